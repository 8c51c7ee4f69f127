import { mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Runner } from '../src/index.ts';
import counted from './fixtures/jobs/counted.ts';
import { lockKey } from '../src/fingerprint.ts';
import {
  ALL_TABLES,
  BROKEN_JOBS,
  FIXTURE_DIRS,
  holdGate,
  killLeftovers,
  lockWaiters,
  lines,
  logLines,
  query,
  runCli,
  runRow,
  snapshot,
  spawnCli,
  waitFor,
  workCounts,
  type CliResult,
} from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

const MORE_JOBS = fileURLToPath(new URL('./fixtures/more-jobs', import.meta.url));

// idem's schema exists up front, so "changes nothing" compares real tables from the first test on.
const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
let url: string;
beforeAll(() => {
  url = testDb.url;
});
afterEach(() => query(url, 'delete from fail_chunks'));

afterAll(killLeftovers);

/** `idem <global fixture flags> <args>` against the test database. */
const idem = (args: string[], env?: Record<string, string>) => runCli([...FIXTURE_DIRS, ...args], { url, ...(env ? { env } : {}) });

/** Asserts the documented shape of a refusal: the exit code and exactly one `idem: error:` line on stderr. */
function expectOneLineError(r: CliResult, code: number, message: string | RegExp): void {
  expect({ code: r.code, stderrLines: lines(r.stderr).length, stdout: r.stdout }, r.stderr).toEqual({ code, stderrLines: 1, stdout: '' });
  expect(r.stderr).toMatch(/^idem: error: /);
  if (typeof message === 'string') expect(r.stderr).toContain(message);
  else expect(r.stderr).toMatch(message);
}

