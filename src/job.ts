import type { Kysely, Transaction } from 'kysely';
import type { Logger } from 'pino';
import { backoffProblems, type BackoffOptions } from './retry.ts';
import { throttleProblems, type ThrottleOptions } from './throttle.ts';
import { resolveHealth, type HealthSetting } from './health-check.ts';
import { UsageError } from './errors.ts';
import { parseSchedule, type ScheduleSpec } from './schedule.ts';
import { unknownKeys } from './suggest.ts';
import { tableNameProblem } from './table-name.ts';
import { LONE_SURROGATE } from './key-label.ts';

/** A JSON value: what params, cursors and chunk specs are made of (they are stored as jsonb). */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/**
 * One slice of a chunked step's work. `key` must be stable: the same source given the same cursor
 * returns the same keys, because the completion marker is stored under it.
 * @example { key: '[1000,2000)', lo: 1000, hi: 2000 }
 */
export interface ChunkSpec {
  readonly key: string;
  readonly [field: string]: Json;
}

/**
 * A stored chunk spec as today's idem shapes it: a keyRange chunk planned by an idem from before
 * keyRange's `last` (`{ key: '[lo,hi)', lo, hi }`) gets `last = hi - 1`, so a job updated to
 * `between ${lo} and ${last}` does not bind NULL (no row, the chunk done with nothing done) on
 * resume. By its shape, not by its source: a job may wrap keyRange in a source of its own (to make
 * `where` depend on params), which carries nothing of keyRange's.
 */
export function reviveSpec(spec: ChunkSpec): ChunkSpec {
  if (spec.last !== undefined || !Number.isSafeInteger(spec.lo) || !Number.isSafeInteger(spec.hi) || spec.key !== `[${spec.lo},${spec.hi})`) return spec;
  return { ...spec, last: (spec.hi as number) - 1 };
}

/** What a chunk source returns for one call: a window of chunks and the cursor to continue from. */
export interface ChunkPage<C extends ChunkSpec = ChunkSpec> {
  readonly chunks: readonly C[];
  /** `null` when the source is exhausted. */
  readonly next: Json | null;
}

/** The identity of the run a step belongs to. */
export interface RunIdentity {
  readonly job: string;
  readonly runKey: string;
  readonly runId: string;
  /** Fencing token: increments each time a process takes the run over. */
  readonly attempt: number;
}

interface BaseContext<P> {
  readonly params: P;
  /** pino child logger carrying job, run key and step (and chunk, inside a chunk). */
  readonly log: Logger;
  /** Aborts when the run must stop at once (second signal, shutdown deadline, lost lock). */
  readonly signal: AbortSignal;
  readonly run: RunIdentity;
  readonly step: string;
  /** The cron slot this run is for (a scheduled job run without --key, or with a slot key of its schedule as its run key: `run`'s or `finalize`'s --key, a POST's Idempotency-Key), else `null`. */
  readonly slot: Date | null;
}

/** Passed to a step's `run`: `db` is the transaction its completion marker commits in. */
export interface StepContext<P = unknown, DB = any> extends BaseContext<P> {
  readonly db: Transaction<DB>;
  /**
   * Performs a side effect that cannot join the transaction (mail, HTTP call, publish) at most
   * once per completed record: `fn` gets a stable idempotency key derived from run, step, chunk and
   * `name` (send it as an `Idempotency-Key` header). A completed effect is never repeated: its
   * recorded result is returned. One that started but never completed (crash mid-call) is retried
   * with the same key, so the receiver sees at-least-once delivery it can deduplicate by key.
   * The result must be JSON; it is stored in the effects ledger outside the chunk's transaction.
   * @example const { id } = await ctx.effect('reminder', (key) => sendMail(to, { idempotencyKey: key }));
   */
  effect<T extends Json | void>(name: string, fn: (idempotencyKey: string) => Promise<T> | T): Promise<T>;
}

/** Passed to a chunk source: `db` is outside any chunk transaction and must only be read. */
export interface PlanContext<P = unknown, DB = any> extends BaseContext<P> {
  readonly db: Kysely<DB>;
  /** How many chunks the runner would like this call to return (a hint, not a rule). */
  readonly windowSize: number;
  /**
   * Adaptive sizing (`--target-chunk-ms`): multiply your nominal chunk size by this. `1` unless the
   * runner is steering chunk durations toward a target; keyRange, keyList and keysetQuery honour it.
   */
  readonly sizeFactor: number;
}

