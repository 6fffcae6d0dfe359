"""Post-hoc calibration maps against independent references.

scikit-learn's IsotonicRegression and calibration_curve, and a NumPy np.histogram binning,
for the one-vs-rest maps (netcal's binning classes import torch, pyro and gpytorch at module
level, so netcal cannot join this CPU-only JAX environment),
SciPy's L-BFGS-B run to a gradient tolerance of 1e-10 on the same objectives written out
separately in NumPy (their own value and gradient) for the parametric maps, JAX's derivatives
of the jax.numpy objective for the hand-written gradient and Hessian-vector product, closed
forms for temperature and ensemble temperature scaling. All data here are generated.
"""

import numpy as np
import pytest
import scipy.optimize
import scipy.special
from sklearn.calibration import calibration_curve
from sklearn.isotonic import IsotonicRegression

from cpjax.calibration import binning, metrics, newton, parametric, posthoc


def _data(seed, n=600, k=4, scale=2.0, sharpen=1.6):
  """Logits z and labels drawn from softmax(z / sharpen): an over-confident model."""
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(n, k)) * scale + np.eye(k)[rng.integers(0, k, n)] * 1.5
  p = scipy.special.softmax(z / sharpen, axis=1)
  labels = (rng.uniform(size=(n, 1)) > np.cumsum(p, 1)).sum(1)
  return z, np.minimum(labels, k - 1)


def _renormalised_log(q, floor):
  q = np.clip(q, floor, None)
  return np.log(q / q.sum(1, keepdims=True))


def test_isotonic_matches_sklearn_one_vs_rest():
  z, y = _data(0)
  fit_z, fit_y, new_z = z[:400], y[:400], z[400:] * 1.3
  p_fit, p_new = scipy.special.softmax(fit_z, 1), scipy.special.softmax(new_z, 1)
  p_fit[:40] = p_fit[40:80]  # Ties in the fitted scores (whole rows, so rows still sum to 1).
  reference = np.stack([IsotonicRegression(y_min=0, y_max=1, out_of_bounds="clip").fit(
      p_fit[:, k], fit_y == k).predict(p_new[:, k]) for k in range(4)], axis=1)
  # The same data through the calibrator: its input is softmax(logits), so pass log p.
  calibrator = posthoc.fit("isotonic", np.log(p_fit), fit_y)
  out = posthoc.apply(calibrator, np.log(p_new))
  np.testing.assert_allclose(out, _renormalised_log(reference, posthoc.DEFAULT_FLOOR),
                             atol=1e-10)


def test_pool_adjacent_violators_hand_worked():
  # y = (1, 0, 0, 1) on x = 1..4: the first three pool to 1/3, then 1.
  x, fitted = binning.pool_adjacent_violators(np.array([1.0, 2, 3, 4]), np.array([1.0, 0, 0, 1]))
  np.testing.assert_allclose(fitted, [1 / 3, 1 / 3, 1 / 3, 1.0])
  # Tied x pool first: x = (1, 1, 2) with y = (1, 0, 0) -> 1/2 at x = 1 then violates -> 1/3.
  x, fitted = binning.pool_adjacent_violators(np.array([1.0, 1, 2]), np.array([1.0, 0, 0]))
  np.testing.assert_allclose(x, [1, 2])
  np.testing.assert_allclose(fitted, [1 / 3, 1 / 3])


@pytest.mark.parametrize("num_bins", [5, 15])
def test_histogram_binning_matches_np_histogram(num_bins):
  z, y = _data(1)
  p_fit, p_new = scipy.special.softmax(z[:400], 1), scipy.special.softmax(z[400:] * 0.7, 1)
  edges = np.linspace(0, 1, num_bins + 1)
  reference = np.empty_like(p_new)
  for k in range(4):
    count, _ = np.histogram(p_fit[:, k], edges)
    hits, _ = np.histogram(p_fit[:, k], edges, weights=(y[:400] == k).astype(float))
    value = np.where(count > 0, hits / np.maximum(count, 1), (edges[:-1] + edges[1:]) / 2)
    where = np.digitize(p_new[:, k], edges[1:-1])  # Same [e_m, e_m+1) bins, last closed.
    reference[:, k] = value[where]
  calibrator = posthoc.fit("histogram_binning", z[:400], y[:400], num_bins=num_bins)
  assert calibrator.hyper["num_bins"] == num_bins
  np.testing.assert_allclose(posthoc.apply(calibrator, z[400:] * 0.7),
                             _renormalised_log(reference, posthoc.DEFAULT_FLOOR), atol=1e-12)


