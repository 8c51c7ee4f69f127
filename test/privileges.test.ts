import { randomBytes } from 'node:crypto';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { inject } from 'vitest';
import { createFixtureTables } from './fixtures/tables.ts';
import { FIXTURE_DIRS, FIXTURE_JOBS, holdGate, killLeftovers, lines, lockWaiters, query, runCli, spawnCli, waitFor, workCounts, type CliResult } from './support/cli.ts';
import { createTestDatabase, type TestDatabase } from './support/database.ts';

// A production role often may not CREATE in the database. idem then says what to grant, and a role
// with exactly the grants the README documents can run jobs.

let database: TestDatabase;
/** The database's superuser URL: the "owner" who may create idem's schema. */
let ownerUrl: string;
/** The same database as a role with no privileges on it beyond what PUBLIC has. */
let roleUrl: string;
let role: string;
let dbName: string;

beforeAll(async () => {
  database = await createTestDatabase();
  ownerUrl = database.url;
  dbName = new URL(ownerUrl).pathname.slice(1);
  await createFixtureTables(ownerUrl);
  role = `idem_jobs_${randomBytes(4).toString('hex')}`;
  const password = randomBytes(12).toString('hex');
  await query(ownerUrl, `create role ${role} login password '${password}'`);
  // What the fixture jobs' own SQL needs: that is the application's business, not idem's.
  await query(ownerUrl, `grant select, insert, update, delete on all tables in schema public to ${role}; grant usage on all sequences in schema public to ${role}`);
  const u = new URL(ownerUrl);
  u.username = role;
  u.password = password;
  roleUrl = u.toString();
});

afterAll(async () => {
  await killLeftovers();
  await database?.drop();
  // Roles are cluster-wide: drop it once its database (and the grants in it) is gone.
  if (role) await query(inject('adminUrl'), `drop role if exists ${role}`);
});

const asRole = (args: string[]) => runCli([...FIXTURE_DIRS, ...args], { url: roleUrl });

/** The command's one stderr line, its exit code `code` and nothing on stdout (or, with --json, the one error object). */
function oneLine(r: CliResult, code: number, json?: Record<string, unknown>): string {
  expect({ code: r.code, stdout: json ? JSON.parse(r.stdout) : r.stdout, lines: lines(r.stderr).length }, r.stderr).toEqual({ code, stdout: json ? expect.objectContaining(json) : '', lines: 1 });
  return r.stderr.trimEnd();
}

const schemaExists = async () => (await query(ownerUrl, `select to_regnamespace('idem') is not null as e`))[0].e as boolean;

/** The grants README.md documents, for our role (the test runs exactly what users are told to run). */
async function documentedGrants(): Promise<string> {
  const readme = await readFile(new URL('../README.md', import.meta.url), 'utf8');
  const section = readme.slice(readme.indexOf('### Database privileges'));
  const block = /```sql\n([\s\S]*?)```/.exec(section)?.[1];
  expect(block, 'README has a sql block under "### Database privileges"').toContain('GRANT');
  return block!.replaceAll('app_jobs', role);
}

