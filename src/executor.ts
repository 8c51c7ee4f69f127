import { createHash } from 'node:crypto';
import type { Kysely } from 'kysely';
import pLimit from 'p-limit';
import type { Logger } from 'pino';
import { FencedError, InterruptedError, messageOf } from './errors.ts';
import type { ChunkPage, ChunkSpec, ChunkSource, Job, Json, RunIdentity, Step, StepContext } from './job.ts';
import { faultArmed, faultPoint } from './fault-points.ts';
import { isClaimRefusal, isMarkerRefusal, markerRefusal } from './marker-at-commit.ts';
import { backoffDelay, DEFAULT_BACKOFF, isRetryable, retrying, type BackoffOptions } from './retry.ts';
import type { PendingChunk, StepRow, Store } from './store.ts';
import { resolveThrottle, Throttle, type ThrottleOptions } from './throttle.ts';
import { sleep } from './sleep.ts';
import { createHealthGate, type HealthSetting } from './health-check.ts';

/** How many chunks are planned (and persisted) per call to a chunk source. */
export const DEFAULT_PLAN_WINDOW = 100;

/** A chunk that failed for good: carries where, how often and why. */
export class ChunkFailure extends Error {
  readonly step: string;
  readonly chunk: string | null;
  readonly tries: number;
  constructor(step: string, chunk: string | null, tries: number, cause: unknown) {
    super(messageOf(cause), { cause });
    this.step = step;
    this.chunk = chunk;
    this.tries = tries;
  }
}

/** A refused marker whose chunk turned out done already: its work rolled back, the chunk is skipped. */
const ALREADY_DONE = Symbol('already done');

/** Only the after-marker fault test needs the marker as a statement of its own. */
const MARKER_APART = faultArmed('after-marker');

export interface ExecuteOptions {
  readonly db: Kysely<any>;
  readonly store: Store;
  readonly job: Job;
  readonly params: unknown;
  readonly run: RunIdentity;
  readonly slot: Date | null;
  readonly log: Logger;
  readonly concurrency: number;
  readonly planWindow: number;
  /** Throttle flags from the command line; they override the job's and step's. */
  readonly throttle?: ThrottleOptions;
  /** Health-check settings from the command line; they override the job's and step's. */
  readonly health?: HealthSetting;
  /** Graceful stop: no new chunk starts once it aborts; its reason says why. */
  readonly stop: AbortSignal;
  /** Hard stop for the job's code (`ctx.signal`): lost lock, second signal, deadline. */
  readonly abort: AbortSignal;
  /** Called after every committed chunk and at each step's start. */
  readonly onProgress?: (p: Progress) => void;
}

/** Where a run is, for progress lines and ETA. */
export interface Progress {
  readonly step: string;
  readonly stepIndex: number;
  readonly steps: number;
  /** Chunks of this step done (by any attempt). */
  readonly done: number;
  readonly planned: number;
  /** The source's estimate of the step's total, when it gives one. */
  readonly estimated: number | null;
  readonly fullyPlanned: boolean;
  /** Chunks this invocation committed in this step, and since when (for the rate). */
  readonly executedNow: number;
  readonly since: number;
}

export interface ExecuteResult {
  /** Chunks whose work this invocation committed. */
  readonly executed: number;
}

const SINGLE_STEP_KEY = 'step';
const EFFECT_NAME = /^[\w.:-]{1,200}$/;

/**
 * Runs the job's unfinished steps in order. Within a chunked step: plan a window from the persisted
 * cursor (or take the persisted unfinished chunks), run them with bounded concurrency, repeat.
 * Each chunk is one transaction: the job's work, then the fenced completion marker.
 */
export async function executeSteps(opts: ExecuteOptions, steps: Map<string, StepRow>): Promise<ExecuteResult> {
  let executed = 0;
  for (const [index, step] of opts.job.steps.entries()) {
    const row = steps.get(step.name);
    if (!row) throw new Error(`step row for "${step.name}" missing`);
    if (row.status === 'done') {
      opts.log.debug({ step: step.name }, 'step already done, skipped');
      continue;
    }
    const stepLog = opts.log.child({ step: step.name });
    stepLog.info('step started');
    executed += await executeStep(opts, step, index, row, stepLog);
    await opts.store.finishStep(opts.run.runId, opts.run.attempt, step.name);
    stepLog.info('step done');
  }
  return { executed };
}

