import { sql, type Kysely } from 'kysely';
import { lockKey } from '../fingerprint.ts';
import type { Json } from '../job.ts';
import { Store, type RunRow } from '../store.ts';
import { HttpProblem } from './problem.ts';

export type ClaimOutcome = { readonly kind: 'created'; readonly run: RunRow } | { readonly kind: 'replayed'; readonly run: RunRow };

/**
 * Claims the run of (job, Idempotency-Key) and records the request, in one transaction:
 *
 * 1. `pg_try_advisory_xact_lock` on a hash of (schema, job, key): tried, never awaited. Held by
 *    another request still inside this same transaction → 409 at once, so a client retrying too
 *    early never parks a server worker on a lock.
 * 2. `Store.claimRun` (insert … on conflict do nothing, else read the row).
 * 3. New run → the request row in `api_requests`, then COMMIT: the key exists only together with
 *    its run. Existing run → same fingerprint is a replay, another is a 422; nothing is written.
 *
 * Anything that fails before COMMIT rolls back both rows, so no key is left behind.
 */
export async function claimRequest(db: Kysely<any>, schema: string, job: string, key: string, params: Json, fp: string): Promise<ClaimOutcome> {
  return db.transaction().execute(async (trx) => {
    const { rows } = await sql<{ locked: boolean }>`select pg_try_advisory_xact_lock(${lockKey(`${schema}:http:${job}:${key}`)}::bigint) as locked`.execute(trx);
    if (!rows[0]?.locked) {
      throw new HttpProblem(409, 'idem.requestInProgress', `a request with Idempotency-Key "${printable(key)}" for job "${job}" is being processed right now; retry in a moment to get its result`, { retryable: true });
    }
    // A Store on the transaction: the claim statement is the CLI's own, inside this transaction.
    const { run, created } = await new Store(trx, schema).claimRun(job, key, params, fp);
    if (run.fingerprint !== fp) throw paramsMismatch(job, key, run.fingerprint, fp);
    if (!created) return { kind: 'replayed', run };
    await sql`insert into ${sql.id(schema, 'api_requests')} (run_id, job, idempotency_key, fingerprint) values (${run.id}, ${job}, ${key}, ${fp})`.execute(trx);
    return { kind: 'created', run };
  });
}

/** 422: the key was used with other params. Names both fingerprints. */
export function paramsMismatch(job: string, key: string, stored: string, requested: string): HttpProblem {
  return new HttpProblem(
    422,
    'idem.paramsMismatch',
    `Idempotency-Key "${printable(key)}" of job "${job}" was already used with other params (${stored}, now ${requested}); send a new Idempotency-Key to run with these params, or the original params to get the original run`,
    { storedFingerprint: stored, requestFingerprint: requested },
  );
}

/** A key quoted in a message: clients choose it, so cut it short. */
export function printable(key: string): string {
  return key.length > 60 ? `${key.slice(0, 57)}...` : key;
}
