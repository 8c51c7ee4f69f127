import fs from 'node:fs';
import tty from 'node:tty';

/**
 * A terminal that hangs up under idem (an ssh session dropped, a terminal window closed) sends it
 * SIGHUP, which stops it gracefully like SIGTERM, and makes every write to it fail with EIO. Two
 * things then crashed it instead: a failed write to stderr or stdout is an 'error' event that
 * nothing handled (an uncaught exception, the run left `running`), and at exit Node 20 restores
 * the terminal's settings on fds 0-2 and aborts when that fails (nodejs/node#51519, fixed in later
 * Node). So once the terminal is gone, fds 0-2 that were on it are pointed at /dev/null (Node then
 * leaves them alone at exit: "the program reopened the file descriptor"), and EIO from stdio is
 * not an error: nobody is there to read it.
 */

/** Points fds 0-2 that are on a hung-up terminal at /dev/null. Never throws. */
export function detachHungUpTerminal(): void {
  for (const fd of [0, 1, 2]) {
    try {
      // A hung-up terminal is still a character device, but no longer answers as a terminal.
      if (!fs.fstatSync(fd).isCharacterDevice() || tty.isatty(fd) || isDevNull(fd)) continue;
      fs.closeSync(fd);
      const reopened = fs.openSync('/dev/null', fd === 0 ? 'r' : 'w');
      if (reopened !== fd) fs.closeSync(reopened); // fd was taken meanwhile: leave it closed
    } catch {
      // Nothing better to do for this fd.
    }
  }
}

const isDevNull = (fd: number): boolean => {
  const a = fs.fstatSync(fd);
  const b = fs.statSync('/dev/null');
  return a.rdev === b.rdev && a.ino === b.ino;
};

let guarded = false;

/**
 * From here on a write to stdout or stderr that fails because the terminal hung up (EIO) detaches
 * from it, and one to a pipe whose reader is gone (EPIPE) is dropped, instead of crashing idem.
 */
export function guardStdio(): void {
  if (guarded) return;
  guarded = true;
  const onError = (err: NodeJS.ErrnoException) => {
    if (err.code === 'EIO') {
      detachHungUpTerminal();
      return;
    }
    // The reader went away (`idem run … | head -1`, `| true`): what is left to print is dropped,
    // and the work goes on with the exit code it would have had. Node ignores SIGPIPE, so this
    // came as an 'error' event that nothing handled, an uncaught exception blamed on the job.
    if (err.code === 'EPIPE') return;
    // A write after that failure, to the stream it destroyed: the same dead terminal or pipe.
    if (err.code === 'ERR_STREAM_DESTROYED') return;
    // Anything else stays what it was without this listener: an uncaught exception.
    process.nextTick(() => {
      throw err;
    });
  };
  process.stdout.on('error', onError);
  process.stderr.on('error', onError);
}
