import { createRequire } from 'node:module';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import { describe, expect, it } from 'vitest';
import { REPO } from './support/cli.ts';
import {
  BusyError,
  DatabaseUnavailableError,
  ExitCode,
  exitCodeOf,
  FencedError,
  IdemError,
  InterruptedError,
  LockLostError,
  MAX_MESSAGE_CHARS,
  messageOf,
  ParamsMismatchError,
  RunFailedError,
  UsageError,
} from '../src/errors.ts';
import { defineJob, validateParams, type Job, type StandardSchemaV1 } from '../src/job.ts';

describe('exit codes', () => {
  it('are the documented numbers', () => {
    expect(ExitCode).toEqual({ Ok: 0, Failed: 1, Usage: 2, ParamsMismatch: 65, LockLost: 69, Busy: 75, Sighup: 129, Sigint: 130, Sigterm: 143 });
  });

  it.each([
    ['UsageError', new UsageError('unknownJob', 'x'), 2, 'idem.unknownJob'],
    ['DatabaseUnavailableError', new DatabaseUnavailableError('x'), 2, 'idem.databaseUnavailable'],
    ['RunFailedError', new RunFailedError('x'), 1, 'idem.runFailed'],
    ['ParamsMismatchError', new ParamsMismatchError('x'), 65, 'idem.paramsMismatch'],
    ['LockLostError', new LockLostError('x'), 69, 'idem.lockLost'],
    ['FencedError', new FencedError('x'), 69, 'idem.fenced'],
    ['BusyError', new BusyError('x'), 75, 'idem.busy'],
    ['InterruptedError(SIGINT)', new InterruptedError('SIGINT'), 130, 'idem.interrupted'],
    ['InterruptedError(SIGTERM)', new InterruptedError('SIGTERM'), 143, 'idem.interrupted'],
  ])('%s maps to exit code %i with a namespaced code', (name, err, exit, code) => {
    expect(exitCodeOf(err)).toBe(exit);
    expect(err.exitCode).toBe(exit);
    expect(err.code).toBe(code);
    expect(err).toBeInstanceOf(IdemError);
    expect(err).toBeInstanceOf(Error);
    expect(err.name).toBe(name.replace(/\(.*\)/, ''));
  });

  it('maps anything that is not an IdemError (a bug, a driver error, a thrown string) to 1', () => {
    expect(exitCodeOf(new Error('boom'))).toBe(1);
    expect(exitCodeOf(Object.assign(new Error('dup'), { code: '23505', exitCode: 2 }))).toBe(1);
    expect(exitCodeOf('boom')).toBe(1);
    expect(exitCodeOf(undefined)).toBe(1);
  });

  it("are recognised by the other module copy: require('idem') and import('idem') in one process", async () => {
    // A CommonJS host requires idem (dist/cjs/, the job API) and imports it (dist/index.js, the
    // runner): two copies of errors.ts, two sets of classes. The runner's BusyError went through
    // the required copy's exitCodeOf as 1, and instanceof the required class was false.
    const required = createRequire(import.meta.url)(path.join(REPO, 'dist', 'cjs', 'job-api.js')) as typeof import('../src/errors.ts');
    const imported = (await import(pathToFileURL(path.join(REPO, 'dist', 'index.js')).href)) as typeof import('../src/errors.ts');
    expect(required.IdemError).not.toBe(imported.IdemError);
    for (const [made, other] of [[imported, required], [required, imported]] as const) {
      const mismatch = new made.ParamsMismatchError('x');
      const busy = new made.BusyError('b');
      expect([other.exitCodeOf(mismatch), other.exitCodeOf(busy), other.exitCodeOf(new made.InterruptedError('SIGINT'))]).toEqual([65, 75, 130]);
      expect(mismatch instanceof other.ParamsMismatchError && mismatch instanceof other.IdemError && busy instanceof other.BusyError).toBe(true);
      // Each class still tells its own: a BusyError is no ParamsMismatchError, whichever copy asks.
      expect(busy instanceof other.ParamsMismatchError || busy instanceof made.ParamsMismatchError).toBe(false);
      expect(new Error('x') instanceof other.IdemError).toBe(false);
    }
  });

  it('every error class a run can throw is exported by the package, PauseWithdrawnError too', async () => {
    const api = await import('../src/index.ts');
    const errors = await import('../src/errors.ts');
    for (const [name, value] of Object.entries(errors)) {
      if (typeof value === 'function' && value.prototype instanceof Error) expect(api, name).toHaveProperty(name, value);
    }
  });

  it('keep the cause they were given', () => {
    const cause = new Error('ECONNREFUSED');
    expect(new DatabaseUnavailableError('cannot reach', { cause }).cause).toBe(cause);
    expect(new UsageError('x', 'y', { cause }).cause).toBe(cause);
  });

  it('an interruption says it is resumable', () => {
    expect(new InterruptedError('SIGTERM').message).toMatch(/SIGTERM.*run the same command again to resume/);
    expect(new InterruptedError('SIGINT').signal).toBe('SIGINT');
  });

  it('messageOf keeps the whole message of anything thrown, bounded by code points', () => {
    expect(messageOf(new Error('first line\nsecond-line-detail'))).toBe('first line\nsecond-line-detail');
    expect(messageOf('plain\nstring')).toBe('plain\nstring');
    expect(messageOf(42)).toBe('42');
    const long = messageOf(new Error('🙂'.repeat(MAX_MESSAGE_CHARS + 10)));
    expect(Array.from(long)).toHaveLength(MAX_MESSAGE_CHARS);
    expect(long).toBe(`${'🙂'.repeat(MAX_MESSAGE_CHARS - 1)}…`);
  });
});