describe('idem run', () => {
  it('runs a job (exit 0, one summary line) and a second run finds it done and changes nothing', async () => {
    const first = await idem(['run', 'counted', '--params', '{"chunks":3}', '--key', 'cli-ok']);
    expect(first.code, first.stderr).toBe(0);
    expect(lines(first.stdout)).toHaveLength(1);
    expect(first.stdout).toMatch(/^job "counted" succeeded: 5 chunks in 3 steps, 5 executed now\b.*\(run key cli-ok, attempt 1\)\n$/);
    expect(await workCounts(url, 'cli-ok')).toEqual(new Map([['c0001', 1], ['c0002', 1], ['c0003', 1]]));

    const before = await snapshot(url, ALL_TABLES);
    const second = await idem(['run', 'counted', '--param', 'chunks=3', '--key', 'cli-ok', '--json']);
    expect(second.code, second.stderr).toBe(0);
    expect(JSON.parse(second.stdout)).toMatchObject({ status: 'already-succeeded', job: 'counted', runKey: 'cli-ok', attempt: 1, executed: 0, summary: { chunks: 5 } });
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('an unknown job exits 2 naming the known jobs, and changes nothing', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const r = await idem(['run', 'nope']);
    expectOneLineError(r, 2, /no job named 'nope' in .*\/ \(known: counted, ranged\); check the name or --jobs-dir/);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('invalid params exit 2 with the validator\'s message, and change nothing', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const [bad, zero, noParams] = await Promise.all([
      idem(['run', 'counted', '--params', '{"chunks":"many"}']),
      idem(['run', 'counted', '--param', 'chunks=0', '--param', 'label=x']),
      idem(['run', 'ranged', '--params', '{"x":1}']),
    ]);
    expectOneLineError(bad!, 2, 'invalid params for job "counted": chunks must be an integer from 1 to 10000, got "many"');
    expectOneLineError(zero!, 2, 'invalid params for job "counted": chunks must be an integer from 1 to 10000, got 0');
    expectOneLineError(noParams!, 2, 'job "ranged" takes no params, got {"x":1}; drop --params/--param');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('--params that is not a JSON object exits 2 showing the expected form, and changes nothing', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const [notJson, notObject] = await Promise.all([
      idem(['run', 'counted', '--params', '{chunks: 3']),
      idem(['run', 'counted', '--params', '[3]']),
    ]);
    expectOneLineError(notJson!, 2, /--params is not valid JSON \(.*\); pass an object such as --params '\{"day":"2026-11-30"\}'/);
    expectOneLineError(notObject!, 2, '--params must be a JSON object, got [3]');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a number beyond the safe integers in --param/--params exits 2 naming its path, instead of being rounded into another run', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const [pair, json] = await Promise.all([
      idem(['run', 'counted', '--param', 'ids=[1,9007199254740993]']),
      idem(['run', 'counted', '--params', '{"chunks":2,"filter":{"min":-9007199254740993}}']),
    ]);
    const rounds = 'is a number beyond the safe integers, ±(2^53−1), which would be rounded (two different values would become one run); pass it as a string';
    expectOneLineError(pair!, 2, `--param ids: ids[1] ${rounds}`);
    expectOneLineError(json!, 2, `--params: filter.min ${rounds}`);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a bad flag, a bad flag value, an unknown command or a bad --key exits 2 naming it, and changes nothing', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const [flag, value, command, key] = await Promise.all([
      idem(['run', 'counted', '--bogus']),
      idem(['run', 'counted', '--concurrency', '0']),
      idem(['frobnicate']),
      idem(['run', 'counted', '--key', 'k'.repeat(201)]),
    ]);
    expect([flag!.code, value!.code, command!.code]).toEqual([2, 2, 2]);
    expect(flag!.stderr).toContain("unknown option '--bogus'");
    expect(value!.stderr).toContain('expected an integer from 1 to 64, got "0"');
    expect(command!.stderr).toContain("unknown command 'frobnicate'");
    expectOneLineError(key!, 2, '--key must be 1 to 200 characters');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a command-line parse error is one `idem: error:` line like every other refusal', async () => {
    // DESIGN: bad input gets a one-line error naming the problem and the fix. Parse errors come from
    // commander, which prints "error: …" and then a second line "(run with --help for usage)".
    const [flag, value, command] = await Promise.all([
      idem(['run', 'counted', '--bogus']),
      idem(['run', 'counted', '--concurrency', '0']),
      idem(['frobnicate']),
    ]);
    expectOneLineError(flag!, 2, "unknown option '--bogus'");
    expectOneLineError(value!, 2, 'expected an integer from 1 to 64, got "0"');
    expectOneLineError(command!, 2, "unknown command 'frobnicate'");
    // commander's suggestion came on a second line.
    const [typo, optionTypo] = await Promise.all([idem(['rnu']), idem(['run', 'counted', '--jsn'])]);
    expect(typo.stderr).toBe("idem: error: unknown command 'rnu' (Did you mean run?); see --help\n");
    expect(optionTypo.stderr).toBe("idem: error: unknown option '--jsn' (Did you mean --json?); see --help\n");
    expect([typo.code, optionTypo.code]).toEqual([2, 2]);
  });

  it('idem without a command is a usage error: the help on stderr, exit 2 (as git and npm do)', async () => {
    const r = await idem([]);
    expect({ code: r.code, stdout: r.stdout }).toEqual({ code: 2, stdout: '' });
    expect(r.stderr).toMatch(/^Usage: idem \[options\] \[command\]/);
  });

  it('run --json prints its error object on stdout for every refusal, a command line that does not parse and a missing folder too', async () => {
    const [concurrency, param, wait, noJob, folder] = await Promise.all([
      idem(['run', 'counted', '--json', '--concurrency', '0']),
      idem(['run', 'counted', '--param', 'noeq', '--json']),
      idem(['run', '--key', 'k1', 'counted', '--wait', 'abc', '--json']),
      idem(['run', '--json']),
      runCli(['--jobs-dir', '/nonexistent-idem-jobs', 'run', 'counted', '--json'], { url }),
    ]);
    const refused = (job: string | null, runKey: string | null, code: string, error: string) => ({ status: 'error', job, runKey, exitCode: 2, code, error });
    const cases: Array<[CliResult, object]> = [
      [concurrency!, refused('counted', null, 'idem.invalidArgument', `option '--concurrency <n>' argument '0' is invalid. expected an integer from 1 to 64, got "0"`)],
      [param!, refused('counted', null, 'idem.invalidArgument', `option '--param <key=value>' argument 'noeq' is invalid. expected key=value, got "noeq"`)],
      [wait!, refused('counted', 'k1', 'idem.invalidArgument', `option '--wait [seconds]' argument 'abc' is invalid. expected a plain decimal number of seconds >= 0 (such as 30 or 0.5), got "abc"`)],
      [noJob!, refused(null, null, 'idem.missingArgument', `missing required argument 'job'`)],
      [folder!, refused('counted', null, 'idem.missingFolder', '--jobs-dir /nonexistent-idem-jobs: no such folder; create it or fix the path')],
    ];
    for (const [r, expected] of cases) {
      expect(r.code, r.stderr).toBe(2);
      expect(JSON.parse(r.stdout)).toEqual(expected);
      expect(lines(r.stderr)).toHaveLength(1);
    }
    // With --catch-up, --json prints an array (the slots' outcomes): here the refusal alone.
    const catchUp = await idem(['run', 'counted', '--catch-up', '3', '--json', '--concurrency', '0']);
    expect(JSON.parse(catchUp.stdout)).toEqual([refused('counted', null, 'idem.invalidArgument', `option '--concurrency <n>' argument '0' is invalid. expected an integer from 1 to 64, got "0"`)]);
  });

  it('an unreachable database exits 2 with a one-line error that never shows the password', async () => {
    const secretUrl = 'postgres://u:secret@127.0.0.1:1/x';
    const [viaEnv, viaFlag, traced] = await Promise.all([
      runCli([...FIXTURE_DIRS, 'run', 'counted'], { url: secretUrl }),
      runCli([...FIXTURE_DIRS, '--database-url', secretUrl, 'status']),
      runCli([...FIXTURE_DIRS, '--log-level', 'trace', 'run', 'counted', '--params', '{"chunks":2}'], { url: secretUrl }),
    ]);
    // The fix names the source used.
    expectOneLineError(viaEnv!, 2, 'cannot reach the database at postgres://u:***@127.0.0.1:1/x: connection refused; start the server or fix DATABASE_URL');
    expectOneLineError(viaFlag!, 2, 'cannot reach the database at postgres://u:***@127.0.0.1:1/x: connection refused; start the server or fix --database-url');
    expect(traced!.code).toBe(2);
    for (const r of [viaEnv!, viaFlag!, traced!]) {
      expect(r.stderr + r.stdout).not.toContain('secret');
    }
  });

  it("a job's ctx.log line quoting DATABASE_URL or its password is written with the password masked", async () => {
    // pino's redaction blanks fields by name (password, connectionString); a job's message or a
    // field of another name carried the password whole to stderr (black-box round 8). A password
    // with characters JSON escapes in a log line, and percent-encoded in the URL.
    const role = `logpw_${process.pid}`;
    const password = 'lo"g\\pw#1 x';
    await query(url, `create role ${role} login superuser password '${password.replace(/'/g, "''")}'`);
    try {
      const secretUrl = new URL(url);
      secretUrl.username = role;
      secretUrl.password = encodeURIComponent(password);
      const r = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'log-secret', '--key', 'log-secret'], { url: secretUrl.href });
      expect(r.code, r.stderr).toBe(0);
      expect(r.stderr).toContain('connecting to postgres://');
      expect(r.stderr).toContain('***');
      const out = r.stderr + r.stdout;
      for (const form of [password, JSON.stringify(password).slice(1, -1), encodeURIComponent(password), secretUrl.password]) expect(out).not.toContain(form);
    } finally {
      await query(url, `drop role if exists ${role}`);
    }
  });

  /** The exiter job run again without the fault resumes and ends with each chunk committed once. */
  async function expectFixedRerunCommitsEachOnce(key: string): Promise<void> {
    const fixed = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'exiter', '--key', key], { url });
    expect(fixed.code, fixed.stderr).toBe(0);
    expect(await query(url, `select chunk_key, count(*)::int as n from work_log where job = 'exiter' and run_key = $1 group by 1 order by 1`, [key])).toEqual([
      { chunk_key: 'a', n: 1 },
      { chunk_key: 'b', n: 1 },
      { chunk_key: 'c', n: 1 },
    ]);
  }

  it("job code that ends the process (process.exit, an uncaught throw, an unhandled rejection) exits 1 with one line saying so; a rerun resumes", async () => {
    // Black-box round 8: process.exit(0) in a chunk exited 0 with nothing printed and the run left
    // unfinished, so cron or CI took a broken run for a success; an uncaught throw printed Node's
    // stack trace, not one line.
    for (const [how, said] of [['exit', 'process.exit(0)'], ['throw', 'late boom'], ['reject', 'unhandled boom']] as const) {
      const key = `exiter-${how}`;
      const r = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'exiter', '--key', key], { url, env: { EXITER_HOW: how } });
      expect(r.code, r.stderr).toBe(1);
      const errors = lines(r.stderr).filter((l) => l.startsWith('idem: error:'));
      expect(errors, r.stderr).toHaveLength(1);
      expect(errors[0]).toContain(said);
      expect(errors[0]).toContain('run the same command again to resume');
      // A fix of the job changes its code, which the resume then needs the flag for (black-box round 13).
      expect(errors[0]).toContain('(with --allow-changed-code if the fix changes the code of the job)');
      expect(r.stderr, how).not.toMatch(/^\s+at /m);
      // A job's process.exit() ends the process there and then: the run is left as a crash leaves it.
      if (how === 'exit') expect(errors[0]).toContain('idem status shows it crashed');
      await expectFixedRerunCommitsEachOnce(key);
    }
  });

  it("--json's error object for job code that ended the process carries the exit code the process ends with", async () => {
    // Black-box round 13: a chunk's process.exit(3) ended the process with 3 while --json said
    // "exitCode":1, "code":null.
    for (const [how, exitCode] of [['exit3', 3], ['exit', 1]] as const) {
      const key = `exiter-json-${how}`;
      const r = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'exiter', '--key', key, '--json'], { url, env: { EXITER_HOW: how } });
      expect(r.code, r.stderr).toBe(exitCode);
      const objects = lines(r.stdout);
      expect(objects, r.stdout).toHaveLength(1);
      expect(JSON.parse(objects[0]!)).toMatchObject({ status: 'error', exitCode, code: 'idem.jobCodeEnded' });
      await expectFixedRerunCommitsEachOnce(key);
    }
  });

  it('an uncaught throw or unhandled rejection while a chunk is still running: exit 1, one error line and one --json object, the run stopped at a chunk boundary', async () => {
    // Black-box round 10: when the chunk in flight ended within the close's grace, the stop that
    // closing the runner gave surfaced as a second error ("stopped by Runner.close()"), a second
    // --json object and exit 143, and the first line claimed a crashed run where it was interrupted.
    for (const how of ['throw', 'reject'] as const) {
      const key = `exiter-short-${how}`;
      const r = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'exiter', '--key', key, '--json'], { url, env: { EXITER_HOW: how, EXITER_WAIT_MS: '200' } });
      expect(r.code, r.stderr).toBe(1);
      const errors = lines(r.stderr).filter((l) => l.startsWith('idem: error:'));
      expect(errors, r.stderr).toHaveLength(1);
      expect(errors[0]).toContain(how === 'throw' ? 'late boom' : 'unhandled boom');
      expect(errors[0]).not.toContain('crashed');
      const objects = lines(r.stdout);
      expect(objects, r.stdout).toHaveLength(1);
      expect(JSON.parse(objects[0]!)).toMatchObject({ status: 'error', exitCode: 1 });
      expect(r.stderr).not.toContain('Runner.close()');
      // Chunk b finished within the grace: a and b committed, c never started; the run is unfinished.
      expect(await runRow(url, 'exiter', key)).toMatchObject({ status: 'interrupted' });
      await expectFixedRerunCommitsEachOnce(key);
    }
  });

  it('an uncaught throw in the chunk that is the run\'s last: exit 1, one error line and one --json object, no success printed beside them', async () => {
    // Black-box round 16 (B5-1): the chunk in flight finished within the close's grace and was the
    // run's last, so the run ended succeeded: idem printed the error object and then the success
    // object (two JSON documents on stdout, `JSON.parse` failed), exit 1, and the error line said the
    // run was "stopped unfinished".
    for (const how of ['throw', 'reject'] as const) {
      const key = `exiter-last-${how}`;
      const env = { EXITER_HOW: how, EXITER_WAIT_MS: '200', EXITER_KEYS: 'b' };
      const r = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'exiter', '--key', key, '--json'], { url, env });
      expect(r.code, r.stderr).toBe(1);
      const objects = lines(r.stdout);
      expect(objects, r.stdout).toHaveLength(1);
      expect(JSON.parse(objects[0]!)).toMatchObject({ status: 'error', job: 'exiter', runKey: key, exitCode: 1, code: 'idem.jobCodeEnded' });
      const errors = lines(r.stderr).filter((l) => l.startsWith('idem: error:'));
      expect(errors, r.stderr).toHaveLength(1);
      expect(errors[0]).not.toContain('unfinished');
      expect(errors[0]).toContain('idem status shows how it ended');
      // Its one chunk committed: the run is done, and the same command says so.
      expect(await runRow(url, 'exiter', key)).toMatchObject({ status: 'succeeded' });
      const text = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'exiter', '--key', key], { url, env: { ...env, EXITER_HOW: 'none' } });
      expect(text.code, text.stderr).toBe(0);
      expect(text.stdout).toContain('already done');
    }
    // Without --json: the error line alone, no "succeeded" line on stdout.
    const plain = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'exiter', '--key', 'exiter-last-plain'], { url, env: { EXITER_HOW: 'throw', EXITER_WAIT_MS: '200', EXITER_KEYS: 'b' } });
    expect(plain.code, plain.stderr).toBe(1);
    expect(plain.stdout).toBe('');
  });

  it('the same key with other params exits 65 and changes nothing', async () => {
    const first = await idem(['run', 'counted', '--params', '{"chunks":2,"label":"a"}', '--key', 'cli-mismatch']);
    expect(first.code, first.stderr).toBe(0);
    const before = await snapshot(url, ALL_TABLES);
    const r = await idem(['run', 'counted', '--params', '{"chunks":2,"label":"b"}', '--key', 'cli-mismatch']);
    expectOneLineError(r, 65, /run key "cli-mismatch" of job "counted" was already used with other params .*; pass a new --key/);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('a failing chunk exits 1 naming the step and chunk; after the fix the same command resumes and exits 0', async () => {
    await query(url, `insert into fail_chunks (chunk_key) values ('c0002')`);
    const failed = await idem(['run', 'counted', '--params', '{"chunks":3}', '--key', 'cli-fail']);
    expect(failed.code, failed.stderr).toBe(1);
    const errors = lines(failed.stderr).filter((l) => l.startsWith('idem: error:'));
    expect(errors).toEqual([
      'idem: error: job "counted" failed in step "work", chunk c0002 after 1 try: injected failure in chunk c0002; fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)',
    ]);
    expect(await runRow(url, 'counted', 'cli-fail')).toMatchObject({ status: 'failed', attempt: 1 });
    // Its detail view says the step failed (the step's row still says running: nobody finished it).
    const detail = await idem(['status', 'counted', '--key', 'cli-fail']);
    expect(lines(detail.stdout).find((l) => /^ {2}\d\. work\b/.test(l))).toMatch(/^ {2}\d\. work +failed +1\/3 chunks$/);

    await query(url, `delete from fail_chunks`);
    const resumed = await idem(['run', 'counted', '--params', '{"chunks":3}', '--key', 'cli-fail', '--json']);
    expect(resumed.code, resumed.stderr).toBe(0);
    // c0002, c0003 and the finish step: what attempt 1 committed is not run again.
    expect(JSON.parse(resumed.stdout)).toMatchObject({ status: 'succeeded', attempt: 2, executed: 3 });
    expect(await workCounts(url, 'cli-fail')).toEqual(new Map([['c0001', 1], ['c0002', 1], ['c0003', 1]]));
  });

  it('run --json that does not succeed still prints one JSON object on stdout: the exit code, the error code and the message', async () => {
    await query(url, `insert into fail_chunks (chunk_key) values ('c0001')`);
    const failed = await idem(['run', 'counted', '--params', '{"chunks":2}', '--key', 'cli-json-fail', '--json']);
    expect(failed.code, failed.stderr).toBe(1);
    expect(JSON.parse(failed.stdout)).toEqual({
      status: 'error',
      job: 'counted',
      runKey: 'cli-json-fail',
      exitCode: 1,
      code: 'idem.runFailed',
      error: expect.stringMatching(/^job "counted" failed in step "work", chunk c0001 after 1 try: injected failure in chunk c0001; /),
    });
    expect(lines(failed.stderr).filter((l) => l.startsWith('idem: error:'))).toHaveLength(1);
    // Refused input too (exit 2), with the key it was given.
    const bad = await idem(['run', 'counted', '--params', '{"chunks":"x"}', '--key', 'cli-json-bad', '--json']);
    expect(bad.code, bad.stderr).toBe(2);
    expect(JSON.parse(bad.stdout)).toMatchObject({ status: 'error', job: 'counted', runKey: 'cli-json-bad', exitCode: 2 });
  });

  it('run --json without --key names the default run key (the params fingerprint) in its error object: failed (1) and busy (75)', async () => {
    await query(url, `insert into fail_chunks (chunk_key) values ('c0001')`);
    const params = '{"chunks":2,"label":"json-default-key"}';
    const failed = await idem(['run', 'counted', '--params', params, '--json']);
    expect(failed.code, failed.stderr).toBe(1);
    const [row] = await query<{ run_key: string }>(url, `select run_key from idem.runs where job = 'counted' and params->>'label' = 'json-default-key'`);
    expect(row?.run_key).toMatch(/^sha256:[0-9a-f]{64}$/);
    expect(JSON.parse(failed.stdout)).toMatchObject({ status: 'error', job: 'counted', runKey: row!.run_key, exitCode: 1, code: 'idem.runFailed' });
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      await holder.query('select pg_advisory_lock($1::bigint)', [lockKey('idem:job:counted')]);
      const busy = await idem(['run', 'counted', '--params', params, '--json']);
      expect(busy.code, busy.stderr).toBe(75);
      expect(JSON.parse(busy.stdout)).toMatchObject({ status: 'error', job: 'counted', runKey: row!.run_key, exitCode: 75 });
    } finally {
      await holder.end();
    }
    // Params that never validated have no key to name.
    const bad = await idem(['run', 'counted', '--params', '{"chunks":"x"}', '--json']);
    expect(bad.code, bad.stderr).toBe(2);
    expect(JSON.parse(bad.stdout)).toMatchObject({ status: 'error', job: 'counted', runKey: null, exitCode: 2 });
  });

  it('exits 75 at once when another process holds the job\'s lock, naming --wait', async () => {
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      await holder.query('select pg_advisory_lock($1::bigint)', [lockKey('idem:job:counted')]);
      const r = await idem(['run', 'counted', '--params', '{"chunks":2}', '--key', 'cli-busy']);
      // Busy is the expected outcome of cron firing twice: one info log line saying "busy", no error line.
      expect({ code: r.code, stdout: r.stdout, errorLines: lines(r.stderr).filter((l) => !l.startsWith('{')) }).toEqual({ code: 75, stdout: '', errorLines: [] });
      expect(logLines(r.stderr)).toEqual([expect.objectContaining({ level: 30, msg: expect.stringMatching(/^busy: job "counted" is running in another process \(its advisory lock is held by backend \d+ \((?:idem-lock [^,)]+:\d+, )?silent \d+s\)\); try again later or pass --wait$/), exitCode: 75 })]);
      expect(await workCounts(url, 'cli-busy')).toEqual(new Map());
    } finally {
      await holder.end();
    }
  });

  it('--dry-run prints the run\'s state and steps, exits 0 and writes nothing', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const r = await idem(['run', 'counted', '--params', '{"chunks":2}', '--key', 'cli-dry', '--dry-run']);
    expect(r.code, r.stderr).toBe(0);
    expect(r.stdout).toBe('dry run: job "counted" run key cli-dry is new; steps: prepare, work (chunked), finish; nothing was written\n');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    expect(await runRow(url, 'counted', 'cli-dry')).toBeUndefined();
  });

  it('--retry-skipped runs the chunks a step skipped under maxFailedChunks, also in a succeeded run', async () => {
    const skippy = (extra: string[] = []) => runCli(['--jobs-dir', MORE_JOBS, 'run', 'skippy', '--key', 'cli-skips', ...extra], { url });
    await query(url, `insert into fail_chunks (chunk_key) values ('c0002'), ('c0004')`);
    const first = await skippy();
    expect(first.code, first.stderr).toBe(0);
    expect(first.stdout).toContain('5 chunks in 1 step (2 skipped: see idem status, retry with --retry-skipped)');
    expect([...(await workCounts(url, 'cli-skips')).keys()]).toEqual(['c0001', 'c0003', 'c0005']);
    // A plain rerun is a no-op: skipped chunks wait for an explicit retry.
    await query(url, 'delete from fail_chunks');
    const plain = await skippy(['--json']);
    expect(JSON.parse(plain.stdout)).toMatchObject({ status: 'already-succeeded', executed: 0 });
    const retried = await skippy(['--retry-skipped', '--json']);
    expect(retried.code, retried.stderr).toBe(0);
    expect(JSON.parse(retried.stdout)).toMatchObject({ status: 'succeeded', attempt: 2, executed: 2, summary: { skipped: 0 } });
    expect(await workCounts(url, 'cli-skips')).toEqual(new Map(['c0001', 'c0002', 'c0003', 'c0004', 'c0005'].map((k) => [k, 1])));
  });

  it('a job file that cannot be loaded exits 2 naming the file, line and column, then the source line', async () => {
    const r = await runCli(['--jobs-dir', BROKEN_JOBS, 'run', 'counted'], { url });
    expect({ code: r.code, stdout: r.stdout }).toEqual({ code: 2, stdout: '' });
    // One line that says it all, then the offending line (here: the end of the file) with a caret.
    expect(lines(r.stderr)[0]).toBe('idem: error: cannot load jobs file test/fixtures/broken-jobs/does-not-compile.js:6:1: syntax error: Expected identifier but found end of file; fix the file');
    expect(lines(r.stderr)).toHaveLength(3);
  });

  it('never logs the database password, even at trace level', async () => {
    const password = decodeURIComponent(new URL(url).password);
    expect(password.length).toBeGreaterThan(3);
    const r = await idem(['--log-level', 'trace', 'run', 'counted', '--params', '{"chunks":2}', '--key', 'cli-trace']);
    expect(r.code, r.stderr).toBe(0);
    expect(lines(r.stderr).length).toBeGreaterThan(3);
    expect(r.stderr + r.stdout).not.toContain(password);
  });
});

