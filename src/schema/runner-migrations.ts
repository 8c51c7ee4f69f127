import { Migrator, sql, type Kysely, type Migration, type MigrationProvider } from 'kysely';
import { isStatementTimeout } from '../database.ts';
import { codeOf, DatabaseUnavailableError, UsageError } from '../errors.ts';

/** Kysely's bookkeeping tables for the runner's own schema; kept inside that schema. */
export const MIGRATION_TABLE = 'idem_migration';
export const MIGRATION_LOCK_TABLE = 'idem_migration_lock';

/**
 * The runner's own tables. Names sort in order; never edit a shipped migration, add one.
 * The schema name is a parameter, so every migration is built for it.
 */
function runnerMigrations(schema: string): Record<string, Migration> {
  const t = (name: string) => sql.id(schema, name);
  return {
    '0001_runs_steps_chunks': {
      async up(db) {
        await sql`create table ${t('runs')} (
          id bigint generated always as identity primary key,
          job text not null,
          run_key text not null,
          params jsonb not null,
          fingerprint text not null,
          status text not null default 'pending'
            check (status in ('pending', 'running', 'succeeded', 'failed', 'interrupted', 'paused', 'cancelled')),
          attempt integer not null default 0,
          holder text,
          created_at timestamptz not null default now(),
          started_at timestamptz,
          updated_at timestamptz not null default now(),
          finished_at timestamptz,
          summary jsonb,
          error jsonb,
          constraint runs_job_run_key_key unique (job, run_key)
        )`.execute(db);
        // idem status / list: newest runs of a job first.
        await sql`create index runs_job_created_at_idx on ${t('runs')} (job, created_at desc)`.execute(db);
        await sql`create table ${t('steps')} (
          run_id bigint not null references ${t('runs')} (id) on delete cascade,
          name text not null,
          position integer not null,
          status text not null default 'pending' check (status in ('pending', 'running', 'done')),
          cursor jsonb,
          planned_all boolean not null default false,
          planned integer not null default 0,
          started_at timestamptz,
          finished_at timestamptz,
          primary key (run_id, name)
        )`.execute(db);
        await sql`create table ${t('chunks')} (
          run_id bigint not null,
          step text not null,
          key text not null,
          seq integer not null,
          spec jsonb not null,
          planned_at timestamptz not null default now(),
          done_at timestamptz,
          done_attempt integer,
          attempts integer not null default 0,
          duration_ms integer,
          error text,
          primary key (run_id, step, key),
          foreign key (run_id, step) references ${t('steps')} (run_id, name) on delete cascade
        )`.execute(db);
        // The resume scan: a step's unfinished chunks in plan order. Partial, so it stays as small
        // as the work left, however many chunks are done.
        await sql`create index chunks_pending_idx on ${t('chunks')} (run_id, step, seq) where done_at is null`.execute(db);
      },
    },
    '0002_skips_fencing_time_effects_control': {
      async up(db) {
        // A chunk that failed for good under a step's skip policy; pending scans pass over it.
        await sql`alter table ${t('chunks')} add column skipped_at timestamptz`.execute(db);
        // When the current attempt took the run over: proves no older attempt committed after it.
        await sql`alter table ${t('runs')} add column attempt_started_at timestamptz`.execute(db);
        // An operator's request (pause, cancel) that the live attempt honours between chunks.
        await sql`alter table ${t('runs')} add column requested text check (requested in ('pause', 'cancel'))`.execute(db);
        // Side effects outside the database, keyed so a retry sends the same idempotency key.
        await sql`create table ${t('effects')} (
          run_id bigint not null references ${t('runs')} (id) on delete cascade,
          step text not null,
          chunk text not null,
          name text not null,
          idem_key text not null unique,
          status text not null default 'started' check (status in ('started', 'done')),
          tries integer not null default 1,
          result jsonb,
          started_at timestamptz not null default now(),
          done_at timestamptz,
          primary key (run_id, step, chunk, name)
        )`.execute(db);
      },
    },
    '0003_step_estimates': {
      async up(db) {
        // A chunk source's estimate of its total (keyRange: from table statistics), for status/ETA.
        await sql`alter table ${t('steps')} add column estimated_chunks integer`.execute(db);
      },
    },
    '0004_run_lock_name': {
      async up(db) {
        // Which advisory lock the live attempt holds (a job's own, or idem migrate's), so status
        // reports "running" only for the run whose lock is really held.
        await sql`alter table ${t('runs')} add column lock_name text`.execute(db);
      },
    },
    '0005_run_lock_pid_chunk_done_by': {
      async up(db) {
        // The backend that holds the live attempt's lock: "running" is per run (that backend holds
        // that lock), not "someone holds this job's lock", which a crashed run's row would inherit.
        await sql`alter table ${t('runs')} add column lock_pid integer`.execute(db);
        // Which worker (host:pid) committed a chunk: per-worker counts and rates in idem status.
        await sql`alter table ${t('chunks')} add column done_by text`.execute(db);
      },
    },
    '0006_code_fingerprint_health': {
      async up(db) {
        // The job definition's fingerprint (its declared version, or its file's hash) the run was
        // started under: a resume under other code is refused unless an operator allows it.
        await sql`alter table ${t('runs')} add column code_fingerprint text`.execute(db);
        // Every allowed change of code between attempts ({ from, to, attempt, at }), for idem status.
        await sql`alter table ${t('runs')} add column code_changes jsonb`.execute(db);
        // Why the live attempt is waiting for the database's health ({ reason, since }), else null.
        await sql`alter table ${t('runs')} add column health_pause jsonb`.execute(db);
      },
    },
    '0007_api_requests': {
      async up(db) {
        // The request that created a run over HTTP (idem serve), written in the transaction that
        // claims the run: the run is "the server's to execute and resume". Deleted with its run
        // (prune, reset), after which the Idempotency-Key may be used again.
        await sql`create table ${t('api_requests')} (
          run_id bigint primary key references ${t('runs')} (id) on delete cascade,
          job text not null,
          idempotency_key text not null,
          fingerprint text not null,
          created_at timestamptz not null default now()
        )`.execute(db);
      },
    },
    '0008_chunk_fence_at_commit': {
      async up(db) {
        // A chunk is claimed and marked done by one statement at the start of its transaction; this
        // checks, at COMMIT, that the attempt that marked it is still the run's attempt. The run
        // row is share-locked until the commit ends, so a takeover's attempt bump (an UPDATE of
        // that row) either waits for this commit or makes it fail: a zombie never commits a chunk
        // after it was fenced off. SQLSTATE IF001 is how the runner tells this refusal apart.
        await sql`create function ${t('chunk_fence')}() returns trigger language plpgsql as $fence$
          begin
            perform 1 from ${t('runs')} where id = new.run_id and attempt = new.done_attempt for share;
            if not found then
              raise exception 'idem: attempt % of run % was fenced off; chunk % rolled back', new.done_attempt, new.run_id, new.key
                using errcode = 'IF001';
            end if;
            return null;
          end $fence$`.execute(db);
        await sql`create constraint trigger chunk_fence after update of done_at on ${t('chunks')}
          deferrable initially deferred for each row
          when (old.done_at is null and new.done_at is not null)
          execute function ${t('chunk_fence')}()`.execute(db);
      },
    },
    '0009_succeeded_run_changed': {
      async up(db) {
        // idem serve answers Idempotency-Key replays of succeeded runs from memory (a succeeded run
        // does not change by itself). Whatever does change or remove one (prune, reset, a
        // --retry-skipped rerun, a hand-written UPDATE, DELETE or TRUNCATE) notifies the servers at
        // its commit, and they forget that run ('*': every run of the schema). Only rows that were
        // succeeded fire, so the chunk path and a running run's own updates never pay for it.
        await sql`create function ${t('succeeded_run_changed')}() returns trigger language plpgsql as $notify$
          begin
            if tg_op = 'TRUNCATE' then
              perform pg_notify('idem_succeeded_run_changed', tg_table_schema || ' *');
            else
              perform pg_notify('idem_succeeded_run_changed', tg_table_schema || ' ' || old.id);
            end if;
            return null;
          end $notify$`.execute(db);
        await sql`create trigger succeeded_run_changed after update or delete on ${t('runs')}
          for each row when (old.status = 'succeeded')
          execute function ${t('succeeded_run_changed')}()`.execute(db);
        await sql`create trigger runs_truncated after truncate on ${t('runs')}
          for each statement execute function ${t('succeeded_run_changed')}()`.execute(db);
      },
    },
    '0010_shared_retries_and_rate': {
      async up(db) {
        // A chunk's transient failures, counted on the chunk itself so every worker sharing a run
        // spends one retry budget and honours one backoff: the tries of the run's attempt
        // `retry_attempt`, and the moment before which no claim takes the chunk again. Written
        // outside the chunk's rolled-back transaction. Adding columns with constant defaults
        // rewrites nothing.
        await sql`alter table ${t('chunks')}
          add column retry_tries integer not null default 0,
          add column retry_attempt integer,
          add column retry_at timestamptz`.execute(db);
        // --max-rate for the whole run: the earliest moment the step's next chunk may start,
        // reserved by every worker in turn.
        await sql`alter table ${t('steps')} add column rate_next timestamptz`.execute(db);
      },
    },
    '0011_rate_reserved_by': {
      async up(db) {
        // Who reserved rate_next: the run's attempt and the interval (ms) it reserved at. A
        // reservation of another attempt (one interrupted or failed, whose reserved starts never
        // happen) or of another rate never makes a start wait longer than the current interval.
        await sql`alter table ${t('steps')}
          add column rate_attempt integer,
          add column rate_interval_ms float8`.execute(db);
      },
    },
    '0012_run_kind_deleting': {
      async up(db) {
        // kind: a migration's run is what makes it run once per database, so prune keeps it.
        // 'deleting': prune marks a run before deleting its markers in batches, so a prune killed
        // between batches leaves a run nobody can revive, finished by the next prune or a rerun.
        await sql`alter table ${t('runs')}
          add column kind text not null default 'job' check (kind in ('job', 'migration')),
          drop constraint runs_status_check,
          add constraint runs_status_check
            check (status in ('pending', 'running', 'succeeded', 'failed', 'interrupted', 'paused', 'cancelled', 'deleting'))`.execute(db);
      },
    },
    '0013_runs_open_idx': {
      async up(db) {
        // The dashboard's active and pending lists and their counts, and GET /api/runs?state=…
        // (run-view.ts): runs of a status a run can still leave, newest first. Without it each read
        // scanned the table (a few active runs among a million: ~0.5 s a list). Partial, so it holds
        // only the runs that have not ended (a few kB however many have ended), and a run entering
        // or leaving it is the only write it costs; `not in (…)` is the `active` filter's own text.
        // Keyed by id first: a list of several statuses (active) reads it newest first and stops at
        // its limit; (status, id) would have to sort, and the planner then often preferred walking
        // the primary key through every ended run. status second: counts read the index alone.
        // Plain CREATE INDEX (a migration is one transaction): it holds writes to runs while it
        // reads the table, ~0.5 s per million runs, once.
        await sql`create index runs_open_idx on ${t('runs')} (id, status) where status not in ('succeeded', 'cancelled')`.execute(db);
      },
    },
    '0014_chunk_fence_definer': {
      async up(db) {
        // The fence reads the run's row at COMMIT. Before PostgreSQL 17 a deferred trigger runs as
        // the role current at COMMIT, so a chunk that switched role (`set local role app_rw`) was
        // refused ("permission denied for schema idem") unless that role had idem's tables. It runs
        // as the schema's owner now. Every name in it is qualified, operators too, so a search_path
        // a caller set cannot put an object of theirs in it; and no SET clause, which would cost
        // every COMMIT a configuration change.
        await sql`create or replace function ${t('chunk_fence')}() returns trigger language plpgsql security definer as $fence$
          begin
            perform 1 from ${t('runs')} where id operator(pg_catalog.=) new.run_id and attempt operator(pg_catalog.=) new.done_attempt for share;
            if not found then
              raise exception 'idem: attempt % of run % was fenced off; chunk % rolled back', new.done_attempt, new.run_id, new.key
                using errcode = 'IF001';
            end if;
            return null;
          end $fence$`.execute(db);
      },
    },
    '0015_chunk_fence_running': {
      async up(db) {
        // The fence also refuses a chunk of a run that is no longer running under its attempt: one
        // that ended (succeeded, failed) while a worker sharing the attempt still had a chunk in
        // flight. Black-box round 13: a worker under the run's earlier code (another had joined
        // with --allow-changed-code and dropped a step) kept committing that step's chunks for
        // seconds after the run had succeeded. Same lookup, so a COMMIT costs nothing more.
        await sql`create or replace function ${t('chunk_fence')}() returns trigger language plpgsql security definer as $fence$
          begin
            perform 1 from ${t('runs')} where id operator(pg_catalog.=) new.run_id and attempt operator(pg_catalog.=) new.done_attempt
              and status operator(pg_catalog.=) 'running' for share;
            if not found then
              raise exception 'idem: attempt % of run % was fenced off (taken over, or the run ended); chunk % rolled back', new.done_attempt, new.run_id, new.key
                using errcode = 'IF001';
            end if;
            return null;
          end $fence$`.execute(db);
      },
    },
    '0016_chunk_fence_sql_lookup': {
      async up(db) {
        // The same fence, the same lookup, the same lock, cheaper at COMMIT. With the lookup run by
        // PL/pgSQL (through SPI), pgbench (PostgreSQL 18, one client, the claim and a one-row UPDATE
        // per transaction, 10,000 a turn, four alternations) took 0.24-0.86 ms a transaction, median
        // 0.47; with it in this SQL function 0.25-0.40, median 0.26; without a fence 0.24-0.31. The
        // trigger's body only calls it: a plain expression, which PL/pgSQL evaluates without SPI.
        // SECURITY DEFINER (as the trigger, 0014): it runs as the schema's owner whatever role the
        // chunk switched to, and is never inlined into the caller (which would bring SPI back).
        // VOLATILE (the default): FOR SHARE needs it, and each call reads the run row at its latest.
        // Positional parameters: in a SQL function a column of the same name would take a named one's place.
        await sql`create or replace function ${t('chunk_fence_holds')}(bigint, integer) returns boolean language sql security definer as $holds$
          select exists (select 1 from ${t('runs')} r where r.id operator(pg_catalog.=) $1
            and r.attempt operator(pg_catalog.=) $2 and r.status operator(pg_catalog.=) 'running' for share)
          $holds$`.execute(db);
        await sql`create or replace function ${t('chunk_fence')}() returns trigger language plpgsql security definer as $fence$
          begin
            if not ${t('chunk_fence_holds')}(new.run_id, new.done_attempt) then
              raise exception 'idem: attempt % of run % was fenced off (taken over, or the run ended); chunk % rolled back', new.done_attempt, new.run_id, new.key
                using errcode = 'IF001';
            end if;
            return null;
          end $fence$`.execute(db);
      },
    },
  };
}

