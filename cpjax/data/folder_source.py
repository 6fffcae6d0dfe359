"""A folder of images as a data source: `DIR/<split>/<class>/...` (dataset.name="folder").

`DIR/train/<class>/*` holds the training images (any depth below the class folder);
`DIR/val/` and `DIR/test/`, when present, hold validation and test images in the same class
folders (otherwise both are seeded carve-outs of train: cpjax.data.splits). Class names
sorted are the label ids 0..K-1. A split's files, by relative path sorted, are its rows; a
row's position is its stable example id, the same in every run over the same files.

Files are chosen by extension (`IMAGE_EXTENSIONS`, any case) and decoded by content, so a
PNG saved under a .jpg name still decodes. At start-up the headers of up to `check_files`
files per split (all of them when the split has no more; otherwise a seeded sample) are read
with PIL's lazy open (magic bytes and header, no pixel decoding); a file that fails is named
in one error, or with `skip_bad_files` left out of the split and listed. Damage past the
header (a truncated JPEG) is found when the file is first read and named there.

Paths are held as one bytes blob and offsets (tens of bytes per file), never the images.
Names need not be UTF-8: paths stay the file system's bytes, and class names (stored as text:
classes.json, the report) show undecodable bytes as backslash escapes (`printable`).
"""

from collections.abc import Sequence
import concurrent.futures
import dataclasses
import functools
import logging
import os
import re

import numpy as np

from cpjax.data import preprocess

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm",
                    ".pgm", ".pbm", ".pnm")
SPLIT_FOLDERS = ("train", "val", "test")
MAX_NAMED = 20  # Bad files named in one error message.


class FolderError(ValueError):
  """The folder is not laid out as DIR/train/<class>/images, or holds undecodable files."""


def printable(name: str) -> str:
  """A file or folder name as text (messages, class lists in JSON and Markdown): bytes that
  are not UTF-8 (os.listdir gives them as surrogates) shown as backslash escapes."""
  return os.fsencode(name).decode("utf-8", "backslashreplace")


class PathTable:
  """Relative paths as one blob of their file-system bytes (os.fsencode: any name, UTF-8 or
  not) and offsets: ~(len(path) + 8) bytes per file."""

  def __init__(self, paths: Sequence[str]):
    encoded = [os.fsencode(p) for p in paths]
    self._offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(e) for e in encoded], out=self._offsets[1:])
    self._blob = b"".join(encoded)

  def __len__(self) -> int:
    return len(self._offsets) - 1

  def __getitem__(self, row: int) -> str:
    return os.fsdecode(self._blob[self._offsets[row]:self._offsets[row + 1]])


def class_names(root: str) -> tuple[str, ...]:
  """Sorted class folder names of `root`/train; FolderError when there are none."""
  train = os.path.join(root, "train")
  if not os.path.isdir(train):
    raise FolderError(f"dataset.folder={root!r} has no train/ folder; lay it out as "
                      "DIR/train/<class>/<image files> (and optionally DIR/val/, DIR/test/)")
  names = tuple(sorted(e.name for e in os.scandir(train)
                       if e.is_dir() and not e.name.startswith(".")))
  if not names:
    raise FolderError(f"{train} has no class folders; lay it out as train/<class>/<images>")
  if len(names) < 2:
    raise FolderError(f"{printable(train)} has one class folder ({printable(names[0])!r}): a "
                      "classifier needs at "
                      "least 2 classes; lay it out as train/<class>/<images> with a folder "
                      "per class")
  return names


def _check_no_empty_class(split_dir: str, classes: tuple[str, ...], labels: np.ndarray) -> None:
  """FolderError naming the class folders of `split_dir` that hold no image: each would be
  a class the model is trained to predict and never sees (torchvision's ImageFolder also
  refuses them)."""
  counts = np.bincount(labels, minlength=len(classes))
  empty = [printable(os.path.join(split_dir, classes[i])) for i in np.flatnonzero(counts == 0)]
  if empty:
    raise FolderError(f"{_count(len(empty), 'class folder')} "
                      f"{'holds' if len(empty) == 1 else 'hold'} no image files "
                      f"({', '.join(IMAGE_EXTENSIONS)}): {', '.join(empty[:MAX_NAMED])}; add "
                      "images to them or remove them (every class folder of train/ is a class)")


