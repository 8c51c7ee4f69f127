import { sql, type RawBuilder } from 'kysely';
import type { ChunkSource, ChunkSpec, Json } from './job.ts';
import { UsageError } from './errors.ts';
import { refuseNonOptions, unknownKeys } from './suggest.ts';
import { identInSql, columnNameProblem, parseTableName, regclassText, tableInSql, tableNameProblem, tableRef } from './table-name.ts';

export interface KeyRangeOptions {
  /**
   * Table to cut, named as it is in the database (case and all, without quotes), optionally
   * schema-qualified: `'reservations'`, `'public.reservations'`, `'MixedCase'` for a table created
   * as `"MixedCase"`.
   */
  readonly table: string;
  /** An indexed integer or bigint column, usually the primary key, named as it is in the database (`'Id'` for `"Id"`). */
  readonly column: string;
  /** Rows per chunk: a range holds `size` keys (meeting `where`) when it is planned, the last one fewer; gaps in the keys widen a range, they do not thin it. */
  readonly size: number;
  /**
   * Extra SQL condition rows must meet to be counted (e.g. `"reserved_by_normalized is null"`).
   * Trusted code, never user input. Defaults to none.
   */
  readonly where?: string | RawBuilder<unknown>;
}

/**
 * A key range `[lo, hi)`, that is `[lo, last]`: the chunk's work should touch only rows with
 * `key between lo and last`. Prefer `last` to `hi`: the last range's `hi` is its last key + 1, which
 * an `integer` (or `smallint`) column cannot hold when that key is the type's maximum, so
 * `id < ${hi}` fails there ("value 2147483648 is out of range for type integer"); for every other key
 * `lo <= key < hi` selects the same rows.
 * @example
 * run: ({ db }, { lo, last }: KeyRangeChunk) => sql`update orders set … where id between ${lo} and ${last}`.execute(db)
 */
export interface KeyRangeChunk extends ChunkSpec {
  readonly key: string;
  /** The first key of the range (inclusive). */
  readonly lo: number;
  /** The end of the range, exclusive: `last + 1`. */
  readonly hi: number;
  /** The end of the range, inclusive: `hi - 1`. Chunks planned by idem before it had `last` get it on resume. */
  readonly last: number;
}

/** Every option keyRange takes; any other is refused (a typo such as `wehre` would cut every row). */
const KEY_RANGE_KEYS: ReadonlyArray<keyof KeyRangeOptions> = ['table', 'column', 'size', 'where'];

/**
 * Keyset chunks over an indexed integer column. Boundaries are computed lazily, one window at a
 * time, by the server (`row_number()` over an index range scan limited to the window): the key list
 * never comes to the client, so planning costs one query per window and memory stays flat.
 * @example
 * keyRange({ table: 'reservations', column: 'id', size: 1000, where: 'reserved_by_normalized is null' })
 */
