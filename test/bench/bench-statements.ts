import { randomBytes } from 'node:crypto';
import { Runner } from 'idem';
import { benchBackfill } from './backfill-job.ts';
import { checkedDrop, loopContender } from './contenders.ts';
import type { BenchContext, BenchResult } from './report.ts';
import { countStatements, type StatementCounts } from './sql-counter.ts';
import { CHUNK_ROWS, prepareTable } from './tables.ts';

/** Enough chunks for several planning windows; the per-chunk figure is exact beyond that. */
const MAX_ROWS = 500_000;
const GOAL = 2;

/**
 * 5. Statements per chunk that the runner issues beyond the job's own, counted at the driver
 * (pg.Client.prototype.query: work pool and lock session). BEGIN/COMMIT are counted apart: a hand
 * loop needs them too. The hand loop is counted the same way, as the reference.
 */
export async function benchStatements(ctx: BenchContext): Promise<BenchResult> {
  const rows = Math.min(ctx.opts.rows, MAX_ROWS);
  const chunks = Math.ceil(rows / CHUNK_ROWS);
  const table = `stmts_${randomBytes(3).toString('hex')}`;
  ctx.log(`statements: counting ${chunks} chunks`);
  const runner = await Runner.connect({ connectionString: ctx.url });
  let idem: StatementCounts;
  try {
    await prepareTable(ctx.pool, table, rows);
    ({ counts: idem } = await countStatements(() => runner.run(benchBackfill, { params: { table, size: CHUNK_ROWS }, key: table, concurrency: 1 })));
    await checkedDrop(ctx, table, 'idem');
  } finally {
    await runner.close();
  }
  const loopTurn = await loopContender(ctx, { rows, size: CHUNK_ROWS }, 'hand loop', `${table}_loop`).prepare(1);
  let loop: StatementCounts;
  try {
    ({ counts: loop } = await countStatements(() => loopTurn.run()));
  } finally {
    await loopTurn.cleanup?.();
  }
  const per = (n: number) => n / chunks;
  const fmt = (n: number) => per(n).toFixed(3);
  const runnerPer = per(idem.byKind.runner);
  return {
    rows: [
      {
        benchmark: `5. statements per chunk beyond the job's own (${chunks} chunks)`,
        contenders: 'idem vs hand loop; driver-counted, lock session included',
        median: `runner ${fmt(idem.byKind.runner)} + BEGIN/COMMIT ${fmt(idem.byKind.tx)} (loop: ${fmt(loop.byKind.runner)} + ${fmt(loop.byKind.tx)})`,
        ratio: `${fmt(idem.total)} vs ${fmt(loop.total)} stmts/chunk; ${fmt(idem.roundTrips)} vs ${fmt(loop.roundTrips)} round trips/chunk`,
        goal: `≤ ${GOAL} (excl. BEGIN/COMMIT)`,
        met: runnerPer <= GOAL,
      },
    ],
    details: [
      `**5. statements per chunk** (${chunks} chunks of ${CHUNK_ROWS} rows; "runner" excludes BEGIN/COMMIT/ROLLBACK, which are counted in their own column)`,
      '',
      '| contender | runner stmts/chunk (excl. BEGIN/COMMIT) | BEGIN/COMMIT per chunk | job stmts/chunk | total stmts per chunk | round trips per chunk | total stmts per run |',
      '|---|---|---|---|---|---|---|',
      `| idem | ${fmt(idem.byKind.runner)} | ${fmt(idem.byKind.tx)} | ${fmt(idem.byKind.job)} | ${fmt(idem.total)} | ${fmt(idem.roundTrips)} | ${idem.total} |`,
      `| hand loop | ${fmt(loop.byKind.runner)} | ${fmt(loop.byKind.tx)} | ${fmt(loop.byKind.job)} | ${fmt(loop.total)} | ${fmt(loop.roundTrips)} | ${loop.total} |`,
      '',
      'idem runner statements in this run:',
      '',
      ...idem.runnerShapes.map((s) => `- ${s.count}× \`${s.shape}\``),
    ],
    data: { chunks, idem, loop },
  };
}
