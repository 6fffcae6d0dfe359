"""Bootstrap confidence intervals for any metric of (probs, labels) data.

Following the focal-loss paper's error bars (Mukhoti et al. 2020 App. G, code
from Kumar et al. 2019; docs/methods.md#bootstrap-intervals): B resamples of size N
with replacement,
the metric recomputed on each, and by default the basic (pivotal) interval
[2 t - q_hi, 2 t - q_lo] around the full-data value t, with "mid" 2 t - q_50.
The percentile interval [q_lo, q_hi] is the alternative. The seed is explicit
and recorded with the result.

`resampled_values` computes the report's metrics over resamples without copying the [N, K]
probabilities per resample: from how often each resample draws each row, means as one matrix
product for a block of resamples, the ECE family and the AURCs from running sums along the
rows sorted by confidence, classwise ECE from sparse sums per (bin, class); each equal to the
metric of the resample's rows up to float64 rounding.
"""

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from cpjax.calibration import metrics

KINDS = ("basic", "percentile")
_GATHERED = 1 << 22  # Entries gathered at once by `classwise_ece_of_resamples` (32 MiB).


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


class _Sorted:
  """Rows sorted by a confidence (ascending), and per resample the running sums along that
  order of its draws' counts, outcomes and confidences: a resample's sums over a range of
  confidences are differences of two entries."""

  def __init__(self, confidence: np.ndarray, correct: np.ndarray):
    self.order = np.argsort(confidence, kind="stable")
    self.confidence, self.correct = confidence[self.order], correct[self.order]

  def running(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[C, N + 1] each: sums of counts, counts x correct, counts x confidence over the first
    j sorted rows, j = 0..N."""
    drawn = counts[:, self.order].astype(np.float64)
    pad = np.zeros((len(counts), 1))
    return tuple(np.concatenate([pad, np.cumsum(x, axis=1)], axis=1)
                 for x in (drawn, drawn * self.correct, drawn * self.confidence))


def _binned_gaps(sums, positions: np.ndarray, total=None) -> np.ndarray:
  """[C]: sum_m |B_m| |acc - conf| / total of bins holding the sorted rows positions[:, m] up
  to positions[:, m + 1] ([C, M + 1]); total: the resample's size (None: the binned count)."""
  count, correct, confidence = (np.diff(np.take_along_axis(x, positions, axis=1), axis=1)
                                for x in sums)
  total = count.sum(axis=1) if total is None else total
  with np.errstate(invalid="ignore", divide="ignore"):  # |B_m| |acc - conf| = |sum - sum|.
    return np.where(total > 0, np.abs(correct - confidence).sum(axis=1) / total, 0.0)


def _fixed_edge_ece(rows: _Sorted, sums, edges, side: str, total) -> np.ndarray:
  """ECE of fixed edges from the running sums along `rows` (`_Sorted.running`): right-closed
  bins (side "right": rows <= e_m are below bin m) or left-closed ("left")."""
  positions = np.searchsorted(rows.confidence, edges, side=side)
  return _binned_gaps(sums, np.broadcast_to(positions, (len(sums[0]), len(edges))), total)


def _adaptive_ece(rows: _Sorted, sums, num_bins: int) -> np.ndarray:
  """AdaECE of each resample from the running sums along `rows`: `metrics.adaptive_edges` of
  its sorted confidences (np.interp of them at linspace(0, N, M + 1), as that function does)
  found from the running counts, then right-closed bins."""
  size = int(round(float(sums[0][0, -1])))
  at = np.linspace(0, size, num_bins + 1)
  low = np.minimum(np.floor(at), size - 1).astype(np.int64)
  high = np.minimum(low + 1, size - 1)
  # The resample's k-th smallest confidence: the sorted row where the running count passes k.
  def order_statistic(k):
    return rows.confidence[np.stack([np.searchsorted(c[1:], k, side="right") for c in sums[0]])]
  below, above = order_statistic(low), order_statistic(high)
  fraction = np.where(at < size - 1, at - low, 0.0)
  edges = np.where(fraction > 0, (above - below) * fraction + below, below)
  positions = np.stack([np.searchsorted(rows.confidence, e, side="right") for e in edges])
  return _binned_gaps(sums, positions, float(size))


def _aurc(rows: _Sorted, counts, oracle: bool = False) -> np.ndarray:
  """AURC (oracle: of the ranking that puts every error last) of each resample, in closed form
  over its tie groups (`ranking.selective_risks`: within a group of s tied draws after a
  drawn, the errors accrue linearly, so its risks sum to before (H(a + s) - H(a)) + errors /
  s (s - a (H(a + s) - H(a))), H the harmonic numbers)."""
  drawn = counts.astype(np.float64)
  errors = drawn * (1.0 - rows.correct[np.argsort(rows.order)])  # In the rows' own order.
  if oracle:  # Two groups: the correct draws first, then the errors.
    size, error_total = drawn.sum(axis=1), errors.sum(axis=1)
    group_sizes = np.stack([size - error_total, error_total], axis=1)
    group_errors = np.stack([np.zeros_like(size), error_total], axis=1)
  else:  # Tie groups of the descending confidence.
    descending = rows.order[::-1]
    _, starts = np.unique(-rows.confidence[::-1], return_index=True)
    group_sizes = np.add.reduceat(drawn[:, descending], starts, axis=1)
    group_errors = np.add.reduceat(errors[:, descending], starts, axis=1)
  size = int(round(float(drawn[0].sum())))
  harmonic = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, size + 1))])
  ahead = np.cumsum(group_sizes, axis=1) - group_sizes  # Draws before each group.
  before = np.cumsum(group_errors, axis=1) - group_errors
  first = ahead.astype(np.int64)
  span = harmonic[first + group_sizes.astype(np.int64)] - harmonic[first]
  with np.errstate(invalid="ignore", divide="ignore"):
    within = np.where(group_sizes > 0, group_errors / group_sizes
                      * (group_sizes - ahead * span), 0.0)
  return (before * span + within).sum(axis=1) / size


