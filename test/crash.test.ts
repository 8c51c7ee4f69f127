import { spawn, spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { shellQuote } from '../src/shell-quote.ts';
import { Runner } from '../src/index.ts';
import counted, { chunkKey } from './fixtures/jobs/counted.ts';
import { BIN, chunkRows, endState, expectFaultCrash, expectKilled, FIXTURE_DIRS, holdGate, killLeftovers, lines, query, runCli, runRow, sessions, spawnCli, waitFor, workCounts, lockWaiters } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

// idem's schema exists before the first poll of idem.chunks.
const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
let url: string;
beforeAll(() => {
  url = testDb.url;
});

// A failed test must not leave its run holding the job's lock for the next one.
afterEach(killLeftovers);

afterAll(killLeftovers);

/**
 * An in-process Runner for one call, closed after: its pool's idle sessions (application_name
 * `idem host:pid`, like the CLI's) must not linger, or `settled()` would wait for them.
 */
async function withRunner<T>(fn: (runner: Runner) => Promise<T>): Promise<T> {
  const runner = await Runner.connect({ connectionString: url });
  try {
    return await fn(runner);
  } finally {
    await runner.close();
  }
}

const CHUNKS = 40;
const PARAMS = { chunks: CHUNKS, pauseMs: 50 };
const ones = (n: number) => new Map(Array.from({ length: n }, (_, i) => [chunkKey(i + 1), 1]));
const run = (key: string, params: object = PARAMS, env?: Record<string, string>) =>
  spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify(params), '--key', key, '--json'], { url, ...(env ? { env } : {}) });

/** Keys of the `work` chunks whose marker committed. */
async function doneKeys(runKey: string): Promise<string[]> {
  return (await chunkRows(url, 'counted', runKey, 'work')).filter((c) => c.done_at !== null).map((c) => c.key);
}

/** Waits until a killed process's sessions are gone: after that nothing of it can still commit. */
async function settled(): Promise<void> {
  await waitFor(async () => (await sessions(url, 'idem')) + (await sessions(url, 'idem-lock')) === 0, 'the killed process\'s sessions to end');
}

describe('a run killed with SIGKILL', () => {
  it("its statement waiting on a lock does not outlive it on the server (client_connection_check_interval)", async () => {
    // Black-box round 13: after a run was killed (or had to exit past its shutdown deadline), its
    // backend stayed active on the server, still waiting on the lock its statement wanted; it took
    // the lock when that was released, for a process that no longer existed.
    const key = 'killed-waiting';
    const gate = 'killed-waiting-gate';
    const held = await holdGate(url, gate);
    try {
      const proc = run(key, { ...PARAMS, chunks: 3, gate });
      await waitFor(async () => (await lockWaiters(url, 'idem')) > 0, 'a chunk blocked at the gate');
      proc.child.kill('SIGKILL');
      expectKilled(await proc.done);
      // The server checks the vanished client every 5 s while the statement waits.
      const gone = Date.now();
      await waitFor(async () => ((await lockWaiters(url, 'idem')) === 0 ? true : undefined), "the killed run's waiting backend to end", { timeoutMs: 15_000 });
      expect(Date.now() - gone).toBeLessThan(15_000);
    } finally {
      await held.release();
    }
  });

  it('keeps exactly the chunks it committed, and a rerun resumes to the end state of a clean run', async () => {
    const proc = run('crash');
    await waitFor(async () => (await doneKeys('crash')).length >= 5, 'five chunks to be done', { timeoutMs: 60_000 });
    proc.child.kill('SIGKILL');
    expectKilled(await proc.done);
    await settled();

    const done = await doneKeys('crash');
    expect(done.length).toBeGreaterThanOrEqual(5);
    expect(done.length).toBeLessThan(CHUNKS);
    // Markers and work committed together: the work log holds exactly the done chunks, once each.
    expect(await workCounts(url, 'crash')).toEqual(new Map(done.map((k) => [k, 1])));
    expect(await runRow(url, 'counted', 'crash')).toMatchObject({ status: 'running', attempt: 1, finished_at: null });
    // The row still says running, but no session holds the lock any more.
    const [status] = await withRunner((runner) => runner.status('counted', 1));
    expect(status).toMatchObject({ runKey: 'crash', state: 'crashed', attempt: 1, chunksDone: done.length + 1 });

    const rerun = await run('crash').done;
    expect(rerun.code, rerun.stderr).toBe(0);
    // The prepare step and the done chunks are skipped: the rest of `work` and `finish` run.
    expect(JSON.parse(rerun.stdout)).toMatchObject({ status: 'succeeded', attempt: 2, executed: CHUNKS - done.length + 1 });
    expect(await runRow(url, 'counted', 'crash')).toMatchObject({ status: 'succeeded', attempt: 2 });
    const chunks = await chunkRows(url, 'counted', 'crash', 'work');
    expect(chunks).toHaveLength(CHUNKS);
    expect(chunks.map((c) => [c.key, c.done_attempt])).toEqual(chunks.map((c) => [c.key, done.includes(c.key) ? 1 : 2]));
    expect(await workCounts(url, 'crash')).toEqual(ones(CHUNKS));
    const log = await query(url, `select chunk_key, attempt from work_log where run_key = 'crash' and step = 'work' order by chunk_key`);
    expect(log.map((r) => [r.chunk_key, r.attempt])).toEqual(chunks.map((c) => [c.key, c.done_attempt]));

    const clean = await withRunner((runner) => runner.run(counted, { params: PARAMS, key: 'crash-clean' }));
    expect(clean).toMatchObject({ status: 'succeeded', attempt: 1, executed: CHUNKS + 2 });
    expect(await endState(url, 'crash', { withAttempts: false })).toEqual(await endState(url, 'crash-clean', { withAttempts: false }));
  }, 120_000);
});

