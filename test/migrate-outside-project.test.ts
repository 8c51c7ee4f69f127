import { chmod, mkdir, mkdtemp, readdir, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { killLeftovers, lines, query, runCli, type CliResult } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

// Black-box tester B12: `idem migrate` in a folder with neither jobs/ nor migrations/ (a deploy
// started in the wrong directory, a project's subfolder) said "no migrations in migrations/",
// exit 0, having made an embedded server (.idem/, 40 MB) or, with DATABASE_URL, idem's schema in
// the app's database. It now refuses as status, list, run and the others do: exit 2, nothing written.

const testDb = useTestDatabase();
let tmp: string;
beforeAll(async () => {
  tmp = await mkdtemp(path.join(os.tmpdir(), 'idem-migrate-outside-'));
  await chmod(tmp, 0o755);
});
afterAll(async () => {
  await killLeftovers();
  if (tmp) await rm(tmp, { recursive: true, force: true });
});

const outcome = (r: CliResult) => ({ code: r.code, stdout: r.stdout, stderr: lines(r.stderr) });
const idemSchemas = async (url: string) => (await query<{ n: number }>(url, `select count(*)::int as n from pg_namespace where nspname = 'idem'`))[0]!.n;

describe('idem migrate outside a project', () => {
  it('neither jobs/ nor migrations/: exit 2 with the refusal the other commands give; no .idem/, no schema', async () => {
    const cwd = path.join(tmp, 'empty');
    await mkdir(cwd);
    const hint = `there is no jobs/ or migrations/ folder in ${cwd}; run idem in your project's root, pass --jobs-dir, or create one with idem init`;
    for (const args of [['migrate'], ['migrate', '--log-level', 'warn'], ['migrate', '--finalize', '0001_x']]) {
      // Without DATABASE_URL: no embedded server is made.
      expect(outcome(await runCli(args, { cwd })), args.join(' ')).toEqual({ code: 2, stdout: '', stderr: [`idem: error: ${hint}`] });
      // With it: idem's schema is not created in the app's database.
      expect(outcome(await runCli(args, { cwd, url: testDb.url })), `${args.join(' ')} (DATABASE_URL)`).toEqual({ code: 2, stdout: '', stderr: [`idem: error: ${hint}`] });
    }
    const json = await runCli(['migrate', '--json'], { cwd, url: testDb.url });
    expect({ code: json.code, stdout: JSON.parse(json.stdout) as unknown }).toEqual({
      code: 2,
      stdout: [{ status: 'error', job: null, runKey: null, exitCode: 2, code: 'idem.missingFolder', error: hint }],
    });
    expect(await readdir(cwd), 'something was created').toEqual([]);
    expect(await idemSchemas(testDb.url), 'idem schema created').toBe(0);
  });

  it("a project's subfolder: the same refusal", async () => {
    const root = path.join(tmp, 'project');
    const cwd = path.join(root, 'test');
    await mkdir(path.join(root, 'jobs'), { recursive: true });
    await mkdir(cwd);
    expect(outcome(await runCli(['migrate'], { cwd, url: testDb.url }))).toEqual({
      code: 2,
      stdout: '',
      stderr: [`idem: error: there is no jobs/ or migrations/ folder in ${cwd}; run idem in your project's root, pass --jobs-dir, or create one with idem init`],
    });
    expect(await readdir(cwd)).toEqual([]);
    expect(await idemSchemas(testDb.url)).toBe(0);
  });

  it('a project with jobs/ and no migrations/: "no migrations", exit 0, as before', async () => {
    const root = path.join(tmp, 'jobs-only');
    await mkdir(path.join(root, 'jobs'), { recursive: true });
    await writeFile(path.join(root, 'package.json'), '{"type":"module"}');
    await writeFile(path.join(root, 'jobs', 'a.js'), `export default { name: 'a', steps: [{ name: 's', run() {} }] };\n`);
    // A schema of its own: the tests above (in any order, shuffled under CI) check that none named idem appears.
    expect(outcome(await runCli(['--schema', 'idem_jobs_only', 'migrate', '--log-level', 'warn'], { cwd: root, url: testDb.url }))).toEqual({ code: 0, stdout: 'no migrations in migrations/\n', stderr: [] });
  });
});
