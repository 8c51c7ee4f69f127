import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Runner } from '../src/index.ts';
import { ALL_TABLES, FIXTURE_DIRS, FIXTURE_JOBS, FIXTURE_MIGRATIONS, killLeftovers, lines, logLines, query, REPO, runCli, snapshot, type CliResult } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

// Issue 14: every common mistake of a new user ends in an error that says what and where, and how
// to fix it; and nothing is written to the database.

// idem's schema exists up front, so "changes nothing" compares real tables.
const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
let url: string;
beforeAll(() => {
  url = testDb.url;
});

let tmp: string;
beforeAll(async () => {
  tmp = await mkdtemp(path.join(os.tmpdir(), 'idem-errors-'));
});
afterAll(async () => {
  await killLeftovers();
  if (tmp) await rm(tmp, { recursive: true, force: true });
});

const idem = (args: string[]) => runCli([...FIXTURE_DIRS, ...args], { url });

/** The refusal's shape: the exit code, nothing on stdout, and stderr led by one `idem: error:` line. */
function refusal(r: CliResult, code: number): string[] {
  expect({ code: r.code, stdout: r.stdout }, r.stderr).toEqual({ code, stdout: '' });
  const out = lines(r.stderr);
  expect(out[0]).toMatch(/^idem: error: /);
  return out;
}

/** A folder of job files in a package with "type": "module", as a user's project has. */
async function jobFolder(name: string, files: Record<string, string>, pkg: object | null = { type: 'module' }): Promise<string> {
  const root = path.join(tmp, name);
  await mkdir(path.join(root, 'jobs'), { recursive: true });
  if (pkg) await writeFile(path.join(root, 'package.json'), JSON.stringify(pkg));
  for (const [file, text] of Object.entries(files)) await writeFile(path.join(root, 'jobs', file), text);
  return path.join(root, 'jobs');
}

const BROKEN_SOURCE = `export default {\n  name: 'broken',\n  steps: [{ name: 'a' run: () => 1 }],\n};\n`;

