/**
 * What both chaos modes share (chaos.ts: one process per invocation; workers-chaos.ts: workers that
 * share a run): the job's processes and how they must end, the oracle and the checks of a finished
 * run, and the driver that sets up a chaos run, keeps its episode and times its blows.
 */
import { createHash } from 'node:crypto';
import { spawn, type ChildProcess } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
const JOBS_DIR = path.join(ROOT, 'test', 'fixtures', 'chaos-jobs');
export const ROWS = 3000; // 100 chunks of 30 rows
/** How long a round may take before its processes count as hung (and are killed). */
export const SETTLE_MS = 60_000;

/** The value and label every row must end with: the oracle, independent of the job's SQL. */
export const chaosValue = (id: number) => (id * 7919) % 1000;
const chaosLabel = (id: number) => `v-${chaosValue(id)}`;
/** md5 of the table as `stateHash` renders it, computed from the ids alone. */
const ORACLE_HASH = createHash('md5')
  .update(Array.from({ length: ROWS }, (_, i) => `${i + 1}:${chaosValue(i + 1)}:${chaosLabel(i + 1)}`).join(','))
  .digest('hex');
const ORACLE_TOTAL = Array.from({ length: ROWS }, (_, i) => chaosValue(i + 1)).reduce((a, b) => a + b, 0);

export interface ChaosStats {
  seed: number;
  rounds: number;
  episodes: number;
  /** Episodes whose chunks were committed by two or more attempts: runs really interrupted mid-way. */
  multiAttemptEpisodes: number;
  spawned: number;
  kills: number;
  /** Kills sent while the victim's run had committed some chunks but not all: mid-run. */
  midRunKills: number;
  terminations: number;
  overlaps: number;
  /** End states unlike a clean run's. */
  divergent: number;
  /** End states (table or summary) unlike the oracle's values computed from the ids. */
  oracleMismatches: number;
  duplicateCommits: number;
  missingCommits: number;
  markerMismatches: number;
  /** Processes that ended with an exit code (or signal) their scenario does not allow. */
  unexpectedExits: string[];
  /** Processes still alive at the settle time-out (killed then): hangs. */
  hangs: string[];
  /** How long the clean reference run took, from its first to its last commit. */
  workMs: number;
}

/** Every counter at zero, for a chaos run with this seed. */
export function newChaosStats(seed: number): ChaosStats {
  return {
    seed, rounds: 0, episodes: 0, multiAttemptEpisodes: 0, spawned: 0, kills: 0, midRunKills: 0, terminations: 0, overlaps: 0,
    divergent: 0, oracleMismatches: 0, duplicateCommits: 0, missingCommits: 0, markerMismatches: 0, unexpectedExits: [], hangs: [], workMs: 0,
  };
}

/** mulberry32: a tiny seeded PRNG, so a failing seed replays the same schedule of abuse. */
export function prng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

export interface Child {
  proc: ChildProcess;
  /** What this process is: for the report. */
  role: string;
  /** Exit codes its scenario allows (a SIGKILL is allowed only when the driver sent it). */
  allowed: ReadonlySet<number>;
  killedByDriver: boolean;
  exited: boolean;
  done: Promise<{ code: number | null; signal: NodeJS.Signals | null; stderr: string }>;
}

export function startRunner(databaseUrl: string, runKey: string, concurrency: number, wait: boolean, role: string, allowed: readonly number[], join = false): Child {
  const args = [path.join(ROOT, 'bin', 'idem.js'), '--jobs-dir', JOBS_DIR, '--log-level', 'info', 'run', 'chaos-backfill', '--key', runKey, '--concurrency', String(concurrency), '--param', 'sleepMs=30'];
  if (wait) args.push('--wait', '30');
  if (join) args.push('--join');
  const proc = spawn(process.execPath, args, { cwd: ROOT, env: { ...process.env, DATABASE_URL: databaseUrl, IDEM_FAULT: '' }, stdio: ['ignore', 'ignore', 'pipe'] });
  let stderr = '';
  proc.stderr!.on('data', (d: Buffer) => (stderr += d.toString()));
  const child: Child = { proc, role: `${role}${wait ? ' --wait' : ''}`, allowed: new Set(allowed), killedByDriver: false, exited: false, done: undefined as never };
  child.done = new Promise((resolve) =>
    proc.on('exit', (code, signal) => {
      child.exited = true;
      resolve({ code, signal, stderr });
    }),
  );
  return child;
}

