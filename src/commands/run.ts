import type { Command } from 'commander';
import { checkRunKey, collectParam, parseParams, positiveInt, waitSeconds } from '../cli-parsers.ts';
import { databaseUrl, installSignals, noDatabaseYet, openRunner, storedRunFingerprint, type CliContext } from '../cli-session.ts';
import { describeOutcome, runErrorObject } from '../describe-outcome.ts';
import type { RunOutcome } from '../runner.ts';
import { CancelledError, ExitCode, UsageError } from '../errors.ts';
import { fingerprint } from '../fingerprint.ts';
import { healthSetting, withHealthFlags, type HealthFlags } from './health-flags.ts';
import { throttleSetting, withThrottleFlags, type ThrottleFlags } from './throttle-flags.ts';
import { createProgressReporter } from '../progress-reporter.ts';
import { shellQuote } from '../shell-quote.ts';
import { testHookMs } from '../test-hooks.ts';

interface RunFlags extends HealthFlags, ThrottleFlags {
  key?: string;
  params?: string;
  param: Record<string, unknown>;
  concurrency: number;
  wait?: number | boolean;
  join?: boolean;
  dryRun?: boolean;
  retrySkipped?: boolean;
  json?: boolean;
  progress: boolean;
  catchUp?: string;
  allowChangedCode?: boolean;
}

