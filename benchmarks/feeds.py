"""Shared pieces of the host-stage benchmarks: a generated JPEG folder, the host stage's
reader in thread or process workers, one timed training epoch, and CPU time with children.

Nothing here imports TensorFlow, tensorflow_datasets or clu (benchmarks.gpu_table runs on
machines without them).
"""

from collections.abc import Callable, Iterable
import concurrent.futures
import inspect
import multiprocessing
import os
import resource
import statistics
import time

import jax
from jax._src import xla_bridge  # backends_are_initialized: may write_folder fork?
import numpy as np
from PIL import Image

from cpjax.data import folder_source, host_stage, preprocess

try:  # Live worker processes' CPU time; without it only reaped children count.
  import psutil
except ImportError:  # pragma: no cover  (psutil is on the machines the benchmarks run on)
  psutil = None

WORKER_KINDS = ("thread", "process")


def _write_one(path: str, seed: int, width: int, height: int) -> None:
  """One generated JPEG: a random 8 x 8 colour field resized bicubically (smooth, so it
  compresses like a photograph) plus uniform noise in [-12, 12], quality 90."""
  rng = np.random.default_rng(seed)
  low = rng.integers(0, 256, (8, 8, 3), np.uint8)
  image = Image.fromarray(low).resize((width, height), Image.BICUBIC)
  noisy = np.asarray(image, np.int16) + rng.integers(-12, 13, (height, width, 3))
  Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(path, quality=90)


def write_folder(root: str, count: int, width: int = 500, height: int = 375,
                 classes: int = 10, workers: int | None = None) -> None:
  """`count` generated JPEGs (not photographs) in `classes` class folders of root/train,
  plus one a class in root/val and root/test (so that a run over the folder trains on every
  train image; never read by the benchmarks). Image i is a function of i alone; written by
  `workers` workers (all cores by default: `_pool`)."""
  jobs = []
  for i in range(-2 * classes, count):
    split = "train" if i >= 0 else ("test" if i >= -classes else "val")
    folder = os.path.join(root, split, f"class{i % classes}")
    os.makedirs(folder, exist_ok=True)
    jobs.append((os.path.join(folder, f"{i + 2 * classes:06d}.JPEG"), i + 2 * classes))
  with _pool(workers or os.cpu_count() or 1) as pool:
    list(pool.map(_write_one, *zip(*jobs), [width] * len(jobs), [height] * len(jobs),
                  chunksize=16))


def _pool(workers: int) -> concurrent.futures.Executor:
  """Forked worker processes while JAX has not started its backend (forking a process that
  runs JAX's threads can deadlock the child), else threads (PIL's resize and encoder and
  NumPy's generators release the GIL, but not all of an image's work)."""
  if started_backend() or "fork" not in multiprocessing.get_all_start_methods():
    return concurrent.futures.ThreadPoolExecutor(workers)
  return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(
      "fork"))


def started_backend() -> bool:
  """Whether JAX has started a backend (its runtime threads) in this process; True when this
  JAX version does not say (then nothing forks)."""
  said = getattr(xla_bridge, "backends_are_initialized", None)
  if said is not None:
    return bool(said())
  return bool(getattr(xla_bridge, "_backends", True))


def folder_train_source(root: str) -> folder_source.FolderSource:
  """The train split of a folder written by `write_folder`, as the trainer opens it."""
  return folder_source.FolderSource(folder_source.listing(root, "train", 0, False))


def train_transform(size: int, seed: int = 0) -> preprocess.Transform:
  """The host stage's ImageNet training transform: random-resized crop to size x size
  (area 8-100 %, aspect 3/4-4/3), flip with p = 1/2, RGB, the default resize engine."""
  return preprocess.Transform(size=size, channels=3, flip=True, seed=seed)


def reader_options(worker_kind: str) -> dict[str, str] | None:
  """The `PreprocessReader` keyword arguments that select `worker_kind` workers in this
  cpjax, or None when it has no such workers (a cpjax whose reader takes no `worker_kind`
  runs threads only)."""
  if worker_kind not in WORKER_KINDS:
    raise ValueError(f"worker kind {worker_kind!r} is not one of {WORKER_KINDS}")
  if "worker_kind" in inspect.signature(host_stage.PreprocessReader).parameters:
    return {"worker_kind": worker_kind}
  return {} if worker_kind == "thread" else None


