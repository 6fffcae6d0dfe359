"""The long-schedule study's accounting and statistics against hand-worked cases and a second
implementation (the report's ECE)."""

import json
import math
import os
import shutil

import numpy as np
import pytest

from cpjax.calibration import metrics
from cpjax.runtime import anatomy, preemption
from studies import long_schedule
from tests.helpers import read_metrics, tiny_config


def test_the_studys_bootstrap_ece_equals_the_reports_ece():
  rng = np.random.default_rng(0)
  confidence = rng.uniform(0.1, 1.0, (4, 500))
  confidence[0, :5] = [1 / 15, 2 / 15, 1.0, 0.5, 14 / 15]  # Bin edges: right-closed bins.
  correct = (rng.uniform(size=(4, 500)) < confidence).astype(np.float64)
  ours = long_schedule._ece(confidence, correct)
  for row in range(4):
    assert ours[row] == pytest.approx(
        metrics.ece_from_confidences(confidence[row], correct[row], 15), abs=1e-12)


def _records(*selected_k):
  return [{"epoch": e, "selected_k": k} for e, k in enumerate(selected_k)]


def test_example_passes_count_training_scoring_and_meta_batches_by_hand():
  # configs/test.py has 1,257 training rows; batches of 10 here.
  fresh = tiny_config(**{"batch_size": 10, "selection.method": "top_k", "num_epochs": 2,
                         "selection.warmup_epochs": 1, "selection.scoring": "fresh"})
  # Epoch 0: 95 rows -> 10 steps -> 300 passes. Epoch 1: 30 rows -> 3 steps -> 90, plus a
  # scoring pass over the 1,257 training rows.
  np.testing.assert_array_equal(long_schedule.example_passes(fresh, _records(95, 30)),
                                [300, 300 + 90 + 1257])
  budget = tiny_config(**{"batch_size": 10, "budget_steps": 12})
  np.testing.assert_array_equal(long_schedule.example_passes(budget, _records(95, 95)),
                                [300, 360])  # 10 steps, then the 2 left of the budget.
  meta = tiny_config(**{"batch_size": 10, "loss.name": "flgamma_sece",
                        "dataset.meta_val_size": 100})
  np.testing.assert_array_equal(long_schedule.example_passes(meta, _records(20)),
                                [80])  # 2 steps of 10 trained (3 each) + 10 meta rows (1).


def test_steady_seconds_take_the_lower_quartile_rate_by_hand():
  config = tiny_config(**{"batch_size": 10})
  # Four epochs of 10 steps timed 10 s (compiling), 2 s, 3 s and 0.2 s (resumed near its
  # end: only its last steps timed, too fast to trust).
  records = [{"epoch": e, "selected_k": 100, "training_seconds": t, "scoring_seconds": 0.5,
              "selection_seconds": 0.25} for e, t in enumerate((10.0, 2.0, 3.0, 0.2))]
  # Per-step rates 1.0, 0.2, 0.3, 0.02; lower quartile (linear) = 0.02 + 0.75 * (0.2 - 0.02).
  rate = 0.02 + 0.75 * 0.18
  assert long_schedule.steady_seconds(config, records) == pytest.approx(40 * rate + 4 * 0.75)


def test_seed_interval_is_the_t_interval_by_hand():
  mean, low, high = long_schedule.seed_interval([1.0, 2.0, 3.0])
  half = 2.919986 / math.sqrt(3)  # t(0.95, 2 df) * sd 1 / sqrt(3), from a t table.
  assert (mean, low, high) == pytest.approx((2.0, 2.0 - half, 2.0 + half), abs=1e-5)
  assert np.isnan(long_schedule.seed_interval([0.5])[1])


def test_paired_bootstrap_of_a_run_with_itself_is_zero_and_brackets_a_known_gap():
  rng = np.random.default_rng(1)
  correct = (rng.uniform(size=2000) < 0.8).astype(np.int8)
  run = {"seed_index": {0: 0}, "correct": [correct], "confidence": [np.full(2000, 0.8)]}
  assert long_schedule.test_interval(run, run, [0], "accuracy") == (0.0, 0.0)
  better = correct.copy()
  better[np.flatnonzero(correct == 0)[:100]] = 1  # 100 of 2,000 more right: +5 points.
  other = {**run, "correct": [better]}
  low, high = long_schedule.test_interval(other, run, [0], "accuracy")
  assert low < 0.05 < high and low > 0.03  # Paired: only the 100 changed images vary.


