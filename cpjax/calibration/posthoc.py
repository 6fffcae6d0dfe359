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

Every map is an entry of the registry MAPS (cpjax.registry), which declares its fit, its
apply, its cross-validated setting and grid and, for the parametric maps, its solver: vector,
matrix and Dirichlet scaling are fitted to convergence by Newton-CG in JAX, float32,
jitted, on the default device (cpjax.calibration.newton: max |gradient| <= 1e-6 relative
to the curvature where that exceeds 1, and a remaining Newton step that moves no fit row's
probability by more than 1e-5), temperature and ETS by SciPy's L-BFGS-B and its own tests
(cpjax.calibration.parametric, which also holds the float64 SciPy fits the JAX ones were
checked against: `SCIPY_ODIR_SOLVER`). A fit that ends short of its tolerance (rows that
nearly separate have no optimum) is logged (a warning naming the map, the strength and the
gradient reached), scores no cross-validated NLL, and flags the map (`Calibrator.converged`;
with no converged strength the map is the identity); a strength chosen at its grid's edge is
logged and flagged too (`Calibrator.at_edge`).
"""

from collections.abc import Callable
import concurrent.futures
import dataclasses
import importlib
import logging
import threading
import time
from typing import Any, NamedTuple

import numpy as np

from cpjax import registry
from cpjax.calibration import binning, exact_newton, parametric, temperature

# Candidates of the cross-validated strengths. ODIR's penalty is a mean over the K (K - 1)
# off-diagonal weights, so the strength that pins a map to its diagonal grows with K: the grid
# reaches 1e6, where for K <= 100 each off-diagonal weight's penalty is >= 100 W_ij^2.
ODIR_GRID = (0.0, 1e-2, 1e-1, 1.0, 10.0, 1e2, 1e3, 1e4, 1e5, 1e6)
# Matrix and Dirichlet scaling leave out strength 0: unregularised, their K^2 + K parameters
# nearly separate a validation split's rows (digits, Fashion-MNIST), where the objective has
# no determined minimiser and the fit scores nothing; 1e-2 is as weak as the grid goes.
SQUARE_ODIR_GRID = ODIR_GRID[1:]
BINS_GRID = (5, 10, 15, 20, 30)
DEFAULT_FLOOR = 1e-6
DEFAULT_FOLDS = 5
# Temperature and ETS (one and three parameters): L-BFGS-B's own tests, at most 200 steps.
SCALING_SOLVER = parametric.Solver(lbfgs_steps=200)
# Vector, matrix and Dirichlet scaling: Newton's method with the exact Hessian in NumPy
# float64 (cpjax.calibration.exact_newton) where it is cheap (vector scaling; matrix and
# Dirichlet scaling up to K ~ 20), else Newton-CG in JAX, float32 (cpjax.calibration.newton).
# On large logits or many classes their objective is ill-conditioned: L-BFGS-B took up to
# ~20,000 steps where Newton's method takes tens.
ODIR_SOLVER = exact_newton.Solver()
# The fits these replaced (SciPy, float64, max |gradient| <= 1e-8): `fit(..., solver=
# SCIPY_ODIR_SOLVER)` runs them, as the reference of the tests and benchmarks.
SCIPY_ODIR_SOLVER = parametric.Solver(lbfgs_steps=100, newton_steps=100, gtol=1e-8)


class Calibrator(NamedTuple):
  """A fitted post-hoc map."""
  method: str  # A map registered in MAPS.
  params: dict[str, np.ndarray]  # The method's parameters.
  hyper: dict[str, Any]  # The hyper-parameters used (the cross-validated one included).
  cv_nll: float  # Mean held-out-fold NLL of the chosen hyper-parameters on the fit data.
  converged: bool = True  # The final fit reached its solver's tolerance (closed forms: True).
  grad_norm: float = float("nan")  # Its max |gradient| (parametric maps).
  at_edge: bool = False  # The cross-validation chose its grid's last (or non-zero first) value.
  evaluations: int = 0  # Objective and Hessian-vector evaluations of every fit, CV included.


# ----------------------------------------------------------------------------------------------
# The maps. Each fit takes the logits [N, K], labels, 0/1 row weights (the fold's training
# rows), the setting's value and a warm start; each apply (params, logits, xp, hyper) gives
# log-probabilities [N, K], in NumPy or jax.numpy.


@dataclasses.dataclass(frozen=True)
class Map:
  """A post-hoc map with its settings: what `fit`, the config schema and the docs read."""
  name: str
  doc: str  # One line: the map and its paper.
  # (logits [N, K], labels [N], 0/1 row weights, setting's value or None, warm start) -> Fit.
  fit: Callable[..., parametric.Fit]
  apply: Callable[..., Any]
  setting: str | None = None  # The cross-validated hyper-parameter, if any.
  grid: tuple = ()  # Its candidates, in increasing order.
  solver: Any = None  # Parametric maps only: a parametric.Solver or exact_newton.Solver.
  square: bool = False  # K^2 + K parameters: the report skips it above a number of classes.
  settings: tuple[registry.Setting, ...] = ()  # None: config.evaluation's fields apply to all.

  @property
  def parametric(self) -> bool:
    """Fitted by an iterative solver (its parameters are small enough to report)."""
    return self.solver is not None


def _softmax(xp, z):
  """softmax(z) through the log-space softmax: the input of the one-vs-rest maps."""
  return xp.exp(parametric.log_softmax(xp, z))


def _closed_form(params: dict) -> parametric.Fit:
  return parametric.Fit(params, True, float("nan"), 0, "closed form")


def _parametric_map(name: str, doc: str, solver, grid: tuple = (), square: bool = False) -> Map:
  def fit_rows(z, y, weights, strength, start):
    return parametric.fit(name, z, y, weights, strength or 0.0, solver, start,
                          temperature_solver=SCALING_SOLVER)

  def apply_map(params, z, xp, hyper):
    del hyper
    params = {k: xp.asarray(v) for k, v in params.items()}
    return parametric.log_softmax(xp, parametric.log_probs(xp, name, params, z))  # Exact rows.
  return Map(name, doc, fit_rows, apply_map, "odir" if grid else None, grid, solver, square)


def with_solver(entry: Map, solver) -> Map:
  """A parametric map of MAPS with another solver (e.g. SCIPY_ODIR_SOLVER, the reference)."""
  if entry.solver is None:
    raise ValueError(f"{entry.name} is fitted in closed form: it has no solver to replace")
  return _parametric_map(entry.name, entry.doc, solver, entry.grid, entry.square)


def _one_vs_rest_map(name: str, doc: str, fit_table, apply_table, grid: tuple = ()) -> Map:
  def fit_rows(z, y, weights, num_bins, start):
    del start
    rows = weights > 0
    args = () if num_bins is None else (num_bins,)
    return _closed_form(fit_table(_softmax(np, z[rows]), y[rows], *args))

  def apply_map(params, z, xp, hyper):
    return binning.renormalised_log(apply_table(params, _softmax(xp, z), xp), hyper["floor"], xp)
  return Map(name, doc, fit_rows, apply_map, "num_bins" if grid else None, grid)


MAPS: registry.Registry[Map] = registry.Registry("post-hoc map", "evaluation")
for _map in (
    Map("none", "s = z: the uncalibrated model", lambda *args: _closed_form({}),
        lambda params, z, xp, hyper: parametric.log_softmax(xp, z)),
    _parametric_map("temperature", "s = z / T, T by L-BFGS on NLL (Guo et al. 2017, ICML)",
                    SCALING_SOLVER),
    _parametric_map("vector_scaling", "s = w * z + b, ODIR's diagonal analogue (Guo et al. "
                    "2017)", ODIR_SOLVER, ODIR_GRID),
    _parametric_map("matrix_scaling", "s = W z + b, ODIR (Guo et al. 2017; Kull et al. 2019)",
                    ODIR_SOLVER, SQUARE_ODIR_GRID, square=True),
    _parametric_map("dirichlet", "s = W log p + b, ODIR (Kull et al. 2019, NeurIPS)",
                    ODIR_SOLVER, SQUARE_ODIR_GRID, square=True),
    _parametric_map("ensemble_temperature", "q = w1 softmax(z / T) + w2 softmax(z) + w3 / K "
                    "(Zhang, Kailkhura & Han 2020, ICML)", SCALING_SOLVER),
    _one_vs_rest_map("histogram_binning", "per-class equal-width bins (Zadrozny & Elkan 2001, "
                     "ICML)", binning.fit_histogram, binning.apply_histogram, BINS_GRID),
    _one_vs_rest_map("isotonic", "per-class isotonic regression (Zadrozny & Elkan 2002, KDD)",
                     binning.fit_isotonic, binning.apply_isotonic),
):
  MAPS.register(_map)


def markdown_table() -> str:
  """MAPS as the docs' table (docs/posthoc.md holds it verbatim; a test checks)."""
  lines = ["| method | map | cross-validated setting: grid | solver |", "|---|---|---|---|"]
  for m in MAPS.entries():
    grid = f"`{m.setting}`: {', '.join(f'{v:g}' for v in m.grid)}" if m.setting else "—"
    solver = "closed form" if m.solver is None else m.solver.describe()
    lines.append(f"| `{m.name}` | {m.doc} | {grid} | {solver} |")
  return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# The interface.


