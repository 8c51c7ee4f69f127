import { AbortedTransactionError, DefaultQueryExecutor, Kysely, PostgresDialect, PostgresDriver, Transaction, type CompiledQuery, type ConnectionProvider, type DatabaseConnection, type Driver, type QueryResult } from 'kysely';
import type pg from 'pg';
import { cancelActiveStatement, sessionSetupOf } from './database.ts';
import { codeOf } from './errors.ts';
import { leadingTokens, splitStatements } from './sql-statements.ts';

/**
 * One worker slot of a step: a connection of the work pool kept for the slot's whole life, so a
 * chunk costs no pool checkout, and the chunk transactions on it.
 *
 * A chunk's transaction costs no round trip more than a hand-written `BEGIN; …; COMMIT` loop: the
 * BEGIN travels in one message with the claim (a parameterless `EXECUTE` of a prepared statement).
 * BEGIN, COMMIT and ROLLBACK go straight to the connection; the job gets a Kysely `Transaction`
 * made for this one transaction ({@link ChunkSlot.trx}): it refuses a nested transaction, and any
 * query once the chunk's transaction is ending or over, like the one `db.transaction()` gives.
 * (Kysely's own `transaction()` per chunk cost 20-30 µs of Node CPU in acquire/begin/commit/release
 * plumbing, about a tenth of the runner's CPU per chunk.)
 */
export interface ChunkSlot {
  /**
   * Opens a chunk's transaction: BEGIN and `claim`, a statement without parameters, in one
   * message. Returns the claim's rows; the transaction stays open until commit() or rollback().
   * `cancelOn`: a claim that may wait (the last pass's, on a chunk another worker holds) is
   * cancelled once it aborts (a first SIGTERM): nothing of a chunk has started, and the claim fails
   * with 57014 instead of holding the worker until the chunk it waits for ends.
   */
  begin<R>(claim: string, cancelOn?: AbortSignal): Promise<R[]>;
  /** The open transaction as a Kysely `Transaction`, for the job's `ctx.db`; refused once it ends. */
  readonly trx: Transaction<any>;
  /** COMMIT. Throws Kysely's AbortedTransactionError when PostgreSQL rolled back instead (an earlier error of the transaction). */
  commit(): Promise<void>;
  /**
   * COMMIT, and in the same message BEGIN and `claim`, the next chunk's claim: a slot that goes on
   * at once saves the round trip of the next BEGIN. Returns the claim's rows, in a transaction left
   * open as by begin(). Throws AbortedTransactionError, after rolling the next transaction back,
   * when PostgreSQL rolled this one back instead of committing it. Any other error leaves it
   * unknown whether the COMMIT took effect (the claim after it may be what failed): the slot is
   * rolled back and the error thrown as {@link CommitUnknownError}.
   */
  commitAndBegin<R>(claim: string): Promise<R[]>;
  /** ROLLBACK when a transaction is open; a connection that cannot roll back is dropped, and the next begin() takes a fresh one. */
  rollback(): Promise<void>;
  /**
   * ROLLBACK and `statement` (run on its own after it) in one message: the statement follows the
   * chunk's release at once, with no round trip in between for another session to act in.
   * Returns the statement's rows; on any error the slot is rolled back as by rollback().
   */
  rollbackWith<R>(statement: string): Promise<R[]>;
  /**
   * Ends a chunk that failed: rolls its work back to the savepoint taken right after the claim
   * (the claim's row lock stays held), runs `statement` (which must undo the claim's marker and
   * record the failure on the chunk) and commits, all in one message. The chunk row is never
   * unlocked before `statement` is committed, so no other session can claim the chunk in between.
   * Returns the statement's rows; on any error the slot is rolled back as by rollback() and the
   * error thrown (the statement then took no effect).
   */
  abandonWith<R>(statement: string): Promise<R[]>;
  /**
   * Whether a chunk transaction is open on the slot: begun, not committed or rolled back, and the
   * server still in it (a COMMIT that failed ended it there, though rollback() is still owed).
   */
  readonly open: boolean;
  /**
   * A Kysely over the slot's own connection, for statements between chunk transactions (a failed
   * chunk's bookkeeping): they need no second connection from the pool, which the other slots'
   * effects and the planner share. Refuses while a chunk transaction is open.
   */
  readonly db: Kysely<any>;
  /**
   * ctx.signal of the chunk on the slot's connection: `abort` (the run's), which also aborts when
   * that connection is lost (the server ended its session: idle in transaction past the timeout,
   * a terminated backend, a restart), since the chunk's transaction is gone with it and can never
   * commit. A chunk that waits on the signal alone (a fetch, a queue) learns of it. Made once per
   * connection, not per chunk.
   */
  readonly signal: AbortSignal;
  /** Hands the connection back to the pool. */
  release(): void;
}