/** The names this build of idem knows, in order. */
export function knownMigrationNames(schema = 'idem'): string[] {
  return Object.keys(runnerMigrations(schema)).sort();
}

/**
 * Brings the runner's schema to the latest version. The fast path is one query: when every known
 * migration is recorded, nothing else runs (so a no-op rerun stays O(1)). Kysely's Migrator takes
 * a lock of its own, so every pod of a deploy may call this at once. With `read` access, or
 * `create` false, a schema that has no idem bookkeeping is left as it is: false (there is nothing
 * to read, and no run to act on). The first creation is one transaction (see createRunnerSchema).
 */
export async function ensureRunnerSchema(db: Kysely<any>, schema: string, access: 'read' | 'write' = 'write', create = access === 'write'): Promise<boolean> {
  const known = knownMigrationNames(schema);
  let applied: string[] | null = null;
  const privileges = access === 'read' ? ['SELECT'] : ['SELECT', 'INSERT', 'UPDATE', 'DELETE'];
  try {
    // The same statement checks that this role may use every runner table, so a role that was
    // granted too little is refused here, before it writes anything, not halfway through a run.
    // One privilege per has_table_privilege call: given a list, it is true when any one is held.
    const { rows } = await sql<{ name: string; lacking: Array<{ table: string; missing: string[] }> | null }>`
      select m.name, (select json_agg(json_build_object('table', c.relname, 'missing', p.missing) order by c.relname) from pg_class c
          cross join lateral (select array_agg(w order by o) as missing from unnest(${privileges}::text[]) with ordinality as u(w, o)
            where not has_table_privilege(c.oid, w)) p
          where c.relnamespace = (select oid from pg_namespace where nspname = ${schema})
            and c.relkind in ('r', 'p') and c.relname not in (${MIGRATION_TABLE}, ${MIGRATION_LOCK_TABLE})
            and p.missing is not null) as lacking
      from ${sql.id(schema, MIGRATION_TABLE)} m`.execute(db);
    applied = rows.map((r) => r.name);
    const lacking = rows[0]?.lacking;
    if (lacking?.length) throw await privilegeRefusal(db, schema, 'use', missingPrivileges(schema, lacking), undefined, access);
  } catch (err) {
    const code = codeOf(err);
    if (code === INSUFFICIENT_PRIVILEGE) throw await privilegeRefusal(db, schema, 'use', (err as Error).message, err, access);
    if (code !== UNDEFINED_TABLE) throw err; // undefined_table: a fresh database
  }
  if (applied) {
    const unknown = applied.filter((n) => !known.includes(n));
    if (unknown.length > 0) {
      throw new DatabaseUnavailableError(
        `runner schema "${schema}" has migration ${unknown.sort().at(-1)} that this idem does not know: the schema is newer than this binary; upgrade idem`,
      );
    }
    if (known.every((n) => applied!.includes(n))) return true;
  }
  // Reading (status, list) a schema that has no idem bookkeeping: nothing to read, and nothing is
  // created (a mistyped --schema made a whole idem schema, or asked a read-only role for CREATE).
  // An operator's command (pause, reset, prune) on a database without the schema: there are no
  // runs to act on, and it creates nothing either.
  if (!applied && (access === 'read' || !create)) return false;
  if (!applied) {
    // A schema that already has tables of the names idem creates, not made by idem (it has no
    // migration table): the first migration would fail on them after Kysely created its own two
    // tables there, so a refusal that promises nothing was changed would leave those behind.
    // Unless idem's bookkeeping is there by now: another pod of the deploy created the schema since.
    const { rows: taken } = await sql<{ relname: string }>`select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace
      where n.nspname = ${schema} and c.relname = any(${RUNNER_TABLES as unknown as string[]}::text[])
        and not exists (select 1 from pg_class m where m.relnamespace = n.oid and m.relname = ${MIGRATION_TABLE})
      order by c.relname`.execute(db);
    if (taken.length > 0) {
      const names = taken.map((r) => r.relname).join(', ');
      throw new UsageError(
        'schemaTaken',
        `schema "${schema}" already has ${taken.length === 1 ? 'a table' : 'tables'} named ${names}, which idem would create there, and no idem bookkeeping (${MIGRATION_TABLE}): they are not idem's; keep idem's tables in a schema of their own with --schema (the default is idem), or rename those tables`,
      );
    }
    // Made whole here, or by another pod meanwhile (then upgraded below if that pod's idem is older).
    if (await createRunnerSchema(db, schema, known)) return true;
  }
  const provider: MigrationProvider = { getMigrations: async () => runnerMigrations(schema) };
  const migrator = new Migrator({
    db,
    provider,
    migrationTableSchema: schema,
    migrationTableName: MIGRATION_TABLE,
    migrationLockTableName: MIGRATION_LOCK_TABLE,
  });
  const { error, results } = await migrator.migrateToLatest();
  if (error) throw await migrationFailure(db, schema, error, results?.find((r) => r.status === 'Error')?.migrationName, applied ? 'upgrade' : 'create', access);
  return true;
}

