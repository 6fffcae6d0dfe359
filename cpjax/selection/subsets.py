"""Subset algorithms of the selection policies: pure functions (scores, ids -> ids; InfoBatch
and importance sampling also return a loss weight per id). cpjax/selection/policies.py
registers each one as a policy with its settings.

The score-based ones rank globally: `jax.lax.top_k` over a score array sharded
over the device mesh (XLA gathers what it needs; every process gets the same
ids). Ties go to the lower example id: scores are laid out in increasing id
order and `jax.lax.top_k` returns the lower index first among equal values.
NaN scores rank last. Every random draw is a NumPy draw that is a pure function
of (seed, a tag per policy, epoch), so a resumed run redraws the same subsets
and nothing about them needs checkpointing.
"""

import math

import jax
import numpy as np

from cpjax.runtime import compile_ahead, sharding

# Tags that keep each policy's random stream apart from the others' for the same (seed, epoch).
_RANDOM, _STRATIFIED, _MIXED, _SAMPLED, _RS2, _INFOBATCH = (0x5E1EC7, 0xCC5, 0x313ED, 0x6B3E1,
                                                            0x252, 0x1B7)
_IMPORTANCE = 0x1395


def _ranked_positions(scores: np.ndarray, k: int, mesh: jax.sharding.Mesh | None) -> np.ndarray:
  """Positions of the k highest scores, best first (lower position on ties)."""
  scores = np.where(np.isnan(scores), -np.inf, np.asarray(scores, np.float32))
  if mesh is None:
    mesh = sharding.create_mesh()
  devices = mesh.devices.size
  padded = np.pad(scores, (0, -len(scores) % devices), constant_values=-np.inf)
  sharded = jax.make_array_from_callback(padded.shape, sharding.batch_sharded(mesh),
                                         lambda index: padded[index])
  # Every position ranked (top_k of all of them): one program for every k an epoch keeps (a
  # static k would compile anew for each size: a slower first step of every new size).
  _, positions = _top_k(sharded, len(padded))
  return np.asarray(sharding.to_host(positions))[:k]


@jax.jit(static_argnums=1)
def _top_k(scores: jax.Array, k: int):
  return jax.lax.top_k(scores, k)


def compile_ranking_ahead(compiler: compile_ahead.Compiler, num_scores: int,
                          mesh: jax.sharding.Mesh | None) -> None:
  """Submits the global ranking of `num_scores` scores (`_ranked_positions`'s) to
  `compiler`."""
  mesh = sharding.create_mesh() if mesh is None else mesh
  padded = num_scores + (-num_scores % mesh.devices.size)
  compiler.submit("the ranking", _top_k, jax.ShapeDtypeStruct(
      (padded,), np.float32, sharding=sharding.batch_sharded(mesh)), padded)


