"""Bootstrap confidence intervals for any metric of (probs, labels) data.

Following the focal-loss paper's error bars (Mukhoti et al. 2020 App. G, code
from Kumar et al. 2019; docs/methods.md#bootstrap-intervals): B resamples of size N
with replacement,
the metric recomputed on each, and by default the basic (pivotal) interval
[2 t - q_hi, 2 t - q_lo] around the full-data value t, with "mid" 2 t - q_50.
The percentile interval [q_lo, q_hi] is the alternative. The seed is explicit
and recorded with the result.

`resampled_values` computes the report's metrics over resamples without copying the [N, K]
probabilities per resample: per-row statistics gathered for a block of resamples at once and
each metric computed for the block in one array operation (bit for bit the metric of each
resample's rows), and classwise ECE from each resample's row counts.
"""

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from cpjax.calibration import metrics, ranking

KINDS = ("basic", "percentile")


class Interval(NamedTuple):
  point: float  # The metric on the full data.
  low: float
  high: float
  mid: float  # 2 t - q_50 (basic) or q_50 (percentile).
  level: float
  kind: str
  num_resamples: int
  seed: int


def bootstrap_interval(metric: Callable[..., float], arrays: tuple[np.ndarray, ...], *,
                       num_resamples: int = 1000, level: float = 0.9, kind: str = "basic",
                       seed: int = 0) -> Interval:
  """Bootstrap interval of `metric(*arrays)` over resampled rows.

  Args:
    metric: a function of the arrays (e.g. `metrics.ece(probs, labels)`).
    arrays: arrays sharing their leading dimension N; rows are resampled
      together.
    num_resamples: B.
    level: coverage, e.g. 0.9 for a 90 % interval.
    kind: "basic" (pivotal; the reference's) or "percentile".
    seed: NumPy generator seed.

  Returns:
    The interval with its point estimate and settings.
  """
  _check(level, kind)
  point = float(metric(*arrays))
  # Not scipy.stats.bootstrap: it draws the same resamples from the same generator and gives
  # the same interval (tests/test_metrics.py checks it) but differs in the last bit, which
  # would change reported numbers; it has no "mid" and needs index arrays to keep probs
  # [N, K] paired with labels [N].
  values = np.concatenate([[metric(*(a[rows] for a in arrays)) for rows in chunk]
                           for chunk in resampled_rows(len(arrays[0]), num_resamples, seed)])
  return interval_from_values(point, values, level=level, kind=kind, seed=seed)


def resampled_rows(size: int, num_resamples: int, seed: int, chunk: int = 100
                   ) -> Iterator[np.ndarray]:
  """The bootstrap's resamples of rows 0..size-1, as [<= chunk, size] index blocks: the B
  draws of `bootstrap_interval` (one `integers(0, size, size)` call each, in order), so
  every metric computed from them resamples the same rows."""
  rng = np.random.default_rng(seed)
  for start in range(0, num_resamples, chunk):
    yield np.stack([rng.integers(0, size, size)
                    for _ in range(min(chunk, num_resamples - start))])


def interval_from_values(point: float, values: np.ndarray, *, level: float, kind: str,
                         seed: int) -> Interval:
  """The interval of a metric whose full-data value is `point` and whose B resampled values
  are `values`: basic [2 t - q_hi, 2 t - q_lo] or percentile [q_lo, q_hi]."""
  _check(level, kind)
  tail = 100 * (1 - level) / 2
  q_lo, q_mid, q_hi = np.percentile(values, [tail, 50, 100 - tail])
  if kind == "basic":
    low, mid, high = 2 * point - q_hi, 2 * point - q_mid, 2 * point - q_lo
  else:
    low, mid, high = q_lo, q_mid, q_hi
  return Interval(point, float(low), float(high), float(mid), level, kind, len(values), seed)


def _check(level: float, kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}; valid choices: {', '.join(KINDS)}")
  if not 0 < level < 1:
    raise ValueError(f"level={level} must be in (0, 1)")


def row_statistics(probs: np.ndarray, logits: np.ndarray, labels: np.ndarray
                    ) -> dict[str, np.ndarray]:
  """[N] per row: what every TABLE_METRICS column but classwise ECE is a function of."""
  confidence, correct = metrics.top_label(probs, labels)
  confidence32, correct32 = metrics.top_label(metrics.softmax_float32(logits), labels)
  return {"confidence": confidence, "correct": correct, "confidence32": confidence32,
          "correct32": correct32, "label_log_prob": metrics.label_log_probs(logits, labels),
          "brier": metrics.brier_terms(probs, labels)}


