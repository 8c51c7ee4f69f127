import { randomBytes } from 'node:crypto';
import type { ChildProcess } from 'node:child_process';
import { assertOk, runCli, type CliResult } from './cli.ts';
import { checkedDrop } from './contenders.ts';
import { alternate, fmtMs, fmtRatio, median, type Contender } from './measure.ts';
import type { BenchContext, BenchResult } from './report.ts';
import { CHUNK_ROWS, prepareTable } from './tables.ts';

const KILL_AT = 0.9;
const GOAL = 0.15;

interface Turn {
  readonly cli: CliResult;
  /** For a resume: the share of chunks the killed run had committed. */
  readonly killedAt?: number;
}

/**
 * 4. Resume: the CLI runs the backfill in a child process; a watcher polls idem.chunks and SIGKILLs
 * it at ~90 % of the chunks done; then the same command resumes, and that resume is timed against
 * a full run of the same command on an identical fresh table (both include process start).
 */
export async function benchResume(ctx: BenchContext): Promise<BenchResult> {
  const { rows, rounds } = ctx.opts;
  const chunks = Math.ceil(rows / CHUNK_ROWS);
  const tag = randomBytes(3).toString('hex');
  const args = (table: string, key: string) => ['run', 'bench-backfill', '--params', JSON.stringify({ table, size: CHUNK_ROWS }), '--key', key];
  const doneChunks = async (key: string) => {
    const { rows: r } = await ctx.pool.query<{ n: number }>(
      `select count(*)::int as n from idem.chunks c join idem.runs r on r.id = c.run_id
       where r.job = 'bench-backfill' and r.run_key = $1 and c.done_at is not null`, [key]);
    return r[0]!.n;
  };

  const full: Contender<Turn> = {
    name: 'full run',
    async prepare(round) {
      const table = `resume_full_${tag}_${round}`;
      await prepareTable(ctx.pool, table, rows);
      return {
        run: async () => ({ cli: assertOk(await runCli(args(table, table), { databaseUrl: ctx.url }), 'full run') }),
        cleanup: () => checkedDrop(ctx, table, 'full run'),
      };
    },
  };
  const resume: Contender<Turn> = {
    name: 'resume after kill',
    async prepare(round) {
      const table = `resume_kill_${tag}_${round}`;
      await prepareTable(ctx.pool, table, rows);
      let watcher: Promise<void> | undefined;
      const killed = await runCli(args(table, table), {
        databaseUrl: ctx.url,
        onSpawn: (child) => { watcher = killAt(child, () => doneChunks(table), Math.floor(chunks * KILL_AT)); },
      });
      await watcher;
      if (killed.signal !== 'SIGKILL') {
        throw new Error(killed.code === 0
          ? `the run to kill finished before the watcher saw ${KILL_AT * 100} % of its chunks done: use more --rows`
          : `the run to kill failed on its own (exit ${killed.code}): ${killed.stderr.trim().split('\n').slice(-2).join(' | ')}`);
      }
      const killedAt = (await doneChunks(table)) / chunks;
      ctx.log(`  killed at ${(killedAt * 100).toFixed(1)} % of ${chunks} chunks`);
      return {
        // --wait: the killed session's lock goes when Postgres notices the dead socket (normally at once).
        run: async () => ({ cli: assertOk(await runCli([...args(table, table), '--wait', '30'], { databaseUrl: ctx.url }), 'resume'), killedAt }),
        cleanup: () => checkedDrop(ctx, table, 'resume'),
      };
    },
  };
  ctx.log(`resume: ${chunks} chunks via the CLI, kill at ${KILL_AT * 100} %, ${rounds} rounds`);
  const samples = await alternate(rounds, [full, resume], ctx.log);
  const fullMs = median(samples.get('full run')!.map((s) => s.result.cli.ms));
  const resumeMs = median(samples.get('resume after kill')!.map((s) => s.result.cli.ms));
  const killedAt = median(samples.get('resume after kill')!.map((s) => s.result.killedAt!));
  const ratio = resumeMs / fullMs;
  return {
    rows: [
      {
        benchmark: `4. resume after SIGKILL at ~${(killedAt * 100).toFixed(0)} % (${chunks} chunks, CLI)`,
        contenders: 'resume vs full run (same command, both incl. process start)',
        median: `${fmtMs(resumeMs)} vs ${fmtMs(fullMs)}`,
        ratio: `${fmtRatio(ratio)} resume÷full (ideal ${fmtRatio(1 - killedAt)} + start-up)`,
        goal: `≤ ${GOAL}`,
        met: ratio <= GOAL,
      },
    ],
    data: {
      chunks,
      killAt: KILL_AT,
      killedAt: samples.get('resume after kill')!.map((s) => s.result.killedAt),
      samplesMs: { full: samples.get('full run')!.map((s) => s.result.cli.ms), resume: samples.get('resume after kill')!.map((s) => s.result.cli.ms) },
      medianMs: { full: fullMs, resume: resumeMs },
      ratio,
    },
  };
}

/** Polls progress and SIGKILLs the child once `target` chunks are done (or it exits first). */
async function killAt(child: ChildProcess, done: () => Promise<number>, target: number): Promise<void> {
  for (;;) {
    if (child.exitCode !== null || child.signalCode !== null) return;
    if ((await done()) >= target) {
      child.kill('SIGKILL');
      return;
    }
    await new Promise((r) => setTimeout(r, 20));
  }
}