@pytest.mark.parametrize("num_bins", [5, 10, 30])
def test_histogram_binning_matches_sklearn_calibration_curve(num_bins):
  # calibration_curve(strategy="uniform") gives, per non-empty equal-width bin, the share of
  # positives (prob_true) and the mean score (prob_pred, which lies inside its bin): the same
  # one-vs-rest table. Its bins are right-closed, ours left-closed: continuous scores never
  # land on an edge, so the two agree here.
  z, y = _data(4, n=500)
  p = scipy.special.softmax(z, 1)
  values = posthoc.fit("histogram_binning", z, y, num_bins=num_bins).params["values"]
  centres = (np.arange(num_bins) + 0.5) / num_bins
  for k in range(4):
    prob_true, prob_pred = calibration_curve(y == k, p[:, k], n_bins=num_bins,
                                             strategy="uniform")
    filled = np.floor(prob_pred * num_bins).astype(int)
    np.testing.assert_allclose(values[k, filled], prob_true, atol=1e-12)
    empty = np.setdiff1d(np.arange(num_bins), filled)
    np.testing.assert_allclose(values[k, empty], centres[empty])  # An empty bin: its centre.


def test_temperature_matches_its_closed_form():
  # Every row has logits (c, 0) and a share f of label 0: NLL is minimal where
  # sigmoid(c / T) = f, so T = c / logit(f).
  c, labels = 3.0, np.array([0] * 7 + [1] * 3)
  z = np.tile([c, 0.0], (10, 1))
  calibrator = posthoc.fit("temperature", z, labels, folds=2)
  assert np.exp(calibrator.params["log_t"]) == pytest.approx(c / np.log(0.7 / 0.3), rel=1e-5)


def test_ensemble_temperature_weights_match_the_closed_form():
  # K = 2, T fixed at 2, two kinds of rows, 20 each: logits (4, 0) with 17 of label 0 and
  # logits (-1, 0) with 7 of label 0. With q_j the mixture's probability of label 0 on rows
  # of kind j, the NLL is minimal where q_j equals the kind's share of label 0 (17/20,
  # 7/20): with sum(w) = 1, a 3 x 3 linear system in the weights.
  t, cs, shares = 2.0, np.array([4.0, -1.0]), np.array([17 / 20, 7 / 20])
  sig = scipy.special.expit
  system = np.array([[sig(cs[0] / t), sig(cs[0]), 0.5], [sig(cs[1] / t), sig(cs[1]), 0.5],
                     [1.0, 1.0, 1.0]])
  expected = np.linalg.solve(system, np.r_[shares, 1.0])
  assert np.all(expected > 0.2)  # An interior optimum: the weights are identified.
  z = np.concatenate([np.tile([cs[0], 0.0], (20, 1)), np.tile([cs[1], 0.0], (20, 1))])
  labels = np.r_[np.zeros(17), np.ones(3), np.zeros(7), np.ones(13)].astype(int)
  params = parametric.fit("ensemble_temperature", z, labels, np.ones(40), 0.0,
                          posthoc.SCALING_SOLVER, log_t=np.log(t)).params
  np.testing.assert_allclose(scipy.special.softmax(params["a"]), expected, atol=2e-3)
  assert params["log_t"] == pytest.approx(np.log(t))
  calibrator = posthoc.Calibrator("ensemble_temperature", params, {}, float("nan"))
  q = np.exp(posthoc.apply(calibrator, z[[0, 20]]))[:, 0]
  np.testing.assert_allclose(q, shares, atol=1e-4)


@pytest.mark.parametrize("method", ["none", "temperature", "ensemble_temperature"])
def test_accuracy_is_unchanged_where_the_method_guarantees_it(method):
  z, y = _data(3)
  calibrator = posthoc.fit(method, z[:300], y[:300])
  out = posthoc.apply(calibrator, z[300:])
  np.testing.assert_array_equal(out.argmax(1), z[300:].argmax(1))


@pytest.mark.parametrize("method", posthoc.MAPS.names())
def test_saturated_logits_give_finite_normalised_log_probabilities(method):
  z, y = _data(4, n=300)
  for fit_z, new_z in ((z, z * 1e4), (z * 1e4, z * 1e4), (z * 1e4, z)):
    calibrator = posthoc.fit(method, fit_z, y, folds=3)
    out = posthoc.apply(calibrator, new_z)
    assert np.all(np.isfinite(out)), (method, calibrator.params)
    np.testing.assert_allclose(np.exp(out).sum(1), 1.0, atol=1e-9)


