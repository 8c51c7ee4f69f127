import { execFileSync } from 'node:child_process';
import path from 'node:path';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createFixtureTables } from './fixtures/tables.ts';
import { STALL_DIRS, FIXTURE_DIRS, lines, query, runCli, sessions, spawnCli, waitFor } from './support/cli.ts';
import { clusterDir, removeDir, startPrimary, systemPgBin, type Cluster } from './support/pg-cluster.ts';
import { useTestDatabase } from './support/database.ts';
import { pgbouncerBinary, startPgbouncer, type Bouncer } from './support/pgbouncer.ts';
import { lockKey } from '../src/fingerprint.ts';

// Issue 8, item 8: idem never runs behind a pooler that does not keep sessions, and works through
// one that does. A real PgBouncer of the test's own sits between the CLI and PostgreSQL.
const missing = pgbouncerBinary() === null;
if (missing) console.warn('pgbouncer tests skipped: pgbouncer is not installed (.ci/run installs it: apt-get install -y pgbouncer)');

const COUNTED = (chunks: number, pauseMs = 0) => JSON.stringify({ chunks, pauseMs, label: 'x', gate: null });
const REFUSAL = /^idem: error: postgres:\/\/[^ ]+ goes through a connection pooler \(PgBouncer or similar\) in transaction or statement mode, which does not keep sessions, and idem needs its session \(advisory lock\): set pool_mode = session for idem's database, or point idem at PostgreSQL directly$/;

describe.skipIf(missing).each(['transaction', 'statement'] as const)('behind PgBouncer in %s mode', (mode) => {
  const database = useTestDatabase({ fixtureTables: true });
  let bouncer: Bouncer;

  beforeAll(async () => {
    bouncer = await startPgbouncer(database.url, mode);
  });
  afterAll(() => bouncer?.stop());

  /** Nothing of idem's and none of the job's work reached the server. */
  async function expectNothingWritten(): Promise<void> {
    expect(await query(database.url, `select nspname from pg_namespace where nspname = 'idem'`)).toEqual([]);
    expect(await query(database.url, 'select count(*)::int as n from work_log')).toEqual([{ n: 0 }]);
    expect(await query(database.url, `select to_regclass('widgets') as t`)).toEqual([{ t: null }]);
  }

  it('run, migrate and status refuse with exit 2 before writing anything: 20 in a row and 4 at once', async () => {
    const commands = [
      ['run', 'counted', '--params', COUNTED(5), '--concurrency', '1'],
      ['run', 'counted', '--params', COUNTED(5), '--concurrency', '4'],
      ['migrate'],
      ['status'],
    ];
    for (let i = 0; i < 20; i++) {
      const r = await runCli([...FIXTURE_DIRS, ...commands[i % commands.length]!], { url: bouncer.url });
      expect({ i, code: r.code, stderr: r.stderr.trim() }).toMatchObject({ i, code: 2, stderr: expect.stringMatching(REFUSAL) });
      expect(r.stderr).not.toContain(new URL(database.url).password);
    }
    const together = await Promise.all(commands.map((c) => runCli([...FIXTURE_DIRS, ...c], { url: bouncer.url })));
    for (const r of together) expect({ code: r.code, stderr: r.stderr.trim() }).toMatchObject({ code: 2, stderr: expect.stringMatching(REFUSAL) });
    await expectNothingWritten();
  }, 240_000);
});

