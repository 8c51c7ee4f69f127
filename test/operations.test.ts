import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, InterruptedError, Runner, sql, type StepContext } from '../src/index.ts';
import { CancelledError } from '../src/errors.ts';
import type { Progress } from '../src/executor.ts';
import { createProgressReporter, formatProgress } from '../src/progress-reporter.ts';
import pino from 'pino';
import { RunViews } from '../src/server/run-view.ts';
import { resolveThrottle, Throttle } from '../src/throttle.ts';
import counted, { chunkKey } from './fixtures/jobs/counted.ts';
import ranged from './fixtures/jobs/ranged.ts';
import sized, { SIZED_DDL, SIZED_NOMINAL } from './fixtures/sized-jobs/sized.ts';
import { withClient } from './fixtures/tables.ts';
import { busyMessage, chunkRows, lines, expectFaultCrash, FIXTURE_DIRS, holdGate, killLeftovers, query, runCli, runRow, sessions, snapshot, spawnCli, waitFor, workCounts, lockWaiters } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

const SIZED_JOBS = fileURLToPath(new URL('./fixtures/sized-jobs', import.meta.url));

const testDb = useTestDatabase({ fixtureTables: true, prepare: (url) => withClient(url, (c) => c.query(SIZED_DDL)), runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});

afterEach(async () => {
  await killLeftovers();
  await query(url, 'delete from fail_chunks');
});

afterAll(killLeftovers);

/** The CLI on the fixture jobs, to completion. */
const idem = (args: readonly string[], env?: Record<string, string>) => runCli([...FIXTURE_DIRS, ...args], { url, ...(env ? { env } : {}) });
const countedArgs = (key: string, params: object, extra: readonly string[] = []) => [...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify(params), '--key', key, ...extra];
const ones = (n: number) => new Map(Array.from({ length: n }, (_, i) => [chunkKey(i + 1), 1]));
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Keys of the counted job's `work` chunks whose marker committed. */
async function doneWork(runKey: string): Promise<string[]> {
  return (await chunkRows(url, 'counted', runKey, 'work')).filter((c) => c.done_at !== null).map((c) => c.key);
}

/** Waits until some session of this database waits on a lock: a chunk stuck at a gate or row lock. */
async function someoneBlocked(): Promise<void> {
  await waitFor(
    async () => (await lockWaiters(url)) > 0,
    'a chunk to block on a held lock',
  );
}

/** Waits until a live CLI run logs that it saw the operator's request (it polls every second). */
async function requestSeen(child: ReturnType<typeof spawnCli>, what: 'pause' | 'cancel'): Promise<void> {
  await waitFor(async () => child.stderr().includes(`${what} requested by an operator`), `the live run to see the ${what} request`);
}

const RUN_TABLES = ['idem.runs', 'idem.steps', 'idem.chunks', 'idem.effects', 'work_log', 'counted_state'] as const;

describe('pause and resume', () => {
  it('pausing a live run lets its in-flight chunk finish, then it exits 75 and stays paused until idem resume', async () => {
    const key = 'op-pause';
    const params = { chunks: 8, gate: 'g-pause' };
    const gate = await holdGate(url, 'g-pause');
    let child: ReturnType<typeof spawnCli>;
    try {
      child = spawnCli(countedArgs(key, params), { url });
      await someoneBlocked(); // c0001 is in flight, waiting at the gate
      const paused = await idem(['pause', 'counted', '--key', key]);
      expect(paused.code, paused.stderr).toBe(0);
      expect(paused.stdout).toBe(`pause: run ${key} of job "counted" requested: the live run stops at its next chunk boundary\n`);
      expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'running', requested: 'pause' });
      // The live run looks for requests every second: wait until it has seen this one, c0001 still in flight.
      await requestSeen(child, 'pause');
    } finally {
      await gate.release();
    }
    const r = await child!.done;
    expect(r.code, r.stderr).toBe(75);
    expect(busyMessage(r.stderr)).toMatch(`job "counted" paused by an operator after finishing its in-flight chunks; run idem resume counted --key ${key} to let it continue`);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'paused', requested: null, attempt: 1 });
    // The in-flight chunk committed; no later chunk started.
    expect(await doneWork(key)).toEqual(['c0001']);
    expect(await workCounts(url, key)).toEqual(new Map([['c0001', 1]]));

    const again = await runCli(countedArgs(key, params), { url });
    expect(again.code).toBe(75);
    expect(busyMessage(again.stderr)).toMatch(`run ${key} of job "counted" is paused; run idem resume counted --key ${key} first`);
    expect(await workCounts(url, key)).toEqual(new Map([['c0001', 1]]));

    const resumed = await idem(['resume', 'counted', '--key', key]);
    expect(resumed.code, resumed.stderr).toBe(0);
    expect(resumed.stdout).toBe(`resume: run ${key} of job "counted" now interrupted\n`);
    const done = await runner.run(counted, { key, params });
    expect(done).toMatchObject({ status: 'succeeded', attempt: 2, executed: 8 }); // 7 work chunks and finish
    expect(await workCounts(url, key)).toEqual(ones(8));
  });

  it('a resume while the live run is honouring a pause is not lost: the run ends interrupted, not paused, and continues', async () => {
    // The interleaving is fixed by the gate: the run has seen the pause (it logs so) while its
    // chunk c0001 is held in flight; the resume then withdraws the request; only then does the
    // chunk commit and the attempt end. Serialized, that is "paused, then resumed": resumable.
    const key = 'op-pause-race';
    const params = { chunks: 8, gate: 'g-pause-race' };
    const gate = await holdGate(url, 'g-pause-race');
    let child: ReturnType<typeof spawnCli>;
    try {
      child = spawnCli(countedArgs(key, params), { url });
      await someoneBlocked();
      expect((await idem(['pause', 'counted', '--key', key])).code).toBe(0);
      await requestSeen(child, 'pause');
      const resumed = await idem(['resume', 'counted', '--key', key]);
      expect(resumed.code, resumed.stderr).toBe(0);
      expect(resumed.stdout).toBe(
        `resume: run ${key} of job "counted" pause withdrawn: the live run goes on (had it already stopped for the pause, it is interrupted and continues on its next invocation)\n`,
      );
      expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'running', requested: null });
    } finally {
      await gate.release();
    }
    const r = await child!.done;
    expect(r.code, r.stderr).toBe(75);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'interrupted', requested: null, attempt: 1 });
    expect(busyMessage(r.stderr)).toMatch(`job "counted" stopped for an operator's pause that was withdrawn (resumed) before it took effect; the run is interrupted: run the same command again to continue`);
    expect(await doneWork(key)).toEqual(['c0001']);
    // Not paused: the next invocation continues it without another resume.
    const done = await runner.run(counted, { key, params });
    expect(done).toMatchObject({ status: 'succeeded', attempt: 2, executed: 8 });
    expect(await workCounts(url, key)).toEqual(ones(8));
  });

  it('pause and cancel of a run nobody executes take effect at once', async () => {
    const key = 'op-idle';
    await query(url, `insert into fail_chunks values ('c0002', null, null)`);
    await expect(runner.run(counted, { key, params: { chunks: 3 } })).rejects.toThrow(/injected failure in chunk c0002/);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'failed' });

    // The step where it stopped reads the run's state wherever a step is shown: the text view,
    // --json and the HTTP run view (the last two said "running" for a run nobody executes).
    const stepsOf = async () => {
      const text = (await idem(['status', 'counted', '--key', key])).stdout;
      const json = JSON.parse((await idem(['status', 'counted', '--key', key, '--json'])).stdout) as { steps: Array<{ name: string; status: string }> };
      const reads = new pg.Pool({ connectionString: url, max: 1 });
      try {
        const view = await new RunViews(runner.db, reads, runner.schema, runner).byKey('counted', key);
        return { text: /^ {2}2\. work +(\S+)/m.exec(text)?.[1], json: json.steps.map((s) => s.status), api: view!.steps.map((s) => s.status) };
      } finally {
        await reads.end();
      }
    };
    expect(await stepsOf()).toEqual({ text: 'failed', json: ['done', 'failed', 'pending'], api: ['done', 'failed', 'pending'] });

    const paused = await idem(['pause', 'counted', '--key', key]);
    expect(paused.code, paused.stderr).toBe(0);
    expect(paused.stdout).toBe(`pause: run ${key} of job "counted" now paused\n`);
    expect(await stepsOf()).toEqual({ text: 'paused', json: ['done', 'paused', 'pending'], api: ['done', 'paused', 'pending'] });
    // Nobody executes it: the status is the whole answer, with no request left pending beside it.
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'paused', finished_at: null, requested: null });
    expect((await runner.status('counted')).find((s) => s.runKey === key)?.requested).toBeNull();

    // Resumed, it is what it was before the pause: failed, with its error (not `interrupted`, which
    // idem finalize would run behind a deploy: a failed run is resumed on purpose).
    const resumed = await idem(['resume', 'counted', '--key', key]);
    expect(resumed.code, resumed.stderr).toBe(0);
    expect(resumed.stdout).toBe(`resume: run ${key} of job "counted" now failed\n`);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'failed', requested: null });
    expect((await runRow(url, 'counted', key)).error).toMatchObject({ chunk: 'c0002' });
    const fin = await idem(['finalize', 'counted', '--key', key]);
    expect(fin.code, fin.stderr).toBe(1);
    expect(await workCounts(url, key)).toEqual(new Map([['c0001', 1]]));
    expect((await idem(['pause', 'counted', '--key', key])).code).toBe(0);

    expect(await runner.cancel('counted', key)).toEqual({ job: 'counted', runKey: key, status: 'cancelled', live: false, requested: null });
    const row = await runRow(url, 'counted', key);
    expect(row).toMatchObject({ status: 'cancelled', requested: null });
    expect(row.finished_at).toBeInstanceOf(Date);

    const late = await idem(['pause', 'counted', '--key', key]);
    expect(late.code).toBe(2);
    expect(late.stderr).toMatch(`run "${key}" of job "counted" is cancelled: nothing to pause`);
    expect(await workCounts(url, key)).toEqual(new Map([['c0001', 1]]));
  });
});

