import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { chunkKey } from './fixtures/jobs/counted.ts';
import { STALL_DIRS, killLeftovers, query, runRow, spawnCli, waitFor, workCounts, type CliProcess } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { defineJob, exitCodeOf, Runner } from '../src/index.ts';

/**
 * A process that went silent while holding its lock: its host vanished behind PgBouncer (whose
 * server connection stays healthy, so the server's keepalives never fire), or it was stopped.
 * SIGSTOP is the cheap, real reproduction: the kernel still answers keepalives for the stopped
 * process, so the server sees a healthy, idle lock session. The lock session's own
 * idle_session_timeout ends it; tests shorten the check interval it derives from.
 */
const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
let url: string;
beforeAll(() => {
  ({ url } = testDb);
});
afterAll(killLeftovers);

/** The lock's check interval in these tests: the lock session's idle timeout is 30 of them (6 s), "looks dead" 15 (3 s). */
const CHECK_MS = 200;
const IDLE_MS = 30 * CHECK_MS;
const ENV = { IDEM_LOCK_CHECK_INTERVAL_MS: String(CHECK_MS), IDEM_IDLE_IN_TRANSACTION_TIMEOUT_MS: '1000' };

const ones = (n: number) => new Map(Array.from({ length: n }, (_, i) => [chunkKey(i + 1), 1]));
const params = (chunks: number, pauseMs: number) => JSON.stringify({ chunks, pauseMs });
const stall = (key: string, chunks: number, pauseMs: number, extra: readonly string[] = []) =>
  spawnCli([...STALL_DIRS, 'run', 'stall', '--params', params(chunks, pauseMs), '--key', key, ...extra], { url, env: ENV, timeoutMs: 60_000 });
const doneBy = async (key: string, pid: number) =>
  (await query<{ n: number }>(url, 'select count(*)::int as n from work_log where run_key = $1 and pid = $2', [key, pid]))[0]!.n;
const committing = (key: string, p: CliProcess) => waitFor(async () => ((await doneBy(key, p.pid)) >= 3 ? true : undefined), 'the first process committing chunks');

/** Stops a process; cleanup always continues and kills it. */
async function stopped<T>(p: CliProcess, fn: () => Promise<T>): Promise<T> {
  p.child.kill('SIGSTOP');
  try {
    return await fn();
  } finally {
    p.child.kill('SIGCONT');
  }
}

describe('a lock holder gone silent (SIGSTOP) is ended by the server', () => {
  it('a second run --wait takes the run over within the idle timeout; every chunk commits once; the stopped process exits 69 and commits nothing after', async () => {
    const key = 'ghost-takeover';
    const chunks = 60;
    const a = stall(key, chunks, 50);
    await committing(key, a);
    let b!: CliProcess;
    let stoppedAt = 0;
    const rb = await stopped(a, async () => {
      stoppedAt = Date.now();
      b = stall(key, chunks, 50, ['--wait', '20', '--concurrency', '4']);
      return b.done;
    });
    expect(rb.code, rb.stderr).toBe(0);
    // Taken over once the lock session had been silent IDLE_MS; the rest of the run is quick.
    expect(rb.endedAt - stoppedAt).toBeLessThan(IDLE_MS + 8_000);
    expect(await runRow(url, 'stall', key)).toMatchObject({ status: 'succeeded', attempt: 2, error: null });
    const before = await doneBy(key, a.pid);
    const ra = await a.done;
    expect(ra.timedOut).toBe(false);
    expect(ra.code, ra.stderr).toBe(69);
    expect(ra.stderr).toMatch(/lost the advisory lock for job "stall": the server ended its session after 6s without a statement from this process|fenced off/);
    expect(await doneBy(key, a.pid)).toBe(before);
    expect(await workCounts(url, key)).toEqual(ones(chunks));
    // Nothing of the first attempt was committed after the second began.
    const [late] = await query<{ n: number }>(url, `select count(*)::int as n from work_log w join idem.runs r on r.run_key = w.run_key where w.run_key = $1 and w.attempt = 1 and w.logged_at > r.attempt_started_at`, [key]);
    expect(late!.n).toBe(0);
  });
});

