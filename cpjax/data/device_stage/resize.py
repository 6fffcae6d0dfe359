"""The device stage's crop, resize and flip: one jitted op over a batch of decoded regions.

Layout of the input ("packed regions"): each example's decoded pixels, its whole image or its
crop box alone, uint8 [h, w, C] in row-major order, laid back to back in 1-D buffers (`parts`,
read as one buffer in order: a GPU decoder's part, then the part decoded on the host), example
k starting at `offsets[k]`, with its region's (h, w) in `shapes[k]` and its box (left, top,
right, bottom, whole pixels) inside that region in `boxes[k]`. The op reads each example's
pixels by index, so a buffer's length changes nothing but the program: XLA compiles one per
(part lengths, examples, taps), on each device.

Few programs, compiled ahead (the reader's `compile_ahead`): a reader sizes every
buffer of a run alike, `capacity` of its shard's rows times the largest image's bytes (from a
header scan), so one length serves every batch of a size; the taps (`tap_count`, a power of
two) are at most `tap_bound` of the largest image's longest side (`tap_choices`: 2 up to that
bound); `compile_for` compiles one program ahead of its first call. A shard that needs more
(an image larger than the scanned ones) gets `bucket` of its bytes and the taps it needs,
compiled when met.

The op, for an example whose box is n_x x n_y pixels, output S x S, K taps an axis:

  out[i, j, c] = round( sum_a wy[i, a] * sum_b wx[j, b] * P(top + ry[i, a], left + rx[j, b], c) )

with P the region's pixels, rounded half to even and clipped to [0, 255]; a flip reverses j.
The taps (r) and weights (w) of an axis of n source pixels, s = n / S:

  bilinear, half-pixel centres (cv2.INTER_LINEAR, tf.image.resize's bilinear; not
    antialiased): u = (i + 1/2) s - 1/2, x0 = floor(u), f = u - x0 (x0 < 0: x0 = 0, f = 0;
    x0 >= n - 1: x0 = n - 1, f = 0); taps x0 (weight 1 - f) and min(x0 + 1, n - 1) (f)
  area averaging (cv2.INTER_AREA, antialiased): output pixel i covers [i s, (i + 1) s); source
    pixel x weighs |[x, x + 1) & [i s, (i + 1) s)| / s; taps floor(i s) + k, k < K

Area averaging where both sides of the box shrink and one by preprocess.AREA_FROM (2) or more,
bilinear otherwise: the host stage's "opencv" rule (preprocess.cv2_resized), so that the two
stages differ by the decoders and by rounding, not by the filter. The host stage decodes a
JPEG whose box is 2x the output or more at a reduced DCT scale first (PIL's `draft`); this op
always reads the full-resolution pixels. Arithmetic is float32, elementwise (no matrix unit,
whose reduced-precision modes would move results by levels), deterministic for a given
program on a given device.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cpjax.data import preprocess

MIN_BUCKET = 1 << 16  # Bytes: the smallest packed buffer (few programs for small batches).
ENGINE = "opencv"  # The host stage's resize engine (dataset.resize) whose rule the op follows.


def resize_problem(resize: str) -> str | None:
  """None where the op resizes as dataset.resize `resize` does (the 'opencv' engine's rule),
  else why not: the one check of every user of the device stage (config validation,
  dataset.decode=auto, the device stage's reader)."""
  if resize == ENGINE:
    return None
  return (f"resizes on the device as the {ENGINE!r} engine does, not dataset.resize={resize!r}"
          f" (set resize={ENGINE!r})")


def bucket(num_bytes: int) -> int:
  """The packed buffer length for `num_bytes` of pixels: the next power of two (at least
  MIN_BUCKET), so that batches of any image sizes share a few compiled programs."""
  return max(MIN_BUCKET, 1 << max(0, int(num_bytes) - 1).bit_length())


def capacity(num_bytes: int) -> int:
  """A run's packed buffer length for up to `num_bytes` of pixels: `num_bytes` rounded up to a
  multiple of MIN_BUCKET (one length for every batch of a size, so no power-of-two rounding)."""
  return max(MIN_BUCKET, -(-int(num_bytes) // MIN_BUCKET) * MIN_BUCKET)


def fitted(num_bytes: int, length: int) -> int:
  """The buffer length for `num_bytes` of pixels where the run's buffers are `length` long:
  `length` where they fit, else `bucket(num_bytes)` (a shard of images larger than those the
  length was sized for: one more program)."""
  return length if num_bytes <= length else bucket(num_bytes)


def uses_area(widths: np.ndarray, heights: np.ndarray, size: int) -> np.ndarray:
  """bool [n]: whether each box (widths x heights) is area-averaged (else bilinear): both sides
  shrink and one by preprocess.AREA_FROM or more, as preprocess.cv2_resized decides."""
  widths, heights = np.asarray(widths), np.asarray(heights)
  shrinks = (widths >= size) & (heights >= size)
  return shrinks & (np.maximum(widths, heights) >= preprocess.AREA_FROM * size)


def tap_count(widths: np.ndarray, heights: np.ndarray, size: int) -> int:
  """K, the taps an axis that every box of a batch needs (2 for bilinear, ceil(s) + 1 for
  area averaging at scale s), rounded up to a power of two (few compiled programs)."""
  area = uses_area(widths, heights, size)
  longest = np.maximum(np.asarray(widths), np.asarray(heights))
  need = np.where(area, np.ceil(longest / size) + 1, 2) if len(area) else np.array([2])
  return 1 << (int(need.max()) - 1).bit_length()


def tap_bound(longest: int, size: int) -> int:
  """The most taps (`tap_count`) a box inside an image whose sides are at most `longest`
  pixels can need: that of a `longest` x `longest` box (need grows with the box's sides)."""
  return tap_count(np.array([longest]), np.array([longest]), size)


def tap_choices(bound: int) -> tuple[int, ...]:
  """Every tap count `tap_count` can give up to `bound`: the powers of two 2, 4, ..., bound."""
  return tuple(1 << k for k in range(1, max(2, bound).bit_length()))


def _axis(n: jax.Array, area: jax.Array, size: int, taps: int) -> tuple[jax.Array, jax.Array]:
  """(taps int32 [S, K], weights float32 [S, K]) of one axis of n source pixels (module
  docstring); unused taps weigh 0 and point inside [0, n)."""
  n = n.astype(jnp.float32)
  scale = n / size
  i = jnp.arange(size, dtype=jnp.float32)[:, None]
  k = jnp.arange(taps, dtype=jnp.float32)[None, :]
  u = (i + 0.5) * scale - 0.5
  x0 = jnp.floor(u)
  inside = (x0 >= 0) & (x0 < n - 1)
  f = jnp.where(inside, u - x0, 0.0)
  x0 = jnp.clip(x0, 0, n - 1)
  linear_w = jnp.where(k == 0, 1 - f, jnp.where(k == 1, f, 0.0))
  linear_x = jnp.minimum(x0 + k, n - 1)
  start = jnp.floor(i * scale)
  x = start + k
  overlap = jnp.minimum(x + 1, (i + 1) * scale) - jnp.maximum(x, i * scale)
  area_w = jnp.where(x < n, jnp.maximum(overlap, 0.0), 0.0) / scale
  area_x = jnp.minimum(x, n - 1)
  return (jnp.where(area, area_x, linear_x).astype(jnp.int32),
          jnp.where(area, area_w, linear_w))


def _one(flat: jax.Array, offset: jax.Array, shape: jax.Array, box: jax.Array,
         area: jax.Array, flip: jax.Array, size: int, channels: int,
         taps: int) -> jax.Array:
  """float32 [S, S, C]: one example's box resampled (the module docstring's sum), flipped."""
  left, top, right, bottom = box[0], box[1], box[2], box[3]
  ry, wy = _axis(bottom - top, area, size, taps)
  rx, wx = _axis(right - left, area, size, taps)
  rows = (top + ry)[:, :, None, None, None]  # [S, K, 1, 1, 1]
  cols = (left + rx)[None, None, :, :, None]  # [1, 1, S, K, 1]
  index = offset + (rows * shape[1] + cols) * channels + jnp.arange(channels)
  pixels = flat[index].astype(jnp.float32)  # [S, K, S, K, C]
  across = (pixels * wx[None, None, :, :, None]).sum(axis=3)  # [S, K, S, C]
  out = (across * wy[:, :, None, None]).sum(axis=1)  # [S, S, C]
  return jnp.where(flip, out[:, ::-1], out)


@functools.partial(jax.jit, static_argnames=("size", "channels", "taps"))
def crop_resize_flip(parts: tuple[jax.Array, ...], offsets: jax.Array, shapes: jax.Array,
                     boxes: jax.Array, area: jax.Array, flips: jax.Array, *, size: int,
                     channels: int, taps: int) -> jax.Array:
  """uint8 [n, S, S, C]: each example's box resized to size x size and flipped where asked.

  Args:
    parts: 1-D uint8 buffers holding the packed regions, read as one in order.
    offsets: int32 [n], where each example's region starts in that buffer.
    shapes: int32 [n, 2], each region's (height, width).
    boxes: int32 [n, 4], each box's (left, top, right, bottom) inside its region.
    area: bool [n], area averaging (else bilinear): `uses_area` of the boxes.
    flips: bool [n], flip left-right.
    size: S. channels: C. taps: K per axis (`tap_count`).
  """
  flat = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
  one = functools.partial(_one, size=size, channels=channels, taps=taps)
  out = jax.vmap(one, in_axes=(None, 0, 0, 0, 0, 0))(flat, offsets, shapes, boxes, area, flips)
  return jnp.clip(jnp.round(out), 0, 255).astype(jnp.uint8)


def compile_for(device: jax.Device, part_lengths: tuple[int, ...], rows: int, size: int,
                channels: int, taps: int) -> None:
  """Compiles `crop_resize_flip` for `rows` examples packed in parts of `part_lengths` bytes on
  `device` (its arguments as the device stage puts them there), ahead of its first call: that
  call then finds the program compiled (jit's cache; nothing runs here)."""
  on = jax.sharding.SingleDeviceSharding(device)

  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=on)

  crop_resize_flip.lower(
      tuple(spec((n,), jnp.uint8) for n in part_lengths), spec((rows,), jnp.int32),
      spec((rows, 2), jnp.int32), spec((rows, 4), jnp.int32), spec((rows,), jnp.bool_),
      spec((rows,), jnp.bool_), size=size, channels=channels, taps=taps).compile()
