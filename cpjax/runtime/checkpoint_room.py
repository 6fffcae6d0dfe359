"""Whether a checkpoint can be written before it is: a writable folder with room for it.

`check_room` runs at start-up (cpjax.config.preflight, for the run's whole checkpoint, read from
shapes) and before every save (cpjax.runtime.checkpointing), so a full or read-only disk is
one clear error naming the folder, before orbax starts writing.
"""

import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np

from cpjax.runtime import files


class CheckpointSaveError(RuntimeError):
  """orbax declined to write a checkpoint that was asked for."""


# Free space asked for before a save, in checkpoints: orbax writes a new step in full before
# the rotation deletes the oldest one, and the margin covers the step's metadata files.
ROOM_FACTOR = 2


def tree_bytes(tree: Any) -> int:
  """Bytes of the arrays (or shape-dtype structs) of `tree`."""
  return int(sum(np.prod(np.shape(leaf), dtype=np.int64) * np.dtype(leaf.dtype).itemsize
                 for leaf in jax.tree.leaves(tree)))


def check_room(directory: str, needed_bytes: int) -> None:
  """Raises CheckpointSaveError at once unless a checkpoint of `needed_bytes` can be written
  in `directory` (or, if it does not exist yet, its nearest existing parent): a folder in
  which a file can be created, on a file system with that much free space. Leaves nothing.
  """
  where = files.existing_parent(directory)
  try:
    if not os.path.isdir(where):
      raise NotADirectoryError(f"{where} is not a folder")
    # A named file: an unnamed one (O_TMPFILE) is allowed in a folder that refuses new names.
    tempfile.NamedTemporaryFile(dir=where, prefix=".cpjax-probe-").close()
  except OSError as err:
    raise CheckpointSaveError(
        f"checkpoint folder {directory} is not writable ({type(err).__name__}: {err}); make "
        "it writable or pass another --workdir") from err
  free = shutil.disk_usage(where).free
  if free < needed_bytes:
    raise CheckpointSaveError(
        f"checkpoint folder {directory} has {files.size_text(free)} free, a checkpoint needs "
        f"{files.size_text(needed_bytes)}; free space there or pass another --workdir")
