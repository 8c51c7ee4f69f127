import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import http from 'node:http';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { fmtMs, median } from './measure.ts';
import { CLK_TCK, statOf } from './probe.ts';
import type { BenchContext, BenchResult, ReportRow } from './report.ts';

const BIN = fileURLToPath(new URL('../../bin/idem.js', import.meta.url));
const JOBS = fileURLToPath(new URL('./jobs', import.meta.url));
const TOKEN = randomBytes(24).toString('hex');
const REQUESTS = 1000;
const CLIENTS = 50;
const SINGLE = 200;
const REPLAY_P99_GOAL_MS = 20;

function percentile(sorted: readonly number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)]!;
}

interface Load {
  readonly ms: number;
  readonly latencies: number[];
  readonly statuses: Map<number, number>;
}

/** `n` requests by `clients` concurrent workers; every latency, and the wall time of the lot. */
async function load(n: number, clients: number, request: (i: number) => Promise<number>): Promise<Load> {
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

/** CPU ms per request of the three parties that share the machine: client (this process), server, PostgreSQL. */
interface CpuSplit {
  readonly client: number;
  readonly server: number;
  readonly pg: number | null;
}

function cpuText(c: CpuSplit): string {
  return `client ${c.client.toFixed(2)}, server ${c.server.toFixed(2)}, postgres ${c.pg === null ? 'n/a' : c.pg.toFixed(2)} ms`;
}

async function withCpu(ctx: BenchContext, serverPid: number, n: number, f: () => Promise<Load>): Promise<Load & { cpu: CpuSplit }> {
  const ticks = () => {
    const s = statOf(serverPid);
    return s ? s.utime + s.stime : 0;
  };
  const start = await ctx.probe.snapshot();
  const server0 = ticks();
  const r = await f();
  const server1 = ticks();
  const cost = await ctx.probe.since(start);
  return { ...r, cpu: { client: cost.nodeCpuMs / n, server: ((server1 - server0) * 1000) / CLK_TCK / n, pg: cost.pgCpuMs === null ? null : cost.pgCpuMs / n } };
}

/**
 * The load generator's request. node:http with a keep-alive agent, one socket per client: fetch
 * (undici) spent ~0.8 ms of CPU per request here, as much as server and PostgreSQL together, on the
 * same two cores, so it inflated every latency it measured. IDEM_BENCH_HTTP_CLIENT=fetch uses it anyway.
 */
function requester(base: string, agent: http.Agent): (path: string, key: string, body: string) => Promise<number> {
  const url = new URL(base);
  if (process.env.IDEM_BENCH_HTTP_CLIENT === 'fetch') {
    return async (path, key, body) => {
      const res = await fetch(`${base}${path}`, { method: 'POST', headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'idempotency-key': key }, body });
      await res.arrayBuffer();
      return res.status;
    };
  }
  return (path, key, body) =>
    new Promise<number>((resolve, reject) => {
      const req = http.request(
        {
          host: url.hostname,
          port: url.port,
          path,
          method: 'POST',
          agent,
          headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json', 'idempotency-key': key, 'content-length': Buffer.byteLength(body) },
        },
        (res) => {
          res.on('data', () => {});
          res.on('end', () => resolve(res.statusCode ?? 0));
          res.on('error', reject);
        },
      );
      req.on('error', reject);
      req.end(body);
    });
}

/** One `idem serve` under test: this build, or the baseline build named by IDEM_BENCH_HTTP_BASELINE. */
interface Contender {
  readonly name: string;
  readonly schema: string;
  readonly proc: ChildProcess;
  readonly base: string;
  readonly samples: Array<{ created: Load & { cpu: CpuSplit }; replayed: Load & { cpu: CpuSplit } }>;
  /** The keys of the last round: the single-client replays replay them. */
  lastTag?: string;
  single?: Load & { cpu: CpuSplit };
}

