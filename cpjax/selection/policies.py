"""The selection policies (`config.selection.method`), each registered in POLICIES with the
settings it reads (`config.selection.<setting>`, declared beside it): config validation,
configs/default.py's fields and docs/selection.md's table all come from this registry.

A policy is `fn(request, **settings)`: the epoch's scores, labels, ids, k, seed and epoch
in, the ids it trains on out (infobatch, importance: ids and a loss weight each). The algorithms are
the pure functions of cpjax/selection/subsets.py. `select` is the one entry point, called by
the library API's `api.Selection`, through which the trainer selects too; scores rank
"hardest first" (highest first) and `direction="easiest"` negates them first. The
cross-field checks (`needs_problems`, `schedule_problems`, `size_problems`) take the values
they check as keywords: config validation and `api.Selection` run the same ones. Adding a
policy: docs/extending.md.
"""

from collections.abc import Callable, Mapping
import dataclasses
from typing import Any, Literal, NamedTuple

import jax
import numpy as np

from cpjax import registry
from cpjax.selection import subsets

FULL = "full"  # No selection: every epoch trains on all data.
DIRECTIONS = ("hardest", "easiest")
# How many examples a policy trains on in a selected epoch (`Policy.size`): "fixed", k =
# subset_size(...) exactly; "constant", exactly k and the same k all run (its subsets need
# one size, as RS2's rounds: no `fraction_end` schedule); "expected", k in expectation
# (importance's independent draws); "free", as many as it decides (full: all of them;
# infobatch: those it keeps).
Size = Literal["fixed", "constant", "expected", "free"]
SIZES: tuple[Size, ...] = ("fixed", "constant", "expected", "free")


class Request(NamedTuple):
  """What a policy function is given for one epoch (besides its own settings)."""
  scores: np.ndarray  # [N] priorities in the order of `ids`, highest first (direction applied).
  labels: np.ndarray  # [N] the examples' labels.
  ids: np.ndarray  # [N] the training examples' ids, increasing (ties go to the lower id).
  k: int  # The subset size: exact ("fixed", "constant") or in expectation ("expected").
  seed: int  # The run's root seed (every random draw).
  epoch: int  # The 0-indexed epoch (per-epoch random draws).
  first_epoch: int = 0  # The first selected epoch (after the warm-up).
  num_epochs: int = 1  # The run's epochs (infobatch's annealing).
  mesh: jax.sharding.Mesh | None = None  # The mesh of the global ranking (None: all devices).


PolicyFn = Callable[..., Any]  # fn(request, **settings) -> ids [k], or (ids, weights).
ProblemsFn = Callable[..., list[str]]  # fn(**values) -> messages (Policy.problems).


@dataclasses.dataclass(frozen=True)
class Policy:
  """A registered selection policy (`config.selection.method`)."""
  name: str
  fn: PolicyFn  # fn(request: Request, **settings) -> int ids, or (ids, float32 weights).
  doc: str  # One line for the docs' table.
  settings: tuple[registry.Setting, ...] = ()  # `config.selection.<name>` fields it reads.
  needs_scores: bool = True  # Ranks scores (the others need no scoring pass).
  # How many it trains on (SIZES): all but free read k and final_full_epochs, fixed and
  # expected the budget schedule (fraction_end) too.
  size: Size = "fixed"
  returns_weights: bool = False  # fn returns (ids, weights): the loss weighted per example.
  # Draws with probabilities proportional to the score: a score that can be negative
  # (scores.Score.nonnegative False) is refused by config validation.
  proportional: bool = False
  # Other selection fields it needs, and why: implied when unset, refused when set otherwise.
  needs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  needs_reason: str = ""
  # Cross-field problems, called by `size_problems` with keywords: num_rows (training
  # examples), num_epochs, warmup_epochs, fraction, count and the policy's settings by name.
  # It names the ones it checks (`**_` takes the rest) and returns messages that start with
  # a selection field's name, bare (config validation prefixes "config.selection.").
  problems: ProblemsFn | None = None

  def __post_init__(self):
    if self.size not in SIZES:
      raise ValueError(f"selection policy {self.name!r}: size={self.size!r}; valid: "
                       f"{', '.join(SIZES)}")

  @property
  def takes_target_scores(self) -> bool:
    """Ranks whatever scores a source gives (a target's too), not only its own train pass's."""
    return self.needs_scores and "scoring" not in self.needs


