import { InvalidArgumentError } from 'commander';
import { UsageError } from './errors.ts';
import { PLAIN_DECIMAL, UNSAFE_NUMBER_RULE, unsafeNumberPath } from './unsafe-number.ts';

const PLAIN_INTEGER = /^\d+$/;

/** Commander argument parsers and the params parser: pure, so every command refuses bad flags the same way. */
export function positiveInt(max: number) {
  return (value: string): number => {
    const n = PLAIN_INTEGER.test(value) ? Number(value) : Number.NaN;
    if (!Number.isInteger(n) || n < 1 || n > max) throw new InvalidArgumentError(`expected an integer from 1 to ${max}, got "${value}"`);
    return n;
  };
}

/** A run key given to find a run (status, pause, reset, finalize): never empty, as no run's is. */
export function existingKey(value: string): string {
  if (value === '') throw new InvalidArgumentError('expected a run key, got an empty one (idem status <job> lists the runs and their keys)');
  return value;
}

export function positiveNumber(value: string): number {
  const n = PLAIN_DECIMAL.test(value) ? Number(value) : Number.NaN;
  if (!Number.isFinite(n) || n <= 0) throw new InvalidArgumentError(`expected a plain decimal number > 0 (such as 5 or 0.5), got "${value}"`);
  return n;
}

export function nonNegativeNumber(value: string): number {
  const n = PLAIN_DECIMAL.test(value) ? Number(value) : Number.NaN;
  if (!Number.isFinite(n) || n < 0) throw new InvalidArgumentError(`expected a plain decimal number >= 0 (such as 250 or 0.5), got "${value}"`);
  return n;
}

export function waitSeconds(value: string | boolean): number | boolean {
  if (typeof value === 'boolean') return value;
  const n = PLAIN_DECIMAL.test(value) ? Number(value) : Number.NaN;
  if (!Number.isFinite(n) || n < 0) throw new InvalidArgumentError(`expected a plain decimal number of seconds >= 0 (such as 30 or 0.5), got "${value}"`);
  return n;
}

export { checkRunKey, MAX_RUN_KEY_CHARS } from './run-key.ts';

export function collectParam(value: string, previous: Record<string, unknown>): Record<string, unknown> {
  const eq = value.indexOf('=');
  if (eq < 1) throw new InvalidArgumentError(`expected key=value, got "${value}"`);
  const raw = value.slice(eq + 1);
  let parsed: unknown = raw;
  try {
    parsed = JSON.parse(raw);
  } catch {
    // Not JSON: the value is the plain string.
  }
  return { ...previous, [value.slice(0, eq)]: parsed };
}

export function parseParams(json: string | undefined, pairs: Record<string, unknown>): Record<string, unknown> {
  let base: unknown = {};
  if (json !== undefined) {
    try {
      base = JSON.parse(json);
    } catch (err) {
      throw new UsageError('invalidParams', `--params is not valid JSON (${(err as Error).message}); pass an object such as --params '{"day":"2026-11-30"}'`);
    }
    if (!base || typeof base !== 'object' || Array.isArray(base)) {
      throw new UsageError('invalidParams', `--params must be a JSON object, got ${json}; pass e.g. --params '{"day":"2026-11-30"}'`);
    }
  }
  const duplicate = json === undefined ? null : duplicateKey(json);
  if (duplicate !== null) throw new UsageError('invalidParams', `--params has the key ${JSON.stringify(duplicate)} twice; give each key once (JSON.parse would keep the last silently, and the params make the run's key)`);
  // Before anything else reads them: a rounded number would be another run's key.
  const inJson = unsafeNumberPath(base);
  if (inJson !== null) throw new UsageError('invalidParams', `--params: ${inJson} ${UNSAFE_NUMBER_RULE}`);
  for (const [name, value] of Object.entries(pairs)) {
    const at = unsafeNumberPath(value, name);
    if (at !== null) throw new UsageError('invalidParams', `--param ${name}: ${at} ${UNSAFE_NUMBER_RULE}`);
  }
  return { ...(base as Record<string, unknown>), ...pairs };
}

/**
 * The first key that an object of `text` (valid JSON) holds twice, as a dotted path from the top
 * (`filter.b.c`, array items as `[0]`), or null. JSON.parse keeps the last of them silently.
 */
export function duplicateKey(text: string): string | null {
  let i = 0;
  const ws = () => {
    while (i < text.length && ' \t\n\r'.includes(text[i]!)) i++;
  };
  const str = (): string => {
    const start = i++;
    while (text[i] !== '"') i += text[i] === '\\' ? 2 : 1;
    i++;
    return JSON.parse(text.slice(start, i)) as string;
  };
  const join = (path: string, key: string) => (path === '' ? key : `${path}.${key}`);
  const value = (path: string): string | null => {
    ws();
    const ch = text[i];
    if (ch === '{') {
      i++;
      const seen = new Set<string>();
      ws();
      if (text[i] === '}') {
        i++;
        return null;
      }
      for (;;) {
        ws();
        const key = str();
        if (seen.has(key)) return join(path, key);
        seen.add(key);
        ws();
        i++; // ':'
        const inner = value(join(path, key));
        if (inner !== null) return inner;
        ws();
        if (text[i++] === '}') return null;
      }
    }
    if (ch === '[') {
      i++;
      ws();
      if (text[i] === ']') {
        i++;
        return null;
      }
      for (let n = 0; ; n++) {
        const inner = value(`${path}[${n}]`);
        if (inner !== null) return inner;
        ws();
        if (text[i++] === ']') return null;
      }
    }
    if (ch === '"') {
      str();
      return null;
    }
    while (i < text.length && !',]} \t\n\r'.includes(text[i]!)) i++;
    return null;
  };
  try {
    return value('');
  } catch {
    return null; // nested deeper than the stack: JSON.parse took it, and so does this check
  }
}