@pytest.mark.slow  # Cross-validated fits of every map.
def test_cross_validation_picks_the_lowest_held_out_nll():
  z, y = _data(5, n=400)
  calibrator = posthoc.fit("matrix_scaling", z, y, folds=4, seed=3)
  fold = np.empty(400, int)
  fold[np.random.default_rng(3).permutation(400)] = np.arange(400) % 4
  held_out = {}
  for odir in posthoc.ODIR_GRID:  # Cold-started fits: the optimum does not depend on the start.
    total = 0.0
    for f in range(4):
      params = parametric.fit("matrix_scaling", z, y, (fold != f).astype(float), odir,
                              posthoc.ODIR_SOLVER).params
      s = z[fold == f] @ params["w"].T + params["b"]
      total -= scipy.special.log_softmax(s, 1)[np.arange((fold == f).sum()), y[fold == f]].sum()
    held_out[odir] = total / 400
  best = min(held_out, key=held_out.get)
  assert calibrator.hyper["odir"] == best
  assert calibrator.cv_nll == pytest.approx(held_out[best], rel=1e-6)  # Converged fits.


def test_choose_auto_takes_the_lowest_cross_validated_nll_and_names_bad_choices():
  z, y = _data(6)
  calibrators = posthoc.fit_all(z, y, methods=("none", "temperature", "isotonic"))
  nlls = {m: c.cv_nll for m, c in calibrators.items()}
  assert posthoc.choose(calibrators) == min(nlls, key=nlls.get)
  assert nlls["temperature"] < nlls["none"]  # Over-confident data: scaling helps.
  assert posthoc.choose(calibrators, "isotonic") == "isotonic"
  with pytest.raises(ValueError, match="dirichlet.*none, temperature, isotonic"):
    posthoc.choose(calibrators, "dirichlet")
  with pytest.raises(ValueError, match="platt.*valid choices: none, temperature"):
    posthoc.fit("platt", z, y)
  with pytest.raises(ValueError, match="finite"):
    posthoc.fit("temperature", np.full((4, 2), np.inf), np.zeros(4, int))


def test_grid_temperature_is_the_temperature_module_fit():
  z, y = _data(7)
  calibrator = posthoc.fit("temperature", z, y, search="grid_nll")
  t = np.exp(calibrator.params["log_t"])
  assert t == pytest.approx(round(t * 10) / 10)  # A grid point (0.1 steps).
  nll = lambda tt: metrics.nll(z / tt, y)  # noqa: E731
  assert nll(t) <= min(nll(t - 0.1), nll(t + 0.1))


@pytest.mark.parametrize("method", ["temperature", "vector_scaling", "matrix_scaling",
                                    "ets_mixture"])
def test_numpy_gradients_match_jax_grad_of_the_jax_objective(method):
  import jax  # pylint: disable=g-import-not-at-top  (x64 only inside this test)
  rng = np.random.default_rng(8)
  z, y = _data(8, n=50, k=4)
  weights = (rng.uniform(size=50) < 0.7).astype(float)
  params = {"temperature": {"log_t": np.float64(0.3)},
            "vector_scaling": {"w": rng.normal(size=4), "b": rng.normal(size=4)},
            "matrix_scaling": {"w": rng.normal(size=(4, 4)), "b": rng.normal(size=4)},
            "ets_mixture": {"a": rng.normal(size=3)}}[method]
  inputs = (np.stack([scipy.special.log_softmax(z / 1.7, 1), scipy.special.log_softmax(z, 1),
                      np.full_like(z, -np.log(4))]) if method == "ets_mixture" else z)
  value, grad = parametric.value_and_grad(method, params, inputs, y, weights, 0.3)
  with jax.enable_x64(True):  # Jitted: one compile (op by op, every operation compiles alone).
    ref_value, ref_grad = jax.jit(jax.value_and_grad(parametric.objective, argnums=1),
                                  static_argnums=0)(method, params, inputs, y, weights, 0.3)
  assert value == pytest.approx(float(ref_value), rel=1e-12)
  for name in params:
    np.testing.assert_allclose(grad[name], np.asarray(ref_grad[name]), rtol=1e-9, atol=1e-12)


