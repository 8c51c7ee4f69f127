import { getMaxListeners, setMaxListeners } from 'node:events';
import { existsSync } from 'node:fs';
import path from 'node:path';
import { Cron } from 'croner';
import { BusyError, ExitCode, exitCodeOf, messageOf, UsageError } from './errors.ts';
import { isConnectionTrouble } from './retry.ts';
import { SLOT_KEY_SOURCE } from './run-key.ts';
import { shellQuote } from './shell-quote.ts';
import { sleep as abortableSleep } from './sleep.ts';

/**
 * A job's schedule with its timezone.
 * @example { cron: '0 3 * * *', timezone: 'Europe/Berlin' }
 */
export interface ScheduleSpec {
  /** Standard 5-field cron: minute hour day-of-month month day-of-week (or @daily, @hourly…). */
  readonly cron: string;
  /** IANA zone the fields are read in. Defaults to `'UTC'` (`DEFAULT_TIMEZONE`). */
  readonly timezone?: string;
}

/**
 * What a job declares: a cron expression (read in UTC) or a spec with a timezone.
 * @example schedule: '0 3 * * *'
 */
export type ScheduleInput = string | ScheduleSpec;

/** A parsed schedule. Slots are whole-second instants; the one API over croner idem uses. */
export interface Schedule {
  /** The expression as declared, for messages. */
  readonly expression: string;
  /** The same schedule as a portable 5-field expression: nicknames expanded, month and day names as numbers. */
  readonly cron: string;
  /** Canonical IANA zone, e.g. `UTC`, `Europe/Berlin`. */
  readonly timezone: string;
  /** The first slot strictly after `instant`. */
  next(instant: Date): Date;
  /** The last slot strictly before `instant`. */
  previous(instant: Date): Date;
}

/** A job and its parsed schedule, as `renderCrontab` and `runCronLoop` take them. */
export interface ScheduledJob {
  readonly job: string;
  readonly schedule: Schedule;
}

export const DEFAULT_TIMEZONE = 'UTC';
/** Most slots one `--catch-up` may run: beyond it a typo (`--catch-up 30d` on a per-minute job) would queue weeks of work. */
export const MAX_CATCH_UP_SLOTS = 1000;
/** Relative to the crontab line's `cd`; `*.log` is what projects usually ignore already. */
export const DEFAULT_CRONTAB_LOG_FILE = 'idem-cron.log';
/**
 * The cron loop never sleeps longer than this at once: a timer does not advance while the host is
 * suspended and setTimeout caps at ~24.8 days, so long sleeps are cut up and the wall clock re-read.
 */
export const CRON_LOOP_MAX_SLEEP_MS = 60_000;

const FIELD_NAMES = ['minute', 'hour', 'day-of-month', 'month', 'day-of-week'] as const;
const MONTH_NAMES = ['JAN', 'FEB', 'MAR', 'APR', 'MAY', 'JUN', 'JUL', 'AUG', 'SEP', 'OCT', 'NOV', 'DEC'];
const DAY_NAMES = ['SUN', 'MON', 'TUE', 'WED', 'THU', 'FRI', 'SAT'];
const NICKNAMES: Readonly<Record<string, string>> = {
  '@yearly': '0 0 1 1 *',
  '@annually': '0 0 1 1 *',
  '@monthly': '0 0 1 * *',
  '@weekly': '0 0 * * 0',
  '@daily': '0 0 * * *',
  '@midnight': '0 0 * * *',
  '@hourly': '0 * * * *',
};
// What every cron accepts. croner also takes L, W, #, ? and +, but a crontab line could not carry them.
const PLAIN_FIELD = /^[0-9*,/-]+$/;
const ZONE_NAME = /^[A-Za-z][A-Za-z0-9_+-]*(?:\/[A-Za-z0-9_+-]+)*$/;
const FIVE_FIELDS = 'standard 5-field cron (minute hour day-of-month month day-of-week), e.g. "0 3 * * *"';

function invalid(expression: string, problem: string, cause?: unknown): UsageError {
  return new UsageError('invalidSchedule', `invalid schedule "${expression}": ${problem}`, cause === undefined ? undefined : { cause });
}

function replaceNames(field: string, names: readonly string[], first: number): string {
  return field.replace(/[A-Za-z]+/g, (word) => {
    const i = names.indexOf(word.toUpperCase());
    return i < 0 ? word : String(i + first);
  });
}

