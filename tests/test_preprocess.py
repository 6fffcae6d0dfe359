"""The host stage's JPEG decoding shortcuts against PIL's plain whole-image decode, and its
OpenCV resize against NumPy references.

A crop decodes a JPEG only down to the last row its resize reads (`Transform._top_rows`);
the expected outputs here are computed independently, by PIL decoding the whole file,
cropping and resizing the box (re-drawn from `example_rng` for training, the centre box by
its closed form for evaluation), and flipping with NumPy. The "opencv" engine's resize is
checked against bilinear interpolation with half-pixel centres and block averaging written
in NumPy. Every image is generated (NumPy arrays, some saved as JPEG with PIL), not a
photograph.
"""

import io
import math

import numpy as np
from PIL import Image
import pytest

from configs import default as default_config
from cpjax.data import preprocess


def _jpeg(array: np.ndarray, mode: str = "RGB", **options) -> bytes:
  buffer = io.BytesIO()
  Image.fromarray(array).convert(mode).save(buffer, format="JPEG", **options)
  return buffer.getvalue()


def _generated(height: int, width: int, seed: int = 0) -> np.ndarray:
  """A smooth random colour field plus noise (compresses like a photograph; generated)."""
  rng = np.random.default_rng(seed)
  low = Image.fromarray(rng.integers(0, 256, (6, 8, 3), np.uint8))
  smooth = np.asarray(low.resize((width, height), Image.BICUBIC), np.int16)
  return np.clip(smooth + rng.integers(-10, 11, (height, width, 3)), 0, 255).astype(np.uint8)


def _expected(data: bytes, size: int, channels: int, seed: int, epoch: int,
              example_id: int, resize: str = "pil") -> np.ndarray:
  """The training transform by hand: PIL's whole decode, the re-drawn box, resize (PIL's, or
  the whole decode's NumPy crop resized by `cv2_resized`), flip."""
  image = Image.open(io.BytesIO(data)).convert("L" if channels == 1 else "RGB")
  rng = np.random.default_rng([seed, preprocess.RNG_STREAM, epoch, example_id])
  box = preprocess.random_resized_box(rng, *image.size, (0.08, 1.0), (3 / 4, 4 / 3))
  flip = rng.random() < 0.5
  if resize == "pil":
    out = np.asarray(image.resize((size, size), Image.BILINEAR, box=box))
  else:
    left, top, right, bottom = box  # Integer: no draft here.
    out = preprocess.cv2_resized(np.asarray(image)[top:bottom, left:right], size)
  out = out.reshape(size, size, channels)
  return out[:, ::-1] if flip else out


_SMALL = _generated(150, 200)
_CASES = {  # JPEG layouts whose rows libjpeg emits differently (chroma context, passes).
    "4:2:0": _jpeg(_SMALL, quality=90),
    "4:4:4": _jpeg(_SMALL, quality=90, subsampling=0),
    "progressive": _jpeg(_SMALL, quality=90, progressive=True),
    "restart markers": _jpeg(_SMALL, quality=90, restart_marker_blocks=2),
    "grey": _jpeg(_SMALL, "L", quality=90),
}


@pytest.mark.parametrize("resize", preprocess.RESIZE_ENGINES)
@pytest.mark.parametrize("name", sorted(_CASES))
@pytest.mark.parametrize("size,channels", [(64, 3), (40, 1)])
def test_a_training_crop_decoded_to_its_last_rows_is_the_whole_decodes(name, size, channels,
                                                                       resize):
  """Bit for bit the same as PIL's whole decode, cropped and resized by hand (reduced-scale
  decoding off here: the next test covers it); most crops of these sizes end high enough to
  be cut short. With "pil", this is also the output of the host stage before "opencv"."""
  data = _CASES[name]
  transform = preprocess.Transform(size=size, channels=channels, flip=True, seed=3,
                                   jpeg_draft=False, resize=resize)
  cut = 0
  for example_id in range(24):
    out = transform(data, example_id, 2)
    np.testing.assert_array_equal(out, _expected(data, size, channels, 3, 2, example_id,
                                                 resize))
    image = Image.open(io.BytesIO(data))
    rng = preprocess.example_rng(3, 2, example_id)
    box = preprocess.random_resized_box(rng, 200, 150, (0.08, 1.0), (3 / 4, 4 / 3))
    cut += transform._top_rows(image, data, box) is not image  # pylint: disable=protected-access
  assert cut >= 12, cut


