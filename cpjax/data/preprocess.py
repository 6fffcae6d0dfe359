"""The host preprocessing stage's ops: decode, random-resized crop, flip, resize + centre crop.

Each op is a function of an example's encoded bytes and, for training, of a NumPy generator
seeded by (seed, epoch, example id) alone (`example_rng`): a resumed, re-sharded or
re-ordered run draws the same crop and flip for the same example in the same epoch.

  training    decode -> a crop box from `TRAIN_CROPS[train_crop]` (a registry; random_resized:
              Szegedy et al. 2015's Inception crop as torchvision's RandomResizedCrop draws
              it, area share in `scale`, aspect ratio log-uniform in `ratio`, ten tries,
              then a centre crop) -> resize to size x size (`resize`) -> flip with p = 1/2
  evaluation  decode -> resize the shorter side to size / eval_fraction and keep the centre
              size x size (one resample of the central box, as flax's ImageNet example's
              `_decode_and_center_crop`); used by evaluation and by scoring passes

The resize (`resize`, config.dataset.resize): "opencv" (the default) crops the box on whole
pixels (`pixel_box`) and resizes it with cv2.resize: bilinear with half-pixel centres
(tf.image.resize's bilinear, not antialiased) when enlarging or shrinking by less than 2x
(`draft` keeps JPEG crops there), area averaging (antialiased) for shrinks of 2x or more;
"pil" is PIL's antialiased bilinear over the exact (possibly fractional) box, the engine
before, kept for comparison. Decoding
is PIL's either way.

The output is a uint8 [size, size, channels] array; normalisation and mixup stay in the
jitted step. Decoding goes by the bytes' content (PIL), not a file's name: greyscale, CMYK,
palette and alpha images become `channels` channels (alpha dropped, as torchvision's
`pil_loader` does). A JPEG whose crop is at least twice the output size is decoded at a
reduced scale (PIL's `draft`, libjpeg's DCT scaling): a pure function of the bytes and the
crop, like the rest. A crop of a whole JPEG (ending in its EOI marker) is decoded only down
to the last row its resize reads (`jpeg_rows`): the same pixels as the whole decode, bit for
bit (for Inception crops of 500 x 375 JPEGs, 86 % of the rows and about 10 % less decoding on
average; for the evaluation crop, the rows above the centre box's bottom); a truncated file is
decoded in full and named, whatever its crop.

With `tf_crop_decode` (off by default: slower than PIL's whole decode in a same-run
measurement on a 2-core machine, benchmarks/RESULTS.md), a training crop of an RGB or
greyscale JPEG (integer box, three output channels, too small a crop for `draft`) is decoded
by TensorFlow's `DecodeAndCropJpeg` (`tf.io.decode_and_crop_jpeg`), which decodes only the
crop window (as flax's ImageNet example does), then resized by the `resize` engine as
above. The crop box and flip are the same draws either way; the pixels differ from PIL's
decode by about one level (the decoders' rounding, and, with "pil", PIL's box resize reading
pixels just outside the box). CMYK/Adobe JPEGs (whose colours TF's
decoder does not convert), PNGs and other formats, one-channel outputs, the evaluation
transform (a fractional box; `draft` covers its large crops) and any file TF rejects stay on
PIL.
"""

from collections.abc import Callable
import dataclasses
import io
import math

import cv2
import numpy as np
from PIL import Image

from cpjax import registry
from cpjax.data import tensorflow_optional
from cpjax.runtime.advised import AdvisedError

RNG_STREAM = 7  # Tag of the preprocessing stream in (seed, tag, epoch, id) seeds.

# OpenCV's own thread pool off (0: each call runs on its calling thread): the host stage's
# workers (processes or threads) already use every core, and the pool would split each small
# resize across threads contending for those cores (on 2 cores: 1.51 against 1.54 ms CPU an
# image with the default pool, within the noise; the pool grows with the cores). Each worker
# process imports this module, so the setting holds there too.
cv2.setNumThreads(0)

# Resize engines (config.dataset.resize): "opencv" resizes the crop's whole-pixel box with
# cv2.resize (`cv2_resized`); "pil" is PIL's antialiased bilinear over the (possibly
# fractional) box, the engine before "opencv".
RESIZE_ENGINES = ("opencv", "pil")
# The shrink factor (box side / output side) from which "opencv" averages areas instead of
# interpolating bilinearly. Below 2, bilinear with half-pixel centres still gives every
# source pixel some weight (at 2 exactly it is the 2 x 2 box average), so its aliasing is
# mild; OpenCV's area averaging at a non-integer factor cost as much CPU as PIL's whole
# antialiased resize in the same-run benchmark (benchmarks/host_stage.py), missing the
# engine's purpose. `draft` keeps JPEG crops under 2x where it applies.
AREA_FROM = 2.0


