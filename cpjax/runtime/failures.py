"""The cause of a failure that stops a run, and the one line that names it and the way out.

A run ends on an operational failure with one `FATAL` line (main.py prints it): what failed,
why, what to do, and where the rerun resumes. The causes are told apart because their ways
out differ:

  * advised: an error that names its own cause and way out (cpjax.runtime.advised: the host
    stage's "/dev/shm too small", a damaged image, a dead decoding worker, a damaged record).
    The exception chain is walked from the error raised, and the first such error is the
    cause named, with the resume advice: the errors beneath it are its details (the ENOSPC
    beneath a full /dev/shm is not a full checkpoint folder);
  * storage: an OSError whose errno says the folder refuses the write (full disk, exceeded
    quota, read-only or permission denied: `STORAGE_ERRNOS`), or an error of another type
    with such an errno's text (tensorstore's, TensorFlow's): make the folder writable or
    free space there, then rerun. The folder is the failing file's: the OSError's filename,
    else the first absolute path in the message whose folder exists (TensorFlow names the
    events file only in its text), else the run's workdir (an ENOSPC of a write() names no
    file); a TensorBoard events file (`EVENTS_MARK` in its name) is named as such;
  * a lost process: in a multi-process run, the text of a collective's or JAX's coordination
    service's error says a peer is gone (Gloo's "Connection reset by peer", "stopped sending
    heartbeats", ...: `LOST_PEER_TEXT`): nothing to fix here; rerun the same command on every
    process;
  * anything else: named by its exception type and message.

Every line ends with the rerun advice naming the newest committed checkpoint (read from the
checkpoint folder's commit markers, so it is right whatever the process was doing).
"""

from collections.abc import Iterator
import contextlib
import errno
import logging
import os
import re

from cpjax.runtime import orbax_layout
from cpjax.runtime.advised import AdvisedError

# errno values of a folder that refuses a write: no space, quota, permission, read-only.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                            errno.EROFS})
# Lower-case fragments of the errors a collective (Gloo, NCCL, the TPU runtime) or JAX's
# coordination service raises when a peer process has died or become unreachable.
LOST_PEER_TEXT = ("connection reset by peer", "connection closed by peer",
                  "stopped sending heartbeats", "heartbeat timeout", "tasks have crashed",
                  "tasks are unhealthy", "leader task was preempted/died")
ADVISED, STORAGE, LOST_PROCESS, OTHER = "advised", "storage", "lost process", "other"
EVENTS_MARK = ".tfevents."  # In a TensorBoard events file's name.
# An absolute path in an error's text: after the start or a blank, up to a blank, quote or ;.
_PATH_IN_TEXT = re.compile(r"(?:^|\s)(/[^\s;'\"]+)")


def chain(err: BaseException) -> Iterator[BaseException]:
  """`err`, then the exceptions it was raised from or during (`__cause__`, `__context__`)."""
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    yield err
    err = err.__cause__ or err.__context__


# The same errors as text (tensorstore, under orbax, reports them in its own exceptions).
_STORAGE_TEXT = tuple(sorted(os.strerror(code).lower() for code in STORAGE_ERRNOS))


def storage_error(err: BaseException) -> BaseException | None:
  """The error in `err`'s chain that says a folder refuses writes, if there is one: an
  OSError with one of STORAGE_ERRNOS, else one whose message is such an errno's text."""
  errors = list(chain(err))
  found = next((e for e in errors if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS),
               None)
  return found or next((e for e in errors if not isinstance(e, OSError) and any(
      text in str(e).lower() for text in _STORAGE_TEXT)), None)


def is_lost_peer(err: BaseException, process_count: int) -> bool:
  """Whether `err` (or an error in its chain) says that a peer process of a multi-process
  run is gone. With one process there is no peer: always False."""
  return process_count > 1 and any(
      fragment in str(e).lower() for e in chain(err) for fragment in LOST_PEER_TEXT)


def advised_error(err: BaseException) -> AdvisedError | None:
  """The first error of `err`'s chain (from `err` down) that names its own way out, if any."""
  return next((e for e in chain(err) if isinstance(e, AdvisedError)), None)


