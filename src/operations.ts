import { sql, type Kysely, type RawBuilder } from 'kysely';
import { acquireAdvisoryLock, type HeldLock } from './advisory-lock.ts';
import { BusyError, UsageError } from './errors.ts';
import { lockKey } from './fingerprint.ts';
import { quoteKey, SLOT_KEY_SOURCE } from './run-key.ts';
import type { RunRow } from './store.ts';

/** What an operator command needs from the runner. */
export interface OperationsHost {
  readonly db: Kysely<any>;
  readonly schema: string;
  /** False: the database has no idem schema (a runner that did not create it), so no runs. */
  readonly schemaExists?: boolean;
  readonly connectionString: string;
  jobLockName(job: string): string;
  runLockName(runId: string): string;
  heldLocks(): Promise<HeldLocks>;
}

/**
 * The host of an operator command with no database to ask (no DATABASE_URL and no embedded server
 * yet, see withoutDatabase in cli-session.ts): no idem schema, so no runs, as on a database the
 * schema was never created in; the refusals are the same. Nothing of it reads a database.
 */
export function noDatabaseHost(schema: string): OperationsHost {
  const none = (): never => {
    throw new Error('idem internal error: no database to ask');
  };
  return { db: new Proxy({}, { get: none }) as Kysely<any>, schema, schemaExists: false, connectionString: '', jobLockName: none, runLockName: none, heldLocks: none };
}

/** Session advisory locks held right now: by 64-bit key, and as `pid:key`. */
export interface HeldLocks {
  readonly keys: ReadonlySet<string>;
  readonly byPid: ReadonlySet<string>;
}

/**
 * The committed chunks of run `r`, in one scan: how many (`chunks_done`), how many of them its
 * current attempt did (`done_this_attempt`, for the rate), and when the last one was claimed
 * (`last_done`). `cross join lateral` it as `cs`. A chunk commits without writing the run row, so
 * the row's `updated_at` alone says nothing about a run that is moving.
 */
export function doneChunks(chunks: RawBuilder<unknown>): RawBuilder<unknown> {
  return sql`(select count(c.done_at)::int as chunks_done, (count(*) filter (where c.done_attempt = r.attempt))::int as done_this_attempt,
    max(c.done_at) as last_done from ${chunks} c where c.run_id = r.id)`;
}

/** A live run reads stalled once nothing committed for this many times its usual interval between chunks… */
export const STALLED_AFTER_INTERVALS = 5;
/** …and for at least this long (a run committing every few ms is not stalled by a checkpoint's pause). */
export const STALLED_MIN_SECONDS = 10;

/**
 * Seconds since a running attempt's last committed chunk, when that is stalled (see
 * RunStatusRow.stalledSeconds), else null. The usual interval is the attempt's time up to its last
 * chunk over its chunks: not its rate now, which a stall drags down until it would never tell.
 */
export function stalledSeconds(attemptSeconds: number, idleSeconds: number, doneThisAttempt: number): number | null {
  if (!(doneThisAttempt > 0) || !(idleSeconds >= 0)) return null;
  const interval = Math.max(0, attemptSeconds - idleSeconds) / doneThisAttempt;
  return idleSeconds > Math.max(STALLED_MIN_SECONDS, STALLED_AFTER_INTERVALS * interval) ? Math.floor(idleSeconds) : null;
}

/** When a run last changed: its row's `updated_at`, or its latest committed chunk where later. */
export function lastChange(updatedAt: Date, lastDone: Date | null): Date {
  return lastDone !== null && lastDone > updatedAt ? lastDone : updatedAt;
}

/**
 * Is this run being worked right now? Not "someone holds the job's lock": the backend that took
 * this run's attempt must still hold the lock it took (a crashed run of the same job stays crashed
 * while another run of it is live). Rows from before lock_pid was recorded fall back to the key.
 */
export function runIsLive(run: Pick<RunRow, 'id' | 'status' | 'job' | 'lock_name' | 'lock_pid'>, held: HeldLocks, h: Pick<OperationsHost, 'jobLockName' | 'runLockName'>): boolean {
  if (run.status !== 'running') return false;
  // Any worker on the run holds the run's own lock (the first one may have gone, others go on).
  if (held.keys.has(lockKey(h.runLockName(String(run.id))))) return true;
  const key = lockKey(run.lock_name ?? h.jobLockName(run.job));
  return run.lock_pid == null ? held.keys.has(key) : held.byPid.has(`${run.lock_pid}:${key}`);
}

