// No imports: the CLI's status command loads this at start-up, where job.ts (and croner) must not load.

/** A UTF-16 surrogate without its pair: not well-formed Unicode, and jsonb refuses it. */
export const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/**
 * The characters no text needs to show as nothing: the zero-width space, word joiner, byte order
 * mark, soft hyphen, and a joiner outside an emoji sequence such as 👩‍💻.
 */
export const ZERO_WIDTH = /[\u00ad\u200b\u2060\ufeff]|(?<![\p{Extended_Pictographic}\p{Emoji_Modifier}\ufe0f])\u200d|\u200d(?!\p{Extended_Pictographic})/u;

/**
 * Characters that show as nothing, or as a plain space, so that two keys differing by one look the
 * same: ZERO_WIDTH, and those ordinary in free text (the non-joiner, the left-to-right, right-to-left
 * and Arabic letter marks, the no-break and ideographic spaces). Shown as `\uHHHH` (keyLabel, and
 * text-table.ts's `visible` for every text output of a stored value).
 */
export const INVISIBLE = new RegExp(`[\\u00a0\\u061c\\u200c\\u200e\\u200f\\u3000]|${ZERO_WIDTH.source}`, 'u');

/**
 * A chunk key as a message quotes it: as is, or JSON-quoted when it holds a control character, a
 * lone surrogate or an invisible character (each of those as `\uHHHH`).
 */
export function keyLabel(key: string): string {
  if (!/[\u0000-\u001f]/.test(key) && !LONE_SURROGATE.test(key) && !INVISIBLE.test(key)) return key;
  return JSON.stringify(key).replace(new RegExp(INVISIBLE.source, 'gu'), (ch) => `\\u${ch.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

/**
 * A job name as a refusal quotes it: whole, or its first 40 characters (code points) when it is
 * longer than any job name can be (NAME: 100), as a long run key is cut (quoteKey).
 */
export function quotedName(name: string): string {
  const chars = [...name];
  return chars.length <= 100 ? `'${name}'` : `'${chars.slice(0, 40).join('')}…' (${chars.length} characters; a job name has at most 100)`;
}
