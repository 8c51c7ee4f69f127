import { defineJob, sql, type ChunkSource } from 'idem';

interface TotalsParams {
  /** First day (YYYY-MM-DD), inclusive. */
  from: string;
  /** Last day (YYYY-MM-DD), inclusive. */
  to: string;
  /** Pause inside each chunk, in ms: only to make the demo's kill-and-resume visible. */
  pauseMs: number;
}

const DAY = /^\d{4}-\d{2}-\d{2}$/;

/** One chunk per day: the key is the day itself, stable whatever the data. */
const days: ChunkSource<TotalsParams> = (cursor, { params, windowSize }) => {
  const chunks = [];
  let day = typeof cursor === 'string' ? cursor : params.from;
  while (chunks.length < windowSize && day <= params.to) {
    chunks.push({ key: day, day });
    day = new Date(Date.parse(`${day}T00:00:00Z`) + 86_400_000).toISOString().slice(0, 10);
  }
  return { chunks, next: day <= params.to ? day : null };
};

/**
 * Per day and item: the totals row is *set* from the reservations (upsert), and rows for items with
 * no reservations that day are deleted. Running a day twice leaves the same rows.
 */
export default defineJob<TotalsParams>({
  name: 'reservation-daily-totals',
  description: 'upsert reservation totals per day and item (state-setting, re-runnable)',
  params: (raw) => {
    const p = (raw ?? {}) as Record<string, unknown>;
    const from = p.from ?? '2026-11-01';
    const to = p.to ?? '2026-11-30';
    const pauseMs = p.pauseMs ?? 0;
    if (typeof from !== 'string' || !DAY.test(from)) throw new Error(`from must be a YYYY-MM-DD day, got ${JSON.stringify(p.from)}`);
    if (typeof to !== 'string' || !DAY.test(to)) throw new Error(`to must be a YYYY-MM-DD day, got ${JSON.stringify(p.to)}`);
    if (to < from) throw new Error(`to (${to}) is before from (${from})`);
    if (!Number.isInteger(pauseMs) || (pauseMs as number) < 0 || (pauseMs as number) > 60_000) throw new Error('pauseMs must be an integer from 0 to 60000');
    const unknown = Object.keys(p).filter((k) => !['from', 'to', 'pauseMs'].includes(k));
    if (unknown.length) throw new Error(`unknown param(s) ${unknown.join(', ')}; this job takes from, to, pauseMs`);
    return { from, to, pauseMs: pauseMs as number };
  },
  steps: [
    {
      name: 'create-table',
      async run({ db }) {
        await sql`create table if not exists reservation_daily_totals (
          day date not null,
          item_code text not null,
          total_quantity bigint not null,
          reservations integer not null,
          primary key (day, item_code)
        )`.execute(db);
      },
    },
    {
      name: 'totals',
      chunks: days,
      async run({ db, params }, { day }: { day: string }) {
        if (params.pauseMs > 0) await sql`select pg_sleep(${params.pauseMs / 1000})`.execute(db);
        await sql`insert into reservation_daily_totals (day, item_code, total_quantity, reservations)
          select ${day}::date, item_code, sum(quantity), count(*) from reservations
          where created_at >= ${day}::date and created_at < ${day}::date + 1
          group by item_code
          on conflict (day, item_code) do update set total_quantity = excluded.total_quantity, reservations = excluded.reservations`.execute(db);
        await sql`delete from reservation_daily_totals t where t.day = ${day}::date
          and not exists (select 1 from reservations r where r.item_code = t.item_code and r.created_at >= ${day}::date and r.created_at < ${day}::date + 1)`.execute(db);
      },
    },
  ],
});
