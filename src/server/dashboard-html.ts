import type { Job } from '../job.ts';
import { escapedChar, UNSAFE, visible } from '../text-table.ts';
import type { RunView } from './run-view.ts';

/**
 * Escapes text for HTML content and attribute values. A carriage return becomes `&#13;`: the HTML
 * parser keeps it as the character (a raw one it would turn into a line feed), and a live fragment
 * holds none for an EventSource to read as a line end.
 */
export function esc(value: unknown): string {
  return String(value ?? '').replace(/[&<>"'\r]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;', '\r': '&#13;' })[c]!);
}

/**
 * Text a user or another tool supplied (run keys, chunk keys, errors), escaped and isolated in a
 * `<bdi>`: a bidi control in it (U+202E) reorders only itself, never the text around it.
 */
export function userText(value: unknown): string {
  return `<bdi>${esc(value)}</bdi>`;
}

/**
 * A key (run or chunk) as {@link userText}, but each control, bidi-control or invisible character
 * (U+200B, a no-break space…) shown as its escape, `\u200b`, as the terminal shows it (text-table.ts's
 * `visible`): two keys that differ by one never look the same.
 */
export function keyText(value: unknown): string {
  const s = String(value ?? '');
  let html = '';
  let from = 0;
  for (const m of s.matchAll(UNSAFE)) {
    const code = m[0].charCodeAt(0).toString(16).toUpperCase().padStart(4, '0');
    html += `${esc(s.slice(from, m.index))}<span class="esc" title="invisible or control character U+${code}">${escapedChar(m[0])}</span>`;
    from = m.index + m[0].length;
  }
  return `<bdi>${html}${esc(s.slice(from))}</bdi>`;
}

/** UTC time, with the date when it is not today: absolute, so a live fragment only changes with the run. */
function when(iso: string | null): string {
  if (!iso) return '—';
  const d = new Date(iso);
  const today = new Date().toISOString().slice(0, 10) === iso.slice(0, 10);
  const text = today ? iso.slice(11, 19) : `${iso.slice(0, 10)} ${iso.slice(11, 16)}`;
  return `<time datetime="${esc(iso)}" title="${esc(d.toISOString())}">${esc(text)}</time>`;
}

function duration(seconds: number | null): string {
  if (seconds === null) return '—';
  if (seconds < 60) return `${seconds}s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)}m ${seconds % 60}s`;
  return `${Math.floor(seconds / 3600)}h ${Math.floor((seconds % 3600) / 60)}m`;
}

export function stateTag(state: string, attrs = ''): string {
  return `<span class="tag tag-${esc(state)}"${attrs} data-state="${esc(state)}">${esc(state)}</span>`;
}

export function progressBar(percent: number | null, label: string): string {
  if (percent === null) return `<div class="bar bar-unknown" role="progressbar" aria-label="${esc(label)}"><div class="fill"></div></div>`;
  return `<div class="bar${percent === 100 ? ' bar-complete' : ''}" role="progressbar" aria-label="${esc(label)}" aria-valuemin="0" aria-valuemax="100" aria-valuenow="${percent}"><div class="fill w${Math.max(0, Math.min(100, Math.round(percent)))}"></div></div>`;
}

function chunkText(r: RunView): string {
  const p = r.progress;
  if (p.total === null) return 'not planned yet';
  return `chunk ${p.done} of ${p.total}${p.fullyPlanned ? '' : '+'}`;
}

/** The buttons an operator may press for a run in this state. */
export function actions(r: RunView): string {
  const b: string[] = [];
  if (['running', 'pending', 'failed', 'interrupted', 'crashed'].includes(r.state) && r.requested !== 'pause') b.push(`<button type="button" class="btn" data-action="pause" data-run="${esc(r.id)}">Pause</button>`);
  // A run created over HTTP that stopped on its own continues in the server (POST …/resume).
  const continuable = r.viaApi && ['failed', 'interrupted', 'crashed'].includes(r.state);
  // Its job's code changed since it stopped: Resume asks first, then resumes with the new code
  // (a refusal, 409, would otherwise be all the button ever gets).
  const withNewCode =
    r.codeChanged && r.viaApi
      ? ` data-body="${esc(JSON.stringify({ allowChangedCode: true }))}" data-confirm="${esc(`The code of job ${r.job} changed since run ${visible(r.key)} started. Resume it with the new code? Only if the change is safe for the chunks already done.`)}"`
      : '';
  if (r.state === 'paused' || r.requested === 'pause' || continuable) b.push(`<button type="button" class="btn" data-action="resume" data-run="${esc(r.id)}"${withNewCode}>Resume</button>`);
  if (!['succeeded', 'cancelled', 'deleting'].includes(r.state) && r.requested !== 'cancel') {
    b.push(`<button type="button" class="btn btn-danger" data-action="cancel" data-run="${esc(r.id)}" data-confirm="Cancel run ${esc(visible(r.key))} of ${esc(r.job)}? Finished chunks are kept; the run never continues.">Cancel</button>`);
  }
  return b.length ? `<div class="actions">${b.join('')}</div>` : '';
}

function facts(pairs: Array<[string, string]>): string {
  return `<dl class="facts">${pairs.map(([k, v]) => `<div><dt>${esc(k)}</dt><dd>${v}</dd></div>`).join('')}</dl>`;
}

/** What a live run says beside its progress: an operator's request not acted on yet, and a wait for the database to be healthy. */
function progressNotes(r: RunView): string {
  const requested = r.requested && r.state === 'running' ? ` <span class="muted">(${esc(r.requested)} requested)</span>` : '';
  const health = r.healthPause ? ` <span class="warn" title="since ${esc(r.healthPause.since)}">paused for health: ${userText(r.healthPause.reason)}</span>` : '';
  return requested + health;
}

/** One run as a card on the dashboard. */
export function runCard(r: RunView): string {
  const pct = r.progress.percent;
  return `<article class="card run" data-run-id="${esc(r.id)}" data-state="${esc(r.state)}">
  <header class="card-head"><a class="title" href="/runs/${esc(r.id)}">${esc(r.job)}</a>${stateTag(r.state)}</header>
  <div class="key" title="run key (Idempotency-Key)">${keyText(r.key)}</div>
  ${progressBar(pct, `progress of run ${r.id}`)}
  <div class="progress-line"><span class="pct">${pct === null ? '…' : `${pct}%`}</span><span>${esc(chunkText(r))}</span>${progressNotes(r)}</div>
  ${facts([
    ['rate', r.throughput === null ? '—' : `${esc(r.throughput)}/s`],
    ['ETA', r.stalledSeconds != null ? `stalled: no chunk committed for ${esc(r.stalledSeconds)}s` : duration(r.etaSeconds)],
    ['attempt', esc(r.attempt)],
    ['holder', r.holder ? `<span class="mono">${userText(r.holder)}</span>` : '—'],
    ['started', when(r.startedAt ?? r.createdAt)],
    ['finished', when(r.finishedAt)],
  ])}
  ${r.error ? `<p class="error-line" title="${esc(r.error.message)}">✖ ${userText(r.error.step)}${r.error.chunk ? ` · ${keyText(r.error.chunk)}` : ''}: ${userText(r.error.message)}</p>` : ''}
  ${r.codeChanged ? `<p class="error-line" title="${esc(r.codeChanged.detail)}">⚠ code changed since the run started: ${userText(r.codeChanged.detail)}</p>` : ''}
  ${actions(r)}
</article>`;
}

/** One list of the dashboard: its newest runs, and how many it has in all. */
export interface RunList {
  readonly runs: readonly RunView[];
  readonly total: number;
  /** The count stopped at `total`: there are at least that many. */
  readonly atLeast: boolean;
}

/** The dashboard's lists of runs. */
export interface HomeRuns {
  /** Running, crashed, failed, interrupted and paused: runs that move or wait for an operator. */
  readonly active: RunList;
  readonly pending: RunList;
  /** Succeeded, cancelled, and deleting (a prune under way). */
  readonly completed: RunList;
}

const count = (n: number) => n.toLocaleString('en-US');
const total = (list: RunList) => `${count(list.total)}${list.atLeast ? '+' : ''}`;

/** The live part of the dashboard: active, pending and completed runs, each headed by its total. */
export function homeLive(home: HomeRuns): string {
  const section = (id: string, title: string, list: RunList, empty: string, all: string) => `
<section class="group" id="${id}" aria-labelledby="${id}-h">
  <h2 id="${id}-h">${esc(title)} <span class="count">${total(list)}</span></h2>
  ${list.runs.length ? `<div class="grid">${list.runs.map(runCard).join('')}</div>` : `<p class="empty">${esc(empty)}</p>`}
  ${list.runs.length < list.total ? `<p class="muted small cut">showing the newest ${count(list.runs.length)} of ${total(list)}; ${all}</p>` : ''}
</section>`;
  const api = (q: string) => `<code>GET /api/runs?${esc(q)}</code>`;
  return (
    section('active', 'Active', home.active, 'Nothing is running, and no run waits for an operator. Start a run from a job below.', `${api('state=active')} lists them (with the pending ones)`) +
    section('pending', 'Pending', home.pending, 'No run is waiting to start.', `${api('state=pending')} lists them all`) +
    section('completed', 'Completed', home.completed, 'No run has finished yet.', `${api('state=succeeded')} and ${api('state=cancelled')} list them`)
  );
}

function paramsForm(job: Job, schema: any, key: string): string {
  const props = schema && typeof schema === 'object' && schema.properties && typeof schema.properties === 'object' ? (schema.properties as Record<string, any>) : null;
  let fields: string;
  if (props && Object.keys(props).length > 0) {
    const required = new Set<string>(Array.isArray(schema.required) ? schema.required : []);
    fields = Object.entries(props)
      .map(([name, p]) => {
        const id = `p-${job.name}-${name}`;
        const label = `<label for="${esc(id)}">${esc(name)}${required.has(name) ? ' <span class="req">*</span>' : ''}${p.description ? ` <span class="muted">${esc(p.description)}</span>` : ''}</label>`;
        const hasDefault = p.default !== undefined;
        // An optional enum or boolean without a default starts unset and is left out unless chosen:
        // a select's first option, or an unticked box's false, would be sent as if chosen.
        if (Array.isArray(p.enum) || (p.type === 'boolean' && !hasDefault && !required.has(name))) {
          const values: unknown[] = Array.isArray(p.enum) ? p.enum : [true, false];
          const chosen = hasDefault ? JSON.stringify(p.default) : undefined;
          const unset = hasDefault ? '' : required.has(name) ? '<option value="" disabled selected>— choose —</option>' : '<option value="" selected>— not set —</option>';
          // A value that is not a string is labelled as JSON: a null option reads "null", not nothing.
          const options = values.map((v) => `<option value="${esc(JSON.stringify(v))}"${JSON.stringify(v) === chosen ? ' selected' : ''}>${esc(typeof v === 'string' ? v : JSON.stringify(v))}</option>`).join('');
          return `<div class="field">${label}<select id="${esc(id)}" name="${esc(name)}" data-type="enum"${required.has(name) ? ' required' : ''}>${unset}${options}</select></div>`;
        }
        // Arrays and objects are written as JSON and parsed before they are sent (dashboard.js says
        // at the field when the text is not JSON of that type); a text input would send a string.
        if (p.type === 'array' || p.type === 'object') {
          const example = p.type === 'array' ? '["a", "b"]' : '{"name": "value"}';
          const jsonLabel = label.replace('</label>', ` <span class="muted">JSON ${p.type}</span></label>`);
          return `<div class="field">${jsonLabel}<textarea id="${esc(id)}" name="${esc(name)}" data-type="${p.type}" rows="2" spellcheck="false" placeholder="${esc(example)}" aria-describedby="${esc(id)}-error"${required.has(name) ? ' required' : ''}>${hasDefault ? esc(JSON.stringify(p.default)) : ''}</textarea><p class="field-error" id="${esc(id)}-error" hidden></p></div>`;
        }
        if (p.type === 'boolean') return `<div class="field field-check"><input type="checkbox" id="${esc(id)}" name="${esc(name)}" data-type="boolean"${p.default === true ? ' checked' : ''}>${label}</div>`;
        const type = p.type === 'integer' || p.type === 'number' ? 'number' : p.format === 'date' ? 'date' : 'text';
        const dflt = p.default === undefined ? '' : ` value="${esc(p.default)}"`;
        return `<div class="field">${label}<input id="${esc(id)}" name="${esc(name)}" type="${type}" data-type="${esc(p.type ?? 'string')}"${dflt}${required.has(name) ? ' required' : ''}></div>`;
      })
      .join('');
  } else if (props) {
    fields = '<p class="muted">This job takes no params.</p>';
  } else {
    fields = `<div class="field"><label for="p-${esc(job.name)}">params (JSON object)</label><textarea id="p-${esc(job.name)}" name="__json" rows="3" spellcheck="false">{}</textarea></div>`;
  }
  return `<form class="run-form" data-job="${esc(job.name)}" method="post" action="/api/jobs/${esc(job.name)}/runs">
  ${fields}
  <div class="field"><label for="k-${esc(job.name)}">Idempotency-Key <span class="muted">a fresh one per intended run; a retry reuses it</span></label><input id="k-${esc(job.name)}" name="__key" class="mono" value="${esc(key)}" pattern="[A-Za-z0-9._:~+=\\/\\-]{1,200}" required></div>
  <div class="form-foot"><button type="submit" class="btn btn-primary">Run ${esc(job.name)}</button><output class="form-result" aria-live="polite"></output></div>
</form>`;
}

/**
 * What a job card says of the job's newest run: its state tag ("new" when it never ran) and the
 * "last run" line. The live stream sends them again (`jobsLive`), each element found by its
 * `data-job-tag` / `data-job-last`, so the card's open Run form is left as it is.
 */
function jobStatus(name: string, last: RunView | undefined): { readonly tag: string; readonly line: string } {
  const attr = (a: string) => ` ${a}="${esc(name)}"`;
  return {
    tag: last ? stateTag(last.state, attr('data-job-tag')) : `<span class="tag tag-new"${attr('data-job-tag')}>new</span>`,
    line: last
      ? `<p class="muted small"${attr('data-job-last')}>last run <a href="/runs/${esc(last.id)}">${keyText(last.key)}</a> · ${when(last.updatedAt)}</p>`
      : `<p class="muted small"${attr('data-job-last')} hidden></p>`,
  };
}

/** The live part of the Jobs section: each job's status (see `jobStatus`), in the order given. */
export function jobsLive(jobs: readonly string[], latest: ReadonlyMap<string, RunView>): string {
  return jobs
    .map((name) => {
      const { tag, line } = jobStatus(name, latest.get(name));
      return tag + line;
    })
    .join('\n');
}

/** The jobs this server runs, each with its Run form: "New" when it never ran. */
export function jobsSection(jobs: readonly Job[], schemas: ReadonlyMap<string, unknown>, latest: ReadonlyMap<string, RunView>, newKey: () => string): string {
  const cards = jobs.map((j) => {
    const { tag, line } = jobStatus(j.name, latest.get(j.name));
    const sched = j.schedule === undefined ? '' : `<span class="chip" title="schedule">⏱ ${esc(typeof j.schedule === 'string' ? j.schedule : j.schedule.cron)}</span>`;
    return `<article class="card job" data-job="${esc(j.name)}">
  <header class="card-head"><span class="title">${esc(j.name)}</span>${tag}</header>
  ${j.description ? `<p class="desc">${esc(j.description)}</p>` : ''}
  <div class="chips">${j.steps.map((s) => `<span class="chip">${esc(s.name)}${s.chunks ? ' ▦' : ''}</span>`).join('')}${sched}</div>
  ${line}
  <details class="run-details"><summary class="btn btn-primary">Run…</summary>${paramsForm(j, schemas.get(j.name), newKey())}</details>
</article>`;
  });
  return `<section class="group" id="jobs" aria-labelledby="jobs-h"><h2 id="jobs-h">Jobs <span class="count">${jobs.length}</span></h2>
  ${jobs.length ? `<div class="grid">${cards.join('')}</div>` : '<p class="empty">No job files found; start idem serve with --jobs-dir.</p>'}</section>`;
}

/** Chunks per minute as an inline SVG bar chart (no script, no library). */
export function throughputChart(series: ReadonlyArray<readonly [string, number]>): string {
  if (series.length === 0) return '<p class="empty">No chunk has committed yet.</p>';
  const byMinute = new Map(series.map(([m, n]) => [Date.parse(m), n]));
  const first = Date.parse(series[0]![0]);
  const last = Date.parse(series.at(-1)![0]);
  // At least a quarter of an hour on the axis, so one busy minute reads as a bar, not a wall.
  const minutes = Math.min(60, Math.max(15, Math.round((last - first) / 60_000) + 1));
  const start = last - (minutes - 1) * 60_000;
  const values = Array.from({ length: minutes }, (_, i) => byMinute.get(start + i * 60_000) ?? 0);
  const max = Math.max(...values, 1);
  const W = 600;
  const H = 140;
  const pad = 28;
  const bw = (W - pad) / Math.max(values.length, 8);
  const bars = values
    .map((v, i) => {
      const h = Math.round((v / max) * (H - 30));
      const t = new Date(start + i * 60_000).toISOString().slice(11, 16);
      return `<rect x="${(pad + i * bw + 1).toFixed(1)}" y="${H - 16 - h}" width="${Math.max(1, bw - 2).toFixed(1)}" height="${h}" rx="2"><title>${t} UTC: ${v} chunks</title></rect>`;
    })
    .join('');
  const t0 = new Date(start).toISOString().slice(11, 16);
  const t1 = new Date(last).toISOString().slice(11, 16);
  return `<svg class="chart" viewBox="0 0 ${W} ${H}" role="img" aria-label="chunks per minute, ${t0} to ${t1} UTC, peak ${max}">
  <line x1="${pad}" y1="${H - 16}" x2="${W}" y2="${H - 16}" class="axis"/>
  <text x="0" y="12" class="label">${max}</text><text x="0" y="${H - 18}" class="label">0</text>
  <text x="${pad}" y="${H - 2}" class="label">${t0}</text><text x="${W}" y="${H - 2}" class="label" text-anchor="end">${t1} UTC</text>
  <g class="bars">${bars}</g>
</svg>`;
}

/** The live part of a run page. */
export function runLive(r: RunView): string {
  const steps = r.steps
    .map((s) => {
      const total = s.plannedAll ? s.planned : Math.max(s.planned, s.estimated ?? 0);
      const pct = s.status === 'done' ? 100 : total > 0 ? Math.min(99, Math.floor((s.done / total) * 100)) : s.status === 'pending' ? 0 : null;
      // A step of a run nobody executes shows where the run stopped (the view says so: step-state.ts).
      return `<tr><td>${esc(s.name)}</td><td>${stateTag(s.status)}</td><td class="bar-cell">${progressBar(pct, `step ${s.name}`)}</td><td class="num">${s.done} / ${total}${s.plannedAll ? '' : '+'}</td></tr>`;
    })
    .join('');
  const skipped = r.skipped?.length
    ? `<table class="table skipped"><thead><tr><th class="c-step">step</th><th class="c-chunk">chunk</th><th class="c-tries num">tries</th><th>error</th></tr></thead><tbody>${r.skipped
        .map((k) => `<tr><td>${userText(k.step)}</td><td class="mono">${keyText(k.key)}</td><td class="num">${k.attempts}</td><td><div class="cell-text">${userText(k.error)}</div></td></tr>`)
        .join('')}</tbody></table>`
    : '<p class="empty">None.</p>';
  const pct = r.progress.percent;
  return `<div class="run-live" data-state="${esc(r.state)}"><div class="run-head" data-run-id="${esc(r.id)}" data-state="${esc(r.state)}">
  <div class="run-title"><h1>${esc(r.job)} ${stateTag(r.state)}</h1><div class="key">${keyText(r.key)}</div></div>
  ${actions(r)}
</div>
<section class="panel">
  ${progressBar(pct, `progress of run ${r.id}`)}
  <div class="progress-line"><span class="pct">${pct === null ? '…' : `${pct}%`}</span><span>${esc(chunkText(r))}</span>${progressNotes(r)}</div>
  ${facts([
    ['rate', r.throughput === null ? '—' : `${esc(r.throughput)}/s`],
    ['ETA', r.stalledSeconds != null ? `stalled: no chunk committed for ${esc(r.stalledSeconds)}s` : duration(r.etaSeconds)],
    ['attempt', esc(r.attempt)],
    ['holder', r.holder ? `<span class="mono">${userText(r.holder)}</span>` : '—'],
    ['created', when(r.createdAt)],
    ['started', when(r.startedAt)],
    ['finished', when(r.finishedAt)],
    ['effects', r.effects ? `${r.effects.done} done${r.effects.started ? `, ${r.effects.started} open` : ''}` : '—'],
  ])}
</section>
${r.error ? `<section class="panel panel-error"><h2>Last error</h2><p><strong>${userText(r.error.step)}${r.error.chunk ? ` · chunk ${keyText(r.error.chunk)}` : ''}</strong> after ${esc(r.error.tries)} ${r.error.tries === 1 ? 'try' : 'tries'}${r.error.code ? ` <span class="mono">(${userText(r.error.code)})</span>` : ''}</p><pre>${userText(r.error.message)}</pre><p class="muted small">${when(r.error.at)}</p></section>` : ''}
${r.codeChanged ? `<section class="panel panel-error"><h2>Code changed since the run started</h2><p>It does not resume on its own: its job's code is <span class="mono">${esc(r.codeChanged.to)}</span>, its last attempt ran <span class="mono">${esc(r.codeChanged.from)}</span>.</p><pre>${userText(r.codeChanged.detail)}</pre></section>` : ''}
<div class="two">
  <section class="panel"><h2>Steps</h2><table class="table steps"><thead><tr><th>step</th><th>status</th><th class="bar-cell">progress</th><th class="num">chunks</th></tr></thead><tbody>${steps || '<tr><td colspan="4" class="empty">not started</td></tr>'}</tbody></table></section>
  <section class="panel"><h2>Chunks per minute</h2>${throughputChart(r.chunksPerMinute ?? [])}</section>
</div>
<section class="panel"><h2>Skipped chunks</h2>${skipped}</section></div>`;
}

/** The page around a body: head, header with the token field, assets served by idem itself. */
export function page(title: string, live: string, rest: string, opts: { readonly liveUrl: string; readonly publicRead: boolean }): string {
  return `<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>${esc(title)} · idem</title>
<link rel="icon" href="/favicon.svg" type="image/svg+xml">
<link rel="stylesheet" href="/assets/dashboard.css">
<noscript><meta http-equiv="refresh" content="10"></noscript>
<script src="/assets/dashboard.js" defer></script>
</head>
<body>
<header class="top">
  <a class="brand" href="/"><svg viewBox="0 0 24 24" width="22" height="22" aria-hidden="true"><rect x="2" y="2" width="20" height="20" rx="6" fill="currentColor"/><path d="M7 12.5l3.2 3.2L17 8.8" stroke="var(--bg)" stroke-width="2.4" fill="none" stroke-linecap="round" stroke-linejoin="round"/></svg><span>idem</span></a>
  <nav><a href="/">Runs</a><a href="/#jobs">Jobs</a><a href="/api/runs">API</a><a href="/metrics">Metrics</a></nav>
  <details class="token"><summary title="Actions need the API token"><svg viewBox="0 0 24 24" width="14" height="14" aria-hidden="true"><circle cx="8" cy="12" r="4" fill="none" stroke="currentColor" stroke-width="2"/><path d="M12 12h9M18 12v3M21 12v2" stroke="currentColor" stroke-width="2" stroke-linecap="round"/></svg> <span class="token-state">API token</span></summary>
    <form class="token-form"><label for="token">API token <span class="muted">kept in this tab only (sessionStorage)</span></label><input id="token" type="password" autocomplete="off" spellcheck="false"><button class="btn" type="submit">Save</button></form>
  </details>
</header>
<main>
<div class="live" data-live="${esc(opts.liveUrl)}">
${live}
</div>
${rest}
</main>
<footer class="foot"><span>idem serve</span><span class="live-state" aria-live="polite">${opts.publicRead ? 'read-only without a token' : ''}</span></footer>
<div class="toast" role="status" aria-live="polite" hidden></div>
</body>
</html>`;
}
