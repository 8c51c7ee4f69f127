import { readFileSync } from 'node:fs';
import { Command, CommanderError, Option } from 'commander';
import { positiveInt } from './cli-parsers.ts';
import { CLI_DEFAULT_SCHEMA, createCliContext, DEFAULT_JOBS_DIR, DEFAULT_MIGRATIONS_DIR, startupInterruption } from './cli-session.ts';
import { registerControlCommands } from './commands/control.ts';
import { registerCronCommand } from './commands/cron.ts';
import { registerFinalizeCommand } from './commands/finalize.ts';
import { registerCrontabCommand } from './commands/crontab.ts';
import { registerInitCommand } from './commands/init.ts';
import { registerListCommand } from './commands/list.ts';
import { registerMigrateCommand } from './commands/migrate.ts';
import { registerPruneCommand } from './commands/prune.ts';
import { registerResetCommand } from './commands/reset.ts';
import { registerRunCommand } from './commands/run.ts';
import { registerServeCommand } from './commands/serve.ts';
import { registerStatusCommand } from './commands/status.ts';
import { migrateErrorEntry, runErrorObject } from './describe-outcome.ts';
import { ExitCode, exitCodeOf, messageOf, UsageError, type StopSignal } from './errors.ts';
import { guardStdio } from './hangup.ts';
import { LOG_LEVELS } from './log-level.ts';
import { visibleError } from './text-table.ts';

export { CLI_DEFAULT_SCHEMA };

/** Set by scripts/build.mjs from package.json (no file read at start-up); unset when run from src/. */
declare const __IDEM_VERSION__: string | undefined;

