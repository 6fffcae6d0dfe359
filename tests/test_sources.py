"""Data sources and the host stage: folders of real-world files, tfds datasets by name, the
crops' randomness, bad files, and the readers built on them.

Every image here is generated (NumPy arrays saved with PIL) and labelled as such; the
expected pixels come from the arrays themselves or from closed forms, not from the code
under test.
"""

import io
import os

import etils.epath
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from PIL import Image
import pytest
import tensorflow_datasets as tfds

from configs import default
from cpjax import steps
from cpjax.config import validation
from cpjax.data import (
  folder_source,
  host_stage,
  preprocess,
  record_source,
  sources,
  specs,
  splits,
  tensorflow_optional,
)
from cpjax.data.device_stage import packed_regions
from cpjax.data.device_stage.reader import DeviceStageReader
from cpjax.runtime import sharding
from tests import helpers
from tests.helpers import tiny_config


def _save(array: np.ndarray, path: str, fmt: str, **options) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  mode = {1: "L", 3: "RGB", 4: "RGBA"}[array.shape[-1]] if array.ndim == 3 else "L"
  Image.fromarray(array.squeeze() if mode == "L" else array, mode).save(path, format=fmt,
                                                                        **options)


def _identity(size: int, channels: int) -> preprocess.Transform:
  """The evaluation transform of a size x size image with eval_fraction 1: the whole image,
  resized to its own size (PIL copies it), so the output is the decoded pixels."""
  return preprocess.Transform(size=size, channels=channels, eval_fraction=1.0)


