"""The ODIR-regularised maps (vector, matrix and Dirichlet scaling) are fitted to convergence.

References written independently of cpjax: the objectives (mean NLL + ODIR, with their own
gradients) in NumPy here, minimised by SciPy's L-BFGS-B to a gradient tolerance of 1e-10; JAX's
forward-over-reverse derivative of the jax.numpy objective for the Hessian-vector product.
Every data set here is generated (labels drawn from a softmax of the logits).
"""

import dataclasses
import logging
import re

import jax
import jax.flatten_util
import numpy as np
import pytest
import scipy.optimize
import scipy.special
import threadpoolctl

from cpjax.calibration import exact_newton, newton, parametric, posthoc, report_files
from cpjax.config import schema

# Every test here fits a map to convergence (seconds compiling and iterating): all `slow`.
pytestmark = pytest.mark.slow


def _generated(seed, n, k, scale=3.0, sharpen=2.0):
  """Generated logits z and labels drawn from softmax(z / sharpen): sharpen > 1 is an
  over-confident model, sharpen = 1 a calibrated one."""
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(n, k)) * scale
  p = scipy.special.softmax(z / sharpen, axis=1)
  return z, np.minimum((rng.uniform(size=(n, 1)) > np.cumsum(p, 1)).sum(1), k - 1)


def _reference_objective(method, z, y, strength):
  """(value, gradient) of mean NLL + ODIR over a flat (w or W, b), written out in NumPy."""
  n, k = z.shape
  x = scipy.special.log_softmax(z, axis=1) if method == "dirichlet" else z
  onehot = np.eye(k)[y]
  off = 1.0 - np.eye(k)

  def value_and_gradient(theta):
    if method == "vector_scaling":
      w, b = theta[:k], theta[k:]
      s = x * w + b
    else:
      w, b = theta[:k * k].reshape(k, k), theta[k * k:]
      s = np.einsum("nj,ij->ni", x, w) + b
    nll = np.mean(scipy.special.logsumexp(s, axis=1) - np.sum(onehot * s, axis=1))
    r = (scipy.special.softmax(s, axis=1) - onehot) / n  # d nll / d s.
    grad_b = r.sum(0) + strength * 2.0 * b / k
    if method == "vector_scaling":
      penalty = np.var(w) + b @ b / k
      grad_w = np.einsum("ni,ni->i", r, x) + strength * 2.0 * (w - w.mean()) / k
    else:
      penalty = np.sum((w * off) ** 2) / (k * (k - 1)) + b @ b / k
      grad_w = (np.einsum("ni,nj->ij", r, x) + strength * 2.0 * w * off / (k * (k - 1))).ravel()
    return nll + strength * penalty, np.concatenate([grad_w, grad_b])
  return value_and_gradient


def _reference_hessian_product(method, z, strength):
  """H v of the objective above for matrix or Dirichlet scaling, written out in NumPy: the
  softmax's Jacobian diag(p) - p p^T applied to the logits' change x dW^T + db."""
  n, k = z.shape
  x = scipy.special.log_softmax(z, axis=1) if method == "dirichlet" else z
  off = 1.0 - np.eye(k)

  def product(theta, v):
    w, b = theta[:k * k].reshape(k, k), theta[k * k:]
    dw, db = v[:k * k].reshape(k, k), v[k * k:]
    p = scipy.special.softmax(x @ w.T + b, axis=1)
    ds = x @ dw.T + db
    dr = (p * ds - p * np.sum(p * ds, axis=1, keepdims=True)) / n  # d r along v.
    return np.concatenate([(dr.T @ x + strength * 2.0 * dw * off / (k * (k - 1))).ravel(),
                           dr.sum(0) + strength * 2.0 * db / k])
  return product


def _reference_fit(method, z, y, strength):
  k = z.shape[1]
  x0 = np.r_[np.ones(k) if method == "vector_scaling" else np.eye(k).ravel(), np.zeros(k)]
  fun = _reference_objective(method, z, y, strength)
  if k >= 100:  # 10,100 parameters: SciPy's trust-region Newton-CG, on the product above.
    return _reference_newton_fit(method, z, strength, x0, fun)
  with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):  # As cpjax's fits run.
    result = scipy.optimize.minimize(fun, x0, jac=True, method="L-BFGS-B",
                                     options={"gtol": 1e-10, "ftol": 0.0, "maxiter": 100000,
                                              "maxfun": 200000})
  # gtol 1e-10 is below what float64 resolves: L-BFGS-B stops on its objective's rounding
  # with max |gradient| ~1e-8; that much is asserted.
  assert np.max(np.abs(fun(result.x)[1])) < 1e-7, result.message
  return result.x, fun


