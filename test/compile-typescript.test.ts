import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
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
