// Builds the published package: dist/ (ESM + .d.ts, the CLI and the whole API) and dist/cjs/
// (CommonJS + .d.ts, the job-authoring API for require('idem')). Starts from an empty dist/ so a
// deleted source file never lingers in the tarball. The two compiles run side by side.
import { spawn } from 'node:child_process';
import { mkdir, rm, writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const root = fileURLToPath(new URL('..', import.meta.url));
const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');

const compile = (project) =>
  new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [tsc, '-p', project], { cwd: root, stdio: 'inherit' });
    child.on('error', reject);
    child.on('close', (code) => (code === 0 ? resolve() : reject(new Error(`tsc -p ${project} exited ${code}`))));
  });

await rm(new URL('../dist', import.meta.url), { recursive: true, force: true });
await Promise.all([compile('tsconfig.build.json'), compile('tsconfig.cjs.json')]);
await mkdir(new URL('../dist/cjs', import.meta.url), { recursive: true });
// The package is "type": "module"; this marks the .js files under dist/cjs/ as CommonJS.
await writeFile(new URL('../dist/cjs/package.json', import.meta.url), '{ "type": "commonjs" }\n');
