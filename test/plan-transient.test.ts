import pg from 'pg';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, IdemError, InterruptedError, keyRange, Runner, sql, type ChunkSource, type KeyRangeChunk } from '../src/index.ts';
import { FIXTURE_DIRS, killLeftovers, query, runCli } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

// Black-box round (B11, C1): a transient error while a window was planned (keyRange's query cut
// short by the role's lock_timeout, a custom source's 40001) was tried again only by the runner's
// own bookkeeping retry, silently, with the default budget whatever the step's `retry` said, and
// when that ran out the run failed "in step "s" after 1 try" with pg's bare text: planning is now
// retried as a chunk is (the step's policy, "transient error, retrying planning"), and a step whose
// planning keeps failing says so, after its tries.

const testDb = useTestDatabase({
  prepare: (url) =>
    query(
      url,
      `create table pt_seen (key text primary key, n integer not null default 1);
       create table pt_items (id integer primary key);
       insert into pt_items select generate_series(1, 100)`,
    ),
});
let url: string;
beforeAll(() => {
  url = testDb.url;
});
/** A database of its own with the fixture tables (items, work_log), for the CLI's `ranged` job. */
const fixtureDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
afterAll(killLeftovers);

/** A Runner of its own whose log lines are kept, on `url` (connection options in it apply). */
async function runnerWithLog(connectionString: string): Promise<{ runner: Runner; lines: () => Array<{ msg: string; [k: string]: unknown }> }> {
  const kept: string[] = [];
  const runner = await Runner.connect({ connectionString, log: pino({ level: 'debug' }, { write: (s: string) => void kept.push(s) }) });
  return { runner, lines: () => kept.map((l) => JSON.parse(l) as { msg: string }) };
}

const withOptions = (options: string) => {
  const u = new URL(url);
  u.searchParams.set('options', options);
  return u.toString();
};

const record = (prefix: string) => async ({ db }: { db: any }, c: { n?: number; lo?: number; key: string }) =>
  void (await sql`insert into pt_seen (key) values (${prefix + c.key}) on conflict (key) do update set n = pt_seen.n + 1`.execute(db));

/** Every chunk key of `prefix` recorded exactly once, `count` of them. */
async function expectEveryChunkOnce(prefix: string, count: number): Promise<void> {
  expect(await query(url, `select count(*)::int as n, max(n)::int as most from pt_seen where key like $1 || '%'`, [prefix])).toEqual([{ n: count, most: 1 }]);
}

/** A source of 30 chunks in windows of 10 whose query raises `code` on its 2nd window, `failures` times. */
function failingSource(code: string, failures: number): { source: ChunkSource; calls: () => number } {
  let calls = 0;
  let failed = 0;
  const source: ChunkSource = async (cursor, ctx) => {
    calls++;
    const at = (cursor as number | null) ?? 0;
    if (at === 10 && failed < failures) {
      failed++;
      await sql`do $$ begin raise exception 'src transient' using errcode = '${sql.raw(code)}'; end $$`.execute(ctx.db);
    }
    return { chunks: Array.from({ length: 10 }, (_, i) => ({ key: `k${at + i}` })), next: at + 10 >= 30 ? null : at + 10 };
  };
  return { source, calls: () => calls };
}

/** A session holding an ACCESS EXCLUSIVE lock on pt_items until `release` (a COMMIT; its connection closed). */
async function lockItems(): Promise<{ release(): Promise<void> }> {
  const holder = new pg.Client({ connectionString: url });
  await holder.connect();
  await holder.query('begin');
  await holder.query('lock table pt_items in access exclusive mode');
  let released: Promise<void> | undefined;
  return { release: () => (released ??= holder.query('commit').then(() => holder.end())) };
}

