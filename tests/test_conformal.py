"""Conformal prediction sets (cpjax.calibration.conformal, the report's section;
docs/methods.md#conformal-prediction-sets): hand-worked cases, a second implementation written
differently (one row at a time, Python's own sort and sums), the JAX path, the threshold's
finite-sample rule at its edges, and coverage on exchangeable generated data as a
statistical test."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from configs import default
from cpjax.calibration import bootstrap, conformal, figures, metrics, posthoc, report, report_files

RAPS = {"lam": 0.25, "k_reg": 1}  # Dyadic: every hand-worked score below is exact in binary.

# Four calibration rows of three classes (probabilities in eighths: every sum exact). Ranks
# (1 = most probable, ties to the smaller class index) and label scores by hand:
#   row   p                   y  rank  lac = 1 - p_y  aps (u = 1) = rho_r   raps = aps + (r - 1) / 4
#   a  (0.5, 0.375, 0.125)    0   1     0.5            0.5                   0.5
#   b  (0.5, 0.375, 0.125)    1   2     0.625          0.875                 1.125
#   c  (0.25, 0.625, 0.125)   1   1     0.375          0.625                 0.625
#   d  (0.125, 0.125, 0.75)   0   2     0.875          0.875 (class 0 ranks    1.125
#                                                     before its tie, class 1)
# Randomised APS, u = (0.5, 0.25, 0.75, 0.5): rho_{r-1} + u p_y =
#   a 0.25, b 0.5 + 0.25 * 0.375 = 0.59375, c 0.75 * 0.625 = 0.46875, d 0.75 + 0.0625 = 0.8125.
CALIBRATION = np.array([[0.5, 0.375, 0.125], [0.5, 0.375, 0.125], [0.25, 0.625, 0.125],
                        [0.125, 0.125, 0.75]])
CALIBRATION_LABELS = np.array([0, 1, 1, 0])
CALIBRATION_U = np.array([0.5, 0.25, 0.75, 0.5])
HAND_LABEL_SCORES = {"lac": [0.5, 0.625, 0.375, 0.875], "aps": [0.5, 0.875, 0.625, 0.875],
                     "raps": [0.5, 1.125, 0.625, 1.125]}


@pytest.mark.parametrize("name", ["lac", "aps", "raps"])
def test_label_scores_by_hand(name):
  settings = RAPS if name == "raps" else {}
  got = conformal.label_scores(name, CALIBRATION, CALIBRATION_LABELS, **settings)
  assert got.tolist() == HAND_LABEL_SCORES[name]


def test_randomised_aps_label_scores_by_hand():
  got = conformal.label_scores("aps", CALIBRATION, CALIBRATION_LABELS, CALIBRATION_U)
  assert got.tolist() == [0.25, 0.59375, 0.46875, 0.8125]


def test_every_class_score_of_a_row_by_hand():
  """p = (0.5, 0.375, 0.125): lac 1 - p = (0.5, 0.625, 0.875); aps rho = (0.5, 0.875, 1.0);
  aps with u = 0.5: (0.25, 0.5 + 0.1875, 0.875 + 0.0625); raps (lambda 1/4, k_reg 1): rho +
  (0, 0.25, 0.5). In class order; rank order is the same here."""
  row = CALIBRATION[:1]
  assert conformal.class_scores("lac", row).tolist() == [[0.5, 0.625, 0.875]]
  assert conformal.class_scores("aps", row).tolist() == [[0.5, 0.875, 1.0]]
  assert conformal.class_scores("aps", row, np.array([0.5])).tolist() == [[0.25, 0.6875, 0.9375]]
  assert conformal.class_scores("raps", row, **RAPS).tolist() == [[0.5, 1.125, 1.5]]
  # p = (0.125, 0.125, 0.75): ranks 2, 3, 1 (the tie to class 0). aps in class order:
  # class 0: 0.75 + 0.125, class 1: 0.875 + 0.125, class 2: 0.75; in rank order sorted.
  tied = CALIBRATION[3:]
  assert conformal.class_scores("aps", tied).tolist() == [[0.875, 1.0, 0.75]]
  assert conformal.rank_scores("aps", tied).tolist() == [[0.75, 0.875, 1.0]]
  assert conformal.label_ranks(tied, np.array([1])).tolist() == [3]


def test_thresholds_and_sets_by_hand():
  """n = 4: alpha = 0.4 takes the k = ceil(5 * 0.6) = 3rd smallest score, alpha = 0.2 the
  4th (k = n), alpha = 0.19 would need the 5th (ceil(4.05)): refused.
  lac scores sorted 0.375, 0.5, 0.625, 0.875: q(0.4) = 0.625, q(0.2) = 0.875.
  aps 0.5, 0.625, 0.875, 0.875: q(0.4) = 0.875. raps 0.5, 0.625, 1.125, 1.125: q(0.4) = 1.125.
  Randomised aps 0.25, 0.46875, 0.59375, 0.8125: q(0.4) = 0.59375."""
  def q(name, alpha, u=None, **settings):
    return conformal.threshold(conformal.label_scores(name, CALIBRATION, CALIBRATION_LABELS,
                                                      u, **settings), alpha)
  assert (q("lac", 0.4), q("lac", 0.2), q("aps", 0.4), q("raps", 0.4, **RAPS)) == (
      0.625, 0.875, 0.875, 1.125)
  assert q("aps", 0.4, CALIBRATION_U) == 0.59375
  with pytest.raises(ValueError, match=r"alpha=0.19 needs the k-th smallest of the n = 4 "
                                       r"validation scores, k = ceil\(\(n \+ 1\)\(1 - alpha\)\) "
                                       r"= 5 > n; the smallest reachable alpha is 1/\(n \+ 1\) "
                                       r"= 1/5 \(0.2, rounded up\)"):
    q("lac", 0.19)
  # Test rows: t = (0.5, 0.375, 0.125), label 2; s = (0.125, 0.125, 0.75), label 1;
  # e = (0.9375, 0.03125, 0.03125), label 0.
  #   lac q = 0.625: t scores (0.5, 0.625, 0.875) -> {0, 1}; s (0.875, 0.875, 0.25) -> {2};
  #     e (0.0625, 0.96875, 0.96875) -> {0}.
  #   aps q = 0.875: t (0.5, 0.875, 1.0) -> {0, 1}; s (0.875, 1.0, 0.75) -> {0, 2} (class 0
  #     ranks before its tie); e: its top class's score 0.9375 > q -> the empty set.
  #   raps q = 1.125: t (0.5, 1.125, 1.5) -> {0, 1}; s (1.125, 1.5, 0.75) -> {0, 2};
  #     e (0.9375, 0.96875 + 0.25, 1.0 + 0.5) -> {0}: above aps's q, below raps's.
  #   randomised aps q = 0.59375, u = 0.5: t (0.25, 0.6875, 0.9375) -> {0}.
  test = np.array([[0.5, 0.375, 0.125], [0.125, 0.125, 0.75], [0.9375, 0.03125, 0.03125]])
  sets = {"lac": [[1, 1, 0], [0, 0, 1], [1, 0, 0]], "aps": [[1, 1, 0], [1, 0, 1], [0, 0, 0]],
          "raps": [[1, 1, 0], [1, 0, 1], [1, 0, 0]]}
  for name, threshold in (("lac", 0.625), ("aps", 0.875), ("raps", 1.125)):
    settings = RAPS if name == "raps" else {}
    got = conformal.prediction_sets(name, test, threshold, **settings)
    assert got.astype(int).tolist() == sets[name], name
  assert conformal.prediction_sets("aps", test[:1], 0.59375, np.array([0.5])).tolist() == [
      [True, False, False]]
  found = conformal.split_conformal((CALIBRATION, CALIBRATION_LABELS), (test, np.array([2, 1, 0])),
                                    ["lac", "aps", "raps"], [0.4], {"raps": RAPS})
  assert [found[name, 0.4].sizes.tolist() for name in ("lac", "aps", "raps")] == [
      [2, 1, 1], [2, 2, 0], [2, 2, 1]]
  assert [found[name, 0.4].covered.tolist() for name in ("lac", "aps", "raps")] == [
      [False, False, True], [False, False, False], [False, False, True]]
  assert {found[key].rank for key in found} == {3}


@pytest.mark.parametrize("num_rows, alpha, k", [
    (99, 0.1, 90),  # 100 * 0.9 = 90 exactly.
    (100, 0.1, 91),  # 101 * 0.9 = 90.9.
    (9, 0.7, 3),  # 10 * 0.3 = 3 exactly; in floats 10 * (1 - 0.7) = 3.0000000000000004 -> 4.
    (4, 0.2, 4),  # k = n: the largest score, allowed.
    (180, 0.1, 163),  # ceil(181 * 0.9 = 162.9).
])
def test_the_quantile_rank_is_exact(num_rows, alpha, k):
  assert conformal.quantile_rank(num_rows, alpha) == k


@pytest.mark.parametrize("num_rows, alpha, refused", [
    (4, 0.2, False), (4, 0.19, True),  # 1/(n + 1) = 0.2: the smallest reachable alpha.
    (180, 1 / 181 + 1e-12, False), (180, 0.005, True),
    (9, 0.1, False), (9, 0.09, True),  # ceil(10 * 0.91) = 10 = n + 1.
])
def test_the_threshold_refuses_a_rank_beyond_n(num_rows, alpha, refused):
  scores = np.arange(num_rows, dtype=np.float64)
  if refused:
    with pytest.raises(ValueError, match=rf"> n; the smallest reachable alpha is 1/\(n \+ 1\) = "
                                         rf"1/{num_rows + 1} "):
      conformal.threshold(scores, alpha)
  else:  # The k-th smallest of 0, 1, ..., n - 1 is k - 1.
    assert conformal.threshold(scores, alpha) == conformal.quantile_rank(num_rows, alpha) - 1


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5, float("nan"), True, "0.1"])
def test_an_alpha_outside_zero_one_is_refused(alpha):
  assert "must be a number in (0, 1)" in conformal.alpha_problem(alpha, 100)
  with pytest.raises(ValueError):
    conformal.threshold(np.zeros(100), alpha)


def test_the_config_checks_name_bad_values_and_valid_choices():
  assert conformal.names_problem(("lac", "apss")) == (
      "got 'apss'; did you mean aps or raps? valid choices: aps, lac, raps")
  assert conformal.names_problem(("lac", "lac")) == "names a score twice: ('lac', 'lac')"
  assert conformal.names_problem(()) is None and conformal.names_problem(["raps"]) is None
  assert conformal.alphas_problem(0.1) is None and conformal.alphas_problem((0.05, 0.1)) is None
  assert conformal.alphas_problem((0.1, 1.0)) == "must be a number in (0, 1), got 1.0"
  assert conformal.alphas_problem(()) == (
      "must be a number in (0, 1) or a non-empty tuple of them, got ()")
  assert conformal.alphas_problem([0.1, 0.1]) == "names an alpha twice: [0.1, 0.1]"


# ------------------------------------------------------------------------------------------
# A second implementation: one row at a time, Python's sort and left-to-right sums.


def _reference_class_scores(p, name, u=1.0, lam=0.0, k_reg=0):
  """Every class's score of one row [K], the definitions written out."""
  order = sorted(range(len(p)), key=lambda k: (-p[k], k))
  out, above = [0.0] * len(p), 0.0
  for rank, k in enumerate(order, 1):
    if name == "lac":
      out[k] = 1 - p[k]
    else:
      out[k] = above + u * p[k]
      if name == "raps":
        out[k] = out[k] + lam * max(rank - k_reg, 0)
    above = above + p[k]
  return out


