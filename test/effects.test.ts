import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { fileURLToPath } from 'node:url';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { defineJob, exitCodeOf, RunFailedError, Runner, type StepContext } from '../src/index.ts';
import notify, { NOTIFY_DDL, type NotifyResult } from './fixtures/effect-jobs/notify.ts';
import { withClient } from './fixtures/tables.ts';
import { expectFaultCrash, expectKilled, killLeftovers, query, runCli, runRow, spawnCli, waitFor, workCounts } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

const EFFECT_JOBS = fileURLToPath(new URL('./fixtures/effect-jobs', import.meta.url));

/** What the receiver does with one request: answer 200, answer 500, or never answer. */
type Action = 'ok' | 'fail' | 'hang';

interface Delivery {
  readonly key: string;
  readonly body: Record<string, unknown>;
  /** 1 for the first request carrying this key, 2 for the second… */
  readonly n: number;
  readonly action: Action;
}

/**
 * A real HTTP receiver on 127.0.0.1: records every request with its Idempotency-Key and body, and
 * answers as `behave` says (200 with `{ delivery: n }` by default).
 */
interface Receiver {
  readonly url: string;
  readonly deliveries: Delivery[];
  behave: (d: { key: string; body: Record<string, unknown>; n: number }) => Action;
  close(): Promise<void>;
}