@pytest.mark.slow
def test_the_study_runs_end_to_end_on_digits(tmp_path, monkeypatch):
  """Three arms on configs/test.py (3 epochs, 1 of warm-up), one seed: the RHO-LOSS arm
  trains its held-out target first; the summary pairs each arm with its references and the
  figures are written. Digits stand in for Fashion-MNIST to keep it to seconds."""
  def tiny_base():
    return tiny_config(**{"num_epochs": 3, "selection.warmup_epochs": 1,
                          "eval_every_epochs": 2})
  monkeypatch.setattr(long_schedule.fashion_mnist_long, "get_config", tiny_base)
  argv = ["long_schedule", f"--out={tmp_path}", f"--records={tmp_path / 'records'}",
          "--seeds", "0", "--only", "noisy_full", "noisy_random-30", "noisy_rho-30"]
  monkeypatch.setattr("sys.argv", argv)
  long_schedule.main()
  with open(tmp_path / "summary.json") as f:
    out = json.load(f)
  assert not out["failures"] and set(out["summary"]) == {"noisy_full", "noisy_random-30",
                                                         "noisy_rho-30"}
  rho = out["summary"]["noisy_rho-30"]
  assert set(rho["paired"]) == {"full", "random"}
  runs = out["runs"]
  accuracy = rho["paired"]["random"]["accuracy"][0]
  assert accuracy == pytest.approx(runs["noisy_rho-30"]["accuracy"][0]
                                   - runs["noisy_random-30"]["accuracy"][0])
  assert out["targets"]["target_rho"]["passes"] > 0
  # The RHO arm's saving with its target counts the target's passes on top of its own.
  full = runs["noisy_full"]["passes"][0]
  assert rho["saving_passes_with_target"] == pytest.approx(
      1 - (runs["noisy_rho-30"]["passes"][0] + out["targets"]["target_rho"]["passes"]) / full)
  # RHO-LOSS scores every example it trains on with a fresh pass in each selected epoch:
  # 1 pass each, on top of 3 per trained example (whole batches), by hand.
  rho_config = long_schedule.grid.apply(tiny_base(), long_schedule.RHO)
  batch, rest = rho_config.batch_size, long_schedule.splits.num_train_examples(
      rho_config.dataset)
  kept = round(0.3 * rest)
  assert runs["noisy_rho-30"]["passes"][0] == 3 * batch * math.ceil(rest / batch) + 2 * (
      3 * batch * math.ceil(kept / batch) + rest)
  for name in ("summary.md", "time_to_accuracy.png", "paired_differences.png"):
    assert (tmp_path / name).stat().st_size > 0
  # Each record keeps where its run's wall clock went: every part of the run's anatomy,
  # summing to its wall clock, as the run's last metrics.jsonl record holds it.
  row = long_schedule.load_record(long_schedule.record_path(str(tmp_path / "records"),
                                                            "noisy_random-30", 0))
  last = read_metrics(str(tmp_path / "noisy_random-30" / "seed0"))[-1]
  assert row["anatomy"] == {k: v for k, v in last.items() if k.startswith("perf/")}
  parts = [row["anatomy"][anatomy.key(name)] for name in anatomy.PARTS]
  assert sum(parts) == pytest.approx(row["anatomy"]["perf/wall_seconds"], rel=1e-9)
  # Three arms, one seed each, all in tier A; the machine each trained on is named.
  text = (tmp_path / "summary.md").read_text()
  assert "**Status:** 3 of 3 planned runs finished (tier A: 3 of 3)" in text
  assert f"{os.cpu_count()} cores, jax" in text

  # The records outlive the workdirs: with every workdir gone (a study moved to a fresh
  # clone), the rerun trains nothing and summarises the same numbers, test images included.
  for name in ("noisy_full", "noisy_random-30", "noisy_rho-30", "target_rho"):
    shutil.rmtree(tmp_path / name)
  def no_training(*args):
    raise AssertionError(f"retrained {args[1:]}")
  monkeypatch.setattr(long_schedule.grid.train, "train_and_evaluate", no_training)
  for extra in (["--summarise-only"], []):
    monkeypatch.setattr("sys.argv", argv + extra)
    long_schedule.main()
    with open(tmp_path / "summary.json") as f:
      again = json.load(f)
    assert not again["failures"] and again["runs"] == runs
    assert again["targets"] == out["targets"] and again["summary"] == out["summary"]


