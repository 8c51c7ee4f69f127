import type { Command } from 'commander';
import { nonNegativeNumber, positiveNumber } from '../cli-parsers.ts';
import type { ThrottleOptions } from '../throttle.ts';

/** The throttle flags of every command that runs chunks (run, finalize, migrate), as commander hands them over. */
export interface ThrottleFlags {
  maxRate?: number;
  pause?: number;
  targetChunkMs?: number;
}

/**
 * Adds `--max-rate`, `--pause` and `--target-chunk-ms`: the invocation's throttle, over the job's and
 * its steps' (README: Throttling). Every command that runs chunks takes them: `idem finalize` in a
 * deploy finishing a backfill that was throttled went at full speed before (black-box round 15).
 */
export function withThrottleFlags(cmd: Command): Command {
  return cmd
    .option('--max-rate <chunks/s>', 'start at most this many chunks per second', positiveNumber)
    .option('--pause <ms>', 'pause this long after each chunk (per worker)', nonNegativeNumber)
    .option('--target-chunk-ms <ms>', 'grow or shrink keyRange, keyList and keysetQuery chunks toward this duration', positiveNumber);
}

/** What the flags ask of the runner: the throttle options given, none when none is. */
export function throttleSetting(o: ThrottleFlags): { throttle?: ThrottleOptions } {
  const throttle: ThrottleOptions = {
    ...(o.maxRate !== undefined ? { maxRate: o.maxRate } : {}),
    ...(o.pause !== undefined ? { pauseMs: o.pause } : {}),
    ...(o.targetChunkMs !== undefined ? { targetChunkMs: o.targetChunkMs } : {}),
  };
  return Object.keys(throttle).length > 0 ? { throttle } : {};
}
