import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';
import { answerWithin } from '../sleep.ts';
import { RUN_STATES } from './run-view.ts';

/** How long a scrape waits for the run counts before it leaves idem_runs out. */
const RUN_COUNTS_TIMEOUT_MS = 2_000;

/**
 * The server's Prometheus metrics (prom-client). Labels are job, step, state, route and status:
 * never a run key or an Idempotency-Key, which are unbounded and chosen by clients.
 */
export class ServerMetrics {
  readonly registry = new Registry();
  readonly chunksCommitted: Counter<'job' | 'step'>;
  readonly chunkDuration: Histogram<'job' | 'step'>;
  readonly chunkErrors: Counter<'job' | 'step'>;
  readonly runsEnded: Counter<'job' | 'outcome'>;
  readonly lockWaits: Counter<'job'>;
  readonly httpRequests: Counter<'method' | 'route' | 'status'>;
  readonly replays: Counter<'source'>;
  readonly runsExecuting: Gauge;
  readonly runsQueued: Gauge;

  /**
   * `runCounts` is read at scrape time: runs per job and state, from the database; `replayCache`
   * too: the succeeded runs whose replays are answered from memory, and the bytes they take.
   * `jobs` are the jobs this server loads: their `idem_runs` series read 0 once reported.
   */
  constructor(
    runCounts: () => Promise<ReadonlyArray<{ job: string; state: string; n: number }>>,
    replayCache: () => { readonly runs: number; readonly bytes: number },
    jobs: ReadonlySet<string>,
  ) {
    const registers = [this.registry];
    collectDefaultMetrics({ register: this.registry, prefix: 'idem_' });
    this.chunksCommitted = new Counter({ name: 'idem_chunks_committed_total', help: 'Chunks committed by runs this server executes.', labelNames: ['job', 'step'], registers });
    this.chunkDuration = new Histogram({
      name: 'idem_chunk_duration_seconds',
      help: "Time a chunk's work took (one try), in runs this server executes.",
      labelNames: ['job', 'step'],
      buckets: [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
      registers,
    });
    this.chunkErrors = new Counter({
      name: 'idem_chunk_errors_total',
      help: "Chunk tries that threw: each is retried (transient) or fails the chunk (the run's failure or a skip).",
      labelNames: ['job', 'step'],
      registers,
    });
    this.runsEnded = new Counter({ name: 'idem_runs_ended_total', help: 'Runs this server executed, by how the execution ended.', labelNames: ['job', 'outcome'], registers });
    this.lockWaits = new Counter({ name: 'idem_lock_waits_total', help: "Executions that had to wait for the job's advisory lock (another process ran the job).", labelNames: ['job'], registers });
    this.httpRequests = new Counter({ name: 'idem_http_requests_total', help: 'API requests by route pattern and status code.', labelNames: ['method', 'route', 'status'], registers });
    this.replays = new Counter({
      name: 'idem_api_replays_total',
      help: 'Idempotency-Key replays answered (the 200 answers with Idempotent-Replayed: true; a 422 is not one), by where the answer came from: memory (a succeeded run, see the README) or database.',
      labelNames: ['source'],
      registers,
    });
    new Gauge({
      name: 'idem_api_replay_cache_runs',
      help: 'Succeeded runs whose Idempotency-Key replays this server answers from memory.',
      registers,
      collect() {
        this.set(replayCache().runs);
      },
    });
    new Gauge({
      name: 'idem_api_replay_cache_bytes',
      help: 'Bytes of the answers held for replays from memory (at most 64 MiB).',
      registers,
      collect() {
        this.set(replayCache().bytes);
      },
    });
    this.runsExecuting = new Gauge({ name: 'idem_runs_executing', help: 'Runs executing in this server now (at most --max-runs).', registers });
    this.runsQueued = new Gauge({ name: 'idem_runs_queued', help: 'Runs waiting for a free execution slot in this server.', registers });
    // A series that vanished when its count dropped to nothing would read as "no data" (an alert on
    // `idem_runs{state="failed"} > 0` never resolves, a graph has a gap), so a pair once reported
    // reads 0 after. Kept only for the jobs this server loads and the states runs have: bounded.
    const states: ReadonlySet<string> = new Set(RUN_STATES.filter((s) => s !== 'active'));
    const reported = new Map<string, { readonly job: string; readonly state: string }>();
    // One read of the counts per scrape, shared by idem_runs and idem_database_up. A database that
    // is down or does not answer leaves idem_runs out of the scrape (and idem_database_up 0): the
    // server's own metrics are what an outage must still show (runs ending in `error`, requests).
    let read: Promise<ReadonlyArray<{ job: string; state: string; n: number }> | null> | undefined;
    const counts = () =>
      (read ??= answerWithin(runCounts(), RUN_COUNTS_TIMEOUT_MS, () => new Error('no answer'))
        .catch(() => null)
        .finally(() => setImmediate(() => (read = undefined))));
    new Gauge({
      name: 'idem_runs',
      help: 'Runs in the database by job and state (running only where the lock is held; crashed otherwise). Left out of a scrape when the database could not be read (idem_database_up 0).',
      labelNames: ['job', 'state'],
      registers,
      async collect() {
        const rows = await counts();
        this.reset();
        if (rows === null) return;
        for (const pair of reported.values()) this.set(pair, 0);
        for (const r of rows) {
          this.set({ job: r.job, state: r.state }, r.n);
          if (jobs.has(r.job) && states.has(r.state)) reported.set(`${r.job}\0${r.state}`, { job: r.job, state: r.state });
        }
      },
    });
    new Gauge({
      name: 'idem_database_up',
      help: `1 when this scrape read the run counts (idem_runs) from PostgreSQL, 0 when it could not within ${RUN_COUNTS_TIMEOUT_MS / 1000} s.`,
      registers,
      async collect() {
        this.set((await counts()) === null ? 0 : 1);
      },
    });
  }
}
