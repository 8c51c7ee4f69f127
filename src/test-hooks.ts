/**
 * A duration from the environment that tests set to shorten one of idem's waits (the defaults are
 * tens of seconds): a positive integer of milliseconds, or undefined (unset, or anything else) for
 * the default. Never documented as a setting: each has a flag or an option where users need one.
 */
export function testHookMs(name: 'IDEM_SERVE_READ_TIMEOUT_MS' | 'IDEM_SERVE_REQUEST_TIMEOUT_MS' | 'IDEM_SERVE_LOG_WINDOW_MS' | 'IDEM_SERVE_RESCAN_MS' | 'IDEM_IDLE_IN_TRANSACTION_TIMEOUT_MS' | 'IDEM_LOCK_CHECK_INTERVAL_MS' | 'IDEM_PROGRESS_INTERVAL_MS' | 'IDEM_CONNECT_RETRY_MS' | 'IDEM_CONNECT_TIMEOUT_MS' | 'IDEM_STANDBY_ALARM_MS' | 'IDEM_CRON_CLOCK_BEHIND_MS' | 'IDEM_LOCK_WAIT_BOUND_MS'): number | undefined {
  return positiveIntegerFromEnv(name);
}

/**
 * A size in bytes from the environment that tests set to make one of idem's bounds small enough to
 * reach quickly (the defaults are tens of MiB): a positive integer, or undefined for the default.
 * Never documented as a setting.
 */
export function testHookBytes(name: 'IDEM_SERVE_REPLAY_CACHE_BYTES'): number | undefined {
  return positiveIntegerFromEnv(name);
}

/** The environment's `name` as a positive integer, or undefined (unset, or anything else). */
function positiveIntegerFromEnv(name: string): number | undefined {
  const n = Number(process.env[name]);
  return Number.isInteger(n) && n > 0 ? n : undefined;
}
