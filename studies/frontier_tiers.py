"""How much training compute can selection skip without losing accuracy?

The accuracy-compute frontier of every policy on the long schedule
(configs/fashion_mnist_long.py: small_cnn, crop+flip, 54,000 training images of
Fashion-MNIST, 20 epochs of cosine SGD, epoch 0 on all data), measured in
example passes (forward 1, forward + backward 3, scoring passes included), and
whether any policy is *lossless* at half the passes or fewer.

Policies, each at four budgets B (per cent of examples kept per selected epoch
for the constant-budget ones; about 0.05 + 0.95 B of full data's passes):

  same_budget-B       all data, cut to a B run's optimizer steps, the cosine
                      stretched over them (fewer epochs of full data)
  random-B            a fresh uniform draw each epoch
  topk_entropy-B      top-k on the train pass's entropy (Tata et al. 2022)
  sampled-B           Gumbel-top-k on the entropy, T = 0.1
  infobatch-rR        InfoBatch (Qin et al. 2024) at prune ratio R (no fixed budget:
                      R = 50, 70, 85, 95 spans its passes)
and the designs that aim beyond them, with the same passes as the B arms:
  topk_anneal-B       top-k, then the last 2 epochs on all data (InfoBatch's annealing
                      for a fixed-size policy); the kept fraction lowered to
                      (19 B - 2) / 17 so that the passes match
  topk_rising-B       top-k with the kept fraction rising linearly over the selected
                      epochs (from B - 25 to B + 25 points, at least 5 %): lean while
                      the model learns the bulk, most data at the end
  sampled_anneal-B    Gumbel-top-k (T = 0.1), then the last 2 epochs on all data

Protocol (settings chosen on validation accuracy only):
  tier A  every policy at the half-compute budget (B = 45, InfoBatch R = 85),
          seeds 0-2, beside full data (seeds 0-2)
  choice  the policy with the highest mean validation accuracy among tier A's
          arms with at most half of full data's passes (the rule is fixed here,
          before any confirmation run)
  tier C  the chosen arm and full data on 5 untouched seeds (3-7)
  tier B  the other budgets (30, 55, 70; InfoBatch R = 50, 70, 95), seeds 0-2
  tier D  the chosen arm and full data under 20 % uniform label noise with a
          different noise draw per seed (seeds 3-7)
  tier E  the chosen arm and full data on a 30-epoch schedule (seeds 0-2): does
          the gap hold where full data is closer to its validation plateau?
  tier F  replication, declared before any of its runs: the chosen arm and full data on
          5 more untouched seeds (8-12), the same rule; reported alone and pooled with
          tier C (seeds 3-12), beside tier C's verdict, which stays as it was

Declared before any of their runs: is an importance-sampling design lossless at half the passes?
  tier A' (A2 in code)  four designs at no more than half of full data's passes, each
          beside full data on seeds 0-2 (its records exist):
            importance-m50, importance-m20  importance sampling (selection.method=
                      importance) by the train pass's el2n, mix 0.5 and 0.2, normalised
                      loss weights clipped at 10; kept fraction 0.4673 in expectation
                      (IMPORTANCE_FRACTION: the largest whose passes stay at or below half
                      even when its selected epochs hold 4 sd more than k in all)
            topk_anneal-p50   top-k entropy with the last 2 epochs on all data at 0.41
                      kept (TOPK_P50_FRACTION: the largest at or below half the passes,
                      49.85 %)
            infobatch_norescale-r95  InfoBatch at r = 0.95 without its loss weight
                      (selection.infobatch_rescale=False): does the weight 1/(1 - r) = 20,
                      rather than the pruning, cause its collapse at r = 0.95?
  choice  the same rule as tier A's, applied to tier A' (`choose(..., tier="A2")`): the
          highest mean validation accuracy among its arms at no more than half of full
          data's passes
  tier G  the tier-A' choice and full data on 10 new seeds (13-22); the same TOST at
          ±0.2 points and -0.1 floor, the test images' paired bootstrap beside the seed
          interval, and per seed the arm's wall-clock and loop seconds over full data's
          (each pair's machine named)

Declared before any of their runs: how much can be saved without losing accuracy, and is
selection better than full data under noisy labels?
  tier H  the largest lossless saving. The rule (`choose_h`), applied to the records of the
          search tiers (A, A', B; seeds 0-2) before any tier-H run: among their arms with all
          of seeds 0-2 at 50 to 70 % of full data's passes (H_PASSES) whose mean paired
          difference from full data is at least -0.1 points, the smallest TOST p (ties: the
          smaller share of passes, then the name). It picks `topk_anneal-55` (H_CHOICE: 57.3 %
          of the passes, -0.07 points, TOST p 0.061), which runs beside full data on 10 new
          seeds (23-32). Verdict: lossless (the TOST at ±0.2 points, p < 0.05, and a mean of at
          least -0.1 points) on all 10 seeds; the two-level bootstrap over seeds and test
          images beside it, and per seed the seconds over full data's, as tier G
  tier N  selection under noisy labels: tier D's design (`topk_anneal-45`, N_DESIGN) and full
          data under 20 % symmetric label noise, one noise draw per seed (the seed), on seeds
          23-32. Verdict, one-sided and declared first: better when, on all 10 seeds, the 90 %
          t interval of the mean paired difference lies above 0 (`equivalence.superiority`:
          a one-sided t-test at 0.05); the two-level bootstrap beside it

Lossless means: a two one-sided t-test (TOST) of equivalence at a margin of
0.2 accuracy points passes at alpha = 0.05 on the paired per-seed differences
(arm - full data, same seeds), i.e. the 90 % t interval of the mean difference
lies inside (-0.2, +0.2), and the mean difference is at least -0.1 points.

Runs already made by the long-schedule study with identical settings (full,
random-30, topk_entropy-30, sampled-30, same_budget-30, InfoBatch at R = 50)
are read from its committed records. Every finished run leaves a small record
in studies/results/frontier_runs/; rerunning the command continues the study:

  python -m studies.frontier --out=studies/out/frontier
  python -m studies.frontier --out=studies/out/frontier --tiers A2    # tier A' alone
  python -m studies.frontier --out=studies/out/frontier --tiers A2G   # then tier G
  python -m studies.frontier --out=studies/out/frontier --tiers H     # tier H
  python -m studies.frontier --out=studies/out/frontier --tiers N     # tier N
  python -m studies.frontier --tiers HN --dry-run   # the runs they would make, nothing trained
  python -m studies.frontier --tiers N --seeds=23,28 # only these seeds' runs (one worker's)

On a machine with cores and device memory to spare (a GPU box), studies/frontier_workers.sh
runs a tier's seeds in parallel processes, one `--seeds` group each.
"""

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import time
import traceback

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from cpjax import registry  # noqa: E402
from cpjax.data import input_pipeline, splits  # noqa: E402
from cpjax.runtime import preemption  # noqa: E402
from cpjax.selection import policies, subsets  # noqa: E402
from studies import equivalence, grid, long_schedule  # noqa: E402

RECORDS = "studies/results/frontier_runs"
LONG_RECORDS = long_schedule.RECORDS
SEARCH_SEEDS = (0, 1, 2)
CONFIRM_SEEDS = (3, 4, 5, 6, 7)
REPLICATE_SEEDS = (8, 9, 10, 11, 12)
HALF = 45  # The half-compute budget: 0.05 + 0.95 * 0.45 = 47.75 % of full data's passes.
BUDGETS = (30, 45, 55, 70)
INFOBATCH_RATIOS = {45: 85, 30: 95, 55: 70, 70: 50}  # Budget column -> prune ratio (%).
MARGIN, MIN_MEAN, ALPHA = equivalence.MARGIN, equivalence.MIN_MEAN, equivalence.ALPHA
tost, lossless = equivalence.tost, equivalence.lossless
ANNEAL_EPOCHS = 2
NOISE = 0.2
SAMPLED = {"selection.method": "sampled", "selection.temperature": 0.1}
# Tiers A' (A2) and G, declared before any of their runs (the module docstring).
TIERS = ("A", "C", "F", "D", "B", "E", "A2", "G", "H", "N")  # Every tier, the default order.
G_SEEDS = tuple(range(13, 23))
PASSES_CAP = 0.5  # Tier A': every arm at no more than half of full data's passes.
SIZE_SDS = 4.0  # An importance arm's epochs may hold this many sd more than k in all.
IMPORTANCE_MIXES = (50, 20)  # Per cent of uniform in the sampling distribution.
IMPORTANCE_FRACTION = 0.4673  # `importance_fraction_at_most(PASSES_CAP, base)`, tested.
TOPK_P50_FRACTION = 0.41  # `anneal_fraction_at_most(PASSES_CAP, base)`, tested.
# Tier A' (A2): its new designs (each importance mix its own, so that the figure draws each).
A2_POLICIES = tuple(f"importance-m{mix}" for mix in IMPORTANCE_MIXES) + ("infobatch_norescale",)
# Tiers H and N, declared before any of their runs (the module docstring).
H_SEEDS = N_SEEDS = tuple(range(23, 33))
H_PASSES = (0.5, 0.7)  # Tier H's candidates: at 50 to 70 % of full data's passes.
# The seeds each tier trains (the default Arm seeds are SEARCH_SEEDS): --seeds' valid values.
TIER_SEEDS = {"A": SEARCH_SEEDS, "A2": SEARCH_SEEDS, "B": SEARCH_SEEDS, "E": SEARCH_SEEDS,
              "C": CONFIRM_SEEDS, "D": CONFIRM_SEEDS, "F": REPLICATE_SEEDS, "G": G_SEEDS,
              "H": H_SEEDS, "N": N_SEEDS}
H_CHOICE = "topk_anneal-55"  # `choose_h` on the records of tiers A, A' and B (tested).
N_DESIGN = "topk_anneal-45"  # Tier D's design, whose exploratory +0.80 points tier N tests.


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  policy: str
  overrides: dict
  tier: str
  budget: int = 100  # The budget column (per cent kept); 100 = full data.
  seeds: tuple = SEARCH_SEEDS
  long_name: str = ""  # The long-schedule study's arm with the same settings, if any.


def anneal_fraction_for(budget: int, num_epochs: int, warmup: int = 1) -> float:
  """The kept fraction of an arm that ends with ANNEAL_EPOCHS full epochs and costs what a
  constant budget-% arm costs: warmup + A + (E - warmup - A) f = warmup + (E - warmup) B."""
  selected = num_epochs - warmup
  return round((selected * budget / 100 - ANNEAL_EPOCHS) / (selected - ANNEAL_EPOCHS), 4)


def rising_range(budget: int) -> tuple[float, float]:
  """(start, end) kept fractions of a linear schedule whose mean is budget %: 25 points
  below to 25 above, the start at least 5 %."""
  start = max(0.05, budget / 100 - 0.25)
  return round(start, 4), round(2 * budget / 100 - start, 4)


def policy_overrides(policy: str, budget: int, base) -> dict:
  """The config overrides of `policy` at `budget` (see the module docstring)."""
  f = budget / 100
  if policy == "same_budget":
    return {"budget_steps": long_schedule.budget_steps(base, f),
            "optimizer.schedule_unit": "step"}
  if policy == "random":
    return {"selection.method": "random", "selection.fraction": f}
  if policy == "topk_entropy":
    return {"selection.method": "top_k", "selection.fraction": f}
  if policy == "sampled":
    return {**SAMPLED, "selection.fraction": f}
  if policy == "infobatch":
    return {**long_schedule.INFOBATCH, "selection.prune_ratio": INFOBATCH_RATIOS[budget] / 100}
  if policy == "topk_anneal":
    return {"selection.method": "top_k",
            "selection.fraction": anneal_fraction_for(budget, base.num_epochs),
            "selection.final_full_epochs": ANNEAL_EPOCHS}
  if policy == "topk_rising":
    start, end = rising_range(budget)
    return {"selection.method": "top_k", "selection.fraction": start,
            "selection.fraction_end": end}
  if policy == "sampled_anneal":
    return {**SAMPLED, "selection.fraction": anneal_fraction_for(budget, base.num_epochs),
            "selection.final_full_epochs": ANNEAL_EPOCHS}
  raise ValueError(f"unknown policy {policy!r}")


POLICIES = ("same_budget", "random", "topk_entropy", "sampled", "infobatch", "topk_anneal",
            "topk_rising", "sampled_anneal")