describe('pause, resume and cancel without --key', () => {
  it('act on the latest run they apply to, as documented, and name the problem when there is none', async () => {
    // The latest counted run that can be paused is nk-failed; a newer, succeeded run is not a target.
    await query(url, `insert into fail_chunks values ('c0002', null, null)`);
    await expect(runner.run(counted, { key: 'nk-failed', params: { chunks: 3 } })).rejects.toThrow(/injected failure/);
    await query(url, 'delete from fail_chunks');
    await runner.run(counted, { key: 'nk-done', params: { chunks: 1 } });

    const paused = await idem(['pause', 'counted']);
    expect([paused.code, paused.stdout], paused.stderr).toEqual([0, 'pause: run nk-failed of job "counted" now paused\n']);
    expect(await runRow(url, 'counted', 'nk-failed')).toMatchObject({ status: 'paused' });
    expect(await runRow(url, 'counted', 'nk-done')).toMatchObject({ status: 'succeeded' });

    // resume: the latest paused run; paused after it failed, it is failed again (resumable by a rerun).
    const resumed = await idem(['resume', 'counted']);
    expect([resumed.code, resumed.stdout], resumed.stderr).toEqual([0, 'resume: run nk-failed of job "counted" now failed\n']);

    // cancel: the latest run not finished (interrupted, paused, failed, pending or running).
    const cancelled = await idem(['cancel', 'counted']);
    expect([cancelled.code, cancelled.stdout], cancelled.stderr).toEqual([0, 'cancel: run nk-failed of job "counted" now cancelled\n']);
    expect(await runRow(url, 'counted', 'nk-failed')).toMatchObject({ status: 'cancelled' });
    expect(await runRow(url, 'counted', 'nk-done')).toMatchObject({ status: 'succeeded' });

    // A job whose runs all succeeded has nothing to pause: exit 2, naming why, nothing changed.
    await runner.run(ranged, { key: 'nk-ranged' });
    const nothing = await idem(['pause', 'ranged']);
    expect(nothing.code).toBe(2);
    expect(nothing.stderr).toContain('job "ranged" has no run to pause');
    expect(await runRow(url, 'ranged', 'nk-ranged')).toMatchObject({ status: 'succeeded' });
  });
});

describe('pause without --key while a run is live', () => {
  it('pauses the live run, not a newer one that only a busy invocation left pending', async () => {
    const params = { chunks: 6, gate: 'g-live-target' };
    const gate = await holdGate(url, 'g-live-target');
    let child: ReturnType<typeof spawnCli>;
    try {
      child = spawnCli(countedArgs('op-live-pause', params), { url });
      await someoneBlocked();
      // Another key of the same job meanwhile: busy (75), and its row stays pending, attempt 0.
      const busy = await runCli(countedArgs('op-phantom-pause', params), { url });
      expect(busy.code).toBe(75);
      expect(await runRow(url, 'counted', 'op-phantom-pause')).toMatchObject({ status: 'pending', attempt: 0 });
      const paused = await idem(['pause', 'counted']);
      expect([paused.code, paused.stdout], paused.stderr).toEqual([0, 'pause: run op-live-pause of job "counted" requested: the live run stops at its next chunk boundary\n']);
      expect(await runRow(url, 'counted', 'op-phantom-pause')).toMatchObject({ status: 'pending', requested: null });
      await requestSeen(child, 'pause');
    } finally {
      await gate.release();
    }
    expect((await child!.done).code).toBe(75);
    expect(await runRow(url, 'counted', 'op-live-pause')).toMatchObject({ status: 'paused' });
    await idem(['cancel', 'counted', '--key', 'op-live-pause']);
    await idem(['cancel', 'counted', '--key', 'op-phantom-pause']);
  });
});

describe('without --key, a crashed run is not the live one', () => {
  it('pause acts on the live run though a newer crashed run still reads running, and cancel then on the newest run it applies to', async () => {
    // L crashes, then C crashes (newer); L is rerun and is live (attempt 2). Both rows read
    // `running`: only the lock tells the live one. Ordering by status and age picked C.
    const params = { chunks: 6, gate: 'g-crashed-target' };
    for (const key of ['op-ct-live', 'op-ct-crashed']) {
      expectFaultCrash(await runCli(countedArgs(key, params), { url, env: { IDEM_FAULT: 'after-commit:crash:1' } }), 'after-commit');
      expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'running', attempt: 1 });
    }
    const gate = await holdGate(url, params.gate);
    let child: ReturnType<typeof spawnCli>;
    try {
      child = spawnCli(countedArgs('op-ct-live', params), { url });
      await someoneBlocked();
      // A busy invocation of a third key meanwhile leaves the newest row, pending.
      expect((await runCli(countedArgs('op-ct-pending', params), { url })).code).toBe(75);
      const paused = await idem(['pause', 'counted']);
      expect([paused.code, paused.stdout], paused.stderr).toEqual([0, 'pause: run op-ct-live of job "counted" requested: the live run stops at its next chunk boundary\n']);
      expect(await runRow(url, 'counted', 'op-ct-crashed')).toMatchObject({ status: 'running', requested: null, attempt: 1 });
      await requestSeen(child, 'pause');
    } finally {
      await gate.release();
    }
    expect((await child!.done).code).toBe(75);
    expect(await runRow(url, 'counted', 'op-ct-live')).toMatchObject({ status: 'paused' });
    // No run is live now: cancel takes the newest run it applies to (the pending one), not the
    // crashed run because its row says running.
    const cancelled = await idem(['cancel', 'counted']);
    expect([cancelled.code, cancelled.stdout], cancelled.stderr).toEqual([0, 'cancel: run op-ct-pending of job "counted" now cancelled\n']);
    expect(await runRow(url, 'counted', 'op-ct-crashed')).toMatchObject({ status: 'running', requested: null });
    for (const key of ['op-ct-live', 'op-ct-crashed']) await idem(['cancel', 'counted', '--key', key]);
  });
});

