/**
 * Imports pg before anything else does, without its Cloudflare probe. At load, pg asks whether it
 * runs in a Cloudflare Worker: through `navigator.userAgent` where `navigator` exists (Node 21+),
 * else by constructing a fetch `Response`, which on Node 20 loads undici: ~25 ms of a ~250 ms
 * no-op `idem run`. A `navigator` with Node's own user agent is defined for the import only and
 * removed again, so job code sees Node 20 as it is. Later imports of pg (the runner's, a job's)
 * get the loaded module.
 */
export async function preloadPg(): Promise<void> {
  if ('navigator' in globalThis) {
    await import('pg');
    return;
  }
  Object.defineProperty(globalThis, 'navigator', { value: { userAgent: `Node.js/${process.versions.node.split('.')[0]}` }, configurable: true, writable: true });
  try {
    await import('pg');
  } finally {
    delete (globalThis as { navigator?: unknown }).navigator;
  }
}
