import { Kysely } from 'kysely';
import pg from 'pg';
import type { Logger } from 'pino';
import { DatabaseUnavailableError } from './errors.ts';
import { IdemPostgresDialect } from './marker-at-commit.ts';

/**
 * Replaces the password in a connection string (URL or key=value form) with `***`.
 * Every place idem prints a connection string goes through here.
 */
export function redactUrl(url: string): string {
  try {
    const u = new URL(url);
    if (u.password) u.password = '***';
    for (const k of ['password', 'sslpassword']) if (u.searchParams.has(k)) u.searchParams.set(k, '***');
    return u.toString().replace(/%2A%2A%2A/g, '***');
  } catch {
    return url.replace(/(password\s*=\s*)('[^']*'|\S+)/gi, '$1***').replace(/(:\/\/[^:/@\s]*:)[^@\s]*@/, '$1***@');
  }
}

/** Removes any occurrence of the connection string's password from a message. */
export function redactSecrets(text: string, connectionString: string): string {
  let password = '';
  try {
    password = decodeURIComponent(new URL(connectionString).password);
  } catch {
    password = /password\s*=\s*'?([^'\s]+)/i.exec(connectionString)?.[1] ?? '';
  }
  return password.length >= 3 ? text.split(password).join('***') : text;
}

/**
 * Server-side TCP keepalives for every idem session (lock and work): if this host vanishes (power,
 * network), the server notices within about a minute (30 s idle + 3 probes 10 s apart) and ends
 * the session, freeing its advisory lock and row locks, instead of after the OS defaults' ~2 hours.
 * `tcp_user_timeout` bounds the same when the server has unacknowledged data in flight.
 */
export const SERVER_KEEPALIVES = 'set tcp_keepalives_idle = 30; set tcp_keepalives_interval = 10; set tcp_keepalives_count = 3; set tcp_user_timeout = 60000';

/** Default of `idleInTransactionTimeoutMs`: a vanished process's open chunk transaction is ended after this. */
export const DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS = 60_000;

export interface Database {
  readonly db: Kysely<any>;
  readonly pool: pg.Pool;
  /** Idempotent. */
  close(): Promise<void>;
}

/** Opens the work pool and proves the server answers, mapping failures to one-line errors that say the fix. */
export async function openDatabase(
  connectionString: string,
  opts: { readonly poolSize: number; readonly log: Logger; readonly idleInTransactionTimeoutMs?: number },
): Promise<Database> {
  const idleMs = opts.idleInTransactionTimeoutMs ?? DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS;
  if (!Number.isInteger(idleMs) || idleMs < 0) throw new TypeError(`idleInTransactionTimeoutMs must be an integer >= 0 (got ${idleMs})`);
  const pool = new pg.Pool({ connectionString, max: opts.poolSize, application_name: 'idem', keepAlive: true, connectionTimeoutMillis: 10_000 });
  // An idle client's socket error is emitted on the pool; unhandled, it would kill the process.
  pool.on('error', (err) => opts.log.warn({ err: { message: redactSecrets(err.message, connectionString) } }, 'idle database connection failed'));
  // A checked-out client whose backend dies between two statements (pg_terminate_backend, a
  // restart) emits 'error' on itself, not on the pool; unhandled, that would crash the process.
  // The next statement on it then fails with a connection error, which the chunk retry handles.
  pool.on('connect', (client) => {
    client.on('error', (err) => opts.log.warn({ err: { message: redactSecrets(err.message, connectionString), code: (err as { code?: string }).code } }, 'database connection lost'));
    // Queued before any statement of whoever checked the client out (pg-pool emits 'connect' first).
    // A work session whose process vanished mid-chunk holds the chunk's row locks: the server ends
    // it after idle_in_transaction_session_timeout, so another worker can redo the chunk.
    client.query(`${SERVER_KEEPALIVES}; set idle_in_transaction_session_timeout = ${idleMs}`).catch(() => {});
  });
  try {
    const client = await pool.connect();
    client.release();
  } catch (err) {
    await pool.end().catch(() => {});
    throw describeConnectError(err, connectionString);
  }
  const db = new Kysely<any>({ dialect: new IdemPostgresDialect({ pool }) });
  let closed: Promise<void> | undefined;
  return {
    db,
    pool,
    close: () => (closed ??= db.destroy().catch(() => {})),
  };
}

export function describeConnectError(err: unknown, connectionString: string): DatabaseUnavailableError {
  const code = (err as { code?: string }).code;
  const where = redactUrl(connectionString);
  const raw = redactSecrets((err as Error)?.message ?? String(err), connectionString);
  let msg: string;
  switch (code) {
    case 'ECONNREFUSED':
      msg = `cannot reach the database at ${where}: connection refused; start the server or fix --database-url / DATABASE_URL`;
      break;
    case 'ENOTFOUND':
    case 'EAI_AGAIN':
      msg = `cannot reach the database at ${where}: host not found; fix the host in --database-url / DATABASE_URL`;
      break;
    case '28P01':
    case '28000':
      msg = `the database at ${where} refused the credentials (${raw}); fix the user or password in DATABASE_URL`;
      break;
    case '3D000':
      msg = `the database at ${where} does not exist (${raw}); create it or fix the database name in DATABASE_URL`;
      break;
    default:
      msg = `cannot connect to the database at ${where}: ${raw}; check --database-url / DATABASE_URL`;
  }
  return new DatabaseUnavailableError(msg, { cause: err });
}
