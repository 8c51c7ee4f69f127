import { spawnSync } from 'node:child_process';
import os from 'node:os';
import { beforeAll, describe, expect, it } from 'vitest';
import { busyMessage, FIXTURE_DIRS, holdGate, query, runCli, sessions, spawnCli, waitFor, type CliProcess, lockWaiters } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { sessionName } from '../src/database.ts';
import { INIT_PID_NAMESPACE, WORKER, workerName } from '../src/worker-identity.ts';

// Issue 9: many worker processes share one run (`idem run --join`).

const testDb = useTestDatabase({ fixtureTables: true });
let url: string;
beforeAll(() => {
  url = testDb.url;
});

const params = (chunks: number, pauseMs: number, gate: string | null = null) => JSON.stringify({ chunks, pauseMs, label: 'x', gate });
const join = (key: string, chunks: number, pauseMs: number, extra: string[] = [], gate: string | null = null) =>
  spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params(chunks, pauseMs, gate), '--key', key, '--join', ...extra], { url, timeoutMs: 120_000 });

/** Every `work` chunk of the run committed exactly once; returns how many distinct processes did work. */
async function expectExactlyOnce(key: string, chunks: number): Promise<number> {
  expect(await query(url, `select chunk_key, count(*)::int as n from work_log where run_key = $1 and step = 'work' group by chunk_key having count(*) <> 1`, [key])).toEqual([]);
  expect(await query(url, `select count(distinct chunk_key)::int as n from work_log where run_key = $1 and step = 'work'`, [key])).toEqual([{ n: chunks }]);
  expect(await query(url, `select count(*)::int as n from work_log where run_key = $1 and step <> 'work'`, [key])).toEqual([{ n: 2 }]);
  const [row] = await query<{ status: string; summary: { chunks: number; attempts: number } }>(url, `select status, summary from idem.runs where run_key = $1`, [key]);
  expect(row?.status).toBe('succeeded');
  expect(row?.summary).toMatchObject({ chunks: chunks + 2, attempts: 1 });
  const rows = await query<{ pids: number }>(url, `select count(distinct pid)::int as pids from work_log where run_key = $1 and step = 'work'`, [key]);
  return rows[0]?.pids ?? 0;
}

async function doneCount(key: string): Promise<number> {
  return (await query<{ n: number }>(url, `select count(*)::int as n from work_log where run_key = $1 and step = 'work'`, [key]))[0]?.n ?? 0;
}

