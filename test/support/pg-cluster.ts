import { execFileSync, spawn } from 'node:child_process';
import { existsSync, readdirSync } from 'node:fs';
import { appendFile, chown, mkdtemp, rm } from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';

/**
 * A throw-away PostgreSQL cluster of the system's binaries (Debian's /usr/lib/postgresql/N/bin),
 * for the tests that need what the shared test server cannot give: server settings that need a
 * restart (archive_mode), a fast autovacuum, and a real streaming standby made with pg_basebackup
 * (the embedded package ships no pg_basebackup).
 */
export interface Cluster {
  readonly url: string;
  readonly port: number;
  readonly dataDir: string;
  stop(): Promise<void>;
}

/** The newest system PostgreSQL bin directory with pg_basebackup, or null. */
export function systemPgBin(): string | null {
  const root = '/usr/lib/postgresql';
  if (!existsSync(root)) return null;
  const versions = readdirSync(root).filter((v) => /^\d+$/.test(v)).sort((a, b) => Number(b) - Number(a));
  for (const v of versions) {
    const bin = path.join(root, v, 'bin');
    if (['initdb', 'pg_ctl', 'postgres', 'pg_basebackup'].every((b) => existsSync(path.join(bin, b)))) return bin;
  }
  return null;
}

const asRoot = process.getuid?.() === 0;
const postgresIds = () =>
  asRoot ? { uid: Number(execFileSync('id', ['-u', 'postgres'], { encoding: 'utf8' })), gid: Number(execFileSync('id', ['-g', 'postgres'], { encoding: 'utf8' })) } : {};

function run(bin: string, args: string[], cwd: string): Promise<void> {
  return new Promise((resolve, reject) => {
    // PostgreSQL refuses to run as root: as root, run it as the postgres user.
    const child = spawn(bin, args, { cwd, ...postgresIds(), stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    child.on('error', reject);
    child.on('close', (code) => (code === 0 ? resolve() : reject(new Error(`${path.basename(bin)} ${args.join(' ')} exited ${code}: ${out.slice(-2000)}`))));
  });
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as net.AddressInfo;
      srv.close(() => resolve(port));
    });
  });
}

/** A directory the postgres user owns, under the system temp dir. */
export async function clusterDir(prefix: string): Promise<string> {
  const dir = await mkdtemp(path.join(os.tmpdir(), prefix));
  if (asRoot) {
    const { uid, gid } = postgresIds() as { uid: number; gid: number };
    await chown(dir, uid, gid);
  }
  return dir;
}

async function start(bin: string, dataDir: string, port: number, settings: readonly string[]): Promise<Cluster> {
  await appendFile(dataDir + '/postgresql.conf', ['', `port = ${port}`, "listen_addresses = '127.0.0.1'", `unix_socket_directories = '${dataDir}'`, ...settings, ''].join('\n'));
  await run(path.join(bin, 'pg_ctl'), ['-D', dataDir, '-l', path.join(dataDir, 'server.log'), '-w', '-t', '60', 'start'], dataDir);
  let stopped: Promise<void> | undefined;
  return {
    url: `postgres://postgres@127.0.0.1:${port}/postgres`,
    port,
    dataDir,
    stop: () => (stopped ??= run(path.join(bin, 'pg_ctl'), ['-D', dataDir, '-m', 'immediate', '-w', 'stop'], dataDir).catch(() => {})),
  };
}

/** initdb (trust auth on loopback: a test cluster only) and start, with extra postgresql.conf lines. */
export async function startPrimary(bin: string, dir: string, settings: readonly string[] = []): Promise<Cluster> {
  const dataDir = path.join(dir, 'primary');
  await run(path.join(bin, 'initdb'), ['-D', dataDir, '-U', 'postgres', '--auth=trust', '--no-sync'], dir);
  return start(bin, dataDir, await freePort(), settings);
}

/** A streaming standby of `primary`, made with pg_basebackup -R (standby.signal and primary_conninfo). */
export async function startStandby(bin: string, dir: string, primary: Cluster, settings: readonly string[] = []): Promise<Cluster> {
  const dataDir = path.join(dir, 'standby');
  await run(path.join(bin, 'pg_basebackup'), ['-h', '127.0.0.1', '-p', String(primary.port), '-U', 'postgres', '-D', dataDir, '-R', '-X', 'stream', '--no-sync'], dir);
  return start(bin, dataDir, await freePort(), settings);
}

export async function removeDir(dir: string): Promise<void> {
  await rm(dir, { recursive: true, force: true });
}
