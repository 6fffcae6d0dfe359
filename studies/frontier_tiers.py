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

The tiers are declared here, before any of their runs (their arms and seeds, and the rules
above); studies.frontier runs them, studies.frontier_summary applies the rules to their records
and writes the summary.
"""

import dataclasses
import math
import re

from cpjax import registry
from cpjax.data import splits
from cpjax.selection import policies
from studies import grid, long_schedule

RECORDS = "studies/results/frontier_runs"
LONG_RECORDS = long_schedule.RECORDS
SEARCH_SEEDS = (0, 1, 2)
CONFIRM_SEEDS = (3, 4, 5, 6, 7)
REPLICATE_SEEDS = (8, 9, 10, 11, 12)
HALF = 45  # The half-compute budget: 0.05 + 0.95 * 0.45 = 47.75 % of full data's passes.
BUDGETS = (30, 45, 55, 70)
INFOBATCH_RATIOS = {45: 85, 30: 95, 55: 70, 70: 50}  # Budget column -> prune ratio (%).
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
