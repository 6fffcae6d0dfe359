"""The parametric post-hoc maps: their log-probabilities, fitted objective and its solver.

With z the logits, the maps (cpjax.calibration.posthoc describes them) are temperature
scaling s = z / T (Guo et al. 2017, ICML), vector scaling s = w * z + b, matrix scaling
s = W z + b, Dirichlet calibration s = W log softmax(z) + b (Kull et al. 2019, NeurIPS) and
ensemble temperature scaling's mixture (Zhang, Kailkhura & Han 2020, ICML). Each is fitted by
minimising

  sum_i weights_i (-log q_i[y_i]) / sum_i weights_i + strength * penalty,

with q = softmax(s) and, for vector, matrix and Dirichlet scaling, ODIR's penalty (off-diagonal
and intercept regularisation, Kull et al. 2019) or its diagonal analogue. The objective is
convex in each map's parameters but temperature's and ETS's.

The objective is written in jax.numpy (`objective`, jit-able); the fits use its NumPy float64
value, analytic gradient and Hessian-vector product (`value_and_grad`, `hessp`, checked against
JAX's derivatives in the tests), because on the few thousand rows of a validation split a call
costs microseconds in NumPy and far more through a jitted function's dispatch.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Solver:
  """How a map is minimised: SciPy's L-BFGS-B, then, where `gtol` is set and L-BFGS-B has
  not reached it, Newton's method (SciPy's trust-ncg with exact Hessian-vector products) from
  where it stopped. L-BFGS-B's steps are cheap and enough for well-conditioned fits; the
  ill-conditioned ones (ODIR on large logits, many classes) need Newton's steps."""
  lbfgs_steps: int  # The most L-BFGS-B iterations.
  newton_steps: int = 0  # The most trust-ncg iterations after them.
  # Convergence: max |gradient| <= gtol. None: L-BFGS-B's own tests and options (its status).
  gtol: float | None = None
  # And, with gtol, the Newton step left moves no fit row's probability by more than
  # xtol: the map is determined, not drifting along a direction the objective hardly curves
  # in (rows that nearly separate).
  xtol: float = 1e-6  # A probability: see `minimise`.

  @property
  def to_tolerance(self) -> bool:
    """Whether a fit is judged converged by a tolerance (else by L-BFGS-B's own tests)."""
    return self.gtol is not None

  def describe(self) -> str:
    """One line for the docs' table."""
    if self.gtol is None:
      return f"L-BFGS-B ({self.lbfgs_steps} steps), its own tests"
    return (f"L-BFGS-B ({self.lbfgs_steps} steps), then Newton ({self.newton_steps}), to max "
            f"\\|grad\\| <= {self.gtol:g} (SciPy, float64)")

  def minimise(self, key, init, inputs, labels, weights, strength) -> "Fit":
    return minimise(key, init, inputs, labels, weights, strength, self)


class Fit(NamedTuple):
  """One fit's parameters and how it ended."""
  params: dict[str, np.ndarray]
  converged: bool  # The solver's tolerance was reached.
  grad_norm: float  # max |gradient| of the objective at `params`.
  evaluations: int  # Objective + gradient evaluations and Hessian-vector products.
  message: str  # The last solver's message.


# ----------------------------------------------------------------------------------------------
# The maps, written once for NumPy (apply, float64) and jax.numpy (jit-able).


def _constant(xp, x):
  """x without a gradient. The shift by the maximum changes no value, and its gradient
  (a max's) came out NaN in float64 under XLA:CPU's --xla_backend_optimization_level=0."""
  return x if xp is np else jax.lax.stop_gradient(x)


def log_softmax(xp, s):
  s = s - _constant(xp, s.max(axis=-1, keepdims=True))
  return s - xp.log(xp.sum(xp.exp(s), axis=-1, keepdims=True))


def _logsumexp(xp, s, axis):
  m = _constant(xp, s.max(axis=axis, keepdims=True))
  return xp.squeeze(m, axis) + xp.log(xp.sum(xp.exp(s - m), axis=axis))


def log_probs(xp, method: str, params: dict, z):
  """log-probabilities of a parametric map (see the module docstring)."""
  if method == "temperature":
    return log_softmax(xp, z / xp.exp(params["log_t"]))
  if method == "vector_scaling":
    return log_softmax(xp, z * params["w"] + params["b"])
  if method in ("matrix_scaling", "dirichlet"):
    x = z if method == "matrix_scaling" else log_softmax(xp, z)
    return log_softmax(xp, x @ params["w"].T + params["b"])
  if method == "ensemble_temperature":
    return log_probs(xp, "ets_mixture", params, _ets_parts(xp, z, params["log_t"]))
  if method == "ets_mixture":  # z: the three parts' log-probabilities [3, N, K].
    log_w = log_softmax(xp, params["a"])  # [3] on the simplex, in log space.
    return _logsumexp(xp, log_w[:, None, None] + z, 0)
  raise ValueError(f"not a parametric method: {method!r}")


