import { sql, type RawBuilder } from 'kysely';

/**
 * The one way idem takes a table or column name (keyRange's `table` and `column`, a step's or a
 * chunk source's `tables`): as it is in the database, case and all, unquoted, a table optionally as
 * `schema.table`. `'MixedCase'` names the table created as `"MixedCase"`; `'orders'` the one
 * created as `orders` (or `ORDERS`, which PostgreSQL folds to `orders`). Queries quote the name
 * (kysely's sql.table / sql.id), and every lookup in the catalog quotes it the same way, so a name
 * that plans also resolves, and the other way round. Quotes in the name are refused with the
 * spelling to use: half of the API folding case and the other half not was the bug this replaces.
 */
export interface TableName {
  readonly schema: string | null;
  readonly name: string;
}

/** Why `value` is not a table name by that rule, or null. `label` is the option, e.g. `table`. */
export function tableNameProblem(value: unknown, label: string): string | null {
  if (typeof value !== 'string' || value === '') return `${label} must be a non-empty string`;
  if (value.includes('"')) return quotedProblem(value, label);
  const parts = value.split('.');
  if (parts.length > 2 || parts.some((p) => p === '')) return `${label} must be a name or schema.name (got '${value}')`;
  return null;
}

/** Why `value` is not a column name by that rule, or null. */
export function columnNameProblem(value: unknown, label: string): string | null {
  if (typeof value !== 'string' || value === '') return `${label} must be a non-empty string`;
  return value.includes('"') ? quotedProblem(value, label) : null;
}

function quotedProblem(value: string, label: string): string {
  return `${label} must be the name as it is in the database, without quotes (got '${value}'): write ${label}: '${value.replace(/"/g, '')}'`;
}

/** A name that passed tableNameProblem, split into schema and table. */
export function parseTableName(value: string): TableName {
  const dot = value.indexOf('.');
  return dot < 0 ? { schema: null, name: value } : { schema: value.slice(0, dot), name: value.slice(dot + 1) };
}

const quoteIdent = (s: string) => `"${s.replace(/"/g, '""')}"`;

/** An identifier (a column, a role) as SQL text an error message suggests spells it: bare when plain lower case, else quoted. */
export function identInSql(name: string): string {
  return /^[a-z_][a-z0-9_]*$/.test(name) ? name : quoteIdent(name);
}

/** The name as SQL text, each part spelled by `part`. */
function partsInSql(value: string, part: (name: string) => string): string {
  const t = parseTableName(value);
  return t.schema === null ? part(t.name) : `${part(t.schema)}.${part(t.name)}`;
}

/** The name as `to_regclass` and `::regclass` read it: each part quoted (`"Sales"."Orders"`). */
export function regclassText(value: string): string {
  return partsInSql(value, quoteIdent);
}

/** A table as SQL text an error message suggests spells it: each part as identInSql spells a column. */
export function tableInSql(value: string): string {
  return partsInSql(value, identInSql);
}

/**
 * What the health check hands `to_regclass` for a `tables` entry: the name quoted by the rule; an
 * entry a custom chunk source spelled with quotes (which defineJob and keyRange refuse) as it is.
 */
export function lookupText(value: string): string {
  return value.includes('"') || tableNameProblem(value, 'table') !== null ? value : regclassText(value);
}

/** The table in a query, quoted the same way. */
export function tableRef(value: string): RawBuilder<unknown> {
  const t = parseTableName(value);
  return t.schema === null ? sql.id(t.name) : sql.id(t.schema, t.name);
}