/**
 * The error a failed creation or upgrade of the schema ends with. The database's read-only
 * default (25006) and a statement_timeout are thrown as PostgreSQL raised them: the
 * runner and the CLI turn them into their one-line refusals (idem.readOnlyDefault, idem.statementTimeout).
 */
async function migrationFailure(db: Kysely<any>, schema: string, error: unknown, failed: string | undefined, what: 'create' | 'upgrade', access: 'read' | 'write'): Promise<unknown> {
  const code = codeOf(error);
  if (code === READ_ONLY_TRANSACTION || isStatementTimeout(error)) return error;
  const message = String((error as Error)?.message ?? error);
  if (code === INSUFFICIENT_PRIVILEGE) return privilegeRefusal(db, schema, what, message, error, access);
  // Kysely fails before any migration (creating the schema or its bookkeeping tables) without naming one.
  return new DatabaseUnavailableError(`could not create or upgrade the runner schema "${schema}"${failed ? ` (migration ${failed})` : ''}: ${message}`, { cause: error });
}

/**
 * Creates the runner schema on a database that has no idem bookkeeping: the schema (unless it is
 * there, empty of idem's tables), Kysely's bookkeeping tables as its Migrator makes them, and every
 * migration, in ONE transaction. Whatever fails (a read-only database, a statement_timeout, a
 * missing privilege) leaves nothing behind; Kysely's Migrator creates the schema and its tables
 * outside its transaction, and a first deploy that failed left an empty `idem` schema (or one with
 * only the bookkeeping). Nothing is ever dropped: a rollback removes only what this transaction made.
 * Pods of a deploy that all find the database fresh take turns on a transaction lock; those that
 * come after find the schema made (false: the caller goes on as for an existing schema).
 */
