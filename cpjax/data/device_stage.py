"""The device stage: images decoded on each device, cropped, resized and flipped there.

`dataset.decode` chooses who decodes a source dataset's images (folder, tfds:NAME, their
records):

  cpu         the host stage (cpjax.data.host_stage): decode, crop, resize and flip on the
              host's cores; the default, unchanged
  gpu         this stage with nvImageCodec (cpjax.data.nvimgcodec_decode): each device decodes
              its own shard of the batch on its GPU (the hardware JPEG decoder where the card
              has one); needs an NVIDIA GPU and the `gpu-decode` extra
  device_cpu  this stage with PIL decoding on the host standing in for the GPU's decoder:
              the same batching, boxes, device op and sharding, testable on any machine
              (slower than `cpu`: one thread pool, no worker processes)
  auto        gpu where it can run (an NVIDIA GPU, the library installed, resize=opencv),
              else cpu; the choice is logged

A decoder is an entry of `DECODERS` (a registry); `resolve` turns auto into a name. In this
stage the host reads each example's encoded bytes and header (threads, no decoding), draws its
box and flip from (seed, epoch, id) with the host stage's own functions
(preprocess.Transform.box_and_flip), each device decodes its rows' images (or boxes) into a
packed buffer on itself, and one jitted op (cpjax.data.device_resize) crops, resizes and
flips them there: the batch's images never come back to the host. The global batch is
assembled from the devices' shards (jax.make_array_from_single_device_arrays).

A file whose header PIL cannot read is named in one BadImageError, as in the host stage; a
file the GPU decoder cannot read (a CMYK or other non-RGB JPEG, a format it lacks, a decode
it fails) is decoded on the host by PIL, counted, and logged at the end of the pass, never
dropped; a truncated file is sent to PIL too, which names it.
"""

import collections
from collections.abc import Callable, Iterator, Sequence
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any

import jax
import numpy as np

from cpjax import registry
from cpjax.data import (
  decode_workers,
  device_resize,
  nvimgcodec_decode,
  packed_regions,
  preprocess,
  readers,
  splits,
)
from cpjax.runtime import sharding

HOST_STAGE, AUTO = "cpu", "auto"  # dataset.decode's choices beside the DECODERS.


class HostDecoder:
  """PIL on the host standing in for a GPU decoder (`dataset.decode=device_cpu`): each
  example's box (or whole image) decoded in the reader's threads, packed, and put on the
  device that the op runs on."""

  def __init__(self, channels: int = 3, whole: bool = False):
    del channels  # Every decoder is built from the channels; PIL's decode takes them per call.
    self.whole = whole
    self.name = "device_cpu (PIL on the host standing in for a GPU decoder)"

  def prepare(self, item: packed_regions.Item,
              channels: int) -> tuple[np.ndarray, packed_regions.Placed]:
    return packed_regions.host_region(item, channels, self.whole)

  def decode(self, items, prepared, channels, device) -> packed_regions.Decoded:
    return packed_regions.with_host_part(items, {}, None, channels, device,
                                         dict(enumerate(prepared)), fallback=False)


@dataclasses.dataclass(frozen=True)
class DecoderKind:
  """A device-stage decoder (`dataset.decode`)."""
  name: str
  # Why it cannot run here (one line naming what to install), or None.
  problem: Callable[[], str | None]
  create: Callable[[int], packed_regions.ImageDecoder]  # channels -> the decoder.
  doc: str = ""
  settings: tuple[registry.Setting, ...] = ()


DECODERS: registry.Registry[DecoderKind] = registry.Registry(
    "image decoder", "dataset", hint=f"{HOST_STAGE} (the host stage), {AUTO}")
DECODERS.register(DecoderKind("gpu", nvimgcodec_decode.problem, nvimgcodec_decode.Decoder,
                              "nvImageCodec on each device's GPU (the gpu-decode extra)"))
DECODERS.register(DecoderKind("device_cpu", lambda: None, HostDecoder,
                              "PIL on the host standing in for the GPU's decoder (tests)"))


def choices() -> list[str]:
  """dataset.decode's valid values."""
  return [HOST_STAGE, AUTO, *DECODERS.names()]


def resolve(decode: str, resize: str) -> str:
  """`decode` with auto resolved, logged: gpu where it can run and the resize engine is the
  device op's ("opencv"), else cpu."""
  if decode != AUTO:
    return decode
  problem = DECODERS["gpu"].problem() or (
      None if resize == "opencv" else f"dataset.resize={resize!r} (the device op is opencv's)")
  chosen = HOST_STAGE if problem else "gpu"
  logging.info("dataset.decode=auto: %s%s.", chosen, f" ({problem})" if problem else
               " (NVIDIA GPU and nvImageCodec found)")
  return chosen


