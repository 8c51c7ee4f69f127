import { idemSessions, newChaosStats, prng, settle, sleep, startRunner, withChaosDriver, type ChaosStats, type Child } from './chaos-driver.ts';

export interface ChaosOptions {
  readonly databaseUrl: string;
  readonly rounds: number;
  readonly seed: number;
  /** Chunks run at once inside each runner process. */
  readonly concurrency?: number;
  readonly onLine?: (line: string) => void;
}

/**
 * Starts the CLI over and over and abuses it (SIGKILL, terminated backends, overlapping
 * invocations), timing each blow from the measured length of a clean run so most land mid-run;
 * then checks each completed run against the oracle and a clean run, with every chunk's work
 * committed exactly once.
 */
export async function runChaos(opts: ChaosOptions): Promise<ChaosStats> {
  const rnd = prng(opts.seed);
  const concurrency = opts.concurrency ?? 4;
  const stats = newChaosStats(opts.seed);
  await withChaosDriver({ databaseUrl: opts.databaseUrl, runKeyPrefix: `chaos-${opts.seed}`, concurrency, join: false, rnd, stats }, async (driver) => {
    for (let round = 1; round <= opts.rounds; round++) {
      stats.rounds = round;
      const roll = rnd();
      const children: Child[] = [];
      const launch = (wait: boolean, role: string, allowed: number[]) => {
        const c = startRunner(opts.databaseUrl, driver.runKey, concurrency, wait, `round ${round} ${role}`, allowed);
        children.push(c);
        stats.spawned++;
        return c;
      };
      if (roll < 0.5) {
        // One process, killed mid-run (or, one time in five, while it starts up and plans).
        const c = launch(rnd() < 0.3, 'killed', [0]);
        if (rnd() < 0.2) await sleep(Math.floor(rnd() * 1500));
        else await driver.midRun(children, 0.9);
        await driver.kill(c);
      } else if (roll < 0.7) {
        // Overlapping invocations: one works, the others exit 75 or (with --wait) wait and find it
        // done or take it over; sometimes one of them is killed mid-run.
        stats.overlaps++;
        const n = 2 + Math.floor(rnd() * 2);
        for (let i = 0; i < n; i++) {
          const wait = rnd() < 0.5;
          launch(wait, `overlap ${i + 1}/${n}`, wait ? [0] : [0, 75]);
        }
        await driver.midRun(children, 0.9);
        const victim = children[Math.floor(rnd() * n)]!;
        if (rnd() < 0.7) await driver.kill(victim);
      } else if (roll < 0.9) {
        // Killed backends: a work session's chunk retries on a new connection; a lost lock
        // session ends the attempt (69).
        launch(false, 'backends terminated', [0, 69]);
        await driver.midRun(children, 0.9);
        for (const pid of await idemSessions(driver.client)) {
          if (rnd() < 0.5) {
            await driver.client.query('select pg_terminate_backend($1)', [pid]);
            stats.terminations++;
          }
        }
      } else {
        launch(false, 'undisturbed', [0]);
      }
      await settle(driver.client, children, stats, `round ${round} (${driver.runKey})`);
      await driver.endEpisodeIfDone();
      opts.onLine?.(`round ${round}: episode ${driver.episode}, ${JSON.stringify({ kills: stats.kills, midRunKills: stats.midRunKills, terminations: stats.terminations, overlaps: stats.overlaps, multiAttemptEpisodes: stats.multiAttemptEpisodes })}`);
    }
    // Finish the episode in flight with an undisturbed run, then verify it too.
    await driver.finish((runKey) => [startRunner(opts.databaseUrl, runKey, concurrency, true, 'final run', [0])]);
  });
  return stats;
}

/** What a chaos run must show to count: every check clean, and enough runs really interrupted. */
export function chaosFailures(s: ChaosStats, minMultiAttemptEpisodes: number): string[] {
  const problems: string[] = [];
  for (const [name, n] of Object.entries({ divergent: s.divergent, oracleMismatches: s.oracleMismatches, duplicateCommits: s.duplicateCommits, missingCommits: s.missingCommits, markerMismatches: s.markerMismatches })) {
    if (n > 0) problems.push(`${name}=${n}`);
  }
  problems.push(...s.unexpectedExits.map((e) => `unexpected exit: ${e}`), ...s.hangs.map((h) => `hang: ${h}`));
  if (s.multiAttemptEpisodes < minMultiAttemptEpisodes) {
    problems.push(`only ${s.multiAttemptEpisodes} episode(s) had chunks committed by two or more attempts; at least ${minMultiAttemptEpisodes} required (the blows missed the runs)`);
  }
  return problems;
}

/** One episode per eight rounds must have been interrupted mid-run and resumed (15 rounds: 2; measured 3-6). */
export const minMultiAttemptEpisodes = (rounds: number) => Math.max(1, Math.ceil(rounds / 8));

export function summaryLine(s: ChaosStats): string {
  return `chaos: seed=${s.seed} rounds=${s.rounds} episodes=${s.episodes} multi-attempt-episodes=${s.multiAttemptEpisodes} spawned=${s.spawned} kills=${s.kills} mid-run-kills=${s.midRunKills} backend-terminations=${s.terminations} overlaps=${s.overlaps} clean-run-ms=${s.workMs} divergent-states=${s.divergent} oracle-mismatches=${s.oracleMismatches} duplicate-chunk-commits=${s.duplicateCommits} missing-chunk-commits=${s.missingCommits} marker-mismatches=${s.markerMismatches} unexpected-exits=${s.unexpectedExits.length} hangs=${s.hangs.length}`;
}
