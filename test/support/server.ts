import { FIXTURE_JOBS, spawnCli, waitFor, type CliProcess } from './cli.ts';

/** The API token the test servers are started with. */
export const TOKEN = 'test-token-0123456789abcdef';

export interface ServeProcess {
  readonly proc: CliProcess;
  /** e.g. http://127.0.0.1:41234 */
  readonly base: string;
}

/** Starts `idem serve --port 0` on the fixture jobs (or `jobsDir`) as a real child process and waits for its address. */
export async function startServe(url: string, args: readonly string[] = [], env: Record<string, string> = {}, jobsDir: string = FIXTURE_JOBS, logLevel = 'warn'): Promise<ServeProcess> {
  const proc = spawnCli(['--jobs-dir', jobsDir, '--log-level', logLevel, 'serve', '--port', '0', ...args], {
    url,
    env: { IDEM_API_TOKEN: TOKEN, ...env },
    timeoutMs: 300_000,
  });
  const base = await waitFor(
    async () => {
      const exited = await Promise.race([proc.done.then(() => true), new Promise((r) => setTimeout(() => r(false), 0))]);
      if (exited) throw new Error(`idem serve exited early: ${proc.stderr()}`);
      return /listening on (http:\/\/[^\s]+)/.exec(proc.stdout())?.[1];
    },
    'idem serve to listen',
    { timeoutMs: 60_000 },
  );
  return { proc, base };
}

export interface ApiResponse<T = any> {
  readonly status: number;
  readonly headers: Headers;
  readonly body: T;
  readonly text: string;
}

/** One HTTP request with the test token (unless `token: null`), JSON in and out. */
export async function api<T = any>(
  base: string,
  method: string,
  path: string,
  opts: { body?: unknown; rawBody?: string; key?: string; token?: string | null; headers?: Record<string, string> } = {},
): Promise<ApiResponse<T>> {
  const headers: Record<string, string> = { ...opts.headers };
  const token = opts.token === undefined ? TOKEN : opts.token;
  if (token !== null) headers.authorization = `Bearer ${token}`;
  if (opts.key !== undefined) headers['idempotency-key'] = opts.key;
  let body: string | undefined;
  if (opts.rawBody !== undefined) body = opts.rawBody;
  else if (opts.body !== undefined) body = JSON.stringify(opts.body);
  if (body !== undefined && !headers['content-type']) headers['content-type'] = 'application/json';
  const res = await fetch(`${base}${path}`, { method, headers, ...(body !== undefined ? { body } : {}) });
  const text = await res.text();
  let parsed: unknown = text;
  try {
    parsed = JSON.parse(text);
  } catch {
    // Not JSON (metrics, HTML): the text.
  }
  return { status: res.status, headers: res.headers, body: parsed as T, text };
}
