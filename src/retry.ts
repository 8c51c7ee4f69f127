import { codeOf, DatabaseUnavailableError, givenValue, IdemError, messageOf } from './errors.ts';
import { sleep } from './sleep.ts';
import { testHookMs } from './test-hooks.ts';

/**
 * SQLSTATEs after which the same chunk, retried in a fresh transaction, can succeed.
 * Everything else is a bug or bad data: retrying would only repeat it.
 */
export const SqlState = {
  /** Serializable/repeatable-read conflict: the retry sees the other transaction's result. */
  SerializationFailure: '40001',
  /** Postgres killed one side of a lock cycle; the other side has gone on. */
  DeadlockDetected: '40P01',
  /** The server is shutting down an idle or busy backend (restart, pg_terminate_backend). */
  AdminShutdown: '57P01',
  /**
   * The server ended a session that sat idle inside its transaction past
   * idle_in_transaction_session_timeout (FATAL: the session is gone, its transaction rolled back):
   * a worker stalled that long (SIGSTOP, a VM freeze, a GC pause) meets it at its next statement.
   * A lost connection like any other; a fresh one can claim the chunk again.
   */
  IdleInTransactionSessionTimeout: '25P03',
  /** The server ended a session idle (outside a transaction) past idle_session_timeout: likewise gone. */
  IdleSessionTimeout: '57P05',
  /** Crash recovery in progress: the server will accept connections again shortly. */
  CrashShutdown: '57P02',
  /** Starting up or shutting down: try again after a pause. */
  CannotConnectNow: '57P03',
  /** max_connections reached; other sessions will leave. */
  TooManyConnections: '53300',
  /** Lock wait exceeded lock_timeout: the blocker usually finishes. */
  LockNotAvailable: '55P03',
} as const;

/** Node/libpq socket errors that mean "the connection went away", never "your SQL is wrong". */
const RETRYABLE_NODE_CODES = new Set(['ECONNRESET', 'ECONNREFUSED', 'EPIPE', 'ETIMEDOUT', 'EHOSTUNREACH', 'ENETUNREACH', 'EAI_AGAIN']);

const RETRYABLE_SQLSTATES = new Set<string>(Object.values(SqlState));

/** What node-postgres says when a connection went away without a code. */
const CONNECTION_GONE = /Connection terminated|connection is closed|Client has encountered a connection error|Query read timeout|timeout exceeded when trying to connect/i;

/**
 * No connection to be had, said without a SQLSTATE of its own: pg-pool's timeout (behind a pooler
 * in session mode whose pool for the database is used up, a new client waits for a server session
 * in vain), and PgBouncer's refusal past its max_client_conn (08P01).
 */
const NO_CONNECTION_FREE = /^timeout exceeded when trying to connect$|no more connections allowed \(max_client_conn\)/;

/**
 * Whether `err`, or a cause of it (five deep), has a code `transient` accepts, or a message saying
 * its connection went away: the one walk behind isRetryable and isConnectionTrouble.
 */
function transientInChain(err: unknown, transient: (code: string) => boolean): boolean {
  let e: unknown = err;
  for (let depth = 0; e && typeof e === 'object' && depth < 5; depth++) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === 'string' && (transient(code) || code.startsWith('08') || RETRYABLE_NODE_CODES.has(code))) return true;
    const msg = (e as { message?: unknown }).message;
    if (typeof msg === 'string' && CONNECTION_GONE.test(msg)) return true;
    e = (e as { cause?: unknown }).cause;
  }
  return false;
}

/** True when the error is transient: a retry in a fresh transaction may succeed. */
export function isRetryable(err: unknown): boolean {
  return transientInChain(err, (code) => RETRYABLE_SQLSTATES.has(code));
}

/** The SQLSTATEs of isConnectionTrouble: the server full or starting, the session ended by it. */
const CONNECTION_SQLSTATES = new Set<string>([
  SqlState.TooManyConnections,
  SqlState.AdminShutdown,
  SqlState.CrashShutdown,
  SqlState.CannotConnectNow,
  SqlState.IdleSessionTimeout,
  SqlState.IdleInTransactionSessionTimeout,
]);

/**
 * The transient errors that are about the connection itself (the server full or starting, the
 * session ended, the socket gone), not about a statement: a retry on another connection may
 * succeed, but nothing about the work was wrong. Not serialization failures, deadlocks or lock
 * timeouts, which are a statement's.
 */
export function isConnectionTrouble(err: unknown): boolean {
  return transientInChain(err, (code) => CONNECTION_SQLSTATES.has(code));
}

/**
 * The database out of reach (stopped, restarting, its sessions ended) as idem's own statements meet
 * it: pg's connection error, or idem's refusal wrapping one ("cannot open the lock session: …",
 * an unreachable database said as Runner.connect says it). A wait for a run live elsewhere (--wait,
 * finalize) keeps trying through it until its deadline. Never a lost lock, a run's failure, or a
 * refusal of idem's about anything else.
 */
