import { createRequire } from 'node:module';
import type { Logger } from 'pino';
import type { LogLevel } from './log-level.ts';
import { terminalDestination } from './terminal-log.ts';

export { LOG_LEVELS, type LogLevel } from './log-level.ts';

/** Paths pino blanks out wherever they appear: a connection string or password must never reach a log. */
const REDACT = ['password', '*.password', 'connectionString', '*.connectionString', 'databaseUrl', '*.databaseUrl'];

type Pino = typeof import('pino');

/** Defined by scripts/build.mjs in dist/'s ES modules; undefined when running from the sources. */
declare const __IDEM_BUNDLED__: boolean | undefined;

/**
 * pino, loaded on first use. Evaluating pino and building a logger costs ~15 ms of CPU, and a
 * command that logs nothing (a no-op rerun, whose only output is its result on stdout) need not
 * pay it. Synchronous, as logging is, so through require(). In dist/ pino is bundled on its own, as
 * CommonJS (dist/pino.cjs, the package's private import #idem-pino): kept out of the ES modules
 * every command loads, it is not even compiled (~4 ms) until needed. From the sources (tsx,
 * vitest) it is pino from node_modules.
 */
let pinoModule: Pino | undefined;
function loadPino(): Pino {
  return (pinoModule ??= createRequire(import.meta.url)(typeof __IDEM_BUNDLED__ === 'boolean' ? '#idem-pino' : 'pino') as Pino);
}

/** pino's level numbers: a lazy logger decides by these, as pino does, whether a call writes anything. */
const LEVEL_VALUES: Readonly<Record<string, number>> = { trace: 10, debug: 20, info: 30, warn: 40, error: 50, fatal: 60, silent: Infinity };

/**
 * A pino logger made when it is first needed: a call at an enabled level, or any use beyond the
 * level methods and child() (reading `level`, isLevelEnabled, handing it to Fastify or to a job's
 * code...), which from then on goes to the real logger. Calls at a disabled level are dropped as
 * pino drops them; child() of a logger not made yet is as lazy, with the parent's level (pino's
 * rule) unless its options set one. The time of a line is taken when it is written, so a late
 * logger writes the same lines as an early one. Exported for tests.
 */
export function lazyLogger(level: string, make: () => Logger): Logger {
  let real: Logger | undefined;
  const get = () => (real ??= make());
  const threshold = LEVEL_VALUES[level];
  // An unknown level: let pino decide (it throws for one it does not know either).
  if (threshold === undefined) return get();
  const forward = (name: PropertyKey) => {
    const r = get();
    const v = Reflect.get(r, name, r) as unknown;
    return typeof v === 'function' ? v.bind(r) : v;
  };
  const noop = () => {};
  return new Proxy({} as Logger, {
    get(_, name) {
      if (real) return forward(name);
      if (typeof name === 'string' && name !== 'silent' && LEVEL_VALUES[name] !== undefined) {
        return LEVEL_VALUES[name]! >= threshold ? (...args: unknown[]) => (get()[name as 'info'] as (...a: unknown[]) => void)(...args) : noop;
      }
      // Not a promise (pino's loggers have no `then`): answered without making one, since `await`
      // and an async function's return look it up on whatever value they get.
      if (name === 'then') return undefined;
      if (name === 'child') {
        return (bindings: Record<string, unknown>, options?: { level?: string }) =>
          real ? real.child(bindings, options) : lazyLogger(options?.level ?? level, () => get().child(bindings, options));
      }
      return forward(name);
    },
    set(_, name, value) {
      return Reflect.set(get(), name, value);
    },
    has(_, name) {
      return Reflect.has(get(), name);
    },
  });
}

/**
 * The one root logger, on stderr (stdout carries the command's result). JSON lines for machines;
 * pretty lines when stderr is a terminal. Synchronous writes, so nothing is lost on process.exit.
 */
export function createLogger(level: LogLevel = 'info', opts: { readonly pretty?: boolean; readonly secrets?: readonly string[] } = {}): Logger {
  const masked = masking(opts.secrets ?? []);
  return lazyLogger(level, () => {
    const pino = loadPino();
    const base = {
      level,
      redact: { paths: REDACT, censor: '***' },
      base: { pid: process.pid },
      // idem logs `err` as errorFields() builds it; pino's own serializer would turn that plain
      // object into {"type":"Object","stack":""}. A real Error still gets pino's treatment.
      serializers: { err: (e: unknown) => (e instanceof Error ? pino.stdSerializers.err(e) : e) },
    };
    if (opts.pretty ?? process.stderr.isTTY) {
      return pino(base, masked(terminalDestination()));
    }
    return pino(base, masked(pino.destination({ fd: 2, sync: true })));
  });
}