function normalizeCron(expression: string): string {
  const trimmed = expression.trim();
  if (trimmed.startsWith('@')) {
    const expanded = NICKNAMES[trimmed.toLowerCase()];
    if (expanded) return expanded;
    throw invalid(expression, `not a time schedule; use ${Object.keys(NICKNAMES).join(', ')} or ${FIVE_FIELDS}`);
  }
  const fields = trimmed.split(/\s+/);
  if (fields.length === 6 || fields.length === 7) {
    throw invalid(expression, `it has ${fields.length} fields, but schedules have minute resolution: drop the seconds${fields.length === 7 ? ' and year' : ''} field and use ${FIVE_FIELDS}`);
  }
  if (fields.length !== 5) throw invalid(expression, `expected ${FIVE_FIELDS}; found ${trimmed === '' ? 'nothing' : `${fields.length} field${fields.length === 1 ? '' : 's'}`}`);
  return fields
    .map((field, i) => {
      const plain = i === 3 ? replaceNames(field, MONTH_NAMES, 1) : i === 4 ? replaceNames(field, DAY_NAMES, 0) : field;
      if (!PLAIN_FIELD.test(plain)) {
        const names = i === 3 ? ', JAN-DEC' : i === 4 ? ', SUN-SAT' : '';
        throw invalid(expression, `${FIELD_NAMES[i]} field "${field}" may only hold numbers${names}, *, ",", "-" and "/" (L, W, #, ? and + are not standard cron)`);
      }
      return plain;
    })
    .join(' ');
}

function canonicalZone(zone: unknown, expression: string): string {
  const fix = 'use an IANA zone name such as "Europe/Berlin", or "UTC"';
  if (typeof zone !== 'string' || !ZONE_NAME.test(zone)) throw invalid(expression, `timezone ${JSON.stringify(zone)} is not a zone name; ${fix}`);
  let resolved: string;
  try {
    resolved = new Intl.DateTimeFormat('en-US', { timeZone: zone }).resolvedOptions().timeZone;
  } catch (err) {
    throw invalid(expression, `unknown timezone "${zone}"; ${fix}`, err);
  }
  // A CRON_TZ line is read by the system's tzdata, which is case-sensitive: a name it has as written
  // is kept. ICU's canonical spelling otherwise ("europe/berlin" → "Europe/Berlin"), not always:
  // it resolves Asia/Kathmandu to Asia/Katmandu and Europe/Kyiv to Europe/Kiev, names tzdata keeps
  // only as backward links.
  // Only another name, not another case of the same one: a case-insensitive file system (macOS)
  // would find `europe/berlin` too.
  return resolved.toLowerCase() !== zone.toLowerCase() && existsSync(path.join(process.env.TZDIR || '/usr/share/zoneinfo', zone)) ? zone : resolved;
}

/**
 * Parses what a job declares as `schedule`. Throws `UsageError` (`idem.invalidSchedule`) naming the
 * expression and the fix for anything but standard 5-field cron in a known zone, and for
 * expressions that never match (`0 0 31 2 *`).
 * @example parseSchedule({ cron: '30 2 * * *', timezone: 'Europe/Berlin' })
 */
export function parseSchedule(input: ScheduleInput): Schedule {
  const spec: Partial<ScheduleSpec> | null = typeof input === 'string' ? { cron: input } : input;
  if (!spec || typeof spec !== 'object' || typeof spec.cron !== 'string') {
    throw new UsageError('invalidSchedule', `schedule must be a cron expression such as "0 3 * * *" or { cron, timezone }, got ${JSON.stringify(input)}`);
  }
  const expression = spec.cron;
  const cron = normalizeCron(expression);
  const timezone = canonicalZone(spec.timezone ?? DEFAULT_TIMEZONE, expression);
  let croner: Cron;
  try {
    // No callback and paused: croner only computes dates here and never starts a timer.
    // 'no-wildcard' treats `30 2,14 * * *` as fixed-time across DST, as Vixie cron and cronie do.
    croner = new Cron(cron, { paused: true, mode: '5-part', timezone, fixedTimeRule: 'no-wildcard' });
  } catch (err) {
    throw invalid(expression, `${messageOf(err).replace(/^CronPattern: /, '')}; use ${FIVE_FIELDS}`, err);
  }
  if (croner.nextRun(new Date(Date.UTC(2000, 0, 1))) === null) {
    throw invalid(expression, 'it never matches a date (check day-of-month against month)');
  }
  const noSlot = (where: string, instant: Date) => new Error(`schedule "${expression}" (${timezone}) has no slot ${where} ${instant.toISOString()}`);
  return Object.freeze({
    expression,
    cron,
    timezone,
    next(instant: Date): Date {
      const slot = croner.nextRun(instant);
      if (!slot) throw noSlot('after', instant);
      return slot;
    },
    previous(instant: Date): Date {
      const slot = croner.previousRuns(1, instant)[0];
      if (!slot) throw noSlot('before', instant);
      return slot;
    },
  });
}

