import { AsyncLocalStorage } from 'node:async_hooks';
import { CompiledQuery, PostgresDialect, type DatabaseConnection, type Driver, type QueryCompiler, type TransactionSettings } from 'kysely';

/**
 * What a chunk transaction hands to the commit: the completion marker to send in the same round
 * trip as COMMIT. Set inside `chunkCommit.run(...)`; read by the driver when Kysely commits.
 */
export interface PendingCommit {
  /** The marker: a prepared statement (created once per connection) and its EXECUTE, built at commit time. */
  marker?: { readonly name: string; readonly prepare: string; readonly execute: () => string };
  /** Set when the marker statement itself failed, so the caller can tell why. */
  markerFailed?: boolean;
}

export const chunkCommit = new AsyncLocalStorage<PendingCommit>();

/**
 * Wraps Kysely's Postgres driver so a chunk's marker and its COMMIT travel as one simple-protocol
 * message (`<marker>; commit`). Postgres runs them in order; if the marker raises, the transaction
 * is aborted and the COMMIT in the same message is skipped, so the work can never commit without
 * its marker. This saves one network round trip per chunk, the biggest cost idem adds to a chunk.
 */
class MarkerAtCommitDriver implements Driver {
  readonly #inner: Driver;
  readonly #prepared = new WeakMap<DatabaseConnection, Set<string>>();
  constructor(inner: Driver) {
    this.#inner = inner;
  }
  init(): Promise<void> {
    return this.#inner.init();
  }
  acquireConnection(): Promise<DatabaseConnection> {
    return this.#inner.acquireConnection();
  }
  beginTransaction(connection: DatabaseConnection, settings: TransactionSettings): Promise<void> {
    return this.#inner.beginTransaction(connection, settings);
  }
  async commitTransaction(connection: DatabaseConnection): Promise<void> {
    const pending = chunkCommit.getStore();
    const marker = pending?.marker;
    if (!pending || !marker) return this.#inner.commitTransaction(connection);
    pending.marker = undefined;
    // Prepared once per session (PREPARE is not transactional, so a rolled-back chunk keeps it):
    // later chunks skip parsing and planning the marker.
    let prepared = this.#prepared.get(connection);
    if (!prepared) this.#prepared.set(connection, (prepared = new Set()));
    if (!prepared.has(marker.name)) {
      await connection.executeQuery(CompiledQuery.raw(marker.prepare));
      prepared.add(marker.name);
    }
    try {
      await connection.executeQuery(CompiledQuery.raw(`${marker.execute()};\ncommit`));
    } catch (err) {
      pending.markerFailed = (err as { code?: string }).code === '22012';
      throw err;
    }
  }
  rollbackTransaction(connection: DatabaseConnection): Promise<void> {
    return this.#inner.rollbackTransaction(connection);
  }
  async savepoint(connection: DatabaseConnection, name: string, compile: QueryCompiler['compileQuery']): Promise<void> {
    await this.#inner.savepoint!(connection, name, compile);
  }
  async rollbackToSavepoint(connection: DatabaseConnection, name: string, compile: QueryCompiler['compileQuery']): Promise<void> {
    await this.#inner.rollbackToSavepoint!(connection, name, compile);
  }
  async releaseSavepoint(connection: DatabaseConnection, name: string, compile: QueryCompiler['compileQuery']): Promise<void> {
    await this.#inner.releaseSavepoint!(connection, name, compile);
  }
  releaseConnection(connection: DatabaseConnection): Promise<void> {
    return this.#inner.releaseConnection(connection);
  }
  destroy(): Promise<void> {
    return this.#inner.destroy();
  }
}

/** PostgresDialect whose driver sends a pending chunk marker together with COMMIT. */
export class IdemPostgresDialect extends PostgresDialect {
  override createDriver(): Driver {
    return new MarkerAtCommitDriver(super.createDriver());
  }
}
