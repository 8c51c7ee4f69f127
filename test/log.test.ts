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

describe("secretForms: the password file's passwords for the connection", () => {
  it('are those of the lines for the URL (host, port, database, user, `*`, escapes), pg\'s among them; none when the URL or PGPASSWORD gives one', async () => {
    const { mkdtemp, rm, writeFile } = await import('node:fs/promises');
    const { tmpdir } = await import('node:os');
    const path = (await import('node:path')).default;
    const { secretForms } = await import('../src/database.ts');
    const { createRequire } = await import('node:module');
    const pgpass = createRequire(createRequire(import.meta.url).resolve('pg'))('pgpass') as (conn: object, cb: (pw: string | undefined) => void) => void;
    const pg = (await import('pg')).default;
    const pgReads = (url: string) => new Promise<string | undefined>((resolve) => pgpass((new pg.Client(url) as unknown as { connectionParameters: object }).connectionParameters, resolve));
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-pgpass-unit-'));
    const saved = { PGPASSFILE: process.env.PGPASSFILE, PGPASSWORD: process.env.PGPASSWORD };
    try {
      const file = path.join(dir, 'pgpass');
      const lines = ['otherhost:5432:*:*:by-host-xx', 'db:6000:*:*:by-port-xx', 'db:5432:app:bob:by-user-xx', 'db:5432:app:alice:pa\\:ss-alice', 'db:*:*:*:fallback-xx'];
      await writeFile(file, `${lines.join('\n')}\n`, { mode: 0o600 });
      process.env.PGPASSFILE = file;
      delete process.env.PGPASSWORD;
      // Each URL with the lines that are its own: every one is masked (libpq takes the first,
      // pgpass 1.0.5 the last it reads), and the one pg takes is among them.
      const cases: Array<[string, string[]]> = [
        ['postgres://alice@db:5432/app', ['fallback-xx', 'pa:ss-alice']],
        ['postgres://alice@db/app', ['fallback-xx', 'pa:ss-alice']],
        ['postgres://bob@db/app', ['by-user-xx', 'fallback-xx']],
        ['postgres://carol@db:6000/app', ['by-port-xx', 'fallback-xx']],
        ['postgres://carol@otherhost/x', ['by-host-xx']],
        ['postgres://carol@db:7000/x', ['fallback-xx']],
        ['postgres://carol@elsewhere/x', []],
      ];
      for (const [url, own] of cases) {
        expect([...secretForms(url)].sort(), url).toEqual(own);
        const taken = await pgReads(url);
        if (taken !== undefined) expect(own, url).toContain(taken);
      }
      // pg does not read the file when the URL or PGPASSWORD gives a password.
      expect(new Set(secretForms('postgres://alice:given-pw@db/app'))).toEqual(new Set(['given-pw']));
      process.env.PGPASSWORD = 'env-pw';
      expect(secretForms('postgres://alice@db/app')).toEqual(['env-pw']);
    } finally {
      for (const [k, v] of Object.entries(saved)) {
        if (v === undefined) delete process.env[k];
        else process.env[k] = v;
      }
      await rm(dir, { recursive: true, force: true });
    }
  });
});
