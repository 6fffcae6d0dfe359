"""Recorded per-epoch train-pass scores on disk: the one place that reads or writes them.

A run with `selection.record_scores=True` writes `scores/epoch_NNNN.npy` in its
workdir: float32 scores indexed by full-split example id, NaN for examples not
trained that epoch. A run with `selection.scoring="target_recorded"` reads a
target run's files epoch by epoch.
"""

import io
import os

import numpy as np

from cpjax.runtime import files

SCORE_FILE = "scores/epoch_{epoch:04d}.npy"


def score_path(workdir: str, epoch: int) -> str:
  """The path of `epoch`'s recorded scores in a run's workdir."""
  return os.path.join(workdir, SCORE_FILE.format(epoch=epoch))


def write_epoch_scores(workdir: str, epoch: int, num_ids: int, ids: np.ndarray,
                       scores: np.ndarray) -> str:
  """Writes `scores` of examples `ids` as epoch `epoch`'s file (atomically); returns its path."""
  by_id = np.full(num_ids, np.nan, np.float32)
  by_id[ids] = scores
  buffer = io.BytesIO()
  np.save(buffer, by_id)
  path = score_path(workdir, epoch)
  files.atomic_write(path, buffer.getvalue())
  return path


def read_epoch_scores(workdir: str, epoch: int, ids: np.ndarray) -> np.ndarray:
  """The recorded scores of examples `ids` in `epoch`, float32.

  Raises:
    FileNotFoundError: the target run recorded no scores for `epoch`.
  """
  path = score_path(workdir, epoch)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"target scores for epoch {epoch} missing: {path} (train the target run with "
        "--config.selection.record_scores=True for at least as many epochs)")
  return np.load(path)[ids].astype(np.float32)
