import { spawn } from 'node:child_process';
import { mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
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

describe('a signal while the embedded server is being made or started', () => {
  /**
   * A fresh project of its own: these tests need a data dir that is not initialised yet. `run`
   * makes it: status and list make no embedded server where .idem/ has none.
   */
  async function freshProject(): Promise<string> {
    const dir = await mkdtemp(path.join(os.tmpdir(), 'idem-lifecycle-init-'));
    await chownToPostgres(dir);
    await mkdir(path.join(dir, 'jobs'));
    await writeFile(path.join(dir, 'jobs', 'noop.mjs'), `export default { name: 'noop', steps: [{ name: 'only', run: () => {} }] };\n`);
    return dir;
  }
  const leftovers = async (dir: string) => (await readdir(path.join(dir, '.idem')).catch(() => [] as string[])).filter((f) => f.startsWith('pg.init'));
  const postmasterOf = async (dir: string) => {
    const pid = Number((await readFile(path.join(dir, '.idem', 'pg', 'postmaster.pid'), 'utf8').catch(() => '')).split('\n')[0]);
    return pid > 0 && alive(pid) ? pid : undefined;
  };

  it('SIGINT during initdb: exit 130, nothing left behind, and the next command starts at once (it waited ~60 s for the dead lock)', async () => {
    // Black-box round 8: the killed command left .idem/pg.init-lock, a 39 MB pg.init-<pid>-… and its
    // .pw file (the password); the next command printed nothing for 55-61 s, until the lock was a
    // minute old. A signal to the whole process group, as Ctrl-C sends, kills initdb too.
    const dir = await freshProject();
    try {
      const env = { ...process.env };
      delete env.DATABASE_URL;
      delete env.NODE_OPTIONS;
      const first = spawn(process.execPath, [path.resolve('bin/idem.js'), 'run', 'noop'], { cwd: dir, detached: true, stdio: ['ignore', 'ignore', 'pipe'], env });
      let err = '';
      first.stderr!.setEncoding('utf8').on('data', (s: string) => (err += s));
      const closed = new Promise<number | null>((resolve) => first.on('close', (code) => resolve(code)));
      await waitFor(async () => /initialising embedded PostgreSQL/.test(err), 'initdb to start', { timeoutMs: 60_000 });
      process.kill(-first.pid!, 'SIGINT');
      expect(await closed, err).toBe(130);
      const next = await runCli(['run', 'noop'], { cwd: dir, timeoutMs: 120_000 });
      expect(next.code, next.stderr).toBe(0);
      expect(next.ms, next.stderr).toBeLessThan(30_000);
      expect(await leftovers(dir)).toEqual([]);
      const pid = await postmasterOf(dir);
      if (pid !== undefined) await expectStopped(pid);
    } finally {
      const pid = await postmasterOf(dir);
      if (pid !== undefined) process.kill(pid, 'SIGINT');
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('a SIGKILLed initialiser does not hold the next command for a minute either: its lock and leftovers are cleared', async () => {
    const dir = await freshProject();
    try {
      const first = spawnCli(['run', 'noop'], { cwd: dir, timeoutMs: 120_000 });
      await waitFor(async () => /initialising embedded PostgreSQL/.test(first.stderr()), 'initdb to start', { timeoutMs: 60_000 });
      first.child.kill('SIGKILL');
      await first.done;
      const next = await runCli(['run', 'noop'], { cwd: dir, timeoutMs: 120_000 });
      expect(next.code, next.stderr).toBe(0);
      expect(next.ms, next.stderr).toBeLessThan(30_000);
      await waitFor(async () => (await leftovers(dir)).length === 0, 'the dead initialiser leftovers to be gone', { timeoutMs: 20_000 });
    } finally {
      const pid = await postmasterOf(dir);
      if (pid !== undefined) process.kill(pid, 'SIGINT');
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('SIGTERM to idem while it starts the server: exit 143, and the server it started is stopped, not left running', async () => {
    const dir = await freshProject();
    try {
      // Initialised first, so that the next command's start is pg_ctl's alone.
      const init = await runCli(['run', 'noop'], { cwd: dir, timeoutMs: 120_000 });
      expect(init.code, init.stderr).toBe(0);
      const proc = spawnCli(['status'], { cwd: dir, timeoutMs: 120_000 });
      let exited = false;
      void proc.done.then(() => (exited = true));
      await waitFor(async () => (await postmasterOf(dir)) !== undefined || exited, 'the postmaster to appear', { timeoutMs: 60_000, intervalMs: 10 });
      expect(exited, proc.stderr()).toBe(false);
      const pid = await postmasterOf(dir);
      proc.child.kill('SIGTERM');
      const r = await proc.done;
      expect(r.code, r.stderr).toBe(143);
      expect(r.stderr).toContain('idem: stopped by SIGTERM');
      if (pid !== undefined) await expectStopped(pid);
      expect(await postmasterOf(dir)).toBeUndefined();
    } finally {
      const pid = await postmasterOf(dir);
      if (pid !== undefined) process.kill(pid, 'SIGINT');
      await rm(dir, { recursive: true, force: true });
    }
  });
});
