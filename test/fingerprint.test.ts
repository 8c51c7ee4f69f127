import { createHash } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { canonicalJson, fingerprint, lockKey } from '../src/fingerprint.ts';

const sha256 = (s: string) => createHash('sha256').update(s).digest('hex');

describe('canonicalJson', () => {
  it('serialises objects with keys sorted at every depth, whatever order they were written in', () => {
    const a = { b: 1, a: { d: [{ z: 1, y: { q: true, p: null } }], c: 'x' } };
    const b = { a: { c: 'x', d: [{ y: { p: null, q: true }, z: 1 }] }, b: 1 };
    expect(canonicalJson(a)).toBe('{"a":{"c":"x","d":[{"y":{"p":null,"q":true},"z":1}]},"b":1}');
    expect(canonicalJson(b)).toBe(canonicalJson(a));
    expect(fingerprint(b)).toBe(fingerprint(a));
  });

  it('sorts keys by code unit, so the order does not depend on the locale', () => {
    expect(canonicalJson({ b: 1, B: 2, a: 3, _: 4, '10': 5, '9': 6 })).toBe('{"10":5,"9":6,"B":2,"_":4,"a":3,"b":1}');
  });

  it('tells apart params that differ in a value, a type, or at depth', () => {
    const variants = [
      { day: '2026-11-30', n: 1 },
      { day: '2026-11-30', n: 2 },
      { day: '2026-11-30', n: '1' },
      { day: '2026-11-30', n: 1, extra: null },
      { day: '2026-11-30', n: [1] },
      { day: '2026-11-30', n: { v: 1 } },
      { day: '2026-11-30', n: { v: 2 } },
      { day: '2026-12-01', n: 1 },
      {},
    ];
    expect(new Set(variants.map(canonicalJson)).size).toBe(variants.length);
    expect(new Set(variants.map(fingerprint)).size).toBe(variants.length);
  });

  it('keeps array order: [1,2] and [2,1] are other params', () => {
    expect(canonicalJson([1, 2])).toBe('[1,2]');
    expect(fingerprint({ ids: [1, 2] })).not.toBe(fingerprint({ ids: [2, 1] }));
  });

  it('drops undefined members like JSON.stringify, and writes undefined array slots as null', () => {
    expect(canonicalJson({ a: 1, b: undefined, c: { d: undefined } })).toBe('{"a":1,"c":{}}');
    expect(fingerprint({ a: 1, b: undefined })).toBe(fingerprint({ a: 1 }));
    expect(canonicalJson([1, undefined, 3])).toBe('[1,null,3]');
    expect(canonicalJson([1, undefined, 3])).toBe(JSON.stringify([1, undefined, 3]));
  });

  it('matches JSON.stringify for scalars, and writes dates as ISO strings and bigints as strings', () => {
    for (const v of [null, true, false, 0, -1.5, 'x"y\\z', 'ünïcödé']) expect(canonicalJson(v)).toBe(JSON.stringify(v));
    expect(canonicalJson(new Date('2026-11-30T00:00:00Z'))).toBe('"2026-11-30T00:00:00.000Z"');
    expect(canonicalJson({ n: 12345678901234567890n })).toBe('{"n":"12345678901234567890"}');
  });

  it('refuses non-finite numbers instead of fingerprinting them as null', () => {
    expect(() => canonicalJson({ n: Number.NaN })).toThrow(TypeError);
    expect(() => fingerprint({ n: Number.POSITIVE_INFINITY })).toThrow(/non-finite/);
  });
});

describe('fingerprint', () => {
  it('is sha256:<64 hex> of the canonical JSON', () => {
    const params = { to: '2026-11-30', from: '2026-11-01' };
    const fp = fingerprint(params);
    expect(fp).toMatch(/^sha256:[0-9a-f]{64}$/);
    expect(fp).toBe(`sha256:${sha256('{"from":"2026-11-01","to":"2026-11-30"}')}`);
  });

  it('is stable across releases: the fingerprint of {} is the SHA-256 of "{}"', () => {
    // Stored run keys default to this value; changing the algorithm would turn every rerun of an
    // existing run into "same key, other params".
    expect(fingerprint({})).toBe('sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a');
  });
});

describe('lockKey', () => {
  it('is the same for the same name and differs between names', () => {
    expect(lockKey('idem:job:nightly')).toBe(lockKey('idem:job:nightly'));
    const keys = new Set(Array.from({ length: 500 }, (_, i) => lockKey(`idem:job:j${i}`)));
    expect(keys.size).toBe(500);
  });

  it('is a signed 64-bit integer in decimal, negative for about half the names', () => {
    const keys = Array.from({ length: 200 }, (_, i) => lockKey(`name-${i}`));
    for (const k of keys) {
      expect(k).toMatch(/^-?[1-9]\d*$|^0$/);
      const n = BigInt(k);
      expect(n >= -(2n ** 63n) && n <= 2n ** 63n - 1n).toBe(true);
      expect(BigInt.asIntN(64, n)).toBe(n);
    }
    const negative = keys.filter((k) => k.startsWith('-')).length;
    expect(negative).toBeGreaterThan(50);
    expect(negative).toBeLessThan(150);
  });

  it('is stable across releases (two versions running during a deploy must contend for the same lock)', () => {
    expect(lockKey('idem:job:counted')).toBe('-2213248363047529635');
    const digest = createHash('sha256').update('idem:migrate').digest();
    expect(lockKey('idem:migrate')).toBe(digest.readBigInt64BE(0).toString());
  });
});
