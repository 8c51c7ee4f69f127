/**
 * Type-level checks of the job API, type-checked by `npm run typecheck` (tsconfig includes test/),
 * not run: each `@ts-expect-error` must meet an error, every other line must compile. Nothing
 * here touches a database.
 */
import { defineJob, keyList, keyRange, keysetQuery, sql, type KeyRangeChunk, type NoParams } from 'idem';

interface Db {
  reservations: { id: number; reserved_by: string | null };
}

// defineJob's own JSDoc example: a keyRange step with no annotations. `db` is Kysely's untyped
// Transaction<any> (a chunk source carries no database type; it was Transaction<unknown>, where
// updateTable('reservations') did not compile).
export const untyped = defineJob({
  name: 'types-untyped',
  steps: [
    {
      name: 'normalize',
      chunks: keyRange({ table: 'reservations', column: 'id', size: 1000 }),
      run: ({ db }, { lo, hi }: KeyRangeChunk) => db.updateTable('reservations').set({ reserved_by: null }).where('id', '>=', lo).where('id', '<', hi).execute(),
    },
  ],
});

// Params from a validator function, a keyRange and a keysetQuery: the params stay the validator's.
const pending = keysetQuery({ query: 'select id from reservations', key: 'id', size: 100 });
export const withParams = defineJob({
  name: 'types-params',
  params: (raw) => raw as { currency: string },
  steps: [
    {
      name: 'ranged',
      chunks: keyRange({ table: 'reservations', column: 'id', size: 10 }),
      run: ({ db, params }, { lo }: KeyRangeChunk) => {
        const currency: string = params.currency;
        // @ts-expect-error: params are the validator's output
        const wrong: number = params.currency;
        return sql`select ${currency}, ${lo}, ${wrong}`.execute(db);
      },
    },
    { name: 'keyset', chunks: pending, run: ({ db }, chunk) => sql`update reservations set reserved_by = null where ${pending.where(chunk)}`.execute(db) },
  ],
});

// A keyList of plain keys does not make the job's params `any`.
export const listed = defineJob({
  name: 'types-list',
  steps: [
    { name: 'listed', chunks: keyList({ keys: [1, 2, 3], size: 2 }), run: () => {} },
    {
      name: 'single',
      run: ({ params }) => {
        // @ts-expect-error: a job without params has none to read
        const p: { nope: 1 } = params;
        return p;
      },
    },
  ],
});

// A database type given to defineJob types ctx.db, with keyRange's chunks too.
export const typed = defineJob<Record<string, never>, Db>({
  name: 'types-typed',
  steps: [
    {
      name: 'normalize',
      chunks: keyRange({ table: 'reservations', column: 'id', size: 1000 }),
      run: ({ db }, { lo, hi }: KeyRangeChunk) => {
        // @ts-expect-error: no such table in Db
        void db.updateTable('nope');
        return db.updateTable('reservations').set({ reserved_by: null }).where('id', '>=', lo).where('id', '<', hi).execute();
      },
    },
  ],
});

// keyList's keys as a function of the params: typed by the job's params, unannotated.
export const listedByParams = defineJob({
  name: 'types-list-params',
  params: (raw) => raw as { ids: number[] },
  steps: [{ name: 'listed', chunks: keyList({ keys: (p) => p.ids, size: 2 }), run: ({ db }, { keys }) => sql`select ${keys}`.execute(db) }],
});

// Black-box round 14 (B3-13): a chunked step whose chunks are a call and whose run takes ctx alone
// got an untyped ctx (TS7031/TS7006 under strict): the union's two run signatures differed in arity.
export const ctxOnly = defineJob({
  name: 'types-ctx-only',
  steps: [
    { name: 'ranged', chunks: keyRange({ table: 'reservations', column: 'id', size: 10 }), run: ({ db, params }) => sql`select ${JSON.stringify(params)}`.execute(db) },
    { name: 'listed', chunks: keyList({ keys: [1, 2], size: 1 }), run: (ctx) => ctx.log.info('chunk') },
    { name: 'single', run: ({ db }) => sql`select 1`.execute(db) },
  ],
});

// Black-box round 15 (B2-14): a job without `params` that names its database type names its params
// type too; Record<string, never> (the default until 2026-12-04) let `params.foo` pass as `never`,
// which any type accepts, where noUncheckedIndexedAccess is off. NoParams has nothing to read.
export const noParams = defineJob<NoParams, Db>({
  name: 'types-no-params',
  steps: [
    {
      name: 'single',
      run: ({ params }) => {
        // @ts-expect-error: a job without params has none to read
        const v: string = params.foo;
        return v;
      },
    },
  ],
});