describe('operators see a silent lock holder', () => {
  /** The readers' check interval: a holder silent for 15 of them (1.5 s) looks dead to them. */
  const READER = { IDEM_LOCK_CHECK_INTERVAL_MS: '100', IDEM_IDLE_IN_TRANSACTION_TIMEOUT_MS: '1000' };
  /** The stopped worker checks every second: the server ends its lock session only after 30 s, past this test. */
  const GHOST = { IDEM_LOCK_CHECK_INTERVAL_MS: '1000', IDEM_IDLE_IN_TRANSACTION_TIMEOUT_MS: '1000' };
  const worker = (key: string, env: Record<string, string>, extra: readonly string[] = [], chunks = 120) =>
    spawnCli([...STALL_DIRS, 'run', 'stall', '--params', params(chunks, 40), '--key', key, '--join', ...extra], { url, env, timeoutMs: 60_000 });
  const cli = (args: readonly string[]) => spawnCli([...STALL_DIRS, ...args], { url, env: READER }).done;
  const lockBackend = async (p: CliProcess) =>
    (await query<{ pid: number }>(url, `select pid from pg_stat_activity where application_name like 'idem-lock %:' || $1`, [String(p.pid)]))[0]?.pid;
  const silentFor = (backend: number, seconds: number) =>
    waitFor(async () => ((await query<{ s: number }>(url, 'select extract(epoch from now() - state_change)::float8 as s from pg_stat_activity where pid = $1', [backend]))[0]!.s > seconds ? true : undefined), `the lock session silent for ${seconds}s`);

  it('status marks the stopped worker silent and rates the run by the live one; once the run is done, status and a busy run name the ghost holder and the fix', async () => {
    const key = 'ghost-seen';
    // Enough chunks that the live worker is still at them while both status reads are made: with
    // 120, a loaded machine (the clean-clone CI of 2026-12-04) saw the run end between the two.
    const chunks = 300;
    const a = worker(key, GHOST, [], chunks);
    try {
      await committing(key, a);
      const c = worker(key, READER, [], chunks);
      await waitFor(async () => ((await doneBy(key, c.pid)) >= 3 ? true : undefined), 'the second worker committing chunks');
      const backend = (await lockBackend(a))!;
      expect(backend).toBeGreaterThan(0);
      await stopped(a, async () => {
        await silentFor(backend, 1.6);
        const live = await cli(['status', 'stall', '--key', key, '--json']);
        expect(live.code, live.stderr).toBe(0);
        const run = JSON.parse(live.stdout) as { state: string; throughput: number | null; workers: Array<{ worker: string; silent: boolean; silentSeconds: number; rate: number }> };
        expect(run.state).toBe('running');
        const ghost = run.workers.find((w) => w.worker.endsWith(`:${a.pid}`))!;
        const other = run.workers.find((w) => w.worker.endsWith(`:${c.pid}`))!;
        expect(ghost).toMatchObject({ silent: true });
        expect(ghost.silentSeconds).toBeGreaterThanOrEqual(1);
        expect(other).toMatchObject({ silent: false });
        // The run's rate is the live worker's alone.
        expect(run.throughput).toBe(other.rate);
        const detail = await cli(['status', 'stall', '--key', key]);
        expect(detail.stdout).toMatch(new RegExp(`:${a.pid} \\(\\d+ chunks, [\\d.]+/s, silent \\d+s: looks dead, not counted in the rate\\)`));

        // The live worker finishes the run (the stopped one's open chunk was ended by the server).
        const rc = await c.done;
        expect(rc.code, rc.stderr).toBe(0);
        expect(await runRow(url, 'stall', key)).toMatchObject({ status: 'succeeded' });
        const table = await cli(['status']);
        expect(table.code, table.stderr).toBe(0);
        expect(table.stdout).toContain(`job "stall": no run of it is live, yet its lock is held by backend ${backend} (idem-lock `);
        expect(table.stdout).toMatch(new RegExp(`held by backend ${backend} \\(idem-lock [^,]+:${a.pid}, silent \\d+s\\): it looks dead .*select pg_terminate_backend\\(${backend}\\).*; new runs of it exit 75 \\(busy\\) until that session ends`));
        const busy = await cli(['run', 'stall', '--params', params(3, 0), '--key', 'another']);
        expect(busy.code, busy.stderr).toBe(75);
        expect(busy.stderr).toMatch(new RegExp(`its advisory lock is held by backend ${backend} \\(idem-lock [^,]+:${a.pid}, silent \\d+s\\): it looks dead \\(a live idem sends a statement on its lock session every 0.1s; none comes from a process stopped, cut off behind a proxy, or whose job blocks its event loop\\), end it with select pg_terminate_backend\\(${backend}\\) \\(safe: `));
      });
      expect(await workCounts(url, key)).toEqual(ones(chunks));
    } finally {
      a.child.kill('SIGKILL');
    }
  });
});

describe('RunnerOptions.lockIdleTimeoutMs', () => {
  // The lock's checks every 0.1 s here (the idle timeout 3 s by default); a chunk blocks the event
  // loop for 4 s, as synchronous work in a job does: no check, no statement on the lock session.
  const blocking = defineJob({
    name: 'blocks-loop',
    steps: [{ name: 'work', chunks: () => ({ chunks: [{ key: 'a' }], next: null }), run: () => void busyWait(4_000) }],
  });
  const busyWait = (ms: number) => {
    const until = Date.now() + ms;
    while (Date.now() < until);
  };

  it('by default a job blocking the event loop past it loses its lock (69); 0 turns it off and the run succeeds', async () => {
    const before = process.env.IDEM_LOCK_CHECK_INTERVAL_MS;
    process.env.IDEM_LOCK_CHECK_INTERVAL_MS = '100';
    try {
      const runner = await Runner.connect({ connectionString: url });
      const off = await Runner.connect({ connectionString: url, lockIdleTimeoutMs: 0 });
      try {
        const lost = await runner.run(blocking, { key: 'default' }).catch((e: unknown) => e);
        expect(exitCodeOf(lost)).toBe(69);
        expect(String((lost as Error).message)).toMatch(/the server ended its session after 3s without a statement from this process/);
        expect((await off.run(blocking, { key: 'off' })).status).toBe('succeeded');
      } finally {
        await runner.close();
        await off.close();
      }
      await expect(Runner.connect({ connectionString: url, lockIdleTimeoutMs: 5_000 })).rejects.toThrow(/lockIdleTimeoutMs must be 0 \(off\) or an integer of at least 20000 ms/);
    } finally {
      if (before === undefined) delete process.env.IDEM_LOCK_CHECK_INTERVAL_MS;
      else process.env.IDEM_LOCK_CHECK_INTERVAL_MS = before;
    }
  }, 60_000);
});
