import pg from 'pg';
import { beforeAll, expect, it } from 'vitest';
import { fingerprint, Runner } from '../src/index.ts';
import { useTestDatabase } from './support/database.ts';

// Found by the workers chaos and the workers bench: on a brand-new run, a joining worker's
// loadSteps raced the first worker's and came back without the step rows ("step row for "backfill"
// missing"), which failed the whole run. INSERT … ON CONFLICT DO NOTHING waits for the other
// worker's insert, then does nothing, and the same statement's SELECT cannot see rows committed
// after its snapshot was taken.

const database = useTestDatabase({ runner: true });
let runner: Runner;
beforeAll(() => {
  runner = database.runner;
});

it('loadSteps returns every step even when another worker inserts them concurrently', async () => {
  const { run } = await runner.store.claimRun('race-job', 'k1', {}, fingerprint({}));
  // The other worker: its insert of the step rows is in flight (not committed yet).
  const other = new pg.Client({ connectionString: database.url });
  await other.connect();
  try {
    await other.query('begin');
    await other.query(`insert into idem.steps (run_id, name, position) values ($1, 'backfill', 1), ($1, 'summarise', 2)`, [run.id]);
    const loading = runner.store.loadSteps(run.id, ['backfill', 'summarise']);
    // Once loadSteps has taken its snapshot and waits on the conflicting insert, commit that.
    for (let i = 0; ; i++) {
      const { rows } = await other.query<{ n: number }>(`select count(*)::int as n from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock'`);
      if (rows[0]!.n > 0) break;
      if (i > 6000) throw new Error('loadSteps never waited on the other insert');
      await new Promise((r) => setTimeout(r, 10));
    }
    await other.query('commit');
    const steps = await loading;
    expect([...steps.keys()]).toEqual(['backfill', 'summarise']);
  } finally {
    await other.end();
  }
});
