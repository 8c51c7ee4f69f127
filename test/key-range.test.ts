import { Kysely, PostgresDialect, sql } from 'kysely';
import pg from 'pg';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { ChunkPage, Json, PlanContext } from '../src/job.ts';
import { keyRange, type KeyRangeChunk, type KeyRangeOptions } from '../src/key-range.ts';
import { useTestDatabase } from './support/database.ts';

const database = useTestDatabase();
let db: Kysely<any>;

beforeAll(async () => {
  db = new Kysely<any>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: database.url, max: 2 }) }) });
  await sql`
    create table gappy (id integer primary key, flag boolean not null default false);
    insert into gappy (id) select g from generate_series(1, 10) g union all select g from generate_series(100, 105) g;
    create table empty_t (id integer primary key);
    create table big (id bigint primary key);
    insert into big select 10000000000 + g * 1000 from generate_series(0, 24) g;
    create table huge (id bigint primary key);
    insert into huge values (1), (9007199254740993);
    create table int_max (id integer primary key, touched integer not null default 0);
    insert into int_max (id) values (1), (2), (2147483647);
    create table small_max (id smallint primary key, touched integer not null default 0);
    insert into small_max (id) values (1), (32767);
    create table nullable_key (id integer unique, touched integer not null default 0);
    insert into nullable_key (id) select generate_series(1, 5) union all select null union all select null;
    create schema other;
    create table other.things (id integer primary key);
    insert into other.things select generate_series(1, 7);
    -- A table whose keys have random gaps (deterministic: setseed).
    select setseed(0.42);
    create table random_gaps as select distinct (random() * 5000)::int as id from generate_series(1, 1200);
    alter table random_gaps add primary key (id);
  `.execute(db);
});

afterAll(async () => {
  await db?.destroy();
});

const ctx = (windowSize: number) =>
  ({
    db,
    windowSize,
    params: {},
    log: pino({ level: 'silent' }),
    signal: new AbortController().signal,
    run: { job: 'test', runKey: 'k', runId: '1', attempt: 1 },
    step: 'step',
  }) as PlanContext<unknown>;

/** Calls the source from a null cursor until it says it is exhausted; returns every window. */
async function allWindows(opts: KeyRangeOptions, windowSize: number): Promise<Array<ChunkPage<KeyRangeChunk>>> {
  const source = keyRange(opts);
  const pages: Array<ChunkPage<KeyRangeChunk>> = [];
  let cursor: Json | null = null;
  for (let i = 0; i < 10_000; i++) {
    const page: ChunkPage<KeyRangeChunk> = await source(cursor, ctx(windowSize));
    pages.push(page);
    if (page.next === null) return pages;
    cursor = page.next;
  }
  throw new Error('the source never said it was exhausted');
}

async function ids(table: string, where = 'true'): Promise<number[]> {
  const { rows } = await sql<{ id: string | number }>`select id from ${sql.table(table)} where ${sql.raw(where)} order by id`.execute(db);
  return rows.map((r) => Number(r.id));
}

/** Asserts the chunks are ordered, contiguous, non-overlapping half-open ranges covering each id exactly once. */
function expectExactCover(chunks: readonly KeyRangeChunk[], keys: number[], size: number): void {
  for (let i = 0; i + 1 < chunks.length; i++) {
    expect(chunks[i]!.hi).toBe(chunks[i + 1]!.lo);
  }
  for (const c of chunks) {
    expect(c.lo).toBeLessThan(c.hi);
    expect(c.last).toBe(c.hi - 1);
    expect(c.key).toBe(`[${c.lo},${c.hi})`);
  }
  const perKey = keys.map((k) => chunks.filter((c) => c.lo <= k && k < c.hi).length);
  expect(perKey.every((n) => n === 1)).toBe(true);
  const rowsPerChunk = chunks.map((c) => keys.filter((k) => c.lo <= k && k < c.hi).length);
  // Every chunk holds exactly `size` rows except the last, which holds the rest.
  expect(rowsPerChunk.slice(0, -1).every((n) => n === size)).toBe(true);
  expect(rowsPerChunk.at(-1)).toBeGreaterThan(0);
  expect(rowsPerChunk.at(-1)).toBeLessThanOrEqual(size);
  expect(new Set(chunks.map((c) => c.key)).size).toBe(chunks.length);
}

