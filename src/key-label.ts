// No imports: the CLI's status command loads this at start-up, where job.ts (and croner) must not load.

/** A UTF-16 surrogate without its pair: not well-formed Unicode, and jsonb refuses it. */
export const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/** A chunk key as a message quotes it: as is, or JSON-quoted when it holds a control character or a lone surrogate. */
export function keyLabel(key: string): string {
  return /[\u0000-\u001f]/.test(key) || LONE_SURROGATE.test(key) ? JSON.stringify(key) : key;
}
