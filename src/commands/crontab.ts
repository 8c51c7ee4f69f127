import type { Command } from 'commander';
import { CLI_DEFAULT_SCHEMA, type CliContext } from '../cli-session.ts';
import { ExitCode, UsageError } from '../errors.ts';
import type { ScheduledJob } from '../schedule.ts';

/**
 * Every job in the folder that declares a schedule, by name; refused when a migration (in
 * `migrationsDir`) shares a scheduled job's name, which would share its lock and runs.
 */
export async function scheduledJobs(dir: string, migrationsDir: string): Promise<ScheduledJob[]> {
  // Loaded here, not at the top: `idem --help` needs neither the job files nor croner.
  const { checkSharedNamesIn, loadJobDir, parseSchedule } = await import('../cli-runtime.ts');
  const scheduled = (await loadJobDir(dir, 'jobs')).filter((l) => l.job.schedule !== undefined);
  await checkSharedNamesIn(scheduled, migrationsDir, 'migrations');
  return scheduled
    .map((l) => ({ job: l.job.name, schedule: parseSchedule(l.job.schedule!) }))
    .sort((a, b) => (a.job < b.job ? -1 : 1));
}

/** What crontab and cron say when no job in the folder declares a schedule (exit 2). */
export function noScheduledJobs(dir: string): UsageError {
  return new UsageError('noScheduledJobs', `no job in ${dir}/ declares a schedule; add schedule: '0 3 * * *' to one`);
}

/** `idem crontab`: crontab lines for every scheduled job. */
export function registerCrontabCommand(program: Command, cli: CliContext): void {
  program
    .command('crontab')
    .description('print crontab lines for every scheduled job (install with: idem crontab | crontab -)')
    .option('--command <command>', 'how cron invokes idem', 'npx idem')
    .option('--log-file <file>', 'where cron appends output')
    .option('--catch-up <N>', 'add --catch-up N to each line, so a failed or missed slot is retried by the next tick')
    .action((o: { command: string; logFile?: string; catchUp?: string }) =>
      cli.runWithSession(async (g) => {
        const entries = await scheduledJobs(g.jobsDir, g.migrationsDir);
        if (entries.length === 0) throw noScheduledJobs(g.jobsDir);
        // Every global flag that changes which lock, tables or files a run uses goes on the line,
        // quoted: a cron run under another schema would take another lock than a manual run.
        // The database URL is not (it holds the password): cron's environment sets DATABASE_URL.
        const identity = [
          ...(g.schema !== CLI_DEFAULT_SCHEMA ? ['--schema', g.schema] : []),
          ...(g.jobsDir !== 'jobs' ? ['--jobs-dir', g.jobsDir] : []),
          ...(g.migrationsDir !== 'migrations' ? ['--migrations-dir', g.migrationsDir] : []),
        ];
        const { renderCrontab, shellQuote } = await import('../cli-runtime.ts');
        const flags = identity.map(shellQuote).map((w) => ` ${w}`).join('');
        process.stdout.write(renderCrontab(entries, { cwd: process.cwd(), command: `${o.command}${flags}`, ...(o.logFile ? { logFile: o.logFile } : {}), ...(o.catchUp ? { catchUp: o.catchUp } : {}) }));
        return ExitCode.Ok;
      }, ['jobs']),
    );
}