/**
 * A resumable chunk source: given the persisted cursor (`null` at first) return the next window
 * of chunks and the cursor after them. The runner persists both before running any of them, so a
 * resume never re-plans from data that changed in between.
 */
export type ChunkSource<P = any, DB = any, C extends ChunkSpec = ChunkSpec> = ((
  cursor: Json | null,
  ctx: PlanContext<P, DB>,
) => ChunkPage<C> | Promise<ChunkPage<C>>) & {
  /** Optional: an estimate of how many chunks the whole source yields, for progress and ETA. */
  estimate?: (ctx: PlanContext<P, DB>) => Promise<number | null> | number | null;
  /** Optional: the tables the step's chunks touch (keyRange knows its own), for the autovacuum health check. */
  tables?: readonly string[];
};

interface StepCommon {
  /** Unique within the job; the step's progress is stored under it. */
  readonly name: string;
  /** Retry policy for transient errors in this step. Defaults to the job's, then `DEFAULT_BACKOFF`. */
  readonly retry?: BackoffOptions;
  /**
   * How many chunks may fail for good (permanent error, or retries exhausted) and be recorded as
   * skipped, with their error, instead of failing the run. `idem run --retry-skipped` retries them.
   * Defaults to `0`: the first such chunk fails the run.
   */
  readonly maxFailedChunks?: number;
  /** Throttling for this step; overrides the job's, overridden by command-line flags. */
  readonly throttle?: ThrottleOptions;
  /** Health checks for this step (thresholds, `false` per indicator, or `false` for none); overrides the job's. */
  readonly health?: HealthSetting;
  /**
   * Tables this step's chunks write, watched for autovacuum (a chunk source may name its own), each
   * named as it is in the database, unquoted, optionally `schema.table` (`'MixedCase'`). Defaults to none.
   */
  readonly tables?: readonly string[];
}

/** A step whose whole work is one transaction. */
export interface SingleStep<P = any, DB = any> extends StepCommon {
  readonly chunks?: undefined;
  /**
   * The step's work. `chunk` is always undefined here; it is declared (as ChunkedStep's is, `any`)
   * so that both kinds of step have identical `run` signatures: only then does TypeScript type
   * `ctx` in a chunked step whose `chunks` is a call (`keyRange(…)`) and whose `run` takes `ctx` alone.
   */
  run(ctx: StepContext<P, DB>, chunk: any): unknown;
}

/** A step cut into chunks, each committed with its marker in one transaction. */
export interface ChunkedStep<P = any, DB = any, C extends ChunkSpec = any> extends StepCommon {
  readonly chunks: ChunkSource<P, DB, C>;
  run(ctx: StepContext<P, DB>, chunk: C): unknown;
}

export type Step<P = any, DB = any> = SingleStep<P, DB> | ChunkedStep<P, DB>;

/**
 * The Standard Schema v1 interface (https://standardschema.dev) that zod, valibot and arktype
 * implement; declared here so idem depends on none of them.
 */
export interface StandardSchemaV1<Input = unknown, Output = Input> {
  readonly '~standard': {
    readonly version: 1;
    readonly vendor: string;
    readonly validate: (value: unknown) => StandardResult<Output> | Promise<StandardResult<Output>>;
    readonly types?: { readonly input: Input; readonly output: Output } | undefined;
  };
}
type StandardResult<O> =
  | { readonly value: O; readonly issues?: undefined }
  | { readonly issues: ReadonlyArray<{ readonly message: string; readonly path?: ReadonlyArray<PropertyKey | { readonly key: PropertyKey }> | undefined }> };

/** Params validation: a Standard Schema or a function that returns the params or throws. */
export type ParamsValidator<P> = StandardSchemaV1<unknown, P> | ((raw: unknown) => P);