async function createRunnerSchema(db: Kysely<any>, schema: string, known: readonly string[]): Promise<boolean> {
  return db.connection().execute(async (conn) => {
    await sql`begin`.execute(conn);
    try {
      await sql`select pg_advisory_xact_lock(hashtext(${`idem:create-schema:${schema}`}))`.execute(conn);
      const { rows } = await sql<{ there: boolean }>`select exists (select 1 from pg_class c join pg_namespace n on n.oid = c.relnamespace
        where n.nspname = ${schema} and c.relname = ${MIGRATION_TABLE}) as there`.execute(conn);
      if (rows[0]?.there) {
        await sql`rollback`.execute(conn);
        return false;
      }
      let failed: string | undefined;
      try {
        // Only when missing: PostgreSQL checks CREATE on the database before it reads IF NOT EXISTS,
        // so a schema a DBA made for a role without that privilege would be refused.
        const { rows: ns } = await sql<{ there: boolean }>`select exists (select 1 from pg_namespace where nspname = ${schema}) as there`.execute(conn);
        if (!ns[0]?.there) await conn.schema.createSchema(schema).execute();
        // The tables Kysely's Migrator creates (migrator.js), so it finds them and goes on from them.
        await conn.schema.withSchema(schema).createTable(MIGRATION_TABLE)
          .addColumn('name', 'varchar(255)', (col) => col.notNull().primaryKey())
          .addColumn('timestamp', 'varchar(255)', (col) => col.notNull())
          .execute();
        await conn.schema.withSchema(schema).createTable(MIGRATION_LOCK_TABLE)
          .addColumn('id', 'varchar(255)', (col) => col.notNull().primaryKey())
          .addColumn('is_locked', 'integer', (col) => col.notNull().defaultTo(0))
          .execute();
        await conn.withSchema(schema).insertInto(MIGRATION_LOCK_TABLE).values({ id: MIGRATION_LOCK_ROW, is_locked: 0 }).execute();
        const migrations = runnerMigrations(schema);
        for (const name of known) {
          failed = name;
          await migrations[name]!.up(conn);
          await conn.withSchema(schema).insertInto(MIGRATION_TABLE).values({ name, timestamp: new Date().toISOString() }).execute();
        }
      } catch (err) {
        throw await migrationFailureAfterRollback(conn, schema, err, failed);
      }
      await sql`commit`.execute(conn);
      return true;
    } catch (err) {
      await sql`rollback`.execute(conn).catch(() => {});
      throw err;
    }
  });
}