describe('idem help, status and list', () => {
  it('--help on every command exits 0 and prints its usage', async () => {
    const cases: Array<[string[], string]> = [
      [['--help'], 'Usage: idem [options] [command]'],
      [['run', '--help'], 'Usage: idem run [options] <job>'],
      [['migrate', '--help'], 'Usage: idem migrate [options]'],
      [['list', '--help'], 'Usage: idem list [options]'],
      [['status', '--help'], 'Usage: idem status [options] [job]'],
      [['help', 'run'], 'Usage: idem run [options] <job>'],
    ];
    const results = await Promise.all(cases.map(([args]) => runCli(args)));
    results.forEach((r, i) => {
      expect(r.code, `${cases[i]![0].join(' ')}: ${r.stderr}`).toBe(0);
      expect(r.stdout).toContain(cases[i]![1]);
    });
  });

  it("run --help names every source --target-chunk-ms sizes, as the README does", async () => {
    // Black-box round 13: it said keyRange only, while keyList and keysetQuery honour it too.
    const r = await runCli(['run', '--help']);
    expect(r.code, r.stderr).toBe(0);
    // The option's help, up to the next option (its place in the list is commander's).
    const from = r.stdout.indexOf('--target-chunk-ms');
    const line = r.stdout.slice(from, r.stdout.indexOf('\n  -', from)).replace(/\s+/g, ' ') + ' ';
    expect(line).toBe('--target-chunk-ms <ms> grow or shrink keyRange, keyList and keysetQuery chunks toward this duration ');
  });

  it('idem help of an unknown command is one error line (exit 2), as idem <unknown> is; idem help help is the help (exit 0)', async () => {
    const [unknown, close, helpHelp] = await Promise.all([runCli(['help', 'nosuch']), runCli(['help', 'statu']), runCli(['help', 'help'])]);
    // Before: the whole help on stderr, with no line saying what was wrong (and help help: the same).
    expect({ code: unknown.code, stderr: unknown.stderr, stdout: unknown.stdout }).toEqual({ code: 2, stderr: "idem: error: unknown command 'nosuch'; see --help\n", stdout: '' });
    expect({ code: close.code, stderr: close.stderr }).toEqual({ code: 2, stderr: "idem: error: unknown command 'statu' (Did you mean status?); see --help\n" });
    expect(helpHelp.code, helpHelp.stderr).toBe(0);
    expect(helpHelp.stdout).toContain('Usage: idem [options] [command]');
  });

  it('an option that takes one value, given twice, is refused (exit 2) instead of the last one winning; --param and --health repeat', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const [key, schema, params, keyJson] = await Promise.all([
      runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'a', '--key', 'b'], { url }),
      runCli([...FIXTURE_DIRS, '--schema', 'idem', '--schema', 'other', 'status'], { url }),
      runCli([...FIXTURE_DIRS, 'run', 'counted', '--param', 'chunks=1', '--param', 'pauseMs=0', '--key', 'repeat-param', '--dry-run', '--health', 'transactionAgeSeconds=900', '--health', 'lockWaitMs=off'], { url }),
      runCli([...FIXTURE_DIRS, 'run', 'counted', '--json', '--key=a', '--key', 'b'], { url }),
    ]);
    // --json: the error object names no run key (before: "b", a run that was never asked for).
    expect(keyJson!.code, keyJson!.stderr).toBe(2);
    expect(JSON.parse(keyJson!.stdout)).toMatchObject({ status: 'error', job: 'counted', runKey: null, code: 'idem.repeatedOption' });
    // Before: exit 0, "(run key b, attempt 1)".
    expectOneLineError(key!, 2, "option '--key' was given more than once; give it once; see --help");
    expectOneLineError(schema!, 2, "option '--schema' was given more than once; give it once; see --help");
    expect(params!.code, params!.stderr).toBe(0);
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
  });

  it('--version and -V print the version of the installed idem and exit 0, as every CLI does', async () => {
    // The first thing asked in a bug report; it was "unknown option '--version'", exit 2.
    const { version } = JSON.parse(await readFile(new URL('../package.json', import.meta.url), 'utf8')) as { version: string };
    for (const r of await Promise.all([runCli(['--version']), runCli(['-V'])])) {
      expect({ code: r.code, stdout: r.stdout, stderr: r.stderr }).toEqual({ code: 0, stdout: `${version}\n`, stderr: '' });
    }
  });

  it('status --json prints parseable runs with progress and state', async () => {
    // Its own runs: one succeeded at once, one that failed and was resumed (attempt 2).
    const runner = await Runner.connect({ connectionString: url });
    try {
      await runner.run(counted, { params: { chunks: 3 }, key: 'st-ok' });
      await query(url, `insert into fail_chunks (chunk_key) values ('c0002')`);
      await runner.run(counted, { params: { chunks: 3 }, key: 'st-resumed' }).catch(() => {});
      await query(url, `delete from fail_chunks`);
      await runner.run(counted, { params: { chunks: 3 }, key: 'st-resumed' });
    } finally {
      await query(url, `delete from fail_chunks`);
      await runner.close();
    }
    const r = await idem(['status', '--json']);
    expect(r.code, r.stderr).toBe(0);
    const rows = JSON.parse(r.stdout) as Array<Record<string, unknown>>;
    expect(Array.isArray(rows)).toBe(true);
    expect(rows.find((x) => x.runKey === 'st-ok')).toMatchObject({ job: 'counted', state: 'succeeded', attempt: 1, chunksDone: 5, chunksPlanned: 5, fullyPlanned: true });
    expect(rows.find((x) => x.runKey === 'st-resumed')).toMatchObject({ job: 'counted', state: 'succeeded', attempt: 2, chunksDone: 5 });

    const filtered = await idem(['status', 'ranged', '--json']);
    expect(filtered.code).toBe(0);
    expect(JSON.parse(filtered.stdout)).toEqual([]);
    const text = await idem(['status', 'counted', '--limit', '1']);
    expect(lines(text.stdout)).toHaveLength(2);
    // An aligned table (columns start at the header's offsets), with the time since the last change.
    const [head, row] = lines(text.stdout) as [string, string];
    expect(head).toMatch(/^JOB +RUN KEY +STATE +ATTEMPT +CHUNKS +UPDATED$/);
    expect(row).toMatch(/^counted +\S+ +succeeded +\d+ +\d+\/\d+ +(just now|\d+ s ago|\d+ min ago)$/);
    for (const column of ['RUN KEY', 'STATE', 'ATTEMPT', 'CHUNKS', 'UPDATED']) expect(row[head.indexOf(column) - 1]).toBe(' ');
    for (const column of ['RUN KEY', 'STATE', 'ATTEMPT', 'CHUNKS', 'UPDATED']) expect(row[head.indexOf(column)]).not.toBe(' ');
  });

  it("status --json gives a failed run's error every documented field, code null when the error has none", async () => {
    // Black-box round 17 (B6-6): an error without a SQLSTATE had no `code` key at all, where the
    // README documents {step, chunk, message, code, tries, at}.
    await query(url, `insert into fail_chunks (chunk_key) values ('c0001')`);
    try {
      const failed = await idem(['run', 'counted', '--params', '{"chunks":2}', '--key', 'st-error-code']);
      expect(failed.code, failed.stderr).toBe(1);
    } finally {
      await query(url, `delete from fail_chunks`);
    }
    const r = await idem(['status', 'counted', '--key', 'st-error-code', '--json']);
    expect(r.code, r.stderr).toBe(0);
    const shown = JSON.parse(r.stdout) as { error: Record<string, unknown> } | Array<{ error: Record<string, unknown> }>;
    const run = Array.isArray(shown) ? shown[0] : shown;
    expect(Object.keys(run!.error).sort()).toEqual(['at', 'chunk', 'code', 'message', 'step', 'tries']);
    expect(run!.error).toMatchObject({ step: 'work', chunk: 'c0001', code: null, tries: expect.any(Number) });
  });

  it("status shows a run's params with DATABASE_URL's password masked, as every log line does", async () => {
    // Review of the change that added params to status: a job's param that quotes the database's
    // password (a second connection string) was printed whole by idem status.
    const password = decodeURIComponent(new URL(url).password);
    expect(password.length).toBeGreaterThan(3);
    const made = await idem(['run', 'counted', '--params', JSON.stringify({ chunks: 1, label: `copy-from:${password}` }), '--key', 'cli-secret-param']);
    expect(made.code, made.stderr).toBe(0);
    for (const args of [['status', 'counted', '--key', 'cli-secret-param'], ['status', 'counted', '--key', 'cli-secret-param', '--json'], ['status', '--json'], ['status']]) {
      const r = await idem(args);
      expect(r.code, r.stderr).toBe(0);
      expect(r.stdout, args.join(' ')).not.toContain(password);
    }
    const detail = await idem(['status', 'counted', '--key', 'cli-secret-param']);
    expect(detail.stdout).toContain('copy-from:***');
  });

  it("a run key holding DATABASE_URL's password is printed masked everywhere, as log lines mask it", async () => {
    // Black-box round 13 (B2-12): log lines masked such a key, while the run summary, status,
    // --json and the error lines printed it whole.
    const password = decodeURIComponent(new URL(url).password);
    expect(password.length).toBeGreaterThan(3);
    const key = `${password}-x`;
    const made = await idem(['run', 'counted', '--params', '{"chunks":1}', '--key', key]);
    expect(made.code, made.stderr).toBe(0);
    expect(made.stdout).toContain('(run key ***-x, attempt 1)');
    const outputs = [made];
    for (const args of [
      ['run', 'counted', '--params', '{"chunks":1}', '--key', key, '--json'],
      ['status'],
      ['status', '--json'],
      ['status', 'counted', '--key', key],
      ['status', 'counted', '--key', key, '--json'],
      ['status', 'counted', '--key', `${password}-nope`],
      ['status', 'counted', '--key', `${password}-nope`, '--json'],
      ['pause', 'counted', '--key', key],
      ['pause', 'counted', '--key', key, '--json'],
      ['resume', 'counted', '--key', key, '--json'],
      ['reset', 'counted', '--key', key],
    ]) {
      const r = await idem(args);
      expect(r.code, `${args.join(' ')}: ${r.stderr}`).not.toBe(null);
      outputs.push(r);
    }
    expect(JSON.parse(outputs[1]!.stdout)).toMatchObject({ status: 'already-succeeded', runKey: '***-x' });
    for (const r of outputs) expect(r.stdout + r.stderr).not.toContain(password);
  });

  it("a password that is also a word is masked in --json's values, never in its codes or field names; bytes a job writes are masked too", async () => {
    // Review of the B2-12 fix: stdout was masked as text, so with the password "idem" every
    // "code":"idem.…" of --json read "***.…"; and a Buffer (a child's output piped through) was not masked at all.
    const role = 'idem_word_password';
    await query(url, `drop role if exists ${role}`);
    await query(url, `create role ${role} login superuser password 'idem'`);
    const wordUrl = new URL(url);
    wordUrl.username = role;
    wordUrl.password = 'idem';
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-bytes-'));
    try {
      const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":"x"}', '--key', 'idem-nope', '--json'], { url: wordUrl.toString() });
      expect(r.code, r.stderr).toBe(2);
      const out = JSON.stringify(JSON.parse(r.stdout));
      expect(out).toMatch(/"code":"idem\.\w+"/);
      expect(out).toContain('***-nope');
      await writeFile(path.join(dir, 'bytes.mjs'), `export default { name: 'bytes', steps: [{ name: 's', run() { process.stdout.write(Buffer.from('secret=' + decodeURIComponent(new URL(process.env.DATABASE_URL).password) + '\\n')); } }] };\n`);
      const password = decodeURIComponent(new URL(url).password);
      const b = await runCli(['--jobs-dir', dir, 'run', 'bytes', '--key', 'bytes-1'], { url });
      expect(b.code, b.stderr).toBe(0);
      expect(b.stdout).toContain('secret=***\n');
      expect(b.stdout + b.stderr).not.toContain(password);
    } finally {
      await query(url, `drop role if exists ${role}`).catch(() => {});
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('status <job> --key K shows one run in detail: state, chunks, steps; an unknown key is a usage error', async () => {
    // The run it shows.
    const made = await idem(['run', 'counted', '--params', '{"chunks":3}', '--key', 'cli-detail']);
    expect(made.code, made.stderr).toBe(0);
    const r = await idem(['status', 'counted', '--key', 'cli-detail']);
    expect(r.code, r.stderr).toBe(0);
    // The run's params as stored (the validator's output, defaults filled in): the README said
    // status --json showed them, and it did not (black-box round 13).
    const stored = { chunks: 3, pauseMs: 0, label: '', gate: null };
    const json = JSON.parse((await idem(['status', 'counted', '--key', 'cli-detail', '--json'])).stdout) as { runKey: string; params: unknown; steps: Array<{ name: string; done: number; planned: number }> };
    expect(json.runKey).toBe('cli-detail');
    expect(json.params).toEqual(stored);
    const list = JSON.parse((await idem(['status', 'counted', '--json'])).stdout) as Array<{ runKey: string; params: unknown }>;
    expect(list.find((x) => x.runKey === 'cli-detail')?.params).toEqual(stored);
    expect(lines(r.stdout).slice(0, 5)).toEqual(['job       counted', 'run key   cli-detail', `params    ${JSON.stringify(json.params)}`, 'state     succeeded, attempt 1', 'chunks    5/5 done']);
    expect(r.stdout).toMatch(/\nsteps\n  1\. \S+ +done +1\/1 chunks\n/);
    expect(r.stdout).toContain('/3 chunks');
    expect(json.steps.reduce((n, s) => n + s.done, 0)).toBe(5);
    const unknown = await idem(['status', 'counted', '--key', 'no-such-key']);
    expectOneLineError(unknown, 2, 'job "counted" has no run with key "no-such-key"');
  });

  it('status <job> --key takes the run key as the table shows it (cut to 27 characters and ...), or any unique prefix', async () => {
    // The default run key is the params fingerprint, 71 characters: the table cuts it, and the
    // full key was only in --json, so the detail view of such a run could not be reached from it.
    const made = await idem(['run', 'counted', '--params', '{"chunks":2,"label":"prefix-lookup"}', '--json']);
    expect(made.code, made.stderr).toBe(0);
    const full = (JSON.parse(made.stdout) as { runKey: string }).runKey;
    expect(full).toMatch(/^sha256:[0-9a-f]{64}$/);
    const table = await idem(['status', 'counted', '--limit', '10000']);
    const shown = lines(table.stdout).map((l) => l.split(/ +/)[1]!).find((k) => k === `${full.slice(0, 27)}...`);
    expect(shown).toBeDefined();
    for (const key of [shown!, full.slice(0, 20)]) {
      const r = await idem(['status', 'counted', '--key', key]);
      expect(r.code, r.stderr).toBe(0);
      expect(lines(r.stdout)[1]).toBe(`run key   ${full}`);
    }
    // A prefix of several keys is refused, naming them.
    for (const key of ['pfx-a', 'pfx-b']) expect((await idem(['run', 'counted', '--params', '{"chunks":1}', '--key', key])).code).toBe(0);
    const ambiguous = await idem(['status', 'counted', '--key', 'pfx-']);
    expectOneLineError(ambiguous, 2, 'job "counted" has several runs with a key starting "pfx-" (pfx-a, pfx-b); give more of the key');
  });

  it('status <job> --key takes a key with a bidi override as the table shows it (escaped), or a prefix of that', async () => {
    // Black-box round 12, B3-6: the table shows U+202E as \u202e, and that text (or its prefix)
    // as --key gave "has no run with key …", exit 2: only the raw character matched.
    const key = 'k\u202eevil<script>x</script>';
    const shown = 'k\\u202eevil<script>x</script>';
    const long = `long-\u202e-${'x'.repeat(40)}`;
    for (const k of [key, long]) expect((await idem(['run', 'counted', '--params', '{"chunks":1}', '--key', k])).code).toBe(0);
    const table = await idem(['status', 'counted', '--limit', '10000']);
    expect(table.code, table.stderr).toBe(0);
    expect(table.stdout).not.toContain('\u202e');
    const keys = lines(table.stdout).map((l) => l.split(/ +/)[1]!);
    const longShown = `long-\\u202e-${'x'.repeat(15)}...`; // its escaped form cut to 27 columns
    expect(keys).toEqual(expect.arrayContaining([shown, longShown]));
    for (const [given, full] of [[shown, shown], [shown.slice(0, 9), shown], ['k\\u20', shown], [key, shown], [longShown, `long-\\u202e-${'x'.repeat(40)}`]] as const) {
      const r = await idem(['status', 'counted', '--key', given]);
      expect(r.code, `${given}: ${r.stderr}`).toBe(0);
      expect(lines(r.stdout)[1]).toBe(`run key   ${full}`);
      expect(r.stdout).not.toContain('\u202e');
    }
    const json = await idem(['status', 'counted', '--key', shown, '--json']);
    expect(JSON.parse(json.stdout).runKey).toBe(key);
  });

  it('status cuts a long key to 30 terminal columns, never inside an emoji, and that text works as --key', async () => {
    const full = '🙂'.repeat(50);
    const made = await idem(['run', 'counted', '--params', '{"chunks":1,"label":"emoji-key"}', '--key', full]);
    expect(made.code, made.stderr).toBe(0);
    const table = await idem(['status', 'counted', '--limit', '10000']);
    expect(table.code, table.stderr).toBe(0);
    expect(table.stdout).not.toContain('\uFFFD');
    const shown = `${'🙂'.repeat(13)}...`; // two columns each: 26 + '...'
    expect(lines(table.stdout).map((l) => l.split(/ +/)[1]!)).toContain(shown);
    const r = await idem(['status', 'counted', '--key', shown]);
    expect(r.code, r.stderr).toBe(0);
    expect(lines(r.stdout)[1]).toBe(`run key   ${full}`);
  });

  it('list --json shows the fixture jobs and migrations with their latest state', async () => {
    // counted's latest run is this one, whatever other tests ran before.
    const runner = await Runner.connect({ connectionString: url });
    try {
      await runner.run(counted, { params: { chunks: 1 }, key: 'list-latest' });
    } finally {
      await runner.close();
    }
    const r = await idem(['list', '--json']);
    expect(r.code, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout)).toEqual([
      expect.objectContaining({ kind: 'job', name: 'counted', state: 'succeeded' }),
      expect.objectContaining({ kind: 'job', name: 'ranged', state: 'never run' }),
      expect.objectContaining({ kind: 'migration', name: '0001_create_widgets', job: 'create-widgets', state: 'pending' }),
      expect.objectContaining({ kind: 'migration', name: '0002_backfill_widgets', job: 'backfill-widgets', state: 'pending' }),
    ]);
    // In a pipe: one tab-separated line per item, for cut and awk (the table is for terminals).
    const tsv = await idem(['list']);
    expect(tsv.code, tsv.stderr).toBe(0);
    expect(tsv.stdout.trimEnd().split('\n').map((l) => l.split('\t').slice(0, 3))).toEqual([
      ['job', 'counted', 'succeeded'],
      ['job', 'ranged', 'never run'],
      ['migration', '0001_create_widgets', 'pending'],
      ['migration', '0002_backfill_widgets', 'pending'],
    ]);
  });
});

