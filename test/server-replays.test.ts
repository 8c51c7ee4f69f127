import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { killLeftovers, query, runCli, waitFor } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { api, startServe, type ServeProcess } from './support/server.ts';

const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
let url: string;
let server: ServeProcess;

beforeAll(async () => {
  url = testDb.url;
  server = await startServe(url, ['--max-runs', '2']);
});

afterAll(killLeftovers);

const post = (key: string, body: unknown) => api(server.base, 'POST', '/api/jobs/counted/runs', { body, key });

/** One series of /metrics (0 when absent). */
async function metric(series: string): Promise<number> {
  const { text } = await api(server.base, 'GET', '/metrics');
  const line = text.split('\n').find((l) => l.startsWith(`${series} `));
  return line ? Number(line.slice(series.length + 1)) : 0;
}

/** idem_api_replays_total{source}. */
const replays = (source: 'memory' | 'database') => metric(`idem_api_replays_total{source="${source}"}`);

/** Starts a run over HTTP and waits for it to succeed; returns its id. */
async function succeededRun(key: string, chunks = 2): Promise<string> {
  const created = await post(key, { chunks });
  expect(created.status, created.text).toBe(201);
  const done = await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`);
  expect(done.body.state).toBe('succeeded');
  return created.body.id as string;
}

/** The session the server listens on for changed runs (the cache is on while it listens). */
async function listenerPids(): Promise<number[]> {
  const rows = await query<{ pid: number }>(url, `select pid from pg_stat_activity where application_name = 'idem serve (replays)' and datname = current_database()`);
  return rows.map((r) => r.pid);
}

describe('replays of succeeded runs come from memory', () => {
  it('answers them without PostgreSQL, the same answer as the database gave', async () => {
    const id = await succeededRun('k-memory');
    const first = await post('k-memory', { chunks: 2 });
    const before = { memory: await replays('memory'), database: await replays('database') };
    const second = await post('k-memory', { chunks: 2 });
    expect(second.status).toBe(200);
    expect(second.headers.get('idempotent-replayed')).toBe('true');
    expect(second.headers.get('location')).toBe(`/api/runs/${id}`);
    expect(second.headers.get('content-type')).toMatch(/^application\/json/);
    expect(second.body).toEqual(first.body);
    expect(await replays('memory')).toBe(before.memory + 1);
    expect(await replays('database')).toBe(before.database);
    // Other params are still a 422 naming both fingerprints, from memory too.
    const other = await post('k-memory', { chunks: 3 });
    expect(other.status).toBe(422);
    expect(other.body.detail).toContain(first.body.fingerprint);
    expect(await query(url, `select count(*)::int as n from idem.runs where run_key = 'k-memory'`)).toEqual([{ n: 1 }]);
  });

  it('holds a run this server executed from the moment it succeeded: even the first replay needs no read', async () => {
    const held = await metric('idem_api_replay_cache_runs');
    const id = await succeededRun('k-warm');
    // The view is read right after the execution ends, which the long-poll may see a moment sooner.
    await waitFor(async () => ((await metric('idem_api_replay_cache_runs')) > held ? true : undefined), 'the run in the cache', { timeoutMs: 5_000 });
    const before = { memory: await replays('memory'), database: await replays('database') };
    const first = await post('k-warm', { chunks: 2 });
    expect(first.status).toBe(200);
    expect(first.body.id).toBe(id);
    expect(await replays('memory')).toBe(before.memory + 1);
    expect(await replays('database')).toBe(before.database);
  });

  it('forgets a run that idem reset removed: the key starts a new run (201)', async () => {
    const id = await succeededRun('k-reset');
    await post('k-reset', { chunks: 2 });
    expect((await post('k-reset', { chunks: 2 })).status).toBe(200);
    const reset = await runCli(['reset', 'counted', '--key', 'k-reset'], { url });
    expect(reset.code, reset.stderr).toBe(0);
    const again = await post('k-reset', { chunks: 2 });
    expect(again.status, again.text).toBe(201);
    expect(again.body.id).not.toBe(id);
  });

  it('forgets a run changed or deleted by hand-written SQL, and all runs on TRUNCATE', async () => {
    const changed = await succeededRun('k-sql-update');
    await post('k-sql-update', { chunks: 2 });
    await query(url, `update idem.runs set status = 'failed', finished_at = null where id = ${changed}`);
    // The notification reaches the server a moment after the commit (README: a replay sent the
    // instant the change commits can still get the old answer), under load more than a moment.
    const afterUpdate = await waitFor(async () => {
      const r = await post('k-sql-update', { chunks: 2 });
      return r.body.state === 'failed' ? r : undefined;
    }, 'the update to reach the server', { timeoutMs: 5_000 });
    expect(afterUpdate.status).toBe(200);

    const deleted = await succeededRun('k-sql-delete');
    await post('k-sql-delete', { chunks: 2 });
    await query(url, `delete from idem.runs where id = ${deleted}`);
    const afterDelete = await waitFor(async () => {
      const r = await post('k-sql-delete', { chunks: 2 });
      return r.status === 201 ? r : undefined;
    }, 'the delete to reach the server', { timeoutMs: 5_000 });
    await api(server.base, 'GET', `/api/runs/${afterDelete.body.id}?wait=30`);

    const kept = await post('k-sql-delete', { chunks: 2 });
    expect(kept.status).toBe(200);
    expect((await post('k-sql-delete', { chunks: 2 })).body.id).toBe(afterDelete.body.id);
    await query(url, 'truncate idem.runs cascade');
    const afterTruncate = await waitFor(async () => {
      const r = await post('k-sql-delete', { chunks: 2 });
      return r.status === 201 ? r : undefined;
    }, 'the truncate to reach the server', { timeoutMs: 5_000 });
    await api(server.base, 'GET', `/api/runs/${afterTruncate.body.id}?wait=30`);
  });

  it('reads PostgreSQL while its listening session is lost, and uses memory again once it listens again', async () => {
    const id = await succeededRun('k-lost');
    await post('k-lost', { chunks: 2 });
    const [pid] = await listenerPids();
    expect(pid).toBeTypeOf('number');
    await query(url, `select pg_terminate_backend(${pid})`);
    // Whatever the server has noticed yet, a run deleted now must not be replayed.
    await query(url, `delete from idem.runs where id = ${id}`);
    const after = await post('k-lost', { chunks: 2 });
    expect(after.status, after.text).toBe(201);
    await api(server.base, 'GET', `/api/runs/${after.body.id}?wait=30`);
    // A new session listens within the reconnect delay; then replays come from memory again.
    await waitFor(async () => ((await listenerPids()).some((p) => p !== pid) ? true : undefined), 'a new listening session', { timeoutMs: 15_000 });
    await waitFor(
      async () => {
        await post('k-lost', { chunks: 2 });
        const m = await replays('memory');
        await post('k-lost', { chunks: 2 });
        return (await replays('memory')) > m ? true : undefined;
      },
      'replays from memory again',
      { timeoutMs: 15_000 },
    );
  });
});

describe('the memory the replay cache takes is bounded by size, not only by count', () => {
  // A run's answer carries its params, which may be as large as --body-limit (64 KiB by default):
  // 10 000 of them would be 640 MB. Answers are held up to 64 MiB in all, none over 1 MiB.
  let big: ServeProcess;
  const CACHE_BYTES = 8 * 1024 * 1024;
  beforeAll(async () => {
    // The bound made 8 MiB (a test hook; 64 MiB by default): 12 runs of 1 MB reach it, where 68
    // took over a minute of the suite.
    big = await startServe(url, ['--body-limit', String(4 * 1024 * 1024), '--max-runs', '4'], { IDEM_SERVE_REPLAY_CACHE_BYTES: String(CACHE_BYTES) });
  });

  const bigMetric = async (series: string): Promise<number> => {
    const { text } = await api(big.base, 'GET', '/metrics');
    const line = text.split('\n').find((l) => l.startsWith(`${series} `));
    return line ? Number(line.slice(series.length + 1)) : 0;
  };
  const bigReplays = (source: 'memory' | 'database') => bigMetric(`idem_api_replays_total{source="${source}"}`);
  const postBig = (key: string, label: string) => api(big.base, 'POST', '/api/jobs/counted/runs', { body: { chunks: 1, label }, key });
  async function succeeded(key: string, label: string): Promise<void> {
    const created = await postBig(key, label);
    expect(created.status, created.text.slice(0, 300)).toBe(201);
    const done = await api(big.base, 'GET', `/api/runs/${created.body.id}?wait=30`);
    expect(done.body.state).toBe('succeeded');
  }

  it('an answer over 1 MiB is not held: its replays read PostgreSQL', async () => {
    const label = 'h'.repeat(1_200_000);
    // Whatever the other test of this server left held (the order is shuffled), this run adds nothing.
    const held = { runs: await bigMetric('idem_api_replay_cache_runs'), bytes: await bigMetric('idem_api_replay_cache_bytes') };
    await succeeded('k-huge', label);
    // The warm-up read after the execution is asynchronous: give it time to (not) store the run.
    await new Promise((r) => setTimeout(r, 500));
    expect(await bigMetric('idem_api_replay_cache_runs')).toBe(held.runs);
    expect(await bigMetric('idem_api_replay_cache_bytes')).toBe(held.bytes);
    const before = { memory: await bigReplays('memory'), database: await bigReplays('database') };
    for (let i = 0; i < 2; i++) {
      const replay = await postBig('k-huge', label);
      expect(replay.status).toBe(200);
      expect(replay.body.params.label).toBe(label);
    }
    expect(await bigReplays('memory')).toBe(before.memory);
    expect(await bigReplays('database')).toBe(before.database + 2);
    expect(await bigMetric('idem_api_replay_cache_runs')).toBe(held.runs);
  });

  it('at most the bound (64 MiB; 8 MiB here) of answers are held in all, the oldest going first', async () => {
    const n = 12;
    const label = (i: number) => `${String(i).padStart(3, '0')}${'b'.repeat(1_000_000)}`;
    for (let i = 0; i < n; i += 4) {
      await Promise.all(Array.from({ length: Math.min(4, n - i) }, (_, j) => succeeded(`k-big-${i + j}`, label(i + j))));
    }
    // Every run offered to the cache (a replay reads it from PostgreSQL if the warm-up did not hold it).
    for (let i = 0; i < n; i++) expect((await postBig(`k-big-${i}`, label(i))).status).toBe(200);
    const held = await bigMetric('idem_api_replay_cache_runs');
    expect(held).toBeGreaterThan(0);
    expect(held).toBeLessThanOrEqual(Math.floor(CACHE_BYTES / 1_000_000));
    expect(held).toBeLessThan(n);
    expect(await bigMetric('idem_api_replay_cache_bytes')).toBeLessThanOrEqual(CACHE_BYTES);
    expect(await bigMetric('idem_api_replay_cache_bytes')).toBeGreaterThan(held * 1_000_000);
    // The last one offered is held: room is made by letting the oldest go.
    const memory = await bigReplays('memory');
    expect((await postBig(`k-big-${n - 1}`, label(n - 1))).status).toBe(200);
    expect(await bigReplays('memory')).toBe(memory + 1);
  }, 180_000);
});
