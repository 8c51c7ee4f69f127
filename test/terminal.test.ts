import { describe, expect, it } from 'vitest';
import { formatProgressBar } from '../src/progress-reporter.ts';
import { formatLogLine } from '../src/terminal-log.ts';
import { truncate } from '../src/terminal.ts';

const at = Date.UTC(2026, 10, 30, 18, 11, 35);
const event = (fields: Record<string, unknown>) => JSON.stringify({ level: 30, time: at, pid: 42, hostname: 'h', ...fields });

describe('log lines on a terminal', () => {
  it('are one line per event; the job, run key and attempt appear once, in a header, until they change', () => {
    const state = {};
    const run = { job: 'counted', runKey: 'k1', attempt: 2 };
    const first = formatLogLine(event({ ...run, step: 'work', msg: 'step started' }), state).split('\n');
    const time = new Date(at).toTimeString().slice(0, 8);
    expect(first).toEqual(['── job counted · run key k1 · attempt 2', `${time} info  step started step=work`]);
    expect(formatLogLine(event({ ...run, step: 'work', msg: 'step done' }), state)).toBe(`${time} info  step done step=work`);
    expect(formatLogLine(event({ ...run, attempt: 3, msg: 'run succeeded', chunks: 5 }), state).split('\n')).toEqual([
      '── job counted · run key k1 · attempt 3',
      `${time} info  run succeeded chunks=5`,
    ]);
  });

  it('keep the level and quote values with spaces; an error shows its message', () => {
    const line = formatLogLine(JSON.stringify({ level: 50, time: at, msg: 'run failed', err: { message: 'boom here', stack: 'x' }, chunk: 'c 1' }), {});
    expect(line).toMatch(/ error run failed err="boom here" chunk="c 1"$/);
  });

  it("leave the characters ordinary in free text in a message as they are, and escape the zero-width ones", () => {
    // Review of round 13's B2-11 fix: every log message on a terminal showed a Russian number's
    // no-break space as \u00a0 ("1\u00a0234 rows"), a Persian word's non-joiner, a Hebrew mark.
    const msg = 'processed 1\u00a0234 rows \u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645 \u05e9\u05dc\u05d5\u05dd\u200f \u3000end';
    const line = formatLogLine(JSON.stringify({ level: 30, time: at, msg }), {});
    expect(line).toContain(msg);
    expect(formatLogLine(JSON.stringify({ level: 30, time: at, msg: 'a\u200bb\u00adc\u2060d' }), {})).toContain('a\\u200bb\\u00adc\\u2060d');
    // A key in a field keeps every escape (two keys differing by a no-break space stay apart).
    expect(formatLogLine(JSON.stringify({ level: 30, time: at, msg: 'x', chunk: 'a\u00a0b' }), {})).toMatch(/ chunk="?a\\u00a0b"?$/);
  });

  it('pass a line that is not JSON through', () => {
    expect(formatLogLine('plain text\n', {})).toBe('plain text');
  });
});

describe('the progress bar', () => {
  const p = { runKey: 'k', attempt: 1, step: 'work', stepIndex: 1, steps: 3, done: 25, planned: 100, estimated: null, fullyPlanned: true, executedNow: 20, since: 0 };
  it('shows the step, a bar of done/planned, the rate and the ETA', () => {
    expect(formatProgressBar(p, 10_000, 10)).toBe('step 2/3 work ███░░░░░░░ 25/100 chunks · 2.0/s · ETA 38s');
  });
  it('marks an estimate with ~ and an unknown ETA with ?', () => {
    expect(formatProgressBar({ ...p, fullyPlanned: false, estimated: 400, executedNow: 0 }, 10_000, 8)).toBe('step 2/3 work █░░░░░░░ 25/400~ chunks · 0.0/s · ETA ?');
  });
  it('says it waits on a chunk held by another worker instead of an ETA counting down to 0', () => {
    expect(formatProgressBar({ ...p, done: 99, waitingOnOthers: true }, 10_000, 10)).toBe('step 2/3 work ██████████ 99/100 chunks · 2.0/s · waiting on a chunk held by another worker');
  });
  it('is cut to the terminal width without counting colour codes', () => {
    expect(truncate('\x1b[32mabcdef\x1b[39m', 3)).toBe('\x1b[32mabc\x1b[39m');
  });
});

