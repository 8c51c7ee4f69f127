import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { afterEach, describe, expect, it } from 'vitest';
import { lockKey } from '../src/fingerprint.ts';
import { createFixtureTables } from './fixtures/tables.ts';
import { busyMessage, FIXTURE_DIRS, FIXTURE_JOBS, killLeftovers, lines, query, runCli, sessions, spawnCli, waitFor } from './support/cli.ts';
import { createTestDatabase, type TestDatabase } from './support/database.ts';

/**
 * README, Migrations: a migration that fails stops the ones after it; the next `idem migrate`
 * resumes it at its first unfinished chunk; `--wait <seconds>` bounds the wait for another pod.
 * Each test has a database of its own: the fixture migrations create `widgets` in it.
 */
const databases: TestDatabase[] = [];
async function freshDatabase(): Promise<string> {
  const db = await createTestDatabase();
  databases.push(db);
  await createFixtureTables(db.url);
  return db.url;
}

const tmpDirs: string[] = [];
afterEach(async () => {
  await killLeftovers();
  for (const db of databases.splice(0)) await db.drop();
  for (const dir of tmpDirs.splice(0)) await rm(dir, { recursive: true, force: true });
});

/** A migrations folder of plain-object job files: file name → the body of its one step. */
async function migrationsDir(files: Record<string, string>): Promise<string> {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'idem-migrate-'));
  tmpDirs.push(dir);
  for (const [file, body] of Object.entries(files)) {
    const name = file.replace(/^\d+_/, 'p2-').replace(/\.mjs$/, '');
    await writeFile(path.join(dir, file), `export default { name: '${name}', steps: [{ name: 'a', async run() { ${body} } }] };\n`);
  }
  return dir;
}

const migrate = (url: string, args: string[] = []) => runCli([...FIXTURE_DIRS, 'migrate', ...args], { url });
const runsOf = (url: string) => query(url, `select run_key, status, attempt from idem.runs order by run_key`);
const backfillLog = (url: string) => query(url, `select chunk_key, attempt from work_log where job = 'backfill-widgets' order by id`);

