"""Splits as array_record files, read by index with grain: data larger than host memory.

A split `name` in `directory` is

  name.array_record-00000-of-0000S ...  one record per row, in row order: the row's
                                         uint8 image, raw (H * W * C bytes, no codec),
                                         or (`encoded`) its encoded file bytes as they
                                         were (JPEG, PNG, ...: cpjax.data.record_source)
  name.index.npz                         labels [N] int32, ids [N] int32, image_shape
                                         (() when encoded), encoded,
                                         the dataset config fields that decide the
                                         split's ids (so a mismatched directory is refused),
                                         each shard's size in bytes and each record's
                                         CRC-32 (so a damaged file is refused)

so a reader holds labels and ids (8 bytes per example) and array_record's
per-record offsets in memory, never the images. `check_files` (run at start-up) compares
the shard sizes with the index and reads a sample of records against their CRC-32; every
record read later is checked too, and a damaged one raises `DamagedRecordError` naming the
file and the record: a garbled image never reaches training. `write_split` takes an iterator
of (id, label, image), so a set larger than memory can be written as it is read;
`write_splits` writes the splits of a dataset config. `stream_reader` builds a
`readers.StreamReader` over `RecordImages`, which reads rows with grain's
ArrayRecordDataSource and reads upcoming batches ahead in background threads
(grain's MapDataset -> IterDataset with ReadOptions); the stream kind of reader
(readers.READERS, registered here) builds one for each split of a run.
"""

from collections.abc import Iterable, Mapping
import os
import threading
import zlib

from array_record.python import array_record_module
import jax
import ml_collections
import numpy as np

from cpjax.data import readers, splits
from cpjax.runtime.advised import AdvisedError

# The dataset config fields that decide which ids each split holds (cpjax.data.splits).
SPLIT_FIELDS = ("name", "val_size", "split_seed", "train_examples", "meta_val_size")


def _shard_paths(directory: str, name: str, num_shards: int) -> list[str]:
  return [os.path.join(directory, f"{name}.array_record-{i:05d}-of-{num_shards:05d}")
          for i in range(num_shards)]


