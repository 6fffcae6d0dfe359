"""The device stage (dataset.decode): its resize against independent references, its boxes
and pixels against the host stage's, its sharding on 8 CPU devices, bad files, fallbacks from
a GPU decoder to PIL, and the config's checks.

No GPU here: the stage runs with PIL on the host standing in for the GPU's decoder
(`HostDecoder`, dataset.decode=device_cpu), through the same batching, boxes, device op and
sharding; a fake GPU decoder that refuses some files exercises the fallback; nvImageCodec's
own calls run on its CPU backend where the library is installed (skipped otherwise). Every
image is generated.
"""

import logging
import math
import os
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest

from cpjax.config import validation
from cpjax.data import (
  host_stage,
  image_stats,
  preprocess,
  sources,
)
from cpjax.data.device_stage import decoders, nvimgcodec, packed_regions, resize
from cpjax.data.device_stage.reader import DeviceStageReader
from cpjax.runtime import sharding
from cpjax.training import setup
from tests import helpers
from tests.test_host_stage import _dataset


def _smooth(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
  """A generated photo-like image: a random 4 x 4 colour field resized bicubically, noise."""
  low = rng.integers(0, 256, (4, 4, 3), np.uint8)
  image = np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), np.int16)
  return np.clip(image + rng.integers(-6, 7, image.shape), 0, 255).astype(np.uint8)


@pytest.fixture(name="folder", scope="module")
def _folder(tmp_path_factory) -> str:
  """3 classes x 8 train images (PNG, RGB JPEG, greyscale JPEG, CMYK JPEG; 20-90 px a side),
  2 test images each."""
  rng = np.random.default_rng(5)
  root = tmp_path_factory.mktemp("device_stage") / "images"
  for split, count in (("train", 8), ("test", 2)):
    for name in ("ant", "bee", "cat"):
      os.makedirs(root / split / name)
      for i in range(count):
        h, w = (int(v) for v in rng.integers(20, 90, 2))
        image = Image.fromarray(_smooth(rng, h, w))
        fmt, mode = (("PNG", "RGB"), ("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"))[i % 4]
        image.convert(mode).save(root / split / name / f"img{i}.{fmt.lower()}", format=fmt,
                                 **({"quality": 90} if fmt == "JPEG" else {}))
  return str(root)


def _source_and_transform(folder: str, seed: int = 3, **transform):
  dataset = _dataset(folder)
  spec = sources.resolve(dataset)
  source = sources.open_splits(dataset)["train"]
  return source, preprocess.Transform(**{"size": spec.image_shape[0], "channels":
                                         spec.image_shape[2], "flip": True, "seed": seed,
                                         **transform})


def _host(images) -> np.ndarray:
  return np.stack([np.asarray(b["image"]) for b in images])


# ---------------------------------------------------------------- the resize op


def _reference_axis(n: int, size: int, area: bool) -> np.ndarray:
  """float64 [S, n]: one axis's resampling matrix, each output pixel's row written from the
  formula for that pixel alone (the op builds all rows at once, as taps)."""
  out = np.zeros((size, n))
  s = n / size
  for i in range(size):
    if area:  # Output pixel i averages the source interval [i s, (i + 1) s).
      for x in range(math.floor(i * s), min(n, math.ceil((i + 1) * s))):
        out[i, x] = max(0.0, min(x + 1, (i + 1) * s) - max(x, i * s)) / s
    else:  # Bilinear, half-pixel centres, the edge pixel repeated.
      u = min(max((i + 0.5) * s - 0.5, 0.0), n - 1.0)
      x0 = min(math.floor(u), n - 1)
      out[i, x0] += 1 - (u - x0)
      out[i, min(x0 + 1, n - 1)] += u - x0
  return out


def _reference(pixels: np.ndarray, box, size: int, area: bool) -> np.ndarray:
  left, top, right, bottom = box
  crop = pixels[top:bottom, left:right].astype(np.float64)
  out = np.einsum("iy,yxc,jx->ijc", _reference_axis(bottom - top, size, area), crop,
                  _reference_axis(right - left, size, area))
  return np.clip(np.round(out), 0, 255).astype(np.uint8)