describe('a request the live run could not act on is not lost', () => {
  // The worker stops for another reason (SIGTERM, SIGKILL) after an operator asked it to pause or
  // cancel: the run ends by the request all the same, and no later invocation does any more work.
  for (const what of ['cancel', 'pause'] as const) {
    it(`${what} requested while a SIGTERMed worker finishes its in-flight chunk: the run ends ${what === 'cancel' ? 'cancelled' : 'paused'}, and a rerun does no work`, async () => {
      const key = `op-term-${what}`;
      const params = { chunks: 6, gate: `g-term-${what}` };
      const gate = await holdGate(url, params.gate);
      let child: ReturnType<typeof spawnCli>;
      try {
        child = spawnCli(countedArgs(key, params, ['--log-level', 'info']), { url });
        await someoneBlocked(); // c0001 in flight at the gate
        child.child.kill('SIGTERM');
        await waitFor(async () => child.stderr().includes('SIGTERM'), 'the worker to take the SIGTERM');
        const asked = await idem([what, 'counted', '--key', key]);
        expect([asked.code, asked.stdout], asked.stderr).toEqual([0, `${what}: run ${key} of job "counted" requested: the live run stops at its next chunk boundary\n`]);
      } finally {
        await gate.release();
      }
      const r = await child!.done;
      expect(r.code, r.stderr).toBe(143);
      const ended = await runRow(url, 'counted', key);
      expect(ended).toMatchObject({ status: what === 'cancel' ? 'cancelled' : 'paused', requested: null, attempt: 1 });
      expect(await doneWork(key)).toEqual(['c0001']);
      const again = await runCli(countedArgs(key, params), { url });
      expect(again.code, again.stderr).toBe(what === 'cancel' ? 1 : 75);
      expect(what === 'cancel' ? again.stderr : busyMessage(again.stderr)).toMatch(what === 'cancel' ? `run ${key} of job "counted" was cancelled` : `run ${key} of job "counted" is paused`);
      expect(await doneWork(key)).toEqual(['c0001']);
      expect(await runRow(url, 'counted', key)).toMatchObject({ status: what === 'cancel' ? 'cancelled' : 'paused', attempt: 1 });
      if (what === 'pause') await idem(['cancel', 'counted', '--key', key]);
    });

    it(`${what} requested, then the worker is SIGKILLed: the next invocation ends the run ${what === 'cancel' ? 'cancelled' : 'paused'} before any work`, async () => {
      const key = `op-kill-${what}`;
      const params = { chunks: 6, gate: `g-kill-${what}` };
      const gate = await holdGate(url, params.gate);
      let child: ReturnType<typeof spawnCli>;
      try {
        child = spawnCli(countedArgs(key, params), { url });
        await someoneBlocked();
        const asked = await idem([what, 'counted', '--key', key]);
        expect(asked.code, asked.stderr).toBe(0);
        child.child.kill('SIGKILL');
        expect((await child.done).signal).toBe('SIGKILL');
      } finally {
        await gate.release();
      }
      await waitFor(async () => (await sessions(url, 'idem-lock')) === 0, 'the killed lock session to end');
      expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'running', requested: what, attempt: 1 });
      const done = await doneWork(key);
      const again = await runCli(countedArgs(key, params), { url });
      expect(again.code, again.stderr).toBe(what === 'cancel' ? 1 : 75);
      expect(what === 'cancel' ? again.stderr : busyMessage(again.stderr)).toMatch(
        `job "counted" ${what === 'cancel' ? 'cancelled' : 'paused'} by an operator (the request was pending when its last worker stopped)`,
      );
      expect(await doneWork(key)).toEqual(done);
      // The invocation took the crashed run over (attempt 2) and ended it there, before any work.
      expect(await runRow(url, 'counted', key)).toMatchObject({ status: what === 'cancel' ? 'cancelled' : 'paused', requested: null, attempt: 2 });
      if (what === 'pause') await idem(['cancel', 'counted', '--key', key]);
    });
  }
});

describe('resume of a crashed run with a pause pending', () => {
  it('withdraws the pause and says that no process works the run (black-box round 13: "the live run goes on")', async () => {
    const key = 'op-crashed-resume';
    const params = { chunks: 3 };
    expectFaultCrash(await runCli(countedArgs(key, params), { url, env: { IDEM_FAULT: 'after-commit:crash:1' } }), 'after-commit');
    await waitFor(async () => (await sessions(url, 'idem-lock')) === 0, 'the crashed lock session to end');
    // Without the pause, a resume has nothing to withdraw: refused, naming the run crashed, as idem
    // status shows it (black-box round 17, B6-3: "is running, not paused").
    const early = await idem(['resume', 'counted', '--key', key]);
    expect([early.code, early.stdout, early.stderr.trim()]).toEqual([
      2,
      '',
      `idem: error: run "${key}" of job "counted" crashed (its row says running, but no process works it), not paused: nothing to resume; its next invocation (idem run counted --key ${key}) continues it`,
    ]);
    // As a worker killed after an operator asked it to pause leaves its run (the row still says running).
    await query(url, `update idem.runs set requested = 'pause' where job = 'counted' and run_key = $1`, [key]);
    const resumed = await idem(['resume', 'counted', '--key', key]);
    expect([resumed.code, resumed.stdout], resumed.stderr).toEqual([0, `resume: run ${key} of job "counted" pause withdrawn: no process works the run (it crashed); its next invocation continues it\n`]);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'running', requested: null, attempt: 1 });
    const again = await runCli(countedArgs(key, params), { url });
    expect(again.code, again.stderr).toBe(0);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'succeeded', attempt: 2 });
  });
});

describe('a pending cancel is not undone by a pause', () => {
  it('pause after a cancel of a live run is refused (exit 2) and the run ends cancelled; so for a crashed run with the cancel pending', async () => {
    const key = 'op-cancel-then-pause';
    const params = { chunks: 6, gate: 'g-cancel-pause' };
    const gate = await holdGate(url, params.gate);
    let child: ReturnType<typeof spawnCli>;
    try {
      child = spawnCli(countedArgs(key, params), { url });
      await someoneBlocked();
      const cancel = await idem(['cancel', 'counted', '--key', key]);
      expect(cancel.code, cancel.stderr).toBe(0);
      const pause = await idem(['pause', 'counted', '--key', key]);
      expect(pause.code).toBe(2);
      expect(pause.stderr).toBe(`idem: error: run "${key}" of job "counted" has a cancel pending (it ends cancelled at its next chunk boundary, or its next invocation if nobody executes it): nothing to pause\n`);
      expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'running', requested: 'cancel' });
      await requestSeen(child, 'cancel');
    } finally {
      await gate.release();
    }
    const out = await child!.done;
    expect(out.code, child!.stderr()).toBe(1);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'cancelled', requested: null });

    // The same with the worker killed while the cancel is pending: the row still says running.
    const key2 = 'op-cancel-kill-pause';
    const params2 = { chunks: 6, gate: 'g-cancel-kill-pause' };
    const gate2 = await holdGate(url, params2.gate);
    try {
      const c2 = spawnCli(countedArgs(key2, params2), { url });
      await someoneBlocked();
      expect((await idem(['cancel', 'counted', '--key', key2])).code).toBe(0);
      c2.child.kill('SIGKILL');
      expect((await c2.done).signal).toBe('SIGKILL');
    } finally {
      await gate2.release();
    }
    await waitFor(async () => (await sessions(url, 'idem-lock')) === 0, 'the killed lock session to end');
    const done = await doneWork(key2);
    const pause2 = await idem(['pause', 'counted', '--key', key2]);
    expect(pause2.code).toBe(2);
    expect(pause2.stderr).toMatch('has a cancel pending');
    expect(await runRow(url, 'counted', key2)).toMatchObject({ status: 'running', requested: 'cancel', attempt: 1 });
    // The next invocation ends it cancelled, before any work.
    const again = await runCli(countedArgs(key2, params2), { url });
    expect(again.code, again.stderr).toBe(1);
    expect(await doneWork(key2)).toEqual(done);
    expect(await runRow(url, 'counted', key2)).toMatchObject({ status: 'cancelled', requested: null });
  });
});

describe('idem list while a run is live', () => {
  it('shows the job running, not pending, when a busy invocation of another key left a newer pending row', async () => {
    const params = { chunks: 4, gate: 'g-list-live' };
    const gate = await holdGate(url, params.gate);
    let child: ReturnType<typeof spawnCli>;
    try {
      child = spawnCli(countedArgs('op-list-live', params), { url });
      await someoneBlocked();
      expect((await runCli(countedArgs('op-list-busy', params), { url })).code).toBe(75);
      expect(await runRow(url, 'counted', 'op-list-busy')).toMatchObject({ status: 'pending' });
      const listed = await idem(['list', '--json']);
      expect(listed.code, listed.stderr).toBe(0);
      expect((JSON.parse(listed.stdout) as Array<{ name: string; state: string }>).find((i) => i.name === 'counted')?.state).toBe('running');
    } finally {
      await gate.release();
    }
    expect((await child!.done).code).toBe(0);
    await idem(['cancel', 'counted', '--key', 'op-list-busy']);
  });
});

