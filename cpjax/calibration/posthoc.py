"""Post-hoc calibration maps: fitted on validation logits, applied to any logits.

One interface for every method: `fit(method, logits, labels, **hyper)` returns a
`Calibrator` (the method's name, its parameters as arrays, the chosen
hyper-parameters and the cross-validated validation NLL), and
`apply(calibrator, logits)` returns float64 log-probabilities [N, K]
(`apply(calibrator, logits, jax.numpy)` the same in JAX, jit-able). With z the
logits, p = softmax(z) and s the calibrated scores (log-probabilities are
log_softmax(s)):

  none                  s = z (the identity: the uncalibrated model).
  temperature           s = z / T, T = exp(t) fitted by L-BFGS on NLL (Guo et al. 2017,
                        ICML). The grid fits of cpjax.calibration.temperature stay
                        available through `search="grid_ece"` or `"grid_nll"`.
  vector_scaling        s = w * z + b, w, b in R^K (Guo et al. 2017), regularised by
                        lambda / K (sum_k (w_k - mean w)^2 + sum_k b_k^2), ODIR's analogue for
                        a diagonal map (unregularised, it can overfit a small, nearly
                        separable validation set).
  matrix_scaling        s = W z + b, W in R^{KxK}, with the off-diagonal and intercept
                        regularisation (ODIR) of Kull et al. 2019 (NeurIPS):
                        lambda / (K (K - 1)) sum_{i != j} W_ij^2 + lambda / K sum_j b_j^2.
  dirichlet             s = W log p + b, ODIR-regularised (Kull et al. 2019, NeurIPS:
                        Dirichlet calibration is matrix scaling of log-probabilities).
  ensemble_temperature  q = w_1 softmax(z / T) + w_2 softmax(z) + w_3 / K, T from
                        temperature scaling, w on the simplex (w = softmax(a)) minimising
                        NLL (Zhang, Kailkhura & Han 2020, ICML: ETS).
  histogram_binning     per class k (one-vs-rest), p_k's equal-width bin [e_m, e_{m+1})
                        (the last closed) maps to the share of its validation samples
                        with label k; an empty bin maps to its centre; rows renormalised
                        (Zadrozny & Elkan 2001, ICML).
  isotonic              per class k, the isotonic (non-decreasing) regression of
                        1[y = k] on p_k by pool-adjacent-violators, tied p_k pooled first,
                        linear between the fitted points and constant beyond them (as
                        scikit-learn's IsotonicRegression); rows renormalised (Zadrozny &
                        Elkan 2002, KDD).

The one-vs-rest maps can give a class probability 0: their outputs are floored
at `floor` (default 1e-6) before renormalising, so no log-probability is
-inf, and every map works in log space on saturated logits, so no output is
non-finite for finite logits.

Regularisation strengths (ODIR's lambda, the number of histogram bins) are chosen
by k-fold cross-validation on the logits given to `fit` (the validation split,
never the test split): each candidate is fitted on k - 1 folds and scored by NLL
on the held-out fold; the lowest mean wins and is refitted on all rows. Every
method records its cross-validated NLL, which `choose` compares (`auto`).

The parametric fits run SciPy's L-BFGS-B on the objective's float64 NumPy value and
analytic gradient (`value_and_grad`; the same objective in jax.numpy, `objective`, is
jit-able and the tests check one against the other's jax.grad); folds are 0/1 row weights.
"""

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
import threadpoolctl

from cpjax.calibration import binning, temperature

METHODS = ("none", "temperature", "vector_scaling", "matrix_scaling", "dirichlet",
           "ensemble_temperature", "histogram_binning", "isotonic")
PARAMETRIC = ("temperature", "vector_scaling", "matrix_scaling", "dirichlet",
              "ensemble_temperature")