/** Lines of a process's stderr a report quotes: enough of its log to tell why a rare exit happened. */
export const STDERR_TAIL_LINES = 40;

/**
 * The end of a process's stderr for a report, one indented line each under what happened, so a
 * flake seen once (a seed that does not replay it) can be diagnosed from the report alone.
 */
export function stderrTail(stderr: string, lines = STDERR_TAIL_LINES): string {
  const all = stderr.trimEnd().split('\n');
  if (all.length === 1 && all[0] === '') return ' (no stderr)';
  const shown = all.slice(-lines);
  const cut = all.length > shown.length ? `, last ${shown.length} of ${all.length} lines` : '';
  return `; its stderr${cut}:\n${shown.map((l) => `      | ${l}`).join('\n')}`;
}

/** Waits for every child and checks how each ended; then waits until their sessions are gone. */
export async function settle(client: pg.Client, children: Child[], stats: ChaosStats, label: string): Promise<void> {
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    for (const c of children) if (!c.exited) c.proc.kill('SIGKILL');
  }, SETTLE_MS);
  const hung = new Set<Child>();
  const ends = children.map(async (c) => {
    const r = await c.done;
    if (timedOut && !c.killedByDriver && r.signal === 'SIGKILL') hung.add(c);
    return r;
  });
  for (const [i, end] of ends.entries()) {
    const c = children[i]!;
    const { code, signal, stderr } = await end;
    if (hung.has(c)) stats.hangs.push(`${label}: ${c.role} still running after ${SETTLE_MS} ms${stderrTail(stderr)}`);
    else if (signal !== null ? !(signal === 'SIGKILL' && c.killedByDriver) : !c.allowed.has(code!)) {
      stats.unexpectedExits.push(`${label}: ${c.role} ended with ${code ?? signal} (allowed: ${[...c.allowed].join(', ')}${c.killedByDriver ? ', SIGKILL' : ''})${stderrTail(stderr)}`);
    }
  }
  clearTimeout(timer);
  // A killed process's backend ends a moment after the process: until then its lock may still be
  // held, and a single invocation of the next round would rightly (but uselessly) exit 75.
  const deadline = Date.now() + SETTLE_MS;
  while ((await idemSessions(client)).length > 0) {
    if (Date.now() > deadline) {
      stats.hangs.push(`${label}: idem sessions still connected ${SETTLE_MS} ms after their processes ended`);
      break;
    }
    await sleep(20);
  }
}

export async function idemSessions(client: pg.Client): Promise<number[]> {
  const { rows } = await client.query<{ pid: number }>(
    `select pid from pg_stat_activity where datname = current_database() and (application_name like 'idem %' or application_name like 'idem-lock %') and pid <> pg_backend_pid()`,
  );
  return rows.map((r) => r.pid);
}

export async function prepareChaosTables(client: pg.Client): Promise<void> {
  await client.query(`drop table if exists chaos_items, chaos_commits, chaos_summary`);
  await client.query(`create table chaos_items (id integer primary key, value integer not null default 0, label text)`);
  await client.query(`insert into chaos_items (id) select g from generate_series(1, ${ROWS}) g`);
  // No unique key on purpose: a chunk committed twice must be visible as two rows.
  await client.query(`create table chaos_commits (run_key text not null, step text not null, chunk_key text not null, attempt integer not null, committed_at timestamptz not null default clock_timestamp())`);
  await client.query(`create table chaos_summary (run_key text primary key, total bigint not null)`);
}

export async function stateHash(client: pg.Client): Promise<string> {
  const { rows } = await client.query<{ h: string }>(`select md5(string_agg(id || ':' || value || ':' || coalesce(label, '-'), ',' order by id)) as h from chaos_items`);
  return rows[0]!.h;
}

