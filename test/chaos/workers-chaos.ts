import { readdir, readFile, readlink } from 'node:fs/promises';
import pg from 'pg';
import { chaosFailures } from './chaos.ts';
import { newChaosStats, prng, settle, sleep, startRunner, stderrTail, withChaosDriver, type ChaosStats, type Child } from './chaos-driver.ts';

/**
 * Chaos for workers (`npm run chaos -- --workers`): every run is shared by 2–6 `idem run --join`
 * processes while random workers are SIGKILLed, have their backends terminated, and new workers
 * join mid-run. Same oracle and commit-log checks as the single-process mode (chaos.ts).
 */
export interface WorkersChaosOptions {
  readonly databaseUrl: string;
  readonly rounds: number;
  readonly seed: number;
  /** Chunks run at once inside each worker. Defaults to `2`. */
  readonly concurrency?: number;
  /** Most workers started together at the beginning of a round (at least 2). Defaults to `6`. */
  readonly maxWorkers?: number;
  /** Most workers joining after each blow. Defaults to `2`. */
  readonly maxLateJoiners?: number;
  /** Start no new round after this many ms (the episode in flight is still finished and verified). Defaults to no limit. */
  readonly budgetMs?: number;
  readonly onLine?: (line: string) => void;
}

export interface WorkersChaosStats extends ChaosStats {
  /** Workers started at the beginning of a round, all together. */
  workers: number;
  /** Workers started while the run was under way (they join it, or find it done or ending). */
  lateJoins: number;
  /** Rounds in which every worker was SIGKILLed: the next round's workers resume under a new attempt. */
  killAllRounds: number;
  /** Workers whose own sessions (lock and work, or work only) were terminated. */
  terminatedWorkers: number;
  /** How the terminated workers ended, by exit code: what the protocol really does. */
  terminatedExits: Record<string, number>;
  /** Joiners that found the run ending in the others and exited 75 (documented: "try again once they stopped"). */
  busyWhileEnding: number;
  /** Finished runs whose summary is missing, or whose `attempts` differs from the run's attempt. */
  summaryMismatches: number;
}

/** The backend pids of the sessions one child process holds: its sockets' local ports are the servers' `client_port`s. */
async function backendsOf(client: pg.Client, pid: number): Promise<{ lock: number[]; work: number[] }> {
  const inodes = new Set<string>();
  for (const fd of await readdir(`/proc/${pid}/fd`).catch(() => [] as string[])) {
    const target = await readlink(`/proc/${pid}/fd/${fd}`).catch(() => '');
    const m = /^socket:\[(\d+)\]$/.exec(target);
    if (m) inodes.add(m[1]!);
  }
  const ports: number[] = [];
  for (const table of ['/proc/net/tcp', '/proc/net/tcp6']) {
    const text = await readFile(table, 'utf8').catch(() => '');
    for (const line of text.split('\n').slice(1)) {
      const f = line.trim().split(/\s+/);
      if (f.length > 9 && inodes.has(f[9]!)) ports.push(parseInt(f[1]!.split(':')[1]!, 16));
    }
  }
  if (ports.length === 0) return { lock: [], work: [] };
  const { rows } = await client.query<{ pid: number; app: string }>(
    `select pid, application_name as app from pg_stat_activity where datname = current_database() and client_port = any($1::int[]) and pid <> pg_backend_pid()`,
    [ports],
  );
  return { lock: rows.filter((r) => r.app.startsWith('idem-lock')).map((r) => r.pid), work: rows.filter((r) => !r.app.startsWith('idem-lock')).map((r) => r.pid) };
}

