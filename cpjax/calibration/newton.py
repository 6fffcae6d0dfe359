"""Newton-CG in JAX for the convex post-hoc maps with many parameters: matrix and Dirichlet
scaling at large K (cpjax.calibration.exact_newton hands it the fits whose Hessian would be
costly to form).

The objective (`parametric.objective`: the weighted mean NLL + ODIR's penalty) is convex in
these maps' parameters. One fit is one jitted call, on the default device (the accelerator
where there is one), in the inputs' precision (float32 unless JAX's x64 mode is on):

  repeat at most `newton_steps` times, at the parameters theta:
    g = grad f(theta); H v by forward-over-reverse differentiation (jax.linearize of grad f);
    the Newton step d: H d = -g by conjugate gradients, preconditioned by H's diagonal
      (ODIR's penalty makes the intercept's and off-diagonal weights' curvature up to 2
      lambda / K, the data's ~1: without it CG crawls), to a relative residual of
      min(0.5, sqrt(|g|)) (Eisenstat & Walker's forcing term: loose far away, tight near)
      or an absolute one of gtol / 10, whichever is larger;
    stop if theta is converged (below);
    a step t d, t = 1, 1/2, 1/4, ...: the first t at which f(theta + t d) meets Armijo's
      sufficient decrease or the slope g(theta + t d) . d is <= 0 (f is convex along the
      line, so a non-positive slope at t means f fell on the whole of [0, t]). Next to the
      optimum float32 cannot resolve f's decrease (f ~ 1, its spacing ~ 1e-7) but can still
      resolve the slope, so the second test lets the iteration reach the gradient float32
      allows. No such t in 30 halvings: the fit has stalled and stops.

Converged: every |g_i| <= gtol * max(1, H_ii) (the gradient, relative to the coordinate's
curvature where that exceeds 1: float32 resolves a coordinate's gradient to about eps *
H_ii * |theta_i|, and ODIR's H_ii reaches 2e4 at lambda = 1e6, K = 100) and the Newton step
d moves no fit row's probability by more than `xtol` to first order (the map is determined,
not drifting along a direction the objective hardly curves in), and the fit has not separated
its rows. Nocedal & Wright, Numerical Optimization (2006), ch. 7.1 (line-search Newton-CG).
"""

import dataclasses
import functools
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpjax.calibration import parametric
from cpjax.runtime import compiler_options

LINE_SEARCH_HALVINGS = 30
ARMIJO = 1e-4  # Sufficient decrease: f(theta + t d) <= f(theta) + ARMIJO t g . d.
# Or the slope at t, g(theta + t d) . d, at most SLOPE_DECREASE |g . d|: on a quadratic along
# the line, f then fell by at least (1 - SLOPE_DECREASE) t |g . d| / 2 (the trapezoid rule).
SLOPE_DECREASE = 0.5
# CG solves (H + DAMPING * max H_ii) d = -g: at strength 0 the maps have exactly flat
# directions (b + c 1, W + 1 v^T are the same map), along which float32's rounding of g
# would otherwise send d far.
DAMPING = 1e-7


@dataclasses.dataclass(frozen=True)
class Solver:
  """Newton-CG in JAX (this module): the most Newton steps, the most CG iterations per step,
  and the convergence tolerances in float32 and in float64 (JAX's x64 mode)."""
  newton_steps: int = 100  # The most Newton steps of one fit.
  cg_steps: int = 500  # The most conjugate-gradient iterations of one Newton step.
  # The most gradient and Hessian-vector evaluations of one fit: where the rows nearly
  # separate (weak strengths, many classes) Newton's steps need ever more CG iterations,
  # and a fit that has not converged within this many scores nothing anyway.
  max_evaluations: int = 2000
  # float32: the gradient's resolution is ~1e-7 * curvature * |parameter| (module docstring),
  # and a probability's ~1e-7.
  gtol32: float = 1e-6  # max |g_i| / max(1, H_ii) at convergence, float32.
  xtol32: float = 1e-5  # The Newton step's largest first-order change of a probability.
  gtol64: float = 1e-8  # The same in float64.
  xtol64: float = 1e-6
  dtype: str = "float32"  # Of the fit: float32, or float64 (needs JAX's x64 mode).

  to_tolerance = True  # A fit is judged converged by the tolerances above.

  def tolerances(self) -> tuple[float, float]:
    """(gtol, xtol) of a fit computed in `self.dtype`."""
    return ((self.gtol64, self.xtol64) if self.dtype == "float64" else
            (self.gtol32, self.xtol32))

  def describe(self) -> str:
    """One line for the docs' table."""
    gtol, xtol = self.tolerances()
    return (f"Newton-CG in JAX ({self.dtype}; {self.newton_steps} steps, {self.max_evaluations} "
            f"evaluations), to max \\|g_i\\| / max(1, H_ii) <= {gtol:g} and a Newton step "
            f"moving no probability by more than {xtol:g}")

  def minimise(self, key, init, inputs, labels, weights, strength) -> parametric.Fit:
    return minimise(key, init, inputs, labels, weights, strength, self)