class BadImageError(AdvisedError, ValueError):
  """An example's bytes are not an image PIL can decode (or cannot be read); the message
  names the example and, raised by the host stage, the way out. `entry`: (split, example
  id) where the source names it (cpjax.data.fingerprint notes it), else None."""
  entry: tuple[str, int] | None = None


def example_rng(seed: int, epoch: int, example_id: int) -> np.random.Generator:
  """The generator of one example's random draws in one epoch: a function of its arguments
  only (not of the batch, the step, the process or the worker that reads it)."""
  return np.random.default_rng([seed, RNG_STREAM, epoch, int(example_id)])


def open_image(data: bytes, where: str) -> Image.Image:
  """PIL's lazy open (format from the content, header only); BadImageError naming `where`."""
  try:
    return Image.open(io.BytesIO(data))
  except Exception as err:  # pylint: disable=broad-except  PIL raises several kinds.
    raise BadImageError(f"{where}: not a readable image ({type(err).__name__}: "
                        f"{str(err)[:200]})") from err


def _converted(image: Image.Image, channels: int, where: str) -> Image.Image:
  """`image` decoded into mode L (1 channel) or RGB (3); BadImageError naming `where`."""
  mode = "L" if channels == 1 else "RGB"
  try:
    if image.mode == mode:
      image.load()  # Decoded in place: `convert` to the same mode would copy the whole image.
      return image
    if image.mode in ("P", "PA", "LA", "RGBA") and mode == "RGB":
      image = image.convert("RGBA")  # Palette transparency resolved before the alpha drop.
    return image.convert(mode)
  except Exception as err:  # pylint: disable=broad-except  Truncated data, bad codecs, ...
    raise BadImageError(f"{where}: cannot be decoded ({type(err).__name__}: "
                        f"{str(err)[:200]})") from err


def decode(data: bytes, channels: int, where: str = "image") -> np.ndarray:
  """The whole image as uint8 [H, W, channels], decoded by content."""
  array = np.asarray(_converted(open_image(data, where), channels, where), np.uint8)
  return array.reshape(array.shape[:2] + (channels,))


Box = tuple[float, float, float, float]  # (left, top, right, bottom) in pixels.


def random_resized_box(rng: np.random.Generator, width: int, height: int,
                       scale: tuple[float, float], ratio: tuple[float, float]) -> Box:
  """Szegedy et al. 2015's Inception crop, as torchvision's RandomResizedCrop.get_params:
  up to ten draws of an area share s ~ U(scale) and an aspect ratio r (log-uniform in
  `ratio`), w = round(sqrt(s A r)), h = round(sqrt(s A / r)), kept when it fits, at a
  uniform offset; otherwise the largest centre crop whose ratio is clamped to `ratio`."""
  area = width * height
  log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
  for _ in range(10):
    target = area * rng.uniform(scale[0], scale[1])
    aspect = math.exp(rng.uniform(*log_ratio))
    w = int(round(math.sqrt(target * aspect)))
    h = int(round(math.sqrt(target / aspect)))
    if 0 < w <= width and 0 < h <= height:
      top = int(rng.integers(0, height - h + 1))
      left = int(rng.integers(0, width - w + 1))
      return (left, top, left + w, top + h)
  in_ratio = width / height
  if in_ratio < ratio[0]:
    w, h = width, int(round(width / ratio[0]))
  elif in_ratio > ratio[1]:
    w, h = int(round(height * ratio[1])), height
  else:
    w, h = width, height
  left, top = (width - w) // 2, (height - h) // 2
  return (left, top, left + w, top + h)


def center_box(width: int, height: int, size: int, eval_fraction: float) -> Box:
  """The central box that, resized to size x size, equals resizing the shorter side to
  size / eval_fraction and keeping the centre size x size."""
  side = min(width, height) * eval_fraction
  return ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)


def pixel_box(box: Box, width: int, height: int) -> tuple[int, int, int, int]:
  """`box` on whole pixels, as the "opencv" engine crops it: each edge rounded to the nearest
  pixel edge (halves up), inside the image, at least one pixel on each side. An integer box
  (every training crop of a JPEG decoded at full scale) is itself; a fractional one (the
  evaluation box, a box scaled by `draft`) moves each edge by at most half a pixel."""
  left = max(0, min(math.floor(box[0] + 0.5), width - 1))
  top = max(0, min(math.floor(box[1] + 0.5), height - 1))
  right = max(left + 1, min(math.floor(box[2] + 0.5), width))
  bottom = max(top + 1, min(math.floor(box[3] + 0.5), height))
  return left, top, right, bottom