describe('idem run --join', () => {
  it('4 workers share one run: every chunk committed exactly once, by several of them, one summary', async () => {
    const workers = Array.from({ length: 4 }, () => join('four', 120, 40));
    const results = await Promise.all(workers.map((w) => w.done));
    expect(results.map((r) => ({ code: r.code, timedOut: r.timedOut }))).toEqual(Array(4).fill({ code: 0, timedOut: false }));
    const pids = await expectExactlyOnce('four', 120);
    expect(pids).toBeGreaterThanOrEqual(2);
  });

  it("each worker's progress line counts the step's chunks done by every worker, not its own alone", async () => {
    // Black-box round 8: three workers each logged "19/60 chunks … ETA 22s" while 57 of 60 were
    // done: `done` was the step's count at the worker's start plus its own commits.
    const spawnJoin = () =>
      spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params(120, 50), '--key', 'progress-shared', '--join'], { url, timeoutMs: 120_000, env: { IDEM_PROGRESS_INTERVAL_MS: '300' } });
    const workers = [spawnJoin(), spawnJoin()];
    const results = await Promise.all(workers.map((w) => w.done));
    expect(results.map((r) => r.code)).toEqual([0, 0]);
    await expectExactlyOnce('progress-shared', 120);
    const progress = results.flatMap((r) =>
      r.stderr
        .split('\n')
        .filter((l) => l.includes('"executedNow"') && l.includes('"step":"work"'))
        .map((l) => JSON.parse(l) as { done: number; executedNow: number; pid: number }),
    );
    expect(progress.length).toBeGreaterThanOrEqual(2);
    // Both workers commit chunks all along. A line counting only its own worker's chunks has done =
    // the chunks done before it started plus executedNow: done - executedNow stays the same from
    // line to line. Counting the other worker's too, it grows.
    const others = (pid: number) => progress.filter((p) => p.pid === pid).map((p) => p.done - p.executedNow);
    const grew = [...new Set(progress.map((p) => p.pid))].map((pid) => Math.max(...others(pid)) - Math.min(...others(pid)));
    expect(Math.max(...grew), JSON.stringify(progress)).toBeGreaterThanOrEqual(10);
    for (const p of progress) expect(p.done).toBeLessThanOrEqual(120);
  });

  it('a plain run while workers share the run exits 75 at once; --wait waits and then finds it done', async () => {
    const first = join('plain', 400, 30);
    const second = join('plain', 400, 30);
    await waitFor(async () => ((await doneCount('plain')) >= 3 ? true : undefined), 'the shared run to be under way');
    const plain = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params(400, 30), '--key', 'plain'], { url });
    expect(plain.code).toBe(75);
    // status names both live workers (host:pid) with their chunks and rate.
    const status = await runCli([...FIXTURE_DIRS, 'status', 'counted', '--json'], { url });
    const run = (JSON.parse(status.stdout) as Array<{ runKey: string; state: string; workers: Array<{ worker: string; chunks: number; rate: number }> }>).find((r) => r.runKey === 'plain');
    expect(run?.state).toBe('running');
    expect(run?.workers).toHaveLength(2);
    expect(run?.workers.map((w) => w.worker).sort()).toEqual([first.pid, second.pid].map((pid) => `${os.hostname()}:${pid}`).sort());
    expect(run!.workers.reduce((n, w) => n + w.chunks, 0)).toBeGreaterThan(0);
    const waiting = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params(400, 30), '--key', 'plain', '--wait', '90'], { url, timeoutMs: 120_000 });
    expect(waiting.code).toBe(0);
    expect(waiting.stdout).toMatch(/already/);
    expect((await Promise.all([first.done, second.done])).map((r) => r.code)).toEqual([0, 0]);
    await expectExactlyOnce('plain', 400);
  });

  it('SIGTERM stops only that worker (its in-flight chunk committed); a SIGKILLed worker loses nothing; the others finish the run', async () => {
    const workers: CliProcess[] = Array.from({ length: 3 }, () => join('kill', 150, 40));
    // All three are in (a worker that starts late would find the run interrupted, not shared).
    await waitFor(async () => ((await sessions(url, 'idem-lock')) === 3 && (await doneCount('kill')) >= 10 ? true : undefined), 'three workers on the run', { timeoutMs: 60_000 });
    workers[0]!.child.kill('SIGTERM');
    const stopped = await workers[0]!.done;
    expect(stopped.code).toBe(143);
    expect(stopped.stderr).toContain('worker stopped; 2 other workers were still on the run');
    // Its last line says the run goes on elsewhere, not that the user must rerun to resume it.
    const last = stopped.stderr.trim().split('\n').at(-1)!;
    expect(last).toMatch(/^idem: .*SIGTERM.*; 2 other workers were still on the run as it left/);
    expect(last).not.toMatch(/run the same command again to resume/);
    workers[1]!.child.kill('SIGKILL');
    const results = await Promise.all(workers.slice(1).map((w) => w.done));
    expect(results[0]!.signal).toBe('SIGKILL');
    expect(results[1]!.code).toBe(0);
    await expectExactlyOnce('kill', 150);
  });
});

