/**
 * Quotes a word for a POSIX shell (a crontab line, a command in a message), leaving plain words as
 * they are. A module of its own so that the server can quote without loading schedule.ts (croner).
 */
export function shellQuote(s: string): string {
  return /^[A-Za-z0-9_./:@+=,-]+$/.test(s) ? s : `'${s.replace(/'/g, `'\\''`)}'`;
}
