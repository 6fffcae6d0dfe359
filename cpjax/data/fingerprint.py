"""A folder dataset's fingerprint: what a checkpoint's example ids and scores refer to.

A folder run's rows are its files by sorted relative path (cpjax.data.folder_source): the
checkpoint's per-example buffers, selection state and saved scores are indexed by them. If
files are replaced, moved to another class, or deleted and added between a kill and the
resume, the same ids name other images, silently. So a run records, per split, every listed
file's relative path, size and modification time: a digest of each split goes into every
checkpoint's metadata, the listing itself into `workdir/LISTING_FILE` (to name what changed);
a resume whose listing's digest differs from its checkpoint's is refused (`check_unchanged`),
naming the first differences.

Paths are kept as the file system gives them (os.fsencode: any bytes, UTF-8 or not) and shown
with undecodable bytes as backslash escapes.
"""

from collections.abc import Mapping, Sequence
import gzip
import hashlib
import json
import os

import jax

from cpjax.data.folder_source import printable
from cpjax.runtime import files

LISTING_FILE = "dataset_listing.json.gz"  # In the workdir: the listing a run started with.
SHOWN = 5  # Differences named per kind in the error.

# (relative path, size in bytes, modification time in ns) of one file.
Entry = tuple[str, int, int]


class DatasetChangedError(ValueError):
  """The dataset's files differ from those the checkpoint was trained on."""


def entries(root: str, relative_paths: Sequence[str]) -> list[Entry]:
  """(path, size, mtime_ns) of each of `relative_paths` under `root`; a file gone since it
  was listed has size and time -1 (it differs from any file that is there)."""
  out = []
  for path in relative_paths:
    try:
      stat = os.stat(os.path.join(root, path))
      out.append((path, stat.st_size, stat.st_mtime_ns))
    except OSError:
      out.append((path, -1, -1))
  return out


def digest(split_entries: Sequence[Entry]) -> str:
  """SHA-256 of one split's entries (paths as bytes), in listing order."""
  sha = hashlib.sha256()
  for path, size, mtime in split_entries:
    sha.update(os.fsencode(path) + b"\0" + f"{size}\0{mtime}\n".encode())
  return sha.hexdigest()


def digests(listing: Mapping[str, Sequence[Entry]]) -> dict[str, str]:
  """{split: digest} of a listing {split: entries}: what a checkpoint's metadata holds."""
  return {split: digest(split_entries) for split, split_entries in sorted(listing.items())}


def write_listing(path: str, listing: Mapping[str, Sequence[Entry]]) -> None:
  """Writes {split: entries} to `path` (gzip JSON, atomically); names stay exact (JSON
  escapes the surrogates of undecodable bytes)."""
  text = json.dumps({split: [list(e) for e in split_entries]
                     for split, split_entries in listing.items()})
  files.atomic_write(path, gzip.compress(text.encode("ascii")))


def read_listing(path: str) -> dict[str, list[Entry]] | None:
  """The listing `write_listing` wrote to `path`; None if it is missing or unreadable."""
  try:
    with gzip.open(path, "rt", encoding="ascii") as f:
      return {split: [tuple(e) for e in split_entries]
              for split, split_entries in json.load(f).items()}
  except (OSError, ValueError, EOFError):
    return None


def differences(old: Sequence[Entry], new: Sequence[Entry]) -> list[str]:
  """What changed between two listings of one split: files removed, added, and changed (size
  or modification time), each kind naming its first SHOWN paths."""
  before = {path: (size, mtime) for path, size, mtime in old}
  after = {path: (size, mtime) for path, size, mtime in new}
  kinds = (("removed", sorted(set(before) - set(after))),
           ("added", sorted(set(after) - set(before))),
           ("changed (size or modification time)",
            sorted(p for p in set(before) & set(after) if before[p] != after[p])))
  return [f"{len(paths)} {kind}: {', '.join(printable(p) for p in paths[:SHOWN])}"
          + (", ..." if len(paths) > SHOWN else "") for kind, paths in kinds if paths]


def check_unchanged(saved: Mapping[str, str] | None, listing: Mapping[str, Sequence[Entry]],
                    saved_listing: Mapping[str, Sequence[Entry]] | None, where: str,
                    step: int) -> None:
  """Raises DatasetChangedError if the listing's digests differ from a checkpoint's.

  Args:
    saved: the checkpoint's {split: digest}; None (saved before digests were recorded, or
      a dataset that has none): nothing to check.
    listing: this run's {split: entries}.
    saved_listing: the listing the run started with (workdir/LISTING_FILE), to name what
      changed; None if it is missing.
    where: the dataset folder, for the message.
    step: the checkpoint's global step, for the message.
  """
  if saved is None:
    return
  now = digests(listing)
  changed = sorted(split for split in set(saved) | set(now) if saved.get(split) != now.get(split))
  if not changed:
    return
  details = []
  for split in changed:
    found = (differences(saved_listing.get(split, []), listing.get(split, []))
             if saved_listing is not None else [])
    details.append(f"{split}/: " + ("; ".join(found) if found else "its files differ"))
  raise DatasetChangedError(
      f"the files of dataset.folder={printable(where)!r} changed since checkpoint {step} was saved "
      f"({' | '.join(details)}). The checkpoint's example ids, scores and splits refer to "
      "the files as they were: put them back as they were to resume, or start a new run in a "
      "new --workdir on the folder as it is now.")


def check_resume(listing: Mapping[str, Sequence[Entry]] | None, meta: Mapping | None,
                 workdir: str, where: str) -> dict[str, str] | None:
  """At a run's start: refuses a resume onto a changed folder (`check_unchanged` against the
  newest checkpoint's `meta`, None without one), then keeps `workdir/LISTING_FILE` up to date
  (process 0). Returns the digests that this run's checkpoints record; None for a dataset
  without a listing (`listing` None: built-in, tfds, converted records)."""
  if listing is None:
    return None
  path = os.path.join(workdir, LISTING_FILE)
  saved_listing = read_listing(path)
  if meta is not None:
    check_unchanged(meta.get("data_digests"), listing, saved_listing, where,
                    meta.get("step", -1))
  now = digests(listing)
  if jax.process_index() == 0 and (saved_listing is None or digests(saved_listing) != now):
    write_listing(path, listing)
  return now