describe('idem status of a shared run', () => {
  it('names a live worker as the holder once the first one died, and rates each worker over its own time when younger than a minute', async () => {
    const first = join('status-holder', 300, 40);
    await waitFor(async () => ((await sessions(url, 'idem-lock')) === 1 && (await doneCount('status-holder')) >= 2 ? true : undefined), 'the first worker under way');
    const second = join('status-holder', 300, 40);
    const secondStarted = Date.now();
    await waitFor(async () => ((await sessions(url, 'idem-lock')) === 2 ? true : undefined), 'the second worker joined');
    first.child.kill('SIGKILL');
    expect((await first.done).signal).toBe('SIGKILL');
    await waitFor(async () => ((await sessions(url, 'idem-lock')) === 1 ? true : undefined), 'the killed worker gone');
    await new Promise((r) => setTimeout(r, 2_000));
    const status = await runCli([...FIXTURE_DIRS, 'status', 'counted', '--key', 'status-holder', '--json'], { url });
    const run = JSON.parse(status.stdout) as { state: string; holder: string | null; workers: Array<{ worker: string; chunks: number; rate: number }> };
    const elapsedS = (Date.now() - secondStarted) / 1000;
    const live = `${os.hostname()}:${second.pid}`;
    expect(run.state).toBe('running');
    expect(run.workers.map((w) => w.worker)).toEqual([live]);
    // The run row still names the first worker; status must not show a dead process as the holder.
    expect(run.holder).toBe(live);
    // Rate over the last minute, of a worker that has lived a few seconds: not its chunks / 60.
    const w = run.workers[0]!;
    expect(w.chunks).toBeGreaterThan(5);
    expect(elapsedS).toBeLessThan(30);
    expect(w.rate * elapsedS).toBeGreaterThanOrEqual(w.chunks * 0.5);
    const human = await runCli([...FIXTURE_DIRS, 'status', 'counted', '--key', 'status-holder'], { url });
    expect(human.stdout).toMatch(new RegExp(`held by\\s+${live}`));
    second.child.kill('SIGKILL');
    await second.done;
  });

  it('one answer of idem status --json is one snapshot: run, steps and workers count the same chunks while 3 workers commit', async () => {
    const workers = Array.from({ length: 3 }, () => join('snapshot', 2000, 10));
    try {
      await waitFor(async () => (await query(url, `select count(*)::int as n from work_log where run_key = 'snapshot' and step = 'work'`))[0].n >= 10, 'the workers to commit chunks');
      let samples = 0;
      for (let i = 0; i < 8 && workers.some((w) => w.child.exitCode === null); i++) {
        const r = await runCli([...FIXTURE_DIRS, 'status', 'counted', '--key', 'snapshot', '--json'], { url });
        expect(r.code, r.stderr).toBe(0);
        const v = JSON.parse(r.stdout) as { state: string; chunksDone: number; steps: Array<{ done: number }>; workers: Array<{ chunks: number }> };
        if (v.state !== 'running') break;
        samples++;
        const stepsDone = v.steps.reduce((n, st) => n + st.done, 0);
        expect([v.chunksDone, stepsDone], r.stdout).toEqual([v.chunksDone, v.chunksDone]);
        // Every chunk of this attempt was committed by a worker still alive: the workers' counts add up to the run's, less the first step's chunk.
        const byWorkers = v.workers.reduce((n, w) => n + w.chunks, 0);
        expect(byWorkers, r.stdout).toBeLessThanOrEqual(v.chunksDone);
        expect(byWorkers, r.stdout).toBeGreaterThanOrEqual(v.chunksDone - 1);
      }
      expect(samples).toBeGreaterThan(2);
    } finally {
      for (const w of workers) w.child.kill('SIGKILL');
      await Promise.all(workers.map((w) => w.done));
    }
  });

  it('every session of a worker is named after it in pg_stat_activity: its work sessions `idem host:pid`, its lock session `idem-lock host:pid`', async () => {
    const first = join('session-names', 300, 40);
    const second = join('session-names', 300, 40);
    await waitFor(async () => ((await sessions(url, 'idem-lock')) === 2 && (await doneCount('session-names')) >= 4 ? true : undefined), 'both workers under way');
    const names = async () =>
      (await query<{ name: string }>(url, `select application_name as name from pg_stat_activity where datname = current_database() and application_name like 'idem%'`)).map((r) => r.name);
    const byWorker = await waitFor(async () => {
      const seen = await names();
      const per = [first, second].map((w) => seen.filter((n) => n === `idem ${os.hostname()}:${w.pid}`).length);
      return per.every((n) => n > 0) ? { seen, per } : undefined;
    }, 'each worker\'s work sessions, named after it');
    expect(byWorker.per.every((n) => n >= 1)).toBe(true);
    // No work session is left anonymous: an operator can tell every backend's worker.
    expect(byWorker.seen.filter((n) => n === 'idem')).toEqual([]);
    expect(byWorker.seen.filter((n) => n.startsWith('idem-lock ')).sort()).toEqual([first, second].map((w) => `idem-lock ${os.hostname()}:${w.pid}`).sort());
    for (const w of [first, second]) w.child.kill('SIGKILL');
    await Promise.all([first.done, second.done]);
  });

  it('a session name longer than PostgreSQL keeps (63 bytes) is cut at a character boundary, not inside one', () => {
    expect(sessionName('idem', 'h:1')).toBe('idem h:1');
    // 10 bytes of 'idem-lock ', then two-byte characters: the 27th would end at byte 64.
    const long = sessionName('idem-lock', `${'ä'.repeat(40)}:12345`);
    expect(long).toBe(`idem-lock ${'ä'.repeat(26)}`);
    expect(Buffer.byteLength(long)).toBe(62);
    expect(Buffer.byteLength(sessionName('idem', `${'h'.repeat(80)}:1`))).toBe(63);
  });
});