def _list_images(split_dir: str, classes: tuple[str, ...]) -> tuple[list[str], list[str]]:
  """(sorted relative image paths, other files ignored) under split_dir's class folders."""
  images, ignored = [], []
  present = sorted(e.name for e in os.scandir(split_dir) if e.is_dir()
                   and not e.name.startswith("."))
  unknown = sorted(set(present) - set(classes))
  if unknown:
    raise FolderError(f"{printable(split_dir)} has class folders that train/ lacks: "
                      f"{', '.join(printable(n) for n in unknown[:MAX_NAMED])}; classes (from "
                      f"train/): {', '.join(printable(n) for n in classes[:MAX_NAMED])}")
  for name in present:
    for parent, dirs, files in os.walk(os.path.join(split_dir, name)):
      dirs[:] = [d for d in dirs if not d.startswith(".")]
      for file in files:
        relative = os.path.relpath(os.path.join(parent, file), split_dir)
        if file.startswith("."):
          continue
        (images if file.lower().endswith(IMAGE_EXTENSIONS) else ignored).append(relative)
  return sorted(images), sorted(ignored)


def header_problem(path: str) -> str | None:
  """Why PIL's lazy open (magic bytes, header) refuses `path`, or None if it opens. The
  caller names the file: PIL's text about it (the file object's repr) is left out."""
  try:
    if os.path.getsize(path) == 0:
      return "empty: 0 bytes"
    with open(path, "rb") as f:
      with preprocess.Image.open(f) as image:
        image.size  # pylint: disable=pointless-statement  The header is parsed by open.
    return None
  except preprocess.Image.UnidentifiedImageError:
    return "UnidentifiedImageError: not in an image format PIL reads"
  except Exception as err:  # pylint: disable=broad-except  Any failure names the file.
    text = re.sub(r" ?<_io\.\w+ name=.*?>", "", str(err))  # PIL's repr of the file object.
    return printable(f"{type(err).__name__}: {text[:120]}")


def _count(count: int, noun: str) -> str:
  """"1 file", "2 files"."""
  return f"{count} {noun}{'' if count == 1 else 's'}"


def _check_headers(root: str, split: str, paths: list[str], limit: int) -> dict[str, str]:
  """{relative path: problem} of the files whose header does not open, among all `paths`
  (at most `limit` of them: else a seeded sample of `limit`; 0 = none checked)."""
  if not limit:
    return {}
  chosen = paths if len(paths) <= limit else [
      paths[i] for i in np.sort(np.random.default_rng(0).choice(len(paths), limit, False))]
  split_dir = os.path.join(root, split)
  found = {}
  # Threads: opening files waits on the disk, and PIL releases the GIL while reading. In
  # chunks: Executor.map submits all its items at once (a future each, ~1 KB).
  with concurrent.futures.ThreadPoolExecutor(min(16, 4 * (os.cpu_count() or 1))) as pool:
    for start in range(0, len(chosen), 4096):
      chunk = chosen[start:start + 4096]
      problems = pool.map(lambda p: header_problem(os.path.join(split_dir, p)), chunk)
      found.update({p: problem for p, problem in zip(chunk, problems) if problem is not None})
  return found


@dataclasses.dataclass(frozen=True)
class Listing:
  """One split's files after the start-up check: rows, labels, the files left out."""
  root: str
  split: str
  paths: PathTable
  labels: np.ndarray  # int32 [N]
  bad: tuple[tuple[str, str], ...]  # (relative path, problem) of the files left out.
  ignored: tuple[str, ...]  # Files without an image extension, never read.


