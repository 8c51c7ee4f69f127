import { createHash } from 'node:crypto';
import { open, stat } from 'node:fs/promises';
import path from 'node:path';
import type { ChunkSource, ChunkSpec, Json } from './job.ts';
import { UsageError } from './errors.ts';
import { refuseNonOptions, unknownKeys } from './suggest.ts';

export interface KeyListOptions<P = any> {
  /** The keys, or a function of the run's params returning them (`(p) => p.ids`). One of `keys` or `file`. */
  readonly keys?: readonly Json[] | ((params: P) => readonly Json[]);
  /**
   * A file of keys (or a function of the params naming one): read from a byte offset, a block at a
   * time, so a file of any size costs the memory of one window. Relative paths resolve against the
   * working directory. The file must not change while the run is unfinished (append is fine).
   */
  readonly file?: string | ((params: P) => string);
  /** File format: `lines` (one key per line) or `csv`. Defaults to `csv` for a `.csv` file, else `lines`. */
  readonly format?: 'lines' | 'csv';
  /** CSV: the key's column, by header name or 0-based index. Defaults to `0`, the first column. */
  readonly column?: string | number;
  /** CSV: whether the first line is a header (skipped). Defaults to `true`. */
  readonly header?: boolean;
  /** Keys per chunk. */
  readonly size: number;
}

/** A slice of the list: `keys` are the chunk's keys, in list order. */
export interface KeyListChunk extends ChunkSpec {
  readonly key: string;
  readonly keys: Json[];
}

/** Every option keyList takes; any other is refused (a typo such as `headers` would do nothing). */
const KEY_LIST_KEYS: ReadonlyArray<keyof KeyListOptions> = ['keys', 'file', 'format', 'column', 'header', 'size'];

/** How many bytes one read takes from the file. */
const BLOCK = 64 * 1024;

/**
 * The params a keyList source asks of its job: those its `keys`/`file` function declares, else
 * none in particular. Its `(p) => p.ids` unannotated leaves P `any` (the job's params are not
 * inferred into it), and a source typed `ChunkSource<any>` made the whole job's `ctx.params` `any`.
 */
type ParamsOfList<P> = unknown extends P ? unknown : P;

/**
 * Chunks over a list of keys: given inline or by the params (`keys`), or streamed from a file of
 * keys, one per line or one CSV column (`file`). Chunk keys are positions in the list
 * (`keys[0,1000)`), stable as long as the list is. Empty lines are skipped.
 * @example
 * keyList({ file: (p) => p.file, size: 1000 })        // run: ({ db }, { keys }) => … where id = any(${keys})
 * keyList({ keys: (p) => p.userIds, size: 100 })
 */
