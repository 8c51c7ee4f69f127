// Builds the published package into an empty dist/ (so a deleted source never lingers):
// - dist/cli.js, dist/index.js (+ shared chunks): ESM, bundled by esbuild with kysely and
//   commander inlined (pino too, as its own CommonJS file: see dist/pino.cjs below). kysely ships ~900 small modules; loading them one by one cost a CLI start
//   200–400 ms, one bundled file costs ~20 ms. pino (~25 CommonJS files) and commander (7) cost
//   ~30 and ~20 ms loaded from node_modules, ~20 and ~12 ms bundled: every `idem` command pays
//   commander, every one that works pays pino. Every other dependency stays external (installed,
//   deduplicated): pg above all, whose type parsers a job may set for idem's queries too.
//   Code splitting keeps one copy of each idem module across the entries and keeps the CLI's
//   lazy import()s lazy.
// - dist/cjs/job-api.js: the job-authoring API as CommonJS, for require('idem') (see job-api.ts).
// - dist/pino.cjs: pino, required when the first log line is written (see src/log.ts).
// - .d.ts next to them, by tsc (declarations only; the types refer to kysely's own).
import { spawn } from 'node:child_process';
import { mkdir, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';
import { build } from 'esbuild';

const root = fileURLToPath(new URL('..', import.meta.url));
const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');
const pkg = JSON.parse(await readFile(new URL('../package.json', import.meta.url), 'utf8'));
const BUNDLED = ['kysely', 'pino', 'commander'];
const external = Object.keys(pkg.dependencies).filter((name) => !BUNDLED.includes(name));
// CommonJS bundled into ES modules (pino, commander) require() Node's built-ins: give each output
// file a require of its own.
const requireBanner = "import { createRequire as __idemCreateRequire } from 'node:module';\nconst require = __idemCreateRequire(import.meta.url);";

// pg is CommonJS. Imported as ESM (`import pg from 'pg'`, its esm/index.mjs wrapper), Node runs its
// CommonJS export lexer on pg's entry, which first compiles the lexer itself: ~6 ms of CPU at every
// start that connects. So idem's ESM bundles take pg through require(). It is the same module
// instance a job's `import pg from 'pg'` gets (the wrapper re-exports lib/index.js's exports), so a
// job's pg.types settings still reach idem's queries.
const pgThroughRequire = {
  name: 'pg-through-require',
  setup(b) {
    b.onResolve({ filter: /^pg$/ }, (args) => (args.namespace === 'pg-through-require' ? { path: 'pg', external: true } : { path: 'pg', namespace: 'pg-through-require' }));
    b.onLoad({ filter: /.*/, namespace: 'pg-through-require' }, () => ({ contents: "module.exports = require('pg');", loader: 'js', resolveDir: root }));
  },
};

// commander requires node:child_process at its top, for executable subcommands (it spawns them),
// which idem has none of; loading child_process (with dgram, which it loads) costs every command,
// --help included, ~4 ms of CPU. Commander gets it on first use instead.
const lazyChildProcessForCommander = {
  name: 'lazy-child-process-for-commander',
  setup(b) {
    b.onResolve({ filter: /^node:child_process$/ }, (args) => (/[\\/]node_modules[\\/]commander[\\/]/.test(args.importer) ? { path: 'child_process', namespace: 'lazy-child-process' } : undefined));
    b.onLoad({ filter: /.*/, namespace: 'lazy-child-process' }, () => ({
      contents: "let cp;\nmodule.exports = new Proxy({}, { get: (_, name) => (cp ??= require('child_process'))[name] });",
      loader: 'js',
      resolveDir: root,
    }));
  },
};

const declarations = (project) =>
  new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [tsc, '-p', project], { cwd: root, stdio: 'inherit' });
    child.on('error', reject);
    child.on('close', (code) => (code === 0 ? resolve() : reject(new Error(`tsc -p ${project} exited ${code}`))));
  });

const common = { absWorkingDir: root, bundle: true, platform: 'node', target: 'node20', external, logLevel: 'warning', legalComments: 'none' };

