import type { Command } from 'commander';
import { runErrorObject } from '../describe-outcome.ts';
import { cancelStatementsOnStop, openRunner, withoutDatabase, type CliContext } from '../cli-session.ts';
import { ExitCode } from '../errors.ts';

/** `idem prune --older-than D`: delete old finished runs in batches. */
export function registerPruneCommand(program: Command, cli: CliContext): void {
  program
    .command('prune')
    .description('delete succeeded and cancelled runs older than a duration, with their markers and effects (in batches)')
    .requiredOption('--older-than <duration>', 'e.g. 30d, 12h, 2w')
    .option('--json', 'print the counts as JSON')
    .action((o: { olderThan: string; json?: boolean }) =>
      cli.runWithSession(async (g, log, session) => {
        const { migrationKeys, noDatabaseHost, parseDuration, pruneRuns } = await import('../cli-runtime.ts');
        const ms = parseDuration(o.olderThan, '--older-than');
        const keys = await migrationKeys(g.migrationsDir);
        let r: Awaited<ReturnType<typeof pruneRuns>>;
        // No database to ask (no DATABASE_URL, no embedded server yet): nothing to remove; none is made.
        if (withoutDatabase(g)) r = await pruneRuns(noDatabaseHost(g.schema), ms, keys);
        else {
          await cancelStatementsOnStop(session);
          const runner = await openRunner(g, log, session, undefined, undefined, undefined, 'existing');
          r = await runner.prune(ms, { migrationKeys: keys });
        }
        const held = r.skipped > 0 ? `; left ${r.skipped} ${r.skipped === 1 ? 'run' : 'runs'} alone that another process holds (reviving, running or resetting it)` : '';
        process.stdout.write(o.json ? `${JSON.stringify(r)}\n` : `prune: removed ${count(r.runs, 'run')}, ${count(r.steps, 'step')}, ${count(r.chunks, 'chunk marker')}, ${count(r.effects, 'effect')} older than ${o.olderThan}${held}\n`);
        return ExitCode.Ok;
      }, [], o.json ? (err) => runErrorObject(null, null, err) : undefined),
    );
}

/** `1 run`, `2 runs`. */
const count = (n: number, what: string) => `${n} ${what}${n === 1 ? '' : 's'}`;