/**
 * The most recent slot at or before `now`: the slot a run started now belongs to. A `now` exactly
 * on a slot returns that slot.
 */
export function latestSlot(schedule: Schedule, now: Date = new Date()): Date {
  // croner's previous search excludes an exact match, so search from 1 ms later.
  let slot = schedule.previous(new Date(now.getTime() + 1));
  while (slot > now) slot = schedule.previous(slot);
  // The loop and catch-up walk forward with next(); settle on the slot that walk would reach, so a
  // backward search that disagreed around a DST change can never make the two pick different keys.
  for (let n = schedule.next(slot); n <= now; n = schedule.next(slot)) slot = n;
  return slot;
}

/**
 * The slots `--catch-up` runs, oldest first, ending with `latestSlot(now)`: the last `count` slots
 * (default 1), or every slot at or after `since` (none when no slot falls in the window).
 * Throws `UsageError` (`idem.catchUpTooLarge`) past `MAX_CATCH_UP_SLOTS`.
 */
export function slotsSince(schedule: Schedule, opts: { readonly now?: Date; readonly count?: number; readonly since?: Date } = {}): Date[] {
  const now = opts.now ?? new Date();
  if (opts.count !== undefined && opts.since !== undefined) throw new TypeError('slotsSince: pass count or since, not both');
  const latest = latestSlot(schedule, now);
  const tooMany = (what: string) =>
    new UsageError('catchUpTooLarge', `--catch-up ${what} covers more than ${MAX_CATCH_UP_SLOTS} slots of schedule "${schedule.expression}"; catch up at most ${MAX_CATCH_UP_SLOTS} slots at a time (a smaller count or a shorter duration)`);
  let from: Date;
  let count = Infinity;
  if (opts.since !== undefined) {
    from = opts.since;
  } else {
    count = opts.count ?? 1;
    if (!Number.isInteger(count) || count < 1) throw new UsageError('invalidCatchUp', `--catch-up count must be an integer >= 1, got ${count}`);
    if (count > MAX_CATCH_UP_SLOTS) throw tooMany(String(count));
    from = latest;
    for (let i = 1; i < count; i++) from = schedule.previous(from);
  }
  const slots: Date[] = [];
  // Walk forward from `from` (inclusive): the order and slots the cron loop would have produced.
  for (let s = schedule.next(new Date(from.getTime() - 1)); s <= latest; s = schedule.next(s)) {
    slots.push(s);
    if (slots.length > MAX_CATCH_UP_SLOTS) throw tooMany(`since ${slotKey(from)}`);
  }
  return slots.length > count ? slots.slice(-count) : slots;
}

const DURATION_MS: Readonly<Record<string, number>> = { m: 60_000, h: 3_600_000, d: 86_400_000, w: 604_800_000 };

/**
 * Reads `--catch-up`: `"3"` is the last 3 slots; `"90m"`, `"12h"`, `"3d"`, `"2w"` are the slots
 * since that long before `now` (a day is 24 h, not a calendar day).
 */
export function parseCatchUp(value: string, now: Date = new Date()): { count: number } | { since: Date } {
  const m = /^\s*(\d+)([mhdw]?)\s*$/.exec(value);
  const n = m ? Number(m[1]) : NaN;
  if (!m || !Number.isSafeInteger(n) || n < 1) {
    throw new UsageError('invalidCatchUp', `--catch-up expected a number of slots or a duration like 12h, 3d (units m, h, d, w); got "${value}"`);
  }
  const unit = m[2];
  return unit ? { since: new Date(now.getTime() - n * DURATION_MS[unit]!) } : { count: n };
}

/** The run key of a scheduled run: the slot in UTC, to the second. @example '2026-11-30T03:00:00Z' */
export function slotKey(slot: Date): string {
  return slot.toISOString().replace(/\.\d{3}Z$/, 'Z');
}

const SLOT_KEY = new RegExp(SLOT_KEY_SOURCE);

/**
 * A date and time as ISO 8601 / RFC 3339 spell it, in any of the ways other than SLOT_KEY's:
 * fractional seconds (JavaScript's toISOString() writes `.000Z`), an offset (`+00:00`), no
 * seconds, a lower-case `t`/`z`, a space for the `T`. For a scheduled job such a key is a time a
 * client meant as a slot, as surely as the slot spelling; taken as an ordinary key it ran the slot
 * a second time, with ctx.slot null (black-box round 19).
 */
const TIME_KEY = /^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:[Zz]|[+-]\d{2}(?::?\d{2})?)$/;

