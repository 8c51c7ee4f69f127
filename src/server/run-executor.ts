import { changedCode, CodeChangedError, derivedJob } from '../code-fingerprint.ts';
import { sql } from 'kysely';
import type { Logger } from 'pino';
import { runIsLive } from '../operations.ts';
import { slotOfJobKey } from '../schedule.ts';
import { BusyError, CancelledError, errorFields, InterruptedError, PausedError, PauseWithdrawnError, RunFailedError, type StopSignal } from '../errors.ts';
import type { Job, Json, Step } from '../job.ts';
import type { Runner, RunOutcome } from '../runner.ts';
import type { RunRow, RunStatus } from '../store.ts';
import { codeChangeDetail } from './run-view.ts';
import type { ServerMetrics } from './server-metrics.ts';

export interface RunExecutorOptions {
  readonly runner: Runner;
  readonly jobs: ReadonlyMap<string, Job>;
  readonly log: Logger;
  readonly metrics: ServerMetrics;
  /** Runs executed at once. */
  readonly maxRuns: number;
  /** Chunks run at once within one run. */
  readonly concurrency: number;
  /** How often a live run looks for an operator's pause/cancel, in ms. */
  readonly controlPollMs: number;
  /** Called when an execution finds its run succeeded (just now, or already). */
  readonly onSucceeded?: (runId: string) => void;
}

interface Queued {
  readonly runId: string;
  readonly job: string;
  readonly key: string;
  /** Resume even though the job's code changed since the run's last attempt (an operator's POST …/resume with {"allowChangedCode":true}); recorded on the run. */
  readonly allowChangedCode?: boolean;
}

/**
 * The states in which a run created over HTTP is still to execute: the rescan queues those, and a
 * queued run found in any other has been ended by another process.
 */
const RUNNABLE_STATES = ['pending', 'running', 'interrupted'] as const;
const RUNNABLE = new Set<string>(RUNNABLE_STATES);
/** RUNNABLE_STATES as SQL literals (`'pending', 'running', 'interrupted'`): a list the planner sees, as the partial index on open runs needs. */
const runnableList = sql.join(RUNNABLE_STATES.map((state) => sql.lit(state)));

/** How an execution in this server ended: the `outcome` label of idem_runs_ended_total. */
export const EXECUTION_OUTCOMES = ['succeeded', 'failed', 'paused', 'cancelled', 'interrupted', 'error'] as const;
export type ExecutionOutcome = (typeof EXECUTION_OUTCOMES)[number];

/**
 * The outcome of an execution that threw `err`. `error` is one that ended without an outcome of
 * the run's own: the database unreachable, the lock lost, the run refused before it started.
 */
export function executionOutcome(err: unknown): ExecutionOutcome {
  if (err instanceof PausedError) return 'paused';
  if (err instanceof CancelledError) return 'cancelled';
  if (err instanceof InterruptedError || err instanceof PauseWithdrawnError) return 'interrupted';
  if (err instanceof RunFailedError) return 'failed';
  return 'error';
}

/**
 * A run created moments ago is still `pending` while the server that created it starts it; another
 * server's rescan leaves it alone for this long (then it is orphaned, or queued behind --max-runs,
 * and whoever has room takes it).
 */
export const PENDING_GRACE_S = 10;

/**
 * Executes runs inside the server process: at most `maxRuns` at once, one run per job at a time
 * (runs of one job serialize on its advisory lock anyway, so a second would only hold a slot while
 * waiting). Each execution is a plain `Runner.run` with the run's key and stored params: the same
 * protocol as `idem run`, so a CLI worker and the server can take turns on one run.
 */
export class RunExecutor {
  readonly #o: RunExecutorOptions;
  readonly #queue: Queued[] = [];
  readonly #running = new Map<string, Promise<void>>();
  readonly #busyJobs = new Set<string>();
  readonly #stop = new AbortController();
  readonly #abort = new AbortController();
  /** Runs whose code change was logged (`id from to`): said once, not at every rescan. */
  readonly #codeWarned = new Set<string>();

