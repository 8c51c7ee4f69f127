import { BusyError, RunFailedError, UsageError } from './errors.ts';
import { runIsLive } from './operations.ts';
import { slotOfJobKey } from './schedule.ts';
import { sleep } from './sleep.ts';
import { databaseOutage, outageDelayMs } from './retry.ts';
import { validateParams, type Job, type Json } from './job.ts';
import { keyLabel } from './key-label.ts';
import { alreadyDone, refuseOtherParams, type RunJobOptions, type Runner, type RunOutcome } from './runner.ts';
import type { RunRow } from './store.ts';
import { continueCommand, shellQuote } from './shell-quote.ts';
import { refuseBadRunOptions } from './run-options.ts';

/** Options of {@link finalizeMigration}. */
export interface FinalizeMigrationOptions extends Omit<FinalizeOptions, 'key' | 'params'> {
  /** Called with each migration's outcome as it is known: the outcomes so far when one fails (`idem migrate --finalize` prints them). */
  readonly onOutcome?: (outcome: FinalizeOutcome) => void;
  /** Called as each migration is taken in hand, before its outcome is known (also the failed one that ends it). */
  readonly onMigration?: (migration: { readonly runKey: string; readonly job: Job } | null) => void;
}

/** How finalize got the run to succeeded. */
export type FinalizeHow = 'already-succeeded' | 'waited' | 'ran-inline';

export interface FinalizeOutcome extends RunOutcome {
  readonly how: FinalizeHow;
}

export interface FinalizeOptions extends Pick<RunJobOptions, 'concurrency' | 'signal' | 'abortSignal' | 'onProgress' | 'allowChangedCode' | 'throttle' | 'health'> {
  /** The run's key. */
  readonly key: string;
  /**
   * Params for a run that does not exist yet. An existing run keeps its own: params given that are
   * not its own are refused with a ParamsMismatchError (exit 65), as Runner.run refuses them,
   * before anything is written or waited for. Defaults to `{}` (and, for an existing run, to its own).
   */
  readonly params?: unknown;
  /** How long to wait for a run that is live in another process, in seconds. Defaults to no bound. */
  readonly timeoutSeconds?: number;
}

/**
 * Makes sure a run has succeeded before a deploy goes on (GitLab's
 * `ensure_batched_background_migration_is_finished`): succeeded → returns at once; live in another
 * process → waits for it (bounded by `timeoutSeconds`); unfinished and idle (or never started) →
 * runs the rest here; failed → throws a RunFailedError carrying the recorded error, runs nothing.
 * @example await finalizeRun(runner, job, { key: 'backfill-2026-11', timeoutSeconds: 600 });
 */
export async function finalizeRun(runner: Runner, job: Job, opts: FinalizeOptions): Promise<FinalizeOutcome> {
  refuseBadRunOptions('finalizeRun()', opts ?? null);
  // A key that is a slot of the job's schedule is that slot's run (ctx.slot), as `idem run --key`
  // runs it; a slot-shaped key off the schedule, or not due yet, is refused before anything is read.
  const slot = slotOfJobKey(job, opts.key);
  const deadline = opts.timeoutSeconds === undefined ? Infinity : Date.now() + opts.timeoutSeconds * 1000;
  let waited = false;
  let outages = 0;
  // Polls rather than waiting on the job's lock: whoever takes the lock bumps the attempt and
  // resumes the run, and a run that failed while we waited must be reported, not resumed.
  for (;;) {
    try {
      return await finalizeOnce();
    } catch (err) {
      if (!databaseOutage(err)) throw err;
      // The database went away (stopped, restarting) while finalize waited for the run: the holder
      // went with it, and the run is left to take over once the server is back. Tried again until
      // the --timeout; out of reach then, or before there was anything to wait for, said as an
      // unreachable database is (exit 2), never pg's bare error (exit 1: "the run failed").
      if (!waited || Date.now() >= deadline) throw runner.unreachable(err);
      await sleep(outageDelayMs(outages++, deadline), opts.signal);
      if (opts.signal?.aborted) throw opts.signal.reason;
    }
  }

  /** Looks at the run until it has an outcome: waits for it while it is live elsewhere, else runs the rest here. */
  async function finalizeOnce(): Promise<FinalizeOutcome> {
    for (;;) {
      const existing = await runner.store.findRun(job.name, opts.key);
      // Other params under this key are refused first, as `idem run` refuses them: not waited for,
      // nor answered "already succeeded", nor the rest run with the run's own params instead.
      if (existing && opts.params !== undefined) await refuseOtherParams(job, existing, opts.params);
      if (existing?.status === 'failed') throw recordedFailure(existing);
      if (existing && (await isLive(runner, existing))) {
        if (Date.now() >= deadline) throw timedOut(opts.timeoutSeconds!, `run ${opts.key} of job "${job.name}"`);
        waited = true;
        await sleep(Math.min(POLL_MS, deadline - Date.now()), opts.signal);
        if (opts.signal?.aborted) throw opts.signal.reason;
        continue;
      }
      const params = existing ? existing.params : ((await validateParams(job, opts.params ?? {})) as Json);
      try {
        const outcome = await runner.run(job, { params, key: opts.key, slot, wait: false, resumeFailed: false, ...pick(opts) });
        return { ...outcome, how: how(outcome, waited) };
      } catch (err) {
        // Someone else took it between our look and our try: wait for them like any live run.
        if (!(err instanceof BusyError)) throw err;
        if (Date.now() >= deadline) throw timedOut(opts.timeoutSeconds!, `run ${opts.key} of job "${job.name}"`);
        waited = true;
      }
    }
  }
}

