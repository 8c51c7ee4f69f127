import { expect, it } from 'vitest';
import { minMultiAttemptEpisodes } from './chaos/chaos.ts';
import { runWorkersChaos, workersChaosFailures, workersSummaryLine } from './chaos/workers-chaos.ts';
import { useTestDatabase } from './support/database.ts';

// The small workers chaos inside `npm test` (2–4 workers per run, one late joiner per blow, to stay
// short on a busy machine: every worker is a Node process to start); `npm run chaos -- --workers`
// runs 200 rounds of 2–6 workers.
// CHAOS_WORKERS_ROUNDS and CHAOS_WORKERS_SEED change or replay it.
const rounds = Number(process.env.CHAOS_WORKERS_ROUNDS ?? 15);
const seed = Number(process.env.CHAOS_WORKERS_SEED ?? Math.floor(Math.random() * 2 ** 31));

const db = useTestDatabase();

it(`2–4 workers per run, SIGKILLed, cut off and joined mid-run, converge on the oracle's state with every chunk committed once (seed ${seed})`, async () => {
  const stats = await runWorkersChaos({ databaseUrl: db.url, rounds, seed, maxWorkers: 4, maxLateJoiners: 1 });
  console.log(workersSummaryLine(stats));
  // In workers mode most blows take one worker and the run goes on under the same attempt; only
  // the kill-all rounds (every 4th) make a run resume under a new attempt, so fewer episodes are
  // multi-attempt than in the single-process chaos: a quarter of its minimum, and at least one.
  expect(workersChaosFailures(stats, Math.max(1, Math.floor(minMultiAttemptEpisodes(rounds) / 4)))).toEqual([]);
  // The blows really landed: workers were killed mid-run, cut off, and joined late.
  expect(stats.episodes).toBeGreaterThanOrEqual(2);
  expect(stats.midRunKills).toBeGreaterThan(0);
  expect(stats.terminatedWorkers).toBeGreaterThan(0);
  expect(stats.lateJoins).toBeGreaterThan(0);
}, 600_000);
