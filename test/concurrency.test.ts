import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import pg from 'pg';
import { Runner } from '../src/index.ts';
import { lockKey } from '../src/fingerprint.ts';
import { DEFAULT_SCHEMA } from '../src/runner.ts';
import counted, { chunkKey } from './fixtures/jobs/counted.ts';
import {
  FIXTURE_DIRS,
  holdGate,
  killLeftovers,
  lines,
  busyMessage,
  logLines,
  query,
  runCli,
  runRow,
  sessions,
  spawnCli,
  waitFor,
  workCounts,
  type CliProcess,
  type CliResult,
  endState,
} from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

const testDb = useTestDatabase({ fixtureTables: true, runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});

// A failed test must not leave processes holding the job's lock for the next one.
afterEach(killLeftovers);

afterAll(killLeftovers);

const CHUNKS = 8;
/** Ten Node processes starting at once on two cores take a while; the tests' own waits are deterministic. */
const PROCESS_TEST_TIMEOUT = 150_000;
const ones = (n: number) => new Map(Array.from({ length: n }, (_, i) => [chunkKey(i + 1), 1]));

/** Starts n identical CLI processes at once; `exited` fills as they end. */
function startMany(n: number, args: string[], env?: Record<string, string>) {
  const procs: CliProcess[] = Array.from({ length: n }, () => spawnCli([...FIXTURE_DIRS, ...args], { url, timeoutMs: 90_000, ...(env ? { env } : {}) }));
  const exited: Array<CliResult & { pid: number }> = [];
  for (const p of procs) void p.done.then((r) => exited.push({ ...r, pid: p.pid }));
  return { procs, exited, all: () => Promise.all(procs.map((p) => p.done)) };
}

