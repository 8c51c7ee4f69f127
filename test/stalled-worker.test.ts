import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, Runner, sql } from '../src/index.ts';
import { chunkKey } from './fixtures/jobs/counted.ts';
import { FIXTURE_DIRS, STALL_DIRS, killLeftovers, query, runCli, runRow, sessions, spawnCli, waitFor, workCounts, type CliProcess } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * A worker stalled for longer than idle_in_transaction_session_timeout (SIGSTOP, a VM freeze, a
 * long GC pause) finds its chunk's session ended by the server (25P03) when it goes on. That is a
 * lost connection like any other: the chunk rolled back on the server, the slot takes a new
 * connection and claims again. It must never fail the run, nor rewrite a run another worker
 * finished meanwhile.
 */
const testDb = useTestDatabase({ fixtureTables: true, runner: { idleInTransactionTimeoutMs: 500 } });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});
afterAll(killLeftovers);

/** The server ends a stalled worker's chunk session after this (the CLI default is 60 s). */
const IDLE_MS = 1_000;

/** Blocks this thread (timers, sockets and all), as a stopped process or a long GC pause would. */
const stallThread = (ms: number) => Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);

const ones = (n: number) => new Map(Array.from({ length: n }, (_, i) => [chunkKey(i + 1), 1]));

describe('a chunk session ended by idle_in_transaction_session_timeout (25P03)', () => {
  it('in-process, the event loop blocked inside a chunk: the chunk retries on a new connection; the run succeeds in the same attempt', async () => {
    const key = 'blocked-loop';
    let stalled = 0;
    const job = defineJob({
      name: 'blocked-loop',
      retry: { base: 10, max: 50 },
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [1, 2, 3].map((i) => ({ key: chunkKey(i) })), next: null }),
          async run(ctx, chunk: { key: string }) {
            // The claim opened the transaction; the thread stops past the server's timeout, and the
            // next statement meets the server's FATAL 25P03 as its answer.
            if (chunk.key === chunkKey(2) && stalled++ === 0) stallThread(1_500);
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid)
              values (${ctx.run.job}, ${ctx.run.runKey}, ${ctx.step}, ${chunk.key}, ${ctx.run.attempt}, ${process.pid})`.execute(ctx.db);
          },
        },
      ],
    });
    const outcome = await runner.run(job, { key });
    expect(stalled).toBe(2);
    expect(outcome).toMatchObject({ status: 'succeeded', attempt: 1, executed: 3 });
    expect(await workCounts(url, key)).toEqual(ones(3));
    expect(await runRow(url, 'blocked-loop', key)).toMatchObject({ status: 'succeeded', attempt: 1, error: null });
    // The lost try was counted on the chunk, in the run's one budget.
    const [c2] = await query<{ retry_tries: number; error: string }>(url, `select c.retry_tries, c.error from idem.chunks c join idem.runs r on r.id = c.run_id where r.run_key = $1 and c.key = $2`, [key, chunkKey(2)]);
    expect(c2).toMatchObject({ retry_tries: 1 });
  });
});

describe("a chunk waiting on ctx.signal (no statement) past the idle-in-transaction timeout", () => {
  it('its ctx.signal aborts when the server ends its session, so the chunk ends and is tried again; the run succeeds', async () => {
    // Black-box round 13: a chunk that awaited ctx.signal (a fetch, a queue) while its transaction
    // sat idle was ended by the server (25P03), and nothing told the job: the worker hung forever,
    // holding the job's lock, after the other workers had finished the run.
    const key = 'signal-hang';
    let hung = 0;
    let reason: unknown;
    const job = defineJob({
      name: 'signal-hang',
      retry: { base: 10, max: 50 },
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [1, 2, 3].map((i) => ({ key: chunkKey(i) })), next: null }),
          async run(ctx, chunk: { key: string }) {
            if (chunk.key === chunkKey(2) && hung++ === 0) {
              await new Promise((_, reject) => ctx.signal.addEventListener('abort', () => reject((reason = ctx.signal.reason)), { once: true }));
            }
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid)
              values (${ctx.run.job}, ${ctx.run.runKey}, ${ctx.step}, ${chunk.key}, ${ctx.run.attempt}, ${process.pid})`.execute(ctx.db);
          },
        },
      ],
    });
    let timer: NodeJS.Timeout | undefined;
    const outcome = await Promise.race([
      runner.run(job, { key }),
      new Promise((_, reject) => (timer = setTimeout(() => reject(new Error('the run hung: the chunk never learned its session had ended')), 15_000))),
    ]).finally(() => clearTimeout(timer));
    expect(outcome).toMatchObject({ status: 'succeeded', attempt: 1, executed: 3 });
    expect(hung).toBe(2);
    expect(String((reason as Error)?.message)).toMatch(/idle-in-transaction timeout|Connection terminated/);
    expect(await workCounts(url, key)).toEqual(ones(3));
  }, 30_000);
});

