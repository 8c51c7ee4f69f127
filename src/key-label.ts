// No imports: the CLI's status command loads this at start-up, where job.ts (and croner) must not load.

/** A UTF-16 surrogate without its pair: not well-formed Unicode, and jsonb refuses it. */
export const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/**
 * Characters that show as nothing, or as a plain space, so that two keys differing by one look the
 * same: the zero-width ones (space, non-joiner, joiner outside an emoji sequence such as 👩‍💻, word
 * joiner, byte order mark, and the left-to-right, right-to-left and Arabic letter marks), the soft
 * hyphen and the non-ASCII spaces (no-break, ideographic). Shown as `\uHHHH` (keyLabel, and
 * text-table.ts's `visible` for every text output).
 */
export const INVISIBLE = /[\u00a0\u00ad\u061c\u200b\u200c\u200e\u200f\u2060\u3000\ufeff]|(?<![\p{Extended_Pictographic}\p{Emoji_Modifier}\ufe0f])\u200d|\u200d(?!\p{Extended_Pictographic})/u;

/**
 * A chunk key as a message quotes it: as is, or JSON-quoted when it holds a control character, a
 * lone surrogate or an invisible character (each of those as `\uHHHH`).
 */
export function keyLabel(key: string): string {
  if (!/[\u0000-\u001f]/.test(key) && !LONE_SURROGATE.test(key) && !INVISIBLE.test(key)) return key;
  return JSON.stringify(key).replace(new RegExp(INVISIBLE.source, 'gu'), (ch) => `\\u${ch.charCodeAt(0).toString(16).padStart(4, '0')}`);
}
