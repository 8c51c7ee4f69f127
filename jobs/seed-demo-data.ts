import { defineJob, sql, type ChunkSource } from 'idem';

interface SeedParams {
  /** How many reservations. */
  rows: number;
}

/** Natural-key ranges [lo, hi) over 1..rows: the rows are generated, not read, so the source is pure. */
const ranges: ChunkSource<SeedParams> = (cursor, { params, windowSize }) => {
  const size = 1000;
  const chunks = [];
  let lo = typeof cursor === 'number' ? cursor : 1;
  while (chunks.length < windowSize && lo <= params.rows) {
    const hi = Math.min(lo + size, params.rows + 1);
    chunks.push({ key: `[${lo},${hi})`, lo, hi });
    lo = hi;
  }
  return { chunks, next: lo <= params.rows ? lo : null };
};

/** Demo rows by natural key with `on conflict do nothing`: state-setting, so a rerun adds nothing. */
export default defineJob<SeedParams>({
  name: 'seed-demo-data',
  description: 'insert demo reservations and idempotency keys (by natural key, re-runnable)',
  params: (raw) => {
    const p = (raw ?? {}) as Record<string, unknown>;
    const rows = p.rows ?? 20_000;
    if (!Number.isInteger(rows) || (rows as number) < 1 || (rows as number) > 10_000_000) {
      throw new Error(`rows must be an integer from 1 to 10000000, got ${JSON.stringify(p.rows)}`);
    }
    const unknown = Object.keys(p).filter((k) => k !== 'rows');
    if (unknown.length) throw new Error(`unknown param(s) ${unknown.join(', ')}; this job takes only rows`);
    return { rows: rows as number };
  },
  steps: [
    {
      name: 'reservations',
      chunks: ranges,
      async run({ db }, { lo, hi }: { lo: number; hi: number }) {
        await sql`insert into reservations (id, item_code, quantity, reserved_by, created_at)
          overriding system value
          select g, 'ITEM-' || lpad((g % 50)::text, 2, '0'), 1 + g % 5,
                 (array['  Alice@Example.COM ', 'bob@example.com', ' Carol@Example.com'])[1 + g % 3],
                 timestamptz '2026-11-01 00:00:00+00' + (g % 30) * interval '1 day' + (g % 86400) * interval '1 second'
          from generate_series(${lo}::bigint, ${hi}::bigint - 1) g
          on conflict (id) do nothing`.execute(db);
      },
    },
    {
      // Explicit ids leave the identity sequence behind; make it so it continues after them.
      name: 'sync-identity',
      async run({ db }) {
        await sql`select setval(pg_get_serial_sequence('reservations', 'id'), greatest((select max(id) from reservations), 1))`.execute(db);
      },
    },
    {
      name: 'idempotency-keys',
      chunks: ranges,
      async run({ db }, { lo, hi }: { lo: number; hi: number }) {
        await sql`insert into idempotency_keys (scope, idem_key, request_hash, response_status, response_body, created_at, expires_at)
          select 'reservations', 'key-' || g, md5(g::text), 201, jsonb_build_object('reservation', g),
                 timestamptz '2026-11-01 00:00:00+00', timestamptz '2026-11-01 00:00:00+00' + (g % 60) * interval '1 day'
          from generate_series(${lo}::bigint, ${hi}::bigint - 1) g
          on conflict (scope, idem_key) do nothing`.execute(db);
      },
    },
  ],
});