/** A minimal Standard Schema v1: an object with a required string `day` and an optional positive int `limits.max`. */
function tinySchema(opts: { async?: boolean } = {}): StandardSchemaV1<unknown, { day: string; max: number }> {
  const validate = (value: unknown) => {
    const v = (value ?? {}) as Record<string, any>;
    const issues: Array<{ message: string; path?: Array<PropertyKey | { key: PropertyKey }> }> = [];
    if (typeof v.day !== 'string') issues.push({ message: 'expected a string', path: ['day'] });
    const max = v.limits?.max ?? 10;
    if (!Number.isInteger(max) || max < 1) issues.push({ message: 'expected a positive integer', path: ['limits', { key: 'max' }] });
    if (Object.keys(v).some((k) => k !== 'day' && k !== 'limits')) issues.push({ message: 'unknown key' });
    const result = issues.length ? { issues } : { value: { day: v.day as string, max } };
    return opts.async ? Promise.resolve(result) : result;
  };
  return { '~standard': { version: 1, vendor: 'test', validate } };
}

const job = (params?: Job['params']): Job =>
  defineJob<any>({ name: 'nightly', ...(params ? { params } : {}), steps: [{ name: 's', run() {} }] });

/** The UsageError validateParams rejects with (fails the test if it resolves). */
async function rejection(p: Promise<unknown>): Promise<UsageError> {
  const err = await p.then(
    (v) => {
      throw new Error(`expected a rejection, got ${JSON.stringify(v)}`);
    },
    (e: unknown) => e,
  );
  expect(err).toBeInstanceOf(UsageError);
  return err as UsageError;
}

