import { existsSync } from 'node:fs';
import { mkdir, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import pg from 'pg';
import { chromium, type BrowserContext, type Page } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { lockKey } from '../src/fingerprint.ts';
import { visible } from '../src/text-table.ts';
import { killLeftovers, query, REPO } from './support/cli.ts';
import { useTestDatabase } from './support/database.ts';
import { api, startServe, TOKEN, type ServeProcess } from './support/server.ts';

/** Debian's chromium (.ci/run installs it), driven by playwright-core: no browser download. */
const CHROMIUM = '/usr/bin/chromium';
const FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'];
/** Git-ignored: look at them after a run. */
export const SCREENSHOTS = path.join(REPO, 'screenshots');

beforeAll(() => {
  if (!existsSync(CHROMIUM)) throw new Error(`${CHROMIUM} is missing; install it with apt-get install -y chromium (.ci/run does)`);
});
const testDb = useTestDatabase({ fixtureTables: true, idemSchema: true });
let url: string;
let server: ServeProcess;
let profile: string;
let context: BrowserContext;
let page: Page;

beforeAll(async () => {
  url = testDb.url;
  server = await startServe(url, ['--public-read', '--max-runs', '4']);
  await mkdir(SCREENSHOTS, { recursive: true });
  profile = await mkdtemp(path.join(tmpdir(), 'idem-chromium-'));
  context = await chromium.launchPersistentContext(profile, { executablePath: CHROMIUM, headless: true, args: FLAGS, viewport: { width: 1280, height: 900 } });
  page = context.pages()[0] ?? (await context.newPage());
  // What the browser refused or complained about: a CSP violation, an invalid pattern attribute.
  await context.addInitScript(() => {
    (window as any).__cspViolations = [];
    document.addEventListener('securitypolicyviolation', (e) => (window as any).__cspViolations.push(`${e.violatedDirective}: ${e.blockedURI || e.sample}`));
  });
  page.on('console', (m) => {
    if (m.type() === 'error' || m.type() === 'warning') consoleProblems.push(m.text());
  });
});

const consoleProblems: string[] = [];
/** Fails when the page reported a CSP violation or the console an error such as an invalid pattern. */
async function expectNoBrowserComplaints(): Promise<void> {
  expect(await page.evaluate(() => (window as any).__cspViolations)).toEqual([]);
  expect(consoleProblems.filter((t) => /Content Security Policy|pattern|regular expression/i.test(t))).toEqual([]);
}

afterAll(async () => {
  await context?.close().catch(() => {});
  if (profile) await rm(profile, { recursive: true, force: true });
  await killLeftovers();
});

const runCard = (key: string) => page.locator('#active, #pending, #completed').locator('article.run', { has: page.locator('.key', { hasText: key }) });

describe('the dashboard in a real browser', () => {
  it('starts a run from the form (a double click starts one), shows live progress to 100 %, pauses and resumes from the buttons', async () => {
    // Some history so the page shows each kind of run.
    const nightly = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'nightly-2026-11-29', body: { chunks: 12 } });
    expect((await api(server.base, 'GET', `/api/runs/${nightly.body.id}?wait=30`)).body.state).toBe('succeeded');
    // One failed run: its chunk c0007 throws, then the cause is "fixed" for the runs after it.
    await query(url, `insert into fail_chunks (chunk_key) values ('c0007')`);
    const failing = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'backfill-orders', body: { chunks: 20, label: 'orders' } });
    expect((await api(server.base, 'GET', `/api/runs/${failing.body.id}?wait=30`)).body.state).toBe('failed');
    await query(url, `delete from fail_chunks`);

    await page.goto(`${server.base}/`);
    await page.evaluate(() => ((window as any).__sameDocument = true));
    // The token goes in once per tab; actions send it as a bearer header.
    await page.locator('.token summary').click();
    await page.locator('#token').fill(TOKEN);
    await page.locator('.token-form button').click();
    await expect.poll(() => page.locator('.token-state').textContent()).toBe('token set');

    const job = page.locator('article.job[data-job="counted"]');
    await job.locator('summary').click();
    await job.locator('textarea').fill('{"chunks": 40, "pauseMs": 150, "label": "from the browser"}');
    const key = await job.locator('input[name=__key]').inputValue();
    expect(key).toMatch(/^[0-9a-f-]{36}$/);
    // The browser checks the key against the pattern itself (an invalid pattern disables it).
    expect(await job.locator('input[name=__key]').evaluate((el: HTMLInputElement) => {
      el.value = 'not a valid key';
      const invalid = el.validity.patternMismatch;
      el.value = 'a-valid/key=1';
      return [invalid, el.validity.patternMismatch];
    })).toEqual([true, false]);
    await job.locator('input[name=__key]').fill(key);
    await job.locator('button[type=submit]').dblclick();
    await expect.poll(() => job.locator('.form-result a').textContent()).toMatch(/run /);
    expect(await job.locator('input[name=__key]').inputValue()).not.toBe(key);
    const rows = await query(url, 'select id::text from idem.runs where run_key = $1', [key]);
    expect(rows).toHaveLength(1);
    const card = runCard(key);
    await expect.poll(() => card.getAttribute('data-state'), { timeout: 20_000 }).toBe('running');
    await expect.poll(async () => Number(await card.locator('[role=progressbar]').getAttribute('aria-valuenow')), { timeout: 20_000 }).toBeGreaterThan(0);

    await card.locator('button[data-action=pause]').click();
    await expect.poll(() => card.getAttribute('data-state'), { timeout: 20_000 }).toBe('paused');
    expect(await card.locator('.tag').textContent()).toBe('paused');
    await page.screenshot({ path: path.join(SCREENSHOTS, 'dashboard-paused.png'), fullPage: true });
    await card.locator('button[data-action=resume]').click();
    await expect.poll(() => card.getAttribute('data-state'), { timeout: 20_000 }).toBe('running');
    await expect.poll(() => card.getAttribute('data-state'), { timeout: 60_000 }).toBe('succeeded');
    expect(await card.locator('[role=progressbar]').getAttribute('aria-valuenow')).toBe('100');
    expect(await card.locator('.tag').textContent()).toBe('succeeded');
    // Every change arrived over server-sent events: the page was never reloaded.
    expect(await page.evaluate(() => (window as any).__sameDocument)).toBe(true);
    await expectNoBrowserComplaints();

    // A run left paused and one running, for the picture.
    await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'reindex-search', body: { chunks: 400, pauseMs: 100, label: 'search' } });
    await expect.poll(() => runCard('reindex-search').getAttribute('data-state'), { timeout: 20_000 }).toBe('running');
    await expect.poll(async () => Number(await runCard('reindex-search').locator('[role=progressbar]').getAttribute('aria-valuenow')), { timeout: 30_000 }).toBeGreaterThan(2);
    await page.screenshot({ path: path.join(SCREENSHOTS, 'dashboard.png'), fullPage: true });
    await page.setViewportSize({ width: 390, height: 844 });
    await page.screenshot({ path: path.join(SCREENSHOTS, 'dashboard-phone.png'), fullPage: true });
    await page.setViewportSize({ width: 1280, height: 900 });

    await card.locator('a.title').click();
    await page.waitForURL(/\/runs\/\d+$/);
    expect(await page.locator('.run-head .tag').first().textContent()).toBe('succeeded');
    expect(await page.locator('table.steps tbody tr').count()).toBe(3);
    expect(await page.locator('svg.chart rect').count()).toBeGreaterThan(0);
    await page.screenshot({ path: path.join(SCREENSHOTS, 'run-page.png'), fullPage: true });
    await expectNoBrowserComplaints();

    const failed = (await query(url, `select id::text from idem.runs where run_key = 'backfill-orders'`))[0].id;
    await page.goto(`${server.base}/runs/${failed}`);
    expect(await page.locator('.run-head .tag').first().textContent()).toBe('failed');
    expect(await page.locator('.panel-error').textContent()).toContain('injected failure in chunk c0007');
    await page.screenshot({ path: path.join(SCREENSHOTS, 'run-page-failed.png'), fullPage: true });

    // Cancel asks first; dismissing the dialog changes nothing, accepting cancels.
    const live = (await query(url, `select id::text from idem.runs where run_key = 'reindex-search'`))[0].id;
    await page.goto(`${server.base}/runs/${live}`);
    page.once('dialog', (d) => void d.dismiss());
    await page.locator('button[data-action=cancel]').click();
    expect((await api(server.base, 'GET', `/api/runs/${live}`)).body.requested).toBeNull();
    page.once('dialog', (d) => void d.accept());
    await page.locator('button[data-action=cancel]').click();
    await expect.poll(() => page.locator('.run-head').getAttribute('data-state'), { timeout: 20_000 }).toBe('cancelled');
  }, 240_000);

  it('reads without JavaScript: the HTML itself carries every run and its state', async () => {
    const created = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'nightly-2026-11-29', body: { chunks: 12 } });
    expect((await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body.state).toBe('succeeded');
    const res = await api(server.base, 'GET', '/', { token: null });
    expect(res.status).toBe(200);
    expect(res.headers.get('content-type')).toMatch(/^text\/html/);
    expect(res.text).toMatch(/<article class="card run" data-run-id="\d+" data-state="succeeded">/);
    expect(res.text).toContain('nightly-2026-11-29');
    expect(res.text).not.toContain(TOKEN);
    // Every asset is served by idem: no other origin is referenced.
    expect(res.text).not.toMatch(/(src|href)="https?:/);
  });
});