/** The PREPAREs each pool client's server session has had: a pool hands the same clients out again. */
const preparedOn = new WeakMap<pg.PoolClient, Set<string>>();

/**
 * A COMMIT sent with the next claim (ChunkSlot.commitAndBegin) got an error: it came from the
 * COMMIT (nothing of the chunk committed) or from the claim after it (the chunk committed). The
 * chunk's marker tells which. `cause` is the error as PostgreSQL or the driver gave it.
 */
export class CommitUnknownError extends Error {
  constructor(cause: unknown) {
    super((cause as Error)?.message ?? String(cause), { cause });
    this.name = 'CommitUnknownError';
  }
}

/**
 * Taken right after every claim, in the claim's message: a chunk that fails rolls back to it, so
 * its claim's row lock stays held until its failure is recorded (ChunkSlot.abandonWith).
 */
const SAVEPOINT = 'idem_chunk';

/** What a chunk's transaction is: `ending` from the moment COMMIT or ROLLBACK is sent. */
type TransactionState = { status: 'open' | 'ending' | 'over' };

const dialect = new PostgresDialect({ pool: {} as pg.Pool });
const compiler = dialect.createQueryCompiler();
const adapter = dialect.createAdapter();
const config = { dialect };

/** The driver a chunk's `Transaction` carries: the transaction is idem's, so the job cannot start, end or nest one. */
const refusing = (): never => {
  throw new Error('a chunk runs in a transaction of its own that idem commits: ctx.db cannot start, nest or end a transaction');
};
const chunkDriver: Driver = {
  init: async () => {},
  acquireConnection: refusing,
  beginTransaction: refusing,
  commitTransaction: refusing,
  rollbackTransaction: refusing,
  releaseConnection: async () => {},
  destroy: refusing,
};

/**
 * A statement that would start or end a transaction (BEGIN, START TRANSACTION, COMMIT, END, ABORT,
 * ROLLBACK but ROLLBACK TO SAVEPOINT, PREPARE TRANSACTION), after any leading comments. Sent
 * through ctx.db it would end the chunk's transaction, claim and marker with it, behind idem's
 * back: refused before it reaches the server. Savepoints stay the job's to use.
 */
const TRANSACTION_CONTROL = /^(?:\s+|--[^\n\r]*(?:[\n\r]|$)|\/\*[\s\S]*?\*\/)*(begin|start\s+transaction|commit(?!\s+prepared)|end|abort|rollback(?!(?:\s+(?:work|transaction))?\s+to\b)|prepare\s+transaction)\b/i;

/**
 * The chunk's transaction is gone under the job's feet (a COMMIT or ROLLBACK hidden after a `;`).
 * `committed`: it was a COMMIT, so the chunk's work so far committed with the marker the claim wrote.
 */
export class TransactionEndedError extends Error {
  readonly committed: boolean;
  constructor(committed = false) {
    super(
      "ctx.db ended the chunk's transaction (a COMMIT or ROLLBACK among the statements it sent): idem commits each chunk with its marker, so run() must not end it; throw an error to roll the chunk back",
    );
    this.name = 'TransactionEndedError';
    this.committed = committed;
  }
}