# ----------------------------------------------------------------------------------------------
# A batch of B fits of one map on the same rows, each with its own row weights, strength and
# start: the flat parameters x [B, P] (ravel_pytree's order: the intercept b, then the
# weights w), the per-fit scalars [B].


def _select(mask, new, old):
  """new where mask [B], else old (any trailing shape)."""
  return jnp.where(mask.reshape(mask.shape + (1,) * (jnp.ndim(new) - 1)), new, old)


def _vdot(a, b):
  return jnp.sum(a * b, axis=1)


class _Batch:
  """`parametric.objective` of each of B fits over their flat parameters, with its gradient,
  Hessian-vector product and Hessian diagonal written out: the mean NLL's gradient in the
  scores is omega_i (q_i - e_{y_i}) per row and its Hessian omega_i (diag(q_i) - q_i q_i^T),
  and the scores are linear in the parameters (J: their Jacobian). Written for a batch rather
  than vmapped, and by hand rather than by automatic differentiation: a smaller program, so it
  traces and compiles in less time; the same numbers up to rounding
  (tests/test_posthoc_convergence.py checks them against JAX's derivatives). The scores and
  everything per row and class are [B, K, N], classes before rows: each matrix product then
  gives its result in the layout the next operation reads, with no transposes."""

  def __init__(self, key: str, inputs, labels, weights, strength):
    self.key, self.inputs = key, inputs  # [N, K]
    self.k = inputs.shape[-1]
    self.columns = inputs.T  # [K, N]
    self.onehot = jnp.arange(self.k)[:, None] == labels[None, :]  # [K, N]
    self.weights = weights  # [B, N]: 0/1 selects a fold's training rows.
    self.omega = (weights / jnp.sum(weights, axis=1, keepdims=True))[:, None, :]  # [B, 1, N]
    self.strength = strength  # [B]
    # The off-diagonal weights masked, not sum(W^2) - sum(diag(W)^2): as `parametric.penalty`.
    self.off = 1.0 - jnp.eye(self.k, dtype=inputs.dtype)
    self.pairs = max(self.k * (self.k - 1), 1)

  def unravel(self, x) -> dict:
    w = x[:, self.k:]
    return {"b": x[:, :self.k],
            "w": w if self.key == "vector_scaling" else w.reshape(-1, self.k, self.k)}

  @staticmethod
  def ravel(tree: dict):
    return jnp.concatenate([tree["b"], tree["w"].reshape(tree["b"].shape[0], -1)], axis=1)

  def scores(self, params: dict):
    """[B, K, N]; linear in the parameters: the scores' change along a direction is the
    direction's scores."""
    if self.key == "vector_scaling":
      return self.columns * params["w"][:, :, None] + params["b"][:, :, None]
    return jnp.einsum("bjk,kn->bjn", params["w"], self.columns) + params["b"][:, :, None]

  def transposed(self, g) -> dict:
    """J^T g for g [B, K, N]."""
    if self.key == "vector_scaling":
      return {"w": jnp.sum(g * self.columns, axis=2), "b": jnp.sum(g, axis=2)}
    return {"w": jnp.einsum("bjn,nk->bjk", g, self.inputs), "b": jnp.sum(g, axis=2)}

  def penalty(self, params: dict):
    w = params["w"]
    if self.key == "vector_scaling":
      spread = jnp.mean((w - jnp.mean(w, axis=1, keepdims=True)) ** 2, axis=1)
    else:
      spread = jnp.sum((w * self.off) ** 2, axis=(1, 2)) / self.pairs
    return spread + jnp.mean(params["b"] ** 2, axis=1)

  def penalty_gradient(self, params: dict):
    """The penalty's gradient at `params`, flat: a quadratic's, so also its Hessian times
    `params`. Vector scaling's is 2 (d - mean d) / K with d = w - mean w: the second mean is
    0 but for rounding, and keeping it keeps the gradient that of the penalty as float32
    computes it (without it, at strength 1e6, the two differed by ~1e-2 and Newton's method
    took twice the steps)."""
    w = params["w"]
    if self.key == "vector_scaling":
      w = 2.0 * (w - jnp.mean(w, axis=1, keepdims=True)) / self.k
      w = w - jnp.mean(w, axis=1, keepdims=True)
    else:
      w = 2.0 * w * self.off / self.pairs
    return self.ravel({"w": w, "b": 2.0 * params["b"] / self.k})

  def log_probs(self, x):
    """[B, K, N]."""
    s = self.scores(self.unravel(x))
    s = s - jnp.max(s, axis=1, keepdims=True)
    return s - jnp.log(jnp.sum(jnp.exp(s), axis=1, keepdims=True))

  def nll(self, log_p):
    """[B]: each fit's weighted mean NLL of log-probabilities [B, K, N]."""
    return -jnp.sum(self.omega * jnp.where(self.onehot, log_p, 0.0), axis=(1, 2))

  def value_and_grad(self, x):
    """[B] values, [B, P] gradients and [B] NLLs (the values without the penalty)."""
    params = self.unravel(x)
    log_p = self.log_probs(x)
    nll = self.nll(log_p)
    g = self.omega * (jnp.exp(log_p) - self.onehot)
    return (nll + self.strength * self.penalty(params),
            (self.ravel(self.transposed(g))
             + self.strength[:, None] * self.penalty_gradient(params)), nll)

  def hvp(self, probs, v):
    """H v at the parameters whose softmax(scores) is `probs` [B, K, N]."""
    direction = self.unravel(v)
    ds = self.scores(direction)
    dg = self.omega * probs * (ds - jnp.sum(probs * ds, axis=1, keepdims=True))
    return (self.ravel(self.transposed(dg))
            + self.strength[:, None] * self.penalty_gradient(direction))

  def hessian_diagonal(self, probs):
    """The NLL's sum_i omega_i q_ik (1 - q_ik) x_ij^2 (x_ij := 1 for the intercept), plus the
    penalty's constant one; flat."""
    curvature = self.omega * probs * (1.0 - probs)  # [B, K, N]
    strength = self.strength[:, None]
    diagonal = {"b": jnp.sum(curvature, axis=2) + strength * 2.0 / self.k}
    if self.key == "vector_scaling":
      diagonal["w"] = (jnp.sum(curvature * self.columns ** 2, axis=2)
                       + strength * 2.0 * (1.0 - 1.0 / self.k) / self.k)
    else:
      diagonal["w"] = (jnp.einsum("bjn,nk->bjk", curvature, self.inputs ** 2)
                       + strength[:, :, None] * 2.0 * self.off / self.pairs)
    return self.ravel(diagonal)

  def block_factors(self, probs, damping):
    """Matrix scaling only: the Cholesky factors [B, K, K + 1, K + 1] of the Hessian's
    diagonal blocks, one a class j over its weights and intercept (W_j., b_j):
    sum_i omega_i q_ij (1 - q_ij) x_i x_i^T (x_i the row's inputs and 1) plus the penalty's
    diagonal and the damping. What the Hessian leaves out (the coupling of two classes,
    -q_ij q_ik) is small where the rows are confident: preconditioned by these blocks, CG took
    7 iterations where the diagonal took 183 (Dirichlet scaling, K = 100, ODIR 0.01)."""
    curvature = self.omega * probs * (1.0 - probs)  # [B, K, N]
    features = jnp.concatenate([self.inputs, jnp.ones_like(self.inputs[:, :1])], axis=1)

    def block(weights):  # [B, N] -> [B, K + 1, K + 1]: one class's data block per fit.
      return jnp.einsum("bn,na,nc->bac", weights, features, features)
    blocks = jnp.moveaxis(jax.lax.map(block, jnp.moveaxis(curvature, 1, 0)), 0, 1)
    strength = self.strength[:, None, None]
    penalty = jnp.concatenate([strength * 2.0 * self.off / self.pairs,
                               jnp.broadcast_to(strength * 2.0 / self.k,
                                                (len(self.strength), self.k, 1))], axis=2)
    index = jnp.arange(self.k + 1)
    blocks = blocks.at[:, :, index, index].add(penalty + damping[:, :, None])
    return jnp.linalg.cholesky(blocks)

  def block_solve(self, factors, r):
    """M^-1 r for the flat r [B, P]: each class's (W_j., b_j) solved with its block."""
    tree = self.unravel(r)
    rows = jnp.concatenate([tree["w"], tree["b"][:, :, None]], axis=2)[..., None]
    solved = jax.scipy.linalg.cho_solve((factors, True), rows)[..., 0]  # [B, K, K + 1]
    return self.ravel({"w": solved[:, :, :-1], "b": solved[:, :, -1]})

  def probability_change(self, probs, step):
    """[B]: max over fit rows of |first-order change of softmax(scores)| along `step`."""
    ds = self.scores(self.unravel(step))
    change = jnp.abs(probs * (ds - jnp.sum(probs * ds, axis=1, keepdims=True)))
    return jnp.max(jnp.where(self.weights[:, None, :] > 0, change, 0.0), axis=(1, 2))


