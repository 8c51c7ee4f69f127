// Preloaded into an idem CLI child (`node --import ./test/bench/count-preload.mjs bin/idem.js …`)
// to count every statement it sends, as sql-counter.ts does in-process: all pg clients (work pool
// and lock session) go through pg.Client.prototype.query. Plain JS so it loads before tsx does.
// On exit it writes { "<statement text>": count } to $IDEM_BENCH_COUNT_FILE.
import { writeFileSync } from 'node:fs';
import pg from 'pg';

const file = process.env.IDEM_BENCH_COUNT_FILE;
if (file) {
  const seen = new Map();
  const orig = pg.Client.prototype.query;
  pg.Client.prototype.query = function (...args) {
    const first = args[0];
    const text = typeof first === 'string' ? first : first?.text;
    if (typeof text === 'string') seen.set(text, (seen.get(text) ?? 0) + 1);
    return orig.apply(this, args);
  };
  process.on('exit', () => writeFileSync(file, JSON.stringify(Object.fromEntries(seen))));
}