// Black-box round 13: containers that share the host's name (`docker run --network host`, pods
// with hostNetwork) are each pid 1 in their own PID namespace. Each must still be a worker of its own.
const unshare = ['unshare', '--pid', '--fork', '--mount-proc', '--kill-child'];
const unshareUnavailable = (() => {
  const r = spawnSync(unshare[0]!, [...unshare.slice(1), 'true'], { encoding: 'utf8' });
  return r.status === 0 ? null : `${unshare.join(' ')} failed (it needs root or user namespaces): ${(r.stderr || r.error?.message || '').trim()}`;
})();
if (unshareUnavailable) console.warn(`PID-namespace workers test skipped: ${unshareUnavailable}`);

describe('a worker\'s name', () => {
  it('is host:pid in the initial PID namespace, or where /proc cannot tell; host:pid/<random> in any other', () => {
    expect(workerName('h', 42, INIT_PID_NAMESPACE)).toBe('h:42');
    expect(workerName('h', 42, null)).toBe('h:42');
    expect(workerName('h', 1, 'pid:[4026532180]', () => '0a1b2c3d')).toBe('h:1/0a1b2c3d');
    // Random per process: a restarted container's namespace may get the same inode again.
    const [a, b] = [workerName('h', 1, 'pid:[4026532180]'), workerName('h', 1, 'pid:[4026532180]')];
    expect(a).toMatch(/^h:1\/[0-9a-f]{8}$/);
    expect(b).not.toBe(a);
    // This process (the test runner) is in the initial namespace here.
    expect(WORKER).toBe(`${os.hostname()}:${process.pid}`);
  });

  it('keeps its pid and suffix whole in the 63 bytes of application_name: a long host name is cut instead, at a character boundary', () => {
    const name = workerName('ä'.repeat(40), 12345, 'pid:[4026532180]', () => '0a1b2c3d');
    expect(name).toBe(`${'ä'.repeat(19)}:12345/0a1b2c3d`);
    // The session's name is the whole worker name: status matches it against the chunks' done_by.
    expect(sessionName('idem-lock', name)).toBe(`idem-lock ${name}`);
    expect(Buffer.byteLength(sessionName('idem-lock', name))).toBe(63);
    expect(workerName('h'.repeat(80), 1, INIT_PID_NAMESPACE)).toBe(`${'h'.repeat(51)}:1`);
    expect(sessionName('idem-lock', workerName('h'.repeat(80), 1, INIT_PID_NAMESPACE))).toHaveLength(63);
  });
});

