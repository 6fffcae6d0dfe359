"""Metrics, bootstrap, OOD and corruption against hand-worked cases and slow loop references."""

import itertools

import numpy as np
import pytest
import scipy.optimize
import scipy.special
import scipy.stats
from sklearn import metrics as sk_metrics

from cpjax.calibration import bootstrap, metrics, ranking
from cpjax.data import corruptions


def _two_class(confidences, correct):
  """probs/labels whose top-label confidence and correctness are as given."""
  c = np.asarray(confidences, np.float64)
  probs = np.stack([c, 1 - c], axis=1)
  labels = np.where(np.asarray(correct) == 1, 0, 1)
  return probs, labels


def test_ece_hand_worked_case_both_conventions():
  # docs/methods.md#ece: bins (13/15, 14/15] holds .95,.95 (acc 1/2), (8/15, 9/15] holds .55,
  # and 1.0 is in the last bin (right-closed) or in no bin (left-closed).
  probs, labels = _two_class([0.95, 0.95, 0.55, 1.0], [1, 0, 1, 1])
  assert metrics.ece(probs, labels) == pytest.approx((2 * 0.45 + 0.45 + 0.0) / 4, abs=1e-12)
  assert metrics.ece(probs, labels) == pytest.approx(0.3375, abs=1e-12)
  assert metrics.ece(probs, labels, convention="left_closed") == pytest.approx(0.45, abs=1e-12)


def test_saturated_confidence_and_empty_bins():
  probs, labels = _two_class([1.0, 1.0, 1.0], [1, 1, 0])
  assert metrics.ece(probs, labels) == pytest.approx(1 / 3)  # One bin, gap 1/3, 14 empty.
  assert metrics.ece(probs, labels, convention="left_closed") == 0.0  # Nothing binned.
  assert metrics.mce(probs, labels) == pytest.approx(1 / 3)
  bins = metrics.reliability_bins(probs, labels)
  assert bins.count.tolist() == [0.0] * 14 + [3.0]
  assert np.isnan(bins.accuracy[:14]).all() and bins.accuracy[14] == pytest.approx(2 / 3)


def test_unknown_convention_is_named():
  with pytest.raises(ValueError, match="left_closed, right_closed|right_closed, left_closed"):
    metrics.ece(*_two_class([0.9], [1]), convention="closed")


def _loop_ece(conf, correct, lowers, uppers, denominator):
  total = 0.0
  for lo, hi in zip(lowers, uppers):
    inside = [i for i in range(len(conf)) if lo < conf[i] <= hi]
    if inside:
      gap = abs(np.mean([correct[i] for i in inside]) - np.mean([conf[i] for i in inside]))
      total += len(inside) / denominator * gap
  return total


def _random_probs(rng, n, k, scale=3.0):
  z = rng.normal(size=(n, k)) * scale
  return np.exp(z) / np.exp(z).sum(1, keepdims=True), rng.integers(0, k, n)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ece_and_adaptive_ece_match_loops(seed):
  rng = np.random.default_rng(seed)
  probs, labels = _random_probs(rng, 300, 5)
  conf = probs.max(1)
  correct = (probs.argmax(1) == labels).astype(float)
  edges = [m / 15 for m in range(16)]
  assert metrics.ece(probs, labels) == pytest.approx(
      _loop_ece(conf, correct, edges[:-1], edges[1:], len(conf)), abs=1e-12)
  # AdaECE edges as in the focal-loss code: np.interp of the sorted confidences.
  ada = np.interp(np.linspace(0, len(conf), 16), np.arange(len(conf)), np.sort(conf))
  assert metrics.adaptive_ece(probs, labels) == pytest.approx(
      _loop_ece(conf, correct, ada[:-1], ada[1:], len(conf)), abs=1e-12)


def test_adaptive_ece_with_ties_leaves_the_minimum_out():
  # 10 samples at 0.6 (all wrong) and 10 at 0.9 (all right): edges coincide at
  # the ties; the samples at the minimum (0.6) are in no (lo, hi] bin.
  probs, labels = _two_class([0.6] * 10 + [0.9] * 10, [0] * 10 + [1] * 10)
  assert metrics.adaptive_ece(probs, labels) == pytest.approx(10 / 20 * 0.1)


