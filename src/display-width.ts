/**
 * How many terminal columns text takes: a CJK character or an emoji takes two, a combining mark
 * none. Tables (`idem status`, `idem list`) align by it and the progress line is cut by it, so a
 * wide run key or step name neither shifts the columns after it nor wraps the line the progress
 * display rewrites in place.
 *
 * The counting is string-width's (Unicode's East Asian Width, emoji sequences, grapheme clusters).
 * Loading it costs ~50 ms (it builds an `Intl.Segmenter` and Unicode property patterns), so it is
 * imported only when some text is not printable ASCII: an all-ASCII command never pays for it.
 */
type Width = (text: string) => number;

const PRINTABLE_ASCII = /^[\x20-\x7e]*$/;
const MARK = /^\p{M}$/u;

let exact: Width | undefined;
let segmenter: Intl.Segmenter | undefined;
let loading: Promise<void> | undefined;

/** Loads string-width (once); after it, {@link columns} and {@link graphemes} are exact. */
export function loadWidth(): Promise<void> {
  loading ??= import('string-width').then((m) => {
    exact = m.default;
    segmenter = new Intl.Segmenter();
  });
  return loading;
}

/** Loads string-width if any of `texts` needs it, so the output made of them is measured exactly. */
export async function prepareColumns(texts: string): Promise<void> {
  if (!PRINTABLE_ASCII.test(texts)) await loadWidth();
}

/**
 * Columns `text` takes: its length when it is printable ASCII; else string-width's count once
 * loaded. Until then: a combining mark none; the scripts before U+1100 (Latin, Greek, Cyrillic,
 * Hebrew, Arabic, Indic, Thai…) and the punctuation and box drawing of U+2000–U+2E7F (idem's own
 * `—`, `…`, `·`, `█`, `░`) one; anything else two, so CJK and emoji are right and the rest is
 * over-estimated: a cut falls early, never past the edge.
 */
export function columns(text: string): number {
  if (PRINTABLE_ASCII.test(text)) return text.length;
  if (exact) return exact(text);
  let n = 0;
  for (const ch of text) {
    const cp = ch.codePointAt(0)!;
    n += MARK.test(ch) ? 0 : cp < 0x1100 || (cp >= 0x2000 && cp <= 0x2e7f) ? 1 : 2;
  }
  return n;
}

/** `text` padded with spaces to `width` columns. */
export function padColumns(text: string, width: number): string {
  return text + ' '.repeat(Math.max(0, width - columns(text)));
}

/**
 * What a cut may not split: grapheme clusters once string-width is loaded (an emoji's ZWJ
 * sequence, a letter with its marks), code points before (never half a surrogate pair).
 */
export function graphemes(text: string): Iterable<string> {
  if (PRINTABLE_ASCII.test(text)) return text;
  if (segmenter) return Array.from(segmenter.segment(text), (s) => s.segment);
  return text;
}

/** The longest start of `text` that fits in `width` columns, cut between characters. */
export function fitColumns(text: string, width: number): string {
  let out = '';
  let used = 0;
  for (const g of graphemes(text)) {
    const w = columns(g);
    if (used + w > width) break;
    out += g;
    used += w;
  }
  return out;
}
