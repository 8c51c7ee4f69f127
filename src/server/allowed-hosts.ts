import net from 'node:net';

/**
 * Which `Host` headers a server bound to loopback answers: a defence against DNS rebinding, where a
 * web page re-points its own name at 127.0.0.1 and then reads the server as same-origin (its
 * requests carry the page's name as Host). As Vite's `server.allowedHosts`: `localhost`, names
 * under `.localhost` (RFC 6761: they resolve to loopback only) and any IP address (a rebound page
 * always has a name; a page at an IP address is that address's own) are allowed, plus the
 * operator's `--allowed-host` names. Ports are ignored; names compare without case.
 */
export class AllowedHosts {
  readonly #names: ReadonlySet<string>;

  /** `names`: values of --allowed-host, already checked with `allowedHostProblem`. */
  constructor(names: readonly string[]) {
    this.#names = new Set(names.map(normalizeName));
  }

  /** True when `host`, a Host header (`name`, `name:port`, `[v6]:port`), names this server. */
  allows(host: string): boolean {
    const name = hostName(host);
    if (name === null) return false;
    return net.isIP(name) !== 0 || name === 'localhost' || name.endsWith('.localhost') || this.#names.has(name);
  }
}

/** Why `value` cannot be an --allowed-host (a host name or IP address, no scheme, no port); null when it can. */
export function allowedHostProblem(value: string): string | null {
  const name = normalizeName(value);
  if (net.isIP(name) !== 0 || /^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$/.test(name)) return null;
  return `--allowed-host ${JSON.stringify(value.slice(0, 100))} must be a host name or an IP address, without scheme or port (e.g. --allowed-host idem.example.com)`;
}

/** True for an address of the loopback interface (127.0.0.0/8, ::1, and 127.x mapped into IPv6). */
export function isLoopbackAddress(address: string): boolean {
  const a = address.toLowerCase();
  return a === '::1' || /^(::ffff:)?127\./.test(a);
}

/** The name of a Host header, lower case, without port, brackets or a final dot; null when it has none. */
function hostName(host: string): string | null {
  const m = /^\[([0-9a-f:.]+)\](?::\d*)?$/i.exec(host) ?? /^([^:[\]]+)(?::\d*)?$/.exec(host);
  return m ? normalizeName(m[1]!) : null;
}

function normalizeName(name: string): string {
  const n = name.toLowerCase().replace(/\.$/, '');
  // An IPv6 address as an --allowed-host may come with or without its brackets.
  return /^\[[0-9a-f:.]+\]$/.test(n) ? n.slice(1, -1) : n;
}