describe.skipIf(missing)('behind PgBouncer in session mode', () => {
  const database = useTestDatabase({ fixtureTables: true });
  let bouncer: Bouncer;

  beforeAll(async () => {
    bouncer = await startPgbouncer(database.url, 'session');
  });
  afterAll(() => bouncer?.stop());

  it('a run succeeds with every chunk once', async () => {
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(30), '--key', 'one', '--concurrency', '4'], { url: bouncer.url });
    expect(r.code).toBe(0);
    const counts = await query(database.url, `select chunk_key, count(*)::int as n from work_log where run_key = 'one' and step = 'work' group by chunk_key having count(*) <> 1`);
    expect(counts).toEqual([]);
    expect(await query(database.url, `select count(distinct chunk_key)::int as n from work_log where run_key = 'one' and step = 'work'`)).toEqual([{ n: 30 }]);
  });

  it('a run stopped past its lock session\'s idle timeout exits 69 saying why, not with PgBouncer\'s "server conn crashed?"', async () => {
    // The lock's check interval 200 ms: the lock session's idle_session_timeout is 30 of them (6 s).
    const env = { IDEM_LOCK_CHECK_INTERVAL_MS: '200', IDEM_IDLE_IN_TRANSACTION_TIMEOUT_MS: '1000' };
    const a = spawnCli([...STALL_DIRS, 'run', 'stall', '--params', JSON.stringify({ chunks: 200, pauseMs: 50 }), '--key', 'stopped'], { url: bouncer.url, env, timeoutMs: 60_000 });
    try {
      await waitFor(async () => ((await query<{ n: number }>(database.url, `select count(*)::int as n from work_log where run_key = 'stopped'`))[0]!.n >= 3 ? true : undefined), 'the run committing chunks');
      a.child.kill('SIGSTOP');
      // The server ends the silent lock session after 6 s; PgBouncer then closes the client's side.
      await waitFor(async () => ((await sessions(database.url, 'idem-lock')) === 0 ? true : undefined), 'the server ending the lock session', { timeoutMs: 15_000 });
      a.child.kill('SIGCONT');
      const r = await a.done;
      expect(r.code, r.stderr).toBe(69);
      expect(r.stderr).toMatch(/lost the advisory lock for job "stall": the server ended its session after 6s without a statement from this process \(stopped or frozen that long, or cut off behind a proxy\); PgBouncer reported it as "server conn crashed\?"/);
      expect(r.stderr).not.toContain(new URL(database.url).password);
    } finally {
      a.child.kill('SIGCONT');
    }
  });

  it('5 invocations at once: one does the run, four exit 75', async () => {
    const procs = Array.from({ length: 5 }, () => spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(40, 100), '--key', 'five'], { url: bouncer.url, timeoutMs: 90_000 }));
    const results = await Promise.all(procs.map((p) => p.done));
    expect(results.map((r) => r.code).sort()).toEqual([0, 75, 75, 75, 75]);
    expect(await query(database.url, `select count(*)::int as n, count(distinct chunk_key)::int as d from work_log where run_key = 'five' and step = 'work'`)).toEqual([{ n: 40, d: 40 }]);
  });

  it("status rates a worker over its own chunks, not over the age of the pooled server session its lock got", async () => {
    // Black-box: two --join workers through PgBouncer, status after 4 s said 0.34/s per worker for
    // 3.34/s direct: the worker's age came from pg_stat_activity.backend_start of the server session
    // PgBouncer handed its lock, opened long before by an earlier command.
    const warm = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(2), '--key', 'rate-warm'], { url: bouncer.url });
    expect(warm.code, warm.stderr).toBe(0);
    // PgBouncer keeps those server sessions (server_lifetime: an hour), and they age meanwhile.
    await new Promise((r) => setTimeout(r, 8_000));
    const startedAt = Date.now();
    const worker = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(2000, 40), '--key', 'rate-live', '--join', '--no-progress'], { url: bouncer.url, timeoutMs: 120_000 });
    try {
      await waitFor(async () => ((await query<{ n: number }>(database.url, `select count(*)::int as n from work_log where run_key = 'rate-live'`))[0]!.n >= 20 ? true : undefined), 'the worker committing chunks');
      // The lock session got one of the warmed server sessions: its backend is older than the worker.
      const [lock] = await query<{ age: number }>(database.url, `select extract(epoch from now() - backend_start)::float8 as age from pg_stat_activity where application_name like 'idem-lock %' and datname = current_database()`);
      expect(lock!.age).toBeGreaterThan((Date.now() - startedAt) / 1000 + 5);
      const status = await runCli([...FIXTURE_DIRS, 'status', 'counted', '--key', 'rate-live', '--json'], { url: database.url });
      const age = (Date.now() - startedAt) / 1000;
      expect(status.code, status.stderr).toBe(0);
      const run = JSON.parse(status.stdout) as { workers: Array<{ chunks: number; rate: number }> };
      expect(run.workers).toHaveLength(1);
      const [w] = run.workers;
      // The worker is younger than `age`, so it did at least chunks/age a second; with the server
      // session's age it was rated at under half that.
      expect(w!.chunks).toBeGreaterThanOrEqual(20);
      expect(w!.rate).toBeGreaterThanOrEqual((0.8 * w!.chunks) / age);
    } finally {
      worker.child.kill('SIGINT');
      await worker.done;
    }
  }, 120_000);
});