describe('the Jobs section of the dashboard (black-box round 12, B3-5)', () => {
  it('shows each job\'s newest run as it changes, without a reload, and leaves an open Run form as it was', async () => {
    const earlier = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: `jobs-earlier-${Date.now()}`, body: { chunks: 1 } });
    expect((await api(server.base, 'GET', `/api/runs/${earlier.body.id}?wait=30`)).body.state).toBe('succeeded');
    await page.goto(`${server.base}/`);
    await page.evaluate(() => ((window as any).__sameDocument = true));
    await expect.poll(() => page.locator('.live-state').textContent()).toBe('live');
    const job = page.locator('article.job[data-job="counted"]');
    // An operator half way through the Run form.
    await job.locator('summary').click();
    await job.locator('textarea').fill('{"chunks": 3, "label": "typed"}');
    const formKey = await job.locator('input[name=__key]').inputValue();
    const key = `jobs-live-${Date.now()}`;
    const created = await api(server.base, 'POST', '/api/jobs/counted/runs', { key, body: { chunks: 30, pauseMs: 100 } });
    expect(created.status, created.text).toBe(201);
    await expect.poll(() => job.locator('p.muted.small a').textContent({ timeout: 1_000 }), { timeout: 10_000 }).toBe(key);
    expect(await job.locator('p.muted.small a').getAttribute('href')).toBe(`/runs/${created.body.id}`);
    await expect.poll(() => job.locator('.card-head .tag').textContent({ timeout: 1_000 }), { timeout: 10_000 }).toMatch(/^(running|succeeded)$/);
    await expect.poll(() => job.locator('.card-head .tag').textContent(), { timeout: 30_000 }).toBe('succeeded');
    expect(await page.evaluate(() => (window as any).__sameDocument)).toBe(true);
    expect(await job.locator('details.run-details').evaluate((d: HTMLDetailsElement) => d.open)).toBe(true);
    expect(await job.locator('textarea').inputValue()).toBe('{"chunks": 3, "label": "typed"}');
    expect(await job.locator('input[name=__key]').inputValue()).toBe(formKey);
    await expectNoBrowserComplaints();
  }, 60_000);
});