def write_split(examples: Iterable[tuple[int, int, np.ndarray | bytes]], num_examples: int,
                directory: str, name: str, split_key: Mapping[str, object],
                num_shards: int = 1, encoded: bool = False) -> list[str]:
  """Writes `num_examples` (id, label, uint8 image) in order as split `name`; returns the
  shard paths. Shard i holds rows [i N // S, (i + 1) N // S): none is empty when N >= S.
  With `encoded`, each example's third item is its encoded image bytes, stored as they are.

  Raises:
    ValueError: no examples, more shards than examples, an image that is not uint8 or not
      of the first image's shape (encoded: not bytes), or fewer or more examples than
      `num_examples`.
  """
  if not 0 < num_shards <= num_examples:
    raise ValueError(f"split {name}: {num_examples} examples in {num_shards} shards; need "
                     "1 <= shards <= examples")
  os.makedirs(directory, exist_ok=True)
  paths = _shard_paths(directory, name, num_shards)
  shard_of_start = {i * num_examples // num_shards: i for i in range(num_shards)}
  labels, ids = np.zeros(num_examples, np.int32), np.zeros(num_examples, np.int32)
  crc32 = np.zeros(num_examples, np.uint32)
  image_shape, writer, written = None, None, 0
  try:
    for row, (example_id, label, image) in enumerate(examples):
      if row >= num_examples:
        raise ValueError(f"split {name}: more than the {num_examples} examples announced")
      if row in shard_of_start:
        if writer is not None:
          writer.close()
        # One record per group, no codec: a row is read alone and costs no decompression.
        writer = array_record_module.ArrayRecordWriter(paths[shard_of_start[row]],
                                                       "group_size:1,uncompressed")
      record, image_shape = _record(image, encoded, image_shape, row, name)
      writer.write(record)
      labels[row], ids[row], crc32[row] = label, example_id, zlib.crc32(record)
      written = row + 1
  finally:
    if writer is not None:
      writer.close()
  if written != num_examples:
    raise ValueError(f"split {name}: {written} examples written, {num_examples} announced")
  # The index last: a directory whose index exists was written whole.
  np.savez(os.path.join(directory, f"{name}.index.npz"), labels=labels, ids=ids,
           image_shape=np.asarray(image_shape, np.int64), num_shards=num_shards, crc32=crc32,
           encoded=encoded,
           shard_bytes=np.asarray([os.path.getsize(p) for p in paths], np.int64),
           **{f"split_{k}": np.asarray(v) for k, v in split_key.items()})
  return paths


def _record(image: np.ndarray | bytes, encoded: bool, image_shape: tuple | None, row: int,
            name: str) -> tuple[bytes, tuple]:
  """(the record of one example, the split's image shape: () when encoded)."""
  if encoded:
    if not isinstance(image, (bytes, bytearray)):
      raise ValueError(f"row {row} of {name}: an encoded split takes bytes, got "
                       f"{type(image).__name__}")
    return bytes(image), ()
  image = np.asarray(image)
  if image.dtype != np.uint8:
    raise ValueError(f"row {row} of {name}: image dtype {image.dtype}, must be uint8")
  image_shape = image.shape if image_shape is None else image_shape
  if image.shape != image_shape:
    raise ValueError(f"row {row} of {name} has image shape {image.shape}, not {image_shape}")
  return np.ascontiguousarray(image).tobytes(), image_shape


def split_key(dataset: ml_collections.ConfigDict) -> dict[str, object]:
  return {field: dataset.get(field, 0) for field in SPLIT_FIELDS}


def write_splits(split_by_name: Mapping[str, splits.Split], directory: str,
                 dataset: ml_collections.ConfigDict, num_shards: int = 4) -> None:
  """Writes host splits (input_pipeline.get_datasets of `dataset`) as array_record files."""
  for name, split in split_by_name.items():
    examples = ((split.ids[r], split.labels[r], split.images[r]) for r in range(len(split)))
    write_split(examples, len(split), directory, name, split_key(dataset),
                max(1, min(num_shards, len(split))))


def read_index(directory: str, name: str, dataset: ml_collections.ConfigDict | None = None,
               encoded: bool = False) -> tuple[splits.Split, tuple[int, ...], list[str]]:
  """(the split without images, image shape, shard paths) of split `name`; with `dataset`,
  raises unless the files hold exactly that config's ids of the split.

  Raises:
    FileNotFoundError: no such split in `directory`, or a shard file is missing.
    ValueError: the files were written for other split ids than `dataset`'s, or hold
      encoded images where `encoded` is False (or raw ones where it is True).
  """
  path = os.path.join(directory, f"{name}.index.npz")
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"no array_record split {name!r} in {directory!r} ({path} is missing); write it with "
        "python -m scripts.write_array_records --config=... --out=DIR")
  index = np.load(path)
  written_encoded = bool(index["encoded"]) if "encoded" in index.files else False
  if written_encoded != encoded:
    raise ValueError(
        f"{directory} holds {'encoded' if written_encoded else 'raw'} images (written for "
        f"dataset.name={index['split_name'].item() if 'split_name' in index.files else '?'!r}"
        f"), this run reads {'encoded' if encoded else 'raw'} ones: encoded records are "
        "written for folder and tfds:NAME datasets, raw ones for the built-in datasets")
  split = splits.Split(None, index["labels"], index["ids"])
  if dataset is not None:
    _check_written_for(index, split, name, directory, dataset)
  paths = _shard_paths(directory, name, int(index["num_shards"]))
  missing = [p for p in paths if not os.path.exists(p)]
  if missing:
    raise FileNotFoundError(f"{directory}: shard files of {name} are missing: {missing}")
  return split, tuple(int(d) for d in index["image_shape"]), paths


def _check_written_for(index, split: splits.Split, name: str, directory: str,
                       dataset: ml_collections.ConfigDict) -> None:
  """Raises unless `index` was written with `dataset`'s split fields and holds its ids."""
  for field, ours in split_key(dataset).items():
    key = f"split_{field}"
    theirs = index[key].item() if key in index.files else "(not recorded)"
    if theirs != ours:
      raise ValueError(f"{directory} holds splits written with dataset.{field}={theirs!r}, "
                       f"this run has {ours!r}: rewrite them for this config")
  expected = splits.split_ids(dataset).get(name)  # The test split's ids are its own.
  if expected is not None and not np.array_equal(split.ids, expected):
    raise ValueError(f"{directory}: split {name} holds {len(split)} ids that are not this "
                     f"config's {len(expected)} {name} ids: rewrite it for this config")