def box_pixels(image: Image.Image, box: tuple[int, int, int, int]) -> np.ndarray:
  """uint8 [h, w] (one band) or [h, w, bands]: the whole-pixel `box` of a decoded image, as
  `np.asarray(image.crop(box))` gives it, packed by PIL's raw encoder (what `tobytes` runs)
  straight from the box into one buffer: no cropped copy first, no joining of 64 KB chunks."""
  left, top, right, bottom = box
  bands = len(image.getbands())
  shape = (bottom - top, right - left) + ((bands,) if bands > 1 else ())
  try:
    # PIL's `_getencoder` (private; the encoder `Image.tobytes` runs) over the box alone.
    encoder = Image._getencoder(image.mode, "raw", image.mode)  # pylint: disable=protected-access
    encoder.setimage(image.im, box)
    _, status, data = encoder.encode(math.prod(shape))  # Whole lines fit: one call.
  except (AttributeError, OSError, TypeError, ValueError):  # Another Pillow's internals.
    status = 0
  if status != 1 or len(data) != math.prod(shape):  # 1: the encoder's "done".
    return np.asarray(image.crop(box), np.uint8)  # tests/test_preprocess.py fails if always.
  return np.frombuffer(data, np.uint8).reshape(shape)


def cv2_resized(pixels: np.ndarray, size: int) -> np.ndarray:
  """uint8 [size, size] or [size, size, C]: `pixels` (a crop) resized by OpenCV: area
  averaging (`cv2.INTER_AREA`, antialiased) where both sides shrink and one by `AREA_FROM` or
  more, else bilinear with half-pixel centres (`cv2.INTER_LINEAR`, as `tf.image.resize`'s
  bilinear, not antialiased; an enlarged side has nothing to alias)."""
  height, width = pixels.shape[:2]
  shrinks = width >= size and height >= size
  area = shrinks and max(width, height) >= AREA_FROM * size
  interpolation = cv2.INTER_AREA if area else cv2.INTER_LINEAR
  return cv2.resize(pixels, (size, size), interpolation=interpolation)


