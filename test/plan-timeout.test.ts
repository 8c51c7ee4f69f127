import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { FIXTURE_DIRS, lines, query, spawnCli, waitFor, type CliProcess } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

// Black-box round (fix-plan): a statement_timeout or lock_timeout cut short idem's own
// window-planning statement while it waited on the step row another session held FOR UPDATE, and
// the run was marked failed (exit 1): in step "work" for 57014, in step "(runner)" for 55P03.

const testDb = useTestDatabase({ fixtureTables: true });
let url: string;
/** Watches pg_stat_activity, on one session: a new one per look would miss a short wait. */
let watcher: pg.Client;
beforeAll(async () => {
  url = testDb.url;
  watcher = new pg.Client({ connectionString: url, application_name: 'test-watcher' });
  await watcher.connect();
});
afterAll(async () => {
  await watcher.end();
});

const CHUNKS = 400;
const params = JSON.stringify({ chunks: CHUNKS, pauseMs: 5, label: 'x', gate: null });
const withOptions = (options: string) => {
  const u = new URL(url);
  u.searchParams.set('options', options);
  return u.toString();
};

/**
 * Once `key`'s run has done a few `work` chunks (its later windows not planned yet), holds the
 * step row `for update`, as another worker planning (or an operator) would, until idem's planner
 * has been seen waiting on it (a session of idem's waiting on a lock, or its log line saying the
 * wait was cut short), then `hold` ms longer, or until `hold()` settles. Returns how many chunks
 * were planned when it let go.
 */
async function holdStepRow(key: string, run: CliProcess, hold: number | (() => Promise<void>)): Promise<{ plannedAtRelease: number }> {
  await waitFor(async () => ((await query<{ n: number }>(url, `select count(*)::int as n from work_log where run_key = $1 and step = 'work'`, [key]))[0]!.n >= 5 ? true : undefined), 'the run to be under way', { timeoutMs: 30_000, intervalMs: 20 });
  const holder = new pg.Client({ connectionString: url, application_name: 'test-step-holder' });
  await holder.connect();
  try {
    await holder.query('set statement_timeout = 0; set lock_timeout = 0');
    await holder.query('begin');
    await holder.query(`select 1 from idem.steps where run_id = (select id from idem.runs where run_key = $1) and name = 'work' for update`, [key]);
    const waiting = `select count(*)::int as n from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock' and application_name like 'idem %:' || $1`;
    await waitFor(
      async () => (run.stderr().includes('planning a window waited on a lock') || (await watcher.query<{ n: number }>(waiting, [String(run.pid)])).rows[0]!.n > 0 ? true : undefined),
      "idem's planner waiting on the step row",
      { timeoutMs: 30_000, intervalMs: 10 },
    );
    await (typeof hold === 'number' ? new Promise((r) => setTimeout(r, hold)) : hold());
    const { rows: [s] } = await holder.query<{ planned: number }>(`select planned from idem.steps where run_id = (select id from idem.runs where run_key = $1) and name = 'work'`, [key]);
    await holder.query('commit');
    return { plannedAtRelease: s!.planned };
  } finally {
    await holder.end();
  }
}

async function expectEveryChunkOnce(key: string): Promise<void> {
  expect(await query(url, `select chunk_key from work_log where run_key = $1 and step = 'work' group by chunk_key having count(*) <> 1`, [key])).toEqual([]);
  expect(await query(url, `select count(distinct chunk_key)::int as n from work_log where run_key = $1 and step = 'work'`, [key])).toEqual([{ n: CHUNKS }]);
}

