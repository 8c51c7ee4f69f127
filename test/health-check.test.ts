import { randomBytes } from 'node:crypto';
import pg from 'pg';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, inject, it, vi } from 'vitest';
import { defineJob, Runner, sql, UsageError, type HealthOptions } from '../src/index.ts';
import { createHealthGate, parseHealthFlag, PROBE_PATIENCE_MS, resolveHealth } from '../src/health-check.ts';
import { Kysely, PostgresDialect } from 'kysely';
import { runCard, runLive } from '../src/server/dashboard-html.ts';
import { RunViews } from '../src/server/run-view.ts';
import counted from './fixtures/jobs/counted.ts';
import { FIXTURE_DIRS, holdGate, killLeftovers, query, runCli, runRow, spawnCli, waitFor, workCounts, lockWaiters } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

const logs: Array<{ msg: string; indicator?: string; [k: string]: unknown }> = [];
const testDb = useTestDatabase({
  fixtureTables: true,
  prepare: (url) => query(url, `create table hot (id int primary key, n int not null default 0); insert into hot values (1, 0)`),
  runner: { log: pino({ level: 'info' }, { write: (line: string) => void logs.push(JSON.parse(line)) }) },
});
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});
afterAll(killLeftovers);

/** A session that opens a transaction and keeps it open (idle in transaction) until release(). */
async function openTransaction(): Promise<{ pid: number; release(): Promise<void> }> {
  const client = new pg.Client({ connectionString: url, application_name: 'test-long-tx' });
  await client.connect();
  await client.query('begin');
  const { rows } = await client.query<{ pid: number }>('select pg_backend_pid() as pid, txid_current()');
  let done: Promise<void> | undefined;
  return { pid: rows[0]!.pid, release: () => (done ??= client.query('commit').then(() => client.end())) };
}

const olderThan = async (pid: number, seconds: number) =>
  (await query(url, `select 1 from pg_stat_activity where pid = $1 and now() - xact_start > make_interval(secs => $2)`, [pid, seconds])).length > 0;

const FAST: HealthOptions = { probeIntervalMs: 100 };

