import { fileURLToPath } from 'node:url';
import { afterAll, beforeEach, describe, expect, it } from 'vitest';
import { killLeftovers, lines, query, runCli, spawnCli, waitFor } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * `idem run --retry-skipped` runs the chunks a step skipped, and then every later step that had run
 * without them runs again, planned afresh: what the run leaves is what a clean run leaves.
 */
const JOBS = fileURLToPath(new URL('./fixtures/rerun-jobs', import.meta.url));

const db = useTestDatabase({
  idemSchema: true,
  prepare: async (url) => {
    await query(url, 'create table items2 (id int primary key, v int not null default 0)');
    await query(url, 'create table summary2 (run_key text primary key, total bigint, n int)');
    await query(url, 'create table rerun_log (run_key text not null, step text not null, key text not null)');
  },
});
afterAll(killLeftovers);

// Items 1..200: `work` plans ten chunks of 20 ids (keys by first id); a clean run totals 2 * 20100.
const CLEAN_TOTAL = '40200';
beforeEach(async () => {
  await query(db.url, 'delete from items2');
  await query(db.url, 'insert into items2 (id) select generate_series(1, 200)');
});

const run = (job: string, key: string, args: string[] = [], failKeys = '') =>
  runCli(['--jobs-dir', JOBS, 'run', job, '--key', key, ...args], { url: db.url, env: { FAILKEYS: failKeys } });

/** Committed executions of the run's chunks, `step/key` → count. */
async function executions(runKey: string): Promise<Record<string, number>> {
  const rows = await query<{ step: string; key: string; n: number }>(db.url, 'select step, key, count(*)::int as n from rerun_log where run_key = $1 group by step, key', [runKey]);
  return Object.fromEntries(rows.map((r) => [`${r.step}/${r.key}`, r.n]).sort(([a], [b]) => String(a).localeCompare(String(b))));
}

async function total(runKey: string): Promise<{ total: string; n: number } | undefined> {
  return (await query<{ total: string; n: number }>(db.url, 'select total::text, n from summary2 where run_key = $1', [runKey]))[0];
}

async function stepRows(job: string, runKey: string) {
  return query(db.url, `select s.name, s.status, s.planned_all, s.planned, s.finished_at is not null as finished,
      (select count(*)::int from idem.chunks c where c.run_id = s.run_id and c.step = s.name and c.done_at is not null) as done,
      (select count(*)::int from idem.chunks c where c.run_id = s.run_id and c.step = s.name and c.skipped_at is not null) as skipped
    from idem.steps s join idem.runs r on r.id = s.run_id where r.job = $1 and r.run_key = $2 order by s.position`, [job, runKey]);
}

const workKeys = (ids: number[]) => Object.fromEntries(ids.map((lo) => [`work/[${lo},${lo + 20})`, 1]));
const ALL_WORK = Array.from({ length: 10 }, (_, i) => 1 + 20 * i);

