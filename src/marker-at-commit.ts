import { CompiledQuery, PostgresDialect, sql, type DatabaseConnection, type Driver, type QueryCompiler, type QueryResult, type RawBuilder, type TransactionSettings } from 'kysely';

/**
 * A chunk's transaction costs no round trip more than a hand-written `BEGIN; …; COMMIT` loop:
 *
 * - the claim rides with BEGIN: `beginTransaction` holds the BEGIN back, and when the chunk's first
 *   statement is its claim (`deferredClaim`), the driver sends `begin; <claim>` as one
 *   simple-protocol message. The claim locks the chunk's row (`FOR UPDATE SKIP LOCKED`, so two
 *   workers sharing a run never run one chunk at once) and raises when there is nothing to claim.
 *   Any other first statement gets its BEGIN sent just before it, as usual.
 * - the completion marker rides with COMMIT: a chunk "executes" its marker through its transaction,
 *   the driver holds it back, and sends `<marker>; commit` as one message when Kysely commits.
 *   Postgres runs them in order; the marker raises when it marks no row, which aborts the
 *   transaction and skips the COMMIT in the same message, so the work never commits without its
 *   marker.
 *
 * Held back per connection (each transaction has its own), so no async-context tracking is needed:
 * on Node 20, AsyncLocalStorage turns on promise hooks for the whole process, a cost on every chunk.
 */
const DEFER = '/* idem:marker-at-commit */ ';
const CLAIM = '/* idem:claim-at-begin */ ';
const REFUSED = Symbol('idem marker refused');
const UNCLAIMED = Symbol('idem claim refused');

/** Statement name → its PREPARE text; each name is prepared once per session, on first use. */
const preparations = new Map<string, string>();

export function registerMarkerStatement(name: string, prepareText: string): void {
  preparations.set(name, prepareText);
}

/** The query a chunk sends last in its transaction: `execute <name>(…)`, held back until COMMIT. */
export function deferredMarker(executeText: string): RawBuilder<unknown> {
  return sql.raw(`${DEFER}${executeText}`);
}

/** The chunk's claim, `execute <name>(…)`: the first statement of its transaction, sent with BEGIN. */
export function deferredClaim(executeText: string): RawBuilder<unknown> {
  return sql.raw(`${CLAIM}${executeText}`);
}

/** True when a chunk's claim found nothing to claim (done, skipped, or locked by another worker). */
export function isClaimRefusal(err: unknown): boolean {
  return !!err && typeof err === 'object' && (err as { [UNCLAIMED]?: boolean })[UNCLAIMED] === true;
}

/** True when a chunk's commit failed because its marker marked nothing (fenced, or done already). */
export function isMarkerRefusal(err: unknown): boolean {
  return !!err && typeof err === 'object' && (err as { [REFUSED]?: boolean })[REFUSED] === true;
}

/** Tags an error as a marker refusal (the marker sent as its own statement, for fault tests). */
export function markerRefusal(message: string): Error {
  return Object.assign(new Error(message), { [REFUSED]: true });
}

/** 22012 division_by_zero: the claim's and the marker's `1 / count(*)` over no row. */
const NOTHING_THERE = '22012';

