import type pg from 'pg';
import type { Logger } from 'pino';
import { ExitCode, InterruptedError } from '../errors.ts';
import { addSecret } from '../database.ts';
import { loadJobDir, migrationKeys } from '../loader.ts';
import { testHookMs } from '../test-hooks.ts';
import { parseDuration } from '../operations.ts';
import type { Runner } from '../runner.ts';
import { loadApiToken } from './api-token.ts';
import { checkServeFlags, createServer } from './create-server.ts';

/**
 * Connections of the API's read pool. A read is one short statement (a replay, a run's view), so a
 * few connections keep up with many clients; more only add PostgreSQL backends competing for the
 * same cores (2, 4 and 8 measured alike with 50 clients on 2 cores: npm run bench -- --only http).
 */
export const READ_POOL_SIZE = 4;

/**
 * A statement of the API's read pool with no answer after this long is given up (503) and its
 * connection dropped: a connection the network forgot silently (a NAT or firewall that lost the
 * flow) would otherwise hold its slot until TCP gives up, about 15 minutes, and four of them would
 * stop every read and /readyz while PostgreSQL answers new connections. Reads take milliseconds;
 * the run page's detail of a run with millions of chunks, seconds.
 */
export const READ_TIMEOUT_MS = 30_000;

/** The flags of `idem serve` (defaults in cli.ts's option list). */
export interface ServeFlags {
  readonly host: string;
  readonly port: number;
  readonly tokenFile?: string;
  readonly publicRead?: boolean;
  /** --allowed-host, repeated. */
  readonly allowedHost?: readonly string[];
  readonly maxRuns: number;
  readonly concurrency: number;
  readonly bodyLimit: number;
  readonly retention?: string;
}

export interface ServeDeps {
  readonly jobsDir: string;
  /** The migrations folder: --retention never prunes its migrations' runs. */
  readonly migrationsDir?: string;
  readonly log: Logger;
  readonly shutdownTimeoutSeconds: number;
  /** The database password's forms: no answer shows them (ServerOptions.secrets). */
  readonly secrets?: readonly string[];
  /**
   * Opens the runner with a pool of `poolSize` and, on the same database (DATABASE_URL or the
   * embedded server), the API's read pool of `readPoolSize` whose statements give up after
   * `readTimeoutMs`; both close when the command ends.
   */
  openDatabase(poolSize: number, readPoolSize: number, readTimeoutMs: number): Promise<{ readonly runner: Runner; readonly reads: pg.Pool }>;
  /** Aborts on the first SIGINT/SIGTERM. */
  readonly stop: AbortSignal;
  /**
   * Aborts on a second SIGINT/SIGTERM (or at the shutdown deadline): the live runs' chunks are
   * aborted and their statements cancelled, so they are recorded `interrupted` before the process
   * exits, not left `running` with their statements going on in PostgreSQL.
   */
  readonly abort?: AbortSignal;
  /** Given how to tell whether the server executes a run: the shutdown deadline says it aborted chunks only then. */
  readonly chunksInFlight?: (check: () => boolean) => void;
}

/**
 * `idem serve`: checks every flag and the token before opening anything, serves until the first
 * signal, then stops accepting requests and lets live runs stop at a chunk boundary (they are
 * `interrupted` and resume at the next start).
 */
export async function serveCommand(o: ServeFlags, deps: ServeDeps): Promise<number> {
  checkServeFlags(o);
  const retentionMs = o.retention === undefined ? null : parseDuration(o.retention, '--retention');
  const token = await loadApiToken({ ...(o.tokenFile !== undefined ? { file: o.tokenFile } : {}), ...(process.env.IDEM_API_TOKEN ? { env: process.env.IDEM_API_TOKEN } : {}) });
  // Masked from here on wherever the password is (answers, log lines, a run's stored error): a job's
  // error may quote it, and a token file's token is not in the environment, where every mask finds
  // IDEM_API_TOKEN's.
  addSecret(token);
  const jobs = (await loadJobDir(deps.jobsDir, 'jobs')).map((l) => l.job);
  // Each executing run takes up to `concurrency` connections of the runner's pool, plus its control
  // and lock reads; the API reads on a pool of their own.
  // IDEM_SERVE_READ_TIMEOUT_MS: for tests, which cannot wait the default 30 s.
  const { runner, reads } = await deps.openDatabase(o.maxRuns * o.concurrency + 4, READ_POOL_SIZE, testHookMs('IDEM_SERVE_READ_TIMEOUT_MS') ?? READ_TIMEOUT_MS);
  // IDEM_SERVE_RESCAN_MS: for tests, which cannot wait the default 30 s for a takeover.
  const rescan = testHookMs('IDEM_SERVE_RESCAN_MS');
  // IDEM_SERVE_REQUEST_TIMEOUT_MS: for tests, which cannot wait the default 60 s.
  const requestTimeout = testHookMs('IDEM_SERVE_REQUEST_TIMEOUT_MS');
  // IDEM_SERVE_LOG_WINDOW_MS: for tests, which cannot wait the default 10 s for a window's summary.
  const logWindow = testHookMs('IDEM_SERVE_LOG_WINDOW_MS');
  const server = createServer({
    runner,
    reads,
    jobs,
    token,
    publicRead: o.publicRead ?? false,
    allowedHosts: o.allowedHost ?? [],
    maxRuns: o.maxRuns,
    concurrency: o.concurrency,
    bodyLimit: o.bodyLimit,
    log: deps.log,
    secrets: [...(deps.secrets ?? []), token],
    retentionMs,
    migrationKeys: retentionMs !== null && deps.migrationsDir !== undefined ? await migrationKeys(deps.migrationsDir) : [],
    ...(rescan !== undefined ? { rescanMs: rescan } : {}),
    ...(requestTimeout !== undefined ? { requestTimeoutMs: requestTimeout } : {}),
    ...(logWindow !== undefined ? { logWindowMs: logWindow } : {}),
  });
  deps.chunksInFlight?.(() => server.executor.executing().size > 0);
  const abortRuns = () => server.executor.abortRuns(deps.abort?.reason instanceof InterruptedError ? deps.abort.reason.signal : 'SIGTERM');
  if (deps.abort?.aborted) abortRuns();
  else deps.abort?.addEventListener('abort', abortRuns, { once: true });
  let address: string;
  try {
    address = await server.listen({ host: o.host, port: o.port });
  } catch (err) {
    // Whatever listen() opened before it failed (the LISTEN session of the replay cache) closes
    // with the pools, before the embedded server's last-one-out check counts the sessions.
    await server.close(0).catch(() => {});
    throw err;
  }
  deps.log.info({ address, jobs: jobs.map((j) => j.name), publicRead: o.publicRead ?? false, maxRuns: o.maxRuns }, 'idem serve listening');
  process.stdout.write(`idem serve: listening on ${address} (${jobs.length} job${jobs.length === 1 ? '' : 's'}; dashboard at ${address}/)\n`);
  await new Promise<void>((resolve) => (deps.stop.aborted ? resolve() : deps.stop.addEventListener('abort', () => resolve(), { once: true })));
  deps.log.info('idem serve stopping: no new requests; live runs stop at their next chunk boundary');
  await server.close(deps.shutdownTimeoutSeconds * 1000, deps.stop.reason);
  const reason = deps.stop.reason;
  return reason instanceof InterruptedError ? reason.exitCode : ExitCode.Ok;
}
