// `npm run bench` loads TypeScript through tsx, with test/bench/tsconfig.json: without the root
// config's `paths`, 'idem' resolves through package.json's exports to dist/, the built package.
// Under the root config tsx resolved it to src/ (esbuild's keepNames helpers and all), so the
// benchmarks measured code no user runs.
import { fileURLToPath } from 'node:url';

process.env.TSX_TSCONFIG_PATH ??= fileURLToPath(new URL('./tsconfig.json', import.meta.url));
await import('tsx');
