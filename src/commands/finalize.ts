import type { Command } from 'commander';
import { collectParam, existingKey, nonNegativeNumber, parseParams, positiveInt } from '../cli-parsers.ts';
import { installSignals, openRunner, type CliContext } from '../cli-session.ts';
import { describeOutcome, runErrorObject } from '../describe-outcome.ts';
import { ExitCode } from '../errors.ts';
import type { FinalizeOutcome } from '../finalize.ts';
import { healthSetting, withHealthFlags, type HealthFlags } from './health-flags.ts';
import { throttleSetting, withThrottleFlags, type ThrottleFlags } from './throttle-flags.ts';

export function describeFinalize(o: FinalizeOutcome): string {
  const how = o.how === 'waited' ? 'finished by another process while finalize waited' : o.how === 'ran-inline' ? 'the rest ran here' : 'had already succeeded';
  return `finalize: ${how}; ${describeOutcome(o)}`;
}

interface FinalizeFlags extends HealthFlags, ThrottleFlags {
  key: string;
  timeout?: number;
  params?: string;
  param: Record<string, unknown>;
  concurrency: number;
  allowChangedCode?: boolean;
  json?: boolean;
}

/** `idem finalize <job> --key K`: for deploys, make sure a run succeeded (wait for it, or finish it here). */
export function registerFinalizeCommand(program: Command, cli: CliContext): void {
  withThrottleFlags(withHealthFlags(program.command('finalize')))
    .description('deploys: make sure a run succeeded: done → exit 0, running elsewhere → wait, unfinished and idle → run the rest here, failed → exit 1')
    .argument('<job>', 'job name')
    .requiredOption('--key <key>', "the run's key", existingKey)
    .option('--timeout <seconds>', 'how long to wait for the run when another process runs it (default: no bound)', nonNegativeNumber)
    .option('--params <json>', 'params for a run that does not exist yet; an existing run keeps its own, and other params given for it are refused (exit 65)')
    .option('--param <key=value>', 'one param, as for idem run; repeatable', collectParam, {})
    .option('--concurrency <n>', 'chunks run at once when the rest runs here', positiveInt(64), 1)
    .option('--allow-changed-code', 'resume even though the job file (or version) changed since the run started')
    .option('--json', 'print the outcome as JSON on stdout')
    .action((name: string, o: FinalizeFlags) =>
      cli.runWithSession(async (g, log, session, force) => {
        const params = parseParams(o.params, o.param);
        // Given (--params or --param): an existing run refuses them unless they are its own.
        const given = o.params !== undefined || Object.keys(o.param).length > 0;
        const { findJob, slotOfJobKey } = await import('../cli-runtime.ts');
        const job = await findJob(g.jobsDir, name, { migrationsDir: g.migrationsDir });
        // finalizeRun refuses a slot-shaped key off the job's schedule too; here that is before
        // any connection, so the refusal creates nothing, not even idem's schema.
        slotOfJobKey(job, o.key);
        const health = await healthSetting(o);
        const { finalizeRun, POOL_HEADROOM } = await import('../cli-runtime.ts');
        const runner = await openRunner(g, log, session, o.concurrency + POOL_HEADROOM);
        const signals = installSignals(log, g.shutdownTimeout, force);
        const outcome = await finalizeRun(runner, job, {
          key: o.key,
          ...(given ? { params } : {}),
          concurrency: o.concurrency,
          ...(o.timeout !== undefined ? { timeoutSeconds: o.timeout } : {}),
          allowChangedCode: o.allowChangedCode ?? false,
          ...health,
          ...throttleSetting(o),
          signal: signals.stop,
          abortSignal: signals.abort,
        });
        // The job's code threw meanwhile: that error is the command's outcome, printed already.
        if (session.jobCodeFailed) return ExitCode.Failed;
        process.stdout.write(o.json ? `${JSON.stringify(outcome)}\n` : `${describeFinalize(outcome)}\n`);
        return ExitCode.Ok;
      }, ['jobs'], o.json ? (err) => runErrorObject(name, o.key, err) : undefined),
    );
}
