import { createHash } from 'node:crypto';
import type { Kysely } from 'kysely';
import type pg from 'pg';
import type { Logger } from 'pino';
import { codeOf, errorFields, FencedError, InterruptedError, messageOf, readableThrown } from './errors.ts';
import type { ChunkPage, ChunkSpec, ChunkSource, Job, Json, RunIdentity, Step, StepContext } from './job.ts';
import { reviveSpec } from './job.ts';
import { keyLabel, LONE_SURROGATE } from './key-label.ts';
import { faultPoint, faultsArmed as faults } from './fault-points.ts';
import { CommitUnknownError, openChunkSlot, TransactionEndedError, type ChunkSlot } from './chunk-slot.ts';
import { backoffDelay, DEFAULT_BACKOFF, isRetryable, isStatementTimeout, lockWaitCutShort, noConnectionFree, retrying, type BackoffOptions } from './retry.ts';
import type { ClaimMode, PendingChunk, RetryCount, StepRow, Store } from './store.ts';
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
  /** It was the step's planning (its chunk source) that failed, its transient errors' tries spent or its query cut short by the statement_timeout: no chunk. */
  readonly planning: boolean;
  constructor(step: string, chunk: string | null, tries: number, cause: unknown, planning = false) {
    super(messageOf(cause), { cause });
    this.step = step;
    this.chunk = chunk;
    this.tries = tries;
    this.planning = planning;
  }
}

export interface ExecuteOptions {
  readonly db: Kysely<any>;
  /** Masks the database's password in a job's error (an Error in place, a thrown string as a copy) before it is recorded, logged or thrown. */
  readonly redact?: <T>(err: T) => T;
  /** The work pool behind `db`: each worker slot keeps one of its connections (chunk-slot.ts). */
  readonly pool: pg.Pool;
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
  /** The run's key and attempt, so a progress log line names its run as the run's other lines do. */
  readonly runKey: string;
  readonly attempt: number;
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
  /** `done` when this invocation started the step: the step's rate is (done - doneBefore) / time, every worker's chunks counted. */
  readonly doneBefore?: number;
  /**
   * Every slot of this process waits for a chunk another transaction holds (another worker's, or
   * a cut-off one's until the server ends its session): the rate says nothing about when that ends.
   */
  readonly waitingOnOthers?: boolean;
  /**
   * True on the step's last report, once its chunks are all done, just before its `step done` log
   * line: a progress bar is taken down then, not drawn again below that line.
   */
  readonly stepDone?: boolean;
}

/**
 * How many times a step's slots start, at most, when they all end with chunks of the step left (a
 * slot that left for want of a connection had one): then the step fails naming them, never a loop.
 */
const MAX_SLOT_ROUNDS = 10;

/** How often (at most) a step's progress is read back from the database, for the other workers' chunks. */
const PROGRESS_REFRESH_MS = 1_000;

export interface ExecuteResult {
  /** Chunks whose work this invocation committed. */
  readonly executed: number;
}

const SINGLE_STEP_KEY = 'step';
const EFFECT_NAME = /^[\w.:-]{1,200}$/;

/**
 * Runs the job's unfinished steps in order. Within a chunked step, `concurrency` slots claim the
 * step's planned chunks one after another (planned and unfinished ones of earlier attempts first,
 * by seq) while the next window is planned from the persisted cursor. Each chunk is one
 * transaction: the claim that marks it done, the job's work, and a COMMIT that the fence checks.
 */
export async function executeSteps(opts: ExecuteOptions, steps: Map<string, StepRow>): Promise<ExecuteResult> {
  let executed = 0;
  let checksFirst: boolean | undefined;
  for (const [index, step] of opts.job.steps.entries()) {
    const row = steps.get(step.name);
    if (!row) throw new Error(`step row for "${step.name}" missing`);
    if (row.status === 'done') {
      opts.log.debug({ step: step.name }, 'step already done, skipped');
      continue;
    }
    // A stop seen between steps: the next step starts nothing (not even its health gate or estimate).
    throwIfStopped(opts.stop);
    const stepLog = opts.log.child({ step: step.name });
    stepLog.info('step started');
    // Deferred constraints in the database: chunks run their deferred checks before COMMIT (ChunkSlot).
    // Asked again at each step until there is one: an earlier step (or a migration) may have made it.
    if (!checksFirst) checksFirst = await opts.store.hasDeferrableConstraints();
    executed += await executeStep(opts, step, index, row, stepLog, checksFirst);
    // Never once the stop is immediate (the lock lost): this worker no longer speaks for the run.
    throwIfStopped(opts.abort);
    await opts.store.finishStep(opts.run.runId, opts.run.attempt, step.name);
    stepLog.info('step done');
  }
  return { executed };
}

