"""Preemption: turn SIGTERM (and Ctrl-C) into "stop after this step, save, exit to be requeued".

SLURM, Kubernetes and TPU maintenance send SIGTERM some seconds before they kill
a job. Instead of dying mid-step, a run finishes the step it is in, saves a
checkpoint at that step, waits for it to commit and exits with EXIT_CODE
(EX_TEMPFAIL, "try again"), which a batch script can turn into a requeue.

Single process: a Python signal handler sets a flag that the loop reads after
every step. Several processes (after `jax.distributed.initialize`): JAX's
preemption service already listens for SIGTERM on every process and agrees on
one safe step across processes (`multihost_utils.reached_preemption_sync_point`),
so every process stops at the same step; no Python SIGTERM handler is installed
there (it would replace the service's). Ctrl-C (SIGINT) is handled only in
single-process runs: one process alone cannot stop a multi-process run in step.

A second signal while the run stops (finishing its step, saving or committing the checkpoint)
changes nothing: it is noted in one line, and the run still saves and exits with EXIT_CODE
(`kill -9` ends it at once, losing the steps since its last committed checkpoint). Once
Preempted is raised, a further signal is not even noted: the stop's own line, which the loop
logs once all its work is done (cpjax.training.train), stays the last.

After the last checkpoint has committed there is no step to finish: during the final report
(`PreemptionGuard.stopping_at_once`) a signal raises Preempted where the run is, so the
process exits within moments, well inside a scheduler's grace period; the rerun writes the
report from that checkpoint. (Single process only: several processes finish the report, and
each logs so as it begins, since JAX's preemption service holds their SIGTERM and they can
stop together only at a training step.)

The training loop meets the guard only through its checkpointer
(`checkpointing.Checkpointer.handling_preemption`, `reached_preemption`, `stop_preempted`,
`stopping_at_once`), which owns one: saving and stopping for a preemption are asked of one
object.
"""

import contextlib
import logging
import os
import signal
import types
from typing import NoReturn

import jax
from jax.experimental import multihost_utils

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a transient failure, requeue and rerun.


class Preempted(Exception):
  """The run stopped on a preemption signal after saving a checkpoint; rerun to resume."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class PreemptionGuard:
  """A context in which SIGTERM/SIGINT only request a stop; `should_stop(step)` reads it."""

  def __init__(self):
    self._signal: int | None = None
    self._previous: dict[int, object] = {}
    # While set: (message, checkpoint step) that Preempted is raised with at once.
    self._at_once: tuple[str, int] | None = None
    self._stopped = False  # The stop's line is logged: nothing may follow it.

  def __enter__(self) -> "PreemptionGuard":
    if jax.process_count() == 1:
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self._request_stop)
    return self

  def __exit__(self, *exc_info) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous = {}

  def _request_stop(self, signum: int, frame: types.FrameType | None) -> None:
    del frame
    if self._signal is not None:  # The run is stopping already: a second signal waits too.
      if not self._stopped:
        logging.warning("Received %s again: the run is already stopping; it exits with status "
                        "%d once its checkpoint is saved (kill -9 %d ends it now, losing the "
                        "steps since its last saved checkpoint).", signal.Signals(signum).name,
                        EXIT_CODE, os.getpid())
      return
    self._signal = signum
    if self._at_once is not None:
      self.stop(*self._at_once)
    logging.warning("Received %s: stopping after the current step to save a checkpoint.",
                    signal.Signals(signum).name)

  def stop(self, message: str, step: int) -> NoReturn:
    """The run's one stop: raises Preempted with `message` after the signal's name (`step`:
    the checkpoint a rerun resumes from)."""
    self._at_once, self._stopped = None, True  # Raised once; no note after it.
    raise Preempted(f"{self.signal_name}: {message}", step)

  @contextlib.contextmanager
  def stopping_at_once(self, message: str, step: int):
    """A context in which SIGTERM/SIGINT (also one received before it) raise Preempted with
    `message` at once, wherever the run is: for work after the checkpoint at global `step`
    has committed (the report), which a rerun redoes from that checkpoint."""
    if jax.process_count() > 1:  # The processes sit a signal out together: say so first.
      logging.info("%d processes: a SIGTERM from here on does not stop the run (one process "
                   "cannot stop the others but at a training step): they finish the final "
                   "report and exit with status 0; the last checkpoint, global step %d, is "
                   "saved.", jax.process_count(), step)
      yield
      return
    self._at_once = (message, step)
    try:
      if self._signal is not None:
        self.stop(message, step)
      yield
    finally:
      self._at_once = None

  def should_stop(self, step: int) -> bool:
    """Whether the run must stop after global `step` (all processes agree on it)."""
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._signal is not None

  @property
  def signal_name(self) -> str:
    return signal.Signals(self._signal).name if self._signal is not None else "SIGTERM"