def _loop_classwise(probs, labels, num_classes):
  n = len(labels)
  per_class = []
  for k in range(num_classes):
    total = 0.0
    for m in range(15):
      lo, hi = m / 15, (m + 1) / 15
      inside = [i for i in range(n) if lo < probs[i, k] <= hi]
      if inside:
        acc = np.mean([labels[i] == k for i in inside])
        conf = np.mean([probs[i, k] for i in inside])
        total += len(inside) / n * abs(acc - conf)
    per_class.append(total)
  return np.mean(per_class)


def test_classwise_ece_matches_loop_with_a_class_absent():
  rng = np.random.default_rng(3)
  probs, labels = _random_probs(rng, 200, 4)
  labels = np.where(labels == 3, 0, labels)  # Class 3 never appears.
  assert metrics.classwise_ece(probs, labels, 4) == pytest.approx(
      _loop_classwise(probs, labels, 4), abs=1e-12)


def test_nll_brier_top_k_s99_by_hand():
  logits = np.array([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
  labels = np.array([1, 2])
  logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  assert metrics.nll(logits, labels) == pytest.approx(-(logp[0, 1] + logp[1, 2]) / 2)
  p = np.exp(logp)
  expected_brier = ((p[0] - [0, 1, 0]) ** 2).sum() / 2 + ((p[1] - [0, 0, 1]) ** 2).sum() / 2
  assert metrics.brier(p, labels) == pytest.approx(expected_brier)
  assert metrics.top_k_accuracy(p, labels, 1) == 0.5
  assert metrics.top_k_accuracy(p, labels, 2) == 1.0
  probs, labels = _two_class([0.995, 0.99, 0.5, 0.999], [1, 0, 1, 1])
  assert metrics.s99(probs, labels) == (0.75, pytest.approx(2 / 3))
  share, acc = metrics.s99(*_two_class([0.6], [1]))
  assert share == 0.0 and np.isnan(acc)


def test_smooth_ece_constant_confidence_and_calibrated_data():
  # All confidences 0.9, accuracy 0.6: the smoothed residual integrates to
  # |0.6 - 0.9| for every bandwidth, so smECE = 0.3 at the fixed point.
  probs, labels = _two_class([0.9] * 10, [1] * 6 + [0] * 4)
  assert metrics.smooth_ece(probs, labels) == pytest.approx(0.3, abs=1e-3)
  rng = np.random.default_rng(0)
  conf = rng.uniform(0.5, 1.0, 20000)
  calibrated = metrics.smooth_ece(*_two_class(conf, rng.uniform(size=conf.size) < conf))
  overconfident = metrics.smooth_ece(*_two_class(conf, rng.uniform(size=conf.size) < conf - 0.1))
  assert calibrated < 0.02 and overconfident == pytest.approx(0.1, abs=0.02)


def test_auroc_matches_sklearn_with_ties():
  rng = np.random.default_rng(0)
  inside = rng.integers(0, 5, 300).astype(float)  # Many ties.
  outside = rng.integers(1, 7, 200).astype(float)
  expected = sk_metrics.roc_auc_score(np.r_[np.zeros(300), np.ones(200)], np.r_[inside, outside])
  assert ranking.auroc(inside, outside) == pytest.approx(expected, abs=1e-12)


def test_ood_scores_by_hand():
  logits = np.array([[0.0, np.log(3.0)]])  # p = (1/4, 3/4)
  scores = ranking.ood_scores(logits)
  assert scores["entropy"][0] == pytest.approx(scipy.stats.entropy([0.25, 0.75]))
  assert scores["max_softmax"][0] == pytest.approx(-0.75)
  assert scores["max_logit"][0] == pytest.approx(-np.log(3.0))
  assert scores["energy"][0] == pytest.approx(-np.log(4.0))


def test_gaussian_noise_scale_and_seed():
  images = np.full((200, 8, 8, 1), 128, np.uint8)
  noisy = corruptions.gaussian_noise(images, 5, seed=1)
  assert noisy.dtype == np.uint8
  assert np.std(noisy / 255.0) == pytest.approx(0.10, rel=0.05)  # Severity 5: c = 0.10.
  assert np.array_equal(noisy, corruptions.gaussian_noise(images, 5, seed=1))
  with pytest.raises(ValueError, match="severity=6"):
    corruptions.gaussian_noise(images, 6)


def test_bootstrap_contains_point_and_shrinks_with_n():
  rng = np.random.default_rng(0)
  widths = []
  for n in (500, 8000):
    probs, labels = _random_probs(rng, n, 10, scale=1.0)
    for kind in bootstrap.KINDS:
      iv = bootstrap.bootstrap_interval(metrics.ece, (probs, labels), num_resamples=200,
                                        kind=kind, seed=0)
      assert iv.low <= iv.point <= iv.high
    widths.append(iv.high - iv.low)
  assert widths[1] < widths[0] / 2  # ~1/sqrt(n): 4x narrower expected.


def test_bootstrap_basic_interval_reflects_percentiles():
  values = np.arange(10.0)
  iv = bootstrap.bootstrap_interval(np.mean, (values,), num_resamples=500, kind="basic", seed=3)
  pct = bootstrap.bootstrap_interval(np.mean, (values,), num_resamples=500, kind="percentile",
                                     seed=3)
  assert iv.low == pytest.approx(2 * 4.5 - pct.high) and iv.high == pytest.approx(2 * 4.5 - pct.low)


@pytest.mark.parametrize("kind", bootstrap.KINDS)
def test_bootstrap_matches_scipy_stats_bootstrap(kind):
  """scipy.stats.bootstrap (resampling row indices, so that probs [N, K] and labels [N] stay
  paired) draws the same resamples from the same generator and gives the same interval."""
  rng = np.random.default_rng(1)
  probs, labels = _random_probs(rng, 400, 5, scale=2.0)
  ours = bootstrap.bootstrap_interval(metrics.ece, (probs, labels), num_resamples=200, kind=kind,
                                      seed=3)
  theirs = scipy.stats.bootstrap(
      (np.arange(400),), lambda rows: metrics.ece(probs[rows], labels[rows]), n_resamples=200,
      confidence_level=0.9, method=kind, vectorized=False, rng=np.random.default_rng(3))
  assert ours.low == pytest.approx(theirs.confidence_interval.low, rel=1e-12)
  assert ours.high == pytest.approx(theirs.confidence_interval.high, rel=1e-12)


@pytest.mark.slow  # Python-loop references on 10,000 rows.
def test_metrics_on_10000_by_100_match_the_loop_references():
  # The vectorised metrics at a realistic size (their cost is tracked in
  # benchmarks/, never timed here) agree with the slow loops above.
  rng = np.random.default_rng(0)
  probs, labels = _random_probs(rng, 10000, 100)
  conf, correct = probs.max(1), (probs.argmax(1) == labels).astype(float)
  edges = np.linspace(0, 1, 16)
  assert metrics.ece(probs, labels) == pytest.approx(
      _loop_ece(conf, correct, edges[:-1], edges[1:], len(conf)), abs=1e-12)
  assert metrics.classwise_ece(probs, labels, 100) == pytest.approx(
      _loop_classwise(probs, labels, 100), abs=1e-12)


def _torch_like_seed_ece(logits, labels, num_bins=15):
  """Tata et al. 2022's code's ECE re-derived per sample: float32 softmax, left-closed float32 bins,
  divided by the number of binned samples (docs/methods.md#ece, left-closed)."""
  z = np.asarray(logits, np.float32)
  total, binned, sums = 0, 0, {}
  for row, label in zip(z, labels):
    e = np.exp(row - row.max())
    p = (e / e.sum()).astype(np.float32)
    c = p.max()
    for m in range(num_bins):
      lo, hi = np.float32(m / num_bins), np.float32((m + 1) / num_bins)
      if lo <= c < hi:
        acc, conf, n = sums.get(m, (0.0, 0.0, 0))
        sums[m] = (acc + float(p.argmax() == label), conf + float(c), n + 1)
        binned += 1
  for acc, conf, n in sums.values():
    total += n * abs(acc / n - conf / n)
  return total / binned if binned else 0.0


def test_seed_ece_drops_float32_saturated_samples_as_the_seed_does():
  # Two samples with a top-logit margin of 30: float32 softmax gives exactly 1.0, so
  # the left-closed bins of Tata et al.'s code hold neither; only the two 0.75-confidence rows
  # count.
  logits = np.array([[30.0, 0.0], [30.0, 0.0], [np.log(3.0), 0.0], [np.log(3.0), 0.0]])
  labels = np.array([1, 1, 0, 1])  # The saturated ones are wrong: a float64 softmax bins them.
  assert np.float32(1.0) == metrics.softmax_float32(logits)[0, 0]
  assert metrics.seed_ece(logits, labels) == pytest.approx(0.25, abs=1e-6)  # |1/2 - 3/4|.
  float64_left_closed = metrics.ece(metrics.softmax(logits), labels, convention="left_closed")
  assert float64_left_closed == pytest.approx((2 * 1.0 + 2 * 0.25) / 4, abs=1e-6)
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(300, 10)) * rng.uniform(0.5, 12, (300, 1))  # Some saturate.
  labels = rng.integers(0, 10, 300)
  assert metrics.seed_ece(logits, labels) == pytest.approx(
      _torch_like_seed_ece(logits, labels), abs=1e-6)


def test_top_k_accuracy_breaks_ties_as_sklearn():
  # Saturated rows: many probabilities are exactly 0.0 and tie with a low label.
  probs = np.array([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                    [0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
                    [0.2, 0.2, 0.2, 0.2, 0.2, 0.0, 0.0]])
  labels = np.array([1, 0, 0, 4])
  for k in (1, 2, 5):
    expected = sk_metrics.top_k_accuracy_score(labels, probs, k=k, labels=np.arange(7))
    assert metrics.top_k_accuracy(probs, labels, k) == pytest.approx(expected), k
  assert metrics.top_k_accuracy(probs, labels, 5) < 1.0  # Row 0's tie is not a free hit.
  rng = np.random.default_rng(2)
  scores = rng.integers(0, 4, (500, 10)).astype(float)  # Heavy ties.
  labels = rng.integers(0, 10, 500)
  for k in (1, 3, 5):
    assert metrics.top_k_accuracy(scores, labels, k) == pytest.approx(
        sk_metrics.top_k_accuracy_score(labels, scores, k=k, labels=np.arange(10)))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_probabilities_give_nan_not_a_number_of_the_rest(bad):
  probs, labels = _random_probs(np.random.default_rng(0), 50, 3)
  probs[7] = [bad, 0.0, 0.0]
  for name, value in [("ece", metrics.ece(probs, labels)),
                      ("ece_left", metrics.ece(probs, labels, convention="left_closed")),
                      ("adaptive_ece", metrics.adaptive_ece(probs, labels)),
                      ("mce", metrics.mce(probs, labels)),
                      ("classwise_ece", metrics.classwise_ece(probs, labels, 3)),
                      ("smooth_ece", metrics.smooth_ece(probs, labels)),
                      ("s99", metrics.s99(probs, labels)[0])]:
    assert np.isnan(value), name
  if np.isnan(bad):
    assert np.isnan(metrics.accuracy(probs, labels))
    assert np.isnan(metrics.top_k_accuracy(probs, labels, 2))


def _brute_force_smooth_ece(conf, correct):
  """smECE by the definition, written independently: per-sample reflected kernel on a
  fine t grid (trapezoid rule), s* by scipy's brentq on smECE_s - s."""
  t = np.linspace(0.0, 1.0, 4001)
  residual = correct - conf

  def smece(s):
    kernel = sum(scipy.stats.norm.pdf(t[:, None], loc=image[None, :], scale=s)
                 for image in (conf, -conf, 2.0 - conf))
    return np.trapezoid(np.abs(kernel @ residual / len(conf)), t)

  s_star = scipy.optimize.brentq(lambda s: smece(s) - s, 1e-3, 1.0)
  return smece(s_star)


@pytest.mark.slow  # A brute-force evaluation of the definition.
@pytest.mark.parametrize("seed", [0, 1])
def test_smooth_ece_matches_a_brute_force_evaluation_of_the_definition(seed):
  rng = np.random.default_rng(seed)
  conf = rng.uniform(0.5, 1.0, 400) ** 0.5  # Top-label confidences, piled up towards 1.
  correct = (rng.uniform(size=400) < conf - 0.08).astype(float)  # Overconfident.
  probs, labels = _two_class(conf, correct)
  assert metrics.smooth_ece(probs, labels) == pytest.approx(
      _brute_force_smooth_ece(conf, correct), abs=5e-4)


def _aurc_by_loop(conf, correct):
  """AURC by a Python loop over coverages after sorting from the least confident upwards."""
  order = np.argsort(conf, kind="stable")[::-1]  # Most confident first (no ties here).
  total, errors = 0.0, 0
  for i, row in enumerate(order, start=1):
    errors += 1 - correct[row]
    total += errors / i
  return total / len(conf)


def test_aurc_matches_a_loop_and_e_aurc_is_zero_for_a_perfect_ranking():
  rng = np.random.default_rng(0)
  conf = rng.uniform(0.5, 1, 500)  # Continuous: no ties.
  correct = (rng.uniform(size=500) < conf).astype(int)
  probs, labels = _two_class(conf, correct)
  assert ranking.aurc(probs, labels) == pytest.approx(_aurc_by_loop(conf, correct), abs=1e-12)
  oracle = np.where(correct == 1, 0.6 + 0.4 * conf, 0.5 + 0.09 * conf)  # Errors ranked last.
  assert ranking.e_aurc(*_two_class(oracle, correct)) == pytest.approx(0.0, abs=1e-12)
  assert ranking.e_aurc(probs, labels) > 0
  expected_oracle = _aurc_by_loop(oracle, correct)
  assert (ranking.aurc(probs, labels) - ranking.e_aurc(probs, labels)
          == pytest.approx(expected_oracle, abs=1e-12))


def test_aurc_with_ties_is_the_mean_over_every_tie_breaking_order():
  conf = np.array([0.9, 0.9, 0.9, 0.7, 0.7, 0.6])
  correct = np.array([1, 0, 1, 0, 1, 1])
  values = []
  for perm in itertools.permutations(range(6)):
    if np.all(np.diff(conf[list(perm)]) <= 0):  # An order consistent with the confidences.
      errors = np.cumsum(1 - correct[list(perm)])
      values.append(np.mean(errors / np.arange(1, 7)))
  assert len(values) == 12  # 3! x 2! orders.
  assert ranking.aurc(*_two_class(conf, correct)) == pytest.approx(np.mean(values), abs=1e-12)


def test_selective_risk_by_hand():
  conf = np.array([0.99, 0.95, 0.9, 0.8, 0.7, 0.65, 0.6, 0.58, 0.56, 0.55])
  correct = np.array([1, 1, 0, 1, 1, 1, 1, 1, 0, 0])
  probs, labels = _two_class(conf, correct)
  assert ranking.selective_risk(probs, labels, 0.9) == pytest.approx(2 / 9)  # Top 9: 2 wrong.
  assert ranking.selective_risk(probs, labels, 0.95) == pytest.approx(3 / 10)  # ceil(9.5) = 10.
  assert ranking.selective_risk(probs, labels, 0.3) == pytest.approx(1 / 3)
  with pytest.raises(ValueError, match="coverage=0"):
    ranking.selective_risk(probs, labels, 0.0)


def test_fpr_at_95_tpr_matches_sklearn_roc_curve():
  rng = np.random.default_rng(1)
  for inside, outside in ((rng.normal(0, 1, 400), rng.normal(2, 1, 300)),
                          (rng.integers(0, 5, 400).astype(float),  # Many ties.
                           rng.integers(2, 8, 300).astype(float))):
    fpr, tpr, _ = sk_metrics.roc_curve(np.r_[np.zeros(400), np.ones(300)], np.r_[inside, outside],
                                       drop_intermediate=False)
    expected = fpr[np.argmax(tpr >= 0.95)]
    assert ranking.fpr_at_tpr(inside, outside, 0.95) == pytest.approx(expected, abs=1e-12)


def test_resampled_rows_are_the_sequential_draws_in_chunks():
  rng = np.random.default_rng(5)  # The reference: one integers(0, N, N) call per resample.
  reference = np.stack([rng.integers(0, 37, 37) for _ in range(23)])
  chunks = list(bootstrap.resampled_rows(37, 23, seed=5, chunk=10))
  assert [len(c) for c in chunks] == [10, 10, 3]
  np.testing.assert_array_equal(np.concatenate(chunks), reference)


def test_classwise_ece_of_resamples_hand_worked():
  # probs [[.9, .1], [.3, .7]], labels [0, 0], 2 bins (0, .5], (.5, 1].
  # Rows (0, 0): class 0 has .9, .9 in the top bin, both events: |2 - 1.8| = .2; class 1 has
  # .1, .1 in the bottom bin, no event: |0 - .2| = .2; (.2 + .2) / N 2 / K 2 = 0.1.
  # Rows (0, 1): class 0: top bin .9 (event) |1 - .9|, bottom bin .3 (event) |1 - .3|; class 1:
  # bottom .1 |0 - .1|, top .7 |0 - .7|: (.1 + .7 + .1 + .7) / 2 / 2 = 0.4.
  probs, labels = np.array([[0.9, 0.1], [0.3, 0.7]]), np.array([0, 0])
  values = bootstrap.classwise_ece_of_resamples(probs, labels, 2, 2, np.array([[2, 0], [1, 1]]))
  np.testing.assert_allclose(values, [0.1, 0.4], atol=1e-15)


@pytest.mark.parametrize("n,k", [(60, 3), (700, 40)])
def test_classwise_ece_of_resamples_equals_the_resampled_rows(n, k):
  rng = np.random.default_rng(n)
  logits = rng.normal(size=(n, k)) * 5
  logits[:4, 0] = 900.0  # Probabilities exactly 0 (in no bin) and exactly 1 (the top bin).
  probs, labels = metrics.softmax(logits), rng.integers(0, k, n)
  assert (probs == 0).any() and (probs == 1).any()
  rows = rng.integers(0, n, (9, n))
  counts = np.stack([np.bincount(r, minlength=n) for r in rows])
  expected = [metrics.classwise_ece(probs[r], labels[r], k, 15) for r in rows]
  np.testing.assert_allclose(bootstrap.classwise_ece_of_resamples(probs, labels, k, 15, counts),
                             expected, rtol=0, atol=1e-13)


def test_classwise_ece_of_resamples_in_blocks_equals_all_at_once(monkeypatch):
  # Few entries gathered at a time (a block of 2 resamples here): the same sums, bit for bit.
  rng = np.random.default_rng(5)
  probs, labels = metrics.softmax(rng.normal(size=(80, 6)) * 4), rng.integers(0, 6, 80)
  counts = np.stack([np.bincount(r, minlength=80) for r in rng.integers(0, 80, (7, 80))])
  at_once = bootstrap.classwise_ece_of_resamples(probs, labels, 6, 15, counts)
  entries = int(np.count_nonzero(metrics.bin_index(probs, metrics.equal_width_edges(15),
                                                   "right_closed") != 0))
  monkeypatch.setattr(bootstrap, "_GATHERED", 2 * entries)
  np.testing.assert_array_equal(bootstrap.classwise_ece_of_resamples(probs, labels, 6, 15,
                                                                     counts), at_once)


def test_row_counts_and_resampled_means_by_hand():
  """Resamples (0, 0, 2) and (1, 2, 2) of 3 rows: counts (2, 0, 1) and (0, 1, 2); a column
  (1, 0, 5) has means (1 + 1 + 5) / 3 and (0 + 5 + 5) / 3."""
  counts = bootstrap.row_counts(np.array([[0, 0, 2], [1, 2, 2]]), 3)
  assert counts.tolist() == [[2, 0, 1], [0, 1, 2]]
  means = bootstrap.resampled_means(np.array([[1], [0], [5]]), [counts])
  assert means[:, 0].tolist() == [7 / 3, 10 / 3]
  with pytest.raises(ValueError, match="non-negative integers"):
    bootstrap.resampled_means(np.array([[0.5]]), [np.ones((1, 1))])


@pytest.mark.parametrize("n, largest", [(50000, 1000), (300, 10), (20000, 70000)])
def test_resampled_means_are_the_resampled_rows_means_bit_for_bit(n, largest):
  """The float32 products split into digits where a sum could pass 2^24 (n x largest: 5e7 and
  1.4e9 here): each mean equals np.mean of the resampled rows exactly."""
  rng = np.random.default_rng(n)
  values = np.stack([rng.integers(0, 2, n), rng.integers(0, largest + 1, n)], axis=1)
  values[0, 1] = largest
  blocks = list(bootstrap.resampled_rows(n, 150, seed=3, chunk=100))
  got = bootstrap.resampled_means(values, [bootstrap.compact_counts(bootstrap.row_counts(
      rows, n)) for rows in blocks])
  want = np.concatenate([values.astype(np.float64)[rows].mean(axis=1) for rows in blocks])
  assert got.shape == (150, 2) and np.array_equal(got, want)


def test_log_softmax_is_scipys_bit_for_bit():
  """NumPy's log-softmax (the per-epoch evaluation imports no SciPy) against
  scipy.special.log_softmax, operation for operation: the same numbers, bit for bit,
  saturated and non-finite rows included."""
  rng = np.random.default_rng(20)
  logits = rng.normal(size=(500, 7)) * rng.uniform(0.1, 300, size=(500, 1))
  logits[3, 2], logits[4], logits[5, 0] = np.inf, -np.inf, np.nan
  with np.errstate(invalid="ignore"):
    expected = scipy.special.log_softmax(logits, axis=-1)
    np.testing.assert_array_equal(metrics.log_softmax(logits), expected)
  np.testing.assert_array_equal(metrics.log_softmax(logits[0]),
                                scipy.special.log_softmax(logits[0]))


def test_smooth_ece_kernel_is_scipys_normal_density():
  """The reflected Gaussian kernel from its distinct offsets against the sum of
  scipy.stats.norm.pdf over the three images, bit for bit."""
  resolution = 50
  centres = (np.arange(resolution) + 0.5) / resolution
  images = (centres, -centres, 2.0 - centres)
  offsets = np.unique(np.stack([centres[:, None] - image[None, :] for image in images]),
                      return_inverse=True)
  for bandwidth in (1e-4, 0.013, 0.5, 1.0):
    expected = np.zeros((resolution, resolution))
    for image in images:
      expected += scipy.stats.norm.pdf(centres[:, None], loc=image[None, :], scale=bandwidth)
    np.testing.assert_array_equal(metrics._reflected_gaussian(offsets, bandwidth), expected)  # pylint: disable=protected-access


@pytest.mark.parametrize("kind", ["equal_width", "seed", "adaptive"])
def test_ece_of_rows_is_each_rows_ece_bit_for_bit(kind):
  """ECE of many rows at once (the bootstrap's resamples) against the ECE functions of each
  row alone: the same numbers bit for bit, a row with a NaN included."""
  rng = np.random.default_rng(21)
  probs = metrics.softmax(rng.normal(size=(6 * 300, 5)) * 3).reshape(6, 300, 5)
  labels = rng.integers(0, 5, (6, 300))
  pairs = [metrics.top_label(p, y) for p, y in zip(probs, labels)]
  confidence, correct = (np.stack(v) for v in zip(*pairs))
  confidence[4, 17] = np.nan
  if kind == "equal_width":
    ours = metrics.ece_of_rows(confidence, correct, metrics.equal_width_edges(15))
    expected = [metrics.ece_from_confidences(c, k) for c, k in zip(confidence, correct)]
  elif kind == "seed":
    conf32 = confidence.astype(np.float32)
    ours = metrics.ece_of_rows(conf32, correct, metrics.seed_edges(15), "left_closed")
    expected = [metrics.seed_ece_from_confidences(c, k) for c, k in zip(conf32, correct)]
  else:
    ours = metrics.ece_of_rows(confidence, correct, metrics.adaptive_edges(confidence, 15))
    expected = [metrics.adaptive_ece_from_confidences(c, k) for c, k in zip(confidence, correct)]
  np.testing.assert_array_equal(ours, expected)
  assert np.isnan(ours[4]) and np.all(np.isfinite(np.delete(ours, 4)))
