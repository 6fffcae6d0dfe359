"""Data: real bundled datasets, splits, determinism, id coverage, fast failure."""

import gzip
import os
import shutil
import socket
from unittest import mock

import ml_collections
import numpy as np
import pytest

from cpjax.data import input_pipeline, splits, tensorflow_optional
from cpjax.data.datasets import fashion_mnist_local
from tests import helpers
from tests.helpers import tiny_config


def dataset_config(**overrides) -> ml_collections.ConfigDict:
  return tiny_config(**{f"dataset.{k}": v for k, v in overrides.items()}).dataset


def test_digits_are_scikit_learns_digits(digits):
  from sklearn.datasets import load_digits
  ref = load_digits()
  assert sum(len(s) for s in digits.values()) == len(ref.images) == 1797
  # Every image is a real sklearn digit with its label (rescaled 0..16 -> 0..255).
  ref_images = np.round(ref.images * 255 / 16).astype(np.uint8)
  lookup = {img.tobytes(): lab for img, lab in zip(ref_images, ref.target)}
  for split in digits.values():
    for img, lab in zip(split.images[..., 0], split.labels):
      assert lookup[img.tobytes()] == lab


def test_train_val_partition_the_train_split_by_id(digits):
  train, val = digits["train"].ids, digits["val"].ids
  assert len(val) == 180 and len(np.intersect1d(train, val)) == 0
  np.testing.assert_array_equal(np.sort(np.concatenate([train, val])), np.arange(1437))
  # The same seed gives the same carve-out; another seed another one.
  a = splits.carve_validation(1437, 180, 42)[1]
  b = splits.carve_validation(1437, 180, 43)[1]
  np.testing.assert_array_equal(a, val)
  assert not np.array_equal(a, b)


def test_epoch_order_is_a_pure_function_covering_every_row():
  rows = np.arange(1000, 1100)
  order = splits.epoch_order(0, 3, rows, 32)
  assert order.shape == (4, 32)  # ceil(100 / 32) full batches.
  np.testing.assert_array_equal(np.unique(order), rows)  # Every row at least once.
  np.testing.assert_array_equal(order, splits.epoch_order(0, 3, rows, 32))
  assert not np.array_equal(order, splits.epoch_order(0, 4, rows, 32))
  assert not np.array_equal(order, splits.epoch_order(1, 3, rows, 32))


@pytest.mark.parametrize("batch_size", [1, 7, 64, 360, 1000])
def test_eval_batches_see_every_example_exactly_once(digits, batch_size):
  seen = []
  for rows, mask in splits.eval_rows(len(digits["test"]), batch_size):
    assert len(rows) == len(mask) == batch_size
    seen.extend(digits["test"].ids[rows[mask > 0]])
  np.testing.assert_array_equal(np.sort(seen), np.sort(digits["test"].ids))
  assert len(seen) == len(digits["test"])


@pytest.fixture
def fashion(fashion_mnist_tfds):
  return fashion_mnist_tfds[1]


def test_fashion_mnist_is_the_real_dataset(fashion):
  assert [len(fashion[s]) for s in ("train", "val", "test")] == [54000, 6000, 10000]
  # Upstream facts: 6,000 / 1,000 images per class; the first test labels.
  labels = np.concatenate([fashion["train"].labels, fashion["val"].labels])
  np.testing.assert_array_equal(np.bincount(labels), [6000] * 10)
  np.testing.assert_array_equal(np.bincount(fashion["test"].labels), [1000] * 10)
  np.testing.assert_array_equal(fashion["test"].labels[:10], [9, 2, 1, 1, 6, 1, 4, 6, 5, 7])
  assert fashion["test"].images.shape[1:] == (28, 28, 1)


def test_fashion_mnist_rejects_a_tampered_file(fashion_mnist_files, tmp_path):
  name = "t10k-labels-idx1-ubyte"
  with gzip.open(os.path.join(fashion_mnist_files, name + ".gz")) as f:
    raw = bytearray(f.read())
  raw[100] ^= 1  # One flipped bit in one label.
  (tmp_path / name).write_bytes(bytes(raw))
  with pytest.raises(ValueError, match="sha256 of the decompressed contents"):
    fashion_mnist_local.read_verified_idx(str(tmp_path), name)
  shutil.copy(os.path.join(fashion_mnist_files, name + ".gz"), tmp_path)
  with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
    fashion_mnist_local.read_verified_idx(str(tmp_path), "train-images-idx3-ubyte")


