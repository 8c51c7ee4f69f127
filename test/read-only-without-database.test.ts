import { existsSync } from 'node:fs';
import { chmod, mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { killLeftovers, lines, runCli, type CliResult } from './support/cli.ts';

// Black-box tester: `idem status` and `idem list` run from the wrong directory, with no
// DATABASE_URL, ran initdb into ./.idem/pg (39 MB) to say "no runs yet (… check --schema)" or "no
// jobs or migrations found", exit 0; `idem status zzzz` set one up just to refuse the name. A
// command that only reads, or acts on runs that exist, makes no embedded server where .idem/ has
// none: it answers from nothing, and outside a project it says so, as `idem run` does.
// No DATABASE_URL anywhere here (runCli sets none): there is no database to ask, on purpose.

let tmp: string;
beforeAll(async () => {
  tmp = await mkdtemp(path.join(os.tmpdir(), 'idem-no-db-'));
  // Searchable by the postgres user, as a project's folder is: the embedded server could be made here.
  await chmod(tmp, 0o755);
});
afterAll(async () => {
  await killLeftovers();
  if (tmp) await rm(tmp, { recursive: true, force: true });
});

/** Exit code, stdout and stderr's lines, as one value to compare. */
const outcome = (r: CliResult) => ({ code: r.code, stdout: r.stdout, stderr: lines(r.stderr) });

/** A project with one JavaScript job, `slow`, and no .idem/ (never run). */
async function project(name: string): Promise<string> {
  const root = path.join(tmp, name);
  await mkdir(path.join(root, 'jobs'), { recursive: true });
  await writeFile(path.join(root, 'package.json'), '{"type":"module"}');
  await writeFile(path.join(root, 'jobs', 'slow.js'), `export default { name: 'slow', description: 'sleeps a while', steps: [{ name: 's', run() {} }] };\n`);
  return root;
}

describe('read-only and operator commands without DATABASE_URL and without an embedded server', () => {
  it('outside a project (no jobs/ nor migrations/): exit 2 with the hint `idem run` gives; nothing is created', async () => {
    const cwd = path.join(tmp, 'empty');
    await mkdir(cwd);
    const hint = `there is no jobs/ or migrations/ folder in ${cwd}; run idem in your project's root, pass --jobs-dir, or create one with idem init`;
    const cases: Array<[string[], string]> = [
      [['status'], hint],
      [['list'], hint],
      [['prune', '--older-than', '30d'], hint],
      [['status', 'zzzz'], `no job named 'zzzz': ${hint}`],
      [['status', 'zzzz', '--key', 'k'], `no job named 'zzzz': ${hint}`],
      [['pause', 'zzzz'], `no job named 'zzzz': ${hint}`],
      [['resume', 'zzzz'], `no job named 'zzzz': ${hint}`],
      [['cancel', 'zzzz'], `no job named 'zzzz': ${hint}`],
      [['reset', 'zzzz', '--key', 'k'], `no job named 'zzzz': ${hint}`],
    ];
    for (const [args, message] of cases) {
      const r = await runCli(args, { cwd });
      expect(outcome(r), args.join(' ')).toEqual({ code: 2, stdout: '', stderr: [`idem: error: ${message}`] });
    }
    // With --json the refusal is the error object on stdout too.
    const json = await runCli(['status', '--json'], { cwd });
    expect({ code: json.code, stdout: JSON.parse(json.stdout) as unknown, stderr: outcome(json).stderr }).toEqual({
      code: 2,
      stdout: { status: 'error', job: null, runKey: null, exitCode: 2, code: 'idem.missingFolder', error: hint },
      stderr: [`idem: error: ${hint}`],
    });
    // A folder given by flag to a command that does not read it (prune): named by its flag,
    // not "pass --jobs-dir" to someone who did (left from black-box round 16's review).
    const flagged: Array<[string[], string]> = [
      [['--jobs-dir', '/typo-jobs', 'prune', '--older-than', '30d'], `--jobs-dir /typo-jobs: no such folder (nor a migrations/ folder in ${cwd}); fix the path, or run idem in your project's root`],
      [['--migrations-dir', 'db/typo', 'prune', '--older-than', '30d'], `--migrations-dir db/typo: no such folder (nor a jobs/ folder in ${cwd}); fix the path, or run idem in your project's root`],
      [['--jobs-dir', 'a', '--migrations-dir', 'b', 'prune', '--older-than', '30d'], '--jobs-dir a and --migrations-dir b: no such folders; fix the paths'],
    ];
    // A name longer than a job name can be is cut in the refusal, as idem run cuts it.
    const long = 'j'.repeat(5000);
    flagged.push([['status', long], `no job named '${'j'.repeat(40)}…' (5000 characters; a job name has at most 100): ${hint}`]);
    for (const [args, message] of flagged) {
      const r = await runCli(args, { cwd });
      expect(outcome(r), args.join(' ')).toEqual({ code: 2, stdout: '', stderr: [`idem: error: ${message}`] });
    }
    expect(await readdir(cwd), 'something was created').toEqual([]);
  });

  it('in a project never run: status says no runs, list lists the jobs on disk, names and keys get the not-found refusal; no .idem/', async () => {
    const root = await project('never-run');
    const noRuns = 'no runs yet (no DATABASE_URL, and no embedded server under .idem/ yet: idem makes one at the first run or migrate)';
    expect(outcome(await runCli(['status'], { cwd: root }))).toEqual({ code: 0, stdout: `${noRuns}\n`, stderr: [] });
    expect(outcome(await runCli(['status', 'slow'], { cwd: root }))).toEqual({ code: 0, stdout: `${noRuns}\n`, stderr: [] });
    expect(outcome(await runCli(['status', '--json'], { cwd: root }))).toEqual({ code: 0, stdout: '[]\n', stderr: [] });
    expect(outcome(await runCli(['status', 'slow', '--key', 'k'], { cwd: root }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: job "slow" has no run with key "k"; see idem status slow for its runs`],
    });
    // An unknown name: the refusal a database without runs gives, from the files.
    expect(outcome(await runCli(['status', 'zzzz'], { cwd: root }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: no job named 'zzzz' in jobs/ or migrations/ (known: slow); check the name or --jobs-dir`],
    });
    expect(outcome(await runCli(['list'], { cwd: root }))).toEqual({ code: 0, stdout: 'job\tslow\tnever run\tsleeps a while\n', stderr: [] });
    const listed = await runCli(['list', '--json'], { cwd: root });
    expect({ code: listed.code, stderr: listed.stderr, items: JSON.parse(listed.stdout) }).toEqual({
      code: 0,
      stderr: '',
      items: [{ kind: 'job', name: 'slow', description: 'sleeps a while', state: 'never run', updatedAt: null }],
    });
    // The operator commands: the job has no run (as on a database without idem's schema), prune removes nothing.
    expect(outcome(await runCli(['pause', 'slow'], { cwd: root }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: job "slow" has no run to pause (none is running or pending or failed or interrupted); see idem status slow`],
    });
    expect(outcome(await runCli(['resume', 'slow'], { cwd: root }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: job "slow" has no run to resume (none is paused or running with a pause pending); see idem status slow`],
    });
    expect(outcome(await runCli(['cancel', 'slow', '--key', 'k'], { cwd: root }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: job "slow" has no run with key "k"; see idem status slow for its run keys`],
    });
    expect(outcome(await runCli(['reset', 'slow', '--key', 'k'], { cwd: root }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: job "slow" has no run with key "k"; see idem status slow for its run keys`],
    });
    expect(outcome(await runCli(['pause', 'zzzz'], { cwd: root }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: no job named 'zzzz' in jobs/ or migrations/ (known: slow); check the name or --jobs-dir`],
    });
    expect(outcome(await runCli(['prune', '--older-than', '30d'], { cwd: root }))).toEqual({
      code: 0,
      stdout: 'prune: removed 0 runs, 0 steps, 0 chunk markers, 0 effects older than 30d\n',
      stderr: [],
    });
    expect(existsSync(path.join(root, '.idem')), 'an embedded server was made').toBe(false);
  });

  it('a dry run in a project never run answers "new" from the files, making no embedded server (B12-5)', async () => {
    // Black-box round 19: `idem run <job> --dry-run` there initialised PostgreSQL under .idem/ (39 MB)
    // to say the run was new and "nothing was written".
    const root = await project('dry-run');
    expect(outcome(await runCli(['run', 'slow', '--dry-run', '--key', 'k1'], { cwd: root }))).toEqual({
      code: 0,
      stdout: 'dry run: job "slow" run key k1 is new; steps: s; nothing was written\n',
      stderr: [],
    });
    const json = await runCli(['run', 'slow', '--dry-run', '--json'], { cwd: root });
    expect(json.code, json.stderr).toBe(0);
    expect(JSON.parse(json.stdout)).toMatchObject({ status: 'dry-run', job: 'slow', runId: null, attempt: 0, summary: null, executed: 0, plan: { state: 'new', steps: [{ name: 's', chunked: false }] } });
    expect(JSON.parse(json.stdout).runKey).toMatch(/^sha256:/);
    // Params are still checked (the job has no validator: anything JSON goes), and a bad --key still refused.
    expect((await runCli(['run', 'slow', '--dry-run', '--key', ' k'], { cwd: root })).code).toBe(2);
    expect(existsSync(path.join(root, '.idem')), 'an embedded server was made').toBe(false);
  });

  it('idem list inside the jobs folder: the hint, and no jobs/.idem', async () => {
    const root = await project('inside-jobs');
    const cwd = path.join(root, 'jobs');
    expect(outcome(await runCli(['list'], { cwd }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: there is no jobs/ or migrations/ folder in ${cwd}; run idem in your project's root, pass --jobs-dir, or create one with idem init`],
    });
    expect((await readdir(cwd)).sort()).toEqual(['slow.js']);
  });
});