describe('resume without --key while a run is live', () => {
  it('withdraws the pause pending on the live run, not an older paused run, whatever a busy invocation left pending', async () => {
    const params = { chunks: 6, gate: 'g-live-resume' };
    // An older run of the job, paused by an operator while nobody executed it.
    await query(url, `insert into fail_chunks values ('c0002', null, null)`);
    const old = await runCli(countedArgs('op-old-paused', { chunks: 3 }), { url });
    expect(old.code).toBe(1);
    await query(url, 'delete from fail_chunks');
    expect((await idem(['pause', 'counted', '--key', 'op-old-paused'])).code).toBe(0);
    const gate = await holdGate(url, params.gate);
    let child: ReturnType<typeof spawnCli>;
    try {
      child = spawnCli(countedArgs('op-live-resume', params), { url });
      await someoneBlocked();
      // The live run has no pause to withdraw: refused, and the older paused run is still left
      // alone (black-box round 17, B6-2: it was resumed instead).
      const early = await idem(['resume', 'counted']);
      expect([early.code, early.stdout, early.stderr.trim()]).toEqual([
        2,
        '',
        'idem: error: run "op-live-resume" of job "counted" is running, not paused: nothing to resume (an older paused run is left alone while a run of the job is live: name it with --key)',
      ]);
      expect(await runRow(url, 'counted', 'op-old-paused')).toMatchObject({ status: 'paused' });
      expect((await runCli(countedArgs('op-busy-resume', params), { url })).code).toBe(75);
      expect((await idem(['pause', 'counted'])).stdout).toMatch('run op-live-resume of job "counted" requested');
      const resumed = await idem(['resume', 'counted']);
      expect(resumed.code, resumed.stderr).toBe(0);
      expect(resumed.stdout).toMatch('op-live-resume');
      expect(await runRow(url, 'counted', 'op-live-resume')).toMatchObject({ status: 'running', requested: null });
      expect(await runRow(url, 'counted', 'op-old-paused')).toMatchObject({ status: 'paused' });
    } finally {
      await gate.release();
    }
    const r = await child!.done;
    // The pause may have reached the live run before the resume withdrew it: then it stops with
    // the run interrupted (75), as documented; else it finishes the run.
    expect([0, 75], r.stderr).toContain(r.code);
    expect((await runRow(url, 'counted', 'op-live-resume')).status).toBe(r.code === 0 ? 'succeeded' : 'interrupted');
    expect(await runRow(url, 'counted', 'op-old-paused')).toMatchObject({ status: 'paused' });
    for (const key of ['op-old-paused', 'op-live-resume', 'op-busy-resume']) await idem(['cancel', 'counted', '--key', key]);
  });
});

describe('an operator command stopped by a signal', () => {
  // Black-box round 13: `idem pause` interrupted (Ctrl-C, exit 130) while its update waited on a
  // lock kept running server-side: the run became paused once the lock was released.
  for (const what of ['pause', 'resume', 'cancel', 'reset', 'prune'] as const) {
    it(`${what} stopped by SIGINT while its statement waits on a lock has no effect, then or later`, async () => {
      const key = `op-sig-${what}`;
      if (what === 'prune') {
        await runner.run(counted, { key, params: { chunks: 1 } });
        await query(url, `update idem.runs set finished_at = now() - interval '2 days' where job = 'counted' and run_key = $1`, [key]);
      } else {
        await query(url, `insert into fail_chunks values ('c0002', null, null)`);
        await expect(runner.run(counted, { key, params: { chunks: 3 } })).rejects.toThrow(/injected failure in chunk c0002/);
        await query(url, 'delete from fail_chunks');
      }
      if (what === 'resume') expect((await idem(['pause', 'counted', '--key', key])).code).toBe(0);
      const before = await runRow(url, 'counted', key);
      const holder = new pg.Client({ connectionString: url });
      await holder.connect();
      try {
        await holder.query('begin');
        await holder.query('lock table idem.runs in share mode');
        const child = spawnCli([...FIXTURE_DIRS, ...(what === 'prune' ? ['prune', '--older-than', '1d'] : [what, 'counted', '--key', key])], { url });
        await waitFor(async () => (await lockWaiters(url, 'idem')) + (await lockWaiters(url, 'idem-lock')) > 0, `the ${what} to wait on the lock`);
        child.child.kill('SIGINT');
        const r = await child.done;
        expect(r.code, r.stderr).toBe(130);
        expect(r.stderr).toMatch('idem: stopped by SIGINT');
        // Its statement was cancelled with the command: nothing waits on the lock any more.
        expect((await lockWaiters(url, 'idem')) + (await lockWaiters(url, 'idem-lock'))).toBe(0);
      } finally {
        await holder.query('commit');
        await holder.end();
      }
      await sleep(300);
      expect(await runRow(url, 'counted', key)).toEqual(before);
      if (what === 'prune') await query(url, `update idem.runs set finished_at = now() where job = 'counted' and run_key = $1`, [key]);
      else await runner.cancel('counted', key);
    });
  }
});

