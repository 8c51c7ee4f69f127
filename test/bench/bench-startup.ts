import { randomBytes } from 'node:crypto';
import { execFileSync, spawn } from 'node:child_process';
import { existsSync, readdirSync } from 'node:fs';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Runner } from 'idem';
import { benchBackfill } from './backfill-job.ts';
import { BENCH_JOBS_DIR, BENCH_JS_JOBS_DIR, REPO_ROOT } from './cli.ts';
import { alternate, fmtRatio, median, type Contender } from './measure.ts';
import type { BenchContext, BenchResult } from './report.ts';
import { dropTable, prepareTable } from './tables.ts';

const HELP_GOAL_MS = 150;
const NOOP_GOAL_MS = 250;

const GNU_TIME = '/usr/bin/time';

/** Node majors other than this one in .test-nodes/ (node scripts/fetch-test-nodes.mjs), e.g. 22 and 24. */
const OTHER_NODES: Array<{ major: string; version: string; bin: string }> = (() => {
  const dir = path.join(REPO_ROOT, '.test-nodes');
  if (!existsSync(dir)) return [];
  return readdirSync(dir)
    .map((major) => ({ major, bin: path.join(dir, major, 'bin', 'node') }))
    .filter((n) => existsSync(n.bin) && n.major !== process.versions.node.split('.')[0])
    .map((n) => ({ ...n, version: execFileSync(n.bin, ['--version'], { encoding: 'utf8' }).trim() }));
})();

/** One process: its wall time, and its CPU time (user + system, all threads) when GNU time is there to read it. */
interface ProcessTime {
  readonly ms: number;
  readonly cpuMs: number | null;
}

/** Runs `node <args>` to its exit (throws unless it exits 0), under GNU time when present. */
async function timeProcess(args: readonly string[], env: NodeJS.ProcessEnv, tmp: string, node: string = process.execPath): Promise<ProcessTime> {
  const timeFile = path.join(tmp, `time-${randomBytes(4).toString('hex')}`);
  const useTime = existsSync(GNU_TIME);
  const [file, argv] = useTime ? [GNU_TIME, ['-f', '%U %S', '-o', timeFile, node, ...args]] : [node, [...args]];
  const ms = await new Promise<number>((resolve, reject) => {
    const t0 = performance.now();
    const child = spawn(file, argv, { cwd: REPO_ROOT, env, stdio: ['ignore', 'ignore', 'pipe'] });
    let stderr = '';
    child.stderr!.on('data', (b: Buffer) => { stderr = (stderr + b.toString()).slice(-2000); });
    child.on('error', reject);
    child.on('close', (code) => (code === 0 ? resolve(performance.now() - t0) : reject(new Error(`node ${args.join(' ')} exited ${code}: ${stderr.trim()}`))));
  });
  if (!useTime) return { ms, cpuMs: null };
  const [user, system] = (await readFile(timeFile, 'utf8')).trim().split(/\s+/).map(Number);
  await rm(timeFile, { force: true });
  return { ms, cpuMs: (user! + system!) * 1000 };
}

/** Milliseconds, always in ms (start-up figures are compared with the goals in ms). */
const ms = (x: number) => `${Math.round(x)} ms`;

/**
 * Start-up: whole commands as cron or an operator runs them, side by side with `node -e 0` (the
 * floor no Node CLI goes under), as absolute medians of alternating rounds and as ratios to that
 * floor. `idem --help` loads commander and the command modules only; the no-op rerun (`idem run`
 * of a finished run, DATABASE_URL given) adds the job file, the runner and one connection, for a
 * TypeScript job (its compiled copy under .idem/cache, fresh after the first run) and a
 * JavaScript one. Absolute goals from the issue hold on a quiet machine; the ratios are what
 * compare across machines.
 */
