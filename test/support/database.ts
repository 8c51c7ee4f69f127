import { randomBytes } from 'node:crypto';
import pg from 'pg';
import { inject } from 'vitest';

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
    // WITH (FORCE) terminates backends a failed test left behind, which would otherwise block the drop.
    drop: () => (dropped ??= withAdmin(adminUrl, (c) => c.query(`drop database if exists ${name} with (force)`))),
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