def _pair(mean, low, high, seeds=(0, 1, 2), equivalent=False, p=0.5):
  tost = {"n": len(seeds), "mean": mean, "p": p, "equivalent": equivalent}
  return {"seeds": list(seeds), "accuracy": (mean, low, high), "accuracy_test": (low, high),
          "tost": tost}


def test_verdicts_read_the_seed_interval_and_refuse_one_seed():
  assert long_schedule.verdict(_pair(0.01, 0.002, 0.02)) == "better"
  assert long_schedule.verdict(_pair(-0.01, -0.02, -0.001)) == "worse"
  assert long_schedule.verdict(_pair(0.001, -0.003, 0.005)) == "no difference"
  assert long_schedule.verdict(_pair(0.01, math.nan, math.nan, (0,))) == "undecided"
  assert long_schedule.verdict(None) == "undecided"
  # Lossless: equivalent by the TOST and the mean at most 0.1 points below; an interval
  # that merely holds 0 is not enough.
  assert long_schedule.lossless(_pair(-0.0005, -0.0015, 0.0005, equivalent=True, p=0.01))
  assert not long_schedule.lossless(_pair(-0.0015, -0.0019, -0.0011, equivalent=True))
  assert not long_schedule.lossless(_pair(0.0, -0.004, 0.004))  # Holds 0, not equivalent.
  assert not long_schedule.lossless(None)


def test_answers_name_the_winner_and_the_targets_met_or_missed():
  arms = {a.name: a for a in long_schedule.arms(tiny_config())}
  pick = ("full", "random-30", "topk_entropy-30", "topk_flsd53-30", "infobatch",
          "noisy_full", "noisy_random-30", "noisy_topk_entropy-30", "noisy_infobatch")
  summary = {name: {"paired": {}, "saving_steady_with_target": 0.0} for name in pick}
  summary["topk_entropy-30"].update(
      paired={"random": _pair(0.011, 0.008, 0.014),
              "full": _pair(-0.001, -0.0018, -0.0002, equivalent=True, p=0.02)},
      saving_steady_with_target=0.6)
  summary["random-30"].update(paired={"full": _pair(-0.015, -0.02, -0.01)},
                              saving_steady_with_target=0.62)
  summary["topk_flsd53-30"]["paired"] = {"ce_topk": _pair(-0.013, -0.02, -0.006)}
  summary["infobatch"].update(paired={"full": _pair(-0.0005, -0.0015, 0.0005, equivalent=True,
                                                   p=0.01)},
                              saving_steady_with_target=0.3)  # Lossless, but saves < 35 %.
  summary["noisy_random-30"]["paired"] = {"full": _pair(-0.01, -0.02, -0.005)}
  summary["noisy_topk_entropy-30"]["paired"] = {"full": _pair(0.004, -0.001, 0.009, p=0.62)}
  # InfoBatch has no fixed budget, but it is a policy under noise too: the best one here.
  summary["noisy_infobatch"]["paired"] = {"full": _pair(0.006, 0.001, 0.011)}
  text = "\n".join(long_schedule.answers([arms[n] for n in pick], summary))
  assert "topk_entropy-30 +1.10 points vs random [+0.80, +1.40]" in text
  assert "better" in text.split("topk_entropy-30 +1.10")[1].split(";")[0]
  assert "topk_flsd53-30 -1.30 points vs CE top-k [-2.00, -0.60]" in text
  assert "met by topk_entropy-30" in text  # -0.1 points, equivalent, 60 % saved.
  assert "InfoBatch lossless at >= 35 % saved: missed" in text
  assert ("best noisy_infobatch +0.60 points vs noisy full [+0.10, +1.10]" in text
          and "lossless or better than full data: met" in text)
  # A "no difference" is printed with its equivalence test.
  assert ("noisy_topk_entropy-30 +0.40 points vs noisy full [-0.10, +0.90]" in text and
          "no difference detected, not shown equivalent at ±0.2 (TOST p 0.620)" in text)


