"""The post-hoc study's paired comparison against SciPy's paired t-test and by hand."""

import json
import os

import numpy as np
import pytest
import scipy.stats

from studies import posthoc as study


def test_paired_interval_is_scipy_ttest_rel_confidence_interval():
  ours, theirs = [0.012, 0.018, 0.011], [0.020, 0.019, 0.025]
  reference = scipy.stats.ttest_rel(ours, theirs).confidence_interval(0.9)
  diff = study.paired(ours, theirs)
  assert diff["mean"] == pytest.approx(np.mean(np.subtract(ours, theirs)))
  assert (diff["low"], diff["high"]) == pytest.approx((reference.low, reference.high))


def test_beats_needs_a_lower_ece_or_nll_interval_without_losing_accuracy():
  below, around = {"low": -2.0, "high": -1.0}, {"low": -1.0, "high": 1.0}
  assert study.beats({"ece": below, "nll": around, "accuracy": around})
  assert not study.beats({"ece": around, "nll": around, "accuracy": around})
  assert not study.beats({"ece": below, "nll": below, "accuracy": below})  # Accuracy lost.


def test_summary_names_the_winner_and_compares_against_ce_with_its_auto_map():
  def cell(ece, nll, acc):
    return {"ece": ece, "nll": nll, "accuracy": acc}
  maps = {m: cell([0.05, 0.06, 0.05], [0.5, 0.6, 0.5], [0.9, 0.9, 0.9]) for m in
          ("none", "temperature", "vector_scaling", "matrix_scaling", "dirichlet",
           "ensemble_temperature", "histogram_binning", "isotonic")}
  ce = {**maps, "auto": cell([0.03, 0.04, 0.035], [0.4, 0.45, 0.42], [0.9, 0.9, 0.9])}
  focal = {**maps, "auto": cell([0.01, 0.015, 0.012], [0.3, 0.33, 0.31], [0.9, 0.91, 0.9])}
  results = {"digits": {"cross_entropy": ce, "focal": focal}}
  diffs = study.compare(results, "digits")
  assert set(diffs) == {"cross_entropy+none", "focal+none", "focal+auto"}
  assert diffs["focal+auto"]["ece"]["mean"] == pytest.approx(
      ((0.01 - 0.03) + (0.015 - 0.04) + (0.012 - 0.035)) / 3)
  text = "\n".join(study.summary_lines("digits", results, [0, 1, 2]))
  assert "Yes: focal+auto." in text


@pytest.mark.parametrize("dataset", study.DATASETS)
def test_every_run_of_the_study_has_a_config(dataset):
  """The refit path rebuilds each run's config; the long-schedule runs take their arm's."""
  losses = study.LONG_ARMS if dataset == study.LONG else study.meta_calibration.LOSSES
  for loss in losses:
    config = study.run_config(dataset, loss, seed=2)
    assert config.seed == 2 and config.loss.name == loss
  if dataset == study.LONG:
    assert config.num_epochs == 20 and config.dataset.meta_val_size == 5000


def _finish(root, arm, seed, report=None):
  os.makedirs(os.path.join(root, arm, f"seed{seed}", "report"))
  with open(os.path.join(root, arm, f"seed{seed}", "report", "results.json"), "w") as f:
    json.dump(report or {}, f)


def test_long_plan_takes_the_seeds_of_finished_ce_runs_and_losses_finished_at_all(tmp_path):
  root = str(tmp_path)
  for seed in (0, 1):
    _finish(root, "full", seed)
    _finish(root, "flsd53_full", seed)
  _finish(root, "full", 2)  # CE ahead at seed 2: seed 2 waits for FLSD-53's.
  _finish(root, "flgamma_full", 0)  # One seed, no interval: left out, not shrinking the rest.
  losses, seeds, left_out = study.long_plan(
      ["cross_entropy", "focal", "flsd53", "flgamma_sece"], [0, 1, 2], root)
  assert (losses, seeds, left_out) == (["cross_entropy", "flsd53"], [0, 1], ["flgamma_sece"])
  _finish(root, "flsd53_full", 2)
  assert study.long_plan(["cross_entropy", "flsd53"], [0, 1, 2], root)[1] == [0, 1, 2]
  assert study.long_plan(["cross_entropy"], [2], root) == ([], [], ["cross_entropy"])


def test_long_report_with_its_table_is_read_in_place(tmp_path):
  root, out = str(tmp_path / "long"), str(tmp_path / "out")
  _finish(root, "full", 0, {"posthoc": {"calibrators": {}}, "epoch": 20})
  assert study.long_report_of("cross_entropy", 0, out, root)["epoch"] == 20
  assert not os.path.exists(out)  # Nothing copied, nothing refitted.


