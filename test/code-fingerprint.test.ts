import { appendFile, mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, Runner, RunFailedError, sql } from '../src/index.ts';
import { CodeChangedError } from '../src/code-fingerprint.ts';
import { holdGate, killLeftovers, lines, query, REPO, runCli, runRow, sessions, waitFor, lockWaiters } from './support/cli.ts';
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
    // The worker under the earlier code (version:1) does not end the run: it leaves after its
    // chunk (exit 69, the joiner still finishing) or, when the joiner ended the run first, reports
    // it succeeded. Which comes first is a race (CI of stop 32 met the first).
    const firstEnd = await (first as Promise<unknown>).catch((e: unknown) => e);
    if (firstEnd instanceof Error) {
      expect(exitCodeOf(firstEnd), String(firstEnd)).toBe(69);
      expect(firstEnd.message).toMatch(/^this worker stopped after its steps: the run's code changed to version:2 since this worker joined .*the run goes on in its 1 other worker/);
    } else expect(firstEnd).toMatchObject({ attempt: 1, status: 'succeeded' });
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

  describe('workers under the earlier code, once a worker joined under other code (allowed)', () => {
    // Black-box round 13 (high): a worker under the run's first code, done with its own steps,
    // marked the run succeeded while the joiner's added step had not run (finalize then said 0 and
    // the step never ran); with a step dropped by the joiner, the earlier worker kept committing
    // that step's chunks after the run had succeeded.
    const logged = async (job: string) => (await query<{ chunk_key: string; n: number }>(url, `select chunk_key, count(*)::int as n from work_log where job = $1 group by 1 order by 1`, [job])).map((r) => `${r.chunk_key}:${r.n}`);
    const log = (job: string, key: string) => sql`insert into work_log (job, run_key, step, chunk_key, attempt, pid) values (${job}, 'k', 'x', ${key}, 0, 0)`;
    /** A single step that writes one row; `ms` sleeps first. */
    const single = (job: string, name: string, ms = 0) => ({
      name,
      async run({ db }: any) {
        if (ms) await sql`select pg_sleep(${ms / 1000})`.execute(db);
        await log(job, name).execute(db);
      },
    });
    /** Chunks x, y, z; x waits at the gate. */
    const chunked = (job: string, gate: string) => ({
      name: 'b',
      chunks: () => ({ chunks: [{ key: 'x' }, { key: 'y' }, { key: 'z' }], next: null }),
      async run({ db }: any, { key }: { key: string }) {
        if (key === 'x') await sql`select 1 from gates where name = ${gate} for share`.execute(db);
        await log(job, key).execute(db);
      },
    });

    it('a step the joiner added runs before the run succeeds; the earlier worker leaves (69), and the run is not ended by it', async () => {
      const job = 'moved-on-add';
      const [a, b] = await Promise.all([Runner.connect({ connectionString: url }), Runner.connect({ connectionString: url })]);
      const gate = await holdGate(url, job);
      let first: Promise<unknown> | undefined;
      let second: Promise<unknown> | undefined;
      try {
        const v1 = defineJob({ name: job, version: '1', steps: [single(job, 'a'), chunked(job, job)] });
        const v2 = defineJob({ name: job, version: '2', steps: [chunked(job, job), single(job, 'new', 1_500), single(job, 'a')] });
        first = a.run(v1, { key: 'k', join: true }).catch((e: unknown) => e);
        await waitFor(async () => (await lockWaiters(url)) > 0, 'chunk x to wait at the gate');
        second = b.run(v2, { key: 'k', join: true, allowChangedCode: true }).catch((e: unknown) => e);
        await waitFor(async () => ((await runRow(url, job, 'k')).code_changes ? true : undefined), 'the joiner to record its code');
        await waitFor(async () => ((await logged(job)).includes('z:1') ? true : undefined), 'the joiner to do y and z');
        await gate.release();
        const left = await first;
        expect(exitCodeOf(left), String(left)).toBe(69);
        expect((left as Error).message).toMatch(/^this worker stopped after its steps: the run's code changed to version:2 since this worker joined \(a worker joined with --allow-changed-code\), so the steps of that code end the run, not this worker's; the run goes on in its 1 other worker/);
        expect(await second).toMatchObject({ status: 'succeeded', attempt: 1 });
      } finally {
        await gate.release();
        await Promise.allSettled([first, second]);
        await Promise.all([a.close(), b.close()]);
      }
      const row = await runRow(url, job, 'k');
      expect(row).toMatchObject({ status: 'succeeded', code_fingerprint: 'version:2' });
      expect([...row.summary.steps].sort((x: { name: string }, y: { name: string }) => x.name.localeCompare(y.name))).toEqual([{ name: 'a', chunks: 1 }, { name: 'b', chunks: 3 }, { name: 'new', chunks: 1 }]);
      expect(row.summary.dropped).toBeUndefined();
      expect(await logged(job)).toEqual(['a:1', 'new:1', 'x:1', 'y:1', 'z:1']);
    });

    it('a step the joiner dropped: the earlier worker cannot commit its chunk once the run has succeeded, and exits 0: the run is done', async () => {
      // Review finding: the fence refused the chunk because the run had ended succeeded, and the
      // worker exited 69 ("interrupted, rerun"), so idem cron retried the slot once to find it done.
      const job = 'moved-on-drop';
      const [a, b] = await Promise.all([Runner.connect({ connectionString: url }), Runner.connect({ connectionString: url })]);
      const gate = await holdGate(url, job);
      let first: Promise<unknown> | undefined;
      try {
        const v1 = defineJob({ name: job, version: '1', steps: [single(job, 'a'), chunked(job, job)] });
        const v2 = defineJob({ name: job, version: '2', steps: [single(job, 'a')] });
        first = a.run(v1, { key: 'k', join: true }).catch((e: unknown) => e);
        await waitFor(async () => (await lockWaiters(url)) > 0, 'chunk x to wait at the gate');
        // The joiner's only step is done: it ends the run while x is in flight in the first worker.
        expect(await b.run(v2, { key: 'k', join: true, allowChangedCode: true })).toMatchObject({ status: 'succeeded', attempt: 1 });
        const finished = (await runRow(url, job, 'k')).finished_at;
        await gate.release();
        const left = await first;
        expect(left, String(left)).toMatchObject({ status: 'succeeded', attempt: 1, executed: 1 });
        // Nothing of the dropped step committed after the run succeeded.
        const after = await query(url, `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = $1 and c.done_at > $2`, [job, finished]);
        expect(after).toEqual([{ n: 0 }]);
        expect(await logged(job)).not.toContain('x:1');
      } finally {
        await gate.release();
        await Promise.allSettled([first]);
        await Promise.all([a.close(), b.close()]);
      }
      expect(await runRow(url, job, 'k')).toMatchObject({ status: 'succeeded' });
    });
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

  it('a run started over HTTP, stopped mid-run and resumed by a server on edited code: its view says why, resume answers 409, and {"allowChangedCode":true} resumes it', async () => {
    // Black-box round 13: every start, every 30 s sweep and every POST …/resume logged the refusal
    // with advice serve has no flag for; resume answered 200 and nothing ran; the run showed
    // `crashed` with no error. Only `idem run --allow-changed-code` got it out.
    const serverDir = await mkdtemp(path.join(REPO, '.idem', 'code-serve-'));
    const gate = await holdGate(url, 'code-serve');
    try {
      const gated = JOB_FILE.replace("name: 'code-check'", "name: 'code-serve'").replace(
        'async run({ db, run }, { key }) {',
        "async run({ db, run }, { key }) {\n      if (key === 'b') await sql`select 1 from gates where name = 'code-serve' for share`.execute(db);",
      );
      await writeFile(path.join(serverDir, 'code-serve.ts'), gated);
      const first = await startServe(url, [], {}, serverDir);
      const created = await api(first.base, 'POST', '/api/jobs/code-serve/runs', { key: 'dep-2', body: {} });
      expect(created.status).toBe(201);
      await waitFor(async () => (await lockWaiters(url)) > 0, 'chunk b to wait at the gate');
      first.proc.child.kill('SIGKILL');
      await first.proc.done;
      await gate.release();
      await waitFor(async () => (await sessions(url, 'idem')) + (await sessions(url, 'idem-lock')) === 0, "the killed server's sessions to end");
      const before = await runRow(url, 'code-serve', 'dep-2');
      expect(before).toMatchObject({ status: 'running', attempt: 1, code_changes: null });

      await appendFile(path.join(serverDir, 'code-serve.ts'), '// a change deployed mid-run\n');
      const srv = await startServe(url, [], { IDEM_SERVE_RESCAN_MS: '200' }, serverDir);
      try {
        const id = created.body.id as string;
        // Several sweeps pass: the refusal is logged once, with advice that fits the server.
        await new Promise((r) => setTimeout(r, 1_500));
        const refusals = lines(srv.proc.stderr()).filter((l) => l.includes('code changed') || l.includes('started under other code'));
        expect(refusals, srv.proc.stderr()).toHaveLength(1);
        expect(JSON.parse(refusals[0]!)).toMatchObject({ level: 40, runId: id, runKey: 'dep-2' });
        expect(refusals[0]).toContain(`POST /api/runs/${id}/resume`);
        expect(refusals[0]).toContain('{\\"allowChangedCode\\":true}');
        expect(refusals[0]).toContain('idem run code-serve --key dep-2 --allow-changed-code');

        // The run's view says why it does not resume, and how to go on.
        const view = await api(srv.base, 'GET', `/api/runs/${id}`);
        expect(view.body).toMatchObject({ state: 'crashed', codeChanged: { from: before.code_fingerprint, to: expect.stringMatching(/^sha256:[0-9a-f]{64}$/) } });
        expect(view.body.codeChanged.to).not.toBe(before.code_fingerprint);
        expect(view.body.codeChanged.detail).toContain('{"allowChangedCode":true}');
        const page = await api(srv.base, 'GET', `/runs/${id}`);
        expect(page.text).toContain('Code changed since the run started');
        expect(page.text).toContain('data-body="{&quot;allowChangedCode&quot;:true}"');

        // A resume without the body is refused, naming the change and the body to send.
        const refused = await api(srv.base, 'POST', `/api/runs/${id}/resume`);
        expect(refused.status, refused.text).toBe(409);
        expect(refused.headers.get('content-type')).toMatch(/^application\/problem\+json/);
        expect(refused.body).toMatchObject({ type: 'urn:idem:problem:idem.codeChanged', codeChanged: { from: before.code_fingerprint } });
        expect(refused.body.detail).toMatch(/^run "dep-2" of job "code-serve" was started under other code \(sha256:[0-9a-f]{12}…, now sha256:[0-9a-f]{12}…\); .*\{"allowChangedCode":true\}/);
        expect((await api(srv.base, 'POST', `/api/runs/${id}/resume`, { body: { allowChangedCode: false } })).status).toBe(409);
        // The body is checked strictly.
        for (const body of [{ allowChangedCode: 'yes' }, { allowChangedCode: true, force: true }, [true], 'true']) {
          const bad = await api(srv.base, 'POST', `/api/runs/${id}/resume`, { body });
          expect(bad.status, JSON.stringify(body)).toBe(400);
          expect(bad.body.type).toBe('urn:idem:problem:idem.invalidBody');
        }
        expect(await runRow(url, 'code-serve', 'dep-2')).toEqual(before);

        // Allowed: it resumes with the new code, recorded on the run as --allow-changed-code is.
        const allowed = await api(srv.base, 'POST', `/api/runs/${id}/resume`, { body: { allowChangedCode: true } });
        expect(allowed.status, allowed.text).toBe(200);
        const done = await api(srv.base, 'GET', `/api/runs/${id}?wait=30`);
        expect(done.body).toMatchObject({ state: 'succeeded', attempt: 2, codeChanged: null });
        const after = await runRow(url, 'code-serve', 'dep-2');
        expect(after.code_changes).toEqual([{ from: before.code_fingerprint, to: view.body.codeChanged.to, attempt: 2, at: expect.any(String) }]);
        expect(lines(srv.proc.stderr()).filter((l) => l.startsWith('{') && JSON.parse(l).level >= 50), srv.proc.stderr()).toEqual([]);
      } finally {
        srv.proc.child.kill('SIGTERM');
        await srv.proc.done;
      }
    } finally {
      await gate.release();
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
    // 'four' never plans (the run fails in 'two' first): dropped with nothing planned.
    await writeFile(path.join(dir, 'step-drop.ts'), stepsFile(['one', 'two', 'four']));
    await query(url, `insert into fail_chunks (chunk_key) values ('two-2')`);
    expect((await cli('run', 'step-drop', '--key', 'sd', '--no-progress')).code).toBe(1);
    await query(url, `delete from fail_chunks where chunk_key = 'two-2'`);
    await writeFile(path.join(dir, 'step-drop.ts'), stepsFile(['one', 'three']));
    const r = await cli('run', 'step-drop', '--key', 'sd', '--no-progress', '--allow-changed-code', '--json');
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout);
    expect(out.summary).toMatchObject({ steps: [{ name: 'one', chunks: 2 }, { name: 'three', chunks: 2 }], chunks: 4, dropped: [{ name: 'two', chunks: 2, done: 1 }, { name: 'four', chunks: 0, done: 0 }] });
    const human = await cli('run', 'step-drop', '--key', 'sd', '--no-progress');
    expect(human.code, human.stderr).toBe(0);
    expect(human.stdout + human.stderr).toContain('4 chunks in 2 steps; steps no longer in the job: two (1 of 2 planned chunks done), four (0 of 0 planned chunks done)');
    // idem status names the dropped steps as dropped, their planning over (no `~`, not "pending 0/0~"):
    // black-box round 18 (B10-4).
    const status = await cli('status', 'step-drop', '--key', 'sd');
    expect(status.code, status.stderr).toBe(0);
    const stepLines = status.stdout.split('\n').filter((l) => /^ {2}\d\. /.test(l)).map((l) => l.trim().replace(/ +/g, ' '));
    expect(stepLines).toEqual(['1. one done 2/2 chunks', '2. two dropped 1/2 chunks', '3. three done 2/2 chunks', '4. four dropped 0/0 chunks']);
    expect(status.stdout).toMatch(/^chunks +5\/6 done/m);
    const json = JSON.parse((await cli('status', 'step-drop', '--key', 'sd', '--json')).stdout);
    expect(json.steps.map((st: { name: string; status: string; plannedAll: boolean }) => [st.name, st.status, st.plannedAll])).toEqual([
      ['one', 'done', true],
      ['two', 'dropped', true],
      ['three', 'done', true],
      ['four', 'dropped', true],
    ]);
  });

  it('refuses a version that is neither a string nor a number at load time', () => {
    expect(() => defineJob({ name: 'bad-version', version: {} as never, steps: [{ name: 's', run() {} }] })).toThrow(/version must be a non-empty string/);
  });
});