def _random_cases(seed: int, count: int, size: int):
  """(image, box) pairs: images 5-120 px a side, boxes anywhere in them (shrinks of up to
  7x, enlargements, thin boxes)."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    h, w = (int(v) for v in rng.integers(5, 120, 2))
    image = rng.integers(0, 256, (h, w, 3), np.uint8)
    left, top = int(rng.integers(0, w - 1)), int(rng.integers(0, h - 1))
    yield image, (left, top, int(rng.integers(left + 1, w + 1)),
                  int(rng.integers(top + 1, h + 1)))


def _op(cases, size: int, flips=None) -> np.ndarray:
  """The op over `cases` as one batch, packed with the stage's own packing."""
  images, boxes = zip(*cases)
  flat, offsets = packed_regions.packed(images)
  boxes = np.asarray(boxes, np.int32)
  widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
  return np.asarray(resize.crop_resize_flip(
      (jnp.asarray(flat),), jnp.asarray(offsets, jnp.int32),
      jnp.asarray([i.shape[:2] for i in images], jnp.int32), jnp.asarray(boxes),
      jnp.asarray(resize.uses_area(widths, heights, size)),
      jnp.asarray(np.zeros(len(images), bool) if flips is None else flips),
      size=size, channels=3, taps=resize.tap_count(widths, heights, size)))


def test_the_resize_matches_a_numpy_reference_written_from_the_formulas():
  """60 random boxes in one batch (bilinear and area averaging, K up to 8 taps) against a
  float64 NumPy second implementation: the same pixels up to float32's rounding of ties."""
  cases = list(_random_cases(0, 60, 16))
  out = _op(cases, 16)
  for (image, box), got in zip(cases, out):
    width, height = box[2] - box[0], box[3] - box[1]
    expected = _reference(image, box, 16, bool(resize.uses_area(width, height, 16)))
    diff = np.abs(got.astype(int) - expected)
    assert diff.max() <= 1 and (diff == 0).mean() > 0.999, (box, diff.max())


def test_the_resize_is_within_one_level_of_opencv_on_the_cropped_box():
  """OpenCV resizing the cropped box (INTER_LINEAR, INTER_AREA by the host stage's rule,
  preprocess.cv2_resized), 8-bit fixed point: within one level of the op, pixel by pixel."""
  cases = list(_random_cases(1, 40, 12))
  for (image, box), got in zip(cases, _op(cases, 12)):
    left, top, right, bottom = box
    expected = preprocess.cv2_resized(np.ascontiguousarray(image[top:bottom, left:right]), 12)
    assert np.abs(got.astype(int) - expected.reshape(got.shape)).max() <= 1, box


def test_a_flip_reverses_the_columns_and_only_the_flipped_examples():
  cases = list(_random_cases(2, 6, 10))
  flips = np.array([True, False, True, False, False, True])
  plain, flipped = _op(cases, 10), _op(cases, 10, flips)
  np.testing.assert_array_equal(flipped[flips], plain[flips][:, :, ::-1])
  np.testing.assert_array_equal(flipped[~flips], plain[~flips])


def test_tap_count_and_bucket_by_hand():
  # 16 px out: a 20-px box enlarges or shrinks < 2x (bilinear, 2 taps); 40 x 40 shrinks 2.5x
  # (area: ceil(2.5) + 1 = 4 taps); 100 x 40 shrinks 6.25x on its long side (8 taps).
  assert resize.tap_count(np.array([20]), np.array([10]), 16) == 2
  assert resize.tap_count(np.array([20, 40]), np.array([20, 40]), 16) == 4
  assert resize.tap_count(np.array([100]), np.array([40]), 16) == 8
  # Area needs both sides at least S: a 100 x 10 box is bilinear (the host stage's rule).
  assert not resize.uses_area(100, 10, 16) and resize.uses_area(32, 16, 16)
  assert resize.bucket(1) == resize.MIN_BUCKET
  assert resize.bucket(3 * 2**20) == 4 * 2**20 and resize.bucket(2**22) == 2**22


