import { execFileSync } from 'node:child_process';
import { promises as fs } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { latestSlot, parseSchedule, slotKey, slotsSince } from '../src/schedule.ts';
import { TICK_SCHEDULE } from './fixtures/scheduled-jobs/hourly-tick.ts';
import { busyMessage, FIXTURE_JOBS, killLeftovers, lines, logLines, query, REPO, runCli, spawnCli, waitFor, workCounts } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { clusterDir, removeDir, startPrimary, startStandby, systemPgBin, type Cluster } from './support/pg-cluster.ts';
import { api, startServe } from './support/server.ts';

const SCHEDULED_JOBS = fileURLToPath(new URL('./fixtures/scheduled-jobs', import.meta.url));
const SCHEDULED_PAIR = fileURLToPath(new URL('./fixtures/scheduled-pair', import.meta.url));
const SCHEDULED_MINUTELY = fileURLToPath(new URL('./fixtures/scheduled-minutely', import.meta.url));
const SCHEDULED_CHUNKS = fileURLToPath(new URL('./fixtures/scheduled-chunks', import.meta.url));
const schedule = parseSchedule(TICK_SCHEDULE);

const testDb = useTestDatabase({ fixtureTables: true });
let url: string;
beforeAll(() => {
  url = testDb.url;
});

/**
 * A test computes the slot its processes will pick; it must not straddle the hour. Near the
 * boundary, wait until the new slot has begun (at most ~20 s, rarely).
 */
beforeEach(async () => {
  const toNext = schedule.next(new Date()).getTime() - Date.now();
  if (toNext < 20_000) await new Promise((r) => setTimeout(r, toNext + 500));
}, 30_000);

afterEach(killLeftovers);

afterAll(killLeftovers);

/**
 * Each test keeps its runs in a schema of its own (`--schema`), so one test's slot runs are not
 * another's, and logs under its own tag.
 */
const tick = (schema: string, args: readonly string[]) => ['--jobs-dir', SCHEDULED_JOBS, '--schema', schema, 'run', 'hourly-tick', ...args];

async function runsOf(schema: string): Promise<Array<{ run_key: string; status: string; attempt: number; created_at: Date }>> {
  return query(url, `select run_key, status, attempt, created_at from ${schema}.runs where job = 'hourly-tick' order by created_at, id`);
}

/** work_log rows of one tag: slot (ctx.slot as ISO) per run key. */
async function ticks(tag: string): Promise<Array<{ run_key: string; chunk_key: string }>> {
  return query(url, 'select run_key, chunk_key from work_log where job = $1 and step = $2 order by id', ['hourly-tick', tag]);
}

describe('idem run on a scheduled job', () => {
  it('two invocations of the same slot at once execute it once, under the slot as run key', async () => {
    const slot = latestSlot(schedule);
    const args = tick('sched_a', ['--param', 'tag=twice', '--param', 'pauseMs=1500', '--json']);
    const [a, b] = await Promise.all([runCli(args, { url }), runCli(args, { url })]);
    const outcomes = [a, b].map((r) => ({ code: r.code, out: r.code === 0 ? JSON.parse(r.stdout) : null, err: r.stderr }));
    const winners = outcomes.filter((o) => o.out?.status === 'succeeded');
    expect(winners, JSON.stringify(outcomes)).toHaveLength(1);
    expect(winners[0]!.out).toMatchObject({ runKey: slotKey(slot), executed: 1, attempt: 1 });
    const loser = outcomes.find((o) => o !== winners[0])!;
    // The other found it busy (75), or, had it come after, done (0): never a second execution.
    if (loser.code === 0) expect(loser.out).toMatchObject({ status: 'already-succeeded', runKey: slotKey(slot), executed: 0 });
    else expect([loser.code, busyMessage(loser.err)]).toEqual([75, expect.stringMatching(/^busy: job "hourly-tick" is running in another process/)]);

    expect(await ticks('twice')).toEqual([{ run_key: slotKey(slot), chunk_key: slot.toISOString() }]);
    expect(await runsOf('sched_a')).toMatchObject([{ run_key: slotKey(slot), status: 'succeeded', attempt: 1 }]);

    const third = await runCli(args, { url });
    expect(third.code).toBe(0);
    expect(JSON.parse(third.stdout)).toMatchObject({ status: 'already-succeeded', runKey: slotKey(slot), executed: 0 });
    expect(await workCounts(url, slotKey(slot), 'twice')).toEqual(new Map([[slot.toISOString(), 1]]));
  });

  it('--catch-up 3 runs the last three slots oldest first, each its own run; a second --catch-up 3 is a no-op', async () => {
    const slots = slotsSince(schedule, { count: 3 });
    const keys = slots.map(slotKey);
    expect(slots[2]!.getTime()).toBe(latestSlot(schedule).getTime());
    expect(slots[1]!.getTime() - slots[0]!.getTime()).toBe(3_600_000);
    const args = tick('sched_b', ['--param', 'tag=catch-up', '--catch-up', '3', '--json']);

    const first = await runCli(args, { url });
    expect(first.code, first.stderr).toBe(0);
    // One JSON document, an array of the slots' outcomes, as migrate --json prints its migrations'.
    const outs = JSON.parse(first.stdout) as Array<{ runKey: string; status: string; executed: number }>;
    expect(outs.map((o) => [o.runKey, o.status, o.executed])).toEqual(keys.map((k) => [k, 'succeeded', 1]));
    // Three runs, created in slot order; each slot's step saw its own slot.
    expect((await runsOf('sched_b')).map((r) => [r.run_key, r.status])).toEqual(keys.map((k) => [k, 'succeeded']));
    expect(await ticks('catch-up')).toEqual(slots.map((s) => ({ run_key: slotKey(s), chunk_key: s.toISOString() })));

    const second = await runCli(args, { url });
    expect(second.code).toBe(0);
    expect((JSON.parse(second.stdout) as Array<{ runKey: string; status: string; executed: number }>).map((o) => [o.runKey, o.status, o.executed])).toEqual(keys.map((k) => [k, 'already-succeeded', 0]));
    expect(await ticks('catch-up')).toHaveLength(3);
    expect(await runsOf('sched_b')).toHaveLength(3);
  });

  it('prune keeps a job\'s latest slot run, so the next tick does not run that slot again; older slots and other keys go (B6-4)', async () => {
    // Black-box round 17: a daily job pruned with --older-than 12h ran its morning slot twice.
    const keys = slotsSince(schedule, { count: 2 }).map(slotKey);
    const run = (args: string[]) => runCli(tick('sched_prune', ['--param', 'tag=prune', ...args]), { url });
    expect((await run(['--catch-up', '2'])).code).toBe(0);
    expect((await run(['--key', 'manual'])).code).toBe(0);
    const pruned = await runCli(['--jobs-dir', SCHEDULED_JOBS, '--schema', 'sched_prune', 'prune', '--older-than', '0s', '--json'], { url });
    expect(pruned.code, pruned.stderr).toBe(0);
    expect(JSON.parse(pruned.stdout)).toMatchObject({ runs: 2, skipped: 0 });
    expect((await runsOf('sched_prune')).map((r) => [r.run_key, r.status])).toEqual([[keys[1], 'succeeded']]);
    // The latest due slot (still keys[1]: beforeEach keeps the test clear of the hour) is done: not run again.
    const again = await run(['--json']);
    expect(again.code, again.stderr).toBe(0);
    expect(JSON.parse(again.stdout)).toMatchObject({ status: 'already-succeeded', runKey: keys[1] });
    expect(await ticks('prune')).toHaveLength(3);
  });
});

