import type { FastifyInstance, FastifyReply } from 'fastify';
import { UsageError } from '../errors.ts';
import { fingerprint } from '../fingerprint.ts';
import { NAME as JOB_NAME, validateParams, type Job, type Json } from '../job.ts';
import { reopenFailedRun } from '../operations.ts';
import { slotOfJobKey } from '../schedule.ts';
import { continueCommand } from '../shell-quote.ts';
import { UNSAFE_NUMBER_RULE, unsafeNumberPath } from '../unsafe-number.ts';
import { claimRequest, paramsMismatch, printable } from './claim-request.ts';
import { HttpProblem } from './problem.ts';
import { ENDED_STATES, RUN_STATES, type RunStateFilter, type RunView } from './run-view.ts';
import type { ServerContext } from './server-context.ts';
import { streamEvents } from './sse.ts';

/** What an Idempotency-Key may be: opaque, printable, URL- and log-safe (UUIDs, ULIDs, base64url…). */
export const IDEMPOTENCY_KEY = /^[A-Za-z0-9._:~+=/-]{1,200}$/;

/**
 * What is wrong with an Idempotency-Key IDEMPOTENCY_KEY refused. Node hands header values over as
 * latin1, one character per byte: a UTF-8 key's length is its bytes, so a non-ASCII key is said
 * to be one, not miscounted.
 */
function keyProblem(key: string | string[]): string {
  if (Array.isArray(key)) return 'got several';
  if (key.length === 0) return 'got an empty one';
  if (/[^\x20-\x7e]/.test(key)) return /[\x80-\xff]/.test(key) ? 'got one with non-ASCII characters (a key is ASCII: letters, digits and those marks)' : 'got one with a control character';
  if (key.length > 200) return `got ${key.length} bytes`;
  return `got one with ${JSON.stringify(/[^A-Za-z0-9._:~+=/-]/.exec(key)?.[0] ?? '?')}`;
}

/** The id of the last event of a run's event stream, once the run has ended. */
const ENDED_EVENT_ID = 'ended';

/** States a resume continues as a new attempt (a paused run is resumed by withdrawing its pause). */
const RESUMABLE_STATES: ReadonlySet<string> = new Set(['failed', 'interrupted', 'crashed']);

/** Longest `?wait=` for a long-poll, in seconds. */
export const MAX_WAIT_SECONDS = 60;

/** JSON Schema of a job's params, where its validator can give one (Standard JSON Schema, zod 4). */
export function paramsSchema(job: Job): Json | null {
  const v = job.params as any;
  if (!v) return { type: 'object', properties: {}, additionalProperties: false };
  try {
    const std = v['~standard']?.jsonSchema;
    if (std && typeof std.input === 'function') return std.input({ target: 'draft-2020-12' }) as Json;
    if (typeof v.toJSONSchema === 'function') return v.toJSONSchema() as Json;
  } catch {
    // A validator that cannot describe itself: the form falls back to a JSON box.
  }
  return null;
}

const JSON_TYPE = 'application/json; charset=utf-8';

/** The `idem run` that continues a run the CLI started (see continueCommand). */
function continueRunCommand(run: RunView): string {
  return continueCommand(run.job, run.key, run.params, `<the params GET /api/runs/${run.id} shows>`);
}

/**
 * The body of POST /api/runs/:id/resume: none, `{}`, or `{"allowChangedCode": true|false}`.
 * Anything else is refused, so a misspelt field is not silently a plain resume.
 */
function resumeBody(body: unknown): { allowChangedCode: boolean } {
  if (body === undefined) return { allowChangedCode: false };
  const expected = 'send no body, {}, or {"allowChangedCode":true} to resume with code changed since the run started';
  if (typeof body !== 'object' || body === null || Array.isArray(body)) throw new HttpProblem(400, 'idem.invalidBody', `the body must be a JSON object; ${expected}`);
  const unknown = Object.keys(body).filter((k) => k !== 'allowChangedCode');
  if (unknown.length > 0) throw new HttpProblem(400, 'idem.invalidBody', `the body has an unknown field "${printable(unknown[0]!)}"; ${expected}`);
  const allow = (body as { allowChangedCode?: unknown }).allowChangedCode;
  if (allow !== undefined && typeof allow !== 'boolean') throw new HttpProblem(400, 'idem.invalidBody', `allowChangedCode must be true or false, got ${printable(JSON.stringify(allow) ?? String(allow)).slice(0, 100)}; ${expected}`);
  return { allowChangedCode: allow === true };
}

