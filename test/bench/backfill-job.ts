import { defineJob, keyRange, sql, type KeyRangeChunk } from 'idem';
import { assertIdent } from './tables.ts';

/** Marks the job's own statement, so the driver-level counter can tell it from the runner's. */
export const JOB_TAG = '/* bench:job */';

/**
 * The per-chunk work every contender does, as parameterised text ($1 = lo, $2 = hi). "Make it so":
 * rows already right are skipped, as in migrations/0002_normalize_reserved_by.ts.
 */
export function chunkUpdateSql(table: string): string {
  return `update ${assertIdent(table)} set normalized = lower(payload) where id >= $1 and id < $2 and normalized is distinct from lower(payload) ${JOB_TAG}`;
}

/** `update`: the backfill UPDATE; `sleep`: pg_sleep(sleepMs) and nothing else (I/O-bound stand-in). */
export type ChunkWork = 'update' | 'sleep';

export interface BenchJobParams {
  readonly table: string;
  /** Rows per chunk. Defaults to 1000. */
  readonly size: number;
  readonly work: ChunkWork;
  /** For `work: 'sleep'`. */
  readonly sleepMs: number;
}

function parseParams(raw: unknown): BenchJobParams {
  const p = (raw ?? {}) as Record<string, unknown>;
  const problems: string[] = [];
  if (typeof p.table !== 'string') problems.push('table must be a string');
  const size = p.size ?? 1000;
  if (!Number.isInteger(size) || (size as number) < 1) problems.push('size must be an integer >= 1');
  const work = p.work ?? 'update';
  if (work !== 'update' && work !== 'sleep') problems.push('work must be "update" or "sleep"');
  const sleepMs = p.sleepMs ?? 5;
  if (typeof sleepMs !== 'number' || sleepMs < 0) problems.push('sleepMs must be a number >= 0');
  if (problems.length) throw new TypeError(problems.join('; '));
  return { table: assertIdent(p.table as string), size: size as number, work: work as ChunkWork, sleepMs: sleepMs as number };
}

/** What the job is built from: this idem, or another checkout's (bench 1's `IDEM_BENCH_BASELINE`). */
export interface JobLib {
  readonly defineJob: typeof defineJob;
  readonly keyRange: typeof keyRange;
  readonly sql: typeof sql;
}

/**
 * One chunked step over `params.table` in keyset chunks of `params.size` rows: the job every
 * benchmark runs, in-process (Runner.run) and through the CLI (test/bench/jobs/bench-backfill.ts).
 */
export const benchBackfill = benchBackfillWith({ defineJob, keyRange, sql });

/** The same job, built from `lib`. */
export function benchBackfillWith({ defineJob, keyRange, sql }: JobLib) {
  return defineJob<BenchJobParams>({
    name: 'bench-backfill',
    description: 'benchmark backfill: normalized = lower(payload) in keyset chunks',
    params: parseParams,
    steps: [
      {
        name: 'backfill',
        chunks: (cursor, ctx) => keyRange({ table: ctx.params.table, column: 'id', size: ctx.params.size })(cursor, ctx),
        async run({ db, params }, { lo, hi }: KeyRangeChunk) {
          if (params.work === 'sleep') {
            await sql`select pg_sleep(${params.sleepMs / 1000}) ${sql.raw(JOB_TAG)}`.execute(db);
            return;
          }
          await sql`update ${sql.table(params.table)} set normalized = lower(payload) where id >= ${lo} and id < ${hi} and normalized is distinct from lower(payload) ${sql.raw(JOB_TAG)}`.execute(db);
        },
      },
    ],
  });
}
