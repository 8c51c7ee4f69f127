import { createRequire } from 'node:module';
import pino, { type Logger } from 'pino';
import type { LogLevel } from './log-level.ts';

export { LOG_LEVELS, type LogLevel } from './log-level.ts';

/** Paths pino blanks out wherever they appear: a connection string or password must never reach a log. */
const REDACT = ['password', '*.password', 'connectionString', '*.connectionString', 'databaseUrl', '*.databaseUrl'];

/**
 * The one root logger, on stderr (stdout carries the command's result). JSON lines for machines;
 * pretty lines when stderr is a terminal. Synchronous writes, so nothing is lost on process.exit.
 */
export function createLogger(level: LogLevel = 'info', opts: { readonly pretty?: boolean } = {}): Logger {
  const base = { level, redact: { paths: REDACT, censor: '***' }, base: { pid: process.pid } };
  if (opts.pretty ?? process.stderr.isTTY) {
    // Required on demand: only a terminal needs pino-pretty (and its dependencies).
    const pretty = createRequire(import.meta.url)('pino-pretty') as typeof import('pino-pretty');
    return pino(base, pretty({ destination: 2, sync: true, ignore: 'pid,hostname', translateTime: 'HH:MM:ss.l' }));
  }
  return pino(base, pino.destination({ fd: 2, sync: true }));
}