/** Chunks (of any step) of this run committed so far. */
export async function commitsOf(client: pg.Client, runKey: string): Promise<number> {
  const { rows } = await client.query<{ n: number }>(`select count(*)::int as n from chaos_commits where run_key = $1`, [runKey]);
  return rows[0]!.n;
}

/**
 * Verifies one finished run: the table and summary hold the oracle's values and equal a clean run's
 * state; every chunk of every step committed exactly once, by the attempt its marker names.
 */
export async function verifyEpisode(client: pg.Client, runKey: string, reference: string, stats: ChaosStats): Promise<void> {
  const hash = await stateHash(client);
  if (hash !== reference) stats.divergent++;
  const { rows: summary } = await client.query<{ total: string }>(`select total::text from chaos_summary where run_key = $1`, [runKey]);
  if (hash !== ORACLE_HASH || Number(summary[0]?.total) !== ORACLE_TOTAL) stats.oracleMismatches++;
  const dup = await client.query<{ n: number }>(`select count(*)::int as n from (select step, chunk_key from chaos_commits where run_key = $1 group by 1, 2 having count(*) > 1) d`, [runKey]);
  stats.duplicateCommits += dup.rows[0]!.n;
  const missing = await client.query<{ n: number }>(
    `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id
     where r.job = 'chaos-backfill' and r.run_key = $1
       and not exists (select 1 from chaos_commits k where k.run_key = $1 and k.step = c.step and k.chunk_key = c.key)`,
    [runKey],
  );
  stats.missingCommits += missing.rows[0]!.n;
  // Both steps are there: 100 backfill chunks and summarise's one.
  const { rows: steps } = await client.query<{ step: string; n: number }>(`select step, count(*)::int as n from chaos_commits where run_key = $1 group by 1 order by 1`, [runKey]);
  if (JSON.stringify(steps) !== JSON.stringify([{ step: 'backfill', n: ROWS / 30 }, { step: 'summarise', n: 1 }])) stats.missingCommits++;
  const mismatch = await client.query<{ n: number }>(
    `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id
     join chaos_commits k on k.run_key = r.run_key and k.step = c.step and k.chunk_key = c.key
     where r.job = 'chaos-backfill' and r.run_key = $1 and c.done_attempt is distinct from k.attempt`,
    [runKey],
  );
  stats.markerMismatches += mismatch.rows[0]!.n;
  const { rows: attempts } = await client.query<{ n: number }>(`select count(distinct attempt)::int as n from chaos_commits where run_key = $1`, [runKey]);
  if (attempts[0]!.n >= 2) stats.multiAttemptEpisodes++;
  stats.episodes++;
}

export async function runStatus(client: pg.Client, runKey: string): Promise<string | undefined> {
  const { rows } = await client.query<{ status: string }>(`select status from idem.runs where job = 'chaos-backfill' and run_key = $1`, [runKey]).catch(() => ({ rows: [] as { status: string }[] }));
  return rows[0]?.status;
}

export interface ChaosDriverOptions<S extends ChaosStats> {
  readonly databaseUrl: string;
  /** Run keys are `<prefix>-<episode>`. */
  readonly runKeyPrefix: string;
  /** Chunks run at once inside each process (the clean reference run's too). */
  readonly concurrency: number;
  /** Start the clean reference run as a `--join` worker (alone on the run, it starts it). */
  readonly join: boolean;
  /** The chaos run's seeded PRNG: the driver draws from it only in `midRun`, so a seed replays. */
  readonly rnd: () => number;
  /** Filled in as the run goes; `workMs` is set from the clean run. */
  readonly stats: S;
  /** Checks of a finished run beyond {@link verifyEpisode}'s. Defaults to none. */
  readonly verifyRun?: (client: pg.Client, runKey: string) => Promise<void>;
}