describe('the dashboard of a job with a params schema', () => {
  // A server of its own, on the same database and browser: the `paint` job (test/fixtures/dashboard-jobs).
  const DASHBOARD_JOBS = fileURLToPath(new URL('./fixtures/dashboard-jobs', import.meta.url));
  let dash: ServeProcess;
  beforeAll(async () => {
    dash = await startServe(url, ['--public-read'], {}, DASHBOARD_JOBS);
  });

  /** The page is no wider than the window: nothing makes it scroll sideways. */
  const overflow = () => page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);

  /** The dashboard of that server with the token set, and paint's Run form open. */
  async function paintForm() {
    await page.goto(`${dash.base}/`);
    // The token is kept per origin (this server has another port).
    if ((await page.locator('.token-state').textContent()) !== 'token set') {
      await page.locator('.token summary').click();
      await page.locator('#token').fill(TOKEN);
      await page.locator('.token-form button').click();
    }
    const job = page.locator('article.job[data-job="paint"]');
    await job.locator('summary').click();
    return job;
  }

  it('a refused action opens the token panel with the focus in its field; Escape closes it and gives the focus back', async () => {
    // Black-box round 19 (B13-4): the panel opened on a 401 with the focus left on the button, so a
    // keyboard user typed into nothing; Escape did not close it, and open it lay over the buttons.
    const fresh = await context.newPage();
    try {
      await fresh.goto(`${dash.base}/`);
      expect(await fresh.locator('.token-state').textContent()).toBe('API token');
      const job = fresh.locator('article.job[data-job="paint"]');
      await job.locator('summary').click();
      await job.locator('button[type=submit]').click();
      await expect.poll(() => fresh.evaluate(() => (document.querySelector('.token') as HTMLDetailsElement).open)).toBe(true);
      await expect.poll(() => fresh.evaluate(() => document.activeElement?.id)).toBe('token');
      await fresh.keyboard.press('Escape');
      expect(await fresh.evaluate(() => (document.querySelector('.token') as HTMLDetailsElement).open)).toBe(false);
      expect(await fresh.evaluate(() => document.activeElement?.closest('.token') !== null && document.activeElement?.tagName)).toBe('SUMMARY');
      // Opened again, a click elsewhere on the page closes it too.
      await fresh.locator('.token summary').click();
      await fresh.locator('h1, main').first().click({ position: { x: 5, y: 5 } });
      expect(await fresh.evaluate(() => (document.querySelector('.token') as HTMLDetailsElement).open)).toBe(false);
    } finally {
      await fresh.close();
    }
  });

  it('the Run form starts from the schema defaults, and leaves optional fields without one out', async () => {
    const job = await paintForm();
    expect(await job.locator('input[name=flag]').isChecked()).toBe(true);
    expect(await job.locator('select[name=color]').inputValue()).toBe('"green"');
    expect(await job.locator('input[name=coats]').inputValue()).toBe('2');
    // Sent untouched: the defaults, and nothing for the optional fields without one.
    await job.locator('button[type=submit]').click();
    await expect.poll(() => job.locator('.form-result a').textContent()).toMatch(/^Started run /);
    const id = (await job.locator('.form-result a').getAttribute('href'))!.split('/').at(-1)!;
    expect((await api(dash.base, 'GET', `/api/runs/${id}`)).body.params).toEqual({ flag: true, color: 'green', coats: 2, layers: ['primer'] });
    // Each optional field set by hand is sent.
    await job.locator('select[name=shade]').selectOption({ label: 'dark' });
    await job.locator('select[name=glossy]').selectOption({ label: 'false' });
    await job.locator('input[name=flag]').uncheck();
    await job.locator('button[type=submit]').click();
    await expect.poll(async () => (await job.locator('.form-result a').getAttribute('href'))?.split('/').at(-1)).not.toBe(id);
    const second = (await job.locator('.form-result a').getAttribute('href'))!.split('/').at(-1)!;
    expect((await api(dash.base, 'GET', `/api/runs/${second}`)).body.params).toEqual({ flag: false, color: 'green', coats: 2, layers: ['primer'], shade: 'dark', glossy: false });
    await expectNoBrowserComplaints();
  });

  it('B3-4: array and object fields take JSON, posted parsed; text that is not JSON of that type is refused at the field; a null option reads null', async () => {
    const job = await paintForm();
    const result = job.locator('.form-result');
    const runs = async () => (await query<{ n: number }>(url, `select count(*)::int as n from idem.runs where job = 'paint'`))[0]!.n;
    // The default array is shown as JSON.
    expect(JSON.parse(await job.locator('[name=layers]').inputValue())).toEqual(['primer']);
    // An enum's null is an option with a visible label.
    expect(await job.locator('select[name=finish] option').allTextContents()).toEqual(['— not set —', 'matte', 'null']);
    const tagsError = job.locator('[name=tags] ~ .field-error');
    const before = await runs();
    for (const [text, expected] of [
      ['["a",', /^tags: not valid JSON/],
      ['{"a": 1}', /^tags must be a JSON array, e\.g\. \["a", "b"\]; found an object$/],
      ['"a"', /^tags must be a JSON array, e\.g\. \["a", "b"\]; found a string$/],
    ] as const) {
      await job.locator('[name=tags]').fill(text);
      await job.locator('button[type=submit]').click();
      await expect.poll(() => tagsError.textContent()).toMatch(expected);
      expect(await tagsError.isVisible()).toBe(true);
      expect(await job.locator('[name=tags]').getAttribute('aria-invalid')).toBe('true');
    }
    await job.locator('[name=extra]').fill('[1]');
    await job.locator('[name=tags]').fill('["a", "b"]');
    await job.locator('button[type=submit]').click();
    await expect.poll(() => job.locator('[name=extra] ~ .field-error').textContent()).toBe('extra must be a JSON object, e.g. {"name": "value"}; found an array');
    expect(await tagsError.isVisible()).toBe(false);
    expect(await runs(), 'nothing was sent').toBe(before);
    // Valid: sent parsed, not as strings.
    await job.locator('[name=extra]').fill('{"k": [1, {"deep": true}]}');
    await job.locator('select[name=finish]').selectOption({ label: 'null' });
    await job.locator('button[type=submit]').click();
    await expect.poll(() => result.locator('a').textContent()).toMatch(/^Started run /);
    expect(await job.locator('.field-error:visible').count()).toBe(0);
    const id = (await result.locator('a').getAttribute('href'))!.split('/').at(-1)!;
    expect((await api(dash.base, 'GET', `/api/runs/${id}`)).body.params).toEqual({ flag: true, color: 'green', coats: 2, layers: ['primer'], tags: ['a', 'b'], extra: { k: [1, { deep: true }] }, finish: null });
    await expectNoBrowserComplaints();
  });

  it('a 409 or a network failure is shown in the Run form, which can be sent again with the same key', async () => {
    const job = await paintForm();
    const submit = job.locator('button[type=submit]');
    const result = job.locator('.form-result');
    // Another request with the form's key is inside its claim: the 409's own sentence.
    const key = await job.locator('input[name=__key]').inputValue();
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      await holder.query('begin');
      await holder.query('select pg_advisory_xact_lock($1::bigint)', [lockKey(`idem:http:paint:${key}`)]);
      await submit.click();
      await expect.poll(() => result.textContent()).toContain('is being processed right now; retry in a moment');
      expect(await submit.isDisabled()).toBe(false);
    } finally {
      await holder.query('rollback').catch(() => {});
      await holder.end();
    }
    // The server cannot be reached: said so, instead of nothing at all.
    await page.route('**/api/jobs/paint/runs', (route) => route.abort('connectionrefused'));
    try {
      await submit.click();
      await expect.poll(() => result.textContent()).toMatch(/^the server did not answer/);
      expect(await result.getAttribute('class')).toContain('bad');
      expect(await submit.isDisabled()).toBe(false);
    } finally {
      await page.unroute('**/api/jobs/paint/runs');
    }
    // Sent again once the claim is over, the same key starts the run.
    expect(await job.locator('input[name=__key]').inputValue()).toBe(key);
    await submit.click();
    await expect.poll(() => job.locator('.form-result a').textContent()).toMatch(/^Started run /);
    expect(await query(url, 'select count(*)::int as n from idem.runs where run_key = $1', [key])).toEqual([{ n: 1 }]);
    await expectNoBrowserComplaints();
  });

  it('a skipped chunk with a long unbroken error does not make the run page wider than the window', async () => {
    const created = await api(dash.base, 'POST', '/api/jobs/paint/runs', { key: 'paint-long-error', body: {} });
    expect((await api(dash.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body.state).toBe('succeeded');
    await page.goto(`${dash.base}/runs/${created.body.id}`);
    expect(await page.locator('.panel', { hasText: 'Skipped chunks' }).locator('td').filter({ hasText: 'bad c2' }).count()).toBe(1);
    try {
      for (const width of [1280, 390]) {
        await page.setViewportSize({ width, height: 900 });
        expect(await overflow(), `at ${width} px`).toBeLessThanOrEqual(0);
      }
      await page.screenshot({ path: path.join(SCREENSHOTS, 'run-page-long-error-phone.png'), fullPage: true });
      // The dashboard, its run cards and job cards, too.
      await page.goto(`${dash.base}/`);
      expect(await overflow(), 'the dashboard at 390 px').toBeLessThanOrEqual(0);
    } finally {
      await page.setViewportSize({ width: 1280, height: 900 });
    }
    await expectNoBrowserComplaints();
  });
});

