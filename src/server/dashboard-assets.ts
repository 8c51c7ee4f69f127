/**
 * The dashboard's stylesheet and script, served by idem itself (no CDN: the page works on a machine
 * without internet). Plain CSS and a little plain JavaScript: the HTML is rendered on the server
 * and readable without either.
 */
export const DASHBOARD_CSS = `
:root{--bg:#f6f7f9;--panel:#fff;--text:#1b1f24;--muted:#667085;--line:#e4e7ec;--accent:#3b5bdb;--accent-soft:#e7ecff;
--ok:#1f9d55;--ok-soft:#e3f6ea;--warn:#b7791f;--warn-soft:#fdf3dc;--bad:#d92d20;--bad-soft:#fde8e7;--idle:#667085;--idle-soft:#eef0f3;
--radius:12px;--shadow:0 1px 2px rgba(16,24,40,.06),0 1px 3px rgba(16,24,40,.08);color-scheme:light dark}
@media (prefers-color-scheme:dark){:root{--bg:#0f1216;--panel:#171b21;--text:#e6e8eb;--muted:#98a2b3;--line:#2a313a;--accent:#7c95ff;--accent-soft:#1e2747;
--ok:#4ade80;--ok-soft:#12301f;--warn:#fbbf24;--warn-soft:#3a2c0c;--bad:#f87171;--bad-soft:#3b1515;--idle:#98a2b3;--idle-soft:#232a33;--shadow:none}}
*{box-sizing:border-box}
html{-webkit-text-size-adjust:100%}
body{margin:0;background:var(--bg);color:var(--text);font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Ubuntu,sans-serif}
a{color:var(--accent);text-decoration:none}a:hover{text-decoration:underline}
.mono,.key,pre,code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.top{position:sticky;top:0;z-index:5;display:flex;align-items:center;gap:16px;padding:10px clamp(12px,3vw,32px);background:var(--panel);border-bottom:1px solid var(--line)}
.brand{display:flex;align-items:center;gap:8px;font-weight:700;font-size:18px;color:var(--text)}
.brand svg{color:var(--accent)}
.top nav{display:flex;gap:14px;flex:1;overflow-x:auto}
.top nav a{color:var(--muted);font-weight:500}
.token{position:relative}
.token summary svg{vertical-align:-2px}
.token summary{list-style:none;cursor:pointer;padding:6px 10px;border:1px solid var(--line);border-radius:999px;font-size:13px;white-space:nowrap}
.token summary::-webkit-details-marker{display:none}
.token[data-set] .token-state{color:var(--ok)}
.token-form{position:absolute;right:0;top:calc(100% + 8px);width:min(320px,88vw);padding:12px;background:var(--panel);border:1px solid var(--line);border-radius:var(--radius);box-shadow:var(--shadow);display:grid;gap:8px}
main{max-width:1400px;margin:0 auto;padding:18px clamp(12px,3vw,32px) 40px}
h1{font-size:22px;margin:0;display:flex;align-items:center;gap:10px;flex-wrap:wrap}
h2{font-size:13px;text-transform:uppercase;letter-spacing:.06em;color:var(--muted);margin:0 0 12px;display:flex;align-items:center;gap:8px}
.count{background:var(--idle-soft);color:var(--muted);border-radius:999px;padding:1px 8px;font-size:12px;letter-spacing:0}
.group{margin:6px 0 28px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,330px),1fr));gap:14px}
.card,.panel{background:var(--panel);border:1px solid var(--line);border-radius:var(--radius);box-shadow:var(--shadow);padding:14px 16px;min-width:0;overflow-wrap:anywhere}
.panel{margin-bottom:14px}
.card-head{display:flex;align-items:center;justify-content:space-between;gap:10px}
.title{font-weight:650;font-size:16px;color:var(--text);overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.key{color:var(--muted);font-size:12.5px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;margin:2px 0 10px}
.esc{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;color:var(--accent);background:var(--accent-soft);border-radius:3px;padding:0 2px}
.tag{display:inline-block;font-size:12px;font-weight:600;line-height:1;padding:5px 9px;border-radius:999px;background:var(--idle-soft);color:var(--idle);white-space:nowrap;text-transform:lowercase}
.tag-running{background:var(--accent-soft);color:var(--accent)}
.tag-running::before{content:"";display:inline-block;width:7px;height:7px;border-radius:50%;background:currentColor;margin-right:6px;vertical-align:1px;animation:pulse 1.4s ease-in-out infinite}
.tag-succeeded,.tag-done{background:var(--ok-soft);color:var(--ok)}
.tag-paused,.tag-interrupted{background:var(--warn-soft);color:var(--warn)}
.tag-failed,.tag-crashed{background:var(--bad-soft);color:var(--bad)}
.tag-new{background:var(--accent-soft);color:var(--accent)}

@keyframes pulse{50%{opacity:.35}}
@media (prefers-reduced-motion:reduce){.tag-running::before{animation:none}}
.bar{height:8px;border-radius:999px;background:var(--idle-soft);overflow:hidden}
.bar .fill{height:100%;background:var(--accent);border-radius:999px;transition:width .4s ease}
[data-state=succeeded] .bar .fill{background:var(--ok)}
[data-state=failed] .bar .fill,[data-state=crashed] .bar .fill{background:var(--bad)}
[data-state=paused] .bar .fill,[data-state=interrupted] .bar .fill{background:var(--warn)}
.bar.bar-complete .fill{background:var(--ok)}
.bar-unknown .fill{width:30%;opacity:.5}
${Array.from({ length: 101 }, (_, i) => `.bar .w${i}{width:${i}%}`).join('')}
.progress-line{display:flex;gap:10px;align-items:baseline;margin:6px 0 10px;font-size:13px;color:var(--muted)}
.pct{font-weight:700;color:var(--text);font-variant-numeric:tabular-nums}
.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(92px,1fr));gap:8px 12px;margin:0}
.facts div{min-width:0}.facts dt{font-size:11px;text-transform:uppercase;letter-spacing:.05em;color:var(--muted)}
.facts dd{margin:0;font-size:13.5px;font-variant-numeric:tabular-nums;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.actions{display:flex;gap:8px;flex-wrap:wrap;margin-top:12px}
.btn{font:inherit;font-size:13.5px;font-weight:600;padding:7px 13px;border-radius:8px;border:1px solid var(--line);background:var(--panel);color:var(--text);cursor:pointer;display:inline-block}
.btn:hover{border-color:var(--accent)}
.btn:disabled{opacity:.5;cursor:progress}
.btn-primary{background:var(--accent);border-color:var(--accent);color:#fff}
.btn-danger{color:var(--bad)}.btn-danger:hover{border-color:var(--bad)}
.error-line{color:var(--bad);font-size:13px;margin:10px 0 0;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.empty{color:var(--muted);margin:0;padding:14px;border:1px dashed var(--line);border-radius:var(--radius)}
.muted{color:var(--muted);font-weight:400}.warn{color:var(--warn);font-weight:600}.small{font-size:12.5px}
.desc{margin:4px 0 8px;color:var(--muted);font-size:13.5px}
.chips{display:flex;flex-wrap:wrap;gap:6px;margin-bottom:8px}
.chip{font-size:12px;padding:2px 8px;border-radius:6px;background:var(--idle-soft);color:var(--muted)}
.run-details summary{list-style:none;margin-top:4px}
.run-details summary::-webkit-details-marker{display:none}
.run-details[open] summary{background:var(--panel);color:var(--text);border-color:var(--line)}
.run-form{display:grid;gap:10px;margin-top:12px}
.field{display:grid;gap:4px}.field label{font-size:13px;font-weight:600}
.field-check{display:flex;align-items:center;gap:8px}
input,textarea,select{font:inherit;font-size:14px;padding:8px 10px;border-radius:8px;border:1px solid var(--line);background:var(--bg);color:var(--text);width:100%;min-width:0}
input[type=checkbox]{width:auto}
textarea{font-family:ui-monospace,Menlo,monospace}
.form-foot{display:flex;align-items:center;gap:10px;flex-wrap:wrap}
.form-result{font-size:13px}.form-result.bad{color:var(--bad)}
.req{color:var(--bad)}
.field-error{color:var(--bad);font-size:12.5px;margin:0}
[aria-invalid=true]{border-color:var(--bad)}
.run-head{display:flex;justify-content:space-between;align-items:flex-start;gap:16px;flex-wrap:wrap;margin-bottom:14px}
.run-title{min-width:0;max-width:100%}
.run-head .key{margin:4px 0 0;white-space:normal;overflow-wrap:anywhere}
.run-head .actions{margin:0}
.two{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,420px),1fr));gap:14px}
.two .panel{margin-bottom:0}
.two+.panel{margin-top:14px}
.table{width:100%;border-collapse:collapse;font-size:13.5px}
.table th{text-align:left;font-size:11px;text-transform:uppercase;letter-spacing:.05em;color:var(--muted);font-weight:600;padding:6px 8px;border-bottom:1px solid var(--line)}
.table td{padding:8px;border-bottom:1px solid var(--line);vertical-align:middle}
.table tr:last-child td{border-bottom:0}
.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.skipped{table-layout:fixed}.skipped .c-step,.skipped .c-chunk{width:22%}.skipped .c-tries{width:4.5em}
.cell-text{white-space:pre-wrap;max-height:10.5em;overflow:auto}
.bar-cell{width:40%}
.chart{width:100%;height:auto;display:block}
.chart .bars rect{fill:var(--accent)}.chart .axis{stroke:var(--line)}.chart .label{font-size:11px;fill:var(--muted)}
.panel-error{border-color:var(--bad)}.panel-error h2{color:var(--bad)}
pre{white-space:pre-wrap;word-break:break-word;background:var(--bg);padding:10px;border-radius:8px;font-size:13px;margin:8px 0}
.foot{display:flex;justify-content:space-between;max-width:1400px;margin:0 auto;padding:0 clamp(12px,3vw,32px) 24px;color:var(--muted);font-size:12px}
.toast{position:fixed;left:50%;bottom:18px;transform:translateX(-50%);background:var(--text);color:var(--bg);padding:10px 16px;border-radius:10px;font-size:14px;max-width:min(560px,92vw);box-shadow:var(--shadow)}
.toast.bad{background:var(--bad);color:#fff}
@media (max-width:560px){.top{flex-wrap:wrap;gap:10px}.top nav{order:3;flex-basis:100%}.bar-cell{width:30%}.facts{grid-template-columns:repeat(3,1fr)}}
`;