describe('cancel and reset', () => {
  it('cancelling a live run ends it with exit 1; reruns are refused until idem reset, after which it runs afresh', async () => {
    const key = 'op-cancel';
    const params = { chunks: 8, gate: 'g-cancel' };
    const gate = await holdGate(url, 'g-cancel');
    let child: ReturnType<typeof spawnCli>;
    try {
      child = spawnCli(countedArgs(key, params), { url });
      await someoneBlocked();
      const cancelled = await idem(['cancel', 'counted', '--key', key]);
      expect(cancelled.code, cancelled.stderr).toBe(0);
      expect(cancelled.stdout).toMatch('requested: the live run stops at its next chunk boundary');
      await requestSeen(child, 'cancel');
    } finally {
      await gate.release();
    }
    const r = await child!.done;
    expect(r.code, r.stderr).toBe(1);
    expect(r.stderr).toMatch(`job "counted" cancelled by an operator; finished chunks are kept; idem reset counted --key ${key} forgets the run`);
    const old = await runRow(url, 'counted', key);
    expect(old).toMatchObject({ status: 'cancelled', requested: null, attempt: 1 });
    expect(old.finished_at).toBeInstanceOf(Date);
    expect(await doneWork(key)).toEqual(['c0001']);

    const refused = await runCli(countedArgs(key, params), { url });
    expect(refused.code).toBe(1);
    expect(refused.stderr).toMatch(`run ${key} of job "counted" was cancelled; idem reset counted --key ${key} forgets it so it can run afresh`);
    await expect(runner.run(counted, { key, params })).rejects.toBeInstanceOf(CancelledError);

    const [{ n: markers }] = await query(url, 'select count(*)::int as n from idem.chunks where run_id = $1', [old.id]);
    expect(markers).toBe(9); // prepare's and the 8 planned work chunks
    const reset = await idem(['reset', 'counted', '--key', key]);
    expect(reset.code, reset.stderr).toBe(0);
    expect(reset.stdout).toBe(`reset: forgot run ${key} of job "counted" (9 chunk markers, 0 effects)\n`);
    expect(await runRow(url, 'counted', key)).toBeUndefined();
    for (const table of ['idem.steps', 'idem.chunks']) {
      expect(await query(url, `select count(*)::int as n from ${table} where run_id = $1`, [old.id])).toEqual([{ n: 0 }]);
    }

    const fresh = await runner.run(counted, { key, params });
    expect(fresh).toMatchObject({ status: 'succeeded', attempt: 1, executed: 10 });
    expect(fresh.runId).not.toBe(old.id);
    // Every chunk executed again: c0001 twice in all (before the cancel and after the reset).
    expect(await workCounts(url, key)).toEqual(new Map([...ones(8)].map(([k]) => [k, k === 'c0001' ? 2 : 1])));
  });

  it('a cancel requested while the last chunk is in flight: the run ends one way, with no request left beside its state', async () => {
    // Black-box round 10: a run shared by workers succeeded with "cancel requested" still on it
    // (idem status: "succeeded … cancel requested"; the API: requested "cancel").
    const gate = await holdGate(url, 'g-last');
    const job = defineJob({
      name: 'last-chunk-cancel',
      steps: [{ name: 'only', chunks: () => ({ chunks: [{ key: 'a' }], next: null }), run: async ({ db }: StepContext) => void (await sql`select 1 from gates where name = 'g-last' for share`.execute(db)) }],
    });
    const running = runner.run(job, { key: 'lc' }).catch((e: unknown) => e);
    try {
      await waitFor(async () => (await lockWaiters(url)) > 0, 'the chunk to wait at the gate');
      expect((await runner.cancel('last-chunk-cancel', 'lc')).live).toBe(true);
    } finally {
      await gate.release();
    }
    await running;
    const row = await runRow(url, 'last-chunk-cancel', 'lc');
    // Every chunk is done: the request had nothing left to stop.
    expect(row.status).toBe('succeeded');
    expect(row.requested).toBeNull();
  });

  it.each(['pause', 'cancel'] as const)('a %s the run has seen while its last chunk is in flight: the run ends succeeded; with a step left, it stops before that step', async (what) => {
    // Black-box round 14 (B3-1): once the control poll had seen the request, the step ended by it
    // after its last chunk committed, so the run read paused (or cancelled) with every chunk done,
    // against the README ("has nothing left to stop: the run ends succeeded").
    for (const withNext of [false, true]) {
      const name = `last-chunk-${what}-${withNext ? 'next' : 'only'}`;
      const gate = await holdGate(url, `g-${name}`);
      const later: string[] = [];
      const job = defineJob({
        name,
        steps: [
          { name: 'only', chunks: () => ({ chunks: [{ key: 'a' }, { key: 'b' }], next: null }), run: async ({ db }: StepContext, c: { key: string }) => void (c.key === 'b' && (await sql`select 1 from gates where name = ${`g-${name}`} for share`.execute(db))) },
          ...(withNext ? [{ name: 'next', run: async () => void later.push('ran') }] : []),
        ],
      });
      const running = runner.run(job, { key: 'lc', controlPollMs: 50 }).catch((e: unknown) => e);
      try {
        await waitFor(async () => (await lockWaiters(url)) > 0, 'chunk b to wait at the gate');
        expect((await runner[what](name, 'lc')).live).toBe(true);
        // The control poll has seen it: the worker starts nothing more.
        await new Promise((r) => setTimeout(r, 400));
      } finally {
        await gate.release();
      }
      const out = await running;
      const row = await runRow(url, name, 'lc');
      if (withNext) {
        expect(row.status).toBe(what === 'pause' ? 'paused' : 'cancelled');
        expect(later).toEqual([]);
      } else {
        expect(out).toMatchObject({ status: 'succeeded', executed: 2 });
        expect(row.status).toBe('succeeded');
        expect(row.requested).toBeNull();
      }
    }
  });

  it('reset of a live run exits 75 (its run lock is held) and changes nothing', async () => {
    const key = 'op-live';
    const gate = await holdGate(url, 'g-live');
    const live = runner.run(counted, { key, params: { chunks: 3, gate: 'g-live' } });
    try {
      await someoneBlocked();
      const before = await snapshot(url, RUN_TABLES);
      const r = await idem(['reset', 'counted', '--key', key]);
      expect(r.code).toBe(75);
      expect(busyMessage(r.stderr)).toBe('busy: run "op-live" of job "counted" is running in another process; idem cancel counted --key op-live first, or reset after it ends');
      expect(await snapshot(url, RUN_TABLES)).toEqual(before);
    } finally {
      await gate.release();
    }
    expect(await live).toMatchObject({ status: 'succeeded', attempt: 1, executed: 5 });
    expect(await workCounts(url, key)).toEqual(ones(3));
  });

  it('reset of a finished run proceeds while another run of the same job is live; reset of that live run names it and its advice works', async () => {
    await runner.run(counted, { key: 'old2', params: { chunks: 2 } });
    const old = await runRow(url, 'counted', 'old2');
    const [{ n: markers }] = await query(url, 'select count(*)::int as n from idem.chunks where run_id = $1', [old.id]);
    const gate = await holdGate(url, 'g-live2');
    const live = spawnCli(countedArgs('live2', { chunks: 3, gate: 'g-live2' }, ['--join']), { url });
    try {
      await someoneBlocked();
      const reset = await idem(['reset', 'counted', '--key', 'old2']);
      expect([reset.code, reset.stderr]).toEqual([0, '']);
      expect(reset.stdout).toBe(`reset: forgot run old2 of job "counted" (${markers} chunk markers, 0 effects)\n`);
      expect(await runRow(url, 'counted', 'old2')).toBeUndefined();
      expect(await query(url, 'select count(*)::int as n from idem.chunks where run_id = $1', [old.id])).toEqual([{ n: 0 }]);

      const before = await snapshot(url, RUN_TABLES);
      const refused = await idem(['reset', 'counted', '--key', 'live2']);
      expect(refused.code).toBe(75);
      expect(busyMessage(refused.stderr)).toBe('busy: run "live2" of job "counted" is running in another process; idem cancel counted --key live2 first, or reset after it ends');
      expect(await snapshot(url, RUN_TABLES)).toEqual(before);
      // The advice works: the cancel reaches the live run.
      const cancel = await idem(['cancel', 'counted', '--key', 'live2']);
      expect(cancel.code, cancel.stderr).toBe(0);
      await requestSeen(live, 'cancel');
    } finally {
      await gate.release();
    }
    const ended = await live.done;
    expect(ended.code, ended.stderr).toBe(1);
    expect(await runRow(url, 'counted', 'live2')).toMatchObject({ status: 'cancelled' });
    const after = await idem(['reset', 'counted', '--key', 'live2']);
    expect([after.code, after.stderr]).toEqual([0, '']);
    expect(await runRow(url, 'counted', 'live2')).toBeUndefined();
  });

  it('reset forgets a crashed run (its process died; its row still says running)', async () => {
    const key = 'op-crashed';
    const crashed = await runCli(countedArgs(key, { chunks: 4 }), { url, env: { IDEM_FAULT: 'after-commit:crash:3' } });
    expectFaultCrash(crashed, 'after-commit');
    // Postgres drops a dead process's lock with its session; wait for that, so only the row is left.
    await waitFor(async () => (await sessions(url, 'idem-lock')) === 0, 'the crashed lock session to end');
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'running' });
    expect((await runner.status('counted')).find((s) => s.runKey === key)?.state).toBe('crashed');

    const reset = await idem(['reset', 'counted', '--key', key]);
    expect([reset.code, reset.stderr]).toEqual([0, '']);
    expect(await runRow(url, 'counted', key)).toBeUndefined();
  });
});

describe('prune', () => {
  const withEffects = defineJob({
    name: 'with-effects',
    steps: [
      {
        name: 'send',
        chunks: () => ({ chunks: [{ key: 'a' }, { key: 'b' }], next: null }),
        async run(ctx: StepContext) {
          await ctx.effect('ping', (key) => ({ key }));
        },
      },
    ],
  });

  /** Every run with how many step, chunk and effect rows it owns. */
  async function perRun() {
    return query(
      url,
      `select r.id, r.job, r.run_key, r.status,
         (select count(*) from idem.steps s where s.run_id = r.id)::int as steps,
         (select count(*) from idem.chunks c where c.run_id = r.id)::int as chunks,
         (select count(*) from idem.effects e where e.run_id = r.id)::int as effects
       from idem.runs r order by r.id`,
    );
  }

  it('removes succeeded and cancelled runs older than the cutoff with their rows, never a failed, interrupted, paused or running one', async () => {
    await runner.run(withEffects, { key: 'prune-fx' });
    await runner.run(counted, { key: 'prune-ok', params: { chunks: 3 } });
    // Interrupted: stopped (as by SIGINT) after its first chunk.
    const stop = new AbortController();
    await expect(
      runner.run(counted, { key: 'prune-int', params: { chunks: 3 }, signal: stop.signal, onProgress: (p) => p.done >= 1 && stop.abort(new InterruptedError('SIGINT')) }),
    ).rejects.toBeInstanceOf(InterruptedError);
    await query(url, `insert into fail_chunks values ('c0002', null, null)`);
    for (const key of ['prune-failed', 'prune-paused', 'prune-cancel']) await runner.run(counted, { key, params: { chunks: 3 } }).catch(() => {});
    await query(url, 'delete from fail_chunks');
    await runner.pause('counted', 'prune-paused');
    await runner.cancel('counted', 'prune-cancel');
    const gate = await holdGate(url, 'g-prune');
    const live = runner.run(counted, { key: 'prune-live', params: { chunks: 3, gate: 'g-prune' } });
    try {
      await someoneBlocked();
      await sleep(1_200); // everything finished above is now older than 1 s
      const before = await perRun();
      const statuses = new Set(before.map((r) => r.status));
      for (const s of ['succeeded', 'cancelled', 'failed', 'paused', 'interrupted', 'running']) expect(statuses).toContain(s);
      const removed = before.filter((r) => r.status === 'succeeded' || r.status === 'cancelled');
      const sum = (f: 'steps' | 'chunks' | 'effects') => removed.reduce((n, r) => n + r[f], 0);
      expect(sum('effects')).toBe(2);

      const [pruned, bad, years] = await Promise.all([idem(['prune', '--older-than', '1s', '--json']), idem(['prune', '--older-than', '5x']), idem(['prune', '--older-than', '100y'])]);
      expect(pruned.code, pruned.stderr).toBe(0);
      expect(JSON.parse(pruned.stdout)).toEqual({ runs: removed.length, steps: sum('steps'), chunks: sum('chunks'), effects: sum('effects'), skipped: 0 });
      expect(await perRun()).toEqual(before.filter((r) => !removed.includes(r)));
      const ids = removed.map((r) => r.id);
      for (const table of ['idem.steps', 'idem.chunks', 'idem.effects']) {
        expect(await query(url, `select count(*)::int as n from ${table} where run_id = any($1::bigint[])`, [ids])).toEqual([{ n: 0 }]);
      }
      expect(bad.code).toBe(2);
      expect(bad.stderr).toMatch('--older-than expects a duration such as 30d, 12h or 90m (units s, m, h, d, w; at most 36500d); got "5x"');
      // No unit for years: the message names the units there are and the limit in one of them.
      expect([years.code, years.stderr]).toEqual([2, 'idem: error: --older-than expects a duration such as 30d, 12h or 90m (units s, m, h, d, w; at most 36500d); got "100y"\n']);

      const again = await idem(['prune', '--older-than', '1s']);
      expect(again.stdout).toBe('prune: removed 0 runs, 0 steps, 0 chunk markers, 0 effects older than 1s\n');
    } finally {
      await gate.release();
    }
    expect(await live).toMatchObject({ status: 'succeeded' });
  });
});