describe('hostile text in run keys and errors (black-box round 12)', () => {
  /** A finished run of `counted`, then given `key`, and failed with `error` by hand (as SQL or another tool could write them). */
  async function runWith(key: string, error: string, chunk = 'c0001'): Promise<string> {
    const created = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: `hostile-${Date.now()}`, body: { chunks: 2 } });
    expect((await api(server.base, 'GET', `/api/runs/${created.body.id}?wait=30`)).body.state).toBe('succeeded');
    const at = new Date().toISOString();
    await query(url, `update idem.runs set run_key = $2, status = 'failed', error = $3::jsonb where id = $1`, [created.body.id, key, JSON.stringify({ step: 'work', chunk, tries: 1, message: error, at })]);
    return String(created.body.id);
  }
  const liveState = () => page.locator('.live-state').textContent();

  it('B3-1: a carriage return in a key or an error reaches the page as rendered, after a live update too', async () => {
    const key = 'cr-key\rafter-cr';
    const message = 'curl: progress 10%\rprogress 100%';
    const id = await runWith(key, message);
    try {
      await page.goto(`${server.base}/runs/${id}`);
      await expect.poll(liveState).toBe('live');
      // The Last error box holds the message, whole, and nothing else; the Steps panel stays its sibling.
      expect(await page.locator('.panel-error pre').textContent()).toBe(message);
      expect(await page.locator('.panel-error table.steps').count()).toBe(0);
      expect(await page.locator('.live > .run-live > .two table.steps').count()).toBe(1);
      // A key's control characters show as the terminal shows them (`\r`): two keys never look the same.
      expect(await page.locator('.run-head .key').textContent()).toBe(visible(key));
      // On the dashboard, the Cancel button's confirm text holds the key, and no run card is inside another.
      await page.goto(`${server.base}/`);
      await expect.poll(liveState).toBe('live');
      expect(await page.locator('article.run article.run').count()).toBe(0);
      expect(await page.locator(`article.run[data-run-id="${id}"] button[data-action=cancel]`).getAttribute('data-confirm')).toContain(visible(key));
      expect(await page.locator(`article.run[data-run-id="${id}"] .key`).textContent()).toBe(visible(key));
    } finally {
      await query(url, `update idem.runs set status = 'cancelled' where id = $1`, [id]);
    }
    await expectNoBrowserComplaints();
  });

  it('B3-2: a 200-character key, or 60 emoji, does not make the run page or the dashboard wider than a 360 px window', async () => {
    const overflow = () => page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    const long = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: `${'k'.repeat(199)}1`, body: { chunks: 2 } });
    expect(long.status, long.text).toBe(201);
    expect((await api(server.base, 'GET', `/api/runs/${long.body.id}?wait=30`)).body.state).toBe('succeeded');
    const emoji = await runWith('🦀'.repeat(60), 'failed');
    try {
      await page.setViewportSize({ width: 360, height: 800 });
      for (const id of [String(long.body.id), emoji]) {
        await page.goto(`${server.base}/runs/${id}`);
        await expect.poll(liveState).toBe('live');
        expect(await overflow(), `run ${id} at 360 px`).toBeLessThanOrEqual(0);
        // Wrapped, not cut: the whole key is on the page, inside the window.
        const box = (await page.locator('.run-head .key').boundingBox())!;
        expect(box.x + box.width, `run ${id}`).toBeLessThanOrEqual(360);
        expect(box.height, `run ${id}: the key takes several lines`).toBeGreaterThan(30);
      }
      await page.screenshot({ path: path.join(SCREENSHOTS, 'run-page-long-key-phone.png'), fullPage: true });
      await page.goto(`${server.base}/`);
      await expect.poll(liveState).toBe('live');
      expect(await overflow(), 'the dashboard at 360 px').toBeLessThanOrEqual(0);
    } finally {
      await page.setViewportSize({ width: 1280, height: 900 });
      await query(url, `update idem.runs set status = 'cancelled' where id = $1`, [emoji]);
    }
  });

  it('B3-3: a right-to-left override in a key, a chunk key or an error stays inside that text (in a key it is shown as its escape)', async () => {
    const RLO = '\u202E';
    const key = `rtl${RLO}abc-def`;
    const id = await runWith(key, `boom${RLO} reversed`, `c${RLO}01`);
    /** Where `text` (inside the element `selector`) is drawn: its first and last character's boxes. */
    const textBox = (selector: string, text: string) =>
      page.evaluate(
        ([sel, t]) => {
          const root = document.querySelector(sel)!;
          const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
          for (let n = walker.nextNode(); n; n = walker.nextNode()) {
            const at = n.textContent!.indexOf(t);
            if (at === -1) continue;
            const box = (i: number) => {
              const r = document.createRange();
              r.setStart(n!, i);
              r.setEnd(n!, i + 1);
              return r.getBoundingClientRect();
            };
            return { first: box(at).left, last: box(at + t.length - 1).left };
          }
          throw new Error(`no text ${t} in ${sel}`);
        },
        [selector, text] as const,
      );
    try {
      // The job card: "last run <key> · <time>", the server's time left to right after the key.
      await page.goto(`${server.base}/`);
      const lastRun = 'article.job[data-job="counted"] p.muted.small';
      expect(await page.locator(`${lastRun} a`).textContent()).toBe(visible(key)); // rtl\u202eabc-def
      const keyBox = (await page.locator(`${lastRun} a`).boundingBox())!;
      const time = await textBox(`${lastRun} time`, ':');
      expect(time.first, 'the time comes after the key').toBeGreaterThanOrEqual(keyBox.x + keyBox.width - 1);
      const clock = await textBox(`${lastRun} time`, (await page.locator(`${lastRun} time`).textContent())!);
      expect(clock.first, 'the time reads left to right').toBeLessThan(clock.last);
      // The run card's error line: "✖ work · <chunk>: <message>"; the run page's "… chunk <chunk> after 1 try".
      const errorLine = `article.run[data-run-id="${id}"] .error-line`;
      const step = await textBox(errorLine, 'work');
      expect(step.first).toBeLessThan(step.last);
      expect((await textBox(errorLine, 'boom')).first, 'the message after the step').toBeGreaterThan(step.last);
      await query(url, `update idem.runs set params = jsonb_set(params, '{label}', to_jsonb($2::text)) where id = $1`, [id, `x${RLO}y`]);
      await page.goto(`${server.base}/runs/${id}`);
      // In the params, such a character is shown as its JSON escape.
      expect(await page.locator('.panel', { hasText: 'Params' }).locator('pre').textContent()).toContain('"label": "x\\u202ey"');
      const after = await textBox('.panel-error p', 'after 1 try');
      expect(after.first, '"after 1 try" reads left to right').toBeLessThan(after.last);
      const strong = (await page.locator('.panel-error p strong').boundingBox())!;
      expect(after.first, '"after 1 try" follows the chunk').toBeGreaterThanOrEqual(strong.x + strong.width - 1);
      // Every element holding such text isolates it.
      for (const sel of ['.run-head .key', '.panel-error pre']) {
        expect(await page.locator(sel).evaluate((el) => [el, ...el.querySelectorAll('*')].some((e) => getComputedStyle(e).unicodeBidi === 'isolate')), sel).toBe(true);
      }
    } finally {
      await query(url, `update idem.runs set status = 'cancelled' where id = $1`, [id]);
    }
  });
});

