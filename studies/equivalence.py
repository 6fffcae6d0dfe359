"""Equivalence of paired per-seed differences: when may a study say "lossless"?

An interval that includes 0 is not evidence of no difference: with few seeds it is
wide enough to include losses that matter. Equivalence needs its own test: two
one-sided t-tests (Schuirmann 1987) at a stated margin. Better than the reference is a
third claim, with a test of its own (`superiority`), declared before the runs it reads.
"""

import math

import numpy as np
from scipy import integrate, stats

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
  mean = float(d.mean()) if n else math.nan  # No pair yet (a worker's summary mid-tier).
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


def superiority(differences, alpha: float = ALPHA) -> dict:
  """A one-sided paired t-test of superiority on differences d (arm - reference): H0 : mean
  <= 0 against mean > 0. Better at level alpha when p < alpha, the same as the lower end of
  the 1 - 2 alpha = 90 % t interval (the TOST's interval) lying above 0."""
  d = np.asarray(differences, np.float64)
  n = len(d)
  mean = float(d.mean()) if n else math.nan  # No pair yet (a worker's summary mid-tier).
  if n < 2:
    return {"n": n, "mean": mean, "p": math.nan, "superior": False,
            "low": math.nan, "high": math.nan}
  se = d.std(ddof=1) / math.sqrt(n)
  if se == 0:
    p_value, half = (0.0 if mean > 0 else 1.0), 0.0
  else:
    p_value = float(stats.t.sf(mean / se, n - 1))
    half = stats.t.ppf(1 - alpha, n - 1) * se
  return {"n": n, "mean": mean, "p": p_value, "superior": bool(p_value < alpha),
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


def tost_power(sd: float, n: int, difference: float = 0.0, margin: float = MARGIN,
               alpha: float = ALPHA) -> float:
  """The probability that `tost` finds n paired differences equivalent when they are drawn
  from N(difference, sd^2) (e.g. n = 3 seeds, sd 0.0012 = 0.12 points: 0.41).

  The TOST passes when mean - c s / sqrt(n) > -margin and mean + c s / sqrt(n) < margin, with
  c = t_{1 - alpha}(n - 1) (Schuirmann 1987). The mean ~ N(difference, sd^2 / n) is independent
  of u = (n - 1) s^2 / sd^2 ~ chi^2(n - 1), so the power is the integral over u of
  P(-h < mean < h) = Phi((h - d) / se) - Phi((-h - d) / se), with h = margin - c s / sqrt(n)
  >= 0, d = difference and se = sd / sqrt(n), against the chi^2 density (Phillips 1990,
  "Power of the two one-sided tests procedure in bioequivalence")."""
  if n < 2 or sd <= 0:
    raise ValueError(f"tost_power needs n >= 2 and sd > 0, got n={n}, sd={sd}")
  crit, se = stats.t.ppf(1 - alpha, n - 1), sd / math.sqrt(n)
  def inside(u):
    half = margin - crit * se * math.sqrt(u / (n - 1))
    return ((stats.norm.cdf((half - difference) / se) - stats.norm.cdf((-half - difference) / se))
            * stats.chi2.pdf(u, n - 1))
  # Beyond u_max the t interval is wider than the margin's window; beyond the chi^2's 1e-14
  # tail there is nothing to integrate (and quad, given a long empty range, would miss the mass).
  u_max = min((n - 1) * (margin / (crit * se)) ** 2, stats.chi2.isf(1e-14, n - 1))
  return float(integrate.quad(inside, 0.0, u_max, limit=200)[0])
