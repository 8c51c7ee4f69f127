import { sql, type Kysely } from 'kysely';
import type { Logger } from 'pino';
import { brandErrorClass, codeOf, errorFields, givenValue, UsageError } from './errors.ts';
import type { Job, RunIdentity, Step } from './job.ts';
import { sleep } from './sleep.ts';
import { retrying } from './retry.ts';
import { didYouMean, suggestSimilar } from './suggest.ts';
import { identInSql, lookupText } from './table-name.ts';
import { PLAIN_DECIMAL } from './unsafe-number.ts';

/**
 * Database-health indicators checked before each chunk starts; while one is over its threshold the
 * step's workers wait (in-flight chunks finish). Each threshold can be changed, or turned off with
 * `false`, per job, per step or per invocation (`--health name=value|off`); `health: false` (or
 * `--no-health-check`) turns every indicator off.
 */
export interface HealthOptions {
  /** Most seconds any standby may lag in replay (`pg_stat_replication.replay_lag`). Defaults to `10`. */
  readonly replicationLagSeconds?: number | false;
  /** Most WAL segments waiting for the archiver (`archive_status/*.ready`; GitLab stops at 42). Defaults to `42`. */
  readonly walArchivePending?: number | false;
  /** Wait while autovacuum works on a table the step touches (its `tables`, or the source's). Defaults to `true`. */
  readonly autovacuum?: boolean;
  /**
   * Most seconds another session of the database may keep a transaction open, running or idle in
   * transaction: it pins the xmin horizon, so every row a backfill rewrites stays as bloat.
   * Defaults to `300`.
   */
  readonly transactionAgeSeconds?: number | false;
  /** Most milliseconds a session may wait for a lock an idem chunk holds. Defaults to `1000`. */
  readonly lockWaitMs?: number | false;
  /** How often the database is probed, at most, per process (all workers share a probe), in ms. Defaults to `5000`. */
  readonly probeIntervalMs?: number;
}

/** Health settings at one layer (job, step, invocation): options, or `false` for none at all. */
export type HealthSetting = HealthOptions | false;

/** The defaults, exported so the README and `--help` cannot drift from the code. */
export const DEFAULT_HEALTH: Required<HealthOptions> = Object.freeze({
  replicationLagSeconds: 10,
  walArchivePending: 42,
  autovacuum: true,
  transactionAgeSeconds: 300,
  lockWaitMs: 1000,
  probeIntervalMs: 5000,
});

const NUMERIC = ['replicationLagSeconds', 'walArchivePending', 'transactionAgeSeconds', 'lockWaitMs', 'probeIntervalMs'] as const;

/** Merges the layers (later ones win; `false` anywhere after the job turns all checks off), checking every value. */
export function resolveHealth(...layers: ReadonlyArray<HealthSetting | undefined>): Required<HealthOptions> | null {
  let merged: Record<string, unknown> | null = { ...DEFAULT_HEALTH };
  for (const layer of layers) {
    if (layer === undefined) continue;
    if (layer === false) {
      merged = null;
      continue;
    }
    merged = { ...(merged ?? DEFAULT_HEALTH), ...Object.fromEntries(Object.entries(layer).filter(([, v]) => v !== undefined)) };
  }
  if (merged === null) return null;
  const problems: string[] = [];
  for (const [k, v] of Object.entries(merged)) {
    if (k === 'autovacuum') {
      if (typeof v !== 'boolean') problems.push(`autovacuum must be true or false (got ${JSON.stringify(v)})`);
    } else if (!(NUMERIC as readonly string[]).includes(k)) {
      problems.push(`unknown indicator "${k}" (${indicatorMeant(k) ?? `known: ${[...NUMERIC, 'autovacuum'].join(', ')}`})`);
    } else if (!(v === false && k !== 'probeIntervalMs') && !(typeof v === 'number' && Number.isFinite(v) && v >= 0)) {
      problems.push(`${k} must be a number >= 0${k === 'probeIntervalMs' ? '' : ' or false'} (got ${givenValue(v)})`);
    }
  }
  if (problems.length) throw new UsageError('invalidHealth', `invalid health check settings: ${problems.join('; ')}; see "Health checks" in the README`);
  return merged as Required<HealthOptions>;
}

