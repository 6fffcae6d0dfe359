"""A run's anatomy: where its wall clock went, in parts that add up to it.

Selection saves training steps; whether it saves time depends on what else a run spends.
`RunClock` splits a process's wall clock (from the interpreter's start) into:

  startup        the interpreter, imports, the backend, the config and start-up checks
  data_open      opening and reading the datasets (input_pipeline.load)
  compile        tracing, lowering and compiling (or loading from the persistent cache) in
                 the main thread, and the main thread's waits for programs compiled ahead in
                 other threads: what compiling cost the wall clock
  steady_step    training at the run's steady pace: each epoch's steps at the median
                 seconds per step of its epochs after the first (the first alone if it is
                 the only one), compiling and input waits excluded
  warmup_step    training slower than that pace, beyond compiling (first steps, caches)
  input_wait     the loop blocked on its next batch
  eval, scoring, selection, checkpoint, report   each net of the compiling inside it
  other          the rest (logging, TensorBoard, the loop's own work), so that the parts add
                 up to the wall clock

The clock is the loop's one timer: every `*_seconds` key of an epoch's record and the
progress report read it (`RunClock.part` and `RunClock.training` time a block as a
`Stopwatch`; `ProgressReport` reads its uptime and parts).

`CompileWatch` counts XLA compilations through `jax.monitoring` (each program compiled or
loaded from the persistent cache is one) and, once the first epoch is done, logs each later
one as a warning naming the function and its argument shapes: a compilation after epoch 0 is
a slower step that a selected epoch's size, a partial batch or a new dtype caused, never
silent. A resumed process measures its own wall clock: its parts are its own.
"""

from collections.abc import Iterable, Iterator
import contextlib
import logging
import os
import threading
import time
from typing import Any

import jax
from jax import monitoring

PARTS = ("startup", "data_open", "compile", "steady_step", "warmup_step", "input_wait", "eval",
         "scoring", "selection", "checkpoint", "report", "other")
# The parts that a run's epochs also record for themselves (eval_seconds, ...): the run's
# totals are perf/run_<part>_seconds, so that TensorBoard's perf/<part>_seconds stays the
# epoch's.
_PER_EPOCH = ("input_wait", "eval", "scoring", "selection", "checkpoint", "report")


def key(part: str) -> str:
  """The record's key of a part's seconds: perf/<part>_seconds (perf/run_<part>_seconds for
  the parts each epoch also records)."""
  return f"perf/run_{part}_seconds" if part in _PER_EPOCH else f"perf/{part}_seconds"
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_PROGRAM_EVENT = _COMPILE_EVENTS[-1]  # One per program compiled or loaded from the cache.
# JAX's loggers of a compilation's start (with shapes) and of its phases' ends.
_START_LOGGER, _PHASE_LOGGER = "jax._src.interpreters.pxla", "jax._src.dispatch"