async function executeStep(opts: ExecuteOptions, step: Step, index: number, row: StepRow, log: Logger): Promise<number> {
  const { store, run } = opts;
  const source: ChunkSource = step.chunks ?? (() => ({ chunks: [{ key: SINGLE_STEP_KEY }], next: null }));
  const retry = { ...DEFAULT_BACKOFF, ...opts.job.retry, ...step.retry };
  const throttle = new Throttle(resolveThrottle(opts.job.throttle, step.throttle, opts.throttle));
  // Adaptive sizing learns from each window, so windows are kept small while it steers.
  const planWindow = throttle.options.targetChunkMs && step.chunks ? Math.max(4, opts.concurrency * 2) : opts.planWindow;
  const limit = pLimit(opts.concurrency);
  const health = await createHealthGate({ db: opts.db, schema: store.schema, run, job: opts.job, step, log, ...(opts.health !== undefined ? { override: opts.health } : {}) });
  let cursor: Json | null = row.cursor;
  let plannedAll = row.planned_all;
  let nextSeq = row.planned + 1;
  let executed = 0;
  const counts = await store.stepCounts(run.runId, step.name);
  let done = counts.done;
  let estimated = row.estimated_chunks;
  const maxSkips = step.maxFailedChunks ?? 0;
  let skipped = counts.skipped;
  const since = performance.now();
  const planCtx = () => ({ db: opts.db, params: opts.params, log, signal: opts.abort, run, step: step.name, slot: opts.slot, windowSize: planWindow, sizeFactor: throttle.sizeFactor });
  const progress = () =>
    opts.onProgress?.({ step: step.name, stepIndex: index, steps: opts.job.steps.length, done, planned: nextSeq - 1, estimated, fullyPlanned: plannedAll, executedNow: executed, since });

  if (estimated === null && source.estimate && !plannedAll) {
    const e = await Promise.resolve(source.estimate(planCtx())).catch(() => null);
    if (typeof e === 'number' && Number.isFinite(e) && e >= 0) {
      estimated = Math.round(e);
      await store.setEstimate(run.runId, step.name, estimated);
    }
  }
  progress();

  let fetchAfter = 0;
  /** The next window: unfinished chunks planned earlier first; only then is the source asked. */
  const nextWindow = async (): Promise<PendingChunk[]> => {
    let pending: PendingChunk[] = await store.pendingChunks(run.runId, step.name, fetchAfter, planWindow);
    while (pending.length === 0 && !plannedAll) {
      // A source that reads the database (keyRange) may hit a dropped connection: ask it again.
      // A source that fails for good fails the step it belongs to, not "(runner)".
      const page: ChunkPage = await retrying(async () => source(cursor, planCtx())).catch((err: unknown) => {
        throw err instanceof ChunkFailure || err instanceof FencedError ? err : new ChunkFailure(step.name, null, 1, err);
      });
      checkPage(step.name, page);
      const result = await store.planWindow(run.runId, run.attempt, step.name, nextSeq - 1, page.chunks, page.next);
      if (result.kind === 'fenced') throw new FencedError(`attempt ${run.attempt} of job "${run.job}" was taken over by a newer attempt while planning`);
      if (result.kind === 'duplicate') {
        throw new ChunkFailure(step.name, null, 1, new Error(`chunk source returned key ${JSON.stringify(result.key)}, which is already planned as chunk ${result.seq} of the step; chunk keys must be unique and stable`));
      }
      if (result.kind === 'moved') {
        // Planned past us meanwhile: nothing was written; continue from where the step is now.
        ({ cursor, planned_all: plannedAll } = result.step);
        nextSeq = result.step.planned + 1;
        pending = await store.pendingChunks(run.runId, step.name, fetchAfter, planWindow);
        continue;
      }
      const planned = page.chunks.length;
      pending = page.chunks.map((spec, i) => ({ seq: nextSeq + i, key: spec.key, spec }));
      nextSeq += planned;
      cursor = page.next;
      plannedAll = page.next === null;
      log.debug({ planned, exhausted: plannedAll, sizeFactor: throttle.sizeFactor }, 'planned a window');
    }
    if (pending.length > 0) fetchAfter = pending[pending.length - 1]!.seq;
    return pending;
  };
  // Adaptive sizing must see a window's durations before it plans the next; otherwise the next
  // window is fetched (and planned) while this one runs, on another connection, so planning
  // queries overlap the chunks' work instead of adding to it.
  const prefetch = !throttle.options.targetChunkMs;
  let upcoming: Promise<PendingChunk[]> | undefined;
  const settleUpcoming = async () => {
    await upcoming?.catch(() => {});
  };

  /**
   * Runs one window's chunks with bounded concurrency. `waitForLocks`: claim each chunk even if
   * another worker holds it (wait for that worker's transaction) instead of passing it by.
   */
  const runWindow = async (pending: PendingChunk[], waitForLocks: boolean): Promise<number[]> => {
    let failure: unknown;
    const durations: number[] = [];
    await Promise.all(
      pending.map((chunk) =>
        limit(async () => {
          // Fail fast and stop gracefully: queued chunks that have not started are simply not run.
          if (failure !== undefined || opts.stop.aborted) return;
          await health?.wait(opts.stop);
          const wait = throttle.reserveStart();
          if (wait > 0) await sleep(wait, opts.stop);
          if (failure !== undefined || opts.stop.aborted) return;
          try {
            const ms = await runChunk(opts, step, chunk, retry, log, waitForLocks);
            if (ms !== null) {
              executed++;
              done++;
              durations.push(ms);
              progress();
            }
          } catch (err) {
            if (err instanceof ChunkFailure && skipped < maxSkips && !opts.stop.aborted) {
              skipped++;
              if (!(await store.skipChunk(run.runId, run.attempt, step.name, chunk.key, err.message))) {
                failure ??= new FencedError(`attempt ${run.attempt} of job "${run.job}" was fenced off while skipping chunk ${chunk.key}`);
              } else {
                log.warn({ chunk: chunk.key, tries: err.tries, skipped, maxFailedChunks: maxSkips, err: { message: err.message } }, 'chunk failed for good; skipped under the step policy');
              }
              return;
            }
            failure ??= err;
          }
          if (throttle.options.pauseMs) await sleep(throttle.options.pauseMs, opts.stop);
        }),
      ),
    );
    if (failure !== undefined) {
      await settleUpcoming();
      throw failure;
    }
    return durations;
  };

  for (;;) {
    if (opts.stop.aborted) await settleUpcoming();
    throwIfStopped(opts.stop);
    const pending = await (upcoming ?? nextWindow());
    upcoming = undefined;
    if (pending.length === 0) break;
    if (prefetch) {
      upcoming = nextWindow();
      upcoming.catch(() => {}); // awaited (and its error seen) at the top of the next turn
    }
    const durations = await runWindow(pending, false);
    if (throttle.options.targetChunkMs) throttle.adapt(durations);
  }
  // Everything is planned and this worker has been through it. Chunks another worker held as we
  // passed them (and chunks it left behind when it died) are still open: take each, waiting for
  // the holder's transaction, until none is left. Alone on a run this is one empty query.
  for (;;) {
    throwIfStopped(opts.stop);
    const left = await store.pendingChunks(run.runId, step.name, 0, planWindow);
    if (left.length === 0) break;
    await runWindow(left, true);
  }
  throwIfStopped(opts.stop);
  return executed;
}

