import type { Cost, CostProbe } from './probe.ts';

/** One contender's turn: prepared outside the clock, then `run` is timed, then `cleanup`. */
export interface Prepared<R = unknown> {
  run(): Promise<R>;
  cleanup?(): Promise<void>;
}

export interface Contender<R = unknown> {
  readonly name: string;
  /** Builds a fresh, identical starting state for this round (not timed). */
  prepare(round: number): Promise<Prepared<R>>;
}

export interface Sample<R = unknown> {
  readonly ms: number;
  readonly result: R;
  /** CPU and WAL of the turn, when a probe was given. */
  readonly cost?: Cost;
}

/**
 * Runs the contenders in alternation for `rounds` rounds, so drift in the machine (checkpoints,
 * cache, thermal) spreads over all of them instead of favouring whoever ran last. The order rotates
 * each round (A B C, B C A, C A B, …): no contender always runs first. Within a round each one
 * still follows the same one (B after A, C after B): bench 1 was run without its single UPDATE to
 * see whether the turn after that one suffers, and it does not (README, Performance).
 */
export async function alternate<R>(rounds: number, contenders: ReadonlyArray<Contender<R>>, log: (msg: string) => void, probe?: CostProbe, opts: AlternateOptions = {}): Promise<Map<string, Sample<R>[]>> {
  const samples = new Map<string, Sample<R>[]>(contenders.map((c) => [c.name, []]));
  if (opts.warmup) {
    for (const c of contenders) {
      const { ms } = await turn(c, 0);
      opts.warmup.set(c.name, ms);
      log(`  warm-up ${c.name}: ${fmtMs(ms)} (not counted)`);
    }
  }
  for (let round = 1; round <= rounds; round++) {
    for (const c of rotate(contenders, round - 1)) {
      const sample = await turn(c, round, probe);
      samples.get(c.name)!.push(sample);
      const { cost } = sample;
      const extra = cost ? ` (node cpu ${fmtMs(cost.nodeCpuMs)}, pg cpu ${cost.pgCpuMs === null ? 'n/a' : fmtMs(cost.pgCpuMs)}, wal ${(cost.walBytes / 2 ** 20).toFixed(0)} MB, load ${cost.load1.toFixed(1)})` : '';
      log(`  round ${round}/${rounds} ${c.name}: ${fmtMs(sample.ms)}${extra}`);
    }
  }
  return samples;
}

/** One turn of `c`: prepared outside the clock, `run` timed (with its cost when a probe is given), then cleaned up. */
async function turn<R>(c: Contender<R>, round: number, probe?: CostProbe): Promise<Sample<R>> {
  const prepared = await c.prepare(round);
  try {
    const before = await probe?.snapshot();
    const t0 = performance.now();
    const result = await prepared.run();
    const ms = performance.now() - t0;
    const cost = before ? await probe!.since(before) : undefined;
    return { ms, result, ...(cost ? { cost } : {}) };
  } finally {
    await prepared.cleanup?.();
  }
}

export interface AlternateOptions {
  /**
   * Runs each contender once, untimed, before the rounds and records its time here. Without it the
   * first rounds of an in-process contender include V8 compiling its code: idem's JavaScript
   * between two statements took 0.10 ms a chunk in its first 1 000-chunk run and 0.02-0.04 ms from
   * the third on, while a three-statement loop is compiled at once.
   */
  readonly warmup?: Map<string, number>;
}

/** `xs` starting at index `by` (mod its length): the order of round `by + 1`. */
export function rotate<T>(xs: readonly T[], by: number): T[] {
  const k = xs.length ? by % xs.length : 0;
  return [...xs.slice(k), ...xs.slice(0, k)];
}

export function median(xs: readonly number[]): number {
  if (xs.length === 0) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  const mid = s.length >> 1;
  return s.length % 2 ? s[mid]! : (s[mid - 1]! + s[mid]!) / 2;
}

export const medianMs = (samples: readonly Sample[]) => median(samples.map((s) => s.ms));

/** 12.3 s, 456 ms, 1.23 ms: three significant digits, unit picked for the size. */
export function fmtMs(ms: number): string {
  if (!Number.isFinite(ms)) return 'n/a';
  if (ms < 0) return `−${fmtMs(-ms)}`;
  if (ms >= 1000) return `${(ms / 1000).toPrecision(3)} s`;
  if (ms >= 1) return `${ms.toPrecision(3)} ms`;
  return `${(ms * 1000).toPrecision(3)} µs`;
}

export function fmtRatio(x: number): string {
  return Number.isFinite(x) ? x.toFixed(x >= 10 ? 1 : 3) : 'n/a';
}

/** The median over rounds of a's time ÷ b's time in the same round: drift between rounds cancels out. */
export function pairedRatio(a: readonly Sample[], b: readonly Sample[], pick: (s: Sample) => number = (s) => s.ms): number {
  return median(a.map((s, i) => pick(s) / pick(b[i]!)));
}

/** Median of a cost field over samples; NaN when not measured. */
export function medianCost(samples: readonly Sample[], field: 'nodeCpuMs' | 'pgCpuMs' | 'walBytes'): number {
  const xs = samples.map((s) => s.cost?.[field]).filter((x): x is number => typeof x === 'number');
  return xs.length ? median(xs) : NaN;
}