/** migrationFailure, after rolling back first: its privilege refusal queries the database. */
async function migrationFailureAfterRollback(conn: Kysely<any>, schema: string, err: unknown, failed: string | undefined): Promise<unknown> {
  await sql`rollback`.execute(conn).catch(() => {});
  return migrationFailure(conn, schema, err, failed, 'create', 'write');
}

/** "no INSERT, UPDATE or DELETE on idem.chunks, idem.runs; no DELETE on idem.steps": tables grouped by what they lack. */
function missingPrivileges(schema: string, lacking: ReadonlyArray<{ table: string; missing: string[] }>): string {
  const groups = new Map<string, string[]>();
  for (const { table, missing } of lacking) {
    const what = missing.length > 1 ? `${missing.slice(0, -1).join(', ')} or ${missing.at(-1)}` : missing[0]!;
    groups.set(what, [...(groups.get(what) ?? []), `${schema}.${table}`]);
  }
  return [...groups].map(([what, tables]) => `no ${what} on ${tables.join(', ')}`).join('; ');
}

/**
 * A permission error (42501) on idem's own schema or tables, raised while a run went on (a grant
 * taken back mid-run), as the one-line refusal a connect would give now: the same message, naming
 * the GRANT. Null when `err` is something else, or when it names a table idem's role still has every
 * privilege on (a job's own table of the same name: that failure is the job's).
 */
