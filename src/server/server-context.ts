import type { Logger } from 'pino';
import type { Job } from '../job.ts';
import type { Runner } from '../runner.ts';
import type { ReplayCache } from './replay-cache.ts';
import type { RunExecutor } from './run-executor.ts';
import type { RunViews } from './run-view.ts';
import type { ServerMetrics } from './server-metrics.ts';

/** What the route modules share: built once by createServer. */
export interface ServerContext {
  readonly runner: Runner;
  readonly jobs: ReadonlyMap<string, Job>;
  readonly views: RunViews;
  /** Replays of succeeded runs, answered from memory. */
  readonly replays: ReplayCache;
  readonly executor: RunExecutor;
  readonly metrics: ServerMetrics;
  readonly log: Logger;
  /** How often event streams look for changes, in ms. */
  readonly sseIntervalMs: number;
  /** Close functions of the event streams still open. */
  readonly openStreams: Set<() => void>;
  /** Aborts when the server begins to close (long-polls answer at once). */
  readonly closing: AbortSignal;
  readonly publicRead: boolean;
  /** Text with the secrets of ServerOptions replaced by `***`: what every answer shows. */
  readonly mask: (text: string) => string;
}
