import type { FastifyInstance } from 'fastify';
import type { ServerContext } from './server-context.ts';

export function registerDashboardRoutes(_app: FastifyInstance, _ctx: ServerContext): void {}