describe('--key of a scheduled job', () => {
  it('a key that is a slot of the schedule runs as that slot (ctx.slot), so --catch-up finds it done; a slot-shaped key off the schedule or not yet due exits 2', async () => {
    const [older, latest] = slotsSince(schedule, { count: 2 }) as [Date, Date];
    const byKey = await runCli(tick('sched_g', ['--param', 'tag=by-key', '--key', slotKey(older)]), { url });
    expect(byKey.code, byKey.stderr).toBe(0);
    expect(await ticks('by-key')).toEqual([{ run_key: slotKey(older), chunk_key: older.toISOString() }]);
    // The catch-up finds the slot done (it ran as that slot) and runs only the other one.
    const catchUp = await runCli(tick('sched_g', ['--param', 'tag=by-key', '--catch-up', '2']), { url });
    expect(catchUp.code, catchUp.stderr).toBe(0);
    expect(await ticks('by-key')).toEqual([older, latest].map((s) => ({ run_key: slotKey(s), chunk_key: s.toISOString() })));

    // Shaped like a slot key, but the schedule does not fire then: refused, naming the nearest slots.
    const off = new Date(older.getTime() + 30 * 60_000);
    const offSlot = await runCli(tick('sched_h', ['--key', slotKey(off)]), { url });
    expect(offSlot.code).toBe(2);
    expect(offSlot.stderr).toBe(
      `idem: error: --key ${slotKey(off)} is shaped like a slot of job "hourly-tick", but its schedule (0 * * * *, UTC) does not fire then; the nearest slots are ${slotKey(older)} and ${slotKey(latest)}: pass one of them, or a key that is not a UTC time\n`,
    );
    // A slot that is not due yet: running it now would mark it done before its time.
    const future = schedule.next(new Date(Date.now() + 86_400_000));
    const early = await runCli(tick('sched_h', ['--key', slotKey(future)]), { url });
    expect(early.code).toBe(2);
    expect(early.stderr).toBe(`idem: error: --key ${slotKey(future)} is a slot of job "hourly-tick" that is not due yet; the latest due slot is ${slotKey(latestSlot(schedule))}: pass a due slot, or a key that is not a UTC time\n`);
    // The same slot spelled as JavaScript's toISOString() writes it (or with an offset, or without
    // its seconds) is that slot, not another key: refused, naming the slot's spelling, where it ran
    // the slot a second time with ctx.slot null (black-box round 19). Other times so spelled too.
    const latestKey = slotKey(latestSlot(schedule));
    for (const key of [older.toISOString(), slotKey(older).replace('Z', '+00:00'), slotKey(older).replace(':00Z', 'Z'), slotKey(older).toLowerCase()]) {
      const spelled = await runCli(tick('sched_h', ['--param', 'tag=by-key', '--key', key]), { url });
      expect([spelled.code, spelled.stderr]).toEqual([2, `idem: error: --key ${key} is a time spelled otherwise than the slot keys of job "hourly-tick" (UTC to the second, like ${latestKey}, the latest due); pass ${slotKey(older)} for that slot, or a key that is not a time\n`]);
    }
    for (const key of [off.toISOString(), future.toISOString()]) {
      const spelled = await runCli(tick('sched_h', ['--key', key]), { url });
      expect([spelled.code, spelled.stderr]).toEqual([2, `idem: error: --key ${key} is a time spelled otherwise than the slot keys of job "hourly-tick" (UTC to the second, like ${latestKey}, the latest due); pass a slot so spelled, or a key that is not a time\n`]);
    }
    expect(await ticks('by-key')).toHaveLength(2);
    expect(await query(url, `select to_regnamespace('sched_h')::text as s`)).toEqual([{ s: null }]);
  });
});

