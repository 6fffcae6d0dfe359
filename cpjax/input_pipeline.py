"""Datasets as host arrays, splits, and deterministic id-carrying batches.

Data is read once through tfds into host memory (CIFAR-size sets are a few
hundred MB at most) as uint8 images; normalisation and augmentation happen on
the device inside the jitted step. Every example keeps a stable integer `id`:
its index in the dataset's full tfds `train` split (or `test` split for test
examples). Batch order is a pure function of (seed, epoch, step), so a resumed
run sees the same batches; evaluation batches are padded and carry a `mask`
so every example is seen exactly once, whatever the batch or device count.

tensorflow_datasets is imported lazily here: the rest of cpjax runs without it.
"""

import dataclasses
import logging

import ml_collections
import numpy as np


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """Static facts about a dataset, known before any data is read."""
  tfds_name: str
  image_shape: tuple[int, int, int]
  num_classes: int
  num_train: int  # Size of the full tfds `train` split.
  mean: tuple[float, ...]  # Per-channel mean of pixel values scaled to [0, 1].
  std: tuple[float, ...]  # Per-channel standard deviation, same scale.
  local: bool  # Built by a cpjax builder from local files: never downloads.
  test_split: str = "test"


DATASETS = {
    # Mean/std of the 1,437 training images (`python -m cpjax.input_pipeline digits`).
    "digits": DatasetSpec("digits", (8, 8, 1), 10, 1437, (0.3054,), (0.3762,), local=True),
    "fashion_mnist": DatasetSpec("fashion_mnist_local", (28, 28, 1), 10, 60000,
                                 (0.2860,), (0.3530,), local=True),
    # tfds's own builder: needs the network once (config.dataset.download=True).
    "fashion_mnist_tfds": DatasetSpec("fashion_mnist", (28, 28, 1), 10, 60000,
                                      (0.2860,), (0.3530,), local=False),
    # The seed code's CIFAR statistics (spec §1.1).
    "cifar10": DatasetSpec("cifar10", (32, 32, 3), 10, 50000, (0.4914, 0.4822, 0.4465),
                           (0.2023, 0.1994, 0.2010), local=False),
    "cifar100": DatasetSpec("cifar100", (32, 32, 3), 100, 50000, (0.5071, 0.4865, 0.4409),
                            (0.2673, 0.2564, 0.2762), local=False),
    "svhn": DatasetSpec("svhn_cropped", (32, 32, 3), 10, 73257, (0.4377, 0.4438, 0.4728),
                        (0.1980, 0.2010, 0.1970), local=False),
}


@dataclasses.dataclass(frozen=True)
class Split:
  """One split in host memory, rows sorted by id."""
  images: np.ndarray  # uint8 [N, H, W, C]
  labels: np.ndarray  # int32 [N]
  ids: np.ndarray  # int32 [N], stable example ids

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, rows: np.ndarray) -> "Split":
    return Split(self.images[rows], self.labels[rows], self.ids[rows])


class DataNotFoundError(FileNotFoundError):
  """The dataset is not prepared locally and may not be downloaded."""


def _builder(spec: DatasetSpec, config: ml_collections.ConfigDict):
  """Returns a prepared tfds builder, or raises DataNotFoundError at once."""
  import tensorflow_datasets as tfds
  from cpjax import datasets  # pylint: disable=unused-import  (registers builders)

  data_dir = config.data_dir or None
  if spec.local:  # Our builders read local files; array_record reads without TF.
    builder = tfds.builder(spec.tfds_name, data_dir=data_dir, file_format="array_record")
    manual_dir = config.manual_dir or (datasets.fashion_mnist_local.DEFAULT_DIR
                                       if spec.tfds_name == "fashion_mnist_local" else None)
    if not builder.is_prepared():
      builder.download_and_prepare(
          download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    return builder
  builder = tfds.builder(spec.tfds_name, data_dir=data_dir)
  if builder.is_prepared():
    return builder
  if config.download or config.manual_dir:
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=config.manual_dir or None))
    return builder
  raise DataNotFoundError(
      f"tfds dataset {spec.tfds_name!r} is not prepared in {builder.data_dir!r} and "
      "cpjax does not download unless asked. Either (a) on a machine with network run "
      f"`python -c \"import tensorflow_datasets as tfds; tfds.builder('{spec.tfds_name}', "
      "data_dir='DIR').download_and_prepare()\"` and copy DIR here, passing "
      "--config.dataset.data_dir=DIR; (b) put the original archive in a folder and pass "
      "--config.dataset.manual_dir=FOLDER; or (c) with network, pass "
      "--config.dataset.download=True.")


def _parse_ids(raw: np.ndarray) -> np.ndarray:
  """tfds ids: ints already, or strings like b'train_16399' (CIFAR)."""
  if raw.dtype.kind in "iu":
    return raw.astype(np.int64)
  return np.array([int(s.rsplit(b"_", 1)[-1]) for s in raw], dtype=np.int64)


