import { sql, type Kysely, type RawBuilder } from 'kysely';
import type pg from 'pg';
import { changedCode, short } from '../code-fingerprint.ts';
import type { Job, Json } from '../job.ts';
import { continueCommand } from '../shell-quote.ts';
import { printable } from './claim-request.ts';
import { doneChunks, lastChange, runIsLive, stalledSeconds, type HeldLocks, type OperationsHost } from '../operations.ts';
import { documentedError, type RunErrorInfo, type RunStatus, type RunSummary } from '../store.ts';
import { shownStepState } from '../step-state.ts';

/** How liveness is decided: the runner's lock names (the held locks are read on the read pool). */
export type LockHost = Pick<OperationsHost, 'jobLockName' | 'runLockName'>;

/** A step of a run as the API shows it. */
export interface StepView {
  readonly name: string;
  /** 'pending', 'running' or 'done'; where a run nobody executes stopped (failed, paused, crashed…), the run's state (see step-state.ts). */
  readonly status: string;
  readonly done: number;
  readonly planned: number;
  readonly plannedAll: boolean;
  readonly estimated: number | null;
}

/** A run as `GET /api/runs/:id` returns it (and every other endpoint that returns a run). */
export interface RunView {
  readonly id: string;
  readonly job: string;
  /** The run key: the Idempotency-Key it was created with over HTTP. */
  readonly key: string;
  /** `running` only while a process holds the job's lock; a dead run's row says `crashed`. */
  readonly state: string;
  readonly attempt: number;
  readonly holder: string | null;
  readonly params: Json;
  readonly fingerprint: string;
  readonly requested: 'pause' | 'cancel' | null;
  /** While a live run waits for the database to be healthy (health checks): why, and since when. */
  readonly healthPause: { readonly reason: string; readonly since: string } | null;
  readonly createdAt: string;
  readonly startedAt: string | null;
  readonly updatedAt: string;
  readonly finishedAt: string | null;
  readonly progress: { readonly done: number; readonly total: number | null; readonly fullyPlanned: boolean; readonly percent: number | null };
  /** Chunks per second of the live attempt. */
  readonly throughput: number | null;
  readonly etaSeconds: number | null;
  /** While running: seconds since its last committed chunk once it reads stalled (see RunStatusRow.stalledSeconds); else null. No ETA then. */
  readonly stalledSeconds: number | null;
  readonly steps: readonly StepView[];
  readonly error: RunErrorInfo | null;
  readonly summary: RunSummary | null;
  /** True when the run was created through the HTTP API (so the server executes and resumes it). */
  readonly viaApi: boolean;
  /**
   * Why a run that stopped does not continue: its job's code (file hash or declared version) is
   * not the code its last attempt ran under, and a resume is refused until an operator allows the
   * change. `detail` says how to go on. Null otherwise (and for a job this server does not load).
   */
  readonly codeChanged: CodeChangeView | null;
  readonly skipped?: ReadonlyArray<{ readonly step: string; readonly key: string; readonly error: string | null; readonly attempts: number }>;
  readonly effects?: { readonly started: number; readonly done: number };
  /** Chunks committed per minute (UTC minute start, count), oldest first, the last 60 minutes with work. */
  readonly chunksPerMinute?: ReadonlyArray<readonly [string, number]>;
}

/** A code change that holds a run back (RunView.codeChanged). */
export interface CodeChangeView {
  /** The fingerprint the run's last attempt ran under: `sha256:…` of its job file, or `version:…`. */
  readonly from: string;
  /** The job's fingerprint in this server now. */
  readonly to: string;
  readonly detail: string;
}

/** States whose run a resume continues, so a changed code holds it back (not live, not ended for good). */
const HELD_BY_CODE: ReadonlySet<string> = new Set(['pending', 'crashed', 'interrupted', 'failed', 'paused']);

/**
 * The sentence of a run its job's code changed under: the change, and how to resume it with the
 * new code (over HTTP for a run this server executes, and with idem run) or else what to deploy.
 */
