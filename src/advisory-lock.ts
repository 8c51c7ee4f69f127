import pg from 'pg';
import { BusyError, codeOf, DatabaseUnavailableError, InterruptedError, LockLostError, RETRY_OR_WAIT } from './errors.ts';
import { lockKey } from './fingerprint.ts';
import { answerWithin, sleep } from './sleep.ts';
import { CONNECT_RETRY_MS, serverStarting } from './retry.ts';
import { testHookMs } from './test-hooks.ts';
import { lockSessionSetup, NO_CONNECTION_FREE_FIX, sessionName, trackSession } from './database.ts';
import { lockCheckIntervalMs, SILENT_SECONDS_SQL, silentSecondsOf, type LockHolder, describeHolder } from './lock-holder.ts';

export interface AdvisoryLockOptions {
  readonly connectionString: string;
  /** Name hashed into the 64-bit lock key (schema + job). */
  readonly name: string;
  /** What the busy error calls the lock holder's work, e.g. `job "nightly"`. */
  readonly what: string;
  /** `false`: fail with BusyError at once. `true`: wait without bound. A number: wait that many seconds. Defaults to `false`. */
  readonly wait?: boolean | number;
  /** Who holds the lock, shown in `application_name` as `idem-lock <holder>`. Defaults to this process's (WORKER, `host:pid`). */
  readonly holder?: string;
  /**
   * With a numeric `wait`: the wait ends at this time (ms since the epoch) instead of `wait`
   * seconds from now, for a caller that tries again within one wait (a database outage ridden
   * out); the busy error still names `wait`.
   */
  readonly waitUntil?: number;
  /** Aborting stops a wait (the caller is being interrupted). */
  readonly signal?: AbortSignal;
  /** How often the held session is checked for life, in ms. Defaults to `2000` (LOCK_CHECK_INTERVAL_MS). */
  readonly checkIntervalMs?: number;
  /**
   * The lock session's `idle_session_timeout` (PostgreSQL 14+), in ms: the server ends the session,
   * and frees the lock, once it has sent nothing for this long (the process stopped, or its host
   * vanished behind a proxy that keeps the server's side of the connection alive). At least 10
   * check intervals (a smaller one is raised to that). 0 turns it off. Defaults to 30 check
   * intervals (60 s).
   */
  readonly idleSessionTimeoutMs?: number;
  /**
   * How long a check, or a statement sent on the lock's session, may go unanswered before the lock
   * counts as lost, in ms: a host whose network vanished never answers, and never errors either.
   * Defaults to `5000` (checks), 6 times that for statements (which may wait for a row lock).
   */
  readonly checkTimeoutMs?: number;
  /**
   * Worker mode, for a run that several processes may share: the lock `name` is taken *shared*,
   * together with a shared lock on `worker.runName` (the run's own), under a short gate, so that
   * entering is decided atomically. Alone → this process is the run's first worker. Others hold
   * the job's lock → with `join` and the same run, this process joins them; else it is busy
   * (a plain run never overlaps, whether the others work alone or together).
   */
  readonly worker?: {
    readonly runName: string;
    readonly join: boolean;
    /** Run in the entry transaction by the first worker (the attempt bump); no row → refused. */
    readonly first: CompiledSql;
    /** Run in the entry transaction by a joining worker (read the attempt it joins). */
    readonly joiner: CompiledSql;
    /**
     * The busy error when another process holds the run's lock exclusively (idem prune or idem
     * reset deleting the run): no worker enters a run while that lasts.
     */
    readonly runHeld: string;
  };
}

/** A statement with its parameters, as Kysely's `compile()` gives it. */
export interface CompiledSql {
  readonly sql: string;
  readonly parameters: readonly unknown[];
}

/** Default of `checkTimeoutMs`. */
export const LOCK_CHECK_TIMEOUT_MS = 5_000;

/** Default of `idleSessionTimeoutMs`, in check intervals: 60 s. Far above one interval, so a slow check or GC pause never ends a live session. */
export const LOCK_IDLE_INTERVALS = 30;
/** `idleSessionTimeoutMs` is never below this many check intervals. */
const MIN_IDLE_INTERVALS = 10;