/**
 * A destination that writes every line with the secrets (the database password's forms, as
 * written in the URL and as sent) replaced by `***`: pino's redaction blanks fields by their name
 * only, and a job's `ctx.log` line may quote DATABASE_URL in its message or a field of any name.
 * Masked in the JSON line, so each secret also as JSON escapes it.
 */
function masking(secrets: readonly string[]): <D extends { write(line: string): unknown }>(destination: D) => D {
  const mask = secretMask(secrets);
  return (destination) => {
    const write = destination.write.bind(destination);
    destination.write = (line: string) => write(mask(line));
    return destination;
  };
}

/**
 * Secrets learned after the masks were made (idem serve's --token-file token, read once the
 * command's logger and console masks exist): every mask secretMask made takes them from then on.
 */
const laterSecrets: string[] = [];

/** Adds a secret to every mask made by secretMask, those made before too. */
export function maskFromNowOn(secret: string): void {
  if (!laterSecrets.includes(secret)) laterSecrets.push(secret);
}

/**
 * The text with every secret (as is, and as JSON escapes it) replaced by `***`, as log lines are
 * masked; also every secret added later with maskFromNowOn. `encode`: how each secret is looked
 * for (maskStdio's bytes look for their latin1 view).
 */
export function secretMask(secrets: readonly string[], encode: (secret: string) => string = (secret) => secret): (text: string) => string {
  const formsOf = (all: readonly string[]) =>
    [...new Set(all.map(encode).flatMap((s) => [s, JSON.stringify(s).slice(1, -1)]))].filter((s) => s.length >= 3).sort((a, b) => b.length - a.length);
  let forms = formsOf([...secrets, ...laterSecrets]);
  let known = laterSecrets.length;
  return (text) => {
    if (known !== laterSecrets.length) {
      forms = formsOf([...secrets, ...laterSecrets]);
      known = laterSecrets.length;
    }
    for (const form of forms) if (text.includes(form)) text = text.split(form).join('***');
    return text;
  };
}

/** Fields whose string values are idem's own words (an error code, a run's status), never a user's text. */
const OWN_VOCABULARY = new Set(['code', 'status', 'state', 'kind', 'level', 'event']);

/**
 * `mask` for a text that may be a JSON document (an API answer, a `--json` line): its string
 * values masked, never its keys, its layout or the values of idem's own vocabulary (OWN_VOCABULARY),
 * so a password that is also a word (`idem`, `state`) cannot rewrite `"code":"idem.busy"` or a
 * field's name; anything else masked as a whole, as log lines are. The document keeps its
 * indentation (none, or the spaces of its first nested line).
 */
export function structuredMask(mask: (text: string) => string): (text: string) => string {
  const walk = (v: unknown): unknown =>
    typeof v === 'string'
      ? mask(v)
      : Array.isArray(v)
      ? v.map(walk)
      : v !== null && typeof v === 'object'
      ? Object.fromEntries(Object.entries(v).map(([k, x]) => [k, OWN_VOCABULARY.has(k) && typeof x === 'string' ? x : walk(x)]))
      : v;
  return (text) => {
    const body = text.trimEnd();
    if (!/^[[{]/.test(body)) return mask(text);
    // Nothing to mask (the common case): the document is not parsed.
    if (mask(body) === body) return text;
    let doc: unknown;
    try {
      doc = JSON.parse(body);
    } catch {
      return mask(text);
    }
    const indent = /^[[{]\n( +)/.exec(body)?.[1]?.length ?? 0;
    return `${JSON.stringify(walk(doc), null, indent || undefined)}${text.slice(body.length)}`;
  };
}

/**
 * Masks what the process writes to stdout and stderr as the log lines are masked: a run key or a
 * param may hold the database password as well as a log line may (black-box round 13), and the
 * run summary, status, --json, error lines and the job's own console output all go out there.
 * JSON documents by their values (structuredMask); bytes (a child process's output piped through)
 * by their latin1 view, which keeps every other byte as it was.
 */
export function maskStdio(secrets: readonly string[]): void {
  const text = structuredMask(secretMask(secrets));
  const bytes = secretMask(secrets, (s) => Buffer.from(s, 'utf8').toString('latin1'));
  for (const stream of [process.stdout, process.stderr]) {
    const write = stream.write.bind(stream) as (chunk: unknown, ...rest: unknown[]) => boolean;
    stream.write = ((chunk: unknown, ...rest: unknown[]) => {
      if (typeof chunk === 'string') return write(text(chunk), ...rest);
      if (chunk instanceof Uint8Array) {
        const latin1 = Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength).toString('latin1');
        const masked = bytes(latin1);
        return write(masked === latin1 ? chunk : Buffer.from(masked, 'latin1'), ...rest);
      }
      return write(chunk, ...rest);
    }) as typeof stream.write;
  }
}

/** A logger that writes nothing (the runner's and the server's default); pino only if code asks more of it. */
export function silentLogger(): Logger {
  return lazyLogger('silent', () => loadPino()({ level: 'silent' }));
}
