import pg from 'pg';
import { beforeAll, describe, expect, it, vi } from 'vitest';
import pino from 'pino';
import { acquireAdvisoryLock } from '../src/advisory-lock.ts';
import { openDatabase } from '../src/database.ts';
import { defineJob, exitCodeOf, fingerprint, keyRange, RunFailedError, Runner, sql, type ChunkSource, type Job } from '../src/index.ts';
import { query, waitFor } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

// Issue 8 (correctness hardening): each test here failed on the code before its fix.

const testDb = useTestDatabase({ prepare: (url) => query(url, 'create table hits (item int primary key, n int not null)'), runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});

/** Items 1..6 in windows of two; with `dup`, the 4th chunk reuses the 1st chunk's key. */
function itemSource(dup: boolean): ChunkSource {
  return (cursor) => {
    const from = (cursor as number | null) ?? 1;
    const chunks = [from, from + 1].map((item) => ({ key: dup && item === 4 ? 'item-1' : `item-${item}`, item }));
    return { chunks, next: from + 2 > 6 ? null : from + 2 };
  };
}

/** Counts every execution of an item (a delta on purpose: a second commit of a chunk shows as n = 2). */
function itemsJob(name: string, dup: boolean): Job {
  return defineJob({
    name,
    steps: [
      {
        name: 'items',
        chunks: itemSource(dup),
        async run({ db }, chunk: { item: number }) {
          await sql`insert into hits (item, n) values (${chunk.item}, 1) on conflict (item) do update set n = hits.n + 1`.execute(db);
        },
      },
    ],
  });
}

