import { sql, type Kysely, type QueryResult, type RawBuilder } from 'kysely';
import { createHash } from 'node:crypto';
import pg from 'pg';
import { boundedMessage } from './errors.ts';
import { retrying, waitingOnLocks } from './retry.ts';
import { WORKER } from './worker-identity.ts';
import type { ChunkSpec, Json } from './job.ts';
import type { CompiledSql, HeldLock } from './advisory-lock.ts';

export type RunStatus = 'pending' | 'running' | 'succeeded' | 'failed' | 'interrupted' | 'paused' | 'cancelled' | 'deleting';

export interface RunRow {
  id: string;
  job: string;
  run_key: string;
  params: Json;
  fingerprint: string;
  status: RunStatus;
  attempt: number;
  holder: string | null;
  created_at: Date;
  started_at: Date | null;
  updated_at: Date;
  finished_at: Date | null;
  summary: RunSummary | null;
  error: RunErrorInfo | null;
  attempt_started_at: Date | null;
  requested: 'pause' | 'cancel' | null;
  lock_name: string | null;
  lock_pid: number | null;
  code_fingerprint?: string | null;
  /** Code changes allowed (--allow-changed-code) on the run, oldest first. */
  code_changes?: Array<{ from: string; to: string; attempt: number; at: string }> | null;
  /** `migration`: recorded by idem migrate; prune keeps it. */
  kind?: 'job' | 'migration';
}

export interface StepRow {
  name: string;
  position: number;
  status: 'pending' | 'running' | 'done';
  cursor: Json | null;
  planned_all: boolean;
  planned: number;
  estimated_chunks: number | null;
}

/** How a chunk slot claims (Store.claimSql). */
export type ClaimMode = 'next' | 'wait' | 'retry';

export interface PendingChunk {
  seq: number;
  key: string;
  spec: ChunkSpec;
  /** `wait` claims only: the chunk is backing off from a transient error for this long yet (ms), else null. */
  backoffMs?: number | null;
}

/** A chunk's transient failures so far in the run's attempt, and the backoff before its next try (ms). */
export interface RetryCount {
  readonly tries: number;
  readonly delayMs: number;
}

/**
 * How long a chunk that failed for good (its retry budget ran out, or a permanent error) stays out
 * of every claim of the attempt: the worker whose try failed it fails the run (or skips the chunk)
 * meanwhile, on the connection the chunk ran on (no wait for the pool), and the others see the
 * run failed at their next control poll (1 s) instead of trying the chunk again. The hold is
 * written before the chunk's row lock is let go (Store.retrySql with `inClaim`). Should that
 * worker die first, another tries the chunk once more after this, and fails it for good at once.
 */
const EXHAUSTED_HOLD = "interval '10 seconds'";

/** Where an attempt (or a worker's share of it) starts. */
export interface AttemptStart {
  readonly attempt: number;
  readonly startedAt: Date;
  /** With a revive (`--retry-skipped`): how many skipped chunks run again, and which later steps run again, in order. */
  readonly revived?: { readonly chunks: number; readonly rerun: readonly string[] };
}

export function toAttemptStart(row: Record<string, unknown>): AttemptStart {
  const start = { attempt: Number(row.attempt), startedAt: row.started_at as Date };
  return 'revived_chunks' in row ? { ...start, revived: { chunks: Number(row.revived_chunks), rerun: row.rerun as string[] } } : start;
}

/** How planning a window ended (Store.planWindow). */
export type PlanResult =
  | { readonly kind: 'planned' }
  /** The run belongs to a newer attempt: this one must stop. */
  | { readonly kind: 'fenced' }
  /** A key of the window is already planned in the step (as chunk `seq`); nothing was written. */
  | { readonly kind: 'duplicate'; readonly key: string; readonly seq: number }
  /** The step was planned past `after` by someone else; nothing was written; `step` is where it is now. */
  | { readonly kind: 'moved'; readonly step: StepRow };

/** What a finished run reports, stored on the run and printed again by a no-op rerun. */
export interface RunSummary {
  readonly steps: ReadonlyArray<{ readonly name: string; readonly chunks: number }>;
  readonly chunks: number;
  /** Chunks that failed for good and were skipped under a step's `maxFailedChunks` policy. */
  readonly skipped: number;
  readonly attempts: number;
  readonly startedAt: string;
  readonly finishedAt: string;
  readonly durationMs: number;
  /**
   * Steps the run had that the job no longer has (removed under --allow-changed-code), with the
   * chunks each had planned and how many of them were done: their other chunks never ran. Absent
   * when there are none.
   */
  readonly dropped?: ReadonlyArray<{ readonly name: string; readonly chunks: number; readonly done: number }>;
}

/** What Store.failRun did: recorded the failure, or found the attempt failed by another worker, or over otherwise. */
export type FailRunResult =
  | { readonly kind: 'failed' }
  | { readonly kind: 'failedElsewhere'; readonly error: RunErrorInfo | null }
  | { readonly kind: 'ended'; readonly run: RunRow };

/** Where and why a run failed; stored on the run, shown by `idem status`. */
export interface RunErrorInfo {
  readonly step: string;
  readonly chunk: string | null;
  readonly tries: number;
  readonly message: string;
  /** The SQLSTATE (or the Node error's code), null when it has none (stored without it before 2026-12-04). */
  readonly code?: string | null;
  readonly at: string;
}

/** A stored run error with every field idem status and the API document: `code` null where it was left out. */
export function documentedError(error: RunErrorInfo | null | undefined): RunErrorInfo | null {
  return error ? { ...error, code: error.code ?? null } : null;
}

/**
 * Every statement idem issues against its own tables, in one place. Statements on the hot path
 * (one per chunk) are commented with why they look the way they do.
 */
export class Store {
  readonly schema: string;
  readonly #db: Kysely<any>;
  readonly #runs;
  readonly #steps;
  readonly #chunks;
  readonly #effects;
  readonly #claimPrepares: readonly string[];
  readonly #claimNames: Record<ClaimMode, string>;

