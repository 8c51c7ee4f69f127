import { fileURLToPath } from 'node:url';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, keyRange, Runner, sql, StandbyError, type HealthOptions } from '../src/index.ts';
import counted from './fixtures/jobs/counted.ts';
import { createFixtureTables } from './fixtures/tables.ts';
import { FIXTURE_DIRS, killLeftovers, lines, query, runCli, runRow, waitFor, workCounts } from './support/cli.ts';
import { clusterDir, removeDir, startPrimary, startStandby, systemPgBin, type Cluster } from './support/pg-cluster.ts';

/**
 * Health indicators that need a server of their own: a real streaming standby (pg_basebackup),
 * archive_mode (a restart setting) and a one-second autovacuum naptime. .ci/run installs the
 * system PostgreSQL that provides pg_basebackup.
 */
const SCHEDULED_JOBS = fileURLToPath(new URL('./fixtures/scheduled-jobs', import.meta.url));
const bin = systemPgBin();
let dir: string;
let primary: Cluster;
let standby: Cluster;
let runner: Runner;

const FAST: HealthOptions = { probeIntervalMs: 100 };

beforeAll(async () => {
  if (!bin) return;
  dir = await clusterDir('idem-health-');
  primary = await startPrimary(bin, dir, ['wal_level = replica', 'max_wal_senders = 5', 'archive_mode = on', "archive_command = 'true'", 'autovacuum_naptime = 1']);
  standby = await startStandby(bin, dir, primary, ['hot_standby = on', 'wal_receiver_status_interval = 1']);
  await waitFor(async () => (await query(primary.url, `select 1 from pg_stat_replication where state = 'streaming'`)).length === 1, 'the standby to stream');
  await createFixtureTables(primary.url);
  runner = await Runner.connect({ connectionString: primary.url });
}, 120_000);

afterAll(async () => {
  await killLeftovers();
  await runner?.close();
  await standby?.stop();
  await primary?.stop();
  if (dir) await removeDir(dir);
});