/** A key of a scheduled job that TIME_KEY reads as a time but is not spelled as a slot key: refused, naming the slot spelling. */
function otherTimeSpelling(schedule: Schedule, job: string, key: string, now: Date, keyName: string): UsageError {
  const normal = key.replace(/^(.{10})[t ]/i, '$1T').replace(/[zZ]$/, 'Z').replace(',', '.');
  const withSeconds = /T\d{2}:\d{2}(?:Z|[+-])/.test(normal) ? normal.replace(/(T\d{2}:\d{2})/, '$1:00') : normal;
  const at = new Date(Date.parse(withSeconds));
  const slot = Number.isFinite(at.getTime()) && at <= now && schedule.next(new Date(at.getTime() - 1)).getTime() === at.getTime() ? slotKey(at) : null;
  return new UsageError(
    'invalidKey',
    `${keyName} ${key} is a time spelled otherwise than the slot keys of job "${job}" (UTC to the second, like ${slotKey(latestSlot(schedule, now))}, the latest due); ${slot ? `pass ${slot} for that slot` : 'pass a slot so spelled'}, or a key that is not a time`,
  );
}

/**
 * The slot an explicit run key (`--key`) of a scheduled job names, or null when the key is not a
 * slot key (the format `slotKey` writes, a real UTC time): `idem run job --key 2026-11-30T03:00:00Z`
 * is that slot's run, with `ctx.slot` set, as cron would have run it. A key of that format that is
 * not a slot of the schedule, or a slot not due yet at `now`, is a UsageError (exit 2): the first is
 * almost surely a typo of one (named in the message), and the second would be recorded done before
 * its time, so the due slot's run (cron's) would find it done. A time spelled otherwise (`.000Z`,
 * `+00:00`, no seconds) is refused too, naming the slot spelling (TIME_KEY).
 */
export function slotOfKey(schedule: Schedule, job: string, key: string, now: Date = new Date(), keyName = '--key'): Date | null {
  if (!SLOT_KEY.test(key)) {
    if (TIME_KEY.test(key)) throw otherTimeSpelling(schedule, job, key, now, keyName);
    return null;
  }
  const at = new Date(Date.parse(key));
  if (!Number.isFinite(at.getTime()) || slotKey(at) !== key) {
    // The slot format at a time that does not exist (month 13, 30 February, hour 24) is a typo of
    // a slot as surely as one off the schedule: taken as an ordinary key, it ran with ctx.slot null.
    throw new UsageError(
      'invalidKey',
      `${keyName} ${key} is shaped like a slot of job "${job}", but is not a real time (${notARealTime(key)}); pass a slot of its schedule (the latest due is ${slotKey(latestSlot(schedule, now))}), or a key that is not a UTC time`,
    );
  }
  // Not due first: a key beyond what the schedule can compute (croner stops at year 2999) is
  // refused as not due, where asking the schedule about it failed with its own error.
  if (at > now) {
    throw new UsageError('invalidKey', `${keyName} ${key} is a slot of job "${job}" that is not due yet; the latest due slot is ${slotKey(latestSlot(schedule, now))}: pass a due slot, or a key that is not a UTC time`);
  }
  if (schedule.next(new Date(at.getTime() - 1)).getTime() !== at.getTime()) {
    throw new UsageError(
      'invalidKey',
      `${keyName} ${key} is shaped like a slot of job "${job}", but its schedule (${schedule.expression}, ${schedule.timezone}) does not fire then; the nearest slots are ${slotKey(schedule.previous(at))} and ${slotKey(schedule.next(at))}: pass one of them, or a key that is not a UTC time`,
    );
  }
  return at;
}

const MONTHS = ['January', 'February', 'March', 'April', 'May', 'June', 'July', 'August', 'September', 'October', 'November', 'December'];

/** What makes a key of the slot format (SLOT_KEY) no real UTC time: the first field out of its range. */
function notARealTime(key: string): string {
  const [year, month, day, hour, minute, second] = key.match(/\d+/g)!.map(Number) as [number, number, number, number, number, number];
  const two = (n: number) => String(n).padStart(2, '0');
  if (month < 1 || month > 12) return `there is no month ${two(month)}`;
  if (day < 1) return `there is no day ${two(day)}`;
  const days = month === 2 ? (isLeapYear(year) ? 29 : 28) : new Date(Date.UTC(2001, month, 0)).getUTCDate();
  if (day > days) return `${MONTHS[month - 1]} ${String(year).padStart(4, '0')} has ${days} days`;
  if (hour > 23) return `there is no hour ${two(hour)} (00 to 23)`;
  if (minute > 59) return `there is no minute ${two(minute)} (00 to 59)`;
  if (second > 59) return `there is no second ${two(second)} (00 to 59)`;
  return 'not a valid UTC time';
}

const isLeapYear = (y: number) => (y % 4 === 0 && y % 100 !== 0) || y % 400 === 0;

