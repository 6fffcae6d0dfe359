"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from collections.abc import Callable
import os
from typing import BinaryIO


def atomic_write(path: str, content: bytes | str | Callable[[BinaryIO], None]) -> None:
  """Writes `content` to `path` through a temporary file and one `os.replace`.

  Args:
    path: the destination; its folder is created if missing.
    content: bytes, text (UTF-8), or a function that writes into a binary file.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    if callable(content):
      content(f)
    else:
      f.write(content.encode() if isinstance(content, str) else content)
    f.flush()
    os.fsync(f.fileno())  # The data must be on disk before the rename makes it visible.
  os.replace(tmp, path)
