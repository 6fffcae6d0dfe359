"""Readers: how rows of a split become a global batch on the device mesh.

The kinds (entries of the registry `READERS`; each builds a run's readers, one a split):

  host          the split stays in host memory; each process gathers its rows of a batch
                there and transfers the images (`splits.batch_at`, then `sharding.to_global`).
  device        the split's uint8 images, labels and ids are put on every device once
                (replicated); a batch is gathered on the devices from int32 row indices, so
                the host sends B int32 numbers instead of B images (`batches`: those of all
                its batches at once, then one gather dispatch per batch), and no host-side
                gathering slows the fresh scoring pass or evaluation.
  stream        the images stay in array_record files (cpjax.data.array_records, written by
                scripts/write_array_records.py); each process reads only its own rows of
                each batch, by index, and grain's threads read the next batches ahead.
                Memory holds labels and ids (8 bytes per example) and the read-ahead
                buffer, not the set.
  host_stage    an encoded dataset's rows (folder, tfds:NAME, their converted records) read
                as encoded bytes, decoded, cropped and flipped on the host in worker
                processes or threads (dataset.worker_kind), each process its own rows
                (cpjax.data.host_stage).
  device_stage  an encoded dataset's rows read as encoded bytes on the host, decoded on each
                device by a decoder of cpjax.data.device_stage.decoders, cropped, resized and
                flipped there (cpjax.data.device_stage).

host and device are registered here, stream by cpjax.data.array_records, host_stage and
device_stage by their modules; cpjax.data.input_pipeline imports them all and chooses a run's
kind (`input_pipeline.choose`).

Every reader gives the same batch dict (image, label, id, mask, and weight when
given), bit for bit, so the steps cannot tell them apart. `batch` builds one
batch; `batches` a sequence of them (close the generator when leaving it early).
`train_batches` is `batches` for the train step: the device reader's leave the gather to
the step (a `RowsToGather` under "gather", which the step's `gathered` turns into the same
batch inside its own program: one dispatch a step instead of a gather and a step).

Device prefetch (all but the device reader): `batches` builds the next `prefetch_depth`
global batches (gathered, read or decoded, and put on the devices with their sharding) in a
background thread while the loop's current step runs, so an accelerator does not wait for
the host between steps; the batches and their order are the same as without it. The device
reader builds its batches on the devices, by a gather dispatched asynchronously: it needs
none.
"""

import collections
from collections.abc import Callable, Iterable, Iterator, Mapping
import concurrent.futures
import dataclasses
import functools
import queue
import threading
from typing import Any, Protocol

import jax
import ml_collections
import numpy as np

from cpjax import registry
from cpjax.data import (
  decode_workers,
  preprocess,
  specs,
  splits,
)
from cpjax.runtime import sharding

DEFAULT_PREFETCH_DEPTH = 2  # Global batches put on the devices ahead of the step.


