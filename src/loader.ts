import { existsSync, readFileSync } from 'node:fs';
import { readdir, readFile, stat } from 'node:fs/promises';
import { createRequire } from 'node:module';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { recordJobFile } from './code-fingerprint.ts';
import { codeOf, messageOf, UsageError } from './errors.ts';
import { quotedName } from './key-label.ts';
import { assertJob, migrationProblems, type Job } from './job.ts';
import { jobFilesLoading } from './job-file-loading.ts';
import { displayPath, explainLoadError, formatLoadFailure } from './load-error.ts';
import { MAX_RUN_KEY_CHARS } from './run-key.ts';
import { quoteChoices, suggestSimilar } from './suggest.ts';

/** Job files: .ts .mts .cts .js .mjs .cjs, except names starting with `_`, type files and tests (`*.test.*`, `*.spec.*`). */
const JOB_FILE = /^(?!_)(?!.*\.d\.[cm]?ts$)(?!.*\.(?:test|spec)\.).*\.(?:[cm]?ts|[cm]?js)$/;
const TYPESCRIPT = /\.[cm]?ts$/;

/**
 * Whether Node treats this file as CommonJS: .cjs/.cts always, .mjs/.mts never, .js/.ts by the
 * "type" of the nearest package.json (CommonJS when absent, as in a fresh `npm init` project).
 */
export function isCommonJsFile(file: string): boolean {
  if (/\.c[jt]s$/.test(file)) return true;
  if (/\.m[jt]s$/.test(file)) return false;
  for (let dir = path.dirname(file); ; dir = path.dirname(dir)) {
    try {
      return (JSON.parse(readFileSync(path.join(dir, 'package.json'), 'utf8')) as { type?: string }).type !== 'module';
    } catch (err) {
      if (codeOf(err) !== 'ENOENT') return true;
    }
    if (path.dirname(dir) === dir) return true;
  }
}

let requireHook: Promise<void> | undefined;

/** How many plain JavaScript job files are importing now (see registerRequireHook). */
let plainJobsLoading = 0;

/**
 * Registers tsx's require hook, for CommonJS TypeScript only. tsx replaces Node's loader of `.js`
 * (and so of `.cjs`) files too, and compiles a `.js` file's import/export to CommonJS: once a
 * `.ts` job had loaded, an ES-module `.js` job in a `"type": "commonjs"` package loaded, where
 * Node refuses it and idem did too when no `.ts` file sorted before it. So while a `.js`, `.cjs`
 * or `.mjs` job file imports, its JavaScript (it and what it requires) is loaded by Node's own
 * loader, as Node would run it whatever other files the folder holds.
 */
async function registerRequireHook(): Promise<void> {
  const extensions = createRequire(import.meta.url).extensions;
  const nodeJs = extensions['.js']!;
  const { register } = await import('tsx/cjs/api');
  register();
  const tsxJs = extensions['.js']!;
  if (tsxJs === nodeJs) return;
  extensions['.js'] = function loadJs(module, filename) {
    return (plainJobsLoading > 0 && !TYPESCRIPT.test(filename.split('?')[0]!) ? nodeJs : tsxJs).call(this, module, filename);
  };
}

/** The directory of the nearest package.json above a file (the file's own directory when none). */
function packageRoot(file: string): string {
  for (let dir = path.dirname(file); ; dir = path.dirname(dir)) {
    if (existsSync(path.join(dir, 'package.json'))) return dir;
    if (path.dirname(dir) === dir) return path.dirname(file);
  }
}

/**
 * Loads one job module as Node would run it; a CommonJS module comes back as `{ default: module.exports }`.
 * TypeScript costs nothing until a folder holds some: CommonJS TypeScript (.cts, or .ts in a
 * CommonJS project) is require()d through tsx's require hook, which is cheap (it patches
 * require); ES-module TypeScript is compiled once by esbuild into the package's .idem/cache/
 * (see compile-typescript.ts) and imported as JavaScript.
 */