describe('keyRange', () => {
  it('cuts a table with gaps into half-open ranges of `size` rows that cover every row once', async () => {
    const page = await keyRange({ table: 'gappy', column: 'id', size: 4 })(null, ctx(100));
    expect(page).toEqual({
      chunks: [
        { key: '[1,5)', lo: 1, hi: 5, last: 4 },
        { key: '[5,9)', lo: 5, hi: 9, last: 8 },
        { key: '[9,102)', lo: 9, hi: 102, last: 101 },
        { key: '[102,106)', lo: 102, hi: 106, last: 105 },
      ],
      next: null,
    });
    expectExactCover(page.chunks, await ids('gappy'), 4);
  });

  it('returns at most windowSize chunks per call and the cursor continues exactly where the window ended', async () => {
    const source = keyRange({ table: 'gappy', column: 'id', size: 4 });
    const first = await source(null, ctx(1));
    expect(first).toEqual({ chunks: [{ key: '[1,5)', lo: 1, hi: 5, last: 4 }], next: 5 });
    const second = await source(first.next, ctx(1));
    expect(second).toEqual({ chunks: [{ key: '[5,9)', lo: 5, hi: 9, last: 8 }], next: 9 });
    const rest = await source(second.next, ctx(2));
    expect(rest).toEqual({ chunks: [{ key: '[9,102)', lo: 9, hi: 102, last: 101 }, { key: '[102,106)', lo: 102, hi: 106, last: 105 }], next: null });
  });

  it('is deterministic: the same cursor gives the same chunks', async () => {
    const source = keyRange({ table: 'gappy', column: 'id', size: 3 });
    expect(await source(5, ctx(2))).toEqual(await source(5, ctx(2)));
  });

  it('a last window holding exactly windowSize chunks is still the last one (next = null)', async () => {
    // 16 rows, size 4, window 2: the second window holds rows 9..16, two full chunks, and ends the table.
    const pages = await allWindows({ table: 'gappy', column: 'id', size: 4 }, 2);
    expect(pages.map((p) => p.chunks.length)).toEqual([2, 2]);
    expect(pages.map((p) => p.next)).toEqual([9, null]);
    expectExactCover(pages.flatMap((p) => p.chunks), await ids('gappy'), 4);
  });

  it('the union of all windows equals the table, for many sizes and window sizes over random gaps', async () => {
    const keys = await ids('random_gaps');
    expect(keys.length).toBeGreaterThan(900);
    for (const [size, windowSize] of [[1, 50], [7, 3], [10, 1], [64, 4], [100, 100], [5000, 1]] as const) {
      const pages = await allWindows({ table: 'random_gaps', column: 'id', size }, windowSize);
      expect(pages.every((p) => p.chunks.length <= windowSize)).toBe(true);
      const chunks = pages.flatMap((p) => p.chunks);
      expect(chunks).toHaveLength(Math.ceil(keys.length / size));
      expectExactCover(chunks, keys, size);
    }
  });

  it('counts only rows matching `where` with index-skipping boundaries too (size >= 8)', async () => {
    const matching = await ids('random_gaps', 'id % 3 = 0');
    for (const [size, windowSize] of [[8, 3], [25, 2], [1000, 5]] as const) {
      const pages = await allWindows({ table: 'random_gaps', column: 'id', size, where: 'id % 3 = 0' }, windowSize);
      const chunks = pages.flatMap((p) => p.chunks);
      expect(chunks).toHaveLength(Math.ceil(matching.length / size));
      expectExactCover(chunks, matching, size);
    }
  });

  it('counts only rows matching `where` (SQL text or a sql`` fragment)', async () => {
    await sql`update gappy set flag = (id % 3 = 0)`.execute(db);
    const flagged = await ids('gappy', 'flag');
    expect(flagged).toEqual([3, 6, 9, 102, 105]);
    for (const where of ['flag', sql`flag`]) {
      const pages = await allWindows({ table: 'gappy', column: 'id', size: 2, where }, 1);
      const chunks = pages.flatMap((p) => p.chunks);
      expect(chunks.map((c) => c.key)).toEqual(['[3,9)', '[9,105)', '[105,106)']);
      expectExactCover(chunks, flagged, 2);
    }
    const none = await keyRange({ table: 'gappy', column: 'id', size: 2, where: 'id < 0' })(null, ctx(10));
    expect(none).toEqual({ chunks: [], next: null });
  });

  it('a `where` ending in a -- comment is one condition too: the comment does not swallow the query around it', async () => {
    // Black-box round 10: the condition was spliced in without a line break, so `-- …` commented
    // out the rest of idem's planning statement ("syntax error at or near \"union\"").
    const matching = await ids('random_gaps', 'id % 3 = 0 or id % 5 = 0');
    for (const [size, windowSize] of [[4, 2], [25, 3]] as const) {
      const pages = await allWindows({ table: 'random_gaps', column: 'id', size, where: 'id % 3 = 0 or id % 5 = 0 -- a trailing comment' }, windowSize);
      expectExactCover(pages.flatMap((p) => p.chunks), matching, size);
    }
  });

  it('a sql`` where with OR at its top is one condition: `lower and (a or b)`, not `lower and a or b`', async () => {
    const matching = await ids('random_gaps', 'id % 3 = 0 or id % 5 = 0');
    for (const [size, windowSize] of [[4, 2], [25, 3]] as const) {
      const pages = await allWindows({ table: 'random_gaps', column: 'id', size, where: sql`id % 3 = 0 or id % 5 = 0` }, windowSize);
      expectExactCover(pages.flatMap((p) => p.chunks), matching, size);
    }
  });

  it('an empty table gives no chunks and next = null', async () => {
    expect(await keyRange({ table: 'empty_t', column: 'id', size: 10 })(null, ctx(100))).toEqual({ chunks: [], next: null });
  });

  it('works on a bigint column, returning numbers', async () => {
    const pages = await allWindows({ table: 'big', column: 'id', size: 10 }, 1);
    const chunks = pages.flatMap((p) => p.chunks);
    expect(chunks).toEqual([
      { key: '[10000000000,10000010000)', lo: 10_000_000_000, hi: 10_000_010_000, last: 10_000_009_999 },
      { key: '[10000010000,10000020000)', lo: 10_000_010_000, hi: 10_000_020_000, last: 10_000_019_999 },
      { key: '[10000020000,10000024001)', lo: 10_000_020_000, hi: 10_000_024_001, last: 10_000_024_000 },
    ]);
    expectExactCover(chunks, await ids('big'), 10);
  });

  it('refuses keys beyond 2^53 instead of rounding them, naming the way out', async () => {
    await expect(keyRange({ table: 'huge', column: 'id', size: 1 })(null, ctx(10))).rejects.toThrow(/not a safe integer, within ±\(2\^53−1\); use keysetQuery for such keys/);
  });

  it('refuses a key column of another type (numeric, text), naming keysetQuery as the way', async () => {
    // Black-box round 10: a numeric key was refused with the text-sorting reason.
    await sql`create table numeric_key (id numeric primary key)`.execute(db);
    await sql`create table text_key (code text primary key)`.execute(db);
    await expect(keyRange({ table: 'numeric_key', column: 'id', size: 10 })(null, ctx(10))).rejects.toThrow(
      `keyRange(): column "id" of "numeric_key" is numeric, but keyRange cuts only smallint, integer and bigint keys (its ranges are integer intervals); for a key of another type use keysetQuery({ query: 'select id from numeric_key', key: 'id', size }) (with your where in the query), which cuts any key type exactly`,
    );
    await expect(keyRange({ table: 'text_key', column: 'code', size: 10 })(null, ctx(10))).rejects.toThrow(/column "code" of "text_key" is text, but keyRange cuts only smallint, integer and bigint keys/);
  });

  it('a key at its type\'s maximum (integer, smallint) is reached by the inclusive bound: `id between lo and last`', async () => {
    // The last range's hi is max + 1, which `id < hi` cannot bind for the column's type; last = hi - 1 can.
    for (const [table, max] of [['int_max', 2147483647], ['small_max', 32767]] as const) {
      const chunks = (await allWindows({ table, column: 'id', size: 1 }, 2)).flatMap((p) => p.chunks);
      expect(chunks.at(-1)).toEqual({ key: `[${max},${max + 1})`, lo: max, hi: max + 1, last: max });
      for (const c of chunks) await sql`update ${sql.table(table)} set touched = touched + 1 where id between ${c.lo} and ${c.last}`.execute(db);
      expect(await sql<{ n: number }>`select count(*)::int as n from ${sql.table(table)} where touched <> 1`.execute(db).then((r) => r.rows[0]!.n)).toBe(0);
      await expect(sql`select 1 from ${sql.table(table)} where id < ${chunks.at(-1)!.hi}`.execute(db)).rejects.toThrow(/out of range/);
    }
  });

  it('refuses a nullable key column holding NULLs (rows no range holds), naming the count and the fix, unless `where` excludes them', async () => {
    await expect(keyRange({ table: 'nullable_key', column: 'id', size: 2 })(null, ctx(10))).rejects.toThrow(
      'keyRange(): column "id" of "nullable_key" has 2 rows where it is NULL, which no range holds, so they would be skipped; declare the column NOT NULL, or pass a where that excludes them (where: \'id is not null\') and handle those rows in another step',
    );
    const chunks = (await allWindows({ table: 'nullable_key', column: 'id', size: 2, where: 'id is not null' }, 10)).flatMap((p) => p.chunks);
    expectExactCover(chunks, [1, 2, 3, 4, 5], 2);
  });

  it('checks a NOT NULL key column in the catalog query alone: no statement looks for NULL rows', async () => {
    const seen: string[] = [];
    const spy = new Kysely<any>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: database.url, max: 1 }) }), log: (e) => void seen.push(e.query.sql) });
    try {
      await keyRange({ table: 'gappy', column: 'id', size: 4 })(null, { ...ctx(10), db: spy } as PlanContext<unknown>);
    } finally {
      await spy.destroy();
    }
    expect(seen).toHaveLength(2); // the catalog check, then the window
    expect(seen.some((q) => /"id" is null/.test(q))).toBe(false);
  });

  it('accepts a schema-qualified table', async () => {
    const pages = await allWindows({ table: 'other.things', column: 'id', size: 3 }, 10);
    expect(pages.flatMap((p) => p.chunks).map((c) => c.key)).toEqual(['[1,4)', '[4,7)', '[7,8)']);
  });

  it('rejects bad options at definition time, listing every problem', () => {
    expect(() => keyRange({ table: '', column: '', size: 0 })).toThrow(
      'keyRange(): table must be a non-empty string; column must be a non-empty string; size must be an integer >= 1 (got 0)',
    );
    expect(() => keyRange({ table: 't', column: 'id', size: 2.5 })).toThrow(/size must be an integer >= 1/);
  });
});