export function databaseOutage(err: unknown): boolean {
  if (err instanceof IdemError && !(err instanceof DatabaseUnavailableError && err.cause !== undefined)) return false;
  return isConnectionTrouble(err);
}

/**
 * How long a wait ridden through a database outage (databaseOutage) sleeps before its `tries`-th
 * look again (from 0): 250 ms, doubling up to 2 s, and never past `deadline` (ms since the epoch).
 */
export function outageDelayMs(tries: number, deadline: number): number {
  return Math.min(250 * 2 ** Math.min(tries, 3), 2_000, Math.max(0, deadline - Date.now()));
}

/**
 * The server refused a new connection because it has none free (max_connections or the role's
 * CONNECTION LIMIT reached: 53300) or is still starting (57P03): waiting may help, the URL is right.
 */
export function noConnectionFree(err: unknown): boolean {
  const code = codeOf(err);
  if (code === SqlState.TooManyConnections || code === SqlState.CannotConnectNow) return true;
  return err instanceof Error && NO_CONNECTION_FREE.test(err.message);
}

/**
 * The server refused a new connection because it is starting up, or shutting down to restart
 * (57P03 "the database system is starting up", "… is shutting down", "… is in recovery mode",
 * "… is not yet accepting connections"): it comes back by itself, and the command can wait for it.
 * Not a standby with hot_standby off (57P03 "… is not accepting connections"), which never does.
 */
export function serverStarting(err: unknown): boolean {
  return codeOf(err) === SqlState.CannotConnectNow && err instanceof Error && /starting up|shutting down|in recovery mode|not yet accepting connections/.test(err.message);
}

/** How long opening waits for a server that has no connection free (53300) or is starting (57P03). */
export const CONNECT_RETRY_MS = 10_000;

export interface BackoffOptions {
  /** First delay's upper bound in ms. Defaults to `100`. */
  readonly base?: number;
  /** Upper bound of any delay in ms. Defaults to `30_000`. */
  readonly max?: number;
  /** Growth per attempt. Defaults to `2`. */
  readonly factor?: number;
  /** How many tries a chunk gets in all (the first one included). Defaults to `5`. */
  readonly attempts?: number;
}

/** What is wrong with a retry policy (empty when nothing is); defineJob reports these at load. */
export function backoffProblems(b: BackoffOptions): string[] {
  if (!b || typeof b !== 'object') return ['retry must be an object { base?, max?, factor?, attempts? }'];
  const problems: string[] = [];
  const num = (v: unknown) => typeof v === 'number' && Number.isFinite(v);
  if (b.base !== undefined && !(num(b.base) && b.base >= 0)) problems.push(`base must be a number of ms >= 0 (got ${givenValue(b.base)})`);
  if (b.max !== undefined && !(num(b.max) && b.max >= 0)) problems.push(`max must be a number of ms >= 0 (got ${givenValue(b.max)})`);
  if (b.factor !== undefined && !(num(b.factor) && b.factor >= 1)) problems.push(`factor must be a number >= 1 (got ${givenValue(b.factor)})`);
  if (b.attempts !== undefined && !(Number.isInteger(b.attempts) && b.attempts >= 1)) problems.push(`attempts must be an integer >= 1 (got ${givenValue(b.attempts)})`);
  return problems;
}

export const DEFAULT_BACKOFF: Required<BackoffOptions> = Object.freeze({ base: 100, max: 30_000, factor: 2, attempts: 5 });

/**
 * Exponential backoff with full jitter (AWS architecture blog): a uniform delay in
 * `[0, min(max, base * factor^(attempt-1)))`. Full jitter spreads retries of workers that failed
 * together (a deadlock, a restart) instead of having them collide again in lockstep.
 * `attempt` counts from 1; `random` is injectable so tests can pin it.
 */
export function backoffDelay(attempt: number, opts: BackoffOptions = {}, random: () => number = Math.random): number {
  if (!Number.isInteger(attempt) || attempt < 1) throw new TypeError(`attempt must be an integer >= 1, got ${attempt}`);
  const base = opts.base ?? DEFAULT_BACKOFF.base;
  const max = opts.max ?? DEFAULT_BACKOFF.max;
  const factor = opts.factor ?? DEFAULT_BACKOFF.factor;
  const ceiling = Math.min(max, base * factor ** (attempt - 1));
  return Math.floor(random() * ceiling);
}

/**
 * Runs one idempotent piece of the runner's own bookkeeping (never a chunk's transaction: that
 * retry lives with the chunk), retrying transient errors with the same backoff. A backend killed
 * between two statements then costs a reconnect, not a failed run. A step's planning (its chunk
 * source) goes through here too, with the step's `retry` policy, `onRetry` logging each retry.
 */