/**
 * One chunk: a transaction with the job's work and the marker, retried on transient errors.
 * Returns the committed try's duration in ms, or null when the chunk turned out done already.
 */
async function runChunk(opts: ExecuteOptions, step: Step, chunk: PendingChunk, retry: Required<BackoffOptions>, stepLog: Logger, waitForLock: boolean): Promise<number | null> {
  const { store, run } = opts;
  const chunkKey = step.chunks ? chunk.key : null;
  const effect = <T>(name: string, fn: (key: string) => Promise<T> | T) => performEffect(opts, step.name, chunk.key, name, fn);
  for (let tries = 1; ; tries++) {
    const started = performance.now();
    try {
      await opts.db.transaction().execute(async (trx) => {
        // The row lock is the lease: it lives exactly as long as this transaction (and its
        // backend), so another worker sharing the run passes this chunk by, or waits for it.
        await store.claimChunk(run.runId, step.name, chunk.seq, waitForLock).execute(trx);
        await faultPoint('after-claim');
        const ctx: StepContext = {
          db: trx,
          params: opts.params,
          signal: opts.abort,
          run,
          step: step.name,
          slot: opts.slot,
          effect: effect as StepContext['effect'],
          get log() {
            return chunkKey === null ? stepLog : stepLog.child({ chunk: chunkKey });
          },
        };
        if (step.chunks) await step.run(ctx, chunk.spec);
        else await (step.run as (c: StepContext) => unknown)(ctx);
        await faultPoint('after-work');
        const ms = Math.round(performance.now() - started);
        if (!MARKER_APART) {
          // The usual path: the marker rides with COMMIT in one round trip (marker-at-commit.ts).
          await store.markerAtCommit(run.runId, run.attempt, step.name, chunk.seq, chunk.key, ms).execute(trx);
          return;
        }
        // With IDEM_FAULT=after-marker the marker is its own statement, so a crash can land
        // between it and the COMMIT, as the fault test wants.
        if (!(await store.markChunkDone(trx, run.runId, run.attempt, step.name, chunk.seq, chunk.key, ms))) throw markerRefusal('marker refused');
        await faultPoint('after-marker');
      });
      await faultPoint('after-commit');
      return performance.now() - started;
    } catch (caught) {
      // Nothing to claim: done (by another worker, or by an earlier try whose acknowledgement was
      // lost), skipped, or held by another worker, which the step's last pass waits for.
      if (isClaimRefusal(caught)) return tries > 1 && (await store.markerRefusal(run.runId, step.name, chunk.key)).doneAttempt === run.attempt ? performance.now() - started : null;
      let err = caught;
      if (isMarkerRefusal(caught)) {
        // Nothing committed. Why was the marker refused: fenced off, or done by someone else?
        const why = await store.markerRefusal(run.runId, step.name, chunk.key);
        if (why.attempt !== run.attempt) {
          err = new FencedError(`attempt ${run.attempt} of job "${run.job}" was fenced off by attempt ${why.attempt}; its chunk ${chunk.key} rolled back`);
        } else if (why.done && why.doneAttempt === run.attempt && tries > 1) {
          // An earlier try of ours committed, and only its acknowledgement was lost: it was executed here.
          return performance.now() - started;
        } else if (why.done) {
          err = ALREADY_DONE;
        } else {
          err = new Error(`chunk ${chunk.key} of step "${step.name}" has no row to mark (was the run reset while running?)`);
        }
      }
      if (err === ALREADY_DONE) return null;
      if (err instanceof FencedError || opts.abort.aborted) throw err;
      const retryable = isRetryable(err);
      if (retryable && tries < retry.attempts && !opts.stop.aborted) {
        const delay = backoffDelay(tries, retry);
        stepLog.warn({ chunk: chunkKey, tries, delayMs: delay, err: { message: messageOf(err), code: (err as { code?: string }).code } }, 'transient error, retrying chunk');
        await sleep(delay, opts.stop);
        continue;
      }
      await store.recordChunkFailure(run.runId, step.name, chunk.key, tries, messageOf(err)).catch(() => {});
      throw new ChunkFailure(step.name, chunkKey, tries, err);
    }
  }
}

