/**
 * Quotes a word for a POSIX shell (a crontab line, a command in a message), leaving plain words as
 * they are. A module of its own so that the server can quote without loading schedule.ts (croner).
 */
export function shellQuote(s: string): string {
  return /^[A-Za-z0-9_./:@+=,-]+$/.test(s) ? s : `'${s.replace(/'/g, `'\\''`)}'`;
}

/** Longest --params written out in a command a message gives; longer ones are named, not written. */
const MAX_PARAMS_SHOWN = 500;

/**
 * The `idem run` that continues a run: its whole key and, unless empty, its params (without them
 * `idem run` computes other params and refuses the key, exit 65), shell-quoted. Params longer than
 * MAX_PARAMS_SHOWN are replaced by `whereParams`, which says where to read them.
 */
export function continueCommand(job: string, key: string, params: unknown, whereParams: string): string {
  const json = JSON.stringify(params ?? {});
  const command = `idem run ${shellQuote(job)} --key ${shellQuote(key)}`;
  if (json === '{}') return command;
  return json.length <= MAX_PARAMS_SHOWN ? `${command} --params ${shellQuote(json)}` : `${command} --params ${whereParams}`;
}
