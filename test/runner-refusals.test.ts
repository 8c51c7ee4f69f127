import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, finalizeMigration, finalizeRun, InterruptedError, Runner, UsageError, type Job } from '../src/index.ts';
import { FIXTURE_MIGRATIONS, killLeftovers, query, runCli } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * The library's entry points refuse what the CLI refuses, up front: a UsageError (exit 2) naming the
 * problem and the fix, and nothing written to the database (no row in idem.runs). Found by a
 * black-box tester using the packed package as a library (round 15, B2).
 */
const testDb = useTestDatabase({ runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});
afterAll(killLeftovers);

/** The error a promise rejects with (fails the test if it resolves). */
async function rejectionOf(p: Promise<unknown>): Promise<Error> {
  return p.then(
    (v) => {
      throw new Error(`expected a rejection, got ${JSON.stringify(v)}`);
    },
    (e: Error) => e,
  );
}

/** Runs rows of a job: none after a refusal. */
async function runsOf(job: string): Promise<number> {
  const [row] = await query<{ n: number }>(url, 'select count(*)::int as n from idem.runs where job = $1', [job]);
  return row!.n;
}

/** A job whose only step counts its executions in `calls`. */
function countingJob(name: string, calls: { n: number }): Job {
  return defineJob({ name, steps: [{ name: 's', run: () => void calls.n++ }] });
}

/** Asserts `err` is a UsageError with this code and message, exit code 2. */
function expectUsage(err: Error, code: string, message: string): void {
  expect(err).toBeInstanceOf(UsageError);
  expect((err as UsageError).code).toBe(code);
  expect(err.message).toBe(message);
  expect(exitCodeOf(err)).toBe(2);
}

describe('params a validator returns with a BigInt in them (B2 round 15)', () => {
  const bigintJob = (name: string) => defineJob({ name, params: (raw: any) => ({ id: BigInt(raw.id) }), steps: [{ name: 's', run: () => {} }] });
  const MESSAGE = (job: string) => `invalid params for job "${job}": params.id is a BigInt, which JSON cannot represent; have the params validator return it as a string (or a number within ±(2^53−1))`;

  it('Runner.run refuses them as invalid params, naming the path, and writes nothing', async () => {
    const err = await rejectionOf(runner.run(bigintJob('c'), { params: { id: '5' }, key: 'k' }));
    expectUsage(err, 'idem.invalidParams', MESSAGE('c'));
    const nested = defineJob({ name: 'c-nested', params: () => ({ ids: [1, 2n] }), steps: [{ name: 's', run: () => {} }] });
    const err2 = await rejectionOf(runner.run(nested, { key: 'k' }));
    expect(err2.message).toBe('invalid params for job "c-nested": params.ids[1] is a BigInt, which JSON cannot represent; have the params validator return it as a string (or a number within ±(2^53−1))');
    expect(await runsOf('c')).toBe(0);
    expect(await runsOf('c-nested')).toBe(0);
  });

  it('idem run refuses them with one line, exit 2', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'idem-bigint-'));
    try {
      writeFileSync(join(dir, 'bigint-cli.ts'), `export default { name: 'bigint-cli', params: (raw: any) => ({ id: BigInt(raw.id) }), steps: [{ name: 's', run: () => {} }] };\n`);
      const r = await runCli(['run', 'bigint-cli', '--param', 'id=5', '--jobs-dir', dir, '--migrations-dir', FIXTURE_MIGRATIONS], { url });
      expect(r.stderr).toBe(`idem: error: ${MESSAGE('bigint-cli')}\n`);
      expect(r.code).toBe(2);
      expect(await runsOf('bigint-cli')).toBe(0);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
