import type { Command } from 'commander';
import { nonNegativeNumber, waitSeconds } from '../cli-parsers.ts';
import { installSignals, openRunner, refuseOutsideProject, type CliContext } from '../cli-session.ts';
import { describeOutcome, migrateErrorEntry } from '../describe-outcome.ts';
import { ExitCode, UsageError } from '../errors.ts';
import type { RunOutcome } from '../runner.ts';
import { visible } from '../text-table.ts';
import type { FinalizeOutcome } from '../finalize.ts';
import { describeFinalize } from './finalize.ts';
import { healthSetting, withHealthFlags, type HealthFlags } from './health-flags.ts';
import { throttleSetting, withThrottleFlags, type ThrottleFlags } from './throttle-flags.ts';

/** `idem migrate`: the ordered migrations; every pod may call it at once. */
export function registerMigrateCommand(program: Command, cli: CliContext): void {
  withThrottleFlags(withHealthFlags(program.command('migrate')))
    .description('run the ordered migrations in the migrations folder; every pod may call it at once')
    .option('--wait [seconds]', 'wait for another migrating process (default: forever)', waitSeconds)
    .option('--no-wait', 'exit 75 at once if another process is migrating')
    .option('--json', 'print the outcomes as JSON on stdout')
    .option('--allow-changed-code', 'resume migrations whose file (or version) changed since they started; recorded on the run')
    .option('--finalize <name>', 'deploys: make sure this migration (and those before it) succeeded: done → exit 0, running elsewhere → wait, idle → run it here, failed → exit 1')
    .option('--timeout <seconds>', 'with --finalize: how long to wait for a migration running elsewhere (default: no bound)', nonNegativeNumber)
    .action((o: { wait?: number | boolean; json?: boolean; allowChangedCode?: boolean; finalize?: string; timeout?: number } & HealthFlags & ThrottleFlags) => {
      // --json: a migrate that fails prints the outcomes so far, then the failed migration as an
      // entry (none for those after it, which never ran), as `run --json` prints its error object;
      // an entry with null runKey and job when none was under way (a bad flag, the database, the lock).
      const done: RunOutcome[] = [];
      // Text mode: a line per migration on stdout, on success and, before the error goes to stderr,
      // for those done so far, so a deploy log tells which migrations this invocation ran or found done.
      const sayDone = <T extends RunOutcome>(outcomes: readonly T[], describe: (out: T) => string) => {
        if (!o.json) for (const out of outcomes) process.stdout.write(`${visible(out.runKey)}: ${describe(out)}\n`);
      };
      // Asserted, not annotated: the callback sets it, which TypeScript's narrowing does not see.
      let current = null as { readonly runKey: string; readonly job: { readonly name: string } } | null;
      return cli.runWithSession(
        async (g, log, session, force) => {
          // Outside the project's root: refused before anything connects, not "no migrations", exit 0,
          // after making an embedded server or idem's schema in the app's database.
          refuseOutsideProject(g);
          const { checkSharedNamesIn, loadJobDir } = await import('../cli-runtime.ts');
          const migrations = await loadJobDir(g.migrationsDir, 'migrations');
          // A migration a job shares its name with would share the job's lock and runs.
          await checkSharedNamesIn(migrations, g.jobsDir, 'jobs');
          if (o.timeout !== undefined && o.finalize === undefined) throw new UsageError('invalidTimeout', '--timeout bounds the wait of --finalize; pass --finalize <name>, or use --wait for a plain migrate');
          const health = await healthSetting(o);
          const runner = await openRunner(g, log, session);
          const signals = installSignals(log, g.shutdownTimeout, force);
          if (o.finalize !== undefined) {
            const { finalizeMigration } = await import('../cli-runtime.ts');
            const list = migrations.map((m) => ({ runKey: m.id, job: m.job }));
            const soFar: FinalizeOutcome[] = [];
            const finalized = await finalizeMigration(runner, list, o.finalize, {
              ...(o.timeout !== undefined ? { timeoutSeconds: o.timeout } : {}),
              allowChangedCode: o.allowChangedCode ?? false,
              ...health,
              ...throttleSetting(o),
              signal: signals.stop,
              abortSignal: signals.abort,
              onMigration: (m) => {
                current = m;
              },
              onOutcome: (out) => {
                soFar.push(out); // for the text lines (with how)
                done.push(out); // for --json's entries before the error's
              },
            }).catch((err: unknown) => {
              sayDone(soFar, describeFinalize);
              throw err;
            });
            // The job's code threw meanwhile: that error is the command's outcome, printed already.
            if (session.jobCodeFailed) return ExitCode.Failed;
            if (o.json) process.stdout.write(`${JSON.stringify(finalized)}\n`);
            else sayDone(finalized, describeFinalize);
            return ExitCode.Ok;
          }
          const outcomes = await runner.migrate(
            migrations.map((m) => ({ runKey: m.id, job: m.job })),
            {
              wait: o.wait ?? true,
              allowChangedCode: o.allowChangedCode ?? false,
              ...health,
              ...throttleSetting(o),
              signal: signals.stop,
              abortSignal: signals.abort,
              onMigration: (m) => {
                current = m;
              },
              onOutcome: (out) => {
                done.push(out);
              },
            },
          ).catch((err: unknown) => {
            sayDone(done, describeOutcome);
            throw err;
          });
          if (session.jobCodeFailed) return ExitCode.Failed;
          if (o.json) process.stdout.write(`${JSON.stringify(outcomes)}\n`);
          else if (outcomes.length === 0) process.stdout.write(`no migrations in ${g.migrationsDir}/\n`);
          else sayDone(outcomes, describeOutcome);
          return ExitCode.Ok;
        },
        ['migrations'],
        o.json ? (err) => [...done, migrateErrorEntry(current, err)] : undefined,
      );
    });
}
