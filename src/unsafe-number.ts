/**
 * A number as the command line takes it: plain decimal digits, with one optional fraction part
 * (`250`, `0.5`). Number() alone would take `''` as 0, `0x3E8` as 1000, `' 5'` as 5 and `1e3` as
 * 1000: a typo would become a setting. Here, a leaf module, so the health checks (which the job
 * API loads) share it with the CLI's parsers without loading commander.
 */
export const PLAIN_DECIMAL = /^\d+(\.\d+)?$/;

/**
 * Where parsed params hold a number JavaScript cannot hold exactly: JSON.parse rounds an integer
 * beyond ±(2^53−1) to a neighbour (9007199254740993 becomes 9007199254740992), so two different
 * inputs would become one run key and the job would act on another row than asked. Node 20's
 * JSON.parse cannot show a number's source text, so any number past that magnitude counts: once
 * parsed, a rounded integer and an exact one cannot be told apart.
 */
export const UNSAFE_NUMBER_RULE = 'is a number beyond the safe integers, ±(2^53−1), which would be rounded (two different values would become one run); pass it as a string';

/** The path (`ids[1]`, `filter.min`) of the first number beyond the safe integers in `value`, or null. */
export function unsafeNumberPath(value: unknown, root = ''): string | null {
  // A stack, not recursion: params nested 30 000 deep must get their own refusal, not a stack overflow.
  const stack: Array<[unknown, string]> = [[value, root]];
  while (stack.length > 0) {
    const [v, path] = stack.pop()!;
    // Non-finite numbers (1e400) are validateParams' to refuse: it says what they became.
    if (typeof v === 'number' && Number.isFinite(v) && Math.abs(v) > Number.MAX_SAFE_INTEGER) return path === '' ? '(the value)' : path;
    if (v === null || typeof v !== 'object') continue;
    const entries = Object.entries(v as Record<string, unknown>);
    // Reversed onto the stack, so the first offending value in document order is the one named.
    for (let i = entries.length - 1; i >= 0; i--) {
      const [k, child] = entries[i]!;
      const sub = Array.isArray(v) ? `${path}[${k}]` : path === '' ? k : `${path}.${k}`;
      stack.push([child, sub.length > 80 ? `${sub.slice(0, 77)}...` : sub]);
    }
  }
  return null;
}
