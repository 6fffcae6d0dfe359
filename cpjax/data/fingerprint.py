"""A source dataset's identity: what a checkpoint's example ids and scores refer to.

A folder run's rows are its files by sorted relative path (cpjax.data.folder_source), and a
run over the folder's converted records has the same rows (cpjax.data.record_source): the
checkpoint's per-example buffers, selection state and saved scores are indexed by them. If
files are replaced, moved to another class, or deleted and added between a kill and the
resume (or the records are converted again from such a folder), the same ids name other
images, silently. So a run records each split's entries, one a row: its name (the file's
relative path), its size in bytes and a digest of its content (`Entry`).

What is compared:

  * names, sizes and sampled contents, not modification times. The content digest is
    SHA-256 of the size and of the whole file when it has at most 3 x 4 KiB, else of its
    first, middle and last 4 KiB (`sampled_ranges`), cut to 64 bits. The same bytes copied
    back (`cp`, a restore from a backup, the folder copied to another disk) are the same
    file; another image at the same path differs in its first 4 KiB (the format's header,
    its tables, the first rows of pixels). A change that keeps the size and lies wholly
    between the sampled blocks of a file over 12 KiB is not seen (a few flipped bytes in
    a large JPEG: the decoder, not this check, meets those).
  * cost: a file's digest is read once. The workdir's listing keeps each file's size and
    modification time beside its digest, and a file whose size and time are unchanged keeps
    its digest, so a resume stats every file (as `ls -l`) and reads only changed ones; a
    run's first start reads up to three blocks of every file (16 threads).
  * converted records: the conversion records the same entries of its rows (each record's
    bytes are its file's), so a records directory has its folder's identity: a run may
    switch between a folder and its records, and records converted from a changed folder
    are refused as the folder would be.

A digest of each split goes into every checkpoint's metadata (`digests`), the listing itself
into `workdir/LISTING_FILE` (to name what changed); a resume whose digests differ from its
checkpoint's is refused (`check_unchanged`), naming the first differences, with one
exception, the recovery from a damaged image: a run that stops on a file (or record) that
cannot be read or decoded notes it in `workdir/DAMAGED_FILE` (`noting_damage`: its name and
the digest of the bytes the run listed), and a resume whose only differences are noted files
changed in place (same names), from a checkpoint that holds the noted bytes, goes on with a
warning naming them: the run never trained on the damaged bytes. Until a checkpoint of the
new bytes exists the listing file keeps the checkpoint's listing beside the new one, so a
second resume from that checkpoint accepts the replacement again, while a later change of
the file (a checkpoint has trained on its replacement) is refused. Checkpoints of earlier
versions hold digests of names, sizes and modification times (no "sampled:" prefix): they
are compared by that rule.

Names are kept as the file system gives them (os.fsencode: any bytes, UTF-8 or not) and shown
with undecodable bytes as backslash escapes.
"""

from collections.abc import Iterator, Mapping, Sequence
import concurrent.futures
import contextlib
import dataclasses
import gzip
import hashlib
import json
import logging
import os

import jax

from cpjax.data import preprocess
from cpjax.data.folder_source import printable
from cpjax.runtime import files

LISTING_FILE = "dataset_listing.json.gz"  # In the workdir: the rows' listings (`saved_listings`).
DAMAGED_FILE = "damaged_examples.json"  # In the workdir: the files a run stopped on.
SHOWN = 5  # Differences named per kind in the error.
BLOCK = 4096  # Bytes of each sampled block of a file.
SCHEME = "sampled"  # Prefix of this version's digests (an earlier version's have none).
_IN_PLACE = "changed (size or content)"  # The kind of change a damaged file's replacement is.

# (name, size in bytes, content digest, modification time in ns) of one row's file (or
# record: no time, 0). A file gone since it was listed has size -1; one that cannot be read,
# the digest "unreadable".
Entry = tuple[str, int, str, int]


class DatasetChangedError(ValueError):
  """The dataset's files differ from those the checkpoint was trained on."""


@dataclasses.dataclass(frozen=True)
class Identity:
  """A run's rows, as a checkpoint records them, and how to speak of them."""
  listing: dict[str, list[Entry]]  # {split: its rows' entries, in row order}
  what: str  # What they are, for messages: "the files of dataset.folder='/data/x'".
  way_back: str  # What resuming needs: "put the files back as they were".
  # The file that should hold the rows' identity and does not (records converted before it
  # was recorded, or its file deleted): the rows cannot be checked; `listing` is empty.
  missing: str = ""