describe('a job file that cannot load: file:line:column, the cause, the source line', () => {
  it('a syntax error in a .ts file, for run, list, migrate and an unknown name in status', async () => {
    const dir = await jobFolder('syntax-ts', { 'broken.ts': BROKEN_SOURCE });
    const file = path.join(dir, 'broken.ts');
    const before = await snapshot(url, ALL_TABLES);
    const [run, list, migrate, status] = await Promise.all([
      runCli(['--jobs-dir', dir, 'run', 'broken'], { url }),
      runCli(['--jobs-dir', dir, '--migrations-dir', FIXTURE_MIGRATIONS, 'list'], { url }),
      runCli(['--migrations-dir', dir, 'migrate'], { url }),
      runCli(['--jobs-dir', dir, '--migrations-dir', FIXTURE_MIGRATIONS, 'status', 'brokn'], { url }),
    ]);
    for (const [r, what] of [[run, 'jobs'], [list, 'jobs'], [migrate, 'migrations'], [status, 'jobs']] as const) {
      const out = refusal(r!, 2);
      // Columns are 1-based, as editors count them: `run` starts at column 23 of line 3.
      expect(out[0]).toBe(`idem: error: cannot load ${what} file ${file}:3:23: syntax error: Expected "}" but found "run"; fix the file`);
      expect(out.slice(1)).toEqual([`    3 |   steps: [{ name: 'a' run: () => 1 }],`, `      |                       ^`]);
    }
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a syntax error after non-ASCII characters: the column counts characters as an editor does, not UTF-8 bytes', async () => {
    // Black-box round 13: 'Größe' put the column 2 past the error (and two emoji 6 past it), the caret under the wrong letters.
    for (const [file, prefix] of [['umlaut.ts', "const s = 'Größe'; "], ['emoji.cjs', "const s = '🙂🙂'; "]] as const) {
      const source = `${prefix}module.exports = { name: 'd' steps: [] };\n`;
      const dir = await jobFolder(`syntax-utf8-${file}`, { [file]: source }, file.endsWith('.cjs') ? null : { type: 'module' });
      const out = refusal(await runCli(['--jobs-dir', dir, 'run', 'd'], { url }), 2);
      const column = source.indexOf('steps') + 1;
      expect(out[0], file).toMatch(new RegExp(`^idem: error: cannot load jobs file ${path.join(dir, file).replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}:1:${column}: syntax error: `));
      expect(out[2], file).toBe(`      | ${' '.repeat(column - 1)}^`);
    }
  });

  it('a syntax error in a .js file (which Node, not tsx, compiles) is located the same way', async () => {
    const dir = await jobFolder('syntax-js', { 'broken.js': BROKEN_SOURCE });
    const out = refusal(await runCli(['--jobs-dir', dir, 'run', 'broken'], { url }), 2);
    expect(out[0]).toBe(`idem: error: cannot load jobs file ${path.join(dir, 'broken.js')}:3:23: syntax error: Expected "}" but found "run"; fix the file`);
    expect(out[1]).toBe(`    3 |   steps: [{ name: 'a' run: () => 1 }],`);
  });

  it('a file that throws while loading names the line that threw, also in a helper it imports', async () => {
    const dir = await jobFolder('throws', {
      'throws.ts': `const ready = process.env.NOPE_NOT_SET;\nif (!ready) throw new Error('NOPE_NOT_SET is not set');\nexport default { name: 'throws', steps: [{ name: 'a', run: () => 1 }] };\n`,
    });
    const out = refusal(await runCli(['--jobs-dir', dir, 'list'], { url }), 2);
    expect(out[0]).toBe(`idem: error: cannot load jobs file ${path.join(dir, 'throws.ts')}:2:19: it threw while loading: Error: NOPE_NOT_SET is not set; fix the file`);
    expect(out[1]).toBe(`    2 | if (!ready) throw new Error('NOPE_NOT_SET is not set');`);

    const deep = await jobFolder('throws-deep', {
      'deep.ts': `import { limit } from './_config.ts';\nexport default { name: 'deep', steps: [{ name: 'a', run: () => limit }] };\n`,
      '_config.ts': `export const limit = JSON.parse('{oops');\n`,
    });
    const d = refusal(await runCli(['--jobs-dir', deep, 'list'], { url }), 2);
    expect(d[0]).toMatch(
      new RegExp(`^idem: error: cannot load jobs file ${esc(path.join(deep, 'deep.ts'))}: at ${esc(path.join(deep, '_config.ts'))}:1:\\d+: it threw while loading: SyntaxError: .*JSON.*; fix the file$`),
    );
    expect(d[1]).toBe(`    1 | export const limit = JSON.parse('{oops');`);
  });

  it('a file that throws a non-Error while loading says what it threw', async () => {
    const dir = await jobFolder('throws-string', { 'bad.ts': `throw 'a string at load';\n` });
    const out = refusal(await runCli(['--jobs-dir', dir, 'list'], { url }), 2);
    expect(out).toEqual([`idem: error: cannot load jobs file ${path.join(dir, 'bad.ts')}: it threw "a string at load" while loading (not an Error, so it has no line); fix the file`]);
  });

  it('an import of a package or a file that does not exist names the import line', async () => {
    const dir = await jobFolder('missing', {
      'pkg.ts': `// needs a package\nimport { nope } from 'no-such-package-idem-test';\nexport default { name: 'pkg', steps: [{ name: 'a', run: () => nope }] };\n`,
    });
    const pkg = refusal(await runCli(['--jobs-dir', dir, 'list'], { url }), 2);
    expect(pkg[0]).toBe(`idem: error: cannot load jobs file ${path.join(dir, 'pkg.ts')}:2:22: cannot find package 'no-such-package-idem-test'; install it (npm install no-such-package-idem-test) or fix the import`);
    expect(pkg[1]).toBe(`    2 | import { nope } from 'no-such-package-idem-test';`);

    const rel = await jobFolder('missing-file', {
      'rel.ts': `import helper from './no-such-helper.ts';\nexport default { name: 'rel', steps: [{ name: 'a', run: () => helper }] };\n`,
    });
    const r = refusal(await runCli(['--jobs-dir', rel, 'list'], { url }), 2);
    expect(r[0]).toBe(`idem: error: cannot load jobs file ${path.join(rel, 'rel.ts')}:1:20: cannot find module './no-such-helper.ts' (${path.join(rel, 'no-such-helper.ts')}); fix the import path`);
  });

  it('in a CommonJS project too (require(), .js and .ts), a missing package names the import line and npm install as the fix', async () => {
    // npm's default project is CommonJS: its job files are require()d, and Node's CommonJS loader
    // throws MODULE_NOT_FOUND ("Cannot find module 'x'\nRequire stack: …"), not ESM's
    // ERR_MODULE_NOT_FOUND. The fix is the same: install the package, or fix the path.
    const dir = await jobFolder(
      'missing-cjs',
      {
        'pkg.js': `// needs a package\nconst { nope } = require('no-such-package-idem-test/sub');\nmodule.exports = { name: 'pkg', steps: [{ name: 'a', run: () => nope }] };\n`,
      },
      { name: 'app' },
    );
    const before = await snapshot(url, ALL_TABLES);
    const js = refusal(await runCli(['--jobs-dir', dir, 'list'], { url }), 2);
    expect(js[0]).toBe(`idem: error: cannot load jobs file ${path.join(dir, 'pkg.js')}:2:26: cannot find package 'no-such-package-idem-test/sub'; install it (npm install no-such-package-idem-test) or fix the import`);
    expect(js[1]).toBe(`    2 | const { nope } = require('no-such-package-idem-test/sub');`);

    const ts = await jobFolder('missing-cts', { 'pkg.ts': `import { nope } from 'no-such-package-idem-test';\nexport default { name: 'pkg', steps: [{ name: 'a', run: () => nope }] };\n` }, { name: 'app' });
    const t = refusal(await runCli(['--jobs-dir', ts, 'run', 'pkg'], { url }), 2);
    expect(t[0]).toBe(`idem: error: cannot load jobs file ${path.join(ts, 'pkg.ts')}:1:22: cannot find package 'no-such-package-idem-test'; install it (npm install no-such-package-idem-test) or fix the import`);

    const rel = await jobFolder('missing-cjs-file', { 'rel.cjs': `const helper = require('./no-such-helper');\nmodule.exports = { name: 'rel', steps: [{ name: 'a', run: () => helper }] };\n` }, { name: 'app' });
    const r = refusal(await runCli(['--jobs-dir', rel, 'list'], { url }), 2);
    expect(r[0]).toBe(`idem: error: cannot load jobs file ${path.join(rel, 'rel.cjs')}:1:24: cannot find module './no-such-helper'; fix the import path`);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a .ts job with import/export in a package without "type": "module" loads (as CommonJS TypeScript), not "cannot require() ES Module in a cycle"', async () => {
    // npm's default project is CommonJS; issue 10 makes its TypeScript jobs load (tsx compiles
    // their import/export to require), so what issue 14 turned into a helpful refusal now works.
    const dir = await jobFolder('commonjs', { 'ok.ts': `export default { name: 'ok', steps: [{ name: 'a', run: () => 1 }] };\n` }, { name: 'app' });
    const r = await runCli(['--jobs-dir', dir, 'list', '--json'], { url });
    expect(r.code, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout)).toEqual(expect.arrayContaining([expect.objectContaining({ kind: 'job', name: 'ok' })]));
  });

  it('an esbuild error is reported with its own text and its place in the user\'s file, not "Transform failed with 1 error:"', async () => {
    // Black-box round 13: the first line of esbuild's message ("Transform failed with 1 error:")
    // was all that was said, and a require() in an ES module was placed in idem's compiled copy.
    const job = `export default { name: 'tla', steps: [{ name: 'a', run: () => 1 }] };\n`;
    for (const [name, pkg, said] of [
      ['tla-commonjs', { name: 'app', type: 'commonjs' }, 'declares "type": "commonjs"; set'],
      ['tla-typeless', { name: 'app' }, 'does not declare "type": "module"; add'],
    ] as const) {
      const dir = await jobFolder(name, { 'tla.ts': `await Promise.resolve(1);\n${job}` }, pkg);
      const out = refusal(await runCli(['--jobs-dir', dir, 'run', 'tla'], { url }), 2);
      expect(out[0]).toBe(
        `idem: error: cannot load jobs file ${path.join(dir, 'tla.ts')}:1:1: top-level await needs an ES module, but ${path.join(dir, '..', 'package.json')} ${said} "type": "module" there, or rename the file to .mts`,
      );
      expect(out[1]).toBe('    1 | await Promise.resolve(1);');
    }

    const dir = await jobFolder('no-such-export', {
      'imp.ts': `import { cfg, nope } from './_cfg.ts';\nexport default { name: 'imp', steps: [{ name: 'a', run: () => [cfg, nope] }] };\n`,
      '_cfg.ts': `export const cfg = 1;\n`,
    });
    const imp = refusal(await runCli(['--jobs-dir', dir, 'list'], { url }), 2);
    expect(imp[0]).toBe(`idem: error: cannot load jobs file ${path.join(dir, 'imp.ts')}:1:15: No matching export in "_cfg.ts" for import "nope"; export it from there, or fix the import`);
    expect(imp.slice(1)).toEqual([`    1 | import { cfg, nope } from './_cfg.ts';`, '      |               ^']);

    const req = await jobFolder('require-in-esm', { 'req.ts': `const idem = require('idem');\nexport default { name: 'req', steps: [{ name: 'a', run: () => idem }] };\n` });
    const r = refusal(await runCli(['--jobs-dir', req, 'list'], { url }), 2);
    expect(r[0]).toBe(`idem: error: cannot load jobs file ${path.join(req, 'req.ts')}:1:14: require("idem") is not available in an ES module; use import instead, or make the file CommonJS (rename it to .cts)`);
  });

  it('an ES-module .js job in a "type": "commonjs" project: one line, and the fix for a .js file (.mjs); without a type it loads, with no Node warning', async () => {
    // Black-box round 13: npm 11's `npm init -y` writes "type": "commonjs". Node's own warning
    // came first, and the fix named .mts and a type the package.json did declare.
    const job = `export default { name: 'esm-js', steps: [{ name: 'a', run: () => 1 }] };\n`;
    const dir = await jobFolder('esm-js-commonjs', { 'esm.js': job }, { name: 'app', type: 'commonjs' });
    expect(lines((await runCli(['--jobs-dir', dir, 'run', 'esm-js'], { url })).stderr)).toEqual([
      `idem: error: cannot load jobs file ${path.join(dir, 'esm.js')}: it is an ES module but ${path.join(dir, '..', 'package.json')} declares "type": "commonjs"; set "type": "module" there, or rename the file to .mjs`,
    ]);
    // Node reads it as an ES module (20.19 and later), and its "Reparsing as ES module" warning,
    // advice on the project's package.json, is not repeated at every command.
    const typeless = await jobFolder('esm-js-typeless', { 'esm.js': job }, { name: 'app' });
    const ok = await runCli(['--jobs-dir', typeless, 'list', '--json'], { url });
    expect({ code: ok.code, stderr: ok.stderr }).toEqual({ code: 0, stderr: '' });
    expect(JSON.parse(ok.stdout)).toEqual(expect.arrayContaining([expect.objectContaining({ kind: 'job', name: 'esm-js' })]));
  });

  it('an ES-module .js job in a "type": "commonjs" project is refused whether a .ts job loads before or after it; a CommonJS .js job loads in both orders', async () => {
    // Black-box: with a .ts job sorting first (a.ts), tsx's require hook was active when esm.js
    // loaded, compiled its import/export to CommonJS and the job ran; Node refuses the file, and
    // so did idem when the .ts file sorted last (z.ts).
    const esm = `export default { name: 'esm-js', steps: [{ name: 'a', run: () => 1 }] };\n`;
    const cjs = `module.exports = { name: 'cjs-js', steps: [{ name: 'a', run: () => 1 }] };\n`;
    const ts = (name: string) => `const n: number = 1;\nexport default { name: '${name}', steps: [{ name: 'a', run: () => n }] };\n`;
    const before = await snapshot(url, ALL_TABLES);
    for (const tsFile of ['a.ts', 'z.ts']) {
      const dir = await jobFolder(`esm-js-commonjs-${tsFile}`, { [tsFile]: ts('ts-job'), 'esm.js': esm }, { name: 'app', type: 'commonjs' });
      for (const args of [['run', 'esm-js'], ['list']]) {
        expect(refusal(await runCli(['--jobs-dir', dir, ...args], { url }), 2), `${tsFile}: ${args.join(' ')}`).toEqual([
          `idem: error: cannot load jobs file ${path.join(dir, 'esm.js')}: it is an ES module but ${path.join(dir, '..', 'package.json')} declares "type": "commonjs"; set "type": "module" there, or rename the file to .mjs`,
        ]);
      }
      const ok = await jobFolder(`cjs-js-commonjs-${tsFile}`, { [tsFile]: ts('ts-job'), 'cjs.js': cjs }, { name: 'app', type: 'commonjs' });
      const r = await runCli(['--jobs-dir', ok, 'list', '--json'], { url });
      expect({ code: r.code, stderr: r.stderr }, tsFile).toEqual({ code: 0, stderr: '' });
      expect((JSON.parse(r.stdout) as Array<{ kind: string; name: string }>).filter((j) => j.kind === 'job').map((j) => j.name).sort(), tsFile).toEqual(['cjs-js', 'ts-job']);
      // What a .cjs job requires loads as Node loads it too: an ES-module .js helper is refused.
      const helper = await jobFolder(`esm-helper-commonjs-${tsFile}`, {
        [tsFile]: ts('ts-job'),
        'c.cjs': `const h = require('./_h.js');\nmodule.exports = { name: 'c', steps: [{ name: 'a', run: () => h.x }] };\n`,
        '_h.js': `export const x = 1;\n`,
      }, { name: 'app', type: 'commonjs' });
      expect(refusal(await runCli(['--jobs-dir', helper, 'list'], { url }), 2)[0], tsFile).toMatch(new RegExp(`^idem: error: cannot load jobs file ${esc(path.join(helper, 'c.cjs'))}`));
    }
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a job file that calls process.exit() while loading is a bad job file: exit 2, one line naming it, no word of a run', async () => {
    // Black-box round 13: exit 1 and "a run in flight is left unfinished", where no run existed.
    const dir = await jobFolder('exits', {
      'pe.ts': `if (!process.env.IDEM_TEST_NOT_SET) process.exit(0);\nexport default { name: 'pe', steps: [{ name: 'a', run: () => 1 }] };\n`,
    });
    const before = await snapshot(url, ALL_TABLES);
    for (const args of [['run', 'pe'], ['list'], ['run', 'pe', '--json']]) {
      const r = await runCli(['--jobs-dir', dir, ...args], { url });
      expect(r.code, r.stderr).toBe(2);
      expect(lines(r.stderr)).toEqual([
        expect.stringMatching(
          new RegExp(`^idem: error: cannot load jobs file ${esc(path.join(dir, 'pe.ts'))}:1:\\d+: it called process\\.exit\\(0\\) while loading; a job file may not end the process: throw an Error instead, or check the condition in a step$`),
        ),
      ]);
      if (args.includes('--json')) expect(JSON.parse(r.stdout)).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.jobLoadFailed' });
    }
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });
});