export function codeChangeDetail(run: Pick<RunView, 'id' | 'job' | 'key' | 'params' | 'viaApi'>, change: { readonly from: string; readonly to: string }): string {
  const cli = `${continueCommand(run.job, run.key, run.params, `<the params GET /api/runs/${run.id} shows>`)} --allow-changed-code`;
  const how = run.viaApi ? `POST /api/runs/${run.id}/resume with the body {"allowChangedCode":true} (or ${cli})` : cli;
  return `run "${printable(run.key)}" of job "${printable(run.job)}" was started under other code (${short(change.from)}, now ${short(change.to)}); if the change is safe for the chunks already done, resume it with ${how}; else deploy the code it started with`;
}

/** States a run can be filtered by. `active` is every state a run can still leave. */
export const RUN_STATES = ['pending', 'running', 'crashed', 'succeeded', 'failed', 'interrupted', 'paused', 'cancelled', 'deleting', 'active'] as const;
export type RunStateFilter = (typeof RUN_STATES)[number];

/** Ended: the run will not change again without an operator (long-poll and SSE stop here). */
export const ENDED_STATES: ReadonlySet<string> = new Set(['succeeded', 'failed', 'cancelled', 'paused']);

export interface RunQuery {
  readonly id?: string;
  readonly job?: string;
  /** The run key (with `job`: at most one run). */
  readonly key?: string;
  /** Add the run page's detail (skipped chunks, effects ledger counts, chunks per minute). */
  readonly detail?: boolean;
  readonly state?: RunStateFilter;
  /** Only rows whose stored status is one of these (`running` rows include crashed runs). */
  readonly statuses?: readonly RunStatus[];
  readonly limit?: number;
  /** Newest first: only runs with an id below this one. */
  readonly before?: string;
}

/** Most replays answered by one statement. */
const MAX_BATCH = 64;

/** No advisory lock held (a view of runs none of which says running needs no pg_locks read). */
const NO_LOCKS: HeldLocks = { keys: new Set(), byPid: new Set() };

/**
 * Read-only queries over idem's tables for the server. The same computations as `idem status`
 * (state from the held advisory locks, rate of the live attempt, estimate where larger than planned).
 *
 * They run on a pool of their own (`reads`), not the runner's: running jobs hold the runner's
 * connections for whole chunks, and an API answer must not queue behind them. The two hot reads,
 * one run by (job, key) (every Idempotency-Key replay) and one run by id (GET, long-poll, events,
 * the run page), are named prepared statements: parsed and planned once per connection, one
 * round trip each, the held advisory locks included, so even a live run's state is one statement.
 */
export class RunViews {
  readonly #db: Kysely<any>;
  readonly #reads: pg.Pool;
  readonly #schema: string;
  readonly #locks: LockHost;
  readonly #byKey: { readonly name: string; readonly text: string };
  readonly #byKeys: { readonly name: string; readonly text: string };
  readonly #byId: { readonly name: string; readonly text: string };
  readonly #jobs: ReadonlyMap<string, Job>;