/** A held session-level advisory lock; `lost` aborts when its session dies. */
export interface HeldLock {
  /** The name the key was hashed from. */
  readonly name: string;
  readonly key: string;
  /** Aborts (with a LockLostError reason) when the lock's session is gone. */
  readonly lost: AbortSignal;
  /** Backend pid of the session holding the lock. */
  readonly pid: number;
  /** Worker mode: true when no other worker held the run as this one entered. */
  readonly firstWorker: boolean;
  /** Worker mode: the row the entry statement returned (`first` or `joiner`), null when refused. */
  readonly entry: Record<string, unknown> | null;
  /** Worker mode: how many other processes hold the run's lock now (0 outside worker mode). */
  otherWorkers(): Promise<number>;
  /**
   * Worker mode: leaves the run under the entry gate, so that workers stopping at the same moment
   * decide one after the other. With other workers still on the run it lets go of this process's
   * locks at once (the next to leave no longer counts it) and returns their number; as the last
   * one it runs `ifLast` on the lock's session inside the gate (a joiner entering after it sees
   * what it wrote) and returns 0. Outside worker mode it runs nothing and returns null.
   */
  leave(ifLast: CompiledSql): Promise<number | null>;
  /**
   * Checks the lock now instead of at the next periodic check; resolves either way, with `lost`
   * aborted if the session is gone. For an error that may be a symptom of losing the lock.
   */
  confirm(): Promise<void>;
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
  // The worker's identity rides in the lock session's application_name (pg_stat_activity shows it
  // to every role), so `idem status` can name the live workers of a run without a table of its own.
  const appName = sessionName('idem-lock', opts.holder);
  const client = await connectLockSession(() => new pg.Client({ connectionString: opts.connectionString, keepAlive: true, keepAliveInitialDelayMillis: 5_000, application_name: appName }));
  trackSession(client);
  const lostController = new AbortController();
  const loseLock = (why: string, cause?: unknown) => {
    if (lostController.signal.aborted) return;
    lostController.abort(new LockLostError(`lost the advisory lock for ${opts.what}: ${why}; another process may take the run over, rerun to resume`, { cause }));
    // A socket that stopped answering would keep every later statement (and end()) waiting forever.
    destroySocket(client);
  };
  const checkTimeout = opts.checkTimeoutMs ?? LOCK_CHECK_TIMEOUT_MS;
  const interval = opts.checkIntervalMs ?? lockCheckIntervalMs();
  const idleMs = opts.idleSessionTimeoutMs === 0 ? 0 : Math.max(opts.idleSessionTimeoutMs ?? interval * LOCK_IDLE_INTERVALS, interval * MIN_IDLE_INTERVALS);
  /** When the session last answered a statement: how long this process had been silent on it. */
  let lastAnswer = performance.now();
  const idleEnded = `the server ended its session after ${idleMs / 1000}s without a statement from this process (stopped or frozen that long, or cut off behind a proxy)`;
  /** An error of the session, as the lost lock's reason. */
  const whyLost = (err: unknown) => {
    const message = String((err as Error)?.message ?? err);
    // 57P05: the server's idle_session_timeout, which only a silent process meets (see lockSessionSetup).
    if ((err as { code?: string }).code === '57P05') return idleEnded;
    // Behind PgBouncer the server's goodbye never reaches us: PgBouncer closes our side with its own
    // words. After a silence past the idle timeout, that was the server's idle timeout too.
    if (message.includes('server conn crashed?')) {
      return idleMs > 0 && performance.now() - lastAnswer >= idleMs
        ? `${idleEnded}; PgBouncer reported it as "server conn crashed?"`
        : `the connection pooler's session to the server ended (PgBouncer: "server conn crashed?"): the server ended or restarted the lock's session`;
    }
    return message;
  };
  /** Statements in flight on the session; the periodic check never queues behind one. */
  let busy = 0;
  /** One statement, raced against a deadline: no answer in time is a lost lock, not a wait. */
  const timed = async <R extends pg.QueryResultRow>(text: string, values: readonly unknown[], ms: number): Promise<R[]> => {
    busy++;
    try {
      const { rows } = await answerWithin(client.query<R>(text, values as unknown[]), ms, () => {
        loseLock(`its session did not answer within ${ms / 1000}s (network gone?)`);
        return lostController.signal.reason;
      });
      lastAnswer = performance.now();
      return rows;
    } finally {
      busy--;
    }
  };
  // Without an 'error' listener a dropped socket would crash the process instead of failing the run.
  client.on('error', (err) => loseLock(whyLost(err), err));
  client.on('end', () => loseLock('its session ended'));
  let released = false;
  let timer: NodeJS.Timeout | undefined;
  const release = async () => {
    if (released) return;
    released = true;
    if (timer) clearInterval(timer);
    client.removeAllListeners('end');
    client.removeAllListeners('error');
    client.on('error', () => {});
    try {
      // pg_advisory_unlock_all: the job's lock in either mode, and the run's lock in worker mode.
      if (!lostController.signal.aborted) await timed('select pg_advisory_unlock_all()', [], checkTimeout);
    } catch {
      // The session is going away anyway, and with it the lock.
    }
    // end() waits for the server's goodbye, which a dead network never sends.
    const ended = client.end().catch(() => {});
    // Not unref'd: with nothing else left to wait on, an end() that never settles ended the
    // process mid-close (Node's exit 13, not the command's code). Cleared once either settles.
    let bounding: NodeJS.Timeout | undefined;
    const bound = new Promise<void>((resolve) => (bounding = setTimeout(resolve, checkTimeout)));
    await Promise.race([ended, bound]);
    clearTimeout(bounding);
    destroySocket(client);
  };