describe("idem's window planning waiting on the step row another session holds", () => {
  for (const [setting, options] of [
    ['statement_timeout', '-c statement_timeout=300'],
    ['lock_timeout', '-c lock_timeout=100'],
  ] as const) {
    it(`cut short by ${setting}: planning is sent again, and the run completes once the lock is let go, every chunk once`, async () => {
      const key = `plan-${setting}`;
      const run = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', key, '--concurrency', '2', '--json'], { url: withOptions(options), timeoutMs: 90_000 });
      // Held 2 s past the first wait seen: longer than the timeout, and than the retries a
      // lock_timeout's 55P03 had (five, about 1.5 s).
      const held = await holdStepRow(key, run, 2_000);
      const r = await run.done;
      // The planner was held up: not all of the step was planned while the lock was held.
      expect(held.plannedAtRelease).toBeLessThan(CHUNKS);
      expect(r.code, r.stderr).toBe(0);
      expect(JSON.parse(r.stdout)).toMatchObject({ status: 'succeeded' });
      expect(r.stderr).toContain('planning a window waited on a lock past the');
      const [row] = await query(url, `select status, error from idem.runs where run_key = $1`, [key]);
      expect(row).toEqual({ status: 'succeeded', error: null });
      await expectEveryChunkOnce(key);
    });
  }

  it('held past the bound: exit 2, idem.statementTimeout naming the setting, the run left interrupted (not failed); the rerun completes it', async () => {
    const key = 'plan-bound';
    const timed = withOptions('-c statement_timeout=300');
    const run = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', key, '--concurrency', '2', '--json'], {
      url: timed,
      timeoutMs: 90_000,
      env: { IDEM_LOCK_WAIT_BOUND_MS: '1500' },
    });
    const held = await holdStepRow(key, run, 4_000);
    const r = await run.done;
    expect(held.plannedAtRelease).toBeLessThan(CHUNKS);
    expect(r.code, r.stderr).toBe(2);
    expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([
      "idem: error: the database cancelled a statement of idem's at the statement_timeout set by -c statement_timeout in DATABASE_URL's options: it waited on a lock or ran longer; raise or remove -c statement_timeout in DATABASE_URL's options (a setting there overrides the role's and the database's), then run the same command again",
    ]);
    expect(JSON.parse(r.stdout)).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.statementTimeout' });
    const [row] = await query(url, `select status, error from idem.runs where run_key = $1`, [key]);
    expect(row).toEqual({ status: 'interrupted', error: null });
    // Run again once the lock is gone: it resumes and completes, every chunk once.
    const again = await spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', key, '--concurrency', '2'], { url: timed, timeoutMs: 90_000 }).done;
    expect(again.code, again.stderr).toBe(0);
    await expectEveryChunkOnce(key);
  });

  it('SIGTERM while planning waits: the worker stops at the next cut, exit 143, the run interrupted (not after the bound, not exit 2); the rerun completes it', async () => {
    const key = 'plan-sigterm';
    const timed = withOptions('-c statement_timeout=300');
    const run = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', key, '--concurrency', '2', '--json'], { url: timed, timeoutMs: 90_000 });
    let exitedWhileHeld = false;
    const held = await holdStepRow(key, run, async () => {
      // Seen waiting: ask it to stop. Before, it went on sending the planning statement again for
      // the whole bound (30 s), then stopped with exit 2 as if the wait had run out.
      run.child.kill('SIGTERM');
      exitedWhileHeld = await Promise.race([run.done.then(() => true), new Promise<boolean>((r) => setTimeout(() => r(false), 15_000))]);
    });
    const r = await run.done;
    expect(held.plannedAtRelease).toBeLessThan(CHUNKS);
    expect(exitedWhileHeld, r.stderr).toBe(true);
    expect(r.code, r.stderr).toBe(143);
    expect(JSON.parse(r.stdout)).toMatchObject({ status: 'error', exitCode: 143 });
    const [row] = await query(url, `select status, error from idem.runs where run_key = $1`, [key]);
    expect(row).toEqual({ status: 'interrupted', error: null });
    const again = await spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', key, '--concurrency', '2'], { url: timed, timeoutMs: 90_000 }).done;
    expect(again.code, again.stderr).toBe(0);
    await expectEveryChunkOnce(key);
  });
});
