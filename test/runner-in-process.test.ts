import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, finalizeMigration, InterruptedError, Runner, RunFailedError, sql, UsageError, type Job } from '../src/index.ts';
import { killLeftovers, query } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * Runs started in one process, through the library, as an app embedding idem does (several runs of
 * one Runner at once, several Runners on one run, the caller's callbacks). Found by a black-box
 * tester using idem as a library (B8).
 */
const testDb = useTestDatabase({ idemSchema: true });
let url: string;
beforeAll(() => {
  ({ url } = testDb);
});
afterAll(killLeftovers);

/** A job of `chunks` chunks, each `select pg_sleep(seconds)`, from a source of the caller's. */
function sleepyJob(name: string, chunks: number, seconds: number): Job {
  return defineJob({
    name,
    steps: [
      {
        name: 'sleep',
        chunks: () => ({ chunks: Array.from({ length: chunks }, (_, i) => ({ key: `c${i + 1}` })), next: null }),
        async run(ctx) {
          await sql`select pg_sleep(${seconds})`.execute(ctx.db);
        },
      },
    ],
  });
}

async function runsOf(job: string): Promise<Array<{ status: string; chunks: number }>> {
  return query(url, `select r.status, (select count(*)::int from idem.chunks c where c.run_id = r.id and c.done_at is not null) as chunks from idem.runs r where r.job = $1`, [job]);
}

describe('runs in flight in one Runner share its pool (B8 A1)', () => {
  /** The refusal of a run at `concurrency` beside runs holding `held` ([label, slots]) of poolSize 10. */
  const refusal = (concurrency: number, held: Array<[string, number]>) => {
    const inUse = held.reduce((n, [, s]) => n + s, 0);
    return `concurrency ${concurrency} does not fit in the pool beside the runs in flight in this Runner: their chunks hold ${inUse} of poolSize 10 (${held.map(([w, s]) => `${w}: ${s}`).join(', ')}) and 2 are kept for planning, effects and control polls; raise poolSize to at least ${inUse + concurrency + 2}, or start fewer runs at once`;
  };

  it('a run whose slots do not fit beside those of the runs in flight is refused at once (exit 2), nothing written; the others run unhindered', async () => {
    const runner = await Runner.connect({ connectionString: url, poolSize: 10 });
    try {
      const jobs = [1, 2, 3, 4].map((i) => sleepyJob(`pool-share-${i}`, 24, 0.2));
      const started = performance.now();
      const results = await Promise.allSettled(jobs.map((job) => runner.run(job, { key: 'k', concurrency: 4 })));
      const seconds = (performance.now() - started) / 1000;
      // Each run passes the check of one run alone (4 + 2 <= 10); two fit together (4 + 4 + 2), not three.
      const ran = jobs.filter((_, i) => results[i]!.status === 'fulfilled').map((j) => j.name);
      const refused = results.flatMap((r) => (r.status === 'rejected' ? [r.reason as Error] : []));
      expect(ran).toHaveLength(2);
      expect(refused).toHaveLength(2);
      for (const err of refused) {
        expect(err).toBeInstanceOf(UsageError);
        expect((err as UsageError).code).toBe('idem.poolTooSmall');
        expect(exitCodeOf(err)).toBe(2);
        expect(err.message).toBe(refusal(4, ran.map((name) => [`job "${name}" run k`, 4])));
      }
      // 24 chunks of 0.2 s on 4 slots: about 1.2 s of work. It took 50-100 s when the runs shared the pool unchecked.
      expect(seconds).toBeLessThan(15);
      for (const job of jobs) expect(await runsOf(job.name)).toEqual(ran.includes(job.name) ? [{ status: 'succeeded', chunks: 24 }] : []);
      // Once they are done, their connections are free again: the others run, together.
      const rest = jobs.filter((j) => !ran.includes(j.name));
      const outcomes = await Promise.all(rest.map((job) => runner.run(job, { key: 'k', concurrency: 4 })));
      expect(outcomes.map((o) => [o.status, o.executed])).toEqual([['succeeded', 24], ['succeeded', 24]]);
    } finally {
      await runner.close();
    }
  });

  it('a run that fits in what is left runs beside the others; a refused one (and a dry run) reserves nothing', async () => {
    const runner = await Runner.connect({ connectionString: url, poolSize: 10 });
    try {
      const [a, b, c] = ['pool-fit-a', 'pool-fit-b', 'pool-fit-c'].map((n) => sleepyJob(n, 8, 0.3));
      const both = Promise.all([runner.run(a!, { key: 'a', concurrency: 3 }), runner.run(b!, { key: 'b', concurrency: 3 })]);
      await new Promise((resolve) => setTimeout(resolve, 100));
      // 3 + 3 of 10 are held and 2 kept: concurrency 3 does not fit, 2 does; a dry run holds none.
      const third = await runner.run(c!, { key: 'c', concurrency: 3 }).catch((e: Error) => e);
      expect(third).toBeInstanceOf(UsageError);
      expect((third as Error).message).toBe(refusal(3, [['job "pool-fit-a" run a', 3], ['job "pool-fit-b" run b', 3]]));
      expect(await runsOf('pool-fit-c')).toEqual([]);
      expect(await runner.run(c!, { key: 'c', concurrency: 3, dryRun: true })).toMatchObject({ status: 'dry-run' });
      expect(await runner.run(c!, { key: 'c', concurrency: 2 })).toMatchObject({ status: 'succeeded', executed: 8 });
      expect((await both).map((o) => o.status)).toEqual(['succeeded', 'succeeded']);
      // Alone, a run may take every connection but the 2 kept.
      expect(await runner.run(c!, { key: 'c8', concurrency: 8 })).toMatchObject({ status: 'succeeded', executed: 8 });
    } finally {
      await runner.close();
    }
  });
});

describe('Runner.close() of one worker of a joined run (B8 A2)', () => {
  it('says it stopped by Runner.close() (not on SIGTERM) and that the others go on with the run, which they finish', async () => {
    const job = sleepyJob('join-close', 60, 0.2);
    const [r1, r2, r3] = (await Promise.all([1, 2, 3].map(() => Runner.connect({ connectionString: url })))) as [Runner, Runner, Runner];
    try {
      const first = r1.run(job, { key: 'j', join: true, concurrency: 2 });
      // The others join once the first has started the attempt.
      for (let i = 0; i < 100 && (await query(url, `select 1 from idem.runs where job = 'join-close' and status = 'running'`)).length === 0; i++) await new Promise((resolve) => setTimeout(resolve, 50));
      const third = r3.run(job, { key: 'j', join: true, concurrency: 2 });
      // Awaited below; handled here too, so a failed expectation does not leave them unhandled as finally closes them.
      for (const p of [first, third]) p.catch(() => {});
      // r2 is closed once it has committed a chunk: mid-run, with the others on it.
      let closed: Promise<void> | undefined;
      const second = r2.run(job, { key: 'j', join: true, concurrency: 2, onProgress: (p) => void (p.executedNow >= 1 && (closed ??= r2.close())) }).catch((e: unknown) => e);
      const err = (await second) as InterruptedError;
      await closed;
      expect(err).toBeInstanceOf(InterruptedError);
      expect(exitCodeOf(err)).toBe(143);
      expect(err.message).toBe(
        'this worker stopped by Runner.close() (its in-flight chunks finished); the run goes on in its 2 other workers, and ends as they end it: idem status join-close --key j shows them',
      );
      const outcomes = await Promise.all([first, third]);
      expect(outcomes.map((o) => o.status)).toEqual(['succeeded', 'succeeded']);
      expect(await runsOf('join-close')).toEqual([{ status: 'succeeded', chunks: 60 }]);
    } finally {
      await Promise.all([r1.close(), r2.close(), r3.close()]);
    }
  });
});

describe("a callback of the caller's that throws (B8 A3)", () => {
  /** A Runner whose log lines (JSON) land in `lines`. */
  async function loggedRunner(lines: Array<{ level: number; msg: string; callback?: string }>): Promise<Runner> {
    const log = pino({ level: 'info' }, { write: (line: string) => void lines.push(JSON.parse(line)) });
    return Runner.connect({ connectionString: url, log });
  }
  const warnings = (lines: Array<{ level: number; msg: string; callback?: string }>) => lines.filter((l) => l.level === 40 && l.callback !== undefined).map((l) => l.msg);

  it('onProgress throwing (or rejecting) does not fail the run: one warning naming it, and the run succeeds', async () => {
    const lines: Array<{ level: number; msg: string; callback?: string }> = [];
    const runner = await loggedRunner(lines);
    try {
      const job = sleepyJob('progress-throws', 6, 0.01);
      let calls = 0;
      const outcome = await runner.run(job, {
        key: 'k',
        onProgress: (p) => {
          calls++;
          if (p.done >= 2) throw new Error('UI widget crashed');
        },
      });
      expect(outcome).toMatchObject({ status: 'succeeded', executed: 6 });
      expect(await runsOf('progress-throws')).toEqual([{ status: 'succeeded', chunks: 6 }]);
      // Still called after it threw; said once.
      expect(calls).toBeGreaterThan(3);
      expect(warnings(lines)).toEqual(['onProgress threw (UI widget crashed); the run goes on, and what onProgress throws later is not logged again']);
      // An async one that rejects is the same, not an unhandled rejection.
      const job2 = sleepyJob('progress-rejects', 3, 0.01);
      expect(await runner.run(job2, { key: 'k', onProgress: async () => { throw new Error('async widget crashed'); } })).toMatchObject({ status: 'succeeded', executed: 3 });
      await new Promise((resolve) => setTimeout(resolve, 50));
      expect(warnings(lines).at(-1)).toBe('onProgress threw (async widget crashed); the run goes on, and what onProgress throws later is not logged again');
    } finally {
      await runner.close();
    }
  });

  it('without a logger given, a callback that throws is still said once: a process warning (code IDEM_CALLBACK_THREW), not nothing', async () => {
    const seen: Array<{ message: string; code?: string }> = [];
    const onWarning = (w: Error & { code?: string }) => void seen.push({ message: w.message, ...(w.code ? { code: w.code } : {}) });
    process.on('warning', onWarning);
    const runner = await Runner.connect({ connectionString: url });
    try {
      const job = sleepyJob('progress-throws-quiet', 4, 0.01);
      const outcome = await runner.run(job, { key: 'k', onProgress: () => { throw new Error('UI widget crashed'); } });
      expect(outcome).toMatchObject({ status: 'succeeded', executed: 4 });
      const migrations = [{ runKey: '0001_quiet', job: sleepyJob('migration-cb-quiet', 1, 0.01) }];
      await runner.migrate(migrations, { onOutcome: () => { throw new Error('outcome crashed'); } });
      // process.emitWarning delivers on the next tick.
      await new Promise((resolve) => setTimeout(resolve, 50));
      expect(seen.filter((w) => w.code === 'IDEM_CALLBACK_THREW')).toEqual([
        { code: 'IDEM_CALLBACK_THREW', message: 'idem: onProgress threw (UI widget crashed); the run goes on, and what onProgress throws later is not logged again' },
        { code: 'IDEM_CALLBACK_THREW', message: 'idem: onOutcome threw (outcome crashed); the run goes on, and what onOutcome throws later is not logged again' },
      ]);
    } finally {
      process.off('warning', onWarning);
      await runner.close();
    }
  });

  it("Runner.migrate's onOutcome and onMigration throwing do not stop the migrations; nor finalizeMigration's", async () => {
    const lines: Array<{ level: number; msg: string; callback?: string }> = [];
    const runner = await loggedRunner(lines);
    try {
      const migrations = [1, 2].map((i) => ({ runKey: `000${i}_m`, job: sleepyJob(`migration-cb-${i}`, 2, 0.01) }));
      const boom = (what: string) => () => {
        throw new Error(`${what} crashed`);
      };
      const outcomes = await runner.migrate(migrations, { onOutcome: boom('outcome'), onMigration: boom('migration') });
      expect(outcomes.map((o) => o.status)).toEqual(['succeeded', 'succeeded']);
      for (const m of migrations) expect(await runsOf(m.job.name)).toEqual([{ status: 'succeeded', chunks: 2 }]);
      expect(warnings(lines).sort()).toEqual([
        'onMigration threw (migration crashed); the run goes on, and what onMigration throws later is not logged again',
        'onOutcome threw (outcome crashed); the run goes on, and what onOutcome throws later is not logged again',
      ]);
      const finalized = await finalizeMigration(runner, migrations, '0002_m', { onOutcome: boom('outcome'), onMigration: boom('migration') });
      expect(finalized.map((o) => o.how)).toEqual(['already-succeeded', 'already-succeeded']);
      // A failed migration: what is thrown is its failure, not what a callback threw on the way.
      const failing = defineJob({ name: 'migration-cb-3', steps: [{ name: 'fail', run: () => { throw new Error('the migration itself failed'); } }] });
      const all = [...migrations, { runKey: '0003_m', job: failing }];
      const failed = await runner.migrate(all, { onOutcome: boom('outcome'), onMigration: boom('migration') }).catch((e: Error) => e);
      expect((failed as RunFailedError).code).toBe('idem.runFailed');
      expect((failed as Error).message).toContain('the migration itself failed');
      const refused = await finalizeMigration(runner, all, '0003_m', { onOutcome: boom('outcome'), onMigration: boom('migration') }).catch((e: Error) => e);
      expect((refused as RunFailedError).code).toBe('idem.runFailed');
      expect((refused as Error).message).toMatch(/^run 0003_m of job "migration-cb-3" failed in step "fail" after 1 try: the migration itself failed; /);
    } finally {
      await runner.close();
    }
  });
});