# The long-schedule study's arms with the same settings (their records are reused).
LONG_NAMES = {"random-30": "random-30", "topk_entropy-30": "topk_entropy-30",
              "sampled-30": "sampled-30", "same_budget-30": "same_budget-30",
              "infobatch-r50": "infobatch"}


def arm_name(policy: str, budget: int) -> str:
  if policy == "infobatch":
    return f"infobatch-r{INFOBATCH_RATIOS[budget]}"
  return f"{policy}-{budget}"


def search_arms(base) -> list[Arm]:
  """Full data and every policy at every budget, seeds 0-2 (tiers A and B)."""
  out = [Arm("full", "full", {}, "A", long_name="full")]
  for budget in (HALF, *[b for b in BUDGETS if b != HALF]):
    for policy in POLICIES:
      name = arm_name(policy, budget)
      out.append(Arm(name, policy, policy_overrides(policy, budget, base),
                     "A" if budget == HALF else "B", budget, long_name=LONG_NAMES.get(name, "")))
  return out


def later_arms(chosen: Arm, base) -> list[Arm]:
  """Tiers C-F for the chosen arm: untouched seeds, per-seed label noise, 30 epochs (its
  settings recomputed for 30 epochs, so that its share of full data's passes stays), and
  5 more untouched seeds (the replication)."""
  longer = grid.apply(base, {"num_epochs": 30})
  def add_noise(overrides):
    return {**overrides, "dataset.label_noise": NOISE}
  return [
      Arm("full@confirm", "full", {}, "C", seeds=CONFIRM_SEEDS),
      Arm(f"{chosen.name}@confirm", chosen.policy, chosen.overrides, "C", chosen.budget,
          seeds=CONFIRM_SEEDS),
      Arm("noisy_full@confirm", "full", add_noise({}), "D", seeds=CONFIRM_SEEDS),
      Arm(f"noisy_{chosen.name}@confirm", chosen.policy, add_noise(chosen.overrides), "D",
          chosen.budget, seeds=CONFIRM_SEEDS),
      Arm("full_e30", "full", {"num_epochs": 30}, "E", long_name="full_e30"),
      Arm(f"{chosen.name}_e30", chosen.policy,
          {**policy_overrides(chosen.policy, chosen.budget, longer), "num_epochs": 30}, "E",
          chosen.budget),
      Arm("full@replicate", "full", {}, "F", seeds=REPLICATE_SEEDS),
      Arm(f"{chosen.name}@replicate", chosen.policy, chosen.overrides, "F", chosen.budget,
          seeds=REPLICATE_SEEDS)]


# ---------------------------------------------------------------------------------------------
# Tiers A' (A2) and G: their passes, counted as the study counts them.


def planned_share(config, base, sizes) -> float:
  """Example passes of a run of `config` whose epochs train `sizes` examples, as a share of
  full data's (`base`, every epoch on all rows), both counted by the study's own
  `long_schedule.example_passes`."""
  n = splits.num_train_examples(base.dataset)
  full = long_schedule.example_passes(
      base, [{"epoch": e, "selected_k": n} for e in range(base.num_epochs)])
  run = long_schedule.example_passes(
      config, [{"epoch": e, "selected_k": int(k)} for e, k in enumerate(sizes)])
  return float(run[-1] / full[-1])


def anneal_sizes(fraction: float, base) -> list[int]:
  """Epoch sizes of top-k at `fraction` kept with the last ANNEAL_EPOCHS on all data."""
  n, warmup = splits.num_train_examples(base.dataset), base.selection.warmup_epochs
  k = policies.subset_size(fraction, 0, n)
  return [n] * warmup + [k] * (base.num_epochs - warmup - ANNEAL_EPOCHS) + [n] * ANNEAL_EPOCHS


def importance_sizes(fraction: float, base, sds: float | None = SIZE_SDS) -> list[int]:
  """Epoch sizes of importance sampling at `fraction` (k in expectation) that bound its
  passes from above: the S selected epochs hold sum_e |S_e| examples, whose sd is at most
  sqrt(S k (1 - k / N)) (each epoch's size is a sum of independent Bernoulli(pi_i) with
  sum_i pi_i = k, so its variance k - sum_i pi_i^2 is at most k - k^2 / N), and
  ceil(|S_e| / B) <= (|S_e| + B - 1) / B; so each epoch at k + `sds` sd / S + B - 1 trains no
  fewer steps in all than the run, unless its sizes exceed theirs by more than `sds` sd.
  sds=None: each epoch at its expected size k."""
  n, warmup = splits.num_train_examples(base.dataset), base.selection.warmup_epochs
  k, selected = policies.subset_size(fraction, 0, n), base.num_epochs - warmup
  if sds is None:
    return [n] * warmup + [k] * selected
  sd = math.sqrt(selected * k * (1 - k / n))
  return [n] * warmup + [math.ceil(k + sds * sd / selected) + base.batch_size - 1] * selected


def largest_fraction(share: float, config_of, sizes_of, base) -> float:
  """The largest kept fraction on a 1e-4 grid whose planned passes (`sizes_of(f, base)`, run
  as `config_of(f)`) are at most `share` of full data's (they grow with f: a bisection)."""
  low, high = 1, 10_000  # In units of 1e-4.
  while low < high:
    middle = (low + high + 1) // 2
    f = middle / 10_000
    if planned_share(config_of(f), base, sizes_of(f, base)) <= share:
      low = middle
    else:
      high = middle - 1
  return low / 10_000


def _topk_p50(fraction: float) -> dict:
  return {"selection.method": "top_k", "selection.fraction": fraction,
          "selection.final_full_epochs": ANNEAL_EPOCHS}


def _importance(fraction: float, mix: int = IMPORTANCE_MIXES[0]) -> dict:
  return {"selection.method": "importance", "selection.score": "el2n",
          "selection.fraction": fraction, "selection.mix": mix / 100,
          "selection.max_weight": 10.0, "selection.weighting": "normalized"}


def anneal_fraction_at_most(share: float, base) -> float:
  """Top-k with the 2-epoch finish: the largest kept fraction at or below `share` of the
  passes (TOPK_P50_FRACTION at half)."""
  return largest_fraction(share, lambda f: grid.apply(base, _topk_p50(f)), anneal_sizes, base)


def importance_fraction_at_most(share: float, base) -> float:
  """Importance sampling: the largest kept fraction whose passes stay at or below `share`
  even with its epochs `SIZE_SDS` sd above their expected size (IMPORTANCE_FRACTION)."""
  return largest_fraction(share, lambda f: grid.apply(base, _importance(f)), importance_sizes,
                          base)


def a2_arms() -> list[Arm]:
  """Tier A' (A2): four designs at no more than half of full data's passes, seeds 0-2. The
  budget column is the tier's cap, 50 % of the passes."""
  return [*(Arm(f"importance-m{mix}", f"importance-m{mix}",
                _importance(IMPORTANCE_FRACTION, mix), "A2", 50) for mix in IMPORTANCE_MIXES),
          Arm("topk_anneal-p50", "topk_anneal", _topk_p50(TOPK_P50_FRACTION), "A2", 50),
          Arm("infobatch_norescale-r95", "infobatch_norescale",
              {**long_schedule.INFOBATCH, "selection.prune_ratio": 0.95,
               "selection.infobatch_rescale": False}, "A2", 50)]


def g_arms(chosen: Arm) -> list[Arm]:
  """Tier G: the tier-A' choice and full data on the 10 new seeds 13-22."""
  return [Arm("full@confirm_g", "full", {}, "G", seeds=G_SEEDS),
          Arm(f"{chosen.name}@confirm_g", chosen.policy, chosen.overrides, "G", chosen.budget,
              seeds=G_SEEDS)]


def _search_arm(name: str, base) -> Arm:
  """The search tiers' (A, A', B) arm called `name`."""
  return next(a for a in search_arms(base) + a2_arms() if a.name == name)


def h_arms(base) -> list[Arm]:
  """Tier H: the declared pick of `choose_h` (H_CHOICE) and full data on seeds 23-32."""
  chosen = _search_arm(H_CHOICE, base)
  return [Arm("full@confirm_h", "full", {}, "H", seeds=H_SEEDS),
          Arm(f"{chosen.name}@confirm_h", chosen.policy, chosen.overrides, "H", chosen.budget,
              seeds=H_SEEDS)]


def n_arms(base) -> list[Arm]:
  """Tier N: tier D's design (N_DESIGN) and full data under 20 % symmetric label noise on
  seeds 23-32, each seed its own noise draw (`run_overrides`)."""
  design, noisy = _search_arm(N_DESIGN, base), {"dataset.label_noise": NOISE}
  return [Arm("noisy_full@confirm_n", "full", noisy, "N", seeds=N_SEEDS),
          Arm(f"noisy_{design.name}@confirm_n", design.policy, {**design.overrides, **noisy},
              "N", design.budget, seeds=N_SEEDS)]


def arm_names(base) -> list[str]:
  """Every arm the study can run: the search arms and the later tiers of any possible choice
  (tier A's: C-F; tier A' (A2)'s: G), and tiers H and N."""
  search = search_arms(base)
  later = [a.name for c in search if c.tier == "A" and c.policy != "full"
           for a in later_arms(c, base)]
  second = [a.name for c in a2_arms() for a in [c, *g_arms(c)]]
  third = [a.name for a in h_arms(base) + n_arms(base)]
  return list(dict.fromkeys([a.name for a in search] + later + second + third))


def parse_tiers(text: str) -> list[str]:
  """--tiers' tiers in order: letters, each optionally followed by digits ("ACFDBE", "A2",
  "A2G", "HN"); an unknown one is named with the valid ones."""
  found = re.findall(r"[A-Z]\d*|.", text)
  for tier in found:
    if tier not in TIERS:
      raise SystemExit(f"--tiers: unknown tier {tier!r} in {text!r}; valid tiers: "
                       f"{', '.join(TIERS)} (A2 is tier A')")
  return found


def parse_arms(text: str, base) -> list[str]:
  """--arms' names, each checked against `arm_names` (an unknown one is named with the
  nearest valid ones)."""
  names = [n for n in text.split(",") if n]
  valid = arm_names(base)
  for name in names:
    if name not in valid:
      raise SystemExit(f"--arms: unknown arm {name!r}; {registry.did_you_mean(name, valid)}"
                       f"valid arms: {', '.join(valid)}")
  return names


def parse_seeds(text: str, tier_seeds: set[int]) -> set[int]:
  """--seeds' seeds; one that is not an integer, or that none of the chosen tiers runs, is
  named with the seeds they run."""
  valid = ", ".join(map(str, sorted(tier_seeds)))
  seeds = set()
  for item in (t.strip() for t in text.split(",")):
    if not item:
      continue
    if not re.fullmatch(r"\d+", item) or int(item) not in tier_seeds:
      raise SystemExit(f"--seeds: {item!r} is not a seed of the tiers chosen; their seeds: "
                       f"{valid}")
    seeds.add(int(item))
  return seeds


def run_overrides(arm: Arm, seed: int) -> dict:
  """An arm's overrides for one seed; a noisy arm draws its label noise from the seed."""
  overrides = {**arm.overrides, "seed": seed}
  if "dataset.label_noise" in overrides:
    overrides["dataset.label_noise_seed"] = seed
  return overrides


def base_config():
  """The long-schedule study's base run; the report's post-hoc table without intervals
  (the frontier reads accuracy only; evaluation settings never change training)."""
  base = long_schedule.base_config()
  base.evaluation.calibrator_resamples = 0
  return base


# ---------------------------------------------------------------------------------------------
# Statistics.


def paired_differences(arm: dict, reference: dict, key: str = "accuracy") -> tuple[list, list]:
  """(seeds, arm - reference per seed) over the seeds both runs finished."""
  seeds = sorted(set(arm["seed_index"]) & set(reference["seed_index"]))
  return seeds, [arm[key][arm["seed_index"][s]] - reference[key][reference["seed_index"][s]]
                 for s in seeds]


def choose(arms: list[Arm], results: dict, tier: str = "A") -> Arm | None:
  """The pre-registered choice: among `tier`'s selecting arms (A; A2: tier A') with at most
  half of full data's passes and all search seeds finished, the highest mean validation
  accuracy (the first listed on a tie). None until every arm of the tier has finished."""
  full = results.get("full")
  candidates = [a for a in arms if a.tier == tier and a.policy != "full"]
  if full is None or any(len(results.get(a.name, {}).get("seed_index", {}))
                         < len(SEARCH_SEEDS) for a in candidates):
    return None
  full_passes = float(np.mean(full["passes"]))
  cheap = [a for a in candidates if np.mean(results[a.name]["passes"]) <= full_passes / 2]
  return max(cheap, key=lambda a: np.mean(results[a.name]["val_accuracy"]), default=None)