/** The effects ledger protocol: claim the record, skip if done, else perform with the stable key and record the result. */
async function performEffect<T>(opts: ExecuteOptions, step: string, chunk: string, name: string, fn: (key: string) => Promise<T> | T): Promise<T> {
  if (typeof name !== 'string' || !EFFECT_NAME.test(name)) throw new TypeError(`ctx.effect(): name must be 1-200 characters of letters, digits, _ . : - (got ${JSON.stringify(name)})`);
  if (typeof fn !== 'function') throw new TypeError('ctx.effect(): fn must be a function (idempotencyKey) => result');
  const { run, store } = opts;
  const key = `idem-${createHash('sha256').update([store.schema, run.job, run.runKey, step, chunk, name].join('\0')).digest('hex').slice(0, 40)}`;
  const record = await store.beginEffect(run.runId, run.attempt, step, chunk, name, key);
  if (!record) throw new FencedError(`attempt ${run.attempt} of job "${run.job}" was fenced off; effect "${name}" of chunk ${chunk} was not started`);
  if (record.status === 'done') return record.result as T;
  // A run that lost its lock (or must stop at once) starts no new effect.
  if (opts.abort.aborted) throw opts.abort.reason ?? new FencedError(`attempt ${run.attempt} of job "${run.job}" stopped before effect "${name}"`);
  const result = await fn(key);
  await store.completeEffect(run.runId, step, chunk, name, (result ?? null) as Json);
  return result;
}
function checkPage(step: string, page: ChunkPage): void {
  if (!page || !Array.isArray(page.chunks) || (page.next === undefined)) {
    throw new ChunkFailure(step, null, 1, new TypeError('a chunk source must return { chunks: ChunkSpec[], next: cursor | null }'));
  }
  const seen = new Set<string>();
  for (const c of page.chunks as ChunkSpec[]) {
    if (!c || typeof c.key !== 'string' || c.key === '') throw new ChunkFailure(step, null, 1, new TypeError('every chunk needs a non-empty string key'));
    if (seen.has(c.key)) throw new ChunkFailure(step, null, 1, new Error(`chunk source returned key ${c.key} twice in one window; keys must be unique`));
    seen.add(c.key);
  }
}

function throwIfStopped(stop: AbortSignal): void {
  if (stop.aborted) throw stop.reason instanceof Error ? stop.reason : new InterruptedError('SIGINT');
}
