/**
 * `npm start`: a tour of idem with real `node bin/idem.js …` child processes against an embedded
 * PostgreSQL (no database to install). Every command is printed with its exit code and stdout.
 *
 * The demo keeps its own cluster in .idem/demo/pg (apart from the CLI's default .idem/pg, whose
 * connection.json and postgres.log live in .idem/) and recreates the database `idem_demo` on each
 * start, so it can be run again and again.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { startEmbeddedPostgres, type EmbeddedServer } from '../src/embedded-postgres.ts';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const BIN = path.join(ROOT, 'bin', 'idem.js');
const DATA_DIR = path.join(ROOT, '.idem', 'demo', 'pg');
const DB_NAME = 'idem_demo';
const JOB = 'reservation-daily-totals';
/** No single idem command in this demo should take this long; a hung child is killed. */
const CHILD_TIMEOUT_MS = 60_000;
/** The whole demo takes about 25 s on an idle machine, about a minute on a busy one. */
const DEMO_TIMEOUT_MS = 180_000;

interface Result {
  readonly code: number | null;
  readonly signal: NodeJS.Signals | null;
  readonly stdout: string;
  readonly stderr: string;
  readonly ms: number;
}

const live = new Map<ChildProcess, Promise<Result>>();
let server: EmbeddedServer | undefined;
let admin: pg.Client | undefined;
let databaseUrl = '';
let section = 0;
/** Set on SIGINT/SIGTERM: the demo's own flow goes quiet while the handler cleans up. */
let stopping = false;

const say = (line = '') => process.stdout.write(`${line}\n`);
const out = (line = '') => {
  if (!stopping) say(line);
};
const indent = (text: string, prefix = '    ') =>
  text
    .trimEnd()
    .split('\n')
    .filter((l) => l !== '')
    .map((l) => prefix + l)
    .join('\n');

function heading(title: string, why: string): void {
  out();
  out(`${++section}. ${title}`);
  out(`   ${why}`);
}

