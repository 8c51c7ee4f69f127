import { createHash } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import { sql, type Kysely } from 'kysely';
import { ExitCode, IdemError } from './errors.ts';
import type { Job } from './job.ts';

/**
 * A resume found the run started under other code, and the operator did not allow it.
 * Exit 65 (sysexits EX_DATAERR), like a reused key with other params: the input does not match
 * what the run was started with.
 */
export class CodeChangedError extends IdemError {
  constructor(message: string) {
    super('idem.codeChanged', ExitCode.ParamsMismatch, message);
  }
}

/** The job file each loaded job came from, hashed once at load time. */
const fileHashes = new WeakMap<Job, string>();

/** Remembers the hash of the file a job was loaded from (the loader calls this). */
export async function recordJobFile(job: Job, file: string): Promise<void> {
  fileHashes.set(job, `sha256:${createHash('sha256').update(await readFile(file)).digest('hex')}`);
}

/**
 * The fingerprint of a job definition: its declared `version` (`version:<v>`), else the SHA-256
 * of the file it was loaded from, else `null` (a job built in code and never loaded from a file,
 * which has no version to compare: not checked).
 */
export function codeFingerprint(job: Job): string | null {
  if (job.version !== undefined) return `version:${job.version}`;
  return fileHashes.get(job) ?? null;
}

interface RunCodeRow {
  readonly id: string;
  readonly job: string;
  readonly run_key: string;
  readonly attempt: number;
  readonly code_fingerprint?: string | null;
}

/**
 * Compares the code a run was started under with the code about to resume it; called under the
 * job's lock, before the attempt is taken over, so a refusal writes nothing. The first attempt
 * records its fingerprint; a resume under other code is refused unless `allowChanged`, which
 * records the change (shown by `idem status`) and adopts the new fingerprint.
 */
export async function checkCodeFingerprint(db: Kysely<any>, schema: string, run: RunCodeRow, job: Job, allowChanged: boolean): Promise<void> {
  const now = codeFingerprint(job);
  if (now === null) return;
  const before = run.code_fingerprint ?? null;
  if (before === now) return;
  const runs = sql.id(schema, 'runs');
  // A run that never ran (or was recorded before idem kept fingerprints) adopts the current code.
  if (before === null || run.attempt === 0) {
    await sql`update ${runs} set code_fingerprint = ${now} where id = ${run.id}`.execute(db);
    return;
  }
  if (!allowChanged) {
    throw new CodeChangedError(
      `run ${run.run_key} of job "${run.job}" was started under other code (${short(before)}, now ${short(now)}); resume it with the code it started with, or pass --allow-changed-code if the change is safe for the chunks already done`,
    );
  }
  const change = { from: before, to: now, attempt: run.attempt + 1, at: new Date().toISOString() };
  await sql`update ${runs} set code_fingerprint = ${now},
      code_changes = coalesce(code_changes, '[]'::jsonb) || ${JSON.stringify([change])}::jsonb
    where id = ${run.id}`.execute(db);
}

function short(fp: string): string {
  return fp.startsWith('sha256:') ? `${fp.slice(0, 19)}…` : fp;
}