def _read_split(builder, split: str) -> Split:
  """Reads a whole split into host arrays sorted by id."""
  if builder.info.file_format.value == "array_record":
    source = builder.as_data_source(split)
    rows = source.__getitems__(list(range(len(source))))
    data = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
  else:  # tfrecord (tfds's default for its built-in datasets) needs TF to read.
    import tensorflow_datasets as tfds
    chunks = list(tfds.as_numpy(builder.as_dataset(split=split, batch_size=10_000)))
    data = {key: np.concatenate([c[key] for c in chunks]) for key in chunks[0]}
  # Without an id feature, the (deterministic) read order is the id.
  ids = _parse_ids(data["id"]) if "id" in data else np.arange(len(data["label"]))
  order = np.argsort(ids, kind="stable")
  return Split(images=np.asarray(data["image"], np.uint8)[order],
               labels=np.asarray(data["label"], np.int32)[order],
               ids=ids[order].astype(np.int32))


def get_test_split(config: ml_collections.ConfigDict, name: str) -> Split:
  """The test split of dataset `name` (e.g. an OOD set), read like `config.dataset`'s."""
  spec = DATASETS[name]
  return _read_split(_builder(spec, config), spec.test_split)


def carve_validation(num_train: int, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Seeded split of ids 0..num_train-1 into (train ids, val ids), each sorted.

  As in the seed code: a permutation of the train split, the last `val_size`
  ids become validation.
  """
  perm = np.random.default_rng(seed).permutation(num_train)
  return np.sort(perm[:-val_size]), np.sort(perm[-val_size:])


def num_train_examples(config: ml_collections.ConfigDict) -> int:
  """Training examples after the validation carve-out and any `train_examples` cap."""
  return config.train_examples or DATASETS[config.name].num_train - config.val_size


def get_datasets(config: ml_collections.ConfigDict) -> dict[str, Split]:
  """Returns {"train", "val", "test"} host splits for `config.dataset`."""
  spec = DATASETS[config.name]
  builder = _builder(spec, config)
  full_train = _read_split(builder, "train")
  if len(full_train) != spec.num_train or not np.array_equal(full_train.ids, np.arange(spec.num_train)):
    raise ValueError(f"{spec.tfds_name}: expected train ids 0..{spec.num_train - 1}, "
                     f"got {len(full_train)} examples")
  train_ids, val_ids = carve_validation(spec.num_train, config.val_size, config.split_seed)
  if config.train_examples:  # A seeded subset of the training ids, for quick studies.
    train_ids = np.sort(np.random.default_rng([config.split_seed, 1]).choice(
        train_ids, config.train_examples, replace=False))
  splits = {"train": full_train.take(train_ids), "val": full_train.take(val_ids),
            "test": _read_split(builder, spec.test_split)}
  logging.info("Dataset %s: %s", config.name, {k: len(v) for k, v in splits.items()})
  return splits


def epoch_order(seed: int, epoch: int, rows: np.ndarray, batch_size: int) -> np.ndarray:
  """Rows of one training epoch in batch order, as a pure function of (seed, epoch).

  The rows are shuffled and cycled to fill the last batch, so every row is
  trained at least once per epoch and every batch is full (BatchNorm sees no
  padding).

  Returns:
    int array [num_steps, batch_size], num_steps = ceil(len(rows) / batch_size).
  """
  shuffled = rows[np.random.default_rng([seed, epoch]).permutation(len(rows))]
  num_steps = -(-len(rows) // batch_size)
  return np.resize(shuffled, (num_steps, batch_size))


def batch_at(split: Split, rows: np.ndarray, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Gathers one host batch: image, label, id and mask (1 = real example)."""
  return {"image": split.images[rows], "label": split.labels[rows], "id": split.ids[rows],
          "mask": np.ones(len(rows), np.float32) if mask is None else mask}


def eval_batches(split: Split, batch_size: int):
  """Yields padded batches covering every row of `split` exactly once."""
  for start in range(0, len(split), batch_size):
    rows = np.arange(start, min(start + batch_size, len(split)))
    mask = np.zeros(batch_size, np.float32)
    mask[:len(rows)] = 1.0
    yield batch_at(split, np.pad(rows, (0, batch_size - len(rows))), mask)


def _print_stats(name: str) -> None:
  """Prints the per-channel mean/std of a dataset's training images."""
  config = ml_collections.ConfigDict(dict(name=name, data_dir="", manual_dir="", download=False,
                                          val_size=1, split_seed=0, train_examples=0))
  images = get_datasets(config)["train"].images.astype(np.float64) / 255.0
  axes = tuple(range(images.ndim - 1))
  print(name, "mean", images.mean(axes).round(4), "std", images.std(axes).round(4))


if __name__ == "__main__":
  import sys
  _print_stats(sys.argv[1])