def test_missing_cifar_fails_at_once_with_instructions(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def no_download(*args, **kwargs):
    pytest.fail(f"download_and_prepare{args, kwargs} was called: cpjax must not download")
  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", no_download)
  with pytest.raises(input_pipeline.DataNotFoundError) as info:
    input_pipeline.get_datasets(dataset_config(name="cifar10", data_dir=str(tmp_path),
                                               val_size=5000))
  assert "--config.dataset.data_dir" in str(info.value)
  assert "download_and_prepare" in str(info.value)


def test_download_offline_fails_after_few_attempts_naming_the_dataset(tmp_path, monkeypatch):
  """download=True without network: a DataNotFoundError after 1 + DOWNLOAD_RETRIES attempts
  to reach the host, not tfds's own 11 with backoff (about 3.5 minutes offline). No packet
  leaves the machine: every name lookup fails here, as it does offline."""
  helpers.require_tensorflow()  # tfds builds CIFAR with it (else one line: the test below).
  lookups = []

  def offline(host, *args, **kwargs):
    lookups.append(host)
    raise socket.gaierror(socket.EAI_NONAME, "no network (this test)")
  monkeypatch.setattr(socket, "getaddrinfo", offline)
  with pytest.raises(input_pipeline.DataNotFoundError,
                     match="could not prepare tfds dataset 'cifar10'.*dataset.data_dir"):
    input_pipeline.get_datasets(dataset_config(name="cifar10", data_dir=str(tmp_path),
                                               val_size=5000, download=True))
  assert 1 <= len(lookups) <= 1 + input_pipeline.DOWNLOAD_RETRIES, lookups


def test_without_tensorflow_a_catalog_dataset_stops_in_one_line_saying_what_to_install(
    tmp_path, monkeypatch):
  """TensorFlow absent (as `tensorflow_optional.installed` says): preparing CIFAR-10, not
  having it prepared, or reading one prepared in tfds's default tfrecord format, stops before
  any download or read with one line naming the dataset and the requirements file."""
  import tensorflow_datasets as tfds
  monkeypatch.setattr(tensorflow_optional, "installed", lambda: False)
  with pytest.raises(input_pipeline.DataNotFoundError) as preparing:
    input_pipeline.get_datasets(dataset_config(name="cifar10", data_dir=str(tmp_path),
                                               val_size=5000, download=True))
  assert "preparing tfds dataset 'cifar10'" in str(preparing.value)
  assert "requirements-tf.txt" in str(preparing.value) and "\n" not in str(preparing.value)
  # Not prepared and not to be prepared (no download, no manual_dir): the ways to prepare it,
  # and, in the same line, that preparing it here needs TensorFlow.
  with pytest.raises(input_pipeline.DataNotFoundError) as missing:
    input_pipeline.get_datasets(dataset_config(name="cifar10", data_dir=str(tmp_path),
                                               val_size=5000))
  assert "tfds dataset 'cifar10' is not prepared" in str(missing.value)
  assert str(missing.value).endswith(
      "pass --config.dataset.download=True; preparing it here needs TensorFlow, which is not "
      "installed: pip install -r requirements-tf.txt (or: pip install 'cpjax[tf]').")
  assert "\n" not in str(missing.value)
  with mock.patch.object(tfds.core.DatasetBuilder, "is_prepared", return_value=True), \
       pytest.raises(input_pipeline.DataNotFoundError) as reading:
    input_pipeline.get_datasets(dataset_config(name="cifar10", data_dir=str(tmp_path),
                                               val_size=5000))
  assert "reading tfds dataset 'cifar10'" in str(reading.value)
  assert "(tfrecord files) needs TensorFlow" in str(reading.value)


def _mock_cifar(self, split, **unused):
  """MOCK DATA for tfds.testing.mock_data: random-noise images, CIFAR-shaped,
  with CIFAR's id strings. Never used for accuracy claims."""
  import tensorflow as tf
  n = {"train": 50000, "test": 10000}[split]
  rng = np.random.default_rng(0)
  ids = np.array([f"{split}_{i:05d}".encode() for i in rng.permutation(n)])
  return tf.data.Dataset.from_tensor_slices({
      "image": rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
      "label": rng.integers(0, 10, n), "id": ids})


@pytest.mark.slow  # 60,000 mock rows through tfds.
def test_cifar_builder_path_on_tfds_mock_data(tmp_path):
  """tfds's own cifar10 builder read through our pipeline, on MOCK data
  (tfds.testing.mock_data): this checks code paths only."""
  helpers.require_tensorflow()  # tfds reads tfrecord datasets (its mock too) with it.
  import tensorflow_datasets as tfds
  with tfds.testing.mock_data(as_dataset_fn=_mock_cifar), \
       mock.patch.object(tfds.core.DatasetBuilder, "is_prepared", return_value=True):
    splits = input_pipeline.get_datasets(dataset_config(name="cifar10", data_dir=str(tmp_path),
                                                        val_size=5000))
  assert [len(splits[s]) for s in ("train", "val", "test")] == [45000, 5000, 10000]
  assert splits["train"].images.shape[1:] == (32, 32, 3)
  np.testing.assert_array_equal(splits["test"].ids, np.arange(10000))  # Parsed, sorted.
