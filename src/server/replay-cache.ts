import pg from 'pg';
import type { Logger } from 'pino';
import { SESSION_SETUP } from '../database.ts';
import { errorFields } from '../errors.ts';
import { answerWithin } from '../sleep.ts';
import { RUN_RELEASED } from '../operations.ts';
import { testHookBytes } from '../test-hooks.ts';
import type { RunView } from './run-view.ts';

/** The channel the runs table's trigger notifies on (runner migration 0009). */
export const SUCCEEDED_RUN_CHANGED = 'idem_succeeded_run_changed';

/** Most runs kept; the oldest entry goes first. */
const MAX_ENTRIES = 10_000;
/**
 * Most bytes of answers kept, the oldest going first. A view carries its run's params, which may
 * be as large as --body-limit (64 KiB by default, up to 16 MiB): the count alone would let 10 000
 * of them take 640 MB or more.
 */
const MAX_BYTES = testHookBytes('IDEM_SERVE_REPLAY_CACHE_BYTES') ?? 64 * 1024 * 1024;
/** An answer larger than this is not kept at all (its replays read PostgreSQL, as without the cache). */
const MAX_ENTRY_BYTES = 1024 * 1024;
/**
 * An entry is read again from PostgreSQL after this long, whatever the listener says: a backstop
 * for a notification lost on a session that still answers pings, which PostgreSQL does not do.
 */
const TTL_MS = 300_000;
/** How often the listening session is checked, and how long the check may take before it is dropped. */
const PING_MS = 10_000;
const PING_TIMEOUT_MS = 5_000;
/** Reconnect delays of the listening session after it was lost: doubling from the first to the last. */
const RECONNECT_MIN_MS = 500;
const RECONNECT_MAX_MS = 30_000;

/** A succeeded run's answer to a replay: its view, serialized once. */
export interface CachedReplay {
  readonly id: string;
  readonly fingerprint: string;
  /** The view as the API's JSON body. */
  readonly json: string;
}

const cacheKey = (job: string, runKey: string) => `${job}\0${runKey}`;

interface Entry extends CachedReplay {
  readonly key: string;
  readonly expires: number;
  /** The JSON's size in bytes (UTF-8). */
  readonly bytes: number;
}

/**
 * Idempotency-Key replays of succeeded runs, answered from memory.
 *
 * A succeeded run's view does not change unless something changes or removes its row (prune, reset,
 * a `--retry-skipped` rerun, an operator's SQL), and each of those fires the runs table's trigger,
 * which notifies this server at commit (LISTEN on a session of its own). So a replay of a finished
 * run, the commonest retry, needs no PostgreSQL round trip at all.
 *
 * The cache is off (every replay reads PostgreSQL, as without it) whenever the listening session is
 * not confirmed: before it has run LISTEN, after it was lost (until it listens again), and when a
 * ping on it goes unanswered. Each change of that state and each notification bumps `generation`;
 * a view read before the bump is not stored (`offer`), so a read that raced a prune never brings
 * the pruned run back. Entries also expire after five minutes, a bound on staleness should a
 * notification ever be lost without the session being seen to fail.
 */
export class ReplayCache {
  readonly #byKey = new Map<string, Entry>();
  readonly #keyById = new Map<string, string>();
  #bytes = 0;
  readonly #schema: string;
  readonly #connection: pg.ClientConfig;
  readonly #log: Logger;
  #client: pg.Client | null = null;
  #listening = false;
  #closed = false;
  #generation = 0;
  #reconnectMs = RECONNECT_MIN_MS;
  #timer: NodeJS.Timeout | undefined;

  /** Told when `idem resume` released a run of this schema (RUN_RELEASED), on the same session. */
  readonly #onReleased: () => void;

  constructor(connection: pg.ClientConfig, schema: string, log: Logger, onReleased: () => void = () => {}) {
    this.#connection = connection;
    this.#schema = schema;
    this.#log = log;
    this.#onReleased = onReleased;
  }

  /** Bumped by every notification and every change of the listening session: see `offer`. */
  get generation(): number {
    return this.#generation;
  }

  /** Runs held. */
  get size(): number {
    return this.#byKey.size;
  }

  /** Bytes of answers held (their JSON, UTF-8). */
  get bytes(): number {
    return this.#bytes;
  }

  /** Whether replays are answered from memory now (the listening session is confirmed). */
  get active(): boolean {
    return this.#listening;
  }