describe('health checks before each chunk', () => {
  it('a long transaction in another session pauses the run, says why once, shows in status, and the run continues when it ends', async () => {
    const tx = await openTransaction();
    try {
      await waitFor(() => olderThan(tx.pid, 1), 'the transaction to be older than 1 s');
      logs.length = 0;
      const running = runner.run(counted, { params: { chunks: 3 }, key: 'long-tx', health: { ...FAST, transactionAgeSeconds: 1 } });
      const row = await waitFor(async () => (await runRow(url, 'counted', 'long-tx'))?.health_pause, 'the run to pause for health').catch((err: Error) => {
        throw new Error(`${err.message}; run ${JSON.stringify(logs.map((l) => l.msg))}`);
      });
      expect(row.reason).toMatch(new RegExp(`^transaction of pid ${tx.pid} \\(idle in transaction\\) open [\\d.]+ s > 1 s$`));
      // The age it shows is above the limit (it read "open 1 s > 1 s" at 1.2 s: black-box round 12).
      expect(Number(/open ([\d.]+) s/.exec(row.reason)![1])).toBeGreaterThan(1);
      // Several probes later: still nothing done (the first step waits too), still said once.
      await waitFor(async () => (await runRow(url, 'counted', 'long-tx')).health_pause.reason !== row.reason, 'a later probe');
      expect(await workCounts(url, 'long-tx', 'prepare')).toEqual(new Map());
      const [status] = await runner.status('counted');
      expect(status).toMatchObject({ runKey: 'long-tx', state: 'running', healthPause: { reason: expect.stringMatching(/^transaction of pid \d+ \(idle in transaction\) open [\d.]+ s > 1 s$/) } });
      expect(logs.filter((l) => typeof l.msg === 'string' && l.msg.startsWith('paused for health: transaction of pid'))).toHaveLength(1);
      // The HTTP run view and the dashboard say so too (black-box round 10: they showed the run
      // running with a rate and an ETA, nothing about the pause).
      const reads = new pg.Pool({ connectionString: url, max: 1 });
      try {
        const view = (await new RunViews(runner.db, reads, runner.schema, runner).byKey('counted', 'long-tx'))!;
        expect(view).toMatchObject({ state: 'running', healthPause: { reason: expect.stringMatching(/^transaction of pid \d+ \(idle in transaction\) open [\d.]+ s > 1 s$/), since: expect.any(String) } });
        for (const html of [runCard(view), runLive(view)]) expect(html.replace(/<\/?bdi>/g, '')).toMatch(/paused for health: transaction of pid \d+ \(idle in transaction\) open [\d.]+ s &gt; 1 s/);
      } finally {
        await reads.end();
      }
      await tx.release();
      const out = await running;
      expect(out).toMatchObject({ status: 'succeeded', executed: 5 });
      expect((await runRow(url, 'counted', 'long-tx')).health_pause).toBeNull();
      expect(logs.filter((l) => l.msg === 'database healthy again; continuing')).toHaveLength(1);
    } finally {
      await tx.release();
    }
  });

  it('the lock lost while every slot waits out a health pause: the step stays unfinished, and the rerun does its chunks', async () => {
    // Review of this stop (H1): with no chunk in flight the stopped step returned normally once the
    // lock was lost, and executeSteps marked it done: a resume skipped its chunks for good.
    const tx = await openTransaction();
    const key = 'lost-in-pause';
    try {
      await waitFor(() => olderThan(tx.pid, 1), 'the transaction to be older than 1 s');
      const running = runner.run(counted, { params: { chunks: 3 }, key, health: { ...FAST, transactionAgeSeconds: 1 } }).catch((e: unknown) => e);
      await waitFor(async () => (await runRow(url, 'counted', key))?.health_pause, 'the run to pause for health');
      // This process's lock session in this database only: the cluster is shared with test files
      // running beside this one (the workers chaos lost a worker's lock to a wider statement).
      await query(url, `select pg_terminate_backend(pid) from pg_stat_activity where application_name like 'idem-lock %:' || $1 and datname = current_database()`, [String(process.pid)]);
      expect(await running).toMatchObject({ name: 'LockLostError' });
      await new Promise((r) => setTimeout(r, 500));
      const steps = await query<{ name: string; status: string }>(url, `select s.name, s.status from idem.steps s join idem.runs r on r.id = s.run_id where r.job = 'counted' and r.run_key = $1 order by s.position`, [key]);
      expect(steps.filter((st) => st.status === 'done')).toEqual([]);
    } finally {
      await tx.release();
    }
    const rerun = await runner.run(counted, { params: { chunks: 3 }, key });
    expect(rerun).toMatchObject({ status: 'succeeded' });
    expect(await workCounts(url, key)).toEqual(new Map([['c0001', 1], ['c0002', 1], ['c0003', 1]]));
  });

  it('a health pause left by a worker that died while paused is not shown as the next attempt\'s', async () => {
    // Review of black-box round 10's fix: the HTTP view and the dashboard show health_pause, which
    // only a worker that saw the database healthy again cleared.
    const first = await runner.run(counted, { params: { chunks: 2 }, key: 'stale-pause' });
    expect(first.status).toBe('succeeded');
    await query(url, `update idem.runs set status = 'running', health_pause = '{"reason":"left behind","since":"2026-01-01T00:00:00Z"}' where job = 'counted' and run_key = 'stale-pause'`);
    await runner.run(counted, { params: { chunks: 2 }, key: 'stale-pause' });
    expect((await runRow(url, 'counted', 'stale-pause')).health_pause).toBeNull();
  });

  it('the same transaction does not stop a run whose indicator, or whole check, is off', async () => {
    const tx = await openTransaction();
    try {
      await waitFor(() => olderThan(tx.pid, 1), 'the transaction to be older than 1 s');
      expect(await runner.run(counted, { params: { chunks: 2 }, key: 'tx-off', health: { ...FAST, transactionAgeSeconds: false } })).toMatchObject({ status: 'succeeded' });
      expect(await runner.run(counted, { params: { chunks: 2 }, key: 'all-off', health: false })).toMatchObject({ status: 'succeeded' });
      // A step can turn it off for itself, under a job that sets a threshold the transaction exceeds.
      const job = defineJob({
        name: 'step-off',
        health: { ...FAST, transactionAgeSeconds: 1 },
        steps: [{ name: 'only', health: { transactionAgeSeconds: false }, run: ({ db }) => sql`update hot set n = n + 1 where id = 1`.execute(db) }],
      });
      expect(await runner.run(job, { key: 'x' })).toMatchObject({ status: 'succeeded', executed: 1 });
      for (const key of ['tx-off', 'all-off']) expect((await runRow(url, 'counted', key)).health_pause).toBeNull();
    } finally {
      await tx.release();
    }
  });

  it('idem run --health pauses and idem status says so; --no-health-check runs through', async () => {
    const tx = await openTransaction();
    try {
      await waitFor(() => olderThan(tx.pid, 1), 'the transaction to be older than 1 s');
      const args = [...FIXTURE_DIRS, '--log-level', 'warn'];
      // The job lock allows one run of counted at a time: the unchecked run goes first.
      const off = await runCli([...args, 'run', 'counted', '--key', 'cli-off', '--param', 'chunks=2', '--no-progress', '--health', 'transactionAgeSeconds=1', '--no-health-check'], { url });
      expect(off.stderr).toBe("");
      expect(off.code).toBe(0);
      const child = spawnCli([...args, 'run', 'counted', '--key', 'cli-tx', '--param', 'chunks=2', '--no-progress', '--health', 'transactionAgeSeconds=1', '--health', 'probeIntervalMs=100'], { url });
      await waitFor(async () => (await runRow(url, 'counted', 'cli-tx'))?.health_pause, 'the CLI run to pause for health');
      const status = await runCli([...args, 'status', 'counted'], { url });
      expect(status.stdout).toMatch(/cli-tx +running +.*paused for health: transaction of pid \d+ \(idle in transaction\) open [\d.]+ s > 1 s/);
      await tx.release();
      const done = await child.done;
      expect(done.code).toBe(0);
      // Said once on stderr, however many probes it took.
      expect(done.stderr.match(/paused for health: transaction of pid/g)).toHaveLength(1);
      const bad = await runCli([...args, 'run', 'counted', '--health', 'replicationLag=5'], { url });
      expect(bad.code).toBe(2);
      expect(bad.stderr).toContain('--health replicationLag=5: unknown indicator "replicationLag"');
    } finally {
      await tx.release();
    }
  });

  it('a session waiting on a lock an idem chunk holds pauses the next chunks until it got its lock', async () => {
    const CHUNKS = 80;
    const gate = await holdGate(url, 'hot');
    const job = defineJob({
      name: 'locker',
      steps: [
        {
          name: 'work',
          // 80 chunks: the other slot's 79 × 100 ms must outlast the test's detection of k00, the
          // blocked session's 300 ms and a probe even on a loaded machine (with 30, a slow round
          // let them all finish first, and with no chunk left to start no probe ran to pause).
          chunks: (cursor) => ({ chunks: Array.from({ length: CHUNKS }, (_, i) => ({ key: `k${String(i).padStart(2, '0')}` })), next: null }),
          async run({ db }, { key }) {
            if (key === 'k00') {
              await sql`update hot set n = n + 1 where id = 1`.execute(db);
              await sql`select 1 from gates where name = 'hot' for share`.execute(db);
            } else {
              await sql`select pg_sleep(0.1)`.execute(db);
            }
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('locker', 'l', 'work', ${key}, 1, 0)`.execute(db);
          },
        },
      ],
    });
    const [{ n: before }] = await query(url, `select n from hot where id = 1`);
    const blocked = new pg.Client({ connectionString: url, application_name: 'test-blocked' });
    await blocked.connect();
    try {
      const running = runner.run(job, { key: 'l', concurrency: 2, health: { ...FAST, lockWaitMs: 300 } });
      await waitFor(async () => (await lockWaiters(url, 'idem')) > 0, 'chunk k00 to hold the row and wait on the gate');
      const update = blocked.query('update hot set n = n + 10 where id = 1');
      const pause = await waitFor(async () => (await runRow(url, 'locker', 'l'))?.health_pause, 'the run to pause for the lock wait');
      expect(pause.reason).toMatch(/^pid \d+ waiting [\d.]+ ms > 300 ms for a lock held by idem \(pid \d+\)$/);
      const doneAtPause = (await workCounts(url, 'l')).size;
      expect(doneAtPause).toBeLessThan(CHUNKS - 1);
      // While the session waits, no new chunk starts (a few probe intervals later, the count is the same).
      await waitFor(async () => (await runRow(url, 'locker', 'l')).health_pause?.reason !== pause.reason, 'a later probe');
      expect((await workCounts(url, 'l')).size).toBeLessThanOrEqual(doneAtPause + 1);
      await gate.release();
      await update;
      expect(await running).toMatchObject({ status: 'succeeded' });
      expect((await workCounts(url, 'l')).size).toBe(CHUNKS);
      expect(await query(url, `select n from hot where id = 1`)).toEqual([{ n: before + 11 }]);
    } finally {
      await gate.release();
      await blocked.end();
    }
  });

  it('one probe serves every worker and step of a process within its interval', async () => {
    // A runner of its own: its pool has never been probed.
    const fresh = await Runner.connect({ connectionString: url });
    const spy = vi.spyOn(pg.Client.prototype, 'query');
    try {
      const out = await fresh.run(counted, { params: { chunks: 40 }, key: 'shared-probe', concurrency: 4, health: { probeIntervalMs: 60_000 } });
      expect(out).toMatchObject({ status: 'succeeded', executed: 42 });
      const probes = spy.mock.calls.filter(([q]) => String(typeof q === 'string' ? q : (q as { text?: string }).text).includes('pg_stat_progress_vacuum'));
      // 42 chunk starts in 3 steps on 4 workers: one probe.
      expect(probes.length).toBe(1);
    } finally {
      spy.mockRestore();
      await fresh.close();
    }
    const spy2 = vi.spyOn(pg.Client.prototype, 'query');
    try {
      await runner.run(counted, { params: { chunks: 10 }, key: 'probe-each', health: { probeIntervalMs: 0 } });
      const probes = spy2.mock.calls.filter(([q]) => String(typeof q === 'string' ? q : (q as { text?: string }).text).includes('pg_stat_progress_vacuum'));
      // With no interval, every one of the 12 chunk starts probes: the count above is the sharing, not a missing probe.
      expect(probes.length).toBe(12);
    } finally {
      spy2.mockRestore();
    }
  });

  it('a probe that cannot get a connection holds the chunks back at most PROBE_PATIENCE_MS once, not its connect timeout at every interval', async () => {
    // Found behind PgBouncer with a session pool smaller than the run needs: the probe's
    // connection waited in PgBouncer's queue for pg-pool's 10 s connect timeout, every chunk of
    // every slot waited with it, and then (the failed probe already stale) the next chunk started
    // another: 3 chunks per 10 s where 3 slots ran 7 a second. Here the probe's pool has one
    // connection, which the test holds, so the probe waits for it as for a pooler's session.
    const pool = new pg.Pool({ connectionString: url, max: 1, connectionTimeoutMillis: 4_000 });
    const db = new Kysely<any>({ dialect: new PostgresDialect({ pool }) });
    const seen: string[] = [];
    const log = pino({ level: 'info' }, { write: (line: string) => void seen.push(JSON.parse(line).msg) });
    try {
      const job = defineJob({ name: 'slow-probe', steps: [{ name: 's', run: async () => {} }] });
      const gate = (await createHealthGate({ db, schema: 'idem', run: { job: 'slow-probe', runKey: 'k', runId: '0', attempt: 1 }, job, step: job.steps[0]!, log, override: { probeIntervalMs: 1_000, transactionAgeSeconds: 1 } }))!;
      const held = await pool.connect();
      try {
        const started = performance.now();
        // Twelve chunk starts over 3 s (three intervals): each may wait for the probe at most its patience.
        const waits: number[] = [];
        for (let i = 0; i < 12; i++) {
          const t = performance.now();
          await gate.wait(new AbortController().signal);
          waits.push(performance.now() - t);
          await new Promise((r) => setTimeout(r, 250));
        }
        const total = performance.now() - started;
        expect(Math.max(...waits), `waits ${waits.map((w) => Math.round(w)).join(', ')} ms`).toBeLessThan(PROBE_PATIENCE_MS + 500);
        expect(waits.filter((w) => w > 100), `waits ${waits.map((w) => Math.round(w)).join(', ')} ms`).toHaveLength(1);
        expect(total).toBeLessThan(12 * 250 + PROBE_PATIENCE_MS + 1_500);
        expect(seen.filter((m) => m.startsWith('health probe'))).toEqual([`health probe gave no answer within ${PROBE_PATIENCE_MS / 1000} s; continuing without it`]);
        // One probe waits for the connection at a time, not one per chunk start.
        expect(pool.waitingCount).toBeLessThanOrEqual(1);
      } finally {
        held.release();
      }
      // The connection back, the probe works again: a transaction open past the limit pauses the
      // next chunk start. (A probe whose first query had failed once stayed failed for the
      // process's life: health checks silently off in a long idem serve or idem cron.)
      const tx = await openTransaction();
      try {
        await waitFor(() => olderThan(tx.pid, 1.2), 'the transaction to be older than 1.2 s');
        await new Promise((r) => setTimeout(r, 1_100)); // past the interval of the last probe
        // While probes fail, a chunk start does not wait for the next one: it reads its answer later.
        await gate.wait(new AbortController().signal);
        await new Promise((r) => setTimeout(r, 300));
        const t = performance.now();
        await gate.wait(AbortSignal.timeout(3_000));
        expect(performance.now() - t).toBeGreaterThan(2_500);
        expect(seen.filter((m) => m.startsWith('paused for health'))).toEqual([expect.stringMatching(new RegExp(`^paused for health: transaction of pid ${tx.pid} `))]);
      } finally {
        await tx.release();
      }
    } finally {
      await db.destroy();
    }
  });

  it('a probe that is slow while the run is paused for health keeps the pause (it does not let chunks start)', async () => {
    // Review of this stop (M2): a probe slower than its patience lifted a health pause, so chunks
    // started on a database still unhealthy, just when probes are likely slow.
    const pool = new pg.Pool({ connectionString: url, max: 1, connectionTimeoutMillis: 15_000 });
    const db = new Kysely<any>({ dialect: new PostgresDialect({ pool }) });
    const seen: string[] = [];
    const log = pino({ level: 'info' }, { write: (line: string) => void seen.push(JSON.parse(line).msg) });
    const tx = await openTransaction();
    try {
      await waitFor(() => olderThan(tx.pid, 1.2), 'the transaction to be older than 1.2 s');
      const job = defineJob({ name: 'slow-probe-paused', steps: [{ name: 's', run: async () => {} }] });
      const gate = (await createHealthGate({ db, schema: 'idem', run: { job: 'slow-probe-paused', runKey: 'k', runId: '0', attempt: 1 }, job, step: job.steps[0]!, log, override: { probeIntervalMs: 500, transactionAgeSeconds: 1 } }))!;
      const stop = new AbortController();
      const waiting = gate.wait(stop.signal).then(() => 'returned');
      await waitFor(async () => (seen.some((m) => m.startsWith('paused for health')) ? true : undefined), 'the gate to pause');
      // From now on every probe waits for the pool's one connection.
      const held = await pool.connect();
      try {
        const outcome = await Promise.race([waiting, new Promise((r) => setTimeout(() => r('still paused'), PROBE_PATIENCE_MS + 5_000))]);
        expect(outcome).toBe('still paused');
        // Not taken for a probe that failed (which lets chunks start: "continuing without it").
        expect(seen.filter((m) => m.startsWith('health probe') || m.startsWith('database healthy again'))).toEqual([]);
      } finally {
        stop.abort();
        held.release();
        await waiting;
      }
    } finally {
      await tx.release();
      await db.destroy();
    }
  });

  it('settings are checked: unknown names, bad values and bad flags are refused with the fix', () => {
    expect(resolveHealth()).toMatchObject({ replicationLagSeconds: 10, walArchivePending: 42, autovacuum: true, transactionAgeSeconds: 300, lockWaitMs: 1000, probeIntervalMs: 5000 });
    expect(resolveHealth({ lockWaitMs: 5 }, false)).toBeNull();
    expect(resolveHealth(false, { lockWaitMs: 5 })).toMatchObject({ lockWaitMs: 5, transactionAgeSeconds: 300 });
    expect(() => resolveHealth({ lockWait: 5 } as HealthOptions)).toThrow('invalid health check settings: unknown indicator "lockWait" (did you mean "lockWaitMs"?)');
    // Black-box round 14 (B3-17): a misspelt flag got the list, not the name meant.
    expect(() => parseHealthFlag('autovacum=off')).toThrow('--health autovacum=off: unknown indicator "autovacum" (did you mean "autovacuum"?); use one of');
    expect(() => resolveHealth({ probeIntervalMs: false } as unknown as HealthOptions)).toThrow('probeIntervalMs must be a number >= 0 (got false)');
    expect(parseHealthFlag('walArchivePending=off', parseHealthFlag('autovacuum=off'))).toEqual({ autovacuum: false, walArchivePending: false });
    expect(() => parseHealthFlag('lockWaitMs=soon')).toThrow(UsageError);
    // Black-box round 18 (B10-3): the number forms every other number flag refuses were taken
    // (0x10 read as 16, 1e3 as 1000, " 5" as 5): a typo became a threshold.
    for (const v of ['0x10', '1e3', ' 5', '5 ', '+5', '.5', '5.', '1_000']) {
      expect(() => parseHealthFlag(`transactionAgeSeconds=${v}`), v).toThrow(`--health transactionAgeSeconds=${v}: expected transactionAgeSeconds=<plain decimal number >= 0, such as 600 or 0.5> or off`);
    }
    expect(() => parseHealthFlag('probeIntervalMs=1e3')).toThrow('--health probeIntervalMs=1e3: expected probeIntervalMs=<plain decimal number >= 0, such as 600 or 0.5>');
    expect(parseHealthFlag('transactionAgeSeconds=600')).toEqual({ transactionAgeSeconds: 600 });
    expect(parseHealthFlag('lockWaitMs=0.5')).toEqual({ lockWaitMs: 0.5 });
    expect(() => defineJob({ name: 'bad-health', health: { transactionAgeSeconds: -1 }, steps: [{ name: 's', run() {} }] })).toThrow(/transactionAgeSeconds must be a number >= 0 or false/);
  });
});

// PostgreSQL shows another role's sessions (their transaction start, lock waits, vacuum progress)
// and the standbys' lag only to a role with pg_read_all_stats: without it the indicators read NULL
// and never fire. idem says so once per run instead of staying silently blind.
describe('health checks under the least-privilege role the README documents', () => {
  const role = `idem_health_${randomBytes(4).toString('hex')}`;
  const roleLogs: Array<{ msg: string; [k: string]: unknown }> = [];
  let roleRunner: Runner | undefined;
  beforeAll(async () => {
    const password = randomBytes(12).toString('hex');
    await query(url, `create role ${role} login password '${password}'`);
    await query(url, `grant usage on schema idem to ${role}; grant select, insert, update, delete on all tables in schema idem to ${role}`);
    // What the fixture job's own SQL needs.
    await query(url, `grant select, insert, update, delete on all tables in schema public to ${role}; grant usage on all sequences in schema public to ${role}`);
    const u = new URL(url);
    u.username = role;
    u.password = password;
    roleRunner = await Runner.connect({ connectionString: u.toString(), log: pino({ level: 'info' }, { write: (line: string) => void roleLogs.push(JSON.parse(line)) }) });
  });
  afterAll(async () => {
    await roleRunner?.close();
    // Roles are cluster-wide: take back what it holds in this database, then drop it.
    await query(url, `drop owned by ${role}`).catch(() => {});
    await query(inject('adminUrl'), `drop role if exists ${role}`);
  });

  it('a probe that fails for want of pg_stat_activity is said once for the run, not once per step', async () => {
    // Black-box round 13 (B3-9 rest): with SELECT on pg_stat_activity taken from the role, the probe
    // failed at every step, and "health probe failed; continuing without it" was logged per step.
    await query(url, `revoke select on pg_catalog.pg_stat_activity from public`);
    try {
      roleLogs.length = 0;
      const out = await roleRunner!.run(counted, { params: { chunks: 2 }, key: 'no-activity', health: FAST });
      expect(out).toMatchObject({ status: 'succeeded' });
      const failures = roleLogs.filter((l) => l.msg === 'health probe failed; continuing without it');
      expect(failures, JSON.stringify(roleLogs.map((l) => l.msg))).toHaveLength(1);
      expect(failures[0]).toMatchObject({ level: 40, job: 'counted', runKey: 'no-activity', err: { message: expect.stringMatching(/permission denied for view pg_stat_activity/) } });
    } finally {
      await query(url, `grant select on pg_catalog.pg_stat_activity to public`);
      // The next test counts the warnings of its own run.
      roleLogs.length = 0;
    }
  });

  it('without pg_read_all_stats warns once naming the blind indicators and the grant; with it, the same transaction pauses the run', async () => {
    const tx = await openTransaction();
    try {
      await waitFor(() => olderThan(tx.pid, 1), 'the transaction to be older than 1 s');
      const blind = await roleRunner!.run(counted, { params: { chunks: 2 }, key: 'blind', health: { ...FAST, transactionAgeSeconds: 1 } });
      expect(blind).toMatchObject({ status: 'succeeded' });
      const warnings = roleLogs.filter((l) => /pg_read_all_stats/.test(l.msg));
      expect(warnings.map((l) => l.msg)).toEqual([
        `health checks cannot see other roles' sessions: role ${role} lacks pg_read_all_stats, so replicationLagSeconds, autovacuum, transactionAgeSeconds and lockWaitMs never pause this run; GRANT pg_read_all_stats TO ${role} (or pg_monitor; see README, Database privileges)`,
      ]);
      expect(warnings[0]).toMatchObject({ level: 40, job: 'counted', runKey: 'blind' });

      await query(url, `grant pg_read_all_stats to ${role}`);
      // A process's probe serves all its runs for probeIntervalMs: let the one the blind run took
      // (before the grant) go stale, or the next run may start on it (here the gap was ~20 ms).
      await new Promise((r) => setTimeout(r, FAST.probeIntervalMs! + 50));
      roleLogs.length = 0;
      const seeing = roleRunner!.run(counted, { params: { chunks: 2 }, key: 'seeing', health: { ...FAST, transactionAgeSeconds: 1 } });
      let outcome = 'still running';
      seeing.then(
        (o) => (outcome = `ended ${JSON.stringify(o)}`),
        (err: Error) => (outcome = `threw ${err.message}`),
      );
      const pause = await waitFor(async () => (await runRow(url, 'counted', 'seeing'))?.health_pause, 'the run to pause for health').catch((err: Error) => {
        throw new Error(`${err.message}; the run ${outcome}; its log ${JSON.stringify(roleLogs.map((l) => l.msg))}`);
      });
      expect(pause.reason).toMatch(new RegExp(`^transaction of pid ${tx.pid} \\(idle in transaction\\) open [\\d.]+ s > 1 s$`));
      await tx.release();
      expect(await seeing).toMatchObject({ status: 'succeeded' });
      expect(roleLogs.filter((l) => /pg_read_all_stats/.test(l.msg))).toEqual([]);
    } finally {
      await tx.release();
    }
  });
});
