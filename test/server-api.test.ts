import { spawn } from 'node:child_process';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { CancelledError, InterruptedError, PausedError, PauseWithdrawnError, RunFailedError } from '../src/errors.ts';
import { lockKey } from '../src/fingerprint.ts';
import { EXECUTION_OUTCOMES, executionOutcome } from '../src/server/run-executor.ts';
import { chunkKey } from './fixtures/jobs/counted.ts';
import { ALL_TABLES, BIN, FIXTURE_JOBS, REPO, holdGate, killLeftovers, runCli, runRow, query, snapshot, spawnCli, waitFor, workCounts, lockWaiters } from './support/cli.ts';
import { createTestDatabase, useTestDatabase } from './support/database.ts';
import { api, startServe, TOKEN, type ServeProcess } from './support/server.ts';

const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
let url: string;
let server: ServeProcess;
const TABLES = [...ALL_TABLES, 'idem.api_requests'];

beforeAll(async () => {
  url = testDb.url;
  server = await startServe(url, ['--max-runs', '4']);
});

afterAll(killLeftovers);

const post = (key: string | undefined, body: unknown, opts: { token?: string | null; job?: string } = {}) =>
  api(server.base, 'POST', `/api/jobs/${opts.job ?? 'counted'}/runs`, { body, ...(key !== undefined ? { key } : {}), ...(opts.token !== undefined ? { token: opts.token } : {}) });

/** Asserts a problem+json refusal with one sentence naming the fix. */
function expectProblem(res: { status: number; headers: Headers; body: any }, status: number, code: string) {
  expect(res.status, JSON.stringify(res.body)).toBe(status);
  expect(res.headers.get('content-type')).toMatch(/^application\/problem\+json/);
  expect(res.body).toMatchObject({ type: `urn:idem:problem:${code}`, status });
  // The server's own refusals say the fix after a semicolon; operator refusals carry the CLI's wording.
  if (code !== 'idem.cannotControl') expect(res.body.detail).toMatch(/;/);
  expect(res.body.detail).not.toContain('\n');
}

/** idem_api_replays_total, memory and database together. */
async function replaysTotal(): Promise<number> {
  const { text } = await api(server.base, 'GET', '/metrics');
  return text
    .split('\n')
    .filter((l) => l.startsWith('idem_api_replays_total{'))
    .reduce((n, l) => n + Number(l.slice(l.lastIndexOf(' ') + 1)), 0);
}

async function runCount(): Promise<number> {
  return (await query<{ n: number }>(url, 'select count(*)::int as n from idem.runs'))[0]!.n;
}

describe('authentication', () => {
  it('refuses a missing token with 401 and a wrong one with 403, for writes and reads, writing nothing', async () => {
    const before = await snapshot(url, TABLES);
    const missing = await post('k-auth', {}, { token: null });
    expectProblem(missing, 401, 'idem.unauthorized');
    expect(missing.headers.get('www-authenticate')).toBe('Bearer realm="idem"');
    expectProblem(await post('k-auth', {}, { token: 'wrong-token-0123456789' }), 403, 'idem.forbidden');
    expectProblem(await api(server.base, 'GET', '/api/runs', { token: null }), 401, 'idem.unauthorized');
    expectProblem(await api(server.base, 'GET', '/api/jobs', { token: `${TOKEN}x` }), 403, 'idem.forbidden');
    expectProblem(await api(server.base, 'GET', '/', { token: null }), 401, 'idem.unauthorized');
    expectProblem(await api(server.base, 'GET', '/metrics', { token: null }), 401, 'idem.unauthorized');
    expect(await snapshot(url, TABLES)).toEqual(before);
    // No response carries the token back.
    expect(missing.text).not.toContain(TOKEN);
  });

  it('another authentication scheme (Basic) is a missing token, 401 naming Bearer, not a wrong one', async () => {
    const before = await snapshot(url, TABLES);
    const basic = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'k-basic', body: {}, token: null, headers: { authorization: `Basic ${Buffer.from(`idem:${TOKEN}`).toString('base64')}` } });
    expectProblem(basic, 401, 'idem.unauthorized');
    expect(basic.headers.get('www-authenticate')).toBe('Bearer realm="idem"');
    expect(basic.body.detail).toContain('Authorization: Bearer');
    expect(await snapshot(url, TABLES)).toEqual(before);
  });

  it('"Bearer" with no token after it is a missing token too (401); two words after it are a wrong one (403)', async () => {
    // Black-box round 10: `Authorization: Bearer` alone got 403 "not the server's API token".
    for (const authorization of ['Bearer', 'Bearer ', 'bearer   ']) {
      const r = await api(server.base, 'GET', '/api/jobs', { token: null, headers: { authorization } });
      expectProblem(r, 401, 'idem.unauthorized');
      expect(r.headers.get('www-authenticate')).toBe('Bearer realm="idem"');
    }
    expectProblem(await api(server.base, 'GET', '/api/jobs', { token: null, headers: { authorization: `Bearer ${TOKEN} extra` } }), 403, 'idem.forbidden');
  });
});

