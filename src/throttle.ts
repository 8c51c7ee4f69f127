/** Throttling for a step: how fast chunks may start, and how long they should take. */
export interface ThrottleOptions {
  /** Most chunks started per second, across all of the step's workers. Defaults to unlimited. */
  readonly maxRate?: number;
  /** Pause after each chunk, per worker, in ms (lets replicas and autovacuum keep up). Defaults to `0`. */
  readonly pauseMs?: number;
  /**
   * Steer chunk sizes so a chunk takes about this long (GitLab's batched-migration approach): after
   * each window the size factor moves toward target ÷ median duration, at most ×2 or ÷2 a window,
   * within [1/16, 16] of the nominal size. Honoured by keyRange. Defaults to off.
   */
  readonly targetChunkMs?: number;
}

const MIN_FACTOR = 1 / 16;
const MAX_FACTOR = 16;

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
  if (t.maxRate !== undefined && !(typeof t.maxRate === 'number' && t.maxRate > 0 && Number.isFinite(t.maxRate))) problems.push(`maxRate must be > 0 (got ${JSON.stringify(t.maxRate)})`);
  if (t.pauseMs !== undefined && !(typeof t.pauseMs === 'number' && Number.isFinite(t.pauseMs) && t.pauseMs >= 0)) problems.push(`pauseMs must be >= 0 (got ${JSON.stringify(t.pauseMs)})`);
  if (t.targetChunkMs !== undefined && !(typeof t.targetChunkMs === 'number' && t.targetChunkMs > 0 && Number.isFinite(t.targetChunkMs))) problems.push(`targetChunkMs must be > 0 (got ${JSON.stringify(t.targetChunkMs)})`);
  return problems;
}

/**
 * One step's throttle state: a start-rate gate shared by its workers, and the adaptive size factor.
 */
export class Throttle {
  readonly options: ThrottleOptions;
  #nextStart = 0;
  #factor = 1;

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

  /** Feeds one window's chunk durations into the size factor. Pure arithmetic; exported for tests. */
  adapt(durationsMs: readonly number[]): number {
    const target = this.options.targetChunkMs;
    if (!target || durationsMs.length === 0) return this.#factor;
    const sorted = [...durationsMs].sort((a, b) => a - b);
    const median = Math.max(1, sorted[Math.floor(sorted.length / 2)]!);
    const step = Math.min(2, Math.max(0.5, target / median));
    this.#factor = Math.min(MAX_FACTOR, Math.max(MIN_FACTOR, this.#factor * step));
    return this.#factor;
  }
}
