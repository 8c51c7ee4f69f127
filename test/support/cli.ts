import { spawn, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { expect } from 'vitest';

/** The repository root: the CLI runs from here, as a user would run it. */
export const REPO = fileURLToPath(new URL('../../', import.meta.url));
export const BIN = fileURLToPath(new URL('../../bin/idem.js', import.meta.url));
export const FIXTURE_JOBS = fileURLToPath(new URL('../fixtures/jobs', import.meta.url));
export const FIXTURE_MIGRATIONS = fileURLToPath(new URL('../fixtures/migrations', import.meta.url));
export const BROKEN_JOBS = fileURLToPath(new URL('../fixtures/broken-jobs', import.meta.url));
/** Global flags pointing the CLI at the test fixtures. */
export const FIXTURE_DIRS = ['--jobs-dir', FIXTURE_JOBS, '--migrations-dir', FIXTURE_MIGRATIONS];
/** The `stall` job (test/fixtures/stall-jobs): chunks that sleep or block in JavaScript inside their transaction. */
export const STALL_DIRS = ['--jobs-dir', fileURLToPath(new URL('../fixtures/stall-jobs', import.meta.url)), '--migrations-dir', FIXTURE_MIGRATIONS];

export interface CliResult {
  /** Exit code, or null when the process died of a signal. */
  readonly code: number | null;
  readonly signal: NodeJS.Signals | null;
  readonly stdout: string;
  readonly stderr: string;
  /** Wall time from spawn to exit. */
  readonly ms: number;
  /** Date.now() when the process had exited. */
  readonly endedAt: number;
  /** True when the helper killed the process because it outlived its timeout. */
  readonly timedOut: boolean;
}

export interface CliProcess {
  readonly child: ChildProcess;
  readonly pid: number;
  /** Resolves when the process has exited and its output is complete. */
  readonly done: Promise<CliResult>;
  /** Output so far. */
  stdout(): string;
  stderr(): string;
}

export interface SpawnOptions {
  /** DATABASE_URL for the child; omitted: none (the CLI would start its embedded server). */
  readonly url?: string;
  /** Extra environment. */
  readonly env?: Record<string, string | undefined>;
  /** Working directory. Defaults to the repository root. */
  readonly cwd?: string;
  /** Killed with SIGKILL after this long. Defaults to 60 s. */
  readonly timeoutMs?: number;
  /** A command that runs node in its turn (`unshare … --`), before `node bin/idem.js`. */
  readonly prefix?: readonly string[];
}

/** Every child spawned by this module and not yet exited, so afterAll can kill what a failed test left. */
const live = new Set<ChildProcess>();

/** Starts `node bin/idem.js <args>` in the repo root. */
export function spawnCli(args: readonly string[], opts: SpawnOptions = {}): CliProcess {
  const env: NodeJS.ProcessEnv = { ...process.env, ...opts.env };
  delete env.NODE_OPTIONS;
  delete env.DATABASE_URL;
  if (!opts.env || !('IDEM_FAULT' in opts.env)) delete env.IDEM_FAULT;
  if (opts.url !== undefined) env.DATABASE_URL = opts.url;
  for (const [k, v] of Object.entries(env)) if (v === undefined) delete env[k];
  const started = performance.now();
  const [command, ...rest] = [...(opts.prefix ?? []), process.execPath, BIN, ...args];
  const child = spawn(command!, rest, { cwd: opts.cwd ?? REPO, env, stdio: ['ignore', 'pipe', 'pipe'] });
  live.add(child);
  let out = '';
  let err = '';
  child.stdout!.setEncoding('utf8').on('data', (s: string) => (out += s));
  child.stderr!.setEncoding('utf8').on('data', (s: string) => (err += s));
  let timedOut = false;
  const timer = setTimeout(() => {
    timedOut = true;
    child.kill('SIGKILL');
  }, opts.timeoutMs ?? 60_000);
  const done = new Promise<CliResult>((resolve, reject) => {
    child.on('error', (e) => {
      clearTimeout(timer);
      live.delete(child);
      reject(e);
    });
    // 'close' (not 'exit'): the output streams are drained by then.
    child.on('close', (code, signal) => {
      clearTimeout(timer);
      live.delete(child);
      resolve({ code, signal, stdout: out, stderr: err, ms: Math.round(performance.now() - started), endedAt: Date.now(), timedOut });
    });
  });
  return { child, pid: child.pid!, done, stdout: () => out, stderr: () => err };
}

/** Runs `node bin/idem.js <args>` to completion. */
export function runCli(args: readonly string[], opts: SpawnOptions = {}): Promise<CliResult> {
  return spawnCli(args, opts).done;
}

/** SIGKILLs every child this module started that is still alive (afterAll of process tests). */
export async function killLeftovers(): Promise<void> {
  const waits = [...live].map(
    (child) =>
      new Promise<void>((resolve) => {
        child.once('close', () => resolve());
        child.kill('SIGKILL');
      }),
  );
  await Promise.all(waits);
}

/**
 * The process died of a SIGKILL the test (or the process itself) sent, not of the helper's
 * time-out kill: a hang must fail the test, never pass for the expected crash.
 */
export function expectKilled(r: CliResult): void {
  expect(r.timedOut, `the process hung until the helper's time-out killed it: ${r.stderr}`).toBe(false);
  expect(r.signal, r.stderr).toBe('SIGKILL');
}

/** The process crashed at the IDEM_FAULT point it was given, and nowhere else. */
export function expectFaultCrash(r: CliResult, point: string): void {
  expectKilled(r);
  expect(r.stderr).toContain(`idem: fault injected at ${point} (crash)`);
}

/** The non-empty lines of a stream's output. */
export const lines = (text: string) => text.split('\n').filter((l) => l.trim() !== '');

/** The JSON log lines (pino, on stderr when it is not a terminal) of a CLI run. */
export function logLines(stderr: string): Array<{ level: number; time: number; msg: string; [k: string]: unknown }> {
  return lines(stderr)
    .filter((l) => l.startsWith('{'))
    .map((l) => JSON.parse(l));
}

/**
 * The message of the busy exit (75): logged at info (level 30) as "busy: …", not as an
 * `idem: error:` line, so cron stays quiet. Undefined when there is none.
 */
export function busyMessage(stderr: string): string | undefined {
  return logLines(stderr).find((l) => l.level === 30 && l.msg.startsWith('busy: '))?.msg;
}

export async function query<R extends pg.QueryResultRow = any>(url: string, text: string, values: unknown[] = []): Promise<R[]> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return (await client.query<R>(text, values)).rows;
  } finally {
    await client.end();
  }
}