await rm(new URL('../dist', import.meta.url), { recursive: true, force: true });
await Promise.all([
  declarations('tsconfig.build.json'),
  declarations('tsconfig.cjs.json'),
  build({ ...common, entryPoints: { cli: 'src/cli.ts', index: 'src/index.ts', testing: 'src/testing.ts' }, format: 'esm', splitting: true, plugins: [pgThroughRequire, lazyChildProcessForCommander], define: { __IDEM_VERSION__: JSON.stringify(pkg.version), __IDEM_BUNDLED__: 'true' }, banner: { js: requireBanner }, outdir: 'dist', chunkNames: 'chunks/[name]-[hash]' }),
  build({ ...common, entryPoints: { 'job-api': 'src/job-api.ts' }, format: 'cjs', outdir: 'dist/cjs' }),
  // pino on its own, as CommonJS, required by src/log.ts (as #idem-pino, package.json "imports")
  // when a logger is first needed: in the ES modules it was compiled at every start (~4 ms).
  build({ ...common, stdin: { contents: "module.exports = require('pino');", resolveDir: root, sourcefile: 'idem-pino.cjs' }, format: 'cjs', outfile: 'dist/pino.cjs' }),
]);
await mkdir(new URL('../dist/cjs', import.meta.url), { recursive: true });
// The package is "type": "module"; this marks the .js files under dist/cjs/ as CommonJS.
await writeFile(new URL('../dist/cjs/package.json', import.meta.url), '{ "type": "commonjs" }\n');
// idem/testing is ESM, but a CommonJS TypeScript project type-checks its imports as CommonJS: there
// `idem` is dist/cjs/job-api.d.ts. So the kit's declarations are also given as CommonJS ones (the
// `require` condition of "./testing", types only), next to the job API's: the same text, its
// relative imports resolved in dist/cjs/.
const testingDts = await readFile(new URL('../dist/testing.d.ts', import.meta.url), 'utf8');
for (const [, spec] of testingDts.matchAll(/from '(\.[^']+)'/g)) {
  const target = new URL(`../dist/cjs/${spec.replace(/\.ts$/, '.d.ts')}`, import.meta.url);
  await readFile(target).catch(() => {
    throw new Error(`dist/testing.d.ts imports ${spec}, which the CommonJS declarations (dist/cjs/) lack: add it to tsconfig.cjs.json or keep the kit's types to the job API`);
  });
}
await writeFile(new URL('../dist/cjs/testing.d.ts', import.meta.url), testingDts);

// kysely ships CommonJS and ESM declarations, and TypeScript takes them for two sets of classes
// (Transaction has a #private member): a job made by require('idem')'s defineJob, its ctx.db typed
// from kysely's CommonJS declarations, was refused by the Runner of import('idem') (ESM), the way a
// CommonJS program embeds the runner. So the CommonJS declarations take kysely's types from its ESM
// declarations too (`resolution-mode: import`, TypeScript 5.3+): one Kysely, whichever entry.
// `sql`, a value, is declared with kysely's ESM type of it.
const KYSELY_IMPORT = /^(import|export)( type)? \{([^}]*)\} from 'kysely';$/gm;
for (const file of (await readdir(new URL('../dist/cjs/', import.meta.url))).filter((f) => f.endsWith('.d.ts'))) {
  const url = new URL(`../dist/cjs/${file}`, import.meta.url);
  const text = await readFile(url, 'utf8');
  const rewritten = text.replace(KYSELY_IMPORT, (line, kind, typeOnly, list) => {
    const names = list.split(',').map((n) => n.trim()).filter(Boolean);
    const types = names.filter((n) => typeOnly || n.startsWith('type ')).map((n) => n.replace(/^type /, ''));
    const values = names.filter((n) => !typeOnly && !n.startsWith('type '));
    if (values.some((v) => v !== 'sql')) throw new Error(`dist/cjs/${file}: ${line} imports a value of kysely other than sql; declare its type in scripts/build.mjs`);
    if (kind === 'export' && types.length > 0) throw new Error(`dist/cjs/${file}: ${line} re-exports kysely's types; extend scripts/build.mjs`);
    const imported = [...types, ...(values.length > 0 ? ['Sql as KyselySql'] : [])];
    const lines = [`import type { ${imported.join(', ')} } from 'kysely' with { 'resolution-mode': 'import' };`];
    if (values.length > 0) lines.push(`${kind === 'export' ? 'export ' : ''}declare const sql: KyselySql;`);
    return lines.join('\n');
  });
  if (/from 'kysely'(?! with)/.test(rewritten)) throw new Error(`dist/cjs/${file}: an import of kysely that scripts/build.mjs does not rewrite`);
  if (rewritten !== text) await writeFile(url, rewritten);
}