describe('a --join worker stopped (SIGSTOP) past the idle-in-transaction timeout, then continued', () => {
  const params = (chunks: number, pauseMs: number) => JSON.stringify({ chunks, pauseMs });
  const join = (key: string, chunks: number, pauseMs: number) =>
    spawnCli([...STALL_DIRS, 'run', 'stall', '--params', params(chunks, pauseMs), '--key', key, '--join', '--concurrency', '2'], {
      url,
      env: { IDEM_IDLE_IN_TRANSACTION_TIMEOUT_MS: String(IDLE_MS) },
      timeoutMs: 90_000,
    });
  const doneCount = async (key: string) => (await query<{ n: number }>(url, `select count(*)::int as n from work_log where run_key = $1`, [key]))[0]!.n;
  /** Both workers on the run, and each has committed chunks (so each is inside the chunk loop). */
  const bothWorking = (key: string, a: CliProcess, b: CliProcess) =>
    waitFor(
      async () => {
        if ((await sessions(url, 'idem-lock')) !== 2) return undefined;
        const rows = await query<{ pid: number }>(url, `select distinct pid from work_log where run_key = $1`, [key]);
        const pids = new Set(rows.map((r) => r.pid));
        return pids.has(a.pid) && pids.has(b.pid) ? true : undefined;
      },
      'both workers committing chunks',
      { timeoutMs: 30_000 },
    );
  /** The stopped worker's work sessions are gone: the server ended them (idle in transaction). */
  const sessionsEnded = (a: CliProcess) =>
    waitFor(
      async () => {
        const rows = await query<{ n: number }>(url, `select count(*)::int as n from pg_stat_activity where datname = current_database() and application_name like 'idem %:' || $1 and state = 'idle in transaction'`, [String(a.pid)]);
        return rows[0]!.n === 0 ? true : undefined;
      },
      "the stopped worker's chunk sessions ended by the server",
      { timeoutMs: 15_000 },
    );

  /**
   * Two workers on `key`; once both work, A is stopped (SIGSTOP, inside a chunk's JavaScript sleep
   * almost surely: its SQL takes ~1 ms of the 60) until B has finished the run (exit 0) and the
   * server has ended A's chunk sessions. Returns A, still stopped, and the run's row as B left it.
   */
  const stoppedUntilDone = async (key: string, chunks: number) => {
    const a = join(key, chunks, 60);
    const b = join(key, chunks, 60);
    try {
      await bothWorking(key, a, b);
      a.child.kill('SIGSTOP');
      const rb = await b.done;
      expect(rb.code, rb.stderr).toBe(0);
      await sessionsEnded(a);
      return { a, before: await runRow(url, 'stall', key) };
    } catch (err) {
      a.child.kill('SIGCONT');
      throw err;
    }
  };

  it('the run succeeded meanwhile: it stays succeeded, with its one summary, and the stalled worker exits 0', async () => {
    const key = 'stopped-until-done';
    const chunks = 150;
    const { a, before } = await stoppedUntilDone(key, chunks);
    try {
      expect(before).toMatchObject({ status: 'succeeded', error: null });
      a.child.kill('SIGCONT');
      const ra = await a.done;
      expect(ra.timedOut).toBe(false);
      expect(ra.code, ra.stderr).toBe(0);
      const after = await runRow(url, 'stall', key);
      expect(after).toMatchObject({ status: 'succeeded', attempt: 1, error: null, summary: before.summary });
      expect(after.finished_at).toEqual(before.finished_at);
      expect(await workCounts(url, key)).toEqual(ones(chunks));
    } finally {
      a.child.kill('SIGCONT');
    }
  });

  it('continued, then two SIGTERMs at once, the run finished meanwhile by the other worker: exit 143 (interrupted), not 0', async () => {
    // Black-box round 13 (B1-1's tail): the second signal aborted the chunk, whose own error (its
    // connection gone) ended the run in place of the signal: exit 0, as if no signal had come.
    const key = 'stopped-two-sigterms';
    const chunks = 150;
    const { a, before } = await stoppedUntilDone(key, chunks);
    try {
      a.child.kill('SIGCONT');
      a.child.kill('SIGTERM');
      await new Promise((r) => setTimeout(r, 5));
      a.child.kill('SIGTERM');
      const ra = await a.done;
      expect(ra.timedOut).toBe(false);
      expect(ra.stderr).toContain('second signal; aborting in-flight chunks');
      expect(ra.code, ra.stderr).toBe(143);
      expect(ra.stderr.trim().split('\n').at(-1)).toMatch(/^idem: .*interrupted by SIGTERM; the run had already ended succeeded/);
      expect(await runRow(url, 'stall', key)).toEqual(before);
      expect(await workCounts(url, key)).toEqual(ones(chunks));
    } finally {
      a.child.kill('SIGCONT');
    }
  });

  it('the run still going in another worker: neither fails it; the stalled worker goes on; both exit 0', async () => {
    const key = 'stopped-while-running';
    const chunks = 400;
    const a = join(key, chunks, 50);
    const b = join(key, chunks, 50);
    try {
      await bothWorking(key, a, b);
      a.child.kill('SIGSTOP');
      await sessionsEnded(a);
      // Some more chunks by B alone, then A goes on while B still has plenty to do.
      const at = await doneCount(key);
      await waitFor(async () => ((await doneCount(key)) >= at + 10 ? true : undefined), 'the other worker going on');
      expect((await runRow(url, 'stall', key)).status).toBe('running');
      const continued = (await query<{ t: Date }>(url, 'select clock_timestamp() as t'))[0]!.t;
      a.child.kill('SIGCONT');
      const [ra, rb] = await Promise.all([a.done, b.done]);
      expect(ra.code, ra.stderr).toBe(0);
      expect(rb.code, rb.stderr).toBe(0);
      expect(await runRow(url, 'stall', key)).toMatchObject({ status: 'succeeded', attempt: 1, error: null, summary: expect.objectContaining({ chunks, attempts: 1 }) });
      expect(await workCounts(url, key)).toEqual(ones(chunks));
      // A committed chunks after it came back.
      const [late] = await query<{ n: number }>(url, `select count(*)::int as n from work_log where run_key = $1 and pid = $2 and logged_at > $3`, [key, a.pid, continued]);
      expect(late!.n).toBeGreaterThan(0);
    } finally {
      a.child.kill('SIGCONT');
    }
  });
});

