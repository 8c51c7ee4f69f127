import { randomUUID } from 'node:crypto';
import type { FastifyInstance } from 'fastify';
import { paramsSchema } from './api-routes.ts';
import { DASHBOARD_CSS, DASHBOARD_JS, FAVICON_SVG } from './dashboard-assets.ts';
import { esc, homeLive, jobsLive, jobsSection, page, runLive, type HomeRuns, type RunList } from './dashboard-html.ts';
import { printable } from './claim-request.ts';
import { HttpProblem, toProblem } from './problem.ts';
import type { RunStatus } from '../store.ts';
import type { ServerContext } from './server-context.ts';
import { streamEvents } from './sse.ts';
import { visible } from '../text-table.ts';

/**
 * The dashboard's lists by stored status. Active: runs that move or wait for an operator (a
 * `running` row is running or crashed); they are listed apart from the pending ones, so a queue of
 * pending runs never pushes them off the page.
 */
const LISTS: Readonly<Record<keyof HomeRuns, { readonly statuses: readonly RunStatus[]; readonly shown: number }>> = {
  active: { statuses: ['running', 'failed', 'interrupted', 'paused'], shown: 100 },
  pending: { statuses: ['pending'], shown: 24 },
  completed: { statuses: ['succeeded', 'cancelled', 'deleting'], shown: 24 },
};

/** Runs of a list counted at most: beyond, its heading says 10,000+ (the count stops there). */
export const COUNT_CAP = 10_000;

/** The newest runs of a list, and how many it has in all. */
async function runList(ctx: ServerContext, { statuses, shown }: (typeof LISTS)[keyof HomeRuns]): Promise<RunList> {
  // One more than is shown tells whether the list is cut; only then is it counted.
  const runs = await ctx.views.list({ statuses, limit: shown + 1 });
  if (runs.length <= shown) return { runs, total: runs.length, atLeast: false };
  // Counted a moment after the list was read: never fewer than the list held.
  const total = Math.max(await ctx.views.count(statuses, COUNT_CAP + 1), shown + 1);
  return { runs: runs.slice(0, shown), total: Math.min(total, COUNT_CAP), atLeast: total > COUNT_CAP };
}

async function homeRuns(ctx: ServerContext): Promise<HomeRuns> {
  const [active, pending, completed] = await Promise.all([runList(ctx, LISTS.active), runList(ctx, LISTS.pending), runList(ctx, LISTS.completed)]);
  return { active, pending, completed };
}

/**
 * The operator's page: server-rendered HTML (readable without JavaScript), a stylesheet and a small
 * script served from here, and live regions fed by server-sent events carrying re-rendered HTML.
 */
export function registerDashboardRoutes(app: FastifyInstance, ctx: ServerContext): void {
  const asset = (type: string, body: string) => async (_req: unknown, reply: any) => reply.type(type).header('cache-control', 'public, max-age=300').send(body);
  app.get('/assets/dashboard.css', asset('text/css; charset=utf-8', DASHBOARD_CSS));
  app.get('/assets/dashboard.js', asset('text/javascript; charset=utf-8', DASHBOARD_JS));
  app.get('/favicon.svg', asset('image/svg+xml', FAVICON_SVG));

  const schemas = new Map([...ctx.jobs.values()].map((j) => [j.name, paramsSchema(j)]));
  // Strict CSP: only idem's own script and style (progress widths are classes of the stylesheet).
  const csp = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; form-action 'self'";

  app.get('/', async (_request, reply) => {
    // A job is new when it has no run at all: asked of the database, not of the lists shown.
    const [runs, latest] = await Promise.all([homeRuns(ctx), ctx.views.latestOfJobs([...ctx.jobs.keys()])]);
    const jobs = [...ctx.jobs.values()].sort((a, b) => (a.name < b.name ? -1 : 1));
    const html = page('Runs', homeLive(runs), jobsSection(jobs, schemas, latest, randomUUID), { liveUrl: '/live', publicRead: ctx.publicRead });
    return reply.type('text/html; charset=utf-8').header('content-security-policy', csp).header('cache-control', 'no-store').send(html);
  });

  app.get('/live', async (request, reply) => {
    // The Jobs section is not replaced (an operator may be filling in a Run form there): its
    // `jobs` event carries each job's status, which the page puts in place of the old one.
    const names = [...ctx.jobs.keys()].sort();
    streamEvents(
      request,
      reply,
      async () => {
        const [runs, latest] = await Promise.all([homeRuns(ctx), ctx.views.latestOfJobs(names)]);
        return [
          { event: 'html', data: homeLive(runs) },
          { event: 'jobs', data: jobsLive(names, latest) },
        ];
      },
      { intervalMs: ctx.sseIntervalMs, open: ctx.openStreams, mask: ctx.mask },
    );
  });

  const unknownRun = (id: string) => new HttpProblem(404, 'idem.unknownRun', `no run with id "${printable(id)}"; the dashboard at / lists the runs`);

  app.get<{ Params: { id: string } }>('/runs/:id', async (request, reply) => {
    const run = await ctx.views.get(request.params.id);
    if (!run) throw unknownRun(request.params.id);
    // Bidi controls in params are shown as JSON escapes: one inside a string would reorder the rest of its line.
    const json = JSON.stringify(run.params, null, 2).replace(/[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
    const params = `<section class="panel"><h2>Params</h2><pre>${esc(json)}</pre><p class="muted small mono">${esc(run.fingerprint)}</p></section>`;
    // FSI … PDI: a bidi control in the key reorders nothing else of the title.
    const html = page(`${run.job} \u2068${visible(run.key)}\u2069`, runLive(run), params, { liveUrl: `/runs/${run.id}/live`, publicRead: ctx.publicRead });
    return reply.type('text/html; charset=utf-8').header('content-security-policy', csp).header('cache-control', 'no-store').send(html);
  });

  app.get<{ Params: { id: string } }>('/runs/:id/live', async (request, reply) => {
    // A run that never existed is a 404; one removed while its page is open ends with `gone`. While
    // the database cannot be reached the stream opens all the same (200, saying so, as /live does):
    // a browser's EventSource never reconnects after a 503, and the page would stop updating for good.
    let first: Awaited<ReturnType<typeof ctx.views.get>>;
    try {
      first = await ctx.views.get(request.params.id);
      if (!first) throw unknownRun(request.params.id);
    } catch (err) {
      if (toProblem(err).status !== 503) throw err;
      first = undefined;
    }
    streamEvents(
      request,
      reply,
      async () => {
        // The read that answered the 404 question is the stream's first event.
        const run = first ?? (await ctx.views.get(request.params.id));
        first = undefined;
        return run ? { event: 'html', data: runLive(run) } : { event: 'gone', data: request.params.id, end: true };
      },
      { intervalMs: ctx.sseIntervalMs, open: ctx.openStreams, mask: ctx.mask },
    );
  });
}
