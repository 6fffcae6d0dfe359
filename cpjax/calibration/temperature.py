"""Post-hoc temperature scaling: fit one T > 0 on validation logits
(docs/methods.md#temperature-scaling).

Scaled logits z / T keep the accuracy and change the confidence (Guo et al.
2017). Three fits:

  grid_ece   T in {0.1, 0.2, ..., 10.0} minimising validation ECE (15 bins,
             right-closed); the focal-loss paper's choice and the default.
  grid_nll   the same grid minimising validation NLL (focal-loss code).
  lbfgs_nll  L-BFGS on NLL from T = 1.5 (Guo et al.'s code), over log T so T
             stays positive.

Grid ties go to the smallest T (the reference updates only on strict
improvement); the grid is k / 10 exactly, not a float running sum. A fit that
raises validation NLL is flagged in the result and logged, never silently
applied as if it helped.
"""

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cpjax.calibration import metrics

METHODS = ("grid_ece", "grid_nll", "lbfgs_nll")
GRID = np.arange(1, 101) / 10.0


class TemperatureFit(NamedTuple):
  temperature: float
  method: str
  nll_before: float  # Validation NLL at T = 1.
  nll_after: float  # Validation NLL at the fitted T.
  ece_before: float
  ece_after: float

  @property
  def nll_rose(self) -> bool:
    return self.nll_after > self.nll_before


_GRID_VALUES = 1 << 22  # Logits scaled at once by the grid search ([temperatures, N, K]).


def grid_values(logits: np.ndarray, labels: np.ndarray, objective: str,
                num_bins: int = 15) -> np.ndarray:
  """[len(GRID)]: validation ECE ("ece", `num_bins` bins) or NLL ("nll") of logits / T for each
  T of GRID. Blocks of temperatures at once, each value the same number, bit for bit, as
  `metrics.ece(metrics.softmax(logits / T), ...)` or `metrics.nll(logits / T, labels)` (the same
  operations, row by row; `metrics.ece_of_rows` bins each temperature's confidences as
  `metrics.ece` bins them)."""
  block = max(1, _GRID_VALUES // max(np.size(logits), 1))
  rows = np.arange(len(labels))
  values = []
  for first in range(0, len(GRID), block):
    temperatures = GRID[first:first + block]
    log_p = metrics.log_softmax(logits[None] / temperatures[:, None, None])  # [T, N, K]
    if objective == "nll":
      # Contiguous rows: each mean then sums in the order of a 1-D mean (pairwise).
      values.append(-np.mean(np.ascontiguousarray(log_p[:, rows, labels]), axis=1))
    else:
      confidence, correct = metrics.top_label(np.exp(log_p), labels)
      values.append(metrics.ece_of_rows(confidence, correct, metrics.equal_width_edges(num_bins)))
  return np.concatenate(values)


def _grid_search(logits: np.ndarray, labels: np.ndarray, objective: str, num_bins: int) -> float:
  values = grid_values(logits, labels, objective, num_bins)
  return float(GRID[int(np.argmin(values))])  # argmin returns the first (smallest T) tie.


def _lbfgs_nll(logits: np.ndarray, labels: np.ndarray, init: float = 1.5,
               max_steps: int = 50) -> float:
  logits32, labels32 = jnp.asarray(logits, jnp.float32), jnp.asarray(labels)

  def loss(log_t):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits32 / jnp.exp(log_t), labels32).mean()

  solver = optax.lbfgs()
  value_and_grad = optax.value_and_grad_from_state(loss)

  @jax.jit
  def step(carry, _):
    log_t, state = carry
    value, grad = value_and_grad(log_t, state=state)
    updates, state = solver.update(grad, state, log_t, value=value, grad=grad, value_fn=loss)
    return (optax.apply_updates(log_t, updates), state), None

  log_t = jnp.log(jnp.float32(init))
  (log_t, _), _ = jax.lax.scan(step, (log_t, solver.init(log_t)), None, length=max_steps)
  return float(jnp.exp(log_t))


def fit_temperature(logits: np.ndarray, labels: np.ndarray, method: str = "grid_ece",
                    num_bins: int = 15) -> TemperatureFit:
  """Fits T on (validation) logits [N, K] and integer labels [N].

  Args:
    logits: eval-mode logits of the validation split.
    labels: their labels.
    method: one of METHODS.
    num_bins: ECE bins of the grid_ece objective and the reported ECE.

  Returns:
    The fitted temperature with validation NLL and ECE before and after.
  """
  if method not in METHODS:
    raise ValueError(f"temperature method={method!r}; valid choices: {', '.join(METHODS)}")
  logits = np.asarray(logits, np.float64)

  def ece_of(z, y):
    return metrics.ece(metrics.softmax(z), y, num_bins)

  if method == "grid_ece":
    temperature = _grid_search(logits, labels, "ece", num_bins)
  elif method == "grid_nll":
    temperature = _grid_search(logits, labels, "nll", num_bins)
  else:
    temperature = _lbfgs_nll(logits, labels)
  fit = TemperatureFit(temperature, method, metrics.nll(logits, labels),
                       metrics.nll(logits / temperature, labels), ece_of(logits, labels),
                       ece_of(logits / temperature, labels))
  if fit.nll_rose:
    logging.warning("Temperature scaling (%s) chose T=%.3f, which RAISES validation NLL "
                    "from %.4f to %.4f; its ECE goes %.4f -> %.4f.", method, temperature,
                    fit.nll_before, fit.nll_after, fit.ece_before, fit.ece_after)
  return fit
