"""Decoded splits kept beside a prepared tfds dataset, so that a run does not rebuild them.

Reading a split out of tfds's array_record files decodes it row by row in Python: 70,000
28x28 Fashion-MNIST images took 5-9 s a run, longer than the training of a short run. The
first run that reads a split writes its decoded arrays (images, labels, ids: a `Split`) to
`DATA_DIR/cpjax_arrays/SPLIT.npz` with the SHA-256 of the split's record files and a CRC-32 of
the arrays; a later run loads them (a fraction of a second) once both still match. A changed
record file (the dataset prepared again) or a damaged array file is rebuilt from the records,
with one line saying so; it is never used stale. An unwritable dataset folder costs one
warning and the run reads the records, as before.
"""

from collections.abc import Callable, Sequence
import hashlib
import logging
import os
import tempfile
import zipfile
import zlib

import numpy as np

from cpjax.data.splits import Split

FOLDER = "cpjax_arrays"
FORMAT = 1  # Bumped when the file's layout changes: an older file is rebuilt.
_FIELDS = ("images", "labels", "ids")


def records_digest(paths: Sequence[str]) -> str:
  """SHA-256 over the record files' names and bytes, in name order (a split's identity)."""
  digest = hashlib.sha256(f"format {FORMAT}\n".encode())
  for path in sorted(map(str, paths)):
    digest.update(os.path.basename(path).encode() + b"\0")
    with open(path, "rb") as f:
      digest.update(hashlib.file_digest(f, "sha256").digest())
  return digest.hexdigest()


def arrays_crc(split: Split) -> int:
  """CRC-32 of the split's arrays (their bytes, shapes and dtypes): catches a damaged file."""
  crc = 0
  for name in _FIELDS:
    array = np.ascontiguousarray(getattr(split, name))
    crc = zlib.crc32(f"{name}{array.shape}{array.dtype}".encode(), crc)
    crc = zlib.crc32(memoryview(array).cast("B"), crc)
  return crc


def cache_path(data_dir: str, split: str) -> str:
  return os.path.join(str(data_dir), FOLDER, f"{split}.npz")


def read(data_dir: str, split: str, record_paths: Sequence[str],
         decode: Callable[[], Split]) -> Split:
  """The split decoded by `decode()` (from `record_paths`), through the array file kept in
  `data_dir`: loaded when it matches the records, else rebuilt and written there."""
  path = cache_path(data_dir, split)
  digest = records_digest(record_paths)
  kept, why = _load(path, digest)
  if kept is not None:
    return kept
  if why:
    logging.info("Decoded arrays of split %r in %s %s: rebuilding them from the records.",
                 split, path, why)
  result = decode()
  _write(path, result, digest)
  return result


def _load(path: str, digest: str) -> tuple[Split | None, str]:
  """(the kept split, "") if `path` holds the arrays of records `digest` intact, else (None,
  why not: "" when there is no file)."""
  if not os.path.exists(path):
    return None, ""
  try:
    # The file opened here: np.load leaves it open when the zip is unreadable.
    with open(path, "rb") as f, np.load(f, allow_pickle=False) as kept:
      if str(kept["records_digest"]) != digest:
        return None, "are of other records (the dataset was prepared again)"
      split = Split(images=kept["images"], labels=kept["labels"], ids=kept["ids"])
      if int(kept["arrays_crc"]) != arrays_crc(split):
        return None, "are damaged (their checksum differs)"
      return split, ""
  except (OSError, ValueError, KeyError, EOFError, zlib.error, zipfile.BadZipFile) as err:
    return None, f"could not be read ({type(err).__name__}: {err})"


def _write(path: str, split: Split, digest: str) -> None:
  """Writes the arrays atomically (a concurrent run sees the old file or the whole new one);
  a folder that cannot be written costs one warning."""
  folder, temporary = os.path.dirname(path), None
  try:
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:
      temporary = f.name
      np.savez(f, images=split.images, labels=split.labels, ids=split.ids,
               records_digest=np.array(digest), arrays_crc=np.array(arrays_crc(split)))
    os.chmod(temporary, 0o644)  # Readable by every user of the dataset, as its records are.
    os.replace(temporary, path)
  except OSError as err:
    logging.warning("Could not keep the decoded split beside the dataset (%s: %s); each run "
                    "decodes it from the records again.", path, err)
    if temporary is not None and os.path.exists(temporary):
      os.remove(temporary)