  /** Every bookkeeping statement goes through here: idempotent, so transient errors are retried. */
  #run<R>(query: RawBuilder<R>, db: Kysely<any> = this.#db): Promise<QueryResult<R>> {
    return retrying(() => query.execute(db));
  }

  constructor(db: Kysely<any>, schema: string) {
    this.#db = db;
    this.schema = schema;
    this.#runs = sql.id(schema, 'runs');
    this.#steps = sql.id(schema, 'steps');
    this.#chunks = sql.id(schema, 'chunks');
    this.#effects = sql.id(schema, 'effects');
    // The schema name is a checked identifier (Runner.connect), so quoting it is enough.
    // The claim is the marker: it picks the step's first chunk that is neither done nor skipped nor
    // held by another transaction, marks it done by this attempt and worker, and returns it. The
    // row lock the UPDATE takes is the lease; the work and the mark commit together or not at all.
    // The attempt is checked here (so a fenced attempt starts nothing) and again at COMMIT by the
    // deferred fence trigger (migration 0008), which share-locks the run row, so a takeover's
    // attempt bump either waits for this commit or makes it fail.
    // `$4` lists seqs: the ones to pass by (next, wait), or the one to take again (retry).
    // A chunk backing off from a transient error (retry_at, set by whichever worker saw it fail)
    // is passed by until then; the `wait` claim takes it anyway and returns how long is left, so
    // a slot in its last pass waits for the backoff instead of ending the step without it.
    const claim = (pick: string, lock: string, returning = '') => `(bigint, integer, text, integer[]) as
      update "${schema}"."chunks" k set done_at = clock_timestamp(), done_attempt = $2, error = null,
        done_by = ${pg.Client.prototype.escapeLiteral(WORKER)}
      where k.done_at is null and (k.run_id, k.step, k.seq) = (select c.run_id, c.step, c.seq from "${schema}"."chunks" c
          where c.run_id = $1 and c.step = $3 and c.done_at is null and c.skipped_at is null and ${pick}
            and exists (select 1 from "${schema}"."runs" where id = $1 and attempt = $2)
          order by c.seq limit 1 ${lock})
      returning k.seq, k.key, k.spec${returning}`;
    const notBackingOff = '(c.retry_at is null or c.retry_at <= clock_timestamp() or c.retry_attempt <> $2)';
    const backoffLeft = `, case when k.retry_attempt = $2 and k.retry_at > clock_timestamp() then ceil(extract(epoch from k.retry_at - clock_timestamp()) * 1000)::int end as "backoffMs"`;
    // The `retry` claim takes the chunk whose backoff the slot slept even when the database's
    // clock says a little is left (a timer that fired early): it returns what is left, and the
    // slot waits that out instead of taking the chunk for done elsewhere and starting the next.
    const bodies: Record<ClaimMode, string> = {
      next: claim(`c.seq <> all($4) and ${notBackingOff}`, 'for update skip locked'),
      wait: claim('c.seq <> all($4)', 'for update', backoffLeft),
      retry: claim('c.seq = any($4)', 'for update skip locked', backoffLeft),
    };
    // Named after what they do, not only the mode: a session pooler that does not reset sessions can
    // hand this process a session where another idem version (or another schema, or another worker's
    // name) prepared a claim; under the same name idem would execute that one. The hash of the whole
    // text (schema and worker included) keeps each claim's name its own, within 63 bytes.
    const modes = Object.keys(bodies) as ClaimMode[];
    this.#claimNames = Object.fromEntries(modes.map((m) => [m, `idem_claim_${m}_${createHash('sha256').update(bodies[m]).digest('hex').slice(0, 16)}`])) as Record<ClaimMode, string>;
    this.#claimPrepares = modes.map((m) => `prepare ${this.#claimNames[m]}${bodies[m]}`);
  }

  /**
   * Claim-then-read in one statement: insert the run if it is new, else return the existing row.
   * A row inserted by a concurrent claimer after this statement's snapshot is invisible to the
   * second branch, so an empty result means "lost a race": read it again.
   */
  async claimRun(job: string, runKey: string, params: Json, fingerprint: string, kind: 'job' | 'migration' = 'job'): Promise<{ run: RunRow; created: boolean }> {
    for (let i = 0; i < 3; i++) {
      const { rows } = await this.#run(sql<RunRow & { created: boolean }>`
        with ins as (
          insert into ${this.#runs} (job, run_key, params, fingerprint, kind) values (${job}, ${runKey}, ${JSON.stringify(params)}::jsonb, ${fingerprint}, ${kind})
          on conflict (job, run_key) do nothing returning *
        )
        select *, true as created from ins
        union all
        select *, false as created from ${this.#runs} where job = ${job} and run_key = ${runKey} and not exists (select 1 from ins)`);
      const row = rows[0];
      if (row) {
        const { created, ...run } = row;
        return { run: normalizeRun(run), created };
      }
    }
    throw new Error(`could not claim run (${job}, ${runKey}): the row vanished three times in a row`);
  }

  /** The run with this id, or null when there is none (reset or pruned). */
  async runById(runId: string): Promise<RunRow | null> {
    const { rows } = await this.#run(sql<RunRow>`select * from ${this.#runs} where id = ${runId}`);
    return rows[0] ? normalizeRun(rows[0]) : null;
  }

  async getRun(runId: string): Promise<RunRow> {
    const run = await this.runById(runId);
    if (!run) throw new Error(`run ${runId} disappeared (was it reset while running?)`);
    return run;
  }

  /**
   * Marks a run as a migration's (idem migrate does, for runs an idem from before the mark
   * recorded), so that prune keeps it: a pruned migration would run again at the next deploy.
   */
  async markMigration(runId: string): Promise<void> {
    await this.#run(sql`update ${this.#runs} set kind = 'migration' where id = ${runId} and kind <> 'migration'`);
  }

  /**
   * Whether the database has a deferrable constraint (or constraint trigger) outside the runner's
   * schema, whose check a chunk's COMMIT could fail. Then chunks check them before COMMIT, inside
   * their transaction, so that a chunk failing there is held back like any other (ChunkSlot).
   */
  async hasDeferrableConstraints(): Promise<boolean> {
    // Another idem schema's fence trigger (a second install, a benchmark's baseline) is not one.
    const { rows } = await this.#run(sql<{ deferrable: boolean }>`select exists (select 1 from pg_constraint
      where condeferrable and connamespace <> (select oid from pg_namespace where nspname = ${this.schema})
        and not (contype = 't' and conname = 'chunk_fence')) as deferrable`);
    return rows[0]!.deferrable;
  }

  async findRun(job: string, runKey: string): Promise<RunRow | undefined> {
    const { rows } = await this.#run(sql<RunRow>`select * from ${this.#runs} where job = ${job} and run_key = ${runKey}`);
    return rows[0] && normalizeRun(rows[0]);
  }

  /**
   * Takes the run over: bumps the fencing token. Sent on the lock's own session, and only while that
   * session holds the lock, so a process whose lock session died cannot bump after a successor did
   * (and fence the successor off). Refuses (null) a run an operator paused or cancelled meanwhile.
   */
  async beginAttempt(runId: string, holder: string, lock: HeldLock, revive: readonly string[] | null = null): Promise<AttemptStart | null> {
    const q = this.beginAttemptSql(runId, holder, lock.name, lock.key, true, revive);
    const rows = await lock.query<Record<string, unknown>>(q.sql, q.parameters);
    return rows[0] ? toAttemptStart(rows[0]) : null;
  }

  /**
   * The attempt bump as a statement for the lock's session (also sent inside a worker's entry).
   * With `revive` (the job's step names, in order: `--retry-skipped`), the same statement makes the
   * run's skipped chunks pending again and reopens their steps; and every step of `revive` after the
   * first step with skipped chunks that had started is planned afresh: its chunk rows deleted
   * (skipped ones included) and its row back as a new step's, so it runs again after the retried
   * chunks, as if the job had run once. Its effects stay recorded (each is still performed once).
   * One statement with the bump, inside the entry gate: a worker joining the attempt sees the
   * revived run, never the run before it (it would find every step done and finish the run).
   */
  beginAttemptSql(runId: string, holder: string, lockName: string, lockKey: string, allowSucceeded: boolean, revive: readonly string[] | null = null): CompiledSql {
    const bump = sql`
      update ${this.#runs} set attempt = attempt + 1, status = 'running', holder = ${holder}, lock_name = ${lockName},
        lock_pid = pg_backend_pid(), started_at = coalesce(started_at, now()), updated_at = now(), error = null,
        -- A worker killed while the run waited for health left its pause: not this attempt's.
        health_pause = null,
        attempt_started_at = clock_timestamp() -- evaluated after any wait for the row lock
      where id = ${runId} and status not in ('paused', 'cancelled', 'deleting') and (status <> 'succeeded' or ${allowSucceeded})
        and exists (select 1 from pg_locks where locktype = 'advisory' and granted and pid = pg_backend_pid() and objsubid = 1
          and ((classid::bigint << 32) | objid::bigint) = ${lockKey}::bigint)
      returning attempt, started_at`;
    if (revive === null) return bump.compile(this.#db);
    return sql`
      with bump as (${bump}),
      first as (
        select min(s.position) as position from ${this.#steps} s
        where s.run_id = ${runId} and s.name = any(${[...revive]}::text[]) and exists (select 1 from bump)
          and exists (select 1 from ${this.#chunks} c where c.run_id = s.run_id and c.step = s.name and c.skipped_at is not null)
      ),
      later as (
        select s.name, s.position from ${this.#steps} s, first
        where s.run_id = ${runId} and s.position > first.position and s.name = any(${[...revive]}::text[])
          and (s.status <> 'pending' or exists (select 1 from ${this.#chunks} c where c.run_id = s.run_id and c.step = s.name))
      ),
      reset as (
        update ${this.#chunks} set skipped_at = null
        where run_id = ${runId} and skipped_at is not null and exists (select 1 from bump) and step not in (select name from later)
        returning step
      ),
      wiped as (
        delete from ${this.#chunks} where run_id = ${runId} and step in (select name from later)
        returning skipped_at
      ),
      reopen as (
        update ${this.#steps} set status = 'running', finished_at = null
        where run_id = ${runId} and name in (select step from reset) returning 1
      ),
      fresh as (
        update ${this.#steps} set status = 'pending', cursor = null, planned_all = false, planned = 0, started_at = null,
          finished_at = null, estimated_chunks = null, rate_next = null, rate_attempt = null, rate_interval_ms = null
        where run_id = ${runId} and name in (select name from later) returning 1
      )
      select attempt, started_at,
        (select count(*) from reset)::int + (select count(skipped_at) from wiped)::int as revived_chunks,
        array(select name from later order by position) as rerun,
        (select count(*) from reopen) as reopened, (select count(*) from fresh) as refreshed
      from bump`.compile(this.#db);
  }

  /** What a worker joining a live run works under: the attempt its first worker took. */
  joinAttemptSql(runId: string): CompiledSql {
    return sql`select attempt, started_at from ${this.#runs}
      where id = ${runId} and status = 'running'`.compile(this.#db);
  }

  /** Creates the step rows a run has not seen yet and returns all of them, in order. */
  async loadSteps(runId: string, names: readonly string[]): Promise<Map<string, StepRow>> {
    const { rows } = await this.#run(sql<StepRow>`
      with ins as (
        insert into ${this.#steps} (run_id, name, position)
        select ${runId}, name, ord::int from unnest(${names}::text[]) with ordinality as u(name, ord)
        on conflict (run_id, name) do nothing returning name, position, status, cursor, planned_all, planned, estimated_chunks
      )
      select name, position, status, cursor, planned_all, planned, estimated_chunks from ins
      union all
      select name, position, status, cursor, planned_all, planned, estimated_chunks from ${this.#steps} where run_id = ${runId}
      order by position`);
    const found = new Map(rows.map((r) => [r.name, r]));
    if (names.every((n) => found.has(n))) return found;
    // Workers joining one run insert its steps at once: a row another worker inserted after this
    // statement's snapshot was skipped by the insert (conflict) yet is invisible to the select.
    // A new statement sees it.
    const { rows: again } = await this.#run(sql<StepRow>`
      select name, position, status, cursor, planned_all, planned, estimated_chunks from ${this.#steps} where run_id = ${runId} order by position`);
    return new Map(again.map((r) => [r.name, r]));
  }

  /**
   * Persists one planned window and the cursor after it, all or nothing, in one statement:
   * - the step row is locked (`for update`), so planning is single-writer per step, and the run row
   *   is share-locked with its attempt checked, so a zombie attempt can neither add chunks nor move
   *   the cursor, and a takeover's attempt bump waits for this commit;
   * - `after` is the planned count the caller planned from (compare-and-set): if the step moved on
   *   meanwhile, nothing is written and the caller re-reads the step;
   * - a key that is already planned in this step writes nothing at all: no chunk rows, no cursor, no
   *   count, so the window is asked for again after the source is fixed, and seqs stay dense.
   * Retried as a whole after a lost connection; a retry that finds its own window committed (the
   * acknowledgement was lost) reports it as planned. Sent again when the statement_timeout or
   * lock_timeout cuts it short as it waits for the step row (waitingOnLocks; `onWait` is told),
   * until `stop` aborts: then its reason is thrown at the next cut.
   */
  planWindow(runId: string, attempt: number, step: string, after: number, chunks: readonly ChunkSpec[], next: Json | null, onWait?: (err: unknown, tries: number) => void, stop?: AbortSignal): Promise<PlanResult> {
    return waitingOnLocks(() => this.#planWindow(runId, attempt, step, after, chunks, next), onWait, stop);
  }

  async #planWindow(runId: string, attempt: number, step: string, after: number, chunks: readonly ChunkSpec[], next: Json | null): Promise<PlanResult> {
    const keys = chunks.map((c) => c.key);
    const payload = JSON.stringify(chunks.map((c, i) => ({ key: c.key, seq: after + 1 + i, spec: c })));
    // The usual case in one statement, one round trip (six as a transaction of its own: most of
    // what planning cost the runner's Node CPU, a window every 100 chunks). Its snapshot is taken
    // before the step row's lock is waited for: a planner that committed meanwhile moved `planned`
    // (the locked row is re-read at its newest), so `go` is empty, nothing is written, and the
    // transaction below, with snapshots of its own, tells "moved" from "ours, acknowledgement lost".
    const { rows: [row] } = await this.#run(sql<StepRow & { current: boolean; dup_key: string | null; dup_seq: number | null; written: boolean }>`
      with s as (
        select s.name, s.position, s.status, s.cursor, s.planned_all, s.planned, s.estimated_chunks, r.attempt = ${attempt} as current
        from ${this.#runs} r join ${this.#steps} s on s.run_id = r.id
        where r.id = ${runId} and s.name = ${step}
        for share of r for update of s),
      go as (select 1 from s where current and planned = ${after}),
      dup as (select key, seq from ${this.#chunks} where run_id = ${runId} and step = ${step} and key = any(${keys}::text[]) and exists (select 1 from go) order by seq limit 1),
      ok as (select 1 from go where not exists (select 1 from dup)),
      ins as (insert into ${this.#chunks} (run_id, step, key, seq, spec)
        select ${runId}, ${step}, x.key, x.seq, x.spec from jsonb_to_recordset(${payload}::jsonb) as x(key text, seq int, spec jsonb) where exists (select 1 from ok)),
      upd as (update ${this.#steps} set cursor = ${JSON.stringify(next)}::jsonb, planned_all = ${next === null},
          planned = ${after + keys.length}, status = 'running', started_at = coalesce(started_at, now())
        where run_id = ${runId} and name = ${step} and exists (select 1 from ok) returning 1)
      select s.*, (select key from dup) as dup_key, (select seq from dup) as dup_seq, exists (select 1 from upd) as written from s`);
    if (!row || !row.current) return { kind: 'fenced' };
    if (row.written) return { kind: 'planned' };
    if (row.dup_key !== null) return { kind: 'duplicate', key: row.dup_key, seq: Number(row.dup_seq) };
    return retrying(() =>
      this.#db.transaction().execute(async (trx): Promise<PlanResult> => {
        const { rows: [row] } = await sql<StepRow & { current: boolean }>`
          select s.name, s.position, s.status, s.cursor, s.planned_all, s.planned, s.estimated_chunks, r.attempt = ${attempt} as current
          from ${this.#runs} r join ${this.#steps} s on s.run_id = r.id
          where r.id = ${runId} and s.name = ${step}
          for share of r for update of s`.execute(trx);
        if (!row || !row.current) return { kind: 'fenced' };
        const { current: _, ...stepRow } = row;
        if (row.planned === after) return { kind: 'moved', step: stepRow }; // back where it was: plan it again
        const { rows } = await sql<{ key: string }>`select key from ${this.#chunks}
          where run_id = ${runId} and step = ${step} and seq > ${after} and seq <= ${after + keys.length} order by seq`.execute(trx);
        const ours = rows.length === keys.length && rows.every((r, i) => r.key === keys[i]) && row.planned === after + keys.length;
        return ours ? { kind: 'planned' } : { kind: 'moved', step: stepRow };
      }),
    );
  }

  /** The PREPAREs a chunk slot's session needs once (chunk-slot.ts). */
  get claimPrepares(): readonly string[] {
    return this.#claimPrepares;
  }

  /**
   * A chunk transaction's first statement, and the only one idem adds to it: claims and marks a
   * chunk (see the constructor), or returns no row when there is nothing to claim. An `EXECUTE`
   * with literal values, so it travels in one message with the BEGIN (chunk-slot.ts).
   * - `next`: the first free chunk, passing by those in `seqs` and those other transactions hold;
   * - `wait`: the first unfinished chunk not in `seqs`, waiting for a transaction that holds it;
   * - `retry`: the chunk `seqs[0]`, if it is still free.
   */
  claimSql(mode: ClaimMode, runId: string, attempt: number, step: string, seqs: readonly number[]): string {
    if (!/^\d+$/.test(runId) || !Number.isSafeInteger(attempt) || !seqs.every((n) => Number.isSafeInteger(n))) throw new TypeError('claim values must be integers');
    return `execute ${this.#claimNames[mode]}(${runId}, ${attempt}, ${pg.Client.prototype.escapeLiteral(step)}, '{${seqs.join(',')}}')`;
  }

  /**
   * What became of a chunk whose COMMIT got no answer (connection lost): committed by this attempt
   * and worker, or not (then it is free again, and whoever claims it next runs it).
   */
  async committedByUs(runId: string, attempt: number, step: string, seq: number): Promise<boolean> {
    const { rows } = await this.#run(sql<{ ours: boolean }>`
      select done_attempt = ${attempt} and done_by = ${WORKER} as ours from ${this.#chunks}
      where run_id = ${runId} and step = ${step} and seq = ${seq}`);
    return rows[0]?.ours === true;
  }

  /**
   * Counts a transient failure of a chunk (outside its rolled-back transaction), on the chunk, so
   * that every worker of the run spends one budget (`delays.length` tries): returns the run
   * attempt's tries so far and the backoff before the next (`delays[tries - 1]`, ms), which
   * `next` claims wait out and `wait` claims report; once the budget is spent, see
   * EXHAUSTED_HOLD. Null when the chunk is no longer pending (done or skipped by another worker
   * meanwhile) or the attempt was fenced off.
   */
  async recordRetry(runId: string, attempt: number, step: string, seq: number, message: string, delays: readonly number[], db?: Kysely<any>, final = false): Promise<RetryCount | null> {
    const { rows } = await this.#run(sql.raw<RetryCount>(this.retrySql(runId, attempt, step, seq, message, delays, { final })), db);
    return rows[0] ?? null;
  }

  /**
   * {@link recordRetry}'s statement, values inlined. With `inClaim` it is sent by the failing slot
   * inside the chunk's own transaction, rolled back to just after the claim (ChunkSlot.abandonWith):
   * it then also undoes the claim's marker, and it commits before the claim's row lock is let go,
   * so no other slot or worker can start a try in between that the budget does not see. With
   * `final` the chunk failed for good whatever the budget says (a permanent error): it is held
   * back for EXHAUSTED_HOLD at once, while the failing slot skips it or fails the run.
   */
  retrySql(runId: string, attempt: number, step: string, seq: number, message: string, delays: readonly number[], how: { readonly inClaim?: boolean; readonly final?: boolean } = {}): string {
    if (!/^\d+$/.test(runId) || !Number.isSafeInteger(attempt) || !Number.isSafeInteger(seq)) throw new TypeError('retry values must be integers');
    const lit = (v: string) => pg.Client.prototype.escapeLiteral(v);
    const ms = delays.map((d) => Math.max(0, Math.min(2 ** 31 - 1, Math.round(d))));
    const tries = `(case when retry_attempt = ${attempt} then retry_tries + 1 else 1 end)`;
    const exhausted = how.final ? 'true' : `${tries} >= ${ms.length}`;
    return `update "${this.schema}"."chunks" set retry_tries = ${tries}, retry_attempt = ${attempt}, error = ${lit(boundedMessage(message))},
        ${how.inClaim ? 'done_at = null, done_attempt = null, done_by = null,' : ''}
        retry_at = clock_timestamp() + case when ${exhausted} then ${EXHAUSTED_HOLD}
          else ('{${ms.join(',')}}'::int[])[${tries}] * interval '1 millisecond' end
      where run_id = ${runId} and step = ${lit(step)} and seq = ${seq} and ${how.inClaim ? `done_attempt = ${attempt} and done_by = ${lit(WORKER)}` : 'done_at is null'} and skipped_at is null
        and exists (select 1 from "${this.schema}"."runs" where id = ${runId} and attempt = ${attempt})
      returning retry_tries as tries, greatest(0, ceil(extract(epoch from retry_at - clock_timestamp()) * 1000))::int as "delayMs"`;
  }

  /**
   * `--max-rate` across every worker of the run: reserves the step's next start, `intervalMs`
   * after the one reserved before it (no earlier than now: idle time is not banked), and returns
   * how long to wait for it (ms).
   */
  async reserveStart(runId: string, attempt: number, step: string, intervalMs: number): Promise<number> {
    const gap = sql`${intervalMs}::float8 * interval '1 millisecond'`;
    // Reservations made by this attempt at this interval queue up (every worker and slot of the
    // attempt spaced one interval apart). Those of an earlier attempt (interrupted, failed: the
    // starts they reserved never happen) or made at another rate are not this schedule's: they
    // delay the start by one interval of the current rate at most, so a rerun with a higher
    // --max-rate does not wait out the old rate's schedule, nor one at the same rate an extra
    // interval for a start that never happened.
    const { rows } = await this.#run(sql<{ wait: number }>`
      with now as (select clock_timestamp() as t)
      update ${this.#steps} set
        rate_next = case
          when rate_attempt = ${attempt} and rate_interval_ms = ${intervalMs}::float8 then greatest(rate_next, now.t)
          else least(greatest(rate_next, now.t), now.t + ${gap})
        end + ${gap},
        rate_attempt = ${attempt},
        rate_interval_ms = ${intervalMs}::float8
      from now
      where run_id = ${runId} and name = ${step}
      returning greatest(0, extract(epoch from rate_next - ${gap} - now.t) * 1000)::float8 as wait`);
    return rows[0]?.wait ?? 0;
  }

  /** The run's current attempt (-1 when the run is gone): why a claim or a commit was refused. */
  async currentAttempt(runId: string): Promise<number> {
    const { rows } = await this.#run(sql<{ attempt: number }>`select attempt from ${this.#runs} where id = ${runId}`);
    return rows[0]?.attempt ?? -1;
  }

  /**
   * Records a failed try of a chunk (outside its rolled-back transaction). `db`: where to send it
   * (a chunk slot's own connection, ChunkSlot.db); defaults to the work pool.
   */
  async recordChunkFailure(runId: string, step: string, key: string, tries: number, message: string, db?: Kysely<any>): Promise<void> {
    await this.#run(sql`update ${this.#chunks} set attempts = attempts + ${tries}, error = ${message}
      where run_id = ${runId} and step = ${step} and key = ${key}`, db);
  }

  /**
   * Records a chunk that failed for good as skipped, if the step's skip budget (`max`, counted over
   * the whole run, every worker and slot) allows it; fenced. The step row is locked so two workers
   * skipping at once cannot both take the last place, and a chunk already skipped (another slot or
   * worker claimed it again between its rollback and its skip) is not counted a second time.
   * `skipped` is the step's count of skipped chunks afterwards. `db`: where to send it (a chunk
   * slot's own connection, ChunkSlot.db); defaults to the work pool.
   */
  async skipChunk(runId: string, attempt: number, step: string, key: string, message: string, max: number, db: Kysely<any> = this.#db): Promise<{ readonly kind: 'skipped' | 'already' | 'over' | 'fenced'; readonly skipped: number }> {
    // The tries were counted already, by recordChunkFailure when the chunk failed for good.
    // Waits for the step row: sent again when a timeout cuts that wait short (waitingOnLocks).
    return waitingOnLocks(() => retrying(() =>
      db.transaction().execute(async (trx) => {
        const { rows: [row] } = await sql<{ current: boolean }>`
          select r.attempt = ${attempt} as current
          from ${this.#runs} r join ${this.#steps} s on s.run_id = r.id
          where r.id = ${runId} and s.name = ${step}
          for share of r for update of s`.execute(trx);
        if (!row || !row.current) return { kind: 'fenced' as const, skipped: 0 };
        const { rows: [c] } = await sql<{ skipped: number; settled: boolean }>`
          select count(skipped_at)::int as skipped,
            coalesce(bool_or(key = ${key} and (skipped_at is not null or done_at is not null)), false) as settled
          from ${this.#chunks} where run_id = ${runId} and step = ${step}`.execute(trx);
        if (c!.settled) return { kind: 'already' as const, skipped: c!.skipped };
        if (c!.skipped >= max) return { kind: 'over' as const, skipped: c!.skipped };
        await sql`update ${this.#chunks} set skipped_at = now(), error = ${message}
          where run_id = ${runId} and step = ${step} and key = ${key} and done_at is null and skipped_at is null`.execute(trx);
        return { kind: 'skipped' as const, skipped: c!.skipped + 1 };
      }),
    ));
  }

  /** How many of a step's chunks are done and skipped (progress at a step's start). */
  /**
   * How far a step is, as every worker of the run sees it: chunks done (planned ones not pending:
   * counted through the pending index, a window's worth, not the step's whole chunk list) and
   * planned. For progress lines of a shared run.
   */
  async stepProgress(runId: string, step: string): Promise<{ done: number; planned: number; plannedAll: boolean } | undefined> {
    const { rows } = await this.#run(sql<{ done: number; planned: number; planned_all: boolean }>`select s.planned - (select count(*)::int from ${this.#chunks} c
        where c.run_id = s.run_id and c.step = s.name and c.done_at is null) as done, s.planned, s.planned_all
      from ${this.#steps} s where s.run_id = ${runId} and s.name = ${step}`);
    const r = rows[0];
    return r && { done: r.done, planned: r.planned, plannedAll: r.planned_all };
  }

  /** Whether every chunk of the step is planned and done or skipped: nothing of it is left to run. */
  async stepComplete(runId: string, step: string): Promise<boolean> {
    const { rows } = await this.#run(sql<{ complete: boolean }>`select s.planned_all and not exists (select 1 from ${this.#chunks} c
        where c.run_id = s.run_id and c.step = s.name and c.done_at is null and c.skipped_at is null) as complete
      from ${this.#steps} s where s.run_id = ${runId} and s.name = ${step}`);
    return rows[0]?.complete === true;
  }

  /** Keys of the step's chunks neither done nor skipped, first `limit` by seq: what an error about them names. */
  async pendingKeys(runId: string, step: string, limit: number): Promise<string[]> {
    const { rows } = await this.#run(sql<{ key: string }>`select key from ${this.#chunks}
      where run_id = ${runId} and step = ${step} and done_at is null and skipped_at is null order by seq limit ${limit}`);
    return rows.map((r) => r.key);
  }

  async stepCounts(runId: string, step: string): Promise<{ done: number; skipped: number }> {
    const { rows } = await this.#run(sql<{ done: number; skipped: number }>`select count(done_at)::int as done, count(skipped_at)::int as skipped
      from ${this.#chunks} where run_id = ${runId} and step = ${step}`);
    return rows[0]!;
  }

  /** Skipped chunks of a run with their errors, for `idem status`. */
  async skippedChunks(runId: string, limit = 20, db?: Kysely<any>): Promise<Array<{ step: string; key: string; error: string | null; attempts: number }>> {
    const query = sql<{ step: string; key: string; error: string | null; attempts: number }>`
      select step, key, error, attempts from ${this.#chunks}
      where run_id = ${runId} and skipped_at is not null order by step, seq limit ${limit}`;
    // In a caller's transaction (a status snapshot) it runs once, not retried on a new connection.
    const { rows } = db ? await query.execute(db) : await this.#run(query);
    return rows;
  }

  /**
   * Claims an effect in the ledger (outside any chunk transaction, so the record survives the
   * chunk's rollback): new or still `started` → returns it to perform (tries counted); `done` →
   * returns its recorded result, and the caller must not perform it again.
   */
  async beginEffect(runId: string, attempt: number, step: string, chunk: string, name: string, idemKey: string): Promise<{ status: 'started' | 'done'; result: Json | null; tries: number } | null> {
    // Fenced like the marker: an attempt that lost the run starts no effect (null).
    const { rows } = await this.#run(sql<{ status: 'started' | 'done'; result: Json | null; tries: number }>`
      with fence as (select 1 from ${this.#runs} where id = ${runId} and attempt = ${attempt} for share),
      up as (
        insert into ${this.#effects} (run_id, step, chunk, name, idem_key)
        select ${runId}, ${step}, ${chunk}, ${name}, ${idemKey} where exists (select 1 from fence)
        on conflict (run_id, step, chunk, name) do update set tries = ${this.#effects}.tries + 1, started_at = now()
          where ${this.#effects}.status = 'started'
        returning status, result, tries
      )
      select * from up
      union all
      select status, result, tries from ${this.#effects}
      where run_id = ${runId} and step = ${step} and chunk = ${chunk} and name = ${name} and not exists (select 1 from up)
        and exists (select 1 from fence)`);
    return rows[0] ?? null;
  }

  async completeEffect(runId: string, step: string, chunk: string, name: string, result: Json | null): Promise<void> {
    await this.#run(sql`update ${this.#effects} set status = 'done', result = ${JSON.stringify(result)}::jsonb, done_at = now()
      where run_id = ${runId} and step = ${step} and chunk = ${chunk} and name = ${name}`);
  }

  /** Stores a chunk source's estimate of its total chunk count (progress and ETA). */
  async setEstimate(runId: string, step: string, estimate: number): Promise<void> {
    await waitingOnLocks(() => this.#run(sql`update ${this.#steps} set estimated_chunks = ${estimate} where run_id = ${runId} and name = ${step}`));
  }

  /** What a live worker watches between chunks: an operator's request, and the run's status. */
  async control(runId: string): Promise<{ requested: 'pause' | 'cancel' | null; status: RunStatus | null; error: RunErrorInfo | null }> {
    const { rows } = await this.#run(sql<{ requested: 'pause' | 'cancel' | null; status: RunStatus; error: RunErrorInfo | null }>`
      select requested, status, error from ${this.#runs} where id = ${runId}`);
    return rows[0] ?? { requested: null, status: null, error: null };
  }


  async finishStep(runId: string, attempt: number, step: string): Promise<void> {
    // Once: a worker that finds the step done by another keeps its finish time. Waits for the
    // step row (a planner's, a skip's): sent again when a timeout cuts that wait short.
    await waitingOnLocks(() =>
      this.#run(sql`update ${this.#steps} set status = 'done', finished_at = now()
        where run_id = ${runId} and name = ${step} and status <> 'done'
          and exists (select 1 from ${this.#runs} where id = ${runId} and attempt = ${attempt})`),
    );
  }

  /** Marks the run succeeded with its summary; fenced, so only the live attempt can. */
  async finishRun(runId: string, attempt: number, startedAt: Date, steps: readonly string[], code: string | null = null): Promise<RunSummary | null> {
    // `code`: the finishing worker's code fingerprint. A worker whose code is no longer the run's
    // (another joined under other code, allowed) finished only its own steps, not necessarily the
    // run's: it may not end the run (null), the workers under the run's code do.
    // `steps`: the job's steps now. A step the run has rows of that the job no longer has (removed
    // under --allow-changed-code) is not counted: it is listed as dropped, with what it left undone.
    const { rows } = await this.#run(sql<{ summary: RunSummary }>`
      with all_counts as (
        select s.name, s.position, count(c.key)::int as chunks, count(c.skipped_at)::int as skipped, count(c.done_at)::int as done,
          s.name = any(${[...steps]}::text[]) as current
        from ${this.#steps} s left join ${this.#chunks} c on c.run_id = s.run_id and c.step = s.name
        where s.run_id = ${runId} group by s.name, s.position
      ), counts as (select * from all_counts where current),
      finished as (
        update ${this.#runs} r set status = 'succeeded', finished_at = now(), updated_at = now(), holder = null, error = null,
          -- A pause or cancel that came while the last chunks ran has nothing left to stop.
          requested = null,
          summary = jsonb_build_object(
            'steps', (select coalesce(jsonb_agg(jsonb_build_object('name', name, 'chunks', chunks) order by position), '[]') from counts),
            'chunks', (select coalesce(sum(chunks), 0)::int from counts),
            'skipped', (select coalesce(sum(skipped), 0)::int from counts),
            'attempts', r.attempt,
            -- As JavaScript's toISOString() writes every other time idem prints: UTC, milliseconds, Z
            -- (to_jsonb of a timestamptz follows the session's TimeZone and keeps microseconds).
            'startedAt', ${startedAt.toISOString()}::text,
            'finishedAt', to_char(now() at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"'),
            'durationMs', (extract(epoch from (now() - ${startedAt.toISOString()}::timestamptz)) * 1000)::bigint)
            || coalesce((select jsonb_build_object('dropped', jsonb_agg(jsonb_build_object('name', name, 'chunks', chunks, 'done', done) order by position))
                 from all_counts where not current having count(*) > 0), '{}')
        where r.id = ${runId} and r.attempt = ${attempt} and r.status = 'running'
          and (${code}::text is null or r.code_fingerprint is null or r.code_fingerprint = ${code}::text)
        returning r.summary
      ),
      -- A dropped step's planning is over with the run (when this statement finished it): idem
      -- status shows no \`~\` for it.
      dropped_planned as (
        update ${this.#steps} s set planned_all = true
        where s.run_id = ${runId} and not s.planned_all and not (s.name = any(${[...steps]}::text[])) and exists (select 1 from finished)
      )
      select summary from finished`);
    return rows[0]?.summary ?? null;
  }

  /**
   * How an attempt ends when it did not succeed: the one statement behind endRun, failRun and
   * interruptRunSql. An operator's pause or cancel that the attempt had not acted on yet (it stopped
   * for a signal first) is honoured: the run ends paused or cancelled instead of interrupted, so no
   * later invocation starts work the operator stopped. A failed run keeps the request, and the next
   * invocation honours it before any work (Store.endByPendingRequest). A compare-and-set on the run
   * still `running` under this attempt: a run that ended meanwhile (succeeded, failed, paused,
   * cancelled, interrupted, often in another worker sharing it) or that a newer attempt took over is
   * left as it is. A worker that comes back late (its process was stopped, its session ended by the
   * server) cannot rewrite how the run ended.
   */
  #endAttempt(runId: string, attempt: number, status: 'failed' | 'interrupted' | 'paused' | 'cancelled', error: RunErrorInfo | null): RawBuilder<unknown> {
    const next =
      status === 'interrupted' ? sql`case requested when 'pause' then 'paused' when 'cancel' then 'cancelled' else 'interrupted' end` : sql`${status}::text`;
    return sql`update ${this.#runs} set status = ${next}, updated_at = now(), holder = null,
        requested = ${status === 'failed' ? sql`requested` : sql`null`},
        error = ${error === null ? null : JSON.stringify(error)}::jsonb,
        finished_at = case when ${next} = 'cancelled' then now() else finished_at end
      where id = ${runId} and attempt = ${attempt} and status = 'running'`;
  }

  /**
   * Ends a run that no worker executes by the pause or cancel an operator requested while its last
   * worker was alive, when that worker died (or failed) before acting on it: called by the next
   * invocation under the run's lock, before any work. Compare-and-set on what was read; returns the
   * new status, or null when the run changed meanwhile (a resume withdrew the request).
   */
  async endByPendingRequest(runId: string, attempt: number, status: string, requested: 'pause' | 'cancel'): Promise<'paused' | 'cancelled' | null> {
    const { rows } = await this.#run(sql<{ status: 'paused' | 'cancelled' }>`update ${this.#runs}
      set status = case requested when 'pause' then 'paused' else 'cancelled' end, requested = null, holder = null, updated_at = now(),
        finished_at = case when requested = 'cancel' then now() else finished_at end
      where id = ${runId} and attempt = ${attempt} and status = ${status} and requested = ${requested}
      returning status`);
    return rows[0]?.status ?? null;
  }

  /**
   * Ends the attempt `interrupted`, or by the operator's request as it stands now (#endAttempt), and
   * returns the run's status and attempt after it. A live attempt that stopped for a request ends by
   * the request as it stands then, not as its poll saw it: a resume may have withdrawn the pause
   * while the in-flight chunks finished (then the run is `interrupted`, the state a resumed paused
   * run has), and a later pause or cancel replaces an earlier one. The first worker of a shared
   * attempt decides; the others read what it wrote.
   */
  async endInterrupted(runId: string, attempt: number): Promise<{ status: RunStatus; attempt: number } | null> {
    const { rows } = await this.#run(sql<{ status: RunStatus; attempt: number }>`
      with ended as (${this.#endAttempt(runId, attempt, 'interrupted', null)} returning status, attempt)
      select status, attempt from ended
      union all select status, attempt from ${this.#runs} where id = ${runId} and not exists (select 1 from ended)`);
    return rows[0] ?? null;
  }

  /** The statement of `endRun(runId, attempt, 'interrupted', null)`, for the lock's session. */
  interruptRunSql(runId: string, attempt: number): CompiledSql {
    return this.#endAttempt(runId, attempt, 'interrupted', null).compile(this.#db);
  }

  /** Records how the run ended when it did not succeed (failed or interrupted), if it is still running under `attempt`. */
  async endRun(runId: string, attempt: number, status: 'failed' | 'interrupted' | 'paused' | 'cancelled', error: RunErrorInfo | null): Promise<void> {
    await this.#run(this.#endAttempt(runId, attempt, status, error));
  }

  /**
   * Records the attempt failed, if the run is still running under it (compare-and-set, see
   * #endAttempt). Otherwise says why not: another worker of the attempt failed it first (its
   * error stays the recorded one), or the run ended otherwise or belongs to a newer attempt
   * (`ended`, with the run as it is now).
   */
  async failRun(runId: string, attempt: number, error: RunErrorInfo): Promise<FailRunResult> {
    const { rows } = await this.#run(sql`${this.#endAttempt(runId, attempt, 'failed', error)} returning 1`);
    if (rows.length > 0) return { kind: 'failed' };
    // Not written: read the run in a statement of its own, which sees what the other worker wrote
    // even when the two updates met on the row lock.
    const run = await this.getRun(runId);
    if (run.status === 'failed' && run.attempt === attempt) return { kind: 'failedElsewhere', error: run.error };
    return { kind: 'ended', run };
  }

  /** Chunks this process (WORKER) committed in the run's attempt. */
  async committedByWorker(runId: string, attempt: number): Promise<number> {
    const { rows } = await this.#run(sql<{ n: number }>`select count(*)::int as n from ${this.#chunks}
      where run_id = ${runId} and done_attempt = ${attempt} and done_by = ${WORKER}`);
    return rows[0]?.n ?? 0;
  }
}

/** pg returns int8 as text; the run id stays a string, counters become numbers. */
function normalizeRun(row: RunRow): RunRow {
  return { ...row, id: String(row.id), attempt: Number(row.attempt) };
}

export type { Json };