  try {
    // Server-side keepalives: if this host vanishes (power, network), the server notices within
    // about a minute and drops the session and its lock, instead of keeping the job "busy" for the
    // hours the OS defaults would take. And idle_session_timeout: where keepalives cannot tell (a
    // proxy between, a stopped process), the server ends a session this process no longer checks.
    await client.query(lockSessionSetup(idleMs));
    const { rows: [first] } = await client.query<{ pid: number }>('select pg_backend_pid() as pid');
    const pid = first!.pid;
    const deadline = opts.wait === true ? Infinity : opts.wait ? (opts.waitUntil ?? Date.now() + opts.wait * 1000) : 0;
    const runKey = opts.worker ? lockKey(opts.worker.runName) : null;
    let firstWorker = true;
    let entry: Record<string, unknown> | null = null;
    for (;;) {
      let row: { ok: boolean; pid: number };
      let runHeld = false;
      if (opts.worker && runKey) {
        const entered = await enterAsWorker(client, key, runKey, lockKey(`${opts.name}:gate`), opts.worker);
        row = { ok: entered.ok, pid: entered.pid };
        runHeld = entered.runHeld;
        firstWorker = entered.first;
        entry = entered.entry;
        // Entered, but the run refuses (paused or cancelled meanwhile): hand back a held lock
        // whose entry is null; the caller re-reads the run and says why.
      } else {
        const { rows } = await client.query<{ ok: boolean; pid: number }>('select pg_try_advisory_lock($1::bigint) as ok, pg_backend_pid() as pid', [key]);
        row = rows[0]!;
      }
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
        if (runHeld && opts.worker) throw new BusyError(opts.worker.runHeld);
        const holders = await describeHolders(client, key, interval);
        throw new BusyError(
          opts.wait
            ? `${opts.what} is still running in another process after waiting ${opts.wait === true ? '' : `${opts.wait}s`} (${holders}); try again later`
            : `${opts.what} is running in another process (${holders})`,
          opts.wait ? undefined : RETRY_OR_WAIT,
        );
      }
      await sleep(POLL_MS + Math.floor(Math.random() * POLL_MS), opts.signal);
    }
    const check = () =>
      timed<{ pid: number }>('select pg_backend_pid() as pid', [], checkTimeout).then(
        (rows) => {
          if (rows[0]?.pid !== pid) loseLock('the session behind the lock changed');
        },
        (err) => loseLock(whyLost(err), err),
      );
    lastAnswer = performance.now();
    timer = setInterval(() => {
      // Never queue a check behind one that has not answered: the deadline of that one decides.
      if (busy > 0 || lostController.signal.aborted) return;
      void check();
    }, interval);
    timer.unref();
    const query = <R extends pg.QueryResultRow>(text: string, values: readonly unknown[]) => {
      if (lostController.signal.aborted) return Promise.reject(lostController.signal.reason);
      return timed<R>(text, values, checkTimeout * 6);
    };
    const otherWorkers = async () => {
      if (!runKey) return 0;
      const rows = await query<{ n: number }>(
        `select ${OTHER_HOLDERS('$1')}::int as n`,
        [runKey],
      );
      return rows[0]!.n;
    };
    const gateKey = lockKey(`${opts.name}:gate`);
    const leave = async (ifLast: CompiledSql): Promise<number | null> => {
      if (!runKey) return null;
      await query('begin', []);
      try {
        await query('select pg_advisory_xact_lock($1::bigint)', [gateKey]);
        const rows = await query<{ n: number }>(`select ${OTHER_HOLDERS('$1')}::int as n`, [runKey]);
        const others = rows[0]!.n;
        if (others > 0) await query('select pg_advisory_unlock_shared($1::bigint), pg_advisory_unlock_shared($2::bigint)', [runKey, key]);
        else await query(ifLast.sql, [...ifLast.parameters]);
        await query('commit', []);
        return others;
      } catch (err) {
        await query('rollback', []).catch(() => {});
        throw err;
      }
    };
    const confirm = async () => {
      if (!lostController.signal.aborted) await check();
    };
    return { name: opts.name, key, pid, firstWorker, entry, lost: lostController.signal, query, otherWorkers, leave, confirm, release };
  } catch (err) {
    await release();
    throw err;
  }
}

