import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, finalizeMigration, finalizeRun, InterruptedError, Runner, UsageError, type Job } from '../src/index.ts';
import { FIXTURE_MIGRATIONS, killLeftovers, query, runCli } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * The library's entry points refuse what the CLI refuses, up front: a UsageError (exit 2) naming the
 * problem and the fix, and nothing written to the database (no row in idem.runs). Found by a
 * black-box tester using the packed package as a library (round 15, B2).
 */
const testDb = useTestDatabase({ runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});
afterAll(killLeftovers);

/** The error a promise rejects with (fails the test if it resolves). */
async function rejectionOf(p: Promise<unknown>): Promise<Error> {
  return p.then(
    (v) => {
      throw new Error(`expected a rejection, got ${JSON.stringify(v)}`);
    },
    (e: Error) => e,
  );
}

/** Runs rows of a job: none after a refusal. */
async function runsOf(job: string): Promise<number> {
  const [row] = await query<{ n: number }>(url, 'select count(*)::int as n from idem.runs where job = $1', [job]);
  return row!.n;
}

/** A job whose only step counts its executions in `calls`. */
function countingJob(name: string, calls: { n: number }): Job {
  return defineJob({ name, steps: [{ name: 's', run: () => void calls.n++ }] });
}

/** Asserts `err` is a UsageError with this code and message, exit code 2. */
function expectUsage(err: Error, code: string, message: string): void {
  expect(err).toBeInstanceOf(UsageError);
  expect((err as UsageError).code).toBe(code);
  expect(err.message).toBe(message);
  expect(exitCodeOf(err)).toBe(2);
}