describe('starting the server', () => {
  it('refuses to start without a token, or with a short one: exit 2, one line, nothing created', async () => {
    const fresh = await createTestDatabase();
    try {
      const none = await runCli(['--jobs-dir', FIXTURE_JOBS, 'serve', '--port', '0'], { url: fresh.url, env: { IDEM_API_TOKEN: undefined } });
      expect(none.code).toBe(2);
      expect(none.stderr.trim()).toMatch(/^idem: error: idem serve needs an API token: set IDEM_API_TOKEN or pass --token-file <file>/);
      expect(none.stderr.trim().split('\n')).toHaveLength(1);
      const short = await runCli(['--jobs-dir', FIXTURE_JOBS, 'serve', '--port', '0'], { url: fresh.url, env: { IDEM_API_TOKEN: 'short' } });
      expect(short.code).toBe(2);
      expect(short.stderr).toContain('at least 16 characters');
      expect(short.stderr).not.toContain('short;');
      const missingFile = await runCli(['--jobs-dir', FIXTURE_JOBS, 'serve', '--token-file', '/nonexistent/token'], { url: fresh.url });
      expect(missingFile.code).toBe(2);
      expect(missingFile.stderr).toContain('cannot read the token file /nonexistent/token (ENOENT); fix --token-file');
      // An empty token file is named as such, even with IDEM_API_TOKEN set (the file wins).
      const dir = await mkdtemp(path.join(tmpdir(), 'idem-token-'));
      try {
        for (const [content, problem] of [['', 'is empty: put the token on its first line'], ['\n\nsecret-token-0123456789\n', 'has no token on its first line: put the token on its first line']] as const) {
          const file = path.join(dir, 'empty.tok');
          await writeFile(file, content);
          const empty = await runCli(['--jobs-dir', FIXTURE_JOBS, 'serve', '--port', '0', '--token-file', file], { url: fresh.url, env: { IDEM_API_TOKEN: TOKEN } });
          expect(empty.code, empty.stderr).toBe(2);
          expect(empty.stderr.trim().split('\n')).toHaveLength(1);
          expect(empty.stderr).toContain(`--token-file ${file} ${problem}`);
        }
      } finally {
        await rm(dir, { recursive: true, force: true });
      }
      // Refused before connecting: idem's schema was not even created.
      expect(await query(fresh.url, `select count(*)::int as n from pg_namespace where nspname = 'idem'`)).toEqual([{ n: 0 }]);
    } finally {
      await fresh.drop();
    }
  });

  it('refuses a token that is not visible ASCII, from a file or IDEM_API_TOKEN: exit 2, one line without the token, nothing created', async () => {
    // Black-box round 12, B3-7: `ünïcode_tökén_0123456789` was accepted, then no client could send
    // it (UTF-8 bytes got 403, Latin-1 200; fetch and browsers send nothing above U+00FF).
    const fresh = await createTestDatabase();
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-token-'));
    try {
      const file = path.join(dir, 'unicode.tok');
      await writeFile(file, 'ünïcode_tökén_0123456789\n');
      for (const [args, env, from] of [
        [['--token-file', file], { IDEM_API_TOKEN: TOKEN }, `token file ${file}`],
        [[], { IDEM_API_TOKEN: 'ünïcode_tökén_0123456789' }, 'IDEM_API_TOKEN'],
        [[], { IDEM_API_TOKEN: 'token-with-a-bell\u0007-0123456789' }, 'IDEM_API_TOKEN'],
      ] as const) {
        const res = await runCli(['--jobs-dir', FIXTURE_JOBS, 'serve', '--port', '0', ...args], { url: fresh.url, env });
        expect(res.code, res.stderr).toBe(2);
        expect(res.stderr.trim().split('\n'), res.stderr).toHaveLength(1);
        expect(res.stderr).toContain(`the API token from ${from} must be visible ASCII characters only (letters, digits, punctuation: HTTP clients cannot send others in a header); generate one with openssl rand -hex 32`);
        expect(res.stderr).not.toMatch(/ünïcode|bell/);
        expect(res.stdout).not.toContain('listening');
      }
      expect(await query(fresh.url, `select count(*)::int as n from pg_namespace where nspname = 'idem'`)).toEqual([{ n: 0 }]);
    } finally {
      await rm(dir, { recursive: true, force: true });
      await fresh.drop();
    }
  });
});

describe('bad requests write nothing', () => {
  it('answers each with one clear problem', async () => {
    const before = await snapshot(url, TABLES);
    expectProblem(await post(undefined, { chunks: 2 }), 400, 'idem.missingIdempotencyKey');
    // Black-box round 16 (B4-4): a header sent empty (or spaces only: HTTP trims them) was "missing".
    for (const value of ['', '   ']) {
      const empty = await api(server.base, 'POST', '/api/jobs/counted/runs', { body: { chunks: 2 }, headers: { 'idempotency-key': value } });
      expectProblem(empty, 400, 'idem.invalidIdempotencyKey');
      expect(empty.body.detail).toContain('the Idempotency-Key header is empty');
    }
    expectProblem(await post('k-unknown', {}, { job: 'no-such-job' }), 404, 'idem.unknownJob');
    const invalid = await post('k-invalid', { chunks: 'many' });
    expectProblem(invalid, 400, 'idem.invalidParams');
    expect(invalid.body.detail).toContain('chunks must be an integer');
    expectProblem(await post('k-array', [1, 2]), 400, 'idem.invalidParams');
    const rounded = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'k-unsafe-int', rawBody: '{"chunks":2,"ids":[9007199254740993]}' });
    expectProblem(rounded, 400, 'idem.invalidParams');
    expect(rounded.body.detail).toBe('the body\'s ids[0] is a number beyond the safe integers, ±(2^53−1), which would be rounded (two different values would become one run); pass it as a string');
    expectProblem(await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'k-malformed', rawBody: '{"chunks": 2,' }), 400, 'idem.malformedJson');
    expectProblem(await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'k-big', rawBody: JSON.stringify({ label: 'x'.repeat(100_000) }) }), 413, 'idem.bodyTooLarge');
    expectProblem(await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'k-text', rawBody: 'chunks=2', headers: { 'content-type': 'text/plain' } }), 415, 'idem.unsupportedMediaType');
    // The detail says what is wrong with the key (black-box round 10: "ключ" was "8 characters", its UTF-8 bytes).
    for (const [key, why] of [
      ['k'.repeat(201), 'got 201 bytes'],
      ["1' or '1'='1", `got one with "'"`],
      ['x;drop table idem.runs;--', 'got one with ";"'],
      ['clé-été', 'got one with non-ASCII characters'],
      ['\u00ff\u00fe', 'got one with non-ASCII characters'],
      ['ключ', 'got one with non-ASCII characters'],
    ]) {
      const res = await api(server.base, 'POST', '/api/jobs/counted/runs', { body: {}, headers: { 'idempotency-key': Buffer.from(key!, 'utf8').toString('latin1') } });
      expectProblem(res, 400, 'idem.invalidIdempotencyKey');
      expect(res.body.detail, key).toContain(why);
    }
    expectProblem(await api(server.base, 'GET', '/api/runs/999999'), 404, 'idem.unknownRun');
    expectProblem(await api(server.base, 'GET', '/api/runs/drop%20table'), 404, 'idem.unknownRun');
    expectProblem(await api(server.base, 'GET', '/api/runs?state=bogus'), 400, 'idem.invalidState');
    expectProblem(await api(server.base, 'GET', '/api/runs?limit=0'), 400, 'idem.invalidLimit');
    expectProblem(await api(server.base, 'POST', '/api/runs/999999/pause'), 404, 'idem.unknownRun');
    expectProblem(await api(server.base, 'GET', '/api/nothing-here'), 404, 'idem.notFound');
    expect(await snapshot(url, TABLES)).toEqual(before);
  });
});

