"""cpjax's selection for your own training loop: which example ids to train on next epoch.

  selection = api.Selection(ids, labels, method="top_k", fraction=0.3, warmup_epochs=1,
                            num_epochs=10, seed=0)
  state = selection.init()                        # A pytree: checkpoint it with yours.
  for epoch in range(10):
    subset = selection.select(state, epoch)       # Ids (and loss weights: infobatch, importance).
    for batch_ids in batches(subset.ids):
      ..., per_example_scores = train_step(...)   # E.g. scores.normalized_entropy(logits).
      state = selection.record(state, batch_ids, per_example_scores)

The trainer selects through this same class (its `selector.Selector` builds one from
config.selection and adds only what is the trainer's own: scoring passes, rows of its
readers, the workdir's records), so the two cannot drift apart: the policies are
`policies.POLICIES`, each with its settings, checked by the rules config validation runs
(`policies.needs_problems`, `schedule_problems`, `size_problems`), and `select` is a pure
function of (seed, epoch, the recorded scores), so the same scores give the trainer's ids,
and a run restored from a checkpoint of `state` selects what the uninterrupted run selected.
The state is the trainer's score buffer: one float32 score per example (0 before any is
recorded, as the trainer's), by the example's position in `ids`; `record` keeps the first
score of an id that a call holds twice (the trainer's wrapped last batch). docs/library.md.
"""

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from cpjax import registry
from cpjax.selection import policies

State = dict[str, np.ndarray]  # {"scores": float32 [N]}.


class Subset(NamedTuple):
  """One epoch's examples."""
  ids: np.ndarray  # Example ids, increasing.
  weights: np.ndarray | None  # float32 loss weight per id (infobatch, importance), else None.


class Selection:
  """A selection policy bound to a training set: `init`, `select`, `record`."""

  def __init__(self, ids, labels=None, *, method: str = "top_k", fraction: float = 0.1,
               count: int = 0, warmup_epochs: int = 0, num_epochs: int = 1, seed: int = 0,
               direction: str = "hardest", final_full_epochs: int = 0,
               fraction_end: float = -1.0, mesh: jax.sharding.Mesh | None = None,
               **settings: Any):
    """Binds a policy and its settings to the training examples.

    Args:
      ids: [N] the training examples' ids, strictly increasing (ties go to the lower id).
      labels: [N] their integer labels (class_balanced; None: all 0).
      method: a registered policy (docs/selection.md), e.g. top_k, sampled, infobatch,
        importance.
      fraction: k / N of the fixed-size policies (k = round(fraction * N), at least 1;
        importance: k in expectation).
      count: k as a count; > 0 overrides fraction.
      warmup_epochs: epochs on all data before the first selected one.
      num_epochs: the run's epochs (infobatch anneals on the last ones).
      seed: the root seed of every random draw (the trainer's config.seed).
      direction: "hardest" (highest scores first) or "easiest".
      final_full_epochs: fixed-size policies: the last epochs train on all data.
      fraction_end: fixed-size policies: >= 0 moves the kept fraction linearly from
        `fraction` (first selected epoch) to this (last selected epoch); < 0: constant.
      mesh: the mesh of the global ranking (None: all devices).
      **settings: the policy's own settings (e.g. temperature=0.1 for sampled); the
        others keep their declared defaults.

    Raises:
      ValueError: an unknown policy or setting, a bad value, or values that cannot work
        together (the checks of a config's `selection` section), named with the valid ones.
    """
    self.ids = np.asarray(ids)
    if self.ids.ndim != 1 or np.any(np.diff(self.ids) <= 0):
      raise ValueError("ids must be a 1-D array of strictly increasing example ids")
    self.labels = (np.zeros(len(self.ids), np.int64) if labels is None
                   else np.asarray(labels))
    if len(self.labels) != len(self.ids):
      raise ValueError(f"{len(self.labels)} labels for {len(self.ids)} ids")
    self.policy = policies.POLICIES[method]
    values = _checked_settings(self.policy, settings)
    _check_combination(method, direction, num_rows=len(self.ids), fraction=fraction,
                       count=count, warmup_epochs=warmup_epochs, num_epochs=num_epochs,
                       final_full_epochs=final_full_epochs, fraction_end=fraction_end,
                       settings=values)
    self._settings = policies.POLICIES.keywords(method, values)
    self.fraction, self.count, self.fraction_end = fraction, count, fraction_end
    self.warmup_epochs, self.num_epochs, self.seed = warmup_epochs, num_epochs, seed
    self.final_full_epochs, self.direction, self.mesh = final_full_epochs, direction, mesh

  @property
  def weighted(self) -> bool:
    """Whether `select` gives loss weights (infobatch, importance): weight each example's loss
    by them."""
    return self.policy.returns_weights

  def init(self) -> State:
    """The state before any score is recorded: every score 0 (the trainer's buffer)."""
    return {"scores": np.zeros(len(self.ids), np.float32)}

  def selecting(self, epoch: int) -> bool:
    """Whether `epoch` trains on a policy's subset: after the warm-up epochs and before the
    final full-data epochs (`final_full_epochs`, an annealing phase as InfoBatch's for the
    fixed-size policies); never under method=full."""
    return (self.policy.name != policies.FULL
            and self.warmup_epochs <= epoch < self.num_epochs - self.final_full_epochs)

  def k_at(self, epoch: int) -> int:
    """The subset size of a fixed-size policy in selected `epoch`: `count`, or the kept
    fraction of the epoch (`fraction`, moving linearly to `fraction_end` over the selected
    epochs when that is >= 0; `policies.fraction_at`) times the training examples."""
    fraction = policies.fraction_at(self.fraction, self.fraction_end, epoch,
                                    self.warmup_epochs,
                                    self.num_epochs - self.final_full_epochs - 1)
    return policies.subset_size(fraction, self.count, len(self.ids))

  def select(self, state: State, epoch: int) -> Subset:
    """The ids to train on in `epoch` (all of them in warm-up), by the recorded scores."""
    if not self.selecting(epoch):
      return Subset(self.ids, np.ones(len(self.ids), np.float32) if self.weighted else None)
    request = policies.Request(np.asarray(state["scores"]), self.labels, self.ids,
                               self.k_at(epoch),
                               self.seed, epoch, self.warmup_epochs, self.num_epochs,
                               self.mesh)
    return Subset(*policies.select(self.policy.name, request, self._settings,
                                   self.direction))

  def record(self, state: State, ids, scores) -> State:
    """The state with the scores of `ids` (from your train step) recorded; a new dict.

    Args:
      state: the state so far.
      ids: [B] example ids (any order; an id twice keeps its first score).
      scores: [B] their scores (NumPy or JAX arrays), e.g. the losses for infobatch.
    """
    ids, scores = np.asarray(ids).reshape(-1), np.asarray(scores, np.float32).reshape(-1)
    if len(ids) != len(scores):
      raise ValueError(f"{len(scores)} scores for {len(ids)} ids")
    positions = np.searchsorted(self.ids, ids)
    known = positions < len(self.ids)
    known[known] = self.ids[positions[known]] == ids[known]
    if not known.all():
      raise ValueError(f"ids not in the training set: {ids[~known][:5].tolist()}")
    _, first = np.unique(ids, return_index=True)
    buffer = np.array(state["scores"], np.float32)
    buffer[positions[first]] = scores[first]
    return {**state, "scores": buffer}


