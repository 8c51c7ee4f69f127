import type { Command } from 'commander';
import { positiveInt } from '../cli-parsers.ts';
import { installSignals, openRunner, type CliContext } from '../cli-session.ts';
import { describeOutcome } from '../describe-outcome.ts';
import { BusyError, errorFields, ExitCode, IdemError, InterruptedError } from '../errors.ts';
import { noScheduledJobs, scheduledJobs } from './crontab.ts';
import { testHookMs } from '../test-hooks.ts';

/** How long cron's slots may meet a standby before it says so as an error (IDEM_STANDBY_ALARM_MS for tests). */
const STANDBY_ALARM_MS = testHookMs('IDEM_STANDBY_ALARM_MS') ?? 10 * 60_000;
/** Tests only: the schedules' clock reads this much behind the wall clock, so a test can put a slot boundary seconds away. */
const CLOCK_BEHIND_MS = testHookMs('IDEM_CRON_CLOCK_BEHIND_MS');

/** `idem cron`: the schedules in this process, for containers without cron. */
export function registerCronCommand(program: Command, cli: CliContext): void {
  program
    .command('cron')
    .description('run the schedules in this process (for containers without cron); several on several hosts are safe')
    .option('--max-runs <n>', 'runs of different jobs executed at once by this process (the others wait their turn)', positiveInt(64), 4)
    .action((o: { maxRuns: number }) =>
      cli.runWithSession(async (g, log, session, force) => {
        const { assertNotStandby, droppedSlotMessage, loadJobDir, runCronLoop, slotKey, SlotBehindError, SlotTakenError } = await import('../cli-runtime.ts');
        // Each job keeps its own schedule, side by side; at most this many of their runs at once,
        // on a pool sized for them as idem serve's is (--max-runs × a run's connections + 4).
        const { default: pLimit } = await import('p-limit');
        const limit = pLimit(o.maxRuns);
        const loaded = await loadJobDir(g.jobsDir, 'jobs');
        const byName = new Map(loaded.map((l) => [l.job.name, l.job]));
        const entries = await scheduledJobs(g.jobsDir, g.migrationsDir);
        // Refused before connecting and before "idem cron started": with nothing to schedule nothing starts.
        if (entries.length === 0) throw noScheduledJobs(g.jobsDir);
        const runner = await openRunner(g, log, session, o.maxRuns + 4);
        // On a standby every slot would fail, tick after tick: refused at start instead (exit 2).
        await assertNotStandby(runner.db);
        const signals = installSignals(log, g.shutdownTimeout, force);
        log.info({ jobs: entries.map((e) => `${e.job} (${e.schedule.expression})`) }, 'idem cron started');
        // Jobs whose slots meet a standby: since when, and whether that was said as an error. Keyed
        // by job (bounded by the jobs), not by slot.
        const onStandby = new Map<string, { since: number; loud: boolean }>();
        await runCronLoop({
          entries,
          signal: signals.stop,
          ...(CLOCK_BEHIND_MS !== undefined ? { now: () => new Date(Date.now() - CLOCK_BEHIND_MS) } : {}),
          runSlot: (name, slot) => limit(async () => {
            const key = slotKey(slot);
            const out = await runner.run(byName.get(name)!, { key, slot, signal: signals.stop, abortSignal: signals.abort }).catch(async (err: unknown) => {
              // A run an operator paused is theirs to resume, not a slot held up by another run.
              if (!(err instanceof IdemError && err.exitCode === ExitCode.Busy) || err.code === 'idem.paused') throw err;
              // Busy: another scheduler runs (or ran) this very slot, or another run of the job
              // holds the job, and then nobody runs this slot now.
              const runs = await runner.status(name).catch(() => []);
              const mine = runs.find((r) => r.runKey === key);
              if (mine?.state === 'succeeded') throw err;
              // Another process runs this slot: it may die before the end, so the slot is looked at
              // again at the next tick, and resumed here if that process no longer holds it.
              if (mine?.state === 'running') throw new SlotTakenError(err);
              const other = runs.find((r) => r.runKey !== key && r.state === 'running');
              throw new SlotBehindError(err, other ? `run key ${other.runKey}` : 'another process');
            });
            onStandby.delete(name);
            log.info({ job: name, slot: key, status: out.status, executed: out.executed }, describeOutcome(out));
          }),
          onDropped: (name, slot) => log.error({ job: name, slot: slotKey(slot) }, droppedSlotMessage(name, slot)),
          onError: (name, slot, err, again, retryInMs) => {
            if (signals.stop.aborted) return;
            // The database could not be reached (down, restarting, failing over, full): the run did
            // not start, and the slot is tried again until it does.
            if (retryInMs !== undefined && err instanceof IdemError && err.code === 'idem.standby') {
              // The server answers, but as a standby (a failover under way): tried again like an
              // unreachable database, said once (a warning); still a standby after STANDBY_ALARM_MS,
              // it is more likely DATABASE_URL naming a standby than a failover: said as an error, once.
              const seen = onStandby.get(name);
              if (!seen) {
                onStandby.set(name, { since: Date.now(), loud: false });
                log.warn({ job: name, slot: slotKey(slot), err: errorFields(err) }, `scheduled run could not start: the database is a standby (in recovery), as during a failover; it is tried again in ${Math.max(1, Math.round(retryInMs / 1000))} s, then until it is a primary again`);
              } else if (!seen.loud && Date.now() - seen.since >= STANDBY_ALARM_MS) {
                seen.loud = true;
                log.error({ job: name, slot: slotKey(slot), err: errorFields(err) }, `scheduled runs have not started for ${Math.round((Date.now() - seen.since) / 60_000)} min: the database is still a standby (in recovery); if DATABASE_URL names a standby, point it at the primary; slots are still tried until it is one`);
              }
              return;
            }
            onStandby.delete(name);
            if (retryInMs !== undefined) {
              log.warn({ job: name, slot: slotKey(slot), err: errorFields(err) }, `scheduled run could not start: the database could not be reached; it is tried again in ${Math.max(1, Math.round(retryInMs / 1000))} s, then until it starts`);
              return;
            }
            // An operator's decision about the slot's run: said, and never tried again (retryByDefault).
            if (err instanceof IdemError && (err.code === 'idem.paused' || err.code === 'idem.cancelled')) {
              log.warn({ job: name, slot: slotKey(slot) }, `slot ${err.code === 'idem.paused' ? 'paused' : 'cancelled'} by an operator: ${err.message}`);
              return;
            }
            const then = again ? "it is tried again at the job's next tick, then left to --catch-up" : 'it was tried again once already: left to --catch-up';
            if (err instanceof SlotBehindError) {
              log.warn({ job: name, slot: slotKey(slot), busy: err.message }, `slot not run now: another run of job "${name}" holds the job (${err.other}); ${then}`);
            } else if (err instanceof SlotTakenError) {
              log.info({ job: name, slot: slotKey(slot) }, `slot taken by another process: ${err.message}${again ? "; it is looked at again at the job's next tick, and resumed there if that process ended without finishing it" : ''}`);
            } else if (err instanceof IdemError && err.exitCode === ExitCode.Busy) log.info({ job: name, slot: slotKey(slot) }, `slot taken by another process: ${err instanceof BusyError ? err.reason : err.message}`);
            else log.error({ job: name, slot: slotKey(slot), err: errorFields(err) }, again ? 'scheduled run failed; the next tick tries it once more, --catch-up after that' : 'scheduled run failed; not tried again at the next tick (left to --catch-up)');
          },
        });
        const reason = signals.stop.reason;
        return reason instanceof InterruptedError ? reason.exitCode : ExitCode.Ok;
      }, ['jobs']),
    );
}