POLICIES: registry.Registry[Policy] = registry.Registry("selection policy", "selection")
POLICIES.register(Policy(FULL, lambda request: request.ids, "all data, every epoch",
                         needs_scores=False, size="free"))


def returns_weights(method: str) -> bool:
  """Whether selection `method` gives each training example a loss weight (infobatch,
  importance)."""
  return method in POLICIES and POLICIES[method].returns_weights


def reads_k(method: str) -> bool:
  """Whether `method` trains on k = subset_size(...) examples per selected epoch, exactly
  or in expectation (`Policy.size` other than free): `final_full_epochs` applies to it."""
  return POLICIES[method].size != "free"


def subset_size(fraction: float, count: int, num_train: int) -> int:
  """k: `count` if set (> 0), else round(fraction * num_train), at least 1."""
  k = count if count > 0 else int(round(fraction * num_train))
  return max(1, min(k, num_train))


def fraction_at(fraction: float, fraction_end: float, epoch: int, first_selected: int,
                last_selected: int) -> float:
  """The kept fraction of selected `epoch` under a linear budget schedule.

  f(e) = f0 + (f1 - f0) * (e - e0) / (e1 - e0) for the selected epochs e0 .. e1
  (`first_selected` .. `last_selected`), f0 = `fraction`, f1 = `fraction_end`;
  a negative `fraction_end` keeps f0 throughout (the constant budget of the
  papers). A rising schedule trains lean while the model learns the easy bulk
  and spends its budget late, where a subset's bias costs most.
  """
  if fraction_end < 0 or last_selected <= first_selected:
    return fraction
  progress = (epoch - first_selected) / (last_selected - first_selected)
  return fraction + (fraction_end - fraction) * progress


POLICIES.register(Policy(
    "top_k", lambda r: subsets.select_top_k(r.scores, r.ids, r.k, r.mesh),
    "the k highest scores (Tata et al. 2022's selection): a global `jax.lax.top_k` over a "
    "score array sharded on the mesh, ties to the lower example id"))
POLICIES.register(Policy(
    "uniform_sorted", lambda r: subsets.select_uniform_sorted(r.scores, r.ids, r.k, r.mesh),
    "every floor(N/k)-th example of the score ranking (Tata et al.'s code's `uniform`)"))
POLICIES.register(Policy(
    "class_balanced",
    lambda r: subsets.select_class_balanced(r.scores, r.labels, r.ids, r.k, r.mesh),
    "per-class quotas proportional to the class frequencies (largest-remainder rounding), "
    "top-k inside each class"))


def _stratified_problems(*, stratify_drop: float, fraction: float, count: int, num_rows: int,
                         **_) -> list[str]:
  """The drop must leave at least k examples to stratify."""
  kept = num_rows - int(stratify_drop * num_rows)
  k = subset_size(fraction, count, num_rows)
  if k > kept:
    return [f"stratify_drop={stratify_drop} leaves {kept} of {num_rows} training examples, "
            f"fewer than the subset size {k}"]
  return []


POLICIES.register(Policy(
    "stratified", lambda r, stratify_drop, num_strata: subsets.select_stratified(
        r.scores, r.ids, r.k, r.seed, r.epoch, stratify_drop, num_strata),
    "CCS (Zheng et al., ICLR 2023): leave out the hardest `stratify_drop` share, "
    "`num_strata` equal-width score strata, the budget spread evenly over them (smallest "
    "first), a uniform draw inside each",
    settings=(registry.Setting("stratify_drop", 0.0, registry.number(0.0, 1.0, high_open=True),
                               "stratified (CCS): hardest share left out (beta)."),
              registry.Setting("num_strata", 50, registry.integer(1),
                               "stratified (CCS): equal-width score strata.")),
    problems=_stratified_problems))
POLICIES.register(Policy(
    "mixed", lambda r, random_share: subsets.select_mixed(r.scores, r.ids, r.k, r.seed, r.epoch,
                                                  random_share, r.mesh),
    "a `random_share` of k drawn uniformly at random, the rest top-k",
    settings=(registry.Setting("random_share", 0.5, registry.number(0.0, 1.0),
                               "mixed: share of the subset drawn uniformly at random."),)))
