import { randomBytes } from 'node:crypto';
import { afterAll, afterEach, describe, expect, inject, it } from 'vitest';
import { createFixtureTables } from './fixtures/tables.ts';
import { FIXTURE_DIRS, killLeftovers, lines, query, runCli, type CliResult } from './support/cli.ts';
import { createTestDatabase, type TestDatabase } from './support/database.ts';
import { knownMigrationNames } from '../src/schema/runner-migrations.ts';

// The first deploy: a database without idem's runner schema. Only a command that writes runs
// (run, migrate, finalize, serve, cron) creates the schema; one that only looks (a dry run, status,
// list) or acts on runs that cannot exist yet (pause, resume, cancel, reset, prune) creates nothing,
// and a refusal (a read-only database, a statement_timeout) leaves nothing behind either.

const databases: TestDatabase[] = [];
const roles: string[] = [];

afterEach(async () => {
  await killLeftovers();
});

afterAll(async () => {
  for (const db of databases) await db.drop();
  for (const role of roles) await query(inject('adminUrl'), `drop role if exists ${role}`);
});

async function freshDatabase(): Promise<{ url: string; name: string }> {
  const db = await createTestDatabase();
  databases.push(db);
  return { url: db.url, name: new URL(db.url).pathname.slice(1) };
}

/** A session the database's own settings (statement_timeout, read-only) do not apply to. */
const unhindered = (url: string) => {
  const u = new URL(url);
  u.searchParams.set('options', '-c statement_timeout=0 -c default_transaction_read_only=off');
  return u.toString();
};

const idemSchemas = async (url: string) => Number((await query(unhindered(url), `select count(*)::int as n from pg_namespace where nspname = 'idem'`))[0].n);

/** The one `idem: error:` line of a refusal, after its exit code and that stdout holds nothing else. */
function oneLine(r: CliResult, code: number): string {
  expect({ code: r.code, lines: lines(r.stderr).length }, r.stderr).toEqual({ code, lines: 1 });
  return r.stderr.trimEnd();
}

