import os from 'node:os';
import type pg from 'pg';
import type { BenchName, BenchOptions } from './options.ts';
import { fmtMs, median, medianCost, pairedRatio, type Sample } from './measure.ts';
import type { CostProbe } from './probe.ts';

/** What every benchmark gets. */
export interface BenchContext {
  /** URL of the bench database (secret: never print it). */
  readonly url: string;
  /** For preparing and checking tables; never used by a timed contender. */
  readonly pool: pg.Pool;
  readonly opts: BenchOptions;
  readonly log: (msg: string) => void;
  /** Server CPU and WAL per turn (pass to `alternate`). */
  readonly probe: CostProbe;
}

/** One line of the summary table. `met: null` means informational (no goal). */
export interface ReportRow {
  readonly benchmark: string;
  readonly contenders: string;
  readonly median: string;
  readonly ratio: string;
  readonly goal: string;
  readonly met: boolean | null;
}

export interface BenchResult {
  readonly rows: ReportRow[];
  /** Extra markdown printed under the summary (breakdowns, notes). */
  readonly details?: string[];
  /** Raw samples and counts for bench-results.json. */
  readonly data: unknown;
}

export interface Meta {
  readonly date: string;
  readonly machine: { readonly os: string; readonly cpus: string; readonly memory: string; readonly node: string };
  readonly postgres: { readonly version: string; readonly origin: string; readonly settings: Readonly<Record<string, string>> };
  readonly rows: number;
  readonly rounds: number;
  readonly durationS?: number;
  /** 1-minute load average at start and end: other work on the machine inflates wall times. */
  readonly load?: { readonly start: number; readonly end: number };
}

export function machineMeta(): Meta['machine'] {
  const cpus = os.cpus();
  return {
    os: `${os.type()} ${os.release()} ${os.arch()}`,
    cpus: `${cpus.length} × ${cpus[0]?.model.trim() ?? '?'}`,
    memory: `${Math.round(os.totalmem() / 2 ** 30)} GiB`,
    node: process.version,
  };
}

const cell = (s: string) => s.replace(/\|/g, '\\|').replace(/\n/g, ' ');

export function renderMarkdown(meta: Meta, results: ReadonlyArray<{ name: BenchName; result?: BenchResult; error?: string }>): string {
  const s = meta.postgres.settings;
  const lines = [
    `## idem benchmark — ${meta.date}`,
    '',
    `- machine: ${meta.machine.os}, ${meta.machine.cpus}, ${meta.machine.memory} RAM, node ${meta.machine.node}`,
    `- postgres: ${meta.postgres.version} (${meta.postgres.origin}; synchronous_commit=${s.synchronous_commit}, fsync=${s.fsync}, wal_sync_method=${s.wal_sync_method}, shared_buffers=${s.shared_buffers}, max_wal_size=${s.max_wal_size}, huge pages ${s.huge_pages_status ?? 'n/a'})`,
    `- rows: ${meta.rows.toLocaleString('en-US')}, rounds: ${meta.rounds} (contenders alternate, the order rotating each round: A B C, B C A, …; medians)${meta.durationS ? `, total ${Math.round(meta.durationS)} s` : ''}`,
    ...(meta.load ? [`- machine load (1-min average) at start ${meta.load.start.toFixed(1)}, at end ${meta.load.end.toFixed(1)} on ${os.cpus().length} cores: wall-time ratios are only as good as the machine is quiet; CPU and WAL columns below are not inflated by other work`] : []),
    '',
    '| benchmark | contenders | median | ratio | goal | met? |',
    '|---|---|---|---|---|---|',
  ];
  for (const { name, result, error } of results) {
    if (error) {
      lines.push(`| ${name} | — | error | — | — | ❌ ${cell(error)} |`);
      continue;
    }
    for (const r of result!.rows) {
      const met = r.met === null ? '—' : r.met ? '✅ yes' : '❌ no';
      lines.push(`| ${cell(r.benchmark)} | ${cell(r.contenders)} | ${cell(r.median)} | ${cell(r.ratio)} | ${cell(r.goal)} | ${met} |`);
    }
  }
  for (const { result } of results) {
    if (result?.details?.length) lines.push('', ...result.details);
  }
  return `${lines.join('\n')}\n`;
}

export function mb(bytes: number): string {
  return `${(bytes / 2 ** 20).toFixed(1)} MB`;
}

/**
 * Per-contender medians of wall time, CPU (this node process; the whole server) and WAL, with each
 * one's ratio to `base`: CPU and WAL do not grow when other work shares the machine, wall time does.
 */
export function costTable(title: string, samples: ReadonlyMap<string, readonly Sample[]>, base: string): string[] {
  const b = samples.get(base)!;
  const ratio = (x: number, y: number) => (Number.isFinite(x) && Number.isFinite(y) && y > 0 ? ` (${(x / y).toFixed(2)}×)` : '');
  const lines = [
    `**${title}** — medians per contender; (×) = ratio to ${base}; paired = median over rounds of the same-round ratio`,
    '',
    '| contender | wall | wall paired | node CPU | postgres CPU | node + postgres CPU | WAL |',
    '|---|---|---|---|---|---|---|',
  ];
  const total = (s: Sample) => (s.cost ? s.cost.nodeCpuMs + (s.cost.pgCpuMs ?? NaN) : NaN);
  for (const [name, xs] of samples) {
    const wall = median(xs.map((s) => s.ms));
    const node = medianCost(xs, 'nodeCpuMs');
    const pgc = medianCost(xs, 'pgCpuMs');
    const sum = median(xs.map(total));
    const wal = medianCost(xs, 'walBytes');
    const bw = median(b.map((s) => s.ms));
    lines.push(`| ${name} | ${fmtMs(wall)}${ratio(wall, bw)} | ${name === base ? '—' : `${pairedRatio(xs, b).toFixed(2)}×`} | ${fmtMs(node)}${ratio(node, medianCost(b, 'nodeCpuMs'))} | ${fmtMs(pgc)}${ratio(pgc, medianCost(b, 'pgCpuMs'))} | ${fmtMs(sum)}${ratio(sum, median(b.map(total)))} | ${mbOrNa(wal)}${ratio(wal, medianCost(b, 'walBytes'))} |`);
  }
  return lines;
}

const mbOrNa = (bytes: number) => (Number.isFinite(bytes) ? mb(bytes) : 'n/a');
