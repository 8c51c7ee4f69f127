import { randomBytes } from 'node:crypto';
import { readlinkSync } from 'node:fs';
import { hostname } from 'node:os';

/**
 * The initial PID namespace as /proc/self/ns/pid reads in it: its inode is fixed by the kernel
 * (PROC_PID_INIT_INO, 0xEFFFFFFC), whatever the host.
 */
export const INIT_PID_NAMESPACE = 'pid:[4026531836]';

/**
 * PostgreSQL keeps the first 63 bytes of a name (NAMEDATALEN - 1): an identifier, an
 * application_name. It drops the rest silently.
 */
export const POSTGRES_NAME_BYTES = 63;

/** The longest name that fits PostgreSQL's application_name after `idem-lock `. */
const NAME_BYTES = POSTGRES_NAME_BYTES - 'idem-lock '.length;

/**
 * A worker's name: `host:pid`, and `host:pid/<8 hex>` for a process in a PID namespace other than
 * the initial one (a container), where the same host name and pid are common: containers with the
 * host's network (`docker run --network host`, pods with hostNetwork) share its name and are each
 * pid 1. The suffix is random per process: a restarted container's PID namespace may get the same
 * inode again. A host name too long for PostgreSQL's 63 bytes with `idem-lock ` before it is cut
 * (at a character boundary), never the pid or the suffix: the name in application_name is the
 * whole name, the same as on the chunks (`done_by`). `pidNamespace` is what /proc/self/ns/pid
 * reads, null where it cannot be read (taken as the initial one).
 */
export function workerName(host: string, pid: number, pidNamespace: string | null, suffix: () => string = () => randomBytes(4).toString('hex')): string {
  const tail = `:${pid}${pidNamespace === null || pidNamespace === INIT_PID_NAMESPACE ? '' : `/${suffix()}`}`;
  const chars = [...host];
  while (chars.length > 0 && Buffer.byteLength(chars.join('') + tail) > NAME_BYTES) chars.pop();
  return chars.join('') + tail;
}

function pidNamespace(): string | null {
  try {
    return readlinkSync('/proc/self/ns/pid');
  } catch {
    return null;
  }
}

/**
 * This process as a worker: on its chunk markers (`done_by`), the run's holder, and its sessions'
 * application_name (`idem host:pid`, `idem-lock host:pid`). Computed once: the one definition.
 */
export const WORKER = workerName(hostname(), process.pid, pidNamespace());