function idemVersion(): string {
  if (typeof __IDEM_VERSION__ === 'string') return __IDEM_VERSION__;
  return (JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8')) as { version: string }).version;
}

/**
 * The `idem` program: the global flags here, each command (its flags, help and action together)
 * in its own module under src/commands/. Start-up time matters (cron fires it, operators type
 * it): this module and the command modules load only commander and small modules; each action
 * imports what it needs (the runner, kysely, pg, pino, tsx) when it runs.
 */
export function buildProgram(state: { exitCode: number }): Command {
  const program = new Command('idem')
    .description('Idempotent batch and data-migration jobs for PostgreSQL: safe to run twice, resumable after a crash.')
    .version(idemVersion(), '-V, --version', 'print the version of idem')
    .addOption(new Option('--database-url <url>', 'PostgreSQL connection string (default: DATABASE_URL, else an embedded server under .idem/)').env('DATABASE_URL'))
    .option('--schema <name>', "schema for idem's own tables", CLI_DEFAULT_SCHEMA)
    .option('--jobs-dir <dir>', 'folder of job files', DEFAULT_JOBS_DIR)
    .option('--migrations-dir <dir>', 'folder of ordered migration files', DEFAULT_MIGRATIONS_DIR)
    .addOption(new Option('--log-level <level>', 'log level (logs go to stderr)').choices(LOG_LEVELS as string[]).default('info'))
    .option('--shutdown-timeout <seconds>', 'after a first SIGINT/SIGTERM, how long in-flight chunks may take', positiveInt(3600), 30)
    // Parse errors are one line like every other refusal, with the fix (see the help) in it;
    // commander's suggestion ("(Did you mean run?)") comes on a line of its own, joined here.
    .configureOutput({ outputError: (str, write) => write(`idem: ${oneLine(str)}; see --help\n`) })
    .exitOverride();

  const cli = createCliContext(program, state);
  registerInitCommand(program);
  registerRunCommand(program, cli);
  registerMigrateCommand(program, cli);
  registerFinalizeCommand(program, cli);
  registerListCommand(program, cli);
  registerStatusCommand(program, cli);
  registerCrontabCommand(program, cli);
  registerCronCommand(program, cli);
  registerControlCommands(program, cli);
  registerResetCommand(program, cli);
  registerPruneCommand(program, cli);
  registerServeCommand(program, cli);
  for (const cmd of [program, ...program.commands]) {
    refuseRepeatedOptions(cmd);
    refuseNegatedTogether(cmd);
  }
  return program;
}

/** Options whose values accumulate (each occurrence adds one): `--param k=v`, `--health name=value`, `serve --allowed-host <name>`. */
const REPEATABLE_OPTIONS: ReadonlySet<string> = new Set(['param', 'health', 'allowedHost']);

/**
 * An option that takes one value, given twice (`--key a --key b`, a wrapper adding its own): refused
 * instead of commander's last-one-wins, which would run under a key (or URL, schema…) the caller
 * may not have meant. `--param`, `--health` and `--allowed-host` are made to repeat.
 */
function refuseRepeatedOptions(cmd: Command): void {
  for (const opt of cmd.options) {
    if (!(opt.required || opt.optional) || REPEATABLE_OPTIONS.has(opt.attributeName())) continue;
    let seen = false;
    cmd.on(`option:${opt.name()}`, () => {
      if (seen) cmd.error(`error: option '${opt.long ?? opt.flags}' was given more than once; give it once`, { code: 'commander.repeatedOption', exitCode: ExitCode.Usage });
      seen = true;
    });
  }
}

/**
 * An option and its negation given together (`migrate --wait 30 --no-wait`) are refused: commander
 * let the last one win, so `--no-wait --wait 3` waited and `--wait 30 --no-wait` exited 75 at once.
 * commander's `.conflicts()` cannot say it (the two share one value, `wait`); the words are its own.
 */
function refuseNegatedTogether(cmd: Command): void {
  for (const negated of cmd.options.filter((o) => o.negate)) {
    const positive = cmd.options.find((o) => !o.negate && o.attributeName() === negated.attributeName());
    if (!positive) continue;
    let given: typeof positive | undefined;
    for (const opt of [positive, negated]) {
      cmd.on(`option:${opt.name()}`, () => {
        if (given && given !== opt) cmd.error(`error: option '${opt.flags}' cannot be used with option '${given.flags}'; give one of them`, { code: 'commander.conflictingOption', exitCode: ExitCode.Usage });
        given = opt;
      });
    }
  }
}

/** A commander message on one line, without its final full stop. */
function oneLine(str: string): string {
  return str.trim().split(/\s*\n\s*/).join(' ').replace(/\.$/, '');
}

/** The error object of a command that takes a job operand and --key. */
function jobAndKeyError(job: string | null, flags: ReadonlyMap<string, string>, err: unknown): unknown {
  return runErrorObject(job, flags.get('--key') ?? null, err);
}

/** What a command given --json prints on stdout when its command line is refused, by command. */
const JSON_REFUSALS: Readonly<Record<string, (job: string | null, flags: ReadonlyMap<string, string>, err: unknown) => unknown>> = {
  // `run --catch-up --json` prints an array (of the slots' outcomes), here the error alone.
  run: (job, flags, err) => (flags.has('--catch-up') ? [runErrorObject(job, null, err)] : runErrorObject(job, flags.get('--key') ?? null, err)),
  finalize: jobAndKeyError,
  migrate: (_job, _flags, err) => [migrateErrorEntry(null, err)],
  // The other commands with --json: the same object, their job and --key where they take them.
  status: jobAndKeyError,
  pause: jobAndKeyError,
  resume: jobAndKeyError,
  cancel: jobAndKeyError,
  reset: jobAndKeyError,
  list: (_job, _flags, err) => runErrorObject(null, null, err),
  prune: (_job, _flags, err) => runErrorObject(null, null, err),
};

/**
 * A command with --json prints its error object (or array) on stdout for a
 * command line commander refuses too, as for every other refusal, and for a signal before the
 * command took over. commander stops at the first bad token, so the command, its job operand,
 * --key and --json are read off the arguments here: a program option or a command's option that
 * takes a value skips that value. Undefined: no --json, or a command without an error object.
 */
function jsonErrorOf(program: Command, args: readonly string[]): ((err: unknown) => unknown) | undefined {
  let command: Command | undefined;
  const operands: string[] = [];
  const values = new Map<string, string>();
  /** A flag given twice with two values has no one value: the error object names none (the command line is refused for it). */
  const set = (flag: string, value: string) => values.set(flag, values.has(flag) && values.get(flag) !== value ? '\0' : value);
  const optionOf = (flag: string) => (command?.options ?? []).concat(program.options).find((opt) => opt.long === flag || opt.short === flag);
  for (let i = 0; i < args.length; i++) {
    const token = args[i]!;
    if (token === '--') {
      operands.push(...args.slice(i + 1));
      break;
    }
    if (token.startsWith('-') && token !== '-') {
      const eq = token.indexOf('=');
      if (eq > 0) {
        set(token.slice(0, eq), token.slice(eq + 1));
        continue;
      }
      const opt = optionOf(token);
      const next = args[i + 1];
      if (opt && next !== undefined && (opt.required || (opt.optional && !next.startsWith('-')))) {
        set(token, next);
        i++;
      } else {
        set(token, '');
      }
      continue;
    }
    if (command) operands.push(token);
    else if (!(command = program.commands.find((c) => c.name() === token || c.aliases().includes(token)))) return undefined;
  }
  for (const [flag, value] of values) if (value === '\0') values.delete(flag);
  const write = command && values.has('--json') ? JSON_REFUSALS[command.name()] : undefined;
  return write && ((err) => write(operands[0] ?? null, values, err));
}

function writeJsonRefusal(program: Command, args: readonly string[], err: CommanderError): void {
  const json = jsonErrorOf(program, args);
  if (!json) return;
  const refused = new UsageError(err.code.replace(/^commander\./, ''), oneLine(err.message).replace(/^error: /, ''));
  process.stdout.write(`${JSON.stringify(json(refused))}\n`);
}

/**
 * bin/idem.js's handler of a signal that comes before a command takes over (idem's modules still
 * loading, the command line being parsed) calls this first: with --json, the command's error
 * object goes to stdout, as a signal later in the start-up prints it (see runWithSession).
 */
(globalThis as Record<symbol, unknown>)[Symbol.for('idem.signalJson')] = (sig: StopSignal) => {
  const json = jsonErrorOf(buildProgram({ exitCode: 0 }), process.argv.slice(2));
  if (json) process.stdout.write(`${JSON.stringify(json(startupInterruption(sig)))}\n`);
};

/**
 * A warning a library emits (pg's note on sslmode, a deprecation) on one `idem: warning:` line,
 * like idem's own messages, instead of Node's several lines. Off with NODE_NO_WARNINGS=1 or
 * --no-warnings, as Node's own printing is.
 */
function oneLineWarnings(): void {
  process.removeAllListeners('warning');
  if (process.env.NODE_NO_WARNINGS === '1' || process.execArgv.includes('--no-warnings')) return;
  process.on('warning', (w: Error) => {
    // pg 8's notice that it will stop reading the password file in pg 9 is advice to idem (which
    // keeps PGPASSFILE and ~/.pgpass working), not to whoever runs the command.
    if (w.name === 'DeprecationWarning' && w.message.startsWith('pgpass support is deprecated')) return;
    // Node's notes on the module type of a file it loads, which only a job file (or what it
    // imports) can prompt: a .js ES module in a package without "type" loads with a warning
    // ("Reparsing as ES module") at every command, and one in a CommonJS package fails with a
    // warning before the error, whose explanation (loader.ts) gives the fix for that file.
    if ((w as Error & { code?: string }).code === 'MODULE_TYPELESS_PACKAGE_JSON' || w.message.startsWith('To load an ES module, set "type": "module"')) return;
    // pg's note on sslmode=prefer, require and verify-ca: several sentences, whose advice
    // (uselibpqcompat=true) does not give prefer libpq's fallback either. Said in idem's words.
    const sslmode = /^SECURITY WARNING: The SSL modes .* treated as aliases for 'verify-full'[\s\S]*uselibpqcompat=true&sslmode=([a-z-]+)'/.exec(w.message)?.[1];
    if (sslmode !== undefined) {
      process.stderr.write(`idem: warning: ${sslmodeWarning(sslmode)}\n`);
      return;
    }
    const text = `${w.name && w.name !== 'Warning' ? `${w.name}: ` : ''}${w.message}`;
    process.stderr.write(`idem: warning: ${visibleError(text.split('\n').map((l) => l.trim()).filter(Boolean).join(' '))}\n`);
  });
}

/** pg takes sslmode=prefer, require and verify-ca for verify-full (pg 8; libpq's meanings from pg 9). */
function sslmodeWarning(mode: string): string {
  const fallback = mode === 'prefer' ? ', no plain connection when the server has no TLS' : '';
  return `sslmode=${mode} in the database URL is taken by pg for verify-full (TLS only, the server's certificate and host name verified${fallback}), not for libpq's ${mode}; write sslmode=verify-full to say so, sslmode=no-verify for TLS without verification, or sslmode=disable for no TLS`;
}

/** Entry point of the `idem` binary. */
export async function main(argv: string[]): Promise<never> {
  // Every command, init and --help included: a closed stdout must not crash one.
  guardStdio();
  oneLineWarnings();
  const state = { exitCode: 0 };
  const program = buildProgram(state);
  // `idem help nosuch`: commander prints the whole help as an error, with no line saying why. The
  // name is parsed as the command it is not, for the same one line as `idem nosuch`.
  // `idem help help` printed the help as that error too: it is the help of the help, `idem --help`.
  const [first, second] = argv.slice(2);
  if (first === 'help' && second === 'help') argv = [...argv.slice(0, 2), '--help'];
  else if (first === 'help' && second !== undefined && !second.startsWith('-') && !program.commands.some((c) => c.name() === second || c.aliases().includes(second))) {
    argv = [...argv.slice(0, 2), second];
  }
  try {
    await program.parseAsync(argv);
  } catch (err) {
    if (err instanceof CommanderError) {
      // Help and version print and end well (`idem --help`, `idem help run`); `idem` without a
      // command printed the help to stderr as commander's error (its exit code 1): a usage error,
      // as for git and npm. Every other parse error is a usage error too.
      if (err.code === 'commander.helpDisplayed' || err.code === 'commander.version') process.exit(0);
      if (err.code === 'commander.help') process.exit(err.exitCode === 0 ? 0 : ExitCode.Usage);
      writeJsonRefusal(program, argv.slice(2), err);
      process.exit(ExitCode.Usage);
    }
    process.stderr.write(`idem: error: ${visibleError(messageOf(err))}\n`);
    process.exit(exitCodeOf(err));
  }
  process.exit(state.exitCode);
}