export interface ControlResult {
  readonly job: string;
  readonly runKey: string;
  /** The status the run has now (a live run keeps `running` until it reaches a chunk boundary). */
  readonly status: string;
  /** True when a live process holds the run and will honour the request between chunks. */
  readonly live: boolean;
  /**
   * The request now pending on the run for its live process (`pause`, `cancel`), or null: none
   * (a run nobody executes took its new status at once; a resume withdrew the pause).
   */
  readonly requested: 'pause' | 'cancel' | null;
}

export interface PruneResult {
  readonly runs: number;
  readonly steps: number;
  readonly chunks: number;
  readonly effects: number;
  /** Runs old enough to go that another process held (reviving, working or resetting them): left alone. */
  readonly skipped: number;
}

const t = (h: Pick<OperationsHost, 'schema'>, name: string) => sql.id(h.schema, name);

/**
 * The run an operator command acts on: the one with `key`, else the job's live run (a worker holds
 * it) in one of `statuses`, else its latest run in one of them. A crashed run's row still says
 * `running`, so the row's status alone would pick a crashed run over the live one, or over a newer
 * pending one. `pausePending`: a running run with a pause pending counts too (resume withdraws it).
 */
async function targetRun(h: OperationsHost, job: string, key: string | undefined, statuses: readonly string[], verb: string, pausePending = false): Promise<RunRow> {
  let run: RunRow | undefined;
  if (h.schemaExists === false) {
    // No idem schema: no run, said as for a job that has none.
  } else if (key === undefined) {
    const applies = pausePending ? sql`(status = any(${statuses}::text[]) or (status = 'running' and requested = 'pause'))` : sql`status = any(${statuses}::text[])`;
    // Every running run (the live one is among them, whether the command applies to it or not) and
    // the latest run it applies to. The live run is the target even where the command does not
    // apply to it (a resume of a live run with no pause pending): the refusal names it, and an
    // older paused run is left alone (until 2026-12-04 a resume without --key resumed that one).
    const { rows } = await sql<RunRow & { applies: boolean }>`select r.*, ${applies} as applies from ${t(h, 'runs')} r
      where job = ${job} and (status = 'running' or id = (select id from ${t(h, 'runs')} where job = ${job} and ${applies} order by created_at desc, id desc limit 1))
      order by created_at desc, id desc`.execute(h.db);
    const running = rows.filter((r) => r.status === 'running');
    const held = running.length > 0 ? await h.heldLocks() : undefined;
    const picked = (held && running.find((r) => runIsLive(r, held, h))) ?? rows.find((r) => r.applies);
    if (picked) {
      const { applies: _, ...row } = picked;
      run = row;
    }
  } else {
    run = (await sql<RunRow>`select * from ${t(h, 'runs')} where job = ${job} and run_key = ${key}`.execute(h.db)).rows[0];
  }
  if (!run) {
    throw new UsageError(
      'unknownRun',
      key === undefined
        ? `job "${job}" has no run to ${verb} (none is ${statuses.join(' or ')}${pausePending ? ' or running with a pause pending' : ''}); see idem status ${job}`
        : `job "${job}" has no run with key ${quoteKey(key)}; see idem status ${job} for its run keys`,
    );
  }
  return { ...run, id: String(run.id) };
}

/** Whether a run is live now: its row says running and its locks are held (pg_locks read only then). */
export async function isLive(h: Pick<OperationsHost, 'heldLocks' | 'jobLockName' | 'runLockName'>, run: Pick<RunRow, 'id' | 'status' | 'job' | 'lock_name' | 'lock_pid'>): Promise<boolean> {
  if (run.status !== 'running') return false;
  return runIsLive(run, await h.heldLocks(), h);
}

/** A statement run on a held lock's own session: it cannot run once that lock is lost. */
function onLockSession<R extends Record<string, unknown>>(lock: HeldLock, db: Kysely<any>, q: RawBuilder<R>): Promise<R[]> {
  const c = q.compile(db);
  return lock.query<R>(c.sql, c.parameters);
}

/** The locks others hold: without those of one session (an operator command's own lock session). */
function withoutPid(held: HeldLocks, pid: number): HeldLocks {
  const byPid = [...held.byPid].filter((k) => !k.startsWith(`${pid}:`));
  return { byPid: new Set(byPid), keys: new Set(byPid.map((k) => k.slice(k.indexOf(':') + 1))) };
}

