"""Ranking metrics: how well a score orders samples. Pure NumPy functions, float64 inside.

Out-of-distribution detection ranks test samples against OOD samples by a score from the
logits (`ood_scores`, `auroc`, `fpr_at_tpr`); selective prediction ranks the test samples by
their top-label confidence and measures the error among the most confident
(`aurc`, `e_aurc`, `selective_risk`). Ties are broken uniformly at random, in expectation.
Every result is a fraction, not a percentage. A non-finite confidence (a diverged model)
makes every selective metric NaN. Definitions: docs/methods.md#evaluation-metrics.
"""

import numpy as np

from cpjax.calibration import metrics


def ood_scores(logits: np.ndarray) -> dict[str, np.ndarray]:
  """Per-sample out-of-distribution scores, higher = more likely OOD
  (docs/methods.md#ood-detection).

  entropy: -sum_k p_k log p_k; max_softmax: -max_k p_k (Hendrycks & Gimpel
  2017); max_logit: -max_k z_k (Hendrycks et al. 2022); energy: the free
  energy -logsumexp_k z_k (Liu et al. 2020).
  """
  # Imported here: the training path imports this module (the per-epoch metrics), and only
  # the report's OOD section needs SciPy, whose import takes about a second.
  import scipy.special  # pylint: disable=g-import-not-at-top
  logp = metrics.log_softmax(logits)
  return {"entropy": -np.sum(np.exp(logp) * logp, axis=-1),
          "max_softmax": -np.exp(logp.max(axis=-1)),
          "max_logit": -np.asarray(logits, np.float64).max(axis=-1),
          "energy": -scipy.special.logsumexp(np.asarray(logits, np.float64), axis=-1)}


def auroc(in_scores: np.ndarray, out_scores: np.ndarray) -> float:
  """Area under the ROC curve for "out" = positive: P(s_out > s_in) + P(tie)/2.

  The Mann-Whitney U statistic from average ranks (ties count 1/2).
  """
  import scipy.stats  # pylint: disable=g-import-not-at-top  (as in ood_scores)
  ranks = scipy.stats.rankdata(np.concatenate([in_scores, out_scores]))
  n_in, n_out = len(in_scores), len(out_scores)
  u = ranks[n_in:].sum() - n_out * (n_out + 1) / 2
  return float(u / (n_in * n_out))


def _expected_cumulative_errors(confidences: np.ndarray, correct: np.ndarray) -> np.ndarray:
  """[N]: expected errors among the i most confident samples (i = 1..N), ties in confidence
  broken uniformly at random: within a tie group the errors accrue linearly."""
  conf = np.asarray(confidences, np.float64)
  errors = 1.0 - np.asarray(correct, np.float64)
  order = np.argsort(-conf, kind="stable")
  conf, errors = conf[order], errors[order]
  cumulative = np.cumsum(errors)
  _, start, size = np.unique(-conf, return_index=True, return_counts=True)
  group = np.repeat(np.arange(len(start)), size)
  before = np.concatenate([[0.0], cumulative])[start][group]  # Errors ahead of the group.
  group_errors = (cumulative[start + size - 1] - np.concatenate([[0.0], cumulative])[start])
  position = np.arange(len(conf)) - start[group] + 1  # 1..size within the group.
  return before + group_errors[group] * position / size[group]


def selective_risks(confidences: np.ndarray, correct: np.ndarray) -> np.ndarray:
  """[N]: the risk (error rate) on the i most confident samples, i = 1..N, in expectation
  over random tie-breaking: the risk-coverage curve at coverages i / N."""
  return _expected_cumulative_errors(confidences, correct) / np.arange(1, len(confidences) + 1)


def aurc(probs: np.ndarray, labels: np.ndarray) -> float:
  """Area under the risk-coverage curve, mean_i risk(i / N), with the top-label confidence
  as the selection score (Geifman, Uziel & El-Yaniv 2019, ICLR). NaN for non-finite probs."""
  return aurc_from_confidences(*metrics.top_label(probs, labels))


def aurc_from_confidences(confidences: np.ndarray, correct: np.ndarray) -> float:
  """`aurc` from top-label confidences [N] and 0/1 correctness [N]."""
  if not metrics.all_finite(confidences):
    return float("nan")
  return float(np.mean(selective_risks(confidences, correct)))


def e_aurc(probs: np.ndarray, labels: np.ndarray) -> float:
  """Excess AURC: AURC less that of the oracle ranking (every error ranked last) at the
  same accuracy (Geifman et al. 2019); 0 for a perfect ranking of errors."""
  return e_aurc_from_confidences(*metrics.top_label(probs, labels))


def e_aurc_from_confidences(confidences: np.ndarray, correct: np.ndarray) -> float:
  """`e_aurc` from top-label confidences [N] and 0/1 correctness [N]."""
  if not metrics.all_finite(confidences):
    return float("nan")
  return (aurc_from_confidences(confidences, correct)
          - float(np.mean(selective_risks(correct, correct))))


def selective_risk(probs: np.ndarray, labels: np.ndarray, coverage: float) -> float:
  """Error rate on the ceil(coverage N) most confident samples (ties broken at random, in
  expectation); NaN for non-finite probs."""
  return selective_risk_from_confidences(*metrics.top_label(probs, labels), coverage)


def selective_risk_from_confidences(confidences: np.ndarray, correct: np.ndarray,
                                    coverage: float) -> float:
  """`selective_risk` from top-label confidences [N] and 0/1 correctness [N]."""
  if not 0 < coverage <= 1:
    raise ValueError(f"coverage={coverage} must be in (0, 1]")
  if not metrics.all_finite(confidences):
    return float("nan")
  count = max(int(np.ceil(coverage * len(confidences) - 1e-9)), 1)
  return float(_expected_cumulative_errors(confidences, correct)[count - 1] / count)


def fpr_at_tpr(in_scores: np.ndarray, out_scores: np.ndarray, tpr: float = 0.95) -> float:
  """False-positive rate at a true-positive rate of at least `tpr`, "out" = positive and a
  higher score = more likely OOD: the threshold is the highest t with P(s_out >= t) >= tpr,
  and the result is P(s_in >= t) (Liang et al. 2018, ICLR: FPR at 95 % TPR)."""
  if not 0 < tpr <= 1:
    raise ValueError(f"tpr={tpr} must be in (0, 1]")
  out_sorted = np.sort(np.asarray(out_scores, np.float64))[::-1]
  threshold = out_sorted[max(int(np.ceil(tpr * len(out_sorted) - 1e-9)), 1) - 1]
  return float(np.mean(np.asarray(in_scores, np.float64) >= threshold))
