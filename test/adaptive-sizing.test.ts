import { describe, expect, it } from 'vitest';
import { defineJob, keyRange, Runner, sql, type KeyRangeChunk } from '../src/index.ts';
import { ADAPTIVE_SIZING, Throttle } from '../src/throttle.ts';
import { query } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/** A deterministic ±5 % jitter (no Math.random: a failure must replay). */
function jitter(seed: number): () => number {
  let x = seed;
  return () => {
    x = (x * 1103515245 + 12345) % 2 ** 31;
    return 0.95 + (x / 2 ** 31) * 0.1;
  };
}

/**
 * Runs windows of 4 chunks whose duration is proportional to the chunk size (cost of a nominal
 * chunk × factor, jittered), feeding each window into adapt(); returns the factor each window ran
 * with and its median duration.
 */
function simulate(t: Throttle, costOf: (window: number) => number, windows: number, noise = jitter(7)) {
  const factors: number[] = [];
  const durations: number[] = [];
  for (let w = 0; w < windows; w++) {
    const f = t.sizeFactor;
    const ds = [0, 1, 2, 3].map(() => costOf(w) * f * noise());
    factors.push(f);
    durations.push([...ds].sort((a, b) => a - b)[2]!);
    t.adapt(ds);
  }
  return { factors, durations };
}

describe('adaptive chunk sizing (--target-chunk-ms)', () => {
  it('on target with ±5 % noise, the size never moves (dead band and moving average)', () => {
    const t = new Throttle({ targetChunkMs: 100 });
    const { factors } = simulate(t, () => 100, 60);
    expect(new Set(factors)).toEqual(new Set([1]));
  });

  it('a chunk duration that suddenly triples shrinks the size within a few windows, without oscillating', () => {
    const t = new Throttle({ targetChunkMs: 100 });
    const { factors, durations } = simulate(t, (w) => (w < 10 ? 100 : 300), 40);
    expect(factors.slice(0, 11)).toEqual(Array(11).fill(1));
    const after = factors.slice(10);
    // Shrinks at once, at most halving a window…
    expect(after[1]).toBeLessThan(1);
    expect(after[1]).toBeGreaterThanOrEqual(ADAPTIVE_SIZING.maxShrink);
    // …never grows back while the cost stays (no oscillation), and never undershoots the right
    // size (1/3) by more than the dead band.
    for (let i = 1; i < after.length; i++) expect(after[i]).toBeLessThanOrEqual(after[i - 1]!);
    expect(Math.min(...after)).toBeGreaterThan((1 / 3) * (1 - ADAPTIVE_SIZING.deadBand - 0.05));
    // Within 3 windows a chunk is back within 25 % of the target, within 6 within the band (+ noise).
    expect(durations[13]!).toBeLessThanOrEqual(125);
    for (const d of durations.slice(16)) expect(Math.abs(d - 100)).toBeLessThanOrEqual(100 * (ADAPTIVE_SIZING.deadBand + 0.06));
    // And it settles: the last 20 windows run with at most two distinct sizes.
    expect(new Set(factors.slice(20)).size).toBeLessThanOrEqual(2);
  });

  it('grows at most 20 % a window when chunks get cheap, and settles without overshooting', () => {
    const t = new Throttle({ targetChunkMs: 90 });
    const { factors } = simulate(t, () => 30, 30);
    for (let i = 1; i < factors.length; i++) expect(factors[i]! / factors[i - 1]!).toBeLessThanOrEqual(ADAPTIVE_SIZING.maxGrowth + 1e-9);
    expect(factors.at(-1)!).toBeGreaterThan(3 * (1 - ADAPTIVE_SIZING.deadBand - 0.05));
    expect(Math.max(...factors)).toBeLessThan(3 * (1 + ADAPTIVE_SIZING.deadBand + 0.05));
  });

  it('stays within [1/16, 16] of the nominal size; no target or no durations change nothing', () => {
    const grow = new Throttle({ targetChunkMs: 1_000_000 });
    simulate(grow, () => 1, 100);
    expect(grow.sizeFactor).toBe(ADAPTIVE_SIZING.maxFactor);
    const shrink = new Throttle({ targetChunkMs: 1 });
    simulate(shrink, () => 100_000, 20);
    expect(shrink.sizeFactor).toBe(ADAPTIVE_SIZING.minFactor);
    expect(new Throttle({}).adapt([1, 2, 3])).toBe(1);
    expect(new Throttle({ targetChunkMs: 100 }).adapt([])).toBe(1);
    // A 0 ms chunk counts as 1 ms: growth is still capped.
    expect(new Throttle({ targetChunkMs: 50 }).adapt([0])).toBe(ADAPTIVE_SIZING.maxGrowth);
  });
});

describe('adaptive chunk sizing in a real run', () => {
  const database = useTestDatabase({
    prepare: async (url) => {
      await query(url, `create table adapt_items (id bigint primary key); insert into adapt_items select generate_series(1, 480)`);
      await query(url, `create table knob (ms_per_row float8 not null); insert into knob values (10)`);
    },
  });

  it('when chunks suddenly take three times as long, keyRange chunks shrink within a few windows and stay there', async () => {
    // Each chunk's size and duration as the job saw it (one worker: in seq order).
    const seen: { size: number; duration_ms: number }[] = [];
    const job = defineJob({
      name: 'adaptive',
      steps: [
        {
          name: 'work',
          chunks: keyRange({ table: 'adapt_items', column: 'id', size: 20 }),
          // A chunk takes (rows × knob) ms: its duration is proportional to its size.
          run: async ({ db }, c: KeyRangeChunk) => {
            const started = performance.now();
            await sql`select pg_sleep(count(*) * (select ms_per_row from knob) / 1000) from adapt_items where id >= ${c.lo} and id < ${c.hi}`.execute(db);
            seen.push({ size: Number(c.hi) - Number(c.lo), duration_ms: performance.now() - started });
          },
        },
      ],
    });
    const runner = await Runner.connect({ connectionString: database.url });
    try {
      let flipped = false;
      const out = await runner.run(job, {
        key: 'a',
        throttle: { targetChunkMs: 200 },
        health: false,
        onProgress: (p) => {
          // After 12 chunks the rows get three times as expensive.
          if (p.done === 12 && !flipped) {
            flipped = true;
            void query(database.url, 'update knob set ms_per_row = 30');
          }
        },
      });
      expect(out.status).toBe('succeeded');
    } finally {
      await runner.close();
    }
    const chunks = seen.slice(0, -1);
    expect(chunks.length + 1).toBe((await query(database.url, `select count(*)::int as n from idem.chunks where done_at is not null`))[0].n);
    // The first chunk that ran at the new cost, and the size the run had reached before it.
    const jump = chunks.findIndex((c, i) => i >= 12 && c.duration_ms > 1.8 * 200);
    expect(jump).toBeGreaterThanOrEqual(12);
    const before = chunks[jump]!.size;
    // Within 4 windows (4 chunks each) every chunk is at most half the size it had…
    const settled = chunks.slice(jump + 16);
    expect(settled.length).toBeGreaterThan(4);
    for (const c of settled) expect(c.size).toBeLessThanOrEqual(Math.ceil(before / 2));
    // …and it does not oscillate: once down, it stays within one capped growth step (×1.2) of its
    // smallest size. (No bound on durations: on a loaded machine one chunk may take long.)
    const least = Math.min(...settled.map((c) => c.size));
    for (const c of settled) expect(c.size).toBeLessThanOrEqual(Math.ceil(least * ADAPTIVE_SIZING.maxGrowth) + 1);
  });
});
