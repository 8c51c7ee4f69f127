/**
 * 1b. Node CPU per chunk: idem (Runner.run, concurrency 1) against the hand loop (bench 1's raw
 * `pg` loop: BEGIN; statement; COMMIT) and a Kysely loop (one `db.transaction().execute()` per
 * chunk), each doing the same trivial upsert per chunk, so the figure is the machinery's and not the
 * work's. A fourth, `idem's SQL`, is the raw `pg` loop sending what a chunk of idem sends (the
 * upsert, then COMMIT through the fence trigger with the next chunk's BEGIN and claim in one
 * message): the floor idem's own
 * statements set, apart from its Node code (on a shared machine a process's CPU per round trip grows
 * with how long the server takes to answer, so a heavier statement costs the client CPU too).
 *
 * Marginal: the same contender over 200 and over 4 200 chunks, the difference ÷ 4 000, so start-up
 * and planning's fixed costs drop out. Rounds alternate the contenders, in an order that rotates
 * each round; medians. idem is the package as users run it (dist/), the job's statement going
 * through `ctx.db` (Kysely).
 * `IDEM_BENCH_CPU_BASELINE=<another checkout, built>` adds that checkout's idem as a fifth contender,
 * for a before/after in one run.
 */
import * as idemPackage from 'idem';
import { defineJob, Runner, sql as idemSql, type StepContext } from 'idem';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { Kysely, PostgresDialect, sql } from 'kysely';
import pg from 'pg';
import { Store } from '../../src/store.ts';
import { median, rotate } from './measure.ts';
import type { BenchContext, BenchResult } from './report.ts';

const SMALL = 200;
const LARGE = 4_200;
const GOAL = 1.5;
const TABLE = 'bench_node_cpu';
const WORK = `insert into ${TABLE} values (1, 1) on conflict (id) do update set n = excluded.n + ${TABLE}.n`;

export const IDEM = 'idem';
export const HAND = 'hand loop';
export const KYSELY = 'Kysely loop';
export const IDEM_SQL = "idem's SQL";
export const BASELINE = 'idem (baseline)';

/** CPU of the whole process, and of its main thread alone (the JavaScript; without V8's GC helper and libuv's threads), in ms. */
interface Cpu {
  readonly process: number;
  readonly main: number;
}

/** The main thread's CPU time in ns (Linux: /proc/self/task/<pid>/schedstat); NaN elsewhere. */
const mainThreadNs = (): number => {
  try {
    return Number(readFileSync(`/proc/self/task/${process.pid}/schedstat`, 'utf8').split(' ')[0]);
  } catch {
    return Number.NaN;
  }
};

const cpuMs = async (fn: () => Promise<void>): Promise<Cpu> => {
  const t = process.cpuUsage();
  const m = mainThreadNs();
  await fn();
  const c = process.cpuUsage(t);
  return { process: (c.user + c.system) / 1000, main: (mainThreadNs() - m) / 1e6 };
};

const job = (n: number, define: typeof defineJob = defineJob, raw: typeof idemSql = idemSql) =>
  define({
    name: `node-cpu-${n}`,
    steps: [
      {
        name: 's',
        chunks: (cursor, { windowSize }) => {
          const from = typeof cursor === 'number' ? cursor : 0;
          const to = Math.min(from + windowSize, n);
          return { chunks: Array.from({ length: to - from }, (_, i) => ({ key: `k${from + i}` })), next: to < n ? to : null };
        },
        run: ({ db }: StepContext) => raw.raw(WORK).execute(db),
      },
    ],
  });

