import { defineJob } from 'idem';

/** The HTTP benchmark's job: one single step that does nothing, so the API's own cost shows. */
export default defineJob<{ n?: number }>({
  name: 'bench-trivial',
  description: 'benchmark: one empty step',
  params: (raw) => raw as { n?: number },
  steps: [{ name: 'noop', run: () => {} }],
});