/**
 * `slotOfKey` for a job: null for a job without a schedule, and (before its schedule is parsed)
 * for a key not shaped like a slot key. So `idem finalize --key` and a POST's Idempotency-Key run a
 * slot of the schedule as that slot, as `idem run --key` does. `keyName`: how a refusal names the key.
 */
export function slotOfJobKey(job: { readonly name: string; readonly schedule?: ScheduleInput }, key: string, keyName = '--key', now: Date = new Date()): Date | null {
  if (job.schedule === undefined || !(SLOT_KEY.test(key) || TIME_KEY.test(key))) return null;
  return slotOfKey(parseSchedule(job.schedule), job.name, key, now, keyName);
}

/** Options of `renderCrontab`. */
export interface CrontabOptions {
  /** Folder each line changes into: the project root, where the jobs folder is. */
  readonly cwd: string;
  /** How to start idem there, inserted as is, e.g. `npx idem` or `/usr/local/bin/idem --schema ops`. */
  readonly command: string;
  /** File the output is appended to, relative to `cwd`. Defaults to `DEFAULT_CRONTAB_LOG_FILE`. */
  readonly logFile?: string;
  /**
   * Passed as `--catch-up`, so each invocation also retries earlier slots that failed
   * (done ones are no-ops), e.g. `'2'`. Defaults to none: only the latest slot runs.
   */
  readonly catchUp?: string;
}

export { shellQuote };

/**
 * Crontab lines that run every scheduled job with `idem run <job>` (the run key is the slot, so a
 * line firing twice for one slot is a no-op). Zoned jobs get `CRON_TZ=` lines.
 */
export function renderCrontab(entries: ReadonlyArray<ScheduledJob>, opts: CrontabOptions): string {
  for (const [name, value] of [['cwd', opts.cwd], ['command', opts.command], ['logFile', opts.logFile ?? '']] as const) {
    if (/[\r\n]/.test(value)) throw new UsageError('invalidCrontab', `crontab ${name} must be one line, got ${JSON.stringify(value)}`);
  }
  if (opts.cwd === '' || opts.command.trim() === '') throw new UsageError('invalidCrontab', 'renderCrontab needs a cwd and a command such as "npx idem"');
  if (opts.catchUp !== undefined) {
    // Each line runs `idem run <job> --catch-up N`: one that covers more slots than a catch-up may
    // would fail at every tick, so it is refused here (a duration: the slots its window holds now).
    const window = parseCatchUp(opts.catchUp);
    const tooMany = ({ job, schedule }: ScheduledJob, cause?: unknown) =>
      new UsageError(
        'catchUpTooLarge',
        `--catch-up ${opts.catchUp} covers more than ${MAX_CATCH_UP_SLOTS} slots of job "${job}" (schedule "${schedule.expression}"), so its crontab line would fail at every tick; catch up at most ${MAX_CATCH_UP_SLOTS} slots at a time (a smaller count or a shorter duration)`,
        cause === undefined ? undefined : { cause },
      );
    for (const entry of entries) {
      if ('count' in window) {
        if (window.count > MAX_CATCH_UP_SLOTS) throw tooMany(entry);
        continue;
      }
      try {
        slotsSince(entry.schedule, window);
      } catch (err) {
        throw err instanceof UsageError && err.code === 'idem.catchUpTooLarge' ? tooMany(entry, err) : err;
      }
    }
  }
  const log = opts.logFile ?? DEFAULT_CRONTAB_LOG_FILE;
  const lines = [
    '# idem scheduled jobs. Each line runs `idem run <job>`, whose run key is the slot time in UTC',
    '# (e.g. 2026-11-30T03:00:00Z), so a slot never runs twice.',
    '# Exit codes: 0 done, or already done (a no-op); 75 busy: another run holds the job\'s lock, harmless,',
    '# that run does the work; 1 failed: progress is kept and the slot resumes where it stopped when run',
    '# again; 2 usage: fix the job or flags, nothing ran.',
    opts.catchUp !== undefined
      ? `# A failed or missed slot is retried by the next invocation (--catch-up ${opts.catchUp} on each line), or by hand by its key`
      : '# A failed or missed slot is retried by --catch-up (idem crontab --catch-up N puts it on each line), or by hand by its key',
    `# (a line run by hand runs the latest slot, not a given one), in ${shellQuote(opts.cwd)}:`,
    `#   ${opts.command} run <job> --key 2026-11-30T03:00:00Z`,
    '# Overlapping invocations are safe: the lock lets one process run a job at a time.',
    '# cron reads times in the system timezone unless a CRON_TZ= line precedes them. CRON_TZ is honoured by',
    '# cronie and other Vixie-cron derivatives (see man 5 crontab); a cron that ignores it fires in the',
    '# system zone instead, and slots then run late (at most one period), never twice; or use `idem cron`.',
    "# cron's environment is minimal: set PATH (for node) and DATABASE_URL above these lines.",
  ];
  if (entries.length === 0) lines.push('# no job declares a schedule');
  let zone: string | undefined;
  for (const { job, schedule } of entries) {
    lines.push('', `# ${job}: ${schedule.expression} (${schedule.timezone})`);
    // CRON_TZ holds for every line after it, so each change of zone is written, UTC included.
    if (schedule.timezone !== zone) lines.push(`CRON_TZ=${schedule.timezone}`);
    zone = schedule.timezone;
    const catchUp = opts.catchUp !== undefined ? ` --catch-up ${shellQuote(opts.catchUp)}` : '';
    const command = `cd ${shellQuote(opts.cwd)} && ${opts.command} run ${shellQuote(job)}${catchUp} >> ${shellQuote(log)} 2>&1`;
    // cron turns an unescaped % into a newline.
    lines.push(`${schedule.cron} ${command.replace(/%/g, '\\%')}`);
  }
  return `${lines.join('\n')}\n`;
}

