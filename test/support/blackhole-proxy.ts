import net from 'node:net';

export interface BlackholeProxy {
  /** Port on 127.0.0.1 that forwards to the upstream server. */
  readonly port: number;
  /** From now on no byte is forwarded, either way; every socket stays open (a network that vanished). */
  cut(): void;
  close(): Promise<void>;
}

/**
 * A TCP proxy of the test's own on loopback. Until `cut()`, it forwards both ways; after it, it
 * swallows everything and answers nothing while keeping both sockets open, as a host whose network
 * went away mid-run looks from each side (no FIN, no RST).
 */
export async function startBlackholeProxy(upstreamPort: number, upstreamHost = '127.0.0.1'): Promise<BlackholeProxy> {
  let cut = false;
  const sockets = new Set<net.Socket>();
  const server = net.createServer((client) => {
    const upstream = net.connect(upstreamPort, upstreamHost);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on('error', () => {});
      s.on('close', () => sockets.delete(s));
    }
    client.on('data', (d) => {
      if (!cut) upstream.write(d);
    });
    upstream.on('data', (d) => {
      if (!cut) client.write(d);
    });
    // Before the cut, an end on one side ends the other; after it, nothing is passed on.
    client.on('end', () => !cut && upstream.end());
    upstream.on('end', () => !cut && client.end());
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    port: (server.address() as net.AddressInfo).port,
    cut: () => {
      cut = true;
    },
    close: async () => {
      for (const s of sockets) s.destroy();
      await new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}
