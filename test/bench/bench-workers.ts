import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import path from 'node:path';
import { assertOk, REPO_ROOT, runCli } from './cli.ts';
import { alternate, fmtMs, median, type Contender } from './measure.ts';
import type { BenchContext, BenchResult, ReportRow } from './report.ts';
import { assertIdent, dropTable, prepareTable, rowsLeft } from './tables.ts';
import { chunkUpdateSql, JOB_TAG, type ChunkWork } from './backfill-job.ts';

const LEVELS = [1, 2, 4] as const;

interface Workload {
  readonly name: string;
  readonly work: ChunkWork;
  readonly chunks: number;
  /** Rows per chunk; the table has chunks × size rows. */
  readonly size: number;
  readonly sleepMs: number;
  /** A fresh table per turn (writes) or one shared table (read-only work). */
  readonly fresh: boolean;
}

const WORKLOADS: readonly Workload[] = [
  { name: 'pg_sleep(5 ms) per chunk (I/O-bound)', work: 'sleep', chunks: 2000, size: 1, sleepMs: 5, fresh: false },
  { name: 'UPDATE of 200 rows per chunk (CPU-bound)', work: 'update', chunks: 1500, size: 200, sleepMs: 0, fresh: true },
];

/** What one turn measured: the whole (process start included) and the part where every worker was working. */
interface Turn {
  /** Workers that committed at least one chunk. */
  readonly workingProcesses: number;
  /** Chunks per second between the moment the last worker committed its first chunk and the moment the first one committed its last. */
  readonly steadyRate: number;
  /** Chunks per second over the whole turn, from spawning the processes to the last one's exit. */
  readonly wallRate: number;
  /** Rolled-back transactions per chunk (server-counted): mostly claims refused because another worker held or had done the chunk. */
  readonly rollbacksPerChunk: number;
}

/**
 * 8. Parallel workers: 1, 2 and 4 `idem run --join` processes (concurrency 1 each) on one run,
 * started together; throughput relative to one process. Node start-up (about a second of CPU per
 * process) is in the wall figure but not in the steady one, which counts only while all are in.
 * Next to them, in the same alternation, 1, 2 and 4 hand-loop processes doing the same chunks with
 * no coordination at all: how far this machine lets N processes scale this chunk shape, so the
 * report can say how much of idem's shortfall from N× is idem's.
 */
