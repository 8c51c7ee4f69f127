/**
 * The terminal (stderr on a TTY): log lines scroll, one status line (the progress bar) stays
 * pinned below them. Every write goes through here, so a log line never lands in the middle of
 * the bar: the bar is cleared, the line written, the bar drawn again.
 */
import { columns, fitColumns, prepareColumns } from './display-width.ts';

const CLEAR_LINE = '\r\x1b[K';

let status: string | undefined;

/** Writes whole lines above the pinned status line. */
export function writeLines(text: string): void {
  const out = text.endsWith('\n') ? text : `${text}\n`;
  process.stderr.write(status === undefined ? out : `${CLEAR_LINE}${out}${status}`);
}

/** Draws (or, with undefined, removes) the pinned status line, cut to the terminal's width. */
export function setStatusLine(text: string | undefined): void {
  // A step name or key that is not ASCII: exact widths from the next redraw on (until then the cut
  // over-estimates, so the line still never wraps).
  if (text !== undefined) prepareColumns(text).catch(() => {});
  const next = text === undefined ? undefined : truncate(text, (process.stderr.columns || 100) - 1);
  if (next === status) return;
  process.stderr.write(`${CLEAR_LINE}${next ?? ''}`);
  status = next;
}

/**
 * Cuts visible text to `width` terminal columns (display-width.ts: a wide character takes two, and a
 * cut never falls inside one). ANSI colour codes take none, and all of them are kept so colours close.
 */
export function truncate(text: string, width: number): string {
  let out = '';
  let left = width;
  for (const part of text.split(/(\x1b\[[0-9;]*m)/)) {
    if (part.startsWith('\x1b[')) {
      out += part;
    } else if (left > 0) {
      const fit = fitColumns(part, left);
      out += fit;
      left = fit === part ? left - columns(part) : 0;
    }
  }
  return out;
}

/** Whether `stream` takes colours: a TTY, without NO_COLOR set, and not a dumb terminal. */
export function colourful(stream: { readonly isTTY?: boolean }): boolean {
  return stream.isTTY === true && !process.env.NO_COLOR && process.env.TERM !== 'dumb';
}

/** Colours when the terminal takes them: not with NO_COLOR set, not when stderr is not a TTY. */
export function colours(enabled = colourful(process.stderr)) {
  const wrap = (open: number, close: number) => (s: string) => (enabled ? `\x1b[${open}m${s}\x1b[${close}m` : s);
  return { dim: wrap(2, 22), bold: wrap(1, 22), red: wrap(31, 39), green: wrap(32, 39), yellow: wrap(33, 39), blue: wrap(34, 39), magenta: wrap(35, 39), cyan: wrap(36, 39), gray: wrap(90, 39) };
}
export type Colours = ReturnType<typeof colours>;
