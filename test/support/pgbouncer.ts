import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { promises as fs } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { chownToPostgres } from './global-setup.ts';

export type PoolMode = 'session' | 'transaction' | 'statement';

export interface Bouncer {
  /** The same database as `serverUrl`, through the pooler (contains the password: do not print it). */
  readonly url: string;
  stop(): Promise<void>;
}

/** Where Debian's pgbouncer is, or null (the test then says why it is skipped). */
export function pgbouncerBinary(): string | null {
  for (const p of ['/usr/sbin/pgbouncer', '/usr/bin/pgbouncer']) if (spawnSync('test', ['-x', p]).status === 0) return p;
  return null;
}

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.once('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as net.AddressInfo;
      srv.close(() => resolve(port));
    });
  });
}

/**
 * Starts a pgbouncer of the test's own (own config, port, pid file and logs in a temp dir; never
 * the system service) in front of the server of `serverUrl`, in the given pool mode, with `extra`
 * lines for its [pgbouncer] section. As root it runs as `postgres`, since pgbouncer refuses root.
 */
export async function startPgbouncer(serverUrl: string, mode: PoolMode, extra: readonly string[] = []): Promise<Bouncer> {
  const bin = pgbouncerBinary();
  if (!bin) throw new Error('pgbouncer is not installed (apt-get install -y pgbouncer)');
  const server = new URL(serverUrl);
  const user = decodeURIComponent(server.username);
  const password = decodeURIComponent(server.password);
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), `idem-pgbouncer-${mode}-`));
  const port = await freePort();
  await fs.writeFile(path.join(dir, 'users.txt'), `"${user}" "${password}"\n`, { mode: 0o600 });
  await fs.writeFile(
    path.join(dir, 'pgbouncer.ini'),
    [
      '[databases]',
      `* = host=${server.hostname} port=${server.port}`,
      '[pgbouncer]',
      'listen_addr = 127.0.0.1',
      `listen_port = ${port}`,
      'unix_socket_dir =',
      'auth_type = scram-sha-256',
      `auth_file = ${dir}/users.txt`,
      `pool_mode = ${mode}`,
      'default_pool_size = 20',
      'max_client_conn = 200',
      `logfile = ${dir}/pgbouncer.log`,
      `pidfile = ${dir}/pgbouncer.pid`,
      'ignore_startup_parameters = extra_float_digits,options',
      ...extra,
      '',
    ].join('\n'),
  );
  if (process.getuid?.() === 0) {
    await chownToPostgres(dir);
    for (const f of ['users.txt', 'pgbouncer.ini']) await chownToPostgres(path.join(dir, f));
  }
  const argv = process.getuid?.() === 0 ? ['runuser', ['-u', 'postgres', '--', bin, path.join(dir, 'pgbouncer.ini')]] as const : [bin, [path.join(dir, 'pgbouncer.ini')]] as const;
  const child: ChildProcess = spawn(argv[0], [...argv[1]], { stdio: ['ignore', 'ignore', 'pipe'] });
  let stderr = '';
  child.stderr?.on('data', (d: Buffer) => (stderr += d.toString()));
  const deadline = Date.now() + 10_000;
  for (;;) {
    const up = await new Promise<boolean>((resolve) => {
      const s = net.connect(port, '127.0.0.1', () => {
        s.destroy();
        resolve(true);
      });
      s.on('error', () => resolve(false));
    });
    if (up) break;
    if (child.exitCode !== null || Date.now() > deadline) {
      child.kill('SIGKILL');
      const log = await fs.readFile(path.join(dir, 'pgbouncer.log'), 'utf8').catch(() => '');
      throw new Error(`pgbouncer did not start: ${stderr}${log}`.slice(0, 2000));
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  const url = new URL(serverUrl);
  url.port = String(port);
  return {
    url: url.toString(),
    async stop() {
      child.kill('SIGTERM');
      await new Promise<void>((resolve) => (child.exitCode !== null ? resolve() : child.once('exit', () => resolve())));
      await fs.rm(dir, { recursive: true, force: true });
    },
  };
}
