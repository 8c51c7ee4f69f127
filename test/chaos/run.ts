/**
 * `npm run chaos [-- --rounds 200 --seed 42] [--workers]`: the full chaos suite on DATABASE_URL or a fresh
 * embedded server; `--workers` shares every run among 2–6 `idem run --join` workers (workers-chaos.ts). Prints one summary line; exits 1 if any run diverged from the oracle or a clean run, double-committed, ended with an exit
 * code its scenario does not allow or hung, or if too few runs were really interrupted mid-way.
 */
import { mkdtemp, chown, rm } from 'node:fs/promises';
import { execFileSync } from 'node:child_process';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { startEmbeddedPostgres } from '../../src/embedded-postgres.ts';
import { chaosFailures, minMultiAttemptEpisodes, runChaos, summaryLine } from './chaos.ts';
import { runWorkersChaos, workersChaosFailures, workersSummaryLine } from './workers-chaos.ts';

function flag(name: string, fallback: number): number {
  const i = process.argv.indexOf(`--${name}`);
  const v = i >= 0 ? Number(process.argv[i + 1]) : fallback;
  if (!Number.isInteger(v) || v < 0) throw new Error(`--${name} must be a whole number`);
  return v;
}

const rounds = flag('rounds', 200);
const workers = process.argv.includes('--workers');
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
  await admin.query(`drop database if exists ${dbName} with (force)`);
  await admin.end();
  await cleanup();
}
process.exit(failed ? 1 : 0);