def select_top_k(scores: np.ndarray, ids: np.ndarray, k: int,
                 mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
  """Ids of the k highest-scoring examples, best first.

  Args:
    scores: [N] one score per training example, in the order of `ids`.
    ids: [N] the examples' ids, increasing (ties go to the lower id).
    k: how many to select (<= N).
    mesh: the device mesh to shard the scores over (default: all devices).

  Returns:
    int [k] selected ids.
  """
  _check(scores, ids, k)
  return np.asarray(ids)[_ranked_positions(scores, k, mesh)]


def select_uniform_sorted(scores: np.ndarray, ids: np.ndarray, k: int,
                          mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
  """Tata et al. 2022's code's "uniform" criterion: every floor(N/k)-th of the sorted list.

  Spreads the subset over the whole score range instead of its top.
  """
  _check(scores, ids, k)
  ranked = _ranked_positions(scores, len(scores), mesh)
  return np.asarray(ids)[ranked[::len(scores) // k][:k]]


def random_subset(ids: np.ndarray, k: int, seed: int, epoch: int | None) -> np.ndarray:
  """k ids drawn without replacement; a new draw per epoch, or one for all (epoch=None)."""
  key = [seed, _RANDOM] if epoch is None else [seed, _RANDOM, epoch]
  return np.sort(np.random.default_rng(key).choice(np.asarray(ids), size=k, replace=False))


def class_quotas(labels: np.ndarray, k: int) -> np.ndarray:
  """Per-class subset sizes proportional to the class frequencies, summing to k.

  q_c = floor(k n_c / N), and the k - sum_c q_c slots left go one each to the
  classes with the largest remainders k n_c mod N (the lower class on ties):
  Hamilton's largest-remainder apportionment, in exact integer arithmetic. A
  class never gets more than it has, and an absent class gets 0.

  Args:
    labels: [N] integer labels >= 0.
    k: the subset size, 1 <= k <= N.
  """
  counts = np.bincount(np.asarray(labels))
  quotas, remainders = np.divmod(k * counts, len(labels))
  by_remainder = np.lexsort((np.arange(len(counts)), -remainders))
  quotas[by_remainder[:k - quotas.sum()]] += 1
  return quotas


def _rank_within_group(groups: np.ndarray) -> np.ndarray:
  """For each position, how many earlier positions hold the same group."""
  order = np.argsort(groups, kind="stable")
  sorted_groups = groups[order]
  within = np.empty(len(groups), np.int64)
  within[order] = np.arange(len(groups)) - np.searchsorted(sorted_groups, sorted_groups)
  return within


def select_class_balanced(scores: np.ndarray, labels: np.ndarray, ids: np.ndarray, k: int,
                          mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
  """Top-k inside each class, with `class_quotas` (proportional to class frequencies).

  The fix for max-entropy subsets that starve the easy classes (the study in
  studies/prioritization found the smallest class at 0.2 % of a 10 % subset).
  One global ranking (as `select_top_k`), then each class's best q_c in it.

  Returns:
    int [k] ids, in global rank order.
  """
  _check(scores, ids, k)
  labels = np.asarray(labels)
  if len(labels) != len(ids):
    raise ValueError(f"{len(labels)} labels for {len(ids)} ids")
  ranked = _ranked_positions(scores, len(scores), mesh)
  ranked_labels = labels[ranked]
  keep = _rank_within_group(ranked_labels) < class_quotas(labels, k)[ranked_labels]
  return np.asarray(ids)[ranked[keep]]


def stratum_budgets(sizes: np.ndarray, k: int) -> np.ndarray:
  """CCS's budget per stratum: the smallest non-empty stratum first, each taking
  min(its size, floor(budget left / non-empty strata left)).

  Args:
    sizes: [S] examples per stratum.
    k: the total budget, <= sizes.sum().
  """
  budgets = np.zeros(len(sizes), np.int64)
  filled = np.flatnonzero(sizes)
  left = k
  for i, stratum in enumerate(filled[np.argsort(sizes[filled], kind="stable")]):
    budgets[stratum] = min(sizes[stratum], left // (len(filled) - i))
    left -= budgets[stratum]
  return budgets


def select_stratified(scores: np.ndarray, ids: np.ndarray, k: int, seed: int, epoch: int,
                      stratify_drop: float = 0.0, num_strata: int = 50) -> np.ndarray:
  """Coverage-centric coreset selection (CCS; Zheng et al., ICLR 2023, Algorithm 1).

  1. Leave out the hardest floor(stratify_drop * N) examples (highest scores;
     ties: the higher id goes first). 2. Split [min, max] of the remaining
  scores into `num_strata` equal-width strata (the last one closed). 3. Spread
  k over the strata with `stratum_budgets`. 4. Draw each stratum's budget
  uniformly without replacement (a function of seed and epoch). NaN scores
  (never scored) count as the lowest score.

  Returns:
    int [k] ids, sorted.

  Raises:
    ValueError: fewer than k examples remain after the drop.
  """
  _check(scores, ids, k)
  scores = np.asarray(scores, np.float64)
  scores = np.where(np.isnan(scores), np.nanmin(scores) if np.isfinite(scores).any() else 0.0,
                    scores)
  ranked = np.lexsort((np.arange(len(scores)), scores))  # Ascending; hardest last.
  kept = np.sort(ranked[:len(scores) - int(stratify_drop * len(scores))])
  if len(kept) < k:
    raise ValueError(f"k={k} is more than the {len(kept)} examples left after dropping the "
                     f"hardest {stratify_drop:.0%}")
  low, high = scores[kept].min(), scores[kept].max()
  width = (high - low) / num_strata
  stratum = (np.minimum(((scores[kept] - low) / width).astype(np.int64), num_strata - 1)
             if width > 0 else np.zeros(len(kept), np.int64))
  budgets = stratum_budgets(np.bincount(stratum, minlength=num_strata), k)
  rng = np.random.default_rng([seed, _STRATIFIED, epoch])
  chosen = [rng.choice(kept[stratum == s], size=b, replace=False)
            for s, b in enumerate(budgets) if b]
  return np.sort(np.asarray(ids)[np.concatenate(chosen)])


def select_mixed(scores: np.ndarray, ids: np.ndarray, k: int, seed: int, epoch: int,
                 random_share: float, mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
  """The k - r top-scored examples plus r drawn uniformly from all the others,
  r = round(random_share * k): a random share keeps a small subset from
  collapsing onto the hardest examples (Sorscher et al. 2022; Ayed & Hayou 2023).

  Returns:
    int [k] ids: the top part in rank order, then the random part sorted.
  """
  _check(scores, ids, k)
  num_random = int(round(random_share * k))
  ranked = _ranked_positions(scores, len(scores), mesh)
  rest = np.sort(ranked[k - num_random:])
  drawn = np.random.default_rng([seed, _MIXED, epoch]).choice(rest, size=num_random,
                                                               replace=False)
  return np.asarray(ids)[np.concatenate([ranked[:k - num_random], np.sort(drawn)])]


def select_sampled(scores: np.ndarray, ids: np.ndarray, k: int, seed: int, epoch: int,
                   temperature: float, mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
  """k examples drawn without replacement, each draw with P(i) ~ exp(score_i / T).

  The Gumbel-top-k trick (Kool et al., ICML 2019): the k largest of
  score_i / T + G_i, G_i iid standard Gumbel, are such a draw. Ranked here as
  score_i + T G_i (the same order, and T = 0 is exactly top-k); T -> infinity
  is a uniform random subset. The noise is a function of (seed, epoch).

  Returns:
    int [k] ids, in the order of the noisy ranking.
  """
  _check(scores, ids, k)
  gumbel = np.random.default_rng([seed, _SAMPLED, epoch]).gumbel(size=len(scores))
  return select_top_k(np.asarray(scores, np.float64) + temperature * gumbel, ids, k, mesh)


def random_without_replacement(ids: np.ndarray, k: int, seed: int,
                               selected_epoch: int) -> np.ndarray:
  """RS2 without replacement (Okanovic et al. 2023): each round of m = ceil(N/k) selected
  epochs walks one random permutation of the ids in slices of k, so every example is
  trained once per round; the round's last slice, short when k does not divide N, is
  filled up with the first ids of the same permutation.

  Args:
    selected_epoch: 0 for the first epoch after the warm-up.

  Returns:
    int [k] ids, sorted.
  """
  ids = np.asarray(ids)
  rounds, position = divmod(selected_epoch, -(-len(ids) // k))
  order = np.random.default_rng([seed, _RS2, rounds]).permutation(len(ids))
  chosen = order[position * k:(position + 1) * k]
  return np.sort(ids[np.concatenate([chosen, order[:k - len(chosen)]])])


def anneal_start(num_epochs: int, anneal_fraction: float) -> int:
  """InfoBatch's first annealing epoch: floor(delta * C), delta = 1 - anneal_fraction.

  The authors' sampler (InfoBatch's `IBSampler`, Qin et al., ICLR 2024) counts
  its resets from 1 at the first epoch and prunes while the count is at most
  delta * C, so epochs 0 .. floor(delta * C) - 1 are pruned and the remaining
  C - floor(delta * C) train on all data: with the default delta = 0.875,
  C = 6 prunes 5 epochs and anneals 1, C = 20 prunes 17 and anneals 3. The
  product is rounded to 6 decimals first, so that 0.7 * 10 counts as 7.
  """
  return math.floor(round((1.0 - anneal_fraction) * num_epochs, 6))


def select_infobatch(scores: np.ndarray, ids: np.ndarray, seed: int, epoch: int,
                     prune_ratio: float, first_anneal_epoch: int, rescale: bool = True
                     ) -> tuple[np.ndarray, np.ndarray]:
  """InfoBatch's soft pruning and rescaling (Qin et al., "InfoBatch: Lossless Training Speed
  Up by Unbiased Dynamic Data Pruning", ICLR 2024; arXiv 2303.04947).

  With H_i the score (the example's last training loss) and r = prune_ratio:
  an example with H_i < mean(H) is pruned with probability r, independently
  (u_i < r, u_i ~ U[0, 1) drawn for every example as a function of (seed,
  epoch)); every other example is kept. A kept example's loss weight is
  w_i = 1 / (1 - r) if H_i < mean(H), else 1, so that E[sum_kept w_i l_i] =
  sum_all l_i: the expected gradient of an epoch is the full data's. From
  `first_anneal_epoch` on (annealing) every example is kept with weight 1.
  (The authors' code keeps exactly floor((1 - r) n) of the n below-mean
  examples; this is the paper's independent draw.) A NaN score makes the mean
  NaN: nothing is pruned. With `rescale=False` every kept example has weight 1: the
  same pruning without the correction (biased towards the high-loss examples), which
  separates what the pruning does from what the weight 1/(1 - r) does.

  Args:
    scores: [N] the score buffer, in the order of `ids`.
    ids: [N] the training examples' ids, increasing.
    seed: the run's root seed.
    epoch: the 0-indexed epoch.
    prune_ratio: r in [0, 1).
    first_anneal_epoch: the first epoch of the full-data annealing (`anneal_start`).
    rescale: weight the kept below-mean examples 1 / (1 - r) (the paper's); False: 1.

  Returns:
    (ids [M] kept, increasing; float32 weights [M] of those ids).
  """
  ids = np.asarray(ids)
  if len(scores) != len(ids):
    raise ValueError(f"{len(scores)} scores for {len(ids)} ids")
  if epoch >= first_anneal_epoch:
    return ids, np.ones(len(ids), np.float32)
  scores = np.asarray(scores, np.float64)
  well_learned = scores < np.mean(scores)  # False everywhere if any score is NaN.
  uniform = np.random.default_rng([seed, _INFOBATCH, epoch]).random(len(ids))
  kept = ~(well_learned & (uniform < prune_ratio))
  weights = np.where(well_learned & rescale, 1.0 / (1.0 - prune_ratio), 1.0).astype(np.float32)
  return ids[kept], weights[kept]


# How `select_importance` weights the loss: the Horvitz-Thompson weights as they are, or
# rescaled to mean 1 over the epoch's examples and clipped (the default).
WEIGHTINGS = ("normalized", "unbiased")


def capped_proportional(values: np.ndarray, total: float, cap: float) -> np.ndarray:
  """x_i = min(cap, c v_i) with the c > 0 that makes sum_i x_i = `total`: shares proportional
  to `values`, none above `cap`.

  With cap 1 these are the inclusion probabilities of a design proportional to size with an
  expected sample size `total` (Sarndal, Swensson & Wretman 1992, "Model Assisted Survey
  Sampling"): an example whose c v_i would exceed 1 is taken for sure. Found by
  capping the values that exceed `cap` and rescaling the rest, until none does; c only grows
  from one round to the next, so a value once capped stays at or above the cap.

  Args:
    values: [n] positive numbers.
    total: the sum wanted, in (0, cap * n].
    cap: the largest share.
  """
  values = np.asarray(values, np.float64)
  if not (np.all(values > 0) and 0 < total <= cap * len(values) * (1 + 1e-12)):
    raise ValueError(f"capped_proportional needs positive values and 0 < total <= cap * n; "
                     f"got total={total}, cap={cap}, n={len(values)}, "
                     f"min value {values.min() if len(values) else None}")
  capped = np.zeros(len(values), bool)
  while not capped.all():
    scale = (total - cap * capped.sum()) / values[~capped].sum()
    over = ~capped & (scale * values > cap)
    if not over.any():
      return np.where(capped, cap, scale * values)
    capped |= over
  return np.full(len(values), float(cap))


def sampling_probabilities(scores: np.ndarray, mix: float) -> np.ndarray:
  """p_i = mix / N + (1 - mix) s_i / sum_j s_j, s_i = max(score_i, 0) (a non-finite score
  counts as 0; all 0: p uniform). The mixture with the uniform distribution keeps every
  p_i >= mix / N, so no weight 1 / (N p_i) exceeds 1 / mix (Katharopoulos & Fleuret 2018's
  smoothing; Johnson & Guestrin 2018)."""
  s = np.asarray(scores, np.float64)
  s = np.where(np.isfinite(s), np.maximum(s, 0.0), 0.0)
  uniform = np.full(len(s), 1.0 / len(s))
  if not s.sum() > 0:
    return uniform
  return mix * uniform + (1.0 - mix) * s / s.sum()


def select_importance(scores: np.ndarray, ids: np.ndarray, k: int, seed: int, epoch: int,
                      mix: float, max_weight: float, weighting: str = "normalized"
                      ) -> tuple[np.ndarray, np.ndarray]:
  """Importance sampling of k examples in expectation, without replacement, with the loss
  weights that make each step's expected gradient the full data's (Katharopoulos & Fleuret,
  "Not All Samples Are Created Equal", ICML 2018; Johnson & Guestrin, NeurIPS 2018; Alain et
  al. 2015).

  Probabilities p = `sampling_probabilities(scores, mix)`; inclusion probabilities
  pi_i = min(1, c p_i) with sum_i pi_i = k (`capped_proportional`); example i is in the
  epoch when u_i < pi_i, u_i ~ U[0, 1) drawn for every example from (seed, epoch), each
  independently (Poisson sampling), so the epoch has k examples in expectation. Its weight
  is the Horvitz-Thompson weight w_i = k / (N pi_i) (= 1 / (N p_i) where pi_i = k p_i):
  E[sum_{i in S} w_i g_i] = (k / N) sum_i g_i, so each of the epoch's steps (the mean of
  w_i g_i over its batch) has the full data's mean gradient in expectation. Poisson sampling
  rather than draws with replacement: the trainer trains an example at most once an epoch
  (one row, one weight, one train-pass score), and independent inclusion keeps the weights
  exactly unbiased, whereas a draw of exactly k without replacement has inclusion
  probabilities that are not k p_i in closed form. (InfoBatch is such a design: pi = 1 - r
  below the mean loss, 1 above, weight 1 / pi.)

  weighting="unbiased" returns w as it is. "normalized" (the default) returns
  w'_i = min(max_weight, t w_i) with t such that w' has mean 1 over the epoch's examples
  (`capped_proportional`): the learning rate keeps its meaning and no example's weight
  exceeds `max_weight`, at the price of a self-normalised estimator, unbiased only as k
  grows. An empty draw (probability prod_i (1 - pi_i) <= exp(-k)) keeps the example with
  the smallest u_i / pi_i.

  Args:
    scores: [N] non-negative priorities in the order of `ids` (higher: drawn more often).
    ids: [N] the training examples' ids, increasing.
    k: the expected number of examples, 1 <= k <= N.
    seed, epoch: the draw's randomness.
    mix: the uniform share of p, in (0, 1].
    max_weight: the largest normalised weight, >= 1.
    weighting: one of WEIGHTINGS.

  Returns:
    (ids [M] drawn, increasing; float32 weights [M] of those ids).
  """
  _check(scores, ids, k)
  if weighting not in WEIGHTINGS:
    raise ValueError(f"weighting={weighting!r}; valid choices: {', '.join(WEIGHTINGS)}")
  n = len(ids)
  inclusion = capped_proportional(sampling_probabilities(scores, mix), k, 1.0)
  uniform = np.random.default_rng([seed, _IMPORTANCE, epoch]).random(n)
  kept = uniform < inclusion
  if not kept.any():
    kept[np.argmin(uniform / inclusion)] = True
  weights = k / (n * inclusion[kept])
  if weighting == "normalized":
    weights = capped_proportional(weights, len(weights), max_weight)
  return np.asarray(ids)[kept], weights.astype(np.float32)


def _check(scores: np.ndarray, ids: np.ndarray, k: int) -> None:
  if len(scores) != len(ids):
    raise ValueError(f"{len(scores)} scores for {len(ids)} ids")
  if not 1 <= k <= len(scores):
    raise ValueError(f"k={k} must be in [1, {len(scores)}]")
  if np.any(np.diff(ids) <= 0):
    raise ValueError("ids must be strictly increasing (the tie-break is by id)")
