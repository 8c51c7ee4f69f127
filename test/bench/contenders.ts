import { randomBytes } from 'node:crypto';
import { Logger, runMigrations, runOnce, type RunnerOptions } from 'graphile-worker';
import pg from 'pg';
import { defineJob, Runner, sql } from 'idem';
import { benchBackfill, chunkUpdateSql, JOB_TAG } from './backfill-job.ts';
import type { Contender } from './measure.ts';
import type { BenchContext } from './report.ts';
import { CHUNK_ROWS, dropTable, keysetChunks, prepareTable, rowsLeft } from './tables.ts';

/**
 * The contenders of the backfill comparisons (benchmarks 1 and 2). Each turn gets a freshly
 * prepared, identical table; what happens before `run` (table, boundaries, connections) is not timed.
 */

/** The backfill: a table of `rows` rows cut into keyset chunks of `size` rows. */
export interface Shape {
  readonly rows: number;
  readonly size: number;
}

export const defaultShape = (ctx: BenchContext): Shape => ({ rows: ctx.opts.rows, size: CHUNK_ROWS });

/** idem on a fresh table; a fresh run key too, so every turn is a first run. */
export function idemContender(ctx: BenchContext, shape: Shape, runner: Pick<Runner, 'run'>, name: string, prefix: string, job: typeof benchBackfill = benchBackfill): Contender {
  return {
    name,
    async prepare(round) {
      const table = `${prefix}_${round}`;
      await prepareTable(ctx.pool, table, shape.rows);
      return {
        run: () => runner.run(job, { params: { table, size: shape.size }, key: `${table}-${randomBytes(4).toString('hex')}`, concurrency: 1 }),
        cleanup: () => checkedDrop(ctx, table, name),
      };
    },
  };
}

const precomputed = new Map<string, ReadonlyArray<{ lo: number; hi: number }>>();

/** The backfill job with its keyset boundaries computed in advance, as the hand loop gets them. */
const precomputedJob = defineJob<{ table: string }>({
  name: 'bench-backfill-precomputed',
  params: (raw) => ({ table: String((raw as { table?: unknown })?.table) }),
  steps: [
    {
      name: 'backfill',
      chunks: (cursor, ctx) => {
        const all = precomputed.get(ctx.params.table)!;
        const from = typeof cursor === 'number' ? cursor : 0;
        const to = Math.min(all.length, from + ctx.windowSize);
        return { chunks: all.slice(from, to).map(({ lo, hi }) => ({ key: `[${lo},${hi})`, lo, hi })), next: to < all.length ? to : null };
      },
      async run({ db, params }, { lo, hi }: { lo: number; hi: number }) {
        await sql`update ${sql.table(params.table)} set normalized = lower(payload) where id >= ${lo} and id < ${hi} and normalized is distinct from lower(payload) ${sql.raw(JOB_TAG)}`.execute(db);
      },
    },
  ],
});

/** idem over boundaries computed before the clock starts: what idem costs beyond keyRange's planning. */
export function precomputedContender(ctx: BenchContext, shape: Shape, runner: Pick<Runner, 'run'>, name: string, prefix: string): Contender {
  return {
    name,
    async prepare(round) {
      const table = `${prefix}_${round}`;
      await prepareTable(ctx.pool, table, shape.rows);
      precomputed.set(table, await keysetChunks(ctx.pool, table, shape.size));
      return {
        run: () => runner.run(precomputedJob, { params: { table }, key: `${table}-${randomBytes(4).toString('hex')}`, concurrency: 1 }),
        cleanup: async () => {
          precomputed.delete(table);
          await checkedDrop(ctx, table, name);
        },
      };
    },
  };
}

/**
 * The floor: BEGIN; UPDATE …; COMMIT per chunk on one connection opened in advance, over keyset
 * boundaries computed in advance, so everything idem does beyond the chunk's work counts against it.
 */