export async function lostPrivilegeRefusal(db: Kysely<any>, schema: string, err: unknown): Promise<UsageError | null> {
  if (codeOf(err) !== INSUFFICIENT_PRIVILEGE || !(err instanceof Error)) return null;
  const named = /^permission denied for (table|schema) (.+)$/.exec(err.message);
  if (!named) return null;
  const [, kind, name] = named;
  if (kind === 'schema') return name === schema ? privilegeRefusal(db, schema, 'use', err.message, err) : null;
  if (!(RUNNER_TABLES as readonly string[]).includes(name!)) return null;
  const { rows } = await sql<{ table: string; missing: string[] }>`
    select c.relname as table, p.missing from pg_class c
      cross join lateral (select array_agg(w order by o) as missing from unnest(array['SELECT', 'INSERT', 'UPDATE', 'DELETE']) with ordinality as u(w, o)
        where not has_table_privilege(c.oid, w)) p
      where c.relnamespace = (select oid from pg_namespace where nspname = ${schema}) and c.relkind in ('r', 'p')
        and c.relname not in (${MIGRATION_TABLE}, ${MIGRATION_LOCK_TABLE}) and p.missing is not null
      order by c.relname`.execute(db);
  if (!rows.some((r) => r.table === name)) return null;
  return privilegeRefusal(db, schema, 'use', missingPrivileges(schema, rows), err);
}

