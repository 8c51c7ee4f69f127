import { mkdir, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { killLeftovers, logLines, runCli, spawnCli, waitFor } from './support/cli.ts';
import { chownToPostgres } from './support/global-setup.ts';

// README: without DATABASE_URL the embedded server "is stopped when the last idem process using it
// exits (it stays up while other clients are connected)". A process's own sessions (its pools, its
// lock, serve's read pool and LISTEN session) are not other clients: they used to be counted while
// their sockets were still closing, so `idem serve` left the server running for good.

let project: string;
const TOKEN_FILE = 'token';

beforeAll(async () => {
  project = await mkdtemp(path.join(os.tmpdir(), 'idem-lifecycle-'));
  await chownToPostgres(project); // as root, PostgreSQL runs as `postgres` and must enter it
  await mkdir(path.join(project, 'jobs'));
  await writeFile(path.join(project, 'jobs', 'noop.mjs'), `export default { name: 'noop', steps: [{ name: 'only', run: () => {} }] };\n`);
  await writeFile(path.join(project, TOKEN_FILE), 'lifecycle-token-0123456789abcdef\n', { mode: 0o600 });
});

/** Stops this file's embedded server if a test (or a failed one) left it running: each test starts from none. */
async function stopLeftover(): Promise<void> {
  const pid = await postmasterPid();
  if (pid === undefined || !alive(pid)) return;
  process.kill(pid, 'SIGINT'); // fast shutdown
  await waitFor(async () => !alive(pid), 'the leftover embedded server to stop', { timeoutMs: 20_000 }).catch(() => process.kill(pid, 'SIGKILL'));
}

beforeEach(stopLeftover);

afterAll(async () => {
  await killLeftovers();
  // Whatever a failed test left running must not outlive the run: this file's server only.
  await stopLeftover();
  if (project) await rm(project, { recursive: true, force: true });
});

/** The pid in .idem/pg/postmaster.pid, if the file is there. */
async function postmasterPid(): Promise<number | undefined> {
  const text = await readFile(path.join(project, '.idem', 'pg', 'postmaster.pid'), 'utf8').catch(() => '');
  const pid = Number(text.split('\n')[0]);
  return pid > 0 ? pid : undefined;
}

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/** Asserts the postmaster is gone within a bounded time. */
async function expectStopped(pid: number): Promise<void> {
  await waitFor(async () => !alive(pid), `embedded PostgreSQL (pid ${pid}) to stop`, { timeoutMs: 15_000 });
}

/** Waits (bounded) until `idem serve` says it listens; fails at once if it exited instead. */
async function listening(proc: ReturnType<typeof spawnCli>): Promise<void> {
  let exited = false;
  void proc.done.then(() => (exited = true));
  await waitFor(async () => /listening on http/.test(proc.stdout()) || exited, 'idem serve to listen', { timeoutMs: 90_000 });
  expect(proc.stdout(), proc.stderr()).toMatch(/listening on http/);
}

const serve = (args: string[] = []) =>
  spawnCli(['serve', '--port', '0', '--token-file', TOKEN_FILE, ...args], { cwd: project, env: { IDEM_API_TOKEN: undefined }, timeoutMs: 120_000 });

/**
 * Log messages about the embedded server's starts and stops. The one-time "initialising … (first
 * run only)" line is left out: whichever test the shuffled order runs first creates the cluster.
 */
const lifecycle = (stderr: string) =>
  logLines(stderr)
    .map((l) => l.msg)
    .filter((m) => /embedded PostgreSQL/.test(m) && !/^initialising /.test(m));

describe('the embedded PostgreSQL is stopped when the last idem process exits', () => {
  it('idem serve, stopped by SIGTERM, stops the embedded server it started (its own sessions do not count)', async () => {
    const proc = serve();
    await listening(proc);
    const pid = (await postmasterPid())!;
    expect(alive(pid)).toBe(true);
    proc.child.kill('SIGTERM');
    const r = await proc.done;
    expect(r.code, r.stderr).toBe(143);
    expect(lifecycle(r.stderr)).toContain('embedded PostgreSQL stopped (last client out)');
    expect(r.stderr).not.toContain('left embedded PostgreSQL running');
    await expectStopped(pid);
  });

  it('idem serve on a port in use exits 2 and stops the embedded server it started', async () => {
    const holder = net.createServer();
    await new Promise<void>((resolve) => holder.listen(0, '127.0.0.1', resolve));
    const port = (holder.address() as net.AddressInfo).port;
    try {
      const r = await runCli(['serve', '--port', String(port), '--token-file', TOKEN_FILE], { cwd: project, env: { IDEM_API_TOKEN: undefined }, timeoutMs: 120_000 });
      expect(r.code, r.stderr).toBe(2);
      expect(r.stderr).toContain(`idem: error: cannot listen on 127.0.0.1:${port}: the address is in use`);
      expect(lifecycle(r.stderr)).toEqual([expect.stringMatching(/^embedded PostgreSQL 18\.\d+ started on /), 'embedded PostgreSQL stopped (last client out)']);
      const pid = await postmasterPid();
      if (pid !== undefined) await expectStopped(pid);
    } finally {
      await new Promise((resolve) => holder.close(resolve));
    }
  });

  it('run, status and list each stop the server they started', async () => {
    for (const args of [['run', 'noop', '--key', 'k1'], ['status'], ['list']]) {
      const r = await runCli(args, { cwd: project, timeoutMs: 120_000 });
      expect(r.code, `${args.join(' ')}: ${r.stderr}`).toBe(0);
      expect(lifecycle(r.stderr), args.join(' ')).toEqual([expect.stringMatching(/^embedded PostgreSQL 18\.\d+ started on /), 'embedded PostgreSQL stopped (last client out)']);
      const pid = await postmasterPid();
      if (pid !== undefined) await expectStopped(pid);
    }
  });

  it('a SIGKILLed process cannot stop it: the server stays up until the next idem command, which stops it as the last one out', async () => {
    const proc = serve();
    await listening(proc);
    const pid = (await postmasterPid())!;
    proc.child.kill('SIGKILL');
    expect((await proc.done).signal).toBe('SIGKILL');
    // Its sessions end with it; the server does not.
    await new Promise((r) => setTimeout(r, 500));
    expect(alive(pid)).toBe(true);
    const next = await runCli(['status'], { cwd: project, timeoutMs: 120_000 });
    expect(next.code, next.stderr).toBe(0);
    expect(lifecycle(next.stderr)).toEqual([expect.stringMatching(/^using embedded PostgreSQL 18\.\d+ already running on /), 'embedded PostgreSQL stopped (last client out)']);
    await expectStopped(pid);
  });
});
