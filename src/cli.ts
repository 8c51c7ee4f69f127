import path from 'node:path';
import { Command, CommanderError, InvalidArgumentError, Option } from 'commander';
import type { Logger } from 'pino';
import { redactUrl } from './database.ts';
import { ExitCode, exitCodeOf, IdemError, InterruptedError, messageOf, UsageError } from './errors.ts';
import { validateParams } from './job.ts';
import { assertKnownJob, checkJobFolders } from './job-lookup.ts';
import { findJob, loadJobDir } from './loader.ts';
import { finalizeMigration, finalizeRun, type FinalizeOutcome } from './finalize.ts';
import { parseHealthFlag, type HealthOptions, type HealthSetting } from './health-check.ts';
import { parseDuration } from './operations.ts';
import { latestSlot, parseCatchUp, parseSchedule, renderCrontab, runCronLoop, shellQuote, slotKey, slotsSince, type ScheduledJob } from './schedule.ts';
import { createProgressReporter } from './progress-reporter.ts';
import { createLogger, LOG_LEVELS, type LogLevel } from './log.ts';
import { DEFAULT_SCHEMA, POOL_HEADROOM, Runner, type RunOutcome, type RunStatusRow } from './runner.ts';

interface GlobalOptions {
  databaseUrl?: string;
  schema: string;
  jobsDir: string;
  migrationsDir: string;
  logLevel: LogLevel;
  shutdownTimeout: number;
}