/** A run a killed prune left `deleting`: no operator command but reset applies to it; what does. */
function beingDeleted(run: RunRow, job: string, verb: string): UsageError {
  return new UsageError(
    'cannotControl',
    `run "${run.run_key}" of job "${job}" is being deleted (an idem prune stopped part way through it): nothing to ${verb}; idem prune finishes deleting it, and idem run ${job} --key ${run.run_key} runs the key afresh`,
  );
}

/** Busy because another process holds a run's lock exclusively to delete it; `what` names the run. */
export function beingDeletedMessage(what: string, advice = 'run the command again once that has ended'): string {
  return `${what} is being deleted in another process (idem prune or idem reset holds its lock); ${advice}`;
}

/** How many times an operator command re-reads a run that changed under it before giving up. */
const CAS_TRIES = 5;

/**
 * Pause or cancel: cooperative. A live run sees the request within a second, lets its in-flight
 * chunks finish and stops with the new status; a run nobody is executing takes the status at once.
 */
export async function requestControl(h: OperationsHost, job: string, what: 'pause' | 'cancel', key?: string): Promise<ControlResult> {
  const open = what === 'pause' ? ['running', 'pending', 'failed', 'interrupted'] : ['running', 'pending', 'failed', 'interrupted', 'paused'];
  let run = await targetRun(h, job, key, open, what);
  for (let tries = 1; ; tries++) {
    if (run.status === 'deleting') throw beingDeleted(run, job, what);
    if (!open.includes(run.status)) {
      const was = run.status === 'succeeded' ? 'had already succeeded' : `is ${run.status}`;
      throw new UsageError('cannotControl', `run "${run.run_key}" of job "${job}" ${was}${tries > 1 ? ' (it changed while the request was made)' : ''}: nothing to ${what}`);
    }
    // A cancel is final: a pause written over it (which the compare-and-set below would allow)
    // would make the run resumable again. A cancel over a pending pause is fine: it is the stronger.
    if (what === 'pause' && run.requested === 'cancel') {
      throw new UsageError('cannotControl', `run "${run.run_key}" of job "${job}" has a cancel pending (it ends cancelled at its next chunk boundary, or its next invocation if nobody executes it): nothing to pause`);
    }
    const live = await isLive(h, run);
    const newStatus = live ? run.status : what === 'pause' ? 'paused' : 'cancelled';
    // Compare-and-set on what was read: a run that finished (or was taken over) in between is not
    // brought back to life; the request is re-decided on its new state instead. A run nobody
    // executes takes the status at once and keeps no request (a process starting in between bumps
    // the attempt first, which fails this compare-and-set: the request is then made to it, live).
    const { rows } = await sql<{ status: string }>`update ${t(h, 'runs')} set requested = ${live ? what : null}, status = ${newStatus}, updated_at = now(),
        finished_at = case when ${newStatus} = 'cancelled' then now() else finished_at end
      where id = ${run.id} and status = ${run.status} and attempt = ${run.attempt} and requested is not distinct from ${run.requested}
      returning status`.execute(h.db);
    if (rows[0]) return { job, runKey: run.run_key, status: rows[0].status, live, requested: live ? what : null };
    if (tries >= CAS_TRIES) throw new BusyError(`run "${run.run_key}" of job "${job}" kept changing while the ${what} was requested; try again`);
    run = await targetRun(h, job, run.run_key, open, what);
  }
}

/**
 * The channel a resume notifies on once it released a paused run to `interrupted` (payload:
 * `<schema> <run id>`): `idem serve` listens, and takes a run created over HTTP up at once rather
 * than at its next rescan (every 30 s).
 */
export const RUN_RELEASED = 'idem_run_released';

/**
 * Undoes a pause: the run becomes resumable (the next `idem run` or cron tick continues it). A run
 * paused after it failed (its error kept) is `failed` again, not `interrupted`: idem finalize runs
 * an interrupted run behind a deploy, and a failed one is resumed on purpose only.
 */
