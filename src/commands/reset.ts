import type { Command } from 'commander';
import { runErrorObject } from '../describe-outcome.ts';
import { cancelStatementsOnStop, openRunner, withoutDatabase, type CliContext } from '../cli-session.ts';
import { existingKey } from '../cli-parsers.ts';
import { ExitCode } from '../errors.ts';
import { visible } from '../text-table.ts';

/** `idem reset <job> --key K`: forget a run so its key runs afresh. */
export function registerResetCommand(program: Command, cli: CliContext): void {
  program
    .command('reset')
    .description('forget a run (steps, chunk markers, effects) so its key runs afresh; refused while it runs')
    .argument('<job>', 'job name')
    .requiredOption('--key <key>', "the run's key (see idem status)", existingKey)
    .option('--json', 'print the result as JSON')
    .action((job: string, o: { key: string; json?: boolean }) =>
      cli.runWithSession(async (g, log, session) => {
        // The name is checked before idem's schema is upgraded: a refused name writes nothing.
        const { assertKnownJob, noDatabaseHost, resetRun } = await import('../cli-runtime.ts');
        if (withoutDatabase(g, job)) {
          // No database to ask (no DATABASE_URL, no embedded server yet): no run to forget; none is made.
          await assertKnownJob(undefined, g.schema, job, g);
          await resetRun(noDatabaseHost(g.schema), job, o.key);
        }
        await cancelStatementsOnStop(session);
        const runner = await openRunner(g, log, session, undefined, undefined, (db, schema) => assertKnownJob(db, schema, job, g), 'existing');
        const r = await runner.reset(job, o.key);
        process.stdout.write(
          o.json ? `${JSON.stringify({ job, runKey: o.key, chunks: r.chunks, effects: r.effects })}\n` : `reset: forgot run ${visible(o.key)} of job "${visible(job)}" (${r.chunks} chunk markers, ${r.effects} effects)\n`,
        );
        return ExitCode.Ok;
      }, undefined, o.json ? (err) => runErrorObject(job, o.key, err) : undefined),
    );
}