describe('a path given as a job name', () => {
  it('suggests the job the file holds (or the one its base name names), as a name with an extension does', async () => {
    // Black-box tester: `idem run jobs/slow.ts` listed every known name, while `idem run slow.ts`
    // suggested 'slow' (by edit distance alone, so a file whose job has another name got nothing).
    const dir = await jobFolder('paths', {
      'slow.js': `export default { name: 'slow', steps: [{ name: 'a', run() {} }] };\n`,
      'backfill.js': `export default { name: 'backfill-order-totals', steps: [{ name: 'a', run() {} }] };\n`,
      'other.js': `export default { name: 'other', steps: [{ name: 'a', run() {} }] };\n`,
    });
    const cwd = path.dirname(dir);
    const before = await snapshot(url, ALL_TABLES);
    const cases: Array<[string, string]> = [
      ['jobs/slow.ts', 'slow'],
      ['jobs/slow.js', 'slow'],
      ['slow.ts', 'slow'],
      ['./jobs/backfill.js', 'backfill-order-totals'],
      [path.join(dir, 'backfill.js'), 'backfill-order-totals'],
      ['jobs/backfill.ts', 'backfill-order-totals'],
      ['backfill.mjs', 'backfill-order-totals'],
      ['jobs/backfill', 'backfill-order-totals'],
    ];
    for (const [given, meant] of cases) {
      const r = await runCli(['run', given], { url, cwd });
      expect(refusal(r, 2), given).toEqual([`idem: error: no job named '${given}'; did you mean '${meant}'?`]);
    }
    // The commands that take a job's name to find its runs say the same.
    const status = await runCli(['status', 'jobs/backfill.js'], { url, cwd });
    expect(refusal(status, 2)).toEqual([`idem: error: no job named 'jobs/backfill.js'; did you mean 'backfill-order-totals'?`]);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });
});

describe('a folder given with --jobs-dir or --migrations-dir must exist', () => {
  it('run in a directory without jobs/ says so (not "known: none"): run idem in the project root, --jobs-dir, or idem init', async () => {
    // The commonest slip: `npx idem run x` from a subfolder, or before `idem init`.
    const cwd = path.join(tmp, 'no-jobs-here');
    await mkdir(cwd, { recursive: true });
    const before = await snapshot(url, ALL_TABLES);
    const r = await runCli(['run', 'backfill'], { url, cwd });
    expect(refusal(r, 2)).toEqual([
      `idem: error: no job named 'backfill': there is no jobs/ folder in ${cwd}; run idem in your project's root, pass --jobs-dir, or create one with idem init`,
    ]);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a missing explicit folder exits 2 naming it, for every command; nothing is written', async () => {
    const missing = path.join(tmp, 'no-such-folder');
    const before = await snapshot(url, ALL_TABLES);
    const results = await Promise.all([
      runCli(['--jobs-dir', missing, 'list'], { url }),
      runCli(['--jobs-dir', missing, 'run', 'counted'], { url }),
      runCli(['--migrations-dir', missing, 'migrate'], { url }),
      runCli(['--jobs-dir', missing, 'status'], { url }),
    ]);
    expect(refusal(results[0]!, 2)).toEqual([`idem: error: --jobs-dir ${missing}: no such folder; create it or fix the path`]);
    expect(refusal(results[1]!, 2)).toEqual([`idem: error: --jobs-dir ${missing}: no such folder; create it or fix the path`]);
    expect(refusal(results[2]!, 2)).toEqual([`idem: error: --migrations-dir ${missing}: no such folder; create it or fix the path`]);
    expect(refusal(results[3]!, 2)).toEqual([`idem: error: --jobs-dir ${missing}: no such folder; create it or fix the path`]);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a folder the command does not read is not checked: run reads only the jobs folder', async () => {
    const r = await runCli(['--jobs-dir', FIXTURE_JOBS, '--migrations-dir', path.join(tmp, 'no-such-folder'), 'run', 'counted', '--dry-run'], { url });
    expect(r.code, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^dry run: job "counted"/);
  });

  it('a file given as a folder is refused too', async () => {
    const file = path.join(FIXTURE_JOBS, 'counted.ts');
    expect(refusal(await runCli(['--jobs-dir', file, 'list'], { url }), 2)).toEqual([`idem: error: --jobs-dir ${file}: not a folder; pass the folder that holds the job files`]);
  });

  it('the default folders may be absent: list works and says so at debug level', async () => {
    // The repo root has jobs/ and migrations/; an empty project folder has neither.
    const empty = path.join(tmp, 'empty-project');
    await mkdir(empty, { recursive: true });
    const r = await runCli(['--log-level', 'debug', 'list', '--json'], { url, cwd: empty });
    expect(r.code, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout)).toEqual([]);
    const debug = lines(r.stderr).filter((l) => l.includes('no jobs folder') || l.includes('no migrations folder'));
    expect(debug).toHaveLength(2);
    expect(debug.every((l) => JSON.parse(l).level === 20)).toBe(true);
  });
});