export async function resumeRun(h: OperationsHost, job: string, key?: string): Promise<ControlResult> {
  let run = await targetRun(h, job, key, ['paused'], 'resume', true);
  for (let tries = 1; ; tries++) {
    if (run.status === 'deleting') throw beingDeleted(run, job, 'resume');
    if (run.status !== 'paused' && !(run.status === 'running' && run.requested === 'pause')) {
      const what = `run "${run.run_key}" of job "${job}"`;
      // A row that says running with no process on it is what idem status calls crashed (until
      // 2026-12-04 this said "is running").
      if (run.status === 'running' && !(await isLive(h, run).catch(() => true))) {
        throw new UsageError('cannotControl', `${what} crashed (its row says running, but no process works it), not paused: nothing to resume; its next invocation (idem run ${job} --key ${run.run_key}) continues it`);
      }
      const olderPaused = key === undefined && run.status === 'running' ? (await sql<{ n: number }>`select count(*)::int as n from ${t(h, 'runs')} where job = ${job} and status = 'paused'`.execute(h.db)).rows[0]!.n > 0 : false;
      throw new UsageError(
        'cannotControl',
        `${what} is ${run.status}, not paused: nothing to resume${olderPaused ? ' (an older paused run is left alone while a run of the job is live: name it with --key)' : ''}`,
      );
    }
    const { rows } = await sql<{ status: string }>`update ${t(h, 'runs')}
      set status = case when status <> 'paused' then status when error is not null then 'failed' else 'interrupted' end, requested = null, updated_at = now()
      where id = ${run.id} and status = ${run.status} and attempt = ${run.attempt} and requested is not distinct from ${run.requested}
      returning status`.execute(h.db);
    // Released: a server executing runs created over HTTP hears it and takes the run up at once
    // (until 2026-12-04 at its next rescan). Best effort: the rescan still finds it.
    if (rows[0]?.status === 'interrupted') await sql`select pg_notify(${RUN_RELEASED}, ${`${h.schema} ${run.id}`})`.execute(h.db).catch(() => {});
    // A run with a pause pending whose worker died (crashed) is no live run: nobody goes on with it now.
    // (The resume took effect: a failed read of the locks only changes what is said, never the outcome.)
    if (rows[0]) return { job, runKey: run.run_key, status: rows[0].status, live: run.status === 'running' && (await isLive(h, run).catch(() => true)), requested: null };
    if (tries >= CAS_TRIES) throw new BusyError(`run "${run.run_key}" of job "${job}" kept changing while the resume was requested; try again`);
    run = await targetRun(h, job, run.run_key, ['paused'], 'resume', true);
  }
}

/**
 * A failed run made continuable again for an executor that is about to continue it (idem serve's
 * resume): `interrupted`, as a resumed paused run is, so a long-poll waits for the new attempt
 * instead of answering with the old failure. Compare-and-set on (failed, attempt); false when the
 * run changed in between (someone else continued it already).
 */
export async function reopenFailedRun(h: Pick<OperationsHost, 'db' | 'schema'>, runId: string, attempt: number): Promise<boolean> {
  const { rows } = await sql`update ${t(h, 'runs')} set status = 'interrupted', updated_at = now()
    where id = ${runId} and status = 'failed' and attempt = ${attempt} returning 1`.execute(h.db);
  return rows.length > 0;
}

/**
 * Forgets a run (its steps, chunk markers and effects) so the same key executes afresh. Takes the
 * run's own lock first, exclusively: every process working the run holds it (shared) for as long as
 * it does, so the rows can never be pulled from under a live run, and no process can enter the run
 * while it is being deleted. Only that run's lock: liveness is per run, and another run of the
 * same job being live does not make this one any less safe to forget.
 */
export async function resetRun(h: OperationsHost, job: string, key: string): Promise<{ chunks: number; effects: number }> {
  const run = await targetRun(h, job, key, [], 'reset');
  const what = `run "${key}" of job "${job}"`;
  const live = () => new BusyError(`${what} is running in another process; idem cancel ${job} --key ${key} first, or reset after it ends`);
  const lock = await acquireAdvisoryLock({ connectionString: h.connectionString, name: h.runLockName(run.id), what, wait: false }).catch(async (err: unknown) => {
    if (!(err instanceof BusyError)) throw err;
    // Workers hold the run's lock shared while they work it; prune or another reset, exclusively.
    if (await isLive(h, run)) throw live();
    throw new BusyError(beingDeletedMessage(what, 'try again once that has ended'));
  });
  try {
    // Holding the run's lock, no worker of this idem is on the run. A run under idem migrate's lock
    // (or an older idem's exclusive job lock) holds no run lock: the backend that took its attempt
    // is asked instead (runIsLive), on the row as it is now.
    const { rows: [now] } = await sql<RunRow>`select * from ${t(h, 'runs')} where id = ${run.id}`.execute(h.db);
    // Deleted (by prune, or another reset) between the read above and the lock.
    if (!now) throw new UsageError('unknownRun', `job "${job}" has no run with key ${quoteKey(key)} any more (it was deleted meanwhile); see idem status ${job} for its run keys`);
    if (runIsLive({ ...now, id: String(now.id) }, withoutPid(await h.heldLocks(), lock.pid), h)) throw live();
    // On the lock's own session: the delete can only happen while the lock is held.
    const [r] = await onLockSession(lock, h.db, sql<{ chunks: number; effects: number }>`
      with c as (select count(*)::int as n from ${t(h, 'chunks')} where run_id = ${run.id}),
           e as (select count(*)::int as n from ${t(h, 'effects')} where run_id = ${run.id}),
           d as (delete from ${t(h, 'runs')} where id = ${run.id} returning 1)
      select (select n from c) as chunks, (select n from e) as effects, (select count(*) from d) as deleted`);
    return { chunks: r!.chunks, effects: r!.effects };
  } finally {
    await lock.release();
  }
}