async function importJobFile(file: string): Promise<Record<string, unknown>> {
  if (TYPESCRIPT.test(file) && isCommonJsFile(file)) {
    await (requireHook ??= registerRequireHook());
    return { default: createRequire(file)(file) as unknown };
  }
  if (TYPESCRIPT.test(file)) {
    const { compileTypeScriptModule } = await import('./compile-typescript.ts');
    const compiled = await compileTypeScriptModule(file, path.join(packageRoot(file), '.idem', 'cache'));
    // Source maps on: stack traces of job errors point at the TypeScript. Node then scans every
    // module compiled after this for a map; idem's runtime (which the job imports) is loaded
    // first, so its ~700 kB are not scanned (~15 ms).
    await import('./index.ts');
    process.setSourceMapsEnabled(true);
    try {
      return (await import(pathToFileURL(compiled).href)) as Record<string, unknown>;
    } catch (err) {
      // A missing import is reported "imported from" the compiled file: name the user's file.
      if (err instanceof Error) err.message = err.message.split(compiled).join(file);
      throw err;
    }
  }
  plainJobsLoading++;
  try {
    return (await import(pathToFileURL(file).href)) as Record<string, unknown>;
  } finally {
    plainJobsLoading--;
  }
}

export interface LoadedJob {
  readonly file: string;
  /** File name without its extension: the run key of a migration. */
  readonly id: string;
  readonly job: Job;
}

/**
 * The run keys of a migrations folder's files (file names without extension), without importing
 * them: what prune needs to recognise migration runs an older idem recorded. Empty without the folder.
 */
export async function migrationKeys(dir: string): Promise<string[]> {
  return (await jobFileNames(path.resolve(dir), ['ENOENT', 'ENOTDIR'])).map(fileStem);
}

/** The job files of a folder, sorted by name; none when reading it fails with one of `missing`. */
async function jobFileNames(abs: string, missing: readonly string[]): Promise<string[]> {
  try {
    return (await readdir(abs)).filter((n) => JOB_FILE.test(n)).sort();
  } catch (err) {
    if (missing.includes(codeOf(err) ?? '')) return [];
    throw err;
  }
}

/** A job file's name without its extension: a migration's run key. */
const fileStem = (name: string) => name.replace(/\.[cm]?[jt]s$/, '');

/** Imports every job module in a folder (TypeScript through tsx, loaded on demand), sorted by file name. */
export async function loadJobDir(dir: string, what: 'jobs' | 'migrations'): Promise<LoadedJob[]> {
  const abs = path.resolve(dir);
  const names = await jobFileNames(abs, ['ENOENT']);
  if (what === 'migrations') refuseSharedStems(names);
  const loaded: LoadedJob[] = [];
  const byName = new Map<string, string>();
  for (const name of names) {
    const file = path.join(abs, name);
    if (!(await stat(file)).isFile()) continue;
    const one = await loadJobFile(file, what);
    if (what === 'migrations') checkMigration(one.job, one.id, path.relative(process.cwd(), file));
    const other = byName.get(one.job.name);
    if (other) throw new UsageError('duplicateJob', `job name "${one.job.name}" is defined twice (${other} and ${name}); rename one`);
    byName.set(one.job.name, name);
    loaded.push(one);
  }
  return loaded;
}

/**
 * Two migration files of one name but their extension (`0001_a.mjs`, `0001_a.ts`) would share a
 * run key: `migrate` would run both under it, and `migrate --finalize 0001_a` would find either.
 * Refused before any file is imported, naming both.
 */
function refuseSharedStems(names: readonly string[]): void {
  const byStem = new Map<string, string>();
  for (const name of names) {
    const other = byStem.get(fileStem(name));
    if (other !== undefined) {
      throw new UsageError(
        'duplicateMigration',
        `two migration files have the run key "${fileStem(name)}" (${other} and ${name}): a migration's run key is its file name without the extension, so they would share one run; rename one`,
      );
    }
    byStem.set(fileStem(name), name);
  }
}

/** Imports one job file and checks its job (not what only a migration must be: see checkMigration). */
async function loadJobFile(file: string, what: 'jobs' | 'migrations'): Promise<LoadedJob> {
  let mod: Record<string, unknown>;
  jobFilesLoading.set(file, (code, stack) => exitWhileLoading(what, file, code, stack));
  try {
    mod = await importJobFile(file);
  } catch (err) {
    // The first line says what and where; the source line with a caret follows it.
    // Explaining must never hide the error it explains.
    const failure = await explainLoadError(file, err).catch(() => ({ cause: messageOf(err), fix: 'fix the file' }));
    throw new UsageError('jobLoadFailed', formatLoadFailure(what, file, failure), { cause: err });
  } finally {
    jobFilesLoading.delete(file);
  }
  const origin = path.relative(process.cwd(), file);
  const exported = jobExport(mod, isCommonJsFile(file));
  if (isThenable(exported)) {
    // TypeScript compiled for a CommonJS project puts `export default` at module.exports.default.
    const cjsDefault = mod.default && typeof mod.default === 'object' ? (mod.default as Record<string, unknown>).default : undefined;
    const which = exported === mod.default || exported === cjsDefault ? 'the default export' : 'the export job';
    throw new UsageError('invalidJob', `${origin}: ${which} is a Promise: export the job itself (defineJob(...)), not a promise of it (in an ES module, export default await … works); fix the file`);
  }
  const job = assertJob(exported === undefined ? noJobExported(mod, origin) : exported, origin);
  warnIgnoredJobs(mod, exported, origin);
  await recordJobFile(job, file);
  return { file, id: fileStem(path.basename(file)), job };
}

