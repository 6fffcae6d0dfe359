"""Where a run's metrics go: clu writers (TensorBoard + console) and metrics.jsonl.

Only process 0 writes. Training metrics of every `log_every_steps` window go to
the clu writer (TensorBoard and the log); one JSON record per completed epoch
goes to `metrics.jsonl` and the writer. On resume, records of epochs after the
restored checkpoint (written before a crash, then redone) are dropped, so the
file never holds duplicates; see EpochLog for damaged files and NaN.
"""

import json
import logging
import os
from typing import Any

from clu import metric_writers, periodic_actions
import jax
import numpy as np

from cpjax.runtime import files


class EpochLog:
  """One JSON record per epoch in `workdir/metrics.jsonl` (process 0 writes).

  Every write replaces the file atomically (files.atomic_write), so a crash
  leaves the old file or the new one. A file damaged anyway (a torn last line
  from a full disk or a copy cut short; a duplicate epoch from an older
  version) still reads: `read_records` drops what does not parse, with a
  warning, and keeps the last record of each epoch. A non-finite metric is
  written as null, never as a number (JSON has no NaN).
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._active = jax.process_index() == 0

  def keep_epochs_before(self, epoch: int) -> None:
    """Drops records of epochs >= `epoch` (redone after a resume) and damaged lines."""
    if self._active and os.path.exists(self.path):
      self._rewrite([r for r in read_records(self.path) if r["epoch"] < epoch])

  def write(self, record: dict[str, Any]) -> None:
    if self._active:
      records = read_records(self.path) if os.path.exists(self.path) else []
      self._rewrite([r for r in records if r["epoch"] != record["epoch"]] + [record])

  def _rewrite(self, records: list[dict[str, Any]]) -> None:
    files.atomic_write(self.path, "".join(
        json.dumps(json_safe(r), sort_keys=True, allow_nan=False) + "\n" for r in records))


def read_records(path: str) -> list[dict[str, Any]]:
  """The epoch records of a metrics.jsonl, by epoch: the last of each epoch, damage dropped."""
  by_epoch = {}
  with open(path, encoding="utf-8", errors="replace") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        by_epoch[int(record["epoch"])] = record  # A later record of an epoch wins.
      except (ValueError, TypeError, KeyError):
        logging.warning("%s line %d is not a complete epoch record (a write cut short?); "
                        "dropping it: %.80r", path, number, line)
  return [by_epoch[epoch] for epoch in sorted(by_epoch)]


def json_safe(value: Any) -> Any:
  """`value` with every non-finite float (NaN, inf) replaced by None, recursively."""
  if isinstance(value, dict):
    return {k: json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_safe(v) for v in value]
  if isinstance(value, (float, np.floating)) and not np.isfinite(value):
    return None
  return value


def create_writer(workdir: str) -> metric_writers.MetricWriter:
  """clu's default writer: TensorBoard events + logging on process 0 only."""
  return metric_writers.create_default_writer(workdir, just_logging=jax.process_index() > 0)


def create_progress_reporter(num_train_steps: int, writer: metric_writers.MetricWriter,
                             every_steps: int) -> periodic_actions.ReportProgress:
  """clu's progress report (steps/s, ETA) to the writer every `every_steps` steps."""
  return periodic_actions.ReportProgress(num_train_steps=num_train_steps, writer=writer,
                                         every_steps=every_steps, every_secs=None)