def _reference_newton_fit(method, z, strength, x0, fun):
  """SciPy's trust-region Newton-CG to max |gradient| <= 1e-10 (L-BFGS-B stalls at ~1e-8 on
  Dirichlet's nearly flat direction at K = 100, after about 12 minutes of a 2-core machine;
  this takes about half a minute)."""
  with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
    result = scipy.optimize.minimize(fun, x0, jac=True, method="trust-ncg",
                                     hessp=_reference_hessian_product(method, z, strength),
                                     options={"gtol": 1e-10, "maxiter": 1000})
  assert np.max(np.abs(fun(result.x)[1])) <= 1e-10, result.message
  return result.x, fun


def _flat(params):
  return np.r_[params["w"].ravel(), params["b"]]


def test_the_reference_gradient_is_its_objectives():
  z, y = _generated(0, 40, 3)
  for method in ("vector_scaling", "matrix_scaling", "dirichlet"):
    fun = _reference_objective(method, z, y, 0.7)
    theta = np.random.default_rng(1).normal(size=6 if method == "vector_scaling" else 12)
    assert scipy.optimize.check_grad(lambda t: fun(t)[0], lambda t: fun(t)[1], theta) < 1e-6
    if method != "vector_scaling":  # The product against central differences of the gradient.
      v = np.random.default_rng(2).normal(size=theta.shape)
      h = 1e-5
      differences = (fun(theta + h * v)[1] - fun(theta - h * v)[1]) / (2 * h)
      product = _reference_hessian_product(method, z, 0.7)(theta, v)
      np.testing.assert_allclose(product, differences, rtol=1e-6, atol=1e-9)


CG = posthoc.ODIR_SOLVER.large  # Newton-CG in JAX, float32: the fits with many parameters.
CG_FLOAT64 = dataclasses.replace(CG, dtype="float64")


@pytest.mark.parametrize("method", ["vector_scaling", "matrix_scaling", "dirichlet"])
@pytest.mark.parametrize("strength", [0.1, 100.0])
def test_exact_newton_fits_match_a_converged_scipy_reference_k10(method, strength):
  z, y = _generated(2, 500, 10)
  reference, fun = _reference_fit(method, z, y, strength)
  calibrator = posthoc.fit(method, z, y, odir=strength)  # Pinned: no choice of strength.
  assert posthoc.ODIR_SOLVER.exact(parametric.solver_key(method), 500, 10)
  assert calibrator.converged and calibrator.grad_norm <= posthoc.ODIR_SOLVER.gtol
  ours = _flat(calibrator.params)
  # Both float64 fits of one strictly convex objective (strength > 0 pins the intercept's
  # and the off-diagonal's shifts): the objective to 1e-12, the parameters to 1e-5.
  assert fun(ours)[0] == pytest.approx(fun(reference)[0], abs=1e-12)
  np.testing.assert_allclose(ours, reference, atol=1e-5)
  # And a stationary point of the objective written independently: max |gradient| < 1e-8.
  assert np.max(np.abs(fun(ours)[1])) < 1e-8


@pytest.mark.parametrize("method", ["vector_scaling", "matrix_scaling", "dirichlet"])
@pytest.mark.parametrize("strength", [0.1, 100.0])
def test_float32_newton_cg_fits_match_a_converged_scipy_reference_k10(method, strength):
  z, y = _generated(2, 500, 10)
  reference, fun = _reference_fit(method, z, y, strength)
  calibrator = posthoc.fit(method, z, y, odir=strength, solver=CG)
  # "Converged" means what the tolerance says: the fit's gradient measure (max |g_i| /
  # max(1, H_ii), the one float32 resolves) is within gtol32.
  assert calibrator.converged and calibrator.grad_norm <= CG.gtol32
  ours = _flat(calibrator.params)
  # The float32 fit, its objective measured in float64 by the reference: within 1e-9 of
  # SciPy's float64 optimum (measured: at most 4e-10), its parameters within 1e-4 (2e-5).
  assert fun(ours)[0] == pytest.approx(fun(reference)[0], abs=1e-9)
  np.testing.assert_allclose(ours, reference, atol=1e-4)


