"""selection.budget: the kept fraction that spends a share of full data's example passes.

The rule (cpjax/selection/budgets.py) against a case worked by hand and a brute-force search,
against the library API's epoch sizes, and the study's lossless design as a budget; the config's
checks and main.py's derivation; and a short run of every fixed-size policy, whose recorded
passes (metrics.jsonl's selected_k) are the budget within one batch.
"""

import math
import os

import numpy as np
import pytest

from configs import default
from cpjax.config import implied, validation
from cpjax.data import splits
from cpjax.selection import api, budgets, policies
from cpjax.training import train
from studies import frontier_tiers, grid
from tests import helpers

# configs/test.py: 1,257 training digits in batches of 64.
DIGITS = 1257
BATCH = 64


def test_a_hand_worked_budget():
  """3 epochs of 1,257 rows, 1 warm-up epoch: 60 % of the 3,771 passes is 2,262.6 rows, so the
  2 selected epochs take 1,005.6, k = 502.8 each: k = 503 (2,263 rows, 0.4 off) beats k = 502
  (2,261, 1.6 off); round(0.4 x 1257) = round(502.8) = 503, and no one-decimal fraction less."""
  schedule = budgets.Schedule(DIGITS, 3, 1)
  fraction = budgets.fraction_for_budget(schedule, 0.6)
  assert fraction == 0.4
  assert budgets.rows_per_epoch(schedule, fraction) == [1257, 503, 503]
  assert budgets.passes(schedule, fraction) == 2263


def test_the_long_schedules_budget_by_hand():
  """20 epochs of 54,000 rows, 1 warm-up and 2 final full epochs: 57.3 % of the 1,080,000
  passes is 618,840; the 17 selected epochs take 456,840, k = 26,872.94: k = 26,873 (1 row
  over); round(f x 54000) = 26873 for f in [0.4976389, 0.4976574): 0.49764, five decimals."""
  schedule = budgets.Schedule(54000, 20, 1, 2)
  fraction = budgets.fraction_for_budget(schedule, 0.573)
  assert fraction == 0.49764
  assert budgets.rows_per_epoch(schedule, fraction) == [54000] + [26873] * 17 + [54000] * 2
  assert budgets.passes(schedule, fraction) == 618841
  assert (budgets.passes_text(schedule, fraction)
          == "618,841 of 1,080,000 example passes, 57.30 % of full data's")


def _nearness(passes: int, target: float) -> tuple[float, int]:
  """How near `passes` is to `target`: the distance, then the passes (a tie: the fewer)."""
  return abs(passes - target), passes


def _reached(schedule: budgets.Schedule, grid_size: int) -> set[int]:
  """The passes of every fraction on a grid of `grid_size` in (0, 1]."""
  return {budgets.passes(schedule, i / grid_size) for i in range(1, grid_size + 1)}


SCHEDULES = [budgets.Schedule(n, e, w, f, end)
             for n, e, w, f, end in [(37, 5, 1, 0, -1.0), (100, 6, 2, 1, -1.0),
                                     (57, 4, 0, 0, -1.0), (80, 7, 1, 2, 0.9),
                                     (45, 5, 2, 0, 0.05)]]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_nearest_passes_and_the_fewest_decimals_as_a_brute_force_search(schedule):
  """Every budget on a grid of the reachable range: the passes are the nearest any fraction
  reaches (searched on a grid finer than a row), no fraction with fewer decimals reaches
  them, and with a constant fraction they lie within S / 2 rows of the budget."""
  low, high = budgets.reachable(schedule)
  reached = _reached(schedule, 20 * schedule.num_rows)  # Finer than a row of any epoch.
  coarser = {decimals: _reached(schedule, 10 ** decimals) for decimals in range(1, 4)}
  for budget in np.linspace(low, high, 41):
    fraction = budgets.fraction_for_budget(schedule, float(budget))
    got, target = budgets.passes(schedule, fraction), budget * schedule.full_passes
    best = min(reached, key=lambda p, target=target: _nearness(p, target))
    assert _nearness(got, target) <= _nearness(best, target)
    assert got == best or schedule.fraction_end >= 0  # A grid may step over a narrow value.
    decimals = len(repr(fraction).split(".")[1]) if "." in repr(fraction) else 0
    if 1 < decimals <= 4:
      assert got not in coarser[decimals - 1]
    if schedule.fraction_end < 0:
      assert abs(got - target) <= len(schedule.selected) / 2 + 1e-9


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_epoch_sizes_are_the_library_apis(schedule):
  """rows_per_epoch is Selection.k_at in its selected epochs and all rows elsewhere."""
  method = "top_k"
  selection = api.Selection(np.arange(schedule.num_rows), method=method, fraction=0.37,
                            warmup_epochs=schedule.warmup_epochs,
                            num_epochs=schedule.num_epochs,
                            final_full_epochs=schedule.final_full_epochs,
                            fraction_end=schedule.fraction_end)
  want = [selection.k_at(e) if selection.selecting(e) else schedule.num_rows
          for e in range(schedule.num_epochs)]
  assert budgets.rows_per_epoch(schedule, 0.37) == want


