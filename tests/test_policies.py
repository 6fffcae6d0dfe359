"""The subset policies (docs/methods.md#selection-policies) against references written
differently (loops, sorting by Python keys, exact fractions, closed forms), on 1 and 8 devices
where they rank globally; InfoBatch's soft pruning against a per-example loop over the same
uniform draws; importance sampling's inclusion probabilities and weights against hand-worked
cases, a root finder and Monte-Carlo estimates, and its weighted gradient against the full
data's."""

from fractions import Fraction
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

from cpjax.config import validation
from cpjax.runtime import sharding
from cpjax.selection import policies, scores, subsets
from tests.helpers import tiny_config


def _mesh(num_devices):
  return sharding.create_mesh(jax.devices()[:num_devices])


def _reference_quotas(labels, k):
  """Hamilton apportionment with Python fractions: exact shares, the largest remainders (then
  the lower class) get the leftover seats."""
  counts = {c: int(np.sum(labels == c)) for c in range(int(labels.max()) + 1)}
  shares = {c: Fraction(k * n, len(labels)) for c, n in counts.items()}
  quotas = {c: int(share) for c, share in shares.items()}  # Floor (shares are >= 0).
  leftover = k - sum(quotas.values())
  for c in sorted(shares, key=lambda c: (-(shares[c] - quotas[c]), c))[:leftover]:
    quotas[c] += 1
  return [quotas[c] for c in sorted(quotas)]


def _reference_class_balanced(scores, labels, ids, k):
  """Per class: sort its members by (-score, id), NaN last, take the quota."""
  chosen = []
  for c, quota in enumerate(_reference_quotas(labels, k)):
    members = [i for i in range(len(ids)) if labels[i] == c]
    members.sort(key=lambda i: (np.isnan(scores[i]), -np.nan_to_num(scores[i]), ids[i]))
    chosen += [ids[i] for i in members[:quota]]
  return sorted(chosen)


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("n, k, num_classes", [(1000, 100, 10), (997, 333, 7), (50, 50, 3),
                                               (40, 1, 4), (300, 37, 10)])
