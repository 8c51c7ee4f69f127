import { testHookMs } from './test-hooks.ts';

/**
 * Who holds an advisory lock, as an operator needs to hear it: a live idem sends a statement on its
 * lock session every check interval, so a holder silent for many of them is a process stopped, or
 * one whose host vanished behind a proxy. No pg here: `idem status` formats with it.
 */

/**
 * Default of `checkIntervalMs`. IDEM_LOCK_CHECK_INTERVAL_MS (tests only, see test-hooks.ts)
 * shortens it, and with it every bound derived from it, in every process of a test alike.
 */
export function lockCheckIntervalMs(): number {
  return testHookMs('IDEM_LOCK_CHECK_INTERVAL_MS') ?? 2_000;
}

/**
 * A lock session silent for this many check intervals (30 s) belongs to no live idem: a live one
 * sends a statement on it every interval. The busy error and `idem status` say it looks dead.
 */
export const SILENT_INTERVALS = 15;

/**
 * Seconds since the session `a` (pg_stat_activity) ended its last statement, 0 while one runs: SQL
 * for the busy error's holders and `idem status`'s workers alike. NULL where the role may not see it.
 */
export const SILENT_SECONDS_SQL = "case when a.state = 'active' then 0 else extract(epoch from now() - a.state_change) end";

/** SILENT_SECONDS_SQL's value as LockHolder.silentSeconds holds it: to 0.1 s, never negative. */
export function silentSecondsOf(value: unknown): number | null {
  return value === null || value === undefined ? null : Math.max(0, Math.round(Number(value) * 10) / 10);
}

/** A lock holder's session, as pg_locks and pg_stat_activity show it. */
export interface LockHolder {
  readonly pid: number;
  /** `idem-lock host:pid` for idem's lock sessions; null where the role may not see it. */
  readonly applicationName: string | null;
  /** Seconds (to 0.1) since its last statement ended (`now() - state_change`; 0 while one runs); null where the role may not see it. */
  readonly silentSeconds: number | null;
}

/**
 * An idem lock session silent this long belongs to no live idem (which checks its lock every
 * `intervalMs`). Another client's session (psql holding the key) may idle as it likes.
 */
export function looksDead(holder: Pick<LockHolder, 'silentSeconds' | 'applicationName'>, intervalMs: number = lockCheckIntervalMs()): boolean {
  return !!holder.applicationName?.startsWith('idem-lock ') && holder.silentSeconds !== null && holder.silentSeconds * 1000 > SILENT_INTERVALS * intervalMs;
}

/** One holder for a one-line message: `backend 123 (idem-lock host:9, silent 2s)`, and the fix when it looks dead. */
export function describeHolder(h: LockHolder, intervalMs: number = lockCheckIntervalMs()): string {
  const what = [h.applicationName, h.silentSeconds !== null ? `silent ${Math.floor(h.silentSeconds)}s` : null].filter(Boolean).join(', ');
  const dead = looksDead(h, intervalMs)
    ? `: it looks dead (a live idem sends a statement on its lock session every ${intervalMs / 1000}s; none comes from a process stopped, cut off behind a proxy, or whose job blocks its event loop), end it with select pg_terminate_backend(${h.pid}) (safe: the run's fencing refuses that process's commits, and a rerun resumes) or see README "A vanished host holds its locks" for the settings that free it`
    : '';
  return `backend ${h.pid}${what ? ` (${what})` : ''}${dead}`;
}

