/**
 * `idem run` on a real pseudo-terminal (util-linux `script`): one line per log event, the run's
 * header once, and a progress bar that no log line is written into.
 */
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { BIN, FIXTURE_DIRS, query, REPO } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

const exec = promisify(execFile);
const SCRIPT = '/usr/bin/script';
const database = useTestDatabase({ fixtureTables: true });

const quote = (s: string) => `'${s.replace(/'/g, `'\\''`)}'`;

describe.runIf(existsSync(SCRIPT))('idem list on a terminal', () => {
  it('prints an aligned table with a header, not tab-separated lines', async () => {
    const env: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: database.url, NO_COLOR: '1' };
    delete env.NODE_OPTIONS;
    const { stdout } = await exec(SCRIPT, ['-qec', [process.execPath, BIN, ...FIXTURE_DIRS, 'list'].map(quote).join(' '), '/dev/null'], { cwd: REPO, env, timeout: 60_000 });
    const screen = stdout.split(/\r?\n/).filter((l) => l.trim() !== '');
    expect(screen[0]).toMatch(/^KIND +NAME +STATE +UPDATED +DESCRIPTION$/);
    expect(stdout).not.toContain('\t');
    const rows = screen.slice(1);
    expect(rows.map((l) => l.split(/ {2,}/)[1])).toEqual(['counted', 'ranged', '0001_create_widgets', '0002_backfill_widgets']);
    // Aligned: every row's state starts under STATE, its time under UPDATED.
    const stateAt = screen[0]!.indexOf('STATE');
    const updatedAt = screen[0]!.indexOf('UPDATED');
    for (const r of rows) {
      expect(r.slice(stateAt)).toMatch(/^(never run|pending|succeeded|failed|running|crashed) /);
      expect(r.slice(updatedAt)).toMatch(/^(—|just now|\d+ (s|min|h|d) ago)/);
    }
  });
});

describe.runIf(existsSync(SCRIPT))('TERM=dumb on a terminal', () => {
  it('idem status and idem list print no colour escapes, as with NO_COLOR', async () => {
    // Black-box round 14 (B3-17): TERM=dumb still got colours from status (NO_COLOR did not).
    const env: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: database.url, TERM: 'dumb' };
    delete env.NODE_OPTIONS;
    delete env.NO_COLOR;
    const run = await exec(process.execPath, [BIN, ...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'dumb'], { cwd: REPO, env, timeout: 60_000 });
    expect(run.stdout).toContain('succeeded');
    for (const cmd of [['status'], ['status', 'counted', '--key', 'dumb'], ['list']]) {
      const { stdout } = await exec(SCRIPT, ['-qec', [process.execPath, BIN, ...FIXTURE_DIRS, ...cmd].map(quote).join(' '), '/dev/null'], { cwd: REPO, env, timeout: 60_000 });
      expect(stdout, cmd.join(' ')).toContain(cmd[0] === 'list' ? 'counted' : 'dumb');
      expect(stdout, cmd.join(' ')).not.toMatch(/\x1b\[\d+m/);
    }
  });
});

describe.runIf(existsSync(SCRIPT))('idem run on a terminal', () => {
  it('prints one line per event and keeps the progress bar below the log lines', async () => {
    const args = [BIN, ...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":12,"pauseMs":120}', '--key', 'tty'];
    const env: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: database.url, NO_COLOR: '1', COLUMNS: '120' };
    delete env.NODE_OPTIONS;
    const { stdout } = await exec(SCRIPT, ['-qec', [process.execPath, ...args].map(quote).join(' '), '/dev/null'], { cwd: REPO, env, timeout: 60_000 });
    // What a terminal shows: each \r\x1b[K (clear line) starts the line over.
    const screen = stdout
      .split(/\r?\n/)
      .map((l) => l.split('\r\x1b[K').at(-1)!.replace(/\r$/, ''))
      .filter((l) => l !== '');
    expect(screen.filter((l) => l.startsWith('── job counted'))).toEqual(['── job counted · run key tty · attempt 1']);
    const logLines = screen.filter((l) => / (info|warn|error) {1,2}/.test(l));
    expect(logLines.map((l) => l.replace(/^\d\d:\d\d:\d\d /, ''))).toEqual(
      expect.arrayContaining([expect.stringMatching(/^info  run started resumed=false\b/), 'info  step started step=work', 'info  step done step=work']),
    );
    // No log line glued to the bar (the bug: `… ETA 1s[18:11:35.519] INFO: step done`), none spread over several lines.
    for (const l of logLines) expect(l).not.toMatch(/chunks · /);
    expect(screen.filter((l) => /^\s+(job|runKey|attempt):/.test(l))).toEqual([]);
    // The bar was drawn: the raw output holds at least one bar frame.
    expect(stdout).toMatch(/step 2\/3 work [█░]+ \d+\/12 chunks · [\d.]+\/s · ETA /);
    expect(screen.at(-1)).toMatch(/^job "counted" succeeded: 14 chunks in 3 steps/);
    // A finished step's bar is not drawn again below its "step done" line (black-box round 13,
    // B2-15): nothing follows that line but the next line (the first step's single chunk is done
    // before any bar is drawn, so every step is checked, the last one too).
    const afterDone = [...stdout.matchAll(/step done step=(\w+)\r?\n([^\n]*)/g)].map((m) => [m[1], m[2]!.split('\r\x1b[K')[0]]);
    expect(afterDone.length).toBeGreaterThanOrEqual(2);
    for (const [step, next] of afterDone) expect(next, `after step ${step} done`).not.toMatch(/ chunks · /);
  });
});

describe.runIf(existsSync(SCRIPT))('idem run on a terminal, ending in an error', () => {
  it('clears the progress bar before the error line: the error starts a line of its own', async () => {
    // The bar was cleared only when the session closed, after main() had written the error
    // (seen as `… ETA 4sidem: error: interrupted by SIGINT …`); a failed chunk does the same.
    await query(database.url, `insert into fail_chunks (chunk_key) values ('c0009')`);
    try {
      const args = [BIN, ...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":12,"pauseMs":120}', '--key', 'tty-fail'];
      const env: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: database.url, NO_COLOR: '1', COLUMNS: '120' };
      delete env.NODE_OPTIONS;
      // -e would make script exit 1 with the run; its output is what matters.
      const { stdout } = await exec(SCRIPT, ['-qc', [process.execPath, ...args].map(quote).join(' '), '/dev/null'], { cwd: REPO, env, timeout: 60_000 });
      expect(stdout).toMatch(/step 2\/3 work [█░]+ \d+\/12 chunks/);
      const screen = stdout
        .split(/\r?\n/)
        .map((l) => l.split('\r\x1b[K').at(-1)!.replace(/\r$/, ''))
        .filter((l) => l !== '');
      const errorLines = screen.filter((l) => l.includes('idem: error:'));
      expect(errorLines).toEqual([expect.stringMatching(/^idem: error: job "counted" failed in step "work", chunk c0009/)]);
    } finally {
      await query(database.url, `delete from fail_chunks`);
    }
  });
});