export async function benchStartup(ctx: BenchContext): Promise<BenchResult> {
  const tag = randomBytes(3).toString('hex');
  const rounds = Math.max(ctx.opts.rounds, 15);
  const table = `startup_${tag}`;
  const params = { table, size: 10 };
  const key = `startup-${tag}`;
  await prepareTable(ctx.pool, table, 1_000);
  const runner = await Runner.connect({ connectionString: ctx.url });
  try {
    await runner.run(benchBackfill, { params, key });
  } finally {
    await runner.close();
  }
  const env: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: ctx.url };
  delete env.NODE_OPTIONS;
  const tmp = await mkdtemp(path.join(os.tmpdir(), 'idem-bench-startup-'));
  const proc = (name: string, args: string[], node?: string): Contender<ProcessTime> => ({ name, prepare: async () => ({ run: () => timeProcess(args, env, tmp, node) }) });
  const idem = ['bin/idem.js', '--jobs-dir', BENCH_JOBS_DIR];
  const idemJs = ['bin/idem.js', '--jobs-dir', BENCH_JS_JOBS_DIR];
  const contenders = [
    proc('node -e 0', ['-e', '0']),
    proc('idem --help', [...idem, '--help']),
    proc('idem run (no-op)', [...idem, 'run', 'bench-backfill', '--params', JSON.stringify(params), '--key', key]),
    proc('idem run (no-op, .js job)', [...idemJs, 'run', 'bench-noop-js', '--key', key]),
    proc('idem status', [...idem, 'status', '--limit', '5']),
    // Other Node majors where scripts/fetch-test-nodes.mjs fetched them: Node 22.1+ keeps V8's
    // compiled code on disk (module.enableCompileCache, see bin/idem.js), Node 20 cannot.
    ...OTHER_NODES.flatMap((n) => [
      proc(`node ${n.major} -e 0`, ['-e', '0'], n.bin),
      proc(`idem run (no-op, .js job) on node ${n.major}`, [...idemJs, 'run', 'bench-noop-js', '--key', key], n.bin),
    ]),
  ];
  try {
    // The JavaScript job's run finishes here, untimed, like the TypeScript one above.
    await timeProcess([...idemJs, 'run', 'bench-noop-js', '--key', key], env, tmp);
    // Each other Node writes its compile cache on its first run, untimed.
    for (const n of OTHER_NODES) await timeProcess([...idemJs, 'run', 'bench-noop-js', '--key', key], env, tmp, n.bin);
    ctx.log(`startup: ${rounds} alternating rounds of ${contenders.map((c) => c.name).join(', ')}`);
    const samples = await alternate(rounds, contenders, ctx.log);
    const med = (n: string) => median(samples.get(n)!.map((s) => s.ms));
    const [node, help, noop, noopJs, status] = contenders.map((c) => med(c.name)) as [number, number, number, number, number];
    ctx.log(`startup medians: node -e 0 ${ms(node)}, idem --help ${ms(help)}, no-op rerun ${ms(noop)} (.js job ${ms(noopJs)}), idem status ${ms(status)}`);
    // On a shared machine the fastest round is the one least disturbed: shown next to the medians, never instead.
    const fastest = (n: string) => Math.min(...samples.get(n)!.map((s) => s.ms));
    ctx.log(`startup fastest rounds: ${contenders.map((c) => `${c.name} ${ms(fastest(c.name))}`).join(', ')}`);
    // CPU time (user + system) grows far less than wall time when other work shares the machine.
    const cpu = (n: string) => median(samples.get(n)!.flatMap((s) => (s.result.cpuMs === null ? [] : [s.result.cpuMs])));
    const cpuMs = Object.fromEntries(contenders.map((c) => [c.name, cpu(c.name)]));
    if (Number.isFinite(cpu('node -e 0'))) ctx.log(`startup CPU medians (user + system): ${contenders.map((c) => `${c.name} ${ms(cpu(c.name))} (${fmtRatio(cpu(c.name) / cpu('node -e 0'))})`).join(', ')}`);
    const cpuNote = (name: string) => (Number.isFinite(cpu(name)) ? `; CPU ${ms(cpu(name))} vs ${ms(cpu('node -e 0'))}` : '');
    const row = (benchmark: string, x: number, goalMs: number | null, name: string) => ({
      benchmark,
      contenders: 'vs `node -e 0`',
      median: `${ms(x)} vs ${ms(node)}${cpuNote(name)}`,
      ratio: `${fmtRatio(x / node)} node -e 0`,
      goal: goalMs === null ? 'info' : `≤ ${goalMs} ms`,
      met: goalMs === null ? null : x <= goalMs,
    });
    return {
      rows: [
        { benchmark: 'startup: `node -e 0` (whole process, the floor)', contenders: '', median: `${ms(node)}${cpuNote('node -e 0').replace(/ vs .*$/, '')}`, ratio: '1', goal: 'info', met: null },
        row('startup: `idem --help` (whole process)', help, HELP_GOAL_MS, 'idem --help'),
        row('startup: no-op rerun `idem run` of a finished run (whole process, DATABASE_URL, TypeScript job)', noop, NOOP_GOAL_MS, 'idem run (no-op)'),
        row('startup: no-op rerun `idem run` of a finished run (whole process, DATABASE_URL, JavaScript job)', noopJs, NOOP_GOAL_MS, 'idem run (no-op, .js job)'),
        row('startup: `idem status` (whole process, DATABASE_URL)', status, null, 'idem status'),
        ...OTHER_NODES.map((n) => {
          const floor = med(`node ${n.major} -e 0`);
          const x = med(`idem run (no-op, .js job) on node ${n.major}`);
          return {
            benchmark: `startup: no-op rerun, JavaScript job, on Node ${n.version} (compile cache on)`,
            contenders: `vs that Node's \`node -e 0\``,
            median: `${ms(x)} vs ${ms(floor)}`,
            ratio: `${fmtRatio(x / floor)} node -e 0`,
            goal: `≤ ${NOOP_GOAL_MS} ms`,
            met: x <= NOOP_GOAL_MS,
          };
        }),
      ],
      data: {
        samplesMs: Object.fromEntries([...samples].map(([k, v]) => [k, v.map((s) => s.ms)])),
        medianMs: { node, help, noop, noopJs, status },
        fastestMs: Object.fromEntries(contenders.map((c) => [c.name, fastest(c.name)])),
        cpuMedianMs: cpuMs,
      },
    };
  } finally {
    await dropTable(ctx.pool, table);
    await rm(tmp, { recursive: true, force: true });
  }
}