describe.skipIf(missing)('behind PgBouncer in session mode that does not reset sessions', () => {
  /** Server sessions in the pool: more than the run below holds at once, so it never waits for one. */
  const SESSIONS = 10;
  const database = useTestDatabase({ fixtureTables: true });
  let bouncer: Bouncer;

  beforeAll(async () => {
    // server_reset_query empty: a server session goes to the next client with what the last one
    // left in it, prepared statements included (as with another idem version before a rolling upgrade).
    bouncer = await startPgbouncer(database.url, 'session', ['server_reset_query =', `default_pool_size = ${SESSIONS}`]);
  });
  afterAll(() => bouncer?.stop());

  it('a prepared claim that another version left in the session is not used: every chunk once, with its marker', async () => {
    const migrated = await runCli([...FIXTURE_DIRS, 'migrate'], { url: bouncer.url });
    expect(migrated.code).toBe(0);
    // Every server session of the pool gets a statement under each name an idem claim has had, with
    // another body: it claims nothing. Executed in place of idem's claim, it would end the step with
    // its chunks undone.
    const clients = await Promise.all(Array.from({ length: SESSIONS }, async () => {
      const c = new pg.Client({ connectionString: bouncer.url });
      await c.connect();
      return c;
    }));
    for (const c of clients) {
      await c.query('deallocate all');
      for (const mode of ['next', 'wait', 'retry']) {
        await c.query(`prepare idem_claim_${mode}_idem(bigint, integer, text, integer[]) as select 0::int as seq, ''::text as key, '{}'::jsonb as spec where false`);
      }
    }
    await Promise.all(clients.map((c) => c.end()));
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(30), '--key', 'stale', '--concurrency', '2'], { url: bouncer.url, timeoutMs: 60_000 });
    expect({ code: r.code, stderr: r.stderr }).toMatchObject({ code: 0 });
    expect(await query(database.url, `select count(*)::int as n, count(distinct chunk_key)::int as d from work_log where run_key = 'stale' and step = 'work'`)).toEqual([{ n: 30, d: 30 }]);
    expect(await query(database.url, `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.run_key = 'stale' and c.step = 'work' and c.done_at is null`)).toEqual([{ n: 0 }]);
  }, 120_000);

  it("a job's lock that a killed idem left on a pooled server session does not keep the job busy", async () => {
    // Black-box round 12 (B2-6): PgBouncer gives a killed process's server sessions, its lock
    // session with the job's advisory lock on it, to the next clients as they are. The rerun was
    // refused as busy, the holder named as the rerunning process itself (PgBouncer had given one of
    // its connections that session, and that connection's application_name), until someone ended
    // that backend by hand. A session a pooler hands over belongs to no live client: idem releases
    // the advisory locks it finds on each new connection.
    const migrated = await runCli([...FIXTURE_DIRS, 'migrate'], { url: bouncer.url });
    expect(migrated.code).toBe(0);
    // One server session of the pool holds the job's lock, as a killed run's lock session leaves it.
    const clients = await Promise.all(Array.from({ length: SESSIONS }, async () => {
      const c = new pg.Client({ connectionString: bouncer.url, application_name: 'killed-idem' });
      await c.connect();
      return c;
    }));
    const key = lockKey('idem:job:counted');
    const [first, ...rest] = clients;
    expect((await first!.query('select pg_try_advisory_lock($1::bigint) as ok', [key])).rows).toEqual([{ ok: true }]);
    await Promise.all(rest.map((c) => c.query('select pg_backend_pid()')));
    // Handed back last, it is the first PgBouncer hands out again (its pool is last in, first out).
    await Promise.all(rest.map((c) => c.end()));
    await first!.end();
    const held = `select count(*)::int as n from pg_locks where locktype = 'advisory' and granted and ((classid::bigint << 32) | objid::bigint) = $1::bigint
      and database = (select oid from pg_database where datname = current_database())`;
    expect(await query(database.url, held, [key])).toEqual([{ n: 1 }]);
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(20), '--key', 'leftover-lock', '--concurrency', '2'], { url: bouncer.url, timeoutMs: 60_000 });
    expect(r.code, r.stderr).toBe(0);
    expect(await query(database.url, `select count(*)::int as n, count(distinct chunk_key)::int as d from work_log where run_key = 'leftover-lock' and step = 'work'`)).toEqual([{ n: 20, d: 20 }]);
    expect(await query(database.url, held, [key])).toEqual([{ n: 0 }]);
  }, 120_000);
});