def apply(calibrator: Calibrator, logits, xp=np):
  """Calibrated log-probabilities [N, K] of `logits`, finite for finite logits.

  With xp = numpy (the default) in float64. With xp = jax.numpy in the logits' precision
  and jit-able, the calibrator closed over: `jax.jit(lambda z: apply(c, z, jnp))`.
  """
  z = np.asarray(logits, np.float64) if xp is np else xp.asarray(logits)
  return MAPS[calibrator.method].apply(calibrator.params, z, xp, calibrator.hyper)


def _folds(n: int, num_folds: int, seed: int) -> np.ndarray:
  """Fold of each row: a seeded permutation dealt round-robin, so fold sizes differ by <= 1."""
  if not 2 <= num_folds <= n:
    raise ValueError(f"folds={num_folds} must be in [2, {n}] (the number of fit rows)")
  fold = np.empty(n, np.int64)
  fold[np.random.default_rng(seed).permutation(n)] = np.arange(n) % num_folds
  return fold


def _held_out_nll(log_p: np.ndarray, labels: np.ndarray) -> float:
  return float(-np.mean(log_p[np.arange(len(labels)), labels]))


def fit(method: str, logits: np.ndarray, labels: np.ndarray, *, folds: int = DEFAULT_FOLDS,
        seed: int = 0, floor: float = DEFAULT_FLOOR, odir: float | None = None,
        num_bins: int | None = None, search: str = "lbfgs_nll", solver=None) -> Calibrator:
  """Fits a post-hoc map on (validation) logits [N, K] and integer labels [N].

  Args:
    method: a map registered in MAPS.
    logits: the fit split's logits (never the test split's).
    labels: their labels.
    folds: k of the k-fold cross-validation.
    seed: seed of the fold assignment.
    floor: smallest probability of the one-vs-rest maps before renormalising.
    odir: vector_scaling / matrix_scaling / dirichlet regularisation strength; None =
      cross-validated over ODIR_GRID.
    num_bins: histogram_binning bins; None = cross-validated over BINS_GRID.
    search: temperature only: lbfgs_nll, or a grid fit of cpjax.calibration.temperature
      (grid_ece, grid_nll).
    solver: parametric maps only: a solver in place of the map's own (`with_solver`).

  Returns:
    The fitted Calibrator with its cross-validated NLL.
  """
  if method not in MAPS:
    raise ValueError(f"post-hoc method={method!r}; {registry.did_you_mean(method, MAPS.names())}"
                     f"valid choices: {', '.join(MAPS.names())}")  # In the docs' order.
  entry = MAPS[method] if solver is None else with_solver(MAPS[method], solver)
  with one_blas_thread():
    return _fit(entry, logits, labels, folds=folds, seed=seed, floor=floor,
                pinned={"odir": odir, "num_bins": num_bins}, search=search)