/** How often finalize looks again at a run live elsewhere. */
const POLL_MS = 250;

function timedOut(timeoutSeconds: number, what: string): BusyError {
  return new BusyError(`${what} is still running in another process after --timeout ${timeoutSeconds}s; raise --timeout, or finalize again later`);
}

/**
 * `idem migrate --finalize <name>`: the named migration (file id or job name) and every one before
 * it must have succeeded; runs them here under the migrate lock when nobody else does. A failed one
 * is not retried: its recorded error is thrown.
 */
export async function finalizeMigration(
  runner: Runner,
  migrations: ReadonlyArray<{ readonly runKey: string; readonly job: Job }>,
  name: string,
  opts: FinalizeMigrationOptions = {},
): Promise<FinalizeOutcome[]> {
  refuseBadRunOptions('finalizeMigration()', opts);
  const index = migrations.findIndex((m) => m.runKey === name || m.job.name === name);
  if (index < 0) {
    const known = migrations.map((m) => m.runKey).join(', ') || 'none';
    throw new UsageError('unknownMigration', `unknown migration "${name}" (known: ${known}); pass a file name without its extension, or the migration's job name`);
  }
  const wanted = migrations.slice(0, index + 1);
  const live = new Set<string>();
  const done: RunRow[] = [];
  for (const m of wanted) {
    const run = await runner.store.findRun(m.job.name, m.runKey);
    if (run?.status === 'failed') {
      // Those found done before it are outcomes too: what the deploy can tell went through.
      // The caller's callbacks, as Runner.migrate calls them: what they throw is logged, not thrown instead of the failure.
      const onOutcome = opts.onOutcome && runner.callerCallback('onOutcome', opts.onOutcome);
      for (const d of done) onOutcome?.({ ...alreadyDone(d), how: 'already-succeeded' });
      if (opts.onMigration) runner.callerCallback('onMigration', opts.onMigration)(m);
      throw recordedFailure(run);
    }
    if (run?.status === 'succeeded') done.push(run);
    if (run && (await isLive(runner, run))) live.add(m.runKey);
  }
  const withHow = (o: RunOutcome): FinalizeOutcome => ({ ...o, how: how(o, live.has(o.runKey)) });
  const outcomes = await bounded(opts.timeoutSeconds, `migration ${name}`, () =>
    runner.migrate(wanted, {
      wait: opts.timeoutSeconds ?? true,
      resumeFailed: false,
      ...pick(opts),
      ...(opts.onOutcome ? { onOutcome: (o: RunOutcome) => opts.onOutcome!(withHow(o)) } : {}),
      ...(opts.onMigration ? { onMigration: opts.onMigration } : {}),
    }),
  );
  return outcomes.map(withHow);
}

/** The error a failed run recorded, as the one-line refusal finalize ends with (exit 1). */
export function recordedFailure(run: Pick<RunRow, 'job' | 'run_key' | 'error' | 'params' | 'kind'>): RunFailedError {
  const e = run.error;
  const where = e ? (e.chunk === null ? ` in step "${e.step}"` : ` in step "${e.step}", chunk ${keyLabel(e.chunk)}`) : '';
  const tries = e ? ` after ${e.tries} ${e.tries === 1 ? 'try' : 'tries'}` : '';
  // A command that resumes it as it is: a job's run with its params (see continueCommand).
  const resume = run.kind === 'migration' ? 'idem migrate' : continueCommand(run.job, run.run_key, run.params, `<its params: idem status ${shellQuote(run.job)} --key ${shellQuote(run.run_key)} --json>`);
  return new RunFailedError(`run ${run.run_key} of job "${run.job}" failed${where}${tries}: ${e?.message ?? 'no error recorded'}; fix the cause, resume it (${resume}; with --allow-changed-code if the fix changes the code of the job), then finalize again`);
}

/** Whether the backend that took the run's lock (its job's, or migrate's) still holds it. */
async function isLive(runner: Runner, run: RunRow): Promise<boolean> {
  if (run.status !== 'running') return false;
  return runIsLive(run, await runner.heldLocks(), { jobLockName: (j) => runner.jobLockName(j), runLockName: (id) => runner.runLockName(id) });
}

function how(outcome: RunOutcome, wasLive: boolean): FinalizeHow {
  if (outcome.status === 'succeeded') return 'ran-inline';
  return wasLive ? 'waited' : 'already-succeeded';
}

/** A wait that ran out names the flag that bounds it. */
async function bounded<T>(timeoutSeconds: number | undefined, what: string, fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (err) {
    if (err instanceof BusyError && timeoutSeconds !== undefined) throw timedOut(timeoutSeconds, what);
    throw err;
  }
}

function pick(opts: Omit<FinalizeOptions, 'key'>): Partial<RunJobOptions> {
  return {
    ...(opts.concurrency !== undefined ? { concurrency: opts.concurrency } : {}),
    ...(opts.signal ? { signal: opts.signal } : {}),
    ...(opts.abortSignal ? { abortSignal: opts.abortSignal } : {}),
    ...(opts.onProgress ? { onProgress: opts.onProgress } : {}),
    ...(opts.allowChangedCode !== undefined ? { allowChangedCode: opts.allowChangedCode } : {}),
    ...(opts.throttle ? { throttle: opts.throttle } : {}),
    ...(opts.health !== undefined ? { health: opts.health } : {}),
  };
}