def summarise(arms: list[Arm], results: dict) -> dict:
  """Per arm: passes as a share of full data's, accuracies, the paired test against the full
  data run of the same regime and schedule on the same seeds."""
  references = {"C": "full@confirm", "D": "noisy_full@confirm", "E": "full_e30",
                "F": "full@replicate", "G": "full@confirm_g", "H": "full@confirm_h",
                "N": "noisy_full@confirm_n"}
  summary = {}
  for arm in arms:
    r = results.get(arm.name)
    if r is None:
      continue
    reference = results.get(references.get(arm.tier, "full"))
    row = {"policy": arm.policy, "tier": arm.tier, "budget": arm.budget,
           "seeds": sorted(r["seed_index"]), "planned_seeds": len(arm.seeds),
           "accuracy": float(np.mean(r["accuracy"])),
           "accuracy_sd": float(np.std(r["accuracy"], ddof=1)) if len(r["accuracy"]) > 1 else 0.0,
           "val_accuracy": float(np.mean(r["val_accuracy"])),
           "ece": float(np.mean(r["ece"])),
           "passes": float(np.mean(r["passes"]))}
    if reference is not None:
      row["passes_share"] = row["passes"] / float(np.mean(reference["passes"]))
      row.update(costs(r, reference))
      if reference is not r:
        seeds, d = paired_differences(r, reference)
        test = tost(d)
        row["vs_full"] = {**test, "seeds": seeds, "lossless": lossless(test)}
    summary[arm.name] = row
  return summary


SEARCH_TIERS = ("A", "A2", "B")  # The tiers on seeds 0-2 beside full data's seeds 0-2.


def frontier_answers(summary: dict) -> dict:
  """For each policy: the largest saving (1 - passes share) at which it is lossless on the
  search seeds (all of 0-2: an arm short of them does not count yet), or None."""
  out = {}
  for name, row in summary.items():
    if row["tier"] not in SEARCH_TIERS or "vs_full" not in row:
      continue
    out.setdefault(row["policy"], None)
    if len(row["seeds"]) < row["planned_seeds"]:
      continue
    best = out.get(row["policy"])
    saving = 1 - row["passes_share"]
    if row["vs_full"]["lossless"] and (best is None or saving > best["saving"]):
      out[row["policy"]] = {"arm": name, "saving": saving}
    out.setdefault(row["policy"], None)
  return out


def smallest_not_worse(summary: dict) -> dict:
  """For each policy, over the search tiers (A, A', B; seeds 0-2): the arm with the smallest share
  of full data's passes that is *not shown worse* than full data (the 90 % t interval of the
  paired difference reaches 0 or above), or None; and the arms shown equivalent by the TOST.
  An arm short of seeds 0-2 is listed under `incomplete` (name, seeds run) and counts for
  neither, so that a policy's answer never rests on a part of its seeds."""
  out = {}
  for name, row in summary.items():
    if row["tier"] not in SEARCH_TIERS or "vs_full" not in row:
      continue
    entry = out.setdefault(row["policy"], {"not_worse": None, "equivalent": [], "incomplete": []})
    if len(row["seeds"]) < row["planned_seeds"]:
      entry["incomplete"].append((name, len(row["seeds"])))
      continue
    vs = row["vs_full"]
    if np.isfinite(vs["high"]) and vs["high"] >= 0:
      best = entry["not_worse"]
      if best is None or row["passes_share"] < best["passes_share"]:
        entry["not_worse"] = {"arm": name, "passes_share": row["passes_share"]}
    if vs["equivalent"]:
      entry["equivalent"].append(name)
  return out


def _verdict_arms(chosen: Arm) -> tuple:
  """The chosen arm's later tiers: (verdict key, arm name, the seeds that complete it)."""
  return (("untouched", f"{chosen.name}@confirm", CONFIRM_SEEDS),
          ("replicate", f"{chosen.name}@replicate", REPLICATE_SEEDS),
          ("noisy", f"noisy_{chosen.name}@confirm", CONFIRM_SEEDS),
          ("epochs_30", f"{chosen.name}_e30", SEARCH_SEEDS))


def pooled_test(results: dict, pairs: list[tuple[str, str]]) -> dict | None:
  """The TOST on the per-seed differences of several (arm, reference) pairs pooled; seeds are
  distinct across the pairs (tiers C and F: 3-7 and 8-12)."""
  seeds, d = [], []
  for arm, reference in pairs:
    if arm in results and reference in results:
      s, diff = paired_differences(results[arm], results[reference])
      seeds += s
      d += diff
  if not seeds:
    return None
  return {**tost(d), "seeds": seeds}


def test_image_intervals(results: dict, arm: str, reference: str, seeds) -> dict:
  """A paired bootstrap over the test images (the same resampled images for both runs of a
  seed, and for every seed): the 90 % interval of the seed-mean difference in test accuracy
  over `seeds`, and of each seed's own difference. The test set's sampling uncertainty,
  beside the seed interval (which measures initialisation and data order)."""
  a, r = results[arm], results[reference]
  if "correct" not in a or "correct" not in r or not len(seeds):
    return {}  # No paired seed yet (e.g. one worker's arm before its full-data run).
  interval = long_schedule.test_interval
  per_seed = {int(s): [float(a["accuracy"][a["seed_index"][s]]
                             - r["accuracy"][r["seed_index"][s]]),
                       *interval(a, r, [s], "accuracy")] for s in seeds}
  return {"pooled": list(interval(a, r, list(seeds), "accuracy")), "per_seed": per_seed,
          "seeds_and_images": seed_and_image_interval(a, r, list(seeds))}


# The two-level bootstrap's resamples: at 1,000 its interval's ends moved by about 0.01 points
# between generator seeds, at 4,000 by about half that.
TWO_LEVEL_RESAMPLES = 4000


def seed_and_image_interval(arm: dict, reference: dict, seeds: list, rng_seed: int = 0
                            ) -> list[float]:
  """A two-level paired bootstrap of the seed-mean difference in test accuracy: each of
  TWO_LEVEL_RESAMPLES resamples draws the test images with replacement (the same images
  for both runs of a seed and for every seed) and then the seeds with replacement, so that its
  90 % percentile interval holds both the seeds' spread and the test set's own sampling (the
  seed interval holds the first, `test_image_intervals`' pooled interval the second)."""
  d = np.array([np.asarray(arm["correct"][arm["seed_index"][s]], np.float64)
                - np.asarray(reference["correct"][reference["seed_index"][s]], np.float64)
                for s in seeds])  # [seeds, images]
  rng = np.random.default_rng(rng_seed)
  means = np.empty(TWO_LEVEL_RESAMPLES)
  for b in range(len(means)):
    per_seed = d[:, rng.integers(0, d.shape[1], d.shape[1])].mean(1)
    means[b] = per_seed[rng.integers(0, len(seeds), len(seeds))].mean()
  tail = (1 - long_schedule.CONFIDENCE) / 2
  return [float(q) for q in np.quantile(means, [tail, 1 - tail])]


def verdicts(summary: dict, chosen: Arm | None, results: dict | None = None) -> dict:
  """The chosen arm's later tiers against full data of the same regime and seeds: C
  (untouched seeds 3-7: the lossless-at-half verdict), F (its replication on seeds 8-12),
  C and F pooled (seeds 3-12), D (per-seed label noise), E (30 epochs). Each with its seeds,
  saving in passes, paired TOST and whether it is complete; C's, F's and the pooled
  `met`: complete, lossless and at least 50 % fewer passes. With `results` (per-image
  correctness), each clean tier also gets the test images' paired bootstrap interval."""
  if chosen is None:
    return {}
  out = {}
  for key, name, seeds in _verdict_arms(chosen):
    row = summary.get(name)
    if row is None or "vs_full" not in row:
      continue
    vs = row["vs_full"]
    out[key] = {"arm": name, "seeds": vs["seeds"], "complete": tuple(vs["seeds"]) == seeds,
                "saving": 1 - row["passes_share"],
                "saving_with_evaluation": 1 - row.get("passes_share_with_evaluation", math.nan),
                **vs}
  test = pooled_test(results or {}, [(f"{chosen.name}@confirm", "full@confirm"),
                                     (f"{chosen.name}@replicate", "full@replicate")])
  if test is not None and "untouched" in out and "replicate" in out:
    out["pooled"] = {"arm": f"{chosen.name}@confirm + @replicate", **test,
                     "complete": tuple(test["seeds"]) == CONFIRM_SEEDS + REPLICATE_SEEDS,
                     "saving": out["untouched"]["saving"], "lossless": lossless(test),
                     "saving_with_evaluation": out["untouched"]["saving_with_evaluation"]}
  for key in ("untouched", "replicate", "pooled"):
    if key in out:
      v = out[key]
      v["met"] = bool(v["complete"] and v["lossless"] and v["saving"] >= 0.5)
  if results:
    tiers = {"untouched": ("@confirm",), "replicate": ("@replicate",),
             "pooled": ("@confirm", "@replicate")}
    for key, suffixes in tiers.items():
      if key in out:
        arm = _merged(results, [f"{chosen.name}{x}" for x in suffixes])
        reference = _merged(results, [f"full{x}" for x in suffixes])
        out[key]["test_images"] = test_image_intervals({"arm": arm, "full": reference}, "arm",
                                                       "full", out[key]["seeds"])
  return out


def _merged(results: dict, names: list[str]) -> dict:
  """The per-seed results of several arms with distinct seeds as one (tiers C and F)."""
  out = {"seed_index": {}}
  for name in names:
    r = results.get(name, {"seed_index": {}})
    for seed, i in r["seed_index"].items():
      out["seed_index"][seed] = len(out["seed_index"])
      for key in ("accuracy", "correct"):
        if key in r:
          out.setdefault(key, []).append(r[key][i])
  return out


def _outcome(v: dict, short: bool = False) -> str:
  """What a verdict's test shows: lossless or not and, where the 90 % interval excludes 0,
  on which side of full data the arm is (`short`: without the reasons, for the figure); for
  tier N's superiority test, better or not."""
  if "superior" in v:
    return ("better" if v["superior"] else "below full data" if v["high"] < 0
            else "not shown better")
  if v["low"] > 0:  # Better than full data is not equivalent to it: say which way it fails.
    return "above full data" + ("" if short else ": its 90 % interval excludes 0 (better, so "
                                                 "not equivalent)")
  why = ("lossless" if v["lossless"] else "not lossless" if short or not v["equivalent"]
         else "not lossless: mean below -0.1")
  if v["high"] < 0:
    why += ", below full data" if short else "; below full data: its 90 % interval excludes 0"
  return why


def _saving_text(v: dict) -> str:
  """'52 % fewer passes', and with evaluation's passes counted where the records tell them."""
  text = f"{100 * v['saving']:.0f} % fewer passes"
  with_evaluation = v.get("saving_with_evaluation", math.nan)
  if np.isfinite(with_evaluation):
    text += f" ({100 * with_evaluation:.1f} % fewer with evaluation's passes counted)"
  return text


def _images_text(images: dict) -> str:
  """The test images' intervals of a verdict: of the mean with the seeds fixed, with the seeds
  resampled too (`seed_and_image_interval`), and of each seed's difference."""
  low, high = images["pooled"]
  both = images.get("seeds_and_images")
  per_seed = "; ".join(f"seed {s}: {_pts(d)} [{_pts(lo)}, {_pts(hi)}]"
                       for s, (d, lo, hi) in images["per_seed"].items())
  return (f". Over test images (paired bootstrap, 90 %): mean [{_pts(low)}, {_pts(high)}]"
          + (f"; seeds and test images resampled together (two-level bootstrap, 90 %): "
             f"[{_pts(both[0])}, {_pts(both[1])}]" if both else "") + f"; {per_seed}")