/** Tags that start a transaction: inside the chunk's, a BEGIN only warns; after an end, it opens the job's own. */
const BEGIN_TAGS = new Set(['BEGIN', 'START TRANSACTION']);
/**
 * Checks the command tags of a text sent without parameters (the simple protocol, the only one
 * that carries several statements): a COMMIT (AND CHAIN too), a ROLLBACK other than to a
 * savepoint, or a PREPARE TRANSACTION among them ended the chunk's transaction, even when a BEGIN
 * opened another one after it, which the session's status cannot tell (`ROLLBACK TO SAVEPOINT`
 * answers with a ROLLBACK's tag too: the text's statements tell how many were those). Returns how the first of
 * them ended it, 'begin' for a BEGIN inside the chunk's transaction (which only warned), or null.
 */
function hiddenControl(text: string, result: pg.QueryResult | pg.QueryResult[]): 'committed' | 'rolled back' | 'begin' | null {
  const results = Array.isArray(result) ? result : [result];
  let toSavepoint: number | undefined;
  let begin = false;
  for (const r of results) {
    const tag = r?.command;
    if (tag === 'COMMIT') return 'committed';
    if (tag === 'PREPARE TRANSACTION') return 'rolled back';
    if (tag === 'ROLLBACK') {
      toSavepoint ??= splitStatements(text).filter((statement) => {
        const [first = '', second = '', third = ''] = leadingTokens(statement);
        return first === 'rollback' && controlOf(first, second, third) === null;
      }).length;
      if (toSavepoint-- <= 0) return 'rolled back';
    } else if (BEGIN_TAGS.has(tag)) begin = true;
  }
  return begin ? 'begin' : null;
}

const refusedControl = (what: string) =>
  new Error(`a chunk runs in a transaction of its own that idem commits: ctx.db cannot start, nest or end a transaction (got ${what}); throw an error to roll the chunk back`);

/**
 * The slot's word on its chunk's transaction: `ended` once the job's statements ended it (and
 * `committed`, when by a COMMIT); `sessionChanged` once they changed a setting of the session (a
 * SET without LOCAL, a RESET), which would outlive the chunk on the slot's connection.
 */
interface JobTransaction {
  ended: boolean;
  committed: boolean;
  sessionChanged: boolean;
}

/**
 * Checks a text the job sends, before it is sent: a statement that starts or ends a transaction is
 * refused (the first one, or, in a text without parameters, which may hold several, any of them:
 * after a COMMIT or ROLLBACK the statements that follow in the same message would run and commit
 * outside the chunk's transaction); a statement that changes a session setting is noted. A text
 * with a backslash is read both ways, with and without backslash escapes in its strings
 * (`standard_conforming_strings`), and what either reading finds counts.
 */
function checkText(text: string, parameterless: boolean, trx: JobTransaction): void {
  // With parameters (the chunk path's usual query): one statement, nothing allocated.
  if (!parameterless) return refuseControl(text);
  const readings = text.includes('\\') ? [...splitStatements(text), ...splitStatements(text, true)] : splitStatements(text);
  for (const statement of readings) {
    const [first = '', second = '', third = ''] = leadingTokens(statement);
    const control = controlOf(first, second, third);
    if (control) throw refusedControl(control);
    // SET LOCAL, SET TRANSACTION and SET CONSTRAINTS end with the transaction; `set local.x = …` (a
    // custom setting named local.x) does not.
    if (first === 'reset' || (first === 'set' && !(['local', 'transaction', 'constraints'].includes(second) && third !== '.'))) trx.sessionChanged = true;
  }
}

/** The transaction control a statement starting with these tokens is, if it is one (BEGIN, COMMIT, ROLLBACK but ROLLBACK TO SAVEPOINT, …). */
function controlOf(first: string, second: string, third: string): string | null {
  switch (first) {
    case 'begin':
    case 'end':
    case 'abort':
      return first.toUpperCase();
    case 'commit':
      return second === 'prepared' ? null : 'COMMIT';
    case 'rollback':
      return second === 'to' || ((second === 'work' || second === 'transaction') && third === 'to') || second === 'prepared' ? null : 'ROLLBACK';
    case 'start':
    case 'prepare':
      return second === 'transaction' ? `${first.toUpperCase()} TRANSACTION` : null;
    default:
      return null;
  }
}

function refuseControl(statement: string): void {
  const control = TRANSACTION_CONTROL.exec(statement);
  if (control) throw refusedControl(control[1]!.toUpperCase().replace(/\s+/g, ' '));
}

