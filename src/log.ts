import pino, { type Logger } from 'pino';
import type { LogLevel } from './log-level.ts';
import { terminalDestination } from './terminal-log.ts';

export { LOG_LEVELS, type LogLevel } from './log-level.ts';

/** Paths pino blanks out wherever they appear: a connection string or password must never reach a log. */
const REDACT = ['password', '*.password', 'connectionString', '*.connectionString', 'databaseUrl', '*.databaseUrl'];

/**
 * The one root logger, on stderr (stdout carries the command's result). JSON lines for machines;
 * pretty lines when stderr is a terminal. Synchronous writes, so nothing is lost on process.exit.
 */
export function createLogger(level: LogLevel = 'info', opts: { readonly pretty?: boolean } = {}): Logger {
  const base = {
    level,
    redact: { paths: REDACT, censor: '***' },
    base: { pid: process.pid },
    // idem logs `err` as errorFields() builds it; pino's own serializer would turn that plain
    // object into {"type":"Object","stack":""}. A real Error still gets pino's treatment.
    serializers: { err: (e: unknown) => (e instanceof Error ? pino.stdSerializers.err(e) : e) },
  };
  if (opts.pretty ?? process.stderr.isTTY) {
    return pino(base, terminalDestination());
  }
  return pino(base, pino.destination({ fd: 2, sync: true }));
}