def _ets_parts(xp, z, log_t):
  """ETS's three log-probabilities [3, N, K]: scaled, unscaled, uniform."""
  uniform = xp.zeros_like(z) - xp.log(1.0 * z.shape[-1])
  return xp.stack([log_softmax(xp, z / xp.exp(log_t)), log_softmax(xp, z), uniform], axis=0)


def penalty(method: str, params: dict, num_classes: int):
  """ODIR: mean squared off-diagonal weight plus mean squared intercept (Kull et al. 2019);
  for vector scaling, its analogue for a diagonal map: the mean squared deviation of w from
  its mean (a shared scale, i.e. a temperature, stays free) plus the mean squared intercept."""
  if method == "vector_scaling":
    w = params["w"]
    return jnp.mean((w - jnp.mean(w)) ** 2) + jnp.mean(params["b"] ** 2)
  if method not in ("matrix_scaling", "dirichlet"):
    return 0.0
  # The off-diagonal weights masked, not sum(W^2) - sum(diag(W)^2): that difference of two
  # sums ~K cancels, and in float32 its rounding (~1e-6 K) times lambda / K^2 swamped the
  # objective's decrease near the optimum.
  off = params["w"] * (1.0 - jnp.eye(num_classes, dtype=params["w"].dtype))
  return jnp.sum(off ** 2) / max(num_classes * (num_classes - 1), 1) + jnp.mean(params["b"] ** 2)


def identity_params(method: str, num_classes: int, log_t: float = 0.0) -> dict:
  """Parameters at which the map is the identity (or T = exp(log_t)): where the fits start."""
  k = num_classes
  if method == "temperature":
    return {"log_t": np.float32(np.log(1.5))}  # Guo et al.'s start.
  if method == "vector_scaling":
    return {"w": np.ones(k, np.float32), "b": np.zeros(k, np.float32)}
  if method in ("matrix_scaling", "dirichlet"):
    return {"w": np.eye(k, dtype=np.float32), "b": np.zeros(k, np.float32)}
  return {"log_t": np.float64(log_t), "a": np.zeros(3, np.float32)}  # ETS: equal weights.


# ----------------------------------------------------------------------------------------------
# The objective, its gradient and its Hessian-vector product.


def objective(method: str, params: dict, inputs, labels, weights, strength):
  """The fitted objective in jax.numpy: sum_i weights_i (-log q_i[y_i]) / sum_i weights_i +
  strength * penalty. `method` is "temperature", "vector_scaling", "matrix_scaling" (Dirichlet:
  matrix scaling with inputs log p) or "ets_mixture" (inputs: ETS's three parts [3, N, K])."""
  log_p = log_probs(jnp, method, params, inputs)
  nll = -jnp.sum(weights * jnp.take_along_axis(log_p, labels[:, None], axis=-1)[:, 0])
  return nll / jnp.sum(weights) + strength * penalty(method, params, inputs.shape[-1])


def _scores(method: str, params: dict, inputs: np.ndarray) -> np.ndarray:
  if method == "temperature":
    return inputs * np.exp(-params["log_t"])
  if method == "vector_scaling":
    return inputs * params["w"] + params["b"]
  return inputs @ params["w"].T + params["b"]


def value_and_grad(method: str, params: dict, inputs: np.ndarray, labels: np.ndarray,
                   weights: np.ndarray, strength: float) -> tuple[float, dict]:
  """`objective` and its gradient in NumPy float64, by hand."""
  omega = weights / np.sum(weights)
  rows = np.arange(len(labels))
  k = inputs.shape[-1]
  if method == "ets_mixture":
    log_w = log_softmax(np, params["a"])
    at_label = inputs[:, rows, labels] + log_w[:, None]  # [3, N]
    log_q = _logsumexp(np, at_label, 0)
    responsibility = np.exp(at_label - log_q)  # [3, N], sums to 1 over the parts.
    grad_a = -(responsibility @ omega - np.exp(log_w))
    return float(-omega @ log_q), {"a": grad_a}
  scores = _scores(method, params, inputs)
  log_p = log_softmax(np, scores)
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


