"""Failures a run must meet early, loudly and without losing work: a report that fails after
the last epoch, strict report JSON, a run that learns nothing, start-up checks of everything a
run will need (data, OOD set, target runs, stream files, checkpoint space), damaged stream
records, an unwritable checkpoint directory. docs/reliability.md lists each fault with its test.
"""

import json
import os

import numpy as np
import pytest

from cpjax import train
from cpjax.calibration import report
from tests.helpers import STEPS_PER_EPOCH, checkpoint_steps, read_metrics, tiny_config


def _strict_load(path: str):
  """json.load that refuses NaN, Infinity and -Infinity (as strict parsers do)."""
  with open(path) as f:
    return json.load(f, parse_constant=lambda name: pytest.fail(f"{name} in {path}"))


def test_a_failing_report_keeps_the_last_epoch_and_evaluate_finishes_it(tmp_path, monkeypatch):
  """The report fails after the last epoch: its checkpoint is already committed, so
  --mode=evaluate writes the report from it, and a rerun of the training command writes it
  too, neither training again."""
  workdir, config = str(tmp_path), tiny_config()
  real = report.write_report

  def failing(*args, **kwargs):
    raise OSError("disk full while writing the report")
  monkeypatch.setattr(report, "write_report", failing)
  with pytest.raises(OSError, match="disk full"):
    train.train_and_evaluate(config, workdir)
  last = 2 * STEPS_PER_EPOCH
  assert checkpoint_steps(workdir) == [STEPS_PER_EPOCH, last]  # The last epoch is saved.
  monkeypatch.setattr(report, "write_report", real)
  results = train.evaluate_only(config, workdir)
  assert (results["checkpoint_step"], results["epoch"]) == (last, 2)
  on_disk = _strict_load(os.path.join(workdir, "report", "results.json"))
  assert (on_disk["checkpoint_step"], on_disk["epoch"], on_disk["epoch_step"]) == (last, 2, 0)
  with open(os.path.join(workdir, "report", "results.md")) as f:
    assert f"The model of global step {last}: after 2 epochs." in f.read()
  # The training command on the finished run: no training, the report rewritten if missing.
  os.remove(os.path.join(workdir, "report", "results.json"))
  epochs_before = [r["epoch"] for r in read_metrics(workdir)]
  train.train_and_evaluate(config, workdir)
  assert _strict_load(os.path.join(workdir, "report", "results.json"))["checkpoint_step"] == last
  assert [r["epoch"] for r in read_metrics(workdir)] == epochs_before
  assert checkpoint_steps(workdir) == [STEPS_PER_EPOCH, last]


def test_report_json_is_strict_with_null_for_undefined_values(tmp_path):
  values = {"a": float("nan"), "b": [np.float32(1.5), np.inf, -np.inf], "c": np.int64(3),
            "d": {"e": np.array([0.25, np.nan])}, "f": True, "g": "text", "h": None}
  assert report.strict_json(values) == {"a": None, "b": [1.5, None, None], "c": 3,
                                        "d": {"e": [0.25, None]}, "f": True, "g": "text",
                                        "h": None}
  # A report of logits no test example is confident about: s99_accuracy and empty bins.
  rng = np.random.default_rng(0)
  logits, labels = rng.normal(size=(200, 10)) * 0.1, rng.integers(0, 10, 200)
  built = report.build_report((logits, labels), (logits, labels), 10,
                              tiny_config().evaluation)
  flat = json.dumps(built, default=float)
  assert "NaN" in flat  # The case: undefined values exist before the conversion.
  paths = report.write_report(str(tmp_path), built)
  strict = _strict_load(paths[0])
  assert strict["metrics"]["test"]["before_ts"]["accuracy"] == pytest.approx(
      float(np.mean(np.argmax(logits, -1) == labels)))
  assert None in strict["reliability"]["before_ts"]["accuracy"]  # Empty bins: null.


def test_a_run_that_learns_nothing_stops_with_a_clear_message(tmp_path):
  """The outside report's run: FL_gamma with meta.max_gamma=0 and meta.temperature=1e-30
  trained with a loss of exactly 0.0 and exited 0 at chance accuracy. Now the first epoch
  stops it, naming the epoch, and nothing is saved."""
  config = tiny_config(**{"loss.name": "flgamma_sece", "dataset.meta_val_size": 128,
                          "meta.max_gamma": 0.0, "meta.temperature": 1e-30, "num_epochs": 1})
  with pytest.raises(train.StalledTrainingError,
                     match=r"learns nothing: at every one of the \d+ steps of epoch 0 the "
                           r"(gradient was exactly zero|training loss was exactly 0\.0)"):
    train.train_and_evaluate(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints" / "0")
  assert checkpoint_steps(str(tmp_path)) == []


@pytest.mark.parametrize("loss_min, loss_max, grad_max, steps, stalls", [
    (0.0, 0.0, 0.0, 5, True),  # Both.
    (0.5, 0.5, 0.1, 5, True),  # The same mean loss on 5 different batches.
    (0.5, 0.5, 0.1, 1, False),  # One step: one loss value says nothing.
    (0.4, 0.5, 0.0, 1, True),  # Zero gradient, even in one step.
    (0.4, 0.5, 0.1, 5, False),
    (-np.inf, np.inf, np.inf, 5, False),  # A resumed epoch's unknown extremes.
])
def test_stall_rule_by_hand(loss_min, loss_max, grad_max, steps, stalls, tmp_path):
  run = train.Run(tiny_config(), str(tmp_path), None, None, None,
                  train.checkpointing.Checkpointer(str(tmp_path), 1), {}, {}, None, None,
                  None, 0)
  totals = {"loss_min": np.float32(loss_min), "loss_max": np.float32(loss_max),
            "grad_norm_max": np.float32(grad_max)}
  if stalls:
    with pytest.raises(train.StalledTrainingError):
      train._raise_if_stalled(run, totals, 3, steps)
  else:
    train._raise_if_stalled(run, totals, 3, steps)
