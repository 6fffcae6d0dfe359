"""Splits as array_record files, read by index with grain: data larger than host memory.

A split `name` in `directory` is

  name.array_record-00000-of-0000S ...  one record per row, in row order: the row's
                                         uint8 image, raw (H * W * C bytes, no codec)
  name.index.npz                         labels [N] int32, ids [N] int32, image_shape,
                                         and the dataset config fields that decide the
                                         split's ids (so a mismatched directory is refused)

so a reader holds 8 bytes per example in memory, never the images. `write_split`
takes an iterator of (id, label, image), so a set larger than memory can be
written as it is read; `write_splits` writes the splits of a dataset config.
`StreamReader` (cpjax.data.readers' interface) reads each process's rows of a
batch with grain's ArrayRecordDataSource and prefetches upcoming batches in
background threads (grain's MapDataset -> IterDataset with ReadOptions).
"""

from collections.abc import Iterable, Mapping
import glob
import os
import threading

from array_record.python import array_record_module
import grain
import ml_collections
import numpy as np

from cpjax.data import splits

# The dataset config fields that decide which ids each split holds (cpjax.data.splits).
SPLIT_FIELDS = ("name", "val_size", "split_seed", "train_examples", "meta_val_size")


def _shard_paths(directory: str, name: str, num_shards: int) -> list[str]:
  return [os.path.join(directory, f"{name}.array_record-{i:05d}-of-{num_shards:05d}")
          for i in range(num_shards)]


def write_split(examples: Iterable[tuple[int, int, np.ndarray]], num_examples: int,
                directory: str, name: str, split_key: Mapping[str, object],
                num_shards: int = 1) -> list[str]:
  """Writes `num_examples` (id, label, uint8 image) in order as split `name`; returns the
  shard paths. Rows go to shards in contiguous blocks, so row r is in shard r // ceil(N/S)."""
  os.makedirs(directory, exist_ok=True)
  paths = _shard_paths(directory, name, num_shards)
  per_shard = -(-num_examples // num_shards)
  labels, ids = np.zeros(num_examples, np.int32), np.zeros(num_examples, np.int32)
  image_shape, writer, row = None, None, -1
  for row, (example_id, label, image) in enumerate(examples):
    if row % per_shard == 0:
      if writer is not None:
        writer.close()
      # One record per group, no codec: a row is read alone and costs no decompression.
      writer = array_record_module.ArrayRecordWriter(paths[row // per_shard],
                                                     "group_size:1,uncompressed")
    image = np.ascontiguousarray(image, np.uint8)
    image_shape = image.shape if image_shape is None else image_shape
    if image.shape != image_shape:
      raise ValueError(f"row {row} of {name} has image shape {image.shape}, not {image_shape}")
    writer.write(image.tobytes())
    labels[row], ids[row] = label, example_id
  if writer is not None:
    writer.close()
  if row + 1 != num_examples:
    raise ValueError(f"split {name}: {row + 1} examples written, {num_examples} announced")
  np.savez(os.path.join(directory, f"{name}.index.npz"), labels=labels, ids=ids,
           image_shape=np.asarray(image_shape, np.int64), num_shards=num_shards,
           **{f"split_{k}": np.asarray(v) for k, v in split_key.items()})
  return paths


def split_key(dataset: ml_collections.ConfigDict) -> dict[str, object]:
  return {field: dataset.get(field, 0) for field in SPLIT_FIELDS}


def write_splits(split_by_name: Mapping[str, splits.Split], directory: str,
                 dataset: ml_collections.ConfigDict, num_shards: int = 4) -> None:
  """Writes host splits (input_pipeline.get_datasets of `dataset`) as array_record files."""
  for name, split in split_by_name.items():
    examples = ((split.ids[r], split.labels[r], split.images[r]) for r in range(len(split)))
    write_split(examples, len(split), directory, name, split_key(dataset),
                max(1, min(num_shards, len(split))))


def read_index(directory: str, name: str, dataset: ml_collections.ConfigDict | None = None
               ) -> tuple[splits.Split, tuple[int, ...], list[str]]:
  """(the split without images, image shape, shard paths) of split `name`; with `dataset`,
  raises if the files were written for other split ids.

  Raises:
    FileNotFoundError: no such split in `directory`.
    ValueError: the directory was written with other SPLIT_FIELDS than `dataset`'s.
  """
  path = os.path.join(directory, f"{name}.index.npz")
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"no array_record split {name!r} in {directory!r} ({path} is missing); write it with "
        "python -m scripts.write_array_records --config=... --out=DIR")
  index = np.load(path)
  if dataset is not None:
    for field, ours in split_key(dataset).items():
      theirs = index[f"split_{field}"].item()
      if theirs != ours:
        raise ValueError(f"{directory} holds splits written with dataset.{field}={theirs!r}, "
                         f"this run has {ours!r}: rewrite them for this config")
  paths = sorted(glob.glob(os.path.join(directory, f"{name}.array_record-*")))
  if len(paths) != int(index["num_shards"]):
    raise FileNotFoundError(f"{directory}: {len(paths)} shard files of {name}, the index "
                            f"names {int(index['num_shards'])}")
  split = splits.Split(None, index["labels"], index["ids"])
  return split, tuple(int(d) for d in index["image_shape"]), paths


class RecordImages:
  """Random access to a split's images by row: grain's ArrayRecordDataSource over its shards."""

  def __init__(self, paths: list[str], image_shape: tuple[int, ...]):
    self._source = grain.sources.ArrayRecordDataSource(paths)
    self.image_shape = image_shape
    self.rows_read = 0  # Rows this process has read (grain's threads add to it).
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._source)

  def read(self, rows: np.ndarray) -> np.ndarray:
    """uint8 images [len(rows), *image_shape] of `rows`, read from the files."""
    with self._lock:
      self.rows_read += len(rows)
    records = self._source.__getitems__([int(r) for r in rows])
    return np.frombuffer(b"".join(records), np.uint8).reshape((len(rows),) + self.image_shape)

  def prefetched(self, row_blocks: np.ndarray, num_threads: int, buffer_size: int):
    """Yields read(block) for each block [b] of `row_blocks` [S, b] in order, read ahead by
    grain's threads (deterministic: the order is fixed before reading starts)."""
    blocks = grain.MapDataset.range(len(row_blocks)).map(lambda s: self.read(row_blocks[s]))
    yield from blocks.to_iter_dataset(grain.ReadOptions(num_threads=num_threads,
                                                        prefetch_buffer_size=buffer_size))