  constructor(opts: RunExecutorOptions) {
    this.#o = opts;
  }

  /** Queues a run for execution unless it is queued or executing here already. */
  enqueue(run: Queued): void {
    if (this.#stop.signal.aborted || this.#running.has(run.runId)) return;
    const queued = this.#queue.findIndex((q) => q.runId === run.runId);
    if (queued >= 0) {
      // An operator's allowing a code change holds for the run already waiting its turn.
      if (run.allowChangedCode) this.#queue[queued] = run;
      return;
    }
    this.#queue.push(run);
    this.#pump();
  }

  /** Run ids executing in this process now. */
  executing(): ReadonlySet<string> {
    return new Set(this.#running.keys());
  }

  /**
   * At start: every run created over HTTP that has not ended (never started, interrupted by a
   * shutdown, or left `running` by a crashed server) is queued again, oldest first. Failed, paused
   * and cancelled runs wait for an operator.
   */
  async resumeUnfinished(): Promise<number> {
    const { runner } = this.#o;
    const s = runner.schema;
    const { rows } = await sql<{
      id: string;
      job: string;
      run_key: string;
      status: RunStatus;
      lock_name: string | null;
      lock_pid: number | null;
      attempt: number;
      code_fingerprint: string | null;
      params: Json;
    }>`
      select r.id::text as id, r.job, r.run_key, r.status, r.lock_name, r.lock_pid, r.attempt, r.code_fingerprint, r.params from ${sql.id(s, 'runs')} r join ${sql.id(s, 'api_requests')} a on a.run_id = r.id
      where r.status in (${runnableList})
        and (r.status <> 'pending' or r.created_at < now() - make_interval(secs => ${PENDING_GRACE_S}))
      order by r.id`.execute(runner.db);
    // A run another live process executes (a second server, idem run) is theirs: waiting for its
    // lock here would only hold a slot.
    await this.#dropEnded();
    const held = rows.some((r) => r.status === 'running') ? await runner.heldLocks() : { keys: new Set<string>(), byPid: new Set<string>() };
    let n = 0;
    for (const r of rows) {
      if (runIsLive(r, held, runner)) continue;
      if (this.#running.has(r.id) || this.#queue.some((q) => q.runId === r.id)) continue;
      const job = this.#o.jobs.get(r.job);
      if (!job) {
        this.#o.log.warn({ job: r.job, runId: r.id }, 'unfinished run of a job this server does not know; start the server with its --jobs-dir to resume it');
        continue;
      }
      // Its resume would be refused until an operator allows the change (its view says so): said
      // once, then left alone.
      const change = changedCode(r, job);
      if (change) {
        this.#warnCodeChanged({ id: r.id, job: r.job, key: r.run_key, params: r.params }, change);
        continue;
      }
      this.enqueue({ runId: r.id, job: r.job, key: r.run_key });
      n++;
    }
    return n;
  }

  /**
   * Drops from the queue the runs another process ended while they waited their turn here (a
   * second server with room executed them), so that idem_runs_queued counts what is left to do
   * here, not a backlog long gone; they would be skipped at their turn anyway.
   */
  async #dropEnded(): Promise<void> {
    if (this.#queue.length === 0) return;
    const { runner } = this.#o;
    const ids = this.#queue.map((q) => q.runId);
    const { rows } = await sql<{ id: string }>`select id::text as id from ${sql.id(runner.schema, 'runs')}
      where id = any(${ids}::bigint[]) and status not in (${runnableList})`.execute(runner.db);
    if (rows.length === 0) return;
    const ended = new Set(rows.map((r) => r.id));
    for (let i = this.#queue.length - 1; i >= 0; i--) if (ended.has(this.#queue[i]!.runId)) this.#queue.splice(i, 1);
    this.#o.metrics.runsQueued.set(this.#queue.length);
  }

  /** Logs, once per run and change, that the run's code changed and how an operator goes on. */
  #warnCodeChanged(run: { id: string; job: string; key: string; params: Json }, change: { from: string; to: string }): void {
    const seen = `${run.id} ${change.from} ${change.to}`;
    if (this.#codeWarned.has(seen)) return;
    this.#codeWarned.add(seen);
    this.#o.log.warn({ job: run.job, runId: run.id, runKey: run.key, codeChanged: change }, codeChangeDetail({ ...run, viaApi: true }, change));
  }

  #pump(): void {
    this.#o.metrics.runsQueued.set(this.#queue.length);
    while (this.#running.size < this.#o.maxRuns && !this.#stop.signal.aborted) {
      const i = this.#queue.findIndex((q) => !this.#busyJobs.has(q.job));
      if (i < 0) break;
      const next = this.#queue.splice(i, 1)[0]!;
      this.#busyJobs.add(next.job);
      const p = this.#execute(next).then((again) => {
        this.#running.delete(next.runId);
        this.#busyJobs.delete(next.job);
        this.#o.metrics.runsExecuting.set(this.#running.size);
        if (again) this.enqueue(next);
        this.#pump();
      });
      this.#running.set(next.runId, p);
      this.#o.metrics.runsExecuting.set(this.#running.size);
    }
    this.#o.metrics.runsQueued.set(this.#queue.length);
  }

  /** Executes one run; true when it should be queued again at once (a pause withdrawn while it was being honoured). */
  async #execute(q: Queued): Promise<boolean> {
    const { runner, metrics } = this.#o;
    let log = this.#o.log.child({ job: q.job, runId: q.runId });
    const job = instrument(this.#o.jobs.get(q.job)!, metrics);
    let outcome: ExecutionOutcome | null = 'succeeded';
    let again = false;
    let run: RunRow | null = null;
    try {
      run = await runner.store.runById(q.runId);
      if (!run) {
        // Reset (or pruned) while it waited its turn here: nothing to execute, nothing went wrong.
        log.info('run was reset or pruned before it started; nothing to execute');
        outcome = null;
        return false;
      }
      log = log.child({ runKey: run.run_key });
      if (!RUNNABLE.has(run.status)) {
        // Another process (a second server, an `idem run`) took it while it waited its turn here and
        // ended it: that process executed it and counts it; a failed or paused one waits for an
        // operator, as the rescan leaves it. Until 2026-12-04 the server ran it again (finding it
        // done), logged "run executed" and counted the execution as its own (black-box round 19).
        log.info({ status: run.status }, `run ended ${run.status} elsewhere while it waited its turn here; nothing to execute`);
        outcome = null;
        return false;
      }
      const committed = new Map<string, number>();
      const base = {
        params: run.params,
        key: run.run_key,
        slot: slotOf(this.#o.jobs.get(q.job)!, run.run_key),
        concurrency: this.#o.concurrency,
        controlPollMs: this.#o.controlPollMs,
        allowChangedCode: q.allowChangedCode ?? false,
        signal: this.#stop.signal,
        abortSignal: this.#abort.signal,
        onProgress: (p: { step: string; executedNow: number }) => {
          const before = committed.get(p.step) ?? 0;
          if (p.executedNow > before) metrics.chunksCommitted.inc({ job: q.job, step: p.step }, p.executedNow - before);
          committed.set(p.step, p.executedNow);
        },
      };
      // join: `idem run --join` workers share the run with the server, and the server shares
      // theirs: whoever comes second works under the live attempt instead of failing busy.
      let done: RunOutcome;
      try {
        done = await runner.run(job, { ...base, join: true, wait: false });
      } catch (err) {
        if (!(err instanceof BusyError)) throw err;
        // Another run of the job is live elsewhere (its lock is exclusive per run key): wait for
        // it, then this run starts or continues (or is found done).
        metrics.lockWaits.inc({ job: q.job });
        log.info('job locked by another process; waiting for it');
        done = await runner.run(job, { ...base, join: true, wait: true });
      }
      if (done.status === 'already-succeeded') {
        // Finished by another process between the read above (or the wait) and this execution.
        log.info('run succeeded elsewhere while it waited its turn here; nothing to execute');
        outcome = null;
        this.#o.onSucceeded?.(q.runId);
        return false;
      }
      log.info('run executed');
      this.#o.onSucceeded?.(q.runId);
    } catch (err) {
      outcome = executionOutcome(err);
      // The operator resumed the run while it stopped for their pause: it continues here, as a
      // resume of a paused run created over HTTP does.
      again = err instanceof PauseWithdrawnError;
      // A failed run was logged by the runner already (error, with its step, chunk and attempt);
      // this line is the server's account of the execution, an error only for an `error` outcome,
      // which nothing else reports.
      // A resume refused for a code change (the job changed after the run was queued) waits for
      // an operator, as the rescan leaves it: a warning saying how to go on, once.
      const change = err instanceof CodeChangedError && run ? changedCode(run, this.#o.jobs.get(q.job)!) : null;
      if (change && run) this.#warnCodeChanged({ id: q.runId, job: q.job, key: run.run_key, params: run.params }, change);
      else if (outcome === 'error') log.error({ outcome, err: errorFields(err) }, 'run error');
      else log.info({ outcome, err: errorFields(err) }, `run ${outcome}`);
    } finally {
      if (outcome !== null) metrics.runsEnded.inc({ job: q.job, outcome });
    }
    return again;
  }

  /**
   * Immediate stop (a second signal, the shutdown deadline): the job code of every live run is
   * aborted and its statements cancelled (PostgreSQL's cancel request); the runs end `interrupted`,
   * recorded with `signal`. Nothing new starts either.
   */
  abortRuns(signal: StopSignal = 'SIGTERM'): void {
    this.#queue.length = 0;
    if (!this.#stop.signal.aborted) this.#stop.abort(new InterruptedError(signal));
    if (!this.#abort.signal.aborted) this.#abort.abort(new InterruptedError(signal));
  }

  /**
   * Graceful stop: nothing new starts, live runs stop after their in-flight chunks and are
   * recorded `interrupted` (resumed at the next start). After `deadlineMs` the job code is aborted.
   */
  async shutdown(deadlineMs: number, signal: StopSignal = 'SIGTERM'): Promise<void> {
    this.#queue.length = 0;
    // The signal that stopped the server is the one the runs it stops are recorded with.
    if (!this.#stop.signal.aborted) this.#stop.abort(new InterruptedError(signal));
    const timer = setTimeout(() => this.abortRuns(signal), deadlineMs);
    timer.unref();
    await Promise.allSettled([...this.#running.values()]);
    clearTimeout(timer);
  }
}

/**
 * The slot a run's key names (POST checked it against the job's schedule, as `idem run --key`
 * does), so the run executes with ctx.slot set. A key the schedule no longer fires at (the job's
 * schedule changed since) runs with no slot rather than not at all.
 */
function slotOf(job: Job, key: string): Date | null {
  try {
    return slotOfJobKey(job, key);
  } catch {
    return null;
  }
}

/** The job with every step's work timed and its thrown tries counted (metrics only; behaviour unchanged). */
function instrument(job: Job, metrics: ServerMetrics): Job {
  const steps = job.steps.map((step): Step => {
    const labels = { job: job.name, step: step.name };
    const orig = step.run as (...args: unknown[]) => unknown;
    const run = async (...args: unknown[]) => {
      const end = metrics.chunkDuration.startTimer(labels);
      try {
        return await orig.apply(step, args);
      } catch (err) {
        metrics.chunkErrors.inc(labels);
        throw err;
      } finally {
        end();
      }
    };
    return { ...step, run } as Step;
  });
  return derivedJob(Object.freeze({ ...job, steps: Object.freeze(steps) }), job);
}
