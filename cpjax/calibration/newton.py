"""Newton's method in JAX for the convex post-hoc maps: vector, matrix and Dirichlet scaling.

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

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np

from cpjax.calibration import parametric

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


def _scores(key: str, params: dict, inputs):
  if key == "vector_scaling":
    return inputs * params["w"] + params["b"]
  return inputs @ params["w"].T + params["b"]


def hessian_diagonal(key: str, params: dict, inputs, weights, strength):
  """The diagonal of the objective's Hessian: the NLL's, sum_i omega_i q_ik (1 - q_ik) x_ij^2
  (x_ij := 1 for the intercept), plus the penalty's constant one."""
  k = inputs.shape[-1]
  omega = weights / jnp.sum(weights)
  probs = jax.nn.softmax(_scores(key, params, inputs), axis=-1)
  curvature = omega[:, None] * probs * (1.0 - probs)  # [N, K]
  diag_b = jnp.sum(curvature, 0) + strength * 2.0 / k
  if key == "vector_scaling":
    return {"w": jnp.sum(curvature * inputs ** 2, 0) + strength * 2.0 * (1.0 - 1.0 / k) / k,
            "b": diag_b}
  off = 1.0 - jnp.eye(k, dtype=inputs.dtype)
  return {"w": curvature.T @ inputs ** 2 + strength * 2.0 * off / max(k * (k - 1), 1),
          "b": diag_b}


def _probability_change(key: str, params: dict, step: dict, inputs, weights):
  """max over fit rows of |first-order change of softmax(scores)| along `step` (the scores
  are linear in the parameters: their change is the scores of `step`)."""
  probs = jax.nn.softmax(_scores(key, params, inputs), axis=-1)
  ds = _scores(key, step, inputs)
  change = jnp.abs(probs * (ds - jnp.sum(probs * ds, axis=1, keepdims=True)))
  return jnp.max(jnp.where(weights[:, None] > 0, change, 0.0))


def _conjugate_gradients(hvp, rhs, precondition, tol, max_steps):
  """Preconditioned CG for H x = rhs from 0, to |residual| <= tol or max_steps. H is
  positive semi-definite; a direction of no curvature ends the iteration."""
  def body(carry):
    x, r, p, rz, i, _ = carry
    hp = hvp(p)
    curvature = jnp.vdot(p, hp)
    flat = curvature <= 0.0
    alpha = jnp.where(flat, 0.0, rz / jnp.where(flat, 1.0, curvature))
    x, r = x + alpha * p, r - alpha * hp
    z = precondition(r)
    rz_new = jnp.vdot(r, z)
    return x, r, z + rz_new / rz * p, rz_new, i + 1, flat

  def running(carry):
    _, r, _, rz, i, flat = carry
    return (jnp.linalg.norm(r) > tol) & (i < max_steps) & ~flat & (rz > 0)

  z = precondition(rhs)
  start = (jnp.zeros_like(rhs), rhs, z, jnp.vdot(rhs, z), 0, False)
  x, _, _, _, steps, _ = jax.lax.while_loop(running, body, start)
  return x, steps


def _newton_direction(objective, key: str, unravel, x, grad, inputs, weights, strength, gtol,
                      cg_steps: int, budget):
  """The Newton step d at `x` (H d = -g by CG preconditioned by H's damped diagonal, to the
  forcing term's tolerance, at most min(`cg_steps`, `budget`) iterations), its CG iterations,
  max |g_i| / max(1, H_ii) and the largest first-order change of a fit row's probability
  along d (the module docstring's convergence tests)."""
  _, exact_hvp = jax.linearize(jax.grad(objective), x)
  diagonal, _ = ravel_pytree(hessian_diagonal(key, unravel(x), inputs, weights, strength))
  damping = DAMPING * jnp.max(diagonal)
  diagonal = diagonal + damping

  def hvp(v):
    return exact_hvp(v) + damping * v
  norm = jnp.linalg.norm(grad)
  inverse_diagonal = 1.0 / jnp.maximum(diagonal, 1e-30)
  # Eisenstat & Walker's forcing term, but no tighter than the gradient tolerance needs.
  tol = jnp.maximum(jnp.minimum(0.5, jnp.sqrt(norm)) * norm, 0.1 * gtol)
  step, cg = _conjugate_gradients(hvp, -grad, lambda r: inverse_diagonal * r, tol,
                                  jnp.minimum(cg_steps, budget))
  scaled = jnp.max(jnp.abs(grad) / jnp.maximum(1.0, diagonal))
  change = _probability_change(key, unravel(x), unravel(step), inputs, weights)
  return step, cg, scaled, change


def _line_search(value_and_grad, x, value, grad, step):
  """Halves t from 1 until f(x + t step) meets Armijo's decrease or the slope test (module
  docstring): (the point accepted, its value and gradient, halvings, whether it moved). The
  value and gradient at the accepted point are the next Newton step's, not computed again."""
  slope = jnp.vdot(grad, step)

  def rejected(carry):
    _, _, _, i, accepted = carry
    return ~accepted & (i < LINE_SEARCH_HALVINGS)

  def halve(carry):
    t, _, _, i, _ = carry
    t = jnp.where(i > 0, 0.5 * t, t)
    new_x = x + t * step
    new_value, new_grad = value_and_grad(new_x)
    accepted = ((new_value <= value + ARMIJO * t * slope)
                | (jnp.vdot(new_grad, step) <= -SLOPE_DECREASE * slope))
    return t, new_x, (new_value, new_grad), i + jnp.where(accepted, 0, 1), accepted
  _, new_x, (new_value, new_grad), halvings, accepted = jax.lax.while_loop(
      rejected, halve, (jnp.ones((), x.dtype), x, (value, grad), 0, False))
  moved = accepted & (slope < 0.0)
  return (jnp.where(moved, new_x, x), jnp.where(moved, new_value, value),
          jnp.where(moved, new_grad, grad), halvings, moved)