  /** The stored answer of (job, key), if the cache is on and holds a fresh one. */
  get(job: string, runKey: string): CachedReplay | undefined {
    if (!this.#listening) return undefined;
    const e = this.#byKey.get(cacheKey(job, runKey));
    if (e === undefined) return undefined;
    if (e.expires <= Date.now()) {
      this.#delete(e);
      return undefined;
    }
    return e;
  }

  /**
   * Stores a view read from PostgreSQL, if its run has succeeded and nothing was notified (and the
   * session was not lost) since `generation` was read, before the read was sent.
   */
  offer(view: RunView, generation: number, json: string): void {
    if (!this.#listening || generation !== this.#generation || view.state !== 'succeeded') return;
    const key = cacheKey(view.job, view.key);
    const old = this.#byKey.get(key);
    if (old) this.#delete(old);
    const bytes = Buffer.byteLength(json);
    if (bytes > MAX_ENTRY_BYTES) return;
    while (this.#byKey.size > 0 && (this.#byKey.size >= MAX_ENTRIES || this.#bytes + bytes > MAX_BYTES)) this.#delete(this.#byKey.values().next().value!);
    this.#byKey.set(key, { key, id: view.id, fingerprint: view.fingerprint, json, expires: Date.now() + TTL_MS, bytes });
    this.#keyById.set(view.id, key);
    this.#bytes += bytes;
  }

  #delete(e: Entry): void {
    if (!this.#byKey.delete(e.key)) return;
    this.#keyById.delete(e.id);
    this.#bytes -= e.bytes;
  }

  #forgetAll(): void {
    this.#generation++;
    this.#byKey.clear();
    this.#keyById.clear();
    this.#bytes = 0;
  }

  /** Opens the listening session; the cache turns on once LISTEN has run. Never throws. */
  start(): void {
    if (this.#closed || this.#client) return;
    const client = new pg.Client({ ...this.#connection, keepAlive: true, application_name: 'idem serve (replays)' });
    this.#client = client;
    const lost = (err?: Error) => {
      if (this.#client !== client) return;
      this.#client = null;
      const was = this.#listening;
      this.#listening = false;
      this.#forgetAll();
      clearInterval(this.#timer);
      client.removeAllListeners('notification');
      client.on('error', () => {});
      void client.end().catch(() => {});
      // A session that went silent (a dead network) would hold its socket until TCP gives up.
      (client as unknown as { connection?: { stream?: { destroy(): void } } }).connection?.stream?.destroy();
      if (this.#closed) return;
      if (was) this.#log.warn({ err: err ? errorFields(err) : undefined }, 'lost the session that hears about changed runs; replays read PostgreSQL until it is back');
      this.#timer = setTimeout(() => this.start(), this.#reconnectMs);
      this.#timer.unref();
      this.#reconnectMs = Math.min(this.#reconnectMs * 2, RECONNECT_MAX_MS);
    };
    client.on('error', lost);
    client.on('end', () => lost());
    client.on('notification', (n) => {
      if (!n.payload) return;
      const at = n.payload.lastIndexOf(' ');
      if (n.payload.slice(0, at) !== this.#schema) return;
      if (n.channel === RUN_RELEASED) return this.#onReleased();
      if (n.channel !== SUCCEEDED_RUN_CHANGED) return;
      const id = n.payload.slice(at + 1);
      this.#generation++;
      if (id === '*') return this.#forgetAll();
      const key = this.#keyById.get(id);
      const e = key === undefined ? undefined : this.#byKey.get(key);
      if (e) this.#delete(e);
    });
    client
      .connect()
      .then(() => client.query(`${SESSION_SETUP}; listen ${SUCCEEDED_RUN_CHANGED}; listen ${RUN_RELEASED}`))
      .then(
        () => {
          if (this.#client !== client) return;
          // Nothing read before this point is stored: `offer` compares generations.
          this.#generation++;
          this.#listening = true;
          this.#reconnectMs = RECONNECT_MIN_MS;
          this.#timer = setInterval(() => this.#ping(client, lost), PING_MS);
          this.#timer.unref();
        },
        (err: Error) => lost(err),
      );
  }

  /** A session that stopped answering (a dead network) is dropped: the cache is off until a new one listens. */
  #ping(client: pg.Client, lost: (err?: Error) => void): void {
    answerWithin(client.query('select 1'), PING_TIMEOUT_MS, () => new Error(`no answer to a ping within ${PING_TIMEOUT_MS} ms`)).then(
      () => {},
      (err: Error) => lost(err),
    );
  }

  async close(): Promise<void> {
    this.#closed = true;
    clearTimeout(this.#timer);
    clearInterval(this.#timer);
    const client = this.#client;
    this.#client = null;
    this.#listening = false;
    this.#forgetAll();
    if (client) {
      client.removeAllListeners('end');
      await client.end().catch(() => {});
    }
  }
}