describe('a transient error while a window is planned', () => {
  it('a custom source raising 40001 once: its planning is tried again after a backoff, logged, and the run succeeds with every chunk once', async () => {
    const { runner, lines } = await runnerWithLog(url);
    try {
      const { source, calls } = failingSource('40001', 1);
      const job = defineJob({ name: 'pt-once', steps: [{ name: 's', chunks: source, run: record('once:') }] });
      const out = await runner.run(job, { key: 'once' });
      expect(out.summary?.steps[0]).toEqual({ name: 's', chunks: 30 });
      // Windows at 0, 10 (failed), 10 again, 20.
      expect(calls()).toBe(4);
      await expectEveryChunkOnce('once:', 30);
      const retried = lines().filter((l) => l.msg === 'transient error, retrying planning');
      expect(retried).toHaveLength(1);
      expect(retried[0]).toMatchObject({ step: 's', tries: 1, err: { code: '40001' } });
      expect(await query(url, `select status from idem.runs where job = 'pt-once'`)).toEqual([{ status: 'succeeded' }]);
    } finally {
      await runner.close();
    }
  });

  it("keyRange's planning query cut short by lock_timeout while another session locks the table: retried under the step's policy, the run succeeds with every chunk once", async () => {
    const { runner, lines } = await runnerWithLog(withOptions('-c lock_timeout=50'));
    const lock = await lockItems();
    try {
      // 2.5 s: past five tries of the default policy (5 × 50 ms + at most 1.5 s of backoff), within the step's 100.
      const release = setTimeout(() => void lock.release(), 2_500);
      const job = defineJob({
        name: 'pt-locked',
        steps: [{ name: 'ranges', retry: { attempts: 100, base: 100, max: 200 }, chunks: keyRange({ table: 'pt_items', column: 'id', size: 10 }), run: async (ctx, c: KeyRangeChunk) => record('locked:')(ctx, c) }],
      });
      const out = await runner.run(job, { key: 'locked' }).finally(() => clearTimeout(release));
      expect(out.summary?.steps[0]).toEqual({ name: 'ranges', chunks: 10 });
      await expectEveryChunkOnce('locked:', 10);
      const retried = lines().filter((l) => l.msg === 'transient error, retrying planning');
      expect(retried.length).toBeGreaterThan(5);
      expect(retried[0]).toMatchObject({ step: 'ranges', tries: 1, err: { code: '55P03' } });
    } finally {
      await lock.release();
      await runner.close();
    }
  });

  it('a source that keeps failing fails the step after its tries, saying it was the planning of the step', async () => {
    const { runner, lines } = await runnerWithLog(url);
    try {
      const { source, calls } = failingSource('40001', Infinity);
      const job = defineJob({ name: 'pt-always', steps: [{ name: 's', retry: { attempts: 3, base: 10 }, chunks: source, run: record('always:') }] });
      const err = await runner.run(job, { key: 'always' }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(IdemError);
      expect([(err as IdemError).code, (err as Error).message]).toEqual([
        'idem.runFailed',
        expect.stringMatching(/^job "pt-always" failed in step "s" after 3 tries: planning its chunks failed: src transient; fix the cause/),
      ]);
      // The first window, then three tries of the second.
      expect(calls()).toBe(4);
      expect(lines().filter((l) => l.msg === 'transient error, retrying planning')).toHaveLength(2);
      expect(await query(url, `select status, error->>'step' as step, (error->>'tries')::int as tries from idem.runs where job = 'pt-always'`)).toEqual([{ status: 'failed', step: 's', tries: 3 }]);
      // Nothing of the second window was planned, and no chunk ran twice (the run fails fast: not
      // every chunk of the first window need have run).
      expect(await query(url, `select s.planned, s.planned_all from idem.steps s join idem.runs r on r.id = s.run_id where r.job = 'pt-always'`)).toEqual([{ planned: 10, planned_all: false }]);
      expect(await query(url, `select count(*)::int as n from pt_seen where key like 'always:%' and n <> 1`)).toEqual([{ n: 0 }]);
    } finally {
      await runner.close();
    }
  });

  it("keyRange's planning cut short by lock_timeout past its tries: the run fails naming the planning and the lock_timeout, with its fix", async () => {
    const { runner } = await runnerWithLog(withOptions('-c lock_timeout=50'));
    const lock = await lockItems();
    try {
      const job = defineJob({ name: 'pt-locked-out', steps: [{ name: 'ranges', retry: { attempts: 2, base: 10 }, chunks: keyRange({ table: 'pt_items', column: 'id', size: 10 }), run() {} }] });
      const err = await runner.run(job, { key: 'out' }).catch((e: unknown) => e);
      expect((err as Error).message).toMatch(
        /^job "pt-locked-out" failed in step "ranges" after 2 tries: planning its chunks failed: canceling statement due to lock timeout \(the lock_timeout set by -c lock_timeout in the connection string's options, or by the job, cut short a wait for a lock another session held: let that session finish first, or raise or remove -c lock_timeout in the connection string's options \(a setting there overrides the role's and the database's\)\); fix the cause/,
      );
      expect(await query(url, `select status from idem.runs where job = 'pt-locked-out'`)).toEqual([{ status: 'failed' }]);
    } finally {
      await lock.release();
      await runner.close();
    }
  });

  it("a chunk source's query cut short by the statement_timeout: the run fails naming the planning and the setting, with a fix that fits planning (no SET LOCAL in a chunk)", async () => {
    const { runner } = await runnerWithLog(withOptions('-c statement_timeout=200'));
    try {
      const source: ChunkSource = async (cursor, ctx) => {
        const at = (cursor as number | null) ?? 0;
        if (at === 10) await sql`select pg_sleep(1)`.execute(ctx.db);
        return { chunks: Array.from({ length: 10 }, (_, i) => ({ key: `k${at + i}` })), next: at + 10 >= 30 ? null : at + 10 };
      };
      const job = defineJob({ name: 'pt-slow-source', steps: [{ name: 's', chunks: source, run() {} }] });
      const err = await runner.run(job, { key: 'slow' }).catch((e: unknown) => e);
      expect((err as Error).message).toMatch(
        /^job "pt-slow-source" failed in step "s" after 1 try: planning its chunks failed: canceling statement due to statement timeout \(the statement_timeout set by -c statement_timeout in the connection string's options, or by the job, cut it short: raise or remove -c statement_timeout in the connection string's options \(a setting there overrides the role's and the database's\)\); fix the cause/,
      );
      expect(await query(url, `select status from idem.runs where job = 'pt-slow-source'`)).toEqual([{ status: 'failed' }]);
    } finally {
      await runner.close();
    }
  });

  it('a worker told to stop while its planning backs off stops at once: the run interrupted, not failed, and nothing of that window planned', async () => {
    const { runner, lines } = await runnerWithLog(url);
    try {
      const { source } = failingSource('40001', Infinity);
      const job = defineJob({ name: 'pt-stopped', steps: [{ name: 's', retry: { attempts: 100, base: 1_000, max: 1_000 }, chunks: source, run: record('stopped:') }] });
      const stop = new AbortController();
      const seen = setInterval(() => lines().some((l) => l.msg === 'transient error, retrying planning') && stop.abort(new InterruptedError('SIGTERM')), 10);
      const started = Date.now();
      const err = await runner
        .run(job, { key: 'stopped', signal: stop.signal })
        .catch((e: unknown) => e)
        .finally(() => clearInterval(seen));
      expect(err).toBeInstanceOf(InterruptedError);
      // Well within the 100 tries of a second each.
      expect(Date.now() - started).toBeLessThan(5_000);
      expect(await query(url, `select r.status, s.planned from idem.runs r join idem.steps s on s.run_id = r.id where r.job = 'pt-stopped'`)).toEqual([{ status: 'interrupted', planned: 10 }]);
    } finally {
      await runner.close();
    }
  });

  it("a chunk's lock_timeout past its tries: the run fails with where the lock_timeout is set and how to raise it, in the chunk too", async () => {
    const { runner } = await runnerWithLog(withOptions('-c lock_timeout=50'));
    const lock = await lockItems();
    try {
      const job = defineJob({ name: 'pt-chunk-locked', steps: [{ name: 'w', retry: { attempts: 2, base: 10 }, run: async ({ db }) => void (await sql`select count(*) from pt_items`.execute(db)) }] });
      const err = await runner.run(job, { key: 'chunk' }).catch((e: unknown) => e);
      expect((err as Error).message).toMatch(
        /^job "pt-chunk-locked" failed in step "w" after 2 tries: canceling statement due to lock timeout \(the lock_timeout set by -c lock_timeout in the connection string's options, or by the job, cut short a wait for a lock another session held: let that session finish first, or raise or remove -c lock_timeout in the connection string's options \(a setting there overrides the role's and the database's\), or raise it in the chunk \(SET LOCAL lock_timeout\)\); fix the cause/,
      );
      expect(await query(url, `select status, error->>'message' as message from idem.runs where job = 'pt-chunk-locked'`)).toEqual([{ status: 'failed', message: expect.stringContaining('(SET LOCAL lock_timeout)') }]);
    } finally {
      await lock.release();
      await runner.close();
    }
  });

  it('two --join workers planning the same step, each meeting 40001 now and then: no window planned twice, every chunk once', async () => {
    const a = await runnerWithLog(url);
    const b = await runnerWithLog(url);
    try {
      let calls = 0;
      // Every third call fails: both workers' planners meet it, at different windows.
      const source: ChunkSource = async (cursor, ctx) => {
        const at = (cursor as number | null) ?? 0;
        if (++calls % 3 === 0) await sql`do $$ begin raise exception 'src transient' using errcode = '40001'; end $$`.execute(ctx.db);
        return { chunks: Array.from({ length: 5 }, (_, i) => ({ key: `k${at + i}` })), next: at + 5 >= 100 ? null : at + 5 };
      };
      const job = defineJob({
        name: 'pt-joined',
        steps: [{ name: 's', retry: { attempts: 10, base: 20 }, chunks: source, run: async (ctx, c: { key: string }) => (await sql`select pg_sleep(0.01)`.execute(ctx.db), record('joined:')(ctx, c)) }],
      });
      const outs = await Promise.all([a.runner.run(job, { key: 'joined', join: true, concurrency: 2 }), b.runner.run(job, { key: 'joined', join: true, concurrency: 2 })]);
      expect(outs.map((o) => o.summary?.steps[0])).toEqual([{ name: 's', chunks: 100 }, { name: 's', chunks: 100 }]);
      await expectEveryChunkOnce('joined:', 100);
      expect(await query(url, `select count(*)::int as n, count(distinct c.key)::int as keys, max(c.seq)::int as last from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'pt-joined'`)).toEqual([{ n: 100, keys: 100, last: 100 }]);
      expect([...a.lines(), ...b.lines()].filter((l) => l.msg === 'transient error, retrying planning').length).toBeGreaterThan(0);
      // Both worked on the run.
      expect([a, b].map((w) => w.lines().find((l) => l.msg === 'run started' || l.msg === 'joined the run as another worker')?.msg).sort()).toEqual(['joined the run as another worker', 'run started']);
    } finally {
      await a.runner.close();
      await b.runner.close();
    }
  });

  it("the CLI, the role's lock_timeout cutting keyRange's planning short past its tries: exit 1, the planning and the setting named with its fix, nothing of the step planned", async () => {
    const db = fixtureDb.url;
    await query(db, `insert into items (id, value) select g, g from generate_series(1, 50) g`);
    const { role, database } = (await query<{ role: string; database: string }>(db, 'select current_user as role, current_database() as database'))[0]!;
    await query(db, `alter role "${role}" in database "${database}" set lock_timeout = '100ms'`);
    const holder = new pg.Client({ connectionString: db });
    await holder.connect();
    try {
      await holder.query('set lock_timeout = 0');
      await holder.query('begin');
      await holder.query('lock table items in access exclusive mode');
      // Held for the whole run: 5 tries (the default) of 100 ms each and at most 1.5 s of backoff.
      const r = await runCli([...FIXTURE_DIRS, 'run', 'ranged', '--key', 'lk2'], { url: db, timeoutMs: 60_000 });
      expect(r.code, r.stderr).toBe(1);
      const last = r.stderr.trim().split('\n').at(-1)!;
      expect(last).toMatch(
        /^idem: error: job "ranged" failed in step "double" after 5 tries: planning its chunks failed: canceling statement due to lock timeout \(the lock_timeout set for the role or database, or by the job, cut short a wait for a lock another session held: let that session finish first, or raise it for the role idem connects as \(ALTER ROLE \S+ SET lock_timeout = '5min'\) or reset it\); fix the cause and run the same command again/,
      );
      expect(r.stderr.match(/transient error, retrying planning/g)).toHaveLength(4);
      await holder.query('rollback');
      expect(await query(db, `select r.status, s.planned, (r.error->>'tries')::int as tries from idem.runs r join idem.steps s on s.run_id = r.id where r.run_key = 'lk2'`)).toEqual([{ status: 'failed', planned: 0, tries: 5 }]);
      expect(await query(db, `select count(*)::int as n from work_log where run_key = 'lk2'`)).toEqual([{ n: 0 }]);
    } finally {
      await holder.end();
      await query(db, `alter role "${role}" in database "${database}" reset lock_timeout`);
    }
  });
});
