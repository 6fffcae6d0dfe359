"""Equivalence of paired per-seed differences: when may a study say "lossless"?

An interval that includes 0 is not evidence of no difference: with few seeds it is
wide enough to include losses that matter. Equivalence needs its own test: two
one-sided t-tests (Schuirmann 1987) at a stated margin.
"""

import math

import numpy as np
from scipy import stats

MARGIN = 0.002  # Equivalence margin: 0.2 accuracy points.
MIN_MEAN = -0.001  # Lossless also needs a mean difference of at least -0.1 points.
ALPHA = 0.05  # Each one-sided test; the TOST's interval is the 1 - 2 alpha = 90 % t interval.


def tost(differences, margin: float = MARGIN, alpha: float = ALPHA) -> dict:
  """Two one-sided t-tests of equivalence (Schuirmann 1987) on paired differences d:
  H0- : mean <= -margin vs mean > -margin, and H0+ : mean >= margin vs mean < margin.
  Equivalence at level alpha when both reject, i.e. max(p-, p+) < alpha, the same as the
  1 - 2 alpha t interval lying inside (-margin, margin)."""
  d = np.asarray(differences, np.float64)
  n = len(d)
  mean = float(d.mean())
  if n < 2:
    return {"n": n, "mean": mean, "p": math.nan, "equivalent": False,
            "low": math.nan, "high": math.nan}
  se = d.std(ddof=1) / math.sqrt(n)
  if se == 0:
    p_value = 0.0 if abs(mean) < margin else 1.0
    half = 0.0
  else:
    p_low = stats.t.sf((mean + margin) / se, n - 1)  # H0: mean <= -margin.
    p_high = stats.t.cdf((mean - margin) / se, n - 1)  # H0: mean >= +margin.
    p_value = float(max(p_low, p_high))
    half = stats.t.ppf(1 - alpha, n - 1) * se
  return {"n": n, "mean": mean, "p": p_value, "equivalent": bool(p_value < alpha),
          "low": mean - half, "high": mean + half}


def lossless(test: dict) -> bool:
  """Equivalent at the margin and a mean difference of at least MIN_MEAN."""
  return bool(test["equivalent"] and test["mean"] >= MIN_MEAN)


def describe(test: dict) -> str:
  """'equivalent at +-0.2 (TOST p 0.012)' or 'not shown equivalent at +-0.2 (TOST p 0.31)'."""
  if not np.isfinite(test["p"]):
    return f"equivalence untested ({test['n']} seed)"
  word = "equivalent" if test["equivalent"] else "not shown equivalent"
  return f"{word} at ±{100 * MARGIN:.1f} (TOST p {test['p']:.3f})"
