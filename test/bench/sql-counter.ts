import pg from 'pg';
import { JOB_TAG } from './backfill-job.ts';

/** Who issued a statement: transaction control, the job's own work, or the runner. */
export type StatementKind = 'tx' | 'job' | 'runner';

export interface StatementCounts {
  /** Statements: a multi-statement simple query (`update …; commit`) counts each of its statements. */
  readonly total: number;
  /** Messages sent to the server (calls to query), i.e. network round trips. */
  readonly roundTrips: number;
  readonly byKind: Readonly<Record<StatementKind, number>>;
  /** Runner statements by shape (whitespace collapsed, cut to 90 chars), most frequent first. */
  readonly runnerShapes: ReadonlyArray<{ readonly shape: string; readonly count: number }>;
}

export function classify(text: string): StatementKind {
  if (/^\s*(begin|start transaction|commit|rollback|end|savepoint|release)\b/i.test(text)) return 'tx';
  if (text.includes(JOB_TAG)) return 'job';
  return 'runner';
}

export const shapeOf = (text: string) => text.replace(/\s+/g, ' ').trim().slice(0, 90);

type Query = typeof pg.Client.prototype.query;
let original: Query | undefined;
let active: Map<string, number> | undefined;

/**
 * Counts every statement sent by any pg.Client in this process while `fn` runs: pool clients
 * (Kysely's work pool) and the advisory-lock session alike, since all of them are pg.Client and
 * every statement goes through Client.prototype.query. Counting costs a Map update per statement.
 */
export async function countStatements<R>(fn: () => Promise<R>): Promise<{ result: R; counts: StatementCounts }> {
  if (active) throw new Error('countStatements() does not nest');
  original ??= pg.Client.prototype.query;
  const orig = original;
  const seen = new Map<string, number>();
  active = seen;
  pg.Client.prototype.query = function (this: pg.Client, ...args: unknown[]) {
    const first = args[0] as string | { text?: string } | undefined;
    const text = typeof first === 'string' ? first : first?.text;
    if (active && typeof text === 'string') active.set(text, (active.get(text) ?? 0) + 1);
    return (orig as (...a: unknown[]) => unknown).apply(this, args);
  } as Query;
  try {
    const result = await fn();
    return { result, counts: summarize(seen) };
  } finally {
    pg.Client.prototype.query = orig;
    active = undefined;
  }
}

export function summarize(seen: ReadonlyMap<string, number>): StatementCounts {
  const byKind: Record<StatementKind, number> = { tx: 0, job: 0, runner: 0 };
  const shapes = new Map<string, number>();
  let total = 0;
  let roundTrips = 0;
  for (const [text, n] of seen) {
    roundTrips += n;
    for (const part of splitStatements(text)) {
      total += n;
      const kind = classify(part);
      byKind[kind] += n;
      if (kind === 'runner') shapes.set(shapeOf(part), (shapes.get(shapeOf(part)) ?? 0) + n);
    }
  }
  const runnerShapes = [...shapes].map(([shape, count]) => ({ shape, count })).sort((a, b) => b.count - a.count);
  return { total, roundTrips, byKind, runnerShapes };
}

/**
 * Splits a simple-protocol query text into its statements at top-level semicolons (not inside
 * quotes, dollar quotes or comments), so `update …; commit` counts as two statements.
 */
export function splitStatements(text: string): string[] {
  const parts: string[] = [];
  let start = 0;
  let i = 0;
  while (i < text.length) {
    const ch = text[i]!;
    const rest = text.slice(i);
    if (ch === "'" || ch === '"') {
      const end = text.indexOf(ch, i + 1);
      i = end < 0 ? text.length : end + 1;
    } else if (rest.startsWith('--')) {
      const end = text.indexOf('\n', i);
      i = end < 0 ? text.length : end + 1;
    } else if (rest.startsWith('/*')) {
      const end = text.indexOf('*/', i + 2);
      i = end < 0 ? text.length : end + 2;
    } else if (ch === '$' && /^\$[A-Za-z_]*\$/.test(rest)) {
      const tag = /^\$[A-Za-z_]*\$/.exec(rest)![0];
      const end = text.indexOf(tag, i + tag.length);
      i = end < 0 ? text.length : end + tag.length;
    } else if (ch === ';') {
      parts.push(text.slice(start, i));
      start = ++i;
    } else {
      i++;
    }
  }
  parts.push(text.slice(start));
  return parts.map((p) => p.trim()).filter((p) => p.length > 0);
}