describe('idem migrate', () => {
  it('a failed migration stops the ones after it; the next migrate resumes it where it stopped', async () => {
    const url = await freshDatabase();
    // 1. The first migration fails: the second never starts.
    await query(url, `insert into fail_chunks (chunk_key) values ('create-widgets')`);
    const first = await migrate(url);
    expect(first.code, first.stderr).toBe(1);
    expect(lines(first.stderr).filter((l) => l.startsWith('idem: error:'))).toEqual([
      expect.stringContaining('job "create-widgets" failed in step "create"'),
    ]);
    expect(await runsOf(url)).toEqual([{ run_key: '0001_create_widgets', status: 'failed', attempt: 1 }]);
    expect(await query(url, `select to_regclass('widgets')::text as t`)).toEqual([{ t: null }]); // its work rolled back

    // 2. Fixed; now the second one fails at its third chunk.
    await query(url, `delete from fail_chunks`);
    await query(url, `insert into fail_chunks (chunk_key) values ('[11,16)')`);
    const second = await migrate(url);
    expect(second.code, second.stderr).toBe(1);
    expect(second.stderr).toContain('job "backfill-widgets" failed in step "backfill", chunk [11,16)');
    expect(await runsOf(url)).toEqual([
      { run_key: '0001_create_widgets', status: 'succeeded', attempt: 2 },
      { run_key: '0002_backfill_widgets', status: 'failed', attempt: 1 },
    ]);
    expect(await backfillLog(url)).toEqual([{ chunk_key: '[1,6)', attempt: 1 }, { chunk_key: '[6,11)', attempt: 1 }]);

    // 3. Fixed: the next migrate finds the first done and resumes the second at [11,16).
    await query(url, `delete from fail_chunks`);
    const third = await migrate(url, ['--json']);
    expect(third.code, third.stderr).toBe(0);
    expect(JSON.parse(third.stdout)).toMatchObject([
      { runKey: '0001_create_widgets', status: 'already-succeeded', executed: 0 },
      { runKey: '0002_backfill_widgets', status: 'succeeded', attempt: 2, executed: 4 },
    ]);
    expect(await backfillLog(url)).toEqual([
      { chunk_key: '[1,6)', attempt: 1 },
      { chunk_key: '[6,11)', attempt: 1 },
      { chunk_key: '[11,16)', attempt: 2 },
      { chunk_key: '[16,21)', attempt: 2 },
      { chunk_key: '[21,26)', attempt: 2 },
      { chunk_key: '[26,31)', attempt: 2 },
    ]);
    expect(await query(url, `select count(*)::int as n, count(*) filter (where name_upper = upper(name))::int as done from widgets`)).toEqual([{ n: 30, done: 30 }]);
  });

  it('--json when a migration fails: the outcomes so far, then the failed one as an error entry; none for those after it', async () => {
    const url = await freshDatabase();
    await query(url, `insert into fail_chunks (chunk_key) values ('[11,16)')`);
    const r = await migrate(url, ['--json']);
    expect(r.code, r.stderr).toBe(1);
    const out = JSON.parse(r.stdout) as unknown[];
    expect(out).toEqual([
      expect.objectContaining({ runKey: '0001_create_widgets', job: 'create-widgets', status: 'succeeded', attempt: 1 }),
      {
        runKey: '0002_backfill_widgets',
        job: 'backfill-widgets',
        status: 'error',
        exitCode: 1,
        code: 'idem.runFailed',
        error: expect.stringMatching(/^job "backfill-widgets" failed in step "backfill", chunk \[11,16\) after 1 try: /),
      },
    ]);
    expect(lines(r.stderr).filter((l) => l.startsWith('idem: error:'))).toHaveLength(1);
    expect(await runsOf(url)).toEqual([
      { run_key: '0001_create_widgets', status: 'succeeded', attempt: 1 },
      { run_key: '0002_backfill_widgets', status: 'failed', attempt: 1 },
    ]);
    // The first migration failing: only its entry (the second never ran).
    const url2 = await freshDatabase();
    await query(url2, `insert into fail_chunks (chunk_key) values ('create-widgets')`);
    const first = await migrate(url2, ['--json']);
    expect(first.code, first.stderr).toBe(1);
    expect(JSON.parse(first.stdout)).toEqual([
      { runKey: '0001_create_widgets', job: 'create-widgets', status: 'error', exitCode: 1, code: 'idem.runFailed', error: expect.stringContaining('job "create-widgets" failed in step "create"') },
    ]);
    expect(await runsOf(url2)).toEqual([{ run_key: '0001_create_widgets', status: 'failed', attempt: 1 }]);
  });

  it('text mode when a migration fails: stdout still has a line for each one that succeeded or was done before it (plain, several pods, --finalize, the exit-65 refusal)', async () => {
    const url = await freshDatabase();
    const dir = await migrationsDir({ '0001_ok.mjs': '', '0002_bad.mjs': "throw new Error('p2 boom');", '0003_after.mjs': '' });
    const cliOn = (u: string, d: string, args: string[]) => runCli(['--jobs-dir', FIXTURE_JOBS, '--migrations-dir', d, '--log-level', 'warn', 'migrate', ...args], { url: u });
    const cli = (args: string[]) => cliOn(url, dir, args);
    // --json's entry for the failed migration, after the outcomes before it.
    const failedEntry = expect.objectContaining({ runKey: '0002_bad', job: 'p2-bad', status: 'error', exitCode: 1, code: 'idem.runFailed', error: expect.stringContaining('failed in step "a" after 1 try: p2 boom') });
    const okRan = /^0001_ok: job "p2-ok" succeeded: 1 chunk in 1 step, 1 executed now in \d+\.\ds \(run key 0001_ok, attempt 1\)$/;
    const okDone = /^0001_ok: job "p2-ok" already done \(run key 0001_ok, finished \S+\): 1 chunk in 1 step; nothing to do$/;
    const errors = (stderr: string) => lines(stderr).filter((l) => l.startsWith('idem: error:'));

    // 1. Plain migrate: 0001 runs, 0002 fails. stdout names 0001; stderr has the one error line.
    const first = await cli([]);
    expect(first.code, first.stderr).toBe(1);
    expect(lines(first.stdout)).toEqual([expect.stringMatching(okRan)]);
    expect(errors(first.stderr)).toEqual([expect.stringContaining('job "p2-bad" failed in step "a" after 1 try: p2 boom')]);
    expect(await runsOf(url)).toEqual([
      { run_key: '0001_ok', status: 'succeeded', attempt: 1 },
      { run_key: '0002_bad', status: 'failed', attempt: 1 },
    ]);

    // 2. Two pods at once: each one's stdout has 0001 (run there, or found done), then exit 1.
    const pods = await Promise.all([cli([]), cli([])]);
    for (const pod of pods) {
      expect(pod.code, pod.stderr).toBe(1);
      expect(lines(pod.stdout)).toEqual([expect.stringMatching(okDone)]);
      expect(errors(pod.stderr)).toEqual([expect.stringContaining('job "p2-bad" failed in step "a"')]);
    }
    expect(await runsOf(url)).toEqual([
      { run_key: '0001_ok', status: 'succeeded', attempt: 1 },
      { run_key: '0002_bad', status: 'failed', attempt: 3 },
    ]);

    // 3. --finalize past the failed one: 0001 is said done, the recorded failure ends it (exit 1).
    const fin = await cli(['--finalize', '0003_after']);
    expect(fin.code, fin.stderr).toBe(1);
    expect(lines(fin.stdout)).toEqual([expect.stringMatching(/^0001_ok: finalize: had already succeeded; job "p2-ok" already done /)]);
    expect(errors(fin.stderr)).toEqual([expect.stringContaining('run 0002_bad of job "p2-bad" failed in step "a" after 1 try: p2 boom')]);
    // The same with --json: the outcome found before it, then the failed migration's entry, named
    // (before 2026-12-04: only an error entry with null runKey and job).
    const finJson = await cli(['--finalize', '0003_after', '--json']);
    expect(finJson.code, finJson.stderr).toBe(1);
    expect(JSON.parse(finJson.stdout)).toEqual([
      expect.objectContaining({ runKey: '0001_ok', job: 'p2-ok', how: 'already-succeeded' }),
      failedEntry,
    ]);

    // 4. The failed one's file changed: refused with 65; 0001 is still named on stdout.
    await writeFile(path.join(dir, '0002_bad.mjs'), `export default { name: 'p2-bad', steps: [{ name: 'a', async run() {} }] };\n`);
    const refused = await cli([]);
    expect(refused.code, refused.stderr).toBe(65);
    expect(lines(refused.stdout)).toEqual([expect.stringMatching(okDone)]);
    expect(errors(refused.stderr)).toEqual([expect.stringContaining('run 0002_bad of job "p2-bad" failed under other code')]);
    expect(await runsOf(url)).toEqual([
      { run_key: '0001_ok', status: 'succeeded', attempt: 1 },
      { run_key: '0002_bad', status: 'failed', attempt: 3 },
    ]);

    // 5. A fresh database, --finalize running them here: 0001 ran inline before 0002 failed.
    const url2 = await freshDatabase();
    const dir2 = await migrationsDir({ '0001_ok.mjs': '', '0002_bad.mjs': "throw new Error('p2 boom');", '0003_after.mjs': '' });
    const inline = await cliOn(url2, dir2, ['--finalize', '0003_after']);
    expect(inline.code, inline.stderr).toBe(1);
    expect(lines(inline.stdout)).toEqual([expect.stringMatching(/^0001_ok: finalize: the rest ran here; job "p2-ok" succeeded: /)]);
    expect(errors(inline.stderr)).toEqual([expect.stringContaining('job "p2-bad" failed in step "a" after 1 try: p2 boom')]);
    // --json on another fresh database: 0001 run here, then 0002's entry.
    const url3 = await freshDatabase();
    const inlineJson = await cliOn(url3, dir2, ['--finalize', '0003_after', '--json']);
    expect(inlineJson.code, inlineJson.stderr).toBe(1);
    expect(JSON.parse(inlineJson.stdout)).toEqual([
      expect.objectContaining({ runKey: '0001_ok', job: 'p2-ok', how: 'ran-inline' }),
      failedEntry,
    ]);
    expect(await runsOf(url2)).toEqual([
      { run_key: '0001_ok', status: 'succeeded', attempt: 1 },
      { run_key: '0002_bad', status: 'failed', attempt: 1 },
    ]);
  });

  it('--wait and --no-wait together are refused (exit 2, one line naming both), in either order; nothing is written', async () => {
    const url = await freshDatabase();
    const [noWaitFirst, waitFirst, bareWait, json] = await Promise.all([
      migrate(url, ['--no-wait', '--wait', '3']),
      migrate(url, ['--wait', '30', '--no-wait']),
      migrate(url, ['--wait', '--no-wait']),
      migrate(url, ['--json', '--no-wait', '--wait=3']),
    ]);
    // Before: the last one won (--no-wait --wait 3 migrated, exit 0; --wait 30 --no-wait was --no-wait).
    for (const [r, first, second] of [
      [noWaitFirst, '--no-wait', '--wait [seconds]'],
      [waitFirst, '--wait [seconds]', '--no-wait'],
      [bareWait, '--wait [seconds]', '--no-wait'],
      [json, '--no-wait', '--wait [seconds]'],
    ] as const) {
      expect(r!.code, r!.stderr).toBe(2);
      expect(lines(r!.stderr)).toEqual([`idem: error: option '${second}' cannot be used with option '${first}'; give one of them; see --help`]);
    }
    for (const r of [noWaitFirst, waitFirst, bareWait]) expect(r!.stdout).toBe('');
    expect(JSON.parse(json!.stdout)).toEqual([
      { runKey: null, job: null, status: 'error', exitCode: 2, code: 'idem.conflictingOption', error: "option '--wait [seconds]' cannot be used with option '--no-wait'; give one of them" },
    ]);
    expect(await query(url, `select to_regclass('idem.runs')::text as runs, to_regclass('widgets')::text as widgets`)).toEqual([{ runs: null, widgets: null }]);
  });

  it('--json prints the outcomes array when migrate fails before any migration: an unreachable database, a bad flag', async () => {
    const [unreachable, badFlag] = await Promise.all([
      migrate('postgres://u:secret@127.0.0.1:1/x', ['--json']),
      runCli([...FIXTURE_DIRS, 'migrate', '--json', '--wait', 'abc']),
    ]);
    expect(unreachable.code, unreachable.stderr).toBe(2);
    expect(JSON.parse(unreachable.stdout)).toEqual([
      { runKey: null, job: null, status: 'error', exitCode: 2, code: 'idem.databaseUnavailable', error: expect.stringMatching(/^cannot reach the database at postgres:\/\/u:\*\*\*@127\.0\.0\.1:1\/x/) },
    ]);
    expect(unreachable.stdout).not.toContain('secret');
    expect(badFlag.code, badFlag.stderr).toBe(2);
    expect(JSON.parse(badFlag.stdout)).toEqual([
      { runKey: null, job: null, status: 'error', exitCode: 2, code: 'idem.invalidArgument', error: `option '--wait [seconds]' argument 'abc' is invalid. expected a plain decimal number of seconds >= 0 (such as 30 or 0.5), got "abc"` },
    ]);
  });

  it('prune and --retention keep migration runs: a migration pruned would run again at the next deploy', async () => {
    const url = await freshDatabase();
    const first = await migrate(url, ['--json']);
    expect(first.code, first.stderr).toBe(0);
    const log = await backfillLog(url);
    expect(log).toHaveLength(6);
    // A run recorded by an idem from before migration runs were marked: the next migrate marks it.
    await query(url, `update idem.runs set kind = 'job' where run_key = '0001_create_widgets'`);
    const marking = await migrate(url, ['--json']);
    expect(marking.code, marking.stderr).toBe(0);
    expect(await query(url, `select run_key, kind from idem.runs order by run_key`)).toEqual([
      { run_key: '0001_create_widgets', kind: 'migration' },
      { run_key: '0002_backfill_widgets', kind: 'migration' },
    ]);
    await new Promise((r) => setTimeout(r, 1_100));
    const pruned = await runCli(['prune', '--older-than', '1s', '--json'], { url });
    expect(pruned.code, pruned.stderr).toBe(0);
    expect(JSON.parse(pruned.stdout)).toEqual({ runs: 0, steps: 0, chunks: 0, effects: 0, skipped: 0 });
    expect(await runsOf(url)).toEqual([
      { run_key: '0001_create_widgets', status: 'succeeded', attempt: 1 },
      { run_key: '0002_backfill_widgets', status: 'succeeded', attempt: 1 },
    ]);
    // The next deploy's migrate finds both done and runs nothing again.
    const again = await migrate(url, ['--json']);
    expect(again.code, again.stderr).toBe(0);
    expect(JSON.parse(again.stdout)).toMatchObject([
      { runKey: '0001_create_widgets', status: 'already-succeeded', executed: 0 },
      { runKey: '0002_backfill_widgets', status: 'already-succeeded', executed: 0 },
    ]);
    expect(await backfillLog(url)).toEqual(log);

    // Right after an upgrade, before any idem migrate: prune and serve --retention recognise the
    // migrations folder's runs by their keys (black-box round 4: they deleted them).
    await query(url, `update idem.runs set kind = 'job'`);
    const legacy = await runCli([...FIXTURE_DIRS, 'prune', '--older-than', '1s', '--json'], { url });
    expect(legacy.code, legacy.stderr).toBe(0);
    expect(JSON.parse(legacy.stdout)).toMatchObject({ runs: 0 });
    expect(await query(url, `select run_key, kind from idem.runs order by run_key`)).toEqual([
      { run_key: '0001_create_widgets', kind: 'migration' },
      { run_key: '0002_backfill_widgets', kind: 'migration' },
    ]);
    await query(url, `update idem.runs set kind = 'job'`);
    const serve = spawnCli([...FIXTURE_DIRS, '--log-level', 'info', 'serve', '--port', '0', '--retention', '1s'], { url, env: { IDEM_API_TOKEN: 'x'.repeat(32) } });
    try {
      await waitFor(async () => (await query(url, `select count(*)::int as n from idem.runs where kind = 'migration'`))[0].n === 2, 'serve --retention to mark the migration runs');
      await waitFor(async () => serve.stdout().includes('listening on'), 'serve to listen');
    } finally {
      serve.child.kill('SIGTERM');
      await serve.done;
    }
    expect(await runsOf(url)).toEqual([
      { run_key: '0001_create_widgets', status: 'succeeded', attempt: 1 },
      { run_key: '0002_backfill_widgets', status: 'succeeded', attempt: 1 },
    ]);
    expect(await backfillLog(url)).toEqual(log);
  });

  it('--wait <seconds> gives up after that long with exit 75; a longer wait migrates once the other pod is done', async () => {
    const url = await freshDatabase();
    // Another "pod" holds the migrate lock.
    const pod = new pg.Client({ connectionString: url });
    await pod.connect();
    let podEnded = false;
    try {
      await pod.query('select pg_advisory_lock($1::bigint)', [lockKey('idem:migrate')]);
      const bounded = await migrate(url, ['--wait', '1']);
      expect(bounded.code, bounded.stderr).toBe(75);
      // Busy is logged at info, not as an `idem: error:` line (issue 10).
      expect(lines(bounded.stderr).filter((l) => !l.startsWith('{'))).toEqual([]);
      expect(busyMessage(bounded.stderr)).toMatch(/^busy: idem migrate is still running in another process after waiting 1s \(its advisory lock is held by backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\)(?:; backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\))*\); try again later$/);
      expect(await runsOf(url)).toEqual([]);
      // --json: no migration ran, so the one entry names none.
      const busyJson = await migrate(url, ['--no-wait', '--json']);
      expect(busyJson.code, busyJson.stderr).toBe(75);
      expect(JSON.parse(busyJson.stdout)).toEqual([{ runKey: null, job: null, status: 'error', exitCode: 75, code: 'idem.busy', error: expect.stringContaining('idem migrate is running in another process') }]);
      expect(await runsOf(url)).toEqual([]);

      const patient = spawnCli([...FIXTURE_DIRS, 'migrate', '--wait', '60', '--json'], { url, timeoutMs: 90_000 });
      await waitFor(async () => (await sessions(url, 'idem-lock')) === 1, 'the waiting migrate to poll for the lock');
      expect(patient.child.exitCode).toBeNull();
      expect(await runsOf(url)).toEqual([]);
      await pod.end();
      podEnded = true;
      const r = await patient.done;
      expect(r.code, r.stderr).toBe(0);
      expect(JSON.parse(r.stdout)).toMatchObject([
        { runKey: '0001_create_widgets', status: 'succeeded', attempt: 1 },
        { runKey: '0002_backfill_widgets', status: 'succeeded', attempt: 1, executed: 6 },
      ]);
    } finally {
      if (!podEnded) await pod.end();
    }
  }, 120_000);
});
