import type { Logger } from 'pino';

/**
 * Warnings that any client can cause (a malformed request, a request answered 503 during an
 * outage), logged at most once per kind and window: the first at once, the rest of the window
 * summed up in one line when it ends (`more`). A flood costs two lines a window instead of one a
 * request; the metrics still count every request.
 */
export class SampledWarnings {
  readonly #log: Logger;
  readonly #windowMs: number;
  readonly #open = new Map<string, { more: number; readonly fields: Record<string, unknown>; readonly msg: string; readonly timer: NodeJS.Timeout }>();

  constructor(log: Logger, windowMs: number) {
    this.#log = log;
    this.#windowMs = windowMs;
  }

  /** Logs `msg` unless a line of this `kind` was logged less than a window ago; counts it then. */
  warn(kind: string, fields: Record<string, unknown>, msg: string): void {
    const open = this.#open.get(kind);
    if (open) {
      open.more++;
      return;
    }
    this.#log.warn(fields, msg);
    this.#start(kind, fields, msg);
  }

  /** Logs the sums of the open windows (the server is closing) and forgets them. */
  flush(): void {
    for (const kind of [...this.#open.keys()]) this.#end(kind, false);
  }

  #start(kind: string, fields: Record<string, unknown>, msg: string): void {
    // Only the request's description in the summary: an error belongs to the line that showed it.
    const { err: _err, ...described } = fields;
    const timer = setTimeout(() => this.#end(kind, true), this.#windowMs);
    timer.unref();
    this.#open.set(kind, { more: 0, fields: described, msg, timer });
  }

  #end(kind: string, again: boolean): void {
    const open = this.#open.get(kind);
    if (!open) return;
    clearTimeout(open.timer);
    this.#open.delete(kind);
    if (open.more === 0) return;
    const seconds = Math.round(this.#windowMs / 100) / 10;
    this.#log.warn({ ...open.fields, more: open.more }, `${open.more} more like it in the last ${seconds} s: ${open.msg}`);
    // Still flooding: the next window sums up too, rather than logging its first line at once.
    if (again) this.#start(kind, open.fields, open.msg);
  }
}
