import { describe, expect, it } from 'vitest';
import { editDistance, quoteChoices, suggestSimilar } from '../src/suggest.ts';

describe('suggestSimilar', () => {
  it('finds a typo, a swapped pair and a forgotten word', () => {
    const jobs = ['reservation-daily-totals', 'seed-demo-data', 'expire-idempotency-keys', 'send-reservation-reminders'];
    expect(suggestSimilar('seed-demo-dat', jobs)).toEqual(['seed-demo-data']);
    expect(suggestSimilar('seed-deom-data', jobs)).toEqual(['seed-demo-data']);
    // The example: 6 edits, more than commander's cap of 3, but most of the name is there.
    expect(suggestSimilar('reservation-totals', jobs)).toEqual(['reservation-daily-totals']);
  });

  it('keeps only the closest names, sorted, and nothing when none is close', () => {
    expect(suggestSimilar('job-b', ['job-a', 'job-c', 'job-ab'])).toEqual(['job-a', 'job-ab', 'job-c']);
    expect(suggestSimilar('zzzzzzzz', ['counted', 'ranged'])).toEqual([]);
    expect(suggestSimilar('counted', ['counted'])).toEqual([]);
  });

  it('counts edits as optimal string alignment (a swap is one edit)', () => {
    expect(editDistance('abcd', 'abdc')).toBe(1);
    expect(editDistance('kitten', 'sitting')).toBe(3);
    expect(editDistance('', 'abc')).toBe(3);
  });

  it('words the choices', () => {
    expect(quoteChoices(['a'])).toBe("'a'");
    expect(quoteChoices(['a', 'b'])).toBe("'a' or 'b'");
    expect(quoteChoices(['a', 'b', 'c'])).toBe("'a', 'b' or 'c'");
  });
});
