import { existsSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { BusyError, DatabaseUnavailableError, RunFailedError, UsageError } from '../src/errors.ts';
import { describeConnectError } from '../src/database.ts';
import { StandbyError } from '../src/health-check.ts';
import {
  couldNotReachDatabase,
  couldNotStartYet,
  latestSlot,
  MAX_RETRY_SLOTS,
  parseCatchUp,
  parseSchedule,
  renderCrontab,
  runCronLoop,
  SlotBehindError,
  SlotTakenError,
  type Schedule,
  slotKey,
  slotOfJobKey,
  slotOfKey,
  slotsSince,
} from '../src/schedule.ts';

const at = (iso: string) => new Date(iso);
const keys = (dates: Date[]) => dates.map(slotKey);

function usageError(fn: () => unknown): UsageError {
  try {
    fn();
  } catch (err) {
    expect(err).toBeInstanceOf(UsageError);
    return err as UsageError;
  }
  throw new Error('expected a UsageError');
}

describe('parseSchedule', () => {
  it('reads a string as UTC and a spec with its zone, canonically spelled', () => {
    const utc = parseSchedule('0 3 * * *');
    expect([utc.cron, utc.timezone, utc.expression]).toEqual(['0 3 * * *', 'UTC', '0 3 * * *']);
    const berlin = parseSchedule({ cron: '30 2 * * *', timezone: 'europe/berlin' });
    expect(berlin.timezone).toBe('Europe/Berlin');
    expect(Object.isFrozen(berlin)).toBe(true);
  });

  it.skipIf(!existsSync('/usr/share/zoneinfo/Asia/Kathmandu'))('keeps a zone spelled as the system tzdata spells it, not ICU\'s older alias (Asia/Kathmandu, not Asia/Katmandu)', () => {
    // Node's ICU resolves Asia/Kathmandu to Asia/Katmandu, Europe/Kyiv to Europe/Kiev: names that
    // exist in tzdata only as backward links, which a CRON_TZ line then depends on.
    expect(parseSchedule({ cron: '*/2 * * * *', timezone: 'Asia/Kathmandu' }).timezone).toBe('Asia/Kathmandu');
    expect(parseSchedule({ cron: '0 3 * * *', timezone: 'Europe/Kyiv' }).timezone).toBe('Europe/Kyiv');
    // A spelling tzdata does not have as written still gets ICU's canonical one.
    expect(parseSchedule({ cron: '0 3 * * *', timezone: 'europe/kyiv' }).timezone).toMatch(/^Europe\/Ky?iev$|^Europe\/Kyiv$/);
    // The same slots either way.
    const a = parseSchedule({ cron: '*/2 * * * *', timezone: 'Asia/Kathmandu' });
    const b = parseSchedule({ cron: '*/2 * * * *', timezone: 'Asia/Katmandu' });
    expect(slotKey(latestSlot(a, at('2026-12-03T12:48:30Z')))).toBe(slotKey(latestSlot(b, at('2026-12-03T12:48:30Z'))));
  });

  it('expands nicknames and names into a portable 5-field expression', () => {
    expect(parseSchedule('@daily').cron).toBe('0 0 * * *');
    expect(parseSchedule('@yearly').cron).toBe('0 0 1 1 *');
    expect(parseSchedule('0 9 * jan-mar MON-FRI').cron).toBe('0 9 * 1-3 1-5');
  });

  it.each([
    ['0 0 3 * * *', /6 fields.*drop the seconds/],
    ['* * * *', /expected standard 5-field cron.*found 4 fields/],
    ['', /found nothing/],
    ['every day', /found 2 fields/],
    ['61 * * * *', /minute: 61/],
    ['0 0 L * *', /day-of-month field "L".*not standard cron/],
    ['0 0 * * MON#2', /day-of-week field "MON#2"/],
    ['0 0 31 2 *', /never matches/],
    ['@reboot', /not a time schedule/],
    ['5-1 * * * *', /From value is larger/],
  ])('rejects %j with a message naming it and the fix', (expr, why) => {
    const err = usageError(() => parseSchedule(expr));
    expect(err.code).toBe('idem.invalidSchedule');
    expect(err.message).toContain(`invalid schedule "${expr}"`);
    expect(err.message).toMatch(why);
  });

  it('rejects an unknown timezone and a non-string cron', () => {
    const err = usageError(() => parseSchedule({ cron: '0 3 * * *', timezone: 'Mars/Olympus' }));
    expect(err.message).toMatch(/unknown timezone "Mars\/Olympus".*IANA/);
    expect(usageError(() => parseSchedule({ cron: '0 3 * * *', timezone: '+01:00' })).message).toMatch(/not a zone name/);
    expect(usageError(() => parseSchedule({ cron: 42 } as never)).code).toBe('idem.invalidSchedule');
  });
});

describe('latestSlot', () => {
  it('returns the most recent slot of an hourly and a daily schedule, across a month boundary', () => {
    expect(slotKey(latestSlot(parseSchedule('15 * * * *'), at('2026-11-30T10:14:59.999Z')))).toBe('2026-11-30T09:15:00Z');
    expect(slotKey(latestSlot(parseSchedule('0 3 * * *'), at('2026-12-01T02:59:00Z')))).toBe('2026-11-30T03:00:00Z');
    expect(slotKey(latestSlot(parseSchedule('0 3 * * *'), at('2026-12-01T03:00:01Z')))).toBe('2026-12-01T03:00:00Z');
  });

  it('returns the slot itself when now is exactly on it, and the one before 1 ms earlier', () => {
    const daily = parseSchedule('0 3 * * *');
    expect(slotKey(latestSlot(daily, at('2026-11-30T03:00:00.000Z')))).toBe('2026-11-30T03:00:00Z');
    expect(slotKey(latestSlot(daily, at('2026-11-30T02:59:59.999Z')))).toBe('2026-11-29T03:00:00Z');
  });

  it('finds the slot of sparse schedules (yearly, leap day)', () => {
    expect(slotKey(latestSlot(parseSchedule('0 0 1 1 *'), at('2026-12-31T23:59:59Z')))).toBe('2026-01-01T00:00:00Z');
    expect(slotKey(latestSlot(parseSchedule('0 0 1 1 *'), at('2027-01-01T00:00:00Z')))).toBe('2027-01-01T00:00:00Z');
    expect(slotKey(latestSlot(parseSchedule('0 0 29 2 *'), at('2027-06-01T00:00:00Z')))).toBe('2024-02-29T00:00:00Z');
  });

  it('follows Europe/Berlin across the spring-forward change of 2026-03-29', () => {
    // 02:30 does not exist that day: a fixed-time job runs when the clock has jumped, 03:00 CEST.
    const nightly = parseSchedule({ cron: '30 2 * * *', timezone: 'Europe/Berlin' });
    expect(slotKey(latestSlot(nightly, at('2026-03-28T12:00:00Z')))).toBe('2026-03-28T01:30:00Z'); // 02:30 CET
    expect(slotKey(latestSlot(nightly, at('2026-03-29T12:00:00Z')))).toBe('2026-03-29T01:00:00Z'); // 03:00 CEST
    expect(slotKey(latestSlot(nightly, at('2026-03-30T12:00:00Z')))).toBe('2026-03-30T00:30:00Z'); // 02:30 CEST
    const daily = parseSchedule({ cron: '0 3 * * *', timezone: 'Europe/Berlin' });
    expect(slotKey(latestSlot(daily, at('2026-03-29T00:59:59Z')))).toBe('2026-03-28T02:00:00Z');
    expect(slotKey(latestSlot(daily, at('2026-03-29T01:00:00Z')))).toBe('2026-03-29T01:00:00Z');
  });

  it('follows Europe/Berlin across the fall-back change of 2026-10-25', () => {
    // 02:30 happens twice that day: a fixed-time job runs once, at the first (CEST) one.
    const nightly = parseSchedule({ cron: '30 2 * * *', timezone: 'Europe/Berlin' });
    expect(slotKey(latestSlot(nightly, at('2026-10-25T01:29:00Z')))).toBe('2026-10-25T00:30:00Z');
    expect(slotKey(latestSlot(nightly, at('2026-10-26T00:00:00Z')))).toBe('2026-10-25T00:30:00Z');
    // An hourly job runs in both passes of the repeated hour.
    const hourly = parseSchedule({ cron: '30 * * * *', timezone: 'Europe/Berlin' });
    expect(slotKey(latestSlot(hourly, at('2026-10-25T01:00:00Z')))).toBe('2026-10-25T00:30:00Z');
    expect(slotKey(latestSlot(hourly, at('2026-10-25T01:45:00Z')))).toBe('2026-10-25T01:30:00Z');
    expect(keys(slotsSince(hourly, { now: at('2026-10-25T03:00:00Z'), count: 4 }))).toEqual([
      '2026-10-24T23:30:00Z',
      '2026-10-25T00:30:00Z',
      '2026-10-25T01:30:00Z',
      '2026-10-25T02:30:00Z',
    ]);
  });

  it('agrees with walking forward over a year of a zoned schedule (no slot skipped or doubled)', () => {
    const s = parseSchedule({ cron: '0 */5 * * *', timezone: 'America/New_York' });
    let slot = latestSlot(s, at('2026-01-01T00:00:00Z'));
    for (let i = 0; i < 2000; i++) {
      const next = s.next(slot);
      expect(latestSlot(s, new Date(next.getTime() - 1))).toEqual(slot);
      expect(latestSlot(s, next)).toEqual(next);
      slot = next;
    }
  });
});

describe('slotsSince', () => {
  const hourly = parseSchedule('0 * * * *');
  const now = at('2026-12-01T01:30:00Z');

  it('returns the last N slots oldest first, ending with the latest, across a month boundary', () => {
    expect(keys(slotsSince(hourly, { now, count: 3 }))).toEqual(['2026-11-30T23:00:00Z', '2026-12-01T00:00:00Z', '2026-12-01T01:00:00Z']);
    expect(keys(slotsSince(hourly, { now }))).toEqual(['2026-12-01T01:00:00Z']);
  });

  it('returns every slot at or after since, inclusive of a slot exactly at since', () => {
    expect(keys(slotsSince(hourly, { now, since: at('2026-11-30T23:00:00Z') }))).toEqual(['2026-11-30T23:00:00Z', '2026-12-01T00:00:00Z', '2026-12-01T01:00:00Z']);
    expect(keys(slotsSince(hourly, { now, since: at('2026-11-30T23:00:00.001Z') }))).toEqual(['2026-12-01T00:00:00Z', '2026-12-01T01:00:00Z']);
    expect(slotsSince(parseSchedule('0 3 * * *'), { now, since: at('2026-12-01T00:00:00Z') })).toEqual([]);
  });

  // The documented cap (README: "at most 1 000"), not the constant: a changed constant must fail here.
  const MAX_CATCH_UP_SLOTS = 1000;
  it(`refuses more than ${MAX_CATCH_UP_SLOTS} slots, naming the cap`, () => {
    const minutely = parseSchedule('* * * * *');
    expect(slotsSince(minutely, { now, count: MAX_CATCH_UP_SLOTS })).toHaveLength(MAX_CATCH_UP_SLOTS);
    const byCount = usageError(() => slotsSince(minutely, { now, count: MAX_CATCH_UP_SLOTS + 1 }));
    expect(byCount.code).toBe('idem.catchUpTooLarge');
    expect(byCount.message).toContain(`more than ${MAX_CATCH_UP_SLOTS} slots`);
    const bySince = usageError(() => slotsSince(minutely, { now, ...parseCatchUp('1d', now) }));
    expect(bySince.message).toContain(`more than ${MAX_CATCH_UP_SLOTS} slots of schedule "* * * * *"`);
    expect(usageError(() => slotsSince(minutely, { now, count: 0 })).code).toBe('idem.invalidCatchUp');
  });
});

describe('parseCatchUp', () => {
  const now = at('2026-11-30T12:00:00Z');
  it('reads a count and the duration forms', () => {
    expect(parseCatchUp('3', now)).toEqual({ count: 3 });
    expect(parseCatchUp('90m', now)).toEqual({ since: at('2026-11-30T10:30:00Z') });
    expect(parseCatchUp('12h', now)).toEqual({ since: at('2026-11-30T00:00:00Z') });
    expect(parseCatchUp('3d', now)).toEqual({ since: at('2026-11-27T12:00:00Z') });
    expect(parseCatchUp('2w', now)).toEqual({ since: at('2026-11-16T12:00:00Z') });
  });

  it.each(['x', '', '0', '0h', '-3', '1.5', '3 days', '12H', '99999999999999999999'])('rejects %j naming the value', (value) => {
    const err = usageError(() => parseCatchUp(value, now));
    expect(err.code).toBe('idem.invalidCatchUp');
    expect(err.message).toContain('expected a number of slots or a duration like 12h, 3d');
    expect(err.message).toContain(`got "${value}"`);
  });
});

describe('slotKey', () => {
  it('is ISO UTC to the second', () => {
    expect(slotKey(at('2026-11-30T03:00:00.000Z'))).toBe('2026-11-30T03:00:00Z');
    expect(slotKey(latestSlot(parseSchedule({ cron: '0 4 * * *', timezone: 'Europe/Berlin' }), at('2026-11-30T12:00:00Z')))).toBe('2026-11-30T03:00:00Z');
  });
});

describe('renderCrontab', () => {
  const entries = [
    { job: 'nightly-report', schedule: parseSchedule('0 3 * * *') },
    { job: 'berlin-export', schedule: parseSchedule({ cron: '30 2 * * MON-FRI', timezone: 'Europe/Berlin' }) },
    { job: 'hourly-sync', schedule: parseSchedule('@hourly') },
  ];

  it('writes one line per job with cwd, command and log, and a CRON_TZ line at each change of zone', () => {
    const text = renderCrontab(entries, { cwd: '/srv/my app', command: 'npx idem', logFile: '/var/log/idem.log' });
    const lines = text.split('\n').filter((l) => l !== '' && !l.startsWith('#'));
    expect(lines).toEqual([
      'CRON_TZ=UTC',
      "0 3 * * * cd '/srv/my app' && npx idem run nightly-report >> /var/log/idem.log 2>&1",
      'CRON_TZ=Europe/Berlin',
      "30 2 * * 1-5 cd '/srv/my app' && npx idem run berlin-export >> /var/log/idem.log 2>&1",
      'CRON_TZ=UTC',
      "0 * * * * cd '/srv/my app' && npx idem run hourly-sync >> /var/log/idem.log 2>&1",
    ]);
    expect(text).toContain('# berlin-export: 30 2 * * MON-FRI (Europe/Berlin)');
    expect(text).toMatch(/# Exit codes: 0 done.*75 busy/s);
    expect(text).toMatch(/1 failed/);
    // A line run by hand runs the latest slot: the header says how to rerun a given one.
    expect(text).toContain("or by hand by its key\n# (a line run by hand runs the latest slot, not a given one), in '/srv/my app':\n#   npx idem run <job> --key 2026-11-30T03:00:00Z\n");
    expect(text).not.toMatch(/rerun the line by hand/);
    expect(text).toMatch(/Overlapping invocations are safe/);
    expect(text).toMatch(/CRON_TZ is honoured by\n# cronie/);
  });

  it('escapes % for cron, quotes paths, defaults the log file and passes --catch-up', () => {
    const text = renderCrontab(entries.slice(0, 1), { cwd: "/srv/o'neil", command: 'node bin/idem.js --log-level warn', catchUp: '2' });
    expect(text).toContain("cd '/srv/o'\\''neil' && node bin/idem.js --log-level warn run nightly-report --catch-up 2 >> idem-cron.log 2>&1");
    expect(text).toContain('# A failed or missed slot is retried by the next invocation (--catch-up 2 on each line), or by hand by its key');
    expect(renderCrontab(entries.slice(0, 1), { cwd: '/srv/100%', command: 'npx idem' })).toContain("cd '/srv/100\\%' &&");
    expect(usageError(() => renderCrontab(entries, { cwd: '/srv', command: 'npx idem\nrm -rf /' })).code).toBe('idem.invalidCrontab');
    expect(usageError(() => renderCrontab(entries, { cwd: '/srv', command: 'npx idem', catchUp: 'soon' })).code).toBe('idem.invalidCatchUp');
  });

  it('refuses a --catch-up that covers more than 1000 slots of a job, naming the job and the limit, instead of lines that fail at every tick', () => {
    // Black-box round 13 (B): crontab --catch-up 2000, or 2d on a minutely job, printed the lines
    // (exit 0), and each line then failed every time with "covers more than 1000 slots".
    const minutely = [...entries, { job: 'every-minute', schedule: parseSchedule('* * * * *') }];
    const byCount = usageError(() => renderCrontab(entries, { cwd: '/srv', command: 'npx idem', catchUp: '2000' }));
    expect(byCount.code).toBe('idem.catchUpTooLarge');
    expect(byCount.message).toBe('--catch-up 2000 covers more than 1000 slots of job "nightly-report" (schedule "0 3 * * *"), so its crontab line would fail at every tick; catch up at most 1000 slots at a time (a smaller count or a shorter duration)');
    const byDuration = usageError(() => renderCrontab(minutely, { cwd: '/srv', command: 'npx idem', catchUp: '2d' }));
    expect(byDuration.message).toBe('--catch-up 2d covers more than 1000 slots of job "every-minute" (schedule "* * * * *"), so its crontab line would fail at every tick; catch up at most 1000 slots at a time (a smaller count or a shorter duration)');
    // At the limit, and a duration that covers fewer slots, are fine.
    expect(renderCrontab(minutely, { cwd: '/srv', command: 'npx idem', catchUp: '1000' })).toContain('run every-minute --catch-up 1000 >>');
    expect(renderCrontab(minutely, { cwd: '/srv', command: 'npx idem', catchUp: '16h' })).toContain('run every-minute --catch-up 16h >>');
  });
});

describe('runCronLoop', () => {
  /**
   * A fake clock and timer: `sleep` waits for the clock to reach its end; once every loop is waiting
   * (nothing left to do until a macrotask), the clock jumps to the earliest end and wakes those
   * sleepers. `stopAt` aborts the loop once the clock reaches it.
   */
  function harness(startIso: string, stopAtIso: string) {
    let clock = at(startIso).getTime();
    const stopAt = at(stopAtIso).getTime();
    const controller = new AbortController();
    const sleeps: number[] = [];
    const calls: string[] = [];
    let sleepers: Array<{ until: number; wake: () => void }> = [];
    let pumping = false;
    const pump = () => {
      if (pumping) return;
      pumping = true;
      setImmediate(() => {
        pumping = false;
        if (sleepers.length === 0) return;
        clock = Math.max(clock, Math.min(...sleepers.map((x) => x.until)));
        if (clock >= stopAt) controller.abort();
        const due = sleepers.filter((x) => controller.signal.aborted || x.until <= clock);
        sleepers = sleepers.filter((x) => !due.includes(x));
        for (const x of due) x.wake();
        if (sleepers.length > 0) pump();
      });
    };
    const wait = (ms: number) =>
      new Promise<void>((wake) => {
        sleepers.push({ until: clock + ms, wake });
        pump();
      });
    return {
      controller,
      sleeps,
      calls,
      /** Records a runSlot call; a loop gone wild is stopped instead of spinning forever. */
      record: (call: string) => {
        calls.push(call);
        if (calls.length > 80) controller.abort();
      },
      now: () => new Date(clock),
      /** The clock jumps (a run that blocks the whole process, a clock set back). */
      advance: (ms: number) => {
        clock += ms;
      },
      /** Time passing for one caller only (a long run) while the others go on. */
      wait,
      /** The calls of one job, in order. */
      of: (job: string) => calls.filter((c) => c.startsWith(`${job}@`)),
      sleep: async (ms: number, signal: AbortSignal) => {
        expect(signal).toBe(controller.signal);
        sleeps.push(ms);
        await wait(ms);
      },
    };
  }

  const daily = parseSchedule('0 3 * * *');
  const hourly = parseSchedule('0 * * * *');

  it('a slot that failed is tried again at the next tick, before that tick\'s own slot', async () => {
    const h = harness('2026-11-30T10:20:00Z', '2026-11-30T12:30:00Z');
    let failures = 0;
    await runCronLoop({
      entries: [{ job: 'hourly', schedule: hourly }],
      runSlot: async (job, slot) => {
        h.record(`${job}@${slotKey(slot)}`);
        // The 10:00 slot fails once (exit 1), then succeeds when retried.
        if (slotKey(slot) === '2026-11-30T10:00:00Z' && failures++ === 0) throw new RunFailedError('boom');
      },
      onError: () => {},
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    expect(h.calls).toEqual(['hourly@2026-11-30T10:00:00Z', 'hourly@2026-11-30T10:00:00Z', 'hourly@2026-11-30T11:00:00Z', 'hourly@2026-11-30T12:00:00Z']);
  });

  it('a slot skipped because another run of its job held the job (SlotBehindError) is tried again at the next tick', async () => {
    const h = harness('2026-11-30T10:20:00Z', '2026-11-30T12:30:00Z');
    let busy = 0;
    await runCronLoop({
      entries: [{ job: 'hourly', schedule: hourly }],
      runSlot: async (job, slot) => {
        h.record(`${job}@${slotKey(slot)}`);
        if (slotKey(slot) === '2026-11-30T10:00:00Z' && busy++ === 0) throw new SlotBehindError(new BusyError('job "hourly" is running in another process'), 'the 09:00 slot');
      },
      onError: () => {},
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    expect(h.calls).toEqual(['hourly@2026-11-30T10:00:00Z', 'hourly@2026-11-30T10:00:00Z', 'hourly@2026-11-30T11:00:00Z', 'hourly@2026-11-30T12:00:00Z']);
  });

  it('a slot another process runs (SlotTakenError) is looked at again at each tick while it stays taken, and resumed once: a resume that fails is not tried again', async () => {
    // Black-box round 15: a slot a peer scheduler took and then died running was never finished.
    const h = harness('2026-11-30T10:20:00Z', '2026-11-30T14:30:00Z');
    const errors: string[] = [];
    let looks = 0;
    await runCronLoop({
      entries: [{ job: 'hourly', schedule: hourly }],
      runSlot: async (job, slot) => {
        h.record(`${job}@${slotKey(slot)}`);
        if (slotKey(slot) !== '2026-11-30T10:00:00Z') return;
        // Taken at start and at 11:00 (the peer still runs it); at 12:00 the peer is gone and the
        // resumed run fails: left to --catch-up, not tried at 13:00 or 14:00.
        if (looks++ < 2) throw new SlotTakenError(new BusyError('run 2026-11-30T10:00:00Z of job "hourly" is running in another process'));
        throw new RunFailedError('boom');
      },
      onError: (job, slot, err, again) => void errors.push(`${job}@${slotKey(slot)} ${(err as Error).name} again=${again}`),
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    expect(h.of('hourly')).toEqual([
      'hourly@2026-11-30T10:00:00Z',
      'hourly@2026-11-30T10:00:00Z', 'hourly@2026-11-30T11:00:00Z',
      'hourly@2026-11-30T10:00:00Z', 'hourly@2026-11-30T12:00:00Z',
      'hourly@2026-11-30T13:00:00Z', 'hourly@2026-11-30T14:00:00Z',
    ]);
    expect(errors).toEqual([
      'hourly@2026-11-30T10:00:00Z SlotTakenError again=true',
      'hourly@2026-11-30T10:00:00Z SlotTakenError again=true',
      'hourly@2026-11-30T10:00:00Z RunFailedError again=false',
    ]);
  });

  it('onError says whether the slot is tried again at the next tick: yes on its first failure, no when its retry fails too', async () => {
    const h = harness('2026-11-30T10:20:00Z', '2026-11-30T11:30:00Z');
    const errors: string[] = [];
    await runCronLoop({
      entries: [{ job: 'hourly', schedule: hourly }],
      runSlot: async (_job, slot) => {
        if (slotKey(slot) === '2026-11-30T10:00:00Z') throw new RunFailedError('boom');
      },
      onError: (job, slot, _err, again) => void errors.push(`${job}@${slotKey(slot)} again=${again}`),
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    expect(errors).toEqual(['hourly@2026-11-30T10:00:00Z again=true', 'hourly@2026-11-30T10:00:00Z again=false']);
  });

  it('a slot whose run could not reach the database is tried again after a short backoff, and at every tick, until it starts; a genuine usage error is not', async () => {
    // Black-box round 13: the database restarted over a slot boundary; the slot's run met
    // "connection refused" (exit 2, like bad input), was never tried again, and the slot was lost.
    const unreachable = () => new DatabaseUnavailableError('cannot reach the database at postgres://db/app: connection refused; start the server or fix DATABASE_URL', { cause: Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' }) });
    const minutely = parseSchedule('* * * * *');
    // The database is down from 10:00:55 to 10:03:10: the 10:01, 10:02 and 10:03 slots cannot start.
    const h = harness('2026-11-30T10:00:50Z', '2026-11-30T10:04:30Z');
    const down = (t: Date) => t >= at('2026-11-30T10:00:55Z') && t < at('2026-11-30T10:03:10Z');
    const errors: string[] = [];
    const ran: string[] = [];
    await runCronLoop({
      entries: [{ job: 'minutely', schedule: minutely }],
      runSlot: async (job, slot) => {
        h.record(`${job}@${slotKey(slot)}`);
        if (down(h.now())) throw unreachable();
        ran.push(`${slotKey(slot)} at ${h.now().toISOString().slice(11, 19)}`);
      },
      onError: (_job, slot, _err, again, retryInMs) => void errors.push(`${slotKey(slot)} at ${h.now().toISOString().slice(11, 19)} again=${again} retryInMs=${retryInMs}`),
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    // Every slot runs, once, oldest first, within the backoff's bound (30 s) of the database's
    // return, not a tick later.
    expect(ran.map((r) => r.slice(0, 20))).toEqual(['2026-11-30T10:00:00Z', '2026-11-30T10:01:00Z', '2026-11-30T10:02:00Z', '2026-11-30T10:03:00Z', '2026-11-30T10:04:00Z']);
    expect(ran[0]).toBe('2026-11-30T10:00:00Z at 10:00:50');
    for (const r of ran.slice(1, 4)) expect(r).toMatch(/ at 10:03:[1-3]\d$/);
    expect(ran[4]).toBe('2026-11-30T10:04:00Z at 10:04:00');
    // Each failure says when it is tried again: a backoff doubling from 1 s, cut at the next tick.
    expect(errors[0]).toBe('2026-11-30T10:01:00Z at 10:01:00 again=true retryInMs=1000');
    expect(errors.every((e) => e.includes('again=true retryInMs='))).toBe(true);
    expect(errors.slice(0, 7)).toEqual(
      ['10:01:00 again=true retryInMs=1000', '10:01:01 again=true retryInMs=2000', '10:01:03 again=true retryInMs=4000', '10:01:07 again=true retryInMs=8000', '10:01:15 again=true retryInMs=16000', '10:01:31 again=true retryInMs=29000', '10:02:00 again=true retryInMs=30000'].map((e) => `2026-11-30T10:01:00Z at ${e}`),
    );
    // While the database is down, one try of the oldest slot per wake, not of every kept slot.
    expect(h.of('minutely').length).toBeLessThan(30);

    // A usage error that is no trouble reaching the database (a missing privilege) is not retried.
    const h2 = harness('2026-11-30T10:20:00Z', '2026-11-30T12:30:00Z');
    const refusals: string[] = [];
    await runCronLoop({
      entries: [{ job: 'hourly', schedule: hourly }],
      runSlot: async (job, slot) => {
        h2.record(`${job}@${slotKey(slot)}`);
        if (slotKey(slot) === '2026-11-30T10:00:00Z') throw new DatabaseUnavailableError('role app may not use the runner schema "idem" (permission denied for table runs): …', { cause: Object.assign(new Error('permission denied for table runs'), { code: '42501' }) });
      },
      onError: (_job, slot, _err, again, retryInMs) => void refusals.push(`${slotKey(slot)} again=${again} retryInMs=${retryInMs}`),
      signal: h2.controller.signal,
      now: h2.now,
      sleep: h2.sleep,
    });
    expect(h2.calls).toEqual(['hourly@2026-11-30T10:00:00Z', 'hourly@2026-11-30T11:00:00Z', 'hourly@2026-11-30T12:00:00Z']);
    expect(refusals).toEqual(['2026-11-30T10:00:00Z again=false retryInMs=undefined']);
  });

  it('past MAX_RETRY_SLOTS kept slots, the oldest dropped is said (onDropped), naming the slot; the rest still run', async () => {
    // Left from black-box round 13: a database down longer than 24 ticks dropped the oldest kept
    // slots without a word, so nobody knew to run them by hand.
    const unreachable = () => new DatabaseUnavailableError('cannot reach the database at postgres://db/app: connection refused; start the server or fix DATABASE_URL', { cause: Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' }) });
    // Down from 10:00:30 to 10:27:10: the 27 slots 10:01 … 10:27 cannot start; 24 are kept.
    const h = harness('2026-11-30T10:00:20Z', '2026-11-30T10:28:30Z');
    const down = (t: Date) => t >= at('2026-11-30T10:00:30Z') && t < at('2026-11-30T10:27:10Z');
    const ran: string[] = [];
    const dropped: string[] = [];
    await runCronLoop({
      entries: [{ job: 'minutely', schedule: parseSchedule('* * * * *') }],
      runSlot: async (_job, slot) => {
        if (down(h.now())) throw unreachable();
        ran.push(slotKey(slot));
      },
      onError: () => {},
      onDropped: (job, slot) => void dropped.push(`${job}@${slotKey(slot)} at ${h.now().toISOString().slice(11, 16)}`),
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    expect(MAX_RETRY_SLOTS).toBe(24);
    expect(dropped).toEqual(['minutely@2026-11-30T10:01:00Z at 10:25', 'minutely@2026-11-30T10:02:00Z at 10:26', 'minutely@2026-11-30T10:03:00Z at 10:27']);
    const minute = (m: number) => `2026-11-30T10:${String(m).padStart(2, '0')}:00Z`;
    expect(ran).toEqual([minute(0), ...Array.from({ length: 25 }, (_, i) => minute(i + 4))]);
  });

  it('a slot whose run met a standby (a failover under way) is tried again with the same backoff until the server is primary again', async () => {
    // Black-box round 13 (B3): during a failover DATABASE_URL answered, but as a standby in
    // recovery (the old primary being demoted, the new one still being promoted); the slot's run was
    // refused (exit 2, idem.standby), never tried again, and the slot was lost.
    const standby = () => new StandbyError('the database is a standby (in recovery) and cannot take writes; point DATABASE_URL at the primary');
    const h = harness('2026-11-30T10:59:50Z', '2026-11-30T11:30:00Z');
    const errors: string[] = [];
    await runCronLoop({
      entries: [{ job: 'hourly', schedule: hourly }],
      runSlot: async (job, slot) => {
        if (h.now() >= at('2026-11-30T11:00:00Z') && h.now() < at('2026-11-30T11:00:20Z')) throw standby();
        h.record(`${job}@${slotKey(slot)} at ${h.now().toISOString().slice(11, 19)}`);
      },
      onError: (_job, slot, _err, again, retryInMs) => void errors.push(`${slotKey(slot)} at ${h.now().toISOString().slice(11, 19)} again=${again} retryInMs=${retryInMs}`),
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    expect(errors.map((e) => e.slice(21))).toEqual(['at 11:00:00 again=true retryInMs=1000', 'at 11:00:01 again=true retryInMs=2000', 'at 11:00:03 again=true retryInMs=4000', 'at 11:00:07 again=true retryInMs=8000', 'at 11:00:15 again=true retryInMs=16000']);
    expect(h.calls).toEqual(['hourly@2026-11-30T10:00:00Z at 10:59:50', 'hourly@2026-11-30T11:00:00Z at 11:00:31']);
    expect(couldNotStartYet(standby())).toBe(true);
    // A database that sets default_transaction_read_only is configuration, not a failover.
    expect(couldNotStartYet(new UsageError('readOnlyDefault', 'the role or database sets default_transaction_read_only = on, …'))).toBe(false);
  });

  it('an hourly slot that could not reach the database runs once the database is back, minutes later, not at the next tick', async () => {
    const unreachable = () => new DatabaseUnavailableError('cannot reach the database at postgres://db/app: no answer within 10 s (…)', { cause: new Error('Connection terminated due to connection timeout') });
    const h = harness('2026-11-30T10:59:50Z', '2026-11-30T11:30:00Z');
    await runCronLoop({
      entries: [{ job: 'hourly', schedule: hourly }],
      runSlot: async (job, slot) => {
        if (h.now() >= at('2026-11-30T11:00:00Z') && h.now() < at('2026-11-30T11:04:00Z')) throw unreachable();
        h.record(`${job}@${slotKey(slot)} at ${h.now().toISOString().slice(11, 19)}`);
      },
      onError: () => {},
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    expect(h.calls).toHaveLength(2);
    expect(h.calls[0]).toBe('hourly@2026-11-30T10:00:00Z at 10:59:50');
    // Within the backoff's bound (30 s) of the database's return.
    expect(h.calls[1]).toMatch(/^hourly@2026-11-30T11:00:00Z at 11:04:[0-2]\d$/);
  });

  it('a long run of one job does not hold up the other jobs\' slots: each job keeps its own schedule', async () => {
    const h = harness('2026-12-03T12:46:24Z', '2026-12-03T12:52:30Z');
    const minutely = parseSchedule('* * * * *');
    await runCronLoop({
      entries: [{ job: 'long', schedule: minutely }, { job: 'tick', schedule: minutely }],
      runSlot: async (job, slot) => {
        h.record(`${job}@${slotKey(slot)} at ${h.now().toISOString().slice(11, 19)}`);
        // Each run of `long` takes 100 s: two of `tick`'s minutes pass meanwhile.
        if (job === 'long') await h.wait(100_000);
      },
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    // Every minute of tick's runs at its minute while long runs (before, tick waited for each of
    // long's runs: it ran 12:46 only at 12:48:04, and never 12:47).
    expect(h.of('tick')).toEqual([
      'tick@2026-12-03T12:46:00Z at 12:46:24',
      'tick@2026-12-03T12:47:00Z at 12:47:00',
      'tick@2026-12-03T12:48:00Z at 12:48:00',
      'tick@2026-12-03T12:49:00Z at 12:49:00',
      'tick@2026-12-03T12:50:00Z at 12:50:00',
      'tick@2026-12-03T12:51:00Z at 12:51:00',
      'tick@2026-12-03T12:52:00Z at 12:52:00',
    ]);
    // long falls behind its own schedule and runs only its latest due slot after each run.
    expect(h.of('long')).toEqual(['long@2026-12-03T12:46:00Z at 12:46:24', 'long@2026-12-03T12:48:00Z at 12:48:04', 'long@2026-12-03T12:49:00Z at 12:49:44', 'long@2026-12-03T12:51:00Z at 12:51:24']);
  });

  it('side by side: a job whose loop throws is reported and stops, the others go on; 12 jobs add no listener-leak warning; an aborted signal runs nothing', async () => {
    const h = harness('2026-12-03T12:46:24Z', '2026-12-03T12:49:30Z');
    const minutely = parseSchedule('* * * * *');
    const broken: Schedule = { ...minutely, next: () => { throw new Error('no slot after this one'); } };
    const errors: string[] = [];
    const warnings: string[] = [];
    const onWarning = (w: Error) => void warnings.push(w.name);
    process.on('warning', onWarning);
    try {
      await runCronLoop({
        entries: [{ job: 'broken', schedule: broken }, ...Array.from({ length: 12 }, (_, i) => ({ job: `j${i}`, schedule: minutely }))],
        runSlot: async (job, slot) => void h.record(`${job}@${slotKey(slot)}`),
        onError: (job, _slot, err) => void errors.push(`${job}: ${(err as Error).message}`),
        signal: h.controller.signal,
        now: h.now,
        sleep: h.sleep,
      });
      await new Promise((r) => setImmediate(r));
    } finally {
      process.off('warning', onWarning);
    }
    expect(errors).toEqual(['broken: no slot after this one']);
    expect(h.of('broken').length).toBeLessThanOrEqual(1);
    expect(h.of('j0')).toEqual(['j0@2026-12-03T12:46:00Z', 'j0@2026-12-03T12:47:00Z', 'j0@2026-12-03T12:48:00Z', 'j0@2026-12-03T12:49:00Z']);
    expect(h.of('j11')).toHaveLength(4);
    expect(warnings).not.toContain('MaxListenersExceededWarning');

    const aborted = new AbortController();
    aborted.abort();
    const calls: string[] = [];
    await runCronLoop({ entries: [{ job: 'daily', schedule: daily }], runSlot: async (job) => void calls.push(job), signal: aborted.signal });
    expect(calls).toEqual([]);
  });

  it('runs the latest due slot at start, then each next slot in order, and stops on abort', async () => {
    const h = harness('2026-11-30T10:20:00Z', '2026-11-30T13:30:00Z');
    await runCronLoop({
      entries: [{ job: 'daily', schedule: daily }, { job: 'hourly', schedule: hourly }],
      runSlot: async (job, slot) => void h.record(`${job}@${slotKey(slot)}`),
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    expect(h.calls).toEqual([
      'daily@2026-11-30T03:00:00Z',
      'hourly@2026-11-30T10:00:00Z',
      'hourly@2026-11-30T11:00:00Z',
      'hourly@2026-11-30T12:00:00Z',
      'hourly@2026-11-30T13:00:00Z',
    ]);
    // The documented bound: never more than 60 s asleep at a time (README, idem cron).
    expect(Math.max(...h.sleeps)).toBeLessThanOrEqual(60_000);
  });

  it('runs every job due at the same instant, and an error in one does not stop the other or the loop', async () => {
    const h = harness('2026-11-30T22:59:00Z', '2026-12-01T03:00:30Z');
    const errors: string[] = [];
    await runCronLoop({
      entries: [{ job: 'flaky', schedule: hourly }, { job: 'daily', schedule: daily }],
      runSlot: async (job, slot) => {
        h.record(`${job}@${slotKey(slot)}`);
        if (job === 'flaky') throw new Error(`boom ${slotKey(slot)}`);
      },
      onError: (job, slot, err) => void errors.push(`${job}@${slotKey(slot)}: ${(err as Error).message}`),
      signal: h.controller.signal,
      now: h.now,
      sleep: h.sleep,
    });
    // Each failed slot is tried once more, at the next tick, before that tick's own slot. The jobs
    // keep their schedules side by side: the order within each job is what counts.
    expect(h.of('daily')).toEqual(['daily@2026-11-30T03:00:00Z', 'daily@2026-12-01T03:00:00Z']);
    expect(h.of('flaky')).toEqual([
      'flaky@2026-11-30T22:00:00Z',
      'flaky@2026-11-30T22:00:00Z',
      'flaky@2026-11-30T23:00:00Z',
      'flaky@2026-11-30T23:00:00Z',
      'flaky@2026-12-01T00:00:00Z',
      'flaky@2026-12-01T00:00:00Z',
      'flaky@2026-12-01T01:00:00Z',
      'flaky@2026-12-01T01:00:00Z',
      'flaky@2026-12-01T02:00:00Z',
      'flaky@2026-12-01T02:00:00Z',
      'flaky@2026-12-01T03:00:00Z',
    ]);
    expect(errors).toHaveLength(11);
    expect(errors[0]).toBe('flaky@2026-11-30T22:00:00Z: boom 2026-11-30T22:00:00Z');
  });

  it('sleeps again when the clock is set back, and runs only the latest slot after a long run', async () => {
    const h = harness('2026-11-30T10:20:00Z', '2026-11-30T16:30:00Z');
    let setBack = false;
    await runCronLoop({
      entries: [{ job: 'hourly', schedule: hourly }],
      runSlot: async (job, slot) => {
        h.record(`${job}@${slotKey(slot)}`);
        // The 11:00 run takes 3.5 hours: 12:00, 13:00 and 14:00 pass while it runs.
        if (slotKey(slot) === '2026-11-30T11:00:00Z') h.advance(3.5 * 3_600_000);
      },
      signal: h.controller.signal,
      now: () => {
        const t = h.now();
        // Once, at 16:00, NTP sets the clock 10 minutes back: nothing may run before 16:00 comes again.
        if (!setBack && t.getTime() >= at('2026-11-30T16:00:00Z').getTime()) {
          setBack = true;
          h.advance(-10 * 60_000);
          return h.now();
        }
        return t;
      },
      sleep: h.sleep,
    });
    expect(h.calls).toEqual(['hourly@2026-11-30T10:00:00Z', 'hourly@2026-11-30T11:00:00Z', 'hourly@2026-11-30T14:00:00Z', 'hourly@2026-11-30T15:00:00Z', 'hourly@2026-11-30T16:00:00Z']);
  });

  it('returns at once when aborted while sleeping with the default sleep, and refuses an empty schedule', async () => {
    const controller = new AbortController();
    const calls: string[] = [];
    const loop = runCronLoop({ entries: [{ job: 'daily', schedule: daily }], runSlot: async (job) => void calls.push(job), signal: controller.signal });
    await new Promise((r) => setTimeout(r, 20));
    controller.abort();
    await loop;
    expect(calls).toEqual(['daily']);
    await expect(runCronLoop({ entries: [] as { job: string; schedule: Schedule }[], runSlot: async () => {}, signal: controller.signal })).rejects.toMatchObject({
      code: 'idem.noScheduledJobs',
    });
  });
});

describe('slotOfKey far in the future', () => {
  it('a slot-shaped key past what the schedule can compute is "not due yet", a usage error (not the failure of the schedule itself)', () => {
    // croner finds no slot after year 2999: the off-schedule check threw "has no slot after …",
    // an HTTP 500 and a CLI exit 1.
    const hourly = parseSchedule('0 * * * *');
    const now = at('2026-12-02T08:00:00Z');
    for (const key of ['3000-01-01T00:00:00Z', '9999-12-31T22:30:00Z', '9999-12-31T23:00:00Z']) {
      const err = usageError(() => slotOfKey(hourly, 'hourly', key, now));
      expect(err.code).toBe('idem.invalidKey');
      expect(err.message).toBe(`--key ${key} is a slot of job "hourly" that is not due yet; the latest due slot is 2026-12-02T08:00:00Z: pass a due slot, or a key that is not a UTC time`);
    }
  });
});

describe('slotOfKey of a slot-shaped key that is no real time', () => {
  it('month 13, 30 February, hour 24, minute or second 60, day 00 are refused (idem.invalidKey) naming the field and the latest due slot, never taken as an ordinary key', () => {
    const hourly = parseSchedule('0 * * * *');
    const now = at('2026-12-02T08:30:00Z');
    const cases: Array<[string, string]> = [
      ['2026-13-01T00:00:00Z', 'there is no month 13'],
      ['2026-00-01T00:00:00Z', 'there is no month 00'],
      ['2026-02-30T05:00:00Z', 'February 2026 has 28 days'],
      ['2028-02-30T05:00:00Z', 'February 2028 has 29 days'],
      ['2026-04-31T05:00:00Z', 'April 2026 has 30 days'],
      ['2026-12-00T05:00:00Z', 'there is no day 00'],
      ['2026-12-02T24:00:00Z', 'there is no hour 24 (00 to 23)'],
      ['2026-12-02T04:60:00Z', 'there is no minute 60 (00 to 59)'],
      ['2026-12-02T04:00:60Z', 'there is no second 60 (00 to 59)'],
      // Beyond what croner computes too: still named for what it is.
      ['9999-13-01T00:00:00Z', 'there is no month 13'],
    ];
    for (const [key, problem] of cases) {
      const err = usageError(() => slotOfKey(hourly, 'hourly', key, now));
      expect(err.code).toBe('idem.invalidKey');
      expect(err.message).toBe(`--key ${key} is shaped like a slot of job "hourly", but is not a real time (${problem}); pass a slot of its schedule (the latest due is 2026-12-02T08:00:00Z), or a key that is not a UTC time`);
      expect(() => slotOfJobKey({ name: 'hourly', schedule: '0 * * * *' }, key, 'Idempotency-Key', now)).toThrow(`Idempotency-Key ${key} is shaped like a slot`);
    }
    // A job without a schedule takes any key as an ordinary one.
    expect(slotOfJobKey({ name: 'plain' }, '2026-13-01T00:00:00Z')).toBeNull();
  });
});

describe('couldNotReachDatabase: which refusals idem cron tries again', () => {
  // Review of the cron retry: PgBouncer reports a database name it does not know (and, in older
  // versions, refused credentials) as 08P01, connection trouble by its class: cron tried such a slot
  // again forever, though the README says configuration errors are not retried.
  const url = 'postgres://app:pw@127.0.0.1:6432/app';
  const pg = (code: string, message: string) => Object.assign(new Error(message), { code });
  it('an outage: refused, reset, a server starting or shutting down', () => {
    for (const err of [pg('ECONNREFUSED', 'connect ECONNREFUSED 127.0.0.1:6432'), pg('57P03', 'the database system is starting up'), pg('57P01', 'terminating connection due to administrator command'), new Error('Connection terminated unexpectedly')]) {
      expect(couldNotReachDatabase(describeConnectError(err, url)), err.message).toBe(true);
    }
  });
  it('configuration a pooler reports as 08P01, credentials, a missing database: not tried again', () => {
    for (const err of [pg('08P01', 'no such database: ap'), pg('08P01', 'password authentication failed'), pg('28P01', 'password authentication failed for user "app"'), pg('3D000', 'database "ap" does not exist')]) {
      expect(couldNotReachDatabase(describeConnectError(err, url)), err.message).toBe(false);
    }
  });
});