describe.skipIf(unshareUnavailable !== null)('workers in PID namespaces of their own', () => {
  it('two workers, both pid 1 on the same host, are two workers in idem status, each with its own chunks and lock session', async () => {
    const inNamespace = () =>
      spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params(400, 30), '--key', 'pid-namespaces', '--join'], { url, timeoutMs: 120_000, prefix: unshare });
    const workers = [inNamespace(), inNamespace()];
    try {
      await waitFor(async () => ((await sessions(url, 'idem-lock')) === 2 && (await doneCount('pid-namespaces')) >= 4 ? true : undefined), 'both workers under way', { timeoutMs: 60_000 });
      // Both really are pid 1 (the fixture logs process.pid with every chunk).
      expect(await query(url, `select distinct pid from work_log where run_key = 'pid-namespaces'`)).toEqual([{ pid: 1 }]);
      type Status = { state: string; workers: Array<{ worker: string; chunks: number }> };
      const run = await waitFor(async () => {
        const r = await runCli([...FIXTURE_DIRS, 'status', 'counted', '--key', 'pid-namespaces', '--json'], { url });
        const v = JSON.parse(r.stdout) as Status;
        return v.state !== 'running' || (v.workers.length === 2 && v.workers.every((w) => w.chunks > 0)) ? v : undefined;
      }, 'status to show both workers with chunks', { timeoutMs: 30_000 });
      expect(run.state).toBe('running');
      const names = run.workers.map((w) => w.worker);
      expect(new Set(names).size, JSON.stringify(run)).toBe(2);
      for (const n of names) expect(n).toMatch(new RegExp(`^${os.hostname()}:1/[0-9a-f]{8}$`));
      const locks = await query<{ name: string }>(url, `select application_name as name from pg_stat_activity where datname = current_database() and application_name like 'idem-lock %' order by 1`);
      expect(locks.map((l) => l.name)).toEqual(names.map((n) => `idem-lock ${n}`).sort());
      const results = await Promise.all(workers.map((w) => w.done));
      expect(results.map((r) => r.code)).toEqual([0, 0]);
      await expectExactlyOnce('pid-namespaces', 400);
    } finally {
      for (const w of workers) w.child.kill('SIGKILL');
    }
  });
});

describe('operating a shared run', () => {
  it('idem pause reaches every worker: each exits 75, none goes on committing into the paused run', async () => {
    const workers: CliProcess[] = Array.from({ length: 3 }, () => join('pause-all', 400, 60, ['--concurrency', '2']));
    await waitFor(async () => ((await sessions(url, 'idem-lock')) === 3 && (await doneCount('pause-all')) >= 10 ? true : undefined), 'three workers on the run', { timeoutMs: 60_000 });
    const paused = await runCli([...FIXTURE_DIRS, 'pause', 'counted', '--key', 'pause-all'], { url });
    expect(paused.code).toBe(0);
    const results = await Promise.all(workers.map((w) => w.done));
    expect(results.map((r) => r.code)).toEqual([75, 75, 75]);
    const [row] = await query<{ status: string }>(url, `select status from idem.runs where run_key = 'pause-all'`);
    expect(row?.status).toBe('paused');
    expect(await doneCount('pause-all')).toBeLessThan(400);
    const resumed = await runCli([...FIXTURE_DIRS, 'resume', 'counted', '--key', 'pause-all'], { url });
    expect(resumed.code).toBe(0);
    const rest = await Promise.all([join('pause-all', 400, 60, ['--concurrency', '4']), join('pause-all', 400, 60, ['--concurrency', '4'])].map((w) => w.done));
    expect(rest.map((r) => r.code)).toEqual([0, 0]);
    expect(await query(url, `select chunk_key from work_log where run_key = 'pause-all' and step = 'work' group by chunk_key having count(*) <> 1`)).toEqual([]);
    expect(await query(url, `select count(distinct chunk_key)::int as n from work_log where run_key = 'pause-all' and step = 'work'`)).toEqual([{ n: 400 }]);
  });
});