@dataclasses.dataclass(frozen=True)
class Transform:
  """The host stage's settings (from config.dataset: `from_config`); call it on an example."""
  size: int  # Output size S (S x S).
  channels: int  # 1 (L) or 3 (RGB).
  train_crop: str = "random_resized"  # A name registered in TRAIN_CROPS.
  scale: tuple[float, float] = (0.08, 1.0)  # random_resized: area share range.
  ratio: tuple[float, float] = (3 / 4, 4 / 3)  # random_resized: aspect-ratio range.
  flip: bool = False  # Training: flip left-right with probability 1/2.
  eval_fraction: float = 0.875  # Evaluation: centre crop S of a shorter side of S / this.
  seed: int = 0  # The run's seed (crop and flip draws: example_rng).
  jpeg_draft: bool = True  # Decode JPEGs at a reduced scale where the crop allows it.
  jpeg_rows: bool = True  # Decode a whole JPEG's rows only down to the crop's last.
  # Training crops of RGB/grey JPEGs: TF decodes the window only. Off by default: on a
  # 2-core machine it was slower than PIL's whole decode (benchmarks/RESULTS.md).
  tf_crop_decode: bool = False
  resize: str = "opencv"  # A RESIZE_ENGINES name: how the crop box becomes size x size.

  def __post_init__(self):
    if self.tf_crop_decode and not tensorflow_optional.installed():
      raise ValueError(tensorflow_optional.missing_message(
          "Transform(tf_crop_decode=True) (TensorFlow's crop-window JPEG decode)") +
          "; or leave tf_crop_decode off: PIL decodes")

  def __call__(self, data: bytes, example_id: int, epoch: int | None,
               where: str = "image") -> np.ndarray:
    """uint8 [S, S, channels] of one example: the training transform of `epoch`, or the
    evaluation transform when `epoch` is None."""
    image = open_image(data, where)
    box, flip = self.box_and_flip(example_id, epoch, *image.size)
    if epoch is not None:
      crop = _tf_crop(data, box) if self._tf_decodable(image, box) else None
      if crop is not None:
        image, box = Image.fromarray(crop), None  # The crop is the whole decoded image.
    if box is not None:
      image, box = self._drafted(image, box)
      image = self._top_rows(image, data, box)
      image = _converted(image, self.channels, where)
    try:
      if self.resize == "pil":
        out = image.resize((self.size, self.size), Image.BILINEAR, box=box)
        if flip:
          out = out.transpose(Image.FLIP_LEFT_RIGHT)
        array = np.asarray(out, np.uint8)
      else:
        whole = (0, 0) + image.size
        pixels = box_pixels(image, whole if box is None else pixel_box(box, *image.size))
        array = cv2_resized(pixels, self.size)
        if flip:  # A view: its consumer's copy (into a batch) does the flip, not a copy here.
          array = array[:, ::-1]
    except Exception as err:  # pylint: disable=broad-except  Truncated data surfaces here.
      raise BadImageError(f"{where}: cannot be decoded ({type(err).__name__}: "
                          f"{str(err)[:200]})") from err
    return array.reshape((self.size, self.size, self.channels))

  def box_and_flip(self, example_id: int, epoch: int | None, width: int,
                   height: int) -> tuple[Box, bool]:
    """One example's crop box (in the pixels of its width x height image) and flip: the
    training crop of `epoch` (TRAIN_CROPS[train_crop]'s box, then the flip, both drawn from
    `example_rng(seed, epoch, example_id)`), or the evaluation's centre box and no flip when
    `epoch` is None. What every decoder of the example crops (cpjax.data.device_stage too)."""
    if epoch is None:
      return center_box(width, height, self.size, self.eval_fraction), False
    rng = example_rng(self.seed, epoch, example_id)
    box = TRAIN_CROPS[self.train_crop].box(rng, width, height, self)
    return box, self.flip and bool(rng.random() < 0.5)  # Drawn after the crop, always.

  def _tf_decodable(self, image: Image.Image, box: Box) -> bool:
    """Whether TF's crop decoder gives this crop: a JPEG PIL reads as RGB or L (not CMYK,
    not an Adobe-transformed file), an integer box, three output channels, and a crop too
    small for PIL's reduced-scale decoding (which is cheaper still where it applies)."""
    return (self.tf_crop_decode and self.channels == 3 and image.format == "JPEG"
            and image.mode in ("RGB", "L") and "adobe" not in image.info
            and all(float(v).is_integer() for v in box) and self._draft_size(image, box) is None)

  def _draft_size(self, image: Image.Image, box: Box) -> tuple[int, int] | None:
    """The smallest decoded size that keeps `box` at least `size` pixels on each side, where
    it is at most half the image (a JPEG DCT scale applies); None otherwise."""
    if not self.jpeg_draft or image.format != "JPEG":
      return None
    width, height = image.size
    box_w, box_h = box[2] - box[0], box[3] - box[1]
    want = (math.ceil(width * self.size / box_w), math.ceil(height * self.size / box_h))
    return None if want[0] * 2 > width or want[1] * 2 > height else want

  def _drafted(self, image: Image.Image, box: Box) -> tuple[Image.Image, Box]:
    """A JPEG set to decode at the smallest DCT scale (1/2, 1/4, 1/8) that keeps the box at
    least `size` pixels on each side, and the box in that scale's pixels."""
    want = self._draft_size(image, box)
    if want is None:
      return image, box  # No reduction is possible: decode in full.
    width, height = image.size
    image.draft("L" if self.channels == 1 else "RGB", want)
    sx, sy = image.size[0] / width, image.size[1] / height
    return image, (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)

  def _rows_needed(self, image: Image.Image, data: bytes, box: Box) -> int | None:
    """How many top rows of `image` the resize of `box` reads, where that is fewer than all
    and the file is a whole baseline or progressive JPEG ending in its EOI marker; None
    otherwise (the whole image is decoded). "pil": the box's bottom plus the bilinear
    filter's support, which widens with the downscale factor, and one row of margin;
    "opencv": the bottom of its `pixel_box` (cv2.resize reads the cropped rows only)."""
    if (not self.jpeg_rows or image.format != "JPEG" or len(image.tile) != 1
        or image.tile[0][0] != "jpeg" or not data.endswith(b"\xff\xd9")):
      return None
    if self.resize == "pil":
      support = max(1.0, (box[3] - box[1]) / self.size)  # Bilinear: 1 pixel, times the scale.
      rows = math.ceil(box[3] + support) + 1
    else:
      rows = pixel_box(box, *image.size)[3]
    return rows if rows < image.size[1] else None

  def _top_rows(self, image: Image.Image, data: bytes, box: Box) -> Image.Image:
    """The JPEG's top rows that the crop's resize reads (`_rows_needed`), decoded
    by PIL's own JPEG decoder, which stops there; `image` itself, to decode in full, where
    that does not apply or the decoder did not reach the last of those rows.

    The rows are the full decode's, bit for bit (libjpeg emits each row the same whatever
    the rows after it), so the resize gives the same output. Only a file that ends in its
    EOI marker is cut short: a truncated file (no EOI) is decoded in full and named, however
    high its crop. PIL's decoder ends a short read with a "too few scanlines" error, the same
    as any other decoder error, so the canvas's last row is filled with a colour first, and a
    last row still all that colour (not decoded) sends the image to the full decode.
    """
    rows = self._rows_needed(image, data, box)
    if rows is None:
      return image
    width = image.size[0]
    bands = len(image.getbands())
    fill = 1 if bands == 1 else tuple(range(1, bands + 1))
    canvas = Image.new(image.mode, (width, rows))
    canvas.paste(fill, (0, rows - 1, width, rows))  # The last row only: filling all costs.
    name, _, offset, args = image.tile[0]
    try:
      # PIL's `_getdecoder` (private; the decoder `ImageFile.load` runs) writes the first
      # `rows` rows of the drafted image into the canvas.
      decoder = Image._getdecoder(image.mode, name, args, image.decoderconfig)  # pylint: disable=protected-access
      try:
        decoder.setimage(canvas.im, (0, 0, width, rows))
        consumed, _ = decoder.decode(memoryview(data)[offset:])
      finally:
        decoder.cleanup()
    except (AttributeError, OSError, TypeError, ValueError):  # Another Pillow's internals.
      return image  # The whole decode (tests/test_preprocess.py fails if this is all it does).
    last = canvas.crop((0, rows - 1, width, rows)).getcolors(1)
    if consumed >= 0 or (last is not None and last[0][1] == fill):
      return image  # Short of data, or stopped early: the full decode names what is wrong.
    return canvas