describe('a slot key given to idem finalize or to idem serve', () => {
  it('idem finalize --key <slot> runs as that slot (ctx.slot); a slot-shaped key off the schedule or not yet due exits 2, writing nothing', async () => {
    const [older, latest] = slotsSince(schedule, { count: 2 }) as [Date, Date];
    const fin = (schema: string, key: string) => ['--jobs-dir', SCHEDULED_JOBS, '--schema', schema, 'finalize', 'hourly-tick', '--param', 'tag=fin-key', '--key', key];
    const ran = await runCli(fin('sched_fin', slotKey(older)), { url });
    expect(ran.code, ran.stderr).toBe(0);
    expect(await ticks('fin-key')).toEqual([{ run_key: slotKey(older), chunk_key: older.toISOString() }]);
    const off = new Date(older.getTime() + 30 * 60_000);
    const offSlot = await runCli(fin('sched_fin_off', slotKey(off)), { url });
    expect(offSlot.code).toBe(2);
    expect(offSlot.stderr).toBe(
      `idem: error: --key ${slotKey(off)} is shaped like a slot of job "hourly-tick", but its schedule (0 * * * *, UTC) does not fire then; the nearest slots are ${slotKey(older)} and ${slotKey(latest)}: pass one of them, or a key that is not a UTC time\n`,
    );
    const future = schedule.next(new Date(Date.now() + 86_400_000));
    const early = await runCli(fin('sched_fin_off', slotKey(future)), { url });
    expect(early.code).toBe(2);
    expect(early.stderr).toBe(`idem: error: --key ${slotKey(future)} is a slot of job "hourly-tick" that is not due yet; the latest due slot is ${slotKey(latestSlot(schedule))}: pass a due slot, or a key that is not a UTC time\n`);
    expect(await query(url, `select to_regnamespace('sched_fin_off')::text as s`)).toEqual([{ s: null }]);
    expect(await ticks('fin-key')).toHaveLength(1);
  });

  it("a POST whose Idempotency-Key is a slot of the schedule runs as that slot (ctx.slot); one off the schedule or not yet due is 422, writing nothing", async () => {
    const [older, latest] = slotsSince(schedule, { count: 2 }) as [Date, Date];
    const server = await startServe(url, ['--schema', 'sched_srv'], {}, SCHEDULED_JOBS);
    try {
      const post = (key: string) => api(server.base, 'POST', '/api/jobs/hourly-tick/runs', { body: { tag: 'srv-key' }, key });
      const created = await post(slotKey(older));
      expect(created.status, created.text).toBe(201);
      expect((await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body).toMatchObject({ state: 'succeeded' });
      expect(await ticks('srv-key')).toEqual([{ run_key: slotKey(older), chunk_key: older.toISOString() }]);

      const off = new Date(older.getTime() + 30 * 60_000);
      const offSlot = await post(slotKey(off));
      expect(offSlot.status, offSlot.text).toBe(422);
      expect(offSlot.headers.get('content-type')).toMatch(/^application\/problem\+json/);
      expect(offSlot.body).toMatchObject({
        type: 'urn:idem:problem:idem.invalidKey',
        status: 422,
        detail: `Idempotency-Key ${slotKey(off)} is shaped like a slot of job "hourly-tick", but its schedule (0 * * * *, UTC) does not fire then; the nearest slots are ${slotKey(older)} and ${slotKey(latest)}: pass one of them, or a key that is not a UTC time`,
      });
      const future = schedule.next(new Date(Date.now() + 86_400_000));
      const early = await post(slotKey(future));
      expect(early.status, early.text).toBe(422);
      expect(early.body).toMatchObject({
        type: 'urn:idem:problem:idem.invalidKey',
        detail: `Idempotency-Key ${slotKey(future)} is a slot of job "hourly-tick" that is not due yet; the latest due slot is ${slotKey(latestSlot(schedule))}: pass a due slot, or a key that is not a UTC time`,
      });
      const spelled = await post(older.toISOString());
      expect(spelled.status, spelled.text).toBe(422);
      expect(spelled.body).toMatchObject({
        type: 'urn:idem:problem:idem.invalidKey',
        detail: `Idempotency-Key ${older.toISOString()} is a time spelled otherwise than the slot keys of job "hourly-tick" (UTC to the second, like ${slotKey(latestSlot(schedule))}, the latest due); pass ${slotKey(older)} for that slot, or a key that is not a time`,
      });
      expect(await query(url, `select run_key from sched_srv.runs order by id`)).toEqual([{ run_key: slotKey(older) }]);
    } finally {
      server.proc.child.kill('SIGTERM');
      await server.proc.done;
    }
  });
});

describe('a slot-shaped key that is no real time', () => {
  it('month 13, 30 February and hour 24 are refused by run, finalize and a POST (exit 2 / 422) naming the problem, writing nothing; never run as ordinary keys with ctx.slot null', async () => {
    const latest = slotKey(latestSlot(schedule));
    const refusal = (name: string, key: string, problem: string) =>
      `${name} ${key} is shaped like a slot of job "hourly-tick", but is not a real time (${problem}); pass a slot of its schedule (the latest due is ${latest}), or a key that is not a UTC time`;
    const cases: Array<[string, string]> = [
      ['2026-13-01T00:00:00Z', 'there is no month 13'],
      ['2026-02-30T05:00:00Z', 'February 2026 has 28 days'],
      ['2026-12-02T24:00:00Z', 'there is no hour 24 (00 to 23)'],
    ];
    for (const [key, problem] of cases) {
      const run = await runCli(tick('sched_bad', ['--param', 'tag=bad-key', '--key', key, '--json']), { url });
      expect({ code: run.code, stderr: run.stderr }).toEqual({ code: 2, stderr: `idem: error: ${refusal('--key', key, problem)}\n` });
      expect(JSON.parse(run.stdout)).toMatchObject({ status: 'error', exitCode: 2, code: 'idem.invalidKey' });
      const fin = await runCli(['--jobs-dir', SCHEDULED_JOBS, '--schema', 'sched_bad', 'finalize', 'hourly-tick', '--param', 'tag=bad-key', '--key', key], { url });
      expect({ code: fin.code, stderr: fin.stderr }).toEqual({ code: 2, stderr: `idem: error: ${refusal('--key', key, problem)}\n` });
    }
    expect(await query(url, `select to_regnamespace('sched_bad')::text as s`)).toEqual([{ s: null }]);
    const server = await startServe(url, ['--schema', 'sched_bad_srv'], {}, SCHEDULED_JOBS);
    try {
      for (const [key, problem] of cases) {
        const res = await api(server.base, 'POST', '/api/jobs/hourly-tick/runs', { body: { tag: 'bad-key' }, key });
        expect(res.status, res.text).toBe(422);
        expect(res.body).toMatchObject({ type: 'urn:idem:problem:idem.invalidKey', detail: refusal('Idempotency-Key', key, problem) });
      }
      expect(await query(url, `select run_key from sched_bad_srv.runs`)).toEqual([]);
    } finally {
      server.proc.child.kill('SIGTERM');
      await server.proc.done;
    }
    expect(await ticks('bad-key')).toEqual([]);
  });
});

describe('--catch-up when a slot fails', () => {
  it('stops at the first failed slot (exit 1); the next tick retries it and goes on', async () => {
    const slots = slotsSince(schedule, { count: 3 });
    const keys = slots.map(slotKey);
    const args = tick('sched_e', ['--param', 'tag=cu-fail', '--catch-up', '3', '--json']);
    await query(url, 'insert into fail_chunks (chunk_key) values ($1)', [slots[1]!.toISOString()]);
    try {
      const first = await runCli(args, { url });
      expect(first.code, first.stderr).toBe(1);
      expect(first.stderr).toContain(`injected failure in slot ${slots[1]!.toISOString()}`);
      // The slot before it ran; the failed one is recorded failed (and --json says so, exit code
      // and all); the one after was not tried.
      expect((JSON.parse(first.stdout) as Array<{ runKey: string; status: string; exitCode?: number }>).map((o) => [o.runKey, o.status, o.exitCode])).toEqual([[keys[0], 'succeeded', undefined], [keys[1], 'error', 1]]);
      expect((await runsOf('sched_e')).map((r) => [r.run_key, r.status])).toEqual([[keys[0], 'succeeded'], [keys[1], 'failed']]);
      expect(await ticks('cu-fail')).toEqual([{ run_key: keys[0], chunk_key: slots[0]!.toISOString() }]);
    } finally {
      await query(url, 'delete from fail_chunks');
    }
    // The next tick (same command) finds the first slot done, retries the failed one, then runs the last.
    const next = await runCli(args, { url });
    expect(next.code, next.stderr).toBe(0);
    expect((JSON.parse(next.stdout) as Array<{ runKey: string; status: string; attempt: number }>).map((o) => [o.runKey, o.status, o.attempt])).toEqual([
      [keys[0], 'already-succeeded', 1],
      [keys[1], 'succeeded', 2],
      [keys[2], 'succeeded', 1],
    ]);
    expect(await ticks('cu-fail')).toEqual(slots.map((s) => ({ run_key: slotKey(s), chunk_key: s.toISOString() })));
  });

  it('passes over a slot an operator cancelled (exit 0, said on its line): the slots after it still run', async () => {
    // Black-box round 14 (B3-6): a cancelled slot ended every --catch-up window holding it with
    // exit 1 (idem.cancelled), so a crontab line with --catch-up N ran no new slot for N ticks.
    const slots = slotsSince(schedule, { count: 3 });
    const keys = slots.map(slotKey);
    const args = tick('sched_cancelled', ['--param', 'tag=cu-cancel', '--catch-up', '3', '--json']);
    await query(url, 'insert into fail_chunks (chunk_key) values ($1)', [slots[1]!.toISOString()]);
    try {
      expect((await runCli(args, { url })).code).toBe(1);
    } finally {
      await query(url, 'delete from fail_chunks');
    }
    const cancel = await runCli(['--jobs-dir', SCHEDULED_JOBS, '--schema', 'sched_cancelled', 'cancel', 'hourly-tick', '--key', keys[1]!], { url });
    expect(cancel.code, cancel.stderr).toBe(0);
    const next = await runCli(args, { url });
    expect(next.code, next.stderr).toBe(0);
    expect((JSON.parse(next.stdout) as Array<{ runKey: string; status: string }>).map((o) => [o.runKey, o.status])).toEqual([
      [keys[0], 'already-succeeded'],
      [keys[1], 'cancelled'],
      [keys[2], 'succeeded'],
    ]);
    expect((await runsOf('sched_cancelled')).map((r) => [r.run_key, r.status])).toEqual([[keys[0], 'succeeded'], [keys[1], 'cancelled'], [keys[2], 'succeeded']]);
    expect(await ticks('cu-cancel')).toEqual([slots[0]!, slots[2]!].map((s) => ({ run_key: slotKey(s), chunk_key: s.toISOString() })));
    // Without --json, the line says it was passed over, and how to run it after all.
    const text = await runCli(tick('sched_cancelled', ['--param', 'tag=cu-cancel', '--catch-up', '3']), { url });
    expect(text.code, text.stderr).toBe(0);
    expect(text.stdout).toContain(`slot ${keys[1]} of job "hourly-tick" was cancelled by an operator: passed over (idem reset hourly-tick --key ${keys[1]} lets it run again)`);
  });

  it('--catch-up 12h runs every hourly slot of the last 12 hours, oldest first', async () => {
    const r = await runCli(tick('sched_f', ['--param', 'tag=cu-12h', '--catch-up', '12h', '--json']), { url });
    expect(r.code, r.stderr).toBe(0);
    const keys = (JSON.parse(r.stdout) as Array<{ runKey: string }>).map((o) => (expect(o).toMatchObject({ status: 'succeeded', executed: 1 }), o.runKey));
    // Twelve consecutive hours ending with the latest due slot (computed here, not by src/).
    const latest = Math.floor(Date.now() / 3_600_000) * 3_600_000;
    const expected = Array.from({ length: 12 }, (_, i) => new Date(latest - (11 - i) * 3_600_000).toISOString().replace('.000Z', 'Z'));
    expect(keys).toEqual(expected);
    expect((await ticks('cu-12h')).map((t) => t.run_key)).toEqual(expected);
  });
});

describe('idem crontab and --catch-up refusals', () => {
  it('crontab prints a line for the scheduled job that changes into the project and runs it', async () => {
    const r = await runCli(['--jobs-dir', SCHEDULED_JOBS, 'crontab', '--command', 'npx idem']);
    expect(r.code, r.stderr).toBe(0);
    const entries = r.stdout.split('\n').filter((l) => l !== '' && !l.startsWith('#'));
    expect(entries).toEqual([
      'CRON_TZ=UTC',
      `0 * * * * cd ${path.resolve(REPO)} && npx idem --jobs-dir ${SCHEDULED_JOBS} run hourly-tick >> idem-cron.log 2>&1`,
    ]);
    expect(r.stdout).toContain('# hourly-tick: 0 * * * * (UTC)');
  });

  it('crontab carries --schema, --jobs-dir and --migrations-dir, shell-quoted, so cron runs take the same lock as manual ones', async () => {
    const spaced = path.join(os.tmpdir(), `idem crontab ${process.pid}`);
    await fs.symlink(SCHEDULED_JOBS, spaced);
    try {
      const r = await runCli(['--schema', 'ops', '--jobs-dir', spaced, '--migrations-dir', "db/it's here", 'crontab', '--command', 'npx idem']);
      expect(r.code, r.stderr).toBe(0);
      const line = r.stdout.split('\n').find((l) => l.includes('run hourly-tick'));
      expect(line).toBe(`0 * * * * cd ${path.resolve(REPO)} && npx idem --schema ops --jobs-dir '${spaced}' --migrations-dir 'db/it'\\''s here' run hourly-tick >> idem-cron.log 2>&1`);
    } finally {
      await fs.rm(spaced);
    }
  });

  it('crontab --catch-up past 1000 slots of a job (a count, or a duration on a minutely job) exits 2 with one line naming the job and the limit', async () => {
    // Black-box round 13 (B): the lines were printed (exit 0), and each then failed at every tick.
    for (const [dir, value, job, expression] of [
      [SCHEDULED_JOBS, '2000', 'hourly-tick', '0 * * * *'],
      [SCHEDULED_MINUTELY, '2d', 'minute-tick', '* * * * *'],
    ] as const) {
      const r = await runCli(['--jobs-dir', dir, 'crontab', '--catch-up', value]);
      expect({ code: r.code, stdout: r.stdout, stderr: r.stderr }).toEqual({
        code: 2,
        stdout: '',
        stderr: `idem: error: --catch-up ${value} covers more than 1000 slots of job "${job}" (schedule "${expression}"), so its crontab line would fail at every tick; catch up at most 1000 slots at a time (a smaller count or a shorter duration)\n`,
      });
    }
    const fine = await runCli(['--jobs-dir', SCHEDULED_MINUTELY, 'crontab', '--catch-up', '12h']);
    expect(fine.code, fine.stderr).toBe(0);
    expect(fine.stdout).toContain('run minute-tick --catch-up 12h >>');
  });

  it('--catch-up with --key, or on a job without a schedule, exits 2 and creates nothing', async () => {
    const withKey = await runCli(tick('sched_c', ['--catch-up', '3', '--key', 'k']), { url });
    expect(withKey.code).toBe(2);
    expect(withKey.stderr).toMatch(/--catch-up picks run keys from the schedule; drop --key/);
    const unscheduled = await runCli(['--jobs-dir', FIXTURE_JOBS, '--schema', 'sched_c', 'run', 'counted', '--catch-up', '3'], { url });
    expect(unscheduled.code).toBe(2);
    expect(unscheduled.stderr).toMatch(/--catch-up needs a scheduled job; "counted" has no schedule/);
    // Refused before connecting: not even idem's schema was created.
    expect(await query(url, `select to_regnamespace('sched_c')::text as s`)).toEqual([{ s: null }]);
  });
});

describe('idem cron', () => {
  it('with no scheduled job: refused (exit 2) in one line before anything starts, without connecting', async () => {
    // Black-box round 13: it logged "idem cron started", then the error.
    const r = await runCli(['--jobs-dir', FIXTURE_JOBS, '--schema', 'sched_none', 'cron'], { url });
    expect({ code: r.code, stdout: r.stdout }, r.stderr).toEqual({ code: 2, stdout: '' });
    expect(r.stderr.split('\n').filter((l) => l !== '')).toEqual([`idem: error: no job in ${FIXTURE_JOBS}/ declares a schedule; add schedule: '0 3 * * *' to one`]);
    expect(await query(url, `select to_regnamespace('sched_none')::text as s`)).toEqual([{ s: null }]);
  });

  it('runs the latest due slot at start, once however many schedulers run, and exits 143 on SIGTERM', async () => {
    const slot = latestSlot(schedule);
    const args = ['--jobs-dir', SCHEDULED_JOBS, '--schema', 'sched_d', 'cron'];
    const crons = [spawnCli(args, { url }), spawnCli(args, { url })];
    await waitFor(async () => {
      const runs = await query(url, `select status from sched_d.runs where job = 'hourly-tick' and run_key = $1`, [slotKey(slot)]).catch(() => []);
      return runs[0]?.status === 'succeeded';
    }, 'the slot to succeed');
    // Both schedulers have handled the slot (run it, found it busy, or found it done) and sleep.
    await waitFor(async () => crons.every((c) => c.stderr().includes(`"slot":"${slotKey(slot)}"`)), 'both schedulers to report the slot');
    for (const c of crons) c.child.kill('SIGTERM');
    const results = await Promise.all(crons.map((c) => c.done));
    expect(results.map((r) => r.code)).toEqual([143, 143]);
    // The busy refusal's advice is for idem run, not for a scheduler's line.
    for (const r of results) expect(r.stderr).not.toContain('pass --wait');

    // cron passes no params: the default tag.
    expect(await ticks('default')).toEqual([{ run_key: slotKey(slot), chunk_key: slot.toISOString() }]);
    expect(await runsOf('sched_d')).toMatchObject([{ run_key: slotKey(slot), status: 'succeeded', attempt: 1 }]);
  });

  it("a slot whose run an operator paused or cancelled is said as such, not as another run holding the job, and not tried again", async () => {
    // Black-box round 14 (B3-7): idem cron logged "slot not run now: another run of job \"tick\"
    // holds the job (another process); it is tried again at the job's next tick" for its own slot
    // paused by an operator; a cancelled one was tried again at the next tick as a failure.
    const slot = latestSlot(schedule);
    for (const [schema, action, said] of [
      ['sched_p', 'pause', `slot paused by an operator: run ${slotKey(slot)} of job "hourly-tick" is paused; run idem resume hourly-tick --key ${slotKey(slot)} first`],
      ['sched_q', 'cancel', `slot cancelled by an operator: run ${slotKey(slot)} of job "hourly-tick" was cancelled; idem reset hourly-tick --key ${slotKey(slot)} forgets it so it can run afresh`],
    ] as const) {
      await query(url, 'insert into fail_chunks (chunk_key) values ($1)', [slot.toISOString()]);
      try {
        expect((await runCli(['--jobs-dir', SCHEDULED_JOBS, '--schema', schema, 'run', 'hourly-tick'], { url })).code).toBe(1);
      } finally {
        await query(url, 'delete from fail_chunks');
      }
      const control = await runCli(['--jobs-dir', SCHEDULED_JOBS, '--schema', schema, action, 'hourly-tick', '--key', slotKey(slot)], { url });
      expect(control.code, control.stderr).toBe(0);
      const cron = spawnCli(['--jobs-dir', SCHEDULED_JOBS, '--schema', schema, 'cron'], { url });
      await waitFor(async () => cron.stderr().includes(`"slot":"${slotKey(slot)}"`), 'the scheduler to report the slot');
      await new Promise((r) => setTimeout(r, 300));
      cron.child.kill('SIGTERM');
      const r = await cron.done;
      expect(r.code, r.stderr).toBe(143);
      const lines = r.stderr.split('\n').filter((l) => l.includes(`"slot":"${slotKey(slot)}"`)).map((l) => JSON.parse(l) as { msg: string; level: number });
      expect(lines.map((l) => l.msg)).toEqual([said]);
      expect(lines[0]!.level).toBe(40);
      expect((await runsOf(schema)).map((x) => x.status)).toEqual([action === 'pause' ? 'paused' : 'cancelled']);
    }
  });

  it('runs the jobs side by side, at most --max-runs at once: two 2-second jobs overlap by default and take turns with --max-runs 1', async () => {
    const slot = slotKey(latestSlot(schedule));
    const spans = async (maxRuns: string[], schema: string) => {
      await query(url, `delete from work_log where job like 'pair-%'`);
      const cron = spawnCli(['--jobs-dir', SCHEDULED_PAIR, '--schema', schema, 'cron', ...maxRuns], { url });
      try {
        await waitFor(async () => {
          const runs = await query(url, `select count(*)::int as n from ${schema}.runs where run_key = $1 and status = 'succeeded'`, [slot]).catch(() => [{ n: 0 }]);
          return runs[0]!.n === 2;
        }, 'both jobs\' slots to succeed');
      } finally {
        cron.child.kill('SIGTERM');
        expect((await cron.done).code).toBe(143);
      }
      const rows = await query(url, `select job, step, logged_at from work_log where job like 'pair-%' and run_key = $1 order by logged_at`, [slot]);
      const at = (job: string, step: string) => new Date(rows.find((r) => r.job === job && r.step === step)!.logged_at).getTime();
      expect(rows).toHaveLength(4);
      return { overlap: at('pair-a', 'start') < at('pair-b', 'end') && at('pair-b', 'start') < at('pair-a', 'end') };
    };
    expect(await spans([], 'sched_pair_4')).toEqual({ overlap: true });
    expect(await spans(['--max-runs', '1'], 'sched_pair_1')).toEqual({ overlap: false });
    const bad = await runCli(['--jobs-dir', SCHEDULED_PAIR, 'cron', '--max-runs', '0'], { url });
    expect(bad.code).toBe(2);
  }, 60_000);

  it('a slot due while another run of the job holds it is not "taken by another process": it is said to be behind that run, and tried again at the next tick', async () => {
    // Black-box round 10: an earlier slot run by hand held the job's lock at the tick; both cron
    // processes logged "slot taken by another process", and nobody ran the slot.
    const slot = latestSlot(schedule);
    const earlier = new Date(slot.getTime() - 3_600_000);
    const held = spawnCli(['--jobs-dir', SCHEDULED_JOBS, '--schema', 'sched_behind', 'run', 'hourly-tick', '--key', slotKey(earlier), '--params', '{"tag":"held","pauseMs":6000}'], { url });
    await waitFor(async () => {
      const runs = await query(url, `select status from sched_behind.runs where job = 'hourly-tick' and run_key = $1`, [slotKey(earlier)]).catch(() => []);
      return runs[0]?.status === 'running';
    }, 'the earlier slot to run');
    const cron = spawnCli(['--jobs-dir', SCHEDULED_JOBS, '--schema', 'sched_behind', 'cron'], { url });
    try {
      await waitFor(async () => cron.stderr().includes(`"slot":"${slotKey(slot)}"`), 'the scheduler to report the slot');
      const line = cron.stderr().split('\n').find((l) => l.includes(`"slot":"${slotKey(slot)}"`))!;
      expect(line).not.toContain('slot taken by another process');
      expect(line).not.toContain('pass --wait');
      expect(JSON.parse(line).msg).toMatch(/^slot not run now: another run of job "hourly-tick" holds the job \(run key 20\d\d-.+\); it is tried again at the job's next tick, then left to --catch-up$/);
    } finally {
      cron.child.kill('SIGTERM');
      await cron.done;
      expect((await held.done).code).toBe(0);
    }
  });
});

describe('several idem cron processes when one dies mid-slot', () => {
  it("the survivor resumes the slot the dead scheduler was running at its next tick: the run succeeds, every chunk once", async () => {
    // Black-box round 15: the survivor logged "slot taken by another process" for the slot, and at
    // its next tick ran only that tick's slot; the dead peer's run stayed crashed 5/7 for good.
    // The schedulers' clock reads behind the wall clock so that it is 45 s past a minute: their
    // first slot runs at start, and the next tick comes 15 s later.
    const behind = ((Date.now() - 45_000) % 60_000 + 60_000) % 60_000 || 60_000;
    const slot = slotKey(latestSlot(parseSchedule('* * * * *'), new Date(Date.now() - behind)));
    const args = ['--jobs-dir', SCHEDULED_CHUNKS, '--schema', 'sched_peer', 'cron'];
    const env = { IDEM_CRON_CLOCK_BEHIND_MS: String(behind) };
    const crons = [spawnCli(args, { url, env }), spawnCli(args, { url, env })];
    const work = () => query<{ chunk_key: string; pid: number }>(url, `select chunk_key, pid from work_log where job = 'minute-chunks' and run_key = $1 order by id`, [slot]);
    try {
      // Two chunks of the slot committed: SIGKILL the scheduler running it.
      const done = await waitFor(async () => ((await work()).length >= 2 ? await work() : null), 'two chunks of the slot');
      const victim = crons.find((c) => c.pid === done[0]!.pid)!;
      const survivor = crons.find((c) => c !== victim)!;
      victim.child.kill('SIGKILL');
      expect((await victim.done).signal).toBe('SIGKILL');
      const said = logLines(survivor.stderr()).filter((l) => l.slot === slot).map((l) => l.msg);
      expect(said[0]).toMatch(/^slot taken by another process: /);
      // At its next tick (about 15 s after start) the survivor resumes the slot.
      await waitFor(async () => (await query(url, `select status from sched_peer.runs where job = 'minute-chunks' and run_key = $1`, [slot]))[0]?.status === 'succeeded', 'the survivor to finish the slot', { timeoutMs: 25_000 });
      const rows = await work();
      expect(rows.map((r) => r.chunk_key).sort()).toEqual(['c1', 'c2', 'c3', 'c4', 'c5', 'c6', 'c7']);
      expect(rows.filter((r) => r.pid === survivor.pid).length).toBeGreaterThan(0);
      expect(await query(url, `select attempt from sched_peer.runs where job = 'minute-chunks' and run_key = $1`, [slot])).toEqual([{ attempt: 2 }]);
      survivor.child.kill('SIGTERM');
      expect((await survivor.done).code).toBe(143);
    } finally {
      for (const c of crons) c.child.kill('SIGKILL');
    }
  }, 45_000);
});

describe.skipIf(!systemPgBin())('idem cron while the database restarts over a slot boundary (a cluster of the test\'s own)', () => {
  let dir: string;
  let primary: Cluster;
  const asPostgres = () => (process.getuid?.() === 0 ? { uid: Number(execFileSync('id', ['-u', 'postgres'], { encoding: 'utf8' })), gid: Number(execFileSync('id', ['-g', 'postgres'], { encoding: 'utf8' })) } : {});
  const pgCtl = (args: string[]) => execFileSync(path.join(systemPgBin()!, 'pg_ctl'), ['-D', primary.dataDir, ...args], { ...asPostgres(), cwd: dir, stdio: 'ignore' });

  beforeAll(async () => {
    dir = await clusterDir('idem-cron-restart-');
    primary = await startPrimary(systemPgBin()!, dir);
  }, 120_000);
  afterAll(async () => {
    await killLeftovers();
    await primary?.stop();
    if (dir) await removeDir(dir);
  });

  it('a slot whose run could not reach the database is tried again until it starts, and its line says so', async () => {
    // Black-box round 13: PostgreSQL stopped at :50 and started at :10 of the next minute; both
    // idem cron processes logged "scheduled run failed; not tried again at the next tick (left to
    // --catch-up)" (idem.databaseUnavailable, exit 2), and that minute's slot never ran.
    const minutely = parseSchedule('* * * * *');
    const statusOf = async (key: string) => (await query(primary.url, `select status from idem.runs where job = 'minute-tick' and run_key = $1`, [key]).catch(() => []))[0]?.status;
    const cron = spawnCli(['--jobs-dir', SCHEDULED_MINUTELY, 'cron'], { url: primary.url, timeoutMs: 180_000 });
    try {
      await waitFor(async () => cron.stderr().includes('"status":"succeeded"'), 'the first slot to run');
      // Not too close to the boundary: the stop must come before the next slot.
      if (minutely.next(new Date()).getTime() - Date.now() < 5_000) await new Promise((r) => setTimeout(r, minutely.next(new Date()).getTime() - Date.now() + 2_000));
      const slot = slotKey(minutely.next(new Date()));
      pgCtl(['-m', 'fast', '-w', 'stop']);
      try {
        const failure = await waitFor(async () => lines(cron.stderr()).find((l) => l.includes(`"slot":"${slot}"`)), 'the slot to fail', { timeoutMs: 70_000, intervalMs: 200 });
        expect(JSON.parse(failure)).toMatchObject({ err: { code: 'idem.databaseUnavailable' } });
        expect(JSON.parse(failure).msg).toMatch(/^scheduled run could not start: the database could not be reached; it is tried again in 1 s, then until it starts/);
        await new Promise((r) => setTimeout(r, 2_000));
      } finally {
        pgCtl(['-l', path.join(primary.dataDir, 'server.log'), '-w', 'start']);
      }
      await waitFor(async () => (await statusOf(slot)) === 'succeeded', 'the slot to run once the database is back', { timeoutMs: 45_000, intervalMs: 250 });
      expect(await query(primary.url, `select attempt from idem.runs where job = 'minute-tick' and run_key = $1`, [slot])).toEqual([{ attempt: 1 }]);
    } finally {
      cron.child.kill('SIGTERM');
      await cron.done;
    }
  }, 180_000);
});

describe.skipIf(!systemPgBin())('idem cron during a failover: DATABASE_URL answers as a standby, then is promoted (clusters of the test\'s own)', () => {
  let dir: string;
  let primary: Cluster;
  let standby: Cluster;
  const asPostgres = () => (process.getuid?.() === 0 ? { uid: Number(execFileSync('id', ['-u', 'postgres'], { encoding: 'utf8' })), gid: Number(execFileSync('id', ['-g', 'postgres'], { encoding: 'utf8' })) } : {});
  const pgCtl = (dataDir: string, args: string[]) => execFileSync(path.join(systemPgBin()!, 'pg_ctl'), ['-D', dataDir, ...args], { ...asPostgres(), cwd: dir, stdio: 'ignore' });

  beforeAll(async () => {
    dir = await clusterDir('idem-cron-failover-');
    primary = await startPrimary(systemPgBin()!, dir);
    standby = await startStandby(systemPgBin()!, dir, primary);
  }, 120_000);
  afterAll(async () => {
    await killLeftovers();
    await primary?.stop();
    await standby?.stop();
    if (dir) await removeDir(dir);
  });

  it('a slot whose run met a standby is tried again, said once, and runs once the standby is promoted', async () => {
    // Black-box round 13 (B3): during a failover the server answered as a standby in recovery; the
    // slot's run was refused (exit 2, idem.standby) and the slot was dropped for good.
    const minutely = parseSchedule('* * * * *');
    const statusOf = async (key: string) => (await query(primary.url, `select status from idem.runs where job = 'minute-tick' and run_key = $1`, [key]).catch(() => []))[0]?.status;
    // Still a standby after IDEM_STANDBY_ALARM_MS (10 min by default), it is said as an error once
    // (review of this fix: a DATABASE_URL naming a standby was retried forever with one warning).
    const cron = spawnCli(['--jobs-dir', SCHEDULED_MINUTELY, 'cron'], { url: primary.url, timeoutMs: 180_000, env: { IDEM_STANDBY_ALARM_MS: '4000' } });
    try {
      await waitFor(async () => cron.stderr().includes('"status":"succeeded"'), 'the first slot to run');
      // The switch to the standby must be done before the next slot.
      if (minutely.next(new Date()).getTime() - Date.now() < 15_000) await new Promise((r) => setTimeout(r, minutely.next(new Date()).getTime() - Date.now() + 2_000));
      const slot = slotKey(minutely.next(new Date()));
      // The failover: the primary goes, and its address answers as a standby (no upstream, still in recovery).
      pgCtl(primary.dataDir, ['-m', 'fast', '-w', 'stop']);
      pgCtl(standby.dataDir, ['-m', 'fast', '-w', 'stop']);
      // pg_basebackup copied the primary's socket lock file, of the port the standby now takes.
      await fs.rm(path.join(standby.dataDir, `.s.PGSQL.${primary.port}.lock`), { force: true });
      await fs.appendFile(path.join(standby.dataDir, 'postgresql.conf'), `\nport = ${primary.port}\nprimary_conninfo = ''\n`);
      pgCtl(standby.dataDir, ['-l', path.join(standby.dataDir, 'server.log'), '-w', 'start']);
      const refusal = await waitFor(async () => lines(cron.stderr()).find((l) => l.includes(`"slot":"${slot}"`)), 'the slot to meet the standby', { timeoutMs: 70_000, intervalMs: 200 });
      expect(JSON.parse(refusal)).toMatchObject({ level: 40, err: { code: 'idem.standby' } });
      expect(JSON.parse(refusal).msg).toMatch(/^scheduled run could not start: the database is a standby \(in recovery\), as during a failover; it is tried again in 1 s, then until it is a primary again$/);
      // Several tries (1 s, 2 s, 4 s), then the promotion.
      await new Promise((r) => setTimeout(r, 8_000));
      pgCtl(standby.dataDir, ['-w', 'promote']);
      await waitFor(async () => (await statusOf(slot)) === 'succeeded', 'the slot to run once the standby is promoted', { timeoutMs: 45_000, intervalMs: 250 });
      expect(await query(primary.url, `select attempt from idem.runs where job = 'minute-tick' and run_key = $1`, [slot])).toEqual([{ attempt: 1 }]);
      // Said once, not at every try; and once more, as an error, past the alarm's 4 s.
      const said = lines(cron.stderr()).filter((l) => l.includes(`"slot":"${slot}"`) && l.includes('standby')).map((l) => JSON.parse(l) as { level: number; msg: string });
      expect(said.map((l) => l.level)).toEqual([40, 50]);
      expect(said[1]!.msg).toMatch(/^scheduled runs have not started for \d+ min: the database is still a standby \(in recovery\); if DATABASE_URL names a standby, point it at the primary; slots are still tried until it is one$/);
    } finally {
      cron.child.kill('SIGTERM');
      await cron.done;
    }
  }, 180_000);
});
