import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, Runner } from '../src/index.ts';
import { fileURLToPath } from 'node:url';
import { ALL_TABLES, FIXTURE_DIRS, FIXTURE_MIGRATIONS, killLeftovers, lines, query, runCli, runRow, snapshot, spawnCli, type CliResult } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

// Round 15 (B2) findings on the command line's input: each test here failed on the code before its fix.

const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true, runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});
afterAll(killLeftovers);

const idem = (args: string[]) => runCli([...FIXTURE_DIRS, ...args], { url });

function expectOneLineError(r: CliResult, code: number, message: string | RegExp): void {
  expect({ code: r.code, stderrLines: lines(r.stderr).length, stdout: r.stdout }, r.stderr).toEqual({ code, stderrLines: 1, stdout: '' });
  expect(r.stderr).toMatch(/^idem: error: /);
  if (typeof message === 'string') expect(r.stderr).toContain(message);
  else expect(r.stderr).toMatch(message);
}

describe('number flags take plain decimal numbers only', () => {
  it("--pause '', --pause 0x3E8, --max-rate ' 5', 1e3 and Infinity exit 2 naming the value, and change nothing", async () => {
    const before = await snapshot(url, ALL_TABLES);
    const [empty, hex, spaced, exp, inf, conc, wait] = await Promise.all([
      idem(['run', 'counted', '--pause', '']),
      idem(['run', 'counted', '--pause', '0x3E8']),
      idem(['run', 'counted', '--max-rate', ' 5']),
      idem(['run', 'counted', '--target-chunk-ms', '1e3']),
      idem(['run', 'counted', '--max-rate', 'Infinity']),
      idem(['run', 'counted', '--concurrency', '0x2']),
      idem(['run', 'counted', '--wait', '0b1']),
    ]);
    expectOneLineError(empty!, 2, `expected a plain decimal number >= 0 (such as 250 or 0.5), got ""`);
    expectOneLineError(hex!, 2, `expected a plain decimal number >= 0 (such as 250 or 0.5), got "0x3E8"`);
    expectOneLineError(spaced!, 2, `expected a plain decimal number > 0 (such as 5 or 0.5), got " 5"`);
    expectOneLineError(exp!, 2, `expected a plain decimal number > 0 (such as 5 or 0.5), got "1e3"`);
    expectOneLineError(inf!, 2, `expected a plain decimal number > 0 (such as 5 or 0.5), got "Infinity"`);
    expectOneLineError(conc!, 2, `expected an integer from 1 to 64, got "0x2"`);
    expectOneLineError(wait!, 2, `expected a plain decimal number of seconds >= 0 (such as 30 or 0.5), got "0b1"`);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('plain decimals are still taken', async () => {
    const r = await idem(['run', 'counted', '--params', '{"chunks":1}', '--key', 'plain-numbers', '--pause', '0', '--max-rate', '2.5', '--target-chunk-ms', '100', '--concurrency', '2']);
    expect(r.code, r.stderr).toBe(0);
  });

  it('the library names NaN as NaN, not null', async () => {
    const job = defineJob({ name: 'nan-conc', steps: [{ name: 'only', run: () => {} }] });
    const err = await runner.run(job, { key: 'nan', concurrency: Number.NaN }).catch((e: unknown) => e);
    expect(exitCodeOf(err), String(err)).toBe(2);
    expect(String(err)).toContain('concurrency must be an integer >= 1 (got NaN)');
    expect(() => defineJob({ name: 'nan-target', throttle: { targetChunkMs: Number.NaN }, steps: [{ name: 'only', run: () => {} }] })).toThrow(/targetChunkMs must be > 0 \(got NaN\)/);
    expect(() => defineJob({ name: 'nan-retry', retry: { attempts: 2, factor: Number.POSITIVE_INFINITY }, steps: [{ name: 'only', run: () => {} }] })).toThrow(/factor must be a number >= 1 \(got Infinity\)/);
    expect(await query(url, `select count(*)::int as n from idem.runs where job like 'nan-%'`)).toEqual([{ n: 0 }]);
  });
});

describe('--params with a duplicated key', () => {
  it('exits 2 naming the key, and changes nothing', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const [top, nested] = await Promise.all([
      idem(['run', 'counted', '--params', '{"chunks":1,"chunks":1000000}']),
      idem(['run', 'counted', '--params', '{"chunks":1,"filter":{"a":1,"b":{"c":1,"c":2}}}']),
    ]);
    expectOneLineError(top!, 2, `--params has the key "chunks" twice; give each key once`);
    expectOneLineError(nested!, 2, `--params has the key "filter.b.c" twice; give each key once`);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    // The same name in two objects is no duplicate.
    const ok = await idem(['run', 'counted', '--params', '{"chunks":1,"label":"x"}', '--key', 'dup-ok']);
    expect(ok.code, ok.stderr).toBe(0);
  });
});

describe('a run key with leading or trailing whitespace', () => {
  it("--key ' ' and --key 'k ' exit 2 with a hint, and change nothing", async () => {
    const before = await snapshot(url, ALL_TABLES);
    const [blank, trailing, leading] = await Promise.all([
      idem(['run', 'counted', '--key', ' ']),
      idem(['run', 'counted', '--key', '2026-11-30 ']),
      idem(['run', 'counted', '--key', '\u00a0k']),
    ]);
    expectOneLineError(blank!, 2, `--key must not begin or end with whitespace (got " "); pass the key without it, e.g. 2026-11-30`);
    expectOneLineError(trailing!, 2, `--key must not begin or end with whitespace (got "2026-11-30 ")`);
    expectOneLineError(leading!, 2, `--key must not begin or end with whitespace`);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('the library refuses the same keys, and takes one with inner spaces', async () => {
    const job = defineJob({ name: 'ws-key', steps: [{ name: 'only', run: () => {} }] });
    for (const key of [' ', '\t', 'k\n', ' k']) {
      const err = await runner.run(job, { key }).catch((e: unknown) => e);
      expect(exitCodeOf(err), `${JSON.stringify(key)}: ${String(err)}`).toBe(2);
    }
    const err = await runner.run(job, { key: ' ' }).catch((e: unknown) => e);
    expect(String(err)).toContain('key must not begin or end with whitespace (got " ")');
    expect(await query(url, `select count(*)::int as n from idem.runs where job = 'ws-key'`)).toEqual([{ n: 0 }]);
    expect((await runner.run(job, { key: 'two words' })).status).toBe('succeeded');
  });
});

describe('two migration files with one base name', () => {
  let tmp: string;
  beforeAll(async () => {
    tmp = await mkdtemp(path.join(tmpdir(), 'idem-cli-input-'));
  });
  afterAll(() => rm(tmp, { recursive: true, force: true }));

  it('migrate, migrate --finalize and list exit 2 naming both files, and run nothing', async () => {
    const root = path.join(tmp, 'same-stem');
    await mkdir(path.join(root, 'jobs'), { recursive: true });
    await mkdir(path.join(root, 'migrations'), { recursive: true });
    await writeFile(path.join(root, 'package.json'), JSON.stringify({ type: 'module' }));
    await writeFile(path.join(root, 'migrations', '0001_a.mjs'), `export default { name: 'm5-a', steps: [{ name: 'a', run() {} }] };\n`);
    await writeFile(path.join(root, 'migrations', '0001_a.ts'), `export default { name: 'm5-b', steps: [{ name: 'a', run() {} }] };\n`);
    const before = await snapshot(url, ALL_TABLES);
    const in_ = (args: string[]) => runCli(args, { url, cwd: root, timeoutMs: 20_000 });
    const [migrate, finalize, list] = await Promise.all([in_(['migrate']), in_(['migrate', '--finalize', '0001_a']), in_(['list'])]);
    for (const r of [migrate!, finalize!, list!]) {
      expectOneLineError(
        r,
        2,
        'idem: error: two migration files have the run key "0001_a" (0001_a.mjs and 0001_a.ts): a migration\'s run key is its file name without the extension, so they would share one run; rename one',
      );
    }
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    expect(await query(url, `select count(*)::int as n from idem.runs where job like 'm5-%'`)).toEqual([{ n: 0 }]);
  });
});

describe('idem init with --jobs-dir and --migrations-dir', () => {
  let tmp: string;
  beforeAll(async () => {
    tmp = await mkdtemp(path.join(tmpdir(), 'idem-init-dirs-'));
  });
  afterAll(() => rm(tmp, { recursive: true, force: true }));

  it('scaffolds into the given folders, and the test and the printed commands point at them', async () => {
    const r = await runCli(['--jobs-dir', 'src/jobs', '--migrations-dir', 'db/migr', 'init'], { cwd: tmp, timeoutMs: 20_000 });
    expect(r.code, r.stderr).toBe(0);
    const files = async (dir: string) => (await readdir(path.join(tmp, dir)).catch(() => null))?.sort() ?? null;
    expect({ jobs: await files('src/jobs'), migrations: await files('db/migr'), defaultJobs: await files('jobs'), defaultMigrations: await files('migrations') }).toEqual({
      jobs: ['example-customer-totals.ts'],
      migrations: ['0001_create_example_tables.ts'],
      defaultJobs: null,
      defaultMigrations: null,
    });
    const test = await readFile(path.join(tmp, 'test', 'idem-examples.test.ts'), 'utf8');
    expect(test).toContain(`import createTables from '../db/migr/0001_create_example_tables.ts';`);
    expect(test).toContain(`import customerTotals from '../src/jobs/example-customer-totals.ts';`);
    expect(r.stdout).toContain('created src/jobs/example-customer-totals.ts');
    expect(r.stdout).toContain('npx idem --migrations-dir db/migr migrate');
    expect(r.stdout).toContain('npx idem --jobs-dir src/jobs run example-customer-totals');
    // A second init names the files in the given folders.
    const again = await runCli(['--jobs-dir', 'src/jobs', '--migrations-dir', 'db/migr', 'init'], { cwd: tmp, timeoutMs: 20_000 });
    expectOneLineError(again, 2, 'idem init would overwrite db/migr/0001_create_example_tables.ts, src/jobs/example-customer-totals.ts, test/idem-examples.test.ts');
  });
});

describe('a closed stdout or stderr', () => {
  const SCHEDULED_JOBS = fileURLToPath(new URL('./fixtures/scheduled-jobs', import.meta.url));

  it('`run --catch-up 5 | head -1`: every slot still runs, no error, no stack trace, exit 0', async () => {
    const cli = spawnCli(['--jobs-dir', SCHEDULED_JOBS, '--migrations-dir', FIXTURE_MIGRATIONS, '--schema', 'epipe_a', '--log-level', 'warn', 'run', 'hourly-tick', '--param', 'tag=epipe', '--param', 'pauseMs=300', '--catch-up', '5'], { url });
    // The reader goes away after the first line, as `head -1` does: later writes meet EPIPE.
    cli.child.stdout!.once('data', () => cli.child.stdout!.destroy());
    const r = await cli.done;
    expect({ code: r.code, stderr: r.stderr }).toEqual({ code: 0, stderr: '' });
    const runs = await query(url, `select run_key, status from epipe_a.runs where job = 'hourly-tick' order by run_key`);
    expect(runs.map((x) => x.status)).toEqual(['succeeded', 'succeeded', 'succeeded', 'succeeded', 'succeeded']);
    expect(await query(url, `select count(*)::int as n from work_log where job = 'hourly-tick' and step = 'epipe'`)).toEqual([{ n: 5 }]);
  });

  it('`run … | true`: the run succeeds and the exit code is 0', async () => {
    const cli = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":2}', '--key', 'epipe-manual-1'], { url });
    cli.child.stdout!.destroy();
    const r = await cli.done;
    expect({ code: r.code, stderr: r.stderr.split('\n').filter((l) => !l.startsWith('{')).join('\n') }).toEqual({ code: 0, stderr: '' });
    expect((await runRow(url, 'counted', 'epipe-manual-1')).status).toBe('succeeded');
  });

  it('a closed stderr (debug logs) does not change the outcome or the exit code, nor a refusal\'s with both closed', async () => {
    const ok = spawnCli([...FIXTURE_DIRS, '--log-level', 'debug', 'run', 'counted', '--params', '{"chunks":2}', '--key', 'epipe-stderr-1'], { url });
    ok.child.stderr!.destroy();
    const r = await ok.done;
    expect(r.code).toBe(0);
    expect(r.stdout).toMatch(/^job "counted" succeeded/);
    expect((await runRow(url, 'counted', 'epipe-stderr-1')).status).toBe('succeeded');
    // Both closed, and a refusal: still its exit code (2), nothing written.
    const refused = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--key', ' ']);
    refused.child.stderr!.destroy();
    refused.child.stdout!.destroy();
    expect((await refused.done).code).toBe(2);
  });
});

describe('what a job file exports', () => {
  let tmp: string;
  beforeAll(async () => {
    tmp = await mkdtemp(path.join(tmpdir(), 'idem-exports-'));
  });
  afterAll(() => rm(tmp, { recursive: true, force: true }));

  async function project(name: string, files: Record<string, string>): Promise<string> {
    const root = path.join(tmp, name);
    await mkdir(path.join(root, 'jobs'), { recursive: true });
    await mkdir(path.join(root, 'migrations'), { recursive: true });
    await writeFile(path.join(root, 'package.json'), JSON.stringify({ type: 'module' }));
    for (const [file, text] of Object.entries(files)) await writeFile(path.join(root, 'jobs', file), text);
    return root;
  }

  it('a second job exported beside the default is named in a warning at load, as ignored', async () => {
    const root = await project('two-exports', {
      'two.js': `export default { name: 'first', steps: [{ name: 'a', run() {} }] };\nexport const job = { name: 'second', steps: [{ name: 'a', run() {} }] };\n`,
      // One job under two names is one job: nothing to say.
      'same.js': `export const job = { name: 'same', steps: [{ name: 'a', run() {} }] };\nexport default job;\n`,
    });
    const before = await snapshot(url, ALL_TABLES);
    const [list, second] = await Promise.all([
      runCli(['list'], { url, cwd: root, timeoutMs: 20_000 }),
      runCli(['run', 'second'], { url, cwd: root, timeoutMs: 20_000 }),
    ]);
    const warning = `idem: warning: jobs/two.js exports a second job, "second" (export job), which idem ignores: a job file holds one job, its default export (or job); move "second" into a file of its own`;
    expect(list.code, list.stderr).toBe(0);
    expect(lines(list.stderr)).toEqual([warning]);
    expect(second.code).toBe(2);
    expect(lines(second.stderr)).toEqual([warning, expect.stringMatching(/^idem: error: no job named 'second'/)]);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a default export that is a Promise is told to export the job itself', async () => {
    const root = await project('promised', {
      'promised.js': `export default (async () => ({ name: 'promised', steps: [{ name: 'a', run() {} }] }))();\n`,
    });
    const before = await snapshot(url, ALL_TABLES);
    const r = await runCli(['run', 'promised'], { url, cwd: root, timeoutMs: 20_000 });
    expectOneLineError(r, 2, 'idem: error: jobs/promised.js: the default export is a Promise: export the job itself (defineJob(...)), not a promise of it (in an ES module, export default await … works); fix the file');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a Promise exported by CommonJS, or by TypeScript in a CommonJS project, is told so in the same words (B12)', async () => {
    // Before: the .cjs file "exports nothing"; the .ts file's default export was called "the export job".
    const job = (name: string) => `{ name: '${name}', steps: [{ name: 'a', run() {} }] }`;
    const promised = (file: string, which = 'the default export') =>
      `idem: error: jobs/${file}: ${which} is a Promise: export the job itself (defineJob(...)), not a promise of it (in an ES module, export default await … works); fix the file`;
    const cjs = await project('promised-cjs', { 'pr3.cjs': `module.exports = Promise.resolve(${job('pr3')});\n` });
    const cjsJob = await project('promised-cjs-job', { 'pr4.cjs': `exports.job = Promise.resolve(${job('pr4')});\n` });
    const ts = await project('promised-ts-commonjs', { 'pr5.ts': `export default (async () => (${job('pr5')}))();\n` });
    await writeFile(path.join(ts, 'package.json'), JSON.stringify({ type: 'commonjs' }));
    const before = await snapshot(url, ALL_TABLES);
    expectOneLineError(await runCli(['list'], { url, cwd: cjs, timeoutMs: 20_000 }), 2, promised('pr3.cjs'));
    expectOneLineError(await runCli(['list'], { url, cwd: cjsJob, timeoutMs: 20_000 }), 2, promised('pr4.cjs', 'the export job'));
    expectOneLineError(await runCli(['list'], { url, cwd: ts, timeoutMs: 20_000 }), 2, promised('pr5.ts'));
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });
});

describe('--json on every command: a refusal is the error object on stdout', () => {
  it('status, list, pause, resume, cancel, reset and prune print {status: "error", …} with the exit code, as run does', async () => {
    // Black-box round 16 (B5-4): README's JSON output says an outcome other than success is the
    // error object, but only run, finalize and migrate printed one: these exited 2 with stdout empty.
    const before = await snapshot(url, ALL_TABLES);
    const cases: Array<[string[], { job: string | null; runKey: string | null }]> = [
      [['status', 'no-such-job', '--json'], { job: 'no-such-job', runKey: null }],
      [['status', 'counted', '--key', 'never-ran', '--json'], { job: 'counted', runKey: 'never-ran' }],
      [['pause', 'counted', '--key', 'never-ran', '--json'], { job: 'counted', runKey: 'never-ran' }],
      [['resume', 'counted', '--key', 'never-ran', '--json'], { job: 'counted', runKey: 'never-ran' }],
      [['cancel', 'counted', '--key', 'never-ran', '--json'], { job: 'counted', runKey: 'never-ran' }],
      [['reset', 'counted', '--key', 'never-ran', '--json'], { job: 'counted', runKey: 'never-ran' }],
      [['prune', '--older-than', '1x', '--json'], { job: null, runKey: null }],
      // Refused by the command line itself (commander), before any command runs.
      [['status', '--json', '--limit', 'x'], { job: null, runKey: null }],
    ];
    const results = await Promise.all(cases.map(([args]) => idem(args)));
    results.forEach((r, i) => {
      const [args, want] = cases[i]!;
      expect(r.code, `${args.join(' ')}: ${r.stderr}`).toBe(2);
      expect(lines(r.stdout), `${args.join(' ')}: ${r.stdout}`).toHaveLength(1);
      const obj = JSON.parse(r.stdout) as Record<string, unknown>;
      expect(obj, args.join(' ')).toMatchObject({ status: 'error', job: want.job, runKey: want.runKey, exitCode: 2 });
      expect(typeof obj.error, args.join(' ')).toBe('string');
      expect(lines(r.stderr), args.join(' ')).toHaveLength(1);
      expect(r.stderr, args.join(' ')).toContain(obj.error as string);
    });
    const list = await runCli(['list', '--json', '--jobs-dir', 'no-such-dir'], { url });
    expect(list.code, list.stderr).toBe(2);
    expect(JSON.parse(list.stdout)).toMatchObject({ status: 'error', job: null, runKey: null, exitCode: 2 });
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });
});

describe('IDEM_API_TOKEN in the environment of a CLI command', () => {
  it('a value too short to be a token (idem serve refuses under 16 characters) masks nothing: `idem` stays `idem`', async () => {
    // Review of round 16's fix (B4-1): the token's forms joined every mask with the password's
    // 3-character floor, so IDEM_API_TOKEN=idem turned `idem: error:` into `***: error:` (and
    // changed a stored error's text for good).
    const r = await runCli([...FIXTURE_DIRS, 'status', 'no-such-job'], { url, env: { IDEM_API_TOKEN: 'idem' } });
    expect(r.code, r.stderr).toBe(2);
    expect(r.stderr).toMatch(/^idem: error: no job named 'no-such-job'/);
  });
});
