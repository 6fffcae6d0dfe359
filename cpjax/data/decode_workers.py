"""The host stage's worker processes: rows decoded and cropped into shared memory.

A `ProcessPool` is one set of worker processes per process of a run (`shared_pool`, by
worker count), started once and kept, that every host-stage reader of the run shares. It is
the standard library's `concurrent.futures.ProcessPoolExecutor` (spawned processes), with:

  - a reader's source and transform pickled once into a shared-memory segment (`Context`),
    which each worker unpickles on its first task of that reader and keeps: a task carries
    the segment's name, a batch's slot and a few row numbers, never an image;
  - each task writing its rows' uint8 crops straight into a slot of a shared-memory ring
    (`Slots`, one slot per batch in flight), from which the reader copies the batch once;
  - a worker that dies (killed, out of memory) failing the pool at once
    (`ProcessPoolExecutor` watches its workers), reported as one `WorkerDiedError` naming
    the process and its exit signal, the other workers stopped;
  - workers that end with their parent: each watches the parent's sentinel (a pipe that
    closes when the parent dies, however it dies) and exits, so a main process killed with
    SIGKILL leaves no workers; the shared-memory segments are registered with
    multiprocessing's resource tracker, which unlinks them once the parent and the workers
    are gone. SIGINT and SIGTERM sent to the process group leave the workers running, so the
    parent's own handling (a checkpoint on SIGTERM) can still read batches.
  - `close_all`, for an exit that skips the interpreter's clean-up (main.py ends a failed run
    with os._exit after its FATAL line): the workers stopped, every segment this process made
    unlinked and the pools' queues (their semaphores) released, so that the resource tracker
    has nothing "leaked" to report after the FATAL line.

Why processes and not threads: the Python around each image's PIL and OpenCV calls holds
the GIL, so threads stop scaling past a few cores (16 threads measured 1.9x one thread).
Why not grain's `mp_prefetch` (spawned processes too, with `SharedMemoryArray` outputs): it
starts its workers for each iterator, and the host stage iterates once a pass (each epoch,
each evaluation and scoring pass), each start running the main script and `import grain`
again in every worker (1.5 s of CPU for `import grain` alone on a 2-core machine); its
outputs are one shared-memory segment an element, made and unlinked each time; and (by
grain 0.2.18's source) its workers do not watch for a parent killed by SIGKILL. The pool
here outlives the passes.

multiprocessing's spawn runs the parent's main module again in each new process, to find
what the parent defined there; for `python main.py` that is the whole trainer with flax and
TensorFlow (about 0.9 GB and seconds of CPU a worker). The workers run this module only, so
they are started under a stand-in main module that names no file (`bare_main`), as a
parent in an interactive interpreter would be. This module imports no JAX, so a worker holds
NumPy, PIL and OpenCV (about 55 MB) and the source's own module.
"""

import collections
from collections.abc import Iterator, Sequence
import concurrent.futures
from concurrent.futures import process as futures_process
import contextlib
import gc
import multiprocessing
from multiprocessing import connection, shared_memory
import os
import pickle
import signal
import sys
import threading
import time
import types
import weakref

import numpy as np

from cpjax.data import preprocess
from cpjax.runtime import files
from cpjax.runtime.advised import AdvisedError

WORKER_KINDS = ("process", "thread")  # config.dataset.worker_kind's choices.
CONTEXTS_KEPT = 16  # Readers' sources a worker keeps unpickled (least recently used out).
SHM_DIR = "/dev/shm"  # Where POSIX shared memory lives on Linux (its free space is checked).


class WorkerDiedError(AdvisedError, RuntimeError):
  """A worker process of the host stage died; the message names it and how it ended."""


class SharedMemoryFullError(AdvisedError, OSError):
  """The shared memory the worker processes need does not fit in /dev/shm (the message says
  how much, and the ways out)."""


def usable_cores() -> int:
  """The cores this process may run on (its CPU affinity), else the machine's count."""
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except AttributeError:  # Not Linux.
    return os.cpu_count() or 1


def describe(source, row: int) -> str:
  """`row` of `source` for messages: its file or record where the source names it."""
  where = getattr(source, "where", None)
  return where(row) if where else f"row {row}"


