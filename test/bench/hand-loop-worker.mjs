// One process of bench 8's hand loops: the chunks [from, to) of a bench table, each in its own
// transaction (BEGIN; mark the chunk done; the chunk's work; COMMIT) with no coordination at all:
// the chunk list is split between the processes in advance. What N processes can do on this machine
// with nothing in the way, next to idem's N workers sharing one run.
// DATABASE_URL in the environment (never in argv, where `ps` shows it to every user);
// argv: marks table, bench table, work ('sleep' | 'update'), sleepMs, rows per chunk, from, to, label
import pg from 'pg';

const [marks, table, work, sleepMs, size, from, to, label] = process.argv.slice(2);
const url = process.env.DATABASE_URL;
const IDENT = /^[a-z_][a-z0-9_]{0,62}$/;
if (!IDENT.test(marks) || !IDENT.test(table)) throw new Error('bench table names must be plain identifiers');
const text =
  work === 'sleep'
    ? `select pg_sleep(${Number(sleepMs) / 1000})`
    : `update ${table} set normalized = lower(payload) where id >= $1 and id < $2 and normalized is distinct from lower(payload)`;
const client = new pg.Client({ connectionString: url, application_name: 'bench-hand-loop' });
await client.connect();
const n = Number(size);
for (let i = Number(from); i < Number(to); i++) {
  // ids are 1..rows without gaps (tables.ts), so chunk i is [1 + i·size, 1 + (i+1)·size), as keyRange cuts it.
  const lo = 1 + i * n;
  await client.query('begin');
  await client.query(`update ${marks} set done_at = clock_timestamp(), done_by = $2 where seq = $1`, [i, label]);
  await client.query(text, work === 'sleep' ? [] : [lo, lo + n]);
  await client.query('commit');
}
await client.end();
