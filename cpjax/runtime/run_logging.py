"""Where a run's metrics go: TensorBoard events, the log and metrics.jsonl.

Only process 0 writes. Training metrics of every `log_every_steps` window go to
the writer (TensorBoard and the log, `runtime.metric_writers`: no TensorFlow); one record
per completed epoch goes through `write_record`: that writer, then `EpochLog`
(metrics.jsonl). On resume, records of epochs after the
restored checkpoint (written before a crash, then redone) are dropped, so the
file never holds duplicates; see EpochLog for damaged files and NaN.

metrics.jsonl keeps the record's own keys (`train_loss`, `test_ece`, ...); TensorBoard
gets each scalar under a tag family (`tensorboard_tag`): train/, val/, test/,
selection/, meta/ (gamma-Net's meta-learning) and perf/ (times, throughput).
"""

from collections.abc import Mapping
import json
import logging
import os
from typing import Any

from clu import parameter_overview
import jax
import numpy as np

from cpjax.runtime import files, metric_writers


class EpochLog:
  """One JSON record per epoch in `workdir/metrics.jsonl` (process 0 writes), each holding
  "epoch" (`write_record` is the way a record goes out).

  Every write replaces the file atomically (files.atomic_write), so a crash
  leaves the old file or the new one; a failed write leaves no temporary, and one left by
  a kill is removed at the next start (`keep_epochs_before`). A file damaged anyway (a torn
  last line from a full disk or a copy cut short; a duplicate epoch from an older version)
  still reads: `read_records` drops what does not parse, with a warning, and keeps the last
  record of each epoch. A non-finite metric is
  written as null, never as a number (JSON has no NaN).
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._active = jax.process_index() == 0

  def keep_epochs_before(self, epoch: int) -> None:
    """At start-up: drops records of epochs >= `epoch` (redone after a resume) and damaged
    lines, and removes the temporaries of a write cut short (a kill mid-write)."""
    if not self._active:
      return
    for path in files.remove_stale_temporaries(self.path):
      logging.info("Removed %s, left by an earlier run's write cut short.", path)
    if os.path.exists(self.path):
      self._rewrite([r for r in read_records(self.path) if r["epoch"] < epoch])

  def record(self, epoch: int) -> dict[str, Any] | None:
    """The record of 0-indexed `epoch` as the file holds it; None if it has none (and on
    processes other than 0, which write nothing)."""
    if not self._active or not os.path.exists(self.path):
      return None
    return next((r for r in read_records(self.path) if r["epoch"] == epoch), None)

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


# Record keys outside the prefix rules of `tensorboard_tag`.
_TAGS = {"epoch": "train/epoch", "learning_rate": "train/epoch_learning_rate",
         "gamma": "train/loss_gamma",  # A scheduled loss hyper-parameter (FLSc).
         "steps_per_sec": "perf/steps_per_sec", "uptime": "perf/uptime",
         "train/meta_loss": "meta/loss", "train/gamma_mean": "meta/gamma_mean"}
FAMILIES = ("train/", "val/", "test/", "ood/", "selection/", "meta/", "perf/")


def tensorboard_tag(key: str) -> str:
  """The TensorBoard tag of a metric key: train_loss -> train/epoch_loss (the epoch's mean;
  train/loss is the window's), val_ece -> val/ece, test_nll -> test/nll, the report's OOD
  numbers ood_auroc_energy -> ood/auroc_energy, *_seconds -> perf/*, a selection record's
  key (selected_k, subset_class_kl, ...) -> selection/*."""
  if key in _TAGS:
    return _TAGS[key]
  if key.startswith(FAMILIES):
    return key
  if key.endswith("_seconds"):
    return f"perf/{key}"
  for split in ("val", "test", "ood"):
    if key.startswith(split + "_"):
      return f"{split}/{key[len(split) + 1:]}"
  if key.startswith("train_"):
    return f"train/epoch_{key[len('train_'):]}"
  return f"selection/{key}"


def _finite_number(value: Any) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
          and bool(np.isfinite(value)))


class TaggedWriter(metric_writers.MultiWriter):
  """Writes to each of its writers, every scalar under its tag family (`tensorboard_tag`) and
  what is not a finite number left out (lists, NaN: metrics.jsonl keeps those)."""

  def write_scalars(self, step, scalars):
    tagged = {tensorboard_tag(k): v for k, v in scalars.items() if _finite_number(v)}
    if tagged:
      super().write_scalars(step, tagged)


def create_writer(workdir: str) -> TaggedWriter:
  """The run's writer: the log, and TensorBoard events in `workdir` on process 0 (the others
  only log), every scalar under its tag family."""
  writers = [metric_writers.LoggingWriter()]
  if jax.process_index() == 0:
    writers.append(metric_writers.TensorBoardWriter(workdir))
  return TaggedWriter(writers)


def write_record(writer: metric_writers.MetricWriter, epoch_log: EpochLog, step: int,
                 record: dict[str, Any], tensorboard: Mapping[str, Any] | None = None) -> None:
  """The one way an epoch's record goes out: its scalars to `writer` (TensorBoard, the log;
  `tensorboard` where given: the record's scalars TensorBoard does not hold yet and any it
  alone shows, as the report's after-TS metrics), then the whole record to metrics.jsonl,
  replacing the epoch's earlier one (the report's numbers join the last epoch's record that
  way)."""
  writer.write_scalars(step, dict(record) if tensorboard is None else tensorboard)
  epoch_log.write(record)


def flat_hparams(tree: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
  """A nested config dict as TensorBoard's HParams tab takes it: one entry per field,
  dotted names ("optimizer.learning_rate"), sequences as their text ("(150, 250)")."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      flat.update(flat_hparams(value, f"{prefix}{key}."))
    elif isinstance(value, (bool, int, float, str)):
      flat[f"{prefix}{key}"] = value
    else:
      flat[f"{prefix}{key}"] = str(tuple(value) if isinstance(value, list) else value)
  return flat


def log_parameter_overview(model_name: str, params: Any) -> None:
  """Logs the model's parameters, a row per array (name, shape, size) and their total, as
  flax's examples do at start-up (clu's parameter_overview; process 0 only)."""
  if jax.process_index() == 0:
    logging.info("Model %s:\n%s", model_name,
                 parameter_overview.get_parameter_overview(params, include_stats=False))