# Candidates of the cross-validated hyper-parameter of each method that has one.
ODIR_GRID = (0.0, 1e-2, 1e-1, 1.0, 10.0)
BINS_GRID = (5, 10, 15, 20, 30)
DEFAULT_FLOOR = 1e-6
DEFAULT_FOLDS = 5
DEFAULT_STEPS = 200  # The most L-BFGS-B iterations of a parametric fit.


class Calibrator(NamedTuple):
  """A fitted post-hoc map."""
  method: str  # One of METHODS.
  params: dict[str, np.ndarray]  # The method's parameters.
  hyper: dict[str, Any]  # The hyper-parameters used (the cross-validated one included).
  cv_nll: float  # Mean held-out-fold NLL of the chosen hyper-parameters on the fit data.


# ----------------------------------------------------------------------------------------------
# The maps, written once for NumPy (apply, float64) and jax.numpy (the jitted fits).


def _constant(xp, x):
  """x without a gradient. The shift by the maximum changes no value, and its gradient
  (a max's) came out NaN in float64 under XLA:CPU's --xla_backend_optimization_level=0."""
  return x if xp is np else jax.lax.stop_gradient(x)


def _log_softmax(xp, s):
  s = s - _constant(xp, s.max(axis=-1, keepdims=True))
  return s - xp.log(xp.sum(xp.exp(s), axis=-1, keepdims=True))


def _logsumexp(xp, s, axis):
  m = _constant(xp, s.max(axis=axis, keepdims=True))
  return xp.squeeze(m, axis) + xp.log(xp.sum(xp.exp(s - m), axis=axis))


def _parametric_log_probs(xp, method: str, params: dict, z):
  """log-probabilities of a parametric map (see the module docstring)."""
  if method == "temperature":
    return _log_softmax(xp, z / xp.exp(params["log_t"]))
  if method == "vector_scaling":
    return _log_softmax(xp, z * params["w"] + params["b"])
  if method in ("matrix_scaling", "dirichlet"):
    x = z if method == "matrix_scaling" else _log_softmax(xp, z)
    return _log_softmax(xp, x @ params["w"].T + params["b"])
  if method == "ensemble_temperature":
    return _parametric_log_probs(xp, "ets_mixture", params, _ets_parts(xp, z, params["log_t"]))
  if method == "ets_mixture":  # z: the three parts' log-probabilities [3, N, K].
    log_w = _log_softmax(xp, params["a"])  # [3] on the simplex, in log space.
    return _logsumexp(xp, log_w[:, None, None] + z, 0)
  raise ValueError(f"not a parametric method: {method!r}")


def _ets_parts(xp, z, log_t):
  """ETS's three log-probabilities [3, N, K]: scaled, unscaled, uniform."""
  uniform = xp.zeros_like(z) - xp.log(1.0 * z.shape[-1])
  return xp.stack([_log_softmax(xp, z / xp.exp(log_t)), _log_softmax(xp, z), uniform], axis=0)


def _penalty(method: str, params: dict, num_classes: int):
  """ODIR: mean squared off-diagonal weight plus mean squared intercept (Kull et al. 2019);
  for vector scaling, its analogue for a diagonal map: the mean squared deviation of w from
  its mean (a shared scale, i.e. a temperature, stays free) plus the mean squared intercept."""
  if method == "vector_scaling":
    w = params["w"]
    return jnp.mean((w - jnp.mean(w)) ** 2) + jnp.mean(params["b"] ** 2)
  if method not in ("matrix_scaling", "dirichlet"):
    return 0.0
  w = params["w"]
  off = jnp.sum(w ** 2) - jnp.sum(jnp.diagonal(w) ** 2)
  return off / max(num_classes * (num_classes - 1), 1) + jnp.mean(params["b"] ** 2)