def test_a_budget_out_of_reach_names_the_range():
  """3 epochs, 1 warm-up: at least 1,257 + 2 rows of 3,771 (0.33386), at most all."""
  schedule = budgets.Schedule(DIGITS, 3, 1)
  assert budgets.reachable(schedule) == (1259 / 3771, 1.0)
  assert budgets.range_text(schedule) == "0.3339 to 1"
  for budget in (0.2, -0.5, 0.0, 1.5):
    with pytest.raises(ValueError, match="reaches 0.3339 to 1 of full data's passes"):
      budgets.fraction_for_budget(schedule, budget)
  assert budgets.fraction_for_budget(schedule, 1.0) == 1.0


def test_the_studys_lossless_design_is_a_budget_within_one_batch():
  """topk_anneal-55 (the tier-H design: fraction 0.4971, the last 2 of 20 epochs on all data,
  1 warm-up epoch) as a budget: its own share of the passes, rounded to 3 decimals (0.573), and
  unrounded, each derive a fraction whose epochs keep within one batch (128) of its rows, in the
  same number of steps."""
  base = frontier_tiers.base_config()
  arm = next(a for a in frontier_tiers.search_arms(base) if a.name == frontier_tiers.H_CHOICE)
  config = grid.apply(base, arm.overrides)
  selection = config.selection
  schedule = budgets.Schedule(splits.num_train_examples(config.dataset), config.num_epochs,
                              selection.warmup_epochs, selection.final_full_epochs)
  assert (selection.method, selection.fraction) == ("top_k", 0.4971)
  study = budgets.rows_per_epoch(schedule, selection.fraction)[1]
  share = budgets.pass_share(schedule, selection.fraction)
  assert round(share, 3) == 0.573
  for budget in (0.573, share):
    fraction = budgets.fraction_for_budget(schedule, budget)
    k = budgets.rows_per_epoch(schedule, fraction)[1]
    assert abs(k - study) <= config.batch_size
    assert math.ceil(k / config.batch_size) == math.ceil(study / config.batch_size)
  assert budgets.fraction_for_budget(schedule, share) == 0.4971


def test_the_policies_that_take_a_budget():
  assert budgets.budget_methods() == [p.name for p in policies.POLICIES.entries()
                                      if p.size != "free"]
  assert not budgets.takes_budget("infobatch") and not budgets.takes_budget("full")
  assert budgets.takes_budget("importance") and budgets.takes_budget("static_random")


# ---------------------------------------------------------------------------------------------
# The config: main.py's derivation and the checks.


def _derived(config, explicit=frozenset({"selection.budget"})):
  settings, line = implied.budget_settings(config, explicit)
  return implied.with_settings(config, settings), line


def test_main_derives_and_logs_the_fraction_and_the_config_validates():
  config = helpers.tiny_config(**{"num_epochs": 3, "selection.method": "top_k",
                                  "selection.warmup_epochs": 1, "selection.budget": 0.6})
  derived, line = _derived(config)
  assert derived.selection.fraction == 0.4
  assert line == ("selection.budget=0.6: selection.fraction=0.4 (1 warm-up epoch of 3 on all "
                  "1,257 rows, top_k's fixed size): 2,263 of 3,771 example passes, 60.01 % of "
                  "full data's.")
  validation.validate(derived)
  assert implied.budget_settings(helpers.tiny_config(), set()) == ({}, "")  # No budget.


def _problems(derive: bool = True, **overrides) -> str:
  """validate's message for configs/test.py over 3 epochs, 1 warm-up, top-k and `overrides`,
  after main.py's derivation (`derive`) or, as a library caller may, without it."""
  config = helpers.tiny_config(**{"num_epochs": 3, "selection.warmup_epochs": 1,
                                  "selection.method": "top_k", **overrides})
  with pytest.raises(validation.ConfigError) as raised:
    validation.validate(_derived(config)[0] if derive else config)
  return str(raised.value)


@pytest.mark.parametrize("budget", [-0.5, 0.2, 1.5])
def test_a_budget_out_of_range_is_one_line_naming_the_reachable_range(budget):
  lines = _problems(**{"selection.budget": budget}).splitlines()[1:]
  assert lines == [f"  config.selection.budget={budget}: the schedule reaches 0.3339 to 1 of "
                   "full data's passes; valid: a share of them in that range, or 0 (no budget)"]


