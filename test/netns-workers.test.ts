import { spawn, type ChildProcess } from 'node:child_process';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createFixtureTables } from './fixtures/tables.ts';
import { BIN, FIXTURE_DIRS, query, REPO, waitFor } from './support/cli.ts';
import { createNamespacedHost, netnsUnavailable, startServerForHosts, type NamespacedHost } from './support/netns.ts';

// Issue 9: two workers on hosts that really are apart (network namespaces of the test's own, each
// linked to this machine by a veth pair) share one run; one host's link goes down mid-run.
const unavailable = netnsUnavailable();
if (unavailable) console.warn(`hosts-apart workers test skipped: ${unavailable}`);

let hosts: NamespacedHost[] = [];
let server: Awaited<ReturnType<typeof startServerForHosts>>;

beforeAll(async () => {
  if (unavailable) return;
  hosts = [createNamespacedHost(), createNamespacedHost()];
  server = await startServerForHosts(hosts, 'workers');
  await createFixtureTables(server.url);
}, 120_000);

afterAll(async () => {
  await server?.stop();
  for (const h of hosts) h.remove();
});

/** `idem run … --join` on a namespaced host; resolves with its exit code. */
function workerOn(host: NamespacedHost, args: string[]): { child: ChildProcess; exit: Promise<number | null>; stderr: () => string } {
  const env: NodeJS.ProcessEnv = { ...process.env, DATABASE_URL: server.urlFor(host) };
  delete env.NODE_OPTIONS;
  const child = spawn(host.exec[0]!, [...host.exec.slice(1), process.execPath, BIN, ...args], { cwd: REPO, env, stdio: ['ignore', 'ignore', 'pipe'] });
  let err = '';
  child.stderr!.on('data', (d: Buffer) => (err += d.toString()));
  return { child, exit: new Promise((resolve) => child.once('exit', (code) => resolve(code))), stderr: () => err };
}

describe.skipIf(unavailable !== null)('workers on hosts apart', () => {
  it('when one host vanishes mid-run, the other finishes the run; the cut worker\'s in-flight chunk is redone exactly once', async () => {
    const chunks = 240;
    const params = JSON.stringify({ chunks, pauseMs: 50, label: 'x', gate: null });
    const args = [...FIXTURE_DIRS, 'run', 'counted', '--params', params, '--key', 'apart', '--join'];
    const [a, b] = hosts.map((h) => workerOn(h, args));
    try {
      // Both hosts have committed chunks: the run is really shared.
      await waitFor(async () => {
        const rows = await query<{ n: number }>(server.url, `select count(distinct pid)::int as n from work_log where run_key = 'apart' and step = 'work'`);
        return (rows[0]?.n ?? 0) >= 2 || undefined;
      }, 'both workers to commit chunks', { timeoutMs: 90_000 });
      hosts[0]!.cut();
      const cutAt = Date.now();
      const bExit = await b!.exit;
      const seconds = (Date.now() - cutAt) / 1000;
      console.log(`hosts apart: the surviving worker finished the run ${seconds.toFixed(1)} s after the other host's link went down`);
      expect({ code: bExit, stderr: b!.stderr().slice(-500) }).toMatchObject({ code: 0 });
      expect(seconds).toBeLessThan(150);
      expect(await query(server.url, `select chunk_key from work_log where run_key = 'apart' and step = 'work' group by chunk_key having count(*) > 1`)).toEqual([]);
      expect(await query(server.url, `select count(distinct chunk_key)::int as n from work_log where run_key = 'apart' and step = 'work'`)).toEqual([{ n: chunks }]);
      expect(await query(server.url, `select status, attempt from idem.runs where run_key = 'apart'`)).toEqual([{ status: 'succeeded', attempt: 1 }]);
      // The cut worker lost its lock and said so.
      expect(await a!.exit).toBe(69);
    } finally {
      a!.child.kill('SIGKILL');
      b!.child.kill('SIGKILL');
    }
  }, 240_000);
});