POLICIES.register(Policy(
    "sampled", lambda r, temperature: subsets.select_sampled(r.scores, r.ids, r.k, r.seed, r.epoch,
                                                     temperature, r.mesh),
    "Gumbel-top-k: k drawn without replacement with P ~ exp(score / `temperature`); T=0 is "
    "`top_k`, a large T is `random`",
    settings=(registry.Setting("temperature", 1.0, registry.number(0.0),
                               "sampled: P ~ exp(score / T); 0 = top_k, large = random."),)))
POLICIES.register(Policy(
    "random", lambda r: subsets.random_subset(r.ids, r.k, r.seed, r.epoch),
    "a fresh uniform random subset of size k each epoch (baseline)", needs_scores=False))
POLICIES.register(Policy(
    "static_random", lambda r: subsets.random_subset(r.ids, r.k, r.seed, None),
    "one random subset, the same every epoch (baseline)", needs_scores=False, size="constant"))
POLICIES.register(Policy(
    "random_without_replacement",
    lambda r: subsets.random_without_replacement(r.ids, r.k, r.seed, r.epoch - r.first_epoch),
    "RS2 (Okanovic et al. 2023): one random permutation per round of ceil(N/k) selected "
    "epochs, walked in slices of k, so every example is trained once per round",
    needs_scores=False, size="constant"))


def _infobatch_problems(*, anneal_fraction: float, warmup_epochs: int, num_epochs: int,
                        **_) -> list[str]:
  """InfoBatch prunes only before its annealing epochs."""
  first_anneal = subsets.anneal_start(num_epochs, anneal_fraction)
  if first_anneal <= warmup_epochs:
    return [f"anneal_fraction={anneal_fraction} anneals from epoch {first_anneal} of "
            f"{num_epochs}, no later than warmup_epochs={warmup_epochs}: infobatch would "
            "never prune"]
  return []


POLICIES.register(Policy(
    "infobatch", lambda r, prune_ratio, anneal_fraction, rescale: subsets.select_infobatch(
        r.scores, r.ids, r.seed, r.epoch, prune_ratio,
        subsets.anneal_start(r.num_epochs, anneal_fraction), rescale),
    "InfoBatch (Qin et al., ICLR 2024): no fixed k. Each example whose last train-pass loss "
    "is below the mean is pruned with probability `prune_ratio` (r); the kept ones of them "
    "get loss weight 1/(1-r), all others 1, so the epoch's expected gradient is the full "
    "data's. The last `anneal_fraction` of the epochs train on all data with weight 1. "
    "`fraction` and `count` are range-checked but unused",
    settings=(registry.Setting("prune_ratio", 0.5, registry.number(0.0, 1.0, high_open=True),
                               "infobatch: P(prune) of a below-mean-loss example, r."),
              registry.Setting("anneal_fraction", 0.125,
                               registry.number(0.0, 1.0, high_open=True),
                               "infobatch: last share of epochs on all data (1 - delta)."),
              registry.Setting("infobatch_rescale", True, registry.boolean(),
                               "infobatch: kept below-mean examples weigh 1/(1-r); False: 1.",
                               arg="rescale")),
    size="free", returns_weights=True,
    needs={"score": "loss", "scoring": "train_pass", "direction": "hardest"},
    needs_reason="prunes by the train pass's own per-example loss",
    problems=_infobatch_problems))
POLICIES.register(Policy(
    "importance", lambda r, mix, max_weight, weighting: subsets.select_importance(
        r.scores, r.ids, r.k, r.seed, r.epoch, mix, max_weight, weighting),
    "importance sampling (Katharopoulos & Fleuret 2018): each example drawn independently "
    "with probability pi_i = min(1, c p_i), p_i = `mix`/N + (1 - `mix`) score_i / sum(score), "
    "c such that sum(pi) = k (k examples in expectation, without replacement), loss weight "
    "k/(N pi_i) = 1/(N p_i) (unbiased); `weighting=normalized` rescales the weights to mean "
    "1 over the epoch's examples, none above `max_weight`",
    settings=(registry.Setting("mix", 0.5, registry.number(0.0, 1.0, low_open=True),
                               "importance: uniform share of the sampling distribution."),
              registry.Setting("max_weight", 10.0, registry.number(1.0),
                               "importance: largest loss weight (normalized weighting)."),
              registry.Setting("weighting", "normalized", registry.choice(subsets.WEIGHTINGS),
                               "importance: normalized (mean 1, clipped) or unbiased (k/(N pi)).")),
    size="expected", returns_weights=True, proportional=True, needs={"direction": "hardest"},
    needs_reason="draws with probabilities that grow with the score"))


