import { readdir, stat } from 'node:fs/promises';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { recordJobFile } from './code-fingerprint.ts';
import { messageOf, UsageError } from './errors.ts';
import { assertJob, type Job } from './job.ts';
import { explainLoadError, formatLoadFailure } from './load-error.ts';
import { quoteChoices, suggestSimilar } from './suggest.ts';

const JOB_FILE = /^(?!_)(?!.*\.d\.[cm]?ts$)(?!.*\.test\.).*\.(?:[cm]?ts|[cm]?js)$/;

export interface LoadedJob {
  readonly file: string;
  /** File name without its extension: the run key of a migration. */
  readonly id: string;
  readonly job: Job;
}

/** Imports every job module in a folder (TypeScript loads through tsx), sorted by file name. */
export async function loadJobDir(dir: string, what: 'jobs' | 'migrations'): Promise<LoadedJob[]> {
  const abs = path.resolve(dir);
  let names: string[];
  try {
    names = (await readdir(abs)).filter((n) => JOB_FILE.test(n)).sort();
  } catch (err) {
    if ((err as { code?: string }).code === 'ENOENT') return [];
    throw err;
  }
  const loaded: LoadedJob[] = [];
  const byName = new Map<string, string>();
  for (const name of names) {
    const file = path.join(abs, name);
    if (!(await stat(file)).isFile()) continue;
    let mod: Record<string, unknown>;
    try {
      mod = (await import(pathToFileURL(file).href)) as Record<string, unknown>;
    } catch (err) {
      // The first line says what and where; the source line with a caret follows it.
      // Explaining must never hide the error it explains.
      const failure = await explainLoadError(file, err).catch(() => ({ cause: messageOf(err), fix: 'fix the file' }));
      throw new UsageError('jobLoadFailed', formatLoadFailure(what, file, failure), { cause: err });
    }
    const job = assertJob(mod.default ?? mod.job, path.relative(process.cwd(), file));
    const other = byName.get(job.name);
    if (other) throw new UsageError('duplicateJob', `job name "${job.name}" is defined twice (${other} and ${name}); rename one`);
    byName.set(job.name, name);
    await recordJobFile(job, file);
    loaded.push({ file, id: name.replace(/\.[cm]?[jt]s$/, ''), job });
  }
  return loaded;
}

/**
 * Finds a job by name among the folder's job files. An unknown name suggests the closest known
 * ones; a migration's name says to use `idem migrate` (when the migrations folder is given).
 */
export async function findJob(dir: string, name: string, opts: { readonly migrationsDir?: string } = {}): Promise<Job> {
  const all = await loadJobDir(dir, 'jobs');
  const hit = all.find((j) => j.job.name === name);
  if (hit) return hit.job;
  if (opts.migrationsDir !== undefined) {
    // Only to word the refusal: a migrations folder that does not load says nothing here.
    const migrations = await loadJobDir(opts.migrationsDir, 'migrations').catch(() => []);
    if (migrations.some((m) => m.job.name === name || m.id === name)) {
      throw new UsageError('notAJob', `'${name}' is a migration in ${opts.migrationsDir}/, not a job; run it with idem migrate`);
    }
  }
  throw unknownJobError(name, all.map((j) => j.job.name), [dir]);
}

/** `no job named 'x'; did you mean 'y'?`, or the known names when none is close. */
export function unknownJobError(name: string, known: Iterable<string>, dirs: readonly string[]): UsageError {
  const names = [...new Set(known)].sort();
  const similar = suggestSimilar(name, names);
  if (similar.length > 0) return new UsageError('unknownJob', `no job named '${name}'; did you mean ${quoteChoices(similar)}?`);
  const where = dirs.map((d) => `${d}/`).join(' or ');
  return new UsageError('unknownJob', `no job named '${name}' in ${where} (known: ${names.join(', ') || 'none'}); check the name or --jobs-dir`);
}
