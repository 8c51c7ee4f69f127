import { readdirSync, readFileSync } from 'node:fs';
import os from 'node:os';
import type pg from 'pg';

/** What one contender's turn cost beyond wall time; robust to a busy machine, unlike wall time. */
export interface Cost {
  /** CPU time of this node process (in-process contenders only; the harness is idle meanwhile). */
  readonly nodeCpuMs: number;
  /** CPU time of the whole PostgreSQL server (every backend and background process); null when not local. */
  readonly pgCpuMs: number | null;
  /** WAL written, in bytes. */
  readonly walBytes: number;
  /** 1-minute load average when the turn ended: other work on the machine inflates wall times. */
  readonly load1: number;
}

interface Snapshot {
  readonly node: NodeJS.CpuUsage;
  readonly pgTicks: number | null;
  readonly lsn: bigint;
}

export const CLK_TCK = 100; // Linux USER_HZ; /proc/<pid>/stat counts CPU time in these ticks

/**
 * Reads the server's CPU from /proc when it runs on this machine (the embedded one, or a local
 * DATABASE_URL): the postmaster's own and reaped children's time plus every live child's, so
 * backends that exit mid-turn (idem's lock session) are still counted. WAL from pg_current_wal_lsn().
 */
export class CostProbe {
  readonly #pool: pg.Pool;
  readonly #postmaster: number | null;

  private constructor(pool: pg.Pool, postmaster: number | null) {
    this.#pool = pool;
    this.#postmaster = postmaster;
  }

  static async open(pool: pg.Pool): Promise<CostProbe> {
    let postmaster: number | null = null;
    try {
      const { rows } = await pool.query<{ pid: number }>(`select pid from pg_stat_activity where backend_type = 'checkpointer'`);
      const ppid = rows[0] ? statOf(rows[0].pid)?.ppid : undefined;
      if (ppid && statOf(ppid)) postmaster = ppid;
    } catch {
      postmaster = null;
    }
    return new CostProbe(pool, postmaster);
  }

  get measuresServerCpu(): boolean {
    return this.#postmaster !== null;
  }

  async snapshot(): Promise<Snapshot> {
    const { rows } = await this.#pool.query<{ lsn: string }>(`select pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint::text as lsn`);
    return { node: process.cpuUsage(), pgTicks: this.#serverTicks(), lsn: BigInt(rows[0]!.lsn) };
  }

  async since(start: Snapshot): Promise<Cost> {
    const end = await this.snapshot();
    const node = process.cpuUsage(start.node);
    return {
      nodeCpuMs: (node.user + node.system) / 1000,
      pgCpuMs: end.pgTicks !== null && start.pgTicks !== null ? ((end.pgTicks - start.pgTicks) * 1000) / CLK_TCK : null,
      walBytes: Number(end.lsn - start.lsn),
      load1: os.loadavg()[0]!,
    };
  }

  #serverTicks(): number | null {
    if (this.#postmaster === null) return null;
    const pm = statOf(this.#postmaster);
    if (!pm) return null;
    let ticks = pm.utime + pm.stime + pm.cutime + pm.cstime;
    for (const name of readdirSync('/proc')) {
      if (!/^\d+$/.test(name)) continue;
      const s = statOf(Number(name));
      if (s && s.ppid === this.#postmaster) ticks += s.utime + s.stime;
    }
    return ticks;
  }
}

/** A process's CPU from /proc (ticks of 1/CLK_TCK s), or undefined when it is gone or not local. */
export function statOf(pid: number): { ppid: number; utime: number; stime: number; cutime: number; cstime: number } | undefined {
  try {
    const text = readFileSync(`/proc/${pid}/stat`, 'utf8');
    // Fields after "(comm)"; comm may contain spaces, so split after the last ')'.
    const f = text.slice(text.lastIndexOf(')') + 2).split(' ');
    return { ppid: Number(f[1]), utime: Number(f[11]), stime: Number(f[12]), cutime: Number(f[13]), cstime: Number(f[14]) };
  } catch {
    return undefined;
  }
}
