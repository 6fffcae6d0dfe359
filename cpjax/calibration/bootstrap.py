"""Bootstrap confidence intervals for any metric of (probs, labels) data.

Following the focal-loss paper's error bars (Mukhoti et al. 2020 App. G, code
from Kumar et al. 2019; docs/methods.md#bootstrap-intervals): B resamples of size N
with replacement,
the metric recomputed on each, and by default the basic (pivotal) interval
[2 t - q_hi, 2 t - q_lo] around the full-data value t, with "mid" 2 t - q_50.
The percentile interval [q_lo, q_hi] is the alternative. The seed is explicit
and recorded with the result.
"""

from collections.abc import Callable
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
  if kind not in KINDS:
    raise ValueError(f"kind={kind!r}; valid choices: {', '.join(KINDS)}")
  if not 0 < level < 1:
    raise ValueError(f"level={level} must be in (0, 1)")
  size = len(arrays[0])
  point = float(metric(*arrays))
  rng = np.random.default_rng(seed)
  # Not scipy.stats.bootstrap: it draws the same resamples from the same generator and gives
  # the same interval (tests/test_metrics.py checks it) but differs in the last bit, which
  # would change reported numbers; it has no "mid" and needs index arrays to keep probs
  # [N, K] paired with labels [N].
  values = np.empty(num_resamples)
  for b in range(num_resamples):
    rows = rng.integers(0, size, size)
    values[b] = metric(*(a[rows] for a in arrays))
  tail = 100 * (1 - level) / 2
  q_lo, q_mid, q_hi = np.percentile(values, [tail, 50, 100 - tail])
  if kind == "basic":
    low, mid, high = 2 * point - q_hi, 2 * point - q_mid, 2 * point - q_lo
  else:
    low, mid, high = q_lo, q_mid, q_hi
  return Interval(point, float(low), float(high), float(mid), level, kind, num_resamples, seed)