def test_buffer_lengths_and_tap_bounds_by_hand():
  # One length a run: multiples of 64 KiB. 2 rows of 100 x 80 x 3 (48,000 bytes): 1 x 64 KiB;
  # 3 rows (72,000): 2 x 64 KiB; pixels past the run's length get the next power of two.
  assert resize.capacity(2 * 24_000) == 65_536
  assert resize.capacity(3 * 24_000) == 131_072
  assert resize.fitted(72_000, 131_072) == 131_072
  assert resize.fitted(200_000, 131_072) == 262_144
  # 16 px out: sides under 32 px never area-average (2 taps); 48 px shrink 3x (3 + 1 -> 4);
  # 89 px 5.6x (6 + 1 -> 8); 2, 4, ..., the bound are the counts a smaller box can need.
  assert resize.tap_bound(31, 16) == 2
  assert resize.tap_bound(48, 16) == 4 and resize.tap_bound(89, 16) == 8
  assert resize.tap_choices(8) == (2, 4, 8) and resize.tap_choices(2) == (2,)
  sides = np.arange(1, 90)  # Every box of an 89 x 89 image needs at most its bound.
  widths, heights = (a.ravel() for a in np.meshgrid(sides, sides))
  assert resize.tap_count(widths, heights, 16) == resize.tap_bound(89, 16)


class _Guard:
  """Stands for a device op's output: logs the wait for it."""

  def __init__(self, log: list, name: str):
    self.log, self.name = log, name

  def block_until_ready(self):
    self.log.append(self.name)


def test_device_buffers_are_reused_in_turn_once_the_op_that_read_them_is_done():
  log = []
  ring = packed_regions.DeviceBuffers(8, 2, jax.devices()[0])
  first, release = ring.take()
  release(_Guard(log, "op 1"))
  second, release = ring.take()
  release(_Guard(log, "op 2"))
  assert first is not second and log == []  # Nothing waited for: fresh buffers.
  again, release_again = ring.take()
  assert again is first and log == ["op 1"]  # The op that read it has finished first.
  release_again(None)  # Read by no op (a failed decode): free at once.
  busy, release_busy = ring.take()
  assert busy is second and log == ["op 1", "op 2"]
  taken, _ = ring.take()  # The first buffer again; now both are taken, neither released.
  assert taken is first and log == ["op 1", "op 2"]
  got = []
  waiting = threading.Thread(target=lambda: got.append(ring.take()))
  waiting.start()
  waiting.join(0.3)
  assert waiting.is_alive() and not got  # A taken buffer is not given out twice.
  release_busy(_Guard(log, "op 4"))
  waiting.join(10)
  assert got[0][0] is second and log == ["op 1", "op 2", "op 4"]


class _Compiles:
  """Backend compiles of the device op from construction until `close` (jax.monitoring)."""

  def __init__(self):
    self.count = 0
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event, duration, **kwargs):
    del duration
    if (event == "/jax/core/compile/backend_compile_duration"
        and kwargs.get("fun_name") == "jit(crop_resize_flip)"):
      self.count += 1

  def close(self):
    jax.monitoring.unregister_event_duration_listener(self._on)


def test_a_pass_over_images_of_several_sizes_compiles_nothing_after_compile_ahead(folder):
  """Training epochs and an evaluation pass over 20-90 px images, 2 devices, output 24 px:
  compile_ahead compiles the device op's programs (one buffer length; taps 2, 4, 8: the
  89 px side's bound, found here from the files themselves) before the first batch, and the
  passes compile none."""
  source, transform = _source_and_transform(folder, size=24)
  longest = 0
  for row in range(len(source)):
    with Image.open(source.where(row)) as image:
      longest = max(longest, *image.size)
  bound = 2  # By hand: ceil(side / 24) + 1 taps, to a power of two, where it area-averages.
  if longest >= 2 * 24:
    bound = 1 << (math.ceil(longest / 24)).bit_length()
  mesh = sharding.create_mesh(jax.devices()[:2])
  reader = DeviceStageReader(source, transform, mesh, packed_regions.HostDecoder(),
                                          num_threads=2)
  compiles = _Compiles()
  try:
    ahead = reader.compile_ahead(4, training=True) + reader.compile_ahead(4, training=False)
    compiled_ahead = compiles.count
    blocks = np.random.default_rng(0).permutation(len(source))[:16].reshape(4, 4)
    for epoch in (0, 1, None):
      for batch in reader.batches(blocks, epoch=epoch):
        batch["image"].block_until_ready()
  finally:
    compiles.close()
  assert longest > 48 and bound >= 4
  taps = [2 ** k for k in range(1, bound.bit_length())]
  # One length and one layout (the stand-in's one part), each tap count, on each device.
  assert sorted(p[3] for p in ahead) == sorted(taps * 2)
  assert len({p[1] for p in ahead}) == 1 and {p[0] for p in ahead} == {0, 1}
  assert compiled_ahead <= len(ahead)  # Fewer where another test compiled one already.
  assert compiles.count == compiled_ahead  # The passes compiled nothing.
  assert reader.compile_ahead(4) == []  # Asked again: nothing more.


