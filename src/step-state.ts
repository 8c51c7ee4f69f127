/**
 * The state a step is shown in. A step's row says `running` until someone finishes it: in a run
 * nobody is executing (failed, paused, interrupted, crashed, cancelled) the step where it stopped
 * shows the run's state, in `idem status` (text and `--json`) and the HTTP run view alike.
 */
export function shownStepState(stepStatus: string, runState: string): string {
  return stepStatus === 'running' && runState !== 'running' ? runState : stepStatus;
}
