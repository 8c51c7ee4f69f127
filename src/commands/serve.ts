import type { Command } from 'commander';
import { positiveInt } from '../cli-parsers.ts';
import { databaseUrl, installSignals, openRunner, type CliContext } from '../cli-session.ts';

/** `idem serve`: the HTTP trigger API, the live dashboard at / and /metrics (src/server/). */
export function registerServeCommand(program: Command, cli: CliContext): void {
  program
    .command('serve')
    .description('serve the HTTP trigger API (Idempotency-Key), the live dashboard at / and /metrics; runs execute in this process')
    .option('--host <host>', 'address to bind (0.0.0.0 exposes it: put TLS in front)', '127.0.0.1')
    .option('--port <port>', 'TCP port (0: any free port)', (v: string) => (v === '0' ? 0 : positiveInt(65535)(v)), 7070)
    .option('--token-file <file>', 'file holding the API bearer token (default: IDEM_API_TOKEN)')
    .option('--public-read', 'let GET requests (dashboard, run reads, metrics) through without the token')
    .option('--allowed-host <name>', 'a Host name the server answers besides localhost and IP addresses (a reverse proxy\'s); repeatable', (v: string, all: string[] = []) => [...all, v])
    .option('--max-runs <n>', 'runs executed at once by this server', positiveInt(256), 4)
    .option('--concurrency <n>', 'chunks run at once within one run', positiveInt(64), 1)
    .option('--body-limit <bytes>', 'largest request body accepted', positiveInt(16 * 1024 * 1024), 65536)
    .option('--retention <duration>', 'prune succeeded and cancelled runs older than this, hourly (their keys become free again), e.g. 30d')
    .action((o: import('../server/serve-command.ts').ServeFlags) =>
      cli.runWithSession(async (g, log, session, force) => {
        // Fastify and the server load only when the command runs, not for --help.
        const { serveCommand } = await import('../server/serve-command.ts');
        // A job a migration shares its name with would share the migration's lock and runs.
        const { checkSharedNamesIn, loadJobDir, secretForms } = await import('../cli-runtime.ts');
        await checkSharedNamesIn(await loadJobDir(g.jobsDir, 'jobs'), g.migrationsDir, 'migrations');
        const signals = installSignals(log, g.shutdownTimeout, force);
        const openDatabase = async (poolSize: number, readPoolSize: number, readTimeoutMs: number) => {
          const url = await databaseUrl(g, log, session);
          const runner = await openRunner(g, log, session, poolSize, url);
          const { assertNotStandby, openDatabase } = await import('../cli-runtime.ts');
          // On a standby every run it starts or resumes would fail: refused at start instead (exit 2).
          await assertNotStandby(runner.db);
          const reads = await openDatabase(url, { poolSize: readPoolSize, log, queryTimeoutMs: readTimeoutMs });
          session.defer(() => reads.close());
          return { runner, reads: reads.pool };
        };
        return serveCommand(o, { jobsDir: g.jobsDir, migrationsDir: g.migrationsDir, log, shutdownTimeoutSeconds: g.shutdownTimeout, secrets: secretForms(g.databaseUrl ?? ''), stop: signals.stop, abort: signals.abort, chunksInFlight: (check) => signals.chunksInFlight(check), openDatabase });
      }),
    );
}
