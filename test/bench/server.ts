import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { startEmbeddedPostgres } from '../../src/embedded-postgres.ts';

/** The database every benchmark works in: fresh, and dropped (with its server, if embedded) at the end. */
export interface BenchServer {
  /** URL of the fresh bench database; contains the password, never print it. */
  readonly url: string;
  /** `server_version` of the server. */
  readonly version: string;
  /** `embedded` or `DATABASE_URL`. */
  readonly origin: 'embedded' | 'DATABASE_URL';
  /** Server settings that decide commit cost, reported next to the results. */
  readonly settings: Readonly<Record<string, string>>;
  /** Drops the database and stops an embedded server. Idempotent. */
  close(): Promise<void>;
}

/** shared_buffers of the embedded bench server (see openBenchServer). */
const EMBEDDED_SHARED_BUFFERS = '2GB';
// huge_pages_status (PostgreSQL 17+; "n/a" before): with 4 kB pages on a VM, the same 1 M-row UPDATE
// took 4.2 to 7.5 s of server CPU from one turn to the next; with huge pages 3.7 to 3.9 s.
const REPORTED_SETTINGS = ['synchronous_commit', 'fsync', 'wal_sync_method', 'shared_buffers', 'max_wal_size', 'checkpoint_timeout', 'huge_pages_status'];

/**
 * DATABASE_URL when set, else an embedded PostgreSQL in a fresh temp dir (owned by `postgres`
 * when we are root, since PostgreSQL refuses to run as root). Either way the benchmarks get a
 * database of their own, so nothing of the user's is touched and idem's schema starts empty.
 */
export async function openBenchServer(log: (msg: string) => void): Promise<BenchServer> {
  let adminUrl = process.env.DATABASE_URL;
  let stopServer = async () => {};
  const origin = adminUrl ? 'DATABASE_URL' : 'embedded';
  if (!adminUrl) {
    const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'idem-bench-'));
    if (process.getuid?.() === 0) {
      const id = (flag: string) => Number(execFileSync('id', [flag, 'postgres'], { encoding: 'utf8' }).trim());
      await fs.chown(dir, id('-u'), id('-g'));
    }
    try {
      const dataDir = path.join(dir, 'pg');
      const onLog = (msg: string) => log(`[bench database] ${msg}`);
      let server = await startEmbeddedPostgres({ dataDir, onLog });
      // The default 128 MB of shared_buffers is smaller than a 1 M-row table with its updated
      // versions: every contender would then write out dirty buffers mid-run, and that disk noise
      // swamped the differences measured (2× between identical runs). Commit durability is untouched.
      await withClient(server.url, (c) => c.query(`alter system set shared_buffers = '${EMBEDDED_SHARED_BUFFERS}'`));
      await server.stop();
      server = await startEmbeddedPostgres({ dataDir, onLog });
      adminUrl = server.url;
      stopServer = async () => {
        await server.stop().catch((err: unknown) => log(`could not stop the embedded server: ${(err as Error).message}`));
        await fs.rm(dir, { recursive: true, force: true });
      };
    } catch (err) {
      await fs.rm(dir, { recursive: true, force: true });
      throw err;
    }
  }
  const name = `idem_bench_${randomBytes(4).toString('hex')}`;
  const admin = (text: string) => withClient(adminUrl!, (c) => c.query(text));
  try {
    await admin(`create database ${name}`);
  } catch (err) {
    await stopServer();
    throw new Error(`cannot create the bench database (${(err as Error).message}): DATABASE_URL must name a role with CREATEDB`, { cause: err });
  }
  const url = new URL(adminUrl);
  url.pathname = `/${name}`;
  const c = new pg.Client({ connectionString: url.toString() });
  await c.connect();
  const { rows } = await c.query<{ name: string; setting: string }>(
    `select name, coalesce(current_setting(name, true), 'n/a') as setting from unnest($1::text[]) as name`, [['server_version', ...REPORTED_SETTINGS]]);
  await c.end();
  const settings = Object.fromEntries(rows.map((r) => [r.name, r.setting]));
  const version = settings.server_version ?? '?';
  delete settings.server_version;
  let closed: Promise<void> | undefined;
  return {
    url: url.toString(),
    version,
    origin,
    settings,
    close: () => (closed ??= (async () => {
      await admin(`drop database if exists ${name} with (force)`).catch((err: unknown) => log(`could not drop ${name}: ${(err as Error).message}`));
      await stopServer();
    })()),
  };
}

async function withClient<R>(url: string, fn: (c: pg.Client) => Promise<R>): Promise<R> {
  const c = new pg.Client({ connectionString: url });
  await c.connect();
  try {
    return await fn(c);
  } finally {
    await c.end();
  }
}