describe('prune durations', () => {
  it('a duration too large to subtract from now is refused like any bad duration (exit 2), by prune and by serve --retention', async () => {
    const before = await snapshot(url, ['idem.runs', 'idem.chunks']);
    for (const value of ['99999999999d', '200000000d', '1000000000d']) {
      const r = await idem(['prune', '--older-than', value]);
      expect(r.code, r.stderr).toBe(2);
      expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([`idem: error: --older-than ${value} is longer than 100 years; give at most 36500d`]);
    }
    const serve = await idem(['serve', '--port', '0', '--retention', '200000000d'], { IDEM_API_TOKEN: 'x'.repeat(32) });
    expect(serve.code, serve.stderr).toBe(2);
    expect(serve.stderr).toContain('--retention 200000000d is longer than 100 years');
    expect(await snapshot(url, ['idem.runs', 'idem.chunks'])).toEqual(before);
  });
});

describe('idem status while runs are live', () => {
  it('shows throughput and ETA of a running run, and a keyRange step estimated from table statistics', async () => {
    // ranged cuts items by 10: statistics know 2500 rows (250 chunks); 100 rows come after ANALYZE.
    await query(url, 'alter table items set (autovacuum_enabled = false)');
    await query(url, 'insert into items (id, value) select g, g from generate_series(1, 2500) g');
    await query(url, 'analyze items');
    await query(url, 'insert into items (id, value) select g, g from generate_series(2501, 2600) g');
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    await holder.query('begin');
    await holder.query('select 1 from items where id = 1 for update'); // ranged's first chunk waits here
    const stop = new AbortController();
    const estimating = runner.run(ranged, { key: 'op-est' });
    const moving = runner.run(counted, { key: 'op-rate', params: { chunks: 100, pauseMs: 100 }, signal: stop.signal });
    // Handled from the start: it rejects (interrupted) while the test is still releasing the lock.
    const movingOutcome = moving.then(() => null, (e: unknown) => e);
    try {
      await someoneBlocked();
      await waitFor(async () => (await doneWork('op-rate')).length >= 4, 'op-rate to commit a few chunks');
      const r = await idem(['status', '--json']);
      expect(r.code, r.stderr).toBe(0);
      const rows = JSON.parse(r.stdout) as Array<Record<string, any>>;

      const rate = rows.find((x) => x.runKey === 'op-rate')!;
      // prepare (1) + work (100, one window) planned; finish not yet: 101 so far, not fully planned.
      expect(rate).toMatchObject({ job: 'counted', state: 'running', chunksPlanned: 101, fullyPlanned: false, estimatedChunks: 101, requested: null });
      expect(rate.chunksDone).toBeGreaterThanOrEqual(5);
      expect(rate.throughput).toBeGreaterThan(0);
      expect(Math.abs(rate.etaSeconds - (101 - rate.chunksDone) / rate.throughput)).toBeLessThanOrEqual(1);

      const est = rows.find((x) => x.runKey === 'op-est')!;
      // Planning runs one window (100) ahead of the blocked first one: 200 planned of an estimated 250.
      expect(est).toMatchObject({ job: 'ranged', state: 'running', chunksDone: 0, chunksPlanned: 200, fullyPlanned: false, estimatedChunks: 250, throughput: null, etaSeconds: null });
    } finally {
      stop.abort(new InterruptedError('SIGINT'));
      await holder.query('rollback');
      await holder.end();
    }
    expect(await movingOutcome).toBeInstanceOf(InterruptedError);
    expect(await runRow(url, 'counted', 'op-rate')).toMatchObject({ status: 'interrupted' });
    const out = await estimating;
    expect(out.summary).toMatchObject({ chunks: 260 });
    // The estimate came from the statistics (2500 rows), not from counting the table (2600).
    const steps = await query(url, `select s.estimated_chunks from idem.steps s join idem.runs r on r.id = s.run_id where r.run_key = 'op-est'`);
    expect(steps).toEqual([{ estimated_chunks: 250 }]);
  });

  it('a live run that has committed nothing for many times its usual interval between chunks reads stalled, with no ETA', async () => {
    // Black-box round 15 (B1-2): a worker SIGSTOPped holding the last chunks; status read "35 s
    // ago … 0.47/s, ETA 4s", then "50 s ago … ETA 6s": an ETA for a run that had not moved.
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    let reached!: () => void;
    const atGate = new Promise<void>((r) => (reached = r));
    const job = defineJob({
      name: 'status-stalled',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: ['a', 'b', 'c', 'd', 'e'].map((key) => ({ key })), next: null }),
          async run(_ctx: StepContext, chunk: { key: string }) {
            if (chunk.key !== 'd') return sleep(50);
            reached();
            await gate;
          },
        },
      ],
    });
    const running = runner.run(job, { key: 'stalled', health: false });
    const status = async () => {
      const r = await idem(['status', 'status-stalled', '--json']);
      expect(r.code, r.stderr).toBe(0);
      return (JSON.parse(r.stdout) as Array<Record<string, any>>).find((x) => x.runKey === 'stalled')!;
    };
    try {
      await atGate;
      // Just after its last chunk: moving, an ETA.
      const moving = await status();
      expect(moving).toMatchObject({ state: 'running', chunksDone: 3, stalledSeconds: null });
      expect(moving.etaSeconds).toEqual(expect.any(Number));
      // Nothing committed for 10 s (the floor; its chunks came ~50 ms apart): stalled, no ETA.
      await new Promise((r) => setTimeout(r, 10_500));
      const stalled = await status();
      expect(stalled).toMatchObject({ state: 'running', chunksDone: 3, etaSeconds: null });
      expect(stalled.stalledSeconds).toBeGreaterThanOrEqual(10);
      expect(stalled.stalledSeconds).toBeLessThan(30);
      expect(stalled.throughput).toBeGreaterThan(0);
      const human = await idem(['status', 'status-stalled']);
      expect(human.stdout).toMatch(/stalled: no chunk committed for 1\ds/);
      expect(human.stdout).not.toMatch(/ETA/);
      const detail = await idem(['status', 'status-stalled', '--key', 'stalled']);
      expect(detail.stdout).toMatch(/stalled: no chunk committed for 1\ds/);
      expect(detail.stdout).not.toMatch(/ETA/);
      // The HTTP API's run view (and the dashboard) says the same.
      const reads = new pg.Pool({ connectionString: url, max: 1 });
      try {
        const view = await new RunViews(runner.db, reads, runner.schema, runner).byKey('status-stalled', 'stalled');
        expect(view).toMatchObject({ state: 'running', progress: { done: 3 }, etaSeconds: null });
        expect(view!.stalledSeconds).toBeGreaterThanOrEqual(10);
      } finally {
        await reads.end();
      }
    } finally {
      release();
    }
    expect((await running).status).toBe('succeeded');
  });

  it('UPDATED of a live run moves with every chunk it commits: Runner.status, idem status --json and the HTTP run view', async () => {
    // Before: UPDATED stayed at the attempt's start (the run row is written only at start and end),
    // so a run committing a chunk every 200 ms read "3 min ago" and looked stuck.
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    let reached!: () => void;
    const atGate = new Promise<void>((r) => (reached = r));
    const job = defineJob({
      name: 'status-updated',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: ['a', 'b', 'c', 'd'].map((key) => ({ key })), next: null }),
          async run(_ctx: StepContext, chunk: { key: string }) {
            if (chunk.key !== 'd') return sleep(250);
            reached();
            await gate;
          },
        },
      ],
    });
    const running = runner.run(job, { key: 'su', health: false });
    try {
      await atGate;
      const [{ started, last }] = await query(url, `select r.attempt_started_at as started, max(c.done_at) as last from idem.runs r join idem.chunks c on c.run_id = r.id
        where r.job = 'status-updated' and c.done_at is not null group by r.attempt_started_at`);
      // a, b and c committed, 250 ms apart; d is claimed, not committed (invisible to this session).
      expect(new Date(last).getTime() - new Date(started).getTime()).toBeGreaterThanOrEqual(500);
      const row = (await runner.status('status-updated')).find((s) => s.runKey === 'su')!;
      expect(row).toMatchObject({ state: 'running', chunksDone: 3 });
      expect(Math.abs(row.updatedAt.getTime() - new Date(last).getTime())).toBeLessThanOrEqual(1);
      const json = JSON.parse((await idem(['status', '--json'])).stdout) as Array<{ runKey: string; updatedAt: string }>;
      expect(Math.abs(new Date(json.find((x) => x.runKey === 'su')!.updatedAt).getTime() - new Date(last).getTime())).toBeLessThanOrEqual(1);
      const reads = new pg.Pool({ connectionString: url, max: 1 });
      try {
        const view = await new RunViews(runner.db, reads, runner.schema, runner).byKey('status-updated', 'su');
        expect(view).toMatchObject({ state: 'running', progress: { done: 3 } });
        expect(Math.abs(new Date(view!.updatedAt).getTime() - new Date(last).getTime())).toBeLessThanOrEqual(1);
      } finally {
        await reads.end();
      }
    } finally {
      release();
    }
    expect((await running).status).toBe('succeeded');
  });
});