export async function benchWorkers(ctx: BenchContext): Promise<BenchResult> {
  const tag = randomBytes(3).toString('hex');
  const rows: ReportRow[] = [];
  const data: Record<string, unknown> = {};
  for (const w of WORKLOADS) {
    const shared = `wrk_shared_${tag}`;
    if (!w.fresh) await prepareTable(ctx.pool, shared, w.chunks * w.size);
    const idem: Contender<Turn>[] = LEVELS.map((n) => ({
      name: idemName(n),
      async prepare(round) {
        const table = w.fresh ? `wrk_${w.work}_${tag}_${n}_${round}` : shared;
        if (w.fresh) await prepareTable(ctx.pool, table, w.chunks * w.size);
        const key = `${table}-${n}-${round}`;
        const args = ['--log-level', 'error', 'run', 'bench-backfill', '--params', JSON.stringify({ table, size: w.size, work: w.work, sleepMs: w.sleepMs }), '--key', key, '--join', '--concurrency', '1', '--no-progress'];
        return {
          async run() {
            const rollbacks0 = await rollbacks(ctx);
            const t0 = performance.now();
            const results = await Promise.all(Array.from({ length: n }, () => runCli(args, { databaseUrl: ctx.url })));
            const wallMs = performance.now() - t0;
            for (const r of results) assertOk(r, `worker of ${n}`);
            const rollbacksPerChunk = ((await rollbacks(ctx)) - rollbacks0) / w.chunks;
            return { ...(await steady(ctx, key)), wallRate: (w.chunks / wallMs) * 1000, rollbacksPerChunk };
          },
          async cleanup() {
            if (!w.fresh) return;
            const left = await rowsLeft(ctx.pool, table);
            await dropTable(ctx.pool, table);
            if (left) throw new Error(`${n} processes left ${left} rows`);
          },
        };
      },
    }));
    // The machine's ceiling for this chunk shape: N processes that each work a share of the chunks,
    // split in advance, with nothing shared but the server. No claim, no fence, no planning.
    const loops: Contender<Turn>[] = LEVELS.map((n) => ({
      name: loopName(n),
      async prepare(round) {
        const table = w.fresh ? `wrk_${w.work}_${tag}_loop${n}_${round}` : shared;
        if (w.fresh) await prepareTable(ctx.pool, table, w.chunks * w.size);
        const marks = `wrk_marks_${tag}_${n}_${round}`;
        await ctx.pool.query(`create table ${assertIdent(marks)} (seq int primary key, done_at timestamptz, done_by text)`);
        await ctx.pool.query(`insert into ${marks} (seq) select g from generate_series(0, $1::int - 1) g`, [w.chunks]);
        await ctx.pool.query(`vacuum (analyze) ${marks}`);
        // The same statements as idem's job (backfill-job.ts), with the marker a plain UPDATE.
        const markSql = `update ${marks} set done_at = clock_timestamp(), done_by = $2 where seq = $1`;
        const [workSql, params] = w.work === 'sleep' ? [`select pg_sleep(${w.sleepMs / 1000}) ${JOB_TAG}`, 'none'] : [chunkUpdateSql(table), 'range'];
        return {
          async run() {
            const t0 = performance.now();
            await Promise.all(
              Array.from({ length: n }, (_, i) =>
                handLoop(ctx.url, [markSql, workSql, params, String(w.size), String(Math.floor((i * w.chunks) / n)), String(Math.floor(((i + 1) * w.chunks) / n)), `loop-${i}`]),
              ),
            );
            const wallMs = performance.now() - t0;
            const { rows } = await ctx.pool.query<{ n: number }>(`select count(*)::int as n from ${marks} where done_at is null`);
            if (rows[0]!.n !== 0) throw new Error(`${n} hand loops left ${rows[0]!.n} chunks undone`);
            return { ...(await steadyOf(ctx, `select done_by, done_at from ${marks} where done_at is not null`, [], `${n} hand loops`)), wallRate: (w.chunks / wallMs) * 1000, rollbacksPerChunk: 0 };
          },
          async cleanup() {
            await ctx.pool.query(`drop table if exists ${marks}`);
            if (!w.fresh) return;
            const left = await rowsLeft(ctx.pool, table);
            await dropTable(ctx.pool, table);
            if (left) throw new Error(`${n} hand loops left ${left} rows`);
          },
        };
      },
    }));
    const contenders = [...idem, ...loops];
    ctx.log(`workers: ${w.name}, ${w.chunks} chunks, ${ctx.opts.rounds} rounds`);
    const samples = await alternate(ctx.opts.rounds, contenders, ctx.log, ctx.probe);
    if (!w.fresh) await dropTable(ctx.pool, shared);
    const per = LEVELS.map((n) => samples.get(idemName(n))!);
    const loopPer = LEVELS.map((n) => samples.get(loopName(n))!);
    const loopRate = loopPer.map((xs) => median(xs.map((s) => s.result.steadyRate)));
    const steadyRate = per.map((xs) => median(xs.map((s) => s.result.steadyRate)));
    const wallRate = per.map((xs) => median(xs.map((s) => s.result.wallRate)));
    const wallMs = per.map((xs) => median(xs.map((s) => s.ms)));
    const rollbacksPerChunk = per.map((xs) => median(xs.map((s) => s.result.rollbacksPerChunk)));
    const working = per.map((xs) => Math.min(...xs.map((s) => s.result.workingProcesses)));
    const x = (rates: number[]) => rates.map((r) => `${(r / rates[0]!).toFixed(2)}×`).join(' / ');
    rows.push({
      benchmark: `8. workers (\`--join\`): ${w.name}, ${w.chunks} chunks`,
      contenders: `${LEVELS.join(' / ')} processes, concurrency 1 each (fewest that did work: ${working.join(' / ')})`,
      median: `${steadyRate.map((r) => `${r.toFixed(0)}`).join(' / ')} chunks/s steady; ${wallMs.map(fmtMs).join(' / ')} wall`,
      ratio: `${x(steadyRate)} steady; ${x(wallRate)} wall (process start included); ${rollbacksPerChunk.map((r) => r.toFixed(2)).join(' / ')} rolled-back claims per chunk`,
      goal: w.work === 'sleep' ? '≥ 3.5× at 4 (steady)' : 'info',
      met: w.work === 'sleep' ? steadyRate[2]! / steadyRate[0]! >= 3.5 : null,
    });
    rows.push({
      benchmark: `8. hand loops, the machine's ceiling: ${w.name}, ${w.chunks} chunks`,
      contenders: `${LEVELS.join(' / ')} processes, each a BEGIN; mark; work; COMMIT loop over its share of the chunks, split in advance`,
      median: `${loopRate.map((r) => `${r.toFixed(0)}`).join(' / ')} chunks/s steady`,
      ratio: `${x(loopRate)} steady; idem ÷ hand loops at the same count ${steadyRate.map((r, i) => (r / loopRate[i]!).toFixed(2)).join(' / ')}`,
      goal: 'info',
      met: null,
    });
    data[w.work] = { chunks: w.chunks, size: w.size, samples: Object.fromEntries(samples), steadyRate, wallRate, wallMs, rollbacksPerChunk, handLoopSteadyRate: loopRate };
  }
  return { rows, data };
}

