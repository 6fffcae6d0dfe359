"""The edge of the input pipeline: a run's datasets opened, prepared and read, and `load`,
which gives a run its splits and their readers of the kind `choose` picks.

A built-in dataset (cpjax.data.specs: digits, Fashion-MNIST, CIFAR-10/100, SVHN) is read
through its tfds builder (cpjax's own builders, cpjax.data.datasets, read local files and
never download; tfds's built-in ones download only when asked: `open_or_prepare`) into
host memory as uint8 images sorted by example id (`get_datasets`; CIFAR-size sets are a
few hundred MB at most), or, converted once by scripts/write_array_records.py, streamed
from array_record files; normalisation and augmentation happen on the device inside the
jitted step (cpjax.data.augment). An encoded dataset (a folder of images, tfds:NAME, or
their converted records: cpjax.data.sources) holds labels and ids only; its images are
decoded, cropped and flipped per batch, on the host (cpjax.data.host_stage) or on the
devices (cpjax.data.device_stage).

`choose`, the one place where a run's kind of reader (cpjax.data.readers) is picked, reads
config.dataset and the dataset's facts:

  an encoded dataset (`DatasetSpec.encoded`): by dataset.decode: cpu, host_stage; a decoder
      (cpjax.data.device_stage.decoders: gpu, nvImageCodec; device_cpu, PIL standing in for
      it), device_stage; auto, gpu where it can run (an NVIDIA GPU, nvImageCodec, and
      dataset.resize the device op's), else cpu. dataset.reader says what the stage reads:
      the source (host), its converted records in dataset.stream_dir (stream), or those
      where stream_dir is set (auto).
  an in-memory dataset: by dataset.reader: stream, or auto when `dataset.stream_dir` is set
      and the training split is larger than `dataset.host_memory_mb` (`streams`); else the
      splits are read into memory and it is host, device, or for auto device when they fit
      `dataset.device_memory_mb` on each device (Fashion-MNIST: 52 MiB, CIFAR-10: 176 MiB;
      on CPU, where every device is host memory, all copies together), else host.
"""
from collections.abc import Mapping
import contextlib
import logging
import math
from typing import Any

import jax
import ml_collections
import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core.download import downloader as tfds_downloader

# array_records, device_stage and host_stage register their kinds of reader
# (readers.READERS), which `load` builds through `choose`.
from cpjax.data import (
  array_records,  # noqa: F401
  datasets,
  host_stage,  # noqa: F401
  readers,
  sources,
  specs,
  split_cache,
  splits,
  tensorflow_optional,
)
from cpjax.data.device_stage import decoders, reader  # noqa: F401
from cpjax.data.splits import Split


class DataNotFoundError(FileNotFoundError):
  """The dataset is not prepared locally and may not be downloaded."""


# Prepared builders by (tfds name, data_dir): the start-up check opens a dataset and the run
# reads it through the same builder (its dataset_info read once), while it stays prepared.
_OPENED: dict[tuple[str, str | None], Any] = {}


def _builder(spec: specs.DatasetSpec, config: ml_collections.ConfigDict):
  """Returns a prepared tfds builder (preparing it now if it is to be prepared: a cpjax
  local builder, download or manual_dir), or raises DataNotFoundError at once."""
  key = (spec.tfds_name, config.data_dir or None)
  opened = _OPENED.get(key)
  if opened is not None and opened.is_prepared():
    return opened
  _OPENED[key] = _open_builder(spec, config)
  return _OPENED[key]


def _open_builder(spec: specs.DatasetSpec, config: ml_collections.ConfigDict):
  """`_builder`'s tfds builder, opened (and prepared, where it is to be) now."""
  data_dir = config.data_dir or None
  if spec.local:  # Our builders read local files; array_record reads without TF.
    builder = tfds.builder(spec.tfds_name, data_dir=data_dir, file_format="array_record")
    manual_dir = config.manual_dir or (datasets.fashion_mnist_local.DEFAULT_DIR
                                       if spec.tfds_name == "fashion_mnist_local" else None)
    if not builder.is_prepared():
      _prepare_local(builder, manual_dir)
    return builder
  builder = tfds.builder(spec.tfds_name, data_dir=data_dir)
  if builder.is_prepared():
    _check_readable(builder)
    return builder
  if config.download or config.manual_dir:
    _download_and_prepare(builder, config.manual_dir or None)
    return builder
  raise _not_prepared(spec, builder)


