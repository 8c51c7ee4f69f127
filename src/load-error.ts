import { readFile } from 'node:fs/promises';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { inspect } from 'node:util';
import { codeOf, IdemError } from './errors.ts';

/**
 * idem's own sources: a frame here is never the line the user has to fix. Built, this module is
 * one of dist/chunks/, and the CLI's frames are in dist/ itself.
 */
const OWN_SOURCES = ((dir) => (path.basename(dir) === 'chunks' ? path.dirname(dir) : dir))(path.dirname(fileURLToPath(import.meta.url))) + path.sep;

/** ES-module TypeScript compiled by idem (compile-typescript.ts): a frame here is esbuild's runtime, which has no source line. */
const COMPILED_COPIES = `${path.sep}.idem${path.sep}cache${path.sep}`;

/** Where a job file failed: 1-based line and column, as editors count them, and that line's text. */
export interface SourceLocation {
  readonly file: string;
  readonly line: number;
  readonly column: number;
  readonly lineText: string;
}

/** Why a job or migration file could not be imported, in words a user can act on. */
export interface LoadFailure {
  /** What went wrong, e.g. `syntax error: Expected "}" but found "run"`. */
  readonly cause: string;
  /** What to do about it. */
  readonly fix: string;
  /** Where, when it can be known. */
  readonly location?: SourceLocation;
}

/**
 * Turns whatever `import()` of a job file threw into cause, fix and location. The raw errors hide
 * the useful part: tsx's TransformError leads with "Transform failed with 1 error:", Node's
 * SyntaxError for a .js file carries no position at all, and a missing import names a resolved
 * path, not the line that asked for it. Runs only on the failure path, so it may re-read and
 * re-parse the file.
 */
export async function explainLoadError(file: string, err: unknown): Promise<LoadFailure> {
  if (!(err instanceof Error)) {
    const shown = typeof err === 'string' ? JSON.stringify(err) : inspect(err, { breakLength: Infinity, depth: 2 });
    return { cause: `it threw ${shown} while loading (not an Error, so it has no line)`, fix: 'fix the file' };
  }
  const code = codeOf(err);
  if (code === 'ERR_MODULE_NOT_FOUND') return missingImport(err.message);
  const esbuild = await esbuildError(file, err);
  // A CommonJS TypeScript file is compiled to CommonJS (tsx), which has no top-level await.
  if (esbuild && /^Top-level await is currently not supported with the "cjs" output format/.test(esbuild.text)) {
    const commonJs = await notAModulePackage(file, 'top-level await needs an ES module,');
    if (commonJs) return { ...commonJs, ...spread(esbuild.location) };
  }
  // CommonJS (a project without "type": "module"): require() throws MODULE_NOT_FOUND, with the
  // importing file first in its require stack.
  if (code === 'MODULE_NOT_FOUND') {
    const missing = await missingRequire(file, err);
    if (missing) return missing;
  }
  // Node 20 says "Cannot require() ES Module … in a cycle"; other versions and paths word it otherwise.
  const esmAsCommonJs =
    code === 'ERR_REQUIRE_CYCLE_MODULE' || code === 'ERR_REQUIRE_ESM' || code === 'ERR_REQUIRE_ASYNC_MODULE' || /Cannot use import statement outside a module|Unexpected token 'export'/.test(err.message);
  if (esmAsCommonJs) {
    const commonJs = await notAModulePackage(file);
    if (commonJs) return commonJs;
  }
  if (err.name === 'SyntaxError' || err.name === 'TransformError' || esbuild) {
    const syntax = await findSyntaxError(esbuild?.location?.file ?? file);
    if (syntax) return syntax;
  }
  // Not a syntax error, but what bundling found (an import of a name the file does not export):
  // esbuild's own words, where it found it.
  if (esbuild) {
    const fix = /^No matching export in /.test(esbuild.text) ? 'export it from there, or fix the import' : 'fix the file';
    return { cause: esbuild.text, fix, ...spread(esbuild.location) };
  }
  // esbuild's stand-in for require() in an ES module it compiled (an ES module has no require).
  const dynamicRequire = /^Dynamic require of "(.+)" is not supported$/.exec(firstLine(err.message));
  if (dynamicRequire) {
    return { cause: `require(${JSON.stringify(dynamicRequire[1])}) is not available in an ES module`, fix: 'use import instead, or make the file CommonJS (rename it to .cts)', ...spread(await thrownAt(err.stack)) };
  }
  const linked = await linkErrorLocation(err.stack);
  if (linked) return { cause: firstLine(err.message), fix: 'fix the file', location: linked };
  // idem's own refusal at load time (defineJob with a bad definition) already says what is wrong.
  // By shape as well as class: a CommonJS job file's defineJob() throws the CommonJS copy's errors.
  if (err instanceof IdemError || isIdemShaped(err)) return { cause: firstLine(err.message), fix: 'fix the file', ...spread(await thrownAt(err.stack)) };
  return { cause: `it threw while loading: ${err.name}: ${firstLine(err.message)}`, fix: 'fix the file', ...spread(await thrownAt(err.stack)) };
}