def hessp(method: str, probs: np.ndarray, direction: dict, inputs: np.ndarray,
          weights: np.ndarray, strength: float) -> dict:
  """The objective's Hessian times `direction`, for vector and matrix scaling (Dirichlet:
  matrix scaling of log p), at the parameters whose softmax(scores) is `probs` [N, K].

  The mean NLL's Hessian in the scores is, per row, omega_i (diag(q_i) - q_i q_i^T), so with
  ds the scores' change along the direction, H v = J^T [omega * q * (ds - <q, ds>)] + the
  penalty's constant Hessian times v (J: the scores' Jacobian in the parameters)."""
  omega = weights / np.sum(weights)
  k = inputs.shape[-1]
  v, c = direction["w"], direction["b"]
  ds = inputs * v + c if method == "vector_scaling" else inputs @ v.T + c
  dg = omega[:, None] * probs * (ds - np.sum(probs * ds, axis=1, keepdims=True))
  h_b = dg.sum(0) + strength * 2.0 * c / k
  if method == "vector_scaling":
    return {"w": np.sum(dg * inputs, 0) + strength * 2.0 * (v - np.mean(v)) / k, "b": h_b}
  pairs = max(k * (k - 1), 1)
  return {"w": dg.T @ inputs + strength * 2.0 * v * (1.0 - np.eye(k)) / pairs, "b": h_b}


# ----------------------------------------------------------------------------------------------
# The fits.


class _Flat:
  """A parameter dict as one float64 vector (SciPy's view), and back."""

  def __init__(self, init: dict):
    self.names = sorted(init)
    self.shapes = [np.shape(init[n]) for n in self.names]
    self.splits = np.cumsum([int(np.prod(s)) for s in self.shapes])[:-1]
    self.x0 = self.ravel(init)

  def ravel(self, params: dict) -> np.ndarray:
    return np.concatenate([np.ravel(params[n]) for n in self.names]).astype(np.float64)

  def unravel(self, x) -> dict:
    parts = np.split(np.asarray(x, np.float64), self.splits)
    return {n: p.reshape(s) for n, p, s in zip(self.names, parts, self.shapes)}


# Below this mean NLL on its rows a fit has separated them (every label's probability above
# 1 - N * 1e-6). ODIR leaves the diagonal free, so the objective then has no finite minimiser:
# the weights grow until the solver stops, and where that is is the solver's choice, not the
# data's (one digits fold's held-out NLL went from 23 to 9 with the L-BFGS-B budget).
SEPARATION_NLL = 1e-6
SEPARATED = f"separates its rows (mean NLL < {SEPARATION_NLL:g}): no finite minimiser"


def _prob_change(key: str, probs: np.ndarray, step: dict, inputs: np.ndarray) -> float:
  """max |first-order change of softmax(scores)| along `step` over the rows of `inputs`
  (probs: their softmax(scores)). Probabilities, not their logarithms: a class of
  probability e^-300 may move its log by 1e-5 and matter to nothing."""
  ds = _scores(key, step, inputs)  # Linear in the parameters for vector and matrix scaling.
  return float(np.max(np.abs(probs * (ds - np.sum(probs * ds, axis=1, keepdims=True)))))


def _separates(key: str, params: dict, inputs, labels, weights) -> bool:
  nll, _ = value_and_grad(key, params, inputs, labels, weights, 0.0)
  return nll < SEPARATION_NLL


