// Fetches Node.js 22 and 24 binaries for the tests that run the installed package under every
// supported Node (test/package.test.ts), into .test-nodes/<major>/bin/node. They come from the npm
// registry (the node-linux-<arch> packages the `node` package installs), so no other network is
// needed. Already fetched majors are kept. Prints one line per major; never fails the caller: a
// machine that cannot fetch them runs the rest of the suite, and those tests say they were skipped.
//
//   node scripts/fetch-test-nodes.mjs [major ...]     (default: 22 24)
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, rename, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

const exec = promisify(execFile);
const root = fileURLToPath(new URL('..', import.meta.url));
const dest = path.join(root, '.test-nodes');
const majors = process.argv.slice(2).length > 0 ? process.argv.slice(2) : ['22', '24'];

if (process.platform !== 'linux' || !['x64', 'arm64'].includes(process.arch)) {
  console.log(`fetch-test-nodes: no node-${process.platform}-${process.arch} package to fetch; the tests under other Node versions are skipped`);
  process.exit(0);
}

await mkdir(dest, { recursive: true });
for (const major of majors) {
  const target = path.join(dest, major);
  const bin = path.join(target, 'bin', 'node');
  if (existsSync(bin)) {
    console.log(`fetch-test-nodes: Node ${(await exec(bin, ['--version'])).stdout.trim()} already in ${target}`);
    continue;
  }
  const tmp = await mkdtemp(path.join(os.tmpdir(), 'idem-test-node-'));
  try {
    const spec = `node-linux-${process.arch}@${major}`;
    const { stdout } = await exec('npm', ['pack', spec, '--json', '--pack-destination', tmp], { cwd: tmp, maxBuffer: 64 * 1024 * 1024, timeout: 600_000 });
    const [info] = JSON.parse(stdout);
    await exec('tar', ['xzf', path.join(tmp, info.filename), '-C', tmp], { timeout: 300_000 });
    // Only the binary is used (npm stays the system's): ~120 MB instead of ~190.
    await rm(target, { recursive: true, force: true });
    await mkdir(path.join(target, 'bin'), { recursive: true });
    await rename(path.join(tmp, 'package', 'bin', 'node'), bin);
    console.log(`fetch-test-nodes: Node ${(await exec(bin, ['--version'])).stdout.trim()} in ${target}`);
  } catch (err) {
    console.log(`fetch-test-nodes: could not fetch Node ${major} (${String(err.message).split('\n')[0]}); the tests under it are skipped`);
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
}
