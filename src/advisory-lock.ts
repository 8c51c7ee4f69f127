import pg from 'pg';
import { BusyError, DatabaseUnavailableError, InterruptedError, LockLostError } from './errors.ts';
import { lockKey } from './fingerprint.ts';
import { sleep } from './sleep.ts';
import { SERVER_KEEPALIVES } from './database.ts';

export interface AdvisoryLockOptions {
  readonly connectionString: string;
  /** Name hashed into the 64-bit lock key (schema + job). */
  readonly name: string;
  /** What the busy error calls the lock holder's work, e.g. `job "nightly"`. */
  readonly what: string;
  /** `false`: fail with BusyError at once. `true`: wait without bound. A number: wait that many seconds. Defaults to `false`. */
  readonly wait?: boolean | number;
  /** Aborting stops a wait (the caller is being interrupted). */
  readonly signal?: AbortSignal;
  /** How often the held session is checked for life, in ms. Defaults to `2000`. */
  readonly checkIntervalMs?: number;
  /**
   * How long a check, or a statement sent on the lock's session, may go unanswered before the lock
   * counts as lost, in ms: a host whose network vanished never answers, and never errors either.
   * Defaults to `5000` (checks), 6 times that for statements (which may wait for a row lock).
   */
  readonly checkTimeoutMs?: number;
}

/** Default of `checkTimeoutMs`. */
export const LOCK_CHECK_TIMEOUT_MS = 5_000;

/** A held session-level advisory lock; `lost` aborts when its session dies. */
export interface HeldLock {
  /** The name the key was hashed from. */
  readonly name: string;
  readonly key: string;
  /** Aborts (with a LockLostError reason) when the lock's session is gone. */
  readonly lost: AbortSignal;
  /** Backend pid of the session holding the lock. */
  readonly pid: number;
  /**
   * Runs one statement on the lock's own session, so it can only succeed while the lock is held
   * (the attempt bump). No answer in time counts as a lost lock.
   */
  query<R extends pg.QueryResultRow>(text: string, values: readonly unknown[]): Promise<R[]>;
  /** Releases the lock and closes its session. Idempotent, and bounded even on a dead socket. */
  release(): Promise<void>;
}

const POLL_MS = 250;

/**
 * Takes a session-level `pg_try_advisory_lock` on a connection of its own, never one from the work
 * pool: the lock lives exactly as long as that session, so a crashed process cannot leave a stale
 * lock behind (Postgres drops it with the session). Waiting polls with try-lock rather than block in
 * `pg_advisory_lock`, so a wait can be bounded and interrupted without cancelling a backend query.
 */