def test_objective_jits_and_matches_the_numpy_value_and_gradient():
  import jax  # pylint: disable=g-import-not-at-top  (x64 only inside this test)
  z, y = _data(9, n=80, k=4)
  params = {"w": np.eye(4) * 0.8, "b": np.full(4, 0.1)}
  weights = np.ones(80)
  value, grad = parametric.value_and_grad("matrix_scaling", params, z, y, weights, 0.5)
  with jax.enable_x64(True):
    jitted = jax.jit(jax.value_and_grad(parametric.objective, argnums=1), static_argnums=0)
    ref_value, ref_grad = jitted("matrix_scaling", params, z, y, weights, 0.5)
  assert value == pytest.approx(float(ref_value), rel=1e-12)
  np.testing.assert_allclose(grad["w"], np.asarray(ref_grad["w"]), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("diverging", ["the best", "every"])
def test_a_diverged_final_fit_never_gives_non_finite_parameters(monkeypatch, diverging):
  z, y = _data(10, n=200, k=3)
  real_fit = parametric.fit
  picked = posthoc.fit("dirichlet", z, y).hyper["odir"]

  def diverged(result, weights, strength):
    final = weights.all()  # The refit on all rows, after the cross-validation.
    if final and (diverging == "every" or strength == picked):
      return result._replace(params={k: np.full_like(v, np.nan)
                                     for k, v in result.params.items()})
    return result

  def fit(method, logits, labels, weights, strength, *args, **kwargs):
    return diverged(real_fit(method, logits, labels, weights, strength, *args, **kwargs),
                    weights, strength)

  monkeypatch.setattr(parametric, "fit", fit)
  calibrator = posthoc.fit("dirichlet", z, y)
  assert all(np.all(np.isfinite(v)) for v in calibrator.params.values())
  if diverging == "every":  # The starting map, the identity, and no claim of a good fit.
    np.testing.assert_array_equal(calibrator.params["w"], np.eye(3))
    assert calibrator.cv_nll == np.inf and not calibrator.converged
    np.testing.assert_allclose(posthoc.apply(calibrator, z), scipy.special.log_softmax(z, 1),
                               atol=1e-12)
  else:  # The next-best strength.
    assert calibrator.hyper["odir"] != picked and np.isfinite(calibrator.cv_nll)


@pytest.mark.parametrize("method", posthoc.MAPS.names())
def test_apply_in_jax_under_jit_matches_the_numpy_apply(method):
  import jax  # pylint: disable=g-import-not-at-top  (x64 only inside this test)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  z, y = _data(11, n=300, k=4)
  calibrator = posthoc.fit(method, z[:200], y[:200], folds=3)
  expected = posthoc.apply(calibrator, z[200:])
  with jax.enable_x64(True):  # Same precision: the two backends give the same numbers.
    out = jax.jit(lambda logits: posthoc.apply(calibrator, logits, jnp))(jnp.asarray(z[200:]))
  np.testing.assert_allclose(np.asarray(out), expected, atol=1e-10)
  # In float32 (the default), saturated logits still give finite, normalised rows.
  saturated = np.float32(1e4) * np.eye(4, dtype=np.float32)[y[200:]]
  out = np.asarray(jax.jit(lambda logits: posthoc.apply(calibrator, logits, jnp))(saturated))
  assert out.dtype == np.float32 and np.all(np.isfinite(out))
  # 1e-3: the suite compiles at XLA:CPU's optimisation level 0 (conftest), whose float32 exp
  # is off by ~1e-4 near 0 (level 3, the default, by ~1e-7).
  np.testing.assert_allclose(np.exp(out).sum(1), 1.0, atol=1e-3)


def test_cross_validation_skips_folds_of_candidates_that_cannot_win(monkeypatch):
  """A strength whose held-out NLL over its first folds already exceeds the best complete
  strength's total is fitted on no more folds; the choice and its cross-validated NLL equal
  those of each strength cross-validated on its own (every fold fitted)."""
  rng = np.random.default_rng(3)
  logits, labels = rng.normal(size=(200, 10)) * 3, rng.integers(0, 10, 200)  # No signal.
  grid = posthoc.MAPS["matrix_scaling"].grid
  alone = {c: posthoc.fit("matrix_scaling", logits, labels, odir=c).cv_nll for c in grid}
  fitted = []
  original = parametric.fit
  monkeypatch.setattr(parametric, "fit", lambda name, z, y, w, strength, *args, **kwargs: (
      fitted.append(strength), original(name, z, y, w, strength, *args, **kwargs))[1])
  calibrator = posthoc.fit("matrix_scaling", logits, labels)
  chosen = min(alone, key=alone.get)
  assert calibrator.hyper["odir"] == chosen
  assert calibrator.cv_nll == pytest.approx(alone[chosen], rel=1e-12)
  folds = {c: fitted[:-1].count(c) for c in grid}  # The last: the refit.
  assert folds[chosen] == posthoc.DEFAULT_FOLDS
  # The weak strengths fit noise in 160 rows with 110 parameters: at least one stops early.
  assert min(folds.values()) < posthoc.DEFAULT_FOLDS, folds
  assert len(fitted) - 1 < len(grid) * posthoc.DEFAULT_FOLDS


@pytest.mark.parametrize("key", ["vector_scaling", "matrix_scaling"])
def test_the_batched_objectives_derivatives_are_jaxs(key):
  """The solver's hand-written value, gradient and Hessian-vector product of a batch of fits
  (each its own row weights and strength) against JAX's derivatives of
  `parametric.objective`, fit by fit."""
  import jax  # pylint: disable=g-import-not-at-top  (x64 only inside this test)
  from jax.flatten_util import ravel_pytree  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(14)
  z, y = _data(14, n=40, k=4)
  shape = (4,) if key == "vector_scaling" else (4, 4)
  params = [{"b": rng.normal(size=4), "w": rng.normal(size=shape)} for _ in range(3)]
  weights = (rng.uniform(size=(3, 40)) < 0.7).astype(float)
  strengths = np.array([0.0, 0.3, 1e3])
  directions = rng.normal(size=(3, 4 + int(np.prod(shape))))
  with jax.enable_x64(True):  # Jitted: one compile each (op by op, every operation compiles).
    def ours(x, v):
      batch = newton._Batch(key, z, y, weights, strengths)  # pylint: disable=protected-access
      return (*batch.value_and_grad(x), batch.hvp(jax.numpy.exp(batch.log_probs(x)), v))
    unravel = ravel_pytree(params[0])[1]

    def objective(flat, w, strength):
      return parametric.objective(key, unravel(flat), z, y, w, strength)

    def reference(flat, direction, w, strength):
      value, grad = jax.value_and_grad(objective)(flat, w, strength)
      hvp = jax.jvp(lambda f: jax.grad(objective)(f, w, strength), (flat,), (direction,))[1]
      return value, objective(flat, w, 0.0), grad, hvp
    x = np.stack([ravel_pytree(p)[0] for p in params])
    values, grads, nlls, hvps = jax.jit(ours)(x, directions)
    reference = jax.jit(reference)
    for b in range(3):
      value, nll, grad, hvp = reference(x[b], directions[b], weights[b], strengths[b])
      assert float(values[b]) == pytest.approx(float(value), rel=1e-12)
      assert float(nlls[b]) == pytest.approx(float(nll), rel=1e-12)
      np.testing.assert_allclose(grads[b], grad, rtol=1e-9, atol=1e-12)
      np.testing.assert_allclose(hvps[b], hvp, rtol=1e-9, atol=1e-12)


def _mixed(seed, n, k=5):
  """Labels drawn from softmax(mu) and logits an over-confident, class-mixing, biased linear
  map of mu: every scaling map has something to fit, at a strength inside its grid."""
  shared = np.random.default_rng(0)
  mix, bias = 2.0 * np.eye(k) + 0.3 * shared.normal(size=(k, k)), shared.normal(size=k)
  rng = np.random.default_rng(seed)
  mu = rng.normal(size=(n, k)) * 1.2 + 3.0 * np.eye(k)[rng.integers(0, k, n)]
  labels = (np.cumsum(scipy.special.softmax(mu, axis=1), 1) > rng.uniform(size=(n, 1))).argmax(1)
  return mu @ mix + bias, labels


@pytest.mark.slow  # Six cross-validated fits.
def test_fits_in_the_background_are_the_fits_made_here():
  """The report starts the cross-validated iterative fits in a background thread: the same
  calibrators, to the last bit, as fitting them here."""
  z, y = _mixed(18, 300)
  futures = posthoc.fit_in_background(posthoc.MAPS.names(), z, y, folds=3, seed=1)
  assert sorted(futures) == ["dirichlet", "matrix_scaling", "vector_scaling"]
  for method, future in futures.items():
    calibrator, seconds = future.result(timeout=600)
    here = posthoc.fit(method, z, y, folds=3, seed=1)
    assert seconds > 0 and calibrator.hyper == here.hyper and calibrator.cv_nll == here.cv_nll
    for name in here.params:
      np.testing.assert_array_equal(calibrator.params[name], here.params[name])
