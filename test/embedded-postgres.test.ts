import { spawn } from 'node:child_process';
import { promises as fs } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { startEmbeddedPostgres, type EmbeddedServer } from '../src/embedded-postgres.ts';
import { chownToPostgres } from './support/global-setup.ts';

const CHILD = fileURLToPath(new URL('./support/start-embedded-child.ts', import.meta.url));
const isRoot = process.getuid?.() === 0;

const tempDirs: string[] = [];
const servers: EmbeddedServer[] = [];
const logs: string[] = [];
const onLog = (msg: string) => logs.push(msg);

async function freshStateDir(): Promise<string> {
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'idem-embedded-'));
  tempDirs.push(dir);
  await chownToPostgres(dir);
  return dir;
}

async function start(dataDir: string): Promise<EmbeddedServer> {
  const server = await startEmbeddedPostgres({ dataDir, onLog });
  servers.push(server);
  return server;
}

async function query<R extends pg.QueryResultRow>(url: string, sql: string): Promise<R[]> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return (await client.query<R>(sql)).rows;
  } finally {
    await client.end();
  }
}

const isRunning = (dataDir: string) => fs.access(path.join(dataDir, 'postmaster.pid')).then(() => true, () => false);
const passwordOf = (url: string) => decodeURIComponent(new URL(url).password);