def _verdict_line(label: str, v: dict) -> str:
  seeds = ",".join(map(str, v["seeds"]))
  status = "" if v["complete"] else " (incomplete: more seeds to run)"
  why = _outcome(v)
  line = (f"- {label}: `{v['arm']}`, {_saving_text(v)}, seeds {seeds}: "
          f"{_pts_interval(v)} points vs full data, "
          f"{equivalence.describe(v)}; {why}{status}")
  if v.get("test_images"):
    line += _images_text(v["test_images"])
  if v.get("earlier_reference"):
    e = v["earlier_reference"]
    line += (f". Its full-data reference here, {100 * v['reference_accuracy']:.2f} %, is "
             f"{100 * (e['accuracy'] - v['reference_accuracy']):.2f} points below the "
             f"long-schedule study's noisy full-data runs ({100 * e['accuracy']:.2f} %, seeds "
             f"{','.join(map(str, e['seeds']))}, one noise draw for every seed)")
  return line


def verdict_lines(found: dict) -> list[str]:
  """The markdown section answering: lossless at >= 50 % fewer passes on untouched seeds?
  Tier C's verdict first, as it was; then its replication (tier F) alone and pooled."""
  lines = ["", "## Lossless at half the passes or fewer, on untouched seeds?", ""]
  if "untouched" not in found:
    return lines + ["Not answered yet: the confirmation runs (tier C) have not finished."]
  u = found["untouched"]
  answer = ("met" if u["met"] else "not decided yet" if not u["complete"] else "missed")
  lines.append(f"**Tier C, seeds 3-7: {answer}.**")
  if "replicate" in found:
    r = found["replicate"]
    again = ("replicated" if r["met"] else "replication not finished" if not r["complete"]
             else "not replicated")
    lines.append(f"Replication on seeds 8-12 (tier F, declared before its runs): **{again}**.")
  labels = {"untouched": "tier C, untouched seeds 3-7, clean labels (the test)",
            "replicate": "tier F, untouched seeds 8-12 (the replication)",
            "pooled": "tiers C and F pooled, seeds 3-12",
            "noisy": "20 % label noise, one noise draw per seed (exploratory: the tier asked "
                     "whether the policy is equivalent to full data; a side of full data read "
                     "from its runs was not declared before them, and only a declared tier can "
                     "confirm it; tier N does. Its full-data runs drew their noise from the "
                     "random stream of epoch 5's order, as the code then did "
                     "(`splits.LABEL_NOISE_STREAM` now keeps them apart), so each trained "
                     "epoch 5 on all the flipped labels first, back to back; the policy's "
                     "runs, on a subset in epoch 5, did not)",
            "epochs_30": "30-epoch schedule (search seeds), vs full data on 30 epochs"}
  return lines + [_verdict_line(labels[k], found[k]) for k in labels if k in found]


def seconds_ratios(results: dict, arm: str, reference: str, seeds) -> dict:
  """Per seed, the arm's seconds over full data's of the same seed, with both runs' machines:
  `wall` (the training process's start to its end; a run resumed after an interruption counts
  its last part only) and `loop` (the loop's scoring + selection + training seconds,
  checkpointed, so a resumed run counts them all). Their geometric means over the seeds whose
  two runs name the same machine (as declared); beside them, `steady_*`: the same over those
  pairs whose two wall clocks are whole (`long_schedule.whole_runs`) and both runs at an even
  pace (EVEN_PACE), each pair flagged `whole` and `even`, as the Time section's rules are."""
  a, r = results[arm], results[reference]
  whole_a, whole_r = long_schedule.whole_runs(a), long_schedule.whole_runs(r)
  per_seed = {}
  for seed in seeds:
    i, j = a["seed_index"][seed], r["seed_index"][seed]
    machines = [run["machine"][k] if "machine" in run else "unknown"
                for run, k in ((a, i), (r, j))]
    per_seed[int(seed)] = {"wall": a["wall_seconds"][i] / r["wall_seconds"][j],
                           "loop": a["compute_seconds"][i] / r["compute_seconds"][j],
                           "machine": machines[0], "full_machine": machines[1],
                           "same_machine": machines[0] == machines[1] != "unknown",
                           "whole": i in whole_a and j in whole_r,
                           "even": "steady_seconds" in a and "steady_seconds" in r
                                   and _even(a, i) and _even(r, j)}
  same = [v for v in per_seed.values() if v["same_machine"]]
  steady = [v for v in same if v["whole"] and v["even"]]
  out = {"per_seed": per_seed, "same_machine_seeds": len(same),
         "steady_seeds": sorted(s for s, v in per_seed.items() if v in steady)}
  for prefix, pairs in (("", same), ("steady_", steady)):
    for key in ("wall", "loop") if pairs else ():
      out[f"{prefix}{key}_geomean"] = float(np.exp(np.mean(np.log([v[key] for v in pairs]))))
  return out


def _new_seed_verdict(summary: dict, name: str, reference: str, seeds: tuple, met,
                      results: dict | None) -> dict:
  """An arm against its full-data reference on declared new seeds: its seeds, saving in
  passes, paired TOST, `lossless` and `met` (`met(verdict)`); with `results`, the test
  images' paired bootstrap and the seconds ratios. {} before its runs."""
  row = summary.get(name)
  if row is None or "vs_full" not in row:
    return {}
  vs = row["vs_full"]
  out = {"arm": name, "seeds": vs["seeds"], "complete": tuple(vs["seeds"]) == seeds,
         "saving": 1 - row["passes_share"], **vs}
  out["met"] = bool(met(out))
  if results:
    out["test_images"] = test_image_intervals(results, name, reference, vs["seeds"])
    out["seconds"] = seconds_ratios(results, name, reference, vs["seeds"])
  return out


def g_verdict(summary: dict, chosen: Arm | None, results: dict | None) -> dict:
  """Tier G: the tier-A' choice against full data on seeds 13-22 (`_new_seed_verdict`), `met`
  when complete, lossless and at least 50 % fewer passes. {} before its runs."""
  name = f"{chosen.name}@confirm_g" if chosen else ""
  return _new_seed_verdict(summary, name, "full@confirm_g", G_SEEDS,
                           lambda v: v["complete"] and v["lossless"] and v["saving"] >= 0.5,
                           results)


def second_search(summary: dict, arms: list[Arm], results: dict) -> dict:
  """The tier-A' choice and tier G's verdict, for the summary; {} while no tier-A' arm has a
  result, so that the summary of the earlier tiers stays as it was."""
  if not any(row["tier"] == "A2" for row in summary.values()):
    return {}
  chosen = choose(arms, results, "A2")
  return {"chosen_a2": chosen.name if chosen else None,
          "verdict_g": g_verdict(summary, chosen, results)}


def _seconds_line(seconds: dict) -> str:
  def flags(v: dict) -> str:
    marks = [m for m, ok in (("resumed", v["whole"]), ("uneven", v["even"])) if not ok]
    return f" ({', '.join(marks)})" if marks else ""
  per_seed = "; ".join(f"seed {s}: {v['wall']:.2f} ({v['loop']:.2f})" + flags(v)
                       + ("" if v["same_machine"] else
                          f" [{v['machine']} vs {v['full_machine']}]")
                       for s, v in seconds["per_seed"].items())
  machines = sorted({v["machine"] for v in seconds["per_seed"].values() if v["same_machine"]})
  mean = (f"geometric mean {seconds['wall_geomean']:.2f} ({seconds['loop_geomean']:.2f}) over "
          f"the {seconds['same_machine_seeds']} pairs run on one machine ({'; '.join(machines)})"
          if seconds["same_machine_seeds"] else "no pair ran on one machine")
  steady = seconds["steady_seeds"]
  if steady:
    mean += (f"; {seconds['steady_wall_geomean']:.2f} ({seconds['steady_loop_geomean']:.2f}) "
             f"over the {len(steady)} of them with whole wall clocks at an even pace (seeds "
             f"{','.join(map(str, steady))}; the Time section's rules)")
  elif seconds["same_machine_seeds"]:
    mean += "; none of them with whole wall clocks at an even pace"
  return (f"- Seconds, the arm's over full data's, wall clock (loop seconds): {mean}. "
          f"Per seed (resumed: a wall clock of a last sitting; uneven: slowed by other work): "
          f"{per_seed}")


def second_lines(summary: dict, second: dict) -> list[str]:
  """The markdown sections of tiers A' and G; none before their runs."""
  if not second:
    return []
  lines = ["", "## Tier A': importance sampling against top-k at half the passes (seeds 0-2)",
           "", "Declared before its runs: importance sampling at two mixes (its loss weights "
           "the inverse inclusion probabilities, self-normalised to mean 1 over an epoch and "
           "clipped at 10), top-k with the 2-epoch "
           "finish at 50 % of the passes and InfoBatch at r = 0.95 without its loss weight, "
           "each paired with full data on seeds 0-2; the choice is tier A's rule applied to "
           "these arms.", ""]
  for name, row in summary.items():
    if row["tier"] == "A2" and "vs_full" in row:
      vs = row["vs_full"]
      lines.append(f"- `{name}`: {100 * row['passes_share']:.1f} % of the passes, validation "
                   f"{100 * row['val_accuracy']:.2f} %, test {_pts_interval(vs)} points vs full "
                   f"data, {equivalence.describe(vs)} (seeds {','.join(map(str, row['seeds']))})")
  chosen = second["chosen_a2"]
  lines += ["", f"Chosen: `{chosen}` (highest mean validation accuracy among the arms of "
            "tier A' at no more than half of full data's passes)." if chosen else
            "Not chosen yet: tier A' has not finished.",
            "", "## Tier G: the tier-A' choice on 10 new seeds (13-22)", ""]
  g = second["verdict_g"]
  if not g:
    return lines + ["Not answered yet: tier G has not run."]
  answer = "met" if g["met"] else "not decided yet" if not g["complete"] else "missed"
  lines += [f"**Lossless at half the passes or fewer: {answer}.**",
            _verdict_line("tier G, seeds 13-22", g)]
  if g.get("seconds"):
    lines.append(_seconds_line(g["seconds"]))
  return lines


# ---------------------------------------------------------------------------------------------
# Tiers H and N, declared before any of their runs.


def h_candidates(summary: dict) -> list[dict]:
  """Tier H's candidates: the search tiers' (A, A', B) arms with all of seeds 0-2 beside full
  data's and at H_PASSES[0] to H_PASSES[1] of full data's passes, each with its share, paired
  mean difference, TOST p and whether its mean is at least MIN_MEAN (`kept`), in the
  summary's order."""
  out = []
  for name, row in summary.items():
    vs = row.get("vs_full")
    if (row["tier"] in SEARCH_TIERS and vs and vs["seeds"] == list(SEARCH_SEEDS)
        and H_PASSES[0] <= row["passes_share"] <= H_PASSES[1]):
      out.append({"arm": name, "passes_share": row["passes_share"], "mean": vs["mean"],
                  "low": vs["low"], "high": vs["high"], "p": vs["p"],
                  "kept": bool(vs["mean"] >= MIN_MEAN)})
  return out


def choose_h(summary: dict) -> str | None:
  """Tier H's rule, declared before its runs: among `h_candidates` with a mean paired
  difference of at least MIN_MEAN (-0.1 points), the smallest TOST p; on a tie the smaller
  share of passes (the larger saving), then the first name in sorted order. None without one."""
  kept = [(c["p"], c["passes_share"], c["arm"]) for c in h_candidates(summary)
          if c["kept"] and np.isfinite(c["p"])]
  return min(kept)[2] if kept else None


def h_verdict(summary: dict, results: dict | None) -> dict:
  """Tier H: H_CHOICE against full data on seeds 23-32 (`_new_seed_verdict`), `met` when all
  10 seeds ran and it is lossless (at whatever saving it has). {} before its runs."""
  return _new_seed_verdict(summary, f"{H_CHOICE}@confirm_h", "full@confirm_h", H_SEEDS,
                           lambda v: v["complete"] and v["lossless"], results)


def n_verdict(summary: dict, results: dict | None) -> dict:
  """Tier N: N_DESIGN against full data on the same noisy labels, seeds 23-32: the one-sided
  superiority test (`equivalence.superiority`) on the paired differences, `better` when all 10
  seeds ran and its 90 % t interval lies above 0; the test images' paired bootstrap and the
  seconds ratios beside it. {} before its runs."""
  name, reference = f"noisy_{N_DESIGN}@confirm_n", "noisy_full@confirm_n"
  row = summary.get(name)
  if row is None or "vs_full" not in row or not results:
    return {}
  seeds, d = paired_differences(results[name], results[reference])
  out = {"arm": name, "seeds": seeds, "complete": tuple(seeds) == N_SEEDS,
         "saving": 1 - row["passes_share"], **equivalence.superiority(d)}
  out["better"] = bool(out["complete"] and out["superior"])
  out["test_images"] = test_image_intervals(results, name, reference, seeds)
  out["seconds"] = seconds_ratios(results, name, reference, seeds)
  return out


