"""The post-hoc study's paired comparison against SciPy's paired t-test and by hand."""

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
