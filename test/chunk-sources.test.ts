import { spawn } from 'node:child_process';
import { createWriteStream } from 'node:fs';
import { mkdtemp, rm, stat, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, IdemError, InterruptedError, keyList, keyRange, keysetQuery, Runner, sql, type KeyListChunk, type KeyRangeChunk, type ChunkSource, type KeysetChunk, type PlanContext } from '../src/index.ts';
import { lookupText } from '../src/table-name.ts';
import { query, runCli, runRow } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

const testDb = useTestDatabase({ prepare: (url) => query(url, `create table seen (key text primary key, n integer not null default 1)`), runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});

let dir: string;
beforeAll(async () => {
  dir = await mkdtemp(path.join(os.tmpdir(), 'idem-sources-'));
});
afterAll(() => rm(dir, { recursive: true, force: true }));

/** Records each key of a chunk; a key seen twice counts 2, so "exactly once" is a check on n. */
const recordKeys = async (db: Parameters<Parameters<typeof defineJob>[0]['steps'][0]['run']>[0]['db'], prefix: string, keys: readonly unknown[]) => {
  await sql`insert into seen (key) select ${prefix} || k from unnest(${keys.map(String)}::text[]) k
    on conflict (key) do update set n = seen.n + 1`.execute(db);
};

/** Runs a job, interrupted after `stopAfter` chunks of its step, then resumed to the end. */
async function runInterrupted(job: ReturnType<typeof defineJob<any>>, key: string, stopAfter: number, params?: unknown) {
  const stop = new AbortController();
  const first = await runner
    .run(job, { key, params, signal: stop.signal, onProgress: (p) => p.done >= stopAfter && stop.abort(new InterruptedError('SIGINT')) })
    .catch((e: unknown) => e);
  if (!(first instanceof InterruptedError)) throw first;
  return runner.run(job, { key, params });
}

const planCtx = (windowSize: number, params: unknown = {}): PlanContext => ({ windowSize, sizeFactor: 1, params }) as PlanContext;