@functools.partial(jax.jit, static_argnames=("key", "newton_steps", "cg_steps", "max_evaluations"))
def _newton(key, x0, inputs, labels, weights, strength, gtol, xtol, *, newton_steps,
            cg_steps, max_evaluations):
  """The jitted fit (module docstring) from the flat parameters x0: Newton steps
  (`_newton_direction`, `_line_search`) until converged, stalled or out of steps or
  evaluations."""
  _, unravel = ravel_pytree(parametric.identity_params(key, inputs.shape[-1]))
  unravel = functools.partial(_unravel_as, unravel, x0.dtype)

  def objective(x):
    return parametric.objective(key, unravel(x), inputs, labels, weights, strength)
  value_and_grad = jax.value_and_grad(objective)

  def body(carry):
    x, value, grad, i, evaluations, _, _, _, _ = carry
    step, cg, scaled, change = _newton_direction(objective, key, unravel, x, grad, inputs,
                                                 weights, strength, gtol, cg_steps,
                                                 max_evaluations - evaluations)
    converged = (scaled <= gtol) & (change <= xtol)
    x, value, grad, halvings, moved = jax.lax.cond(  # A converged fit stays where it is.
        converged, lambda: (x, value, grad, -1, False),
        lambda: _line_search(value_and_grad, x, value, grad, step))
    # Evaluations: the Hessian's diagonal, CG's products, the line search's (value and
    # gradient at each point tried).
    return (x, value, grad, i + 1, evaluations + 1 + cg + halvings + 1, converged,
            ~converged & ~moved, scaled, change)

  def running(carry):
    _, _, _, i, evaluations, converged, stalled, _, _ = carry
    return (i < newton_steps) & ~converged & ~stalled & (evaluations < max_evaluations)

  inf = jnp.asarray(jnp.inf, x0.dtype)
  value, grad = value_and_grad(x0)
  x, _, grad, steps, evaluations, converged, stalled, scaled, change = jax.lax.while_loop(
      running, body, (x0, value, grad, 0, 1, False, False, inf, inf))
  nll = parametric.objective(key, unravel(x), inputs, labels, weights, 0.0)
  return x, steps, evaluations, converged, stalled, scaled, change, nll, jnp.max(jnp.abs(grad))


def _unravel_as(unravel, dtype, x):
  return jax.tree.map(lambda v: v.astype(dtype), unravel(x))


def minimise(key: str, init: dict, inputs: np.ndarray, labels: np.ndarray,
             weights: np.ndarray, strength: float, solver: Solver) -> parametric.Fit:
  """`parametric.objective(key, ...)` (vector or matrix scaling; Dirichlet: matrix scaling of
  log p) minimised from `init` by Newton-CG in JAX, in `solver.dtype`."""
  if solver.dtype not in ("float32", "float64"):
    raise ValueError(f"solver dtype={solver.dtype!r}; valid choices: float32, float64")
  if solver.dtype == "float64" and not jax.config.jax_enable_x64:
    raise ValueError("a float64 fit needs JAX's x64 mode (`with jax.enable_x64(True):`)")
  dtype = np.dtype(solver.dtype)
  gtol, xtol = solver.tolerances()
  x0, unravel = ravel_pytree({n: jnp.asarray(v, dtype) for n, v in init.items()})
  x, steps, evaluations, converged, stalled, scaled, change, nll, grad_norm = _newton(
      key, x0, jnp.asarray(inputs, dtype), jnp.asarray(labels, jnp.int32),
      jnp.asarray(weights, dtype), jnp.asarray(strength, dtype), jnp.asarray(gtol, dtype),
      jnp.asarray(xtol, dtype), newton_steps=solver.newton_steps, cg_steps=solver.cg_steps,
      max_evaluations=solver.max_evaluations)
  params = {n: np.asarray(v) for n, v in unravel(x).items()}
  scaled, change, grad_norm = float(scaled), float(change), float(grad_norm)
  message = (f"{int(steps)} Newton steps; max |g_i| / max(1, H_ii) {scaled:.2g}, the Newton "
             f"step left moves a probability by {change:.2g}")
  if float(nll) < parametric.SEPARATION_NLL:
    return parametric.Fit(params, False, grad_norm, int(evaluations), parametric.SEPARATED)
  if not bool(converged):
    reason = ("stalled: no step lowers the objective" if bool(stalled) else
              f"stopped at {solver.newton_steps} Newton steps or {solver.max_evaluations} "
              "evaluations")
    if scaled <= gtol and change > xtol:
      reason = "undetermined: rows nearly separate"
    message = f"{reason}; {message}"
  return parametric.Fit(params, bool(converged), grad_norm, int(evaluations), message)
