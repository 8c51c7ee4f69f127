import type { Command } from 'commander';
import { runErrorObject } from '../describe-outcome.ts';
import { existingKey, positiveInt } from '../cli-parsers.ts';
import { openRunner, withoutDatabase, type CliContext } from '../cli-session.ts';
import { ExitCode, UsageError } from '../errors.ts';
import type { Runner, RunStatusRow } from '../runner.ts';
import { describeHolder, type LockHolder } from '../lock-holder.ts';
import { keyLabel } from '../key-label.ts';
import { quoteKey } from '../run-key.ts';
import { shellQuote } from '../shell-quote.ts';
import { shownStepState } from '../step-state.ts';
import { columns, fitColumns, padColumns, prepareColumns } from '../display-width.ts';
import { colourful, colours, type Colours } from '../terminal.ts';
import { stringsMapped, textTable, visible, visibleDeep } from '../text-table.ts';

/** "just now", "42 s ago", "3 min ago", "5 h ago", "2 d ago". Pure; exported for tests. */
export function relativeTime(date: Date, now: Date = new Date()): string {
  const s = Math.round((now.getTime() - date.getTime()) / 1000);
  if (s < 5) return 'just now';
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86_400) return `${Math.floor(s / 3600)} h ago`;
  return `${Math.floor(s / 86_400)} d ago`;
}

/** A run state in its colour: green done, cyan running, red failed or crashed, yellow held up. */
export function stateColour(state: string, c: Colours): (s: string) => string {
  if (state === 'succeeded') return c.green;
  if (state === 'running') return c.cyan;
  if (state === 'failed' || state === 'crashed') return c.red;
  if (state === 'paused' || state === 'interrupted') return c.yellow;
  if (state === 'cancelled' || state === 'deleting') return c.gray;
  return (s) => s;
}

function chunksOf(r: RunStatusRow): string {
  return `${r.chunksDone}/${r.fullyPlanned ? r.chunksPlanned : `${Math.max(r.chunksPlanned, r.estimatedChunks ?? 0)}~`}`;
}

/** "1 try", "3 tries": a failed and a skipped chunk say it alike. */
const tries = (n: number) => `${n} ${n === 1 ? 'try' : 'tries'}`;

/**
 * The row with its chunk keys as messages quote them (keyLabel: JSON-quoted when they hold a
 * control character), labelled before the output escapes what is left, as a run's error says it.
 */
function withKeyLabels(r: RunStatusRow): RunStatusRow {
  return {
    ...r,
    error: r.error?.chunk ? { ...r.error, chunk: keyLabel(r.error.chunk) } : r.error,
    skipped: r.skipped.map((k) => ({ ...k, key: keyLabel(k.key) })),
  };
}

function errorOf(r: RunStatusRow, clip: (s: string) => string = (s) => s): string {
  const e = r.error!;
  return `step "${e.step}"${e.chunk ? ` chunk ${e.chunk}` : ''} after ${tries(e.tries)}: ${clip(e.message)}`;
}

/** Characters of an error a row of the table shows; the detail view (`--key`) and `--json` show all. */
const TABLE_ERROR_CHARS = 300;

/** An error cut to TABLE_ERROR_CHARS characters (code points), saying how many more there are and where they are. */
const clipFor = (r: RunStatusRow) => (s: string) => {
  const chars = [...s];
  if (chars.length <= TABLE_ERROR_CHARS) return s;
  return `${chars.slice(0, TABLE_ERROR_CHARS).join('')}… (${(chars.length - TABLE_ERROR_CHARS).toLocaleString('en-US').replace(/,/g, ' ')} more characters: idem status ${shellQuote(r.job)} --key ${shellQuote(r.runKey)} shows all)`;
};

/**
 * `idem status` as an aligned table: one row per run, newest first, with the time since its last
 * change and its state in colour; what a person needs next (who holds it, its rate and ETA, its
 * error, a pending request, skipped chunks) after the columns. Pure; exported for tests.
 */