/** `idem run <job>`: run a job, or find it done; resumes at the first unfinished chunk. */
export function registerRunCommand(program: Command, cli: CliContext): void {
  withThrottleFlags(withHealthFlags(program.command('run')))
    .description('run a job (or find it done): resumes at the first unfinished chunk')
    .argument('<job>', 'job name, as defined in a file in the jobs folder')
    .option('--key <key>', 'run key (idempotency key); default: the params fingerprint')
    .option('--params <json>', 'params as a JSON object')
    .option('--param <key=value>', 'one param (value parsed as JSON when it parses, else a string); repeatable', collectParam, {})
    .option('--concurrency <n>', 'chunks run at once', positiveInt(64), 1)
    .option('--wait [seconds]', 'if another process runs this job, wait for it (forever, or this many seconds) instead of exiting 75', waitSeconds)
    .option('--join', 'if this run is live in other processes, join them as one more worker (start it when nobody runs it)')
    .option('--dry-run', 'show what would run; write nothing')
    .option('--retry-skipped', "retry chunks skipped under a step's maxFailedChunks policy (also in a succeeded run)")
    .option('--no-progress', 'no live progress line on a terminal')
    .option('--catch-up <N|duration>', 'scheduled jobs: run the missed slots oldest first, the last N or those within a duration (e.g. 3, 12h, 2d)')
    .option('--json', 'print the outcome as JSON on stdout')
    .option('--allow-changed-code', 'resume a run even though its job file (or version) changed since it started; recorded on the run')
    .action((name: string, o: RunFlags) => {
      /** The run key being worked on, for --json's error object (a --catch-up slot's key). */
      let current = o.key;
      /** --catch-up: the slots' outcomes so far, printed with the failed slot's error as one array. */
      const outcomes: Array<RunOutcome | { readonly status: 'cancelled'; readonly job: string; readonly runKey: string }> = [];
      const jsonError = (err: unknown) => (o.catchUp !== undefined ? [...outcomes, runErrorObject(name, current ?? null, err)] : runErrorObject(name, current ?? null, err));
      return cli.runWithSession(
        async (g, log, session, force) => {
          const params = parseParams(o.params, o.param);
          if (o.key !== undefined) checkRunKey(o.key);
          // Loaded when the command runs, not at the top: `idem --help` needs none of them (the job
          // API brings kysely, the schedule croner).
          const { dryRunOutcome, findJob, validateParams, latestSlot, parseCatchUp, parseSchedule, slotKey, slotOfKey, slotsSince, POOL_HEADROOM } = await import('../cli-runtime.ts');
          const job = await findJob(g.jobsDir, name, { migrationsDir: g.migrationsDir });
          // Bad params are refused before any connection: nothing, not even idem's schema, is created.
          // Unless they are exactly what the run with this --key stores (its validator's output, as
          // the resume command a failed run's error prints gives them): that run's, not validated again.
          let valid: unknown;
          let url: string | undefined;
          try {
            valid = await validateParams(job, params);
          } catch (err) {
            if (o.key === undefined || params === undefined) throw err;
            // Asked only where such a run can be: an embedded server is not made (or started) for it
            // when there is none under .idem/ yet, and any trouble reaching the database leaves the
            // params error as the answer.
            if (noDatabaseYet(g)) throw err;
            // A signal while the embedded server starts still ends the command as a signal does.
            url = await databaseUrl(g, log, session).catch((e: unknown) => {
              if (session.startup.signal.aborted) throw e;
              return undefined;
            });
            if (url === undefined || (await storedRunFingerprint(url, g.schema, job.name, o.key)) !== fingerprintOrNull(params)) throw err;
            valid = params;
          }
          // Without --key the run key is the validated params' fingerprint, as the runner derives it:
          // --json's error object names it (null only when the params never validated).
          const defaultKey = fingerprint(valid);
          current = o.key ?? defaultKey;
          const health = await healthSetting(o);
          // A scheduled job run without --key is the run of its most recent due slot: cron firing
          // twice, or late, lands on the same run. --catch-up runs each missed slot as its own run.
          const schedule = job.schedule === undefined ? undefined : parseSchedule(job.schedule);
          if (o.catchUp !== undefined && (!schedule || o.key !== undefined)) {
            throw new UsageError('invalidCatchUp', schedule ? '--catch-up picks run keys from the schedule; drop --key' : `--catch-up needs a scheduled job; "${job.name}" has no schedule`);
          }
          // A --key that is a slot key of the schedule is that slot's run (ctx.slot set), as cron's
          // would be: --catch-up then finds it done. A slot-shaped key off the schedule is refused.
          const keySlot = schedule && o.key !== undefined ? slotOfKey(schedule, job.name, o.key) : null;
          const slots: Array<Date | null> =
            o.catchUp !== undefined ? slotsSince(schedule!, parseCatchUp(o.catchUp)) : [o.key === undefined && schedule ? latestSlot(schedule) : keySlot];
          if (slots.length === 0) {
            process.stdout.write(o.json ? '[]\n' : `no slot of job "${job.name}" falls within --catch-up ${o.catchUp}\n`);
            return ExitCode.Ok;
          }
          // A dry run writes nothing, not even idem's schema: it reads (where the schema is not there yet,
          // every run is new).
          // Where there is no database yet (no DATABASE_URL, no embedded server under .idem/), every
          // run would be new: a dry run says so from the files, as status does, instead of making a
          // server (initdb, ~40 MB) to ask (black-box round 19, B12-5).
          const fromFiles = o.dryRun === true && url === undefined && noDatabaseYet(g);
          const runner = fromFiles ? null : await openRunner(g, log, session, o.concurrency + POOL_HEADROOM, url, undefined, o.dryRun ? 'read' : 'write');
          const signals = installSignals(log, g.shutdownTimeout, force);
          const { throttle = {} } = throttleSetting(o);
          const progressMs = testHookMs('IDEM_PROGRESS_INTERVAL_MS');
          for (const slot of slots) {
            const reporter = o.progress && !o.json && !o.dryRun ? createProgressReporter({ job: job.name, tty: process.stderr.isTTY === true, log, ...(progressMs ? { intervalMs: progressMs } : {}) }) : undefined;
            if (reporter) session.defer(async () => reporter.stop());
            const key = slot ? slotKey(slot) : o.key;
            current = key ?? defaultKey;
            // Stopped (the bar cleared) before anything else is written, also when the run throws:
            // main() writes the error line, and the session's deferred stop runs only after it.
            const running = runner === null ? Promise.resolve(dryRunOutcome(job, key ?? defaultKey)) : runner.run(job, {
              throttle,
              ...(reporter ? { onProgress: reporter.update } : {}),
              params,
              ...(key !== undefined ? { key } : {}),
              slot,
              concurrency: o.concurrency,
              wait: o.wait ?? false,
              join: o.join ?? false,
              dryRun: o.dryRun ?? false,
              retrySkipped: o.retrySkipped ?? false,
              allowChangedCode: o.allowChangedCode ?? false,
              ...health,
              signal: signals.stop,
              abortSignal: signals.abort,
            }).finally(() => reporter?.stop());
            // --catch-up passes over a slot an operator cancelled (before this invocation): that
            // decision was made, and the slots after it are still due.
            const outcome = o.catchUp === undefined ? await running : await running.catch((err: unknown) => {
              if (!(err instanceof CancelledError && err.earlier)) throw err;
              return null;
            });
            if (outcome === null) {
              outcomes.push({ status: 'cancelled', job: job.name, runKey: key! });
              if (!o.json) process.stdout.write(`slot ${key} of job "${job.name}" was cancelled by an operator: passed over (idem reset ${shellQuote(job.name)} --key ${key} lets it run again)\n`);
              continue;
            }
            // The job's code threw meanwhile: that error is the command's outcome, printed already.
            if (session.jobCodeFailed) return ExitCode.Failed;
            outcomes.push(outcome);
            // --catch-up --json: one array at the end (as migrate --json), not a line per slot.
            if (!o.json) process.stdout.write(`${describeOutcome(outcome)}\n`);
            else if (o.catchUp === undefined) process.stdout.write(`${JSON.stringify(outcome)}\n`);
          }
          if (o.json && o.catchUp !== undefined) process.stdout.write(`${JSON.stringify(outcomes)}\n`);
          return ExitCode.Ok;
        },
        ['jobs'],
        // --json is for scripts: an outcome other than success, or input refused, is JSON on stdout too.
        o.json ? jsonError : undefined,
      );
    });
}

/** The params' fingerprint, or null when they have none (not JSON). */
function fingerprintOrNull(params: unknown): string | null {
  try {
    return fingerprint(params);
  } catch {
    return null;
  }
}