describe.skipIf(!bin)('health indicators on a cluster of its own (system PostgreSQL with pg_basebackup)', () => {
  it('pointed at a standby, idem refuses to write with a one-line error naming the fix (exit 2)', async () => {
    await waitFor(async () => (await query(standby.url, `select to_regclass('idem.runs') as t`))[0].t !== null, 'the runner schema to reach the standby');
    const onStandby = await Runner.connect({ connectionString: standby.url });
    try {
      const err = await onStandby.run(counted, { params: { chunks: 2 }, key: 'standby' }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(StandbyError);
      expect(exitCodeOf(err)).toBe(2);
      expect((err as Error).message).toMatch(/^the database is a standby \(in recovery(, \d+ s behind its primary)?\) and cannot take writes; point DATABASE_URL at the primary$/);
    } finally {
      await onStandby.close();
    }
    const cli = await runCli([...FIXTURE_DIRS, '--log-level', 'warn', 'run', 'counted', '--key', 'standby-cli'], { url: standby.url });
    expect(cli.code).toBe(2);
    expect(lines(cli.stderr)).toEqual([expect.stringMatching(/^idem: error: the database is a standby .* point DATABASE_URL at the primary$/)]);
    expect(await query(primary.url, `select run_key from idem.runs where run_key like 'standby%'`)).toEqual([]);
  });

  it('a standby that has replayed all it received is not said to be behind, however long its primary idles', async () => {
    // Black-box round 13: "9 s behind its primary", growing, for a caught-up standby of an idle
    // primary: the delay was now() - pg_last_xact_replay_timestamp(), the age of the last commit.
    await query(primary.url, 'select 1');
    await waitFor(async () => (await query(standby.url, 'select pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn() as caught'))[0].caught, 'the standby to catch up');
    await new Promise((r) => setTimeout(r, 2_500));
    const cli = await runCli([...FIXTURE_DIRS, '--log-level', 'warn', 'pause', 'counted', '--key', 'standby-idle'], { url: standby.url });
    expect(cli.code).toBe(2);
    expect(lines(cli.stderr)).toEqual(['idem: error: the database is a standby (in recovery) and cannot take writes; point DATABASE_URL at the primary']);
  });

  it('pointed at a standby, every command that writes (pause, resume, cancel, reset, prune) refuses with the same line (exit 2), writing nothing; status and list still read', async () => {
    // On the primary: a failed run, a paused run and an old succeeded run, each something the command acts on there.
    await query(primary.url, `insert into fail_chunks (chunk_key) values ('c0002')`);
    try {
      await expect(runner.run(counted, { params: { chunks: 3 }, key: 'sb-failed' })).rejects.toThrow();
    } finally {
      await query(primary.url, 'delete from fail_chunks');
    }
    await runner.run(counted, { params: { chunks: 1 }, key: 'sb-paused' });
    await query(primary.url, `update idem.runs set status = 'paused' where run_key = 'sb-paused'`);
    await runner.run(counted, { params: { chunks: 1 }, key: 'sb-done' });
    await query(primary.url, `update idem.runs set finished_at = now() - interval '2 days' where run_key = 'sb-done'`);
    const rowsOf = () => query(primary.url, `select run_key, status, requested, attempt, updated_at, (select count(*)::int from idem.chunks c where c.run_id = r.id) as chunks from idem.runs r where run_key like 'sb-%' order by run_key`);
    const before = await rowsOf();
    // The standby has replayed all of it.
    await waitFor(async () => (await query(standby.url, `select count(*)::int as n from idem.runs where run_key like 'sb-%'`))[0].n === 3, 'the runs to reach the standby');
    const standbyLine = /^idem: error: the database is a standby \(in recovery(, \d+ s behind its primary)?\) and cannot take writes; point DATABASE_URL at the primary$/;
    for (const args of [
      ['pause', 'counted', '--key', 'sb-failed'],
      ['pause', 'counted'],
      ['cancel', 'counted', '--key', 'sb-failed'],
      ['resume', 'counted', '--key', 'sb-paused'],
      ['reset', 'counted', '--key', 'sb-failed'],
      ['prune', '--older-than', '1d'],
      ['prune', '--older-than', '1d', '--json'],
    ]) {
      const r = await runCli([...FIXTURE_DIRS, '--log-level', 'warn', ...args], { url: standby.url });
      // With --json the refusal is the error object on stdout as well (round 16: it was nothing).
      const stdout = args.includes('--json') ? (JSON.parse(r.stdout) as unknown) : r.stdout;
      const json = { status: 'error', job: null, runKey: null, exitCode: 2, code: 'idem.standby', error: expect.stringMatching(standbyLine.source.replace('^idem: error: ', '^')) };
      expect({ args, code: r.code, stdout, stderr: lines(r.stderr) }).toEqual({ args, code: 2, stdout: args.includes('--json') ? json : '', stderr: [expect.stringMatching(standbyLine)] });
    }
    // The long-running ones refuse at start, rather than fail at every slot or request.
    for (const args of [
      ['--jobs-dir', SCHEDULED_JOBS, '--log-level', 'warn', 'cron'],
      [...FIXTURE_DIRS, '--log-level', 'warn', 'serve', '--port', '0'],
    ]) {
      const r = await runCli(args, { url: standby.url, timeoutMs: 20_000, env: { IDEM_API_TOKEN: 'standby-test-token-0123456789abcdef' } });
      expect({ args, code: r.code, stdout: r.stdout, stderr: lines(r.stderr) }).toEqual({ args, code: 2, stdout: '', stderr: [expect.stringMatching(standbyLine)] });
    }
    expect(await rowsOf()).toEqual(before);
    // The library refuses the same way.
    const onStandby = await Runner.connect({ connectionString: standby.url });
    try {
      for (const op of [() => onStandby.pause('counted', 'sb-failed'), () => onStandby.resume('counted', 'sb-paused'), () => onStandby.cancel('counted'), () => onStandby.reset('counted', 'sb-failed'), () => onStandby.prune(86_400_000)]) {
        const err = await op().catch((e: unknown) => e);
        expect(err).toBeInstanceOf(StandbyError);
        expect(exitCodeOf(err)).toBe(2);
      }
    } finally {
      await onStandby.close();
    }
    // Reading needs no primary.
    const status = await runCli([...FIXTURE_DIRS, '--log-level', 'warn', 'status', 'counted', '--key', 'sb-failed'], { url: standby.url });
    expect({ code: status.code, stderr: status.stderr }).toEqual({ code: 0, stderr: '' });
    expect(status.stdout).toContain('sb-failed');
    const list = await runCli([...FIXTURE_DIRS, '--log-level', 'warn', 'list'], { url: standby.url });
    expect({ code: list.code, stderr: list.stderr }).toEqual({ code: 0, stderr: '' });
    expect(list.stdout).toContain('counted');
  });

  it('a standby lagging in replay pauses the run until it caught up', async () => {
    await query(standby.url, 'select pg_wal_replay_pause()');
    try {
      // WAL keeps coming while replay stands still, so the lag the primary measures grows.
      await waitFor(async () => {
        await query(primary.url, `insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('lag', 'x', 'x', 'x', 0, 0)`);
        const [r] = await query(primary.url, `select extract(epoch from replay_lag)::float8 as lag from pg_stat_replication`);
        return r && r.lag > 1.5;
      }, 'replay lag above 1.5 s', { intervalMs: 200 });
      const running = runner.run(counted, { params: { chunks: 2 }, key: 'lag', health: { ...FAST, replicationLagSeconds: 1 } });
      const pause = await waitFor(async () => (await runRow(primary.url, 'counted', 'lag'))?.health_pause, 'the run to pause for replication lag');
      expect(pause.reason).toMatch(/^replication lag [\d.]+ s > 1 s$/);
      expect(await workCounts(primary.url, 'lag', 'prepare')).toEqual(new Map());
      await query(standby.url, 'select pg_wal_replay_resume()');
      expect(await running).toMatchObject({ status: 'succeeded', executed: 4 });
      expect((await runRow(primary.url, 'counted', 'lag')).health_pause).toBeNull();
    } finally {
      await query(standby.url, 'select pg_wal_replay_resume()').catch(() => {});
    }
  });

  it('WAL segments piling up unarchived pause the run until the archiver caught up', async () => {
    const setArchive = async (command: string) => {
      await query(primary.url, `alter system set archive_command = '${command}'`);
      await query(primary.url, 'select pg_reload_conf()');
    };
    const ready = async () => (await query(primary.url, `select count(*)::int as n from pg_ls_archive_statusdir() where name like '%.ready'`))[0].n as number;
    await setArchive('false');
    try {
      for (let i = 0; i < 4; i++) {
        await query(primary.url, `insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('wal', 'x', 'x', 'x', 0, 0)`);
        await query(primary.url, 'select pg_switch_wal()');
      }
      await waitFor(async () => (await ready()) > 2, 'more than 2 segments waiting for the archiver');
      const running = runner.run(counted, { params: { chunks: 2 }, key: 'wal', health: { ...FAST, walArchivePending: 2, replicationLagSeconds: false } });
      const pause = await waitFor(async () => (await runRow(primary.url, 'counted', 'wal'))?.health_pause, 'the run to pause for unarchived WAL');
      expect(pause.reason).toMatch(/^\d+ WAL segments not archived > 2$/);
      expect(await workCounts(primary.url, 'wal', 'prepare')).toEqual(new Map());
      await setArchive('true');
      await query(primary.url, 'select pg_switch_wal()'); // wakes the archiver
      expect(await running).toMatchObject({ status: 'succeeded', executed: 4 });
      expect(await ready()).toBeLessThanOrEqual(2);
    } finally {
      await setArchive('true');
    }
  });

  it('a role that cannot read the archive status (no pg_monitor) is told once that walArchivePending never pauses the run, and the grant', async () => {
    // Black-box round 15 (B3): as a role with pg_read_all_stats but not pg_monitor, --health
    // walArchivePending=1 with 4 segments waiting ran to the end with no pause and no word at all.
    const role = `idem_wal_${process.pid}`;
    const setArchive = async (command: string) => {
      await query(primary.url, `alter system set archive_command = '${command}'`);
      await query(primary.url, 'select pg_reload_conf()');
    };
    const ready = async () => (await query(primary.url, `select count(*)::int as n from pg_ls_archive_statusdir() where name like '%.ready'`))[0].n as number;
    await query(primary.url, `drop role if exists ${role}; create role ${role} login; grant pg_read_all_stats to ${role}`);
    await query(primary.url, `grant usage on schema idem to ${role}; grant select, insert, update, delete on all tables in schema idem to ${role}`);
    await query(primary.url, `grant select, insert, update, delete on all tables in schema public to ${role}; grant usage on all sequences in schema public to ${role}`);
    const logs: Array<{ msg: string; [k: string]: unknown }> = [];
    const as = new URL(primary.url);
    as.username = role;
    const roleRunner = await Runner.connect({ connectionString: as.toString(), log: pino({ level: 'info' }, { write: (line: string) => void logs.push(JSON.parse(line)) }) });
    await setArchive('false');
    try {
      for (let i = 0; i < 4; i++) {
        await query(primary.url, `insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('wal-role', 'x', 'x', 'x', 0, 0)`);
        await query(primary.url, 'select pg_switch_wal()');
      }
      await waitFor(async () => (await ready()) > 1, 'more than 1 segment waiting for the archiver');
      const out = await roleRunner.run(counted, { params: { chunks: 2 }, key: 'wal-blind', health: { ...FAST, walArchivePending: 1, replicationLagSeconds: false } });
      expect(out).toMatchObject({ status: 'succeeded', executed: 4 });
      expect(logs.filter((l) => /walArchivePending/.test(l.msg)).map((l) => [l.level, l.runKey, l.msg])).toEqual([
        [40, 'wal-blind', `health checks cannot see the WAL archive: role ${role} lacks pg_monitor, so walArchivePending never pauses this run; GRANT pg_monitor TO ${role} (see README, Database privileges)`],
      ]);
      // With the grant the same backlog pauses the run (the warning is not said again).
      await query(primary.url, `grant pg_monitor to ${role}`);
      await roleRunner.close();
      logs.length = 0;
      const seeing = await Runner.connect({ connectionString: as.toString(), log: pino({ level: 'info' }, { write: (line: string) => void logs.push(JSON.parse(line)) }) });
      try {
        const running = seeing.run(counted, { params: { chunks: 2 }, key: 'wal-seeing', health: { ...FAST, walArchivePending: 1, replicationLagSeconds: false } });
        const pause = await waitFor(async () => (await runRow(primary.url, 'counted', 'wal-seeing'))?.health_pause, 'the run to pause for unarchived WAL');
        expect(pause.reason).toMatch(/^\d+ WAL segments not archived > 1$/);
        await setArchive('true');
        await query(primary.url, 'select pg_switch_wal()');
        expect(await running).toMatchObject({ status: 'succeeded', executed: 4 });
        expect(logs.filter((l) => /pg_monitor/.test(l.msg))).toEqual([]);
      } finally {
        await seeing.close();
      }
    } finally {
      await setArchive('true');
      await roleRunner.close();
      await query(primary.url, `drop owned by ${role}; drop role if exists ${role}`).catch(() => {});
    }
  });

  it('autovacuum on a table the step touches pauses it; a step on other tables goes on', async () => {
    // A table autovacuum will pick at once and work on slowly (cost limit 1, 100 ms naps).
    await query(primary.url, `create table vac_target (id bigint primary key, pad text not null) with (autovacuum_vacuum_threshold = 0, autovacuum_vacuum_scale_factor = 0,
      autovacuum_vacuum_cost_delay = 100, autovacuum_vacuum_cost_limit = 1)`);
    await query(primary.url, `insert into vac_target select g, repeat('x', 200) from generate_series(1, 20000) g`);
    await query(primary.url, `delete from vac_target where id > 10`);
    const vacuuming = async () =>
      query(primary.url, `select p.pid from pg_stat_progress_vacuum p join pg_stat_activity a using (pid) where p.relid = 'vac_target'::regclass and a.backend_type = 'autovacuum worker'`);
    await waitFor(async () => (await vacuuming()).length > 0, 'autovacuum to work on vac_target', { timeoutMs: 60_000 });

    const other = defineJob({ name: 'elsewhere', steps: [{ name: 'only', tables: ['work_log'], run: ({ db }) => sql`select 1`.execute(db) }] });
    expect(await runner.run(other, { key: 'e', health: { ...FAST, transactionAgeSeconds: false } })).toMatchObject({ status: 'succeeded' });

    // keyRange names its table: no `tables` needed on the step.
    const job = defineJob({
      name: 'vac-backfill',
      steps: [{ name: 'fill', chunks: keyRange({ table: 'vac_target', column: 'id', size: 5 }), run: ({ db }, c: { lo: number; hi: number }) => sql`update vac_target set pad = 'y' where id >= ${c.lo} and id < ${c.hi}`.execute(db) }],
    });
    const running = runner.run(job, { key: 'v', health: { ...FAST, transactionAgeSeconds: false } });
    const pause = await waitFor(async () => (await runRow(primary.url, 'vac-backfill', 'v'))?.health_pause, 'the run to pause for autovacuum');
    expect(pause.reason).toBe('autovacuum running on vac_target');
    expect(await query(primary.url, `select count(*)::int as n from vac_target where pad = 'y'`)).toEqual([{ n: 0 }]);
    // Clear it: no more autovacuum on the table, and the running one cancelled.
    await query(primary.url, `alter table vac_target set (autovacuum_enabled = false)`);
    await waitFor(async () => {
      const rows = await vacuuming();
      for (const r of rows) await query(primary.url, 'select pg_cancel_backend($1)', [r.pid]);
      return rows.length === 0;
    }, 'the autovacuum worker to stop');
    expect(await running).toMatchObject({ status: 'succeeded', executed: 2 });
    expect(await query(primary.url, `select count(*)::int as n from vac_target where pad = 'y'`)).toEqual([{ n: 10 }]);
  });
});

describe.skipIf(!bin)('on the system PostgreSQL (older than the embedded 18)', () => {
  it('a role that does not exist (trust auth, where PostgreSQL says so): exit 2 naming CREATE ROLE or the user, not the password', async () => {
    // Black-box round 12 (B2-8): "role … does not exist" (28000) got "fix the user or password", and
    // under trust auth there is no password to fix. (Under password auth PostgreSQL does not tell.)
    const as = new URL(primary.url);
    as.username = 'idem_no_such_role';
    const res = await runCli([...FIXTURE_DIRS, 'status'], { url: as.toString() });
    expect(res.code, res.stderr).toBe(2);
    expect(lines(res.stderr)).toEqual([
      expect.stringMatching(/^idem: error: the database at \S+ has no role idem_no_such_role \(role "idem_no_such_role" does not exist\); create it \(CREATE ROLE idem_no_such_role LOGIN\) or fix the user in DATABASE_URL$/),
    ]);
    const err = await Runner.connect({ connectionString: as.toString() }).then(() => null, (e: unknown) => e as Error);
    expect(err?.message).toMatch(/has no role idem_no_such_role .*fix the user in the connection string$/);
  });

  it("a chunk that switches to a role without rights on idem's schema (set local role) commits once: idem's fence at COMMIT runs as the schema's owner", async () => {
    // Black-box round 9, PostgreSQL 15: the fence trigger read idem.runs at COMMIT as the chunk's
    // current role (PostgreSQL 18 runs a deferred trigger as the role that queued it), so `set local
    // role lowpriv` (the README's own advice: local) failed every chunk with "permission denied for
    // schema idem", unless that role had been granted idem's tables.
    const role = `lowpriv_${process.pid}`;
    await query(primary.url, `drop table if exists role_work; create table role_work (k text primary key); drop role if exists ${role}; create role ${role}; grant insert on role_work to ${role}`);
    try {
      const job = defineJob({
        name: 'role-switch',
        steps: [
          {
            name: 'work',
            chunks: () => ({ chunks: ['a', 'b', 'c'].map((key) => ({ key })), next: null }),
            async run({ db }, chunk: { key: string }) {
              await sql.raw(`set local role ${role}`).execute(db);
              await sql`insert into role_work values (${chunk.key})`.execute(db);
            },
          },
        ],
      });
      expect((await runner.run(job, { key: 'k' })).status).toBe('succeeded');
      expect(await query(primary.url, 'select k from role_work order by k')).toEqual([{ k: 'a' }, { k: 'b' }, { k: 'c' }]);
      expect(await query(primary.url, `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'role-switch' and c.done_at is not null`)).toEqual([{ n: 3 }]);
    } finally {
      await query(primary.url, `drop table if exists role_work; drop role if exists ${role}`);
    }
  });
});
