import { UsageError } from './errors.ts';
import { healthSettingProblem, throttleSettingProblems } from './job.ts';
import type { FinalizeMigrationOptions, FinalizeOptions } from './finalize.ts';
import type { MigrateOptions, RunJobOptions } from './runner.ts';
import { unknownKeys } from './suggest.ts';

/**
 * The options of the library's run entry points (Runner.run, Runner.migrate, finalizeRun,
 * finalizeMigration), checked as Runner.connect checks its own: an unknown key is refused, naming
 * the one meant. Until 2026-12-04 they were not checked at all: `dryrun: true` (for `dryRun`) ran
 * the job for real, and `throttle: { maxrate }` ran it unthrottled.
 */
const RUN_KEYS: ReadonlyArray<keyof RunJobOptions> = [
  'params', 'key', 'concurrency', 'wait', 'join', 'dryRun', 'signal', 'abortSignal', 'planWindow',
  'retrySkipped', 'slot', 'throttle', 'onProgress', 'controlPollMs', 'allowChangedCode', 'resumeFailed', 'health',
];
/** Runner.migrate's: a migration has no params, its run key is given with it, and there is no dry run. */
const MIGRATE_KEYS: ReadonlyArray<keyof MigrateOptions> = [...(RUN_KEYS.filter((k) => k !== 'params' && k !== 'key' && k !== 'dryRun') as Array<keyof MigrateOptions>), 'onMigration', 'onOutcome'];
const FINALIZE_KEYS: ReadonlyArray<keyof FinalizeOptions> = ['key', 'params', 'timeoutSeconds', 'concurrency', 'signal', 'abortSignal', 'onProgress', 'allowChangedCode', 'throttle', 'health'];
const FINALIZE_MIGRATION_KEYS: ReadonlyArray<keyof FinalizeMigrationOptions> = [...(FINALIZE_KEYS.filter((k) => k !== 'key' && k !== 'params') as Array<keyof FinalizeMigrationOptions>), 'onMigration', 'onOutcome'];

const ENTRY_POINTS = {
  'Runner.run()': { keys: RUN_KEYS, example: "{ key: 'day-1', params: {…} }" },
  'Runner.migrate()': { keys: MIGRATE_KEYS, example: '{ wait: 60 }' },
  'finalizeRun()': { keys: FINALIZE_KEYS, example: "{ key: 'backfill-2026-11', timeoutSeconds: 600 }" },
  'finalizeMigration()': { keys: FINALIZE_MIGRATION_KEYS, example: '{ timeoutSeconds: 600 }' },
} as const;

/** `"yes"`, `-1`, `a function`: a value as a refusal quotes it. */
export function shown(v: unknown): string {
  if (typeof v === 'function') return 'a function';
  if (typeof v === 'bigint') return `${v}n`;
  try {
    return JSON.stringify(v) ?? String(v);
  } catch {
    return `a${typeof v === 'object' ? 'n' : ''} ${typeof v}`;
  }
}

/**
 * Refuses a run entry point's options before anything is read or written: not an object, an
 * unknown key, or a value of the wrong kind; a UsageError `idem.invalidOptions` (exit 2) naming
 * each problem. `undefined` is no options.
 */
export function refuseBadRunOptions(fn: keyof typeof ENTRY_POINTS, given: unknown): void {
  if (given === undefined) return;
  const { keys, example } = ENTRY_POINTS[fn];
  if (given === null || typeof given !== 'object' || Array.isArray(given)) {
    const got = Array.isArray(given) ? 'an array' : given === null ? 'null' : `a ${typeof given}`;
    throw new UsageError('invalidOptions', `${fn}: options must be an object, such as ${example} (got ${got})`);
  }
  const o = given as Record<string, unknown>;
  const problems = unknownKeys(o, keys as readonly string[], '');
  const given_ = (k: string) => (keys as readonly string[]).includes(k) && o[k] !== undefined;
  if (fn === 'finalizeRun()' && o.key === undefined) problems.push('key is required: the key of the run to finalize');
  for (const k of ['dryRun', 'join', 'retrySkipped', 'allowChangedCode', 'resumeFailed']) {
    if (given_(k) && typeof o[k] !== 'boolean') problems.push(`${k} must be true or false (got ${shown(o[k])})`);
  }
  const seconds = (v: unknown) => typeof v === 'number' && Number.isFinite(v) && v >= 0;
  if (given_('wait') && !(typeof o.wait === 'boolean' || seconds(o.wait))) problems.push(`wait must be true, false or a number of seconds >= 0 (got ${shown(o.wait)})`);
  if (given_('timeoutSeconds') && !seconds(o.timeoutSeconds)) problems.push(`timeoutSeconds must be a number of seconds >= 0 (got ${shown(o.timeoutSeconds)})`);
  if (given_('planWindow') && !(Number.isInteger(o.planWindow) && (o.planWindow as number) >= 1)) problems.push(`planWindow must be an integer >= 1 (got ${shown(o.planWindow)})`);
  if (given_('controlPollMs') && !(typeof o.controlPollMs === 'number' && Number.isFinite(o.controlPollMs) && o.controlPollMs > 0)) problems.push(`controlPollMs must be a number of ms > 0 (got ${shown(o.controlPollMs)})`);
  for (const k of ['signal', 'abortSignal']) {
    if (given_(k) && !(o[k] instanceof AbortSignal)) problems.push(`${k} must be an AbortSignal (got ${shown(o[k])})`);
  }
  for (const k of ['onProgress', 'onMigration', 'onOutcome']) {
    if (given_(k) && typeof o[k] !== 'function') problems.push(`${k} must be a function (got ${shown(o[k])})`);
  }
  if (given_('slot') && !(o.slot === null || (o.slot instanceof Date && !Number.isNaN(o.slot.getTime())))) problems.push(`slot must be a Date or null (got ${shown(o.slot)})`);
  // Checked here, as defineJob checks a job's: inside the run it failed the run in step "(runner)".
  if (given_('throttle')) for (const m of throttleSettingProblems(o.throttle)) problems.push(`throttle: ${m}`);
  if (given_('health')) {
    const problem = healthSettingProblem(o.health);
    if (problem) problems.push(`health: ${problem}`);
  }
  if (problems.length > 0) throw new UsageError('invalidOptions', `${fn}: invalid options: ${problems.join('; ')}`);
}
