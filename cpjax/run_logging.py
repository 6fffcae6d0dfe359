"""Where a run's metrics go: clu writers (TensorBoard + console) and metrics.jsonl.

Only process 0 writes. `metrics.jsonl` holds one JSON object per completed
epoch; on resume, records of epochs after the restored checkpoint (written
before a crash, then redone) are dropped so the file never holds duplicates.
"""

import json
import os
from typing import Any

import jax


class EpochLog:
  """Appends one JSON record per epoch to `workdir/metrics.jsonl` (process 0)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._active = jax.process_index() == 0

  def keep_epochs_before(self, epoch: int) -> None:
    """Drops records of epochs >= `epoch` (atomically rewrites the file)."""
    if not self._active or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      records = [line for line in f if line.strip() and json.loads(line)["epoch"] < epoch]
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(records)
    os.replace(tmp, self.path)

  def write(self, record: dict[str, Any]) -> None:
    if self._active:
      with open(self.path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def create_writer(workdir: str):
  """clu's default writer: TensorBoard events + logging on process 0 only."""
  from clu import metric_writers  # Imports TensorFlow: only at this I/O edge.
  return metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)


def create_progress_reporter(num_train_steps: int, writer):
  """clu's periodic progress report (steps/s, ETA) to the writer."""
  from clu import periodic_actions
  return periodic_actions.ReportProgress(num_train_steps=num_train_steps, writer=writer,
                                         every_steps=None, every_secs=30.0)
