/**
 * `idem/testing`: a convergence test kit for users' jobs. In a vitest or node:test test,
 *
 * @example
 * import { expectConvergent } from 'idem/testing';
 * import { sql } from 'idem';
 * import createTables from '../migrations/0001_create_tables.ts';
 * import totals from '../jobs/totals.ts';
 *
 * test('totals converges however it is run', async () => {
 *   await expectConvergent(totals, {
 *     setup: [createTables],
 *     snapshot: async (db) => (await sql`select * from totals order by day`.execute(db)).rows,
 *   });
 * });
 *
 * runs the job against a real PostgreSQL in every way idem promises to converge (a clean run; the
 * same run twice; N concurrent invocations; a crash before and after each chunk's work, then a
 * rerun; a new run key after a finished run), each in a fresh database, and compares the user's
 * `snapshot(db)` of the end state with the clean run's, failing with a diff that names the scenario.
 */
import { randomBytes } from 'node:crypto';
import path from 'node:path';
import { isDeepStrictEqual } from 'node:util';
import { diffArrays } from 'diff';
import { sql, type Kysely } from 'kysely';
import pg from 'pg';
import { describeConnectError, redactError, refuseUnsupportedUrl } from './database.ts';
import { codeOf, IdemError, messageOf, UsageError } from './errors.ts';
import { assertJob, validateParams, type Job, type Step } from './job.ts';
import { silentLogger } from './log.ts';
import { Runner } from './runner.ts';
import { unknownKeys } from './suggest.ts';

export interface ConvergenceOptions {
  /** The job's params. Defaults to `{}`. */
  readonly params?: unknown;
  /** The end state to compare: any JSON-like value, e.g. the rows of the tables the job writes, in a stable order. */
  readonly snapshot: (db: Kysely<any>) => Promise<unknown>;
  /** Jobs run once, in order, in each fresh database before the scenario (typically the migrations, then seed data). Defaults to none. */
  readonly setup?: ReadonlyArray<Job | { readonly job: Job; readonly params?: unknown }>;
  /** Invocations started at once in the concurrent scenario. Defaults to `3`. */
  readonly concurrency?: number;
  /** At most this many chunk boundaries get a crash scenario (each boundary twice: before and after its work). Defaults to `20`. */
  readonly maxCrashPoints?: number;
  /**
   * A server to create the scenario databases in (a superuser URL). Defaults to `DATABASE_URL`,
   * else an embedded PostgreSQL under `.idem/test-pg/` (started on first use, stopped after).
   */
  readonly databaseUrl?: string;
}

/** What `expectConvergent` ran, for a test that wants to assert more. */
export interface ConvergenceReport {
  /** Every scenario, by name, in the order run. */
  readonly scenarios: readonly string[];
  /** The clean run's snapshot, which every scenario matched. */
  readonly snapshot: unknown;
}

/** Thrown by the kit at an injected crash point: the chunk's transaction rolls back, as it would if the process died there. */
class InjectedCrash extends Error {
  constructor(where: string) {
    super(`idem/testing: injected crash ${where}`);
    this.name = 'InjectedCrash';
  }
}

/** A copy of the job whose step code throws at the n-th chunk boundary (counted across steps), before or after the chunk's work. */
function crashingAt(job: Job, n: number, when: 'before' | 'after'): Job {
  let hits = 0;
  const steps = job.steps.map((step: Step) => ({
    ...step,
    // Retrying would hide the crash; the rerun is the recovery under test. A crash stops the run:
    // a step's tolerance for failed chunks must not skip past it and go on.
    retry: { ...(step.retry ?? {}), attempts: 1 },
    maxFailedChunks: 0,
    async run(ctx: unknown, chunk?: unknown) {
      const here = ++hits === n;
      if (here && when === 'before') throw new InjectedCrash(`before the work of chunk boundary ${n}`);
      const result = await (step.run as (c: unknown, k?: unknown) => unknown)(ctx, chunk);
      if (here && when === 'after') throw new InjectedCrash(`after the work of chunk boundary ${n}, before its commit`);
      return result;
    },
  }));
  return Object.freeze({ ...job, steps }) as unknown as Job;
}