async function executeStep(opts: ExecuteOptions, step: Step, index: number, row: StepRow, log: Logger, checksFirst: boolean): Promise<number> {
  const { store, run } = opts;
  const source: ChunkSource = step.chunks ?? (() => ({ chunks: [{ key: SINGLE_STEP_KEY }], next: null }));
  const retry = { ...DEFAULT_BACKOFF, ...opts.job.retry, ...step.retry };
  /** Backoff before the next try after the n-th failed one (index n - 1), jittered afresh each time. */
  const retryDelays = () => Array.from({ length: retry.attempts }, (_, i) => backoffDelay(i + 1, retry));
  const throttle = new Throttle(resolveThrottle(opts.job.throttle, step.throttle, opts.throttle));
  // Adaptive sizing learns from each window, so windows are kept small while it steers.
  const planWindow = throttle.options.targetChunkMs && step.chunks ? Math.max(4, opts.concurrency * 2) : opts.planWindow;
  // The gate resolves the tables the step names (its own and its chunk source's): a name the
  // server refuses is the step's mistake, not the runner's.
  const health = await createHealthGate({ db: opts.db, schema: store.schema, run, job: opts.job, step, log, ...(opts.health !== undefined ? { override: opts.health } : {}) }).catch((err: unknown) => {
    throw isRetryable(err) ? err : new ChunkFailure(step.name, null, 1, err);
  });
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
  const doneBefore = done;
  // Other workers of the run commit chunks too: what they did is read back now and then (not on
  // the chunk path: in the background, at most once a PROGRESS_REFRESH_MS), so that a worker's
  // progress shows the step's, not its own alone. Read back on a timer too, not only on this
  // worker's chunk events, and reported when it changed the figures: a worker whose slots wait on
  // another worker's chunks (or run long chunks) has no events, and until 2026-12-04 its progress
  // line kept the figures of its last one (27/30 for 30 s while 28 were done).
  let seen = { done: 0, planned: 0, plannedAll: false };
  let refreshedAt = performance.now();
  let refreshing: Promise<void> | undefined;
  /** The step's slots have all ended: a late read-back reports nothing more. */
  let slotsEnded = false;
  const refresh = () => {
    if (refreshing || performance.now() - refreshedAt < PROGRESS_REFRESH_MS) return;
    refreshedAt = performance.now();
    refreshing = store
      .stepProgress(run.runId, step.name)
      .then((p) => {
        if (!p) return;
        const before = seen;
        seen = { done: Math.max(seen.done, p.done), planned: Math.max(seen.planned, p.planned), plannedAll: seen.plannedAll || p.plannedAll };
        if (!slotsEnded && (seen.done !== before.done || seen.planned !== before.planned || seen.plannedAll !== before.plannedAll)) report();
      })
      .catch(() => {})
      .finally(() => (refreshing = undefined));
  };
  /** Slots of this step still going (see leavesForOthers). */
  let slotsLive = 0;
  /** Slots whose last-pass claim is waiting for a chunk another transaction holds (see Progress.waitingOnOthers). */
  let slotsWaiting = 0;
  const progress = (stepDone = false) => {
    if (!opts.onProgress) return;
    if (!stepDone) refresh();
    report(stepDone);
  };
  const report = (stepDone = false) => {
    if (!opts.onProgress) return;
    opts.onProgress({
      runKey: run.runKey,
      attempt: run.attempt,
      step: step.name,
      stepIndex: index,
      steps: opts.job.steps.length,
      done: Math.max(done, seen.done),
      planned: Math.max(nextSeq - 1, seen.planned),
      estimated,
      fullyPlanned: plannedAll || seen.plannedAll,
      executedNow: executed,
      since,
      doneBefore,
      waitingOnOthers: slotsWaiting > 0 && slotsWaiting === slotsLive,
      ...(stepDone ? { stepDone } : {}),
    });
  };

  if (estimated === null && source.estimate && !plannedAll) {
    const e = await Promise.resolve(source.estimate(planCtx())).catch(() => null);
    if (typeof e === 'number' && Number.isFinite(e) && e >= 0) {
      estimated = Math.round(e);
      await store.setEstimate(run.runId, step.name, estimated);
    }
  }
  progress();

  // Planning is single-flight here, and single-writer per step across workers (Store.planWindow:
  // step row lock and compare-and-set). It stays one window ahead of the claims, on a pool
  // connection of its own, so the next window is planned while this one's chunks run; adaptive
  // sizing must see a window's durations first, so then it plans only when the planned chunks are
  // used up.
  const adaptive = !!throttle.options.targetChunkMs;
  let durations: number[] = [];
  let planning: Promise<void> | undefined;
  const planNext = async (): Promise<void> => {
    if (adaptive) {
      throttle.adapt(durations);
      durations = [];
    }
    // A source that reads the database (keyRange, a custom source's query) may meet a transient
    // error, the ones a chunk is retried for (a dropped connection, 40001, 40P01, a lock_timeout
    // while another session locks its table, …): it is asked for the same window again, after the
    // step's backoff, as often as a chunk is tried (the step's `retry`). Nothing is held meanwhile:
    // the window is written (Store.planWindow: step row lock, compare-and-set) only once the source
    // answered, so a retry never plans a window twice, and another worker may plan on meanwhile.
    // Until 2026-12-04 the runner's bookkeeping retry did it, with the default budget, silently,
    // and the step then failed "after 1 try" with nothing saying it was the planning. A source that
    // fails for good fails the step it belongs to, not "(runner)".
    let tries = 0;
    const onRetry = (err: unknown, n: number, delayMs: number) => log.warn({ tries: n, delayMs, err: errorFields(err) }, 'transient error, retrying planning');
    const page: ChunkPage = await retrying(async () => (tries++, source(cursor, planCtx())), retry, onRetry, opts.stop).catch((err: unknown) => {
      if (err instanceof ChunkFailure || err instanceof FencedError) throw err;
      // Stopped (a signal, an operator's pause) while the planning was backing off: the worker stops as that stop does.
      if (opts.stop.aborted && isRetryable(err)) throw opts.stop.reason instanceof Error ? opts.stop.reason : err;
      throw new ChunkFailure(step.name, null, tries, err, isRetryable(err) || isStatementTimeout(err));
    });
    checkPage(step.name, page);
    if (page.chunks.length === 0 && page.next !== null && JSON.stringify(page.next) === JSON.stringify(cursor)) {
      // It would be asked for the same window again, forever.
      throw new ChunkFailure(
        step.name,
        null,
        1,
        new Error(`chunk source returned no chunks and the cursor it was given (${JSON.stringify(cursor)}) as next; return next: null when the step is done, or a cursor past the window it looked at`),
      );
    }
    // What the database refuses to store of a page (checkPage catches what it can say better) is
    // the step's too; a lost connection, after planWindow's own retries, stays the runner's, and so
    // does a wait for the step row cut short by a timeout past planWindow's own bound (the runner
    // leaves the run interrupted, exit 2). Until 2026-12-04 its first cut failed the run (exit 1).
    // A stop (a signal, an operator's pause) ends that wait at its next cut: the stop's reason is
    // thrown, and this worker stops as that stop does.
    const onWait = (err: unknown, tries: number) => {
      if (tries === 1) log.warn({ err: errorFields(err) }, `planning a window waited on a lock past the ${codeOf(err) === '57014' ? 'statement_timeout' : 'lock_timeout'} (another worker or session holds the step row): sent again until it gets it`);
    };
    const result = await store.planWindow(run.runId, run.attempt, step.name, nextSeq - 1, page.chunks, page.next, onWait, opts.stop).catch((err: unknown) => {
      throw isRetryable(err) || lockWaitCutShort(err) || err === opts.stop.reason ? err : new ChunkFailure(step.name, null, 1, err);
    });
    if (result.kind === 'fenced') throw new FencedError(`attempt ${run.attempt} of job "${run.job}" was taken over by a newer attempt while planning`);
    if (result.kind === 'duplicate') {
      throw new ChunkFailure(step.name, null, 1, new Error(`chunk source returned key ${JSON.stringify(result.key)}, which is already planned as chunk ${result.seq} of the step; chunk keys must be unique and stable`));
    }
    if (result.kind === 'moved') {
      // Another worker planned past us meanwhile: nothing was written; go on from where the step is.
      ({ cursor, planned_all: plannedAll } = result.step);
      nextSeq = result.step.planned + 1;
      return;
    }
    nextSeq += page.chunks.length;
    // As it is stored, which is what a resumed run reads back: a Date as its ISO string, an
    // undefined field gone. Until 2026-12-04 the same process kept the object itself, so a source
    // that used it as one (cursor.getUTCDate()) broke only when the run resumed.
    cursor = page.next === null ? null : (JSON.parse(JSON.stringify(page.next)) as Json);
    plannedAll = page.next === null;
    log.debug({ planned: page.chunks.length, exhausted: plannedAll, sizeFactor: throttle.sizeFactor }, 'planned a window');
  };
  const plan = (): Promise<void> => (planning ??= planNext().finally(() => (planning = undefined)));

  let failure: unknown;
  /** Chunks waiting out a retry's backoff in one slot: the other slots pass them by. */
  const cooling = new Set<number>();
  /**
   * Chunks a slot here claimed and started, until that slot is done with them: committed, retry
   * counted, or (failed for good) skipped or the run failed. A claim here that gets one of them
   * again (its transaction ended without a commit, a COMMIT that failed lets the row go before the
   * slot could hold it back) starts nothing, and waits for that slot instead.
   */
  const owned = new Map<number, Owned>();
  const own = (seq: number) => {
    const entry = new Owned();
    owned.set(seq, entry);
    return entry;
  };
  const disown = (seq: number) => {
    owned.get(seq)?.settle();
    owned.delete(seq);
  };
  const tries = new Map<number, number>();

  let highestClaimed = 0;
  /** Called once a chunk is claimed, before its work: may it start? Also plans one window ahead. */
  const onClaimed = (chunk: PendingChunk): boolean => {
    highestClaimed = Math.max(highestClaimed, chunk.seq);
    if (!adaptive && !plannedAll && nextSeq - 1 - chunk.seq < planWindow) plan().catch((err: unknown) => void (failure ??= err));
    // A claim that waited for another transaction may get its chunk after this run failed or
    // was asked to stop: then it starts no work, and the claim rolls back.
    return failure === undefined && !opts.stop.aborted;
  };
  /** The claim almost every chunk sends: the first free chunk, none cooling off. */
  const nextClaim = store.claimSql('next', run.runId, run.attempt, step.name, []);
  /**
   * Asked just before a chunk's COMMIT (first pass only): the claim to send with it, when the slot
   * would send exactly that claim at once afterwards (nothing to wait for: no throttle, health fresh
   * and good, no chunk cooling off, no stop or failure). Saves a round trip a chunk.
   */
  const pipelined = !!step.chunks && !throttle.options.maxRate && !throttle.options.pauseMs;
  const claimWithCommit = (): NextClaim | undefined =>
    pipelined && failure === undefined && !opts.stop.aborted && !opts.abort.aborted && cooling.size === 0 && (health?.ready() ?? true)
      ? { claim: nextClaim, plannedBefore: plannedAll }
      : undefined;
  /**
   * A slot that the database refuses a connection (for itself or for its bookkeeping), past the
   * retries, because it has none free (max_connections or the role's CONNECTION LIMIT reached:
   * 53300; a server starting: 57P03): while other slots go on, it ends quietly and they finish the
   * step with fewer. The last slot does not: its error ends this worker (not the run, Runner).
   * A chunk it was about to retry or skip may be one the others' last claims passed by: the step
   * is checked complete once every slot has ended, and the slots start again when it is not.
   */
  /** The error the last slot that left for want of a connection met (see the slots' rounds below). */
  let leftFor: unknown;
  const leavesForOthers = (err: unknown): boolean => {
    if (!noConnectionFree(err) || slotsLive <= 1 || failure !== undefined || opts.stop.aborted) return false;
    leftFor = err;
    log.warn({ err: errorFields(err), slotsLeft: slotsLive - 1 }, `a slot could not get a database connection (${messageOf(err)}); the step goes on with ${slotsLive - 1} ${slotsLive - 1 === 1 ? 'slot' : 'slots'}`);
    return true;
  };
  /**
   * One worker slot: its own connection for its whole life, claiming one chunk after another until
   * none is left. First pass: claim the first free chunk, passing by those other transactions hold
   * (other slots, other workers). When everything is planned and nothing is free, the last pass
   * claims waiting: chunks another worker holds, or left behind when it died, are taken as soon as
   * its transaction ends. A slot that finds nothing even then is done.
   */
  const runSlot = async (): Promise<void> => {
    slotsLive++;
    const slot = openChunkSlot(opts.pool, store.claimPrepares, checksFirst, opts.abort);
    /** The chunk this slot started last (see `owned`). */
    let mine: { readonly seq: number; readonly entry: Owned } | undefined;
    try {
      let retrySeq: number | null = null;
      let lastPass = false;
      let claimErrors = 0;
      /** A claim that was not expected to find a chunk found one under --max-rate: it was let go, and the next claim reserves its start first. */
      let regate = false;
      /** The next claim's answer when it came with the last COMMIT (its transaction is open), and whether all was planned when it was sent. */
      let claimed: ClaimedWithCommit | undefined;
      /** Whether the health gate and the throttle came before this iteration's claim. */
      let gated = false;
      // Made once per slot, not per chunk: tryChunk asks them about the chunk it claimed.
      /** This slot's wait claim is counted in slotsWaiting. */
      let waiting = false;
      const setWaiting = (now: boolean) => {
        if (now === waiting) return;
        waiting = now;
        slotsWaiting += now ? 1 : -1;
        progress();
      };
      const mayStart = (chunk: PendingChunk): boolean | 'later' | 'busy' => {
        // The wait is over: this slot has a chunk.
        setWaiting(false);
        if (owned.has(chunk.seq)) return 'busy';
        const may = !gated && throttle.options.maxRate ? 'later' : onClaimed(chunk);
        if (may === true) mine = { seq: chunk.seq, entry: own(chunk.seq) };
        return may;
      };
      const nextWithCommit = () => (lastPass ? undefined : claimWithCommit());
      for (;;) {
        // Fail fast and stop gracefully: a slot starts no chunk once either happened.
        if (failure !== undefined || opts.stop.aborted) return;
        // The health gate and the throttle come before a claim that should find a chunk (a retry,
        // or planned chunks beyond those this process claimed), not before one that finds nothing.
        gated = !claimed && (regate || retrySeq !== null || (!lastPass && highestClaimed < nextSeq - 1));
        regate = false;
        if (gated) {
          await health?.wait(opts.stop);
          // --max-rate is the run's: the start is reserved on the step row, shared by every
          // worker (here without the database only when it cannot be reached).
          const rate = throttle.options.maxRate;
          const wait = rate ? await store.reserveStart(run.runId, run.attempt, step.name, 1000 / rate).catch(() => throttle.reserveStart()) : 0;
          if (wait > 0) await sleep(wait, opts.stop);
          if (failure !== undefined || opts.stop.aborted) return;
        }

        const mode: ClaimMode = claimed ? 'next' : retrySeq !== null ? 'retry' : lastPass ? 'wait' : 'next';
        // A claim sent while a window was being planned may miss it: only a claim sent after
        // everything was planned may end the first pass.
        const plannedBefore = claimed ? claimed.plannedBefore : plannedAll;
        const claim = claimed ? claimed.rows : mode === 'next' && cooling.size === 0 ? nextClaim : store.claimSql(mode, run.runId, run.attempt, step.name, retrySeq !== null ? [retrySeq] : [...cooling]);
        claimed = undefined;
        let outcome: ChunkTry;
        try {
          // Not in the last pass: its claims wait for chunks other transactions hold, where the
          // claim sent with a COMMIT passes them by, and finding none there would end the slot.
          // Under --max-rate every start has its reservation: a claim made without one (it was
          // expected to find nothing) lets its chunk go, and the slot claims again after reserving.
          setWaiting(mode === 'wait');
          outcome = await tryChunk(opts, step, slot, claim, log, mayStart, nextWithCommit, retryDelays, mode === 'wait' ? opts.stop : undefined);
          setWaiting(false);
          claimErrors = 0;
        } catch (err) {
          setWaiting(false);
          // A waiting claim cancelled by a first signal (see ChunkSlot.begin): the slot leaves, and
          // the step ends as a stop ends it. Until 2026-12-04 the claim held the worker until the
          // chunk it waited for ended, or the shutdown deadline forced the process out.
          if (mode === 'wait' && opts.stop.aborted && !opts.abort.aborted) return;
          // A waiting claim cut short by the role's statement_timeout or lock_timeout, while the
          // chunk it waits for runs longer in another worker: claim again. Until 2026-12-04 its
          // 57014 (55P03 after the retries) failed the run in step "(runner)".
          if (mode === 'wait' && waitCutShort(err) && !opts.abort.aborted) {
            await sleep(50, opts.stop); // a timeout of a few ms would make it spin
            continue;
          }
          // The claim itself failed (before any work): a dropped connection is tried again.
          if (isRetryable(err) && ++claimErrors < retry.attempts && !opts.abort.aborted) {
            await sleep(backoffDelay(claimErrors, retry), opts.stop);
            continue;
          }
          if (leavesForOthers(err)) return;
          // An immediate stop ends the step by its reason, whatever the claim met on its way out.
          failure ??= opts.abort.aborted ? (opts.abort.reason ?? err) : err;
          return;
        }

        if (outcome.kind === 'abandoned') return;
        if (outcome.kind === 'later') {
          regate = true;
          continue;
        }
        if (outcome.kind === 'backoff') {
          // The last unfinished chunk is backing off after another slot's or worker's transient
          // failure, or this slot's own retry came a hair before the database's end of its backoff:
          // wait it out, then claim again (whoever claims it first tries it). A second at
          // most between looks: the worker that spent its last try may skip it meanwhile. When that
          // is a slot here (its wait claim was sent before the slot passed the chunk by), as long
          // as that slot takes.
          const settled = owned.get(outcome.seq)?.settled;
          if (settled) await settled;
          else await sleep(Math.min(outcome.ms, 1_000), opts.stop);
          continue;
        }
        if (outcome.kind === 'none') {
          if (mode === 'retry') {
            retrySeq = null; // done or taken meanwhile (by another worker): not ours to retry any more
          } else if ((await store.currentAttempt(run.runId)) !== run.attempt) {
            failure ??= new FencedError(`attempt ${run.attempt} of job "${run.job}" was taken over by a newer attempt`);
            return;
          } else if (!plannedAll) {
            await plan().catch((err: unknown) => void (failure ??= err));
          } else if (!plannedBefore) {
            // Planned while this claim was under way: claim again.
          } else if (!lastPass) {
            lastPass = true;
          } else {
            return;
          }
          continue;
        }

        const { chunk } = outcome;
        if (outcome.kind === 'failed') {
          const err = outcome.err;
          if (err instanceof FencedError) {
            failure ??= err;
            disown(chunk.seq);
            return;
          }
          if (opts.abort.aborted) {
            // The chunk ended because the run stopped at once (a second signal, the shutdown
            // deadline, a lost lock): whatever it threw then (the job's own error, a connection
            // the stop cut) is that stop's doing, and the run ends by the stop's reason. Until
            // 2026-12-03 it ended by the chunk's error: a failure in step "(runner)" (exit 1), or
            // exit 0 when the other workers had finished the run meanwhile, after a second SIGTERM.
            failure ??= opts.abort.reason ?? err;
            disown(chunk.seq);
            return;
          }
          let n = (tries.get(chunk.seq) ?? 0) + 1;
          let delay: number | undefined;
          const transient = isRetryable(err);
          {
            // Counted on the chunk, so the budget and the backoff are the run's, not each worker's:
            // the other workers pass the chunk by until its backoff is over (or, once it failed for
            // good, until it is skipped or the run failed). Counted before the claim let the chunk
            // go already, unless its transaction could not be held (its COMMIT failed, or the
            // connection went): then here, on the slot's connection, at once.
            const counted =
              outcome.counted !== undefined
                ? outcome.counted
                : await store.recordRetry(run.runId, run.attempt, step.name, chunk.seq, messageOf(err), retryDelays(), slot.db, !transient).catch(() => undefined);
            if (counted === null) {
              // Done or skipped by another worker meanwhile, or fenced off (the next claim says so).
              tries.delete(chunk.seq);
              retrySeq = null;
              disown(chunk.seq);
              if (err instanceof TransactionEndedError && err.committed) {
                // Done by this slot: a COMMIT the job hid after a `;` committed the chunk's work so
                // far with the marker the claim wrote. The rest of its run() never ran.
                log.warn({ chunk: step.chunks ? chunk.key : null, err: errorFields(err) }, "the job's own COMMIT committed the chunk with what its run() had done by then; nothing after that statement ran");
                executed++;
                done++;
                progress();
              }
              continue;
            }
            if (counted) ({ tries: n, delayMs: delay } = counted);
          }
          tries.set(chunk.seq, n);
          if (transient && n < retry.attempts && !opts.stop.aborted) {
            delay ??= backoffDelay(n, retry);
            log.warn({ chunk: step.chunks ? chunk.key : null, tries: n, delayMs: delay, err: errorFields(err) }, 'transient error, retrying chunk');
            cooling.add(chunk.seq);
            disown(chunk.seq);
            await sleep(delay, opts.stop);
            cooling.delete(chunk.seq);
            retrySeq = chunk.seq;
            continue;
          }
          if (transient && n < retry.attempts) {
            // Stopping (a first signal) as a chunk in flight met a transient error (its connection
            // lost): no new try starts here, and the chunk did not fail for good. The worker stops
            // as the signal says, the run interrupted, not failed; the rerun or another worker
            // tries the chunk again. Until 2026-12-03 such a chunk failed the run (exit 1).
            tries.delete(chunk.seq);
            disown(chunk.seq);
            return;
          }
          tries.delete(chunk.seq);
          // Failed for good. The other slots here pass it by from now on, even should the hold on
          // the chunk (EXHAUSTED_HOLD) run out before it is skipped or the run failed. Its
          // bookkeeping goes over this slot's own connection: from the pool it could wait for a
          // connection that only slots waiting for one themselves (in ctx.effect) could free.
          cooling.add(chunk.seq);
          const settled = () => {
            cooling.delete(chunk.seq);
            disown(chunk.seq);
          };
          await store.recordChunkFailure(run.runId, step.name, chunk.key, n, messageOf(err), slot.db).catch(() => {});
          const failed = new ChunkFailure(step.name, step.chunks ? chunk.key : null, n, err);
          if (maxSkips > 0 && !opts.stop.aborted) {
            const skip = await store.skipChunk(run.runId, run.attempt, step.name, chunk.key, failed.message, maxSkips, slot.db).finally(settled);
            if (skip.kind === 'fenced') {
              failure ??= new FencedError(`attempt ${run.attempt} of job "${run.job}" was fenced off while skipping chunk ${keyLabel(chunk.key)}`);
              return;
            }
            if (skip.kind !== 'over') {
              skipped = skip.skipped;
              if (skip.kind === 'skipped') log.warn({ chunk: chunk.key, tries: n, skipped, maxFailedChunks: maxSkips, err: errorFields(err, failed.message) }, 'chunk failed for good; skipped under the step policy');
              else log.info({ chunk: chunk.key, tries: n, err: errorFields(err, failed.message) }, 'chunk failed again after another slot or worker had settled it');
              retrySeq = null;
              continue;
            }
          }
          failure ??= failed;
          settled();
          return;
        }

        retrySeq = null;
        tries.delete(chunk.seq);
        disown(chunk.seq);
        executed++;
        done++;
        if (adaptive) durations.push(outcome.ms);
        claimed = outcome.next;
        progress();
        if (throttle.options.pauseMs) await sleep(throttle.options.pauseMs, opts.stop);
      }
    } catch (err) {
      // Ends the step once the other slots have stopped (they start nothing more): not at once,
      // with their chunks still in flight while the runner records how the attempt ended.
      if (!leavesForOthers(err)) failure ??= opts.abort.aborted ? (opts.abort.reason ?? err) : err;
    } finally {
      slotsLive--;
      // However the slot ended, no slot here waits for it any more.
      if (mine && owned.get(mine.seq) === mine.entry) disown(mine.seq);
      // A claim that came with the last COMMIT and was never started rolls back.
      await slot.rollback();
      slot.release();
    }
  };

  throwIfStopped(opts.stop);
  // A non-chunked step is one chunk: one slot.
  const slots = step.chunks ? opts.concurrency : 1;
  const refresher = opts.onProgress ? setInterval(refresh, PROGRESS_REFRESH_MS / 4) : undefined;
  refresher?.unref();
  try {
    for (let round = 1; ; round++) {
      await Promise.all(Array.from({ length: slots }, runSlot));
      if (failure !== undefined || opts.stop.aborted || opts.abort.aborted) break;
      // Every slot found nothing more to claim. That is not yet the step done: a slot that left for
      // want of a connection (leavesForOthers) may have had a chunk to retry, or one it failed for
      // good and was skipping, that the others' last claims passed by (it was cooling off when they
      // were sent). Until 2026-12-04 the step and the run were then marked done with it pending, and
      // a rerun said "already succeeded". One query a step; the slots start again for what is left.
      let left: string[];
      try {
        if (await store.stepComplete(run.runId, step.name)) break;
        left = await store.pendingKeys(run.runId, step.name, 6);
      } catch (err) {
        // Past their retries: ends the step as a slot's error would (the planner is awaited first).
        failure = err;
        break;
      }
      const named = left.length === 0 ? 'none pending, but not all of it planned' : `${left.slice(0, 5).map((k) => (step.chunks ? keyLabel(k) : `step "${step.name}"`)).join(', ')}${left.length > 5 ? ', …' : ''}`;
      if (round >= MAX_SLOT_ROUNDS) {
        // Slots that kept leaving for want of a connection: that, not the job, ends this worker (exit
        // 69, the run interrupted, as the last slot's own refusal would); else the step fails naming them.
        failure = leftFor !== undefined ? leftFor : new ChunkFailure(
          step.name,
          step.chunks && left.length === 1 ? left[0]! : null,
          1,
          new Error(`the step is not complete (${named}) after its slots started ${MAX_SLOT_ROUNDS} times and found nothing more to claim; run the same command again to resume`),
        );
        break;
      }
      // Done meanwhile by another worker (or planned by one): the slots look again, which costs a claim each.
      if (left.length > 0) log.warn({ round: round + 1, left }, `every slot ended, but chunks of the step are left (${named}): the slots start again for them`);
    }
  } finally {
    clearInterval(refresher);
    slotsEnded = true;
  }
  await planning?.catch(() => {});
  await refreshing;
  if (failure !== undefined) throw failure;
  // Stopped (a signal, an operator's pause or cancel) once the step's last chunks were in flight:
  // nothing of it is left, so it ends done and the stop takes effect before the next step, or, when
  // this was the last, has nothing left to stop and the run succeeds (README: Operating runs).
  // An immediate stop (a lost lock, a second signal) ends the step as it always did: unfinished.
  if (opts.stop.aborted && (opts.abort.aborted || !(await store.stepComplete(run.runId, step.name).catch(() => false)))) throwIfStopped(opts.abort.aborted ? opts.abort : opts.stop);
  progress(true);
  return executed;
}