def _reference_split(val_p, val_y, test_p, test_y, name, alpha, u_val, u_test, settings):
  """(threshold, sets [N][K] bool, sizes, covered) by the reference, k by integers."""
  cal = sorted(_reference_class_scores(val_p[i], name, u_val[i], **settings)[val_y[i]]
               for i in range(len(val_y)))
  scale = 10**6  # The alphas here have at most six decimals: alpha = a / scale exactly.
  k = -(-(len(cal) + 1) * (scale - round(alpha * scale)) // scale)  # An integer ceiling.
  q = cal[k - 1]
  sets = [[s <= q for s in _reference_class_scores(test_p[i], name, u_test[i], **settings)]
          for i in range(len(test_y))]
  return q, sets, [sum(row) for row in sets], [row[y] for row, y in zip(sets, test_y)]


def _generated(rng, n, num_classes, ties=True):
  """Rows of probabilities with exact ties and zeros where asked, and labels."""
  z = rng.normal(size=(n, num_classes)) * 2.0
  p = np.exp(z)
  p /= p.sum(1, keepdims=True)
  if ties:
    p[: n // 5, 1] = p[: n // 5, 0]  # Tied pairs (class 0 ranks first).
    p[n // 5: n // 4, -1] = 0.0  # A zero probability.
    p[n // 4: n // 3] = 1.0 / num_classes  # A row of ties.
  labels = (p.cumsum(1) > rng.random((n, 1))).argmax(1)
  return p, labels


@pytest.mark.parametrize("randomised", [False, True])
@pytest.mark.parametrize("search", [False, True])
@pytest.mark.parametrize("depth", [2, 32])
def test_the_driver_equals_the_reference_exactly(randomised, search, depth, monkeypatch):
  """Thresholds, every set's size, each label's coverage, at several alphas, on rows with
  ties and zeros, in blocks of 16 rows (the report's blocks of rows are the same functions
  on fewer rows); randomised: both given the same u; search: sizes and label ranks by binary
  search along the rows sorted whole (the driver's way above SEARCH_ABOVE classes), else
  counted; depth: the ranks the driver sorts first (2 of 7: most labels and sets reach past
  them, and ties straddle them; 32: every rank)."""
  monkeypatch.setattr(conformal, "BLOCK_ENTRIES", 16 * 7)
  monkeypatch.setattr(conformal, "SEARCH_ABOVE", 0 if search else 1000)
  monkeypatch.setattr(conformal, "TOP_RANKS", depth)
  rng = np.random.default_rng(3)
  (val_p, val_y), (test_p, test_y) = _generated(rng, 150, 7), _generated(rng, 120, 7)
  u_val = rng.random(150) if randomised else np.ones(150)
  u_test = rng.random(120) if randomised else np.ones(120)
  draws = {conformal.VALIDATION: u_val, conformal.TEST: u_test} if randomised else None
  settings = {"lam": 0.07, "k_reg": 2}
  found = conformal.split_conformal((val_p, val_y), (test_p, test_y), ["lac", "aps", "raps"],
                                    [0.1, 0.5], {"raps": settings}, draws)
  for (name, alpha), sets in found.items():
    score_settings = settings if name == "raps" else {}
    randomised_score = name != "lac"
    q, ref_sets, sizes, covered = _reference_split(
        val_p, val_y, test_p, test_y, name, alpha, u_val if randomised_score else np.ones(150),
        u_test if randomised_score else np.ones(120), score_settings)
    assert sets.threshold == q, (name, alpha)
    assert sets.sizes.tolist() == sizes and sets.covered.tolist() == covered, (name, alpha)
    u = u_test if randomised and randomised_score else None
    assert conformal.prediction_sets(name, test_p, q, u, **score_settings).tolist() == ref_sets
  sizes = np.concatenate([sets.sizes for sets in found.values()])
  assert sizes.min() == 0 and sizes.max() >= 5  # Empty and large sets are among the cases.


def test_a_transform_block_by_block_equals_the_whole_probabilities(monkeypatch):
  """Logits mapped by softmax (log-probabilities by exp) one block of rows at a time give the
  sets of the whole split's probabilities: the maps are row-wise, so each row's numbers are
  the same."""
  monkeypatch.setattr(conformal, "BLOCK_ENTRIES", 32 * 7)  # Blocks of 32 rows.
  rng = np.random.default_rng(8)
  val_z, test_z, ood_z = (rng.normal(size=(n, 7)) * 3 for n in (150, 120, 70))
  val_y, test_y = rng.integers(0, 7, 150), rng.integers(0, 7, 120)
  args = (["lac", "aps", "raps"], [0.1, 0.3], {"raps": {"lam": 0.02, "k_reg": 2}})
  whole = conformal.split_conformal((metrics.softmax(val_z), val_y),
                                    (metrics.softmax(test_z), test_y), *args,
                                    ood_probs=metrics.softmax(ood_z))
  for transform, rows in ((metrics.softmax, lambda z: z),
                          (np.exp, metrics.log_softmax)):
    blocks = conformal.split_conformal((rows(val_z), val_y), (rows(test_z), test_y), *args,
                                       ood_probs=rows(ood_z), transform=transform)
    for key, sets in whole.items():
      got = blocks[key]
      assert got.threshold == sets.threshold and got.rank == sets.rank
      for field in ("covered", "sizes", "ood_sizes"):
        assert np.array_equal(getattr(got, field), getattr(sets, field)), (key, field)


def test_the_searches_equal_the_counts_at_many_classes():
  """K = 300 (> SEARCH_ABOVE): label ranks and set sizes by binary search equal the counts
  over every class, on rows with tied labels (both orders of the tie) and rows of ties."""
  rng = np.random.default_rng(1)
  probs = rng.dirichlet(np.full(300, 0.3), size=400)
  probs[:50, 3] = probs[:50, 7]
  probs[50:60] = 1 / 300
  labels = rng.integers(0, 300, 400)
  labels[:25], labels[25:50] = 7, 3
  view = conformal.ranked(probs)
  assert 300 > conformal.SEARCH_ABOVE
  assert np.array_equal(conformal.sorted_label_ranks(view, labels),
                        conformal.label_ranks(probs, labels))
  u = rng.random(400)
  for name, settings in (("lac", {}), ("aps", {}), ("raps", {"lam": 0.002, "k_reg": 3})):
    matrix = conformal.rank_scores(name, probs, u, **settings)
    for q in np.quantile(matrix[:, :40], [0.1, 0.5, 0.9]):
      assert np.array_equal(conformal.sorted_set_sizes(name, view, q, u, **settings),
                            conformal.set_sizes(matrix, q)), (name, q)


@pytest.mark.parametrize("name", ["lac", "aps", "raps"])
def test_class_scores_equal_the_reference_on_every_class(name):
  rng = np.random.default_rng(5)
  probs, _ = _generated(rng, 60, 9)
  u = rng.random(60)
  settings = {"lam": 0.03, "k_reg": 3} if name == "raps" else {}
  got = conformal.class_scores(name, probs, None if name == "lac" else u, **settings)
  want = [_reference_class_scores(probs[i], name, 1.0 if name == "lac" else u[i], **settings)
          for i in range(60)]
  assert got.tolist() == want
  # Non-decreasing along each row's ranks, as the sets' prefix rule needs.
  assert np.all(np.diff(conformal.rank_scores(name, probs, None if name == "lac" else u,
                                              **settings), axis=1) >= 0)


def test_the_jax_path_is_jitted_and_equals_numpy():
  """jax.numpy under jit, float32 probabilities in sixty-fourths (every sum exact, so both
  paths give the same numbers bit for bit), ties included."""
  rng = np.random.default_rng(7)
  counts = rng.multinomial(64, np.full(6, 1 / 6), size=40)
  probs = (counts / 64).astype(np.float32)
  labels = rng.integers(0, 6, 40)
  u = (rng.integers(0, 8, 40) / 8).astype(np.float32)
  settings = {"lam": 0.125, "k_reg": 2}
  for name in ("lac", "aps", "raps"):
    keywords = settings if name == "raps" else {}

    @jax.jit
    def jitted(p, y, u, name=name, keywords=keywords):
      scores = conformal.label_scores(name, p, y, u, jnp, **keywords)
      q = conformal.threshold(scores, 0.2, jnp)
      return scores, q, conformal.prediction_sets(name, p, q, u, jnp, **keywords)
    scores, q, sets = jitted(jnp.asarray(probs), jnp.asarray(labels), jnp.asarray(u))
    want_scores = conformal.label_scores(name, probs, labels, u, **keywords)
    want_q = conformal.threshold(want_scores, 0.2)
    np.testing.assert_array_equal(np.asarray(scores), want_scores)
    assert float(q) == float(want_q)
    np.testing.assert_array_equal(np.asarray(sets),
                                  conformal.prediction_sets(name, probs, want_q, u, **keywords))


def test_summary_by_hand():
  """Labels (0, 0, 1, 1, 1, 2), covered (1, 0, 1, 1, 0, 1), sizes (1, 0, 2, 1, 3, 1), 4
  classes: coverage 4/6; per class 1/2, 2/3, 1, none (class 3 has no rows); worst class 0
  (1/2, 2 rows); mean size 8/6, median (1 + 1) / 2 = 1; singletons 3/6, empty 1/6; by size
  0: 0/1, 1: 3/3, 2: 1/1, 3: 0/1."""
  got = conformal.summary(np.array([1, 0, 1, 1, 0, 1], bool), np.array([1, 0, 2, 1, 3, 1]),
                          np.array([0, 0, 1, 1, 1, 2]), 4)
  assert got["coverage"] == 4 / 6 and got["mean_size"] == 8 / 6 and got["median_size"] == 1.0
  assert got["singleton_share"] == 0.5 and got["empty_share"] == 1 / 6
  assert got["class_coverage"][:3] == [0.5, 2 / 3, 1.0] and math.isnan(got["class_coverage"][3])
  assert got["class_rows"] == [2, 3, 1, 0]
  assert (got["worst_class"], got["worst_class_coverage"], got["worst_class_rows"]) == (0, 0.5, 2)
  assert got["by_size"] == {"size": [0, 1, 2, 3], "rows": [1, 3, 1, 1],
                            "coverage": [0.0, 1.0, 1.0, 0.0]}


def test_uniform_draws_are_seeded_per_split():
  first = conformal.uniform_draws(3, conformal.TEST, 5)
  assert np.array_equal(first, np.random.default_rng([3, 1]).random(5))
  assert np.array_equal(first, conformal.uniform_draws(3, conformal.TEST, 5))
  assert not np.array_equal(first, conformal.uniform_draws(3, conformal.VALIDATION, 5))


# ------------------------------------------------------------------------------------------
# Coverage on exchangeable generated data: a statistical test at a stated level.

DRAWS, CALIBRATION_ROWS, TEST_ROWS, ALPHA = 2000, 49, 50, 0.1
LEVEL = 0.001  # Each check below fails a correct implementation with probability <= 0.1 %.


def _coverage_counts(name: str, randomised: bool, seed: int) -> np.ndarray:
  """[DRAWS] the covered test rows of each draw: a calibration set and a test set of i.i.d.
  (so exchangeable) generated rows, K = 5, a miscalibrated model (labels drawn from
  softmax(1.5 z), probabilities softmax(z)); thresholds by `conformal.threshold`."""
  rng = np.random.default_rng(seed)
  rows = DRAWS * (CALIBRATION_ROWS + TEST_ROWS)
  z = rng.normal(size=(rows, 5)) * 1.5
  probs = np.exp(z) / np.exp(z).sum(1, keepdims=True)
  truth = np.exp(1.5 * z) / np.exp(1.5 * z).sum(1, keepdims=True)
  labels = (truth.cumsum(1) > rng.random((rows, 1))).argmax(1)
  u = rng.random(rows) if randomised else None
  settings = {"lam": 0.05, "k_reg": 1} if name == "raps" else {}
  scores = conformal.label_scores(name, probs, labels, u, **settings).reshape(DRAWS, -1)
  q = np.array([conformal.threshold(row[:CALIBRATION_ROWS], ALPHA) for row in scores])
  return np.sum(scores[:, CALIBRATION_ROWS:] <= q[:, None], axis=1)


def _merged_chi_square(observed: np.ndarray, expected: np.ndarray) -> float:
  """The chi-square test's p-value after merging neighbouring cells until each expects >= 5."""
  cells_observed, cells_expected, o, e = [], [], 0.0, 0.0
  for count, mass in zip(observed, expected):
    o, e = o + count, e + mass
    if e >= 5:
      cells_observed.append(o)
      cells_expected.append(e)
      o, e = 0.0, 0.0
  cells_observed[-1] += o
  cells_expected[-1] += e
  return scipy.stats.chisquare(cells_observed, cells_expected).pvalue


@pytest.mark.parametrize("name, randomised", [("lac", False), ("aps", True), ("raps", True)])
def test_coverage_follows_the_beta_binomial_law_of_split_conformal(name, randomised):
  """With continuous scores and n calibration rows, a draw's coverage is Beta(k, n + 1 - k),
  k = ceil((n + 1)(1 - alpha)) (Vovk et al. 2005; Angelopoulos & Bates 2021), so the covered
  count of its m test rows is Beta-Binomial(m, k, n + 1 - k): here n = 49, alpha = 0.1, k =
  45, mean 45 / 50 = 1 - alpha. Over 2,000 draws: the counts' distribution is that law
  (chi-square) and the mean coverage is not below 1 - alpha (one-sided z-test), each at
  LEVEL."""
  k = conformal.quantile_rank(CALIBRATION_ROWS, ALPHA)
  law = scipy.stats.betabinom(TEST_ROWS, k, CALIBRATION_ROWS + 1 - k)
  counts = _coverage_counts(name, randomised, seed=11)
  observed = np.bincount(counts, minlength=TEST_ROWS + 1)
  assert _merged_chi_square(observed, DRAWS * law.pmf(np.arange(TEST_ROWS + 1))) > LEVEL
  standard_error = math.sqrt(law.var() / DRAWS) / TEST_ROWS
  z = (counts.mean() / TEST_ROWS - (1 - ALPHA)) / standard_error
  assert z > scipy.stats.norm.ppf(LEVEL), z


def test_deterministic_aps_covers_at_least_one_minus_alpha():
  """u = 1: the label's score rho_r has atoms (rho_K = 1 for a last-ranked label), so the
  coverage law is only bounded below: mean coverage >= 1 - alpha (one-sided z-test at
  LEVEL, with the Beta-Binomial variance as a scale)."""
  k = conformal.quantile_rank(CALIBRATION_ROWS, ALPHA)
  law = scipy.stats.betabinom(TEST_ROWS, k, CALIBRATION_ROWS + 1 - k)
  counts = _coverage_counts("aps", False, seed=12)
  z = (counts.mean() / TEST_ROWS - (1 - ALPHA)) / (math.sqrt(law.var() / DRAWS) / TEST_ROWS)
  assert z > scipy.stats.norm.ppf(LEVEL), z


# ------------------------------------------------------------------------------------------
# The report's section (cpjax.calibration.report.conformal_section), against the reference.


def _report_inputs(seed=9, num_classes=6):
  rng = np.random.default_rng(seed)

  def logits(n):
    labels = rng.integers(0, num_classes, n)
    z = rng.normal(size=(n, num_classes)) + 2.0 * np.eye(num_classes)[labels]
    return 2.5 * z, labels  # Over-confident: the temperature map has something to fit.
  val, test = logits(200), logits(300)
  calibrator = posthoc.fit("temperature", *val)
  table = report.PosthocTable({"chosen": "temperature"}, calibrator,
                              posthoc.apply(calibrator, test[0]))
  return val, test, table, rng.normal(size=(80, num_classes))


def _config(**overrides):
  config = default.get_config().evaluation
  config.bootstrap_resamples = 60
  config.conformal_alpha = (0.1, 0.2)
  config.update(overrides)
  return config


@pytest.mark.parametrize("randomised", [False, True])
def test_the_report_section_equals_the_reference(randomised):
  """Every set's threshold and test numbers (coverage overall and per class, the worst class,
  mean and median size, singleton and empty shares, coverage by size) and the OOD mean size,
  before and after the map, from the reference's sets of the same probabilities; the
  intervals are the generic bootstrap's of the same rows (same seed), bit for bit."""
  val, test, table, ood = _report_inputs()
  config = _config(conformal_randomized=randomised, conformal_seed=4)
  section = report.conformal_section(val, test, 6, config, table, ood)
  probabilities = {
      "uncalibrated": [conformal.softmax(z) for z in (val[0], test[0], ood)],
      "calibrated": [np.exp(posthoc.apply(table.calibrator, z)) for z in (val[0], test[0], ood)]}
  draws = [conformal.uniform_draws(4, split, n) if randomised else np.ones(n)
           for split, n in enumerate((200, 300, 80))]
  settings = {"lam": 0.01, "k_reg": 5}
  assert section["alphas"] == [0.1, 0.2] and section["skipped"] == {}
  assert section["calibrator"] == "temperature" and section["validation_rows"] == 200
  for tag, (val_p, test_p, ood_p) in probabilities.items():
    for name in ("lac", "aps", "raps"):
      score_settings = settings if name == "raps" else {}
      u = draws if name != "lac" else [np.ones(n) for n in (200, 300, 80)]
      for alpha in (0.1, 0.2):
        entry = section["sets"][tag][name][repr(alpha)]
        q, _, sizes, covered = _reference_split(val_p, val[1], test_p, test[1], name, alpha,
                                                u[0], u[1], score_settings)
        _, _, ood_sizes, _ = _reference_split(val_p, val[1], ood_p, np.zeros(80, int), name,
                                              alpha, u[0], u[2], score_settings)
        _check_entry(entry, q, np.array(sizes), np.array(covered), test[1], ood_sizes, config)


def _check_entry(entry, q, sizes, covered, labels, ood_sizes, config):
  assert entry["threshold"] == q
  got = entry["test"]
  assert got["coverage"] == pytest.approx(covered.mean(), abs=1e-15)
  assert got["mean_size"] == pytest.approx(sizes.mean(), abs=1e-15)
  ordered = sorted(sizes.tolist())
  assert got["median_size"] == (ordered[149] + ordered[150]) / 2  # 300 rows: the middle two.
  assert got["singleton_share"] == pytest.approx(np.mean(sizes == 1), abs=1e-15)
  assert got["empty_share"] == pytest.approx(np.mean(sizes == 0), abs=1e-15)
  per_class = [covered[labels == k].mean() for k in range(6)]
  assert got["class_coverage"] == pytest.approx(per_class, abs=1e-15)
  assert got["worst_class"] == int(np.argmin(per_class))
  present = sorted(set(sizes.tolist()))
  assert got["by_size"]["size"] == present
  assert got["by_size"]["rows"] == [int(np.sum(sizes == s)) for s in present]
  assert got["by_size"]["coverage"] == pytest.approx(
      [covered[sizes == s].mean() for s in present], abs=1e-15)
  assert entry["ood"]["mean_size"] == pytest.approx(np.mean(ood_sizes), abs=1e-15)
  rows = {"coverage": covered, "mean_size": sizes, "singleton_share": sizes == 1,
          "empty_share": sizes == 0}
  for stat, values in rows.items():
    want = bootstrap.bootstrap_interval(np.mean, (values.astype(np.float64),),
                                        num_resamples=config.bootstrap_resamples,
                                        level=config.bootstrap_level,
                                        kind=config.bootstrap_kind, seed=config.bootstrap_seed)
    assert entry["intervals"][stat] == want._asdict(), stat  # Bit for bit.


def test_the_section_reuses_the_reports_resamples_and_skips_an_unreached_alpha(caplog):
  """The row counts the report's other intervals record (`_intervals`'s counts_out) give the
  intervals the section draws itself; an alpha the validation rows do not reach (a dataset's
  own validation split: known only here) is skipped, named and logged."""
  val, test, table, _ = _report_inputs()
  config = _config()
  counts = []
  report._intervals(test[0], test[1], 6, config, counts_out=counts)  # pylint: disable=protected-access
  assert len(counts) == 1 and counts[0].shape == (60, 300) and counts[0].dtype == np.uint8
  assert np.all(counts[0].sum(1) == 300)
  shared = report.conformal_section(val, test, 6, config, table, None, counts)
  drawn = report.conformal_section(val, test, 6, config, table)
  assert shared == drawn
  config.conformal_alpha = (0.1, 0.004)  # n = 200: k = ceil(201 * 0.996) = 201.
  section = report.conformal_section(val, test, 6, config, table)
  assert section["alphas"] == [0.1] and list(section["skipped"]) == ["0.004"]
  assert "1/(n + 1) = 1/201" in section["skipped"]["0.004"]
  assert "Conformal prediction sets at alpha 0.004 skipped" in caplog.text
  config.conformal_scores = ()
  assert report.conformal_section(val, test, 6, config, table) is None


def test_the_sections_markdown_record_and_figure():
  """results.md: a table per alpha with a row per score and probabilities, the worst class by
  name where the run has class names; metrics.jsonl: each set's test numbers and OOD mean
  size; the set-size figure is drawn once for a section's PNG and its TensorBoard image."""
  val, test, table, ood = _report_inputs()
  section = report.conformal_section(val, test, 6, _config(), table, ood)
  names = [f"name{k}" for k in range(6)]
  text = "\n".join(report_files._conformal_markdown(section, names))  # pylint: disable=protected-access
  for alpha in ("0.1", "0.2"):
    assert f"### alpha = {alpha} (k = " in text
  entry = section["sets"]["calibrated"]["raps"]["0.2"]
  worst = entry["test"]["worst_class"]
  row = next(line for line in text.splitlines() if line.startswith("| raps | calibrated | ")
             and f"| {entry['threshold']:.6g} |" in line)
  assert f"| {worst} name{worst}: {entry['test']['worst_class_coverage']:.4f} (" in row
  assert row.endswith(f"| {entry['ood']['mean_size']:.3f} |")
  record = report.conformal_record({"conformal": section})
  assert len(record) == 2 * 3 * 2 * (len(report.CONFORMAL_RECORDED) + 1)
  assert record["test_conformal_calibrated_raps_alpha0.2_coverage"] == entry["test"]["coverage"]
  assert record["ood_conformal_calibrated_raps_alpha0.2_mean_size"] == entry["ood"]["mean_size"]
  figures._KEPT.pop(("set_sizes",), None)  # pylint: disable=protected-access
  image = figures.set_size_image(section)
  kept = figures._KEPT[("set_sizes",)]["figure"]  # pylint: disable=protected-access
  assert image.shape == (350, 500, 3) and figures.set_size_png(section)[:4] == b"\x89PNG"
  assert figures._KEPT[("set_sizes",)]["figure"] is kept  # pylint: disable=protected-access


def test_leading_ranks_are_the_first_ranks_of_the_whole_sort():
  """The partitioned, partly sorted rows give the whole sort's first ranks and their sums, the
  same numbers bit for bit, also where ties straddle the depth and on rows of ties."""
  rng = np.random.default_rng(12)
  probs = rng.dirichlet(np.full(300, 0.3), size=200)
  probs[:40, 10:14] = probs[:40, [20]]  # Ties across the depth's edge for some rows.
  probs[40:50] = 1 / 300
  whole = conformal.ranked(probs)
  for depth in (1, 5, 32, 300):
    leading = conformal.leading_ranks(probs, depth)
    assert np.array_equal(leading.sorted, whole.sorted[:, :depth])
    assert np.array_equal(leading.sums, whole.sums[:, :depth + 1])


def test_softmax_is_the_metrics_softmax_to_rounding():
  rng = np.random.default_rng(13)
  logits = rng.normal(size=(500, 40)).astype(np.float32) * 6
  logits[:5, 3] = 800.0  # Saturated rows: exact zeros and ones alike.
  ours, reference = conformal.softmax(logits), metrics.softmax(logits)
  assert ours.dtype == np.float64
  np.testing.assert_allclose(ours, reference, rtol=1e-14, atol=1e-300)
  np.testing.assert_allclose(ours.sum(axis=1), 1.0, rtol=1e-14)