export interface JobDefinition<P = any, DB = any> {
  /** Unique job name; the advisory lock and every run row are keyed by it. */
  readonly name: string;
  readonly description?: string;
  /**
   * The version of this job's code, recorded on each run: a resume under another version is
   * refused (exit 65) unless `--allow-changed-code`. Defaults to the SHA-256 of the job's file, so
   * any edit of the file counts as a change; declare a version to decide yourself what counts
   * (e.g. when the job imports helpers from other files, which the file hash does not cover).
   * @example version: '2026-11-30.1'
   */
  readonly version?: string | number;
  /** Validates and types `ctx.params`. Defaults to accepting only `{}` or no params. */
  readonly params?: ParamsValidator<P>;
  /** Ordered, state-setting steps: each must leave the same state however often it runs. */
  readonly steps: ReadonlyArray<Step<P, DB>>;
  /** Default retry policy for the job's steps. Defaults to `DEFAULT_BACKOFF`. */
  readonly retry?: BackoffOptions;
  /** Default throttling for the job's steps. Defaults to none. */
  readonly throttle?: ThrottleOptions;
  /** Health checks before each chunk (see HealthOptions). Defaults to every indicator on with its default threshold. */
  readonly health?: HealthSetting;
  /**
   * Cron schedule (5 fields, optional IANA timezone, default UTC). A scheduled job run without
   * --key uses its most recent due slot as run key, so cron firing twice hits the same run.
   * @example schedule: '0 3 * * *'   or   schedule: { cron: '0 3 * * *', timezone: 'Europe/Berlin' }
   */
  readonly schedule?: string | { readonly cron: string; readonly timezone?: string };
}

/** A job as loaded: validated and frozen. */
export type Job<P = any, DB = any> = Readonly<JobDefinition<P, DB>>;

export const NAME = /^[a-z0-9][a-z0-9._:-]{0,99}$/i;
/** {@link NAME} in words, for the errors that quote it. */
const NAME_RULE = `${NAME} (letters, digits and . _ : -, starting with a letter or digit, at most 100 characters`;

/**
 * Declares a job. Checks the definition once, at load time, and reports every problem together.
 * @example
 * export default defineJob({
 *   name: 'backfill-normalized',
 *   steps: [{ name: 'normalize', chunks: keyRange({ table: 'reservations', column: 'id', size: 1000 }),
 *     run: ({ db }, { lo, hi }) => db.updateTable('reservations').set(...).where('id', '>=', lo).where('id', '<', hi).execute() }],
 * });
 */
/**
 * The params of a job without a `params` validator: none to read. An empty object type, so that
 * `ctx.params.foo` is a type error (a `Record<string, never>` gave `never`, which any type accepts).
 */
export type NoParams = Readonly<Record<never, never>>;

export function defineJob<P = NoParams, DB = any>(definition: JobDefinition<P, DB>): Job<P, DB> {
  return assertJob(definition, 'defineJob()');
}

