import { existsSync } from 'node:fs';
import { appendFile, mkdir, readFile, writeFile } from 'node:fs/promises';
import path from 'node:path';
import type { Command } from 'commander';
import { ExitCode, UsageError } from '../errors.ts';
import { shellQuote } from '../shell-quote.ts';

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

const test = (migrationImport: string, jobImport: string) => `import { test } from 'vitest';
import { sql } from 'idem';
import { expectConvergent } from 'idem/testing';
import createTables from '${migrationImport}';
import customerTotals from '${jobImport}';

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

/** Where `idem init` writes, relative to the project. */
interface InitFolders {
  readonly jobsDir: string;
  readonly migrationsDir: string;
}

/** A path as a file name in a message or an import: relative to `from`, with forward slashes. */
const relativeTo = (from: string, to: string) => path.relative(from, to).split(path.sep).join('/');

/**
 * The files `idem init` writes, relative to `root`, in the folders `--jobs-dir` and
 * `--migrations-dir` name (jobs/ and migrations/ by default); the test imports them from there.
 */
export function initFiles(root: string, dirs: InitFolders): Record<string, string> {
  const migration = path.resolve(root, dirs.migrationsDir, '0001_create_example_tables.ts');
  const job = path.resolve(root, dirs.jobsDir, 'example-customer-totals.ts');
  const testDir = path.join(root, 'test');
  const importPath = (file: string) => {
    const rel = relativeTo(testDir, file);
    return rel.startsWith('.') ? rel : `./${rel}`;
  };
  return {
    [relativeTo(root, migration)]: MIGRATION,
    [relativeTo(root, job)]: JOB,
    'test/idem-examples.test.ts': test(importPath(migration), importPath(job)),
  };
}

/** The files `idem init` writes with the default folders, relative to the project. */
export const INIT_FILES: Readonly<Record<string, string>> = initFiles('.', { jobsDir: 'jobs', migrationsDir: 'migrations' });

/** `idem init`: an example job, migration and convergence test in the current project. */
export function registerInitCommand(program: Command): void {
  program
    .command('init')
    .description('scaffold jobs/ and migrations/ (or --jobs-dir and --migrations-dir) with an example, a convergence test, and .idem/ in .gitignore; never overwrites a file')
    .action(async () => {
      const root = process.cwd();
      const { jobsDir, migrationsDir } = program.opts<InitFolders>();
      const files = initFiles(root, { jobsDir, migrationsDir });
      const existing = Object.keys(files).filter((f) => existsSync(path.join(root, f)));
      if (existing.length > 0) {
        throw new UsageError('initWouldOverwrite', `idem init would overwrite ${existing.join(', ')}; move or delete ${existing.length === 1 ? 'it' : 'them'} and run idem init again (nothing was written)`);
      }
      for (const [file, content] of Object.entries(files)) {
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
          ...nextCommands({ jobsDir, migrationsDir }),
          'and the convergence test: npm install -D vitest && npx vitest run test/idem-examples.test.ts',
          '',
        ].join('\n'),
      );
      process.exitCode = ExitCode.Ok;
    });
}

/**
 * The commands `idem init` prints, with the folders it was given (a folder other than the default
 * must be named to every command that reads it), aligned on their comments.
 */
function nextCommands(dirs: InitFolders): string[] {
  const jobs = dirs.jobsDir === 'jobs' ? '' : ` --jobs-dir ${shellQuote(dirs.jobsDir)}`;
  const migrations = dirs.migrationsDir === 'migrations' ? '' : ` --migrations-dir ${shellQuote(dirs.migrationsDir)}`;
  const lines: Array<[string, string]> = [
    [`npx idem${migrations} migrate`, 'create the example tables (an embedded PostgreSQL starts under .idem/ unless DATABASE_URL is set)'],
    [`npx idem${jobs} run example-customer-totals`, 'run the example job; run it again: nothing to do'],
    ['npx idem status', 'see the runs'],
  ];
  const width = Math.max(...lines.map(([command]) => command.length));
  return lines.map(([command, comment]) => `  ${command.padEnd(width)}   # ${comment}`);
}