describe('throttling', () => {
  const doneTimes = async (job: string, key: string, step: string) =>
    (await chunkRows(url, job, key, step)).map((c) => (c.done_at as Date).getTime());

  /** Gaps in ms between consecutive chunk commits of one run's work step, in commit order. */
  const gapsOf = async (key: string) => {
    const times = (await doneTimes('counted', key, 'work')).sort((a, b) => a - b);
    return times.slice(1).map((t, i) => t - times[i]!);
  };

  it('--max-rate 5 starts chunks no faster than 5 a second: far slower than the same run unthrottled', async () => {
    // The unthrottled run, in the same test, measures this machine now: a slow machine alone
    // must not pass for a throttle.
    const free = await runCli(countedArgs('op-rate-free', { chunks: 10 }), { url });
    expect(free.code, free.stderr).toBe(0);
    const r = await runCli(countedArgs('op-rate5', { chunks: 10 }, ['--max-rate', '5']), { url });
    expect(r.code, r.stderr).toBe(0);
    const span = (gaps: number[]) => gaps.reduce((a, b) => a + b, 0);
    const [throttled, unthrottled] = [await gapsOf('op-rate5'), await gapsOf('op-rate-free')];
    expect(throttled).toHaveLength(9);
    // 9 intervals of 200 ms between the first and the last start (commits follow starts) ...
    expect(span(throttled)).toBeGreaterThanOrEqual(1_700);
    // ... and the throttle, not the machine, made it slow.
    expect(span(throttled)).toBeGreaterThanOrEqual(2 * span(unthrottled));
    console.log(`--max-rate 5: 10 chunks over ${span(throttled)} ms; unthrottled ${span(unthrottled)} ms`);
  });

  it('--pause 100 sleeps 100 ms after each chunk of one worker: on top of the chunk\'s own time', async () => {
    // Each chunk takes at least 60 ms of its own (pg_sleep inside the chunk). The markers are
    // written at the claim, so the gap between two claims is the chunk's time plus the pause:
    // at least 160 ms. A throttle that only spaced starts 100 ms apart would give ~100 ms; a slow
    // machine only makes the gaps longer, never shorter.
    const r = await runCli(countedArgs('op-pause100', { chunks: 6, pauseMs: 60 }, ['--pause', '100', '--concurrency', '1']), { url });
    expect(r.code, r.stderr).toBe(0);
    const paused = await gapsOf('op-pause100');
    expect(paused).toHaveLength(5);
    expect(Math.min(...paused)).toBeGreaterThanOrEqual(155);
    // And without --pause the same chunks follow each other at once: the gap is the chunk's time.
    const free = await runCli(countedArgs('op-pause-free', { chunks: 6, pauseMs: 60 }, ['--concurrency', '1']), { url });
    expect(free.code, free.stderr).toBe(0);
    const unpaused = await gapsOf('op-pause-free');
    expect(Math.min(...unpaused)).toBeGreaterThanOrEqual(55);
    console.log(`--pause 100: gaps ${paused.join(', ')} ms; unthrottled ${unpaused.join(', ')} ms`);
  });

  it('--target-chunk-ms grows keyRange chunks that finish early and shrinks chunks that run long', async () => {
    await query(url, 'insert into sized_items (id) select generate_series(1, 300)');
    const sizes = async (key: string) => (await chunkRows(url, 'sized', key, 'work')).map((c) => ({ lo: c.spec.lo as number, hi: c.spec.hi as number }));
    const covers = (ranges: Array<{ lo: number; hi: number }>) => ranges.every((c, i) => c.lo === (i === 0 ? 1 : ranges[i - 1]!.hi)) && ranges.at(-1)!.hi === 301;

    // 2 ms a row: a nominal chunk (20 rows) takes ~40 ms against a target of 400.
    const r = await runCli(['--jobs-dir', SIZED_JOBS, 'run', 'sized', '--param', 'msPerRow=2', '--target-chunk-ms', '400', '--key', 'op-grow'], { url });
    expect(r.code, r.stderr).toBe(0);
    const grown = await sizes('op-grow');
    expect(covers(grown)).toBe(true);
    // The first window (4 chunks while steering) is nominal; every full chunk after it is larger.
    expect(grown.slice(0, 4).map((c) => c.hi - c.lo)).toEqual([SIZED_NOMINAL, SIZED_NOMINAL, SIZED_NOMINAL, SIZED_NOMINAL]);
    expect(grown.length).toBeGreaterThan(5);
    for (const c of grown.slice(4, -1)) expect(c.hi - c.lo).toBeGreaterThan(SIZED_NOMINAL);

    // 4 ms a row: a nominal chunk takes ~80 ms against a target of 20: halved (the most per window), then again.
    const out = await runner.run(sized, { key: 'op-shrink', params: { msPerRow: 4 }, throttle: { targetChunkMs: 20 } });
    expect(out.status).toBe('succeeded');
    const shrunk = await sizes('op-shrink');
    expect(covers(shrunk)).toBe(true);
    expect(shrunk.slice(0, 8).map((c) => c.hi - c.lo)).toEqual([20, 20, 20, 20, 10, 10, 10, 10]);
    for (const c of shrunk.slice(8, -1)) expect(c.hi - c.lo).toBeLessThan(10);
  });
});

describe('--max-rate reservations of an earlier attempt', () => {
  // An attempt that ends (interrupted, failed) leaves the step's rate_next where its last
  // reservation put it: the start it reserved never happens. The next attempt's first start waits
  // at most one interval of its own rate, never the old schedule.
  let failFirst = true;
  const job = (name: string) =>
    defineJob({
      name,
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: ['c1', 'c2', 'c3', 'c4'].map((key) => ({ key })), next: null }),
          run: async (_ctx, chunk: { key: string }) => {
            if (chunk.key === 'c1' && failFirst) throw new Error('first attempt fails');
            await new Promise((r) => setTimeout(r, 10));
          },
        },
      ],
    });
  const leaveSchedule = async (name: string, rate: number) => {
    failFirst = true;
    await expect(runner.run(job(name), { key: 'k', throttle: { maxRate: rate } })).rejects.toThrow('first attempt fails');
    // As an interrupted run at --max-rate 0.01 leaves it: its next reservations far ahead.
    await query(url, `update idem.steps s set rate_next = clock_timestamp() + interval '100 seconds' from idem.runs r where r.id = s.run_id and r.job = $1 and s.name = 'work'`, [name]);
    failFirst = false;
  };

  it('a rerun at a higher rate starts at once', async () => {
    await leaveSchedule('rate-left-fast', 0.01);
    const started = performance.now();
    const out = await runner.run(job('rate-left-fast'), { key: 'k', throttle: { maxRate: 1000 } });
    expect(out).toMatchObject({ status: 'succeeded', attempt: 2 });
    expect(performance.now() - started).toBeLessThan(3_000);
  });

  it('a rerun at the same rate waits at most one interval before its first start, and spaces the rest', async () => {
    await leaveSchedule('rate-left-same', 1);
    const started = performance.now();
    const out = await runner.run(job('rate-left-same'), { key: 'k', throttle: { maxRate: 1 } });
    expect(out).toMatchObject({ status: 'succeeded', attempt: 2 });
    // Four starts one second apart, the first at most one second in: 3 to 4 seconds (and a little).
    const ms = performance.now() - started;
    expect(ms).toBeGreaterThanOrEqual(2_900);
    expect(ms).toBeLessThan(5_500);
  });
});