def preprocess_reader(source, transform: preprocess.Transform, mesh: jax.sharding.Mesh,
                      workers: int, worker_kind: str, prefetch_depth: int = 2,
                      read_ahead: int = 2) -> host_stage.PreprocessReader | None:
  """The host stage's reader with `workers` workers of `worker_kind`; None (and a printed
  note) when this cpjax has no workers of that kind."""
  options = reader_options(worker_kind)
  if options is None:
    print(f"note: cpjax.data.host_stage.PreprocessReader takes no worker_kind here: "
          f"{worker_kind} workers skipped")
    return None
  return host_stage.PreprocessReader(source, transform, mesh, num_workers=workers,
                                     prefetch_depth=prefetch_depth, read_ahead=read_ahead,
                                     **options)


def close_reader(reader) -> None:
  """Stops a reader's workers where it has a `close` (process workers); else nothing."""
  close = getattr(reader, "close", None)
  if close is not None:
    close()


def cpu_seconds() -> float:
  """User + system CPU seconds of this process, its reaped children and its live
  descendants (worker processes): differences of two readings give a pipeline's CPU time,
  whether its workers are threads or processes."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
  total = own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
  if psutil is not None:
    for child in psutil.Process().children(recursive=True):
      try:
        times = child.cpu_times()
        total += times.user + times.system
      except psutil.Error:  # Exited between the listing and the reading.
        pass
  return total


def timed_epoch(train_fn, state, batches) -> tuple[dict[str, float], object]:
  """({seconds, blocked_seconds, first_batch_seconds}, state) of one pass of
  `train_fn(state, batch, lr, {})` over `batches`, ending when the last step is done:
  the epoch's wall time, the part of it spent waiting for the next batch, and of that the
  wait for the first (a reader's start-up)."""
  lr, waited, first = np.float32(0.01), 0.0, None
  start = time.perf_counter()
  iterator = iter(batches)
  while True:
    before = time.perf_counter()
    batch = next(iterator, None)
    waited += time.perf_counter() - before
    first = waited if first is None else first
    if batch is None:
      break
    state, _, _ = train_fn(state, batch, lr, {})
  jax.block_until_ready(state.step)
  return {"seconds": time.perf_counter() - start, "blocked_seconds": waited,
          "first_batch_seconds": first}, state


def input_alone(batches) -> float:
  """Seconds to make every batch of `batches` and put it on the devices, no step."""
  start = time.perf_counter()
  for batch in batches:
    jax.block_until_ready(batch)
  return time.perf_counter() - start


def wait_shares(train_fn, state, epoch_feeds: dict[str, Callable[[], Iterable]],
                repeats: int) -> tuple[dict[str, dict], object]:
  """The input-wait share of each feed's training epoch, and the state after them.

  `epoch_feeds` maps a name to a function giving one epoch's batches; "resident" (batches
  already on the devices) is the reference. After a compiling step and one untimed pass of
  each feed, each feed's epoch is timed in turn `repeats` times (so that drifts in the
  machine hit every feed), each followed by its input alone (batches made, no step). A
  feed's share is 1 - resident / feed, medians of epoch seconds: the part of its epoch
  that would go if input cost nothing.
  """
  _, state = timed_epoch(train_fn, state, list(epoch_feeds["resident"]())[:2])  # Compiles.
  for feed in epoch_feeds.values():  # Untimed: workers start, files enter the page cache.
    input_alone(feed())
  runs = {name: [] for name in epoch_feeds}
  for _ in range(repeats):
    for name, feed in epoch_feeds.items():
      epoch, state = timed_epoch(train_fn, state, feed())
      epoch["input_alone_seconds"] = input_alone(feed())
      runs[name].append(epoch)
  base = statistics.median(run["seconds"] for run in runs["resident"])
  results = {}
  for name, epochs in runs.items():
    median = {key: statistics.median(epoch[key] for epoch in epochs) for key in epochs[0]}
    results[name] = {"seconds": [epoch["seconds"] for epoch in epochs],
                     **{f"median_{key}": value for key, value in median.items()},
                     "input_wait_share": 1 - base / median["seconds"]}
  return results, state
