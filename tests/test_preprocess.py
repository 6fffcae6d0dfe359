"""The host stage's JPEG decoding shortcuts against PIL's plain whole-image decode.

A crop decodes a JPEG only down to the last row its resize reads (`Transform._top_rows`);
the expected outputs here are computed independently, by PIL decoding the whole file,
cropping and resizing the box (re-drawn from `example_rng` for training, the centre box by
its closed form for evaluation), and flipping with NumPy. Every image is generated (NumPy
arrays saved as JPEG with PIL), not a photograph.
"""

import io
import math

import numpy as np
from PIL import Image
import pytest

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
              example_id: int) -> np.ndarray:
  """The training transform by hand: PIL's whole decode, the re-drawn box, resize, flip."""
  image = Image.open(io.BytesIO(data)).convert("L" if channels == 1 else "RGB")
  rng = np.random.default_rng([seed, preprocess.RNG_STREAM, epoch, example_id])
  box = preprocess.random_resized_box(rng, *image.size, (0.08, 1.0), (3 / 4, 4 / 3))
  flip = rng.random() < 0.5
  out = np.asarray(image.resize((size, size), Image.BILINEAR, box=box))
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


@pytest.mark.parametrize("name", sorted(_CASES))
@pytest.mark.parametrize("size,channels", [(64, 3), (40, 1)])
def test_a_training_crop_decoded_to_its_last_rows_is_the_whole_decodes(name, size, channels):
  """Bit for bit the same as PIL's whole decode, cropped and resized by hand (reduced-scale
  decoding off here: the next test covers it); most crops of these sizes end high enough to
  be cut short."""
  data = _CASES[name]
  transform = preprocess.Transform(size=size, channels=channels, flip=True, seed=3,
                                   jpeg_draft=False)
  cut = 0
  for example_id in range(24):
    out = transform(data, example_id, 2)
    np.testing.assert_array_equal(out, _expected(data, size, channels, 3, 2, example_id))
    image = Image.open(io.BytesIO(data))
    rng = preprocess.example_rng(3, 2, example_id)
    box = preprocess.random_resized_box(rng, 200, 150, (0.08, 1.0), (3 / 4, 4 / 3))
    cut += transform._top_rows(image, data, box) is not image  # pylint: disable=protected-access
  assert cut >= 12, cut


def test_a_drafted_crop_is_cut_in_the_drafted_rows_and_equals_the_uncut_decode():
  """A 960 x 720 JPEG cropped to 64 px decodes at 1/2, 1/4 or 1/8 scale (`draft`) and is
  cut in that scale's rows: the same output as the same drafted decode in full."""
  data = _jpeg(_generated(720, 960, seed=1), quality=90)
  cut = preprocess.Transform(size=64, channels=3, flip=True, seed=0)
  uncut = preprocess.Transform(size=64, channels=3, flip=True, seed=0, jpeg_rows=False)
  for example_id in range(16):
    np.testing.assert_array_equal(cut(data, example_id, 0), uncut(data, example_id, 0))


def test_an_evaluation_crop_of_a_tall_jpeg_is_cut_and_equals_the_whole_decode():
  """150 x 200 (portrait) JPEG, output 64, fraction 0.875: the centre box of side 131.25 runs
  from row 34.375 to 165.625, so the resize reads 165.625 + 131.25 / 64 (its scale) rows plus
  one of margin: 169 of 200. The output is PIL's whole decode resized over that box."""
  data = _jpeg(_generated(200, 150, seed=2), quality=90)
  transform = preprocess.Transform(size=64, channels=3, eval_fraction=0.875, jpeg_draft=False)
  box = (9.375, 34.375, 140.625, 165.625)
  assert preprocess.center_box(150, 200, 64, 0.875) == box
  image = Image.open(io.BytesIO(data))
  assert transform._rows_needed(image, data, box) == 169  # pylint: disable=protected-access
  assert transform._top_rows(image, data, box).size == (150, 169)  # pylint: disable=protected-access
  whole = Image.open(io.BytesIO(data)).convert("RGB")
  expected = np.asarray(whole.resize((64, 64), Image.BILINEAR, box=box))
  np.testing.assert_array_equal(transform(data, 0, None), expected)
  drafted = preprocess.Transform(size=64, channels=3, eval_fraction=0.875)  # At 1/2 scale.
  np.testing.assert_array_equal(
      drafted(data, 0, None),
      preprocess.Transform(size=64, channels=3, eval_fraction=0.875, jpeg_rows=False)(
          data, 0, None))


def test_the_rows_a_crop_needs_by_hand():
  """200 x 150 JPEG, output 32: a box 64 rows high (scale 2) ending at row 84 reads up to
  84 + 2 (the bilinear support of 1 pixel, times the scale 2), plus a row of margin: 87. A
  box of 16 rows (an upscale, support 1) ending at 50: 52. A box ending at 147: 150 rows,
  the whole image, so no cut. A truncated file (no EOI marker at its end): no cut."""
  data = _CASES["4:2:0"]
  image = Image.open(io.BytesIO(data))
  transform = preprocess.Transform(size=32, channels=3)
  rows = transform._rows_needed  # pylint: disable=protected-access
  assert rows(image, data, (10, 20, 74, 84)) == 87
  assert rows(image, data, (10, 34, 26, 50)) == 52
  assert rows(image, data, (0, 83, 64, 147)) is None
  assert rows(image, data[:-2], (10, 20, 74, 84)) is None
  assert preprocess.Transform(size=32, channels=3, jpeg_rows=False)._rows_needed(  # pylint: disable=protected-access
      image, data, (10, 20, 74, 84)) is None
  assert math.ceil(84 + 64 / 32) + 1 == 87  # The arithmetic above, spelled out.


@pytest.mark.parametrize("damage", ["half", "no EOI", "bad Huffman table"])
def test_a_damaged_jpeg_is_named_for_every_crop_however_high(damage):
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
  transform = preprocess.Transform(size=64, channels=3, seed=0)
  for example_id in range(10):
    with pytest.raises(preprocess.BadImageError, match="bad.jpg"):
      transform(data, example_id, 0, where="bad.jpg")
  if damage == "bad Huffman table":  # Some of those crops tried the cut decode first.
    image = Image.open(io.BytesIO(data))
    boxes = [preprocess.random_resized_box(preprocess.example_rng(0, 0, i), 200, 200,
                                           (0.08, 1.0), (3 / 4, 4 / 3)) for i in range(10)]
    assert any(transform._rows_needed(image, data, box) for box in boxes)  # pylint: disable=protected-access