describe('keyList', () => {
  it('cuts keys given by the params into chunks with an estimate; every key once', async () => {
    const job = defineJob<{ ids: number[] }>({
      name: 'by-params',
      params: (raw) => raw as { ids: number[] },
      steps: [{ name: 'each', chunks: keyList<{ ids: number[] }>({ keys: (p) => p.ids, size: 3 }), run: ({ db }, c: KeyListChunk) => recordKeys(db, 'p:', c.keys) }],
    });
    const ids = [5, 3, 99, 1, 7, 42, 8, 13, 21, 34];
    const out = await runner.run(job, { key: 'p', params: { ids } });
    expect(out.summary?.steps[0]).toEqual({ name: 'each', chunks: 4 });
    const chunks = await query(url, `select c.key, c.spec->'keys' as keys from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'by-params' order by seq`);
    expect(chunks).toEqual([
      { key: 'keys[0,3)', keys: [5, 3, 99] },
      { key: 'keys[3,6)', keys: [1, 7, 42] },
      { key: 'keys[6,9)', keys: [8, 13, 21] },
      { key: 'keys[9,10)', keys: [34] },
    ]);
    expect(await query(url, `select s.estimated_chunks from idem.steps s join idem.runs r on r.id = s.run_id where r.job = 'by-params'`)).toEqual([{ estimated_chunks: 4 }]);
    expect(await query(url, `select count(*)::int as keys, max(n) as most from seen where key like 'p:%'`)).toEqual([{ keys: 10, most: 1 }]);
  });

  it('streams a newline file from a byte offset: interrupted and resumed, every key exactly once', async () => {
    const file = path.join(dir, 'ids.txt');
    const n = 25_000;
    // Blank lines and CRLF endings, as files from other systems have them.
    await writeFile(file, Array.from({ length: n }, (_, i) => (i % 1000 === 0 ? `id-${i}\r\n\n` : `id-${i}\n`)).join(''));
    const job = defineJob<{ file: string }>({
      name: 'by-file',
      params: (raw) => raw as { file: string },
      steps: [{ name: 'each', chunks: keyList<{ file: string }>({ file: (p) => p.file, size: 500 }), run: ({ db }, c: KeyListChunk) => recordKeys(db, 'f:', c.keys) }],
    });
    const out = await runInterrupted(job, 'f', 7, { file });
    expect(out).toMatchObject({ status: 'succeeded', attempt: 2 });
    expect(out.summary?.steps[0]).toEqual({ name: 'each', chunks: n / 500 });
    expect(await query(url, `select count(*)::int as keys, max(n) as most, min(n) as least from seen where key like 'f:%'`)).toEqual([{ keys: n, most: 1, least: 1 }]);
    expect(await query(url, `select 1 from seen where key in ('f:id-0', 'f:id-24999', 'f:id-1000')`)).toHaveLength(3);
    const [est] = await query(url, `select s.estimated_chunks from idem.steps s join idem.runs r on r.id = s.run_id where r.job = 'by-file'`);
    // From the file size and the first keys' mean length: close, not exact.
    expect(est.estimated_chunks).toBeGreaterThan(40);
    expect(est.estimated_chunks).toBeLessThan(60);
  });

  it('a file changed before its cursor between attempts is refused on resume (not read from mid-line); restored, the run completes, every key once', async () => {
    // Black-box round 18 (B8-9): lines prepended to the file shifted it under the stored byte
    // offset; the resumed run read from the middle of a line, ran a chunk with the key "1058" (cut
    // from "id1058"), and ran id1058 again.
    const file = path.join(dir, 'changing.txt');
    const original = Array.from({ length: 100 }, (_, i) => `id${1000 + i}\n`).join('');
    await writeFile(file, original);
    const job = defineJob<{ file: string }>({
      name: 'by-changing-file',
      params: (raw) => raw as { file: string },
      steps: [{ name: 'each', chunks: keyList<{ file: string }>({ file: (p) => p.file, size: 10 }), run: ({ db }, c: KeyListChunk) => recordKeys(db, 'chg:', c.keys) }],
    });
    const stop = new AbortController();
    const first = await runner
      .run(job, { key: 'chg', params: { file }, planWindow: 2, signal: stop.signal, onProgress: (p) => p.done >= 3 && stop.abort(new InterruptedError('SIGINT')) })
      .catch((e: unknown) => e);
    expect(first).toBeInstanceOf(InterruptedError);
    await writeFile(file, `X1\nX22\nX333\n${original}`);
    const refused = await runner.run(job, { key: 'chg', params: { file } }).catch((e: unknown) => e);
    expect(String(refused)).toMatch(/keyList\(\): .*changing\.txt changed before byte \d+, where the run's plan goes on reading it/);
    expect(String(refused)).toMatch(/must not change while its run is unfinished \(appending is safe\)/);
    // Nothing read from the changed file ran (the chunks planned before it changed did: their keys
    // were read from the file as it was), and none twice.
    expect(await query(url, `select key from seen where key like 'chg:%' and (key !~ '^chg:id1[0-9]{3}$' or n <> 1)`)).toEqual([]);
    expect((await runRow(url, 'by-changing-file', 'chg'))?.status).toBe('failed');
    // Restored (an append is fine): the run goes on from where it was, every key once.
    await writeFile(file, `${original}id9999\n`);
    const out = await runner.run(job, { key: 'chg', params: { file } });
    expect(out.status).toBe('succeeded');
    expect(await query(url, `select count(*)::int as keys, max(n) as most from seen where key like 'chg:id1%'`)).toEqual([{ keys: 100, most: 1 }]);
  });

  it('a lines file starting with a UTF-8 byte order mark: the mark is not part of the first key', async () => {
    const file = path.join(dir, 'bom.txt');
    await writeFile(file, '\uFEFFa1\na2\n');
    const page = await keyList({ file, size: 10 })(null, planCtx(10));
    expect(page.chunks.flatMap((c) => c.keys)).toEqual(['a1', 'a2']);
  });

  it('reads a CSV column by header name, with quoted fields, and refuses a missing column', async () => {
    const file = path.join(dir, 'users.csv');
    await writeFile(file, 'name,email,id\r\n"Doe, Jane","jane@x.org",17\r\nBob,"say ""hi""@x.org",18\r\n\r\nEve,e@x.org,19');
    const src = keyList({ file, column: 'email', size: 2 });
    const first = await src(null, planCtx(1));
    expect(first.chunks).toEqual([{ key: 'keys[0,2)', keys: ['jane@x.org', 'say "hi"@x.org'] }]);
    const second = await src(first.next, planCtx(1));
    expect(second).toEqual({ chunks: [{ key: 'keys[2,3)', keys: ['e@x.org'] }], next: null });
    const byIndex = await keyList({ file, column: 2, size: 10 })(null, planCtx(1));
    expect(byIndex.chunks[0]!.keys).toEqual(['17', '18', '19']);
    await expect(keyList({ file, column: 'phone', size: 2 })(null, planCtx(1))).rejects.toThrow(`keyList(): ${file} has no column "phone" in its header; fix column, or the file`);
    expect(() => keyList({ size: 2 })).toThrow('keyList(): pass exactly one of keys or file');
  });

  it('a file that is a directory: one line naming keyList, the path and the fix, from planning and from the estimate', async () => {
    // Black-box round 13: a bare "EISDIR: illegal operation on a directory, read", naming neither keyList nor the path.
    const src = keyList({ file: dir, size: 2 });
    const expected = `keyList(): cannot read ${dir}: it is a directory, not a file of keys; fix the path (relative paths resolve against ${process.cwd()})`;
    await expect(src(null, planCtx(1))).rejects.toThrow(expected);
    await expect(Promise.resolve(src.estimate!(planCtx(1)))).rejects.toThrow(expected);
  });

  it('a file larger than the process may hold is streamed through in a heap too small to load it whole', async () => {
    const file = path.join(dir, 'big.txt');
    // 1.6 M keys of 40 characters: 66 MB, more than twice the child's 32 MB heap.
    const lines = 1_600_000;
    await new Promise<void>((resolve, reject) => {
      const out = createWriteStream(file);
      out.on('error', reject);
      let i = 0;
      const write = () => {
        while (i < lines) {
          const block: string[] = [];
          for (let j = 0; j < 100_000 && i < lines; j++, i++) block.push(`k${String(i).padStart(39, '0')}`);
          if (!out.write(`${block.join('\n')}\n`)) return void out.once('drain', write);
        }
        out.end(resolve);
      };
      write();
    });
    const bytes = (await stat(file)).size;
    expect(bytes).toBeGreaterThan(60_000_000);
    const script = path.join(dir, 'walk.mts');
    await writeFile(
      script,
      `import { readFileSync } from 'node:fs';
import { keyList } from ${JSON.stringify(path.resolve('src/key-list.ts'))};
const [file, mode] = process.argv.slice(2);
if (mode === 'whole') { console.log(readFileSync(file, 'utf8').split('\\n').length); process.exit(0); }
const src = keyList({ file, size: 1000 });
let cursor = null, keys = 0, chunks = 0, last = '';
do {
  const page = await src(cursor, { windowSize: 50, sizeFactor: 1, params: {} });
  for (const c of page.chunks) { keys += c.keys.length; chunks++; last = c.keys[c.keys.length - 1]; }
  cursor = page.next;
} while (cursor !== null);
console.log(JSON.stringify({ keys, chunks, last }));
`,
    );
    const walk = (mode: string) =>
      new Promise<{ code: number | null; out: string; err: string }>((resolve) => {
        const child = spawn(process.execPath, ['--max-old-space-size=32', '--import', 'tsx', script, file, mode], { stdio: ['ignore', 'pipe', 'pipe'] });
        let out = '';
        let err = '';
        child.stdout.on('data', (d) => (out += d));
        child.stderr.on('data', (d) => (err += d));
        child.on('close', (code) => resolve({ code, out, err }));
      });
    const streamed = await walk('stream');
    expect(streamed.err).toBe('');
    expect(streamed.code).toBe(0);
    expect(JSON.parse(streamed.out)).toEqual({ keys: lines, chunks: lines / 1000, last: `k${String(lines - 1).padStart(39, '0')}` });
    // The control: the same heap cannot hold the file's keys loaded whole.
    const whole = await walk('whole');
    expect(whole.code).not.toBe(0);
    expect(whole.err).toMatch(/heap out of memory|Invalid string length/);
  }, 180_000);
});

describe('keysetQuery', () => {
  beforeAll(async () => {
    // Composite key (text, bigint) with gaps: ids jump, whole tenants are missing, closed rows are filtered out.
    await query(url, `create table orders (tenant text not null, id bigint not null, status text not null, touched integer not null default 0, primary key (tenant, id))`);
    await query(url, `insert into orders (tenant, id, status)
      select t, g * g, case when g % 7 = 0 then 'closed' else 'open' end
      from unnest(array['acme', 'beta', 'zeta']) t, generate_series(1, 300) g where not (t = 'beta' and g between 50 and 250)`);
    await query(url, 'analyze orders');
  });

  it('cuts a query by a composite key across gaps: each row once, chunks contiguous and full, resumable', async () => {
    const orders = keysetQuery({ query: `select tenant, id from orders where status = 'open'`, key: ['tenant', 'id'], size: 37 });
    const job = defineJob({
      name: 'keyset',
      steps: [
        {
          name: 'touch',
          chunks: orders,
          run: ({ db }, c: KeysetChunk) => sql`update orders set touched = touched + 1 where status = 'open' and ${orders.where(c)}`.execute(db),
        },
      ],
    });
    const out = await runInterrupted(job, 'k', 5);
    expect(out).toMatchObject({ status: 'succeeded', attempt: 2 });
    const [{ open }] = await query(url, `select count(*)::int as open from orders where status = 'open'`);
    expect(await query(url, `select status, min(touched), max(touched) from orders group by status order by status`)).toEqual([
      { status: 'closed', min: 0, max: 0 },
      { status: 'open', min: 1, max: 1 },
    ]);
    const chunks = await query(url, `select c.spec from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'keyset' order by seq`);
    expect(chunks).toHaveLength(Math.ceil(open / 37));
    // No gap between chunks: each starts after the last key of the one before.
    chunks.forEach((c, i) => expect(c.spec.after).toEqual(i === 0 ? null : chunks[i - 1]!.spec.through));
    expect(chunks.at(-1)!.spec.through).toEqual(['zeta', String(300 * 300)]);
    // Every chunk but the last holds exactly `size` rows.
    for (const c of chunks.slice(0, -1)) {
      const [{ n }] = await query(url, `select count(*)::int as n from orders where status = 'open' and (tenant, id) > ($1, $2) and (tenant, id) <= ($3, $4)`, [
        ...(c.spec.after ?? ['', '-1']),
        ...c.spec.through,
      ]);
      expect(n).toBe(37);
    }
    const [est] = await query(url, `select s.estimated_chunks from idem.steps s join idem.runs r on r.id = s.run_id where r.job = 'keyset'`);
    expect(est.estimated_chunks).toBeGreaterThan(0);
    expect(await runRow(url, 'keyset', 'k')).toMatchObject({ status: 'succeeded' });
  });

  it("boundaries do not depend on the session's settings: floats under extra_float_digits = 0, dates across a DateStyle change", async () => {
    // Black-box round 12 (B1-2): boundaries were the session's ::text of the key. Under
    // extra_float_digits = 0, 1.0000000000000002 printed as "1" and its row fell between two
    // chunks (skipped, the run succeeded); a cursor stored as "10/01/2026" under DateStyle
    // 'SQL, DMY' read back as October 1 under 'ISO, MDY', and 125 of 144 rows were updated 2–3 times.
    const dbName = new URL(url).pathname.slice(1);
    await query(url, `create table fk (id float8 primary key, done integer not null default 0)`);
    await query(url, `insert into fk (id) values (0.5), (1.0000000000000002), (0.1::float8 + 0.2::float8), (1), (2.5)`);
    await query(url, `create table td (id date primary key, v integer not null default 0)`);
    await query(url, `insert into td (id) select make_date(2026, m, d) from generate_series(1, 12) m, generate_series(1, 12) d`);
    const floats = keysetQuery({ query: 'select id from fk', key: 'id', size: 2 });
    const dates = keysetQuery({ query: 'select id from td', key: 'id', size: 10 });
    const floatJob = defineJob({ name: 'settings-floats', steps: [{ name: 's', chunks: floats, run: ({ db }, c: KeysetChunk) => sql`update fk set done = done + 1 where ${floats.where(c)}`.execute(db) }] });
    const dateJob = defineJob({ name: 'settings-dates', steps: [{ name: 's', chunks: dates, run: ({ db }, c: KeysetChunk) => sql`update td set v = v + 1 where ${dates.where(c)}`.execute(db) }] });
    await query(url, `alter database ${dbName} set extra_float_digits = 0`);
    await query(url, `alter database ${dbName} set datestyle = 'SQL, DMY'`);
    const runners: Runner[] = [];
    try {
      const dmy = await Runner.connect({ connectionString: url });
      runners.push(dmy);
      expect((await dmy.run(floatJob, { key: 'k' })).status).toBe('succeeded');
      expect(await query(url, `select done, count(*)::int as n from fk group by done`)).toEqual([{ done: 1, n: 5 }]);
      const stop = new AbortController();
      const first = await dmy
        .run(dateJob, { key: 'k', signal: stop.signal, onProgress: (p) => void (p.done >= 3 && stop.abort(new InterruptedError('SIGINT'))) })
        .catch((e: unknown) => e);
      expect(first).toBeInstanceOf(InterruptedError);
      await query(url, `alter database ${dbName} set datestyle = 'ISO, MDY'`);
      const mdy = await Runner.connect({ connectionString: url });
      runners.push(mdy);
      expect((await mdy.run(dateJob, { key: 'k' })).status).toBe('succeeded');
      expect(await query(url, `select v, count(*)::int as n from td group by v`)).toEqual([{ v: 1, n: 144 }]);
    } finally {
      for (const r of runners) await r.close();
      await query(url, `alter database ${dbName} reset extra_float_digits`);
      await query(url, `alter database ${dbName} reset datestyle`);
    }
  });

  it('keys longer than a chunk key may be (2000 bytes): the chunk is keyed by a digest of its boundary, each row once', async () => {
    // Black-box round 12 (B1-4): the chunk key was the boundary's JSON, and a text key of 2100
    // bytes failed the step with advice to "key the chunk by something shorter", which
    // keysetQuery's user cannot choose.
    await query(url, `create table lk (id text primary key, v integer not null default 0)`);
    await query(url, `insert into lk (id) select repeat('x', 2100) || g from generate_series(1, 10) g`);
    const long = keysetQuery({ query: 'select id from lk', key: 'id', size: 3 });
    const job = defineJob({ name: 'long-keys', steps: [{ name: 's', chunks: long, run: ({ db }, c: KeysetChunk) => sql`update lk set v = v + 1 where ${long.where(c)}`.execute(db) }] });
    expect((await runInterrupted(job, 'k', 2)).status).toBe('succeeded');
    expect(await query(url, `select v, count(*)::int as n from lk group by v`)).toEqual([{ v: 1, n: 10 }]);
    const keys = await query<{ key: string }>(url, `select c.key from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'long-keys' order by seq`);
    expect(keys).toHaveLength(4);
    for (const { key } of keys) {
      expect(Buffer.byteLength(key)).toBeLessThanOrEqual(2000);
      expect(key).toMatch(/^\["x{20,}.*sha256:[0-9a-f]{64}$/);
    }
  });

  it('a query ending in a -- comment or a semicolon, as SQL copied from a console does, plans like the bare query', async () => {
    // Black-box round 10 (keyRange's `where`, and the same splice here): the comment swallowed the
    // rest of idem's statement, the semicolon was a syntax error inside it.
    await query(url, `create table ks_tail (id integer primary key, open boolean not null, touched integer not null default 0)`);
    await query(url, `insert into ks_tail (id, open) select g, g % 4 <> 0 from generate_series(1, 230) g`);
    const queries = [`select id from ks_tail where open -- open ones`, `select id from ks_tail where open;`, `select id from ks_tail where open ; -- open ones\n`];
    for (const [i, q] of queries.entries()) {
      const src = keysetQuery({ query: q, key: 'id', size: 50 });
      const job = defineJob({ name: `ks-tail-${i}`, steps: [{ name: 'touch', chunks: src, run: ({ db }, c: KeysetChunk) => sql`update ks_tail set touched = touched + 1 where open and ${src.where(c)}`.execute(db) }] });
      expect((await runner.run(job, { key: 'k' })).status, q).toBe('succeeded');
    }
    expect(await query(url, `select open, min(touched), max(touched), count(*)::int as n from ks_tail group by open order by open`)).toEqual([
      { open: false, min: 0, max: 0, n: 57 },
      { open: true, min: 3, max: 3, n: 173 },
    ]);
  });

  it('refuses a query whose key is NULL in some row (rows no chunk holds) at first planning, naming the column and the fix', async () => {
    await query(url, `create table ks_nulls (tenant text, id integer, touched integer not null default 0, unique (tenant, id))`);
    await query(url, `insert into ks_nulls (tenant, id) select 'a', g from generate_series(1, 5) g union all select 'b', null union all select 'c', null`);
    const touch = (name: string, q: string) => {
      const src = keysetQuery({ query: q, key: ['tenant', 'id'], size: 2 });
      return defineJob({ name, steps: [{ name: 'touch', chunks: src, run: ({ db }, c: KeysetChunk) => sql`update ks_nulls set touched = touched + 1 where ${src.where(c)}`.execute(db) }] });
    };
    const err = await runner.run(touch('ks-nulls', 'select tenant, id from ks_nulls'), { key: 'k' }).catch((e: unknown) => e);
    expect((err as Error).message).toBe(
      'job "ks-nulls" failed in step "touch" after 1 try: keysetQuery(): the query returns rows whose key column "id" is NULL, which no chunk holds, so they would be skipped; make the key columns NOT NULL, or exclude those rows in the query (where tenant is not null and id is not null) and handle them in another step; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    );
    expect(await query(url, `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'ks-nulls'`)).toEqual([{ n: 0 }]);
    const ok = await runner.run(touch('ks-not-null', 'select tenant, id from ks_nulls where tenant is not null and id is not null'), { key: 'k' });
    expect(ok.status).toBe('succeeded');
    expect(await query(url, `select (tenant is null or id is null) as has_null, min(touched), max(touched) from ks_nulls group by 1 order by 1`)).toEqual([
      { has_null: false, min: 1, max: 1 },
      { has_null: true, min: 0, max: 0 },
    ]);
  });

  it('keyList and keysetQuery, like keyRange, scale their chunk size by ctx.sizeFactor (--target-chunk-ms)', async () => {
    const ctx = (sizeFactor: number) => ({ ...planCtx(2), sizeFactor, db: runner.db }) as PlanContext;
    const list = keyList({ keys: Array.from({ length: 100 }, (_, i) => i), size: 10 });
    expect((await list(null, ctx(2))).chunks.map((c) => c.keys.length)).toEqual([20, 20]);
    expect((await list(null, ctx(0.5))).chunks.map((c) => c.keys.length)).toEqual([5, 5]);
    const rows = keysetQuery({ query: `select tenant, id from orders`, key: ['tenant', 'id'], size: 10 });
    const count = async (c: KeysetChunk) => (await query(url, `select count(*)::int as n from orders where (tenant, id) > ($1, $2) and (tenant, id) <= ($3, $4)`, [...(c.after ?? ['', '-1']), ...c.through]))[0].n;
    expect(await Promise.all((await rows(null, ctx(2))).chunks.map(count))).toEqual([20, 20]);
    expect(await Promise.all((await rows(null, ctx(0.5))).chunks.map(count))).toEqual([5, 5]);
  });

  it('refuses bad options at definition time', () => {
    expect(() => keysetQuery({ query: '', key: [], size: 0 })).toThrow(
      'keysetQuery(): query must be a non-empty SQL string or a sql`` builder; key must be a column name or a non-empty array of them; size must be an integer >= 1 (got 0)',
    );
    // It is a subquery of idem's statements: two statements, or a comment alone, cannot be.
    for (const q of ['select id from t; delete from t', '-- nothing but a comment;']) {
      expect(() => keysetQuery({ query: q, key: 'id', size: 1 }), q).toThrow('keysetQuery(): query must be one SELECT statement (it is used as a subquery)');
    }
  });
});

describe('chunk sources refuse an option key they do not know, naming the closest known key', () => {
  it('keyRange, keyList and keysetQuery: a typo is refused when the source is made, a known key still taken', () => {
    // Black-box round 13, beside the job's nested keys: keyRange({ ..., wehre }) would cut every row, keyList({ ..., headers: false }) skip the first key.
    expect(() => keyRange({ table: 't', column: 'id', size: 10, wehre: 'x > 0' } as never)).toThrow('keyRange(): unknown key "wehre" (did you mean "where"?)');
    expect(() => keyList({ keys: [1], size: 1, headers: false } as never)).toThrow('keyList(): unknown key "headers" (did you mean "header"?)');
    // Black-box round 14 (B3-14): keyList([…]) listed 'unknown key "0" (known: …)' once per element.
    const keys = Array.from({ length: 40 }, (_, i) => i);
    expect(() => keyList(keys as never)).toThrow(/^keyList\(\) takes an options object, such as \{ keys: \[1, 2, 3\], size: 1000 \} \(got an array\)$/);
    expect(() => keyRange('orders' as never)).toThrow(/^keyRange\(\) takes an options object, such as \{ table: 'orders', column: 'id', size: 1000 \} \(got a string\)$/);
    expect(() => keysetQuery(undefined as never)).toThrow(/^keysetQuery\(\) takes an options object, .* \(got undefined\)$/);
    expect(() => keysetQuery({ query: 'select 1 as id', key: 'id', size: 1, table: ['t'] } as never)).toThrow('keysetQuery(): unknown key "table" (did you mean "tables"?)');
    // Reported with the other problems, all at once; a stray key with no near one lists the known keys.
    expect(() => keyRange({ table: 't', column: 'id', size: 0, bogus: 1 } as never)).toThrow(
      'keyRange(): unknown key "bogus" (known: table, column, size, where); size must be an integer >= 1 (got 0)',
    );
    expect(() => keyRange({ table: 't', column: 'id', size: 1, where: 'x > 0' })).not.toThrow();
    expect(() => keyList({ file: 'f.csv', format: 'csv', column: 'id', header: true, size: 1 })).not.toThrow();
    expect(() => keysetQuery({ query: 'select 1 as id', key: 'id', size: 1, tables: ['t'] })).not.toThrow();
  });
});

describe('keyRange: a table or column name is spelled as it is in the database', () => {
  beforeAll(async () => {
    // Created quoted: the names keep their case, and only that spelling names them.
    await query(url, `create table "MixedCase" ("Id" int primary key, v int)`);
    await query(url, `insert into "MixedCase" select g, 0 from generate_series(1, 20) g`);
    await query(url, `create schema "Sales"`);
    await query(url, `create table "Sales"."Orders" ("Id" bigint primary key, v int)`);
    await query(url, `insert into "Sales"."Orders" select g, 0 from generate_series(1, 10) g`);
    await query(url, `analyze "MixedCase"; analyze "Sales"."Orders"`);
  });

  const touch = (table: string, column: string, size: number) => {
    const source = keyRange({ table, column, size });
    return defineJob({
      name: `mixed-${table.replace(/\W/g, '-').toLowerCase()}`,
      steps: [{ name: 'touch', chunks: source, run: ({ db }, c: KeyRangeChunk) => sql`update ${sql.table(table)} set v = v + 1 where ${sql.ref(column)} >= ${c.lo} and ${sql.ref(column)} < ${c.hi}`.execute(db) }],
    });
  };

  it("plans and estimates a mixed-case table and column named as written ('MixedCase', 'Id'), schema-qualified too", async () => {
    const out = await runner.run(touch('MixedCase', 'Id', 7), { key: 'm' });
    expect(out.summary?.steps[0]).toEqual({ name: 'touch', chunks: 3 });
    expect(await query(url, `select min(v), max(v) from "MixedCase"`)).toEqual([{ min: 1, max: 1 }]);
    // The estimate reads the same table: 20 rows (the planner's statistics) / 7.
    expect(await query(url, `select s.estimated_chunks from idem.steps s join idem.runs r on r.id = s.run_id where r.job = 'mixed-mixedcase' and r.run_key = 'm'`)).toEqual([{ estimated_chunks: 3 }]);
    const qualified = await runner.run(touch('Sales.Orders', 'Id', 4), { key: 'q' });
    expect(qualified.summary?.steps[0]).toEqual({ name: 'touch', chunks: 3 });
    expect(await query(url, `select min(v), max(v) from "Sales"."Orders"`)).toEqual([{ min: 1, max: 1 }]);
    // The autovacuum health check watches the same table: it resolves the source's `tables` (and a
    // step's) by the same rule.
    const tables = keyRange({ table: 'Sales.Orders', column: 'Id', size: 1 }).tables!;
    expect(tables).toEqual(['Sales.Orders']);
    const resolved = await query(url, `select to_regclass(n)::oid::int8 as oid from unnest($1::text[]) n`, [[...tables, 'MixedCase'].map(lookupText)]);
    expect(resolved).toEqual(await query(url, `select oid::int8 as oid from unnest(array['"Sales"."Orders"'::regclass, '"MixedCase"'::regclass]) oid`));
  });

  it('refuses a quoted name at definition, with the spelling to use, and names the table a wrong-case name meant', async () => {
    expect(() => keyRange({ table: '"MixedCase"', column: '"Id"', size: 7 })).toThrow(
      `keyRange(): table must be the name as it is in the database, without quotes (got '"MixedCase"'): write table: 'MixedCase'; column must be the name as it is in the database, without quotes (got '"Id"'): write column: 'Id'`,
    );
    expect(() => keyRange({ table: 'a.b.c', column: 'id', size: 1 })).toThrow(`keyRange(): table must be a name or schema.name (got 'a.b.c')`);
    // The same rule wherever idem takes a table or column name.
    expect(() => defineJob({ name: 'quoted-tables', steps: [{ name: 's', tables: ['ok', '"MixedCase"'], run() {} }] })).toThrow(
      `defineJob(): invalid job definition: steps[0].tables[1] must be the name as it is in the database, without quotes (got '"MixedCase"'): write steps[0].tables[1]: 'MixedCase'`,
    );
    expect(() => keysetQuery({ query: 'select 1', key: '"Id"', size: 1, tables: ['"Sales"."Orders"'] })).toThrow(
      `keysetQuery(): key must be the name as it is in the database, without quotes (got '"Id"'): write key: 'Id'; tables[0] must be the name as it is in the database, without quotes (got '"Sales"."Orders"'): write tables[0]: 'Sales.Orders'`,
    );
    const err = await runner.run(touch('mixedcase', 'Id', 7), { key: 'lower' }).catch((e: unknown) => e);
    expect((err as Error).message).toMatch(/keyRange\(\): table "mixedcase" does not exist; did you mean 'MixedCase'\? \(names are case-sensitive, as in the database\)/);
    const col = await runner.run(touch('MixedCase', 'id', 7), { key: 'lower-col' }).catch((e: unknown) => e);
    expect((col as Error).message).toMatch(/keyRange\(\): table "MixedCase" has no column "id"; did you mean 'Id'\?/);
  });
});

describe('keyRange: a run planned by an older idem', () => {
  // Wrapped: a job's own source calling keyRange (to make `where` depend on params) carries
  // nothing of keyRange's; the stored spec's shape says what it is.
  it.each([
    ['keyRange itself', 'kr_resume', (src: ReturnType<typeof keyRange>) => src],
    ['keyRange wrapped in a source of the job', 'kr_resume_w', (src: ReturnType<typeof keyRange>): ChunkSource => (cursor, ctx) => src(cursor, ctx)],
  ] as const)('resumes chunks stored without `last` (planned before it existed) with last = hi - 1: %s', async (_, table, wrap) => {
    await query(url, `create table ${table} (id integer primary key, v integer not null default 0)`);
    await query(url, `insert into ${table} (id) select generate_series(1, 9)`);
    const job = defineJob({
      name: `kr-resume-${table}`,
      steps: [{ name: 'touch', chunks: wrap(keyRange({ table, column: 'id', size: 3 })), run: ({ db }, c: KeyRangeChunk) => sql`update ${sql.table(table)} set v = v + 1 where id between ${c.lo} and ${c.last}`.execute(db) }],
    });
    const stop = new AbortController();
    const first = await runner.run(job, { key: 'old', signal: stop.signal, onProgress: (p) => p.done >= 1 && stop.abort(new InterruptedError('SIGINT')) }).catch((e: unknown) => e);
    expect(first).toBeInstanceOf(InterruptedError);
    // What an older idem stored: { key, lo, hi }.
    await query(url, `update idem.chunks set spec = spec - 'last' where run_id = (select id from idem.runs where job = $1)`, [job.name]);
    expect(await runner.run(job, { key: 'old' })).toMatchObject({ status: 'succeeded', attempt: 2 });
    expect(await query(url, `select min(v), max(v) from ${table}`)).toEqual([{ min: 1, max: 1 }]);
  });
});

describe('a custom source that does not move', () => {
  it('no chunks and the same cursor back fails the run at once, naming the step and the fix, instead of planning forever', async () => {
    let calls = 0;
    const job = defineJob({
      name: 'stuck-source',
      steps: [
        {
          name: 'days',
          chunks: (cursor) => {
            calls++;
            return { chunks: [], next: cursor ?? '2026-11-30' };
          },
          run: () => {},
        },
      ],
    });
    const started = performance.now();
    const err = await runner.run(job, { key: 'stuck' }).catch((e: unknown) => e);
    expect(performance.now() - started).toBeLessThan(10_000);
    expect(String(err)).toMatch(/step "days".*chunk source returned no chunks and the cursor it was given \("2026-11-30"\)/);
    expect(String(err)).toMatch(/return next: null when the step is done/);
    expect(calls).toBe(2); // null → "2026-11-30", then "2026-11-30" → "2026-11-30": refused
    expect((await runRow(url, 'stuck-source', 'stuck'))?.status).toBe('failed');
  });

  it('the cursor comes back to the source as it is stored (its JSON) in the same run, as on resume', async () => {
    // Until 2026-12-04 the same process handed back the object itself (a Date), a resumed run its
    // JSON (a string): a source calling cursor.getUTCDate() worked until the run had to resume.
    const seen: unknown[] = [];
    const job = defineJob({
      name: 'date-cursor',
      steps: [
        {
          name: 'days',
          chunks: (cursor) => {
            seen.push(cursor);
            // What a JavaScript job (no type check) may return: the type says next is Json.
            if (cursor === null) return { chunks: [{ key: 'a' }], next: new Date(Date.UTC(2026, 0, 4)) as never };
            if (typeof cursor === 'string') return { chunks: [{ key: `b-${cursor.slice(0, 10)}` }], next: { after: new Date(Date.UTC(2026, 0, 5)), skip: undefined } as never };
            return { chunks: [], next: null };
          },
          run: async ({ db }, chunk) => recordKeys(db, 'date-cursor-', [chunk.key]),
        },
      ],
    });
    expect((await runner.run(job, { key: 'dates', planWindow: 1 })).status).toBe('succeeded');
    expect(seen).toEqual([null, '2026-01-04T00:00:00.000Z', { after: '2026-01-05T00:00:00.000Z' }]);
    expect(await query(url, `select key, n from seen where key like 'date-cursor-%' order by key`)).toEqual([
      { key: 'date-cursor-a', n: 1 },
      { key: 'date-cursor-b-2026-01-04', n: 1 },
    ]);
  });

  it('empty windows whose cursor moves are fine (a sparse scan)', async () => {
    const job = defineJob({
      name: 'sparse-source',
      steps: [
        {
          name: 'scan',
          chunks: (cursor) => {
            const at = (cursor as number | null) ?? 0;
            if (at >= 5) return { chunks: [], next: null };
            return { chunks: at === 3 ? [{ key: `k${at}` }] : [], next: at + 1 };
          },
          run: async ({ db }, chunk) => recordKeys(db, 'sparse-', [chunk.key]),
        },
      ],
    });
    expect((await runner.run(job, { key: 'sparse' })).status).toBe('succeeded');
    expect(await query(url, `select key, n from seen where key like 'sparse-%'`)).toEqual([{ key: 'sparse-k3', n: 1 }]);
  });
});

describe('a job-definition mistake in planning is the step\'s, with what to fix', () => {
  const failed = async (job: ReturnType<typeof defineJob<any>>) => {
    const err = await runner.run(job, { key: 'k' }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(Error);
    return { message: (err as Error).message, recorded: (await runRow(url, job.name, 'k')).error };
  };
  const sourceOf = (specs: object[]) => () => ({ chunks: specs as { key: string }[], next: null });

  it('keyRange over a table name that is not a name fails in its step', async () => {
    const { keyRange } = await import('../src/index.ts');
    // With the autovacuum health check, the gate resolves the source's table before planning.
    const job = defineJob({ name: 'bad-table', health: { autovacuum: true }, steps: [{ name: 'scan', chunks: keyRange({ table: 'tx; drop table tx', column: 'id', size: 10 }), run: () => {} }] });
    const { message, recorded } = await failed(job);
    expect(message).toMatch(/^job "bad-table" failed in step "scan" after 1 try: .*"tx; drop table tx"/);
    expect(recorded).toMatchObject({ step: 'scan', chunk: null });
  });

  it('a table name the server refuses (U+0000) for the autovacuum health check fails in its step', async () => {
    const { keyRange } = await import('../src/index.ts');
    const job = defineJob({ name: 'nul-table', health: { autovacuum: true }, steps: [{ name: 'scan', chunks: keyRange({ table: 'tx\u0000', column: 'id', size: 10 }), run: () => {} }] });
    const { message, recorded } = await failed(job);
    expect(message).toMatch(/^job "nul-table" failed in step "scan" after 1 try: invalid byte sequence for encoding "UTF8": 0x00;/);
    expect(recorded).toMatchObject({ step: 'scan', chunk: null });
  });

  it('a chunk spec holding a BigInt fails in its step, saying to convert it', async () => {
    const job = defineJob({ name: 'bigint-spec', steps: [{ name: 'plan', chunks: sourceOf([{ key: 'a', id: 1n }]), run: () => {} }] });
    const { message, recorded } = await failed(job);
    expect(message).toBe(
      'job "bigint-spec" failed in step "plan" after 1 try: chunk a: chunk specs must be JSON: a BigInt (at id) cannot be stored; convert it to a string or number; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    );
    expect(recorded).toMatchObject({ step: 'plan', chunk: null });
  });

  it('a chunk spec or key holding U+0000 fails in its step, saying PostgreSQL cannot store it', async () => {
    const spec = defineJob({ name: 'nul-spec', steps: [{ name: 'plan', chunks: sourceOf([{ key: 'a', name: 'x\u0000y' }]), run: () => {} }] });
    const s = await failed(spec);
    expect(s.message).toBe(
      'job "nul-spec" failed in step "plan" after 1 try: chunk a: chunk specs cannot hold the character U+0000 (at name), which PostgreSQL cannot store in text or jsonb; remove or replace it; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    );
    expect(s.recorded).toMatchObject({ step: 'plan', chunk: null });
    const key = defineJob({ name: 'nul-key', steps: [{ name: 'plan', chunks: sourceOf([{ key: 'a\u0000b' }]), run: () => {} }] });
    const k = await failed(key);
    expect(k.message).toBe(
      'job "nul-key" failed in step "plan" after 1 try: chunk "a\\u0000b": chunk specs cannot hold the character U+0000 (at key), which PostgreSQL cannot store in text or jsonb; remove or replace it; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    );
    expect(k.recorded).toMatchObject({ step: 'plan', chunk: null });
  });

  it('a chunk spec or key holding a lone surrogate fails in its step, naming the chunk and the field', async () => {
    const job = defineJob({ name: 'surrogate-spec', steps: [{ name: 'plan', chunks: sourceOf([{ key: 'a', name: 'x\ud800' }]), run: () => {} }] });
    const { message, recorded } = await failed(job);
    expect(message).toBe(
      'job "surrogate-spec" failed in step "plan" after 1 try: chunk a: chunk specs cannot hold a lone surrogate (at name), which is not well-formed Unicode and PostgreSQL cannot store as JSON; remove or replace it; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    );
    expect(recorded).toMatchObject({ step: 'plan', chunk: null });
    const key = await failed(defineJob({ name: 'surrogate-key', steps: [{ name: 'plan', chunks: sourceOf([{ key: 'a\ud800b' }]), run: () => {} }] }));
    expect(key.message).toMatch(/^job "surrogate-key" failed in step "plan" after 1 try: chunk "a\\ud800b": chunk specs cannot hold a lone surrogate \(at key\)/);
  });

  it('NaN or Infinity in a chunk spec fails in its step instead of being stored as null', async () => {
    const { message } = await failed(defineJob({ name: 'nan-spec', steps: [{ name: 'plan', chunks: sourceOf([{ key: 'a', lo: NaN }, { key: 'b', hi: Infinity }]), run: () => {} }] }));
    expect(message).toBe(
      'job "nan-spec" failed in step "plan" after 1 try: chunk a: chunk specs must be JSON: NaN (at lo) has no JSON form and would be stored as null; use a number or a string; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    );
  });

  it('a chunk key longer than 2000 bytes of UTF-8 fails in its step, naming the chunk (clipped) and the limit', async () => {
    const { message, recorded } = await failed(defineJob({ name: 'long-key', steps: [{ name: 'plan', chunks: sourceOf([{ key: 'x'.repeat(3_000_000) }]), run: () => {} }] }));
    expect(message).toBe(
      `job "long-key" failed in step "plan" after 1 try: chunk ${'x'.repeat(40)}… (3000000 bytes): a chunk key is at most 2000 bytes of UTF-8 (the chunk index holds no longer one); key the chunk by something shorter, e.g. its range or a hash of its content; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)`,
    );
    expect(recorded).toMatchObject({ step: 'plan', chunk: null });
    // 2000 bytes exactly (500 four-byte characters) is stored.
    const ok = defineJob({ name: 'max-key', steps: [{ name: 'plan', chunks: sourceOf([{ key: '🙂'.repeat(500) }]), run: () => {} }] });
    expect((await runner.run(ok, { key: 'k' })).status).toBe('succeeded');
  });

  it('a key repeated within one window is quoted in the message, as across windows', async () => {
    const { message } = await failed(defineJob({ name: 'dup-window', steps: [{ name: 'plan', chunks: sourceOf([{ key: 'a b' }, { key: 'a b' }]), run: () => {} }] }));
    expect(message).toMatch(/: chunk source returned key "a b" twice in one window; keys must be unique;/);
  });
});

describe("a chunk source's options refused when it is made: idem.invalidJob, exit 2, as defineJob's (black-box round 18, B8-6)", () => {
  // They were plain TypeErrors: no code, exitCodeOf 1, and the CLI said "it threw while loading:
  // TypeError: …" where defineJob's mistakes read as idem's own refusal.
  it('keyRange, keysetQuery and keyList throw a UsageError with code idem.invalidJob', () => {
    const cases: Array<[() => unknown, string]> = [
      [() => keyRange({ table: 't', column: 'id', size: 10, wehre: 'x' } as never), 'keyRange(): unknown key "wehre" (did you mean "where"?)'],
      [() => keysetQuery({ query: 'select 1 as k; select 2', key: 'k', size: 1 }), 'keysetQuery(): query must be one SELECT statement (it is used as a subquery)'],
      [() => keyList({ size: 1 } as never), 'keyList(): pass exactly one of keys or file'],
      [() => keyRange('orders' as never), "keyRange() takes an options object, such as { table: 'orders', column: 'id', size: 1000 } (got a string)"],
    ];
    for (const [make, message] of cases) {
      let thrown: unknown;
      try {
        make();
      } catch (err) {
        thrown = err;
      }
      expect(thrown, message).toBeInstanceOf(IdemError);
      expect([(thrown as IdemError).code, exitCodeOf(thrown), (thrown as Error).message]).toEqual(['idem.invalidJob', 2, message]);
    }
  });

  it('a job file making one loads with the one line naming it (exit 2), not "it threw while loading: TypeError"', async () => {
    const jobs = await mkdtemp(path.join(os.tmpdir(), 'idem-source-typo-'));
    try {
      await writeFile(path.join(jobs, 'typo.mjs'), `import { keyRange } from ${JSON.stringify(new URL('../dist/index.js', import.meta.url).href)};\nexport default { name: 'typo', steps: [{ name: 's', chunks: keyRange({ table: 't', column: 'id', size: 10, wehre: 'x' }), run() {} }] };\n`);
      const r = await runCli(['run', 'typo', '--jobs-dir', jobs], { url });
      expect(r.code, r.stderr).toBe(2);
      expect(r.stderr.split('\n')[0]).toMatch(/^idem: error: cannot load jobs file .*typo\.mjs:2:\d+: keyRange\(\): unknown key "wehre" \(did you mean "where"\?\); fix the file$/);
    } finally {
      await rm(jobs, { recursive: true, force: true });
    }
  });

  it('a table that does not exist is found when the step plans: the run fails there (exit 1, recorded), to resume once it is created', async () => {
    const job = defineJob({ name: 'no-table', steps: [{ name: 's', chunks: keyRange({ table: 'nowhere', column: 'id', size: 10 }), run() {} }] });
    const err = await runner.run(job, { key: 'k' }).catch((e: unknown) => e);
    expect([(err as IdemError).code, exitCodeOf(err)]).toEqual(['idem.runFailed', 1]);
    const [run] = await query(url, "select status, error->>'step' as step, error->>'message' as message from idem.runs where job = 'no-table'");
    expect(run).toEqual({ status: 'failed', step: 's', message: 'keyRange(): table "nowhere" does not exist; create it before the step runs, or fix the table name' });
  });
});
