import { BusyError, CancelledError, IdemError, ParamsMismatchError, PausedError, UsageError } from '../errors.ts';
import { isRetryable } from '../retry.ts';

/**
 * An HTTP error as RFC 9457 `application/problem+json`: `type` is a stable URN per problem (the
 * same code idem's errors carry), `detail` is one sentence that names the problem and the fix.
 */
export class HttpProblem extends Error {
  readonly status: number;
  readonly code: string;
  readonly extra: Readonly<Record<string, unknown>>;
  constructor(status: number, code: string, detail: string, extra: Record<string, unknown> = {}) {
    super(detail);
    this.status = status;
    this.code = code;
    this.extra = extra;
  }
}

export const PROBLEM_TYPE = 'application/problem+json';

const TITLES: Record<number, string> = {
  400: 'Bad Request',
  401: 'Unauthorized',
  403: 'Forbidden',
  404: 'Not Found',
  405: 'Method Not Allowed',
  408: 'Request Timeout',
  409: 'Conflict',
  413: 'Content Too Large',
  415: 'Unsupported Media Type',
  417: 'Expectation Failed',
  421: 'Misdirected Request',
  422: 'Unprocessable Content',
  431: 'Request Header Fields Too Large',
  500: 'Internal Server Error',
  503: 'Service Unavailable',
};

export interface ProblemBody {
  readonly type: string;
  readonly title: string;
  readonly status: number;
  readonly detail: string;
  readonly [k: string]: unknown;
}

export function problemBody(p: HttpProblem): ProblemBody {
  return { type: `urn:idem:problem:${p.code}`, title: TITLES[p.status] ?? 'Error', status: p.status, detail: p.message, ...p.extra };
}

/**
 * Maps whatever a handler threw to a problem. idem's own errors keep their message (they already
 * say the fix); Fastify's parser errors get idem's wording; anything else is a 500 whose detail
 * says nothing about internals (the log has it).
 */
export function toProblem(err: unknown): HttpProblem {
  if (err instanceof HttpProblem) return err;
  if (err instanceof ParamsMismatchError) return new HttpProblem(422, 'idem.paramsMismatch', err.message);
  if (err instanceof UsageError) {
    const status = err.code === 'idem.unknownJob' || err.code === 'idem.unknownRun' ? 404 : err.code === 'idem.cannotControl' ? 409 : 400;
    return new HttpProblem(status, err.code, err.message);
  }
  if (err instanceof BusyError || err instanceof PausedError || err instanceof CancelledError) return new HttpProblem(409, err.code, err.message);
  if (err instanceof IdemError) return new HttpProblem(500, err.code, err.message);
  const fst = err as { code?: string; statusCode?: number; message?: string };
  switch (fst.code) {
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new HttpProblem(413, 'idem.bodyTooLarge', 'the request body is larger than the server accepts; send smaller params (see --body-limit)');
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return new HttpProblem(415, 'idem.unsupportedMediaType', 'the request body must be JSON; send Content-Type: application/json');
    case 'FST_ERR_CTP_INVALID_CONTENT_LENGTH':
      return new HttpProblem(400, 'idem.badContentLength', 'the Content-Length header does not match the body; send the body as it is');
  }
  if (err instanceof SyntaxError || fst.statusCode === 400) {
    return new HttpProblem(400, 'idem.malformedJson', 'the request body is not valid JSON; send the params as a JSON object, e.g. {"day":"2026-11-30"}');
  }
  // A lost or refused database connection (restart, failover, max_connections) is not the
  // request's fault and nothing was committed: say so, so clients retry with the same key.
  // pg-pool's wait for a free connection that ran out (its connections are all stuck on a database
  // that does not answer) is the same outage.
  if (isRetryable(err) || (err instanceof Error && err.message === 'timeout exceeded when trying to connect')) {
    return new HttpProblem(503, 'idem.databaseUnavailable', 'the server cannot reach its database right now (connection lost or refused); retry in a moment, with the same Idempotency-Key for a POST', { retryable: true });
  }
  return new HttpProblem(500, 'idem.internal', 'the server failed to handle the request; see the server log, then retry');
}