describe('a --join worker whose chunk waits on ctx.signal alone, its work session ended, stopped by two SIGTERMs', () => {
  /** The worker's work sessions idle in a chunk's transaction (its chunk waiting on ctx.signal). */
  const waiting = async (w: CliProcess) =>
    (await query<{ pid: number }>(url, `select pid from pg_stat_activity where datname = current_database() and application_name like 'idem %:' || $1 and state = 'idle in transaction'`, [String(w.pid)])).map((r) => r.pid);

  it.each([
    ['as the first SIGTERM comes', 0],
    ['a second before the first SIGTERM (the chunk tried again, waiting again)', 1_000],
  ])('%s: exit 143, the run interrupted (not failed), no step "(runner)"', async (_, beforeSignalMs) => {
    // Black-box round 13 (B1-1's tail): such a worker was reported to exit 0 naming step "(runner)".
    // What happened here: a chunk whose connection was lost as the first signal came failed the
    // run (exit 1, "failed in step work"), where a first signal leaves it interrupted.
    const key = `two-sigterms-${beforeSignalMs}`;
    const w = spawnCli([...STALL_DIRS, 'run', 'stall', '--params', JSON.stringify({ chunks: 3, pauseMs: 0 }), '--key', key, '--join'], { url, env: { STALL_WAIT_SIGNAL: '1' }, timeoutMs: 60_000 });
    const backends = await waitFor(async () => ((await waiting(w)).length > 0 ? waiting(w) : undefined), 'the chunk waiting on ctx.signal in its transaction');
    for (const pid of backends) await query(url, 'select pg_terminate_backend($1)', [pid]);
    await new Promise((r) => setTimeout(r, beforeSignalMs));
    w.child.kill('SIGTERM');
    await new Promise((r) => setTimeout(r, 300));
    w.child.kill('SIGTERM');
    const r = await w.done;
    expect(r.timedOut, r.stderr).toBe(false);
    expect(r.code, r.stderr).toBe(143);
    expect(r.stderr).not.toContain('(runner)');
    expect(r.stderr.trim().split('\n').at(-1)).toMatch(/^idem: .*interrupted by SIGTERM/);
    expect(await runRow(url, 'stall', key)).toMatchObject({ status: 'interrupted', error: null });
    expect(await workCounts(url, key)).toEqual(new Map());
    // A rerun resumes it (without the wait on ctx.signal) and does every chunk.
    const rerun = await runCli([...STALL_DIRS, 'run', 'stall', '--params', JSON.stringify({ chunks: 3, pauseMs: 0 }), '--key', key], { url });
    expect(rerun.code, rerun.stderr).toBe(0);
    expect(await workCounts(url, key)).toEqual(ones(3));
  });

  it('its chunk throwing an error of its own once ctx.signal aborts: the second SIGTERM interrupts the run (exit 143), not a failure in step "(runner)"', async () => {
    const key = 'two-sigterms-own-error';
    const w = spawnCli([...STALL_DIRS, 'run', 'stall', '--params', JSON.stringify({ chunks: 3, pauseMs: 0 }), '--key', key, '--join'], { url, env: { STALL_WAIT_SIGNAL: 'own' }, timeoutMs: 60_000 });
    await waitFor(async () => ((await waiting(w)).length > 0 ? true : undefined), 'the chunk waiting on ctx.signal in its transaction');
    w.child.kill('SIGTERM');
    await new Promise((r) => setTimeout(r, 300));
    w.child.kill('SIGTERM');
    const r = await w.done;
    expect(r.timedOut, r.stderr).toBe(false);
    expect(r.code, r.stderr).toBe(143);
    expect(r.stderr).not.toContain('(runner)');
    expect(r.stderr.trim().split('\n').at(-1)).toMatch(/^idem: .*interrupted by SIGTERM/);
    expect(await runRow(url, 'stall', key)).toMatchObject({ status: 'interrupted', error: null });
  });
});

