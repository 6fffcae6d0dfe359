"""Newton's method with the exact Hessian, in NumPy float64, for the convex post-hoc maps whose
parameters are few: vector scaling (2 K), and matrix and Dirichlet scaling at small K (K^2 + K).

The objective (`parametric.objective`: the weighted mean NLL + ODIR's penalty) is convex in
these maps' parameters theta, and its Hessian is written out:

  H = sum_i omega_i (diag(q_i) - q_i q_i^T) (x) x_i x_i^T + the penalty's constant Hessian,

with q_i = softmax(scores_i), omega_i the row's weight over their sum and x_i the row's
features (matrix scaling: the row's inputs and 1 for the intercept; vector scaling: class k's
input and 1). On the few thousand rows of a validation split and ~100 parameters it is a few
matrix products, so each Newton step solves H d = -g exactly (H damped by
DAMPING * max H_ii for the directions the map cannot tell apart at strength 0) and the fit
ends in a handful of steps from a warm start:

  repeat at most `newton_steps` times:
    converged if max |g_i| / max(1, H_ii) <= gtol (the gradient, relative to the coordinate's
      curvature where that exceeds 1) and the Newton step moves no fit row's probability by
      more than xtol to first order (the map is determined, not drifting along a direction
      the objective hardly curves in);
    a step t d, t = 1, 1/2, ...: the first t with Armijo's sufficient decrease or a
      non-positive slope g(theta + t d) . d <= -|g . d| / 2 (cpjax.calibration.newton);
      none in 30 halvings: stalled.

A fit whose rows separate (mean NLL below `parametric.SEPARATION_NLL`) has no minimiser and
is flagged. Nocedal & Wright, Numerical Optimization (2006), ch. 3 (line-search Newton).

Larger problems (`Solver.exact`: the Hessian's products would cost more than
`max_hessian_work` multiply-adds, e.g. matrix scaling at K = 100) go to `Solver.large`,
Newton-CG in JAX (cpjax.calibration.newton), which never forms H.
"""

import collections
import dataclasses
import hashlib
import threading
from typing import Any

import numpy as np

from cpjax.calibration import newton, parametric

LINE_SEARCH_HALVINGS = 30
ARMIJO = 1e-4
SLOPE_DECREASE = 0.5
DAMPING = 1e-12  # H + DAMPING * max H_ii: flat directions at strength 0 (b + c 1 is b's map).


@dataclasses.dataclass(frozen=True)
class Solver:
  """Exact Newton (this module) where the Hessian is cheap, else `large`."""
  newton_steps: int = 100
  gtol: float = 1e-8  # max |g_i| / max(1, H_ii) at convergence (float64).
  xtol: float = 1e-6  # The Newton step's largest first-order change of a probability.
  # Multiply-adds of one Hessian (rows x K^2 (K + 1)^2 for matrix scaling, 3 rows x K^2 for
  # vector scaling) up to which a fit is solved here: matrix scaling up to K ~ 20 on 5,000
  # rows, vector scaling up to K ~ 400 on 10,000.
  max_hessian_work: float = 2e9
  large: Any = dataclasses.field(default_factory=newton.Solver)

  to_tolerance = True  # A fit is judged converged by the tolerances above (or `large`'s).

  def describe(self) -> str:
    """One line for the docs' table."""
    large_gtol, large_xtol = self.large.tolerances()
    return (f"Newton, exact Hessian (NumPy, float64), to max \\|g_i\\| / max(1, H_ii) <= "
            f"{self.gtol:g} and a probability step <= {self.xtol:g}; where a Hessian costs over "
            f"{self.max_hessian_work:.0e} multiply-adds, Newton-CG in JAX ({self.large.dtype}) "
            f"to {large_gtol:g} and {large_xtol:g}")

  def exact(self, key: str, rows: int, num_classes: int) -> bool:
    """Whether a fit of `key` on `rows` rows and `num_classes` classes is solved here."""
    return _hessian_work(key, rows, num_classes) <= self.max_hessian_work

  def minimise(self, key, init, inputs, labels, weights, strength) -> parametric.Fit:
    rows = int(np.count_nonzero(weights))
    if not self.exact(key, rows, np.shape(inputs)[-1]):
      return self.large.minimise(key, init, inputs, labels, weights, strength)
    return minimise(key, init, inputs, labels, weights, strength, self)