def declared_tiers(summary: dict, results: dict | None) -> dict:
  """Tiers H and N for the summary: H's declared pick, the rule applied to the summary's
  search rows (None without them), its candidates and verdict; N's arm and verdict."""
  return {"tier_h": {"declared_choice": H_CHOICE, "rule_choice": choose_h(summary),
                     "candidates": h_candidates(summary),
                     "verdict": h_verdict(summary, results)},
          "tier_n": {"arm": f"noisy_{N_DESIGN}@confirm_n", "verdict": n_verdict(summary, results)}}


def _state(v: dict, done: str, seeds: tuple) -> str:
  """'not run yet', 'not decided yet (k of n seeds)' or `done`."""
  if not v:
    return "not run yet"
  return done if v["complete"] else f"not decided yet ({len(v['seeds'])} of {len(seeds)} seeds)"


def _superiority_line(label: str, v: dict) -> str:
  """Tier N's verdict line: its interval, the one-sided test, which side of full data."""
  seeds = ",".join(map(str, v["seeds"]))
  why = ("better: its 90 % interval lies above 0" if v["superior"] else
         "below full data: its 90 % interval lies below 0" if v["high"] < 0 else
         "not shown better: its 90 % interval reaches 0")
  status = "" if v["complete"] else " (incomplete: more seeds to run)"
  p_value = f"one-sided p {v['p']:.3f}" if np.isfinite(v["p"]) else "untested (1 seed)"
  line = (f"- {label}: `{v['arm']}`, {_saving_text(v)}, seeds {seeds}: {_pts_interval(v)} "
          f"points vs full data on the same noisy labels, {p_value}; {why}{status}")
  if v.get("test_images"):
    line += _images_text(v["test_images"])
  return line


def _said(label: str, v: dict, seeds: tuple) -> str:
  """'`arm` on seeds 3-7 (tier C): -0.07 [-0.15, +0.00], lossless', with its seeds so far
  while incomplete."""
  so_far = "" if v["complete"] else f", {len(v['seeds'])} of {len(seeds)} seeds so far"
  return (f"`{v['arm']}` on seeds {seeds[0]}-{seeds[-1]} ({label}{so_far}): {_pts_interval(v)}, "
          + _outcome(v, short=True))


def headline_lines(summary: dict, found: dict, second: dict, declared: dict) -> list[str]:
  """The summary's headline: the current answer of each declared question. Lossless at half
  the passes: shown when the latest test of a design (tier C's pooled with its replication F,
  or tier G) is met; not shown when all of them are complete and none is met. Then tier H's
  and tier N's verdicts, or that they have not run."""
  lines = ["", "## The answer so far, across the declared tiers", ""]
  tests = [(key, label, seeds) for key, label, seeds in
           (("untouched", "tier C", CONFIRM_SEEDS),
            ("replicate", "tier F, its replication", REPLICATE_SEEDS),
            ("pooled", "tiers C and F", CONFIRM_SEEDS + REPLICATE_SEEDS)) if key in found]
  said = [_said(label, found[key], seeds) for key, label, seeds in tests]
  current = [found["pooled"] if "pooled" in found else found[tests[0][0]]] if tests else []
  g = (second or {}).get("verdict_g")
  if g:
    said.append(_said("tier G", g, G_SEEDS))
    current.append(g)
  word = ("not answered yet" if not current else "shown" if any(v["met"] for v in current)
          else "not shown" if all(v["complete"] for v in current) else "not decided yet")
  lines.append(f"- Lossless at half the passes or fewer (tiers C, F and G): **{word}**"
               + (". " + "; ".join(said) if said else ""))
  h, searched = declared["tier_h"]["verdict"], summary.get(H_CHOICE, {}).get("vs_full")
  pick = f"`{H_CHOICE}`" + (
      f", {100 * summary[H_CHOICE]['passes_share']:.1f} % of the passes, chosen on seeds 0-2 "
      f"where it was {_pts_interval(searched)} (TOST p {searched['p']:.3f})" if searched else "")
  done = ("missed" if not h or not h["met"] else
          f"lossless at {100 * h['saving']:.0f} % fewer passes")
  lines.append(f"- The largest lossless saving (tier H, {pick}): "
               f"**{_state(h, done, H_SEEDS)}**"
               + (f". {_said('tier H', h, H_SEEDS)}" if h else ""))
  n = declared["tier_n"]["verdict"]
  done = "better" if n and n["better"] else "not shown better"
  text = (f"- Selection under 20 % label noise (tier N, `{N_DESIGN}`): "
          f"**{_state(n, done, N_SEEDS)}**")
  if n:
    text += (f". `{n['arm']}` on seeds 23-32: {_pts_interval(n)} vs full data on the same "
             f"noisy labels, one-sided p {n['p']:.3f}")
  if "noisy" in found:
    text += (f"; tier D's {_pts_interval(found['noisy'])} on seeds 3-7 was exploratory, against "
             "a full-data reference that trained the flipped labels first in epoch 5 (tier D "
             "below)")
  return lines + [text]


def declared_lines(declared: dict) -> list[str]:
  """The markdown sections of tiers H and N: the rule and its candidates, then each verdict
  or that it has not run."""
  h, n = declared["tier_h"], declared["tier_n"]
  lines = ["", "## Tier H: the largest lossless saving, on 10 new seeds (23-32)", "",
           "Declared before its runs: among the search tiers' arms (A, A', B) with all of seeds "
           f"0-2 at {100 * H_PASSES[0]:.0f} to {100 * H_PASSES[1]:.0f} % of full data's passes "
           f"whose mean paired difference from full data is at least {100 * MIN_MEAN:+.1f} "
           "points, the smallest TOST p (ties: the smaller share of passes, then the name); "
           "the pick and full data then run on seeds 23-32. Lossless: the TOST at "
           f"±{100 * MARGIN:.1f} points passes (p < {ALPHA}) and the mean is at least "
           f"{100 * MIN_MEAN:+.1f} points, on all 10 seeds.", ""]
  for c in h["candidates"]:
    lines.append(f"- `{c['arm']}`: {100 * c['passes_share']:.1f} % of the passes, "
                 f"{_pts_interval(c)} points vs full data (TOST p {c['p']:.3f})"
                 + ("" if c["kept"] else "; mean below -0.1, not a candidate"))
  rule = h["rule_choice"]
  lines += ["", f"Declared pick: `{h['declared_choice']}`; the rule on this summary's records: "
            + (f"`{rule}`." if rule else "no search record here.")]
  v = h["verdict"]
  done = "missed" if not v or not v["met"] else f"met, {100 * v['saving']:.0f} % fewer passes"
  lines += ["", f"**Lossless on seeds 23-32: {_state(v, done, H_SEEDS)}.**"]
  if v:
    lines.append(_verdict_line("tier H, seeds 23-32", v))
    if v.get("seconds"):
      lines.append(_seconds_line(v["seconds"]))
  lines += ["", "## Tier N: selection under 20 % label noise, on 10 new seeds (23-32)", "",
            f"Declared before its runs: `{N_DESIGN}` (tier D's design) and full data, "
            f"{100 * NOISE:.0f} % of the training labels flipped uniformly to another class, "
            "each seed its own noise draw (the seed); better: on all 10 seeds the 90 % t "
            "interval of the mean paired difference lies above 0 (a one-sided t-test at "
            f"{ALPHA}).", ""]
  v = n["verdict"]
  done = "better" if v and v["better"] else "not shown better"
  lines.append(f"**Better than full data under label noise: {_state(v, done, N_SEEDS)}.**")
  if v:
    lines.append(_superiority_line("tier N, seeds 23-32", v))
    if v.get("seconds"):
      lines.append(_seconds_line(v["seconds"]))
  return lines


# ---------------------------------------------------------------------------------------------
# Costs beside the passes: evaluation's passes, the kept share, wall-clock.

# The validation images each evaluation passes beside the test images: the base config's
# dataset.val_size (a test checks it); a record holds only its test images' correctness.
VAL_IMAGES = 6000
# A run at an even pace: its training + scoring + selection seconds within 5 % of its steady
# seconds (long_schedule.steady_seconds: its epochs at their lower-quartile speed per step),
# i.e. no part of it much slowed by other work on the machine.
EVEN_PACE = 1.05
# What a run's record holds of its time (long_schedule._run_row, grid.run_cell).
TIME_KEYS = ("machine", "wall_seconds", "compute_seconds", "steady_seconds", "training_seconds",
             "scoring_seconds", "selection_seconds")


def evaluation_passes(r: dict) -> float | None:
  """Mean forward passes of an arm's evaluations: each evaluated epoch (its curve's, the last
  one's being the report's) passes the validation and the test images once. None without
  curves."""
  if "curve_epoch" not in r or "correct" not in r:
    return None
  return float(np.mean([len(e) * (VAL_IMAGES + len(c))
                        for e, c in zip(r["curve_epoch"], r["correct"])]))


def costs(r: dict, reference: dict) -> dict:
  """An arm's costs beside its training and scoring passes, from what its records hold: its
  evaluation's passes and its share of full data's passes with them counted; its seconds
  (`run_times`) and its time over full data's, paired per seed (`time_pairs`)."""
  out = {}
  evaluated = evaluation_passes(r), evaluation_passes(reference)
  if None not in evaluated:
    out["evaluation_passes"] = evaluated[0]
    out["passes_share_with_evaluation"] = float(
        (np.mean(r["passes"]) + evaluated[0]) / (np.mean(reference["passes"]) + evaluated[1]))
  if all(key in run for key in TIME_KEYS for run in (r, reference)):
    pairs = {} if reference is r else time_pairs(r, reference)
    out["time"] = {**run_times(r), "pairs": pairs, **mean_ratios(pairs)}
  return out


def _even(r: dict, i: int) -> bool:
  return r["compute_seconds"][i] <= EVEN_PACE * r["steady_seconds"][i]


def run_times(r: dict) -> dict:
  """The machines an arm's runs trained on, and mean seconds over its runs with a whole wall
  clock (`long_schedule.whole_runs`): wall clock, training, scoring + selection, and the rest
  of the wall clock (evaluation, compiling, data loading and the report)."""
  keep = long_schedule.whole_runs(r)
  mean = {key: float(np.mean([r[key][i] for i in keep])) if keep else math.nan
          for key in ("wall_seconds", "training_seconds", "scoring_seconds",
                      "selection_seconds", "compute_seconds")}
  return {"machines": sorted(set(r["machine"])),
          "whole_seeds": sorted(s for s, i in r["seed_index"].items() if i in keep),
          "wall": mean["wall_seconds"], "training": mean["training_seconds"],
          "scoring": mean["scoring_seconds"] + mean["selection_seconds"],
          "rest": mean["wall_seconds"] - mean["compute_seconds"]}


def time_pairs(r: dict, reference: dict) -> dict:
  """Per seed both ran, where both trained on the same machine (None where not: processors
  differ in speed): the arm's wall clock over full data's (None where either wall clock is a
  last sitting's, `long_schedule.whole_runs`), its training + scoring + selection seconds over
  full data's, and whether both ran at an even pace (EVEN_PACE)."""
  out = {}
  for seed in sorted(set(r["seed_index"]) & set(reference["seed_index"])):
    i, j = r["seed_index"][seed], reference["seed_index"][seed]
    if r["machine"][i] != reference["machine"][j]:
      out[seed] = None
      continue
    whole = i in long_schedule.whole_runs(r) and j in long_schedule.whole_runs(reference)
    out[seed] = {"machine": r["machine"][i],
                 "wall": r["wall_seconds"][i] / reference["wall_seconds"][j] if whole else None,
                 "compute": r["compute_seconds"][i] / reference["compute_seconds"][j],
                 "even": _even(r, i) and _even(reference, j)}
  return out


def mean_ratios(pairs: dict) -> dict:
  """Means over `time_pairs`: the wall-clock ratio over the same-machine pairs with whole wall
  clocks and over those of them at an even pace, and the ratio of training + scoring +
  selection seconds over the same-machine pairs at an even pace (each with its seeds)."""
  same = {s: p for s, p in pairs.items() if p is not None}
  wall = {s: p["wall"] for s, p in same.items() if p["wall"] is not None}
  even = {s: v for s, v in wall.items() if same[s]["even"]}
  def mean(values):
    return float(np.mean(list(values))) if values else math.nan
  return {"wall_ratio": mean(wall.values()), "wall_seeds": sorted(wall),
          "even_wall_ratio": mean(even.values()), "even_seeds": sorted(even),
          "compute_ratio": mean([p["compute"] for p in same.values() if p["even"]]),
          "compute_seeds": sorted(s for s, p in same.items() if p["even"])}