/** One chaos run's driver: its own session, the clean run's reference state and the episode under way. */
export interface ChaosDriver {
  /** The driver's own session (application_name `chaos-driver`, not counted as idem's). */
  readonly client: pg.Client;
  /** The run key of the episode under way: each episode is one run, abused until it succeeds. */
  readonly runKey: string;
  readonly episode: number;
  /**
   * Waits until the run commits (or every one of `children` ended), then a random part, up to
   * `fraction`, of the time the clean run needed for what is left, divided among the `sharing`
   * workers that do it together: the blow that follows lands while chunks are being committed, not
   * after the run is over.
   */
  midRun(children: readonly Child[], fraction: number, sharing?: number): Promise<void>;
  /** SIGKILLs a child still running, counted as mid-run when its run had committed some chunks but not all. */
  kill(child: Child): Promise<void>;
  /** When the episode's run succeeded: verifies it and starts the next episode. */
  endEpisodeIfDone(): Promise<void>;
  /** Finishes the episode in flight, if any, with the undisturbed processes `start` launches, and verifies it. */
  finish(start: (runKey: string) => Child[]): Promise<void>;
}

/**
 * Connects the driver, creates the chaos tables, runs the clean reference run (its state is what
 * every episode must end with, its commit times say how long the work takes), starts the first
 * episode and hands the driver to `rounds`; closes the driver's session after.
 */
export async function withChaosDriver<S extends ChaosStats>(opts: ChaosDriverOptions<S>, rounds: (driver: ChaosDriver) => Promise<void>): Promise<void> {
  const { stats, rnd } = opts;
  const client = new pg.Client({ connectionString: opts.databaseUrl, application_name: 'chaos-driver' });
  await client.connect();
  try {
    await prepareChaosTables(client);
    const clean = startRunner(opts.databaseUrl, 'clean', opts.concurrency, false, 'clean run', [0], opts.join);
    stats.spawned++;
    await settle(client, [clean], stats, 'clean run');
    if ((await runStatus(client, 'clean')) !== 'succeeded') throw new Error(`the clean reference run did not succeed: ${[...stats.unexpectedExits, ...stats.hangs].join('; ')}`);
    const reference = await stateHash(client);
    const { rows: span } = await client.query<{ ms: number }>(`select (extract(epoch from max(committed_at) - min(committed_at)) * 1000)::int as ms from chaos_commits where run_key = 'clean'`);
    stats.workMs = Math.max(50, span[0]!.ms);
    const totalCommits = ROWS / 30 + 1;

    let episode = 0;
    let runKey = '';
    const newEpisode = async () => {
      episode++;
      runKey = `${opts.runKeyPrefix}-${episode}`;
      await client.query(`update chaos_items set value = 0, label = null`);
    };
    const verify = async () => {
      await verifyEpisode(client, runKey, reference, stats);
      await opts.verifyRun?.(client, runKey);
    };
    const driver: ChaosDriver = {
      client,
      get runKey() {
        return runKey;
      },
      get episode() {
        return episode;
      },
      async midRun(children, fraction, sharing = 1) {
        const before = await commitsOf(client, runKey);
        const until = Date.now() + SETTLE_MS;
        while ((await commitsOf(client, runKey)) === before && children.some((c) => !c.exited) && Date.now() < until) await sleep(10);
        const left = Math.max(0, totalCommits - (await commitsOf(client, runKey)));
        await sleep(Math.floor((rnd() * fraction * stats.workMs * (left / totalCommits)) / sharing));
      },
      async kill(c) {
        if (c.exited) return;
        const n = await commitsOf(client, runKey);
        c.killedByDriver = true;
        if (c.proc.kill('SIGKILL')) {
          stats.kills++;
          if (n > 0 && n < totalCommits) stats.midRunKills++;
        }
      },
      async endEpisodeIfDone() {
        if ((await runStatus(client, runKey)) !== 'succeeded') return;
        await verify();
        await newEpisode();
      },
      async finish(start) {
        if ((await runStatus(client, runKey)) === undefined) return;
        const last = start(runKey);
        stats.spawned += last.length;
        await settle(client, last, stats, `final run (${runKey})`);
        if ((await runStatus(client, runKey)) !== 'succeeded') stats.unexpectedExits.push(`final run of ${runKey} did not succeed`);
        else await verify();
      },
    };
    await newEpisode();
    await rounds(driver);
  } finally {
    await client.end();
  }
}
