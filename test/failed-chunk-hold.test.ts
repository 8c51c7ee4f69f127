import pg from 'pg';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { defineJob, RunFailedError, Runner, sql } from '../src/index.ts';
import { query } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * A chunk that fails for good, among chunks that run at once in other slots of the same process:
 * it is run once (permanent error) or `retry.attempts` times (transient), never again by another
 * slot before it is skipped or the run failed; and failure bookkeeping and effects never wait for a
 * pool connection that only a waiting slot could free.
 */
const db = useTestDatabase({
  idemSchema: true,
  prepare: async (url) => {
    await query(url, `create table exec_log (job text not null, chunk text not null, at timestamptz not null default clock_timestamp())`);
    await query(url, `create table deferred_keys (id text primary key deferrable initially deferred)`);
  },
});

/** Writes outside every chunk transaction: what it records survives the chunk's rollback. */
let side: pg.Pool;
beforeAll(() => {
  side = new pg.Pool({ connectionString: db.url, max: 4 });
});
afterAll(() => side?.end());
beforeEach(() => side.query('delete from exec_log'));

// Slots that wait (a held chunk, a backoff) must not each hang a listener on one shared signal:
// past 10, Node prints "MaxListenersExceededWarning: Possible EventTarget memory leak" on the
// user's stderr (the CLI turns it into an idem: warning: line), for a run that is fine.
const warnings: string[] = [];
const onWarning = (w: Error) => warnings.push(`${w.name}: ${w.message}`);
beforeAll(() => void process.on('warning', onWarning));
afterAll(() => void process.off('warning', onWarning));
afterEach(() => {
  const leaks = warnings.splice(0).filter((w) => w.startsWith('MaxListenersExceededWarning'));
  expect(leaks).toEqual([]);
});

const recordExecution = (job: string, chunk: string) => side.query('insert into exec_log (job, chunk) values ($1, $2)', [job, chunk]);

async function executions(job: string): Promise<Map<string, number>> {
  const rows = await query<{ chunk: string; n: number }>(db.url, 'select chunk, count(*)::int as n from exec_log where job = $1 group by chunk', [job]);
  return new Map(rows.map((r) => [r.chunk, r.n]));
}

async function chunkRows(job: string, key: string) {
  return query<{ key: string; done: boolean; skipped: boolean; attempts: number; error: string | null }>(
    db.url,
    `select c.key, c.done_at is not null as done, c.skipped_at is not null as skipped, c.attempts, c.error
     from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = $1 and r.run_key = $2 order by c.seq`,
    [job, key],
  );
}

/** A runner with the pool the CLI opens for `concurrency` (concurrency + 2). */
async function withRunner<T>(concurrency: number, fn: (runner: Runner) => Promise<T>): Promise<T> {
  const runner = await Runner.connect({ connectionString: db.url, poolSize: concurrency + 2 });
  try {
    return await fn(runner);
  } finally {
    await runner.close();
  }
}

const transient = (msg: string) => Object.assign(new Error(msg), { code: '40001' });

function failingJob(name: string, opts: { maxFailedChunks: number; error: 'permanent' | 'transient'; attempts?: number }) {
  return defineJob({
    name,
    ...(opts.attempts ? { retry: { attempts: opts.attempts, base: 1, max: 5 } } : {}),
    steps: [
      {
        name: 's',
        maxFailedChunks: opts.maxFailedChunks,
        chunks: () => ({ chunks: Array.from({ length: 20 }, (_, i) => ({ key: `c${i}`, i })), next: null }),
        run: async (_ctx, c: { key: string; i: number }) => {
          if (c.i === 3) {
            await recordExecution(name, c.key);
            throw opts.error === 'transient' ? transient('c3 always fails, transiently') : new Error('c3 always fails');
          }
        },
      },
    ],
  });
}