class DeviceStageReader(readers.HostReader):
  """Batches of a source's rows through `transform`'s boxes and flips, decoded by `decoder`
  on each device and resized there (see the module docstring)."""
  kind = "device_stage"

  def __init__(self, source, transform: preprocess.Transform, mesh: jax.sharding.Mesh,
               decoder: packed_regions.ImageDecoder, num_threads: int = 0,
               prefetch_depth: int = readers.DEFAULT_PREFETCH_DEPTH, read_ahead: int = 2):
    super().__init__(splits.Split(None, np.asarray(source.labels, np.int32),
                                  np.asarray(source.ids, np.int32)), mesh, prefetch_depth)
    if transform.resize != "opencv":
      raise ValueError(f"resize={transform.resize!r}: the device stage resizes as the "
                       "'opencv' engine does (cpjax.data.device_resize)")
    self.source, self.transform, self.decoder = source, transform, decoder
    self.num_threads = num_threads or decode_workers.usable_cores()
    self._read_ahead = max(1, read_ahead)
    self._threads: concurrent.futures.ThreadPoolExecutor | None = None
    self._devices: concurrent.futures.ThreadPoolExecutor | None = None
    self.decoded_on_host = 0  # Examples a GPU decoder left to PIL, over all passes.
    self._count_lock = threading.Lock()  # The device threads add to it.

  @property
  def decoder_name(self) -> str:
    return self.decoder.name

  def batch(self, rows, mask=None, weights=None, epoch=None):
    """The global batch of `rows` (weights: one per row of the batch, as HostReader.batch)."""
    blocks = np.asarray(rows)[None, :]
    masks = None if mask is None else np.asarray(mask)[None, :]
    batches = self._batches(blocks, masks, weights, epoch, weights_by_row=False)
    try:
      return next(batches)
    finally:
      batches.close()

  def batches(self, row_blocks: np.ndarray, masks: np.ndarray | None = None,
              row_weights: np.ndarray | None = None, epoch: int | None = None
              ) -> Iterator[dict[str, jax.Array]]:
    """The global batch of each block [S, B] in order: the next `read_ahead` blocks read in
    threads and `prefetch_depth` decoded on the devices ahead of the consumer."""
    return readers.prefetched(self._batches(row_blocks, masks, row_weights, epoch),
                              self.prefetch_depth)

  def images(self, rows: np.ndarray, epoch: int | None = None) -> np.ndarray:
    """uint8 [len(rows), S, S, C] on the host: `rows` through this stage on the first local
    device, whatever the mesh (tests and measurements)."""
    items, prepared = zip(*self._threads_pool().map(
        lambda row: self._prepared(int(row), epoch), np.asarray(rows)))
    return np.asarray(self._shard(items, prepared, jax.local_devices()[0]))

  def _batches(self, row_blocks, masks, row_weights, epoch, weights_by_row: bool = True):
    """Each block's global batch; `row_weights` one per split row (`weights_by_row`), or the
    block's own (`batch`)."""
    if len(row_blocks) == 0:
      return
    local = sharding.process_rows(self.mesh, row_blocks.shape[1])
    pending: collections.deque = collections.deque()
    before = self.decoded_on_host
    try:
      for s, rows in enumerate(row_blocks):
        pending.append(self._submit(rows[local], epoch))
        if len(pending) > self._read_ahead:
          yield self._global(row_blocks, masks, row_weights, s - self._read_ahead,
                             pending.popleft(), weights_by_row)
      first = len(row_blocks) - len(pending)
      for s in range(first, len(row_blocks)):
        yield self._global(row_blocks, masks, row_weights, s, pending.popleft(), weights_by_row)
    finally:
      for futures in pending:
        for future in futures:
          future.cancel()
      self._log_fallbacks(self.decoded_on_host - before)

  def _threads_pool(self) -> concurrent.futures.ThreadPoolExecutor:
    if self._threads is None:
      self._threads = concurrent.futures.ThreadPoolExecutor(
          self.num_threads, thread_name_prefix="cpjax-read")
    return self._threads

  def _prepared(self, row: int, epoch: int | None) -> tuple[packed_regions.Item, Any]:
    item = packed_regions.header_item(self.source, self.transform, row, epoch)
    return item, self.decoder.prepare(item, self.transform.channels)

  def _submit(self, rows: np.ndarray, epoch: int | None) -> list[concurrent.futures.Future]:
    pool = self._threads_pool()
    return [pool.submit(self._prepared, int(row), epoch) for row in rows]

  def _global(self, row_blocks, masks, row_weights, s: int, futures, weights_by_row: bool):
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
    """uint8 [n, S, S, C] on `device`: the examples decoded there and resized by the op."""
    t = self.transform
    decoded = self.decoder.decode(items, prepared, t.channels, device)
    with self._count_lock:
      self.decoded_on_host += decoded.on_host
    origins = np.asarray([(p.x0, p.y0, p.x0, p.y0) for p in decoded.placed], np.int32)
    boxes = np.asarray([item.box for item in items], np.int32).reshape(-1, 4) - origins
    widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    small = jax.device_put({
        "offsets": np.asarray([p.offset for p in decoded.placed], np.int32),
        "shapes": np.asarray([(p.height, p.width) for p in decoded.placed],
                             np.int32).reshape(-1, 2),
        "boxes": boxes, "area": device_resize.uses_area(widths, heights, t.size),
        "flips": np.asarray([item.flip for item in items], bool)}, device)
    return device_resize.crop_resize_flip(
        decoded.parts, small["offsets"], small["shapes"], small["boxes"], small["area"],
        small["flips"], size=t.size, channels=t.channels,
        taps=device_resize.tap_count(widths, heights, t.size))

  def _log_fallbacks(self, count: int) -> None:
    if count:
      logging.warning("%d images of this pass were decoded on the host by PIL: the GPU "
                      "decoder (%s) could not read them (non-RGB JPEGs, other formats, "
                      "truncated files); %d so far in this run.", count, self.decoder.name,
                      self.decoded_on_host)