export async function benchNodeCpu(ctx: BenchContext): Promise<BenchResult> {
  const { url } = ctx;
  // Per-round figures swing by ±40 % on a shared 2-core machine (the loop itself: 113-212 µs in one
  // run): seven rounds, so that two bad ones cannot move the median.
  const rounds = Math.max(ctx.opts.rounds, 7);
  await ctx.pool.query(`create table if not exists ${TABLE} (id int primary key, n int not null)`);
  // A finished run of LARGE chunks, for idem's SQL: its chunks are made pending again before each use.
  const floorJob = job(LARGE);
  const floorRunner = await Runner.connect({ connectionString: url });
  await floorRunner.run(floorJob, { key: 'sql-floor', health: false });
  await floorRunner.close();
  const floor = new pg.Client({ connectionString: url });
  await floor.connect();
  const floorDb = new Kysely<any>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: url, max: 1 }) }) });
  try {
    const { rows: [floorRun] } = await floor.query<{ id: string; attempt: number }>(`select id, attempt from idem.runs where job = $1 and run_key = 'sql-floor'`, [floorJob.name]);
    const store = new Store(floorDb, 'idem');
    for (const text of store.claimPrepares) await floor.query(text);
    const claim = store.claimSql('next', floorRun!.id, floorRun!.attempt, 's', []);
    let turn = 0;
    // The baseline in a schema of its own: an older idem refuses a runner schema that a newer one
    // has migrated further ("the schema is newer than this binary").
    const idemContender = (lib: typeof idemPackage, schema?: string) => async (n: number) => {
      const runner = await lib.Runner.connect({ connectionString: url, ...(schema ? { schema } : {}) });
      try {
        const j = job(n, lib.defineJob, lib.sql);
        return await cpuMs(async () => void (await runner.run(j, { key: `r${++turn}-${n}`, health: false })));
      } finally {
        await runner.close();
      }
    };
    const baselineDir = process.env.IDEM_BENCH_CPU_BASELINE;
    const baseline = baselineDir ? ((await import(pathToFileURL(path.resolve(baselineDir, 'dist/index.js')).href)) as typeof idemPackage) : undefined;
    const contenders: Record<string, (n: number) => Promise<Cpu>> = {
      // A schema of its own too, as the baseline's: the floor's contender makes its 4 200 chunks in
      // `idem` pending again every round, and the dead rows it leaves there made idem's claims
      // slower than the baseline's: paired 1.07-1.08× against an older tree here, where two fresh
      // schemas gave 1.01× for the same two trees.
      [IDEM]: idemContender(idemPackage, 'idem_cpu'),
      ...(baseline ? { [BASELINE]: idemContender(baseline, 'idem_baseline') } : {}),
      [KYSELY]: async (n) => {
        const db = new Kysely<any>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: url, max: 2 }) }) });
        try {
          return await cpuMs(async () => {
            for (let i = 0; i < n; i++) await db.transaction().execute((trx) => sql.raw(WORK).execute(trx));
          });
        } finally {
          await db.destroy();
        }
      },
      [IDEM_SQL]: async (n) => {
        await floor.query('update idem.chunks set done_at = null, done_attempt = null, done_by = null where run_id = $1', [floorRun!.id]);
        // The fence accepts a chunk of a running run only (runner migration 0015): the floor's run
        // is running again, as a live run's is, while its chunks are committed.
        await floor.query(`update idem.runs set status = 'running', finished_at = null where id = $1`, [floorRun!.id]);
        // As idem sends it: the first chunk's claim with BEGIN, every later one with the COMMIT before it.
        return cpuMs(async () => {
          await floor.query(`begin;\n${claim}`);
          for (let i = 0; i < n; i++) {
            await floor.query(WORK, []);
            await floor.query(i + 1 < n ? `commit;\nbegin;\n${claim}` : 'commit');
          }
        });
      },
      [HAND]: async (n) => {
        const c = new pg.Client({ connectionString: url });
        await c.connect();
        try {
          return await cpuMs(async () => {
            for (let i = 0; i < n; i++) {
              await c.query('begin');
              await c.query(WORK, []);
              await c.query('commit');
            }
          });
        } finally {
          await c.end();
        }
      },
    };
    ctx.log(`node cpu: ${Object.keys(contenders).join(' / ')}, ${SMALL} and ${LARGE} trivial chunks each, ${rounds} rounds`);
    const per: Record<string, number[]> = Object.fromEntries(Object.keys(contenders).map((k) => [k, []]));
    const perMain: Record<string, number[]> = Object.fromEntries(Object.keys(contenders).map((k) => [k, []]));
    for (let round = 1; round <= rounds; round++) {
      for (const [name, run] of rotate(Object.entries(contenders), round - 1)) {
        const small = await run(SMALL);
        const large = await run(LARGE);
        const ms = (large.process - small.process) / (LARGE - SMALL);
        const main = (large.main - small.main) / (LARGE - SMALL);
        per[name]!.push(ms);
        perMain[name]!.push(main);
        ctx.log(`  round ${round}/${rounds} ${name}: ${(ms * 1000).toFixed(0)} µs Node CPU per chunk (main thread ${(main * 1000).toFixed(0)} µs)`);
      }
    }
    const m = Object.fromEntries(Object.entries(per).map(([k, xs]) => [k, median(xs)])) as Record<string, number>;
    const us = (ms: number) => `${(ms * 1000).toFixed(0)} µs`;
    const ratio = m[IDEM]! / m[HAND]!;
    /** Median of each round's own idem÷loop: a slow spell that hits one round hits both contenders of it less unevenly. */
    const paired = median(per[IDEM]!.map((x, i) => x / per[HAND]![i]!));
    /** The main thread alone: V8's GC helper threads spin and wait longer when the other core is busy, which moves process CPU more than the work does. */
    const mainMedian = Object.fromEntries(Object.entries(perMain).map(([k, xs]) => [k, median(xs)])) as Record<string, number>;
    const mainRatio = mainMedian[IDEM]! / mainMedian[HAND]!;
    const mainPaired = median(perMain[IDEM]!.map((x, i) => x / perMain[HAND]![i]!));
    return {
      rows: [
        {
          benchmark: `1b. Node CPU per chunk (marginal, ${LARGE - SMALL} trivial chunks)`,
          contenders: `idem vs hand loop (raw pg: BEGIN; upsert; COMMIT); Kysely loop and idem's SQL for reference`,
          median: `${us(m[IDEM]!)} vs ${us(m[HAND]!)} (Kysely loop ${us(m[KYSELY]!)}, idem's SQL ${us(m[IDEM_SQL]!)})`,
          ratio: `${ratio.toFixed(2)}× idem÷loop (paired ${paired.toFixed(2)}×; ${(m[IDEM]! / m[KYSELY]!).toFixed(2)}× the Kysely loop; idem's SQL ${(m[IDEM_SQL]! / m[HAND]!).toFixed(2)}×; main thread alone ${us(mainMedian[IDEM]!)} vs ${us(mainMedian[HAND]!)}, ${mainRatio.toFixed(2)}×, paired ${mainPaired.toFixed(2)}×)`,
          goal: `≤ ${GOAL}×`,
          met: ratio <= GOAL,
        },
        ...(baseline
          ? [
              {
                benchmark: '1b. Node CPU per chunk: before/after',
                contenders: `idem vs idem (baseline: ${baselineDir})`,
                median: `${us(m[IDEM]!)} vs ${us(m[BASELINE]!)}`,
                ratio: `${(m[IDEM]! / m[BASELINE]!).toFixed(2)}× (paired ${median(per[IDEM]!.map((x, i) => x / per[BASELINE]![i]!)).toFixed(2)}×)`,
                goal: 'info',
                met: null,
              },
            ]
          : []),
      ],
      details: [
        '**1b. Node CPU per chunk, per round** (µs; marginal over 4 000 chunks)',
        '',
        `| contender | ${per[IDEM]!.map((_, i) => `round ${i + 1}`).join(' | ')} | median |`,
        `|---|${per[IDEM]!.map(() => '---|').join('')}---|`,
        ...Object.entries(per).map(([k, xs]) => `| ${k} | ${xs.map((x) => (x * 1000).toFixed(0)).join(' | ')} | ${(m[k]! * 1000).toFixed(0)} |`),
        ...Object.entries(perMain).map(([k, xs]) => `| ${k}, main thread | ${xs.map((x) => (x * 1000).toFixed(0)).join(' | ')} | ${(mainMedian[k]! * 1000).toFixed(0)} |`),
      ],
      data: { small: SMALL, large: LARGE, perChunkMs: per, medianMs: m, ratio, pairedRatio: paired, mainThreadPerChunkMs: perMain, mainThreadMedianMs: mainMedian, mainThreadRatio: mainRatio, mainThreadPairedRatio: mainPaired, ...(baselineDir ? { baseline: baselineDir } : {}) },
    };
  } finally {
    await floor.end();
    await floorDb.destroy();
    await ctx.pool.query(`drop table if exists ${TABLE}`);
  }
}