describe('validateParams', () => {
  it('a job without params given a deeply nested body: the depth refusal, short (not a stack overflow, nor the whole body quoted)', async () => {
    // `{"tag": [[[…30 000…]]]}` to a job without params: the message stringified the whole body,
    // RangeError "Maximum call stack size exceeded" (HTTP 500, CLI exit 1).
    const deep = JSON.parse(`{"tag":${'['.repeat(30_000)}${']'.repeat(30_000)}}`);
    const err = await rejection(validateParams(job(), deep));
    expect(err.message).toMatch(/^invalid params for job "nightly": params\.tag(\[0\])+\[\.\.\. nests deeper than 100 levels$/);
    const wide = await rejection(validateParams(job(), { tag: 'x'.repeat(60_000) }));
    expect(wide.message.length).toBeLessThan(400);
    expect(wide.message).toMatch(/^job "nightly" takes no params, got \{"tag":"xxx.*…; drop --params\/--param$/);
  });

  it('a Standard Schema: returns its output value (defaults applied)', async () => {
    await expect(validateParams(job(tinySchema()), { day: '2026-11-30' })).resolves.toEqual({ day: '2026-11-30', max: 10 });
    await expect(validateParams(job(tinySchema({ async: true })), { day: 'd', limits: { max: 3 } })).resolves.toEqual({ day: 'd', max: 3 });
  });

  it('a Standard Schema: every issue is named with its path, in one UsageError (exit 2)', async () => {
    const err = await rejection(validateParams(job(tinySchema()), { limits: { max: 0 }, extra: 1 }));
    expect(err.code).toBe('idem.invalidParams');
    expect(exitCodeOf(err)).toBe(2);
    expect(err.message).toBe('invalid params for job "nightly": day: expected a string; limits.max: expected a positive integer; unknown key');
  });

  it('a Standard Schema with async validation reports issues the same way', async () => {
    const err = await rejection(validateParams(job(tinySchema({ async: true })), {}));
    expect(err.message).toBe('invalid params for job "nightly": day: expected a string');
  });

  it('a Standard Schema gets {} when no params are given', async () => {
    const err = await rejection(validateParams(job(tinySchema()), undefined));
    expect(err.message).toContain('day: expected a string');
  });

  it('a plain function: returns what it returns', async () => {
    const fn = (raw: unknown) => ({ n: Number((raw as { n?: unknown }).n ?? 1) * 2 });
    await expect(validateParams(job(fn), { n: 4 })).resolves.toEqual({ n: 8 });
    await expect(validateParams(job(fn), undefined)).resolves.toEqual({ n: 2 });
  });

  it('a plain function that throws: UsageError carrying its message and the original as cause', async () => {
    const thrown = new Error('day must be YYYY-MM-DD, got "yesterday"');
    const err = await rejection(
      validateParams(
        job(() => {
          throw thrown;
        }),
        { day: 'yesterday' },
      ),
    );
    expect(err.message).toBe('invalid params for job "nightly": day must be YYYY-MM-DD, got "yesterday"');
    expect(err.cause).toBe(thrown);
    expect(exitCodeOf(err)).toBe(2);
  });

  it('a job without a params schema accepts nothing or {} and refuses any param, naming the fix', async () => {
    await expect(validateParams(job(), undefined)).resolves.toEqual({});
    await expect(validateParams(job(), {})).resolves.toEqual({});
    const err = await rejection(validateParams(job(), { day: '2026-11-30' }));
    expect(err.code).toBe('idem.invalidParams');
    expect(err.message).toBe('job "nightly" takes no params, got {"day":"2026-11-30"}; drop --params/--param');
    await rejection(validateParams(job(), []));
    await rejection(validateParams(job(), 'x'));
  });
});

describe('defineJob', () => {
  it('returns the definition checked and frozen', () => {
    const run = () => {};
    const j = defineJob({ name: 'nightly-rollup.v2', description: 'd', steps: [{ name: 'a', run }, { name: 'b', chunks: () => ({ chunks: [], next: null }), run }] });
    expect(j.name).toBe('nightly-rollup.v2');
    expect(j.steps.map((s) => s.name)).toEqual(['a', 'b']);
    expect(Object.isFrozen(j)).toBe(true);
    expect(Object.isFrozen(j.steps)).toBe(true);
  });

  it('rejects a bad definition listing every problem at once', () => {
    const run = () => {};
    let err: unknown;
    try {
      defineJob({
        name: 'bad name!',
        params: 42 as never,
        steps: [
          { name: 'a', run },
          { name: 'a', run: 'not a function' as never },
          { name: 'c', chunks: 5 as never, run },
          { name: '', run },
        ],
      });
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(UsageError);
    const e = err as UsageError;
    expect(e.code).toBe('idem.invalidJob');
    expect(exitCodeOf(e)).toBe(2);
    expect(e.message).toMatch(/^defineJob\(\): invalid job definition: /);
    expect(e.message).toContain('name must match');
    expect(e.message).toContain('"bad name!"');
    expect(e.message).toContain('params must be a Standard Schema');
    expect(e.message).toContain('step name "a" is used twice');
    expect(e.message).toContain('steps[1].run must be a function');
    expect(e.message).toContain('steps[2].chunks must be a chunk source function');
    expect(e.message).toContain('steps[3].name must match');
    // Not only the regex: what a name may be, in words.
    expect(e.message).toContain('name must match /^[a-z0-9][a-z0-9._:-]{0,99}$/i (letters, digits and . _ : -, starting with a letter or digit, at most 100 characters, got "bad name!")');
    expect(e.message.split('; ')).toHaveLength(6);
  });

  it('rejects a job without steps and a value that is not a definition', () => {
    expect(() => defineJob({ name: 'empty', steps: [] })).toThrow(/steps must be a non-empty array/);
    expect(() => defineJob({ name: 'nosteps' } as never)).toThrow(/steps must be a non-empty array/);
    expect(() => defineJob(null as never)).toThrow(UsageError);
    expect(() => defineJob(null as never)).toThrow(/does not export a job definition/);
  });
});
