import { createHash } from 'node:crypto';
import { mkdir, readFile, rename, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { pathToFileURL } from 'node:url';
import type { Plugin } from 'esbuild';

/**
 * Bumped whenever the compile options or the manifest change, so copies built by an older idem
 * are rebuilt: 2 keeps `idem` an import where 1 could bundle a copy of it; 3 records each input's
 * content hash, where 2 trusted mtime and size alone; 4 gives each module its source's
 * `import.meta.url`, where 3 left the compiled copy's; 5 hashes the bytes compiled, where 4 read
 * each input again after the build.
 */
const MANIFEST_VERSION = 5;

/**
 * What a compiled file was built from: each input's path and the sha256 of its content, to know
 * when it is stale. Not mtime and size: `cp -p`, `rsync -a`, tar and Nix keep or normalise mtimes,
 * so a changed file of the same size looked unchanged and the old code ran.
 */
interface Manifest {
  readonly version: typeof MANIFEST_VERSION;
  readonly inputs: ReadonlyArray<readonly [file: string, sha256: string]>;
}

async function contentHash(file: string): Promise<string> {
  return createHash('sha256').update(await readFile(file)).digest('hex');
}

/**
 * Compiles an ES-module TypeScript job file to one plain JavaScript module under `cacheDir` and
 * returns its path; the next start finds it fresh (every input's content unchanged: a hash of a
 * job and its relative imports, a few files) and imports it without compiling anything.
 *
 * Why not tsx's loader hook: on Node 20 a loader hook runs in a thread of its own and every
 * module loaded after it crosses to that thread and back, so a no-op `idem run` spent a second
 * (10× `node -e 0`) loading one job. esbuild (which tsx itself uses) bundles the job with its
 * relative imports in one call; packages stay imports, resolved as the job file would resolve
 * them because the cache sits in the job's own package (`<package>/.idem/cache/`).
 */
export async function compileTypeScriptModule(file: string, cacheDir: string): Promise<string> {
  // One compiled copy per Node major: it is compiled for that Node (`target`), and a project may
  // be run by several (nvm, a CI matrix) without one's copy lacking syntax lowering the other needs.
  const target = `node${process.versions.node.split('.')[0]}`;
  const id = createHash('sha256').update(`${file}\0${target}`).digest('hex').slice(0, 12);
  const out = path.join(cacheDir, `${path.basename(file).replace(/\.[cm]?ts$/, '')}-${id}.mjs`);
  const manifestFile = `${out}.json`;
  if (await isFresh(manifestFile)) return out;
  const { build } = await import('esbuild');
  const loaded = new Map<string, string>();
  const result = await build({
    entryPoints: [file],
    bundle: true,
    packages: 'external',
    // idem itself stays an import even where a tsconfig maps 'idem' to its sources (this
    // repository does, for type-checking): bundled, each job file carried its own copy of the
    // runner (~350 kB, with kysely loaded unbundled), 200 ms of start-up and a second set of
    // classes next to the CLI's.
    external: ['idem', 'idem/*'],
    format: 'esm',
    platform: 'node',
    target,
    write: false,
    metafile: true,
    outfile: out,
    // Stack traces of job errors point at the TypeScript source (see enableSourceMaps below).
    sourcemap: 'inline',
    logLevel: 'silent',
    absWorkingDir: path.dirname(file),
    plugins: [loadHashed(loaded)],
  }).catch((err: { errors?: Array<{ text: string; location: { file: string; line: number; column: number } | null }> }) => {
    // Worded as tsx's TransformError (an absolute path, then ERROR:), which load-error.ts
    // explains with the source line: the same message whichever way the file was compiled.
    const first = err.errors?.[0];
    if (!first) throw err;
    // A relative import esbuild cannot find: worded as Node's own, so it is explained the same way.
    const unresolved = /^Could not resolve "(\.{1,2}\/[^"]+)"/.exec(first.text);
    if (unresolved && first.location) {
      const importer = path.resolve(path.dirname(file), first.location.file);
      const e = new Error(`Cannot find module '${path.resolve(path.dirname(importer), unresolved[1]!)}' imported from ${importer}`, { cause: err });
      (e as Error & { code?: string }).code = 'ERR_MODULE_NOT_FOUND';
      throw e;
    }
    const where = first.location ? `${path.resolve(path.dirname(file), first.location.file)}:${first.location.line}:${first.location.column}: ` : '';
    const e = new Error(`Transform failed with 1 error:\n${where}ERROR: ${first.text}`, { cause: err });
    e.name = 'TransformError';
    throw e;
  });
  // The hash of the bytes esbuild compiled, not of the file read again now: an edit that lands
  // meanwhile (an editor saving, a deploy copying) would be recorded as compiled, and every later
  // start would run the old code as fresh. Such an edit is found stale at the next start instead.
  const inputs = await Promise.all(
    Object.keys(result.metafile.inputs).map(async (rel) => {
      const abs = path.resolve(path.dirname(file), rel);
      return [abs, loaded.get(abs) ?? (await contentHash(abs))] as const;
    }),
  );
  await mkdir(cacheDir, { recursive: true });
  // Several processes may compile at once: each writes its own temp file and renames it over.
  const tmp = `${out}.${process.pid}.tmp`;
  await writeFile(tmp, result.outputFiles[0]!.contents);
  await rename(tmp, out);
  await writeFile(`${manifestFile}.${process.pid}.tmp`, JSON.stringify({ version: MANIFEST_VERSION, inputs } satisfies Manifest));
  await rename(`${manifestFile}.${process.pid}.tmp`, manifestFile);
  return out;
}

const IMPORT_META = /\bimport\.meta\.(url|dirname|filename)\b/g;

/**
 * Loads every input of the bundle itself, so that `hashes` records the sha256 of the very bytes
 * compiled (by absolute path). And `import.meta.url`, `.dirname` and `.filename` of each bundled
 * source file as that file's own: run from the cache, they named the compiled copy under
 * .idem/cache/, so a job reading a file next to it (`new URL('./query.sql', import.meta.url)`)
 * failed under the CLI, where Node running the file as it is (vitest, tsx) found it. Each module of
 * the bundle gets its own, written in as literals.
 */
const loadHashed = (hashes: Map<string, string>): Plugin => ({
  name: 'idem-load-hashed',
  setup(build) {
    build.onLoad({ filter: /.*/, namespace: 'file' }, async (args) => {
      const bytes = await readFile(args.path);
      hashes.set(args.path, createHash('sha256').update(bytes).digest('hex'));
      if (!/\.[cm]?[jt]sx?$/.test(args.path)) return { contents: bytes, loader: 'default' };
      const text = bytes.toString('utf8');
      if (!text.includes('import.meta')) return { contents: bytes, loader: 'default' };
      const own: Record<string, string> = { url: pathToFileURL(args.path).href, dirname: path.dirname(args.path), filename: args.path };
      return { contents: text.replace(IMPORT_META, (_, name: string) => JSON.stringify(own[name])), loader: 'default' };
    });
  },
});

async function isFresh(manifestFile: string): Promise<boolean> {
  let manifest: Manifest;
  try {
    manifest = JSON.parse(await readFile(manifestFile, 'utf8')) as Manifest;
  } catch {
    return false;
  }
  if (manifest.version !== MANIFEST_VERSION) return false;
  const checks = await Promise.all(
    manifest.inputs.map(async ([file, sha256]) => {
      try {
        return (await contentHash(file)) === sha256;
      } catch {
        return false;
      }
    }),
  );
  return checks.every(Boolean);
}