def minimise(key: str, init: dict, inputs: np.ndarray, labels: np.ndarray,
             weights: np.ndarray, strength: float, solver: Solver) -> Fit:
  """`objective(key, ...)` minimised from `init` by `solver`."""
  # Imported here: the training path imports this module, and only the report fits a map.
  import scipy.optimize  # pylint: disable=g-import-not-at-top
  import scipy.sparse.linalg  # pylint: disable=g-import-not-at-top
  flat, count, cache = _Flat(init), [0], {}

  def fun(x):
    count[0] += 1
    value, grad = value_and_grad(key, flat.unravel(x), inputs, labels, weights, strength)
    return value, flat.ravel(grad)

  def hess_vector(x, d):
    count[0] += 1
    if cache.get("x") is None or not np.array_equal(cache["x"], x):  # CG reuses one x.
      cache["x"] = np.array(x)
      cache["probs"] = np.exp(log_softmax(np, _scores(key, flat.unravel(x), inputs)))
    return flat.ravel(hessp(key, cache["probs"], flat.unravel(d), inputs, weights, strength))

  options = {"maxiter": solver.lbfgs_steps}
  if solver.gtol is not None:
    options["gtol"] = solver.gtol
  result = scipy.optimize.minimize(fun, flat.x0, jac=True, method="L-BFGS-B", options=options)
  x, message = result.x, str(result.message)
  grad_norm = float(np.max(np.abs(fun(x)[1])))
  if solver.gtol is None:  # L-BFGS-B's own verdict (its iteration cap, or a failed search).
    return Fit(flat.unravel(x), bool(result.success), grad_norm, count[0], message)
  if _separates(key, flat.unravel(x), inputs, labels, weights):
    return Fit(flat.unravel(x), False, grad_norm, count[0], SEPARATED)
  stalled = False
  if grad_norm > solver.gtol and solver.newton_steps:
    result = scipy.optimize.minimize(fun, x, jac=True, hessp=hess_vector, method="trust-ncg",
                                     options={"maxiter": solver.newton_steps,
                                              "gtol": solver.gtol})
    # trust-ncg tests the gradient's 2-norm (the verdict is the recomputed gradient's), and
    # judges a step by the objective's decrease, which next to the optimum falls below
    # float64's resolution of the objective: it then stops (status 2, "a bad approximation")
    # with a gradient of ~1e-8 that it cannot reduce; the Newton step below judges that.
    x, message, stalled = result.x, str(result.message), result.status == 2
    grad_norm = float(np.max(np.abs(fun(x)[1])))
    if _separates(key, flat.unravel(x), inputs, labels, weights):
      return Fit(flat.unravel(x), False, grad_norm, count[0], SEPARATED)
  # A small gradient on a nearly flat direction is no optimum, and a stalled solver may be
  # next to one or not: the remaining Newton step (by CG, to 1e-3 relative) says how far the
  # fit still is from one, as the largest change it would make to a fit row's probabilities
  # (the parameters themselves can have exactly flat directions: at
  # strength 0, b + c and W + 1 v^T are the same map).
  operator = scipy.sparse.linalg.LinearOperator((len(x), len(x)), lambda d: hess_vector(x, d))
  hess_vector(x, np.zeros_like(x))  # Caches softmax(scores) at x.
  step, info = scipy.sparse.linalg.cg(operator, -fun(x)[1], rtol=1e-3, maxiter=2000)
  rows = weights > 0
  step_norm = (_prob_change(key, cache["probs"][rows], flat.unravel(step), inputs[rows])
               if info == 0 else np.inf)
  message += f"; Newton step left {step_norm:.2g}"
  if step_norm > solver.xtol:
    message = (f"undetermined: the Newton step left moves a probability by {step_norm:.3g} "
               "(rows nearly separate)")
  converged = (grad_norm <= solver.gtol or stalled) and step_norm <= solver.xtol
  return Fit(flat.unravel(x), converged, grad_norm, count[0], message)


def fit(method: str, logits: np.ndarray, labels: np.ndarray, weights: np.ndarray,
        strength: float, solver, start: dict | None = None,
        log_t: float | None = None, temperature_solver: Solver | None = None) -> Fit:
  """One fit of a parametric map: minimises the weighted mean NLL + strength * penalty.

  Args:
    method: temperature, vector_scaling, matrix_scaling, dirichlet or ensemble_temperature.
    logits: [N, K] float64 logits.
    labels: [N] integer labels.
    weights: [N] row weights (0/1 selects a fold's training rows).
    strength: the regularisation strength (vector, matrix and Dirichlet scaling only).
    solver: how to minimise: a `Solver` (SciPy, float64) or any object with its `minimise`
      method (cpjax.calibration.exact_newton.Solver: Newton's method, exact Hessian or CG).
    start: parameters to start from (a warm start); None = the identity map.
    log_t: ensemble_temperature only: a fixed log-temperature; None = fitted by NLL first,
      by `temperature_solver`.
    temperature_solver: that first fit's solver (default: `solver`).

  Returns:
    The fitted parameters (ETS: with its temperature) and how the fit ended.
  """
  k = logits.shape[-1]
  first = None
  if method == "ensemble_temperature" and log_t is None:
    first = fit("temperature", logits, labels, weights, 0.0, temperature_solver or solver)
    log_t = float(first.params["log_t"])
  init = identity_params(method, k, log_t or 0.0)
  init.update({name: v for name, v in (start or {}).items() if name != "log_t"})
  # What does not depend on the moving parameters is computed once: Dirichlet calibration
  # is matrix scaling of log p; ETS with T fixed is a mixture of three fixed predictions.
  key, inputs = method, logits
  if method == "dirichlet":
    key, inputs = "matrix_scaling", log_softmax(np, logits)
  elif method == "ensemble_temperature":
    key, inputs = "ets_mixture", _ets_parts(np, logits, init.pop("log_t"))
  result = solver.minimise(key, init, inputs, labels, weights, strength)
  if method != "ensemble_temperature":
    return result
  params = {**result.params, "log_t": np.float64(log_t)}
  if first is None:
    return result._replace(params=params)
  return Fit(params, result.converged and first.converged, result.grad_norm,
             result.evaluations + first.evaluations, result.message)


def solver_key(method: str) -> str:
  """The objective a fit of `method` minimises: Dirichlet calibration is matrix scaling of the
  log-probabilities."""
  return "matrix_scaling" if method == "dirichlet" else method