def kept_schedule(arm: Arm, base) -> dict:
  """What an arm trains on, from its config: its selected epochs (0-indexed, first and last),
  the kept fraction in the first and in the last of them (InfoBatch's follows the losses:
  None) and the epochs on all data after them. {} for an arm that selects nothing."""
  config = grid.apply(base, arm.overrides)
  s = config.selection
  if s.method == "full":
    return {}
  if s.method == "infobatch":
    after = config.num_epochs - subsets.anneal_start(config.num_epochs, s.anneal_fraction)
    kept = None
  else:
    after = s.final_full_epochs
    kept = [s.fraction, s.fraction if s.fraction_end < 0 else s.fraction_end]
  return {"epochs": [s.warmup_epochs, config.num_epochs - after - 1], "kept": kept,
          "full_after": after}


def mean_kept(schedule: dict, passes: float, full_passes: float) -> float:
  """The mean kept share over the selected epochs that a run's passes imply: (passes - its
  all-data epochs' passes) / (selected epochs x one all-data epoch's passes, full data's over
  its epochs). Within a batch's rounding per epoch; a scoring pass would count as training."""
  first, last = schedule["epochs"]
  epochs, selected = last + 1 + schedule["full_after"], last - first + 1
  per_epoch = full_passes / epochs
  return float((passes - per_epoch * (epochs - selected)) / (selected * per_epoch))


def add_kept(summary: dict, arms: list[Arm], base) -> None:
  """Each summarised arm's `kept_schedule`, in its summary row; an arm whose kept share follows
  the losses (InfoBatch) with the mean its passes imply (`mean_kept`)."""
  for arm in arms:
    row = summary.get(arm.name)
    if row is None:
      continue
    row["kept"] = kept = kept_schedule(arm, base)
    if kept and kept["kept"] is None and "passes_share" in row:
      kept["mean_from_passes"] = mean_kept(kept, row["passes"],
                                           row["passes"] / row["passes_share"])


def earlier_noisy_full(records: str = LONG_RECORDS) -> dict | None:
  """The long-schedule study's noisy full-data runs (one noise draw for every seed), beside
  tier D's reference: their seeds and mean test accuracy; None without their records."""
  paths = {s: long_schedule.record_path(records, "noisy_full", s) for s in SEARCH_SEEDS}
  found = {s: long_schedule.load_record(p)["accuracy"] for s, p in paths.items()
           if os.path.exists(p)}
  if not found:
    return None
  return {"seeds": sorted(found), "accuracy": float(np.mean(list(found.values())))}


# ---------------------------------------------------------------------------------------------
# Outputs.


def _pts(value: float) -> str:
  return "—" if value is None or not np.isfinite(value) else f"{100 * value:+.2f}"

def _pts_interval(v: dict) -> str:
  """A difference `v` (mean, low, high as fractions) in points: '-0.07 [-0.15, +0.00]'."""
  return f"{_pts(v['mean'])} [{_pts(v['low'])}, {_pts(v['high'])}]"


def _lossless_cell(row: dict) -> str:
  """The table's verdict: none before all of an arm's seeds have run (on 2 seeds the t
  interval is too wide, or of no width when both differences agree)."""
  vs = row.get("vs_full")
  if not vs:
    return "—"
  if len(row["seeds"]) < row["planned_seeds"]:
    return f"not yet ({len(row['seeds'])} of {row['planned_seeds']} seeds)"
  return "yes" if vs["lossless"] else "no"


def _evaluation_sentence(summary: dict) -> str:
  """What 'passes with evaluation' adds, with full data's evaluation passes where known."""
  full = summary.get("full", {}).get("evaluation_passes")
  per_run = (f" ({full:,.0f} in a 20-epoch run; a same-budget run, cut short, evaluates "
             "fewer times)") if full else ""
  return (" Passes with evaluation: the same with each evaluation's forward passes of the "
          f"{VAL_IMAGES:,} validation and the test images counted{per_run}; the rule's "
          "'half the passes' counts training and scoring alone. Kept per selected epoch: from "
          "the arm's config (InfoBatch's follows the losses: the mean its passes imply); "
          "epochs 0-indexed, epoch 0 on all data.")


def _kept_cell(row: dict) -> str:
  """'38.5 % in epochs 1-17, then 2 on all data', 'all data' (`kept_schedule`), or '—'."""
  k = row.get("kept")
  if k is None:
    return "—"
  if not k:
    return "all data, fewer steps" if row["policy"] == "same_budget" else "all data"
  if k["kept"] is None:
    share = f"≈ {100 * k.get('mean_from_passes', math.nan):.1f} % (mean)"
  elif k["kept"][0] == k["kept"][1]:
    share = f"{100 * k['kept'][0]:.1f} %"
  else:
    share = f"{100 * k['kept'][0]:.1f} → {100 * k['kept'][1]:.1f} %"
  then = f", then {k['full_after']} on all data" if k["full_after"] else ""
  return f"{share} in epochs {k['epochs'][0]}-{k['epochs'][1]}{then}"


def markdown(summary: dict, chosen: Arm | None, command: str, failures: dict,
             results: dict | None = None, second: dict | None = None,
             found: dict | None = None, declared: dict | None = None) -> str:
  """The summary's markdown; `second`: tiers A' and G (`second_search`); `found`: the
  verdicts (else computed from the summary); `declared`: tiers H and N (`declared_tiers`,
  else computed from the summary)."""
  found = found if found is not None else verdicts(summary, chosen, results)
  declared = declared if declared is not None else declared_tiers(summary, results)
  lines = ["# Accuracy-compute frontier (Fashion-MNIST, long schedule)", "",
           f"Command: `{command}`. Test accuracy in per cent; differences in points, paired "
           "per seed against full data of the same regime and schedule; [90 % t interval]; "
           f"TOST: two one-sided t-tests at a ±{100 * MARGIN:.1f}-point margin (p < {ALPHA}: "
           f"equivalent); lossless = equivalent and mean >= {100 * MIN_MEAN:+.1f} points. "
           "Passes: example passes (forward 1, forward + backward 3, scoring included) as a "
           "share of full data's." + _evaluation_sentence(summary),
           *headline_lines(summary, found, second or {}, declared), "", "## Every arm", "",
           "| arm | tier | seeds | passes | passes with evaluation | kept per selected epoch "
           "| test acc | val acc | vs full | TOST p | lossless |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, row in summary.items():
    vs = row.get("vs_full")
    cells = [name, row["tier"], ",".join(map(str, row["seeds"])),
             f"{100 * row.get('passes_share', math.nan):.1f} %",
             f"{100 * row.get('passes_share_with_evaluation', math.nan):.1f} %",
             _kept_cell(row),
             f"{100 * row['accuracy']:.2f} ± {100 * row['accuracy_sd']:.2f}",
             f"{100 * row['val_accuracy']:.2f}",
             f"{_pts(vs['mean'])} [{_pts(vs['low'])}, {_pts(vs['high'])}]" if vs else "—",
             f"{vs['p']:.3f}" if vs and np.isfinite(vs["p"]) else "—",
             _lossless_cell(row)]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "## Largest lossless saving per policy (search seeds 0-2)", ""]
  for policy, best in frontier_answers(summary).items():
    lines.append(f"- {policy}: " + (f"{100 * best['saving']:.0f} % fewer passes ({best['arm']})"
                                    if best else "not lossless at any budget run"))
  lines += ["", "## Smallest share of passes not shown worse than full data (search seeds 0-2)",
            "", "Not shown worse: the 90 % t interval of the paired difference reaches 0. That "
            "is not equivalence; the arms shown equivalent (TOST) are named after it.", ""]
  for policy, entry in smallest_not_worse(summary).items():
    best = entry["not_worse"]
    where = (f"{100 * best['passes_share']:.1f} % of the passes ({best['arm']})" if best
             else "worse than full data at every budget run on all of seeds 0-2")
    same = ", ".join(entry["equivalent"]) or "none"
    running = "".join(f"; not counted yet: {name} ({n} of {len(SEARCH_SEEDS)} seeds)"
                      for name, n in entry["incomplete"])
    lines.append(f"- {policy}: {where}; shown equivalent: {same}{running}")
  lines += ["", "## The chosen policy", "",
            (f"`{chosen.name}` (highest mean validation accuracy among tier A's arms at no more "
             "than half of full data's passes)." if chosen else
             "Not chosen yet: tier A has not finished.")]
  lines += verdict_lines(found)
  lines += second_lines(summary, second or {})
  lines += declared_lines(declared)
  lines += time_lines(summary)
  if failures:
    lines += ["", "## Failed runs", ""] + [f"- {k}: {v}" for k, v in failures.items()]
  return "\n".join(lines) + "\n"


def _seconds(value: float) -> str:
  return "—" if not np.isfinite(value) else f"{value:.0f}"


def _mean_with_seeds(value: float, seeds: list) -> str:
  """'0.52 (seeds 3,4,5)', or '—' over no seed."""
  if not seeds:
    return "—"
  return f"{value:.2f} (seed{'s' * (len(seeds) > 1)} {','.join(map(str, seeds))})"


def _ratio_cells(t: dict) -> list[str]:
  """Per seed: the wall-clock ratio, or why there is none; the means (`mean_ratios`)."""
  per_seed = []
  for seed, p in t["pairs"].items():
    why = ("other machine" if p is None else "resumed" if p["wall"] is None
           else f"{p['wall']:.2f}" + ("" if p["even"] else " (uneven)"))
    per_seed.append(f"{seed}: {why}")
  if not t["pairs"]:
    return ["—"] * 4
  return ["; ".join(per_seed),
          f"{t['wall_ratio']:.2f}" if t["wall_seeds"] else "—",
          _mean_with_seeds(t["even_wall_ratio"], t["even_seeds"]),
          _mean_with_seeds(t["compute_ratio"], t["compute_seeds"])]