/** Validates a job definition (also a plain default-exported object) and freezes it. */
export function assertJob(value: unknown, origin: string): Job {
  const problems: string[] = [];
  const def = value as Partial<JobDefinition> | null;
  if (!def || typeof def !== 'object') {
    throw new UsageError('invalidJob', `${origin} does not export a job definition: expected an object with name and steps`);
  }
  problems.push(...unknownKeys(def, JOB_KEYS, ''));
  if (typeof def.name !== 'string' || !NAME.test(def.name)) {
    problems.push(`name must match ${NAME_RULE}, got ${JSON.stringify(def.name)})`);
  }
  if (def.schedule !== undefined) {
    try {
      parseSchedule(def.schedule);
    } catch (err) {
      problems.push((err as Error).message);
    }
    problems.push(...unknownNestedKeys(def.schedule, SCHEDULE_KEYS, 'schedule: '));
  }
  if (def.version !== undefined && !((typeof def.version === 'string' && def.version !== '' && def.version.length <= 200) || Number.isFinite(def.version))) {
    problems.push(`version must be a non-empty string (at most 200 characters) or a number (got ${JSON.stringify(def.version)})`);
  }
  const checkHealth = (setting: unknown, where: string) => {
    const problem = healthSettingProblem(setting);
    if (problem) problems.push(`${where}${problem}`);
  };
  checkHealth(def.health, '');
  if (def.params !== undefined && typeof def.params !== 'function' && !isStandardSchema(def.params)) {
    problems.push('params must be a Standard Schema (zod, valibot, arktype…) or a function (raw) => params');
  }
  if (def.throttle !== undefined) for (const m of throttleSettingProblems(def.throttle)) problems.push(`throttle: ${m}`);
  if (def.retry !== undefined) for (const m of [...unknownNestedKeys(def.retry, BACKOFF_KEYS, ''), ...backoffProblems(def.retry)]) problems.push(`retry: ${m}`);
  if (!Array.isArray(def.steps) || def.steps.length === 0) {
    problems.push('steps must be a non-empty array');
  } else {
    const seen = new Set<string>();
    def.steps.forEach((s: Partial<Step> | undefined, i) => {
      if (s && typeof s === 'object') problems.push(...unknownKeys(s, STEP_KEYS, `steps[${i}]: `));
      if (!s || typeof s.name !== 'string' || !NAME.test(s.name)) problems.push(`steps[${i}].name must match ${NAME_RULE}, got ${JSON.stringify(s?.name)})`);
      else if (seen.has(s.name)) problems.push(`step name "${s.name}" is used twice`);
      else seen.add(s.name);
      if (!s || typeof s.run !== 'function') problems.push(`steps[${i}].run must be a function`);
      if (s && s.maxFailedChunks !== undefined && !(Number.isInteger(s.maxFailedChunks) && s.maxFailedChunks >= 0)) {
        problems.push(`steps[${i}].maxFailedChunks must be an integer >= 0`);
      }
      if (s?.throttle !== undefined) for (const m of throttleSettingProblems(s.throttle)) problems.push(`steps[${i}].throttle: ${m}`);
      if (s?.retry !== undefined) for (const m of [...unknownNestedKeys(s.retry, BACKOFF_KEYS, ''), ...backoffProblems(s.retry)]) problems.push(`steps[${i}].retry: ${m}`);
      if (s) checkHealth(s.health, `steps[${i}]: `);
      if (s && s.tables !== undefined) {
        if (!(Array.isArray(s.tables) && s.tables.every((t) => typeof t === 'string' && t !== ''))) problems.push(`steps[${i}].tables must be an array of table names`);
        else for (const [j, t] of s.tables.entries()) problems.push(...[tableNameProblem(t, `steps[${i}].tables[${j}]`) ?? []].flat());
      }
      if (s && s.chunks !== undefined && typeof s.chunks !== 'function') {
        problems.push(`steps[${i}].chunks must be a chunk source function such as keyRange({...})`);
      }
    });
  }
  if (problems.length > 0) {
    throw new UsageError('invalidJob', `${origin}: invalid job definition: ${problems.join('; ')}`);
  }
  return Object.freeze({ ...(def as JobDefinition), steps: Object.freeze([...(def.steps as Step[])]) });
}

/**
 * What a migration may not declare, though a job may: it runs once per database under its run key
 * (its file name), so params and a schedule would be silently ignored.
 */
export function migrationProblems(job: Job): string[] {
  const problems: string[] = [];
  if (job.params !== undefined) problems.push('a migration takes no params (it runs once per database, with its file name as run key): remove params, or make it a job in the jobs folder');
  if (job.schedule !== undefined) problems.push('a migration has no schedule (idem migrate runs it, once): remove schedule, or make it a job in the jobs folder');
  return problems;
}

/** Every key a job definition may have; any other is refused (a typo such as `schedual` would otherwise do nothing). */
const JOB_KEYS: ReadonlyArray<keyof JobDefinition> = ['name', 'description', 'version', 'params', 'steps', 'retry', 'throttle', 'health', 'schedule'];
/** Every key a step may have. */
const STEP_KEYS: ReadonlyArray<keyof SingleStep | keyof ChunkedStep> = ['name', 'run', 'chunks', 'retry', 'maxFailedChunks', 'throttle', 'health', 'tables'];

/** Every key of an object schedule, of retry and of throttle (the nested option objects; health names its own). */
const SCHEDULE_KEYS: ReadonlyArray<keyof ScheduleSpec> = ['cron', 'timezone'];
const BACKOFF_KEYS: ReadonlyArray<keyof BackoffOptions> = ['base', 'max', 'factor', 'attempts'];
const THROTTLE_KEYS: ReadonlyArray<keyof ThrottleOptions> = ['maxRate', 'pauseMs', 'targetChunkMs'];

/**
 * What is wrong with a throttle setting (a job's, a step's, or Runner.run's option): its unknown
 * keys (`maxrate`) and its values (`maxRate: 0`). Empty when nothing is.
 */