describe('a paused shared run', () => {
  it('reads paused only once every worker has stopped: no chunk commits after it reads paused', async () => {
    const workers: CliProcess[] = Array.from({ length: 3 }, () => join('pause-last', 300, 300, ['--concurrency', '2']));
    await waitFor(async () => ((await sessions(url, 'idem-lock')) === 3 && (await doneCount('pause-last')) >= 6 ? true : undefined), 'three workers on the run', { timeoutMs: 60_000 });
    const paused = await runCli([...FIXTURE_DIRS, 'pause', 'counted', '--key', 'pause-last'], { url });
    expect(paused.code).toBe(0);
    // The moment it reads paused (as a client waiting for it would), what has committed.
    const atPaused = await waitFor(
      async () => {
        const [row] = await query<{ status: string; n: number }>(
          url,
          `select status, (select count(*)::int from work_log where run_key = 'pause-last' and step = 'work') as n from idem.runs where run_key = 'pause-last'`,
        );
        return row?.status === 'paused' ? row.n : undefined;
      },
      'the run to read paused',
      { timeoutMs: 30_000, intervalMs: 5 },
    );
    const results = await Promise.all(workers.map((w) => w.done));
    expect(results.map((r) => r.code)).toEqual([75, 75, 75]);
    // Before: the first worker to stop marked it paused while the others' chunks were still in flight.
    expect(await doneCount('pause-last')).toBe(atPaused);
    expect(await query(url, `select status, requested from idem.runs where run_key = 'pause-last'`)).toEqual([{ status: 'paused', requested: null }]);
  });
});

/**
 * Two workers with a chunk each held at a gate; an operator pauses the run, both workers see it,
 * then `then` (resume or cancel) is run before the gate opens. Returns how the workers ended.
 */
async function pauseThen(key: string, then: 'resume' | 'cancel'): Promise<Array<Awaited<CliProcess['done']>>> {
  const gate = await holdGate(url, key);
  let workers: CliProcess[] = [];
  try {
    workers = Array.from({ length: 2 }, () => join(key, 20, 0, [], key));
    await waitFor(async () => (await lockWaiters(url)) >= 2, 'both workers to have a chunk in flight at the gate', { timeoutMs: 60_000 });
    expect((await runCli([...FIXTURE_DIRS, 'pause', 'counted', '--key', key], { url })).code).toBe(0);
    await waitFor(async () => workers.every((w) => w.stderr().includes('pause requested by an operator')), 'both workers to see the pause', { timeoutMs: 10_000 });
    const operator = await runCli([...FIXTURE_DIRS, then, 'counted', '--key', key], { url });
    expect(operator.code, operator.stderr).toBe(0);
  } finally {
    await gate.release();
  }
  return Promise.all(workers.map((w) => w.done));
}

describe('a pause withdrawn while the workers were stopping for it', () => {
  it('no worker says the run will read paused: the first says the pause was withdrawn, the last ends it interrupted', async () => {
    const key = 'pause-withdrawn';
    const results = await pauseThen(key, 'resume');
    expect(results.map((r) => r.code)).toEqual([75, 75]);
    const last = results.map((r) => busyMessage(r.stderr) ?? r.stderr);
    for (const l of last) expect(l).not.toContain('reads paused');
    expect(last.filter((l) => l.includes('withdrawn')), last.join('\n')).toHaveLength(2);
    expect(await query(url, `select status, requested from idem.runs where run_key = $1`, [key])).toEqual([{ status: 'interrupted', requested: null }]);
  });
});

describe('a pause replaced by a cancel while the workers were stopping for it', () => {
  it('every worker reports the cancel (exit 1), none says the pause was withdrawn; the run reads cancelled', async () => {
    // Black-box round 18 (B9-1): a worker that was not the last to stop said "pause withdrawn
    // (resumed) … run the same command again" and exited 75; nobody had resumed anything.
    const key = 'pause-then-cancel';
    const results = await pauseThen(key, 'cancel');
    expect(results.map((r) => r.code), results.map((r) => r.stderr).join('\n')).toEqual([1, 1]);
    for (const r of results) {
      expect(r.stderr).not.toContain('withdrawn');
      expect(r.stderr).toMatch(/cancelled by an operator/);
    }
    expect(await query(url, `select status from idem.runs where run_key = $1`, [key])).toEqual([{ status: 'cancelled' }]);
  });
});

