import { randomBytes } from 'node:crypto';
import { Runner } from 'idem';
import { backfillRace, IDEM, LOOP } from './backfill-race.ts';
import { cpuRatio } from './bench-overhead.ts';
import { idemContender, QUEUE_NAME, queueContender, type Shape } from './contenders.ts';
import { alternate, fmtMs, fmtRatio, median, medianMs, pairedRatio, type Sample } from './measure.ts';
import { costTable, type BenchContext, type BenchResult, type ReportRow } from './report.ts';
import { CHUNK_ROWS } from './tables.ts';

const GOAL = 0.5;
/** Per-chunk overhead dominates when the chunk's own work is tiny: 2 000 chunks of 10 rows. */
const TINY: Shape = { rows: 20_000, size: 10 };

/**
 * 2. The same backfill as one queued job per chunk in graphile-worker (bulk enqueue + runOnce
 * drain, one worker, concurrency 1): alternated with idem in the same race as benchmark 1, then
 * once more with tiny chunks, where the runners' own per-chunk costs are most of the time.
 */
export async function benchQueue(ctx: BenchContext): Promise<BenchResult> {
  const { samples, enqueueMs } = await backfillRace(ctx);
  const tiny = await tinyRace(ctx);
  const rows: ReportRow[] = [
    row(`2. vs a Postgres job queue: ${Math.ceil(ctx.opts.rows / CHUNK_ROWS)} chunks of ${CHUNK_ROWS} rows`, samples.get(IDEM)!, samples.get(QUEUE_NAME)!, enqueueMs),
    row(`2b. vs a Postgres job queue: ${TINY.rows / TINY.size} chunks of ${TINY.size} rows`, tiny.samples.get(IDEM)!, tiny.samples.get(QUEUE_NAME)!, tiny.enqueueMs),
  ];
  return {
    rows,
    details: [
      // With `overhead` selected, its table already lists every contender of the main race.
      ...(samples.has(LOOP) ? [] : [...costTable('2. vs queue — cost per contender', samples, IDEM), '']),
      ...costTable(`2b. vs queue, ${TINY.size}-row chunks — cost per contender`, tiny.samples, IDEM),
    ],
    data: {
      queue: QUEUE_NAME,
      main: { samples: Object.fromEntries(samples), enqueueMs },
      tiny: { shape: TINY, samples: Object.fromEntries(tiny.samples), enqueueMs: tiny.enqueueMs },
    },
  };
}

function row(benchmark: string, idemS: readonly Sample[], queueS: readonly Sample[], enqueueMs: readonly number[]): ReportRow {
  const [idem, queue] = [idemS, queueS].map(medianMs) as [number, number];
  const ratio = idem / queue;
  return {
    benchmark,
    contenders: `idem (concurrency 1) vs ${QUEUE_NAME}: one job per chunk, bulk add_jobs + runOnce drain, 1 worker at concurrency 1`,
    median: `${fmtMs(idem)} vs ${fmtMs(queue)} (enqueue ${fmtMs(median([...enqueueMs]))} of it)`,
    ratio: `${fmtRatio(ratio)} idem÷queue (paired ${fmtRatio(pairedRatio(idemS, queueS))}; CPU ${fmtRatio(cpuRatio(idemS, queueS))})`,
    goal: `≤ ${GOAL}`,
    met: ratio <= GOAL,
  };
}

async function tinyRace(ctx: BenchContext): Promise<{ samples: Map<string, Sample[]>; enqueueMs: number[] }> {
  const tag = randomBytes(3).toString('hex');
  const runner = await Runner.connect({ connectionString: ctx.url });
  const queue = await queueContender(ctx, TINY, `tiny_queue_${tag}`);
  try {
    ctx.log(`queue: ${TINY.rows / TINY.size} chunks of ${TINY.size} rows, idem vs ${QUEUE_NAME}, ${ctx.opts.rounds} rounds`);
    const samples = await alternate(ctx.opts.rounds, [idemContender(ctx, TINY, runner, IDEM, `tiny_idem_${tag}`), queue], ctx.log, ctx.probe);
    return { samples, enqueueMs: queue.enqueueMs };
  } finally {
    await runner.close();
    await queue.close();
  }
}