export function keyRange(opts: KeyRangeOptions): ChunkSource<unknown, any, KeyRangeChunk> {
  refuseNonOptions('keyRange()', opts, "{ table: 'orders', column: 'id', size: 1000 }");
  const problems = [...(opts && typeof opts === 'object' ? unknownKeys(opts, KEY_RANGE_KEYS, '') : [])];
  problems.push(...[tableNameProblem(opts?.table, 'table'), columnNameProblem(opts?.column, 'column')].filter((p) => p !== null));
  if (!Number.isInteger(opts?.size) || opts.size < 1) problems.push(`size must be an integer >= 1 (got ${opts?.size})`);
  // A mistake in the job's definition, as defineJob's are (idem.invalidJob, exit 2).
  if (problems.length) throw new UsageError('invalidJob', `keyRange(): ${problems.join('; ')}`);
  // One spelling for the queries and for every catalog lookup (src/table-name.ts).
  const table = tableRef(opts.table);
  const regclass = regclassText(opts.table);
  const column = sql.id(opts.column);
  // In parentheses either way: `lower and a or b` would be `(lower and a) or b`, and cut ranges from
  // rows outside the window (boundaries out of order, rows skipped or covered twice).
  // The closing parenthesis on a line of its own: a `-- comment` ending `where` must not comment out the statement around it.
  const extra = opts.where === undefined ? sql`true` : typeof opts.where === 'string' ? sql.raw(`(${opts.where}\n)`) : sql`(${opts.where}\n)`;

  // Once per database handle: a source object is usually module-level and outlives runs.
  const checked = new WeakMap<object, Promise<void>>();
  const source: ChunkSource<unknown, any, KeyRangeChunk> = async (cursor, ctx) => {
    let check = checked.get(ctx.db);
    if (!check) {
      check = checkKeyColumn(ctx.db, opts.table, regclass, opts.column, sql`select count(*)::int as n from ${table} where ${column} is null and ${extra}`);
      checked.set(ctx.db, check);
      check.catch(() => checked.delete(ctx.db));
    }
    await check;
    const from = cursor === null ? null : toSafeInt(cursor, 'cursor');
    const windowChunks = Math.max(1, ctx.windowSize);
    // Adaptive sizing (--target-chunk-ms) scales the nominal size; 1 otherwise.
    const size = Math.max(1, Math.round(opts.size * (ctx.sizeFactor ?? 1)));
    const lower = from === null ? sql`true` : sql`${column} >= ${from}`;
    let boundaries: number[];
    let full: boolean;
    let last: number | null;
    if (size >= 8) {
      // Skip through the index `size` keys at a time (one OFFSET probe per boundary): nothing is
      // materialised, so a window of 100 000 rows costs a few ms instead of a sort spilled to disk.
      const { rows } = await sql<{ k: string | number; last: string | number | null }>`
        with recursive b(k, i) as (
          select (select ${column} from ${table} where ${lower} and ${extra} order by ${column} limit 1), 0
          union all
          select (select ${column} from ${table} where ${column} >= b.k and ${extra} order by ${column} offset ${size} limit 1), i + 1
          from b where b.k is not null and i < ${windowChunks}
        )
        select k, (select ${column} from ${table} where ${column} >= (select max(k) from b) and ${extra} order by ${column} desc limit 1) as last
        from b where k is not null order by i`.execute(ctx.db);
      boundaries = rows.map((r) => toSafeInt(r.k, opts.column));
      full = boundaries.length === windowChunks + 1;
      last = rows.length > 0 && rows[0]!.last !== null ? toSafeInt(rows[0]!.last, opts.column) : null;
    } else {
      // Tiny chunks: one numbered scan of the window beats a probe per boundary.
      const limit = windowChunks * size + 1;
      const { rows } = await sql<{ k: string | number; rn: string; total: string }>`
        with s as (select ${column} as k from ${table} where ${lower} and ${extra} order by ${column} limit ${limit}),
             n as (select k, row_number() over (order by k) as rn, count(*) over () as total from s)
        select k, rn, total from n where (rn - 1) % ${size} = 0 or rn = total order by k`.execute(ctx.db);
      boundaries = rows.filter((r) => (Number(r.rn) - 1) % size === 0).map((r) => toSafeInt(r.k, opts.column));
      full = rows.length > 0 && Number(rows[0]!.total) === limit;
      last = rows.length > 0 ? toSafeInt(rows[rows.length - 1]!.k, opts.column) : null;
    }
    if (boundaries.length === 0) return { chunks: [], next: null };
    let next: Json | null = null;
    if (full) {
      // Window full: its last boundary is where the next window starts.
      next = boundaries[boundaries.length - 1]!;
    } else {
      boundaries.push(last! + 1);
    }
    const chunks: KeyRangeChunk[] = [];
    for (let i = 0; i + 1 < boundaries.length; i++) {
      const lo = boundaries[i]!;
      const hi = boundaries[i + 1]!;
      chunks.push({ key: `[${lo},${hi})`, lo, hi, last: hi - 1 });
    }
    return { chunks, next };
  };
  // From the planner's statistics (reltuples), not a count(*): free, and good enough for an ETA.
  source.estimate = async (ctx) => {
    const { rows } = await sql<{ n: number }>`select greatest(reltuples, 0)::float8 as n from pg_class where oid = to_regclass(${regclass})`.execute(ctx.db);
    const n = rows[0]?.n;
    return n === undefined || n <= 0 ? null : Math.ceil(n / opts.size);
  };
  // The same spelling as `table`: the health check resolves it by the same rule.
  source.tables = [opts.table];
  return source;
}

/**
 * keyRange cuts `[lo, hi)` ranges by the column's integer order, so the column must be an integer
 * type (a text column of digits sorts '10' < '9', and a job filtering `id >= lo and id < hi` would
 * silently skip rows) with a unique index (a key repeated more than `size` times cannot be cut
 * into ranges: the source would emit `[5,5)` forever), holding no NULL among the rows `where`
 * selects (no range holds a NULL: those rows would be skipped, silently). A column declared NOT
 * NULL costs no statement more than the catalog query.
 */
