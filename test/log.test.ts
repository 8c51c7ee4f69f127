import pino, { type Logger } from 'pino';
import { describe, expect, it } from 'vitest';
import { lazyLogger, secretMask, structuredMask } from '../src/log.ts';

/** A pino logger writing its JSON lines into `lines`, time left out (it differs between two loggers). */
function capturing(lines: string[], level = 'info'): Logger {
  return pino({ level, timestamp: false, base: { pid: 1 } }, { write: (line: string) => void lines.push(line.trim()) });
}

/** The same calls on an eager pino logger and on a lazy one: both must write the same lines. */
function both(level: string, calls: (log: Logger) => void) {
  const eager: string[] = [];
  const lazy: string[] = [];
  let made = 0;
  calls(capturing(eager, level));
  calls(lazyLogger(level, () => (made++, capturing(lazy, level))));
  return { eager, lazy, made };
}

describe('lazyLogger', () => {
  it('makes no logger for calls at disabled levels nor for child loggers that write nothing', () => {
    const r = both('info', (log) => {
      log.debug('not written');
      log.trace({ a: 1 }, 'nor this');
      log.child({ job: 'j' }).debug('nor this');
    });
    expect(r.made).toBe(0);
    expect(r.lazy).toEqual(r.eager);
    expect(r.eager).toEqual([]);
  });

  it('writes what pino writes once a call is at an enabled level: bindings of children, levels given to a child', () => {
    const r = both('info', (log) => {
      log.debug('dropped');
      const child = log.child({ job: 'j', runKey: 'k' });
      child.info({ n: 1 }, 'started');
      child.child({ step: 's' }).warn('slow %s', 'chunk');
      child.child({ step: 'd' }, { level: 'debug' }).debug('detail');
      log.error(new Error('boom').message);
    });
    expect(r.made).toBe(1);
    expect(r.lazy).toEqual(r.eager);
    expect(r.eager).toHaveLength(4);
  });

  it('is no promise: awaiting it, or returning it from an async function, makes no logger', async () => {
    let made = 0;
    const log = lazyLogger('info', () => (made++, capturing([])));
    expect(await Promise.resolve(log)).toBe(log);
    expect(await (async () => log)()).toBe(log);
    expect(made).toBe(0);
  });

  it('is silent at level silent, and anything beyond the level methods reaches the real logger', () => {
    const r = both('silent', (log) => {
      log.fatal('nothing');
      expect(log.level).toBe('silent');
      expect(log.isLevelEnabled('error')).toBe(false);
      log.level = 'info';
      log.info('now written');
    });
    expect(r.made).toBe(1);
    expect(r.lazy).toEqual(r.eager);
    expect(r.eager).toHaveLength(1);
  });
});

describe('structuredMask', () => {
  it("masks a JSON document's values, never its field names, codes or layout; other text as a whole", () => {
    // Review of round 13's B2-12 fix: masking --json and API answers as text turned a password
    // that is also a word (idem, state) into *** in "code":"idem.busy" and in field names.
    const m = structuredMask(secretMask(['idem'])!);
    expect(m('{"status":"failed","runKey":"idem-x","error":{"code":"idem.busy","message":"job idem busy"}}\n')).toBe(
      '{"status":"failed","runKey":"***-x","error":{"code":"idem.busy","message":"job *** busy"}}\n',
    );
    expect(m('[\n  {\n    "idem": "idem"\n  }\n]\n')).toBe('[\n  {\n    "idem": "***"\n  }\n]\n');
    expect(m('idem: error: no run idem-x\n')).toBe('***: error: no run ***-x\n');
    expect(m('{"not json": idem')).toBe('{"not json": ***');
    const state = structuredMask(secretMask(['state'])!);
    expect(state('{"state":"running","note":"a state"}')).toBe('{"state":"running","note":"a ***"}');
  });
});