export function formatStatus(stored: readonly RunStatusRow[], now: Date = new Date(), c: Colours = colours(false)): string {
  if (stored.length === 0) return 'no runs yet';
  // Keys, errors and names come from the database: their control characters are shown escaped.
  const rows = visibleDeep(stored.map(withKeyLabels));
  const header = ['JOB', 'RUN KEY', 'STATE', 'ATTEMPT', 'CHUNKS', 'UPDATED'];
  const table = rows.map((r) => [r.job, shownKey(r.runKey), r.state, String(r.attempt), chunksOf(r), relativeTime(r.updatedAt, now)]);
  const { line } = textTable([header, ...table]);
  const out = [line(header, (_, s) => c.bold(s))];
  rows.forEach((r, n) => {
    const live = r.state === 'running' ? [`held by ${r.holder ?? '?'}`, r.throughput !== null ? `${r.throughput}/s` : '', r.etaSeconds !== null ? `ETA ${r.etaSeconds}s` : '', r.stalledSeconds !== null ? c.yellow(stalledNote(r.stalledSeconds)) : ''].filter(Boolean).join(', ') : '';
    const silent = r.workers.filter((w) => w.silent).length;
    const workers = [r.workers.length > 1 ? `${r.workers.length} workers` : '', silent > 0 ? c.yellow(`${silent} silent (looks dead): idem status ${shellQuote(r.job)} --key ${shellQuote(r.runKey)}`) : ''].filter(Boolean).join('  ');
    const guards = [r.healthPause ? c.yellow(`paused for health: ${r.healthPause.reason}`) : '', r.codeChanges.length ? c.yellow(`code changed (allowed) at attempt ${r.codeChanges.map((x) => x.attempt).join(', ')}`) : ''];
    const clip = clipFor(r);
    const note = r.error ? c.red(`error: ${errorOf(r, clip)}`) : [live, workers, r.requested ? c.yellow(`${r.requested} requested`) : '', ...guards].filter(Boolean).join('  ');
    // Notes start at one column in every row ("just now" and "5 s ago" differ in width).
    out.push(line(table[n]!, (i, s) => (i === 2 ? stateColour(r.state, c)(s) : i === 5 ? c.dim(s) : s), note !== '') + (note ? `  ${note}` : ''));
    for (const k of r.skipped) out.push(c.yellow(`    skipped: step "${k.step}" chunk ${k.key} after ${tries(k.attempts)}: ${clip(k.error ?? '')}`));
  });
  return out.join('\n');
}

/**
 * Jobs whose lock a session holds while none of their runs is running (Runner.jobLockHolders picks
 * them): a process left behind (stopped, or its host gone behind a proxy) keeping every new run of
 * the job busy. One line each, naming the session and the fix. Pure.
 */
export function formatOrphanHolders(holders: ReadonlyArray<LockHolder & { readonly job: string }>, c: Colours = colours(false)): string[] {
  return visibleDeep(holders).map((h) => c.yellow(`job ${quoteKey(h.job)}: no run of it is live, yet its lock is held by ${describeHolder(h)}; new runs of it exit 75 (busy) until that session ends`));
}

/** One step of a run, for the detail view. */
export interface StepDetail {
  readonly name: string;
  readonly status: string;
  readonly done: number;
  readonly planned: number;
  readonly plannedAll: boolean;
  readonly estimated: number | null;
  readonly skipped: number;
}

async function stepDetails(db: Runner['db'], schema: string, runId: string): Promise<StepDetail[]> {
  // kysely's sql through idem's own module, never `import('kysely')`: a dynamic import of the package
  // needs its whole namespace, so the bundle would keep every dialect, plugin and helper of kysely.
  const { sql } = await import('../cli-runtime.ts');
  const s = schema;
  const { rows } = await sql<{ name: string; status: string; planned: number; planned_all: boolean; estimated_chunks: number | null; done: number; skipped: number }>`
    select st.name, st.status, st.planned, st.planned_all, st.estimated_chunks,
      (select count(*) from ${sql.id(s, 'chunks')} c where c.run_id = st.run_id and c.step = st.name and c.done_at is not null)::int as done,
      (select count(*) from ${sql.id(s, 'chunks')} c where c.run_id = st.run_id and c.step = st.name and c.skipped_at is not null)::int as skipped
    from ${sql.id(s, 'steps')} st where st.run_id = ${runId} order by st.position`.execute(db);
  return rows.map((r) => ({ name: r.name, status: r.status, done: r.done, planned: r.planned, plannedAll: r.planned_all, estimated: r.estimated_chunks, skipped: r.skipped }));
}

/** A run's params in the detail view: JSON, cut at TABLE_ERROR_CHARS characters (`--json` shows them whole). */
function paramsText(params: unknown): string {
  const chars = [...(JSON.stringify(params) ?? 'null')];
  if (chars.length <= TABLE_ERROR_CHARS) return chars.join('');
  return `${chars.slice(0, TABLE_ERROR_CHARS).join('')}… (${(chars.length - TABLE_ERROR_CHARS).toLocaleString('en-US').replace(/,/g, ' ')} more characters: --json shows all)`;
}

/** In place of the ETA of a run that has not moved for many times its usual interval between chunks. */
const stalledNote = (seconds: number) => `stalled: no chunk committed for ${seconds}s`;