describe('--retry-skipped and the steps after the retried chunks', () => {
  it('runs the later steps again after the retried chunks, planned afresh: the run ends as a clean run does', async () => {
    const clean = await run('skipj', 'clean');
    expect(clean.code, clean.stderr).toBe(0);
    expect(await total('clean')).toEqual({ total: CLEAN_TOTAL, n: 1 });

    await query(db.url, 'update items2 set v = 0');
    const first = await run('skipj', 'sk2', [], '41');
    expect(first.code, first.stderr).toBe(0);
    expect(first.stdout).toContain('14 chunks in 3 steps (1 skipped: see idem status, retry with --retry-skipped)');
    // The summary was computed without chunk 41-60.
    expect(await total('sk2')).toEqual({ total: String(40200 - 2 * 1010), n: 1 });

    const retried = await run('skipj', 'sk2', ['--retry-skipped']);
    expect(retried.code, retried.stderr).toBe(0);
    expect(lines(retried.stdout)).toEqual([
      expect.stringMatching(/^job "skipj" succeeded: 14 chunks in 3 steps, 5 executed now in .*\(run key sk2, attempt 2\)$/),
      'steps after the retried chunks run again: summary, tally',
    ]);
    // The total is a clean run's, and the later steps ran exactly once more; `work` once each.
    expect(await total('sk2')).toEqual({ total: CLEAN_TOTAL, n: 2 });
    expect(await executions('sk2')).toEqual({ ...workKeys(ALL_WORK), 'summary/step': 2, 'tally/t1': 2, 'tally/t2': 2, 'tally/t3': 2 });
    expect(await stepRows('skipj', 'sk2')).toEqual([
      { name: 'work', status: 'done', planned_all: true, planned: 10, finished: true, done: 10, skipped: 0 },
      { name: 'summary', status: 'done', planned_all: true, planned: 1, finished: true, done: 1, skipped: 0 },
      { name: 'tally', status: 'done', planned_all: true, planned: 3, finished: true, done: 3, skipped: 0 },
    ]);
    // Done now: a plain rerun and another --retry-skipped change nothing.
    const again = await run('skipj', 'sk2', ['--retry-skipped', '--json']);
    expect(JSON.parse(again.stdout)).toMatchObject({ status: 'already-succeeded', executed: 0 });
    expect(JSON.parse(again.stdout)).not.toHaveProperty('rerunSteps');
    expect(await total('sk2')).toEqual({ total: CLEAN_TOTAL, n: 2 });
  });

  it('three --join workers starting --retry-skipped together revive once: each chunk runs once more, the later steps once more', async () => {
    const first = await run('skipj', 'joined', [], '41,121');
    expect(first.code, first.stderr).toBe(0);
    expect(await total('joined')).toEqual({ total: String(40200 - 2 * 1010 - 2 * 2610), n: 1 });

    // Each tally chunk takes a second, so the three workers share the attempt.
    const workers = await Promise.all([0, 1, 2].map(() => spawnCli(['--jobs-dir', JOBS, 'run', 'skipj', '--key', 'joined', '--join', '--retry-skipped', '--json', '--concurrency', '2'], { url: db.url, env: { FAILKEYS: '', SLOWMS: '1000' } }).done));
    for (const w of workers) expect(w.code, w.stderr).toBe(0);
    const outcomes = workers.map((w) => JSON.parse(w.stdout));
    for (const o of outcomes) expect(o).toMatchObject({ status: 'succeeded', attempt: 2, summary: { chunks: 14, skipped: 0 } });
    // The worker that revived says which steps ran again; the joiners revived nothing.
    expect(outcomes.filter((o) => o.rerunSteps === undefined)).toHaveLength(2);
    expect(outcomes.filter((o) => o.rerunSteps !== undefined).map((o) => o.rerunSteps)).toEqual([['summary', 'tally']]);
    expect(outcomes.reduce((n, o) => n + o.executed, 0)).toBe(2 + 1 + 3);
    expect(await total('joined')).toEqual({ total: CLEAN_TOTAL, n: 2 });
    expect(await executions('joined')).toEqual({ ...workKeys(ALL_WORK), 'summary/step': 2, 'tally/t1': 2, 'tally/t2': 2, 'tally/t3': 2 });
  });

  it('a worker joining the attempt while its first worker is stalled right after entering finds the run revived, and finishes it as a clean run', async () => {
    const first = await run('skipj', 'stalled', [], '41');
    expect(first.code, first.stderr).toBe(0);
    // The first worker bumped the attempt on entering, and stalls there (a slow or stopped process).
    const stalled = spawnCli(['--jobs-dir', JOBS, 'run', 'skipj', '--key', 'stalled', '--join', '--retry-skipped', '--json'], { url: db.url, env: { FAILKEYS: '', IDEM_FAULT: 'after-lock:stall' } });
    try {
      await waitFor(async () => (stalled.stderr().includes('fault injected at after-lock') ? true : undefined), 'the first worker stalled after entering');
      const joined = await runCli(['--jobs-dir', JOBS, 'run', 'skipj', '--key', 'stalled', '--join', '--retry-skipped', '--json'], { url: db.url, env: { FAILKEYS: '' } });
      expect(joined.code, joined.stderr).toBe(0);
      expect(JSON.parse(joined.stdout)).toMatchObject({ status: 'succeeded', attempt: 2, executed: 1 + 1 + 3, summary: { chunks: 14, skipped: 0 } });
    } finally {
      stalled.child.kill('SIGKILL');
      await stalled.done;
    }
    expect(await total('stalled')).toEqual({ total: CLEAN_TOTAL, n: 2 });
    expect(await executions('stalled')).toEqual({ ...workKeys(ALL_WORK), 'summary/step': 2, 'tally/t1': 2, 'tally/t2': 2, 'tally/t3': 2 });
  });

  it('skipped chunks only in the last step: the steps before it do not run again, and nothing says so', async () => {
    const first = await run('skiplast', 'last', [], 'k2');
    expect(first.code, first.stderr).toBe(0);
    expect(first.stdout).toContain('5 chunks in 2 steps (1 skipped: see idem status, retry with --retry-skipped)');
    const before = await query(db.url, `select s.name, s.finished_at from idem.steps s join idem.runs r on r.id = s.run_id where r.run_key = 'last' and s.name = 'prep'`);

    const retried = await run('skiplast', 'last', ['--retry-skipped', '--json']);
    expect(retried.code, retried.stderr).toBe(0);
    const outcome = JSON.parse(retried.stdout);
    expect(outcome).toMatchObject({ status: 'succeeded', attempt: 2, executed: 1, summary: { chunks: 5, skipped: 0 } });
    expect(outcome).not.toHaveProperty('rerunSteps');
    expect(await executions('last')).toEqual({ 'prep/step': 1, 'work/k1': 1, 'work/k2': 1, 'work/k3': 1, 'work/k4': 1 });
    expect(await query(db.url, `select s.name, s.finished_at from idem.steps s join idem.runs r on r.id = s.run_id where r.run_key = 'last' and s.name = 'prep'`)).toEqual(before);
    expect(await stepRows('skiplast', 'last')).toEqual([
      { name: 'prep', status: 'done', planned_all: true, planned: 1, finished: true, done: 1, skipped: 0 },
      { name: 'work', status: 'done', planned_all: true, planned: 4, finished: true, done: 4, skipped: 0 },
    ]);
  });
});
