/**
 * Test-only fault injection at named boundaries of the protocol, so a test can crash or stall the
 * runner exactly where a real crash would hurt most. Off unless IDEM_FAULT is set; when off,
 * `faultPoint` is a function that returns at once (the env var is read once, at load).
 *
 * IDEM_FAULT=<point>:<action>[:<nth>]   e.g. `after-marker:crash:5` (SIGKILL itself at the 5th hit)
 *   action: `crash` (SIGKILL, no cleanup at all), `stall` (hang until killed), `throw` (an error)
 */
export const FAULT_POINTS = [
  'after-lock', // the advisory lock is held, the attempt not yet bumped
  'after-claim', // a chunk's transaction has begun, the job's work not yet run
  'after-work', // the job's work is done, the marker not yet written
  'after-marker', // the marker is written, the transaction not yet committed
  'after-commit', // the chunk is committed
  'before-finish', // every step is done, the run not yet marked succeeded
] as const;
export type FaultPoint = (typeof FAULT_POINTS)[number];

type Action = 'crash' | 'stall' | 'throw';

function parse(spec: string | undefined): { point: FaultPoint; action: Action; nth: number } | null {
  if (!spec) return null;
  const [point, action = 'crash', nth = '1'] = spec.split(':');
  if (!FAULT_POINTS.includes(point as FaultPoint) || !['crash', 'stall', 'throw'].includes(action) || !(Number(nth) >= 1)) {
    throw new Error(`IDEM_FAULT=${spec} is not <point>:<crash|stall|throw>[:<nth>] with point one of ${FAULT_POINTS.join(', ')}`);
  }
  return { point: point as FaultPoint, action: action as Action, nth: Number(nth) };
}

const fault = parse(process.env.IDEM_FAULT);
/** Whether IDEM_FAULT armed a fault point: the chunk path skips its fault points (and their awaits) when not. */
export const faultsArmed = fault !== null;
let hits = 0;

async function trigger(point: FaultPoint): Promise<void> {
  if (point !== fault!.point || ++hits !== fault!.nth) return;
  process.stderr.write(`idem: fault injected at ${point} (${fault!.action})\n`);
  if (fault!.action === 'crash') process.kill(process.pid, 'SIGKILL');
  if (fault!.action === 'throw') throw new Error(`fault injected at ${point}`);
  await new Promise(() => setInterval(() => {}, 60_000));
}

/** Crashes, stalls or throws here when IDEM_FAULT names this point; otherwise does nothing. */
export const faultPoint: (point: FaultPoint) => Promise<void> | undefined = fault ? trigger : () => undefined;
