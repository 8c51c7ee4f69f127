/**
 * The statements of a SQL text as PostgreSQL splits a simple-protocol message: at each `;` that is
 * not inside a string (`'…'`, `E'…'`), a quoted name (`"…"`), a dollar-quoted body (`$$…$$`,
 * `$fn$…$fn$`), a comment (`-- …`, nested `/* … *\/`) or a `BEGIN ATOMIC … END` function body.
 * Blank statements are left out. No imports: the chunk path's own helper.
 */
export function splitStatements(text: string): string[] {
  if (!text.includes(';')) return [text];
  const out: string[] = [];
  const n = text.length;
  let start = 0;
  let i = 0;
  /** Inside BEGIN ATOMIC … END: 1 for the body, one more per CASE … END in it. */
  let atomic = 0;
  let previousWord = '';
  const wordChar = (ch: string | undefined) => ch !== undefined && /[\w$]/.test(ch);
  while (i < n) {
    const c = text[i]!;
    if (c === "'") {
      const backslashes = i > 0 && (text[i - 1] === 'e' || text[i - 1] === 'E') && !wordChar(text[i - 2]);
      i++;
      while (i < n) {
        if (backslashes && text[i] === '\\') i += 2;
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
      while (i < n && text[i] !== '\n') i++;
    } else if (c === '/' && text[i + 1] === '*') {
      let depth = 1;
      i += 2;
      while (i < n && depth > 0) {
        if (text[i] === '/' && text[i + 1] === '*') {
          depth++;
          i += 2;
        } else if (text[i] === '*' && text[i + 1] === '/') {
          depth--;
          i += 2;
        } else i++;
      }
    } else if (c === '$' && !wordChar(text[i - 1])) {
      const tag = /^\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$/.exec(text.slice(i, i + 66))?.[0];
      if (tag) {
        const end = text.indexOf(tag, i + tag.length);
        i = end < 0 ? n : end + tag.length;
      } else i++;
      previousWord = '';
    } else if (/[A-Za-z_]/.test(c)) {
      let j = i + 1;
      while (j < n && wordChar(text[j])) j++;
      const word = text.slice(i, j).toLowerCase();
      if (word === 'atomic' && previousWord === 'begin') atomic++;
      else if (atomic > 0 && word === 'case') atomic++;
      else if (atomic > 0 && word === 'end') atomic--;
      previousWord = word;
      i = j;
    } else {
      if (c === ';' && atomic === 0) {
        out.push(text.slice(start, i));
        start = i + 1;
      }
      if (!/\s/.test(c)) previousWord = '';
      i++;
    }
  }
  out.push(text.slice(start));
  return out.filter((s) => /\S/.test(s));
}
