import type { Logger } from 'pino';
import type { Progress } from './executor.ts';
import { colours, setStatusLine, type Colours } from './terminal.ts';

export interface ProgressReporter {
  readonly update: (p: Progress) => void;
  /** Clears the line (TTY) and stops the timer. Idempotent. */
  stop(): void;
}

/**
 * What stands in for the ETA while the chunks left are held by another worker: a rate-based ETA
 * would count down to 0 and stay there while the workers wait out, say, a cut-off worker's chunk
 * (its row lock lasts until the server ends that session, up to ~60 s).
 */
const WAITING_ON_OTHERS = 'waiting on a chunk held by another worker';

/** done/total, rate and ETA as one short line. Pure; exported for tests. */
export function formatProgress(job: string, p: Progress, now = performance.now()): string {
  const total = p.fullyPlanned ? p.planned : Math.max(p.planned, p.estimated ?? 0);
  const rate = stepRate(p, now);
  const left = total - p.done;
  const eta = p.waitingOnOthers ? WAITING_ON_OTHERS : rate > 0 && total > 0 ? `ETA ${formatSeconds(left / rate)}` : 'ETA ?';
  const of = total > 0 ? `${p.done}/${total}${p.fullyPlanned ? '' : '~'}` : `${p.done}`;
  return `${job} step ${p.stepIndex + 1}/${p.steps} ${p.step}: ${of} chunks, ${rate.toFixed(1)}/s, ${eta}`;
}

/**
 * The pinned progress bar on a terminal: step, a bar of done/planned (or the estimate, marked ~),
 * the step's rate since this invocation started it (every worker's chunks) and the ETA. Pure; exported for tests.
 */
export function formatProgressBar(p: Progress, now = performance.now(), width = 24, c: Colours = colours(false)): string {
  const total = p.fullyPlanned ? p.planned : Math.max(p.planned, p.estimated ?? 0);
  const rate = stepRate(p, now);
  const eta = p.waitingOnOthers ? WAITING_ON_OTHERS : `ETA ${rate > 0 && total > 0 ? formatSeconds((total - p.done) / rate) : '?'}`;
  const filled = total > 0 ? Math.min(width, Math.round((p.done / total) * width)) : 0;
  const bar = c.green('█'.repeat(filled)) + c.gray('░'.repeat(width - filled));
  const of = total > 0 ? `${p.done}/${total}${p.fullyPlanned ? '' : '~'}` : `${p.done}`;
  return `${c.dim(`step ${p.stepIndex + 1}/${p.steps}`)} ${p.step} ${bar} ${of} chunks · ${rate.toFixed(1)}/s · ${eta}`;
}

/** Chunks a second since this invocation started the step: every worker's (the step's done since then), at least its own. */
function stepRate(p: Progress, now: number): number {
  const secs = (now - p.since) / 1000;
  const chunks = Math.max(p.executedNow, p.doneBefore === undefined ? 0 : p.done - p.doneBefore);
  return secs > 0 ? chunks / secs : 0;
}

function formatSeconds(seconds: number): string {
  if (!Number.isFinite(seconds)) return '?';
  // Round once, then split: rounding the parts separately shows 119.5 s as "1m60s".
  const s = Math.ceil(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
}

/**
 * A progress bar pinned below the log lines on a terminal (redrawn at most 4 times a second), or
 * a JSON log line every `intervalMs` otherwise, so a long run in cron or Kubernetes still shows
 * it is moving.
 */
export function createProgressReporter(opts: { readonly job: string; readonly tty: boolean; readonly log: Logger; readonly intervalMs?: number }): ProgressReporter {
  let last: Progress | undefined;
  let drawn = false;
  const c = colours();
  const draw = () => {
    if (!last) return;
    if (opts.tty) {
      setStatusLine(formatProgressBar(last, performance.now(), 24, c));
      drawn = true;
    } else {
      // The fields every other line of the run carries (the run's child logger binds them).
      opts.log.info({ job: opts.job, runKey: last.runKey, attempt: last.attempt, step: last.step, done: last.done, planned: last.planned, estimated: last.estimated, executedNow: last.executedNow, ...(last.waitingOnOthers ? { waitingOnOthers: true } : {}) }, formatProgress(opts.job, last));
    }
  };
  const intervalMs = opts.tty ? 250 : (opts.intervalMs ?? 10_000);
  let lastTick = performance.now();
  let skipped = false;
  const timer = setInterval(() => {
    // A tick more than a second late: the process was stopped (SIGSTOP, a VM freeze) or its event
    // loop blocked. Its figures are from before the gap, and a verdict on the run's lock may be due
    // (the lock check fires in the same turn): this one is skipped, the next draws. Only one in a
    // row: a job that keeps the loop blocked (every tick late) still gets every other one drawn.
    const now = performance.now();
    const late = now - lastTick > intervalMs + 1_000;
    lastTick = now;
    if (late && !skipped) {
      skipped = true;
      return;
    }
    skipped = false;
    draw();
  }, intervalMs);
  timer.unref();
  let stopped = false;
  return {
    update: (p) => {
      last = p;
      // The step is done: its bar comes down before its `step done` line, which would otherwise
      // draw it again below itself; the next step's first report brings the bar back.
      if (p.stepDone && opts.tty) {
        last = undefined;
        if (drawn) setStatusLine(undefined);
        drawn = false;
      }
    },
    stop: () => {
      if (stopped) return;
      stopped = true;
      clearInterval(timer);
      if (drawn) setStatusLine(undefined);
    },
  };
}