describe('Throttle', () => {
  it('reserveStart() spaces starts 1000 / maxRate ms apart and does not bank idle time', () => {
    const t = new Throttle({ maxRate: 20 });
    expect([t.reserveStart(1000), t.reserveStart(1000), t.reserveStart(1000), t.reserveStart(1010)]).toEqual([0, 50, 100, 140]);
    // After an idle spell the next start is free again, and the one after waits a full interval.
    expect(t.reserveStart(5000)).toBe(0);
    expect(t.reserveStart(5000)).toBe(50);
    expect(new Throttle({}).reserveStart(0)).toBe(0);
  });

  it('resolveThrottle() lets later layers win and names every bad value', () => {
    expect(resolveThrottle({ maxRate: 5, pauseMs: 10 }, undefined, { maxRate: 7 })).toEqual({ maxRate: 7, pauseMs: 10 });
    expect(() => resolveThrottle({ maxRate: 0, pauseMs: -1, targetChunkMs: -5 })).toThrow('invalid throttle: maxRate must be > 0 (got 0); pauseMs must be >= 0 (got -1); targetChunkMs must be > 0 (got -5)');
  });
});

describe('formatProgress', () => {
  const p = (over: Partial<Progress>): Progress => ({ runKey: 'k', attempt: 1, step: 'work', stepIndex: 1, steps: 3, done: 25, planned: 100, estimated: null, fullyPlanned: true, executedNow: 20, since: 0, ...over });

  it('shows done/total, the rate of this invocation and the ETA', () => {
    expect(formatProgress('counted', p({}), 10_000)).toBe('counted step 2/3 work: 25/100 chunks, 2.0/s, ETA 38s');
  });

  it('marks a total taken from an estimate with ~ and formats minutes and hours', () => {
    expect(formatProgress('counted', p({ fullyPlanned: false, estimated: 400 }), 10_000)).toBe('counted step 2/3 work: 25/400~ chunks, 2.0/s, ETA 3m08s');
    expect(formatProgress('counted', p({ planned: 9025 }), 10_000)).toBe('counted step 2/3 work: 25/9025 chunks, 2.0/s, ETA 1h15m');
  });

  it('says ETA ? before anything ran, and shows a bare count when nothing is planned', () => {
    expect(formatProgress('counted', p({ executedNow: 0 }), 10_000)).toBe('counted step 2/3 work: 25/100 chunks, 0.0/s, ETA ?');
    expect(formatProgress('j', p({ stepIndex: 0, steps: 1, done: 0, planned: 0, executedNow: 0 }), 10_000)).toBe('j step 1/1 work: 0 chunks, 0.0/s, ETA ?');
  });

  it('a JSON progress line names the job, run key and attempt, as every other line of the run does', async () => {
    const logged: Array<Record<string, unknown>> = [];
    const log = pino({ level: 'info' }, { write: (line: string) => void logged.push(JSON.parse(line)) });
    const reporter = createProgressReporter({ job: 'counted', tty: false, log, intervalMs: 10 });
    try {
      await runner.run(counted, { params: { chunks: 2 }, key: 'progress-fields', onProgress: reporter.update });
      await waitFor(async () => logged.length > 0, 'a progress line');
    } finally {
      reporter.stop();
    }
    expect(logged[0]).toMatchObject({ job: 'counted', runKey: 'progress-fields', attempt: 1, step: expect.any(String), msg: expect.stringMatching(/^counted step /) });
  });

  it('while the chunks left are held by another worker (one cut off: its lock lasts until the server ends it), says so instead of an ETA', () => {
    // Black-box round 13 (B1-5): the ETA, computed from the rate, counted down to 0 and stayed
    // there (or went odd) while the workers waited up to ~60 s for a cut-off worker's chunk.
    expect(formatProgress('counted', p({ done: 99, waitingOnOthers: true }), 10_000)).toBe('counted step 2/3 work: 99/100 chunks, 2.0/s, waiting on a chunk held by another worker');
    expect(formatProgress('counted', p({ done: 99, waitingOnOthers: false }), 10_000)).toBe('counted step 2/3 work: 99/100 chunks, 2.0/s, ETA 1s');
  });

  it('a worker whose slots all wait for a chunk another worker holds reports so, not an ETA, until the wait ends', async () => {
    const job = defineJob({
      name: 'held-eta',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [{ key: 'x' }, { key: 'y' }, { key: 'z' }], next: null }),
          async run({ db }: StepContext, { key }: { key: string }) {
            if (key === 'x') await sql`select 1 from gates where name = 'held-eta' for share`.execute(db);
          },
        },
      ],
    });
    const other = await Runner.connect({ connectionString: url });
    const gate = await holdGate(url, 'held-eta');
    const seen: Progress[] = [];
    let first: Promise<unknown> | undefined;
    let second: Promise<unknown> | undefined;
    try {
      first = runner.run(job, { key: 'k', join: true });
      await waitFor(async () => (await lockWaiters(url)) > 0, 'chunk x to wait at the gate');
      second = other.run(job, { key: 'k', join: true, onProgress: (p) => void seen.push(p) });
      const waiting = await waitFor(async () => seen.find((p) => p.waitingOnOthers), 'the joiner to wait on chunk x');
      expect(formatProgress('held-eta', waiting, waiting.since + 10_000)).toMatch(/, waiting on a chunk held by another worker$/);
      await gate.release();
      expect(await second).toMatchObject({ status: 'succeeded' });
      expect(await first).toMatchObject({ status: 'succeeded' });
      // The wait over, it is said no more.
      expect(seen.at(-1)?.waitingOnOthers).toBe(false);
    } finally {
      await gate.release();
      await Promise.allSettled([first, second]);
      await other.close();
    }
  });

  it("a worker waiting on another worker's chunk reports the other's later commits, read back from the database", async () => {
    // Black-box round 15 (B1-1): a --join worker that waited on a stopped worker's chunks printed
    // "done":27 for 30 s while 28 were done: the step's count was read back only on its own chunk
    // events, and waiting it had none; the 10-second line reprinted its last figures.
    const job = defineJob({
      name: 'held-refresh',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [{ key: 'x' }, { key: 'y' }, { key: 'z' }], next: null }),
          async run({ db }: StepContext, { key }: { key: string }) {
            if (key !== 'z') await sql`select 1 from gates where name = ${`held-refresh-${key}`} for share`.execute(db);
          },
        },
      ],
    });
    const other = await Runner.connect({ connectionString: url });
    const gateX = await holdGate(url, 'held-refresh-x');
    const gateY = await holdGate(url, 'held-refresh-y');
    const logged: Array<{ done: number; waitingOnOthers?: boolean }> = [];
    const log = pino({ level: 'info' }, { write: (line: string) => void logged.push(JSON.parse(line)) });
    const reporter = createProgressReporter({ job: 'held-refresh', tty: false, log, intervalMs: 100 });
    let first: Promise<unknown> | undefined;
    let second: Promise<unknown> | undefined;
    try {
      // The first worker's two slots hold x and y at their gates; the second does z, then waits.
      first = runner.run(job, { key: 'k', join: true, concurrency: 2 });
      await waitFor(async () => (await lockWaiters(url)) >= 2, 'chunks x and y to wait at their gates');
      second = other.run(job, { key: 'k', join: true, concurrency: 1, onProgress: reporter.update });
      await waitFor(async () => logged.find((l) => l.waitingOnOthers && l.done === 1), 'the joiner to have done z and to wait on x and y');
      // The first worker commits y; the joiner, still waiting (on x), has no chunk event of its own.
      await gateY.release();
      await waitFor(async () => ((await chunkRows(url, 'held-refresh', 'k', 'work')).filter((c) => c.done_at !== null).length === 2 ? true : undefined), 'y committed');
      const line = await waitFor(async () => logged.find((l) => l.waitingOnOthers && l.done === 2), "the joiner's progress line to count y", { timeoutMs: 5_000 });
      expect(line).toMatchObject({ done: 2, planned: 3, executedNow: 1, waitingOnOthers: true });
      await gateX.release();
      expect(await second).toMatchObject({ status: 'succeeded' });
      expect(await first).toMatchObject({ status: 'succeeded' });
    } finally {
      reporter.stop();
      await gateX.release();
      await gateY.release();
      await Promise.allSettled([first, second]);
      await other.close();
    }
  });

  it('never shows 60 seconds in a minute', () => {
    // 239 left at 2/s: 119.5 s, which rounds up to 2m00s.
    expect(formatProgress('counted', p({ done: 0, planned: 239, executedNow: 2 }), 1_000)).toBe('counted step 2/3 work: 0/239 chunks, 2.0/s, ETA 2m00s');
  });
});