/**
 * A readable line diff of two JSON values: `-` the clean run, `+` the scenario, each change with
 * the three lines around it (so a changed field is shown with its row) and `…` where equal lines
 * are left out. Lines are matched by a longest common subsequence, so an extra or a missing row is
 * one block, not a difference on every line after it. At most 40 changed lines are shown.
 */
export function diffSnapshots(expected: unknown, actual: unknown): string {
  const a = (JSON.stringify(expected, null, 2) ?? 'undefined').split('\n');
  const b = (JSON.stringify(actual, null, 2) ?? 'undefined').split('\n');
  const ops = lineDiff(a, b);
  const CONTEXT = 3;
  const MAX_CHANGES = 40;
  const near = new Array<boolean>(ops.length).fill(false);
  ops.forEach((op, i) => {
    if (op.kind === ' ') return;
    for (let j = Math.max(0, i - CONTEXT); j <= Math.min(ops.length - 1, i + CONTEXT); j++) near[j] = true;
  });
  const out: string[] = [];
  let changes = 0;
  let skipped = false;
  for (let i = 0; i < ops.length; i++) {
    if (!near[i]) {
      skipped = true;
      continue;
    }
    if (skipped && out.length > 0) out.push('  …');
    skipped = false;
    const op = ops[i]!;
    out.push(`${op.kind} ${op.line}`);
    if (op.kind !== ' ' && ++changes >= MAX_CHANGES) {
      out.push('  …');
      break;
    }
  }
  return out.join('\n');
}

interface DiffOp {
  readonly kind: ' ' | '-' | '+';
  readonly line: string;
}

/** The line diff, by jsdiff's Myers diff (the one `git diff` uses). */
function lineDiff(a: string[], b: string[]): DiffOp[] {
  return diffArrays(a, b).flatMap((part) => part.value.map((line): DiffOp => ({ kind: part.added ? '+' : part.removed ? '-' : ' ', line })));
}

/** Every key of ConvergenceOptions; any other is refused (a typo such as `databaseURL` would otherwise do nothing). */
const OPTION_KEYS: ReadonlyArray<keyof ConvergenceOptions> = ['params', 'snapshot', 'setup', 'concurrency', 'maxCrashPoints', 'databaseUrl'];

/** What the caller gave as a job: validated as the loader validates a job file's export, or refused naming what it is. */
function givenJob(value: unknown, where: string): Job {
  if (value === null || typeof value !== 'object') {
    throw new UsageError('invalidJob', `expectConvergent(job, options): ${where} is ${value === null ? 'null' : typeof value === 'undefined' ? 'undefined' : `a ${typeof value}`}, not a job; pass a job made with defineJob() (a job file's default export)`);
  }
  return assertJob(value, 'expectConvergent()');
}

/**
 * The options' problems, all together as defineJob reports a definition's, before anything
 * connects: a mistyped key, a missing snapshot, counts that are not counts, setup entries that are
 * not jobs.
 */
function checkOptions(opts: unknown): { setup: Array<{ job: Job; params: unknown }> } {
  if (opts === null || typeof opts !== 'object') {
    throw new UsageError('invalidOptions', 'expectConvergent(job, options): options must be an object with at least snapshot: (db) => the end state to compare');
  }
  const o = opts as Partial<Record<keyof ConvergenceOptions, unknown>>;
  const problems = unknownKeys(o, OPTION_KEYS, '');
  if (typeof o.snapshot !== 'function') problems.push('snapshot must be a function (db) => the end state to compare');
  if (o.concurrency !== undefined && !(Number.isInteger(o.concurrency) && (o.concurrency as number) >= 1)) problems.push(`concurrency must be an integer of at least 1 (got ${shown(o.concurrency)})`);
  if (o.maxCrashPoints !== undefined && !(Number.isInteger(o.maxCrashPoints) && (o.maxCrashPoints as number) >= 0)) problems.push(`maxCrashPoints must be an integer >= 0 (got ${shown(o.maxCrashPoints)})`);
  if (o.databaseUrl !== undefined && typeof o.databaseUrl !== 'string') problems.push(`databaseUrl must be a postgres:// URL string (got ${typeof o.databaseUrl})`);
  if (o.setup !== undefined && !Array.isArray(o.setup)) problems.push('setup must be an array of jobs or { job, params }');
  if (problems.length > 0) throw new UsageError('invalidOptions', `expectConvergent(job, options): invalid options: ${problems.join('; ')}`);
  const setup = ((o.setup ?? []) as unknown[]).map((s, i) => {
    const entry = s !== null && typeof s === 'object' && !('steps' in s) && 'job' in s ? (s as { job: unknown; params?: unknown }) : { job: s, params: {} };
    return { job: givenJob(entry.job, `setup[${i}]`), params: entry.params ?? {} };
  });
  return { setup };
}

