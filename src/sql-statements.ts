/**
 * The statements of a SQL text as PostgreSQL splits a simple-protocol message: at each `;` that is
 * not inside a string (`'…'`, `E'…'`), a quoted name (`"…"`), a dollar-quoted body (`$$…$$`,
 * `$fn$…$fn$`), a comment (`-- …` to the end of the line, nested `/* … *\/`) or the `BEGIN ATOMIC …
 * END` body of a CREATE FUNCTION or PROCEDURE. Blank statements are left out. `backslashes`: read
 * `\` as an escape in every string, as a session with `standard_conforming_strings = off` does
 * (in `E'…'` strings it always is). No imports: the chunk path's own helper.
 */
export function splitStatements(text: string, backslashes = false): string[] {
  if (!text.includes(';')) return [text];
  const out: string[] = [];
  const n = text.length;
  let start = 0;
  let i = 0;
  /** Inside BEGIN ATOMIC … END: 1 for the body, one more per CASE … END in it. */
  let atomic = 0;
  let firstWord = '';
  let previousWord = '';
  while (i < n) {
    const c = text[i]!;
    if (c === "'") {
      const escapes = backslashes || (i > 0 && (text[i - 1] === 'e' || text[i - 1] === 'E') && !isWordChar(text[i - 2]));
      i++;
      while (i < n) {
        if (escapes && text[i] === '\\') i += 2;
        else if (text[i] === "'" && text[i + 1] === "'") i += 2;
        else if (text[i] === "'") break;
        else i++;
      }
      i++;
      previousWord = '';
    } else if (c === '"') {
      i++;
      while (i < n) {
        if (text[i] === '"' && text[i + 1] === '"') i += 2;
        else if (text[i] === '"') break;
        else i++;
      }
      i++;
      previousWord = '';
    } else if (c === '-' && text[i + 1] === '-') {
      i = lineEnd(text, i);
    } else if (c === '/' && text[i + 1] === '*') {
      i = commentEnd(text, i);
    } else if (c === '$' && !isWordChar(text[i - 1])) {
      const tag = DOLLAR_TAG.exec(text.slice(i, i + 130))?.[0];
      if (tag) {
        const end = text.indexOf(tag, i + tag.length);
        i = end < 0 ? n : end + tag.length;
      } else i++;
      previousWord = '';
    } else if (isWordStart(c)) {
      let j = i + 1;
      while (j < n && isWordChar(text[j])) j++;
      const word = text.slice(i, j).toLowerCase();
      firstWord ||= word;
      if (word === 'atomic' && previousWord === 'begin' && firstWord === 'create') atomic++;
      else if (atomic > 0 && word === 'case') atomic++;
      else if (atomic > 0 && word === 'end') atomic--;
      previousWord = word;
      i = j;
    } else {
      if (c === ';' && atomic === 0) {
        out.push(text.slice(start, i));
        start = i + 1;
        firstWord = '';
      }
      if (!isSpace(c)) previousWord = '';
      i++;
    }
  }
  out.push(text.slice(start));
  return out.filter((s) => /\S/.test(s));
}

/**
 * The first `max` tokens of a statement, past whitespace and comments as PostgreSQL skips them:
 * words lower-cased, any other character as itself (so `set local.x` reads `set`, `local`, `.`).
 */
export function leadingTokens(statement: string, max = 3): string[] {
  const tokens: string[] = [];
  const n = statement.length;
  let i = 0;
  while (i < n && tokens.length < max) {
    const c = statement[i]!;
    if (isSpace(c)) i++;
    else if (c === '-' && statement[i + 1] === '-') i = lineEnd(statement, i);
    else if (c === '/' && statement[i + 1] === '*') i = commentEnd(statement, i);
    else if (isWordStart(c)) {
      let j = i + 1;
      while (j < n && isWordChar(statement[j])) j++;
      tokens.push(statement.slice(i, j).toLowerCase());
      i = j;
    } else {
      tokens.push(c);
      i++;
    }
  }
  return tokens;
}

/** A dollar-quote's tag: `$$`, or `$name$` (a name may hold any letter, non-ASCII ones too, but no `$`). */
const DOLLAR_TAG = /^\$(?:[A-Za-z_\u0080-\uffff][A-Za-z0-9_\u0080-\uffff]*)?\$/;

/** PostgreSQL's identifier characters: ASCII letters, digits, `_`, `$`, and every character beyond ASCII. */
const isWordStart = (ch: string) => (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || ch === '_' || ch >= '\u0080';
const isWordChar = (ch: string | undefined) => ch !== undefined && (isWordStart(ch) || (ch >= '0' && ch <= '9') || ch === '$');
/** PostgreSQL's whitespace: space, tab, newline, carriage return, form feed, vertical tab. */
const isSpace = (ch: string) => ch === ' ' || ch === '\t' || ch === '\n' || ch === '\r' || ch === '\f' || ch === '\v';

/** Past a `--` comment: it ends at a newline or a carriage return. */
function lineEnd(text: string, i: number): number {
  while (i < text.length && text[i] !== '\n' && text[i] !== '\r') i++;
  return i;
}

/** Past a `/* … *\/` comment, which nests. */
function commentEnd(text: string, i: number): number {
  let depth = 1;
  i += 2;
  while (i < text.length && depth > 0) {
    if (text[i] === '/' && text[i + 1] === '*') {
      depth++;
      i += 2;
    } else if (text[i] === '*' && text[i + 1] === '/') {
      depth--;
      i += 2;
    } else i++;
  }
  return i;
}

/**
 * A text's one statement, without a `;` (and comments) after it, as SQL copied from a console ends;
 * null when the text holds more than one statement, or none.
 */
export function soleStatement(text: string): string | null {
  const statements = splitStatements(text).filter((statement) => leadingTokens(statement, 1).length > 0);
  return statements.length === 1 ? statements[0]! : null;
}
