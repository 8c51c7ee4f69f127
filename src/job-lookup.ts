import { stat } from 'node:fs/promises';
import { sql, type Kysely } from 'kysely';
import type { Logger } from 'pino';
import { UsageError } from './errors.ts';
import { checkNameShared, checkSharedNames, loadJobDir, unknownJobError } from './loader.ts';

/** A folder of job or migration files, as the CLI was given it. */
export interface JobFolder {
  readonly flag: '--jobs-dir' | '--migrations-dir';
  readonly dir: string;
  /** True when the user passed the flag; the defaults (`jobs`, `migrations`) may be absent. */
  readonly explicit: boolean;
  readonly what: 'jobs' | 'migrations';
}

/**
 * A folder the user named must exist: `--jobs-dir /typo list` listing nothing and exiting 0 hides
 * the mistake. A default folder may be absent (a project with migrations only), said at debug level.
 */
export async function checkJobFolders(folders: readonly JobFolder[], log: Logger): Promise<void> {
  for (const f of folders) {
    const found = await stat(f.dir).catch((err: NodeJS.ErrnoException) => {
      if (err.code === 'ENOENT' || err.code === 'ENOTDIR') return undefined;
      throw err;
    });
    if (found?.isDirectory()) continue;
    if (!f.explicit && !found) {
      log.debug({ dir: f.dir }, `no ${f.what} folder at ${f.dir}/ (the default); no ${f.what} loaded`);
      continue;
    }
    throw new UsageError(
      'missingFolder',
      found ? `${f.flag} ${f.dir}: not a folder; pass the folder that holds the ${f.what === 'jobs' ? 'job' : 'migration'} files` : `${f.flag} ${f.dir}: no such folder; create it or fix the path`,
    );
  }
}

/**
 * For commands that take a job name and act on its runs (status, pause, resume, cancel, reset):
 * a name is known when it has runs, or a job or migration file defines it. Otherwise the name is
 * refused with the closest known names, before anything is written. The files are loaded only on
 * that path, so a job with runs needs no loadable file (its file may be gone).
 */
export async function assertKnownJob(db: Kysely<any> | undefined, schema: string, name: string, dirs: { readonly jobsDir: string; readonly migrationsDir: string }): Promise<void> {
  // Called before idem's schema is created (Runner.connect's beforeSchema): on a database without
  // it there are no runs, and a refused name must not leave the schema behind. Without a database
  // (db undefined: no DATABASE_URL and no embedded server yet) there are no runs either.
  const runs = sql.id(schema, 'runs');
  const hasRuns = db !== undefined && (await sql<{ found: boolean }>`select to_regclass(format('%I.runs', ${schema}::text)) is not null as found`.execute(db)).rows[0]?.found === true;
  if (hasRuns) {
    const { rows } = await sql<{ found: boolean }>`select exists (select 1 from ${runs} where job = ${name}) as found`.execute(db!);
    // A job and a migration of this name would mix their runs here: refused, as everywhere.
    if (rows[0]?.found) return checkNameShared(name, dirs);
  }
  const jobs = await loadJobDir(dirs.jobsDir, 'jobs');
  const migrations = await loadJobDir(dirs.migrationsDir, 'migrations');
  checkSharedNames(jobs, migrations);
  const names = [...jobs, ...migrations].map((l) => l.job.name);
  if (names.includes(name)) return;
  const ran = hasRuns ? (await sql<{ job: string }>`select distinct job from ${runs}`.execute(db!)).rows : [];
  throw unknownJobError(name, names, [dirs.jobsDir, dirs.migrationsDir], ran.map((r) => r.job), [...jobs, ...migrations]);
}
