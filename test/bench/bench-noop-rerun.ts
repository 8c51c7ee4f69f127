import { randomBytes } from 'node:crypto';
import { Runner, type RunOutcome } from 'idem';
import { benchBackfill } from './backfill-job.ts';
import { assertOk, runCli, type CliResult } from './cli.ts';
import { alternate, fmtMs, fmtRatio, median, type Contender } from './measure.ts';
import type { BenchContext, BenchResult } from './report.ts';
import { countStatements, summarize, type StatementCounts } from './sql-counter.ts';
import { dropTable, prepareTable } from './tables.ts';

/** A finished run this size is re-invoked; a 100-chunk one next to it shows the cost is constant. */
const BIG = { rows: 100_000, size: 10 }; // 10 000 chunks
const SMALL = { rows: 1_000, size: 10 }; // 100 chunks
const GOAL_MS = 50;

type Sample = { ms: number; counts?: StatementCounts; outcome?: RunOutcome };

/**
 * 3. No-op rerun: re-invoke a run that finished with 10 000 chunks. Timed in-process (run() on a
 * connected Runner, and Runner.connect + run + close, which is what a fresh process does after
 * start-up) and through the CLI (process start included, `idem --help` shown as the floor of
 * starting node + tsx + idem's modules). Statements are counted at the driver, lock session included.
 */
export async function benchNoopRerun(ctx: BenchContext): Promise<BenchResult> {
  const tag = randomBytes(3).toString('hex');
  const rounds = Math.max(ctx.opts.rounds, 5);
  const runner = await Runner.connect({ connectionString: ctx.url });
  const finished = async (what: typeof BIG, name: string) => {
    const table = `noop_${name}_${tag}`;
    await prepareTable(ctx.pool, table, what.rows);
    const params = { table, size: what.size };
    const key = `noop-${name}-${tag}`;
    const first = await runner.run(benchBackfill, { params, key, concurrency: 4 });
    const chunks = first.summary?.chunks ?? 0;
    if (chunks !== what.rows / what.size) throw new Error(`setup run of ${table} has ${chunks} chunks, expected ${what.rows / what.size}`);
    return { table, params, key, chunks };
  };
  try {
    ctx.log(`noop: finishing a ${BIG.rows / BIG.size}-chunk and a ${SMALL.rows / SMALL.size}-chunk run (setup, not timed)`);
    const big = await finished(BIG, 'big');
    const small = await finished(SMALL, 'small');
    const inProcess = (name: string, run: () => Promise<RunOutcome>): Contender<Sample> => ({
      name,
      prepare: async () => ({
        async run() {
          const t0 = performance.now();
          const { result, counts } = await countStatements(run);
          const ms = performance.now() - t0;
          if (result.status !== 'already-succeeded') throw new Error(`${name}: expected already-succeeded, got ${result.status}`);
          return { ms, counts, outcome: result };
        },
      }),
    });
    const cli = (name: string, args: string[], count: boolean): Contender<Sample> => ({
      name,
      prepare: async () => ({
        async run() {
          const r: CliResult = assertOk(await runCli(args, { databaseUrl: ctx.url, countStatements: count }), name);
          return { ms: r.ms, ...(r.statements ? { counts: summarize(new Map(Object.entries(r.statements))) } : {}) };
        },
      }),
    });
    const runArgs = (s: typeof big) => ['run', 'bench-backfill', '--params', JSON.stringify(s.params), '--key', s.key];
    const contenders = [
      inProcess('run() 10k', () => runner.run(benchBackfill, { params: big.params, key: big.key })),
      inProcess('run() 100', () => runner.run(benchBackfill, { params: small.params, key: small.key })),
      inProcess('connect+run+close 10k', async () => {
        const r = await Runner.connect({ connectionString: ctx.url });
        try {
          return await r.run(benchBackfill, { params: big.params, key: big.key });
        } finally {
          await r.close();
        }
      }),
      cli('CLI 10k', runArgs(big), true),
      cli('CLI --help', ['--help'], false),
    ];
    ctx.log(`noop: re-invoking finished runs, ${rounds} rounds`);
    const samples = await alternate(rounds, contenders, ctx.log);
    const med = (n: string) => median(samples.get(n)!.map((s) => s.result.ms));
    const stmts = (n: string) => samples.get(n)!.at(-1)!.result.counts!;
    const [run10k, run100, cold, cliMs, helpMs] = contenders.map((c) => med(c.name)) as [number, number, number, number, number];
    const s10k = stmts('run() 10k');
    const s100 = stmts('run() 100');
    const sCold = stmts('connect+run+close 10k');
    const sCli = stmts('CLI 10k');
    const constant = s10k.total === s100.total;
    return {
      rows: [
        {
          benchmark: `3. no-op rerun of a finished ${big.chunks}-chunk run (in-process)`,
          contenders: 'Runner.connect + run + close; run() on a connected Runner (100-chunk run alongside)',
          median: `${fmtMs(cold)}; run() ${fmtMs(run10k)} (100 chunks: ${fmtMs(run100)})`,
          ratio: `${fmtRatio(run10k / run100)} run() 10k÷100`,
          goal: `< ${GOAL_MS} ms`,
          met: cold < GOAL_MS && run10k < GOAL_MS,
        },
        {
          benchmark: '3. no-op rerun: SQL statements (driver-counted, lock session included)',
          contenders: 'connect+run+close; run(); CLI',
          median: `${sCold.total}; ${s10k.total} (100 chunks: ${s100.total}); CLI ${sCli.total}`,
          ratio: constant ? 'same for 10 000 and 100 chunks' : 'differs with chunk count',
          goal: 'constant handful (≤ 5)',
          met: constant && sCold.total <= 5 && sCli.total <= 5,
        },
        {
          benchmark: '3. no-op rerun via the CLI (process start included)',
          contenders: '`node bin/idem.js run …` vs `node bin/idem.js --help` (node + module-load floor; see the startup rows for ratios to `node -e 0`)',
          median: `${fmtMs(cliMs)} vs ${fmtMs(helpMs)}`,
          ratio: `${fmtMs(cliMs - helpMs)} above the floor`,
          goal: 'info',
          met: null,
        },
      ],
      details: [
        '**3. no-op rerun — statements issued** (connect+run+close, then CLI):',
        '',
        ...sCold.runnerShapes.map((s) => `- ${s.count}× \`${s.shape}\``),
        ...(sCli.runnerShapes.length ? ['- CLI:', ...sCli.runnerShapes.map((s) => `  - ${s.count}× \`${s.shape}\``)] : []),
      ],
      data: {
        chunks: { big: big.chunks, small: small.chunks },
        samplesMs: Object.fromEntries([...samples].map(([k, v]) => [k, v.map((s) => s.result.ms)])),
        medianMs: { run10k, run100, connectRunClose: cold, cli: cliMs, cliHelp: helpMs },
        statements: { run10k: s10k, run100: s100, connectRunClose: sCold, cli: sCli },
      },
    };
  } finally {
    await runner.close();
    for (const t of ['big', 'small']) await dropTable(ctx.pool, `noop_${t}_${tag}`);
  }
}