def sampled_ranges(size: int) -> list[tuple[int, int]]:
  """(offset, length) of the bytes a content digest reads of `size` bytes: all of them up to
  3 blocks, else the first, the middle and the last BLOCK."""
  if size <= 3 * BLOCK:
    return [(0, size)]
  return [(0, BLOCK), ((size - BLOCK) // 2, BLOCK), (size - BLOCK, BLOCK)]


def content_digest(size: int, blocks: Sequence[bytes]) -> str:
  """The digest of content of `size` bytes from its `sampled_ranges` blocks: SHA-256 of the
  size in decimal, a newline and the blocks, cut to 64 bits (16 hex digits)."""
  sha = hashlib.sha256(f"{size}\n".encode())
  for block in blocks:
    sha.update(block)
  return sha.hexdigest()[:16]


def bytes_digest(data: bytes) -> str:
  """`content_digest` of bytes in memory (a record's: its file's bytes, unchanged)."""
  return content_digest(len(data), [data[o:o + n] for o, n in sampled_ranges(len(data))])


def _file_digest(path: str, size: int) -> str:
  try:
    with open(path, "rb") as f:
      return content_digest(size, [os.pread(f.fileno(), n, o) for o, n in sampled_ranges(size)])
  except OSError:
    return "unreadable"


def file_entries(root: str, relative_paths: Sequence[str],
                 known: Sequence[Entry] = ()) -> list[Entry]:
  """The entries of `relative_paths` under `root`, in order. A file whose size and time
  are those of its entry in `known` (the workdir's listing) keeps that entry's digest; the
  others are read (threads: the waits are the disk's)."""
  by_name = {entry[0]: entry for entry in known if len(entry) == 4 and entry[2]}

  def entry(path: str) -> Entry:
    try:
      stat = os.stat(os.path.join(root, path))
    except OSError:
      return (path, -1, "", -1)
    old = by_name.get(path)
    if old is not None and (old[1], old[3]) == (stat.st_size, stat.st_mtime_ns):
      return old
    return (path, stat.st_size, _file_digest(os.path.join(root, path), stat.st_size),
            stat.st_mtime_ns)

  out = []
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    for start in range(0, len(relative_paths), 4096):  # Not a future per file at once.
      out += pool.map(entry, relative_paths[start:start + 4096])
  return out


def stat_entries(root: str, relative_paths: Sequence[str]) -> list[Entry]:
  """The entries of `relative_paths` under `root` without their digests ("": no file read):
  for a cache key (`stat_digest`)."""
  out = []
  for path in relative_paths:
    try:
      stat = os.stat(os.path.join(root, path))
      out.append((path, stat.st_size, "", stat.st_mtime_ns))
    except OSError:
      out.append((path, -1, "", -1))
  return out


def digest(split_entries: Sequence[Entry]) -> str:
  """SHA-256 of one split's names (as bytes), sizes and content digests, in row order."""
  sha = hashlib.sha256()
  for name, size, content, _ in split_entries:
    sha.update(os.fsencode(name) + b"\0" + f"{size}\0{content}\n".encode())
  return sha.hexdigest()


def stat_digest(split_entries: Sequence[Entry]) -> str:
  """SHA-256 of names, sizes and modification times: an earlier version's digest (what its
  checkpoints hold), and a cache key that needs no file read."""
  sha = hashlib.sha256()
  for name, size, _, mtime in split_entries:
    sha.update(os.fsencode(name) + b"\0" + f"{size}\0{mtime}\n".encode())
  return sha.hexdigest()


def digests(listing: Mapping[str, Sequence[Entry]]) -> dict[str, str]:
  """{split: "sampled:<digest>"} of a listing: what a checkpoint's metadata holds."""
  return {split: f"{SCHEME}:{digest(entries)}" for split, entries in sorted(listing.items())}


def _matches(saved: str | None, entries: Sequence[Entry] | None) -> bool:
  if saved is None or entries is None:
    return False
  scheme, _, value = saved.rpartition(":")
  return value == (digest(entries) if scheme else stat_digest(entries))


def write_listings(path: str, listings: Sequence[Mapping[str, Sequence[Entry]]]) -> None:
  """Writes listings ({split: entries} each) to `path` (gzip JSON, atomically); names stay
  exact (JSON escapes the surrogates of undecodable bytes)."""
  text = json.dumps([{split: [list(e) for e in entries] for split, entries in listing.items()}
                     for listing in listings])
  files.atomic_write(path, gzip.compress(text.encode("ascii")))


def read_listings(path: str) -> list[dict[str, list[Entry]]]:
  """The listings `write_listings` wrote to `path` ([] if it is missing or unreadable; an
  earlier version's file, one listing of (name, size, time) entries, with the digests "")."""
  try:
    with gzip.open(path, "rt", encoding="ascii") as f:
      saved = json.load(f)
    return [{split: [tuple(e) if len(e) == 4 else (e[0], e[1], "", e[2]) for e in entries]
             for split, entries in listing.items()}
            for listing in (saved if isinstance(saved, list) else [saved])]
  except (OSError, ValueError, EOFError, IndexError, AttributeError):
    return []


def saved_listings(workdir: str) -> list[dict[str, list[Entry]]]:
  """The listings in `workdir`: the last start's rows first (its digests are a file's cache,
  `file_entries`'s `known`), then, while a damaged file's replacement has not reached a
  checkpoint, the rows of the checkpoint that run resumed from."""
  return read_listings(os.path.join(workdir, LISTING_FILE))


def changes(old: Sequence[Entry], new: Sequence[Entry],
            by_time: bool = False) -> dict[str, list[str]]:
  """{kind: names, sorted} of what changed in one split: removed, added, changed (size or
  content; `by_time`: size or modification time, an earlier version's rule)."""
  key = (lambda e: (e[1], e[3])) if by_time else (lambda e: (e[1], e[2]))
  before, after = {e[0]: key(e) for e in old}, {e[0]: key(e) for e in new}
  changed = "changed (size or modification time)" if by_time else _IN_PLACE
  found = {"removed": sorted(set(before) - set(after)), "added": sorted(set(after) - set(before)),
           changed: sorted(p for p in set(before) & set(after) if before[p] != after[p])}
  return {kind: names for kind, names in found.items() if names}


def _named(found: Mapping[str, Sequence[str]]) -> str:
  return "; ".join(f"{len(names)} {kind}: {', '.join(printable(n) for n in names[:SHOWN])}"
                   + (", ..." if len(names) > SHOWN else "") for kind, names in found.items())


def check_unchanged(saved: Mapping[str, str] | None, identity: Identity,
                    saved_listing: Mapping[str, Sequence[Entry]] | None, step: int,
                    damaged: Mapping[str, set[str]] | None = None) -> list[str]:
  """Raises DatasetChangedError if the rows differ from a checkpoint's, unless the only
  differences are files changed in place that the run found damaged.

  Args:
    saved: the checkpoint's {split: digest}; None (saved before digests were recorded, or
      of a dataset that has none): nothing to check.
    identity: this run's rows.
    saved_listing: the listing of the checkpoint's rows (workdir/LISTING_FILE), to name what
      changed; None if it is missing.
    step: the checkpoint's global step, for the message.
    damaged: {split: names} of the files the run stopped on (`damaged_names`).

  Returns:
    "split/name" of each damaged file accepted as replaced ([] when nothing changed).
  """
  if saved is None:
    return []
  now = identity.listing
  changed = sorted(split for split in set(saved) | set(now)
                   if not _matches(saved.get(split), now.get(split)))
  found = {split: changes(saved_listing.get(split, []), now.get(split, []),
                          by_time=":" not in saved.get(split, ":"))
           if saved_listing is not None else {} for split in changed}
  damaged = damaged or {}
  replaced = _replaced_damaged(found, damaged)
  if not changed or replaced:
    return replaced
  # What blocks the resume: the changes other than damaged files' replacements.
  blocking = {split: _blocking(kinds, damaged.get(split, set()))
              for split, kinds in found.items()}
  details = " | ".join(f"{split}/: {_named(blocking[split]) or 'its files differ'}"
                       for split in changed if blocking[split] or not found[split])
  raise DatasetChangedError(
      f"{identity.what} changed since checkpoint {step} was saved ({details}). The "
      "checkpoint's example ids, scores and splits refer to them as they were: "
      f"{identity.way_back} to resume, or start a new run in a new --workdir on the data as "
      "it is now.")


def _blocking(kinds: Mapping[str, list[str]], damaged: set[str]) -> dict[str, list[str]]:
  """`kinds` ({kind: names}) without the damaged files changed in place."""
  kept = {kind: [n for n in names if kind != _IN_PLACE or n not in damaged]
          for kind, names in kinds.items()}
  return {kind: names for kind, names in kept.items() if names}


def _replaced_damaged(found: Mapping[str, Mapping[str, list[str]]],
                      damaged: Mapping[str, set[str]]) -> list[str]:
  """"split/name" of every change in `found` ({split: changes}) if each one is a damaged
  file changed in place, else []."""
  if not found or any(not kinds or set(kinds) != {_IN_PLACE}
                      or not set(kinds[_IN_PLACE]) <= damaged.get(split, set())
                      for split, kinds in found.items()):
    return []
  return [f"{split}/{name}" for split, kinds in found.items() for name in kinds[_IN_PLACE]]


def note_damaged(workdir: str, split: str, example_id: int) -> None:
  """Notes example `example_id` of `split` as found damaged: its name and content digest in
  the run's listing (the first of `saved_listings`), so that only the replacement of those
  bytes is accepted, not a later change of a file a checkpoint has trained on."""
  listings = saved_listings(workdir)
  entries = listings[0].get(split, []) if listings else []
  if not 0 <= example_id < len(entries):
    return
  name, _, content, _ = entries[example_id]
  path = os.path.join(workdir, DAMAGED_FILE)
  noted = _read_notes(path)
  noted.setdefault(split, {})[name] = content
  files.atomic_write(path, json.dumps(noted))


def _read_notes(path: str) -> dict[str, dict[str, str]]:
  try:
    with open(path) as f:
      noted = json.load(f)
    return {split: dict(names) for split, names in noted.items()}
  except (OSError, ValueError, AttributeError, TypeError):
    return {}


def damaged_names(workdir: str, listing: Mapping[str, Sequence[Entry]] | None
                  ) -> dict[str, set[str]]:
  """{split: names} of the noted damaged files whose bytes in `listing` (the checkpoint's
  rows) are the damaged ones: those a resume from that checkpoint may find replaced."""
  if listing is None:
    return {}
  out = {}
  for split, noted in _read_notes(os.path.join(workdir, DAMAGED_FILE)).items():
    content = {name: c for name, _, c, _ in listing.get(split, [])}
    out[split] = {name for name, damaged in noted.items() if content.get(name) == damaged}
  return out


@contextlib.contextmanager
def noting_damage(workdir: str) -> Iterator[None]:
  """A context in which a BadImageError that names its example (`entry`: (split, id), set
  by the host stage) is noted in `workdir` before it propagates: the resume accepts that
  file replaced."""
  try:
    yield
  except preprocess.BadImageError as err:
    if getattr(err, "entry", None) is not None and os.path.isdir(workdir):
      with contextlib.suppress(OSError):  # The error itself is what the run reports.
        note_damaged(workdir, *err.entry)
    raise


def _unchecked(identity: Identity, meta: Mapping | None) -> None:
  """Rows whose identity file is missing: refused (DatasetChangedError) when the checkpoint
  recorded their digests, as the rows may then be other rows; else run unchecked, with a
  warning."""
  if meta is not None and meta.get("data_digests") is not None:
    raise DatasetChangedError(
        f"{identity.what} lack {identity.missing}, though checkpoint {meta.get('step', -1)} "
        "recorded their rows' identity: without it the resume cannot check that they are the "
        f"checkpoint's rows. {identity.way_back[0].upper()}{identity.way_back[1:]} to resume, "
        "or start a new run in a new --workdir on the data as it is now.")
  logging.warning("%s lack %s (converted before cpjax recorded their rows' identity, or the "
                  "file was deleted): a resume cannot check that they are the checkpoint's. "
                  "Convert them again to have it checked.", identity.what, identity.missing)


def check_resume(identity: Identity | None, listings: Sequence[Mapping[str, Sequence[Entry]]],
                 meta: Mapping | None, workdir: str) -> dict[str, str] | None:
  """At a run's start: refuses a resume onto other rows (`check_unchanged` against the
  newest checkpoint's `meta`, None without one; `listings`: `saved_listings`). Then, on
  process 0, writes this run's listing, followed by the checkpoint's while a damaged file's
  replacement has been accepted (a second resume from that checkpoint accepts it again), and
  forgets the damaged files otherwise. Returns the digests that this run's checkpoints
  record; None for a dataset without an identity (`identity` None, or its identity file
  missing: refused where the checkpoint recorded the rows' digests)."""
  if identity is None:
    return None
  if identity.missing:
    return _unchecked(identity, meta)
  now = digests(identity.listing)
  saved = (meta or {}).get("data_digests")
  checkpoints = next((listing for listing in listings if digests(listing) == saved),
                     listings[0] if listings else None)  # To name what changed.
  replaced = []
  if meta is not None:
    replaced = check_unchanged(saved, identity, checkpoints, meta.get("step", -1),
                               damaged_names(workdir, checkpoints))
  if replaced:
    logging.warning("%s changed since checkpoint %d (%s), %s this run found damaged: the "
                    "resume goes on with the new bytes.", ", ".join(
                        printable(name) for name in replaced), meta.get("step", -1),
                    identity.what, "a file" if len(replaced) == 1 else "files")
  if jax.process_index() == 0:
    kept = [identity.listing] + ([checkpoints] if replaced else [])
    if [digests(listing) for listing in listings] != [digests(listing) for listing in kept]:
      write_listings(os.path.join(workdir, LISTING_FILE), kept)
    if not replaced:
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(workdir, DAMAGED_FILE))
  return now