def time_lines(summary: dict) -> list[str]:
  """The wall-clock section: each arm's seconds (`run_times`) and its time over full data's
  (`time_pairs`, `mean_ratios`), the machines named below the table."""
  rows = {name: row["time"] for name, row in summary.items() if "time" in row}
  if not rows:
    return []
  machines = list(dict.fromkeys(m for t in rows.values() for m in t["machines"]))
  label = {m: f"M{i + 1}" for i, m in enumerate(machines)}
  lines = ["", "## Time", "",
           "Seconds as each run's record holds them, means over its runs with a whole wall "
           "clock. Wall: the run's `train.train_and_evaluate`, start to report "
           "(`studies.grid.run_cell`); "
           "training and scoring + selection: the loop's phase seconds, summed over sittings; "
           "rest: wall minus those (evaluation, compiling, data loading, the report). A "
           "resumed run's wall clock is its last sitting's alone: a run whose wall clock is "
           "below its phase seconds counts as resumed and is left out of the wall columns (a "
           "resume whose last sitting was the longer part is not told apart). Ratios: the "
           "arm's over full data's of the same tier and seed, only where both trained on the "
           "same machine (as recorded); uneven: either run's phase seconds more than "
           f"{100 * (EVEN_PACE - 1):.0f} % above its steady seconds (its epochs at their "
           "lower-quartile speed), i.e. slowed by other work; phase seconds / full's: the mean "
           "over the pairs at an even pace. Some sittings shared the machine with other work, "
           "so only ratios of one seed on one machine compare. A machine string names a kind "
           "of machine, not a sitting, and this kind's speed varied between sittings: full "
           "data's seeds 0-2 (tiers A and B's reference) are the long-schedule study's runs, "
           "from other sittings than this study's own tier-A and tier-B arms, so those ratios "
           "compare sittings as much as policies; tiers C to F ran each seed's arm beside its "
           "full-data run (seed by seed).", "",
           "| arm | machines | whole runs | wall s | training s | scoring + selection s | rest s "
           "| wall / full's, per seed | mean | at an even pace | phase seconds / full's, even "
           "pace |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, t in rows.items():
    cells = [name, ", ".join(label[m] for m in t["machines"]),
             ",".join(map(str, t["whole_seeds"])) or "—",
             *(_seconds(t[k]) for k in ("wall", "training", "scoring", "rest")),
             *_ratio_cells(t)]
    lines.append("| " + " | ".join(cells) + " |")
  return lines + ["", "Machines: " + "; ".join(f"{label[m]}: {m}" for m in machines) + "."]


def _mean_interval(values) -> tuple[float, float]:
  """(mean, half-width of the 90 % t interval of the mean) of per-seed values; 0 for one."""
  v = np.asarray(values, np.float64)
  if len(v) < 2:
    return float(v.mean()), 0.0
  return float(v.mean()), float(stats.t.ppf(1 - ALPHA, len(v) - 1)
                                * v.std(ddof=1) / math.sqrt(len(v)))


# How far below full data each panel reaches, in points. An arm far below (InfoBatch at
# r = 0.95, about -10) would otherwise squash the arms near 0 that the figure is for: it is
# marked at the panel's floor with its numbers instead.
FIGURE_FLOOR = 3.0


def plot_frontier(arms: list[Arm], results: dict, summary: dict, path: str,
                  found: dict | None = None) -> None:
  """Writes `draw_frontier`'s figure to `path`."""
  fig = draw_frontier(arms, results, summary, found)
  fig.savefig(path, dpi=100)
  plt.close(fig)


def draw_frontier(arms: list[Arm], results: dict, summary: dict,
                  found: dict | None = None) -> plt.Figure:
  """Left: test accuracy against the share of full data's passes, one line per policy (mean
  over seeds 0-2, bars: the 90 % t interval of that mean), full data as a band (its 90 %
  interval). Right: each arm's paired difference from full data on the same seeds with its
  90 % t interval (the TOST's interval) and the ±0.2-point equivalence margin; an arm whose
  bar reaches 0 is not shown worse, one whose bar lies inside the margin is equivalent. Both
  panels stop `FIGURE_FLOOR` points below full data; an arm below that is a marker at the
  floor with its numbers. The chosen arm's later tiers (`verdicts`) as text under the panels,
  since they are paired on other seeds or schedules."""
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 7.5))
  full = results.get("full")
  acc_floor = None
  if full is not None:
    mean, half = _mean_interval(100 * np.asarray(full["accuracy"]))
    acc_floor = mean - FIGURE_FLOOR
    ax.axhspan(mean - half, mean + half, color="grey", alpha=0.3,
               label=f"full data (90 % interval, {len(full['accuracy'])} seeds)")
  below = []  # (axis, x, floor, colour, text) of the arms under a panel's floor.
  for i, policy in enumerate(POLICIES + A2_POLICIES):
    # An arm has a share of passes only beside full data's records (not with `--tiers B`
    # alone before tier A has run): without one it has no place on either axis.
    names = sorted((a.name for a in arms if a.policy == policy and a.tier in SEARCH_TIERS
                    and "passes_share" in summary.get(a.name, {})),
                   key=lambda n: summary[n]["passes_share"])
    if not names:
      continue
    colour, style = long_schedule.STYLES[i]
    x = np.array([100 * summary[n]["passes_share"] for n in names])
    acc = [_mean_interval(100 * np.asarray(results[n]["accuracy"])) for n in names]
    ax.errorbar(x, [m for m, _ in acc], yerr=[h for _, h in acc], fmt=style, color=colour,
                marker="o", capsize=3, label=policy)
    for xi, n, (m, h) in zip(x, names, acc):
      if acc_floor is not None and m < acc_floor:
        below.append((ax, xi, acc_floor, colour, f"{n}: {m:.1f} [{m - h:.1f}, {m + h:.1f}] %"))
    vs = [summary[n].get("vs_full") for n in names]
    keep = []
    for j, v in enumerate(vs):
      if not v or not np.isfinite(v["low"]):
        continue
      if 100 * v["mean"] >= -FIGURE_FLOOR:
        keep.append(j)
      else:
        below.append((bx, x[j], -FIGURE_FLOOR, colour, f"{names[j]}: {_pts_interval(v)}"))
    if keep:
      mid = np.array([100 * vs[j]["mean"] for j in keep])
      bx.errorbar(x[keep] + (i - len(POLICIES) / 2) * 0.25, mid,
                  yerr=[mid - [100 * vs[j]["low"] for j in keep],
                        [100 * vs[j]["high"] for j in keep] - mid],
                  fmt="o", color=colour, capsize=3, label=policy)
    for xi, n in zip(x, names):  # A point short of its seeds is preliminary: say so.
      if len(results[n]["accuracy"]) < len(SEARCH_SEEDS):
        ax.annotate(f"{len(results[n]['accuracy'])} seed", (xi, acc[names.index(n)][0]),
                    xytext=(4, -10), textcoords="offset points", fontsize=7, color=colour)
  for axis in (ax, bx):
    axis.axvline(50, color="black", linestyle=":", linewidth=1)
    axis.set_xlim(20, 102)
    axis.set_xlabel("example passes, % of full data's (scoring included)")
    axis.grid(alpha=0.3)
  bx.axhline(0, color="black", linewidth=1)
  bx.axhspan(-100 * MARGIN, 100 * MARGIN, color="green", alpha=0.08,
             label=f"equivalence margin ±{100 * MARGIN:.1f}")
  if acc_floor is not None:
    ax.set_ylim(bottom=acc_floor - 0.3)
  bx.set_ylim(bottom=-FIGURE_FLOOR - 0.3)
  for axis, xi, floor, colour, text in below:
    axis.plot([xi], [floor - 0.15], marker="v", color=colour, markersize=8)
    axis.annotate(f"{text} (below)", (xi, floor - 0.15), xytext=(8, -3),
                  textcoords="offset points", fontsize=7, color=colour)
  ax.set_ylabel("test accuracy % (mean of seeds 0-2, 90 % t interval)")
  bx.set_ylabel("vs full data, points (paired per seed, 90 % t interval)")
  ax.set_title("Fashion-MNIST, small_cnn, 20 epochs: accuracy vs training compute")
  bx.set_title("Paired difference from full data (same seeds)")
  for axis, size, where in ((ax, 8, "lower right"), (bx, 7, "lower right")):
    if axis.get_legend_handles_labels()[0]:  # Nothing to name before any comparable run.
      axis.legend(fontsize=size, loc=where)
  fig.tight_layout()
  if found:
    text = "\n".join(f"{v['arm']} (seeds {','.join(map(str, v['seeds']))}): "
                     f"{_pts_interval(v)} vs full, "
                     + _outcome(v, short=True)
                     for v in found.values())
    fig.subplots_adjust(bottom=0.2)
    fig.text(ax.get_position().x0, 0.01, text, fontsize=8, va="bottom",
             bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "grey"})
  return fig


def note_earlier_reference(found: dict, summary: dict, earlier: dict | None) -> dict:
  """Tier D's verdict with its full-data reference's mean accuracy beside the long-schedule
  study's noisy full-data runs (`earlier_noisy_full`)."""
  if earlier and "noisy" in found and "noisy_full@confirm" in summary:
    found["noisy"].update(reference_accuracy=summary["noisy_full@confirm"]["accuracy"],
                          earlier_reference=earlier)
  return found


def write_outputs(out: str, arms: list[Arm], results: dict, chosen, command: str,
                  failures: dict) -> None:
  summary = summarise(arms, results)
  add_kept(summary, arms, base_config())
  found = note_earlier_reference(verdicts(summary, chosen, results), summary,
                                 earlier_noisy_full())
  second = second_search(summary, arms, results)  # Tiers A' and G; {} before their runs.
  declared = declared_tiers(summary, results)  # Tiers H and N.
  slim = {name: {k: v for k, v in r.items() if k not in ("correct", "confidence")}
          for name, r in results.items()}
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"summary": summary, "frontier": frontier_answers(summary),
               "not_worse": smallest_not_worse(summary),
               "chosen": chosen.name if chosen else None,
               "verdicts": found, "margin": MARGIN, **second, **declared,
               "runs": slim, "failures": failures}, f, indent=1,
              default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(markdown(summary, chosen, command, failures, results, second, found, declared))
  later = {key: v for key, v in (("g", second.get("verdict_g")),
                                 ("h", declared["tier_h"]["verdict"]),
                                 ("n", declared["tier_n"]["verdict"])) if v}
  plot_frontier(arms, results, summary, os.path.join(out, "frontier.png"), {**found, **later})


# ---------------------------------------------------------------------------------------------
# The README's budget table, from a summary.json (studies/results/frontier.json).

README = "README.md"
TABLE_START = ("<!-- The budget table: written from studies/results/frontier.json by python -m "
               "studies.frontier --readme=studies/results/frontier.json; do not edit by hand. -->")
TABLE_END = "<!-- End of the budget table. -->"


def _bracket(pair) -> str:
  return f"[{_pts(pair[0])}, {_pts(pair[1])}]"


def _passes_cell(row: dict) -> str:
  return (f"{100 * row['passes_share']:.1f} % "
          f"({100 * row.get('passes_share_with_evaluation', math.nan):.1f} %)")


def _policy_cell(arm: Arm, row: dict, base) -> str:
  """'`top_k` entropy, 38.5 % kept in epochs 1-17, then 2 on all data (`--config....`;
  the study's `topk_anneal-45`)': what it trains on (`_kept_cell`), how to run it."""
  config = grid.apply(base, arm.overrides)
  flags = " ".join(f"--config.{k}={v}" for k, v in arm.overrides.items()
                   if k.startswith("selection."))
  kept = _kept_cell(row).replace(" in epochs", " kept in epochs", 1)
  return (f"`{config.selection.method}` {config.selection.score}, {kept} (`{flags}`; the "
          f"study's `{arm.name}`)")


def _cost(v: dict, bootstrap: bool = True) -> str:
  """'-0.13 [-0.20, -0.05] (seeds 3-12, TOST p 0.044; with the test images [-0.26, +0.01])',
  the two-level bootstrap's interval where the verdict has it and `bootstrap`."""
  seeds = v["seeds"]
  test = (f"one-sided p {v['p']:.3f}" if "superior" in v else f"TOST p {v['p']:.3f}")
  both = (v.get("test_images") or {}).get("seeds_and_images")
  images = f"; with the test images {_bracket(both)}" if both and bootstrap else ""
  return f"{_pts_interval(v)} (seeds {seeds[0]}-{seeds[-1]}, {test}{images})"


def _time_mean_cell(time: dict) -> str:
  """Tier C's wall-clock ratio (`mean_ratios`: arithmetic means) and its machine."""
  if not time.get("wall_seeds"):
    return "not measured beside full data on one machine"
  even = (f"{time['even_wall_ratio']:.2f} (mean over seeds {','.join(map(str, time['even_seeds']))}"
          f", both runs whole and at an even pace; " if time["even_seeds"] else "(")
  return (f"{even}{time['wall_ratio']:.2f} over seeds {','.join(map(str, time['wall_seeds']))}"
          f" with whole wall clocks) on `{'`, `'.join(time['machines'])}`")


def _time_geomean_cell(v: dict) -> str:
  """A new-seed tier's wall-clock ratio (`seconds_ratios`: geometric means) and machines."""
  if not v:
    return "not run yet"
  seconds = v["seconds"]
  if not seconds["same_machine_seeds"]:
    return "no pair ran on one machine"
  machines = sorted({p["machine"] for p in seconds["per_seed"].values() if p["same_machine"]})
  steady = seconds["steady_seeds"]
  even = (f"{seconds['steady_wall_geomean']:.2f} (geometric mean over seeds "
          f"{','.join(map(str, steady))}, both runs whole and at an even pace; " if steady
          else "no pair both whole and at an even pace (")
  return (f"{even}{seconds['wall_geomean']:.2f} over all {seconds['same_machine_seeds']} pairs "
          f"run on one machine) on `{'`, `'.join(machines)}`")


def _searched(summary: dict, name: str) -> str:
  """'seeds 0-2: -0.18 [-0.63, +0.28], TOST p 0.447': a search arm against full data."""
  vs = summary[name]["vs_full"]
  return f"seeds 0-2: {_pts_interval(vs)}, TOST p {vs['p']:.3f}"


def _new_seed_cost(v: dict, label: str, seeds: tuple, done: str) -> str:
  """A declared tier's cost cell: not run yet, not decided yet (k of n seeds, the interval so
  far), or its outcome in bold and its interval."""
  if not v:
    return f"{label}: not run yet"
  if not v["complete"]:
    return (f"{label}: not decided yet, {len(v['seeds'])} of {len(seeds)} seeds run "
            f"({_pts_interval(v)} so far)")
  return f"{label}: **{done}**, {_cost(v)}"