/** Parses one `--health name=value` flag (`value`: a number, `off`, or for autovacuum `on`/`off`). */
/** `did you mean "autovacuum"?` for a misspelt indicator, or undefined. */
function indicatorMeant(name: string): string | undefined {
  return didYouMean(suggestSimilar(name, [...NUMERIC, 'autovacuum']));
}

export function parseHealthFlag(value: string, previous: HealthOptions = {}): HealthOptions {
  const eq = value.indexOf('=');
  const name = eq < 0 ? value : value.slice(0, eq);
  const raw = eq < 0 ? '' : value.slice(eq + 1);
  if (name === 'autovacuum') {
    if (raw !== 'on' && raw !== 'off') throw new UsageError('invalidHealth', `--health autovacuum=${raw}: expected on or off`);
    return { ...previous, autovacuum: raw === 'on' };
  }
  if (!(NUMERIC as readonly string[]).includes(name)) {
    const meant = indicatorMeant(name);
    throw new UsageError('invalidHealth', `--health ${value}: unknown indicator "${name}"${meant ? ` (${meant})` : ''}; use one of ${[...NUMERIC, 'autovacuum'].join(', ')} as name=value`);
  }
  if (raw === 'off' && name !== 'probeIntervalMs') return { ...previous, [name]: false };
  // As every other number flag: until 2026-12-04 `0x10`, `1e3` and ` 5` were taken (16, 1000, 5).
  const n = PLAIN_DECIMAL.test(raw) ? Number(raw) : Number.NaN;
  if (!Number.isFinite(n)) throw new UsageError('invalidHealth', `--health ${value}: expected ${name}=<plain decimal number >= 0, such as 600 or 0.5>${name === 'probeIntervalMs' ? '' : ' or off'}`);
  return { ...previous, [name]: n };
}

/** The database is a standby (in recovery): idem must not try to write there. */
export class StandbyError extends UsageError {
  static {
    brandErrorClass(this, 'StandbyError');
  }

  constructor(message: string) {
    super('standby', message);
  }
}

/** What one probe measured; thresholds are applied per step. */
interface Measurement {
  readonly inRecovery: boolean;
  readonly replayDelaySeconds: number | null;
  readonly replicationLagSeconds: number | null;
  readonly walReady: number | null;
  readonly vacuuming: ReadonlyArray<{ readonly oid: number; readonly name: string }>;
  readonly oldestTransaction: { readonly pid: number; readonly state: string; readonly seconds: number } | null;
  readonly longestLockWait: { readonly pid: number; readonly ms: number; readonly blocker: number } | null;
}

/**
 * One process-wide probe per database: every step and worker asks it, and it queries at most once
 * per interval (concurrent askers share the query in flight).
 */
class HealthProbe {
  readonly #db: Kysely<any>;
  /** The last probe: when it started (a failed one: when it failed), and whether it answered yet. */
  #last: { at: number; value: Promise<Measurement>; settled: boolean } | null = null;
  #walVisible: Promise<boolean> | null = null;

  constructor(db: Kysely<any>) {
    this.#db = db;
  }

