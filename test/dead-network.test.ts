import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { FIXTURE_DIRS, query, spawnCli, waitFor } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { startBlackholeProxy, type BlackholeProxy } from './support/blackhole-proxy.ts';

// Issue 8, item 4: a dead network is a lost lock, noticed within a bounded time.

const database = useTestDatabase({ fixtureTables: true });
let proxy: BlackholeProxy;
beforeAll(async () => {
  proxy = await startBlackholeProxy(Number(new URL(database.url).port));
});
afterAll(() => proxy?.close());

describe('a network that goes dead mid-run', () => {
  it('the cut-off process notices, abandons its in-flight chunks and exits 69 within 30 s of the cut', async () => {
    const viaProxy = new URL(database.url);
    viaProxy.port = String(proxy.port);
    const params = JSON.stringify({ chunks: 400, pauseMs: 50, label: 'x', gate: null });
    const proc = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', 'cut', '--concurrency', '2'], { url: viaProxy.toString(), timeoutMs: 120_000 });
    await waitFor(async () => {
      const n = (await query<{ n: number }>(database.url, `select count(*)::int as n from work_log where run_key = 'cut' and step = 'work'`))[0]?.n ?? 0;
      return n >= 5 || undefined;
    }, 'the run to commit a few chunks', { timeoutMs: 60_000 });
    proxy.cut();
    const cutAt = Date.now();
    const result = await proc.done;
    const seconds = (result.endedAt - cutAt) / 1000;
    console.log(`dead network: the cut-off process exited ${result.code} ${seconds.toFixed(1)} s after the cut`);
    expect(result.timedOut).toBe(false);
    expect(result.code).toBe(69);
    expect(result.stderr).toMatch(/lost the advisory lock for job "counted": its session did not answer within 5s/);
    expect(seconds).toBeLessThan(30);
    // The run was lost, not failed: its row still says running (a successor resumes it).
    expect(await query(database.url, `select status from idem.runs where run_key = 'cut'`)).toEqual([{ status: 'running' }]);
  }, 120_000);
});