def transformed(source, transform: preprocess.Transform, row: int,
                epoch: int | None) -> np.ndarray:
  """uint8 [S, S, C]: `row` of `source` read and transformed (the host stage's unit of work,
  the same in a thread or a worker process). A file that cannot be read or decoded raises
  BadImageError with the source's way out (`on_damage`) and, where the source names it,
  the example (`entry`: (split, id), which cpjax.data.fingerprint notes)."""
  try:
    (data,) = source.read(np.asarray([row]))
    return transform(data, int(source.ids[row]), epoch, where=describe(source, row))
  except preprocess.BadImageError as err:
    raise damaged(err, source, row) from err


def damaged(err: preprocess.BadImageError, source, row: int) -> preprocess.BadImageError:
  """`err` (a file of `source`'s `row` that cannot be read or decoded) with the source's way
  out (`on_damage`) and, where the source names it, the example (`entry`: (split, id))."""
  advice = getattr(source, "on_damage", "")
  out = preprocess.BadImageError(f"{err}; {advice}" if advice else str(err))
  out.entry = source.entry(row) if hasattr(source, "entry") else None
  return out


# ---------------------------------------------------------------- shared memory


# The segments this process made and has not unlinked yet (by name): what `close_all` unlinks.
_SEGMENTS: dict[str, shared_memory.SharedMemory] = {}


def _created(num_bytes: int, what: str) -> shared_memory.SharedMemory:
  """A new shared-memory segment of `num_bytes`, its pages reserved now (tmpfs allocates
  them on first write, and a write past /dev/shm's size kills the writer with SIGBUS);
  SharedMemoryFullError naming the need and the ways out where they do not fit (a
  container's default /dev/shm is 64 MB)."""
  shm = shared_memory.SharedMemory(create=True, size=max(1, num_bytes))
  _SEGMENTS[shm.name] = shm
  path = os.path.join(SHM_DIR, shm.name.lstrip("/"))
  if not os.path.exists(path):  # Not Linux's tmpfs: nothing to reserve.
    return shm
  fd = os.open(path, os.O_RDWR)
  try:
    os.posix_fallocate(fd, 0, max(1, num_bytes))
  except OSError as err:
    _unlinked(shm)
    stats = os.statvfs(SHM_DIR)
    raise SharedMemoryFullError(
        f"the host stage's worker processes need {files.size_text(num_bytes)} more shared "
        f"memory for {what}, and {SHM_DIR} has "
        f"{files.size_text(stats.f_bavail * stats.f_frsize)} free ({err.strerror}): give the "
        "container more (docker run --shm-size=8g, or "
        "--ipc=host), lower dataset.batch_size, or decode in threads "
        "(--config.dataset.worker_kind=thread)") from err
  finally:
    os.close(fd)
  return shm


def _unlinked(shm: shared_memory.SharedMemory) -> None:
  _SEGMENTS.pop(shm.name, None)
  shm.close()
  with contextlib.suppress(FileNotFoundError):
    shm.unlink()


