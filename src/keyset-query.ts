import { sql, type RawBuilder } from 'kysely';
import { createHash } from 'node:crypto';
import type { ChunkSource, ChunkSpec, Json, PlanContext } from './job.ts';
import { soleStatement } from './sql-statements.ts';
import { UsageError } from './errors.ts';
import { refuseNonOptions, unknownKeys } from './suggest.ts';
import { identInSql, columnNameProblem, tableNameProblem } from './table-name.ts';

export interface KeysetQueryOptions {
  /**
   * The rows to cut, as a query returning at least the key columns (trusted code, never user
   * input): `'select tenant_id, id from orders where status = \'open\''` or a sql`` builder.
   */
  readonly query: string | RawBuilder<unknown>;
  /**
   * The key column or columns: unique together, never NULL in the query's rows (checked when the
   * step's first window is planned), ideally an index's leading columns; named
   * as they are in the database, unquoted (`'Id'` for a column created as `"Id"`).
   */
  readonly key: string | readonly string[];
  /** Rows per chunk. */
  readonly size: number;
  /**
   * Tables the step touches, for the autovacuum health indicator, named as they are in the
   * database (unquoted, optionally `schema.table`). Defaults to none (declare them on the step
   * with `tables` instead, or here).
   */
  readonly tables?: readonly string[];
}

/**
 * A slice `(after, through]` of the query's rows in key order: `after` is the previous chunk's last
 * key (`null` for the first chunk), `through` this chunk's last key, both as text (exact for any
 * type; Postgres casts them back when compared with the columns). Consecutive chunks leave no gap,
 * so a row inserted between two chunks' keys while the run goes is still covered.
 */
export interface KeysetChunk extends ChunkSpec {
  readonly key: string;
  readonly after: string[] | null;
  readonly through: string[];
}

export type KeysetSource = ChunkSource<unknown, any, KeysetChunk> & {
  /** The chunk's condition on the key columns, for the step's statements: `where ${source.where(chunk)}`. */
  where(chunk: KeysetChunk, alias?: string): RawBuilder<unknown>;
};

/** Every option keysetQuery takes; any other is refused (a typo such as `table` would do nothing). */
const KEYSET_QUERY_KEYS: ReadonlyArray<keyof KeysetQueryOptions> = ['query', 'key', 'size', 'tables'];

/**
 * Keyset chunks over the rows of a query, for composite (or non-integer) keys: each boundary is one
 * index probe (`where (k1, k2) > (…) order by k1, k2 offset size - 1 limit 1`) done by the server
 * in one recursive statement per window, so gaps cost nothing and the rows never come to the client.
 * @example
 * const orders = keysetQuery({ query: 'select tenant_id, id from orders', key: ['tenant_id', 'id'], size: 1000 });
 * steps: [{ name: 'backfill', chunks: orders,
 *   run: ({ db }, c) => sql`update orders set total = … where ${orders.where(c)}`.execute(db) }]
 */
