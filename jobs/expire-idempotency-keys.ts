import { defineJob, sql, type ChunkSource } from 'idem';

interface ExpireParams {
  /** Keys that expired before this instant are deleted. Defaults to the run's cron slot. */
  asOf: string | null;
}

/** The cutoff: the explicit asOf, else the slot this run is for (so a late or repeated run of a slot deletes the same set). */
function cutoff(params: ExpireParams, slot: Date | null): string {
  if (params.asOf) return params.asOf;
  if (slot) return slot.toISOString();
  throw new Error('no asOf param and no cron slot: pass --param asOf=<ISO time> or run it without --key');
}

type Cursor = [string, string];

/**
 * Keyset chunks over the composite primary key (scope, idem_key) of the expired keys: boundaries
 * every 1000 rows, computed by the server one window at a time.
 */
const expiredKeyRanges: ChunkSource<ExpireParams> = async (cursor, { db, params, slot, windowSize }) => {
  const size = 1000;
  const after = cursor as Cursor | null;
  const { rows } = await sql<{ scope: string; idem_key: string; rn: string; total: string }>`
    with s as (
      select scope, idem_key from idempotency_keys
      where expires_at < ${cutoff(params, slot)}::timestamptz
        and ${after ? sql`(scope, idem_key) >= (${after[0]}, ${after[1]})` : sql`true`}
      order by scope, idem_key limit ${windowSize * size + 1}
    ), n as (select scope, idem_key, row_number() over (order by scope, idem_key) rn, count(*) over () total from s)
    select * from n where (rn - 1) % ${size} = 0 or rn = total order by rn`.execute(db);
  if (rows.length === 0) return { chunks: [], next: null };
  const full = Number(rows[0]!.total) === windowSize * size + 1;
  const bounds = rows.filter((r) => (Number(r.rn) - 1) % size === 0).map((r): Cursor => [r.scope, r.idem_key]);
  // The last window ends after its last row: an open upper bound (null) for the final chunk.
  const ends: Array<Cursor | null> = [...bounds.slice(1), ...(full ? [] : [null])];
  const starts = full ? bounds.slice(0, -1) : bounds;
  const chunks = starts.map((lo, i) => ({ key: `${lo.join('/')}..${ends[i]?.join('/') ?? 'end'}`, lo, hi: ends[i] ?? null }));
  return { chunks, next: full ? bounds[bounds.length - 1]! : null };
};

/**
 * Deletes expired idempotency keys in chunks, hourly. Deleting what is already gone deletes nothing:
 * idempotent. Run without --key it is the run of the latest hourly slot, so cron firing twice (or
 * late) is one run; `--catch-up 24` runs the missed hours.
 */
export default defineJob<ExpireParams>({
  name: 'expire-idempotency-keys',
  description: 'delete idempotency keys that expired before the slot (hourly) or asOf, in chunks',
  schedule: '0 * * * *',
  params: (raw) => {
    const p = (raw ?? {}) as Record<string, unknown>;
    const asOf = p.asOf ?? null;
    if (asOf !== null && (typeof asOf !== 'string' || Number.isNaN(Date.parse(asOf)))) throw new Error(`asOf must be an ISO timestamp, got ${JSON.stringify(p.asOf)}`);
    const unknown = Object.keys(p).filter((k) => k !== 'asOf');
    if (unknown.length) throw new Error(`unknown param(s) ${unknown.join(', ')}; this job takes only asOf`);
    return { asOf: asOf === null ? null : new Date(asOf).toISOString() };
  },
  steps: [
    {
      name: 'delete-expired',
      chunks: expiredKeyRanges,
      async run({ db, params, slot }, chunk: { lo: Cursor; hi: Cursor | null }) {
        await sql`delete from idempotency_keys
          where expires_at < ${cutoff(params, slot)}::timestamptz
            and (scope, idem_key) >= (${chunk.lo[0]}, ${chunk.lo[1]})
            and ${chunk.hi ? sql`(scope, idem_key) < (${chunk.hi[0]}, ${chunk.hi[1]})` : sql`true`}`.execute(db);
      },
    },
  ],
});
