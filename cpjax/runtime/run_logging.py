"""Where a run's metrics go: clu writers (TensorBoard + console) and metrics.jsonl.

Only process 0 writes. Training metrics of every `log_every_steps` window go to
the clu writer (TensorBoard and the log); one JSON record per completed epoch
goes to `metrics.jsonl` and the writer. On resume, records of epochs after the
restored checkpoint (written before a crash, then redone) are dropped, so the
file never holds duplicates.
"""

import json
import os
from typing import Any

from clu import metric_writers
from clu import periodic_actions
import jax

from cpjax.runtime import files


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
    files.atomic_write(self.path, "".join(records))

  def write(self, record: dict[str, Any]) -> None:
    if self._active:
      with open(self.path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def create_writer(workdir: str) -> metric_writers.MetricWriter:
  """clu's default writer: TensorBoard events + logging on process 0 only."""
  return metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)


def create_progress_reporter(num_train_steps: int, writer: metric_writers.MetricWriter,
                             every_steps: int) -> periodic_actions.ReportProgress:
  """clu's progress report (steps/s, ETA) to the writer every `every_steps` steps."""
  return periodic_actions.ReportProgress(num_train_steps=num_train_steps, writer=writer,
                                         every_steps=every_steps, every_secs=None)
