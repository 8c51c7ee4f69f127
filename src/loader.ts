import { readdir, stat } from 'node:fs/promises';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { UsageError } from './errors.ts';
import { assertJob, type Job } from './job.ts';

const JOB_FILE = /^(?!_)(?!.*\.d\.[cm]?ts$)(?!.*\.test\.).*\.(?:[cm]?ts|[cm]?js)$/;
const TYPESCRIPT = /\.[cm]?ts$/;

let typescriptReady: Promise<void> | undefined;

/**
 * Teaches Node to load TypeScript, once per process and only when a folder holds a .ts, .mts or
 * .cts file: tsx costs about 100 ms at start-up, which a JavaScript project, `idem --help` and
 * `idem status` should not pay. Both of tsx's hooks: the ESM one for .mts and .ts in a
 * "type": "module" project, the CommonJS one for .cts and .ts in a CommonJS project (and what
 * those require()).
 */
function loadTypeScript(): Promise<void> {
  return (typescriptReady ??= (async () => {
    const [esm, cjs] = await Promise.all([import('tsx/esm/api'), import('tsx/cjs/api')]);
    esm.register();
    cjs.register();
  })());
}

export interface LoadedJob {
  readonly file: string;
  /** File name without its extension: the run key of a migration. */
  readonly id: string;
  readonly job: Job;
}

/** Imports every job module in a folder (TypeScript through tsx, loaded on demand), sorted by file name. */
export async function loadJobDir(dir: string, what: 'jobs' | 'migrations'): Promise<LoadedJob[]> {
  const abs = path.resolve(dir);
  let names: string[];
  try {
    names = (await readdir(abs)).filter((n) => JOB_FILE.test(n)).sort();
  } catch (err) {
    if ((err as { code?: string }).code === 'ENOENT') return [];
    throw err;
  }
  if (names.some((n) => TYPESCRIPT.test(n))) await loadTypeScript();
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
    const job = assertJob(jobExport(mod), path.relative(process.cwd(), file));
    const other = byName.get(job.name);
    if (other) throw new UsageError('duplicateJob', `job name "${job.name}" is defined twice (${other} and ${name}); rename one`);
    byName.set(job.name, name);
    loaded.push({ file, id: name.replace(/\.[cm]?[jt]s$/, ''), job });
  }
  return loaded;
}

/**
 * The job a module exports: `export default` or `export const job` in ESM. A CommonJS module
 * (a .cjs file, or TypeScript compiled for a CommonJS project) arrives as `{ default: module.exports }`,
 * where `export default` became `exports.default` and `module.exports = job` is the job itself.
 */
function jobExport(mod: Record<string, unknown>): unknown {
  const top = mod.default ?? mod.job;
  if (top && typeof top === 'object' && !('steps' in top)) {
    const inner = (top as Record<string, unknown>).default ?? (top as Record<string, unknown>).job;
    if (inner !== undefined) return inner;
  }
  return top;
}

/** Finds a job by name among the folder's job files; an unknown name lists the known ones. */
export async function findJob(dir: string, name: string): Promise<Job> {
  const all = await loadJobDir(dir, 'jobs');
  const hit = all.find((j) => j.job.name === name);
  if (hit) return hit.job;
  const known = all.map((j) => j.job.name).join(', ') || 'none';
  throw new UsageError('unknownJob', `unknown job "${name}": no file in ${dir}/ defines it (known jobs: ${known}); check the name or --jobs-dir`);
}
