import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, promises as fs, readFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

/** The repository root: the CLI runs from there, as a user would run `node bin/idem.js`. */
export const REPO_ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
export const BENCH_JOBS_DIR = path.join('test', 'bench', 'jobs');
/** A JavaScript job, for the start-up benchmark's rerun without a compiled copy. */
export const BENCH_JS_JOBS_DIR = path.join('test', 'bench', 'jobs-js');
const GNU_TIME = '/usr/bin/time';

export interface CliOptions {
  readonly databaseUrl: string;
  /** Wrap in GNU time to read the peak RSS exactly (else /proc/<pid>/status VmHWM is polled). */
  readonly measureMemory?: boolean;
  /** Preload count-preload.mjs and return the statements the CLI sent. */
  readonly countStatements?: boolean;
  /** Called once the child runs (e.g. to watch progress and kill it). */
  readonly onSpawn?: (child: ChildProcess) => void;
}

export interface CliResult {
  readonly code: number | null;
  readonly signal: NodeJS.Signals | null;
  /** Wall time from spawn to exit, process start included. */
  readonly ms: number;
  readonly stdout: string;
  readonly stderr: string;
  /** Peak resident set size of the node process, in bytes (when measured). */
  readonly maxRssBytes?: number;
  /** How the peak was read: `GNU time` or `VmHWM`. */
  readonly rssSource?: string;
  /** Statement text → count (with countStatements). */
  readonly statements?: Record<string, number>;
}

/** Runs `node bin/idem.js --jobs-dir test/bench/jobs <args>` against the bench database. */
export async function runCli(args: readonly string[], opts: CliOptions): Promise<CliResult> {
  const tmp = await fs.mkdtemp(path.join(os.tmpdir(), 'idem-bench-cli-'));
  const timeFile = path.join(tmp, 'time');
  const countFile = path.join(tmp, 'count.json');
  const nodeArgs = [...(opts.countStatements ? ['--import', './test/bench/count-preload.mjs'] : []), 'bin/idem.js', '--jobs-dir', BENCH_JOBS_DIR, ...args];
  const useTime = opts.measureMemory === true && existsSync(GNU_TIME);
  const [file, argv] = useTime ? [GNU_TIME, ['-f', '%M', '-o', timeFile, process.execPath, ...nodeArgs]] : [process.execPath, nodeArgs];
  const env = { ...process.env, DATABASE_URL: opts.databaseUrl, ...(opts.countStatements ? { IDEM_BENCH_COUNT_FILE: countFile } : {}) };
  try {
    const t0 = performance.now();
    const child = spawn(file, argv, { cwd: REPO_ROOT, env, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout!.on('data', (b: Buffer) => { stdout += b.toString(); });
    child.stderr!.on('data', (b: Buffer) => { stderr = (stderr + b.toString()).slice(-20_000); });
    let hwm = 0;
    const poll = opts.measureMemory && !useTime ? setInterval(() => { hwm = Math.max(hwm, readVmHwm(child.pid)); }, 50) : undefined;
    opts.onSpawn?.(child);
    const { code, signal } = await new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve, reject) => {
      child.on('error', reject);
      child.on('close', (c, s) => resolve({ code: c, signal: s }));
    });
    const ms = performance.now() - t0;
    if (poll) clearInterval(poll);
    let maxRssBytes: number | undefined;
    let rssSource: string | undefined;
    if (useTime) {
      const kb = Number((await fs.readFile(timeFile, 'utf8').catch(() => '')).trim().split('\n').pop());
      if (Number.isFinite(kb) && kb > 0) [maxRssBytes, rssSource] = [kb * 1024, 'GNU time'];
    } else if (hwm > 0) {
      [maxRssBytes, rssSource] = [hwm, 'VmHWM'];
    }
    const statements = opts.countStatements ? (JSON.parse(await fs.readFile(countFile, 'utf8').catch(() => '{}')) as Record<string, number>) : undefined;
    return { code, signal, ms, stdout, stderr, ...(maxRssBytes ? { maxRssBytes, rssSource } : {}), ...(statements ? { statements } : {}) };
  } finally {
    await fs.rm(tmp, { recursive: true, force: true });
  }
}

/** Throws with the CLI's last stderr lines unless it exited 0. */
export function assertOk(r: CliResult, what: string): CliResult {
  if (r.code !== 0) throw new Error(`${what}: idem exited ${r.code ?? r.signal}: ${r.stderr.trim().split('\n').slice(-3).join(' | ')}`);
  return r;
}

/** VmHWM (peak RSS) of a live process, in bytes; 0 once it is gone. */
function readVmHwm(pid: number | undefined): number {
  if (!pid) return 0;
  try {
    // Synchronous on purpose: a 50 ms poll of a tiny procfs file.
    const text = readFileSync(`/proc/${pid}/status`, 'utf8');
    const m = /VmHWM:\s+(\d+)\s+kB/.exec(text);
    return m ? Number(m[1]) * 1024 : 0;
  } catch {
    return 0;
  }
}
