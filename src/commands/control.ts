import type { Command } from 'commander';
import { runErrorObject } from '../describe-outcome.ts';
import { cancelStatementsOnStop, openRunner, withoutDatabase, type CliContext } from '../cli-session.ts';
import { existingKey } from '../cli-parsers.ts';
import { ExitCode } from '../errors.ts';
import { visible } from '../text-table.ts';

function registerControl(program: Command, cli: CliContext, name: 'pause' | 'resume' | 'cancel', description: string): void {
  program
    .command(name)
    .description(description)
    .argument('<job>', 'job name')
    .option('--key <key>', "the run's key (default: the job's latest run it applies to)", existingKey)
    .option('--json', 'print the result as JSON')
    .action((job: string, o: { key?: string; json?: boolean }) =>
      cli.runWithSession(async (g, log, session) => {
        // The name is checked before idem's schema is upgraded: a refused name writes nothing.
        const { assertKnownJob, noDatabaseHost, requestControl, resumeRun } = await import('../cli-runtime.ts');
        if (withoutDatabase(g, job)) {
          // No database to ask (no DATABASE_URL, no embedded server yet): no run to act on, said as
          // on a database without idem's schema; none is made.
          await assertKnownJob(undefined, g.schema, job, g);
          const none = noDatabaseHost(g.schema);
          await (name === 'resume' ? resumeRun(none, job, o.key) : requestControl(none, job, name, o.key));
        }
        await cancelStatementsOnStop(session);
        const runner = await openRunner(g, log, session, undefined, undefined, (db, schema) => assertKnownJob(db, schema, job, g), 'existing');
        const r = await runner[name](job, o.key);
        const how = !r.live
          ? name === 'resume' && r.status === 'running'
            ? 'pause withdrawn: no process works the run (it crashed); its next invocation continues it'
            : `now ${r.status}`
          : name === 'resume'
            ? 'pause withdrawn: the live run goes on (had it already stopped for the pause, it is interrupted and continues on its next invocation)'
            : 'requested: the live run stops at its next chunk boundary';
        process.stdout.write(o.json ? `${JSON.stringify(r)}\n` : `${name}: run ${visible(r.runKey)} of job "${r.job}" ${how}\n`);
        return ExitCode.Ok;
      }, undefined, o.json ? (err) => runErrorObject(job, o.key ?? null, err) : undefined),
    );
}

/** `idem pause|resume|cancel <job>`: operator actions between chunks. */
export function registerControlCommands(program: Command, cli: CliContext): void {
  registerControl(program, cli, 'pause', 'pause a run between chunks; its re-invocations exit 75 until idem resume');
  registerControl(program, cli, 'resume', 'let a paused run continue on its next invocation');
  registerControl(program, cli, 'cancel', 'cancel a run between chunks; finished chunks are kept, the run never continues');
}
