/**
 * The longest delay a Node timer holds (2^31 - 1 ms, 24.8 days): a longer one is set to 1 ms with a
 * TimeoutOverflowWarning, so `--pause 3000000000` would not pause at all. Longer waits are taken in
 * steps of at most this.
 */
export const MAX_TIMER_MS = 2 ** 31 - 1;

/**
 * Calls `fn` once `ms` have passed (any duration, in steps of at most {@link MAX_TIMER_MS}); the
 * returned function cancels it. `ms` that is not a number >= 0 counts as 0, as setTimeout's does.
 */
export function after(ms: number, fn: () => void): () => void {
  let timer: NodeJS.Timeout;
  const until = performance.now() + (ms > 0 ? ms : 0);
  const arm = () => {
    const left = until - performance.now();
    timer = left > MAX_TIMER_MS ? setTimeout(arm, MAX_TIMER_MS) : setTimeout(fn, Math.max(0, left));
  };
  arm();
  return () => clearTimeout(timer);
}

/** Waits `ms` (any duration), or less if `signal` aborts first (resolves, never rejects: the caller checks why). */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const done = () => {
      cancel();
      signal?.removeEventListener('abort', done);
      resolve();
    };
    const cancel = after(ms, done);
    signal?.addEventListener('abort', done, { once: true });
  });
}

/**
 * `answer`, or a rejection with `late()` when it has not settled `ms` after the call. The deadline
 * is judged after one more round of I/O, not when its timer runs: a process that could not run
 * meanwhile (SIGSTOP, a long GC pause, code blocking the event loop) runs its timers before it reads
 * its sockets on waking, and the answer may be there, unread.
 */
export function answerWithin<T>(answer: Promise<T>, ms: number, late: () => unknown): Promise<T> {
  return new Promise<T>((resolve, reject) => {
    let settled = false;
    const settle = (fn: () => void) => {
      if (settled) return;
      settled = true;
      cancel();
      fn();
    };
    const cancel = after(ms, () => setImmediate(() => settle(() => reject(late()))));
    answer.then(
      (value) => settle(() => resolve(value)),
      (err: unknown) => settle(() => reject(err)),
    );
  });
}