/**
 * A chunk a slot here started (see `owned` in executeStep): `settled` resolves once that slot is
 * done with it. The promise is made only when another slot asks to wait, which almost none does.
 */
class Owned {
  #settled: Promise<void> | undefined;
  #resolve: (() => void) | undefined;
  #done = false;
  get settled(): Promise<void> {
    return (this.#settled ??= this.#done ? Promise.resolve() : new Promise<void>((resolve) => (this.#resolve = resolve)));
  }
  settle(): void {
    this.#done = true;
    this.#resolve?.();
  }
}

type ChunkTry =
  | { readonly kind: 'none' }
  | { readonly kind: 'abandoned' }
  /** The chunk is backing off (`ms`), or a slot here is not done with it (`ms` 0). */
  | { readonly kind: 'backoff'; readonly ms: number; readonly seq: number }
  | { readonly kind: 'later' }
  | { readonly kind: 'committed'; readonly chunk: PendingChunk; readonly ms: number; readonly next?: ClaimedWithCommit }
  | { readonly kind: 'failed'; readonly chunk: PendingChunk; readonly err: unknown; readonly counted?: RetryCount | null };

/** 0-rows-claimed is "nothing to claim"; SQLSTATE IF001 is the fence trigger refusing a COMMIT. */
const FENCED_AT_COMMIT = 'IF001';

/** The next chunk's claim, sent with a COMMIT; `plannedBefore`: everything was planned when it was sent. */
interface NextClaim {
  readonly claim: string;
  readonly plannedBefore: boolean;
}

/** A NextClaim's answer: the claimed chunk (none, or one, in a transaction left open). */
interface ClaimedWithCommit {
  readonly rows: PendingChunk[];
  readonly plannedBefore: boolean;
}

/**
 * A waiting claim (the last pass's) cut short while it waited for another worker's chunk: by the
 * role's statement_timeout or lock_timeout, or a cancel request (57014, 55P03). Nothing of a chunk
 * had started; the claim is sent again.
 */
function waitCutShort(err: unknown): boolean {
  const code = codeOf(err);
  return code === '57014' || code === '55P03';
}

/**
 * One try of one chunk, in one transaction on the slot's connection: the claim (which also marks
 * the chunk done, travelling with the BEGIN, or already answered with the last COMMIT), the job's
 * work, COMMIT (where the fence trigger checks that this attempt is still the run's), with the next
 * claim when `next()` gives one. Throws only when the claim itself fails.
 */
async function tryChunk(
  opts: ExecuteOptions,
  step: Step,
  slot: ChunkSlot,
  claim: string | PendingChunk[],
  stepLog: Logger,
  mayStart: (chunk: PendingChunk) => boolean | 'later' | 'busy',
  next: () => NextClaim | undefined,
  retryDelays: () => readonly number[],
  /** Cancels the claim when it aborts (ChunkSlot.begin's `cancelOn`): the last pass's waiting claim. */
  cancelClaimOn?: AbortSignal,
): Promise<ChunkTry> {
  const { store, run } = opts;
  const started = performance.now();
  let chunk: PendingChunk | undefined;
  let nextClaim: NextClaim | undefined;
  let nextRows: PendingChunk[] | undefined;
  try {
    // BEGIN and the claim, in one message: the claim locks the first free chunk (SKIP LOCKED) and
    // writes its marker; both commit with the work or neither does.
    chunk = (typeof claim === 'string' ? await slot.begin<PendingChunk>(claim, cancelClaimOn) : claim)[0];
    if (!chunk) {
      await slot.commit();
      return { kind: 'none' };
    }
    if (chunk.backoffMs) {
      // A `wait` or `retry` claim found the chunk still backing off from a transient error.
      await slot.rollback();
      return { kind: 'backoff', ms: chunk.backoffMs, seq: chunk.seq };
    }
    const may = mayStart(chunk);
    if (may !== true) {
      await slot.rollback();
      return may === 'busy' ? { kind: 'backoff', ms: 0, seq: chunk.seq } : { kind: may === 'later' ? 'later' : 'abandoned' };
    }
    const claimed = chunk;
    if (faults) await faultPoint('after-claim');
    const ctx = new ChunkContext(opts, step, slot.trx, slot.signal, claimed.key, !step.chunks, stepLog);
    // The job's work, in the same transaction.
    await step.run(ctx, step.chunks ? reviveSpec(claimed.spec) : undefined);
    if (faults) {
      await faultPoint('after-work');
      // The marker was written by the claim; a crash here loses both it and the work.
      await faultPoint('after-marker');
    }
    // A job that honours ctx.signal returns early once it aborts (lost lock, second signal,
    // deadline), with part of its work done: that must not commit as the whole chunk.
    if (opts.abort.aborted) throw opts.abort.reason ?? new InterruptedError('SIGTERM');
    // COMMIT: the fence trigger refuses it (IF001) when this attempt is no longer the run's.
    nextClaim = next();
    if (nextClaim) nextRows = await slot.commitAndBegin<PendingChunk>(nextClaim.claim);
    else await slot.commit();
  } catch (thrown) {
    // With the next claim, an error may be the claim's, after the COMMIT took effect.
    // (A Proxy the job threw may throw from `instanceof`: it is no CommitUnknownError.)
    const unknown = (() => {
      try {
        return thrown instanceof CommitUnknownError;
      } catch {
        return false;
      }
    })();
    // A job's error that quotes DATABASE_URL (a report link, a second client's URL) is recorded in
    // idem.chunks and idem.runs, logged and printed: its password is masked once, here.
    const raw = unknown ? (thrown as CommitUnknownError).cause : thrown;
    const err = readableThrown(raw, (value) => {
      const masked = opts.redact ? opts.redact(value) : value;
      isRetryable(masked);
      codeOf(masked);
      return masked;
    });
    if (chunk && !unknown && !(err instanceof FencedError) && codeOf(err) !== FENCED_AT_COMMIT && !opts.abort.aborted) {
      // The try is counted on the chunk, and a chunk that failed for good (a permanent error, or
      // its last try) is held back from every claim, inside the chunk's own transaction: its work
      // rolls back to the savepoint after the claim, and the count commits before the claim's row
      // lock is let go. No other slot or worker can start a try in between, that the budget does
      // not see, or of a chunk that is being skipped or failing the run. When the transaction is
      // over already (its COMMIT failed, or answered ROLLBACK), in the same message as a ROLLBACK.
      const final = !isRetryable(err);
      const count = (inClaim: boolean) => store.retrySql(run.runId, run.attempt, step.name, chunk!.seq, messageOf(err), retryDelays(), { inClaim, final });
      const counted = await (slot.open ? slot.abandonWith<RetryCount>(count(true)) : slot.rollbackWith<RetryCount>(count(false)))
        .then((rows) => rows[0] ?? null, () => undefined);
      if (counted !== undefined) return { kind: 'failed', chunk, err, counted };
    }
    await slot.rollback();
    if (!chunk) throw thrown;
    if (codeOf(err) === FENCED_AT_COMMIT) {
      // A newer attempt took the run over, or the run ended under this one (another worker
      // sharing it finished or failed it) while this chunk was in flight.
      const now = await store.getRun(run.runId).catch(() => null);
      const why = now && now.attempt === run.attempt ? `stopped: the run had ended ${now.status} meanwhile` : `fenced off by attempt ${now?.attempt ?? -1}`;
      return { kind: 'failed', chunk, err: new FencedError(`attempt ${run.attempt} of job "${run.job}" was ${why}; its chunk ${keyLabel(chunk.key)} rolled back`) };
    }
    // A lost connection may have taken the COMMIT's answer with it, not the COMMIT.
    if ((unknown || isRetryable(err)) && (await store.committedByUs(run.runId, run.attempt, step.name, chunk.seq).catch(() => false))) {
      return { kind: 'committed', chunk, ms: performance.now() - started };
    }
    return { kind: 'failed', chunk, err };
  }
  if (faults) await faultPoint('after-commit');
  const ms = performance.now() - started;
  return { kind: 'committed', chunk, ms, ...(nextClaim && nextRows ? { next: { rows: nextRows, plannedBefore: nextClaim.plannedBefore } } : {}) };
}

/**
 * A chunk's `ctx`: a class instance whose fields are all its own data properties, so that a job's
 * `{ ...ctx, db }`, `Object.create(ctx)` and a Proxy see every one of them. Not an object literal
 * with a `log` getter (made only when asked for): V8 builds such a literal on its slow path, ~1 µs
 * a chunk, where the chunk's child logger made at once costs ~0.2-0.5 µs and this object ~0.05 µs.
 * `effect` is an own arrow function, so that `({ effect }) => effect(…)` works.
 */
class ChunkContext implements StepContext {
  readonly db: StepContext['db'];
  readonly params: unknown;
  readonly signal: AbortSignal;
  readonly run: RunIdentity;
  readonly step: string;
  readonly slot: Date | null;
  readonly log: Logger;
  readonly effect: StepContext['effect'];
  constructor(opts: ExecuteOptions, step: Step, db: StepContext['db'], signal: AbortSignal, key: string, wholeStep: boolean, stepLog: Logger) {
    this.db = db;
    this.params = opts.params;
    this.signal = signal;
    this.run = opts.run;
    this.step = step.name;
    this.slot = opts.slot;
    this.log = wholeStep ? stepLog : stepLog.child({ chunk: key });
    /** Effect names this try used: a name is part of the effect's key, so a second use would get the first's result. */
    let effectNames: Set<string> | undefined;
    this.effect = ((name: string, fn: (key: string) => unknown) => {
      effectNames ??= new Set();
      if (effectNames.has(name)) {
        // Rejected, not thrown: in `Promise.all(users.map(() => ctx.effect(…)))` a throw inside
        // map() would leave the first call's promise unheld, and its rejection unhandled.
        const where = wholeStep ? `step "${step.name}"` : `chunk ${keyLabel(key)}`;
        return Promise.reject(
          new TypeError(
            `ctx.effect(): name ${JSON.stringify(name)} was already used in ${where}; an effect's name must be unique within its chunk (it is part of the effect's idempotency key, and a second call would be answered by the first's result): add what tells the calls apart, e.g. \`email:\${user.id}\``,
          ),
        );
      }
      effectNames.add(name);
      return performEffect(opts, step.name, key, name, fn);
    }) as StepContext['effect'];
  }
}

/** The effects ledger protocol: claim the record, skip if done, else perform with the stable key and record the result. */
async function performEffect<T>(opts: ExecuteOptions, step: string, chunk: string, name: string, fn: (key: string) => Promise<T> | T): Promise<T> {
  if (typeof name !== 'string' || !EFFECT_NAME.test(name)) throw new TypeError(`ctx.effect(): name must be 1-200 characters of letters, digits, _ . : - (got ${JSON.stringify(name)})`);
  if (typeof fn !== 'function') throw new TypeError('ctx.effect(): fn must be a function (idempotencyKey) => result');
  const { run, store } = opts;
  const key = `idem-${createHash('sha256').update([store.schema, run.job, run.runKey, step, chunk, name].join('\0')).digest('hex').slice(0, 40)}`;
  const record = await store.beginEffect(run.runId, run.attempt, step, chunk, name, key);
  if (!record) throw new FencedError(`attempt ${run.attempt} of job "${run.job}" was fenced off; effect "${name}" of chunk ${keyLabel(chunk)} was not started`);
  if (record.status === 'done') return record.result as T;
  // A run that lost its lock (or must stop at once) starts no new effect.
  if (opts.abort.aborted) throw opts.abort.reason ?? new FencedError(`attempt ${run.attempt} of job "${run.job}" stopped before effect "${name}"`);
  const result = await fn(key);
  const unrecordable = notJson(result);
  if (unrecordable) {
    // The call happened; unrecorded, the effect counts as started, and a retry performs it again
    // with the same key (as after a crash mid-call), so the receiver's dedupe still holds.
    throw new TypeError(
      `ctx.effect(): the result of effect "${name}" cannot be recorded as JSON (${unrecordable}); return plain JSON from fn (a BigInt as a string or number, no U+0000 in strings). Its call was made: the retry makes it again with the same idempotency key`,
    );
  }
  await store.completeEffect(run.runId, step, chunk, name, (result ?? null) as Json);
  return result;
}

/** Why a value cannot be stored as jsonb (a BigInt anywhere, U+0000 in a string or key), or null. */
function notJson(value: unknown): string | null {
  let why: string | null = null;
  try {
    JSON.stringify(value, (k, v: unknown) => {
      if (why === null && (k.includes('\u0000') || (typeof v === 'string' && v.includes('\u0000')))) why = 'U+0000 in a string';
      return v;
    });
  } catch (err) {
    return typeof (err as Error).message === 'string' && /BigInt/i.test((err as Error).message) ? 'a BigInt' : messageOf(err);
  }
  return why;
}
/**
 * Longest chunk key, in bytes of UTF-8. The chunk's primary key (run_id, step, key) and the effects
 * ledger's (run_id, step, chunk, name: step <= 100, name <= 200 characters) are btree indexes, whose
 * entries hold at most 2704 bytes, compressed or not: 2000 always fits, with the other columns.
 */
const MAX_CHUNK_KEY_BYTES = 2000;

function checkPage(step: string, page: ChunkPage): void {
  if (!page || !Array.isArray(page.chunks) || (page.next === undefined)) {
    throw new ChunkFailure(step, null, 1, new TypeError('a chunk source must return { chunks: ChunkSpec[], next: cursor | null }'));
  }
  const seen = new Set<string>();
  for (const c of page.chunks as ChunkSpec[]) {
    if (!c || typeof c.key !== 'string' || c.key === '') throw new ChunkFailure(step, null, 1, new TypeError('every chunk needs a non-empty string key'));
    const bytes = Buffer.byteLength(c.key, 'utf8');
    if (bytes > MAX_CHUNK_KEY_BYTES) {
      const head = c.key.slice(0, /[\uD800-\uDBFF]/.test(c.key[39] ?? '') ? 39 : 40);
      throw new ChunkFailure(
        step,
        null,
        1,
        new TypeError(`chunk ${keyLabel(head)}… (${bytes} bytes): a chunk key is at most ${MAX_CHUNK_KEY_BYTES} bytes of UTF-8 (the chunk index holds no longer one); key the chunk by something shorter, e.g. its range or a hash of its content`),
      );
    }
    if (seen.has(c.key)) throw new ChunkFailure(step, null, 1, new Error(`chunk source returned key ${JSON.stringify(c.key)} twice in one window; keys must be unique`));
    seen.add(c.key);
    const problem = unstorable(c, []);
    if (problem) throw new ChunkFailure(step, null, 1, new TypeError(`chunk ${keyLabel(c.key)}: ${problem}`));
  }
  const problem = unstorable(page.next, []);
  if (problem) throw new ChunkFailure(step, null, 1, new TypeError(`a chunk source's cursor (next): ${problem}`));
}

/**
 * What in a chunk spec PostgreSQL cannot store as jsonb (or its key as text), said as what to fix:
 * a BigInt (JSON has none), NaN or ±Infinity (JSON.stringify would make them null, silently), the
 * character U+0000 (neither text nor jsonb holds it), a lone surrogate (jsonb refuses it), or
 * anything else JSON.stringify refuses (a cycle). Null when it can be stored.
 */
function unstorable(value: unknown, at: readonly string[]): string | null {
  const where = () => (at.length > 0 ? ` (at ${at.join('.')})` : '');
  if (typeof value === 'bigint') return `chunk specs must be JSON: a BigInt${where()} cannot be stored; convert it to a string or number`;
  if (typeof value === 'number') return Number.isFinite(value) ? null : `chunk specs must be JSON: ${value}${where()} has no JSON form and would be stored as null; use a number or a string`;
  if (typeof value === 'string') {
    if (value.includes('\u0000')) return `chunk specs cannot hold the character U+0000${where()}, which PostgreSQL cannot store in text or jsonb; remove or replace it`;
    return LONE_SURROGATE.test(value) ? `chunk specs cannot hold a lone surrogate${where()}, which is not well-formed Unicode and PostgreSQL cannot store as JSON; remove or replace it` : null;
  }
  if (value === null || typeof value !== 'object') return null;
  if (at.length > 64) return null; // JSON.stringify below says what a cycle is
  if (Array.isArray(value) || Object.getPrototypeOf(value) === Object.prototype || Object.getPrototypeOf(value) === null) {
    for (const [k, v] of Object.entries(value)) {
      if (k.includes('\u0000') || LONE_SURROGATE.test(k)) return unstorable(k, [...at, JSON.stringify(k)]);
      const found = unstorable(v, [...at, k]);
      if (found) return found;
    }
    if (at.length > 0) return null;
  }
  if (at.length > 0) return null;
  try {
    JSON.stringify(value);
    return null;
  } catch (err) {
    return `chunk specs must be JSON: ${messageOf(err)}`;
  }
}

function throwIfStopped(stop: AbortSignal): void {
  if (stop.aborted) throw stop.reason instanceof Error ? stop.reason : new InterruptedError('SIGINT');
}