/** `file:line:column: cause; fix`, then the offending line with a caret under the column. */
export function formatLoadFailure(what: 'jobs' | 'migrations', file: string, f: LoadFailure): string {
  const loc = f.location;
  const where = !loc ? '' : loc.file === file ? `:${loc.line}:${loc.column}` : `: at ${displayPath(loc.file)}:${loc.line}:${loc.column}`;
  const head = `cannot load ${what} file ${displayPath(file)}${where}: ${f.cause}; ${f.fix}`;
  if (!loc) return head;
  const gutter = String(loc.line);
  // Keep tabs under tabs so the caret lines up with the column in any terminal.
  const pad = loc.lineText.slice(0, loc.column - 1).replace(/[^\t]/g, ' ');
  return `${head}\n    ${gutter} | ${loc.lineText}\n    ${' '.repeat(gutter.length)} | ${pad}^`;
}

/** Relative to the working directory when inside it (as the user typed it), else absolute. */
export function displayPath(file: string): string {
  const rel = path.relative(process.cwd(), file);
  return rel && !rel.startsWith('..') && !path.isAbsolute(rel) ? rel : file;
}

function isIdemShaped(err: Error): boolean {
  const e = err as { code?: unknown; exitCode?: unknown };
  return typeof e.code === 'string' && e.code.startsWith('idem.') && typeof e.exitCode === 'number';
}

function firstLine(s: string): string {
  return s.split('\n').find((l) => l.trim() !== '')?.trim() ?? s;
}

function spread(location: SourceLocation | undefined): { location?: SourceLocation } {
  return location ? { location } : {};
}

async function sourceLines(file: string): Promise<string[] | undefined> {
  try {
    return (await readFile(file, 'utf8')).split(/\r?\n/);
  } catch {
    return undefined;
  }
}

async function at(file: string, line: number, column: number): Promise<SourceLocation | undefined> {
  const text = (await sourceLines(file))?.[line - 1];
  return text === undefined ? undefined : { file, line, column, lineText: text };
}

/**
 * esbuild's 0-based column, which counts UTF-8 bytes, as the 1-based column an editor shows (and
 * the caret's padding counts): UTF-16 units of the line before it. 'Größe' put it 2 past the error.
 */
function editorColumn(lineText: string, byteColumn: number): number {
  return Buffer.from(lineText, 'utf8').subarray(0, byteColumn).toString('utf8').length + 1;
}

/**
 * The first error of an esbuild failure, its text and where. tsx's TransformError keeps it only in
 * its message ("Transform failed with 1 error:\n/path/file.ts:3:22: ERROR: …", the column 0-based),
 * as compile-typescript.ts words its own; esbuild's own failure has `errors`. The file may be a
 * helper the job imports. Undefined for any other error.
 */
async function esbuildError(file: string, err: Error): Promise<{ text: string; location?: SourceLocation } | undefined> {
  type Message = { text: string; location: { file: string; line: number; column: number } | null };
  const own = (err as { errors?: Message[] }).errors?.[0];
  let where: { file: string; line: number; column: number } | undefined;
  let text: string;
  if (own && typeof own.text === 'string') {
    text = own.text;
    if (own.location) where = { ...own.location, file: path.resolve(path.dirname(file), own.location.file) };
  } else {
    if (err.name !== 'TransformError') return undefined;
    const m = /^(\/.+?|[A-Za-z]:\\.+?):(\d+):(\d+): ERROR: (.*)$/m.exec(err.message);
    if (!m) return undefined;
    text = m[4]!;
    where = { file: m[1]!, line: Number(m[2]), column: Number(m[3]) };
  }
  if (!where) return { text };
  // tsx names a .cts or .mts file .ts to esbuild: the job file itself.
  const named = where.file.replace(/\.[cm]?[jt]s$/, '') === file.replace(/\.[cm]?[jt]s$/, '') ? file : where.file;
  const located = await at(named, where.line, where.column + 1);
  return { text, ...spread(located && { ...located, column: editorColumn(located.lineText, where.column) }) };
}

