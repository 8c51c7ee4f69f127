#!/usr/bin/env node
// Job and migration files are TypeScript: tsx's loader compiles them (and idem's own sources) on
// import, so there is no build step between editing a job and running it.
import { register } from 'tsx/esm/api';

register();
const { main } = await import('../src/cli.ts');
await main(process.argv);
