import { existsSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { Writable } from 'node:stream';
import type { Command } from 'commander';
import type { Logger } from 'pino';
import { detachHungUpTerminal, guardStdio } from './hangup.ts';
import { ExitCode, exitCodeOf, exitCodeOfSignal, IdemError, InterruptedError, messageOf, STOP_SIGNALS, UsageError, type StopSignal } from './errors.ts';
import type { LogLevel } from './log-level.ts';
import type { Runner, RunnerOptions } from './runner.ts';
import { jobFileExit } from './job-file-loading.ts';
import { quotedName } from './key-label.ts';
import { testHookMs } from './test-hooks.ts';
import { visibleError } from './text-table.ts';

/**
 * runner.ts's DEFAULT_SCHEMA, repeated here so that `idem --help` need not load the runner (and
 * kysely, pg, pino with it); test/cli-startup.test.ts keeps the two equal.
 */
export const CLI_DEFAULT_SCHEMA = 'idem';

/** The folders idem looks in when no flag names others. */
export const DEFAULT_JOBS_DIR = 'jobs';
export const DEFAULT_MIGRATIONS_DIR = 'migrations';

/** The global flags every command sees. */
export interface GlobalOptions {
  databaseUrl?: string;
  /** Where databaseUrl came from, as an error message names it: the flag or the environment. */
  databaseUrlFrom?: '--database-url' | 'DATABASE_URL';
  schema: string;
  jobsDir: string;
  migrationsDir: string;
  logLevel: LogLevel;
  shutdownTimeout: number;
}

/** Resources a command opened, released in reverse order however the command ends. */
export class Session {
  readonly #cleanups: Array<() => Promise<void>> = [];
  /** Aborted by a signal during start-up: what is still starting (the embedded server) gives up. */
  readonly startup = new AbortController();
  /** An embedded server is being made or started: closing waits for it to give up and be released. */
  embeddedStarting = false;
  /**
   * The job's code threw outside a chunk's run() or left a rejection unhandled: that was printed (and
   * --json'd) as the command's outcome. A run that still ends well after it (the chunk in flight was
   * its last) is not printed as a second outcome.
   */
  jobCodeFailed = false;
  defer(fn: () => Promise<void>): void {
    this.#cleanups.push(fn);
  }
  async close(): Promise<void> {
    while (this.#cleanups.length) await this.#cleanups.pop()!().catch(() => {});
  }
}

/** A command's body: returns the exit code; `force` ends the process after a second signal. */
export type CommandBody = (g: GlobalOptions, log: Logger, session: Session, force: (code: number) => void) => Promise<number>;

/** What a command module gets from the program: the globals and the one way to run a command body. */
export interface CliContext {
  globals(): GlobalOptions;
  /**
   * `uses`: the folders the command reads; one given explicitly must exist. `run`, `crontab` and
   * `cron` read only the jobs folder (a crontab line carries --migrations-dir through unread).
   * Defaults to both. `jsonError` (a command run with --json): what to print on stdout, as JSON,
   * when the command ends in an error, whatever threw it (a missing folder, the database, the body).
   */
  runWithSession(fn: CommandBody, uses?: ReadonlyArray<'jobs' | 'migrations'>, jsonError?: (err: unknown) => unknown): Promise<void>;
}

export function createCliContext(program: Command, state: { exitCode: number }): CliContext {
  const globals = (): GlobalOptions => {
    const opts = program.opts<GlobalOptions>();
    return {
      ...opts,
      // Spaces or a line end around it (a .env file, a secret pasted with its newline) are not part of
      // the URL; pg would read a leading space as a host name and a trailing one into the database name.
      ...(opts.databaseUrl !== undefined ? { databaseUrl: opts.databaseUrl.trim() } : {}),
      databaseUrlFrom: program.getOptionValueSource('databaseUrl') === 'env' ? 'DATABASE_URL' : '--database-url',
    };
  };

  const runWithSession = async (fn: CommandBody, uses: ReadonlyArray<'jobs' | 'migrations'> = ['jobs', 'migrations'], jsonError?: (err: unknown) => unknown) => {
    const g = globals();
    const session = new Session();
    /** The code idem itself ends the process with, once it does: any other process.exit() comes from the job's code. */
    let exiting: number | undefined;
    const finish = async (code: number, graceMs = 10_000) => {
      exiting = code;
      // Set before anything is awaited: a close that never settles, with nothing left to wait on
      // (its sockets gone), ends the process by Node's own exit (bin/idem.js's top-level await
      // unsettled), whose code was 13 unless this was set.
      process.exitCode = code;
      // Watchdog: a stuck close (a pool waiting on an in-flight transaction) must not keep a cron
      // slot busy forever; exiting closes the sockets and Postgres rolls the transactions back.
      setTimeout(() => process.exit(code), graceMs).unref();
      await session.close();
      process.exit(code);
    };
    /** A signal ended the start-up: what the command still throws on its way out is not printed. */
    let stoppedBy: StopSignal | undefined;
    let stopping: Promise<void> | undefined;
    // Until a command installs its graceful handlers (installSignals), a SIGINT or SIGTERM ends it
    // as the exit-code table says, after releasing what the session holds (a pool, an embedded
    // server it started). Node's default ended the process by the signal, with neither. With
    // --json, its error object goes to stdout as for any other end that is not a success.
    onStartupSignal = (sig) => {
      if (stoppedBy) return;
      stoppedBy = sig;
      if (sig === 'SIGHUP') detachHungUpTerminal();
      if (jsonError) process.stdout.write(`${JSON.stringify(jsonError(startupInterruption(sig)))}\n`);
      process.stderr.write(`idem: stopped by ${sig}\n`);
      state.exitCode = exitCodeOfSignal(sig);
      session.startup.abort(startupInterruption(sig));
      // Killing initdb or letting a starting server come up and releasing it takes a few seconds;
      // the watchdog gives that time (pg_ctl's own bound is 60 s), else 2 s.
      stopping = finish(state.exitCode, session.embeddedStarting ? 65_000 : 2_000);
    };
    // Before the runtime loads (pg, kysely, pino: a good part of the start-up): from here a signal
    // is the session's, with the command's --json error object.
    dropEarlySignals();
    guardStdio();
    for (const sig of STOP_SIGNALS) process.on(sig, startupSignal[sig]);
    // Loaded here, not at the top: `idem --help` and parse errors never need the runtime. Every
    // command run here needs pg (job files import idem, which brings the runner): loaded first,
    // before the runtime's modules, whose evaluation would load it without preloadPg's care.
    await import('./preload-pg.ts').then((m) => m.preloadPg());
    const { createLogger, maskStdio, secretForms, redactSecrets, passwordFileProblem } = await import('./cli-runtime.ts');
    const fileProblem = passwordFileProblem();
    if (fileProblem) onePasswordFileWarning(fileProblem);
    // Every line masks the password (job lines too: ctx.log is a child of this logger), and so does
    // everything else the command prints (a run key or param may hold it).
    const log = createLogger(g.logLevel, { secrets: secretForms(g.databaseUrl ?? '') });
    maskStdio(secretForms(g.databaseUrl ?? ''));
    try {
      const { checkJobFolders } = await import('./cli-runtime.ts');
      await checkJobFolders(
        [
          { flag: '--jobs-dir' as const, dir: g.jobsDir, explicit: program.getOptionValueSource('jobsDir') === 'cli', what: 'jobs' as const },
          { flag: '--migrations-dir' as const, dir: g.migrationsDir, explicit: program.getOptionValueSource('migrationsDir') === 'cli', what: 'migrations' as const },
        ].filter((f) => uses.includes(f.what)),
        log,
      );
      const mask = (text: string) => (g.databaseUrl ? redactSecrets(text, g.databaseUrl) : text);
      const guard = guardAgainstJobCode(jsonError, mask, () => exiting, (code) => {
        session.jobCodeFailed = true;
        void finish(code, 2_000);
      });
      try {
        state.exitCode = await fn(g, log, session, (code) => void finish(code, 2_000));
        if (session.jobCodeFailed) state.exitCode = ExitCode.Failed;
      } finally {
        guard.remove();
      }
    } catch (thrown) {
      // Stopped by a signal while starting: that was printed, and the process is on its way out.
      if (stoppedBy) return;
      // The job's code threw outside run() or let a promise reject: that was printed (and
      // --json'd), and closing the runner stopped the run, which the command throws now: not a
      // second outcome, and the exit code stays 1.
      if (session.jobCodeFailed) {
        state.exitCode = ExitCode.Failed;
        return;
      }
      // Whatever the command ends with is printed (and --json'd): a job file that threw while
      // loading, or params its schema refused, with DATABASE_URL in the message, shows it masked.
      const runtime = await import('./cli-runtime.ts');
      // The embedded server's role is postgres.
      const err = runtime.statementTimeoutRefusal(
        g.databaseUrl ? runtime.redactError(thrown, g.databaseUrl) : thrown,
        g.databaseUrl ?? 'postgres://postgres@localhost',
        g.databaseUrl ? (g.databaseUrlFrom ?? '--database-url') : undefined,
      );
      state.exitCode = exitCodeOf(err);
      // --json is for scripts: an outcome other than success is JSON on stdout too (the one-line
      // error still goes to stderr, and the exit code is the same).
      if (jsonError) process.stdout.write(`${JSON.stringify(jsonError(err))}\n`);
      // One line, control characters escaped; a job file's code frame (idem's own lines) stays below it.
      const msg = visibleError(err instanceof IdemError ? err.message : messageOf(err), err instanceof IdemError && err.code === 'idem.jobLoadFailed');
      // Busy (75: another process holds the run, or it is paused) is the expected outcome of cron
      // firing twice, not a failure: an info log line, so a cron mail filter or --log-level warn
      // keeps it quiet, while every real failure stays an `idem: error:` line.
      if (state.exitCode === ExitCode.Busy) log.info({ exitCode: state.exitCode, code: (err as IdemError).code }, `busy: ${msg}`);
      else process.stderr.write(`idem: error: ${msg}\n`);
      if (!(err instanceof IdemError)) log.debug({ err }, 'unexpected error');
    } finally {
      // Stopped while starting: finish() releases the session and exits by the signal (a command
      // that ended meanwhile must not exit first, with its own code).
      if (stopping) {
        state.exitCode = exitCodeOfSignal(stoppedBy!);
        await stopping;
      }
      // The same watchdog on the normal path: releasing the lock, pool and embedded server must
      // not hang the process.
      // A lost lock often means a dead network: closing the pool would wait on its sockets.
      // The exit code is set first, as in finish(): a close left waiting on nothing (no socket or
      // timer to keep the process alive) ended it with Node's 13, while --json said the command's.
      process.exitCode = state.exitCode;
      setTimeout(() => process.exit(state.exitCode), state.exitCode === ExitCode.LockLost ? 2_000 : 10_000).unref();
      await session.close();
    }
  };
  return { globals, runWithSession };
}

/**
 * pg's `pgpass` says why it ignores the password file ("WARNING: password file … has group or world
 * access; …") on stderr in its own words, at each connection it opens (twice as a command starts).
 * Said once instead, as an idem warning with the fix, and only when pg looks in the file (the server
 * asks for a password the URL and PGPASSWORD do not give).
 */
function onePasswordFileWarning(problem: string): void {
  let pgpass: { warnTo(stream: NodeJS.WritableStream): unknown };
  try {
    // The copy pg requires (its own dependency, not idem's).
    pgpass = createRequire(createRequire(import.meta.url).resolve('pg'))('pgpass') as typeof pgpass;
  } catch {
    return; // a pg without pgpass reads no password file
  }
  let said = false;
  pgpass.warnTo(
    new Writable({
      write(_chunk, _encoding, done) {
        if (!said) process.stderr.write(`idem: warning: ${problem}\n`);
        said = true;
        done();
      },
    }),
  );
}

/**
 * While a command runs (a job's code with it), job code that ends the process its own way does not
 * pass for idem's outcome: `process.exit(0)` mid-run exited 0 with the run unfinished, so cron or
 * CI took it for a success; an uncaught throw (in a timer) or an unhandled promise rejection printed
 * Node's stack trace. Each now ends with one `idem: error:` line (and --json's error object) and
 * exit 1: `process.exit()` keeps its own code unless it is 0; a throw or rejection releases the
 * session first, as a signal during start-up does: the runner closes, a chunk in flight gets the
 * close's grace (2 s) to finish, and the run is left unfinished (interrupted; crashed when a chunk
 * outlived the grace; succeeded when the chunk in flight was its last, which the command then does
 * not print as a second outcome). After `process.exit()` it is left as a crash leaves it. A `process.exit()` from a
 * job file's top level, while it loads, is a bad job file instead: exit 2, the file named.
 */
function guardAgainstJobCode(jsonError: ((err: unknown) => unknown) | undefined, mask: (text: string) => string, idemExits: () => number | undefined, finish: (code: number) => void): { remove(): void } {
  /** The one `idem: error:` line, and with --json the error object (its exit code the process's). */
  const say = (err: IdemError) => {
    if (jsonError) process.stdout.write(`${JSON.stringify(jsonError(err))}\n`);
    process.stderr.write(`idem: error: ${visibleError(err.message, false)}\n`);
  };
  const report = (what: string, run: string, exitCode: number = ExitCode.Failed) => {
    // A job's process.exit(3) keeps its 3.
    say(new IdemError('idem.jobCodeEnded', exitCode as ExitCode, mask(`the job's code ${what} while the command was running; ${run}: fix the job and run the same command again to resume (with --allow-changed-code if the fix changes the code of the job)`)));
  };
  const onExit = (code: number) => {
    const own = idemExits();
    if (own !== undefined) {
      // idem is on its way out (closing after a signal or a failure), and a job's process.exit(0)
      // came first: the exit code stays idem's.
      if (code !== own) process.exitCode = own;
      return;
    }
    // A job file's top level, while it loads: a bad job file (exit 2), no run begun.
    const loading = jobFileExit(code, new Error().stack ?? '');
    if (loading !== undefined) {
      say(new UsageError('jobLoadFailed', mask(loading)));
      process.exitCode = ExitCode.Usage;
      return;
    }
    report(`ended the process (process.exit(${code}))`, 'a run in flight is left unfinished (idem status shows it crashed)', code || ExitCode.Failed);
    if (!code) process.exitCode = ExitCode.Failed;
  };
  const onThrow = (err: unknown, origin: string) => {
    if (idemExits() !== undefined) return;
    const what = origin === 'unhandledRejection' ? 'let a promise reject with no one to catch it' : 'threw outside a chunk\'s run()';
    let message: string;
    try {
      message = messageOf(err);
    } catch {
      message = 'a value that cannot be read';
    }
    // The runner closes: chunks in flight get the close's grace to finish, no new one starts.
    report(`${what} (${message})`, 'no new chunk starts, a run in flight stops once its chunks in flight end (idem status shows how it ended)');
    finish(ExitCode.Failed);
  };
  process.on('exit', onExit);
  process.on('uncaughtException', onThrow);
  return {
    remove() {
      process.off('exit', onExit);
      process.off('uncaughtException', onThrow);
    },
  };
}

/** The variables that name a server to libpq (and pg, under a URL that leaves them out). */
const LIBPQ_SERVER_VARIABLES = ['PGHOST', 'PGPORT', 'PGDATABASE'] as const;

/** DATABASE_URL, or the URL of the embedded server under .idem/ (started if needed, released when the session ends). */
export async function databaseUrl(g: GlobalOptions, log: Logger, session: Session): Promise<string> {
  const source = g.databaseUrlFrom ?? '--database-url';
  checkDatabaseSource(g);
  if (g.databaseUrl) {
    const { redactUrl, refuseUnsupportedUrl } = await import('./cli-runtime.ts');
    refuseUnsupportedUrl(g.databaseUrl, source);
    log.debug({ database: redactUrl(g.databaseUrl) }, 'using database');
    return g.databaseUrl;
  }
  const { startEmbeddedPostgres } = await import('./embedded-postgres.ts');
  session.startup.signal.throwIfAborted();
  // Registered before it is up: a signal meanwhile makes the start give up (initdb killed, its
  // leftovers and lock removed; a server it started released again) and closing waits for that.
  session.embeddedStarting = true;
  const starting = startEmbeddedPostgres({ dataDir: path.resolve('.idem', 'pg'), onLog: (msg) => log.info(msg), signal: session.startup.signal }).finally(() => (session.embeddedStarting = false));
  session.defer(async () => (await starting.catch(() => undefined))?.release());
  return (await starting).url;
}

/** Neither DATABASE_URL (nor --database-url) nor an embedded server under .idem/ yet: no database holds a run. */
export function noDatabaseYet(g: GlobalOptions): boolean {
  return g.databaseUrl === undefined && !existsSync(path.resolve('.idem', 'pg'));
}

/**
 * For a command that only reads (status, list) or acts on runs that exist (pause, resume, cancel,
 * reset, prune): true when there is no database to ask, with neither DATABASE_URL (nor
 * --database-url) nor an embedded server under .idem/. There are no runs then, and the command
 * answers from the files alone: making an embedded server (initdb, ~40 MB) to find nothing in it
 * is not its business, least of all in a folder that is not a project. Where neither the jobs nor
 * the migrations folder is there either, idem was started outside the project's root: refused,
 * exit 2, as `idem run` refuses (`job`: the name the command was given, which the refusal names).
 */
export function withoutDatabase(g: GlobalOptions, job?: string): boolean {
  checkDatabaseSource(g);
  if (!noDatabaseYet(g)) return false;
  refuseOutsideProject(g, job);
  return true;
}

/**
 * Refused (exit 2) when neither the jobs nor the migrations folder is there: idem was started
 * outside the project's root (a subfolder, a deploy's wrong directory). For the commands that answer
 * without a database (withoutDatabase) and for `idem migrate`, which would otherwise migrate nothing
 * into a database it made or into idem's schema it wrote, and exit 0. `job`: the name the command
 * was given, which the refusal names.
 */
export function refuseOutsideProject(g: GlobalOptions, job?: string): void {
  if (!existsSync(path.resolve(g.jobsDir)) && !existsSync(path.resolve(g.migrationsDir))) {
    // A folder given by flag is checked up front by the commands that read it; prune, pause and the
    // like do not, so one given to them can be missing here: named by its flag, not told to pass it.
    const jobsGiven = g.jobsDir !== DEFAULT_JOBS_DIR;
    const migrationsGiven = g.migrationsDir !== DEFAULT_MIGRATIONS_DIR;
    const hint =
      jobsGiven && migrationsGiven
        ? `--jobs-dir ${g.jobsDir} and --migrations-dir ${g.migrationsDir}: no such folders; fix the paths`
        : jobsGiven || migrationsGiven
        ? `${jobsGiven ? `--jobs-dir ${g.jobsDir}` : `--migrations-dir ${g.migrationsDir}`}: no such folder (nor a ${jobsGiven ? g.migrationsDir : g.jobsDir}/ folder in ${process.cwd()}); fix the path, or run idem in your project's root`
        : `there is no ${g.jobsDir}/ or ${g.migrationsDir}/ folder in ${process.cwd()}; run idem in your project's root, pass --jobs-dir, or create one with idem init`;
    throw job === undefined ? new UsageError('missingFolder', hint) : new UsageError('unknownJob', `no job named ${quotedName(job)}: ${hint}`);
  }
}

/** The refusals of a database URL that is no use, before it is used: set but empty, or PG* variables without it. */
function checkDatabaseSource(g: GlobalOptions): void {
  const source = g.databaseUrlFrom ?? '--database-url';
  // Set but empty (a CI secret that is missing): not the embedded server's cue, which a deploy's
  // idem migrate would otherwise take, migrating a throwaway database and exiting 0.
  if (g.databaseUrl === '') {
    throw new UsageError('invalidDatabaseUrl', `${source} is set but empty; set it to postgres://user:password@host:5432/db, or unset it to use the embedded server under .idem/`);
  }
  if (g.databaseUrl === undefined) {
    // libpq's variables name a server, which idem reads only through a URL: without one the
    // embedded server would be used instead, silently.
    const named = LIBPQ_SERVER_VARIABLES.filter((v) => process.env[v]);
    if (named.length > 0) {
      throw new UsageError(
        'invalidDatabaseUrl',
        `${named.join(', ')} ${named.length === 1 ? 'is' : 'are'} set but DATABASE_URL is not, and idem takes its server only from DATABASE_URL or --database-url; set DATABASE_URL=postgres:/// to connect as the PG* variables say, or unset ${named.length === 1 ? 'it' : 'them'} to use the embedded server under .idem/`,
      );
    }
  }
}

/**
 * The params fingerprint of job's run `key`, read on a connection of its own that writes nothing
 * (not even idem's schema), or null: no such run, no schema yet, or the database not to be asked.
 * For params the job's validator refuses: those a run stores (its validator's output) are that
 * run's, and not validated again (see storedParamsGiven in runner.ts).
 */
export async function storedRunFingerprint(url: string, schema: string, job: string, key: string): Promise<string | null> {
  if (!/^[a-z_][a-z0-9_]{0,62}$/i.test(schema)) return null;
  const { default: pg } = await import('pg');
  // A server that does not answer within 3 s is not waited on: the params error is the answer then.
  const client = new pg.Client({ connectionString: url, connectionTimeoutMillis: 3_000 });
  client.on('error', () => {});
  try {
    await client.connect();
    const { rows } = await client.query<{ there: boolean }>('select to_regclass($1) is not null as there', [`"${schema}".runs`]);
    if (!rows[0]?.there) return null;
    const found = await client.query<{ fingerprint: string }>(`select fingerprint from "${schema}".runs where job = $1 and run_key = $2`, [job, key]);
    return found.rows[0]?.fingerprint ?? null;
  } catch {
    return null;
  } finally {
    await client.end().catch(() => {});
  }
}

/**
 * Opens a Runner on DATABASE_URL, or on the embedded server under .idem/ when none is given (or on
 * `url`, from databaseUrl). `access`: `write` creates or upgrades idem's schema (a command that
 * starts runs); `existing` (pause, resume, cancel, reset, prune) and `read` (status, list, a dry
 * run: SELECT is all it needs) create nothing where the schema is not there yet: there are no runs.
 */
export async function openRunner(g: GlobalOptions, log: Logger, session: Session, poolSize = 10, url?: string, beforeSchema?: RunnerOptions['beforeSchema'], access: 'write' | 'existing' | 'read' = 'write'): Promise<Runner> {
  // The runner brings kysely and pg: loaded by the commands that talk to the database, when they do.
  const [{ Runner }, connectionString] = await Promise.all([import('./cli-runtime.ts'), url ?? databaseUrl(g, log, session)]);
  // IDEM_IDLE_IN_TRANSACTION_TIMEOUT_MS: for tests, which cannot stall a worker for the default 60 s.
  const idle = testHookMs('IDEM_IDLE_IN_TRANSACTION_TIMEOUT_MS');
  const runner = await Runner.connect({
    connectionString,
    schema: g.schema,
    log,
    poolSize,
    ...(idle !== undefined ? { idleInTransactionTimeoutMs: idle } : {}),
    ...(beforeSchema ? { beforeSchema } : {}),
    ...(access === 'read' ? { readOnly: true } : {}),
    ...(access === 'existing' ? { createSchema: false } : {}),
    // The connection string given (not the embedded server's): a connection error's fix names its source.
    ...(g.databaseUrl && (url === undefined || url === g.databaseUrl) ? { connectionSource: g.databaseUrlFrom ?? '--database-url' } : {}),
  });
  session.defer(() => runner.close());
  return runner;
}

/**
 * An operator command (pause, resume, cancel, reset, prune) stopped by a signal cancels its
 * statements: one waiting on a lock went on server-side after the process had exited 130, and took
 * effect when the lock was released. Cancelled, it has no effect at all.
 */
export async function cancelStatementsOnStop(session: Session): Promise<void> {
  const { cancelStatements } = await import('./cli-runtime.ts');
  if (session.startup.signal.aborted) cancelStatements();
  else session.startup.signal.addEventListener('abort', () => cancelStatements(), { once: true });
}

/** Removes bin/idem.js's handlers of a signal while idem loads: from here the session's own handle it. */
function dropEarlySignals(): void {
  const early = (globalThis as Record<symbol, unknown>)[Symbol.for('idem.earlySignal')] as ((sig: NodeJS.Signals) => void) | undefined;
  if (!early) return;
  for (const sig of STOP_SIGNALS) process.off(sig, early);
}

/** The error a signal during a command's start-up ends it with (its --json error object's). */
export function startupInterruption(sig: StopSignal): InterruptedError {
  return new InterruptedError(sig, `stopped by ${sig} while starting; run the same command again`);
}

/** What a signal does before installSignals: set by runWithSession. */
let onStartupSignal: (sig: StopSignal) => void = () => {};
const startupSignal: Record<StopSignal, () => void> = {
  SIGINT: () => onStartupSignal('SIGINT'),
  SIGTERM: () => onStartupSignal('SIGTERM'),
  SIGHUP: () => onStartupSignal('SIGHUP'),
};

/**
 * Graceful first, forceful second: the first SIGINT/SIGTERM stops new chunks and lets in-flight
 * ones finish; a second signal, or the deadline, aborts the job code and exits (Postgres rolls
 * back whatever was in flight, so nothing is half-done).
 */
export function installSignals(log: Logger, deadlineSeconds: number, onForce: (code: number) => void) {
  /** Whether a chunk may be in flight at the deadline; a command that knows (idem serve) says so with `chunksInFlight`. */
  let inFlight = () => true;
  dropEarlySignals();
  for (const sig of STOP_SIGNALS) process.off(sig, startupSignal[sig]);
  const stop = new AbortController();
  const abort = new AbortController();
  const handler = (sig: StopSignal) => {
    // A terminal that hung up: before the first line written to it fails.
    if (sig === 'SIGHUP') detachHungUpTerminal();
    const code = exitCodeOfSignal(sig);
    if (!stop.signal.aborted) {
      log.warn({ signal: sig, deadlineSeconds }, 'stopping: no new chunks; in-flight chunks may finish (signal again to abort them)');
      stop.abort(new InterruptedError(sig));
      setTimeout(() => {
        // Without a chunk in flight nothing is aborted: what held the stop was not a run's, and no error.
        if (inFlight()) log.error('shutdown deadline passed; aborting in-flight chunks');
        else log.warn({ deadlineSeconds }, 'shutdown deadline passed with no chunk in flight; exiting');
        abort.abort(new InterruptedError(sig));
        onForce(code);
      }, deadlineSeconds * 1000).unref();
    } else {
      log.error({ signal: sig }, 'second signal; aborting in-flight chunks');
      abort.abort(new InterruptedError(sig));
      onForce(code);
    }
  };
  // SIGHUP: the terminal closed (an ssh session dropped, the shell that started idem exited).
  // Node's default ended the process there and then, the run left `running` until it was taken for crashed.
  for (const sig of STOP_SIGNALS) process.on(sig, () => handler(sig));
  return {
    stop: stop.signal,
    abort: abort.signal,
    /** Tells the deadline whether chunks are in flight (by default it takes it that they are). */
    chunksInFlight(check: () => boolean): void {
      inFlight = check;
    },
  };
}