async function checkKeyColumn(db: PlanDb, table: string, regclass: string, name: string, countNulls: RawBuilder<{ n: number }>): Promise<void> {
  const { schema, name: relname } = parseTableName(table);
  // The `other_*` columns: the names a wrong-case spelling meant (`'mixedcase'` for "MixedCase").
  const { rows } = await sql<{ found: boolean; type: string | null; not_null: boolean | null; unique_indexed: boolean; other_tables: string[] | null; other_columns: string[] | null }>`
    select to_regclass(${regclass}) is not null as found,
      (select format_type(a.atttypid, null) from pg_attribute a
        where a.attrelid = to_regclass(${regclass}) and a.attname = ${name} and a.attnum > 0 and not a.attisdropped) as type,
      (select a.attnotnull from pg_attribute a
        where a.attrelid = to_regclass(${regclass}) and a.attname = ${name} and a.attnum > 0 and not a.attisdropped) as not_null,
      exists (select 1 from pg_index i join pg_attribute a on a.attrelid = i.indrelid and a.attnum = i.indkey[0]
        where i.indrelid = to_regclass(${regclass}) and a.attname = ${name} and i.indisunique and i.indisvalid
          and i.indnatts = 1 and i.indpred is null) as unique_indexed,
      (select array_agg(case when ${schema}::text is null then c.relname::text else n.nspname || '.' || c.relname end order by n.nspname, c.relname)
        from pg_class c join pg_namespace n on n.oid = c.relnamespace
        where lower(c.relname) = lower(${relname}) and c.relkind in ('r', 'p', 'm', 'v', 'f')
          and (case when ${schema}::text is null then pg_table_is_visible(c.oid) else lower(n.nspname) = lower(${schema}) end)) as other_tables,
      (select array_agg(a.attname::text order by a.attname) from pg_attribute a
        where a.attrelid = to_regclass(${regclass}) and lower(a.attname) = lower(${name}) and a.attname <> ${name} and a.attnum > 0 and not a.attisdropped) as other_columns`.execute(db);
  const r = rows[0]!;
  const meant = (names: string[] | null) => (names?.length ? `; did you mean ${names.map((n) => `'${n}'`).join(' or ')}? (names are case-sensitive, as in the database)` : '');
  if (!r.found) throw new TypeError(`keyRange(): table ${JSON.stringify(table)} does not exist${meant(r.other_tables)}; create it before the step runs, or fix the table name`);
  if (r.type === null) throw new TypeError(`keyRange(): table ${JSON.stringify(table)} has no column ${JSON.stringify(name)}${meant(r.other_columns)}; fix the column name`);
  if (!['smallint', 'integer', 'bigint'].includes(r.type)) {
    throw new TypeError(
      `keyRange(): column ${JSON.stringify(name)} of ${JSON.stringify(table)} is ${r.type}, but keyRange cuts only smallint, integer and bigint keys (its ranges are integer intervals); for a key of another type use keysetQuery({ query: 'select ${identInSql(name)} from ${tableInSql(table)}', key: '${name}', size }) (with your where in the query), which cuts any key type exactly`,
    );
  }
  if (!r.unique_indexed) {
    throw new TypeError(
      `keyRange(): column ${JSON.stringify(name)} of ${JSON.stringify(table)} has no unique index, and a key repeated more than size times cannot be cut into ranges; add a unique index (usually the primary key) or use a custom chunk source`,
    );
  }
  if (r.not_null) return;
  // A unique index holds any number of NULLs, and finds them (`is null` is an index condition).
  const { rows: nulls } = await countNulls.execute(db);
  const n = nulls[0]?.n ?? 0;
  if (n > 0) {
    throw new TypeError(
      `keyRange(): column ${JSON.stringify(name)} of ${JSON.stringify(table)} has ${n} ${n === 1 ? 'row' : 'rows'} where it is NULL, which no range holds, so ${n === 1 ? 'it' : 'they'} would be skipped; declare the column NOT NULL, or pass a where that excludes them (where: '${identInSql(name)} is not null') and handle those rows in another step`,
    );
  }
}

type PlanDb = Parameters<RawBuilder<unknown>['execute']>[0];

function toSafeInt(v: unknown, what: string): number {
  const n = typeof v === 'number' ? v : Number(v);
  if (!Number.isSafeInteger(n)) {
    throw new TypeError(`keyRange(): ${what} value ${String(v)} is not a safe integer, within ±(2^53−1); use keysetQuery for such keys (its boundaries are exact text, for any key)`);
  }
  return n;
}
