"""What the device stage's decoders share: an example as the host prepares it (`Item`), the
packed layout of decoded regions on a device (`Placed`, `Decoded`, `packed`), how the reader
sizes a shard's buffers (`Buffers`), device buffers reused in turn by a decoder that writes
into device memory (`DeviceBuffers`), and PIL's decode on the host, for the stand-in decoder
(`HostDecoder`) and for the files a GPU decoder cannot read (`host_region`, `with_host_part`).

The layout is cpjax.data.device_stage.resize's input: each example's decoded pixels (its whole
image, or its crop box alone) uint8 [h, w, C] row-major, back to back in 1-D buffers on the
device, with an offset, a (h, w) and the region's origin in the image per example. Every
buffer of a run is `Buffers.length` long (one compiled program serves every batch of a
size); a decoder's `layouts` says which part lengths it gives for it.
"""

from collections.abc import Callable, Sequence
import dataclasses
import functools
import threading
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from cpjax.data import decode_workers, preprocess
from cpjax.data.device_stage import resize


@dataclasses.dataclass(frozen=True)
class Item:
  """One example of a batch as the host prepares it: its bytes, header facts, box and flip."""
  data: bytes
  where: str  # The file or record, for messages.
  width: int
  height: int
  mode: str  # PIL's mode of the file: RGB, L, CMYK, P, ...
  format: str  # PIL's format: JPEG, PNG, ...
  box: tuple[int, int, int, int]  # (left, top, right, bottom), whole pixels of the image.
  flip: bool
  # A decode that fails raises this (the file named, the source's way out, its entry).
  damaged: Callable[[preprocess.BadImageError], preprocess.BadImageError] = dataclasses.field(
      default=lambda err: err, repr=False, compare=False)


@dataclasses.dataclass(frozen=True)
class Placed:
  """Where an example's decoded region lies in a packed buffer, and which part of its image
  it is (origin: the region's top-left pixel; (0, 0) for the whole image)."""
  offset: int
  height: int
  width: int
  x0: int = 0
  y0: int = 0


@dataclasses.dataclass(frozen=True)
class Decoded:
  """One device's shard of a batch, decoded on that device (`device_resize`'s input)."""
  parts: tuple[jax.Array, ...]  # Packed buffers on the device, read as one in order.
  placed: tuple[Placed, ...]  # Per example, offsets into that one buffer.
  on_host: int = 0  # Examples the host decoded in a GPU decoder's place (fallbacks).
  # Called with the device op's output (None if the op was not run) once it is dispatched:
  # a decoder that keeps its buffers (`DeviceBuffers`) rewrites one only after that output.
  release: Callable[[Any], None] | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Buffers:
  """How the reader sizes a shard's packed buffers: each part `length` bytes (one length per
  run and shard size: one compiled program; regions that do not fit get
  `resize.fitted`'s larger length), and `depth`, the batches in flight: a decoder that
  keeps device buffers (`DeviceBuffers`) keeps that many a device and length."""
  length: int
  depth: int = 2


class ImageDecoder(Protocol):
  """How the device stage decodes: `prepare` runs on the host for each example (in the
  reader's threads), `decode` puts a shard's regions on its device in buffers sized by
  `buffers`, and `layouts` names the part lengths that `decode` gives for buffers of `length`
  bytes when the regions fit (the programs the reader compiles ahead)."""
  name: str  # What decodes, for the log and the checkpoint (a resume compares it).

  def prepare(self, item: Item, channels: int) -> Any: ...

  def decode(self, items: Sequence[Item], prepared: Sequence[Any], channels: int,
             device: jax.Device, buffers: Buffers) -> Decoded: ...

  def layouts(self, length: int) -> tuple[tuple[int, ...], ...]: ...


class DeviceBuffers:
  """`depth` uint8 buffers of `length` bytes on `device`, given out in turn (`take`) to a
  decoder that writes into device memory itself (nvImageCodec, through their
  `__cuda_array_interface__`): allocated once, so no batch waits for an allocation queued
  behind the device's running steps; a buffer is given out again only once the device op
  that read it last has finished (the release's output is ready): the one host wait its reuse
  needs, and with `depth` batches in flight that op has long finished."""

  def __init__(self, length: int, depth: int, device: jax.Device):
    self._buffers = [jnp.zeros((length,), jnp.uint8, device=device)
                     for _ in range(max(1, depth))]
    for buffer in self._buffers:
      buffer.block_until_ready()  # Once: JAX has written it before anything else writes it.
    self._guards: list[Any] = [None] * len(self._buffers)
    self._busy = [False] * len(self._buffers)
    self._next = 0
    self._changed = threading.Condition()

  def take(self) -> tuple[Any, Callable[[Any], None]]:
    """The next buffer, once the op that read it last has finished, and its release: call it
    with the output of the op that reads the buffer now (None: nothing read it)."""
    with self._changed:
      k = self._next
      self._changed.wait_for(lambda: not self._busy[k])  # Taken and not yet released.
      self._next = (k + 1) % len(self._buffers)
      self._busy[k] = True
      guard, self._guards[k] = self._guards[k], None
    release = functools.partial(self._release, k)
    try:
      if guard is not None:
        guard.block_until_ready()
    except BaseException:
      release(None)
      raise
    return self._buffers[k], release

  def _release(self, k: int, guard: Any) -> None:
    with self._changed:
      self._guards[k], self._busy[k] = guard, False
      self._changed.notify_all()


