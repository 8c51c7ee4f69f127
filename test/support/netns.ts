import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';

/** A host apart: a network namespace of the test's own, linked to this one by a veth pair. */
export interface NamespacedHost {
  readonly ns: string;
  /** This side's address (where a server here listens for the namespace). */
  readonly hostAddress: string;
  /** The namespace's own address. */
  readonly nsAddress: string;
  /** `ip netns exec <ns>` before a command, to run it on that host. */
  readonly exec: readonly string[];
  /** Takes the link down: packets stop both ways, and nobody is told (a host that vanished). */
  cut(): void;
  remove(): void;
}

function ip(args: string[]): { ok: boolean; out: string } {
  const r = spawnSync('ip', args, { encoding: 'utf8' });
  return { ok: r.status === 0, out: `${r.stdout ?? ''}${r.stderr ?? ''}${r.error?.message ?? ''}`.trim() };
}

/** Why namespaced hosts cannot work here (not root, no iproute2, no netns support), or null. */
export function netnsUnavailable(): string | null {
  if (process.getuid?.() !== 0) return 'network namespaces need root';
  const probe = `idem-probe-${process.pid}`;
  const add = ip(['netns', 'add', probe]);
  if (!add.ok) return `ip netns add failed: ${add.out || 'is iproute2 installed?'}`;
  ip(['netns', 'del', probe]);
  return null;
}

/**
 * Creates a namespace and a veth pair. Addresses come from a /30 in 10.231.0.0/16 that exists only
 * between this machine and the namespace the test made: no traffic leaves the machine.
 */
export function createNamespacedHost(): NamespacedHost {
  const id = randomBytes(3).toString('hex');
  const ns = `idem-${id}`;
  const hostIf = `idh${id}`;
  const nsIf = `idn${id}`;
  const block = (parseInt(id, 16) % 16_000) * 4;
  const base = `10.231.${Math.floor(block / 256)}`;
  const hostAddress = `${base}.${(block % 256) + 1}`;
  const nsAddress = `${base}.${(block % 256) + 2}`;
  const steps: string[][] = [
    ['netns', 'add', ns],
    ['link', 'add', hostIf, 'type', 'veth', 'peer', 'name', nsIf],
    ['link', 'set', nsIf, 'netns', ns],
    ['addr', 'add', `${hostAddress}/30`, 'dev', hostIf],
    ['link', 'set', hostIf, 'up'],
    ['netns', 'exec', ns, 'ip', 'addr', 'add', `${nsAddress}/30`, 'dev', nsIf],
    ['netns', 'exec', ns, 'ip', 'link', 'set', nsIf, 'up'],
    ['netns', 'exec', ns, 'ip', 'link', 'set', 'lo', 'up'],
  ];
  const remove = () => {
    ip(['link', 'del', hostIf]);
    ip(['netns', 'del', ns]);
  };
  for (const s of steps) {
    const r = ip(s);
    if (!r.ok) {
      remove();
      throw new Error(`ip ${s.join(' ')} failed: ${r.out}`);
    }
  }
  return {
    ns,
    hostAddress,
    nsAddress,
    exec: ['ip', 'netns', 'exec', ns],
    cut: () => {
      const r = ip(['netns', 'exec', ns, 'ip', 'link', 'set', nsIf, 'down']);
      if (!r.ok) throw new Error(`could not take the link down: ${r.out}`);
    },
    remove,
  };
}

/**
 * A PostgreSQL of the test's own (the embedded binaries, in a temp dir) that also listens on the
 * host side of each namespaced host's veth pair, and lets those hosts in. `url` reaches it on
 * loopback; `urlFor(host)` is the URL a process inside that host uses.
 */
export async function startServerForHosts(hosts: readonly NamespacedHost[], database: string): Promise<{ url: string; urlFor(host: NamespacedHost): string; stop(): Promise<void> }> {
  const { promises: fs } = await import('node:fs');
  const os = await import('node:os');
  const path = await import('node:path');
  const { startEmbeddedPostgres } = await import('../../src/embedded-postgres.ts');
  const { chownToPostgres } = await import('./global-setup.ts');
  const { query } = await import('./cli.ts');
  const dir = await fs.mkdtemp(path.join(os.tmpdir(), 'idem-netns-'));
  await chownToPostgres(dir);
  const dataDir = path.join(dir, 'pg');
  const first = await startEmbeddedPostgres({ dataDir });
  await query(first.url, `alter system set listen_addresses = '${['127.0.0.1', ...hosts.map((h) => h.hostAddress)].join(',')}'`);
  await fs.appendFile(path.join(dataDir, 'pg_hba.conf'), hosts.map((h) => `\nhost all all ${h.nsAddress}/32 scram-sha-256\n`).join(''));
  await first.stop();
  const server = await startEmbeddedPostgres({ dataDir });
  await query(server.url, `create database ${database}`);
  const u = new URL(server.url);
  u.pathname = `/${database}`;
  const url = u.toString();
  return {
    url,
    urlFor: (host) => {
      const v = new URL(url);
      v.hostname = host.hostAddress;
      return v.toString();
    },
    stop: async () => {
      await server.stop();
      await fs.rm(dir, { recursive: true, force: true });
    },
  };
}
