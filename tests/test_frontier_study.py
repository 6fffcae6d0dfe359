"""The frontier study's budgets, equivalence test and pre-registered choice against
hand-worked cases and a second implementation (SciPy's one-sample t-tests)."""

import json
import math
import os
import subprocess

import matplotlib.pyplot as plt
import numpy as np
import pytest
from scipy import stats

from cpjax.config import validation
from studies import equivalence, frontier, frontier_summary, frontier_tiers, grid, long_schedule
from studies.frontier_tiers import Arm


def test_tost_by_hand():
  # d = (+0.1, 0, -0.1) points: mean 0, sd 0.1, se 0.1 / sqrt(3); t = 0.2 / se = sqrt(12).
  # With 2 degrees of freedom the t tail is closed-form: sf(t) = (1 - t / sqrt(t^2 + 2)) / 2.
  result = equivalence.tost([0.001, 0.0, -0.001])
  t = math.sqrt(12)
  assert result["p"] == pytest.approx((1 - t / math.sqrt(t * t + 2)) / 2, rel=1e-9)
  assert result["equivalent"] and result["mean"] == 0.0
  # The 90 % interval: mean +- t_0.95(2) * se, with t_0.95(2) = 2.919986.
  assert result["high"] == pytest.approx(2.919986 * 0.001 / math.sqrt(3), rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_tost_equals_two_one_sided_scipy_tests(seed):
  rng = np.random.default_rng(seed)
  d = rng.normal(rng.uniform(-0.003, 0.003), 0.0015, size=int(rng.integers(3, 9)))
  lower = stats.ttest_1samp(d + equivalence.MARGIN, 0.0, alternative="greater").pvalue
  upper = stats.ttest_1samp(d - equivalence.MARGIN, 0.0, alternative="less").pvalue
  result = equivalence.tost(d)
  assert result["p"] == pytest.approx(max(lower, upper), rel=1e-9)
  # Equivalence at alpha 0.05 is the 90 % t interval inside the margin.
  low, high = stats.t.interval(0.9, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
  inside = -equivalence.MARGIN < low and high < equivalence.MARGIN
  assert result["equivalent"] == inside
  assert (result["low"], result["high"]) == pytest.approx((low, high), rel=1e-9)


def test_lossless_needs_equivalence_and_a_small_mean_loss():
  assert equivalence.lossless({"equivalent": True, "mean": -0.0005})
  assert not equivalence.lossless({"equivalent": True, "mean": -0.0015})  # Below -0.1 points.
  assert not equivalence.lossless({"equivalent": False, "mean": 0.0})
  assert not equivalence.tost([0.0005])["equivalent"]  # One seed proves nothing.


@pytest.mark.parametrize("budget", frontier_tiers.BUDGETS)
def test_anneal_arms_cost_what_the_constant_budget_arms_cost(budget):
  # 20 epochs, 1 warm-up: 1 + 19 B full-epoch equivalents; an annealing arm trains
  # 1 + 2 + 17 f of them.
  f = frontier_tiers.anneal_fraction_for(budget, 20)
  assert 1 + 2 + 17 * f == pytest.approx(1 + 19 * budget / 100, abs=17 * 5e-5)


def test_anneal_fraction_of_the_half_budget_by_hand():
  assert frontier_tiers.anneal_fraction_for(45, 20) == pytest.approx((19 * 0.45 - 2) / 17, abs=5e-5)
  assert frontier_tiers.anneal_fraction_for(45, 20) == 0.3853


@pytest.mark.parametrize("budget", frontier_tiers.BUDGETS)
def test_rising_schedule_keeps_the_budget_on_average(budget):
  start, end = frontier_tiers.rising_range(budget)
  fractions = [start + (end - start) * e / 18 for e in range(19)]  # 19 selected epochs.
  assert np.mean(fractions) == pytest.approx(budget / 100, abs=1e-4)
  assert 0.05 <= start < end <= 1.0


def _result(values, passes, val=None, seeds=None):
  seeds = range(len(values)) if seeds is None else seeds
  return {"seed_index": {s: i for i, s in enumerate(seeds)}, "accuracy": list(values),
          "val_accuracy": list(val if val is not None else values),
          "passes": [passes] * len(values), "ece": [0.0] * len(values)}


def test_the_choice_is_the_best_validation_accuracy_at_half_the_passes_or_less():
  arms = [Arm("full", "full", {}, "A"), Arm("a-45", "a", {}, "A", 45),
          Arm("b-45", "b", {}, "A", 45), Arm("c-45", "c", {}, "A", 45),
          Arm("d-30", "d", {}, "B", 30)]
  results = {"full": _result([0.92] * 3, 100.0),
             "a-45": _result([0.91] * 3, 48.0, val=[0.915] * 3),
             "b-45": _result([0.90] * 3, 47.0, val=[0.93] * 3),  # Best validation: chosen,
             "c-45": _result([0.95] * 3, 60.0),  # not this one: more than half the passes.
             "d-30": _result([0.99] * 3, 30.0)}  # Tier B never takes part.
  assert frontier_summary.choose(arms, results).name == "b-45"
  del results["a-45"]["seed_index"][2]  # A tier-A arm without all its seeds: no choice yet.
  assert frontier_summary.choose(arms, results) is None


def test_summary_pairs_by_seed_and_finds_the_largest_lossless_saving():
  arms = [Arm("full", "full", {}, "A"), Arm("p-45", "p", {}, "A", 45),
          Arm("p-30", "p", {}, "B", 30), Arm("q-45", "q", {}, "A", 45)]
  full = [0.920, 0.922, 0.925]
  results = {"full": _result(full, 100.0),
             "p-45": _result(np.add(full, [0.0005, -0.0003, 0.0001]), 48.0),
             "p-30": _result(np.add(full, [-0.0100, -0.0080, -0.0120]), 34.0),
             "q-45": _result(np.add(full, [0.0005, -0.0030, 0.0040]), 48.0)}
  summary = frontier_summary.summarise(arms, results)
  assert summary["p-45"]["passes_share"] == pytest.approx(0.48)
  assert summary["p-45"]["vs_full"]["mean"] == pytest.approx(0.0001, abs=1e-12)
  assert summary["p-45"]["vs_full"]["lossless"]
  assert not summary["p-30"]["vs_full"]["lossless"]
  assert not summary["q-45"]["vs_full"]["lossless"]  # Mean +0.05 points but too spread.
  answers = frontier_summary.frontier_answers(summary)
  assert answers["p"]["arm"] == "p-45" and answers["p"]["saving"] == pytest.approx(0.52)
  assert answers["q"] is None
  # An arm on 2 of seeds 0-2 is lossless on them (interval ±0.06 points) but does not count yet.
  arms.append(Arm("p-20", "p", {}, "B", 20))
  results["p-20"] = _result(np.add(full[:2], [0.0001, -0.0001]), 25.0)
  summary = frontier_summary.summarise(arms, results)
  assert summary["p-20"]["vs_full"]["lossless"]
  assert frontier_summary.frontier_answers(summary)["p"]["arm"] == "p-45"
  table = frontier_summary.markdown(summary, None, "cmd", {}).splitlines()
  rows = {row.split("|")[1].strip(): row for row in table if row.startswith("| p-")}
  assert rows["p-20"].endswith("| not yet (2 of 3 seeds) |")
  assert rows["p-45"].endswith("| yes |")


def _confirmation(differences, seeds=frontier_tiers.CONFIRM_SEEDS):
  """Summary and chosen arm with a tier-C arm `differences` from full data on `seeds`."""
  chosen = Arm("p-45", "p", {}, "A", 45)
  arms = [Arm("full@confirm", "full", {}, "C", seeds=seeds),
          Arm("p-45@confirm", "p", {}, "C", 45, seeds=seeds)]
  full = [0.920, 0.918, 0.925, 0.921, 0.919][:len(seeds)]
  results = {"full@confirm": _result(full, 100.0, seeds=seeds),
             "p-45@confirm": _result(np.add(full, differences), 47.75, seeds=seeds)}
  return frontier_summary.verdicts(frontier_summary.summarise(arms, results), chosen)


def test_the_half_compute_verdict_needs_five_untouched_seeds_equivalence_and_the_mean():
  # Differences in accuracy (0.0001 = 0.01 points). Tight around +0.002 points: met.
  found = _confirmation([-0.0005, 0.0003, 0.0001, -0.0002, 0.0004])["untouched"]
  assert found["complete"] and found["lossless"] and found["met"]
  assert found["saving"] == pytest.approx(0.5225) and found["seeds"] == [3, 4, 5, 6, 7]
  # Tight around -0.12 points: equivalent at +-0.2, but the mean is below -0.1: missed.
  found = _confirmation([-0.0011, -0.0013, -0.0012, -0.0012, -0.0012])["untouched"]
  assert found["equivalent"] and not found["lossless"] and not found["met"]
  # The same good differences on seeds 3-5 only: undecided, not met.
  found = _confirmation([-0.0005, 0.0003, 0.0001], seeds=(3, 4, 5))["untouched"]
  assert found["lossless"] and not found["complete"] and not found["met"]
  lines = frontier_summary.verdict_lines({"untouched": found})
  assert lines[3] == "**Tier C, seeds 3-7: not decided yet.**" and "incomplete" in lines[4]


def test_arms_option_names_an_unknown_arm_and_the_near_ones():
  base = frontier_tiers.base_config()
  assert frontier_tiers.parse_arms("topk_anneal-70,noisy_topk_anneal-45@confirm", base) == [
      "topk_anneal-70", "noisy_topk_anneal-45@confirm"]
  assert frontier_tiers.parse_arms("", base) == []
  with pytest.raises(SystemExit, match=r"unknown arm 'topk_anneal-50'; did you mean "
                                       r"topk_anneal-p50 or topk_anneal-70\? valid arms: full,"):
    frontier_tiers.parse_arms("topk_anneal-50", base)


def test_every_arm_is_a_valid_config():
  base = frontier_tiers.base_config()
  search = frontier_tiers.search_arms(base)
  assert len({a.name for a in search}) == len(search) == 1 + 4 * len(frontier_tiers.POLICIES)
  chosen = next(a for a in search if a.name == "topk_anneal-45")
  for arm in search + frontier_tiers.later_arms(chosen, base):
    validation.validate(grid.apply(base, frontier_tiers.run_overrides(arm, 3)))


def test_summarise_only_reads_the_long_schedule_records(tmp_path, monkeypatch):
  """With no frontier record yet, the summary holds the runs the long-schedule study already
  made with the same settings, and trains nothing. Passes by hand: full data trains 20
  epochs of ceil(54,000 / 128) = 422 steps; top-k at 30 % the first of them, then 19 of
  ceil(16,200 / 128) = 127 steps."""
  def no_training(*args):
    raise AssertionError(f"trained {args[1:]}")
  monkeypatch.setattr(frontier.grid.train, "train_and_evaluate", no_training)
  monkeypatch.setattr("sys.argv", ["frontier", f"--out={tmp_path}", "--summarise-only",
                                   f"--records={tmp_path / 'records'}"])
  frontier.main()
  with open(tmp_path / "summary.json") as f:
    out = json.load(f)
  summary = out["summary"]
  assert summary["topk_entropy-30"]["passes_share"] == pytest.approx((422 + 19 * 127) / (20 * 422))
  assert summary["topk_entropy-30"]["seeds"] == [0, 1, 2]
  assert not summary["topk_entropy-30"]["vs_full"]["lossless"]  # -0.26 [-0.46, -0.06].
  assert out["chosen"] is None and not out["failures"]
  assert (tmp_path / "frontier.png").exists() and (tmp_path / "summary.md").exists()


def _tiers_c_and_f(c_differences, f_differences):
  """Summary, results and chosen arm with tiers C (seeds 3-7) and F (seeds 8-12) of a chosen
  arm `p-45`, each `*_differences` from full data on its seeds."""
  chosen = Arm("p-45", "p", {}, "A", 45)
  arms, results = [], {}
  for suffix, tier, seeds, d in (
      ("@confirm", "C", frontier_tiers.CONFIRM_SEEDS, c_differences),
      ("@replicate", "F", frontier_tiers.REPLICATE_SEEDS, f_differences)):
    full = [0.920, 0.918, 0.925, 0.921, 0.919]
    arms += [Arm(f"full{suffix}", "full", {}, tier, seeds=seeds),
             Arm(f"p-45{suffix}", "p", {}, tier, 45, seeds=seeds)]
    results[f"full{suffix}"] = _result(full, 100.0, seeds=seeds)
    results[f"p-45{suffix}"] = _result(np.add(full, d), 47.75, seeds=seeds)
  return frontier_summary.summarise(arms, results), results, chosen


def test_replication_is_reported_alone_and_pooled_beside_the_original_verdict():
  c = [-0.0005, 0.0003, 0.0001, -0.0002, 0.0004]  # Tight around +0.002 points: met.
  f = [-0.0011, -0.0013, -0.0012, -0.0012, -0.0012]  # Equivalent, mean -0.12: not lossless.
  summary, results, chosen = _tiers_c_and_f(c, f)
  found = frontier_summary.verdicts(summary, chosen, results)
  assert found["untouched"]["met"]  # Tier C's verdict stays as it was.
  assert found["replicate"]["equivalent"] and not found["replicate"]["met"]
  assert found["replicate"]["seeds"] == [8, 9, 10, 11, 12]
  pooled = found["pooled"]
  assert pooled["seeds"] == list(range(3, 13)) and pooled["complete"]
  # The pooled test is the TOST on the 10 differences: SciPy's one-sided t-tests.
  d = np.array(c + f)
  lower = stats.ttest_1samp(d + equivalence.MARGIN, 0.0, alternative="greater").pvalue
  upper = stats.ttest_1samp(d - equivalence.MARGIN, 0.0, alternative="less").pvalue
  assert pooled["p"] == pytest.approx(max(lower, upper), rel=1e-9)
  assert pooled["mean"] == pytest.approx((0.0001 / 5 - 0.006 / 5) / 2, abs=1e-12)
  assert pooled["met"] == (pooled["equivalent"] and pooled["mean"] >= -0.001)
  lines = frontier_summary.verdict_lines(found)
  assert lines[3] == "**Tier C, seeds 3-7: met.**" and "**not replicated**" in lines[4]
  assert any(line.startswith("- tiers C and F pooled, seeds 3-12") for line in lines)


def test_test_image_bootstrap_against_the_binomial_closed_form():
  # Both runs agree on every image but 200 of 2,000, which only the arm gets right: the
  # resampled difference is Binomial(2000, 0.1) / 2000, whose 90 % interval is about
  # 0.1 +- 1.645 sqrt(0.1 * 0.9 / 2000) = 0.1 +- 0.011.
  n, k = 2000, 200
  full = np.zeros(n, np.int8)
  full[k::2] = 1
  arm = full.copy()
  arm[:k] = 1
  results = {name: {"seed_index": {3: 0}, "accuracy": [c.mean()], "correct": [c.tolist()]}
             for name, c in (("arm", arm), ("full", full))}
  out = frontier_summary.test_image_intervals(results, "arm", "full", [3])
  half = 1.645 * math.sqrt(0.1 * 0.9 / n)
  assert out["pooled"] == pytest.approx([0.1 - half, 0.1 + half], abs=0.003)
  difference, low, high = out["per_seed"][3]
  assert difference == pytest.approx(0.1) and (low, high) == pytest.approx(out["pooled"])
  # Identical predictions: every resample differs by exactly 0.
  results["arm"] = results["full"]
  assert frontier_summary.test_image_intervals(results, "arm", "full", [3])["pooled"] == [0.0, 0.0]


def test_smallest_share_not_shown_worse_and_the_equivalent_arms():
  arms = [Arm("full", "full", {}, "A"), Arm("p-30", "p", {}, "B", 30),
          Arm("p-45", "p", {}, "A", 45), Arm("p-70", "p", {}, "B", 70),
          Arm("q-45", "q", {}, "A", 45)]
  full = [0.920, 0.922, 0.925]
  results = {"full": _result(full, 100.0),
             "p-30": _result(np.add(full, [-0.010, -0.008, -0.012]), 34.0),  # Worse.
             "p-45": _result(np.add(full, [0.003, -0.004, -0.001]), 48.0),  # Not worse, wide.
             "p-70": _result(np.add(full, [0.0002, -0.0001, 0.0]), 72.0),  # Equivalent.
             "q-45": _result(np.add(full, [-0.010, -0.011, -0.009]), 48.0)}
  arms.append(Arm("q-30", "q", {}, "B", 30))  # Two of its three seeds so far,
  results["q-30"] = _result(np.add(full[:2], [0.0001, -0.0001]), 34.0)  # "equivalent" on them.
  out = frontier_summary.smallest_not_worse(frontier_summary.summarise(arms, results))
  assert out["p"]["not_worse"] == {"arm": "p-45", "passes_share": pytest.approx(0.48)}
  assert out["p"]["equivalent"] == ["p-70"]
  assert out["q"] == {"not_worse": None, "equivalent": [], "incomplete": [("q-30", 2)]}


def test_the_figure_is_drawn_without_full_datas_records(tmp_path):
  """A tier run before full data's (`--tiers B` on a fresh --out) has no share of passes: the
  figure is still written, and the summary's table shows no share for it."""
  arms = [Arm("full", "full", {}, "A"), Arm("p-30", "p", {}, "B", 30)]
  results = {"p-30": _result([0.90, 0.91, 0.92], 34.0)}
  summary = frontier_summary.summarise(arms, results)
  assert "passes_share" not in summary["p-30"] and "vs_full" not in summary["p-30"]
  frontier_summary.plot_frontier(arms, results, summary, str(tmp_path / "frontier.png"))
  assert (tmp_path / "frontier.png").stat().st_size > 0


def test_a_verdict_says_when_the_arm_is_above_or_below_full_data():
  """The verdict line names the side of 0 that a 90 % interval excludes: an arm above full
  data is better, not 'not lossless' alone; one below says so beside its test."""
  base = {"arm": "a", "seeds": [3, 4, 5, 6, 7], "complete": True, "saving": 0.52, "n": 5,
          "p": 0.98, "equivalent": False, "lossless": False}
  above = frontier_summary._verdict_line("noise", {**base, "mean": 0.008, "low": 0.004,
                                                   "high": 0.012})
  assert above.endswith("+0.80 [+0.40, +1.20] points vs full data, not shown equivalent at "
                        "±0.2 (TOST p 0.980); above full data: its 90 % interval excludes 0 "
                        "(better, so not equivalent)")
  below = frontier_summary._verdict_line("f", {**base, "mean": -0.0018, "low": -0.0031,
                                               "high": -0.0004})
  assert below.endswith("not lossless; below full data: its 90 % interval excludes 0")
  across = frontier_summary._verdict_line("c", {**base, "mean": -0.0007, "low": -0.0015,
                                                "high": 0.0001, "p": 0.013, "equivalent": True,
                                                "lossless": True})
  assert across.endswith("equivalent at ±0.2 (TOST p 0.013); lossless")


def test_the_figure_marks_an_arm_far_below_full_data_at_its_floor():
  """An arm 10 points below full data would squash the arms near 0 that the figure is for: both
  panels stop a few points below full data and name that arm at the edge, with its numbers
  worked by hand: differences -10.0, -12.1, -7.9 have sd 2.1, so the 90 % t interval is
  -10.0 -/+ 2.92 x 2.1 / sqrt(3) = [-13.54, -6.46]; accuracies 82, 80, 84 %: 82.0 [78.6, 85.4]."""
  arms = [Arm("full", "full", {}, "A"),
          Arm("infobatch-r95", "infobatch", {}, "B", 95),
          Arm("topk_anneal-45", "topk_anneal", {}, "A", 45)]
  results = {"full": _result([0.92, 0.921, 0.919], 100.0),
             "infobatch-r95": _result([0.82, 0.80, 0.84], 41.6),
             "topk_anneal-45": _result([0.919, 0.92, 0.918], 47.8)}
  summary = frontier_summary.summarise(arms, results)
  fig = frontier_summary.draw_frontier(arms, results, summary)
  try:
    accuracy, difference = fig.axes[:2]
    assert accuracy.get_ylim()[0] > 85 and difference.get_ylim()[0] > -5
    notes = {axis: [t.get_text() for t in axis.texts] for axis in (accuracy, difference)}
    assert notes[difference] == ["infobatch-r95: -10.00 [-13.54, -6.46] (below)"]
    assert notes[accuracy] == ["infobatch-r95: 82.0 [78.6, 85.4] % (below)"]
  finally:
    plt.close(fig)


@pytest.mark.parametrize("sd,n,difference", [(0.0012, 3, 0.0), (0.0012, 5, -0.001),
                                             (0.002, 4, 0.0005)])
def test_tost_power_against_a_simulation_of_the_tost(sd, n, difference):
  """The closed-form power against the share of simulated samples that `tost` (SciPy's t
  tails) finds equivalent: 20,000 samples, a standard error of at most 0.0035."""
  rng = np.random.default_rng(n)
  samples = rng.normal(difference, sd, size=(20_000, n))
  passed = np.mean([equivalence.tost(d)["equivalent"] for d in samples])
  assert equivalence.tost_power(sd, n, difference) == pytest.approx(passed, abs=0.015)


def test_tost_power_limits_and_the_three_seed_case():
  # A tiny spread passes whenever the true difference is inside the margin, never outside.
  assert equivalence.tost_power(1e-6, 3, 0.0) == pytest.approx(1.0, abs=1e-6)
  assert equivalence.tost_power(1e-6, 3, 0.003) == pytest.approx(0.0, abs=1e-6)
  # At a true difference of 0 and a spread of 0.12 points, 3 seeds pass about 41 % of the time.
  assert 0.39 < equivalence.tost_power(0.0012, 3) < 0.42
  with pytest.raises(ValueError, match="n >= 2"):
    equivalence.tost_power(0.001, 1)


def _timed(wall, compute, steady, machine, seeds):
  return {"seed_index": {s: i for i, s in enumerate(seeds)}, "wall_seconds": wall,
          "compute_seconds": compute, "steady_seconds": steady, "machine": machine,
          "training_seconds": [c - 1.0 for c in compute], "scoring_seconds": [0.5] * len(wall),
          "selection_seconds": [0.5] * len(wall)}


def test_wall_clock_is_paired_per_seed_on_one_machine_and_whole_runs_only():
  """Seed 3: both whole, even pace: 250 / 500 = 0.5. Seed 4: the arm's wall clock (100 s) is
  below its phase seconds (200 s), a resumed run's last sitting: no wall ratio, the phase
  seconds' 200 / 400 still. Seed 5: another machine: nothing. Seed 6: full data slowed (its
  phase seconds 30 % above its steady seconds): 300 / 1000 = 0.3, uneven."""
  a, b = "cpu A, 2 cores", "cpu B, 2 cores"
  arm = _timed([250, 100, 240, 300], [220, 200, 210, 280], [215, 198, 205, 275],
               [a, a, b, a], (3, 4, 5, 6))
  full = _timed([500, 450, 480, 1000], [470, 400, 450, 960], [465, 398, 445, 740],
                [a, a, a, a], (3, 4, 5, 6))
  pairs = frontier_summary.time_pairs(arm, full)
  assert pairs[5] is None
  assert pairs[3] == {"machine": a, "wall": 0.5, "compute": pytest.approx(220 / 470),
                      "even": True}
  assert pairs[4]["wall"] is None and pairs[4]["compute"] == 0.5
  assert pairs[6]["wall"] == 0.3 and not pairs[6]["even"]
  means = frontier_summary.mean_ratios(pairs)
  assert means["wall_ratio"] == pytest.approx(0.4) and means["wall_seeds"] == [3, 6]
  assert means["even_wall_ratio"] == 0.5 and means["even_seeds"] == [3]
  assert means["compute_ratio"] == pytest.approx((220 / 470 + 0.5) / 2)  # Even pace only.
  assert means["compute_seeds"] == [3, 4]
  times = frontier_summary.run_times(arm)  # Seed 4 left out: its wall clock is one sitting's.
  assert times["whole_seeds"] == [3, 5, 6] and times["wall"] == pytest.approx(790 / 3)
  assert times["rest"] == pytest.approx((30 + 30 + 20) / 3)
  assert times["scoring"] == 1.0 and times["machines"] == [a, b]


def test_evaluation_passes_and_the_share_with_them():
  """20 epochs evaluated every 2nd: 10 evaluations of 6,000 validation and 10,000 test images
  = 160,000 passes, added to both arms' training passes before their ratio."""
  curve = list(range(2, 21, 2))
  def run(passes):
    return {**_result([0.9], passes), "curve_epoch": [curve], "correct": [[1] * 10_000]}
  full, arm = run(3_240_960.0), run(0.4775 * 3_240_960)
  assert frontier_summary.evaluation_passes(full) == 160_000
  share = frontier_summary.costs(arm, full)["passes_share_with_evaluation"]
  assert share == pytest.approx((0.4775 * 3_240_960 + 160_000) / (3_240_960 + 160_000))
  assert frontier_summary.evaluation_passes(_result([0.9], 1.0)) is None  # No curves: not counted.


def test_validation_images_match_the_base_config():
  from cpjax.data import splits
  assert frontier_summary.VAL_IMAGES == splits.carved_val_size(frontier_tiers.base_config().dataset)


def test_kept_schedule_of_each_design_from_its_config():
  """Top-k with the finish at 45 %: (19 x 0.45 - 2) / 17 = 0.3853 kept in epochs 1-17, then 2
  on all data; rising from 20 to 70 %; InfoBatch (anneal 0.125 of 20 epochs: floor(17.5) = 17)
  prunes in epochs 1-16, then 3 on all data; full data selects nothing."""
  base = frontier_tiers.base_config()
  arms = {a.name: a for a in frontier_tiers.search_arms(base)}
  assert frontier_summary.kept_schedule(arms["topk_anneal-45"], base) == {
      "epochs": [1, 17], "kept": [0.3853, 0.3853], "full_after": 2}
  assert frontier_summary.kept_schedule(arms["topk_anneal-30"], base)["kept"][0] == 0.2176
  assert frontier_summary.kept_schedule(arms["topk_rising-45"], base)["kept"] == [0.2, 0.7]
  assert frontier_summary.kept_schedule(arms["topk_entropy-30"], base) == {
      "epochs": [1, 19], "kept": [0.3, 0.3], "full_after": 0}
  assert frontier_summary.kept_schedule(arms["infobatch-r85"], base) == {
      "epochs": [1, 16], "kept": None, "full_after": 3}
  assert frontier_summary.kept_schedule(arms["full"], base) == {}
  # A mean of 30 % kept in epochs 1-16 of 20, 100 passes a full epoch: 4 x 100 + 16 x 30.
  assert frontier_summary.mean_kept({"epochs": [1, 16], "full_after": 3}, 880.0, 2000.0) == (
      pytest.approx(0.3))


def test_two_level_bootstrap_reduces_to_each_level():
  """One seed: the test images' bootstrap alone (Binomial(2000, 0.1) / 2000, as above). Forty
  seeds whose runs differ on every image or on none (the image draw changes nothing): the seed
  bootstrap alone, the mean of 40 draws from 20 ones and 20 zeros: 0.5 +- 1.645 x 0.5 /
  sqrt(40) = [0.37, 0.63]."""
  n, k = 2000, 200
  full = np.zeros(n, np.int8)
  full[k::2] = 1
  arm = full.copy()
  arm[:k] = 1
  one = {name: {"seed_index": {3: 0}, "correct": [c.tolist()]} for name, c in
         (("arm", arm), ("full", full))}
  half = 1.645 * math.sqrt(0.1 * 0.9 / n)
  assert frontier_summary.seed_and_image_interval(one["arm"], one["full"], [3]) == pytest.approx(
      [0.1 - half, 0.1 + half], abs=0.003)
  seeds = list(range(40))
  arms = {"seed_index": {s: s for s in seeds}, "correct": [[1] * 50] * 20 + [[0] * 50] * 20}
  fulls = {"seed_index": {s: s for s in seeds}, "correct": [[0] * 50] * 40}
  low, high = frontier_summary.seed_and_image_interval(arms, fulls, seeds)
  assert (low, high) == pytest.approx((0.5 - 1.645 * 0.5 / math.sqrt(40),
                                       0.5 + 1.645 * 0.5 / math.sqrt(40)), abs=0.03)


def _interval(v: dict) -> str:
  return f"{100 * v['mean']:+.2f} [{100 * v['low']:+.2f}, {100 * v['high']:+.2f}]"


def _bracket(pair) -> str:
  return f"[{100 * pair[0]:+.2f}, {100 * pair[1]:+.2f}]"


def _committed() -> dict:
  with open("studies/results/frontier.json", encoding="utf-8") as f:
    return json.load(f)


def _table_rows(table: str) -> list[str]:
  """The budget table's body rows, each as its line."""
  return [line for line in table.splitlines()
          if line.startswith("| ") and not line.startswith("| passes")]


def _share(row: dict) -> str:
  return (f"{100 * row['passes_share']:.1f} % "
          f"({100 * row['passes_share_with_evaluation']:.1f} %)")


def test_docs_budget_table_is_written_from_the_committed_summary():
  """docs/studies.md holds `budget_table` of studies/results/frontier.json byte for byte, its
  markers included (`python -m studies.frontier --budget-table=studies/results/frontier.json`),
  and that is the page the flag rewrites by default."""
  assert frontier_summary.BUDGET_TABLE_PAGE == "docs/studies.md"
  with open(frontier_summary.BUDGET_TABLE_PAGE, encoding="utf-8") as f:
    page = f.read()
  assert frontier_summary.budget_table(_committed(), frontier_tiers.base_config()) in page


def test_write_budget_table_rewrites_only_between_the_markers(tmp_path):
  """write_budget_table replaces what lies between the markers with the committed summary's
  table and leaves the rest of the page as it was; a page without both markers is refused."""
  table = frontier_summary.budget_table(_committed(), frontier_tiers.base_config())
  page = tmp_path / "page.md"
  page.write_text(f"head\n\n{frontier_summary.TABLE_START}\nstale\n"
                  f"{frontier_summary.TABLE_END}\n\ntail\n", encoding="utf-8")
  frontier_summary.write_budget_table("studies/results/frontier.json", str(page))
  assert page.read_text(encoding="utf-8") == f"head\n\n{table}\n\ntail\n"
  page.write_text("no markers\n", encoding="utf-8")
  with pytest.raises(SystemExit, match="--budget-table: .* needs the budget table's markers"):
    frontier_summary.write_budget_table("studies/results/frontier.json", str(page))


def test_budget_table_states_the_frontier_summary():
  """Every row's numbers as frontier.json has them, in the table's own formats: tier C's design
  with F and the pool, tier G's, tier H's pick (lossless) and tier N's design (not shown
  better; its GPU pairs all shared the card, so no pair ran at an even pace), full data."""
  out = _committed()
  summary, found, g = out["summary"], out["verdicts"], out["verdict_g"]
  h, n = out["tier_h"]["verdict"], out["tier_n"]["verdict"]
  rows = _table_rows(frontier_summary.budget_table(out, frontier_tiers.base_config()))
  assert len(rows) == 5 and rows[4] == "| 100 % | full data |  |  |  |"
  time = summary["topk_anneal-45@confirm"]["time"]
  assert time["even_seeds"] == [3, 4, 5] and time["wall_seeds"] == [3, 4, 5, 7]
  pooled, c = found["pooled"], found["untouched"]
  expected = {0: [_share(summary["topk_anneal-45@confirm"]),
                  "`top_k` entropy, 38.5 % kept in epochs 1-17, then 2 on all data",
                  "--config.selection.fraction=0.3853",  # (19 x 0.45 - 2) / 17 = 0.38529.
                  f"seeds 0-2: {_interval(summary['topk_anneal-45']['vs_full'])}",
                  f"**not lossless, below full data** on all 10 seeds: {_interval(pooled)} "
                  f"(seeds 3-12, TOST p {pooled['p']:.3f}; with the test images "
                  f"{_bracket(pooled['test_images']['seeds_and_images'])})",
                  f"{_interval(c)} (seeds 3-7, TOST p {c['p']:.3f}; with the test images "
                  f"{_bracket(c['test_images']['seeds_and_images'])}), lossless",
                  f"{_interval(found['replicate'])} (seeds 8-12, TOST p "
                  f"{found['replicate']['p']:.3f}), not lossless, below full data",
                  f"{time['even_wall_ratio']:.2f} (mean over seeds 3,4,5",
                  f"{time['wall_ratio']:.2f} over seeds 3,4,5,7", f"`{time['machines'][0]}`"],
              1: [_share(summary[g["arm"]]), "41.0 % kept in epochs 1-17",
                  "--config.selection.fraction=0.41",
                  f"seeds 0-2: {_interval(summary['topk_anneal-p50']['vs_full'])}, TOST p "
                  f"{summary['topk_anneal-p50']['vs_full']['p']:.3f}",
                  f"**not lossless, below full data**: {_interval(g)} (seeds 13-22, TOST p "
                  f"{g['p']:.3f}; with the test images "
                  f"{_bracket(g['test_images']['seeds_and_images'])})",
                  f"{g['seconds']['steady_wall_geomean']:.2f} (geometric mean over seeds "
                  "15,16,17,18,19,20,21,22, both runs whole and at an even pace; "
                  f"{g['seconds']['whole_wall_geomean']:.2f} over the 9 pairs with whole wall "
                  "clocks, each on one kind of machine)"],
              2: [_share(summary["topk_anneal-55"]), "49.7 % kept in epochs 1-17",
                  "--config.selection.fraction=0.4971",  # (19 x 0.55 - 2) / 17 = 0.49706.
                  f"seeds 0-2: {_interval(summary['topk_anneal-55']['vs_full'])}, TOST p "
                  f"{summary['topk_anneal-55']['vs_full']['p']:.3f}",
                  f"| tier H: **lossless**, {_interval(h)} (seeds 23-32, TOST p {h['p']:.3f}; "
                  f"with the test images {_bracket(h['test_images']['seeds_and_images'])}) |",
                  f"{h['seconds']['steady_wall_geomean']:.2f} (geometric mean over seeds "
                  "26,27,28,29,31, both runs whole and at an even pace; "
                  f"{h['seconds']['whole_wall_geomean']:.2f} over the 9 pairs with whole wall "
                  "clocks, each on one kind of machine) on `AMD EPYC, 2 cores, jax 0.10.2 on "
                  "cpu` |"],
              3: [_share(summary["topk_anneal-45"]), "--config.selection.fraction=0.3853",
                  f"tier D's {_interval(found['noisy'])} (seeds 3-7) was exploratory",
                  f"| tier N: **not shown better**, {_interval(n)} (seeds 23-32, one-sided p "
                  f"{n['p']:.3f}; with the test images "
                  f"{_bracket(n['test_images']['seeds_and_images'])}) vs full data on the same "
                  "noisy labels |",
                  "| no pair both whole and at an even pace "
                  f"({n['seconds']['whole_wall_geomean']:.2f} over the 10 pairs with whole wall "
                  "clocks, each on one kind of machine) on `Intel(R) Xeon(R) Processor, 16 "
                  "cores, jax 0.11.2 on gpu, 1 x NVIDIA H100 80GB HBM3` |"]}
  missing = [(i, e) for i, strings in expected.items() for e in strings if e not in rows[i]]
  assert not missing, f"the budget table lacks {missing}"
  assert "dataset.label_noise" not in rows[3]  # The row names the noise; its flags select.


def test_budget_table_fills_in_tiers_h_and_n_from_their_verdicts():
  """Made-up verdicts: tier H complete and lossless, tier N on 5 of its 10 seeds (not decided,
  whatever its interval), then on all 10 and better; each time cell the geometric means."""
  out = json.loads(json.dumps(_committed()))
  seconds = {"per_seed": {str(s): {"machine": "gpu x", "same_machine": True}
                          for s in range(23, 33)}, "same_machine_seeds": 10,
             "whole_seeds": list(range(23, 33)), "steady_seeds": list(range(23, 31)),
             "steady_wall_geomean": 0.6, "whole_wall_geomean": 0.58, "wall_geomean": 0.58}
  h = {"arm": "topk_anneal-55@confirm_h", "seeds": list(range(23, 33)), "complete": True,
       "saving": 0.427, "mean": -0.0004, "low": -0.0012, "high": 0.0004, "p": 0.0012,
       "equivalent": True, "lossless": True, "met": True, "seconds": seconds,
       "test_images": {"seeds_and_images": [-0.002, 0.0011]}}
  n = {"arm": "noisy_topk_anneal-45@confirm_n", "seeds": list(range(23, 28)), "complete": False,
       "saving": 0.52, "mean": 0.004, "low": 0.001, "high": 0.007, "p": 0.01, "superior": True,
       "better": False, "seconds": seconds, "test_images": {"seeds_and_images": [0.0, 0.008]}}
  for name, base_name in ((h["arm"], "topk_anneal-55"), (n["arm"], "topk_anneal-45")):
    out["summary"][name] = {**out["summary"][base_name], "passes_share": 0.5,
                            "passes_share_with_evaluation": 0.52}
  out["tier_h"]["verdict"], out["tier_n"]["verdict"] = h, n
  base = frontier_tiers.base_config()
  rows = _table_rows(frontier_summary.budget_table(out, base))
  time = ("0.60 (geometric mean over seeds 23,24,25,26,27,28,29,30, both runs whole and at an "
          "even pace; 0.58 over the 10 pairs with whole wall clocks, each on one kind of "
          "machine) on `gpu x`")
  assert rows[2].startswith("| 50.0 % (52.0 %) |")
  assert rows[2].endswith("| tier H: **lossless**, -0.04 [-0.12, +0.04] (seeds 23-32, TOST p "
                          f"0.001; with the test images [-0.20, +0.11]) | {time} |")
  assert rows[3].endswith("| tier N: not decided yet, 5 of 10 seeds run (+0.40 [+0.10, +0.70] "
                          f"so far) vs full data on the same noisy labels | {time} |")
  n.update(seeds=list(range(23, 33)), complete=True, better=True)
  rows = _table_rows(frontier_summary.budget_table(out, base))
  assert rows[3].endswith("| tier N: **better**, +0.40 [+0.10, +0.70] (seeds 23-32, one-sided p "
                          "0.010; with the test images [+0.00, +0.80]) vs full data on the same "
                          f"noisy labels | {time} |")


def test_docs_state_the_search_seeds_numbers_beside_the_table():
  """docs/studies.md's sentences beside the budget table on arms run on seeds 0-2 alone, as
  frontier.json has them."""
  out = _committed()
  summary = out["summary"]
  with open("docs/studies.md", encoding="utf-8") as f:
    text = " ".join(f.read().split("## Which selection to use: the budget table")[1]
                    .split("## Which policy for which schedule")[0].split())
  expected = [f"{summary['full']['evaluation_passes']:,.0f} a run"]
  for name in ("topk_entropy-30", "infobatch-r50"):
    row = summary[name]
    expected += [f"{_share(row)} of the passes", f"{_interval(row['vs_full'])} (seeds 0-2)",
                 f"TOST p {row['vs_full']['p']:.3f}",
                 f"{row['time']['wall_ratio']:.2f} of full data's wall clock (seed 2, the one "
                 "pair of whole runs"]
    assert row["time"]["even_seeds"] == row["time"]["wall_seeds"] == [2]
  expected += ["30.0 % kept in epochs 1-19",
               f"≈ {100 * summary['infobatch-r50']['kept']['mean_from_passes']:.1f} % kept on "
               "average in epochs 1-16"]
  missing = [e for e in expected if e not in text]
  assert not missing, f"docs/studies.md's budget table section lacks {missing}"


def test_docs_studies_state_tier_g_as_the_summary_has_it():
  """docs/studies.md's tier-G outcome: the seed interval and TOST, the two-level interval,
  the per-seed extremes, the passes and the wall-clock means, as frontier.json has them."""
  with open("studies/results/frontier.json", encoding="utf-8") as f:
    out = json.load(f)
  with open("docs/studies.md", encoding="utf-8") as f:
    text = " ".join(f.read().split("**Tier G outcome")[1].split())
  g, row = out["verdict_g"], out["summary"]["topk_anneal-p50@confirm_g"]
  per_seed = {int(s): v[0] for s, v in g["test_images"]["per_seed"].items()}
  low, high = min(per_seed, key=per_seed.get), max(per_seed, key=per_seed.get)
  below = sum(v < 0 for v in per_seed.values())
  seconds, pooled = g["seconds"], out["verdicts"]["pooled"]
  expected = [_interval(g), f"TOST p {g['p']:.3f}",
              f"is {_bracket(g['test_images']['seeds_and_images'])}",
              f"from {100 * per_seed[low]:+.2f} (seed {low}) to {100 * per_seed[high]:+.2f} "
              f"(seed {high}), {below} of 10 below 0",
              f"{100 * row['passes_share']:.1f} % of full data's passes "
              f"({100 * row['passes_share_with_evaluation']:.1f} % with",
              f"was {seconds['steady_wall_geomean']:.2f} of full data's",
              f"loop seconds {seconds['steady_loop_geomean']:.2f}",
              f"({seconds['per_seed']['14']['wall']:.2f})",  # JSON's keys are strings.
              f"over all 10 pairs, {seconds['wall_geomean']:.2f}",
              f"{_interval(pooled)} on seeds 3-12"]
  missing = [e for e in expected if e not in text]
  assert not missing, f"docs/studies.md lacks {missing}"


def test_docs_studies_state_the_frontier_summary_and_the_power():
  """docs/studies.md's frontier numbers added beside the seed intervals, as the committed
  summary has them: kept shares, passes with evaluation, the two-level intervals, tier C's
  wall-clock ratios, tier D's reference, and the TOST's power at the stated spread."""
  with open("studies/results/frontier.json", encoding="utf-8") as f:
    out = json.load(f)
  with open("docs/studies.md", encoding="utf-8") as f:
    text = " ".join(f.read().split("## How much compute can be skipped")[1].split())
  summary, found = out["summary"], out["verdicts"]
  expected = []
  for budget in frontier_tiers.BUDGETS:
    row = summary[f"topk_anneal-{budget}"]
    expected += [f"{100 * row['kept']['kept'][0]:.1f} % in epochs 1-17, then 2 on all data",
                 f"{100 * row['passes_share']:.1f} % "
                 f"({100 * row['passes_share_with_evaluation']:.1f} %)"]
  for ratio in (85, 95, 70, 50):
    row = summary[f"infobatch-r{ratio}"]
    expected.append(f"≈ {100 * row['kept']['mean_from_passes']:.1f} % (mean) in epochs 1-16")
  expected += [f"the interval is {_bracket(found['untouched']['test_images']['seeds_and_images'])}",
               f"interval is {_bracket(found['pooled']['test_images']['seeds_and_images'])}",
               f"saving is {100 * found['untouched']['saving_with_evaluation']:.1f} %"]
  time = summary["topk_anneal-45@confirm"]["time"]
  ratios = [time["pairs"][str(s)]["wall"] for s in time["even_seeds"]]
  expected += [f"took {time['even_wall_ratio']:.2f} of",
               "(" + ", ".join(f"{r:.3f}" for r in ratios[:-1]) + f" and {ratios[-1]:.3f};",
               f"the mean is {time['wall_ratio']:.2f}"]
  noisy, earlier = found["noisy"], found["noisy"]["earlier_reference"]["accuracy"]
  expected.append(f"{100 * (earlier - noisy['reference_accuracy']):.2f} points below the "
                  f"long-schedule study's noisy full-data runs ({100 * earlier:.2f} %")
  expected += [f"pass that test only {100 * equivalence.tost_power(0.0012, 3):.0f} % of the time",
               f"5 seeds {100 * equivalence.tost_power(0.0012, 5):.0f} % of the time"]
  missing = [e for e in expected if e not in text]
  assert not missing, f"docs/studies.md lacks {missing}"


# Tiers A' (A2 in code) and G, declared before their runs.


def test_tier_a2_arms_are_valid_configs_at_no_more_than_half_the_passes():
  """Passes by hand (20 epochs, epoch 0 on all 54,000 rows in 422 steps of 128; full data
  20 x 422 steps). Top-k with the finish at 41 % kept: 3 full epochs and 17 of
  ceil(22,140 / 128) = 173 steps, (3 x 422 + 17 x 173) / 8,440 = 49.85 %; at 41.01 % kept
  (22,145 rows, 174 steps) it would be 50.05 %. Importance at 46.73 % (k = 25,234 in
  expectation): its 19 selected epochs' total size has sd at most sqrt(19 k (1 - k/N)) =
  505.4, so each epoch bounded at ceil(k + 4 x 505.4 / 19) + 127 = 25,468 rows, 199 steps:
  (422 + 19 x 199) / 8,440 = 49.80 %; at 46.74 % the bound is 200 steps, 50.02 %."""
  base = frontier_tiers.base_config()
  arms = frontier_tiers.a2_arms()
  assert [a.name for a in arms] == ["importance-m50", "importance-m20", "topk_anneal-p50",
                                    "infobatch_norescale-r95"]
  assert all(a.tier == "A2" and a.seeds == (0, 1, 2) for a in arms)
  assert (frontier_tiers.TOPK_P50_FRACTION == frontier_tiers.anneal_fraction_at_most(0.5, base)
          == 0.41)
  assert (frontier_tiers.IMPORTANCE_FRACTION
          == frontier_tiers.importance_fraction_at_most(0.5, base) == 0.4673)
  share = frontier_tiers.planned_share
  topk = [a for a in arms if a.policy == "topk_anneal"][0]
  config = grid.apply(base, topk.overrides)
  assert share(config, base, frontier_tiers.anneal_sizes(0.41, base)) == pytest.approx(
      (3 * 422 + 17 * 173) / 8440, abs=1e-12)
  assert share(config, base, frontier_tiers.anneal_sizes(0.4101, base)) > 0.5
  importance = grid.apply(base, arms[0].overrides)
  assert share(importance, base, frontier_tiers.importance_sizes(0.4673, base)) == pytest.approx(
      (422 + 19 * 199) / 8440, abs=1e-12)
  assert share(importance, base, frontier_tiers.importance_sizes(0.4674, base)) == pytest.approx(
      (422 + 19 * 200) / 8440, abs=1e-12)
  for arm in arms + frontier_tiers.g_arms(arms[1]):
    validation.validate(grid.apply(base, frontier_tiers.run_overrides(arm, 13)))
  assert arms[3].overrides["selection.infobatch_rescale"] is False
  assert {arms[0].overrides["selection.mix"], arms[1].overrides["selection.mix"]} == {0.5, 0.2}


def test_importance_arms_stay_under_half_the_passes_in_simulated_runs():
  """2,000 simulated runs of the importance arm, each selected epoch's size drawn as
  Binomial(N, k/N) (equal inclusion probabilities: the largest variance a sum of
  independent Bernoulli(pi_i) with sum pi_i = k can have), their passes counted by the
  study's own `example_passes`: none exceeds half of full data's, and their mean is the
  expectation, (422 + 19 E[ceil(|S| / 128)]) / 8,440, about 49.5 %."""
  base = frontier_tiers.base_config()
  config = grid.apply(base, frontier_tiers.a2_arms()[0].overrides)
  k = round(frontier_tiers.IMPORTANCE_FRACTION * 54000)
  rng = np.random.default_rng(0)
  shares = []
  for _ in range(2000):
    sizes = [54000] + rng.binomial(54000, k / 54000, 19).tolist()
    records = [{"epoch": e, "selected_k": s} for e, s in enumerate(sizes)]
    shares.append(long_schedule.example_passes(config, records)[-1] / (3 * 128 * 20 * 422))
  assert max(shares) <= 0.5
  assert np.mean(shares) == pytest.approx((422 + 19 * (k / 128 + 0.5)) / 8440, abs=5e-4)


def test_tiers_parse_with_a_digit_and_name_an_unknown_one():
  assert frontier_tiers.parse_tiers("ACFDBE") == ["A", "C", "F", "D", "B", "E"]
  assert frontier_tiers.parse_tiers("A2G") == ["A2", "G"]
  assert frontier_tiers.parse_tiers("".join(frontier_tiers.TIERS)) == list(frontier_tiers.TIERS)
  with pytest.raises(SystemExit, match=r"unknown tier 'A3' in 'A3'; valid tiers: A, C, F, D, "
                                       r"B, E, A2, G, H, N \(A2 is tier A'\)"):
    frontier_tiers.parse_tiers("A3")
  with pytest.raises(SystemExit, match="unknown tier 'a'"):
    frontier_tiers.parse_tiers("a")


def _with_machine(result, wall, loop, machine="cpu x"):
  n = len(result["accuracy"])
  return {**result, "wall_seconds": [wall] * n, "compute_seconds": [loop] * n,
          "steady_seconds": [loop] * n, "machine": [machine] * n}


def test_tier_a2_choice_and_the_tier_g_verdict_by_hand():
  """Tier A' chooses by validation accuracy among its arms at half the passes or fewer (not
  among tier A's); tier G pairs the choice with full data on seeds 13-22: the TOST on 10
  differences (SciPy's one-sided t-tests), and per seed the seconds ratios, the geometric
  mean over the pairs run on one machine."""
  full = Arm("full", "full", {}, "A")
  a2 = frontier_tiers.a2_arms()
  arms = [full, Arm("t-45", "t", {}, "A", 45), *a2]
  results = {"full": _result([0.92] * 3, 100.0), "t-45": _result([0.90] * 3, 48.0, [0.99] * 3),
             "importance-m50": _result([0.92] * 3, 49.5, val=[0.929] * 3),
             "importance-m20": _result([0.92] * 3, 49.5, val=[0.931] * 3),  # Chosen,
             "topk_anneal-p50": _result([0.92] * 3, 49.8, val=[0.930] * 3),
             "infobatch_norescale-r95": _result([0.92] * 3, 50.5, val=[0.95] * 3)}  # not: >50 %.
  assert frontier_summary.choose(arms, results).name == "t-45"  # Tier A's choice is its own.
  chosen = frontier_summary.choose(arms, results, "A2")
  assert chosen.name == "importance-m20" and chosen.overrides["selection.mix"] == 0.2
  g = frontier_tiers.g_arms(chosen)
  assert [a.name for a in g] == ["full@confirm_g", "importance-m20@confirm_g"]
  assert all(a.seeds == tuple(range(13, 23)) and a.tier == "G" for a in g)
  d = [0.0004, -0.0006, 0.0002, -0.0003, 0.0001, 0.0005, -0.0002, 0.0, -0.0004, 0.0003]
  base_acc = 0.92 + 0.001 * np.arange(10) / 10
  results["full@confirm_g"] = _with_machine(_result(base_acc, 100.0, seeds=range(13, 23)),
                                            1000.0, 800.0)
  arm = _with_machine(_result(base_acc + d, 49.5, seeds=range(13, 23)), 600.0, 400.0)
  arm["machine"][9] = "gpu y"  # Seed 22's pair ran on two machines: out of the mean.
  arm["wall_seconds"][0] = 250.0  # Seed 13: wall ratio 0.25, below its loop's 400: resumed.
  results["full@confirm_g"]["steady_seconds"][8] = 700.0  # Seed 21's full: 800 > 1.05 x 700.
  results["importance-m20@confirm_g"] = arm
  summary = frontier_summary.summarise(arms + g, results)
  found = frontier_summary.g_verdict(summary, chosen, results)
  lower = stats.ttest_1samp(np.array(d) + equivalence.MARGIN, 0.0, alternative="greater").pvalue
  upper = stats.ttest_1samp(np.array(d) - equivalence.MARGIN, 0.0, alternative="less").pvalue
  assert found["p"] == pytest.approx(max(lower, upper), rel=1e-9)
  assert found["complete"] and found["lossless"] and found["met"]
  assert found["saving"] == pytest.approx(0.505) and found["seeds"] == list(range(13, 23))
  seconds = found["seconds"]
  assert seconds["per_seed"][13] == {"wall": 0.25, "loop": 0.5, "machine": "cpu x",
                                     "full_machine": "cpu x", "same_machine": True,
                                     "whole": False, "even": True}
  assert seconds["per_seed"][21]["whole"] and not seconds["per_seed"][21]["even"]
  # Whole, even and on one machine: seeds 14-20, each 600/1000 and 400/800.
  assert seconds["steady_seeds"] == list(range(14, 21))
  assert seconds["steady_wall_geomean"] == pytest.approx(0.6, rel=1e-12)
  assert seconds["steady_loop_geomean"] == pytest.approx(0.5, rel=1e-12)
  assert not seconds["per_seed"][22]["same_machine"] and seconds["same_machine_seeds"] == 9
  # Nine pairs: one at 0.25, eight at 0.6: (0.25 x 0.6^8)^(1/9).
  assert seconds["wall_geomean"] == pytest.approx((0.25 * 0.6 ** 8) ** (1 / 9), rel=1e-12)
  assert seconds["loop_geomean"] == pytest.approx(0.5, rel=1e-12)
  # Whole wall clocks on one machine: seeds 14-21 (seed 13 resumed), all at 0.6.
  assert seconds["whole_seeds"] == list(range(14, 22))
  assert seconds["whole_wall_geomean"] == pytest.approx(0.6, rel=1e-12)
  second = frontier_summary.second_search(summary, arms + g, results)
  assert second["chosen_a2"] == "importance-m20"
  text = frontier_summary.markdown(summary, None, "cmd", {}, results, second)
  assert "Chosen: `importance-m20`" in text
  assert "**Lossless at half the passes or fewer: met.**" in text
  assert "seed 22: 0.60 (0.50) [gpu y vs cpu x]" in text
  assert "seed 13: 0.25 (0.50) (resumed);" in text and "seed 21: 0.60 (0.50) (uneven);" in text
  assert "0.60 (0.50) over the 7 of them with whole wall clocks at an even pace" in text
  # Seeds 13-17 only: not complete, so not met, whatever the differences.
  for name in ("full@confirm_g", "importance-m20@confirm_g"):
    results[name]["seed_index"] = {s: i for s, i in results[name]["seed_index"].items() if s < 18}
  partial = frontier_summary.g_verdict(frontier_summary.summarise(arms + g, results), chosen,
                                       results)
  assert not partial["complete"] and not partial["met"]


def test_the_summary_has_no_tier_a2_section_before_its_runs():
  """Without a tier-A' record the summary is the earlier tiers' alone (the committed one
  regenerates byte for byte); with one, its section says that tier G has not run."""
  arms = [Arm("full", "full", {}, "A"), *frontier_tiers.a2_arms()]
  results = {"full": _result([0.92] * 3, 100.0)}
  summary = frontier_summary.summarise(arms, results)
  assert frontier_summary.second_search(summary, arms, results) == {}
  assert "Tier A'" not in frontier_summary.markdown(summary, None, "cmd", {}, results, {})
  results["topk_anneal-p50"] = _result([0.921] * 2, 49.8)  # Two seeds so far.
  summary = frontier_summary.summarise(arms, results)
  second = frontier_summary.second_search(summary, arms, results)
  assert second == {"chosen_a2": None, "verdict_g": {}}
  text = frontier_summary.markdown(summary, None, "cmd", {}, results, second)
  assert "Not chosen yet: tier A' has not finished." in text
  assert "Not answered yet: tier G has not run." in text.split("## Tier H")[0]


def test_tiers_a2_and_g_run_from_their_records_alone(tmp_path, monkeypatch):
  """`--tiers A2G --summarise-only` with generated records for tier A' (seeds 0-2) and tier
  G (seeds 13-22): full data's seeds 0-2 come from the long-schedule study's records, the
  choice is made, tier G's arms are the choice's, and the summary, its JSON and the figure
  carry both tiers; nothing trains."""
  def no_training(*args):
    raise AssertionError(f"trained {args[1:]}")
  monkeypatch.setattr(frontier.grid.train, "train_and_evaluate", no_training)
  records = tmp_path / "records"
  rng = np.random.default_rng(0)
  full_passes = 20 * 422 * 3 * 128
  def save(name, seeds, val, accuracy, share):
    for seed in seeds:
      correct = (rng.random(10000) < accuracy).astype(np.int8)
      long_schedule.save_record(long_schedule.record_path(str(records), name, seed), {
          "accuracy": float(correct.mean()), "val_accuracy": val, "ece": 0.01,
          "passes": share * full_passes, "wall_seconds": 1000.0 * share,
          "compute_seconds": 900.0 * share, "machine": "test cpu",
          "correct": correct.tolist(), "confidence": [0.9] * 10000})
  for name, val in (("importance-m50", 0.928), ("importance-m20", 0.931),
                    ("topk_anneal-p50", 0.929), ("infobatch_norescale-r95", 0.80)):
    save(name, (0, 1, 2), val, 0.92, 0.495)
  save("full@confirm_g", frontier_tiers.G_SEEDS, 0.93, 0.92, 1.0)
  save("importance-m20@confirm_g", frontier_tiers.G_SEEDS, 0.93, 0.92, 0.495)
  monkeypatch.setattr("sys.argv", ["frontier", f"--out={tmp_path}", "--summarise-only",
                                   f"--records={records}", "--tiers=A2G"])
  frontier.main()
  with open(tmp_path / "summary.json") as f:
    out = json.load(f)
  assert out["chosen_a2"] == "importance-m20" and out["chosen"] is None
  g = out["verdict_g"]
  assert g["arm"] == "importance-m20@confirm_g" and g["seeds"] == list(frontier_tiers.G_SEEDS)
  assert g["complete"] and g["saving"] == pytest.approx(0.505)
  assert g["seconds"]["wall_geomean"] == pytest.approx(0.495)
  assert g["test_images"]["pooled"][0] < g["mean"] < g["test_images"]["pooled"][1]
  assert set(out["summary"]) == {"full", "importance-m50", "importance-m20", "topk_anneal-p50",
                                 "infobatch_norescale-r95", "full@confirm_g",
                                 "importance-m20@confirm_g"}
  text = (tmp_path / "summary.md").read_text()
  assert "## Tier A': importance sampling" in text and "## Tier G:" in text
  assert (tmp_path / "frontier.png").stat().st_size > 0


# Tiers H and N, declared before their runs.


def test_superiority_by_hand_and_against_scipys_one_sided_test():
  """d = (+0.1, +0.2, +0.3) points: mean 0.2, sd 0.1, se 0.1 / sqrt(3), t = sqrt(12); with 2
  degrees of freedom sf(t) = (1 - t / sqrt(t^2 + 2)) / 2 = 0.0371 < 0.05: better, and the 90 %
  interval's lower end 0.2 - 2.919986 x 0.1 / sqrt(3) = 0.0314 points is above 0."""
  result = equivalence.superiority([0.001, 0.002, 0.003])
  t = math.sqrt(12)
  assert result["p"] == pytest.approx((1 - t / math.sqrt(t * t + 2)) / 2, rel=1e-9)
  assert result["superior"] and result["low"] == pytest.approx(
      0.002 - 2.919986 * 0.001 / math.sqrt(3), rel=1e-6)
  # Mean +0.2 points but spread: the interval reaches below 0, not better.
  spread = [0.001, -0.002, 0.007]
  result = equivalence.superiority(spread)
  assert not result["superior"] and result["low"] < 0 < result["mean"]
  assert result["p"] == pytest.approx(
      stats.ttest_1samp(spread, 0.0, alternative="greater").pvalue, rel=1e-9)
  rng = np.random.default_rng(0)
  for _ in range(20):  # p < 0.05 exactly when the lower end is above 0.
    d = rng.normal(0.001, 0.002, size=int(rng.integers(3, 12)))
    result = equivalence.superiority(d)
    assert result["p"] == pytest.approx(
        stats.ttest_1samp(d, 0.0, alternative="greater").pvalue, rel=1e-9)
    assert result["superior"] == (result["low"] > 0) == (result["p"] < 0.05)
  assert equivalence.superiority([0.001] * 4)["superior"]  # No spread: the sign decides.
  assert not equivalence.superiority([0.0] * 4)["superior"]
  assert not equivalence.superiority([0.01])["superior"]  # One seed: untested.


def _row(tier, share, mean, p, seeds=(0, 1, 2)):
  """A hand-made summary row: its tier, share of passes and paired test on `seeds`."""
  return {"tier": tier, "passes_share": share, "seeds": list(seeds), "planned_seeds": 3,
          "vs_full": {"mean": mean, "low": mean - 0.002, "high": mean + 0.002, "p": p,
                      "seeds": list(seeds)}}


def test_tier_h_rule_by_hand():
  """Among the search tiers' arms at 50-70 % of the passes with a mean of at least -0.1
  points, the smallest TOST p; a tie goes to the smaller share, then to the name."""
  summary = {"a": _row("A", 0.49, 0.0, 0.001),  # Under 50 % of the passes: out.
             "b": _row("B", 0.55, -0.0012, 0.002),  # Mean -0.12 points: out.
             "c": _row("B", 0.60, -0.0005, 0.08),
             "d": _row("A2", 0.65, 0.0002, 0.05),  # The smallest p left: chosen.
             "e": _row("C", 0.60, 0.0, 0.0001, seeds=(3, 4, 5)),  # Not a search tier: out.
             "f": _row("B", 0.56, 0.0, 0.0001, seeds=(0, 1)),  # Seeds 0-1 only: out.
             "g": _row("B", 0.71, 0.0, 0.0001)}  # Over 70 %: out.
  assert [c["arm"] for c in frontier_summary.h_candidates(summary)] == ["b", "c", "d"]
  assert [c["kept"] for c in frontier_summary.h_candidates(summary)] == [False, True, True]
  assert frontier_summary.choose_h(summary) == "d"
  summary["h"] = _row("B", 0.70, -0.001, 0.05)  # The same p, more passes: not chosen,
  summary["i"] = _row("A", 0.50, -0.0009, 0.05)  # the same p, fewer passes: chosen.
  assert frontier_summary.choose_h(summary) == "i"
  summary["0"] = _row("B", 0.50, 0.0, 0.05)  # The same p and share: the first name.
  assert frontier_summary.choose_h(summary) == "0"
  assert frontier_summary.choose_h({"c": _row("B", 0.6, -0.002, 0.9)}) is None


def test_tier_h_rule_on_the_committed_records_picks_the_declared_arm():
  """The rule, recomputed from the committed runs with SciPy's one-sided t-tests (a second
  implementation of the TOST): the arms of tiers A, A' and B at 50-70 % of full data's passes
  are InfoBatch at r = 0.7 (mean below -0.1) and r = 0.5 and top-k with the finish at the 55 %
  budget; the smallest TOST p among the two left is top-k's, the declared H_CHOICE."""
  out = _committed()
  runs, summary = out["runs"], out["summary"]
  full = runs["full"]
  p_values = {}
  for name, row in summary.items():
    if row["tier"] not in ("A", "A2", "B") or name == "full":
      continue
    r = runs[name]
    share = np.mean(r["passes"]) / np.mean(full["passes"])
    if not 0.5 <= share <= 0.7:
      continue
    seeds = sorted(set(r["seed_index"]) & set(full["seed_index"]))
    d = np.array([r["accuracy"][r["seed_index"][s]] - full["accuracy"][full["seed_index"][s]]
                  for s in seeds])
    assert seeds == ["0", "1", "2"]  # JSON's keys are strings.
    if d.mean() >= -0.001:
      p_values[name] = max(
          stats.ttest_1samp(d + 0.002, 0.0, alternative="greater").pvalue,
          stats.ttest_1samp(d - 0.002, 0.0, alternative="less").pvalue)
  assert sorted(p_values) == ["infobatch-r50", "topk_anneal-55"]
  assert min(p_values, key=p_values.get) == frontier_tiers.H_CHOICE == "topk_anneal-55"
  assert (frontier_summary.choose_h(summary) == out["tier_h"]["rule_choice"]
          == frontier_tiers.H_CHOICE)
  assert [c["arm"] for c in out["tier_h"]["candidates"]] == [
      "infobatch-r70", "topk_anneal-55", "infobatch-r50"]
  assert out["tier_h"]["verdict"]["arm"] == f"{frontier_tiers.H_CHOICE}@confirm_h"


def _paired(name, reference, seeds, differences, passes=(50.0, 100.0)):
  """Results of an arm and its reference on `seeds`, the arm `differences` above it."""
  full = 0.90 + 0.001 * np.arange(len(seeds))
  return {reference: _with_machine(_result(full, passes[1], seeds=seeds), 1000.0, 800.0),
          name: _with_machine(_result(full + np.asarray(differences), passes[0], seeds=seeds),
                              600.0, 400.0)}


def test_tier_h_and_tier_n_verdicts_by_hand(tmp_path):
  """Tier H: lossless on all 10 seeds, at whatever saving; tier N: better when the one-sided
  test passes on all 10 seeds (SciPy's one-sided t-test); each undecided on 5 of them, and
  the summary's headline, sections and figure say so."""
  base = frontier_tiers.base_config()
  arms = frontier_tiers.h_arms(base) + frontier_tiers.n_arms(base)
  seeds = frontier_tiers.H_SEEDS
  d_h = [0.0004, -0.0006, 0.0002, -0.0003, 0.0001, 0.0005, -0.0002, 0.0, -0.0004, 0.0003]
  d_n = [0.008, 0.004, 0.010, 0.006, 0.007, 0.003, 0.009, 0.005, 0.008, 0.006]
  results = {**_paired("topk_anneal-55@confirm_h", "full@confirm_h", seeds, d_h, (57.3, 100.0)),
             **_paired("noisy_topk_anneal-45@confirm_n", "noisy_full@confirm_n", seeds, d_n)}
  summary = frontier_summary.summarise(arms, results)
  h = frontier_summary.h_verdict(summary, results)
  assert h["complete"] and h["lossless"] and h["met"]
  assert h["saving"] == pytest.approx(0.427) and h["seeds"] == list(seeds)
  n = frontier_summary.n_verdict(summary, results)
  assert n["p"] == pytest.approx(stats.ttest_1samp(d_n, 0.0, alternative="greater").pvalue,
                                 rel=1e-9)
  assert n["superior"] and n["better"] and n["low"] > 0 and n["saving"] == pytest.approx(0.5)
  assert n["seconds"]["wall_geomean"] == pytest.approx(0.6)
  text = frontier_summary.markdown(summary, None, "cmd", {}, results)
  assert "**Lossless on seeds 23-32: met, 43 % fewer passes.**" in text
  assert "**Better than full data under label noise: better.**" in text
  assert ("- The largest lossless saving (tier H, `topk_anneal-55`): **lossless at 43 % fewer "
          "passes**") in text
  assert "- Selection under 20 % label noise (tier N, `topk_anneal-45`): **better**" in text
  figure = frontier_summary.draw_frontier(arms, results, summary, {"h": h, "n": n})
  notes = "\n".join(t.get_text() for t in figure.texts)
  plt.close(figure)
  assert "noisy_topk_anneal-45@confirm_n (seeds 23,24,25,26,27,28,29,30,31,32): " in notes
  assert notes.endswith("vs full, better") and "@confirm_h" in notes and "lossless\n" in notes
  for name in results:  # Seeds 23-27 only: neither is decided, whatever the differences.
    results[name]["seed_index"] = {s: i for s, i in results[name]["seed_index"].items()
                                   if s < 28}
  summary = frontier_summary.summarise(arms, results)
  h, n = frontier_summary.h_verdict(summary, results), frontier_summary.n_verdict(summary, results)
  assert h["lossless"] and not h["met"] and n["superior"] and not n["better"]
  text = frontier_summary.markdown(summary, None, "cmd", {}, results)
  assert "**Lossless on seeds 23-32: not decided yet (5 of 10 seeds).**" in text
  assert "under label noise: not decided yet (5 of 10 seeds).**" in text
  empty = frontier_summary.markdown({}, None, "cmd", {})
  assert "**Lossless on seeds 23-32: not run yet.**" in empty
  assert "**Better than full data under label noise: not run yet.**" in empty


def test_declared_tiers_before_any_seed_has_both_runs():
  """A parallel worker's summary while the selection arm has seed 24 alone and full data seeds
  23 and 25 (no seed with both runs): the verdicts hold no pair and no test-image interval,
  and the summary says undecided (it used to stop on an empty bootstrap)."""
  base = frontier_tiers.base_config()
  arms = frontier_tiers.h_arms(base) + frontier_tiers.n_arms(base)
  results = _paired("noisy_topk_anneal-45@confirm_n", "noisy_full@confirm_n", (23, 24, 25),
                    [0.004, 0.002, 0.003])
  arm, full = results["noisy_topk_anneal-45@confirm_n"], results["noisy_full@confirm_n"]
  for r in (arm, full):  # Per-test-image records, as the runs' records hold them.
    r["correct"] = [[1, 0, 1, 1]] * 3
    r["confidence"] = [[0.9, 0.6, 0.8, 0.7]] * 3
  arm["seed_index"] = {24: arm["seed_index"][24]}
  full["seed_index"] = {s: i for s, i in full["seed_index"].items() if s != 24}
  summary = frontier_summary.summarise(arms, results)
  n = frontier_summary.n_verdict(summary, results)  # No warning either: pytest makes them errors.
  text = frontier_summary.markdown(summary, None, "cmd", {}, results)
  assert n["seeds"] == [] and n["test_images"] == {} and not n["better"]
  assert "under label noise: not decided yet (0 of 10 seeds).**" in text


def test_dry_run_plans_tiers_h_and_n_and_trains_nothing(tmp_path, monkeypatch, capsys):
  """`--tiers HN --dry-run`: 20 runs each, full data and the design on each of seeds 23-32,
  seed by seed; tier H's design is top-k at (19 x 0.55 - 2) / 17 = 0.4971 kept with the last
  2 epochs on all data, tier N's at (19 x 0.45 - 2) / 17 = 0.3853 with 20 % label noise
  drawn from the run's own seed. Nothing trains and no summary is written."""
  def no_training(*args):
    raise AssertionError(f"trained {args[1:]}")
  monkeypatch.setattr(frontier.grid.train, "train_and_evaluate", no_training)
  out = tmp_path / "out"
  monkeypatch.setattr("sys.argv", ["frontier", f"--out={out}", "--tiers=HN", "--dry-run",
                                   f"--records={tmp_path / 'records'}"])
  frontier.main()
  lines = capsys.readouterr().out.splitlines()
  assert not out.exists()
  assert lines[0] == "tier H: 20 runs" and lines[21] == "tier N: 20 runs" and len(lines) == 42
  anneal = "selection.method=top_k selection.fraction={} selection.final_full_epochs=2"
  for tier, first, arm, noise in (("H", 1, "topk_anneal-55@confirm_h", ""),
                                  ("N", 22, "noisy_topk_anneal-45@confirm_n",
                                   "dataset.label_noise=0.2 ")):
    full = "full@confirm_h" if tier == "H" else "noisy_full@confirm_n"
    design = anneal.format("0.4971" if tier == "H" else "0.3853")
    expected = []
    for i, seed in enumerate(range(23, 33)):
      drawn = f" dataset.label_noise_seed={seed}" if noise else ""
      expected += [f"  {2 * i + 1}/20 {full} seed {seed} (to train): {noise}seed={seed}{drawn}",
                   f"  {2 * i + 2}/20 {arm} seed {seed} (to train): {design} {noise}"
                   f"seed={seed}{drawn}"]
    assert lines[first:first + 20] == expected
  base = frontier_tiers.base_config()
  for arm in frontier_tiers.h_arms(base) + frontier_tiers.n_arms(base):
    validation.validate(grid.apply(base, frontier_tiers.run_overrides(arm, 23)))


def test_seeds_option_trains_only_those_seeds_and_names_a_bad_one(tmp_path, monkeypatch,
                                                                  capsys):
  """`--tiers N --seeds=24,31 --arms=...`: the one arm at seeds 24 and 31 is all that trains,
  in that order, with its own seed's noise draw; a seed outside tier N's 23-32, or not a
  number, stops the study before anything trains, naming it and the tier's seeds."""
  trained = []

  def no_training(config, workdir):
    trained.append((os.path.basename(os.path.dirname(workdir)), config.seed,
                    config.dataset.label_noise_seed, config.dataset.data_dir))
    raise RuntimeError("stop here")  # A failed run is reported; the study goes on.
  monkeypatch.setattr(frontier.grid.train, "train_and_evaluate", no_training)
  arm = "noisy_topk_anneal-45@confirm_n"
  monkeypatch.setattr("sys.argv", ["frontier", f"--out={tmp_path / 'out'}", "--tiers=N",
                                   "--seeds=31,24", f"--arms={arm}", "--data-dir=/elsewhere",
                                   f"--records={tmp_path / 'records'}"])
  frontier.main()
  assert trained == [(arm, 24, 24, "/elsewhere"), (arm, 31, 31, "/elsewhere")]
  for bad in ("3", "x", "23,40"):
    monkeypatch.setattr("sys.argv", ["frontier", f"--out={tmp_path / 'out'}", "--tiers=N",
                                     f"--seeds={bad}", f"--records={tmp_path / 'records'}"])
    with pytest.raises(SystemExit) as stop:
      frontier.main()
    assert str(stop.value) == (f"--seeds: {bad.split(',')[-1]!r} is not a seed of the tiers "
                               "chosen; their seeds: " + ", ".join(map(str, range(23, 33))))
  assert len(trained) == 2


def test_docs_studies_state_tier_hs_candidates_as_the_summary_has_them():
  """docs/studies.md's table of tier H's candidates: each arm's passes, interval and TOST p,
  as frontier.json has them, and the pick."""
  out = _committed()
  with open("docs/studies.md", encoding="utf-8") as f:
    text = f.read().split("**Tier H: the largest lossless saving")[1]
  for c in out["tier_h"]["candidates"]:
    row = (f"| `{c['arm']}` | {100 * c['passes_share']:.1f} | {_interval(c)} | {c['p']:.3f} |")
    assert row in text, row
  assert f"The rule picks `{out['tier_h']['rule_choice']}`" in text


def test_workers_script_alternates_each_seeds_order_and_prepares_once(tmp_path):
  """studies/frontier_workers.sh with a stand-in Python that logs its calls: the data is
  prepared once before any worker; worker 0 (seeds 23, 28) runs seed 23 in the tier's order
  and seed 28 with the selection arm first; worker 1 (seed 24) with the selection arm first;
  every call carries FRONTIER_ARGS, the worker's seed, the records and its own out folder, and
  each worker's device memory share is 0.8 / 2 workers."""
  log = tmp_path / "calls.txt"
  fake = tmp_path / "python"
  fake.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -c ]; then exec python3 "$@"; fi\n'
                  f'echo "$XLA_PYTHON_CLIENT_MEM_FRACTION $*" >> {log}\n')
  fake.chmod(0o755)
  out, records, arm = tmp_path / "out", tmp_path / "records", "noisy_topk_anneal-45@confirm_n"
  done = subprocess.run(
      ["bash", "studies/frontier_workers.sh", "N", arm, str(records), str(out), "23,28", "24"],
      env={**{k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"},
           "PYTHON": str(fake), "FRONTIER_ARGS": "--data-dir=/d --manual-dir=/m"},
      capture_output=True, text=True, timeout=60, check=False)
  assert done.returncode == 0, done.stderr
  calls = log.read_text().splitlines()
  assert calls[0] == "0.4 -m studies.frontier --prepare-data --data-dir=/d --manual-dir=/m"

  def call(worker, seed, *rest):
    return (f"0.4 -m studies.frontier --tiers=N --seeds={seed} --records={records} "
            f"--out={out}/worker{worker} --data-dir=/d --manual-dir=/m" + "".join(
                f" {r}" for r in rest))
  worker0 = [c for c in calls if f"{out}/worker0" in c]
  worker1 = [c for c in calls if f"{out}/worker1" in c]
  assert worker0 == [call(0, 23), call(0, 28, f"--arms={arm}"), call(0, 28)]
  assert worker1 == [call(1, 24, f"--arms={arm}"), call(1, 24)]
  assert len(calls) == 6 and sorted(p.name for p in out.iterdir()) == [
      "worker0.log", "worker1.log"]


def _tier_records(arm: str, reference: str) -> tuple[np.ndarray, np.ndarray]:
  """Test accuracy of `arm` and `reference` on seeds 23-32, read straight from the committed
  record files (the mean of each run's per-image correctness, not its stored accuracy)."""
  def accuracy(name, seed):
    with np.load(f"{frontier_tiers.RECORDS}/{name}/seed{seed}.npz") as f:
      return np.unpackbits(f["correct"])[:int(f["num_test"])].mean()
  seeds = range(23, 33)
  return (np.array([accuracy(arm, s) for s in seeds]),
          np.array([accuracy(reference, s) for s in seeds]))


def test_tier_h_and_n_verdicts_recomputed_from_the_committed_records():
  """Tiers H and N from their 40 record files with SciPy alone: per-image correctness averaged
  per run, paired per seed; tier H's TOST at ±0.2 points as two one-sided t-tests and its
  90 % t interval; tier N's one-sided t-test of mean <= 0. The committed summary states the
  same numbers and the declared verdicts that follow from them."""
  out = _committed()
  arm, full = _tier_records("topk_anneal-55@confirm_h", "full@confirm_h")
  d = arm - full
  p_tost = max(stats.ttest_1samp(d, -0.002, alternative="greater").pvalue,
               stats.ttest_1samp(d, 0.002, alternative="less").pvalue)
  low, high = stats.t.interval(0.9, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
  h = out["tier_h"]["verdict"]
  assert h["seeds"] == list(range(23, 33))
  assert (h["mean"], h["low"], h["high"], h["p"]) == pytest.approx(
      (d.mean(), low, high, p_tost), abs=1e-9)
  assert p_tost < 0.05 and -0.002 < low and high < 0.002 and d.mean() >= -0.001
  assert h["lossless"] and h["met"]
  arm, full = _tier_records("noisy_topk_anneal-45@confirm_n", "noisy_full@confirm_n")
  d = arm - full
  p_one_sided = stats.ttest_1samp(d, 0.0, alternative="greater").pvalue
  low = stats.t.interval(0.9, len(d) - 1, loc=d.mean(), scale=stats.sem(d))[0]
  n = out["tier_n"]["verdict"]
  assert (n["mean"], n["low"], n["p"]) == pytest.approx((d.mean(), low, p_one_sided), abs=1e-9)
  assert p_one_sided >= 0.05 and low <= 0 and not n["better"] and n["complete"]


def test_readme_and_docs_state_tiers_h_and_n_as_the_summary_has_them():
  """The README's advice under the table and docs/studies.md's outcomes quote tier H's and tier
  N's intervals and p values as frontier.json has them."""
  out = _committed()
  h, n = out["tier_h"]["verdict"], out["tier_n"]["verdict"]
  with open("README.md", encoding="utf-8") as f:
    readme = " ".join(f.read().split("**What to use, from the two declared answers.**")[1]
                      .split("On a GPU")[0].split())
  with open("docs/studies.md", encoding="utf-8") as f:
    docs = " ".join(f.read().split("**Tier H outcome")[1].split("**Time on a GPU.**")[0].split())
  for text in (readme, docs):
    assert f"{_interval(h)} points" in text and f"TOST p {h['p']:.3f}" in text
    assert f"{_interval(n)} points" in text
  assert f"one-sided p {n['p']:.3f}" in docs
  assert f"[{100 * h['test_images']['seeds_and_images'][0]:+.2f}, " in docs
  assert f"{h['seconds']['steady_wall_geomean']:.2f} of full data's" in readme
  # Tier H's wall clock over its whole pairs, the declared mean beside it, and the one arm run
  # between the lost designs' passes and tier H's.
  seconds, r70 = h["seconds"], out["summary"]["infobatch-r70"]
  assert (f"{seconds['whole_wall_geomean']:.2f} over the {len(seconds['whole_seeds'])} pairs "
          "with whole wall clocks") in docs
  assert f"the declared mean over all 10 pairs, {seconds['wall_geomean']:.2f}" in docs
  assert (f"`infobatch-r70` at {100 * r70['passes_share']:.1f} % (seeds 0-2 only), was worse "
          f"than full data, "
          f"{_interval(r70['vs_full'])}") in docs


def test_gpu_solo_timing_in_the_docs_from_its_records():
  """The solo H200 pairs (studies/results/frontier_gpu_solo): each run's wall and loop seconds
  and their ratios, read from the record files with json and NumPy, are the ones docs/studies.md
  tabulates, and the geometric means the README and the docs quote."""
  def seconds(name, seed):
    with np.load(f"studies/results/frontier_gpu_solo/{name}/seed{seed}.npz") as f:
      row = json.loads(str(f["row"]))
    assert row["machine"].endswith("jax 0.11.2 on gpu, 1 x NVIDIA H200")
    return row["wall_seconds"], row["scoring_seconds"] + row["selection_seconds"] + row[
        "training_seconds"]
  with open("docs/studies.md", encoding="utf-8") as f:
    docs = f.read()
  with open("README.md", encoding="utf-8") as f:
    readme = " ".join(f.read().split())
  walls, loops = [], []
  for seed in (23, 24, 25):
    (fw, fl), (aw, al) = (seconds("noisy_full@confirm_n", seed),
                          seconds("noisy_topk_anneal-45@confirm_n", seed))
    walls.append(aw / fw)
    loops.append(al / fl)
    assert (f"| {seed} | {fw:.1f} ({fl:.1f}) | {aw:.1f} ({al:.1f}) | {aw / fw:.2f} "
            f"({al / fl:.2f}) |") in docs
  wall, loop = np.exp(np.mean(np.log(walls))), np.exp(np.mean(np.log(loops)))
  assert f"The geometric mean is {wall:.2f} of the wall clock and {loop:.2f} of the loop" in docs
  assert f"took {wall:.2f} of full data's wall clock" in readme
  assert f"Its loop took {loop:.2f} of full data's" in readme


def test_tier_seeds_are_the_seeds_each_tiers_arms_train():
  """--seeds' valid values (TIER_SEEDS) against the arms: the search tiers' and A' arms, tiers
  C-F for a chosen arm, tier G for an A' arm, and tiers H and N each train exactly the seeds
  listed for their tier."""
  base = frontier_tiers.base_config()
  search = frontier_tiers.search_arms(base) + frontier_tiers.a2_arms()
  chosen = next(a for a in search if a.name == "topk_anneal-45")
  arms = (search + frontier_tiers.later_arms(chosen, base)
          + frontier_tiers.g_arms(frontier_tiers.a2_arms()[0]) + frontier_tiers.h_arms(base)
          + frontier_tiers.n_arms(base))
  trained = {}
  for arm in arms:
    trained.setdefault(arm.tier, set()).update(arm.seeds)
  assert set(trained) == set(frontier_tiers.TIERS)
  assert trained == {t: set(s) for t, s in frontier_tiers.TIER_SEEDS.items()}
