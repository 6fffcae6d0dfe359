"""The device stage's reader: an encoded dataset's images (folder, tfds:NAME, their records)
decoded on each device by the decoder `dataset.decode` names (cpjax.data.device_stage.decoders),
cropped, resized and flipped there.

In this stage the host reads each
example's encoded bytes and header (threads, no decoding), draws its box and flip from (seed,
epoch, id) with the host stage's own functions (preprocess.Transform.box_and_flip), each
device decodes its rows' images (or boxes) into a packed buffer on itself, and one jitted op
(cpjax.data.device_stage.resize) crops, resizes and flips them there: the batch's images never
come back to the host. The global batch is assembled from the devices' shards
(jax.make_array_from_single_device_arrays).

Pipelined: a pass's batches are made by a background thread `prefetch_depth` batches ahead
of the consumer (readers.prefetched), the rows' bytes and headers `read_ahead` blocks ahead
of that, and the device op is dispatched without waiting for it, so decoding and cropping
batch n + 1 runs while step n runs. At most prefetch_depth + 2 batches are in flight
(`dataset.prefetch_depth`, 0 to 64): a GPU decoder keeps that many device buffers a device
and batch size (packed_regions.DeviceBuffers) and reuses each once the op that read it has
finished. The host waits, per batch, for its rows' reads and for each device's decode (a GPU
decoder for its own CUDA stream: the op reads what it wrote), never for the devices' queue
of steps.

Few programs, compiled ahead: every shard of a batch size is packed into buffers of one
length, its rows times the largest image's bytes (a header scan of up to SIZE_SAMPLE rows,
`largest`), and its taps are a power of two up to what the largest image's boxes need, so the
device op has a few programs a device (`programs`; one per device, as jit compiles a
single-device program for each), which `compile_ahead` compiles in parallel before a pass.
A shard of images larger than the scanned ones still works: its program is compiled when
met, with a warning naming it once programs were compiled ahead.

A file whose header PIL cannot read is named in one BadImageError, as in the host stage; a
file the GPU decoder cannot read (a CMYK or other non-RGB JPEG, a format it lacks, a decode
it fails) is decoded on the host by PIL, counted, and logged at the end of the pass, never
dropped; a truncated file is sent to PIL too, which names it.
"""

from collections.abc import Sequence
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any

import jax
import numpy as np

from cpjax.data import (
  decode_workers,
  image_stats,
  preprocess,
  readers,
)
from cpjax.data.device_stage import decoders, packed_regions, resize
from cpjax.runtime import sharding

SIZE_SAMPLE = image_stats.STATS_SAMPLE  # Headers scanned for the largest image (`largest`).
# A device-op program: (device id, part lengths, rows of the shard, taps).
Program = tuple[int, tuple[int, ...], int, int]


@dataclasses.dataclass(frozen=True)
class Largest:
  """The largest image of a split's header scan: what its buffers and taps are sized for."""
  pixels: int  # Most pixels (width x height) of an image.
  side: int  # Longest side (a training box lies within it).
  shorter: int  # Longest shorter side (the evaluation's centre box lies within it).
  scanned: int  # Headers read.