export function keyList<P = any>(opts: KeyListOptions<P>): ChunkSource<ParamsOfList<P>, any, KeyListChunk> {
  refuseNonOptions('keyList()', opts, "{ keys: [1, 2, 3], size: 1000 }");
  const problems = opts && typeof opts === 'object' ? unknownKeys(opts, KEY_LIST_KEYS, '') : [];
  if ((opts?.keys === undefined) === (opts?.file === undefined)) problems.push('pass exactly one of keys or file');
  if (opts?.keys !== undefined && !Array.isArray(opts.keys) && typeof opts.keys !== 'function') problems.push('keys must be an array or a function of the params');
  if (opts?.file !== undefined && !(typeof opts.file === 'function' || (typeof opts.file === 'string' && opts.file !== ''))) problems.push('file must be a path or a function of the params');
  if (!Number.isInteger(opts?.size) || opts.size < 1) problems.push(`size must be an integer >= 1 (got ${opts?.size})`);
  if (opts?.format !== undefined && opts.format !== 'lines' && opts.format !== 'csv') problems.push(`format must be 'lines' or 'csv' (got ${JSON.stringify(opts.format)})`);
  if (opts?.column !== undefined && !(typeof opts.column === 'string' || (Number.isInteger(opts.column) && opts.column >= 0))) problems.push('column must be a header name or a 0-based index');
  // A mistake in the job's definition, as defineJob's are (idem.invalidJob, exit 2).
  if (problems.length) throw new UsageError('invalidJob', `keyList(): ${problems.join('; ')}`);

  const chunkSize = (factor: number | undefined) => Math.max(1, Math.round(opts.size * (factor ?? 1)));
  const cut = (keys: Json[], first: number, size: number): KeyListChunk[] => {
    const chunks: KeyListChunk[] = [];
    for (let i = 0; i < keys.length; i += size) {
      const slice = keys.slice(i, i + size);
      chunks.push({ key: `keys[${first + i},${first + i + slice.length})`, keys: slice });
    }
    return chunks;
  };

  if (opts.keys !== undefined) {
    const list = (params: P): readonly Json[] => {
      const keys = typeof opts.keys === 'function' ? opts.keys(params) : opts.keys!;
      if (!Array.isArray(keys)) throw new TypeError(`keyList(): keys(params) must return an array (got ${typeof keys})`);
      return keys;
    };
    const source: ChunkSource<ParamsOfList<P>, any, KeyListChunk> = (cursor, ctx) => {
      const keys = list(ctx.params);
      const from = typeof cursor === 'number' ? cursor : 0;
      const to = Math.min(keys.length, from + Math.max(1, ctx.windowSize) * chunkSize(ctx.sizeFactor));
      return { chunks: cut(keys.slice(from, to) as Json[], from, chunkSize(ctx.sizeFactor)), next: to < keys.length ? to : null };
    };
    source.estimate = (ctx) => Math.ceil(list(ctx.params).length / opts.size);
    return source;
  }

  const fileOf = (params: P) => path.resolve(typeof opts.file === 'function' ? opts.file(params) : opts.file!);
  const source: ChunkSource<ParamsOfList<P>, any, KeyListChunk> = async (cursor, ctx) => {
    const file = fileOf(ctx.params);
    const format = opts.format ?? (file.toLowerCase().endsWith('.csv') ? 'csv' : 'lines');
    const at = cursor === null ? null : (cursor as { offset: number; index: number; column: number; before?: string });
    const size = chunkSize(ctx.sizeFactor);
    const want = Math.max(1, ctx.windowSize) * size;
    const reader = await LineReader.open(file, at?.offset ?? 0);
    try {
      // The bytes before the cursor are what the plan so far was read from: changed (lines put in
      // or taken out before it), the offset no longer falls after the same line, and reading on
      // from it would cut keys from the middle of lines. (A cursor from before 2026-12-04 has no
      // digest: not checked.)
      if (at?.before !== undefined && (await reader.digestBefore(at.offset)) !== at.before) {
        throw new TypeError(
          `keyList(): ${file} changed before byte ${at.offset}, where the run's plan goes on reading it; the file must not change while its run is unfinished (appending is safe): restore it to go on, or run the new file under a new key`,
        );
      }
      let column = at?.column ?? (typeof opts.column === 'number' ? opts.column : 0);
      if (at === null && format === 'csv' && (opts.header ?? true)) {
        const header = await reader.next();
        if (header !== null && typeof opts.column === 'string') {
          column = parseCsvLine(header.text, file, 1).indexOf(opts.column);
          if (column < 0) throw new TypeError(`keyList(): ${file} has no column "${opts.column}" in its header; fix column, or the file`);
        }
      }
      const keys: Json[] = [];
      let offset = reader.offset;
      while (keys.length < want) {
        const line = await reader.next();
        if (line === null) break;
        offset = reader.offset;
        if (line.text.trim() === '') continue;
        if (format === 'lines') {
          keys.push(line.text);
          continue;
        }
        const fields = parseCsvLine(line.text, file, line.offset);
        if (column >= fields.length) throw new TypeError(`keyList(): ${file} at byte ${line.offset} has ${fields.length} column(s), none at index ${column}; fix the file or column`);
        keys.push(fields[column]!);
      }
      const index = at?.index ?? 0;
      const more = keys.length === want && (await reader.next()) !== null;
      return { chunks: cut(keys, index, size), next: more ? { offset, index: index + keys.length, column, before: await reader.digestBefore(offset) } : null };
    } finally {
      await reader.close();
    }
  };
  // From the file's size and the mean length of its first keys: no full read just for an ETA.
  source.estimate = async (ctx) => {
    const file = fileOf(ctx.params);
    const { size: bytes } = await stat(file);
    const reader = await LineReader.open(file, 0);
    try {
      let lines = 0;
      while (reader.offset < BLOCK && (await reader.next()) !== null) lines++;
      if (lines === 0) return 0;
      return Math.ceil(((bytes / reader.offset) * lines) / opts.size);
    } finally {
      await reader.close();
    }
  };
  return source;
}

/** Bytes before a file cursor whose digest the cursor keeps (keyList's `before`). */
const DIGEST_BYTES = 256;

