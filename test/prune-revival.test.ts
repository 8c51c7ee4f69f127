import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { lockKey } from '../src/fingerprint.ts';
import type { Runner } from '../src/runner.ts';
import skippy from './fixtures/more-jobs/skippy.ts';
import { busyMessage, killLeftovers, query, runCli, runRow, spawnCli, waitFor, type CliProcess, lockWaiters } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * `idem prune` against `idem run … --retry-skipped`, which brings an old succeeded run back to
 * running: prune must never delete any part of a run a process is reviving or running, must never
 * leave a run half deleted, and must not deadlock with the revival.
 */

const MORE_JOBS = fileURLToPath(new URL('./fixtures/more-jobs', import.meta.url));

const testDb = useTestDatabase({ fixtureTables: true, runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});
afterEach(async () => {
  await killLeftovers();
  await query(url, 'delete from fail_chunks');
  // Each test counts what prune removes: no test may leave an old run behind for the next one
  // (the tests run in any order under CI's shuffle).
  for (const table of ['effects', 'chunks', 'steps']) await query(url, `delete from idem.${table} where run_id in (select id from idem.runs where job = 'skippy')`);
  await query(url, `delete from idem.runs where job = 'skippy'`);
});
afterAll(killLeftovers);

const retry = (key: string) => spawnCli(['--jobs-dir', MORE_JOBS, 'run', 'skippy', '--key', key, '--retry-skipped', '--json'], { url });
const prune = () => spawnCli(['prune', '--older-than', '30m', '--json'], { url });
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/**
 * A succeeded skippy run finished an hour ago with one skipped chunk (c0003) and `padding` more
 * done markers, so that prune deletes its chunks in several batches. Returns its id and how many
 * chunk rows it has.
 */
async function oldSucceededRun(key: string, padding: number): Promise<{ id: string; chunks: number }> {
  await query(url, `insert into fail_chunks values ('c0003', null, null) on conflict do nothing`);
  const first = await runner.run(skippy, { key });
  await query(url, 'delete from fail_chunks');
  expect(first).toMatchObject({ status: 'succeeded' });
  expect(first.summary?.skipped).toBe(1);
  const id = String(first.runId);
  await query(
    url,
    `insert into idem.chunks (run_id, step, key, seq, spec, done_at, done_attempt, attempts)
     select $1, 'work', 'p' || lpad(g::text, 6, '0'), 5 + g, jsonb_build_object('key', 'p' || g), now(), 1, 1 from generate_series(1, $2::int) g`,
    [id, padding],
  );
  await query(url, 'update idem.steps set planned = planned + $2 where run_id = $1', [id, padding]);
  await query(url, `update idem.runs set finished_at = now() - interval '1 hour', updated_at = now() - interval '1 hour' where id = $1`, [id]);
  return { id, chunks: await chunkCount(id) };
}

async function chunkCount(id: string): Promise<number> {
  return (await query(url, 'select count(*)::int as n from idem.chunks where run_id = $1', [id]))[0].n;
}

/** Rows the run owns in each of idem's tables. */
async function owned(id: string) {
  const [row] = await query(
    url,
    `select (select count(*) from idem.runs where id = $1)::int as runs, (select count(*) from idem.steps where run_id = $1)::int as steps,
       (select count(*) from idem.chunks where run_id = $1)::int as chunks`,
    [id],
  );
  return row as { runs: number; steps: number; chunks: number };
}

