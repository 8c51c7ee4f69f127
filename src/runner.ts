import { setMaxListeners } from 'node:events';
import { CompiledQuery, sql, type Kysely } from 'kysely';
import type { Logger } from 'pino';
import { acquireAdvisoryLock, lockHolders, type HeldLock } from './advisory-lock.ts';
import { looksDead, SILENT_SECONDS_SQL, silentSecondsOf, type LockHolder } from './lock-holder.ts';
import { describeConnectError, isStatementTimeout, openDatabase, redactError, statementTimeoutOrigin, statementTimeoutRefusal, type Database } from './database.ts';
import { BusyError, CancelledError, codeOf, DatabaseUnavailableError, givenValue, RETRY_OR_WAIT, errorFields, FencedError, IdemError, InterruptedError, messageOf, STOP_SIGNALS, type StopSignal, LockLostError, ParamsMismatchError, PausedError, PauseWithdrawnError, RunFailedError, UsageError } from './errors.ts';
import { ChunkFailure, DEFAULT_PLAN_WINDOW, executeSteps, type Progress } from './executor.ts';
import type { ThrottleOptions } from './throttle.ts';
import { fingerprint, lockKey } from './fingerprint.ts';
import { adoptCodeFingerprint, codeFingerprint, recordCodeFingerprint, refuseChangedCode, short } from './code-fingerprint.ts';
import { recordedFailure } from './finalize.ts';
import { assertNotStandby, refuseOnStandby, type HealthSetting } from './health-check.ts';
import { assertJob, migrationProblems, paramsProblem, validateParams, type Job, type Json } from './job.ts';
import { keyLabel } from './key-label.ts';
import { faultPoint } from './fault-points.ts';
import { silentLogger } from './log.ts';
import { answerWithin, sleep } from './sleep.ts';
import { beingDeletedMessage, doneChunks, finishDeletion, isLive, lastChange, pruneRuns, stalledSeconds, requestControl, resetRun, resumeRun, runIsLive, type ControlResult, type HeldLocks, type OperationsHost, type PruneResult } from './operations.ts';
import { databaseOutage, isConnectionTrouble, isLockTimeout, isRetryable, lockWaitCutShort, outageDelayMs, retrying } from './retry.ts';
import { ensureRunnerSchema, lostPrivilegeRefusal } from './schema/runner-migrations.ts';
import { documentedError, Store, toAttemptStart, type AttemptStart, type RunRow, type RunSummary } from './store.ts';
import { checkRunKey } from './run-key.ts';
import { refuseBadRunOptions, shown } from './run-options.ts';
import { unknownKeys } from './suggest.ts';
import { POSTGRES_NAME_BYTES, WORKER } from './worker-identity.ts';

/** Default size of the work pool (RunnerOptions.poolSize). */
export const DEFAULT_POOL_SIZE = 10;
/** Connections a run needs beside one per concurrent chunk: the planner's prefetch, and effects and control polls. */
export const POOL_HEADROOM = 2;

/** Every key of RunnerOptions; any other is refused (a typo such as `poolsize` would otherwise do nothing). */
const RUNNER_OPTION_KEYS: ReadonlyArray<keyof RunnerOptions> = ['connectionString', 'schema', 'log', 'poolSize', 'idleInTransactionTimeoutMs', 'lockIdleTimeoutMs', 'beforeSchema', 'readOnly', 'createSchema', 'connectionSource'];

/** What other libraries and habits call the connection string. */
const CONNECTION_STRING_ALIASES: Readonly<Record<string, string>> = Object.fromEntries(
  ['databaseUrl', 'databaseURL', 'database_url', 'DATABASE_URL', 'dbUrl', 'url', 'URL', 'uri', 'connection', 'connectionUrl', 'connectionURL', 'connectionUri', 'connString', 'dsn'].map((k) => [k, 'connectionString']),
);

const URL_FORM = 'a postgres://user:password@host:5432/db URL';

/**
 * Runner.connect's options, checked before anything connects: an unknown key named with the one
 * meant (`databaseUrl` → `connectionString`), a missing or non-string connection string.
 */
function refuseBadOptions(given: unknown): void {
  if (given === null || typeof given !== 'object') {
    throw new UsageError('invalidOptions', `Runner.connect(options): options must be an object with connectionString: ${URL_FORM}`);
  }
  const problems = unknownKeys(given, RUNNER_OPTION_KEYS, '', CONNECTION_STRING_ALIASES);
  const cs = (given as { connectionString?: unknown }).connectionString;
  const aliased = Object.keys(given).some((k) => Object.hasOwn(CONNECTION_STRING_ALIASES, k));
  if (cs === undefined && !aliased) problems.push(`connectionString is required: ${URL_FORM}`);
  else if (cs !== undefined && typeof cs !== 'string') problems.push(`connectionString must be a string (got ${cs === null ? 'null' : `a${typeof cs === 'object' ? 'n' : ''} ${typeof cs}`}): ${URL_FORM}`);
  problems.push(...optionValueProblems(given as Record<string, unknown>));
  if (problems.length > 0) throw new UsageError('invalidOptions', `Runner.connect(): invalid options: ${problems.join('; ')}`);
}

/**
 * Runner.connect's option values that cannot work, refused before connecting: a poolSize below
 * what a run needs (1 waited 10 s and said "cannot connect to the database"; -1 left a
 * top-level-await script to exit 13 silently; 0, 2 and 1.5 were taken and every run() was then
 * refused, idem.poolTooSmall), a timeout below its bound, a flag that is not a boolean.
 */
function optionValueProblems(o: Record<string, unknown>): string[] {
  const problems: string[] = [];
  const minPool = 1 + POOL_HEADROOM;
  if (o.poolSize !== undefined && !(Number.isInteger(o.poolSize) && (o.poolSize as number) >= minPool)) {
    problems.push(`poolSize must be an integer >= ${minPool}: a run needs a connection per concurrent chunk plus ${POOL_HEADROOM} (planning ahead, effects and control polls) (got ${shown(o.poolSize)})`);
  }
  const lockIdle = o.lockIdleTimeoutMs;
  if (lockIdle !== undefined && !(Number.isInteger(lockIdle) && (lockIdle === 0 || (lockIdle as number) >= 20_000))) {
    problems.push(`lockIdleTimeoutMs must be 0 (off) or an integer of at least 20000 ms, ten of the lock's 2 s checks (got ${shown(lockIdle)})`);
  }
  const idle = o.idleInTransactionTimeoutMs;
  if (idle !== undefined && !(Number.isInteger(idle) && (idle as number) >= 0)) problems.push(`idleInTransactionTimeoutMs must be an integer number of ms >= 0, 0 turning it off (got ${shown(idle)})`);
  for (const k of ['readOnly', 'createSchema']) if (o[k] !== undefined && typeof o[k] !== 'boolean') problems.push(`${k} must be true or false (got ${shown(o[k])})`);
  for (const k of ['schema', 'connectionSource']) if (o[k] !== undefined && typeof o[k] !== 'string') problems.push(`${k} must be a string (got ${shown(o[k])})`);
  if (o.beforeSchema !== undefined && typeof o.beforeSchema !== 'function') problems.push(`beforeSchema must be a function (got ${shown(o.beforeSchema)})`);
  if (o.log !== undefined && (o.log === null || typeof (o.log as { child?: unknown }).child !== 'function')) problems.push('log must be a pino Logger (an object with child())');
  return problems;
}

/**
 * A schema name idem may keep its tables under: a plain identifier (it is quoted as given), not a
 * system schema (`pg_*`, where PostgreSQL refuses or a superuser would write into its catalogs;
 * `information_schema`), at most 63 bytes (PostgreSQL would cut a longer one, so two long names could
 * meet in one schema). Refused before connecting: nothing is created.
 */
function refuseSchemaName(schema: string): void {
  if (!/^[a-z_][a-z0-9_]*$/i.test(schema)) {
    throw new UsageError('invalidSchema', `schema name ${JSON.stringify(schema)} is not a plain identifier; use letters, digits and _`);
  }
  if (schema.length > POSTGRES_NAME_BYTES) {
    throw new UsageError(
      'invalidSchema',
      `schema name "${schema.slice(0, 40)}…" is ${schema.length} bytes long, and PostgreSQL keeps the first ${POSTGRES_NAME_BYTES} of a name (two long names could meet in one schema); use a name of at most ${POSTGRES_NAME_BYTES} bytes`,
    );
  }
  const system = schema.startsWith('pg_') ? 'the pg_ prefix is reserved' : schema === 'information_schema' ? "the SQL standard's catalog views" : null;
  if (system) throw new UsageError('invalidSchema', `schema name "${schema}" is a PostgreSQL system schema (${system}), where idem must not create its tables; use a schema of its own (the default is ${DEFAULT_SCHEMA})`);
}

/**
 * A job given to run() or migrate(), checked as the CLI's loader and idem/testing check one, before
 * anything is written: a plain object (not defineJob's) ran as far as it got, a failed run with
 * JS's "Cannot read properties of undefined (reading 'map')" for missing steps, and a name the CLI
 * refuses was stored. The caller's object is what runs (the code fingerprint knows a job file's
 * hash by it); the checked copy assertJob returns is dropped. The check is cheap (no I/O).
 */
function refuseBadJob(job: unknown, origin: string): void {
  if (job === null || typeof job !== 'object') {
    const got = job === null ? 'null' : job === undefined ? 'undefined' : `a ${typeof job}`;
    throw new UsageError('invalidJob', `${origin}: the job must be a job definition (what defineJob returns), got ${got}`);
  }
  assertJob(job, origin);
}

/**
 * Runner.migrate's list, checked as `idem migrate` checks its folder before anything is written:
 * an array of { runKey, job }, each run key valid and given once (two migrations under one key
 * would be one run: the second found done), each job valid and a migration's (no params, no schedule).
 */
function refuseBadMigrations(migrations: unknown): void {
  const fn = 'Runner.migrate()';
  if (!Array.isArray(migrations)) {
    const got = migrations === null ? 'null' : typeof migrations === 'object' ? 'an object' : `a ${typeof migrations}`;
    throw new UsageError('invalidMigration', `${fn}: migrations must be an array of { runKey, job } (got ${got})`);
  }
  const seen = new Map<string, number>();
  migrations.forEach((m: unknown, i) => {
    if (m === null || typeof m !== 'object' || Array.isArray(m)) throw new UsageError('invalidMigration', `${fn}: migrations[${i}] must be an object { runKey, job }`);
    const unknown = unknownKeys(m, ['runKey', 'job'], `migrations[${i}]: `);
    if (unknown.length > 0) throw new UsageError('invalidMigration', `${fn}: ${unknown.join('; ')}`);
    const { runKey, job } = m as { runKey: unknown; job: unknown };
    checkRunKey(runKey as string, `migration key of job "${(job as Job | null)?.name}"`);
    refuseBadJob(job, `${fn}: migration ${runKey as string}`);
    const problems = migrationProblems(job as Job);
    if (problems.length > 0) throw new UsageError('invalidMigration', `${fn}: migration ${runKey as string}: ${problems.join('; ')}`);
    const first = seen.get(runKey as string);
    if (first !== undefined) throw new UsageError('invalidMigration', `${fn}: run key "${runKey as string}" is given twice (migrations[${first}] and migrations[${i}]); give each migration a run key of its own`);
    seen.set(runKey as string, i);
  });
}

/** Default name of the schema holding idem's own tables. */
export const DEFAULT_SCHEMA = 'idem';

