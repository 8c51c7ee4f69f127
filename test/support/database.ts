import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { afterAll, beforeAll, inject } from 'vitest';
import { Runner, type RunnerOptions } from '../../src/runner.ts';
import { createFixtureTables } from '../fixtures/tables.ts';

export interface TestDatabase {
  /** Connection URL of the fresh database (contains the password: do not print it). */
  readonly url: string;
  /** Disconnects whatever is left and drops the database; idempotent. */
  drop(): Promise<void>;
}

/**
 * Creates an empty database on the test server, one per test file, so files running in parallel
 * never see each other's rows, locks or schemas.
 *
 * @example
 * let db: TestDatabase;
 * beforeAll(async () => { db = await createTestDatabase(); });
 * afterAll(() => db.drop());
 */
export async function createTestDatabase(): Promise<TestDatabase> {
  const adminUrl = inject('adminUrl');
  const name = `idem_test_${randomBytes(6).toString('hex')}`;
  await withAdmin(adminUrl, (c) => c.query(`create database ${name}`));
  const url = new URL(adminUrl);
  url.pathname = `/${name}`;
  let dropped: Promise<void> | undefined;
  return {
    url: url.toString(),
    // WITH (FORCE) terminates backends a failed test left behind, which would otherwise block the
    // drop. Sessions a file's afterAll just ended may still be there (pool.end() resolves once it
    // has asked its clients to end, not once they have): terminated then, such a client emits the
    // 57P01 on a pool that no longer listens, an uncaught error in the test process (CI, once).
    // So the drop first waits (at most 3 s) for the database to have no session left.
    drop: () =>
      (dropped ??= withAdmin(adminUrl, async (c) => {
        for (let i = 0; i < 60; i++) {
          const { rows } = await c.query<{ n: number }>('select count(*)::int as n from pg_stat_activity where datname = $1', [name]);
          if (rows[0]!.n === 0) break;
          await new Promise((resolve) => setTimeout(resolve, 50));
        }
        await c.query(`drop database if exists ${name} with (force)`);
      })),
  };
}

async function withAdmin(adminUrl: string, fn: (client: pg.Client) => Promise<unknown>): Promise<void> {
  const client = new pg.Client({ connectionString: adminUrl });
  await client.connect();
  try {
    await fn(client);
  } finally {
    await client.end();
  }
}

export interface UseTestDatabaseOptions {
  /** Create the fixture jobs' tables (test/fixtures/tables.ts). Defaults to `false`. */
  readonly fixtureTables?: boolean;
  /**
   * File-specific set-up (extra tables, rows) that runs after the fixture tables and before any
   * Runner connects. Defaults to none.
   */
  readonly prepare?: (url: string) => Promise<unknown>;
  /**
   * Create idem's own schema up front (a Runner connects and closes again), so tests that compare
   * "before" and "after" see idem's real tables from the first test on. Implied by `runner`.
   * Defaults to `false`.
   */
  readonly idemSchema?: boolean;
  /**
   * Keep one in-process Runner connected for the whole file (`true`, or the options besides
   * `connectionString` to connect it with); it is closed before the database drops. Defaults to `false`.
   */
  readonly runner?: boolean | Omit<RunnerOptions, 'connectionString'>;
}

/** What {@link useTestDatabase} set up; each getter throws when read before its beforeAll ran. */
export interface UsedTestDatabase {
  readonly database: TestDatabase;
  /** Connection URL of the file's database (contains the password: do not print it). */
  readonly url: string;
  /** The file's Runner; only with the `runner` option. */
  readonly runner: Runner;
}

/**
 * Gives the calling test file (or describe block) a database of its own: registers a beforeAll
 * that creates it (then the fixture tables, `prepare`, idem's schema and the Runner, in that order)
 * and an afterAll that closes the Runner and drops the database.
 *
 * vitest runs after-hooks in reverse order of registration (`sequence.hooks: 'stack'`, pinned in
 * vitest.config.ts), so an afterAll the file registers after this call (killing leftover child
 * processes, closing a server) runs while the Runner and the database are still there; a
 * beforeAll registered after it runs after the database is ready.
 *
 * @example
 * const testDb = useTestDatabase({ fixtureTables: true, runner: true });
 * let url: string;
 * let runner: Runner;
 * beforeAll(() => {
 *   ({ url, runner } = testDb);
 * });
 * afterAll(killLeftovers);
 */
export function useTestDatabase(options: UseTestDatabaseOptions = {}): UsedTestDatabase {
  let database: TestDatabase | undefined;
  let runner: Runner | undefined;
  beforeAll(async () => {
    database = await createTestDatabase();
    if (options.fixtureTables) await createFixtureTables(database.url);
    await options.prepare?.(database.url);
    if (options.runner) {
      runner = await Runner.connect({ ...(options.runner === true ? {} : options.runner), connectionString: database.url });
    } else if (options.idemSchema) {
      await (await Runner.connect({ connectionString: database.url })).close();
    }
  });
  afterAll(async () => {
    await runner?.close();
    await database?.drop();
  });
  const ready = <T>(value: T | undefined, what: string): T => {
    if (value === undefined) {
      throw new Error(`useTestDatabase: ${what} read before its beforeAll ran${what === 'runner' && !options.runner ? ' (pass { runner: true } to get one)' : ''}; read it inside a hook or a test`);
    }
    return value;
  };
  return {
    get database() {
      return ready(database, 'database');
    },
    get url() {
      return ready(database, 'url').url;
    },
    get runner() {
      return ready(runner, 'runner');
    },
  };
}