describe('every worker stopped at once', () => {
  it('SIGTERM to all workers together (a deploy, a scale-down) records the run interrupted, not left running without a holder', async () => {
    for (let round = 0; round < 3; round++) {
      const key = `all-term-${round}`;
      const gate = await holdGate(url, key);
      const p = JSON.stringify({ chunks: 200, pauseMs: 0, label: 'x', gate: key });
      const workers = Array.from({ length: 3 }, () =>
        spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', p, '--key', key, '--join', '--concurrency', '2'], { url, timeoutMs: 60_000 }),
      );
      try {
        // Every worker is in, its chunks held at the gate; they all end their chunks at one instant.
        await waitFor(async () => ((await sessions(url, 'idem-lock')) === 3 ? true : undefined), 'three workers on the run');
        await waitFor(async () => ((await lockWaiters(url, 'idem')) === 6 ? true : undefined), 'six chunks at the gate');
        for (const w of workers) w.child.kill('SIGTERM');
        await new Promise((r) => setTimeout(r, 300));
      } finally {
        await gate.release();
      }
      const results = await Promise.all(workers.map((w) => w.done));
      expect(results.map((r) => r.code)).toEqual([143, 143, 143]);
      const [row] = await query<{ status: string }>(url, `select status from idem.runs where run_key = $1`, [key]);
      expect(row?.status, `round ${round}`).toBe('interrupted');
    }
  });

  it('a chunk that keeps failing transiently gets the retry budget once for the whole run, not once per worker, with its backoff', async () => {
    // c0005 raises 40001 on every try (fixture_tries counts tries across processes: a sequence is
    // not rolled back). The fixture's retry: 5 tries, backoff 10-50 ms.
    await query(url, `insert into fail_chunks (chunk_key, sqlstate, times) values ('c0005', '40001', 1000000)`);
    await query(url, 'alter sequence fixture_tries restart');
    // Every chunk waits at a gate until all three workers hold one: a worker that started late
    // (a loaded machine) would otherwise find the run failed already and resume it, a new budget.
    const gate = await holdGate(url, 'g-budget');
    try {
      const workers = Array.from({ length: 3 }, () => join('budget', 200, 20, [], 'g-budget'));
      try {
        await waitFor(async () => (await lockWaiters(url)) >= 3, 'all three workers at the gate', { timeoutMs: 60_000 });
      } finally {
        await gate.release();
      }
      const results = await Promise.all(workers.map((w) => w.done));
      expect(results.map((r) => r.code)).toEqual([1, 1, 1]);
      const [seq] = await query<{ tries: string }>(url, `select last_value as tries from fixture_tries`);
      expect(Number(seq!.tries)).toBe(5);
      expect(await query(url, `select status, error->>'chunk' as chunk, (error->>'tries')::int as tries from idem.runs where run_key = 'budget'`)).toEqual([{ status: 'failed', chunk: 'c0005', tries: 5 }]);
      // The worker that spent the last try says so; the others stop, as the run failed elsewhere.
      expect(results.filter((r) => /failed in step "work", chunk c0005 after 5 tries/.test(r.stderr))).toHaveLength(1);
      expect(await query(url, `select attempts from idem.chunks c join idem.runs r on r.id = c.run_id where r.run_key = 'budget' and c.key = 'c0005'`)).toEqual([{ attempts: 5 }]);
    } finally {
      await query(url, `delete from fail_chunks`);
    }
  });

  it('--max-rate is the run\'s rate: 3 workers with --max-rate 5 start 5 chunks a second between them, not 5 each', async () => {
    const workers = Array.from({ length: 3 }, () => join('rate', 16, 0, ['--max-rate', '5']));
    const results = await Promise.all(workers.map((w) => w.done));
    expect(results.map((r) => r.code)).toEqual([0, 0, 0]);
    await expectExactlyOnce('rate', 16);
    const times = (await query<{ t: number }>(url, `select extract(epoch from c.done_at) * 1000 as t from idem.chunks c join idem.runs r on r.id = c.run_id
      where r.run_key = 'rate' and c.step = 'work' order by c.done_at`)).map((r) => Number(r.t));
    expect(times).toHaveLength(16);
    // Starts are 200 ms apart, whichever worker made them; commits follow them by the chunk's own
    // time, which for the first chunks of a worker includes its connection's set-up. From the
    // third commit to the last: 13 intervals, 2 600 ms at 5 a second (at 5 a second per worker,
    // 3 workers took about a third of it: 934 ms for all 16 before the rate was the run's).
    const span = times.at(-1)! - times[2]!;
    expect(span).toBeGreaterThanOrEqual(2_000);
    console.log(`3 workers, --max-rate 5: 16 chunks over ${Math.round(times.at(-1)! - times[0]!)} ms, the last 14 over ${Math.round(span)} ms`);
  });
});