// One role's life, in order: no grants, the owner creates the schema, the README's grants, an idem
// upgrade, a grant taken back. Each test is a stage of it, so this one suite keeps its order under
// the shuffled CI run (every other suite's tests set up what they read).
describe('a role without CREATE on the database', { shuffle: false }, () => {
  it('is refused with what to grant, before anything is written', async () => {
    const r = await asRole(['run', 'counted', '--params', '{"chunks":2}', '--key', 'weak']);
    expect(oneLine(r, 2)).toBe(
      `idem: error: role ${role} may not create the runner schema "idem" (permission denied for database ${dbName}): GRANT CREATE ON DATABASE ${dbName} TO ${role}, ` +
        `or let the database owner run idem migrate once (it creates the schema) and then GRANT USAGE ON SCHEMA idem TO ${role}; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA idem TO ${role} (see README, Database privileges)`,
    );
    expect(r.stderr).not.toContain('migration unknown');
    expect(await schemaExists()).toBe(false);
    expect(await workCounts(ownerUrl, 'weak')).toEqual(new Map());
  });

  it('once the owner created the schema, is refused until granted, naming the grants', async () => {
    // As the README says: the owner runs idem migrate once (with no migrations of its own here).
    // (idem status did it too until reading stopped creating anything.)
    const none = await mkdtemp(path.join(os.tmpdir(), 'idem-no-migrations-'));
    const owner = await runCli(['--jobs-dir', FIXTURE_JOBS, '--migrations-dir', none, 'migrate'], { url: ownerUrl });
    await rm(none, { recursive: true, force: true });
    expect(owner.code, owner.stderr).toBe(0);
    expect(await schemaExists()).toBe(true);

    const r = await asRole(['run', 'counted', '--params', '{"chunks":2}', '--key', 'weak']);
    expect(oneLine(r, 2)).toBe(
      `idem: error: role ${role} may not use the runner schema "idem" (permission denied for schema idem): as the schema's owner, ` +
        `GRANT USAGE ON SCHEMA idem TO ${role}; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA idem TO ${role} (see README, Database privileges)`,
    );
    expect(await query(ownerUrl, 'select * from idem.runs')).toEqual([]);
  });

  it('with exactly the README grants runs, resumes, shows, resets and prunes jobs', async () => {
    await query(ownerUrl, await documentedGrants());
    const run = await asRole(['run', 'counted', '--params', '{"chunks":3}', '--key', 'weak']);
    expect(run.code, run.stderr).toBe(0);
    expect(run.stdout).toMatch(/^job "counted" succeeded: 5 chunks in 3 steps, 5 executed now/);
    expect(await workCounts(ownerUrl, 'weak')).toEqual(new Map([['c0001', 1], ['c0002', 1], ['c0003', 1]]));

    // A failed run resumes under the same role (update paths, retries, the fenced marker).
    await query(ownerUrl, `insert into fail_chunks (chunk_key) values ('c0002')`);
    expect((await asRole(['run', 'counted', '--params', '{"chunks":3}', '--key', 'weak-2'])).code).toBe(1);
    await query(ownerUrl, `delete from fail_chunks`);
    const resumed = await asRole(['run', 'counted', '--params', '{"chunks":3}', '--key', 'weak-2', '--json']);
    expect(resumed.code, resumed.stderr).toBe(0);
    expect(JSON.parse(resumed.stdout)).toMatchObject({ status: 'succeeded', attempt: 2 });

    const [status, list] = await Promise.all([asRole(['status', 'counted', '--json']), asRole(['list', '--json'])]);
    expect(status.code, status.stderr).toBe(0);
    expect(JSON.parse(status.stdout).map((r: { runKey: string }) => r.runKey).sort()).toEqual(['weak', 'weak-2']);
    expect(list.code, list.stderr).toBe(0);

    const reset = await asRole(['reset', 'counted', '--key', 'weak']);
    expect(reset.code, reset.stderr).toBe(0);
    const prune = await asRole(['prune', '--older-than', '0s', '--json']);
    expect(prune.code, prune.stderr).toBe(0);
    expect(await query(ownerUrl, `select run_key from idem.runs where job = 'counted'`)).toEqual([]);
  });

  it('after an idem upgrade that adds to the schema, says the owner must run it once', async () => {
    // As if this idem were newer than the schema: its last runner migration is not recorded.
    const [last] = await query(ownerUrl, `delete from idem.idem_migration where name = (select max(name) from idem.idem_migration) returning *`);
    try {
      const r = await asRole(['run', 'counted', '--params', '{"chunks":2}', '--key', 'weak-upgrade']);
      // The reason is PostgreSQL's own, and depends on what the newest migration does: an ALTER
      // TABLE or FUNCTION ("must be owner of table …") or a CREATE TABLE ("permission denied for
      // schema idem").
      const reason = /\((must be owner of (table|function) [\w.]+|permission denied for schema idem)\)/.source;
      expect(oneLine(r, 2)).toMatch(
        new RegExp(
          `^${escape(`idem: error: role ${role} may not upgrade the runner schema "idem" to this idem's version `)}${reason}${escape(
            `: let the schema's owner run idem migrate once (it upgrades the schema), then GRANT USAGE ON SCHEMA idem TO ${role}; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA idem TO ${role} (see README, Database privileges)`,
          )}$`,
        ),
      );
      expect(await query(ownerUrl, `select * from idem.runs where run_key = 'weak-upgrade'`)).toEqual([]);
    } finally {
      await query(ownerUrl, `insert into idem.idem_migration (name, timestamp) values ($1, $2)`, [last.name, last.timestamp]);
    }
  });

  it('a grant taken back is named before anything is written', async () => {
    await query(ownerUrl, `revoke delete on idem.chunks from ${role}`);
    try {
      const r = await asRole(['run', 'counted', '--params', '{"chunks":2}', '--key', 'weak-3']);
      expect(oneLine(r, 2)).toBe(
        `idem: error: role ${role} may not use the runner schema "idem" (no DELETE on idem.chunks): as the schema's owner, ` +
          `GRANT USAGE ON SCHEMA idem TO ${role}; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA idem TO ${role} (see README, Database privileges)`,
      );
      expect(await query(ownerUrl, `select * from idem.runs where run_key = 'weak-3'`)).toEqual([]);
    } finally {
      await query(ownerUrl, `grant delete on idem.chunks to ${role}`);
    }
  });

  it("a permission error on the job's own table stays the job's failure (exit 1, run failed)", async () => {
    await query(ownerUrl, `revoke insert on work_log from ${role}`);
    try {
      const r = await asRole(['--log-level', 'error', 'run', 'counted', '--params', '{"chunks":1}', '--key', 'weak-job-table']);
      expect(r.code, r.stderr).toBe(1);
      expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([expect.stringMatching(/^idem: error: job "counted" failed in step "\w+".* permission denied for table work_log; /)]);
      expect(await query(ownerUrl, `select status, error->>'message' as message from idem.runs where run_key = 'weak-job-table'`)).toEqual([{ status: 'failed', message: 'permission denied for table work_log' }]);
    } finally {
      await query(ownerUrl, `grant insert on work_log to ${role}`);
    }
  });

  for (const table of ['chunks', 'runs']) {
    it(`a grant taken back mid-run (UPDATE on idem.${table}) stops the worker with the same line as at connect time (exit 2), not a failed run`, async () => {
      // Black-box round 15 (B3): REVOKE UPDATE ON idem.chunks while a run went on failed the run
      // ("job failed in step (runner) … permission denied for table chunks", exit 1), blaming the job.
      const key = `weak-revoke-${table}`;
      const gate = await holdGate(ownerUrl, key);
      const child = spawnCli([...FIXTURE_DIRS, '--log-level', 'error', 'run', 'counted', '--params', JSON.stringify({ chunks: 3, gate: key }), '--key', key, '--json'], { url: roleUrl, timeoutMs: 40_000 });
      let r: CliResult;
      try {
        await waitFor(async () => (await lockWaiters(ownerUrl, 'idem')) > 0, 'a chunk waiting on the gate');
        await query(ownerUrl, `revoke update on idem.${table} from ${role}`);
        await gate.release();
        r = await child.done;
      } finally {
        await gate.release();
        await query(ownerUrl, `grant update on idem.${table} to ${role}`);
      }
      // With --json, its own code, for alert routing (black-box round 18, B10-5: it was idem.databaseUnavailable).
      expect(oneLine(r!, 2, { status: 'error', exitCode: 2, code: 'idem.insufficientPrivilege' })).toBe(
        `idem: error: role ${role} may not use the runner schema "idem" (no UPDATE on idem.${table}): as the schema's owner, ` +
          `GRANT USAGE ON SCHEMA idem TO ${role}; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA idem TO ${role} (see README, Database privileges)`,
      );
      const [run] = await query(ownerUrl, `select status, error from idem.runs where run_key = $1`, [key]);
      // Not failed: with UPDATE on idem.runs taken back idem cannot record it interrupted either,
      // and the run is left running under no lock (idem status: crashed), as a killed worker leaves it.
      expect(run).toEqual({ status: table === 'runs' ? 'running' : 'interrupted', error: null });
      // Granted back, the same command resumes it.
      const again = await asRole(['run', 'counted', '--params', JSON.stringify({ chunks: 3, gate: key }), '--key', key]);
      expect(again.code, again.stderr).toBe(0);
    });
  }
});