describe('startEmbeddedPostgres', () => {
  /**
   * One initialised cluster the tests share (initdb once); every test starts it itself and leaves
   * it stopped (afterEach), so no test depends on what an earlier one left running.
   */
  let dataDir: string;

  beforeAll(async () => {
    dataDir = path.join(await freshStateDir(), 'pg');
    await (await start(dataDir)).stop();
  });

  afterEach(async () => {
    for (const server of servers.splice(0)) await server.stop().catch(() => undefined);
    logs.length = 0;
  });

  afterAll(async () => {
    // Whatever a failed test left running must not outlive the run.
    for (const server of servers) await server.stop().catch(() => undefined);
    for (const dir of tempDirs) await fs.rm(dir, { recursive: true, force: true });
  });

  it('first start initialises a cluster, stores its credentials privately and answers queries', async () => {
    const fresh = path.join(await freshStateDir(), 'pg');
    const server = await start(fresh);
    expect(server.startedHere).toBe(true);
    expect(logs.some((m) => m.includes('initialising embedded PostgreSQL'))).toBe(true);
    expect(server.url).toMatch(/^postgres:\/\/postgres:[0-9a-f]+@127\.0\.0\.1:\d+\/postgres$/);
    expect(new URL(server.url).port).not.toBe('5432');
    expect(await query(server.url, 'select 1 as one')).toEqual([{ one: 1 }]);
    const connFile = path.join(path.dirname(fresh), 'connection.json');
    expect((await fs.stat(connFile)).mode & 0o777).toBe(0o600);
    const conn = JSON.parse(await fs.readFile(connFile, 'utf8'));
    expect(conn).toMatchObject({ user: 'postgres', password: passwordOf(server.url), port: Number(new URL(server.url).port) });
    expect(await query(server.url, `select current_setting('password_encryption') as enc`)).toEqual([{ enc: 'scram-sha-256' }]);
  });

  it('a second start while the server runs joins it instead of starting another', async () => {
    const first = await start(dataDir);
    expect(first.startedHere).toBe(true);
    const second = await start(dataDir);
    expect(second.startedHere).toBe(false);
    expect(second.url).toBe(first.url);
    // Two handles, two presence connections.
    const rows = await query(first.url,
      `select count(*)::int as n from pg_stat_activity where application_name = 'idem-embedded'`);
    expect(rows).toEqual([{ n: 2 }]);
  });

  it('release() while another client is connected leaves the server running', async () => {
    const first = await start(dataDir);
    const second = await start(dataDir);
    const other = new pg.Client({ connectionString: first.url });
    await other.connect();
    try {
      await second.release();
      await first.release();
      expect(await isRunning(dataDir)).toBe(true);
      expect((await other.query('select 2 as two')).rows).toEqual([{ two: 2 }]);
      await first.release(); // idempotent: still running, no second count
      expect(await isRunning(dataDir)).toBe(true);
    } finally {
      await other.end();
    }
  });

  it('release() as the last client stops the server', async () => {
    const first = await start(dataDir);
    const server = await start(dataDir);
    expect(server.startedHere).toBe(false);
    await first.release();
    expect(await isRunning(dataDir)).toBe(true); // the other handle is still connected
    await server.release();
    expect(await isRunning(dataDir)).toBe(false);
    await expect(query(server.url, 'select 1')).rejects.toMatchObject({ code: 'ECONNREFUSED' });
    await server.release();
    await server.stop(); // both idempotent on a stopped server
    expect(logs).toContain('embedded PostgreSQL stopped (last client out)');
  });

  it('a restart reuses the data of the previous one', async () => {
    const before = await start(dataDir);
    expect(before.startedHere).toBe(true);
    await query(before.url, 'create table if not exists kept (id int primary key); insert into kept values (42) on conflict do nothing');
    await before.stop();
    expect(await isRunning(dataDir)).toBe(false);

    const after = await start(dataDir);
    expect(after.startedHere).toBe(true);
    expect(passwordOf(after.url)).toBe(passwordOf(before.url));
    expect(await query(after.url, 'select id from kept')).toEqual([{ id: 42 }]);
  });

  it('a start racing the last release ends with a running server', async () => {
    const leaving = await start(dataDir);
    const [, joining] = await Promise.all([leaving.release(), start(dataDir)]);
    expect(await isRunning(dataDir)).toBe(true);
    expect(await query(joining.url, 'select 3 as three')).toEqual([{ three: 3 }]);
    await joining.release();
    expect(await isRunning(dataDir)).toBe(false);
  });

  it('never passes the password to onLog', async () => {
    const first = await start(dataDir);
    const second = await start(dataDir);
    await second.release();
    await first.release();
    const password = passwordOf(first.url);
    expect(logs.some((m) => m.includes('started on 127.0.0.1:'))).toBe(true);
    expect(logs.some((m) => m.includes('already running on 127.0.0.1:'))).toBe(true);
    expect(logs.some((m) => m.includes('stopped'))).toBe(true);
    expect(logs.filter((m) => m.includes(password))).toEqual([]);
    expect(logs.filter((m) => m.includes('\n'))).toEqual([]);
  });

  it('four processes starting at once on a fresh data dir share one server, and the last one out stops it', async () => {
    const sharedDir = path.join(await freshStateDir(), 'pg');
    const children = Array.from({ length: 4 }, () =>
      spawn(process.execPath, ['--import', 'tsx', CHILD, sharedDir], { stdio: ['pipe', 'pipe', 'pipe'] }));
    const exits = children.map((child) => new Promise<number | null>((resolve) => child.on('close', resolve)));
    const reports = await Promise.all(children.map((child) => new Promise<string>((resolve, reject) => {
      let out = '';
      let err = '';
      child.stdout!.on('data', (b: Buffer) => { out += b; if (out.includes('\n')) resolve(out.trim()); });
      child.stderr!.on('data', (b: Buffer) => { err += b; });
      child.on('close', (code) => reject(new Error(`child exited ${code} before reporting: ${err}`)));
    })));
    const seen = reports.map((line) => JSON.parse(line) as { startedHere: boolean; port: number; system_identifier: string });
    expect(new Set(seen.map((s) => s.port)).size).toBe(1);
    expect(new Set(seen.map((s) => s.system_identifier)).size).toBe(1);
    expect(seen.filter((s) => s.startedHere)).toHaveLength(1);

    for (const child of children) child.stdin!.end();
    expect(await Promise.all(exits)).toEqual([0, 0, 0, 0]);
    expect(await isRunning(sharedDir)).toBe(false);
  });

  it.skipIf(!isRoot)('as root, a data dir the postgres user cannot reach fails with a one-line error naming the fix', async () => {
    const locked = await fs.mkdtemp(path.join(os.tmpdir(), 'idem-locked-')); // 0700, owned by root
    tempDirs.push(locked);
    const err: Error = await startEmbeddedPostgres({ dataDir: path.join(locked, 'state', 'pg') }).then(
      () => { throw new Error('expected a failure'); }, (e: Error) => e);
    expect(err.message).toContain(`${locked} is not searchable`);
    expect(err.message).toContain(`chmod o+x ${locked}`);
    expect(err.message).not.toContain('\n');
    expect(await fs.readdir(path.join(locked, 'state'))).toEqual([]);
  });
});