/**
 * What Kysely's connection of a chunk takes for its pg client: the slot's, with the answer to a
 * text sent without parameters checked for a transaction end hidden in it (hiddenControl). A
 * query with parameters is one statement, refused up front when it is one of those.
 */
function checkedClient(client: pg.PoolClient, trx: JobTransaction): pg.PoolClient {
  return {
    query(text: string, values?: unknown[]) {
      if (typeof text !== 'string' || (values && values.length > 0)) return client.query(text as never, values);
      return client.query(text, values).then((result: pg.QueryResult | pg.QueryResult[]) => {
        // A backstop: checkText refuses these before they are sent.
        const control = hiddenControl(text, result);
        if (control === 'committed' || control === 'rolled back') {
          trx.ended = true;
          trx.committed = control === 'committed';
          throw new TransactionEndedError(trx.committed);
        }
        if (control === 'begin') throw refusedControl('BEGIN');
        return result;
      });
    },
    release: (discard?: boolean) => client.release(discard),
  } as unknown as pg.PoolClient;
}

/**
 * The slot's connection as a chunk's queries use it: a statement that starts or ends a
 * transaction is refused, and a query after which the chunk's transaction is over (one hidden
 * after a `;` ended it) fails the chunk at once, and every query after it is refused before it
 * reaches the server, so nothing of the job's runs outside the chunk's transaction, even when the
 * job catches the error. Without this, the chunk's work ran again and again: idem's COMMIT found
 * no transaction (PostgreSQL only warns), took the chunk for committed, and claimed it again.
 */
function guardedConnection(connection: DatabaseConnection, client: pg.PoolClient, trx: JobTransaction): DatabaseConnection {
  const check = (query: CompiledQuery) => {
    if (trx.ended || transactionStatus(client) === 'I') throw new TransactionEndedError(trx.committed);
    checkText(query.sql, query.parameters.length === 0, trx);
  };
  return {
    async executeQuery<R>(query: CompiledQuery) {
      check(query);
      const result = await connection.executeQuery<R>(query);
      if (transactionStatus(client) === 'I') {
        trx.ended = true;
        throw new TransactionEndedError();
      }
      return result;
    },
    streamQuery<R>(query: CompiledQuery, chunkSize?: number) {
      check(query);
      return connection.streamQuery<R>(query, chunkSize);
    },
  };
}

/** pg's ReadyForQuery status of the session: 'I' idle (no transaction), 'T' in one, 'E' in a failed one. */
const transactionStatus = (client: pg.PoolClient) => (client as unknown as { getTransactionStatus?(): string | null }).getTransactionStatus?.();

/**
 * The server said (ReadyForQuery 'I', the last statement answered, none in flight) that no
 * transaction is open: a COMMIT that failed (the fence, a deferred constraint) ended it. A ROLLBACK
 * then would do nothing but draw `WARNING: there is no transaction in progress` into the server's
 * log. False whenever that is not known for sure (a statement in flight, an older pg): then the
 * ROLLBACK goes as before.
 */
const noTransaction = (client: pg.PoolClient) => usable(client) && isReady(client) && transactionStatus(client) === 'I';
/** Whether pg still takes statements on the connection: not after a connection error or end() (its last status is then stale). */
const usable = (client: pg.PoolClient) => {
  const c = client as unknown as { _queryable?: boolean; _ending?: boolean };
  return c._queryable !== false && c._ending !== true;
};
const isReady = (client: pg.PoolClient) => (client as unknown as { readyForQuery?: boolean }).readyForQuery === true;

/**
 * pg rejects a statement as soon as its error arrives, and may read the ReadyForQuery after it
 * (the transaction status) only later: an empty query, sent in any transaction state and answered
 * at once, waits for it. Only then, only when it has not been read yet.
 */
const settle = async (client: pg.PoolClient) => {
  // A connection that failed answers nothing: the ROLLBACK that follows then fails as it always did
  // (and the slot drops the connection), instead of this throwing before the transaction state moves.
  if (!isReady(client) && typeof (client as unknown as { getTransactionStatus?: unknown }).getTransactionStatus === 'function') await client.query('').catch(() => {});
};