describe('run keys: what --key may contain, and what text output shows of stored ones', () => {
  /** A control character as the messages name it: visible, never raw. */
  const CONTROL_KEYS: Array<[string, string]> = [
    ['evil\n\x1b[2J\x1b[Hfake', 'U+000A'],
    ['tab\there', 'U+0009'],
    ['cr\rhere', 'U+000D'],
    ['esc\x1b', 'U+001B'],
    ['del\x7f', 'U+007F'],
    ['c1\u0085next-line', 'U+0085'],
    ['csi\u009b2J', 'U+009B'],
  ];

  it('a --key with a control character (C0, DEL, C1) exits 2 with one line naming it and the fix; nothing is written', async () => {
    const before = await snapshot(url, ALL_TABLES);
    const results = await Promise.all(CONTROL_KEYS.map(([key]) => idem(['run', 'counted', '--params', '{"chunks":1}', '--key', key])));
    results.forEach((r, i) => {
      const [key, named] = CONTROL_KEYS[i]!;
      const at = [...key].findIndex((ch) => /\p{Cc}/u.test(ch)) + 1;
      expectOneLineError(r, 2, `--key must not contain control characters (it has ${named} at character ${at}); pass a key of printable characters, e.g. 2026-11-30`);
      // The refusal itself shows none of them raw.
      expect(r.stderr.slice(0, -1)).not.toMatch(/\p{Cc}/u);
    });
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    // Exactly these keys: another test of this file stores a key with control characters on purpose.
    expect(await query(url, `select run_key from idem.runs where run_key = any($1::text[])`, [CONTROL_KEYS.map(([key]) => key)])).toEqual([]);
  });

  it('--key counts characters, not UTF-16 units: 200 emoji are a key, 201 are refused; printable non-ASCII is allowed', async () => {
    const emoji200 = '😀'.repeat(200);
    // One at a time: two runs of a job at once would be busy (75).
    const run = (key: string) => idem(['run', 'counted', '--params', '{"chunks":1}', '--key', key]);
    const ok = await run(emoji200);
    const tooLong = await run('😀'.repeat(201));
    const accented = await run('Größe-日本-2026');
    const empty = await run('');
    expect(ok.code, ok.stderr).toBe(0);
    expect(await runRow(url, 'counted', emoji200)).toMatchObject({ status: 'succeeded' });
    expectOneLineError(tooLong, 2, '--key must be 1 to 200 characters (got 201)');
    expect(await runRow(url, 'counted', '😀'.repeat(201))).toBeUndefined();
    expect(accented.code, accented.stderr).toBe(0);
    expect(await runRow(url, 'counted', 'Größe-日本-2026')).toMatchObject({ status: 'succeeded' });
    expectOneLineError(empty, 2, '--key must be 1 to 200 characters (got 0)');
  });

  it('pause, resume, cancel, reset and prune print their documented --json shapes; pause and cancel say the request pending on a live run', async () => {
    // Black-box round 15 (B1-4): reset had no --json (exit 2) while the others took it, pause's
    // JSON of a live run did not show that a pause was now pending, and none was documented.
    const key = 'json-shapes';
    const gate = await holdGate(url, key);
    const worker = spawnCli([...FIXTURE_DIRS, 'run', 'counted', '--params', JSON.stringify({ chunks: 50, pauseMs: 0, label: '', gate: key }), '--key', key], { url, timeoutMs: 60_000 });
    const json = async (args: string[]) => {
      const r = await idem([...args, '--json']);
      expect(r.code, `${args.join(' ')}: ${r.stderr}`).toBe(0);
      return JSON.parse(r.stdout) as unknown;
    };
    try {
      await waitFor(async () => ((await lockWaiters(url)) > 0 ? true : undefined), 'the run to hold a chunk at the gate');
      expect(await json(['pause', 'counted', '--key', key])).toEqual({ job: 'counted', runKey: key, status: 'running', live: true, requested: 'pause' });
      expect(await query(url, `select requested from idem.runs where run_key = $1`, [key])).toEqual([{ requested: 'pause' }]);
      expect(await json(['resume', 'counted', '--key', key])).toEqual({ job: 'counted', runKey: key, status: 'running', live: true, requested: null });
      expect(await json(['cancel', 'counted', '--key', key])).toEqual({ job: 'counted', runKey: key, status: 'running', live: true, requested: 'cancel' });
      // The worker polls the run row once a second: on a loaded machine it may see the pause before
      // the resume (it stops then, and ends by the request as it stands: cancel), else the cancel.
      await waitFor(async () => /(pause|cancel) requested by an operator/.test(worker.stderr()), 'the worker to see a request', { timeoutMs: 20_000 });
    } finally {
      await gate.release();
    }
    const ended = await worker.done;
    expect(ended.code, ended.stderr.slice(-2000) + ended.stdout).toBe(1);
    expect(await query(url, `select status from idem.runs where run_key = $1`, [key])).toEqual([{ status: 'cancelled' }]);
    const [{ n: markers } = { n: -1 }] = await query<{ n: number }>(url, `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.run_key = $1`, [key]);
    expect(await json(['reset', 'counted', '--key', key])).toEqual({ job: 'counted', runKey: key, chunks: markers, effects: 0 });
    expect(await query(url, `select 1 from idem.runs where run_key = $1`, [key])).toEqual([]);
    const pruned = await json(['prune', '--older-than', '1000d']);
    expect(pruned).toEqual({ runs: 0, steps: 0, chunks: 0, effects: 0, skipped: 0 });
  });

  it('a key with a bidi override is echoed escaped by run, reset and pause, as status shows it; an over-long key is echoed cut, with the limit', async () => {
    // U+202E is printable for --key (not a control character) but reorders the rest of a terminal line.
    const key = 'bidi-\u202eevil';
    const shown = 'bidi-\\u202eevil';
    const run = await idem(['run', 'counted', '--params', '{"chunks":1}', '--key', key]);
    expect(run.code, run.stderr).toBe(0);
    expect(run.stdout).toContain(`(run key ${shown}, attempt 1)`);
    const again = await idem(['run', 'counted', '--params', '{"chunks":1}', '--key', key]);
    expect(again.stdout).toContain(`(run key ${shown}, finished `);
    const pause = await idem(['pause', 'counted', '--key', key]);
    expectOneLineError(pause, 2, `run "${shown}" of job "counted"`);
    const reset = await idem(['reset', 'counted', '--key', key]);
    expect(reset.code, reset.stderr).toBe(0);
    expect(reset.stdout).toMatch(new RegExp(`^reset: forgot run ${shown.replace(/\\/g, '\\\\')} of job "counted" `));
    // Text output and error lines; stderr's JSON log lines keep the value exact, as --json does.
    for (const r of [run, again, reset]) expect(r.stdout).not.toContain('\u202e');
    expect(pause.stderr).not.toContain('\u202e');

    const long = 'k'.repeat(5000);
    // pause, resume and cancel share one lookup; reset and status have their own.
    const commands = ['pause', 'reset', 'status'];
    const refused = await Promise.all(commands.map((command) => idem([command, 'counted', '--key', long])));
    refused.forEach((r, i) => {
      expectOneLineError(r, 2, `job "counted" has no run with key "${'k'.repeat(40)}…" (5000 characters; a run key has at most 200); see idem status counted`);
      expect(r.stderr.length, commands[i]).toBeLessThan(400);
    });
  });

  it('keys that differ by an invisible character (zero-width, soft hyphen, no-break space) are told apart: run, status and errors show it as \\uHHHH', async () => {
    // Black-box round 13 (B2-11): "inv-a\u200bb" printed as "inv-ab", and "inv-a\u00a0b" as "inv-a b".
    const key = 'inv-a\u200bb';
    const run = await idem(['run', 'counted', '--params', '{"chunks":1}', '--key', key]);
    expect(run.code, run.stderr).toBe(0);
    expect(run.stdout).toContain('(run key inv-a\\u200bb, attempt 1)');
    const table = await idem(['status', 'counted']);
    expect(table.stdout).toContain('inv-a\\u200bb');
    // What status shows works as --key, as for a bidi control.
    const detail = await idem(['status', 'counted', '--key', 'inv-a\\u200bb']);
    expect(detail.code, detail.stderr).toBe(0);
    expect(lines(detail.stdout)[1]).toBe('run key   inv-a\\u200bb');
    const unknown = await idem(['status', 'counted', '--key', 'inv-a\u00a0b']);
    expectOneLineError(unknown, 2, 'job "counted" has no run with key "inv-a\\u00a0b"');
    // Text output and error lines; stderr's JSON log lines keep the value exact, as --json does.
    for (const r of [run, table, detail]) expect(r.stdout).not.toMatch(/[\u200b\u00a0]/);
    expect(unknown.stderr).not.toMatch(/[\u200b\u00a0]/);
  });

  it('status shows control characters of a stored key (an older idem, SQL) escaped, never raw, in the table and the detail view', async () => {
    // Neither the CLI nor the library stores such a key any more; an older idem's library did. Here
    // the row is made as it left it: a run, its key rewritten in SQL.
    const stored = 'evil\n\x1b[2J\x1b[Hfake\u009b';
    const runner = await Runner.connect({ connectionString: url });
    try {
      await runner.run(counted, { params: { chunks: 1 }, key: 'evil-to-be' });
    } finally {
      await runner.close();
    }
    await query(url, `update idem.runs set run_key = $1 where job = 'counted' and run_key = 'evil-to-be'`, [stored]);
    const shown = 'evil\\n\\x1b[2J\\x1b[Hfake\\x9b';
    const table = await idem(['status', 'counted', '--limit', '10000']);
    expect(table.code, table.stderr).toBe(0);
    expect(table.stdout.replace(/\n/g, '')).not.toMatch(/\p{Cc}/u);
    expect(lines(table.stdout).find((l) => l.includes('evil'))).toMatch(new RegExp(`^counted +${shown.replace(/[\\[\]]/g, '\\$&')} +succeeded `));
    const detail = await idem(['status', 'counted', '--key', 'evil']);
    expect(detail.code, detail.stderr).toBe(0);
    expect(detail.stdout.replace(/\n/g, '')).not.toMatch(/\p{Cc}/u);
    expect(lines(detail.stdout)[1]).toBe(`run key   ${shown}`);
    // --json keeps the value exact (JSON escapes it).
    const json = JSON.parse((await idem(['status', 'counted', '--limit', '10000', '--json'])).stdout) as Array<{ runKey: string }>;
    expect(json.some((r) => r.runKey === stored)).toBe(true);
  });

  it('a skipped chunk tried once says "after 1 try", like a failure does', async () => {
    await query(url, `insert into fail_chunks (chunk_key) values ('c0002')`);
    const r = await runCli(['--jobs-dir', MORE_JOBS, 'run', 'skippy', '--key', 'cli-one-try'], { url });
    expect(r.code, r.stderr).toBe(0);
    const table = await runCli(['--jobs-dir', MORE_JOBS, 'status', 'skippy'], { url });
    const detail = await runCli(['--jobs-dir', MORE_JOBS, 'status', 'skippy', '--key', 'cli-one-try'], { url });
    expect(lines(table.stdout)).toContain('    skipped: step "work" chunk c0002 after 1 try: injected failure in chunk c0002');
    expect(lines(detail.stdout)).toContain('  step "work" chunk c0002 after 1 try: injected failure in chunk c0002');
    expect(table.stdout + detail.stdout).not.toContain('1 tries');
  });
});