/** Options of `runCronLoop`. */
export interface CronLoopOptions {
  readonly entries: ReadonlyArray<ScheduledJob>;
  /** Runs one slot of one job (the CLI: `runner.run(job, { key: slotKey(slot) })`). */
  readonly runSlot: (job: string, slot: Date) => Promise<void>;
  /** Ends the loop: after the current runSlot (which should watch it too), or at once while sleeping. */
  readonly signal: AbortSignal;
  /** Defaults to `() => new Date()`. */
  readonly now?: () => Date;
  /** Defaults to a setTimeout the signal cuts short; it keeps the process alive on purpose. */
  readonly sleep?: (ms: number, signal: AbortSignal) => Promise<void>;
  /**
   * Gets every error runSlot throws, also an interruption after `signal` aborted. `again`: the slot
   * is kept to be tried again (false when this was its one retry, or the error is not one to
   * retry). `retryInMs`: set when the slot's run could not reach the database (see
   * `waitsForDatabase`): it is tried again in that many ms, then until it starts. Defaults to one
   * line on stderr.
   */
  readonly onError?: (job: string, slot: Date, err: unknown, again: boolean, retryInMs?: number) => void;
  /**
   * Whether a failed slot is tried again, once, at the job's next tick (before that tick's own slot).
   * Defaults to: failed runs (exit 1), runs that lost their lock (69), a slot held up by another run
   * of its job (`SlotBehindError`) and a slot another process is running (`SlotTakenError`, looked
   * at again at every tick while that process runs it, see there); not bad input, or a paused or
   * cancelled run.
   */
  readonly retryFailed?: (err: unknown) => boolean;
  /**
   * Whether a slot's run could not start because the database could not be reached: it is tried
   * again after a short backoff (`CRON_UNREACHABLE_RETRY_MS`, doubling up to
   * `CRON_UNREACHABLE_RETRY_MAX_MS`, never past the job's next tick) and at every tick, until it
   * starts or is no longer among the `MAX_RETRY_SLOTS` kept. Defaults to `couldNotStartYet`: also a
   * database that answers as a standby, during a failover.
   */
  readonly waitsForDatabase?: (err: unknown) => boolean;
  /**
   * Gets each slot dropped from the kept ones, the oldest, when more than `MAX_RETRY_SLOTS` of a
   * job wait to be tried again (a database down for more ticks than that): nothing tries it again,
   * so it is said. Defaults to one line on stderr.
   */
  readonly onDropped?: (job: string, slot: Date) => void;
}

/** Most failed slots per job kept for retry by the cron loop; older ones are left to --catch-up. */
export const MAX_RETRY_SLOTS = 24;
/** First wait before a slot whose run could not reach the database is tried again; it doubles. */
export const CRON_UNREACHABLE_RETRY_MS = 1_000;
/** Longest wait between tries of a slot whose run could not reach the database. */
export const CRON_UNREACHABLE_RETRY_MAX_MS = 30_000;

function retryByDefault(err: unknown): boolean {
  // A run an operator cancelled exits 1 as a failed one does: their decision, not tried again.
  if (err instanceof Error && (err as { code?: unknown }).code === 'idem.cancelled') return false;
  const code = exitCodeOf(err);
  return code === ExitCode.Failed || code === ExitCode.LockLost || err instanceof SlotBehindError || err instanceof SlotTakenError;
}

/**
 * The run could not start because the database could not be reached (refused, unreachable, no
 * answer, starting or shutting down, no connection free, the session ended as it opened): exit 2
 * like bad input, but nothing about the job or its flags is wrong, and the slot's run can start
 * once the database is back. Not a genuine refusal: wrong credentials, a missing privilege or
 * database, a pooler without sessions, an unknown host.
 */