def _each(metric):
  """A metric of one resample's statistics [N] as one of a block of resamples' ([C, N])."""
  return lambda confidence, correct: np.array([metric(c, k) for c, k in zip(confidence,
                                                                            correct)])


# name -> (the row statistics it reads, f(them gathered for a block of resamples [C, N] each,
# num_bins) -> its [C] values): the metric of each resample's rows, bit for bit (the same
# sums in the same order, one array operation for the block; cpjax.calibration.report's
# columns).
FROM_ROW_STATISTICS = {
    "accuracy": (("correct",), lambda s, m: np.mean(s["correct"], axis=1)),
    "ece": (("confidence", "correct", "bin"), lambda s, m: metrics.ece_of_rows(
        s["confidence"], s["correct"], metrics.equal_width_edges(m), index=s["bin"])),
    "ece_left_closed": (("confidence32", "correct32", "bin32"), lambda s, m: metrics.ece_of_rows(
        s["confidence32"], s["correct32"], metrics.seed_edges(m), "left_closed", s["bin32"])),
    "adaptive_ece": (("confidence", "correct"), lambda s, m: metrics.ece_of_rows(
        s["confidence"], s["correct"], metrics.adaptive_edges(s["confidence"], m))),
    "nll": (("label_log_prob",), lambda s, m: -np.mean(s["label_log_prob"], axis=1)),
    "brier": (("brier",), lambda s, m: np.mean(s["brier"], axis=1)),
    "aurc": (("confidence", "correct"), lambda s, m: _each(ranking.aurc_from_confidences)(
        s["confidence"], s["correct"])),
    "e_aurc": (("confidence", "correct"), lambda s, m: _each(ranking.e_aurc_from_confidences)(
        s["confidence"], s["correct"])),
}


def resampled_values(probs, logits, labels, num_classes, num_bins, names, resamples,
                     counts_out: list | None = None) -> dict[str, np.ndarray]:
  """[B] values of each named metric, over the resamples' [chunk, N] row blocks: each
  block's statistics gathered once, each metric computed for the whole block at once.
  `counts_out`, a list: each block's row counts (`row_counts`, `compact_counts`) are
  appended to it, for other statistics of the same resamples (`resampled_means`)."""
  statistics = row_statistics(probs, logits, labels)
  # Each row's bin of the fixed-edge ECEs, binned once (a resample's rows keep their bins).
  statistics["bin"] = metrics.bin_index(statistics["confidence"],
                                        metrics.equal_width_edges(num_bins), "right_closed")
  statistics["bin32"] = metrics.bin_index(statistics["confidence32"],
                                          metrics.seed_edges(num_bins), "left_closed")
  needed = {key for name in names if name != "classwise_ece"
            for key in FROM_ROW_STATISTICS[name][0]}
  values = {name: [] for name in names}
  for rows in resamples:
    gathered = {key: statistics[key][rows] for key in needed}
    counts = (row_counts(rows, len(labels))
              if "classwise_ece" in names or counts_out is not None else None)
    if counts_out is not None:
      counts_out.append(compact_counts(counts))
    for name in names:
      if name == "classwise_ece":
        values[name].append(classwise_ece_of_resamples(probs, labels, num_classes, num_bins,
                                                       counts))
      else:
        values[name].append(FROM_ROW_STATISTICS[name][1](gathered, num_bins))
  return {name: np.concatenate(v) if v else np.zeros(0) for name, v in values.items()}


def row_counts(rows: np.ndarray, size: int) -> np.ndarray:
  """[C, size] how often each of C resamples (rows [C, N] of `resampled_rows`) draws each row."""
  return np.bincount((rows + size * np.arange(len(rows))[:, None]).ravel(),
                     minlength=len(rows) * size).reshape(len(rows), size)


def compact_counts(counts: np.ndarray) -> np.ndarray:
  """`counts` in the smallest unsigned integer type that holds them (uint8: a row drawn more
  than 255 times in one resample of N >> 255 rows has probability below 1e-500)."""
  return counts.astype(np.uint8 if counts.max(initial=0) <= 255 else np.uint32)


