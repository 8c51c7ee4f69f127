/**
 * Exit codes are part of idem's interface: scripts, cron wrappers and CI branch on them.
 * They follow sysexits(3) where a code there fits, so `75` reads as "try again later".
 */
export const ExitCode = {
  /** The run finished, now or earlier (a no-op rerun). */
  Ok: 0,
  /** The run failed; the failing step and chunk are recorded and a rerun resumes there. */
  Failed: 1,
  /** Usage or bad input: unknown job, invalid params, bad flag, unreachable database. */
  Usage: 2,
  /** The run key was used before with other params (sysexits EX_DATAERR). */
  ParamsMismatch: 65,
  /** The runner lost its advisory-lock session mid-run (sysexits EX_UNAVAILABLE); rerun to resume. */
  LockLost: 69,
  /** Another run holds the job's lock (sysexits EX_TEMPFAIL); retry later or pass --wait. */
  Busy: 75,
  /** Interrupted by SIGHUP (the terminal closed: an ssh session dropped, the shell exited); resumable. */
  Sighup: 129,
  /** Interrupted by SIGINT; resumable. */
  Sigint: 130,
  /** Interrupted by SIGTERM; resumable. */
  Sigterm: 143,
} as const;
export type ExitCode = (typeof ExitCode)[keyof typeof ExitCode];

/**
 * Where each idem error class marks its prototype, so that `instanceof` and {@link exitCodeOf}
 * recognise its errors whichever copy of idem made them. A CommonJS host that requires idem (the
 * job API, dist/cjs/) and imports it (the runner, ESM) has two copies of these classes in one
 * process; a job's BusyError from the one was no BusyError of the other. `Symbol.for` keys are
 * shared by every copy.
 */
const CLASS_KEY = Symbol.for('idem.errorClass');
const brandKey = (name: string) => Symbol.for(`idem.error.${name}`);

/**
 * Marks `cls` as the idem error class `name`: its instances (its subclasses' too) answer
 * `instanceof` of the same class from any copy of idem. A user's own subclass, not marked, is
 * told by its prototype chain alone, as usual.
 * @internal
 */
export function brandErrorClass(cls: abstract new (...args: never[]) => IdemError, name: string): void {
  Object.defineProperty(cls.prototype, CLASS_KEY, { value: name });
  Object.defineProperty(cls.prototype, brandKey(name), { value: true });
}

/**
 * Base class: every error idem raises on purpose carries a stable `code` and the exit code it maps
 * to. `instanceof` works across copies of idem (`require('idem')` and `import('idem')` in one
 * process): `err instanceof BusyError` holds for a BusyError either made.
 */
export class IdemError extends Error {
  static {
    brandErrorClass(this, 'IdemError');
  }

  /**
   * The prototype chain first, then the class's mark (see {@link brandErrorClass}). Inherited by
   * every subclass with `this` the class asked about, so it checks that class's own mark, never
   * its parent's: a BusyError is no ParamsMismatchError, from any copy.
   */
  static override [Symbol.hasInstance]<T>(this: abstract new (...args: never[]) => T, value: unknown): value is T {
    if (Function.prototype[Symbol.hasInstance].call(this, value)) return true;
    if (value === null || typeof value !== 'object') return false;
    const name = Object.getOwnPropertyDescriptor(this.prototype, CLASS_KEY)?.value;
    return typeof name === 'string' && (value as Record<symbol, unknown>)[brandKey(name)] === true;
  }

  readonly code: string;
  readonly exitCode: ExitCode;
  constructor(code: string, exitCode: ExitCode, message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.code = code;
    this.exitCode = exitCode;
  }
}

/** Bad input from the user: a flag, a job name, params. Nothing was changed. */
export class UsageError extends IdemError {
  static {
    brandErrorClass(this, 'UsageError');
  }

  constructor(code: string, message: string, options?: { cause?: unknown }) {
    super(`idem.${code}`, ExitCode.Usage, message, options);
  }
}

/** The database cannot be used (unreachable, wrong credentials, schema too new, pooled sessions). */
export class DatabaseUnavailableError extends IdemError {
  static {
    brandErrorClass(this, 'DatabaseUnavailableError');
  }

  constructor(message: string, options?: { cause?: unknown }) {
    super('idem.databaseUnavailable', ExitCode.Usage, message, options);
  }
}

/** Same (job, run key) was used before with other params: refused, never silently replayed. */
export class ParamsMismatchError extends IdemError {
  static {
    brandErrorClass(this, 'ParamsMismatchError');
  }

  constructor(message: string) {
    super('idem.paramsMismatch', ExitCode.ParamsMismatch, message);
  }
}

/** Another process holds the job's advisory lock. */
export class BusyError extends IdemError {
  static {
    brandErrorClass(this, 'BusyError');
  }

