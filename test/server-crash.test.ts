import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { chunkKey } from './fixtures/jobs/counted.ts';
import { FIXTURE_DIRS, holdGate, killLeftovers, query, runCli, runRow, sessions, spawnCli, waitFor, workCounts, lockWaiters } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { api, startServe } from './support/server.ts';

const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
let url: string;
beforeAll(() => {
  url = testDb.url;
});
afterAll(killLeftovers);

const CHUNKS = 40;

describe('GET /metrics while PostgreSQL cannot be reached', () => {
  it("still answers 200 with the server's own metrics; idem_runs is left out and idem_database_up reads 0", async () => {
    const { startBlackholeProxy } = await import('./support/blackhole-proxy.ts');
    const direct = new URL(url);
    const proxy = await startBlackholeProxy(Number(direct.port));
    const via = new URL(url);
    via.port = String(proxy.port);
    const srv = await startServe(via.href);
    try {
      const up = await api(srv.base, 'GET', '/metrics');
      expect(up.status).toBe(200);
      expect(up.text).toMatch(/^idem_database_up 1$/m);
      const created = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key: 'k-metrics-down', body: { chunks: 2 } });
      expect((await api(srv.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body).toMatchObject({ state: 'succeeded' });
      const before = (await api(srv.base, 'GET', '/metrics')).text;
      expect(before).toMatch(/^idem_runs\{job="counted",state="succeeded"\} [1-9]\d*$/m);
      const ended = /^idem_runs_ended_total\{job="counted",outcome="succeeded"\} [1-9]\d*$/m.exec(before)?.[0];
      expect(ended, before).toBeDefined();
      await proxy.close(); // its connections end, and no new one is answered: connection refused
      const down = await api(srv.base, 'GET', '/metrics');
      // Before: 503 idem.databaseUnavailable, and every metric gone for the outage.
      expect(down.status, down.text).toBe(200);
      expect(down.text).toMatch(/^idem_database_up 0$/m);
      expect(down.text).toMatch(/^idem_runs_executing 0$/m);
      expect(down.text).toMatch(/^idem_http_requests_total\{method="GET",route="\/metrics",status="200"\} 2$/m);
      // The server's own counters read as they did before the outage.
      expect(down.text.split('\n')).toContain(ended);
      expect(down.text).not.toMatch(/^idem_runs\{/m);
      // A request that needs the database answers 503, logged as a warning naming the request
      // (before: an error line with neither method nor route, for every probe of the outage).
      expect((await api(srv.base, 'GET', '/readyz')).status).toBe(503);
      await waitFor(async () => srv.proc.stderr().includes('request answered 503'), 'the 503 to be logged');
      const logged = srv.proc.stderr().split('\n').filter((l) => l.startsWith('{')).map((l) => JSON.parse(l) as Record<string, unknown>);
      expect(logged.filter((l) => (l.level as number) >= 50), srv.proc.stderr()).toEqual([]);
      expect(logged.find((l) => String(l.msg).startsWith('request answered 503'))).toMatchObject({ level: 40, method: 'GET', route: '/readyz', status: 503 });
    } finally {
      srv.proc.child.kill('SIGTERM');
      await srv.proc.done;
    }
  }, 60_000);
});

describe('GET /metrics while the runs table does not answer', () => {
  it("gives up after 2 s and leaves no query behind on the runs' connections: the read runs on the read pool, bounded by its timeout", async () => {
    // A backend whose client hung up while it waits on a lock ends at once (PostgreSQL 14+), so a
    // read given up by its pool's timeout leaves no waiting session behind.
    const dbName = new URL(url).pathname.slice(1);
    await query(url, `alter database ${dbName} set client_connection_check_interval = '100ms'`);
    const srv = await startServe(url, ['--max-runs', '1'], { IDEM_SERVE_READ_TIMEOUT_MS: '1000' });
    const pg = await import('pg');
    const holder = new pg.default.Client({ connectionString: url, application_name: 'test-lock' });
    await holder.connect();
    try {
      expect((await api(srv.base, 'GET', '/metrics')).text).toMatch(/^idem_database_up 1$/m);
      // Every read of idem.runs now waits: what a server that stopped answering looks like.
      await holder.query('begin');
      await holder.query('lock table idem.runs in access exclusive mode');
      for (let i = 0; i < 3; i++) {
        const scrape = await api(srv.base, 'GET', '/metrics');
        expect(scrape.status).toBe(200);
        expect(scrape.text).toMatch(/^idem_database_up 0$/m);
      }
      // Before: each scrape left its count waiting on one of the connections the runs execute on
      // (no query timeout there), 3 of the 5 this server has; they waited as long as the lock did.
      await waitFor(async () => (await lockWaiters(url, 'idem')) === 0, "the scrapes' reads to be given up", { timeoutMs: 10_000 });
      await holder.query('commit');
      expect((await api(srv.base, 'GET', '/metrics')).text).toMatch(/^idem_database_up 1$/m);
    } finally {
      await holder.end();
      srv.proc.child.kill('SIGTERM');
      await srv.proc.done;
      await query(url, `alter database ${dbName} reset client_connection_check_interval`);
    }
  }, 60_000);
});

describe("idem serve's log of a run that fails", () => {
  it('one error line for the failure (the runner\'s, with job, runKey and attempt), not a second one from the server', async () => {
    const key = 'k-fails-once';
    await query(url, `insert into fail_chunks values ('c0002', null, null)`);
    const srv = await startServe(url);
    try {
      const created = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key, body: { chunks: 3 } });
      expect((await api(srv.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body).toMatchObject({ state: 'failed' });
      await waitFor(async () => srv.proc.stderr().includes('"msg":"run failed"'), 'the failure to be logged');
    } finally {
      srv.proc.child.kill('SIGTERM');
      await srv.proc.done;
      await query(url, `delete from fail_chunks`);
    }
    const errors = srv.proc
      .stderr()
      .split('\n')
      .filter((l) => l.startsWith('{'))
      .map((l) => JSON.parse(l) as Record<string, unknown>)
      .filter((l) => (l.level as number) >= 50);
    // Before: two level-50 "run failed" lines for the one failure, the second without runKey or attempt.
    expect(errors, srv.proc.stderr()).toEqual([expect.objectContaining({ msg: 'run failed', job: 'counted', runKey: key, attempt: 1 })]);
  }, 60_000);
});

describe('idem serve killed with SIGKILL mid-run', () => {
  it('resumes the run when it starts again; it ends succeeded with every chunk committed once', async () => {
    const first = await startServe(url);
    const created = await api(first.base, 'POST', '/api/jobs/counted/runs', { key: 'k-crash', body: { chunks: CHUNKS, pauseMs: 50 } });
    expect(created.status).toBe(201);
    await waitFor(async () => (await workCounts(url, 'k-crash')).size >= 5, 'five chunks to commit', { timeoutMs: 60_000 });
    first.proc.child.kill('SIGKILL');
    expect((await first.proc.done).signal).toBe('SIGKILL');
    // Nothing of the dead server can commit once its sessions are gone.
    await waitFor(async () => (await sessions(url, 'idem')) + (await sessions(url, 'idem-lock')) === 0, "the killed server's sessions to end");
    const committed = (await workCounts(url, 'k-crash')).size;
    expect(committed).toBeLessThan(CHUNKS);
    expect(await runRow(url, 'counted', 'k-crash')).toMatchObject({ status: 'running', attempt: 1 });

    const second = await startServe(url);
    // Before anyone asks: the restarted server picks the run up by itself.
    const done = await api(second.base, 'GET', `/api/runs/${created.body.id}?wait=60`);
    expect(done.body).toMatchObject({ state: 'succeeded', attempt: 2, progress: { done: CHUNKS + 2, percent: 100 } });
    expect(await workCounts(url, 'k-crash')).toEqual(new Map(Array.from({ length: CHUNKS }, (_, i) => [chunkKey(i + 1), 1])));
    expect(await workCounts(url, 'k-crash', 'prepare')).toEqual(new Map([['step', 1]]));
    expect(await workCounts(url, 'k-crash', 'finish')).toEqual(new Map([['step', 1]]));
    // A replay after the crash is the same run, not a second one.
    const replay = await api(second.base, 'POST', '/api/jobs/counted/runs', { key: 'k-crash', body: { chunks: CHUNKS, pauseMs: 50 } });
    expect(replay).toMatchObject({ status: 200, body: { id: created.body.id, state: 'succeeded' } });

    second.proc.child.kill('SIGTERM');
    const stopped = await second.proc.done;
    expect(stopped.code, stopped.stderr).toBe(143);
  });

  it.each([
    ['SIGTERM', 143, 'k-term'],
    ['SIGHUP', 129, 'k-hup'],
  ] as const)('%s stops live runs at a chunk boundary as interrupted, recorded with that signal; the next start finishes them', async (sig, exitCode, key) => {
    const first = await startServe(url);
    const created = await api(first.base, 'POST', '/api/jobs/counted/runs', { key, body: { chunks: CHUNKS, pauseMs: 50 } });
    await waitFor(async () => (await workCounts(url, key)).size >= 3, 'three chunks to commit', { timeoutMs: 60_000 });
    first.proc.child.kill(sig);
    const stopped = await first.proc.done;
    expect(stopped.code, stopped.stderr).toBe(exitCode);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'interrupted' });
    const interrupted = stopped.stderr.split('\n').filter((l) => l.includes('"msg":"run interrupted'));
    expect(interrupted.length, stopped.stderr).toBe(1);
    expect(JSON.parse(interrupted[0]!)).toMatchObject({ runKey: key, signal: sig });
    const second = await startServe(url);
    const done = await api(second.base, 'GET', `/api/runs/${created.body.id}?wait=60`);
    expect(done.body).toMatchObject({ state: 'succeeded', attempt: 2 });
    expect([...(await workCounts(url, key)).values()]).toEqual(Array.from({ length: CHUNKS }, () => 1));
    second.proc.child.kill('SIGTERM');
    await second.proc.done;
  });

  it.each([
    ['SIGTERM', 143, 'k-term-x2'],
    ['SIGINT', 130, 'k-int-x2'],
  ] as const)('a second %s during a long statement cancels it: exit %i, the run recorded interrupted (not crashed), no pg_sleep left on the server', async (sig, exitCode, key) => {
    // Black-box (fix-serve): the second signal exited 143 at once with the run still `running`
    // (idem status: crashed) and its pg_sleep still active on the server: nothing cancelled the
    // statement, and the process did not wait for the run to be recorded.
    const srv = await startServe(url);
    const pid = srv.proc.pid;
    const sleeping = async () =>
      (await query(url, `select pid from pg_stat_activity where application_name like 'idem %:' || $1 and query like '%pg_sleep%' and state = 'active'`, [String(pid)])).length;
    const created = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key, body: { chunks: 3, pauseMs: 60_000 } });
    expect(created.status).toBe(201);
    await waitFor(async () => ((await sleeping()) > 0 ? true : undefined), 'the chunk in its pg_sleep', { timeoutMs: 60_000 });
    const started = Date.now();
    srv.proc.child.kill(sig);
    await new Promise((r) => setTimeout(r, 300));
    srv.proc.child.kill(sig);
    const stopped = await srv.proc.done;
    expect(stopped.code, stopped.stderr).toBe(exitCode);
    expect(Date.now() - started, 'exits soon after the second signal').toBeLessThan(8_000);
    expect(stopped.stderr).toContain('second signal; aborting in-flight chunks');
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'interrupted', attempt: 1, error: null });
    const interrupted = stopped.stderr.split('\n').filter((l) => l.includes('"msg":"run interrupted'));
    expect(interrupted.length, stopped.stderr).toBe(1);
    expect(JSON.parse(interrupted[0]!)).toMatchObject({ runKey: key, signal: sig });
    // Cancelled before the process exited, not left to run on after it.
    expect(await sleeping()).toBe(0);
    // No chunk of `work` committed: the one in flight rolled back.
    expect((await workCounts(url, key)).size).toBe(0);
    // Cancelled, so the servers the next tests start do not resume its minute-long chunks.
    const cancelled = await runCli([...FIXTURE_DIRS, 'cancel', 'counted', '--key', key], { url });
    expect(cancelled.code, cancelled.stderr).toBe(0);
  });

  it('--max-runs bounds the runs executing at once; the others wait their turn, pending', async () => {
    const srv = await startServe(url, ['--max-runs', '1']);
    const slow = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key: 'k-slot', body: { chunks: 10, pauseMs: 200 } });
    await waitFor(async () => (await workCounts(url, 'k-slot')).size >= 1, 'the first run to be executing');
    const queued = await api(srv.base, 'POST', '/api/jobs/ranged/runs', { key: 'k-queued', body: {} });
    expect(queued.status).toBe(201);
    expect(queued.body.state).toBe('pending');
    const metrics = (await api(srv.base, 'GET', '/metrics')).text;
    expect(metrics).toMatch(/^idem_runs_executing 1$/m);
    expect(metrics).toMatch(/^idem_runs_queued 1$/m);
    // Still pending while the slot is taken: the second run has not started.
    expect((await api(srv.base, 'GET', `/api/runs/${queued.body.id}`)).body).toMatchObject({ state: 'pending', attempt: 0 });
    const first = await api(srv.base, 'GET', `/api/runs/${slow.body.id}?wait=60`);
    expect(first.body.state).toBe('succeeded');
    const second = await api(srv.base, 'GET', `/api/runs/${queued.body.id}?wait=60`);
    expect(second.body).toMatchObject({ state: 'succeeded', attempt: 1 });
    // It started only after the first had finished.
    expect(Date.parse(second.body.startedAt)).toBeGreaterThanOrEqual(Date.parse(first.body.finishedAt));
    srv.proc.child.kill('SIGTERM');
    await srv.proc.done;
  });

  it('a run reset while it waits its turn in the queue is skipped quietly: no "run error", no error outcome', async () => {
    // Black-box round 10: the server later logged `run error` ("run … disappeared (was it reset
    // while running?)") at error level and counted idem_runs_ended_total{outcome="error"}.
    const srv = await startServe(url, ['--max-runs', '1']);
    try {
      const slow = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key: 'k-slot-reset', body: { chunks: 10, pauseMs: 200 } });
      await waitFor(async () => (await workCounts(url, 'k-slot-reset')).size >= 1, 'the first run to be executing');
      const queued = await api(srv.base, 'POST', '/api/jobs/ranged/runs', { key: 'k-reset-queued', body: {} });
      expect(queued.body.state).toBe('pending');
      const reset = await runCli([...FIXTURE_DIRS, 'reset', 'ranged', '--key', 'k-reset-queued'], { url });
      expect(reset.code, reset.stderr).toBe(0);
      expect((await api(srv.base, 'GET', `/api/runs/${slow.body.id}?wait=60`)).body.state).toBe('succeeded');
      await waitFor(async () => /^idem_runs_queued 0$/m.test((await api(srv.base, 'GET', '/metrics')).text) && /^idem_runs_executing 0$/m.test((await api(srv.base, 'GET', '/metrics')).text), 'the queue to drain');
      const metrics = (await api(srv.base, 'GET', '/metrics')).text;
      expect(metrics).not.toMatch(/^idem_runs_ended_total\{job="ranged",outcome="error"\}/m);
      expect(srv.proc.stderr()).not.toContain('disappeared');
      expect(await runRow(url, 'ranged', 'k-reset-queued')).toBeUndefined();
    } finally {
      srv.proc.child.kill('SIGTERM');
      await srv.proc.done;
    }
  });

  it('--retention prunes finished runs at start; their Idempotency-Keys start new runs after', async () => {
    const first = await startServe(url);
    const old = await api(first.base, 'POST', '/api/jobs/counted/runs', { key: 'k-retained', body: { chunks: 2 } });
    expect((await api(first.base, 'GET', `/api/runs/${old.body.id}?wait=30`)).body.state).toBe('succeeded');
    first.proc.child.kill('SIGTERM');
    await first.proc.done;
    await new Promise((r) => setTimeout(r, 1100)); // older than the 1 s retention below
    const second = await startServe(url, ['--retention', '1s']);
    await waitFor(async () => (await runRow(url, 'counted', 'k-retained')) === undefined, 'the finished run to be pruned');
    expect(await query(url, `select count(*)::int as n from idem.api_requests where idempotency_key = 'k-retained'`)).toEqual([{ n: 0 }]);
    const again = await api(second.base, 'POST', '/api/jobs/counted/runs', { key: 'k-retained', body: { chunks: 3 } });
    expect(again.status).toBe(201);
    expect(again.body.id).not.toBe(old.body.id);
    // Finished before the server stops: a run left interrupted here would be resumed by whichever
    // test of this file starts a server next (tests are shuffled under CI) and counted in its metrics.
    expect((await api(second.base, 'GET', `/api/runs/${again.body.id}?wait=30`)).body).toMatchObject({ state: 'succeeded' });
    second.proc.child.kill('SIGTERM');
    await second.proc.done;
  });

  it('a key whose run a killed prune left marked deleting starts a new run (201); the remnant is gone', async () => {
    const srv = await startServe(url);
    const old = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key: 'k-half-pruned', body: { chunks: 3 } });
    expect((await api(srv.base, 'GET', `/api/runs/${old.body.id}?wait=30`)).body.state).toBe('succeeded');
    // What a prune killed between its batches leaves: the run marked, some of its markers gone.
    await query(url, `update idem.runs set status = 'deleting' where id = $1`, [old.body.id]);
    await query(url, `delete from idem.chunks where run_id = $1 and key in ('c0001', 'c0002')`, [old.body.id]);
    expect((await api(srv.base, 'GET', `/api/runs/${old.body.id}`)).body.state).toBe('deleting');
    const again = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key: 'k-half-pruned', body: { chunks: 3 } });
    expect(again.status, JSON.stringify(again.body)).toBe(201);
    expect(again.body.id).not.toBe(old.body.id);
    expect(await query(url, `select count(*)::int as n from idem.chunks where run_id = $1`, [old.body.id])).toEqual([{ n: 0 }]);
    expect((await api(srv.base, 'GET', `/api/runs/${again.body.id}?wait=30`)).body).toMatchObject({ state: 'succeeded', attempt: 1 });
    srv.proc.child.kill('SIGTERM');
    await srv.proc.done;
  });

  it("another server's rescan leaves a run that was just created (pending) to the server that created it", async () => {
    const env = { IDEM_SERVE_RESCAN_MS: '300' };
    const a = await startServe(url, ['--max-runs', '1']);
    const slow = await api(a.base, 'POST', '/api/jobs/counted/runs', { key: 'k-fresh-slow', body: { chunks: 40, pauseMs: 200 } });
    await waitFor(async () => (await workCounts(url, 'k-fresh-slow')).size >= 1, 'the first run to be executing');
    // Queued behind A's --max-runs: pending, seconds old.
    const queued = await api(a.base, 'POST', '/api/jobs/ranged/runs', { key: 'k-fresh-queued', body: {} });
    expect(queued.body.state).toBe('pending');
    const b = await startServe(url, [], env);
    // Several of B's rescans (every 300 ms) pass; B takes nothing that young.
    await new Promise((r) => setTimeout(r, 2_000));
    expect((await api(b.base, 'GET', '/metrics')).text).toMatch(/^idem_runs_executing 0$/m);
    expect((await api(a.base, 'GET', `/api/runs/${queued.body.id}`)).body).toMatchObject({ state: 'pending', attempt: 0 });
    expect((await api(a.base, 'GET', `/api/runs/${slow.body.id}?wait=60`)).body.state).toBe('succeeded');
    expect((await api(a.base, 'GET', `/api/runs/${queued.body.id}?wait=60`)).body).toMatchObject({ state: 'succeeded', attempt: 1 });
    for (const s of [a, b]) {
      s.proc.child.kill('SIGTERM');
      await s.proc.done;
    }
  });

  it('a run queued on one server that another executed is not executed, logged or counted again by the first, and leaves its queue', async () => {
    // Black-box round 19 (B13-2): A, busy (--max-runs 1), logged "run executed" and counted
    // idem_runs_ended_total for 30 runs B had executed, and idem_runs_queued said 30 long after.
    const env = { IDEM_SERVE_RESCAN_MS: '300' };
    const a = await startServe(url, ['--max-runs', '1'], env, undefined, 'info');
    const b = await startServe(url, [], env);
    const gate = await holdGate(url, 'g-queued');
    try {
      const blocker = await api(a.base, 'POST', '/api/jobs/counted/runs', { key: 'k-q-blocker', body: { chunks: 1, gate: 'g-queued' } });
      await waitFor(async () => (await lockWaiters(url, 'idem')) >= 1 || undefined, "A's run to wait at the gate");
      const queued = [];
      for (const key of ['k-q-1', 'k-q-2', 'k-q-3']) queued.push((await api(a.base, 'POST', '/api/jobs/ranged/runs', { key, body: {} })).body.id as string);
      expect((await api(a.base, 'GET', '/metrics')).text).toMatch(/^idem_runs_queued 3$/m);
      // B takes them once they are older than the grace for a fresh run (10 s), and executes them.
      for (const id of queued) expect((await api(b.base, 'GET', `/api/runs/${id}?wait=60`)).body).toMatchObject({ state: 'succeeded', attempt: 1 });
      // A's rescan drops them from its queue.
      await waitFor(async () => /^idem_runs_queued 0$/m.test((await api(a.base, 'GET', '/metrics')).text) || undefined, "A's queue to drop the runs B executed");
      await gate.release();
      expect((await api(a.base, 'GET', `/api/runs/${blocker.body.id}?wait=60`)).body.state).toBe('succeeded');
      await new Promise((r) => setTimeout(r, 1_000));
      const aMetrics = (await api(a.base, 'GET', '/metrics')).text;
      expect(aMetrics).not.toMatch(/^idem_runs_ended_total\{job="ranged"/m);
      expect(aMetrics).toMatch(/^idem_runs_ended_total\{job="counted",outcome="succeeded"\} 1$/m);
      expect((await api(b.base, 'GET', '/metrics')).text).toMatch(/^idem_runs_ended_total\{job="ranged",outcome="succeeded"\} 3$/m);
      const executedByA = a.proc.stderr().split('\n').filter((l) => l.startsWith('{')).map((l) => JSON.parse(l) as { msg: string; runId?: string }).filter((l) => l.msg === 'run executed');
      expect(executedByA.map((l) => l.runId)).toEqual([blocker.body.id]);
    } finally {
      await gate.release().catch(() => {});
      for (const s of [a, b]) {
        s.proc.child.kill('SIGTERM');
        await s.proc.done;
      }
    }
  });

  it('a second server takes over the run of one that was SIGKILLed, without a restart; chunks once', async () => {
    const env = { IDEM_SERVE_RESCAN_MS: '300' };
    const a = await startServe(url, [], env);
    const b = await startServe(url, [], env);
    const created = await api(a.base, 'POST', '/api/jobs/counted/runs', { key: 'k-takeover', body: { chunks: CHUNKS, pauseMs: 50 } });
    await waitFor(async () => (await workCounts(url, 'k-takeover')).size >= 5, 'five chunks to commit', { timeoutMs: 60_000 });
    // While A is alive, B leaves its run alone: after several of its rescans it executes nothing
    // and has not queued up behind A's lock.
    await new Promise((r) => setTimeout(r, 1_000));
    const metrics = (await api(b.base, 'GET', '/metrics')).text;
    expect(metrics).toMatch(/^idem_runs_executing 0$/m);
    expect(metrics).not.toMatch(/^idem_lock_waits_total\{/m);
    expect((await api(b.base, 'GET', `/api/runs/${created.body.id}`)).body).toMatchObject({ state: 'running', attempt: 1 });
    a.proc.child.kill('SIGKILL');
    await a.proc.done;
    const done = await api(b.base, 'GET', `/api/runs/${created.body.id}?wait=60`);
    expect(done.body).toMatchObject({ state: 'succeeded', attempt: 2 });
    expect(await workCounts(url, 'k-takeover')).toEqual(new Map(Array.from({ length: CHUNKS }, (_, i) => [chunkKey(i + 1), 1])));
    b.proc.child.kill('SIGTERM');
    await b.proc.done;
  });

  it('idem run --join workers share a run the server executes: every chunk once, by both', async () => {
    const srv = await startServe(url);
    // Every chunk waits on a gate held here: the run cannot end before the worker has joined.
    const gate = await holdGate(url, 'g-join');
    const body = { chunks: 60, pauseMs: 20, gate: 'g-join' };
    const created = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key: 'k-join', body });
    const worker = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify(body), '--key', 'k-join', '--join'], { url, timeoutMs: 180_000 });
    // Joined: a chunk of the server and one of the worker both wait at the gate.
    const blocked = () => lockWaiters(url, 'idem');
    await waitFor(async () => (await blocked()) >= 2, 'the server and the worker to each hold a chunk', { timeoutMs: 120_000 });
    await gate.release();
    const joined = await worker.done;
    expect(joined.code, joined.stderr).toBe(0);
    const done = await api(srv.base, 'GET', `/api/runs/${created.body.id}?wait=60`);
    expect(done.body).toMatchObject({ state: 'succeeded', attempt: 1 });
    expect([...(await workCounts(url, 'k-join')).values()]).toEqual(Array.from({ length: 60 }, () => 1));
    const pids = await query<{ n: number }>(url, `select count(distinct pid)::int as n from work_log where run_key = 'k-join' and step = 'work'`);
    expect(pids).toEqual([{ n: 2 }]);
    srv.proc.child.kill('SIGTERM');
    await srv.proc.done;
  });
});
