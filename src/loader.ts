import { readdir, stat } from 'node:fs/promises';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { recordJobFile } from './code-fingerprint.ts';
import { UsageError } from './errors.ts';
import { assertJob, type Job } from './job.ts';

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
      throw new UsageError('jobLoadFailed', `cannot load ${what} file ${path.relative(process.cwd(), file)}: ${(err as Error).message?.split('\n')[0]}; fix the file`, { cause: err });
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

/** Finds a job by name among the folder's job files; an unknown name lists the known ones. */
export async function findJob(dir: string, name: string): Promise<Job> {
  const all = await loadJobDir(dir, 'jobs');
  const hit = all.find((j) => j.job.name === name);
  if (hit) return hit.job;
  const known = all.map((j) => j.job.name).join(', ') || 'none';
  throw new UsageError('unknownJob', `unknown job "${name}": no file in ${dir}/ defines it (known jobs: ${known}); check the name or --jobs-dir`);
}