/** PREPARE is not transactional: once sent, it stays for the session even if this chunk rolls back. */
async function ensurePrepared(c: DeferringConnection, executeText: string): Promise<void> {
  const name = /^execute (\w+)\(/.exec(executeText)?.[1];
  const prepare = name === undefined ? undefined : preparations.get(name);
  if (name === undefined || prepare === undefined || c.prepared.has(name)) return;
  try {
    await c.inner.executeQuery(CompiledQuery.raw(prepare));
  } catch (err) {
    // 42P05 duplicate_prepared_statement: the server session is older than this connection
    // object (a session pooler whose server_reset_query was turned off hands it on). The
    // statement was prepared by idem for the same schema, so use it. Poolers that do not keep
    // sessions at all are refused at connect (database.ts), before any chunk runs.
    if ((err as { code?: string }).code !== '42P05') throw err;
  }
  c.prepared.add(name);
}

class DeferringConnection implements DatabaseConnection {
  readonly inner: DatabaseConnection;
  readonly prepared = new Set<string>();
  pendingMarker: string | undefined;
  /** A BEGIN not sent yet: it goes with the transaction's first statement. */
  pendingBegin = false;
  constructor(inner: DatabaseConnection) {
    this.inner = inner;
  }
  async executeQuery<R>(query: CompiledQuery): Promise<QueryResult<R>> {
    if (query.sql.startsWith(DEFER)) {
      this.pendingMarker = query.sql.slice(DEFER.length);
      return { rows: [] };
    }
    if (!this.pendingBegin) return this.inner.executeQuery<R>(query);
    this.pendingBegin = false;
    if (!query.sql.startsWith(CLAIM)) {
      await this.inner.executeQuery(CompiledQuery.raw('begin'));
      return this.inner.executeQuery<R>(query);
    }
    const claim = query.sql.slice(CLAIM.length);
    await ensurePrepared(this, claim);
    try {
      await this.inner.executeQuery(CompiledQuery.raw(`begin;\n${claim}`));
    } catch (err) {
      if ((err as { code?: string }).code === NOTHING_THERE) Object.assign(err as object, { [UNCLAIMED]: true });
      throw err;
    }
    return { rows: [] };
  }
  streamQuery<R>(query: CompiledQuery, chunkSize?: number): AsyncIterableIterator<QueryResult<R>> {
    return this.inner.streamQuery<R>(query, chunkSize);
  }
}

class MarkerAtCommitDriver implements Driver {
  readonly #inner: Driver;
  // Kysely's Postgres driver keeps one connection object per pg client; so do we, per that object.
  readonly #wrappers = new WeakMap<DatabaseConnection, DeferringConnection>();
  constructor(inner: Driver) {
    this.#inner = inner;
  }
  init(): Promise<void> {
    return this.#inner.init();
  }
  async acquireConnection(): Promise<DatabaseConnection> {
    const inner = await this.#inner.acquireConnection();
    let wrapper = this.#wrappers.get(inner);
    if (!wrapper) this.#wrappers.set(inner, (wrapper = new DeferringConnection(inner)));
    return wrapper;
  }
  async beginTransaction(connection: DatabaseConnection, settings: TransactionSettings): Promise<void> {
    const c = connection as DeferringConnection;
    // Only a plain BEGIN is held back; one with an isolation level or access mode goes at once.
    if (settings.isolationLevel === undefined && settings.accessMode === undefined && c instanceof DeferringConnection) {
      c.pendingBegin = true;
      return;
    }
    await this.#inner.beginTransaction(unwrap(connection), settings);
  }
  async commitTransaction(connection: DatabaseConnection): Promise<void> {
    const c = connection as DeferringConnection;
    const marker = c.pendingMarker;
    c.pendingMarker = undefined;
    if (c.pendingBegin) {
      // Nothing ran in this transaction, so there is nothing to commit (nor a BEGIN to send).
      c.pendingBegin = false;
      if (marker === undefined) return;
      await c.inner.executeQuery(CompiledQuery.raw('begin'));
    }
    if (marker === undefined) return this.#inner.commitTransaction(c.inner);
    await ensurePrepared(c, marker);
    try {
      await c.inner.executeQuery(CompiledQuery.raw(`${marker};\ncommit`));
    } catch (err) {
      if ((err as { code?: string }).code === NOTHING_THERE) Object.assign(err as object, { [REFUSED]: true });
      throw err;
    }
  }
  async rollbackTransaction(connection: DatabaseConnection): Promise<void> {
    const c = connection as DeferringConnection;
    c.pendingMarker = undefined;
    if (c.pendingBegin) {
      c.pendingBegin = false;
      return;
    }
    return this.#inner.rollbackTransaction(unwrap(connection));
  }
  async savepoint(connection: DatabaseConnection, name: string, compile: QueryCompiler['compileQuery']): Promise<void> {
    await this.#inner.savepoint!(unwrap(connection), name, compile);
  }
  async rollbackToSavepoint(connection: DatabaseConnection, name: string, compile: QueryCompiler['compileQuery']): Promise<void> {
    await this.#inner.rollbackToSavepoint!(unwrap(connection), name, compile);
  }
  async releaseSavepoint(connection: DatabaseConnection, name: string, compile: QueryCompiler['compileQuery']): Promise<void> {
    await this.#inner.releaseSavepoint!(unwrap(connection), name, compile);
  }
  releaseConnection(connection: DatabaseConnection): Promise<void> {
    return this.#inner.releaseConnection(unwrap(connection));
  }
  destroy(): Promise<void> {
    return this.#inner.destroy();
  }
}

function unwrap(connection: DatabaseConnection): DatabaseConnection {
  return connection instanceof DeferringConnection ? connection.inner : connection;
}

/** PostgresDialect whose driver sends a chunk's marker together with its COMMIT. */
export class IdemPostgresDialect extends PostgresDialect {
  override createDriver(): Driver {
    return new MarkerAtCommitDriver(super.createDriver());
  }
}
