#!/usr/bin/env node
// The CLI runs compiled JavaScript from dist/: no TypeScript compiler at start-up. TypeScript job
// files are handled later, and only when a folder holds some (see src/loader.ts).
import module from 'node:module';

// Node 22.1+ keeps V8's compiled code of idem and its dependencies on disk between runs (a
// faster start for cron and operators); Node 20 has no such cache, and nothing happens.
module.enableCompileCache?.();

let cli;
try {
  cli = await import('../dist/cli.js');
} catch (err) {
  if (err?.code !== 'ERR_MODULE_NOT_FOUND' || !String(err.message).includes('dist/cli.js')) throw err;
  process.stderr.write('idem: error: dist/cli.js is missing: this is a checkout of the repository, build it first with npm run build\n');
  process.exit(2);
}
await cli.main(process.argv);