def one_blas_thread():
  """A context in which NumPy's BLAS runs one thread (threadpoolctl, process-wide): the fits'
  matrices are small, and OpenBLAS's threads waiting on each other made them ~10x slower on a
  busy 2-core machine. Entered around a whole report too, so that the fits' nested entries,
  from any thread, restore the same limit."""
  # Imported here: the training path imports this module (the config's map names), and only
  # the report fits a map.
  import threadpoolctl  # pylint: disable=g-import-not-at-top
  return threadpoolctl.threadpool_limits(limits=1, user_api="blas")


def _fit(entry: Map, logits, labels, *, folds, seed, floor, pinned, search) -> Calibrator:
  if search not in temperature.METHODS:
    raise ValueError(f"search={search!r}; valid choices: {', '.join(temperature.METHODS)}")
  z = np.asarray(logits, np.float64)
  y = np.asarray(labels, np.int64)
  if z.ndim != 2 or y.shape != (len(z),):
    raise ValueError(f"logits {z.shape} and labels {y.shape} must be [N, K] and [N]")
  if not np.all(np.isfinite(z)):
    raise ValueError("logits must be finite to fit a post-hoc map")
  hyper = {"folds": folds, "seed": seed, "floor": floor}
  if entry.name == "temperature" and search != "lbfgs_nll":
    return _fit_temperature_grid(z, y, search, hyper)
  value = pinned.get(entry.setting)
  candidates = (value,) if value is not None else entry.grid or (None,)
  return _cross_validate(entry, z, y, _folds(len(z), folds, seed), candidates, hyper)