@pytest.mark.parametrize("resize", preprocess.RESIZE_ENGINES)
def test_a_drafted_crop_is_cut_in_the_drafted_rows_and_equals_the_uncut_decode(resize):
  """A 960 x 720 JPEG cropped to 64 px decodes at 1/2, 1/4 or 1/8 scale (`draft`) and is
  cut in that scale's rows: the same output as the same drafted decode in full."""
  data = _jpeg(_generated(720, 960, seed=1), quality=90)
  cut = preprocess.Transform(size=64, channels=3, flip=True, seed=0, resize=resize)
  uncut = preprocess.Transform(size=64, channels=3, flip=True, seed=0, jpeg_rows=False,
                               resize=resize)
  for example_id in range(16):
    np.testing.assert_array_equal(cut(data, example_id, 0), uncut(data, example_id, 0))


def test_an_evaluation_crop_of_a_tall_jpeg_is_cut_and_equals_the_whole_decode():
  """150 x 200 (portrait) JPEG, output 64, fraction 0.875: the centre box of side 131.25 runs
  from row 34.375 to 165.625, so the resize reads 165.625 + 131.25 / 64 (its scale) rows plus
  one of margin: 169 of 200. The output is PIL's whole decode resized over that box."""
  data = _jpeg(_generated(200, 150, seed=2), quality=90)
  transform = preprocess.Transform(size=64, channels=3, eval_fraction=0.875, jpeg_draft=False,
                                   resize="pil")
  box = (9.375, 34.375, 140.625, 165.625)
  assert preprocess.center_box(150, 200, 64, 0.875) == box
  image = Image.open(io.BytesIO(data))
  assert transform._rows_needed(image, data, box) == 169  # pylint: disable=protected-access
  assert transform._top_rows(image, data, box).size == (150, 169)  # pylint: disable=protected-access
  whole = Image.open(io.BytesIO(data)).convert("RGB")
  expected = np.asarray(whole.resize((64, 64), Image.BILINEAR, box=box))
  np.testing.assert_array_equal(transform(data, 0, None), expected)
  # "opencv" crops the box rounded to whole pixels, (9, 34, 141, 166): 166 rows are read.
  opencv = preprocess.Transform(size=64, channels=3, eval_fraction=0.875, jpeg_draft=False)
  assert opencv._rows_needed(image, data, box) == 166  # pylint: disable=protected-access
  expected = preprocess.cv2_resized(np.asarray(whole)[34:166, 9:141], 64)
  np.testing.assert_array_equal(opencv(data, 0, None), expected)
  for resize in preprocess.RESIZE_ENGINES:  # At 1/2 scale.
    drafted = preprocess.Transform(size=64, channels=3, eval_fraction=0.875, resize=resize)
    np.testing.assert_array_equal(
        drafted(data, 0, None),
        preprocess.Transform(size=64, channels=3, eval_fraction=0.875, jpeg_rows=False,
                             resize=resize)(data, 0, None))


def test_the_rows_a_crop_needs_by_hand():
  """200 x 150 JPEG, output 32: a box 64 rows high (scale 2) ending at row 84 reads up to
  84 + 2 (the bilinear support of 1 pixel, times the scale 2), plus a row of margin: 87. A
  box of 16 rows (an upscale, support 1) ending at 50: 52. A box ending at 147: 150 rows,
  the whole image, so no cut. A truncated file (no EOI marker at its end): no cut. That is
  "pil"'s resize; "opencv" reads the rows of the box rounded to whole pixels only: 84, 50,
  147 (a cut) and 148 for a box ending at 147.5."""
  data = _CASES["4:2:0"]
  image = Image.open(io.BytesIO(data))
  transform = preprocess.Transform(size=32, channels=3, resize="pil")
  rows = transform._rows_needed  # pylint: disable=protected-access
  assert rows(image, data, (10, 20, 74, 84)) == 87
  assert rows(image, data, (10, 34, 26, 50)) == 52
  assert rows(image, data, (0, 83, 64, 147)) is None
  assert rows(image, data[:-2], (10, 20, 74, 84)) is None
  assert preprocess.Transform(size=32, channels=3, jpeg_rows=False)._rows_needed(  # pylint: disable=protected-access
      image, data, (10, 20, 74, 84)) is None
  assert math.ceil(84 + 64 / 32) + 1 == 87  # The arithmetic above, spelled out.
  rows = preprocess.Transform(size=32, channels=3)._rows_needed  # pylint: disable=protected-access
  assert [rows(image, data, box) for box in [(10, 20, 74, 84), (10, 34, 26, 50),
                                             (0, 83, 64, 147), (0, 83.5, 64, 147.5)]] == [
                                                 84, 50, 147, 148]
  assert rows(image, data[:-2], (10, 20, 74, 84)) is None