/** A string as a literal in a RegExp. */
function escape(text: string): string {
  return text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
}

// A monitoring role may read idem's tables and nothing more: status and list work for it, and a
// command that writes names exactly the privileges it lacks. A database of its own: the suite above
// starts before idem's schema exists.
describe('a schema made beforehand by the DBA, owned by a role without CREATE on the database', () => {
  it('the first run creates idem\'s tables in it (no CREATE SCHEMA asked of the database)', async () => {
    // Review of this stop (H3): the first migration, now one transaction, always ran CREATE SCHEMA
    // IF NOT EXISTS, which PostgreSQL checks against CREATE on the database before it looks at IF
    // NOT EXISTS: "permission denied for database", where the least-privilege set-up had worked.
    const schema = `idem_pre_${randomBytes(3).toString('hex')}`;
    await query(ownerUrl, `create schema ${schema} authorization ${role}`);
    const r = await runCli([...FIXTURE_DIRS, '--schema', schema, 'run', 'counted', '--params', '{"chunks":2}', '--key', 'pre-made'], { url: roleUrl });
    expect(r.code, r.stderr).toBe(0);
    expect(await query(ownerUrl, `select status from ${schema}.runs where run_key = 'pre-made'`)).toEqual([{ status: 'succeeded' }]);
  });
});

