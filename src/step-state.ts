/**
 * The state a step is shown in. A step's row says `running` until someone finishes it: in a run
 * nobody is executing (failed, paused, interrupted, crashed, cancelled) the step where it stopped
 * shows the run's state, in `idem status` (text and `--json`) and the HTTP run view alike. In a
 * succeeded run every step of the job is done: one that is not was dropped from the job (under
 * `--allow-changed-code`) and shows `dropped`, not `pending` or the run's `succeeded`.
 */
export function shownStepState(stepStatus: string, runState: string): string {
  if (runState === 'succeeded' && stepStatus !== 'done') return 'dropped';
  return stepStatus === 'running' && runState !== 'running' ? runState : stepStatus;
}
