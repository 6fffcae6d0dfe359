"""Starting jax.distributed for multi-process runs (called by main.py only).

Auto-detected clusters (Cloud TPU pods, SLURM, Open MPI) need no arguments:
`jax.distributed.initialize()` reads their environment. Anything else passes
the coordinator address, process count and process id explicitly, as flags
or through JAX's own variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID). A plain single-machine run starts nothing.

Liveness. A process that dies (SIGKILL, the OOM killer, a lost node) must not leave the
others waiting in a collective forever, holding the allocation. Each process runs a
`LivenessWatch`: a thread that publishes a heartbeat counter in the coordination service's
key-value store every second and reads everyone's. A process whose counter has not moved
for `heartbeat_timeout_s` seconds (main.py's --heartbeat_timeout_s), or a coordination
service that has not answered for as long (process 0, which hosts it, is gone), is declared
lost: the watch prints one FATAL line naming the lost process, the last good checkpoint and
the rerun advice (cpjax.runtime.failures), and ends this process with status 1. A process
that finishes (or stops for a preemption) says so first (`finished`), so the others never
mistake its end for a loss.

JAX's coordination service has its own heartbeat, and on a lost task it aborts every other
process with a 60-line C++ dump and no word on how to resume (its error callback cannot be
replaced from Python: the jaxlib binding cannot pass its status to Python). It stays as a
backstop, for a process whose watch thread cannot run: JAX is given a longer timeout
(`jax_heartbeat_timeout`), so the watch speaks first. The timeout must exceed the longest
pause of a healthy process's heartbeat: JAX's default, 100 s, is safe.
"""

from collections.abc import Callable
import os
import sys
import threading
import time

import jax
from jax._src import distributed as jax_distributed  # The running client (as multihost_utils).

from cpjax.runtime import failures

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                "JAX_COORDINATOR_ADDRESS")


HEARTBEAT_TIMEOUT_S = 100  # JAX's default: a process silent this long is declared dead.


LOST_EXIT_CODE = 1  # A lost peer is a failed job step: the scheduler's rerun resumes it.
_ALIVE, _DONE = "cpjax/alive/", "cpjax/done/"  # Key-value store prefixes (+ process index).
_watch: "LivenessWatch | None" = None


def jax_heartbeat_timeout(heartbeat_timeout_s: int) -> int:
  """The timeout given to JAX's own heartbeat: later than the watch's, so that the watch
  names the lost process before JAX aborts (see the module docstring). A JAX process beats
  every half timeout, so JAX may declare a process lost as early as half its timeout after
  the death (measured: 18 s after a SIGKILL with a 30 s timeout); half of this is 10 s
  more than the watch's timeout."""
  return 2 * heartbeat_timeout_s + 20


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S, workdir: str = "") -> None:
  """Calls jax.distributed.initialize when running as one of several processes, and starts
  the LivenessWatch: a process silent for `heartbeat_timeout_s` seconds ends the others
  with one FATAL line naming it and the last good checkpoint under `workdir`."""
  global _watch
  if heartbeat_timeout_s < 1:
    raise ValueError(f"--heartbeat_timeout_s={heartbeat_timeout_s} must be at least 1 second")
  explicit = (coordinator_address, num_processes, process_id)
  backstop = jax_heartbeat_timeout(heartbeat_timeout_s)
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise ValueError("--coordinator_address, --num_processes and --process_id go "
                       f"together; got {explicit}")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=backstop)
  elif _is_multiprocess_cluster():
    jax.distributed.initialize(heartbeat_timeout_seconds=backstop)
  else:
    return
  client = jax_distributed.global_state.client
  if client is not None and jax.process_count() > 1:
    checkpoint_dir = os.path.join(os.path.abspath(workdir), "checkpoints")
    _watch = LivenessWatch(client, jax.process_index(), jax.process_count(),
                           heartbeat_timeout_s,
                           lambda which, detail: _exit_lost(which, detail, checkpoint_dir))
    _watch.start()


def _exit_lost(which: str, detail: str, checkpoint_dir: str) -> None:
  """Ends this process at once (from the watch thread) with the lost-process FATAL line.
  os._exit: the main thread may be blocked in a collective with the lost process."""
  sys.stderr.write(f"FATAL {failures.lost_process_line(which, detail, checkpoint_dir)}\n")
  sys.stderr.flush()
  os._exit(LOST_EXIT_CODE)