def _held_out_log_probs(entry: Map, params: dict, z: np.ndarray, hyper: dict) -> np.ndarray:
  # The parametric maps are scored by their own log-probabilities, not renormalised again
  # (as their cross-validated NLLs always were: the same numbers to the last bit).
  if entry.solver is not None:
    return parametric.log_probs(np, entry.name, params, z)
  return entry.apply(params, z, np, hyper)


def _cross_validate(entry: Map, z, y, fold, candidates, hyper) -> Calibrator:
  """Every candidate on every fold, then the best candidate on all rows.

  The candidates go from the largest (the strongest regularisation) to the smallest. Each fit
  starts where another ended (a warm start): where the same fold's fit of the previous
  candidate ended. For a map fitted to a tolerance (whose converged fit does not depend on its
  start: its objective is convex), a fold with no such fit (the first candidate) starts where
  the previous fold's fit of the same candidate ended, the refit on all rows at the mean of
  the folds' fits, and a candidate whose fit on one fold stops short of convergence is not
  fitted on the remaining folds (it scores nothing whatever they give). The maps fitted by
  their solver's own tests (temperature, ETS: one candidate) start every fold afresh, as they
  always did.

  A candidate whose held-out NLL summed over the folds fitted so far already exceeds the best
  complete candidate's sum over all folds cannot be chosen (no fold's NLL is negative): its
  remaining folds are not fitted, and it ranks by that partial sum (should the best one's
  refit fail). The weak strengths of the square maps, the costliest fits, are often such.
  """
  order = np.argsort([0.0 if c is None else float(c) for c in candidates])[::-1]
  scored = _score(entry, z, y, fold, candidates, order, hyper)
  return _refit_best(entry, z, y, candidates, scored, hyper)


class _Scored(NamedTuple):
  scores: np.ndarray  # Held-out NLL summed over each candidate's scored folds.
  starts: dict  # Candidate -> the mean of its folds' fits (its refit's start), where chained.
  evaluations: int  # Those of the fits made while scoring.
  unconverged: list  # (candidate's value, its Fit) of each fold fit that stopped short.
  fits: int  # Fold fits made.


def _score(entry: Map, z, y, fold, candidates, order, hyper) -> _Scored:
  """`_cross_validate`'s scores, each candidate's folds in turn."""
  scores, evaluations, unconverged, best = np.zeros(len(candidates)), 0, [], np.inf
  num_folds = int(fold.max()) + 1
  chained = _to_tolerance(entry)
  starts, means, fits = [None] * num_folds, {}, 0
  for c in order:
    previous = None
    for f in range(num_folds):
      held = fold == f
      # A fold's own fit of the previous strength is a better start than another fold's of
      # this one: directions the data hardly determine differ between folds, and Newton's
      # method took twice the steps from there at weak strengths (K = 100).
      start = starts[f] if starts[f] is not None or not chained else previous
      result = entry.fit(z, y, (fold != f).astype(np.float64), candidates[c], start)
      evaluations, fits = evaluations + result.evaluations, fits + 1
      if not result.converged:
        unconverged.append((candidates[c], result))
      usable = _usable(entry, result)
      log_p = _held_out_log_probs(entry, result.params, z[held], hyper) if usable else None
      scores[c] += _held_out_nll(log_p, y[held]) * held.sum() if usable else np.inf
      # A diverged (or, where chained, unconverged) fit is no warm start.
      previous = result.params if usable else None
      starts[f] = previous if previous is not None or not chained else starts[f]
      if (chained and not usable) or scores[c] > best:
        break
      if chained:
        means[c] = _running_mean(means.get(c), result.params, f)
    else:  # Every fold fitted: a complete candidate.
      best = min(best, scores[c])
  return _Scored(scores, means, evaluations, unconverged, fits)


