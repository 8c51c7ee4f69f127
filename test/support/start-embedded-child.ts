/**
 * Child process for the concurrency test: starts (or joins) the embedded server for argv[2], prints
 * what it sees as one JSON line, holds on until stdin closes so all children overlap, then releases
 * like the CLI does on exit.
 */
import pg from 'pg';
import { startEmbeddedPostgres } from '../../src/embedded-postgres.ts';

const server = await startEmbeddedPostgres({ dataDir: process.argv[2]! });
const client = new pg.Client({ connectionString: server.url });
await client.connect();
const { rows } = await client.query<{ port: number; system_identifier: string }>(
  `select current_setting('port')::int as port, system_identifier::text from pg_control_system()`,
);
await client.end();
process.stdout.write(`${JSON.stringify({ startedHere: server.startedHere, ...rows[0] })}\n`);
process.stdin.resume();
await new Promise((resolve) => process.stdin.once('end', resolve));
await server.release();
