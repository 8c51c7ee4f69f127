import { spawn, type ChildProcess } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
const JOBS_DIR = path.join(ROOT, 'test', 'fixtures', 'chaos-jobs');
const ROWS = 3000; // 100 chunks of 30 rows
const OK_EXITS = new Set([0, 69, 75]); // done, lost its lock (terminated), busy (overlap)

export interface ChaosOptions {
  readonly databaseUrl: string;
  readonly rounds: number;
  readonly seed: number;
  /** Chunks run at once inside each runner process. */
  readonly concurrency?: number;
  readonly onLine?: (line: string) => void;
}

export interface ChaosStats {
  seed: number;
  rounds: number;
  episodes: number;
  spawned: number;
  kills: number;
  terminations: number;
  overlaps: number;
  divergent: number;
  duplicateCommits: number;
  missingCommits: number;
  markerMismatches: number;
  unexpectedExits: string[];
}

/** mulberry32: a tiny seeded PRNG, so a failing seed replays the same schedule of abuse. */
function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

interface Child {
  proc: ChildProcess;
  done: Promise<{ code: number | null; signal: NodeJS.Signals | null; stderr: string }>;
}

function startRunner(databaseUrl: string, runKey: string, concurrency: number, wait: boolean): Child {
  const args = [path.join(ROOT, 'bin', 'idem.js'), '--jobs-dir', JOBS_DIR, '--log-level', 'error', 'run', 'chaos-backfill', '--key', runKey, '--concurrency', String(concurrency), '--param', 'sleepMs=30'];
  if (wait) args.push('--wait', '30');
  const proc = spawn(process.execPath, args, { cwd: ROOT, env: { ...process.env, DATABASE_URL: databaseUrl, IDEM_FAULT: '' }, stdio: ['ignore', 'ignore', 'pipe'] });
  let stderr = '';
  proc.stderr!.on('data', (d: Buffer) => (stderr += d.toString()));
  const done = new Promise<{ code: number | null; signal: NodeJS.Signals | null; stderr: string }>((resolve) =>
    proc.on('exit', (code, signal) => resolve({ code, signal, stderr })),
  );
  return { proc, done };
}

async function settle(children: Child[], stats: ChaosStats, timeoutMs = 40_000): Promise<void> {
  const timer = setTimeout(() => children.forEach((c) => c.proc.kill('SIGKILL')), timeoutMs);
  for (const c of children) {
    const { code, signal, stderr } = await c.done;
    if (signal === null && code !== null && !OK_EXITS.has(code)) stats.unexpectedExits.push(`exit ${code}: ${stderr.trim().split('\n').slice(-12).join(' | ')}`);
  }
  clearTimeout(timer);
}

export async function prepareChaosTables(client: pg.Client): Promise<void> {
  await client.query(`drop table if exists chaos_items, chaos_commits, chaos_summary`);
  await client.query(`create table chaos_items (id integer primary key, value integer not null default 0, label text)`);
  await client.query(`insert into chaos_items (id) select g from generate_series(1, ${ROWS}) g`);
  // No unique key on purpose: a chunk committed twice must be visible as two rows.
  await client.query(`create table chaos_commits (run_key text not null, chunk_key text not null, attempt integer not null, committed_at timestamptz not null default clock_timestamp())`);
  await client.query(`create table chaos_summary (run_key text primary key, total bigint not null)`);
}

async function stateHash(client: pg.Client): Promise<string> {
  const { rows } = await client.query<{ h: string }>(`select md5(string_agg(id || ':' || value || ':' || coalesce(label, '-'), ',' order by id)) as h from chaos_items`);
  return rows[0]!.h;
}

/** Verifies one finished run: state equals a clean run's, every chunk committed exactly once, by the attempt its marker names. */
async function verifyEpisode(client: pg.Client, runKey: string, reference: string, stats: ChaosStats): Promise<void> {
  if ((await stateHash(client)) !== reference) stats.divergent++;
  const dup = await client.query<{ n: number }>(`select count(*)::int as n from (select chunk_key from chaos_commits where run_key = $1 group by chunk_key having count(*) > 1) d`, [runKey]);
  stats.duplicateCommits += dup.rows[0]!.n;
  const missing = await client.query<{ n: number }>(
    `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id
     where r.job = 'chaos-backfill' and r.run_key = $1 and c.step = 'backfill'
       and not exists (select 1 from chaos_commits k where k.run_key = $1 and k.chunk_key = c.key)`,
    [runKey],
  );
  stats.missingCommits += missing.rows[0]!.n;
  const mismatch = await client.query<{ n: number }>(
    `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id
     join chaos_commits k on k.run_key = r.run_key and k.chunk_key = c.key
     where r.job = 'chaos-backfill' and r.run_key = $1 and c.done_attempt is distinct from k.attempt`,
    [runKey],
  );
  stats.markerMismatches += mismatch.rows[0]!.n;
  stats.episodes++;
}