describe('a database without idem schema', () => {
  it('idem run --dry-run reports the run as new, and creates nothing', async () => {
    const { url } = await freshDatabase();
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":2}', '--key', 'k', '--dry-run'], { url });
    expect({ code: r.code, stderr: r.stderr }).toEqual({ code: 0, stderr: '' });
    expect(r.stdout).toBe('dry run: job "counted" run key k is new; steps: prepare, work (chunked), finish; nothing was written\n');
    const json = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":2}', '--key', 'k', '--dry-run', '--json'], { url });
    expect(json.code, json.stderr).toBe(0);
    expect(JSON.parse(json.stdout)).toMatchObject({ status: 'dry-run', runKey: 'k', runId: null, attempt: 0, plan: { state: 'new' } });
    expect(await idemSchemas(url)).toBe(0);
  });

  it('idem run --dry-run works for a role that may not create the schema, and creates nothing', async () => {
    const { url } = await freshDatabase();
    const role = `idem_nocreate_${randomBytes(4).toString('hex')}`;
    roles.push(role);
    const password = randomBytes(12).toString('hex');
    await query(url, `create role ${role} login password '${password}'`);
    const u = new URL(url);
    u.username = role;
    u.password = password;
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":2}', '--key', 'k', '--dry-run'], { url: u.toString() });
    expect({ code: r.code, stderr: r.stderr }).toEqual({ code: 0, stderr: '' });
    expect(r.stdout).toContain('run key k is new');
    expect(await idemSchemas(url)).toBe(0);
  });

  it('pause, resume, cancel and reset say the job has no run; prune removes nothing; none creates the schema', async () => {
    const { url } = await freshDatabase();
    const cli = (args: string[]) => runCli([...FIXTURE_DIRS, ...args], { url });
    const [pause, resume, cancel, pauseKey, reset, prune] = await Promise.all([
      cli(['pause', 'counted']),
      cli(['resume', 'counted']),
      cli(['cancel', 'counted']),
      cli(['pause', 'counted', '--key', 'x']),
      cli(['reset', 'counted', '--key', 'x']),
      cli(['prune', '--older-than', '30d', '--json']),
    ]);
    expect(oneLine(pause, 2)).toBe('idem: error: job "counted" has no run to pause (none is running or pending or failed or interrupted); see idem status counted');
    expect(oneLine(resume, 2)).toMatch(/^idem: error: job "counted" has no run to resume /);
    expect(oneLine(cancel, 2)).toMatch(/^idem: error: job "counted" has no run to cancel /);
    expect(oneLine(pauseKey, 2)).toBe('idem: error: job "counted" has no run with key "x"; see idem status counted for its run keys');
    expect(oneLine(reset, 2)).toBe('idem: error: job "counted" has no run with key "x"; see idem status counted for its run keys');
    expect({ code: prune.code, stderr: prune.stderr }).toEqual({ code: 0, stderr: '' });
    expect(JSON.parse(prune.stdout)).toEqual({ runs: 0, steps: 0, chunks: 0, effects: 0, skipped: 0 });
    expect(await idemSchemas(url)).toBe(0);
  });

  it('with default_transaction_read_only = on, idem run gives the readOnlyDefault refusal and creates nothing', async () => {
    const { url, name } = await freshDatabase();
    await query(url, `alter database ${name} set default_transaction_read_only = on`);
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'k', '--json'], { url });
    const line = oneLine(r, 2);
    expect(line).toBe(
      "idem: error: the role or database sets default_transaction_read_only = on, so idem cannot write its bookkeeping (nothing was written); reset it (ALTER DATABASE … RESET default_transaction_read_only, or ALTER ROLE …) or give idem a role and database it may write",
    );
    expect(JSON.parse(r.stdout)).toMatchObject({ code: 'idem.readOnlyDefault' });
    const migrate = await runCli([...FIXTURE_DIRS, 'migrate'], { url });
    expect(oneLine(migrate, 2)).toBe(line);
    expect(await idemSchemas(url)).toBe(0);
  });

  it('with a statement_timeout too short for the first migration, idem run gives the statementTimeout refusal and leaves nothing behind', async () => {
    const { url, name } = await freshDatabase();
    // Which statement is cancelled depends on the machine's speed: each of these timeouts cancels
    // some statement of the schema's creation (or one before it), and each must leave nothing.
    let refused = 0;
    for (const ms of ['1ms', '3ms', '10ms']) {
      await query(unhindered(url), `alter database ${name} set statement_timeout = '${ms}'`);
      const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'st', '--json'], { url });
      const tables = Number((await query(unhindered(url), `select count(*)::int as n from pg_tables where schemaname = 'idem'`))[0].n);
      if (tables > 0) {
        // Enough for the schema on this machine: made whole, in one go (what the run did next,
        // under that timeout, is not this test's subject).
        expect(tables, r.stderr).toBe(7);
        break;
      }
      const line = oneLine(r, 2);
      expect(line).toMatch(/^idem: error: the database cancelled a statement of idem's at the statement_timeout set for the role or database \(SHOW statement_timeout\): /);
      expect(JSON.parse(r.stdout)).toMatchObject({ code: 'idem.statementTimeout' });
      expect(await idemSchemas(url)).toBe(0);
      refused++;
    }
    expect(refused).toBeGreaterThan(0);
  });

  it('a first migration that fails halfway leaves nothing of idem, and keeps a schema that was there before', async () => {
    const { url } = await freshDatabase();
    // The schema exists (its owner made it for idem), with a type that migration 0002's table
    // collides with: 0001 succeeds, 0002 fails.
    await query(url, `create schema idem; create type idem.effects as enum ('x')`);
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'k'], { url });
    expect(oneLine(r, 2)).toMatch(/^idem: error: could not create or upgrade the runner schema "idem" \(migration 0002_skips_fencing_time_effects_control\): type "effects" already exists$/);
    expect(await idemSchemas(url)).toBe(1);
    expect(await query(url, `select count(*)::int as n from pg_class c join pg_namespace n on n.oid = c.relnamespace where n.nspname = 'idem'`)).toEqual([{ n: 0 }]);
    expect(await query(url, `select typname from pg_type t join pg_namespace n on n.oid = t.typnamespace where n.nspname = 'idem' and typname = 'effects'`)).toEqual([{ typname: 'effects' }]);
  });

  it('pods of a deploy that find the database fresh at once all get the schema, made once', async () => {
    const { url } = await freshDatabase();
    await createFixtureTables(url);
    const runs = await Promise.all(['a', 'b', 'c', 'd'].map((key) => runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', key, '--wait'], { url })));
    for (const r of runs) expect(r.code, r.stderr).toBe(0);
    expect(await query(url, `select count(*)::int as n from idem.idem_migration`)).toEqual([{ n: knownMigrationNames().length }]);
    expect(await query(url, `select run_key, status from idem.runs order by run_key`)).toEqual(['a', 'b', 'c', 'd'].map((run_key) => ({ run_key, status: 'succeeded' })));
  });
});