export function throttleSettingProblems(throttle: unknown): string[] {
  return [...unknownNestedKeys(throttle, THROTTLE_KEYS, ''), ...throttleProblems(throttle as ThrottleOptions)];
}

/** What is wrong with a health setting (an object of thresholds, or false), or null when nothing is. */
export function healthSettingProblem(setting: unknown): string | null {
  if (setting === undefined) return null;
  try {
    if (setting !== false && (typeof setting !== 'object' || setting === null)) throw new Error('health must be an object of thresholds or false');
    resolveHealth(setting as HealthSetting);
    return null;
  } catch (err) {
    return (err as Error).message;
  }
}

/** unknownKeys of a nested option object, when it is one (a wrong type is reported by its own check). */
function unknownNestedKeys(value: unknown, known: readonly string[], where: string): string[] {
  return value && typeof value === 'object' && !Array.isArray(value) ? unknownKeys(value, known, where) : [];
}

function isStandardSchema(v: unknown): v is StandardSchemaV1 {
  return !!v && typeof v === 'object' && '~standard' in v && typeof (v as StandardSchemaV1)['~standard']?.validate === 'function';
}

/**
 * Validates raw params against the job's validator. Throws a UsageError naming every issue, so the
 * run never starts (and nothing is written) with params the job does not accept.
 */
export async function validateParams<P>(job: Job<P>, raw: unknown): Promise<P> {
  const params = await validateRawParams(job, raw);
  if (params === undefined) throw new UsageError('invalidParams', `invalid params for job "${job.name}": the params validator returned undefined; have it return the params (an object)`);
  const problem = unstorable(params, 'have the params validator return it');
  if (problem) throw new UsageError('invalidParams', `invalid params for job "${job.name}": ${problem}`);
  return params;
}


/** Deepest nesting of objects and arrays params may have: canonical JSON and jsonb recurse per level. */
export const MAX_PARAMS_DEPTH = 100;

/** What a value JSON cannot hold should be given as instead, for a function and the like. */
const AS_DATA = 'as data (a string, number, boolean, null, array or plain object)';

/**
 * Why `v` (at `path`) is a value JSON drops or turns into something else, or null when it is not:
 * a function or Symbol (JSON drops them, or a whole params that is one: nothing was stored, pg's
 * not-null violation), a Map, Set or the like (JSON makes each `{}`), binary data, an invalid Date
 * (null), undefined in an array (null). A valid Date is what its toJSON makes it, its ISO string; a
 * key whose value is undefined is absent, as JSON has it.
 */
function notJson(v: unknown, path: string, fix: string): string | null {
  if (typeof v === 'function') return `${path} is a function, which JSON cannot represent; ${fix} ${AS_DATA} or leave it out`;
  if (typeof v === 'symbol') return `${path} is a Symbol, which JSON cannot represent; ${fix} as a string`;
  if (v === null || typeof v !== 'object') return null;
  if (v instanceof Date) return Number.isNaN(v.getTime()) ? `${path} is an invalid Date, which JSON would turn into null; ${fix} as a valid Date or an ISO string` : null;
  if (v instanceof Map) return `${path} is a Map, which JSON would turn into {}; ${fix} as a plain object (Object.fromEntries(map))`;
  if (v instanceof Set) return `${path} is a Set, which JSON would turn into {}; ${fix} as an array ([...set])`;
  if (ArrayBuffer.isView(v) || v instanceof ArrayBuffer) return `${path} is binary data (${v.constructor?.name ?? 'ArrayBuffer'}), which JSON cannot represent faithfully; ${fix} as a string (base64 or hex)`;
  const tag = Object.prototype.toString.call(v).slice(8, -1);
  if (['WeakMap', 'WeakSet', 'RegExp', 'Promise', 'Error'].includes(tag)) return `${path} is a ${tag}, which JSON would turn into {}; ${fix} ${AS_DATA}`;
  return null;
}

/**
 * Whether params that are not JSON's as given (see notJson) can be fingerprinted and stored: null
 * when they can. Exported for the runner, which takes params given exactly as a run stores them as
 * that run's (a Map fingerprints as {}, which such a run may have stored).
 */
export function paramsProblem(value: unknown): string | null {
  return unstorable(value);
}