describe.skipIf(missing)('behind PgBouncer in session mode with a pool smaller than the run needs', () => {
  // Black-box round 12 (B2-1): default_pool_size 5, --concurrency 4: the lock session and four
  // slots took the five server sessions and the planner waited for a sixth; the run was then
  // marked failed in step "(runner)" ("timeout exceeded when trying to connect"), and idem
  // finalize in a deploy refused it. No connection free is never a run's failure (README).
  const database = useTestDatabase({ fixtureTables: true });
  let bouncer: Bouncer;

  beforeAll(async () => {
    // query_wait_timeout: PgBouncer's 120 s by default, for how long a query waits for a server session.
    bouncer = await startPgbouncer(database.url, 'session', ['default_pool_size = 5', 'max_db_connections = 5', 'query_wait_timeout = 20']);
  });
  afterAll(() => bouncer?.stop());

  it('the run is never marked failed: the slot that gets no session leaves (exit 0), or the worker stops (exit 69, interrupted) and a smaller --concurrency resumes it; every chunk once', async () => {
    const migrated = await runCli([...FIXTURE_DIRS, 'migrate'], { url: bouncer.url });
    expect(migrated.code, migrated.stderr).toBe(0);
    const starved = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(150), '--key', 'small-pool', '--concurrency', '4'], { url: bouncer.url, timeoutMs: 250_000 });
    // Which of the two depends on who waits for the missing session first: a slot (it leaves, the
    // others finish the step) or the planner (the worker stops).
    expect([0, 69], starved.stderr).toContain(starved.code);
    expect(starved.stderr).not.toContain('"msg":"run failed"');
    const status = (await query<{ status: string }>(database.url, `select status from idem.runs where run_key = 'small-pool'`))[0]?.status;
    expect(status).toBe(starved.code === 0 ? 'succeeded' : 'interrupted');
    if (starved.code === 69) {
      const resumed = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(150), '--key', 'small-pool', '--concurrency', '2'], { url: bouncer.url, timeoutMs: 120_000 });
      expect(resumed.code, resumed.stderr).toBe(0);
    }
    expect(await query(database.url, `select count(*)::int as n, count(distinct chunk_key)::int as keys from work_log where run_key = 'small-pool' and step = 'work'`)).toEqual([{ n: 150, keys: 150 }]);
  }, 400_000);
});