describe('a run killed with SIGKILL, seen by --dry-run (round 18, B10 C2)', () => {
  it('the dry run says crashed, as idem status does, and that the real run resumes it as the next attempt (--join too); running only while live', async () => {
    // Black-box round 18 (B10, C2): a dry run reported a crashed run "running" (exit 0, and
    // "state":"running" in --json), where idem status said crashed and the real run resumes it.
    const key = 'dry-crashed';
    const gate = 'dry-crashed-gate';
    const held = await holdGate(url, gate);
    const params = { ...PARAMS, chunks: 3, gate };
    const dry = (extra: string[] = []) => runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify(params), '--key', key, '--dry-run', ...extra], { url });
    try {
      const proc = run(key, params);
      await waitFor(async () => (await lockWaiters(url, 'idem')) > 0, 'a chunk blocked at the gate');
      // Live: the real plain run would be busy.
      const live = await dry(['--json']);
      expect(live.code, live.stderr).toBe(0);
      expect(JSON.parse(live.stdout)).toMatchObject({ status: 'dry-run', attempt: 1, plan: { state: 'running' } });
      proc.child.kill('SIGKILL');
      expectKilled(await proc.done);
      await settled();
    } finally {
      await held.release();
    }
    const before = await runRow(url, 'counted', key);
    expect(before).toMatchObject({ status: 'running', attempt: 1 });
    const [status] = await withRunner((runner) => runner.status('counted', 1));
    expect(status).toMatchObject({ runKey: key, state: 'crashed' });
    for (const extra of [[], ['--join']]) {
      const text = await dry(extra);
      expect(text.code, text.stderr).toBe(0);
      expect(text.stdout).toBe(`dry run: job "counted" run key ${key} is crashed (idem run resumes it as attempt 2); steps: prepare, work (chunked), finish; nothing was written\n`);
      const json = await dry([...extra, '--json']);
      expect(json.code, json.stderr).toBe(0);
      expect(JSON.parse(json.stdout)).toMatchObject({ status: 'dry-run', runKey: key, attempt: 1, plan: { state: 'crashed' } });
    }
    expect(await runRow(url, 'counted', key)).toEqual(before);
    // And the real run does resume it, as attempt 2.
    const rerun = await run(key, params).done;
    expect(rerun.code, rerun.stderr).toBe(0);
    expect(JSON.parse(rerun.stdout)).toMatchObject({ status: 'succeeded', attempt: 2 });
  });
});

