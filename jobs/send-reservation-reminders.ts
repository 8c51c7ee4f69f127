import { defineJob, keyRange, sql, type KeyRangeChunk } from 'idem';

interface ReminderParams {
  /** The receiver's endpoint; it must deduplicate by the Idempotency-Key header. */
  url: string;
}

const DEFAULT_URL = 'http://127.0.0.1:8787/reminders';
/** A receiver that never answers must not hold the chunk's transaction (and the job) forever. */
const REQUEST_TIMEOUT_MS = 10_000;

/**
 * Sends one reminder per reservation to an HTTP receiver.
 *
 * The guarantee, and why it holds:
 * - Toward the receiver, delivery is at-least-once, deduplicated by key: each POST goes through
 *   `ctx.effect`, which gives it a key stable across retries, crashes and processes (derived from
 *   the run, step, chunk and effect name). A reminder whose effect completed is never sent again;
 *   one cut off mid-request (crash, timeout, non-2xx) is sent again with the same key, and the
 *   receiver must treat a repeated key as the same reminder.
 * - In the database, the record is exactly-once: it is written in the chunk's transaction, which
 *   commits together with the chunk's marker, and `reservation_reminders` has one row per
 *   reservation. A reservation already recorded (by this run or an earlier one) is not sent again.
 */
export default defineJob<ReminderParams>({
  name: 'send-reservation-reminders',
  description: 'POST one reminder per reservation (Idempotency-Key header) and record it',
  params: (raw) => {
    const p = (raw ?? {}) as Record<string, unknown>;
    const unknown = Object.keys(p).filter((k) => k !== 'url');
    if (unknown.length) throw new Error(`unknown param(s) ${unknown.join(', ')}; this job takes only url`);
    const url = p.url ?? DEFAULT_URL;
    if (typeof url !== 'string' || !URL.canParse(url) || !/^https?:$/.test(new URL(url).protocol)) {
      throw new Error(`url must be an http(s) URL such as ${DEFAULT_URL}, got ${JSON.stringify(p.url)}`);
    }
    return { url };
  },
  steps: [
    {
      name: 'create-table',
      async run({ db }) {
        await sql`create table if not exists reservation_reminders (
          reservation_id bigint primary key,
          effect_key text not null,
          receiver_status integer not null,
          sent_at timestamptz not null default now()
        )`.execute(db);
      },
    },
    {
      name: 'remind',
      chunks: keyRange({ table: 'reservations', column: 'id', size: 100 }),
      async run(ctx, { lo, last }: KeyRangeChunk) {
        const { rows } = await sql<{ id: string; item_code: string; quantity: number; reserved_by: string; created_at: Date }>`
          select r.id, r.item_code, r.quantity, r.reserved_by, r.created_at from reservations r
          where r.id between ${lo} and ${last}
            and not exists (select 1 from reservation_reminders m where m.reservation_id = r.id)
          order by r.id`.execute(ctx.db);
        for (const r of rows) {
          const body = JSON.stringify({ reservationId: Number(r.id), itemCode: r.item_code, quantity: r.quantity, reservedBy: r.reserved_by, createdAt: r.created_at });
          // One effect per reservation: the name carries the id, so each reminder gets its own key.
          const sent = await ctx.effect(`reminder:${r.id}`, async (key) => {
            const res = await fetch(ctx.params.url, {
              method: 'POST',
              headers: { 'Idempotency-Key': key, 'content-type': 'application/json' },
              body,
              signal: AbortSignal.any([ctx.signal, AbortSignal.timeout(REQUEST_TIMEOUT_MS)]),
            });
            await res.arrayBuffer(); // drain, so the connection is reused
            // Throwing leaves the effect unfinished: its retry (this chunk's, or the rerun's) sends the same key.
            if (!res.ok) throw new Error(`reminder for reservation ${r.id}: receiver answered ${res.status}`);
            // Recorded in the effects ledger (JSON) and returned as is on a retry, key included.
            return { status: res.status, key };
          });
          await sql`insert into reservation_reminders (reservation_id, effect_key, receiver_status)
            values (${r.id}, ${sent.key}, ${sent.status})
            on conflict (reservation_id) do nothing`.execute(ctx.db);
        }
      },
    },
  ],
});
