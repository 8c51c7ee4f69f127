/** Waits `ms`, or less if `signal` aborts first (resolves, never rejects: the caller checks why). */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve();
    const done = () => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
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
      clearTimeout(timer);
      fn();
    };
    const timer = setTimeout(() => setImmediate(() => settle(() => reject(late()))), ms);
    answer.then(
      (value) => settle(() => resolve(value)),
      (err: unknown) => settle(() => reject(err)),
    );
  });
}