def _read(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


# ---------------------------------------------------------------- decoding real-world files


def test_png_grey_rgb_alpha_and_palette_decode_to_their_generated_pixels(tmp_path):
  rng = np.random.default_rng(0)
  rgb = rng.integers(0, 256, (12, 12, 3), np.uint8)
  rgba = np.concatenate([rgb, rng.integers(0, 256, (12, 12, 1), np.uint8)], -1)
  grey = rng.integers(0, 256, (12, 12, 1), np.uint8)
  for name, array in (("rgb", rgb), ("rgba", rgba), ("grey", grey)):
    _save(array, str(tmp_path / f"{name}.png"), "PNG")
  three, one = _identity(12, 3), _identity(12, 1)
  np.testing.assert_array_equal(three(_read(tmp_path / "rgb.png"), 0, None), rgb)
  # Alpha dropped (torchvision's pil_loader convention), colour kept.
  np.testing.assert_array_equal(three(_read(tmp_path / "rgba.png"), 0, None), rgb)
  np.testing.assert_array_equal(one(_read(tmp_path / "grey.png"), 0, None), grey)
  # A grey image read as RGB: the grey value in all three channels.
  np.testing.assert_array_equal(three(_read(tmp_path / "grey.png"), 0, None),
                                np.repeat(grey, 3, -1))
  # A palette PNG: each pixel its palette colour.
  palette = rng.integers(0, 256, (4, 3), np.uint8)
  indices = rng.integers(0, 4, (12, 12), np.uint8)
  image = Image.fromarray(indices, "P")
  image.putpalette(palette.ravel().tolist() + [0] * (768 - palette.size))
  image.save(tmp_path / "palette.png")
  np.testing.assert_array_equal(three(_read(tmp_path / "palette.png"), 0, None),
                                palette[indices])


def test_a_png_named_jpg_decodes_by_content(tmp_path):
  rgb = np.random.default_rng(1).integers(0, 256, (10, 10, 3), np.uint8)
  _save(rgb, str(tmp_path / "really_a_png.jpg"), "PNG")
  np.testing.assert_array_equal(_identity(10, 3)(_read(tmp_path / "really_a_png.jpg"), 0, None),
                                rgb)


def test_grey_and_cmyk_jpegs_decode_close_to_their_generated_colours(tmp_path):
  # Flat colours survive JPEG almost exactly: a few levels of tolerance.
  grey = np.full((16, 16, 1), 90, np.uint8)
  _save(grey, str(tmp_path / "grey.jpg"), "JPEG", quality=95)
  out = _identity(16, 3)(_read(tmp_path / "grey.jpg"), 0, None)
  assert out.shape == (16, 16, 3) and np.abs(out.astype(int) - 90).max() <= 2
  c, m, y, k = 40, 120, 200, 30
  Image.new("CMYK", (16, 16), (c, m, y, k)).save(tmp_path / "cmyk.jpg", quality=95)
  out = _identity(16, 3)(_read(tmp_path / "cmyk.jpg"), 0, None).astype(float)
  # Subtractive CMYK -> RGB: channel = (255 - ink) (255 - K) / 255.
  expected = [(255 - ink) * (255 - k) / 255 for ink in (c, m, y)]
  np.testing.assert_allclose(out.reshape(-1, 3).mean(0), expected, atol=3)


def test_training_crops_of_grey_and_cmyk_jpegs_keep_their_generated_colours(tmp_path):
  """The training transform with `tf_crop_decode` (TF for RGB/grey JPEGs, PIL for CMYK) gives flat
  colours back within JPEG's few levels, with three channels."""
  helpers.require_tensorflow()  # tf_crop_decode decodes with TensorFlow.
  _save(np.full((40, 30, 1), 90, np.uint8), str(tmp_path / "grey.jpg"), "JPEG", quality=95)
  transform = preprocess.Transform(size=16, channels=3, flip=True, seed=1, tf_crop_decode=True)
  for example_id in range(4):
    out = transform(_read(tmp_path / "grey.jpg"), example_id, 0)
    assert out.shape == (16, 16, 3) and np.abs(out.astype(int) - 90).max() <= 2
  c, m, y, k = 40, 120, 200, 30
  Image.new("CMYK", (40, 30), (c, m, y, k)).save(tmp_path / "cmyk.jpg", quality=95)
  expected = [(255 - ink) * (255 - k) / 255 for ink in (c, m, y)]  # As the test above.
  for example_id in range(4):
    out = transform(_read(tmp_path / "cmyk.jpg"), example_id, 0).astype(float)
    np.testing.assert_allclose(out.reshape(-1, 3).mean(0), expected, atol=3)


def test_a_tf_decoded_training_crop_is_close_to_pil_on_the_whole_decode(tmp_path):
  """A second implementation: PIL decodes the whole JPEG and crops the box re-drawn from
  example_rng, then resizes it alone; the host stage decodes only the window (TF). Same box,
  same flip, so the pixels agree within 1.5 levels on average (the two libjpeg builds'
  rounding, about 1 level here), at most 6 anywhere."""
  helpers.require_tensorflow()  # tf_crop_decode decodes with TensorFlow.
  yy, xx = np.mgrid[0:150, 0:200]
  smooth = np.stack([xx, yy + 50, (xx + yy) // 2], -1).astype(np.uint8)
  _save(smooth, str(tmp_path / "smooth.jpg"), "JPEG", quality=95)
  data = _read(tmp_path / "smooth.jpg")
  # Output 128 > half of 200 x 150: no crop can take PIL's reduced-scale path, all take TF's.
  transform = preprocess.Transform(size=128, channels=3, flip=True, seed=3,
                                   tf_crop_decode=True)
  image = Image.open(tmp_path / "smooth.jpg")
  decoded = np.asarray(image.convert("RGB"))
  flips = set()
  for example_id in range(8):
    rng = np.random.default_rng([3, preprocess.RNG_STREAM, 1, example_id])
    left, top, right, bottom = preprocess.random_resized_box(rng, 200, 150, (0.08, 1.0),
                                                             (3 / 4, 4 / 3))
    flip = rng.random() < 0.5
    flips.add(bool(flip))
    box = (left, top, right, bottom)
    assert transform._tf_decodable(image, box)  # pylint: disable=protected-access
    assert preprocess._tf_crop(data, box).shape == (bottom - top, right - left, 3)  # pylint: disable=protected-access
    crop = Image.fromarray(decoded[top:bottom, left:right])
    expected = np.asarray(crop.resize((128, 128), Image.BILINEAR)).astype(int)
    expected = expected[:, ::-1] if flip else expected
    diff = np.abs(transform(data, example_id, 1).astype(int) - expected)
    assert diff.mean() < 1.5 and diff.max() <= 6, (example_id, diff.mean(), diff.max())
  assert flips == {True, False}  # Both orientations were checked.


def test_a_drafted_jpeg_crop_is_close_to_the_full_decode(tmp_path):
  """Reduced-scale JPEG decoding (a 400-px crop to 32 px) changes pixels only slightly."""
  yy, xx = np.mgrid[0:512, 0:512]
  smooth = np.stack([xx // 2, yy // 2, (xx + yy) // 4], -1).astype(np.uint8)
  _save(smooth, str(tmp_path / "big.jpg"), "JPEG", quality=95)
  data = _read(tmp_path / "big.jpg")
  drafted = preprocess.Transform(size=32, channels=3, eval_fraction=0.8)(data, 0, None)
  full = preprocess.Transform(size=32, channels=3, eval_fraction=0.8,
                              jpeg_draft=False)(data, 0, None)
  assert np.abs(drafted.astype(int) - full.astype(int)).mean() < 2.0


def test_evaluation_crop_is_the_centre_of_the_shorter_side_over_the_fraction(tmp_path):
  """64 x 48 image, size 24, fraction 0.5: the centre box of side 48 * 0.5 = 24 is resized to
  24, i.e. copied: NumPy's slice [12:36, 20:44] is the expected output."""
  image = np.random.default_rng(2).integers(0, 256, (48, 64, 3), np.uint8)
  _save(image, str(tmp_path / "wide.png"), "PNG")
  out = preprocess.Transform(size=24, channels=3, eval_fraction=0.5)(
      _read(tmp_path / "wide.png"), 0, None)
  np.testing.assert_array_equal(out, image[12:36, 20:44])


# ---------------------------------------------------------------- the crops' randomness


def test_random_resized_box_by_hand_and_within_its_ranges():
  rng = np.random.default_rng(0)
  # Area share fixed at 1/4 and ratio 1: a 50 x 50 box of a 100 x 100 image.
  for _ in range(20):
    left, top, right, bottom = preprocess.random_resized_box(rng, 100, 100, (0.25, 0.25),
                                                             (1.0, 1.0))
    assert (right - left, bottom - top) == (50, 50) and 0 <= left <= 50 and 0 <= top <= 50
  for _ in range(200):
    left, top, right, bottom = preprocess.random_resized_box(rng, 300, 200, (0.08, 1.0),
                                                             (3 / 4, 4 / 3))
    w, h = right - left, bottom - top
    assert 0 <= left and right <= 300 and 0 <= top and bottom <= 200
    assert 0.08 * 0.9 <= w * h / 60000 <= 1.0 and 0.7 <= w / h <= 1.4
  # No draw fits a 1000 x 10 strip at ratio ~1: the centre crop clamped to the ratio range.
  assert preprocess.random_resized_box(rng, 1000, 10, (0.5, 1.0), (3 / 4, 4 / 3)) == (
      493, 0, 506, 10)


@pytest.fixture(name="folder")
def _folder(tmp_path):
  """A generated folder: 3 classes x 6 images of varied size and format in train/, 2 per
  class in test/; no val/ (carved from train)."""
  rng = np.random.default_rng(3)
  root = tmp_path / "images"
  for split, count in (("train", 6), ("test", 2)):
    for label, name in enumerate(("cat", "ant", "bee")):
      for i in range(count):
        h, w = (int(v) for v in rng.integers(16, 48, 2))
        array = rng.integers(0, 256, (h, w, 3), np.uint8)
        fmt, ext = (("PNG", ".png"), ("JPEG", ".jpg"))[i % 2]
        _save(array, str(root / split / name / f"img{i}{ext}"), fmt)
  return str(root)


def _dataset(folder: str, **overrides) -> ml_collections.ConfigDict:
  dataset = default.get_config().dataset
  dataset.update({"name": "folder", "folder": folder, "image_size": 16, "val_size": 3,
                  "flip": True, **overrides})
  return dataset


def test_folder_classes_ids_and_splits(folder):
  dataset = _dataset(folder)
  spec = sources.resolve(dataset)
  assert spec.classes == ("ant", "bee", "cat") and spec.num_classes == 3  # Sorted names.
  assert spec.num_train == 18 and spec.test_split == "test" and spec.val_split == ""
  opened = sources.open_splits(dataset)
  train, val, test = opened["train"], opened["val"], opened["test"]
  # The ids are positions in the sorted relative paths; labels from the class folder.
  paths = sorted(os.path.relpath(os.path.join(d, f), os.path.join(folder, "train"))
                 for d, _, files in os.walk(os.path.join(folder, "train")) for f in files)
  expected_train, expected_val = splits.carve_validation(18, 3, dataset.split_seed)
  np.testing.assert_array_equal(train.ids, expected_train)
  np.testing.assert_array_equal(val.ids, expected_val)
  for source in (train, val):
    for row, example_id in enumerate(source.ids):
      assert source.where(row).endswith(paths[example_id])
      assert source.labels[row] == spec.classes.index(paths[example_id].split(os.sep)[0])
  assert len(test) == 6 and list(test.labels) == [0, 0, 1, 1, 2, 2]


def test_a_folder_without_test_carves_it_and_one_with_val_uses_it(folder, tmp_path):
  os.rename(os.path.join(folder, "test"), os.path.join(folder, "val"))
  dataset = _dataset(folder, test_size=4)
  spec = sources.resolve(dataset)
  assert spec.val_split == "val" and spec.test_split == ""
  opened = sources.open_splits(dataset)
  assert len(opened["val"]) == 6 and len(opened["test"]) == 4 and len(opened["train"]) == 14
  assert not set(opened["test"].ids) & set(opened["train"].ids)
  with pytest.raises(validation.ConfigError, match="test_size=0"):
    validation.validate(tiny_config(**{
        "dataset.name": "folder", "dataset.folder": folder, "dataset.image_size": 16,
        "evaluation.ood": ""}))


def _reader(dataset: ml_collections.ConfigDict, split: str = "train", seed: int = 0,
            workers: int = 2) -> host_stage.PreprocessReader:
  spec = sources.resolve(dataset)
  transform = preprocess.from_config(dataset, spec.image_shape, seed)
  return host_stage.PreprocessReader(sources.open_splits(dataset)[split], transform,
                                     sharding.create_mesh(), num_workers=workers)


def test_crops_are_a_function_of_seed_epoch_and_id_only(folder):
  """The same example in the same epoch gets the same pixels whatever the batch, its place
  in it, the worker count or the read-ahead; another epoch or seed gets another crop."""
  dataset = _dataset(folder)
  reader = _reader(dataset, workers=1)
  rows = np.arange(len(reader))
  first = reader.images(rows, epoch=3)
  shuffled = np.random.default_rng(0).permutation(rows)
  again = _reader(dataset, workers=3).images(shuffled, epoch=3)
  np.testing.assert_array_equal(again, first[shuffled])
  blocks = np.stack([shuffled[:8], shuffled[7:15]])
  batches = list(_reader(dataset).batches(blocks, epoch=3))
  for block, batch in zip(blocks, batches):
    np.testing.assert_array_equal(jax.device_get(batch["image"]), first[block])
    np.testing.assert_array_equal(jax.device_get(batch["id"]), reader.ids[block])
  other_epoch = reader.images(rows, epoch=4)
  other_seed = _reader(dataset, seed=1).images(rows, epoch=3)
  assert np.mean(np.any(other_epoch != first, axis=(1, 2, 3))) > 0.8
  assert np.mean(np.any(other_seed != first, axis=(1, 2, 3))) > 0.8
  # Evaluation (no epoch) is deterministic and unflipped: the centre crop.
  np.testing.assert_array_equal(reader.images(rows), reader.images(rows[::-1])[::-1])


@pytest.mark.parametrize("resize", preprocess.RESIZE_ENGINES)
def test_the_training_draws_follow_example_rng(folder, resize):
  """An independent re-draw: the crop box and flip of an example come from
  example_rng(seed, epoch, id) alone, in that order; the pixels of a PNG (lossless) are its
  box resized by hand with the run's engine (`dataset.resize`)."""
  dataset = _dataset(folder, image_size=16, resize=resize)
  reader = _reader(dataset, seed=5)
  row = next(r for r in range(len(reader.ids)) if reader.source.where(r).endswith(".png"))
  example_id = int(reader.ids[row])
  rng = np.random.default_rng([5, preprocess.RNG_STREAM, 2, example_id])
  with Image.open(reader.source.where(row)) as image:
    image = image.convert("RGB")
    box = preprocess.random_resized_box(rng, *image.size, (0.08, 1.0), (3 / 4, 4 / 3))
    flip = rng.random() < 0.5
    if resize == "pil":
      expected = np.asarray(image.resize((16, 16), Image.BILINEAR, box=box))
    else:
      left, top, right, bottom = box  # Integer: a PNG is never drafted.
      expected = preprocess.cv2_resized(np.asarray(image)[top:bottom, left:right], 16)
  if flip:
    expected = expected[:, ::-1]
  np.testing.assert_array_equal(reader.images(np.asarray([row]), epoch=2)[0], expected)


# ---------------------------------------------------------------- bad files


def test_an_unreadable_file_is_named_at_start_up_or_left_out_and_listed(folder, tmp_path):
  bad = os.path.join(folder, "train", "bee", "broken.jpg")
  with open(bad, "wb") as f:
    f.write(b"this is not an image")
  config = tiny_config(**{"dataset.name": "folder", "dataset.folder": folder,
                          "dataset.image_size": 16, "dataset.val_size": 5,
                          "evaluation.ood": "", "evaluation.conformal_scores": ()})
  train = os.path.join(folder, "train")
  with pytest.raises(validation.ConfigError) as raised:
    validation.validate(config)
  assert (f"1 file of {train} is not a readable image: {bad} (UnidentifiedImageError: not in "
          "an image format PIL reads). Remove or replace it, or pass "
          "--config.dataset.skip_bad_files=True to leave it out (it is then listed") in str(
              raised.value)
  empty = os.path.join(folder, "train", "bee", "empty.png")
  open(empty, "wb").close()
  with pytest.raises(validation.ConfigError) as raised:
    validation.validate(config)
  assert (f"2 files of {train} are not readable images: {bad} (UnidentifiedImageError: not in "
          f"an image format PIL reads); {empty} (empty: 0 bytes). Remove or replace them") in str(
              raised.value)
  assert "<_io" not in str(raised.value)  # No Python object's repr.
  config.dataset.skip_bad_files = True
  validation.validate(config)
  assert specs.DATASETS["folder"].num_train == 18  # Left out.
  listed = sources.bad_files(config.dataset)
  assert len(listed) == 2 and listed[0].startswith(bad) and listed[1].startswith(empty)


def test_damage_past_the_header_is_named_when_the_file_is_read(folder):
  path = os.path.join(folder, "train", "ant", "img1.jpg")
  _save(np.random.default_rng(4).integers(0, 256, (200, 200, 3), np.uint8), path, "JPEG")
  data = _read(path)
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2])  # A valid header, half of the scan missing.
  with pytest.raises(preprocess.BadImageError, match="img1.jpg"):  # The statistics' sample.
    sources.resolve(_dataset(folder))
  dataset = _dataset(folder, mean=(0.5,) * 3, std=(0.25,) * 3)  # No sample decoded.
  reader = next(r for r in (_reader(dataset, "train"), _reader(dataset, "val"))
                if any(r.source.where(i) == path for i in range(len(r))))
  row = next(r for r in range(len(reader)) if reader.source.where(r) == path)
  with pytest.raises(preprocess.BadImageError, match="img1.jpg"):
    reader.images(np.asarray([row]), epoch=0)
  with pytest.raises(preprocess.BadImageError, match="img1.jpg"):
    list(reader.batches(np.asarray([[row] * 8])))


def test_a_truncated_jpeg_is_named_with_tf_crop_decoding_too(tmp_path):
  """TF rejects the damaged scan, PIL then names the file: every crop, none silently kept."""
  helpers.require_tensorflow()  # tf_crop_decode decodes with TensorFlow.
  _save(np.random.default_rng(4).integers(0, 256, (200, 200, 3), np.uint8),
        str(tmp_path / "half.jpg"), "JPEG")
  data = _read(tmp_path / "half.jpg")
  transform = preprocess.Transform(size=128, channels=3, tf_crop_decode=True)
  for example_id in range(10):
    with pytest.raises(preprocess.BadImageError, match="half.jpg"):
      transform(data[:len(data) // 2], example_id, 0, where="half.jpg")


def test_header_checks_and_path_table():
  table = folder_source.PathTable(["a/x.png", "bé/ü.jpg", ""])
  assert [table[i] for i in range(3)] == ["a/x.png", "bé/ü.jpg", ""] and len(table) == 3


# ---------------------------------------------------------------- tfds:NAME


class CpjaxGeneratedImages(tfds.core.GeneratorBasedBuilder):
  """Generated (random) images of varying size in 3 classes: tfds's Image feature, PNG."""
  VERSION = tfds.core.Version("1.0.0")
  pkg_dir_path = etils.epath.Path(__file__).parent

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(None, None, 3)),
            "label": tfds.features.ClassLabel(names=["zebra", "ant", "cat"])}),
        supervised_keys=("image", "label"))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {"train": self._generate_examples("train"), "test": self._generate_examples("test")}

  def _generate_examples(self, split):
    for i, (image, label) in enumerate(generated_examples(split)):
      yield i, {"image": image, "label": label}


def generated_examples(split: str) -> list[tuple[np.ndarray, int]]:
  rng = np.random.default_rng({"train": 0, "test": 1}[split])
  out = []
  for i in range({"train": 30, "test": 9}[split]):
    h, w = (int(v) for v in rng.integers(10, 30, 2))
    out.append((rng.integers(0, 256, (h, w, 3), np.uint8), i % 3))
  return out


@pytest.fixture(name="tfds_dir", scope="module")
def _tfds_dir(tmp_path_factory):
  """A prepared generated tfds dataset (array_record) in a fresh data_dir."""
  helpers.require_tensorflow()  # tfds encodes the generated images with it.
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  tfds.builder("cpjax_generated_images", data_dir=data_dir,
               file_format="array_record").download_and_prepare()
  return data_dir


def test_a_tfds_dataset_by_name_reads_its_metadata_and_images(tfds_dir):
  dataset = _dataset("", name="tfds:cpjax_generated_images", data_dir=tfds_dir,
                     image_size=12)
  spec = sources.resolve(dataset)
  # Classes in tfds's label order (not sorted), sizes from builder.info; val carved.
  assert spec.classes == ("zebra", "ant", "cat") and spec.num_classes == 3
  assert spec.num_train == 30 and spec.test_split == "test" and spec.val_split == ""
  assert spec.image_shape == (12, 12, 3) and specs.DATASETS[dataset.name] == spec
  opened = sources.open_splits(dataset)
  assert [len(opened[s]) for s in ("train", "val", "test")] == [27, 3, 9]
  # Every row decodes to one generated image of its label (PNG: exactly), each once.
  expected = generated_examples("train")
  seen = set()
  for name in ("train", "val"):
    source = opened[name]
    for row, data in enumerate(source.read(np.arange(len(source)))):
      pixels = preprocess.decode(data, 3)
      (match,) = [i for i, (image, _) in enumerate(expected)
                  if image.shape == pixels.shape and np.array_equal(image, pixels)]
      assert expected[match][1] == source.labels[row]
      seen.add(match)
  assert seen == set(range(30))
  batch = _reader(dataset, "test").images(np.arange(9))
  assert batch.shape == (9, 12, 12, 3) and batch.dtype == np.uint8


@pytest.mark.slow  # Each worker imports this module (tfds, JAX) to unpickle the builder.
def test_a_tfds_dataset_decodes_the_same_in_worker_processes_and_threads(tfds_dir):
  """tfds:NAME through the host stage: worker processes (2, or 1 with read-ahead 1) and
  threads give the transform's own output for each row, bit for bit, training and
  evaluation (each worker opens the dataset's files itself)."""
  dataset = _dataset("", name="tfds:cpjax_generated_images", data_dir=tfds_dir,
                     image_size=12)
  spec = sources.resolve(dataset)
  source = sources.open_splits(dataset)["train"]
  transform = preprocess.from_config(dataset, spec.image_shape, 2)
  rows = np.random.default_rng(4).permutation(len(source))[:16]
  for epoch in (1, None):
    expected = np.stack([transform(source.read(np.asarray([row]))[0], int(source.ids[row]),
                                   epoch) for row in rows])
    for kind, workers, read_ahead in (("process", 2, 2), ("process", 1, 1), ("thread", 2, 2)):
      reader = host_stage.PreprocessReader(source, transform, sharding.create_mesh(), workers,
                                           read_ahead=read_ahead, worker_kind=kind)
      images = [jax.device_get(b["image"]) for b in reader.batches(rows.reshape(2, 8),
                                                                   epoch=epoch)]
      np.testing.assert_array_equal(np.concatenate(images), expected, err_msg=kind)


def test_a_tfds_dataset_and_its_records_through_the_device_stage(tmp_path, tfds_dir):
  """dataset.decode=device_cpu (the device stage, PIL standing in for the GPU's decoder) over
  tfds:NAME and over its converted records: the same batches, bit for bit, and within one
  level of the host stage's (PNGs: the same decoded pixels and boxes, the resize's rounding)."""
  dataset = _dataset("", name="tfds:cpjax_generated_images", data_dir=tfds_dir, image_size=12)
  spec = sources.resolve(dataset)
  transform = preprocess.from_config(dataset, spec.image_shape, 2)
  direct = sources.open_splits(dataset)["train"]
  out = str(tmp_path / "rec")
  sources.write_records(dataset, out, num_shards=2)
  records = _dataset("", name="tfds:cpjax_generated_images", stream_dir=out, image_size=12)
  sources.resolve(records)
  converted = sources.open_splits(records)["train"]
  mesh = sharding.create_mesh()
  blocks = np.random.default_rng(5).permutation(len(direct))[:16].reshape(2, 8)

  def images(reader) -> np.ndarray:
    return np.stack([jax.device_get(b["image"]) for b in reader.batches(blocks, epoch=1)])
  got = [images(DeviceStageReader(source, transform, mesh,
                                               packed_regions.HostDecoder()))
         for source in (direct, converted)]
  np.testing.assert_array_equal(*got)
  host = images(host_stage.PreprocessReader(direct, transform, mesh, worker_kind="thread"))
  assert np.abs(host.astype(int) - got[0]).max() <= 1


def test_a_converted_tfds_dataset_holds_its_encoded_bytes(tmp_path, tfds_dir):
  """A tfds dataset converted to encoded records (cpjax.data.record_source): tfds's own
  bytes of every row, and the same facts."""
  dataset = _dataset("", name="tfds:cpjax_generated_images", data_dir=tfds_dir)
  direct = sources.resolve(dataset)
  opened = sources.KINDS["tfds:"].open(dataset, direct)
  out = str(tmp_path / "rec")
  written = sources.write_records(dataset, out, num_shards=2)
  assert written == {"train": 30, "test": 9}
  records = _dataset("", name="tfds:cpjax_generated_images", stream_dir=out)
  assert sources.resolve(records) == direct
  expected = {"train": generated_examples("train"), "test": generated_examples("test")}
  for split, source in opened.items():
    converted = record_source.RecordSource(out, split)
    rows = np.arange(len(source))
    assert converted.read(rows) == source.read(rows)
    # One row at a time (the host stage's reads, by index) gives the same bytes.
    assert [source.read(np.asarray([row]))[0] for row in rows] == source.read(rows)
    # tfds wrote the generated arrays as PNG (in its own order): each record decodes to
    # exactly one of them, of the record's label.
    by_pixels = {image.tobytes(): label for image, label in expected[split]}
    decoded = [np.asarray(Image.open(io.BytesIO(data))) for data in converted.read(rows)]
    assert [by_pixels[image.tobytes()] for image in decoded] == list(converted.labels)
    assert len({image.tobytes() for image in decoded}) == len(expected[split])


def test_an_unprepared_tfds_dataset_says_how_to_prepare_it(tmp_path, monkeypatch):
  """Not prepared: how to prepare it; where TensorFlow is absent, in the same line, that
  preparing it here needs TensorFlow and what to install."""
  config = tiny_config(**{"dataset.name": "tfds:mnist", "dataset.data_dir": str(tmp_path),
                          "evaluation.ood": ""})
  monkeypatch.setattr(tensorflow_optional, "installed", lambda: True)
  with pytest.raises(validation.ConfigError, match="not prepared.*array_record") as raised:
    validation.validate(config)
  assert "TensorFlow" not in str(raised.value)
  monkeypatch.setattr(tensorflow_optional, "installed", lambda: False)
  with pytest.raises(validation.ConfigError) as raised:
    validation.validate(config)
  (line,) = str(raised.value).splitlines()[1:]
  assert "tfds dataset 'mnist' is not prepared" in line
  assert line.endswith("; preparing it here needs TensorFlow, which is not installed: pip "
                       "install -r requirements-tf.txt (or: pip install 'cpjax[tf]')"), line
  config.dataset.name = "tfds:no_such_dataset_anywhere"
  with pytest.raises(validation.ConfigError, match="no such dataset"):
    validation.validate(config)


def test_a_misspelled_tfds_name_keeps_tfds_suggestion(tmp_path):
  """tfds's lookup needs no network: its "Did you mean: mnsit -> mnist ?" comes after the
  list of every dataset it knows, and the error passes it on as the name to use."""
  config = tiny_config(**{"dataset.name": "tfds:mnsit", "dataset.data_dir": str(tmp_path),
                          "evaluation.ood": ""})
  with pytest.raises(validation.ConfigError) as raised:
    validation.validate(config)
  message = str(raised.value)
  assert "tfds knows no such dataset (DatasetNotFoundError: Dataset mnsit not found.)" in message
  assert "did you mean --config.dataset.name=tfds:mnist?" in message
  assert "abstract_reasoning" not in message  # Not tfds's list of every dataset.
  # The field and its value are named once, not once by the check and again by the error.
  assert message.count("dataset.name='tfds:mnsit'") == 1, message
  assert "config.dataset.name='tfds:mnsit': tfds knows no such dataset" in message


# ---------------------------------------------------------------- selection over such data


def test_a_scoring_pass_streams_every_row_once_through_the_evaluation_transform(folder):
  """steps.predict (the fresh and target scoring passes, evaluation) over a host-stage
  reader: each row once, in row order, with the deterministic centre crop."""
  dataset = _dataset(folder)
  reader = _reader(dataset)
  per_example = jax.jit(lambda state, batch: jnp.concatenate(
      [batch["id"][:, None].astype(jnp.int32),
       batch["image"].reshape(batch["image"].shape[0], -1).astype(jnp.int32)], axis=1))
  out = steps.predict(per_example, None, reader, sharding.create_mesh(), 8)
  np.testing.assert_array_equal(out[:, 0], reader.ids)
  expected = reader.images(np.arange(len(reader))).reshape(len(reader), -1)
  np.testing.assert_array_equal(out[:, 1:], expected)
  assert reader.rows_read == 2 * len(reader) + (-len(reader)) % 8  # predict's + ours + padding