describe('the dashboard with a long queue of pending runs', () => {
  it('still shows every run that needs an operator, counts each list in full, says where a list is cut, and tags a job new only when it never ran', async () => {
    const count = async (statuses: string[]) => (await query<{ n: number }>(url, 'select count(*)::int as n from idem.runs where status = any($1)', [statuses]))[0]!.n;
    const insert = (job: string, prefix: string, status: string, n: number) =>
      query(url, `insert into idem.runs (job, run_key, params, fingerprint, status) select $1, $2 || g, '{}', 'x', $3 from generate_series(1, $4) g`, [job, prefix, status, n]);
    const html = async () => (await api(server.base, 'GET', '/')).text;
    const section = (page: string, id: string) => new RegExp(`<section class="group" id="${id}"[\\s\\S]*?</section>`).exec(page)?.[0] ?? '';
    const heading = (page: string, id: string) => /<span class="count">([\d,]+\+?)<\/span>/.exec(section(page, id))?.[1];
    const jobTag = (page: string, job: string) => new RegExp(`<article class="card job" data-job="${job}">\\s*<header class="card-head"><span class="title">${job}</span><span class="tag tag-([a-z]+)"`).exec(page)?.[1];
    // Only this test and the gauge test (which deletes them) run `ranged` on this server.
    expect(jobTag(await html(), 'ranged')).toBe('new');
    try {
      // Runs that need an operator, older than a queue of 2 000 pending runs.
      await insert('ranged', 'dash-ok-', 'succeeded', 13);
      await insert('ranged', 'dash-failed-', 'failed', 2);
      await insert('counted', 'dash-crashed-', 'running', 1);
      await insert('counted', 'dash-paused-', 'paused', 1);
      await insert('counted', 'dash-interrupted-', 'interrupted', 1);
      await insert('counted', 'dash-queued-', 'pending', 2000);
      // More completed runs than are counted: the count stops at 10 000.
      await insert('counted', 'dash-cancelled-', 'cancelled', 10_000);
      const page = await html();
      const active = section(page, 'active');
      for (const [key, state] of [['dash-failed-1', 'failed'], ['dash-failed-2', 'failed'], ['dash-crashed-1', 'crashed'], ['dash-paused-1', 'paused'], ['dash-interrupted-1', 'interrupted']]) {
        expect(active).toMatch(new RegExp(`<article class="card run" data-run-id="\\d+" data-state="${state}">(?:(?!</article>)[\\s\\S])*<div class="key"[^>]*><bdi>${key}</bdi></div>`));
      }
      expect(active).not.toContain('dash-queued-');
      // Each heading is the list's total, not the number of cards shown.
      expect(heading(page, 'active')).toBe(String(await count(['running', 'failed', 'interrupted', 'paused'])));
      const pending = await count(['pending']);
      expect(pending).toBeGreaterThanOrEqual(2000);
      expect(heading(page, 'pending')).toBe(pending.toLocaleString('en-US'));
      expect(section(page, 'pending')).toContain(`showing the newest 24 of ${pending.toLocaleString('en-US')};`);
      expect(section(page, 'pending').match(/<article class="card run"/g)).toHaveLength(24);
      expect(heading(page, 'completed')).toBe('10,000+');
      expect(section(page, 'completed')).toContain('showing the newest 24 of 10,000+;');
      // `ranged` ran (its latest run is far behind the queue): tagged with that run's state, not new.
      expect(jobTag(page, 'ranged')).toMatch(/^(succeeded|failed)$/);
    } finally {
      await query(url, `delete from idem.runs where run_key like 'dash-%'`);
    }
  });
});

describe('a method a route does not take', () => {
  it('is 405 with an Allow header naming the methods it takes, not 404; a path no route has stays 404; nothing is written', async () => {
    const before = await snapshot(url, TABLES);
    for (const [method, path, allow] of [
      ['GET', '/api/jobs/counted/runs', 'POST'],
      ['PUT', '/api/runs/1', 'GET, HEAD'],
      ['DELETE', '/api/runs/1', 'GET, HEAD'],
      ['GET', '/api/runs/1/pause', 'POST'],
      ['POST', '/api/jobs', 'GET, HEAD'],
      ['OPTIONS', '/api/runs', 'GET, HEAD'],
      ['DELETE', '/', 'GET, HEAD'],
    ] as const) {
      const res = await api(server.base, method, path);
      expectProblem(res, 405, 'idem.methodNotAllowed');
      expect(res.headers.get('allow'), `${method} ${path}`).toBe(allow);
      expect(res.body.detail).toContain(`${method} is not allowed on ${path}; use ${allow}`);
    }
    expectProblem(await api(server.base, 'DELETE', '/api/nothing-here'), 404, 'idem.notFound');
    expectProblem(await api(server.base, 'GET', '/api/jobs/counted/runs/extra'), 404, 'idem.notFound');
    // Authentication comes first, as for every other answer.
    expectProblem(await api(server.base, 'PUT', '/api/runs/1', { token: null }), 401, 'idem.unauthorized');
    expect(await snapshot(url, TABLES)).toEqual(before);
  });
});

