import type { Kysely } from 'kysely';
import pLimit from 'p-limit';
import type { Logger } from 'pino';
import { FencedError, InterruptedError, messageOf } from './errors.ts';
import type { ChunkPage, ChunkSpec, ChunkSource, Job, Json, RunIdentity, Step, StepContext } from './job.ts';
import { faultPoint } from './fault-points.ts';
import { backoffDelay, DEFAULT_BACKOFF, isRetryable, retrying, type BackoffOptions } from './retry.ts';
import type { PendingChunk, StepRow, Store } from './store.ts';

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

/** Thrown inside a chunk transaction when its marker shows the chunk already done: roll back, skip. */
const ALREADY_DONE = Symbol('already done');

export interface ExecuteOptions {
  readonly db: Kysely<any>;
  readonly store: Store;
  readonly job: Job;
  readonly params: unknown;
  readonly run: RunIdentity;
  readonly log: Logger;
  readonly concurrency: number;
  readonly planWindow: number;
  /** Graceful stop: no new chunk starts once it aborts; its reason says which signal. */
  readonly stop: AbortSignal;
  /** Hard stop for the job's code (`ctx.signal`): lost lock, second signal, deadline. */
  readonly abort: AbortSignal;
}

export interface ExecuteResult {
  /** Chunks whose work this invocation committed. */
  readonly executed: number;
}

const SINGLE_STEP_KEY = 'step';

/**
 * Runs the job's unfinished steps in order. Within a chunked step: plan a window from the persisted
 * cursor (or take the persisted unfinished chunks), run them with bounded concurrency, repeat.
 * Each chunk is one transaction: the job's work, then the fenced completion marker.
 */
export async function executeSteps(opts: ExecuteOptions, steps: Map<string, StepRow>): Promise<ExecuteResult> {
  let executed = 0;
  for (const step of opts.job.steps) {
    const row = steps.get(step.name);
    if (!row) throw new Error(`step row for "${step.name}" missing`);
    if (row.status === 'done') {
      opts.log.debug({ step: step.name }, 'step already done, skipped');
      continue;
    }
    const stepLog = opts.log.child({ step: step.name });
    stepLog.info('step started');
    executed += await executeStep(opts, step, row, stepLog);
    await opts.store.finishStep(opts.run.runId, opts.run.attempt, step.name);
    stepLog.info('step done');
  }
  return { executed };
}

async function executeStep(opts: ExecuteOptions, step: Step, row: StepRow, log: Logger): Promise<number> {
  const { store, run } = opts;
  const source: ChunkSource = step.chunks ?? (() => ({ chunks: [{ key: SINGLE_STEP_KEY }], next: null }));
  const retry = { ...DEFAULT_BACKOFF, ...opts.job.retry, ...step.retry };
  const limit = pLimit(opts.concurrency);
  let cursor: Json | null = row.cursor;
  let plannedAll = row.planned_all;
  let nextSeq = row.planned + 1;
  let afterSeq = 0;
  let executed = 0;
  const maxSkips = step.maxFailedChunks ?? 0;
  let skipped = maxSkips > 0 ? await store.countSkipped(run.runId, step.name) : 0;
  const planCtx = { db: opts.db, params: opts.params, log, signal: opts.abort, run, step: step.name, windowSize: opts.planWindow };

  for (;;) {
    throwIfStopped(opts.stop);
    // Unfinished chunks planned by an earlier attempt come first; only then is the source asked.
    let pending: PendingChunk[] = await store.pendingChunks(run.runId, step.name, afterSeq, opts.planWindow);
    if (pending.length === 0) {
      if (plannedAll) break;
      // A source that reads the database (keyRange) may hit a dropped connection: ask it again.
      const page: ChunkPage = await retrying(async () => source(cursor, planCtx));
      checkPage(step.name, page);
      const { planned, fenced } = await store.planWindow(run.runId, run.attempt, step.name, nextSeq, page.chunks, page.next);
      if (fenced) throw new FencedError(`attempt ${run.attempt} of job "${run.job}" was taken over by a newer attempt while planning`);
      if (planned !== page.chunks.length) {
        throw new ChunkFailure(step.name, null, 1, new Error(`chunk source returned ${page.chunks.length - planned} key(s) that were already planned; chunk keys must be unique and stable`));
      }
      pending = page.chunks.map((spec, i) => ({ seq: nextSeq + i, key: spec.key, spec }));
      nextSeq += planned;
      cursor = page.next;
      plannedAll = page.next === null;
      log.debug({ planned, exhausted: plannedAll }, 'planned a window');
      if (pending.length === 0) continue;
    }
    afterSeq = pending[pending.length - 1]!.seq;

    let failure: unknown;
    await Promise.all(
      pending.map((chunk) =>
        limit(async () => {
          // Fail fast and stop gracefully: queued chunks that have not started are simply not run.
          if (failure !== undefined || opts.stop.aborted) return;
          try {
            if (await runChunk(opts, step, chunk, retry, log)) executed++;
          } catch (err) {
            if (err instanceof ChunkFailure && skipped < maxSkips && !opts.stop.aborted) {
              skipped++;
              if (!(await store.skipChunk(run.runId, run.attempt, step.name, chunk.key, err.tries, err.message))) {
                failure ??= new FencedError(`attempt ${run.attempt} of job "${run.job}" was fenced off while skipping chunk ${chunk.key}`);
              } else {
                log.warn({ chunk: chunk.key, tries: err.tries, skipped, maxFailedChunks: maxSkips, err: { message: err.message } }, 'chunk failed for good; skipped under the step policy');
              }
              return;
            }
            failure ??= err;
          }
        }),
      ),
    );
    if (failure !== undefined) throw failure;
  }
  throwIfStopped(opts.stop);
  return executed;
}

/** One chunk: a transaction with the job's work and the marker, retried on transient errors. */
async function runChunk(opts: ExecuteOptions, step: Step, chunk: PendingChunk, retry: Required<BackoffOptions>, stepLog: Logger): Promise<boolean> {
  const { store, run } = opts;
  const chunkKey = step.chunks ? chunk.key : null;
  for (let tries = 1; ; tries++) {
    const started = performance.now();
    try {
      await opts.db.transaction().execute(async (trx) => {
        await faultPoint('after-claim');
        const ctx: StepContext = {
          db: trx,
          params: opts.params,
          signal: opts.abort,
          run,
          step: step.name,
          get log() {
            return chunkKey === null ? stepLog : stepLog.child({ chunk: chunkKey });
          },
        };
        if (step.chunks) await step.run(ctx, chunk.spec);
        else await (step.run as (c: StepContext) => unknown)(ctx);
        await faultPoint('after-work');
        const marked = await store.markChunkDone(trx, run.runId, run.attempt, step.name, chunk.key, Math.round(performance.now() - started));
        if (!marked) {
          const why = await store.markerRefusal(run.runId, step.name, chunk.key);
          if (why.attempt !== run.attempt) {
            throw new FencedError(`attempt ${run.attempt} of job "${run.job}" was fenced off by attempt ${why.attempt}; its chunk ${chunk.key} rolled back`);
          }
          if (why.done) throw ALREADY_DONE;
          throw new Error(`chunk ${chunk.key} of step "${step.name}" has no row to mark (was the run reset while running?)`);
        }
        await faultPoint('after-marker');
      });
      await faultPoint('after-commit');
      return true;
    } catch (err) {
      if (err === ALREADY_DONE) return false;
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

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    function done() {
      clearTimeout(t);
      signal.removeEventListener('abort', done);
      resolve();
    }
    signal.addEventListener('abort', done, { once: true });
  });
}