function shown(value: unknown): string {
  return typeof value === 'string' ? JSON.stringify(value) : String(value);
}

/**
 * Opens a session on the server the scenario databases are created on; not reaching it (refused,
 * a wrong password, no such database) is said as Runner.connect says it, naming `source`.
 */
async function withAdmin<T>(url: string, source: string, fn: (c: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: url });
  client.on('error', () => {});
  await client.connect().catch(async (err: unknown) => {
    await client.end().catch(() => {});
    throw describeConnectError(err, url, source);
  });
  try {
    return await fn(client);
  } finally {
    await client.end();
  }
}

/** How old a scenario database must be before a later kit takes it for a leftover. */
const LEFTOVER_AFTER_SECONDS = 3600;

/**
 * Drops the scenario databases an earlier kit left behind (its test timed out, its process was
 * killed before the scenario's finally ran): those created over an hour ago that no session uses.
 * A database in use, or one that another role owns, is left as it is.
 */
async function dropLeftoverDatabases(c: pg.Client): Promise<void> {
  const { rows } = await c.query<{ datname: string }>(
    `select datname from pg_database d where datname ~ '^idem_kit_[0-9a-z]+_[0-9a-f]{12}$'
      and not exists (select 1 from pg_stat_activity a where a.datid = d.oid)`,
  );
  const now = Date.now() / 1000;
  for (const { datname } of rows) {
    const created = parseInt(datname.split('_')[2]!, 36);
    if (!(now - created > LEFTOVER_AFTER_SECONDS)) continue;
    await c.query(`drop database if exists ${datname}`).catch(() => {});
  }
}

/**
 * Runs `job` in every way idem promises to converge and asserts each ends in the clean run's
 * `snapshot`. Throws an Error naming the first scenario that differs, with a diff. See the module
 * comment for an example.
 */