export interface RunnerOptions {
  /** Postgres connection string. Required (the CLI falls back to DATABASE_URL, then an embedded server). */
  readonly connectionString: string;
  /** Schema for idem's own tables. Defaults to `idem`. */
  readonly schema?: string;
  /** Root logger. Defaults to a silent one. */
  readonly log?: Logger;
  /**
   * Most connections the work pool opens (the lock takes one more). A run needs its concurrency
   * plus 2 (planning ahead, effects and control polls beside the chunks' transactions); a run that
   * asks for more concurrency than that is refused rather than left to deadlock. Runs in flight at
   * once share the pool: their concurrencies added up, plus the 2, must fit, or the run that does
   * not fit beside the others is refused at once (idem.poolTooSmall, exit 2). Defaults to `10`.
   */
  readonly poolSize?: number;
  /**
   * `idle_in_transaction_session_timeout` of the work sessions, in ms: the server ends a chunk's
   * session that has sat idle inside its transaction this long (a vanished or stalled process), so
   * another worker can redo the chunk. 0 turns it off. Defaults to `60000`.
   */
  readonly idleInTransactionTimeoutMs?: number;
  /**
   * `idle_session_timeout` of the lock session, in ms (PostgreSQL 14+): the server ends it, freeing
   * the job's lock, once this process has sent nothing on it for this long. A live idem checks its
   * lock every 2 s, so only a process that went silent meets it: stopped (SIGSTOP, a frozen VM), its
   * host gone behind a proxy (PgBouncer) that keeps the server's side alive, or a job blocking
   * Node's event loop that long (then the run stops, exit 69: raise it, or 0 turns it off, for
   * such jobs). At least 20 000 (10 checks). Defaults to `60000`.
   */
  readonly lockIdleTimeoutMs?: number;
  /**
   * @internal Runs on the connected database before idem's schema is created or upgraded; what it
   * throws closes the connections and is thrown by connect (the CLI refuses an unknown job name
   * here, so that refusal writes nothing, not even the schema).
   */
  readonly beforeSchema?: (db: Kysely<any>, schema: string) => Promise<void>;
  /**
   * Connect to read only (status, list): idem's tables need just SELECT then, not INSERT, UPDATE
   * and DELETE, so a monitoring role can use it; writing through it fails with PostgreSQL's
   * permission error. A schema that is not there yet is not created (schemaExists is false: no
   * runs); one older than this idem is still upgraded (that takes its owner). Defaults to `false`.
   */
  readonly readOnly?: boolean;
  /**
   * @internal False: a database without idem's schema is left without it (schemaExists false: there
   * are no runs). The CLI's operator commands (pause, resume, cancel, reset, prune), which have
   * nothing to act on there. Defaults to `true` (`false` when readOnly).
   */
  readonly createSchema?: boolean;
  /** @internal Where connectionString came from, as a connection error's fix names it (the CLI: `--database-url` or `DATABASE_URL`). */
  readonly connectionSource?: string;
}

/** Options of {@link Runner.migrate}. */
export interface MigrateOptions extends Omit<RunJobOptions, 'key' | 'params' | 'dryRun'> {
  /**
   * Called with each migration as idem starts checking or running it, and with `null` while it
   * waits for the migrate lock: what a thrown error was about (`idem migrate --json` names it).
   */
  readonly onMigration?: (migration: { readonly runKey: string; readonly job: Job } | null) => void;
  /** Called with each migration's outcome as it is known (those found done first): the outcomes so far when one fails. */
  readonly onOutcome?: (outcome: RunOutcome) => void;
}

export interface RunJobOptions {
  /** Raw params, validated by the job's schema. Defaults to `{}`. */
  readonly params?: unknown;
  /** The run's idempotency key. Defaults to the params fingerprint. */
  readonly key?: string;
  /** Chunks run at once within this process. Defaults to `1`. */
  readonly concurrency?: number;
  /** When another process holds the lock: `false` fail at once (busy), `true` wait, n wait n seconds. Defaults to `false`. */
  readonly wait?: boolean | number;
  /**
   * When the run is live in other processes, join them as one more worker instead of failing busy
   * (when nothing is live, start it as usual). Only processes on the same run key join, whether the
   * run's first process joined or not; a plain run (`join` false) never starts beside another
   * process. Defaults to `false`.
   */
  readonly join?: boolean;
  /** Report what would run without writing anything. Defaults to `false`. */
  readonly dryRun?: boolean;
  /**
   * Aborting stops the run gracefully: no new chunk starts, in-flight ones finish, the run ends
   * `interrupted` and run() rejects with an InterruptedError (exit 143; 130 for the reason
   * 'SIGINT'), whatever the abort's reason. A later run of the key resumes it.
   */
  readonly signal?: AbortSignal;
  /** Aborting makes the job's `ctx.signal` abort too (second Ctrl-C, shutdown deadline). */
  readonly abortSignal?: AbortSignal;
  /** Chunks planned per call of a chunk source. Defaults to `100`. */
  readonly planWindow?: number;
  /** Retry chunks skipped under a step's `maxFailedChunks` policy, even in a succeeded run. Defaults to `false`. */
  readonly retrySkipped?: boolean;
  /** The cron slot this run is for; exposed to steps as `ctx.slot`. Defaults to `null`. */
  readonly slot?: Date | null;
  /** Throttling that overrides the job's and steps' own. */
  readonly throttle?: ThrottleOptions;
  /** Progress after every committed chunk (for a progress line). */
  readonly onProgress?: (p: Progress) => void;
  /** How often the live run checks for an operator's pause/cancel, in ms. Defaults to `1000`. */
  readonly controlPollMs?: number;
  /** Resume a run started under other job code (recorded on the run). Defaults to `false`: refused, exit 65. */
  readonly allowChangedCode?: boolean;
  /** `false`: a failed run is not resumed; its recorded error is thrown instead (finalize). Defaults to `true`. */
  readonly resumeFailed?: boolean;
  /** Health checks that override the job's and steps' (`false`: none). Defaults to theirs. */
  readonly health?: HealthSetting;
}

export type RunStatusOutcome = 'succeeded' | 'already-succeeded' | 'dry-run';

export interface RunOutcome {
  readonly status: RunStatusOutcome;
  readonly job: string;
  readonly runKey: string;
  readonly runId: string | null;
  readonly attempt: number;
  readonly summary: RunSummary | null;
  /** Chunks this invocation committed (0 for a no-op rerun). */
  readonly executed: number;
  /** How long this invocation's attempt took (the summary's durationMs spans every attempt). */
  readonly elapsedMs?: number;
  /** For a dry run: the run's state as idem status says it (`new`, `crashed` for a run whose process died, else its status) and the steps that would run. */
  readonly plan?: { readonly state: string; readonly steps: ReadonlyArray<{ readonly name: string; readonly chunked: boolean }> };
  /** For `retrySkipped`: the steps after the retried chunks that had run, and ran again after them (absent when none). */
  readonly rerunSteps?: readonly string[];
}

/** One process working a run. */
export interface RunWorker {
  /** The process's name, `host:pid` (worker-identity.ts). */
  readonly worker: string;
  /** Chunks it committed in the run's current attempt. */
  readonly chunks: number;
  /** Chunks per second it committed over the last minute. */
  readonly rate: number;
  /** Seconds since its lock session's last statement; null where the role may not see it. */
  readonly silentSeconds: number | null;
  /**
   * Silent far longer than a live idem allows (15 check intervals, 30 s): stopped, or its host gone
   * behind a proxy. Not counted in the run's rate and ETA; the server ends it after 60 s (14+).
   */
  readonly silent: boolean;
}

/** A run's state as `idem status` reports it. */
export interface RunStatusRow {
  readonly job: string;
  readonly runKey: string;
  readonly runId: string;
  /** The run's params, as stored: its validator's output (what the job's steps see as `ctx.params`). */
  readonly params: Json;
  /** `running` only while the backend that took this run's lock still holds it; a dead run's row says `crashed`. */
  readonly state: string;
  readonly attempt: number;
  readonly holder: string | null;
  readonly chunksDone: number;
  readonly chunksPlanned: number;
  readonly fullyPlanned: boolean;
  readonly createdAt: Date;
  readonly updatedAt: Date;
  readonly finishedAt: Date | null;
  readonly error: RunRow['error'];
  readonly summary: RunSummary | null;
  /** Chunks per second committed by the current attempt (while running). */
  readonly throughput: number | null;
  /** Total chunks expected: planned so far, or the sources' estimates where larger. */
  readonly estimatedChunks: number | null;
  /** Seconds left at the current throughput (while running, and not stalled). */
  readonly etaSeconds: number | null;
  /**
   * While running: seconds since the run's last committed chunk, when that is longer than
   * STALLED_AFTER_INTERVALS (operations.ts) times its usual interval between chunks this attempt and at least
   * STALLED_MIN_SECONDS (a worker stopped or stuck holding chunks); else null. No ETA then.
   */
  readonly stalledSeconds: number | null;
  /** A pause or cancel requested and not yet honoured. */
  readonly requested: 'pause' | 'cancel' | null;
  /** Chunks skipped under a step's skip policy (the first 20), with their errors. */
  readonly skipped: ReadonlyArray<{ readonly step: string; readonly key: string; readonly error: string | null; readonly attempts: number }>;
  /** Changes of job code an operator allowed between attempts (`--allow-changed-code`). */
  readonly codeChanges: ReadonlyArray<{ readonly from: string; readonly to: string; readonly attempt: number; readonly at: string }>;
  /** Why the live run waits for the database's health, and since when; else null. */
  readonly healthPause: { readonly reason: string; readonly since: string } | null;
  /** The processes working the run now (one, or several with `--join`): chunks each committed in this attempt, and chunks/s over the last minute. */
  readonly workers: ReadonlyArray<RunWorker>;
}

/**
 * The runner: owns the work pool and the store, and drives the protocol for one run at a time.
 * @example
 * const runner = await Runner.connect({ connectionString: process.env.DATABASE_URL! });
 * try { await runner.run(job, { params: { day: '2026-11-30' } }); } finally { await runner.close(); }
 */
export class Runner {
  readonly schema: string;
  readonly store: Store;
  readonly #database: Database;
  /** Aborted by close(): every run in flight stops gracefully. */
  readonly #closing = new AbortController();
  /** Runs in flight (run, migrate), settled or not: close() waits for them. */
  readonly #inFlight = new Set<Promise<void>>();
  /** The slots (concurrency) each run in flight (run, migrate) holds in the work pool; see #reservePool. */
  readonly #reserved = new Map<symbol, { readonly what: string; readonly slots: number }>();
  readonly #connectionString: string;
  #schemaExists = true;
  /** Where the connection string came from, as a connection error's fix names it. */
  readonly #connectionSource: string | undefined;
  readonly #log: Logger;
  /** No logger given (Runner.connect's `log`): what the caller must still hear goes to process.emitWarning. */
  readonly #quiet: boolean;
  readonly #poolSize: number;
  readonly #lockIdleTimeoutMs: number | undefined;

  private constructor(database: Database, opts: RunnerOptions, schema: string, log: Logger) {
    this.#database = database;
    this.#connectionString = opts.connectionString;
    this.#connectionSource = opts.connectionSource;
    this.#log = log;
    this.#quiet = opts.log === undefined;
    this.#poolSize = opts.poolSize ?? DEFAULT_POOL_SIZE;
    this.#lockIdleTimeoutMs = opts.lockIdleTimeoutMs;
    this.schema = schema;
    this.store = new Store(database.db, schema);
  }

