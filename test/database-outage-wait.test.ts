import { execFileSync } from 'node:child_process';
import path from 'node:path';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { createFixtureTables } from './fixtures/tables.ts';
import { FIXTURE_DIRS, killLeftovers, lines, query, runRow, spawnCli, waitFor } from './support/cli.ts';
import { clusterDir, removeDir, startPrimary, systemPgBin, type Cluster } from './support/pg-cluster.ts';

/**
 * README, `--wait` and `idem finalize --timeout`: a process waiting for a run live in another one
 * rides out a database stopped and started while it waits (the holder exits 69, its lock lost):
 * it keeps trying to reach the server until its deadline, then takes the crashed run over and
 * finishes it. A database still unreachable at the deadline is said in idem's usual line (the URL,
 * password masked, and the fix; exit 2, idem.databaseUnavailable). Black-box: finalize exited 1
 * with pg's bare `connect ECONNREFUSED` (exit 1 reads "the backfill failed" to a deploy), and
 * `run --wait` gave up at once with "cannot open the lock session: connect ECONNREFUSED".
 *
 * A cluster of the test's own, stopped (pg_ctl -m fast) and started again: never the suite's server.
 */
const bin = systemPgBin();
if (!bin) console.warn('database-outage-wait tests skipped: no system PostgreSQL (/usr/lib/postgresql/N/bin)');