describe('prune and a run revived by --retry-skipped', () => {
  it('prune leaves alone a run whose own lock a process holds (a worker entering it), and says it skipped it', async () => {
    const key = 'held-run-lock';
    const { id, chunks } = await oldSucceededRun(key, 100);
    // A worker entering a run holds the run's lock shared before it bumps the attempt.
    const worker = new pg.Client({ connectionString: url });
    await worker.connect();
    try {
      await worker.query('select pg_advisory_lock_shared($1::bigint)', [lockKey(`idem:run:${id}`)]);
      const p = await prune().done;
      expect(p.code, p.stderr).toBe(0);
      expect(JSON.parse(p.stdout)).toMatchObject({ runs: 0, chunks: 0, skipped: 1 });
      expect(await owned(id)).toEqual({ runs: 1, steps: 1, chunks });
    } finally {
      await worker.end();
    }
    const text = await runCli(['prune', '--older-than', '30m'], { url });
    expect(text.stdout).toBe('prune: removed 1 run, 1 step, 105 chunk markers, 0 effects older than 30m\n');
    expect(await owned(id)).toEqual({ runs: 0, steps: 0, chunks: 0 });
  });

  it('while a run\'s lock is held exclusively (prune or reset deleting it), a retry and a reset of it are busy, naming that, and change nothing', async () => {
    const key = 'held-exclusive';
    const { id, chunks } = await oldSucceededRun(key, 10);
    const deleter = new pg.Client({ connectionString: url });
    await deleter.connect();
    try {
      await deleter.query('select pg_advisory_lock($1::bigint)', [lockKey(`idem:run:${id}`)]);
      const r = await retry(key).done;
      expect(r.code, r.stderr).toBe(75);
      expect(busyMessage(r.stderr)).toBe(`busy: run "${key}" of job "skippy" is being deleted in another process (idem prune or idem reset holds its lock); run the command again once that has ended`);
      const reset = await runCli(['--jobs-dir', MORE_JOBS, 'reset', 'skippy', '--key', key], { url });
      expect(reset.code, reset.stderr).toBe(75);
      expect(busyMessage(reset.stderr)).toBe(`busy: run "${key}" of job "skippy" is being deleted in another process (idem prune or idem reset holds its lock); try again once that has ended`);
      expect(await owned(id)).toEqual({ runs: 1, steps: 1, chunks });
      expect(await runRow(url, 'skippy', key)).toMatchObject({ status: 'succeeded', attempt: 1 });
    } finally {
      await deleter.end();
    }
  });

  it('a retry that starts while prune is deleting the run is refused (exit 75, naming why) and the run goes whole', async () => {
    const key = 'prune-first';
    const { id } = await oldSucceededRun(key, 30_000);
    // One marker near the end is row-locked, so prune stalls part way through the run's chunks.
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    let pruning: CliProcess | undefined;
    let retrying: CliProcess | undefined;
    try {
      await holder.query('begin');
      await holder.query(`select 1 from idem.chunks where run_id = $1 and key = 'p029999' for update`, [id]);
      pruning = prune();
      await waitFor(async () => (await lockWaiters(url)) >= 1, 'prune to stall on the held marker');
      retrying = retry(key);
      let exited = false;
      void retrying.done.then(() => (exited = true));
      // Fixed: the retry is refused at once. Before: it went on and blocked on prune's rows.
      await waitFor(async () => exited || (await lockWaiters(url)) >= 2, 'the retry to exit or block');
      await holder.query('commit');
    } finally {
      await holder.end();
    }
    const [p, r] = await Promise.all([pruning!.done, retrying!.done]);
    expect(p.code, p.stderr).toBe(0);
    expect(JSON.parse(p.stdout)).toMatchObject({ runs: 1, chunks: 30_005, skipped: 0 });
    expect(r.code, r.stderr).toBe(75);
    expect(busyMessage(r.stderr)).toBe(`busy: run "${key}" of job "skippy" is being deleted in another process (idem prune or idem reset holds its lock); run the command again once that has ended`);
    expect(await owned(id)).toEqual({ runs: 0, steps: 0, chunks: 0 });
    // Afterwards the key is free and runs afresh.
    const again = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'skippy', '--key', key, '--json'], { url });
    expect(again.code, again.stderr).toBe(0);
    expect(JSON.parse(again.stdout)).toMatchObject({ status: 'succeeded', attempt: 1, executed: 5 });
  });

  it('a run revived and paused inside its retried chunk is neither deleted nor touched by prune, and its retry completes', async () => {
    const key = 'revived-first';
    const { id, chunks } = await oldSucceededRun(key, 100);
    const table = new pg.Client({ connectionString: url });
    await table.connect();
    let retrying: CliProcess | undefined;
    try {
      // The retried chunk reads fail_chunks: it waits inside its transaction while this is held.
      await table.query('begin');
      await table.query('lock table fail_chunks in access exclusive mode');
      retrying = retry(key);
      await waitFor(async () => (await lockWaiters(url)) >= 1, 'the retried chunk to wait');
      expect(await runRow(url, 'skippy', key)).toMatchObject({ status: 'running', attempt: 2 });
      const p = await prune().done;
      expect(p.code, p.stderr).toBe(0);
      expect(JSON.parse(p.stdout)).toMatchObject({ runs: 0, chunks: 0 });
      expect(await owned(id)).toEqual({ runs: 1, steps: 1, chunks });
      await table.query('commit');
    } finally {
      await table.end();
    }
    const r = await retrying!.done;
    expect(r.code, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout)).toMatchObject({ status: 'succeeded', attempt: 2, executed: 1 });
    expect(await owned(id)).toEqual({ runs: 1, steps: 1, chunks });
    expect((await query(url, 'select count(*)::int as n from idem.chunks where run_id = $1 and done_at is null', [id]))[0].n).toBe(0);
  });

  /**
   * Kills a prune while it waits in its third batch of the run's chunks (one marker near the end is
   * row-locked), so the first two batches are deleted and committed and the rest is not.
   */
  async function killPruneMidway(id: string, chunks: number): Promise<void> {
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      await holder.query('begin');
      await holder.query(`select 1 from idem.chunks where run_id = $1 and key = 'p029999' for update`, [id]);
      const pruning = prune();
      await waitFor(async () => (await lockWaiters(url)) >= 1 && (await chunkCount(id)) < chunks, 'prune to delete some batches and stall on the held marker');
      pruning.child.kill('SIGKILL');
      expect((await pruning.done).code).toBeNull();
      // Its backend would still finish the waiting DELETE once the marker is free: end it, as the
      // server does when it finds the client gone.
      await holder.query(`select pg_terminate_backend(pid) from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'`);
      await waitFor(async () => (await lockWaiters(url)) === 0, "the killed prune's backend to end");
      await holder.query('rollback');
    } finally {
      await holder.end();
    }
    const left = await owned(id);
    expect(left.runs).toBe(1);
    expect(left.chunks).toBeGreaterThan(0);
    expect(left.chunks).toBeLessThan(chunks);
  }

  it('a prune killed between its batches leaves the run marked deleting, never succeeded; a rerun of its key finishes the deletion and runs afresh', async () => {
    const key = 'killed-prune';
    const { id, chunks } = await oldSucceededRun(key, 30_000);
    await killPruneMidway(id, chunks);
    // Before: still "succeeded" with a third of its markers, and --retry-skipped would revive it.
    expect(await runRow(url, 'skippy', key)).toMatchObject({ id, status: 'deleting' });
    const shown = await runCli(['--jobs-dir', MORE_JOBS, 'status', 'skippy', '--json'], { url });
    expect(shown.code, shown.stderr).toBe(0);
    expect(JSON.parse(shown.stdout)).toEqual(expect.arrayContaining([expect.objectContaining({ runKey: key, state: 'deleting' })]));
    for (const verb of ['pause', 'cancel', 'resume']) {
      const r = await runCli(['--jobs-dir', MORE_JOBS, verb, 'skippy', '--key', key], { url });
      expect(r.code, r.stderr).toBe(2);
      expect(r.stderr).toContain(`idem: error: run "${key}" of job "skippy" is being deleted (an idem prune stopped part way through it): nothing to ${verb}; idem prune finishes deleting it, and idem run skippy --key ${key} runs the key afresh`);
    }
    expect(await runRow(url, 'skippy', key)).toMatchObject({ id, status: 'deleting', requested: null });
    const r = await retry(key).done;
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout);
    expect(out).toMatchObject({ status: 'succeeded', attempt: 1, executed: 5 });
    expect(String(out.runId)).not.toBe(id);
    expect(await owned(id)).toEqual({ runs: 0, steps: 0, chunks: 0 });
    expect(await runRow(url, 'skippy', key)).toMatchObject({ status: 'succeeded', attempt: 1 });
  });

  it('the next prune finishes a run a killed prune left, whatever its age', async () => {
    const key = 'killed-prune-2';
    const { id, chunks } = await oldSucceededRun(key, 30_000);
    await killPruneMidway(id, chunks);
    const left = await owned(id);
    const p = await runCli(['prune', '--older-than', '30d', '--json'], { url });
    expect(p.code, p.stderr).toBe(0);
    expect(JSON.parse(p.stdout)).toEqual({ runs: 1, steps: 1, chunks: left.chunks, effects: 0, skipped: 0 });
    expect(await owned(id)).toEqual({ runs: 0, steps: 0, chunks: 0 });
  });

  it('prune racing a revival never deadlocks, never fails either, and leaves the run whole or gone whole', async () => {
    const outcomes: string[] = [];
    for (let trial = 0; trial < 8; trial++) {
      const key = `race-${trial}`;
      const { id, chunks } = await oldSucceededRun(key, 30_000);
      const pruning = prune();
      await sleep((trial * 20) % 150);
      const retrying = retry(key);
      const [p, r] = await Promise.all([pruning.done, retrying.done]);
      expect(p.code, `trial ${trial}: ${p.stderr}`).toBe(0);
      expect(p.stderr).not.toMatch('deadlock');
      expect(r.stderr).not.toMatch('deadlock');
      const left = await owned(id);
      if (r.code === 0 && JSON.parse(r.stdout).attempt === 1) {
        // Prune was done before the retry even read the run: the key ran afresh, as a new run.
        expect(JSON.parse(r.stdout), `trial ${trial}`).toMatchObject({ status: 'succeeded', executed: 5 });
        expect(left, `trial ${trial}`).toEqual({ runs: 0, steps: 0, chunks: 0 });
        outcomes.push('afresh');
      } else if (r.code === 0) {
        // The revival won: the run is all there, and its skipped chunk ran.
        expect(JSON.parse(r.stdout), `trial ${trial}`).toMatchObject({ status: 'succeeded', attempt: 2, executed: 1 });
        expect(left, `trial ${trial}`).toEqual({ runs: 1, steps: 1, chunks });
        expect(await runRow(url, 'skippy', key)).toMatchObject({ status: 'succeeded' });
        outcomes.push('revived');
      } else {
        // Prune won: the retry was refused and nothing of the run is left.
        expect(r.code, `trial ${trial}: ${r.stderr}`).toBe(75);
        expect(busyMessage(r.stderr), `trial ${trial}`).toMatch(/^busy: run "race-\d" of job "skippy" (is being deleted|was deleted)/);
        expect(left, `trial ${trial}`).toEqual({ runs: 0, steps: 0, chunks: 0 });
        outcomes.push('pruned');
      }
    }
    console.log(`prune vs retry: ${outcomes.join(', ')}`);
  }, 240_000);
});
