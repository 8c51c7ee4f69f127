import { Kysely, PostgresDialect } from 'kysely';
import type pg from 'pg';

/**
 * One worker slot of a step: a connection of the work pool kept for the slot's whole life, so a
 * chunk costs no pool checkout, and a Kysely instance over just that connection for the chunks'
 * transactions.
 *
 * A chunk's transaction costs no round trip more than a hand-written `BEGIN; …; COMMIT` loop: the
 * BEGIN is held back and sent in one message with the transaction's first statement when that
 * statement has no parameters (the chunk's claim, an `EXECUTE` of a prepared statement with literal
 * values, is such a statement). A first statement with parameters gets its BEGIN just before it.
 */
export interface ChunkSlot {
  /** Kysely over the slot's connection; `db.transaction()` is a chunk's transaction. */
  readonly db: Kysely<any>;
  /**
   * Sends a parameterless statement inside the transaction `db.transaction()` opened on the slot
   * (with its BEGIN, when it is the first): the claim, without Kysely's query plumbing per chunk.
   */
  first<R>(text: string): Promise<R[]>;
  /** Hands the connection back to the pool. */
  release(): void;
}

type Result = { command: string; rowCount: number | null; rows: unknown[] };

/** The PREPAREs each pool client's server session has had: a pool hands the same clients out again. */
const preparedOn = new WeakMap<pg.PoolClient, Set<string>>();

/** Opens a slot; `prepare` are statements each server session of the slot needs once (PREPARE …). */
export function openChunkSlot(pool: pg.Pool, prepare: readonly string[]): ChunkSlot {
  let client: pg.PoolClient | undefined;
  let connecting: Promise<pg.PoolClient> | undefined;
  let beginPending = false;

  const connect = async (): Promise<pg.PoolClient> => {
    const c = await pool.connect();
    try {
      const done = preparedOn.get(c) ?? new Set<string>();
      preparedOn.set(c, done);
      for (const text of prepare) {
        if (done.has(text)) continue;
        // 42P05 duplicate_prepared_statement: a session pooler with server_reset_query turned off
        // handed on a session that has it already; it is idem's own, for the same schema.
        await c.query(text).catch((err: { code?: string }) => {
          if (err.code !== '42P05') throw err;
        });
        done.add(text);
      }
    } catch (err) {
      c.release(true);
      throw err;
    }
    return c;
  };

  const query = async (text: string, values?: unknown[]): Promise<Result> => {
    const c = client!;
    if (text === 'begin' && !values?.length) {
      beginPending = true;
      return { command: 'BEGIN', rowCount: null, rows: [] };
    }
    if (!beginPending) return (await c.query(text, values)) as unknown as Result;
    beginPending = false;
    if (text === 'commit' || text === 'rollback') {
      // Nothing ran in this transaction, so there is nothing to end (nor a BEGIN to send).
      return { command: text.toUpperCase(), rowCount: null, rows: [] };
    }
    if (values?.length) {
      await c.query('begin');
      return (await c.query(text, values)) as unknown as Result;
    }
    // Simple protocol, two statements in one message: pg answers with one result per statement.
    const results = (await c.query(`begin;\n${text}`)) as unknown as Result[];
    return results[results.length - 1]!;
  };

  // What Kysely's driver gets from the "pool": one object per server connection (the driver keeps
  // its connection wrapper per object, and a discarded wrapper stays discarded).
  const newConnection = () => ({
    query,
    release(discard?: boolean) {
      // Kysely discards a connection whose ROLLBACK failed (the socket is gone): the next chunk
      // checks out a fresh one instead of failing on the dead one.
      if (discard && client) {
        client.release(true);
        client = undefined;
        beginPending = false;
        connection = newConnection();
      }
    },
  });
  let connection = newConnection();
  const slotPool = {
    async connect() {
      client ??= await (connecting ??= connect().finally(() => (connecting = undefined)));
      return connection;
    },
    async end() {},
  };
  const db = new Kysely<any>({ dialect: new PostgresDialect({ pool: slotPool as unknown as pg.Pool }) });
  return {
    db,
    async first<R>(text: string) {
      return (await query(text)).rows as R[];
    },
    release() {
      client?.release();
      client = undefined;
    },
  };
}
