import type { Command } from 'commander';
import { runErrorObject } from '../describe-outcome.ts';
import { openRunner, withoutDatabase, type CliContext } from '../cli-session.ts';
import { ExitCode } from '../errors.ts';
import type { RunStatusRow } from '../runner.ts';
import { prepareColumns } from '../display-width.ts';
import { colourful, colours, type Colours } from '../terminal.ts';
import { textTable, visibleDeep } from '../text-table.ts';
import { relativeTime, stateColour } from './status.ts';

/** One job or migration of `idem list`, as `--json` prints it. */
export interface ListItem {
  readonly kind: 'job' | 'migration';
  /** The job's name; a migration's file name without extension (its run key). */
  readonly name: string;
  /** A migration's job name. */
  readonly job?: string;
  readonly description: string;
  /** The latest run's state; `never run` (a job) or `pending` (a migration) without one. */
  readonly state: string;
  /** When the latest run last changed; null without one. */
  readonly updatedAt: Date | null;
}

const NO_ITEMS = 'no jobs or migrations found';

/**
 * `idem list` for a person (a terminal): aligned columns, states in colour, the time since the
 * latest run changed, the description last. Pure; exported for tests.
 */
export function formatList(given: readonly ListItem[], now: Date = new Date(), c: Colours = colours(false)): string {
  if (given.length === 0) return NO_ITEMS;
  // Names and descriptions come from job files, states from the database: shown escaped.
  const items = visibleDeep(given);
  const header = ['KIND', 'NAME', 'STATE', 'UPDATED', 'DESCRIPTION'];
  const rows = items.map((i) => [i.kind, i.name, i.state, i.updatedAt ? relativeTime(i.updatedAt, now) : '—', i.description]);
  const { line } = textTable([header, ...rows]);
  return [line(header, (_, s) => c.bold(s)), ...rows.map((cells, n) => line(cells, (col, s) => (col === 2 ? stateColour(items[n]!.state, c)(s) : col === 3 ? c.dim(s) : s)))].join('\n');
}

/** `idem list` for a pipe: one tab-separated line per item (kind, name, state, description), for cut and awk. */
export function formatListTsv(given: readonly ListItem[]): string {
  // A tab or newline in a field would break the line into other fields or lines.
  return visibleDeep(given).map((i) => `${i.kind}\t${i.name}\t${i.state}\t${i.description}`).join('\n') || NO_ITEMS;
}

/** `idem list`: jobs and migrations with their description and latest state. */
export function registerListCommand(program: Command, cli: CliContext): void {
  program
    .command('list')
    .description('list jobs and migrations with their description and latest state (a table on a terminal, tab-separated lines in a pipe)')
    .option('--json', 'print as JSON')
    .action((o: { json?: boolean }) =>
      cli.runWithSession(async (g, log, session) => {
        const { checkSharedNames, loadJobDir } = await import('../cli-runtime.ts');
        const jobs = await loadJobDir(g.jobsDir, 'jobs');
        const migrations = await loadJobDir(g.migrationsDir, 'migrations');
        checkSharedNames(jobs, migrations);
        // A job's latest run, except that a live one wins: a busy invocation of another key leaves
        // a newer `pending` row beside it, which is not what the job is doing.
        const latest = new Map<string, RunStatusRow>();
        // Without a database to ask (no DATABASE_URL, no embedded server yet) none is made: no runs.
        // Reads only: a monitoring role with SELECT on idem's tables may list.
        const stored = withoutDatabase(g) ? [] : await (await openRunner(g, log, session, undefined, undefined, undefined, 'read')).status(undefined, 1000);
        for (const r of stored) if (!latest.has(r.job) || (r.state === 'running' && latest.get(r.job)!.state !== 'running')) latest.set(r.job, r);
        const items: ListItem[] = [
          ...jobs.map((j) => ({ kind: 'job' as const, name: j.job.name, description: j.job.description ?? '', state: latest.get(j.job.name)?.state ?? 'never run', updatedAt: latest.get(j.job.name)?.updatedAt ?? null })),
          ...migrations.map((m) => ({ kind: 'migration' as const, name: m.id, job: m.job.name, description: m.job.description ?? '', state: latest.get(m.job.name)?.state ?? 'pending', updatedAt: latest.get(m.job.name)?.updatedAt ?? null })),
        ];
        const tty = process.stdout.isTTY === true;
        if (!o.json && tty) await prepareColumns(JSON.stringify(items));
        const text = o.json ? JSON.stringify(items) : tty ? formatList(items, new Date(), colours(colourful(process.stdout))) : formatListTsv(items);
        process.stdout.write(`${text}\n`);
        return ExitCode.Ok;
      }, undefined, o.json ? (err) => runErrorObject(null, null, err) : undefined),
    );
}
