import type { Command } from 'commander';
import { openRunner, type CliContext } from '../cli-session.ts';
import { ExitCode } from '../errors.ts';
import type { RunStatusRow } from '../runner.ts';

/** `idem list`: jobs and migrations with their description and latest state. */
export function registerListCommand(program: Command, cli: CliContext): void {
  program
    .command('list')
    .description('list jobs and migrations with their description and latest state')
    .option('--json', 'print as JSON')
    .action((o: { json?: boolean }) =>
      cli.runWithSession(async (g, log, session) => {
        const { loadJobDir } = await import('../loader.ts');
        const jobs = await loadJobDir(g.jobsDir, 'jobs');
        const migrations = await loadJobDir(g.migrationsDir, 'migrations');
        const runner = await openRunner(g, log, session);
        const latest = new Map<string, RunStatusRow>();
        for (const r of await runner.status(undefined, 1000)) if (!latest.has(r.job)) latest.set(r.job, r);
        const items = [
          ...jobs.map((j) => ({ kind: 'job', name: j.job.name, description: j.job.description ?? '', state: latest.get(j.job.name)?.state ?? 'never run' })),
          ...migrations.map((m) => ({ kind: 'migration', name: m.id, job: m.job.name, description: m.job.description ?? '', state: latest.get(m.job.name)?.state ?? 'pending' })),
        ];
        if (o.json) process.stdout.write(`${JSON.stringify(items)}\n`);
        else process.stdout.write(`${items.map((i) => `${i.kind}\t${i.name}\t${i.state}\t${i.description}`).join('\n') || 'no jobs or migrations found'}\n`);
        return ExitCode.Ok;
      }),
    );
}