def _running_mean(mean: dict | None, params: dict, count: int) -> dict:
  """The mean of `count` + 1 parameter dicts, from that of the first `count`."""
  if mean is None:
    return dict(params)
  return {k: (mean[k] * count + params[k]) / (count + 1) for k in params}


def _refit_best(entry: Map, z, y, candidates, scored: _Scored, hyper) -> Calibrator:
  """The best candidate refitted on all rows, from the mean of its folds' fits where there is
  one."""
  # The best candidate refitted on all rows; should that fit diverge (or, where the map is
  # fitted to convergence, not converge), the next best, and if every one does, the starting
  # map (cv_nll inf): never non-finite parameters, nor the solver's choice of a divergent map.
  scores, evaluations, failed = scored.scores, scored.evaluations, []
  for best in np.argsort(scores, kind="stable"):
    if _to_tolerance(entry) and not np.isfinite(scores[best]):
      break  # No fold's fit of this strength, or of any after it, converged.
    result = entry.fit(z, y, np.ones(len(z)), candidates[best], scored.starts.get(best))
    evaluations += result.evaluations
    if _usable(entry, result):
      if entry.setting is not None:
        hyper[entry.setting] = candidates[best]
      _warn_unconverged(entry, scored, failed, result, candidates[best])
      at_edge = _at_edge(entry, candidates, candidates[best])
      return Calibrator(entry.name, result.params, hyper, float(scores[best] / len(z)),
                        result.converged, result.grad_norm, at_edge, evaluations)
    failed.append((candidates[best], result))
  _warn_unconverged(entry, scored, failed, None, None)
  return Calibrator(entry.name, parametric.identity_params(entry.name, z.shape[-1]), hyper,
                    float("inf"), False, float("nan"), False, evaluations)


def _setting_text(entry: Map, value) -> str:
  return f"{entry.setting}={value:g}" if entry.setting and value is not None else "its fit"


def _warn_unconverged(entry: Map, scored: _Scored, failed: list,
                      final: parametric.Fit | None, value) -> None:
  """One warning for a map whose fits did not all converge (a line a fit would flood the log:
  on separable rows nearly every fold of every strength stops short): the cross-validation's
  fits that stopped short, with their strengths and the worst one's gradient and message;
  the refits on all rows that failed; and what the map is (its strength, or its starting
  map where none converged). Nothing where every fit converged."""
  final_short = final is not None and not final.converged
  if not scored.unconverged and not failed and not final_short:
    return
  parts = []
  if scored.unconverged:
    values = sorted({v for v, _ in scored.unconverged if v is not None})
    strengths = (f"{entry.setting}={', '.join(f'{v:g}' for v in values)}" if entry.setting
                 else "its fit")
    worst_value, worst = max(scored.unconverged, key=lambda item: item[1].grad_norm)
    parts.append(f"{len(scored.unconverged)} of {scored.fits} cross-validation fits, at "
                 f"{strengths}, stopped short of convergence (largest max |gradient| "
                 f"{worst.grad_norm:.3g}, at {_setting_text(entry, worst_value)}: "
                 f"{worst.message}); those strengths get no cross-validated score (nor are "
                 "their remaining folds fitted)")
  parts += [f"the refit on all rows at {_setting_text(entry, v)} diverged or stopped short "
            f"(max |gradient| {r.grad_norm:.3g}: {r.message})" for v, r in failed]
  if final is None:
    outcome = "no fit converged: the map is its starting map, with no cross-validated NLL"
  else:
    outcome = f"the map is its fit at {_setting_text(entry, value)}" + (
        f", which stopped short too (max |gradient| {final.grad_norm:.3g})"
        if final_short else "")
  logging.warning("%s: %s; %s.", entry.name, "; ".join(parts), outcome)


