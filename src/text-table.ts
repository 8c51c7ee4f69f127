import { columns, padColumns } from './display-width.ts';
import { INVISIBLE, ZERO_WIDTH } from './key-label.ts';

/** Rows of aligned columns, as `idem status` and `idem list` print them. */
export interface TextTable {
  /**
   * One row, its cells padded to the column widths and two spaces apart; the last cell is not
   * padded (it may run long) unless `padLast` (text follows the row, and should start at one
   * column in every row). `paint` colours a cell after padding, so colour codes never count
   * toward a width.
   */
  line(cells: readonly string[], paint?: (column: number, padded: string) => string, padLast?: boolean): string;
}

/**
 * Aligns every row given (the header among them): each column as wide as its widest cell. Exact for
 * wide characters once `prepareColumns` has seen the text (the commands do that before formatting).
 */
export function textTable(rows: ReadonlyArray<readonly string[]>): TextTable {
  const count = Math.max(0, ...rows.map((r) => r.length));
  // Widths in terminal columns (display-width.ts): a CJK key or an emoji takes two.
  const widths = Array.from({ length: count }, (_, i) => Math.max(0, ...rows.map((r) => columns(r[i] ?? ''))));
  return {
    line: (cells, paint = (_, s) => s, padLast = false) => cells.map((cell, i) => paint(i, i === cells.length - 1 && !padLast ? cell : padColumns(cell, widths[i]!))).join('  '),
  };
}

/**
 * What must never reach a terminal raw from a stored value (a run key an older idem accepted, a row
 * written by SQL, an error message, a job file's description): the control characters (C0, DEL,
 * C1: newlines, ESC sequences that move the cursor or clear the screen) and the Unicode line
 * separators and bidirectional embeddings, overrides and isolates (they reorder what follows them);
 * and the characters that show as nothing or as a plain space (key-label.ts's INVISIBLE: a zero-width
 * space, a soft hyphen, a no-break space), so that two keys differing by one do not look the same.
 */
const CONTROLS = '[\\u0000-\\u001f\\u007f-\\u009f\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]';
/** What {@link visible} escapes: control, bidi-control and invisible characters. */
export const UNSAFE = new RegExp(`${CONTROLS}|${INVISIBLE.source}`, 'gu');
const NAMED: Record<string, string> = { '\n': '\\n', '\r': '\\r', '\t': '\\t' };
/**
 * UNSAFE without the characters that are ordinary in free text (key-label.ts's ZERO_WIDTH in
 * place of INVISIBLE): a log message's `1\u00a0234` of a Russian number format, a Persian word, a
 * Hebrew sentence's marks.
 */
const UNSAFE_IN_TEXT = new RegExp(`${CONTROLS}|${ZERO_WIDTH.source}`, 'gu');

/**
 * `s` with every such character escaped visibly: `\n`, `\r`, `\t`, else `\xHH` (C0, DEL, C1) or
 * `\uHHHH`. Printable text, non-ASCII included (the invisible characters aside), is left as it
 * is. Every text output of a stored value goes through here (see {@link visibleDeep}); JSON output
 * does not need it.
 */
export function visible(s: string): string {
  return escapeWith(s, UNSAFE);
}

/** One character as {@link visible} shows it: `\\n`, `\\x1b`, `\\u200b`. */
export function escapedChar(ch: string): string {
  const code = ch.charCodeAt(0);
  return NAMED[ch] ?? (code <= 0x9f ? `\\x${code.toString(16).padStart(2, '0')}` : `\\u${code.toString(16).padStart(4, '0')}`);
}

function escapeWith(s: string, unsafe: RegExp): string {
  return s.replace(unsafe, escapedChar);
}

/**
 * A log message as the terminal shows it: {@link visible}, but the characters that are ordinary in
 * free text (UNSAFE_IN_TEXT) left as they are; keys and identifiers keep visible's escapes.
 */
export function visibleText(s: string): string {
  return escapeWith(s, UNSAFE_IN_TEXT);
}

/**
 * The CLI's final `idem: error:` text: the message with every control character escaped
 * ({@link visible}), so it is one line and nothing in it (a chunk's error, a params validator's
 * message) reaches the terminal as an escape sequence. `frame: true` is for a message whose lines
 * after the first are idem's own (a job file's code frame: the source line and its caret): each of
 * those lines is escaped on its own, tabs kept so the caret stays under its column.
 */
export function visibleError(message: string, frame = false): string {
  if (!frame) return visible(message);
  const [head = '', ...rest] = message.split('\n');
  return [visible(head), ...rest.map((l) => l.split('\t').map(visible).join('\t'))].join('\n');
}

/**
 * `value` with {@link visible} applied to every string in it (object fields and array items, at any
 * depth; dates and other values as they are): the one step a text formatter takes on the rows it
 * was given, so no field it prints can slip through.
 */
export function visibleDeep<T>(value: T): T {
  return stringsMapped(value, visible);
}

/** `value` with every string in it (in arrays and plain objects, at any depth) replaced by `fn`'s; other values as they are. */
export function stringsMapped<T>(value: T, fn: (text: string) => string): T {
  if (typeof value === 'string') return fn(value) as T;
  if (Array.isArray(value)) return value.map((v) => stringsMapped(v, fn)) as T;
  if (value && typeof value === 'object' && Object.getPrototypeOf(value) === Object.prototype) {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, stringsMapped(v, fn)])) as T;
  }
  return value;
}
