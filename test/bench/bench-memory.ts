import { randomBytes } from 'node:crypto';
import { assertOk, runCli } from './cli.ts';
import { checkedDrop } from './contenders.ts';
import { fmtMs } from './measure.ts';
import { mb, type BenchContext, type BenchResult, type ReportRow } from './report.ts';
import { CHUNK_ROWS, prepareTable } from './tables.ts';

const GOAL_BYTES = 150 * 2 ** 20;
/** Flat: the biggest table may cost at most this much more peak RSS than the smallest. */
const FLAT = 1.1;
const BIG_ROWS = 10_000_000;

/**
 * 6. Peak RSS of the CLI process (GNU time's max RSS, else /proc/<pid>/status VmHWM) backfilling
 * tables of growing size; `idem --help` shows the floor of node + tsx + idem's modules.
 */
export async function benchMemory(ctx: BenchContext): Promise<BenchResult> {
  const { rows } = ctx.opts;
  const sizes = [...new Set([rows, rows * 3, ...(ctx.opts.big ? [BIG_ROWS] : [])])].sort((a, b) => a - b);
  const tag = randomBytes(3).toString('hex');
  const floor = assertOk(await runCli(['--help'], { databaseUrl: ctx.url, measureMemory: true }), '--help');
  const runs: Array<{ rows: number; chunks: number; maxRssBytes: number; ms: number; source: string }> = [];
  for (const n of sizes) {
    const table = `memory_${tag}_${n}`;
    ctx.log(`memory: ${n.toLocaleString('en-US')} rows (preparing)`);
    await prepareTable(ctx.pool, table, n);
    const r = assertOk(
      await runCli(['run', 'bench-backfill', '--params', JSON.stringify({ table, size: CHUNK_ROWS }), '--key', table], { databaseUrl: ctx.url, measureMemory: true }),
      `memory ${n}`,
    );
    await checkedDrop(ctx, table, `memory ${n}`);
    if (!r.maxRssBytes) throw new Error('could not read the peak RSS of the CLI (no /usr/bin/time, no /proc)');
    runs.push({ rows: n, chunks: Math.ceil(n / CHUNK_ROWS), maxRssBytes: r.maxRssBytes, ms: r.ms, source: r.rssSource! });
    ctx.log(`  ${n.toLocaleString('en-US')} rows: peak RSS ${mb(r.maxRssBytes)} in ${fmtMs(r.ms)}`);
  }
  const first = runs[0]!;
  const last = runs[runs.length - 1]!;
  const growth = last.maxRssBytes / first.maxRssBytes;
  const rowsOut: ReportRow[] = [
    {
      benchmark: '6. memory: peak RSS of the CLI process',
      contenders: runs.map((r) => `${(r.rows / 1e6).toLocaleString('en-US')} M rows`).join(' / ') + ' (floor: `idem --help`)',
      median: `${runs.map((r) => mb(r.maxRssBytes)).join(' / ')} (floor ${floor.maxRssBytes ? mb(floor.maxRssBytes) : 'n/a'})`,
      ratio: `${growth.toFixed(3)} largest÷smallest`,
      goal: `< ${mb(GOAL_BYTES)}, flat (≤ ${FLAT}×)`,
      met: runs.every((r) => r.maxRssBytes < GOAL_BYTES) && growth <= FLAT,
    },
  ];
  return { rows: rowsOut, data: { source: first.source, floorBytes: floor.maxRssBytes ?? null, runs } };
}
