/**
 * The job files loader.ts is importing now, each with the words for a `process.exit()` its code
 * calls meanwhile (`if (!process.env.X) process.exit(0)` at its top level): cli-session.ts's guard
 * reports that as the bad job file it is (exit 2, the file named), not as job code that ended a run.
 * A module of its own so that the guard, installed for every command, need not load the loader.
 */
export const jobFilesLoading = new Map<string, (code: number, stack: string) => string>();

/** What a `process.exit(code)` called now means, when a job file is loading: the one it came from (by the stack), else the last one started. */
export function jobFileExit(code: number, stack: string): string | undefined {
  let last: ((code: number, stack: string) => string) | undefined;
  for (const [file, describe] of jobFilesLoading) {
    if (stack.includes(file)) return describe(code, stack);
    last = describe;
  }
  return last?.(code, stack);
}
