#!/usr/bin/env node
// The CLI runs compiled JavaScript from dist/: no TypeScript compiler at start-up. tsx is loaded
// later, and only when a job or migration file is TypeScript (see src/loader.ts).
import { main } from '../dist/cli.js';

await main(process.argv);