@pytest.mark.parametrize("resize", preprocess.RESIZE_ENGINES)
@pytest.mark.parametrize("damage", ["half", "no EOI", "bad Huffman table"])
def test_a_damaged_jpeg_is_named_for_every_crop_however_high(damage, resize):
  """A crop above the damage is not kept: a truncated file (half of it, or all but its EOI
  marker) is decoded in full and named; a Huffman table that libjpeg rejects stops the cut
  decode before its last row, so the full decode runs and names the file."""
  data = _jpeg(np.random.default_rng(4).integers(0, 256, (200, 200, 3), np.uint8))
  if damage == "half":
    data = data[:len(data) // 2]
  elif damage == "no EOI":
    data = data[:-2]
  else:
    at = data.index(b"\xff\xc4") + 5  # The 16 code-length counts of the first DHT table.
    data = data[:at] + bytes([255] * 16) + data[at + 16:]
  transform = preprocess.Transform(size=64, channels=3, seed=0, resize=resize)
  for example_id in range(10):
    with pytest.raises(preprocess.BadImageError, match="bad.jpg"):
      transform(data, example_id, 0, where="bad.jpg")
  if damage == "bad Huffman table":  # Some of those crops tried the cut decode first.
    image = Image.open(io.BytesIO(data))
    boxes = [preprocess.random_resized_box(preprocess.example_rng(0, 0, i), 200, 200,
                                           (0.08, 1.0), (3 / 4, 4 / 3)) for i in range(10)]
    assert any(transform._rows_needed(image, data, box) for box in boxes)  # pylint: disable=protected-access


def _bilinear(pixels: np.ndarray, size: int) -> np.ndarray:
  """NumPy reference: bilinear resize to size x size with half-pixel centres (output pixel i
  samples the input at (i + 0.5) * in / out - 0.5, clamped to the edge pixels), as
  tf.image.resize(method="bilinear", antialias=False); rounded to uint8."""
  out = pixels.astype(np.float64)
  for axis in (0, 1):
    n = pixels.shape[axis]
    at = np.clip((np.arange(size) + 0.5) * n / size - 0.5, 0, n - 1)
    low = np.floor(at).astype(int)
    high = np.minimum(low + 1, n - 1)
    weight = (at - low).reshape((-1, 1, 1) if axis == 0 else (1, -1, 1))
    out = (np.take(out, low, axis) * (1 - weight) + np.take(out, high, axis) * weight)
  return np.round(out).astype(np.uint8)


def _block_mean(pixels: np.ndarray, fy: int, fx: int) -> np.ndarray:
  """NumPy reference: the mean of each fy x fx block (area averaging at integer factors)."""
  h, w, c = pixels.shape
  blocks = pixels.reshape(h // fy, fy, w // fx, fx, c).astype(np.float64)
  return np.round(blocks.mean(axis=(1, 3))).astype(np.uint8)


@pytest.mark.parametrize("shape", [(23, 37), (64, 48), (100, 90), (120, 60)])
def test_opencv_bilinear_below_twice_the_output_matches_numpy_half_pixel_bilinear(shape):
  """Generated noise enlarged (23 x 37, 64 x 48 -> 64), shrunk by less than 2x (100 x 90 ->
  64) or mixed (120 x 60: one side shrinks by 1.9, one enlarges): bilinear with half-pixel
  centres, within one uint8 level (OpenCV's 11-bit fixed-point weights)."""
  pixels = np.random.default_rng(5).integers(0, 256, shape + (3,), np.uint8)
  out = preprocess.cv2_resized(pixels, 64)
  assert out.shape == (64, 64, 3) and out.dtype == np.uint8
  diff = np.abs(out.astype(int) - _bilinear(pixels, 64).astype(int))
  assert diff.max() <= 1, diff.max()


@pytest.mark.parametrize("fy,fx", [(2, 2), (3, 2), (4, 4)])
def test_opencv_shrinking_by_twice_or_more_averages_areas(fy, fx):
  """Generated noise shrunk by integer factors of 2 or more (either side): each output pixel
  is its block's mean, within one uint8 level; bilinear would differ by tens of levels on
  noise at 3x and 4x (it reads 2 x 2 of each block's pixels)."""
  pixels = np.random.default_rng(6).integers(0, 256, (32 * fy, 32 * fx, 3), np.uint8)
  out = preprocess.cv2_resized(pixels, 32)
  diff = np.abs(out.astype(int) - _block_mean(pixels, fy, fx).astype(int))
  assert diff.max() <= 1, diff.max()
  grey = pixels[..., :1]  # One channel: OpenCV drops the axis, the Transform restores it.
  assert preprocess.cv2_resized(grey, 32).shape == (32, 32)


def test_pixel_box_rounds_each_edge_to_the_nearest_pixel_edge():
  """Halves up, clamped inside the image, at least one pixel; integer boxes unchanged."""
  assert preprocess.pixel_box((9.375, 34.375, 140.625, 165.625), 150, 200) == (9, 34, 141, 166)
  assert preprocess.pixel_box((0.5, 1.5, 2.49, 3.51), 10, 10) == (1, 2, 2, 4)
  assert preprocess.pixel_box((3, 4, 50, 60), 100, 100) == (3, 4, 50, 60)
  assert preprocess.pixel_box((-0.2, 0, 10.7, 10.2), 10, 10) == (0, 0, 10, 10)
  assert preprocess.pixel_box((4.4, 4.4, 4.45, 4.45), 10, 10) == (4, 4, 5, 5)


@pytest.mark.parametrize("mode,bands", [("RGB", 3), ("L", 1)])
def test_a_box_packed_by_pils_encoder_is_pils_crop(mode, bands, monkeypatch):
  """`box_pixels` against PIL's own crop and array conversion, for boxes at every edge and
  of one pixel; it packs the box without cropping (the crop path is never taken)."""
  shape = (37, 53) + ((bands,) if bands > 1 else ())
  image = Image.fromarray(np.random.default_rng(3).integers(0, 256, shape, np.uint8), mode)
  boxes = [(0, 0, 53, 37), (3, 5, 40, 30), (52, 36, 53, 37), (0, 10, 1, 11), (10, 0, 53, 1)]
  expected = [np.asarray(image.crop(box), np.uint8) for box in boxes]
  monkeypatch.setattr(Image.Image, "crop", None)  # Any fallback to crop fails here.
  for box, want in zip(boxes, expected):
    got = preprocess.box_pixels(image, box)
    assert got.shape == want.shape and got.dtype == np.uint8
    np.testing.assert_array_equal(got, want)


def test_the_opencv_crops_are_a_function_of_seed_epoch_and_id():
  """The same (seed, epoch, id) gives the same pixels from two Transforms and in any call
  order; another id or epoch gives another crop; and the box is the draw "pil" uses (the
  same flip too: "pil"'s output is within a few levels of "opencv"'s on a smooth image)."""
  data = _jpeg(_generated(375, 500, seed=7), quality=90)
  a = preprocess.Transform(size=64, channels=3, flip=True, seed=11)
  b = preprocess.Transform(size=64, channels=3, flip=True, seed=11)
  pil = preprocess.Transform(size=64, channels=3, flip=True, seed=11, resize="pil")
  first = [a(data, i, 1) for i in range(6)]
  for i in reversed(range(6)):
    np.testing.assert_array_equal(b(data, i, 1), first[i])
  for i in range(5):
    assert not np.array_equal(first[i], first[i + 1])
    assert not np.array_equal(first[i], a(data, i, 2))
  for i in range(6):  # Same box and flip: the engines differ by resampling alone.
    diff = np.abs(first[i].astype(int) - pil(data, i, 1).astype(int))
    assert np.mean(diff) < 3, (i, np.mean(diff))


def test_the_resize_field_reaches_the_transform():
  """config.dataset.resize (default "opencv") is the Transform's engine."""
  config = default_config.get_config()
  assert config.dataset.resize == "opencv"
  assert preprocess.from_config(config.dataset, (32, 32, 3), 0).resize == "opencv"
  config.dataset.resize = "pil"
  assert preprocess.from_config(config.dataset, (32, 32, 3), 0).resize == "pil"