class Context:
  """A reader's (source, transform), pickled once into shared memory for the workers; the
  segment is unlinked when the Context is closed or collected."""

  def __init__(self, source, transform: preprocess.Transform):
    # The transform's crop entry travels too (its function pickled by reference, so
    # unpickling imports the module that defines it): a worker process registers it where
    # its own TRAIN_CROPS lacks it (a crop that a user's module or a test registered).
    crop = preprocess.TRAIN_CROPS[transform.train_crop]
    try:
      data = pickle.dumps((source, transform, crop), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:  # pylint: disable=broad-except  pickle raises several kinds.
      raise TypeError(
          f"the data source {type(source).__name__} cannot be pickled for the host stage's "
          f"worker processes ({type(err).__name__}: {err}): leave open handles and locks out "
          "of its pickle (__getstate__) and open them on first read, or decode in threads "
          "(--config.dataset.worker_kind=thread); the training crop "
          f"{transform.train_crop!r} must be a module-level function") from err
    shm = _created(len(data), "a reader's source")
    shm.buf[:len(data)] = data
    self.key = (shm.name, len(data))  # What a task carries.
    self._release = weakref.finalize(self, _unlinked, shm)

  def close(self) -> None:
    self._release()


class Slots:
  """A ring of `count` shared-memory slots, each one batch's uint8 images of `shape`
  [L, S, S, C]; batch s of a pass goes to slot s % count. A context manager: the slots are
  unlinked on leaving it."""

  def __init__(self, count: int, shape: tuple[int, ...]):
    self.shape = tuple(int(v) for v in shape)
    size = int(np.prod(self.shape))
    self._shms = []
    try:
      for _ in range(count):
        self._shms.append(_created(size, f"{count} batch{'es' * (count != 1)} of "
                                         f"{self.shape[0]} image{'s' * (self.shape[0] != 1)}"))
    except BaseException:
      self.close()
      raise

  def name(self, s: int) -> str:
    return self._shms[s % len(self._shms)].name

  def copy(self, s: int) -> np.ndarray:
    """A private copy of batch s's images (the slot is then free for batch s + count)."""
    view = np.ndarray(self.shape, np.uint8, buffer=self._shms[s % len(self._shms)].buf)
    out = view.copy()
    del view  # Released before the segment can be closed.
    return out

  def close(self) -> None:
    for shm in self._shms:
      _unlinked(shm)
    self._shms = []

  def __enter__(self) -> "Slots":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ---------------------------------------------------------------- the worker side

_contexts: collections.OrderedDict = collections.OrderedDict()


def _init_worker() -> None:
  """Runs first in each worker: ignore the group's SIGINT and SIGTERM (the parent handles
  them and the pool stops its workers), and exit when the parent does."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  parent = multiprocessing.parent_process()
  if parent is not None:
    threading.Thread(target=_exit_with_parent, args=(parent.sentinel,), daemon=True,
                     name="cpjax-parent-watch").start()


def _exit_with_parent(sentinel: int) -> None:
  connection.wait([sentinel])  # Readable once the parent has exited, however it ended.
  os._exit(0)  # pylint: disable=protected-access  No cleanup: the parent is gone.


def _ready() -> int:
  return os.getpid()


def _context(key: tuple[str, int]):
  """The (source, transform) of a reader's Context, unpickled on first use and kept."""
  if key in _contexts:
    _contexts.move_to_end(key)
    return _contexts[key]
  name, size = key
  shm = shared_memory.SharedMemory(name)
  try:
    source, transform, crop = pickle.loads(shm.buf[:size])
  except Exception as err:  # pylint: disable=broad-except  A class the worker cannot import.
    raise TypeError(
        f"a host-stage worker process cannot unpickle the reader's data source "
        f"({type(err).__name__}: {err}): define its class in an importable module (the "
        "workers do not run the main script), or decode in threads "
        "(--config.dataset.worker_kind=thread)") from err
  finally:
    shm.close()
  if crop.name not in preprocess.TRAIN_CROPS:
    preprocess.TRAIN_CROPS.register(crop)
  value = _contexts[key] = (source, transform)
  while len(_contexts) > CONTEXTS_KEPT:
    _contexts.popitem(last=False)
  return value


def decode_into(context: tuple[str, int], slot: str, shape: tuple[int, ...], offset: int,
                rows: np.ndarray, epoch: int | None) -> None:
  """Writes `rows` of the context's source, transformed, into images [offset:offset +
  len(rows)] of the slot named `slot` (uint8 `shape`)."""
  source, transform = _context(context)
  shm = shared_memory.SharedMemory(slot)
  out = np.ndarray(shape, np.uint8, buffer=shm.buf)
  try:
    for i, row in enumerate(rows):
      out[offset + i] = transformed(source, transform, int(row), epoch)
  finally:
    del out  # Released before closing (a traceback would otherwise keep it exported).
    shm.close()


# ---------------------------------------------------------------- the parent side

_START_LOCK = threading.Lock()  # One pool's workers start at a time (under bare_main).


@contextlib.contextmanager
def bare_main() -> Iterator[None]:
  """The parent's main module replaced by a stand-in that names no file while workers are
  started, so that spawn does not run the main script again in each of them."""
  real = sys.modules["__main__"]
  sys.modules["__main__"] = types.ModuleType("__main__")
  try:
    yield
  finally:
    sys.modules["__main__"] = real


def _ended(exitcode: int | None) -> str:
  if exitcode is None:
    return "ended"
  if exitcode < 0:
    name = signal.Signals(-exitcode).name
    hint = {"SIGKILL": ": killed, e.g. by the kernel's out-of-memory killer",
            "SIGBUS": ": e.g. /dev/shm full"}.get(name, "")
    return f"was killed by {name}{hint}"
  return f"exited with status {exitcode}"


class ProcessPool:
  """`num_workers` spawned processes that run `decode_into` tasks (see the module docstring)."""

  def __init__(self, num_workers: int):
    self.num_workers = num_workers
    self.broken = False
    self._executor = concurrent.futures.ProcessPoolExecutor(
        num_workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker)
    # All workers are started here, under the stand-in main: the executor starts one per
    # submitted task while none is idle, and never more than num_workers.
    with _START_LOCK, bare_main():
      started = [self._executor.submit(_ready) for _ in range(num_workers)]
    # The worker processes, to name the dead and stop the rest when one dies.
    self._processes = dict(self._executor._processes)  # pylint: disable=protected-access
    self.pids = sorted(self._processes)
    for future in started:
      self._result(future)

  def submit(self, *args) -> concurrent.futures.Future:
    """A `decode_into(*args)` task."""
    try:
      return self._executor.submit(decode_into, *args)
    except futures_process.BrokenProcessPool as err:
      raise self._died() from err

  def decode(self, context: Context, slots: Slots, s: int, rows: np.ndarray,
             epoch: int | None) -> list[concurrent.futures.Future]:
    """Tasks writing `rows` (one batch's, this process's) into batch s's slot: one chunk of
    consecutive rows a worker."""
    chunks = np.array_split(np.asarray(rows), min(self.num_workers, max(1, len(rows))))
    offsets = np.cumsum([0] + [len(c) for c in chunks[:-1]])
    return [self.submit(context.key, slots.name(s), slots.shape, int(offset), chunk, epoch)
            for offset, chunk in zip(offsets, chunks) if len(chunk)]

  def wait(self, futures: Sequence[concurrent.futures.Future]) -> None:
    """Waits for `futures`; raises the first one's error (a bad file: its BadImageError)."""
    for future in futures:
      self._result(future)

  def _result(self, future: concurrent.futures.Future):
    try:
      return future.result()
    except futures_process.BrokenProcessPool as err:
      raise self._died() from err

  def _died(self) -> WorkerDiedError:
    """The error of a broken pool: the dead workers named, the others stopped."""
    self.broken = True
    deadline = time.monotonic() + 2.0  # The executor's thread may be reaping it this moment.
    while True:
      dead = [f"pid {pid} {_ended(process.exitcode)}" for pid, process in self._processes.items()
              if process.exitcode not in (None, 0)]  # Polled (reaped if dead), not waited on.
      if dead or time.monotonic() > deadline:
        break
      time.sleep(0.02)
    for process in self._processes.values():
      if process.is_alive():
        process.kill()  # They ignore SIGTERM; the executor waits on them.
        process.join(timeout=5.0)
    return WorkerDiedError(
        f"a host-stage worker process died ({'; '.join(dead) or 'no exit status'}) with the "
        "batches it was decoding (if it ran out of memory: lower dataset.num_workers or "
        "dataset.batch_size)")

  def shutdown(self) -> None:
    self._executor.shutdown(wait=True, cancel_futures=True)

  def close(self) -> None:
    """Stops the workers at once (killed: they may be mid-task) and releases the executor's
    queues; the pool is unusable after."""
    self.broken = True
    for process in self._processes.values():
      if process.is_alive():
        process.kill()
    for process in self._processes.values():
      process.join(timeout=5.0)
    self.shutdown()


_POOLS: dict[int, ProcessPool] = {}  # This process's pools, by worker count.
_POOLS_LOCK = threading.Lock()


def shared_pool(num_workers: int) -> ProcessPool:
  """This process's pool of `num_workers` workers (started on first use; a broken one is
  closed and replaced)."""
  with _POOLS_LOCK:
    pool = _POOLS.get(num_workers)
    if pool is None or pool.broken:
      if pool is not None:
        pool.close()
      pool = _POOLS[num_workers] = ProcessPool(num_workers)
    return pool


def close_all() -> None:
  """Stops every pool's workers, unlinks every shared-memory segment this process made and
  has not unlinked (a reader's context; the slots of a pass still in flight) and releases
  the pools' queues: for an exit that skips the interpreter's clean-up (os._exit), after
  which multiprocessing's resource tracker would otherwise report them "leaked". A segment
  is unlinked, not closed: a thread may still hold a view of it. Pools start afresh on
  their next use."""
  with _POOLS_LOCK:
    pools = list(_POOLS.values())
    _POOLS.clear()
  for pool in pools:
    with contextlib.suppress(Exception):  # pylint: disable=broad-except  Best effort.
      pool.close()
  for shm in list(_SEGMENTS.values()):
    _SEGMENTS.pop(shm.name, None)
    with contextlib.suppress(OSError):
      shm.unlink()  # Also unregisters it from the resource tracker.
  del pools
  gc.collect()  # A queue's semaphores are unregistered when it is collected.
