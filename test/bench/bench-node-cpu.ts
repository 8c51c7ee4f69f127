/**
 * Node CPU per chunk: idem (Runner.run, concurrency 1) against a Kysely loop (one
 * `db.transaction().execute()` per chunk) and a raw `pg` loop (BEGIN; statement; COMMIT), each doing
 * the same trivial upsert per chunk, so the figure is the machinery's and not the work's. A fourth,
 * `idem's SQL`, is the raw `pg` loop sending what a chunk of idem sends (BEGIN with the claim in one
 * message, the upsert, COMMIT through the fence trigger): on a shared machine a process's CPU per
 * round trip grows with how long the server takes to answer (a statement that only waits longer
 * costs the client CPU too), so this is the floor idem's own statements set, apart from its Node
 * code. Marginal:
 * the same contender over 200 and over 4 200 chunks, the difference ÷ 4 000, so start-up and
 * planning's fixed costs drop out. Three rounds, alternating; medians.
 * `node --import tsx test/bench/bench-node-cpu.ts` (DATABASE_URL, or an embedded server in a temp dir).
 */
import { Kysely, PostgresDialect } from 'kysely';
import pg from 'pg';
import { defineJob, Runner, sql, type StepContext } from '../../src/index.ts';
import { Store } from '../../src/store.ts';
import { openBenchServer } from './server.ts';

const SMALL = 200;
const LARGE = 4_200;
const WORK = 'insert into bench_node_cpu values (1, 1) on conflict (id) do update set n = excluded.n + bench_node_cpu.n';

const cpuMs = async (fn: () => Promise<void>): Promise<number> => {
  const t = process.cpuUsage();
  await fn();
  const c = process.cpuUsage(t);
  return (c.user + c.system) / 1000;
};
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;

const server = await openBenchServer(() => {});
try {
  const url = server.url;
  const setup = new pg.Client({ connectionString: url });
  await setup.connect();
  await setup.query('create table if not exists bench_node_cpu (id int primary key, n int not null)');
  await setup.end();
  const job = (n: number) =>
    defineJob({
      name: `node-cpu-${n}`,
      steps: [
        {
          name: 's',
          chunks: (cursor, { windowSize }) => {
            const from = typeof cursor === 'number' ? cursor : 0;
            const to = Math.min(from + windowSize, n);
            return { chunks: Array.from({ length: to - from }, (_, i) => ({ key: `k${from + i}` })), next: to < n ? to : null };
          },
          run: ({ db }: StepContext) => sql.raw(WORK).execute(db),
        },
      ],
    });
  // A finished run of LARGE chunks, for idem's SQL: its chunks are made pending again before each use.
  const floorJob = job(LARGE);
  const floorRunner = await Runner.connect({ connectionString: url });
  await floorRunner.run(floorJob, { key: 'sql-floor', health: false });
  await floorRunner.close();
  const floor = new pg.Client({ connectionString: url });
  await floor.connect();
  const { rows: [floorRun] } = await floor.query<{ id: string; attempt: number }>(`select id, attempt from idem.runs where job = $1 and run_key = 'sql-floor'`, [floorJob.name]);
  const floorDb = new Kysely<any>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: url, max: 1 }) }) });
  const store = new Store(floorDb, 'idem');
  for (const text of store.claimPrepares) await floor.query(text);
  const claim = store.claimSql('next', floorRun!.id, floorRun!.attempt, 's', []);
  const contenders: Record<string, (n: number) => Promise<number>> = {
    idem: async (n) => {
      const runner = await Runner.connect({ connectionString: url });
      try {
        const j = job(n);
        return await cpuMs(async () => void (await runner.run(j, { key: `r${Date.now()}-${n}`, health: false })));
      } finally {
        await runner.close();
      }
    },
    'kysely loop': async (n) => {
      const db = new Kysely<any>({ dialect: new PostgresDialect({ pool: new pg.Pool({ connectionString: url, max: 2 }) }) });
      try {
        return await cpuMs(async () => {
          for (let i = 0; i < n; i++) await db.transaction().execute((trx) => sql.raw(WORK).execute(trx));
        });
      } finally {
        await db.destroy();
      }
    },
    "idem's SQL": async (n) => {
      await floor.query('update idem.chunks set done_at = null, done_attempt = null, done_by = null where run_id = $1', [floorRun!.id]);
      return cpuMs(async () => {
        for (let i = 0; i < n; i++) {
          await floor.query(`begin;\n${claim}`);
          await floor.query(WORK, []);
          await floor.query('commit');
        }
      });
    },
    'pg loop': async (n) => {
      const c = new pg.Client({ connectionString: url });
      await c.connect();
      try {
        return await cpuMs(async () => {
          for (let i = 0; i < n; i++) {
            await c.query('begin');
            await c.query(WORK, []);
            await c.query('commit');
          }
        });
      } finally {
        await c.end();
      }
    },
  };
  const per: Record<string, number[]> = Object.fromEntries(Object.keys(contenders).map((k) => [k, []]));
  for (let round = 0; round < 3; round++) {
    for (const [name, run] of Object.entries(contenders)) {
      const small = await run(SMALL);
      const large = await run(LARGE);
      per[name]!.push((large - small) / (LARGE - SMALL));
    }
  }
  const loop = median(per['pg loop']!);
  const kysely = median(per['kysely loop']!);
  for (const [name, xs] of Object.entries(per)) {
    const m = median(xs);
    console.log(`${name.padEnd(12)} ${m.toFixed(3)} ms Node CPU per chunk (${(m / loop).toFixed(2)}× the pg loop, ${(m / kysely).toFixed(2)}× the Kysely loop; rounds ${xs.map((x) => x.toFixed(3)).join(' / ')})`);
  }
  await floor.end();
  await floorDb.destroy();
} finally {
  await server.close();
}