describe('POST /api/jobs/:job/runs', () => {
  it('creates once (201), replays the stored run (200, Idempotent-Replayed), refuses other params (422)', async () => {
    const created = await post('k-first', { chunks: 3 });
    expect(created.status, created.text).toBe(201);
    expect(created.headers.get('location')).toBe(`/api/runs/${created.body.id}`);
    expect(created.headers.get('idempotent-replayed')).toBe('false');
    expect(created.body).toMatchObject({ job: 'counted', key: 'k-first', params: { chunks: 3, pauseMs: 0, label: '', gate: null }, viaApi: true });
    // Other params while the run is not held in memory (the database path): a 422, not a replay.
    const replays = await replaysTotal();
    expectProblem(await post('k-first', { chunks: 4 }), 422, 'idem.paramsMismatch');
    expect(await replaysTotal()).toBe(replays);

    const done = await api(server.base, 'GET', `${created.headers.get('location')}?wait=30`);
    expect(done.status).toBe(200);
    // A single step counts as one chunk: 1 + 3 + 1.
    expect(done.body).toMatchObject({ id: created.body.id, state: 'succeeded', progress: { done: 5, total: 5, percent: 100 } });
    expect(done.body.steps.map((s: any) => [s.name, s.status, s.done])).toEqual([
      ['prepare', 'done', 1],
      ['work', 'done', 3],
      ['finish', 'done', 1],
    ]);

    const replay = await post('k-first', { chunks: 3 });
    expect(replay.status).toBe(200);
    expect(replay.headers.get('idempotent-replayed')).toBe('true');
    expect(replay.headers.get('location')).toBe(`/api/runs/${created.body.id}`);
    expect(replay.body).toMatchObject({ id: created.body.id, state: 'succeeded' });
    // Key order and defaults do not matter: the fingerprint is of the validated params.
    expect((await post('k-first', { pauseMs: 0, chunks: 3 })).status).toBe(200);

    const before = await snapshot(url, TABLES);
    const replaysBefore = await replaysTotal();
    const other = await post('k-first', { chunks: 4 });
    expectProblem(other, 422, 'idem.paramsMismatch');
    // idem_api_replays_total counts replays answered; a refusal is not one.
    expect(await replaysTotal()).toBe(replaysBefore);
    expect(other.body.storedFingerprint).toBe(created.body.fingerprint);
    expect(other.body.requestFingerprint).toMatch(/^sha256:/);
    expect(other.body.detail).toContain(created.body.fingerprint);
    expect(await snapshot(url, TABLES)).toEqual(before);
    expect(await workCounts(url, 'k-first')).toEqual(new Map([[chunkKey(1), 1], [chunkKey(2), 1], [chunkKey(3), 1]]));
  });

  it('a request whose key is inside another request\'s claim is 409 at once, retryable, with Retry-After; nothing is written', async () => {
    // The claim's transaction-level lock on (schema, job, key), held here as a request still inside its claim holds it.
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      await holder.query('begin');
      await holder.query('select pg_advisory_xact_lock($1::bigint)', [lockKey('idem:http:counted:k-held')]);
      const before = await snapshot(url, TABLES);
      const res = await post('k-held', { chunks: 1 });
      expectProblem(res, 409, 'idem.requestInProgress');
      expect(res.body.retryable).toBe(true);
      expect(res.headers.get('retry-after')).toBe('1');
      expect(await snapshot(url, TABLES)).toEqual(before);
    } finally {
      await holder.query('rollback').catch(() => {});
      await holder.end();
    }
    // Once the claim is over, the same request goes through, and its run is done before this test
    // ends (left running, it wrote into the snapshot of whichever test came next: ci71, seed 693567).
    const created = await post('k-held', { chunks: 1 });
    expect(created.status).toBe(201);
    expect((await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body.state).toBe('succeeded');
  });

  it('100 concurrent POSTs with one key: one 201, the rest 200 replays or 409, one run, one execution; idem_api_replays_total rises by the replays answered', async () => {
    const replays = await replaysTotal();
    const responses = await Promise.all(Array.from({ length: 100 }, () => post('k-hundred', { chunks: 5 })));
    // Every path that answers a replay (memory, a database read, the claim finding the run) counts it, once.
    expect(await replaysTotal()).toBe(replays + responses.filter((r) => r.headers.get('idempotent-replayed') === 'true').length);
    const statuses = responses.map((r) => r.status);
    expect(statuses.filter((s) => s === 201)).toHaveLength(1);
    expect(statuses.every((s) => s === 201 || s === 200 || s === 409)).toBe(true);
    for (const r of responses.filter((x) => x.status === 409)) expectProblem(r, 409, 'idem.requestInProgress');
    for (const r of responses.filter((x) => x.status === 200)) expect(r.headers.get('idempotent-replayed')).toBe('true');
    const ids = new Set(responses.filter((r) => r.status < 300).map((r) => r.body.id));
    expect(ids.size).toBe(1);
    const rows = await query(url, `select id::text from idem.runs where run_key = 'k-hundred'`);
    expect(rows).toHaveLength(1);
    expect((await api(server.base, 'GET', `/api/runs/${rows[0].id}?wait=30`)).body.state).toBe('succeeded');
    // One execution: the single steps ran once, every chunk committed once.
    expect(await workCounts(url, 'k-hundred', 'prepare')).toEqual(new Map([['step', 1]]));
    expect([...(await workCounts(url, 'k-hundred')).values()]).toEqual([1, 1, 1, 1, 1]);
  });

  it('10 different keys at once make 10 runs, each executed once', async () => {
    const keys = Array.from({ length: 10 }, (_, i) => `k-ten-${i}`);
    const responses = await Promise.all(keys.map((k) => post(k, { chunks: 2 })));
    expect(responses.map((r) => r.status)).toEqual(keys.map(() => 201));
    for (const r of responses) expect((await api(server.base, 'GET', `/api/runs/${r.body.id}?wait=60`)).body.state).toBe('succeeded');
    for (const k of keys) expect(await workCounts(url, k, 'prepare')).toEqual(new Map([['step', 1]]));
    // Replayed all at once (concurrent lookups share statements): each answer is its own key's run,
    // and the one sent with other params is refused alone.
    const replays = await Promise.all([...keys.map((k) => post(k, { chunks: 2 })), post(keys[3]!, { chunks: 3 }), post('k-ten-none', { chunks: 2 }, { job: 'nope' })]);
    expect(replays.slice(0, 10).map((r) => [r.status, r.headers.get('idempotent-replayed'), r.body.key, r.body.id])).toEqual(responses.map((r, i) => [200, 'true', keys[i], r.body.id]));
    expectProblem(replays[10]!, 422, 'idem.paramsMismatch');
    expectProblem(replays[11]!, 404, 'idem.unknownJob');
    const list = await api(server.base, 'GET', '/api/runs?job=counted&state=succeeded&limit=4');
    expect(list.body.runs).toHaveLength(4);
    const page2 = await api(server.base, 'GET', `/api/runs?job=counted&state=succeeded&limit=4&cursor=${list.body.nextCursor}`);
    expect(page2.body.runs).toHaveLength(4);
    expect(Number(page2.body.runs[0].id)).toBeLessThan(Number(list.body.runs[3].id));
  });
});

