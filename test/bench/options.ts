import { parseArgs } from 'node:util';

/** Every benchmark `--only` can name, in the order they run. */
export const BENCHMARKS = ['overhead', 'cpu', 'queue', 'startup', 'noop', 'resume', 'statements', 'memory', 'parallel', 'workers', 'http'] as const;
export type BenchName = (typeof BENCHMARKS)[number];

export interface BenchOptions {
  /** Rows of the backfill table. Defaults to `1_000_000`. */
  readonly rows: number;
  /** Alternation rounds per comparison (A B A B …). Defaults to `3`. */
  readonly rounds: number;
  /** Also measure memory on 10 M rows (slow). Defaults to `false`. */
  readonly big: boolean;
  /** Benchmarks to run. Defaults to all of them. */
  readonly only: readonly BenchName[];
  /** Where the results go. Defaults to `bench-results.json`. */
  readonly out: string;
}

export const USAGE = `usage: npm run bench -- [--rows N] [--rounds N] [--big] [--only ${BENCHMARKS.join(',')}] [--out FILE]
  --rows    rows of the backfill table (default 1000000; 1e6, 1M, 1_000_000 all work)
  --rounds  alternation rounds per comparison, at least 3 (default 3)
  --big     also measure peak memory on 10 M rows (takes several minutes)
  --only    comma-separated benchmarks to run (default: all); startup brings resume with it
            (the start-up goals and the resume-after-kill figure they serve are reported together)
  --out     results file (default bench-results.json)
Uses DATABASE_URL when set (a fresh database is created in it and dropped after), else an embedded PostgreSQL in a temp dir.`;

/** Parses the command line; every problem is reported at once, as one error. */
export function parseOptions(argv: readonly string[]): BenchOptions | 'help' {
  const { values } = parseArgs({
    args: [...argv],
    options: {
      rows: { type: 'string' },
      rounds: { type: 'string' },
      big: { type: 'boolean', default: false },
      only: { type: 'string', multiple: true },
      out: { type: 'string' },
      help: { type: 'boolean', short: 'h', default: false },
    },
    strict: true,
    allowPositionals: false,
  });
  if (values.help) return 'help';
  const problems: string[] = [];
  const rows = parseCount(values.rows ?? '1000000');
  if (rows === undefined || rows < 1000) problems.push(`--rows must be an integer >= 1000 (got "${values.rows}")`);
  const rounds = Number(values.rounds ?? '3');
  if (!Number.isInteger(rounds) || rounds < 3) problems.push(`--rounds must be an integer >= 3 (got "${values.rounds}")`);
  const only = (values.only ?? []).flatMap((v) => v.split(',')).map((s) => s.trim()).filter(Boolean);
  for (const name of only) if (!(BENCHMARKS as readonly string[]).includes(name)) problems.push(`--only: unknown benchmark "${name}" (known: ${BENCHMARKS.join(', ')})`);
  if (problems.length) throw new Error(`${problems.join('; ')}\n${USAGE}`);
  return {
    rows: rows!,
    rounds,
    big: values.big ?? false,
    only: only.length ? BENCHMARKS.filter((b) => only.includes(b) || (b === 'resume' && only.includes('startup'))) : [...BENCHMARKS],
    out: values.out ?? 'bench-results.json',
  };
}

/** `1000000`, `1_000_000`, `1e6`, `1M`, `300k`. */
function parseCount(text: string): number | undefined {
  const m = /^([0-9][0-9_]*(?:\.[0-9]+)?(?:e[0-9]+)?)([kKmM]?)$/.exec(text.trim());
  if (!m) return undefined;
  const n = Number(m[1]!.replace(/_/g, '')) * (m[2] === '' ? 1 : /k/i.test(m[2]!) ? 1e3 : 1e6);
  return Number.isSafeInteger(n) ? n : undefined;
}
