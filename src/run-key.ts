import { UsageError } from './errors.ts';

/** Longest run key, in characters (code points, so 200 emoji are 200 characters). */
export const MAX_RUN_KEY_CHARS = 200;

/**
 * A run key that is a cron slot, as schedule.ts's slotKey writes it (`2026-11-30T03:00:00Z`: UTC, to
 * the second): the source of schedule.ts's check of a key, and of prune's in SQL (PostgreSQL's
 * regular expressions read `\d` alike), so that both mean the same keys.
 */
export const SLOT_KEY_SOURCE = String.raw`^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$`;

/** How many characters of an over-long key a message quotes. */
const QUOTED_KEY_CHARS = 40;

/**
 * `key` in double quotes, as a message names it; one longer than any run key may be is cut to its
 * first 40 characters and an ellipsis, with its length and the limit: a 5 000-character paste must
 * not fill the terminal, and no run can have it. Escaping control and bidi characters is the
 * output's job (`visible`, `visibleError`).
 */
export function quoteKey(key: string): string {
  const chars = [...key];
  if (chars.length <= MAX_RUN_KEY_CHARS) return `"${key}"`;
  return `"${chars.slice(0, QUOTED_KEY_CHARS).join('')}…" (${chars.length} characters; a run key has at most ${MAX_RUN_KEY_CHARS})`;
}

/**
 * A run key, from the command line (`--key`) or a library call: a string of 1 to 200 characters
 * (code points), none of them a control character (C0, DEL, C1: a newline or an ESC sequence in a
 * key would reach every terminal that shows it, and break `idem status`'s lines). Any printable
 * character is allowed, non-ASCII too: keys in the operator's language are legitimate. Whitespace
 * may stand inside a key, never at its start or end (`--key ' '` looks empty in every listing, and
 * `'k '` looks like `k`). Throws a
 * UsageError (exit 2) naming the problem, before anything is written.
 */
export function checkRunKey(key: unknown, label = '--key'): asserts key is string {
  if (typeof key !== 'string') throw new UsageError('invalidKey', `${label} must be a string (got ${key === null ? 'null' : typeof key}); pass a key such as '2026-11-30'`);
  const chars = [...key];
  if (chars.length === 0 || chars.length > MAX_RUN_KEY_CHARS) {
    throw new UsageError('invalidKey', `${label} must be 1 to ${MAX_RUN_KEY_CHARS} characters (got ${chars.length}); pass ${chars.length === 0 ? 'a non-empty' : 'a shorter'} key, e.g. 2026-11-30`);
  }
  // Checked first: a key ' ' or 'k\n' is a stray space or newline, and the hint says so.
  if (/^\s|\s$/u.test(key)) {
    throw new UsageError('invalidKey', `${label} must not begin or end with whitespace (got ${quoteKey(key)}); pass the key without it, e.g. 2026-11-30`);
  }
  const at = chars.findIndex((ch) => /\p{Cc}/u.test(ch));
  if (at !== -1) {
    const code = chars[at]!.codePointAt(0)!.toString(16).toUpperCase().padStart(4, '0');
    throw new UsageError('invalidKey', `${label} must not contain control characters (it has U+${code} at character ${at + 1}); pass a key of printable characters, e.g. 2026-11-30`);
  }
}