async function startReceiver(): Promise<Receiver> {
  const deliveries: Delivery[] = [];
  const seen = new Map<string, number>();
  const receiver: Receiver = {
    url: '',
    deliveries,
    behave: () => 'ok',
    close: async () => {
      server.closeAllConnections();
      await new Promise((resolve) => server.close(resolve));
    },
  };
  const server = http.createServer((req, res) => {
    let raw = '';
    req.setEncoding('utf8').on('data', (s: string) => (raw += s));
    req.on('end', () => {
      const key = String(req.headers['idempotency-key'] ?? '');
      const n = (seen.get(key) ?? 0) + 1;
      seen.set(key, n);
      let body: Record<string, unknown> = {};
      try {
        body = JSON.parse(raw);
      } catch {
        // Recorded as {}: a test asserting on the body then fails visibly.
      }
      const action = receiver.behave({ key, body, n });
      deliveries.push({ key, body, n, action });
      if (action === 'hang') return;
      res.writeHead(action === 'ok' ? 200 : 500, { 'content-type': 'application/json' });
      res.end(JSON.stringify(action === 'ok' ? { delivery: n } : { error: 'injected' }));
    });
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const { port } = server.address() as AddressInfo;
  return Object.assign(receiver, { url: `http://127.0.0.1:${port}/notify` });
}

const testDb = useTestDatabase({ fixtureTables: true, prepare: (url) => withClient(url, (c) => c.query(NOTIFY_DDL)), runner: true });
let url: string;
let runner: Runner;
beforeAll(() => {
  ({ url, runner } = testDb);
});

let receiver: Receiver;

beforeAll(async () => {
  receiver = await startReceiver();
});

afterEach(async () => {
  await killLeftovers();
  receiver.behave = () => 'ok';
  await query(url, 'delete from fail_chunks');
});

afterAll(async () => {
  await killLeftovers();
  await receiver?.close();
});

/** The receiver's deliveries for one run key, optionally one chunk and effect name. */
const deliveriesOf = (run: string, chunk?: string, name?: string) =>
  receiver.deliveries.filter((d) => d.body.run === run && (chunk === undefined || d.body.chunk === chunk) && (name === undefined || d.body.name === name));

/** The effects ledger of a run, by `chunk/name`. */
async function ledger(job: string, runKey: string): Promise<Map<string, { idem_key: string; status: string; tries: number; result: unknown }>> {
  const rows = await query(
    url,
    `select e.chunk, e.name, e.idem_key, e.status, e.tries, e.result from idem.effects e join idem.runs r on r.id = e.run_id
      where r.job = $1 and r.run_key = $2 order by e.chunk, e.name`,
    [job, runKey],
  );
  return new Map(rows.map((r) => [`${r.chunk}/${r.name}`, { idem_key: r.idem_key, status: r.status, tries: r.tries, result: r.result }]));
}

/** What each chunk's committed transaction recorded as its effect's result. */
async function results(runKey: string): Promise<Map<string, NotifyResult>> {
  const rows = await query(url, 'select chunk_key, name, result from notify_results where run_key = $1', [runKey]);
  return new Map(rows.map((r) => [`${r.chunk_key}/${r.name}`, r.result as NotifyResult]));
}

/** `fail_chunks` with a SQLSTATE fails `times` tries counted on a sequence shared by the file: start it over. */
async function failTransiently(chunk: string, sqlstate: string, times: number): Promise<void> {
  await query(url, 'alter sequence fixture_tries restart');
  await query(url, 'insert into fail_chunks (chunk_key, sqlstate, times) values ($1, $2, $3)', [chunk, sqlstate, times]);
}

describe('ctx.effect in one process', () => {
  it('an effect runs once: a transient failure after it retries the chunk, which gets the recorded result', async () => {
    // c0002 fails with a serialization failure after its effect, once: its transaction rolls back and retries.
    await failTransiently('c0002', '40001', 1);
    const out = await runner.run(notify, { key: 'fx-once', params: { url: receiver.url, chunks: 3 } });
    expect(out).toMatchObject({ status: 'succeeded', attempt: 1, executed: 3 });

    const tries = await query(url, 'select last_value::int as n from fixture_tries');
    expect(tries[0].n).toBe(2); // c0002's work ran twice: the failing try and the committed one
    for (const chunk of ['c0001', 'c0002', 'c0003']) expect(deliveriesOf('fx-once', chunk)).toHaveLength(1);
    const effects = await ledger('notify', 'fx-once');
    expect([...effects.keys()]).toEqual(['c0001/notify', 'c0002/notify', 'c0003/notify']);
    for (const e of effects.values()) expect(e).toMatchObject({ status: 'done', tries: 1 });
    // The retried transaction got the first call's recorded answer, not a second call's.
    const key = deliveriesOf('fx-once', 'c0002')[0]!.key;
    expect(effects.get('c0002/notify')!.result).toEqual({ status: 200, key, delivery: 1 });
    expect((await results('fx-once')).get('c0002/notify')).toEqual({ status: 200, key, delivery: 1 });
    expect(await workCounts(url, 'fx-once', 'send')).toEqual(new Map([['c0001', 1], ['c0002', 1], ['c0003', 1]]));
  });

  it('an effect whose call fails (HTTP 500) is performed again with the same key when the run is resumed', async () => {
    receiver.behave = ({ body, n }) => (body.chunk === 'c0002' && n === 1 ? 'fail' : 'ok');
    const params = { url: receiver.url, chunks: 3 };
    const failed = await runner.run(notify, { key: 'fx-500', params }).then(
      () => null,
      (e: unknown) => e,
    );
    expect(failed).toBeInstanceOf(RunFailedError);
    expect(exitCodeOf(failed)).toBe(1);
    expect((failed as Error).message).toMatch(/chunk c0002 after 1 try: receiver answered 500 for c0002\/notify/);
    expect(await runRow(url, 'notify', 'fx-500')).toMatchObject({ status: 'failed', attempt: 1 });
    const before = await ledger('notify', 'fx-500');
    expect(before.get('c0001/notify')).toMatchObject({ status: 'done', tries: 1 });
    expect(before.get('c0002/notify')).toMatchObject({ status: 'started', tries: 1, result: null });
    expect(before.has('c0003/notify')).toBe(false);

    const resumed = await runner.run(notify, { key: 'fx-500', params });
    expect(resumed).toMatchObject({ status: 'succeeded', attempt: 2, executed: 2 });
    const sent = deliveriesOf('fx-500', 'c0002');
    expect(sent.map((d) => [d.n, d.action])).toEqual([[1, 'fail'], [2, 'ok']]);
    expect(sent[1]!.key).toBe(sent[0]!.key);
    const after = await ledger('notify', 'fx-500');
    expect(after.get('c0002/notify')).toEqual({ idem_key: sent[0]!.key, status: 'done', tries: 2, result: { status: 200, key: sent[0]!.key, delivery: 2 } });
    // The chunk done before the failure is not performed again.
    expect(deliveriesOf('fx-500', 'c0001')).toHaveLength(1);
    expect(await workCounts(url, 'fx-500', 'send')).toEqual(new Map([['c0001', 1], ['c0002', 1], ['c0003', 1]]));
  });

  it('an effect whose call times out is performed again with the same key when the run is resumed', async () => {
    receiver.behave = ({ body, n }) => (body.chunk === 'c0001' && n === 1 ? 'hang' : 'ok');
    const params = { url: receiver.url, chunks: 2, timeoutMs: 300 };
    const failed = await runner.run(notify, { key: 'fx-timeout', params }).then(
      () => null,
      (e: unknown) => e,
    );
    expect(failed).toBeInstanceOf(RunFailedError);
    expect((await ledger('notify', 'fx-timeout')).get('c0001/notify')).toMatchObject({ status: 'started', tries: 1 });
    expect(await workCounts(url, 'fx-timeout', 'send')).toEqual(new Map());

    await runner.run(notify, { key: 'fx-timeout', params });
    const sent = deliveriesOf('fx-timeout', 'c0001');
    expect(sent.map((d) => d.action)).toEqual(['hang', 'ok']);
    expect(new Set(sent.map((d) => d.key)).size).toBe(1);
    expect((await ledger('notify', 'fx-timeout')).get('c0001/notify')).toMatchObject({ idem_key: sent[0]!.key, status: 'done', tries: 2 });
  });
});

describe('effect names within a chunk', () => {
  it('a name used twice in one chunk fails the chunk, naming the fix; the second call is not silently answered by the first', async () => {
    const calls: string[] = [];
    const twice = defineJob({
      name: 'fx-twice',
      steps: [
        {
          name: 'send',
          chunks: () => ({ chunks: [{ key: 'a', to: ['x@example.com', 'y@example.com'] }], next: null }),
          async run(ctx: StepContext, c: { key: string; to: string[] }) {
            for (const to of c.to) await ctx.effect('email', () => void calls.push(to));
          },
        },
      ],
    });
    const err = await runner.run(twice, { key: 'fx-twice' }).then(() => null, (e: unknown) => e);
    expect(err).toBeInstanceOf(RunFailedError);
    expect(exitCodeOf(err)).toBe(1);
    expect((err as Error).message).toContain('ctx.effect(): name "email" was already used in chunk a');
    expect((err as Error).message).toContain('unique within its chunk');
    // Before: two recipients, one call, no error.
    expect(calls).toEqual(['x@example.com']);
    // Distinct names per recipient: both sent, each once.
    const distinct = defineJob({
      name: 'fx-distinct',
      steps: [
        {
          name: 'send',
          chunks: () => ({ chunks: [{ key: 'a', to: ['x@example.com', 'y@example.com'] }], next: null }),
          async run(ctx: StepContext, c: { key: string; to: string[] }) {
            for (const [i, to] of c.to.entries()) await ctx.effect(`email:${i}`, () => void calls.push(to));
          },
        },
      ],
    });
    calls.length = 0;
    expect(await runner.run(distinct, { key: 'fx-distinct' })).toMatchObject({ status: 'succeeded' });
    expect(calls).toEqual(['x@example.com', 'y@example.com']);
  });
});

describe('effect names within a chunk, called at once', () => {
  it('Promise.all over ctx.effect with one name: the chunk fails, the run ends as documented, no unhandled rejection', async () => {
    const parallel = defineJob({
      name: 'fx-parallel',
      steps: [
        {
          name: 'send',
          maxFailedChunks: 5,
          chunks: () => ({ chunks: ['a', 'b', 'c'].map((key) => ({ key })), next: null }),
          async run(ctx: StepContext) {
            await Promise.all(
              [1, 2].map((u) =>
                ctx.effect('email', async () => {
                  await new Promise((r) => setTimeout(r, 50));
                  throw new Error(`mail server said 503 for user ${u}`);
                }),
              ),
            );
          },
        },
      ],
    });
    const unhandled: unknown[] = [];
    const onUnhandled = (err: unknown) => unhandled.push(err);
    process.on('unhandledRejection', onUnhandled);
    try {
      const out = await runner.run(parallel, { key: 'fx-parallel' });
      expect(out).toMatchObject({ status: 'succeeded', summary: { skipped: 3 } });
      await new Promise((r) => setTimeout(r, 300)); // the first calls' rejections settle
    } finally {
      process.off('unhandledRejection', onUnhandled);
    }
    // Before: the duplicate threw synchronously inside map(), so Promise.all never held the first
    // call's promise, and its rejection was unhandled (a CLI process died with a raw stack trace).
    expect(unhandled).toEqual([]);
    const [row] = await query(url, `select count(*) filter (where c.skipped_at is not null)::int as skipped from idem.chunks c join idem.runs r on r.id = c.run_id where r.job = 'fx-parallel'`);
    expect(row.skipped).toBe(3);
  });
});

describe('effect keys', () => {
  it('are stable across processes and attempts, and differ per chunk, per name and per run', async () => {
    // The first process hangs in c0002's first effect and is killed there: the ledger says started.
    receiver.behave = ({ body, n }) => (body.run === 'fx-proc' && body.chunk === 'c0002' && body.name === 'notify' && n === 1 ? 'hang' : 'ok');
    const args = ['--jobs-dir', EFFECT_JOBS, 'run', 'notify', '--key', 'fx-proc', '--param', `url=${receiver.url}`, '--param', 'chunks=3', '--param', 'names=["notify","audit"]', '--json'];
    const first = spawnCli(args, { url });
    await waitFor(async () => deliveriesOf('fx-proc', 'c0002', 'notify').length === 1, 'the first process to hang in c0002');
    first.child.kill('SIGKILL');
    expectKilled(await first.done);
    const killed = await ledger('notify', 'fx-proc');
    expect(killed.get('c0002/notify')).toMatchObject({ status: 'started', tries: 1 });
    expect([...killed.keys()]).toEqual(['c0001/audit', 'c0001/notify', 'c0002/notify']);

    // A new process (the killed one's lock session may linger a moment: wait for it) resumes.
    const second = await runCli([...args.slice(0, -1), '--wait', '10', '--json'], { url });
    expect(second.code).toBe(0);
    expect(JSON.parse(second.stdout)).toMatchObject({ status: 'succeeded', attempt: 2 });

    const sent = deliveriesOf('fx-proc');
    const keyOf = new Map<string, Set<string>>();
    for (const d of sent) keyOf.set(`${d.body.chunk}/${d.body.name}`, (keyOf.get(`${d.body.chunk}/${d.body.name}`) ?? new Set()).add(d.key));
    // Six (chunk, name) pairs, each under exactly one key, no two pairs sharing one.
    expect([...keyOf.keys()].sort()).toEqual(['c0001/audit', 'c0001/notify', 'c0002/audit', 'c0002/notify', 'c0003/audit', 'c0003/notify']);
    for (const keys of keyOf.values()) expect(keys.size).toBe(1);
    const keys = [...keyOf.values()].map((s) => [...s][0]!);
    expect(new Set(keys).size).toBe(6);
    // The interrupted effect was sent by both processes with the same key; the rest once each.
    expect(deliveriesOf('fx-proc', 'c0002', 'notify').map((d) => d.n)).toEqual([1, 2]);
    expect(sent).toHaveLength(7);
    const done = await ledger('notify', 'fx-proc');
    for (const [pair, e] of done) {
      expect(e.status).toBe('done');
      expect(e.idem_key).toBe([...keyOf.get(pair)!][0]);
    }
    expect(done.get('c0002/notify')!.tries).toBe(2);

    // Another run key: same chunks and names, all new keys.
    await runner.run(notify, { key: 'fx-proc-other', params: { url: receiver.url, chunks: 3, names: ['notify', 'audit'] } });
    const otherKeys = new Set(deliveriesOf('fx-proc-other').map((d) => d.key));
    expect(otherKeys.size).toBe(6);
    for (const k of keys) expect(otherKeys.has(k)).toBe(false);
  });
});

describe('jobs/send-reservation-reminders', () => {
  const N = 450;

  it('delivers every reservation under one key and records it once, through crashes, kills and receiver errors', async () => {
    const [migrated, badUrl] = await Promise.all([runCli(['migrate'], { url }), runCli(['run', 'send-reservation-reminders', '--param', 'url=ftp://example.com/x'], { url })]);
    expect(migrated.code, migrated.stderr).toBe(0);
    // Params are checked before anything runs.
    expect(badUrl.code).toBe(2);
    expect(badUrl.stderr).toMatch('invalid params for job "send-reservation-reminders": url must be an http(s) URL');
    await query(
      url,
      `insert into reservations (item_code, quantity, reserved_by)
       select 'ITEM-' || lpad((g % 50)::text, 2, '0'), 1 + g % 5, 'user' || g || '@example.com' from generate_series(1, $1::int) g`,
      [N],
    );
    // One reservation, in the last chunk (so the crashes come first), is refused once (HTTP 500):
    // that round fails and a later one resends it.
    const refused = 440;
    receiver.behave = ({ body, n }) => (body.reservationId === refused && n === 1 ? 'fail' : 'ok');

    // A seeded generator, so a failing sequence of rounds can be replayed.
    let seed = 20261130;
    const random = () => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) / 2 ** 31);
    const args = ['run', 'send-reservation-reminders', '--param', `url=${receiver.url}`, '--wait', '10', '--json'];
    const rounds: string[] = [];
    let succeeded = false;
    for (let round = 1; round <= 30 && !succeeded; round++) {
      // Alternate a fault-injected crash after a chunk's work, before its marker (in the first
      // round, hit 1 is the create-table step), with a SIGKILL from outside after a random number of new deliveries,
      // which lands anywhere: mid-request, between the answer and the ledger, mid-transaction.
      const crash = round % 2 === 1;
      const env = crash ? { IDEM_FAULT: `after-work:crash:${2 + Math.floor(random() * 3)}` } : undefined;
      const child = spawnCli(args, { url, ...(env ? { env } : {}) });
      let exited = false;
      const r = await Promise.all([
        child.done.finally(() => (exited = true)),
        crash
          ? undefined
          : (async (target: number) => {
              while (!exited && receiver.deliveries.length < target) await new Promise((res) => setTimeout(res, 5));
              if (!exited) child.child.kill('SIGKILL');
            })(receiver.deliveries.length + 1 + Math.floor(random() * 100)),
      ]).then(([result]) => result);
      const faulted = r.stderr.includes('idem: fault injected at after-work (crash)');
      rounds.push(`${round}:${env?.IDEM_FAULT ?? 'kill'}:${r.code ?? r.signal}${faulted ? ':faulted' : ''}`);
      if (r.code === 0) {
        succeeded = true;
        expect(JSON.parse(r.stdout)).toMatchObject({ status: 'succeeded', job: 'send-reservation-reminders' });
      } else if (r.code === 1) {
        expect(r.stderr).toMatch(/receiver answered 500/);
      } else if (crash) {
        expectFaultCrash(r, 'after-work');
      } else {
        expectKilled(r);
      }
    }
    expect(succeeded, rounds.join(' ')).toBe(true);
    // Both kinds of death happened: the injected crash and a kill from outside.
    expect(rounds.some((r) => r.endsWith(':SIGKILL:faulted')), rounds.join(' ')).toBe(true);
    expect(rounds.some((r) => r.includes(':kill:SIGKILL')), rounds.join(' ')).toBe(true);

    // The database: one record per reservation, each under the key its effect was given.
    const recorded = await query(
      url,
      `select m.reservation_id::int as id, m.effect_key, m.receiver_status, e.idem_key, e.status, e.result
         from reservation_reminders m
         left join idem.effects e on e.name = 'reminder:' || m.reservation_id
         order by m.reservation_id`,
    );
    expect(recorded.map((r) => r.id)).toEqual(Array.from({ length: N }, (_, i) => i + 1));
    for (const r of recorded) {
      expect(r).toMatchObject({ effect_key: r.idem_key, receiver_status: 200, status: 'done', result: { status: 200, key: r.idem_key } });
    }
    const effects = await query(url, `select count(*)::int as n from idem.effects where name like 'reminder:%'`);
    expect(effects[0].n).toBe(N);

    // The receiver: every reservation under exactly one key, that key answered 200 at least once.
    const keysById = new Map<number, Set<string>>();
    for (const d of receiver.deliveries) {
      const id = d.body.reservationId as number | undefined;
      if (id !== undefined) keysById.set(id, (keysById.get(id) ?? new Set()).add(d.key));
    }
    expect(keysById.size).toBe(N);
    for (const r of recorded) {
      expect([...keysById.get(r.id)!]).toEqual([r.effect_key]);
      expect(receiver.deliveries.some((d) => d.key === r.effect_key && d.action === 'ok')).toBe(true);
    }
    // The refused reminder was sent again (under its one key) until it was answered.
    const refusedSends = receiver.deliveries.filter((d) => d.body.reservationId === refused).map((d) => d.action);
    expect(refusedSends[0]).toBe('fail');
    expect(refusedSends).toContain('ok');
  });
});

describe('effect results', () => {
  it('one that cannot be recorded as JSON (a BigInt, U+0000) fails the chunk naming the effect and the fix', async () => {
    const calls: string[] = [];
    for (const [name, value] of [['bigint', 12n], ['nul', 'a\u0000b']] as const) {
      const job = defineJob({
        name: `fx-result-${name}`,
        steps: [
          {
            name: 'send',
            chunks: () => ({ chunks: [{ key: 'a' }], next: null }),
            async run(ctx: StepContext) {
              await ctx.effect('charge', () => {
                calls.push(name);
                return { id: value } as never; // what a JavaScript job can return
              });
            },
          },
        ],
      });
      const err = await runner.run(job, { key: `fx-result-${name}` }).then(() => null, (e: unknown) => e);
      expect(err, name).toBeInstanceOf(RunFailedError);
      // Before: "Do not know how to serialize a BigInt" / "unsupported Unicode escape sequence".
      expect((err as Error).message, name).toMatch(/ctx\.effect\(\): the result of effect "charge" cannot be recorded as JSON \((a BigInt|U\+0000)[^)]*\); return plain JSON/);
    }
    expect(calls).toEqual(['bigint', 'nul']);
  });
});