@pytest.mark.parametrize("method", ["vector_scaling", "matrix_scaling", "dirichlet"])
@pytest.mark.parametrize("strength", [0.1, 100.0])
def test_float64_newton_cg_fits_match_a_converged_scipy_reference_k10(method, strength):
  z, y = _generated(2, 500, 10)
  reference, fun = _reference_fit(method, z, y, strength)
  with jax.enable_x64(True):
    calibrator = posthoc.fit(method, z, y, odir=strength, solver=CG_FLOAT64)
  assert calibrator.converged and calibrator.grad_norm <= 1e-8
  ours = _flat(calibrator.params)
  assert fun(ours)[0] == pytest.approx(fun(reference)[0], abs=1e-12)
  np.testing.assert_allclose(ours, reference, atol=1e-5)


def test_a_float64_fit_outside_x64_mode_is_refused():
  z, y = _generated(2, 50, 3)
  with pytest.raises(ValueError, match="x64"):
    posthoc.fit("vector_scaling", z, y, odir=1.0, solver=CG_FLOAT64)


@pytest.mark.parametrize("method", ["vector_scaling", "matrix_scaling", "dirichlet"])
def test_a_warm_start_reaches_the_cold_starts_optimum(method):
  # From the identity, and from the fits of much weaker and much stronger strengths (the
  # starts the cross-validation gives it): one convex objective, one optimum.
  z, y = _generated(12, 400, 8)
  weights = np.ones(len(z))
  cold = parametric.fit(method, z, y, weights, 10.0, posthoc.ODIR_SOLVER)
  fun = _reference_objective(method, z, y, 10.0)
  for other in (1e-2, 1e4):
    start = parametric.fit(method, z, y, weights, other, posthoc.ODIR_SOLVER).params
    warm = parametric.fit(method, z, y, weights, 10.0, posthoc.ODIR_SOLVER, start)
    assert cold.converged and warm.converged
    assert fun(_flat(warm.params))[0] == pytest.approx(fun(_flat(cold.params))[0], abs=1e-12)
    np.testing.assert_allclose(_flat(warm.params), _flat(cold.params), atol=1e-6)


def _random_problem(method: str, seed: int, rows: int):
  """Generated logits of 4 classes, 0/1 row weights and random parameters of `method`."""
  rng = np.random.default_rng(seed)
  z, y = _generated(seed, rows, 4)
  weights = (rng.uniform(size=rows) < 0.7).astype(float)
  shape = (4,) if method == "vector_scaling" else (4, 4)
  return rng, z, y, weights, shape, {"w": rng.normal(size=shape), "b": rng.normal(size=4)}


@pytest.mark.parametrize("method", ["vector_scaling", "matrix_scaling"])
def test_the_preconditioners_diagonal_is_the_hessians(method):
  rng, z, y, weights, shape, params = _random_problem(method, 13, 30)
  with jax.enable_x64(True):
    ours = newton.hessian_diagonal(method, params, z, weights, 0.3)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    hessian = jax.hessian(lambda x: parametric.objective(method, unravel(x), z, y, weights, 0.3))
    reference = unravel(np.diag(np.asarray(hessian(flat))))
  for name in params:
    np.testing.assert_allclose(np.asarray(ours[name]), np.asarray(reference[name]), rtol=1e-10,
                               atol=1e-14)


def test_the_cross_validation_reproduces_the_scipy_one():
  # The same cross-validated fit by the float64 SciPy solver (cold and per-fold warm starts,
  # every fold fitted), by exact Newton (float64) and by Newton-CG in JAX (float32), both
  # with warm starts across strengths and folds: the same strength, the same cross-validated
  # NLL to each solver's resolution, the same map.
  z, y = _generated(14, 600, 6)
  reference = posthoc.fit("dirichlet", z, y, solver=posthoc.SCIPY_ODIR_SOLVER)
  for solver, nll_tolerance, param_tolerance in ((posthoc.ODIR_SOLVER, 1e-9, 1e-5),
                                                 (CG, 1e-6, 1e-4)):
    ours = posthoc.fit("dirichlet", z, y, solver=solver)
    assert ours.converged and reference.converged
    assert ours.hyper["odir"] == reference.hyper["odir"]
    assert ours.cv_nll == pytest.approx(reference.cv_nll, abs=nll_tolerance)
    np.testing.assert_allclose(_flat(ours.params), _flat(reference.params), atol=param_tolerance)
    assert ours.evaluations < reference.evaluations


