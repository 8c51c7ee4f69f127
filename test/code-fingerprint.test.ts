import { appendFile, mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, Runner, RunFailedError, sql } from '../src/index.ts';
import { CodeChangedError } from '../src/code-fingerprint.ts';
import { holdGate, killLeftovers, lines, query, REPO, runCli, runRow, waitFor, lockWaiters } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { api, startServe } from './support/server.ts';

const testDb = useTestDatabase({ fixtureTables: true });
let url: string;
beforeAll(() => {
  url = testDb.url;
});

let dir: string;
beforeAll(async () => {
  // Inside the package (under the git-ignored .idem/), so the job imports 'idem' by name, as a
  // user's job does, and loads as the package's ESM.
  await mkdir(path.join(REPO, '.idem'), { recursive: true });
  dir = await mkdtemp(path.join(REPO, '.idem', 'code-'));
});
afterAll(async () => {
  await killLeftovers();
  await rm(dir, { recursive: true, force: true });
});

/** A job of three chunks; a chunk whose key is in fail_chunks fails after its work (rolled back). */
const JOB_FILE = `import { defineJob, sql } from 'idem';
export default defineJob({
  name: 'code-check',
  steps: [{
    name: 'work',
    chunks: () => ({ chunks: [{ key: 'a' }, { key: 'b' }, { key: 'c' }], next: null }),
    async run({ db, run }, { key }) {
      await sql\`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('code-check', \${run.runKey}, 'work', \${key}, \${run.attempt}, 0)\`.execute(db);
      const { rows } = await sql\`select 1 from fail_chunks where chunk_key = \${key}\`.execute(db);
      if (rows.length > 0) throw new Error('injected failure in chunk ' + key);
    },
  }],
});
`;

const cli = (...args: string[]) => runCli(['--jobs-dir', dir, '--log-level', 'warn', ...args], { url });

