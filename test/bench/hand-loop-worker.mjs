// One process of bench 8's hand loops: the chunks [from, to) of a bench table, each in its own
// transaction (BEGIN; mark the chunk done; the chunk's work; COMMIT) with no coordination at all:
// the chunk list is split between the processes in advance. What N processes can do on this machine
// with nothing in the way, next to idem's N workers sharing one run.
// DATABASE_URL in the environment (never in argv, where `ps` shows it to every user). argv: the
// marker statement ($1 = chunk index, $2 = label), the work statement (with `range`: $1 = lo,
// $2 = hi; else no parameters), 'range' or 'none', rows per chunk, from, to, label. The statements
// are built by bench-workers.ts from the bench's own (chunkUpdateSql), so both loops do the same work.
import pg from 'pg';

const [markSql, workSql, params, size, from, to, label] = process.argv.slice(2);
const client = new pg.Client({ connectionString: process.env.DATABASE_URL, application_name: 'bench-hand-loop' });
await client.connect();
const n = Number(size);
for (let i = Number(from); i < Number(to); i++) {
  // ids are 1..rows without gaps (tables.ts), so chunk i is [1 + i·size, 1 + (i+1)·size), as keyRange cuts it.
  const lo = 1 + i * n;
  await client.query('begin');
  await client.query(markSql, [i, label]);
  await client.query(workSql, params === 'range' ? [lo, lo + n] : []);
  await client.query('commit');
}
await client.end();