@pytest.mark.slow  # Minutes: SciPy's reference over 10,100 parameters.
@pytest.mark.parametrize("method", ["matrix_scaling", "dirichlet"])
def test_fits_match_a_converged_scipy_reference_k100(method):
  z, y = _generated(3, 400, 100)
  strength = 1e3
  reference, fun = _reference_fit(method, z, y, strength)
  # Dirichlet here has a nearly flat direction (below): float64's gradient tolerance takes
  # more than the default budget of evaluations along it.
  solver = dataclasses.replace(CG_FLOAT64, newton_steps=1000, max_evaluations=100_000)
  with jax.enable_x64(True):
    fit = parametric.fit(method, z, y, np.ones(len(z)), strength, solver)
  assert fit.converged and fit.grad_norm <= 1e-8, fit.message
  float32 = parametric.fit(method, z, y, np.ones(len(z)), strength, posthoc.ODIR_SOLVER)
  assert float32.converged, float32.message
  # Within a few of float32's spacings of the objective (1.2e-7 at 1.3): matrix scaling
  # within 1e-8, Dirichlet (its nearly flat direction) 1.6e-7 above SciPy's optimum.
  assert fun(_flat(float32.params))[0] == pytest.approx(fun(reference)[0], abs=1e-6)
  ours = _flat(fit.params)
  # A stationary point of the independently written objective, at or above SciPy's optimum
  # (found to max |gradient| 1e-10, so no point is below it by more than rounding).
  assert np.max(np.abs(fun(ours)[1])) < 1e-8
  assert fun(ours)[0] >= fun(reference)[0] - 1e-12
  if method == "matrix_scaling":
    assert fun(ours)[0] == pytest.approx(fun(reference)[0], abs=1e-12)
    np.testing.assert_allclose(ours, reference, atol=1e-5)
  else:
    # Dirichlet at K = 100 has a nearly flat direction (the unpenalised diagonal against the
    # log-probabilities' shared shift): a point of max |gradient| 1e-8 may be far along it
    # (this fit: 10 in a weight) and above the optimum by gradient^2 / (2 x its curvature),
    # measured 1.05e-8 here, so the parameters are not compared and the objective is to 2e-8.
    assert fun(ours)[0] == pytest.approx(fun(reference)[0], abs=2e-8)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vector_scaling", "matrix_scaling"])
def test_hessian_vector_product_matches_jax(method):
  rng, z, y, weights, shape, params = _random_problem(method, 4, 60)
  direction = {"w": rng.normal(size=shape), "b": rng.normal(size=4)}
  scores = z * params["w"] + params["b"] if method == "vector_scaling" else (
      z @ params["w"].T + params["b"])
  ours = parametric.hessp(method, scipy.special.softmax(scores, axis=1), direction, z,
                          weights, 0.3)
  with jax.enable_x64(True):
    grad = jax.grad(parametric.objective, argnums=1)
    _, ref = jax.jvp(lambda p: grad(method, p, z, y, weights, 0.3), (params,), (direction,))
  for name in params:
    np.testing.assert_allclose(ours[name], np.asarray(ref[name]), rtol=1e-9, atol=1e-12)


@pytest.mark.slow  # Two fits to convergence per map.
@pytest.mark.parametrize("method", ["vector_scaling", "matrix_scaling", "dirichlet"])
def test_fitted_map_is_stable_under_rounding_level_changes(method):
  z, y = _generated(5, 600, 10)
  test_z, test_y = _generated(6, 2000, 10)
  perturbed = z * (1.0 + 1e-6 * np.random.default_rng(7).standard_normal(z.shape))
  before, after = posthoc.fit(method, z, y), posthoc.fit(method, perturbed, y)
  assert before.converged and after.converged
  assert before.hyper["odir"] == after.hyper["odir"]
  # Inputs moved by 1e-6 relative: a converged map moves by about as much (what it moved by
  # when fits stopped at an iteration cap was up to 1.4 in a weight).
  np.testing.assert_allclose(_flat(after.params), _flat(before.params), atol=1e-4)
  nll = [metrics_nll(posthoc.apply(c, test_z), test_y) for c in (before, after)]
  assert abs(nll[0] - nll[1]) < 1e-6