class Reader:
  """Rows of `split` gathered in host memory, each process its own part of a batch."""
  kind = "host"

  def __init__(self, split: splits.Split, mesh: jax.sharding.Mesh,
               prefetch_depth: int = DEFAULT_PREFETCH_DEPTH):
    self.split, self.mesh = split, mesh
    self.prefetch_depth = _checked_depth(prefetch_depth)

  def __len__(self) -> int:
    return len(self.split)

  @property
  def labels(self) -> np.ndarray:  # Host copies, for the selection's bookkeeping.
    return self.split.labels

  @property
  def ids(self) -> np.ndarray:
    return self.split.ids

  def batch(self, rows: np.ndarray, mask: np.ndarray | None = None,
            weights: np.ndarray | None = None) -> dict[str, jax.Array]:
    """The global batch of split rows `rows` [B] (mask [B]: 1 = real row; weights [B]: the
    rows' loss weights)."""
    local = sharding.process_rows(self.mesh, len(rows))
    host = splits.batch_at(self.split, rows[local], _part(mask, local), _part(weights, local))
    return sharding.to_global(self.mesh, host, len(rows))

  def batches(self, row_blocks: np.ndarray, masks: np.ndarray | None = None,
              row_weights: np.ndarray | None = None, epoch: int | None = None
              ) -> Iterator[dict[str, jax.Array]]:
    """`batch` of each block of `row_blocks` [S, B] in order (masks [S, B]; row_weights: one
    per split row, looked up for each block), `prefetch_depth` of them built ahead. `epoch`:
    the training epoch the batches are for (None: evaluation or scoring), which only the
    host stage's reader uses (in-memory images are augmented on the device)."""
    del epoch
    return prefetched(self._batches(row_blocks, masks, row_weights), self.prefetch_depth)

  def train_batches(self, row_blocks: np.ndarray, row_weights: np.ndarray | None = None,
                    epoch: int | None = None) -> Iterator[dict[str, Any]]:
    """The train step's `batches` of `row_blocks` (no masks: every training row is real);
    each a batch, or (device reader) what the step gathers it from (`gathered`)."""
    return self.batches(row_blocks, row_weights=row_weights, epoch=epoch)

  def _batches(self, row_blocks, masks, row_weights) -> Iterator[dict[str, jax.Array]]:
    for s, rows in enumerate(row_blocks):
      yield self.batch(rows, None if masks is None else masks[s],
                       None if row_weights is None else row_weights[rows])

  def _global(self, rows: np.ndarray, local_images: np.ndarray, mask: np.ndarray | None,
              weights: np.ndarray | None) -> dict[str, jax.Array]:
    """The global batch of `rows` from this process's images of its part of them: the readers
    that read a batch's images themselves (stream, preprocess) give them here."""
    local = sharding.process_rows(self.mesh, len(rows))
    host = {"image": local_images, "label": self.split.labels[rows[local]],
            "id": self.split.ids[rows[local]], **mask_and_weight(local, mask, weights)}
    return sharding.to_global(self.mesh, host, len(rows))


def _checked_depth(depth: int) -> int:
  if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
    raise ValueError(f"prefetch_depth={depth!r}: an integer >= 0 (0 = no prefetch)")
  return depth


def prefetched(items: Iterator[Any], depth: int) -> Iterator[Any]:
  """`items` in order, the next `depth` of them made by a background thread while the
  consumer works on the current one (depth 0: `items` itself, made on demand).

  The thread stops, and `items` is closed, when this generator is exhausted or closed; an
  error in making an item is raised here, in its place in the sequence.
  """
  if depth == 0:
    yield from items
    return
  ready: queue.Queue = queue.Queue(maxsize=depth)
  stop = threading.Event()

  def put(entry) -> bool:
    while not stop.is_set():  # Gives up when the consumer has left.
      try:
        ready.put(entry, timeout=0.05)
        return True
      except queue.Full:
        pass
    return False

  def produce() -> None:
    try:
      for item in items:
        if not put(("item", item)):
          return
      put(("end", None))
    except Exception as err:  # pylint: disable=broad-except  Raised in the consumer.
      put(("error", err))
    finally:
      close = getattr(items, "close", None)
      if close is not None:
        close()

  thread = threading.Thread(target=produce, name="cpjax-prefetch", daemon=True)
  thread.start()
  try:
    while True:
      kind, value = ready.get()
      if kind == "end":
        return
      if kind == "error":
        raise value
      yield value
  finally:
    stop.set()
    thread.join()


def _part(values: np.ndarray | None, local: slice) -> np.ndarray | None:
  return None if values is None else values[local]


def mask_and_weight(local: slice, mask: np.ndarray | None,
                    weights: np.ndarray | None) -> dict[str, np.ndarray]:
  """This process's `mask` (all ones when None) and `weight` (when given) of a batch, as
  `splits.batch_at` gives them."""
  out = {"mask": np.ones(local.stop - local.start, np.float32) if mask is None
         else np.asarray(mask[local], np.float32)}
  if weights is not None:
    out["weight"] = np.asarray(weights[local], np.float32)
  return out