class DamagedRecordError(AdvisedError, ValueError):
  """A record of an array_record split is unreadable or differs from what was written (the
  message names the file, the record and how to rewrite it)."""


_REWRITE = "rewrite the split with python -m scripts.write_array_records --config=... --out=DIR"


def _open_source(paths: list[str]):
  """grain's ArrayRecordDataSource over `paths`; array_record's bare errors named by file."""
  import grain  # Here: only streamed splits read with grain; a run of in-memory data doesn't
  # pay its import (with its dependencies, about half a second).
  try:
    return grain.sources.ArrayRecordDataSource(paths)
  except Exception as err:  # pylint: disable=broad-except  (array_record: bare RuntimeError)
    for path in paths:  # Which file: open each alone.
      try:
        grain.sources.ArrayRecordDataSource([path])
      except Exception:  # pylint: disable=broad-except
        raise DamagedRecordError(f"{path} is not a readable array_record file "
                                 f"({type(err).__name__}: {str(err)[:200]}); {_REWRITE}") from err
    raise


class RecordImages:
  """Random access to a split's images by row: grain's ArrayRecordDataSource over its shards.

  With `crc32` (each row's CRC-32, from the index), every record read is checked against it.
  With `encoded`, records are encoded images of any length (`read_records`); otherwise each
  is one raw image of `image_shape` (`read`).
  """

  def __init__(self, paths: list[str], image_shape: tuple[int, ...], num_rows: int,
               crc32: np.ndarray | None = None, encoded: bool = False):
    self._source = _open_source(paths)
    if len(self._source) != num_rows:  # E.g. an old index beside rewritten shards.
      raise ValueError(f"{len(self._source)} records in {paths[0]} ..., the index names "
                       f"{num_rows} rows: rewrite the split")
    self._paths, self._crc32 = paths, crc32
    self._record_bytes = None if encoded else int(np.prod(image_shape))
    self.image_shape = image_shape
    self.rows_read = 0  # Rows this process has read (grain's threads add to it).
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._source)

  def read(self, rows: np.ndarray) -> np.ndarray:
    """uint8 images [len(rows), *image_shape] of `rows`, read from the files."""
    records = self.read_records(rows)
    return np.frombuffer(b"".join(records), np.uint8).reshape((len(rows),) + self.image_shape)

  def read_records(self, rows: np.ndarray) -> list[bytes]:
    """The records of `rows` as written, each checked (DamagedRecordError naming it)."""
    with self._lock:
      self.rows_read += len(rows)
    try:
      # One row (the host stage's reads): indexing, ~10 us; __getitems__ starts a thread
      # pool per call (~0.5 ms), which pays only for many rows at once.
      records = ([self._source[int(rows[0])]] if len(rows) == 1
                 else self._source.__getitems__([int(r) for r in rows]))
    except Exception as err:  # pylint: disable=broad-except  (array_record: bare RuntimeError)
      raise self._damaged(self._first_unreadable(rows), f"unreadable ({type(err).__name__}: "
                          f"{str(err)[:200]})") from err
    for row, record in zip(rows, records):
      self._check(int(row), record)
    return records

  def location(self, row: int) -> tuple[str, int]:
    """(shard path, record index in it) of `row` (shard i holds rows [i N // S, (i+1) N // S))."""
    num_rows, num_shards = len(self._source), len(self._paths)
    starts = [i * num_rows // num_shards for i in range(num_shards)]
    shard = int(np.searchsorted(starts, row, side="right")) - 1
    return self._paths[shard], row - starts[shard]

  def _damaged(self, row: int, what: str) -> DamagedRecordError:
    path, record = self.location(row)
    return DamagedRecordError(f"{path}: record {record} (row {row} of the split) is {what}; "
                              f"{_REWRITE}")

  def _first_unreadable(self, rows: np.ndarray) -> int:
    """The first of `rows` that array_record cannot read alone (the first row if none)."""
    for row in rows:
      try:
        self._source.__getitems__([int(row)])
      except Exception:  # pylint: disable=broad-except
        return int(row)
    return int(rows[0])

  def _check(self, row: int, record: bytes) -> None:
    if self._record_bytes is not None and len(record) != self._record_bytes:
      raise self._damaged(row, f"{len(record)} bytes, not {self._record_bytes}")
    if self._crc32 is not None and zlib.crc32(record) != int(self._crc32[row]):
      raise self._damaged(row, "damaged (its CRC-32 differs from the one written)")

  def prefetched(self, row_blocks: np.ndarray, num_threads: int, buffer_size: int):
    """Yields read(block) for each block [b] of `row_blocks` [S, b] in order, read ahead by
    grain's threads (deterministic: the order is fixed before reading starts)."""
    import grain  # Here, as in `_open_source`.
    blocks = grain.MapDataset.range(len(row_blocks)).map(lambda s: self.read(row_blocks[s]))
    yield from blocks.to_iter_dataset(grain.ReadOptions(num_threads=num_threads,
                                                        prefetch_buffer_size=buffer_size))


def stream_reader(directory: str, name: str, mesh: jax.sharding.Mesh,
                  dataset: ml_collections.ConfigDict | None = None) -> readers.StreamReader:
  """The stream reader of split `name` in `directory` (checked against `dataset` if given)."""
  split, image_shape, paths = read_index(directory, name, dataset)
  depth = readers.DEFAULT_PREFETCH_DEPTH if dataset is None else dataset.prefetch_depth
  return readers.StreamReader(RecordImages(paths, image_shape, len(split),
                                           _index_field(directory, name, "crc32")), split, mesh,
                              prefetch_depth=depth)


def _stream_readers(build: readers.Build) -> dict[str, readers.StreamReader]:
  """The stream kind's readers of a run (input_pipeline.choose): every split from its files in
  dataset.stream_dir."""
  dataset = build.dataset
  names = ["train", "val", "test"] + (["meta_val"] if dataset.meta_val_size else [])
  return {name: stream_reader(dataset.stream_dir, name, build.mesh, dataset) for name in names}


readers.READERS.register(readers.ReaderKind(
    "stream", "the splits' array_record files, each process reading its rows", _stream_readers))


def _index_field(directory: str, name: str, field: str) -> np.ndarray | None:
  """A field of split `name`'s index, or None in an index written before it was recorded."""
  index = np.load(os.path.join(directory, f"{name}.index.npz"))
  return index[field] if field in index.files else None


def open_records(directory: str, name: str, dataset: ml_collections.ConfigDict | None = None,
                 encoded: bool = False) -> tuple[splits.Split, RecordImages]:
  """(the split without images, its records) of split `name`, as `read_index` checks it."""
  split, image_shape, paths = read_index(directory, name, dataset, encoded)
  return split, RecordImages(paths, image_shape, len(split),
                             _index_field(directory, name, "crc32"), encoded)


def check_files(directory: str, name: str, dataset: ml_collections.ConfigDict | None = None,
                sample: int = 16, encoded: bool = False) -> None:
  """Start-up check of split `name`: its index (as `read_index`), each shard's size against
  the size written, and the first, the last and `sample` random records (a fixed seed)
  against their CRC-32. Reads a few records, not the split.

  Raises:
    FileNotFoundError, ValueError: as `read_index`.
    DamagedRecordError: a shard of another size than written, or a sampled record damaged.
  """
  split, _, paths = read_index(directory, name, dataset, encoded)
  sizes = _index_field(directory, name, "shard_bytes")
  for path, size in zip(paths, sizes if sizes is not None else []):
    if os.path.getsize(path) != int(size):
      raise DamagedRecordError(f"{path} is {os.path.getsize(path)} bytes, {int(size)} were "
                               f"written: the file is truncated or damaged; {_REWRITE}")
  _, images = open_records(directory, name, dataset, encoded)
  rows = np.random.default_rng(0).integers(0, len(split), min(sample, len(split)))
  images.read_records(np.unique(np.concatenate([[0, len(split) - 1], rows])))