  /**
   * `db` only compiles statements; every read runs on `reads`. `jobs`: the jobs this server runs,
   * whose code a stopped run's is compared with (RunView.codeChanged).
   */
  constructor(db: Kysely<any>, reads: pg.Pool, schema: string, locks: LockHost, jobs: ReadonlyMap<string, Job> = new Map()) {
    this.#jobs = jobs;
    this.#db = db;
    this.#reads = reads;
    this.#schema = schema;
    this.#locks = locks;
    // Fixed text per server: $1/$2 are the only parameters, so PostgreSQL keeps one generic plan.
    this.#byKey = { name: 'idem_run_view_by_key', text: this.#select(sql`r.job = $1 and r.run_key = $2`, { detail: true, locks: true }).compile(db).sql };
    // Planned per batch: PostgreSQL's custom plan (it sees the arrays' length) always looks cheaper
    // than the generic one, so it would be re-planned for a lone key every time; a lone key takes
    // the statement above, whose generic plan is kept.
    this.#byKeys = {
      name: 'idem_run_views_by_keys',
      text: this.#select(sql`(r.job, r.run_key) in (select * from unnest($1::text[], $2::text[]))`, { detail: true, locks: true }).compile(db).sql,
    };
    this.#byId = { name: 'idem_run_view_by_id', text: this.#select(sql`r.id = $1::bigint`, { detail: true, locks: true }).compile(db).sql };
  }

  #t(name: string) {
    return sql.id(this.#schema, name);
  }

  /**
   * The view's columns for the runs `where` selects, newest first. Columns are named, never `r.*`:
   * a prepared statement whose result type changes (a later idem adds a column while this server
   * runs) would fail with "cached plan must not change result type".
   */
  #select(where: RawBuilder<unknown>, o: { readonly detail: boolean; readonly locks: boolean; readonly limit?: number }): RawBuilder<any> {
    const s = (n: string) => this.#t(n);
    return sql`
      select r.id, r.job, r.run_key, r.status, r.attempt, r.holder, r.params, r.fingerprint, r.requested, r.health_pause,
        r.created_at, r.started_at, r.updated_at, r.finished_at, r.error, r.summary, r.lock_name, r.lock_pid, r.code_fingerprint,
        cs.chunks_done, cs.done_this_attempt, cs.last_done,
        extract(epoch from now() - r.attempt_started_at)::float8 as attempt_seconds,
        extract(epoch from now() - greatest(cs.last_done, r.attempt_started_at))::float8 as idle_seconds,
        coalesce((select json_agg(json_build_object(
            'name', st.name, 'status', st.status, 'planned', st.planned, 'plannedAll', st.planned_all, 'estimated', st.estimated_chunks,
            'done', (select count(*) from ${s('chunks')} c where c.run_id = st.run_id and c.step = st.name and c.done_at is not null)
          ) order by st.position) from ${s('steps')} st where st.run_id = r.id), '[]'::json) as step_views,
        exists (select 1 from ${s('api_requests')} a where a.run_id = r.id) as via_api
        ${o.locks ? sql`, ${this.#heldLocksColumn()}` : sql``}
        ${o.detail ? sql`, ${this.#detailColumns()}` : sql``}
      from ${s('runs')} r cross join lateral ${doneChunks(s('chunks'))} cs
      where ${where}
      order by r.id desc${o.limit === undefined ? sql`` : sql` limit ${sql.lit(o.limit)}`}`;
  }

  async list(q: RunQuery): Promise<RunView[]> {
    if (q.state !== 'running' && q.state !== 'crashed') return this.#listPage(q);
    // running vs crashed is known only after the lock check, so a page of rows that say running
    // may hold fewer runs of the asked state than `limit`, or none: read on until `limit` of them
    // are found or the rows end, so that a short page means the end (nextCursor null).
    const limit = q.limit ?? 50;
    const found: RunView[] = [];
    let before = q.before;
    for (;;) {
      const rows = await this.#listPage({ ...q, limit: Math.max(limit, 100), ...(before !== undefined ? { before } : {}) });
      found.push(...rows.filter((v) => v.state === q.state));
      if (found.length >= limit || rows.length < Math.max(limit, 100)) return found.slice(0, limit);
      before = rows.at(-1)!.id;
    }
  }

  async #listPage(q: RunQuery): Promise<RunView[]> {
    const statusFilter =
      q.state === undefined
        ? sql`true`
        : q.state === 'active'
          ? sql`r.status not in ('succeeded', 'cancelled')` // runs_open_idx's predicate, word for word
          : q.state === 'crashed'
            ? sql`r.status = 'running'`
            : sql`r.status = ${q.state}`;
    const where = sql`${q.id === undefined ? sql`true` : sql`r.id = ${q.id}`}
        and ${q.job === undefined ? sql`true` : sql`r.job = ${q.job}`}
        and ${q.key === undefined ? sql`true` : sql`r.run_key = ${q.key}`}
        and ${statusFilter}
        and ${q.statuses === undefined ? sql`true` : sql`r.status = any(${[...q.statuses]}::text[])`}
        and ${q.before === undefined ? sql`true` : sql`r.id < ${q.before}`}`;
    const compiled = this.#select(where, { detail: q.detail ?? false, locks: false, limit: q.limit ?? 50 }).compile(this.#db);
    const { rows } = await this.#reads.query(compiled.sql, [...compiled.parameters]);
    // pg_locks is only consulted when a row says running.
    const held = rows.some((r) => r.status === 'running') ? await this.#heldLocksNow() : NO_LOCKS;
    const views = rows.map((r) => this.#toView(r, held, q.detail ?? false));
    return views;
  }

  /**
   * Runs per job and state (`running` only where the lock is held, `crashed` otherwise): what
   * /metrics reports as idem_runs. Rows that say running are judged one by one; the rest are counted.
   */
  async countByState(): Promise<Array<{ job: string; state: string; n: number }>> {
    const runs = this.#t('runs');
    const counted = sql`select job, status, count(*)::int as n from ${runs} where status <> 'running' group by 1, 2`.compile(this.#db);
    // The held locks come with the rows that say running, in the same statement (as the views read them).
    const running = sql`select r.id::text as id, r.job, r.status, r.lock_name, r.lock_pid, ${this.#heldLocksColumn()} from ${runs} r where r.status = 'running'`.compile(this.#db);
    const [{ rows: byStatus }, { rows: live }] = await Promise.all([
      this.#reads.query<{ job: string; status: string; n: number }>(counted.sql, [...counted.parameters]),
      this.#reads.query(running.sql, [...running.parameters]),
    ]);
    const held = live.length > 0 ? heldFrom(live[0]) : NO_LOCKS;
    const out = new Map<string, { job: string; state: string; n: number }>();
    const add = (job: string, state: string, n: number) => out.set(`${job}\0${state}`, { job, state, n: (out.get(`${job}\0${state}`)?.n ?? 0) + n });
    for (const r of byStatus) add(r.job, r.status, r.n);
    for (const r of live) add(r.job, runIsLive(r, held, this.#locks) ? 'running' : 'crashed', 1);
    return [...out.values()];
  }

  /** The advisory locks held now, read on the read pool (as the held-locks column reads them). */
  async #heldLocksNow(): Promise<HeldLocks> {
    const { rows } = await this.#reads.query(`select ${HELD_LOCKS_AGG} as held_locks`);
    return heldFrom(rows[0]);
  }

  /**
   * How many runs have one of `statuses`, counting no further than `cap`. Runs that have not ended
   * are counted in runs_open_idx; ended ones (succeeded, cancelled) are not in it, and a
   * count of every one of a table of a million takes a third of a second, while the scan of a
   * capped count stops once it has found `cap`.
   */
  async count(statuses: readonly RunStatus[], cap: number): Promise<number> {
    const compiled = sql`select count(*)::int as n from (select 1 from ${this.#t('runs')} where status = any(${[...statuses]}::text[]) limit ${cap}) c`.compile(this.#db);
    const { rows } = await this.#reads.query<{ n: number }>(compiled.sql, [...compiled.parameters]);
    return rows[0]!.n;
  }

  /**
   * The newest run of each of `jobs` (those that have one), held locks included: one probe of the
   * (job, created_at) index per job, whatever else the table holds.
   */
  async latestOfJobs(jobs: readonly string[]): Promise<Map<string, RunView>> {
    if (jobs.length === 0) return new Map();
    const newest = sql`r.id in (select (select x.id from ${this.#t('runs')} x where x.job = j.name order by x.created_at desc, x.id desc limit 1)
        from unnest(${[...jobs]}::text[]) as j(name))`;
    const compiled = this.#select(newest, { detail: false, locks: true }).compile(this.#db);
    const { rows } = await this.#reads.query(compiled.sql, [...compiled.parameters]);
    return new Map(rows.map((r) => [r.job as string, this.#toView(r, heldFrom(r), false)]));
  }

  /** One run with the detail of its page, in one prepared statement. */
  async get(id: string): Promise<RunView | undefined> {
    if (!/^\d{1,18}$/.test(id)) return undefined;
    return this.#one(this.#byId, [id]);
  }

  /**
   * The run of (job, key) with its detail, or undefined: an Idempotency-Key replay. Lookups that
   * arrive while the read pool's every connection has one in flight wait and go together in the next one
   * (`(job, run_key) in unnest(…)`): under load one round trip answers many replays, and a lone
   * request goes at once, alone.
   */
  byKey(job: string, key: string): Promise<RunView | undefined> {
    return new Promise((resolve, reject) => {
      this.#waiting.push({ job, key, resolve, reject });
      this.#sendKeys();
    });
  }

  readonly #waiting: Array<{ job: string; key: string; resolve: (v: RunView | undefined) => void; reject: (err: unknown) => void }> = [];
  #batches = 0;

  #sendKeys(): void {
    // At most one batch per connection of the read pool: a batch never queues for a connection.
    while (this.#batches < (this.#reads.options.max ?? 1) && this.#waiting.length > 0) {
      const batch = this.#waiting.splice(0, MAX_BATCH);
      this.#batches++;
      this.#reads
        .query(
          batch.length === 1
            ? { ...this.#byKey, values: [batch[0]!.job, batch[0]!.key] }
            : { ...this.#byKeys, values: [batch.map((b) => b.job), batch.map((b) => b.key)] },
        )
        .then(
          ({ rows }) => {
            const found = new Map(rows.map((r) => [`${r.job}\0${r.run_key}`, r]));
            for (const b of batch) {
              const r = found.get(`${b.job}\0${b.key}`);
              try {
                b.resolve(r ? this.#rowView(r) : undefined);
              } catch (err) {
                b.reject(err);
              }
            }
          },
          (err: unknown) => {
            for (const b of batch) b.reject(err);
          },
        )
        .finally(() => {
          this.#batches--;
          this.#sendKeys();
        });
    }
  }

  async #one(statement: { readonly name: string; readonly text: string }, values: unknown[]): Promise<RunView | undefined> {
    const { rows } = await this.#reads.query({ ...statement, values });
    return rows[0] ? this.#rowView(rows[0]) : undefined;
  }

  /** A row of the prepared views, which carry the held locks for a running run. */
  #rowView(r: any): RunView {
    return this.#toView(r, heldFrom(r), true);
  }

  #toView(r: any, held: HeldLocks, detail: boolean): RunView {
    let view = toView(r, runIsLive(r, held, this.#locks));
    const job = this.#jobs.get(view.job);
    const change = job && HELD_BY_CODE.has(view.state) ? changedCode(r, job) : null;
    if (change) view = { ...view, codeChanged: { ...change, detail: codeChangeDetail(view, change) } };
    if (!detail) return view;
    const minutes = (r.chunks_per_minute ?? []) as Array<[string, number]>;
    return {
      ...view,
      skipped: r.skipped_chunks ?? [],
      effects: { started: r.effects_started, done: r.effects_done },
      chunksPerMinute: minutes.map(([m, n]) => [new Date(m).toISOString(), n] as const).reverse(),
    };
  }

  /**
   * The advisory locks held in this database (the rows of Runner.heldLocks), read only for a run
   * whose row says running: a finished run's view never touches pg_locks.
   */
  #heldLocksColumn() {
    return sql`case when r.status = 'running' then ${sql.raw(HELD_LOCKS_AGG)} end as held_locks`;
  }

  #detailColumns() {
    const s = (n: string) => this.#t(n);
    return sql`
      coalesce((select json_agg(json_build_object('step', k.step, 'key', k.key, 'error', k.error, 'attempts', k.attempts))
        from (select step, key, error, attempts from ${s('chunks')} where run_id = r.id and skipped_at is not null order by step, seq limit 20) k), '[]'::json) as skipped_chunks,
      (select count(*) from ${s('effects')} e where e.run_id = r.id and e.status = 'started')::int as effects_started,
      (select count(*) from ${s('effects')} e where e.run_id = r.id and e.status = 'done')::int as effects_done,
      (select json_agg(json_build_array(m.m, m.n)) from (
        select date_trunc('minute', done_at) as m, count(*)::int as n from ${s('chunks')}
        where run_id = r.id and done_at is not null group by 1 order by 1 desc limit 60) m) as chunks_per_minute`;
  }
}

/** The advisory locks held in this database, as `[key, pid]` pairs (the rows of Runner.heldLocks). */
const HELD_LOCKS_AGG = `(
        select json_agg(json_build_array(((l.classid::bigint << 32) | l.objid::bigint)::text, l.pid)) from pg_locks l
        where l.locktype = 'advisory' and l.objsubid = 1 and l.granted
          and l.database = (select oid from pg_database where datname = current_database()))`;

/** The held advisory locks a row of a statement with the held-locks column carries. */
function heldFrom(r: any): HeldLocks {
  const locks = (r.held_locks ?? []) as Array<[string, number]>;
  return locks.length === 0 ? NO_LOCKS : { keys: new Set(locks.map(([k]) => k)), byPid: new Set(locks.map(([k, pid]) => `${pid}:${k}`)) };
}

function iso(d: Date | null): string | null {
  return d === null ? null : d.toISOString();
}

function toView(r: any, locked: boolean): RunView {
  const state = r.status === 'running' ? (locked ? 'running' : 'crashed') : r.status;
  const steps: StepView[] = (r.step_views as any[]).map((st) => ({
    name: st.name,
    status: shownStepState(st.status, state),
    done: Number(st.done),
    planned: st.planned,
    plannedAll: st.plannedAll,
    estimated: st.estimated,
  }));
  const fullyPlanned = steps.length > 0 && steps.every((st) => st.plannedAll);
  const planned = steps.reduce((a, st) => a + (st.plannedAll ? st.planned : Math.max(st.planned, st.estimated ?? 0)), 0);
  const total = steps.length === 0 ? null : planned;
  const done: number = r.chunks_done;
  const percent = state === 'succeeded' ? 100 : total ? Math.min(99, Math.floor((done / total) * 100)) : total === 0 ? 0 : null;
  const rate = state === 'running' && r.attempt_seconds > 0 && r.done_this_attempt > 0 ? r.done_this_attempt / r.attempt_seconds : null;
  const stalled = rate === null ? null : stalledSeconds(r.attempt_seconds, r.idle_seconds, r.done_this_attempt);
  return {
    id: String(r.id),
    job: r.job,
    key: r.run_key,
    state,
    attempt: r.attempt,
    holder: state === 'running' ? r.holder : null,
    params: r.params,
    fingerprint: r.fingerprint,
    requested: r.requested ?? null,
    healthPause: state === 'running' ? (r.health_pause ?? null) : null,
    createdAt: r.created_at.toISOString(),
    startedAt: iso(r.started_at),
    updatedAt: lastChange(r.updated_at, r.last_done).toISOString(),
    finishedAt: iso(r.finished_at),
    progress: { done, total, fullyPlanned, percent },
    throughput: rate === null ? null : Math.round(rate * 100) / 100,
    etaSeconds: rate && total !== null && stalled === null ? Math.max(0, Math.round((total - done) / rate)) : null,
    stalledSeconds: stalled,
    steps,
    error: documentedError(r.error),
    summary: r.summary ?? null,
    viaApi: r.via_api,
    codeChanged: null,
  };
}
