#!/usr/bin/env node
/**
 * Writes test/support/durations.json, the seconds each test file took, from a vitest JSON report:
 *   npx vitest run --reporter=json --outputFile.json=/tmp/report.json; node scripts/test-durations.mjs /tmp/report.json
 * test/support/sequencer.ts starts the longest files first from it (see there why).
 */
import { readFileSync, writeFileSync } from 'node:fs';
import path from 'node:path';

const report = process.argv[2];
if (!report) {
  console.error('usage: node scripts/test-durations.mjs <vitest JSON report>');
  process.exit(2);
}
const root = path.resolve(import.meta.dirname, '..');
const { testResults } = JSON.parse(readFileSync(report, 'utf8'));
const table = Object.fromEntries(
  testResults
    .map((f) => [path.relative(root, f.name), Math.round((f.endTime - f.startTime) / 100) / 10])
    .sort((a, b) => b[1] - a[1]),
);
writeFileSync(path.join(root, 'test/support/durations.json'), `${JSON.stringify(table, null, 2)}\n`);
console.log(`test/support/durations.json: ${Object.keys(table).length} files`);
