import { mkdtemp, readFile, rm, stat, utimes, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { compileTypeScriptModule } from '../src/compile-typescript.ts';

const JOB = fileURLToPath(new URL('./fixtures/startup-ts-jobs/startup-noop-ts.ts', import.meta.url));

describe('compiled TypeScript jobs', () => {
  // A cache of each test's own: the second test leaves a hand-written copy behind that a fresh
  // manifest makes the compiler trust, which the first would read (the order is shuffled in CI).
  let cache: string;
  beforeEach(async () => {
    cache = await mkdtemp(path.join(os.tmpdir(), 'idem-compile-'));
  });
  afterEach(() => rm(cache, { recursive: true, force: true }));

  it("import idem, even where this repository's tsconfig maps it to the sources, instead of carrying a copy", async () => {
    const out = await compileTypeScriptModule(JOB, cache);
    const code = await readFile(out, 'utf8');
    expect(code).toMatch(/^import \{ defineJob \} from "idem";$/m);
    // A bundled copy would bring the runner's sources along (esbuild names each one in a comment).
    expect(code).not.toMatch(/^\/\/ .*src\/(job|runner)\.ts$/m);
  });

  it('are rebuilt when their manifest comes from an older idem (other compile options)', async () => {
    const out = await compileTypeScriptModule(JOB, cache);
    const manifest = `${out}.json`;
    const current = JSON.parse(await readFile(manifest, 'utf8')) as { version: number; inputs: unknown[] };
    await writeFile(out, '// stale\n');
    // Same inputs, unchanged: only the version says the copy is stale.
    await writeFile(manifest, JSON.stringify({ ...current, version: 1 }));
    await compileTypeScriptModule(JOB, cache);
    expect(await readFile(out, 'utf8')).toMatch(/from "idem"/);
    expect(JSON.parse(await readFile(manifest, 'utf8')).version).toBe(current.version);
    // And a fresh manifest is trusted: the copy is not rebuilt.
    await writeFile(out, '// kept\n');
    await compileTypeScriptModule(JOB, cache);
    expect(await readFile(out, 'utf8')).toBe('// kept\n');
  });
});

describe('the compiled-TypeScript cache', () => {
  let dir: string;
  beforeEach(async () => {
    dir = await mkdtemp(path.join(os.tmpdir(), 'idem-compile-content-'));
  });
  afterEach(() => rm(dir, { recursive: true, force: true }));

  it('rebuilds a job whose content changed while its size and mtime did not (cp -p, rsync -a, tar)', async () => {
    const job = path.join(dir, 'job.ts');
    const helper = path.join(dir, 'helper.ts');
    const when = new Date('2025-06-01T12:00:00Z');
    await writeFile(job, "import { word } from './helper.ts';\nexport const said: string = word;\n");
    await writeFile(helper, "export const word = 'AAAA';\n");
    await utimes(job, when, when);
    await utimes(helper, when, when);
    const cache = path.join(dir, '.idem', 'cache');
    const out = await compileTypeScriptModule(job, cache);
    expect(await readFile(out, 'utf8')).toContain('"AAAA"');
    // The relative import changes, same size, same mtime: only its content tells.
    await writeFile(helper, "export const word = 'BBBB';\n");
    await utimes(helper, when, when);
    expect((await stat(helper)).mtime.getTime()).toBe(when.getTime());
    const again = await compileTypeScriptModule(job, cache);
    expect(again).toBe(out);
    const code = await readFile(again, 'utf8');
    expect(code).toContain('"BBBB"');
    expect(code).not.toContain('"AAAA"');
    // And unchanged content is still served from the cache, not rebuilt.
    await writeFile(out, '// kept\n');
    expect(await readFile(await compileTypeScriptModule(job, cache), 'utf8')).toBe('// kept\n');
  });

  it('never serves old code for a file edited while it compiled (the bytes compiled are the bytes hashed)', async () => {
    // An editor saving, or a deploy copying, while a run starts: esbuild read the old content, the
    // manifest recorded the new content's hash, and every later start ran the old code as fresh.
    // The edit lands at moments swept across a build's duration, measured first.
    const job = path.join(dir, 'job.ts');
    const cache = path.join(dir, '.idem', 'cache');
    const build = async (text: string) => {
      await writeFile(job, text);
      const t = performance.now();
      await compileTypeScriptModule(job, cache);
      return performance.now() - t;
    };
    await build("export const version: string = 'warm';\n");
    const took = [await build("export const version: string = 'a';\n"), await build("export const version: string = 'b';\n"), await build("export const version: string = 'c';\n")].sort((a, b) => a - b)[1]!;
    const stale: number[] = [];
    for (let i = 0; i < 40; i++) {
      const at = (took * i) / 30;
      await writeFile(job, `export const version: string = 'old-${i}';\n`);
      const started = performance.now();
      const compiling = compileTypeScriptModule(job, cache);
      // Finer than a timer's millisecond: yield to I/O until the moment comes.
      while (performance.now() - started < at) await new Promise(setImmediate);
      await writeFile(job, `export const version: string = 'new-${i}';\n`);
      await compiling;
      // The next start must run what the file says now.
      if (!(await readFile(await compileTypeScriptModule(job, cache), 'utf8')).includes(`new-${i}`)) stale.push(Math.round(at * 10) / 10);
    }
    expect(stale, `a build takes ~${Math.round(took)} ms; stale at these edit times (ms)`).toEqual([]);
  });
});

describe('import.meta in a compiled TypeScript job', () => {
  let dir: string;
  beforeEach(async () => {
    dir = await mkdtemp(path.join(os.tmpdir(), 'idem-compile-meta-'));
  });
  afterEach(() => rm(dir, { recursive: true, force: true }));

  it('is the source file\'s own, in the job and in each module it imports, so a file next to it can be read', async () => {
    // It was the compiled copy's under .idem/cache/: `new URL('./g.sql', import.meta.url)` failed
    // with ENOENT under the CLI while the same job passed under vitest.
    const { mkdir } = await import('node:fs/promises');
    await mkdir(path.join(dir, 'lib'));
    await writeFile(path.join(dir, 'g.sql'), 'select 1');
    await writeFile(path.join(dir, 'lib', 'q.sql'), 'select 2');
    await writeFile(path.join(dir, 'lib', 'where.ts'), "import { readFileSync } from 'node:fs';\nexport const helper = { url: import.meta.url, sql: readFileSync(new URL('./q.sql', import.meta.url), 'utf8') };\n");
    await writeFile(
      path.join(dir, 'job.ts'),
      "import { readFileSync } from 'node:fs';\nimport { helper } from './lib/where.ts';\nconst sql: string = readFileSync(new URL('./g.sql', import.meta.url), 'utf8');\nexport const seen = { url: import.meta.url, dirname: import.meta.dirname, filename: import.meta.filename, sql, helper };\n",
    );
    const out = await compileTypeScriptModule(path.join(dir, 'job.ts'), path.join(dir, '.idem', 'cache'));
    const { pathToFileURL } = await import('node:url');
    const { seen } = (await import(pathToFileURL(out).href)) as { seen: Record<string, unknown> };
    expect(seen).toEqual({
      url: pathToFileURL(path.join(dir, 'job.ts')).href,
      dirname: dir,
      filename: path.join(dir, 'job.ts'),
      sql: 'select 1',
      helper: { url: pathToFileURL(path.join(dir, 'lib', 'where.ts')).href, sql: 'select 2' },
    });
  });
});