/** Reads a file line by line from a byte offset, a block at a time, knowing the offset after each line. */
class LineReader {
  readonly #handle: Awaited<ReturnType<typeof open>>;
  #buffer = Buffer.alloc(0);
  #position: number;
  #eof = false;
  /** Byte offset just after the last line returned. */
  offset: number;

  private constructor(handle: Awaited<ReturnType<typeof open>>, offset: number) {
    this.#handle = handle;
    this.#position = offset;
    this.offset = offset;
  }

  static async open(file: string, offset: number): Promise<LineReader> {
    const refuse = (why: string, cause?: unknown) =>
      new TypeError(`keyList(): cannot read ${file}: ${why}; fix the path (relative paths resolve against ${process.cwd()})`, { cause });
    let handle: Awaited<ReturnType<typeof open>>;
    try {
      handle = await open(file, 'r');
    } catch (err) {
      throw refuse((err as Error).message, err);
    }
    // A directory opens fine on Linux; only its first read fails, with a bare "EISDIR: illegal
    // operation on a directory, read" that names neither keyList nor the path.
    if ((await handle.stat().catch(() => null))?.isDirectory()) {
      await handle.close();
      throw refuse('it is a directory, not a file of keys');
    }
    return new LineReader(handle, offset);
  }

  /**
   * A digest of the (up to) 256 bytes before `offset`: a resume checks that the file still has the
   * same bytes there, so the offset still falls just after the line it was taken after.
   */
  async digestBefore(offset: number): Promise<string> {
    const from = Math.max(0, offset - DIGEST_BYTES);
    const buffer = Buffer.alloc(offset - from);
    const { bytesRead } = await this.#handle.read(buffer, 0, buffer.length, from);
    return createHash('sha256').update(buffer.subarray(0, bytesRead)).update(String(offset - from)).digest('base64url').slice(0, 22);
  }

  /** The next line without its line break (\n or \r\n), or null at the end of the file. */
  async next(): Promise<{ text: string; offset: number } | null> {
    for (;;) {
      const nl = this.#buffer.indexOf(0x0a);
      if (nl >= 0 || (this.#eof && this.#buffer.length > 0)) {
        const end = nl >= 0 ? nl : this.#buffer.length;
        const start = this.offset;
        let text = this.#buffer.subarray(0, end).toString('utf8');
        if (text.endsWith('\r')) text = text.slice(0, -1);
        // A byte order mark (Excel, Windows editors) is no part of the first key or header.
        if (start === 0 && text.startsWith('\uFEFF')) text = text.slice(1);
        const consumed = nl >= 0 ? nl + 1 : end;
        this.#buffer = this.#buffer.subarray(consumed);
        this.offset += consumed;
        return { text, offset: start };
      }
      if (this.#eof) return null;
      const block = Buffer.allocUnsafe(BLOCK);
      const { bytesRead } = await this.#handle.read(block, 0, BLOCK, this.#position);
      this.#position += bytesRead;
      if (bytesRead === 0) this.#eof = true;
      // Only the unfinished line is carried over, so memory is one block plus one line.
      this.#buffer = this.#buffer.length === 0 ? block.subarray(0, bytesRead) : Buffer.concat([this.#buffer, block.subarray(0, bytesRead)]);
    }
  }

  async close(): Promise<void> {
    await this.#handle.close();
  }
}

/**
 * One CSV record on one line (RFC 4180 quoting: `"a,b"`, `"say ""hi"""`). A quoted field spanning
 * lines is refused: a key never contains a line break, and refusing keeps offsets exact.
 */
export function parseCsvLine(line: string, file: string, offset: number): string[] {
  const fields: string[] = [];
  let i = 0;
  for (;;) {
    if (line[i] === '"') {
      let value = '';
      i++;
      for (;;) {
        const q = line.indexOf('"', i);
        if (q < 0) throw new TypeError(`keyList(): ${file} at byte ${offset}: a quoted CSV field is not closed on its line; keys may not contain line breaks`);
        value += line.slice(i, q);
        if (line[q + 1] === '"') {
          value += '"';
          i = q + 2;
          continue;
        }
        i = q + 1;
        break;
      }
      fields.push(value);
    } else {
      const comma = line.indexOf(',', i);
      fields.push(line.slice(i, comma < 0 ? line.length : comma).trim());
      i = comma < 0 ? line.length : comma;
    }
    if (i >= line.length) return fields;
    if (line[i] !== ',') throw new TypeError(`keyList(): ${file} at byte ${offset}: expected a comma after a quoted CSV field`);
    i++;
    if (i === line.length) {
      fields.push('');
      return fields;
    }
  }
}