describe('an unknown job name suggests the closest known ones', () => {
  it('run, status, pause, resume, cancel and reset exit 2 with "did you mean", and write nothing', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const results = await Promise.all([
      idem(['run', 'countd']),
      idem(['status', 'countd']),
      idem(['pause', 'countd']),
      idem(['resume', 'countd']),
      idem(['cancel', 'countd']),
      idem(['reset', 'countd', '--key', 'k']),
    ]);
    for (const r of results) expect(refusal(r, 2)).toEqual([`idem: error: no job named 'countd'; did you mean 'counted'?`]);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a job name far longer than any job name can be is quoted cut, as a long run key is', async () => {
    // Black-box round 13: a 5,000-character unknown name was echoed whole in the one-line error.
    const name = 'x'.repeat(5_000);
    for (const args of [['run', name], ['status', name], ['pause', name]]) {
      const r = await idem(args);
      const [line] = refusal(r, 2);
      expect(line, args[0]).toMatch(new RegExp(`^idem: error: no job named '${'x'.repeat(40)}…' \\(5000 characters; a job name has at most 100\\) in \\S+ .*\\(known: [^)]*\\); check the name or --jobs-dir$`));
      expect(line, args[0]).not.toContain('x'.repeat(41));
      // The known names are listed ten at most of each kind (other tests' jobs may have runs here).
      expect(line!.replace(/\(known: [^)]*\)/, '').length, args[0]).toBeLessThan(400);
    }
  });

  it('on a database without idem\'s schema: status, pause, resume, cancel and reset refuse the name and create no schema', async () => {
    const schema = 'unknown_name_fresh';
    await query(url, `drop schema if exists ${schema} cascade`);
    const results = await Promise.all([
      idem(['--schema', schema, 'status', 'countd']),
      idem(['--schema', schema, 'pause', 'countd']),
      idem(['--schema', schema, 'resume', 'countd']),
      idem(['--schema', schema, 'cancel', 'countd']),
      idem(['--schema', schema, 'reset', 'countd', '--key', 'k']),
    ]);
    for (const r of results) expect(refusal(r, 2)).toEqual([`idem: error: no job named 'countd'; did you mean 'counted'?`]);
    expect(await query(url, `select to_regnamespace($1)::text as s`, [schema])).toEqual([{ s: null }]);
    // A known name still works there, and so does a read of all jobs; reading creates nothing
    // (black-box round 13: `status --schema <typo>` created a whole idem schema, and under a
    // read-only role asked for GRANT CREATE ON DATABASE).
    const reads = await Promise.all([
      idem(['--schema', schema, 'status', 'counted']),
      idem(['--schema', schema, 'status']),
      idem(['--schema', schema, 'status', '--json']),
      idem(['--schema', schema, 'status', 'counted', '--key', 'k']),
      idem(['--schema', schema, 'list', '--json']),
    ]);
    for (const r of reads.slice(0, 2)) {
      expect(r.code, r.stderr).toBe(0);
      expect(r.stdout).toBe(`no runs yet (schema "${schema}" holds no idem runs: idem creates it at the first run or migrate; check --schema)\n`);
    }
    expect(reads[2]!.code, reads[2]!.stderr).toBe(0);
    expect(JSON.parse(reads[2]!.stdout)).toEqual([]);
    expect(refusal(reads[3]!, 2)).toEqual([`idem: error: job "counted" has no run with key "k"; see idem status counted for its runs`]);
    expect(reads[4]!.code, reads[4]!.stderr).toBe(0);
    expect(JSON.parse(reads[4]!.stdout)).toContainEqual(expect.objectContaining({ kind: 'job', name: 'counted', state: 'never run' }));
    expect(await query(url, `select to_regnamespace($1)::text as s`, [schema])).toEqual([{ s: null }]);
  });

  it('a --schema that already holds tables of the names idem creates (not idem\'s) is refused, exit 2, and left as it was', async () => {
    const schema = 'app_owned_tables';
    await query(url, `drop schema if exists ${schema} cascade`);
    await query(url, `create schema ${schema}; create table ${schema}.runs (id int primary key, name text); create table ${schema}.steps (x int)`);
    try {
      const r = await idem(['--schema', schema, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'k']);
      expect(refusal(r, 2)).toEqual([
        `idem: error: schema "${schema}" already has tables named runs, steps, which idem would create there, and no idem bookkeeping (idem_migration): they are not idem's; keep idem's tables in a schema of their own with --schema (the default is idem), or rename those tables`,
      ]);
      // Before: "could not create or upgrade the runner schema … relation "runs" already exists", with
      // Kysely's idem_migration and idem_migration_lock tables left in the schema.
      expect(await query(url, `select relname from pg_class where relnamespace = $1::regnamespace and relkind = 'r' order by relname`, [schema])).toEqual([{ relname: 'runs' }, { relname: 'steps' }]);
    } finally {
      await query(url, `drop schema ${schema} cascade`);
    }
  });

  it('a --schema that is a system schema or longer than 63 bytes is refused by run, status and migrate, exit 2, one line, nothing created (B3-9)', async () => {
    // Before: run --schema information_schema (a superuser) created idem's tables in the SQL
    // standard's catalog views' schema; pg_catalog failed on PostgreSQL's "permission denied"; a
    // 70-character name was "not a plain identifier" though it is one (PostgreSQL would cut it to
    // 63 bytes, so two long names could meet in one schema).
    const long = `idem_${'x'.repeat(65)}`;
    const cases = [
      ['pg_catalog', 'schema name "pg_catalog" is a PostgreSQL system schema (the pg_ prefix is reserved), where idem must not create its tables; use a schema of its own (the default is idem)'],
      ['pg_toast', 'schema name "pg_toast" is a PostgreSQL system schema (the pg_ prefix is reserved), where idem must not create its tables; use a schema of its own (the default is idem)'],
      ['information_schema', 'schema name "information_schema" is a PostgreSQL system schema (the SQL standard\'s catalog views), where idem must not create its tables; use a schema of its own (the default is idem)'],
      [long, `schema name "${long.slice(0, 40)}…" is 70 bytes long, and PostgreSQL keeps the first 63 of a name (two long names could meet in one schema); use a name of at most 63 bytes`],
    ] as const;
    const tables = () => query(url, `select count(*)::int as n from pg_class where relnamespace in ('pg_catalog'::regnamespace, 'information_schema'::regnamespace, 'pg_toast'::regnamespace) and relname in ('runs', 'steps', 'chunks', 'idem_migration')`);
    const before = await tables();
    for (const [schema, message] of cases) {
      for (const args of [['run', 'counted', '--params', '{"chunks":1}', '--key', 'k'], ['status'], ['migrate']]) {
        const r = await idem(['--schema', schema, ...args]);
        expect(refusal(r, 2), `${schema} ${args[0]}`).toEqual([`idem: error: ${message}`]);
      }
    }
    expect(await tables()).toEqual(before);
    expect(await query(url, `select count(*)::int as n from pg_namespace where nspname like 'idem_xxx%'`)).toEqual([{ n: 0 }]);
  });

  it('suggests migrations by their job name, and lists the known names when none is close', async () => {
    const [migration, none] = await Promise.all([idem(['status', 'create-widget']), idem(['status', 'zzzzzzzzzzzzzzzz'])]);
    expect(refusal(migration!, 2)).toEqual([`idem: error: no job named 'create-widget'; did you mean 'create-widgets'?`]);
    // Known: the fixture files' jobs and migrations, and any job with runs in the database (other
    // tests of this file may have made some before this one, in a shuffled order).
    // Those with runs only are listed apart, ten at most.
    const files = ['backfill-widgets', 'counted', 'create-widgets', 'ranged'];
    const withRuns = (await query<{ job: string }>(url, `select distinct job from idem.runs`).catch(() => [])).map((r) => r.job);
    const ranOnly = [...new Set(withRuns)].filter((j) => !files.includes(j)).sort();
    const listed = ranOnly.length === 0 ? ''
      : `; with runs only: ${ranOnly.slice(0, 10).join(', ')}${ranOnly.length > 10 ? ` and ${ranOnly.length - 10} more; idem list and idem status show all` : ''}`;
    expect(refusal(none!, 2)).toEqual([
      `idem: error: no job named 'zzzzzzzzzzzzzzzz' in ${FIXTURE_JOBS}/ or ${FIXTURE_MIGRATIONS}/ (known: ${files.join(', ')}${listed}); check the name or --jobs-dir`,
    ]);
  });

  it('run names a migration as one, not as a typo', async () => {
    expect(refusal(await idem(['run', 'create-widgets']), 2)).toEqual([
      `idem: error: 'create-widgets' is a migration in ${FIXTURE_MIGRATIONS}/, not a job; run it with idem migrate`,
    ]);
  });

  it('a known job with no runs, and a name with runs but no file, are not errors', async () => {
    const known = await idem(['status', 'ranged']);
    expect(known.code, known.stderr).toBe(0);
    expect(known.stdout).toBe('no runs yet\n');
    // A run of a job whose file was since deleted: its history is still there to see.
    const runner = await Runner.connect({ connectionString: url });
    try {
      await runner.run({ name: 'retired-job', steps: [{ name: 's', run: async () => {} }] } as never, { key: 'old' });
    } finally {
      await runner.close();
    }
    const retired = await idem(['status', 'retired-job', '--json']);
    expect(retired.code, retired.stderr).toBe(0);
    expect(JSON.parse(retired.stdout)).toEqual([expect.objectContaining({ job: 'retired-job', runKey: 'old', state: 'succeeded' })]);
    // ... and it counts as a known name for suggestions.
    expect(refusal(await idem(['status', 'retired-jobs']), 2)).toEqual([`idem: error: no job named 'retired-jobs'; did you mean 'retired-job'?`]);
  });
});