def _checked_settings(policy: policies.Policy, given: Mapping[str, Any]) -> dict[str, Any]:
  """The policy's settings by name: its declared defaults, overridden by `given`, checked."""
  declared = {s.name: s for s in policy.settings}
  unknown = sorted(set(given) - set(declared))
  if unknown:
    raise ValueError(f"method={policy.name!r} has no setting {unknown[0]!r}; "
                     f"{registry.did_you_mean(unknown[0], list(declared))}"
                     f"its settings: {', '.join(declared) or 'none'}")
  values = {name: given.get(name, s.default) for name, s in declared.items()}
  for name, value in values.items():
    if problem := declared[name].check(value):
      raise ValueError(f"{policy.name} setting {name}: {problem}")
  return values


def _check_combination(method: str, direction: str, *, num_rows: int, fraction: float,
                       count: int, warmup_epochs: int, num_epochs: int, final_full_epochs: int,
                       fraction_end: float, settings: Mapping[str, Any]) -> None:
  """Raises the cross-field problems that config validation names for a config's
  `selection` section (`policies.needs_problems`, `schedule_problems`, `size_problems`)."""
  if direction not in policies.DIRECTIONS:
    raise ValueError(f"direction={direction!r}; valid choices: "
                     f"{', '.join(policies.DIRECTIONS)}")
  problems = (policies.needs_problems(method, direction=direction)
              + policies.schedule_problems(method, num_epochs=num_epochs,
                                           warmup_epochs=warmup_epochs,
                                           final_full_epochs=final_full_epochs,
                                           fraction_end=fraction_end, count=count)
              + policies.size_problems(method, num_rows=num_rows, num_epochs=num_epochs,
                                       warmup_epochs=warmup_epochs, fraction=fraction,
                                       count=count, **settings))
  if problems:
    raise ValueError("; ".join(problems))