const closedError = (s: TransactionState) =>
  new Error(`this chunk's transaction is ${s.status === 'ending' ? 'ending' : 'over'}: ctx.db may be used only until the chunk's run() returns`);

/**
 * The executor of a chunk's `Transaction`: Kysely's own, over the slot's connection, refusing every
 * query once the transaction is ending or over. A query without plugins goes straight to the
 * connection: Kysely's path there is four promise layers (connection provider, consumer, result
 * transform) that do nothing without plugins, and per chunk they were a measurable share of the
 * runner's Node CPU. With plugins (`ctx.db.withPlugin(…)`), Kysely's path, through the guard.
 */
class ChunkQueryExecutor extends DefaultQueryExecutor {
  readonly #state: TransactionState;
  readonly #connection: DatabaseConnection;
  constructor(state: TransactionState, connection: DatabaseConnection) {
    super(compiler, adapter, {
      async provideConnection(consumer) {
        if (state.status !== 'open') throw closedError(state);
        return consumer(connection);
      },
    } satisfies ConnectionProvider, []);
    this.#state = state;
    this.#connection = connection;
  }
  override executeQuery<R>(compiledQuery: CompiledQuery): Promise<QueryResult<R>> {
    if (this.#state.status !== 'open') return Promise.reject(closedError(this.#state));
    return this.#connection.executeQuery<R>(compiledQuery);
  }
}

/** Opens a slot; `prepare` are statements each server session of the slot needs once (PREPARE …). */
/**
 * `checksFirst`: the database has deferrable constraints (Store.hasDeferrableConstraints), whose
 * checks would otherwise run in the COMMIT, where a failure ends the transaction and lets the
 * chunk's row go before its failure is recorded, so another worker could claim and run it again
 * in between. With it, every COMMIT is sent after `SET CONSTRAINTS ALL IMMEDIATE`, in the same
 * message: the checks (and the fence trigger's) run first, inside the transaction, and a chunk
 * that fails them is rolled back to its savepoint with its row lock held, like a chunk whose work
 * threw.
 */
export function openChunkSlot(pool: pg.Pool, prepare: readonly string[], checksFirst = false, abort: AbortSignal = new AbortController().signal): ChunkSlot {
  const checks = checksFirst ? 'set constraints all immediate;\n' : '';
  let client: pg.PoolClient | undefined;
  /** The current connection's signal (see ChunkSlot.signal), and how to stop listening to it. */
  let signal = abort;
  let unwatch = () => {};
  /** Kysely's connection over `client`, for the job's queries (result shape, errors, as everywhere). */
  let connection: DatabaseConnection | undefined;
  let state: TransactionState = { status: 'over' };
  let trx: Transaction<any> | undefined;
  /** Whether the job's statements ended the chunk's transaction (reset with each chunk). */
  const jobTransaction: JobTransaction = { ended: false, committed: false, sessionChanged: false };
  /** From BEGIN sent until a COMMIT or ROLLBACK was answered: the server may hold a transaction. */
  let inTransaction = false;
  /** The message commitAndBegin() sends, made once per claim text (a slot sends the same one chunk after chunk). */
  let pipelined = { claim: '', text: '' };
  const commitAndBeginText = (claim: string) =>
    pipelined.claim === claim ? pipelined.text : (pipelined = { claim, text: `${checks}commit;\nbegin;\n${claim};\nsavepoint ${SAVEPOINT}` }).text;
  /**
   * Once the stop is immediate (`abort`: a second signal, the shutdown deadline, a lost lock), the
   * job's statements in flight on this slot are cancelled, and any it sends after, until the chunk's
   * transaction ends: a chunk inside a long statement (an UPDATE, a pg_sleep) ends at once and is
   * rolled back, and the attempt is recorded as it ended, instead of the process exiting with the
   * statement still running on the server (its row locks held) and the run left `running`.
   * idem's own statements (the ROLLBACK, the COMMIT) are never cancelled.
   */
  let cancelling: NodeJS.Timeout | undefined;
  const cancelled = new WeakSet<object>();
  /** A connection a cancel request was sent on: one arriving late would hit its next statement, so it never goes back to the pool. */
  let cancelledOn: pg.PoolClient | undefined;
  const cancelJobStatements = () => {
    if (client && state.status === 'open' && cancelActiveStatement(client, cancelled)) cancelledOn = client;
  };
  const onAbort = () => {
    cancelJobStatements();
    cancelling ??= setInterval(cancelJobStatements, 50).unref();
  };
  if (abort.aborted) onAbort();
  else abort.addEventListener('abort', onAbort, { once: true });

  const connect = async (): Promise<pg.PoolClient> => {
    const c = await pool.connect();
    try {
      const done = preparedOn.get(c) ?? new Set<string>();
      preparedOn.set(c, done);
      for (const text of prepare) {
        if (done.has(text)) continue;
        // 42P05 duplicate_prepared_statement: a session pooler with server_reset_query turned off
        // handed on a session that has it already. Its name is the hash of its text (Store), so it
        // is this very statement.
        await c.query(text).catch((err: unknown) => {
          if (codeOf(err) !== '42P05') throw err;
        });
        done.add(text);
      }
      const driver = new PostgresDriver({ pool: { connect: async () => checkedClient(c, jobTransaction) } as unknown as pg.Pool });
      await driver.init();
      connection = guardedConnection(await driver.acquireConnection(), c, jobTransaction);
    } catch (err) {
      c.release(true);
      throw err;
    }
    const lost = new AbortController();
    const onLost = (err?: unknown) => lost.abort(err instanceof Error ? err : new Error('Connection terminated unexpectedly'));
    c.on('error', onLost);
    c.on('end', onLost);
    unwatch = () => {
      c.off('error', onLost);
      c.off('end', onLost);
    };
    signal = AbortSignal.any([abort, lost.signal]);
    return c;
  };

  /** Hands the connection back to the pool, or drops it (`discard`) so that it is never handed out again. */
  const letGo = (discard: boolean) => {
    unwatch();
    unwatch = () => {};
    client?.release(discard || client === cancelledOn);
    client = undefined;
    connection = undefined;
    inTransaction = false;
  };

  /** A Kysely Transaction for one chunk's transaction: every query checks that it is still open. */
  const newTransaction = (s: TransactionState, conn: DatabaseConnection): Transaction<any> => {
    const executor = new ChunkQueryExecutor(s, conn);
    return new Transaction<any>({ config, executor, dialect, driver: chunkDriver } as unknown as ConstructorParameters<typeof Transaction<any>>[0]);
  };

  /**
   * Ends the chunk's transaction with `text`: COMMIT or ROLLBACK, alone or followed in the same
   * message by more statements (pg then answers with one result per statement). The transaction
   * is `ending` from the moment it is sent; an error leaves `inTransaction` as it was, so that
   * rollback() can still end it.
   */
  const end = async <T extends pg.QueryResult | pg.QueryResult[] = pg.QueryResult>(text: string): Promise<T> => {
    state.status = 'ending';
    try {
      const result = (await client!.query(text)) as unknown as T;
      inTransaction = false;
      return result;
    } finally {
      state.status = 'over';
    }
  };

  /** A new chunk transaction on the slot's connection: ctx.db for it, refused once it ends. */
  const opened = () => {
    state = { status: 'open' };
    trx = newTransaction(state, connection!);
    inTransaction = true;
    jobTransaction.ended = false;
    jobTransaction.committed = false;
    jobTransaction.sessionChanged = false;
  };

  /**
   * What ChunkSlot.db's Kysely takes for a pool: hands out the slot's connection (connecting when
   * the slot has none), never while a chunk transaction is open. A connection that failed (not an
   * error PostgreSQL answered with on a live session) is dropped, and the next statement connects
   * afresh, so Store's retries of transient errors do not retry on a dead socket.
   */
  const ownConnection = {
    connect: async () => {
      if (inTransaction) throw new Error('a chunk transaction is open on this slot: its bookkeeping waits until it ends');
      const c = (client ??= await connect());
      const drop = () => {
        if (client === c) letGo(true);
      };
      return {
        query: (text: string, values?: unknown[]) =>
          c.query(text, values).catch((err: unknown) => {
            if (!(err instanceof Error && 'severity' in err) || /^(08|57P)/.test(codeOf(err) ?? '')) drop();
            throw err;
          }),
        // Kysely asks to discard a connection whose ROLLBACK failed.
        release: (discard?: boolean) => {
          if (discard) drop();
        },
      };
    },
    end: async () => {},
  };
  let bookkeeping: Kysely<any> | undefined;

  /**
   * After an error from a message that began with the deferred checks: true when it was theirs,
   * the transaction is still open and is now back at the claim's savepoint. False when the COMMIT
   * or what followed it failed (no transaction of the chunk is left to roll back to).
   */
  const checksFailed = async (): Promise<boolean> => {
    if (!checks) return false;
    try {
      await client!.query(`rollback to savepoint ${SAVEPOINT}`);
      inTransaction = true;
      return true;
    } catch {
      return false;
    }
  };

  const rollback = async () => {
    if (!inTransaction || !client) return;
    try {
      await settle(client);
      if (noTransaction(client)) {
        // Ended on the server already (until 2026-12-04 a ROLLBACK was sent anyway, and the server
        // logged a WARNING for every chunk the fence refused).
        inTransaction = false;
      } else await end('rollback');
      // The job's statements ended the chunk's transaction themselves (see rollbackWith).
      if (jobTransaction.ended) letGo(true);
    } catch {
      // The socket is gone (or the server dropped the session): the next chunk takes a fresh one.
      letGo(true);
    }
  };

  const begin = async <R>(claim: string, cancelOn?: AbortSignal) => {
    if (inTransaction) throw new Error('a chunk transaction is already open on this slot');
    const c = (client ??= await connect());
    // Open for rollback() from here; open to the job's statements (and to an abort's cancel, which
    // must never hit idem's own claim) only once the claim has answered.
    inTransaction = true;
    jobTransaction.ended = false;
    jobTransaction.committed = false;
    jobTransaction.sessionChanged = false;
    // Simple protocol, two statements in one message: pg answers with one result per statement.
    const sent = c.query(`begin;\n${claim};\nsavepoint ${SAVEPOINT}`) as unknown as Promise<pg.QueryResult[]>;
    const cancel = () => {
      if (cancelActiveStatement(c, cancelled)) cancelledOn = c;
    };
    if (cancelOn?.aborted) cancel();
    else cancelOn?.addEventListener('abort', cancel, { once: true });
    let results: pg.QueryResult[];
    try {
      results = await sent;
    } finally {
      cancelOn?.removeEventListener('abort', cancel);
    }
    opened();
    return results[1]!.rows as R[];
  };

  /**
   * A setting the chunk changed for the session (SET without LOCAL) committed with it, and would
   * reach the next chunk and idem's own claim (`set default_transaction_read_only = on` made every
   * later claim fail; a leaked statement_timeout failed an innocent chunk): these statements undo
   * every one of them and set idem's own again, in a transaction of their own (sent in the next
   * claim's message, a full ROLLBACK of that chunk must not bring the settings back). Undefined
   * when the session's setup is not known: then the connection is dropped instead.
   */
  const resetSession = (c: pg.PoolClient): string | undefined => {
    const setup = sessionSetupOf.get(c);
    return setup === undefined ? undefined : `begin;\nreset session authorization;\nreset role;\nreset all;\n${setup};\ncommit`;
  };

  const commit = async () => {
    if (jobTransaction.ended || transactionStatus(client!) === 'I') throw new TransactionEndedError(jobTransaction.committed);
    let result: pg.QueryResult | pg.QueryResult[];
    try {
      result = await end<pg.QueryResult | pg.QueryResult[]>(`${checks}commit`);
    } catch (err) {
      await checksFailed();
      throw err;
    }
    const { command } = Array.isArray(result) ? result[result.length - 1]! : result;
    // PostgreSQL ends COMMIT with a ROLLBACK tag when an earlier statement's error aborted the
    // transaction (the job caught it): nothing of the chunk committed.
    if (command === 'ROLLBACK') throw new AbortedTransactionError();
    if (jobTransaction.sessionChanged) {
      const reset = resetSession(client!);
      if (reset === undefined) letGo(true);
      else await client!.query(reset).catch(() => letGo(true));
    }
  };

  return {
    begin,
    async commitAndBegin<R>(claim: string) {
      // No transaction of the chunk to commit: the job's statements ended it (guardedConnection tells how).
      if (jobTransaction.ended || transactionStatus(client!) === 'I') throw new TransactionEndedError(jobTransaction.committed);
      // Session settings the chunk changed are reset in the same message, before the next BEGIN.
      const reset = jobTransaction.sessionChanged ? resetSession(client!) : '';
      if (reset === undefined) {
        await commit(); // drops the connection: the next claim goes on a fresh one
        try {
          return await begin<R>(claim);
        } catch (err) {
          await rollback();
          throw new CommitUnknownError(err);
        }
      }
      let results: pg.QueryResult[];
      try {
        // Three statements in one message. PostgreSQL runs them in order and stops at the first
        // error: a failed COMMIT runs no claim; a COMMIT of an aborted transaction answers ROLLBACK
        // and the BEGIN and claim after it still run.
        results = await end<pg.QueryResult[]>(reset ? `${checks}commit;\n${reset};\nbegin;\n${claim};\nsavepoint ${SAVEPOINT}` : commitAndBeginText(claim));
      } catch (err) {
        // The deferred checks failed: a failure of the chunk, whose transaction is still open.
        if (await checksFailed()) throw err;
        // A failed claim left its transaction aborted; a failed COMMIT left none (then ROLLBACK only warns).
        await rollback();
        // The reset may not have run: the session's settings are not known any more.
        if (reset) letGo(true);
        throw new CommitUnknownError(err);
      }
      opened();
      if (checks) results.shift();
      if (results[0]!.command === 'ROLLBACK') {
        // Nothing of the chunk committed: the chunk claimed after it starts no work.
        await rollback();
        throw new AbortedTransactionError();
      }
      // The claim's rows: the last statement but one (the SAVEPOINT is the last).
      return results[results.length - 2]!.rows as R[];
    },
    get trx() {
      if (!trx) throw new Error('no chunk transaction was opened on this slot');
      return trx;
    },
    commit,
    rollback,
    async rollbackWith<R>(statement: string) {
      if (!client) throw new Error('no connection on this slot');
      try {
        // No ROLLBACK where no transaction is open (a failed COMMIT ended it): see noTransaction.
        await settle(client);
        const results = await end<pg.QueryResult | pg.QueryResult[]>(noTransaction(client) ? statement : `rollback;\n${statement}`);
        return (Array.isArray(results) ? results[results.length - 1]! : results).rows as R[];
      } catch (err) {
        await rollback();
        throw err;
      } finally {
        // The job's statements ended the chunk's transaction themselves: what they did to the
        // session (a SET their COMMIT committed) is not known; the next chunk gets a fresh one.
        if (jobTransaction.ended) letGo(true);
      }
    },
    async abandonWith<R>(statement: string) {
      if (!client || !inTransaction) throw new Error('no chunk transaction is open on this slot');
      try {
        const results = await end<pg.QueryResult[]>(`rollback to savepoint ${SAVEPOINT};\n${statement};\ncommit`);
        // A COMMIT that answers ROLLBACK committed nothing: the statement took no effect.
        if (results[2]?.command === 'ROLLBACK') throw new AbortedTransactionError();
        return results[1]!.rows as R[];
      } catch (err) {
        await rollback();
        throw err;
      }
    },
    /** Whether the chunk's own transaction is open (not one the job opened after ending it). */
    get open() {
      return inTransaction && !!client && !jobTransaction.ended && transactionStatus(client) !== 'I';
    },
    get db() {
      return (bookkeeping ??= new Kysely<any>({ dialect: new PostgresDialect({ pool: ownConnection as unknown as pg.Pool }) }));
    },
    get signal() {
      return signal;
    },
    release() {
      abort.removeEventListener('abort', onAbort);
      clearInterval(cancelling);
      state.status = 'over';
      // A connection that may still be inside a transaction never goes back to the pool.
      letGo(inTransaction);
    },
  };
}
