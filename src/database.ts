import { readFileSync, type Stats, statSync } from 'node:fs';
import { userInfo } from 'node:os';
import path from 'node:path';
import { Kysely, PostgresDialect } from 'kysely';
import pg from 'pg';
import { CONNECT_RETRY_MS, isConnectionTrouble, isLockTimeout, isRetryable, isStatementTimeout, noConnectionFree, serverStarting } from './retry.ts';
import { sleep } from './sleep.ts';
import { testHookMs } from './test-hooks.ts';
import { POSTGRES_NAME_BYTES, WORKER } from './worker-identity.ts';
import type { Logger } from 'pino';
import { codeOf, DatabaseUnavailableError, errorFields, type IdemError, messageOf, UsageError } from './errors.ts';
import { maskFromNowOn } from './log.ts';
import { identInSql } from './table-name.ts';

export { isStatementTimeout } from './retry.ts';

/** The role a connection string logs in as, as pg picks it: the URL's user, else PGUSER, else the OS user. */
function roleOf(connectionString: string): string {
  let user = '';
  try {
    const url = new URL(connectionString);
    // pg reads ?user= too, after the URL's user.
    user = decodeURIComponent(url.username) || (url.searchParams.get('user') ?? '');
  } catch {
    // Not a URL: pg's defaults below.
  }
  if (user) return user;
  if (process.env.PGUSER) return process.env.PGUSER;
  try {
    return userInfo().username;
  } catch {
    return 'postgres';
  }
}

/**
 * Where the connection itself sets statement_timeout (`-c statement_timeout=…` in the URL's
 * `options`, else in PGOPTIONS, as pg reads them): a startup option overrides the role's and the
 * database's setting, so ALTER ROLE cannot help there. Null when neither sets it. Names only where,
 * never the connection string (it may hold a password).
 */
function statementTimeoutFromConnection(connectionString: string, source: string | undefined, setting: TimeoutSetting): string | null {
  let options = '';
  try {
    options = new URL(connectionString).searchParams.get('options') ?? '';
  } catch {
    // Not a URL: pg reads no options from it.
  }
  // pg takes the URL's options when there are any, else PGOPTIONS.
  const named = new RegExp(setting, 'i');
  if (options) return named.test(options) ? `${source ?? 'the connection string'}'s options` : null;
  return named.test(process.env.PGOPTIONS ?? '') ? 'PGOPTIONS' : null;
}

/** The settings that cut one of idem's statements short: statement_timeout, or (waiting on a lock) lock_timeout. */
type TimeoutSetting = 'statement_timeout' | 'lock_timeout';

/**
 * Where the statement_timeout idem ran into is set, and how to give idem more: in the connection's
 * options when they set it, else for the role `connectionString` logs in as (`source`: where the
 * connection string came from, `DATABASE_URL` or `--database-url` in the CLI).
 */
export function statementTimeoutOrigin(connectionString: string, source?: string, setting: TimeoutSetting = 'statement_timeout'): { readonly setBy: string; readonly fix: string; readonly fromConnection: boolean } {
  const where = statementTimeoutFromConnection(connectionString, source, setting);
  if (where !== null) {
    return {
      setBy: `set by -c ${setting} in ${where}`,
      fix: `raise or remove -c ${setting} in ${where} (a setting there overrides the role's and the database's)`,
      fromConnection: true,
    };
  }
  return {
    setBy: 'set for the role or database',
    fix: `raise it for the role idem connects as (ALTER ROLE ${identInSql(roleOf(connectionString))} SET ${setting} = '5min')`,
    fromConnection: false,
  };
}

/**
 * A statement of idem's own (not a chunk's: a run's failure says that one) cut short by the
 * statement_timeout (or, waiting on a lock, the lock_timeout) of the role or database, or of the
 * connection's options: a refusal naming where it is set and the fix that works there (exit 2),
 * not PostgreSQL's bare "canceling statement due to statement timeout" as if something had failed.
 * Other errors as given.
 */
export function statementTimeoutRefusal(err: unknown, connectionString: string, source?: string): unknown {
  const setting = isStatementTimeout(err) ? 'statement_timeout' : isLockTimeout(err) ? 'lock_timeout' : null;
  if (setting === null) return err;
  const o = statementTimeoutOrigin(connectionString, source, setting);
  const at = o.fromConnection ? o.setBy : `${o.setBy} (SHOW ${setting})`;
  const why = setting === 'statement_timeout' ? 'it waited on a lock or ran longer' : 'it waited on a lock another session held';
  return new UsageError('statementTimeout', `the database cancelled a statement of idem's at the ${setting} ${at}: ${why}; ${o.fix}${o.fromConnection ? '' : ' or reset it'}, then run the same command again`, {
    cause: err,
  });
}

/**
 * Replaces the password in a connection string (URL or key=value form) with `***`.
 * Every place idem prints a connection string goes through here.
 */
