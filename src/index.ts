/**
 * idem's public API: what job and migration files (and programs embedding the runner) import.
 * Everything not exported here is internal. The job-authoring half lives in job-api.ts, which is
 * also the CommonJS entry; the runner is ESM only.
 */
export * from './job-api.ts';
export { Runner, DEFAULT_SCHEMA } from './runner.ts';
export { finalizeRun, finalizeMigration } from './finalize.ts';
export type { FinalizeHow, FinalizeMigrationOptions, FinalizeOptions, FinalizeOutcome } from './finalize.ts';
export { CodeChangedError } from './code-fingerprint.ts';
export { DEFAULT_HEALTH, StandbyError } from './health-check.ts';
export type { HealthOptions, HealthSetting } from './health-check.ts';
export type { MigrateOptions, RunJobOptions, RunOutcome, RunnerOptions, RunStatusRow } from './runner.ts';
export type { RunSummary, RunErrorInfo } from './store.ts';
export { redactUrl } from './database.ts';