describe('overlapping runs of one job', () => {
  it('of ten concurrent `idem run`s exactly one works; the nine others exit 75 at once', async () => {
    const gate = await holdGate(url, 'ten');
    const params = JSON.stringify({ chunks: CHUNKS, pauseMs: 20, gate: 'ten' });
    // Debug logging timestamps the moment each process starts using the database ("using database").
    const many = startMany(10, ['--log-level', 'debug', 'run', 'counted', '--params', params, '--key', 'ten', '--json']);
    let losers: Array<CliResult & { pid: number }>;
    let busyMs: number[];
    try {
      // The winner holds the lock and sits in its first chunk until the gate opens: every other
      // process must have given up by then, without waiting for it.
      await waitFor(async () => many.exited.length >= 9, 'nine processes to exit', { timeoutMs: 60_000 });
      losers = [...many.exited];
      expect(losers.map((r) => r.code)).toEqual(new Array(9).fill(75));
      for (const r of losers) {
        // Busy is info, not an error: no `idem: error:` line, one "busy: …" log line.
        expect(lines(r.stderr).filter((l) => !l.startsWith('{'))).toEqual([]);
        expect(busyMessage(r.stderr)).toMatch(/^busy: job "counted" is running in another process \(its advisory lock is held by backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\)(?:; backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\))*\); try again later or pass --wait$/);
      }
      // "At once" is proven by the gate: the winner cannot finish before it opens, and all nine
      // exited while it was shut. The times are only reported (a loaded machine stretches them).
      busyMs = losers.map((r) => r.endedAt - logLines(r.stderr).find((l) => l.msg === 'using database')!.time);
      // A bounded wait gives up after its bound with the same busy code.
      const bounded = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', 'ten', '--wait', '1'], { url });
      expect(bounded.code, bounded.stderr).toBe(75);
      expect(lines(bounded.stderr).filter((l) => !l.startsWith('{'))).toEqual([]);
      expect(busyMessage(bounded.stderr)).toMatch(/^busy: job "counted" is still running in another process after waiting 1s \(its advisory lock is held by backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\)(?:; backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\))*\); try again later$/);
      const winner = many.procs.find((p) => !losers.some((l) => l.pid === p.pid))!;
      expect(winner.child.exitCode).toBeNull();
      const [status] = await runner.status('counted', 1);
      expect(status).toMatchObject({ runKey: 'ten', state: 'running', attempt: 1 });
      expect(status!.holder).toMatch(new RegExp(`:${winner.pid}$`));
      expect(await workCounts(url, 'ten')).toEqual(new Map());
    } finally {
      await gate.release();
    }
    const results = await many.all();
    const winners = results.filter((r) => r.code === 0);
    expect(winners).toHaveLength(1);
    expect(JSON.parse(winners[0]!.stdout)).toMatchObject({ status: 'succeeded', attempt: 1, executed: CHUNKS + 2 });
    expect(await workCounts(url, 'ten')).toEqual(ones(CHUNKS));
    expect(await runRow(url, 'counted', 'ten')).toMatchObject({ status: 'succeeded', attempt: 1 });
    console.log(`losers exited 75 after ${losers.map((r) => r.ms).join(', ')} ms from spawn, ${busyMs.join(', ')} ms from first database use (winner: ${winners[0]!.ms} ms)`);
  }, PROCESS_TEST_TIMEOUT);

  it('ten concurrent `idem run --wait`s all exit 0, with the end state of one clean run', async () => {
    const gate = await holdGate(url, 'ten-wait');
    const params = JSON.stringify({ chunks: CHUNKS, pauseMs: 20, gate: 'ten-wait' });
    const many = startMany(10, ['run', 'counted', '--params', params, '--key', 'ten-wait', '--wait', '--json']);
    try {
      // All ten hold a lock session (one owns the lock, nine poll for it) while the run is stuck.
      await waitFor(async () => (await sessions(url, 'idem-lock')) === 10, 'ten lock sessions', { timeoutMs: 60_000 });
      expect(many.exited).toEqual([]);
    } finally {
      await gate.release();
    }
    const results = await many.all();
    expect(results.map((r) => r.code)).toEqual(new Array(10).fill(0));
    const outcomes = results.map((r) => JSON.parse(r.stdout) as { status: string; executed: number; attempt: number });
    expect(outcomes.filter((o) => o.status === 'succeeded' && o.executed === CHUNKS + 2 && o.attempt === 1)).toHaveLength(1);
    expect(outcomes.filter((o) => o.status === 'already-succeeded' && o.executed === 0)).toHaveLength(9);
    expect(await workCounts(url, 'ten-wait')).toEqual(ones(CHUNKS));
    // Waiters that found the run done did not take it over: one attempt.
    expect(await runRow(url, 'counted', 'ten-wait')).toMatchObject({ status: 'succeeded', attempt: 1 });
    // The end state of one clean, undisturbed run of the same params, made here (not by another test).
    await runner.run(counted, { key: 'ten-wait-clean', params: { chunks: CHUNKS, pauseMs: 20, gate: 'ten-wait' } });
    expect(await endState(url, 'ten-wait', { withAttempts: true })).toEqual(await endState(url, 'ten-wait-clean', { withAttempts: true }));
    expect(await sessions(url, 'idem-lock')).toBe(0);
  }, PROCESS_TEST_TIMEOUT);
});

describe('many slots of one process', () => {
  it('sixteen slots pausing at once print no warning: nothing hangs more than ten listeners on one signal', async () => {
    // Each waiting slot hung an abort listener on the run's stop signal: from the eleventh on,
    // Node printed "MaxListenersExceededWarning: Possible EventTarget memory leak" (the CLI
    // turned it into an idem: warning: line) for a run that was fine.
    const res = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify({ chunks: 48 }), '--key', 'sixteen-slots', '--concurrency', '16', '--pause', '150'], { url });
    expect(res.code, res.stderr).toBe(0);
    expect(res.stderr).not.toMatch(/warning|MaxListeners/i);
    expect(await workCounts(url, 'sixteen-slots')).toEqual(ones(48));
  }, PROCESS_TEST_TIMEOUT);
});