describe('a read-only role (USAGE on the schema, SELECT on its tables)', () => {
  let db: TestDatabase;
  const reader = `idem_read_${randomBytes(4).toString('hex')}`;
  let readerUrl: string;
  beforeAll(async () => {
    db = await createTestDatabase();
    await createFixtureTables(db.url);
    const owner = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'seen'], { url: db.url });
    expect(owner.code, owner.stderr).toBe(0);
    const password = randomBytes(12).toString('hex');
    await query(db.url, `create role ${reader} login password '${password}'; grant usage on schema idem to ${reader}; grant select on all tables in schema idem to ${reader}`);
    const u = new URL(db.url);
    u.username = reader;
    u.password = password;
    readerUrl = u.toString();
  });
  afterAll(async () => {
    await db?.drop();
    await query(inject('adminUrl'), `drop role if exists ${reader}`);
  });

  it('runs idem status and idem list, and is told the exact privileges a run lacks', async () => {
    const asReader = (args: string[]) => runCli([...FIXTURE_DIRS, ...args], { url: readerUrl });
    const [status, list, run] = await Promise.all([asReader(['status', 'counted', '--json']), asReader(['list']), asReader(['run', 'counted', '--params', '{"chunks":1}', '--key', 'unseen'])]);
    expect(status.code, status.stderr).toBe(0);
    expect(JSON.parse(status.stdout).map((r: { runKey: string }) => r.runKey)).toEqual(['seen']);
    expect(list.code, list.stderr).toBe(0);
    expect(list.stdout).toContain('counted');
    expect(oneLine(run, 2)).toMatch(new RegExp(`^idem: error: role ${reader} may not use the runner schema "idem" \\(no INSERT, UPDATE or DELETE on idem\\.\\w+(, idem\\.\\w+)*\\): `));
    expect(run.stderr).toContain('idem.runs');
    expect(await query(db.url, `select run_key from idem.runs`)).toEqual([{ run_key: 'seen' }]);
  });

  it('on a schema older than this idem, is told the owner must upgrade it, and the read grants it needs then (not write grants)', async () => {
    // Black-box round 13: status as a monitoring role on an older schema advised GRANT SELECT,
    // INSERT, UPDATE, DELETE to it.
    const [last] = await query(db.url, `delete from idem.idem_migration where name = (select max(name) from idem.idem_migration) returning *`);
    try {
      const r = await runCli([...FIXTURE_DIRS, 'status', 'counted'], { url: readerUrl });
      const line = oneLine(r, 2);
      expect(line).toMatch(new RegExp(`^idem: error: role ${reader} may not upgrade the runner schema "idem" to this idem's version \\(.+\\): let the schema's owner run idem migrate once \\(it upgrades the schema\\), then GRANT USAGE ON SCHEMA idem TO ${reader}; GRANT SELECT ON ALL TABLES IN SCHEMA idem TO ${reader} \\(see README, Database privileges\\)$`));
    } finally {
      await query(db.url, `insert into idem.idem_migration (name, timestamp) values ($1, $2)`, [last.name, last.timestamp]);
    }
  });
});
