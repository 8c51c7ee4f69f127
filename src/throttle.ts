import { givenValue } from './errors.ts';

/** Throttling for a step: how fast chunks may start, and how long they should take. */
export interface ThrottleOptions {
  /** Most chunks started per second, across all of the step's workers. Defaults to unlimited. */
  readonly maxRate?: number;
  /** Pause after each chunk, per worker, in ms (lets replicas and autovacuum keep up). Defaults to `0`. */
  readonly pauseMs?: number;
  /**
   * Steer chunk sizes so a chunk takes about this long, as GitLab's batch optimizer does (see
   * `ADAPTIVE_SIZING` and `Throttle.adapt`). Honoured by keyRange, keyList and keysetQuery.
   * Defaults to off.
   */
  readonly targetChunkMs?: number;
}

/**
 * The adaptive-sizing constants (after GitLab's `BatchOptimizer`: smoothed efficiency, a target
 * band, growth capped at 20 % per step, bounded sizes). Shrinking may go faster than growing:
 * chunks that run long hurt the database, chunks that run short only cost throughput.
 */
export const ADAPTIVE_SIZING = Object.freeze({
  /** Weight of the newest window in the moving average of a nominal chunk's cost. */
  smoothing: 0.5,
  /** No change while the predicted duration is within ±10 % of the target. */
  deadBand: 0.1,
  /** Growth per window, at most. */
  maxGrowth: 1.2,
  /** Shrink per window, at most (×0.5). */
  maxShrink: 0.5,
  /** Bounds of the size factor, relative to the nominal size. */
  minFactor: 1 / 16,
  maxFactor: 16,
});

/** Merges throttle settings (later ones win) and checks them, naming every bad value. */
export function resolveThrottle(...layers: ReadonlyArray<ThrottleOptions | undefined>): ThrottleOptions {
  const merged: { maxRate?: number; pauseMs?: number; targetChunkMs?: number } = {};
  for (const l of layers) {
    if (!l) continue;
    if (l.maxRate !== undefined) merged.maxRate = l.maxRate;
    if (l.pauseMs !== undefined) merged.pauseMs = l.pauseMs;
    if (l.targetChunkMs !== undefined) merged.targetChunkMs = l.targetChunkMs;
  }
  const problems = throttleProblems(merged);
  if (problems.length) throw new TypeError(`invalid throttle: ${problems.join('; ')}`);
  return merged;
}

/** What is wrong with a throttle setting (empty when nothing is); defineJob reports these at load. */
export function throttleProblems(t: ThrottleOptions): string[] {
  const problems: string[] = [];
  if (!t || typeof t !== 'object') return ['throttle must be an object { maxRate?, pauseMs?, targetChunkMs? }'];
  if (t.maxRate !== undefined && !(typeof t.maxRate === 'number' && t.maxRate > 0 && Number.isFinite(t.maxRate))) problems.push(`maxRate must be > 0 (got ${givenValue(t.maxRate)})`);
  if (t.pauseMs !== undefined && !(typeof t.pauseMs === 'number' && Number.isFinite(t.pauseMs) && t.pauseMs >= 0)) problems.push(`pauseMs must be >= 0 (got ${givenValue(t.pauseMs)})`);
  if (t.targetChunkMs !== undefined && !(typeof t.targetChunkMs === 'number' && t.targetChunkMs > 0 && Number.isFinite(t.targetChunkMs))) problems.push(`targetChunkMs must be > 0 (got ${givenValue(t.targetChunkMs)})`);
  return problems;
}

/**
 * One step's throttle state: a start-rate gate shared by its workers, and the adaptive size factor.
 */
export class Throttle {
  readonly options: ThrottleOptions;
  #nextStart = 0;
  #factor = 1;
  /** Moving average of what a chunk of nominal size (factor 1) takes, in ms; null before the first window. */
  #cost: number | null = null;

  constructor(options: ThrottleOptions) {
    this.options = options;
  }

  get sizeFactor(): number {
    return this.#factor;
  }

  /** Milliseconds to wait before the next chunk may start (and books that start). */
  reserveStart(now = performance.now()): number {
    const rate = this.options.maxRate;
    if (!rate) return 0;
    const at = Math.max(now, this.#nextStart);
    this.#nextStart = at + 1000 / rate;
    return at - now;
  }

  /**
   * Feeds one window's chunk durations (chunks cut with the current factor) into the size factor:
   * 1. the window's median duration ÷ factor is what a nominal chunk costs now; an exponential
   *    moving average smooths it (one slow chunk is noise, three slow windows are a trend);
   * 2. predicted duration = average cost × factor; inside the dead band around the target nothing
   *    changes, so noise cannot make the size oscillate;
   * 3. outside it the factor moves by target ÷ predicted, capped at ×1.2 growth and ×0.5 shrink a
   *    window, within [1/16, 16] of the nominal size.
   * Pure arithmetic; exported for tests.
   */
  adapt(durationsMs: readonly number[]): number {
    const target = this.options.targetChunkMs;
    if (!target || durationsMs.length === 0) return this.#factor;
    const A = ADAPTIVE_SIZING;
    const sorted = [...durationsMs].sort((a, b) => a - b);
    const median = Math.max(1, sorted[Math.floor(sorted.length / 2)]!);
    const cost = median / this.#factor;
    this.#cost = this.#cost === null ? cost : A.smoothing * cost + (1 - A.smoothing) * this.#cost;
    const predicted = this.#cost * this.#factor;
    if (Math.abs(predicted - target) <= A.deadBand * target) return this.#factor;
    const step = Math.min(A.maxGrowth, Math.max(A.maxShrink, target / predicted));
    this.#factor = Math.min(A.maxFactor, Math.max(A.minFactor, this.#factor * step));
    return this.#factor;
  }
}