def hessian_diagonal(key: str, params: dict, inputs, weights, strength):
  """The diagonal of one fit's objective's Hessian at `params` (unbatched), as a dict."""
  batch = _Batch(key, jnp.asarray(inputs), jnp.zeros(len(inputs), jnp.int32),
                 jnp.asarray(weights)[None], jnp.asarray(strength)[None])
  x = batch.ravel({n: jnp.asarray(v)[None] for n, v in params.items()})
  probs = jnp.exp(batch.log_probs(x))
  return {n: v[0] for n, v in batch.unravel(batch.hessian_diagonal(probs)).items()}


def _conjugate_gradients(hvp, rhs, precondition, tol, max_steps):
  """Preconditioned CG (`precondition`: r -> M^-1 r) for H x = rhs [B, P] from 0, each fit to
  |residual| <= tol or max_steps [B] iterations. H is positive semi-definite; a direction of
  no curvature ends a fit's iteration. Returns x, each fit's iterations and whether each
  reached the tolerance."""
  def running(carry):
    _, r, _, rz, i, flat = carry
    return (jnp.linalg.norm(r, axis=1) > tol) & (i < max_steps) & ~flat & (rz > 0)

  def body(carry):
    x, r, p, rz, i, _ = carry
    active = running(carry)
    hp = hvp(p)
    curvature = _vdot(p, hp)
    flat = curvature <= 0.0
    alpha = jnp.where(flat, 0.0, rz / jnp.where(flat, 1.0, curvature))[:, None]
    new_r = r - alpha * hp
    z = precondition(new_r)
    rz_new = _vdot(new_r, z)
    new = (x + alpha * p, new_r, z + (rz_new / jnp.where(active, rz, 1.0))[:, None] * p,
           rz_new, i + 1, flat)
    return tuple(_select(active, n, o) for n, o in zip(new, carry))

  z = precondition(rhs)
  none = jnp.zeros(rhs.shape[:1], jnp.int32)
  start = (jnp.zeros_like(rhs), rhs, z, _vdot(rhs, z), none, none > 0)
  x, r, _, _, steps, _ = jax.lax.while_loop(lambda c: jnp.any(running(c)), body, start)
  return x, steps, jnp.linalg.norm(r, axis=1) <= tol


