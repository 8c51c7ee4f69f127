/**
 * `npm run bench`: idem's speed and footprint against hand-written SQL and a Postgres job queue,
 * measured side by side in one run (ratios, never timed assertions). Prints a markdown table and
 * writes bench-results.json. See test/bench/options.ts for the flags.
 */
import { writeFile } from 'node:fs/promises';
import pg from 'pg';
import { benchHttp } from './bench-http.ts';
import { benchMemory } from './bench-memory.ts';
import { benchNodeCpu } from './bench-node-cpu.ts';
import { benchNoopRerun } from './bench-noop-rerun.ts';
import { benchOverhead } from './bench-overhead.ts';
import { benchParallelism } from './bench-parallelism.ts';
import { benchQueue } from './bench-queue.ts';
import { benchResume } from './bench-resume.ts';
import { benchStatements } from './bench-statements.ts';
import { benchStartup } from './bench-startup.ts';
import { benchWorkers } from './bench-workers.ts';
import os from 'node:os';
import { parseOptions, USAGE, type BenchName } from './options.ts';
import { CostProbe } from './probe.ts';
import { machineMeta, renderMarkdown, type BenchContext, type BenchResult, type Meta } from './report.ts';
import { openBenchServer } from './server.ts';

const BENCHES: Record<BenchName, (ctx: BenchContext) => Promise<BenchResult>> = {
  overhead: benchOverhead,
  cpu: benchNodeCpu,
  queue: benchQueue,
  startup: benchStartup,
  noop: benchNoopRerun,
  resume: benchResume,
  statements: benchStatements,
  memory: benchMemory,
  parallel: benchParallelism,
  http: benchHttp,
  workers: benchWorkers,
};

// The benchmarks measure the package as users import it (dist/, built by `prebench`): under the
// root tsconfig's `paths`, tsx would hand them src/ instead (test/bench/register.mjs).
const idemEntry = import.meta.resolve('idem');
if (!idemEntry.endsWith('/dist/index.js')) {
  throw new Error(`'idem' resolves to ${idemEntry}, not the built package (dist/index.js): run the benchmarks with npm run bench`);
}

const log = (msg: string) => process.stderr.write(`${new Date().toISOString().slice(11, 19)} ${msg}\n`);

async function main(): Promise<number> {
  let opts;
  try {
    opts = parseOptions(process.argv.slice(2));
  } catch (err) {
    process.stderr.write(`bench: ${(err as Error).message}\n`);
    return 2;
  }
  if (opts === 'help') {
    process.stdout.write(`${USAGE}\n`);
    return 0;
  }
  const started = performance.now();
  const loadStart = os.loadavg()[0]!;
  const server = await openBenchServer(log);
  // Ctrl-C: drop the database and stop the embedded server instead of leaving them behind.
  const onSignal = () => {
    log('interrupted: cleaning up');
    void server.close().finally(() => process.exit(130));
  };
  process.once('SIGINT', onSignal);
  process.once('SIGTERM', onSignal);
  const pool = new pg.Pool({ connectionString: server.url, max: 4 });
  pool.on('error', () => {});
  const results: Array<{ name: BenchName; result?: BenchResult; error?: string }> = [];
  try {
    log(`postgres ${server.version} (${server.origin}); benchmarks: ${opts.only.join(', ')}`);
    const probe = await CostProbe.open(pool);
    if (!probe.measuresServerCpu) log('server CPU not measurable (server not local): pg cpu columns show n/a');
    if (server.settings.huge_pages_status === 'off') {
      log('huge pages are off: on a VM the 1 M-row wall times then swing by a third between identical turns (README, Performance); as root, sysctl -w vm.nr_hugepages=1200 before the run steadies them');
    }
    const ctx: BenchContext = { url: server.url, pool, opts, log, probe };
    for (const name of opts.only) {
      const t0 = performance.now();
      try {
        results.push({ name, result: await BENCHES[name](ctx) });
      } catch (err) {
        log(`${name} failed: ${(err as Error).stack ?? err}`);
        results.push({ name, error: (err as Error).message });
      }
      log(`${name} took ${((performance.now() - t0) / 1000).toFixed(0)} s`);
    }
  } finally {
    await pool.end().catch(() => {});
    await server.close();
  }
  const meta: Meta = {
    date: new Date().toISOString(),
    machine: machineMeta(),
    postgres: { version: server.version, origin: server.origin, settings: server.settings },
    rows: opts.rows,
    rounds: opts.rounds,
    durationS: (performance.now() - started) / 1000,
    load: { start: loadStart, end: os.loadavg()[0]! },
  };
  process.stdout.write(`\n${renderMarkdown(meta, results)}`);
  const json = { meta, results: results.map((r) => ({ name: r.name, ...(r.error ? { error: r.error } : { rows: r.result!.rows, data: r.result!.data }) })) };
  await writeFile(opts.out, `${JSON.stringify(json, null, 2)}\n`);
  log(`wrote ${opts.out}`);
  return results.some((r) => r.error) ? 1 : 0;
}

process.exitCode = await main();