/** `idem status <job> --key K`: one run in detail. Pure; exported for tests. */
export function formatRunDetail(stored: RunStatusRow, storedSteps: readonly StepDetail[], now: Date = new Date(), c: Colours = colours(false)): string {
  const [r, steps] = visibleDeep([withKeyLabels(stored), storedSteps] as const);
  const when = (d: Date | null) => (d ? `${d.toISOString()} (${relativeTime(d, now)})` : '—');
  const fields: Array<[string, string]> = [
    ['job', r.job],
    ['run key', r.runKey],
    // From the stored params, escaped as text once (visibleDeep's escapes would be escaped again by JSON).
    ['params', visible(paramsText(stored.params))],
    ['state', `${stateColour(r.state, c)(r.state)}, attempt ${r.attempt}${r.requested ? c.yellow(` (${r.requested} requested)`) : ''}`],
    ['chunks', `${chunksOf(r)} done${r.throughput !== null ? `, ${r.throughput}/s` : ''}${r.etaSeconds !== null ? `, ETA ${r.etaSeconds}s` : ''}${r.stalledSeconds !== null ? `, ${c.yellow(stalledNote(r.stalledSeconds))}` : ''}`],
    ...(r.holder ? ([['held by', r.holder]] as Array<[string, string]>) : []),
    ...(r.workers.length > 0 ? ([['workers', r.workers.map((w) => `${w.worker} (${w.chunks} chunks, ${w.rate}/s${w.silent ? c.yellow(`, silent ${Math.floor(w.silentSeconds ?? 0)}s: looks dead, not counted in the rate`) : ''})`).join(', ')]] as Array<[string, string]>) : []),
    ...(r.healthPause ? ([['health', c.yellow(`paused for health: ${r.healthPause.reason}`)]] as Array<[string, string]>) : []),
    ...(r.codeChanges.length ? ([['code', c.yellow(`changed (allowed) at attempt ${r.codeChanges.map((x) => x.attempt).join(', ')}`)]] as Array<[string, string]>) : []),
    ['created', when(r.createdAt)],
    ['updated', when(r.updatedAt)],
    ['finished', when(r.finishedAt)],
  ];
  const width = Math.max(...fields.map(([k]) => k.length));
  const out = fields.map(([k, v]) => `${c.bold(k.padEnd(width))}  ${v}`);
  if (steps.length > 0) {
    out.push('', c.bold('steps'));
    const nameWidth = Math.max(...steps.map((s) => columns(s.name)));
    const shown = steps.map((s) => shownStepState(s.status, r.state));
    const statusWidth = Math.max(7, ...shown.map((x) => x.length));
    steps.forEach((s, i) => {
      const total = s.plannedAll ? `${s.planned}` : `${Math.max(s.planned, s.estimated ?? 0)}~`;
      const skipped = s.skipped > 0 ? c.yellow(`, ${s.skipped} skipped`) : '';
      out.push(`  ${i + 1}. ${padColumns(s.name, nameWidth)}  ${shown[i]!.padEnd(statusWidth)}  ${s.done}/${total} chunks${skipped}`);
    });
  }
  if (r.skipped.length > 0) {
    out.push('', c.bold('skipped chunks') + c.dim(' (retry with idem run --retry-skipped)'));
    for (const k of r.skipped) out.push(c.yellow(`  step "${k.step}" chunk ${k.key} after ${tries(k.attempts)}: ${k.error ?? ''}`));
  }
  if (r.error) out.push('', `${c.bold('last error')}  ${c.red(errorOf(r))}`);
  return out.join('\n');
}

/**
 * A run key as the table shows it: wider than 30 terminal columns, its first 27 columns and `...`.
 * The cut falls between characters (display-width.ts), never inside an emoji's surrogate pair
 * (which showed U+FFFD, and that text passed back as --key matched nothing).
 */
function shownKey(key: string): string {
  return columns(key) > 30 ? `${fitColumns(key, 27)}...` : key;
}

/**
 * The run whose key starts with `key`, as the table shows a long key (cut, ending in `...`) or as
 * a user shortens one (a params fingerprint is 71 characters): read-only, so a unique prefix is
 * enough, as with git's short hashes. The key as it is or as the table shows it, its bidi and
 * control characters escaped by `visible` (`k\u202eevil`), whole or cut: that is the text a user
 * copies. Undefined when none matches; several is a usage error.
 */
function uniqueByPrefix(runs: readonly RunStatusRow[], job: string, key: string): RunStatusRow | undefined {
  const exact = runs.filter((r) => visible(r.runKey) === key);
  if (exact.length === 1) return exact[0];
  const prefix = key.replace(/(?:\.\.\.|…)$/, '');
  if (prefix === '') return undefined;
  const hits = runs.filter((r) => r.runKey.startsWith(prefix) || visible(r.runKey).startsWith(prefix));
  if (hits.length > 1) {
    const keys = [...new Set(hits.map((r) => r.runKey))].sort();
    const shown = keys.length > 5 ? `${keys.slice(0, 5).join(', ')}, …` : keys.join(', ');
    throw new UsageError('unknownRun', `job "${job}" has several runs with a key starting "${prefix}" (${shown}); give more of the key`);
  }
  return hits[0];
}