def _identity_params(method: str, num_classes: int, log_t: float = 0.0) -> dict:
  """Parameters at which the map is the identity (or T = exp(log_t)): where L-BFGS starts."""
  k = num_classes
  if method == "temperature":
    return {"log_t": np.float32(np.log(1.5))}  # Guo et al.'s start.
  if method == "vector_scaling":
    return {"w": np.ones(k, np.float32), "b": np.zeros(k, np.float32)}
  if method in ("matrix_scaling", "dirichlet"):
    return {"w": np.eye(k, dtype=np.float32), "b": np.zeros(k, np.float32)}
  return {"log_t": np.float64(log_t), "a": np.zeros(3, np.float32)}  # ETS: equal weights.


# ----------------------------------------------------------------------------------------------
# Parametric fits: weighted mean NLL + strength * penalty, minimised by SciPy's L-BFGS-B. The
# objective is written in jax.numpy (`objective`, jit-able); the fits use its NumPy float64
# value and analytic gradient (`value_and_grad`, checked against jax.grad in the tests),
# because on the few thousand rows of a validation split a call costs microseconds in NumPy
# and far more through a jitted function's dispatch, and a fit takes hundreds of calls.


def objective(method: str, params: dict, inputs, labels, weights, strength):
  """The fitted objective in jax.numpy: sum_i weights_i (-log q_i[y_i]) / sum_i weights_i +
  strength * penalty. `method` is "temperature", "vector_scaling", "matrix_scaling" (Dirichlet:
  matrix scaling with inputs log p) or "ets_mixture" (inputs: ETS's three parts [3, N, K])."""
  log_p = _parametric_log_probs(jnp, method, params, inputs)
  nll = -jnp.sum(weights * jnp.take_along_axis(log_p, labels[:, None], axis=-1)[:, 0])
  return nll / jnp.sum(weights) + strength * _penalty(method, params, inputs.shape[-1])


def value_and_grad(method: str, params: dict, inputs: np.ndarray, labels: np.ndarray,
                   weights: np.ndarray, strength: float) -> tuple[float, dict]:
  """`objective` and its gradient in NumPy float64, by hand."""
  omega = weights / np.sum(weights)
  rows = np.arange(len(labels))
  k = inputs.shape[-1]
  if method == "ets_mixture":
    log_w = _log_softmax(np, params["a"])
    at_label = inputs[:, rows, labels] + log_w[:, None]  # [3, N]
    log_q = _logsumexp(np, at_label, 0)
    responsibility = np.exp(at_label - log_q)  # [3, N], sums to 1 over the parts.
    grad_a = -(responsibility @ omega - np.exp(log_w))
    return float(-omega @ log_q), {"a": grad_a}
  if method == "temperature":
    scores = inputs * np.exp(-params["log_t"])
  elif method == "vector_scaling":
    scores = inputs * params["w"] + params["b"]
  else:
    scores = inputs @ params["w"].T + params["b"]
  log_p = _log_softmax(np, scores)
  value = float(-omega @ log_p[rows, labels])
  g = np.exp(log_p)
  g[rows, labels] -= 1.0
  g *= omega[:, None]  # d value / d scores.
  if method == "temperature":
    return value, {"log_t": np.float64(-np.sum(g * scores))}
  b = params["b"]
  grad_b = g.sum(0) + strength * 2.0 * b / k
  value += strength * float(np.mean(b ** 2))
  w = params["w"]
  if method == "vector_scaling":
    deviation = w - np.mean(w)
    value += strength * float(np.mean(deviation ** 2))
    return value, {"w": np.sum(g * inputs, 0) + strength * 2.0 * deviation / k, "b": grad_b}
  off = w * (1.0 - np.eye(k))
  pairs = max(k * (k - 1), 1)
  value += strength * float(np.sum(off ** 2)) / pairs
  return value, {"w": g.T @ inputs + strength * 2.0 * off / pairs, "b": grad_b}