describe('a job that throws a non-Error value', () => {
  it("`throw 'a string'` in a chunk is reported as that string: exit 1, one line, the run recorded as failed", async () => {
    const dir = await jobFolder('throws-string-in-run', {
      'str.ts': `export default { name: 'throws-string', steps: [{ name: 'only', run: () => { throw 'a string from the job'; } }] };\n`,
    });
    const r = await runCli(['--jobs-dir', dir, 'run', 'throws-string', '--key', 'str'], { url });
    expect(r.code, r.stderr).toBe(1);
    expect(r.stdout).toBe('');
    const errors = lines(r.stderr).filter((l) => l.startsWith('idem: error:'));
    expect(errors).toEqual([
      'idem: error: job "throws-string" failed in step "only" after 1 try: a string from the job; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    ]);
    const status = await runCli(['--jobs-dir', dir, 'status', 'throws-string', '--json'], { url });
    expect(JSON.parse(status.stdout)).toEqual([
      expect.objectContaining({ runKey: 'str', state: 'failed', error: expect.objectContaining({ step: 'only', message: 'a string from the job' }) }),
    ]);
  });
});

describe('a job that throws null, undefined or rejects with nothing', () => {
  // Each chunk sleeps a little so two --join workers both take part.
  const job = (name: string, thrown: string, maxFailedChunks: number) =>
    `export default { name: '${name}', steps: [{ name: 'work', maxFailedChunks: ${maxFailedChunks}, ` +
    `chunks: () => ({ chunks: Array.from({ length: 12 }, (_, i) => ({ key: 'c' + (i + 1) })), next: null }), ` +
    `run: async (_ctx, c) => { await new Promise((r) => setTimeout(r, 50)); if (c.key === 'c2') ${thrown}; } }] };\n`;
  const cases = [
    ['null', 'throw null', 'null'],
    ['undefined', 'throw undefined', 'undefined'],
    ['reject', 'return Promise.reject()', 'undefined'],
  ] as const;

  for (const [id, thrown, shown] of cases) {
    it(`${thrown} in a chunk fails the run in that chunk, exit 1, one line`, async () => {
      const dir = await jobFolder(`throws-${id}`, { 'j.ts': job(`throws-${id}`, thrown, 0) });
      const r = await runCli(['--jobs-dir', dir, 'run', `throws-${id}`, '--key', 'k'], { url });
      expect(r.code, r.stderr).toBe(1);
      expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([
        `idem: error: job "throws-${id}" failed in step "work", chunk c2 after 1 try: ${shown}; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)`,
      ]);
      const [run] = await query<{ error: unknown }>(url, `select error from idem.runs where job = $1`, [`throws-${id}`]);
      expect(run!.error).toMatchObject({ step: 'work', chunk: 'c2', tries: 1, message: shown });
    });

    it(`${thrown} in a chunk is skipped under maxFailedChunks by two --join workers, both exit 0`, async () => {
      const dir = await jobFolder(`skips-${id}`, { 'j.ts': job(`skips-${id}`, thrown, 1) });
      const rs = await Promise.all([0, 1].map(() => runCli(['--jobs-dir', dir, 'run', `skips-${id}`, '--key', 'k', '--join'], { url })));
      for (const r of rs) expect(r.code, r.stderr).toBe(0);
      expect(await query(url, `select c.key, c.error from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = $1 and c.skipped_at is not null`, [`skips-${id}`])).toEqual([
        { key: 'c2', error: shown },
      ]);
      expect((await query<{ status: string }>(url, `select status from idem.runs where job = $1`, [`skips-${id}`]))[0]!.status).toBe('succeeded');
    });
  }
});

describe('the final error line is one line, with control characters escaped', () => {
  /** The `idem: error:` lines of a result, and no raw ESC or CR anywhere on stderr. */
  const errorLines = (r: CliResult) => {
    expect(r.stderr).not.toContain('\x1b');
    expect(r.stderr).not.toContain('\r');
    return lines(r.stderr).filter((l) => l.startsWith('idem: error:'));
  };

  it('an error message with ESC sequences, a tab and a CR: run and finalize print it escaped', async () => {
    const dir = await jobFolder('control-chars', {
      'cc.ts': `export default { name: 'control-chars', steps: [{ name: 'only', run: () => { throw new Error('bad \\x1b[2J\\x1b[31mred\\ttab\\rCR'); } }] };\n`,
    });
    const shown = String.raw`bad \x1b[2J\x1b[31mred\ttab\rCR`;
    const r = await runCli(['--jobs-dir', dir, 'run', 'control-chars', '--key', 'k'], { url });
    expect(r.code, r.stderr).toBe(1);
    expect(errorLines(r)).toEqual([`idem: error: job "control-chars" failed in step "only" after 1 try: ${shown}; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)`]);
    const f = await runCli(['--jobs-dir', dir, 'finalize', 'control-chars', '--key', 'k'], { url });
    expect(f.code, f.stderr).toBe(1);
    const [line] = errorLines(f);
    expect(line).toContain(shown);
    expect(lines(f.stderr).filter((l) => !l.startsWith('{'))).toEqual([line]);
  });

  it('a params validator whose message has a newline: one line, exit 2 (function and Standard Schema)', async () => {
    const dir = await jobFolder('params-newline', {
      'fn.ts': `export default { name: 'params-fn', params: () => { throw new Error('first line\\nsecond line'); }, steps: [{ name: 'a', run: () => {} }] };\n`,
      'ss.ts':
        `export default { name: 'params-ss', params: { '~standard': { version: 1, vendor: 'test', validate: () => ({ issues: [{ message: 'bad\\nvalue\\x1b[2J', path: ['n'] }] }) } }, ` +
        `steps: [{ name: 'a', run: () => {} }] };\n`,
    });
    const fn = refusal(await runCli(['--jobs-dir', dir, 'run', 'params-fn', '--key', 'k'], { url }), 2);
    expect(fn).toEqual([String.raw`idem: error: invalid params for job "params-fn": first line\nsecond line`]);
    const ss = await runCli(['--jobs-dir', dir, 'run', 'params-ss', '--key', 'k'], { url });
    expect(refusal(ss, 2)).toEqual([String.raw`idem: error: invalid params for job "params-ss": n: bad\nvalue\x1b[2J`]);
    expect(errorLines(ss)).toHaveLength(1);
  });

  it('a thrown plain object shows its message, or else its JSON, not [object Object]', async () => {
    const dir = await jobFolder('plain-object', {
      'msg.ts': `export default { name: 'obj-message', steps: [{ name: 'only', run: () => { throw { message: 'x from an object', status: 500 }; } }] };\n`,
      'json.ts': `export default { name: 'obj-json', steps: [{ name: 'only', run: () => { throw { status: 500, reason: 'nope' }; } }] };\n`,
    });
    const m = await runCli(['--jobs-dir', dir, 'run', 'obj-message', '--key', 'k'], { url });
    expect(m.code, m.stderr).toBe(1);
    expect(errorLines(m)).toEqual(['idem: error: job "obj-message" failed in step "only" after 1 try: x from an object; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)']);
    const j = await runCli(['--jobs-dir', dir, 'run', 'obj-json', '--key', 'k'], { url });
    expect(j.code, j.stderr).toBe(1);
    expect(errorLines(j)).toEqual(['idem: error: job "obj-json" failed in step "only" after 1 try: {"status":500,"reason":"nope"}; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)']);
  });
});

/** idem's line for pg's deprecation note on sslmode=prefer, require and verify-ca (which pg takes for verify-full). */
const SSLMODE_WARNING = (mode: string) =>
  `idem: warning: sslmode=${mode} in the database URL is taken by pg for verify-full (TLS only, the server's certificate and host name verified${mode === 'prefer' ? ', no plain connection when the server has no TLS' : ''}), not for libpq's ${mode}; write sslmode=verify-full to say so, sslmode=no-verify for TLS without verification, or sslmode=disable for no TLS`;

describe("a library's warning is one line too", () => {
  it("pg's multi-line note on sslmode=require comes out as one `idem: warning:` line before the error", async () => {
    const r = await runCli([...FIXTURE_DIRS, 'status'], { url: 'postgres://u:secret@127.0.0.1:1/x?sslmode=require' });
    expect(r.code, r.stderr).toBe(2);
    const out = lines(r.stderr).filter((l) => !l.startsWith('{'));
    // Before: Node's "(node:123) Warning: SECURITY WARNING: …" and eight more lines; then those
    // lines joined into one (B12: pg's advice, uselibpqcompat=true, which does not help); now idem's own line.
    expect(out).toEqual([SSLMODE_WARNING('require'), expect.stringMatching(/^idem: error: cannot reach the database/)]);
    expect(r.stderr).not.toContain('secret');
  });
});

describe('SSL settings in the URL that pg does not read as meant (B2-15)', () => {
  // pg takes any sslmode it does not know (`bogus`, libpq's `allow`) for full verification, and any
  // ssl value but true, 1, 0 and no-verify (`maybe`, even `false`) for "use TLS": the server
  // without TLS then answered "The server does not support SSL connections". Refused before
  // connecting instead, naming the parameter and the values pg reads; the password never printed.
  const withQuery = (query: string) => {
    const u = new URL(url);
    u.search = query;
    return u.toString();
  };
  const password = () => decodeURIComponent(new URL(url).password);

  it('sslmode=bogus, sslmode=allow, ssl=maybe, ssl=false: exit 2, one line, nothing written, for status and run', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const cases = [
      ['sslmode=bogus', 'DATABASE_URL has sslmode=bogus, which pg does not know; use sslmode=disable, prefer, require, verify-ca, verify-full or no-verify (or leave it out)'],
      ['sslmode=allow', 'DATABASE_URL has sslmode=allow, which pg does not know; use sslmode=disable, prefer, require, verify-ca, verify-full or no-verify (or leave it out)'],
      ['ssl=maybe', 'DATABASE_URL has ssl=maybe, which pg does not know; use ssl=true, 1, 0 or no-verify, or sslmode= (disable, prefer, require, verify-ca, verify-full or no-verify)'],
      ['ssl=false', 'DATABASE_URL has ssl=false, which pg does not know; use ssl=true, 1, 0 or no-verify, or sslmode= (disable, prefer, require, verify-ca, verify-full or no-verify)'],
    ] as const;
    for (const [query, message] of cases) {
      for (const args of [['status'], ['run', 'counted', '--key', 'ssl-bad']]) {
        const r = await runCli([...FIXTURE_DIRS, ...args], { url: withQuery(query) });
        expect(refusal(r, 2), query).toEqual([`idem: error: ${message}`]);
        expect(r.stderr).not.toContain(password());
      }
    }
    const flag = await runCli([...FIXTURE_DIRS, '--database-url', withQuery('sslmode=bogus'), 'status']);
    expect(refusal(flag, 2)).toEqual(['idem: error: --database-url has sslmode=bogus, which pg does not know; use sslmode=disable, prefer, require, verify-ca, verify-full or no-verify (or leave it out)']);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('sslmode=prefer against a server without TLS (B12): one idem warning line, then an error saying pg does not fall back; nothing written', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const cases = [
      // pg's own note (several sentences, advice to use uselibpqcompat=true) is idem's one line.
      ['sslmode=prefer', [SSLMODE_WARNING('prefer')]],
      // pg's advice followed: it asks for TLS all the same (without verification), and warns nothing.
      ['uselibpqcompat=true&sslmode=prefer', []],
    ] as const;
    for (const [query, warnings] of cases) {
      for (const args of [['status'], ['run', 'counted', '--key', 'ssl-prefer']]) {
        const r = await runCli([...FIXTURE_DIRS, ...args], { url: withQuery(query) });
        expect({ code: r.code, stdout: r.stdout }, r.stderr).toEqual({ code: 2, stdout: '' });
        const out = lines(r.stderr);
        expect(out.slice(0, -1), query).toEqual(warnings);
        expect(out.at(-1), query).toMatch(
          /^idem: error: the database at postgres:\/\/.*:\*\*\*@.* does not accept SSL \(TLS\) connections, and DATABASE_URL has sslmode=prefer, with which pg insists on TLS \(unlike libpq, it does not fall back to a plain connection\); enable ssl on the server, or set sslmode=disable in DATABASE_URL$/,
        );
        expect(r.stderr).not.toContain(password());
      }
    }
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('PGSSLMODE=prefer against a server without TLS: the error says pg does not fall back either', async () => {
    const r = await runCli([...FIXTURE_DIRS, 'status'], { url, env: { PGSSLMODE: 'prefer' } });
    expect(refusal(r, 2)).toEqual([
      expect.stringMatching(
        /^idem: error: the database at postgres:\/\/.*:\*\*\*@.* does not accept SSL \(TLS\) connections, and PGSSLMODE=prefer asks for one \(pg insists on TLS with it: unlike libpq, it does not fall back to a plain connection\); enable ssl on the server, or unset PGSSLMODE$/,
      ),
    ]);
  });

  it('sslmode=require and verify-ca against a server without TLS: idem\'s one warning line, then the error', async () => {
    for (const mode of ['require', 'verify-ca']) {
      const r = await runCli([...FIXTURE_DIRS, 'status'], { url: withQuery(`sslmode=${mode}`) });
      expect({ code: r.code, stdout: r.stdout }, r.stderr).toEqual({ code: 2, stdout: '' });
      const out = lines(r.stderr);
      expect(out[0], mode).toBe(SSLMODE_WARNING(mode));
      expect(out.slice(1), mode).toEqual([expect.stringMatching(/ does not accept SSL \(TLS\) connections, and DATABASE_URL asks for one; enable ssl on the server, or set sslmode=disable in DATABASE_URL$/)]);
    }
  });

  it('uselibpqcompat=true&sslmode=verify-ca without sslrootcert: one line naming the fix, not pg\'s SECURITY WARNING; nothing written', async () => {
    // Before: `cannot connect to the database at …: SECURITY WARNING: Using sslmode=verify-ca requires …` (four sentences).
    const before = await snapshot(url, ALL_TABLES);
    for (const args of [['status'], ['run', 'counted', '--key', 'ssl-ca']]) {
      const r = await runCli([...FIXTURE_DIRS, ...args], { url: withQuery('uselibpqcompat=true&sslmode=verify-ca') });
      expect(refusal(r, 2)).toEqual([
        'idem: error: DATABASE_URL has uselibpqcompat=true and sslmode=verify-ca but no sslrootcert, which pg refuses (verify-ca checks the certificate against your own CA, not its host name); add sslrootcert=<your CA file>, or use sslmode=verify-full',
      ]);
      expect(r.stderr).not.toContain(password());
    }
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('sslmode=verify-full (or ssl=true) against a server without TLS: says the server does not accept it and the fix', async () => {
    for (const query of ['sslmode=verify-full', 'ssl=true']) {
      const r = await runCli([...FIXTURE_DIRS, 'status'], { url: withQuery(query) });
      const out = refusal(r, 2);
      expect(out, query).toHaveLength(1);
      expect(out[0]).toMatch(/^idem: error: the database at postgres:\/\/.*:\*\*\*@.* does not accept SSL \(TLS\) connections, and DATABASE_URL asks for one; enable ssl on the server, or set sslmode=disable in DATABASE_URL$/);
      expect(r.stderr).not.toContain(password());
    }
  });
});

describe('a failed chunk\'s message with newlines is recorded whole', () => {
  const pretty = JSON.stringify([{ id: 1, problem: 'bad' }], null, 2);
  const cases = [
    ['error', `throw new Error('first\\nsecond-line-detail')`, 'first\nsecond-line-detail'],
    ['string', `throw 'plain\\nstring'`, 'plain\nstring'],
    ['pretty', `throw new Error(JSON.stringify([{ id: 1, problem: 'bad' }], null, 2))`, pretty],
  ] as const;
  for (const [id, thrown, message] of cases) {
    it(`${thrown}: the run's error, status, status --json, run --json and the final line keep all of it`, async () => {
      const name = `multiline-${id}`;
      const dir = await jobFolder(name, { 'j.ts': `export default { name: '${name}', steps: [{ name: 'only', run: () => { ${thrown}; } }] };\n` });
      const escaped = message.replace(/\n/g, '\\n');
      const r = await runCli(['--jobs-dir', dir, 'run', name, '--key', 'k', '--json'], { url });
      expect(r.code, r.stderr).toBe(1);
      const whole = `job "${name}" failed in step "only" after 1 try: ${message}; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)`;
      expect(JSON.parse(r.stdout)).toMatchObject({ status: 'error', exitCode: 1, error: whole });
      expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([`idem: error: ${whole.replace(/\n/g, '\\n')}`]);
      const [row] = await query<{ message: string }>(url, `select error->>'message' as message from idem.runs where job = $1 and run_key = 'k'`, [name]);
      expect(row?.message).toBe(message);
      const json = await runCli(['--jobs-dir', dir, 'status', name, '--json'], { url });
      expect(JSON.parse(json.stdout)).toEqual([expect.objectContaining({ runKey: 'k', state: 'failed', error: expect.objectContaining({ step: 'only', message }) })]);
      const table = await runCli(['--jobs-dir', dir, 'status', name], { url });
      expect(table.code, table.stderr).toBe(0);
      expect(table.stdout).toContain(escaped.slice(0, 60));
    });
  }
});

describe('a job definition that loads but is wrong is refused (exit 2), naming the file and the fix', () => {
  it('unknown keys (a typo, a stray key) at the job and the step level: each named with the closest known key, all at once', async () => {
    const dir = await jobFolder('unknown-keys', {
      'typo.js': `export default { name: 'typo', schedual: '0 * * * *', bogus: 1, steps: [{ name: 'a', maxFailedChunk: 2, run() {} }, { name: 'b', run() {}, chunk: () => null }] };\n`,
    });
    const before = await snapshot(url, ALL_TABLES);
    const out = refusal(await runCli(['--jobs-dir', dir, 'run', 'typo'], { url }), 2);
    expect(out).toEqual([
      `idem: error: ${path.relative(REPO, path.join(dir, 'typo.js'))}: invalid job definition: unknown key "schedual" (did you mean "schedule"?); unknown key "bogus" (known: name, description, version, params, steps, retry, throttle, health, schedule); steps[0]: unknown key "maxFailedChunk" (did you mean "maxFailedChunks"?); steps[1]: unknown key "chunk" (did you mean "chunks"?)`,
    ]);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('unknown keys inside schedule, retry and throttle, of the job and of a step: each named with where it is and the closest known key', async () => {
    // Black-box round 13: these loaded, and did nothing: the job ran at 03:00 UTC, made 5 tries, ran unthrottled.
    const dir = await jobFolder('unknown-nested-keys', {
      'nested.js': `export default { name: 'nested', schedule: { cron: '0 3 * * *', timezon: 'Europe/Berlin' }, retry: { attempt: 1 }, throttle: { maxrate: 5 },
        steps: [{ name: 'a', throttle: { pausems: 5 }, retry: { bsae: 10, max: 100 }, run() {} }] };\n`,
    });
    const goodDir = await jobFolder('known-nested-keys', {
      'good.js': `export default { name: 'good', schedule: { cron: '0 3 * * *', timezone: 'Europe/Berlin' }, retry: { base: 1, max: 2, factor: 2, attempts: 3 }, throttle: { maxRate: 5, pauseMs: 1, targetChunkMs: 100 },
        steps: [{ name: 'a', throttle: { pauseMs: 5 }, retry: { attempts: 1 }, health: { lockWaitMs: 100 }, run() {} }] };\n`,
    });
    const before = await snapshot(url, ALL_TABLES);
    const [nested, crontab] = await Promise.all([runCli(['--jobs-dir', dir, 'run', 'nested'], { url }), runCli(['--jobs-dir', dir, 'crontab', '--command', 'npx idem'])]);
    const expected = [
      `idem: error: ${path.relative(REPO, path.join(dir, 'nested.js'))}: invalid job definition: schedule: unknown key "timezon" (did you mean "timezone"?); throttle: unknown key "maxrate" (did you mean "maxRate"?); retry: unknown key "attempt" (did you mean "attempts"?); steps[0].throttle: unknown key "pausems" (did you mean "pauseMs"?); steps[0].retry: unknown key "bsae" (did you mean "base"?)`,
    ];
    expect(refusal(nested, 2)).toEqual(expected);
    expect(refusal(crontab, 2)).toEqual(expected);
    // Every key these objects take is still taken.
    const good = await runCli(['--jobs-dir', goodDir, 'run', 'good', '--dry-run'], { url });
    expect(good.code, good.stderr).toBe(0);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a job and a migration of the same name are refused by every command that reads both folders, naming both files', async () => {
    const root = path.join(tmp, 'shared-name');
    await mkdir(path.join(root, 'jobs'), { recursive: true });
    await mkdir(path.join(root, 'migrations'), { recursive: true });
    await writeFile(path.join(root, 'package.json'), JSON.stringify({ type: 'module' }));
    const hello = `export default { name: 'hello', steps: [{ name: 'a', run() {} }] };\n`;
    await writeFile(path.join(root, 'jobs', 'hello.js'), hello);
    await writeFile(path.join(root, 'jobs', 'other.js'), `export default { name: 'other', steps: [{ name: 'a', run() {} }] };\n`);
    await writeFile(path.join(root, 'migrations', '0001_a.js'), `export default { name: 'first', steps: [{ name: 'a', run() {} }] };\n`);
    await writeFile(path.join(root, 'migrations', '0002_b.js'), hello);
    const before = await snapshot(url, ALL_TABLES);
    const in_ = (args: string[]) => runCli(args, { url, cwd: root, timeoutMs: 20_000, env: { IDEM_API_TOKEN: 'a'.repeat(64) } });
    const results = await Promise.all([
      in_(['run', 'hello']),
      in_(['run', 'hello', '--key', '0002_b']),
      in_(['finalize', 'hello', '--key', 'k']),
      in_(['list']),
      in_(['status', 'hello']),
      in_(['migrate']),
      in_(['serve', '--port', '0']),
    ]);
    for (const r of results) {
      expect(refusal(r, 2)).toEqual([
        'idem: error: job name "hello" is defined twice (jobs/hello.js and migrations/0002_b.js): a job and a migration may not share a name (they would share one lock and one list of runs); rename one',
      ]);
    }
    // A job of another name runs: the folders are not refused as a whole.
    expect((await in_(['run', 'other', '--dry-run'])).code).toBe(0);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    // A name with runs already (made before the clash, here in process) is refused too.
    const runner = await Runner.connect({ connectionString: url });
    try {
      await runner.run({ name: 'hello', steps: [{ name: 'a', run: async () => {} }] } as never, { key: 'before-the-clash' });
    } finally {
      await runner.close();
    }
    expect(refusal(await in_(['status', 'hello']), 2)[0]).toMatch(/^idem: error: job name "hello" is defined twice \(jobs\/hello\.js and migrations\/0002_b\.js\)/);
  });

  it('a migration declaring params or a schedule, or whose file name is too long to be its run key, is refused naming the file and the fix', async () => {
    const dir = await jobFolder('migration-params', {
      '0001_p.js': `export default { name: 'with-params', params: (raw) => raw, schedule: '0 * * * *', steps: [{ name: 'a', run() {} }] };\n`,
    });
    const long = `0001_${'x'.repeat(196)}`;
    const longDir = await jobFolder('migration-long-name', { [`${long}.js`]: `export default { name: 'long-name', steps: [{ name: 'a', run() {} }] };\n` });
    const before = await snapshot(url, ALL_TABLES);
    const [declared, tooLong] = await Promise.all([runCli(['--migrations-dir', dir, 'migrate'], { url }), runCli(['--migrations-dir', longDir, 'migrate', '--json'], { url })]);
    expect(refusal(declared, 2)).toEqual([
      `idem: error: ${path.relative(REPO, path.join(dir, '0001_p.js'))}: a migration takes no params (it runs once per database, with its file name as run key): remove params, or make it a job in the jobs folder; a migration has no schedule (idem migrate runs it, once): remove schedule, or make it a job in the jobs folder`,
    ]);
    const message = `${path.relative(REPO, path.join(longDir, `${long}.js`))}: the migration's file name without its extension is its run key, at most 200 characters; this one has 201: rename the file`;
    expect({ code: tooLong.code, stderr: tooLong.stderr }).toEqual({ code: 2, stderr: `idem: error: ${message}\n` });
    expect(JSON.parse(tooLong.stdout)).toEqual([{ runKey: null, job: null, status: 'error', exitCode: 2, code: 'idem.invalidMigration', error: message }]);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });
});

describe('a chunk source mistake is its step\'s', () => {
  it('a chunk spec holding a BigInt: exit 1, the step named, what to fix', async () => {
    const dir = await jobFolder('bigint-cli', {
      'b.ts': `export default { name: 'bigint-cli', steps: [{ name: 'plan', chunks: () => ({ chunks: [{ key: 'k1', id: 10n }], next: null }), run: () => {} }] };\n`,
    });
    const r = await runCli(['--jobs-dir', dir, 'run', 'bigint-cli', '--key', 'k'], { url });
    expect(r.code, r.stderr).toBe(1);
    expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([
      'idem: error: job "bigint-cli" failed in step "plan" after 1 try: chunk k1: chunk specs must be JSON: a BigInt (at id) cannot be stored; convert it to a string or number; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    ]);
  });
});

describe('the JSON log line of a failure names the error class', () => {
  it('a PostgreSQL error in a chunk logs type DatabaseError with its SQLSTATE, not a bare "Object"', async () => {
    const dir = await jobFolder('database-error', {
      'missing.mjs': `export default { name: 'missing-table', steps: [{ name: 'only', run: ({ db }) => db.selectFrom('no_such_table_here').selectAll().execute() }] };\n`,
    });
    const r = await runCli(['--jobs-dir', dir, 'run', 'missing-table', '--key', 'db-err'], { url });
    expect(r.code, r.stderr).toBe(1);
    const failed = logLines(r.stderr).find((l) => l.msg === 'run failed');
    expect(failed?.err).toEqual({ type: 'DatabaseError', message: 'relation "no_such_table_here" does not exist', code: '42P01' });
  });

  it('a transient error retried in a chunk logs its class too', async () => {
    const dir = await jobFolder('transient-error', {
      'flaky.mjs':
        `let tries = 0;\nexport default { name: 'flaky', steps: [{ name: 'only', run: () => { if (++tries === 1) throw Object.assign(new TypeError('socket hang up'), { code: 'ECONNRESET' }); } }] };\n`,
    });
    const r = await runCli(['--jobs-dir', dir, 'run', 'flaky', '--key', 'flaky-1'], { url });
    expect(r.code, r.stderr).toBe(0);
    const retried = logLines(r.stderr).find((l) => l.msg === 'transient error, retrying chunk');
    expect(retried?.err).toEqual({ type: 'TypeError', message: 'socket hang up', code: 'ECONNRESET' });
  });

  it("a refused connection to a host with two addresses (Node's AggregateError, whose own message is empty) says what was refused", async () => {
    // localhost is ::1 and 127.0.0.1 on most machines: Node tries both and throws an AggregateError
    // with message '' and code ECONNREFUSED. The lookup is the job's own so the test does not
    // depend on /etc/hosts; port 1 on loopback has no listener.
    const dir = await jobFolder('aggregate-error', {
      'callout.mjs': `import net from 'node:net';
const connect = () => new Promise((resolve, reject) => {
  const s = net.connect({ port: 1, host: 'localhost', autoSelectFamily: true,
    lookup: (h, o, cb) => (o.all ? cb(null, [{ address: '::1', family: 6 }, { address: '127.0.0.1', family: 4 }]) : cb(null, '127.0.0.1', 4)) });
  s.on('connect', () => { s.destroy(); resolve(); });
  s.on('error', reject);
});
export default { name: 'callout', retry: { attempts: 2, base: 10, max: 20 }, steps: [{ name: 'call', run: () => connect() }] };
`,
    });
    const r = await runCli(['--jobs-dir', dir, 'run', 'callout', '--key', 'agg'], { url });
    expect(r.code, r.stderr).toBe(1);
    const logged = logLines(r.stderr);
    for (const msg of ['transient error, retrying chunk', 'run failed']) {
      const line = logged.find((l) => l.msg === msg);
      expect(line?.err, msg).toEqual({ type: 'AggregateError', message: expect.stringContaining('connect ECONNREFUSED 127.0.0.1:1'), code: 'ECONNREFUSED' });
    }
    const errors = lines(r.stderr).filter((l) => l.startsWith('idem: error:'));
    expect(errors).toEqual([expect.stringMatching(/^idem: error: job "callout" failed in step "call" after 2 tries: \S.*connect ECONNREFUSED 127\.0\.0\.1:1.*; fix the cause/)]);
    const [row] = await query<{ message: string }>(url, `select error->>'message' as message from idem.runs where job = 'callout' and run_key = 'agg'`);
    expect(row?.message).toContain('connect ECONNREFUSED 127.0.0.1:1');
  });
});

function esc(s: string): string {
  return s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
}

describe('a role or database that sets default_transaction_read_only = on', () => {
  it('run, finalize and the operators refuse with exit 2 and one line naming the setting (not a bare "read-only transaction", exit 1); nothing written', async () => {
    // Black-box round 12 (B2-4).
    const url = testDb.url;
    const dbName = new URL(url).pathname.slice(1);
    const done = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'ro-done'], { url });
    expect(done.code, done.stderr).toBe(0);
    await query(url, `alter database ${dbName} set default_transaction_read_only = on`);
    try {
      const before = await snapshot(url, ALL_TABLES);
      const results = await Promise.all([
        runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'ro-new', '--json'], { url }),
        runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'ro-done'], { url }),
        runCli([...FIXTURE_DIRS, 'finalize', 'counted', '--key', 'ro-new'], { url }),
        runCli([...FIXTURE_DIRS, 'pause', 'counted', '--key', 'ro-done'], { url }),
        runCli([...FIXTURE_DIRS, 'reset', 'counted', '--key', 'ro-done'], { url }),
      ]);
      for (const r of results) {
        expect(r.code, r.stderr).toBe(2);
        expect(lines(r.stderr), r.stderr).toEqual([expect.stringMatching(/^idem: error: the role or database sets default_transaction_read_only = on, so idem cannot write its bookkeeping \(nothing was written\); reset it/)]);
      }
      expect(JSON.parse(results[0]!.stdout)).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.readOnlyDefault' });
      expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    } finally {
      // A session of a read-only database sets it off for itself first, then resets the database's.
      const { default: pg } = await import('pg');
      const c = new pg.Client({ connectionString: url });
      await c.connect();
      await c.query('set default_transaction_read_only = off');
      await c.query(`alter database ${dbName} reset default_transaction_read_only`);
      await c.end();
    }
  });
});

describe('a statement_timeout (set for the role or database) that cuts a statement short', () => {
  // Black-box round 12 (B2-7): every command printed PostgreSQL's bare "canceling statement due to
  // statement timeout" and exited 1, as if the run had failed, naming neither the setting nor a fix.
  it("idem's own statement, waiting on a lock past it: exit 2 and one line naming the setting and the fix; nothing written", async () => {
    const url = testDb.url;
    const dbName = new URL(url).pathname.slice(1);
    const done = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'st-done'], { url });
    expect(done.code, done.stderr).toBe(0);
    const { default: pg } = await import('pg');
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    await query(url, `alter database ${dbName} set statement_timeout = '300ms'`);
    try {
      const before = await snapshot(url, ALL_TABLES);
      // idem's tables locked by someone else: each command's first read of them waits, and is cut off.
      await holder.query('set statement_timeout = 0; begin; lock table idem.runs in access exclusive mode');
      const results = [];
      for (const args of [['run', 'counted', '--params', '{"chunks":1}', '--key', 'st-new', '--json'], ['run', 'counted', '--params', '{"chunks":1}', '--key', 'st-done'], ['status'], ['pause', 'counted', '--key', 'st-done']]) {
        results.push(await runCli([...FIXTURE_DIRS, ...args], { url }));
      }
      await holder.query('rollback');
      for (const r of results) {
        expect(r.code, r.stderr).toBe(2);
        expect(lines(r.stderr), r.stderr).toEqual([
          expect.stringMatching(/^idem: error: the database cancelled a statement of idem's at the statement_timeout set for the role or database \(SHOW statement_timeout\): it waited on a lock or ran longer; raise it for the role idem connects as \(ALTER ROLE postgres SET statement_timeout = '5min'\) or reset it, then run the same command again$/),
        ]);
      }
      expect(JSON.parse(results[0]!.stdout)).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.statementTimeout' });
      expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    } finally {
      await holder.end();
      await query(url, `alter database ${dbName} reset statement_timeout`);
    }
  });

  it("a chunk's statement: the run fails (exit 1) and its error says what to change", async () => {
    const url = testDb.url;
    const dbName = new URL(url).pathname.slice(1);
    const { default: pg } = await import('pg');
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    await query(url, `insert into gates values ('st-gate') on conflict do nothing`);
    await query(url, `alter database ${dbName} set statement_timeout = '300ms'`);
    try {
      // The chunk waits for the gate row, which another session holds.
      await holder.query(`begin; select 1 from gates where name = 'st-gate' for update`);
      const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1,"gate":"st-gate"}', '--key', 'st-chunk'], { url });
      await holder.query('rollback');
      expect(r.code, r.stderr).toBe(1);
      const want = /^job "counted" failed in step "work", chunk c0001 after 1 try: canceling statement due to statement timeout \(the statement_timeout set for the role or database, or by the job, cut it short: give a chunk less to do, or raise it for the role idem connects as \(ALTER ROLE postgres SET statement_timeout = '5min'\) or in the chunk \(SET LOCAL statement_timeout\)\); fix the cause and run the same command again to resume there \(with --allow-changed-code if the fix changes the code of the job\)$/;
      expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([expect.stringMatching(new RegExp(`^idem: error: ${want.source.slice(1)}`))]);
      const [run] = await query(url, `select status, error->>'message' as message from idem.runs where job = 'counted' and run_key = 'st-chunk'`);
      expect(run).toEqual({ status: 'failed', message: expect.stringMatching(/^canceling statement due to statement timeout \(the statement_timeout set for the role or database, or by the job, cut it short: /) });
    } finally {
      await holder.end();
      await query(url, `alter database ${dbName} reset statement_timeout`);
    }
  });
});

describe('a statement_timeout set by the connection itself (-c statement_timeout in its options, or PGOPTIONS)', () => {
  // Black-box round 15 (B3): with `?options=-c statement_timeout=1` in DATABASE_URL, the refusal
  // said to ALTER ROLE … SET statement_timeout, which a startup option overrides: it could not work.
  const withOptions = (url: string, options: string) => {
    const u = new URL(url);
    u.searchParams.set('options', options);
    return u.toString();
  };

  it("idem's own statement: the one line names where it is set (DATABASE_URL's options, or PGOPTIONS) and that fix; exit 2, nothing written", async () => {
    const url = testDb.url;
    const { default: pg } = await import('pg');
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      const before = await snapshot(url, ALL_TABLES);
      await holder.query('set statement_timeout = 0; begin; lock table idem.runs in access exclusive mode');
      const viaUrl = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'stc-url'], { url: withOptions(url, '-c statement_timeout=300ms') });
      const viaEnv = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'stc-env'], { url, env: { PGOPTIONS: '-c statement_timeout=300ms' } });
      await holder.query('rollback');
      expect([viaUrl.code, lines(viaUrl.stderr)], viaUrl.stderr).toEqual([
        2,
        [
          "idem: error: the database cancelled a statement of idem's at the statement_timeout set by -c statement_timeout in DATABASE_URL's options: it waited on a lock or ran longer; raise or remove -c statement_timeout in DATABASE_URL's options (a setting there overrides the role's and the database's), then run the same command again",
        ],
      ]);
      expect([viaEnv.code, lines(viaEnv.stderr)], viaEnv.stderr).toEqual([
        2,
        [
          "idem: error: the database cancelled a statement of idem's at the statement_timeout set by -c statement_timeout in PGOPTIONS: it waited on a lock or ran longer; raise or remove -c statement_timeout in PGOPTIONS (a setting there overrides the role's and the database's), then run the same command again",
        ],
      ]);
      expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    } finally {
      await holder.end();
    }
  });

  it("a chunk's statement: the run's error names DATABASE_URL's options, not ALTER ROLE", async () => {
    const url = testDb.url;
    const { default: pg } = await import('pg');
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    await query(url, `insert into gates values ('stc-gate') on conflict do nothing`);
    try {
      await holder.query(`begin; select 1 from gates where name = 'stc-gate' for update`);
      const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1,"gate":"stc-gate"}', '--key', 'stc-chunk'], { url: withOptions(url, '-c statement_timeout=1s') });
      await holder.query('rollback');
      expect(r.code, r.stderr).toBe(1);
      const [run] = await query(url, `select status, error->>'message' as message from idem.runs where job = 'counted' and run_key = 'stc-chunk'`);
      expect(run).toEqual({
        status: 'failed',
        message:
          "canceling statement due to statement timeout (the statement_timeout set by -c statement_timeout in DATABASE_URL's options, or by the job, cut it short: give a chunk less to do, or raise or remove -c statement_timeout in DATABASE_URL's options (a setting there overrides the role's and the database's), or raise it in the chunk (SET LOCAL statement_timeout))",
      });
    } finally {
      await holder.end();
    }
  });
});

describe('an empty --key given to find a run', () => {
  it('status, pause, resume, cancel, reset and finalize refuse it in one line (exit 2), writing nothing', async () => {
    // Black-box round 14 (B3-17): `idem status counted --key ""` said "no run with key """.
    const before = await snapshot(url, ALL_TABLES);
    for (const cmd of [['status', 'counted'], ['pause', 'counted'], ['resume', 'counted'], ['cancel', 'counted'], ['reset', 'counted'], ['finalize', 'counted']]) {
      const r = await idem([...cmd, '--key', '']);
      expect([r.code, r.stderr], cmd.join(' ')).toEqual([2, "idem: error: option '--key <key>' argument '' is invalid. expected a run key, got an empty one (idem status <job> lists the runs and their keys); see --help\n"]);
    }
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });
});
