/**
 * The part of the public API a job or migration file needs: defining jobs and their chunks, SQL,
 * errors. It is also what a CommonJS host gets from `require('idem')` (compiled to dist/cjs/), so
 * nothing here may reach an ESM-only dependency (p-limit) or the runner: a CommonJS job file of a
 * CommonJS project then loads on Node 20, which cannot require() an ES module.
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
  NoParams,
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
export {
  BusyError,
  CancelledError,
  PausedError,
  PauseWithdrawnError,
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
export { sql } from 'kysely';
