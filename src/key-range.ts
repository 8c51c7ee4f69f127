import { sql, type RawBuilder } from 'kysely';
import type { ChunkSource, ChunkSpec, Json } from './job.ts';

export interface KeyRangeOptions {
  /** Table to cut, optionally schema-qualified (`"public.reservations"`). */
  readonly table: string;
  /** An indexed integer or bigint column, usually the primary key. */
  readonly column: string;
  /** Rows per chunk (at most; gaps in the keys make chunks cover fewer rows). */
  readonly size: number;
  /**
   * Extra SQL condition rows must meet to be counted (e.g. `"reserved_by_normalized is null"`).
   * Trusted code, never user input. Defaults to none.
   */
  readonly where?: string | RawBuilder<unknown>;
}

/** A half-open key range `[lo, hi)`: the chunk's work should touch only rows with lo <= key < hi. */
export interface KeyRangeChunk extends ChunkSpec {
  readonly key: string;
  readonly lo: number;
  readonly hi: number;
}

/**
 * Keyset chunks over an indexed integer column. Boundaries are computed lazily, one window at a
 * time, by the server (`row_number()` over an index range scan limited to the window): the key list
 * never comes to the client, so planning costs one query per window and memory stays flat.
 * @example
 * keyRange({ table: 'reservations', column: 'id', size: 1000, where: 'reserved_by_normalized is null' })
 */
export function keyRange(opts: KeyRangeOptions): ChunkSource<unknown, unknown, KeyRangeChunk> {
  const problems: string[] = [];
  if (typeof opts?.table !== 'string' || opts.table === '') problems.push('table must be a non-empty string');
  if (typeof opts?.column !== 'string' || opts.column === '') problems.push('column must be a non-empty string');
  if (!Number.isInteger(opts?.size) || opts.size < 1) problems.push(`size must be an integer >= 1 (got ${opts?.size})`);
  if (problems.length) throw new TypeError(`keyRange(): ${problems.join('; ')}`);
  const table = sql.table(opts.table);
  const column = sql.ref(opts.column);
  const extra = opts.where === undefined ? sql`true` : typeof opts.where === 'string' ? sql.raw(`(${opts.where})`) : opts.where;

  const source: ChunkSource<unknown, unknown, KeyRangeChunk> = async (cursor, ctx) => {
    const from = cursor === null ? null : toSafeInt(cursor, 'cursor');
    const windowChunks = Math.max(1, ctx.windowSize);
    // Adaptive sizing (--target-chunk-ms) scales the nominal size; 1 otherwise.
    const size = Math.max(1, Math.round(opts.size * (ctx.sizeFactor ?? 1)));
    const limit = windowChunks * size + 1;
    const lower = from === null ? sql`true` : sql`${column} >= ${from}`;
    const { rows } = await sql<{ k: string | number; rn: string; total: string }>`
      with s as (select ${column} as k from ${table} where ${lower} and ${extra} order by ${column} limit ${limit}),
           n as (select k, row_number() over (order by k) as rn, count(*) over () as total from s)
      select k, rn, total from n where (rn - 1) % ${size} = 0 or rn = total order by k`.execute(ctx.db);
    if (rows.length === 0) return { chunks: [], next: null };
    const total = Number(rows[0]!.total);
    const boundaries = rows.filter((r) => (Number(r.rn) - 1) % size === 0).map((r) => toSafeInt(r.k, opts.column));
    let next: Json | null = null;
    if (total === limit) {
      // Window full: its last boundary is where the next window starts.
      next = boundaries[boundaries.length - 1]!;
    } else {
      boundaries.push(toSafeInt(rows[rows.length - 1]!.k, opts.column) + 1);
    }
    const chunks: KeyRangeChunk[] = [];
    for (let i = 0; i + 1 < boundaries.length; i++) {
      const lo = boundaries[i]!;
      const hi = boundaries[i + 1]!;
      chunks.push({ key: `[${lo},${hi})`, lo, hi });
    }
    return { chunks, next };
  };
  // From the planner's statistics (reltuples), not a count(*): free, and good enough for an ETA.
  source.estimate = async (ctx) => {
    const { rows } = await sql<{ n: number }>`select greatest(reltuples, 0)::float8 as n from pg_class where oid = to_regclass(${opts.table})`.execute(ctx.db);
    const n = rows[0]?.n;
    return n === undefined || n <= 0 ? null : Math.ceil(n / opts.size);
  };
  return source;
}

function toSafeInt(v: unknown, what: string): number {
  const n = typeof v === 'number' ? v : Number(v);
  if (!Number.isSafeInteger(n)) {
    throw new TypeError(`keyRange(): ${what} value ${String(v)} is not an integer within ±2^53; use a custom chunk source for such keys`);
  }
  return n;
}