describe("a run whose job's code changed since it stopped (black-box round 13)", () => {
  it('its page says so; Resume asks first, then resumes it with the new code', async () => {
    const created = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: 'deploy-mid-run', body: { chunks: 8, pauseMs: 200 } });
    const id = created.body.id as string;
    // Started (runs of one job take turns in the server): a paused run that never started has no code to compare.
    await expect.poll(async () => (await api(server.base, 'GET', `/api/runs/${id}`)).body.attempt, { timeout: 30_000 }).toBe(1);
    await api(server.base, 'POST', `/api/runs/${id}/pause`);
    await expect.poll(async () => (await api(server.base, 'GET', `/api/runs/${id}`)).body.state, { timeout: 20_000 }).toBe('paused');
    // As if a deploy changed the job after this attempt: the run's code is not the server's.
    const old = `sha256:${'0'.repeat(64)}`;
    await query(url, `update idem.runs set code_fingerprint = $1 where id = $2`, [old, id]);
    const view = (await api(server.base, 'GET', `/api/runs/${id}`)).body;
    expect(view.codeChanged).toMatchObject({ from: old });
    // Before: POST …/resume answered 200 and the run never continued; now a plain one is refused.
    expect((await api(server.base, 'POST', `/api/runs/${id}/resume`)).status).toBe(409);

    await page.goto(`${server.base}/runs/${id}`);
    if ((await page.locator('.token-state').textContent()) !== 'token set') {
      await page.locator('.token summary').click();
      await page.locator('#token').fill(TOKEN);
      await page.locator('.token-form button').click();
    }
    expect(await page.locator('.panel-error').textContent()).toContain('Code changed since the run started');
    expect(await page.locator('.panel-error').textContent()).toContain('{"allowChangedCode":true}');
    let asked = '';
    page.once('dialog', (d) => {
      asked = d.message();
      void d.dismiss();
    });
    await page.locator('button[data-action=resume]').click();
    await expect.poll(() => asked).toContain('Resume it with the new code?');
    expect((await api(server.base, 'GET', `/api/runs/${id}`)).body.state).toBe('paused');
    page.once('dialog', (d) => void d.accept());
    await page.locator('button[data-action=resume]').click();
    await expect.poll(async () => (await api(server.base, 'GET', `/api/runs/${id}`)).body.state, { timeout: 30_000 }).toBe('succeeded');
    const [row] = await query(url, `select code_changes from idem.runs where id = $1`, [id]);
    expect(row.code_changes).toEqual([{ from: old, to: view.codeChanged.to, attempt: 2, at: expect.any(String) }]);
  }, 60_000);
});