/**
 * A job file that ends the process while it loads (`if (!process.env.X) process.exit(0)`): every
 * command loads the folder, so `idem list` ended there too, with no run to speak of. One line,
 * `file:line:column` of the call when the stack shows it (synchronous: the process is exiting).
 */
function exitWhileLoading(what: 'jobs' | 'migrations', file: string, code: number, stack: string): string {
  const url = pathToFileURL(file).href;
  const at = [url, file].map((f) => new RegExp(`${f.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}:(\\d+):(\\d+)`).exec(stack)).find(Boolean);
  return `cannot load ${what} file ${displayPath(file)}${at ? `:${at[1]}:${at[2]}` : ''}: it called process.exit(${code}) while loading; a job file may not end the process: throw an Error instead, or check the condition in a step`;
}

/**
 * A job and a migration of one name would share the job's lock and its list of runs (`idem status`
 * would mix them, `idem run hello --key 0002_b` would find the migration's run): refused like two
 * jobs of one name. Paths relative to the working directory, the job's first.
 */
function sharedNameError(name: string, jobFile: string, migrationFile: string): UsageError {
  const rel = (f: string) => path.relative(process.cwd(), f);
  return new UsageError(
    'duplicateJob',
    `job name "${name}" is defined twice (${rel(jobFile)} and ${rel(migrationFile)}): a job and a migration may not share a name (they would share one lock and one list of runs); rename one`,
  );
}

/** Refuses a name that both folders define, both loaded (`idem list`, `idem status` of an unknown name). */
export function checkSharedNames(jobs: readonly LoadedJob[], migrations: readonly LoadedJob[]): void {
  const byName = new Map(jobs.map((j) => [j.job.name, j.file]));
  for (const m of migrations) {
    const jobFile = byName.get(m.job.name);
    if (jobFile !== undefined) throw sharedNameError(m.job.name, jobFile, m.file);
  }
}

/**
 * Refuses a name of `loaded` that a file of the other folder defines too, without importing that
 * whole folder: `idem run` must not import every migration (a project's migrations only grow, and
 * a no-op rerun stays one job file; test/cli-startup.test.ts), nor `idem migrate` every job. So only
 * the files that spell one of the names out as a string literal (`'hello'`, `"hello"`, `` `hello` ``)
 * are imported, to read their name; one that does not load is left to the commands that load its
 * folder. A name computed at load time (`name: prefix + 'x'`) is seen only where both folders are
 * loaded (list, status; see checkSharedNames).
 */
export async function checkSharedNamesIn(loaded: readonly LoadedJob[], otherDir: string, other: 'jobs' | 'migrations'): Promise<void> {
  if (loaded.length === 0) return;
  const byName = new Map(loaded.map((l) => [l.job.name, l.file]));
  for (const found of await jobsSpelling(otherDir, [...byName.keys()], other)) {
    const mine = byName.get(found.job.name);
    if (mine === undefined) continue;
    throw other === 'migrations' ? sharedNameError(found.job.name, mine, found.file) : sharedNameError(found.job.name, found.file, mine);
  }
}

/**
 * The jobs of a folder's files that spell out one of `names` as a string literal (`'hello'`,
 * `"hello"`, `` `hello` ``), imported to read their name; the other files are only read, and a
 * file that does not load is left to the commands that load its folder.
 */
async function jobsSpelling(dir: string, names: readonly string[], what: 'jobs' | 'migrations'): Promise<LoadedJob[]> {
  const abs = path.resolve(dir);
  const found: LoadedJob[] = [];
  for (const name of await jobFileNames(abs, ['ENOENT', 'ENOTDIR'])) {
    const file = path.join(abs, name);
    const text = await readFile(file, 'utf8').catch(() => '');
    if (!names.some((n) => text.includes(`'${n}'`) || text.includes(`"${n}"`) || text.includes(`\`${n}\``))) continue;
    const one = await loadJobFile(file, what).catch(() => null);
    if (one) found.push(one);
  }
  return found;
}

