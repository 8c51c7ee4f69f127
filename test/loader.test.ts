import { mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { UsageError } from '../src/index.ts';
import { findJob, loadJobDir, unknownJobError } from '../src/loader.ts';

// Job files outside the package import it by path: the self-reference ('idem') resolves only inside it.
const INDEX = path.resolve('src/index.ts');
let dir: string;

beforeAll(async () => {
  dir = await mkdtemp(path.join(os.tmpdir(), 'idem-loader-'));
});
afterAll(() => rm(dir, { recursive: true, force: true }));

async function folder(name: string, files: Record<string, string>): Promise<string> {
  const d = path.join(dir, name);
  await mkdir(d);
  for (const [file, text] of Object.entries(files)) await writeFile(path.join(d, file), text);
  return d;
}

describe('loading job folders', () => {
  it('accepts a plain default-exported object as well as defineJob, in file-name order, skipping tests (*.test.*, *.spec.*) and type files', async () => {
    const d = await folder('mixed', {
      '02_plain.ts': `export default { name: 'plain', description: 'no defineJob', steps: [{ name: 'only', run() {} }] };`,
      '01_defined.ts': `import { defineJob } from ${JSON.stringify(INDEX)};\nexport default defineJob({ name: 'defined', steps: [{ name: 's', run() {} }] });`,
      'helper.test.ts': `throw new Error('a test file must not be loaded');`,
      'helper.spec.ts': `throw new Error('a spec file (vitest, jest, mocha name tests so too) must not be loaded');`,
      'other.spec.mjs': `throw new Error('nor a spec file of another extension');`,
      'types.d.ts': `export type X = number;`,
      '_private.ts': `throw new Error('a file starting with _ must not be loaded');`,
    });
    const jobs = await loadJobDir(d, 'jobs');
    expect(jobs.map((j) => [j.id, j.job.name])).toEqual([
      ['01_defined', 'defined'],
      ['02_plain', 'plain'],
    ]);
    const plain = jobs[1]!.job;
    expect(plain.description).toBe('no defineJob');
    expect(Object.isFrozen(plain)).toBe(true);
    expect(Object.isFrozen(plain.steps)).toBe(true);
  });

  it('refuses a plain object that is not a job, naming the file and every problem', async () => {
    const d = await folder('bad', { 'bad.ts': `export default { name: 'has space', steps: [] };` });
    const err = await loadJobDir(d, 'jobs').catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UsageError);
    expect((err as Error).message).toMatch(/bad\.ts: invalid job definition: name must match .*; steps must be a non-empty array/);
  });

  it('a file that exports no job says so, CommonJS as ES module; one exporting only other names is told of the _ prefix of helper files', async () => {
    // Black-box round 13: a CommonJS file without module.exports was "name must match …; steps
    // must be a non-empty array", its helper exports "unknown key".
    const cases = [
      ['nothing.cjs', `const job = { name: 'x', steps: [{ name: 's', run() {} }] };\n`, 'nothing'],
      ['helpers.cjs', `exports.foo = 1;\nexports.bar = 2;\n`, 'foo, bar'],
      ['helpers.mjs', `export const foo = 1;\n`, 'foo'],
      ['nothing.mjs', `const job = 1;\n`, 'nothing'],
      // require()d through tsx (as under the CLI, where Node's import() of a .cjs file is { default: {} } too).
      ['nothing.cts', `const job = 1;\n`, 'nothing'],
      ['helpers.cts', `export const foo = 1;\n`, 'foo'],
    ] as const;
    for (const [file, text, exported] of cases) {
      const d = await folder(`no-export-${file.replace('.', '-')}`, { [file]: text });
      const err = await loadJobDir(d, 'jobs').catch((e: unknown) => e);
      expect(err).toBeInstanceOf(UsageError);
      const hint = exported === 'nothing' ? 'it exports nothing; export the job' : `it exports only ${exported}; export the job`;
      expect((err as Error).message).toBe(
        `${path.relative(process.cwd(), path.join(d, file))} does not export a job definition: expected an object with name and steps (export default …, or module.exports = … in CommonJS); ${hint}, or if the file is a helper, start its name with _ (idem skips those)`,
      );
    }
    // A CommonJS job with a mistake in it is still told what is wrong with it.
    const d = await folder('cjs-half', { 'half.cjs': `module.exports = { name: 'half' };\n` });
    await expect(loadJobDir(d, 'jobs')).rejects.toThrow(/half\.cjs: invalid job definition: steps must be a non-empty array/);
  });

  it('an invalid defineJob() at load time points at the line in the job file, not inside idem', async () => {
    const d = await folder('bad-define', {
      'bad-define.ts': `import { defineJob } from ${JSON.stringify(INDEX)};\nexport default defineJob({ name: 'has space', steps: [] });\n`,
    });
    const err = await loadJobDir(d, 'jobs').catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UsageError);
    expect((err as Error).message.split('\n')[0]).toMatch(/bad-define\.ts:2:\d+: defineJob\(\): invalid job definition: name must match .*; fix the file$/);
    expect((err as Error).message.split('\n')[1]).toBe(`    2 | export default defineJob({ name: 'has space', steps: [] });`);
  });

  it('refuses two files that define the same job name', async () => {
    const job = `export default { name: 'twin', steps: [{ name: 's', run() {} }] };`;
    const d = await folder('twins', { 'a.ts': job, 'b.ts': job });
    await expect(loadJobDir(d, 'jobs')).rejects.toThrow('job name "twin" is defined twice (a.ts and b.ts); rename one');
  });

  it('names the known jobs when asked for an unknown one; a missing folder has none', async () => {
    const d = await folder('known', { 'k.ts': `export default { name: 'known-one', steps: [{ name: 's', run() {} }] };` });
    await expect(findJob(d, 'nope')).rejects.toThrow(/no job named 'nope' in .* \(known: known-one\)/);
    await expect(findJob(d, 'known-on')).rejects.toThrow("no job named 'known-on'; did you mean 'known-one'?");
    expect(await loadJobDir(path.join(dir, 'does-not-exist'), 'jobs')).toEqual([]);
  });

  it('lists at most ten known names of each kind, and keeps jobs known only by their runs apart', () => {
    // CI failure of stop 32: a shared test database held runs of many jobs, and `status <typo>`
    // listed every one of them in its "one-line" error (459 characters and growing).
    const files = Array.from({ length: 14 }, (_, i) => `file-job-${String(i).padStart(2, '0')}`);
    const ran = Array.from({ length: 30 }, (_, i) => `ran-only-${String(i).padStart(2, '0')}`);
    const e = unknownJobError('zzzzzzzzzzzz', files, ['jobs', 'migrations'], [...ran, ...files.slice(0, 3)]);
    expect(e.message).toBe(
      `no job named 'zzzzzzzzzzzz' in jobs/ or migrations/ (known: ${files.slice(0, 10).join(', ')} and 4 more; `
      + `with runs only: ${ran.slice(0, 10).join(', ')} and 20 more; idem list and idem status show all); check the name or --jobs-dir`,
    );
    expect(unknownJobError('zzzzzzzzzzzz', ['a-job'], ['jobs'], ['gone', 'a-job']).message)
      .toBe(`no job named 'zzzzzzzzzzzz' in jobs/ (known: a-job; with runs only: gone); check the name or --jobs-dir`);
    // A close name is suggested from both kinds.
    expect(unknownJobError('ran-only-2', files, ['jobs'], ran).message).toBe(`no job named 'ran-only-2'; did you mean 'ran-only-02', 'ran-only-12' or 'ran-only-20'?`);
  });

  it('loads ES-module TypeScript compiled once into the package\'s .idem/cache, and names file, line and column of a syntax error', async () => {
    const root = await folder('esm-project', { 'package.json': '{ "type": "module" }' });
    await mkdir(path.join(root, 'jobs'));
    const good = path.join(root, 'jobs', 'good.ts');
    await writeFile(good, `import { helper } from './_helper.ts';\nexport default { name: helper('esm'), steps: [{ name: 's', run() {} }] };`);
    await writeFile(path.join(root, 'jobs', '_helper.ts'), `export const helper = (s: string): string => s + '-job';`);
    expect((await loadJobDir(path.join(root, 'jobs'), 'jobs')).map((l) => l.job.name)).toEqual(['esm-job']);
    const cached = (await readdir(path.join(root, '.idem', 'cache'))).sort();
    expect(cached).toEqual([expect.stringMatching(/^good-[0-9a-f]{12}\.mjs$/), expect.stringMatching(/^good-[0-9a-f]{12}\.mjs\.json$/)]);

    await writeFile(path.join(root, 'jobs', 'bad.ts'), `export default { name: 'bad', steps: [ ) };`);
    const err = await loadJobDir(path.join(root, 'jobs'), 'jobs').catch((e: unknown) => e);
    expect(err).toBeInstanceOf(UsageError);
    expect((err as Error).message.split('\n')[0]).toMatch(/^cannot load jobs file .*bad\.ts:1:\d+: syntax error: Unexpected "\)"; fix the file$/);
  });
});

