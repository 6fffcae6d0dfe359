"""Errors that name their own cause and way out: the run's one FATAL line prints them.

An operational failure deep in the data path is often raised from a lower error: the host
stage's "/dev/shm is too small" from the ENOSPC of reserving the pages, a damaged image from
PIL's decoder error. The lower error is a detail; the way out (give the container more
shared memory, decode in threads; replace the file) is in the error raised from it. Such an
error derives from `AdvisedError`, and cpjax.runtime.failures names it, with the resume
advice, instead of walking on to the ENOSPC beneath it (which would read as a full
checkpoint folder).

This module imports nothing: the host stage's worker processes, which must not load JAX,
import it too.
"""


class AdvisedError(Exception):
  """An error whose message says what failed and what to do; base of such errors (mixed in
  before a built-in base: `class SharedMemoryFullError(AdvisedError, OSError)`)."""