describe('operator actions', () => {
  // 30 chunks of 200 ms: the live run sees a request within its 1 s control poll, long before its end.
  const SLOW = { chunks: 30, pauseMs: 200 };
  const chunksDone = async (key: string) => (await workCounts(url, key)).size;

  it('pause stops a live run at a chunk boundary, resume continues it in the server, cancel is refused once it ended', async () => {
    const created = await post('k-pause', SLOW);
    expect(created.status).toBe(201);
    const id = created.body.id;
    await waitFor(async () => (await chunksDone('k-pause')) >= 1, 'the first chunk');
    // A replay and a read of the live run say running: the held locks come in the same statement.
    expect(await post('k-pause', SLOW)).toMatchObject({ status: 200, body: { id, state: 'running', holder: expect.any(String) } });
    expect((await api(server.base, 'GET', `/api/runs/${id}`)).body).toMatchObject({ id, state: 'running' });
    const paused = await api(server.base, 'POST', `/api/runs/${id}/pause`);
    expect(paused.status).toBe(200);
    expect(paused.body).toMatchObject({ id, requested: 'pause' });
    const stopped = await api(server.base, 'GET', `/api/runs/${id}?wait=30`);
    expect(stopped.body.state).toBe('paused');
    expect(stopped.body.progress.done).toBeLessThan(32);
    expectProblem(await api(server.base, 'POST', `/api/runs/${id}/pause`), 409, 'idem.cannotControl');
    const resumed = await api(server.base, 'POST', `/api/runs/${id}/resume`);
    expect(resumed.status).toBe(200);
    const done = await api(server.base, 'GET', `/api/runs/${id}?wait=30`);
    expect(done.body).toMatchObject({ state: 'succeeded', progress: { done: 32 } });
    expect([...(await workCounts(url, 'k-pause')).values()]).toEqual(Array.from({ length: 30 }, () => 1));
    expectProblem(await api(server.base, 'POST', `/api/runs/${id}/cancel`), 409, 'idem.cannotControl');
    // Mutations need the token.
    expectProblem(await api(server.base, 'POST', `/api/runs/${id}/cancel`, { token: null }), 401, 'idem.unauthorized');
  });

  it('idem resume from the CLI continues a paused run created over HTTP in the server at once, not at its next rescan', async () => {
    // Black-box round 18 (B9-2): the README said "at once"; the server took it up at its rescan,
    // every 30 s (this server has the default interval).
    const created = await post('k-cli-resume', SLOW);
    expect(created.status).toBe(201);
    const id = created.body.id;
    await waitFor(async () => (await chunksDone('k-cli-resume')) >= 1, 'the first chunk');
    expect((await api(server.base, 'POST', `/api/runs/${id}/pause`)).status).toBe(200);
    expect((await api(server.base, 'GET', `/api/runs/${id}?wait=30`)).body.state).toBe('paused');
    const resumed = await runCli(['--jobs-dir', FIXTURE_JOBS, 'resume', 'counted', '--key', 'k-cli-resume'], { url });
    expect(resumed.code, resumed.stderr).toBe(0);
    const at = performance.now();
    await waitFor(async () => ((await runRow(url, 'counted', 'k-cli-resume'))?.attempt === 2 ? true : undefined), 'the server to take the run up again', { timeoutMs: 5_000, intervalMs: 50 });
    expect(performance.now() - at).toBeLessThan(5_000);
    const done = await api(server.base, 'GET', `/api/runs/${id}?wait=30`);
    expect(done.body).toMatchObject({ state: 'succeeded', progress: { done: 32 } });
    expect([...(await workCounts(url, 'k-cli-resume')).values()]).toEqual(Array.from({ length: 30 }, () => 1));
  });

  it('a resume while the server is honouring a pause is not lost: the run continues in the server, chunks once', async () => {
    // Ordered by a gate: the run has seen the pause (it logs so) while chunk 1 is held in flight;
    // the resume withdraws the request; only then may the chunk commit and the attempt end.
    const key = 'k-pause-race';
    const gate = await holdGate(url, 'g-api-pause-race');
    let id: string;
    try {
      const created = await post(key, { chunks: 6, gate: 'g-api-pause-race' });
      expect(created.status).toBe(201);
      id = created.body.id;
      await waitFor(
        async () => (await lockWaiters(url)) > 0,
        'chunk 1 to wait at the gate',
      );
      expect((await api(server.base, 'POST', `/api/runs/${id}/pause`)).body).toMatchObject({ id, requested: 'pause' });
      await waitFor(
        async () => server.proc.stderr().split('\n').some((l) => l.includes(`"runKey":"${key}"`) && l.includes('pause requested by an operator')),
        'the live run to see the pause',
      );
      const resumed = await api(server.base, 'POST', `/api/runs/${id}/resume`);
      expect(resumed.status).toBe(200);
      expect(resumed.body).toMatchObject({ id, state: 'running', requested: null });
    } finally {
      await gate.release();
    }
    const done = await api(server.base, 'GET', `/api/runs/${id!}?wait=30`);
    expect(done.body).toMatchObject({ state: 'succeeded', attempt: 2, progress: { done: 8 } });
    expect(await workCounts(url, key)).toEqual(new Map(Array.from({ length: 6 }, (_, i) => [chunkKey(i + 1), 1])));
  });

  it('a failed run created over HTTP, paused and then resumed, continues in the server and succeeds', async () => {
    await query(url, `insert into fail_chunks (chunk_key) values ('c0004')`);
    let id: string;
    try {
      const created = await post('k-failed-paused', { chunks: 4 });
      expect(created.status).toBe(201);
      id = created.body.id;
      expect((await api(server.base, 'GET', `/api/runs/${id}?wait=30`)).body).toMatchObject({ state: 'failed' });
      const paused = await api(server.base, 'POST', `/api/runs/${id}/pause`);
      expect(paused.status, paused.text).toBe(200);
      expect(paused.body).toMatchObject({ state: 'paused' });
    } finally {
      await query(url, `delete from fail_chunks where chunk_key = 'c0004'`);
    }
    const resumed = await api(server.base, 'POST', `/api/runs/${id}/resume`);
    expect(resumed.status, resumed.text).toBe(200);
    const done = await api(server.base, 'GET', `/api/runs/${id}?wait=30`);
    expect(done.body).toMatchObject({ state: 'succeeded', attempt: 2 });
    expect([...(await workCounts(url, 'k-failed-paused')).values()]).toEqual([1, 1, 1, 1]);
  });

  it('resume retries a failed run created over HTTP in the server, from its first unfinished chunk; a CLI run is left to idem run', async () => {
    await query(url, `insert into fail_chunks (chunk_key) values ('c0023')`);
    let id: string;
    try {
      const created = await post('k-failed', { chunks: 23 });
      expect(created.status).toBe(201);
      id = created.body.id;
      const failed = await api(server.base, 'GET', `/api/runs/${id}?wait=30`);
      expect(failed.body).toMatchObject({ state: 'failed', error: { message: expect.stringContaining('injected failure in chunk c0023') } });
    } finally {
      await query(url, `delete from fail_chunks where chunk_key = 'c0023'`);
    }
    const resumed = await api(server.base, 'POST', `/api/runs/${id}/resume`);
    expect(resumed.status, resumed.text).toBe(200);
    expect(resumed.body.id).toBe(id);
    const done = await api(server.base, 'GET', `/api/runs/${id}?wait=30`);
    expect(done.body).toMatchObject({ state: 'succeeded', attempt: 2 });
    // c0001…c0022 committed once in the first attempt, c0023 once in the second.
    expect([...(await workCounts(url, 'k-failed')).values()]).toEqual(Array.from({ length: 23 }, () => 1));

    // A failed run that idem run started is its caller's to retry: 409 naming the command, nothing written.
    await query(url, `insert into fail_chunks (chunk_key) values ('c0024')`);
    try {
      const cli = await runCli(['--jobs-dir', FIXTURE_JOBS, 'run', 'counted', '--key', 'k-failed-cli', '--params', JSON.stringify({ chunks: 24 })], { url });
      expect(cli.code).toBe(1);
    } finally {
      await query(url, `delete from fail_chunks where chunk_key = 'c0024'`);
    }
    const cliRun = await runRow(url, 'counted', 'k-failed-cli');
    const before = await snapshot(url, TABLES);
    const refused = await api(server.base, 'POST', `/api/runs/${cliRun.id}/resume`);
    expectProblem(refused, 409, 'idem.cannotControl');
    expect(refused.body.detail).toContain('idem run counted --key k-failed-cli');
    expect(await snapshot(url, TABLES)).toEqual(before);
  });

  it("the 409 for a failed run idem run started names a command that continues it: its params and its whole key, shell-quoted", async () => {
    // A key longer than the 60 characters messages show, with a character the shell would split on.
    const key = `cli params ${'k'.repeat(60)}`;
    await query(url, `insert into fail_chunks (chunk_key) values ('c0013')`);
    try {
      const cli = await runCli(['--jobs-dir', FIXTURE_JOBS, 'run', 'counted', '--key', key, '--params', JSON.stringify({ chunks: 13, label: "it's" })], { url });
      expect(cli.code).toBe(1);
    } finally {
      await query(url, `delete from fail_chunks where chunk_key = 'c0013'`);
    }
    const run = await runRow(url, 'counted', key);
    const refused = await api(server.base, 'POST', `/api/runs/${run.id}/resume`);
    expectProblem(refused, 409, 'idem.cannotControl');
    const command = /continue it with (idem run .*)$/.exec(refused.body.detail)?.[1];
    expect(command, refused.body.detail).toBeDefined();
    // Run as a user would paste it (idem being this checkout's CLI on the fixture jobs).
    const done = await new Promise<{ code: number | null; stderr: string }>((resolve) => {
      const sh = spawn('sh', ['-c', `idem() { "${process.execPath}" "${BIN}" --jobs-dir "${FIXTURE_JOBS}" "$@"; }; ${command!}`], {
        env: { ...process.env, DATABASE_URL: url },
      });
      let stderr = '';
      sh.stderr.on('data', (d) => (stderr += d));
      sh.on('exit', (code) => resolve({ code, stderr }));
    });
    expect(done.code, done.stderr).toBe(0);
    expect((await runRow(url, 'counted', key)).status).toBe('succeeded');
    expect([...(await workCounts(url, key)).values()]).toEqual(Array.from({ length: 13 }, () => 1));
  });

  it('cancel stops a live run; it never continues', async () => {
    const created = await post('k-cancel', SLOW);
    const id = created.body.id;
    await waitFor(async () => (await chunksDone('k-cancel')) >= 1, 'the first chunk');
    expect((await api(server.base, 'POST', `/api/runs/${id}/cancel`)).status).toBe(200);
    const ended = await api(server.base, 'GET', `/api/runs/${id}?wait=30`);
    expect(ended.body.state).toBe('cancelled');
    expect(ended.body.progress.done).toBeLessThan(32);
    expectProblem(await api(server.base, 'POST', `/api/runs/${id}/resume`), 409, 'idem.cannotControl');
    // A replay of the creating request shows the cancelled run and starts nothing.
    const replay = await post('k-cancel', SLOW);
    expect(replay).toMatchObject({ status: 200, body: { id, state: 'cancelled' } });
  });
});