describe('a chunk inside a long statement when the stop turns immediate (shutdown deadline, second signal)', () => {
  /** idem's sessions of the worker still running a statement. */
  const busy = async (pid: number) =>
    (await query<{ pid: number }>(url, `select pid from pg_stat_activity where datname = current_database() and application_name like 'idem %:' || $1 and state = 'active'`, [String(pid)])).map((r) => r.pid);

  it.each([
    ['the shutdown deadline', ['--shutdown-timeout', '1'], 1, 3],
    ['a second SIGTERM', [], 2, 3],
    // Review of this stop (H2): the other slot's claim, waiting on the chunk's row lock in the last
    // pass, was cancelled too, and its 57014 failed the run in step "(runner)" (exit 1).
    ['a second SIGTERM, the other slot waiting to claim the same chunk', ['--concurrency', '2'], 2, 1],
  ] as const)('%s cancels the statement: exit 143, the run interrupted (not crashed), nothing left running on the server', async (_, flags, signals, chunks) => {
    // Black-box round 14 (B1-2): the process exited 143 with the run still `running` (idem status:
    // crashed) and its pg_sleep went on in PostgreSQL for as long as it had (a long UPDATE would
    // have kept its row locks after idem had gone).
    const key = `long-statement-${signals}-${flags.join('')}`;
    const w = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify({ chunks, pauseMs: 60_000 }), '--key', key, ...flags], { url, timeoutMs: 60_000 });
    await waitFor(async () => ((await query(url, `select 1 from pg_stat_activity where application_name like 'idem %:' || $1 and query like '%pg_sleep%' and state = 'active'`, [String(w.pid)])).length > 0 ? true : undefined), 'the chunk in its pg_sleep');
    // With two slots, the second waits on the chunk's row lock (its last-pass claim).
    if (chunks === 1) await waitFor(async () => ((await query(url, `select 1 from pg_stat_activity where application_name like 'idem %:' || $1 and wait_event_type = 'Lock'`, [String(w.pid)])).length > 0 ? true : undefined), 'the other slot waiting to claim');
    const started = Date.now();
    for (let i = 0; i < signals; i++) {
      w.child.kill('SIGTERM');
      await new Promise((r) => setTimeout(r, 300));
    }
    const r = await w.done;
    expect(r.timedOut, r.stderr).toBe(false);
    expect(r.code, r.stderr).toBe(143);
    // Black-box round 15 (B1-2): pg's "Client.activeQuery is deprecated" warning, printed by the
    // cancel (idem read the deprecated getter, and so does pg's own Client#cancel).
    expect(r.stderr).not.toContain('DeprecationWarning');
    expect(Date.now() - started, 'exits soon after the stop turns immediate').toBeLessThan(8_000);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'interrupted', error: null });
    expect(r.stderr.trim().split('\n').at(-1)).toMatch(/^idem: .*interrupted by SIGTERM/);
    // Nothing of it runs on the server any more.
    await waitFor(async () => ((await busy(w.pid)).length === 0 ? true : undefined), 'its statements to end', { timeoutMs: 3_000 });
    expect(await query(url, `select 1 from pg_stat_activity where query like '%pg_sleep(60)%' and application_name like 'idem %:' || $1`, [String(w.pid)])).toEqual([]);
  });
});