def test_images_larger_than_the_scanned_ones_are_still_resized_and_said(folder, monkeypatch,
                                                                         caplog):
  """A header scan that saw the smallest image only: the shards of larger ones get a longer
  buffer or more taps, compiled when met with a warning, and the same batches as after a
  scan of every row."""
  source, transform = _source_and_transform(folder)
  mesh = sharding.create_mesh(jax.devices()[:1])
  blocks = np.arange(16).reshape(4, 4)
  scanned = DeviceStageReader(source, transform, mesh,
                                           packed_regions.HostDecoder())
  full = _host(scanned.batches(blocks, epoch=1))
  pixels = []
  for row in range(len(source)):
    with Image.open(source.where(row)) as image:
      pixels.append(image.size[0] * image.size[1])
  monkeypatch.setattr(image_stats, "sample_rows",
                      lambda num_rows, sample: np.array([int(np.argmin(pixels))]))
  reader = DeviceStageReader(source, transform, mesh, packed_regions.HostDecoder())
  reader.compile_ahead(4)
  assert reader.largest().pixels == min(pixels) < scanned.largest().pixels == max(pixels)
  with caplog.at_level(logging.WARNING):
    np.testing.assert_array_equal(_host(reader.batches(blocks, epoch=1)), full)
  assert "beyond those compiled ahead" in caplog.text
  assert "larger than the largest of the 1 headers scanned" in caplog.text


class _SlowDecoder(packed_regions.HostDecoder):
  """The stand-in decoder taking `seconds` more a shard: the time a GPU decode takes."""

  def __init__(self, seconds: float):
    super().__init__()
    self.seconds = seconds

  def decode(self, items, prepared, channels, device, buffers):
    time.sleep(self.seconds)
    return super().decode(items, prepared, channels, device, buffers)


def _fed_seconds(reader, blocks: np.ndarray, step_seconds: float) -> float:
  """Seconds to take the training batches of `blocks`, each followed by a stand-in step (its
  images waited for, then `step_seconds` of sleep)."""
  start = time.perf_counter()
  for batch in reader.batches(blocks, epoch=1):
    batch["image"].block_until_ready()
    time.sleep(step_seconds)
  return time.perf_counter() - start


def test_decoding_the_next_batch_overlaps_the_step(folder):
  """A decoder and a step of d seconds each, n batches: pipelined (prefetch_depth 2) the
  decoder's time does not add to the steps' (about n d + d, under 0.75 of the same reader
  unpipelined); with prefetch_depth 0 each batch is decoded then stepped, at least 2 n d."""
  d, n = 0.15, 8
  source, transform = _source_and_transform(folder)
  mesh = sharding.create_mesh(jax.devices()[:1])
  blocks = np.arange(4 * n).reshape(n, 4) % len(source)
  seconds = {}
  for depth in (2, 0):
    reader = DeviceStageReader(source, transform, mesh, _SlowDecoder(d),
                                            num_threads=2, prefetch_depth=depth)
    reader.compile_ahead(4)
    seconds[depth] = _fed_seconds(reader, blocks, d)
  assert seconds[0] >= 2 * n * d, seconds  # Decode, then step: the sleeps add up.
  assert seconds[2] < 0.75 * seconds[0], seconds


# ---------------------------------------------------------------- against the host stage


@pytest.mark.parametrize("epoch", [1, None])
def test_boxes_and_flips_are_a_re_draw_from_seed_epoch_and_id(folder, epoch):
  """An independent re-draw of each example's box (torchvision's RandomResizedCrop rule, from
  example_rng(seed, epoch, id)) and flip (drawn after it); the evaluation's centre box, rounded
  to whole pixels; what the host reads from each file's header."""
  source, transform = _source_and_transform(folder)
  for row in range(len(source)):
    item = packed_regions.header_item(source, transform, row, epoch)
    with Image.open(source.where(row)) as image:
      width, height = image.size
    if epoch is None:
      side = min(width, height) * transform.eval_fraction
      exact = ((width - side) / 2, (height - side) / 2, (width + side) / 2, (height + side) / 2)
      flip = False
    else:
      rng = preprocess.example_rng(3, epoch, int(source.ids[row]))
      exact = preprocess.random_resized_box(rng, width, height, (0.08, 1.0), (3 / 4, 4 / 3))
      flip = bool(rng.random() < 0.5)
    assert item.box == tuple(min(max(math.floor(v + 0.5), 0), limit) for v, limit in
                             zip(exact, (width, height, width, height)))
    assert (item.width, item.height, item.flip) == (width, height, flip)