def metrics_nll(log_p, labels):
  return -np.mean(log_p[np.arange(len(labels)), labels])


@pytest.mark.slow  # A cross-validated fit per map.
@pytest.mark.parametrize("method", ["vector_scaling", "matrix_scaling", "dirichlet"])
def test_test_nll_is_no_worse_than_no_map_on_calibrated_data(method):
  # Generated calibrated logits (labels drawn from softmax(z)): no map can help, and with a
  # strength up to 1e6 in the grid the cross-validation can pin the map near the identity's
  # family; on held-out data it must not cost more than 0.002 of NLL (estimation noise of
  # K = 10 scales on 3,000 rows).
  z, y = _generated(8, 3000, 10, sharpen=1.0)
  test_z, test_y = _generated(9, 20000, 10, sharpen=1.0)
  calibrator = posthoc.fit(method, z, y)
  none = metrics_nll(scipy.special.log_softmax(test_z, axis=1), test_y)
  assert metrics_nll(posthoc.apply(calibrator, test_z), test_y) <= none + 2e-3


def test_separable_rows_are_reported_not_converged(caplog):
  # Generated separable data (the label is the arg-max of large logits): ODIR leaves the
  # diagonal free, so matrix scaling's objective has no minimiser at any strength. Every
  # fit is flagged, the warning names the map, the strength and the gradient, and the map
  # is its starting map, the identity, with no cross-validated NLL to win `auto` with.
  z = np.random.default_rng(10).normal(size=(150, 3)) * 20
  y = z.argmax(1)
  with caplog.at_level(logging.WARNING):
    calibrator = posthoc.fit("matrix_scaling", z, y, folds=3)
  assert not calibrator.converged and calibrator.cv_nll == np.inf
  np.testing.assert_array_equal(calibrator.params["w"], np.eye(3))
  # One line for the map, however many of its fits stopped short: the map, the strengths,
  # the worst gradient and what the map is; a strength that stopped short on its first fold
  # is not fitted on the other two.
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("matrix_scaling")]
  assert len(lines) == 1, lines
  grid = posthoc.MAPS["matrix_scaling"].grid
  stopped, fitted = map(int, re.search(r": (\d+) of (\d+) cross-validation", lines[0]).groups())
  assert stopped == len(grid) and fitted < 3 * len(grid)
  assert f"odir={', '.join(f'{v:g}' for v in grid)}" in lines[0]
  assert "max |gradient|" in lines[0] and lines[0].endswith(
      "no fit converged: the map is its starting map, with no cross-validated NLL.")
  row = {"hyper": {}, "converged": calibrator.converged, "at_edge": calibrator.at_edge}
  assert report_files._fit_flag(row) == "NOT CONVERGED"  # pylint: disable=protected-access


def test_a_strength_at_the_grids_edge_is_flagged(caplog):
  # Generated over-confident data whose best map is a temperature: the strongest ODIR (the
  # diagonal map) wins, at the grid's last value, and the table and the log say so.
  z, y = _generated(11, 2000, 5)
  with caplog.at_level(logging.WARNING):
    calibrator = posthoc.fit("dirichlet", z, y)
  assert calibrator.hyper["odir"] == posthoc.ODIR_GRID[-1] and calibrator.at_edge
  assert any("the edge of its grid" in r.getMessage() for r in caplog.records)
  row = {"converged": calibrator.converged, "at_edge": calibrator.at_edge}
  assert report_files._fit_flag(row) == "grid edge"  # pylint: disable=protected-access
  # A pinned strength is no choice, and no edge.
  assert not posthoc.fit("dirichlet", z, y, odir=posthoc.ODIR_GRID[-1]).at_edge


def test_the_registry_declares_every_map_and_feeds_the_config_and_the_docs():
  assert list(posthoc.MAPS) == list(posthoc.MAPS.names())
  for name, entry in posthoc.MAPS.items():
    assert entry.name == name and callable(entry.fit) and callable(entry.apply) and entry.doc
    assert (entry.setting is None) == (entry.grid == ())
    assert list(entry.grid) == sorted(entry.grid)
  parametric_maps = tuple(name for name, m in posthoc.MAPS.items() if m.parametric)
  assert parametric_maps == ("temperature", "vector_scaling", "matrix_scaling", "dirichlet",
                             "ensemble_temperature")
  check = schema.spine_schema()["evaluation.calibrator"]
  problem = check("platt")
  assert all(name in problem for name in posthoc.MAPS)
  assert check("auto") is None and check("dirichlet") is None
  with open("docs/posthoc.md") as f:
    assert posthoc.markdown_table() in f.read()


