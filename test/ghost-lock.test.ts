import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { chunkKey } from './fixtures/jobs/counted.ts';
import { FIXTURE_MIGRATIONS, killLeftovers, query, runRow, spawnCli, waitFor, workCounts, type CliProcess } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

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

const STALL_DIRS = ['--jobs-dir', fileURLToPath(new URL('./fixtures/stall-jobs', import.meta.url)), '--migrations-dir', FIXTURE_MIGRATIONS];
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
