"""The host stage's reader: encoded rows decoded and cropped in parallel, ahead of the device.

`PreprocessReader` is the reader of a source dataset (folder, tfds:NAME, their array_record
conversions). For each global batch, each process reads and transforms only its own rows
(cpjax.runtime.sharding.process_rows), then puts them on the devices as the other readers
do. Training batches (`batches(..., epoch=e)`) get the training transform of epoch e
(random-resized crop and flip, drawn from (seed, e, example id): cpjax.data.preprocess);
evaluation and scoring passes (no epoch) the evaluation transform.

Who decodes (`worker_kind`, config.dataset.worker_kind):

  process  (the default) `num_workers` worker processes, shared by the run's readers
           (cpjax.data.decode_workers): each batch's rows are split into one chunk a
           worker, each worker writes its crops into the batch's slot of a shared-memory
           ring, and the reader copies the finished batch out once. No image is pickled.
  thread   `num_workers` threads of this process, one task an image. The Python around
           each image's PIL and OpenCV calls holds the GIL, so threads stop scaling past a
           few cores (16 threads measured 1.9x one thread on a 16-core machine, where a
           sketch of processes writing into shared memory measured 10.5x); kept for where
           they may be cheaper: a machine with one or two cores, a run too short to repay
           the workers' start (once a run), a container with a small /dev/shm.

Up to `read_ahead` batches are decoding at once ahead of the one the step will take next,
and the readers' `prefetched` thread puts the next batches on the devices. The batches are
the same, bit for bit, whatever the worker kind, the worker count or the read-ahead: each
example's crop depends on (seed, epoch, example id) only.
"""

from collections.abc import Iterator
import concurrent.futures
import logging

import jax
import numpy as np

from cpjax.data import decode_workers, preprocess, readers
from cpjax.runtime import sharding


class PreprocessReader(readers.SourceReader):
  """Batches of a source's rows through a `preprocess.Transform`, in worker processes or
  threads (`worker_kind`; `num_workers` 0: the cores this process may use)."""
  kind = "host_stage"
  decoder_name = "cpu (the host stage: PIL decodes, OpenCV resizes)"  # dataset.decode=cpu.
  thread_name = "cpjax-decode"

  def __init__(self, source, transform: preprocess.Transform, mesh: jax.sharding.Mesh,
               num_workers: int = 0, prefetch_depth: int = readers.DEFAULT_PREFETCH_DEPTH,
               read_ahead: int = 2, worker_kind: str = "process"):
    if worker_kind not in decode_workers.WORKER_KINDS:
      raise ValueError(f"worker_kind={worker_kind!r}: one of {decode_workers.WORKER_KINDS}")
    super().__init__(source, transform, mesh, num_workers, prefetch_depth, read_ahead)
    self.worker_kind = worker_kind
    self._context: decode_workers.Context | None = None
    self.rows_read = 0  # Rows this process has had decoded (tests: each process its own).

  def images(self, rows: np.ndarray, epoch: int | None = None) -> np.ndarray:
    """uint8 [len(rows), S, S, C]: the rows transformed (training transform of `epoch`, or
    the evaluation transform when None)."""
    decoded = self._decode(np.asarray(rows)[None, :], epoch)
    try:
      return next(decoded)
    finally:
      decoded.close()

  def batch(self, rows, mask=None, weights=None, epoch=None):
    local = sharding.process_rows(self.mesh, len(rows))
    return self._global(rows, self.images(rows[local], epoch), mask, weights)

  def _batches(self, row_blocks, masks, row_weights, epoch) -> Iterator[dict[str, jax.Array]]:
    if len(row_blocks) == 0:
      return
    local = sharding.process_rows(self.mesh, row_blocks.shape[1])
    decoded = self._decode(np.asarray(row_blocks)[:, local], epoch)
    try:
      for s, images in enumerate(decoded):
        yield self._block(row_blocks, masks, row_weights, s, images)
    finally:  # A consumer that leaves early (preemption, an error) cancels the rest.
      decoded.close()

  def _decode(self, local_blocks: np.ndarray, epoch: int | None) -> Iterator[np.ndarray]:
    """The images of each block of rows [S, L] in order, `read_ahead` blocks ahead."""
    if self.worker_kind == "thread" or local_blocks.shape[1] == 0:
      return self.read_ahead(local_blocks, lambda s, rows: self._in_threads(rows, epoch),
                             lambda s, futures: _stacked(futures, self.transform))
    return self._in_processes(local_blocks, epoch)

  def _in_threads(self, rows: np.ndarray, epoch: int | None) -> list[concurrent.futures.Future]:
    """One thread task an image of `rows`."""
    pool = self._thread_pool()
    self.rows_read += len(rows)
    return [pool.submit(decode_workers.transformed, self.source, self.transform, int(row),
                        epoch) for row in rows]

  def _in_processes(self, local_blocks, epoch) -> Iterator[np.ndarray]:
    """The blocks decoded by the worker processes, each block in flight in its own slot of
    shared memory (read_ahead ahead of the one being waited on)."""
    pool = decode_workers.shared_pool(self.num_workers)
    if self._context is None:
      self._context = decode_workers.Context(self.source, self.transform)
    t = self.transform
    shape = (local_blocks.shape[1], t.size, t.size, t.channels)

    def submit(s: int, rows: np.ndarray) -> list[concurrent.futures.Future]:
      self.rows_read += len(rows)
      return pool.decode(self._context, slots, s, rows, epoch)

    # Closing the read-ahead first cancels the tasks not started; those running write into
    # slots that are unlinked after.
    with decode_workers.Slots(min(self._read_ahead + 1, len(local_blocks)), shape) as slots:
      yield from self.read_ahead(local_blocks, submit,
                                 lambda s, futures: _finished(pool, slots, s, futures))

  def _block(self, row_blocks, masks, row_weights, s: int, images: np.ndarray):
    rows = row_blocks[s]
    return self._global(rows, images, None if masks is None else masks[s],
                        None if row_weights is None else row_weights[rows])


def _stacked(futures: list[concurrent.futures.Future],
             transform: preprocess.Transform) -> np.ndarray:
  """The futures' images stacked in order (an error is raised in its row's place)."""
  if not futures:
    return np.zeros((0, transform.size, transform.size, transform.channels), np.uint8)
  return np.stack([f.result() for f in futures])


def _finished(pool: decode_workers.ProcessPool, slots: decode_workers.Slots, s: int,
              futures: list[concurrent.futures.Future]) -> np.ndarray:
  """Block s's images, once its tasks are done, copied out of its slot."""
  pool.wait(futures)
  return slots.copy(s)


def _readers(build: readers.Build) -> dict[str, PreprocessReader]:
  """The host_stage kind's readers of a run (input_pipeline.choose): every split of the encoded
  dataset, decoded by dataset.worker_kind's workers."""
  dataset = build.dataset
  transform = preprocess.from_config(dataset, build.spec.image_shape, build.seed)
  opened, where = build.open_encoded()
  by_name = {name: PreprocessReader(source, transform, build.mesh, dataset.num_workers,
                                    dataset.prefetch_depth, worker_kind=dataset.worker_kind)
             for name, source in opened.items()}
  logging.info("Dataset %s: %s, read from %s; images decoded to %s on the host by %d %s.",
               dataset.name, {k: len(v) for k, v in by_name.items()},
               where, build.spec.image_shape,
               by_name["train"].num_workers,
               {"process": "worker processes", "thread": "threads"}[dataset.worker_kind])
  return by_name


readers.READERS.register(readers.ReaderKind(
    "host_stage", "an encoded dataset decoded and cropped on the host's cores", _readers))
