import { randomBytes } from 'node:crypto';
import { Runner } from 'idem';
import { benchBackfill, type ChunkWork } from './backfill-job.ts';
import { alternate, fmtMs, median, type Contender } from './measure.ts';
import type { BenchContext, BenchResult, ReportRow } from './report.ts';
import { dropTable, prepareTable, rowsLeft } from './tables.ts';

const LEVELS = [1, 2, 4] as const;
const CHUNKS = 400;

interface Workload {
  readonly name: string;
  readonly work: ChunkWork;
  /** Rows per chunk; the table has CHUNKS × size rows. */
  readonly size: number;
  readonly sleepMs: number;
  /** A fresh table per turn (writes) or one shared table (read-only work). */
  readonly fresh: boolean;
}

const WORKLOADS: readonly Workload[] = [
  { name: 'pg_sleep(5 ms) per chunk (I/O-bound stand-in)', work: 'sleep', size: 1, sleepMs: 5, fresh: false },
  { name: 'small UPDATE (100 rows) per chunk', work: 'update', size: 100, sleepMs: 0, fresh: true },
];

/**
 * 7. Throughput at concurrency 1, 2 and 4 within one process (one Runner, pool of 10), on
 * CPU-light chunks; reported as throughput relative to concurrency 1.
 */
export async function benchParallelism(ctx: BenchContext): Promise<BenchResult> {
  const tag = randomBytes(3).toString('hex');
  const runner = await Runner.connect({ connectionString: ctx.url, poolSize: 10 });
  const rows: ReportRow[] = [];
  const data: Record<string, unknown> = {};
  try {
    for (const w of WORKLOADS) {
      const shared = `par_shared_${tag}`;
      if (!w.fresh) await prepareTable(ctx.pool, shared, CHUNKS * w.size);
      const contenders: Contender[] = LEVELS.map((c) => ({
        name: `concurrency ${c}`,
        async prepare(round) {
          const table = w.fresh ? `par_${w.work}_${tag}_${c}_${round}` : shared;
          if (w.fresh) await prepareTable(ctx.pool, table, CHUNKS * w.size);
          return {
            run: () => runner.run(benchBackfill, { params: { table, size: w.size, work: w.work, sleepMs: w.sleepMs }, key: `${table}-${c}-${round}`, concurrency: c }),
            async cleanup() {
              if (!w.fresh) return;
              const left = await rowsLeft(ctx.pool, table);
              await dropTable(ctx.pool, table);
              if (left) throw new Error(`concurrency ${c} left ${left} rows`);
            },
          };
        },
      }));
      ctx.log(`parallel: ${w.name}, ${CHUNKS} chunks, ${ctx.opts.rounds} rounds`);
      const samples = await alternate(ctx.opts.rounds, contenders, ctx.log, ctx.probe);
      if (!w.fresh) await dropTable(ctx.pool, shared);
      const med = LEVELS.map((c) => median(samples.get(`concurrency ${c}`)!.map((s) => s.ms)));
      const speedup = med.map((m) => med[0]! / m);
      rows.push({
        benchmark: `7. parallelism: ${w.name}, ${CHUNKS} chunks`,
        contenders: LEVELS.map((c) => `c=${c}`).join(' / '),
        median: med.map(fmtMs).join(' / '),
        ratio: `${speedup.map((x) => `${x.toFixed(2)}×`).join(' / ')} throughput vs c=1`,
        goal: `info (ideal ${LEVELS.map((c) => `${c}×`).join(' / ')})`,
        met: null,
      });
      data[w.work] = { chunks: CHUNKS, samples: Object.fromEntries(samples), medianMs: med, speedup };
    }
  } finally {
    await runner.close();
  }
  return { rows, data };
}