async function startServer(ctx: BenchContext, name: string, bin: string, schema: string): Promise<Contender> {
  // IDEM_BENCH_HTTP_PROFILE=<dir>: this build's server writes a V8 CPU profile there when it stops.
  const profile = process.env.IDEM_BENCH_HTTP_PROFILE && bin === BIN ? ['--cpu-prof', '--cpu-prof-dir', process.env.IDEM_BENCH_HTTP_PROFILE] : [];
  const proc = spawn(process.execPath, [...profile, bin, '--jobs-dir', JOBS, '--schema', schema, '--log-level', 'warn', 'serve', '--port', '0', '--max-runs', '4'], {
    env: { ...process.env, DATABASE_URL: ctx.url, IDEM_API_TOKEN: TOKEN, NODE_OPTIONS: '' },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const base = await new Promise<string>((resolve, reject) => {
    let out = '';
    proc.stdout!.setEncoding('utf8').on('data', (s: string) => {
      out += s;
      const m = /listening on (http:\/\/\S+)/.exec(out);
      if (m) resolve(m[1]!);
    });
    proc.once('exit', (code) => reject(new Error(`idem serve (${name}) exited with ${code}`)));
  });
  return { name, schema, proc, base, samples: [] };
}

/**
 * 8. HTTP trigger API: `idem serve` as its own process; 1000 POSTs with distinct Idempotency-Keys
 * from 50 concurrent clients (runs of a one-empty-step job, executed by the server meanwhile), then
 * the same 1000 requests again as replays once every run has finished; `--rounds` rounds, medians.
 * With IDEM_BENCH_HTTP_BASELINE=<path of another build's bin/idem.js>, that build's server is
 * measured too, in alternation (A B A B …, each on a schema of its own): before/after side by side.
 */
export async function benchHttp(ctx: BenchContext): Promise<BenchResult> {
  const contenders: Contender[] = [];
  const agent = new http.Agent({ keepAlive: true, maxSockets: CLIENTS });
  const pool = new pg.Pool({ connectionString: ctx.url, max: 1 });
  try {
    contenders.push(await startServer(ctx, 'this build', BIN, 'idem'));
    const baseline = process.env.IDEM_BENCH_HTTP_BASELINE;
    if (baseline) contenders.push(await startServer(ctx, 'baseline', baseline, 'idem_baseline'));
    const posts = new Map(contenders.map((c) => [c, requester(c.base, agent)]));
    const post = (c: Contender, tag: string) => (i: number) => posts.get(c)!('/api/jobs/bench-trivial/runs', `bench-${tag}-${i}`, JSON.stringify({ n: i }));
    // Warm-up: connections, JIT, prepared plans (its runs are not counted).
    for (const c of contenders) await load(50, 10, post(c, 'warm'));
    for (let round = 1; round <= ctx.opts.rounds; round++) {
      for (const c of contenders) {
        const tag = `${round}-${randomBytes(3).toString('hex')}`;
        const created = await withCpu(ctx, c.proc.pid!, REQUESTS, () => load(REQUESTS, CLIENTS, post(c, tag)));
        if (created.statuses.get(201) !== REQUESTS) throw new Error(`${c.name}: expected ${REQUESTS} × 201, got ${JSON.stringify([...created.statuses])}`);
        const deadline = Date.now() + 600_000;
        for (;;) {
          const { rows } = await pool.query(`select count(*)::int as n from ${c.schema}.runs where job = 'bench-trivial' and status <> 'succeeded'`);
          if (rows[0].n === 0) break;
          if (Date.now() > deadline) throw new Error(`${c.name}: ${rows[0].n} runs still unfinished after 10 minutes`);
          await new Promise((r) => setTimeout(r, 200));
        }
        const t0 = process.hrtime.bigint() / 1000n;
        const replayed = await withCpu(ctx, c.proc.pid!, REQUESTS, () => load(REQUESTS, CLIENTS, post(c, tag)));
        // The replay phase on CLOCK_MONOTONIC in µs, as the server's V8 profile counts time: slice it out.
        if (process.env.IDEM_BENCH_HTTP_PROFILE) ctx.log(`http: ${c.name} replays from ${t0} to ${process.hrtime.bigint() / 1000n} µs (monotonic)`);
        if (replayed.statuses.get(200) !== REQUESTS) throw new Error(`${c.name}: expected ${REQUESTS} × 200 replays, got ${JSON.stringify([...replayed.statuses])}`);
        c.samples.push({ created, replayed });
        c.lastTag = tag;
        ctx.log(
          `  round ${round}/${ctx.opts.rounds} ${c.name}: POST p50 ${fmtMs(percentile(created.latencies, 50))} p99 ${fmtMs(percentile(created.latencies, 99))}; ` +
            `replay p50 ${fmtMs(percentile(replayed.latencies, 50))} p99 ${fmtMs(percentile(replayed.latencies, 99))}, ${Math.round((REQUESTS / replayed.ms) * 1000)} req/s, CPU/replay ${cpuText(replayed.cpu)}`,
        );
      }
    }
    // One client: the cost of one replay without queueing behind 49 others (the 50-client
    // percentiles are mostly queueing: p50 ≈ clients / throughput).
    for (const c of contenders) {
      c.single = await withCpu(ctx, c.proc.pid!, SINGLE, () => load(SINGLE, 1, post(c, c.lastTag!)));
      if (c.single.statuses.get(200) !== SINGLE) throw new Error(`${c.name}: expected ${SINGLE} × 200 replays, got ${JSON.stringify([...c.single.statuses])}`);
    }
    return report(contenders);
  } finally {
    agent.destroy();
    await pool.end().catch(() => {});
    for (const c of contenders) c.proc.kill('SIGTERM');
    await Promise.all(contenders.map((c) => new Promise((r) => (c.proc.exitCode !== null ? r(null) : c.proc.once('exit', r)))));
  }
}

function report(contenders: readonly Contender[]): BenchResult {
  const stats = (loads: ReadonlyArray<Load & { cpu: CpuSplit }>, n: number) => {
    const med = (f: (l: Load & { cpu: CpuSplit }) => number) => median(loads.map(f));
    return {
      p50: med((l) => percentile(l.latencies, 50)),
      p90: med((l) => percentile(l.latencies, 90)),
      p99: med((l) => percentile(l.latencies, 99)),
      reqPerSec: med((l) => (n / l.ms) * 1000),
      cpu: {
        client: med((l) => l.cpu.client),
        server: med((l) => l.cpu.server),
        pg: loads.some((l) => l.cpu.pg === null) ? null : med((l) => l.cpu.pg!),
      },
    };
  };
  const rows: ReportRow[] = [];
  const data: Record<string, unknown> = {};
  for (const c of contenders) {
    const created = stats(
      c.samples.map((s) => s.created),
      REQUESTS,
    );
    const replayed = stats(
      c.samples.map((s) => s.replayed),
      REQUESTS,
    );
    const single = stats([c.single!], SINGLE);
    const row = (what: string, s: typeof created, clients: number, goal: string, met: boolean | null): ReportRow => ({
      benchmark: `HTTP ${what}`,
      contenders: `idem serve (${c.name}), ${clients === 1 ? SINGLE : REQUESTS} requests, ${clients} client${clients === 1 ? '' : 's'}`,
      median: `p50 ${fmtMs(s.p50)}, p99 ${fmtMs(s.p99)}`,
      ratio: `${Math.round(s.reqPerSec)} req/s; CPU per request: ${cpuText(s.cpu)}`,
      goal,
      met,
    });
    const mine = c.name === 'this build';
    rows.push(
      row('POST (new key: claim + 201)', created, CLIENTS, 'informational', null),
      row('POST replay (200, Idempotent-Replayed)', replayed, CLIENTS, mine ? `replay p99 < ${REPLAY_P99_GOAL_MS} ms` : 'informational', mine ? replayed.p99 < REPLAY_P99_GOAL_MS : null),
      row('POST replay, 1 client', single, 1, 'informational', null),
    );
    data[c.name] = { created, replayed, single, rounds: c.samples.length };
  }
  return { rows, data };
}
