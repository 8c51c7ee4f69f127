import { setTimeout as delay } from 'node:timers/promises';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { answerWithin, sleep } from '../src/sleep.ts';

// Node's setTimeout takes at most 2^31 - 1 ms (24.8 days); a longer delay is set to 1 ms with a
// TimeoutOverflowWarning, which turned `--pause 3000000000` and `--max-rate 0.0000001` into no
// throttle at all. Real timers: the test sees what a run would.
const HUGE = 3_000_000_000;
const warnings: Error[] = [];
const onWarning = (w: Error) => void warnings.push(w);
beforeEach(() => {
  warnings.length = 0;
  process.on('warning', onWarning);
});
afterEach(() => {
  process.off('warning', onWarning);
});

describe('waits longer than a timer can hold', () => {
  it('sleep() of 3 000 000 000 ms is still asleep 50 ms later, and wakes when its signal aborts', async () => {
    const abort = new AbortController();
    const slept = sleep(HUGE, abort.signal).then(() => 'woke');
    expect(await Promise.race([slept, delay(50).then(() => 'asleep')])).toBe('asleep');
    abort.abort();
    expect(await slept).toBe('woke');
    expect(warnings.map((w) => w.name)).not.toContain('TimeoutOverflowWarning');
  });

  it('answerWithin() with a 3 000 000 000 ms bound is not late 50 ms later', async () => {
    let settle!: (v: string) => void;
    const answer = answerWithin(new Promise<string>((r) => (settle = r)), HUGE, () => new Error('late'));
    expect(await Promise.race([answer, delay(50).then(() => 'waiting')])).toBe('waiting');
    settle('answered');
    expect(await answer).toBe('answered');
    expect(warnings.map((w) => w.name)).not.toContain('TimeoutOverflowWarning');
  });
});