export async function retrying<T>(
  fn: () => Promise<T>,
  opts: BackoffOptions = {},
  /** Told of each transient error about to be tried again, with the try it ended (from 1) and the backoff before the next. */
  onRetry?: (err: unknown, tries: number, delayMs: number) => void,
  /** No new try after it aborts: the last error is thrown. */
  stop?: AbortSignal,
): Promise<T> {
  const attempts = opts.attempts ?? DEFAULT_BACKOFF.attempts;
  /** Until when a server that is starting up (a restart) is waited for, from the first such refusal. */
  let startingUntil: number | undefined;
  for (let attempt = 1, starting = 0; ; attempt++) {
    try {
      return await fn();
    } catch (err) {
      // A restart: the tries ran out in a second or two while the server came back, and the
      // command gave up on "the database system is starting up". Waited for as opening waits.
      if (serverStarting(err)) {
        startingUntil ??= Date.now() + (testHookMs('IDEM_CONNECT_RETRY_MS') ?? CONNECT_RETRY_MS);
        if (Date.now() < startingUntil) {
          await sleep(Math.min(250 * 2 ** starting++, 2_000, Math.max(0, startingUntil - Date.now())));
          attempt--;
          continue;
        }
      }
      if (attempt >= attempts || !isRetryable(err) || stop?.aborted) throw err;
      const delay = backoffDelay(attempt, opts);
      onRetry?.(err, attempt, delay);
      await sleep(delay, stop);
      if (stop?.aborted) throw err;
    }
  }
}

/**
 * A statement of idem's own cut short while it waited on a lock another session held (another
 * worker planning the same step, an operator's transaction): by the statement_timeout (57014 "…
 * due to statement timeout") or the lock_timeout (55P03 "… due to lock timeout") of the role, the
 * database or the connection. Not a cancel request (57014 "… due to user request"), nor NOWAIT.
 */
export function lockWaitCutShort(err: unknown): boolean {
  return isStatementTimeout(err) || isLockTimeout(err);
}

/**
 * Whether `err` is PostgreSQL's statement_timeout cutting a statement short (57014 alone is also a
 * cancel request: idem's own on an abort, or pg_cancel_backend).
 */
export function isStatementTimeout(err: unknown): boolean {
  return codeOf(err) === '57014' && /due to statement timeout/.test(messageOf(err));
}

/** Whether `err` is PostgreSQL's lock_timeout cutting a statement's wait for a lock short (55P03 alone is also NOWAIT's). */
export function isLockTimeout(err: unknown): boolean {
  return codeOf(err) === SqlState.LockNotAvailable && /due to lock timeout/.test(messageOf(err));
}

/**
 * How long, from the first time it is cut short, idem sends one of its own statements that waits
 * on a lock (planning a window, skipping a chunk, finishing a step: the step row) again: past
 * this, the last error is thrown, and the runner ends the command with exit 2 (idem.statementTimeout),
 * the run left interrupted.
 */
export const LOCK_WAIT_BOUND_MS = 30_000;

/**
 * Runs one of idem's own statements that may wait on a lock another transaction holds (the step
 * row, which another worker's planner holds a moment, or anyone's `select … for update`), sending
 * it again after a short pause (50 ms, doubling, at most 1 s) whenever the statement_timeout or
 * lock_timeout cuts it short ({@link lockWaitCutShort}), for {@link LOCK_WAIT_BOUND_MS} at most.
 * The statement must be safe to send again (all or nothing). `onWait` is told of each such cut.
 * Until 2026-12-04 the first cut failed the run (exit 1), as if a chunk had failed.
 *
 * `stop` (a worker told to stop: a signal, an operator's pause): the statement is not sent again
 * after the next cut, and the stop's reason is thrown, so the worker stops as a stop does (exit
 * 143 for SIGTERM, the run interrupted), not after the bound as if the wait had run out.
 */
export async function waitingOnLocks<T>(fn: () => Promise<T>, onWait?: (err: unknown, tries: number) => void, stop?: AbortSignal): Promise<T> {
  let until: number | undefined;
  const stopped = (err: unknown) => (stop?.reason instanceof Error ? stop.reason : err);
  for (let tries = 1; ; tries++) {
    try {
      return await fn();
    } catch (err) {
      if (!lockWaitCutShort(err)) throw err;
      if (stop?.aborted) throw stopped(err);
      until ??= Date.now() + (testHookMs('IDEM_LOCK_WAIT_BOUND_MS') ?? LOCK_WAIT_BOUND_MS);
      if (Date.now() >= until) throw err;
      onWait?.(err, tries);
      await sleep(Math.min(1_000, 50 * 2 ** Math.min(tries - 1, 5), Math.max(0, until - Date.now())), stop);
      if (stop?.aborted) throw stopped(err);
    }
  }
}