export function couldNotReachDatabase(err: unknown): boolean {
  // PgBouncer says "no such database", and on older versions refuses credentials, as 08P01, which
  // is connection trouble by its class: configuration, not an outage, and never tried again.
  return exitCodeOf(err) === ExitCode.Usage && isConnectionTrouble(err) && !/no such database|no such user|password authentication failed|SASL authentication failed|auth failed/i.test(messageOf(err));
}

/**
 * The run could not start for now: the database could not be reached (`couldNotReachDatabase`), or
 * it answered as a standby in recovery (`StandbyError`): during a failover DATABASE_URL can point
 * at the old primary being demoted, or at the new one still being promoted, and the slot's run can
 * start once the server is a primary again. `idem cron` tries such a slot again until it starts.
 */
export function couldNotStartYet(err: unknown): boolean {
  // By its code: health-check.ts (StandbyError's module) would bring kysely into every job file's load.
  return couldNotReachDatabase(err) || (err instanceof UsageError && err.code === 'idem.standby');
}

/**
 * A slot that found its job held by another run of it (an earlier slot still running, a run by
 * hand): not run now, and, unlike a slot another scheduler took, not run by anyone else either, so
 * it is tried again at the job's next tick (then left to --catch-up). `other` names that run.
 */
export class SlotBehindError extends Error {
  readonly other: string;
  /** `busy`: the refusal the slot's run met (its `cause`); its message without the advice to idem run. */
  constructor(busy: Error, other: string) {
    super(busy instanceof BusyError ? busy.reason : busy.message, { cause: busy });
    this.name = 'SlotBehindError';
    this.other = other;
  }
}

/**
 * A slot whose run another process (a peer scheduler, a run by hand) holds: not run here now. That
 * process may die before it finishes the run, and nobody else would resume it, so the slot is
 * looked at again at the job's next tick, and at each one after while that process still runs it:
 * then it is found done (a no-op), still taken, or resumed here, once, as a failed slot is (its
 * chunks done stay done; an operator's pause or cancel is honoured).
 */
export class SlotTakenError extends Error {
  /** `busy`: the refusal the slot's run met (its `cause`). */
  constructor(busy: Error) {
    super(busy instanceof BusyError ? busy.reason : busy.message, { cause: busy });
    this.name = 'SlotTakenError';
  }
}

function reportDropToStderr(job: string, slot: Date): void {
  process.stderr.write(`idem cron: ${droppedSlotMessage(job, slot)}\n`);
}

/** What `idem cron` says of a slot dropped from the retries (see `onDropped`). */
export function droppedSlotMessage(job: string, slot: Date): string {
  return `job "${job}" slot ${slotKey(slot)} is no longer tried again: more than ${MAX_RETRY_SLOTS} of its slots wait for a retry; run it by hand (idem run ${shellQuote(job)} --key ${slotKey(slot)}) or with --catch-up`;
}

function reportToStderr(job: string, slot: Date, err: unknown): void {
  process.stderr.write(`idem cron: job "${job}" slot ${slotKey(slot)} failed: ${messageOf(err)}\n`);
}

/**
 * The in-process scheduler of `idem cron`. Each job keeps its own schedule, side by side with the
 * others: it first runs its latest due slot (a no-op if done), then sleeps until its next slot and
 * runs it, and so on, so a long run of one job never holds up another job's slots. A job that falls
 * behind (a run longer than its period, a clock jump) runs only its latest due slot, as at start;
 * `--catch-up` is the way to run missed ones. Errors go to `onError` and never stop the loop; a slot
 * that failed is tried again once, at the job's next tick (see `retryFailed`), a slot another process
 * runs is looked at again at each tick until it is done or resumed here (see `SlotTakenError`), and a slot whose run
 * could not reach the database is tried again until it starts (see `waitsForDatabase`). Resolves once
 * `signal` aborts and every job's run in flight has returned.
 */
