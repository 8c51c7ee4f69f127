import { defineJob, keyRange, sql, type KeyRangeChunk } from 'idem';

/**
 * Add a column, then backfill it in keyset chunks. "Make it so": each chunk sets the value only
 * where it is not already right, so rerunning a chunk (or the whole migration) changes nothing.
 */
export default defineJob({
  name: 'normalize-reserved-by',
  description: 'add reservations.reserved_by_normalized and backfill it as lower(trim(reserved_by))',
  steps: [
    {
      name: 'add-column',
      async run({ db }) {
        await sql`alter table reservations add column if not exists reserved_by_normalized text`.execute(db);
      },
    },
    {
      name: 'backfill',
      chunks: keyRange({ table: 'reservations', column: 'id', size: 1000 }),
      async run({ db }, { lo, hi }: KeyRangeChunk) {
        await sql`update reservations set reserved_by_normalized = lower(trim(reserved_by))
          where id >= ${lo} and id < ${hi}
            and reserved_by_normalized is distinct from lower(trim(reserved_by))`.execute(db);
      },
    },
  ],
});