describe.skipIf(missing)('behind PgBouncer in session mode with a pool too small for even one slot', () => {
  // Black-box round 15 (B3-3): default_pool_size 2 and --concurrency 1 (idem needs 3: its lock
  // session, a slot, planning and bookkeeping): 0 chunks for minutes, then a warning that "the run
  // was interrupted in another worker" (there was none: the worker's own ending, seen by its control
  // poll) and exit 69 with "timeout exceeded when trying to connect", naming neither the pooler's
  // pool nor the fix. The connect timeout is shortened (a test hook) so that this takes seconds.
  const database = useTestDatabase({ fixtureTables: true });
  let bouncer: Bouncer;
  beforeAll(async () => {
    bouncer = await startPgbouncer(database.url, 'session', ['default_pool_size = 2', 'max_db_connections = 2', 'query_wait_timeout = 5']);
  });
  afterAll(() => bouncer?.stop());

  it('the worker stops (exit 69, the run interrupted) naming the pooler\'s full pool and the fix, with no word of another worker', async () => {
    const migrated = await runCli([...FIXTURE_DIRS, 'migrate'], { url: database.url });
    expect(migrated.code, migrated.stderr).toBe(0);
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', COUNTED(5), '--key', 'tiny-pool'], { url: bouncer.url, env: { IDEM_CONNECT_TIMEOUT_MS: '1000', IDEM_CONNECT_RETRY_MS: '1000' }, timeoutMs: 120_000 });
    expect(r.code, r.stderr).toBe(69);
    expect(r.stderr).not.toContain('in another worker');
    expect(r.stderr.trim().split('\n').at(-1)).toMatch(/^idem: error: this worker stopped: .*timeout exceeded when trying to connect.*behind a connection pooler this means its pool for this database has no server session free for idem: each worker may hold --concurrency \+ 3 \(its lock's, one per slot, two for planning, bookkeeping and effects\); raise the pooler's default_pool_size \(and max_db_connections\) or lower --concurrency; the run is interrupted: run the same command again to resume$/);
    expect((await query<{ status: string }>(database.url, `select status from idem.runs where run_key = 'tiny-pool'`))[0]?.status).toBe('interrupted');
  }, 150_000);
});

describe.skipIf(missing || !systemPgBin())('behind PgBouncer in session mode, the server restarted (a cluster of the test\'s own)', () => {
  let dir: string;
  let primary: Cluster;
  let bouncer: Bouncer;
  const asPostgres = () => (process.getuid?.() === 0 ? { uid: Number(execFileSync('id', ['-u', 'postgres'], { encoding: 'utf8' })), gid: Number(execFileSync('id', ['-g', 'postgres'], { encoding: 'utf8' })) } : {});

  beforeAll(async () => {
    dir = await clusterDir('idem-pgb-restart-');
    primary = await startPrimary(systemPgBin()!, dir);
    await createFixtureTables(primary.url);
    // Trust auth on the server; PgBouncer asks its clients for this password.
    const through = new URL(primary.url);
    through.password = 'restart-secret';
    bouncer = await startPgbouncer(through.toString(), 'session');
  }, 120_000);
  afterAll(async () => {
    await bouncer?.stop();
    await primary?.stop();
    if (dir) await removeDir(dir);
  });

  it('commands started right after the restart wait for it or say so in one line (exit 2), not "Connection terminated unexpectedly" (exit 1); the run then resumes', async () => {
    // Black-box round 12 (B2-5): PgBouncer hands out the server sessions that died with the restart
    // until it next checks them, then refuses logins for server_login_retry (15 s); idem printed
    // pg's bare "Connection terminated unexpectedly" and exited 1.
    const params = JSON.stringify({ chunks: 200, pauseMs: 50, label: 'x', gate: null });
    const a = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', 'restarted', '--concurrency', '2'], { url: bouncer.url, timeoutMs: 120_000 });
    await waitFor(async () => ((await query<{ n: number }>(primary.url, `select count(*)::int as n from work_log where run_key = 'restarted'`))[0]!.n >= 5 ? true : undefined), 'the run committing chunks');
    execFileSync(path.join(systemPgBin()!, 'pg_ctl'), ['-D', primary.dataDir, '-m', 'fast', '-w', 'restart', '-l', path.join(primary.dataDir, 'server.log')], { ...asPostgres(), cwd: dir, stdio: 'ignore' });
    const stopped = await a.done;
    expect(stopped.code, stopped.stderr).toBe(69);
    const results = [];
    for (const args of [['status'], ['run', 'counted', '--params', params, '--key', 'restarted', '--concurrency', '2']]) {
      const started = Date.now();
      const r = await runCli([...FIXTURE_DIRS, ...args], { url: bouncer.url, timeoutMs: 120_000 });
      results.push({ args: args[0], code: r.code, ms: Date.now() - started, errors: lines(r.stderr).filter((l) => l.startsWith('idem: error:')) });
    }
    for (const r of results) {
      expect(r.code === 0 || r.code === 2, JSON.stringify(r)).toBe(true);
      if (r.code === 2) {
        expect(r.errors, JSON.stringify(r)).toEqual([expect.stringMatching(/^idem: error: cannot reach the database at postgres:\/\/postgres:\*\*\*@127\.0\.0\.1:\d+\/postgres: the connection was closed as it opened \(.+\); the server, or a pooler in front of it, is restarting or down: run the same command again once it is up$/)]);
      }
      expect(r.ms, JSON.stringify(r)).toBeLessThan(30_000);
    }
    // Once PgBouncer logs in again, the run resumes and every chunk is done once.
    await waitFor(async () => ((await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', 'restarted', '--concurrency', '2'], { url: bouncer.url, timeoutMs: 120_000 })).code === 0 ? true : undefined), 'the run resuming', { timeoutMs: 60_000, intervalMs: 1_000 });
    expect(await query(primary.url, `select count(*)::int as n, count(distinct chunk_key)::int as d from work_log where run_key = 'restarted' and step = 'work'`)).toEqual([{ n: 200, d: 200 }]);
  }, 240_000);
});