def _check_readable(builder) -> None:
  """Raises DataNotFoundError (one line: what to install) for a prepared tfds dataset stored
  as tfrecord files where TensorFlow, which alone reads them, is not installed."""
  if builder.info.file_format.value != "array_record" and not tensorflow_optional.installed():
    raise DataNotFoundError(tensorflow_optional.missing_message(
        f"reading tfds dataset {builder.name!r} in {builder.data_dir!r} (tfrecord files)"))


def _prepare_local(builder, manual_dir: str | None) -> None:
  """Prepares a cpjax local builder from its files; a failure names the dataset, the folder
  and the error in one DataNotFoundError."""
  try:
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
  except Exception as err:  # Missing or damaged files, in whatever form tfds reports them.
    raise DataNotFoundError(
        f"could not prepare dataset {builder.name!r} in {builder.data_dir!r} from the files "
        f"in {manual_dir!r}: {type(err).__name__}: {str(err)[:500]}") from err


def _not_prepared(spec: specs.DatasetSpec, builder) -> DataNotFoundError:
  return DataNotFoundError(
      f"tfds dataset {spec.tfds_name!r} is not prepared in {builder.data_dir!r} and "
      "cpjax does not download unless asked. Either (a) on a machine with network run "
      f"`python -c \"import tensorflow_datasets as tfds; tfds.builder('{spec.tfds_name}', "
      "data_dir='DIR').download_and_prepare()\"` and copy DIR here, passing "
      "--config.dataset.data_dir=DIR; (b) put the original archive in a folder and pass "
      "--config.dataset.manual_dir=FOLDER; or (c) with network, pass "
      f"--config.dataset.download=True{tensorflow_optional.preparing_note()}.")


def open_or_prepare(name: str, config: ml_collections.ConfigDict) -> None:
  """Makes sure dataset `name` can be read as `config` (a dataset config) would read it,
  before a run's first step: a prepared dataset is opened; one to be prepared (a cpjax local
  builder, download=True or a manual_dir) is prepared now, so that its failure (an archive
  that fails tfds's checksum, no network) comes before training, not after it. Each
  dataset goes through its own tfds builder. The splits the run reads (train and the test
  split) must be listed in the prepared dataset.

  Raises:
    DataNotFoundError: not prepared and not to be prepared, or its preparation failed, or
      a split is missing; the message names the dataset and the ways to prepare it.
  """
  if sources.is_source_name(name):  # Read (and named when missing) by sources.resolve.
    sources.resolve(config)
    return
  spec = specs.DATASETS[name]
  builder = _builder(spec, config)
  missing = [s for s in ("train", spec.test_split) if s not in builder.info.splits]
  if missing:
    raise DataNotFoundError(
        f"tfds dataset {spec.tfds_name!r} in {builder.data_dir!r} has no split "
        f"{', '.join(map(repr, missing))} (it has {sorted(builder.info.splits)}); prepare it "
        "again")


# tfds retries a failed download MAX_RETRIES=10 times with exponential backoff (0.2 s * 2^i):
# offline that is about 3.5 minutes of silence before the error. Two retries still ride out
# a brief network hiccup, and an offline machine fails in about a second.
DOWNLOAD_RETRIES = 2


@contextlib.contextmanager
def _download_retries(retries: int):
  """Sets tfds's download retry count (a module constant it reads at each download)."""
  previous = getattr(tfds_downloader, "MAX_RETRIES", None)
  if previous is None:  # Another tfds version: leave its own retry policy alone.
    yield
    return
  tfds_downloader.MAX_RETRIES = retries
  try:
    yield
  finally:
    tfds_downloader.MAX_RETRIES = previous


