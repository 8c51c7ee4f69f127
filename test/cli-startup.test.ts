import { describe, expect, it } from 'vitest';
import { CLI_DEFAULT_SCHEMA } from '../src/cli.ts';
import { DEFAULT_SCHEMA } from '../src/runner.ts';

describe('CLI start-up', () => {
  it("repeats the runner's default schema (kept apart so --help need not load the runner)", () => {
    expect(CLI_DEFAULT_SCHEMA).toBe(DEFAULT_SCHEMA);
  });
});
