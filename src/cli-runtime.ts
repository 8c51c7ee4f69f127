/**
 * Everything a command that works loads, behind one import: each command imports this module when
 * it runs (never at the top, so `idem --help` loads none of it). One module, not one import per
 * module a command needs, because every such import is an entry point of the bundle and esbuild
 * makes a chunk for each set of entry points that reach a module: ~30 files to resolve, read and
 * link at every start. Through here a no-op rerun loads ~17. Nothing a working command rarely needs
 * belongs here: the TypeScript compiler, the embedded server and the HTTP server stay imports of
 * their own, and pg is loaded first, on its own (see preload-pg.ts).
 */
export * from './log.ts';
export * from './job-lookup.ts';
export * from './database.ts';
export * from './runner.ts';
export * from './health-check.ts';
export * from './schedule.ts';
export * from './loader.ts';
export * from './finalize.ts';
export * from './job.ts';
export * from './job-api.ts';
export * from './operations.ts';
