// The start-up benchmark's JavaScript job (`idem --jobs-dir test/bench/jobs-js run bench-noop-js`):
// its no-op rerun shows what a job needs no compiler for.
import { defineJob } from 'idem';

export default defineJob({
  name: 'bench-noop-js',
  description: 'benchmark: one empty step, in plain JavaScript',
  steps: [{ name: 'noop', run() {} }],
});