@functools.partial(jax.jit, static_argnums=0)
def _gather(out_sharding, arrays: dict[str, jax.Array], rows: jax.Array
            ) -> dict[str, jax.Array]:
  """arrays[rows] for every array, laid out as a batch (rows sharded on `data`)."""
  return {key: jax.lax.with_sharding_constraint(value[rows], out_sharding)
          for key, value in arrays.items()}


@functools.partial(jax.jit, static_argnums=0)
def _gather_block(out_sharding, arrays: dict[str, jax.Array], blocks: dict[str, jax.Array],
                  step: jax.Array) -> dict[str, jax.Array]:
  """Batch `step` of an epoch's `blocks` (row [S, B], mask and weight [S, B]): arrays[rows]
  for every array, with the block's mask and weight, laid out as a batch."""
  small = {key: value[step] for key, value in blocks.items()}
  gathered = _gather(out_sharding, arrays, small.pop("row"))
  return {**gathered, **{key: jax.lax.with_sharding_constraint(value, out_sharding)
                         for key, value in small.items()}}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowsToGather:
  """Batch `index` of an epoch's row `blocks`, still to gather from the device-resident split
  `arrays` (`DeviceReader.train_batches`): a jitted step gathers it in its own program."""
  arrays: dict[str, jax.Array]  # The split on every device: image, label, id.
  blocks: dict[str, jax.Array]  # [S, B] row (and mask, weight) of the epoch's batches.
  index: np.ndarray  # int32 scalar: which of the S batches.
  out_sharding: jax.sharding.NamedSharding = dataclasses.field(metadata={"static": True})


def gathered(batch: dict[str, Any]) -> dict[str, jax.Array]:
  """`batch` with its "gather" entry (a `RowsToGather`), if any, replaced by the batch it
  names: inside a jitted step, the same gather `DeviceReader.batches` dispatches alone."""
  if "gather" not in batch:
    return batch
  rest = dict(batch)
  rows = rest.pop("gather")
  # The barrier keeps XLA from fusing the gather into each of its consumers (augmentation,
  # labels, ids), which repeats it in each: the batch is gathered once, as a separate gather
  # dispatch gives it (measured on CPU: without it the fused step cost more than the two).
  return {**jax.lax.optimization_barrier(
      _gather_block(rows.out_sharding, rows.arrays, rows.blocks, rows.index)), **rest}