/**
 * For a command given a job name (`status`, `pause`, `reset`…): refuses the name when a job file and
 * a migration file both define it, importing only files that spell it out (see checkSharedNamesIn).
 */
export async function checkNameShared(name: string, dirs: { readonly jobsDir: string; readonly migrationsDir: string }): Promise<void> {
  const jobs = (await jobsSpelling(dirs.jobsDir, [name], 'jobs')).filter((j) => j.job.name === name);
  await checkSharedNamesIn(jobs, dirs.migrationsDir, 'migrations');
}

/**
 * What a migration may not be, though a job may: it runs once per database under its file name
 * as run key (README, Migrations), so params and a schedule would be silently ignored, and a
 * file name that is not a valid run key would fail only when `migrate` reaches it.
 */
function checkMigration(job: Job, id: string, origin: string): void {
  const problems = migrationProblems(job);
  const chars = [...id].length;
  if (chars > MAX_RUN_KEY_CHARS) problems.push(`the migration's file name without its extension is its run key, at most ${MAX_RUN_KEY_CHARS} characters; this one has ${chars}: rename the file`);
  else if (/\p{Cc}/u.test(id)) problems.push("the migration's file name without its extension is its run key, which may not hold control characters: rename the file");
  if (problems.length > 0) throw new UsageError('invalidMigration', `${origin}: ${problems.join('; ')}`);
}

/**
 * The job a module exports: `export default` or `export const job` in ESM. A CommonJS module
 * (a .cjs file, or TypeScript compiled for a CommonJS project) arrives as `{ default: module.exports }`,
 * where `export default` became `exports.default` and `module.exports = job` is the job itself.
 * Undefined when there is none: a CommonJS module's exports with neither name nor steps are not
 * a job (a forgotten `module.exports = job`, or helpers only), while an ES module's default export
 * of such an object is refused for what it lacks.
 */
function jobExport(mod: Record<string, unknown>, commonJs: boolean): unknown {
  const top = mod.default ?? mod.job;
  // `module.exports = Promise…`: a promise, not "nothing" (refused as the ES module's is).
  if (isThenable(top)) return top;
  if (top && typeof top === 'object' && !('steps' in top)) {
    const inner = (top as Record<string, unknown>).default ?? (top as Record<string, unknown>).job;
    if (inner !== undefined) return inner;
    if (commonJs && mod.default === top && !('name' in top)) return undefined;
  }
  return top;
}

const isThenable = (value: unknown): boolean =>
  value !== null && (typeof value === 'object' || typeof value === 'function') && typeof (value as { then?: unknown }).then === 'function';

/** What reads as a job definition: an object with a string name and an array of steps. */
const looksLikeJob = (value: unknown): value is { name: string } =>
  value !== null && typeof value === 'object' && typeof (value as { name?: unknown }).name === 'string' && Array.isArray((value as { steps?: unknown }).steps);

/** Files and exports already warned about: a command that loads a folder twice says it once. */
const warnedIgnored = new Set<string>();

/**
 * A file holds one job, its default export (or `job`): another job it exports beside that one
 * (`export const job = defineJob(...)` next to a default of another name) is ignored, and `idem run`
 * of its name said only "no job named". One warning line names it.
 */
function warnIgnoredJobs(mod: Record<string, unknown>, chosen: unknown, origin: string): void {
  const candidates: Array<[string, unknown]> = Object.entries(mod).filter(([k]) => k !== 'module.exports');
  const top = mod.default;
  if (top && typeof top === 'object' && top !== chosen && !looksLikeJob(top)) candidates.push(...Object.entries(top));
  for (const [exportName, value] of candidates) {
    if (value === chosen || !looksLikeJob(value)) continue;
    if (chosen && typeof chosen === 'object' && (chosen as { name?: unknown }).name === value.name) continue;
    const key = `${origin}\0${exportName}`;
    if (warnedIgnored.has(key)) continue;
    warnedIgnored.add(key);
    const how = exportName === 'default' ? 'export default' : `export ${exportName}`;
    process.emitWarning(`${origin} exports a second job, ${JSON.stringify(value.name)} (${how}), which idem ignores: a job file holds one job, its default export (or job); move ${JSON.stringify(value.name)} into a file of its own`);
  }
}

/**
 * A file that exports no job: it says so, and what it does export. Files named `_…` are the
 * helpers idem skips (README, How job files load), so exports of other names hint at one.
 */