def test_a_budget_beside_a_fraction_or_count_is_refused_naming_both():
  config = helpers.tiny_config(**{"selection.method": "top_k", "selection.budget": 0.6,
                                  "selection.fraction": 0.3})
  with pytest.raises(validation.ConfigError, match=r"config.selection.budget=0.6 and "
                     r"config.selection.fraction=0.3 were both set"):
    implied.budget_settings(config, {"selection.budget", "selection.fraction"})
  text = _problems(False, **{"selection.budget": 0.6, "selection.fraction": 0.3})
  assert ("config.selection.budget=0.6 and config.selection.fraction=0.3 were both set: the "
          "budget derives the fraction (0.4 on this schedule); set one of them") in text
  text = _problems(False, **{"selection.budget": 0.6, "selection.count": 100})
  assert "config.selection.budget=0.6 and config.selection.count=100 were both set" in text


def test_a_budget_with_a_policy_of_its_own_sizes_names_the_ones_that_take_one():
  text = _problems(**{"selection.budget": 0.6, "selection.method": "infobatch",
                      "selection.score": "loss"})
  assert ("config.selection.budget=0.6 does not work with method='infobatch', which decides "
          "its epochs' sizes itself") in text
  assert ", ".join(budgets.budget_methods()) in text


def test_a_command_line_budget_outranks_a_config_files_fraction():
  """configs/cifar10.py sets fraction 0.1: a budget on the command line replaces it; the same
  budget beside a fraction on the command line, or in the same file, is refused."""
  changed = {"selection.fraction", "selection.method", "num_epochs"}
  assert implied.user_set({"selection.budget"}, changed) == {
      "selection.budget", "selection.method", "num_epochs"}
  assert "selection.fraction" in implied.user_set({"selection.budget", "selection.fraction"},
                                                  changed)
  assert "selection.fraction" in implied.user_set(set(), changed | {"selection.budget"})
  assert implied.user_set({"seed"}, changed) == changed | {"seed"}
  assert default.get_config().selection.budget == 0.0


@pytest.mark.slow  # Starts main.py twice: a bad budget stops before any work, a good one trains.
def test_main_refuses_a_bad_budget_and_logs_a_good_ones_fraction(tmp_path):
  """configs/test.py over 3 epochs, 2 of them warm-up: at least 2 x 1,257 + 1 of 3,771 rows
  (0.66693); 1.5 is refused in one line, 0.8 trains k = round(0.4 x 1257) = 503 rows."""
  flags = ("--config.num_epochs=3", "--config.selection.method=top_k")
  result = helpers.run_main(str(tmp_path / "bad"), *flags, "--config.selection.budget=1.5")
  assert result.returncode == 2
  problems = [line for line in result.stderr.splitlines() if "selection.budget" in line]
  assert problems == ["  config.selection.budget=1.5: the schedule reaches 0.667 to 1 of full "
                      "data's passes; valid: a share of them in that range, or 0 (no budget)"]
  workdir = str(tmp_path / "good")
  result = helpers.run_main(workdir, *flags, "--config.selection.budget=0.8")
  assert result.returncode == 0, result.stderr[-3000:]
  assert ("selection.budget=0.8: selection.fraction=0.4 (2 warm-up epochs of 3 on all 1,257 "
          "rows, top_k's fixed size): 3,017 of 3,771 example passes, 80.01 % of full data's."
          in result.stderr)
  assert [r["selected_k"] for r in helpers.read_metrics(workdir)] == [1257, 1257, 503]


# ---------------------------------------------------------------------------------------------
# A short run per fixed-size policy.

FIXED = [name for name in budgets.budget_methods()
         if policies.POLICIES[name].size in ("fixed", "constant")]


@pytest.mark.slow  # A whole (tiny) training run per policy.
@pytest.mark.parametrize("method", FIXED)
def test_a_runs_recorded_passes_are_its_budget_within_one_batch(method, tmp_path):
  """configs/test.py, 4 epochs, 1 warm-up and 1 final full epoch, 55 % of full data's passes:
  the rows metrics.jsonl records (selected_k per epoch) over 4 x 1,257 are the budget within
  one batch of rows, and exactly what the rule planned."""
  budget = 0.55
  config = helpers.tiny_config(**{
      "num_epochs": 4, "selection.method": method, "selection.warmup_epochs": 1,
      "selection.final_full_epochs": 1, "selection.budget": budget,
      "evaluation.bootstrap_resamples": 10, "evaluation.calibrator_resamples": 0})
  config, _ = _derived(config)
  workdir = str(tmp_path / method)
  train.train_and_evaluate(config, workdir)
  recorded = sum(r["selected_k"] for r in helpers.read_metrics(workdir))
  assert abs(recorded - budget * 4 * DIGITS) <= BATCH
  schedule = budgets.Schedule(DIGITS, 4, 1, 1)
  assert recorded == budgets.passes(schedule, config.selection.fraction)
  assert os.path.exists(os.path.join(workdir, "report", "results.json"))