def _column(name: str, statistics: dict, counts: np.ndarray, num_bins: int,
            running: dict) -> np.ndarray:
  """[C]: the named TABLE_METRICS column of each resample (counts [C, N]); `running`: the
  block's running sums along each order, computed at their first use (shared by columns)."""
  size = counts.sum(axis=1)
  if name in ("accuracy", "nll", "brier"):  # Means of a per-row statistic.
    key, sign = {"accuracy": ("correct", 1.0), "nll": ("label_log_prob", -1.0),
                 "brier": ("brier", 1.0)}[name]
    return sign * (counts @ statistics[key]) / size

  def sums(order: str):
    if order not in running:
      running[order] = statistics[order].running(counts)
    return running[order]
  if name == "ece":
    return _fixed_edge_ece(statistics["sorted"], sums("sorted"),
                           metrics.equal_width_edges(num_bins), "right", size)
  if name == "ece_left_closed":
    return _fixed_edge_ece(statistics["sorted32"], sums("sorted32"),
                           metrics.seed_edges(num_bins), "left", None)
  if name == "adaptive_ece":
    return _adaptive_ece(statistics["sorted"], sums("sorted"), num_bins)
  aurc = _aurc(statistics["sorted"], counts)
  return aurc if name == "aurc" else aurc - _aurc(statistics["sorted"], counts, oracle=True)


def resampled_values(probs, logits, labels, num_classes, num_bins, names, resamples,
                     counts_out: list | None = None) -> dict[str, np.ndarray]:
  """[B] values of each named metric (finite probabilities), over the resamples' [chunk, N]
  row blocks, from how often each resample draws each row (`row_counts`): means as one
  matrix product, the ECE family and the AURCs from running sums along the rows sorted by
  confidence, classwise ECE from `classwise_ece_of_resamples`. Each equals the metric of the
  resample's rows (`metrics`, `ranking`) up to float64 rounding: the same sums in another
  order. `counts_out`, a list: each block's row counts (`compact_counts`) are appended to it,
  for other statistics of the same resamples (`resampled_means`)."""
  statistics = row_statistics(probs, logits, labels)
  statistics["sorted"] = _Sorted(statistics["confidence"], statistics["correct"])
  statistics["sorted32"] = _Sorted(statistics["confidence32"], statistics["correct32"])
  values = {name: [] for name in names}
  for rows in resamples:
    counts = row_counts(rows, len(labels))
    if counts_out is not None:
      counts_out.append(compact_counts(counts))
    running = {}
    for name in names:
      values[name].append(
          classwise_ece_of_resamples(probs, labels, num_classes, num_bins, counts)
          if name == "classwise_ece" else _column(name, statistics, counts, num_bins, running))
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
  are gathered per resample ([B, entries], sorted by their (bin, class) once) and summed per
  (bin, class) by one `np.add.reduceat`, and the lowest bin's sums are the class totals
  (counts @ probs, the label counts) less theirs. Per (m, k), |B| |acc - conf| is
  |sum of events - sum of p|. Equal to `metrics.classwise_ece` of the resampled rows up to
  float64 rounding (the sums are taken in another order). Finite probabilities only.
  """
  probs, counts = np.asarray(probs, np.float64), np.asarray(counts, np.float64)
  edges = metrics.equal_width_edges(num_bins)
  index = metrics.bin_index(probs, edges, "right_closed")  # -1: p = 0, in no bin.
  rows, classes = np.nonzero(index != 0)
  slot = np.where(index[rows, classes] < 0, num_bins, index[rows, classes])  # M: no bin.
  columns = (slot - 1) * num_classes + classes  # Bins 1..M-1, then "no bin".
  order = np.argsort(columns, kind="stable")
  rows, classes, columns = rows[order], classes[order], columns[order]
  cells, starts = np.unique(columns, return_index=True)
  values = (np.ones(len(rows)), probs[rows, classes],
            (np.asarray(labels)[rows] == classes).astype(np.float64))
  sums = [np.zeros((len(counts), num_bins * num_classes)) for _ in values]
  block = max(1, _GATHERED // max(len(rows), 1))  # Resamples per gather of [block, entries].
  for first in range(0, len(counts) if len(cells) else 0, block):
    gathered = counts[first:first + block, rows]  # Each entry's row: drawn this many times.
    for summed, value in zip(sums, values):
      summed[first:first + block, cells] = np.add.reduceat(gathered * value, starts, axis=1)
  label_counts = np.stack([np.bincount(labels, c, num_classes) for c in counts])
  totals = (np.broadcast_to(counts.sum(1, keepdims=True), label_counts.shape),
            counts @ probs, label_counts)  # [B, K] each: count, confidence, event sums.
  by_bin = [s.reshape(len(counts), num_bins, num_classes) for s in sums]
  lowest = [t - s.sum(1) for t, s in zip(totals, by_bin)]  # Bin 0: the rest.
  confidence = np.concatenate([lowest[1][:, None], by_bin[1][:, :-1]], 1)  # [B, M, K]
  events = np.concatenate([lowest[2][:, None], by_bin[2][:, :-1]], 1)
  return np.abs(events - confidence).sum((1, 2)) / counts.sum(1) / num_classes
