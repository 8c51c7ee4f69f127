import { fileURLToPath } from 'node:url';
import { defineConfig } from 'vitest/config';
import { LongestFirstSequencer } from './test/support/sequencer.ts';

/**
 * IDEM_TEST_SHUFFLE=1 runs the tests of each file in a random order (files keep theirs), so a test
 * that reads what an earlier test left behind fails; on by default under CI (CI=true, as .ci/run
 * runs), IDEM_TEST_SHUFFLE=0 turns it off. IDEM_TEST_SEED replays an order.
 */
const shuffle = process.env.IDEM_TEST_SHUFFLE === '1' || (process.env.CI === 'true' && process.env.IDEM_TEST_SHUFFLE !== '0');
const seed = Number(process.env.IDEM_TEST_SEED ?? Math.floor(Math.random() * 1_000_000));
if (shuffle) console.log(`tests shuffled within each file with seed ${seed} (replay: IDEM_TEST_SHUFFLE=1 IDEM_TEST_SEED=${seed} npm test)`);

export default defineConfig({
  resolve: {
    // Job fixtures import 'idem' as users do; in the tests that is the source the tests import
    // too (one copy of every class), not the built dist/ the package exports point at.
    alias: [
      { find: /^idem$/, replacement: fileURLToPath(new URL('./src/index.ts', import.meta.url)) },
      { find: /^idem\/testing$/, replacement: fileURLToPath(new URL('./src/testing.ts', import.meta.url)) },
    ],
  },
  test: {
    include: ['test/**/*.test.ts'],
    exclude: ['test/bench/**', '**/node_modules/**'],
    // One real PostgreSQL for the whole run; each test file creates its own database in it.
    globalSetup: ['test/support/global-setup.ts'],
    testTimeout: 60_000,
    // Starting an embedded cluster (initdb included) runs in hooks.
    hookTimeout: 120_000,
    // Forks, not threads: tests spawn child processes and send signals, which threads share badly.
    pool: 'forks',
    // The CI machine has 2 cores, but most of the long files wait (a minute's cron slot, a server
    // held starting up, a pooler's queue, a cut network's timeouts) rather than compute: a third
    // worker overlaps those waits (the suite: 855–886 s on 2 workers, 690 s on 3, 2026-12-04). Later
    // that day the suite had grown and the machine slowed: 832–853 s on 3 (14 min 34 s–14 min 55 s
    // with npm ci), 777 s on 4 (13 min 40 s), all passing; a fourth worker keeps it under 15 minutes.
    maxWorkers: 4,
    // 'stack' (vitest's default, pinned): after-hooks run in reverse order, so a file's own afterAll
    // registered after useTestDatabase() (test/support/database.ts) runs before the database drops.
    // Files start longest first (test/support/sequencer.ts), so that no long file starts last and
    // leaves the other worker idle; the tests within a file are shuffled under CI (above).
    sequence: { sequencer: LongestFirstSequencer, shuffle: shuffle ? { files: false, tests: true } : false, seed, hooks: 'stack' },
  },
});