def test_class_balanced_matches_a_per_class_reference(num_devices, n, k, num_classes):
  rng = np.random.default_rng(n + k)
  labels = rng.choice(num_classes, n, p=rng.dirichlet(np.ones(num_classes)))  # Imbalanced.
  labels[0] = num_classes - 1  # At least two classes present.
  scores = rng.integers(0, 15, n).astype(np.float32) / 15  # Many exact ties.
  scores[rng.choice(n, n // 20)] = np.nan
  ids = np.sort(rng.choice(10 * n, n, replace=False))
  got = subsets.select_class_balanced(scores, labels, ids, k, _mesh(num_devices))
  assert len(got) == k
  np.testing.assert_array_equal(np.sort(got), _reference_class_balanced(scores, labels, ids, k))
  np.testing.assert_array_equal(subsets.class_quotas(labels, k), _reference_quotas(labels, k))


def test_class_quotas_by_hand():
  labels = np.array([0] * 6 + [1] * 3 + [2] * 1)  # Shares of k=5: 3, 1.5, 0.5.
  assert subsets.class_quotas(labels, 5).tolist() == [3, 2, 0]  # Tie 0.5/0.5: lower class.
  assert subsets.class_quotas(labels, 10).tolist() == [6, 3, 1]
  assert subsets.class_quotas(np.array([0, 0, 2]), 2).tolist() == [1, 0, 1]  # Class 1 absent.


def _reference_budgets(sizes, k):
  """CCS Algorithm 1 as written: repeatedly take the smallest remaining stratum."""
  remaining = {s: n for s, n in enumerate(sizes) if n > 0}
  budgets, budget = [0] * len(sizes), k
  while remaining:
    smallest = min(remaining, key=lambda s: (remaining[s], s))
    budgets[smallest] = min(remaining.pop(smallest), budget // (len(remaining) + 1))
    budget -= budgets[smallest]
  return budgets


@pytest.mark.parametrize("seed", range(6))
def test_stratified_budgets_strata_and_drop_match_ccs(seed):
  rng = np.random.default_rng(seed)
  n, num_strata, drop = 400, int(rng.integers(2, 12)), [0.0, 0.1, 0.3][seed % 3]
  scores = rng.beta(2, 5, n)  # Skewed: strata of very different sizes.
  ids = np.arange(n) * 3
  k = int(rng.integers(1, int(n * (1 - drop))))
  got = subsets.select_stratified(scores, ids, k, seed=1, epoch=seed, stratify_drop=drop,
                                   num_strata=num_strata)
  assert len(got) == k == len(set(got.tolist()))
  kept = sorted(range(n), key=lambda i: scores[i])[:n - int(drop * n)]  # Hardest dropped.
  assert set((got // 3).tolist()) <= set(kept)
  low, high = min(scores[kept]), max(scores[kept])
  edges = [low + (high - low) * j / num_strata for j in range(num_strata + 1)]
  stratum = {i: min(next(j for j in range(num_strata) if scores[i] < edges[j + 1])
                    if scores[i] < high else num_strata - 1, num_strata - 1) for i in kept}
  sizes = [sum(1 for i in kept if stratum[i] == s) for s in range(num_strata)]
  per_stratum = [sum(1 for i in (got // 3) if stratum[int(i)] == s) for s in range(num_strata)]
  assert per_stratum == _reference_budgets(sizes, k)


def test_stratified_is_uniform_within_a_stratum_and_redraws_per_epoch():
  scores, ids = np.zeros(20), np.arange(20)  # One stratum: a uniform draw of k.
  counts = np.zeros(20)
  for epoch in range(2000):
    counts[subsets.select_stratified(scores, ids, 5, seed=0, epoch=epoch)] += 1
  # Binomial(2000, 1/4) per example: mean 500, sd ~19.4; 5 sd.
  assert np.all(np.abs(counts - 500) < 5 * 19.4), counts
  again = subsets.select_stratified(scores, ids, 5, seed=0, epoch=7)
  np.testing.assert_array_equal(again, subsets.select_stratified(scores, ids, 5, 0, 7))


def test_mixed_takes_the_top_and_a_random_rest():
  rng = np.random.default_rng(0)
  scores, ids = rng.permutation(100).astype(np.float32), np.arange(100) + 1000
  got = subsets.select_mixed(scores, ids, 20, seed=3, epoch=1, random_share=0.25)
  top = [1000 + i for i in sorted(range(100), key=lambda i: -scores[i])[:15]]
  assert got[:15].tolist() == top  # 20 - round(0.25 * 20) = 15 best, in rank order.
  assert len(set(got.tolist())) == 20 and not set(got[15:].tolist()) & set(top)
  np.testing.assert_array_equal(got, subsets.select_mixed(scores, ids, 20, 3, 1, 0.25))
  assert not np.array_equal(got[15:], subsets.select_mixed(scores, ids, 20, 3, 2, 0.25)[15:])
  assert sorted(subsets.select_mixed(scores, ids, 20, 3, 1, 0.0).tolist()) == sorted(
      subsets.select_top_k(scores, ids, 20).tolist())


@pytest.mark.slow  # 6,000 draws.
def test_sampled_inclusion_follows_the_gumbel_max_closed_form():
  """k = 1: the Gumbel-max theorem gives P(i) = softmax(score / T)_i exactly."""
  scores, ids, temperature = np.array([0.0, 0.5, 1.0, 2.0]), np.arange(4), 0.7
  draws = 6000
  counts = np.bincount([subsets.select_sampled(scores, ids, 1, seed=0, epoch=e,
                                                temperature=temperature)[0]
                        for e in range(draws)], minlength=4)
  expected = np.exp(scores / temperature) / np.exp(scores / temperature).sum()
  sd = np.sqrt(draws * expected * (1 - expected))
  assert np.all(np.abs(counts - draws * expected) < 5 * sd), (counts, draws * expected)


def test_sampled_temperature_zero_is_top_k_and_large_is_random():
  rng = np.random.default_rng(1)
  scores, ids = rng.normal(size=200), np.arange(200)
  np.testing.assert_array_equal(
      subsets.select_sampled(scores, ids, 30, seed=0, epoch=0, temperature=0.0),
      subsets.select_top_k(scores, ids, 30))
  hot = np.zeros(200)
  for epoch in range(300):
    hot[subsets.select_sampled(scores, ids, 30, seed=0, epoch=epoch, temperature=1e6)] += 1
  top = subsets.select_top_k(scores, ids, 30)
  # Random: each example in 15 % of 300 draws (sd ~6.2); top-k would put the top 30 in all.
  assert np.abs(hot[top].mean() - 45) < 5


@pytest.mark.parametrize("n, k", [(100, 10), (103, 10), (10, 10), (7, 3)])
def test_random_without_replacement_covers_everything_once_per_round(n, k):
  ids = np.arange(n) * 2 + 5
  rounds = -(-n // k)
  for r in range(2):
    drawn = [subsets.random_without_replacement(ids, k, seed=4, selected_epoch=r * rounds + e)
             for e in range(rounds)]
    assert all(len(s) == k == len(set(s.tolist())) for s in drawn)
    seen, times = np.unique(np.concatenate(drawn), return_counts=True)
    np.testing.assert_array_equal(seen, ids)  # Every example at least once per round,
    assert np.sum(times == 2) == rounds * k - n and times.max() <= 2  # the top-up twice.
  first, second = (subsets.random_without_replacement(ids, k, 4, e) for e in (0, rounds))
  assert n == k or not np.array_equal(first, second)  # Each round has its own permutation.


def test_direction_easiest_ranks_the_lowest_first_and_nan_last():
  scores = np.array([0.3, np.nan, 0.1, 0.9, 0.2])
  ids = np.arange(5)
  def easiest(k):
    request = policies.Request(scores, np.zeros(5, int), ids, k, seed=0, epoch=0)
    return policies.POLICIES["top_k"].fn(request._replace(scores=-scores)).tolist()
  assert easiest(2) == [2, 4] and easiest(4) == [2, 4, 0, 3]  # Rank order.
  chosen, weights = policies.select("top_k", policies.Request(scores, np.zeros(5, int), ids, 4,
                                                              seed=0, epoch=0), {}, "easiest")
  assert chosen.tolist() == [0, 2, 3, 4] and weights is None  # `select` sorts the ids.


@pytest.mark.parametrize("field, value, message", [
    ("selection.direction", "hard", "valid choices: easiest, hardest"),
    ("selection.stratify_drop", 1.0, "must be in [0.0, 1.0), got 1.0"),
    ("selection.random_share", 1.5, "must be in [0.0, 1.0], got 1.5"),
    ("selection.num_strata", 0, "must be at least 1, got 0"),
])
def test_bad_policy_knobs_are_named(field, value, message):
  with pytest.raises(ValueError) as info:
    validation.validate(tiny_config(**{field: value}))
  assert f"config.{field}" in str(info.value) and message in str(info.value)


def test_a_drop_that_leaves_fewer_than_k_is_an_early_error():
  config = tiny_config(**{"selection.method": "stratified", "selection.fraction": 0.5,
                          "selection.stratify_drop": 0.6})
  with pytest.raises(ValueError, match="stratify_drop=0.6 leaves 503 of 1257 training examples, "
                                       "fewer than the subset size 628"):
    validation.validate(config)


@pytest.mark.parametrize("method", [name for name in policies.POLICIES.names()
                                    if policies.POLICIES[name].size in ("fixed", "constant")])
def test_every_method_gives_k_distinct_ids_and_the_same_again_for_the_same_epoch(method):
  rng = np.random.default_rng(7)
  scores, labels, ids = rng.normal(size=120), rng.integers(0, 5, 120), np.arange(120) * 2
  section = {"random_share": 0.3, "temperature": 0.5, "stratify_drop": 0.1, "num_strata": 6}
  settings = policies.POLICIES.keywords(method, section)
  request = policies.Request(scores, labels, ids, 25, seed=1, epoch=4, first_epoch=2)
  got, weights = policies.select(method, request, settings)
  assert len(got) == len(set(got.tolist())) == 25 and set(got.tolist()) <= set(ids.tolist())
  assert weights is None and np.all(np.diff(got) > 0)
  np.testing.assert_array_equal(got, policies.select(method, request, settings)[0])


@pytest.mark.parametrize("method", policies.POLICIES.names())
def test_a_policys_flags_say_what_select_gives(method):
  """returns_weights: `select` gives one float32 weight an id, else None; a fixed size gives
  exactly k ids (above), and the budget schedule reads k for fixed and expected sizes."""
  rng = np.random.default_rng(11)
  scores, labels, ids = rng.random(120) + 0.05, rng.integers(0, 5, 120), np.arange(120)
  policy = policies.POLICIES[method]
  request = policies.Request(scores, labels, ids, 25, seed=1, epoch=2, num_epochs=10)
  got, weights = policies.select(method, request, policies.POLICIES.keywords(
      method, policies.POLICIES.defaults()))
  assert (weights is not None) == policy.returns_weights == policies.returns_weights(method)
  if weights is not None:
    assert weights.shape == got.shape and weights.dtype == np.float32
  assert policies.reads_k(method) == (policy.size != "free")


def test_a_policy_size_outside_the_four_is_refused_naming_them():
  with pytest.raises(ValueError, match="selection policy 'mine': size='exact'; valid: fixed, "
                                       "constant, expected, free"):
    policies.Policy("mine", lambda request: request.ids, "mine", size="exact")


def _reference_infobatch(scores, ids, seed, epoch, r, first_anneal_epoch):
  """InfoBatch example by example, with Python floats: the mean as an exact sum over N, then
  each below-mean example pruned when its uniform draw is below r, else kept with 1/(1-r)."""
  if epoch >= first_anneal_epoch:
    return list(ids), [1.0] * len(ids)
  uniform = np.random.default_rng([seed, subsets._INFOBATCH, epoch]).random(len(ids))
  mean = math.fsum(float(s) for s in scores) / len(scores)
  kept, weights = [], []
  for i, score in enumerate(scores):
    if float(score) >= mean:
      kept.append(ids[i])
      weights.append(1.0)
    elif not uniform[i] < r:
      kept.append(ids[i])
      weights.append(1.0 / (1.0 - r))
  return kept, weights


@pytest.mark.parametrize("n, r, epoch", [(1000, 0.5, 3), (997, 0.3, 0), (50, 0.9, 7),
                                         (1, 0.5, 1), (300, 0.0, 2)])
def test_infobatch_matches_a_per_example_loop(n, r, epoch):
  rng = np.random.default_rng(n)
  scores = rng.gamma(1.0, 1.0, n).astype(np.float32)  # Losses: skewed, mean above median.
  ids = np.sort(rng.choice(10 * n, n, replace=False))
  got_ids, got_weights = subsets.select_infobatch(scores, ids, 5, epoch, r, 10)
  want_ids, want_weights = _reference_infobatch(scores, ids, 5, epoch, r, 10)
  np.testing.assert_array_equal(got_ids, want_ids)
  np.testing.assert_array_equal(got_weights, np.float32(want_weights))
  assert got_weights.dtype == np.float32 and np.all(np.diff(got_ids) > 0)


def test_infobatch_prunes_only_below_the_mean_and_reweights_exactly():
  rng = np.random.default_rng(0)
  scores, ids, r = rng.exponential(size=2000), np.arange(2000) * 3, 0.6
  below = scores < scores.mean()
  pruned_share = []
  for epoch in range(40):
    kept, weights = subsets.select_infobatch(scores, ids, 1, epoch, r, 100)
    kept_below = below[kept // 3]
    assert set(np.setdiff1d(ids, kept) // 3) <= set(np.flatnonzero(below))  # Only below.
    assert np.all(weights[kept_below] == np.float32(1 / (1 - r)))
    assert np.all(weights[~kept_below] == 1.0) and np.sum(~kept_below) == np.sum(~below)
    pruned_share.append(1 - kept_below.sum() / below.sum())
  # Each below-mean example pruned with probability r: 40 epochs of ~1,260 Bernoulli(0.6) draws.
  sd = math.sqrt(r * (1 - r) / (40 * below.sum()))
  assert abs(np.mean(pruned_share) - r) < 5 * sd


def test_infobatch_rescaling_is_unbiased_for_the_epoch_loss_sum():
  """E[sum_kept w_i l_i] = sum_i l_i: the average over many draws comes within 5 sd."""
  rng = np.random.default_rng(1)
  losses, ids, r = rng.gamma(0.5, 2.0, 500), np.arange(500), 0.5
  sums = [np.sum(w * losses[kept]) for kept, w in
          (subsets.select_infobatch(losses, ids, 2, epoch, r, 10**6) for epoch in range(2000))]
  below = losses < losses.mean()
  sd = math.sqrt(np.sum(losses[below] ** 2) * r / (1 - r) / 2000)  # Var of w l 1[kept].
  assert abs(np.mean(sums) - losses.sum()) < 5 * sd


def test_infobatch_edge_cases_annealing_and_determinism():
  rng = np.random.default_rng(2)
  scores, ids = rng.normal(size=300), np.arange(300) + 7
  for epoch in (0, 5):  # r = 0 keeps everything with weight 1.
    kept, weights = subsets.select_infobatch(scores, ids, 0, epoch, 0.0, 9)
    np.testing.assert_array_equal(kept, ids)
    assert np.all(weights == 1.0)
  for epoch in (9, 10, 50):  # Annealing: all data, weight 1, whatever the scores.
    kept, weights = subsets.select_infobatch(scores, ids, 0, epoch, 0.5, 9)
    np.testing.assert_array_equal(kept, ids)
    assert np.all(weights == 1.0)
  same = [subsets.select_infobatch(scores, ids, 3, 4, 0.5, 9) for _ in range(2)]
  np.testing.assert_array_equal(same[0][0], same[1][0])
  np.testing.assert_array_equal(same[0][1], same[1][1])
  assert not np.array_equal(same[0][0], subsets.select_infobatch(scores, ids, 3, 5, 0.5, 9)[0])
  assert not np.array_equal(same[0][0], subsets.select_infobatch(scores, ids, 4, 4, 0.5, 9)[0])
  for constant in (np.zeros(300), np.r_[np.nan, scores[1:]]):  # Nothing below a flat or NaN mean.
    np.testing.assert_array_equal(subsets.select_infobatch(constant, ids, 0, 1, 0.5, 9)[0], ids)


def _reference_pruned_epochs(num_epochs: int, delta: Fraction) -> list[int]:
  """The epochs that InfoBatch's reference sampler prunes, replayed from its counter: its
  constructor resets once (the counter goes 0 -> 1), each epoch's iterator resets again, and a
  reset prunes while the counter is at most num_epochs * delta (exact fractions here, so that
  the reference's float products do not blur the integer cases)."""
  iterations, pruned = 1, []  # After the constructor's reset.
  for epoch in range(num_epochs):
    if not iterations > num_epochs * delta:
      pruned.append(epoch)
    iterations += 1
  return pruned


@pytest.mark.parametrize("delta", ["7/8", "9/10", "4/5", "7/10", "1/2", "29/40"])
def test_infobatch_anneals_where_the_reference_sampler_stops_pruning(delta):
  delta = Fraction(delta)
  for num_epochs in range(1, 301):
    pruned = _reference_pruned_epochs(num_epochs, delta)
    assert pruned == list(range(len(pruned)))  # A prefix of the run.
    assert subsets.anneal_start(num_epochs, float(1 - delta)) == len(pruned), num_epochs


@pytest.mark.parametrize("num_epochs, first", [(6, 5), (10, 8), (20, 17), (8, 7), (200, 175)])
def test_infobatch_default_keeps_a_full_data_epoch_at_the_end(num_epochs, first):
  # Hand-worked: floor(0.875 C); C = 6 and 10 anneal 1 and 2 epochs (the reference's rounding).
  assert subsets.anneal_start(num_epochs, 0.125) == first


@pytest.mark.parametrize("overrides, message", [
    ({}, "config.selection.score='entropy' does not work with method='infobatch' "
         "(it prunes by the train pass's own per-example loss); valid: 'loss'"),
    ({"selection.score": "loss", "selection.scoring": "fresh"},
     "config.selection.scoring='fresh' does not work with method='infobatch'"),
    ({"selection.score": "loss", "selection.prune_ratio": 1.0},
     "config.selection.prune_ratio: must be in [0.0, 1.0), got 1.0"),
    ({"selection.score": "loss", "selection.anneal_fraction": -0.1},
     "config.selection.anneal_fraction: must be in [0.0, 1.0), got -0.1"),
    ({"selection.score": "loss", "num_epochs": 4, "selection.warmup_epochs": 2,
      "selection.anneal_fraction": 0.5},
     "config.selection.anneal_fraction=0.5 anneals from epoch 2 of 4, no later than "
     "warmup_epochs=2: infobatch would never prune"),
])
def test_bad_infobatch_configs_are_named(overrides, message):
  with pytest.raises(ValueError) as info:
    validation.validate(tiny_config(**{"selection.method": "infobatch", **overrides}))
  assert message in str(info.value)
  validation.validate(tiny_config(**{"selection.method": "infobatch",
                                            "selection.score": "loss", "num_epochs": 4}))


# Importance sampling (subsets.select_importance): Poisson sampling with inclusion
# probabilities pi_i = min(1, c p_i) summing to k, and Horvitz-Thompson loss weights k / (N pi_i).


def _reference_inclusion(scores, k, mix):
  """pi_i = min(1, c p_i) with sum_i pi_i = k, c found by SciPy's root finder (not by capping
  rounds), p_i = mix / N + (1 - mix) s_i / sum s, s = max(score, 0)."""
  s = np.maximum(np.asarray(scores, np.float64), 0.0)
  p = mix / len(s) + (1 - mix) * s / s.sum()
  if k == len(s):
    return np.ones(len(s))
  c = scipy.optimize.brentq(lambda c: np.minimum(1.0, c * p).sum() - k, 0.0, k / p.min(),
                            xtol=1e-14, rtol=1e-15)
  return np.minimum(1.0, c * p)


def test_importance_inclusion_probabilities_and_weights_by_hand():
  # Scores (0, 1, 1, 2), mix 1/2: p = 1/8 + s/8 = (1/8, 2/8, 2/8, 3/8); k = 2: pi = 2 p (none
  # above 1); weights k / (N pi) = 1 / (2 pi) = (2, 1, 1, 2/3).
  p = subsets.sampling_probabilities(np.array([0.0, 1.0, 1.0, 2.0]), 0.5)
  np.testing.assert_allclose(p, [1 / 8, 2 / 8, 2 / 8, 3 / 8], rtol=1e-15)
  np.testing.assert_allclose(subsets.capped_proportional(p, 2, 1.0), [0.25, 0.5, 0.5, 0.75],
                             rtol=1e-15)
  # Scores (0, 0, 0, 10), mix 0.2: p = (0.05, 0.05, 0.05, 0.85); 2 p_4 = 1.7 > 1, so the last
  # is taken for sure and the other three share the remaining 1: pi = (1/3, 1/3, 1/3, 1),
  # weights 2 / (4 pi) = (1.5, 1.5, 1.5, 0.5).
  p = subsets.sampling_probabilities(np.array([0.0, 0.0, 0.0, 10.0]), 0.2)
  np.testing.assert_allclose(p, [0.05, 0.05, 0.05, 0.85], rtol=1e-14)
  pi = subsets.capped_proportional(p, 2, 1.0)
  np.testing.assert_allclose(pi, [1 / 3, 1 / 3, 1 / 3, 1.0], rtol=1e-14)
  ids, weights = subsets.select_importance(np.array([0.0, 0.0, 0.0, 10.0]), np.arange(4), 2,
                                           0, 0, 0.2, 10.0, "unbiased")
  assert 3 in ids  # pi = 1.
  want = {0: 1.5, 1: 1.5, 2: 1.5, 3: 0.5}
  np.testing.assert_allclose(weights, [want[i] for i in ids], rtol=1e-6)
  # Normalised and clipped: raw weights (4, 1, 1, 1, 1) at mean 1 are (2.5, 0.625 x 4); with
  # at most 2 the first is 2 and the other four share 3: 0.75 each.
  np.testing.assert_allclose(subsets.capped_proportional(np.array([4.0, 1, 1, 1, 1]), 5, 10.0),
                             [2.5, 0.625, 0.625, 0.625, 0.625], rtol=1e-15)
  np.testing.assert_allclose(subsets.capped_proportional(np.array([4.0, 1, 1, 1, 1]), 5, 2.0),
                             [2.0, 0.75, 0.75, 0.75, 0.75], rtol=1e-15)
  # Negative, NaN and infinite scores count as 0; all 0 is uniform.
  np.testing.assert_allclose(
      subsets.sampling_probabilities(np.array([-1.0, np.nan, np.inf, 3.0]), 0.5),
      [0.125, 0.125, 0.125, 0.625])
  np.testing.assert_allclose(subsets.sampling_probabilities(np.zeros(5), 0.3), np.full(5, 0.2))


@pytest.mark.parametrize("n, k, mix, seed", [(200, 60, 0.2, 0), (97, 30, 0.5, 1),
                                             (50, 49, 0.05, 2), (30, 30, 0.5, 3), (40, 1, 1.0, 4)])
def test_importance_matches_a_per_example_reference(n, k, mix, seed):
  """The same uniform draws: example i is kept when u_i < pi_i (pi from a root finder), with
  weight k / (N pi_i) (unbiased) or those weights rescaled to mean 1 (normalized, no clip)."""
  rng = np.random.default_rng(seed)
  scores = rng.gamma(0.5, 1.0, n) * (rng.random(n) < 0.8)  # Skewed, some exactly 0.
  ids = np.sort(rng.choice(5 * n, n, replace=False))
  pi = _reference_inclusion(scores, k, mix)
  np.testing.assert_allclose(subsets.capped_proportional(
      subsets.sampling_probabilities(scores, mix), k, 1.0), pi, rtol=1e-9, atol=1e-12)
  for epoch in range(5):
    uniform = np.random.default_rng([7, subsets._IMPORTANCE, epoch]).random(n)
    kept = [i for i in range(n) if uniform[i] < pi[i]] or [int(np.argmin(uniform / pi))]
    got_ids, got_weights = subsets.select_importance(scores, ids, k, 7, epoch, mix, 1e9,
                                                     "unbiased")
    np.testing.assert_array_equal(got_ids, ids[kept])
    raw = np.array([k / (n * pi[i]) for i in kept])
    np.testing.assert_allclose(got_weights, raw, rtol=1e-6)
    assert got_weights.dtype == np.float32
    _, normalized = subsets.select_importance(scores, ids, k, 7, epoch, mix, 1e9, "normalized")
    np.testing.assert_allclose(normalized, raw / raw.mean(), rtol=1e-6)


def test_importance_inclusion_frequencies_and_weights_match_a_monte_carlo_estimate():
  """Over 4,000 (seed, epoch) draws each example's share of draws holding it is within 5 sd
  of pi_i, the mean epoch size is k, and the mean of w_i 1[i drawn] is k / N for every i
  (the Horvitz-Thompson weights are unbiased)."""
  rng = np.random.default_rng(5)
  n, k, mix, draws = 40, 12, 0.2, 4000
  scores = rng.exponential(size=n) ** 2
  ids = np.arange(n) * 2 + 1
  pi = _reference_inclusion(scores, k, mix)
  assert pi.max() == 1.0 and pi.min() < 0.1  # Some taken for sure, some rarely.
  drawn, weighted, sizes = np.zeros(n), np.zeros(n), []
  for seed, epoch in ((s, e) for s in range(4) for e in range(draws // 4)):
    got, weights = subsets.select_importance(scores, ids, k, seed, epoch, mix, 1e9, "unbiased")
    drawn[got // 2] += 1
    weighted[got // 2] += weights
    sizes.append(len(got))
  sd = np.sqrt(pi * (1 - pi) / draws)
  assert np.all(np.abs(drawn / draws - pi) <= 5 * sd + 1e-12)
  assert abs(np.mean(sizes) - k) < 5 * math.sqrt(np.sum(pi * (1 - pi)) / draws)
  weight_sd = (k / n) * np.sqrt((1 - pi) / pi / draws)  # sd of w 1[drawn]: w = k / (N pi).
  assert np.all(np.abs(weighted / draws - k / n) <= 5 * weight_sd + 1e-6)  # float32 weights.


def _softmax_regression(n, d, num_classes, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d))
  labels = rng.integers(0, num_classes, n)
  w = rng.normal(size=(d, num_classes))
  logits = x @ w
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  per_example = x[:, :, None] * (p - np.eye(num_classes)[labels])[:, None, :]  # dCE_i/dW.
  loss = -np.log(p[np.arange(n), labels])
  return x, labels, w, per_example.reshape(n, -1), loss


def test_importance_weighted_gradient_is_the_full_data_gradient_in_expectation():
  """Softmax regression on 60 examples, p from each example's loss: the mean over 3,000 draws
  of (1/k) sum_{i drawn} w_i g_i equals the full data's mean gradient within 5 Monte-Carlo
  standard errors in every coordinate (g_i in closed form, x_i (softmax_i - onehot_i), and
  the full gradient checked against jax.grad). The same draws without the weights miss it by
  more than that: the check has the power to see the bias that the weights remove."""
  n, k, mix, draws = 60, 15, 0.2, 3000
  x, labels, w, grads, loss = _softmax_regression(n, 4, 3, 0)
  full = grads.mean(0)
  def mean_loss(weights):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(x @ weights), labels[:, None], 1))
  np.testing.assert_allclose(np.asarray(jax.grad(mean_loss)(w)).ravel(), full, rtol=1e-5,
                             atol=1e-7)
  weighted, plain = [], []
  for epoch in range(draws):
    got, weights = subsets.select_importance(loss, np.arange(n), k, 11, epoch, mix, 1e9,
                                             "unbiased")
    weighted.append(weights.astype(np.float64) @ grads[got] / k)
    plain.append(grads[got].mean(0))
  for estimates, unbiased in ((np.array(weighted), True), (np.array(plain), False)):
    error = np.abs(estimates.mean(0) - full) / (estimates.std(0, ddof=1) / math.sqrt(draws))
    assert (error.max() < 5) == unbiased, error.max()


def test_importance_normalized_weights_have_mean_one_and_respect_the_cap():
  rng = np.random.default_rng(6)
  scores, ids = rng.exponential(size=500) ** 3, np.arange(500)
  for epoch, (mix, cap) in enumerate([(0.05, 3.0), (0.2, 10.0), (0.5, 1.0), (0.01, 1.5)]):
    got, raw = subsets.select_importance(scores, ids, 100, 0, epoch, mix, cap, "unbiased")
    same, weights = subsets.select_importance(scores, ids, 100, 0, epoch, mix, cap, "normalized")
    np.testing.assert_array_equal(got, same)
    assert weights.mean() == pytest.approx(1.0, rel=1e-6) and weights.max() <= cap * (1 + 1e-6)
    if cap == 1.0:  # Mean 1, none above 1: all 1.
      np.testing.assert_allclose(weights, 1.0, rtol=1e-6)
      continue
    below = weights < cap * (1 - 1e-6)  # Unclipped: one common factor times the raw weight.
    ratio = weights[below] / raw[below]
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-5)
    assert np.all(raw[~below] >= raw[below].max() * (1 - 1e-5))  # Clipped: the largest.
  assert (~below).sum() > 0  # The last case (mix 0.01, cap 1.5) clips some.


def test_importance_is_deterministic_per_seed_and_epoch_and_never_empty():
  rng = np.random.default_rng(8)
  scores, ids = rng.exponential(size=300), np.arange(300) + 5
  first = subsets.select_importance(scores, ids, 90, 3, 4, 0.5, 10.0)
  again = subsets.select_importance(scores, ids, 90, 3, 4, 0.5, 10.0)
  np.testing.assert_array_equal(first[0], again[0])
  np.testing.assert_array_equal(first[1], again[1])
  assert not np.array_equal(first[0], subsets.select_importance(scores, ids, 90, 3, 5, 0.5,
                                                                10.0)[0])
  assert not np.array_equal(first[0], subsets.select_importance(scores, ids, 90, 4, 4, 0.5,
                                                                10.0)[0])
  # Uniform p (mix 1): every weight is 1, and k = 1 of 50 draws nothing in about
  # (1 - 1/50)^50 = 36 % of the epochs: then the one with the smallest u / pi is kept.
  empty = 0
  for epoch in range(40):
    got, weights = subsets.select_importance(np.ones(50), np.arange(50), 1, 0, epoch, 1.0, 10.0)
    uniform = np.random.default_rng([0, subsets._IMPORTANCE, epoch]).random(50)
    if not np.any(uniform < 1 / 50):
      empty += 1
      assert got.tolist() == [int(np.argmin(uniform))]
    assert len(got) >= 1 and np.all(weights == 1.0)
  assert empty > 5
  np.testing.assert_array_equal(subsets.select_importance(scores, ids, 300, 0, 0, 0.3, 10.0)[0],
                                ids)  # k = N: everything, pi = 1.
  with pytest.raises(ValueError, match="weighting='hajek'; valid choices: normalized, unbiased"):
    subsets.select_importance(scores, ids, 90, 0, 0, 0.5, 10.0, "hajek")


@pytest.mark.parametrize("overrides, message", [
    ({"selection.mix": 0.0}, "config.selection.mix: must be in (0.0, 1.0], got 0.0"),
    ({"selection.mix": 1.5}, "config.selection.mix: must be in (0.0, 1.0], got 1.5"),
    ({"selection.max_weight": 0.5}, "config.selection.max_weight: must be at least 1.0, got 0.5"),
    ({"selection.weighting": "hajek"},
     "config.selection.weighting: got 'hajek'; valid choices: normalized, unbiased"),
    ({"selection.score": "margin"},
     "config.selection.score='margin' can be negative, and method='importance' draws with "
     "probabilities proportional to the score; valid: entropy, least_confidence, loss, el2n"),
    ({"selection.direction": "easiest"},
     "config.selection.direction='easiest' does not work with method='importance' (it draws "
     "with probabilities that grow with the score); valid: 'hardest'"),
])
def test_bad_importance_configs_are_named(overrides, message):
  with pytest.raises(ValueError) as info:
    validation.validate(tiny_config(**{"selection.method": "importance", **overrides}))
  assert message in str(info.value)
  validation.validate(tiny_config(**{
      "selection.method": "importance", "selection.score": "el2n", "selection.mix": 1.0,
      "selection.final_full_epochs": 1, "num_epochs": 4, "selection.warmup_epochs": 1}))


def test_infobatch_without_its_rescaling_prunes_alike_with_unit_weights():
  rng = np.random.default_rng(9)
  scores, ids = rng.exponential(size=400), np.arange(400)
  for epoch in range(5):
    kept, weights = subsets.select_infobatch(scores, ids, 2, epoch, 0.95, 10)
    same, unit = subsets.select_infobatch(scores, ids, 2, epoch, 0.95, 10, rescale=False)
    np.testing.assert_array_equal(kept, same)
    assert np.all(unit == 1.0) and unit.dtype == np.float32 and np.any(weights == np.float32(20))
  assert policies.POLICIES.defaults()["infobatch_rescale"] is True
  config = tiny_config(**{"selection.method": "infobatch", "selection.score": "loss",
                          "num_epochs": 4, "selection.infobatch_rescale": False})
  validation.validate(config)
  del config.selection["infobatch_rescale"]  # A hand-edited config's value of another type.
  config.selection["infobatch_rescale"] = 0
  with pytest.raises(ValueError, match="config.selection.infobatch_rescale: must be True or "
                                       "False, got 0"):
    validation.validate(config)


def test_the_scores_declared_nonnegative_are_never_negative():
  """importance takes only these: on random and near-one-hot logits each is >= 0 up to
  rounding (entropy's +1e-6 inside the log can make a one-hot's -4e-7); margin is not."""
  rng = np.random.default_rng(10)
  logits = jnp.asarray(np.concatenate([rng.normal(size=(200, 10)),
                                       30 * np.eye(10)[rng.integers(0, 10, 50)]]), jnp.float32)
  labels = jnp.asarray(rng.integers(0, 10, 250))
  declared = [s for s in scores.SCORES.entries() if s.nonnegative]
  assert {s.name for s in declared} == {"entropy", "least_confidence", "loss", "el2n"}
  for score in declared:
    assert float(jnp.min(score.fn(logits, labels))) >= -1e-6, score.name
  assert float(jnp.min(scores.margin(logits, labels))) < 0
