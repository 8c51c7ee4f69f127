// The benchmark job as the CLI loads it (`idem --jobs-dir test/bench/jobs run bench-backfill`).
export { benchBackfill as default } from '../backfill-job.ts';
