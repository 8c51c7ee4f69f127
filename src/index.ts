/**
 * idem's public API: what job and migration files (and programs embedding the runner) import.
 * Everything not exported here is internal.
 */
export { defineJob } from './job.ts';
export type {
  ChunkPage,
  ChunkSource,
  ChunkSpec,
  ChunkedStep,
  Job,
  JobDefinition,
  Json,
  ParamsValidator,
  PlanContext,
  RunIdentity,
  SingleStep,
  StandardSchemaV1,
  Step,
  StepContext,
} from './job.ts';
export { keyRange } from './key-range.ts';
export type { KeyRangeChunk, KeyRangeOptions } from './key-range.ts';
export { keyList } from './key-list.ts';
export type { KeyListChunk, KeyListOptions } from './key-list.ts';
export { keysetQuery } from './keyset-query.ts';
export type { KeysetChunk, KeysetQueryOptions, KeysetSource } from './keyset-query.ts';
export { Runner, DEFAULT_SCHEMA } from './runner.ts';
export { finalizeRun, finalizeMigration } from './finalize.ts';
export type { FinalizeHow, FinalizeOptions, FinalizeOutcome } from './finalize.ts';
export { CodeChangedError } from './code-fingerprint.ts';
export { DEFAULT_HEALTH, StandbyError } from './health-check.ts';
export type { HealthOptions, HealthSetting } from './health-check.ts';
export type { RunJobOptions, RunOutcome, RunnerOptions, RunStatusRow } from './runner.ts';
export type { RunSummary, RunErrorInfo } from './store.ts';
export {
  BusyError,
  CancelledError,
  PausedError,
  DatabaseUnavailableError,
  ExitCode,
  FencedError,
  IdemError,
  InterruptedError,
  LockLostError,
  ParamsMismatchError,
  RunFailedError,
  UsageError,
  exitCodeOf,
} from './errors.ts';
export { backoffDelay, isRetryable, SqlState, DEFAULT_BACKOFF } from './retry.ts';
export type { BackoffOptions } from './retry.ts';
export { canonicalJson, fingerprint } from './fingerprint.ts';
export { redactUrl } from './database.ts';
export { sql } from 'kysely';