describe('relative times in idem status', () => {
  it('say how long ago, in the largest whole unit', async () => {
    const { relativeTime } = await import('../src/commands/status.ts');
    const now = new Date(Date.UTC(2026, 10, 30, 12));
    const ago = (s: number) => relativeTime(new Date(now.getTime() - s * 1000), now);
    expect([ago(2), ago(42), ago(3 * 60 + 5), ago(5 * 3600), ago(2 * 86_400 + 7)]).toEqual(['just now', '42 s ago', '3 min ago', '5 h ago', '2 d ago']);
  });
});

describe('idem list on a terminal', () => {
  it('aligns the columns, says how long ago each latest run changed, and colours the state', async () => {
    const { formatList } = await import('../src/commands/list.ts');
    const { colours } = await import('../src/terminal.ts');
    const now = new Date(Date.UTC(2026, 10, 30, 12));
    const items = [
      { kind: 'job' as const, name: 'counted', description: 'counts', state: 'succeeded', updatedAt: new Date(now.getTime() - 180_000) },
      { kind: 'job' as const, name: 'a-much-longer-job-name', description: '', state: 'never run', updatedAt: null },
      { kind: 'migration' as const, name: '0001_create_widgets', job: 'create-widgets', description: 'widgets table', state: 'failed', updatedAt: new Date(now.getTime() - 7_200_000) },
    ];
    const lines = formatList(items, now).split('\n');
    expect(lines).toEqual([
      'KIND       NAME                    STATE      UPDATED    DESCRIPTION',
      'job        counted                 succeeded  3 min ago  counts',
      'job        a-much-longer-job-name  never run  —          ',
      'migration  0001_create_widgets     failed     2 h ago    widgets table',
    ]);
    const painted = formatList(items, now, colours(true)).split('\n');
    expect(painted[1]).toContain('\x1b[32msucceeded\x1b[39m');
    expect(painted[3]).toContain('\x1b[31mfailed   \x1b[39m');
    expect(formatList([], now)).toBe('no jobs or migrations found');
  });
});