export function loopContender(ctx: BenchContext, shape: Shape, name: string, prefix: string): Contender {
  return {
    name,
    async prepare(round) {
      const table = `${prefix}_${round}`;
      await prepareTable(ctx.pool, table, shape.rows);
      const chunks = await keysetChunks(ctx.pool, table, shape.size);
      const text = chunkUpdateSql(table);
      const client = new pg.Client({ connectionString: ctx.url });
      await client.connect();
      return {
        async run() {
          for (const { lo, hi } of chunks) {
            await client.query('begin');
            await client.query(text, [lo, hi]);
            await client.query('commit');
          }
        },
        async cleanup() {
          await client.end();
          await checkedDrop(ctx, table, name);
        },
      };
    },
  };
}

/** The lower bound: the whole backfill as one statement (one transaction, no chunking at all). */
export function singleUpdateContender(ctx: BenchContext, shape: Shape, name: string, prefix: string): Contender {
  return {
    name,
    async prepare(round) {
      const table = `${prefix}_${round}`;
      await prepareTable(ctx.pool, table, shape.rows);
      const client = new pg.Client({ connectionString: ctx.url });
      await client.connect();
      return {
        async run() {
          await client.query(`update ${table} set normalized = lower(payload) where normalized is distinct from lower(payload)`);
        },
        async cleanup() {
          await client.end();
          await checkedDrop(ctx, table, name);
        },
      };
    },
  };
}

/** The pinned devDependency (Node 20: graphile-worker 0.18 needs Node >= 22.18, pg-boss 12 needs Node 22). */
export const QUEUE_NAME = 'graphile-worker 0.16.6';
const TASK = 'bench_backfill_chunk';

export interface QueueContender extends Contender {
  /** Enqueue time of each turn, in ms (part of the turn's timed total). */
  readonly enqueueMs: number[];
  close(): Promise<void>;
}

/**
 * graphile-worker: one job per chunk, all enqueued in one bulk `add_jobs` call, then drained by
 * `runOnce` with one worker at concurrency 1 until no job is left. Enqueue and drain are both timed;
 * the boundaries are computed in advance, as for the hand loop. Its schema is installed and its
 * pool opened up front, as idem's Runner is connected up front.
 */
export async function queueContender(ctx: BenchContext, shape: Shape, prefix: string): Promise<QueueContender> {
  const silent = new Logger(() => () => {});
  const pool = new pg.Pool({ connectionString: ctx.url, max: 4 });
  pool.on('error', () => {});
  const options: RunnerOptions = { pgPool: pool, concurrency: 1, noHandleSignals: true, logger: silent };
  await runMigrations(options);
  const enqueueMs: number[] = [];
  return {
    name: QUEUE_NAME,
    enqueueMs,
    close: () => pool.end().catch(() => {}),
    async prepare(round) {
      const table = `${prefix}_${round}`;
      await prepareTable(ctx.pool, table, shape.rows);
      const specs = JSON.stringify((await keysetChunks(ctx.pool, table, shape.size)).map((c) => ({ identifier: TASK, payload: c })));
      const text = chunkUpdateSql(table);
      return {
        async run() {
          const t0 = performance.now();
          await pool.query(
            `select count(*) from graphile_worker.add_jobs(array(select json_populate_record(null::graphile_worker.job_spec, x) from json_array_elements($1::json) x))`,
            [specs],
          );
          enqueueMs.push(performance.now() - t0);
          await runOnce(options, {
            [TASK]: async (payload, helpers) => {
              const { lo, hi } = payload as { lo: number; hi: number };
              await helpers.query(text, [lo, hi]);
            },
          });
        },
        async cleanup() {
          const { rows } = await ctx.pool.query<{ n: number }>('select count(*)::int as n from graphile_worker.jobs');
          if (rows[0]!.n !== 0) throw new Error(`${QUEUE_NAME} left ${rows[0]!.n} jobs in the queue`);
          await checkedDrop(ctx, table, QUEUE_NAME);
        },
      };
    },
  };
}

/** Proves the contender did the whole backfill, then drops its table. */
export async function checkedDrop(ctx: BenchContext, table: string, who: string): Promise<void> {
  const left = await rowsLeft(ctx.pool, table);
  await dropTable(ctx.pool, table);
  if (left !== 0) throw new Error(`${who} left ${left} rows of ${table} not backfilled`);
}