describe('ending an attempt is a compare-and-set on the run still running under it', () => {
  it('failRun and endRun do not overwrite a succeeded run, nor one of a newer attempt', async () => {
    const key = 'cas-end';
    const job = defineJob({ name: 'cas-end', steps: [{ name: 'only', async run() {} }] });
    const outcome = await runner.run(job, { key });
    expect(outcome.status).toBe('succeeded');
    const runId = outcome.runId!;
    const before = await runRow(url, 'cas-end', key);
    const error = { step: 'only', chunk: null, tries: 1, message: 'terminating connection due to idle-in-transaction timeout', code: '25P03', at: new Date().toISOString() };
    const refused = await runner.store.failRun(runId, outcome.attempt, error);
    expect(refused).toMatchObject({ kind: 'ended', run: { status: 'succeeded', attempt: outcome.attempt } });
    await runner.store.endRun(runId, outcome.attempt, 'interrupted', null);
    // An older attempt's straggler cannot end the run either.
    await runner.store.endRun(runId, outcome.attempt - 1, 'failed', error);
    expect(await runRow(url, 'cas-end', key)).toEqual(before);
  });

  it('a worker whose chunk failed for good, finding the run succeeded by another worker meanwhile, leaves it succeeded and succeeds', async () => {
    const key = 'late-failure';
    let joined!: () => void;
    const bJoined = new Promise<void>((r) => (joined = r));
    // The first try of c0001 must be A's: B is started only once A is inside it (both workers run
    // this job object in this process, so the count is shared).
    let aInside!: () => void;
    const aInC1 = new Promise<void>((r) => (aInside = r));
    let c1Tries = 0;
    const job = defineJob({
      name: 'late-failure',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [1, 2, 3].map((i) => ({ key: chunkKey(i) })), next: null }),
          async run(ctx, chunk: { key: string }) {
            if (chunk.key === chunkKey(1) && c1Tries++ === 0) {
              aInside();
              await bJoined;
              throw new Error('a bug that the other worker does not hit');
            }
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid)
              values (${ctx.run.job}, ${ctx.run.runKey}, ${ctx.step}, ${chunk.key}, ${ctx.run.attempt}, ${process.pid})`.execute(ctx.db);
          },
        },
      ],
    });
    const other = await Runner.connect({ connectionString: url });
    try {
      // A records its failure only once B has finished the run (as a worker stopped meanwhile would).
      const record = runner.store.recordChunkFailure.bind(runner.store);
      runner.store.recordChunkFailure = async (...args) => {
        await waitFor(async () => ((await runRow(url, 'late-failure', key))?.status === 'succeeded' ? true : undefined), 'the other worker to finish the run');
        return record(...args);
      };
      const a = runner.run(job, { key, join: true });
      await aInC1;
      expect(await sessions(url, 'idem-lock')).toBe(1);
      const b = other.run(job, { key, join: true });
      await waitFor(async () => ((await sessions(url, 'idem-lock')) === 2 ? true : undefined), 'the second worker joined');
      joined();
      expect(await b).toMatchObject({ status: 'succeeded', attempt: 1 });
      const before = await runRow(url, 'late-failure', key);
      expect(await a).toMatchObject({ status: 'succeeded', attempt: 1, summary: before.summary });
      expect(await runRow(url, 'late-failure', key)).toEqual(before);
      expect(await workCounts(url, key)).toEqual(ones(3));
    } finally {
      delete (runner.store as { recordChunkFailure?: unknown }).recordChunkFailure;
      await other.close();
    }
  });

  it('failRun records the first failure of a running attempt, and reports it to a second worker', async () => {
    const key = 'cas-fail';
    const { run } = await runner.store.claimRun('cas-fail', key, {}, 'fp');
    await query(url, `update idem.runs set status = 'running', attempt = 1 where id = $1`, [run.id]);
    const first = { step: 's', chunk: 'c1', tries: 1, message: 'first', at: new Date().toISOString() };
    expect(await runner.store.failRun(run.id, 1, first)).toEqual({ kind: 'failed' });
    expect(await runner.store.failRun(run.id, 1, { ...first, message: 'second' })).toEqual({ kind: 'failedElsewhere', error: first });
    expect(await runRow(url, 'cas-fail', key)).toMatchObject({ status: 'failed', error: first });
  });
});

describe('a run stopped (SIGSTOP) past a progress interval, then continued', () => {
  /** The CLI's progress lines (non-TTY: a JSON log line whose message ends in the rate and ETA). */
  const progressLines = (text: string) => text.split('\n').filter((l) => /chunks, [\d.]+\/s, ETA/.test(l));
  it('prints no progress line for the time it was stopped: the first tick after it is skipped, the next ones report as before', async () => {
    const key = 'stopped-progress';
    const interval = 300;
    const a = spawnCli([...STALL_DIRS, 'run', 'stall', '--params', JSON.stringify({ chunks: 200, pauseMs: 20 }), '--key', key], {
      url,
      env: { IDEM_PROGRESS_INTERVAL_MS: String(interval) },
      timeoutMs: 60_000,
    });
    try {
      await waitFor(async () => progressLines(a.stderr()).length >= 2 || undefined, 'two progress lines', { timeoutMs: 20_000 });
      a.child.kill('SIGSTOP');
      // Stopped for five intervals: everything it wrote before has reached us by the end of it.
      await new Promise((r) => setTimeout(r, 5 * interval));
      const before = a.stderr().length;
      a.child.kill('SIGCONT');
      // The tick that was due while it was stopped fires at once when it goes on. Its figures are
      // from before the stop (no chunk ended meanwhile), and a verdict on its lock may be due: it
      // must not print. The next tick comes an interval after it.
      await new Promise((r) => setTimeout(r, interval / 2));
      expect(progressLines(a.stderr().slice(before))).toEqual([]);
      await waitFor(async () => progressLines(a.stderr().slice(before)).length >= 1 || undefined, 'a progress line after the stop', { timeoutMs: 10_000 });
      const r = await a.done;
      expect(r.code, r.stderr).toBe(0);
      expect(await workCounts(url, key)).toEqual(ones(200));
    } finally {
      a.child.kill('SIGCONT');
    }
  });

  it('a job that keeps the event loop blocked (every tick late) still gets its progress reported: only one late tick in a row is skipped', async () => {
    const key = 'blocked-progress';
    const r = await runCli([...STALL_DIRS, 'run', 'stall', '--params', JSON.stringify({ chunks: 5, blockMs: 1500 }), '--key', key], {
      url,
      env: { IDEM_PROGRESS_INTERVAL_MS: '300' },
      timeoutMs: 60_000,
    });
    expect(r.code, r.stderr).toBe(0);
    expect(progressLines(r.stderr).length).toBeGreaterThanOrEqual(1);
    expect(await workCounts(url, key)).toEqual(ones(5));
  });
});