/**
 * Re-parses the file with esbuild (what tsx compiles with) to get the first syntax error's
 * position: the same answer for .ts and .js files. Undefined when the file parses: the
 * SyntaxError came from running it (JSON.parse, a missing named export).
 */
async function findSyntaxError(file: string): Promise<LoadFailure | undefined> {
  const source = await readFile(file, 'utf8').catch(() => undefined);
  if (source === undefined) return undefined;
  const { transform } = await import('esbuild');
  const loader = /\.[cm]?ts$/.test(file) ? 'ts' : 'js';
  try {
    await transform(source, { loader, format: 'esm', sourcefile: file, logLevel: 'silent' });
    return undefined;
  } catch (e) {
    const first = (e as { errors?: Array<{ text: string; location: { line: number; column: number; lineText: string } | null }> }).errors?.[0];
    if (!first) return undefined;
    const loc = first.location;
    // esbuild's columns are 0-based.
    return {
      cause: `syntax error: ${first.text}`,
      fix: 'fix the file',
      ...(loc ? { location: { file, line: loc.line, column: editorColumn(loc.lineText, loc.column), lineText: loc.lineText } } : {}),
    };
  }
}

/** "Cannot find package 'x' imported from /a/b.ts" / "Cannot find module '/a/c.ts' imported from /a/b.ts". */
async function missingImport(message: string): Promise<LoadFailure> {
  const m = /Cannot find (package|module) '([^']+)' imported from (.+)$/m.exec(message);
  if (!m) return { cause: firstLine(message), fix: 'fix the import' };
  const [, kind, target, from] = m as unknown as [string, string, string, string];
  const importer = from.startsWith('file:') ? fileURLToPath(from) : from;
  const lines = (await sourceLines(importer)) ?? [];
  const importerDir = path.dirname(importer);
  // The specifier as written: the package name itself, or whichever relative one resolves to the target.
  const matches = (spec: string) =>
    kind === 'package' ? spec === target || spec.startsWith(`${target}/`) : path.resolve(importerDir, spec) === target || (spec.startsWith('.') && target.startsWith(path.resolve(importerDir, spec)));
  for (let i = 0; i < lines.length; i++) {
    for (const s of lines[i]!.matchAll(/(?:\bfrom|\bimport|\brequire\s*\()\s*\(?\s*(['"])([^'"]+)\1/g)) {
      const spec = s[2]!;
      if (!matches(spec)) continue;
      const location = { file: importer, line: i + 1, column: s.index + s[0].indexOf(s[1]!) + 1, lineText: lines[i]! };
      return kind === 'package'
        ? { cause: `cannot find package '${target}'`, fix: `install it (npm install ${packageName(target)}) or fix the import`, location }
        : { cause: `cannot find module '${spec}' (${target})`, fix: 'fix the import path', location };
    }
  }
  return kind === 'package'
    ? { cause: `cannot find package '${target}' (imported from ${displayPath(importer)})`, fix: `install it (npm install ${packageName(target)}) or fix the import` }
    : { cause: `cannot find module ${target} (imported from ${displayPath(importer)})`, fix: 'fix the import path' };
}

/**
 * "Cannot find module 'x'\nRequire stack:\n- /app/jobs/a.js\n- …": the same answer as for an ES
 * module's missing import. Undefined when the importer is not the user's (a package that lacks one
 * of its own dependencies): the generic message says more then.
 */
async function missingRequire(file: string, err: Error): Promise<LoadFailure | undefined> {
  const spec = /^Cannot find module '([^']+)'/.exec(err.message)?.[1];
  if (!spec) return undefined;
  const stack = (err as { requireStack?: unknown }).requireStack;
  const importer = Array.isArray(stack) && typeof stack[0] === 'string' ? stack[0] : file;
  if (importer.includes(`${path.sep}node_modules${path.sep}`) || importer.startsWith(OWN_SOURCES)) return undefined;
  const bare = !spec.startsWith('.') && !path.isAbsolute(spec);
  const cause = bare ? `cannot find package '${spec}'` : `cannot find module '${spec}'`;
  const fix = bare ? `install it (npm install ${packageName(spec)}) or fix the import` : 'fix the import path';
  const lines = (await sourceLines(importer)) ?? [];
  for (let i = 0; i < lines.length; i++) {
    for (const s of lines[i]!.matchAll(/(?:\bfrom|\bimport|\brequire\s*\()\s*\(?\s*(['"])([^'"]+)\1/g)) {
      if (s[2] !== spec) continue;
      return { cause, fix, location: { file: importer, line: i + 1, column: s.index + s[0].indexOf(s[1]!) + 1, lineText: lines[i]! } };
    }
  }
  return importer === file ? { cause, fix } : { cause: `${cause} (required from ${displayPath(importer)})`, fix };
}

/** `@scope/pkg/sub` → `@scope/pkg`; `pkg/sub` → `pkg`. */
function packageName(specifier: string): string {
  const parts = specifier.split('/');
  return specifier.startsWith('@') ? parts.slice(0, 2).join('/') : parts[0]!;
}

/**
 * A .ts or .js file with `export` in a package that is not `"type": "module"` is compiled as
 * CommonJS, and Node fails with "Cannot require() ES Module … in a cycle": say what is really wrong.
 * `what` is the cause's start (`top-level await needs an ES module,`: tsx compiles a CommonJS
 * TypeScript file's import and export, but not its top-level await). The fix renames a .js file to
 * .mjs, TypeScript to .mts.
 */
async function notAModulePackage(file: string, what = 'it is an ES module'): Promise<LoadFailure | undefined> {
  if (/\.m[jt]s$/.test(file)) return undefined;
  const esm = /\.[cm]?ts$/.test(file) ? '.mts' : '.mjs';
  if (/\.c[jt]s$/.test(file)) return { cause: `${what} but a ${path.extname(file)} file is CommonJS`, fix: `rename it to ${esm}` };
  for (let dir = path.dirname(file); ; dir = path.dirname(dir)) {
    const pkgFile = path.join(dir, 'package.json');
    const text = await readFile(pkgFile, 'utf8').catch(() => undefined);
    if (text !== undefined) {
      let type: unknown;
      try {
        type = (JSON.parse(text) as { type?: unknown }).type;
      } catch {
        return undefined;
      }
      if (type === 'module') return undefined;
      // npm 11's `npm init -y` writes "type": "commonjs".
      if (type !== undefined) return { cause: `${what} but ${displayPath(pkgFile)} declares "type": ${JSON.stringify(type)}`, fix: `set "type": "module" there, or rename the file to ${esm}` };
      return { cause: `${what} but ${displayPath(pkgFile)} does not declare "type": "module"`, fix: `add "type": "module" there, or rename the file to ${esm}` };
    }
    if (path.dirname(dir) === dir) {
      return { cause: `${what} but no package.json above it declares "type": "module"`, fix: `add a package.json with "type": "module" to the project, or rename the file to ${esm}` };
    }
  }
}

/** Node prefixes a link-time error's stack with "file:line\n<source line>\n<caret>". */
async function linkErrorLocation(stack: string | undefined): Promise<SourceLocation | undefined> {
  const m = stack && /^((?:file:\/\/)?\/[^\n]+?|[A-Za-z]:\\[^\n]+?):(\d+)\n([^\n]*)\n( *)\^/.exec(stack);
  if (!m) return undefined;
  const file = m[1]!.startsWith('file:') ? fileURLToPath(m[1]!) : m[1]!;
  return { file, line: Number(m[2]), column: m[4]!.length + 1, lineText: m[3]! };
}

/** The innermost stack frame in the user's own code (tsx maps it back to the .ts source). */
async function thrownAt(stack: string | undefined): Promise<SourceLocation | undefined> {
  for (const frame of stack?.split('\n').slice(1) ?? []) {
    const m = /\(?((?:file:\/\/)?\/[^():]+|[A-Za-z]:\\[^():]+):(\d+):(\d+)\)?\s*$/.exec(frame);
    if (!m) continue;
    const file = m[1]!.startsWith('file:') ? fileURLToPath(m[1]!) : m[1]!;
    if (file.includes(`${path.sep}node_modules${path.sep}`) || file.startsWith(OWN_SOURCES) || file.includes(COMPILED_COPIES)) continue;
    const loc = await at(file, Number(m[2]), Number(m[3]));
    if (loc) return loc;
  }
  return undefined;
}
