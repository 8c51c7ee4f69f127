import { UsageError } from './errors.ts';

/**
 * "Did you mean …?" for a mistyped name, the way commander suggests a mistyped command: the
 * optimal-string-alignment edit distance (Levenshtein plus swapped neighbours), keeping only the
 * candidates at the best distance. Commander caps the distance at 3 because option names are
 * short; job names are long and a forgotten word (`reservation-totals` for
 * `reservation-daily-totals`) is 6 edits, so the cap here is relative: more than half of the
 * longer name must survive. commander does not export its helper (package `exports`), hence these
 * few lines.
 *
 * @example
 * suggestSimilar('countd', ['counted', 'ranged']); // ['counted']
 */
export function suggestSimilar(word: string, candidates: Iterable<string>, max = 3): string[] {
  let best = Infinity;
  let similar: string[] = [];
  for (const candidate of new Set(candidates)) {
    if (candidate.length <= 1 || candidate === word) continue;
    const distance = editDistance(word, candidate);
    const length = Math.max(word.length, candidate.length);
    if ((length - distance) / length <= 0.5) continue;
    if (distance < best) {
      best = distance;
      similar = [candidate];
    } else if (distance === best) {
      similar.push(candidate);
    }
  }
  return similar.sort().slice(0, max);
}

/**
 * `unknown key "schedual" (did you mean "schedule"?)` for each own key of `value` not in `known`,
 * led by `where`: what a job definition, its nested option objects and the chunk sources' options
 * say of a key they do not know (a typo would otherwise do nothing, silently). `aliases` names the
 * known key meant by a name that is not similar to it (`url` for `connectionString`).
 */
export function unknownKeys(value: object, known: readonly string[], where: string, aliases: Readonly<Record<string, string>> = {}): string[] {
  return Object.keys(value)
    .filter((k) => !known.includes(k))
    .map((k) => {
      // Another library's name for an option (`databaseUrl` for `connectionString`) is nothing like
      // ours letter by letter: `aliases` maps it.
      const similar = Object.hasOwn(aliases, k) ? [aliases[k]!] : suggestSimilar(k, known);
      return `${where}unknown key ${JSON.stringify(k)} (${didYouMean(similar) ?? `known: ${known.join(', ')}`})`;
    });
}

/** `did you mean "a" or "b"?` for the names suggestSimilar found; undefined for none. */
export function didYouMean(similar: readonly string[]): string | undefined {
  return similar.length > 0 ? `did you mean ${similar.map((n) => JSON.stringify(n)).join(' or ')}?` : undefined;
}

/** `'a'`, `'a' or 'b'`, `'a', 'b' or 'c'`. */
export function quoteChoices(names: readonly string[]): string {
  const q = names.map((n) => `'${n}'`);
  return q.length <= 1 ? (q[0] ?? '') : `${q.slice(0, -1).join(', ')} or ${q.at(-1)}`;
}

/** Optimal string alignment distance: no substring is edited twice. */
export function editDistance(a: string, b: string): number {
  const d: number[][] = Array.from({ length: a.length + 1 }, (_, i) => [i]);
  for (let j = 0; j <= b.length; j++) d[0]![j] = j;
  for (let i = 1; i <= a.length; i++) {
    for (let j = 1; j <= b.length; j++) {
      const cost = a[i - 1] === b[j - 1] ? 0 : 1;
      let v = Math.min(d[i - 1]![j]! + 1, d[i]![j - 1]! + 1, d[i - 1]![j - 1]! + cost);
      if (i > 1 && j > 1 && a[i - 1] === b[j - 2] && a[i - 2] === b[j - 1]) v = Math.min(v, d[i - 2]![j - 2]! + 1);
      d[i]![j] = v;
    }
  }
  return d[a.length]![b.length]!;
}

/**
 * Refuses what is not an options object (an array, a string, nothing) given where one is expected,
 * in one line with an example: `keyList([1, 2, 3])` listed `unknown key "0"` once per element.
 */
export function refuseNonOptions(fn: string, value: unknown, example: string): void {
  if (value !== null && typeof value === 'object' && !Array.isArray(value)) return;
  const got = Array.isArray(value) ? 'an array' : value === null ? 'null' : value === undefined ? 'undefined' : `a ${typeof value}`;
  throw new UsageError('invalidJob', `${fn} takes an options object, such as ${example} (got ${got})`);
}