def _hessian_work(key: str, rows: int, k: int) -> float:
  return rows * (3.0 * k * k if key == "vector_scaling" else float(k * k * (k + 1) ** 2))


# ----------------------------------------------------------------------------------------------
# The two objectives, on the fit's rows (weights > 0): value and gradient, the Hessian, and the
# first-order change of the probabilities along a step, over the parameters as one flat vector
# (`flat`, `params`: to and from the {"b", "w"} dict).


class _Problem:
  """What both maps share: the rows, labels and row weights omega of a fit; the data term's
  value, gradient and Hessian at the last point asked for are kept (a fit of the next
  strength on the same rows starts where this one ended, where they are the same)."""

  def __init__(self, inputs, labels, weights):
    rows = np.asarray(weights) > 0
    self.inputs = np.asarray(inputs, np.float64)[rows]
    self.labels = np.asarray(labels)[rows]
    omega = np.asarray(weights, np.float64)[rows]
    self.omega = omega / omega.sum()
    self.n, self.k = self.inputs.shape
    self.onehot = np.arange(self.k)[None, :] == self.labels[:, None]
    self._kept: dict[str, Any] = {}  # "x" (bytes), "data", "hessian" at that point.
    self._lock = threading.Lock()  # Fits of one problem from two threads keep apart.

  def _kept_at(self, x, name: str, compute):
    with self._lock:
      if self._kept.get("x") != x.tobytes():
        self._kept = {"x": x.tobytes()}
      if name not in self._kept:
        self._kept[name] = compute()
      return self._kept[name]

  def data(self, x):
    """(nll, its gradient, q) at the flat parameters x."""
    def compute():
      log_q, q = self.softmax(self.scores(x))
      nll = -float(self.omega @ log_q[np.arange(self.n), self.labels])
      residual = (q - self.onehot) * self.omega[:, None]  # d nll / d scores.
      return nll, self.transposed(residual), q
    return self._kept_at(x, "data", compute)

  def data_hessian(self, x, q):
    """The data term's Hessian at x (whose softmax(scores) is q)."""
    return self._kept_at(x, "hessian", lambda: self.hessian(q))

  def softmax(self, scores):
    """(log q, q) of scores [N, K]."""
    scores = scores - scores.max(axis=1, keepdims=True)
    log_q = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    return log_q, np.exp(log_q)


  def probability_change(self, q, step) -> float:
    ds = self.scores(step)  # Linear in the parameters.
    return float(np.max(np.abs(q * (ds - np.sum(q * ds, axis=1, keepdims=True)))))


class _Matrix(_Problem):
  """s = W x + b, its parameters flat as theta = [W | b] [K, K + 1] row-major (row j: class
  j's weights, its intercept last); the penalty is ODIR's (`parametric.penalty`):
  sum_{i != j} W_ij^2 / (K (K - 1)) + sum_j b_j^2 / K."""

  def __init__(self, *args):
    super().__init__(*args)
    k = self.k
    # The penalty's Hessian, diagonal: 2 / (K (K - 1)) off W's diagonal, 0 on it, 2 / K on b.
    curvature = np.full((k, k + 1), 2.0 / max(k * (k - 1), 1))
    curvature[np.arange(k), np.arange(k)] = 0.0
    curvature[:, k] = 2.0 / k
    self.penalty_curvature = curvature.ravel()
    self.augmented = np.concatenate([self.inputs, np.ones((self.n, 1))], axis=1)  # [N, K + 1]
    self.scaled = np.sqrt(self.omega)[:, None] * self.augmented
    # Each row's x x^T, [N, (K + 1)^2]: the Hessian's diagonal blocks are products with it.
    self.outer = (self.augmented[:, :, None] * self.augmented[:, None, :]).reshape(self.n, -1)

  def flat(self, params: dict):
    return np.concatenate([params["w"], np.asarray(params["b"])[:, None]], axis=1).ravel()

  def params(self, x) -> dict:
    theta = x.reshape(self.k, self.k + 1)
    return {"b": theta[:, -1].copy(), "w": theta[:, :-1].copy()}

  def scores(self, x):
    return self.augmented @ x.reshape(self.k, self.k + 1).T

  def transposed(self, g):
    return (g.T @ self.augmented).ravel()

  def penalty(self, x):
    return 0.5 * float(self.penalty_curvature @ (x * x))

  def penalty_gradient(self, x):
    return self.penalty_curvature * x

  def hessian(self, q):
    """[P, P]: sum_i omega_i (diag(q_i) (x) x_i x_i^T - (q_i (x) x_i) (q_i (x) x_i)^T), the
    second term one symmetric product V^T V (BLAS's syrk), the first its diagonal blocks."""
    k, n, width = self.k, self.n, self.k + 1
    rows = (q[:, :, None] * self.scaled[:, None, :]).reshape(n, k * width)
    hessian = -(rows.T @ rows)
    own = ((q * self.omega[:, None]).T @ self.outer).reshape(k, width, width)
    blocks = hessian.reshape(k, width, k, width)  # A view: the blocks added in place.
    blocks[np.arange(k), :, np.arange(k), :] += own
    return hessian

  def penalty_hessian(self):
    return np.diag(self.penalty_curvature)


