"""The training loop and main.py: compile once, faults, resume after SIGKILL, end to end.

The jitted steps themselves (learning, metrics, 1 vs 8 devices) are tested in
test_steps.py. The slow runs are shared fixtures (tests/trained_runs.py): `main_run` (main.py,
1 device) serves the end-to-end, evaluate-only and SIGKILL tests; `selected_run` the
compile-once test; `other_model_run` the shape-mismatch test.
"""

import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cpjax import optim
from cpjax.calibration import conformal, posthoc, report
from cpjax.config import preflight
from cpjax.runtime import anatomy
from cpjax.training import setup, train
from tests import helpers
from tests.helpers import STEPS_PER_EPOCH, read_metrics, run_main, tiny_config

pytest_plugins = ("tests.trained_runs",)  # The shared trained runs.


def test_learning_rate_schedules_by_hand():
  config = tiny_config(**{"optimizer.learning_rate": 0.1}).optimizer
  assert optim.learning_rate_at(config, 0, 200) == pytest.approx(0.1)
  assert optim.learning_rate_at(config, 100, 200) == pytest.approx(0.05)
  assert optim.learning_rate_at(config, 199, 200) == pytest.approx(
      0.1 * (1 + np.cos(np.pi * 199 / 200)) / 2)
  config.schedule = "multistep"
  got = [optim.learning_rate_at(config, e, 350) for e in (0, 149, 150, 249, 250)]
  np.testing.assert_allclose(got, [0.1, 0.1, 0.01, 0.01, 0.001])


def test_step_schedule_is_the_epoch_schedule_stretched_over_the_run_steps():
  config = tiny_config(**{"optimizer.learning_rate": 0.1}).optimizer
  # Epoch unit: the epoch's rate whatever the step.
  assert optim.learning_rate_of_step(config, 2, 999, 1000, 4) == pytest.approx(
      0.1 * (1 + np.cos(np.pi * 2 / 4)) / 2)
  config.schedule_unit = "step"
  for t in (0, 7, 25, 49):  # Cosine over T = 50 steps: 0.1 (1 + cos(pi t / T)) / 2.
    assert optim.learning_rate_of_step(config, 0, t, 50, 4) == pytest.approx(
        0.1 * (1 + np.cos(np.pi * t / 50)) / 2)
  config.schedule, config.milestones = "multistep", (2, 3)  # Of 4 epochs over 100 steps.
  got = [optim.learning_rate_of_step(config, 0, t, 100, 4) for t in (0, 49, 50, 74, 75)]
  np.testing.assert_allclose(got, [0.1, 0.1, 0.01, 0.01, 0.001])


@pytest.mark.parametrize("natural, budget, expected", [
    ([422, 422, 422], 0, (422, 422, 422)),  # No budget: every epoch in full.
    ([422, 422, 422], 600, (422, 178)),
    ([422, 422, 422], 422, (422,)),  # Runs out exactly at an epoch's end.
    ([422, 43, 43], 100, (100,)),  # Runs out inside the first epoch.
    ([422, 43, 43], 450, (422, 28)),
    ([422, 43, 43], 10_000, (422, 43, 43)),  # More than the run needs: unchanged.
])
def test_epoch_steps_under_a_step_budget_by_hand(natural, budget, expected):
  assert setup._epoch_steps(natural, budget) == expected


@pytest.mark.slow
def test_budgeted_run_stops_at_the_budget_with_the_schedule_spread_over_it(tmp_path):
  """The "same budget" baseline: full data cut to 27 steps, cosine over those 27 steps."""
  budget = STEPS_PER_EPOCH + 7
  config = tiny_config(**{"num_epochs": 3, "budget_steps": budget,
                          "optimizer.schedule_unit": "step", "optimizer.learning_rate": 0.1})
  train.train_and_evaluate(config, str(tmp_path))
  records = read_metrics(str(tmp_path))
  assert [r["epoch"] for r in records] == [0, 1]  # Epoch 1 is cut short and is the last.
  assert helpers.checkpoint_steps(tmp_path) == [STEPS_PER_EPOCH, budget]
  assert records[1]["selected_k"] == 7 * config.batch_size  # 7 steps of distinct rows.
  assert records[1]["learning_rate"] == pytest.approx(  # At the epoch's first step, 20.
      0.1 * (1 + np.cos(np.pi * STEPS_PER_EPOCH / budget)) / 2, rel=1e-6)
  assert "test_accuracy" in records[1]  # The last epoch's evaluation and report ran.
  assert os.path.exists(tmp_path / "report" / "results.json")


