import { createHash } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import { sql, type Kysely } from 'kysely';
import { brandErrorClass, ExitCode, IdemError } from './errors.ts';
import type { Job } from './job.ts';

/**
 * A resume found the run started under other code, and the operator did not allow it.
 * Exit 65 (sysexits EX_DATAERR), like a reused key with other params: the input does not match
 * what the run was started with.
 */
export class CodeChangedError extends IdemError {
  static {
    brandErrorClass(this, 'CodeChangedError');
  }

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
 * A job derived from another (the server wraps each step's `run` for its metrics) keeps the code
 * fingerprint of the one it came from: it is the same code.
 */
export function derivedJob<J extends Job>(derived: J, from: Job): J {
  const hash = fileHashes.get(from);
  if (hash !== undefined) fileHashes.set(derived, hash);
  return derived;
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
  /** Set for a runner that reads it: the run's status, and the code changes allowed on it. */
  readonly status?: string;
  readonly code_changes?: ReadonlyArray<{ readonly from: string; readonly to: string; readonly attempt: number }> | null;
}

/**
 * Records the code an attempt runs under, once it has taken the run over (`attempt` is its number):
 * the first attempt adopts its fingerprint; a later one under other code (only reached when the
 * operator allowed it: `refuseChangedCode` ran before the lock) appends the change, shown by
 * `idem status`, and adopts the new fingerprint.
 */
export async function recordCodeFingerprint(db: Kysely<any>, schema: string, run: RunCodeRow, job: Job, attempt: number, joined = false): Promise<void> {
  const now = codeFingerprint(job);
  const before = run.code_fingerprint ?? null;
  if (now === null || before === now) return;
  const runs = sql.id(schema, 'runs');
  // A run's first attempt (or a run recorded before idem kept fingerprints) adopts the current code.
  // A worker joining a live attempt under other code (allowed) changes the code of that attempt,
  // its first one included: recorded like a resume's change, at the attempt it joined.
  if (before === null || (attempt === 1 && !joined)) {
    await sql`update ${runs} set code_fingerprint = ${now} where id = ${run.id}`.execute(db);
    return;
  }
  const change = { from: before, to: now, attempt, at: new Date().toISOString() };
  // Compare-and-set on the fingerprint read: a retry after a lost acknowledgement appends nothing.
  await sql`update ${runs} set code_fingerprint = ${now},
      code_changes = coalesce(code_changes, '[]'::jsonb) || ${JSON.stringify([change])}::jsonb
    where id = ${run.id} and code_fingerprint = ${before}`.execute(db);
}

/**
 * A run's very first invocation records its code before taking the lock, so the common path adds
 * nothing after the attempt bump (where workers joining the run race to set it up). Only the first
 * writer's fingerprint sticks.
 */
export async function adoptCodeFingerprint(db: Kysely<any>, schema: string, run: RunCodeRow, job: Job): Promise<void> {
  const now = codeFingerprint(job);
  if (now === null || run.attempt !== 0 || (run.code_fingerprint ?? null) !== null) return;
  await sql`update ${sql.id(schema, 'runs')} set code_fingerprint = ${now} where id = ${run.id} and code_fingerprint is null`.execute(db);
}

/**
 * The refusal alone, writing nothing: called on the claimed row before the job's lock is taken
 * (taking it bumps the attempt), so a refused resume leaves the run exactly as it was.
 */
export function refuseChangedCode(run: RunCodeRow, job: Job, allowChanged: boolean): void {
  const change = changedCode(run, job);
  if (allowChanged || change === null) return;
  const { from: before, to: now } = change;
  const what = `run ${run.run_key} of job "${run.job}"`;
  const safe = 'if the change is safe for the chunks already done';
  // A failed run is resumed after a fix, which is often in the job's code: that way first.
  if (run.status === 'failed') {
    throw new CodeChangedError(`${what} failed under other code (${short(before)}, now ${short(now)}); to resume it with this code (a fix of that failure), pass --allow-changed-code ${safe}; else resume it with the code it failed under`);
  }
  // Its code was changed (allowed) since it started: "started under other code" would name the
  // change's hash as the one it started with, to a process that may well have that one.
  const last = run.code_changes?.at(-1);
  if (last && last.to === before) {
    throw new CodeChangedError(
      `${what} changed its code at attempt ${last.attempt} (from ${short(last.from)} to ${short(before)}, allowed), and this process has ${short(now)}; pass --allow-changed-code to work it with this code ${safe}, or work it with ${short(before)}`,
    );
  }
  throw new CodeChangedError(`${what} was started under other code (${short(before)}, now ${short(now)}); resume it with the code it started with, or pass --allow-changed-code ${safe}`);
}

/**
 * The code change a resume of `run` under `job` would be refused for (refuseChangedCode without
 * the flag): the fingerprint the run's last attempt ran under and the job's now; null when none.
 * Whether the run has ended, or is live, is for the caller to judge.
 */
export function changedCode(run: Pick<RunCodeRow, 'attempt' | 'code_fingerprint'>, job: Job): { readonly from: string; readonly to: string } | null {
  const now = codeFingerprint(job);
  const before = run.code_fingerprint ?? null;
  if (now === null || before === null || before === now || run.attempt === 0) return null;
  return { from: before, to: now };
}

/** A fingerprint as messages show it: a file's hash cut to 12 hex digits, a version whole. */
export function short(fp: string): string {
  return fp.startsWith('sha256:') ? `${fp.slice(0, 19)}…` : fp;
}
