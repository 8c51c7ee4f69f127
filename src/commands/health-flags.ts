import type { Command } from 'commander';
import type { HealthSetting } from '../health-check.ts';

/** The health flags of every command that runs chunks, as commander hands them over. */
export interface HealthFlags {
  /** Raw `--health name=value` words, parsed (and checked) when the command runs. */
  health?: string[];
  healthCheck?: boolean;
}

/**
 * Adds `--health` and `--no-health-check`. The values are parsed inside the action, so that
 * `--help` does not load the health checks (and kysely with them).
 */
export function withHealthFlags(cmd: Command): Command {
  return cmd
    .option('--health <name=value>', 'change a health-check threshold or turn it off (e.g. transactionAgeSeconds=600, lockWaitMs=off); repeatable', (v: string, prev: string[] | undefined) => [...(prev ?? []), v])
    .option('--no-health-check', 'do not wait for the database to be healthy before each chunk');
}

/** What the flags ask of the runner: nothing, off, or changed thresholds. Throws a UsageError on a bad value. */
export async function healthSetting(o: HealthFlags): Promise<{ health?: HealthSetting }> {
  if (o.healthCheck === false) return { health: false };
  if (!o.health || o.health.length === 0) return {};
  const { parseHealthFlag } = await import('../cli-runtime.ts');
  let options = {};
  for (const v of o.health) options = parseHealthFlag(v, options);
  return Object.keys(options).length > 0 ? { health: options } : {};
}