describe('reads', () => {
  it('GET /api/jobs lists the jobs with their steps and params schema where known', async () => {
    const res = await api(server.base, 'GET', '/api/jobs');
    expect(res.status).toBe(200);
    const ranged = res.body.jobs.find((j: any) => j.name === 'ranged');
    expect(ranged).toMatchObject({ description: expect.any(String), steps: [{ name: 'double', chunked: true }], params: { type: 'object', properties: {} } });
    expect(res.body.jobs.find((j: any) => j.name === 'counted').params).toBeNull();
  });

  it('a run another process executes reads running while that process lives, crashed once it was killed', async () => {
    const cli = spawnCli(['--jobs-dir', FIXTURE_JOBS, 'run', 'counted', '--key', 'k-cli', '--params', JSON.stringify({ chunks: 30, pauseMs: 200 })], { url });
    await waitFor(async () => (await workCounts(url, 'k-cli')).size >= 1, 'the first chunk of the CLI run');
    const id = String((await runRow(url, 'counted', 'k-cli')).id);
    // The held advisory locks are read in the view's own statement: the CLI's lock counts.
    expect((await api(server.base, 'GET', `/api/runs/${id}`)).body).toMatchObject({ id, state: 'running', viaApi: false });
    cli.child.kill('SIGKILL');
    await cli.done;
    await waitFor(async () => (await api(server.base, 'GET', `/api/runs/${id}`)).body.state === 'crashed', 'the killed run to read crashed');
    expect(await runRow(url, 'counted', 'k-cli')).toMatchObject({ status: 'running' });
    const crashed = await api(server.base, 'GET', '/api/runs?job=counted&state=crashed');
    expect(crashed.body.runs.map((r: any) => r.id)).toContain(id);
    expect((await api(server.base, 'GET', '/api/runs?job=counted&state=running')).body.runs.map((r: any) => r.id)).not.toContain(id);
  });

  it('GET /api/runs/:id/events streams progress until the run ends', async () => {
    const created = await post('k-events', { chunks: 3, pauseMs: 100 });
    const res = await fetch(`${server.base}/api/runs/${created.body.id}/events`, { headers: { authorization: `Bearer ${TOKEN}` } });
    expect(res.status).toBe(200);
    expect(res.headers.get('content-type')).toMatch(/^text\/event-stream/);
    const text = await res.text(); // the server ends the stream when the run has ended
    const events = text.split('\n\n').filter((b) => b.startsWith('event: progress')).map((b) => JSON.parse(b.split('\n').filter((l) => l.startsWith('data: ')).map((l) => l.slice(6)).join('\n')));
    expect(events.length).toBeGreaterThanOrEqual(1);
    expect(events.at(-1)).toMatchObject({ id: created.body.id, state: 'succeeded', progress: { done: 5, percent: 100 } });
  });

  it("a run key holding DATABASE_URL's password is masked in every answer (API, event stream, dashboard), as log lines mask it", async () => {
    // Black-box round 13 (B2-12): the API and the dashboard showed such a key whole.
    const password = decodeURIComponent(new URL(url).password);
    expect(password).toMatch(/^[A-Za-z0-9._~-]{4,}$/);
    const key = `${password}-http`;
    const created = await post(key, { chunks: 1 });
    expect(created.status, created.text).toBe(201);
    expect(created.body.key).toBe('***-http');
    const id = created.body.id as string;
    expect((await api(server.base, 'GET', `/api/runs/${id}?wait=30`)).body.state).toBe('succeeded');
    const events = await fetch(`${server.base}/api/runs/${id}/events`, { headers: { authorization: `Bearer ${TOKEN}` } });
    const answers = [created.text, (await post(key, { chunks: 1 })).text, await events.text()];
    for (const p of [`/api/runs/${id}`, '/api/runs?job=counted', '/', `/runs/${id}`]) answers.push((await api(server.base, 'GET', p)).text);
    for (const text of answers) expect(text).not.toContain(password);
    expect(answers.at(-1)).toContain('***-http');
  });

  it("the API token in a job's error is masked wherever the error shows: API, event stream, dashboard, log lines, idem status, the stored run", async () => {
    // Black-box round 16 (B4-1, high): the password was masked in a run's error, the token was not.
    // IDEM_API_TOKEN is in every job's environment, so a library that dumps its environment into an
    // error put the write token in front of every reader (under --public-read, anyone).
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-leak-'));
    try {
      await writeFile(
        path.join(dir, 'leak.mjs'),
        `export default { name: 'leak', steps: [{ name: 'work', run() { throw new Error('env dump: token ' + process.env.IDEM_API_TOKEN + ' end'); } }] };\n`,
      );
      const leaky = await startServe(url, [], {}, dir, 'info');
      try {
        const created = await api(leaky.base, 'POST', '/api/jobs/leak/runs', { key: 'leak-1', body: {} });
        expect(created.status, created.text).toBe(201);
        const id = created.body.id as string;
        const done = await api(leaky.base, 'GET', `/api/runs/${id}?wait=30`);
        expect(done.body.state, done.text).toBe('failed');
        expect(done.text).toContain('env dump: token *** end');
        const events = await fetch(`${leaky.base}/api/runs/${id}/events`, { headers: { authorization: `Bearer ${TOKEN}` } });
        const answers = [done.text, await events.text()];
        for (const p of ['/api/runs?job=leak', '/', `/runs/${id}`]) answers.push((await api(leaky.base, 'GET', p)).text);
        for (const text of answers) expect(text).not.toContain(TOKEN);
        const [row] = await query<{ error: string }>(url, `select error::text from idem.runs where id = $1`, [id]);
        expect(row!.error).toContain('env dump: token *** end');
        // The CLI, run by a deploy whose environment holds the token too.
        const status = await runCli(['--jobs-dir', dir, 'status', 'leak', '--json'], { url, env: { IDEM_API_TOKEN: TOKEN } });
        expect(status.code, status.stderr).toBe(0);
        expect(status.stdout).toContain('env dump: token *** end');
        const failed = await runCli(['--jobs-dir', dir, 'run', 'leak', '--key', 'leak-cli'], { url, env: { IDEM_API_TOKEN: TOKEN } });
        expect(failed.code, failed.stderr).toBe(1);
        expect(failed.stderr).toContain('env dump: token *** end');
        const [cliRow] = await query<{ error: string }>(url, `select error::text from idem.runs where job = 'leak' and run_key = 'leak-cli'`);
        expect(cliRow!.error).not.toContain(TOKEN);
        leaky.proc.child.kill('SIGTERM');
        await leaky.proc.done;
        expect(leaky.proc.stderr()).not.toContain(TOKEN);
        expect(leaky.proc.stderr()).toContain('env dump: token *** end');
      } finally {
        leaky.proc.child.kill('SIGKILL');
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it("a --token-file token is masked in the server's own log lines and console output too", async () => {
    // Left from black-box round 16's review: idem serve made its log and console masks before it
    // read the token file, so a job that printed the token (it can read the file as well as the
    // server can) showed it in serve's stderr and stdout, where IDEM_API_TOKEN's was masked.
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-token-file-'));
    try {
      const tokenFile = path.join(dir, 'token');
      await writeFile(tokenFile, `${TOKEN}\n`);
      await writeFile(
        path.join(dir, 'tell.mjs'),
        `import { readFileSync } from 'node:fs';\nexport default { name: 'tell', steps: [{ name: 'work', run(ctx) { const t = readFileSync(process.env.TELL_TOKEN_FILE, 'utf8').trim(); ctx.log.warn('log token ' + t + ' end'); console.log('stdout token ' + t + ' end'); console.error('stderr token ' + t + ' end'); } }] };\n`,
      );
      const told = await startServe(url, ['--token-file', tokenFile], { IDEM_API_TOKEN: undefined as unknown as string, TELL_TOKEN_FILE: tokenFile }, dir, 'info');
      try {
        const created = await api(told.base, 'POST', '/api/jobs/tell/runs', { key: 'tell-1', body: {} });
        expect(created.status, created.text).toBe(201);
        const done = await api(told.base, 'GET', `/api/runs/${created.body.id}?wait=30`);
        expect(done.body.state, done.text).toBe('succeeded');
        told.proc.child.kill('SIGTERM');
        await told.proc.done;
        const out = `${told.proc.stdout()}\n${told.proc.stderr()}`;
        for (const where of ['log', 'stdout', 'stderr']) expect(out).toContain(`${where} token *** end`);
        expect(out).not.toContain(TOKEN);
      } finally {
        told.proc.child.kill('SIGKILL');
      }
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('a run key differing from another only by an invisible character shows that character on the dashboard, as the terminal does', async () => {
    // Left from black-box round 13 (B2-11): the terminal shows U+200B as \u200b, the dashboard
    // showed it as nothing, so "ab" and "a\u200bb" were two cards that looked the same.
    const keys = ['dash-zw-a\u200bb', 'dash-zw-a\u00a0b', 'dash-zw-a\u001bb'];
    const ids: string[] = [];
    // An HTTP header cannot carry such a key: `idem run --key` can.
    for (const key of keys) {
      const [row] = await query<{ id: string }>(url, `insert into idem.runs (job, run_key, params, fingerprint, status) values ('counted', $1, '{}', 'x', 'succeeded') returning id::text`, [key]);
      ids.push(row!.id);
    }
    for (const [i, shown] of ['\\u200b', '\\u00a0', '\\x1b'].entries()) {
      const page = (await api(server.base, 'GET', `/runs/${ids[i]}`)).text;
      expect(page).toContain(`dash-zw-a<span class="esc" title="invisible or control character U+${shown.slice(2).toUpperCase().padStart(4, '0')}">${shown}</span>b`);
      expect(page).not.toContain(keys[i]);
    }
  });

  it('GET /metrics speaks Prometheus text, labelled by job and step, never by key', async () => {
    const created = await post('k-metrics', { chunks: 2 });
    expect(created.status).toBe(201);
    expect((await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body.state).toBe('succeeded');
    const res = await api(server.base, 'GET', '/metrics');
    expect(res.status).toBe(200);
    expect(res.headers.get('content-type')).toMatch(/^text\/plain/);
    expect(res.text).toMatch(/idem_chunks_committed_total\{job="counted",step="work"\} \d+/);
    expect(res.text).toMatch(/idem_chunk_duration_seconds_bucket\{le="[^"]+",job="counted",step="work"\} \d+/);
    expect(res.text).toMatch(/idem_runs\{job="counted",state="succeeded"\} \d+/);
    expect(res.text).toMatch(/idem_http_requests_total\{method="POST",route="\/api\/jobs\/:job\/runs",status="201"\} \d+/);
    expect(res.text).toMatch(/idem_http_requests_total\{method="GET",route="\/api\/runs\/:id",status="200"\} \d+/);
    expect(res.text).not.toContain('k-metrics');
    expect(res.text).not.toContain(TOKEN);
  });

  it('idem_runs_ended_total{outcome} takes exactly the values the README documents', async () => {
    const readme = await readFile(path.join(REPO, 'README.md'), 'utf8');
    const row = readme.split('\n').find((l) => l.startsWith('| `idem_runs_ended_total{job,outcome}` |'));
    expect(row, 'the README lists idem_runs_ended_total in its Metrics table').toBeDefined();
    // The values are the first sentence's; the rest explains them.
    const documented = [...row!.split(' | ')[1]!.split('. ')[0]!.matchAll(/`([a-z]+)`/g)].map((m) => m[1]);
    expect(documented.sort()).toEqual([...EXECUTION_OUTCOMES].sort());
    const refused = Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:5432'), { code: 'ECONNREFUSED' });
    expect(
      [new RunFailedError('x'), new PausedError('x'), new CancelledError('x'), new InterruptedError('SIGTERM'), new PauseWithdrawnError('x'), refused].map(executionOutcome),
    ).toEqual(['failed', 'paused', 'cancelled', 'interrupted', 'interrupted', 'error']);
    // And what this server reports, after at least one execution.
    const created = await post('k-outcomes', { chunks: 1 });
    expect((await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body.state).toBe('succeeded');
    const reported = [...(await api(server.base, 'GET', '/metrics')).text.matchAll(/^idem_runs_ended_total\{[^}]*outcome="([^"]+)"/gm)].map((m) => m[1]);
    expect(reported.length).toBeGreaterThan(0);
    for (const outcome of reported) expect(documented).toContain(outcome);
  });

  it('idem_runs{job,state} reads 0 once a count it reported drops to nothing, instead of the series vanishing', async () => {
    // Only this test runs `ranged` on this server.
    const created = await post('k-gauge', {}, { job: 'ranged' });
    expect(created.status, created.text).toBe(201);
    expect((await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body.state).toBe('succeeded');
    const series = async () => (await api(server.base, 'GET', '/metrics')).text.split('\n').filter((l) => l.startsWith('idem_runs{job="ranged",'));
    expect(await series()).toContain('idem_runs{job="ranged",state="succeeded"} 1');
    await query(url, `delete from idem.runs where job = 'ranged'`);
    expect(await series()).toContain('idem_runs{job="ranged",state="succeeded"} 0');
    // Jobs this server does not load are not kept: their series may come and go without bound.
    await query(url, `insert into idem.runs (job, run_key, params, fingerprint, status) values ('not-loaded', 'k-gauge', '{}', 'x', 'failed')`);
    const metrics = async () => (await api(server.base, 'GET', '/metrics')).text;
    expect(await metrics()).toContain('idem_runs{job="not-loaded",state="failed"} 1');
    await query(url, `delete from idem.runs where job = 'not-loaded'`);
    expect(await metrics()).not.toContain('job="not-loaded"');
  });
});