/** Sets the status and headers of an answer that is one run; returns the reply. */
function sendRun(reply: FastifyReply, status: number, runId: string, replayed: boolean | null): FastifyReply {
  reply.code(status).header('location', `/api/runs/${runId}`);
  if (replayed !== null) reply.header('idempotent-replayed', String(replayed));
  return reply;
}

export function registerApiRoutes(app: FastifyInstance, ctx: ServerContext): void {
  app.get('/api/jobs', async () => ({
    jobs: [...ctx.jobs.values()].map((j) => ({
      name: j.name,
      description: j.description ?? null,
      schedule: j.schedule === undefined ? null : typeof j.schedule === 'string' ? j.schedule : j.schedule,
      steps: j.steps.map((s) => ({ name: s.name, chunked: s.chunks !== undefined })),
      params: paramsSchema(j),
    })),
  }));

  app.post<{ Params: { job: string }; Body: unknown }>('/api/jobs/:job/runs', async (request, reply) => {
    const key = request.headers['idempotency-key'];
    if (key === undefined) {
      throw new HttpProblem(400, 'idem.missingIdempotencyKey', 'the request has no Idempotency-Key header; send one unique key per intended run (e.g. a UUID), and the same key again on a retry');
    }
    // Sent, but empty (HTTP trims the spaces around a value): not missing, as it said until 2026-12-04.
    if (key === '') {
      throw new HttpProblem(400, 'idem.invalidIdempotencyKey', 'the Idempotency-Key header is empty; send one unique key per intended run (e.g. a UUID), and the same key again on a retry');
    }
    // Node joins a repeated header it does not know with ", ": "te2, te3" would be judged as one key.
    const sent = request.raw.headersDistinct['idempotency-key']?.length ?? 1;
    if (sent > 1) {
      throw new HttpProblem(400, 'idem.invalidIdempotencyKey', `the Idempotency-Key header was sent ${sent} times; send it once, with the one key of this run`);
    }
    if (Array.isArray(key) || !IDEMPOTENCY_KEY.test(key)) {
      throw new HttpProblem(
        400,
        'idem.invalidIdempotencyKey',
        `the Idempotency-Key header must be 1 to 200 characters of letters, digits and . _ : ~ + = / -; ${keyProblem(key)}; send e.g. a UUID`,
      );
    }
    const job = ctx.jobs.get(request.params.job);
    if (!job) {
      throw new HttpProblem(404, 'idem.unknownJob', `unknown job "${printable(request.params.job)}"; GET /api/jobs lists the jobs this server runs`);
    }
    // A key that is a slot of the job's schedule is that slot's run, as with `idem run --key`
    // (the executor runs it with ctx.slot); one the schedule never fires at, or not due yet, is refused.
    try {
      slotOfJobKey(job, key, 'Idempotency-Key');
    } catch (err) {
      if (err instanceof UsageError) throw new HttpProblem(422, err.code, err.message);
      throw err;
    }
    // No body at all is no params; a JSON null is a body that is not an object.
    const raw = request.body === undefined ? {} : request.body;
    if (typeof raw !== 'object' || raw === null || Array.isArray(raw)) {
      throw new HttpProblem(400, 'idem.invalidParams', 'the body must be a JSON object of params; send {} for none');
    }
    // Fastify's parser rounded a number beyond ±(2^53−1): another run's key, another row.
    const unsafe = unsafeNumberPath(raw);
    if (unsafe !== null) throw new HttpProblem(400, 'idem.invalidParams', `the body's ${unsafe} ${UNSAFE_NUMBER_RULE}`);
    let params: Json;
    try {
      params = (await validateParams(job, raw)) as Json;
    } catch (err) {
      if (err instanceof UsageError) throw new HttpProblem(400, 'idem.invalidParams', `${err.message.replace(/; drop --params\/--param$/, '')}; fix the body`);
      throw err;
    }
    const fp = fingerprint(params);
    // Replay fast path: a succeeded run's answer is in memory (replay-cache.ts says when it may
    // be); any other committed run for the key needs no transaction and no lock, one read.
    const cached = ctx.replays.get(job.name, key);
    // idem_api_replays_total counts replays answered (Idempotent-Replayed: true), so each path
    // counts after its fingerprint check: a 422 is a refusal, not a replay.
    if (cached) {
      if (cached.fingerprint !== fp) throw paramsMismatch(job.name, key, cached.fingerprint, fp);
      ctx.metrics.replays.inc({ source: 'memory' });
      return sendRun(reply, 200, cached.id, true).type(JSON_TYPE).send(cached.json);
    }
    const generation = ctx.replays.generation;
    const existing = await ctx.views.byKey(job.name, key);
    // A run a prune marked and did not get to delete whole (killed between its batches): finish
    // that deletion; the key then starts a new run, as after any prune.
    if (existing?.state === 'deleting') await ctx.runner.finishDeletion(existing.id, `run "${printable(key)}" of job "${job.name}"`);
    else if (existing) {
      if (existing.fingerprint !== fp) throw paramsMismatch(job.name, key, existing.fingerprint, fp);
      ctx.metrics.replays.inc({ source: 'database' });
      const json = JSON.stringify(existing);
      ctx.replays.offer(existing, generation, json);
      return sendRun(reply, 200, existing.id, true).type(JSON_TYPE).send(json);
    }
    const outcome = await claimRequest(ctx.runner.db, ctx.runner.schema, job.name, key, params, fp);
    if (outcome.kind === 'created') ctx.executor.enqueue({ runId: outcome.run.id, job: job.name, key });
    const view = await ctx.views.get(outcome.run.id);
    if (!view) throw new HttpProblem(404, 'idem.unknownRun', `run ${outcome.run.id} was removed (reset or pruned) while answering; send the request again`);
    // The claim found the run a concurrent request had just committed: a replay read from the database.
    if (outcome.kind === 'replayed') ctx.metrics.replays.inc({ source: 'database' });
    sendRun(reply, outcome.kind === 'created' ? 201 : 200, view.id, outcome.kind === 'replayed');
    return view;
  });

  app.get<{ Querystring: { job?: string; state?: string; limit?: string; cursor?: string } }>('/api/runs', async (request) => {
    const q = request.query;
    const limit = q.limit === undefined ? 50 : Number(q.limit);
    if (!Number.isInteger(limit) || limit < 1 || limit > 500) throw new HttpProblem(400, 'idem.invalidLimit', `limit must be an integer from 1 to 500, got "${printable(String(q.limit))}"; page with cursor for more`);
    if (q.state !== undefined && !(RUN_STATES as readonly string[]).includes(q.state)) {
      throw new HttpProblem(400, 'idem.invalidState', `state must be one of ${RUN_STATES.join(', ')}; got "${printable(q.state)}"`);
    }
    // Any job name is a fine filter (CLI runs of jobs this server does not load included), but a
    // string that cannot be one (a NUL byte PostgreSQL refuses, a page of text) is a client error.
    if (q.job !== undefined && (typeof q.job !== 'string' || !JOB_NAME.test(q.job))) {
      throw new HttpProblem(400, 'idem.invalidJob', `job is not a job name (letters, digits, . _ : -, up to 100 characters), got "${printable(String(q.job)).replace(/[\u0000-\u001f\u007f]/g, '?')}"; pass one name as GET /api/jobs or idem list shows it`);
    }
    if (q.cursor !== undefined && !/^\d{1,18}$/.test(q.cursor)) throw new HttpProblem(400, 'idem.invalidCursor', 'cursor is not a run id; pass the nextCursor of a previous page');
    const runs = await ctx.views.list({
      ...(q.job !== undefined ? { job: q.job } : {}),
      ...(q.state !== undefined ? { state: q.state as RunStateFilter } : {}),
      ...(q.cursor !== undefined ? { before: q.cursor } : {}),
      limit,
    });
    return { runs, nextCursor: runs.length === limit ? runs.at(-1)!.id : null };
  });

  const getRun = async (id: string): Promise<RunView> => {
    const view = await ctx.views.get(id);
    if (!view) throw new HttpProblem(404, 'idem.unknownRun', `no run with id "${printable(id)}"; GET /api/runs lists the runs`);
    return view;
  };

  app.get<{ Params: { id: string }; Querystring: { wait?: string } }>('/api/runs/:id', async (request) => {
    const wait = request.query.wait === undefined ? 0 : Number(request.query.wait);
    if (!Number.isFinite(wait) || wait < 0 || wait > MAX_WAIT_SECONDS) {
      throw new HttpProblem(400, 'idem.invalidWait', `wait must be a number of seconds from 0 to ${MAX_WAIT_SECONDS}; got "${printable(String(request.query.wait))}"`);
    }
    const deadline = Date.now() + wait * 1000;
    let gone = false;
    const onClose = () => (gone = true);
    // A keep-alive socket serves many requests: the listener must not outlive this one.
    const socket = request.raw.socket;
    if (wait > 0) socket.once('close', onClose);
    try {
      for (;;) {
        const view = await getRun(request.params.id);
        if (ENDED_STATES.has(view.state) || Date.now() >= deadline || gone || ctx.closing.aborted) return view;
        await new Promise((r) => setTimeout(r, Math.min(250, Math.max(1, deadline - Date.now()))));
      }
    } finally {
      socket.off('close', onClose);
    }
  });

  for (const action of ['pause', 'resume', 'cancel'] as const) {
    // The CLI's operator actions (compare-and-set on the run row); their refusals map to 404/409.
    app.post<{ Params: { id: string }; Body: unknown }>(`/api/runs/:id/${action}`, async (request) => {
      const allowChangedCode = action === 'resume' ? resumeBody(request.body).allowChangedCode : false;
      const before = await getRun(request.params.id);
      // A run its job's code changed under resumes with the new code only when the operator says
      // so, as `idem run --allow-changed-code` does (recorded on the run); otherwise the refusal is
      // the answer, not a 200 for a resume that would never run.
      const refuseChangedCode = () => {
        if (before.codeChanged && !allowChangedCode) {
          throw new HttpProblem(409, 'idem.codeChanged', before.codeChanged.detail, { codeChanged: { from: before.codeChanged.from, to: before.codeChanged.to } });
        }
      };
      // A run that stopped without an operator (failed, interrupted, crashed) continues where
      // `idem run` would continue it: in the server for a run created over HTTP, from its first
      // unfinished chunk, as a new attempt. A run idem run started is its caller's to continue.
      if (action === 'resume' && RESUMABLE_STATES.has(before.state)) {
        const run = `run "${printable(before.key)}" of job "${printable(before.job)}" is ${before.state}`;
        if (!before.viaApi) {
          throw new HttpProblem(409, 'idem.cannotControl', `${run} and was started by idem run, not over HTTP: continue it with ${continueRunCommand(before)}`);
        }
        if (!ctx.jobs.has(before.job)) {
          throw new HttpProblem(409, 'idem.cannotControl', `${run}, and this server does not load that job: start the server with the --jobs-dir that holds it, or continue it with idem run`);
        }
        refuseChangedCode();
        if (before.state === 'failed') await reopenFailedRun(ctx.runner, before.id, before.attempt);
        ctx.executor.enqueue({ runId: before.id, job: before.job, key: before.key, allowChangedCode });
        return getRun(before.id);
      }
      if (action === 'resume' && before.viaApi && ctx.jobs.has(before.job)) refuseChangedCode();
      const result = await ctx.runner[action](before.job, before.key);
      // A run created over HTTP is this server's to execute: resuming it means continuing it now.
      // Other runs continue on their next invocation, as with idem resume.
      if (action === 'resume' && !result.live && before.viaApi && ctx.jobs.has(before.job)) {
        // Paused after it failed, it is failed again: continued as a resumed failed run is.
        if (result.status === 'failed') await reopenFailedRun(ctx.runner, before.id, before.attempt);
        ctx.executor.enqueue({ runId: before.id, job: before.job, key: before.key, allowChangedCode });
      }
      return getRun(before.id);
    });
  }

  app.get<{ Params: { id: string } }>('/api/runs/:id/events', async (request, reply) => {
    let run: RunView | undefined = await getRun(request.params.id);
    // The last event of an ended run has the id `ended`. EventSource reconnects whenever a stream
    // ends, sending that id back: a 204 is the one answer that makes it stop (it would otherwise get
    // the same final event every `retry` ms, forever). A run resumed since streams again.
    if (request.headers['last-event-id'] === ENDED_EVENT_ID && ENDED_STATES.has(run.state)) return reply.code(204).send();
    streamEvents(
      request,
      reply,
      async () => {
        // The read that answered 404 or 204 is the stream's first event.
        const view = run ?? (await ctx.views.get(request.params.id));
        run = undefined;
        if (!view) return { event: 'gone', data: JSON.stringify({ id: request.params.id }), end: true };
        const end = ENDED_STATES.has(view.state);
        return { event: 'progress', data: JSON.stringify(view), end, ...(end ? { id: ENDED_EVENT_ID } : {}) };
      },
      { intervalMs: ctx.sseIntervalMs, open: ctx.openStreams, mask: ctx.mask },
    );
  });
}
