import pg from 'pg';

/** Rows per keyset chunk in the backfill benchmarks. */
export const CHUNK_ROWS = 1000;

/** Only plain lower-case identifiers: table names are built by the benchmarks, never typed in. */
const IDENT = /^[a-z_][a-z0-9_]{0,62}$/;

export function assertIdent(name: string): string {
  if (!IDENT.test(name)) throw new TypeError(`bench table name ${JSON.stringify(name)} is not a plain identifier`);
  return name;
}

/**
 * A fresh backfill table of `rows` rows (ids 1..rows, no gaps), built with generate_series, the
 * primary key added after the load, then VACUUM (ANALYZE) so every contender starts from set hint
 * bits, a visibility map and statistics, and a CHECKPOINT so no contender inherits the previous
 * one's dirty pages. Same server settings for everyone (synchronous_commit untouched).
 *
 * Autovacuum is off for the table (never for idem's own tables): a 1 M-row backfill leaves enough
 * dead rows for an autovacuum worker to start on it mid-turn, at a moment set by the launcher's
 * clock, not by the contender. Where it did, it took 1.0-1.3 s of server CPU beside the turn's
 * ~6 s, on whichever contender happened to be running: noise in the comparison, not a cost of
 * either chunk path. (idem's health gate does not wait for it here: the bench job wraps keyRange,
 * so the step names no table.)
 */
export async function prepareTable(pool: pg.Pool, table: string, rows: number): Promise<void> {
  const t = assertIdent(table);
  await pool.query(`drop table if exists ${t}`);
  await pool.query(`create table ${t} (id bigint not null, payload text not null, normalized text) with (autovacuum_enabled = false)`);
  await pool.query(`insert into ${t} (id, payload) select g, 'User ' || g || ' <' || md5(g::text) || '@Example.COM>' from generate_series(1, $1::bigint) g`, [rows]);
  await pool.query(`alter table ${t} add primary key (id)`);
  await pool.query(`vacuum (analyze) ${t}`);
  await checkpoint(pool);
}

export async function dropTable(pool: pg.Pool, table: string): Promise<void> {
  await pool.query(`drop table if exists ${assertIdent(table)}`);
}

/** CHECKPOINT needs superuser or pg_checkpoint: without it the benchmarks just carry the noise. */
export async function checkpoint(pool: pg.Pool): Promise<void> {
  await pool.query('checkpoint').catch(() => {});
}

/**
 * The keyset boundaries `[lo, hi)` of `size`-row chunks, computed the way `keyRange` does (every
 * size-th key, then the last key + 1), so the hand loop and the queue get exactly idem's chunks.
 */
export async function keysetChunks(pool: pg.Pool, table: string, size: number): Promise<Array<{ lo: number; hi: number }>> {
  const t = assertIdent(table);
  const { rows } = await pool.query<{ k: string }>(
    `select k from (select id as k, row_number() over (order by id) as rn from ${t}) s where (rn - 1) % $1 = 0
     union all select max(id) + 1 from ${t} order by 1`, [size]);
  const keys = rows.map((r) => Number(r.k));
  const chunks: Array<{ lo: number; hi: number }> = [];
  for (let i = 0; i + 1 < keys.length; i++) chunks.push({ lo: keys[i]!, hi: keys[i + 1]! });
  return chunks;
}

/** How many rows still differ from the backfilled value: 0 once a contender did the whole job. */
export async function rowsLeft(pool: pg.Pool, table: string): Promise<number> {
  const { rows } = await pool.query<{ n: number }>(`select count(*)::int as n from ${assertIdent(table)} where normalized is distinct from lower(payload)`);
  return rows[0]!.n;
}