class _Vector(_Problem):
  """s_j = w_j x_j + b_j: parameters [b (K), w (K)]; the penalty is ODIR's diagonal analogue
  (`parametric.penalty`): mean_j (w_j - mean w)^2 + mean_j b_j^2."""

  def flat(self, params: dict):
    return np.concatenate([params["b"], params["w"]]).astype(np.float64)

  def params(self, x) -> dict:
    return {"b": x[:self.k].copy(), "w": x[self.k:].copy()}

  def split(self, x):
    return x[:self.k], x[self.k:]

  def scores(self, x):
    b, w = self.split(x)
    return self.inputs * w + b

  def transposed(self, g):
    return np.concatenate([g.sum(axis=0), (g * self.inputs).sum(axis=0)])

  def penalty(self, x):
    b, w = self.split(x)
    return float(np.mean((w - w.mean()) ** 2) + np.mean(b ** 2))

  def penalty_gradient(self, x):
    b, w = self.split(x)
    return np.concatenate([2.0 * b / self.k, 2.0 * (w - w.mean()) / self.k])

  def hessian(self, q):
    """[2K, 2K]: sum_i omega_i (diag(q_i f_i f_i) - (q_i f_i)(q_i f_i)^T) over the features
    f = (1, x) of (b, w), the second term one symmetric product (BLAS's syrk)."""
    k = self.k
    weighted = q * self.omega[:, None]
    rows = np.sqrt(self.omega)[:, None] * np.concatenate([q, q * self.inputs], axis=1)
    hessian = -(rows.T @ rows)
    own = np.concatenate([weighted.sum(axis=0), (weighted * self.inputs ** 2).sum(axis=0)])
    hessian[np.diag_indices_from(hessian)] += own
    mixed = (weighted * self.inputs).sum(axis=0)  # d2 / db_j dw_j: diag(sum omega q x).
    hessian[np.arange(k), k + np.arange(k)] += mixed
    hessian[k + np.arange(k), np.arange(k)] += mixed
    return hessian

  def penalty_hessian(self):
    """2 / K on b; 2 / K (I - 1 1^T / K) on w (its centring)."""
    k = self.k
    hessian = np.zeros((2 * k, 2 * k))
    hessian[:k, :k] = 2.0 / k * np.eye(k)
    hessian[k:, k:] = 2.0 / k * (np.eye(k) - 1.0 / k)
    return hessian


PROBLEMS = {"vector_scaling": _Vector, "matrix_scaling": _Matrix}
_KEPT_PROBLEMS = 16  # A cross-validation's folds and all rows, of one map at a time, with room.
_problems: collections.OrderedDict = collections.OrderedDict()
_problems_lock = threading.Lock()