@pytest.mark.slow  # Seconds of compiling: the op for each of 8 devices and the host stage.
@pytest.mark.parametrize("epoch", [2, None])
def test_the_stand_in_gives_the_host_stages_pixels_within_one_level(folder, epoch):
  """With the host stage's reduced-scale JPEG decoding off (the device stage reads full-scale
  pixels), both decode with PIL and crop the same boxes: within one level (the resize's
  rounding: OpenCV's fixed point against float32), most pixels equal. Training and eval."""
  source, transform = _source_and_transform(folder, jpeg_draft=False)
  mesh = sharding.create_mesh()
  blocks = np.random.default_rng(0).permutation(len(source))[:16].reshape(2, 8)
  host = _host(host_stage.PreprocessReader(source, transform, mesh, num_workers=2,
                                           worker_kind="thread").batches(blocks, epoch=epoch))
  reader = DeviceStageReader(source, transform, mesh, packed_regions.HostDecoder(),
                                          num_threads=2)
  device = _host(reader.batches(blocks, epoch=epoch))
  diff = np.abs(host.astype(int) - device)
  assert diff.max() <= 1 and (diff == 0).mean() > 0.8, (diff.max(), (diff == 0).mean())


def test_the_stand_ins_difference_from_the_host_stage_as_configured(folder):
  """The host stage as configured (reduced-scale JPEG decoding for boxes 2x the output or
  more) against the stand-in on the same boxes: mean and max absolute difference, measured
  (benchmarks.decode_difference measures it on 500 x 375 JPEGs; docs/data.md)."""
  source, transform = _source_and_transform(folder)
  mesh = sharding.create_mesh()
  rows = np.arange(len(source))
  host = host_stage.PreprocessReader(source, transform, mesh, worker_kind="thread",
                                     num_workers=2).images(rows, epoch=1)
  reader = DeviceStageReader(source, transform, mesh, packed_regions.HostDecoder(),
                                          num_threads=2)
  diff = np.abs(host.astype(int) - reader.images(rows, epoch=1))
  # A scaled-down DCT decode is a different image: small on average, tens of levels at edges.
  assert 0 < diff.mean() < 8 and diff.max() < 128, (diff.mean(), diff.max())


def test_the_folders_records_give_the_folders_batches(folder, tmp_path):
  """The folder converted to encoded records (dataset.stream_dir) through the device stage:
  the folder's batches, bit for bit (the same bytes, ids, boxes and decoder)."""
  source, transform = _source_and_transform(folder)
  sources.write_records(_dataset(folder), str(tmp_path / "rec"), num_shards=2)
  records = _dataset("", stream_dir=str(tmp_path / "rec"))
  sources.resolve(records)
  converted = sources.open_splits(records)["train"]
  assert type(converted).__name__ == "RecordSource"
  mesh = sharding.create_mesh()
  blocks = np.arange(16).reshape(2, 8)
  got = [_host(DeviceStageReader(s, transform, mesh, packed_regions.HostDecoder())
               .batches(blocks, epoch=1)) for s in (source, converted)]
  np.testing.assert_array_equal(*got)


def test_whole_images_and_boxes_alone_give_the_same_batches(folder):
  """A decoder that places whole images (the box cropped on the device) and one that places
  the boxes alone: the same batches, bit for bit (the op reads the box's pixels only)."""
  source, transform = _source_and_transform(folder)
  mesh = sharding.create_mesh()
  blocks = np.arange(16).reshape(2, 8)
  batches = [_host(DeviceStageReader(
      source, transform, mesh, packed_regions.HostDecoder(whole=whole)).batches(blocks, epoch=1))
      for whole in (False, True)]
  np.testing.assert_array_equal(*batches)