/** The tables idem's runner migrations create, in whatever schema they are given. */
const RUNNER_TABLES = ['runs', 'steps', 'chunks', 'effects', 'api_requests'] as const;

/** SQLSTATE 42P01: the runner schema's bookkeeping table is not there yet (a fresh database). */
const UNDEFINED_TABLE = '42P01';
/** SQLSTATE 42501: the role lacks a privilege. */
const INSUFFICIENT_PRIVILEGE = '42501';
/** SQLSTATE 25006: a write in a read-only transaction (a standby, default_transaction_read_only). */
const READ_ONLY_TRANSACTION = '25006';
/** The one row of Kysely's lock table (kysely's MIGRATION_LOCK_ID). */
const MIGRATION_LOCK_ROW = 'migration_lock';

/**
 * What a role without enough privileges must do, in one line: the grant that lets it manage the
 * schema itself (CREATE on the database), or the grants that let it use a schema its owner
 * created. README, "Database privileges", documents the same statements.
 */
async function privilegeRefusal(db: Kysely<any>, schema: string, what: 'create' | 'upgrade' | 'use', reason: string, cause?: unknown, access: 'read' | 'write' = 'write'): Promise<UsageError> {
  const { rows } = await sql<{ role: string; database: string }>`select quote_ident(current_user) as role, quote_ident(current_database()) as database`.execute(db);
  const { role, database } = rows[0]!;
  // A reading command (status, list) needs to read, and is told only that.
  const grants = `GRANT USAGE ON SCHEMA ${schema} TO ${role}; GRANT ${access === 'read' ? 'SELECT' : 'SELECT, INSERT, UPDATE, DELETE'} ON ALL TABLES IN SCHEMA ${schema} TO ${role}`;
  const message =
    what === 'create'
      ? `role ${role} may not create the runner schema "${schema}" (${reason}): GRANT CREATE ON DATABASE ${database} TO ${role}, or let the database owner run idem migrate once (it creates the schema) and then ${grants} (see README, Database privileges)`
      : what === 'upgrade'
        ? `role ${role} may not upgrade the runner schema "${schema}" to this idem's version (${reason}): let the schema's owner run idem migrate once (it upgrades the schema), then ${grants} (see README, Database privileges)`
        : `role ${role} may not use the runner schema "${schema}" (${reason}): as the schema's owner, ${grants} (see README, Database privileges)`;
  // Its own code (until 2026-12-04 idem.databaseUnavailable, which an alert would route to the
  // database's on-call): the database is up, the role lacks a grant.
  return new UsageError('insufficientPrivilege', message, cause === undefined ? undefined : { cause });
}