def test_one_seed_is_not_called_a_no():
  """With one seed there is no interval: the summary says so instead of answering no."""
  maps = {m: {"ece": [0.05], "nll": [0.5], "accuracy": [0.9]} for m in
          ("none", "temperature", "vector_scaling", "matrix_scaling", "dirichlet",
           "ensemble_temperature", "histogram_binning", "isotonic", "auto")}
  results = {"digits": {"cross_entropy": maps, "flsd53": maps}}
  text = "\n".join(study.summary_lines("digits", results, [0]))
  assert "Not decided: one seed gives no interval." in text and "No: no loss" not in text


def _report(ece: float) -> dict:
  """A report's post-hoc table by hand: `temperature` has the lowest cross-validated NLL."""
  def row(scale, cv_nll):
    return {"cv_nll": cv_nll, "test": {"ece": ece * scale, "nll": 0.3 * scale,
                                       "accuracy": 0.9, "brier": 0.1}}
  return {"posthoc": {"calibrators": {
      m: row(0.5, 0.2) if m == "temperature" else row(1.0, 0.5) for m in study.posthoc.MAPS}}}


def _args(tmp_path, **extra):
  import argparse
  return argparse.Namespace(records=str(tmp_path / "records"), out=str(tmp_path / "out"),
                            runs=None, long_runs=str(tmp_path / "long"), refit=False, **extra)


def test_a_finished_run_is_recorded_and_its_record_read_instead_of_the_run(tmp_path,
                                                                            monkeypatch):
  args = _args(tmp_path)
  monkeypatch.setattr(study, "report_of", lambda *a, **k: _report(0.04))
  rows = study.run_table("digits", "focal", 1, args)
  assert rows["auto"] == {"ece": 0.02, "nll": 0.15, "accuracy": 0.9, "map": "temperature"}
  assert rows["none"] == {"ece": 0.04, "nll": 0.3, "accuracy": 0.9}
  path = tmp_path / "records" / "digits" / "focal" / "seed1.json"
  assert json.loads(path.read_text()) == rows

  def must_not_run(*a, **k):
    raise AssertionError("a recorded run was trained or refitted")
  monkeypatch.setattr(study, "report_of", must_not_run)
  assert study.run_table("digits", "focal", 1, args) == rows
  args.refit = True  # --refit recomputes despite the record.
  with pytest.raises(AssertionError, match="recorded run"):
    study.run_table("digits", "focal", 1, args)


def test_study_summarises_from_records_alone(tmp_path, monkeypatch):
  """A fresh clone has the records and no workdirs: the study trains nothing and summarises."""
  for seed, (ce, fl) in enumerate([(0.04, 0.03), (0.05, 0.035), (0.045, 0.03)]):
    for loss, ece in (("cross_entropy", ce), ("flsd53", fl)):
      study.save_record(study.record_path(str(tmp_path / "records"), study.LONG, loss, seed),
                        study.table(_report(ece)))

  def must_not_run(*a, **k):
    raise AssertionError("a recorded run was trained or refitted")
  monkeypatch.setattr(study, "report_of", must_not_run)
  monkeypatch.setattr(study, "long_report_of", must_not_run)
  monkeypatch.setattr("sys.argv", ["posthoc", f"--out={tmp_path / 'out'}",
                                   f"--records={tmp_path / 'records'}",
                                   f"--long-runs={tmp_path / 'long'}", "--datasets", study.LONG,
                                   "--losses", "cross_entropy", "flsd53"])
  study.main()
  summary = json.loads((tmp_path / "out" / "summary.json").read_text())
  assert summary["seeds"] == {study.LONG: [0, 1, 2]}
  by_loss = summary["results"][study.LONG]
  assert by_loss["flsd53"]["none"]["ece"] == pytest.approx([0.03, 0.035, 0.03])
  assert by_loss["cross_entropy"]["auto"]["ece"] == pytest.approx([0.02, 0.025, 0.0225])
  diff = summary["paired"][study.LONG]["auto"]["flsd53+auto"]["ece"]["mean"]
  assert diff == pytest.approx(np.mean([0.015 - 0.02, 0.0175 - 0.025, 0.015 - 0.0225]))


def test_long_plan_counts_a_recorded_run_as_finished(tmp_path):
  root, records = str(tmp_path / "long"), str(tmp_path / "records")
  for seed in (0, 1):
    _finish(root, "full", seed)
  study.save_record(study.record_path(records, study.LONG, "flsd53", 0), {})
  assert study.long_plan(["cross_entropy", "flsd53"], [0, 1], root, records)[0] == [
      "cross_entropy"]  # FLSD-53 at one seed only: left out.
  study.save_record(study.record_path(records, study.LONG, "flsd53", 1), {})
  study.save_record(study.record_path(records, study.LONG, "cross_entropy", 2), {})
  assert study.long_plan(["cross_entropy", "flsd53"], [0, 1, 2], root, records)[:2] == (
      ["cross_entropy", "flsd53"], [0, 1])
