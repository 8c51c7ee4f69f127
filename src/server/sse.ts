import type { FastifyReply, FastifyRequest } from 'fastify';
import { errorFields } from '../errors.ts';
import { structuredMask } from '../log.ts';
import { toProblem } from './problem.ts';

/** One server-sent event; `data` may span lines (each becomes its own `data:` line). */
export interface SseEvent {
  readonly event: string;
  readonly data: string;
  /** The event's id: an EventSource sends the last one back as Last-Event-ID when it reconnects. */
  readonly id?: string;
}

export interface SseOptions {
  /** How often `next` is asked for the current state, in ms. */
  readonly intervalMs: number;
  /** Streams still open when the server closes are ended by it. */
  readonly open: Set<() => void>;
  /** Each frame as sent: the server's secrets masked (ServerContext.mask). */
  readonly mask: (text: string) => string;
}

const HEARTBEAT_MS = 15_000;

/** Sent while the database cannot be reached; the dashboard shows its data where it says `live`. */
const UNAVAILABLE: SseEvent = { event: 'unavailable', data: 'database unreachable; retrying…' };

/**
 * An EventSource ends a line at CRLF, LF or a lone CR: data split only on LF would let a CR in it
 * end a `data:` line early and start a bogus field. Each of the three becomes a line of its own
 * (the client joins them with LF); HTML fragments escape their CRs (`esc`) and arrive unchanged.
 */
function frame(e: SseEvent): string {
  return `event: ${e.event}\n${e.id === undefined ? '' : `id: ${e.id}\n`}${e.data.split(/\r\n|\r|\n/).map((l) => `data: ${l}`).join('\n')}\n\n`;
}

/**
 * A frame with the secrets masked in its data lines (structuredMask: a JSON event by its values,
 * never its field names), its event name and id (idem's own) left as they are.
 */
function maskedFrame(text: string, mask: (text: string) => string): string {
  return text.replace(/^data: (.*)$/gm, (_, data: string) => `data: ${mask(data)}`);
}

/**
 * Streams `text/event-stream`: asks `next()` for the current state every `intervalMs` and sends it
 * only when it changed; `next()` returning `end: true` sends that last event and closes. Polling
 * the database (not an in-process bus) shows work done by any process: CLI workers included.
 * `next()` may return several events of different names (parts of one page): each is sent when it
 * differs from the last one of its name.
 */
export function streamEvents(
  request: FastifyRequest,
  reply: FastifyReply,
  next: () => Promise<(SseEvent & { readonly end?: boolean }) | ReadonlyArray<SseEvent & { readonly end?: boolean }>>,
  opts: SseOptions,
): void {
  reply.hijack();
  const res = reply.raw;
  res.writeHead(200, {
    'content-type': 'text/event-stream; charset=utf-8',
    'cache-control': 'no-store',
    connection: 'keep-alive',
    // Reverse proxies (nginx) would otherwise buffer the stream.
    'x-accel-buffering': 'no',
  });
  // HEAD has no body: Node would hold the headers until the first body byte, which never comes, while
  // the stream polled the database until the client gave up.
  if (request.method === 'HEAD') return void res.end();
  res.write('retry: 2000\n\n');
  let closed = false;
  const last = new Map<string, string>();
  const dataMask = structuredMask(opts.mask);
  const maskFrame = (text: string) => maskedFrame(text, dataMask);
  let timer: NodeJS.Timeout | undefined;
  let lastWrite = Date.now();
  const socket = request.raw.socket;
  const close = () => {
    if (closed) return;
    closed = true;
    clearTimeout(timer);
    opts.open.delete(close);
    socket.off('close', close);
    res.end();
  };
  opts.open.add(close);
  socket.on('close', close);
  const tick = async () => {
    if (closed) return;
    try {
      const got = await next();
      if (closed) return;
      const events = Array.isArray(got) ? got : [got as SseEvent & { readonly end?: boolean }];
      const frames = events.map(frame);
      const changed = frames.filter((text, i) => text !== last.get(events[i]!.event));
      if (changed.length) {
        res.write(changed.map(maskFrame).join(''));
        events.forEach((e, i) => last.set(e.event, frames[i]!));
        lastWrite = Date.now();
      } else if (Date.now() - lastWrite > HEARTBEAT_MS) {
        res.write(': keep-alive\n\n');
        lastWrite = Date.now();
      }
      if (events.some((e) => e.end)) return close();
    } catch (err) {
      if (closed) return;
      if (toProblem(err).status !== 503) {
        request.log.warn({ err: errorFields(err) }, 'event stream failed; closing it (the client reconnects)');
        return close();
      }
      // The database cannot be reached (a restart, a failover): the stream says so and keeps asking,
      // rather than ending into a reconnect that would be answered 503, on which a browser's
      // EventSource gives up for good. Every event is sent again once the database answers.
      const text = frame(UNAVAILABLE);
      if (last.get(UNAVAILABLE.event) !== text) {
        request.log.warn({ err: errorFields(err) }, 'event stream cannot read the database; it says so and keeps trying');
        res.write(text);
        lastWrite = Date.now();
      }
      last.clear();
      last.set(UNAVAILABLE.event, text);
    }
    timer = setTimeout(tick, opts.intervalMs);
  };
  void tick();
}