def cause(err: BaseException, process_count: int) -> str:
  """ADVISED, STORAGE, LOST_PROCESS or OTHER (an error that says its way out first; then
  storage: a full disk is a full disk anywhere)."""
  if advised_error(err) is not None:
    return ADVISED
  if storage_error(err) is not None:
    return STORAGE
  return LOST_PROCESS if is_lost_peer(err, process_count) else OTHER


def failing_path(err: BaseException) -> str:
  """The file a storage error is about: its filename (an OSError's), else the first absolute
  path in its message whose folder exists; "" if neither."""
  path = getattr(err, "filename", None)
  if isinstance(path, str) and path:
    return path
  return next((found for found in _PATH_IN_TEXT.findall(str(err))
               if os.path.isdir(os.path.dirname(found))), "")


def describe(err: BaseException) -> str:
  """`Type: first line of the message`, cut at 400 characters (orbax and tensorstore append
  long specs and stack traces to their messages)."""
  text = str(err).split(" [tensorstore_spec=")[0].strip().split("\n")[0]
  return f"{type(err).__name__}: {text}"[:400]


@contextlib.contextmanager
def detail_of(error: BaseException | None) -> Iterator[None]:
  """A block whose failure, while `error` propagates (None: none does), is logged as its
  detail and dropped: a run stops on the failure it met first (a disk that the TensorBoard
  events file found full, not the checkpoint whose commit failed on it next)."""
  try:
    yield
  except Exception as err:  # pylint: disable=broad-except  (raised again without `error`)
    if error is None:
      raise
    logging.warning("Stopping on %s, this failed too: %s", describe(error), describe(err))


def resume_advice(checkpoint_dir: str) -> str:
  """How to go on: rerun the same command, which resumes from the newest committed
  checkpoint in `checkpoint_dir` (named by its step), or starts afresh if there is none."""
  steps = orbax_layout.committed_steps(checkpoint_dir)
  if not steps:
    return (f"rerun the same command: no checkpoint is committed in {checkpoint_dir} yet, so "
            "it starts from the beginning")
  return (f"rerun the same command: it resumes from the last good checkpoint, step "
          f"{steps[-1]} in {checkpoint_dir}")


def lost_process_line(which: str, detail: str, checkpoint_dir: str) -> str:
  """The line of a run stopped because a process of the job was lost.

  Args:
    which: the lost process ("process 1 of 2"), or "" if it is not known.
    detail: what showed the loss (an error's description, or the silence's length).
    checkpoint_dir: the run's checkpoint folder.
  """
  who = which or "a process of this job (see the other processes' logs for which)"
  return (f"{who} was lost ({detail}): killed, out of memory or its host down; this process "
          f"stops too. Once every process has ended, {resume_advice(checkpoint_dir)} (on "
          "every process)")


def line(err: BaseException, checkpoint_dir: str, process_count: int, what: str = "",
         folder: str = "") -> str:
  """The one FATAL line for `err`, worded by its cause (see the module docstring).

  Args:
    err: the exception that stopped the run.
    checkpoint_dir: the run's checkpoint folder (for the resume advice).
    process_count: the run's number of processes.
    what: what failed, e.g. "writing a checkpoint in DIR" (default: writing the failing
      file, `failing_path`).
    folder: the folder to make writable (default: the failing file's, else the run's
      workdir, `checkpoint_dir`'s parent).
  """
  kind = cause(err, process_count)
  if kind == ADVISED:
    return f"{' '.join(str(advised_error(err)).split())}; {resume_advice(checkpoint_dir)}"
  if kind == STORAGE:
    oserror = storage_error(err)
    path = failing_path(oserror)
    named = (f"the TensorBoard events file {path}" if EVENTS_MARK in os.path.basename(path)
             else path)
    what = what or (f"writing {named}" if path else "writing the run's files")
    folder = folder or os.path.dirname(path) or os.path.dirname(checkpoint_dir)
    return (f"{what} failed ({describe(oserror)}); make the folder {folder} writable (or "
            f"free space there), then {resume_advice(checkpoint_dir)}")
  if kind == LOST_PROCESS:
    return lost_process_line("", describe(err) + (f" while {what}" if what else ""),
                             checkpoint_dir)
  return f"{what or 'the run'} failed ({describe(err)}); {resume_advice(checkpoint_dir)}"
