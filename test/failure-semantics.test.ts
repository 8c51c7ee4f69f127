import { chmod, mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { hostname, tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { inspect } from 'node:util';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest';
import { defineJob, RunFailedError, Runner, sql } from '../src/index.ts';
import { sessionName } from '../src/database.ts';
import { FAULT_POINTS } from '../src/fault-points.ts';
import { useTestDatabase } from './support/database.ts';
import { BIN, expectFaultCrash, FIXTURE_DIRS, killLeftovers, lines, logLines, type CliProcess, type CliResult, query, runCli, runRow, sessions, spawnCli, waitFor, workCounts, holdGate, lockWaiters } from './support/cli.ts';
import counted, { maybeFail } from './fixtures/jobs/counted.ts';
import { api, startServe } from './support/server.ts';

const MORE_JOBS = fileURLToPath(new URL('./fixtures/more-jobs', import.meta.url));

const db = useTestDatabase({ fixtureTables: true, runner: true });
let runner: Runner;
beforeAll(() => {
  runner = db.runner;
});

// A test that failed before its own cleanup must not make the next test's chunks fail.
afterEach(async () => {
  await killLeftovers();
  await query(db.url, 'delete from fail_chunks');
});

afterAll(killLeftovers);

const sumOfSquares = (n: number) => (n * (n + 1) * (2 * n + 1)) / 6;

async function doneCount(runKey: string, job = 'counted'): Promise<number> {
  const rows = await query<{ n: number }>(
    db.url,
    `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = $1 and r.run_key = $2 and c.done_at is not null`,
    [job, runKey],
  );
  return rows[0]!.n;
}

/** Every `work` chunk of the run committed exactly once, and the end state is that of a clean run. */
async function expectConverged(runKey: string, chunks: number): Promise<void> {
  const counts = await workCounts(db.url, runKey);
  expect(counts.size).toBe(chunks);
  expect([...counts.values()].every((n) => n === 1)).toBe(true);
  const total = await query<{ value: string }>(db.url, `select value from counted_state where run_key = $1 and chunk_key = 'total'`, [runKey]);
  expect(Number(total[0]?.value)).toBe(sumOfSquares(chunks));
  expect((await runRow(db.url, 'counted', runKey)).status).toBe('succeeded');
}

/** The error a promise rejects with (fails the test if it resolves). */
const rejectionOf = (p: Promise<unknown>): Promise<Error> =>
  p.then(
    (v) => {
      throw new Error(`expected a rejection, got ${String(v)}`);
    },
    (e: Error) => e,
  );

describe('transient and permanent chunk errors', () => {
  it('a transient SQLSTATE is retried in a fresh transaction and the chunk commits once', async () => {
    await query(db.url, `insert into fail_chunks values ('c0003', '40001', 2)`);
    await query(db.url, `select setval('fixture_tries', 1, false)`);
    try {
      const out = await runner.run(counted, { key: 'transient', params: { chunks: 5 } });
      expect(out.status).toBe('succeeded');
      // Two failed tries and the successful one each drew a number that survives the rollback.
      const tries = await query<{ v: string }>(db.url, `select last_value as v from fixture_tries`);
      expect(Number(tries[0]!.v)).toBe(3);
      await expectConverged('transient', 5);
    } finally {
      await query(db.url, `delete from fail_chunks`);
    }
  });

  it('a chunk whose retries run out fails the run with step, chunk and tries recorded; a rerun resumes there', async () => {
    await query(db.url, `insert into fail_chunks values ('c0004', '40P01', 1000)`);
    const err = await runner.run(counted, { key: 'exhausted', params: { chunks: 6 } }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RunFailedError);
    expect((err as RunFailedError).exitCode).toBe(1);
    const run = await runRow(db.url, 'counted', 'exhausted');
    expect(run.status).toBe('failed');
    expect(run.error).toMatchObject({ step: 'work', chunk: 'c0004', tries: 5 });
    const [status] = await runner.status('counted');
    expect(status!.error).toMatchObject({ chunk: 'c0004', tries: 5 });
    expect(await doneCount('exhausted')).toBe(1 + 3); // prepare + c0001..c0003
    await query(db.url, `delete from fail_chunks`);
    const again = await runner.run(counted, { key: 'exhausted', params: { chunks: 6 } });
    expect(again.executed).toBe(3 + 1); // c0004..c0006 and finish: nothing done before is redone
    await expectConverged('exhausted', 6);
  });

  it('a permanent error is not retried', async () => {
    await query(db.url, `insert into fail_chunks values ('c0002', null, null)`);
    await runner.run(counted, { key: 'permanent', params: { chunks: 3 } }).catch(() => {});
    await query(db.url, `delete from fail_chunks`);
    const run = await runRow(db.url, 'counted', 'permanent');
    expect(run.error).toMatchObject({ chunk: 'c0002', tries: 1, message: 'injected failure in chunk c0002' });
    // The failed chunk's work rolled back with it.
    expect((await workCounts(db.url, 'permanent')).get('c0002')).toBeUndefined();
  });
});

describe("a chunk error that quotes the database's password", () => {
  it('is recorded, thrown and logged with the password masked', async () => {
    // A job that builds a URL from DATABASE_URL (a report link, a second client) and throws with
    // it in the message: the password went whole into idem.chunks.error, idem.runs.error, the
    // thrown error and the log.
    const password = decodeURIComponent(new URL(db.url).password);
    expect(password.length).toBeGreaterThanOrEqual(8);
    const leaky = defineJob({
      name: 'leaky',
      steps: [
        {
          name: 'work',
          maxFailedChunks: 1,
          chunks: () => ({ chunks: [{ key: 'a' }, { key: 'b' }], next: null }),
          run: async (_ctx, c: { key: string }) => {
            throw new Error(`${c.key}: cannot reach ${db.url} (password ${password})`);
          },
        },
      ],
    });
    const lines: string[] = [];
    const { default: pino } = await import('pino');
    const log = pino({ level: 'debug' }, { write: (s: string) => void lines.push(s) });
    const own = await Runner.connect({ connectionString: db.url, log });
    try {
      const err = await own.run(leaky, { key: 'leaky' }).catch((e: Error) => e);
      expect(err).toBeInstanceOf(RunFailedError);
      expect((err as Error).message).toContain('cannot reach');
      expect((err as Error).message).not.toContain(password);
    } finally {
      await own.close();
    }
    const stored = await query<{ text: string }>(db.url, `select coalesce(c.error, '') || ' ' || coalesce(r.error::text, '') as text from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'leaky'`);
    expect(stored).toHaveLength(2);
    for (const { text } of stored) expect(text).not.toContain(password);
    expect(stored.map((r) => r.text).join(' ')).toContain('***');
    expect(lines.join('').length).toBeGreaterThan(0);
    expect(lines.join('')).not.toContain(password);
  });
});

describe("a job error whose cause is a plain object quoting the database's password", () => {
  it('is thrown to a library caller with a masked copy of the object, and recorded masked', async () => {
    // An HTTP client's error is an object holding the request (axios: `config.url`); a job that
    // calls out with DATABASE_URL in a URL, or wraps such an error as a cause, put the password
    // whole into what util.inspect (console.error) prints of the RunFailedError.
    const password = decodeURIComponent(new URL(db.url).password);
    const thrownObject: Record<string, unknown> = { message: 'request failed', config: { url: db.url, headers: [`Referer: ${db.url}`] } };
    thrownObject.self = thrownObject;
    const nested = { detail: db.url, more: { deeper: [{ url: db.url }] } };
    const axiosLike = defineJob({
      name: 'leaky-object-cause',
      steps: [{ name: 'work', chunks: () => ({ chunks: [{ key: 'a' }], next: null }), run: async () => Promise.reject(thrownObject) }],
    });
    const wrapped = defineJob({
      name: 'leaky-nested-cause',
      steps: [{ name: 'work', run: async () => Promise.reject(new Error('outer', { cause: new Error('x', { cause: nested }) })) }],
    });
    for (const job of [axiosLike, wrapped]) {
      const err = await rejectionOf(runner.run(job, { key: 'k' }));
      expect(err).toBeInstanceOf(RunFailedError);
      const shown = inspect(err, { depth: 20 });
      expect(shown).toContain('***');
      expect(shown).not.toContain(password);
    }
    const shown = inspect(await rejectionOf(runner.run(axiosLike, { key: 'k' })), { depth: 20 });
    expect(shown).toContain("url: 'postgres://");
    expect(shown).toContain('[Circular');
    // The job's own objects are left as they were: masked copies are thrown, not these.
    expect((thrownObject.config as { url: string }).url).toBe(db.url);
    expect(nested.more.deeper[0]!.url).toBe(db.url);
    const stored = await query<{ text: string }>(
      db.url,
      `select coalesce(c.error, '') || ' ' || coalesce(r.error::text, '') as text from idem.runs r left join idem.chunks c on c.run_id = r.id where r.job in ('leaky-object-cause', 'leaky-nested-cause')`,
    );
    expect(stored).toHaveLength(2);
    for (const { text } of stored) expect(text).not.toContain(password);
  });
});

describe('a chunk error that quotes a password given in PGPASSWORD', () => {
  it('is masked too: the URL has none, pg took it from the environment', async () => {
    const password = decodeURIComponent(new URL(db.url).password);
    const bare = new URL(db.url);
    bare.password = '';
    const leaky = defineJob({
      name: 'leaky-env',
      steps: [{ name: 'work', run: async () => void (await Promise.reject(new Error(`connect failed for app/${password}`))) }],
    });
    const saved = process.env.PGPASSWORD;
    process.env.PGPASSWORD = password;
    const own = await Runner.connect({ connectionString: bare.href });
    try {
      const err = await own.run(leaky, { key: 'leaky-env' }).catch((e: Error) => e);
      expect(err).toBeInstanceOf(RunFailedError);
      expect((err as Error).message).toContain('connect failed for app/***');
    } finally {
      await own.close();
      if (saved === undefined) delete process.env.PGPASSWORD;
      else process.env.PGPASSWORD = saved;
    }
    const stored = await query<{ text: string }>(db.url, `select coalesce(c.error, '') || ' ' || coalesce(r.error::text, '') as text from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'leaky-env'`);
    expect(stored).toHaveLength(1);
    expect(stored[0]!.text).not.toContain(password);
  });
});

describe('a chunk error that quotes a password given as ?password= in the URL', () => {
  it('is masked too, as written in the URL and as the server gets it', async () => {
    // pg reads `?password=` as the password (libpq does too); masking looked at the URL's userinfo
    // only, so a job error quoting DATABASE_URL or the password went whole into idem.runs.error,
    // stderr and --json (black-box round 8). A password with characters the query encodes.
    const password = 'q p+w&rd=%x1';
    const url = new URL(db.url);
    const role = `qpw_${process.pid}`;
    await query(db.url, `create role ${role} login superuser password '${password}'`);
    try {
      url.username = role;
      url.password = '';
      url.searchParams.set('password', password);
      const connectionString = url.href;
      expect(connectionString).not.toContain(password);
      const leaky = defineJob({
        name: 'leaky-query-password',
        steps: [{ name: 'work', run: async () => void (await Promise.reject(new Error(`pw=${new URL(connectionString).searchParams.get('password')} url=${connectionString}`))) }],
      });
      const own = await Runner.connect({ connectionString });
      try {
        const err = await own.run(leaky, { key: 'k' }).catch((e: Error) => e);
        expect(err).toBeInstanceOf(RunFailedError);
        expect((err as Error).message).toContain('pw=*** url=');
        expect((err as Error).message).not.toContain(password);
        expect((err as Error).message).not.toContain(url.searchParams.toString());
      } finally {
        await own.close();
      }
      const stored = await query<{ text: string }>(db.url, `select coalesce(r.error::text, '') as text from idem.runs r where r.job = 'leaky-query-password'`);
      expect(stored).toHaveLength(1);
      expect(stored[0]!.text).toContain('***');
      expect(stored[0]!.text).not.toContain(password);
      expect(stored[0]!.text).not.toContain(url.searchParams.toString());
    } finally {
      await query(db.url, `drop role if exists ${role}`);
    }
  });
});

describe("a chunk that throws a string quoting the database's password", () => {
  it('is recorded and thrown with the password masked', async () => {
    // Not an Error: its text cannot be masked in place, as an Error's message is.
    const password = decodeURIComponent(new URL(db.url).password);
    const leaky = defineJob({
      name: 'leaky-string-chunk',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [{ key: 'a' }], next: null }),
          run: async () => {
            throw `cannot reach ${db.url}`;
          },
        },
      ],
    });
    const err = await rejectionOf(runner.run(leaky, { key: 'leaky' }));
    expect(err.message).toContain('cannot reach');
    expect(err.message).not.toContain(password);
    const stored = await query<{ text: string }>(db.url, `select coalesce(c.error, '') || ' ' || coalesce(r.error::text, '') as text from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'leaky-string-chunk'`);
    expect(stored).toHaveLength(1);
    expect(stored[0]!.text).toContain('cannot reach');
    expect(stored[0]!.text).not.toContain(password);
  });
});