def process_start_time() -> float:
  """The wall-clock time (time.time()) this process started, from /proc where there is one;
  else the time this module was imported (after the interpreter and the first imports)."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # Field 22: starttime.
    with open("/proc/stat") as f:
      boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError, StopIteration):
    return _IMPORTED


_IMPORTED = time.time()


class CompileWatch:
  """Counts compilations and their seconds (the backend's in all threads; the main thread's
  wall time inside any compile phase, nested traces counted once), and warns of each one
  after `first_epoch_done()` with the function and its shapes."""

  def __init__(self):
    self.compilations = 0
    self.after_first_epoch = 0
    self.seconds = 0.0  # The backend's compiling (or cache loading), in every thread.
    self.late: list[str] = []  # "function (shapes)" of each compilation after epoch 0.
    self._spans: list[tuple[float, float]] = []  # The main thread's compile phases.
    self._main = threading.main_thread().ident
    self._lock = threading.Lock()
    self._watching_late = False
    self._log_compiles_before = None
    monitoring.register_event_duration_secs_listener(self._on_event)
    monitoring.register_event_time_span_listener(self._on_span)
    self._filter = _LateCompileFilter(self)

  def _on_span(self, event: str, start: float, end: float, **kwargs: Any) -> None:
    if event in _COMPILE_EVENTS and threading.get_ident() == self._main:
      with self._lock:
        self._spans.append((start, end))

  def main_seconds(self, start: float = 0.0, end: float = float("inf")) -> float:
    """The main thread's wall seconds inside compile phases between `start` and `end`
    (time.time()): the union of its phases' spans (a trace nests the traces of the jitted
    functions it calls)."""
    with self._lock:
      spans = sorted((max(a, start), min(b, end)) for a, b in self._spans)
    total, reach = 0.0, start
    for a, b in spans:
      a = max(a, reach)
      if b > a:
        total, reach = total + b - a, b
    return total

  def _on_event(self, event: str, seconds: float, **kwargs: Any) -> None:
    if event != _PROGRAM_EVENT:
      return
    with self._lock:
      self.seconds += seconds
      self.compilations += 1
      if self._watching_late:
        self.after_first_epoch += 1
        if not self._filter.named_last:  # JAX did not log its shapes: its name at least.
          self.late.append(str(kwargs.get("fun_name", "?")))
        self._filter.named_last = False

  def first_epoch_done(self) -> None:
    """From now on each compilation is counted as late and logged with its shapes (JAX's
    `jax_log_compiles` gives them; its phase lines are dropped)."""
    if self._watching_late:
      return
    self._watching_late = True
    self._log_compiles_before = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    for name in (_START_LOGGER, _PHASE_LOGGER):
      logging.getLogger(name).addFilter(self._filter)

  def stop_watching_late(self) -> None:
    """Compilations from here on (the report's own programs) are not the loop's."""
    if not self._watching_late:
      return
    self._watching_late = False
    jax.config.update("jax_log_compiles", self._log_compiles_before)
    for name in (_START_LOGGER, _PHASE_LOGGER):
      logging.getLogger(name).removeFilter(self._filter)

  def close(self) -> None:
    self.stop_watching_late()
    monitoring.unregister_event_duration_listener(self._on_event)
    monitoring.unregister_event_time_span_listener(self._on_span)


class _LateCompileFilter(logging.Filter):
  """Turns JAX's "Compiling f with global shapes and types ..." into cpjax's warning and drops
  its "Finished ..." phase lines (the user did not ask for `jax_log_compiles`)."""

  def __init__(self, watch: CompileWatch):
    super().__init__()
    self.watch = watch
    self.named_last = False

  def filter(self, record: logging.LogRecord) -> bool:
    if self.watch._log_compiles_before:  # The user asked for JAX's own lines: keep them.
      return True
    message = record.getMessage()
    if record.name == _START_LOGGER and message.startswith("Compiling "):
      what = message[len("Compiling "):].split(". Argument mapping")[0]
      what = what.replace(" with global shapes and types ", " ")
      self.watch.late.append(what)
      self.named_last = True
      record.msg, record.args = ("Compiling after the first epoch (its step runs slower; "
                                 "a new shape or dtype reached a jitted function): %s"), (what,)
      return True
    return not message.startswith("Finished ")


class Stopwatch:
  """The wall seconds of a block: `seconds` so far, or the block's own once `stop`ped."""

  def __init__(self):
    self.start, self.end = time.time(), None

  def stop(self) -> None:
    self.end = time.time()

  @property
  def seconds(self) -> float:
    return (time.time() if self.end is None else self.end) - self.start


class Training(Stopwatch):
  """An epoch's training block, and in `input_wait` the seconds the step loop blocked on its
  next batch (`timed`). With asynchronous dispatch the loop runs ahead of the device until
  the device's queue is full, so a loop fed faster than the device trains waits little
  there and a loop starved by its reader waits about as long as the device idles. The first
  batch's wait (a reader starting up) is counted too."""

  def __init__(self):
    super().__init__()
    self.input_wait = 0.0

  def timed(self, batches: Iterable[Any]) -> Iterator[Any]:
    """`batches`, the time each `next` blocked added to `input_wait`."""
    batches = iter(batches)
    while True:
      start = time.time()
      try:
        batch = next(batches)
      except StopIteration:
        return
      finally:
        self.input_wait += time.time() - start
      yield batch


class RunClock:
  """Seconds of each part of one process's run (see the module docstring). Without a
  `watch` (a selector or a test of its own) no compiling is taken out of the parts."""

  def __init__(self, watch: CompileWatch | None = None, start: float | None = None):
    self.watch = watch
    self.start = process_start_time() if start is None else start
    self.seconds = dict.fromkeys(PARTS, 0.0)
    self._epochs: list[tuple[int, float]] = []  # (steps, net training seconds) per epoch.
    self._training: Training | None = None  # The epoch's steps running now, if any.

  def _compiling(self, start: float, end: float) -> float:
    return self.watch.main_seconds(start, end) if self.watch else 0.0

  def mark_startup_done(self) -> None:
    now = time.time()
    self.seconds["startup"] = now - self.start - self._compiling(self.start, now)

  @contextlib.contextmanager
  def part(self, name: str, record: dict[str, Any] | None = None) -> Iterator[Stopwatch]:
    """Adds the block's seconds, net of the main thread's compiling in it, to part `name`; its
    whole wall seconds are the stopwatch's once it ends, and `record`'s "<name>_seconds"."""
    block = Stopwatch()
    try:
      yield block
    finally:
      block.stop()
      net = block.seconds - self._compiling(block.start, block.end)
      self.seconds[name] += max(net, 0.0)
      if record is not None:
        record[f"{name}_seconds"] = block.seconds

  def add(self, name: str, seconds: float) -> None:
    self.seconds[name] += seconds

  @contextlib.contextmanager
  def training(self, steps: int, record: dict[str, Any] | None = None) -> Iterator[Training]:
    """Times an epoch's `steps` training steps: the batches the loop takes through
    `Training.timed` count their waits as input wait, which is taken out of the steps'. Its
    wall and input-wait seconds also go to `record` ("training_seconds", "input_wait_seconds")."""
    block = self._training = Training()
    try:
      yield block
    finally:
      block.stop()
      self._training = None
      if record is not None:
        record.update(training_seconds=block.seconds, input_wait_seconds=block.input_wait)
      net = block.seconds - self._compiling(block.start, block.end) - block.input_wait
      self.seconds["input_wait"] += block.input_wait
      if steps:
        self._epochs.append((steps, max(net, 0.0)))

  def parts(self, now: float | None = None) -> dict[str, float]:
    """{part: seconds} until `now` (default: now), adding up to the seconds since the process
    started."""
    now = time.time() if now is None else now
    seconds = {**self.seconds, **_split_training(self._epochs)}
    if (block := self._training) is not None:  # Steps running now: training so far.
      seconds["input_wait"] += block.input_wait
      seconds["steady_step"] += max(block.seconds - self._compiling(block.start, now)
                                    - block.input_wait, 0.0)
    seconds["compile"] = self._compiling(self.start, now) + self.seconds["compile"]
    seconds["other"] = max(now - self.start - sum(v for k, v in seconds.items() if k != "other"),
                           0.0)
    return seconds

  def anatomy(self) -> dict[str, float]:
    """{key(part): seconds} with the compilations' counts and the wall clock; the parts add
    up to "perf/wall_seconds"."""
    now = time.time()
    seconds = self.parts(now)
    return {**{key(name): float(seconds[name]) for name in PARTS},
            "perf/wall_seconds": float(now - self.start),
            "perf/compile_work_seconds": float(self.watch.seconds),
            "perf/compilations": self.watch.compilations,
            "perf/compilations_after_first_epoch": self.watch.after_first_epoch}


def _split_training(epochs: list[tuple[int, float]]) -> dict[str, float]:
  """{"steady_step", "warmup_step"} seconds of epochs' (steps, net seconds): the steady pace
  is the median seconds per step of the epochs after the first (the first's if alone); each
  epoch's seconds above its steps at that pace are warm-up."""
  if not epochs:
    return {"steady_step": 0.0, "warmup_step": 0.0}
  paces = sorted(s / n for n, s in (epochs[1:] or epochs))
  middle = len(paces) // 2
  pace = paces[middle] if len(paces) % 2 else (paces[middle - 1] + paces[middle]) / 2
  warmup = sum(max(s - n * pace, 0.0) for n, s in epochs)
  return {"steady_step": sum(s for _, s in epochs) - warmup, "warmup_step": warmup}


def summary_line(anatomy: dict[str, float]) -> str:
  """One console line: the wall clock and its parts, largest first, with the compilations."""
  parts = sorted(((name, anatomy[key(name)]) for name in PARTS),
                 key=lambda item: -item[1])
  text = " + ".join(f"{name.replace('_', ' ')} {value:.1f}" for name, value in parts
                    if value >= 0.05)
  return (f"Run anatomy: {anatomy['perf/wall_seconds']:.1f} s = {text} s; "
          f"{anatomy['perf/compilations']} programs compiled or loaded, "
          f"{anatomy['perf/compilations_after_first_epoch']} after the first epoch.")
