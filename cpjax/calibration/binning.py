"""One-vs-rest binning maps of class probabilities (NumPy), for cpjax.calibration.posthoc.

  histogram binning   per class k, p_k's equal-width bin [e_m, e_{m+1}) (the last closed)
                      maps to the share of the fit rows in it with label k; an empty bin
                      maps to its centre (Zadrozny & Elkan 2001, ICML).
  isotonic            per class k, the isotonic (non-decreasing) regression of 1[y = k] on
                      p_k by pool-adjacent-violators, tied p_k pooled first, linear between
                      the fitted points and constant beyond them, as scikit-learn's
                      IsotonicRegression (Zadrozny & Elkan 2002, KDD).

Each class is mapped on its own, so a row no longer sums to 1: `renormalised_log` floors
the mapped probabilities (a class can map to 0) and renormalises them in log space.

The fits are NumPy; the applications take `xp` (numpy, or jax.numpy to run under jit).
"""

import numpy as np


def bin_of(p, num_bins: int, xp=np):
  """Equal-width bin of each probability: [e_m, e_{m+1}), the last bin closed at 1."""
  return xp.clip(xp.floor(p * num_bins).astype(xp.int32), 0, num_bins - 1)


def fit_histogram(p: np.ndarray, labels: np.ndarray, num_bins: int) -> dict[str, np.ndarray]:
  """Histogram binning of probabilities p [N, K]: each (class, bin)'s mapped value [K, bins]."""
  k = p.shape[-1]
  index = bin_of(p, num_bins) + num_bins * np.arange(k)  # [N, K] bin id per (class, bin).
  events = (labels[:, None] == np.arange(k)).astype(np.float64)
  count = np.bincount(index.ravel(), minlength=k * num_bins).reshape(k, num_bins)
  hits = np.bincount(index.ravel(), events.ravel(), k * num_bins).reshape(k, num_bins)
  centres = (np.arange(num_bins) + 0.5) / num_bins
  return {"values": np.where(count > 0, hits / np.maximum(count, 1), centres[None, :])}


def apply_histogram(params, p, xp=np):
  """Each class probability of p [N, K] replaced by its bin's fitted value."""
  values = xp.asarray(params["values"])
  return values[np.arange(p.shape[-1])[None, :], bin_of(p, values.shape[-1], xp)]


def pool_adjacent_violators(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Isotonic regression of y on x (equal weights): the knots (unique x, fitted y).

  Tied x are pooled first (their mean y, weighted by their count); then adjacent
  blocks whose means decrease are merged until the means are non-decreasing.
  """
  order = np.argsort(x, kind="stable")
  ux, start, counts = np.unique(x[order], return_index=True, return_counts=True)
  means = np.add.reduceat(y[order].astype(np.float64), start) / counts
  # SciPy's pool-adjacent-violators (C) on the tied means weighted by their counts: the same
  # unique least-squares fit as pooling in Python (up to rounding), ~100x faster, which a
  # report at ImageNet's K (a fit per class per fold) needs.
  # Imported here: the training path imports this module (the config's map names), and only
  # the report fits a map.
  import scipy.optimize  # pylint: disable=g-import-not-at-top
  fitted = scipy.optimize.isotonic_regression(means, weights=counts.astype(np.float64)).x
  return ux, fitted


def fit_isotonic(p: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
  """Knots per class padded to a common length L by repeating the last one: x, y [K, L]."""
  knots = [pool_adjacent_violators(p[:, k], (labels == k).astype(np.float64))
           for k in range(p.shape[-1])]
  length = max(len(x) for x, _ in knots)
  pad = lambda a: np.concatenate([a, np.full(length - len(a), a[-1])])  # noqa: E731
  return {"x": np.stack([pad(x) for x, _ in knots]), "y": np.stack([pad(y) for _, y in knots])}


def apply_isotonic(params, p, xp=np):
  """Each class probability of p [N, K] mapped through its class's knots (linear between)."""
  return xp.stack([xp.interp(p[:, k], xp.asarray(params["x"][k]), xp.asarray(params["y"][k]))
                   for k in range(p.shape[-1])], axis=-1)


def renormalised_log(q, floor: float, xp=np):
  """log(q / sum q) per row, with q floored at `floor` (and NaN read as the floor) first."""
  q = xp.maximum(xp.nan_to_num(q, nan=floor), floor)
  return xp.log(q) - xp.log(q.sum(axis=-1, keepdims=True))