/**
 * Sessions holding a 64-bit advisory key (granted, any mode) in this database, other than the one
 * asking, the most silent first. pg_stat_activity shows another role's state_change only to a
 * superuser or a member of pg_read_all_stats: null then.
 */
export async function lockHolders(run: (text: string, values: unknown[]) => Promise<Array<Record<string, unknown>>>, keys: readonly string[]): Promise<Array<LockHolder & { key: string }>> {
  const rows = await run(
    `select distinct l.pid, ((l.classid::bigint << 32) | l.objid::bigint)::text as key, a.application_name,
        (${SILENT_SECONDS_SQL})::float8 as silent
      from pg_locks l left join pg_stat_activity a on a.pid = l.pid
      where l.locktype = 'advisory' and l.granted and l.objsubid = 1 and l.pid <> pg_backend_pid()
        and l.database = (select oid from pg_database where datname = current_database())
        and ((l.classid::bigint << 32) | l.objid::bigint) = any($1::bigint[])
      order by silent desc nulls last, l.pid`,
    [keys],
  );
  return rows.map((r) => ({
    key: String(r.key),
    pid: Number(r.pid),
    applicationName: (r.application_name as string | null) || null,
    silentSeconds: silentSecondsOf(r.silent),
  }));
}

/** Who holds `key`, for the busy error; never fails the error it is part of. */
async function describeHolders(client: pg.Client, key: string, intervalMs: number): Promise<string> {
  try {
    const holders = await lockHolders(async (text, values) => (await client.query(text, values)).rows, [key]);
    if (holders.length === 0) return 'its advisory lock is held';
    const shown = holders.slice(0, 3).map((h) => describeHolder(h, intervalMs));
    return `its advisory lock is held by ${shown.join('; ')}${holders.length > 3 ? `; and ${holders.length - 3} more` : ''}`;
  } catch {
    return 'its advisory lock is held';
  }
}

/** Drops a client's socket at once (no goodbye): for a session that has stopped answering. */
/**
 * A new client from `make`, connected. A server starting up or restarting (57P03) is waited for
 * up to 10 s, as opening the pool waits (a pg.Client connects once: each try is a new one); it
 * gave up at once with "cannot open the lock session: the database system is starting up".
 */