def budget_rows(out: dict, base) -> list[list[str]]:
  """One row per declared answer of the summary `out` (a summary.json): tier C's design with
  its replication (F) and their pool, tier G's, tier H's, tier N's, and full data."""
  summary, found = out["summary"], out["verdicts"]
  arms = {a.name: a for a in search_arms(base) + a2_arms() + n_arms(base)}
  rows = []
  name = out["chosen"]
  c_row = summary[f"{name}@confirm"]
  pooled = found["pooled"]
  rows.append([
      _passes_cell(c_row), _policy_cell(arms[name], c_row, base),
      f"lossless at half the passes or fewer? Chosen on validation accuracy ("
      f"{_searched(summary, name)}), then tier C (seeds 3-7) and its replication, tier F "
      "(seeds 8-12), each declared before its runs",
      f"**{_outcome(pooled, short=True)}** on all 10 seeds: {_cost(pooled)}; tier C: "
      f"{_cost(found['untouched'])}, {_outcome(found['untouched'], short=True)}; tier F: "
      f"{_cost(found['replicate'], False)}, {_outcome(found['replicate'], short=True)}",
      _time_mean_cell(c_row["time"])])
  g = out["verdict_g"]
  g_row = summary[g["arm"]]
  rows.append([
      _passes_cell(g_row), _policy_cell(arms[out["chosen_a2"]], g_row, base),
      "lossless at half the passes or fewer? Chosen on validation accuracy among tier A' "
      f"(importance sampling, InfoBatch without its weight; {_searched(summary, out['chosen_a2'])}"
      "), then tier G (seeds 13-22), declared before its runs",
      f"**{_outcome(g, short=True)}**: {_cost(g)}", _time_geomean_cell(g)])
  h, pick = out["tier_h"]["verdict"], out["tier_h"]["declared_choice"]
  h_row = summary[h["arm"]] if h else summary[pick]
  rows.append([
      _passes_cell(h_row), _policy_cell(arms[pick], h_row, base),
      "the largest lossless saving? Chosen by a rule declared before tier H's runs among the "
      f"search arms at 50-70 % of the passes ({_searched(summary, pick)}), then tier H (seeds "
      "23-32)",
      _new_seed_cost(h, "tier H", H_SEEDS, _outcome(h, short=True) if h else ""),
      _time_geomean_cell(h)])
  n = out["tier_n"]["verdict"]
  n_row = summary[n["arm"]] if n else summary[N_DESIGN]
  noisy = found.get("noisy")
  rows.append([
      _passes_cell(n_row), _policy_cell(arms[N_DESIGN], n_row, base),
      "better than full data under 20 % label noise, a noise draw per seed? Tier N (seeds "
      "23-32), declared before its runs"
      + (f"; tier D's {_pts_interval(noisy)} (seeds 3-7) was exploratory, against a full-data "
         "reference that trained epoch 5 on the flipped labels first" if noisy else ""),
      _new_seed_cost(n, "tier N", N_SEEDS, _outcome(n, short=True) if n else "")
      + (" vs full data on the same noisy labels" if n else ""),
      _time_geomean_cell(n)])
  return rows + [["100 %", "full data", "", "", ""]]


def budget_table(out: dict, base) -> str:
  """The README's budget table (`budget_rows`) between its markers."""
  lines = [TABLE_START, "",
           "| passes, % of full (with evaluation) | policy: what it keeps | question, declared "
           "tiers | test accuracy vs full data, points [90 % t interval] | time, share of full "
           "data's (machine) |", "|---|---|---|---|---|"]
  lines += ["| " + " | ".join(row) + " |" for row in budget_rows(out, base)]
  return "\n".join(lines + ["", TABLE_END])


def write_readme_table(summary_json: str, readme: str = README) -> None:
  """Replaces the budget table between TABLE_START and TABLE_END in `readme` with
  `budget_table` of `summary_json`; the markers must be there, once each."""
  with open(summary_json, encoding="utf-8") as f:
    table = budget_table(json.load(f), base_config())
  with open(readme, encoding="utf-8") as f:
    text = f.read()
  if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1:
    raise SystemExit(f"--readme: {readme} needs the budget table's markers once each, "
                     f"{TABLE_START!r} and {TABLE_END!r}")
  head, rest = text.split(TABLE_START)
  with open(readme, "w", encoding="utf-8") as f:
    f.write(head + table + rest.split(TABLE_END)[1])


# ---------------------------------------------------------------------------------------------
# The loop.


def _record(records: str, arm: Arm, seed: int) -> str:
  """The run's record: the long-schedule study's where that study made the same run."""
  if arm.long_name:
    path = long_schedule.record_path(LONG_RECORDS, arm.long_name, seed)
    if os.path.exists(path):
      return path
  return long_schedule.record_path(records, arm.name, seed)


def planned_runs(tier_arms: list[Arm]) -> list[tuple[Arm, int]]:
  """A tier's (arm, seed) runs in the order they train: seed by seed, each seed's arms in
  order, so that a tier cut short is paired."""
  return [(a, s) for s in sorted({s for a in tier_arms for s in a.seeds})
          for a in tier_arms if s in a.seeds]


def left_out(arm: Arm, seed: int, only: list[str], seeds: set[int]) -> str:
  """The option that leaves this run out ('--arms', '--seeds'), or '' when it is to run. A
  run left out still reads its finished record (tier A's decide the choice that the later
  tiers need); it trains nothing."""
  return ("--arms" if only and arm.name not in only
          else "--seeds" if seeds and seed not in seeds else "")


def plan_lines(tier: str, todo: list[tuple[Arm, int]], records: str, only: list[str],
               seeds: set[int] = frozenset()) -> list[str]:
  """--dry-run's listing: per run its arm, seed, the overrides it trains with, and whether its
  record exists (or --arms or --seeds leaves it out)."""
  lines = [f"tier {tier}: {len(todo)} runs"]
  for i, (arm, seed) in enumerate(todo):
    option = left_out(arm, seed, only, seeds)
    state = ("recorded" if os.path.exists(_record(records, arm, seed))
             else f"left out by {option}" if option else "to train")
    lines.append(f"  {i + 1}/{len(todo)} {arm.name} seed {seed} ({state}): "
                 + " ".join(f"{k}={v}" for k, v in run_overrides(arm, seed).items()))
  return lines


def _run(base, arm: Arm, seed: int, out: str, records: str, results: dict, failures: dict,
         label: str, summarise_only: bool, quiet: bool = False) -> None:
  workdir = os.path.join(out, arm.name, f"seed{seed}")
  record = _record(records, arm, seed)
  finished = os.path.exists(record) or os.path.exists(
      os.path.join(workdir, "report", "results.json"))
  if summarise_only and not finished:
    return
  if not quiet:
    print(f"[{time.strftime('%H:%M:%S')}] {label}: tier {arm.tier} {arm.name} seed {seed}"
          + (" (finished)" if finished else ""), flush=True)
  try:
    row = long_schedule.run_row(base, run_overrides(arm, seed), workdir, record)
    long_schedule._add(results, arm.name, seed, row)  # pylint: disable=protected-access
  except preemption.Preempted:
    raise  # A stop request stops the study; its checkpoint resumes the run on the rerun.
  except Exception as err:  # One failed run must not stop the study: it is reported.
    failures[f"{arm.name} seed {seed}"] = f"{type(err).__name__}: {str(err)[:300]}"
    print(f"[{time.strftime('%H:%M:%S')}] FAILED {arm.name} seed {seed}: "
          f"{traceback.format_exc()}", flush=True)


def _tier_arms(tier: str, arms: list[Arm], results: dict, base) -> list[Arm] | None:
  """The arms that `tier` runs, or None while the choice it follows is not made: C-F follow
  tier A's, G the tier-A' (A2) one; H and N run their declared designs. Tier A' runs beside
  full data's seeds 0-2 (read from their records), so that its arms have their reference in
  the summary when it runs alone."""
  if tier == "H":
    return h_arms(base)
  if tier == "N":
    return n_arms(base)
  if tier in ("C", "D", "E", "F"):
    chosen = choose(arms, results)
    return None if chosen is None else [a for a in later_arms(chosen, base) if a.tier == tier]
  if tier == "G":
    chosen = choose(arms, results, "A2")
    return None if chosen is None else g_arms(chosen)
  full = [a for a in arms if a.name == "full"] if tier == "A2" else []
  return full + [a for a in arms if a.tier == tier]


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="studies/out/frontier",
                      help="workdirs (checkpoints, reports), summary and figure")
  parser.add_argument("--records", default=RECORDS,
                      help=f"one small file per finished run (default {RECORDS})")
  parser.add_argument("--tiers", default="".join(TIERS),
                      help="tiers to run, in order (default ACFDBEA2GHN; A2 is tier A', "
                           "e.g. --tiers A2, then --tiers A2G for tier G; --tiers H, --tiers N)")
  parser.add_argument("--arms", default="",
                      help="comma-separated arm names: run only these (e.g. a cut-down tier "
                           "B: --tiers B --arms topk_anneal-55,topk_anneal-70); default all")
  parser.add_argument("--seeds", default="",
                      help="comma-separated seeds: train only these of the tiers' runs, the "
                           "others' records still read (e.g. one process per seed group, on "
                           "a machine with cores and device memory to spare); default all")
  parser.add_argument("--data-dir", default="",
                      help="tfds data dir for the prepared Fashion-MNIST (default "
                           "~/tensorflow_datasets); training is unchanged")
  parser.add_argument("--manual-dir", default="",
                      help="the folder of Fashion-MNIST's four IDX files, gzipped or not "
                           "(default Debian's "
                           "/usr/share/datasets/fashion-mnist); training is unchanged")
  parser.add_argument("--prepare-data", action="store_true",
                      help="prepare Fashion-MNIST in --data-dir from --manual-dir and stop: "
                           "once, before parallel processes would each prepare it at once")
  parser.add_argument("--summarise-only", action="store_true",
                      help="rewrite the summary from finished runs, train nothing")
  parser.add_argument("--dry-run", action="store_true",
                      help="list each tier's runs (arm, seed, overrides, recorded or to train) "
                           "and stop: nothing trained, nothing written")
  parser.add_argument("--readme", default="", metavar="SUMMARY_JSON",
                      help=f"rewrite {README}'s budget table from this summary.json (e.g. "
                           "studies/results/frontier.json) and stop; nothing trained")
  args = parser.parse_args()
  if args.readme:
    write_readme_table(args.readme)
    return
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
  base = grid.apply(base_config(), {"dataset.data_dir": args.data_dir,
                                     "dataset.manual_dir": args.manual_dir})
  if args.prepare_data:
    input_pipeline.open_or_prepare(base.dataset.name, base.dataset)
    return
  command = f"python -m studies.frontier --out={args.out}"
  if not args.dry_run:
    os.makedirs(args.out, exist_ok=True)
  arms = search_arms(base) + a2_arms()
  only = parse_arms(args.arms, base)
  tiers = parse_tiers(args.tiers)
  seeds = parse_seeds(args.seeds, {s for t in tiers for s in TIER_SEEDS[t]})
  results, failures = {}, {}
  for tier in tiers:
    tier_arms = _tier_arms(tier, arms, results, base)
    if tier_arms is None:
      print(f"[{time.strftime('%H:%M:%S')}] tier {tier} waits for tier "
            f"{'A' if tier in 'CDEF' else 'A2'}'s choice", flush=True)
      continue
    arms += [a for a in tier_arms if a not in arms]
    todo = planned_runs(tier_arms)
    if args.dry_run:
      print("\n".join(plan_lines(tier, todo, args.records, only, seeds)), flush=True)
    for i, (arm, seed) in enumerate(todo):
      skip = args.summarise_only or args.dry_run or bool(left_out(arm, seed, only, seeds))
      _run(base, arm, seed, args.out, args.records, results, failures,
           f"tier {tier} run {i + 1}/{len(todo)}", skip, quiet=args.dry_run)
      if not skip:
        write_outputs(args.out, arms, results, choose(arms, results), command, failures)
  if args.dry_run:
    return
  write_outputs(args.out, arms, results, choose(arms, results), command, failures)
  print(f"[{time.strftime('%H:%M:%S')}] done: {args.out}/summary.md", flush=True)


if __name__ == "__main__":
  main()
