import type { Command } from 'commander';
import { waitSeconds } from '../cli-parsers.ts';
import { installSignals, openRunner, type CliContext } from '../cli-session.ts';
import { describeOutcome } from '../describe-outcome.ts';
import { ExitCode } from '../errors.ts';
import { loadJobDir } from '../loader.ts';

/** `idem migrate`: the ordered migrations; every pod may call it at once. */
export function registerMigrateCommand(program: Command, cli: CliContext): void {
  program
    .command('migrate')
    .description('run the ordered migrations in the migrations folder; every pod may call it at once')
    .option('--wait [seconds]', 'wait for another migrating process (default: forever)', waitSeconds)
    .option('--no-wait', 'exit 75 at once if another process is migrating')
    .option('--json', 'print the outcomes as JSON on stdout')
    .action((o: { wait?: number | boolean; json?: boolean }) =>
      cli.runWithSession(async (g, log, session, force) => {
        const migrations = await loadJobDir(g.migrationsDir, 'migrations');
        const runner = await openRunner(g, log, session);
        const signals = installSignals(log, g.shutdownTimeout, force);
        const outcomes = await runner.migrate(
          migrations.map((m) => ({ runKey: m.id, job: m.job })),
          { wait: o.wait ?? true, signal: signals.stop, abortSignal: signals.abort },
        );
        if (o.json) process.stdout.write(`${JSON.stringify(outcomes)}\n`);
        else if (outcomes.length === 0) process.stdout.write(`no migrations in ${g.migrationsDir}/\n`);
        else for (const out of outcomes) process.stdout.write(`${out.runKey}: ${describeOutcome(out)}\n`);
        return ExitCode.Ok;
      }, ['migrations']),
    );
}
