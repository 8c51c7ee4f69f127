import { createHash, timingSafeEqual } from 'node:crypto';
import { readFile } from 'node:fs/promises';
import { MIN_TOKEN_LENGTH } from '../database.ts';
import { UsageError } from '../errors.ts';

/** Shortest token accepted: a guessable token would make the bearer check decoration (defined with the masks, which take no shorter one). */
export { MIN_TOKEN_LENGTH };

/**
 * The API token from a file (first line, trimmed: the shape of a Kubernetes or systemd secret) or
 * from `IDEM_API_TOKEN`. The file wins, so a secret mount overrides a stray variable. At least
 * MIN_TOKEN_LENGTH visible ASCII characters (what every HTTP client can send as a header).
 */
export async function loadApiToken(opts: { readonly file?: string; readonly env?: string }): Promise<string> {
  let token = opts.env;
  let from = 'IDEM_API_TOKEN';
  if (opts.file !== undefined) {
    let text: string;
    try {
      text = await readFile(opts.file, 'utf8');
    } catch (err) {
      throw new UsageError('tokenFile', `cannot read the token file ${opts.file} (${(err as { code?: string }).code ?? 'error'}); fix --token-file`, { cause: err });
    }
    token = text.split('\n')[0]!.trim();
    // The file wins over IDEM_API_TOKEN, so an empty one is its own problem, not a missing token.
    if (!token) {
      throw new UsageError('tokenFile', `--token-file ${opts.file} ${text.trim() ? 'has no token on its first line' : 'is empty'}: put the token on its first line (e.g. openssl rand -hex 32 > ${opts.file})`);
    }
    from = `token file ${opts.file}`;
  }
  if (!token) {
    throw new UsageError('noToken', 'idem serve needs an API token: set IDEM_API_TOKEN or pass --token-file <file> (e.g. openssl rand -hex 32 > token)');
  }
  if (token.length < MIN_TOKEN_LENGTH || /\s/.test(token)) {
    throw new UsageError('weakToken', `the API token from ${from} must be at least ${MIN_TOKEN_LENGTH} characters without spaces; generate one with openssl rand -hex 32`);
  }
  // Header values are bytes: fetch and browsers cannot send a character above U+00FF, and others
  // would send UTF-8 where Node reads Latin-1, so such a token would be accepted here and unusable.
  if (!/^[\x21-\x7e]+$/.test(token)) {
    throw new UsageError('invalidToken', `the API token from ${from} must be visible ASCII characters only (letters, digits, punctuation: HTTP clients cannot send others in a header); generate one with openssl rand -hex 32`);
  }
  return token;
}

/**
 * A check of presented tokens against the expected one, in constant time. Both sides are hashed
 * so timingSafeEqual gets equal lengths and the comparison leaks neither content nor length; the
 * expected side is hashed once, not on every request.
 */
export function tokenMatcher(expected: string): (presented: string) => boolean {
  const b = createHash('sha256').update(expected).digest();
  return (presented) => timingSafeEqual(createHash('sha256').update(presented).digest(), b);
}

/**
 * The token of an `Authorization: Bearer <token>` header; null when there is none, the header
 * uses another scheme (Basic, …) or names Bearer with nothing after it: that is a missing token
 * (401 naming Bearer), not a wrong one. A Bearer header with more than one word gives '' (a wrong token).
 */
export function bearerToken(header: string | undefined): string | null {
  if (!header || !/^Bearer\s+\S/i.test(header)) return null;
  const m = /^Bearer[ ]+(\S+)\s*$/i.exec(header);
  return m ? m[1]! : '';
}