export async function expectConvergent(given: Job, opts: ConvergenceOptions): Promise<ConvergenceReport> {
  // Bad input is refused before anything connects or is created, in the words the CLI and
  // Runner.connect use (one line, the fix, an IdemError with its exit code), not as the TypeError
  // or pg error it would meet later.
  const job = givenJob(given, 'job');
  const { setup } = checkOptions(opts);
  const params = opts.params ?? {};
  await validateParams(job, params);
  for (const [i, s] of setup.entries()) {
    await validateParams(s.job, s.params).catch((err: unknown) => {
      throw err instanceof IdemError ? new UsageError('invalidParams', `expectConvergent(): setup[${i}]: ${err.message}`, { cause: err }) : err;
    });
  }
  const log = silentLogger();
  const source = opts.databaseUrl !== undefined ? 'databaseUrl' : 'DATABASE_URL';
  let adminUrl = (opts.databaseUrl ?? process.env.DATABASE_URL)?.trim();
  if (adminUrl) refuseUnsupportedUrl(adminUrl, source);
  let release: (() => Promise<void>) | undefined;
  if (!adminUrl) {
    const { startEmbeddedPostgres } = await import('./embedded-postgres.ts');
    const server = await startEmbeddedPostgres({ dataDir: path.resolve('.idem', 'test-pg') });
    adminUrl = server.url;
    release = () => server.release();
  }
  const admin = adminUrl;

  /** A fresh database with the setup jobs run in it; the scenario gets connected runners on it. */
  let swept = false;
  const inFreshDatabase = async <T>(fn: (connect: () => Promise<Runner>) => Promise<T>): Promise<T> => {
    // Named with its creation time (seconds, base 36), so a later kit can tell a leftover from a
    // scenario under way in another process.
    const name = `idem_kit_${Math.floor(Date.now() / 1000).toString(36)}_${randomBytes(6).toString('hex')}`;
    await withAdmin(admin, source, async (c) => {
      if (!swept) {
        swept = true;
        await dropLeftoverDatabases(c);
      }
      await c.query(`create database ${name}`).catch(async (err: unknown) => {
        if (codeOf(err) !== '42501') throw err;
        const { rows } = await c.query<{ role: string }>('select quote_ident(current_user) as role');
        throw new UsageError(
          'cannotCreateDatabase',
          `expectConvergent(): role ${rows[0]!.role} may not create databases (${(err as Error).message}), and each scenario runs in a database of its own created on databaseUrl: ALTER ROLE ${rows[0]!.role} CREATEDB, or pass the databaseUrl of a role that may`,
          { cause: err },
        );
      });
    });
    const url = new URL(admin);
    url.pathname = `/${name}`;
    const runners: Runner[] = [];
    const connect = async () => {
      const r = await Runner.connect({ connectionString: url.toString(), log });
      runners.push(r);
      return r;
    };
    try {
      const first = await connect();
      for (const s of setup) await first.run(s.job, { key: 'setup', params: s.params });
      return await fn(connect);
    } finally {
      await Promise.all(runners.map((r) => r.close().catch(() => {})));
      await withAdmin(admin, source, (c) => c.query(`drop database if exists ${name} with (force)`)).catch(() => {});
    }
  };

  const scenarios: string[] = [];
  let clean: unknown;
  const check = async (scenario: string, body: (runner: Runner, connect: () => Promise<Runner>) => Promise<void>) => {
    scenarios.push(scenario);
    const got = await inFreshDatabase(async (connect) => {
      const runner = await connect();
      await body(runner, connect);
      try {
        return await opts.snapshot(runner.db);
      } catch (thrown) {
        const err = redactError(thrown, admin);
        // The user's query (a table it names that the job never creates, a typo): which scenario, and
        // that the snapshot is what to fix, not a bare pg error that reads as idem's own.
        throw new UsageError(
          'invalidSnapshot',
          `expectConvergent(): snapshot(db) threw in scenario "${scenario}": ${messageOf(err)}; fix the snapshot, which reads each scenario's fresh database after setup and the job ran`,
          { cause: err },
        );
      }
    });
    if (scenario === 'a clean run') {
      clean = got;
      return;
    }
    if (!isDeepStrictEqual(got, clean)) {
      throw new Error(`job "${job.name}" did not converge in scenario "${scenario}": its end state differs from a clean run's (- clean run, + ${scenario}):\n${diffSnapshots(clean, got)}`);
    }
  };

  try {
    let boundaries = 0;
    await check('a clean run', async (runner) => {
      const out = await runner.run(job, { params, key: 'kit' });
      boundaries = out.summary?.chunks ?? 0;
    });
    await check('the same run twice', async (runner) => {
      await runner.run(job, { params, key: 'kit' });
      await runner.run(job, { params, key: 'kit' });
    });
    const n = opts.concurrency ?? 3;
    await check(`${n} concurrent invocations`, async (_runner, connect) => {
      const runners = await Promise.all(Array.from({ length: n }, () => connect()));
      await Promise.all(runners.map((r) => r.run(job, { params, key: 'kit', wait: true })));
    });
    const points = Math.min(boundaries, opts.maxCrashPoints ?? 20);
    for (let b = 1; b <= points; b++) {
      for (const when of ['before', 'after'] as const) {
        await check(`a crash ${when} the work of chunk ${b} of ${boundaries}, then a rerun`, async (runner) => {
          const crashed = await runner.run(crashingAt(job, b, when), { params, key: 'kit' }).then(
            () => null,
            (err: unknown) => err,
          );
          if (crashed === null) throw new Error(`idem/testing: the crash injected ${when} chunk ${b} did not stop the run`);
          await runner.run(job, { params, key: 'kit', retrySkipped: true });
        });
      }
    }
    await check('a new run key after a finished run', async (runner) => {
      await runner.run(job, { params, key: 'kit' });
      await runner.run(job, { params, key: 'kit-again' });
    });
    return { scenarios, snapshot: clean };
  } finally {
    await release?.();
  }
}

export { sql };