def finished() -> None:
  """Tells the other processes that this one ends on purpose (done, or preempted), and
  stops its watch: they must not take its silence for a loss."""
  if _watch is not None:
    _watch.finish()


def await_lost_process(seconds: float | None = None) -> None:
  """After an error that says a peer is gone: waits (at most `seconds`, default the
  heartbeat timeout and a margin) for the watch to name the lost process and end this one.
  Returns if it does not (one process, or no verdict): the caller then says it itself."""
  if _watch is not None and _watch.is_alive():
    _watch.join(_watch.timeout_s + 5 * _watch.interval_s if seconds is None else seconds)


class LivenessWatch(threading.Thread):
  """Heartbeats through the coordination service's key-value store (a daemon thread).

  Every `interval_s` seconds: publish this process's counter, read every process's counter
  and the list of finished processes. A process whose counter has not changed for
  `timeout_s` seconds, or a store that has not answered for as long, is lost:
  `on_lost(which, detail)` is called once and the watch stops.

  Args:
    client: jax's DistributedRuntimeClient (key_value_set, key_value_dir_get).
    process_id: this process's index.
    num_processes: the job's number of processes.
    timeout_s: the silence after which a process is declared lost.
    on_lost: called with ("process K of N", what showed it).
    interval_s: seconds between heartbeats (default: 1 s, or timeout_s / 4 if shorter).
    clock: monotonic seconds (a test passes its own).
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float,
               on_lost: Callable[[str, str], None], interval_s: float | None = None,
               clock: Callable[[], float] = time.monotonic):
    super().__init__(name="cpjax-liveness-watch", daemon=True)
    self.client, self.process_id, self.num_processes = client, process_id, num_processes
    self.timeout_s = timeout_s
    self.interval_s = interval_s or min(1.0, timeout_s / 4)
    self._on_lost, self._clock = on_lost, clock
    self._stop_event = threading.Event()
    self._beats = 0
    start = clock()
    self._last_answer = start
    self._seen = {k: (None, start) for k in range(num_processes) if k != process_id}

  def run(self) -> None:
    while not self._stop_event.wait(self.interval_s):
      verdict = self.check()
      if verdict is not None and not self._stop_event.is_set():
        self._on_lost(*verdict)
        return

  def check(self) -> tuple[str, str] | None:
    """One heartbeat: (which, detail) of a lost process, or None while all are alive."""
    now = self._clock()
    self._beats += 1
    try:
      self.client.key_value_set(f"{_ALIVE}{self.process_id}", str(self._beats),
                                allow_overwrite=True)
      counters = {_index(key): value for key, value in self.client.key_value_dir_get(_ALIVE)}
      done = {_index(key) for key, _ in self.client.key_value_dir_get(_DONE)}
    except Exception as err:  # pylint: disable=broad-except  (the service is unreachable)
      if now - self._last_answer > self.timeout_s:
        return (f"process 0 of {self.num_processes} (it hosts the coordination service)",
                f"the coordination service has not answered for {now - self._last_answer:.0f}"
                f" s: {failures.describe(err)}")
      return None
    self._last_answer = now
    lost = []
    for k, (value, since) in sorted(self._seen.items()):
      if k in done:
        continue
      if counters.get(k) != value:
        self._seen[k] = (counters.get(k), now)
      elif now - since > self.timeout_s:
        lost.append(k)
    if not lost:
      return None
    return (" and ".join(f"process {k}" for k in lost) + f" of {self.num_processes}",
            f"no heartbeat for {self.timeout_s:g} s")

  def finish(self) -> None:
    """Marks this process finished in the store (best effort) and stops the watch."""
    self._stop_event.set()
    try:
      self.client.key_value_set(f"{_DONE}{self.process_id}", "1", allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except  (the job is ending anyway)
      pass


def _index(key: str) -> int:
  """The process index at the end of a key ("cpjax/alive/3" or "3", as the store lists)."""
  return int(key.rstrip("/").rsplit("/", 1)[-1])


def _is_multiprocess_cluster() -> bool:
  if "SLURM_JOB_ID" in os.environ:
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1
  return any(name in os.environ for name in _CLUSTER_ENV[1:])