async function connectLockSession(make: () => pg.Client): Promise<pg.Client> {
  const until = Date.now() + (testHookMs('IDEM_CONNECT_RETRY_MS') ?? CONNECT_RETRY_MS);
  for (let tries = 0; ; tries++) {
    const client = make();
    // Errors of a try that failed are its own: the caller's listeners come once it is connected.
    const quiet = () => {};
    client.on('error', quiet);
    try {
      await client.connect();
      client.off('error', quiet);
      return client;
    } catch (err) {
      client.off('error', quiet);
      client.on('error', quiet);
      await client.end().catch(() => {});
      if (serverStarting(err) && Date.now() < until) {
        await sleep(Math.min(250 * 2 ** tries, 2_000, Math.max(0, until - Date.now())));
        continue;
      }
      const full = codeOf(err) === '53300' ? `; the database has no connection free for idem: ${NO_CONNECTION_FREE_FIX}` : serverStarting(err) ? '; the database is starting up or restarting: run the same command again once it is up' : '';
      throw new DatabaseUnavailableError(`cannot open the lock session: ${(err as Error).message}${full}`, { cause: err });
    }
  }
}

function destroySocket(client: pg.Client): void {
  (client as unknown as { connection?: { stream?: { destroy(): void } } }).connection?.stream?.destroy();
}

/**
 * Holders of a 64-bit advisory key other than this session (granted, any mode), in this database:
 * advisory locks are per database, and pg_locks shows every database's.
 */
const OTHER_HOLDERS = (param: string) => `(select count(*) from pg_locks where locktype = 'advisory' and granted and objsubid = 1
  and database = (select oid from pg_database where datname = current_database())
  and ((classid::bigint << 32) | objid::bigint) = ${param}::bigint and pid <> pg_backend_pid())`;

/**
 * One decision, made under a transaction-level gate lock (held for a few milliseconds, released by
 * the COMMIT) so that two processes entering at once see each other: take the job's lock shared;
 * alone → first worker; others on the same run and `join` → join; else let go and report busy.
 * A process of an older idem holds the job's lock exclusively, so the shared try fails: busy.
 */
async function enterAsWorker(
  client: pg.Client,
  jobKey: string,
  runKey: string,
  gateKey: string,
  worker: NonNullable<AdvisoryLockOptions['worker']>,
): Promise<{ ok: boolean; first: boolean; pid: number; entry: Record<string, unknown> | null; runHeld: boolean }> {
  await client.query('begin');
  try {
    await client.query('select pg_advisory_xact_lock($1::bigint)', [gateKey]);
    const { rows } = await client.query<{ got: boolean; others: number; on_run: number; pid: number }>(
      `select pg_try_advisory_lock_shared($1::bigint) as got, ${OTHER_HOLDERS('$1')}::int as others, ${OTHER_HOLDERS('$2')}::int as on_run, pg_backend_pid() as pid`,
      [jobKey, runKey],
    );
    const r = rows[0]!;
    let enter = r.got && (r.others === 0 || (worker.join && r.on_run > 0));
    let runHeld = false;
    let entry: Record<string, unknown> | null = null;
    if (enter) {
      // Tried, never waited for: the run's lock held exclusively means idem prune or idem reset is
      // deleting the run (they take it so that no worker can enter a run they delete, and never
      // wait themselves for a worker). Waiting here would hold the gate, and every entry of the
      // job, for as long as the deletion lasts, and then enter a run that is gone.
      const { rows: [shared] } = await client.query<{ ok: boolean }>('select pg_try_advisory_lock_shared($1::bigint) as ok', [runKey]);
      if (shared!.ok) {
        // Inside the gate: a worker joining later sees the first worker's attempt bump, never the one before.
        const stmt = r.others === 0 ? worker.first : worker.joiner;
        entry = (await client.query(stmt.sql, [...stmt.parameters])).rows[0] ?? null;
      } else {
        enter = false;
        runHeld = true;
      }
    }
    if (!enter && r.got) await client.query('select pg_advisory_unlock_shared($1::bigint)', [jobKey]);
    await client.query('commit');
    return { ok: enter, first: enter && r.others === 0, pid: r.pid, entry, runHeld };
  } catch (err) {
    await client.query('rollback').catch(() => {});
    throw err;
  }
}