describe("a worker's last-pass claim, waiting for a chunk another worker holds", () => {
  /** The worker's sessions waiting on a lock: its last-pass claim blocked on the other's chunk. */
  const claimWaiting = async (w: CliProcess) =>
    (await query(url, `select 1 from pg_stat_activity where datname = current_database() and application_name like 'idem %:' || $1 and wait_event_type = 'Lock'`, [String(w.pid)])).length > 0 ? true : undefined;

  it("is cut short by the role's statement_timeout: it claims again, and the run is not failed in step \"(runner)\"", async () => {
    // Review of stop 34 (2): a statement_timeout (or lock_timeout) shorter than another worker's
    // chunk cancelled the waiting claim, and its 57014 failed the whole run in step "(runner)".
    const key = 'wait-claim-timeout';
    // The holder's chunk is held at a gate (not a fixed sleep) until the joiner has waited past its
    // statement_timeout a few times: on a loaded machine the joiner took longer to start than a
    // 4 s chunk lasted, and never waited at all.
    const gate = await holdGate(url, key);
    let holder: CliProcess | undefined;
    let waiter: CliProcess | undefined;
    try {
      holder = join(key, 1, 0, [], key);
      await waitFor(async () => ((await lockWaiters(url)) >= 1 ? true : undefined), 'the chunk held at the gate', { timeoutMs: 60_000 });
      const timed = `${url}${url.includes('?') ? '&' : '?'}options=${encodeURIComponent('-c statement_timeout=700')}`;
      waiter = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params(1, 0, key), '--key', key, '--join'], { url: timed, timeoutMs: 60_000 });
      const w = waiter;
      await waitFor(() => claimWaiting(w), 'the joiner waiting to claim the held chunk', { timeoutMs: 60_000 });
      await new Promise((r) => setTimeout(r, 2_500));
    } finally {
      await gate.release();
    }
    const [held, waited] = await Promise.all([holder!.done, waiter!.done]);
    expect(held.code, held.stderr).toBe(0);
    expect(waited.code, waited.stderr).toBe(0);
    expect(waited.stderr).not.toContain('(runner)');
    await expectExactlyOnce(key, 1);
  });

  it('ends at the first SIGTERM: the worker leaves at once (exit 143), not at the shutdown deadline, and the run goes on', async () => {
    // Review of stop 34 (3): the claim blocked on the other worker's row lock until the deadline
    // (--shutdown-timeout), then the process was forced out without recording how it left.
    const key = 'wait-claim-sigterm';
    const holder = join(key, 1, 8_000);
    await waitFor(async () => ((await query(url, `select 1 from pg_stat_activity where application_name like 'idem %:' || $1 and query like '%pg_sleep%' and state = 'active'`, [String(holder.pid)])).length > 0 ? true : undefined), 'the chunk in its pg_sleep');
    const waiter = join(key, 1, 8_000, ['--shutdown-timeout', '20']);
    await waitFor(() => claimWaiting(waiter), 'the joiner waiting to claim the held chunk');
    const t0 = Date.now();
    waiter.child.kill('SIGTERM');
    const stopped = await waiter.done;
    expect(Date.now() - t0, 'left at once').toBeLessThan(3_000);
    expect(stopped.code, stopped.stderr).toBe(143);
    expect(stopped.stderr).toContain('worker stopped; 1 other worker was still on the run');
    expect(stopped.stderr).not.toContain('(runner)');
    const held = await holder.done;
    expect(held.code, held.stderr).toBe(0);
    await expectExactlyOnce(key, 1);
  });
});