def _fit_one(method: str, z, y, weights, strength: float, steps: int,
             log_t: float = 0.0, start: dict | None = None) -> dict[str, np.ndarray]:
  init = _identity_params(method, z.shape[-1], log_t)
  init.update({k: v for k, v in (start or {}).items() if k != "log_t"})
  # What does not depend on the moving parameters is computed once: Dirichlet calibration
  # is matrix scaling of log p; ETS with T fixed is a mixture of three fixed predictions.
  key, inputs = method, z
  if method == "dirichlet":
    key, inputs = "matrix_scaling", _log_softmax(np, z)
  elif method == "ensemble_temperature":
    key, inputs = "ets_mixture", _ets_parts(np, z, init.pop("log_t"))
  names = sorted(init)
  shapes = [np.shape(init[n]) for n in names]
  sizes = [int(np.prod(shape)) for shape in shapes]

  def unflatten(x):
    parts = np.split(np.asarray(x, np.float64), np.cumsum(sizes)[:-1])
    return {n: p.reshape(shape) for n, p, shape in zip(names, parts, shapes)}

  def fun(x):
    value, grad = value_and_grad(key, unflatten(x), inputs, y, weights, strength)
    return value, np.concatenate([np.ravel(grad[n]) for n in names])

  x0 = np.concatenate([np.ravel(init[n]) for n in names]).astype(np.float64)
  result = scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B",
                                   options={"maxiter": steps})
  fixed = {"log_t": np.float64(log_t)} if method == "ensemble_temperature" else {}
  return {**unflatten(result.x), **fixed}


def fit_parametric(method: str, logits: np.ndarray, labels: np.ndarray,
                   weights: np.ndarray | None = None, strength: float = 0.0,
                   steps: int = DEFAULT_STEPS, start: dict | None = None,
                   log_t: float | None = None) -> dict[str, np.ndarray]:
  """One fit of a parametric map: minimises the weighted mean NLL + strength * penalty.

  Args:
    method: one of PARAMETRIC.
    logits: [N, K] logits.
    labels: [N] integer labels.
    weights: [N] row weights (0/1 selects the fold's training rows); None = all ones.
    strength: the regularisation strength (vector_scaling, matrix_scaling, dirichlet; ignored
      by the others).
    steps: the most L-BFGS-B iterations.
    start: parameters to start from (a warm start); None = the identity map.
    log_t: ensemble_temperature only: a fixed log-temperature; None = fitted by NLL first.

  Returns:
    The fitted parameters (ETS: with its temperature fitted first on the same rows).
  """
  z = np.asarray(logits, np.float64)
  y = np.asarray(labels, np.int64)
  w = np.ones(len(z)) if weights is None else np.asarray(weights, np.float64)
  if method == "ensemble_temperature" and log_t is None:
    log_t = float(_fit_one("temperature", z, y, w, 0.0, steps)["log_t"])
  return _fit_one(method, z, y, w, float(strength), steps, log_t or 0.0, start)


# ----------------------------------------------------------------------------------------------
# The interface.


def _softmax(xp, z):
  """softmax(z) through the log-space softmax: the input of the one-vs-rest maps."""
  return xp.exp(_log_softmax(xp, z))


def apply(calibrator: Calibrator, logits, xp=np):
  """Calibrated log-probabilities [N, K] of `logits`, finite for finite logits.

  With xp = numpy (the default) in float64. With xp = jax.numpy in the logits' precision
  and jit-able, the calibrator closed over: `jax.jit(lambda z: apply(c, z, jnp))`.
  """
  z = np.asarray(logits, np.float64) if xp is np else xp.asarray(logits)
  method, params = calibrator.method, calibrator.params
  if method == "none":
    return _log_softmax(xp, z)
  if method in PARAMETRIC:
    params = {k: xp.asarray(v) for k, v in params.items()}
    return _log_softmax(xp, _parametric_log_probs(xp, method, params, z))  # Exact rows.
  q = (binning.apply_histogram if method == "histogram_binning" else binning.apply_isotonic)(
      params, _softmax(xp, z), xp)
  return binning.renormalised_log(q, calibrator.hyper["floor"], xp)