@pytest.mark.parametrize("key", ["vector_scaling", "matrix_scaling"])
def test_the_exact_solvers_derivatives_are_jaxs(key):
  """exact_newton's hand-written value, gradient and Hessian (on the fit rows, weights > 0)
  against JAX's value_and_grad and hessian of `parametric.objective`, in float64."""
  rng, z, y, weights, shape, params = _random_problem(key, 21, 50)
  problem = exact_newton.PROBLEMS[key](z, y, weights)
  objective = exact_newton._Objective(problem, 0.3)  # pylint: disable=protected-access
  x = problem.flat(params)
  value, grad, nll, q = objective.value_and_grad(x)
  hessian = objective.hessian(x, q)
  with jax.enable_x64(True):
    def objective(flat, strength=0.3):
      return parametric.objective(key, problem.params(flat), z, y, weights, strength)
    ref_value, ref_grad = jax.value_and_grad(objective)(x)
    ref_hessian = jax.hessian(objective)(x)
    assert nll == pytest.approx(float(objective(x, 0.0)), rel=1e-12)
  assert value == pytest.approx(float(ref_value), rel=1e-12)
  np.testing.assert_allclose(grad, np.asarray(ref_grad), rtol=1e-9, atol=1e-13)
  np.testing.assert_allclose(hessian, np.asarray(ref_hessian), rtol=1e-9, atol=1e-13)
  for name, value in problem.params(x).items():  # The flat order round-trips.
    np.testing.assert_array_equal(value, params[name])


def test_the_exact_solver_hands_costly_hessians_to_newton_cg():
  """A fit whose Hessian would cost more than `max_hessian_work` goes to `large` (Newton-CG
  in JAX), here forced by a limit of 0; the same optimum to float32's resolution."""
  z, y = _generated(22, 300, 5)
  weights = np.ones(len(z))
  calls = []

  class Recording:
    def minimise(self, *args):
      calls.append(args[0])
      return CG.minimise(*args)
  forced = dataclasses.replace(posthoc.ODIR_SOLVER, max_hessian_work=0, large=Recording())
  handed = parametric.fit("matrix_scaling", z, y, weights, 1.0, forced)
  exact = parametric.fit("matrix_scaling", z, y, weights, 1.0, posthoc.ODIR_SOLVER)
  assert calls == ["matrix_scaling"] and handed.converged and exact.converged
  fun = _reference_objective("matrix_scaling", z, y, 1.0)
  assert fun(_flat(handed.params))[0] == pytest.approx(fun(_flat(exact.params))[0], abs=1e-9)
  assert not posthoc.ODIR_SOLVER.exact("matrix_scaling", 5000, 100)  # K = 100: Newton-CG.
  assert posthoc.ODIR_SOLVER.exact("vector_scaling", 5000, 100)


def test_a_map_with_some_fits_short_of_convergence_is_one_warning(monkeypatch, caplog):
  # Every fold fit at ODIR 0.01 (stood in for by a fit marked unconverged) stops short: the
  # cross-validation scores the other strengths and the report finishes with one line
  # naming the map, the strength, the fits that stopped and the strength the map has.
  z, y = _generated(23, 300, 4)
  original = parametric.fit

  def fit(method, logits, labels, weights, strength, *args, **kwargs):
    result = original(method, logits, labels, weights, strength, *args, **kwargs)
    return result._replace(converged=False, message="forced") if strength == 1e-2 else result
  monkeypatch.setattr(parametric, "fit", fit)
  with caplog.at_level(logging.WARNING):
    calibrator = posthoc.fit("dirichlet", z, y, folds=3)
  lines = [r.getMessage() for r in caplog.records if "convergence" in r.getMessage()]
  assert len(lines) == 1 and lines[0].startswith("dirichlet: "), lines
  assert calibrator.converged and calibrator.hyper["odir"] != 1e-2
  assert "at odir=0.01, stopped short of convergence" in lines[0] and "forced" in lines[0]
  assert lines[0].endswith(f"the map is its fit at odir={calibrator.hyper['odir']:g}.")