  /** What is busy, without the advice to whoever invoked it (a scheduler says what it does instead). */
  readonly reason: string;

  /** `advice`, when given, ends the message: `<reason>; <advice>`. */
  constructor(reason: string, advice?: string) {
    super('idem.busy', ExitCode.Busy, advice === undefined ? reason : `${reason}; ${advice}`);
    this.reason = reason;
  }
}

/** A busy refusal's advice to an `idem run` (or a library caller) that did not wait. */
export const RETRY_OR_WAIT = 'try again later or pass --wait';

/** The run failed in a step or chunk; recorded on the run row, resumable. */
export class RunFailedError extends IdemError {
  static {
    brandErrorClass(this, 'RunFailedError');
  }

  constructor(message: string, options?: { cause?: unknown }) {
    super('idem.runFailed', ExitCode.Failed, message, options);
  }
}

/** The signals that stop idem gracefully: in-flight chunks finish, the run is recorded interrupted. */
export type StopSignal = 'SIGINT' | 'SIGTERM' | 'SIGHUP';
export const STOP_SIGNALS: readonly StopSignal[] = ['SIGINT', 'SIGTERM', 'SIGHUP'];

/** 128 + the signal's number, as a shell reports a process the signal ended. */
export function exitCodeOfSignal(signal: StopSignal): ExitCode {
  return signal === 'SIGINT' ? ExitCode.Sigint : signal === 'SIGHUP' ? ExitCode.Sighup : ExitCode.Sigterm;
}

/** The run was stopped by a signal after in-flight chunks finished or rolled back. */
export class InterruptedError extends IdemError {
  static {
    brandErrorClass(this, 'InterruptedError');
  }

  readonly signal: StopSignal;
  /**
   * What stopped it when no signal did: `Runner.close()`, the caller's AbortSignal. `signal` is then
   * the one whose exit code it takes (SIGTERM), and messages name this instead.
   */
  readonly stoppedBy: string | undefined;
  constructor(signal: StopSignal, message?: string, options?: { readonly stoppedBy?: string }) {
    super(
      'idem.interrupted',
      exitCodeOfSignal(signal),
      message ?? `interrupted by ${signal}; finished chunks are kept, run the same command again to resume`,
    );
    this.signal = signal;
    this.stoppedBy = options?.stoppedBy;
  }
}

/** The lock session died: another attempt may now own the run, so this one must stop. */
export class LockLostError extends IdemError {
  static {
    brandErrorClass(this, 'LockLostError');
  }

  constructor(message: string, options?: { cause?: unknown }) {
    super('idem.lockLost', ExitCode.LockLost, message, options);
  }
}

/**
 * A chunk's commit was refused because a newer attempt took the run over (fencing).
 * Raised inside the chunk transaction so its work rolls back.
 */
export class FencedError extends IdemError {
  static {
    brandErrorClass(this, 'FencedError');
  }

  constructor(message: string) {
    super('idem.fenced', ExitCode.LockLost, message);
  }
}

/**
 * The `code` of anything thrown (a SQLSTATE, a Node errno, an IdemError's code) when it is a
 * string. Anything may be thrown, `null` and `undefined` included (`throw null`,
 * `Promise.reject()`): reading `.code` of those directly would throw in the handler itself.
 */
export function codeOf(err: unknown): string | undefined {
  if (err === null || (typeof err !== 'object' && typeof err !== 'function')) return undefined;
  const code = (err as { code?: unknown }).code;
  return typeof code === 'string' ? code : undefined;
}

/**
 * Maps any thrown value to the exit code the CLI should end with: an idem error's own (from any
 * copy of idem in the process, see {@link IdemError}), else 1.
 */
export function exitCodeOf(err: unknown): ExitCode {
  if (err instanceof IdemError && typeof err.exitCode === 'number') return err.exitCode;
  return ExitCode.Failed;
}

/**
 * A setting's value as a message quotes it: JSON, except for what JSON cannot show (NaN and
 * ±Infinity, which JSON.stringify makes "null"; undefined; a bigint), shown as JavaScript writes it.
 */
export function givenValue(value: unknown): string {
  if (typeof value === 'number' && !Number.isFinite(value)) return String(value);
  if (typeof value === 'bigint') return `${value}n`;
  return JSON.stringify(value) ?? String(value);
}

/** The longest error message idem records or prints, in characters (code points); longer ones end in `…`. */
export const MAX_MESSAGE_CHARS = 4000;

/** `message` cut to {@link MAX_MESSAGE_CHARS} code points (never inside a surrogate pair), `…` marking a cut. */
export function boundedMessage(message: string): string {
  if (message.length <= MAX_MESSAGE_CHARS) return message;
  const chars = Array.from(message);
  return chars.length <= MAX_MESSAGE_CHARS ? message : `${chars.slice(0, MAX_MESSAGE_CHARS - 1).join('')}…`;
}