def test_optimizer_is_pytorch_sgd_with_coupled_weight_decay_and_clipping():
  config = tiny_config(**{"optimizer.weight_decay": 0.01,
                          "optimizer.grad_clip_norm": 1.0}).optimizer
  tx = optim.create_optimizer(config)
  theta, buf = np.array([1.0, -2.0]), np.zeros(2)
  params = jnp.array(theta, jnp.float32)
  state = jax.jit(tx.init)(params)

  @jax.jit  # One program (op by op, every operation of the optimizer would compile alone).
  def update(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  for raw in ([3.0, 4.0], [0.1, 0.2]):  # The first gradient is clipped (norm 5 -> 1).
    g = np.array(raw) * min(1.0, 1.0 / np.linalg.norm(raw))
    buf = 0.9 * buf + g + 0.01 * theta  # torch.optim.SGD, dampening 0.
    theta = theta - 0.05 * buf
    state.hyperparams["learning_rate"] = jnp.float32(0.05)
    params, state = update(jnp.array(raw, jnp.float32), state, params)
  np.testing.assert_allclose(params, theta, rtol=1e-5)


def test_train_step_compiles_once_per_run(selected_run):
  """Warm-up epoch of 20 steps, then two top-half epochs of 10: one trace, one executable."""
  k = round(0.5 * 1257)
  assert selected_run.config.selection.fraction == 0.5
  assert helpers.checkpoint_steps(selected_run.workdir) == [  # Named by global step.
      STEPS_PER_EPOCH, STEPS_PER_EPOCH + -(-k // 64), STEPS_PER_EPOCH + 2 * -(-k // 64)]
  assert selected_run.train_step_traces == 1
  assert selected_run.train_step_executables == 1


@pytest.mark.slow
def test_non_finite_loss_stops_with_epoch_and_step_and_keeps_checkpoint(tmp_path, monkeypatch):
  real = optim.learning_rate_at
  monkeypatch.setattr(optim, "learning_rate_at",  # Epoch 1 diverges.
                      lambda c, e, n: 1e30 if e == 1 else real(c, e, n))
  config = tiny_config(**{"num_epochs": 2, "optimizer.weight_decay": 0.0})
  with pytest.raises(train.NonFiniteLossError, match=r"at epoch 1, step \d+ of the epoch"):
    train.train_and_evaluate(config, str(tmp_path))
  assert [r["epoch"] for r in read_metrics(str(tmp_path))] == [0]
  assert helpers.checkpoint_steps(tmp_path) == [STEPS_PER_EPOCH]  # After epoch 0 only.


def test_unwritable_workdir_fails_early(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(preflight.StartupCheckError, match=f"--workdir '{blocker}/workdir' "
                     f"cannot be a folder: {blocker} is a file; pass another --workdir"):
    train.train_and_evaluate(tiny_config(), str(blocker / "workdir"))


def test_restoring_into_other_shapes_names_the_mismatch(other_model_run, tmp_path):
  workdir = str(tmp_path / "copy")
  shutil.copytree(other_model_run.workdir, workdir)  # The shared run stays untouched.
  with pytest.raises(Exception, match=r"params.Conv_0.kernel: checkpoint \(3, 3, 1, 16\) vs "
                                      r"config \(3, 3, 1, 8\)"):
    train.train_and_evaluate(tiny_config(), workdir)  # `tiny` into small_cnn's checkpoint.


def _final_state(workdir):
  state = helpers.restore_checkpoint(workdir)
  del state["selection"]["seconds"]  # Wall-clock totals differ between any two runs.
  return state


def test_sigkill_and_rerun_reproduces_the_uninterrupted_run(main_run, tmp_path):
  killed = str(tmp_path / "killed")
  helpers.sigkill_once_saved(killed, helpers.MAIN_RUN_FLAGS, 2 * STEPS_PER_EPOCH,
                             helpers.subprocess_env())
  assert not os.path.isdir(os.path.join(killed, "checkpoints", str(4 * STEPS_PER_EPOCH)))
  # A damaged metrics.jsonl must not stop the rerun: an older duplicate of epoch 0 (the
  # last record of an epoch wins) and a torn final line (dropped with a warning).
  with open(os.path.join(killed, "metrics.jsonl")) as f:
    first = f.readline()
  with open(os.path.join(killed, "metrics.jsonl"), "a") as f:
    f.write(first.replace('"epoch": 0', '"stale": 1, "epoch": 0') + first + '{"epoch": 2, "tra')
  resumed = run_main(killed, *helpers.MAIN_RUN_FLAGS)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from" in resumed.stderr
  assert "is not a complete epoch record" in resumed.stderr
  assert (helpers.without_timing(read_metrics(killed))
          == helpers.without_timing(read_metrics(main_run.workdir)))
  jax.tree.map(np.testing.assert_array_equal, _final_state(killed),
               _final_state(main_run.workdir))


def test_main_end_to_end(main_run, tmp_path):
  records = read_metrics(main_run.workdir)
  assert [r["epoch"] for r in records] == [0, 1, 2, 3]
  for key in ("train_loss", "train_accuracy", "val_accuracy", "val_nll", "test_accuracy",
              "test_nll", "epoch_seconds"):
    assert all(np.isfinite(r[key]) for r in records), key
  assert all(0 <= r[k] <= 1 for r in records for k in ("val_accuracy", "test_accuracy"))
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(main_run.workdir))
  # keep_checkpoints=2: the last two, named by global step.
  assert helpers.checkpoint_steps(main_run.workdir) == [3 * STEPS_PER_EPOCH, 4 * STEPS_PER_EPOCH]
  assert sorted(os.listdir(os.path.join(main_run.workdir, "scores"))) == [
      f"epoch_{e:04d}.npy" for e in range(4)]  # --config.selection.record_scores=True.
  for key in ("ece", "adaptive_ece", "classwise_ece", "mce"):
    assert all(0 <= r[f"test_{key}"] <= 1 for r in records), key
  report = _check_report(os.path.join(main_run.workdir, "report"))
  # The report's before-TS test numbers are the last epoch's, from the same logits.
  for key in ("accuracy", "nll", "ece", "adaptive_ece", "classwise_ece", "mce", "aurc",
              "selective_risk_95"):
    assert report["metrics"]["test"]["before_ts"][key] == pytest.approx(records[-1][f"test_{key}"])
  chosen = report["posthoc"]["chosen"]
  assert records[-1]["calibrator"] == chosen
  assert records[-1]["test_calibrated_nll"] == pytest.approx(
      report["posthoc"]["calibrators"][chosen]["test"]["nll"])
  assert records[-1]["ood_fpr95_energy"] == report["ood"]["fpr_at_95_tpr"]["before_ts"]["energy"]

  # Evaluate-only (on a copy) rewrites the same report from the latest checkpoint, no training.
  workdir = str(tmp_path / "copy")
  shutil.copytree(main_run.workdir, workdir)
  shutil.rmtree(os.path.join(workdir, "report"))
  evaluated = run_main(workdir, *helpers.MAIN_RUN_FLAGS, "--mode=evaluate")
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  again = _check_report(os.path.join(workdir, "report"))
  assert again["metrics"] == report["metrics"] and again["intervals"] == report["intervals"]
  # Every post-hoc map is refitted on the checkpoint's validation logits: the same maps.
  for method, row in report["posthoc"]["calibrators"].items():
    refitted = again["posthoc"]["calibrators"][method]
    assert refitted["test"] == pytest.approx(row["test"], rel=1e-6), method
    assert refitted["hyper"] == row["hyper"], method
  assert read_metrics(workdir) == records  # No epoch was trained.
  assert helpers.checkpoint_steps(workdir) == helpers.checkpoint_steps(main_run.workdir)


def test_epoch_records_time_their_parts(main_run):
  """Each record's timed parts are disjoint stretches of its epoch, so they add up to at most
  its epoch_seconds (two clocks: a millisecond's slack); the input wait lies inside training;
  the last record also times its checkpoint and report. A CPU counts no device memory."""
  records = read_metrics(main_run.workdir)
  for r in records:  # configs/test.py evaluates every epoch.
    assert 0 <= r["input_wait_seconds"] <= r["training_seconds"], r["epoch"]
    assert r["eval_seconds"] > 0, r["epoch"]
    parts = ["scoring", "selection", "training", "eval", "checkpoint", "report"]
    assert sum(r.get(f"{p}_seconds", 0.0) for p in parts) <= r["epoch_seconds"] + 1e-3, r
  assert all("checkpoint_seconds" not in r and "report_seconds" not in r for r in records[:-1])
  assert records[-1]["checkpoint_seconds"] > 0 and records[-1]["report_seconds"] > 0
  assert not any("perf/peak_device_memory_bytes" in r for r in records)


def test_input_wait_counts_the_waits_for_batches_only():
  """A reader that takes 20 ms a batch under a loop that takes 150 ms a step: the wait is the
  reader's 3 x 20 ms (at least that; far below the loop's 450 ms), and every batch arrives."""
  def slow_reader():
    for i in range(3):
      time.sleep(0.02)
      yield i
  training, got = anatomy.Training(), []
  for batch in training.timed(slow_reader()):
    got.append(batch)
    time.sleep(0.15)  # The step: not input.
  assert got == [0, 1, 2]
  assert 0.06 <= training.input_wait < 0.3


def test_peak_device_memory_is_the_largest_devices_peak(monkeypatch):
  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      return self.stats
  devices = [Device({"peak_bytes_in_use": 5, "bytes_in_use": 9}), Device(None),
             Device({"peak_bytes_in_use": 7})]
  monkeypatch.setattr(jax, "local_devices", lambda: devices)
  assert train.peak_device_memory() == {"perf/peak_device_memory_bytes": 7}
  monkeypatch.setattr(jax, "local_devices", lambda: [Device(None)])  # A CPU: not counted.
  assert train.peak_device_memory() == {}


def _check_report(report_dir):
  """The report's files exist, the PNGs decode to non-blank images; returns results.json."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  for name in ("reliability_before_ts.png", "reliability_after_ts.png",
               "reliability_calibrated.png", "confidence_histogram.png"):
    with Image.open(os.path.join(report_dir, name)) as image:
      pixels = np.asarray(image.convert("L"))
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 10, name
  with open(os.path.join(report_dir, "results.md")) as f:
    markdown = f.read()
  assert "Temperature (grid_ece" in markdown
  # The footer names its sources, so a user's report stands without the repository.
  assert "Tata et al. 2022, 'Can Calibration Improve Sample Prioritization?'" in markdown
  assert "Mukhoti et al. 2020, 'Calibrating Deep Neural Networks using Focal Loss'" in markdown
  with open(os.path.join(report_dir, "results.json")) as f:
    results = json.load(f)
  fit = results["temperature"]
  assert 0.1 <= fit["temperature"] <= 10.0
  for tag in ("before_ts", "after_ts"):
    assert (results["metrics"]["test"][tag]["accuracy"]
            == results["metrics"]["test"]["before_ts"]["accuracy"])
    for name, interval in results["intervals"][tag].items():
      assert interval["low"] <= interval["high"] and interval["num_resamples"] == 100, name
    assert set(results["ood"][tag]) == {"entropy", "max_softmax", "max_logit", "energy"}
  assert sum(results["reliability"]["before_ts"]["count"]) == 360  # Every test image binned.
  assert set(results["ood"]["fpr_at_95_tpr"]["before_ts"]) == set(results["ood"]["before_ts"])
  section = results["posthoc"]
  assert list(section["calibrators"]) == list(posthoc.MAPS.names())
  assert section["requested"] == section["chosen"] == "ensemble_temperature"  # The default.
  for method in ("none", "temperature", "ensemble_temperature"):  # Accuracy kept.
    assert (section["calibrators"][method]["test"]["accuracy"]
            == results["metrics"]["test"]["before_ts"]["accuracy"]), method
    # Same resampled rows, same predictions: the same accuracy interval.
    assert (section["calibrators"][method]["intervals"]["accuracy"]
            == section["calibrators"]["none"]["intervals"]["accuracy"]), method
  for method, row in section["calibrators"].items():
    assert set(row["intervals"]) == set(report.TABLE_METRICS), method
    for name, interval in row["intervals"].items():
      assert interval["point"] == pytest.approx(row["test"][name]), (method, name)
      assert interval["low"] <= interval["high"], (method, name)
  assert section["calibrators"]["none"]["test"]["nll"] == pytest.approx(
      results["metrics"]["test"]["before_ts"]["nll"])
  assert sum(results["reliability"]["calibrated"]["count"]) == 360
  _check_conformal_from_the_saved_logits(report_dir, results)
  return results


def _check_conformal_from_the_saved_logits(report_dir, report):
  """val_logits.npz and test_logits.npz give back the report's conformal sets: the
  uncalibrated ones from the softmax of the saved logits, the calibrated ones from the
  chosen map refitted on the saved validation logits (float32 logits, as the report's)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  with Image.open(os.path.join(report_dir, "set_size_histogram.png")) as image:
    assert np.asarray(image.convert("L")).std() > 10
  saved = {}
  for split in ("val", "test"):
    with np.load(os.path.join(report_dir, f"{split}_logits.npz")) as arrays:
      saved[split] = {name: arrays[name] for name in arrays.files}
  assert len(saved["val"]["ids"]) == 180 and len(saved["test"]["ids"]) == 360
  section = report["conformal"]
  assert section["scores"] == ["lac", "aps", "raps"] and section["alphas"] == [0.1]
  calibrator = posthoc.fit(section["calibrator"], saved["val"]["logits"], saved["val"]["labels"])
  inputs = {"uncalibrated": [conformal.softmax(saved[s]["logits"]) for s in ("val", "test")],
            "calibrated": [np.exp(posthoc.apply(calibrator, saved[s]["logits"]))
                           for s in ("val", "test")]}
  for tag, (val_p, test_p) in inputs.items():
    for name in section["scores"]:
      settings = conformal.keywords(name, report["conformal"]["settings"])
      scores = conformal.label_scores(name, val_p, saved["val"]["labels"], **settings)
      q = conformal.threshold(scores, 0.1)
      sets = conformal.prediction_sets(name, test_p, q, **settings)
      entry = section["sets"][tag][name]["0.1"]
      assert entry["threshold"] == q, (tag, name)
      assert entry["test"]["mean_size"] == sets.sum(1).mean(), (tag, name)
      assert entry["test"]["coverage"] == sets[np.arange(360), saved["test"]["labels"]].mean()


def test_a_bad_value_fails_before_any_work(tmp_path):
  with pytest.raises(ValueError, match="config.loss.name: got 'bogus'; valid choices: brier, "
                                       "ce_dece"):
    train.train_and_evaluate(tiny_config(**{"loss.name": "bogus"}), str(tmp_path / "wd"))
  assert not (tmp_path / "wd").exists()


def test_evaluate_on_a_missing_workdir_fails_without_creating_it(tmp_path):
  missing = tmp_path / "never_trained"
  with pytest.raises(FileNotFoundError, match="no checkpoints/ in --workdir"):
    train.evaluate_only(tiny_config(), str(missing))
  assert not missing.exists()