/**
 * Every row of each table, as JSON text in a stable order (null for a table that does not exist):
 * compare two snapshots to prove an operation changed nothing, timestamps included.
 */
export async function snapshot(url: string, tables: readonly string[]): Promise<Record<string, string[] | null>> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    const result: Record<string, string[] | null> = {};
    for (const table of tables) {
      const { rows: exists } = await client.query<{ t: string | null }>('select to_regclass($1)::text as t', [table]);
      if (!exists[0]?.t) {
        result[table] = null;
        continue;
      }
      const { rows } = await client.query<{ r: string }>(`select to_jsonb(t)::text as r from ${table} t order by 1`);
      result[table] = rows.map((x) => x.r);
    }
    return result;
  } finally {
    await client.end();
  }
}

/** idem's own tables and the fixtures' tables: what "changes nothing" is checked against. */
export const ALL_TABLES = ['idem.runs', 'idem.steps', 'idem.chunks', 'work_log', 'counted_state', 'items'] as const;

/** Polls until fn returns a truthy value (returned), or throws after timeoutMs. */
export async function waitFor<T>(fn: () => Promise<T>, what: string, { timeoutMs = 20_000, intervalMs = 50 } = {}): Promise<NonNullable<T>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await fn();
    if (v) return v as NonNullable<T>;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

/**
 * Holds the `gates` row `name` with `for update` in an open transaction: every chunk that passes
 * this gate (`for share`) blocks until release(). Deterministic overlap, no timing guesses.
 */