describe('stored text with control characters on a terminal', () => {
  // Keys, names and messages from the database (an older idem, a row written by SQL) or from job
  // files must not move the cursor, clear the screen or break a line: shown escaped, visibly.
  it('visible() escapes C0, DEL, C1 and bidi controls, and leaves printable text, non-ASCII included, as it is', async () => {
    const { visible } = await import('../src/text-table.ts');
    expect(visible('evil\n\x1b[2J\x1b[Hfake')).toBe('evil\\n\\x1b[2J\\x1b[Hfake');
    expect(visible('a\tb\rc\0d\x7fe\u0085f\u009bg')).toBe('a\\tb\\rc\\x00d\\x7fe\\x85f\\x9bg');
    expect(visible('left\u202eright\u2066x\u2028y')).toBe('left\\u202eright\\u2066x\\u2028y');
    expect(visible('Größe 日本 😀 👩‍💻 back\\slash')).toBe('Größe 日本 😀 👩‍💻 back\\slash');
  });

  it('visible() and keyLabel() escape the invisible characters, so keys that differ by one do not look alike', async () => {
    // Black-box round 13 (B2-11): a key with a zero-width character, a soft hyphen or a non-ASCII
    // space printed raw, the same as the key without it (or with an ASCII space).
    const { visible } = await import('../src/text-table.ts');
    const { keyLabel } = await import('../src/key-label.ts');
    const invisible = ['\u200b', '\u200c', '\u200d', '\u2060', '\ufeff', '\u00ad', '\u00a0', '\u3000', '\u200e', '\u200f'];
    for (const ch of invisible) {
      const escaped = `\\u${ch.charCodeAt(0).toString(16).padStart(4, '0')}`;
      expect(visible(`a${ch}b`)).toBe(`a${escaped}b`);
      expect(keyLabel(`a${ch}b`)).toBe(`"a${escaped}b"`);
    }
    expect(keyLabel('a\u200b"b\n')).toBe('"a\\u200b\\"b\\n"');
    // A zero-width joiner inside an emoji sequence is part of the emoji (👩‍💻, 🏳️‍🌈, 👩🏽‍💻), not hidden text.
    for (const emoji of ['👩\u200d💻', '🏳\ufe0f\u200d🌈', '👩🏽\u200d💻']) {
      expect(visible(`k ${emoji}`)).toBe(`k ${emoji}`);
      expect(keyLabel(`k ${emoji}`)).toBe(`k ${emoji}`);
    }
    expect(visible('x\u200d💻')).toBe('x\\u200d💻');
    expect(keyLabel('plain key 日本')).toBe('plain key 日本');
  });

  it('log lines escape them in the header, the message and every field', () => {
    const line = formatLogLine(event({ job: 'j\x1b[31m', runKey: 'evil\n\x1b[2Jfake', attempt: 1, msg: 'chunk\x1b]0;title\x07 failed', chunk: 'k\x1b[H', err: { message: 'bad\nthing' } }), {});
    expect(line.split('\n')).toHaveLength(2);
    expect(line).not.toMatch(/[\u0000-\u0009\u000b-\u001f\u007f-\u009f]/);
    expect(line).toContain('── job j\\x1b[31m · run key evil\\n\\x1b[2Jfake · attempt 1');
    expect(line).toContain('chunk\\x1b]0;title\\x07 failed');
    expect(line).toContain('chunk=k\\x1b[H');
  });

  it('idem status and idem list (table and tab-separated) escape them in every cell', async () => {
    const { formatList, formatListTsv } = await import('../src/commands/list.ts');
    const { formatStatus } = await import('../src/commands/status.ts');
    const now = new Date(Date.UTC(2026, 10, 30, 12));
    const items = [{ kind: 'job' as const, name: 'tab\tname', description: 'two\nlines \x1b[2J', state: 'never run', updatedAt: null }];
    expect(formatList(items, now).split('\n')[1]).toBe('job   tab\\tname  never run  —        two\\nlines \\x1b[2J');
    expect(formatListTsv(items)).toBe('job\ttab\\tname\tnever run\ttwo\\nlines \\x1b[2J');
    const row = {
      job: 'counted', runKey: 'evil\n\x1b[2Jfake', runId: '1', state: 'failed', attempt: 1, chunksDone: 0, chunksPlanned: 1, fullyPlanned: true, estimatedChunks: null,
      updatedAt: now, createdAt: now, finishedAt: now, holder: null, throughput: null, etaSeconds: null, workers: [], requested: null, healthPause: null, codeChanges: [],
      error: { step: 'work', chunk: 'c\r1', tries: 1, message: 'boom\n\x1b[31mred', at: now.toISOString() },
      skipped: [{ step: 'work', key: 'k\x1b2', attempts: 1, error: 'x\ny' }],
    };
    const text = formatStatus([row as never], now);
    expect(text.split('\n')).toHaveLength(3);
    expect(text).not.toMatch(/[\u0000-\u0009\u000b-\u001f\u007f-\u009f]/);
    expect(text).toContain('evil\\n\\x1b[2Jfake');
    // A chunk key with a control character is JSON-quoted, as every message names it (keyLabel).
    expect(text).toContain('error: step "work" chunk "c\\r1" after 1 try: boom\\n\\x1b[31mred');
    expect(text).toContain('skipped: step "work" chunk "k\\u001b2" after 1 try: x\\ny');
  });

  it('idem status\'s table shortens a long error to a line, and says how much is left out; the detail view keeps it whole', async () => {
    const { formatStatus, formatRunDetail } = await import('../src/commands/status.ts');
    const now = new Date(Date.UTC(2026, 10, 30, 12));
    const long = `${'x'.repeat(290)}😀${'y'.repeat(19_709)}`; // 20 000 characters
    const row = {
      job: 'counted', runKey: 'k', runId: '1', state: 'failed', attempt: 1, chunksDone: 0, chunksPlanned: 1, fullyPlanned: true, estimatedChunks: null,
      updatedAt: now, createdAt: now, finishedAt: now, holder: null, throughput: null, etaSeconds: null, workers: [], requested: null, healthPause: null, codeChanges: [],
      error: { step: 'work', chunk: 'c1', tries: 1, message: long, at: now.toISOString() },
      skipped: [{ step: 'work', key: 'k2', attempts: 1, error: long }],
    };
    const lines = formatStatus([row as never], now).split('\n');
    expect(lines).toHaveLength(3);
    expect(lines[1]).toContain(`error: step "work" chunk c1 after 1 try: ${'x'.repeat(290)}😀${'y'.repeat(9)}… (19 700 more characters: idem status counted --key k shows all)`);
    expect(lines[2]).toMatch(/^ {4}skipped: step "work" chunk k2 after 1 try: x{290}😀y{9}… \(19 700 more characters/);
    expect(lines.every((l) => l.length < 500)).toBe(true);
    expect(formatRunDetail(row as never, [], now)).toContain(long);
  });
});

describe('wide characters on a terminal (CJK, emoji: two columns each; combining marks: none)', () => {
  const columnsOf = (s: string) => {
    // Display columns as a terminal counts them, written out here so the test does not share the code under test.
    let n = 0;
    for (const ch of s) {
      const cp = ch.codePointAt(0)!;
      if (/\p{M}/u.test(ch)) continue;
      n += (cp >= 0x1100 && cp <= 0x115f) || (cp >= 0x2e80 && cp <= 0xa4cf) || (cp >= 0xac00 && cp <= 0xd7a3) || (cp >= 0xf900 && cp <= 0xfaff) || (cp >= 0xff00 && cp <= 0xff60) || (cp >= 0x1f300 && cp <= 0x1faff) ? 2 : 1;
    }
    return n;
  };

  it('idem list and idem status align their columns by display width, not by UTF-16 length', async () => {
    await (await import('../src/display-width.ts')).loadWidth(); // as the commands do for text that is not ASCII
    const { formatList } = await import('../src/commands/list.ts');
    const { formatStatus } = await import('../src/commands/status.ts');
    const now = new Date(Date.UTC(2026, 10, 30, 12));
    const items = [
      { kind: 'job' as const, name: '顧客の集計', description: 'd1', state: 'never run', updatedAt: null },
      { kind: 'job' as const, name: 'cafe\u0301-😀', description: 'd2', state: 'never run', updatedAt: null },
      { kind: 'job' as const, name: 'plain-ascii-name', description: 'd3', state: 'never run', updatedAt: null },
    ];
    const lines = formatList(items, now).split('\n');
    const stateAt = lines.map((l) => columnsOf(l.slice(0, l.search(/never run|STATE/))));
    expect(stateAt).toHaveLength(4);
    expect(new Set(stateAt).size).toBe(1);
    const row = (runKey: string) => ({
      job: 'counted', runKey, runId: '1', state: 'succeeded', attempt: 1, chunksDone: 1, chunksPlanned: 1, fullyPlanned: true, estimatedChunks: null,
      updatedAt: now, createdAt: now, finishedAt: now, holder: null, throughput: null, etaSeconds: null, workers: [], requested: null, healthPause: null, codeChanges: [], error: null, skipped: [],
    });
    const failed = (runKey: string, ago: number) => ({ ...row(runKey), state: 'failed', updatedAt: new Date(now.getTime() - ago), error: { step: 'work', chunk: 'c1', tries: 1, message: 'boom', at: now.toISOString() } });
    const status = formatStatus([row('月次-請求書-2026-11'), row('plain-key'), row('😀😀😀'), failed('f1', 0), failed('f2', 5_000)] as never[], now).split('\n');
    const chunksAt = status.map((l) => columnsOf(l.slice(0, l.search(/1\/1|CHUNKS/))));
    expect(chunksAt).toHaveLength(6);
    expect(new Set(chunksAt).size).toBe(1);
    // A note after the last column ("just now" and "5 s ago" differ in width) starts at one column.
    const notesAt = status.filter((l) => l.includes('error:')).map((l) => l.indexOf('error:'));
    expect(notesAt).toHaveLength(2);
    expect(new Set(notesAt).size).toBe(1);
  });

  it('idem status cuts a long wide key to 30 columns, at a character, and the cut text still names the run', async () => {
    await (await import('../src/display-width.ts')).loadWidth();
    const { formatStatus } = await import('../src/commands/status.ts');
    const now = new Date(Date.UTC(2026, 10, 30, 12));
    const key = '請求書'.repeat(10); // 30 characters, 60 columns
    const row = {
      job: 'counted', runKey: key, runId: '1', state: 'succeeded', attempt: 1, chunksDone: 1, chunksPlanned: 1, fullyPlanned: true, estimatedChunks: null,
      updatedAt: now, createdAt: now, finishedAt: now, holder: null, throughput: null, etaSeconds: null, workers: [], requested: null, healthPause: null, codeChanges: [], error: null, skipped: [],
    };
    const line = formatStatus([row as never], now).split('\n')[1]!;
    const shown = line.split(/\s{2,}/).find((cell) => cell.endsWith('...'))!;
    expect(shown).toBeDefined();
    expect(columnsOf(shown)).toBeLessThanOrEqual(30);
    expect(key.startsWith(shown.slice(0, -3))).toBe(true);
  });

  it('the progress line is cut to the terminal width in columns, never inside a character', () => {
    // The emoji would need columns 5 and 6: the line ends before it (nothing after it is shown out of order).
    expect(truncate('\x1b[32m顧客😀abc\x1b[39m', 5)).toBe('\x1b[32m顧客\x1b[39m');
    expect(truncate('\x1b[32m顧客😀abc\x1b[39m', 7)).toBe('\x1b[32m顧客😀a\x1b[39m');
    expect(truncate('😀😀😀', 3)).toBe('😀');
    expect(truncate('e\u0301tude', 2)).toBe('e\u0301t');
  });
});
