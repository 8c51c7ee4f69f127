import Fastify, { LogController, type FastifyBaseLogger, type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify';
import type pg from 'pg';
import type { Logger } from 'pino';
import { errorFields, InterruptedError, UsageError } from '../errors.ts';
import { answerWithin } from '../sleep.ts';
import { SampledWarnings } from './sampled-log.ts';
import { secretMask, silentLogger, structuredMask } from '../log.ts';
import type { Job } from '../job.ts';
import type { Runner } from '../runner.ts';
import { AllowedHosts, allowedHostProblem, isLoopbackAddress } from './allowed-hosts.ts';
import { bearerToken, tokenMatcher } from './api-token.ts';
import { registerApiRoutes } from './api-routes.ts';
import { esc } from './dashboard-html.ts';
import { registerDashboardRoutes } from './dashboard-routes.ts';
import { HttpProblem, PROBLEM_TYPE, problemBody, toProblem } from './problem.ts';
import { ReplayCache } from './replay-cache.ts';
import { RunExecutor } from './run-executor.ts';
import { RunViews } from './run-view.ts';
import type { ServerContext } from './server-context.ts';
import { ServerMetrics } from './server-metrics.ts';

/** Default address: loopback only; exposing the API is an explicit decision (--host 0.0.0.0). */
export const DEFAULT_HOST = '127.0.0.1';
export const DEFAULT_PORT = 7070;
/** Default most runs executed at once by one server. */
export const DEFAULT_MAX_RUNS = 4;
/** Default interval of the rescan for unfinished runs nobody executes. */
export const DEFAULT_RESCAN_MS = 30_000;
/** Default largest request body: params are small; 64 KiB leaves room and bounds abuse. */
export const DEFAULT_BODY_LIMIT = 64 * 1024;
/**
 * Default time a request has to arrive whole, headers and body: a client that stops sending part
 * way would otherwise hold its connection (Fastify turns Node's own limit off). Only arriving is
 * timed: long-polls and event streams answer for as long as they need.
 */
export const DEFAULT_REQUEST_TIMEOUT_MS = 60_000;

export interface ServerOptions {
  readonly runner: Runner;
  /**
   * The pool the API's and dashboard's reads run on: the runner's own pool is the running jobs'
   * (a chunk holds its connection for the whole chunk), so replies must not queue behind them.
   * Same database as the runner; the caller sizes it and closes it after the server.
   */
  readonly reads: pg.Pool;
  readonly jobs: readonly Job[];
  /** The bearer token every mutating request (and every read, without publicRead) must present. */
  readonly token: string;
  /** Let GET requests (dashboard, API reads, metrics) through without a token. Defaults to `false`. */
  readonly publicRead?: boolean;
  /**
   * Host names the server answers besides loopback names and IP addresses (see AllowedHosts), e.g.
   * a reverse proxy's `idem.example.com`. The Host check applies on a loopback bind, and on any
   * bind once this is given. Defaults to none.
   */
  readonly allowedHosts?: readonly string[];
  /** Runs executed at once in this process. Defaults to `4`. */
  readonly maxRuns?: number;
  /** Chunks run at once within one run. Defaults to `1`. */
  readonly concurrency?: number;
  /** Largest request body in bytes. Defaults to `65536`. */
  readonly bodyLimit?: number;
  /** Time a request has to arrive whole (headers and body) before it is answered 408, in ms. Defaults to `60000`. */
  readonly requestTimeoutMs?: number;
  /** Warnings any client can cause (malformed requests, 503s) are logged once per kind and window, in ms. Defaults to `10000`. */
  readonly logWindowMs?: number;
  /** Root logger. Defaults to a silent one. */
  readonly log?: Logger;
  /** How often a live run looks for pause/cancel, in ms. Defaults to `1000`. */
  readonly controlPollMs?: number;
  /** How often event streams look for changes, in ms. Defaults to `500`. */
  readonly sseIntervalMs?: number;
  /** How often the server looks for unfinished runs created over HTTP that nobody executes, in ms. Defaults to `30000`. */
  readonly rescanMs?: number;
  /** Prune succeeded and cancelled runs older than this (ms), hourly; their keys become free again. Defaults to `null` (never). */
  readonly retentionMs?: number | null;
  /** The migrations folder's run keys: retention keeps those runs (see Runner.prune). */
  readonly migrationKeys?: readonly string[];
  /**
   * Text no answer shows, each occurrence replaced by `***` (as is, JSON- and HTML-escaped): the
   * database password's forms, which a run key, params or an error may hold. idem serve passes
   * them, as its log lines mask them. Defaults to none.
   */
  readonly secrets?: readonly string[];
}

export interface IdemServer {
  readonly app: FastifyInstance;
  readonly executor: RunExecutor;
  /** Listens, then queues the unfinished runs created over HTTP. Returns the bound address. */
  listen(opts: { readonly host?: string; readonly port?: number }): Promise<string>;
  /**
   * Stops accepting requests, lets live runs stop at a chunk boundary (interrupted, resumed on next
   * start). Idempotent. `reason`: why it stops (an InterruptedError names the signal the stopped
   * runs are recorded with; SIGTERM otherwise).
   */
  close(deadlineMs?: number, reason?: unknown): Promise<void>;
}

const DEFAULT_LOG_WINDOW_MS = 10_000;

/** How long /readyz waits for PostgreSQL's answer before it says not ready. */
const READY_TIMEOUT_MS = 2_000;

const STATIC_PATHS = new Set(['/assets/dashboard.css', '/assets/dashboard.js', '/favicon.svg']);
const PUBLIC_PATHS = new Set(['/healthz', '/readyz', ...STATIC_PATHS]);

/** Paths answered whatever the Host: probes send the pod's address or name, and learn nothing there. */
const PROBE_PATHS = new Set(['/healthz', '/readyz']);

/** Builds the HTTP server: Fastify with the API, the dashboard and /metrics over one Runner. */
export function createServer(opts: ServerOptions): IdemServer {
  const log = opts.log ?? silentLogger();
  const jobs = new Map(opts.jobs.map((j) => [j.name, j]));
  const runner = opts.runner;
  const views = new RunViews(runner.db, opts.reads, runner.schema, runner, jobs);
  // The read pool's connection settings: the same database, a session of its own.
  // Its listening session also hears `idem resume` release a run: then the rescan runs at once.
  const replays = new ReplayCache(opts.reads.options as pg.ClientConfig, runner.schema, log, () => void rescan());
  // On the read pool, as the API's reads: bounded by its query timeout, never queued behind runs.
  const metrics = new ServerMetrics(() => views.countByState(), () => ({ runs: replays.size, bytes: replays.bytes }), new Set(jobs.keys()));
  const executor = new RunExecutor({
    runner,
    jobs,
    log,
    metrics,
    maxRuns: opts.maxRuns ?? DEFAULT_MAX_RUNS,
    concurrency: opts.concurrency ?? 1,
    controlPollMs: opts.controlPollMs ?? 1_000,
    // A run this server finished is replayed from memory from the first replay on: one read now
    // instead of one per replay until the cache holds it.
    onSucceeded: (runId) => {
      if (!replays.active) return;
      const generation = replays.generation;
      views.get(runId).then(
        (view) => view && replays.offer(view, generation, JSON.stringify(view)),
        () => {}, // Only a warm-up: the first replay reads it instead.
      );
    },
  });
  // The rescan for unfinished runs nobody executes (the timer's, and one when `idem resume` released
  // a run). Two at once are harmless: enqueue passes by a run already queued or running here.
  const rescan = (): Promise<void> =>
    executor.resumeUnfinished().then(
      (n) => void (n > 0 && log.info({ runs: n }, 'resuming unfinished runs')),
      (err: unknown) => log.warn({ err: errorFields(err) }, 'rescan for unfinished runs failed; the next one tries again'),
    );
  const closing = new AbortController();
  const mask = secretMask((opts.secrets ?? []).flatMap((s) => [s, esc(s)]));
  /** An answer masked: a JSON one by its values (never its field names or codes), others as text. */
  const answerMask = structuredMask(mask);
  const ctx: ServerContext = {
    mask,
    runner,
    jobs,
    views,
    replays,
    executor,
    metrics,
    log,
    sseIntervalMs: opts.sseIntervalMs ?? 500,
    openStreams: new Set(),
    closing: closing.signal,
    publicRead: opts.publicRead ?? false,
  };

  const allowedHosts = new AllowedHosts(opts.allowedHosts ?? []);
  // Set by listen() from the addresses bound; on until then, so nothing slips through meanwhile.
  let checkHosts = true;
  const requestTimeout = opts.requestTimeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS;
  /** Counts an answered request and logs its debug line. */
  const answered = (request: FastifyRequest, route: string, status: number, ms: number) => {
    metrics.httpRequests.inc({ method: request.method, route, status: String(status) });
    request.log.debug({ method: request.method, route, status, ms: Math.round(ms) }, 'request');
  };
  // Lines any client can cause, one per kind and window (an unauthenticated flood must not fill the disk).
  const sampled = new SampledWarnings(log, opts.logWindowMs ?? DEFAULT_LOG_WINDOW_MS);
  const app = Fastify({
    loggerInstance: log as FastifyBaseLogger,
    // Request lines go to debug from onResponse below: a busy API would otherwise flood the log.
    logController: new LogController({ disableRequestLogging: true }),
    bodyLimit: opts.bodyLimit ?? DEFAULT_BODY_LIMIT,
    // Behind a proxy the operator sets X-Forwarded-*; idem does not trust them itself.
    trustProxy: false,
    return503OnClosing: true,
    // Counted and logged as every answer is (they never reach a route nor onResponse): a slow or
    // broken client is otherwise invisible. The parser's error itself is not logged (see clientError).
    clientErrorHandler: (err: NodeJS.ErrnoException, socket: import('node:net').Socket) => {
      const status = clientError(err, socket);
      if (status === null) return;
      metrics.httpRequests.inc({ method: 'unparsed', route: 'unmatched', status: String(status) });
      const why = status === 408 ? 'it did not arrive whole in time' : status === 431 ? 'its headers are too large' : 'not valid HTTP';
      sampled.warn(`unparsed ${status}`, { status, code: err.code }, `request refused before routing: ${why} (answered ${status})`);
    },
    // Twice. Fastify sets it on the server after creating it (0, off, unless given); given to Node
    // at creation too, Node derives the headers' timeout from it (at most 60 s) and keeps it no
    // longer than the request's, which it requires: with the default 60 s headers timeout left
    // above a shorter request timeout, Node 20 never timed a body out.
    requestTimeout,
    // Node answers a request without Host with a bare empty 400 of its own; the first onRequest
    // hook below answers it as a problem instead. Node looks for requests past their time every
    // 30 s by default, which would let one stall for up to twice the timeout.
    http: { requireHostHeader: false, requestTimeout, connectionsCheckingInterval: Math.min(5_000, requestTimeout) },
    // Path parameters are checked by their routes (an unknown job is a 404, a run id that is not one
    // a 404), whatever their length: Fastify's default of 100 answers longer ones with its own 414
    // before authentication. Node's header limit (16 KiB, the request line included) bounds them.
    routerOptions: { maxParamLength: 65_536 },
    // A path that cannot be routed at all (a % not followed by UTF-8 in hex) is refused before any
    // hook, authentication included: a problem like every other refusal, not Fastify's own JSON.
    // No hook sees it, onResponse neither: it is counted and logged here, as a request no route matched.
    frameworkErrors: (err, request, reply) => {
      const problem =
        err.code === 'FST_ERR_BAD_URL'
          ? new HttpProblem(400, 'idem.badUrl', 'the request path has a percent-encoding that does not decode; percent-encode the path as UTF-8 (%2F, %C3%A9)')
          : toProblem(err);
      void (reply as FastifyReply).code(problem.status).type(PROBLEM_TYPE).send(problemBody(problem));
      answered(request as FastifyRequest, 'unmatched', problem.status, (reply as FastifyReply).elapsedTime);
    },
  });

  // On every answer Node writes for Fastify (routes, refusals before any hook, event streams): no
  // MIME sniffing of a JSON or text answer into HTML, and no run URL leaked to a linked site.
  app.server.prependListener('request', (request: import('node:http').IncomingMessage, response: import('node:http').ServerResponse) => {
    for (const [name, value] of Object.entries(SECURITY_HEADERS)) response.setHeader(name, value);
    answering.set(request.socket, response);
  });
  // Every open connection, and the answer each is on: at close, a connection whose request has not
  // arrived whole (headers or body still coming) is closed rather than waited for. Node's close
  // waits for it (it is not idle), up to the request timeout; the process for the shutdown deadline.
  const connections = new Set<import('node:net').Socket>();
  const answering = new WeakMap<import('node:net').Socket, import('node:http').ServerResponse>();
  app.server.on('connection', (socket: import('node:net').Socket) => {
    connections.add(socket);
    socket.once('close', () => connections.delete(socket));
  });
  /** Closes the connections no handler answers: a request still arriving, or none (idle, or headers part-sent). */
  const closeUnanswered = () => {
    for (const socket of connections) {
      const response = answering.get(socket);
      // writableFinished, not writableEnded: an answer ended but still in the socket buffer is let finish.
      if (response === undefined || response.writableFinished || !response.req.complete) socket.destroy();
    }
  };

  // Two requests Node answers itself, before any listener of Fastify's: an Expect other than
  // 100-continue (a bare 417 with an empty body) and CONNECT (the socket closed without a word).
  // Answered here as every other refusal is: problem+json, the security headers, counted.
  app.server.on('checkExpectation', (request: import('node:http').IncomingMessage, response: import('node:http').ServerResponse) => {
    const expect = String(request.headers.expect ?? '');
    const problem = new HttpProblem(417, 'idem.expectationFailed', `the server meets no Expect but 100-continue, and the request sent Expect: ${JSON.stringify(expect.slice(0, 40))}; send the request without it`);
    const body = JSON.stringify(problemBody(problem));
    response.writeHead(417, { ...SECURITY_HEADERS, 'content-type': `${PROBLEM_TYPE}; charset=utf-8`, 'content-length': Buffer.byteLength(body), connection: 'close' });
    response.end(body);
    metrics.httpRequests.inc({ method: request.method ?? 'unparsed', route: 'unmatched', status: '417' });
    sampled.warn('417 expect', { status: 417 }, 'request refused: an Expect header other than 100-continue (answered 417)');
  });
  app.server.on('connect', (request: import('node:http').IncomingMessage, socket: import('node:net').Socket) => {
    const problem = new HttpProblem(405, 'idem.methodNotAllowed', 'CONNECT is not allowed: idem serve is not a proxy; send the API\'s requests (GET, POST) to the server itself');
    const body = JSON.stringify(problemBody(problem));
    socket.on('error', () => {});
    socket.resume();
    const security = Object.entries(SECURITY_HEADERS).map(([name, value]) => `${name}: ${value}\r\n`).join('');
    // An empty Allow: the target (an authority, not a path) allows no method (RFC 9110 §10.2.1).
    socket.end(`HTTP/1.1 405 ${problemBody(problem).title}\r\nAllow: \r\nContent-Length: ${Buffer.byteLength(body)}\r\nContent-Type: ${PROBLEM_TYPE}; charset=utf-8\r\n${security}Connection: close\r\n\r\n${body}`);
    setTimeout(() => socket.destroy(), 2_000).unref();
    metrics.httpRequests.inc({ method: 'CONNECT', route: 'unmatched', status: '405' });
    sampled.warn('405 connect', { status: 405, method: request.method }, 'request refused: CONNECT (answered 405)');
  });

  // Params are JSON only: a text/plain body (Fastify parses it by default) is refused with 415.
  app.removeContentTypeParser('text/plain');
  app.removeContentTypeParser('application/json');
  app.addContentTypeParser('application/json', { parseAs: 'buffer' }, jsonBody(app.getDefaultJsonParser('error', 'error')));
  // No body at all is no params, whatever the Content-Type says; a body of another type is a 415.
  app.addContentTypeParser('*', { parseAs: 'buffer' }, (request, body: Buffer, done) => {
    if (body.length === 0) return done(null, undefined);
    const encoding = contentEncodingProblem(request);
    if (encoding) return done(encoding, undefined);
    done(new HttpProblem(415, 'idem.unsupportedMediaType', 'the request body must be JSON; send Content-Type: application/json'), undefined);
  });

  /** Requests whose target is no path (`*`): whatever route Fastify matched them to, they matched none. */
  const notAPath = new WeakSet<object>();
  app.addHook('onRequest', async (request) => {
    // A target that is neither a path nor absolute-form: `*` (asterisk-form, RFC 9112 §3.2.4, only
    // for a server-wide OPTIONS) or `foo`. Until 2026-12-04 `GET *` was routed as `/`, the dashboard
    // (black-box round 19), where `POST *` was a 404.
    const raw = request.raw.url ?? '';
    if (!raw.startsWith('/') && absoluteFormAuthority(raw) === null) {
      notAPath.add(request.raw);
      throw new HttpProblem(400, 'idem.badUrl', `the request target ${JSON.stringify(raw.slice(0, 100))} is not a path; request a path such as /api/runs (see the API reference in the README)`);
    }
    if (request.headers.host === undefined && request.raw.httpVersion === '1.1') {
      throw new HttpProblem(400, 'idem.missingHost', 'the request has no Host header; HTTP/1.1 requires one, so send Host: <the server\'s host:port> (HTTP clients do by themselves)');
    }
    // RFC 9112 §3.2: more than one Host is a 400. Node keeps the first and drops the others, so
    // `Host: 127.0.0.1` then `Host: evil.com` passed the check below while a proxy may route by the second.
    if (hostHeaders(request.raw.rawHeaders) > 1) {
      throw new HttpProblem(400, 'idem.duplicateHost', 'the request has more than one Host header; send exactly one, the name the server is reached by');
    }
    // DNS rebinding: a page whose name now resolves to 127.0.0.1 sends that name as Host. Before
    // authentication, so a --public-read server shows it nothing. (No Host: HTTP/1.0, no browser.)
    // An absolute-form target (`GET http://name/path`) names the host itself, and RFC 9112 §3.2.2
    // says it wins over the Host header: that authority is the one checked.
    const target = absoluteFormAuthority(request.raw.url ?? '');
    const host = target ?? request.headers.host;
    if (checkHosts && host !== undefined && !allowedHosts.allows(host) && !PROBE_PATHS.has(pathOf(request.url))) {
      sampled.warn('421 host', { status: 421, host: host.slice(0, 100) }, 'request refused: Host not allowed (answered 421); if it is a name of this server (a reverse proxy\'s), pass it as --allowed-host');
      throw new HttpProblem(
        421,
        'idem.hostNotAllowed',
        `${target === null ? 'the Host header' : 'the host of the request target'} ${JSON.stringify(host.slice(0, 100))} is not a name of this server (a web page reaching it through DNS rebinding sends its own); use localhost or the server's IP address, or start idem serve with --allowed-host <name> for each name it is reached by`,
      );
    }
  });

  const tokenMatches = tokenMatcher(opts.token);
  app.addHook('onRequest', async (request, reply) => {
    const path = request.url.split('?')[0]!;
    if (PUBLIC_PATHS.has(path)) return;
    if (ctx.publicRead && (request.method === 'GET' || request.method === 'HEAD')) return;
    const token = bearerToken(request.headers.authorization);
    if (token === null) {
      reply.header('www-authenticate', 'Bearer realm="idem"');
      throw new HttpProblem(401, 'idem.unauthorized', 'this endpoint needs the server\'s API token; send Authorization: Bearer <token> with the token from IDEM_API_TOKEN or --token-file');
    }
    if (!tokenMatches(token)) {
      throw new HttpProblem(403, 'idem.forbidden', 'the bearer token is not the server\'s API token; send the token from IDEM_API_TOKEN or the --token-file of the server');
    }
  });

  // Every answer a route or refusal sends (JSON, HTML, metrics) without the secrets; the event
  // streams mask their own frames. Before the length is set, which Fastify does after this hook.
  // Not the dashboard's static files: idem's own code, which a password that is also a word
  // (`postgres`) would break.
  app.addHook('onSend', async (request, _reply, payload) => (typeof payload === 'string' && !STATIC_PATHS.has(request.url.split('?')[0]!) ? answerMask(payload) : payload));

  app.addHook('onResponse', async (request, reply) => {
    // The route pattern, never the URL: a key or id in a label would grow the series without bound.
    const route = notAPath.has(request.raw) ? undefined : request.routeOptions.url;
    answered(request, route ?? methodNotAllowedRoute.get(request.raw) ?? 'unmatched', reply.statusCode, reply.elapsedTime);
  });

  app.setErrorHandler(async (err, request, reply) => {
    const problem = toProblem(err);
    // A refusal a client should simply repeat (503, the 409 of a key inside another request's claim) says when.
    if (problem.status === 503 || problem.extra.retryable === true) reply.header('retry-after', '1');
    // RFC 7694: the encodings the server takes in a request.
    if (problem.code === 'idem.unsupportedContentEncoding') reply.header('accept-encoding', 'identity');
    // A 503 is the database being unreachable, which the readiness probe and every client meet at
    // once: a warning naming the request, not an error line per request of an outage.
    const where = { method: request.method, route: request.routeOptions.url ?? 'unmatched', status: problem.status };
    if (problem.status === 503) sampled.warn(`503 ${where.method} ${where.route}`, { ...where, err: errorFields(err) }, 'request answered 503: the database cannot be reached');
    else if (problem.status >= 500) request.log.error({ ...where, err: errorFields(err) }, 'request failed');
    return reply.code(problem.status).type(PROBLEM_TYPE).send(problemBody(problem));
  });

  app.setNotFoundHandler(async (request, reply) => {
    const path = request.url.split('?')[0]!;
    const { methods: allow, url: matched } = routeMethods.allowed(path);
    if (allow.length > 0) {
      // Counted under the route the path matched (a 405 is that route's answer), as a route's own answers are.
      if (matched !== null) methodNotAllowedRoute.set(request.raw, matched);
      const problem = new HttpProblem(405, 'idem.methodNotAllowed', `${request.method.slice(0, 20)} is not allowed on ${path.slice(0, 100)}; use ${allow.join(', ')}`);
      return reply.code(405).header('allow', allow.join(', ')).type(PROBLEM_TYPE).send(problemBody(problem));
    }
    const problem = new HttpProblem(404, 'idem.notFound', `no route ${request.method} ${request.url.split('?')[0]!.slice(0, 100)}; see the API reference in the README`);
    return reply.code(404).type(PROBLEM_TYPE).send(problemBody(problem));
  });

  // Recorded before any route is added, so it sees them all.
  const routeMethods = new RouteMethods();
  /** The route pattern a path answered 405 matched: its label in idem_http_requests_total. */
  const methodNotAllowedRoute = new WeakMap<import('node:http').IncomingMessage, string>();
  app.addHook('onRoute', (route) => routeMethods.add(route.url, route.method));

  // Liveness: the process serves. Readiness: PostgreSQL answers too, within READY_TIMEOUT_MS (a
  // dead network would otherwise hold the probe until TCP gives up). Restarting a pod cannot fix
  // the database, so only readiness looks at it.
  app.get('/healthz', async () => ({ ok: true }));
  app.get('/readyz', async () => {
    await answerWithin(
      opts.reads.query('select 1'),
      READY_TIMEOUT_MS,
      () => new HttpProblem(503, 'idem.databaseUnavailable', `PostgreSQL did not answer within ${READY_TIMEOUT_MS / 1000} s; check the database and the network to it, then retry`, { retryable: true }),
    );
    return { ok: true, database: 'ok' };
  });
  app.get('/metrics', async (_request, reply) => {
    const text = await metrics.registry.metrics();
    return reply.type(metrics.registry.contentType).send(text);
  });
  registerApiRoutes(app, ctx);
  registerDashboardRoutes(app, ctx);

  app.addHook('onClose', async () => {
    for (const close of [...ctx.openStreams]) close();
  });

  let pruneTimer: NodeJS.Timeout | undefined;
  let rescanTimer: NodeJS.Timeout | undefined;
  const prune = async () => {
    if (!opts.retentionMs) return;
    try {
      const r = await runner.prune(opts.retentionMs, { migrationKeys: opts.migrationKeys ?? [] });
      if (r.runs > 0 || r.skipped > 0) log.info({ runs: r.runs, chunks: r.chunks, skipped: r.skipped }, 'pruned runs past the retention');
    } catch (err) {
      log.warn({ err: errorFields(err) }, 'prune failed; the next hour tries again');
    }
  };

  let closed: Promise<void> | undefined;
  return {
    app,
    executor,
    async listen({ host = DEFAULT_HOST, port = DEFAULT_PORT }) {
      let address: string;
      try {
        address = await app.listen({ host, port });
      } catch (err) {
        throw listenProblem(err, host, port);
      }
      // Only loopback needs it by default: a server bound to a network address is reached by name
      // through proxies and load balancers, and the names are the operator's to list.
      checkHosts = (opts.allowedHosts ?? []).length > 0 || app.addresses().every((a) => typeof a !== 'string' && isLoopbackAddress(a.address));
      replays.start();
      const resumed = await executor.resumeUnfinished();
      if (resumed > 0) log.info({ runs: resumed }, 'resuming unfinished runs');
      // Later too: a run another server left behind when it crashed is picked up within a rescan
      // interval; one `idem resume` released, at once (the replays' session hears it).
      rescanTimer = setInterval(() => void rescan(), opts.rescanMs ?? DEFAULT_RESCAN_MS);
      rescanTimer.unref();
      if (opts.retentionMs) {
        void prune();
        pruneTimer = setInterval(prune, 3_600_000);
        pruneTimer.unref();
      }
      return address;
    },
    close(deadlineMs = 30_000, reason?: unknown) {
      return (closed ??= (async () => {
        closing.abort();
        clearInterval(pruneTimer);
        clearInterval(rescanTimer);
        for (const close of [...ctx.openStreams]) close();
        const appClosed = app.close();
        // After app.close() began: Fastify stops listening and answers new requests 503 from here.
        closeUnanswered();
        await Promise.all([appClosed, executor.shutdown(deadlineMs, reason instanceof InterruptedError ? reason.signal : 'SIGTERM'), replays.close()]);
        sampled.flush();
      })());
    },
  };
}

/**
 * The methods each route path takes. Fastify's router answers a known path asked with another
 * method as not found; this tells that 405 (with the methods to use) from a path no route has.
 */
class RouteMethods {
  readonly #routes: Array<{ readonly pattern: RegExp; readonly url: string; readonly methods: string[] }> = [];

  add(url: string, method: string | readonly string[]): void {
    // `:name` matches one path segment, as in Fastify's router; everything else literally.
    const literal = (text: string) => text.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
    const pattern = new RegExp(`^${url.split(/(:[A-Za-z0-9_]+)/).map((part) => (part.startsWith(':') ? '[^/]+' : literal(part))).join('')}$`);
    const methods = typeof method === 'string' ? [method] : [...method];
    const same = this.#routes.find((r) => r.pattern.source === pattern.source);
    if (same) same.methods.push(...methods.filter((m) => !same.methods.includes(m)));
    else this.#routes.push({ pattern, url, methods });
  }

  /** The methods `path` takes (empty when no route has that path) and the first route pattern it matches (null: none). */
  allowed(path: string): { readonly methods: string[]; readonly url: string | null } {
    const routes = this.#routes.filter((r) => r.pattern.test(path));
    return { methods: routes.flatMap((r) => r.methods), url: routes[0]?.url ?? null };
  }
}

/** How many Host headers a request carries (Node's `headers.host` keeps only the first). */
function hostHeaders(rawHeaders: readonly string[]): number {
  let n = 0;
  for (let i = 0; i < rawHeaders.length; i += 2) if (rawHeaders[i]!.toLowerCase() === 'host') n++;
  return n;
}

/** The authority of an absolute-form request target (`http://name:port/path`), or null for an origin-form one (`/path`). */
function absoluteFormAuthority(target: string): string | null {
  const m = /^[a-z][a-z0-9+.-]*:\/\/([^/?#]*)/i.exec(target);
  if (!m) return null;
  // userinfo@ is not part of the host (RFC 9110 forbids it in http URIs anyway).
  return m[1]!.slice(m[1]!.lastIndexOf('@') + 1);
}

/** The path of a request URL, origin-form or absolute-form, without its query. */
function pathOf(url: string): string {
  const path = url.split('?')[0]!;
  const m = /^[a-z][a-z0-9+.-]*:\/\/[^/]*/i.exec(path);
  return m ? path.slice(m[0].length) || '/' : path;
}

/** Sent with every answer (see the request listener in createServer). */
const SECURITY_HEADERS = { 'x-content-type-options': 'nosniff', 'referrer-policy': 'no-referrer' } as const;

/** UTF-8 decoding that refuses invalid bytes instead of replacing them with U+FFFD. */
const UTF8 = new TextDecoder('utf-8', { fatal: true });

type JsonParser = (request: FastifyRequest, body: string, done: (err: Error | null, body?: unknown) => void) => void;

/**
 * The JSON body parser: UTF-8 only, checked byte for byte (a replaced byte would store other params
 * than were sent and let two different bodies share a fingerprint), an empty body is no params, and
 * Fastify's own parser (which refuses __proto__ and constructor.prototype keys) does the parsing.
 */
function jsonBody(parse: JsonParser) {
  return (request: FastifyRequest, body: Buffer, done: (err: Error | null, body?: unknown) => void): void => {
    const charset = /;\s*charset\s*=\s*"?([^";\s]*)"?/i.exec(request.headers['content-type'] ?? '')?.[1]?.toLowerCase();
    if (charset !== undefined && charset !== 'utf-8' && charset !== 'utf8') {
      return done(new HttpProblem(415, 'idem.unsupportedCharset', `the body's charset is ${JSON.stringify(charset.slice(0, 40))}; send UTF-8 JSON (charset=utf-8 or none)`));
    }
    if (body.length === 0) return done(null, undefined);
    const encoding = contentEncodingProblem(request);
    if (encoding) return done(encoding);
    let text: string;
    try {
      text = UTF8.decode(body);
    } catch {
      return done(new HttpProblem(400, 'idem.invalidEncoding', 'the request body is not valid UTF-8; send the params as UTF-8 JSON'));
    }
    parse(request, text, (err, parsed) => {
      if (!err) return done(null, parsed);
      const key = forbiddenKey(text);
      if (key === null) return done(err);
      done(new HttpProblem(400, 'idem.forbiddenKey', `the body has a ${JSON.stringify(key)} key, which idem refuses (prototype pollution); rename it`));
    });
  };
}

/**
 * A body sent compressed (Content-Encoding gzip, br, …): idem does not inflate request bodies (a
 * small body gains nothing, and inflating would bypass --body-limit), so it is a 415 naming the fix
 * rather than the compressed bytes refused as JSON that is not UTF-8. Null for none or identity.
 */
function contentEncodingProblem(request: FastifyRequest): HttpProblem | null {
  const encoding = request.headers['content-encoding'];
  if (encoding === undefined || /^\s*(identity\s*)?$/i.test(encoding)) return null;
  return new HttpProblem(415, 'idem.unsupportedContentEncoding', `Content-Encoding ${JSON.stringify(encoding.slice(0, 40))} is not supported; send the body uncompressed (no Content-Encoding, or identity)`);
}

/**
 * Why Fastify's parser refused a body that is valid JSON: the key it refuses (`__proto__`, or
 * `constructor` holding `prototype`). Null when the body is not valid JSON at all.
 */
function forbiddenKey(text: string): string | null {
  let found: string | null = null;
  try {
    JSON.parse(text, function (this: unknown, key, value) {
      if (key === '__proto__') found ??= '__proto__';
      if (key === 'constructor' && value !== null && typeof value === 'object' && Object.hasOwn(value, 'prototype')) found ??= 'constructor.prototype';
      return value;
    });
  } catch {
    return null;
  }
  return found;
}

/**
 * Requests Node's HTTP parser refuses before any route sees them (a control character in a header,
 * headers over the size limit, a Content-Length the body does not match) get a problem+json answer
 * like every other error, not Fastify's own JSON; returns the status answered (null: none). The
 * parser's error is not logged: it carries the raw request bytes, the Authorization header included.
 */
function clientError(err: NodeJS.ErrnoException, socket: import('node:net').Socket): number | null {
  if (err.code === 'ECONNRESET' || socket.destroyed) return null;
  const problem =
    err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
      ? new HttpProblem(408, 'idem.requestTimeout', 'the request did not arrive whole within the server\'s request timeout; send it again, all of it')
      : err.code === 'HPE_HEADER_OVERFLOW'
        ? new HttpProblem(431, 'idem.headersTooLarge', 'the request headers are larger than the server accepts; send a short Idempotency-Key (at most 200 characters) and no oversized headers')
        : new HttpProblem(400, 'idem.badRequest', 'the request is not valid HTTP (a control character in a header, or a body that does not match its Content-Length); send a well-formed request');
  const body = JSON.stringify(problemBody(problem));
  if (!socket.writable) {
    socket.destroy();
    return null;
  }
  // Half-close and drain what the client is still sending (the rest of 100 KB of headers): closing
  // a socket with unread input sends a reset, and the client would see ECONNRESET, not the answer.
  socket.on('error', () => {});
  socket.resume();
  const security = Object.entries(SECURITY_HEADERS).map(([name, value]) => `${name}: ${value}\r\n`).join('');
  socket.end(`HTTP/1.1 ${problem.status} ${problemBody(problem).title}\r\nContent-Length: ${Buffer.byteLength(body)}\r\nContent-Type: ${PROBLEM_TYPE}; charset=utf-8\r\n${security}Connection: close\r\n\r\n${body}`);
  setTimeout(() => socket.destroy(), 2_000).unref();
  return problem.status;
}

/** A bind that failed for the operator's --host/--port, as a usage error (exit 2) naming the fix. */
function listenProblem(err: unknown, host: string, port: number): unknown {
  const code = (err as { code?: string }).code;
  const why: Record<string, string> = {
    EADDRINUSE: 'the address is in use; pass another --port, or stop the process that holds it',
    EADDRNOTAVAIL: 'no interface of this machine has that address; pass one of its addresses as --host (127.0.0.1, 0.0.0.0)',
    EACCES: 'the port needs privileges this process lacks; pass a --port above 1023',
    ENOTFOUND: 'the host name does not resolve; pass an address or a resolvable name as --host',
    EAI_AGAIN: 'the host name does not resolve; pass an address or a resolvable name as --host',
  };
  const reason = code ? why[code] : undefined;
  return reason ? new UsageError('cannotListen', `cannot listen on ${host}:${port}: ${reason}`, { cause: err }) : err;
}

/** Checks the serve flags together and throws once with every problem. */
export function checkServeFlags(o: { readonly port: number; readonly host: string; readonly allowedHost?: readonly string[] }): void {
  const problems: string[] = [];
  if (!Number.isInteger(o.port) || o.port < 0 || o.port > 65535) problems.push(`--port must be 0 to 65535, got ${o.port}`);
  if (!o.host) problems.push('--host must not be empty');
  for (const name of o.allowedHost ?? []) {
    const problem = allowedHostProblem(name);
    if (problem) problems.push(problem);
  }
  if (problems.length) throw new UsageError('invalidServeFlags', `${problems.join('; ')}; see idem serve --help`);
}