@functools.lru_cache(maxsize=16)
def listing(root: str, split: str, check_files: int, skip_bad_files: bool) -> Listing:
  """The files of `root`/`split` (cached per process: start-up checks and loading share it).

  Raises:
    FolderError: no such folder, class folders train/ lacks, no images, or (without
      `skip_bad_files`) files whose header does not open, each named.
  """
  classes = class_names(root)
  split_dir = os.path.join(root, split)
  paths, ignored = _list_images(split_dir, classes)
  if ignored:
    logging.warning("%s: %s without an image extension (%s) not read, e.g. %s",
                    printable(split_dir), _count(len(ignored), "file"), ", ".join(IMAGE_EXTENSIONS),
                    ", ".join(printable(p) for p in ignored[:3]))
  if not paths:
    raise FolderError(f"{printable(split_dir)} holds no image files "
                      f"({', '.join(IMAGE_EXTENSIONS)})")
  bad = _check_headers(root, split, paths, check_files)
  if bad and not skip_bad_files:
    named = "; ".join(f"{printable(os.path.join(split_dir, p))} ({why})" for p, why in
                      list(bad.items())[:MAX_NAMED])
    one = len(bad) == 1
    it, is_ = ("it", "is") if one else ("them", "are")
    raise FolderError(f"{_count(len(bad), 'file')} of {printable(split_dir)} {is_} not "
                      f"{'a readable image' if one else 'readable images'}: {named}. Remove "
                      f"or replace {it}, or pass --config.dataset.skip_bad_files=True to leave "
                      f"{it} out ({'it is' if one else 'they are'} then listed in the log and "
                      "in workdir/bad_files.txt)")
  if bad:
    logging.warning("%s: leaving out %s (dataset.skip_bad_files): %s",
                    printable(split_dir), _count(len(bad), "unreadable file"),
                    ", ".join(printable(p) for p in list(bad)[:MAX_NAMED]))
    paths = [p for p in paths if p not in bad]
  index = {name: i for i, name in enumerate(classes)}
  labels = np.asarray([index[p.split(os.sep, 1)[0]] for p in paths], np.int32)
  if split == "train":
    _check_no_empty_class(split_dir, classes, labels)
  return Listing(root, split, PathTable(paths), labels, tuple(sorted(bad.items())),
                 tuple(ignored))


def splits_present(root: str) -> tuple[str, ...]:
  """The split folders of `root` that exist (train first)."""
  return tuple(s for s in SPLIT_FOLDERS if os.path.isdir(os.path.join(root, s)))


class FolderSource:
  """Rows `rows` of a folder split's listing: encoded bytes read from the files."""
  encoded = True
  # The way out of a file that cannot be read or decoded (the host stage adds it to the error).
  on_damage = ("replace the file with a readable copy of the image under the same name (the "
               "resume accepts a file that the run found damaged)")

  def __init__(self, files: Listing, rows: np.ndarray | None = None,
               ids: np.ndarray | None = None):
    self._files = files
    self._rows = np.arange(len(files.paths)) if rows is None else np.asarray(rows)
    self.labels = files.labels[self._rows]
    # A row of the listing is the example's id (`ids`: a compacted copy's, see __getstate__).
    self.ids = self._rows.astype(np.int32) if ids is None else np.asarray(ids, np.int32)

  def __len__(self) -> int:
    return len(self._rows)

  def take(self, rows: np.ndarray) -> "FolderSource":
    return FolderSource(self._files, self._rows[rows], self.ids[rows])

  def __getstate__(self) -> dict:
    """Pickled (for the host stage's worker processes) with its own rows' paths alone when
    it holds under half of its listing: a carve-out (validation from ImageNet's 1.28M files)
    does not carry the whole split's path table (49 MB) to every worker."""
    if 2 * len(self._rows) >= len(self._files.paths):
      return self.__dict__
    paths = PathTable([self._files.paths[int(row)] for row in self._rows])
    files = dataclasses.replace(self._files, paths=paths, labels=self.labels)
    return {**self.__dict__, "_files": files, "_rows": np.arange(len(self._rows))}

  def name(self, row: int) -> str:
    """The file of `row` relative to its split's folder (its name in the listing)."""
    return self._files.paths[int(self._rows[row])]

  def path(self, row: int) -> str:
    """The file of `row`, as the file system names it (to open)."""
    return os.path.join(self._files.root, self._files.split, self.name(row))

  def where(self, row: int) -> str:
    """The file of `row`, for messages (bytes that are not UTF-8 escaped: `printable`)."""
    return printable(self.path(row))

  def entry(self, row: int) -> tuple[str, int]:
    """(split folder, example id) of `row`: which file a damaged-file note names."""
    return self._files.split, int(self.ids[row])

  def read(self, rows: np.ndarray) -> list[bytes]:
    """The encoded bytes of `rows`' files."""
    out = []
    for row in rows:
      try:
        with open(self.path(int(row)), "rb") as f:
          out.append(f.read())
      except OSError as err:
        raise preprocess.BadImageError(f"{self.where(int(row))}: cannot be read "
                                       f"({type(err).__name__}: {err.strerror})") from err
    return out
