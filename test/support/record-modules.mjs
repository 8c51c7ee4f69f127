// Preloaded with `node --import` by test/cli-startup.test.ts: writes every module the process
// loads to the file named by IDEM_RECORD_MODULES, one URL or path a line. ES modules (and the
// CommonJS ones they import) through a load hook; CommonJS modules required from CommonJS ones
// from require.cache when the process exits.
import { appendFileSync } from 'node:fs';
import { createRequire, register } from 'node:module';

const file = process.env.IDEM_RECORD_MODULES;
if (file) {
  register('./record-modules-hooks.mjs', import.meta.url, { data: { file } });
  const cache = createRequire(import.meta.url).cache;
  process.on('exit', () => appendFileSync(file, Object.keys(cache).map((p) => `${p}\n`).join('')));
}