  /**
   * The last probe's answer while it is fresh, or still coming (a probe in flight is shared however
   * long it takes: one waits for a connection at a time); else a new probe's.
   */
  measure(maxAgeMs: number): Promise<Measurement> {
    const now = performance.now();
    // A probe in flight past PROBE_GIVE_UP_MS (a socket that went half-open) is not waited for any
    // more: another is sent, or no probe would ever be sent again in this process.
    const pending = this.#last && !this.#last.settled && now - this.#last.at < Math.max(PROBE_GIVE_UP_MS, 3 * maxAgeMs);
    if (this.#last && (pending || (this.#last.settled && now - this.#last.at < maxAgeMs))) return this.#last.value;
    const last = { at: now, value: this.#query(), settled: false };
    // A failed probe is kept for the interval after it failed: a persistent failure costs one query
    // per interval, not one per chunk (counted from its start, a probe that failed after a 10 s
    // connect timeout was stale at once, and the next chunk waited for another).
    last.value.then(
      () => void (last.settled = true),
      () => {
        last.settled = true;
        last.at = performance.now();
      },
    );
    this.#last = last;
    return last.value;
  }

  /** How long the probe in flight has waited for its answer (0: none in flight). */
  waitingMs(): number {
    return this.#last && !this.#last.settled ? performance.now() - this.#last.at : 0;
  }

  /** Until when measure(maxAgeMs) answers from the last probe without querying. */
  freshUntil(maxAgeMs: number): number {
    return this.#last ? this.#last.at + maxAgeMs : 0;
  }

  /**
   * pg_ls_archive_statusdir needs superuser or pg_monitor; without it the indicator is skipped
   * (warnIfBlind says so), as it is with archive_mode off (nothing to watch).
   */
  #canSeeWal(): Promise<boolean> {
    return (this.#walVisible ??= sql<{ ok: boolean }>`select ${ARCHIVE_ON} and ${SEES_ARCHIVE} as ok`
      .execute(this.#db)
      .then(
        (r) => r.rows[0]?.ok === true,
        (err: unknown) => {
          // Asked again by the next probe: a connection that failed once must not end probing.
          this.#walVisible = null;
          throw err;
        },
      ));
  }

  async #query(): Promise<Measurement> {
    const wal = (await this.#canSeeWal()) ? sql`(select count(*)::int from pg_ls_archive_statusdir() where name like '%.ready')` : sql`null::int`;
    // One statement; each part reads a statistics view, no table. Sessions of idem's own pools
    // (application_name `idem host:pid`, or plain `idem` from an older idem) never count as the
    // long transaction that pins the horizon.
    const { rows } = await sql<Measurement>`
      select pg_is_in_recovery() as "inRecovery",
        ${REPLAY_DELAY} as "replayDelaySeconds",
        (select extract(epoch from max(replay_lag))::float8 from pg_stat_replication) as "replicationLagSeconds",
        ${wal} as "walReady",
        coalesce((select json_agg(json_build_object('oid', p.relid::int8, 'name', p.relid::regclass::text))
          from pg_stat_progress_vacuum p join pg_stat_activity a on a.pid = p.pid
          where a.backend_type = 'autovacuum worker' and p.datname = current_database()), '[]') as vacuuming,
        (select json_build_object('pid', pid, 'state', state, 'seconds', extract(epoch from now() - xact_start)::float8)
          from pg_stat_activity
          where datname = current_database() and backend_type = 'client backend' and xact_start is not null
            and pid <> pg_backend_pid() and application_name <> 'idem' and application_name not like 'idem %'
          order by xact_start limit 1) as "oldestTransaction",
        (select json_build_object('pid', w.pid, 'ms', extract(epoch from now() - w.query_start)::float8 * 1000, 'blocker', b.pid)
          from pg_stat_activity w cross join lateral unnest(pg_blocking_pids(w.pid)) as bp(pid)
          join pg_stat_activity b on b.pid = bp.pid and (b.application_name = 'idem' or b.application_name like 'idem %')
          where w.datname = current_database() and w.wait_event_type = 'Lock' and w.application_name <> 'idem' and w.application_name not like 'idem %'
          order by w.query_start limit 1) as "longestLockWait"`.execute(this.#db);
    return rows[0]!;
  }
}

const probes = new WeakMap<Kysely<any>, HealthProbe>();

/** Whether the server archives WAL: with archive_mode off there is no backlog to watch. */
const ARCHIVE_ON = sql`current_setting('archive_mode') <> 'off'`;

/** Whether this role may list the archive status directory (pg_ls_archive_statusdir). */
const SEES_ARCHIVE = sql`((select rolsuper from pg_roles where rolname = current_user) or pg_has_role(current_user, 'pg_monitor', 'member'))`;

/**
 * The indicators that read other roles' sessions or the standbys: PostgreSQL shows those columns
 * (xact_start, wait_event_type, query_start, vacuum progress, replay_lag) as NULL to a role without
 * pg_read_all_stats (a superuser has it), so they could never fire. Its own role's sessions stay
 * visible, which is why nothing else shows the blindness.
 */
const NEED_READ_ALL_STATS = ['replicationLagSeconds', 'autovacuum', 'transactionAgeSeconds', 'lockWaitMs'] as const;

/** Indicators already looked at for a run, blind or not (the identity object lives as long as the run's invocation). */
const warnedBlind = new WeakMap<RunIdentity, Set<string>>();

/**
 * Runs whose probe is failing and was said so: the warning is once per run (its steps' gates share
 * this), not once per step, until a probe succeeds again.
 */
const probeFailing = new WeakSet<RunIdentity>();

/**
 * Longest a chunk start waits for a probe's answer (a probe is a few milliseconds of catalog reads;
 * one that waits for a connection, behind a pooler with no session free or a server slow to accept
 * one, can take pg-pool's 10 s connect timeout). Past it the chunk starts as when a probe fails.
 */
export const PROBE_PATIENCE_MS = 2_000;

/** A probe in flight this long is given up on (see HealthProbe.measure). */
const PROBE_GIVE_UP_MS = 30_000;

class SlowProbe extends Error {}

/**
 * The probe's answer, waited for at most PROBE_PATIENCE_MS in all (counted from the probe's start),
 * and not at all while the last one failed or was too slow (`failing`): the probe goes on in the
 * background and the next chunk start reads its answer.
 */
async function patiently(p: HealthProbe, intervalMs: number, failing: boolean): Promise<Measurement> {
  const answer = p.measure(intervalMs);
  const left = failing ? 0 : PROBE_PATIENCE_MS - p.waitingMs();
  if (p.waitingMs() === 0) return answer; // answered already
  let timer: NodeJS.Timeout | undefined;
  const slow = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new SlowProbe(`health probe gave no answer within ${PROBE_PATIENCE_MS / 1000} s; continuing without it`)), Math.max(0, left));
  });
  try {
    return await Promise.race([answer, slow]);
  } finally {
    clearTimeout(timer);
  }
}

