"""Bootstrap confidence intervals for any metric of (probs, labels) data.

Following the focal-loss paper's error bars (Mukhoti et al. 2020 App. G, code
from Kumar et al. 2019; docs/methods.md#bootstrap-intervals): B resamples of size N
with replacement,
the metric recomputed on each, and by default the basic (pivotal) interval
[2 t - q_hi, 2 t - q_lo] around the full-data value t, with "mid" 2 t - q_50.
The percentile interval [q_lo, q_hi] is the alternative. The seed is explicit
and recorded with the result.
"""

from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

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