export const DASHBOARD_JS = `'use strict';
(() => {
  const TOKEN_KEY = 'idem-api-token';
  const token = () => sessionStorage.getItem(TOKEN_KEY) || '';
  const toastEl = () => document.querySelector('.toast');
  let toastTimer;
  function toast(text, bad) {
    const el = toastEl();
    if (!el) return;
    el.textContent = text;
    el.className = 'toast' + (bad ? ' bad' : '');
    el.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { el.hidden = true; }, 5000);
  }
  function markToken() {
    const d = document.querySelector('.token');
    if (!d) return;
    if (token()) { d.setAttribute('data-set', ''); d.querySelector('.token-state').textContent = 'token set'; }
    else { d.removeAttribute('data-set'); d.querySelector('.token-state').textContent = 'API token'; }
  }
  async function call(method, url, opts) {
    const headers = Object.assign({ accept: 'application/json' }, (opts && opts.headers) || {});
    if (token()) headers.authorization = 'Bearer ' + token();
    const res = await fetch(url, { method, headers, body: opts && opts.body });
    let body = null;
    try { body = await res.json(); } catch (e) { body = null; }
    return { status: res.status, headers: res.headers, body };
  }
  const problemText = (r) => (r.body && (r.body.detail || r.body.title)) || ('HTTP ' + r.status);
  function needToken(r) {
    if (r.status === 401 || r.status === 403) {
      const d = document.querySelector('.token');
      if (d) {
        d.open = true;
        // Where a keyboard user types next: the token field, not the button that was refused.
        const input = d.querySelector('input');
        if (input) input.focus();
      }
      toast(problemText(r), true);
      return true;
    }
    return false;
  }

  // Live: the server sends the rendered fragment whenever it changed; the browser swaps it in.
  // An EventSource reconnects by itself after a stream that ended, but gives up for good on an
  // answer that is not a 200 (a 503 while the server restarts, a proxy's 502): such a one is opened
  // again here, after 1 s, then twice as long each time up to 30 s, until a stream answers.
  function live() {
    const region = document.querySelector('[data-live]');
    if (!region || !window.EventSource) return;
    const state = document.querySelector('.live-state');
    const say = (text) => { if (state) state.textContent = text; };
    let delay = 1000;
    let ended = false;
    function connect() {
      const es = new EventSource(region.getAttribute('data-live'));
      es.addEventListener('html', (e) => { region.innerHTML = e.data; say('live'); delay = 1000; });
      // Each job's status, swapped element by element: the rest of its card (an open Run form) stays.
      es.addEventListener('jobs', (e) => {
        const t = document.createElement('template');
        t.innerHTML = e.data;
        for (const el of Array.from(t.content.children)) {
          const attr = el.hasAttribute('data-job-tag') ? 'data-job-tag' : 'data-job-last';
          const old = document.querySelector('#jobs [' + attr + '="' + CSS.escape(el.getAttribute(attr) || '') + '"]');
          if (old) old.replaceWith(el);
        }
      });
      // The server cannot read its database: it says so and keeps trying on the same stream.
      es.addEventListener('unavailable', (e) => say(e.data));
      es.addEventListener('gone', () => { ended = true; es.close(); say('this run no longer exists'); });
      es.onerror = () => {
        say('reconnecting…');
        if (ended || es.readyState !== EventSource.CLOSED) return;
        setTimeout(connect, delay);
        delay = Math.min(delay * 2, 30000);
      };
    }
    connect();
  }

  document.addEventListener('click', async (e) => {
    const btn = e.target.closest && e.target.closest('button[data-action]');
    if (!btn) return;
    const confirmText = btn.getAttribute('data-confirm');
    if (confirmText && !window.confirm(confirmText)) return;
    btn.disabled = true;
    try {
      const body = btn.getAttribute('data-body');
      const r = await call('POST', '/api/runs/' + encodeURIComponent(btn.getAttribute('data-run')) + '/' + btn.getAttribute('data-action'), body ? { body, headers: { 'content-type': 'application/json' } } : undefined);
      if (needToken(r)) return;
      if (r.status >= 400) toast(problemText(r), true);
      else toast(btn.getAttribute('data-action') + ': run ' + r.body.key + ' is ' + r.body.state + (r.body.requested ? ' (' + r.body.requested + ' requested)' : ''));
    } catch (err) { toast(String(err), true); }
    finally { btn.disabled = false; }
  });

  const kindOf = (v) => (v === null ? 'null' : Array.isArray(v) ? 'an array' : typeof v === 'object' ? 'an object' : 'a ' + typeof v);
  /** The value of an array or object field, or the sentence saying why its text is not one (its example: the field's placeholder, from the server). */
  function jsonField(el, type) {
    let value;
    try { value = JSON.parse(el.value); } catch (err) { return { problem: el.name + ': not valid JSON (' + err.message + '); write a JSON ' + type + ', e.g. ' + el.placeholder }; }
    if (kindOf(value) !== (type === 'array' ? 'an array' : 'an object')) return { problem: el.name + ' must be a JSON ' + type + ', e.g. ' + el.placeholder + '; found ' + kindOf(value) };
    return { value };
  }
  function markField(el, problem) {
    const note = el.parentNode.querySelector('.field-error');
    if (problem) el.setAttribute('aria-invalid', 'true'); else el.removeAttribute('aria-invalid');
    if (note) { note.textContent = problem || ''; note.hidden = !problem; }
  }
  /** The params the form says, or null when a field is not valid (each such field says why). */
  function formParams(form) {
    const json = form.querySelector('[name=__json]');
    if (json) return JSON.parse(json.value || '{}');
    const params = {};
    let invalid = null;
    for (const el of form.querySelectorAll('[data-type]')) {
      const t = el.getAttribute('data-type');
      if (t === 'array' || t === 'object') {
        const field = el.value.trim() === '' ? {} : jsonField(el, t);
        markField(el, field.problem);
        if (field.problem) invalid = invalid || el;
        else if ('value' in field) params[el.name] = field.value;
      }
      else if (t === 'boolean') params[el.name] = el.checked;
      else if (el.value === '') continue;
      else if (t === 'enum') params[el.name] = JSON.parse(el.value);
      else if (t === 'integer' || t === 'number') params[el.name] = Number(el.value);
      else params[el.name] = el.value;
    }
    if (invalid) { invalid.focus(); return null; }
    return params;
  }
  const freshKey = () => (crypto.randomUUID ? crypto.randomUUID() : Date.now().toString(36) + '-' + Math.random().toString(36).slice(2));

  // The token panel is a popover: Escape or a click elsewhere closes it (it lies over the page's
  // top buttons while open), Escape handing the focus back to its summary.
  document.addEventListener('keydown', (e) => {
    const d = document.querySelector('.token[open]');
    if (e.key !== 'Escape' || !d) return;
    d.open = false;
    d.querySelector('summary').focus();
  });
  document.addEventListener('click', (e) => {
    const d = document.querySelector('.token[open]');
    if (d && !d.contains(e.target)) d.open = false;
  });

  document.addEventListener('submit', async (e) => {
    const form = e.target;
    if (form.classList.contains('token-form')) {
      e.preventDefault();
      const v = form.querySelector('input').value.trim();
      if (v) sessionStorage.setItem(TOKEN_KEY, v); else sessionStorage.removeItem(TOKEN_KEY);
      form.querySelector('input').value = '';
      form.closest('details').open = false;
      markToken();
      toast(v ? 'Token saved for this tab.' : 'Token cleared.');
      return;
    }
    if (!form.classList.contains('run-form')) return;
    e.preventDefault();
    const out = form.querySelector('.form-result');
    const keyInput = form.querySelector('[name=__key]');
    let params;
    try { params = formParams(form); } catch (err) { out.textContent = 'params are not valid JSON: ' + err.message; out.className = 'form-result bad'; return; }
    if (params === null) { out.textContent = 'not sent: a field above says what to fix'; out.className = 'form-result bad'; return; }
    // The key was fixed when the form was drawn: a double click sends the same key twice, and the
    // server starts one run. It changes only after an answer, for the next intended run.
    const key = keyInput.value;
    const submit = form.querySelector('button[type=submit]');
    submit.disabled = true;
    let r;
    try {
      r = await call('POST', form.getAttribute('action'), { headers: { 'content-type': 'application/json', 'idempotency-key': key }, body: JSON.stringify(params) });
    } catch (err) {
      // No answer: the request may or may not have arrived, so the key stays, and sending again
      // is a retry that starts at most one run.
      if (keyInput.value === key) { out.className = 'form-result bad'; out.textContent = 'the server did not answer (' + ((err && err.message) || err) + '); send again: the same key starts at most one run'; }
      return;
    } finally {
      submit.disabled = false;
    }
    if (needToken(r)) return;
    // A second click's answer after the first one's changed the key: the first already reported.
    if (keyInput.value !== key) return;
    if (r.status === 201 || r.status === 200) {
      out.className = 'form-result';
      out.innerHTML = '';
      const a = document.createElement('a');
      a.href = '/runs/' + r.body.id;
      a.textContent = (r.status === 201 ? 'Started run ' : 'Already started: run ') + r.body.key;
      out.appendChild(a);
      keyInput.value = freshKey();
    } else {
      // A refusal to retry (the 409 of a key inside another request's claim) keeps the key: the
      // retry gets that request's run. Its sentence says so.
      out.className = 'form-result' + (r.body && r.body.retryable ? '' : ' bad'); out.textContent = problemText(r);
    }
  });

  document.addEventListener('DOMContentLoaded', () => { markToken(); live(); });
})();
`;

export const FAVICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24"><rect x="2" y="2" width="20" height="20" rx="6" fill="#3b5bdb"/><path d="M7 12.5l3.2 3.2L17 8.8" stroke="#fff" stroke-width="2.4" fill="none" stroke-linecap="round" stroke-linejoin="round"/></svg>`;