/** What `idem status` says without a database to ask: not a hint to check --schema, which is not the cause. */
const NO_DATABASE_NO_RUNS = 'no runs yet (no DATABASE_URL, and no embedded server under .idem/ yet: idem makes one at the first run or migrate)';

const noRunWithKey = (job: string, key: string) => new UsageError('unknownRun', `job "${job}" has no run with key ${quoteKey(key)}; see idem status ${job} for its runs`);

/** `idem status [job] [--key K]`: the runs, newest first, or one run in detail. */
export function registerStatusCommand(program: Command, cli: CliContext): void {
  program
    .command('status')
    .description("show runs: state ('running' only while a process holds the lock), attempt, chunks done/planned, last error; with <job> --key K, one run in detail")
    .argument('[job]', 'only this job')
    .option('--key <key>', 'show this run of <job> in detail: steps, chunks done/planned per step, rate, ETA, holder, skipped chunks, last error', existingKey)
    .option('--json', 'print as JSON')
    .option('--limit <n>', 'how many runs', positiveInt(10_000), 50)
    .action((job: string | undefined, o: { json?: boolean; limit: number; key?: string }) =>
      cli.runWithSession(async (g, log, session) => {
        if (o.key !== undefined && job === undefined) throw new UsageError('invalidKey', '--key needs the job too: idem status <job> --key <key>');
        // A job name is checked before idem's schema is created: a refused name writes nothing.
        const { assertKnownJob, secretRedactor } = await import('../cli-runtime.ts');
        if (withoutDatabase(g, job)) {
          // No database to ask (no DATABASE_URL, no embedded server yet): no runs, and none is made.
          if (job !== undefined) await assertKnownJob(undefined, g.schema, job, g);
          if (o.key !== undefined) throw noRunWithKey(job!, o.key);
          process.stdout.write(o.json ? '[]\n' : `${NO_DATABASE_NO_RUNS}\n`);
          return ExitCode.Ok;
        }
        const runner = await openRunner(g, log, session, undefined, undefined, job !== undefined ? (db, schema) => assertKnownJob(db, schema, job, g) : undefined, 'read');
        // A run's params (and error) may quote DATABASE_URL's password: masked as in every log line.
        // Also without DATABASE_URL (the embedded server): PGPASSWORD and the API token are masked
        // before a long error is cut for the table, where a cut secret would no longer be found.
        const masked = secretRedactor(g.databaseUrl ?? '');
        const tty = colourful(process.stdout);
        if (o.key !== undefined) {
          // status() lists newest first; a run key is unique per job, so search that job's runs.
          // The run and its steps are read in one snapshot, so their counts agree.
          const key = o.key;
          const { run, steps } = await runner.snapshot(async (view) => {
            const runs = await view.status(job, 10_000);
            const found = runs.find((r) => r.runKey === key) ?? uniqueByPrefix(runs, job!, key);
            return { run: found, steps: found ? await stepDetails(view.db, runner.schema, found.runId) : [] };
          });
          if (!run) throw noRunWithKey(job!, o.key);
          const json = JSON.stringify({ ...run, steps: steps.map((st) => ({ ...st, status: shownStepState(st.status, run.state) })) });
          if (!o.json) await prepareColumns(json);
          // The table masked before its columns are measured and its long values clipped (the
          // output is masked again as a whole, as every line idem writes is).
          process.stdout.write(masked(o.json ? `${json}\n` : `${formatRunDetail(stringsMapped(run, masked), stringsMapped(steps, masked), new Date(), colours(tty))}\n`));
          return ExitCode.Ok;
        }
        const rows = await runner.status(job, o.limit);
        const json = JSON.stringify(rows);
        if (!o.json) await prepareColumns(json);
        // --json keeps its shape (an array of runs); the table tells of a lock held with no live run.
        const orphans = o.json ? [] : formatOrphanHolders(stringsMapped(await runner.jobLockHolders(job !== undefined ? [job] : [...new Set(rows.map((r) => r.job))]), masked), colours(tty));
        // A schema without idem's bookkeeping (a mistyped --schema, or nothing ever run): said so.
        const table = rows.length === 0 && !runner.schemaExists ? `no runs yet (schema "${runner.schema}" holds no idem runs: idem creates it at the first run or migrate; check --schema)` : formatStatus(stringsMapped(rows, masked), new Date(), colours(tty));
        process.stdout.write(masked(o.json ? `${json}\n` : `${[table, ...orphans].join('\n')}\n`));
        return ExitCode.Ok;
      }, undefined, o.json ? (err) => runErrorObject(job ?? null, o.key ?? null, err) : undefined),
    );
}