def _tf_crop(data: bytes, box: Box) -> np.ndarray | None:
  """uint8 [h, w, 3]: the JPEG's integer `box` alone, decoded by TF; None where TF rejects
  the bytes (PIL then decodes them, and names the file if it cannot either)."""
  # TensorFlow is imported on first use: `tf_crop_decode` is off by default, and importing
  # TF costs every run about 2 s and its memory (tfds imports it lazily too).
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  left, top, right, bottom = (int(v) for v in box)
  try:
    # The raw op (tf.io.decode_and_crop_jpeg's kernel) skips the wrapper's Python dispatch,
    # which holds the GIL.
    crop = tf.raw_ops.DecodeAndCropJpeg(contents=data, channels=3,
                                        crop_window=[top, left, bottom - top, right - left])
  except (tf.errors.OpError, ValueError):  # Truncated or unusual files: PIL's turn.
    return None
  return crop.numpy()


def _random_resized(rng: np.random.Generator, width: int, height: int, t: Transform) -> Box:
  return random_resized_box(rng, width, height, t.scale, t.ratio)


def _center(rng: np.random.Generator, width: int, height: int, t: Transform) -> Box:
  del rng  # No random crop: the evaluation crop (flips still random).
  return center_box(width, height, t.size, t.eval_fraction)


@dataclasses.dataclass(frozen=True)
class TrainCrop:
  """A training crop of the host stage (`config.dataset.train_crop`)."""
  name: str
  # (rng, image width, image height, transform) -> the crop box; every random number drawn
  # from `rng` (seeded by seed, epoch and example id: `example_rng`).
  box: Callable[[np.random.Generator, int, int, Transform], Box]
  doc: str  # One line: what it crops.
  settings: tuple[registry.Setting, ...] = ()  # None: crops read config.dataset's fields.


# Training crops by name. A new crop is one function and its registration (a user's module
# too: docs/extending.md#add-a-preprocessing-op).
TRAIN_CROPS: registry.Registry[TrainCrop] = registry.Registry("training crop", "dataset")
TRAIN_CROPS.register(TrainCrop("random_resized", _random_resized,
                               "Inception crop: area share in crop_scale, ratio in crop_ratio"))
TRAIN_CROPS.register(TrainCrop("center", _center,
                               "the evaluation's centre crop (flips still random)"))


def from_config(dataset, image_shape: tuple[int, int, int], seed: int) -> Transform:
  """The Transform of `dataset` (config.dataset) producing `image_shape` (the registered
  spec's), under the run's `seed`."""
  return Transform(size=image_shape[0], channels=image_shape[2],
                   train_crop=dataset.train_crop, scale=tuple(dataset.crop_scale),
                   ratio=tuple(dataset.crop_ratio), flip=dataset.flip,
                   eval_fraction=dataset.eval_crop_fraction, seed=seed,
                   resize=dataset.resize)