/**
 * Logs once per run which of the step's indicators this role cannot see, and the grant that fixes
 * it. A check that fails says nothing: the probe's own failure is logged when it happens.
 */
async function warnIfBlind(db: Kysely<any>, o: Required<HealthOptions>, run: RunIdentity, log: Logger): Promise<void> {
  const on = NEED_READ_ALL_STATS.filter((k) => o[k] !== false);
  const walOn = o.walArchivePending !== false;
  const warned = warnedBlind.get(run) ?? new Set<string>();
  if (on.every((k) => warned.has(k)) && (!walOn || warned.has('walArchivePending'))) return;
  const seen = await sql<{ role: string; stats: boolean; walBlind: boolean }>`select current_user as role,
      pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') as stats,
      ${ARCHIVE_ON} and not ${SEES_ARCHIVE} as "walBlind"`
    .execute(db)
    .then((r) => r.rows[0], () => undefined);
  if (!seen) return;
  const blind = on.filter((k) => !warned.has(k));
  const walUnseen = walOn && !warned.has('walArchivePending');
  // Seen once per run: a role that can see them is not asked again at the next step either.
  for (const k of blind) warned.add(k);
  if (walOn) warned.add('walArchivePending');
  warnedBlind.set(run, warned);
  const role = identInSql(seen.role);
  if (!seen.stats && blind.length > 0) {
    const names = blind.length > 1 ? `${blind.slice(0, -1).join(', ')} and ${blind.at(-1)}` : blind[0];
    log.warn(
      { indicators: blind, role: seen.role },
      `health checks cannot see other roles' sessions: role ${role} lacks pg_read_all_stats, so ${names} never pause this run; GRANT pg_read_all_stats TO ${role} (or pg_monitor; see README, Database privileges)`,
    );
  }
  // pg_ls_archive_statusdir is pg_monitor's (or a superuser's) alone: pg_read_all_stats is not enough.
  if (walUnseen && seen.walBlind) {
    log.warn(
      { indicators: ['walArchivePending'], role: seen.role },
      `health checks cannot see the WAL archive: role ${role} lacks pg_monitor, so walArchivePending never pauses this run; GRANT pg_monitor TO ${role} (see README, Database privileges)`,
    );
  }
}

/**
 * A measurement above its limit, as a reason shows it: whole units, unless rounding would print
 * the limit itself or less ("open 3 s > 3 s"); then tenths, rounded up.
 */
function over(value: number, limit: number): string {
  const whole = Math.round(value);
  return whole > limit ? String(whole) : (Math.ceil(value * 10) / 10).toFixed(1);
}

