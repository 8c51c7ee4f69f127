import { execFileSync } from 'node:child_process';
import { promises as fs } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import type { TestProject } from 'vitest/node';
import { startEmbeddedPostgres } from '../../src/embedded-postgres.ts';

declare module 'vitest' {
  export interface ProvidedContext {
    /** Superuser URL of the test server; test files create their own database through it. */
    adminUrl: string;
  }
}

/**
 * Gives the test run one real PostgreSQL: DATABASE_URL if set (CI with a service container),
 * otherwise a dedicated embedded server in a fresh temp dir, stopped and deleted afterwards.
 */
export default async function setup(project: TestProject): Promise<(() => Promise<void>) | undefined> {
  if (process.env.DATABASE_URL) {
    project.provide('adminUrl', process.env.DATABASE_URL);
    return undefined;
  }
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'idem-test-'));
  try {
    await chownToPostgres(dir);
    const server = await startEmbeddedPostgres({
      dataDir: path.join(dir, 'pg'),
      onLog: (msg) => console.log(`[test database] ${msg}`),
    });
    await withoutFsync(server.url);
    project.provide('adminUrl', server.url);
    return async () => {
      await server.stop();
      await fs.rm(dir, { recursive: true, force: true });
    };
  } catch (err) {
    await fs.rm(dir, { recursive: true, force: true });
    throw err;
  }
}

/**
 * The suite's own server flushes nothing to disk at COMMIT (`fsync = off`): every chunk, marker and
 * bookkeeping statement of ~900 tests commits, and on this machine an fdatasync cost 0.5-0.65 ms
 * of each commit (3 000 commits: 2.1-2.7 s against 0.7 s). What the tests kill (idem processes,
 * backends, the server with an immediate stop) loses nothing by it: a COMMIT still writes its WAL
 * before it answers (synchronous_commit stays on), into the OS's cache, which only a crash of the
 * machine itself loses. The servers tests start of their own, and the benchmark's, keep fsync on.
 */
async function withoutFsync(url: string): Promise<void> {
  const { default: pg } = await import('pg');
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    await client.query('alter system set fsync = off');
    await client.query('select pg_reload_conf()');
  } finally {
    await client.end();
  }
}

/** mkdtemp makes a 0700 dir; as root, PostgreSQL runs as `postgres`, which must be able to enter it. */
export async function chownToPostgres(dir: string): Promise<void> {
  if (process.getuid?.() !== 0) return;
  const id = (flag: string) => Number(execFileSync('id', [flag, 'postgres'], { encoding: 'utf8' }).trim());
  await fs.chown(dir, id('-u'), id('-g'));
}