describe.skipIf(!bin)('a wait for a live run across a database outage (a cluster of the test\'s own)', () => {
  let dir: string;
  let primary: Cluster;
  const asPostgres = () => (process.getuid?.() === 0 ? { uid: Number(execFileSync('id', ['-u', 'postgres'], { encoding: 'utf8' })), gid: Number(execFileSync('id', ['-g', 'postgres'], { encoding: 'utf8' })) } : {});
  const pgCtl = (args: string[]) => execFileSync(path.join(bin!, 'pg_ctl'), ['-D', primary.dataDir, ...args], { ...asPostgres(), cwd: dir, stdio: 'ignore' });
  const stopServer = () => pgCtl(['-m', 'fast', '-w', 'stop']);
  const startServer = () => pgCtl(['-l', path.join(primary.dataDir, 'server.log'), '-w', 'start']);
  const pause = (ms: number) => new Promise((r) => setTimeout(r, ms));
  /** 16 chunks of 400 ms one at a time: the holder is mid-run for about 6 s. */
  const slow = (key: string) => ['run', 'counted', '--key', key, '--params', JSON.stringify({ chunks: 16, pauseMs: 400 }), '--concurrency', '1'];
  const chunksDone = async (key: string) => (await query<{ n: number }>(primary.url, `select count(distinct chunk_key)::int as n from work_log where run_key = $1 and step = 'work'`, [key]))[0]!.n;

  beforeAll(async () => {
    dir = await clusterDir('idem-outage-');
    primary = await startPrimary(bin!, dir);
    await createFixtureTables(primary.url);
  }, 60_000);
  afterEach(async () => {
    await killLeftovers();
  });
  afterAll(async () => {
    await primary?.stop();
    if (dir) await removeDir(dir);
  });

  /** Starts the slow holder, then `waiter` once the holder is mid-run; stops the server with both on it. */
  async function holderAndWaiter(key: string, waiter: readonly string[]) {
    const holder = spawnCli([...FIXTURE_DIRS, ...slow(key)], { url: primary.url, timeoutMs: 90_000 });
    await waitFor(async () => ((await chunksDone(key).catch(() => 0)) >= 1 ? true : undefined), 'the holder mid-run');
    const w = spawnCli([...FIXTURE_DIRS, ...waiter], { url: primary.url, timeoutMs: 90_000 });
    // The waiter is waiting: run --wait's lock session polls the lock (`idem-lock host:pid`),
    // finalize polls the run on its work sessions (`idem host:pid`), once it has connected.
    const kind = waiter[0] === 'finalize' ? 'idem' : 'idem-lock';
    await waitFor(
      async () => ((await query<{ n: number }>(primary.url, `select count(*)::int as n from pg_stat_activity where application_name like $1`, [`${kind} %:${w.pid}`]))[0]!.n > 0 ? true : undefined),
      'the waiter connected',
    );
    await pause(1_000);
    expect(w.child.exitCode).toBe(null);
    stopServer();
    return { holder, waiter: w };
  }

  it('idem finalize waiting on a run rides out the server stopped for 4 s: the holder exits 69, finalize takes the run over and finishes it (exit 0)', async () => {
    const { holder, waiter } = await holderAndWaiter('out-fin', ['finalize', 'counted', '--key', 'out-fin', '--timeout', '60', '--json']);
    await pause(4_000);
    startServer();
    const h = await holder.done;
    expect(h.code, h.stderr).toBe(69);
    const f = await waiter.done;
    expect(f.code, f.stderr).toBe(0);
    expect(JSON.parse(f.stdout)).toMatchObject({ status: 'succeeded' });
    expect((await runRow(primary.url, 'counted', 'out-fin')).status).toBe('succeeded');
    expect(await chunksDone('out-fin')).toBe(16);
  }, 90_000);

  it('idem run --wait rides out the server stopped for 4 s: the holder exits 69, the waiter takes the run over and finishes it (exit 0)', async () => {
    const { holder, waiter } = await holderAndWaiter('out-wait', [...slow('out-wait'), '--wait', '60', '--json']);
    await pause(4_000);
    startServer();
    const h = await holder.done;
    expect(h.code, h.stderr).toBe(69);
    const w = await waiter.done;
    expect(w.code, w.stderr).toBe(0);
    expect(JSON.parse(w.stdout)).toMatchObject({ status: 'succeeded' });
    expect((await runRow(primary.url, 'counted', 'out-wait')).status).toBe('succeeded');
    expect(await chunksDone('out-wait')).toBe(16);
  }, 90_000);

  const unreachable = (port: number) =>
    new RegExp(`^idem: error: cannot reach the database at postgres://postgres@127\\.0\\.0\\.1:${port}/postgres: connection refused; start the server or fix DATABASE_URL$`);

  it('idem finalize --timeout 4 with the server still down at the deadline exits 2 with idem\'s unreachable-database line, after waiting out its timeout', async () => {
    const { holder, waiter } = await holderAndWaiter('down-fin', ['finalize', 'counted', '--key', 'down-fin', '--timeout', '4', '--json']);
    try {
      const f = await waiter.done;
      expect(f.code, f.stderr).toBe(2);
      // One error line (the warnings before it are the lost sessions, logged as they went).
      expect(lines(f.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([expect.stringMatching(unreachable(primary.port))]);
      expect(lines(f.stderr).at(-1)).toMatch(unreachable(primary.port));
      expect(JSON.parse(f.stdout)).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.databaseUnavailable' });
      // It waited out its --timeout (counted from its connecting, after the process started).
      expect(f.ms).toBeGreaterThanOrEqual(4_000);
      expect((await holder.done).code).toBe(69);
    } finally {
      startServer();
    }
    // The run is left as the holder's crash left it, for the next finalize.
    expect((await runRow(primary.url, 'counted', 'down-fin')).status).toBe('running');
  }, 90_000);

  it('idem run --wait 4 with the server still down at the deadline exits 2 with idem\'s unreachable-database line, after waiting out its --wait', async () => {
    const { holder, waiter } = await holderAndWaiter('down-wait', [...slow('down-wait'), '--wait', '4', '--json']);
    try {
      const w = await waiter.done;
      expect(w.code, w.stderr).toBe(2);
      // One error line (the warnings before it are the lost sessions, logged as they went).
      expect(lines(w.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([expect.stringMatching(unreachable(primary.port))]);
      expect(lines(w.stderr).at(-1)).toMatch(unreachable(primary.port));
      expect(JSON.parse(w.stdout)).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.databaseUnavailable' });
      expect(w.ms).toBeGreaterThanOrEqual(4_000);
      expect((await holder.done).code).toBe(69);
    } finally {
      startServer();
    }
    expect((await runRow(primary.url, 'counted', 'down-wait')).status).toBe('running');
  }, 90_000);
});