describe('code changes between attempts', () => {
  it('a resume under an edited job file is refused with exit 65 and changes nothing; --allow-changed-code resumes and is recorded', async () => {
    await writeFile(path.join(dir, 'code-check.ts'), JOB_FILE);
    await query(url, `insert into fail_chunks (chunk_key) values ('b')`);
    const failed = await cli('run', 'code-check', '--key', 'k1', '--no-progress');
    expect(failed.code, failed.stderr).toBe(1);
    // Black-box round 13: the fix is often in the job's code, which the resume then needs
    // --allow-changed-code for; the failure says so (the CLI's and finalize's), not only "fix the cause".
    expect(failed.stderr).toContain("fix the cause and run the same command again to resume there (with --allow-changed-code if the fix changes the code of the job)");
    const fin = await cli('finalize', 'code-check', '--key', 'k1');
    expect(fin.code, fin.stderr).toBe(1);
    expect(fin.stderr).toMatch(/fix the cause, resume it \(idem run code-check --key k1; with --allow-changed-code if the fix changes the code of the job\), then finalize again$/m);
    const first = await runRow(url, 'code-check', 'k1');
    expect(first).toMatchObject({ status: 'failed', attempt: 1, code_changes: null });
    expect(first.code_fingerprint).toMatch(/^sha256:[0-9a-f]{64}$/);
    await query(url, `delete from fail_chunks where chunk_key = 'b'`);

    // A deploy edits the job file between the attempts.
    await appendFile(path.join(dir, 'code-check.ts'), '// a change deployed mid-backfill\n');
    const refused = await cli('run', 'code-check', '--key', 'k1', '--no-progress');
    expect(refused.code).toBe(65);
    const errLines = lines(refused.stderr).filter((l) => !l.startsWith('{'));
    expect(errLines).toHaveLength(1);
    // A failed run: the way to resume it with the fixed code comes first.
    expect(errLines[0]).toMatch(
      /^idem: error: run k1 of job "code-check" failed under other code \(sha256:[0-9a-f]{12}…, now sha256:[0-9a-f]{12}…\); to resume it with this code \(a fix of that failure\), pass --allow-changed-code if the change is safe for the chunks already done; else resume it with the code it failed under$/,
    );
    expect(await runRow(url, 'code-check', 'k1')).toEqual(first);
    expect(await query(url, `select chunk_key from work_log where run_key = 'k1' order by chunk_key`)).toEqual([{ chunk_key: 'a' }]);
    // --dry-run says so too (black-box round 10: it reported the run resumable, exit 0).
    const dry = await cli('run', 'code-check', '--key', 'k1', '--no-progress', '--dry-run');
    expect(dry.code, dry.stderr).toBe(65);
    expect(dry.stderr).toContain('failed under other code');
    const dryAllowed = await cli('run', 'code-check', '--key', 'k1', '--no-progress', '--dry-run', '--allow-changed-code');
    expect(dryAllowed.code, dryAllowed.stderr).toBe(0);
    expect(await runRow(url, 'code-check', 'k1')).toEqual(first);

    const allowed = await cli('run', 'code-check', '--key', 'k1', '--no-progress', '--allow-changed-code');
    expect(allowed.code).toBe(0);
    const after = await runRow(url, 'code-check', 'k1');
    expect(after).toMatchObject({ status: 'succeeded', attempt: 2 });
    expect(after.code_fingerprint).not.toBe(first.code_fingerprint);
    expect(after.code_changes).toEqual([{ from: first.code_fingerprint, to: after.code_fingerprint, attempt: 2, at: expect.any(String) }]);
    expect(await query(url, `select chunk_key from work_log where run_key = 'k1' order by chunk_key`)).toEqual([{ chunk_key: 'a' }, { chunk_key: 'b' }, { chunk_key: 'c' }]);

    const status = await cli('status', 'code-check', '--json');
    expect(JSON.parse(status.stdout)[0].codeChanges).toEqual(after.code_changes);
    expect((await cli('status', 'code-check')).stdout).toContain('code changed (allowed) at attempt 2');
  });

  it('an unchanged file resumes without the flag, and a declared version is what counts', async () => {
    const runner = await Runner.connect({ connectionString: url });
    try {
      let fail = true;
      const versioned = (version: string) =>
        defineJob({
          name: 'versioned',
          version,
          steps: [
            {
              name: 'work',
              chunks: () => ({ chunks: [{ key: 'x' }, { key: 'y' }], next: null }),
              async run({ db, run }, { key }) {
                await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('versioned', ${run.runKey}, 'work', ${key}, ${run.attempt}, 0)`.execute(db);
                if (key === 'y' && fail) throw new Error('injected');
              },
            },
          ],
        });
      await expect(runner.run(versioned('1'), { key: 'v' })).rejects.toBeInstanceOf(RunFailedError);
      expect(await runRow(url, 'versioned', 'v')).toMatchObject({ status: 'failed', code_fingerprint: 'version:1' });
      // The same version again (other object, same declared code): a plain resume, still failing.
      await expect(runner.run(versioned('1'), { key: 'v' })).rejects.toBeInstanceOf(RunFailedError);
      fail = false;
      const err = await runner.run(versioned('2'), { key: 'v' }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(CodeChangedError);
      expect(exitCodeOf(err)).toBe(65);
      expect((err as Error).message).toContain('(version:1, now version:2)');
      expect(await runRow(url, 'versioned', 'v')).toMatchObject({ status: 'failed', attempt: 2, code_fingerprint: 'version:1', code_changes: null });
      const out = await runner.run(versioned('2'), { key: 'v', allowChangedCode: true });
      expect(out).toMatchObject({ status: 'succeeded', attempt: 3 });
      expect(await runRow(url, 'versioned', 'v')).toMatchObject({ code_fingerprint: 'version:2', code_changes: [{ from: 'version:1', to: 'version:2', attempt: 3 }] });
      // A finished run is never re-checked: a later deploy does not make old runs fail.
      expect(await runner.run(versioned('3'), { key: 'v' })).toMatchObject({ status: 'already-succeeded' });
    } finally {
      await runner.close();
    }
  });

  it('a worker joining a live run under other code is refused without the flag; with it, it joins and the change is recorded', async () => {
    const [a, b] = await Promise.all([Runner.connect({ connectionString: url }), Runner.connect({ connectionString: url })]);
    const gate = await holdGate(url, 'code-join');
    let first: Promise<unknown> | undefined;
    let second: Promise<unknown> | undefined;
    let waiting: Promise<unknown> | undefined;
    try {
      const gated = (version: string) =>
        defineJob({
          name: 'joined-code',
          version,
          steps: [
            {
              name: 'work',
              chunks: () => ({ chunks: [{ key: 'x' }, { key: 'y' }, { key: 'z' }], next: null }),
              async run({ db, run }, { key }) {
                if (key === 'x') await sql`select 1 from gates where name = 'code-join' for share`.execute(db);
                await sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('joined-code', ${run.runKey}, 'work', ${key}, ${run.attempt}, 0)`.execute(db);
              },
            },
          ],
        });
      first = a.run(gated('1'), { key: 'j', join: true });
      await waitFor(async () => (await lockWaiters(url)) > 0, 'chunk x to wait at the gate');
      const refused = await b.run(gated('2'), { key: 'j', join: true }).catch((e: unknown) => e);
      expect(refused).toBeInstanceOf(CodeChangedError);
      expect(await runRow(url, 'joined-code', 'j')).toMatchObject({ status: 'running', attempt: 1, code_fingerprint: 'version:1', code_changes: null });
      // --dry-run --join refuses it as the real --join does (black-box round 13: "is running", exit 0);
      // a plain dry run still reports the live run, as the plain run is busy (75) rather than refused.
      const dryJoin = await b.run(gated('2'), { key: 'j', join: true, dryRun: true }).catch((e: unknown) => e);
      expect(dryJoin).toBeInstanceOf(CodeChangedError);
      expect((dryJoin as Error).message).toBe((refused as Error).message);
      expect(await b.run(gated('2'), { key: 'j', dryRun: true })).toMatchObject({ status: 'dry-run', plan: { state: 'running' } });
      // A plain run (cron firing during a deploy) of the live run is busy, as under the same code:
      // 75, not the code refusal (65), whose --allow-changed-code advice would only lead to 75.
      // Black-box round 10.
      const plain = await b.run(gated('2'), { key: 'j' }).catch((e: unknown) => e);
      expect(exitCodeOf(plain), String(plain)).toBe(75);
      expect((plain as Error).message).toMatch(/^job "joined-code" is running in another process \(.+\); try again later or pass --wait$/);
      expect(await runRow(url, 'joined-code', 'j')).toMatchObject({ status: 'running', attempt: 1, code_fingerprint: 'version:1', code_changes: null });
      // A wait that runs out is busy, saying how long it waited; a stop while waiting ends it at once.
      const outwaited = await b.run(gated('2'), { key: 'j', wait: 1 }).catch((e: unknown) => e);
      expect(exitCodeOf(outwaited)).toBe(75);
      expect((outwaited as Error).message).toMatch(/^job "joined-code" is still running in another process after waiting 1s/);
      const stop = new AbortController();
      setTimeout(() => stop.abort('SIGINT'), 300);
      const t0 = Date.now();
      const stopped = await b.run(gated('2'), { key: 'j', wait: 60, signal: stop.signal }).catch((e: unknown) => e);
      expect(exitCodeOf(stopped), String(stopped)).toBe(130);
      expect(Date.now() - t0).toBeLessThan(5_000);
      // With --wait it waits for the run to end, then finds it done.
      waiting = b.run(gated('2'), { key: 'j', wait: 60 });
      second = b.run(gated('2'), { key: 'j', join: true, allowChangedCode: true });
      const joinedRow = await waitFor(async () => {
        const row = await runRow(url, 'joined-code', 'j');
        return row.code_changes ? row : undefined;
      }, 'the joiner to record the change');
      expect(joinedRow).toMatchObject({ status: 'running', attempt: 1, code_fingerprint: 'version:2', code_changes: [{ from: 'version:1', to: 'version:2', attempt: 1, at: expect.any(String) }] });
      // A joiner with the code the run started under: its code changed since (black-box round 13:
      // "was started under other code (version:2, now version:1)", the hashes the wrong way round).
      const original = await b.run(gated('1'), { key: 'j', join: true }).catch((e: unknown) => e);
      expect(original).toBeInstanceOf(CodeChangedError);
      expect((original as Error).message).toBe(
        'run j of job "joined-code" changed its code at attempt 1 (from version:1 to version:2, allowed), and this process has version:1; pass --allow-changed-code to work it with this code if the change is safe for the chunks already done, or work it with version:2',
      );
    } finally {
      await gate.release();
      await Promise.allSettled([first, second, waiting]);
      await Promise.all([a.close(), b.close()]);
    }
    expect(await first).toMatchObject({ attempt: 1 });
    expect(await second).toMatchObject({ attempt: 1 });
    expect(await waiting).toMatchObject({ status: 'already-succeeded', attempt: 1 });
    const row = await runRow(url, 'joined-code', 'j');
    expect(row).toMatchObject({ status: 'succeeded', attempt: 1, code_fingerprint: 'version:2' });
    expect(row.code_changes).toHaveLength(1);
    expect(await query(url, `select chunk_key, count(*)::int as n from work_log where job = 'joined-code' group by 1 order by 1`)).toEqual([
      { chunk_key: 'x', n: 1 },
      { chunk_key: 'y', n: 1 },
      { chunk_key: 'z', n: 1 },
    ]);
  });

  it('a run started over HTTP records its code too: a resume under an edited file is refused, from the CLI as from the server', async () => {
    const serverDir = await mkdtemp(path.join(REPO, '.idem', 'code-http-'));
    try {
      await writeFile(path.join(serverDir, 'code-check.ts'), JOB_FILE);
      await query(url, `insert into fail_chunks (chunk_key) values ('b')`);
      const srv = await startServe(url, [], {}, serverDir);
      try {
        const created = await api(srv.base, 'POST', '/api/jobs/code-check/runs', { key: 'k-http', body: {} });
        expect(created.status).toBe(201);
        expect((await api(srv.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body.state).toBe('failed');
      } finally {
        srv.proc.child.kill('SIGTERM');
        await srv.proc.done;
      }
      await query(url, `delete from fail_chunks where chunk_key = 'b'`);
      const first = await runRow(url, 'code-check', 'k-http');
      expect(first).toMatchObject({ status: 'failed', attempt: 1 });
      // Before: null, so no resume under other code was ever refused.
      expect(first.code_fingerprint).toMatch(/^sha256:[0-9a-f]{64}$/);
      await appendFile(path.join(serverDir, 'code-check.ts'), '// a change deployed mid-backfill\n');
      const refused = await runCli(['--jobs-dir', serverDir, '--log-level', 'warn', 'run', 'code-check', '--key', 'k-http', '--no-progress'], { url });
      expect(refused.code, refused.stderr).toBe(65);
      expect(refused.stderr).toContain('failed under other code');
      expect(await runRow(url, 'code-check', 'k-http')).toMatchObject({ status: 'failed', attempt: 1, code_fingerprint: first.code_fingerprint });
    } finally {
      await rm(serverDir, { recursive: true, force: true });
    }
  });

  it('a step removed under --allow-changed-code: the summary counts the job\'s steps and names the dropped one with what it left undone', async () => {
    // Black-box round 10: the run said "succeeded: 4 chunks in 4 steps" for a job of 2 steps, and
    // nothing said that the removed step's chunks never committed.
    const stepsFile = (names: string[]) => `import { defineJob, sql } from 'idem';
export default defineJob({
  name: 'step-drop',
  steps: ${JSON.stringify(names)}.map((name) => ({
    name,
    chunks: () => ({ chunks: [{ key: name + '-1' }, { key: name + '-2' }], next: null }),
    async run({ db, run }, { key }) {
      const { rows } = await sql\`select 1 from fail_chunks where chunk_key = \${key}\`.execute(db);
      if (rows.length > 0) throw new Error('injected failure in chunk ' + key);
      await sql\`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values ('step-drop', \${run.runKey}, \${name}, \${key}, \${run.attempt}, 0)\`.execute(db);
    },
  })),
});
`;
    await writeFile(path.join(dir, 'step-drop.ts'), stepsFile(['one', 'two']));
    await query(url, `insert into fail_chunks (chunk_key) values ('two-2')`);
    expect((await cli('run', 'step-drop', '--key', 'sd', '--no-progress')).code).toBe(1);
    await query(url, `delete from fail_chunks where chunk_key = 'two-2'`);
    await writeFile(path.join(dir, 'step-drop.ts'), stepsFile(['one', 'three']));
    const r = await cli('run', 'step-drop', '--key', 'sd', '--no-progress', '--allow-changed-code', '--json');
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout);
    expect(out.summary).toMatchObject({ steps: [{ name: 'one', chunks: 2 }, { name: 'three', chunks: 2 }], chunks: 4, dropped: [{ name: 'two', chunks: 2, done: 1 }] });
    const human = await cli('run', 'step-drop', '--key', 'sd', '--no-progress');
    expect(human.code, human.stderr).toBe(0);
    expect(human.stdout + human.stderr).toContain('4 chunks in 2 steps; steps no longer in the job: two (1 of 2 planned chunks done)');
  });

  it('refuses a version that is neither a string nor a number at load time', () => {
    expect(() => defineJob({ name: 'bad-version', version: {} as never, steps: [{ name: 's', run() {} }] })).toThrow(/version must be a non-empty string/);
  });
});
