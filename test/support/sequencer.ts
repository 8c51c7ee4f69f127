/**
 * Starts the longest test files first, from the seconds each took in a recorded run
 * (test/support/durations.json; refresh it with scripts/test-durations.mjs).
 *
 * Why: the suite runs on 2 workers, and vitest's default order on a clean clone (no cache of
 * earlier runs, as in CI) is by file size, which says little about time here: the two network
 * namespace files (a minute each) started last and one worker sat idle for a minute at the end.
 * Longest first leaves only short files for the end. Files the table lacks (new ones) go first,
 * as vitest does with unknown files; a file that failed in this checkout's last run goes before
 * all (vitest's cache, when there is one).
 */
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { BaseSequencer, type TestSpecification } from 'vitest/node';

const durations = JSON.parse(readFileSync(new URL('./durations.json', import.meta.url), 'utf8')) as Record<string, number>;

export class LongestFirstSequencer extends BaseSequencer {
  override async sort(files: TestSpecification[]): Promise<TestSpecification[]> {
    const root = this.ctx.config.root;
    // Each file's rank once, not at every comparison: failed last time, then its recorded seconds.
    const ranked = files.map((f) => {
      const file = path.relative(root, f.moduleId);
      const failed = this.ctx.cache.getFileTestResults(`${f.project.name}:${file}`)?.failed === true;
      return { f, failed: Number(failed), seconds: durations[file.split(path.sep).join('/')] ?? Number.POSITIVE_INFINITY };
    });
    return ranked.sort((a, b) => b.failed - a.failed || b.seconds - a.seconds).map((r) => r.f);
  }
}