describe('a chunk that fails for good is held back from every other slot until it is settled', () => {
  for (const concurrency of [4, 16]) {
    for (const maxFailedChunks of [0, 1]) {
      it(`permanent error, concurrency ${concurrency}, maxFailedChunks ${maxFailedChunks}: c3 runs exactly once`, async () => {
        const name = `perm-${concurrency}-${maxFailedChunks}`;
        await withRunner(concurrency, async (runner) => {
          for (let round = 0; round < 3; round++) {
            const key = `k${round}`;
            const job = failingJob(name, { maxFailedChunks, error: 'permanent' });
            const out = await runner.run(job, { key, concurrency }).then(
              (o) => ({ ok: true as const, o }),
              (e: unknown) => ({ ok: false as const, e }),
            );
            const rows = await chunkRows(name, key);
            const c3 = rows.find((r) => r.key === 'c3')!;
            expect(c3.attempts).toBe(1);
            if (maxFailedChunks === 1) {
              expect(out.ok).toBe(true);
              if (out.ok) expect(out.o.summary).toMatchObject({ chunks: 20, skipped: 1 });
              expect(c3).toMatchObject({ done: false, skipped: true });
              expect(rows.filter((r) => r.done)).toHaveLength(19);
            } else {
              expect(out.ok).toBe(false);
              if (!out.ok) expect(out.e).toBeInstanceOf(RunFailedError);
              const [run] = await query<{ status: string; error: { chunk: string; tries: number } }>(
                db.url,
                `select status, error from idem.runs where job = $1 and run_key = $2`,
                [name, key],
              );
              expect(run).toMatchObject({ status: 'failed', error: { chunk: 'c3', tries: 1 } });
              expect(c3).toMatchObject({ done: false, skipped: false });
            }
          }
          // Once per run: three runs, three executions.
          expect((await executions(name)).get('c3')).toBe(3);
        });
      });

      it(`transient error, concurrency ${concurrency}, maxFailedChunks ${maxFailedChunks}: c3 runs retry.attempts times`, async () => {
        const name = `trans-${concurrency}-${maxFailedChunks}`;
        await withRunner(concurrency, async (runner) => {
          const job = failingJob(name, { maxFailedChunks, error: 'transient', attempts: 3 });
          const out = await runner.run(job, { key: 'k', concurrency }).then(
            (o) => ({ ok: true as const, o }),
            (e: unknown) => ({ ok: false as const, e }),
          );
          expect((await executions(name)).get('c3')).toBe(3);
          const rows = await chunkRows(name, 'k');
          const c3 = rows.find((r) => r.key === 'c3')!;
          expect(c3.attempts).toBe(3);
          if (maxFailedChunks === 1) {
            expect(out.ok).toBe(true);
            expect(c3).toMatchObject({ done: false, skipped: true });
          } else {
            expect(out.ok).toBe(false);
            const [run] = await query<{ error: { chunk: string; tries: number } }>(db.url, `select error from idem.runs where job = $1 and run_key = 'k'`, [name]);
            expect(run!.error).toMatchObject({ chunk: 'c3', tries: 3 });
          }
        });
      });
    }
  }
});

describe('a chunk whose COMMIT fails for good (a deferred constraint)', () => {
  it('is held back from the other slots as well: it runs once, and is skipped once', async () => {
    const name = 'deferred-16';
    const job = defineJob({
      name,
      steps: [
        {
          name: 's',
          maxFailedChunks: 1,
          chunks: () => ({ chunks: Array.from({ length: 20 }, (_, i) => ({ key: `c${i}`, i })), next: null }),
          run: async (ctx, c: { key: string; i: number }) => {
            if (c.i !== 3) return;
            await recordExecution(name, c.key);
            // Checked at COMMIT: the COMMIT fails (23505) and the transaction is over before idem can act in it.
            await sql`insert into deferred_keys values ('dup'), ('dup')`.execute(ctx.db);
          },
        },
      ],
    });
    await withRunner(16, async (runner) => {
      const out = await runner.run(job, { key: 'k', concurrency: 16 });
      expect(out.summary).toMatchObject({ chunks: 20, skipped: 1 });
    });
    expect((await executions(name)).get('c3')).toBe(1);
    const c3 = (await chunkRows(name, 'k')).find((r) => r.key === 'c3')!;
    expect(c3).toMatchObject({ skipped: true, done: false, attempts: 1 });
    expect(await query(db.url, 'select count(*)::int as n from deferred_keys')).toEqual([{ n: 0 }]);
  });
});

