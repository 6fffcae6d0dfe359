"""What the device stage's decoders share: an example as the host prepares it (`Item`), the
packed layout of decoded regions on a device (`Placed`, `Decoded`, `packed`), and PIL's
decode on the host, for the stand-in decoder (`HostDecoder`) and for the files a GPU decoder
cannot read (`host_region`, `with_host_part`).

The layout is cpjax.data.device_resize's input: each example's decoded pixels (its whole
image, or its crop box alone) uint8 [h, w, C] row-major, back to back in 1-D buffers on the
device, with an offset, a (h, w) and the region's origin in the image per example.
"""

from collections.abc import Callable, Sequence
import dataclasses
import functools
from typing import Any, Protocol

import jax
import numpy as np

from cpjax.data import decode_workers, device_resize, preprocess


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


class ImageDecoder(Protocol):
  """How the device stage decodes: `prepare` runs on the host for each example (in the
  reader's threads), `decode` puts a shard's regions on its device."""
  name: str  # What decodes, for the log and the checkpoint (a resume compares it).

  def prepare(self, item: Item, channels: int) -> Any: ...

  def decode(self, items: Sequence[Item], prepared: Sequence[Any], channels: int,
             device: jax.Device) -> Decoded: ...


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


def packed(regions: Sequence[np.ndarray], start: int = 0) -> tuple[np.ndarray, list[int]]:
  """The regions back to back in one uint8 buffer of `device_resize.bucket` length, and each
  one's offset (plus `start`: where the buffer will begin in the op's joined buffer)."""
  sizes = [r.size for r in regions]
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  flat = np.zeros(device_resize.bucket(int(offsets[-1])), np.uint8)
  for region, offset in zip(regions, offsets):
    flat[offset:offset + region.size] = region.ravel()
  return flat, [start + int(o) for o in offsets[:-1]]


def with_host_part(items: Sequence[Item], placed: dict[int, Placed], device_part, channels: int,
                   device: jax.Device, regions: dict[int, tuple[np.ndarray, Placed]],
                   fallback: bool) -> Decoded:
  """A shard's Decoded: the examples a device decoder placed in `device_part` (by index in
  `placed`), and the rest decoded on the host (`regions` where already decoded, else now),
  packed after it and put on the device. `fallback`: those are a GPU decoder's failures."""
  rest = [k for k in range(len(items)) if k not in placed]
  for k in rest:
    if k not in regions:
      regions[k] = host_region(items[k], channels)
  start = 0 if device_part is None else int(device_part.shape[0])
  flat, offsets = packed([regions[k][0] for k in rest], start)
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

  def decode(self, items, prepared, channels, device) -> Decoded:
    return with_host_part(items, {}, None, channels, device, dict(enumerate(prepared)),
                          fallback=False)