export async function acquireAdvisoryLock(opts: AdvisoryLockOptions): Promise<HeldLock> {
  const key = lockKey(opts.name);
  const client = new pg.Client({ connectionString: opts.connectionString, keepAlive: true, keepAliveInitialDelayMillis: 5_000, application_name: 'idem-lock' });
  const lostController = new AbortController();
  const loseLock = (why: string, cause?: unknown) => {
    if (lostController.signal.aborted) return;
    lostController.abort(new LockLostError(`lost the advisory lock for ${opts.what}: ${why}; another process may take the run over, rerun to resume`, { cause }));
    // A socket that stopped answering would keep every later statement (and end()) waiting forever.
    destroySocket(client);
  };
  const checkTimeout = opts.checkTimeoutMs ?? LOCK_CHECK_TIMEOUT_MS;
  /** Statements in flight on the session; the periodic check never queues behind one. */
  let busy = 0;
  /** One statement, raced against a deadline: no answer in time is a lost lock, not a wait. */
  const timed = async <R extends pg.QueryResultRow>(text: string, values: readonly unknown[], ms: number): Promise<R[]> => {
    busy++;
    let timer: NodeJS.Timeout | undefined;
    try {
      const deadline = new Promise<never>((_, reject) => {
        timer = setTimeout(() => {
          loseLock(`its session did not answer within ${ms / 1000}s (network gone?)`);
          reject(lostController.signal.reason);
        }, ms);
      });
      const { rows } = await Promise.race([client.query<R>(text, values as unknown[]), deadline]);
      return rows;
    } finally {
      clearTimeout(timer);
      busy--;
    }
  };
  // Without an 'error' listener a dropped socket would crash the process instead of failing the run.
  client.on('error', (err) => loseLock(err.message, err));
  client.on('end', () => loseLock('its session ended'));
  let released = false;
  try {
    await client.connect();
  } catch (err) {
    throw new DatabaseUnavailableError(`cannot open the lock session: ${(err as Error).message}`, { cause: err });
  }
  let timer: NodeJS.Timeout | undefined;
  const release = async () => {
    if (released) return;
    released = true;
    if (timer) clearInterval(timer);
    client.removeAllListeners('end');
    client.removeAllListeners('error');
    client.on('error', () => {});
    try {
      if (!lostController.signal.aborted) await timed('select pg_advisory_unlock($1::bigint)', [key], checkTimeout);
    } catch {
      // The session is going away anyway, and with it the lock.
    }
    // end() waits for the server's goodbye, which a dead network never sends.
    const ended = client.end().catch(() => {});
    const bound = new Promise<void>((resolve) => setTimeout(resolve, checkTimeout).unref());
    await Promise.race([ended, bound]);
    destroySocket(client);
  };

  try {
    // Server-side keepalives for this session only: if this host vanishes (power, network), the
    // server notices within about a minute and drops the session and its lock, instead of keeping
    // the job "busy" for the hours the OS defaults would take.
    await client.query(SERVER_KEEPALIVES);
    const { rows: [first] } = await client.query<{ pid: number }>('select pg_backend_pid() as pid');
    const pid = first!.pid;
    const deadline = opts.wait === true ? Infinity : opts.wait ? Date.now() + opts.wait * 1000 : 0;
    for (;;) {
      const { rows } = await client.query<{ ok: boolean; pid: number }>('select pg_try_advisory_lock($1::bigint) as ok, pg_backend_pid() as pid', [key]);
      const row = rows[0]!;
      if (row.pid !== pid) {
        // A transaction-pooling proxy (PgBouncer pool_mode=transaction) hands each statement to any
        // server session, so a session lock would be taken on a session we no longer hold.
        throw new DatabaseUnavailableError(
          'the connection goes through a pooler that does not keep sessions (backend pid changed between statements); point DATABASE_URL at Postgres directly or at a session-mode pool',
        );
      }
      if (row.ok) break;
      if (opts.signal?.aborted) throw opts.signal.reason ?? new InterruptedError('SIGINT');
      if (Date.now() >= deadline) {
        throw new BusyError(
          opts.wait
            ? `${opts.what} is still running in another process after waiting ${opts.wait === true ? '' : `${opts.wait}s`}; try again later`
            : `${opts.what} is running in another process (its advisory lock is held); try again later or pass --wait`,
        );
      }
      await sleep(POLL_MS + Math.floor(Math.random() * POLL_MS), opts.signal);
    }
    const interval = opts.checkIntervalMs ?? 2_000;
    timer = setInterval(() => {
      // Never queue a check behind one that has not answered: the deadline of that one decides.
      if (busy > 0 || lostController.signal.aborted) return;
      timed<{ pid: number }>('select pg_backend_pid() as pid', [], checkTimeout).then(
        (rows) => {
          if (rows[0]?.pid !== pid) loseLock('the session behind the lock changed');
        },
        (err) => loseLock((err as Error).message, err),
      );
    }, interval);
    timer.unref();
    const query = <R extends pg.QueryResultRow>(text: string, values: readonly unknown[]) => {
      if (lostController.signal.aborted) return Promise.reject(lostController.signal.reason);
      return timed<R>(text, values, checkTimeout * 6);
    };
    return { name: opts.name, key, pid, lost: lostController.signal, query, release };
  } catch (err) {
    await release();
    throw err;
  }
}

/** Drops a client's socket at once (no goodbye): for a session that has stopped answering. */
function destroySocket(client: pg.Client): void {
  (client as unknown as { connection?: { stream?: { destroy(): void } } }).connection?.stream?.destroy();
}
