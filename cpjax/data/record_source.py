"""A folder or tfds dataset converted to array_record files of encoded images.

`scripts/write_array_records.py` converts a source dataset (dataset.name `folder` or
`tfds:NAME`) into a directory that a run then reads instead of the source
(`dataset.stream_dir=DIR`, `dataset.reader` auto or stream):

  train.array_record-*, val.*, test.*   the source's whole splits (as many as it has), one
                                         record per row in row order: the row's encoded file
                                         bytes as they were (JPEG, PNG, ...), with its id and
                                         label in the index (cpjax.data.array_records, encoded)
  train.identity.npz, ...                each row's name (a folder's file, relative to its
                                         split; else "example ID (label L)"), size and content
                                         digest (cpjax.data.fingerprint): the rows' identity,
                                         which a checkpoint records and a resume compares
  dataset.json                           the dataset's facts: its name, classes, which splits
                                         it has, the source's image shape where fixed, the
                                         files the source left out (skip_bad_files); written
                                         last, so a directory with it was written whole

Rows keep the source's ids, so a run over the records is the run over the source, bit for
bit: the same bytes go through the same host stage (cpjax.data.host_stage) with the same
draws, carve-outs (validation, meta-validation, holdout) are taken at run time as from the
source, and a converted ImageNet is about the size of its JPEGs. Every record read is
checked against its CRC-32: a damaged one raises array_records.DamagedRecordError naming
the shard file and the record. The rows' identity is their folder's (the same names, sizes
and content digests: `identity`), so a resume onto records converted from other files is
refused naming them, and a run may switch between a folder and its records.
"""

from collections.abc import Iterator
import json
import os
import threading

import numpy as np

from cpjax.data import array_records, fingerprint

MANIFEST = "dataset.json"
SPLITS = ("train", "val", "test")  # Split roles; records of a role are named by it.


class RecordsError(ValueError):
  """The directory does not hold encoded records of this dataset; the message says why."""


def write_split(source, directory: str, split: str, dataset_name: str, num_shards: int,
                chunk: int = 256) -> list[str]:
  """Writes every row of `source` (a data source with encoded rows: cpjax.data.sources) as
  split `split` of `directory`, its bytes unchanged; returns the shard paths."""
  if not source.encoded:
    raise RecordsError(f"split {split}: the source gives decoded pixels, not encoded bytes")
  ids, labels = np.asarray(source.ids), np.asarray(source.labels)
  entries = []  # The rows' identity, gathered as they are read.

  def examples() -> Iterator[tuple[int, int, bytes]]:
    for start in range(0, len(source), chunk):
      rows = np.arange(start, min(start + chunk, len(source)))
      for row, data in zip(rows, source.read(rows)):
        name = (source.name(int(row)) if hasattr(source, "name")
                else f"example {ids[row]} (label {labels[row]})")
        entries.append((name, len(data), fingerprint.bytes_digest(data)))
        yield int(ids[row]), int(labels[row]), data

  paths = array_records.write_split(examples(), len(source), directory, split,
                                    {"name": dataset_name}, max(1, min(num_shards, len(source))),
                                    encoded=True)
  _write_identity(directory, split, entries)
  return paths


def _write_identity(directory: str, split: str, entries: list[tuple[str, int, str]]) -> None:
  """Writes (name, size, content digest) of each row of `split`: names as one blob of their
  file-system bytes and offsets (any name, UTF-8 or not)."""
  names = [os.fsencode(name) for name, _, _ in entries]
  np.savez(os.path.join(directory, f"{split}.identity.npz"),
           names=np.frombuffer(b"".join(names), np.uint8),
           offsets=np.cumsum([0] + [len(n) for n in names], dtype=np.int64),
           sizes=np.asarray([size for _, size, _ in entries], np.int64),
           digests=np.asarray([digest for _, _, digest in entries], "S16"))


def identity(directory: str) -> fingerprint.Identity:
  """The identity of the rows of the records in `directory` (see the module docstring); for
  records without it (written before it was recorded, or its file deleted), one that names
  the missing file (`missing`: cpjax.data.fingerprint.check_resume decides)."""
  with open(os.path.join(directory, MANIFEST)) as f:
    split_names = json.load(f)["splits"]
  what = f"the records in dataset.stream_dir={directory!r}"
  way_back = ("convert the files as they were into them again (python -m "
              "scripts.write_array_records; a file this run found damaged: a readable copy of "
              "it)")
  listing = {}
  for split in split_names:
    path = os.path.join(directory, f"{split}.identity.npz")
    if not os.path.exists(path):
      return fingerprint.Identity({}, what, way_back, missing=path)
    with np.load(path) as saved:
      blob, offsets = saved["names"].tobytes(), saved["offsets"]
      listing[split] = [(os.fsdecode(blob[offsets[i]:offsets[i + 1]]), int(size),
                         digest.decode("ascii"), 0)
                        for i, (size, digest) in enumerate(zip(saved["sizes"],
                                                               saved["digests"]))]
  return fingerprint.Identity(listing, what, way_back)