/** Starts `node bin/idem.js <args>` with the demo's DATABASE_URL; resolves when it exits (or is killed on timeout). */
function startIdem(args: readonly string[]): { child: ChildProcess; done: Promise<Result> } {
  const started = performance.now();
  const child = spawn(process.execPath, [BIN, ...args], {
    cwd: ROOT,
    env: { ...process.env, DATABASE_URL: databaseUrl },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  
  let stdout = '';
  let stderr = '';
  child.stdout!.on('data', (b: Buffer) => (stdout += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (stderr += b.toString()));
  const timer = setTimeout(() => child.kill('SIGKILL'), CHILD_TIMEOUT_MS);
  const done = new Promise<Result>((resolve, reject) => {
    child.on('error', reject);
    child.on('close', (code, signal) => {
      clearTimeout(timer);
      live.delete(child);
      resolve({ code, signal, stdout, stderr, ms: performance.now() - started });
    });
  });
  live.set(child, done);
  return { child, done };
}

const shown = (args: readonly string[]) => `$ node bin/idem.js ${args.map((a) => (/^[\w./:=,-]+$/.test(a) ? a : `'${a}'`)).join(' ')}`;

/** Log lines are JSON on a pipe; show them as one short line each. */
function formatStderr(stderr: string): string {
  return stderr
    .trimEnd()
    .split('\n')
    .filter((l) => l !== '')
    .map((line) => {
      try {
        const { level, msg, time: _t, pid: _p, hostname: _h, job: _j, runKey: _k, ...rest } = JSON.parse(line) as Record<string, unknown>;
        const name = ({ 10: 'trace', 20: 'debug', 30: 'info', 40: 'warn', 50: 'error', 60: 'fatal' } as Record<string, string>)[String(level)] ?? String(level);
        const fields = Object.entries(rest).map(([k, v]) => `${k}=${typeof v === 'string' ? v : JSON.stringify(v)}`);
        return `    log ${name}: ${msg as string}${fields.length ? ` (${fields.join(' ')})` : ''}`;
      } catch {
        return `    stderr: ${line}`;
      }
    })
    .join('\n');
}

function describeExit(r: Result): string {
  return r.code !== null ? `exit ${r.code}` : `killed by ${r.signal}`;
}

/** Runs one command, prints it, its stdout, its stderr (condensed) and its exit code. */
async function idem(args: readonly string[]): Promise<Result> {
  out(shown(args));
  const r = await startIdem(args).done;
  if (r.stdout.trim()) out(indent(r.stdout));
  if (r.stderr.trim()) out(formatStderr(r.stderr));
  out(`    → ${describeExit(r)}`);
  return r;
}

async function query<R extends pg.QueryResultRow>(text: string, values: unknown[] = [], show = true): Promise<R[]> {
  // Shown with the values inlined, as one would type it into psql.
  if (show) out(`sql> ${text.replace(/\s+/g, ' ').trim().replace(/\$(\d+)/g, (_, i: string) => `'${String(values[Number(i) - 1])}'`)}`);
  const { rows } = await admin!.query<R>(text, values);
  return rows;
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

async function waitFor(what: string, timeoutMs: number, check: () => Promise<boolean>): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs / 1000} s waiting for ${what}`);
    await sleep(50);
  }
}

/** True when no idem process has a session open in the demo database. */
async function noIdemSessions(): Promise<boolean> {
  const { rows } = await admin!.query<{ n: number }>(
    `select count(*)::int as n from pg_stat_activity where datname = $1 and application_name in ('idem', 'idem-lock')`,
    [DB_NAME],
  );
  return rows[0]!.n === 0;
}

function expectExit(r: Result, code: number, what: string): void {
  if (r.code !== code) throw new Error(`${what}: expected exit ${code}, got ${describeExit(r)}\n${r.stderr}`);
}

async function setUp(): Promise<void> {
  out('idem demo: every command below is a real `node bin/idem.js` process; stdout is shown as printed,');
  out('log lines (stderr, JSON) are condensed to one line each.');
  out();
  out(`Starting the embedded PostgreSQL in ${path.relative(process.cwd(), DATA_DIR) || DATA_DIR} (the first run also runs initdb)…`);
  server = await startEmbeddedPostgres({ dataDir: DATA_DIR, onLog: (msg) => say(`    ${msg}`) });
  const adminUrl = new URL(server.url);
  admin = new pg.Client({ connectionString: adminUrl.toString(), application_name: 'idem-demo' });
  admin.on('error', () => {});
  await admin.connect();
  // WITH (FORCE): a previous demo killed half-way may have left sessions behind.
  await admin.query(`drop database if exists ${DB_NAME} with (force)`);
  await admin.query(`create database ${DB_NAME}`);
  await admin.end();
  adminUrl.pathname = `/${DB_NAME}`;
  databaseUrl = adminUrl.toString();
  admin = new pg.Client({ connectionString: databaseUrl, application_name: 'idem-demo' });
  admin.on('error', () => {});
  await admin.connect();
  const shownUrl = new URL(databaseUrl);
  shownUrl.password = '***';
  out(`    fresh database "${DB_NAME}"; the commands below get DATABASE_URL=${shownUrl}`);
}

async function demo(): Promise<void> {
  await setUp();
  const q = ['--log-level', 'warn'];

  heading('idem migrate, twice', 'Migrations run in file-name order, each once; the second call (every pod of a deploy may make it) finds them done.');
  expectExit(await idem(['migrate', ...q]), 0, 'migrate');
  expectExit(await idem(['migrate', ...q]), 0, 'second migrate');

  heading('idem run seed-demo-data, twice', 'Same job, same params: the second run is a no-op that prints the saved summary.');
  expectExit(await idem(['run', 'seed-demo-data', '--param', 'rows=20000', ...q]), 0, 'seed');
  expectExit(await idem(['run', 'seed-demo-data', '--param', 'rows=20000', ...q]), 0, 'second seed');

  heading('Ten overlapping invocations of one run', 'As if cron fired ten times: one process takes the advisory lock and works, the others exit 75 (busy) at once.');
  // info: a busy exit (75) is logged at info, not as an error, so --log-level warn would show nothing of it.
  const overlapArgs = ['run', JOB, '--key', 'demo-overlap', '--param', 'pauseMs=100', '--log-level', 'info'];
  out(`${shown(overlapArgs)}   (× 10, started together)`);
  const results = await Promise.all(Array.from({ length: 10 }, () => startIdem(overlapArgs).done));
  const tally = new Map<string, Result[]>();
  for (const r of results) tally.set(describeExit(r), [...(tally.get(describeExit(r)) ?? []), r]);
  const workerMs = Math.max(...results.filter((r) => r.code === 0).map((r) => r.ms));
  for (const [exit, rs] of [...tally].sort()) {
    const secs = rs.map((r) => r.ms / 1000);
    const when = rs.length === 1 ? `${secs[0]!.toFixed(1)} s` : `${Math.min(...secs).toFixed(1)}–${Math.max(...secs).toFixed(1)} s`;
    const note = exit === 'exit 75' && Math.max(...rs.map((r) => r.ms)) < workerMs ? ', while the one that worked was still running' : '';
    out(`    ${exit} × ${rs.length}   ended ${when} after launch${note}`);
  }
  out('    (most of those seconds are ten node + tsx processes starting at once)');
  if ((tally.get('exit 0')?.length ?? 0) > 1) out('    (an exit 0 beyond the first is a late starter that found the run already done)');
  const worker = results.find((r) => r.code === 0);
  const busy = results.find((r) => r.code === 75);
  if (worker) out(`    stdout of the one that worked:\n${indent(worker.stdout, '      ')}`);
  // Its stderr is not a terminal: pino's JSON lines. The message is what a terminal would show.
  const message = (line: string) => {
    try {
      return String((JSON.parse(line) as { msg?: unknown }).msg ?? line);
    } catch {
      return line;
    }
  };
  if (busy) out(`    stderr of one busy process (its log's message):\n${indent(busy.stderr.split('\n').filter(Boolean).map(message).join('\n'), '      ')}`);
  if (!worker) throw new Error('no invocation of the overlap run succeeded');
  const [totals] = await query<{ rows: number; total: string; reserved: string }>(
    `select count(*)::int as rows, sum(total_quantity)::text as total, (select sum(quantity) from reservations)::text as reserved from reservation_daily_totals`,
  );
  out(indent(`rows=${totals!.rows} sum(total_quantity)=${totals!.total} sum(reservations.quantity)=${totals!.reserved}`));
  out('    the totals match the reservations: ten invocations, one run\'s worth of work.');

  heading('A run killed mid-way, then resumed', 'SIGKILL after ~10 committed chunks (no chance to clean up); the rerun executes only the chunks that were not committed.');
  const crashArgs = ['run', JOB, '--key', 'demo-crash', '--param', 'pauseMs=150', ...q];
  out(`${shown(crashArgs)} &`);
  const crash = startIdem(crashArgs);
  const doneChunks = async () => {
    const rows = await query<{ n: number }>(
      `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id
       where r.job = $1 and r.run_key = $2 and c.done_at is not null`,
      [JOB, 'demo-crash'],
      false,
    );
    return rows[0]!.n;
  };
  await waitFor('10 committed chunks', 30_000, async () => (await doneChunks().catch(() => 0)) >= 10);
  crash.child.kill('SIGKILL');
  const killed = await crash.done;
  const before = await doneChunks();
  out(`$ kill -KILL ${crash.child.pid}    # ${describeExit(killed)}; ${before} chunks had committed`);
  // Postgres ends the dead process's sessions (and so frees its advisory lock) as soon as it sees the sockets close.
  await waitFor("the killed process's sessions to end", 10_000, noIdemSessions);
  expectExit(await idem(['status', JOB, ...q]), 0, 'status');
  out('    (a dead run says "crashed": its row says running, but nobody holds the lock)');
  const resumed = await idem(['run', JOB, '--key', 'demo-crash', '--param', 'pauseMs=150', '--log-level', 'info']);
  expectExit(resumed, 0, 'resumed run');
  const executedNow = Number(/(\d+) executed now/.exec(resumed.stdout)?.[1] ?? NaN);
  const byAttempt = await query<{ done_attempt: number; chunks: number }>(
    `select c.done_attempt, count(*)::int as chunks from idem.chunks c join idem.runs r on r.id = c.run_id
     where r.job = $1 and r.run_key = $2 group by 1 order by 1`,
    [JOB, 'demo-crash'],
  );
  out(indent(byAttempt.map((r) => `attempt ${r.done_attempt}: ${r.chunks} chunks`).join('\n')));
  out(`    ${before} committed before the kill + ${executedNow} executed now = ${before + executedNow}; no chunk ran twice.`);

  heading('A reused run key with other params is refused', 'The run key is an idempotency key: same key, other params → exit 65 and nothing written.');
  expectExit(await idem(['run', JOB, '--key', 'demo-crash', '--param', 'from=2026-11-02', ...q]), 65, 'params mismatch');

  heading('idem status and idem list', 'Every run with its state, attempts and chunk progress; every job and migration with its latest state.');
  expectExit(await idem(['status', ...q]), 0, 'status');
  expectExit(await idem(['list', ...q]), 0, 'list');
}

let tornDown: Promise<void> | undefined;
/** Idempotent: the normal end, a failure and a signal may all call it. */
function tearDown(): Promise<void> {
  return (tornDown ??= (async () => {
    const leftovers = [...live];
    for (const [child] of leftovers) child.kill('SIGKILL');
    await Promise.all(leftovers.map(([, done]) => done.catch(() => {})));
    // A killed child's backends end a moment after its sockets close; until then they would count
    // as clients and keep release() from stopping the server.
    if (leftovers.length > 0) await waitFor('killed sessions to end', 5_000, noIdemSessions).catch(() => {});
    await admin?.end().catch(() => {});
    if (server) {
      say();
      say('Releasing the embedded PostgreSQL…');
      await server.release().catch((err: unknown) => say(`    could not stop it: ${(err as Error).message}`));
    }
  })());
}

// Leftover children must not outlive the demo, however it ends.
process.on('exit', () => {
  for (const child of live.keys()) child.kill('SIGKILL');
});
for (const sig of ['SIGINT', 'SIGTERM'] as const) {
  process.once(sig, () => {
    say(`\n${sig}: stopping the demo`);
    stopping = true;
    void tearDown().finally(() => process.exit(sig === 'SIGINT' ? 130 : 143));
  });
}
const watchdog = setTimeout(() => {
  say(`\nthe demo took longer than ${DEMO_TIMEOUT_MS / 1000} s; giving up`);
  stopping = true;
  void tearDown().finally(() => process.exit(1));
}, DEMO_TIMEOUT_MS);
watchdog.unref();

const t0 = performance.now();
try {
  await demo();
  await tearDown();
  say(`\nDemo finished in ${((performance.now() - t0) / 1000).toFixed(1)} s.`);
} catch (err) {
  // After a signal or the watchdog, the failure is only the children being killed: stay quiet.
  if (!stopping) {
    say(`\ndemo failed: ${(err as Error).message}`);
    await tearDown();
    process.exitCode = 1;
  }
}
