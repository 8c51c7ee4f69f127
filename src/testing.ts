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
import { codeOf } from './errors.ts';
import type { Job, Step } from './job.ts';
import { silentLogger } from './log.ts';
import { Runner } from './runner.ts';

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

async function withAdmin<T>(url: string, fn: (c: pg.Client) => Promise<T>): Promise<T> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return await fn(client);
  } finally {
    await client.end();
  }
}

/**
 * Runs `job` in every way idem promises to converge and asserts each ends in the clean run's
 * `snapshot`. Throws an Error naming the first scenario that differs, with a diff. See the module
 * comment for an example.
 */
export async function expectConvergent(job: Job, opts: ConvergenceOptions): Promise<ConvergenceReport> {
  const params = opts.params ?? {};
  const log = silentLogger();
  let adminUrl = opts.databaseUrl ?? process.env.DATABASE_URL;
  let release: (() => Promise<void>) | undefined;
  if (!adminUrl) {
    const { startEmbeddedPostgres } = await import('./embedded-postgres.ts');
    const server = await startEmbeddedPostgres({ dataDir: path.resolve('.idem', 'test-pg') });
    adminUrl = server.url;
    release = () => server.release();
  }
  const admin = adminUrl;

  /** A fresh database with the setup jobs run in it; the scenario gets connected runners on it. */
  const inFreshDatabase = async <T>(fn: (connect: () => Promise<Runner>) => Promise<T>): Promise<T> => {
    const name = `idem_kit_${randomBytes(6).toString('hex')}`;
    await withAdmin(admin, async (c) => {
      await c.query(`create database ${name}`).catch(async (err: unknown) => {
        if (codeOf(err) !== '42501') throw err;
        const { rows } = await c.query<{ role: string }>('select quote_ident(current_user) as role');
        throw new Error(
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
      for (const s of opts.setup ?? []) {
        const [setupJob, setupParams] = 'steps' in s ? [s, {}] : [s.job, s.params ?? {}];
        await first.run(setupJob, { key: 'setup', params: setupParams });
      }
      return await fn(connect);
    } finally {
      await Promise.all(runners.map((r) => r.close().catch(() => {})));
      await withAdmin(admin, (c) => c.query(`drop database if exists ${name} with (force)`)).catch(() => {});
    }
  };

  const scenarios: string[] = [];
  let clean: unknown;
  const check = async (scenario: string, body: (runner: Runner, connect: () => Promise<Runner>) => Promise<void>) => {
    scenarios.push(scenario);
    const got = await inFreshDatabase(async (connect) => {
      const runner = await connect();
      await body(runner, connect);
      return opts.snapshot(runner.db);
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
