import { exitCodeOf, IdemError, messageOf } from './errors.ts';
import type { RunOutcome } from './runner.ts';
import { visible } from './text-table.ts';

/** One human line for a run's outcome: what happened, how much, and what to do about skipped chunks. */
export function describeOutcome(o: RunOutcome): string {
  const s = o.summary;
  if (o.status === 'dry-run') {
    const steps = o.plan!.steps.map((st) => `${st.name}${st.chunked ? ' (chunked)' : ''}`).join(', ');
    const resumes = o.plan!.state === 'crashed' ? ` (idem run resumes it as attempt ${o.attempt + 1})` : '';
    return `dry run: job "${o.job}" run key ${visible(o.runKey)} is ${o.plan!.state}${resumes}; steps: ${steps}; nothing was written`;
  }
  const skipped = s && s.skipped > 0 ? ` (${s.skipped} skipped: see idem status, retry with --retry-skipped)` : '';
  const dropped = s?.dropped?.length
    ? `; steps no longer in the job: ${s.dropped.map((d) => `${visible(d.name)} (${d.done} of ${d.chunks} planned chunk${d.chunks === 1 ? '' : 's'} done)`).join(', ')}`
    : '';
  const counts = s ? `${s.chunks} chunk${s.chunks === 1 ? '' : 's'} in ${s.steps.length} step${s.steps.length === 1 ? '' : 's'}${skipped}${dropped}` : '';
  if (o.status === 'already-succeeded') {
    const finished = s?.finishedAt ? new Date(s.finishedAt).toISOString() : '?';
    return `job "${o.job}" already done (run key ${visible(o.runKey)}, finished ${finished}): ${counts}; nothing to do`;
  }
  const took = o.attempt > 1 ? ` (the run took ${((s?.durationMs ?? 0) / 1000).toFixed(1)}s over ${o.attempt} attempts)` : '';
  const rerun = o.rerunSteps?.length ? `\nsteps after the retried chunks run again: ${o.rerunSteps.map(visible).join(', ')}` : '';
  return `job "${o.job}" succeeded: ${counts}, ${o.executed} executed now in ${((o.elapsedMs ?? s?.durationMs ?? 0) / 1000).toFixed(1)}s${took} (run key ${visible(o.runKey)}, attempt ${o.attempt})${rerun}`;
}

/** What `--json` says of an outcome other than success (`run`'s error object, `migrate`'s failed entry): the exit code, idem's error code and the message. */
export function failureFields(err: unknown): { readonly exitCode: number; readonly code: string | null; readonly error: string } {
  return { exitCode: exitCodeOf(err), code: err instanceof IdemError ? err.code : null, error: messageOf(err) };
}

/** What `idem run --json` (and `finalize --json`) prints when the run does not succeed, or the input is refused. */
export function runErrorObject(job: string | null, runKey: string | null, err: unknown) {
  return { status: 'error', job, runKey, ...failureFields(err) };
}

/** `idem migrate --json`'s entry for the migration that failed (`null`s: none was under way, e.g. the database is unreachable). */
export function migrateErrorEntry(current: { readonly runKey: string; readonly job: { readonly name: string } } | null, err: unknown) {
  return { runKey: current?.runKey ?? null, job: current?.job.name ?? null, status: 'error', ...failureFields(err) };
}