def resampled_means(values: np.ndarray, counts) -> np.ndarray:
  """[B, S] the mean of each column of `values` [N, S], non-negative integers (0/1 events,
  set sizes), over each resample, from the resamples' row counts (blocks [C, N],
  `row_counts`): counts @ values / N, one float32 matrix product a block, exact.

  A resample's sum of a column is an integer; float32 sums it exactly while it stays below
  2^24, so each column is split into base-D digits, D the largest power of two with
  N (D - 1) < 2^24, whose sums are each exact, and put back together in float64. So every
  mean is the mean of the resampled rows' values bit for bit, at about a third of a float64
  product's cost (N < 2^24 rows)."""
  values = np.asarray(values)
  num_rows = len(values)
  if not np.array_equal(values, np.floor(values)) or np.any(values < 0) or num_rows >= 2**24:
    raise ValueError("resampled_means takes non-negative integers of fewer than 2^24 rows")
  values = values.astype(np.int64)
  base = 1 << int(np.log2((2**24 - 1) // num_rows + 1))  # N (base - 1) < 2^24.
  plan = [(column, base**place) for column in range(values.shape[1])  # (column, place value)
          for place in range(_digits(int(values[:, column].max(initial=0)), base))]
  digits = np.zeros((num_rows, len(plan)), np.float32)
  for index, (column, place) in enumerate(plan):
    digits[:, index] = (values[:, column] // place) % base
  sums = [np.asarray(c, np.float32) @ digits for c in counts]  # Integers below 2^24: exact.
  sums = np.concatenate(sums).astype(np.float64) if sums else np.zeros((0, len(plan)))
  totals = np.zeros((len(sums), values.shape[1]))
  for index, (column, place) in enumerate(plan):
    totals[:, column] += place * sums[:, index]  # Integers below 2^53: exact.
  return totals / num_rows


def _digits(largest: int, base: int) -> int:
  """How many base-`base` digits `largest` has (at least one)."""
  count = 1
  while largest >= base**count:
    count += 1
  return count


def classwise_ece_of_resamples(probs: np.ndarray, labels: np.ndarray, num_classes: int,
                               num_bins: int, counts: np.ndarray) -> np.ndarray:
  """[B]: `metrics.classwise_ece` of B bootstrap resamples, each given by `counts` [B, N] (how often
  it draws each row), without copying the [N, K] probabilities per resample.

  Resample b's sums per (bin m, class k) are sum_i counts_bi x_ik over the entries (i, k)
  in bin m, x = 1, p_ik or 1[y_i = k]. At most M - 1 of a row's probabilities exceed 1 / M,
  so nearly every entry is in the lowest bin: the other entries (and those in no bin, p = 0)
  are summed as a sparse product, and the lowest bin's sums are the class totals
  (counts @ probs, the label counts) less theirs. Per (m, k), |B| |acc - conf| is
  |sum of events - sum of p|. Equal to `metrics.classwise_ece` of the resampled rows up to float64
  rounding (the sums are taken in another order). Finite probabilities only.
  """
  probs, counts = np.asarray(probs, np.float64), np.asarray(counts, np.float64)
  edges = metrics.equal_width_edges(num_bins)
  index = metrics.bin_index(probs, edges, "right_closed")  # -1: p = 0, in no bin.
  rows, classes = np.nonzero(index != 0)
  slot = np.where(index[rows, classes] < 0, num_bins, index[rows, classes])  # M: no bin.
  columns = (slot - 1) * num_classes + classes  # Bins 1..M-1, then "no bin".
  event = np.asarray(labels)[rows] == classes
  # Imported here: the training path imports this module (the config's interval kinds), and
  # only the report resamples.
  import scipy.sparse  # pylint: disable=g-import-not-at-top
  shape = (len(probs), num_bins * num_classes)
  sums = [counts @ scipy.sparse.csr_matrix((value, (rows, columns)), shape=shape)
          for value in (np.ones(len(rows)), probs[rows, classes], event.astype(np.float64))]
  label_counts = np.stack([np.bincount(labels, c, num_classes) for c in counts])
  totals = (np.broadcast_to(counts.sum(1, keepdims=True), label_counts.shape),
            counts @ probs, label_counts)  # [B, K] each: count, confidence, event sums.
  by_bin = [np.asarray(s).reshape(len(counts), num_bins, num_classes) for s in sums]
  lowest = [t - s.sum(1) for t, s in zip(totals, by_bin)]  # Bin 0: the rest.
  confidence = np.concatenate([lowest[1][:, None], by_bin[1][:, :-1]], 1)  # [B, M, K]
  events = np.concatenate([lowest[2][:, None], by_bin[2][:, :-1]], 1)
  return np.abs(events - confidence).sum((1, 2)) / counts.sum(1) / num_classes