describe('chunks whose COMMIT fails for good, in two workers sharing the run', () => {
  it('each runs once: the other worker never claims one between its failed COMMIT and its hold', async () => {
    const name = 'deferred-workers';
    const failing = (i: number) => i % 5 === 2;
    const job = defineJob({
      name,
      steps: [
        {
          name: 's',
          maxFailedChunks: 1_000,
          chunks: () => ({ chunks: Array.from({ length: 300 }, (_, i) => ({ key: `c${String(i).padStart(3, '0')}`, i })), next: null }),
          run: async (ctx, c: { key: string; i: number }) => {
            if (!failing(c.i)) return;
            await recordExecution(name, c.key);
            // Checked at COMMIT: a duplicate key of a deferred primary key.
            await sql`insert into deferred_keys values (${c.key}), (${c.key})`.execute(ctx.db);
          },
        },
      ],
    });
    const runners = await Promise.all([0, 1].map(() => Runner.connect({ connectionString: db.url, poolSize: 10 })));
    try {
      const outs = await Promise.all(runners.map((r) => r.run(job, { key: 'k', concurrency: 8, join: true })));
      for (const out of outs) expect(out.status).toBe('succeeded');
    } finally {
      await Promise.all(runners.map((r) => r.close()));
    }
    const ran = await executions(name);
    const twice = [...ran].filter(([, n]) => n !== 1);
    expect(twice, `chunks run more than once: ${twice.map(([k, n]) => `${k}×${n}`).join(', ')}`).toEqual([]);
    expect(ran.size).toBe(60);
    const rows = await chunkRows(name, 'k');
    expect(rows.filter((r) => r.skipped).map((r) => [r.key, r.attempts])).toEqual([...ran.keys()].sort().map((k) => [k, 1]));
    expect(await query(db.url, 'select count(*)::int as n from deferred_keys')).toEqual([{ n: 0 }]);
  });
});

describe('an effect that throws under concurrency 8', () => {
  it('skips the failing chunks, commits the others, calls each receiver once, and never waits for a pool connection', async () => {
    const calls = new Map<string, number>();
    const job = defineJob({
      name: 'effmin',
      steps: [
        {
          name: 's',
          maxFailedChunks: 100,
          chunks: () => ({ chunks: Array.from({ length: 40 }, (_, i) => ({ key: `c${i}`, i })), next: null }),
          run: async (ctx, c: { key: string; i: number }) => {
            await ctx.effect('notify', async () => {
              calls.set(c.key, (calls.get(c.key) ?? 0) + 1);
              await recordExecution('effmin', c.key);
              if (c.i % 5 === 0) throw new Error('receiver said 400');
              return { ok: true };
            });
          },
        },
      ],
    });
    await withRunner(8, async (runner) => {
      const started = performance.now();
      const out = await runner.run(job, { key: 'K', concurrency: 8 });
      const ms = performance.now() - started;
      expect(out.status).toBe('succeeded');
      expect(out.summary).toMatchObject({ chunks: 40, skipped: 8 });
      // A pool wait would have taken 10 s (connectionTimeoutMillis) at least.
      expect(ms).toBeLessThan(5_000);
    });
    const rows = await chunkRows('effmin', 'K');
    const failing = rows.filter((r) => Number(r.key.slice(1)) % 5 === 0);
    expect(failing.every((r) => r.skipped && !r.done && r.attempts === 1 && r.error === 'receiver said 400')).toBe(true);
    expect(rows.filter((r) => r.done)).toHaveLength(32);
    expect(rows.filter((r) => r.skipped)).toHaveLength(8);
    // Each chunk ran once, so each receiver was called once.
    expect([...calls.values()].every((n) => n === 1)).toBe(true);
    expect(calls.size).toBe(40);
    const logged = await executions('effmin');
    expect(logged.size).toBe(40);
    expect([...logged.values()].every((n) => n === 1)).toBe(true);
    const effects = await query<{ status: string; n: number }>(db.url, `select status, count(*)::int as n from idem.effects group by status order by status`);
    expect(effects).toEqual([{ status: 'done', n: 32 }, { status: 'started', n: 8 }]);
  });
});