class DeviceStageReader(readers.SourceReader):
  """Batches of a source's rows through `transform`'s boxes and flips, decoded by `decoder`
  on each device and resized there (see the module docstring); `num_threads` read the rows'
  bytes and headers; prefetch_depth + 2 batches in flight at most."""
  kind = "device_stage"

  def __init__(self, source, transform: preprocess.Transform, mesh: jax.sharding.Mesh,
               decoder: packed_regions.ImageDecoder, num_threads: int = 0,
               prefetch_depth: int = readers.DEFAULT_PREFETCH_DEPTH, read_ahead: int = 2):
    problem = resize.resize_problem(transform.resize)
    if problem:
      raise ValueError(f"the device stage {problem}")
    super().__init__(source, transform, mesh, num_threads, prefetch_depth, read_ahead)
    self.decoder = decoder
    self._devices: concurrent.futures.ThreadPoolExecutor | None = None
    self.decoded_on_host = 0  # Examples a GPU decoder left to PIL, over all passes.
    self._count_lock = threading.Lock()  # The device threads add to it.
    self._largest: Largest | None = None
    self._programs: set[Program] = set()  # Compiled ahead, or met in a batch.
    self._ahead_rows: set[int] = set()  # Shard sizes whose programs were compiled ahead.
    self._plan_lock = threading.Lock()

  @property
  def decoder_name(self) -> str:
    return self.decoder.name

  def batch(self, rows, mask=None, weights=None, epoch=None):
    """The global batch of `rows` (weights: one per row of the batch, as Reader.batch)."""
    blocks = np.asarray(rows)[None, :]
    masks = None if mask is None else np.asarray(mask)[None, :]
    batches = self._batches(blocks, masks, weights, epoch, weights_by_row=False)
    try:
      return next(batches)
    finally:
      batches.close()

  def images(self, rows: np.ndarray, epoch: int | None = None) -> np.ndarray:
    """uint8 [len(rows), S, S, C] on the host: `rows` through this stage on the first local
    device, whatever the mesh (tests and measurements)."""
    items, prepared = zip(*self._thread_pool().map(
        lambda row: self._prepared(int(row), epoch), np.asarray(rows)))
    return np.asarray(self._shard(items, prepared, jax.local_devices()[0]))

  def largest(self) -> Largest:
    """The largest image of the headers of a seeded sample of SIZE_SAMPLE rows (every row of a
    smaller split; image_stats.sample_rows), read once in the reader's threads (no pixels
    decoded; an unreadable header raises the BadImageError a batch would)."""
    with self._plan_lock:
      if self._largest is None:
        rows = image_stats.sample_rows(len(self.source), SIZE_SAMPLE)
        items = list(self._thread_pool().map(lambda row: packed_regions.header_item(
            self.source, self.transform, int(row), None), rows))
        sizes = np.asarray([(i.width, i.height) for i in items] or [(1, 1)], np.int64)
        self._largest = Largest(int(sizes.prod(axis=1).max()), int(sizes.max()),
                                int(sizes.min(axis=1).max()), len(items))
      return self._largest

  def buffers(self, rows: int) -> packed_regions.Buffers:
    """How a shard of `rows` examples is packed: buffers of `rows` times the largest image's
    bytes (resize.capacity), prefetch_depth + 2 of them in flight."""
    pixels = rows * self.largest().pixels * self.transform.channels
    return packed_regions.Buffers(resize.capacity(pixels), self.prefetch_depth + 2)

  def programs(self, batch_size: int, training: bool = True) -> list[Program]:
    """The device-op programs that global batches of `batch_size` rows can need on this
    process's devices while the images are no larger than `largest`: per device, each of the
    decoder's layouts of `buffers`' length, each tap count up to `tap_bound` of the longest
    side (training: any box of an image) or of the longest shorter side (evaluation: the
    centre box)."""
    largest, size = self.largest(), self.transform.size
    bound = resize.tap_bound(largest.side if training else largest.shorter, size)
    index_map = sharding.batch_sharded(self.mesh).addressable_devices_indices_map((batch_size,))
    out = []
    for device, index in index_map.items():
      rows = len(range(*index[0].indices(batch_size)))
      for lengths in self.decoder.layouts(self.buffers(rows).length):
        out += [(device.id, tuple(lengths), rows, taps)
                for taps in resize.tap_choices(bound)]
    return out

  def compile_ahead(self, batch_size: int, training: bool = True) -> list[Program]:
    """Compiles `programs(batch_size, training)` not compiled yet, in parallel threads, and
    returns them. Called before a pass (a run calls it while its steps compile, from any
    thread), the pass compiles nothing once its batches start, unless an image is larger
    than the scanned ones (`_met`). Without it, a pass compiles the programs it meets, as
    few (one buffer length)."""
    wanted = self.programs(batch_size, training)
    with self._plan_lock:
      todo = [p for p in wanted if p not in self._programs]
      self._programs.update(todo)
      self._ahead_rows.update(rows for _, _, rows, _ in wanted)
    if not todo:
      return []
    devices = {d.id: d for d in jax.local_devices()}
    t, start = self.transform, time.perf_counter()
    # The first device's programs first, the other devices' then: the same programs, which
    # the persistent compilation cache (where it is on) gives them without compiling again.
    first = [p for p in todo if p[0] == todo[0][0]]
    try:
      with concurrent.futures.ThreadPoolExecutor(min(len(todo), decode_workers.usable_cores()),
                                                 thread_name_prefix="cpjax-compile") as pool:
        for group in (first, [p for p in todo if p[0] != todo[0][0]]):
          list(pool.map(lambda p: resize.compile_for(devices[p[0]], p[1], p[2], t.size,
                                                            t.channels, p[3]), group))
    except BaseException:
      with self._plan_lock:  # Not compiled: a batch compiles them when met.
        self._programs.difference_update(todo)
      raise
    logging.info("Device stage: %d programs of the device op compiled ahead in %.1f s for "
                 "batches of %d (%s; taps %s; buffers of %d bytes, %d in flight a device).",
                 len(todo), time.perf_counter() - start, batch_size,
                 "training" if training else "evaluation", sorted({p[3] for p in todo}),
                 max(max(p[1]) for p in todo), self.prefetch_depth + 2)
    return todo

  def _met(self, program: Program) -> None:
    """Notes a program a shard runs; one that `compile_ahead` did not compile for a shard size
    it covered (an image larger than the scanned ones) is compiled now, with a warning."""
    with self._plan_lock:
      if program in self._programs:
        return
      self._programs.add(program)
      warn = program[2] in self._ahead_rows
    if warn:
      largest = self.largest()
      logging.warning("Device stage: the device op compiles a program beyond those compiled "
                      "ahead (device %d, parts of %s bytes, %d rows, %d taps): this batch has "
                      "images larger than the largest of the %d headers scanned (%d pixels, "
                      "%d px a side).", *program, largest.scanned, largest.pixels,
                      largest.side)

  def _batches(self, row_blocks, masks, row_weights, epoch, weights_by_row: bool = True):
    """Each block's global batch, its rows' bytes and headers read `read_ahead` blocks
    ahead; `row_weights` one per split row (`weights_by_row`), or the block's own (`batch`)."""
    if len(row_blocks) == 0:
      return
    local = sharding.process_rows(self.mesh, row_blocks.shape[1])
    before = self.decoded_on_host
    try:
      yield from self.read_ahead(
          row_blocks, lambda s, rows: self._submit(rows[local], epoch),
          lambda s, futures: self._assembled(row_blocks, masks, row_weights, s, futures,
                                             weights_by_row))
    finally:
      self._log_fallbacks(self.decoded_on_host - before)

  def _prepared(self, row: int, epoch: int | None) -> tuple[packed_regions.Item, Any]:
    item = packed_regions.header_item(self.source, self.transform, row, epoch)
    return item, self.decoder.prepare(item, self.transform.channels)

  def _submit(self, rows: np.ndarray, epoch: int | None) -> list[concurrent.futures.Future]:
    pool = self._thread_pool()
    return [pool.submit(self._prepared, int(row), epoch) for row in rows]

  def _assembled(self, row_blocks, masks, row_weights, s: int, futures,
                 weights_by_row: bool) -> dict[str, jax.Array]:
    """Block s's global batch: its examples (from `futures`) decoded and resized on their
    devices, labels, ids, mask and weight put beside them."""
    rows = row_blocks[s]
    local = sharding.process_rows(self.mesh, len(rows))
    items, prepared = zip(*[f.result() for f in futures]) if futures else ((), ())
    weights = row_weights if row_weights is None or not weights_by_row else row_weights[rows]
    host = {"label": self.split.labels[rows[local]], "id": self.split.ids[rows[local]],
            **readers.mask_and_weight(local, None if masks is None else masks[s], weights)}
    out = sharding.to_global(self.mesh, host, len(rows))
    out["image"] = self._sharded_images(items, prepared, len(rows), local)
    return out

  def _sharded_images(self, items, prepared, batch_size: int, local: slice) -> jax.Array:
    """The batch's images [B, S, S, C] sharded on `data`: each local device's shard decoded
    and resized on that device (in parallel threads, one a device)."""
    t = self.transform
    image_sharding = sharding.batch_sharded(self.mesh)
    shape = (batch_size, t.size, t.size, t.channels)
    index_map = image_sharding.addressable_devices_indices_map(shape)
    if self._devices is None:
      self._devices = concurrent.futures.ThreadPoolExecutor(
          len(index_map), thread_name_prefix="cpjax-device-decode")
    jobs = []
    for device, index in index_map.items():
      start, stop = index[0].indices(batch_size)[:2]
      part = slice(start - local.start, stop - local.start)
      jobs.append(self._devices.submit(self._shard, items[part], prepared[part], device))
    return jax.make_array_from_single_device_arrays(shape, image_sharding,
                                                    [job.result() for job in jobs])

  def _shard(self, items: Sequence[packed_regions.Item], prepared: Sequence[Any],
             device: jax.Device) -> jax.Array:
    """uint8 [n, S, S, C] on `device`: the examples decoded there and resized by the op
    (dispatched, not waited for)."""
    t = self.transform
    decoded = self.decoder.decode(items, prepared, t.channels, device, self.buffers(len(items)))
    out = None
    try:
      with self._count_lock:
        self.decoded_on_host += decoded.on_host
      origins = np.asarray([(p.x0, p.y0, p.x0, p.y0) for p in decoded.placed], np.int32)
      boxes = np.asarray([item.box for item in items], np.int32).reshape(-1, 4) - origins
      widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
      taps = resize.tap_count(widths, heights, t.size)
      self._met((device.id, tuple(int(p.shape[0]) for p in decoded.parts), len(items), taps))
      small = jax.device_put({
          "offsets": np.asarray([p.offset for p in decoded.placed], np.int32),
          "shapes": np.asarray([(p.height, p.width) for p in decoded.placed],
                               np.int32).reshape(-1, 2),
          "boxes": boxes, "area": resize.uses_area(widths, heights, t.size),
          "flips": np.asarray([item.flip for item in items], bool)}, device)
      out = resize.crop_resize_flip(
          decoded.parts, small["offsets"], small["shapes"], small["boxes"], small["area"],
          small["flips"], size=t.size, channels=t.channels, taps=taps)
      return out
    finally:
      if decoded.release is not None:  # The decoder's buffer: free once `out` is computed.
        decoded.release(out)

  def _log_fallbacks(self, count: int) -> None:
    if count:
      logging.warning("%d images of this pass were decoded on the host by PIL: the GPU "
                      "decoder (%s) could not read them (non-RGB JPEGs, other formats, "
                      "truncated files); %d so far in this run.", count, self.decoder.name,
                      self.decoded_on_host)


def _readers(build: readers.Build) -> dict[str, DeviceStageReader]:
  """The device_stage kind's readers of a run (input_pipeline.choose): every split of the encoded
  dataset, one decoder (build.decode's) for all."""
  dataset = build.dataset
  transform = preprocess.from_config(dataset, build.spec.image_shape, build.seed)
  opened, where = build.open_encoded()
  decoder = decoders.DECODERS[build.decode].create(build.spec.image_shape[2])
  by_name = {name: DeviceStageReader(source, transform, build.mesh, decoder,
                                     dataset.num_workers, dataset.prefetch_depth)
             for name, source in opened.items()}
  logging.info("Dataset %s: %s, read from %s; images decoded and resized to %s on the "
               "devices by %s.", dataset.name, {k: len(v) for k, v in opened.items()},
               where, build.spec.image_shape, decoder.name)
  return by_name


readers.READERS.register(readers.ReaderKind(
    "device_stage", "an encoded dataset decoded and resized on the devices", _readers))
