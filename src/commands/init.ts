import { existsSync } from 'node:fs';
import { appendFile, mkdir, readFile, writeFile } from 'node:fs/promises';
import path from 'node:path';
import type { Command } from 'commander';
import { ExitCode, UsageError } from '../errors.ts';

const MIGRATION = `import { defineJob, sql } from 'idem';

/** Creates the example's tables and a few orders. Safe to run again: every statement checks first. */
export default defineJob({
  name: 'create-example-tables',
  description: 'example orders and the per-customer totals table',
  steps: [
    {
      name: 'create',
      async run({ db }) {
        await sql\`create table if not exists example_orders (
          id bigint primary key,
          customer text not null,
          amount_cents bigint not null
        )\`.execute(db);
        await sql\`insert into example_orders (id, customer, amount_cents)
          select i, 'customer-' || (i % 5), i * 100 from generate_series(1, 200) i
          on conflict (id) do nothing\`.execute(db);
        await sql\`create table if not exists example_customer_totals (
          customer text primary key,
          orders integer not null,
          amount_cents bigint not null
        )\`.execute(db);
      },
    },
  ],
});
`;

const JOB = `import { defineJob, sql, type ChunkSource } from 'idem';

/** One chunk per customer: the key is the customer, stable whatever else changes. */
const customers: ChunkSource = async (_cursor, { db }) => {
  const { rows } = await sql<{ customer: string }>\`select distinct customer from example_orders order by customer\`.execute(db);
  return { chunks: rows.map((r) => ({ key: r.customer, customer: r.customer })), next: null };
};

/**
 * Sets each customer's totals from their orders. State-setting ("make it so"), never "add one
 * more": a chunk run twice, after a crash or by a second process, leaves the same row.
 */
export default defineJob({
  name: 'example-customer-totals',
  description: 'per-customer order totals (an example state-setting job)',
  steps: [
    {
      name: 'totals',
      chunks: customers,
      async run({ db }, { customer }: { customer: string }) {
        await sql\`insert into example_customer_totals (customer, orders, amount_cents)
          select customer, count(*), sum(amount_cents) from example_orders where customer = \${customer} group by customer
          on conflict (customer) do update set orders = excluded.orders, amount_cents = excluded.amount_cents\`.execute(db);
      },
    },
  ],
});
`;

const TEST = `import { test } from 'vitest';
import { sql } from 'idem';
import { expectConvergent } from 'idem/testing';
import createTables from '../migrations/0001_create_example_tables.ts';
import customerTotals from '../jobs/example-customer-totals.ts';

// Runs the job clean, twice, concurrently, crashed at each chunk then rerun, and under a new run
// key, each in a fresh database (DATABASE_URL, else an embedded PostgreSQL under .idem/), and
// checks every way ends in the same rows.
test('example-customer-totals converges however it is run', async () => {
  await expectConvergent(customerTotals, {
    setup: [createTables],
    snapshot: async (db) => (await sql\`select * from example_customer_totals order by customer\`.execute(db)).rows,
  });
}, 120_000);

test('create-example-tables converges however it is run', async () => {
  await expectConvergent(createTables, {
    snapshot: async (db) => (await sql\`select * from example_orders order by id\`.execute(db)).rows,
  });
}, 120_000);
`;

/** The files `idem init` writes, relative to the project. */
export const INIT_FILES: Readonly<Record<string, string>> = {
  'migrations/0001_create_example_tables.ts': MIGRATION,
  'jobs/example-customer-totals.ts': JOB,
  'test/idem-examples.test.ts': TEST,
};

/** `idem init`: an example job, migration and convergence test in the current project. */
export function registerInitCommand(program: Command): void {
  program
    .command('init')
    .description('scaffold jobs/ and migrations/ with an example, a convergence test, and .idem/ in .gitignore; never overwrites a file')
    .action(async () => {
      const root = process.cwd();
      const existing = Object.keys(INIT_FILES).filter((f) => existsSync(path.join(root, f)));
      if (existing.length > 0) {
        throw new UsageError('initWouldOverwrite', `idem init would overwrite ${existing.join(', ')}; move or delete ${existing.length === 1 ? 'it' : 'them'} and run idem init again (nothing was written)`);
      }
      for (const [file, content] of Object.entries(INIT_FILES)) {
        await mkdir(path.dirname(path.join(root, file)), { recursive: true });
        await writeFile(path.join(root, file), content, { flag: 'wx' });
        process.stdout.write(`created ${file}\n`);
      }
      const gitignore = path.join(root, '.gitignore');
      const current = existsSync(gitignore) ? await readFile(gitignore, 'utf8') : '';
      if (!/^\/?\.idem\/?$/m.test(current)) {
        await appendFile(gitignore, `${current === '' || current.endsWith('\n') ? '' : '\n'}# idem: the embedded PostgreSQL and compiled jobs\n.idem/\n`);
        process.stdout.write(`${current === '' ? 'created' : 'updated'} .gitignore (.idem/)\n`);
      }
      process.stdout.write(
        [
          '',
          'Next:',
          '  npx idem migrate                       # create the example tables (an embedded PostgreSQL starts under .idem/ unless DATABASE_URL is set)',
          '  npx idem run example-customer-totals   # run the example job; run it again: nothing to do',
          '  npx idem status                        # see the runs',
          'and the convergence test: npm install -D vitest && npx vitest run test/idem-examples.test.ts',
          '',
        ].join('\n'),
      );
      process.exitCode = ExitCode.Ok;
    });
}