async function runStatus(client: pg.Client, runKey: string): Promise<string | undefined> {
  const { rows } = await client.query<{ status: string }>(`select status from idem.runs where job = 'chaos-backfill' and run_key = $1`, [runKey]).catch(() => ({ rows: [] as { status: string }[] }));
  return rows[0]?.status;
}

/**
 * Starts the CLI over and over and abuses it (SIGKILL at random moments, terminated backends,
 * overlapping invocations) until each run completes; then checks the run converged on a clean
 * run's end state with every chunk's work committed exactly once.
 */
export async function runChaos(opts: ChaosOptions): Promise<ChaosStats> {
  const rnd = prng(opts.seed);
  const concurrency = opts.concurrency ?? 4;
  const stats: ChaosStats = { seed: opts.seed, rounds: 0, episodes: 0, spawned: 0, kills: 0, terminations: 0, overlaps: 0, divergent: 0, duplicateCommits: 0, missingCommits: 0, markerMismatches: 0, unexpectedExits: [] };
  const client = new pg.Client({ connectionString: opts.databaseUrl, application_name: 'chaos-driver' });
  await client.connect();
  try {
    await prepareChaosTables(client);
    // The reference: one clean, undisturbed run.
    const clean = startRunner(opts.databaseUrl, 'clean', concurrency, false);
    stats.spawned++;
    await settle([clean], stats);
    if ((await runStatus(client, 'clean')) !== 'succeeded') throw new Error('the clean reference run did not succeed');
    const reference = await stateHash(client);

    let episode = 0;
    let runKey = '';
    const newEpisode = async () => {
      episode++;
      runKey = `chaos-${opts.seed}-${episode}`;
      await client.query(`update chaos_items set value = 0, label = null`);
    };
    await newEpisode();
    for (let round = 1; round <= opts.rounds; round++) {
      stats.rounds = round;
      const roll = rnd();
      const children: Child[] = [];
      const launch = (wait: boolean) => {
        children.push(startRunner(opts.databaseUrl, runKey, concurrency, wait));
        stats.spawned++;
      };
      const delay = 300 + Math.floor(rnd() * 2200);
      if (roll < 0.5) {
        launch(rnd() < 0.3);
        await sleep(delay);
        if (children[0]!.proc.exitCode === null && children[0]!.proc.kill('SIGKILL')) stats.kills++;
      } else if (roll < 0.7) {
        stats.overlaps++;
        const n = 2 + Math.floor(rnd() * 2);
        for (let i = 0; i < n; i++) launch(rnd() < 0.5);
        await sleep(delay);
        const victim = children[Math.floor(rnd() * n)]!;
        if (rnd() < 0.7 && victim.proc.exitCode === null && victim.proc.kill('SIGKILL')) stats.kills++;
      } else if (roll < 0.9) {
        launch(false);
        await sleep(delay);
        const { rows } = await client.query<{ pid: number }>(
          `select pid from pg_stat_activity where datname = current_database() and application_name in ('idem', 'idem-lock') and pid <> pg_backend_pid()`,
        );
        for (const r of rows) {
          if (rnd() < 0.5) {
            await client.query('select pg_terminate_backend($1)', [r.pid]);
            stats.terminations++;
          }
        }
      } else {
        launch(false);
      }
      await settle(children, stats);
      if ((await runStatus(client, runKey)) === 'succeeded') {
        await verifyEpisode(client, runKey, reference, stats);
        await newEpisode();
      }
      opts.onLine?.(`round ${round}: episode ${episode}, ${JSON.stringify({ kills: stats.kills, terminations: stats.terminations, overlaps: stats.overlaps })}`);
    }
    // Finish the episode in flight with an undisturbed run, then verify it too.
    if ((await runStatus(client, runKey)) !== undefined) {
      const last = startRunner(opts.databaseUrl, runKey, concurrency, true);
      stats.spawned++;
      await settle([last], stats);
      if ((await runStatus(client, runKey)) !== 'succeeded') stats.unexpectedExits.push(`final run of ${runKey} did not succeed`);
      else await verifyEpisode(client, runKey, reference, stats);
    }
    return stats;
  } finally {
    await client.end();
  }
}

export function summaryLine(s: ChaosStats): string {
  return `chaos: seed=${s.seed} rounds=${s.rounds} episodes=${s.episodes} spawned=${s.spawned} kills=${s.kills} backend-terminations=${s.terminations} overlaps=${s.overlaps} divergent-states=${s.divergent} duplicate-chunk-commits=${s.duplicateCommits} missing-chunk-commits=${s.missingCommits} marker-mismatches=${s.markerMismatches} unexpected-exits=${s.unexpectedExits.length}`;
}