export async function runCronLoop(opts: CronLoopOptions): Promise<void> {
  const { entries, runSlot, signal } = opts;
  const now = opts.now ?? (() => new Date());
  const sleep = opts.sleep ?? abortableSleep;
  const onError = opts.onError ?? reportToStderr;
  if (entries.length === 0) {
    throw new UsageError('noScheduledJobs', 'no job declares a schedule; add one to a job definition, e.g. schedule: "0 3 * * *"');
  }
  const retryFailed = opts.retryFailed ?? retryByDefault;
  const waitsForDatabase = opts.waitsForDatabase ?? couldNotStartYet;
  const onDropped = opts.onDropped ?? reportDropToStderr;
  if (signal.aborted) return;
  // Every job's loop sleeps on the signal at once: not a listener leak past Node's default of 10.
  setMaxListeners(Math.max(getMaxListeners(signal), entries.length + 10), signal);
  const jobLoop = async ({ job, schedule }: ScheduledJob): Promise<void> => {
    /**
     * Slots of this job kept to be tried again, oldest first: those whose run failed, once, at its
     * next tick; those whose run could not reach the database (`unreachable`), after a short backoff
     * and at every tick, until they start.
     */
    const kept: Array<{ slot: Date; unreachable: boolean }> = [];
    // Tries in a row that could not reach the database (the backoff doubles), and when the
    // unreachable slots are tried next.
    let unreachableTries = 0;
    let retryAt = Infinity;
    /** Runs one slot; false when its run could not reach the database. `isRetry`: a failed slot's one retry. */
    const attempt = async (slot: Date, isRetry = false): Promise<boolean> => {
      const i = kept.findIndex((k) => k.slot.getTime() === slot.getTime());
      if (i >= 0) kept.splice(i, 1);
      try {
        await runSlot(job, slot);
        unreachableTries = 0;
        return true;
      } catch (err) {
        // A run that could not reach the database did not start: nothing is wrong with the slot,
        // and it is kept until it starts. A run that failed is tried again once: a slot that fails
        // its retry too is left to --catch-up, so a job that fails for good costs at most two runs
        // a tick, not one more for every tick it failed.
        const unreachable = !signal.aborted && waitsForDatabase(err);
        // A slot still taken by a live run of another process is watched, not retried: found
        // taken again at a tick, it is kept for the next one; its one retry is the run resumed here.
        const again = unreachable || (!signal.aborted && (!isRetry || err instanceof SlotTakenError) && retryFailed(err));
        let retryInMs: number | undefined;
        if (unreachable) {
          // The job's next tick tries it too, if that comes first.
          const t = now();
          retryInMs = Math.min(CRON_UNREACHABLE_RETRY_MS * 2 ** unreachableTries++, CRON_UNREACHABLE_RETRY_MAX_MS, schedule.next(t).getTime() - t.getTime());
          retryAt = t.getTime() + retryInMs;
        } else unreachableTries = 0;
        if (again) {
          kept.push({ slot, unreachable });
          kept.sort((a, b) => a.slot.getTime() - b.slot.getTime());
          if (kept.length > MAX_RETRY_SLOTS) {
            const dropped = kept.shift()!;
            try {
              onDropped(job, dropped.slot);
            } catch {
              // A failing reporter must not end the scheduler either.
            }
          }
        }
        try {
          onError(job, slot, err, again, retryInMs);
        } catch {
          // A failing reporter must not end the scheduler either.
        }
        return !unreachable;
      }
    };
    /**
     * Tries the kept slots that `which` picks, oldest first, each before `before`; while the
     * database still cannot be reached, one try does for all (the others wait with it).
     */
    const retryKept = async (which: (k: { unreachable: boolean }) => boolean, before: Date): Promise<void> => {
      for (const k of [...kept]) {
        if (signal.aborted || k.slot.getTime() >= before.getTime()) break;
        if (which(k) && !(await attempt(k.slot, !k.unreachable))) break;
      }
    };
    // last: the newest slot handed to runSlot; the next slot is the first after it.
    let last = latestSlot(schedule, now());
    await attempt(last);
    while (!signal.aborted) {
      const next = schedule.next(last);
      // Re-read the clock after every sleep: a clock set back means sleeping again, not running early.
      for (let t = now().getTime(); t < next.getTime() && !signal.aborted; t = now().getTime()) {
        // Between ticks, only the slots whose run could not reach the database, on their backoff.
        const waiting = kept.some((k) => k.unreachable);
        if (waiting && t >= retryAt) {
          await retryKept((k) => k.unreachable, next);
          continue;
        }
        await sleep(Math.min(next.getTime() - t, CRON_LOOP_MAX_SLEEP_MS, waiting ? retryAt - t : Infinity), signal);
      }
      if (signal.aborted) return;
      // Never behind `next`, whatever latestSlot says: every pass must move the job forward.
      const latest = latestSlot(schedule, now());
      last = latest > next ? latest : next;
      // A tick: first the kept slots (a failed one once), then the tick's own.
      await retryKept(() => true, last);
      if (!signal.aborted) await attempt(last);
    }
  };
  // A job whose loop throws (a schedule with no slot after the last one, a clock that fails) is
  // reported and stops; the other jobs go on.
  await Promise.all(
    entries.map((e) =>
      jobLoop(e).catch((err: unknown) => {
        try {
          onError(e.job, now(), err, false);
        } catch {
          // A failing reporter must not end the scheduler either.
        }
      }),
    ),
  );
}
