"""The host stage's reader: encoded rows decoded and cropped in parallel, ahead of the device.

`PreprocessReader` is the reader of a source dataset (folder, tfds:NAME). For each global
batch, each process reads and transforms only its own rows (cpjax.runtime.sharding
.process_rows) in a pool of worker threads, then puts them on the devices as the other
readers do. Training batches (`batches(..., epoch=e)`) get the training transform of epoch
e (random-resized crop and flip, drawn from (seed, e, example id):
cpjax.data.preprocess); evaluation and scoring passes (no epoch) the evaluation transform.

Threads, not processes: PIL releases the GIL while it decodes and resamples, which is
nearly all of an example's cost, so threads run in parallel on the cores without copying
decoded images between processes or pickling the source; and they share the process's
JAX-free state. Up to `read_ahead` batches are in the pool at once, so the workers run
ahead of the step; the readers' `prefetched` thread then puts the next batches on the
devices. The batches are the same, bit for bit, whatever the worker count or read-ahead.
"""

import collections
from collections.abc import Iterator
import concurrent.futures
import os

import jax
import numpy as np

from cpjax.data import preprocess, readers, splits
from cpjax.runtime import sharding


class PreprocessReader(readers.HostReader):
  """Batches of a source's rows through a `preprocess.Transform`, in worker threads."""
  kind = "preprocess"

  def __init__(self, source, transform: preprocess.Transform, mesh: jax.sharding.Mesh,
               num_workers: int = 0, prefetch_depth: int = readers.DEFAULT_PREFETCH_DEPTH,
               read_ahead: int = 2):
    super().__init__(splits.Split(None, np.asarray(source.labels, np.int32),
                                  np.asarray(source.ids, np.int32)), mesh, prefetch_depth)
    self.source, self.transform = source, transform
    self.num_workers = num_workers or os.cpu_count() or 1
    self._read_ahead = max(1, read_ahead)
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self.rows_read = 0  # Rows this process has decoded (tests: each process its own).

  def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.num_workers,
                                                         thread_name_prefix="cpjax-decode")
    return self._pool

  def _one(self, row: int, epoch: int | None) -> np.ndarray:
    (data,) = self.source.read(np.asarray([row]))
    return self.transform(data, int(self.split.ids[row]), epoch, where=self._where(row))

  def _where(self, row: int) -> str:
    where = getattr(self.source, "where", None)
    return where(row) if where else f"row {row}"

  def _submit(self, rows: np.ndarray, epoch: int | None) -> list[concurrent.futures.Future]:
    self.rows_read += len(rows)
    pool = self._executor()
    return [pool.submit(self._one, int(row), epoch) for row in rows]

  def images(self, rows: np.ndarray, epoch: int | None = None) -> np.ndarray:
    """uint8 [len(rows), S, S, C]: the rows transformed (training transform of `epoch`, or
    the evaluation transform when None)."""
    return _stacked(self._submit(rows, epoch))

  def batch(self, rows, mask=None, weights=None, epoch=None):
    local = sharding.process_rows(self.mesh, len(rows))
    return self._global(rows, self.images(rows[local], epoch), mask, weights)

  def batches(self, row_blocks: np.ndarray, masks: np.ndarray | None = None,
              row_weights: np.ndarray | None = None, epoch: int | None = None
              ) -> Iterator[dict[str, jax.Array]]:
    """`batch` of each block [S, B] in order, the next `read_ahead` blocks decoding in the
    workers and `prefetch_depth` on the devices ahead of the consumer."""
    return readers.prefetched(self._decoded(row_blocks, masks, row_weights, epoch),
                              self.prefetch_depth)

  def _decoded(self, row_blocks, masks, row_weights, epoch) -> Iterator[dict[str, jax.Array]]:
    if len(row_blocks) == 0:
      return
    local = sharding.process_rows(self.mesh, row_blocks.shape[1])
    pending: collections.deque = collections.deque()
    try:
      for s in range(len(row_blocks)):
        pending.append(self._submit(row_blocks[s, local], epoch))
        if len(pending) > self._read_ahead:
          yield self._block(row_blocks, masks, row_weights, s - self._read_ahead,
                            _stacked(pending.popleft()))
      first = len(row_blocks) - len(pending)
      for offset in range(len(pending)):
        yield self._block(row_blocks, masks, row_weights, first + offset,
                          _stacked(pending.popleft()))
    finally:  # A consumer that leaves early (preemption, an error) cancels the rest.
      for futures in pending:
        for future in futures:
          future.cancel()

  def _block(self, row_blocks, masks, row_weights, s: int, images: np.ndarray):
    rows = row_blocks[s]
    return self._global(rows, images, None if masks is None else masks[s],
                        None if row_weights is None else row_weights[rows])

  def _global(self, rows, local_images, mask, weights) -> dict[str, jax.Array]:
    local = sharding.process_rows(self.mesh, len(rows))
    host = {"image": local_images, "label": self.split.labels[rows[local]],
            "id": self.split.ids[rows[local]],
            **readers.mask_and_weight(local, mask, weights)}
    return sharding.to_global(self.mesh, host, len(rows))


def _stacked(futures: list[concurrent.futures.Future]) -> np.ndarray:
  """The futures' images stacked in order (an error is raised in its row's place)."""
  return np.stack([f.result() for f in futures])