describe('a run stopped with one SIGTERM or SIGINT', () => {
  it.each([
    ['SIGTERM', 143],
    ['SIGINT', 130],
    // The terminal closed (an ssh session dropped, the shell that started it exited).
    ['SIGHUP', 129],
  ] as const)('%s: the chunk in flight commits, no new one starts, exit %i as interrupted, and the same command resumes', async (sig, exitCode) => {
    const key = `stop-${sig}`;
    const gate = `gate-${sig}`;
    // 150 ms chunks: the gate below must be held before the run ends (~5 s after the third chunk;
    // with PARAMS' 50 ms it was under 2 s, thin on a loaded machine, as a CI time-out in
    // failure-semantics.test.ts showed for the same pattern).
    const params = { ...PARAMS, pauseMs: 150, gate };
    // The gate row exists from the start, so every chunk takes it (for share) while it runs.
    await query(url, 'insert into gates (name) values ($1) on conflict do nothing', [gate]);
    const proc = run(key, params);
    let inFlight: string;
    let doneBefore: string[];
    await waitFor(async () => (await doneKeys(key)).length >= 3, 'three chunks to be done', { timeoutMs: 60_000 });
    // Taking the gate waits for the chunk that holds it to commit; the next chunk then blocks on
    // it, so exactly one chunk is in flight (concurrency 1) when the signal arrives.
    const held = await holdGate(url, gate);
    try {
      await waitFor(async () => (await lockWaiters(url, 'idem')) > 0, 'a chunk blocked at the gate');
      doneBefore = await doneKeys(key);
      inFlight = chunkKey(doneBefore.length + 1);
      expect(doneBefore).toEqual(Array.from({ length: doneBefore.length }, (_, i) => chunkKey(i + 1)));
      proc.child.kill(sig);
      // The process has handled the signal (stop requested) while its chunk is still in flight.
      await waitFor(async () => proc.stderr().includes('stopping: no new chunks'), 'the process to log that it is stopping');
      expect(await doneKeys(key)).toEqual(doneBefore);
    } finally {
      await held.release();
    }
    const stopped = await proc.done;
    expect(stopped.timedOut, stopped.stderr).toBe(false);
    expect(stopped.code, stopped.stderr).toBe(exitCode);
    expect(lines(stopped.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([
      `idem: error: interrupted by ${sig}; finished chunks are kept, run the same command again to resume`,
    ]);
    // It stopped because the chunk finished, not because the shutdown deadline aborted it.
    expect(stopped.stderr).not.toContain('shutdown deadline passed');
    await settled();
    // The chunk in flight when the signal arrived committed, work and marker; nothing after it started.
    expect(await doneKeys(key)).toEqual([...doneBefore, inFlight]);
    expect(await workCounts(url, key)).toEqual(new Map([...doneBefore, inFlight].map((k) => [k, 1])));
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'interrupted', attempt: 1, holder: null });

    const rerun = await run(key, params).done;
    expect(rerun.code, rerun.stderr).toBe(0);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'succeeded', attempt: 2 });
    expect(await workCounts(url, key)).toEqual(ones(CHUNKS));
  }, 120_000);
});

/** `script` (util-linux) runs a command on a terminal of its own; killing it hangs that terminal up. */
const hasScript = spawnSync('script', ['--version'], { stdio: 'ignore' }).status === 0;

