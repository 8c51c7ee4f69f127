/**
 * What the health checks cost: the probe statement's latency, and a run of many tiny chunks with
 * the checks on (default 5 s interval) and off. `node --import tsx test/bench/bench-health.ts`
 * (DATABASE_URL, or an embedded server in a temp dir).
 */
import { defineJob, Runner, sql } from 'idem';
import { openBenchServer } from './server.ts';

const server = await openBenchServer(() => {});
try {
  const runner = await Runner.connect({ connectionString: server.url, poolSize: 4 });
  try {
    await sql`create table bench_health (id int primary key, n int not null default 0)`.execute(runner.db);
    await sql`insert into bench_health select generate_series(1, 2000)`.execute(runner.db);
    // The probe alone: probeIntervalMs 0 makes every chunk start probe.
    const probeJob = defineJob({ name: 'probe-only', steps: [{ name: 's', chunks: (c) => ({ chunks: Array.from({ length: 200 }, (_, i) => ({ key: String(i) })), next: null }), run: () => {} }] });
    const t0 = performance.now();
    await runner.run(probeJob, { key: 'probe-each', health: { probeIntervalMs: 0 } });
    const withEach = performance.now() - t0;
    const t1 = performance.now();
    await runner.run(probeJob, { key: 'probe-none', health: false });
    const without = performance.now() - t1;
    console.log(`probe statement: ${((withEach - without) / 200).toFixed(2)} ms each (200 chunks: ${withEach.toFixed(0)} ms probing before every chunk vs ${without.toFixed(0)} ms with no checks)`);

    const job = defineJob({
      name: 'tiny-chunks',
      steps: [{ name: 's', chunks: (c) => ({ chunks: Array.from({ length: 2000 }, (_, i) => ({ key: String(i + 1), id: i + 1 })), next: null }), run: ({ db }, c: { id: number }) => sql`update bench_health set n = n + 1 where id = ${c.id}`.execute(db) }],
    });
    const rows: string[] = [];
    for (const round of [1, 2, 3]) {
      for (const [label, health] of [['checks on (default)', undefined], ['--no-health-check', false]] as const) {
        const t = performance.now();
        await runner.run(job, { key: `${label}-${round}`, ...(health === undefined ? {} : { health }) });
        rows.push(`${label}: ${(performance.now() - t).toFixed(0)} ms for 2000 chunks`);
      }
    }
    console.log(rows.join('\n'));
  } finally {
    await runner.close();
  }
} finally {
  await server.close();
}
