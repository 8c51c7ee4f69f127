/**
 * `npm run chaos [-- --rounds 200 --seed 42] [--workers]`: the full chaos suite on DATABASE_URL or a fresh
 * embedded server; `--workers` shares every run among 2–6 `idem run --join` workers (workers-chaos.ts). Prints one summary line; exits 1 if any run diverged from the oracle or a clean run, double-committed, ended with an exit
 * code its scenario does not allow or hung, or if too few runs were really interrupted mid-way.
 */
import { mkdtemp, chown, rm } from 'node:fs/promises';
import { execFileSync } from 'node:child_process';
import os from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import pg from 'pg';
import { startEmbeddedPostgres } from '../../src/embedded-postgres.ts';
import { chaosFailures, minMultiAttemptEpisodes, runChaos, summaryLine } from './chaos.ts';
import { runWorkersChaos, workersChaosFailures, workersSummaryLine } from './workers-chaos.ts';

const USAGE = `usage: npm run chaos [-- --rounds N] [--seed N] [--workers [--minutes N]]
  --rounds N    rounds to run (default 200)
  --seed N      replay a run: its first line prints the seed
  --workers     share every run among 2-6 \`idem run --join\` workers, killed and joining at random
  --minutes N   with --workers: start no new round after N minutes
DATABASE_URL: the server to use (a database of its own is made and dropped); else a fresh embedded one.`;

const options = {
  rounds: { type: 'string' },
  seed: { type: 'string' },
  minutes: { type: 'string' },
  workers: { type: 'boolean' },
  help: { type: 'boolean', short: 'h' },
} as const;
let args: ReturnType<typeof parseArgs<{ options: typeof options; strict: true; allowPositionals: false }>>['values'];
try {
  args = parseArgs({
    options,
    strict: true,
    allowPositionals: false,
  }).values;
} catch (err) {
  // An unknown flag (a typo of --rounds) must not start a 200-round run.
  console.error(`chaos: ${(err as Error).message}; see npm run chaos -- --help`);
  process.exit(2);
}
if (args.help) {
  console.log(USAGE);
  process.exit(0);
}

function flag(name: 'rounds' | 'seed' | 'minutes', fallback: number): number {
  const raw = args[name];
  const v = raw === undefined ? fallback : Number(raw);
  if (!Number.isInteger(v) || v < 0 || (raw !== undefined && raw.trim() === '')) {
    console.error(`chaos: --${name} must be a whole number (got ${JSON.stringify(raw)})`);
    process.exit(2);
  }
  return v;
}

const rounds = flag('rounds', 200);
const workers = args.workers === true;
/** `--minutes N` (workers mode): start no new round after N minutes, so a bounded run still ends with its summary. */
const minutes = flag('minutes', 0);
const seed = flag('seed', Math.floor(Math.random() * 2 ** 31));
let url = process.env.DATABASE_URL;
let cleanup = async () => {};
if (!url) {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'idem-chaos-'));
  if (process.getuid?.() === 0) {
    const uid = Number(execFileSync('id', ['-u', 'postgres']).toString());
    const gid = Number(execFileSync('id', ['-g', 'postgres']).toString());
    await chown(dir, uid, gid);
  }
  const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'pg') });
  url = server.url;
  cleanup = async () => {
    await server.stop();
    await rm(dir, { recursive: true, force: true });
  };
}
// A database of its own, so the suite never touches anything else.
const admin = new pg.Client({ connectionString: url });
await admin.connect();
const dbName = `idem_chaos_${process.pid}`;
await admin.query(`drop database if exists ${dbName}`);
await admin.query(`create database ${dbName}`);
const dbUrl = new URL(url);
dbUrl.pathname = `/${dbName}`;
console.log(`chaos${workers ? ' --workers' : ''}: seed=${seed} rounds=${rounds} (replay with --seed ${seed} --rounds ${rounds}${workers ? ' --workers' : ''})`);
let failed = true;
/** Drops the suite's database, closes the admin connection and stops an embedded server: each step runs even if one before it failed. */
const teardown = async () => {
  try {
    await admin.query(`drop database if exists ${dbName} with (force)`);
  } finally {
    try {
      await admin.end();
    } finally {
      await cleanup();
    }
  }
};
// Ctrl-C or a kill: drop the database and stop the embedded server instead of leaving them behind.
// The rounds' own connections then die under them: their errors are the cleanup's, not failures.
let interrupted = false;
process.on('uncaughtException', (err) => {
  if (interrupted) return;
  console.error(err);
  process.exit(1);
});
const onSignal = (signal: NodeJS.Signals) => {
  if (interrupted) return;
  interrupted = true;
  console.log(`chaos: ${signal}: cleaning up`);
  void teardown()
    .catch((err: unknown) => console.error(`chaos: cleanup failed: ${(err as Error).message}`))
    .finally(() => process.exit(130));
};
process.once('SIGINT', onSignal);
process.once('SIGTERM', onSignal);
try {
  const onLine = process.env.CHAOS_VERBOSE ? console.log : undefined;
  let problems: string[];
  if (workers) {
    const stats = await runWorkersChaos({ databaseUrl: dbUrl.toString(), rounds, seed, onLine, ...(minutes > 0 ? { budgetMs: minutes * 60_000 } : {}) });
    problems = workersChaosFailures(stats, minMultiAttemptEpisodes(stats.rounds));
    for (const p of problems) console.log(`failed: ${p}`);
    console.log(workersSummaryLine(stats));
  } else {
    const stats = await runChaos({ databaseUrl: dbUrl.toString(), rounds, seed, onLine });
    problems = chaosFailures(stats, minMultiAttemptEpisodes(rounds));
    for (const p of problems) console.log(`failed: ${p}`);
    console.log(summaryLine(stats));
  }
  failed = problems.length > 0;
} finally {
  await teardown();
}
process.exit(failed ? 1 : 0);