describe('an options object with a key the method does not know (B2 round 15)', () => {
  it('Runner.run refuses it, naming the key meant, and runs nothing', async () => {
    const calls = { n: 0 };
    const job = countingJob('opt-typo', calls);
    const cases: Array<[Record<string, unknown>, string]> = [
      [{ key: 'dry-1', dryrun: true }, 'unknown key "dryrun" (did you mean "dryRun"?)'],
      [{ kye: 'k' }, 'unknown key "kye" (did you mean "key"?)'],
      [{ key: 'k', concurency: 2 }, 'unknown key "concurency" (did you mean "concurrency"?)'],
      [{ key: 'k', throttle: { maxrate: 0.001 } }, 'throttle: unknown key "maxrate" (did you mean "maxRate"?)'],
    ];
    for (const [opts, problem] of cases) {
      const err = await rejectionOf(runner.run(job, opts as never));
      expectUsage(err, 'idem.invalidOptions', `Runner.run(): invalid options: ${problem}`);
    }
    const notObject = await rejectionOf(runner.run(job, 'dry-1' as never));
    expectUsage(notObject, 'idem.invalidOptions', "Runner.run(): options must be an object, such as { key: 'day-1', params: {…} } (got a string)");
    const wrongType = await rejectionOf(runner.run(job, { key: 'k', dryRun: 'yes', wait: -1 } as never));
    expectUsage(wrongType, 'idem.invalidOptions', 'Runner.run(): invalid options: dryRun must be true or false (got "yes"); wait must be true, false or a number of seconds >= 0 (got -1)');
    expect(calls.n).toBe(0);
    expect(await runsOf('opt-typo')).toBe(0);
  });

  it('finalizeRun, Runner.migrate and finalizeMigration refuse theirs too, before reading or writing anything', async () => {
    const calls = { n: 0 };
    const job = countingJob('opt-typo-fin', calls);
    const typo = await rejectionOf(finalizeRun(runner, job, { key: 'f', timeoutSecond: 5 } as never));
    expectUsage(typo, 'idem.invalidOptions', 'finalizeRun(): invalid options: unknown key "timeoutSecond" (did you mean "timeoutSeconds"?)');
    const negative = await rejectionOf(finalizeRun(runner, job, { key: 'f', timeoutSeconds: -5 }));
    expectUsage(negative, 'idem.invalidOptions', 'finalizeRun(): invalid options: timeoutSeconds must be a number of seconds >= 0 (got -5)');
    const noKey = await rejectionOf(finalizeRun(runner, job, {} as never));
    expectUsage(noKey, 'idem.invalidOptions', 'finalizeRun(): invalid options: key is required: the key of the run to finalize');
    const migration = countingJob('opt-typo-mig', calls);
    const wiat = await rejectionOf(runner.migrate([{ runKey: '0001', job: migration }], { wiat: true } as never));
    expectUsage(wiat, 'idem.invalidOptions', 'Runner.migrate(): invalid options: unknown key "wiat" (did you mean "wait"?)');
    const keyGiven = await rejectionOf(runner.migrate([{ runKey: '0001', job: migration }], { key: 'x' } as never));
    expect(keyGiven.message).toMatch(/^Runner\.migrate\(\): invalid options: unknown key "key" \(/);
    const fin = await rejectionOf(finalizeMigration(runner, [{ runKey: '0001', job: migration }], '0001', { timeoutSecond: 1 } as never));
    expectUsage(fin, 'idem.invalidOptions', 'finalizeMigration(): invalid options: unknown key "timeoutSecond" (did you mean "timeoutSeconds"?)');
    expect(calls.n).toBe(0);
    expect(await runsOf('opt-typo-fin')).toBe(0);
    expect(await runsOf('opt-typo-mig')).toBe(0);
  });
});

describe('an invalid throttle given to Runner.run (B2 round 15)', () => {
  it('is refused up front as defineJob refuses it, and a valid one then runs attempt 1', async () => {
    const calls = { n: 0 };
    const job = countingJob('bad-throttle', calls);
    const cases: Array<[unknown, string]> = [
      [{ maxRate: 0 }, 'maxRate must be > 0 (got 0)'],
      [{ maxRate: -1 }, 'maxRate must be > 0 (got -1)'],
      [{ pauseMs: -1 }, 'pauseMs must be >= 0 (got -1)'],
      [{ pauseMs: 'x' }, 'pauseMs must be >= 0 (got "x")'],
      [{ targetChunkMs: 0 }, 'targetChunkMs must be > 0 (got 0)'],
      ['fast', 'throttle must be an object { maxRate?, pauseMs?, targetChunkMs? }'],
    ];
    for (const [throttle, problem] of cases) {
      const err = await rejectionOf(runner.run(job, { key: 't', throttle } as never));
      expectUsage(err, 'idem.invalidOptions', `Runner.run(): invalid options: throttle: ${problem}`);
    }
    expect(calls.n).toBe(0);
    expect(await runsOf('bad-throttle')).toBe(0);
    const ok = await runner.run(job, { key: 't', throttle: { maxRate: 100 } });
    expect(ok).toMatchObject({ status: 'succeeded', attempt: 1 });
    expect(calls.n).toBe(1);
  });
});

describe('a job not made by defineJob, given to Runner.run or Runner.migrate (B2 round 15)', () => {
  it('Runner.run checks it as defineJob does, before writing anything', async () => {
    const cases: Array<[unknown, string]> = [
      [{ name: 'plain-bad' }, 'Runner.run(): invalid job definition: steps must be a non-empty array'],
      [{ name: 'plain-bad2', steps: [{ name: 's' }] }, 'Runner.run(): invalid job definition: steps[0].run must be a function'],
      [
        { name: 'bad name!', steps: [{ name: 's', run: () => {} }] },
        'Runner.run(): invalid job definition: name must match /^[a-z0-9][a-z0-9._:-]{0,99}$/i (letters, digits and . _ : -, starting with a letter or digit, at most 100 characters, got "bad name!")',
      ],
      [{ name: 'plain-extra', steps: [{ name: 's', run: () => {} }], schedual: '0 3 * * *' }, 'Runner.run(): invalid job definition: unknown key "schedual" (did you mean "schedule"?)'],
    ];
    for (const [job, message] of cases) {
      const err = await rejectionOf(runner.run(job as Job, { key: 'k' }));
      expectUsage(err, 'idem.invalidJob', message);
    }
    for (const job of [undefined, null, 'plain-bad']) {
      const err = await rejectionOf(runner.run(job as never, { key: 'k' }));
      expectUsage(err, 'idem.invalidJob', `Runner.run(): the job must be a job definition (what defineJob returns), got ${job === null ? 'null' : job === undefined ? 'undefined' : 'a string'}`);
    }
    const [row] = await query<{ n: number }>(url, "select count(*)::int as n from idem.runs where job in ('plain-bad', 'plain-bad2', 'bad name!', 'plain-extra')");
    const n = row!.n;
    expect(n).toBe(0);
  });

  it('Runner.migrate checks each job, and refuses a run key given twice and a migration taking params', async () => {
    const calls = { n: 0 };
    const good = countingJob('lm-good', calls);
    const plain = await rejectionOf(runner.migrate([{ runKey: '0011', job: { name: 'lm-h' } as Job }]));
    expectUsage(plain, 'idem.invalidJob', 'Runner.migrate(): migration 0011: invalid job definition: steps must be a non-empty array');
    const twice = await rejectionOf(runner.migrate([{ runKey: '0011', job: good }, { runKey: '0011', job: countingJob('lm-other', calls) }]));
    expectUsage(twice, 'idem.invalidMigration', 'Runner.migrate(): run key "0011" is given twice (migrations[0] and migrations[1]); give each migration a run key of its own');
    const withParams = defineJob({ name: 'lm-params', params: (raw: unknown) => raw as { n?: number }, steps: [{ name: 's', run: () => void calls.n++ }] });
    const params = await rejectionOf(runner.migrate([{ runKey: '0012', job: withParams }]));
    expectUsage(
      params,
      'idem.invalidMigration',
      'Runner.migrate(): migration 0012: a migration takes no params (it runs once per database, with its file name as run key): remove params, or make it a job in the jobs folder',
    );
    const extra = await rejectionOf(runner.migrate([{ runKey: '0013', job: good, runkey: 'x' } as never]));
    expectUsage(extra, 'idem.invalidMigration', 'Runner.migrate(): migrations[0]: unknown key "runkey" (did you mean "runKey"?)');
    const notArray = await rejectionOf(runner.migrate({ runKey: '0013', job: good } as never));
    expectUsage(notArray, 'idem.invalidMigration', 'Runner.migrate(): migrations must be an array of { runKey, job } (got an object)');
    expect(calls.n).toBe(0);
    const [row] = await query<{ n: number }>(url, "select count(*)::int as n from idem.runs where job in ('lm-h', 'lm-good', 'lm-other', 'lm-params')");
    const n = row!.n;
    expect(n).toBe(0);
    // The same migrations given right run.
    const [out] = await runner.migrate([{ runKey: '0011', job: good }]);
    expect(out).toMatchObject({ status: 'succeeded', runKey: '0011' });
    expect(calls.n).toBe(1);
  });
});

describe('params a validator returns with a BigInt in them (B2 round 15)', () => {
  const bigintJob = (name: string) => defineJob({ name, params: (raw: any) => ({ id: BigInt(raw.id) }), steps: [{ name: 's', run: () => {} }] });
  const MESSAGE = (job: string) => `invalid params for job "${job}": params.id is a BigInt, which JSON cannot represent; have the params validator return it as a string (or a number within ±(2^53−1))`;

  it('Runner.run refuses them as invalid params, naming the path, and writes nothing', async () => {
    const err = await rejectionOf(runner.run(bigintJob('c'), { params: { id: '5' }, key: 'k' }));
    expectUsage(err, 'idem.invalidParams', MESSAGE('c'));
    const nested = defineJob({ name: 'c-nested', params: () => ({ ids: [1, 2n] }), steps: [{ name: 's', run: () => {} }] });
    const err2 = await rejectionOf(runner.run(nested, { key: 'k' }));
    expect(err2.message).toBe('invalid params for job "c-nested": params.ids[1] is a BigInt, which JSON cannot represent; have the params validator return it as a string (or a number within ±(2^53−1))');
    expect(await runsOf('c')).toBe(0);
    expect(await runsOf('c-nested')).toBe(0);
  });

  it('idem run refuses them with one line, exit 2', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'idem-bigint-'));
    try {
      writeFileSync(join(dir, 'bigint-cli.ts'), `export default { name: 'bigint-cli', params: (raw: any) => ({ id: BigInt(raw.id) }), steps: [{ name: 's', run: () => {} }] };\n`);
      const r = await runCli(['run', 'bigint-cli', '--param', 'id=5', '--jobs-dir', dir, '--migrations-dir', FIXTURE_MIGRATIONS], { url });
      expect(r.stderr).toBe(`idem: error: ${MESSAGE('bigint-cli')}\n`);
      expect(r.code).toBe(2);
      expect(await runsOf('bigint-cli')).toBe(0);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('Runner.connect given a pool or timeout it cannot work with (B2 round 15)', () => {
  it('refuses it before connecting, naming the bound and why', async () => {
    const need = 'a run needs a connection per concurrent chunk plus 2 (planning ahead, effects and control polls)';
    const cases: Array<[Record<string, unknown>, string]> = [
      [{ poolSize: 1 }, `poolSize must be an integer >= 3: ${need} (got 1)`],
      [{ poolSize: 2 }, `poolSize must be an integer >= 3: ${need} (got 2)`],
      [{ poolSize: 0 }, `poolSize must be an integer >= 3: ${need} (got 0)`],
      [{ poolSize: -3 }, `poolSize must be an integer >= 3: ${need} (got -3)`],
      [{ poolSize: 1.5 }, `poolSize must be an integer >= 3: ${need} (got 1.5)`],
      [{ lockIdleTimeoutMs: -1 }, "lockIdleTimeoutMs must be 0 (off) or an integer of at least 20000 ms, ten of the lock's 2 s checks (got -1)"],
      [{ idleInTransactionTimeoutMs: -5 }, 'idleInTransactionTimeoutMs must be an integer number of ms >= 0, 0 turning it off (got -5)'],
      [{ readOnly: 'yes' }, 'readOnly must be true or false (got "yes")'],
      [{ schema: 5 }, 'schema must be a string (got 5)'],
    ];
    for (const [opts, problem] of cases) {
      const started = Date.now();
      const err = await rejectionOf(Runner.connect({ connectionString: url, schema: 'never_made', ...opts } as never));
      expect(err, JSON.stringify(opts)).toBeInstanceOf(UsageError);
      expect((err as UsageError).code).toBe('idem.invalidOptions');
      expect(err.message).toBe(`Runner.connect(): invalid options: ${problem}`);
      expect(exitCodeOf(err)).toBe(2);
      expect(Date.now() - started).toBeLessThan(2_000);
    }
    // Nothing was created: the schema these runners would have made is not there.
    const [row] = await query<{ there: boolean }>(url, "select exists (select 1 from pg_namespace where nspname = 'never_made') as there");
    const there = row!.there;
    expect(there).toBe(false);
  });

  it('a top-level-await script given poolSize -1 ends with the one-line error, exit 2 (it exited 13 silently)', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'idem-pool-'));
    try {
      const index = new URL('../dist/index.js', import.meta.url).href;
      writeFileSync(
        join(dir, 'script.mjs'),
        `import { Runner, exitCodeOf } from ${JSON.stringify(index)};\ntry { await Runner.connect({ connectionString: process.env.DATABASE_URL, poolSize: -1 }); } catch (err) { console.error(err.message); process.exit(exitCodeOf(err)); }\n`,
      );
      const { spawnSync } = await import('node:child_process');
      const r = spawnSync(process.execPath, [join(dir, 'script.mjs')], { env: { ...process.env, DATABASE_URL: url }, encoding: 'utf8', timeout: 30_000 });
      expect(r.stderr).toContain('Runner.connect(): invalid options: poolSize must be an integer >= 3');
      expect(r.status).toBe(2);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('Runner.run given a signal already aborted (B2 round 15)', () => {
  it('throws InterruptedError (143) and writes no run', async () => {
    const calls = { n: 0 };
    const job = countingJob('pre-aborted', calls);
    const err = await rejectionOf(runner.run(job, { key: 'k', signal: AbortSignal.abort() }));
    expect(err).toBeInstanceOf(InterruptedError);
    expect(exitCodeOf(err)).toBe(143);
    expect(err.message).toMatch(/^stopped by the caller's AbortSignal \(This operation was aborted\)/);
    const migrated = await rejectionOf(runner.migrate([{ runKey: '0001', job }], { signal: AbortSignal.abort('SIGINT') }));
    expect(migrated).toBeInstanceOf(InterruptedError);
    expect(exitCodeOf(migrated)).toBe(130);
    expect(calls.n).toBe(0);
    expect(await runsOf('pre-aborted')).toBe(0);
  });
});

describe("a statement_timeout that cuts one of idem's own statements short, met through the library (black-box round 18, B8-3)", () => {
  // The CLI said these as its one-line refusal (exit 2, idem.statementTimeout); Runner.connect,
  // run and the operator methods threw PostgreSQL's bare 57014 "canceling statement due to
  // statement timeout" (exit 1, no idem code).
  const withOptions = (options: string) => {
    const u = new URL(url);
    u.searchParams.set('options', options);
    return u.toString();
  };
  const fromOptions = (where: string) =>
    `the database cancelled a statement of idem's at the statement_timeout set by -c statement_timeout in ${where}: it waited on a lock or ran longer; raise or remove -c statement_timeout in ${where} (a setting there overrides the role's and the database's), then run the same command again`;

  /** Runs `fn` while another session holds `table` in access exclusive mode. */
  async function whileLocked<T>(table: string, fn: () => Promise<T>): Promise<T> {
    const { default: pg } = await import('pg');
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      await holder.query(`set statement_timeout = 0; begin; lock table ${table} in access exclusive mode`);
      return await fn();
    } finally {
      await holder.query('rollback').catch(() => {});
      await holder.end();
    }
  }

  it('Runner.connect refuses as the CLI does, naming where the setting is (the URL\'s options, or the database\'s), exit 2', async () => {
    const viaOptions = await whileLocked('idem.idem_migration', () => rejectionOf(Runner.connect({ connectionString: withOptions('-c statement_timeout=300ms') })));
    expectUsage(viaOptions, 'idem.statementTimeout', fromOptions("the connection string's options"));
    const named = await whileLocked('idem.idem_migration', () =>
      rejectionOf(Runner.connect({ connectionString: withOptions('-c statement_timeout=300ms'), connectionSource: 'DATABASE_URL' })),
    );
    expectUsage(named, 'idem.statementTimeout', fromOptions("DATABASE_URL's options"));
    const dbName = new URL(url).pathname.slice(1);
    await query(url, `alter database ${dbName} set statement_timeout = '300ms'`);
    try {
      const viaDatabase = await whileLocked('idem.idem_migration', () => rejectionOf(Runner.connect({ connectionString: url })));
      expectUsage(
        viaDatabase,
        'idem.statementTimeout',
        "the database cancelled a statement of idem's at the statement_timeout set for the role or database (SHOW statement_timeout): it waited on a lock or ran longer; raise it for the role idem connects as (ALTER ROLE postgres SET statement_timeout = '5min') or reset it, then run the same command again",
      );
    } finally {
      await query(url, `alter database ${dbName} reset statement_timeout`);
    }
  });

  it('Runner.run, status, pause, cancel and reset refuse the same way, and write nothing', async () => {
    const calls = { n: 0 };
    const job = countingJob('st-lib', calls);
    const timed = await Runner.connect({ connectionString: withOptions('-c statement_timeout=300ms') });
    try {
      const ran = await whileLocked('idem.runs', () => rejectionOf(timed.run(job, { key: 'k' })));
      expectUsage(ran, 'idem.statementTimeout', fromOptions("the connection string's options"));
      for (const [what, call] of [
        ['status', () => timed.status('st-lib')],
        ['pause', () => timed.pause('st-lib', 'k')],
        ['cancel', () => timed.cancel('st-lib', 'k')],
        ['reset', () => timed.reset('st-lib', 'k')],
      ] as const) {
        const err = await whileLocked('idem.runs', () => rejectionOf((call as () => Promise<unknown>)()));
        expect([what, (err as UsageError).code, exitCodeOf(err), err.message]).toEqual([what, 'idem.statementTimeout', 2, fromOptions("the connection string's options")]);
      }
    } finally {
      await timed.close();
    }
    expect(calls.n).toBe(0);
    expect(await runsOf('st-lib')).toBe(0);
  });
});

describe('params JSON cannot hold faithfully: a function, a Symbol, a Map or Set, undefined in an array (black-box round 18, B8-4)', () => {
  // A function or Symbol as params threw `TypeError: Cannot read properties of undefined (reading
  // 'length')` (a job without params) or PostgreSQL's 23502 not-null violation (a validator passing
  // them through), exit 1; a Map, a Date or a Map nested in them was silently taken as `{}`.
  const FIX = 'as data (a string, number, boolean, null, array or plain object)';

  it('Runner.run refuses them given to a job without params, naming what is wrong and the fix, and writes nothing', async () => {
    const calls = { n: 0 };
    const job = countingJob('np-bad', calls);
    const cases: Array<[unknown, string]> = [
      [() => 1, `params is a function, which JSON cannot represent; pass it ${FIX} or leave it out`],
      [Symbol('s'), 'params is a Symbol, which JSON cannot represent; pass it as a string'],
      [new Map(), 'params is a Map, which JSON would turn into {}; pass it as a plain object (Object.fromEntries(map))'],
      [new Set([1]), 'params is a Set, which JSON would turn into {}; pass it as an array ([...set])'],
      [{ m: new Map([['a', 1]]) }, 'params.m is a Map, which JSON would turn into {}; pass it as a plain object (Object.fromEntries(map))'],
      [{ f: () => 1 }, `params.f is a function, which JSON cannot represent; pass it ${FIX} or leave it out`],
      [{ at: new Date(Number.NaN) }, 'params.at is an invalid Date, which JSON would turn into null; pass it as a valid Date or an ISO string'],
    ];
    for (const [params, problem] of cases) {
      const err = await rejectionOf(runner.run(job, { params, key: 'k' }));
      expectUsage(err, 'idem.invalidParams', `invalid params for job "np-bad": ${problem}`);
    }
    // A Date is no params object either (it was taken as {}).
    const dated = await rejectionOf(runner.run(job, { params: new Date(0), key: 'k' }));
    expectUsage(dated, 'idem.invalidParams', 'job "np-bad" takes no params, got "1970-01-01T00:00:00.000Z"; drop --params/--param');
    expect(calls.n).toBe(0);
    expect(await runsOf('np-bad')).toBe(0);
  });

  it("Runner.run refuses them when the job's validator returns them, and writes nothing", async () => {
    const calls = { n: 0 };
    const job = defineJob({ name: 'vp-bad', params: (raw: unknown) => raw as Record<string, unknown>, steps: [{ name: 's', run: () => void calls.n++ }] });
    const RETURN = 'have the params validator return it';
    const cases: Array<[unknown, string]> = [
      [() => 1, `params is a function, which JSON cannot represent; ${RETURN} ${FIX} or leave it out`],
      [Symbol('s'), `params is a Symbol, which JSON cannot represent; ${RETURN} as a string`],
      [{ m: new Map() }, `params.m is a Map, which JSON would turn into {}; ${RETURN} as a plain object (Object.fromEntries(map))`],
      [{ s: new Set() }, `params.s is a Set, which JSON would turn into {}; ${RETURN} as an array ([...set])`],
      [{ ids: [1, undefined] }, `params.ids[1] is undefined, which JSON would turn into null; ${RETURN} as null, or leave it out of the array`],
      [{ deep: { cb: () => 1 } }, `params.deep.cb is a function, which JSON cannot represent; ${RETURN} ${FIX} or leave it out`],
    ];
    for (const [params, problem] of cases) {
      const err = await rejectionOf(runner.run(job, { params, key: 'k' }));
      expectUsage(err, 'idem.invalidParams', `invalid params for job "vp-bad": ${problem}`);
    }
    const none = defineJob({ name: 'vp-none', params: () => undefined as unknown as Record<string, unknown>, steps: [{ name: 's', run: () => void calls.n++ }] });
    expectUsage(
      await rejectionOf(runner.run(none, { key: 'k' })),
      'idem.invalidParams',
      'invalid params for job "vp-none": the params validator returned undefined; have it return the params (an object)',
    );
    expect(calls.n).toBe(0);
    expect(await runsOf('vp-bad')).toBe(0);
    expect(await runsOf('vp-none')).toBe(0);
  });

  it('a Date is stored as its ISO string, and a key whose value is undefined as absent (what JSON makes of them)', async () => {
    const seen: unknown[] = [];
    const job = defineJob({ name: 'vp-date', params: (raw: unknown) => raw as Record<string, unknown>, steps: [{ name: 's', run: (ctx) => void seen.push(ctx.params) }] });
    const outcome = await runner.run(job, { params: { at: new Date(0), gone: undefined, n: 1 } });
    expect(outcome.status).toBe('succeeded');
    const [row] = await query<{ params: unknown; run_key: string }>(url, "select params, run_key from idem.runs where job = 'vp-date'");
    expect(row!.params).toEqual({ at: '1970-01-01T00:00:00.000Z', n: 1 });
    // The same params as JSON are the same run: found done, not run again.
    const again = await runner.run(job, { params: { at: '1970-01-01T00:00:00.000Z', n: 1 } });
    expect(again.runKey).toBe(row!.run_key);
    expect(seen).toHaveLength(1);
  });
});