def test_each_device_decodes_and_holds_its_own_shard(folder):
  """8 devices, batches of 16: the image array is sharded on `data`; device d holds rows
  2d and 2d + 1 of the batch, the images one device alone gives for those rows, with their
  ids and labels beside them; the same batches with any read-ahead and prefetch depth."""
  source, transform = _source_and_transform(folder)
  mesh = sharding.create_mesh()
  assert mesh.devices.size == 8
  blocks = np.random.default_rng(1).permutation(len(source))[:16].reshape(1, 16)
  reader = DeviceStageReader(source, transform, mesh, packed_regions.HostDecoder(),
                                          num_threads=3, read_ahead=1, prefetch_depth=0)
  (batch,) = list(reader.batches(blocks, epoch=4))
  assert batch["image"].sharding.spec == jax.sharding.PartitionSpec("data")
  expected = reader.images(blocks[0], epoch=4)  # One device, every row.
  for shard in batch["image"].addressable_shards:
    rows = slice(*shard.index[0].indices(16)[:2])
    assert rows.stop - rows.start == 2
    assert shard.data.devices() == {shard.device}
    np.testing.assert_array_equal(np.asarray(shard.data), expected[rows])
  np.testing.assert_array_equal(np.asarray(batch["id"]), source.ids[blocks[0]])
  np.testing.assert_array_equal(np.asarray(batch["label"]), source.labels[blocks[0]])
  other = DeviceStageReader(source, transform, mesh, packed_regions.HostDecoder(),
                                         read_ahead=3, prefetch_depth=2)
  weights = np.linspace(0.5, 2.0, len(source)).astype(np.float32)  # One per split row.
  (fed,) = list(other.train_batches(blocks, row_weights=weights, epoch=4))
  np.testing.assert_array_equal(np.asarray(fed["image"]), expected)
  np.testing.assert_array_equal(np.asarray(fed["weight"]), weights[blocks[0]])
  mask = (np.arange(16) < 11).astype(np.float32)
  single = other.batch(blocks[0], mask, weights[blocks[0]] * 3, epoch=4)  # Per batch row.
  np.testing.assert_array_equal(np.asarray(single["image"]), expected)
  np.testing.assert_array_equal(np.asarray(single["mask"]), mask)
  np.testing.assert_array_equal(np.asarray(single["weight"]), weights[blocks[0]] * 3)


# ---------------------------------------------------------------- bad files and fallbacks


class _FakeGpu:
  """A GPU decoder's stand-in that 'decodes on the device' (PIL, placed in a first part) every
  file nvImageCodec would be given except those `refuse` names, as a GPU decoder returning
  None for them would: the rest go to the stage's PIL fallback."""

  def __init__(self, refuse=lambda item: False):
    self.refuse, self.name = refuse, "fake gpu"

  def prepare(self, item, channels):
    del item, channels

  def layouts(self, length):
    return (length,), (length, resize.MIN_BUCKET), (length, length)

  def decode(self, items, prepared, channels, device, buffers):
    chosen = [k for k, item in enumerate(items)
              if nvimgcodec.gpu_readable(item) and not self.refuse(item)]
    regions = [packed_regions.host_region(items[k], channels) for k in chosen]
    flat, offsets = packed_regions.packed([r for r, _ in regions], length=buffers.length)
    placed = {k: packed_regions.Placed(o, p.height, p.width, p.x0, p.y0)
              for k, o, (_, p) in zip(chosen, offsets, regions)}
    part = jax.device_put(flat, device) if chosen else None
    return packed_regions.with_host_part(items, placed, part, channels, device, {},
                                         fallback=True, length=buffers.length)


def test_files_a_gpu_decoder_cannot_read_are_decoded_by_pil_and_counted(folder, caplog):
  """PNGs and CMYK JPEGs are never given to the GPU decoder, and a JPEG it returns None for
  is decoded by PIL too: the batch is the stand-in's, bit for bit, and the log counts them."""
  source, transform = _source_and_transform(folder)
  mesh = sharding.create_mesh()
  blocks = np.arange(16).reshape(2, 8)
  items = [packed_regions.header_item(source, transform, row, 1) for row in blocks.ravel()]
  refused = {next(i.where for i in items if (i.format, i.mode) == ("JPEG", "RGB"))}
  reader = DeviceStageReader(source, transform, mesh,
                                          _FakeGpu(lambda item: item.where in refused))
  with caplog.at_level(logging.WARNING):
    got = _host(reader.batches(blocks, epoch=1))
  expected = _host(DeviceStageReader(
      source, transform, mesh, packed_regions.HostDecoder()).batches(blocks, epoch=1))
  np.testing.assert_array_equal(got, expected)
  pil = sum(i.format == "PNG" or i.mode == "CMYK" for i in items) + 1  # 1 refused.
  assert reader.decoded_on_host == pil and pil >= 5
  assert f"{pil} images of this pass were decoded on the host by PIL" in caplog.text


