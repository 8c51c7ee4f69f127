import pg from 'pg';
import { beforeAll, describe, expect, it } from 'vitest';
import { Runner } from '../src/index.ts';
import counted, { chunkKey } from './fixtures/jobs/counted.ts';
import { holdGate, query, runRow, waitFor, workCounts } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * README, "What happens when…": the connection to Postgres drops mid-run (pg_terminate_backend on a
 * work connection, not the lock's) → the chunk retries on a new connection; idem's own bookkeeping
 * statements retry the same way. The run goes on in the same attempt.
 */
const testDb = useTestDatabase({ fixtureTables: true, runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});

const ones = (n: number) => new Map(Array.from({ length: n }, (_, i) => [chunkKey(i + 1), 1]));

/** The pid of the one work session (not the lock's) that waits on a lock and whose query matches. */
async function blockedWorkSession(queryLike: string): Promise<number> {
  return waitFor(async () => {
    const rows = await query<{ pid: number }>(
      url,
      `select pid from pg_stat_activity where datname = current_database() and application_name like 'idem %'
         and wait_event_type = 'Lock' and query ilike $1`,
      [queryLike],
    );
    return rows.length === 1 ? rows[0]!.pid : undefined;
  }, `a work session blocked in ${queryLike}`);
}

describe('a work connection killed mid-run', () => {
  it('in a chunk: the chunk retries on a new connection and commits once, in the same attempt', async () => {
    const key = 'killed-in-chunk';
    const gate = await holdGate(url, key);
    const run = runner.run(counted, { key, params: { chunks: 3, gate: key } });
    let killed: number;
    try {
      // c0001 waits at the gate inside its transaction: kill its session there.
      killed = await blockedWorkSession('%gates%');
      expect(await query(url, 'select pg_terminate_backend($1) as ok', [killed])).toEqual([{ ok: true }]);
    } finally {
      await gate.release();
    }
    expect(await run).toMatchObject({ status: 'succeeded', attempt: 1, executed: 5 });
    expect(await workCounts(url, key)).toEqual(ones(3));
    // c0001 committed on another backend than the killed one.
    const [c1] = await query<{ backend_pid: number }>(url, `select backend_pid from work_log where run_key = $1 and chunk_key = 'c0001'`, [key]);
    expect(c1!.backend_pid).not.toBe(killed!);
    expect(await runRow(url, 'counted', key)).toMatchObject({ status: 'succeeded', attempt: 1, error: null });
  });

  it('in a bookkeeping statement (finishing a step): the statement retries and the run succeeds', async () => {
    const key = 'killed-in-bookkeeping';
    const gate = await holdGate(url, key);
    const run = runner.run(counted, { key, params: { chunks: 3, gate: key } });
    const rowLock = new pg.Client({ connectionString: url });
    await rowLock.connect();
    let released = false;
    const releaseRowLock = async () => {
      if (released) return;
      released = true;
      await rowLock.query('rollback');
      await rowLock.end();
    };
    try {
      await blockedWorkSession('%gates%'); // planned, c0001 in flight
      // Hold the `work` step's row: marking the step done must wait here once the chunks are in.
      await rowLock.query('begin');
      await rowLock.query(`select 1 from idem.steps s join idem.runs r on r.id = s.run_id where r.run_key = $1 and s.name = 'work' for update of s`, [key]);
      await gate.release();
      const pid = await blockedWorkSession('%update%steps%done%');
      expect(await workCounts(url, key)).toEqual(ones(3)); // every chunk is in; only the bookkeeping waits
      expect(await query(url, 'select pg_terminate_backend($1) as ok', [pid])).toEqual([{ ok: true }]);
      await releaseRowLock();
    } finally {
      await gate.release();
      await releaseRowLock();
    }
    expect(await run).toMatchObject({ status: 'succeeded', attempt: 1, executed: 5 });
    expect(await workCounts(url, key)).toEqual(ones(3));
    expect(await query(url, `select s.name, s.status from idem.steps s join idem.runs r on r.id = s.run_id where r.run_key = $1 order by s.position`, [key])).toEqual([
      { name: 'prepare', status: 'done' },
      { name: 'work', status: 'done' },
      { name: 'finish', status: 'done' },
    ]);
  });
});