def clear_manifest(directory: str) -> None:
  """Removes an earlier conversion's facts before its files are rewritten: a conversion
  stopped midway then leaves a directory that runs refuse, not one with mixed splits."""
  path = os.path.join(directory, MANIFEST)
  if os.path.exists(path):
    os.remove(path)


def write_manifest(directory: str, facts: dict) -> None:
  """Writes the dataset's facts (see the module docstring), atomically, last."""
  path = os.path.join(directory, MANIFEST)
  with open(path + ".tmp", "w") as f:
    json.dump(facts, f, indent=1)
  os.replace(path + ".tmp", path)


def read_manifest(directory: str, dataset_name: str) -> dict:
  """The facts of the records in `directory`, checked to be dataset `dataset_name`'s.

  Raises:
    FileNotFoundError: no such directory, or no (whole) conversion in it.
    RecordsError: the records are another dataset's.
  """
  path = os.path.join(directory, MANIFEST)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"dataset.stream_dir={directory!r} holds no converted {dataset_name} dataset ({path} "
        f"is missing: not written, or its writing stopped); write it with python -m "
        f"scripts.write_array_records --config=... --config.dataset.name={dataset_name} "
        f"--out={directory}")
  with open(path) as f:
    facts = json.load(f)
  if facts["name"] != dataset_name:
    raise RecordsError(f"dataset.stream_dir={directory!r} holds dataset {facts['name']!r} "
                       f"(from {facts['source']}), this run has dataset.name={dataset_name!r}")
  return facts


def check(directory: str, facts: dict) -> None:
  """Start-up check of every split of the records: its index, shard sizes and a sample of
  records against their CRC-32 (array_records.check_files)."""
  for split in facts["splits"]:
    array_records.check_files(directory, split, encoded=True)


class _Records:
  """A split's records, opened on first read and shared by the sources taken from it."""

  def __init__(self, directory: str, split: str):
    self.directory, self.split = directory, split
    self.index, _, _ = array_records.read_index(directory, split, encoded=True)
    self._records: array_records.RecordImages | None = None
    self._lock = threading.Lock()

  def __getstate__(self) -> dict:
    """Pickled (for the host stage's worker processes) as its directory, split and index:
    each process opens the files itself."""
    return {"directory": self.directory, "split": self.split, "index": self.index}

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state, _records=None, _lock=threading.Lock())

  def opened(self) -> array_records.RecordImages:
    with self._lock:  # Worker threads may read first at once.
      if self._records is None:
        _, self._records = array_records.open_records(self.directory, self.split, encoded=True)
      return self._records


class RecordSource:
  """Rows of a converted split: encoded bytes read from its array_record files by index."""
  encoded = True
  # The way out of a record whose bytes are intact (its CRC-32 holds) but not an image: its
  # file was damaged when converted. (Added to the host stage's error.)
  on_damage = ("the record holds its source file's bytes as converted: replace that file with "
               "a readable copy and convert the dataset again (python -m "
               "scripts.write_array_records; the resume accepts a file that the run found "
               "damaged)")

  def __init__(self, directory: str, split: str, rows: np.ndarray | None = None,
               records: _Records | None = None):
    self._records = records or _Records(directory, split)
    index = self._records.index
    self._rows = np.arange(len(index)) if rows is None else np.asarray(rows)
    self.labels = index.labels[self._rows]
    self.ids = index.ids[self._rows]  # The source's ids, as written.

  def __len__(self) -> int:
    return len(self._rows)

  def take(self, rows: np.ndarray) -> "RecordSource":
    return RecordSource("", "", self._rows[rows], self._records)

  def where(self, row: int) -> str:
    """The record of `row`, for messages."""
    path, record = self._records.opened().location(int(self._rows[row]))
    return f"{path} record {record} (example id {int(self.ids[row])})"

  def entry(self, row: int) -> tuple[str, int]:
    """(split, example id) of `row`: which file a damaged-file note names."""
    return self._records.split, int(self.ids[row])

  def read(self, rows: np.ndarray) -> list[bytes]:
    """The encoded bytes of `rows`, each checked against its CRC-32."""
    return self._records.opened().read_records(self._rows[np.asarray(rows)])