/** Resources a command opened, released in reverse order however the command ends. */
class Session {
  readonly #cleanups: Array<() => Promise<void>> = [];
  defer(fn: () => Promise<void>): void {
    this.#cleanups.push(fn);
  }
  async close(): Promise<void> {
    while (this.#cleanups.length) await this.#cleanups.pop()!().catch(() => {});
  }
}

function positiveInt(max: number) {
  return (value: string): number => {
    const n = Number(value);
    if (!Number.isInteger(n) || n < 1 || n > max) throw new InvalidArgumentError(`expected an integer from 1 to ${max}, got "${value}"`);
    return n;
  };
}

function positiveNumber(value: string): number {
  const n = Number(value);
  if (!Number.isFinite(n) || n <= 0) throw new InvalidArgumentError(`expected a number > 0, got "${value}"`);
  return n;
}

function nonNegativeNumber(value: string): number {
  const n = Number(value);
  if (!Number.isFinite(n) || n < 0) throw new InvalidArgumentError(`expected a number >= 0, got "${value}"`);
  return n;
}

function waitSeconds(value: string | boolean): number | boolean {
  if (typeof value === 'boolean') return value;
  const n = Number(value);
  if (!Number.isFinite(n) || n < 0) throw new InvalidArgumentError(`expected a number of seconds >= 0, got "${value}"`);
  return n;
}

function collectParam(value: string, previous: Record<string, unknown>): Record<string, unknown> {
  const eq = value.indexOf('=');
  if (eq < 1) throw new InvalidArgumentError(`expected key=value, got "${value}"`);
  const raw = value.slice(eq + 1);
  let parsed: unknown = raw;
  try {
    parsed = JSON.parse(raw);
  } catch {
    // Not JSON: the value is the plain string.
  }
  return { ...previous, [value.slice(0, eq)]: parsed };
}

function parseParams(json: string | undefined, pairs: Record<string, unknown>): Record<string, unknown> {
  let base: unknown = {};
  if (json !== undefined) {
    try {
      base = JSON.parse(json);
    } catch (err) {
      throw new UsageError('invalidParams', `--params is not valid JSON (${(err as Error).message}); pass an object such as --params '{"day":"2026-11-30"}'`);
    }
    if (!base || typeof base !== 'object' || Array.isArray(base)) {
      throw new UsageError('invalidParams', `--params must be a JSON object, got ${json}; pass e.g. --params '{"day":"2026-11-30"}'`);
    }
  }
  return { ...(base as Record<string, unknown>), ...pairs };
}

/** Every job in the folder that declares a schedule, by name. */
async function scheduledJobs(dir: string): Promise<ScheduledJob[]> {
  const loaded = await loadJobDir(dir, 'jobs');
  return loaded
    .filter((l) => l.job.schedule !== undefined)
    .map((l) => ({ job: l.job.name, schedule: parseSchedule(l.job.schedule!) }))
    .sort((a, b) => (a.job < b.job ? -1 : 1));
}

/** Opens a Runner on DATABASE_URL, or on the embedded server under .idem/ when none is given. */
async function openRunner(g: GlobalOptions, log: Logger, session: Session, poolSize = 10): Promise<Runner> {
  let url = g.databaseUrl;
  if (!url) {
    const { startEmbeddedPostgres } = await import('./embedded-postgres.ts');
    const server = await startEmbeddedPostgres({ dataDir: path.resolve('.idem', 'pg'), onLog: (msg) => log.info(msg) });
    session.defer(() => server.release());
    url = server.url;
  } else {
    log.debug({ database: redactUrl(url) }, 'using database');
  }
  const runner = await Runner.connect({ connectionString: url, schema: g.schema, log, poolSize });
  session.defer(() => runner.close());
  return runner;
}

/**
 * Graceful first, forceful second: the first SIGINT/SIGTERM stops new chunks and lets in-flight
 * ones finish; a second signal, or the deadline, aborts the job code and exits (Postgres rolls
 * back whatever was in flight, so nothing is half-done).
 */
function installSignals(log: Logger, deadlineSeconds: number, onForce: (code: number) => void) {
  const stop = new AbortController();
  const abort = new AbortController();
  const handler = (sig: 'SIGINT' | 'SIGTERM') => {
    const code = sig === 'SIGINT' ? ExitCode.Sigint : ExitCode.Sigterm;
    if (!stop.signal.aborted) {
      log.warn({ signal: sig, deadlineSeconds }, 'stopping: no new chunks; in-flight chunks may finish (signal again to abort them)');
      stop.abort(new InterruptedError(sig));
      setTimeout(() => {
        log.error('shutdown deadline passed; aborting in-flight chunks');
        abort.abort(new InterruptedError(sig));
        onForce(code);
      }, deadlineSeconds * 1000).unref();
    } else {
      log.error({ signal: sig }, 'second signal; aborting in-flight chunks');
      abort.abort(new InterruptedError(sig));
      onForce(code);
    }
  };
  process.on('SIGINT', () => handler('SIGINT'));
  process.on('SIGTERM', () => handler('SIGTERM'));
  return { stop: stop.signal, abort: abort.signal };
}

function describeOutcome(o: RunOutcome): string {
  const s = o.summary;
  if (o.status === 'dry-run') {
    const steps = o.plan!.steps.map((st) => `${st.name}${st.chunked ? ' (chunked)' : ''}`).join(', ');
    return `dry run: job "${o.job}" run key ${o.runKey} is ${o.plan!.state}; steps: ${steps}; nothing was written`;
  }
  const skipped = s && s.skipped > 0 ? ` (${s.skipped} skipped: see idem status, retry with --retry-skipped)` : '';
  const counts = s ? `${s.chunks} chunk${s.chunks === 1 ? '' : 's'} in ${s.steps.length} step${s.steps.length === 1 ? '' : 's'}${skipped}` : '';
  if (o.status === 'already-succeeded') {
    const finished = s?.finishedAt ? new Date(s.finishedAt).toISOString() : '?';
    return `job "${o.job}" already done (run key ${o.runKey}, finished ${finished}): ${counts}; nothing to do`;
  }
  const took = o.attempt > 1 ? ` (the run took ${((s?.durationMs ?? 0) / 1000).toFixed(1)}s over ${o.attempt} attempts)` : '';
  return `job "${o.job}" succeeded: ${counts}, ${o.executed} executed now in ${((o.elapsedMs ?? s?.durationMs ?? 0) / 1000).toFixed(1)}s${took} (run key ${o.runKey}, attempt ${o.attempt})`;
}

/** The health flags every command that runs chunks takes. */
function withHealthFlags(cmd: Command): Command {
  return cmd
    .option('--health <name=value>', 'change a health-check threshold or turn it off (e.g. transactionAgeSeconds=600, lockWaitMs=off); repeatable', (v: string, prev: HealthOptions | undefined) => parseHealthFlag(v, prev ?? {}))
    .option('--no-health-check', 'do not wait for the database to be healthy before each chunk');
}

function healthSetting(o: { health?: HealthOptions; healthCheck?: boolean }): { health?: HealthSetting } {
  if (o.healthCheck === false) return { health: false };
  return o.health && Object.keys(o.health).length > 0 ? { health: o.health } : {};
}

function describeFinalize(o: FinalizeOutcome): string {
  const how = o.how === 'waited' ? 'finished by another process while finalize waited' : o.how === 'ran-inline' ? 'the rest ran here' : 'had already succeeded';
  return `finalize: ${how}; ${describeOutcome(o)}`;
}

function formatStatus(rows: RunStatusRow[]): string {
  if (rows.length === 0) return 'no runs yet';
  const lines = rows.map((r) => {
    const progress = `${r.chunksDone}/${r.fullyPlanned ? r.chunksPlanned : `${Math.max(r.chunksPlanned, r.estimatedChunks ?? 0)}~`}`;
    const live = r.state === 'running' ? `  held by ${r.holder ?? '?'}${r.throughput !== null ? `, ${r.throughput}/s` : ''}${r.etaSeconds !== null ? `, ETA ${r.etaSeconds}s` : ''}` : '';
    const asked = `${r.requested ? `  (${r.requested} requested)` : ''}${r.healthPause ? `  paused for health: ${r.healthPause.reason}` : ''}${r.codeChanges.length ? `  code changed (allowed) at attempt ${r.codeChanges.map((c) => c.attempt).join(', ')}` : ''}`;
    const extra = r.error ? `  error: step "${r.error.step}"${r.error.chunk ? ` chunk ${r.error.chunk}` : ''} after ${r.error.tries} tries: ${r.error.message}` : live + asked;
    const skips = r.skipped.map((k) => `\n    skipped: step "${k.step}" chunk ${k.key} after ${k.attempts} tries: ${k.error ?? ''}`).join('');
    return `${r.job}\t${r.runKey.length > 30 ? `${r.runKey.slice(0, 27)}...` : r.runKey}\t${r.state}\tattempt ${r.attempt}\tchunks ${progress}\t${r.updatedAt.toISOString()}${extra}${skips}`;
  });
  return ['JOB\tRUN KEY\tSTATE\tATTEMPT\tCHUNKS\tUPDATED', ...lines].join('\n');
}

export function buildProgram(state: { exitCode: number }): Command {
  const program = new Command('idem')
    .description('Idempotent batch and data-migration jobs for PostgreSQL: safe to run twice, resumable after a crash.')
    .addOption(new Option('--database-url <url>', 'PostgreSQL connection string (default: DATABASE_URL, else an embedded server under .idem/)').env('DATABASE_URL'))
    .option('--schema <name>', "schema for idem's own tables", DEFAULT_SCHEMA)
    .option('--jobs-dir <dir>', 'folder of job files', 'jobs')
    .option('--migrations-dir <dir>', 'folder of ordered migration files', 'migrations')
    .addOption(new Option('--log-level <level>', 'log level (logs go to stderr)').choices(LOG_LEVELS as string[]).default('info'))
    .option('--shutdown-timeout <seconds>', 'after a first SIGINT/SIGTERM, how long in-flight chunks may take', positiveInt(3600), 30)
    // Parse errors are one line like every other refusal, with the fix (see the help) in it.
    .configureOutput({ outputError: (str, write) => write(`idem: ${str.trim().replace(/\.$/, '')}; see --help\n`) })
    .exitOverride();

  const globals = () => program.opts<GlobalOptions>();

  /**
   * `uses`: the folders the command reads; one given explicitly must exist. `run`, `crontab` and
   * `cron` read only the jobs folder (a crontab line carries --migrations-dir through unread).
   */
  const runWithSession = async (
    fn: (g: GlobalOptions, log: Logger, session: Session, force: (code: number) => void) => Promise<number>,
    uses: ReadonlyArray<'jobs' | 'migrations'> = ['jobs', 'migrations'],
  ) => {
    const g = globals();
    const log = createLogger(g.logLevel);
    const session = new Session();
    const finish = async (code: number, graceMs = 10_000) => {
      // Watchdog: a stuck close (a pool waiting on an in-flight transaction) must not keep a cron
      // slot busy forever; exiting closes the sockets and Postgres rolls the transactions back.
      setTimeout(() => process.exit(code), graceMs).unref();
      await session.close();
      process.exit(code);
    };
    try {
      await checkJobFolders(
        [
          { flag: '--jobs-dir' as const, dir: g.jobsDir, explicit: program.getOptionValueSource('jobsDir') === 'cli', what: 'jobs' as const },
          { flag: '--migrations-dir' as const, dir: g.migrationsDir, explicit: program.getOptionValueSource('migrationsDir') === 'cli', what: 'migrations' as const },
        ].filter((f) => uses.includes(f.what)),
        log,
      );
      state.exitCode = await fn(g, log, session, (code) => void finish(code, 2_000));
    } catch (err) {
      state.exitCode = exitCodeOf(err);
      const msg = err instanceof IdemError ? err.message : messageOf(err);
      process.stderr.write(`idem: error: ${msg}\n`);
      if (!(err instanceof IdemError)) log.debug({ err }, 'unexpected error');
    } finally {
      // The same watchdog on the normal path: releasing the lock, pool and embedded server must
      // not hang the process.
      // A lost lock often means a dead network: closing the pool would wait on its sockets.
      setTimeout(() => process.exit(state.exitCode), state.exitCode === ExitCode.LockLost ? 2_000 : 10_000).unref();
      await session.close();
    }
  };

  withHealthFlags(program
    .command('run'))
    .description('run a job (or find it done): resumes at the first unfinished chunk')
    .argument('<job>', 'job name, as defined in a file in the jobs folder')
    .option('--key <key>', 'run key (idempotency key); default: the params fingerprint')
    .option('--params <json>', 'params as a JSON object')
    .option('--param <key=value>', 'one param (value parsed as JSON when it parses, else a string); repeatable', collectParam, {})
    .option('--concurrency <n>', 'chunks run at once', positiveInt(64), 1)
    .option('--wait [seconds]', 'if another process runs this job, wait for it (forever, or this many seconds) instead of exiting 75', waitSeconds)
    .option('--join', 'if this run is live in other processes, join them as one more worker (start it when nobody runs it)')
    .option('--dry-run', 'show what would run; write nothing')
    .option('--retry-skipped', "retry chunks skipped under a step's maxFailedChunks policy (also in a succeeded run)")
    .option('--max-rate <chunks/s>', 'start at most this many chunks per second', positiveNumber)
    .option('--pause <ms>', 'pause this long after each chunk (per worker)', nonNegativeNumber)
    .option('--target-chunk-ms <ms>', 'grow or shrink keyRange chunks toward this duration', positiveNumber)
    .option('--no-progress', 'no live progress line on a terminal')
    .option('--catch-up <N|duration>', 'scheduled jobs: run the missed slots oldest first, the last N or those within a duration (e.g. 3, 12h, 2d)')
    .option('--json', 'print the outcome as JSON on stdout')
    .option('--allow-changed-code', 'resume a run even though its job file (or version) changed since it started; recorded on the run')
    .action((name: string, o: { key?: string; params?: string; param: Record<string, unknown>; concurrency: number; wait?: number | boolean; join?: boolean; dryRun?: boolean; retrySkipped?: boolean; json?: boolean; maxRate?: number; pause?: number; targetChunkMs?: number; progress: boolean; catchUp?: string; allowChangedCode?: boolean; health?: HealthOptions; healthCheck?: boolean }) =>
      runWithSession(async (g, log, session, force) => {
        const params = parseParams(o.params, o.param);
        if (o.key !== undefined && (o.key.length === 0 || o.key.length > 200)) throw new UsageError('invalidKey', '--key must be 1 to 200 characters');
        const job = await findJob(g.jobsDir, name, { migrationsDir: g.migrationsDir });
        // Bad params are refused before any connection: nothing, not even idem's schema, is created.
        await validateParams(job, params);
        // A scheduled job run without --key is the run of its most recent due slot: cron firing
        // twice, or late, lands on the same run. --catch-up runs each missed slot as its own run.
        const schedule = job.schedule === undefined ? undefined : parseSchedule(job.schedule);
        if (o.catchUp !== undefined && (!schedule || o.key !== undefined)) {
          throw new UsageError('invalidCatchUp', schedule ? '--catch-up picks run keys from the schedule; drop --key' : `--catch-up needs a scheduled job; "${job.name}" has no schedule`);
        }
        const slots: Array<Date | null> =
          o.catchUp !== undefined ? slotsSince(schedule!, parseCatchUp(o.catchUp)) : [o.key === undefined && schedule ? latestSlot(schedule) : null];
        if (slots.length === 0) {
          process.stdout.write(`no slot of job "${job.name}" falls within --catch-up ${o.catchUp}\n`);
          return ExitCode.Ok;
        }
        const runner = await openRunner(g, log, session, o.concurrency + POOL_HEADROOM);
        const signals = installSignals(log, g.shutdownTimeout, force);
        const throttle = {
          ...(o.maxRate !== undefined ? { maxRate: o.maxRate } : {}),
          ...(o.pause !== undefined ? { pauseMs: o.pause } : {}),
          ...(o.targetChunkMs !== undefined ? { targetChunkMs: o.targetChunkMs } : {}),
        };
        for (const slot of slots) {
          const reporter = o.progress && !o.json && !o.dryRun ? createProgressReporter({ job: job.name, tty: process.stderr.isTTY === true, log }) : undefined;
          if (reporter) session.defer(async () => reporter.stop());
          const key = slot ? slotKey(slot) : o.key;
          const outcome = await runner.run(job, {
            throttle,
            ...(reporter ? { onProgress: reporter.update } : {}),
            params,
            ...(key !== undefined ? { key } : {}),
            slot,
            concurrency: o.concurrency,
            wait: o.wait ?? false,
            join: o.join ?? false,
            dryRun: o.dryRun ?? false,
            retrySkipped: o.retrySkipped ?? false,
            allowChangedCode: o.allowChangedCode ?? false,
            ...healthSetting(o),
            signal: signals.stop,
            abortSignal: signals.abort,
          });
          reporter?.stop();
          process.stdout.write(o.json ? `${JSON.stringify(outcome)}\n` : `${describeOutcome(outcome)}\n`);
        }
        return ExitCode.Ok;
      }, ['jobs']),
    );

  withHealthFlags(program
    .command('migrate'))
    .description('run the ordered migrations in the migrations folder; every pod may call it at once')
    .option('--wait [seconds]', 'wait for another migrating process (default: forever)', waitSeconds)
    .option('--no-wait', 'exit 75 at once if another process is migrating')
    .option('--json', 'print the outcomes as JSON on stdout')
    .option('--allow-changed-code', 'resume migrations whose file (or version) changed since they started; recorded on the run')
    .option('--finalize <name>', 'deploys: make sure this migration (and those before it) succeeded: done → exit 0, running elsewhere → wait, idle → run it here, failed → exit 1')
    .option('--timeout <seconds>', 'with --finalize: how long to wait for a migration running elsewhere (default: no bound)', nonNegativeNumber)
    .action((o: { wait?: number | boolean; json?: boolean; allowChangedCode?: boolean; finalize?: string; timeout?: number; health?: HealthOptions; healthCheck?: boolean }) =>
      runWithSession(async (g, log, session, force) => {
        const migrations = await loadJobDir(g.migrationsDir, 'migrations');
        if (o.timeout !== undefined && o.finalize === undefined) throw new UsageError('invalidTimeout', '--timeout bounds the wait of --finalize; pass --finalize <name>, or use --wait for a plain migrate');
        const runner = await openRunner(g, log, session);
        const signals = installSignals(log, g.shutdownTimeout, force);
        if (o.finalize !== undefined) {
          const list = migrations.map((m) => ({ runKey: m.id, job: m.job }));
          const outcomes = await finalizeMigration(runner, list, o.finalize, {
            ...(o.timeout !== undefined ? { timeoutSeconds: o.timeout } : {}),
            allowChangedCode: o.allowChangedCode ?? false,
            ...healthSetting(o),
            signal: signals.stop,
            abortSignal: signals.abort,
          });
          if (o.json) process.stdout.write(`${JSON.stringify(outcomes)}\n`);
          else for (const out of outcomes) process.stdout.write(`${out.runKey}: ${describeFinalize(out)}\n`);
          return ExitCode.Ok;
        }
        const outcomes = await runner.migrate(
          migrations.map((m) => ({ runKey: m.id, job: m.job })),
          { wait: o.wait ?? true, allowChangedCode: o.allowChangedCode ?? false, ...healthSetting(o), signal: signals.stop, abortSignal: signals.abort },
        );
        if (o.json) process.stdout.write(`${JSON.stringify(outcomes)}\n`);
        else if (outcomes.length === 0) process.stdout.write(`no migrations in ${g.migrationsDir}/\n`);
        else for (const out of outcomes) process.stdout.write(`${out.runKey}: ${describeOutcome(out)}\n`);
        return ExitCode.Ok;
      }, ['migrations']),
    );

  withHealthFlags(program
    .command('finalize'))
    .description('deploys: make sure a run succeeded: done → exit 0, running elsewhere → wait, unfinished and idle → run the rest here, failed → exit 1')
    .argument('<job>', 'job name')
    .requiredOption('--key <key>', "the run's key")
    .option('--timeout <seconds>', 'how long to wait for the run when another process runs it (default: no bound)', nonNegativeNumber)
    .option('--params <json>', 'params, only for a run that does not exist yet (an existing run keeps its own)')
    .option('--param <key=value>', 'one param, as for idem run; repeatable', collectParam, {})
    .option('--concurrency <n>', 'chunks run at once when the rest runs here', positiveInt(64), 1)
    .option('--allow-changed-code', 'resume even though the job file (or version) changed since the run started')
    .option('--json', 'print the outcome as JSON on stdout')
    .action((name: string, o: { key: string; timeout?: number; params?: string; param: Record<string, unknown>; concurrency: number; allowChangedCode?: boolean; json?: boolean; health?: HealthOptions; healthCheck?: boolean }) =>
      runWithSession(async (g, log, session, force) => {
        const params = parseParams(o.params, o.param);
        const job = await findJob(g.jobsDir, name);
        const runner = await openRunner(g, log, session, o.concurrency + 2);
        const signals = installSignals(log, g.shutdownTimeout, force);
        const outcome = await finalizeRun(runner, job, {
          key: o.key,
          params,
          concurrency: o.concurrency,
          ...(o.timeout !== undefined ? { timeoutSeconds: o.timeout } : {}),
          allowChangedCode: o.allowChangedCode ?? false,
          ...healthSetting(o),
          signal: signals.stop,
          abortSignal: signals.abort,
        });
        process.stdout.write(o.json ? `${JSON.stringify(outcome)}\n` : `${describeFinalize(outcome)}\n`);
        return ExitCode.Ok;
      }),
    );

  program
    .command('list')
    .description('list jobs and migrations with their description and latest state')
    .option('--json', 'print as JSON')
    .action((o: { json?: boolean }) =>
      runWithSession(async (g, log, session) => {
        const jobs = await loadJobDir(g.jobsDir, 'jobs');
        const migrations = await loadJobDir(g.migrationsDir, 'migrations');
        const runner = await openRunner(g, log, session);
        const latest = new Map<string, RunStatusRow>();
        for (const r of await runner.status(undefined, 1000)) if (!latest.has(r.job)) latest.set(r.job, r);
        const items = [
          ...jobs.map((j) => ({ kind: 'job', name: j.job.name, description: j.job.description ?? '', state: latest.get(j.job.name)?.state ?? 'never run' })),
          ...migrations.map((m) => ({ kind: 'migration', name: m.id, job: m.job.name, description: m.job.description ?? '', state: latest.get(m.job.name)?.state ?? 'pending' })),
        ];
        if (o.json) process.stdout.write(`${JSON.stringify(items)}\n`);
        else process.stdout.write(`${items.map((i) => `${i.kind}\t${i.name}\t${i.state}\t${i.description}`).join('\n') || 'no jobs or migrations found'}\n`);
        return ExitCode.Ok;
      }),
    );

  program
    .command('status')
    .description("show runs: state ('running' only while a process holds the lock), attempt, chunks done/planned, last error")
    .argument('[job]', 'only this job')
    .option('--json', 'print as JSON')
    .option('--limit <n>', 'how many runs', positiveInt(10_000), 50)
    .action((job: string | undefined, o: { json?: boolean; limit: number }) =>
      runWithSession(async (g, log, session) => {
        const runner = await openRunner(g, log, session);
        if (job !== undefined) await assertKnownJob(runner, job, g);
        const rows = await runner.status(job, o.limit);
        process.stdout.write(o.json ? `${JSON.stringify(rows)}\n` : `${formatStatus(rows)}\n`);
        return ExitCode.Ok;
      }),
    );

  program
    .command('crontab')
    .description('print crontab lines for every scheduled job (install with: idem crontab | crontab -)')
    .option('--command <command>', 'how cron invokes idem', 'npx idem')
    .option('--log-file <file>', 'where cron appends output')
    .option('--catch-up <N>', 'add --catch-up N to each line, so a failed or missed slot is retried by the next tick')
    .action((o: { command: string; logFile?: string; catchUp?: string }) =>
      runWithSession(async (g) => {
        const entries = await scheduledJobs(g.jobsDir);
        if (entries.length === 0) throw new UsageError('noScheduledJobs', `no job in ${g.jobsDir}/ declares a schedule; add schedule: '0 3 * * *' to one`);
        // Every global flag that changes which lock, tables or files a run uses goes on the line,
        // quoted: a cron run under another schema would take another lock than a manual run.
        // The database URL is not (it holds the password): cron's environment sets DATABASE_URL.
        const identity = [
          ...(g.schema !== DEFAULT_SCHEMA ? ['--schema', g.schema] : []),
          ...(g.jobsDir !== 'jobs' ? ['--jobs-dir', g.jobsDir] : []),
          ...(g.migrationsDir !== 'migrations' ? ['--migrations-dir', g.migrationsDir] : []),
        ];
        const flags = identity.map(shellQuote).map((w) => ` ${w}`).join('');
        process.stdout.write(renderCrontab(entries, { cwd: process.cwd(), command: `${o.command}${flags}`, ...(o.logFile ? { logFile: o.logFile } : {}), ...(o.catchUp ? { catchUp: o.catchUp } : {}) }));
        return ExitCode.Ok;
      }, ['jobs']),
    );

  program
    .command('cron')
    .description('run the schedules in this process (for containers without cron); several on several hosts are safe')
    .action(() =>
      runWithSession(async (g, log, session, force) => {
        const loaded = await loadJobDir(g.jobsDir, 'jobs');
        const byName = new Map(loaded.map((l) => [l.job.name, l.job]));
        const entries = await scheduledJobs(g.jobsDir);
        const runner = await openRunner(g, log, session);
        const signals = installSignals(log, g.shutdownTimeout, force);
        log.info({ jobs: entries.map((e) => `${e.job} (${e.schedule.expression})`) }, 'idem cron started');
        await runCronLoop({
          entries,
          signal: signals.stop,
          runSlot: async (name, slot) => {
            const out = await runner.run(byName.get(name)!, { key: slotKey(slot), slot, signal: signals.stop, abortSignal: signals.abort });
            log.info({ job: name, slot: slotKey(slot), status: out.status, executed: out.executed }, describeOutcome(out));
          },
          onError: (name, slot, err) => {
            if (signals.stop.aborted) return;
            if (err instanceof IdemError && err.exitCode === ExitCode.Busy) log.info({ job: name, slot: slotKey(slot) }, `slot taken by another process: ${err.message}`);
            else log.error({ job: name, slot: slotKey(slot), err: { message: messageOf(err) } }, 'scheduled run failed; the next tick tries it once more, --catch-up after that');
          },
        });
        const reason = signals.stop.reason;
        return reason instanceof InterruptedError ? reason.exitCode : ExitCode.Ok;
      }, ['jobs']),
    );

  const control = (name: 'pause' | 'resume' | 'cancel', description: string) =>
    program
      .command(name)
      .description(description)
      .argument('<job>', 'job name')
      .option('--key <key>', "the run's key (default: the job's latest run it applies to)")
      .option('--json', 'print the result as JSON')
      .action((job: string, o: { key?: string; json?: boolean }) =>
        runWithSession(async (g, log, session) => {
          const runner = await openRunner(g, log, session);
          await assertKnownJob(runner, job, g);
          const r = await runner[name](job, o.key);
          const how = r.live ? `requested: the live run stops at its next chunk boundary` : `now ${r.status}`;
          process.stdout.write(o.json ? `${JSON.stringify(r)}\n` : `${name}: run ${r.runKey} of job "${r.job}" ${how}\n`);
          return ExitCode.Ok;
        }),
      );
  control('pause', 'pause a run between chunks; its re-invocations exit 75 until idem resume');
  control('resume', 'let a paused run continue on its next invocation');
  control('cancel', 'cancel a run between chunks; finished chunks are kept, the run never continues');

  program
    .command('reset')
    .description('forget a run (steps, chunk markers, effects) so its key runs afresh; refused while it runs')
    .argument('<job>', 'job name')
    .requiredOption('--key <key>', "the run's key (see idem status)")
    .action((job: string, o: { key: string }) =>
      runWithSession(async (g, log, session) => {
        const runner = await openRunner(g, log, session);
        await assertKnownJob(runner, job, g);
        const r = await runner.reset(job, o.key);
        process.stdout.write(`reset: forgot run ${o.key} of job "${job}" (${r.chunks} chunk markers, ${r.effects} effects)\n`);
        return ExitCode.Ok;
      }),
    );

  program
    .command('prune')
    .description('delete succeeded and cancelled runs older than a duration, with their markers and effects (in batches)')
    .requiredOption('--older-than <duration>', 'e.g. 30d, 12h, 2w')
    .option('--json', 'print the counts as JSON')
    .action((o: { olderThan: string; json?: boolean }) =>
      runWithSession(async (g, log, session) => {
        const ms = parseDuration(o.olderThan, '--older-than');
        const runner = await openRunner(g, log, session);
        const r = await runner.prune(ms);
        process.stdout.write(o.json ? `${JSON.stringify(r)}\n` : `prune: removed ${r.runs} runs, ${r.steps} steps, ${r.chunks} chunk markers, ${r.effects} effects older than ${o.olderThan}\n`);
        return ExitCode.Ok;
      }, []),
    );

  return program;
}

/** Entry point of the `idem` binary. */
export async function main(argv: string[]): Promise<never> {
  const state = { exitCode: 0 };
  const program = buildProgram(state);
  try {
    await program.parseAsync(argv);
  } catch (err) {
    if (err instanceof CommanderError) {
      // Help and version print and end well; every other parse error is a usage error.
      process.exit(err.code === 'commander.helpDisplayed' || err.code === 'commander.version' || err.code === 'commander.help' ? 0 : ExitCode.Usage);
    }
    process.stderr.write(`idem: error: ${messageOf(err)}\n`);
    process.exit(exitCodeOf(err));
  }
  process.exit(state.exitCode);
}