/**
 * Deletes finished runs (succeeded or cancelled) last touched before the cutoff, with their markers
 * and ledger rows, in bounded batches: a history of millions of chunk rows is removed without one
 * huge transaction or lock. Runs that are running, paused, failed or interrupted are never touched.
 *
 * A finished run can come back to life (`idem run --retry-skipped` revives a succeeded run with
 * skipped chunks), so each run is deleted holding its own lock exclusively, taken with a try-lock
 * and its state read again under it: a run some process holds (entering or working it) is skipped
 * and counted in `skipped`, and no process can enter a run while it is being deleted (it is busy,
 * exit 75, instead). Prune never waits for a worker, so it cannot deadlock with one, and a run it
 * starts deleting is deleted whole. The statements run on the lock's own session, so none of them
 * runs once that lock is lost.
 */
export async function pruneRuns(h: OperationsHost, olderThanMs: number, migrationKeys: readonly string[] = [], batch = PRUNE_BATCH): Promise<PruneResult> {
  const cutoff = new Date(Date.now() - olderThanMs).toISOString();
  const total = { runs: 0, steps: 0, chunks: 0, effects: 0, skipped: 0 };
  if (h.schemaExists === false) return total;
  // Runs an idem from before migration runs were marked recorded for the migrations folder's
  // files (their run keys, without params): marked first, so they are kept (idem migrate marks
  // them too). A job run with such a key and no params is kept as well: the safe side.
  if (migrationKeys.length > 0) {
    await sql`update ${t(h, 'runs')} set kind = 'migration'
      where kind <> 'migration' and run_key = any(${migrationKeys}::text[]) and params = '{}'::jsonb`.execute(h.db);
  }
  // Two prunes at once take turns: each would otherwise skip the runs the other is deleting.
  const lock = await acquireAdvisoryLock({ connectionString: h.connectionString, name: `${h.schema}:prune`, what: 'idem prune', wait: true });
  // A migration's run is never pruned: it is what makes the migration run once per database. Nor is
  // a job's latest slot run (its key a slot, schedule.ts's slotKey): the next tick, an `idem run`
  // without --key and an `idem cron` starting up run the latest due slot unless its run is there, so
  // pruning it ran that slot again (black-box round 17). A run marked deleting (by a prune killed
  // part way through it) goes whatever its age.
  const runs = t(h, 'runs');
  // Slot keys sort as their times, all of them between '0000' and '9999-99': the latest of a job's
  // is one step of a backward scan of the (job, run_key) index.
  const latestSlotRun = sql`(run_key ~ ${SLOT_KEY_SOURCE} and run_key = (select max(l.run_key) from ${runs} l
    where l.job = ${runs}.job and l.run_key between '0000' and '9999-99' and l.run_key ~ ${SLOT_KEY_SOURCE}))`;
  const prunable = sql`kind = 'job' and ((status in ('succeeded', 'cancelled') and coalesce(finished_at, updated_at) < ${cutoff}::timestamptz and not ${latestSlotRun}) or status = 'deleting')`;
  try {
    let after = '0';
    for (;;) {
      const { rows: runs } = await sql<{ id: string }>`select id from ${t(h, 'runs')}
        where ${prunable} and id > ${after}::bigint
        order by id limit 100`.execute(h.db);
      if (runs.length === 0) return total;
      for (const { id: rawId } of runs) {
        const id = String(rawId);
        after = id;
        const r = await deleteRunHeld(h, lock, id, prunable, batch);
        if (r === null) {
          total.skipped++;
          continue;
        }
        total.runs += r.runs;
        total.steps += r.steps;
        total.chunks += r.chunks;
        total.effects += r.effects;
      }
    }
  } finally {
    await lock.release();
  }
}