/** Why the database is unhealthy for this step, or null. */
function diagnose(m: Measurement, o: Required<HealthOptions>, tables: ReadonlySet<number>): { indicator: string; reason: string } | null {
  if (o.replicationLagSeconds !== false && m.replicationLagSeconds !== null && m.replicationLagSeconds > o.replicationLagSeconds) {
    return { indicator: 'replicationLagSeconds', reason: `replication lag ${over(m.replicationLagSeconds, o.replicationLagSeconds)} s > ${o.replicationLagSeconds} s` };
  }
  if (o.walArchivePending !== false && m.walReady !== null && m.walReady > o.walArchivePending) {
    return { indicator: 'walArchivePending', reason: `${m.walReady} WAL segments not archived > ${o.walArchivePending}` };
  }
  if (o.autovacuum) {
    const hit = m.vacuuming.find((v) => tables.has(Number(v.oid)));
    if (hit) return { indicator: 'autovacuum', reason: `autovacuum running on ${hit.name}` };
  }
  if (o.transactionAgeSeconds !== false && m.oldestTransaction && m.oldestTransaction.seconds > o.transactionAgeSeconds) {
    const t = m.oldestTransaction;
    return { indicator: 'transactionAgeSeconds', reason: `transaction of pid ${t.pid} (${t.state}) open ${over(t.seconds, o.transactionAgeSeconds)} s > ${o.transactionAgeSeconds} s` };
  }
  if (o.lockWaitMs !== false && m.longestLockWait && m.longestLockWait.ms > o.lockWaitMs) {
    const w = m.longestLockWait;
    return { indicator: 'lockWaitMs', reason: `pid ${w.pid} waiting ${over(w.ms, o.lockWaitMs)} ms > ${o.lockWaitMs} ms for a lock held by idem (pid ${w.blocker})` };
  }
  return null;
}

/**
 * How far a standby's replay is behind, in seconds: the age of the last transaction it replayed,
 * but only while it has received WAL it has not replayed yet. A standby that replayed all it
 * received is caught up (null: nothing said), however long ago its idle primary last committed.
 */
const REPLAY_DELAY = sql`case when pg_is_in_recovery() and pg_last_wal_receive_lsn() is distinct from pg_last_wal_replay_lsn()
  then extract(epoch from now() - pg_last_xact_replay_timestamp())::float8 end`;

function standbyError(m: Measurement): StandbyError {
  const behind = m.replayDelaySeconds === null ? '' : `, ${Math.round(m.replayDelaySeconds)} s behind its primary`;
  return new StandbyError(`the database is a standby (in recovery${behind}) and cannot take writes; point DATABASE_URL at the primary`);
}

/**
 * Turns the "read-only transaction" error a standby raises on idem's first write into a one-line
 * refusal naming the fix. Wraps the run's claim, so a healthy primary pays nothing.
 */
export async function refuseOnStandby<T>(db: Kysely<any>, fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (err) {
    if (codeOf(err) !== '25006') throw err;
    throw (await readOnlyRefusal(db)) ?? err;
  }
}

/**
 * Refuses at once when the database is a standby: an operator's action (pause, resume, cancel,
 * reset, prune) is one round trip or two, and checking first makes every one of them, whatever
 * state its run is in (or when there is none), refuse with the same line, before it reads or writes.
 */
export async function assertNotStandby(db: Kysely<any>): Promise<void> {
  const refusal = await readOnlyRefusal(db);
  if (refusal) throw refusal;
}

/**
 * Why idem's writes would be refused as read-only, as a one-line error naming the fix: the
 * database is a standby, or the role or database sets `default_transaction_read_only = on` (a
 * database frozen for a move, a read-only role given to idem by mistake: idem does not override
 * it). Null when neither.
 */
async function readOnlyRefusal(db: Kysely<any>): Promise<Error | null> {
  const { rows } = await sql<{ inRecovery: boolean; replayDelaySeconds: number | null; readOnlyDefault: boolean }>`
    select pg_is_in_recovery() as "inRecovery",
      ${REPLAY_DELAY} as "replayDelaySeconds",
      current_setting('default_transaction_read_only')::boolean as "readOnlyDefault"`.execute(db);
  const r = rows[0];
  if (r?.inRecovery) return standbyError({ ...r, replicationLagSeconds: null, walReady: null, vacuuming: [], oldestTransaction: null, longestLockWait: null });
  if (r?.readOnlyDefault) {
    return new UsageError(
      'readOnlyDefault',
      "the role or database sets default_transaction_read_only = on, so idem cannot write its bookkeeping (nothing was written); reset it (ALTER DATABASE … RESET default_transaction_read_only, or ALTER ROLE …) or give idem a role and database it may write",
    );
  }
  return null;
}

export interface HealthGateOptions {
  readonly db: Kysely<any>;
  readonly schema: string;
  readonly run: RunIdentity;
  readonly job: Job;
  readonly step: Step;
  readonly log: Logger;
  /** The invocation's setting (flags); wins over the step's and job's. */
  readonly override?: HealthSetting;
}