export function redactUrl(url: string): string {
  // Where the user or password ends the authority early, the "host" is a piece of them and the rest
  // holds the password: nothing after the scheme is shown.
  if (misreadUserinfo(url)) return url.replace(/:\/\/.*$/s, '://***');
  // Not a URL at all (no scheme, one slash): everything up to its last @ may be a user and password.
  if (!POSTGRES_URL.test(url) && !/^\s*[A-Za-z_]+\s*=/.test(url)) return url.replace(/^.*@/s, '***@');
  try {
    const u = new URL(url);
    if (u.password) u.password = '***';
    for (const k of ['password', 'sslpassword']) if (u.searchParams.has(k)) u.searchParams.set(k, '***');
    return u.toString().replace(/%2A%2A%2A/g, '***');
  } catch {
    return url.replace(/(password\s*=\s*)('[^']*'|\S+)/gi, '$1***').replace(/(:\/\/[^:/@\s]*:)[^@\s]*@/, '$1***@');
  }
}

/**
 * A URL of another database (`mysql://…`), which pg would try as PostgreSQL; and libpq's other
 * format, `host=db port=5432 user=app password=… dbname=app`: pg (and so idem) reads only URLs, and
 * would take the whole string for a host name ("host not found"). Refused up front,
 * before any connection, with what to pass instead; the string itself is not repeated (it holds
 * the password).
 */
export function refuseUnsupportedUrl(connectionString: string, source: string): void {
  if (misreadUserinfo(connectionString)) throw new UsageError('invalidDatabaseUrl', invalidUrlMessage(source));
  const scheme = /^\s*([A-Za-z][A-Za-z0-9+.-]*):\/\//.exec(connectionString)?.[1];
  if (scheme !== undefined && !['postgres', 'postgresql'].includes(scheme.toLowerCase())) {
    throw new UsageError('invalidDatabaseUrl', `${source} is a ${scheme}: URL, and idem works with PostgreSQL only; pass postgres://user:password@host:5432/db (or postgresql://)`);
  }
  if (/^\s*[A-Za-z_]+\s*=/.test(connectionString)) {
    throw new UsageError(
      'invalidDatabaseUrl',
      `${source} is a keyword/value connection string, which idem does not support; pass a URL instead: postgres://user:password@host:5432/db (percent-encode special characters in the password)`,
    );
  }
  // No scheme, or `postgres:/…`: pg would take the string for a host name or a socket path, and
  // its error would repeat it, password and all.
  if (!POSTGRES_URL.test(connectionString)) {
    throw new UsageError(
      'invalidDatabaseUrl',
      `${source} is not a postgres:// URL; pass postgres://user:password@host:5432/db (percent-encode special characters in the password; a Unix socket: postgres:///db?host=/var/run/postgresql)`,
    );
  }
  // White space in the user, password or host: pg then decodes none of the password's other
  // %-escapes (`p%40ss x` reaches the server as `p%40ss x`), or takes a piece for the host, and its
  // error blames the credentials. In the query (`?options=-c search_path=app`) it is read as meant.
  const authority = splitAuthority(connectionString.trim())?.authority ?? '';
  if (/\s/.test(authority)) throw new UsageError('invalidDatabaseUrl', `${source} holds white space in its user, password or host; percent-encode it (a space as %20): postgres://user:password@host:5432/db`);
  const port = /:(\d+)$/.exec(authority.slice(authority.lastIndexOf('@') + 1))?.[1];
  if (port !== undefined && !(Number(port) >= 1 && Number(port) <= 65535)) {
    throw new UsageError('invalidDatabaseUrl', `${source} has port ${port}, which is not a port number (1 to 65535); fix the port: postgres://user:password@host:5432/db`);
  }
  refuseUnknownSslSetting(connectionString, source);
}

/** The `sslmode` values pg reads (pg-connection-string); any other it takes for full verification, silently. */
const SSL_MODES = ['disable', 'prefer', 'require', 'verify-ca', 'verify-full', 'no-verify'];
/** The `ssl` values pg reads; any other (`maybe`, even `false`) it takes for "use TLS". */
const SSL_VALUES = ['true', '1', '0', 'no-verify'];

/**
 * An `sslmode` or `ssl` in the URL's query that pg does not know: refused (exit 2) naming the
 * parameter and the values it reads, instead of pg asking a server without TLS for it (libpq's
 * `sslmode=allow`, a typo) and failing with "The server does not support SSL connections".
 */
function refuseUnknownSslSetting(connectionString: string, source: string): void {
  let query: URLSearchParams;
  try {
    query = new URL(connectionString.trim()).searchParams;
  } catch {
    return; // pg's own parse fails too: describeConnectError's invalidDatabaseUrl
  }
  const orList = (values: readonly string[]) => values.join(', ').replace(/, (?=[^,]*$)/, ' or ');
  const modes = orList(SSL_MODES);
  const said = (key: string, value: string) => redactSecrets(`${key}=${value.length > 40 ? `${value.slice(0, 40)}…` : value}`, connectionString);
  for (const value of query.getAll('sslmode')) {
    if (!SSL_MODES.includes(value)) throw new UsageError('invalidDatabaseUrl', `${source} has ${said('sslmode', value)}, which pg does not know; use sslmode=${modes} (or leave it out)`);
  }
  for (const value of query.getAll('ssl')) {
    if (!SSL_VALUES.includes(value)) {
      throw new UsageError('invalidDatabaseUrl', `${source} has ${said('ssl', value)}, which pg does not know; use ssl=${orList(SSL_VALUES)}, or sslmode= (${modes})`);
    }
  }
  // pg's advice for sslmode=verify-ca (uselibpqcompat=true) needs a CA file: without one pg throws a
  // four-sentence SECURITY WARNING, which idem printed as the reason it "cannot connect".
  if (query.getAll('uselibpqcompat').at(-1) === 'true' && query.getAll('sslmode').at(-1) === 'verify-ca' && !query.get('sslrootcert')) {
    throw new UsageError(
      'invalidDatabaseUrl',
      `${source} has uselibpqcompat=true and sslmode=verify-ca but no sslrootcert, which pg refuses (verify-ca checks the certificate against your own CA, not its host name); add sslrootcert=<your CA file>, or use sslmode=verify-full`,
    );
  }
}

/** The sslmode pg reads from the URL (the last one given), or undefined. */
function sslmodeOf(connectionString: string): string | undefined {
  try {
    return new URL(connectionString.trim()).searchParams.getAll('sslmode').at(-1);
  } catch {
    return undefined;
  }
}

const POSTGRES_URL = /^\s*postgres(?:ql)?:\/\//i;

/**
 * A user or password with an unencoded `/`, `?` or `#` ends a URL's authority early. Mostly the URL
 * then fails to parse (a port that is not a number: see describeConnectError), but digits before it
 * read as a port: `postgres://app:12#pw@db/app` is host `app`, port 12, and the rest, password and
 * real host included, a fragment. An `@` in the password before a `/` or `?` does the same
 * (`postgres://app:p@ss/word@db/app`: password `p`, host `ss`). So a URL with a fragment (which
 * PostgreSQL URLs never use), or with an `@` after its authority (an `@` in a database name or a
 * query value must be written %40 then), is taken for that mistake.
 */
function misreadUserinfo(url: string): boolean {
  const rest = splitAuthority(url)?.rest ?? '';
  return rest.includes('#') || rest.includes('@');
}

/** A URL's authority (user, password, host and port, up to the first `/`, `?` or `#`) and what follows it; null without `scheme://`. */
function splitAuthority(url: string): { authority: string; rest: string } | null {
  const m = /^\s*[A-Za-z][A-Za-z0-9+.-]*:\/\/([^/?#]*)(.*)$/s.exec(url);
  return m ? { authority: m[1]!, rest: m[2]! } : null;
}

/** Where a connection string does not parse, or parses as something else: neither it nor its redaction is repeated. */
function invalidUrlMessage(source: string | undefined): string {
  return `${source ?? 'the connection string'} is not a valid URL; percent-encode special characters in the user and password (/ as %2F, # as %23, ? as %3F, @ as %40, % as %25): postgres://user:password@host:5432/db`;
}

/**
 * Removes any occurrence of the connection's password from a message: the connection string's, and
 * PGPASSWORD's, which pg uses when the string has none.
 */
export function redactSecrets(text: string, connectionString: string): string {
  return maskAll(text, secretForms(connectionString));
}

/** redactSecrets for many texts: the secret forms worked out once (a stat of the password file among them), not per text. */
export function secretRedactor(connectionString: string): (text: string) => string {
  const forms = secretForms(connectionString);
  return (text) => maskAll(text, forms);
}

/**
 * Secrets besides the database password that nothing idem prints, logs, stores or answers may show:
 * `idem serve`'s API token once read from --token-file (IDEM_API_TOKEN is masked from the
 * environment directly, in every command: a job's code and its child processes inherit it).
 */
const otherSecrets = new Set<string>();

/**
 * The shortest API token idem serve takes (server/api-token.ts refuses shorter ones), and so the
 * shortest token the masks take: defined here, where every command's masks are made, so that they
 * do not load the server's modules.
 */
export const MIN_TOKEN_LENGTH = 16;

/** Adds a secret (an API token read from a file) to what secretForms masks, from now on. */
export function addSecret(secret: string): void {
  if (secret.trim().length < MIN_TOKEN_LENGTH) return;
  for (const form of [secret, secret.trim()]) {
    otherSecrets.add(form);
    // The command's logger and console masks were made before the token was read.
    maskFromNowOn(form);
  }
}

/**
 * The password's forms redactSecrets masks: as written in the URL (percent-encoded), as the server
 * gets it, and PGPASSWORD; and the API token (IDEM_API_TOKEN, or a token file's, see addSecret).
 * pg (like libpq) also takes the password from the query, `?password=…`, and an SSL key's
 * passphrase from `?sslpassword=…`: those too, as written and decoded.
 */
export function secretForms(connectionString: string): string[] {
  let forms: string[];
  try {
    const url = new URL(connectionString);
    const raw = url.password;
    forms = [raw, safeDecode(raw)];
    for (const key of ['password', 'sslpassword']) {
      for (const value of url.searchParams.getAll(key)) forms.push(value);
      for (const [, written] of url.search.matchAll(new RegExp(`[?&]${key}=([^&#]*)`, 'gi'))) forms.push(written!, safeDecode(written!));
    }
  } catch {
    forms = [/password\s*=\s*'?([^'\s]+)/i.exec(connectionString)?.[1] ?? ''];
  }
  forms.push(process.env.PGPASSWORD ?? '', ...passwordsFromFile(connectionString));
  // The API token (black-box round 16: a job's error quoting its environment stored, logged and
  // served the token under --public-read, where the password beside it was masked).
  // Only a value that can be a token (idem serve refuses one under 16 characters): a short one
  // (IDEM_API_TOKEN=idem in a developer's shell) would mask ordinary words, `idem: error:` among them.
  const token = process.env.IDEM_API_TOKEN?.trim();
  if (token !== undefined && token.length >= MIN_TOKEN_LENGTH) forms.push(token, process.env.IDEM_API_TOKEN!);
  forms.push(...otherSecrets);
  // Longest first: a form inside another (the decoded password in the written one) leaves no piece of it.
  return [...new Set(forms)].filter((password) => password.length >= 3).sort((a, b) => b.length - a.length);
}

/**
 * The passwords pg may take from the password file (PGPASSFILE, default ~/.pgpass) for this
 * connection: those of the lines whose host, port, database and user match pg's (its `pgpass`
 * package's rules: `*` matches anything, `\:` and `\\` are escapes). Every matching line, not
 * only the first as libpq takes: pgpass 1.0.5 goes on reading after its first match and gives the
 * last one it read. Only where pg reads the file: the connection string has no password and
 * PGPASSWORD is not set. A file pg ignores for its permissions still holds the password, and it is
 * masked all the same.
 */
export function passwordsFromFile(connectionString: string): readonly string[] {
  if (Object.prototype.hasOwnProperty.call(process.env, 'PGPASSWORD')) return [];
  const file = passwordFilePath();
  let stat: Stats;
  try {
    stat = statSync(file);
  } catch {
    return [];
  }
  if (!stat.isFile()) return [];
  const cacheKey = `${file}\0${stat.mtimeMs}\0${stat.size}\0${stat.ino}\0${connectionString}\0${process.env.PGUSER ?? ''}\0${process.env.PGHOST ?? ''}\0${process.env.PGPORT ?? ''}\0${process.env.PGDATABASE ?? ''}`;
  const known = fileSecrets.get(cacheKey);
  if (known) return known;
  const found: string[] = [];
  try {
    // pg's own reading of the string and the environment (host, port, database, user).
    const params = (new pg.Client({ connectionString }) as unknown as { connectionParameters: { host?: string; port?: number; database?: string; user?: string; password?: string | null } }).connectionParameters;
    if (params.password === null || params.password === undefined) {
      for (const line of readFileSync(file, 'utf8').split(/\r?\n/)) {
        const entry = parsePassFileLine(line);
        if (entry && passFileEntryMatches(entry, params)) found.push(entry.password);
      }
    }
  } catch {
    // an unreadable file or a string pg cannot read: pg gets no password from it either
  }
  if (fileSecrets.size > 20) fileSecrets.clear();
  fileSecrets.set(cacheKey, found);
  return found;
}

/** passwordsFromFile's answers, by file version, connection string and pg's environment. */
const fileSecrets = new Map<string, readonly string[]>();

/**
 * The password file pg reads, exactly as its `pgpass` package chooses it: PGPASSFILE, else
 * $HOME/.pgpass, and with HOME unset (some systemd units) ./.pgpass in the working directory, not
 * the account's home: the file masked must be the file pg reads.
 */
function passwordFilePath(): string {
  if (process.env.PGPASSFILE) return process.env.PGPASSFILE;
  return process.platform === 'win32' ? path.join(process.env.APPDATA || './', 'postgresql', 'pgpass.conf') : path.join(process.env.HOME || './', '.pgpass');
}

/**
 * Why pg does not read the password file, when it is there and would be read (PGPASSWORD is not
 * set) but pg's `pgpass` ignores it: group or world access, or not a plain file. The problem and its
 * fix, for a warning or an error; undefined when pg reads it (or there is none).
 */
export function passwordFileProblem(): string | undefined {
  if (Object.prototype.hasOwnProperty.call(process.env, 'PGPASSWORD') || process.platform === 'win32') return undefined;
  const file = passwordFilePath();
  let stat: Stats;
  try {
    stat = statSync(file);
  } catch {
    return undefined;
  }
  if (!stat.isFile()) return `the password file ${file} is not a plain file, so pg does not read it; put the password in a file there (chmod 600), or point PGPASSFILE at one`;
  if (stat.mode & 0o077) return `the password file ${file} has group or world access, so pg does not read it; chmod 600 ${file}`;
  return undefined;
}

type PassFileEntry = { readonly host: string; readonly port: string; readonly database: string; readonly user: string; readonly password: string };

/** One line of a password file as pg's `pgpass` package reads it (host:port:database:user:password), or null. */
function parsePassFileLine(line: string): PassFileEntry | null {
  if (line.length < 11 || /^\s+#/.test(line)) return null;
  const fields: string[] = [];
  let start = 0;
  for (let i = 0; i < line.length - 1; i++) {
    if (fields.length === 4) break;
    if (line[i + 1] === ':' && line[i] !== '\\') {
      fields.push(line.slice(start, i + 1));
      start = i + 2;
    }
  }
  if (fields.length < 4) return null;
  fields.push(line.slice(start));
  const unescape = (f: string) => (Object.prototype.hasOwnProperty.call(process.env, 'PGPASS_NO_DEESCAPE') ? f : f.replace(/\\([:\\])/g, '$1'));
  const [host, port, database, user, password] = fields.map(unescape) as [string, string, string, string, string];
  const portOk = port === '*' || (Number.isSafeInteger(Number(port)) && Number(port) > 0);
  if (!host || !portOk || !database || !user || !password) return null;
  return { host, port, database, user, password };
}

/** Whether a password file line is for this connection, as pg's `pgpass` package matches it. */
function passFileEntryMatches(entry: PassFileEntry, params: { host?: string; port?: number; database?: string; user?: string }): boolean {
  const field = (want: string, have: string | undefined) => want === '*' || want === have;
  return field(entry.host, params.host) && (Number(params.port || 5432) === Number(entry.port) || entry.port === '*') && field(entry.database, params.database) && field(entry.user, params.user);
}

function safeDecode(text: string): string {
  try {
    return decodeURIComponent(text);
  } catch {
    return text;
  }
}

function maskAll(text: string, forms: readonly string[]): string {
  for (const password of forms) if (text.includes(password)) text = text.split(password).join('***');
  return text;
}

/**
 * Masks the connection string's password in a thrown value before it is recorded, logged or
 * printed: an Error's message, stack and own enumerable properties (pg's `detail`, an HTTP client's
 * `config`), along its `cause` chain (a RunFailedError's cause is the job's own error, which a
 * caller's console.error prints whole) and an AggregateError's errors. Errors are masked in place,
 * as they are the ones thrown on. Anything else (a thrown string, a plain object or array, such as
 * an HTTP client's `{ message, config: { url } }`, whether thrown or a cause) is replaced by a
 * masked copy where it holds the password: the job's own object is left as it was.
 * @example throw redactError(err, connectionString);
 */
export function redactError<T>(err: T, connectionString: string): T {
  const forms = secretForms(connectionString);
  const redact = (text: string) => maskAll(text, forms);
  const errors = new Set<Error>();
  let budget = MASK_MAX_VALUES;

  /**
   * `value` as it may be shown: masked in place (an Error), the same value (nothing in it to
   * mask), or a masked copy (a string, an object or array holding the password). Copies share
   * `copies`, so a cycle in the job's object is a cycle in the copy.
   */
  const masked = (value: unknown): unknown => {
    let changed = false;
    const copies = new Map<object, unknown>();
    const copy = (v: unknown, depth: number): unknown => {
      if (typeof v === 'string') {
        const r = redact(v);
        if (r !== v) changed = true;
        return r;
      }
      if (v instanceof Error) return visitError(v), v;
      if (v === null || typeof v !== 'object' || !copyable(v)) return v;
      const seen = copies.get(v);
      if (seen !== undefined) return seen;
      if (depth > MASK_MAX_DEPTH || --budget < 0) {
        // Too deep or too large to look through: not shown, rather than shown unchecked.
        changed = true;
        return NOT_CHECKED;
      }
      if (Array.isArray(v)) {
        const out: unknown[] = [];
        copies.set(v, out);
        for (const item of v) out.push(copy(item, depth + 1));
        return out;
      }
      if (v instanceof Map) {
        const out = new Map();
        copies.set(v, out);
        for (const [k, item] of v) out.set(copy(k, depth + 1), copy(item, depth + 1));
        return out;
      }
      if (v instanceof Set) {
        const out = new Set();
        copies.set(v, out);
        for (const item of v) out.add(copy(item, depth + 1));
        return out;
      }
      // Its class kept (util.inspect shows `AxiosHeaders { … }`), its own enumerable fields copied.
      const out = Object.create(Object.getPrototypeOf(v)) as Record<string, unknown>;
      copies.set(v, out);
      for (const key of Object.keys(v)) {
        let item: unknown;
        try {
          item = (v as Record<string, unknown>)[key];
        } catch {
          continue; // a getter that throws: nothing to show
        }
        const k = redact(key);
        if (k !== key) changed = true;
        out[k] = copy(item, depth + 1);
      }
      return out;
    };
    const result = copy(value, 0);
    return changed ? result : value;
  };

  const visitError = (e: Error): void => {
    if (errors.has(e)) return;
    errors.add(e);
    try {
      e.message = redact(e.message);
      if (typeof e.stack === 'string') e.stack = redact(e.stack);
    } catch {
      // A frozen error cannot be masked; better left as it is than a second error where the first is being recorded.
    }
    const fields: string[] = ['cause', ...Object.keys(e).filter((k) => k !== 'cause')];
    for (const key of fields) {
      if (!Object.prototype.hasOwnProperty.call(e, key)) continue;
      try {
        const before = (e as unknown as Record<string, unknown>)[key];
        // idem's own error codes and PostgreSQL's SQLSTATEs are never the password: a password
        // that is also a word (`idem`) must not turn `idem.invalidParams` into `***.invalidParams`.
        if (key === 'code' && typeof before === 'string' && /^(idem\.[A-Za-z]+|[0-9A-Z]{5})$/.test(before)) continue;
        const after = masked(before);
        if (after !== before) (e as unknown as Record<string, unknown>)[key] = after;
      } catch {
        // read-only or a throwing getter: left as it is
      }
    }
    if (e instanceof AggregateError && Array.isArray(e.errors)) {
      try {
        const after = masked(e.errors);
        if (after !== e.errors) e.errors = after as unknown[];
      } catch {
        // left as it is
      }
    }
  };

  return masked(err) as T;
}

/** How deep redactError looks into a plain object or array a job threw, or gave as a cause. */
const MASK_MAX_DEPTH = 10;
/** How many objects and arrays redactError copies for one error (a cause holding a large response body). */
const MASK_MAX_VALUES = 2_000;
/** What stands in a masked copy for the part of a job's object too deep or too large to look through. */
const NOT_CHECKED = '[not shown: too deep or too large to check for the password]';

/** Objects redactError copies: plain ones, class instances (an HTTP client's config), arrays, Maps and Sets; not Dates, Buffers, promises and the like. */
function copyable(v: object): boolean {
  if (Array.isArray(v) || v instanceof Map || v instanceof Set) return true;
  if (ArrayBuffer.isView(v) || v instanceof ArrayBuffer || v instanceof Date || v instanceof RegExp || v instanceof Promise || v instanceof WeakMap || v instanceof WeakSet) return false;
  return typeof (v as { then?: unknown }).then !== 'function';
}

/**
 * Server-side TCP keepalives for every idem session (lock and work): if this host vanishes (power,
 * network), the server notices within about a minute (30 s idle + 3 probes 10 s apart) and ends
 * the session, freeing its advisory lock and row locks, instead of after the OS defaults' ~2 hours.
 * `tcp_user_timeout` bounds the same when the server has unacknowledged data in flight.
 */
export const SERVER_KEEPALIVES = 'set tcp_keepalives_idle = 30; set tcp_keepalives_interval = 10; set tcp_keepalives_count = 3; set tcp_user_timeout = 60000';

/**
 * idem's protocol is built for READ COMMITTED: claims skip rows other transactions hold and see
 * the rows they commit, the fence and the step row are re-read under lock at their latest. Under
 * a role's or database's `default_transaction_isolation = 'serializable'`, its own claims, markers
 * and planning raised serialization failures among themselves (the job doing nothing), failing
 * runs; under repeatable read a claim's FOR UPDATE of a row just committed by another worker does
 * too. So every idem session pins it, the chunk's own statements included (README, "The
 * one-transaction rule").
 */
const READ_COMMITTED = "set default_transaction_isolation = 'read committed'";

/**
 * A statement of idem's that waits (on a lock, a long query) goes on on the server after its
 * process is gone (SIGKILL, a deadline's exit), and may take its lock after all: PostgreSQL 14+
 * checks a session's client every `client_connection_check_interval` while a statement runs and
 * ends it when the client has gone. A DO block that swallows its error: on a platform without the
 * kernel events it needs, setting it fails, and in the setup's one implicit transaction that would
 * undo the settings before it.
 */
const CLIENT_CHECK = `do $idem$ begin if current_setting('server_version_num')::int >= 140000 then
  perform set_config('client_connection_check_interval', '5000', false); end if;
  exception when others then null; end $idem$`;

/**
 * The output formats node-postgres parses, and that keysetQuery's text boundaries are written in:
 * a role or database that sets others (`DateStyle = 'SQL, DMY'`, `IntervalStyle = iso_8601`,
 * `extra_float_digits = 0`) made pg read every timestamp as null (runs failed in step "(runner)"),
 * wrote boundaries such as "10/01/2026" that a session with another DateStyle read back as
 * October 1 (rows done twice), and rounded float keys ("1" for 1.0000000000000002: rows skipped).
 * `datestyle = 'ISO'` sets the output format alone: the day/month order of the session's input
 * is left as the role or database sets it.
 */
const OUTPUT_FORMATS = "set datestyle = 'ISO'; set intervalstyle = 'postgres'; set extra_float_digits = 3";

/**
 * What every idem session (lock and work) sets first: the server-side keepalives, and no
 * `idle_session_timeout` (PostgreSQL 14+). A role or database may set one (`ALTER ROLE … SET
 * idle_session_timeout = '1min'`) for clients that forget their sessions; a work session may idle
 * in the pool for as long as a chunk takes elsewhere, and the server ending it cost a retry. The
 * lock session sets its own instead (lockSessionSetup).
 */
export const SESSION_SETUP = `${SERVER_KEEPALIVES}; ${idleSessionTimeout(0)}; ${READ_COMMITTED}; ${OUTPUT_FORMATS}; ${CLIENT_CHECK}`;

/**
 * Sent once on each new session, lock and work: a session lock a killed idem left. A new backend
 * holds none; a server session a pooler that does not reset sessions (PgBouncer in session mode
 * with `server_reset_query` empty) hands over does, if a killed process had it: its lock session
 * with the job's lock, which kept the job busy for every rerun (the holder named as the rerunning
 * process itself, whose connection now had that session). Such a session belongs to no live client.
 */
export const RELEASE_LEFTOVER_LOCKS = 'select pg_advisory_unlock_all()';

/**
 * The lock session's setup: SESSION_SETUP, then an `idle_session_timeout` of its own (PostgreSQL
 * 14+). A live idem sends a statement on its lock session every check interval (2 s), so the
 * server ends it only when the process went silent: stopped (SIGSTOP, a frozen VM) or its host
 * gone behind a proxy (PgBouncer) whose server connection stays healthy, where keepalives never
 * fire because the server's peer is the proxy. The lock is freed then, within `ms`, and the
 * process, if it ever wakes, finds its lock lost (exit 69) and its commits fenced off.
 */
export function lockSessionSetup(ms: number): string {
  // The same bound inside its transactions (the entry gate, leave()): short, and without job code.
  return `${SERVER_KEEPALIVES}; ${idleSessionTimeout(ms)}; ${READ_COMMITTED}; ${OUTPUT_FORMATS}; ${CLIENT_CHECK}; set idle_in_transaction_session_timeout = ${ms}; ${RELEASE_LEFTOVER_LOCKS}`;
}

function idleSessionTimeout(ms: number): string {
  if (!Number.isInteger(ms) || ms < 0) throw new TypeError(`idle_session_timeout must be an integer >= 0 ms (got ${ms})`);
  return `select set_config('idle_session_timeout', '${ms}', false) where current_setting('server_version_num')::int >= 140000`;
}

/**
 * What each work session of a pool was set up with (onConnect): a chunk slot whose job changed a
 * session setting resets the session and sends this again, instead of opening another one.
 */
export const sessionSetupOf = new WeakMap<object, string>();

/**
 * The application_name of one of idem's sessions: `idem host:pid` for the work pool's, `idem-lock
 * host:pid` for the lock's, so pg_stat_activity tells an operator which worker a backend belongs
 * to (WORKER: worker-identity.ts, which keeps it whole). Cut to what PostgreSQL keeps, at a
 * character boundary (the server would cut a long name anyway, and could cut it inside a character).
 */
export function sessionName(kind: 'idem' | 'idem-lock', holder = WORKER): string {
  const chars = [...`${kind} ${holder}`];
  while (Buffer.byteLength(chars.join('')) > POSTGRES_NAME_BYTES) chars.pop();
  return chars.join('');
}

/** Every session of idem's own in this process (work pools' and lock sessions'), while it is open. */
const idemSessions = new Set<pg.Client>();

/** Counts `client` among idem's sessions (cancelStatements reaches it) until it ends. */
export function trackSession(client: pg.Client): void {
  idemSessions.add(client);
  client.once('end', () => idemSessions.delete(client));
}

let cancelling: NodeJS.Timeout | undefined;

/**
 * Cancels the statement each of idem's sessions is running, and each one they start from then on,
 * until the process exits: an operator command stopped by a signal must not take effect later.
 * Its statement (`idem pause`'s update, waiting on a lock) otherwise went on server-side after the
 * process was gone, and landed when the lock was released; cancelled, its transaction rolls back.
 * Sent as PostgreSQL's cancel request (a connection of its own, as psql's Ctrl-C), which a pooler
 * passes on to the server session.
 */
export function cancelStatements(): void {
  const sent = new WeakSet<object>();
  const sweep = () => {
    for (const client of idemSessions) void cancelActiveStatement(client, sent);
  };
  sweep();
  cancelling ??= setInterval(sweep, 50).unref();
}

/**
 * Sends PostgreSQL's cancel request for the statement `client` is running, if any and not already
 * in `sent` (which it joins). A connection of its own, as psql's Ctrl-C; the statement fails with
 * 57014 and its transaction is left aborted. Sent with pg's Connection, not Client#cancel: that one
 * (like the `activeQuery` getter) is deprecated in pg 8.23 and printed a DeprecationWarning on
 * every process that cancelled (black-box round 15), and goes away in pg 9.
 */
export function cancelActiveStatement(client: pg.ClientBase, sent: WeakSet<object>): boolean {
  const c = client as unknown as { _getActiveQuery?: () => object | null; _activeQuery?: object | null; processID: number; secretKey: number; host: string; port: number };
  const active = typeof c._getActiveQuery === 'function' ? c._getActiveQuery() : (c._activeQuery ?? null);
  if (!active || sent.has(active)) return false;
  sent.add(active);
  // pg's Connection (its wire protocol over one socket); @types/pg does not declare these two.
  const con = new pg.Connection() as unknown as pg.Connection & { connect(portOrPath: number | string, host?: string): void; cancel(processID: number, secretKey: number): void };
  // The server answers a cancel request by closing the connection; nothing to wait for or report.
  con.on('error', () => {});
  con.once('connect', () => con.cancel(c.processID, c.secretKey));
  if (c.host?.startsWith('/')) con.connect(`${c.host}/.s.PGSQL.${c.port}`);
  else con.connect(c.port, c.host);
  return true;
}

/** How long a work-pool connection may take to open (pg-pool's connectionTimeoutMillis): a pooler with no session free holds it past this. */
export const CONNECT_TIMEOUT_MS = 10_000;

/** Default of `idleInTransactionTimeoutMs`: a vanished process's open chunk transaction is ended after this. */
export const DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS = 60_000;

export interface Database {
  readonly db: Kysely<any>;
  readonly pool: pg.Pool;
  /** Whether the connections go through a (session-mode) connection pooler, seen at open (refuseSessionlessPooler). */
  readonly pooled: boolean;
  /** Idempotent. */
  close(): Promise<void>;
}

/** Opens the work pool and proves the server answers, mapping failures to one-line errors that say the fix. */
export async function openDatabase(
  connectionString: string,
  opts: {
    readonly poolSize: number;
    readonly log: Logger;
    readonly idleInTransactionTimeoutMs?: number;
    /**
     * Gives up on a statement that has had no answer for this long and drops its connection (pg's
     * query_timeout; the pool discards a client whose query failed). Only for short reads: a
     * connection whose flow the network forgot silently would otherwise hold its slot until TCP
     * gives up, about 15 minutes. Defaults to none.
     */
    readonly queryTimeoutMs?: number;
    /** Where the connection string came from, as an error's fix names it (`--database-url`, `DATABASE_URL`). */
    readonly source?: string;
  },
): Promise<Database> {
  refuseUnsupportedUrl(connectionString, 'the connection string');
  const idleMs = opts.idleInTransactionTimeoutMs ?? DEFAULT_IDLE_IN_TRANSACTION_TIMEOUT_MS;
  if (!Number.isInteger(idleMs) || idleMs < 0) throw new TypeError(`idleInTransactionTimeoutMs must be an integer >= 0 (got ${idleMs})`);
  /** Set once close() begins: errors of the sessions it ends are expected, not logged. */
  let closing = false;
  const pool = new pg.Pool({
    connectionString,
    max: opts.poolSize,
    application_name: sessionName('idem'),
    keepAlive: true,
    connectionTimeoutMillis: testHookMs('IDEM_CONNECT_TIMEOUT_MS') ?? CONNECT_TIMEOUT_MS,
    ...(opts.queryTimeoutMs !== undefined ? { query_timeout: opts.queryTimeoutMs } : {}),
    // Awaited by pg-pool before the client is handed out, so the session settings are in place
    // before anyone's first statement and nothing is queued behind them on the connection.
    onConnect: async (client: pg.ClientBase) => {
      // A checked-out client whose backend dies between two statements (pg_terminate_backend, a
      // restart) emits 'error' on itself, not on the pool; unhandled, that would crash the process.
      // The next statement on it then fails with a connection error, which the chunk retry handles.
      client.on('error', (err) => {
        if (!closing) opts.log.warn({ err: errorFields(err, redactSecrets(err.message, connectionString)) }, 'database connection lost');
      });
      // A work session whose process vanished mid-chunk holds the chunk's row locks: the server ends
      // it after idle_in_transaction_session_timeout, so another worker can redo the chunk.
      const setup = `${SESSION_SETUP}; set idle_in_transaction_session_timeout = ${idleMs}`;
      sessionSetupOf.set(client, setup);
      await client.query(`${setup}; ${RELEASE_LEFTOVER_LOCKS}`).catch((err: unknown) => {
        // Closed as it opened: behind a pooler, a server session that died with a restart of the
        // server (PgBouncer hands it out until it next checks it). Not handed out: pool.connect()
        // fails, and opening (below) tries a fresh one.
        if (isConnectionTrouble(err)) {
          droppedAtSetup.add(err as object);
          throw err;
        }
      });
    },
  });
  // Sessions whose sockets are still open. pool.end() resolves once it has asked each idle client
  // to end, not once they have: close() waits for the sockets, so that whoever counts the server's
  // sessions next (the embedded server's last-one-out check) no longer sees ours.
  const open = new Set<pg.Client>();
  /** Called once `open` is empty (see close()). */
  let whenAllEnded: (() => void) | undefined;
  pool.on('connect', (client) => {
    trackSession(client);
    open.add(client);
    client.once('end', () => {
      open.delete(client);
      if (open.size === 0) whenAllEnded?.();
    });
  });
  // An idle client's socket error is emitted on the pool; unhandled, it would kill the process.
  pool.on('error', (err) => {
    if (!closing) opts.log.warn({ err: errorFields(err, redactSecrets(err.message, connectionString)) }, 'idle database connection failed');
  });
  // A session killed during the check (a restart, pg_terminate_backend) says nothing about a
  // pooler: check again on fresh sessions. Reaching the server at all is not retried here: an
  // unreachable database is reported at once.
  // A server with no connection free (max_connections, the role's CONNECTION LIMIT, reached:
  // 53300) or still starting (57P03) is waited for a little: sessions leave, a server comes up.
  const fullUntil = Date.now() + (testHookMs('IDEM_CONNECT_RETRY_MS') ?? CONNECT_RETRY_MS);
  let pooled = false;
  for (let attempt = 1, full = 0; ; attempt++) {
    // Settled one by one: when one connects and the other is refused, the one that connected must
    // go back, or pool.end() below waits for it forever (with one slot free, idem hung at start).
    // (pool.connect() throws at once on a URL pg cannot parse: a rejection here, like the rest.)
    const settled = await Promise.allSettled([0, 1].map(async () => pool.connect()));
    const clients = settled.flatMap((r) => (r.status === 'fulfilled' ? [r.value] : []));
    const refused = settled.find((r): r is PromiseRejectedResult => r.status === 'rejected');
    if (refused) {
      for (const c of clients) c.release(true);
      // PgBouncer's refusal for server_login_retry (15 s) after a failed login to the server: a restart.
      const restarting = droppedAtSetup.has(refused.reason) || /server login has been failing/.test(messageOf(refused.reason));
      if ((noConnectionFree(refused.reason) || restarting) && Date.now() < fullUntil) {
        await sleep(Math.min(250 * 2 ** full++, 2_000, Math.max(0, fullUntil - Date.now())));
        attempt--;
        continue;
      }
      await pool.end().catch(() => {});
      throw describeConnectError(refused.reason, connectionString, opts.source);
    }
    try {
      pooled = await refuseSessionlessPooler(clients[0]!, clients[1]!, connectionString);
      for (const c of clients) c.release();
      break;
    } catch (err) {
      for (const c of clients) c.release(true);
      if (isRetryable(err) && (attempt < 3 || Date.now() < fullUntil)) {
        await sleep(Math.min(250, Math.max(0, fullUntil - Date.now())));
        continue;
      }
      await pool.end().catch(() => {});
      throw isConnectionTrouble(err) ? describeConnectError(err, connectionString, opts.source) : err;
    }
  }
  const db = new Kysely<any>({ dialect: new PostgresDialect({ pool }) });
  let closed: Promise<void> | undefined;
  return {
    db,
    pool,
    pooled,
    close: () =>
      (closed ??= (async () => {
        // Errors of sessions this close ends (sockets dropped after the wait) are not news.
        closing = true;
        // pool.end() waits for every client handed out to come back. One whose holder never gives it
        // back (a chunk abandoned after a lost lock whose job code never settles) kept close()
        // waiting forever, on nothing once its session was gone (the CLI then ended by Node's exit
        // 13, with no timer or socket left). Once every session has ended, nothing is left to wait for.
        const destroyed = db.destroy().catch(() => {});
        await (open.size === 0 ? destroyed : Promise.race([destroyed, new Promise<void>((resolve) => (whenAllEnded = resolve))]));
        whenAllEnded = undefined;
        await awaitSocketsClosed(open, CLOSE_WAIT_MS);
      })()),
  };
}

/** Errors of sessions that were closed while their settings were sent (onConnect). */
const droppedAtSetup = new WeakSet<object>();

/** The fix for a server or role with no connection free (53300), wherever idem meets it. */
export const NO_CONNECTION_FREE_FIX = "wait for other sessions to end, or raise max_connections or the role's CONNECTION LIMIT";


/**
 * How long close() waits for the server's goodbye on its sessions before dropping their sockets: a
 * dead network never sends it. The CLI's exit watchdog (10 s, 2 s after a lost lock) bounds the whole.
 */
const CLOSE_WAIT_MS = 2_000;

async function awaitSocketsClosed(open: ReadonlySet<pg.Client>, ms: number): Promise<void> {
  if (open.size === 0) return;
  const clients = [...open];
  let timer: NodeJS.Timeout | undefined;
  const bound = new Promise<void>((resolve) => (timer = setTimeout(resolve, ms)));
  await Promise.race([Promise.all(clients.map((c) => new Promise<void>((resolve) => (open.has(c) ? c.once('end', () => resolve()) : resolve())))), bound]);
  clearTimeout(timer);
  for (const c of clients) if (open.has(c)) (c as unknown as { connection?: { stream?: { destroy(): void } } }).connection?.stream?.destroy();
}

/**
 * idem keeps state in sessions (the advisory lock, the marker's prepared statement), so it must
 * never run behind a pooler that hands each transaction or statement to another server session
 * (PgBouncer pool_mode=transaction or statement). Checked on every start, before anything is
 * written: two connections of ours, both open, ask for their backend pid. A direct server is
 * certain: each connection's backend is the one that announced its pid at connect (BackendKeyData).
 * Behind a pooler (which announces pids of its own) they ask in turn many times (A, B, A, B, …): a
 * session pooler gives each its own backend for the connection's life, so the pids differ and stay
 * put; a transaction pooler releases A's server session after each statement and hands that one
 * to B (PgBouncer reuses the most recently used) or another one to A's next statement.
 */
async function refuseSessionlessPooler(a: pg.PoolClient, b: pg.PoolClient, connectionString: string): Promise<boolean> {
  const pid = async (c: pg.PoolClient) => (await c.query<{ pid: number }>('select pg_backend_pid() as pid')).rows[0]!.pid;
  const announced = (c: pg.PoolClient) => (c as unknown as { processID?: number }).processID;
  const a1 = await pid(a);
  const b1 = await pid(b);
  // Each connection talks to the backend that announced itself at connect, and they are two: no
  // pooler in between (a pooler announces a pid of its own, in every pool mode). Certain, and the
  // common case, so it costs two statements.
  if (a1 !== b1 && announced(a) === a1 && announced(b) === b1) return false;
  // A pooler. In session mode each connection keeps its server session for its life; in
  // transaction or statement mode its next statement may go to any idle one. One alternation
  // (A, B, A, B) can be fooled when other processes' clients take and give back sessions in
  // between so that A and B each get theirs again (four idem commands starting at once behind
  // PgBouncer did), so alternate POOLER_PROBES times: any move, or a shared session, is refused.
  let keeps = a1 !== b1;
  for (let i = 0; keeps && i < POOLER_PROBES; i++) keeps = (await pid(a)) === a1 && (await pid(b)) === b1;
  if (keeps) return true;
  const what = announced(a) !== undefined && announced(a) !== a1 ? 'a connection pooler (PgBouncer or similar)' : 'a pooler';
  throw new DatabaseUnavailableError(
    `${redactUrl(connectionString)} goes through ${what} in transaction or statement mode, which does not keep sessions, and idem needs its session (advisory lock): set pool_mode = session for idem's database, or point idem at PostgreSQL directly`,
  );
}

/** Alternations of the pooler check once a pooler is seen (see refuseSessionlessPooler). */
const POOLER_PROBES = 10;

/**
 * Where pg took the password from, as a fix names it: the URL's (userinfo or `?password=`), else
 * PGPASSWORD, else the password file (PGPASSFILE, default ~/.pgpass), which pg reads when neither
 * gives one.
 */
function passwordSource(connectionString: string): { readonly from: 'url' | 'env' | 'file'; readonly file: string } {
  const file = passwordFilePath();
  let inUrl = false;
  try {
    const u = new URL(connectionString);
    inUrl = u.password !== '' || Boolean(u.searchParams.get('password'));
  } catch {
    inUrl = true; // unparsable: the URL is what to fix
  }
  return { from: inUrl ? 'url' : process.env.PGPASSWORD ? 'env' : 'file', file };
}

export function describeConnectError(err: unknown, connectionString: string, source?: string): IdemError {
  const code = codeOf(err);
  // pg could not parse the string (new URL): most often a password with an unencoded / # ? or @,
  // else a port past 65535 or an unclosed [ (the same refusal as a URL refused before connecting).
  // Neither the string nor its redaction is repeated: where the URL breaks, the redaction may too.
  if (code === 'ERR_INVALID_URL') {
    return new UsageError('invalidDatabaseUrl', invalidUrlMessage(source), { cause: err });
  }
  const where = redactUrl(connectionString);
  const raw = redactSecrets((err as Error)?.message ?? String(err), connectionString);
  // Without a source (the library's Runner.connect), the fix names what the caller passed.
  const urlSource = source ?? 'the connection string';
  // pg's SCRAM client, given no password (none in the URL, PGPASSWORD or the password file), says so
  // in its own terms ("SASL: SCRAM-SERVER-FIRST-MESSAGE: client password must be a string").
  if (/client password must be a (non-empty )?string/.test(raw)) {
    const { file, from } = passwordSource(connectionString);
    // The password may well be in the file, which pg ignored for its permissions: that is the fix.
    const problem = from === 'file' ? passwordFileProblem() : undefined;
    if (problem) return new DatabaseUnavailableError(`the database at ${where} asks for a password and none was given: ${problem} (or put the password in ${urlSource} or PGPASSWORD)`, { cause: err });
    return new DatabaseUnavailableError(
      `the database at ${where} asks for a password and none was given (not in ${urlSource}, PGPASSWORD or ${file}); put it in ${urlSource} (postgres://user:password@host:5432/db, percent-encoded), or set PGPASSWORD, or add it to ${file}`,
      { cause: err },
    );
  }
  // Starting up or restarting (57P03), still so after the wait for it: the URL is right.
  if (serverStarting(err)) {
    return new DatabaseUnavailableError(`the database at ${where} is starting up or restarting (${raw}); run the same command again once it is up`, { cause: err });
  }
  let msg: string;
  switch (code) {
    case 'ECONNREFUSED':
      msg = `cannot reach the database at ${where}: connection refused; start the server or fix ${urlSource}`;
      break;
    case 'ENOTFOUND':
    case 'EAI_AGAIN':
      msg = `cannot reach the database at ${where}: host not found; fix the host in ${urlSource}`;
      break;
    case '28P01':
    case '28000': {
      // 28000 is also "not permitted to log in" and pg_hba.conf's refusals, where the user and
      // password are right and changing them is the wrong advice.
      const role = /role "([^"]+)" is not permitted to log in/.exec(raw)?.[1];
      // Under trust (or peer) auth PostgreSQL says the role does not exist; with a password it
      // does not tell, and "fix the user or password" below stands.
      const missing = /role "([^"]+)" does not exist/.exec(raw)?.[1];
      if (missing) msg = `the database at ${where} has no role ${missing} (${raw}); create it (CREATE ROLE ${identInSql(missing)} LOGIN) or fix the user in ${urlSource}`;
      else if (role) msg = `the database at ${where} refused the connection (${raw}); ALTER ROLE ${identInSql(role)} LOGIN, or use a role that may log in`;
      else if (/pg_hba\.conf/.test(raw)) msg = `the database at ${where} refused the connection (${raw}); allow it in the server's pg_hba.conf, or connect as a user, to a database or from a host it allows`;
      else {
        // The fix names where the password came from: the URL has none when pg took it from
        // PGPASSWORD or the password file.
        const pw = passwordSource(connectionString);
        if (pw.from === 'env') msg = `the database at ${where} refused the credentials (${raw}); fix the password in PGPASSWORD (${urlSource} has none), or the user in ${urlSource}`;
        else if (pw.from === 'file') msg = `the database at ${where} refused the credentials (${raw}); fix the password in ${pw.file} (${urlSource} has none, PGPASSWORD is not set), or the user in ${urlSource}`;
        else msg = `the database at ${where} refused the credentials (${raw}); fix the user or password in ${urlSource}`;
      }
      break;
    }
    case '42501': {
      // The role may log in, but not to this database: CONNECT was revoked (from PUBLIC) and not granted to it.
      const database = /permission denied for database "(.+)"/.exec(raw)?.[1];
      if (database !== undefined) msg = `the database at ${where} does not let role ${roleOf(connectionString)} connect (${raw}); GRANT CONNECT ON DATABASE ${identInSql(database)} TO ${identInSql(roleOf(connectionString))}, or connect as a role that has it`;
      else msg = `cannot connect to the database at ${where}: ${raw}; check ${urlSource}`;
      break;
    }
    case '3D000':
      msg = `the database at ${where} does not exist (${raw}); create it or fix the database name in ${urlSource}`;
      break;
    case '53300':
      // The URL is right: the server (max_connections) or the role (CONNECTION LIMIT) is full.
      msg = `the database at ${where} has no connection free for idem (${raw}); idem needs a few at once (its lock session, two to start, one per slot of --concurrency): ${NO_CONNECTION_FREE_FIX}`;
      break;
    default:
      if (/Connection terminated due to connection timeout/.test(raw)) {
        // pg's connect timeout (10 s): nothing answered, or a pooler accepted and found no server.
        msg = `cannot reach the database at ${where}: no answer within 10 s (the server, or a pooler in front of it, is down, starting or overloaded, or a firewall drops the packets); check the server, or fix ${urlSource}`;
      } else if (code === '57P01' || code === '57P02' || code === 'ECONNRESET' || /Connection terminated unexpectedly|server conn crashed|server login has been failing/.test(raw)) {
        msg = `cannot reach the database at ${where}: the connection was closed as it opened (${raw}); the server, or a pooler in front of it, is restarting or down: run the same command again once it is up`;
      } else if (/The server does not support SSL connections/.test(raw)) {
        // sslmode (but disable) or ssl=true|1|no-verify in the URL, or PGSSLMODE: pg asks for TLS and does not fall back.
        const byEnv = !/[?&]ssl(mode)?=/i.test(connectionString) && process.env.PGSSLMODE;
        // sslmode=prefer (with uselibpqcompat=true too): libpq would fall back to a plain connection, pg does not.
        const prefer = !byEnv && sslmodeOf(connectionString) === 'prefer';
        msg = byEnv
          ? `the database at ${where} does not accept SSL (TLS) connections, and PGSSLMODE=${process.env.PGSSLMODE} asks for one${process.env.PGSSLMODE === 'prefer' ? ' (pg insists on TLS with it: unlike libpq, it does not fall back to a plain connection)' : ''}; enable ssl on the server, or unset PGSSLMODE`
          : prefer
          ? `the database at ${where} does not accept SSL (TLS) connections, and ${urlSource} has sslmode=prefer, with which pg insists on TLS (unlike libpq, it does not fall back to a plain connection); enable ssl on the server, or set sslmode=disable in ${urlSource}`
          : `the database at ${where} does not accept SSL (TLS) connections, and ${urlSource} asks for one; enable ssl on the server, or set sslmode=disable in ${urlSource}`;
      } else msg = `cannot connect to the database at ${where}: ${raw}; check ${urlSource}`;
  }
  return new DatabaseUnavailableError(msg, { cause: err });
}