def _folds(n: int, num_folds: int, seed: int) -> np.ndarray:
  """Fold of each row: a seeded permutation dealt round-robin, so fold sizes differ by <= 1."""
  if not 2 <= num_folds <= n:
    raise ValueError(f"folds={num_folds} must be in [2, {n}] (the number of fit rows)")
  fold = np.empty(n, np.int64)
  fold[np.random.default_rng(seed).permutation(n)] = np.arange(n) % num_folds
  return fold


def _held_out_nll(log_p: np.ndarray, labels: np.ndarray) -> float:
  return float(-np.mean(log_p[np.arange(len(labels)), labels]))


def _grid(method: str, hyper: dict) -> tuple[str | None, tuple]:
  """(name, candidates) of the cross-validated hyper-parameter; a value given pins it."""
  name = {"vector_scaling": "odir", "matrix_scaling": "odir", "dirichlet": "odir",
          "histogram_binning": "num_bins"}.get(method)
  if name is None:
    return None, (None,)
  if hyper.get(name) is not None:
    return name, (hyper[name],)
  return name, ODIR_GRID if name == "odir" else BINS_GRID


def fit(method: str, logits: np.ndarray, labels: np.ndarray, *, folds: int = DEFAULT_FOLDS,
        seed: int = 0, steps: int = DEFAULT_STEPS, floor: float = DEFAULT_FLOOR,
        odir: float | None = None, num_bins: int | None = None,
        search: str = "lbfgs_nll") -> Calibrator:
  """Fits a post-hoc map on (validation) logits [N, K] and integer labels [N].

  Args:
    method: one of METHODS.
    logits: the fit split's logits (never the test split's).
    labels: their labels.
    folds: k of the k-fold cross-validation.
    seed: seed of the fold assignment.
    steps: L-BFGS iterations of the parametric fits.
    floor: smallest probability of the one-vs-rest maps before renormalising.
    odir: vector_scaling / matrix_scaling / dirichlet regularisation strength; None =
      cross-validated over ODIR_GRID.
    num_bins: histogram_binning bins; None = cross-validated over BINS_GRID.
    search: temperature only: lbfgs_nll, or a grid fit of cpjax.calibration.temperature
      (grid_ece, grid_nll).

  Returns:
    The fitted Calibrator with its cross-validated NLL.
  """
  if method not in METHODS:
    raise ValueError(f"post-hoc method={method!r}; valid choices: {', '.join(METHODS)}")
  # One BLAS thread: the fits' matrices are tiny, and OpenBLAS's threads waiting on each
  # other made L-BFGS-B's steps ~10x slower on a busy 2-core machine.
  with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
    return _fit(method, logits, labels, folds=folds, seed=seed, steps=steps, floor=floor,
                odir=odir, num_bins=num_bins, search=search)


def _fit(method, logits, labels, *, folds, seed, steps, floor, odir, num_bins,
         search) -> Calibrator:
  if search not in temperature.METHODS:
    raise ValueError(f"search={search!r}; valid choices: {', '.join(temperature.METHODS)}")
  z = np.asarray(logits, np.float64)
  y = np.asarray(labels, np.int64)
  if z.ndim != 2 or y.shape != (len(z),):
    raise ValueError(f"logits {z.shape} and labels {y.shape} must be [N, K] and [N]")
  if not np.all(np.isfinite(z)):
    raise ValueError("logits must be finite to fit a post-hoc map")
  name, candidates = _grid(method, {"odir": odir, "num_bins": num_bins})
  hyper = {"folds": folds, "seed": seed, "floor": floor}
  if method == "temperature" and search != "lbfgs_nll":
    return _fit_temperature_grid(z, y, search, hyper)
  fold = _folds(len(z), folds, seed)
  if method in PARAMETRIC:
    hyper["steps"] = steps
    return _fit_parametric_cv(method, z, y, fold, name, candidates, hyper)
  scores = np.zeros(len(candidates))
  for f in range(folds):
    train, held = fold != f, fold == f
    for c, value in enumerate(candidates):
      fitted = _fit_nonparametric(method, z[train], y[train], {**hyper, name: value})
      scores[c] += _held_out_nll(apply(fitted, z[held]), y[held]) * held.sum()
  best = int(np.argmin(scores))
  if name is not None:
    hyper[name] = candidates[best]
  return _fit_nonparametric(method, z, y, hyper)._replace(cv_nll=float(scores[best] / len(z)))