export function keysetQuery(opts: KeysetQueryOptions): KeysetSource {
  const columns = typeof opts?.key === 'string' ? [opts.key] : Array.isArray(opts?.key) ? [...opts.key] : [];
  refuseNonOptions('keysetQuery()', opts, "{ query: 'select id from orders', key: 'id', size: 1000 }");
  const problems = opts && typeof opts === 'object' ? unknownKeys(opts, KEYSET_QUERY_KEYS, '') : [];
  const text = typeof opts?.query === 'string' ? soleStatement(opts.query) : undefined;
  if (!(typeof opts?.query === 'string' ? opts.query.trim() !== '' : opts?.query && typeof (opts.query as RawBuilder<unknown>).compile === 'function')) {
    problems.push('query must be a non-empty SQL string or a sql`` builder');
  } else if (text === null) problems.push('query must be one SELECT statement (it is used as a subquery)');
  if (columns.length === 0 || columns.some((c) => typeof c !== 'string' || c === '')) problems.push('key must be a column name or a non-empty array of them');
  else for (const c of columns) problems.push(...[columnNameProblem(c, 'key') ?? []].flat());
  if (new Set(columns).size !== columns.length) problems.push('key names a column twice');
  if (!Number.isInteger(opts?.size) || opts.size < 1) problems.push(`size must be an integer >= 1 (got ${opts?.size})`);
  if (opts?.tables !== undefined) {
    if (!Array.isArray(opts.tables)) problems.push('tables must be an array of table names');
    else for (const [i, t] of opts.tables.entries()) problems.push(...[tableNameProblem(t, `tables[${i}]`) ?? []].flat());
  }
  // A mistake in the job's definition, as defineJob's are (idem.invalidJob, exit 2).
  if (problems.length) throw new UsageError('invalidJob', `keysetQuery(): ${problems.join('; ')}`);

  // On a line of its own: a `-- comment` at its end must not comment out the statement around it.
  const query = typeof opts.query === 'string' ? sql.raw(`${text}\n`) : sql`${opts.query}\n`;
  const cols = (alias: string) => sql.join(columns.map((c) => sql.ref(`${alias}.${c}`)));
  const asText = (alias: string) => sql.join(columns.map((c) => sql`${sql.ref(`${alias}.${c}`)}::text`));
  const generic = sql.join(columns.map((_, i) => sql.ref(`k${i}`)));
  const bOf = sql.join(columns.map((_, i) => sql.ref(`b.k${i}`)));
  const values = (v: readonly string[]) => sql.join(v.map((x) => sql`${x}`));
  const order = (alias: string, dir: 'asc' | 'desc') => sql.join(columns.map((c) => sql`${sql.ref(`${alias}.${c}`)} ${sql.raw(dir)}`));
  /**
   * Rows whose key is NULL are in no chunk (`(k) > (…)` and `(k) <= (…)` are never true for them):
   * they would be skipped while the run succeeds. Checked once, when the step's first window is
   * planned. One probe: `is null` on a NOT NULL table column is folded away by PostgreSQL 17+, and
   * an index on the key finds NULLs; otherwise it scans the query once.
   */
  const refuseNullKeys = async (db: PlanContext['db']): Promise<void> => {
    const isNull = (c: string) => sql`${sql.ref(`q.${c}`)} is null`;
    const { rows } = await sql<Record<string, boolean>>`
      select ${sql.join(columns.map((c, i) => sql`${isNull(c)} as ${sql.ref(`n${i}`)}`))}
      from (${query}) q where ${sql.join(columns.map(isNull), sql` or `)} limit 1`.execute(db);
    if (rows.length === 0) return;
    const column = columns.find((_, i) => rows[0]![`n${i}`]) ?? columns[0]!;
    throw new TypeError(
      `keysetQuery(): the query returns rows whose key column ${JSON.stringify(column)} is NULL, which no chunk holds, so they would be skipped; make the key columns NOT NULL, or exclude those rows in the query (where ${columns.map((c) => `${identInSql(c)} is not null`).join(' and ')}) and handle them in another step`,
    );
  };

  const plan: ChunkSource<unknown, any, KeysetChunk> = async (cursor, ctx) => {
    const after = cursor === null ? null : (cursor as string[]);
    if (after !== null && (!Array.isArray(after) || after.length !== columns.length)) {
      throw new TypeError(`keysetQuery(): the stored cursor ${JSON.stringify(cursor)} does not match key (${columns.join(', ')}); the key of an unfinished run must not change`);
    }
    if (after === null) await refuseNullKeys(ctx.db);
    const windowChunks = Math.max(1, ctx.windowSize);
    const size = Math.max(1, Math.round(opts.size * (ctx.sizeFactor ?? 1)));
    const lower = after === null ? sql`true` : sql`(${cols('q')}) > (${values(after)})`;
    // One probe per boundary: the row `size` rows past the previous boundary, found by the index.
    const { rows } = await sql<{ k: string[]; i: number }>`
      with recursive b(${generic}, i) as (
        (select ${cols('q')}, 1 from (${query}) q where ${lower} order by ${order('q', 'asc')} offset ${size - 1} limit 1)
        union all
        select ${cols('n')}, b.i + 1 from b cross join lateral (
          select ${cols('q')} from (${query}) q where (${cols('q')}) > (${bOf}) order by ${order('q', 'asc')} offset ${size - 1} limit 1
        ) n where b.i < ${windowChunks}
      )
      select array[${sql.join(columns.map((_, i) => sql`${sql.ref(`b.k${i}`)}::text`))}] as k, i from b order by i`.execute(ctx.db);
    const boundaries = rows.map((r) => r.k);
    const chunks: KeysetChunk[] = [];
    let prev = after;
    for (const through of boundaries) {
      chunks.push({ key: chunkKeyOf(through), after: prev, through });
      prev = through;
    }
    if (boundaries.length === windowChunks) return { chunks, next: prev as Json };
    // The window ran out of full chunks: the rest (fewer than `size` rows) is the last chunk.
    const from = prev === null ? sql`true` : sql`(${cols('q')}) > (${values(prev)})`;
    const { rows: last } = await sql<{ k: string[] }>`
      select array[${asText('q')}] as k from (${query}) q where ${from} order by ${order('q', 'desc')} limit 1`.execute(ctx.db);
    if (last[0]) chunks.push({ key: chunkKeyOf(last[0].k), after: prev, through: last[0].k });
    return { chunks, next: null };
  };

  // From the planner's row estimate for the query: free, and good enough for an ETA.
  plan.estimate = async (ctx) => {
    const { rows } = await sql<{ 'QUERY PLAN': Array<{ Plan: { 'Plan Rows': number } }> }>`explain (format json) select 1 from (${query}) q`.execute(ctx.db);
    const n = rows[0]?.['QUERY PLAN']?.[0]?.Plan?.['Plan Rows'];
    return typeof n === 'number' && n > 0 ? Math.ceil(n / opts.size) : null;
  };
  if (opts.tables) plan.tables = [...opts.tables];
  const where = (chunk: KeysetChunk, alias?: string): RawBuilder<unknown> => {
    const ref = (c: string) => sql.ref(alias ? `${alias}.${c}` : c);
    const row = sql.join(columns.map(ref));
    const upper = sql`(${row}) <= (${values(chunk.through)})`;
    // In parentheses: a job's `where ${src.where(c)} or …` stays one condition on the chunk.
    return chunk.after === null ? upper : sql`((${row}) > (${values(chunk.after)}) and ${upper})`;
  };
  return Object.assign(plan, { where });
}

/** Longest chunk key kept as the boundary's JSON itself: the chunk index's limit (executor.ts), so every key that fit before keeps its form. */
const MAX_PLAIN_KEY_BYTES = 2000;

/**
 * A chunk's key: its last key as JSON (`["acme","42"]`). Keys too long for the chunk index (a text
 * key of 2 kB) are keyed by the JSON's first characters and its SHA-256 instead, as stable and as
 * unique as the boundary itself (the boundary stays whole in the chunk's spec).
 */
function chunkKeyOf(through: readonly string[]): string {
  const json = JSON.stringify(through);
  if (Buffer.byteLength(json) <= MAX_PLAIN_KEY_BYTES) return json;
  // By code points, so no surrogate pair is cut in half.
  const head = Array.from(json).slice(0, 100).join('');
  return `${head}… sha256:${createHash('sha256').update(json).digest('hex')}`;
}
