"""Atomic file writes (a reader sees the old file or the new one, never half of one), where
cpjax caches what it derives from a dataset (`user_cache_dir`), sizes in words (`size_text`)
and the nearest existing folder of a path to be (`existing_parent`)."""

from collections.abc import Callable
import contextlib
import os
import re
from typing import BinaryIO

_TMP_SUFFIX = ".tmp"  # atomic_write's temporary: f"{path}.tmp{pid}".


def _temporary(path: str) -> str:
  return f"{path}{_TMP_SUFFIX}{os.getpid()}"


def existing_parent(path: str) -> str:
  """`path`, or its nearest parent that exists."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return path


def atomic_write(path: str, content: bytes | str | Callable[[BinaryIO], None]) -> None:
  """Writes `content` to `path` through a temporary file and one `os.replace`.

  A failed write (a full disk, a folder turned read-only) removes its temporary and
  re-raises: the old file stays as it was and nothing else is left behind.

  Args:
    path: the destination; its folder is created if missing.
    content: bytes, text (UTF-8), or a function that writes into a binary file.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = _temporary(path)
  try:
    with open(tmp, "wb") as f:
      if callable(content):
        content(f)
      else:
        f.write(content.encode() if isinstance(content, str) else content)
      f.flush()
      os.fsync(f.fileno())  # The data must be on disk before the rename makes it visible.
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):  # Never created, or the folder refuses even this.
      os.remove(tmp)
    raise


def remove_stale_temporaries(path: str) -> list[str]:
  """Removes the temporaries of `path` that an earlier atomic_write left (a process killed
  mid-write): files named exactly `path` + ".tmp" + digits, nothing else. Call it only while
  no other process writes `path` (a run holds its workdir lock). Returns what it removed."""
  folder, name = os.path.split(os.path.abspath(path))
  pattern = re.compile(re.escape(name + _TMP_SUFFIX) + r"[0-9]+")
  try:
    names = os.listdir(folder)
  except FileNotFoundError:
    return []
  removed = []
  for other in sorted(names):
    candidate = os.path.join(folder, other)
    if pattern.fullmatch(other) and os.path.isfile(candidate):
      os.remove(candidate)
      removed.append(candidate)
  return removed


def user_cache_dir(name: str) -> str:
  """$XDG_CACHE_HOME/cpjax/`name` (~/.cache by default): where derived facts of a dataset
  (channel statistics, a tfds split's labels) are cached, never beside the data, which may
  be read-only or shared."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return os.path.join(base, "cpjax", name)


def size_text(num_bytes: int | float) -> str:
  """A size as messages give it: MiB with one decimal from 0.1 MiB, else KiB from 1 KiB,
  else bytes ("0 bytes", "12.5 KiB", "3.0 MiB"): never "0.0 MiB" for a few KiB."""
  if num_bytes >= 0.1 * 2**20:
    return f"{num_bytes / 2**20:.1f} MiB"
  if num_bytes >= 2**10:
    return f"{num_bytes / 2**10:.1f} KiB"
  return f"{int(num_bytes)} byte{'' if int(num_bytes) == 1 else 's'}"
