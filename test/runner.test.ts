import pg from 'pg';
import { afterEach, beforeAll, describe, expect, it, vi } from 'vitest';
import { BusyError, defineJob, exitCodeOf, fingerprint, LockLostError, ParamsMismatchError, RunFailedError, Runner, sql, UsageError, type Json, type StepContext } from '../src/index.ts';
import { lockKey } from '../src/fingerprint.ts';
import counted, { chunkKey, maybeFail } from './fixtures/jobs/counted.ts';
import ranged from './fixtures/jobs/ranged.ts';
import { ALL_TABLES, chunkRows, holdGate, query, runRow, snapshot, waitFor, workCounts, lockWaiters } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { recordedFailure } from '../src/finalize.ts';
import { formatStatus } from '../src/commands/status.ts';

const testDb = useTestDatabase({ fixtureTables: true, runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});

// A test that failed before its own cleanup must not make the next test's chunks fail.
afterEach(() => query(url, 'delete from fail_chunks'));

/** The error a promise rejects with (fails the test if it resolves). */
async function rejectionOf(p: Promise<unknown>): Promise<Error> {
  return p.then(
    (v) => {
      throw new Error(`expected a rejection, got ${JSON.stringify(v)}`);
    },
    (e: Error) => e,
  );
}

/** How many statements fn sends to Postgres (through any pg client in this process). */
async function countStatements<T>(fn: () => Promise<T>): Promise<{ result: T; statements: number }> {
  const spy = vi.spyOn(pg.Client.prototype, 'query');
  try {
    const result = await fn();
    return { result, statements: spy.mock.calls.length };
  } finally {
    spy.mockRestore();
  }
}

const ones = (n: number) => new Map(Array.from({ length: n }, (_, i) => [chunkKey(i + 1), 1]));