def _at_edge(entry: Map, candidates: tuple, value) -> bool:
  """Whether the cross-validation chose the grid's last value, or its first unless that is 0
  (no regularisation, the natural bound); logged, since a wider grid might do better."""
  if len(candidates) < 2 or value not in (candidates[0], candidates[-1]):
    return False
  if value == candidates[0] and value == 0:
    return False
  logging.warning("%s: the cross-validation chose %s=%g, the edge of its grid (%s).",
                  entry.name, entry.setting, value, ", ".join(f"{c:g}" for c in candidates))
  return True


def _usable(entry: Map, result: parametric.Fit) -> bool:
  """Finite parameters and, for a map fitted to a tolerance, converged: an unconverged fit's
  held-out NLL is where its solver stopped, no score of the strength."""
  finite = all(np.all(np.isfinite(v)) for v in result.params.values())
  return finite and (result.converged or not _to_tolerance(entry))


def _to_tolerance(entry: Map) -> bool:
  return entry.solver is not None and entry.solver.to_tolerance


def _fit_temperature_grid(z, y, search, hyper) -> Calibrator:
  """A grid fit of cpjax.calibration.temperature, cross-validated like the others."""
  fold = _folds(len(z), hyper["folds"], hyper["seed"])
  total = 0.0
  for f in range(hyper["folds"]):
    held = fold == f
    t = temperature.fit_temperature(z[~held], y[~held], method=search).temperature
    total += _held_out_nll(parametric.log_softmax(np, z[held] / t), y[held]) * held.sum()
  t = temperature.fit_temperature(z, y, method=search).temperature
  return Calibrator("temperature", {"log_t": np.float64(np.log(t))}, {**hyper, "search": search},
                    total / len(z))


def import_scipy_in_background() -> threading.Thread:
  """Starts importing SciPy's optimisers (temperature and ETS's L-BFGS-B, isotonic
  regression's pool-adjacent-violators: about half a second) in a background thread, so
  that the import overlaps the caller's other work; a fit that needs them meanwhile waits
  for it (Python's import lock)."""
  thread = threading.Thread(target=importlib.import_module, args=("scipy.optimize",),
                            name="import-scipy", daemon=True)
  thread.start()
  return thread


def fit_in_background(methods, logits: np.ndarray, labels: np.ndarray,
                      **hyper) -> dict[str, concurrent.futures.Future]:
  """Starts `fit(method, logits, labels, **hyper)` of those of `methods` whose strength is
  cross-validated to a tolerance (vector, matrix and Dirichlet scaling: the costliest fits)
  one after another in a background thread, so that they run while the caller computes
  something else (their solvers' matrix products release the interpreter's lock). The caller
  holds `one_blas_thread()` until the futures are done.

  Returns:
    {method: a future of (its Calibrator, the seconds its fit took)}, for those maps only.
  """
  group = [method for method in methods if MAPS[method].grid and _to_tolerance(MAPS[method])]
  futures = {method: concurrent.futures.Future() for method in group}

  def run() -> None:
    for method in group:
      started = time.perf_counter()
      try:
        calibrator = fit(method, logits, labels, **hyper)
      except BaseException as error:  # pylint: disable=broad-except  (the caller raises it)
        futures[method].set_exception(error)
      else:
        futures[method].set_result((calibrator, time.perf_counter() - started))
  if group:
    threading.Thread(target=run, name="posthoc-fits").start()
  return futures


def fit_all(logits: np.ndarray, labels: np.ndarray, methods=None,
            **hyper) -> dict[str, Calibrator]:
  """Every method of `methods` (None: every registered map) fitted on the same rows and
  folds."""
  return {method: fit(method, logits, labels, **hyper) for method in methods or MAPS.names()}


def choose(calibrators: dict[str, Calibrator], name: str = "auto") -> str:
  """`name`, or for "auto" the calibrator of lowest cross-validated NLL (ties: first)."""
  if name != "auto":
    if name not in calibrators:
      raise ValueError(f"calibrator={name!r} was not fitted; fitted: {', '.join(calibrators)}")
    return name
  return min(calibrators, key=lambda m: calibrators[m].cv_nll)