def problem_of(key: str, inputs, labels, weights) -> _Problem:
  """The problem of these rows, kept across fits (the cross-validation fits each fold's rows
  at every strength): a few recent ones, found by their content."""
  digest = hashlib.blake2b(digest_size=16)
  for array in (np.asarray(inputs, np.float64), np.asarray(labels), np.asarray(weights)):
    digest.update(np.ascontiguousarray(array).tobytes())
    digest.update(str(array.shape).encode())
  name = (key, digest.hexdigest())
  with _problems_lock:
    if name not in _problems:
      _problems[name] = PROBLEMS[key](inputs, labels, weights)
      if len(_problems) > _KEPT_PROBLEMS:
        _problems.popitem(last=False)
    _problems.move_to_end(name)
    return _problems[name]


class _Objective:
  """A problem at a strength: the data term plus strength times the penalty."""

  def __init__(self, problem: _Problem, strength: float):
    self.problem, self.strength = problem, float(strength)

  def value_and_grad(self, x):
    """(value, gradient, nll, q) at the flat parameters x."""
    nll, grad, q = self.problem.data(x)
    return (nll + self.strength * self.problem.penalty(x),
            grad + self.strength * self.problem.penalty_gradient(x), nll, q)

  def hessian(self, x, q):
    return self.problem.data_hessian(x, q) + self.strength * self.problem.penalty_hessian()


# ----------------------------------------------------------------------------------------------
# The fit.


def _newton_step(hessian, grad):
  """d: (H + DAMPING max H_ii I) d = -g."""
  damped = hessian + DAMPING * max(float(np.max(np.diag(hessian))), 1e-300) * np.eye(len(grad))
  return -np.linalg.solve(damped, grad)


def _line_search(problem, x, value, grad, step):
  """(the accepted point's (x, value, gradient, nll, q), or None where no t is accepted)."""
  slope = float(grad @ step)
  if slope >= 0.0:
    return None
  t = 1.0
  for _ in range(LINE_SEARCH_HALVINGS):
    new_x = x + t * step
    new = problem.value_and_grad(new_x)
    if new[0] <= value + ARMIJO * t * slope or float(new[1] @ step) <= -SLOPE_DECREASE * slope:
      return (new_x, *new)
    t *= 0.5
  return None


def minimise(key: str, init: dict, inputs, labels, weights, strength,
             solver: Solver) -> parametric.Fit:
  """`parametric.objective(key, ...)` (vector or matrix scaling; Dirichlet: matrix scaling of
  log p) minimised from `init` by Newton's method with the exact Hessian (module docstring)."""
  problem = problem_of(key, inputs, labels, weights)
  objective = _Objective(problem, strength)
  x = problem.flat({name: np.asarray(value, np.float64) for name, value in init.items()})
  value, grad, nll, q = objective.value_and_grad(x)
  evaluations, steps, scaled, change = 1, 0, np.inf, np.inf
  converged = stalled = False
  for _ in range(solver.newton_steps):
    hessian = objective.hessian(x, q)
    scaled = float(np.max(np.abs(grad) / np.maximum(1.0, np.diag(hessian))))
    step = _newton_step(hessian, grad)
    change = problem.probability_change(q, step)
    evaluations += 1
    if scaled <= solver.gtol and change <= solver.xtol:
      converged = True
      break
    accepted = _line_search(objective, x, value, grad, step)
    if accepted is None:
      stalled = True
      break
    x, value, grad, nll, q = accepted
    evaluations, steps = evaluations + 1, steps + 1
  return _result(solver, problem.params(x), converged, stalled, scaled, change, nll,
                 evaluations, steps)


def _result(solver: Solver, params, converged, stalled, scaled, change, nll, evaluations,
            steps) -> parametric.Fit:
  """The fit as a `parametric.Fit`: its gradient measure is the one its tolerance bounds."""
  if nll < parametric.SEPARATION_NLL:
    return parametric.Fit(params, False, scaled, evaluations, parametric.SEPARATED)
  message = (f"{steps} Newton steps; max |g_i| / max(1, H_ii) {scaled:.2g}, the Newton step "
             f"left moves a probability by {change:.2g}")
  if not converged:
    reason = ("stalled: no step lowers the objective" if stalled else
              f"stopped at {solver.newton_steps} Newton steps")
    if scaled <= solver.gtol and change > solver.xtol:
      reason = "undetermined: rows nearly separate"
    message = f"{reason}; {message}"
  return parametric.Fit(params, converged, scaled, evaluations, message)