def test_scorer_effect_is_the_difference_of_differences_by_hand():
  arms = {a.name: a for a in long_schedule.arms(long_schedule.base_config())}
  def run(*accuracy):
    return {"seed_index": {0: 0, 1: 1, 2: 2}, "accuracy": list(accuracy)}
  results = {"topk_flgamma-30": run(0.915, 0.917, 0.918), "flgamma_full": run(0.919, 0.918, 0.921),
             "topk_entropy-30": run(0.919, 0.921, 0.922), "full": run(0.923, 0.922, 0.924)}
  # Per seed: (-0.004 - (-0.004)), (-0.001 - (-0.001)), (-0.003 - (-0.002)) = 0, 0, -0.001.
  effect = long_schedule.scorer_effect(arms["topk_flgamma-30"], results)
  assert effect["accuracy"][0] == pytest.approx(-0.001 / 3, abs=1e-12)
  assert effect["seeds"] == 3 and effect["tost"]["n"] == 3
  assert long_schedule.scorer_effect(arms["topk_entropy-30"], results) is None


@pytest.mark.slow
def test_a_failed_run_is_reported_but_a_stop_request_stops_the_study(tmp_path, monkeypatch):
  """A run that raises is listed under the summary's failed runs and the study goes on; a
  preemption (SIGTERM) propagates, so the study stops and its rerun resumes the run."""
  def fails(base, overrides, workdir, record):
    raise ValueError(f"planted failure of seed {overrides['seed']}")
  monkeypatch.setattr(long_schedule, "run_row", fails)
  monkeypatch.setattr("sys.argv", ["long_schedule", f"--out={tmp_path}", "--seeds", "0", "1",
                                   f"--records={tmp_path / 'records'}", "--only", "random-30"])
  long_schedule.main()
  with open(tmp_path / "summary.json") as f:
    failures = json.load(f)["failures"]
  assert set(failures) == {"random-30 seed 0", "random-30 seed 1"}
  assert "planted failure of seed 1" in failures["random-30 seed 1"]

  def preempted(base, overrides, workdir, record):
    raise preemption.Preempted("SIGTERM: saved a checkpoint", 7)
  monkeypatch.setattr(long_schedule, "run_row", preempted)
  with pytest.raises(preemption.Preempted):
    long_schedule.main()


def test_tier_b_runs_the_calibrated_scorers_first():
  """Tier B opens with Tata et al.'s question: the FL_gamma-SECE runs and the calibrated
  targets' arms, the full run that the gamma-Net target needs before its arm; tiers in order."""
  ordered = long_schedule.arms(long_schedule.base_config())
  tiers = [a.tier for a in ordered]
  assert tiers == sorted(tiers)
  tier_b = [a.name for a in ordered if a.tier == "B"]
  first = tier_b[:4]
  assert first == ["flgamma_full", "topk_flgamma-30", "topk_mixup_target-30",
                   "topk_gamma_target-30"]
  assert not any("flgamma" in n or "target" in n for n in tier_b[4:])


def test_wall_clock_counts_only_runs_it_covers_whole():
  """A resumed run's wall clock is its last sitting's (100 s against 200 s of phase seconds):
  left out of the mean, 300 and 500 s kept; the cell names how many runs it rests on."""
  r = {"wall_seconds": [300.0, 100.0, 500.0], "compute_seconds": [280.0, 200.0, 500.0]}
  assert long_schedule.whole_runs(r) == [0, 2]
  row = {"seeds": [0, 1, 2], "wall_runs": 2, "wall_seconds": 400.0}
  assert long_schedule._wall_cell(row) == "400 (2 of 3)"
  assert long_schedule._wall_cell({**row, "wall_runs": 0}) == "— (0 of 3)"


def test_the_machine_names_an_accelerators_devices(monkeypatch):
  """On CPU the string is as the committed records hold it; on a GPU it names the card."""
  class Device:
    def __init__(self, kind):
      self.device_kind = kind
  monkeypatch.setattr(long_schedule.jax, "default_backend", lambda: "cpu")
  cpu = long_schedule.machine()
  assert cpu.endswith(f"cores, jax {long_schedule.jax.__version__} on cpu")
  monkeypatch.setattr(long_schedule.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(long_schedule.jax, "devices", lambda: [Device("NVIDIA H100 80GB HBM3")])
  assert long_schedule.machine() == cpu[:-len("cpu")] + "gpu, 1 x NVIDIA H100 80GB HBM3"
  monkeypatch.setattr(long_schedule.jax, "devices", lambda: [Device("A"), Device("A"),
                                                             Device("B")])
  assert long_schedule.machine().endswith("on gpu, 2 x A, 1 x B")