function noJobExported(mod: Record<string, unknown>, origin: string): never {
  const names = new Set(Object.keys(mod).filter((k) => k !== 'default' && k !== 'module.exports'));
  const exportsObject = mod.default;
  if (exportsObject && typeof exportsObject === 'object') for (const k of Object.keys(exportsObject)) names.add(k);
  const found = names.size === 0 ? 'it exports nothing' : `it exports only ${[...names].join(', ')}`;
  throw new UsageError(
    'invalidJob',
    `${origin} does not export a job definition: expected an object with name and steps (export default …, or module.exports = … in CommonJS); ${found}; export the job, or if the file is a helper, start its name with _ (idem skips those)`,
  );
}

/**
 * Finds a job by name among the folder's job files. An unknown name suggests the closest known
 * ones; a migration's name says to use `idem migrate`, and a job a migration shares its name with
 * is refused (both when the migrations folder is given).
 */
export async function findJob(dir: string, name: string, opts: { readonly migrationsDir?: string } = {}): Promise<Job> {
  const all = await loadJobDir(dir, 'jobs');
  const hit = all.find((j) => j.job.name === name);
  if (hit) {
    if (opts.migrationsDir !== undefined) await checkSharedNamesIn([hit], opts.migrationsDir, 'migrations');
    return hit.job;
  }
  if (opts.migrationsDir !== undefined) {
    // Only to word the refusal: a migrations folder that does not load says nothing here.
    const migrations = await loadJobDir(opts.migrationsDir, 'migrations').catch(() => []);
    if (migrations.some((m) => m.job.name === name || m.id === name)) {
      throw new UsageError('notAJob', `'${name}' is a migration in ${opts.migrationsDir}/, not a job; run it with idem migrate`);
    }
  }
  if (all.length === 0 && !existsSync(path.resolve(dir))) {
    // Only the default folder can be missing here (an explicit --jobs-dir is checked up front):
    // idem was started outside the project's root, or before idem init.
    throw new UsageError('unknownJob', `no job named ${quotedName(name)}: there is no ${dir}/ folder in ${process.cwd()}; run idem in your project's root, pass --jobs-dir, or create one with idem init`);
  }
  throw unknownJobError(name, all.map((j) => j.job.name), [dir], [], all);
}

/**
 * The job a name given as a path means (`jobs/slow.ts`, `./jobs/backfill`, `slow.mjs`: a folder, a
 * job file's extension, or both): the one the file holds (by its path, else by its name without
 * extension, whatever the extension given), else the one its base name names; undefined for a
 * name that is not a path, or a path that means none of them. A job is named, never given by its
 * file: the refusal says which name to give.
 */
function jobOfPath(name: string, files: readonly LoadedJob[], names: readonly string[]): string | undefined {
  if (!/[\\/]/.test(name) && fileStem(name) === name) return undefined;
  const stem = fileStem(path.basename(name));
  const file = files.find((f) => f.file === path.resolve(name)) ?? files.find((f) => f.id === stem);
  return file?.job.name ?? (names.includes(stem) ? stem : undefined);
}

/**
 * `no job named 'x'; did you mean 'y'?`, or the known names when none is close: the jobs and
 * migrations of the folders, then (apart) jobs known only by their runs in the database. Each
 * list shows ten names at most, so the refusal stays one line on a database of many jobs.
 */
export function unknownJobError(name: string, known: Iterable<string>, dirs: readonly string[], ranOnly: Iterable<string> = [], files: readonly LoadedJob[] = []): UsageError {
  const names = [...new Set(known)].sort();
  const others = [...new Set(ranOnly)].filter((n) => !names.includes(n)).sort();
  const meant = jobOfPath(name, files, names);
  const similar = meant !== undefined ? [meant] : suggestSimilar(name, [...names, ...others].sort());
  if (similar.length > 0) return new UsageError('unknownJob', `no job named ${quotedName(name)}; did you mean ${quoteChoices(similar)}?`);
  const where = dirs.map((d) => `${d}/`).join(' or ');
  const some = (list: string[]): string => (list.length > 10 ? `${list.slice(0, 10).join(', ')} and ${list.length - 10} more` : list.join(', '));
  const cut = names.length > 10 || others.length > 10 ? '; idem list and idem status show all' : '';
  const listed = `known: ${some(names) || 'none'}${others.length > 0 ? `; with runs only: ${some(others)}` : ''}${cut}`;
  return new UsageError('unknownJob', `no job named ${quotedName(name)} in ${where} (${listed}); check the name or --jobs-dir`);
}
