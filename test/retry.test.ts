import { describe, expect, it } from 'vitest';
import { backoffDelay, DEFAULT_BACKOFF, isConnectionTrouble, isRetryable, noConnectionFree, SqlState } from '../src/retry.ts';

const ceiling = (attempt: number, base = 100, max = 30_000, factor = 2) => Math.min(max, base * factor ** (attempt - 1));

describe('backoffDelay', () => {
  it('stays in [0, min(max, base * factor^(attempt-1))) and is a whole number of ms, for every attempt', () => {
    for (let attempt = 1; attempt <= 25; attempt++) {
      const top = ceiling(attempt);
      for (let i = 0; i < 400; i++) {
        const d = backoffDelay(attempt);
        expect(Number.isInteger(d)).toBe(true);
        expect(d).toBeGreaterThanOrEqual(0);
        expect(d).toBeLessThan(top);
      }
    }
  });

  it('uses the defaults documented on DEFAULT_BACKOFF', () => {
    expect(DEFAULT_BACKOFF).toEqual({ base: 100, max: 30_000, factor: 2, attempts: 5 });
    expect(Object.isFrozen(DEFAULT_BACKOFF)).toBe(true);
    const justBelowOne = () => 1 - Number.EPSILON;
    expect(backoffDelay(1, {}, justBelowOne)).toBe(99);
    expect(backoffDelay(4, {}, justBelowOne)).toBe(799);
    expect(backoffDelay(30, {}, justBelowOne)).toBe(29_999);
  });

  it('honours base, factor and the max cap', () => {
    const opts = { base: 10, factor: 3, max: 500 };
    const top = (a: number) => backoffDelay(a, opts, () => 1 - Number.EPSILON) + 1;
    expect([1, 2, 3, 4, 5, 6].map(top)).toEqual([10, 30, 90, 270, 500, 500]);
  });

  it('spreads delays over the whole range (full jitter), not around one value', () => {
    const top = ceiling(5); // 1600 ms
    const samples = Array.from({ length: 4000 }, () => backoffDelay(5));
    expect(Math.min(...samples)).toBeLessThan(top * 0.05);
    expect(Math.max(...samples)).toBeGreaterThan(top * 0.95);
    // Every tenth of the range gets a fair share (expected 400 each).
    const buckets = new Array<number>(10).fill(0);
    for (const d of samples) buckets[Math.floor((d / top) * 10)]!++;
    for (const n of buckets) expect(n).toBeGreaterThan(250);
    expect(new Set(samples).size).toBeGreaterThan(800);
  });

  it('with a pinned random is a pure function: floor(random * ceiling)', () => {
    expect(backoffDelay(1, {}, () => 0)).toBe(0);
    expect(backoffDelay(3, {}, () => 0.5)).toBe(200);
    expect(backoffDelay(3, {}, () => 0.25)).toBe(100);
    expect(backoffDelay(3, {}, () => 0.25)).toBe(backoffDelay(3, {}, () => 0.25));
  });

  it('refuses an attempt that is not an integer >= 1', () => {
    for (const bad of [0, -1, 1.5, Number.NaN, Number.POSITIVE_INFINITY]) {
      expect(() => backoffDelay(bad)).toThrow(TypeError);
    }
    expect(() => backoffDelay(0)).toThrow(/attempt must be an integer >= 1, got 0/);
  });
});

const pgError = (code: string, message = `error ${code}`) => Object.assign(new Error(message), { code });

describe('isRetryable', () => {
  it.each([
    ['40001 serialization_failure', SqlState.SerializationFailure],
    ['40P01 deadlock_detected', SqlState.DeadlockDetected],
    ['57P01 admin_shutdown', SqlState.AdminShutdown],
    ['25P03 idle_in_transaction_session_timeout', SqlState.IdleInTransactionSessionTimeout],
    ['57P05 idle_session_timeout', SqlState.IdleSessionTimeout],
    ['08006 connection_failure', '08006'],
    ['08000 connection_exception', '08000'],
    ['53300 too_many_connections', SqlState.TooManyConnections],
    ['55P03 lock_not_available', SqlState.LockNotAvailable],
  ])('is true for %s', (_, code) => {
    expect(isRetryable(pgError(code))).toBe(true);
  });

  it('is true for socket errors such as ECONNRESET and a terminated connection', () => {
    expect(isRetryable(pgError('ECONNRESET', 'read ECONNRESET'))).toBe(true);
    expect(isRetryable(pgError('EPIPE'))).toBe(true);
    expect(isRetryable(new Error('Connection terminated unexpectedly'))).toBe(true);
  });

  it('looks through wrapped errors (cause chains)', () => {
    expect(isRetryable(new Error('chunk failed', { cause: pgError('40001') }))).toBe(true);
    expect(isRetryable(new Error('outer', { cause: new Error('middle', { cause: pgError('40P01') }) }))).toBe(true);
    expect(isRetryable(new Error('outer', { cause: new Error('middle', { cause: pgError('23505') }) }))).toBe(false);
  });

  it.each([
    ['23505 unique_violation', pgError('23505')],
    ['42601 syntax_error', pgError('42601')],
    ['42P01 undefined_table', pgError('42P01')],
    // statement_timeout cancels the statement, not the session: the same chunk would hit it again.
    ['57014 query_canceled', pgError('57014')],
    ['a plain Error', new Error('boom')],
    ['a string', 'boom'],
    ['null', null],
    ['undefined', undefined],
    ['a numeric code', { code: 40001 }],
  ])('is false for %s', (_, err) => {
    expect(isRetryable(err)).toBe(false);
  });
});

describe('no connection free, said by a pool or a pooler without a SQLSTATE of its own', () => {
  it("pg-pool's timeout and PgBouncer's max_client_conn refusal are connection trouble, never a run's failure", () => {
    // Black-box round 12 (B2-1, B2-2): behind PgBouncer in session mode with a pool smaller than
    // a run needs, pg-pool's "timeout exceeded when trying to connect" failed the run in step
    // "(runner)", and max_client_conn's 08P01 was not seen as "no connection free", so no slot
    // left for the others. Both errors exactly as pg-pool and pg (for PgBouncer's ErrorResponse) make them.
    const poolTimeout = new Error('timeout exceeded when trying to connect');
    const maxClientConn = Object.assign(new Error('no more connections allowed (max_client_conn)'), { code: '08P01', severity: 'FATAL' });
    for (const err of [poolTimeout, maxClientConn]) {
      expect(noConnectionFree(err), err.message).toBe(true);
      expect(isConnectionTrouble(err), err.message).toBe(true);
      expect(isRetryable(err), err.message).toBe(true);
    }
    // Another 08P01 (a protocol violation) is connection trouble, not "no connection free".
    expect(noConnectionFree(Object.assign(new Error('invalid frontend message type 0'), { code: '08P01' }))).toBe(false);
  });
});