describe('a run page while the database cannot be read (black-box: a short outage)', () => {
  const liveState = () => page.locator('.live-state').textContent();
  const headState = () => page.locator('.run-head').getAttribute('data-state');

  it('keeps its live stream through the outage, says the database is unreachable, and shows the final state after, without a reload', async () => {
    // Reads give up after 1 s, so a read held by the lock below fails as one of a lost database does (503).
    const srv = await startServe(url, ['--public-read'], { IDEM_SERVE_READ_TIMEOUT_MS: '1000' });
    const holder = new pg.Client({ connectionString: url });
    await holder.connect();
    try {
      const created = await api(srv.base, 'POST', '/api/jobs/counted/runs', { key: `outage-${Date.now()}`, body: { chunks: 40, pauseMs: 100 } });
      expect(created.status, created.text).toBe(201);
      await page.goto(`${srv.base}/runs/${created.body.id}`);
      await page.evaluate(() => ((window as any).__sameDocument = true));
      await expect.poll(headState, { timeout: 20_000 }).toBe('running');
      await expect.poll(liveState).toBe('live');
      // The outage: no read of the runs table answers for 6 s.
      await holder.query('begin');
      await holder.query('lock table idem.runs in access exclusive mode');
      // Before: the stream ended, its reconnect was answered 503, and the EventSource gave up for good.
      const live = await fetch(`${srv.base}/runs/${created.body.id}/live`);
      expect(live.status).toBe(200);
      await expect.poll(liveState, { timeout: 10_000 }).toBe('database unreachable; retrying…');
      const reader = live.body!.getReader();
      let text = '';
      while (!text.includes('event: unavailable')) text += new TextDecoder().decode((await reader.read()).value);
      await reader.cancel();
      await new Promise((r) => setTimeout(r, 4_000));
      await holder.query('commit');
      await expect.poll(headState, { timeout: 60_000 }).toBe('succeeded');
      expect(await liveState()).toBe('live');
      expect(await page.evaluate(() => (window as any).__sameDocument)).toBe(true);
    } finally {
      await holder.query('rollback').catch(() => {});
      await holder.end();
      srv.proc.child.kill('SIGKILL');
      await srv.proc.done;
    }
  }, 120_000);

  it('opens its stream again after an answer that is not a 200 (a proxy\'s 502, a restarting server\'s 503), with a backoff', async () => {
    const created = await api(server.base, 'POST', '/api/jobs/counted/runs', { key: `refused-${Date.now()}`, body: { chunks: 40, pauseMs: 100 } });
    expect(created.status, created.text).toBe(201);
    const refused: number[] = [];
    // The first two opens of the stream are answered 503, as a server without its database did.
    await page.route(`**/runs/${created.body.id}/live`, async (route) => {
      if (refused.length < 2) {
        refused.push(Date.now());
        return route.fulfill({ status: 503, contentType: 'application/problem+json', body: '{"status":503}' });
      }
      return route.continue();
    });
    try {
      await page.goto(`${server.base}/runs/${created.body.id}`);
      expect(await headState()).not.toBe('succeeded');
      await page.evaluate(() => ((window as any).__sameDocument = true));
      await expect.poll(() => refused.length, { timeout: 10_000 }).toBe(2);
      await expect.poll(headState, { timeout: 60_000 }).toBe('succeeded');
      await expect.poll(liveState).toBe('live');
      // Not at once: after a delay that grows.
      expect(refused[1]! - refused[0]!).toBeGreaterThanOrEqual(900);
      expect(await page.evaluate(() => (window as any).__sameDocument)).toBe(true);
    } finally {
      await page.unroute(`**/runs/${created.body.id}/live`);
    }
  }, 90_000);
});
