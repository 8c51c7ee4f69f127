import { execFileSync } from 'node:child_process';
import { appendFileSync, writeFileSync } from 'node:fs';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { acquireAdvisoryLock } from '../src/advisory-lock.ts';
import { createFixtureTables } from './fixtures/tables.ts';
import { FIXTURE_DIRS, lines, query, runCli, waitFor } from './support/cli.ts';
import { clusterDir, removeDir, startPrimary, systemPgBin, type Cluster } from './support/pg-cluster.ts';

/**
 * README, Exit codes (2): a server still starting (57P03 "the database system is starting up") is
 * waited for through 10 s of retries, then the command says so in one line. Black-box: a command
 * started during a restart gave up at once, with "check DATABASE_URL" or no fix at all.
 *
 * The server is held in "starting up" by a cluster of the test's own restarted into archive
 * recovery (recovery.signal) whose restore_command sleeps: before redo begins PostgreSQL asks it
 * for two timeline history files and the checkpoint's segment, and refuses every connection with
 * 57P03 "the database system is starting up" meanwhile (3 × the sleep). The command then fails
 * (`false`), PostgreSQL recovers from pg_wal and promotes itself: a primary again.
 */
const bin = systemPgBin();
if (!bin) console.warn('server-starting tests skipped: no system PostgreSQL (/usr/lib/postgresql/N/bin)');

describe.skipIf(!bin)('a server that is starting up (a cluster of the test\'s own)', () => {
  let dir: string;
  let primary: Cluster;
  const asPostgres = () => (process.getuid?.() === 0 ? { uid: Number(execFileSync('id', ['-u', 'postgres'], { encoding: 'utf8' })), gid: Number(execFileSync('id', ['-g', 'postgres'], { encoding: 'utf8' })) } : {});
  const pgCtl = (args: string[]) => execFileSync(path.join(bin!, 'pg_ctl'), ['-D', primary.dataDir, ...args], { ...asPostgres(), cwd: dir, stdio: 'ignore' });

  /** Restarts the server held "starting up" for about 3 × `sleepS` seconds; returns at once. */
  function restartStartingFor(sleepS: number): void {
    pgCtl(['-m', 'immediate', '-w', 'stop']);
    writeFileSync(path.join(primary.dataDir, 'recovery.signal'), '');
    appendFileSync(path.join(primary.dataDir, 'postgresql.conf'), `\nrestore_command = 'sleep ${sleepS}; false'\nhot_standby = off\n`);
    pgCtl(['-l', path.join(primary.dataDir, 'server.log'), '-W', 'start']);
  }
  /** Once the postmaster listens (a moment after pg_ctl start -W): whether it says it is starting up. */
  const startingUp = () =>
    waitFor(
      async () => {
        try {
          await query(primary.url, 'select 1');
          return 'up';
        } catch (err) {
          const message = (err as Error).message;
          return /ECONNREFUSED/.test(message) ? undefined : /the database system is starting up/.test(message) ? 'starting' : message;
        }
      },
      'the server listening',
      { timeoutMs: 5_000, intervalMs: 50 },
    );
  const upAgain = () => waitFor(async () => ((await query<{ r: boolean }>(primary.url, 'select pg_is_in_recovery() as r').catch(() => [{ r: true }]))[0]!.r ? undefined : true), 'the server up again', { timeoutMs: 60_000, intervalMs: 250 });

  beforeAll(async () => {
    dir = await clusterDir('idem-starting-');
    primary = await startPrimary(bin!, dir);
    await createFixtureTables(primary.url);
  }, 60_000);
  afterAll(async () => {
    await primary?.stop();
    if (dir) await removeDir(dir);
  });

  it('a run started while it starts up past the wait exits 2 saying it is starting up and to run the command again, not "check DATABASE_URL"; run again once up, it succeeds', async () => {
    restartStartingFor(4);
    expect(await startingUp()).toBe('starting');
    const args = [...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify({ chunks: 3 }), '--key', 'starting'];
    const r = await runCli(args, { url: primary.url, env: { IDEM_CONNECT_RETRY_MS: '3000' } });
    expect(r.code, r.stderr).toBe(2);
    // It waited (3 s here, 10 s by default) before giving up.
    expect(r.ms).toBeGreaterThanOrEqual(3_000);
    expect(lines(r.stderr)).toEqual([
      expect.stringMatching(/^idem: error: the database at postgres:\/\/postgres@127\.0\.0\.1:\d+\/postgres is starting up or restarting \(the database system is starting up\); run the same command again once it is up$/),
    ]);
    await upAgain();
    const again = await runCli(args, { url: primary.url });
    expect(again.code, again.stderr).toBe(0);
    expect(await query(primary.url, `select count(distinct chunk_key)::int as n from work_log where run_key = 'starting' and step = 'work'`)).toEqual([{ n: 3 }]);
  }, 90_000);

  it('a run started while it starts up for less than the wait waits for it and succeeds', async () => {
    // About 3 s "starting up", then about 3 s in recovery with hot_standby off, then a primary.
    restartStartingFor(1);
    expect(await startingUp()).toBe('starting');
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify({ chunks: 3 }), '--key', 'waited'], { url: primary.url });
    expect(r.code, r.stderr).toBe(0);
    expect(await query(primary.url, `select count(distinct chunk_key)::int as n from work_log where run_key = 'waited' and step = 'work'`)).toEqual([{ n: 3 }]);
  }, 90_000);

  it('the lock session waits for it too, then says it is starting up and to run the command again', async () => {
    restartStartingFor(4);
    expect(await startingUp()).toBe('starting');
    process.env.IDEM_CONNECT_RETRY_MS = '2000';
    const t0 = Date.now();
    try {
      await expect(acquireAdvisoryLock({ connectionString: primary.url, name: 'starting-lock', what: 'job "x"' })).rejects.toThrow(
        /^cannot open the lock session: the database system is starting up; the database is starting up or restarting: run the same command again once it is up$/,
      );
    } finally {
      delete process.env.IDEM_CONNECT_RETRY_MS;
    }
    expect(Date.now() - t0).toBeGreaterThanOrEqual(1_800);
    await upAgain();
    // Once it is up the lock is had (and nothing was left holding it).
    const lock = await acquireAdvisoryLock({ connectionString: primary.url, name: 'starting-lock', what: 'job "x"' });
    await lock.release();
  }, 90_000);
});