describe('a terminal that hangs up under a run (an ssh session dropped)', () => {
  // Every write to the terminal fails (EIO) from then on, and Node 20 aborted at exit restoring
  // its settings: the process died by SIGABRT, the run left `running` (crashed).
  it.skipIf(!hasScript)('stops the run as SIGHUP does: exit 129, interrupted, every committed chunk once, and the same command resumes', async () => {
    const key = 'hangup';
    const dir = await mkdtemp(path.join(os.tmpdir(), 'idem-hangup-'));
    const result = path.join(dir, 'exit.json');
    const idemArgs = [BIN, ...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify({ ...PARAMS, pauseMs: 150 }), '--key', key];
    const line = [process.execPath, fileURLToPath(new URL('./fixtures/hangup-launcher.mjs', import.meta.url)), result, process.execPath, ...idemArgs].map(shellQuote).join(' ');
    const env: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: url, SHELL: '/bin/bash' };
    delete env.NODE_OPTIONS;
    const terminal = spawn('script', ['-qfec', line, '/dev/null'], { env, stdio: ['ignore', 'ignore', 'ignore'] });
    try {
      await waitFor(async () => (await doneKeys(key)).length >= 3, 'three chunks to be done', { timeoutMs: 60_000 });
      terminal.kill('SIGKILL'); // its end of the terminal closes: the terminal hangs up
      await waitFor(async () => existsSync(result), 'the run to end', { timeoutMs: 30_000 });
      expect(JSON.parse(await readFile(result, 'utf8'))).toEqual({ code: 129, signal: null });
    } finally {
      terminal.kill('SIGKILL');
      await rm(dir, { recursive: true, force: true });
    }
    await settled();
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'interrupted', attempt: 1, holder: null });
    const done = await doneKeys(key);
    expect(await workCounts(url, key)).toEqual(new Map(done.map((k) => [k, 1])));
    const rerun = await run(key, { ...PARAMS, pauseMs: 150 }).done;
    expect(rerun.code, rerun.stderr).toBe(0);
    expect(await workCounts(url, key)).toEqual(ones(CHUNKS));
  }, 120_000);
});

describe('a crash at a protocol boundary (IDEM_FAULT)', () => {
  // Hits count every chunk transaction, single steps included: hit 1 is `prepare`, hit 3 is c0002.
  it.each([
    ['after-marker', 'the marker is written but not committed: neither it nor the work survives', ['c0001']],
    ['after-commit', 'the chunk committed: the rerun does not redo it', ['c0001', 'c0002']],
  ])('%s: %s', async (point, _, doneBeforeRerun) => {
    const key = `fault-${point}`;
    const params = { chunks: 5, label: key };
    const crashed = await run(key, params, { IDEM_FAULT: `${point}:crash:3` }).done;
    expectFaultCrash(crashed, point);
    await settled();
    expect(await doneKeys(key)).toEqual(doneBeforeRerun);
    expect(await workCounts(url, key)).toEqual(new Map(doneBeforeRerun.map((k) => [k, 1])));

    const rerun = await run(key, params).done;
    expect(rerun.code, rerun.stderr).toBe(0);
    expect(await workCounts(url, key)).toEqual(ones(5));
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'succeeded', attempt: 2 });
  });

  it('before-finish: every step is done but the run is not marked; the rerun only marks it', async () => {
    const params = { chunks: 3, label: 'before-finish' };
    const crashed = await run('fault-before-finish', params, { IDEM_FAULT: 'before-finish:crash:1' }).done;
    expectFaultCrash(crashed, 'before-finish');
    await settled();
    expect(await runRow(url, 'counted', 'fault-before-finish')).toMatchObject({ status: 'running', attempt: 1 });
    expect(await workCounts(url, 'fault-before-finish', 'finish')).toEqual(new Map([['step', 1]]));

    const rerun = await run('fault-before-finish', params).done;
    expect(rerun.code, rerun.stderr).toBe(0);
    expect(JSON.parse(rerun.stdout)).toMatchObject({ status: 'succeeded', attempt: 2, executed: 0 });
    expect(await runRow(url, 'counted', 'fault-before-finish')).toMatchObject({ status: 'succeeded', attempt: 2 });
    expect(await workCounts(url, 'fault-before-finish')).toEqual(ones(3));
    expect(await workCounts(url, 'fault-before-finish', 'finish')).toEqual(new Map([['step', 1]]));
  });
});