/** Transactions rolled back in the bench database so far (a backend's counts are flushed when it exits, so read after the workers ended). */
async function rollbacks(ctx: BenchContext): Promise<number> {
  // Backends flush their counts as they exit, a moment after their client did: wait for that.
  for (let i = 0; i < 200; i++) {
    const { rows } = await ctx.pool.query<{ n: number }>(`select count(*)::int as n from pg_stat_activity where datname = current_database() and application_name like 'idem%'`);
    if (rows[0]!.n === 0) break;
    await new Promise((r) => setTimeout(r, 25));
  }
  const { rows } = await ctx.pool.query<{ n: string }>(`select xact_rollback::text as n from pg_stat_database where datname = current_database()`);
  return Number(rows[0]!.n);
}

const idemName = (n: number) => `${n} process${n > 1 ? 'es' : ''}`;
const loopName = (n: number) => `${n} hand loop${n > 1 ? 's' : ''}`;

/** One hand-loop process (hand-loop-worker.mjs); rejects with its stderr unless it exits 0. */
function handLoop(url: string, args: string[]): Promise<void> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [path.join(REPO_ROOT, 'test', 'bench', 'hand-loop-worker.mjs'), ...args], {
      cwd: REPO_ROOT,
      env: { ...process.env, DATABASE_URL: url },
      stdio: ['ignore', 'ignore', 'pipe'],
    });
    let stderr = '';
    child.stderr!.on('data', (b: Buffer) => (stderr = (stderr + b.toString()).slice(-4000)));
    child.on('error', reject);
    child.on('close', (code) => (code === 0 ? resolve() : reject(new Error(`hand loop exited ${code}: ${stderr}`))));
  });
}

/** Throughput while every worker of the run was committing: per-worker first and last commit from `done_by`. */
function steady(ctx: BenchContext, runKey: string): Promise<Omit<Turn, 'wallRate' | 'rollbacksPerChunk'>> {
  const chunks = `select c.done_by, c.done_at from idem.chunks c join idem.runs r on r.id = c.run_id
       where r.job = 'bench-backfill' and r.run_key = $1 and c.done_at is not null`;
  return steadyOf(ctx, chunks, [runKey], `run ${runKey}`);
}

/** The steady rate over `chunks` (rows of done_by, done_at): from the last worker's first chunk to the first worker's last. */
async function steadyOf(ctx: BenchContext, chunks: string, params: unknown[], what: string): Promise<Omit<Turn, 'wallRate' | 'rollbacksPerChunk'>> {
  const { rows } = await ctx.pool.query<{ workers: number; n: number; ms: number }>(
    `with c as (${chunks}),
     w as (select max(first) as lo, min(last) as hi, count(*)::int as workers from (select min(done_at) as first, max(done_at) as last from c group by done_by) x)
     select w.workers, (select count(*)::int from c where c.done_at > w.lo and c.done_at <= w.hi) as n,
            extract(epoch from w.hi - w.lo) * 1000 as ms
     from w`,
    params,
  );
  const r = rows[0]!;
  if (!(r.ms > 0)) throw new Error(`${what}: the workers never worked at the same time (${r.workers} did work); more chunks needed`);
  return { workingProcesses: r.workers, steadyRate: (r.n / Number(r.ms)) * 1000 };
}