export async function holdGate(url: string, name: string): Promise<{ release(): Promise<void> }> {
  const client = new pg.Client({ connectionString: url, application_name: 'test-gate' });
  await client.connect();
  await client.query('insert into gates (name) values ($1) on conflict do nothing', [name]);
  await client.query('begin');
  await client.query('select 1 from gates where name = $1 for update', [name]);
  let released: Promise<void> | undefined;
  return {
    release: () =>
      (released ??= (async () => {
        await client.query('commit');
        await client.end();
      })()),
  };
}

/** How many sessions with this application_name are connected to the database of `url`. */
export async function sessions(url: string, applicationName: string): Promise<number> {
  const rows = await query<{ n: number }>(
    url,
    // A lock session is named `idem-lock host:pid`.
    `select count(*)::int as n from pg_stat_activity where datname = current_database() and (application_name = $1 or application_name like $1 || ' %')`,
    [applicationName],
  );
  return rows[0]!.n;
}

/**
 * How many sessions of the database of `url` wait on a lock (a row lock: a chunk at its gate), or,
 * with `applicationName`, only those named after it (`idem` counts a worker's work sessions,
 * `idem host:pid`). Its own database only: test files share the one test server.
 */
export async function lockWaiters(url: string, applicationName?: string): Promise<number> {
  const rows = await query<{ n: number }>(
    url,
    `select count(*)::int as n from pg_stat_activity where datname = current_database() and wait_event_type = 'Lock' and ($1::text is null or application_name like $1 || ' %')`,
    [applicationName ?? null],
  );
  return rows[0]!.n;
}

/** work_log rows per chunk key for one run key (job steps log 'step'). */
export async function workCounts(url: string, runKey: string, step = 'work'): Promise<Map<string, number>> {
  const rows = await query<{ chunk_key: string; n: number }>(
    url,
    'select chunk_key, count(*)::int as n from work_log where run_key = $1 and step = $2 group by chunk_key order by chunk_key',
    [runKey, step],
  );
  return new Map(rows.map((r) => [r.chunk_key, r.n]));
}

/** The idem.runs row of (job, run key), or undefined. */
export async function runRow(url: string, job: string, runKey: string): Promise<any> {
  const rows = await query(url, 'select * from idem.runs where job = $1 and run_key = $2', [job, runKey]);
  return rows[0];
}

/** The idem.chunks rows of (job, run key) for one step, in plan order. */
export async function chunkRows(url: string, job: string, runKey: string, step: string): Promise<any[]> {
  return query(
    url,
    `select c.* from idem.chunks c join idem.runs r on r.id = c.run_id
      where r.job = $1 and r.run_key = $2 and c.step = $3 order by c.seq`,
    [job, runKey, step],
  );
}

/**
 * The end state of a `counted` run, without what differs between two clean runs (ids, times, the
 * key itself): compare two runs to prove they converged. `withAttempts` also compares which attempt
 * committed each chunk (equal for two undisturbed runs, not for a crashed and a clean one).
 */
export async function endState(url: string, runKey: string, { withAttempts }: { withAttempts: boolean }) {
  const state = await query(url, `select chunk_key, value from counted_state where run_key = $1 order by chunk_key`, [runKey]);
  const chunks = (await chunkRows(url, 'counted', runKey, 'work')).map((c) => ({
    key: c.key,
    seq: c.seq,
    spec: c.spec,
    done: c.done_at !== null,
    ...(withAttempts ? { doneAttempt: c.done_attempt } : {}),
  }));
  const steps = await query(url, `select s.name, s.position, s.status, s.cursor, s.planned, s.planned_all from idem.steps s join idem.runs r on r.id = s.run_id where r.run_key = $1 order by s.position`, [runKey]);
  const row = await runRow(url, 'counted', runKey);
  const log = await query(url, `select step, chunk_key, count(*)::int as n from work_log where run_key = $1 group by 1, 2 order by 1, 2`, [runKey]);
  const run = { status: row.status, error: row.error, summaryChunks: row.summary?.chunks, summarySteps: row.summary?.steps, ...(withAttempts ? { attempt: row.attempt } : {}) };
  return { state, chunks, steps, run, log };
}