describe('planning a window is all or nothing (item 1)', () => {
  it('a duplicate chunk key moves nothing, fails the run naming the key, and a fixed rerun processes every chunk once', async () => {
    await query(url, 'truncate hits');
    const err = await runner.run(itemsJob('dup-key', true), { key: 'k', planWindow: 2 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RunFailedError);
    expect((err as Error).message).toContain('"item-1"');
    expect((err as Error).message).toContain('chunk keys must be unique and stable');

    // The window [item-3, item-1(dup)] left no trace: not a chunk row, not the cursor, not the count.
    const [step] = await query<{ cursor: unknown; planned: number; planned_all: boolean }>(url,
      `select s.cursor, s.planned, s.planned_all from idem.steps s join idem.runs r on r.id = s.run_id where r.job = 'dup-key'`);
    expect(step).toEqual({ cursor: 3, planned: 2, planned_all: false });
    const keys = await query<{ key: string; seq: number }>(url,
      `select c.key, c.seq from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'dup-key' order by c.seq`);
    expect(keys).toEqual([{ key: 'item-1', seq: 1 }, { key: 'item-2', seq: 2 }]);

    // The source is fixed; the rerun resumes at the window that failed and does every item once.
    const outcome = await runner.run(itemsJob('dup-key', false), { key: 'k', planWindow: 2 });
    expect(outcome.status).toBe('succeeded');
    expect(outcome.summary?.chunks).toBe(6);
    const hits = await query<{ item: number; n: number }>(url, 'select item, n from hits order by item');
    expect(hits).toEqual([1, 2, 3, 4, 5, 6].map((item) => ({ item, n: 1 })));
    const seqs = await query<{ seq: number }>(url,
      `select c.seq from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'dup-key' order by c.seq`);
    expect(seqs.map((r) => r.seq)).toEqual([1, 2, 3, 4, 5, 6]);
  });
});

describe('the work pool fits the requested concurrency (item 2)', () => {
  const effectJob = defineJob({
    name: 'effect-at-pool-size',
    steps: [
      {
        name: 'mail',
        chunks: (cursor) => ({ chunks: [1, 2, 3, 4, 5, 6, 7, 8].map((i) => ({ key: `m${i}`, i })), next: null }),
        async run(ctx, chunk: { i: number }) {
          await sql`select pg_sleep(0.05)`.execute(ctx.db);
          await ctx.effect('send', () => ({ sent: chunk.i }));
        },
      },
    ],
  });

  it('a concurrency the pool cannot serve is refused at once with both numbers, and nothing is written', async () => {
    const small = await Runner.connect({ connectionString: url, poolSize: 4 });
    try {
      const err = await small.run(effectJob, { concurrency: 4 }).catch((e: unknown) => e);
      expect((err as Error).message).toBe('concurrency 4 needs a pool of at least 6 connections, but poolSize is 4; raise poolSize or lower concurrency');
      expect(exitCodeOf(err)).toBe(2);
      expect(await query(url, `select 1 from idem.runs where job = 'effect-at-pool-size'`)).toEqual([]);
      // The largest concurrency that fits runs with an effect in every chunk, and does not deadlock.
      const ok = await small.run(effectJob, { concurrency: 2 });
      expect(ok).toMatchObject({ status: 'succeeded', executed: 8 });
      expect(await query(url, `select count(*)::int as n from idem.effects e join idem.runs r on r.id = e.run_id where r.job = 'effect-at-pool-size' and e.status = 'done'`)).toEqual([{ n: 8 }]);
    } finally {
      await small.close();
    }
  });
});

describe('work sessions are set up before their first statement (dead networks)', () => {
  it('every connection of a burst carries idle_in_transaction_session_timeout, with nothing queued behind the setup', async () => {
    const warnings: string[] = [];
    const onWarning = (w: Error) => warnings.push(`${w.name}: ${w.message}`);
    process.on('warning', onWarning);
    const database = await openDatabase(url, { poolSize: 4, log: pino({ level: 'silent' }), idleInTransactionTimeoutMs: 45_000 });
    try {
      // 24 statements at once on 4 fresh connections: each must see the setting from its first statement on.
      const seen = await Promise.all(
        Array.from({ length: 24 }, () => database.pool.query<{ t: string; pid: number }>(`select current_setting('idle_in_transaction_session_timeout') as t, pg_backend_pid() as pid`)),
      );
      expect(new Set(seen.map((r) => r.rows[0]!.t))).toEqual(new Set(['45s']));
      expect(new Set(seen.map((r) => r.rows[0]!.pid)).size).toBeGreaterThan(1);
      await new Promise((r) => setImmediate(r));
      expect(warnings.filter((w) => w.startsWith('DeprecationWarning'))).toEqual([]);
    } finally {
      process.off('warning', onWarning);
      await database.close();
    }
  });
});

describe('operator actions are compare-and-set (item 3)', () => {
  const tiny = defineJob({ name: 'tiny', steps: [{ name: 'one', run: () => {} }] });

  it('a cancel that read the run as unfinished does not bring it back after it succeeded', async () => {
    await runner.run(tiny, { key: 'cas' });
    // The run as a crashed attempt leaves it: running, nobody holding its lock.
    await query(url, `update idem.runs set status = 'running', finished_at = null where job = 'tiny' and run_key = 'cas'`);
    const finisher = new pg.Client({ connectionString: url });
    await finisher.connect();
    try {
      // The run finishes (not yet committed) while the cancel is deciding.
      await finisher.query('begin');
      await finisher.query(`update idem.runs set status = 'succeeded', finished_at = now() where job = 'tiny' and run_key = 'cas'`);
      const cancelling = runner.cancel('tiny', 'cas').then(
        (r) => ({ ok: r }),
        (e: Error) => ({ err: e }),
      );
      await waitFor(async () => (await query(url, `select 1 from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock' and query like '%requested%'`)).length > 0 || undefined, 'the cancel to wait for the row lock');
      await finisher.query('commit');
      const outcome = await cancelling;
      expect('err' in outcome && outcome.err.message).toBe('run "cas" of job "tiny" had already succeeded (it changed while the request was made): nothing to cancel');
    } finally {
      await finisher.end();
    }
    expect(await query(url, `select status, requested from idem.runs where job = 'tiny' and run_key = 'cas'`)).toEqual([{ status: 'succeeded', requested: null }]);
  });
});

describe('the attempt bump is tied to holding the lock (item 5)', () => {
  it('a process whose lock session died cannot bump the attempt', async () => {
    const { run } = await runner.store.claimRun('bump', 'k', {}, fingerprint({}));
    const lock = await acquireAdvisoryLock({ connectionString: url, name: runner.jobLockName('bump'), what: 'job "bump"' });
    try {
      await query(url, 'select pg_terminate_backend($1)', [lock.pid]);
      const begun = await runner.store.beginAttempt(run.id, 'test:1', lock).catch(() => null);
      expect(begun).toBeNull();
    } finally {
      await lock.release();
    }
    expect(await query(url, `select attempt, status from idem.runs where id = $1`, [run.id])).toEqual([{ attempt: 0, status: 'pending' }]);
  });
});

describe('a process that was stalled past a lock check\'s deadline reads the answer before judging (issue 9)', () => {
  // SIGSTOP/SIGCONT, a long GC pause, or a chunk whose code blocks the event loop: the check's
  // answer arrived while the process could not read it, and on waking the deadline timer ran before
  // the socket was read. The lock was healthy, yet it counted as lost (exit 69).
  it('a check answered while the event loop was blocked past its deadline keeps the lock', async () => {
    const lock = await acquireAdvisoryLock({ connectionString: url, name: 'stall-check', what: 'job "stall"', checkIntervalMs: 60_000, checkTimeoutMs: 200 });
    try {
      const confirmed = lock.confirm(); // the check is on the wire now
      const until = Date.now() + 800; // the server answers within this; the deadline passes unseen
      while (Date.now() < until) {
        // blocked, as a stopped process or a synchronous chunk is
      }
      await confirmed;
      expect(lock.lost.aborted, String(lock.lost.reason)).toBe(false);
      // Still the same session, still holding the lock.
      const held = await query(url, `select count(*)::int as n from pg_locks where locktype = 'advisory' and pid = $1 and granted`, [lock.pid]);
      expect(held).toEqual([{ n: 1 }]);
    } finally {
      await lock.release();
    }
  });

  it('a check that is really unanswered still loses the lock by its deadline', async () => {
    const lock = await acquireAdvisoryLock({ connectionString: url, name: 'stall-dead', what: 'job "stall"', checkIntervalMs: 60_000, checkTimeoutMs: 300 });
    process.kill(lock.pid, 'SIGSTOP'); // its backend stops answering, as behind a dead network
    try {
      const t = performance.now();
      await lock.confirm();
      expect(lock.lost.aborted).toBe(true);
      expect(String(lock.lost.reason)).toMatch(/did not answer within 0.3s/);
      expect(performance.now() - t).toBeLessThan(5_000);
    } finally {
      process.kill(lock.pid, 'SIGCONT');
      await lock.release();
      await query(url, 'select pg_terminate_backend($1)', [lock.pid]).catch(() => {});
    }
  });
});

describe('the library refuses a run key the CLI refuses (issue 9)', () => {
  it('Runner.run and Runner.migrate refuse an empty, overlong, control-character or non-string key with exit 2, and write nothing', async () => {
    const job = defineJob({ name: 'lib-key', steps: [{ name: 'only', run: () => {} }] });
    const cases: Array<[unknown, RegExp]> = [
      ['', /key must be 1 to 200 characters \(got 0\)/],
      ['x'.repeat(201), /key must be 1 to 200 characters \(got 201\)/],
      ['2026-11-30\nevil', /key must not contain control characters \(it has U\+000A at character 11\)/],
      ['\u001b[31mred', /U\+001B at character 1/],
      [42, /key must be a string \(got number\)/],
    ];
    for (const [key, message] of cases) {
      const err = await runner.run(job, { key: key as string }).catch((e: unknown) => e);
      expect(exitCodeOf(err), `${JSON.stringify(key)}: ${String(err)}`).toBe(2);
      expect(String(err)).toMatch(message);
    }
    const mig = await runner.migrate([{ runKey: 'ok\tnot', job }]).catch((e: unknown) => e);
    expect(exitCodeOf(mig), String(mig)).toBe(2);
    expect(String(mig)).toMatch(/must not contain control characters \(it has U\+0009/);
    expect(await query(url, `select count(*)::int as n from idem.runs where job = 'lib-key'`)).toEqual([{ n: 0 }]);
    // 200 emoji are 200 characters, and fine.
    expect((await runner.run(job, { key: '🙂'.repeat(200) })).status).toBe('succeeded');
  });
});

describe('liveness is per run, not per job (item 6)', () => {
  let open!: () => void;
  const gate = new Promise<void>((resolve) => (open = resolve));
  const gated = defineJob({
    name: 'gated',
    steps: [{ name: 'wait', run: async (ctx) => { if (ctx.run.runKey === 'k2') await gate; } }],
  });

  it('a crashed run stays crashed while another run of the job is live, and pausing it takes effect at once', async () => {
    await runner.run(gated, { key: 'k1' });
    // k1 as a crash leaves it: running, its lock session gone.
    await query(url, `update idem.runs set status = 'running', finished_at = null where job = 'gated' and run_key = 'k1'`);
    const live = runner.run(gated, { key: 'k2' });
    try {
      const states = async () => Object.fromEntries((await runner.status('gated')).map((r) => [r.runKey, r.state]));
      await waitFor(async () => ((await states()).k2 === 'running' ? true : undefined), 'k2 to run');
      expect(await states()).toEqual({ k1: 'crashed', k2: 'running' });
      const paused = await runner.pause('gated', 'k1');
      expect(paused).toMatchObject({ live: false, status: 'paused' });
    } finally {
      open();
      await live;
    }
    expect(await query(url, `select run_key, status from idem.runs where job = 'gated' order by run_key`)).toEqual([
      { run_key: 'k1', status: 'paused' },
      { run_key: 'k2', status: 'succeeded' },
    ]);
  });
});

describe('the rest the review found (item 6)', () => {
  it('defineJob refuses a bad throttle or retry anywhere in the job at load, naming each', () => {
    const err = (() => {
      try {
        defineJob({
          name: 'bad-settings',
          retry: { attempts: 0 },
          steps: [
            { name: 'one', run: () => {} },
            { name: 'two', throttle: { maxRate: 0 }, retry: { factor: 0.5 }, run: () => {} },
          ],
        });
      } catch (e) {
        return e as Error;
      }
      return null;
    })();
    expect(exitCodeOf(err)).toBe(2);
    expect(err?.message).toBe(
      'defineJob(): invalid job definition: retry: attempts must be an integer >= 1 (got 0); steps[1].throttle: maxRate must be > 0 (got 0); steps[1].retry: factor must be a number >= 1 (got 0.5)',
    );
  });

  it('keyRange refuses a text column and a column without a unique index, before planning a chunk', async () => {
    await query(url, `create table texty (id text primary key); insert into texty select g::text from generate_series(1, 30) g`);
    await query(url, `create table repeated (id int not null); insert into repeated select g / 10 from generate_series(1, 30) g`);
    for (const [table, expected] of [
      ['texty', 'keyRange(): column "id" of "texty" is text, but keyRange cuts only smallint, integer and bigint keys'],
      ['repeated', 'keyRange(): column "id" of "repeated" has no unique index'],
    ] as const) {
      const job = defineJob({ name: `kr-${table}`, steps: [{ name: 'cut', chunks: keyRange({ table, column: 'id', size: 5 }), run: () => {} }] });
      const err = await runner.run(job).catch((e: Error) => e);
      expect(exitCodeOf(err)).toBe(1);
      expect((err as Error).message).toContain(`failed in step "cut" after 1 try: ${expected}`);
      expect(await query(url, `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = $1`, [`kr-${table}`])).toEqual([{ n: 0 }]);
    }
  });
});

describe('bookkeeping counts what happened (item 6)', () => {
  it('a chunk skipped after one permanent failure shows one try, not two', async () => {
    const job = defineJob({
      name: 'skip-once',
      steps: [{
        name: 'items',
        maxFailedChunks: 1,
        chunks: () => ({ chunks: [{ key: 'good' }, { key: 'bad' }], next: null }),
        run: (_ctx, chunk: { key: string }) => {
          if (chunk.key === 'bad') throw new Error('permanent');
        },
      }],
    });
    const out = await runner.run(job);
    expect(out.summary).toMatchObject({ chunks: 2, skipped: 1 });
    const [row] = await runner.status('skip-once');
    expect(row?.skipped).toEqual([{ step: 'items', key: 'bad', error: 'permanent', attempts: 1 }]);
  });

  it('a chunk whose COMMIT acknowledgement was lost counts as executed by this invocation, and its work happened once', async () => {
    const job = itemsJob('lost-ack', false);
    const original = pg.Client.prototype.query;
    let dropped = 0;
    // The COMMIT of the transaction whose claim took item-3: the server commits, the client never hears so.
    let armed: unknown;
    const spy = vi.spyOn(pg.Client.prototype, 'query').mockImplementation(function (this: pg.Client, ...args: any[]) {
      const text = typeof args[0] === 'string' ? args[0] : args[0]?.text;
      const result = (original as any).apply(this, args);
      if (dropped === 0 && armed === this && text === 'commit') {
        dropped++;
        return Promise.resolve(result).then(() => {
          throw Object.assign(new Error('Connection terminated unexpectedly'), { code: 'ECONNRESET' });
        });
      }
      if (dropped === 0 && typeof text === 'string' && text.includes('execute idem_claim_')) {
        return Promise.resolve(result).then((r: any) => {
          // BEGIN, the claim and the savepoint after it (or COMMIT first): the claim's is the UPDATE.
          const claimed = Array.isArray(r) ? r.find((x: any) => x.command === 'UPDATE') : r;
          if (claimed?.rows?.[0]?.key === 'item-3') armed = this;
          return r;
        });
      }
      return result;
    });
    try {
      await query(url, 'truncate hits');
      const out = await runner.run(job, { key: 'ack', planWindow: 2 });
      expect(dropped).toBe(1);
      expect(out).toMatchObject({ status: 'succeeded', executed: 6 });
    } finally {
      spy.mockRestore();
    }
    expect(await query(url, 'select item, n from hits order by item')).toEqual([1, 2, 3, 4, 5, 6].map((item) => ({ item, n: 1 })));
  });

  it('an attempt that lost the run starts no effect', async () => {
    const { run } = await runner.store.claimRun('fenced-effect', 'k', {}, fingerprint({}));
    await query(url, 'update idem.runs set attempt = 2 where id = $1', [run.id]);
    expect(await runner.store.beginEffect(run.id, 1, 'step', 'chunk', 'mail', 'idem-key')).toBeNull();
    expect(await query(url, 'select count(*)::int as n from idem.effects where run_id = $1', [run.id])).toEqual([{ n: 0 }]);
    expect(await runner.store.beginEffect(run.id, 2, 'step', 'chunk', 'mail', 'idem-key')).toMatchObject({ status: 'started', tries: 1 });
  });
});

describe('a lost lock is a lost run, not a failed one (found by the workers chaos)', () => {
  it('a connection error that arrives while the lock session is silent does not mark the run failed', async () => {
    let lockPid = 0;
    const job = defineJob({
      name: 'lock-silent-work-killed',
      steps: [
        {
          name: 'work',
          retry: { attempts: 1 },
          async run({ db }) {
            // The lock session stops answering (its backend is stopped, as on a dead network) and
            // the chunk fails with what a killed work session says: the run's fate must wait for
            // the lock's answer, not take the work session's error as the run's failure.
            const { rows } = await sql<{ pid: number }>`select pid from pg_stat_activity
              where application_name like 'idem-lock %' and datname = current_database()`.execute(db);
            lockPid = rows[0]!.pid;
            process.kill(lockPid, 'SIGSTOP');
            throw Object.assign(new Error('terminating connection due to administrator command'), { code: '57P01' });
          },
        },
      ],
    });
    try {
      const err = await runner.run(job, { key: 'silent' }).catch((e: unknown) => e);
      expect(exitCodeOf(err), String(err)).toBe(69);
    } finally {
      if (lockPid) {
        process.kill(lockPid, 'SIGCONT');
        await query(url, 'select pg_terminate_backend($1)', [lockPid]);
      }
    }
    expect(await query(url, `select status, error from idem.runs where job = 'lock-silent-work-killed'`)).toEqual([{ status: 'running', error: null }]);
  });
});

describe('a worker whose work sessions are killed while it starts (found by the workers chaos)', () => {
  // A real transient error from the real server: a trigger raises serialization_failure (40001,
  // which idem retries) once per arming, on the statement that records the run's code fingerprint.
  beforeAll(async () => {
    // A sequence, because the raise rolls back whatever the trigger wrote: the first nextval after
    // arming fails the statement, every later one lets it through.
    await query(url, `create sequence if not exists fp_fault;
      create or replace function fp_fault() returns trigger language plpgsql as $$
      begin
        if new.code_fingerprint is distinct from old.code_fingerprint and nextval('fp_fault') = 1 then
          raise exception 'could not serialize access (injected)' using errcode = '40001';
        end if;
        return new;
      end $$;
      create or replace trigger fp_fault before update on idem.runs for each row execute function fp_fault()`);
  });
  const arm = () => query(url, 'alter sequence fp_fault restart with 1');
  /** How many fingerprint writes reached the trigger since arming (the first one failed). */
  const tries = async () => {
    const [s] = await query(url, 'select last_value, is_called from fp_fault');
    return s.is_called ? Number(s.last_value) : 0;
  };

  const versioned = (version: string, failFirst: boolean) =>
    defineJob({
      name: 'fp-transient',
      version,
      steps: [
        {
          name: 'work',
          retry: { attempts: 1 },
          async run({ db }) {
            if (failFirst) throw new Error('first attempt fails for good');
            await sql`insert into hits (item, n) values (100, 1) on conflict (item) do update set n = hits.n + 1`.execute(db);
          },
        },
      ],
    });

  it('a transient error on recording the code fingerprint is retried like every bookkeeping statement, and recorded once', async () => {
    // A new run adopts the code it starts with (before the lock).
    await arm();
    const first = await runner.run(versioned('v1', true), { key: 'fp' }).catch((e: unknown) => e);
    expect(await tries()).toBe(2);
    expect(exitCodeOf(first), String(first)).toBe(1);
    expect(String(first)).toMatch(/first attempt fails for good/);
    expect(await query(url, `select code_fingerprint, attempt, status from idem.runs where job = 'fp-transient'`)).toEqual([
      { code_fingerprint: 'version:v1', attempt: 1, status: 'failed' },
    ]);
    // Its second attempt under other code records the change (after the lock), once.
    await arm();
    const second = await runner.run(versioned('v2', false), { key: 'fp', allowChangedCode: true });
    expect(await tries()).toBe(2);
    expect(second).toMatchObject({ status: 'succeeded', attempt: 2, executed: 1 });
    const [row] = await query(url, `select code_fingerprint, jsonb_array_length(code_changes) as changes from idem.runs where job = 'fp-transient'`);
    expect(row).toEqual({ code_fingerprint: 'version:v2', changes: 1 });
    expect(await query(url, 'select n from hits where item = 100')).toEqual([{ n: 1 }]);
  });
});

describe("a role's idle_session_timeout does not end idem's sessions", () => {
  it('a run whose lock session idles past it keeps its lock and succeeds', async () => {
    // ALTER ROLE … SET idle_session_timeout = '1500ms' (PostgreSQL 14+), here through the URL for
    // this test's sessions only: the lock session idles between its checks and was ended, and
    // every run exited 69 (lost the advisory lock) within seconds.
    const [v] = await query<{ n: number }>(url, `select current_setting('server_version_num')::int as n`);
    if (v!.n < 140000) return;
    const strict = new URL(url);
    strict.searchParams.set('options', '-c idle_session_timeout=300');
    const slow = defineJob({
      name: 'idle-session',
      steps: [{ name: 'items', chunks: () => ({ chunks: [1, 2, 3, 4, 5, 6].map((item) => ({ key: `i${item}`, item })), next: null }), run: async ({ db }, c: { item: number }) => {
        await sql`select pg_sleep(0.25)`.execute(db);
        await sql`insert into hits (item, n) values (${100 + c.item}, 1) on conflict (item) do update set n = hits.n + 1`.execute(db);
      } }],
    });
    const own = await Runner.connect({ connectionString: strict.href });
    try {
      expect(await own.run(slow, { key: 'idle-session' })).toMatchObject({ status: 'succeeded', attempt: 1 });
    } finally {
      await own.close();
    }
    expect(await query(url, 'select count(*)::int as n, sum(n)::int as total from hits where item > 100 and item <= 106')).toEqual([{ n: 6, total: 6 }]);
  }, 30_000);
});
