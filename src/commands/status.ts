import type { Command } from 'commander';
import { positiveInt } from '../cli-parsers.ts';
import { openRunner, type CliContext } from '../cli-session.ts';
import { ExitCode } from '../errors.ts';
import type { RunStatusRow } from '../runner.ts';

export function formatStatus(rows: RunStatusRow[]): string {
  if (rows.length === 0) return 'no runs yet';
  const lines = rows.map((r) => {
    const progress = `${r.chunksDone}/${r.fullyPlanned ? r.chunksPlanned : `${Math.max(r.chunksPlanned, r.estimatedChunks ?? 0)}~`}`;
    const live = r.state === 'running' ? `  held by ${r.holder ?? '?'}${r.throughput !== null ? `, ${r.throughput}/s` : ''}${r.etaSeconds !== null ? `, ETA ${r.etaSeconds}s` : ''}` : '';
    const asked = r.requested ? `  (${r.requested} requested)` : '';
    const extra = r.error ? `  error: step "${r.error.step}"${r.error.chunk ? ` chunk ${r.error.chunk}` : ''} after ${r.error.tries} tries: ${r.error.message}` : live + asked;
    const skips = r.skipped.map((k) => `\n    skipped: step "${k.step}" chunk ${k.key} after ${k.attempts} tries: ${k.error ?? ''}`).join('');
    return `${r.job}\t${r.runKey.length > 30 ? `${r.runKey.slice(0, 27)}...` : r.runKey}\t${r.state}\tattempt ${r.attempt}\tchunks ${progress}\t${r.updatedAt.toISOString()}${extra}${skips}`;
  });
  return ['JOB\tRUN KEY\tSTATE\tATTEMPT\tCHUNKS\tUPDATED', ...lines].join('\n');
}

/** `idem status [job]`: the runs, newest first. */
export function registerStatusCommand(program: Command, cli: CliContext): void {
  program
    .command('status')
    .description("show runs: state ('running' only while a process holds the lock), attempt, chunks done/planned, last error")
    .argument('[job]', 'only this job')
    .option('--json', 'print as JSON')
    .option('--limit <n>', 'how many runs', positiveInt(10_000), 50)
    .action((job: string | undefined, o: { json?: boolean; limit: number }) =>
      cli.runWithSession(async (g, log, session) => {
        const runner = await openRunner(g, log, session);
        const rows = await runner.status(job, o.limit);
        process.stdout.write(o.json ? `${JSON.stringify(rows)}\n` : `${formatStatus(rows)}\n`);
        return ExitCode.Ok;
      }),
    );
}