export async function runWorkersChaos(opts: WorkersChaosOptions): Promise<WorkersChaosStats> {
  const rnd = prng(opts.seed);
  const concurrency = opts.concurrency ?? 2;
  const maxWorkers = Math.max(2, opts.maxWorkers ?? 6);
  const maxLateJoiners = Math.max(1, opts.maxLateJoiners ?? 2);
  const stats: WorkersChaosStats = {
    ...newChaosStats(opts.seed),
    workers: 0, lateJoins: 0, killAllRounds: 0, terminatedWorkers: 0, terminatedExits: {}, busyWhileEnding: 0, summaryMismatches: 0,
  };
  // One summary: the run row's, counting the attempts its chunks were committed under.
  const verifyRun = async (client: pg.Client, runKey: string) => {
    const { rows } = await client.query<{ ok: boolean }>(
      `select (r.summary is not null and (r.summary->>'attempts')::int = r.attempt) as ok from idem.runs r where r.job = 'chaos-backfill' and r.run_key = $1`,
      [runKey],
    );
    if (!rows[0]?.ok) stats.summaryMismatches++;
  };
  // The clean reference: one undisturbed worker alone on the run (a `--join` with nobody to join starts it).
  await withChaosDriver({ databaseUrl: opts.databaseUrl, runKeyPrefix: `workers-${opts.seed}`, concurrency, join: true, rnd, stats, verifyRun }, async (driver) => {
    const { client } = driver;
    const stopAt = opts.budgetMs === undefined ? Infinity : Date.now() + opts.budgetMs;
    for (let round = 1; round <= opts.rounds && Date.now() < stopAt; round++) {
      stats.rounds = round;
      const children: Child[] = [];
      const terminated = new Set<Child>();
      const launch = (role: string, allowed: number[]) => {
        const c = startRunner(opts.databaseUrl, driver.runKey, concurrency, false, `round ${round} ${role}`, allowed, true);
        children.push(c);
        stats.spawned++;
        return c;
      };
      const live = () => children.filter((c) => !c.exited && !c.killedByDriver);
      const n = 2 + Math.floor(rnd() * (maxWorkers - 1));
      stats.workers += n;
      // 75 only for "the run is ending in the processes that share it": checked after settle.
      for (let i = 0; i < n; i++) launch(`worker ${i + 1}/${n}`, [0, 75]);
      // Every fourth round (and now and then another) kills every worker mid-run: the next round
      // must resume under a new attempt. The other rounds kill some, cut some off, add some.
      const killAll = round % 4 === 0 || rnd() < 0.1;
      // The workers share the run, so it ends about n times sooner than the one-worker clean run.
      await driver.midRun(children, killAll ? 0.7 : 0.5, n);
      if (killAll) {
        stats.killAllRounds++;
        for (const c of children) await driver.kill(c);
      } else {
        const blows = 1 + Math.floor(rnd() * 3);
        for (let b = 0; b < blows; b++) {
          const victims = live();
          const roll = rnd();
          if (roll < 0.35 && victims.length > 0) {
            await driver.kill(victims[Math.floor(rnd() * victims.length)]!);
          } else if (roll < 0.75 && victims.length > 0) {
            // Cut one worker off: its lock session (and, half the time, its work sessions too).
            const victim = victims[Math.floor(rnd() * victims.length)]!;
            const { lock, work } = await backendsOf(client, victim.proc.pid!);
            const targets = [...lock, ...(rnd() < 0.5 ? work : [])];
            for (const pid of targets) await client.query('select pg_terminate_backend($1)', [pid]);
            if (targets.length > 0) {
              stats.terminations += targets.length;
              stats.terminatedWorkers++;
              terminated.add(victim);
              victim.allowed = new Set([0, 69, 75]);
              victim.role += ' (backends terminated)';
            }
          } else if (roll < 0.85) {
            // A work session of any worker: its chunk retries on a new connection.
            const { rows } = await client.query<{ pid: number }>(`select pid from pg_stat_activity where datname = current_database() and application_name like 'idem %'`);
            const pid = rows[Math.floor(rnd() * rows.length)]?.pid;
            if (pid !== undefined) {
              await client.query('select pg_terminate_backend($1)', [pid]);
              stats.terminations++;
            }
          }
          if (rnd() < 0.5) {
            const joiners = 1 + Math.floor(rnd() * maxLateJoiners);
            for (let j = 0; j < joiners; j++) launch('late joiner', [0, 75]);
            stats.lateJoins += joiners;
          }
          await sleep(Math.floor(rnd() * 0.3 * stats.workMs));
        }
      }
      const reported = stats.unexpectedExits.length + stats.hangs.length;
      await settle(client, children, stats, `round ${round} (${driver.runKey})`);
      for (const c of children) {
        const { code, signal, stderr } = await c.done;
        if (terminated.has(c)) {
          const k = String(code ?? signal);
          stats.terminatedExits[k] = (stats.terminatedExits[k] ?? 0) + 1;
        }
        if (code === 75) {
          if (/ending in the processes that share it/.test(stderr)) stats.busyWhileEnding++;
          else stats.unexpectedExits.push(`round ${round} (${driver.runKey}): ${c.role} exited 75 though it asked to join${stderrTail(stderr)}`);
        }
      }
      await driver.endEpisodeIfDone();
      for (const e of [...stats.unexpectedExits, ...stats.hangs].slice(reported)) opts.onLine?.(`  ${e}`);
      opts.onLine?.(`round ${round}: episode ${driver.episode}, ${JSON.stringify({ workers: stats.workers, lateJoins: stats.lateJoins, kills: stats.kills, terminations: stats.terminations, terminatedExits: stats.terminatedExits, multiAttemptEpisodes: stats.multiAttemptEpisodes, divergent: stats.divergent, duplicateCommits: stats.duplicateCommits, missingCommits: stats.missingCommits, unexpectedExits: stats.unexpectedExits.length, hangs: stats.hangs.length })}`);
    }
    // Finish the episode in flight with two undisturbed workers, then verify it too.
    await driver.finish((runKey) => [0, 1].map((i) => startRunner(opts.databaseUrl, runKey, concurrency, false, `final worker ${i + 1}`, [0, 75], true)));
  });
  return stats;
}

export function workersSummaryLine(s: WorkersChaosStats): string {
  const exits = Object.entries(s.terminatedExits).map(([k, v]) => `${k}:${v}`).join(',') || 'none';
  return `chaos --workers: seed=${s.seed} rounds=${s.rounds} episodes=${s.episodes} multi-attempt-episodes=${s.multiAttemptEpisodes} spawned=${s.spawned} workers=${s.workers} late-joins=${s.lateJoins} kills=${s.kills} mid-run-kills=${s.midRunKills} kill-all-rounds=${s.killAllRounds} backend-terminations=${s.terminations} terminated-workers=${s.terminatedWorkers} terminated-worker-exits=${exits} busy-while-ending=${s.busyWhileEnding} clean-run-ms=${s.workMs} divergent-states=${s.divergent} oracle-mismatches=${s.oracleMismatches} duplicate-chunk-commits=${s.duplicateCommits} missing-chunk-commits=${s.missingCommits} marker-mismatches=${s.markerMismatches} summary-mismatches=${s.summaryMismatches} unexpected-exits=${s.unexpectedExits.length} hangs=${s.hangs.length}`;
}

/** Every check of the single-process mode, plus one summary per run. */
export function workersChaosFailures(s: WorkersChaosStats, minMultiAttemptEpisodes: number): string[] {
  return [...chaosFailures(s, minMultiAttemptEpisodes), ...(s.summaryMismatches > 0 ? [`summaryMismatches=${s.summaryMismatches}`] : [])];
}
