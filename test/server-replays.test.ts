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
    const afterUpdate = await post('k-sql-update', { chunks: 2 });
    expect(afterUpdate.status).toBe(200);
    expect(afterUpdate.body.state).toBe('failed');

    const deleted = await succeededRun('k-sql-delete');
    await post('k-sql-delete', { chunks: 2 });
    await query(url, `delete from idem.runs where id = ${deleted}`);
    const afterDelete = await post('k-sql-delete', { chunks: 2 });
    expect(afterDelete.status, afterDelete.text).toBe(201);
    await api(server.base, 'GET', `/api/runs/${afterDelete.body.id}?wait=30`);

    const kept = await post('k-sql-delete', { chunks: 2 });
    expect(kept.status).toBe(200);
    expect((await post('k-sql-delete', { chunks: 2 })).body.id).toBe(afterDelete.body.id);
    await query(url, 'truncate idem.runs cascade');
    const afterTruncate = await post('k-sql-delete', { chunks: 2 });
    expect(afterTruncate.status, afterTruncate.text).toBe(201);
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