describe("a planning error that quotes the database's password", () => {
  // A chunk source (a keyset query, a key list read from elsewhere, a custom source) that throws
  // with DATABASE_URL in its message: planning's failure went past the chunks' masking, whole into
  // idem.runs.error, the log, the thrown error and the CLI's stderr and --json.
  const password = () => decodeURIComponent(new URL(db.url).password);
  const leakyPlan = (name: string, thrown: 'an Error' | 'a string') =>
    defineJob({
      name,
      steps: [
        {
          name: 'plan',
          chunks: () => {
            const text = `cannot plan: ${db.url} refused (password ${password()})`;
            throw thrown === 'an Error' ? new Error(text) : text;
          },
          run: async () => {},
        },
      ],
    });

  it.each(['an Error', 'a string'] as const)('%s thrown by a chunk source is recorded, thrown and logged with the password masked', async (thrown) => {
    expect(password().length).toBeGreaterThanOrEqual(8);
    const name = `leaky-plan-${thrown === 'an Error' ? 'error' : 'string'}`;
    const lines: string[] = [];
    const { default: pino } = await import('pino');
    const log = pino({ level: 'debug' }, { write: (s: string) => void lines.push(s) });
    const own = await Runner.connect({ connectionString: db.url, log });
    let err: Error;
    try {
      err = await rejectionOf(own.run(leakyPlan(name, thrown), { key: 'leaky' }));
    } finally {
      await own.close();
    }
    expect(err).toBeInstanceOf(RunFailedError);
    expect(err.message).toContain('cannot plan');
    expect(err.message).toContain('***');
    // The whole chain a caller may print (console.error shows causes and stacks).
    for (let e: unknown = err; e instanceof Error; e = e.cause) {
      expect(e.message).not.toContain(password());
      expect(String(e.stack)).not.toContain(password());
    }
    const stored = await query<{ text: string }>(
      db.url,
      `select row_to_json(r)::text || ' ' || coalesce((select json_agg(s)::text from idem.steps s where s.run_id = r.id), '') || ' ' || coalesce((select json_agg(c)::text from idem.chunks c where c.run_id = r.id), '') as text
       from idem.runs r where r.job = $1`,
      [name],
    );
    expect(stored).toHaveLength(1);
    expect(stored[0]!.text).toContain('cannot plan');
    expect(stored[0]!.text).not.toContain(password());
    expect(lines.join('')).toContain('cannot plan');
    expect(lines.join('')).not.toContain(password());
  });

  it("an effect's error is recorded, thrown and logged with the password masked", async () => {
    const leakyEffect = defineJob({
      name: 'leaky-effect',
      steps: [{ name: 'notify', run: (ctx) => ctx.effect('mail', () => Promise.reject(new Error(`mail relay refused ${db.url}`))) }],
    });
    const lines: string[] = [];
    const { default: pino } = await import('pino');
    const own = await Runner.connect({ connectionString: db.url, log: pino({ level: 'debug' }, { write: (s: string) => void lines.push(s) }) });
    let err: Error;
    try {
      err = await rejectionOf(own.run(leakyEffect, { key: 'leaky' }));
    } finally {
      await own.close();
    }
    expect(err.message).toContain('mail relay refused');
    for (let e: unknown = err; e instanceof Error; e = e.cause) expect(`${e.message} ${e.stack}`).not.toContain(password());
    const [stored] = await query<{ text: string }>(
      db.url,
      `select row_to_json(r)::text || ' ' || (select json_agg(e)::text from idem.effects e where e.run_id = r.id) || ' ' || (select json_agg(c)::text from idem.chunks c where c.run_id = r.id) as text from idem.runs r where r.job = 'leaky-effect'`,
    );
    expect(stored!.text).toContain('mail relay refused');
    expect(stored!.text).not.toContain(password());
    expect(lines.join('')).not.toContain(password());
  });

  describe('through the CLI and idem serve', () => {
    let dir: string;
    beforeAll(async () => {
      dir = await mkdtemp(path.join(tmpdir(), 'idem-leaky-plan-'));
      await writeFile(
        path.join(dir, 'leaky-cli-plan.mjs'),
        `export default { name: 'leaky-cli-plan', steps: [{ name: 'plan', chunks: () => { throw new Error('cannot plan: ' + process.env.DATABASE_URL + ' refused'); }, run: async () => {} }] };\n`,
      );
    });
    afterAll(() => rm(dir, { recursive: true, force: true }));

    it('is printed masked on stderr and in --json by idem run and idem finalize', async () => {
      const run = await runCli(['--jobs-dir', dir, 'run', 'leaky-cli-plan', '--key', 'cli', '--json'], { url: db.url });
      // finalize finds the run failed and prints its recorded error.
      const fin = await runCli(['--jobs-dir', dir, 'finalize', 'leaky-cli-plan', '--key', 'cli', '--json'], { url: db.url });
      for (const r of [run, fin]) {
        expect(r.code, r.stderr).toBe(1);
        expect(r.stderr).toContain('cannot plan');
        expect(JSON.parse(r.stdout)).toMatchObject({ status: 'error', exitCode: 1 });
        expect(r.stdout).toContain('***');
        expect(r.stdout + r.stderr).not.toContain(password());
      }
      const [row] = await query<{ text: string }>(db.url, `select error::text as text from idem.runs where job = 'leaky-cli-plan' and run_key = 'cli'`);
      expect(row!.text).toContain('cannot plan');
      expect(row!.text).not.toContain(password());
    }, 60_000);

    it("is recorded, served and logged masked by idem serve's executor", async () => {
      const server = await startServe(db.url, [], {}, dir);
      try {
        const created = await api(server.base, 'POST', '/api/jobs/leaky-cli-plan/runs', { body: {}, key: 'serve' });
        expect(created.status, created.text).toBe(201);
        const failed = await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`);
        expect(failed.body).toMatchObject({ state: 'failed' });
        expect(failed.text).toContain('cannot plan');
        expect(failed.text).not.toContain(password());
        const page = await api(server.base, 'GET', `/runs/${created.body.id}`);
        expect(page.text).toContain('cannot plan');
        expect(page.text).not.toContain(password());
      } finally {
        server.proc.child.kill('SIGTERM');
        await server.proc.done;
      }
      expect(server.proc.stderr()).toContain('cannot plan');
      expect(server.proc.stdout() + server.proc.stderr()).not.toContain(password());
    }, 60_000);
  });

  it('a job file that throws it while loading is printed masked', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-leaky-load-'));
    try {
      await writeFile(path.join(dir, 'leaky-load.mjs'), `throw new Error('cannot connect to ' + process.env.DATABASE_URL);\n`);
      const r = await runCli(['--jobs-dir', dir, 'run', 'leaky-load', '--json'], { url: db.url });
      expect(r.code, r.stderr).toBe(2);
      expect(r.stderr).toContain('cannot connect to');
      expect(r.stdout).toContain('***');
      expect(r.stdout + r.stderr).not.toContain(password());
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  }, 60_000);
});

describe('skip policy', () => {
  const skippy = defineJob({
    name: 'skippy',
    steps: [
      {
        name: 'work',
        maxFailedChunks: 2,
        retry: { attempts: 1 },
        chunks: () => ({ chunks: ['c0001', 'c0002', 'c0003', 'c0004', 'c0005'].map((key) => ({ key })), next: null }),
        async run(ctx, chunk: { key: string }) {
          await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('skippy', ${ctx.run.runKey}, 'work', ${chunk.key}, ${ctx.run.attempt}, 0)`.execute(ctx.db);
          await maybeFail(ctx, chunk.key);
        },
      },
    ],
  });

  it('records up to maxFailedChunks failed chunks as skipped, lists them, and --retry-skipped runs them', async () => {
    await query(db.url, `insert into fail_chunks values ('c0002', null, null), ('c0004', null, null)`);
    const out = await runner.run(skippy, { key: 'skips' });
    expect(out.status).toBe('succeeded');
    expect(out.summary).toMatchObject({ chunks: 5, skipped: 2 });
    const [status] = await runner.status('skippy');
    expect(status!.skipped.map((s) => s.key)).toEqual(['c0002', 'c0004']);
    expect(status!.skipped[0]!.error).toBe('injected failure in chunk c0002');
    expect((await workCounts(db.url, 'skips')).size).toBe(3);
    // A plain rerun is a no-op; skipped chunks wait for an explicit retry.
    expect((await runner.run(skippy, { key: 'skips' })).status).toBe('already-succeeded');
    await query(db.url, `delete from fail_chunks`);
    const retried = await runner.run(skippy, { key: 'skips', retrySkipped: true });
    expect(retried.executed).toBe(2);
    expect(retried.summary).toMatchObject({ skipped: 0 });
    const counts = await workCounts(db.url, 'skips');
    expect(counts.size).toBe(5);
    expect([...counts.values()].every((n) => n === 1)).toBe(true);
  });

  // A chunk that fails slowly: another slot (or worker) that finds nothing free waits on its row lock
  // and claims it the moment it rolls back, before its failure is recorded as skipped.
  const slowSkippy = (name: string, keys: string[], failing: string[], maxFailedChunks: number) =>
    defineJob({
      name,
      steps: [
        {
          name: 'work',
          maxFailedChunks,
          retry: { attempts: 1 },
          chunks: () => ({ chunks: keys.map((key) => ({ key })), next: null }),
          async run(ctx, chunk: { key: string }) {
            await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values (${name}, ${ctx.run.runKey}, 'work', ${chunk.key}, ${ctx.run.attempt}, 0)`.execute(ctx.db);
            if (failing.includes(chunk.key)) {
              await sql`select pg_sleep(0.4)`.execute(ctx.db);
              throw new Error(`injected failure in chunk ${chunk.key}`);
            }
          },
        },
      ],
    });

  it('counts a failed chunk once against maxFailedChunks when another slot re-claims it (concurrency 2)', async () => {
    const job = slowSkippy('skippy-slow', ['c0001', 'c0002'], ['c0002'], 1);
    const out = await runner.run(job, { key: 'slow-skip', concurrency: 2 });
    expect(out.status).toBe('succeeded');
    expect(out.summary).toMatchObject({ chunks: 2, skipped: 1 });
    const [status] = await runner.status('skippy-slow');
    expect(status!.skipped.map((s) => s.key)).toEqual(['c0002']);
  });

  it('maxFailedChunks bounds the skipped chunks of the run, not of each worker sharing it', async () => {
    const job = slowSkippy('skippy-shared', ['c0001', 'c0002', 'c0003', 'c0004'], ['c0001', 'c0002'], 1);
    const second = await Runner.connect({ connectionString: db.url });
    try {
      const results = await Promise.allSettled([
        runner.run(job, { key: 'shared-skip', join: true }),
        (async () => {
          await waitFor(async () => (await query(db.url, `select 1 from idem.runs where job = 'skippy-shared' and status = 'running'`)).length > 0, 'the first worker to start the run');
          return second.run(job, { key: 'shared-skip', join: true });
        })(),
      ]);
      const run = await runRow(db.url, 'skippy-shared', 'shared-skip');
      const skipped = await query<{ n: number }>(
        db.url,
        `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'skippy-shared' and c.skipped_at is not null`,
      );
      // Two chunks failed for good with a budget of one: the run fails, and at most one is skipped.
      expect(run.status).toBe('failed');
      expect(skipped[0]!.n).toBeLessThanOrEqual(1);
      expect(results.some((r) => r.status === 'rejected')).toBe(true);
    } finally {
      await second.close();
    }
  });

  it('fails the run when more chunks fail than the step allows', async () => {
    await query(db.url, `insert into fail_chunks values ('c0001', null, null), ('c0002', null, null), ('c0003', null, null)`);
    try {
      await expect(runner.run(skippy, { key: 'too-many' })).rejects.toBeInstanceOf(RunFailedError);
      expect((await runRow(db.url, 'skippy', 'too-many')).error).toMatchObject({ chunk: 'c0003' });
    } finally {
      await query(db.url, `delete from fail_chunks`);
    }
  });
});

describe('fault points: a crash at every protocol boundary converges on rerun', () => {
  // after-marker, after-commit and before-finish have detailed tests of their own in crash.test.ts.
  const covered = new Set(['after-marker', 'after-commit', 'before-finish']);
  it('the crash tests here and in crash.test.ts cover every fault point', () => {
    expect(FAULT_POINTS.filter((p) => !covered.has(p))).toEqual(['after-lock', 'after-claim', 'after-work']);
  });
  for (const point of FAULT_POINTS.filter((p) => !covered.has(p))) {
    it(`crash ${point}`, async () => {
      const key = `fault-${point}`;
      const chunkPoint = ['after-claim', 'after-work', 'after-marker', 'after-commit'].includes(point);
      const args = [...FIXTURE_DIRS, '--log-level', 'error', 'run', 'counted', '--key', key, '--param', 'chunks=8', '--concurrency', '2'];
      const crashed = await runCli(args, { url: db.url, env: { IDEM_FAULT: `${point}:crash:${chunkPoint ? 4 : 1}` } });
      expectFaultCrash(crashed, point);
      const before = await runRow(db.url, 'counted', key);
      expect(before?.status ?? 'none').not.toBe('succeeded');
      const rerun = await runCli(args, { url: db.url });
      expect(rerun.code, `rerun's stderr: ${rerun.stderr}`).toBe(0);
      await expectConverged(key, 8);
    });
  }
});

describe('signals and lost locks', () => {
  const base = (key: string, extra: string[] = []) => [...FIXTURE_DIRS, '--log-level', 'warn', 'run', 'counted', '--key', key, ...extra];

  // SIGTERM with in-flight chunks finishing (exit 143, interrupted, resumable) is in crash.test.ts.

  /** Some idem work session of this database waits on a lock: the chunk sits at its gate. */
  const atGate = () =>
    waitFor(async () => (await lockWaiters(db.url, 'idem')) > 0, 'a chunk waiting on the gate');
  /** The chunk's work is done (uncommitted) before it waits at the gate: an abort has something to roll back. */
  const gatedArgs = (key: string, chunks: number) => base(key, ['--param', `chunks=${chunks}`, '--param', `gate=${key}`, '--param', 'gateAfterWork=true']);
  const stopping = (child: ReturnType<typeof spawnCli>) =>
    waitFor(async () => logLines(child.stderr()).find((l) => l.msg.startsWith('stopping: no new chunks')), 'the first signal to be handled');

  it('a second SIGINT aborts a stuck chunk at once (exit 130) and its work rolls back', async () => {
    const key = 'double-sigint';
    const gate = await holdGate(db.url, key);
    // A long deadline, so only the second signal can explain an early exit; the helper's time-out
    // (a hang) comes well before the test's.
    const child = spawnCli(['--shutdown-timeout', '600', ...gatedArgs(key, 3)], { url: db.url, timeoutMs: 40_000 });
    let res: CliResult;
    let t0 = 0;
    try {
      await atGate();
      child.child.kill('SIGINT');
      // The first signal was handled and the process is still there, waiting for its chunk.
      await stopping(child);
      expect(child.child.exitCode).toBeNull();
      t0 = Date.now();
      child.child.kill('SIGINT');
      // The gate stays held until the process is gone: only an abort can end the chunk.
      res = await child.done;
    } finally {
      await gate.release();
    }
    expect(res.timedOut, res.stderr).toBe(false);
    expect(res.code, res.stderr).toBe(130);
    expect(res.stderr).toContain('second signal; aborting in-flight chunks');
    // Generous: the behaviour is "not after the in-flight chunk, not at the deadline".
    expect(res.endedAt - t0).toBeLessThan(15_000);
    // c0001 had done its work before the gate: it rolled back with the chunk.
    expect((await workCounts(db.url, key)).size).toBe(0);
    expect(await query(db.url, 'select chunk_key from counted_state where run_key = $1', [key])).toEqual([]);
    expect(await doneCount(key)).toBe(1); // prepare only
    expect((await runCli(gatedArgs(key, 3), { url: db.url })).code).toBe(0);
    await expectConverged(key, 3);
  }, 90_000);

  it('the shutdown deadline aborts a chunk that outlives it, no sooner than the deadline', async () => {
    const key = 'deadline';
    const gate = await holdGate(db.url, key);
    const child = spawnCli(['--shutdown-timeout', '1', ...gatedArgs(key, 2)], { url: db.url, timeoutMs: 40_000 });
    let res: CliResult;
    let stopAt = 0;
    try {
      await atGate();
      child.child.kill('SIGTERM');
      stopAt = (await stopping(child)).time;
      res = await child.done;
    } finally {
      await gate.release();
    }
    expect(res.timedOut, res.stderr).toBe(false);
    expect(res.code, res.stderr).toBe(143);
    // The in-flight chunk got its full second: a 1 s deadline is not an immediate abort (the
    // exit itself can come a moment later either way: closing the pool waits up to 2 s) ...
    const deadlineAt = logLines(res.stderr).find((l) => l.msg === 'shutdown deadline passed; aborting in-flight chunks')?.time;
    expect(deadlineAt, res.stderr).toBeDefined();
    expect(deadlineAt! - stopAt).toBeGreaterThanOrEqual(990);
    // ... nor the default 30 s one (generous: the gate is never released before the exit).
    expect(res.endedAt - stopAt).toBeLessThan(20_000);
    expect((await workCounts(db.url, key)).size).toBe(0);
    expect(await query(db.url, 'select chunk_key from counted_state where run_key = $1', [key])).toEqual([]);
  }, 90_000);

  it('when its lock session is killed the runner exits 69 promptly, a waiting run takes over, and no old-attempt chunk commits after the takeover', async () => {
    const key = 'lock-loss';
    // 250 ms inside each chunk: once 5 chunks are done, the gate below must be held before the run
    // ends (~4 s later). With 50 ms the run could end within a second, before the gate was held
    // on a loaded machine, and the waiting run then found nothing to wait for (a CI time-out).
    const args = base(key, ['--param', 'chunks=40', '--param', 'pauseMs=250', '--param', `gate=${key}`, '--concurrency', '2']);
    const first = spawnCli(args, { url: db.url, timeoutMs: 100_000 });
    // Each wait is bounded well inside the test's own time-out and gives up at once, with the
    // process's output, when a process it waits on has exited: a failure says where it stopped.
    const alive = (child: CliProcess, what: string) => {
      if (child.child.exitCode !== null || child.child.signalCode !== null) {
        throw new Error(`${what} exited (${child.child.exitCode ?? child.child.signalCode}) early: ${child.stderr()}`);
      }
    };
    await waitFor(async () => (alive(first, 'the first run'), (await doneCount(key)) >= 5), '5 chunks done', { timeoutMs: 30_000 });
    // Hold the first run mid-chunk (deterministic on a loaded machine) while the second one lines up.
    const gate = await holdGate(db.url, key);
    let t0 = 0;
    const second = spawnCli([...args, '--wait', '120'], { url: db.url, timeoutMs: 100_000 });
    try {
      await waitFor(async () => (alive(first, 'the first run'), alive(second, 'the waiting run'), (await sessions(db.url, 'idem-lock')) >= 2), 'the second run waiting for the lock', {
        timeoutMs: 30_000,
      });
      // The first run's lock session, by the holder its name carries (host:pid); the waiting run's
      // session holds advisory locks too, for a moment at each try (the gate, the job's lock shared).
      const holder = await query<{ pid: number }>(
        db.url,
        `select distinct l.pid from pg_locks l join pg_stat_activity a on a.pid = l.pid
         where l.locktype = 'advisory' and l.granted and a.application_name = $1 and a.datname = current_database()`,
        [sessionName('idem-lock', `${hostname()}:${first.pid}`)],
      );
      expect(holder).toHaveLength(1);
      t0 = Date.now();
      await query(db.url, 'select pg_terminate_backend($1)', [holder[0]!.pid]);
    } finally {
      await gate.release();
    }
    const firstRes = await first.done;
    expect(firstRes.timedOut, firstRes.stderr).toBe(false);
    expect(firstRes.code, firstRes.stderr).toBe(69);
    // Detected at once (socket error) or by the 2 s check; generous for a loaded machine, yet far
    // from the run's own length (it is held at the gate until its lock is gone).
    expect(firstRes.endedAt - t0).toBeLessThan(15_000);
    expect(firstRes.stderr).toContain('lost the advisory lock');
    const secondRes = await second.done;
    expect(secondRes.timedOut, secondRes.stderr).toBe(false);
    expect(secondRes.code, secondRes.stderr).toBe(0);
    await expectConverged(key, 40);
    const run = await runRow(db.url, 'counted', key);
    expect(run.attempt).toBe(2);
    const fence = await query<{ late: number; old: number }>(
      db.url,
      `select count(*) filter (where c.done_attempt = 1 and c.done_at >= r.attempt_started_at)::int as late,
              count(*) filter (where c.done_attempt = 1)::int as old
       from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'counted' and r.run_key = $1`,
      [key],
    );
    expect(fence[0]!.old).toBeGreaterThanOrEqual(5);
    expect(fence[0]!.late).toBe(0);
  }, 120_000);

  it('a lost lock exits 69, as its --json says, even when closing waits on a chunk that never settles and every session of the worker is gone', async () => {
    // Black-box: idem's backends terminated while a step ran (--concurrency 3) printed the lost lock
    // and --json's exitCode 69, then exited 13: closing the pool waited on a slot whose chunk never
    // ended, nothing (no socket, no timer but the unref'd watchdog) kept the process alive, and Node
    // ended it for bin/idem.js's unsettled top-level await, with its own code.
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-lost-close-'));
    try {
      await writeFile(path.join(dir, 'package.json'), JSON.stringify({ type: 'module' }));
      // A chunk that awaits what never comes, with no timer or socket of its own (it ignores ctx.signal).
      await writeFile(path.join(dir, 'never.js'), `export default { name: 'never', steps: [{ name: 'wait', run() { return new Promise(() => {}); } }] };\n`);
      const child = spawnCli(['--jobs-dir', dir, 'run', 'never', '--key', 'lost-close', '--json'], { url: db.url, timeoutMs: 60_000 });
      const holder = sessionName('idem-lock', `${hostname()}:${child.pid}`);
      const work = sessionName('idem', `${hostname()}:${child.pid}`);
      await waitFor(async () => ((await query(db.url, `select 1 from idem.steps s join idem.runs r on r.id = s.run_id where r.run_key = 'lost-close' and s.status = 'running'`)).length > 0 ? true : undefined), 'the step running');
      await new Promise((r) => setTimeout(r, 300));
      const killed = await query<{ n: number }>(db.url, `select count(pg_terminate_backend(pid))::int as n from pg_stat_activity where application_name in ($1, $2) and datname = current_database()`, [holder, work]);
      expect(killed[0]!.n).toBeGreaterThanOrEqual(2);
      const r = await child.done;
      expect(r.timedOut, r.stderr).toBe(false);
      const json = JSON.parse(lines(r.stdout).at(-1)!) as { exitCode: number };
      expect(json.exitCode).toBe(69);
      expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([expect.stringMatching(/^idem: error: lost the advisory lock for /)]);
      expect(r.code, r.stderr).toBe(69);
      expect(r.stderr).not.toContain('unsettled top-level await');
      expect(await runRow(db.url, 'never', 'lost-close')).toMatchObject({ status: expect.stringMatching(/^(running|interrupted)$/) });
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  }, 90_000);
});

describe('database health at start-up', () => {
  it('wrong credentials: exit 2, one line naming the fix, and the password is not printed', async () => {
    const bad = new URL(db.url);
    bad.password = 'not-the-password-xyz';
    const res = await runCli([...FIXTURE_DIRS, 'status'], { url: bad.toString() });
    expect(res.code).toBe(2);
    expect(res.stderr).toMatch(/refused the credentials.*fix the user or password/);
    expect(res.stderr).not.toContain('not-the-password-xyz');
    expect(res.stderr.trim().split('\n')).toHaveLength(1);
  });

  it('wrong credentials from --database-url: the fix names --database-url, not DATABASE_URL', async () => {
    const bad = new URL(db.url);
    bad.password = 'not-the-password-xyz';
    const res = await runCli([...FIXTURE_DIRS, '--database-url', bad.toString(), 'status']);
    expect(res.code).toBe(2);
    expect(res.stderr.trim().split('\n')).toEqual([expect.stringMatching(/refused the credentials.*; fix the user or password in --database-url$/)]);
    expect(res.stderr).not.toContain('not-the-password-xyz');
    const env = await runCli([...FIXTURE_DIRS, 'status'], { url: bad.toString() });
    expect(env.stderr.trim().split('\n')).toEqual([expect.stringMatching(/; fix the user or password in DATABASE_URL$/)]);
  });

  it('no password anywhere: the line says none was given and where to give one, not pg internal SASL message', async () => {
    const u = new URL(db.url);
    u.password = '';
    const noPgpass = { PGPASSWORD: undefined, PGPASSFILE: path.join(tmpdir(), 'idem-no-such-pgpass') };
    const res = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--key', 'no-pw', '--json'], { url: u.toString(), env: noPgpass });
    expect(res.code, res.stderr).toBe(2);
    expect(res.stderr.trim().split('\n')).toEqual([
      `idem: error: the database at ${u.toString()} asks for a password and none was given (not in DATABASE_URL, PGPASSWORD or ${noPgpass.PGPASSFILE}); put it in DATABASE_URL (postgres://user:password@host:5432/db, percent-encoded), or set PGPASSWORD, or add it to ${noPgpass.PGPASSFILE}`,
    ]);
    expect(JSON.parse(res.stdout)).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.databaseUnavailable' });
  });

  it('a wrong password from PGPASSWORD or .pgpass: the fix names that source, not DATABASE_URL, and the password is not printed', async () => {
    const u = new URL(db.url);
    u.password = '';
    const fromEnv = await runCli([...FIXTURE_DIRS, 'status'], { url: u.toString(), env: { PGPASSWORD: 'wrong-env-secret', PGPASSFILE: path.join(tmpdir(), 'idem-no-such-pgpass') } });
    expect(fromEnv.code, fromEnv.stderr).toBe(2);
    expect(fromEnv.stderr.trim().split('\n')).toEqual([expect.stringMatching(/refused the credentials \(password authentication failed for user "[^"]+"\); fix the password in PGPASSWORD \(DATABASE_URL has none\), or the user in DATABASE_URL$/)]);
    expect(fromEnv.stderr).not.toContain('wrong-env-secret');
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-pgpass-'));
    try {
      const pgpass = path.join(dir, 'pgpass');
      await writeFile(pgpass, `*:*:*:*:wrong-file-secret\n`, { mode: 0o600 });
      const fromFile = await runCli([...FIXTURE_DIRS, '--database-url', u.toString(), 'status'], { env: { PGPASSWORD: undefined, PGPASSFILE: pgpass } });
      expect(fromFile.code, fromFile.stderr).toBe(2);
      expect(fromFile.stderr.trim().split('\n').filter((l) => !l.startsWith('idem: warning:'))).toEqual([
        expect.stringMatching(new RegExp(`refused the credentials \\(password authentication failed for user "[^"]+"\\); fix the password in ${pgpass.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')} \\(--database-url has none, PGPASSWORD is not set\\), or the user in --database-url$`)),
      ]);
      expect(fromFile.stderr).not.toContain('wrong-file-secret');
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
    // The password in the URL stays the URL's to fix, PGPASSWORD set or not.
    const inUrl = new URL(db.url);
    inUrl.password = 'wrong-url-secret';
    const fromUrl = await runCli([...FIXTURE_DIRS, 'status'], { url: inUrl.toString(), env: { PGPASSWORD: 'other-secret' } });
    expect(fromUrl.stderr.trim().split('\n')).toEqual([expect.stringMatching(/; fix the user or password in DATABASE_URL$/)]);
    expect(fromUrl.stderr).not.toMatch(/wrong-url-secret|other-secret/);
  });

  describe('a password from the password file (PGPASSFILE)', () => {
    let dir: string;
    let pgpass: string;
    let bare: string;
    const secret = () => decodeURIComponent(new URL(db.url).password);
    beforeAll(async () => {
      dir = await mkdtemp(path.join(tmpdir(), 'idem-pgpass-mask-'));
      const u = new URL(db.url);
      pgpass = path.join(dir, 'pgpass');
      await writeFile(pgpass, `${u.hostname}:${u.port}:*:${decodeURIComponent(u.username)}:${secret()}\n`, { mode: 0o600 });
      u.password = '';
      bare = u.href;
      await mkdir(path.join(dir, 'jobs'));
      // A job that quotes the password in its error, as a careless one does (an API token in a URL).
      await writeFile(path.join(dir, 'jobs', 'pgpass-leak.mjs'), `export default { name: 'pgpass-leak', steps: [{ name: 'call', retry: { attempts: 1 }, run: async () => { throw new Error('GET https://api.example/x?token=' + process.env.LEAKED_TOKEN); } }] };\n`);
    });
    afterAll(() => rm(dir, { recursive: true, force: true }));

    it('is masked as one from the URL or PGPASSWORD is: in the run key, the job error, --json and idem status', async () => {
      // Black-box round: the same password from PGPASSWORD showed `token=***`; from .pgpass it was printed whole.
      const env = { PGPASSFILE: pgpass, PGPASSWORD: undefined, LEAKED_TOKEN: secret() };
      const key = `${secret()}-pp`;
      const run = await runCli(['--jobs-dir', path.join(dir, 'jobs'), 'run', 'pgpass-leak', '--key', key, '--json'], { url: bare, env });
      expect(run.code, run.stderr).toBe(1);
      expect(run.stderr).toContain('token=***');
      expect(run.stdout).toContain('token=***');
      const [text, json] = await Promise.all([
        runCli(['--jobs-dir', path.join(dir, 'jobs'), 'status'], { url: bare, env }),
        runCli(['--jobs-dir', path.join(dir, 'jobs'), 'status', '--json'], { url: bare, env }),
      ]);
      expect(text.code, text.stderr).toBe(0);
      expect(text.stdout).toContain('***-pp');
      expect(JSON.parse(json.stdout)).toContainEqual(expect.objectContaining({ job: 'pgpass-leak', runKey: '***-pp', state: 'failed' }));
      for (const r of [run, text, json]) expect(r.stdout + r.stderr).not.toContain(secret());
      // The run is recorded under its real key: only what is shown is masked.
      expect(await query(db.url, `select count(*)::int as n from idem.runs where job = 'pgpass-leak' and run_key = $1`, [key])).toEqual([{ n: 1 }]);
    });

    it('with HOME unset, pg reads ./.pgpass in the working directory: that is the file masked', async () => {
      // Review of this stop (M4): idem masked the lines of the account's ~/.pgpass while pg, with
      // HOME unset (a systemd unit), read ./.pgpass: the password it used went unmasked.
      const cwd = path.join(dir, 'home-unset');
      await mkdir(cwd, { recursive: true });
      await writeFile(path.join(cwd, '.pgpass'), await readFile(pgpass, 'utf8'), { mode: 0o600 });
      const env = { HOME: undefined, PGPASSFILE: undefined, PGPASSWORD: undefined, LEAKED_TOKEN: secret() };
      const run = await runCli(['--jobs-dir', path.join(dir, 'jobs'), 'run', 'pgpass-leak', '--key', 'home-unset'], { url: bare, env, cwd });
      expect(run.code, run.stderr).toBe(1);
      expect(run.stderr).toContain('token=***');
      expect(run.stdout + run.stderr).not.toContain(secret());
    });

    it("is masked in idem serve's answers and log lines too", async () => {
      const server = await startServe(bare, [], { PGPASSFILE: pgpass, PGPASSWORD: undefined, LEAKED_TOKEN: secret() } as unknown as Record<string, string>, path.join(dir, 'jobs'));
      try {
        const created = await api(server.base, 'POST', '/api/jobs/pgpass-leak/runs', { body: {}, key: `${secret()}-serve` });
        expect(created.status, created.text).toBe(201);
        const failed = await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`);
        expect(failed.body).toMatchObject({ state: 'failed' });
        expect(failed.text).toContain('***-serve');
        expect(failed.text).toContain('token=***');
        const page = await api(server.base, 'GET', `/runs/${created.body.id}`);
        expect(page.status).toBe(200);
        for (const r of [created, failed, page]) expect(r.text).not.toContain(secret());
      } finally {
        server.proc.child.kill('SIGTERM');
        await server.proc.done;
      }
      expect(server.proc.stderr()).toContain('token=***');
      expect(server.proc.stdout() + server.proc.stderr()).not.toContain(secret());
    }, 60_000);

    it('in a file with group or world access: one idem warning line, and the error names the permissions and chmod 600', async () => {
      // Black-box round: pg's own "WARNING: password file … has group or world access" twice, then
      // "none was given … add it to <file>" while the password was in that file.
      const open = path.join(dir, 'pgpass-open');
      const u = new URL(db.url);
      await writeFile(open, `${u.hostname}:${u.port}:*:${decodeURIComponent(u.username)}:${secret()}\n`, { mode: 0o644 });
      await chmod(open, 0o644);
      const before = await query(db.url, `select count(*)::int as n from idem.runs`);
      const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--key', 'pgpass-open'], { url: bare, env: { PGPASSFILE: open, PGPASSWORD: undefined } });
      expect(r.code, r.stderr).toBe(2);
      expect(r.stdout).toBe('');
      expect(r.stderr.trim().split('\n')).toEqual([
        `idem: warning: the password file ${open} has group or world access, so pg does not read it; chmod 600 ${open}`,
        `idem: error: the database at ${bare} asks for a password and none was given: the password file ${open} has group or world access, so pg does not read it; chmod 600 ${open} (or put the password in DATABASE_URL or PGPASSWORD)`,
      ]);
      expect(r.stderr).not.toContain(secret());
      expect(await query(db.url, `select count(*)::int as n from idem.runs`)).toEqual(before);
    });
  });

  it("a run key holding the password: idem status's columns line up with the key masked (widths of what is shown)", async () => {
    // Black-box round: the padding was computed on the key before masking, so `***-x` sat 10 columns off.
    const key = `${decodeURIComponent(new URL(db.url).password)}-x`;
    for (const k of [key, 'k']) expect((await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', k], { url: db.url })).code).toBe(0);
    const r = await runCli([...FIXTURE_DIRS, 'status', 'counted'], { url: db.url });
    expect(r.code, r.stderr).toBe(0);
    const out = lines(r.stdout);
    const header = out[0]!;
    const masked = out.find((l) => l.includes('***-x'))!;
    const plain = out.find((l) => /^counted +k +succeeded/.test(l))!;
    expect(masked, r.stdout).toBeDefined();
    expect(plain, r.stdout).toBeDefined();
    // STATE starts in one column in every row.
    expect(masked.indexOf('succeeded')).toBe(header.indexOf('STATE'));
    expect(plain.indexOf('succeeded')).toBe(header.indexOf('STATE'));
    // A long password is masked before the key is clipped to its column: no piece of it shows.
    expect(r.stdout).not.toContain(key.slice(0, 8));
  });

  it('a database with CONNECT revoked: exit 2 naming GRANT CONNECT ON DATABASE … TO the role', async () => {
    const name = `idem-noconnect-${process.pid}`;
    const role = `idem_noconnect_${process.pid}`;
    await query(db.url, `create database "${name}"`);
    await query(db.url, `create role ${role} login password 'noconnect-pw'`);
    await query(db.url, `revoke connect on database "${name}" from public`);
    try {
      const u = new URL(db.url);
      u.username = role;
      u.password = 'noconnect-pw';
      u.pathname = `/${name}`;
      const r = await runCli([...FIXTURE_DIRS, 'status'], { url: u.href });
      expect(r.code, r.stderr).toBe(2);
      expect(r.stderr.trim().split('\n')).toEqual([
        `idem: error: the database at ${u.href.replace('noconnect-pw', '***')} does not let role ${role} connect (permission denied for database "${name}"); GRANT CONNECT ON DATABASE "${name}" TO ${role}, or connect as a role that has it`,
      ]);
    } finally {
      await query(db.url, `drop database if exists "${name}"`);
      await query(db.url, `drop role if exists ${role}`);
    }
  });

  it('a URL that does not parse is idem.invalidDatabaseUrl (exit 2) whatever breaks it: a fragment, a port past 65535, an unclosed [', async () => {
    const u = new URL(db.url);
    for (const raw of [`postgres://${u.username}:pw-secret@${u.host}/app#frag`, `postgres://${u.username}:pw-secret@127.0.0.1:99999/app`, `postgres://${u.username}:pw-secret@[::1:5542/app`]) {
      const res = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--key', 'bad-url', '--json'], { url: raw });
      expect(res.code, raw).toBe(2);
      expect(res.stderr.trim().split('\n'), raw).toEqual([expect.stringMatching(raw.includes('99999') ? /^idem: error: DATABASE_URL has port 99999, which is not a port number/ : /^idem: error: DATABASE_URL is not a valid URL; percent-encode/)]);
      expect(JSON.parse(res.stdout), raw).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.invalidDatabaseUrl' });
      expect(res.stdout + res.stderr).not.toContain('pw-secret');
    }
  });

  it('a password with an unencoded /, # or ?: exit 2, one line saying to percent-encode it, the password not printed', async () => {
    const u = new URL(db.url);
    // A password that starts with digits before the / # or ? parses as a valid URL whose host is the
    // user and whose port is those digits ("12#ss-secret": host postgres, port 12): it used to
    // fail as "host not found", printing the whole string, password included.
    // So does an @ before a / or ? ("p@ss/secret": password p, host ss, database "secret@host/db").
    const cases = [['pa/ss-secret', '--database-url'], ['pa#ss-secret', 'DATABASE_URL'], ['pa?ss-secret', '--database-url'], ['12#ss-secret', 'DATABASE_URL'], ['12/ss-secret', '--database-url'], ['12?ss-secret', 'DATABASE_URL'], ['p@ss/ss-secret', 'DATABASE_URL']] as const;
    for (const [password, from] of cases) {
      const raw = `postgres://${u.username}:${password}@${u.host}${u.pathname}`;
      const res = from === 'DATABASE_URL' ? await runCli([...FIXTURE_DIRS, 'status'], { url: raw }) : await runCli([...FIXTURE_DIRS, '--database-url', raw, 'status']);
      expect(res.code, res.stderr).toBe(2);
      const out = res.stderr.trim().split('\n');
      expect(out, password).toEqual([expect.stringMatching(new RegExp(`^idem: error: ${from} is not a valid URL.*percent-encode.*# as %23`))]);
      expect(res.stderr).not.toContain('ss-secret');
    }
    // The library refuses the same before connecting, and its exported redaction shows none of it.
    const { Runner, redactUrl } = await import('idem');
    const misread = `postgres://${u.username}:12#ss-secret@${u.host}${u.pathname}`;
    await expect(Runner.connect({ connectionString: misread })).rejects.toThrow(/^the connection string is not a valid URL; percent-encode/);
    expect(redactUrl(misread)).toBe('postgres://***');
    expect(redactUrl(`postgres://${u.username}:ok-secret@${u.host}${u.pathname}`)).not.toContain('ok-secret');
    for (const password of ['p@ss/ss-secret', 'p@ss?x=ss-secret', 'p@ss/w#rd?ss-secret']) {
      const raw = `postgres://${u.username}:${password}@${u.host}${u.pathname}`;
      const err = await rejectionOf(Runner.connect({ connectionString: raw }));
      expect(err.message, password).toMatch(/^the connection string is not a valid URL; percent-encode/);
      expect(redactUrl(raw), password).not.toContain('ss-secret');
    }
  });

  it('a connection string that is not a postgres:// URL (no scheme, one slash): exit 2 before connecting, the password not printed', async () => {
    const u = new URL(db.url);
    const forms = [`${u.username}:ss-secret@${u.host}${u.pathname}`, `//${u.username}:ss-secret@${u.host}${u.pathname}`, `postgres:/${u.username}:ss-secret@${u.host}${u.pathname}`, `postgres//${u.username}:ss-secret@${u.host}${u.pathname}`, 'foo bar'];
    // pg took each for a host name or a socket path, and the error printed the string whole.
    const res = await runCli([...FIXTURE_DIRS, 'status'], { url: forms[0] });
    expect(res.code, res.stderr).toBe(2);
    expect(res.stderr.trim().split('\n')).toEqual([expect.stringMatching(/^idem: error: DATABASE_URL is not a postgres:\/\/ URL; pass postgres:\/\/user:password@host:5432\/db/)]);
    expect(res.stderr).not.toContain('ss-secret');
    const { Runner, redactUrl } = await import('idem');
    for (const raw of forms) {
      const err = await rejectionOf(Runner.connect({ connectionString: raw }));
      expect(err.message, raw).toMatch(/^the connection string is not a postgres:\/\/ URL/);
      expect(err.message, raw).not.toContain('ss-secret');
      expect(redactUrl(raw), raw).not.toContain('ss-secret');
    }
  });

  it('a role that may not log in: exit 2 naming ALTER ROLE … LOGIN, not "fix the user or password" (they are right)', async () => {
    await query(db.url, `drop role if exists idem_nologin_role`);
    await query(db.url, `create role idem_nologin_role nologin password 'nologin-secret-xyz'`);
    try {
      const as = new URL(db.url);
      as.username = 'idem_nologin_role';
      as.password = 'nologin-secret-xyz';
      const res = await runCli([...FIXTURE_DIRS, 'status'], { url: as.toString() });
      expect(res.code).toBe(2);
      expect(res.stderr.trim().split('\n')).toEqual([
        expect.stringMatching(/^idem: error: the database at \S+ refused the connection \(role "idem_nologin_role" is not permitted to log in\); ALTER ROLE idem_nologin_role LOGIN, or use a role that may log in$/),
      ]);
      expect(res.stderr).not.toContain('nologin-secret-xyz');
    } finally {
      await query(db.url, `drop role if exists idem_nologin_role`);
    }
  });

  /** A login role with a CONNECTION LIMIT and the grants the fixture jobs need: `url` connects as it. */
  async function limitedRole(role: string, password: string, limit: number): Promise<{ url: string; drop(): Promise<void> }> {
    const drop = async () => {
      await query(db.url, `drop owned by ${role}`).catch(() => {});
      await query(db.url, `drop role if exists ${role}`);
    };
    await drop();
    await query(db.url, `create role ${role} login password '${password}' connection limit ${limit}`);
    await query(db.url, `grant usage on schema idem to ${role}; grant select, insert, update, delete on all tables in schema idem to ${role};
      grant select, insert, update, delete on all tables in schema public to ${role}; grant usage on all sequences in schema public to ${role}`);
    const as = new URL(db.url);
    as.username = role;
    as.password = password;
    return { url: as.toString(), drop };
  }

  it('a server with one free connection slot, or none, for idem: exit 2 after a bounded retry, one line naming the limit, never a hang', async () => {
    // Black-box round 10: with exactly one slot free, the start's second connection failed (53300)
    // and the first one was never released: pool.end() waited on it forever, and so did idem (also
    // `idem status`). With none free, exit 2 at once with "check DATABASE_URL", the wrong fix.
    for (const limit of [1, 0]) {
      const role = `idem_conn_limit_${limit}`;
      const as = await limitedRole(role, 'limit-secret-xyz', limit);
      try {
        const started = Date.now();
        const child = spawnCli([...FIXTURE_DIRS, 'status'], { url: as.url, env: { IDEM_CONNECT_RETRY_MS: '1500' } });
        const killer = setTimeout(() => child.child.kill('SIGKILL'), 20_000);
        const res = await child.done;
        clearTimeout(killer);
        expect(res.code, `limit ${limit}: ${res.stderr}`).toBe(2);
        // Retried for the window, not refused at once; and over well before the 20 s kill.
        expect(Date.now() - started).toBeGreaterThanOrEqual(1_500);
        expect(res.stderr.trim().split('\n')).toEqual([
          expect.stringMatching(new RegExp(`^idem: error: the database at \\S+ has no connection free for idem \\(too many connections for role "${role}"\\); .*wait for other sessions to end, or raise max_connections or the role's CONNECTION LIMIT$`)),
        ]);
        expect(res.stderr).not.toContain('limit-secret-xyz');
      } finally {
        await as.drop();
      }
    }
  });

  it('a slot that cannot get a connection mid-run (the role\'s CONNECTION LIMIT) does not fail the run: the other slots finish it', async () => {
    // Black-box round 10: a worker whose pool met 53300 after its start failed the whole run, as
    // step "(runner)", and every other worker sharing it with it.
    const as = await limitedRole('idem_conn_limit_mid', 'mid-secret-xyz', 4);
    try {
      const key = 'conn-limit-mid';
      // The lock session, the pool's two from the start, the planner's: a fourth slot of the pool is refused.
      const res = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":12}', '--key', key, '--concurrency', '4', '--no-progress'], { url: as.url });
      expect(res.code, res.stderr).toBe(0);
      expect(res.stderr).not.toContain('mid-secret-xyz');
      expect(await runRow(db.url, 'counted', key)).toMatchObject({ status: 'succeeded', attempt: 1 });
      expect([...(await workCounts(db.url, key)).values()].every((n) => n === 1)).toBe(true);
      expect((await workCounts(db.url, key)).size).toBe(12);
    } finally {
      await as.drop();
    }
  });

  it('a slot that leaves for want of a connection with a chunk to retry does not leave that chunk pending under a step marked done', async () => {
    // Review round 14 (F1): slot S1's chunk x failed transiently and S1 slept out its backoff; S2,
    // in its last pass, sent a wait claim passing x by (it was cooling off) that blocked on z (held
    // by another transaction); S1 woke, could get no connection (53300) and left quietly for the
    // others; z was committed elsewhere, S2's claim found nothing and the step, then the run, were
    // marked done with x never done: a rerun said "already succeeded".
    await query(db.url, `create table if not exists left_pending_log (key text not null)`);
    const role = 'idem_conn_limit_left';
    const as = await limitedRole(role, 'left-secret-xyz', 10);
    const gate = () => {
      let open!: () => void;
      const promise = new Promise<void>((resolve) => (open = resolve));
      return { promise, open };
    };
    const gateX = gate();
    const gateY = gate();
    let xTries = 0;
    let xPid: number | undefined;
    let yStarted = false;
    const job = defineJob({
      name: 'left-pending',
      // A long backoff, the same every time (Math.random pinned below): the test acts within it.
      retry: { base: 3_000, factor: 1, attempts: 2 },
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [{ key: 'x' }, { key: 'y' }, { key: 'z' }], next: null }),
          run: async ({ db: trx }, c: { key: string }) => {
            if (c.key === 'x' && ++xTries === 1) {
              const { rows } = await sql<{ pid: number }>`select pg_backend_pid() as pid`.execute(trx);
              xPid = rows[0]!.pid;
              await gateX.promise;
              throw Object.assign(new Error('could not serialize access (test)'), { code: '40001' });
            }
            if (c.key === 'y') {
              yStarted = true;
              await gateY.promise;
            }
            await sql`insert into left_pending_log (key) values (${c.key})`.execute(trx);
          },
        },
      ],
    });
    const lines: string[] = [];
    const logged = (msg: string) => lines.some((l) => l.includes(msg));
    const { default: pino } = await import('pino');
    const own = await Runner.connect({ connectionString: as.url, log: pino({ level: 'debug' }, { write: (s: string) => void lines.push(s) }) });
    const random = vi.spyOn(Math, 'random').mockReturnValue(0.999);
    const holder = new pg.Client({ connectionString: db.url, application_name: 'test-holder' });
    holder.on('error', () => {});
    await holder.connect();
    try {
      const running = own.run(job, { key: 'left', concurrency: 2 });
      await waitFor(async () => xPid !== undefined && yStarted, 'x and y in flight');
      // z is planned and free: hold its row, as another worker's chunk in flight would.
      await holder.query('begin');
      expect((await holder.query(`select c.seq from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'left-pending' and c.key = 'z' for update of c`)).rowCount).toBe(1);
      gateX.open(); // x fails transiently: its slot (S1) sleeps out the 3 s backoff
      await waitFor(async () => logged('transient error, retrying chunk'), 'x to fail once');
      gateY.open(); // y commits; S2 finds nothing free and waits, x passed by, for z
      const s2 = await waitFor(async () => {
        const rows = await query<{ pid: number }>(db.url, `select pid from pg_stat_activity where datname = current_database() and usename = $1 and wait_event_type = 'Lock'`, [role]);
        return rows[0]?.pid;
      }, "S2's wait claim blocked on z");
      // The role may keep the sessions it has (the lock's, S2's): every other one ends, x's slot's
      // among them, and no new one is let in.
      await query(db.url, `alter role ${role} connection limit 2`);
      const ended = await query<{ pid: number }>(
        db.url,
        `select pid from pg_stat_activity where datname = current_database() and usename = $1 and application_name not like 'idem-lock%' and pid <> $2`,
        [role, s2],
      );
      expect(ended.map((r) => r.pid)).toContain(xPid);
      for (const { pid } of ended) await query(db.url, 'select pg_terminate_backend($1)', [pid]);
      expect(logged('a slot could not get a database connection')).toBe(false);
      await waitFor(async () => logged('a slot could not get a database connection'), 'S1 to leave for want of a connection', { timeoutMs: 30_000 });
      // The race as the review found it: S1 left with x to retry, and S2's claim, passing x by, waits.
      expect(xTries).toBe(1);
      expect(await query(db.url, `select c.done_at is null as pending from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'left-pending' and c.key = 'x'`)).toEqual([{ pending: true }]);
      // z commits elsewhere (attempt 1, by another worker), and connections are to be had again.
      await query(db.url, `alter role ${role} connection limit 10`);
      await holder.query(`update idem.chunks c set done_at = clock_timestamp(), done_attempt = 1, done_by = 'another worker' from idem.runs r where r.id = c.run_id and r.job = 'left-pending' and c.key = 'z'`);
      await holder.query('commit');
      const outcome = await running;
      expect(outcome).toMatchObject({ status: 'succeeded', attempt: 1 });
      const chunks = await query<{ key: string; done: boolean }>(db.url, `select c.key, c.done_at is not null as done from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'left-pending' order by c.seq`);
      expect(chunks).toEqual([
        { key: 'x', done: true },
        { key: 'y', done: true },
        { key: 'z', done: true },
      ]);
      expect(await query(db.url, `select key, count(*)::int as n from left_pending_log group by key order by key`)).toEqual([
        { key: 'x', n: 1 },
        { key: 'y', n: 1 },
      ]);
      expect(logged('chunks of the step are left')).toBe(true);
      expect(lines.join('')).not.toContain('left-secret-xyz');
    } finally {
      random.mockRestore();
      gateX.open();
      gateY.open();
      await holder.end().catch(() => {});
      await own.close();
      await query(db.url, `drop table if exists left_pending_log`);
      await as.drop();
    }
  });

  it('a step whose slots keep ending with it incomplete fails after a bounded number of starts, naming what is left, never loops', async () => {
    // The other side of the test above: the slots start again only so often. Here the step row says
    // it is not all planned (written behind the runner's back), which no start of the slots changes.
    const job = defineJob({
      name: 'never-complete',
      steps: [
        {
          name: 'work',
          chunks: () => ({ chunks: [{ key: 'a' }], next: null }),
          run: async () => {
            await query(db.url, `update idem.steps s set planned_all = false from idem.runs r where r.id = s.run_id and r.job = 'never-complete' and s.name = 'work'`);
          },
        },
      ],
    });
    const lines: string[] = [];
    const { default: pino } = await import('pino');
    const own = await Runner.connect({ connectionString: db.url, log: pino({ level: 'debug' }, { write: (s: string) => void lines.push(s) }) });
    try {
      const started = Date.now();
      const err = await rejectionOf(own.run(job, { key: 'never', concurrency: 2 }));
      expect(err).toBeInstanceOf(RunFailedError);
      expect(err.message).toContain('failed in step "work"');
      expect(err.message).toContain('the step is not complete (none pending, but not all of it planned) after its slots started 10 times and found nothing more to claim; run the same command again to resume');
      expect(Date.now() - started).toBeLessThan(15_000);
      expect(await runRow(db.url, 'never-complete', 'never')).toMatchObject({ status: 'failed', attempt: 1 });
      expect(await doneCount('never', 'never-complete')).toBe(1);
    } finally {
      await own.close();
    }
  });

  it('a worker joining when the database has few connections left for it never fails the shared run: slots that get none leave, or it exits naming the limit', async () => {
    // Black-box round 10: a third worker starting when the server was nearly full failed the
    // shared run in "(runner)" (53300), and both healthy workers with it.
    for (const limit of [3, 2]) {
      const role = `idem_conn_limit_join_${limit}`;
      const as = await limitedRole(role, 'join-secret-xyz', limit);
      const gate = await holdGate(db.url, `g-conn-join-${limit}`);
      const key = `conn-limit-join-${limit}`;
      const args = [...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify({ chunks: 12, gate: `g-conn-join-${limit}` }), '--key', key, '--join', '--no-progress'];
      try {
        const healthy = spawnCli(args, { url: db.url });
        await waitFor(async () => (await lockWaiters(db.url)) > 0, 'the healthy worker to wait at the gate');
        // Limit 3: its lock session and the pool's two from the start fill it, so of its three
        // slots only those that get one of the pool's work. Limit 2: no lock session at all.
        const starvedChild = spawnCli([...args, '--concurrency', '3'], { url: as.url });
        await waitFor(async () => starvedChild.stderr().includes('"joined":true') || starvedChild.stderr().includes('idem: error'), 'the second worker to join or stop');
        await new Promise((resolve) => setTimeout(resolve, 1_500));
        await gate.release();
        const [done, starved] = await Promise.all([healthy.done, starvedChild.done]);
        expect(done.code, done.stderr).toBe(0);
        expect(starved.stderr).not.toContain('join-secret-xyz');
        expect(starved.stderr).not.toContain('failed in step "(runner)"');
        if (limit === 3) expect(starved.code, starved.stderr).toBe(0);
        else {
          expect(starved.code, starved.stderr).toBe(2);
          expect(lines(starved.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([
            `idem: error: cannot open the lock session: too many connections for role "${role}"; the database has no connection free for idem: wait for other sessions to end, or raise max_connections or the role's CONNECTION LIMIT`,
          ]);
        }
        expect(await runRow(db.url, 'counted', key)).toMatchObject({ status: 'succeeded', attempt: 1 });
        expect((await workCounts(db.url, key)).size).toBe(12);
        expect([...(await workCounts(db.url, key)).values()].every((n) => n === 1)).toBe(true);
      } finally {
        await gate.release();
        await as.drop();
      }
    }
  });

  it('a worker that loses its work connections mid-run and cannot get any back stops with 69; the run is interrupted, not failed, and a rerun finishes it', async () => {
    // The last-slot side of black-box round 10's fix: idem's own statements failing past their
    // retries for connection trouble end the worker, never the run.
    const role = 'idem_conn_limit_lost';
    const as = await limitedRole(role, 'lost-secret-xyz', 3);
    const gate = await holdGate(db.url, 'g-conn-lost');
    const key = 'conn-limit-lost';
    const args = [...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify({ chunks: 6, gate: 'g-conn-lost' }), '--key', key, '--no-progress'];
    try {
      const worker = spawnCli(args, { url: as.url });
      await waitFor(async () => (await lockWaiters(db.url)) > 0, 'the worker to wait at the gate');
      // The role may keep only the session it has left (the lock's), and its work sessions end:
      // every reconnect of the worker is refused (53300).
      await query(db.url, `alter role ${role} connection limit 1`);
      await query(db.url, `select pg_terminate_backend(pid) from pg_stat_activity where datname = current_database() and usename = $1 and application_name not like 'idem-lock%'`, [role]);
      await gate.release();
      const r = await worker.done;
      expect(r.code, r.stderr).toBe(69);
      expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([
        expect.stringMatching(/^idem: error: this worker stopped: the database failed idem's own statements past their retries \(too many connections for role "idem_conn_limit_lost"\); the run is interrupted: run the same command again to resume$/),
      ]);
      expect(await runRow(db.url, 'counted', key)).toMatchObject({ status: 'interrupted', error: null });
    } finally {
      await gate.release();
      await query(db.url, `alter role ${role} connection limit 3`);
    }
    try {
      const again = await runCli(args, { url: as.url });
      expect(again.code, again.stderr).toBe(0);
      expect([...(await workCounts(db.url, key)).values()]).toEqual(Array(6).fill(1));
    } finally {
      await as.drop();
    }
  });

  it('a runner schema newer than this binary: exit 2 and nothing is changed', async () => {
    await runCli([...FIXTURE_DIRS, 'status'], { url: db.url }); // make sure the schema exists
    await query(db.url, `insert into idem.idem_migration (name, timestamp) values ('9999_from_the_future', now()::text)`);
    try {
      const res = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--key', 'future'], { url: db.url });
      expect(res.code).toBe(2);
      expect(res.stderr).toContain('newer than this binary; upgrade idem');
      expect(await runRow(db.url, 'counted', 'future')).toBeUndefined();
    } finally {
      await query(db.url, `delete from idem.idem_migration where name = '9999_from_the_future'`);
    }
  });

  it('a schema from before the open-runs index gets it from concurrent first uses, once, its runs kept', async () => {
    // As an idem before 0013 left it: runs there, the index and its record (and later ones) not.
    await query(db.url, `drop index idem.runs_open_idx`);
    await query(db.url, `delete from idem.idem_migration where name >= '0013'`);
    const runs = async () => (await query<{ n: number }>(db.url, `select count(*)::int as n from idem.runs`))[0]!.n;
    const before = await runs();
    const runners = await Promise.all(Array.from({ length: 4 }, () => Runner.connect({ connectionString: db.url })));
    await Promise.all(runners.map((r) => r.close()));
    expect(await query(db.url, `select name from idem.idem_migration where name like '0013%'`)).toEqual([{ name: '0013_runs_open_idx' }]);
    expect(await query(db.url, `select indexdef from pg_indexes where schemaname = 'idem' and indexname = 'runs_open_idx'`)).toEqual([
      { indexdef: "CREATE INDEX runs_open_idx ON idem.runs USING btree (id, status) WHERE (status <> ALL (ARRAY['succeeded'::text, 'cancelled'::text]))" },
    ]);
    expect(await runs()).toBe(before);
  });
});

describe('a chunk that fails for good at --concurrency > 1', () => {
  it('lets the chunks in flight finish, starts no new one, and the rerun resumes', async () => {
    const key = 'permanent-parallel';
    await query(db.url, `insert into fail_chunks values ('c0002', null, null)`);
    // All three first chunks block on uncommitted rows of the test's own transactions (their
    // upserts wait on the unique key), so all three are in flight, deterministically, before
    // c0002 may fail: c0001 and c0003 on one blocker, c0002 on another that is let go first.
    const [inFlight, failing] = [new pg.Client({ connectionString: db.url }), new pg.Client({ connectionString: db.url })];
    await Promise.all([inFlight.connect(), failing.connect()]);
    await inFlight.query('begin');
    await inFlight.query(`insert into counted_state (run_key, chunk_key, value) values ($1, 'c0001', -1), ($1, 'c0003', -1)`, [key]);
    await failing.query('begin');
    await failing.query(`insert into counted_state (run_key, chunk_key, value) values ($1, 'c0002', -1)`, [key]);
    const running = runner.run(counted, { key, params: { chunks: 10 }, concurrency: 3 }).then(() => null, (e: unknown) => e);
    const waiting = () => lockWaiters(db.url, 'idem');
    try {
      await waitFor(async () => (await waiting()) === 3, 'c0001, c0002 and c0003 to wait on the blockers');
      await failing.query('rollback');
      await waitFor(async () => (await query(db.url, `select c.error from idem.chunks c join idem.runs r on r.id = c.run_id where r.run_key = $1 and c.key = 'c0002' and c.error is not null`, [key])).length > 0, 'c0002 to fail');
      expect(await waiting()).toBe(2);
    } finally {
      await failing.query('rollback').catch(() => {});
      await inFlight.query('rollback');
      await Promise.all([inFlight.end(), failing.end()]);
    }
    const err = await running;
    expect(err).toBeInstanceOf(RunFailedError);
    expect((await runRow(db.url, 'counted', key)).error).toMatchObject({ step: 'work', chunk: 'c0002', tries: 1 });
    // The two chunks in flight committed; none after c0003 started, and c0002's work rolled back.
    expect(await workCounts(db.url, key)).toEqual(new Map([['c0001', 1], ['c0003', 1]]));
    await query(db.url, `delete from fail_chunks`);
    const again = await runner.run(counted, { key, params: { chunks: 10 }, concurrency: 3 });
    expect(again).toMatchObject({ status: 'succeeded', attempt: 2, executed: 8 + 1 }); // c0002, c0004..c0010, finish
    await expectConverged(key, 10);
  });
});

describe('ctx.signal, observed from inside a job', () => {
  const watch = (key: string, extra: string[] = []) => [...extra, '--jobs-dir', MORE_JOBS, '--log-level', 'warn', 'run', 'signal-watch', '--key', key];
  const started = (child: ReturnType<typeof spawnCli>) => waitFor(async () => child.stderr().includes('signal-watch: chunk started'), 'the chunk to start');

  it('aborts at the shutdown deadline with the interruption as its reason', async () => {
    const child = spawnCli(watch('sig-deadline', ['--shutdown-timeout', '1']), { url: db.url, timeoutMs: 40_000 });
    await started(child);
    child.child.kill('SIGTERM');
    const res = await child.done;
    expect(res.timedOut, res.stderr).toBe(false);
    expect(res.code, res.stderr).toBe(143);
    expect(res.stderr).toContain('signal-watch: ctx.signal aborted: InterruptedError: interrupted by SIGTERM');
  }, 90_000);

  it('aborts when the lock session is lost, with the lost lock as its reason', async () => {
    const child = spawnCli(watch('sig-lock'), { url: db.url, timeoutMs: 40_000 });
    await started(child);
    const [holder] = await query<{ pid: number }>(db.url, `select pid from pg_stat_activity where datname = current_database() and application_name like 'idem-lock %'`);
    await query(db.url, 'select pg_terminate_backend($1)', [holder!.pid]);
    const res = await child.done;
    expect(res.timedOut, res.stderr).toBe(false);
    expect(res.code, res.stderr).toBe(69);
    expect(res.stderr).toMatch(/signal-watch: ctx\.signal aborted: LockLostError: .*lost the advisory lock/);
    // The log says what happened: the lock's session ended. No other attempt took the run over
    // (it said "lost the run to another attempt" after every server restart).
    expect(res.stderr).not.toMatch(/another attempt/);
    expect(await query(db.url, `select attempt from idem.runs where run_key = 'sig-lock'`)).toEqual([{ attempt: 1 }]);
  }, 90_000);
});

describe('a signal while a command starts', () => {
  it('SIGTERM before the run began exits 143 with one line, not killed by the signal, and nothing is recorded', async () => {
    // Loading jobs, reaching the database, starting an embedded server: until the command installs
    // its graceful handlers, Node's default ended the process by the signal (no exit code, no
    // cleanup), where the exit-code table says 143. A job file that takes its time to load holds
    // the command there.
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-slow-load-'));
    try {
      await writeFile(
        path.join(dir, 'slow-load.mjs'),
        `process.stderr.write('slow-load: loading\\n');\nawait new Promise((r) => setTimeout(r, 30_000));\nexport default { name: 'slow-load', steps: [{ name: 'a', run: async () => {} }] };\n`,
      );
      const child = spawnCli(['--jobs-dir', dir, 'run', 'slow-load'], { url: db.url, timeoutMs: 40_000 });
      await waitFor(async () => child.stderr().includes('slow-load: loading'), 'the job file to start loading');
      child.child.kill('SIGTERM');
      const res = await child.done;
      expect(res.timedOut, res.stderr).toBe(false);
      expect(res.code, res.stderr).toBe(143);
      expect(res.stderr.trim().split('\n').at(-1)).toBe('idem: stopped by SIGTERM');
      expect(await query(db.url, `select count(*)::int as n from idem.runs where job = 'slow-load'`)).toEqual([{ n: 0 }]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  }, 60_000);

  it('SIGTERM while the CLI itself still loads exits 143 with one line, not killed by the signal', async () => {
    // Before any command starts (idem's own modules loading: ~0.1-0.5 s of every start) there was
    // no handler at all. A loader hook holds the import of dist/cli.js, and says when it does.
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-slow-cli-'));
    try {
      const { marker, importArg } = await holdCliLoading(dir, 20_000);
      const child = spawn(process.execPath, ['--import', importArg, BIN, 'status'], { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, DATABASE_URL: db.url } });
      let stderr = '';
      child.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
      const exited = new Promise<[number | null, string | null]>((resolve) => child.on('close', (code, signal) => resolve([code, signal])));
      await waitFor(async () => existsSync(marker), 'the CLI to start loading', { timeoutMs: 15_000 });
      child.kill('SIGTERM');
      expect(await exited, stderr).toEqual([143, null]);
      expect(stderr.trim()).toBe('idem: stopped by SIGTERM');
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  }, 60_000);
});

describe('a signal while a command with --json starts', () => {
  const interrupted = (sig: string, exitCode: number) => ({ status: 'error', exitCode, code: 'idem.interrupted', error: `stopped by ${sig} while starting; run the same command again` });

  it('run, run --catch-up, finalize and migrate print their JSON error object on stdout (exit 143/130), as a signal after the start does', async () => {
    // A job file (and a migration) that takes its time to load holds each command in its start-up.
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-slow-json-'));
    const slow = (name: string) =>
      `process.stderr.write('slow-load: loading\\n');\nawait new Promise((r) => setTimeout(r, 30_000));\nexport default { name: '${name}', schedule: '0 * * * *', steps: [{ name: 'a', run: async () => {} }] };\n`;
    try {
      await writeFile(path.join(dir, 'slow-json.mjs'), slow('slow-json'));
      await import('node:fs/promises').then((fs) => fs.mkdir(path.join(dir, 'migrations')));
      await writeFile(path.join(dir, 'migrations', '0001_slow_json.mjs'), slow('0001_slow_json').replace("schedule: '0 * * * *', ", ''));
      const dirs = ['--jobs-dir', dir, '--migrations-dir', path.join(dir, 'migrations')];
      const cases: Array<[string[], NodeJS.Signals, number, unknown]> = [
        [['run', 'slow-json', '--key', 'sj1', '--json'], 'SIGTERM', 143, { job: 'slow-json', runKey: 'sj1', ...interrupted('SIGTERM', 143) }],
        [['run', 'slow-json', '--key', 'sj2', '--json'], 'SIGINT', 130, { job: 'slow-json', runKey: 'sj2', ...interrupted('SIGINT', 130) }],
        [['run', 'slow-json', '--catch-up', '2', '--json'], 'SIGTERM', 143, [{ job: 'slow-json', runKey: null, ...interrupted('SIGTERM', 143) }]],
        [['finalize', 'slow-json', '--key', 'fz', '--json'], 'SIGTERM', 143, { job: 'slow-json', runKey: 'fz', ...interrupted('SIGTERM', 143) }],
        [['migrate', '--json'], 'SIGTERM', 143, [{ runKey: null, job: null, ...interrupted('SIGTERM', 143) }]],
      ];
      for (const [args, sig, code, json] of cases) {
        const child = spawnCli([...dirs, ...args], { url: db.url, timeoutMs: 40_000 });
        await waitFor(async () => child.stderr().includes('slow-load: loading'), 'the file to start loading');
        child.child.kill(sig);
        const res = await child.done;
        expect({ args, timedOut: res.timedOut, code: res.code, last: res.stderr.trim().split('\n').at(-1) }).toEqual({ args, timedOut: false, code, last: `idem: stopped by ${sig}` });
        expect(res.stdout.split('\n').filter(Boolean).map((l) => JSON.parse(l))).toEqual([json]);
      }
      expect(await query(db.url, `select count(*)::int as n from idem.runs where job in ('slow-json', '0001_slow_json')`)).toEqual([{ n: 0 }]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  }, 120_000);

  it('while the CLI itself still loads, run --json prints its error object too', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-slow-cli-json-'));
    try {
      const { marker, importArg } = await holdCliLoading(dir, 3_000);
      const child = spawn(process.execPath, ['--import', importArg, BIN, ...FIXTURE_DIRS, 'run', 'counted', '--key', 'early-json', '--json'], { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, DATABASE_URL: db.url } });
      let stdout = '';
      let stderr = '';
      child.stdout.setEncoding('utf8').on('data', (d: string) => (stdout += d));
      child.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d));
      const exited = new Promise<[number | null, string | null]>((resolve) => child.on('close', (code, signal) => resolve([code, signal])));
      await waitFor(async () => existsSync(marker), 'the CLI to start loading', { timeoutMs: 15_000 });
      child.kill('SIGTERM');
      expect(await exited, stderr).toEqual([143, null]);
      expect(stderr.trim()).toBe('idem: stopped by SIGTERM');
      expect(stdout.split('\n').filter(Boolean).map((l) => JSON.parse(l))).toEqual([{ job: 'counted', runKey: 'early-json', ...interrupted('SIGTERM', 143) }]);
      expect(await query(db.url, `select count(*)::int as n from idem.runs where run_key = 'early-json'`)).toEqual([{ n: 0 }]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  }, 60_000);
});

describe('the retryable codes', () => {
  it.each(['57P02', '57P03', 'ECONNREFUSED'])('%s is retried in a fresh transaction and the chunk commits once', async (code) => {
    const key = `retry-${code}`;
    await query(db.url, `insert into fail_chunks values ('c0002', $1, 2)`, [code]);
    await query(db.url, `select setval('fixture_tries', 1, false)`);
    try {
      const out = await runner.run(counted, { key, params: { chunks: 3 } });
      expect(out).toMatchObject({ status: 'succeeded', attempt: 1 });
      // Two failed tries and the one that committed.
      expect(await query(db.url, 'select last_value::int as n from fixture_tries')).toEqual([{ n: 3 }]);
      await expectConverged(key, 3);
    } finally {
      await query(db.url, `delete from fail_chunks`);
    }
  });
});

describe('--retry-skipped on a shared run', () => {
  it('only the worker that starts the attempt makes skipped chunks pending again; a joiner does not undo the skips made since', async () => {
    const job = defineJob({
      name: 'skippy-rejoin',
      steps: [
        {
          name: 'work',
          maxFailedChunks: 2,
          retry: { attempts: 1 },
          chunks: () => ({ chunks: ['c0001', 'c0002', 'c0003'].map((key) => ({ key })), next: null }),
          async run(ctx, chunk: { key: string }) {
            if (chunk.key === 'c0003') return;
            await sql`select pg_sleep(0.8)`.execute(ctx.db);
            throw new Error(`injected failure in chunk ${chunk.key}`);
          },
        },
      ],
    });
    const attempts = async () =>
      Object.fromEntries(
        (await query<{ key: string; attempts: number }>(db.url, `select c.key, c.attempts from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'skippy-rejoin' and c.skipped_at is not null order by c.key`)).map((r) => [r.key, r.attempts]),
      );
    expect((await runner.run(job, { key: 'rejoin' })).summary).toMatchObject({ skipped: 2 });
    expect(await attempts()).toEqual({ c0001: 1, c0002: 1 });
    const second = await Runner.connect({ connectionString: db.url });
    try {
      const first = runner.run(job, { key: 'rejoin', join: true, retrySkipped: true });
      // Join once the first worker has tried c0001 again and skipped it (while it works on c0002).
      await waitFor(async () => ((await attempts()).c0001 === 2 ? true : undefined), 'c0001 skipped again');
      const joined = second.run(job, { key: 'rejoin', join: true, retrySkipped: true });
      const [a, b] = await Promise.all([first, joined]);
      expect(a.summary).toMatchObject({ skipped: 2 });
      expect(b.summary).toMatchObject({ skipped: 2 });
      // c0001, skipped again before the second worker joined, was not retried once more by it.
      // (c0002 may be tried twice: the joiner, finding nothing free, waits on its row lock and
      // claims it the moment its failed try rolls back, before the skip is recorded.)
      const after = await attempts();
      expect(after.c0001).toBe(2);
      expect(after.c0002).toBeGreaterThanOrEqual(2);
      expect(after.c0002).toBeLessThanOrEqual(3);
    } finally {
      await second.close();
    }
  });
});

describe('a chunk that fails for good in one of the workers sharing a run', () => {
  it('the first failure stays the recorded one; a worker that hits the same chunk after it reports the run failed elsewhere and records nothing more', async () => {
    const job = defineJob({
      name: 'shared-fail',
      steps: [
        {
          name: 'work',
          retry: { attempts: 1 },
          chunks: () => ({ chunks: ['c0001', 'c0002', 'c0003'].map((key) => ({ key })), next: null }),
          async run(ctx, chunk: { key: string }) {
            if (chunk.key !== 'c0001') return;
            await sql`select pg_sleep(0.8)`.execute(ctx.db);
            throw new Error(`injected failure in chunk ${chunk.key}`);
          },
        },
      ],
    });
    const second = await Runner.connect({ connectionString: db.url });
    try {
      // Neither polls the run row during the test: what they do is what their own failures make them do.
      const first = runner.run(job, { key: 'shared-fail', join: true, controlPollMs: 60_000 }).then(() => null, (e: unknown) => e);
      await waitFor(async () => (await query(db.url, `select 1 from idem.runs where job = 'shared-fail' and status = 'running'`)).length > 0, 'the first worker to start the run');
      // One worker takes c0001; the other finds c0002 and c0003, then waits on c0001's row lock and
      // claims it the moment the failed try rolls back.
      const joined = second.run(job, { key: 'shared-fail', join: true, controlPollMs: 60_000 }).then(() => null, (e: unknown) => e);
      const recorded = await waitFor(async () => (await runRow(db.url, 'shared-fail', 'shared-fail')).error ?? undefined, 'the first failure recorded');
      expect(recorded).toMatchObject({ chunk: 'c0001', tries: 1 });
      const errors = (await Promise.all([first, joined])) as Error[];
      expect(errors.every((e) => e instanceof RunFailedError)).toBe(true);
      const elsewhere = errors.filter((e) => /failed in another process sharing the run/.test(e.message));
      const own = errors.filter((e) => /failed in step "work", chunk c0001 after 1 try/.test(e.message));
      expect([own.length, elsewhere.length]).toEqual([1, 1]);
      expect((await runRow(db.url, 'shared-fail', 'shared-fail')).error).toEqual(recorded);
    } finally {
      await second.close();
    }
  });
});

describe('a chunk or step that throws null, undefined or rejects with nothing', () => {
  // `throw null` is as much a thrown value as `throw 'x'`: it fails (or is skipped) in its own step
  // and chunk, never in "(runner)" because the runner read `.code` of it.
  const throwers = {
    null: () => {
      throw null;
    },
    undefined: () => {
      throw undefined;
    },
    'Promise.reject()': () => Promise.reject(),
  } as const;
  const thrower = (name: string, how: () => unknown, maxFailedChunks: number) =>
    defineJob({
      name,
      steps: [
        {
          name: 'work',
          maxFailedChunks,
          chunks: () => ({ chunks: ['c1', 'c2', 'c3'].map((key) => ({ key })), next: null }),
          async run(_ctx, chunk: { key: string }) {
            if (chunk.key === 'c2') await how();
          },
        },
        { name: 'after', run: () => how() },
      ],
    });

  for (const [what, how] of Object.entries(throwers)) {
    const shown = what === 'null' ? 'null' : 'undefined';
    const id = what === 'null' ? 'null' : what === 'undefined' ? 'undefined' : 'reject';
    it(`${what} in a chunk fails the run in that chunk`, async () => {
      const job = thrower(`throws-${id}`, how, 0);
      const err = await runner.run(job, { key: 'k' }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(RunFailedError);
      expect((err as RunFailedError).message).toBe(`job "throws-${id}" failed in step "work", chunk c2 after 1 try: ${shown}; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)`);
      expect((await runRow(db.url, `throws-${id}`, 'k')).error).toMatchObject({ step: 'work', chunk: 'c2', tries: 1, message: shown });
    });

    it(`${what} in a chunk is skipped under maxFailedChunks; in a step without chunks it fails that step`, async () => {
      const job = thrower(`skips-${id}`, how, 1);
      const err = await runner.run(job, { key: 'k' }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(RunFailedError);
      const [status] = await runner.status(`skips-${id}`);
      expect(status!.skipped).toEqual([expect.objectContaining({ step: 'work', key: 'c2', error: shown })]);
      expect((await runRow(db.url, `skips-${id}`, 'k')).error).toMatchObject({ step: 'after', chunk: null, tries: 1, message: shown });
    });
  }
});

/**
 * A loader hook (in `dir`) that holds the import of dist/cli.js for `ms`, so a test can signal the
 * CLI while it still loads: `marker` appears when the hold starts; pass `importArg` to node's --import.
 */
async function holdCliLoading(dir: string, ms: number): Promise<{ marker: string; importArg: string }> {
  const marker = path.join(dir, 'holding');
  await writeFile(
    path.join(dir, 'hooks.mjs'),
    `import { writeFileSync } from 'node:fs';\nexport async function resolve(specifier, context, next) {\n  if (specifier.endsWith('/dist/cli.js')) { writeFileSync(${JSON.stringify(marker)}, ''); await new Promise((r) => setTimeout(r, ${ms})); }\n  return next(specifier, context);\n}\n`,
  );
  await writeFile(path.join(dir, 'register.mjs'), `import { register } from 'node:module';\nregister(${JSON.stringify(pathToFileURL(path.join(dir, 'hooks.mjs')).href)});\n`);
  return { marker, importArg: pathToFileURL(path.join(dir, 'register.mjs')).href };
}