describe('Runner.run', () => {
  it('a second run of a finished job changes nothing and costs O(1) statements', async () => {
    const statementsOfRerun: number[] = [];
    for (const [chunks, key] of [[10, 'twice-10'], [40, 'twice-40']] as const) {
      const first = await runner.run(counted, { params: { chunks }, key });
      expect(first).toMatchObject({ status: 'succeeded', job: 'counted', runKey: key, attempt: 1, executed: chunks + 2 });
      expect(first.summary).toMatchObject({ chunks: chunks + 2, attempts: 1, steps: [{ name: 'prepare', chunks: 1 }, { name: 'work', chunks }, { name: 'finish', chunks: 1 }] });
      // Both times as idem prints every other (status --json, the API): ISO 8601 in UTC, milliseconds,
      // whatever the server's TimeZone (finishedAt had microseconds and +00:00 beside startedAt's .546).
      for (const at of [first.summary!.startedAt, first.summary!.finishedAt]) expect(at).toBe(new Date(at).toISOString());
      const before = await snapshot(url, ALL_TABLES);

      const { result: second, statements } = await countStatements(() => runner.run(counted, { params: { chunks }, key }));
      expect(second).toMatchObject({ status: 'already-succeeded', executed: 0, job: 'counted', runKey: key, runId: first.runId, attempt: 1 });
      expect(second.summary).toEqual(first.summary);
      expect(await snapshot(url, ALL_TABLES)).toEqual(before);
      expect(await workCounts(url, key)).toEqual(ones(chunks));
      expect(await workCounts(url, key, 'prepare')).toEqual(new Map([['step', 1]]));
      statementsOfRerun.push(statements);
    }
    // One claim statement, whatever the run's size: no lock, no planning, no chunk scan. The lower
    // bound proves the spy counts (a spy on the wrong method would report 0).
    expect(statementsOfRerun[0]).toBeGreaterThanOrEqual(1);
    expect(statementsOfRerun[0]).toBeLessThanOrEqual(2);
    expect(statementsOfRerun[1]).toBe(statementsOfRerun[0]);
  });

  it('planning a window is one statement: no transaction of its own', async () => {
    // Six round trips a window (BEGIN, lock, duplicate check, insert, cursor, COMMIT) were most of
    // what planning cost the runner's Node CPU. 40 chunks more in windows of 5 are 8 windows more.
    const job = defineJob({
      name: 'plan-statements',
      params: (raw: unknown) => raw as { n: number },
      steps: [
        {
          name: 'work',
          chunks: (cursor, ctx) => {
            const from = typeof cursor === 'number' ? cursor : 0;
            const to = Math.min(from + ctx.windowSize, (ctx.params as { n: number }).n);
            return { chunks: Array.from({ length: to - from }, (_, i) => ({ key: `c${from + i}` })), next: to < (ctx.params as { n: number }).n ? to : null };
          },
          run: ({ db }: StepContext) => sql`select 1`.execute(db),
        },
      ],
    });
    const sent: Array<{ planning: number; begins: number }> = [];
    for (const n of [20, 60]) {
      const spy = vi.spyOn(pg.Client.prototype, 'query');
      try {
        expect(await runner.run(job, { params: { n }, key: `p${n}`, health: false, planWindow: 5 })).toMatchObject({ status: 'succeeded', executed: n });
        const texts = spy.mock.calls.map((c) => (typeof c[0] === 'string' ? c[0] : ((c[0] as { text?: string } | undefined)?.text ?? '')));
        sent.push({ planning: texts.filter((t) => t.includes('jsonb_to_recordset')).length, begins: texts.filter((t) => /^\s*begin\s*$/i.test(t)).length });
      } finally {
        spy.mockRestore();
      }
    }
    expect(sent[0]!.planning).toBe(4);
    expect(sent[1]!.planning - sent[0]!.planning).toBe(8);
    expect(sent[1]!.begins).toBe(sent[0]!.begins);
    expect(await query(url, `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'plan-statements' and r.run_key = 'p60' and c.done_at is not null`)).toEqual([{ n: 60 }]);
  });

  it('a chunk costs two messages to the server: its COMMIT carries the next chunk\'s BEGIN and claim', async () => {
    const job = defineJob({
      name: 'messages',
      params: (raw: unknown) => raw as { n: number },
      steps: [
        {
          name: 'work',
          chunks: (_cursor, ctx) => ({ chunks: Array.from({ length: (ctx.params as { n: number }).n }, (_, i) => ({ key: `c${i}` })), next: null }),
          run: ({ db }: StepContext) => sql`select 1`.execute(db),
        },
      ],
    });
    const sent: Array<{ begins: number; commitsWithClaim: number; job: number }> = [];
    for (const n of [20, 60]) {
      const spy = vi.spyOn(pg.Client.prototype, 'query');
      try {
        expect(await runner.run(job, { params: { n }, key: `m${n}`, health: false })).toMatchObject({ status: 'succeeded', executed: n });
        const texts = spy.mock.calls.map((c) => (typeof c[0] === 'string' ? c[0] : ''));
        sent.push({
          begins: texts.filter((t) => /^begin;\s*execute idem_claim_/.test(t)).length,
          commitsWithClaim: texts.filter((t) => /^commit;\s*begin;\s*execute idem_claim_next_/.test(t)).length,
          job: texts.filter((t) => t === 'select 1').length,
        });
      } finally {
        spy.mockRestore();
      }
    }
    // Per chunk: the job's statement and one COMMIT carrying the next claim; a hand-written loop
    // sends three messages (BEGIN, statement, COMMIT). A claim with its own BEGIN only starts the
    // step and ends it, however many chunks it has.
    expect(sent[1]!.job - sent[0]!.job).toBe(40);
    expect(sent[1]!.commitsWithClaim - sent[0]!.commitsWithClaim).toBe(40);
    expect(sent[1]!.begins).toBe(sent[0]!.begins);
    expect(sent[0]!.begins).toBeGreaterThanOrEqual(1);
  });

  it('the last pass waits for every chunk other transactions hold, also after committing one of them', async () => {
    // Concurrency 1. Chunks c and d are held by two other transactions (as by workers that may
    // still die): the slot does a, b, e, then waits for c. Once c is let go and done, it must wait
    // for d too, not find "nothing free" and end the step with d undone.
    const job = defineJob({
      name: 'last-pass',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: ['a', 'b', 'c', 'd', 'e'].map((key) => ({ key })), next: null }),
          async run({ db }: StepContext, chunk: { key: string }) {
            if (chunk.key === 'a') await sql`select pg_sleep(0.5)`.execute(db);
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('last-pass', 'k', 'work', ${chunk.key}, 1, 0)`.execute(db);
          },
        },
      ],
    });
    const holders = await Promise.all(['c', 'd'].map(async () => {
      const c = new pg.Client({ connectionString: url, application_name: 'test-holder' });
      await c.connect();
      return c;
    }));
    try {
      const running = runner.run(job, { key: 'k', health: false });
      const settled = running.then(() => true, () => true);
      const hold = async (client: pg.Client, key: string) => {
        await waitFor(async () => (await query(url, `select 1 from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'last-pass' and c.key = $1`, [key])).length, `chunk ${key} planned`);
        await client.query('begin');
        await client.query(`select 1 from idem.chunks c where c.key = $1 and c.run_id = (select id from idem.runs where job = 'last-pass') for update`, [key]);
      };
      await hold(holders[0]!, 'c');
      await hold(holders[1]!, 'd');
      const waitingOnLock = () => lockWaiters(url, 'idem').then((n) => n > 0);
      await waitFor(waitingOnLock, 'the slot waiting for chunk c');
      await holders[0]!.query('rollback');
      // Now it does c, then must wait for d: give a slot that wrongly ended the time to end.
      await Promise.race([settled, new Promise((r) => setTimeout(r, 1500))]);
      expect(await Promise.race([settled, false])).toBe(false);
      await holders[1]!.query('rollback');
      expect(await running).toMatchObject({ status: 'succeeded', executed: 5 });
      expect((await query(url, `select chunk_key from work_log where job = 'last-pass' order by 1`)).map((r) => r.chunk_key)).toEqual(['a', 'b', 'c', 'd', 'e']);
    } finally {
      await Promise.all(holders.map((c) => c.end()));
    }
  });

  it('the run key defaults to the fingerprint of the validated params, whatever their key order', async () => {
    const out = await runner.run(counted, { params: { chunks: 3, label: 'fp' } });
    const validated = { chunks: 3, pauseMs: 0, label: 'fp', gate: null };
    expect(out.runKey).toBe(fingerprint(validated));
    const row = await runRow(url, 'counted', out.runKey);
    expect(row).toMatchObject({ fingerprint: out.runKey, params: validated, status: 'succeeded', attempt: 1 });

    const again = await runner.run(counted, { params: { label: 'fp', pauseMs: 0, chunks: 3 } });
    expect(again).toMatchObject({ status: 'already-succeeded', runKey: out.runKey, runId: out.runId, executed: 0 });
    expect(await workCounts(url, out.runKey)).toEqual(ones(3));
  });

  it('a new key runs the same params afresh, as a run of its own', async () => {
    const a = await runner.run(counted, { params: { chunks: 4, label: 'keys' }, key: 'keys-a' });
    const b = await runner.run(counted, { params: { chunks: 4, label: 'keys' }, key: 'keys-b' });
    expect(a.status).toBe('succeeded');
    expect(b).toMatchObject({ status: 'succeeded', executed: 6, attempt: 1 });
    expect(b.runId).not.toBe(a.runId);
    expect(await workCounts(url, 'keys-a')).toEqual(ones(4));
    expect(await workCounts(url, 'keys-b')).toEqual(ones(4));
  });

  it('the same key with other params is refused (exit 65) and changes nothing', async () => {
    await runner.run(counted, { params: { chunks: 2, label: 'a' }, key: 'mismatch' });
    const before = await snapshot(url, ALL_TABLES);
    const err = await rejectionOf(runner.run(counted, { params: { chunks: 2, label: 'b' }, key: 'mismatch' }));
    expect(err).toBeInstanceOf(ParamsMismatchError);
    expect(exitCodeOf(err)).toBe(65);
    expect(err.message).toContain('run key "mismatch" of job "counted" was already used with other params');
    expect(err.message).toContain('--key');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('invalid params are refused (UsageError, exit 2) before anything is written', async () => {
    const before = await snapshot(url, ALL_TABLES);
    for (const params of [{ chunks: 'many' }, { chunks: 0 }, { nope: 1 }]) {
      const err = await rejectionOf(runner.run(counted, { params, key: 'invalid' }));
      expect(err).toBeInstanceOf(UsageError);
      expect(exitCodeOf(err)).toBe(2);
      expect(err.message).toMatch(/^invalid params for job "counted": /);
    }
    const err = await rejectionOf(runner.run(ranged, { params: { x: 1 } }));
    expect(err.message).toContain('job "ranged" takes no params');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a dry run reports the plan and writes nothing', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const out = await runner.run(counted, { params: { chunks: 2 }, key: 'dry', dryRun: true });
    expect(out).toMatchObject({ status: 'dry-run', runId: null, executed: 0, plan: { state: 'new', steps: [{ name: 'prepare', chunked: false }, { name: 'work', chunked: true }, { name: 'finish', chunked: false }] } });
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  /** A run of 8 work chunks that fails for good at c0004 (the first test checks how). */
  const failAtC0004 = async (key: string) => {
    await query(url, `insert into fail_chunks (chunk_key) values ('c0004')`);
    return rejectionOf(runner.run(counted, { params: { chunks: 8, label: 'fail' }, key, planWindow: 3 }));
  };

  it('a failing chunk fails the run (exit 1) recording where and why; its work rolls back', async () => {
    const err = await failAtC0004('fail');
    expect(err).toBeInstanceOf(RunFailedError);
    expect(exitCodeOf(err)).toBe(1);
    expect(err.message).toContain('job "counted" failed in step "work", chunk c0004 after 1 try: injected failure in chunk c0004');

    const run = await runRow(url, 'counted', 'fail');
    expect(run).toMatchObject({ status: 'failed', attempt: 1, holder: null, finished_at: null });
    expect(run.error).toMatchObject({ step: 'work', chunk: 'c0004', tries: 1, message: 'injected failure in chunk c0004' });
    // Chunks before the failure committed; the failing one's work and marker rolled back together.
    expect(await workCounts(url, 'fail')).toEqual(ones(3));
    expect(await query(url, `select chunk_key from counted_state where run_key = 'fail' order by 1`)).toEqual(['c0001', 'c0002', 'c0003'].map((chunk_key) => ({ chunk_key })));
    const chunks = await chunkRows(url, 'counted', 'fail', 'work');
    expect(chunks.map((c) => [c.key, c.done_at !== null])).toEqual([
      ['c0001', true], ['c0002', true], ['c0003', true], ['c0004', false], ['c0005', false], ['c0006', false], ['c0007', false], ['c0008', false],
    ]);
    expect(chunks[3]).toMatchObject({ attempts: 1, error: 'injected failure in chunk c0004' });
    // Planning runs one window ahead of execution: the third window (c0007, c0008, the last) was
    // planned while the second ran, and the plan is persisted for the resume.
    const [step] = await query(url, `select s.* from idem.steps s where s.run_id = $1 and s.name = 'work'`, [run.id]);
    expect(step).toMatchObject({ planned: 8, cursor: null, planned_all: true, status: 'running' });

    const [status] = await runner.status('counted', 1);
    expect(status).toMatchObject({ runKey: 'fail', state: 'failed', attempt: 1, chunksDone: 4, chunksPlanned: 9, fullyPlanned: false, holder: null });
    expect(status!.error).toMatchObject({ step: 'work', chunk: 'c0004', tries: 1 });
  });

  it('after the cause is fixed, a rerun resumes at the failed chunk and never redoes finished ones', async () => {
    expect(await failAtC0004('resume')).toBeInstanceOf(RunFailedError);
    expect(await runRow(url, 'counted', 'resume')).toMatchObject({ status: 'failed', attempt: 1 });
    await query(url, `delete from fail_chunks where chunk_key = 'c0004'`);
    const out = await runner.run(counted, { params: { chunks: 8, label: 'fail' }, key: 'resume', planWindow: 3 });
    expect(out).toMatchObject({ status: 'succeeded', attempt: 2, executed: 6 });
    expect(out.summary).toMatchObject({ chunks: 10, attempts: 2 });
    expect(await workCounts(url, 'resume')).toEqual(ones(8));
    expect(await workCounts(url, 'resume', 'prepare')).toEqual(new Map([['step', 1]]));
    expect(await workCounts(url, 'resume', 'finish')).toEqual(new Map([['step', 1]]));
    const chunks = await chunkRows(url, 'counted', 'resume', 'work');
    expect(chunks.map((c) => [c.key, c.seq, c.done_attempt])).toEqual([
      ['c0001', 1, 1], ['c0002', 2, 1], ['c0003', 3, 1], ['c0004', 4, 2], ['c0005', 5, 2], ['c0006', 6, 2], ['c0007', 7, 2], ['c0008', 8, 2],
    ]);
    // The work log agrees with the markers: each chunk's work was done by the attempt that marked it.
    const log = await query(url, `select chunk_key, attempt from work_log where run_key = 'resume' and step = 'work' order by chunk_key`);
    expect(log.map((r) => [r.chunk_key, r.attempt])).toEqual(chunks.map((c) => [c.key, c.done_attempt]));
    const run = await runRow(url, 'counted', 'resume');
    expect(run).toMatchObject({ status: 'succeeded', error: null, attempt: 2 });
    const status = (await runner.status('counted')).find((r) => r.runKey === 'resume');
    expect(status).toMatchObject({ runKey: 'resume', state: 'succeeded', chunksDone: 10, chunksPlanned: 10, fullyPlanned: true, error: null });
  });

  it('a transient error (40001) is retried with backoff and the chunk commits once', async () => {
    await query(url, `insert into fail_chunks values ('c0002', '40001', 2)`);
    await query(url, `alter sequence fixture_tries restart`);
    try {
      const out = await runner.run(counted, { params: { chunks: 3, label: 'transient' }, key: 'transient' });
      expect(out).toMatchObject({ status: 'succeeded', attempt: 1, executed: 5 });
      expect(await query(url, 'select last_value::int as n from fixture_tries')).toEqual([{ n: 3 }]);
      expect(await workCounts(url, 'transient')).toEqual(ones(3));
    } finally {
      await query(url, `delete from fail_chunks`);
    }
  });

  it('a transient error that outlasts the retry budget fails the run with the tries and SQLSTATE', async () => {
    await query(url, `insert into fail_chunks values ('c0001', '40P01', 1000)`);
    try {
      const err = await rejectionOf(runner.run(counted, { params: { chunks: 2, label: 'exhausted' }, key: 'exhausted' }));
      expect(err).toBeInstanceOf(RunFailedError);
      expect(err.message).toContain('chunk c0001 after 5 tries');
      const run = await runRow(url, 'counted', 'exhausted');
      expect(run.error).toMatchObject({ step: 'work', chunk: 'c0001', tries: 5, code: '40P01' });
      expect(await workCounts(url, 'exhausted')).toEqual(new Map());
    } finally {
      await query(url, `delete from fail_chunks`);
    }
  });

  it('a run that lost its lock after the run ended elsewhere says how it ended, not "rerun to resume"', async () => {
    // As a --join worker stopped (SIGSTOP, a cut link) while the others finished the run: when it
    // wakes, its lock session is gone, and the run it would tell the user to resume is done.
    let inChunk!: () => void;
    const entered = new Promise<void>((resolve) => (inChunk = resolve));
    const job = defineJob({
      name: 'lost-after-end',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [{ key: 'a' }], next: null }),
          async run(ctx: StepContext) {
            inChunk();
            await new Promise((resolve) => ctx.signal.addEventListener('abort', resolve, { once: true }));
          },
        },
      ],
    });
    const running = runner.run(job, { key: 'k', health: false });
    const settled = running.then(() => undefined, (e: unknown) => e);
    await entered;
    // What the other workers' last chunk and finish left (the chunk's row lock is this run's here).
    await query(url, `update idem.runs set status = 'succeeded', finished_at = now() where job = 'lost-after-end'`);
    // This database's lock sessions only: the server is shared with the test files running beside
    // this one, and ending their runs' lock sessions failed them (ci130, and a run of this stop).
    await query(url, `select pg_terminate_backend(pid) from pg_stat_activity where application_name like 'idem-lock %' and datname = current_database() and pid <> pg_backend_pid()`);
    const err = (await settled) as Error;
    expect(err).toBeInstanceOf(LockLostError);
    expect(err.message).toMatch(/^lost the advisory lock for job "lost-after-end": .*; the run has meanwhile ended succeeded \(attempt 1\) in the other workers sharing it: nothing to resume; idem status lost-after-end --key k shows it$/);
    expect(err.message).not.toContain('rerun to resume');
    expect(await query(url, `select status from idem.runs where job = 'lost-after-end'`)).toEqual([{ status: 'succeeded' }]);
  });

  it('a retry whose timer fires before the database sees the backoff over waits for it, and starts no other chunk meanwhile', async () => {
    // The slot sleeps the backoff the database gave, then claims the chunk again; the database
    // checks its own `retry_at`. A timer firing a hair early (or a database clock a hair ahead)
    // made that claim find nothing, the slot took the chunk for done elsewhere and started the
    // next one. Here the database's backoff ends 150 ms after the one it tells the slot (a trigger moves it
    // once the statement has computed what it returns).
    await query(url, `insert into fail_chunks values ('c0001', '40P01', 1000)`);
    await query(url, `create function public.test_retry_later() returns trigger language plpgsql as $$ begin
      if pg_trigger_depth() = 1 then update idem.chunks set retry_at = retry_at + interval '150 ms' where run_id = new.run_id and step = new.step and seq = new.seq; end if;
      return null; end $$`);
    await query(url, `create trigger test_retry_later after update of retry_at on idem.chunks for each row when (new.retry_at is not null) execute function public.test_retry_later()`);
    try {
      const err = await rejectionOf(runner.run(counted, { params: { chunks: 2, label: 'early-timer' }, key: 'early-timer' }));
      expect(err).toBeInstanceOf(RunFailedError);
      expect(err.message).toContain('chunk c0001 after 5 tries');
      expect(await workCounts(url, 'early-timer')).toEqual(new Map());
    } finally {
      await query(url, `drop trigger test_retry_later on idem.chunks; drop function public.test_retry_later()`);
    }
  });

  it('with concurrency 4, chunks run 4 at a time and each commits exactly once', async () => {
    let active = 0;
    let peak = 0;
    const job = defineJob({
      name: 'parallel',
      steps: [
        {
          name: 'work',
          chunks: (cursor, { windowSize }) => {
            const from = typeof cursor === 'number' ? cursor : 1;
            const to = Math.min(from + windowSize - 1, 30);
            const chunks = Array.from({ length: to - from + 1 }, (_, i) => ({ key: chunkKey(from + i) }));
            return { chunks, next: to < 30 ? to + 1 : null };
          },
          async run(ctx, chunk: { key: string }) {
            peak = Math.max(peak, ++active);
            try {
              await sql`select pg_sleep(0.03)`.execute(ctx.db);
              await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('parallel', ${ctx.run.runKey}, 'work', ${chunk.key}, ${ctx.run.attempt}, 0)`.execute(ctx.db);
            } finally {
              active--;
            }
          },
        },
      ],
    });
    const out = await runner.run(job, { key: 'parallel', concurrency: 4, planWindow: 8 });
    expect(out).toMatchObject({ status: 'succeeded', executed: 30 });
    expect(peak).toBe(4);
    expect(await workCounts(url, 'parallel')).toEqual(ones(30));
    const [{ n }] = await query(url, `select count(distinct backend_pid)::int as n from work_log where run_key = 'parallel'`);
    expect(n).toBeGreaterThanOrEqual(4);
  });

  it('a custom chunk source is called window by window from the persisted cursor, also on resume', async () => {
    const calls: Array<[Json | null, number]> = [];
    const job = defineJob({
      name: 'windowed',
      steps: [
        {
          name: 'work',
          chunks: (cursor, { windowSize }) => {
            calls.push([cursor, windowSize]);
            const from = typeof cursor === 'number' ? cursor : 1;
            const to = Math.min(from + windowSize - 1, 10);
            return { chunks: Array.from({ length: to - from + 1 }, (_, i) => ({ key: `w${from + i}`, n: from + i })), next: to < 10 ? to + 1 : null };
          },
          async run(ctx, chunk: { key: string }) {
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('windowed', ${ctx.run.runKey}, 'work', ${chunk.key}, ${ctx.run.attempt}, 0)`.execute(ctx.db);
            await maybeFail(ctx, chunk.key);
          },
        },
      ],
    });
    await query(url, `insert into fail_chunks (chunk_key) values ('w5')`);
    await expect(runner.run(job, { key: 'windowed', planWindow: 3 })).rejects.toBeInstanceOf(RunFailedError);
    // Planning stays one window ahead of execution: the third window was planned while the second ran.
    expect(calls).toEqual([[null, 3], [4, 3], [7, 3]]);

    await query(url, `delete from fail_chunks`);
    calls.length = 0;
    const out = await runner.run(job, { key: 'windowed', planWindow: 3 });
    expect(out).toMatchObject({ status: 'succeeded', attempt: 2, executed: 6 });
    // Resumed from the persisted plan and cursor: the first three windows were not planned again.
    expect(calls).toEqual([[10, 3]]);
    const chunks = await chunkRows(url, 'windowed', 'windowed', 'work');
    expect(chunks.map((c) => [c.seq, c.key, c.spec, c.done_attempt])).toEqual(
      Array.from({ length: 10 }, (_, i) => [i + 1, `w${i + 1}`, { key: `w${i + 1}`, n: i + 1 }, i < 4 ? 1 : 2]),
    );
    const [step] = await query(url, `select s.cursor, s.planned, s.planned_all, s.status from idem.steps s join idem.runs r on r.id = s.run_id where r.job = 'windowed'`);
    expect(step).toEqual({ cursor: null, planned: 10, planned_all: true, status: 'done' });
    const log = await query(url, `select chunk_key, count(*)::int as n from work_log where job = 'windowed' group by 1`);
    expect(log).toHaveLength(10);
    expect(log.every((r) => r.n === 1)).toBe(true);
  });

  it('a keyRange job covers every row of its table once', async () => {
    await query(url, `insert into items (id, value) select g, g from generate_series(1, 95) g where g % 7 <> 0`);
    const out = await runner.run(ranged, { key: 'ranged' });
    const rows = 95 - 13;
    expect(out).toMatchObject({ status: 'succeeded', executed: Math.ceil(rows / 10) });
    expect(await query(url, 'select count(*)::int as n from items where doubled is distinct from value * 2')).toEqual([{ n: 0 }]);
    const log = await query(url, `select chunk_key from work_log where job = 'ranged' and run_key = 'ranged' order by id`);
    expect(log.map((r) => r.chunk_key)).toEqual((await chunkRows(url, 'ranged', 'ranged', 'double')).map((c) => c.key));
  });

  it('another process holding the job lock makes run() busy (exit 75) without doing any work', async () => {
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      await holder.query('select pg_advisory_lock($1::bigint)', [lockKey(runner.jobLockName('counted'))]);
      const err = await rejectionOf(runner.run(counted, { params: { chunks: 2 }, key: 'busy' }));
      expect(err).toBeInstanceOf(BusyError);
      expect(exitCodeOf(err)).toBe(75);
      expect(err.message).toContain('job "counted" is running in another process');
      expect(err.message).toContain('--wait');
      const waited = Date.now();
      await expect(runner.run(counted, { params: { chunks: 2 }, key: 'busy', wait: 1 })).rejects.toBeInstanceOf(BusyError);
      expect(Date.now() - waited).toBeGreaterThanOrEqual(1000);
      expect(await workCounts(url, 'busy')).toEqual(new Map());
      expect(await runRow(url, 'counted', 'busy')).toMatchObject({ attempt: 0, status: 'pending' });
      // Other jobs are not blocked by this job's lock.
      await expect(runner.run(ranged, { key: 'ranged-while-busy' })).resolves.toMatchObject({ status: 'succeeded' });
    } finally {
      await holder.end();
    }
    await expect(runner.run(counted, { params: { chunks: 2 }, key: 'busy' })).resolves.toMatchObject({ status: 'succeeded', attempt: 1 });
  });

  it('a chunk whose ctx.signal aborted is rolled back, not committed with the part of its work done before it returned', async () => {
    // The job honours the signal the way the docs invite: it stops between rows and returns.
    await query(url, 'drop table if exists abort_items');
    await query(url, 'create table abort_items (id int primary key, val int)');
    await query(url, 'insert into abort_items select g, null from generate_series(0, 29) g');
    const job = defineJob({
      name: 'abortable',
      steps: [
        {
          name: 'fill',
          chunks: () => ({ chunks: [0, 10, 20].map((lo) => ({ key: `[${lo},${lo + 10})`, lo })), next: null }),
          async run({ db, signal }: StepContext, chunk: { lo: number }) {
            for (let id = chunk.lo; id < chunk.lo + 10; id++) {
              if (signal.aborted) return;
              await sql`select pg_sleep(0.05)`.execute(db);
              await sql`update abort_items set val = ${id} where id = ${id}`.execute(db);
            }
          },
        },
      ],
    });
    try {
      const running = rejectionOf(runner.run(job, { key: 'k', health: false }));
      // Mid-way through the second chunk, the run loses its lock: ctx.signal aborts.
      await waitFor(async () => (await query(url, `select 1 from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'abortable' and c.done_at is not null`)).length, 'the first chunk done');
      await new Promise((r) => setTimeout(r, 150));
      await query(url, `select pg_terminate_backend(pid) from pg_stat_activity where application_name like 'idem-lock %:' || $1 and datname = current_database()`, [String(process.pid)]);
      const err = await running;
      expect(err).toBeInstanceOf(LockLostError);
      // Every chunk is all or nothing: a chunk marked done has all its rows, and no row of a chunk
      // that is not marked done was written.
      const done = (await query(url, `select c.key from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'abortable' and c.done_at is not null`)).map((r) => r.key);
      const rows = await query(url, `select id / 10 * 10 as lo, count(val)::int as n from abort_items group by 1 order by 1`);
      expect(rows.map((r) => (done.includes(`[${r.lo},${Number(r.lo) + 10})`) ? 10 : 0))).toEqual(rows.map((r) => r.n));
      expect(done).toContain('[0,10)');
      expect(done).not.toContain('[10,20)');
    } finally {
      await query(url, 'drop table if exists abort_items');
    }
  });

  /**
   * Attempt 1 of run `key` blocks inside chunk c0001 on a gate while a takeover bumps the fencing
   * token: its COMMIT is refused, it fails with exit 69, and nothing of it is committed or recorded.
   */
  async function zombieIsFenced(key: string): Promise<void> {
    const gate = await holdGate(url, key);
    const running = rejectionOf(runner.run(counted, { params: { chunks: 3, gate: key }, key }));
    try {
      await waitFor(async () => (await lockWaiters(url)) > 0, 'the chunk to block on the gate');
      await query(url, `update idem.runs set attempt = attempt + 1 where run_key = $1`, [key]);
    } finally {
      await gate.release();
    }
    const err = await running;
    expect(err).toBeInstanceOf(LockLostError);
    expect(exitCodeOf(err)).toBe(69);
    expect(err.message).toContain('fenced off by attempt 2');
    expect(await workCounts(url, key)).toEqual(new Map());
    expect((await chunkRows(url, 'counted', key, 'work')).filter((c) => c.done_at !== null)).toEqual([]);
    // The zombie records nothing on the run: it belongs to attempt 2 now.
    expect(await runRow(url, 'counted', key)).toMatchObject({ attempt: 2, status: 'running', error: null });
  }

  it('a zombie attempt cannot commit after a newer attempt took the run over (fencing, exit 69)', () => zombieIsFenced('fence'));

  it('fencing holds as well where the database has deferrable constraints (the checks, the fence among them, run before COMMIT)', async () => {
    await query(url, 'create table fence_deferrable (id int primary key deferrable initially deferred)');
    try {
      await zombieIsFenced('fence-d');
      // And an unfenced run in that database commits every chunk once.
      const ok = await runner.run(counted, { params: { chunks: 5 }, key: 'deferrable-ok' });
      expect(ok.status).toBe('succeeded');
      expect([...(await workCounts(url, 'deferrable-ok')).values()]).toEqual([1, 1, 1, 1, 1]);
    } finally {
      await query(url, 'drop table fence_deferrable');
    }
  });

  it('status() lists runs newest first, filtered by job', async () => {
    // Its own runs: two of counted (one finished, one whose row says running though nobody holds
    // the lock, as after a crash) and one of another job.
    await runner.run(counted, { params: { chunks: 10 }, key: 'status-ok' });
    await runner.run(counted, { params: { chunks: 2 }, key: 'status-crashed' });
    await query(url, `update idem.runs set status = 'running', finished_at = null where job = 'counted' and run_key = 'status-crashed'`);
    await runner.run(ranged, { key: 'status-other' });
    const all = await runner.status();
    const mine = await runner.status('counted');
    expect(mine.length).toBeGreaterThanOrEqual(2);
    expect(mine.every((r) => r.job === 'counted')).toBe(true);
    expect(all.some((r) => r.job === 'ranged' && r.runKey === 'status-other')).toBe(true);
    expect(all.length).toBeGreaterThan(mine.length);
    const created = all.map((r) => r.createdAt.getTime());
    expect(created).toEqual([...created].sort((a, b) => b - a));
    expect((await runner.status('counted', 2)).map((r) => r.runKey)).toEqual(mine.slice(0, 2).map((r) => r.runKey));
    // Nothing holds a lock now: a run row still saying `running` is reported as crashed.
    expect(mine.find((r) => r.runKey === 'status-crashed')).toMatchObject({ state: 'crashed', holder: null });
    expect(mine.find((r) => r.runKey === 'status-ok')).toMatchObject({ state: 'succeeded', chunksDone: 12, chunksPlanned: 12, fullyPlanned: true });
  });

  it('jobLockHolders() names a session holding a job\'s lock only while no run of the job is running, however many runs status shows', async () => {
    const job = 'holders-job';
    const holder = new pg.Client({ connectionString: url, application_name: 'idem-lock elsewhere:1' });
    await holder.connect();
    try {
      await holder.query('select pg_advisory_lock($1::bigint)', [lockKey(runner.jobLockName(job))]);
      const run = (key: string, status: string) => query(url, `insert into idem.runs (job, run_key, params, fingerprint, kind, status) values ($1, $2, '{}', 'f', 'job', $3)`, [job, key, status]);
      await run('done-one', 'succeeded');
      expect((await runner.jobLockHolders([job])).map((h) => ({ job: h.job, name: h.applicationName }))).toEqual([{ job, name: 'idem-lock elsewhere:1' }]);
      // A running run, older than a newer pending one (a cron firing while it works): status
      // --limit 1 shows only the pending one, and the lock is still the running run's.
      await run('long-one', 'running');
      await run('fired-meanwhile', 'pending');
      expect((await runner.status(job, 1)).map((r) => r.runKey)).toEqual(['fired-meanwhile']);
      expect(await runner.jobLockHolders([job])).toEqual([]);
    } finally {
      await holder.end();
    }
  });
});

describe('ctx.db is the chunk transaction, and only while the chunk runs', () => {
  /** A job of 3 chunks (a, b, c), each of which logs its work, then runs `each`. */
  const jobEach = (name: string, each: (db: StepContext['db'], key: string) => Promise<void>) =>
    defineJob({
      name,
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: ['a', 'b', 'c'].map((key) => ({ key })), next: null }),
          async run(ctx, chunk: { key: string }) {
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values (${name}, ${ctx.run.runKey}, 'work', ${chunk.key}, ${ctx.run.attempt}, 0)`.execute(ctx.db);
            await each(ctx.db, chunk.key);
          },
        },
      ],
    });
  /** A job of 3 chunks whose second chunk runs `second` after logging its work. */
  const jobWith = (name: string, second: (db: StepContext['db']) => Promise<void>) => jobEach(name, (db, key) => (key === 'b' ? second(db) : Promise.resolve()));
  const doneKeys = async (job: string) =>
    (await query(url, `select c.key from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = $1 and c.done_at is not null order by 1`, [job])).map((r) => r.key);
  const logged = async (job: string) => (await query(url, `select chunk_key from work_log where job = $1 order by 1`, [job])).map((r) => r.chunk_key);

  it('a statement error the job swallows still fails the chunk: PostgreSQL rolls the transaction back, work and marker together', async () => {
    const job = jobWith('swallowed', async (db) => {
      await sql`select 1 / 0`.execute(db).catch(() => {});
    });
    const err = await rejectionOf(runner.run(job, { key: 'k' }));
    expect(err).toBeInstanceOf(RunFailedError);
    expect(err.message).toContain('job "swallowed" failed in step "work", chunk b after 1 try: Transaction was rolled back instead of committed');
    expect(await doneKeys('swallowed')).toEqual(['a']);
    expect(await logged('swallowed')).toEqual(['a']);
  });

  it('an error at COMMIT (a deferred constraint) fails the chunk, and the next chunk claimed with that COMMIT starts no work', async () => {
    await query(url, 'drop table if exists deferred_check');
    await query(url, 'create table deferred_check (id int primary key, parent int references deferred_check (id) deferrable initially deferred)');
    try {
      const job = jobWith('deferred', async (db) => {
        // Accepted now, refused at COMMIT: parent 999 does not exist.
        await sql`insert into deferred_check values (1, 999)`.execute(db);
      });
      const err = await rejectionOf(runner.run(job, { key: 'k' }));
      expect(err).toBeInstanceOf(RunFailedError);
      expect(err.message).toContain('job "deferred" failed in step "work", chunk b after 1 try: insert or update on table "deferred_check" violates foreign key constraint');
      expect(await doneKeys('deferred')).toEqual(['a']);
      expect(await logged('deferred')).toEqual(['a']);
      expect(await query(url, 'select count(*)::int as n from deferred_check')).toEqual([{ n: 0 }]);
      // Fixed, the rerun resumes at b and does b and c once each.
      await query(url, 'insert into deferred_check values (999, null)');
      expect((await runner.run(job, { key: 'k' })).status).toBe('succeeded');
      expect(await doneKeys('deferred')).toEqual(['a', 'b', 'c']);
      expect(await logged('deferred')).toEqual(['a', 'b', 'c']);
    } finally {
      await query(url, 'drop table if exists deferred_check');
    }
  });

  it("a deferrable constraint the run's own first step creates is checked before each COMMIT of the next step: two workers try each failing chunk once", async () => {
    // Whether the database has deferrable constraints was asked once per run, before its first
    // step: one that step created was missed, a chunk failing it at COMMIT let its row go before its
    // failure was recorded, and the other worker claimed and ran it again (black-box round 8: 64
    // tries of 60 chunks).
    await query(url, 'drop table if exists deferred_made');
    const tries = new Map<string, number>();
    const job = defineJob({
      name: 'deferred-made',
      steps: [
        { name: 'ddl', run: async ({ db }) => void (await sql`create table if not exists deferred_made (k int, unique (k) deferrable initially deferred)`.execute(db)) },
        {
          name: 'work',
          maxFailedChunks: 1000,
          chunks: () => ({ chunks: Array.from({ length: 60 }, (_, i) => ({ key: `c${i}` })), next: null }),
          async run({ db }, chunk: { key: string }) {
            tries.set(chunk.key, (tries.get(chunk.key) ?? 0) + 1);
            // Accepted now, refused at COMMIT: the same key twice. A key of the chunk's own: chunks
            // inserting one key between them wait on each other's uniqueness recheck and may
            // deadlock (40P01, retried: a second try by design; CI saw one).
            const k = Number(chunk.key.slice(1));
            await sql`insert into deferred_made values (${k}), (${k})`.execute(db);
            await new Promise((resolve) => setTimeout(resolve, 2));
          },
        },
      ],
    });
    const second = await Runner.connect({ connectionString: url });
    try {
      const outcomes = await Promise.all([runner.run(job, { key: 'k', join: true, concurrency: 6 }), second.run(job, { key: 'k', join: true, concurrency: 6 })]);
      expect(outcomes.map((o) => o.status).sort()).toEqual(['succeeded', 'succeeded']);
      expect(tries.size).toBe(60);
      expect([...tries.entries()].filter(([, n]) => n !== 1)).toEqual([]);
      expect(await query(url, 'select count(*)::int as n from deferred_made')).toEqual([{ n: 0 }]);
    } finally {
      await second.close();
      await query(url, 'drop table if exists deferred_made');
    }
  });

  it('a thrown value that cannot be stringified or read is still a failure of its chunk, shown by what it holds', async () => {
    // Black-box round 8: `{ code: 10n, detail }` and a circular object were recorded as
    // "[object Object]" (JSON.stringify throws on both); an Error whose message getter throws, or a
    // Proxy that throws from its traps, failed the whole run as step "(runner)" with no chunk,
    // although maxFailedChunks would have skipped the chunk.
    const circular: Record<string, unknown> = { detail: 'circular detail' };
    circular.self = circular;
    const getter = new Error('x');
    Object.defineProperty(getter, 'message', { get: () => { throw new Error('getter boom'); } });
    const proxy = new Proxy({}, { get: () => { throw new Error('proxy trap boom'); }, getPrototypeOf: () => { throw new Error('proxy proto boom'); } });
    const thrown: Record<string, unknown> = { bigint: { code: 10n, detail: 'bigint detail' }, circular, getter, proxy };
    const job = defineJob({
      name: 'odd-throws',
      steps: [
        {
          name: 'work',
          maxFailedChunks: 10,
          chunks: () => ({ chunks: [...Object.keys(thrown), 'fine'].map((key) => ({ key })), next: null }),
          async run(_ctx, chunk: { key: string }) {
            if (chunk.key !== 'fine') throw thrown[chunk.key];
          },
        },
      ],
    });
    const result = await runner.run(job, { key: 'k' });
    expect(result.status).toBe('succeeded');
    const stored = await query<{ key: string; error: string | null }>(url, `select c.key, c.error from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'odd-throws' and c.error is not null`);
    const errors = new Map(stored.map((s) => [s.key, s.error ?? '']));
    expect([...errors.keys()].sort()).toEqual(['bigint', 'circular', 'getter', 'proxy']);
    expect(errors.get('bigint')).toContain('bigint detail');
    expect(errors.get('bigint')).toContain('10');
    expect(errors.get('circular')).toContain('circular detail');
    expect(errors.get('getter')).toContain('getter boom');
    expect(errors.get('proxy')).toMatch(/proxy (trap|proto) boom/);
    for (const e of errors.values()) expect(e).not.toContain('[object Object]');
  });

  it("a chunk's session-level SET does not outlive its chunk: the next chunk and idem's own claim start on a clean session", async () => {
    // Black-box round 8: `set default_transaction_read_only = on` in one chunk (SET, not SET LOCAL)
    // stayed on the slot's connection, and idem's next claim failed ("cannot execute UPDATE in a
    // read-only transaction"), failing the run as step "(runner)" with nothing recorded; a leaked
    // statement_timeout failed an innocent later chunk.
    const job = (name: string, setting: string) =>
      jobEach(name, async (db, key) => void (await (key === 'a' ? sql.raw(setting) : sql`select pg_sleep(0.15)`).execute(db)));
    for (const [i, setting] of ['set default_transaction_read_only = on', "set statement_timeout = '50ms'", "select 1; set session statement_timeout = '50ms'"].entries()) {
      const name = `session-set-${i}`;
      const outcome = await runner.run(job(name, setting), { key: 'k' });
      expect(outcome.status, setting).toBe('succeeded');
      expect(await doneKeys(name), setting).toEqual(['a', 'b', 'c']);
      expect(await logged(name), setting).toEqual(['a', 'b', 'c']);
    }
    // A custom setting named local.x is a session's setting, not SET LOCAL (black-box round 9).
    const custom = jobEach('session-set-custom', async (db, key) => {
      if (key === 'a') await sql.raw(`set local.foo = 'leaked'`).execute(db);
      else {
        const { rows } = await sql<{ v: string | null }>`select current_setting('local.foo', true) as v`.execute(db);
        if (rows[0]!.v) throw new Error(`local.foo leaked into chunk ${key}: ${rows[0]!.v}`);
      }
    });
    expect((await runner.run(custom, { key: 'k' })).status).toBe('succeeded');
    // SET LOCAL ends with its transaction, so it keeps the connection.
    const local = await runner.run(job('session-set-local', "set local statement_timeout = '50ms'"), { key: 'k' });
    expect(local.status).toBe('succeeded');
    // A job that sets a session setting in every chunk (`set search_path = …` first thing in run())
    // keeps its connection: the setting is reset in the next claim's message, not by reconnecting.
    const everyChunk = defineJob({
      name: 'session-set-every',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: ['a', 'b', 'c', 'd'].map((key) => ({ key })), next: null }),
          async run(ctx, chunk: { key: string }) {
            const { rows } = await sql<{ t: string }>`select current_setting('statement_timeout') as t`.execute(ctx.db);
            await sql.raw(`set statement_timeout = '7s'`).execute(ctx.db);
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('session-set-every', ${rows[0]!.t}, 'work', ${chunk.key}, 1, 0)`.execute(ctx.db);
          },
        },
      ],
    });
    expect((await runner.run(everyChunk, { key: 'k' })).status).toBe('succeeded');
    const rows = await query<{ run_key: string; backend_pid: number }>(url, `select run_key, backend_pid from work_log where job = 'session-set-every' order by chunk_key`);
    expect(rows.map((r) => r.run_key)).toEqual(['0', '0', '0', '0']);
    expect(new Set(rows.map((r) => r.backend_pid)).size).toBe(1);
  });

  it("idem's sessions run at READ COMMITTED whatever default_transaction_isolation the database sets", async () => {
    // Black-box round 12 (B1-1): with `alter database … set default_transaction_isolation =
    // 'serializable'`, idem's own claims, markers and window planning raised serialization
    // failures among themselves (the job did nothing): runs failed in step "(runner)", or a chunk
    // ran out of its retries, in 5 of 24 runs at --concurrency 4–8 and in every 3-worker run.
    const dbName = new URL(url).pathname.slice(1);
    await query(url, 'create table if not exists iso_log (chunk text primary key, iso text not null)');
    await query(url, `alter database ${dbName} set default_transaction_isolation = 'serializable'`);
    const serializable = await Runner.connect({ connectionString: url });
    try {
      const keys = Array.from({ length: 400 }, (_, i) => `k${i}`);
      const job = defineJob({
        name: 'iso-default',
        steps: [
          {
            name: 'work',
            chunks: (cursor: Json | null, ctx) => {
              const from = (cursor as number | null) ?? 0;
              const to = Math.min(keys.length, from + ctx.windowSize);
              return { chunks: keys.slice(from, to).map((key) => ({ key })), next: to < keys.length ? to : null };
            },
            async run(ctx, chunk: { key: string }) {
              await sql`insert into iso_log values (${chunk.key}, current_setting('transaction_isolation'))`.execute(ctx.db);
            },
          },
        ],
      });
      const outcome = await serializable.run(job, { key: 'k', concurrency: 8 });
      expect(outcome.status).toBe('succeeded');
      expect(await query(url, `select iso, count(*)::int as n from iso_log group by iso`)).toEqual([{ iso: 'read committed', n: keys.length }]);
    } finally {
      await serializable.close();
      await query(url, `alter database ${dbName} reset default_transaction_isolation`);
    }
  });

  it('a savepoint lets a chunk survive an error it expects: the chunk commits, with its marker', async () => {
    const job = jobWith('savepoint', async (db) => {
      await sql`savepoint maybe`.execute(db);
      await sql`select 1 / 0`.execute(db).catch(() => sql`rollback to savepoint maybe`.execute(db));
      await sql`release savepoint maybe`.execute(db);
    });
    expect((await runner.run(job, { key: 'k' })).status).toBe('succeeded');
    expect(await doneKeys('savepoint')).toEqual(['a', 'b', 'c']);
    expect(await logged('savepoint')).toEqual(['a', 'b', 'c']);
  });

  it('a nested transaction is refused inside a chunk, and nothing of the chunk commits', async () => {
    const job = jobWith('nested', async (db) => {
      await db.transaction().execute(async (inner) => void (await sql`select 1`.execute(inner)));
    });
    const err = await rejectionOf(runner.run(job, { key: 'k' }));
    expect(err.message).toContain('chunk b after 1 try: calling the transaction method for a Transaction is not supported');
    expect(await doneKeys('nested')).toEqual(['a']);
    expect(await logged('nested')).toEqual(['a']);
    // A controlled transaction too: its commit() would otherwise end the chunk's transaction early.
    const controlled = jobWith('controlled', async (db) => {
      const inner = await db.startTransaction().execute();
      await inner.commit().execute();
    });
    const err2 = await rejectionOf(runner.run(controlled, { key: 'k' }));
    expect(err2.message).toContain('chunk b after 1 try: a chunk runs in a transaction of its own that idem commits: ctx.db cannot start, nest or end a transaction');
    expect(await doneKeys('controlled')).toEqual(['a']);
    expect(await logged('controlled')).toEqual(['a']);
  });

  it('COMMIT, ROLLBACK or END sent through ctx.db fails the chunk once: the chunk is not run again and again', async () => {
    // ROLLBACK ended the chunk's transaction, claim and marker with it; idem's COMMIT then found no
    // transaction (PostgreSQL only warns), counted the chunk as committed, and claimed it again:
    // 655 runs of one chunk in 2.5 s, forever, and a rerun looped the same way.
    // Hidden after a `;` and followed by a new transaction (`rollback; begin`, `rollback and chain`),
    // the session was in a transaction again after the statement, so the end went unseen: the job's
    // work went on in a transaction of its own, committed by idem's COMMIT without the marker, and
    // the chunk ran again and again (62 101 times in 120 s, black-box round 8).
    const statements = ['rollback', 'commit', '/* done */ END', '  Rollback Work', 'abort', 'begin', 'select 1; rollback', 'select 1; rollback; begin', 'select 1; rollback and chain', 'select 1; abort; start transaction'];
    for (const [i, text] of statements.entries()) {
      const name = `ends-trx-${i}`;
      let tries = 0;
      const job = jobWith(name, async (db) => {
        if (++tries > 3) throw new Error(`looped: chunk b ran ${tries} times`);
        await sql.raw(text).execute(db);
      });
      const err = await rejectionOf(runner.run(job, { key: 'k' }));
      expect(err, text).toBeInstanceOf(RunFailedError);
      expect(err.message, text).toMatch(/chunk b after 1 try: .*ctx\.db (cannot start, nest or end a transaction \(got [A-Z ]+\)|ended the chunk's transaction)/);
      expect(tries, text).toBe(1);
      expect(await doneKeys(name), text).toEqual(['a']);
      expect(await logged(name), text).toEqual(['a']);
    }
    // A COMMIT hidden after a `;` is refused as well, before the text reaches the server: idem
    // splits a text without parameters into its statements as PostgreSQL does. Before, it reached
    // the server and committed b's work with its marker, and whatever followed it in the same text
    // (`…; commit; insert …`) ran and committed outside the chunk's transaction; after `commit;
    // begin` the job's next statements ran in a transaction of their own, and its later error was
    // swallowed (black-box round 8).
    const outside = (job: string) => `insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('${job}', 'k', 'work', 'outside', 1, 0)`;
    const hidden: Array<string | string[]> = [
      'select 1; commit',
      'select 1; commit; begin',
      'select 1; commit and chain',
      `select 1; commit; ${outside('ends-trx-x')}`,
      `select 1; rollback; ${outside('ends-trx-x')}`,
      // Read as PostgreSQL reads them (black-box round 9): a non-ASCII letter is an identifier's,
      // so `é$$` opens no dollar quote; a `--` comment ends at a carriage return; `begin atomic`
      // opens a function body only in a CREATE; with standard_conforming_strings off, `\'` is an
      // escaped quote (a text with a backslash is read both ways).
      `select 1 as é$$; commit; ${outside('ends-trx-x')}; select 2 as é$$`,
      `select 1; -- x\rcommit; ${outside('ends-trx-x')}`,
      `with begin as (select 1) select * from begin atomic; commit; ${outside('ends-trx-x')}`,
      ['set local standard_conforming_strings = off', `select '\\''; commit; ${outside('ends-trx-x')}; select ''`],
      'select 1; /* a /* nested */ comment */ rollback',
    ];
    for (const [i, texts] of hidden.entries()) {
      const text = String(texts);
      const name = `ends-trx-commit-${i}`;
      let runs = 0;
      const job = jobWith(name, async (db) => {
        if (++runs > 3) throw new Error(`looped: chunk b ran ${runs} times`);
        for (const t of typeof texts === 'string' ? [texts] : texts) await sql.raw(t).execute(db);
      });
      const err = await rejectionOf(runner.run(job, { key: 'k' }));
      expect(err.message, text).toMatch(/chunk b after 1 try: .*ctx\.db cannot start, nest or end a transaction \(got (COMMIT|ROLLBACK)\)/);
      expect(runs, text).toBe(1);
      expect(await doneKeys(name), text).toEqual(['a']);
      expect(await logged(name), text).toEqual(['a']);
    }
    expect(await query(url, `select count(*)::int as n from work_log where job = 'ends-trx-x'`)).toEqual([{ n: 0 }]);
    // Strings, quoted names, dollar-quoted bodies and comments are not statements: a `commit`
    // inside them is no end, and the chunk commits as usual.
    const quoted = jobWith('ends-trx-quoted', async (db) => {
      await sql.raw(`select 'x; commit'; select 1 as "y; rollback"; do $$ begin perform 1; end $$; select 2 /* ; end */; select $q$ ; abort $q$`).execute(db);
      await sql.raw(`do $é$ begin perform 1; end $é$; savepoint s; rollback /* undo */ to savepoint s; release savepoint s; select E'\\'; commit'`).execute(db);
    });
    expect((await runner.run(quoted, { key: 'k' })).status).toBe('succeeded');
    expect(await doneKeys('ends-trx-quoted')).toEqual(['a', 'b', 'c']);
    // Savepoints stay the job's own (the test above): ROLLBACK TO SAVEPOINT is not an end.
  });

  it('ctx.db kept past its chunk is refused, so a leaked promise cannot write into the next chunk', async () => {
    let kept: StepContext['db'] | undefined;
    let late: Promise<unknown> | undefined;
    let lateWithPlugin: Promise<unknown> | undefined;
    const job = defineJob({
      name: 'leaked',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [{ key: 'a' }, { key: 'b' }], next: null }),
          async run(ctx, chunk: { key: string }) {
            if (chunk.key === 'a') kept = ctx.db;
            else {
              late = sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('leaked', 'k', 'work', 'late', 1, 0)`.execute(kept!).catch((e: Error) => e);
              // Through a plugin too (withSchema adds one): Kysely's own query path, same refusal.
              lateWithPlugin = kept!.withSchema('public').insertInto('work_log').values({ job: 'leaked', run_key: 'k', step: 'work', chunk_key: 'late2', attempt: 1, pid: 0 }).execute().catch((e: Error) => e);
            }
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('leaked', ${ctx.run.runKey}, 'work', ${chunk.key}, ${ctx.run.attempt}, 0)`.execute(ctx.db);
          },
        },
      ],
    });
    expect((await runner.run(job, { key: 'k' })).status).toBe('succeeded');
    const lateErr = (await late) as Error;
    expect(lateErr).toBeInstanceOf(Error);
    expect(lateErr.message).toMatch(/already committed|is over/);
    const lateErr2 = (await lateWithPlugin) as Error;
    expect(lateErr2).toBeInstanceOf(Error);
    expect(lateErr2.message).toMatch(/already committed|is over/);
    expect(await logged('leaked')).toEqual(['a', 'b']);
    expect(await doneKeys('leaked')).toEqual(['a', 'b']);
  });

  it("a job's helpers may copy ctx ({ ...ctx }), derive from it or wrap it: every field comes along", async () => {
    const seen: Array<Record<string, unknown>> = [];
    const job = defineJob({
      name: 'ctx-copies',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [{ key: 'a' }, { key: 'b' }], next: null }),
          async run(ctx, chunk: { key: string }) {
            const copy = { ...ctx, extra: 1 };
            const derived = Object.create(ctx) as StepContext;
            const wrapped = new Proxy(ctx, {});
            for (const [how, c] of [['spread', copy], ['Object.create', derived], ['Proxy', wrapped]] as const) {
              seen.push({ how, chunk: chunk.key, log: (c.log?.bindings() as { chunk?: string } | undefined)?.chunk, effect: typeof c.effect, step: c.step, runKey: c.run?.runKey, signal: c.signal instanceof AbortSignal });
            }
            // The copy's db is the chunk's transaction: its work commits with the chunk.
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('ctx-copies', ${copy.run.runKey}, 'work', ${chunk.key}, ${copy.run.attempt}, 0)`.execute(copy.db);
          },
        },
      ],
    });
    expect((await runner.run(job, { key: 'k' })).status).toBe('succeeded');
    expect(seen).toEqual(
      ['a', 'b'].flatMap((chunk) => ['spread', 'Object.create', 'Proxy'].map((how) => ({ how, chunk, log: chunk, effect: 'function', step: 'work', runKey: 'k', signal: true }))),
    );
    expect(await logged('ctx-copies')).toEqual(['a', 'b']);
  });
});

describe("a run stopped by the caller's AbortSignal", () => {
  // RunJobOptions.signal: "Aborting stops the run gracefully". An AbortError, a timeout's or any
  // Error reason was thrown as the run's failure: the run read failed (step "(runner)": "This
  // operation was aborted") and finalizeRun refused it. Only an InterruptedError reason stopped it.
  const reasons: Array<[string, (c: AbortController) => void, 'SIGINT' | 'SIGTERM']> = [
    ['abort() (an AbortError)', (c) => c.abort(), 'SIGTERM'],
    ['an Error of the caller', (c) => c.abort(new Error('shutting down')), 'SIGTERM'],
    ["the string 'SIGINT'", (c) => c.abort('SIGINT'), 'SIGINT'],
    ["the string 'SIGTERM'", (c) => c.abort('SIGTERM'), 'SIGTERM'],
  ];
  it.each(reasons)('%s: the run is interrupted (InterruptedError), and the rest runs once later', async (_what, abort, signal) => {
    const key = `caller-abort-${signal}-${Math.random().toString(36).slice(2, 8)}`;
    const stop = new AbortController();
    const err = await rejectionOf(
      runner.run(counted, {
        key,
        params: { chunks: 6 },
        signal: stop.signal,
        onProgress: (p) => {
          if (p.step === 'work' && p.done === 2) abort(stop);
        },
      }),
    );
    expect(err.constructor.name, err.message).toBe('InterruptedError');
    expect([(err as Error & { signal?: string }).signal, exitCodeOf(err)]).toEqual([signal, signal === 'SIGINT' ? 130 : 143]);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'interrupted', error: null, attempt: 1 });
    expect(await runner.run(counted, { key, params: { chunks: 6 } })).toMatchObject({ status: 'succeeded', attempt: 2 });
    expect(await workCounts(url, key)).toEqual(new Map(Array.from({ length: 6 }, (_, i) => [chunkKey(i + 1), 1])));
  });
});

describe('Runner.close() while a run is in flight', () => {
  it('stops the run gracefully (interrupted) and closes promptly; a rerun does the rest once', async () => {
    // close() waited for the whole step (every remaining chunk), then the run threw "driver has
    // already been destroyed" as a failure and its row stayed running.
    const own = await Runner.connect({ connectionString: url });
    const key = `close-in-flight-${Math.random().toString(36).slice(2, 8)}`;
    let started!: () => void;
    const twoDone = new Promise<void>((r) => (started = r));
    const run = rejectionOf(own.run(counted, { key, params: { chunks: 30, pauseMs: 100 }, onProgress: (p) => p.step === 'work' && p.done === 2 && started() }));
    await twoDone;
    const t = performance.now();
    await own.close();
    const closeMs = performance.now() - t;
    const err = await run;
    // The chunk in flight finishes (≤ 100 ms of work here), nothing new starts: not the ~2.8 s left.
    expect(closeMs, `close took ${Math.round(closeMs)} ms`).toBeLessThan(1_500);
    expect(err.constructor.name, err.message).toBe('InterruptedError');
    expect(err.message).toMatch(/Runner\.close\(\)/);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'interrupted', error: null });
    expect(await runner.run(counted, { key, params: { chunks: 30, pauseMs: 100 } })).toMatchObject({ status: 'succeeded' });
    expect(await workCounts(url, key)).toEqual(new Map(Array.from({ length: 30 }, (_, i) => [chunkKey(i + 1), 1])));
    // A closed runner runs nothing more.
    await expect(own.run(counted, { key: `${key}-after`, params: { chunks: 1 } })).rejects.toThrow('this Runner was closed; open another with Runner.connect()');
  });
});

describe('Runner.run when the database went away after connect', () => {
  it('throws DatabaseUnavailableError (exit 2) naming the problem, without the password, as Runner.connect does', async () => {
    // It threw pg's own `connect ECONNREFUSED 127.0.0.1:…`, which exitCodeOf mapped to 1 ("the run
    // failed; its progress is recorded"), though nothing was recorded.
    const { startBlackholeProxy } = await import('./support/blackhole-proxy.ts');
    const direct = new URL(url);
    const proxy = await startBlackholeProxy(Number(direct.port));
    const via = new URL(url);
    via.port = String(proxy.port);
    const own = await Runner.connect({ connectionString: via.href });
    try {
      await proxy.close(); // the port no longer answers: connection refused
      const err = await rejectionOf(own.run(counted, { key: 'db-went-away', params: { chunks: 1 } }));
      expect([err.constructor.name, exitCodeOf(err)], err.message).toEqual(['DatabaseUnavailableError', 2]);
      expect(err.message).toBe(`cannot reach the database at ${via.href.replace(`:${via.password}@`, ':***@')}: connection refused; start the server or fix the connection string`);
    } finally {
      await own.close();
    }
    expect(await query(url, `select count(*)::int as n from idem.runs where run_key = 'db-went-away'`)).toEqual([{ n: 0 }]);
  }, 30_000);
});

describe('a chunk key in messages', () => {
  it('is quoted as JSON when it holds a control character, in the run failure, its record, status and finalize alike', async () => {
    const key = 'line1\nline2, chunk x';
    const job = defineJob({
      name: 'key-label',
      steps: [{ name: 'work', chunks: () => ({ chunks: [{ key }], next: null }), run: () => { throw new Error('boom'); } }],
    });
    const err = await runner.run(job, { key: 'r' }).then(() => null, (e: unknown) => e as Error);
    expect(err).toBeInstanceOf(RunFailedError);
    expect(err!.message).toBe('job "key-label" failed in step "work", chunk "line1\\nline2, chunk x" after 1 try: boom; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)');
    const label = 'chunk "line1\\nline2, chunk x"';
    expect(recordedFailure(await runRow(url, 'key-label', 'r')).message).toContain(`failed in step "work", ${label} after 1 try: boom;`);
    const [row] = await runner.status('key-label');
    expect(formatStatus([row!])).toContain(`step "work" ${label} after 1 try: boom`);
    // A plain key stays as it is.
    const plain = defineJob({ name: 'key-label-plain', steps: [{ name: 'work', chunks: () => ({ chunks: [{ key: 'k 1' }], next: null }), run: () => { throw new Error('boom'); } }] });
    const err2 = await runner.run(plain, { key: 'r' }).then(() => null, (e: unknown) => e as Error);
    expect(err2!.message).toBe('job "key-label-plain" failed in step "work", chunk k 1 after 1 try: boom; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)');
  });
});

describe('Runner.connect given a wrongly named option (B2-15)', () => {
  // `databaseUrl`, `url`, `connection`: the option is `connectionString`. It used to be read as a
  // missing connection string ("the connection string is not a postgres:// URL"), not naming the
  // option to use; a mistyped `poolsize` was ignored. Refused before connecting, as a job
  // definition's unknown keys are.
  const unreachable = 'postgres://u:pw@127.0.0.1:1/x';

  it('names the right option, before connecting', async () => {
    for (const key of ['databaseUrl', 'url', 'connection', 'databaseURL', 'connectionUrl', 'uri']) {
      const err = await rejectionOf(Runner.connect({ [key]: url } as any));
      expect(err, key).toBeInstanceOf(UsageError);
      expect((err as UsageError).code).toBe('idem.invalidOptions');
      expect(err.message, key).toBe(`Runner.connect(): invalid options: unknown key "${key}" (did you mean "connectionString"?)`);
    }
    const typo = await rejectionOf(Runner.connect({ connectionString: unreachable, poolsize: 3 } as any));
    expect(typo.message).toBe('Runner.connect(): invalid options: unknown key "poolsize" (did you mean "poolSize"?)');
    const none = await rejectionOf(Runner.connect({} as any));
    expect(none.message).toBe('Runner.connect(): invalid options: connectionString is required: a postgres://user:password@host:5432/db URL');
    const notString = await rejectionOf(Runner.connect({ connectionString: new URL(url) } as any));
    expect(notString.message).toBe('Runner.connect(): invalid options: connectionString must be a string (got an object): a postgres://user:password@host:5432/db URL');
    const noOptions = await rejectionOf(Runner.connect(undefined as any));
    expect(noOptions.message).toBe('Runner.connect(options): options must be an object with connectionString: a postgres://user:password@host:5432/db URL');
    expect(exitCodeOf(noOptions)).toBe(2);
  });
});