/**
 * Why params cannot be fingerprinted and stored as jsonb, or null when they can: a non-finite number
 * or a BigInt (JSON has neither: JSON.stringify threw its bare "Do not know how to serialize a
 * BigInt", exit 1), a value JSON would drop or change (see notJson), a string or key with U+0000 or
 * a lone surrogate (jsonb refuses both), nesting deeper than MAX_PARAMS_DEPTH. Checked after
 * validation, so the job's own output counts too; `fix` says who should give the value otherwise.
 */
function unstorable(value: unknown, fix = 'pass it'): string | null {
  const stack: Array<[unknown, string, number]> = [[value, 'params', 0]];
  const text = (s: string, path: string) =>
    s.includes('\u0000') ? `${path} contains the character U+0000, which PostgreSQL cannot store` : LONE_SURROGATE.test(s) ? `${path} is not well-formed Unicode (it has a lone surrogate)` : null;
  while (stack.length > 0) {
    const [v, path, depth] = stack.pop()!;
    if (typeof v === 'number' && !Number.isFinite(v)) return `${path} is ${v}, which JSON cannot represent`;
    if (typeof v === 'bigint') return `${path} is a BigInt, which JSON cannot represent; ${fix} as a string (or a number within ±(2^53−1))`;
    if (typeof v === 'string') {
      const p = text(v, path);
      if (p) return p;
    }
    const lost = notJson(v, path, fix);
    if (lost) return lost;
    if (v === null || typeof v !== 'object' || v instanceof Date) continue;
    if (depth >= MAX_PARAMS_DEPTH) return `${path} nests deeper than ${MAX_PARAMS_DEPTH} levels`;
    if (Array.isArray(v)) {
      // A hole or undefined in an array is null to JSON: another value than the one given.
      for (let i = 0; i < v.length; i++) if (v[i] === undefined) return `${path}[${i}] is undefined, which JSON would turn into null; ${fix} as null, or leave it out of the array`;
    }
    for (const [k, child] of Object.entries(v as Record<string, unknown>)) {
      const p = text(k, `${path} key ${JSON.stringify(k.slice(0, 40))}`);
      if (p) return p;
      const sub = Array.isArray(v) ? `${path}[${k}]` : `${path}.${k}`;
      // A path through deep nesting would make the message as long as the params.
      stack.push([child, sub.length > 80 ? `${sub.slice(0, 77)}...` : sub, depth + 1]);
    }
  }
  return null;
}

async function validateRawParams<P>(job: Job<P>, raw: unknown): Promise<P> {
  const v = job.params;
  if (v === undefined) {
    // A plain object only: a Date or a Map has no keys either, and was taken as {}.
    if (raw === undefined || (isPlainObject(raw) && isPlainPrototype(raw) && Object.keys(raw).length === 0)) return {} as P;
    // The depth check first: stringifying 30 000 levels overflowed the stack (an HTTP 500). And the
    // params quoted only in part: a 60 kB body made a 60 kB message.
    const problem = unstorable(raw);
    if (problem) throw new UsageError('invalidParams', `invalid params for job "${job.name}": ${problem}`);
    const given = JSON.stringify(raw);
    throw new UsageError('invalidParams', `job "${job.name}" takes no params, got ${given.length > 200 ? `${given.slice(0, 200)}…` : given}; drop --params/--param`);
  }
  if (isStandardSchema(v)) {
    const result = await v['~standard'].validate(raw ?? {});
    if (result.issues) {
      const issues = result.issues.map((i) => {
        const path = (i.path ?? []).map((p) => (typeof p === 'object' ? String(p.key) : String(p))).join('.');
        return path ? `${path}: ${i.message}` : i.message;
      });
      throw new UsageError('invalidParams', `invalid params for job "${job.name}": ${issues.join('; ')}`);
    }
    return result.value;
  }
  try {
    return await v(raw ?? {});
  } catch (err) {
    const msg = err instanceof Error ? err.message : String(err);
    throw new UsageError('invalidParams', `invalid params for job "${job.name}": ${msg}`, { cause: err });
  }
}

function isPlainObject(v: unknown): v is Record<string, unknown> {
  return !!v && typeof v === 'object' && !Array.isArray(v);
}

/** Whether `v` is an object literal's kind (or Object.create(null)'s), not a Date, Map or class instance. */
function isPlainPrototype(v: object): boolean {
  const proto = Object.getPrototypeOf(v);
  return proto === null || proto === Object.prototype || Object.getPrototypeOf(proto) === null;
}