/** Chunk rows deleted per statement by prune: a history of millions goes without one huge transaction. */
const PRUNE_BATCH = 10_000;

/**
 * Deletes one run with its rows, on `lock`'s session (so none of it runs once that lock is lost),
 * holding the run's own lock exclusively, taken with a try-lock: null when another process holds
 * it (entering, working or deleting the run). Under that lock the run is read again (`still`: a
 * run revived since it was listed is not deletable any more; zero counts then) and marked
 * `deleting` in a statement of its own before its markers go in batches: a process killed between
 * batches leaves a run no one can revive or resume, which the next prune or a rerun of its key
 * finishes (finishDeletion).
 */
async function deleteRunHeld(h: OperationsHost, lock: HeldLock, id: string, still: RawBuilder<unknown>, batch = PRUNE_BATCH): Promise<Omit<PruneResult, 'skipped'> | null> {
  const onLock = <R extends Record<string, unknown>>(q: RawBuilder<R>) => onLockSession(lock, h.db, q);
  const runKey = lockKey(h.runLockName(id));
  const [got] = await onLock(sql<{ ok: boolean }>`select pg_try_advisory_lock(${runKey}::bigint) as ok`);
  if (!got!.ok) return null;
  try {
    const marked = await onLock(sql<{ id: string }>`update ${t(h, 'runs')} set status = 'deleting', updated_at = now() where id = ${id} and ${still} returning id`);
    if (marked.length === 0) return { runs: 0, steps: 0, chunks: 0, effects: 0 };
    let chunks = 0;
    for (;;) {
      const [deleted] = await onLock(sql<{ n: number }>`with d as (
          delete from ${t(h, 'chunks')} where ctid in (select ctid from ${t(h, 'chunks')} where run_id = ${id} limit ${batch}) returning 1)
        select count(*)::int as n from d`);
      chunks += deleted!.n;
      if (deleted!.n < batch) break;
    }
    const [r] = await onLock(sql<{ runs: number; steps: number; effects: number }>`
      with e as (delete from ${t(h, 'effects')} where run_id = ${id} returning 1),
           s as (delete from ${t(h, 'steps')} where run_id = ${id} returning 1),
           r as (delete from ${t(h, 'runs')} where id = ${id} returning 1)
      select (select count(*) from r)::int as runs, (select count(*) from s)::int as steps, (select count(*) from e)::int as effects`);
    return { ...r!, chunks };
  } finally {
    await onLock(sql<{ ok: boolean }>`select pg_advisory_unlock(${runKey}::bigint) as ok`);
  }
}

/**
 * Finishes deleting a run a prune marked `deleting` and did not get to delete whole (it was killed
 * between batches), so that its key runs afresh. Busy (exit 75) while another process holds the
 * run's lock: a prune or reset deleting it now.
 */
export async function finishDeletion(h: OperationsHost, runId: string, what: string): Promise<void> {
  const busy = () => new BusyError(beingDeletedMessage(what));
  // The run's own lock, exclusively; deleteRunHeld takes it once more on the same session.
  const lock = await acquireAdvisoryLock({ connectionString: h.connectionString, name: h.runLockName(runId), what, wait: false }).catch((err: unknown) => {
    throw err instanceof BusyError ? busy() : err;
  });
  try {
    if ((await deleteRunHeld(h, lock, runId, sql`status = 'deleting'`)) === null) throw busy();
  } finally {
    await lock.release();
  }
}

/** Parses `30d`, `12h`, `90m`, `2w`, `45s` into milliseconds. */
export function parseDuration(value: string, flag: string): number {
  const m = /^(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$/.exec(value.trim());
  if (!m) throw new UsageError('invalidDuration', `${flag} expects a duration such as 30d, 12h or 90m (units s, m, h, d, w; at most 36500d); got "${value}"`);
  const unit = { s: 1_000, m: 60_000, h: 3_600_000, d: 86_400_000, w: 604_800_000 }[m[2] as 's' | 'm' | 'h' | 'd' | 'w'];
  const ms = Number(m[1]) * unit;
  // Now minus more than that is no date (or is before anything idem recorded).
  if (!(ms <= MAX_DURATION_MS)) throw new UsageError('invalidDuration', `${flag} ${value} is longer than 100 years; give at most 36500d`);
  return ms;
}

/** The longest duration parseDuration takes: 100 years. */
const MAX_DURATION_MS = 36_500 * 86_400_000;