  /** Connects, checks the server, and creates or upgrades the runner schema. */
  static async connect(given: RunnerOptions): Promise<Runner> {
    refuseBadOptions(given);
    // White space around the URL (an env file's line, a secret with its newline) is not part of it,
    // as for the CLI: pg would read a leading space as the host, a trailing one into the database name.
    const opts = typeof given?.connectionString === 'string' ? { ...given, connectionString: given.connectionString.trim() } : given;
    const schema = opts.schema ?? DEFAULT_SCHEMA;
    refuseSchemaName(schema);
    const log = opts.log ?? silentLogger();
    const database = await openDatabase(opts.connectionString, {
      poolSize: opts.poolSize ?? DEFAULT_POOL_SIZE,
      log,
      ...(opts.idleInTransactionTimeoutMs !== undefined ? { idleInTransactionTimeoutMs: opts.idleInTransactionTimeoutMs } : {}),
      ...(opts.connectionSource !== undefined ? { source: opts.connectionSource } : {}),
    });
    try {
      await opts.beforeSchema?.(database.db, schema);
      // A database that refuses writes (a standby, default_transaction_read_only) is said as a run's
      // claim would say it, also when it is the schema's creation that met it.
      const present = await refuseOnStandby(database.db, () =>
        retrying(() => ensureRunnerSchema(database.db, schema, opts.readOnly ? 'read' : 'write', !opts.readOnly && opts.createSchema !== false)),
      );
      const runner = new Runner(database, opts, schema, log);
      runner.#schemaExists = present;
      return runner;
    } catch (err) {
      await database.close();
      // A statement of idem's cut short by a statement_timeout (or lock_timeout): the refusal the
      // CLI gives (exit 2, idem.statementTimeout, naming where it is set), not PostgreSQL's bare 57014.
      throw statementTimeoutRefusal(err, opts.connectionString, opts.connectionSource);
    }
  }

  /** `err`, or when it is one of idem's own statements cut short by a timeout, the refusal Runner.connect gives for it. */
  #timeoutRefusal(err: unknown): unknown {
    return err instanceof IdemError ? err : statementTimeoutRefusal(err, this.#connectionString, this.#connectionSource);
  }

