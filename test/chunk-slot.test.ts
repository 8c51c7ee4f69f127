import pg from 'pg';
import { afterAll, beforeAll, beforeEach, describe, expect, it } from 'vitest';
import { sql } from '../src/index.ts';
import { CommitUnknownError, openChunkSlot } from '../src/chunk-slot.ts';
import { query } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';

/**
 * A COMMIT that fails ends the transaction on the server (the fence refusing a chunk of a run that
 * ended, a deferred constraint). What the slot sends after it: until 2026-12-04 a ROLLBACK, which
 * the server answers with `WARNING: there is no transaction in progress`, one line in its log for
 * every such chunk (black-box round 15, B1-3). PostgreSQL sends that WARNING to the client as a
 * notice too: the test counts them on the slot's own connections.
 */
const db = useTestDatabase({
  prepare: (url) => query(url, `create table slot_refs (id int primary key, ref int references slot_refs (id) deferrable initially deferred)`),
});

let pool: pg.Pool;
const notices: string[] = [];
beforeAll(() => {
  pool = new pg.Pool({ connectionString: db.url, max: 2 });
  pool.on('connect', (c) => c.on('notice', (n) => notices.push(`${n.severity}: ${n.message}`)));
});
afterAll(() => pool?.end());
beforeEach(async () => {
  notices.length = 0;
  await query(db.url, 'delete from slot_refs');
});

/** A row whose deferred foreign key fails at COMMIT, not before: the COMMIT ends the transaction with an error. */
const violate = (slot: ReturnType<typeof openChunkSlot>) => sql`insert into slot_refs (id, ref) values (1, 99)`.execute(slot.trx);

/** The slot's connection is usable: a chunk transaction opens, writes and commits on it. */
async function expectUsable(slot: ReturnType<typeof openChunkSlot>): Promise<void> {
  expect(await slot.begin<{ x: number }>('select 1 as x')).toEqual([{ x: 1 }]);
  await sql`insert into slot_refs (id, ref) values (2, null)`.execute(slot.trx);
  await slot.commit();
  expect(await query(db.url, 'select id from slot_refs')).toEqual([{ id: 2 }]);
}

describe('a chunk slot after a COMMIT that failed', () => {
  it('commit() then rollback(): no ROLLBACK sent (no server WARNING), the connection usable', async () => {
    const slot = openChunkSlot(pool, []);
    try {
      await slot.begin('select 1');
      await violate(slot);
      await expect(slot.commit()).rejects.toMatchObject({ code: '23503' });
      await slot.rollback();
      expect(notices).toEqual([]);
      await expectUsable(slot);
      expect(notices).toEqual([]);
    } finally {
      slot.release();
    }
  });

  it('commitAndBegin(): its COMMIT failing, no ROLLBACK follows it, and no claim ran', async () => {
    const slot = openChunkSlot(pool, []);
    try {
      await slot.begin('select 1');
      await violate(slot);
      const err = await slot.commitAndBegin('select 1 as x').catch((e: unknown) => e);
      expect(err).toBeInstanceOf(CommitUnknownError);
      expect((err as CommitUnknownError).cause).toMatchObject({ code: '23503' });
      expect(slot.open).toBe(false);
      await slot.rollback();
      expect(notices).toEqual([]);
      await expectUsable(slot);
      expect(notices).toEqual([]);
    } finally {
      slot.release();
    }
  });

  it("rollbackWith(): the statement runs on its own, without the ROLLBACK, and its rows come back", async () => {
    const slot = openChunkSlot(pool, []);
    try {
      await slot.begin('select 1');
      await violate(slot);
      await expect(slot.commit()).rejects.toMatchObject({ code: '23503' });
      expect(await slot.rollbackWith<{ y: number }>('select 2 as y')).toEqual([{ y: 2 }]);
      expect(notices).toEqual([]);
      await expectUsable(slot);
    } finally {
      slot.release();
    }
  });

  it('a transaction still open (aborted by a failed statement) is rolled back as before', async () => {
    const slot = openChunkSlot(pool, []);
    try {
      await slot.begin('select 1');
      await expect(sql`select 1 / 0`.execute(slot.trx)).rejects.toMatchObject({ code: '22012' });
      await slot.rollback();
      expect(slot.open).toBe(false);
      expect(notices).toEqual([]);
      await expectUsable(slot);
    } finally {
      slot.release();
    }
  });
});