def test_a_truncated_jpeg_goes_to_pil_which_names_it(tmp_path):
  """A JPEG cut short (no EOI marker) is not given to the GPU decoder; PIL's decode names the
  file in one BadImageError; so is a file whose header is not an image's, at its read."""
  root = tmp_path / "bad"
  rng = np.random.default_rng(0)
  for name in ("a", "b"):
    os.makedirs(root / "train" / name)
    for i in range(4):
      Image.fromarray(_smooth(rng, 40, 50)).save(root / "train" / name / f"{i}.jpg",
                                                 quality=90)
  cut = root / "train" / "a" / "2.jpg"
  data = cut.read_bytes()
  cut.write_bytes(data[:len(data) * 3 // 4])  # Past the header: it opens, then fails.
  dataset = _dataset(str(root), check_files=0, val_size=1, test_size=1)
  spec = sources.resolve(dataset)
  source = sources.open_splits(dataset)["train"]
  transform = preprocess.from_config(dataset, spec.image_shape, 0)
  mesh = sharding.create_mesh()
  row = [source.where(r) for r in range(len(source))].index(str(cut))
  assert not nvimgcodec.gpu_readable(packed_regions.header_item(source, transform, row,
                                                                       None))
  reader = DeviceStageReader(source, transform, mesh, _FakeGpu())
  with pytest.raises(preprocess.BadImageError, match=f"{cut}: cannot be decoded") as raised:
    reader.images(np.array([row]), epoch=1)
  # As the host stage raises it: the folder's way out, the example for the resume's notes.
  assert source.on_damage in str(raised.value) and raised.value.entry == source.entry(row)
  (root / "train" / "b" / "1.jpg").write_bytes(b"not an image at all")
  row = [source.where(r) for r in range(len(source))].index(str(root / "train/b/1.jpg"))
  with pytest.raises(preprocess.BadImageError, match="b/1.jpg: not a readable image"):
    list(reader.batches(np.array([[row] * 8]), epoch=1))


@pytest.mark.skipif(nvimgcodec.importlib.util.find_spec("nvidia") is None
                    or nvimgcodec.importlib.util.find_spec("nvidia.nvimgcodec") is None,
                    reason="nvImageCodec is not installed (pip install 'cpjax[gpu-decode]')")
def test_nvimgcodec_on_its_cpu_backend_gives_the_stand_ins_batches(folder):
  """The gpu decoder's own nvImageCodec calls (code streams, regions, decoding into places of
  one buffer, None for what it cannot read) on the library's CPU backend: the stand-in's
  batches, bit for bit (both decode with libjpeg), the PNGs and CMYK JPEGs left to PIL."""
  source, transform = _source_and_transform(folder)
  mesh = sharding.create_mesh()
  blocks = np.arange(16).reshape(2, 8)
  decoder = nvimgcodec.Decoder(3, on_gpu=False)
  reader = DeviceStageReader(source, transform, mesh, decoder)
  expected = _host(DeviceStageReader(
      source, transform, mesh, packed_regions.HostDecoder()).batches(blocks, epoch=1))
  np.testing.assert_array_equal(_host(reader.batches(blocks, epoch=1)), expected)
  items = [packed_regions.header_item(source, transform, row, 1) for row in blocks.ravel()]
  assert reader.decoded_on_host == sum(i.format == "PNG" or i.mode == "CMYK" for i in items)


# ---------------------------------------------------------------- the config


def _problems(**dataset) -> str:
  config = helpers.tiny_config(**{f"dataset.{k}": v for k, v in dataset.items()})
  with pytest.raises(validation.ConfigError) as raised:
    validation.validate(config)
  return str(raised.value)


def test_decode_gpu_without_a_gpu_stops_at_start_up_naming_what_to_install(folder,
                                                                          monkeypatch):
  """No GPU here: the line names jax[cuda13]; where nvImageCodec is missing too, the same
  line names the gpu-decode extra (one install after the other would fail again)."""
  for installed in (True, False):
    monkeypatch.setattr(nvimgcodec, "_nvimgcodec_installed", lambda i=installed: i)
    message = _problems(**{**_dataset(folder).to_dict(), "decode": "gpu"})
    (line,) = [line for line in message.splitlines() if "dataset.decode" in line]
    assert "config.dataset.decode='gpu' needs an NVIDIA GPU" in line and "jax[cuda13]" in line
    assert "decode=cpu" in line
    assert ("it also needs nvImageCodec, which is not installed: pip install "
            "'cpjax[gpu-decode]'" in line) is not installed, line


def test_the_gpu_decoder_on_a_gpu_without_nvimgcodec_names_the_extra_alone(monkeypatch):
  monkeypatch.setattr(nvimgcodec, "_nvidia", lambda device: True)  # As on a GPU.
  monkeypatch.setattr(nvimgcodec, "_nvimgcodec_installed", lambda: False)
  assert nvimgcodec.problem() == (
      f"needs nvImageCodec, which is not installed: {nvimgcodec.INSTALL}")
  monkeypatch.setattr(nvimgcodec, "_nvimgcodec_installed", lambda: True)
  assert nvimgcodec.problem() is None


def test_decode_choices_are_checked_and_fit_the_dataset(folder):
  assert "valid choices: auto, cpu, device_cpu, gpu" in _problems(decode="gpu_please")
  assert "'digits' is held in memory as pixels" in _problems(decode="device_cpu")
  assert "not dataset.resize='pil'" in _problems(
      **{**_dataset(folder).to_dict(), "decode": "device_cpu", "resize": "pil"})
  fields = {f"dataset.{k}": v for k, v in _dataset(folder, decode="device_cpu").items()}
  # The folder's 4 validation images reach no conformal alpha below 0.2: no sets here.
  config = helpers.tiny_config(**fields, **{"evaluation.ood": "", "evaluation.calibrator_folds": 2,
                                            "evaluation.conformal_scores": ()})
  validation.validate(config)  # The stand-in runs anywhere.


def test_auto_picks_the_host_stage_without_a_gpu_and_says_why(folder, caplog):
  with caplog.at_level(logging.INFO):
    assert decoders.resolved_decode(_dataset(folder, decode="auto")) == "cpu"
  assert "dataset.decode=auto: cpu (gpu needs an NVIDIA GPU" in caplog.text
  assert decoders.resolved_decode(_dataset(folder, decode="device_cpu")) == "device_cpu"


def test_the_resize_rule_is_one_check_for_its_three_users(folder, caplog):
  """dataset.resize other than opencv: config validation, auto's log and the device stage's
  reader all name it with the same words."""
  words = ("resizes on the device as the 'opencv' engine does, not dataset.resize='pil' "
           "(set resize='opencv')")
  assert resize.resize_problem("opencv") is None
  assert resize.resize_problem("pil") == words
  assert f"config.dataset.decode='device_cpu' {words}; or decode on the host" in _problems(
      **{**_dataset(folder).to_dict(), "decode": "device_cpu", "resize": "pil"})
  source, transform = _source_and_transform(folder, resize="pil")
  with pytest.raises(ValueError, match=re.escape(f"the device stage {words}")):
    DeviceStageReader(source, transform, sharding.create_mesh(),
                                   packed_regions.HostDecoder())
  with caplog.at_level(logging.INFO):
    assert decoders.resolved_decode(_dataset(folder, decode="auto", resize="pil")) == "cpu"
  # The decoder's own problem first (none where a GPU and nvImageCodec are), then the resize.
  assert f"dataset.decode=auto: cpu (gpu {nvimgcodec.problem() or words})." in (
      caplog.text)


def test_the_checkpoint_names_the_decoder_and_a_resume_with_another_warns(caplog):
  reader = DeviceStageReader.__new__(DeviceStageReader)
  reader.decoder = packed_regions.HostDecoder()
  assert setup._decoder_meta(reader, {}) == {"decoder": reader.decoder.name}  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING):
    setup._decoder_meta(reader, {"decoder": "gpu (nvImageCodec 0.9.0, ...)"})  # pylint: disable=protected-access
  assert "from here the run mixes the two" in caplog.text
  assert setup._decoder_meta(object(), {"decoder": "x"}) == {}  # pylint: disable=protected-access