describe('parallel `idem migrate`', () => {
  it('five pods migrating at once all exit 0 and each migration does its work once', async () => {
    const gate = await holdGate(url, 'migrate');
    const many = startMany(5, ['migrate', '--json'], { IDEM_TEST_GATE: 'migrate' });
    try {
      await waitFor(async () => (await sessions(url, 'idem-lock')) === 5, 'five lock sessions', { timeoutMs: 60_000 });
      expect(many.exited).toEqual([]);
      // A pod that must not wait gets the busy code instead.
      const impatient = await runCli([...FIXTURE_DIRS, 'migrate', '--no-wait'], { url, env: { IDEM_TEST_GATE: 'migrate' } });
      expect(impatient.code, impatient.stderr).toBe(75);
      expect(lines(impatient.stderr).filter((l) => !l.startsWith('{'))).toEqual([]);
      expect(busyMessage(impatient.stderr)).toMatch(/^busy: idem migrate is running in another process \(its advisory lock is held by backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\)(?:; backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\))*\); try again later or pass --wait$/);
      // The first migration is done; the second is stuck in its first chunk.
      expect(await query(url, `select run_key, status from idem.runs where job in ('create-widgets', 'backfill-widgets') order by run_key`)).toEqual([
        { run_key: '0001_create_widgets', status: 'succeeded' },
        { run_key: '0002_backfill_widgets', status: 'running' },
      ]);
    } finally {
      await gate.release();
    }
    const results = await many.all();
    expect(results.map((r) => r.code), results.map((r) => r.stderr).join('\n')).toEqual([0, 0, 0, 0, 0]);
    const outcomes = results.map((r) => JSON.parse(r.stdout) as Array<{ runKey: string; status: string; executed: number }>);
    // Every pod reports both migrations; only one of them executed the (gated) second one's 6 chunks.
    expect(outcomes.every((o) => o.map((m) => m.runKey).join() === '0001_create_widgets,0002_backfill_widgets')).toBe(true);
    expect(outcomes.filter((o) => o[1]!.status === 'succeeded' && o[1]!.executed === 6)).toHaveLength(1);
    expect(outcomes.filter((o) => o[1]!.status === 'already-succeeded' && o[1]!.executed === 0)).toHaveLength(4);

    const runs = await query(url, `select job, run_key, status, attempt from idem.runs where job in ('create-widgets', 'backfill-widgets') order by run_key`);
    expect(runs).toEqual([
      { job: 'create-widgets', run_key: '0001_create_widgets', status: 'succeeded', attempt: 1 },
      { job: 'backfill-widgets', run_key: '0002_backfill_widgets', status: 'succeeded', attempt: 1 },
    ]);
    const log = await query(url, `select job, chunk_key, count(*)::int as n from work_log where job in ('create-widgets', 'backfill-widgets') group by 1, 2 order by 1, 2`);
    expect(log).toEqual([
      { job: 'backfill-widgets', chunk_key: '[1,6)', n: 1 },
      { job: 'backfill-widgets', chunk_key: '[11,16)', n: 1 },
      { job: 'backfill-widgets', chunk_key: '[16,21)', n: 1 },
      { job: 'backfill-widgets', chunk_key: '[21,26)', n: 1 },
      { job: 'backfill-widgets', chunk_key: '[26,31)', n: 1 },
      { job: 'backfill-widgets', chunk_key: '[6,11)', n: 1 },
      { job: 'create-widgets', chunk_key: 'step', n: 1 },
    ]);
    expect(await query(url, `select count(*)::int as n, count(name_upper)::int as done from widgets`)).toEqual([{ n: 30, done: 30 }]);

    // A later pod finds everything done without touching the lock: while another session holds
    // the migrate lock, `migrate --no-wait` (which would exit 75 on trying it) exits 0.
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      await holder.query('select pg_advisory_lock($1::bigint)', [lockKey(`${DEFAULT_SCHEMA}:migrate`)]);
      const later = await runCli([...FIXTURE_DIRS, 'migrate', '--no-wait', '--json'], { url });
      expect(later.code, later.stderr).toBe(0);
      expect(JSON.parse(later.stdout)).toMatchObject([{ status: 'already-succeeded', runKey: '0001_create_widgets' }, { status: 'already-succeeded', runKey: '0002_backfill_widgets' }]);
    } finally {
      await holder.end();
    }
  }, PROCESS_TEST_TIMEOUT);
});