def _fit_nonparametric(method, z, y, hyper) -> Calibrator:
  if method == "none":
    params = {}
  elif method == "histogram_binning":
    params = binning.fit_histogram(_softmax(np, z), y, hyper["num_bins"])
  else:
    params = binning.fit_isotonic(_softmax(np, z), y)
  return Calibrator(method, params, hyper, float("nan"))


def _fit_parametric_cv(method, z, y, fold, name, candidates, hyper) -> Calibrator:
  """Every candidate on every fold, then the best candidate on all rows. Within a fold the
  strengths go from strongest to weakest, each fit starting where the previous one ended."""
  strengths = [0.0 if value is None else float(value) for value in candidates]
  scores = np.zeros(len(strengths))
  for f in range(int(fold.max()) + 1):
    held, params = fold == f, None
    for c in np.argsort(strengths)[::-1]:
      params = fit_parametric(method, z, y, ~held, strengths[c], hyper["steps"], params)
      finite = _finite(params)
      log_p = _parametric_log_probs(np, method, params, z[held]) if finite else None
      scores[c] += _held_out_nll(log_p, y[held]) * held.sum() if finite else np.inf
      params = params if finite else None  # A diverged fit is no warm start.
  # The best candidate refitted on all rows; should that fit diverge, the next best, and if
  # every one does, the starting map (cv_nll inf): never non-finite parameters.
  for best in np.argsort(scores, kind="stable"):
    params = fit_parametric(method, z, y, None, strengths[best], hyper["steps"])
    if _finite(params):
      if name is not None:
        hyper[name] = candidates[best]
      return Calibrator(method, params, hyper, float(scores[best] / len(z)))
  logging.warning("Every %s fit diverged; keeping its starting map.", method)
  return Calibrator(method, _identity_params(method, z.shape[-1]), hyper, float("inf"))


def _finite(params: dict[str, np.ndarray]) -> bool:
  return all(np.all(np.isfinite(v)) for v in params.values())


def _fit_temperature_grid(z, y, search, hyper) -> Calibrator:
  """A grid fit of cpjax.calibration.temperature, cross-validated like the others."""
  fold = _folds(len(z), hyper["folds"], hyper["seed"])
  total = 0.0
  for f in range(hyper["folds"]):
    held = fold == f
    t = temperature.fit_temperature(z[~held], y[~held], method=search).temperature
    total += _held_out_nll(_log_softmax(np, z[held] / t), y[held]) * held.sum()
  t = temperature.fit_temperature(z, y, method=search).temperature
  return Calibrator("temperature", {"log_t": np.float64(np.log(t))}, {**hyper, "search": search},
                    total / len(z))


def fit_all(logits: np.ndarray, labels: np.ndarray, methods=METHODS,
            **hyper) -> dict[str, Calibrator]:
  """Every method of `methods` fitted on the same rows and folds."""
  return {method: fit(method, logits, labels, **hyper) for method in methods}


def choose(calibrators: dict[str, Calibrator], name: str = "auto") -> str:
  """`name`, or for "auto" the calibrator of lowest cross-validated NLL (ties: first)."""
  if name != "auto":
    if name not in calibrators:
      raise ValueError(f"calibrator={name!r} was not fitted; fitted: {', '.join(calibrators)}")
    return name
  return min(calibrators, key=lambda m: calibrators[m].cv_nll)
