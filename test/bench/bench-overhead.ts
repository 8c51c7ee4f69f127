import { backfillRace, BASELINE, IDEM, LOOP, SINGLE } from './backfill-race.ts';
import { fmtMs, fmtRatio, median, medianMs, pairedRatio, type Sample } from './measure.ts';
import { costTable, type BenchContext, type BenchResult } from './report.ts';
import { CHUNK_ROWS } from './tables.ts';

const GOAL = 1.05;

/**
 * 1. Overhead vs the physical limit: idem (Runner.run, keyRange chunks, concurrency 1) against a
 * hand-written loop doing the same UPDATE per chunk, each in its own BEGIN … COMMIT, over the same
 * keyset boundaries; one single UPDATE over the whole table as the lower bound.
 */
export async function benchOverhead(ctx: BenchContext): Promise<BenchResult> {
  const { samples, warmupMs } = await backfillRace(ctx);
  const [idemS, loopS, singleS] = [IDEM, LOOP, SINGLE].map((n) => samples.get(n)!) as [Sample[], Sample[], Sample[]];
  const [idem, loop, single] = [idemS, loopS, singleS].map(medianMs) as [number, number, number];
  const ratio = idem / loop;
  const paired = pairedRatio(idemS, loopS);
  const cpu = cpuRatio(idemS, loopS);
  const chunks = Math.ceil(ctx.opts.rows / CHUNK_ROWS);
  return {
    rows: [
      {
        benchmark: `1. overhead: backfill ${ctx.opts.rows.toLocaleString('en-US')} rows, ${chunks} chunks`,
        contenders: 'idem (Runner.run, concurrency 1) vs hand loop (BEGIN; UPDATE; COMMIT per chunk, boundaries precomputed)',
        median: `${fmtMs(idem)} vs ${fmtMs(loop)} (${(idem / chunks).toFixed(2)} vs ${(loop / chunks).toFixed(2)} ms/chunk; untimed warm-up turn ${fmtMs(warmupMs.get(IDEM) ?? NaN)} vs ${fmtMs(warmupMs.get(LOOP) ?? NaN)})`,
        ratio: `${fmtRatio(ratio)} idem÷loop (paired ${fmtRatio(paired)}; CPU ${fmtRatio(cpu)})`,
        goal: `≤ ${GOAL}`,
        met: ratio <= GOAL,
      },
      ...(samples.has(BASELINE)
        ? [
            {
              benchmark: '1. overhead against another checkout (IDEM_BENCH_BASELINE)',
              contenders: `idem vs idem (baseline: ${process.env.IDEM_BENCH_BASELINE}), same rounds`,
              median: `${fmtMs(idem)} vs ${fmtMs(medianMs(samples.get(BASELINE)!))}; baseline÷loop ${fmtRatio(medianMs(samples.get(BASELINE)!) / loop)}`,
              ratio: `${fmtRatio(idem / medianMs(samples.get(BASELINE)!))} idem÷baseline (paired ${fmtRatio(pairedRatio(idemS, samples.get(BASELINE)!))})`,
              goal: 'info',
              met: null,
            },
          ]
        : []),
      {
        benchmark: '1. lower bound: one UPDATE over the table',
        contenders: 'single UPDATE vs hand loop',
        median: `${fmtMs(single)} vs ${fmtMs(loop)}`,
        ratio: `${fmtRatio(single / loop)} single÷loop`,
        goal: 'info',
        met: null,
      },
    ],
    details: costTable('1./2. backfill — cost per contender', samples, LOOP),
    data: { rows: ctx.opts.rows, chunks, chunkRows: CHUNK_ROWS, samples: Object.fromEntries(samples), warmupMs: Object.fromEntries(warmupMs), medianMs: { idem, loop, single }, ratio, pairedRatio: paired, cpuRatio: cpu },
  };
}

/** Median node + postgres CPU of a ÷ of b: what a contender costs, however busy the machine. */
export function cpuRatio(a: readonly Sample[], b: readonly Sample[]): number {
  const cpu = (xs: readonly Sample[]) => xs.map((s) => (s.cost ? s.cost.nodeCpuMs + (s.cost.pgCpuMs ?? NaN) : NaN));
  return median(cpu(a)) / median(cpu(b));
}