  /** `work`, with one of idem's own statements cut short by a timeout said as Runner.connect says it. */
  async #refusingTimeouts<T>(work: () => Promise<T>): Promise<T> {
    try {
      return await work();
    } catch (err) {
      throw this.#timeoutRefusal(err);
    }
  }

  /** An operator command (pause, resume, …): refused on a standby, its statements' timeouts said as connect says them. */
  #operate<T>(op: (h: OperationsHost) => Promise<T>): Promise<T> {
    return this.#refusingTimeouts(async () => {
      await assertNotStandby(this.db);
      return op(this.#ops());
    });
  }

  get db() {
    return this.#database.db;
  }

  /**
   * False for a read-only runner (`readOnly`, or `createSchema: false`) on a schema without idem's bookkeeping, which it left
   * as it was: it has no runs (status() lists none).
   */
  get schemaExists(): boolean {
    return this.#schemaExists;
  }

  /**
   * Closes the runner (idempotent). Runs in flight (run, migrate, finalizeRun) are stopped first, gracefully: no
   * new chunk starts, chunks in flight finish and commit, and each such run ends `interrupted` (its
   * promise rejects with InterruptedError, exit 143); a later run of the same key resumes it. Then
   * the pool closes. A run() after close() is refused.
   */
  async close(): Promise<void> {
    this.#closing.abort(
      new InterruptedError('SIGTERM', 'stopped by Runner.close(): chunks in flight finished, no new chunk started; finished chunks are kept, run it again to resume', { stoppedBy: 'Runner.close()' }),
    );
    await Promise.all(this.#inFlight);
    await this.#database.close();
  }

  /**
   * Runs `body` as a run in flight of this runner: refused once the runner is closed, and stopped
   * gracefully by close(). It gets the caller's signals as the run sees them: `signal` (stop) aborted
   * by the caller's or by close(), `abortSignal` (ctx.signal) by the caller's, each with an
   * InterruptedError for reason (see interruption()).
   */
  async #inFlightRun<T>(caller: { readonly signal?: AbortSignal; readonly abortSignal?: AbortSignal }, body: (signals: { signal: AbortSignal; abortSignal?: AbortSignal }) => Promise<T>): Promise<T> {
    if (this.#closing.signal.aborted) throw new UsageError('runnerClosed', 'this Runner was closed; open another with Runner.connect()');
    const undo: Array<() => void> = [];
    const follow = (sources: AbortSignal[]): AbortSignal => {
      const c = new AbortController();
      const onAbort = function (this: AbortSignal) {
        c.abort(interruption(this.reason));
      };
      for (const s of sources) {
        if (s.aborted) c.abort(interruption(s.reason));
        else {
          s.addEventListener('abort', onAbort, { once: true });
          undo.push(() => s.removeEventListener('abort', onAbort));
        }
      }
      return c.signal;
    };
    const signal = follow([this.#closing.signal, ...(caller.signal ? [caller.signal] : [])]);
    // Stopped before it started: nothing to record (a run row created only to read `interrupted`).
    if (signal.aborted) {
      for (const u of undo) u();
      throw signal.reason;
    }
    const running = body({ signal, ...(caller.abortSignal ? { abortSignal: follow([caller.abortSignal]) } : {}) });
    const settled = running.then(
      () => {},
      () => {},
    );
    this.#inFlight.add(settled);
    try {
      return await running;
    } catch (err) {
      // The database went away since connect(): reaching it failed before the run could start (a
      // lost connection later on is a lost lock or a chunk's failure, idem errors both). Said as
      // connect() says it, exit 2, not pg's bare `connect ECONNREFUSED` (exit 1, "the run failed").
      if (!(err instanceof IdemError) && UNREACHABLE.has(codeOf(err) ?? '')) throw describeConnectError(err, this.#connectionString, this.#connectionSource);
      // One of idem's own statements (claiming the run, its bookkeeping) cut short by a timeout: a
      // chunk's is the run's failure, an IdemError by now.
      throw this.#timeoutRefusal(err);
    } finally {
      this.#inFlight.delete(settled);
      for (const u of undo) u();
    }
  }

  /** Runs a job to completion (or finds it done). Throws an IdemError subclass on every other outcome. */
  async run(job: Job, opts: RunJobOptions = {}): Promise<RunOutcome> {
    refuseBadJob(job, 'Runner.run()');
    refuseBadRunOptions('Runner.run()', opts);
    return this.#inFlightRun(opts, (signals) => this.#run(job, { ...opts, ...signals }));
  }

  /** `reserved`: the run holds its share of the pool already (a --wait that starts over, below). */
  async #run(job: Job, opts: RunJobOptions, reserved = false): Promise<RunOutcome> {
    this.#checkConcurrency(opts.concurrency);
    if (opts.key !== undefined) checkRunKey(opts.key, 'key');
    let params: Json;
    let fp: string;
    try {
      params = (await validateParams(job, opts.params)) as Json;
      fp = fingerprint(params);
    } catch (err) {
      // Params that are an existing run's stored ones (see storedParamsGiven) are not validated again.
      const run = opts.key === undefined || !this.#schemaExists ? undefined : await this.store.findRun(job.name, opts.key);
      if (!run || !storedParamsGiven(opts.params, run)) throw err;
      ({ params, fingerprint: fp } = run);
    }
    const runKey = opts.key ?? fp;
    if (opts.dryRun) return this.#dryRun(job, runKey, fp, opts.allowChangedCode ?? false, opts.params, opts.join ?? false);
    // Before anything is written: a run refused here leaves no row.
    const release = reserved ? () => {} : this.#reservePool(opts.concurrency, `job "${job.name}" run ${shortKey(runKey)}`);
    try {
      return await this.#claimAndRun(job, runKey, params, fp, opts);
    } finally {
      release();
    }
  }

  async #claimAndRun(job: Job, runKey: string, params: Json, fp: string, opts: RunJobOptions): Promise<RunOutcome> {
    // A run a prune marked deleting and did not get to delete whole (killed between its batches)
    // is deleted here first, so that its key runs afresh, as it would have after that prune.
    for (let tries = 1; ; tries++) {
      const { run } = await refuseOnStandby(this.db, () => this.store.claimRun(job.name, runKey, params, fp));
      if (run.fingerprint !== fp && opts.key !== undefined && storedParamsGiven(opts.params, run)) ({ params, fingerprint: fp } = run);
      if (run.status === 'deleting' && tries <= 3) {
        await finishDeletion(this.#ops(), run.id, `run "${runKey}" of job "${job.name}"`);
        continue;
      }
      const outcome = await this.#runClaimed(job, run, runKey, params, fp, opts);
      if (outcome !== DELETING || tries > 3) return outcome === DELETING ? refuseDeleting(job.name, runKey) : outcome;
    }
  }

  /** Runs a claimed run: the lock, then the attempt. DELETING: a prune marked it meanwhile. */
  async #runClaimed(job: Job, run: RunRow, runKey: string, params: Json, fp: string, opts: RunJobOptions): Promise<RunOutcome | typeof DELETING> {
    checkFingerprint(job.name, runKey, run, fp);
    if (run.status === 'succeeded' && !(opts.retrySkipped && (run.summary?.skipped ?? 0) > 0)) return alreadyDone(run);
    refuseControlled(run);
    // Refusals that must write nothing come before the lock: taking it bumps the attempt.
    if (opts.resumeFailed === false && run.status === 'failed') throw recordedFailure(run);
    try {
      refuseChangedCode(run, job, opts.allowChangedCode ?? false);
    } catch (err) {
      const waitLeft = opts.join ? false : await this.#busyWhileLive(job, run, runKey, opts);
      if (waitLeft === false) throw err;
      // --wait waited for the live run to end: what it left is looked at afresh, within what is
      // left of the wait.
      return this.#run(job, { ...opts, wait: waitLeft }, true);
    }
    // Bookkeeping like the store's: idempotent, so a killed work session is retried, not fatal.
    await retrying(() => adoptCodeFingerprint(this.db, this.schema, run, job));

    // Every process on a run is a worker: it holds the job's lock shared and the run's own lock.
    // The first one in bumps the attempt; a plain run refuses to overlap anyone (busy, exit 75);
    // with `join`, a process finding the same run live joins it under that attempt.
    const lockName = this.jobLockName(job.name);
    const allowSucceeded = !!opts.retrySkipped;
    // A lock session killed while still waiting held nothing yet: simply open another.
    const lock = await this.#lockRidingOutages(opts.wait ?? false, opts.signal, (waitUntil) =>
      acquireAdvisoryLock({
        connectionString: this.#connectionString,
        name: lockName,
        what: `job "${job.name}"`,
        wait: opts.wait ?? false,
        ...(waitUntil !== undefined ? { waitUntil } : {}),
        ...(opts.signal ? { signal: opts.signal } : {}),
        ...(this.#lockIdleTimeoutMs !== undefined ? { idleSessionTimeoutMs: this.#lockIdleTimeoutMs } : {}),
        worker: {
          runName: this.runLockName(run.id),
          join: opts.join ?? false,
          first: this.store.beginAttemptSql(run.id, WORKER, lockName, lockKey(lockName), allowSucceeded, opts.retrySkipped ? job.steps.map((s) => s.name) : null),
          joiner: this.store.joinAttemptSql(run.id),
          runHeld: beingDeletedMessage(`run "${runKey}" of job "${job.name}"`),
        },
      }),
    );
    try {
      // Entered, but the run is gone: prune or reset deleted it after it was claimed above (and
      // let go of its lock before this process tried it). Its key is free again.
      if (!lock.entry) {
        const now = await this.store.findRun(job.name, runKey);
        if (now?.id !== run.id) {
          throw new BusyError(`run "${runKey}" of job "${job.name}" was deleted (idem prune or idem reset) while this process was starting it; run the command again to run the key afresh`);
        }
        // Marked by a prune that stopped part way through it: finish that deletion, then afresh.
        if (now.status === 'deleting') return DELETING;
      }
      const begin = async () => (lock.entry ? toAttemptStart(lock.entry) : null);
      return await this.#runLocked(job, run.id, params, lock, opts, begin);
    } finally {
      await lock.release();
    }
  }

  /**
   * Takes a lock with `acquire` (retrying a session killed before it held anything). With a wait,
   * the database going away meanwhile (stopped, restarting: the holder waited for is gone with it)
   * does not end the wait: the lock is tried again, on a new session, until the wait's deadline,
   * and a database still out of reach then is said as Runner.connect says it (exit 2). `acquire`
   * gets the deadline (ms since the epoch) of a numeric wait, so that a try again waits only
   * what is left of it.
   */
  async #lockRidingOutages<T>(wait: boolean | number, signal: AbortSignal | undefined, acquire: (waitUntil: number | undefined) => Promise<T>): Promise<T> {
    if (wait === false || wait === 0) return retrying(() => acquire(undefined));
    const deadline = wait === true ? Infinity : Date.now() + wait * 1000;
    const waitUntil = wait === true ? undefined : deadline;
    for (let tries = 0; ; tries++) {
      try {
        return await retrying(() => acquire(waitUntil));
      } catch (err) {
        if (!databaseOutage(err)) throw err;
        if (Date.now() >= deadline) throw this.unreachable(err);
        await sleep(outageDelayMs(tries, deadline), signal);
        if (signal?.aborted) throw interruption(signal.reason);
      }
    }
  }

  /**
   * @internal A database out of reach (see databaseOutage), said as Runner.connect says an
   * unreachable database: its URL (password masked) and the fix, exit 2. Anything else as it is.
   */
  unreachable(err: unknown): unknown {
    if (!databaseOutage(err)) return err;
    const cause = err instanceof DatabaseUnavailableError ? err.cause : err;
    return describeConnectError(cause, this.#connectionString, this.#connectionSource);
  }

  /**
   * A plain run (not `join`) refused before its lock (code changed since the run started) while the
   * run is live in other processes: busy first, as the lock would say under the same code (75; a
   * cron line firing during a deploy is not a failure), or with `wait`, waits for it to end and
   * returns what is left of the wait (true: no bound). False when the run is not live: the
   * refusal stands. A stop (signal, Runner.close()) while waiting ends the wait as an interruption.
   */
  async #busyWhileLive(job: Job, run: RunRow, runKey: string, opts: RunJobOptions): Promise<number | true | false> {
    const live = async () => {
      const now = await this.store.findRun(job.name, runKey);
      return now?.id === run.id && (await isLive(this.#ops(), now));
    };
    if (!(await live())) return false;
    if (!opts.wait) throw new BusyError(`job "${job.name}" is running in another process (run ${runKey}, under the code it started with)`, RETRY_OR_WAIT);
    const deadline = opts.wait === true ? Infinity : Date.now() + opts.wait * 1000;
    do {
      if (Date.now() >= deadline) throw new BusyError(`job "${job.name}" is still running in another process after waiting ${opts.wait}s (run ${runKey}); try again later`);
      await sleep(Math.min(500, deadline - Date.now()), opts.signal);
      if (opts.signal?.aborted) throw interruption(opts.signal.reason);
    } while (await live());
    return opts.wait === true ? true : Math.max(0, (deadline - Date.now()) / 1000);
  }

  /** The run's own advisory lock, held shared by every worker on it: "is this run live?" */
  runLockName(runId: string): string {
    return `${this.schema}:run:${runId}`;
  }

  /**
   * Runs ordered migrations under one lock: every pod of a deploy may call this at once; one works,
   * the others wait (by default) and then find each migration done.
   */
  async migrate(migrations: ReadonlyArray<{ readonly runKey: string; readonly job: Job }>, opts: MigrateOptions = {}): Promise<RunOutcome[]> {
    refuseBadMigrations(migrations);
    refuseBadRunOptions('Runner.migrate()', opts);
    return this.#inFlightRun(opts, (signals) => this.#migrate(migrations, { ...opts, ...signals }));
  }

  async #migrate(migrations: ReadonlyArray<{ readonly runKey: string; readonly job: Job }>, given: MigrateOptions): Promise<RunOutcome[]> {
    const opts: MigrateOptions = {
      ...given,
      ...(given.onOutcome ? { onOutcome: this.callerCallback('onOutcome', given.onOutcome) } : {}),
      ...(given.onMigration ? { onMigration: this.callerCallback('onMigration', given.onMigration) } : {}),
    };
    this.#checkConcurrency(opts.concurrency);
    const release = this.#reservePool(opts.concurrency, 'Runner.migrate()');
    try {
      return await this.#migrateReserved(migrations, opts);
    } finally {
      release();
    }
  }

  async #migrateReserved(migrations: ReadonlyArray<{ readonly runKey: string; readonly job: Job }>, opts: MigrateOptions): Promise<RunOutcome[]> {
    const outcomes: RunOutcome[] = [];
    const record = (outcome: RunOutcome) => {
      outcomes.push(outcome);
      opts.onOutcome?.(outcome);
    };
    const fp = fingerprint({});
    // Fast path: every migration already done means no lock and no waiting at all.
    const pending: Array<{ runKey: string; job: Job }> = [];
    for (const m of migrations) {
      opts.onMigration?.(m);
      const run = await this.store.findRun(m.job.name, m.runKey);
      if (run) checkFingerprint(m.job.name, m.runKey, run, fp);
      // Recorded by an idem from before migration runs were marked: mark it, so prune keeps it.
      if (run && run.kind !== 'migration') await refuseOnStandby(this.db, () => this.store.markMigration(run.id));
      if (run?.status === 'succeeded') record(alreadyDone(run));
      else pending.push(m);
    }
    if (pending.length === 0) return outcomes;
    opts.onMigration?.(null);
    const lock = await retrying(() =>
      acquireAdvisoryLock({
        connectionString: this.#connectionString,
        name: `${this.schema}:migrate`,
        what: 'idem migrate',
        wait: opts.wait ?? true,
        ...(opts.signal ? { signal: opts.signal } : {}),
        ...(this.#lockIdleTimeoutMs !== undefined ? { idleSessionTimeoutMs: this.#lockIdleTimeoutMs } : {}),
      }),
    );
    try {
      for (const m of pending) {
        opts.onMigration?.(m);
        const claim = () => refuseOnStandby(this.db, () => this.store.claimRun(m.job.name, m.runKey, {}, fp, 'migration'));
        let { run } = await claim();
        // Pruned part way by an idem from before migration runs were marked: finish it, run afresh.
        if (run.status === 'deleting') {
          await finishDeletion(this.#ops(), run.id, `migration ${m.runKey}`);
          ({ run } = await claim());
        }
        checkFingerprint(m.job.name, m.runKey, run, fp);
        if (run.status === 'succeeded') {
          record(alreadyDone(run));
          continue;
        }
        const begin = () => this.store.beginAttempt(run.id, WORKER, lock, opts.retrySkipped ? m.job.steps.map((s) => s.name) : null);
        record(await this.#runLocked(m.job, run.id, {}, lock, opts, begin));
      }
    } finally {
      await lock.release();
    }
    return outcomes;
  }

  /** Asks a run to pause (cooperatively, between chunks). Without a key: the job's latest unfinished run. */
  async pause(job: string, key?: string): Promise<ControlResult> {
    return this.#operate((h) => requestControl(h, job, 'pause', key));
  }

  /** Lets a paused run continue on its next invocation. */
  async resume(job: string, key?: string): Promise<ControlResult> {
    return this.#operate((h) => resumeRun(h, job, key));
  }

  /** Cancels a run (cooperatively); finished chunks are kept, the run never continues. */
  async cancel(job: string, key?: string): Promise<ControlResult> {
    return this.#operate((h) => requestControl(h, job, 'cancel', key));
  }

  /** Forgets a run so its key executes afresh; refused while it runs. */
  async reset(job: string, key: string): Promise<{ chunks: number; effects: number }> {
    return this.#operate((h) => resetRun(h, job, key));
  }

  /** Finishes deleting a run a killed prune left marked `deleting`, so its key runs afresh; busy while a prune or reset deletes it. */
  async finishDeletion(runId: string, what: string): Promise<void> {
    return this.#operate((h) => finishDeletion(h, runId, what));
  }

  /**
   * Deletes succeeded and cancelled runs older than `olderThanMs`, in batches; never a migration's
   * run. `migrationKeys`: the run keys of the migrations folder's files, so that a migration run
   * an older idem recorded (before runs were marked) is recognised and kept as well.
   */
  async prune(olderThanMs: number, opts: { readonly migrationKeys?: readonly string[] } = {}): Promise<PruneResult> {
    return this.#operate((h) => pruneRuns(h, olderThanMs, opts.migrationKeys ?? []));
  }

  /**
   * A chunk holds a pool connection for its whole transaction, and `ctx.effect` and the planner
   * need one more beside it: with every connection inside a chunk, they would wait forever.
   */
  #checkConcurrency(concurrency = 1): void {
    if (!Number.isInteger(concurrency) || concurrency < 1) {
      throw new UsageError('invalidConcurrency', `concurrency must be an integer >= 1 (got ${givenValue(concurrency)})`);
    }
    if (concurrency + POOL_HEADROOM > this.#poolSize) {
      throw new UsageError(
        'poolTooSmall',
        `concurrency ${concurrency} needs a pool of at least ${concurrency + POOL_HEADROOM} connections, but poolSize is ${this.#poolSize}; raise poolSize or lower concurrency`,
      );
    }
  }

  /**
   * Reserves a run's slots (its concurrency) in the work pool among the runs in flight in this
   * Runner, or refuses the run (idem.poolTooSmall, exit 2) when they do not fit beside theirs and
   * the POOL_HEADROOM connections the runs share for planning, effects and control polls (short
   * statements, never waiting on a chunk's row: they queue for those and always get one, as a
   * single run's slots do). Until 2026-12-04 each run was checked alone: runs started together
   * (Promise.all) whose slots took the whole pool stalled for 50-100 s, and one of them then ended
   * exit 69, "the run is interrupted". Returns what gives the slots back.
   */
  #reservePool(concurrency = 1, what: string): () => void {
    const held = [...this.#reserved.values()];
    const inUse = held.reduce((sum, r) => sum + r.slots, 0);
    if (held.length > 0 && inUse + concurrency + POOL_HEADROOM > this.#poolSize) {
      const shown = held.slice(0, 5).map((r) => `${r.what}: ${r.slots}`);
      if (held.length > 5) shown.push(`${held.length - 5} more`);
      throw new UsageError(
        'poolTooSmall',
        `concurrency ${concurrency} does not fit in the pool beside the runs in flight in this Runner: their chunks hold ${inUse} of poolSize ${this.#poolSize} (${shown.join(', ')}) and ${POOL_HEADROOM} are kept for planning, effects and control polls; raise poolSize to at least ${inUse + concurrency + POOL_HEADROOM}, or start fewer runs at once`,
      );
    }
    const id = Symbol(what);
    this.#reserved.set(id, { what, slots: concurrency });
    return () => this.#reserved.delete(id);
  }

  /** @internal A callback of the caller's as idem calls it: see callerCallback (finalizeMigration's, on this runner's log). */
  callerCallback<A extends unknown[]>(name: string, fn: (...args: A) => unknown): (...args: A) => void {
    return callerCallback(this.#quiet ? null : this.#log, name, fn);
  }

  #ops(): OperationsHost {
    return { db: this.db, schema: this.schema, schemaExists: this.#schemaExists, connectionString: this.#connectionString, jobLockName: (j) => this.jobLockName(j), runLockName: (id) => this.runLockName(id), heldLocks: () => this.heldLocks() };
  }

  jobLockName(job: string): string {
    return `${this.schema}:job:${job}`;
  }

  async #runLocked(job: Job, runId: string, params: Json, lock: HeldLock, opts: RunJobOptions, begin: () => Promise<AttemptStart | null>): Promise<RunOutcome> {
    // Re-read under the lock: the holder we waited for has usually finished the run.
    const current = await this.store.getRun(runId);
    const joined = !lock.firstWorker;
    if (current.status === 'succeeded' && !(opts.retrySkipped && (current.summary?.skipped ?? 0) > 0)) return alreadyDone(current);
    refuseControlled(current);
    if (current.requested) await this.#endByPendingRequest(job, current, joined);
    if (opts.resumeFailed === false && current.status === 'failed') throw recordedFailure(current);
    refuseChangedCode(current, job, opts.allowChangedCode ?? false);
    await faultPoint('after-lock');
    const begun = await begin();
    if (!begun) {
      // An operator paused or cancelled it after the read above, or the lock is gone already.
      if (lock.lost.aborted) throw lock.lost.reason;
      refuseControlled(await this.store.getRun(runId));
      if (joined) throw new BusyError(`run ${current.run_key} of job "${job.name}" is ending in the processes that share it (${current.status}); try again once they stopped`);
      throw new LockLostError(`the lock for job "${job.name}" was no longer held when attempt bump ran; rerun to resume`);
    }
    const { attempt, startedAt } = begun;
    const invocationStarted = performance.now();
    const identity = { job: job.name, runKey: current.run_key, runId, attempt };
    const log = this.#log.child({ job: job.name, runKey: current.run_key, attempt });
    log.info({ resumed: attempt > 1, joined }, joined ? 'joined the run as another worker' : attempt > 1 ? 'run resumed' : 'run started');
    // Operators pause or cancel through the run row; the live attempt looks between chunks.
    const control = new AbortController();
    let ending = false;
    const poll = setInterval(() => {
      this.store.control(runId).then(
        ({ requested, status, error }) => {
          // Once this worker is ending, the run's state is its own doing (it recorded it interrupted):
          // not another worker's, as the lines below would say.
          if (control.signal.aborted || ending) return;
          if (requested) {
            // Logged when seen, so an operator (and a test) can tell the request has reached the run.
            log.warn({ requested }, `${requested} requested by an operator; no new chunk starts, in-flight chunks finish`);
            control.abort(new ControlRequest(requested));
          }
          // Another worker on this run failed it: this one stops too, and records nothing.
          else if (status === 'failed') control.abort(new FailedElsewhere(error?.message ?? 'unknown error'));
          // Another worker already ended this attempt for an operator's request (and cleared it):
          // this one stops too, and ends by the run's state (paused, cancelled, or interrupted when
          // the pause was withdrawn), as if it had seen the request itself.
          else if (status === 'paused' || status === 'cancelled' || status === 'interrupted') {
            log.warn({ status }, `the run was ${status} in another worker; no new chunk starts, in-flight chunks finish`);
            control.abort(new ControlRequest(status === 'cancelled' ? 'cancel' : 'pause'));
          }
        },
        () => {},
      );
    }, opts.controlPollMs ?? 1_000);
    const stop = AbortSignal.any([lock.lost, control.signal, ...(opts.signal ? [opts.signal] : [])]);
    const abort = AbortSignal.any([lock.lost, ...(opts.abortSignal ? [opts.abortSignal] : [])]);
    // Every slot may wait on `stop` at once (a pause, a backoff, a held chunk), and a chunk's own
    // code listens on `abort` (ctx.signal: a fetch, a driver's cancel). Node's leak warning at 11
    // listeners printed "Possible EventTarget memory leak" for sixteen slots pausing together; far
    // past a few per slot it would be a leak, which Node should still name.
    setMaxListeners(10 + 8 * (opts.concurrency ?? 1), stop, abort);
    try {
      await retrying(() => recordCodeFingerprint(this.db, this.schema, current, job, attempt, joined));
      // The worker that starts the attempt made skipped chunks pending again with its attempt bump
      // (one joining it does not, or it would undo the skips this attempt has made since), and
      // planned the steps after them afresh: they ran without those chunks, and run again after
      // them, so what they computed (a total, an index) covers every chunk.
      const rerunSteps = begun.revived?.rerun ?? [];
      if (begun.revived && begun.revived.chunks > 0) log.info({ chunks: begun.revived.chunks, ...(rerunSteps.length > 0 ? { rerunSteps } : {}) }, 'retrying skipped chunks');
      const steps = await this.store.loadSteps(runId, job.steps.map((s) => s.name));
      const { executed } = await untilLost(lock.lost, executeSteps(
        {
          db: this.db,
          redact: (err) => redactError(err, this.#connectionString),
          pool: this.#database.pool,
          store: this.store,
          job,
          params,
          run: identity,
          log,
          concurrency: opts.concurrency ?? 1,
          planWindow: opts.planWindow ?? DEFAULT_PLAN_WINDOW,
          slot: opts.slot ?? null,
          ...(opts.throttle ? { throttle: opts.throttle } : {}),
          ...(opts.health !== undefined ? { health: opts.health } : {}),
          ...(opts.onProgress ? { onProgress: callerCallback(this.#quiet ? null : log, 'onProgress', opts.onProgress) } : {}),
          stop,
          abort,
        },
        steps,
      ));
      if (lock.lost.aborted) throw lock.lost.reason;
      await faultPoint('before-finish');
      const code = codeFingerprint(job);
      let summary = await this.store.finishRun(runId, attempt, startedAt, job.steps.map((s) => s.name), code);
      if (!summary) {
        // Finishing is done once: another worker of this attempt may have found nothing left first.
        const now = await this.store.getRun(runId);
        if (now.status === 'failed' && now.attempt === attempt) throw new FailedElsewhere(now.error?.message ?? 'unknown error');
        if (now.status === 'running' && now.attempt === attempt && code !== null && now.code_fingerprint && now.code_fingerprint !== code) {
          throw new CodeMovedOn(now.code_fingerprint);
        }
        if (now.status !== 'succeeded' || now.attempt !== attempt || !now.summary) throw new FencedError(`attempt ${attempt} of job "${job.name}" was taken over before it could finish`);
        summary = now.summary;
      }
      log.info({ executed, chunks: summary.chunks, durationMs: summary.durationMs }, 'run succeeded');
      return { status: 'succeeded', job: job.name, runKey: current.run_key, runId, attempt, summary, executed, elapsedMs: Math.round(performance.now() - invocationStarted), ...(rerunSteps.length > 0 ? { rerunSteps: [...rerunSteps] } : {}) };
    } catch (thrown) {
      // A job's error that quotes DATABASE_URL is recorded in idem.runs, logged and thrown: the
      // chunks' own are masked as they fail (executor.ts), the rest here, whatever threw them (a
      // chunk source planning the next window, the health gate resolving a step's tables).
      ending = true;
      const err = redactError(thrown, this.#connectionString);
      // Once the lock is gone, whatever failed next (often a statement on a connection killed in
      // the same sweep) is a symptom: the run was lost, not failed, and must not be marked failed.
      // A connection-class error can arrive before the lock's own session reports its end, so
      // the lock is checked now before such an error may fail a run other workers may share.
      if (!lock.lost.aborted && isRetryable(err instanceof ChunkFailure ? err.cause : err)) await lock.confirm();
      const end = await this.#recordEnd(runId, attempt, job, current.run_key, lock.lost.aborted ? lock.lost.reason : err, log, lock);
      if (!(end instanceof SucceededElsewhere)) throw end;
      // The run's work is all done: this worker's failure was about a chunk another worker
      // committed. The run stays succeeded, and so does this worker, as a joiner that finds the run
      // finished does.
      const { run } = end;
      const executed = await this.store.committedByWorker(runId, attempt).catch(() => 0);
      log.info({ executed, chunks: run.summary?.chunks }, 'run succeeded (finished by another worker)');
      return { status: 'succeeded', job: job.name, runKey: current.run_key, runId, attempt, summary: run.summary, executed, elapsedMs: Math.round(performance.now() - invocationStarted) };
    } finally {
      clearInterval(poll);
    }
  }

  /**
   * An operator paused or cancelled the run while a worker was live, and that worker stopped (killed,
   * failed) before acting on it. The first worker of the next attempt ends the run by the request
   * and throws, before any work; a joiner meets a live attempt that is about to stop and is busy.
   * A request withdrawn meanwhile (resume) leaves the run to continue.
   */
  async #endByPendingRequest(job: Job, run: RunRow, joined: boolean): Promise<void> {
    const what = run.requested!;
    if (joined) {
      throw new BusyError(`run ${run.run_key} of job "${job.name}" is ending in the processes that share it (an operator's ${what} is pending); try again once they stopped`);
    }
    const ended = await this.store.endByPendingRequest(run.id, run.attempt, run.status, what);
    if (ended === null) return;
    this.#log.warn({ job: job.name, runKey: run.run_key, status: ended }, `run ${ended} by an operator's request that its last worker did not live to honour`);
    throw ended === 'paused'
      ? new PausedError(`job "${job.name}" paused by an operator (the request was pending when its last worker stopped); run idem resume ${job.name} --key ${run.run_key} to let it continue`)
      : new CancelledError(`job "${job.name}" cancelled by an operator (the request was pending when its last worker stopped); finished chunks are kept; idem reset ${job.name} --key ${run.run_key} forgets the run`, { earlier: true });
  }

  /**
   * Leaves the run as a worker that stops without a verdict on it: under the entry gate, the last
   * worker to leave records it interrupted (leave() returns 0); outside worker mode (null) this
   * process records it. A leave() that could not be asked (its session lost: undefined) writes
   * nothing: the released lock leaves the run crashed, not ended under workers that may still be
   * live, where ending the attempt would fence off their commits. Returns leave()'s answer.
   */
  async #leaveInterrupted(lock: HeldLock, runId: string, attempt: number): Promise<number | null | undefined> {
    const others = await lock.leave(this.store.interruptRunSql(runId, attempt)).catch(() => undefined);
    if (others === null) await this.store.endInterrupted(runId, attempt).catch(() => null);
    return others;
  }

  /**
   * Records how an attempt ended and returns the error to throw. A fenced attempt writes nothing,
   * and nothing overwrites a run that is no longer running under this attempt (Store.failRun):
   * when that run had succeeded, returns SucceededElsewhere instead of an error.
   */
  async #recordEnd(runId: string, attempt: number, job: Job, runKey: string, err: unknown, log: Logger, lock: HeldLock): Promise<unknown> {
    if (err instanceof CodeMovedOn) {
      // This worker's steps are done; the run's (under its code now) may not be. It leaves as a
      // worker stopping does: the last to leave records the run interrupted, to resume under that code.
      // A leave() that failed (its session lost) writes nothing: the workers under the run's code
      // are on it, and ending the attempt here would fence off their commits.
      const others = await this.#leaveInterrupted(lock, runId, attempt);
      const now = await this.#runAsItEnded(runId);
      if (now?.attempt === attempt && now.status === 'succeeded') return new SucceededElsewhere(now);
      const rest =
        others === undefined
          ? `this worker lost its session as it left; the run goes on in the workers under its code (idem status ${job.name} --key ${runKey} shows them)`
          : others !== null && others > 0
          ? `the run goes on in its ${others} other ${others === 1 ? 'worker' : 'workers'} (idem status ${job.name} --key ${runKey} shows them)`
          : `no other worker is left: the run is interrupted; resume it with the job's code as it is now (the run's), or pass --allow-changed-code`;
      log.warn({ code: err.to, otherWorkers: others }, `this worker stopped: ${err.message}; ${rest}`);
      return new LockLostError(`this worker stopped after its steps: ${err.message} (a worker joined with --allow-changed-code), so the steps of that code end the run, not this worker's; ${rest}`);
    }
    if (err instanceof FailedElsewhere) {
      log.error({ err: errorFields(err) }, 'the run failed in another worker; stopping');
      return new RunFailedError(`job "${job.name}" failed in another process sharing the run: ${err.message}; ${RESUME_AFTER_FIX}`, { cause: err });
    }
    if (err instanceof FencedError) {
      // The fence also refuses a chunk of a run that ended under this attempt while it was in
      // flight: failed in another worker sharing it, which is how this worker ends too.
      const now = await this.#runAsItEnded(runId);
      if (now?.attempt === attempt && now.status === 'failed') return this.#recordEnd(runId, attempt, job, runKey, new FailedElsewhere(now.error?.message ?? 'unknown error'), log, lock);
      // Succeeded in another worker: the run is done, and the chunk refused was work it no longer
      // has (a step a worker under the run's newer code dropped). Nothing to rerun: not 69.
      if (now?.attempt === attempt && now.status === 'succeeded') {
        log.info({ err: errorFields(err) }, "this worker's in-flight chunk was not committed: the run had ended succeeded meanwhile in another worker sharing it, so the run is done and that chunk's work is no longer the run's");
        return new SucceededElsewhere(now);
      }
    }
    if (err instanceof FencedError || err instanceof LockLostError) {
      // A fenced commit proves a newer attempt took over; a lost lock only that its session ended
      // (a server restart, a terminated backend, a dead network), and the run is free to resume.
      log.error({ err: errorFields(err) }, err instanceof LockLostError ? "lost the run's advisory lock; stopping" : 'lost the run to another attempt');
      const lost = err instanceof LockLostError ? err : new LockLostError(err.message, { cause: err });
      // A worker stopped (SIGSTOP, a cut link) while the others finished the run wakes to a lost
      // lock: "rerun to resume" would send the user after a run that is over.
      const now = await this.#runAsItEnded(runId);
      if (now?.status === 'succeeded') {
        const base = lost.message.replace(/; another process may take the run over, rerun to resume$/, '');
        return new LockLostError(`${base}; the run has meanwhile ended succeeded (attempt ${now.attempt}) in the other workers sharing it: nothing to resume; idem status ${job.name} --key ${runKey} shows it`, { cause: err });
      }
      return lost;
    }
    if (err instanceof ControlRequest) {
      // The run takes the request's state only when its last worker stops, so that a paused run
      // has nothing in flight in any worker. Decided under the entry gate, as for a signal: the
      // last to leave ends the run (by the request as it stands then).
      const others = await lock.leave(this.store.interruptRunSql(runId, attempt)).catch(() => null);
      if (others !== null && others > 0) {
        const rest = `${others} other ${others === 1 ? 'worker finishes its' : 'workers finish their'} in-flight chunks`;
        // A resume may have withdrawn the pause since this worker saw it: then the run will not read
        // paused. A cancel may have replaced it: then it ends cancelled, and this worker says so
        // (until 2026-12-04 it said the pause was withdrawn, exit 75, "run the same command again").
        const now = await this.store.getRun(runId).catch(() => null);
        const current = now !== null && now.attempt === attempt;
        const what = err.what === 'pause' && current && (now.requested === 'cancel' || now.status === 'cancelled') ? 'cancel' : err.what;
        if (what === 'pause' && current && now.requested !== 'pause') {
          log.warn({ otherWorkers: others }, "worker stopped for an operator's pause that was withdrawn meanwhile");
          return new PauseWithdrawnError(
            `this worker stopped for an operator's pause that was withdrawn (resumed) meanwhile; the run goes on in its ${others} other ${others === 1 ? 'worker' : 'workers'}, or is interrupted if they stopped too: run the same command again to continue`,
          );
        }
        log.warn({ requested: what, otherWorkers: others }, `worker stopped for an operator's ${what}; the run ends once its other workers have`);
        return what === 'pause'
          ? new PausedError(`job "${job.name}" paused by an operator: this worker finished its in-flight chunks and stopped; the run reads paused once ${rest}; then idem resume ${job.name} --key ${runKey} lets it continue`)
          : new CancelledError(`job "${job.name}" cancelled by an operator: this worker finished its in-flight chunks and stopped; the run reads cancelled once ${rest}; finished chunks are kept`);
      }
      // Ended by the request as it stands now: a resume may have withdrawn the pause meanwhile.
      const ended = await (others === null ? this.store.endInterrupted(runId, attempt) : this.store.getRun(runId)).then((r) => (r && r.attempt === attempt ? r.status : null), () => null);
      const status = ended === 'paused' || ended === 'cancelled' || ended === 'interrupted' ? ended : err.what === 'pause' ? 'paused' : 'cancelled';
      log.warn({ status }, `run ${status} by an operator`);
      if (status === 'interrupted') {
        return new PauseWithdrawnError(
          `job "${job.name}" stopped for an operator's pause that was withdrawn (resumed) before it took effect; the run is interrupted: run the same command again to continue`,
        );
      }
      return status === 'paused'
        ? new PausedError(`job "${job.name}" paused by an operator after finishing its in-flight chunks; run idem resume ${job.name} --key ${runKey} to let it continue`)
        : new CancelledError(`job "${job.name}" cancelled by an operator; finished chunks are kept; idem reset ${job.name} --key ${runKey} forgets the run`);
    }
    if (err instanceof InterruptedError) {
      // One worker stopping stops only itself while others still share the run.
      // Decided under the entry gate: workers stopped together (a deploy) leave one after the
      // other, so the last of them records the run interrupted instead of each counting the others.
      const others = await lock.leave(this.store.interruptRunSql(runId, attempt)).catch(() => null);
      if (others !== null && others > 0 && err.stoppedBy !== undefined) {
        // Stopped by this process's own code (Runner.close(), its AbortSignal), not a signal every
        // worker of a deploy gets: this worker alone leaves, and the others go on with the run.
        // Until 2026-12-04 it said "stopped on SIGTERM" and that the run would be interrupted.
        const rest = `the run goes on in its ${others} other ${others === 1 ? 'worker' : 'workers'}, and ends as they end it`;
        log.warn({ stoppedBy: err.stoppedBy, otherWorkers: others }, `worker stopped by ${err.stoppedBy}; ${rest}`);
        return new InterruptedError(err.signal, `this worker stopped by ${err.stoppedBy} (its in-flight chunks finished); ${rest}: idem status ${job.name} --key ${runKey} shows them`, { stoppedBy: err.stoppedBy });
      }
      if (others !== null && others > 0) {
        // Said as what was true when it left: the others may be stopping too (every worker of a
        // deploy gets SIGTERM at once), and the last of them records the run interrupted.
        const were = `${others} other ${others === 1 ? 'worker was' : 'workers were'} still on the run`;
        log.warn({ signal: err.signal, otherWorkers: others }, `worker stopped; ${were}`);
        return new InterruptedError(
          err.signal,
          `this worker stopped on ${err.signal} (its in-flight chunks finished, or rolled back on a second signal); ${were} as it left (the last of them to stop records the run interrupted): idem status ${job.name} --key ${runKey} shows them`,
        );
      }
      const by = err.stoppedBy ?? err.signal;
      // An operator's pause or cancel that came too late for this attempt to act on is honoured
      // by how it ended (Store: #endAttempt): say so instead of "rerun to resume".
      const after = await (others === null ? this.store.endInterrupted(runId, attempt) : this.store.getRun(runId)).catch(() => null);
      const ended = after?.attempt === attempt ? after.status : null;
      if (ended === 'paused' || ended === 'cancelled') {
        log.warn({ signal: err.signal, status: ended }, `run ${ended} by an operator's request`);
        return new InterruptedError(
          err.signal,
          ended === 'paused'
            ? `interrupted by ${by}; an operator's pause was pending, so the run is paused: idem resume ${job.name} --key ${runKey} lets it continue`
            : `interrupted by ${by}; an operator's cancel was pending, so the run is cancelled: finished chunks are kept; idem reset ${job.name} --key ${runKey} forgets the run`,
        );
      }
      // Ending is a compare-and-set on the running attempt: a run the other workers ended meanwhile
      // (succeeded, failed) kept that state, and "rerun to resume" would be wrong.
      if (ended !== null && ended !== 'interrupted' && ended !== 'running') {
        log.warn({ signal: err.signal, status: ended }, `worker stopped; the run had already ended ${ended} in the other workers`);
        return new InterruptedError(err.signal, `interrupted by ${by}; the run had already ended ${ended} in the other workers sharing it: idem status ${job.name} --key ${runKey} shows it`);
      }
      log.warn({ signal: err.signal }, 'run interrupted; rerun to resume');
      return err;
    }
    if (!(err instanceof ChunkFailure) && !(err instanceof IdemError) && isConnectionTrouble(err)) {
      // idem's own statements (not a chunk's work) lost their connections past their retries (no
      // connection free: max_connections or the role's CONNECTION LIMIT; sessions ended): this
      // worker stops, the run is not failed. The other workers go on; the last one to stop
      // records the run interrupted (or as a pending request says), and a rerun resumes it.
      const others = await this.#leaveInterrupted(lock, runId, attempt);
      // Behind a session pooler, a connection that waited past the connect timeout (or PgBouncer's
      // query_wait_timeout) for a server session means its pool for the database is full.
      const full = this.#database.pooled && /timeout exceeded when trying to connect|query_wait_timeout/.test(messageOf(err));
      const why = `the database failed idem's own statements past their retries (${messageOf(err)})${
        full
          ? `: behind a connection pooler this means its pool for this database has no server session free for idem: each worker may hold --concurrency + 3 (its lock's, one per slot, two for planning, bookkeeping and effects); raise the pooler's default_pool_size (and max_db_connections) or lower --concurrency`
          : ''
      }`;
      if (others) {
        log.error({ err: errorFields(err), otherWorkers: others }, `this worker stopped: ${why}; the run goes on in its other workers`);
        return new LockLostError(`this worker stopped: ${why}; the run goes on in its ${others} other ${others === 1 ? 'worker' : 'workers'} (idem status ${job.name} --key ${runKey} shows them; --join adds this one back)`, { cause: err });
      }
      const now = await this.#runAsItEnded(runId);
      if (now?.attempt === attempt && now.status === 'succeeded') return new SucceededElsewhere(now);
      const ended = now?.attempt === attempt && ['paused', 'cancelled', 'failed'].includes(now.status) ? `the run had ended ${now.status}` : 'the run is interrupted';
      log.error({ err: errorFields(err), status: now?.status ?? null }, `this worker stopped: ${why}; ${ended}`);
      return new LockLostError(`this worker stopped: ${why}; ${ended}${ended === 'the run is interrupted' ? ': run the same command again to resume' : `: idem status ${job.name} --key ${runKey} shows it`}`, { cause: err });
    }
    if (!(err instanceof ChunkFailure) && !(err instanceof IdemError) && lockWaitCutShort(err)) {
      // One of idem's own statements (planning a window, finishing a step: not a chunk's work) cut
      // short by the statement_timeout or lock_timeout, past the time it is sent again for
      // (waitingOnLocks): nothing of the job failed. This worker stops as a statement cut short
      // before the run refuses (exit 2, idem.statementTimeout, naming the setting); the last worker
      // to stop records the run interrupted, and the same command resumes it. Until 2026-12-04 the
      // run was marked failed (exit 1), in the step being planned or in step "(runner)".
      const others = await this.#leaveInterrupted(lock, runId, attempt);
      const refusal = statementTimeoutRefusal(err, this.#connectionString, this.#connectionSource) as IdemError;
      log.error({ err: errorFields(err), otherWorkers: others ?? null }, `this worker stopped: ${refusal.message}`);
      if (!others) return refusal;
      return new UsageError('statementTimeout', `${refusal.message.replace(/, then run the same command again$/, '')}; the run goes on in its ${others} other ${others === 1 ? 'worker' : 'workers'} (--join adds this one back)`, { cause: err });
    }
    // A grant on idem's own schema or tables taken back mid-run (its bookkeeping, a chunk's claim,
    // marker or fence refused) is not the job's failure: this worker stops as a connect would have
    // refused, naming the GRANT (exit 2), and the run is left interrupted (when idem may still write
    // that), to resume once granted. A permission error on the job's own tables stays its failure.
    if (!(err instanceof IdemError)) {
      const refusal = await lostPrivilegeRefusal(this.db, this.schema, err instanceof ChunkFailure ? err.cause : err).catch(() => null);
      if (refusal) {
        const others = await this.#leaveInterrupted(lock, runId, attempt);
        log.warn({ err: errorFields(refusal.cause), otherWorkers: others ?? null }, "this worker stopped: a privilege on idem's schema was taken back mid-run");
        return refusal;
      }
    }
    const failure = err instanceof ChunkFailure ? err : new ChunkFailure('(runner)', null, 1, err);
    const code = codeOf(failure.cause);
    // PostgreSQL's bare "canceling statement due to statement timeout" names neither the setting nor a fix.
    const origin = statementTimeoutOrigin(this.#connectionString, this.#connectionSource);
    // Nor does its "canceling statement due to lock timeout" (a chunk's, or a chunk source's while
    // planning, past their tries): until 2026-12-04 that was all it said. A chunk's may be given
    // more in the chunk (SET LOCAL); a chunk source's planning query runs outside any chunk.
    const lockOrigin = isLockTimeout(failure.cause) ? statementTimeoutOrigin(this.#connectionString, this.#connectionSource, 'lock_timeout') : undefined;
    const orRaise = (o: typeof origin, setting: string) => (failure.planning ? `${o.fix}${o.fromConnection ? '' : ' or reset it'}` : `${o.fix}${o.fromConnection ? ', or raise it' : ' or'} in the chunk (SET LOCAL ${setting})`);
    const explained = isStatementTimeout(failure.cause)
      ? `${failure.message} (the statement_timeout ${origin.setBy}, or by the job, cut it short: ${failure.planning ? '' : 'give a chunk less to do, or '}${orRaise(origin, 'statement_timeout')})`
      : lockOrigin
        ? `${failure.message} (the lock_timeout ${lockOrigin.setBy}, or by the job, cut short a wait for a lock another session held: let that session finish first, or ${orRaise(lockOrigin, 'lock_timeout')})`
        : failure.message;
    // A chunk source whose transient errors outlasted the step's tries: no chunk failed, its planning did.
    const message = failure.planning ? `planning its chunks failed: ${explained}` : explained;
    const recorded = await this.store
      .failRun(runId, attempt, {
        step: failure.step,
        chunk: failure.chunk,
        tries: failure.tries,
        message,
        code: code ?? null,
        at: new Date().toISOString(),
      })
      .catch(() => null);
    // Another worker of this attempt failed the run first (often on this very chunk, which this
    // one claimed after that worker's try rolled back): its record stands, and this one says so.
    if (recorded?.kind === 'failedElsewhere' && recorded.error) return this.#recordEnd(runId, attempt, job, runKey, new FailedElsewhere(recorded.error.message), log, lock);
    const where = failure.chunk === null ? `step "${failure.step}"` : `step "${failure.step}", chunk ${keyLabel(failure.chunk)}`;
    if (recorded?.kind === 'ended') {
      // The run is no longer running under this attempt (failRun is a compare-and-set): it ended
      // while this worker was away (stopped, its session ended by the server), in another worker
      // sharing it, or a newer attempt took it over. What was recorded stands.
      const { run } = recorded;
      log.warn({ step: failure.step, chunk: failure.chunk, tries: failure.tries, status: run.status, runAttempt: run.attempt, err: errorFields(failure.cause, message) }, `${where} failed here, but the run had ended meanwhile (${run.status}); not recorded`);
      if (run.attempt === attempt && run.status === 'succeeded') return new SucceededElsewhere(run);
      if (run.attempt === attempt && (run.status === 'paused' || run.status === 'cancelled')) {
        return this.#recordEnd(runId, attempt, job, runKey, new ControlRequest(run.status === 'paused' ? 'pause' : 'cancel'), log, lock);
      }
      return this.#recordEnd(runId, attempt, job, runKey, new FencedError(`attempt ${attempt} of job "${job.name}" ended (the run is ${run.status} under attempt ${run.attempt}) before it could record its failure in ${where}: ${message}`), log, lock);
    }
    log.error({ step: failure.step, chunk: failure.chunk, tries: failure.tries, err: errorFields(failure.cause, message) }, 'run failed');
    return new RunFailedError(
      `job "${job.name}" failed in ${where} after ${failure.tries} ${failure.tries === 1 ? 'try' : 'tries'}: ${message}; ${RESUME_AFTER_FIX}`,
      { cause: failure },
    );
  }

  /**
   * The run's row for the message of a worker that lost its lock or its connections (how the run
   * ended meanwhile), or null. Bounded: that is often a dead network, where a new connection waits
   * out its connect timeout (10 s) before failing, and the answer only changes the message.
   */
  #runAsItEnded(runId: string): Promise<RunRow | null> {
    return answerWithin(this.store.getRun(runId), LOST_LOOKUP_MS, () => null).catch(() => null);
  }

  async #dryRun(job: Job, runKey: string, fp: string, allowChangedCode: boolean, given: unknown, join: boolean): Promise<RunOutcome> {
    // No schema yet (a dry run creates none): the run would be new.
    const run = this.#schemaExists ? await this.store.findRun(job.name, runKey) : null;
    if (run && !storedParamsGiven(given, run)) checkFingerprint(job.name, runKey, run, fp);
    // A resume the real command would refuse for its code: not a finished, paused or cancelled run
    // (refused or done for that first), nor a live one unless joining it (a plain run is busy
    // first; --join refuses to join it under other code).
    const live = !!run && (await isLive(this.#ops(), run));
    if (run && !['succeeded', 'paused', 'cancelled'].includes(run.status) && (join || !live)) refuseChangedCode(run, job, allowChangedCode);
    // `running` only while a live process holds it (the real plain run is busy, 75); a row left
    // `running` by a process that died is crashed, as idem status says, and the real run resumes it.
    const state = !run ? 'new' : run.status === 'running' && !live ? 'crashed' : run.status;
    return dryRunOutcome(job, runKey, run, state);
  }

  /** Runs with progress, newest first; `running` only where the job's advisory lock is really held. */
  async status(job?: string, limit = 50): Promise<RunStatusRow[]> {
    return this.#refusingTimeouts(() => this.snapshot((view) => view.status(job, limit)));
  }

  /**
   * Reads in one snapshot (a read-only, repeatable-read transaction): every count of one answer of
   * `idem status` (the run's, its steps', its workers') sees the same committed chunks, however
   * fast the workers commit meanwhile. `view.db` is the transaction, for further reads of the same
   * answer.
   */
  snapshot<T>(fn: (view: { readonly db: Kysely<any>; status(job?: string, limit?: number): Promise<RunStatusRow[]> }) => Promise<T>): Promise<T> {
    return this.db
      .transaction()
      .setIsolationLevel('repeatable read')
      .setAccessMode('read only')
      .execute((trx) => fn({ db: trx, status: (job, limit = 50) => this.#status(trx, job, limit) }));
  }

  async #status(db: Kysely<any>, job: string | undefined, limit: number): Promise<RunStatusRow[]> {
    if (!this.#schemaExists) return [];
    const s = this.schema;
    const { rows } = await sql<any>`
      select r.*,
        cs.chunks_done, cs.done_this_attempt, cs.last_done,
        (select coalesce(sum(planned), 0) from ${sql.id(s, 'steps')} st where st.run_id = r.id)::int as chunks_planned,
        coalesce((select bool_and(planned_all) from ${sql.id(s, 'steps')} st where st.run_id = r.id), false) as fully_planned,
        exists (select 1 from ${sql.id(s, 'chunks')} c where c.run_id = r.id and c.skipped_at is not null) as has_skipped,
        extract(epoch from now() - r.attempt_started_at)::float8 as attempt_seconds,
        extract(epoch from now() - greatest(cs.last_done, r.attempt_started_at))::float8 as idle_seconds,
        (select sum(case when planned_all then planned else greatest(planned, coalesce(estimated_chunks, 0)) end)
           from ${sql.id(s, 'steps')} st where st.run_id = r.id)::int as estimated_total
      from ${sql.id(s, 'runs')} r cross join lateral ${doneChunks(sql.id(s, 'chunks'))} cs
      where ${job === undefined ? sql`true` : sql`r.job = ${job}`}
      order by r.created_at desc, r.id desc limit ${limit}`.execute(db);
    const held = await this.heldLocks(db);
    const skippedByRun = new Map<string, RunStatusRow['skipped']>();
    const workersByRun = new Map<string, RunWorker[]>();
    for (const r of rows) if (r.status === 'running') workersByRun.set(String(r.id), await this.#workers(db, String(r.id), Number(r.attempt)));
    for (const r of rows) if (r.has_skipped) skippedByRun.set(String(r.id), await this.store.skippedChunks(String(r.id), 20, db));
    return rows.map((r) => {
      const state = r.status === 'running' ? (runIsLive(r, held, this.#ops()) ? 'running' : 'crashed') : r.status;
      const workers = state === 'running' ? (workersByRun.get(String(r.id)) ?? []) : [];
      // A silent worker commits nothing more: the rate is the live workers' over the last minute then.
      const live = workers.filter((w) => !w.silent);
      const rate =
        state !== 'running' ? null
        : live.length < workers.length ? (live.length > 0 && live.some((w) => w.rate > 0) ? live.reduce((sum, w) => sum + w.rate, 0) : null)
        : r.attempt_seconds > 0 && r.done_this_attempt > 0 ? r.done_this_attempt / r.attempt_seconds
        : null;
      const estimated = r.estimated_total ?? null;
      const stalled = rate === null ? null : stalledSeconds(r.attempt_seconds, r.idle_seconds, r.done_this_attempt);
      return {
        job: r.job,
        runKey: r.run_key,
        runId: String(r.id),
        params: r.params,
        state,
        attempt: r.attempt,
        // The run row names the worker that started this attempt; once it is gone, name one still there.
        holder: state === 'running' ? holderOf(r.holder, workersByRun.get(String(r.id)) ?? []) : null,
        chunksDone: r.chunks_done,
        chunksPlanned: r.chunks_planned,
        fullyPlanned: r.fully_planned,
        createdAt: r.created_at,
        updatedAt: lastChange(r.updated_at, r.last_done),
        finishedAt: r.finished_at,
        error: documentedError(r.error),
        summary: r.summary,
        skipped: skippedByRun.get(String(r.id)) ?? [],
        workers,
        throughput: rate === null ? null : Math.round(rate * 100) / 100,
        estimatedChunks: estimated,
        etaSeconds: rate && estimated !== null && stalled === null ? Math.max(0, Math.round((estimated - r.chunks_done) / rate)) : null,
        stalledSeconds: stalled,
        requested: r.requested ?? null,
        codeChanges: r.code_changes ?? [],
        healthPause: state === 'running' ? (r.health_pause ?? null) : null,
      };
    });
  }

  /**
   * Live workers of a run: the sessions holding the run's own lock, named `idem-lock host:pid`
   * (a run of an older idem, or under idem migrate, shows its one lock holder by the run row).
   */
  async #workers(db: Kysely<any>, runId: string, attempt: number): Promise<RunWorker[]> {
    const key = lockKey(this.runLockName(runId));
    const { rows } = await sql<{ worker: string; silent: number | null; chunks: number; last_minute: number; seconds: number | null }>`
      with live as (
        select substr(a.application_name, length('idem-lock ') + 1) as worker,
          min(${sql.raw(SILENT_SECONDS_SQL)})::float8 as silent
        from pg_locks l join pg_stat_activity a on a.pid = l.pid
        where l.locktype = 'advisory' and l.granted and l.objsubid = 1
          and l.database = (select oid from pg_database where datname = current_database())
          and ((l.classid::bigint << 32) | l.objid::bigint) = ${key}::bigint and a.application_name like 'idem-lock %'
        group by 1
      )
      select live.worker, live.silent, done.chunks, done.last_minute,
        extract(epoch from now() - done.first_done)::float8 as seconds
      from live cross join lateral (
        select count(*) filter (where c.done_attempt = ${attempt})::int as chunks,
          count(*) filter (where c.done_at > now() - interval '60 seconds')::int as last_minute,
          min(c.done_at) filter (where c.done_attempt = ${attempt}) as first_done
        from ${sql.id(this.schema, 'chunks')} c where c.run_id = ${runId} and c.done_by = live.worker
      ) done
      order by live.worker`.execute(db);
    return rows.map((r) => {
      const silentSeconds = silentSecondsOf(r.silent);
      return { worker: r.worker, chunks: r.chunks, rate: workerRate(r.last_minute, r.seconds), silentSeconds, silent: looksDead({ silentSeconds, applicationName: `idem-lock ${r.worker}` }) };
    });
  }

  /**
   * Sessions holding the locks of those of these jobs none of whose runs is `running` (in the whole
   * table, not the page `status` shows), the most silent first: one left behind (a process stopped,
   * or its host gone behind a proxy) that keeps every new run of the job busy.
   */
  async jobLockHolders(jobs: readonly string[], db: Kysely<any> = this.db): Promise<Array<LockHolder & { readonly job: string }>> {
    if (jobs.length === 0) return [];
    const byKey = new Map(jobs.map((j) => [lockKey(this.jobLockName(j)), j]));
    const holders = await lockHolders(async (text, values) => (await db.executeQuery<Record<string, unknown>>(CompiledQuery.raw(text, values))).rows, [...byKey.keys()]);
    if (holders.length === 0 || !this.#schemaExists) return holders.map(({ key, ...h }) => ({ ...h, job: byKey.get(key)! }));
    // Read after the holders: a run that started in between is seen running, not taken for none.
    const { rows } = await sql<{ job: string }>`select distinct job from ${sql.id(this.schema, 'runs')} where job = any(${jobs}) and status = 'running'`.execute(db);
    const running = new Set(rows.map((r) => r.job));
    return holders.map(({ key, ...h }) => ({ ...h, job: byKey.get(key)! })).filter((h) => !running.has(h.job));
  }

  /** The session advisory locks held in this database right now. */
  async heldLocks(db: Kysely<any> = this.db): Promise<HeldLocks> {
    const { rows } = await sql<{ key: string; pid: number }>`
      select ((classid::bigint << 32) | objid::bigint)::text as key, pid from pg_locks
      where locktype = 'advisory' and objsubid = 1 and granted
        and database = (select oid from pg_database where datname = current_database())`.execute(db);
    return { keys: new Set(rows.map((r) => r.key)), byPid: new Set(rows.map((r) => `${r.pid}:${r.key}`)) };
  }
}

/**
 * A worker's chunks a second: over the last minute, or, for a worker whose first chunk of this
 * attempt is younger than that, over the span since that chunk ((n - 1) chunks after it), the
 * worker's own record. Not the age of its lock session (pg_stat_activity.backend_start): behind
 * PgBouncer that is the pooled server session's, opened by whatever used it first, and a worker
 * 4 s old was rated over many minutes.
 */
function workerRate(lastMinute: number, sinceFirst: number | null): number {
  const rate = sinceFirst === null || sinceFirst >= 60 ? lastMinute / 60 : lastMinute <= 1 ? lastMinute / Math.max(1, sinceFirst) : (lastMinute - 1) / Math.max(1, sinceFirst);
  return Math.round(rate * 100) / 100;
}

/** How long a worker that lost its lock (or its connections) asks how the run ended, for its message. */
const LOST_LOOKUP_MS = 2_000;

/**
 * Waits for the work unless the lock is lost first. In-flight chunks on a dead network never
 * answer; once the lock is gone they cannot commit anyway (fencing), so they are abandoned, not
 * awaited, and the run stops within the lock check's deadline.
 */
function untilLost<T>(lost: AbortSignal, work: Promise<T>): Promise<T> {
  if (lost.aborted) {
    work.catch(() => {});
    return Promise.reject(lost.reason);
  }
  return new Promise<T>((resolve, reject) => {
    const onLost = () => {
      work.catch(() => {});
      reject(lost.reason);
    };
    lost.addEventListener('abort', onLost, { once: true });
    work.then(resolve, reject).finally(() => lost.removeEventListener('abort', onLost));
  });
}

/** How a failed run's message ends: its fix is often in the job's code, which the resume then needs the flag for. */
const RESUME_AFTER_FIX = 'fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)';

/** Why a worker stops when another worker on its run failed the run. */
class FailedElsewhere extends Error {}

/**
 * Not a failure: this worker did its steps, but the run's code is no longer its own (a worker joined
 * under other code, allowed, and its steps are the run's now): the workers under that code end it.
 */
class CodeMovedOn extends Error {
  readonly to: string;
  constructor(to: string) {
    super(`the run's code changed to ${short(to)} since this worker joined`);
    this.to = to;
  }
}

/** Not an error: a worker's failure found its run already succeeded (by another worker of the attempt). */
class SucceededElsewhere {
  readonly run: RunRow;
  constructor(run: RunRow) {
    this.run = run;
  }
}

/** Errors of reaching the server at all (a socket that never connected, a server refusing sessions). */
const UNREACHABLE = new Set(['ECONNREFUSED', 'ENOTFOUND', 'EAI_AGAIN', 'ETIMEDOUT', 'EHOSTUNREACH', 'ENETUNREACH', '57P03', '3D000', '28P01', '28000']);

/**
 * Why a run stops when the caller's AbortSignal (RunJobOptions.signal) or close() aborts: an
 * interruption, a graceful stop that finished chunks survive and a rerun resumes, never the run's
 * failure. idem's own reasons stand as they are (the CLI's InterruptedError on a signal); the
 * strings 'SIGINT', 'SIGTERM' and 'SIGHUP' name the signal; anything else (abort()'s AbortError,
 * AbortSignal.timeout()'s TimeoutError, an Error or value of the caller's) is a SIGTERM-like stop,
 * exit 143, whose message quotes it. It was thrown as the run's failure: the run read failed
 * ("This operation was aborted") and finalize refused to finish it.
 */
function interruption(reason: unknown): IdemError {
  if (reason instanceof IdemError) return reason;
  if (typeof reason === 'string' && (STOP_SIGNALS as readonly string[]).includes(reason)) return new InterruptedError(reason as StopSignal);
  const why = reason instanceof Error ? reason.message : String(reason);
  return new InterruptedError('SIGTERM', `stopped by the caller's AbortSignal (${why}); finished chunks are kept, run it again to resume`, { stoppedBy: "the caller's AbortSignal" });
}

/** Why a live attempt stops at an operator's request. */
class ControlRequest extends Error {
  readonly what: 'pause' | 'cancel';
  constructor(what: 'pause' | 'cancel') {
    super(`${what} requested`);
    this.what = what;
  }
}

/** #runClaimed's answer for a run a prune marked deleting while this process was entering it. */
const DELETING = Symbol('deleting');

/** A key whose run kept being marked deleting as fast as this process deleted it: give up, busy. */
function refuseDeleting(job: string, runKey: string): never {
  throw new BusyError(beingDeletedMessage(`run "${runKey}" of job "${job}"`));
}

/** A paused or cancelled run does not start again until an operator says so. */
function refuseControlled(run: RunRow): void {
  if (run.status === 'paused') {
    throw new PausedError(`run ${run.run_key} of job "${run.job}" is paused; run idem resume ${run.job} --key ${run.run_key} first`);
  }
  if (run.status === 'cancelled') {
    throw new CancelledError(`run ${run.run_key} of job "${run.job}" was cancelled; idem reset ${run.job} --key ${run.run_key} forgets it so it can run afresh`, { earlier: true });
  }
}

/**
 * Whether the params given are exactly an existing run's stored ones. A run stores its validator's
 * output, and that is what `idem status --json`, the API, finalize and a failed run's resume
 * command pass back: validated again, a validator that transforms (a string to a number, euros to
 * cents) refuses them or changes them once more. Given as stored, they are that run's params.
 */
function storedParamsGiven(given: unknown, run: Pick<RunRow, 'fingerprint'>): boolean {
  if (given === undefined || paramsProblem(given) !== null) return false;
  try {
    return fingerprint(given) === run.fingerprint;
  } catch {
    return false; // not JSON (a function, a cycle): not the stored params
  }
}

/**
 * Refuses params given for an existing run that are not its own, as Runner.run does (exit 65):
 * given as the run stores them they are its own; else validated, and compared by fingerprint.
 */
export async function refuseOtherParams(job: Job, run: RunRow, given: unknown): Promise<void> {
  if (storedParamsGiven(given, run)) return;
  checkFingerprint(job.name, run.run_key, run, fingerprint(await validateParams(job, given)));
}

function checkFingerprint(job: string, runKey: string, run: RunRow, fp: string): void {
  if (run.fingerprint !== fp) {
    throw new ParamsMismatchError(
      `run key "${runKey}" of job "${job}" was already used with other params (${run.fingerprint.slice(0, 19)}…, now ${fp.slice(0, 19)}…); pass a new --key to run with these params, or the original params to resume it`,
    );
  }
}

/**
 * A dry run's outcome: the run (null: there is none, it would be new) in `state`, and the steps
 * that would run. Also the CLI's, where there is no database yet to ask (every run would be new).
 */
export function dryRunOutcome(job: Job, runKey: string, run: RunRow | null = null, state = 'new'): RunOutcome {
  return {
    status: 'dry-run',
    job: job.name,
    runKey,
    runId: run?.id ?? null,
    attempt: run?.attempt ?? 0,
    summary: run?.summary ?? null,
    executed: 0,
    plan: { state, steps: job.steps.map((s) => ({ name: s.name, chunked: s.chunks !== undefined })) },
  };
}

/** The outcome of a run found succeeded (finalizeMigration's too). */
export function alreadyDone(run: RunRow): RunOutcome {
  return { status: 'already-succeeded', job: run.job, runKey: run.run_key, runId: run.id, attempt: run.attempt, summary: run.summary, executed: 0 };
}

/** The code of the process warning a caller's callback that threw gets when the Runner has no logger. */
export const CALLBACK_THREW = 'IDEM_CALLBACK_THREW';

/**
 * A callback of the caller's (onProgress, onOutcome, onMigration) as idem calls it: what it throws,
 * or the promise it returns rejects with, is logged once (a warning naming it) and otherwise
 * ignored, and it is still called after. It is the caller's code (a progress bar, a UI), not the
 * job's: until 2026-12-04 an onProgress that threw failed the run in step "(runner)", and one of
 * Runner.migrate's stopped the migrations. `log` null: the caller gave the Runner no logger, so the
 * warning goes to process.emitWarning (stderr, unless the process handles or silences warnings)
 * instead of a silent logger, where a broken callback went unnoticed.
 */
function callerCallback<A extends unknown[]>(log: Logger | null, name: string, fn: (...args: A) => unknown): (...args: A) => void {
  let said = false;
  const warn = (err: unknown) => {
    if (said) return;
    said = true;
    const message = `${name} threw (${messageOf(err)}); the run goes on, and what ${name} throws later is not logged again`;
    if (log) log.warn({ callback: name, err: errorFields(err) }, message);
    else process.emitWarning(`idem: ${message}`, { code: CALLBACK_THREW });
  };
  return (...args: A) => {
    try {
      const result = fn(...args);
      if (result !== null && typeof result === 'object' && typeof (result as PromiseLike<unknown>).then === 'function') (result as PromiseLike<unknown>).then(undefined, warn);
    } catch (err) {
      warn(err);
    }
  };
}

/** A run key as the pool's refusal lists it: a params fingerprint (or any long key) cut to its first 19 characters (code points, as quoteKey cuts). */
function shortKey(runKey: string): string {
  const chars = [...runKey];
  return keyLabel(chars.length > 40 ? `${chars.slice(0, 19).join('')}…` : runKey);
}

/** The run row's holder while it is among the live workers, else the first live worker (none: the row's). */
function holderOf(holder: string | null, workers: readonly RunWorker[]): string | null {
  if (workers.length === 0 || workers.some((w) => w.worker === holder)) return holder;
  return workers[0]!.worker;
}
