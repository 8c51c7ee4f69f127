// The load hook of record-modules.mjs (it runs on the hooks thread).
import { appendFileSync } from 'node:fs';

let file;

export function initialize(data) {
  file = data.file;
}

export async function load(url, context, next) {
  appendFileSync(file, `${url}\n`);
  return next(url, context);
}