# CG preconditioned by the Hessian's diagonal, at most this many iterations a Newton step; a
# matrix-scaling step that needs more is solved again, and the fit's later steps at once,
# preconditioned by the diagonal blocks (`_Batch.block_factors`), made once a fit (about
# (K + 1) / 2 Hessian-vector products) at that step's point: any positive definite
# preconditioner leaves CG's solution the same, and the blocks of the step where the fit
# needed them kept CG to a few iterations at the later ones.
DIAGONAL_CG_STEPS = 30


def _newton_direction(batch: _Batch, x, grad, gtol, max_steps, blocks, factors):
  """The Newton step d at `x` (H d = -g by preconditioned CG, to the forcing term's
  tolerance, at most `max_steps` [B] iterations: by H's damped diagonal, or, for matrix
  scaling, by the damped diagonal blocks `factors` where `blocks` [B] says the fit has them,
  made here where the diagonal takes over DIAGONAL_CG_STEPS iterations), its evaluations,
  max |g_i| / max(1, H_ii), the largest first-order change of a fit row's probability along
  d (the module docstring's convergence tests), and the fit's blocks and whether it has
  them; per fit."""
  probs = jnp.exp(batch.log_probs(x))
  diagonal = batch.hessian_diagonal(probs)
  damping = DAMPING * jnp.max(diagonal, axis=1, keepdims=True)
  diagonal = diagonal + damping
  norm = jnp.linalg.norm(grad, axis=1)
  # Eisenstat & Walker's forcing term, but no tighter than the gradient tolerance needs.
  tol = jnp.maximum(jnp.minimum(0.5, jnp.sqrt(norm)) * norm, 0.1 * gtol)

  def hvp(v):
    return batch.hvp(probs, v) + damping * v
  inverse = 1.0 / jnp.maximum(diagonal, 1e-30)
  if batch.key != "matrix_scaling":
    step, cg, _ = _conjugate_gradients(hvp, -grad, lambda r: inverse * r, tol, max_steps)
  else:
    step, cg, solved = _conjugate_gradients(
        hvp, -grad, lambda r: inverse * r, tol,
        jnp.where(blocks, 0, jnp.minimum(max_steps, DIAGONAL_CG_STEPS)))
    new = ~blocks & ~solved & (cg < max_steps)  # Fits whose blocks are made here.
    factors, cost = jax.lax.cond(
        jnp.any(new), lambda _: (jnp.where(new[:, None, None, None],
                                           batch.block_factors(probs, damping), factors),
                                 jnp.where(new, (batch.k + 1) // 2, 0).astype(cg.dtype)),
        lambda _: (factors, jnp.zeros_like(cg)), None)
    blocks = blocks | new

    def by_blocks(_):
      blocked, more, _ = _conjugate_gradients(
          hvp, -grad, lambda r: batch.block_solve(factors, r), tol,
          jnp.where(blocks, jnp.maximum(max_steps - cg - cost, 0), 0))
      return (jnp.where(blocks[:, None], blocked, step),
              cg + cost + jnp.where(blocks, more, 0))
    step, cg = jax.lax.cond(jnp.any(blocks), by_blocks, lambda _: (step, cg), None)
  scaled = jnp.max(jnp.abs(grad) / jnp.maximum(1.0, diagonal), axis=1)
  return step, cg, scaled, batch.probability_change(probs, step), blocks, factors


def _line_search(value_and_grad, point, step, skip):
  """Halves each fit's t from 1 until f(x + t step) meets Armijo's decrease or the slope test
  (module docstring), from `point` = (x, its value, gradient and NLL): (the points accepted
  with theirs, halvings, whether each moved). The value and gradient at an accepted point are
  the next Newton step's, not computed again. A fit in `skip` [B] (converged, or finished)
  tries no point."""
  x, value, grad, _ = point
  slope = _vdot(grad, step)

  def rejected(carry):
    _, _, i, accepted = carry
    return ~accepted & (i < LINE_SEARCH_HALVINGS)

  def halve(carry):
    t, _, i, _ = carry
    active = rejected(carry)
    t = jnp.where(i > 0, 0.5 * t, t)
    new_x = x + t[:, None] * step
    new_value, new_grad, new_nll = value_and_grad(new_x)
    accepted = ((new_value <= value + ARMIJO * t * slope)
                | (_vdot(new_grad, step) <= -SLOPE_DECREASE * slope))
    new = (t, (new_x, new_value, new_grad, new_nll), i + jnp.where(accepted, 0, 1), accepted)
    return jax.tree.map(functools.partial(_select, active), new, carry)
  start = (jnp.ones_like(value), point, jnp.zeros(value.shape, jnp.int32), skip)
  _, tried, halvings, accepted = jax.lax.while_loop(lambda c: jnp.any(rejected(c)), halve,
                                                    start)
  moved = accepted & (slope < 0.0) & ~skip
  return (jax.tree.map(functools.partial(_select, moved), tried, point),
          jnp.where(skip, -1, halvings), moved)


def _newton(key, x0, weights, strength, inputs, labels, gtol, xtol, *, newton_steps,
            cg_steps, max_evaluations):
  """B fits (module docstring) from the flat parameters x0 [B, P], with row weights
  weights [B, N] and strengths [B]: Newton steps (`_newton_direction`, `_line_search`) until
  each has converged, stalled or run out of steps or evaluations. A fit that has ended takes
  no more steps, CG iterations or line-search points while the others go on."""
  batch = _Batch(key, inputs, labels, weights, strength)

  def running(carry):
    _, i, evaluations, converged, stalled, _, _, _, _ = carry
    return (i < newton_steps) & ~converged & ~stalled & (evaluations < max_evaluations)

  def body(carry):
    point, i, evaluations, _, _, _, _, blocks, factors = carry
    active = running(carry)
    step, cg, scaled, change, blocks, factors = _newton_direction(
        batch, point[0], point[2], gtol,
        jnp.where(active, jnp.minimum(cg_steps, max_evaluations - evaluations), 0), blocks,
        factors)
    converged = (scaled <= gtol) & (change <= xtol)
    # A converged fit stays where it is.
    point, halvings, moved = _line_search(batch.value_and_grad, point, step,
                                          converged | ~active)
    # Evaluations: the Hessian's diagonal, CG's products, the line search's (value and
    # gradient at each point tried).
    new = (point, i + 1, evaluations + 1 + cg + halvings + 1, converged, ~converged & ~moved,
           scaled, change, blocks, factors)
    return jax.tree.map(functools.partial(_select, active), new, carry)

  point = (x0, *batch.value_and_grad(x0))
  zeros = jnp.zeros(point[1].shape, jnp.int32)
  inf = jnp.full(point[1].shape, jnp.inf, x0.dtype)
  # The diagonal blocks' factors of matrix scaling's fits (identities until a fit makes them).
  width = batch.k + 1 if key == "matrix_scaling" else 1
  factors = jnp.broadcast_to(jnp.eye(width, dtype=x0.dtype),
                             (len(x0), batch.k if key == "matrix_scaling" else 1, width, width))
  (x, _, grad, nll), steps, evaluations, converged, stalled, scaled, change, _, _ = (
      jax.lax.while_loop(lambda c: jnp.any(running(c)), body,
                         (point, zeros, zeros + 1, zeros > 0, zeros > 0, inf, inf,
                          zeros > 0, factors)))
  return (x, steps, evaluations, converged, stalled, scaled, change, nll,
          jnp.max(jnp.abs(grad), axis=1))


_STATIC = ("key", "newton_steps", "cg_steps", "max_evaluations")
_newton_jit = jax.jit(_newton, static_argnames=_STATIC)
_COMPILED: dict[tuple, Any] = {}  # One executable per fit shape and solver, per process.
_COMPILED_LOCK = threading.Lock()  # Fits run in the report's background thread too.


def _executable(key: str, batch: int, rows: int, num_classes: int, solver: Solver):
  """The compiled `_newton` of `batch` fits of `rows` rows and `num_classes` classes: compiled
  once per shape and solver in a process (and loaded from JAX's persistent compilation cache
  where that is on), with the "solver" options of cpjax.runtime.compiler_options (on a CPU,
  YNNPACK's batched products were 12x slower than XLA's own)."""
  dtype = np.dtype(solver.dtype)
  entry = (key, batch, rows, num_classes, dtype.name, solver.newton_steps, solver.cg_steps,
           solver.max_evaluations, jax.default_backend())  # What it compiles.
  with _COMPILED_LOCK:
    if entry not in _COMPILED:
      _COMPILED[entry] = _compile(key, batch, rows, num_classes, dtype, solver)
    return _COMPILED[entry]


def _compile(key, batch, rows, num_classes, dtype, solver: Solver):
  shape = jax.ShapeDtypeStruct
  num_params = num_classes * (2 if key == "vector_scaling" else num_classes + 1)
  lowered = _newton_jit.lower(
      key, shape((batch, num_params), dtype), shape((batch, rows), dtype), shape((batch,), dtype),
      shape((rows, num_classes), dtype), shape((rows,), jnp.int32), shape((), dtype),
      shape((), dtype), newton_steps=solver.newton_steps, cg_steps=solver.cg_steps,
      max_evaluations=solver.max_evaluations)
  return lowered.compile(compiler_options.compiler_options("solver"))


def minimise(key: str, init: dict, inputs: np.ndarray, labels: np.ndarray,
             weights: np.ndarray, strength: float, solver: Solver) -> parametric.Fit:
  """`parametric.objective(key, ...)` (vector or matrix scaling; Dirichlet: matrix scaling of
  log p) minimised from `init` by Newton-CG in JAX, in `solver.dtype`: one jitted call (a
  batch of one fit; the module's objective is written for a batch)."""
  if solver.dtype not in ("float32", "float64"):
    raise ValueError(f"solver dtype={solver.dtype!r}; valid choices: float32, float64")
  if solver.dtype == "float64" and not jax.config.jax_enable_x64:
    raise ValueError("a float64 fit needs JAX's x64 mode (`with jax.enable_x64(True):`)")
  dtype = np.dtype(solver.dtype)
  gtol, xtol = solver.tolerances()
  names = sorted(init)  # ravel_pytree's order: b, then w.
  shapes = [np.shape(init[n]) for n in names]
  x0 = np.concatenate([np.ravel(init[n]) for n in names])[None]
  rows, num_classes = np.shape(inputs)
  executable = _executable(key, 1, rows, num_classes, solver)
  out = jax.device_get(executable(
      jnp.asarray(x0, dtype), jnp.asarray(np.asarray(weights)[None], dtype),
      jnp.asarray([strength], dtype), jnp.asarray(inputs, dtype),
      jnp.asarray(labels, jnp.int32), jnp.asarray(gtol, dtype), jnp.asarray(xtol, dtype)))
  splits = np.cumsum([int(np.prod(shape)) for shape in shapes])[:-1]
  params = {n: part.reshape(shape) for n, part, shape in zip(names, np.split(out[0][0], splits),
                                                             shapes)}
  return _result(solver, params, gtol, xtol, *(v[0] for v in out[1:]))


def _result(solver: Solver, params: dict, gtol, xtol, steps, evaluations, converged, stalled,
            scaled, change, nll, grad_norm) -> parametric.Fit:
  """One fit's outcome as a `parametric.Fit`, its message saying how it ended."""
  scaled, change = float(scaled), float(change)
  message = (f"{int(steps)} Newton steps; max |g_i| / max(1, H_ii) {scaled:.2g}, the Newton "
             f"step left moves a probability by {change:.2g}")
  # The fit's gradient measure is the one its tolerance bounds (max |g| is not: where H_ii
  # exceeds 1, float32 resolves g_i only to ~eps H_ii |theta_i|).
  del grad_norm
  if float(nll) < parametric.SEPARATION_NLL:
    return parametric.Fit(params, False, scaled, int(evaluations), parametric.SEPARATED)
  if not bool(converged):
    reason = ("stalled: no step lowers the objective" if bool(stalled) else
              f"stopped at {solver.newton_steps} Newton steps or {solver.max_evaluations} "
              "evaluations")
    if scaled <= gtol and change > xtol:
      reason = "undetermined: rows nearly separate"
    message = f"{reason}; {message}"
  return parametric.Fit(params, bool(converged), scaled, int(evaluations), message)
