import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { fmtMs } from './measure.ts';
import type { BenchContext, BenchResult } from './report.ts';

const BIN = fileURLToPath(new URL('../../bin/idem.js', import.meta.url));
const JOBS = fileURLToPath(new URL('./jobs', import.meta.url));
const TOKEN = randomBytes(24).toString('hex');
const REQUESTS = 1000;
const CLIENTS = 50;
const REPLAY_P99_GOAL_MS = 20;

function percentile(sorted: readonly number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
}

/** `n` requests by `clients` concurrent workers; every latency, and the wall time of the lot. */
async function load(n: number, clients: number, request: (i: number) => Promise<number>): Promise<{ ms: number; latencies: number[]; statuses: Map<number, number> }> {
  const latencies: number[] = [];
  const statuses = new Map<number, number>();
  let next = 0;
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: clients }, async () => {
      for (let i = next++; i < n; i = next++) {
        const s = performance.now();
        const status = await request(i);
        latencies.push(performance.now() - s);
        statuses.set(status, (statuses.get(status) ?? 0) + 1);
      }
    }),
  );
  return { ms: performance.now() - t0, latencies: latencies.sort((a, b) => a - b), statuses };
}

/**
 * 8. HTTP trigger API: `idem serve` as its own process; 1000 POSTs with distinct Idempotency-Keys
 * from 50 concurrent clients (runs of a one-empty-step job, executed by the server meanwhile), then
 * the same 1000 requests again as replays once every run has finished.
 */
export async function benchHttp(ctx: BenchContext): Promise<BenchResult> {
  const server = spawn(process.execPath, [BIN, '--jobs-dir', JOBS, '--log-level', 'warn', 'serve', '--port', '0', '--max-runs', '4'], {
    env: { ...process.env, DATABASE_URL: ctx.url, IDEM_API_TOKEN: TOKEN, NODE_OPTIONS: '' },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  try {
    const base = await new Promise<string>((resolve, reject) => {
      let out = '';
      server.stdout!.setEncoding('utf8').on('data', (s: string) => {
        out += s;
        const m = /listening on (http:\/\/\S+)/.exec(out);
        if (m) resolve(m[1]!);
      });
      server.once('exit', (code) => reject(new Error(`idem serve exited with ${code}`)));
    });
    const tag = randomBytes(3).toString('hex');
    const post = async (i: number) => {
      const res = await fetch(`${base}/api/jobs/bench-trivial/runs`, {
        method: 'POST',
        headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'idempotency-key': `bench-${tag}-${i}` },
        body: JSON.stringify({ n: i }),
      });
      await res.arrayBuffer();
      return res.status;
    };
    // Warm-up: connections, JIT, prepared plans (its runs are not counted).
    await load(50, 10, (i) => post(REQUESTS + i));
    ctx.log(`http: ${REQUESTS} POSTs with distinct keys, ${CLIENTS} clients`);
    const created = await load(REQUESTS, CLIENTS, post);
    if (created.statuses.get(201) !== REQUESTS) throw new Error(`expected ${REQUESTS} × 201, got ${JSON.stringify([...created.statuses])}`);
    const pool = new pg.Pool({ connectionString: ctx.url, max: 1 });
    try {
      const deadline = Date.now() + 600_000;
      for (;;) {
        const { rows } = await pool.query(`select count(*)::int as n from idem.runs where job = 'bench-trivial' and status <> 'succeeded'`);
        if (rows[0].n === 0) break;
        if (Date.now() > deadline) throw new Error(`${rows[0].n} runs still unfinished after 10 minutes`);
        await new Promise((r) => setTimeout(r, 200));
      }
    } finally {
      await pool.end();
    }
    ctx.log('http: the same requests again (replays)');
    const replayed = await load(REQUESTS, CLIENTS, post);
    if (replayed.statuses.get(200) !== REQUESTS) throw new Error(`expected ${REQUESTS} × 200 replays, got ${JSON.stringify([...replayed.statuses])}`);
    // One client: the cost of one replay without queueing behind 49 others (on a loaded machine,
    // the 50-client percentiles are mostly queueing: p50 ≈ clients / throughput).
    const single = await load(200, 1, post);
    const row = (what: string, r: typeof created, goal: string, met: boolean | null) => ({
      benchmark: `HTTP ${what}`,
      contenders: `idem serve, ${REQUESTS} requests, ${CLIENTS} clients`,
      median: `p50 ${fmtMs(percentile(r.latencies, 50))}, p99 ${fmtMs(percentile(r.latencies, 99))}`,
      ratio: `${Math.round((REQUESTS / r.ms) * 1000)} req/s`,
      goal,
      met,
    });
    return {
      rows: [
        row('POST (new key: claim + 201)', created, 'informational', null),
        row('POST replay (200, Idempotent-Replayed)', replayed, `replay p99 < ${REPLAY_P99_GOAL_MS} ms`, percentile(replayed.latencies, 99) < REPLAY_P99_GOAL_MS),
        { ...row('POST replay, 1 client', single, 'informational', null), contenders: 'idem serve, 200 requests, 1 client', ratio: `${Math.round((200 / single.ms) * 1000)} req/s` },
      ],
      data: {
        created: { ms: created.ms, p50: percentile(created.latencies, 50), p90: percentile(created.latencies, 90), p99: percentile(created.latencies, 99), max: created.latencies.at(-1) },
        single: { ms: single.ms, p50: percentile(single.latencies, 50), p99: percentile(single.latencies, 99) },
        replayed: { ms: replayed.ms, p50: percentile(replayed.latencies, 50), p90: percentile(replayed.latencies, 90), p99: percentile(replayed.latencies, 99), max: replayed.latencies.at(-1) },
      },
    };
  } finally {
    server.kill('SIGTERM');
    await new Promise((r) => (server.exitCode !== null ? r(null) : server.once('exit', r)));
  }
}