describe('--database-url and DATABASE_URL must be URLs', () => {
  it('a keyword/value connection string exits 2 saying a URL is required, never showing the password; nothing is written', async () => {
    const u = new URL(url);
    const kv = `host=${u.hostname} port=${u.port} user=${decodeURIComponent(u.username)} password=secret-kv-pw dbname=${u.pathname.slice(1)}`;
    const before = await snapshot(url, ALL_TABLES);
    const [viaFlag, viaEnv, quoted] = await Promise.all([
      runCli([...FIXTURE_DIRS, '--database-url', kv, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'kv']),
      runCli([...FIXTURE_DIRS, 'status'], { url: kv }),
      runCli([...FIXTURE_DIRS, '--database-url', ` host = '127.0.0.1' password='secret-kv-pw'`, 'list']),
    ]);
    const fix = 'is a keyword/value connection string, which idem does not support; pass a URL instead: postgres://user:password@host:5432/db';
    expectOneLineError(viaFlag!, 2, `--database-url ${fix}`);
    expectOneLineError(viaEnv!, 2, `DATABASE_URL ${fix}`);
    expectOneLineError(quoted!, 2, `--database-url ${fix}`);
    for (const r of [viaFlag!, viaEnv!, quoted!]) {
      expect(r.stderr + r.stdout).not.toContain('secret-kv-pw');
      expect(r.stderr).not.toContain('host not found');
    }
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    expect(await runRow(url, 'counted', 'kv')).toBeUndefined();
  });

  it('white space: around the URL it is trimmed (a .env line, a pasted secret); inside it exit 2 saying to percent-encode it, the password not printed', async () => {
    const u = new URL(url);
    const [lead, trail] = await Promise.all([runCli([...FIXTURE_DIRS, 'status'], { url: ` ${url}` }), runCli([...FIXTURE_DIRS, '--database-url', `${url} \n`, 'status'])]);
    // pg read a leading space as the host "base", a trailing one into the database name.
    expect(lead.code, lead.stderr).toBe(0);
    expect(trail.code, trail.stderr).toBe(0);
    // The library trims it the same way.
    const lib = await Runner.connect({ connectionString: ` ${url}\n` });
    await lib.close();
    const spaced = `postgres://${u.username}:sp ace-secret@${u.host}${u.pathname}`;
    const before = await snapshot(url, ALL_TABLES);
    const r = await runCli([...FIXTURE_DIRS, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'spaced'], { url: spaced });
    expectOneLineError(r, 2, 'DATABASE_URL holds white space in its user, password or host; percent-encode it (a space as %20): postgres://user:password@host:5432/db');
    expect(r.stderr + r.stdout).not.toContain('ace-secret');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    // In the query it is read as meant (pg takes it as libpq does).
    const withOptions = new URL(url);
    const q = await runCli([...FIXTURE_DIRS, 'status'], { url: `${withOptions.href}${withOptions.search ? '&' : '?'}options=-c search_path=public` });
    expect(q.code, q.stderr).toBe(0);
  });

  it("a password from PGPASSFILE works with no warning line: pg's deprecation of it is advice to idem, not to its user", async () => {
    const u = new URL(url);
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-pgpass-'));
    try {
      const file = path.join(dir, 'pgpass');
      await writeFile(file, `${u.hostname}:${u.port}:*:${decodeURIComponent(u.username)}:${decodeURIComponent(u.password)}\n`, { mode: 0o600 });
      const bare = new URL(url);
      bare.password = '';
      const r = await runCli([...FIXTURE_DIRS, 'status'], { url: bare.href, env: { PGPASSFILE: file, PGPASSWORD: undefined } });
      expect(r.code, r.stderr).toBe(0);
      // Before: "idem: warning: DeprecationWarning: pgpass support is deprecated and will be removed in pg@9.0. …" on every command.
      expect(r.stderr).toBe('');
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('a port past 65535 exits 2 naming the port, not the password\'s encoding', async () => {
    const u = new URL(url);
    const r = await runCli([...FIXTURE_DIRS, 'status'], { url: `postgres://${u.username}:pw-secret@127.0.0.1:99999${u.pathname}` });
    expectOneLineError(r, 2, 'DATABASE_URL has port 99999, which is not a port number (1 to 65535); fix the port: postgres://user:password@host:5432/db');
    expect(r.stderr).not.toContain('pw-secret');
  });

  it('DATABASE_URL or --database-url set but empty, or PGHOST/PGPORT/PGDATABASE without a URL: exit 2, no embedded server started', async () => {
    const dir = await mkdtemp(path.join(tmpdir(), 'idem-empty-url-'));
    try {
      const [env, flag, libpq] = await Promise.all([
        runCli([...FIXTURE_DIRS, 'status'], { url: '', cwd: dir }),
        runCli([...FIXTURE_DIRS, '--database-url', '  ', 'migrate'], { cwd: dir }),
        runCli([...FIXTURE_DIRS, 'migrate'], { cwd: dir, env: { PGHOST: '127.0.0.1', PGDATABASE: 'app' } }),
      ]);
      expectOneLineError(env!, 2, 'DATABASE_URL is set but empty; set it to postgres://user:password@host:5432/db, or unset it to use the embedded server under .idem/');
      expectOneLineError(flag!, 2, '--database-url is set but empty; set it to postgres://user:password@host:5432/db, or unset it to use the embedded server under .idem/');
      expectOneLineError(
        libpq!,
        2,
        'PGHOST, PGDATABASE are set but DATABASE_URL is not, and idem takes its server only from DATABASE_URL or --database-url; set DATABASE_URL=postgres:/// to connect as the PG* variables say, or unset them to use the embedded server under .idem/',
      );
      expect(await readdir(dir)).toEqual([]);
    } finally {
      await rm(dir, { recursive: true, force: true });
    }
  });

  it('a URL of another database (mysql://) exits 2 naming the scheme, never showing the password; nothing is written', async () => {
    const u = new URL(url);
    const other = `mysql://${u.username}:secret-my-pw@${u.host}${u.pathname}`;
    const before = await snapshot(url, ALL_TABLES);
    const [viaFlag, viaEnv] = await Promise.all([
      runCli([...FIXTURE_DIRS, '--database-url', other, 'run', 'counted', '--params', '{"chunks":1}', '--key', 'my']),
      runCli([...FIXTURE_DIRS, 'status'], { url: other }),
    ]);
    const fix = 'is a mysql: URL, and idem works with PostgreSQL only; pass postgres://user:password@host:5432/db (or postgresql://)';
    expectOneLineError(viaFlag!, 2, `--database-url ${fix}`);
    expectOneLineError(viaEnv!, 2, `DATABASE_URL ${fix}`);
    for (const r of [viaFlag!, viaEnv!]) expect(r.stderr + r.stdout).not.toContain('secret-my-pw');
    expect(await snapshot(url, ALL_TABLES)).toEqual(before);
    expect(await runRow(url, 'counted', 'my')).toBeUndefined();
  });
});