def header_item(source, transform: preprocess.Transform, row: int,
                epoch: int | None) -> Item:
  """Row `row` of `source`: read, its header parsed (PIL's lazy open: no pixels decoded;
  BadImageError naming the file) and its box and flip drawn as the host stage draws them."""
  damaged = functools.partial(decode_workers.damaged, source=source, row=row)
  try:
    (data,) = source.read(np.asarray([row]))
    where = decode_workers.describe(source, row)
    image = preprocess.open_image(data, where)
  except preprocess.BadImageError as err:  # As the host stage names it (its way out too).
    raise damaged(err) from err
  box, flip = transform.box_and_flip(int(source.ids[row]), epoch, *image.size)
  return Item(data, where, image.size[0], image.size[1], image.mode, image.format or "",
              preprocess.pixel_box(box, *image.size), flip, damaged)


def host_region(item: Item, channels: int, whole: bool = False) -> tuple[np.ndarray, Placed]:
  """uint8 [h, w, C]: the example's box (or whole image) decoded by PIL on the host (the host
  stage's full-scale decode, `preprocess.decode`), and its origin in the image."""
  try:
    pixels = preprocess.decode(item.data, channels, item.where)
  except preprocess.BadImageError as err:
    raise item.damaged(err) from err
  if whole:
    return pixels, Placed(0, pixels.shape[0], pixels.shape[1])
  left, top, right, bottom = item.box
  region = np.ascontiguousarray(pixels[top:bottom, left:right])
  return region, Placed(0, bottom - top, right - left, left, top)


def packed(regions: Sequence[np.ndarray], start: int = 0,
           length: int | None = None) -> tuple[np.ndarray, list[int]]:
  """The regions back to back in one uint8 buffer `length` bytes long (None:
  `resize.bucket` of theirs; regions longer than `length` get `resize.fitted`'s
  length), and each one's offset (plus `start`: where the buffer will begin in the op's
  joined buffer)."""
  sizes = [r.size for r in regions]
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  total = int(offsets[-1])
  flat = np.zeros(resize.bucket(total) if length is None
                  else resize.fitted(total, length), np.uint8)
  for region, offset in zip(regions, offsets):
    flat[offset:offset + region.size] = region.ravel()
  return flat, [start + int(o) for o in offsets[:-1]]


def host_length(num_bytes: int, length: int, after_device_part: bool) -> int:
  """The host part's length: `resize.fitted` to the run's `length`; after a device
  decoder's part (its fallbacks, few or none) MIN_BUCKET where they fit in it, so that a
  batch without fallbacks sends no more. Two programs at most: (length,) alone, or
  (length, MIN_BUCKET) and (length, length) after a device part."""
  if after_device_part and num_bytes <= resize.MIN_BUCKET:
    return resize.MIN_BUCKET
  return resize.fitted(num_bytes, length)


def with_host_part(items: Sequence[Item], placed: dict[int, Placed], device_part, channels: int,
                   device: jax.Device, regions: dict[int, tuple[np.ndarray, Placed]],
                   fallback: bool, length: int | None = None) -> Decoded:
  """A shard's Decoded: the examples a device decoder placed in `device_part` (by index in
  `placed`), and the rest decoded on the host (`regions` where already decoded, else now),
  packed after it (`host_length` of the run's buffer `length`; None: a power of two) and put
  on the device. `fallback`: those are a GPU decoder's failures."""
  rest = [k for k in range(len(items)) if k not in placed]
  for k in rest:
    if k not in regions:
      regions[k] = host_region(items[k], channels)
  start = 0 if device_part is None else int(device_part.shape[0])
  pixels = [regions[k][0] for k in rest]
  size = None
  if length is not None:
    size = host_length(sum(r.size for r in pixels), length, device_part is not None)
  flat, offsets = packed(pixels, start, size)
  out = dict(placed)
  for k, offset in zip(rest, offsets):
    out[k] = dataclasses.replace(regions[k][1], offset=offset)
  host_part = jax.device_put(flat, device)
  parts = (host_part,) if device_part is None else (device_part, host_part)
  return Decoded(parts, tuple(out[k] for k in range(len(items))),
                 len(rest) if fallback else 0)


class HostDecoder:
  """PIL on the host standing in for a GPU decoder (`dataset.decode=device_cpu`): each
  example's box (or whole image) decoded in the reader's threads, packed, and put on the
  device that the op runs on."""

  def __init__(self, channels: int = 3, whole: bool = False):
    del channels  # Every decoder is built from the channels; PIL's decode takes them per call.
    self.whole = whole
    self.name = "device_cpu (PIL on the host standing in for a GPU decoder)"

  def prepare(self, item: Item, channels: int) -> tuple[np.ndarray, Placed]:
    return host_region(item, channels, self.whole)

  def decode(self, items, prepared, channels, device, buffers: Buffers) -> Decoded:
    return with_host_part(items, {}, None, channels, device, dict(enumerate(prepared)),
                          fallback=False, length=buffers.length)

  def layouts(self, length: int) -> tuple[tuple[int, ...], ...]:
    return ((length,),)