class DeviceReader(Reader):
  """Rows of `split` gathered on the devices from a copy of the split on each of them."""
  kind = "device"

  def __init__(self, split: splits.Split, mesh: jax.sharding.Mesh):
    super().__init__(split, mesh, prefetch_depth=0)  # Its gathers are dispatched async.
    self._arrays = sharding.replicate(mesh, {"image": split.images, "label": split.labels,
                                             "id": split.ids})

  def batch(self, rows, mask=None, weights=None):
    local = sharding.process_rows(self.mesh, len(rows))
    small = {"row": np.asarray(rows[local], np.int32),
             **mask_and_weight(local, mask, weights)}
    small = sharding.to_global(self.mesh, small, len(rows))
    gathered = _gather(sharding.batch_sharded(self.mesh), self._arrays, small.pop("row"))
    return {**gathered, **small}

  def _batches(self, row_blocks, masks, row_weights):
    """The blocks' rows, masks and weights go to the devices in one transfer; each batch is
    then one gather dispatched on the devices (no host work per batch but the dispatch)."""
    if len(row_blocks) == 0:
      return
    blocks = self._blocks(row_blocks, masks, row_weights)
    out_sharding = sharding.batch_sharded(self.mesh)
    for s in range(len(row_blocks)):
      yield _gather_block(out_sharding, self._arrays, blocks, np.int32(s))

  def train_batches(self, row_blocks, row_weights=None, epoch=None):
    """No gather here: each item names its batch ({"gather": RowsToGather}), and the train
    step gathers it (`gathered`), saving a dispatch a step."""
    del epoch
    if len(row_blocks) == 0:
      return
    # The blocks are an argument of the step: padded to the longest epoch's number of steps
    # (all rows), so that epochs of every size (a subset, infobatch, a resumed remainder)
    # share one compiled step. The padding's rows are never gathered.
    padded = np.zeros((max(-(-len(self) // row_blocks.shape[1]), len(row_blocks)),
                       row_blocks.shape[1]), row_blocks.dtype)
    padded[:len(row_blocks)] = row_blocks
    blocks = self._blocks(padded, None, row_weights)
    out_sharding = sharding.batch_sharded(self.mesh)
    for s in range(len(row_blocks)):
      yield {"gather": RowsToGather(self._arrays, blocks, np.int32(s), out_sharding)}

  def _blocks(self, row_blocks: np.ndarray, masks: np.ndarray | None,
              row_weights: np.ndarray | None) -> dict[str, jax.Array]:
    """The [S, B] rows, masks and weights of `row_blocks` on the devices, in one transfer."""
    local = sharding.process_rows(self.mesh, row_blocks.shape[1])
    small = {"row": np.asarray(row_blocks[:, local], np.int32),
             "mask": (np.ones(row_blocks[:, local].shape, np.float32) if masks is None
                      else np.asarray(masks[:, local], np.float32))}
    if row_weights is not None:
      small["weight"] = np.asarray(row_weights[row_blocks[:, local]], np.float32)
    return sharding.to_global_blocks(self.mesh, small, row_blocks.shape[1])


class RowImages(Protocol):
  """Images of a split's rows read from files (cpjax.data.array_records.RecordImages)."""
  rows_read: int

  def read(self, rows: np.ndarray) -> np.ndarray: ...

  def prefetched(self, row_blocks: np.ndarray, num_threads: int,
                 buffer_size: int) -> Iterator[np.ndarray]: ...


class StreamReader(Reader):
  """Rows of a split read from its array_record files: each process reads the images of its
  own rows of each batch only (labels and ids, 8 bytes per example, are in memory)."""
  kind = "stream"

  def __init__(self, images: RowImages, split: splits.Split,
               mesh: jax.sharding.Mesh, num_threads: int = 4, buffer_size: int = 8,
               prefetch_depth: int = DEFAULT_PREFETCH_DEPTH):
    super().__init__(split, mesh, prefetch_depth)
    self.images, self._threads, self._buffer = images, num_threads, buffer_size

  def batch(self, rows, mask=None, weights=None):
    local = sharding.process_rows(self.mesh, len(rows))
    return self._global(rows, self.images.read(rows[local]), mask, weights)

  def _batches(self, row_blocks, masks, row_weights):
    local = sharding.process_rows(self.mesh, row_blocks.shape[1])
    read_ahead = self.images.prefetched(row_blocks[:, local], self._threads, self._buffer)
    for s, images in enumerate(read_ahead):
      yield self._global(row_blocks[s], images, None if masks is None else masks[s],
                         None if row_weights is None else row_weights[row_blocks[s]])


class SourceReader(Reader):
  """Rows of an encoded dataset's source (folder, tfds:NAME, their records) read through
  `transform`, each process its own rows of a batch: the base of the host stage's reader
  (cpjax.data.host_stage) and the device stage's (cpjax.data.device_stage). `num_workers`
  (0: the cores this process may use) read or decode; `read_ahead` blocks of rows are in
  flight ahead of the one the consumer takes (`read_ahead`)."""
  thread_name = "cpjax-read"  # Its thread pool's thread names.

  def __init__(self, source, transform: preprocess.Transform, mesh: jax.sharding.Mesh,
               num_workers: int = 0, prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
               read_ahead: int = 2):
    super().__init__(splits.Split(None, np.asarray(source.labels, np.int32),
                                  np.asarray(source.ids, np.int32)), mesh, prefetch_depth)
    self.source, self.transform = source, transform
    self.num_workers = num_workers or decode_workers.usable_cores()
    self._read_ahead = max(1, read_ahead)
    self._threads: concurrent.futures.ThreadPoolExecutor | None = None

  def batches(self, row_blocks: np.ndarray, masks: np.ndarray | None = None,
              row_weights: np.ndarray | None = None, epoch: int | None = None
              ) -> Iterator[dict[str, jax.Array]]:
    """`batch` of each block [S, B] in order (`epoch`: the training transform of that epoch;
    None: the evaluation transform), the next `read_ahead` blocks in flight and
    `prefetch_depth` batches put on the devices ahead of the consumer."""
    return prefetched(self._batches(row_blocks, masks, row_weights, epoch), self.prefetch_depth)

  def read_ahead(self, blocks: Iterable[Any],
                 submit: Callable[[int, Any], list[concurrent.futures.Future]],
                 finish: Callable[[int, list[concurrent.futures.Future]], Any]
                 ) -> Iterator[Any]:
    """finish(s, futures) of each block s of `blocks` in order, where futures = submit(s,
    block) was called `read_ahead` blocks ahead of it. When the generator is closed before
    the end (a consumer that leaves, an error), the futures of the blocks submitted and not
    finished are cancelled: those not started never run."""
    pending: collections.deque = collections.deque()
    try:
      for s, block in enumerate(blocks):
        pending.append((s, submit(s, block)))
        if len(pending) > self._read_ahead:
          yield finish(*pending.popleft())
      while pending:
        yield finish(*pending.popleft())
    finally:
      for _, futures in pending:
        for future in futures:
          future.cancel()

  def _thread_pool(self) -> concurrent.futures.ThreadPoolExecutor:
    if self._threads is None:
      self._threads = concurrent.futures.ThreadPoolExecutor(
          self.num_workers, thread_name_prefix=self.thread_name)
    return self._threads


# ------------------------------------------------------------------- the kinds of reader


@dataclasses.dataclass(frozen=True)
class Build:
  """What a kind of reader builds a run's readers from (cpjax.data.input_pipeline.choose)."""
  dataset: ml_collections.ConfigDict  # config.dataset.
  spec: specs.DatasetSpec  # The dataset's facts.
  mesh: jax.sharding.Mesh  # Where the batches go.
  seed: int  # The run's seed: the stages draw each crop and flip from (seed, epoch, id).
  decode: str  # An encoded dataset's dataset.decode, auto resolved: cpu or a decoder's name.
  in_memory: Mapping[str, splits.Split]  # host, device: the splits read into host memory.
  # host_stage, device_stage: opens the encoded dataset's splits -> ({split: its source},
  # where they are read from, in words). Given by the caller, so that the stages do not
  # import the sources (and tfds with them).
  open_encoded: Callable[[], tuple[Mapping[str, Any], str]] | None = None


@dataclasses.dataclass(frozen=True)
class ReaderKind:
  """A kind of reader (the module docstring), registered in READERS by its module."""
  name: str
  doc: str
  create: Callable[[Build], dict[str, Reader]]  # A run's readers, one a split.
  settings: tuple[registry.Setting, ...] = ()  # Its fields are config.dataset's own.


READERS: registry.Registry[ReaderKind] = registry.Registry(
    "kind of reader", "dataset", hint="(stream, host_stage and device_stage are registered "
    "by cpjax.data.array_records, host_stage and device_stage: import them)")
READERS.register(ReaderKind(
    "host", "the splits in host memory",
    lambda build: {name: Reader(split, build.mesh, build.dataset.prefetch_depth)
                   for name, split in build.in_memory.items()}))
READERS.register(ReaderKind(
    "device", "the splits on every device",
    lambda build: {name: DeviceReader(split, build.mesh)
                   for name, split in build.in_memory.items()}))
