import { expect, it } from 'vitest';
import { chaosFailures, minMultiAttemptEpisodes, runChaos, summaryLine } from './chaos/chaos.ts';
import { useTestDatabase } from './support/database.ts';

// The small chaos round inside `npm test`; `npm run chaos` runs 200 rounds. CHAOS_SEED replays one.
const rounds = Number(process.env.CHAOS_ROUNDS ?? 15);
const seed = Number(process.env.CHAOS_SEED ?? Math.floor(Math.random() * 2 ** 31));

const db = useTestDatabase();

it(`random kills, killed backends and overlapping runs converge on the oracle's state (seed ${seed})`, async () => {
  const stats = await runChaos({ databaseUrl: db.url, rounds, seed });
  console.log(summaryLine(stats));
  // Every check at once, so a failure names all of them (and the seed, in the test's name).
  expect(chaosFailures(stats, minMultiAttemptEpisodes(rounds))).toEqual([]);
  expect(stats.episodes).toBeGreaterThanOrEqual(1);
}, 600_000);