/**
 * Extracts the message from anything thrown, whole (newlines kept: a chunk's multi-line error, a
 * pretty-printed JSON body), bounded by {@link MAX_MESSAGE_CHARS}; text outputs escape its control
 * characters (`visibleError`), `--json` keeps it. An Error without a message of its own says
 * what it holds instead: Node's refused connection to a host with several addresses (localhost is
 * ::1 and 127.0.0.1) is an AggregateError whose message is empty, its parts name each address.
 */
export function messageOf(err: unknown): string {
  let msg = err instanceof Error ? err.message : shownValue(err);
  if (msg === '' && err instanceof AggregateError && err.errors.length > 0) {
    msg = [...new Set(err.errors.map(messageOf))].join('; ');
  }
  if (msg === '' && err instanceof Error) {
    const code = codeOf(err);
    msg = code !== undefined ? `${err.constructor.name} ${code}` : err.constructor.name;
  }
  return boundedMessage(msg);
}

/**
 * A thrown value that is not an Error, as a message: a string or number as it is (`x`, `42`,
 * `null`), an object by its own string `message` when it has one (what libraries that throw plain
 * objects mean to say), else by its JSON (`{"status":500}`), never `[object Object]`.
 */
function shownValue(err: unknown): string {
  if (err !== null && typeof err === 'object') {
    const message = (err as { message?: unknown }).message;
    if (typeof message === 'string' && message !== '') return message;
    try {
      // A BigInt as its digits, a cycle as "[Circular]": JSON.stringify throws on both.
      const seen: object[] = [];
      const json = JSON.stringify(err, function (this: unknown, _key, value: unknown) {
        if (typeof value === 'bigint') return value.toString();
        if (value !== null && typeof value === 'object') {
          while (seen.length > 0 && seen[seen.length - 1] !== this) seen.pop();
          if (seen.includes(value)) return '[Circular]';
          seen.push(value);
        }
        return value;
      });
      if (typeof json === 'string' && json !== '{}') return json;
    } catch {
      // a getter or toJSON that throws: its string form below
    }
  }
  try {
    return String(err);
  } catch {
    return Object.prototype.toString.call(err); // an object without a prototype
  }
}

/**
 * A job's thrown value as idem can handle it: the value itself, unless reading it throws (an Error
 * whose `message` getter throws, a Proxy whose traps do), then an Error saying what reading it
 * threw. `use` does what idem does with the value first (masking, classifying); it throws too
 * when the value cannot be read.
 */
export function readableThrown<T>(thrown: unknown, use: (value: unknown) => T): T {
  try {
    const used = use(thrown);
    messageOf(used);
    return used;
  } catch (reading) {
    let why: string;
    try {
      why = messageOf(reading);
    } catch {
      why = 'unreadable too';
    }
    return use(new Error(`run() threw a value that cannot be read (reading it threw: ${why})`));
  }
}

/**
 * What a log line says of an error: its class (`DatabaseError`, `TypeError`; `string` for a thrown
 * string), its message (or `message`, already redacted by the caller; JSON keeps it one line), and its code (a SQLSTATE,
 * a Node errno) when it has one. No stack: a log line stays one line, and the message says where.
 */
export function errorFields(err: unknown, message: string = messageOf(err)): { type: string; message: string; code?: string } {
  const type = err instanceof Error ? err.constructor.name : typeof err;
  const code = codeOf(err);
  return code !== undefined ? { type, message, code } : { type, message };
}

/** The run is paused by an operator (`idem pause`); it resumes after `idem resume`. */
export class PausedError extends IdemError {
  static {
    brandErrorClass(this, 'PausedError');
  }

  constructor(message: string) {
    super('idem.paused', ExitCode.Busy, message);
  }
}

/**
 * The live attempt stopped for an operator's pause that `idem resume` withdrew while its in-flight
 * chunks finished: the run is `interrupted` (as a resumed paused run is), so the next invocation
 * continues it.
 */
export class PauseWithdrawnError extends IdemError {
  static {
    brandErrorClass(this, 'PauseWithdrawnError');
  }

  constructor(message: string) {
    super('idem.pauseWithdrawn', ExitCode.Busy, message);
  }
}

/** The run was cancelled by an operator (`idem cancel`); `idem reset` forgets it. */
export class CancelledError extends IdemError {
  static {
    brandErrorClass(this, 'CancelledError');
  }

  /** The run was cancelled before this invocation (it started no work): an operator's decision made already. */
  readonly earlier: boolean;

  constructor(message: string, opts: { readonly earlier?: boolean } = {}) {
    super('idem.cancelled', ExitCode.Failed, message);
    this.earlier = opts.earlier ?? false;
  }
}