/** A step's gate: `wait()` before each chunk returns at once while the database is healthy. */
export interface HealthGate {
  wait(signal: AbortSignal): Promise<void>;
  /**
   * Whether wait() would return at once now without a probe: the last one found the database
   * healthy (or could not tell) and is still fresh. A slot may then claim its next chunk with the
   * COMMIT of the current one; otherwise it commits, then waits.
   */
  ready(): boolean;
}

/**
 * Builds the step's gate, or null when every indicator is off. The tables it watches for
 * autovacuum are the step's `tables` and its chunk source's (`keyRange` knows its table).
 */
export async function createHealthGate(opts: HealthGateOptions): Promise<HealthGate | null> {
  const o = resolveHealth(opts.job.health, opts.step.health, opts.override);
  if (!o) return null;
  let probe = probes.get(opts.db);
  if (!probe) probes.set(opts.db, (probe = new HealthProbe(opts.db)));
  await warnIfBlind(opts.db, o, opts.run, opts.log);
  const names = [...(opts.step.tables ?? []), ...(opts.step.chunks?.tables ?? [])];
  const tables = new Set<number>();
  if (o.autovacuum && names.length > 0) {
    // Retried as every statement of idem's own is: a pool connection whose backend just ended (a
    // terminated session, found by the chaos for workers) stopped the worker here at a step's start.
    const { rows } = await retrying(() => sql<{ oid: string | null }>`select to_regclass(n)::oid::int8 as oid from unnest(${names.map(lookupText)}::text[]) n`.execute(opts.db));
    for (const r of rows) if (r.oid !== null) tables.add(Number(r.oid));
  }
  const runs = sql.id(opts.schema, 'runs');
  let paused: string | null = null;
  const record = (pause: { reason: string; since: string } | null) =>
    sql`update ${runs} set health_pause = ${pause === null ? null : JSON.stringify(pause)}::jsonb where id = ${opts.run.runId} and attempt = ${opts.run.attempt}`
      .execute(opts.db)
      .catch(() => {});
  const p = probe;
  let since = '';
  /** Until when the last wait() that let a chunk start holds good (its probe's freshness). */
  let clearUntil = 0;
  return {
    ready: () => paused === null && performance.now() < clearUntil,
    async wait(signal) {
      try {
        while (!signal.aborted) {
          let m: Measurement;
          try {
            m = await patiently(p, o.probeIntervalMs, probeFailing.has(opts.run));
            probeFailing.delete(opts.run);
          } catch (err) {
            // Paused for health, a probe that is slow to answer is no sign of health (a busy
            // pg_stat_activity, a long archive backlog): the pause holds until a probe answers.
            if (err instanceof SlowProbe && paused !== null) {
              await sleep(o.probeIntervalMs, signal);
              continue;
            }
            // Monitoring that fails must not stop the work: log once for the run, carry on as healthy.
            if (!probeFailing.has(opts.run)) {
              if (err instanceof SlowProbe) opts.log.warn(err.message);
              else opts.log.warn({ err: errorFields(err) }, 'health probe failed; continuing without it');
            }
            probeFailing.add(opts.run);
            clearUntil = Math.max(p.freshUntil(o.probeIntervalMs), performance.now() + Math.min(o.probeIntervalMs, PROBE_PATIENCE_MS));
            // Chunks run again: the run is no longer paused for health, whatever the last probe said.
            if (paused !== null) {
              paused = null;
              await record(null);
            }
            return;
          }
          if (m.inRecovery) throw standbyError(m);
          const bad = diagnose(m, o, tables);
          if (!bad) {
            if (paused !== null) {
              opts.log.info({ after: paused }, 'database healthy again; continuing');
              paused = null;
              await record(null);
            }
            clearUntil = p.freshUntil(o.probeIntervalMs);
            return;
          }
          if (paused !== bad.indicator) {
            // Said once per cause, not once per probe or worker.
            opts.log.warn({ indicator: bad.indicator, reason: bad.reason }, `paused for health: ${bad.reason}`);
            paused = bad.indicator;
            since = new Date().toISOString();
          }
          await record({ reason: bad.reason, since });
          await sleep(o.probeIntervalMs, signal);
        }
      } finally {
        if (signal.aborted && paused !== null) {
          paused = null;
          await record(null);
        }
      }
    },
  };
}