# The cross-field checks of a selection, shared by config validation (which prefixes each
# message with "config.selection.") and the library API (`api.Selection` raises them): they
# take the values they check as keywords, so both run the very same rules.


def needs_problems(method: str, **fields: Any) -> list[str]:
  """The selection `fields` (by name) that policy `method` needs set otherwise
  (`Policy.needs`; infobatch prunes by each example's own training loss)."""
  policy = POLICIES[method]
  return [f"{field}={fields[field]!r} does not work with method={method!r} (it "
          f"{policy.needs_reason}); valid: {needed!r}"
          for field, needed in policy.needs.items()
          if field in fields and fields[field] != needed]


def schedule_problems(method: str, *, num_epochs: int, warmup_epochs: int,
                      final_full_epochs: int, fraction_end: float, count: int) -> list[str]:
  """The epochs that select (warm-up, final full epochs) and a fixed-size method's budget
  schedule (`fraction_end`), for `num_epochs` epochs."""
  problems, fixed = [], reads_k(method)
  if method != FULL and warmup_epochs >= num_epochs:
    problems.append(f"warmup_epochs={warmup_epochs} leaves no epoch of the {num_epochs} "
                    f"(num_epochs) to select in; method={method!r} would never run")
  if final_full_epochs and not fixed:
    problems.append(f"final_full_epochs={final_full_epochs} works with the fixed-size methods "
                    f"only, not method={method!r}"
                    + (" (use anneal_fraction)" if method == "infobatch" else ""))
  if fixed and final_full_epochs and num_epochs - final_full_epochs - warmup_epochs <= 0:
    problems.append(f"warmup_epochs={warmup_epochs} and final_full_epochs={final_full_epochs} "
                    f"leave no epoch of the {num_epochs} (num_epochs) to select in")
  if fraction_end < 0:
    return problems
  if fraction_end == 0:
    problems.append("fraction_end=0 keeps no example in the last selected epoch; valid: -1 "
                    "(a constant fraction) or a share in (0, 1]")
  varying = [p.name for p in POLICIES.entries() if p.size in ("fixed", "expected")]
  if method not in varying:
    problems.append(f"fraction_end={fraction_end} does not work with method={method!r} (its "
                    f"subset needs one size); valid: {', '.join(varying)}")
  if count:
    problems.append(f"fraction_end={fraction_end} needs count=0 (the schedule moves the "
                    f"fraction; count {count} fixes k)")
  return problems


def size_problems(method: str, *, num_rows: int, num_epochs: int, warmup_epochs: int,
                  fraction: float, count: int, **settings: Any) -> list[str]:
  """The subset size against the `num_rows` training examples, then the policy's own
  cross-field problems (`Policy.problems`) with its `settings` by name."""
  if count > num_rows:
    return [f"count={count} exceeds the {num_rows} training examples"]
  problems = POLICIES[method].problems
  return problems(num_rows=num_rows, num_epochs=num_epochs, warmup_epochs=warmup_epochs,
                  fraction=fraction, count=count, **settings) if problems else []


def select(method: str, request: Request, settings: Mapping[str, Any],
           direction: str = "hardest") -> tuple[np.ndarray, np.ndarray | None]:
  """The ids policy `method` trains on in `request.epoch`: the one entry point of every policy.

  Args:
    method: a registered policy name (POLICIES).
    request: the epoch's scores, labels, ids, k, seed and epoch.
    settings: the policy's own settings by keyword (`POLICIES.keywords(method, section)`).
    direction: "easiest" ranks the lowest scores first (scored policies; NaN stays last).

  Returns:
    (int ids, increasing; float32 loss weights of those ids, or None for a policy that
    weights no loss).
  """
  policy = POLICIES[method]
  if policy.needs_scores and direction == "easiest":
    request = request._replace(scores=-np.asarray(request.scores))  # NaN stays NaN.
  chosen = policy.fn(request, **settings)
  if policy.returns_weights:
    return chosen
  return np.sort(chosen), None
