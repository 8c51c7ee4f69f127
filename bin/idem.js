#!/usr/bin/env node
// The CLI runs compiled JavaScript from dist/: no TypeScript compiler at start-up. TypeScript job
// files are handled later, and only when a folder holds some (see src/loader.ts).
import fs from 'node:fs';
import module from 'node:module';
import os from 'node:os';
import path from 'node:path';
import tty from 'node:tty';

// Node 22.1+ keeps V8's compiled code of idem and its dependencies on disk between runs (a
// faster start for cron and operators); Node 20 has no such cache, and nothing happens. Kept in
// the user's own cache folder, not Node's default under the shared temp folder, where another user
// could plant a directory of compiled code first. NODE_COMPILE_CACHE=dir (Node enables it itself
// then) picks another place, NODE_DISABLE_COMPILE_CACHE=1 turns it off. Never fatal: Node reports a
// folder it cannot use in the return value, and idem runs uncached.
if (module.enableCompileCache && !process.env.NODE_COMPILE_CACHE) {
  const cacheHome = () => {
    const xdg = process.env.XDG_CACHE_HOME;
    if (xdg && path.isAbsolute(xdg)) return xdg;
    try {
      const home = os.homedir();
      return path.isAbsolute(home) ? path.join(home, '.cache') : undefined;
    } catch {
      return undefined; // no home directory (a bare service account): no cache
    }
  };
  const home = cacheHome();
  if (home) module.enableCompileCache(path.join(home, 'idem', 'node-compile-cache'));
}

// A SIGINT, SIGTERM or SIGHUP while idem's own modules load (before a command takes over: see
// src/cli-session.ts, which removes this) ends it as the exit-code table says, with one line,
// not killed by the signal: nothing is open yet to close.
let cli;
/** A signal that came while dist/cli.js loaded, with --json: handled once it has loaded. */
let pendingSignal;
const earlySignal = (sig) => {
  // --json's error object is written by idem's own code (dist/cli.js): a signal while that loads
  // waits for it (the import ends, one way or the other, in a moment).
  if (!cli && process.argv.includes('--json')) {
    pendingSignal ??= sig;
    return;
  }
  // A terminal that hung up (see src/hangup.ts): fds 0-2 on it go to /dev/null first, or Node 20
  // aborts at exit restoring its settings, and the line below is a failed write to nobody.
  if (sig === 'SIGHUP') {
    for (const fd of [0, 1, 2]) {
      try {
        if (!fs.fstatSync(fd).isCharacterDevice() || tty.isatty(fd)) continue;
        fs.closeSync(fd);
        fs.openSync('/dev/null', fd === 0 ? 'r' : 'w');
      } catch {}
    }
  }
  try {
    globalThis[Symbol.for('idem.signalJson')]?.(sig);
  } catch {}
  process.stderr.write(`idem: stopped by ${sig}\n`);
  process.exit(sig === 'SIGINT' ? 130 : sig === 'SIGHUP' ? 129 : 143);
};
globalThis[Symbol.for('idem.earlySignal')] = earlySignal;
for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) process.on(sig, earlySignal);

try {
  cli = await import('../dist/cli.js');
} catch (err) {
  if (err?.code !== 'ERR_MODULE_NOT_FOUND' || !String(err.message).includes('dist/cli.js')) throw err;
  process.stderr.write('idem: error: dist/cli.js is missing: this is a checkout of the repository, build it first with npm run build\n');
  process.exit(2);
}
if (pendingSignal) earlySignal(pendingSignal);
await cli.main(process.argv);
