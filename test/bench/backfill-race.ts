import { randomBytes } from 'node:crypto';
import { Runner } from 'idem';
import { defaultShape, idemContender, precomputedContender, loopContender, queueContender, singleUpdateContender, type QueueContender } from './contenders.ts';
import { alternate, type Contender, type Sample } from './measure.ts';
import type { BenchContext } from './report.ts';
import { CHUNK_ROWS } from './tables.ts';
import { existsSync } from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { benchBackfillWith, type JobLib } from './backfill-job.ts';

export const IDEM = 'idem';
export const LOOP = 'hand loop';
export const SINGLE = 'single UPDATE';
export const BASELINE = 'idem (baseline)';
export const PRECOMPUTED = 'idem (boundaries precomputed)';

export interface RaceResult {
  readonly samples: ReadonlyMap<string, Sample[]>;
  /** Enqueue times of the queue contender's timed turns, when it ran. */
  readonly enqueueMs: readonly number[];
  /** Each contender's untimed first turn (V8 and the server's caches warming up), in ms. */
  readonly warmupMs: ReadonlyMap<string, number>;
}

const races = new WeakMap<BenchContext, Promise<RaceResult>>();

/**
 * One alternation (A B C D, A B C D, …) of every backfill contender that the selected benchmarks
 * need: idem, plus the hand loop and the single UPDATE for `overhead`, plus the queue for `queue`.
 * Shared, so idem's turns serve both comparisons and the default run stays within its time budget.
 */
export function backfillRace(ctx: BenchContext): Promise<RaceResult> {
  let race = races.get(ctx);
  if (!race) {
    race = runRace(ctx);
    races.set(ctx, race);
  }
  return race;
}

async function runRace(ctx: BenchContext): Promise<RaceResult> {
  const { rows, rounds, only } = ctx.opts;
  const tag = randomBytes(3).toString('hex');
  const runner = await Runner.connect({ connectionString: ctx.url });
  let queue: QueueContender | undefined;
  let baseline: Awaited<ReturnType<typeof openBaseline>> | undefined;
  const shape = defaultShape(ctx);
  try {
    const contenders: Contender[] = [idemContender(ctx, shape, runner, IDEM, `race_idem_${tag}`)];
    if (only.includes('overhead') && process.env.IDEM_BENCH_BASELINE) {
      baseline = await openBaseline(ctx.url, process.env.IDEM_BENCH_BASELINE);
      contenders.push(idemContender(ctx, shape, baseline.runner, BASELINE, `race_base_${tag}`, baseline.job));
    }
    if (only.includes('overhead') && process.env.IDEM_BENCH_PRECOMPUTED) contenders.push(precomputedContender(ctx, shape, runner, PRECOMPUTED, `race_pre_${tag}`));
    if (only.includes('overhead')) contenders.push(loopContender(ctx, shape, LOOP, `race_loop_${tag}`), singleUpdateContender(ctx, shape, SINGLE, `race_single_${tag}`));
    if (only.includes('queue')) contenders.push((queue = await queueContender(ctx, shape, `race_queue_${tag}`)));
    ctx.log(`backfill ${rows.toLocaleString('en-US')} rows in ${CHUNK_ROWS}-row chunks: ${contenders.map((c) => c.name).join(' / ')}, ${rounds} rounds`);
    const warmupMs = new Map<string, number>();
    const samples = await alternate(rounds, contenders, ctx.log, ctx.probe, { warmup: warmupMs });
    // The queue's warm-up turn enqueued too: only the timed turns' enqueue times count.
    return { samples, warmupMs, enqueueMs: queue?.enqueueMs.slice(1) ?? [] };
  } finally {
    await runner.close();
    await queue?.close();
    await baseline?.runner.close();
  }
}

/**
 * Another checkout's idem, for a before/after in one run (`IDEM_BENCH_BASELINE=<dir>`): its built
 * `dist/` when it has one, else its `src/` (older checkouts had no build; tsx runs them as the
 * tests did). It keeps its tables in a schema of its own, so neither version meets the other's
 * migrations.
 */
async function openBaseline(url: string, dir: string) {
  const built = path.resolve(dir, 'dist/index.js');
  const entry = existsSync(built) ? built : path.resolve(dir, 'src/index.ts');
  const lib = (await import(pathToFileURL(entry).href)) as JobLib & { Runner: { connect(o: { connectionString: string; schema: string }): Promise<Pick<Runner, 'run' | 'close'>> } };
  const runner = await lib.Runner.connect({ connectionString: url, schema: 'idem_baseline' });
  return { runner, job: benchBackfillWith(lib) as ReturnType<typeof benchBackfillWith> };
}