def _download_and_prepare(builder, manual_dir: str | None) -> None:
  """download_and_prepare with few retries; a failure names the dataset and the ways out."""
  if not tensorflow_optional.installed():  # tfds encodes the catalog's images with it.
    raise DataNotFoundError(tensorflow_optional.missing_message(
        f"preparing tfds dataset {builder.name!r} in {builder.data_dir!r}"))
  logging.info("Preparing tfds dataset %r in %s (downloading unless manual_dir has it).",
               builder.name, builder.data_dir)
  try:
    with _download_retries(DOWNLOAD_RETRIES):
      builder.download_and_prepare(
          download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
  except Exception as err:  # tfds raises many kinds; all mean "not prepared".
    raise DataNotFoundError(
        f"could not prepare tfds dataset {builder.name!r} in {builder.data_dir!r} "
        f"(manual_dir={manual_dir!r}): {type(err).__name__}: {str(err)[:500]}. Without "
        "network, prepare it on a machine with network and pass "
        "--config.dataset.data_dir=DIR, or put the original archive in a folder and pass "
        "--config.dataset.manual_dir=FOLDER.") from err


def _parse_ids(raw: np.ndarray) -> np.ndarray:
  """tfds ids: ints already, or strings like b'train_16399' (CIFAR)."""
  if raw.dtype.kind in "iu":
    return raw.astype(np.int64)
  return np.array([int(s.rsplit(b"_", 1)[-1]) for s in raw], dtype=np.int64)


def _read_split(builder, split: str) -> Split:
  """Reads a whole split into host arrays sorted by id; an array_record split through its
  decoded arrays kept beside the dataset (cpjax.data.split_cache)."""
  if builder.info.file_format.value == "array_record":
    paths = [str(p) for p in builder.info.splits[split].filepaths]
    return split_cache.read(builder.data_dir, split, paths,
                            lambda: _decode_split(builder, split))
  return _decode_split(builder, split)


def _decode_split(builder, split: str) -> Split:
  """Decodes a whole split out of its tfds files into host arrays sorted by id."""
  if builder.info.file_format.value == "array_record":
    source = builder.as_data_source(split)
    rows = source.__getitems__(list(range(len(source))))
    data = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
  else:  # tfrecord (tfds's default for its built-in datasets) needs TF to read.
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
  spec = specs.DATASETS[name]
  return _read_split(_builder(spec, config), spec.test_split)


def get_datasets(config: ml_collections.ConfigDict) -> dict[str, Split]:
  """Returns {"train", "val", "test"} host splits for `config.dataset`, and "meta_val"
  with a `meta_val_size` (FL_gamma's meta-validation batches)."""
  if sources.is_source_name(config.name):
    raise ValueError(f"dataset {config.name!r} is not read into memory: its images are decoded "
                     "per batch by the host stage (input_pipeline.load)")
  spec = specs.DATASETS[config.name]
  builder = _builder(spec, config)
  full_train = _read_split(builder, "train")
  if (len(full_train) != spec.num_train
      or not np.array_equal(full_train.ids, np.arange(spec.num_train))):
    raise ValueError(f"{spec.tfds_name}: expected train ids 0..{spec.num_train - 1}, "
                     f"got {len(full_train)} examples")
  ids = splits.split_ids(config)
  if config.get("label_noise", 0.0):  # Generated noise on real images; val and test stay clean.
    full_train = Split(full_train.images, splits.noisy_labels(
        full_train.labels, ids["pool"], config.label_noise, config.label_noise_seed,
        spec.num_classes), full_train.ids)
  result = {"train": full_train.take(ids["train"]), "val": full_train.take(ids["val"]),
            "test": _read_split(builder, spec.test_split)}
  if len(ids["meta_val"]):
    result["meta_val"] = full_train.take(ids["meta_val"])
  logging.info("Dataset %s: %s", config.name, {k: len(v) for k, v in result.items()})
  return result


# ------------------------------------------------------------------ the choice of a reader


def split_bytes(split_by_name: Mapping[str, splits.Split]) -> int:
  """Bytes of images, labels and ids of every split: what the device reader puts on a device."""
  return sum(s.images.nbytes + s.labels.nbytes + s.ids.nbytes for s in split_by_name.values())


def train_bytes(dataset: ml_collections.ConfigDict) -> int:
  """The full training split's image bytes, from the dataset's facts (nothing is read)."""
  spec = specs.DATASETS[dataset.name]
  return spec.num_train * math.prod(spec.image_shape)


def streams(dataset: ml_collections.ConfigDict) -> bool:
  """Whether a run of `dataset` reads its splits from array_record files of pixels (never an
  encoded dataset's: a stage reads those, its converted records too)."""
  if specs.DATASETS[dataset.name].encoded:
    return False
  return dataset.reader == "stream" or (
      dataset.reader == "auto" and bool(dataset.stream_dir)
      and train_bytes(dataset) > dataset.host_memory_mb * 2**20)


def in_memory_kind(choice: str, num_bytes: int, budget_mb: float, copies: int = 1) -> str:
  """The in-memory kind `choice` (dataset.reader) asks for: host or device as named, or for
  auto, device when `copies` copies of `num_bytes` fit `budget_mb` (CPU "devices" share host
  memory: one copy each), else host."""
  if choice not in IN_MEMORY_READERS:
    raise ValueError(f"dataset.reader={choice!r}; valid: {', '.join(READER_CHOICES)}")
  fits = num_bytes * copies <= budget_mb * 2**20
  if choice == "device" and not fits:
    logging.warning("dataset.reader='device' puts %.1f MiB x %d on the devices, over "
                    "dataset.device_memory_mb=%.0f.", num_bytes / 2**20, copies, budget_mb)
  if choice != "auto":
    return choice
  return "device" if fits else "host"



READER_CHOICES = ("auto", "host", "device", "stream")  # dataset.reader's valid values.
IN_MEMORY_READERS = ("auto", "host", "device")  # Those of an in-memory run.
# Those of an encoded dataset: host reads the source, stream its converted records
# (dataset.stream_dir), auto the records where stream_dir is set, else the source.
SOURCE_READERS = ("auto", "host", "stream")


def choose(dataset: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, seed: int
           ) -> dict[str, readers.Reader]:
  """A run's readers, one a split (train, val, test, and meta_val with a meta_val_size), of
  the kind that `dataset` (config.dataset) asks for: the one place where dataset.decode,
  dataset.reader and the dataset's facts pick it (the module docstring), logged. The splits
  are read into memory for an in-memory kind only; `seed`: the stages' crops and flips."""
  spec, decode, in_memory = specs.DATASETS[dataset.name], decoders.HOST_DECODE, {}
  if spec.encoded:
    decode = decoders.resolved_decode(dataset)
    kind = "host_stage" if decode == decoders.HOST_DECODE else "device_stage"
  elif streams(dataset):
    kind = "stream"
  else:
    if dataset.stream_dir:
      logging.info("dataset.stream_dir=%s is not read: dataset.reader=%r and the training "
                   "split fits dataset.host_memory_mb.", dataset.stream_dir, dataset.reader)
    in_memory = get_datasets(dataset)
    # On CPU the devices are host memory: each holds a copy, and the budget covers them all.
    copies = jax.local_device_count() if jax.default_backend() == "cpu" else 1
    kind = in_memory_kind(dataset.reader, split_bytes(in_memory), dataset.device_memory_mb,
                          copies)
  by_name = readers.READERS[kind].create(readers.Build(
      dataset, spec, mesh, seed, decode, in_memory,
      lambda: (sources.open_splits(dataset), sources.read_from(dataset))))
  # Labels and ids (8 bytes an example) are all that the other kinds hold in memory.
  num_bytes = split_bytes(in_memory) if in_memory else 8 * sum(map(len, by_name.values()))
  logging.info("Data reader: %s (dataset.reader=%s); %.1f MiB of splits in memory, device "
               "budget %.0f MiB.", kind, dataset.reader, num_bytes / 2**20,
               dataset.device_memory_mb)
  return by_name


def load(dataset: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, seed: int = 0
         ) -> tuple[dict[str, Split], dict[str, readers.Reader]]:
  """A run's splits (train, val, test, and meta_val with a meta_val_size) and the readers
  that put their batches on `mesh`, of the kind `choose` picks for `dataset`
  (config.dataset). Streamed splits and those of an encoded dataset (folder, tfds:NAME;
  decoded per batch, the crops drawn from `seed`) hold no images."""
  by_name = choose(dataset, mesh, seed)
  return {name: each.split for name, each in by_name.items()}, by_name


def _print_stats(name: str) -> None:
  """Prints the per-channel mean/std of a dataset's training images."""
  config = ml_collections.ConfigDict(dict(name=name, data_dir="", manual_dir="", download=False,
                                          val_size=1, split_seed=0, train_examples=0,
                                          meta_val_size=0))
  images = get_datasets(config)["train"].images.astype(np.float64) / 255.0
  axes = tuple(range(images.ndim - 1))
  print(name, "mean", images.mean(axes).round(4), "std", images.std(axes).round(4))


if __name__ == "__main__":
  import sys
  _print_stats(sys.argv[1])
