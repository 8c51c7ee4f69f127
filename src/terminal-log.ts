import { colours, writeLines, type Colours } from './terminal.ts';
import { visible, visibleText } from './text-table.ts';

const LEVEL_NAMES: Record<number, string> = { 10: 'trace', 20: 'debug', 30: 'info', 40: 'warn', 50: 'error', 60: 'fatal' };
/** Fields every line of a run repeats: shown once, in the header line of the run, not on each line. */
const RUN_FIELDS = ['job', 'runKey', 'attempt'];
const HIDDEN = new Set(['level', 'time', 'msg', 'pid', 'hostname', ...RUN_FIELDS]);

function levelLabel(level: number, c: Colours): string {
  const name = (LEVEL_NAMES[level] ?? String(level)).padEnd(5);
  if (level >= 50) return c.red(name);
  if (level >= 40) return c.yellow(name);
  if (level >= 30) return c.green(name);
  return c.gray(name);
}

/**
 * A field as text: quoted (JSON) when it has spaces, quotes or `=`; control characters escaped
 * either way (a key or message from the database must not move the cursor or break the line).
 */
function fieldValue(v: unknown): string {
  return visible(rawFieldValue(v));
}

function rawFieldValue(v: unknown): string {
  if (typeof v === 'string') return /[\s"=]/.test(v) || v === '' ? JSON.stringify(v) : v;
  if (v && typeof v === 'object' && 'message' in v && typeof (v as { message: unknown }).message === 'string') return JSON.stringify((v as { message: string }).message);
  return JSON.stringify(v);
}

/**
 * One line per log event for a person at a terminal: time, level, message and the few fields
 * that event carries; the job, run key and attempt go in a header line when they change. Pure
 * (takes pino's JSON line, returns text); exported for tests.
 */
export function formatLogLine(json: string, state: { run?: string }, c: Colours = colours(false)): string {
  let e: Record<string, unknown>;
  try {
    e = JSON.parse(json) as Record<string, unknown>;
  } catch {
    return visible(json.trimEnd());
  }
  const lines: string[] = [];
  if (typeof e.job === 'string') {
    const run = [`job ${e.job}`, e.runKey !== undefined ? `run key ${String(e.runKey)}` : '', e.attempt !== undefined ? `attempt ${String(e.attempt)}` : ''].filter(Boolean).join(' · ');
    if (run !== state.run) {
      state.run = run;
      lines.push(c.bold(c.cyan(`── ${visible(run)}`)));
    }
  }
  const time = typeof e.time === 'number' ? new Date(e.time).toTimeString().slice(0, 8) : '';
  const fields = Object.entries(e)
    .filter(([k, v]) => !HIDDEN.has(k) && v !== undefined && v !== null)
    .map(([k, v]) => c.gray(`${k}=`) + fieldValue(v));
  lines.push([c.dim(time), levelLabel(Number(e.level), c), visibleText(String(e.msg ?? '')), ...fields].filter(Boolean).join(' '));
  return lines.join('\n');
}

/** A pino destination that writes formatted lines above the pinned progress bar. */
export function terminalDestination(): { write(line: string): void } {
  const state: { run?: string } = {};
  const c = colours();
  return { write: (line) => writeLines(formatLogLine(line, state, c)) };
}
