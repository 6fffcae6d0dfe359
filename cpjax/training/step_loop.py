"""The step loop: an epoch's steps with the jitted train step, their metric sums on device
and the train metrics of every logging window.

`train_steps` runs an epoch's steps: it sums the epoch's metrics on device, writes the train
metrics every `log_every_steps` steps (a logging window's metrics folded in one program,
`_fold_window`), calls the progress report after each step, stops the run on a non-finite
loss (cpjax.training.run.raise_if_bad) and ends after the current step when a preemption is
requested. It does no checkpoint I/O: cpjax.training.train's epoch saves what it returns.
Every function takes values or the config section it uses.
"""

import contextlib
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cpjax import run_state, steps
from cpjax.runtime import anatomy, checkpointing, compile_ahead, periodic, sharding
from cpjax.training.run import raise_if_bad

EPOCH_SUMS = ("loss_sum", "correct", "count", "first_bad_step")  # Summed over an epoch.


def train_steps(train_fn, state: steps.TrainState, batches, learning_rates: list,
                loss_hparams: dict[str, np.float32], done: run_state.Done, *, first_step: int,
                epoch: int, log_every: int, window_steps: int, writer, progress,
                checkpointer: checkpointing.Checkpointer, compile_step: int = -1):
  """Trains the epoch's steps done.steps.. over `batches`, from global step `first_step`
  (the epoch's first) on; `learning_rates[i]`: step i's. The step at index `compile_step` is
  the process's first: its compile is timed and logged. `progress` is called after every
  step (it reports where due: cpjax.runtime.metric_writers.ProgressReport), then
  `checkpointer.reached_preemption` says whether to stop. Each logging window's metrics are
  folded in one program over `window_steps` steps (`window_steps()`).

  Returns:
    (state, totals: the epoch's sums on device, outputs: per-example outputs stacked per
    logging window on device, steps: the epoch's steps trained, stopped: a preemption was
    requested). A non-finite loss raises NonFiniteLossError at the logging point after its
    window's (or at the loop's end).
  """
  totals = None if done.totals is None else jax.device_put(done.totals)
  outputs, window, i, stopped = [], [], done.steps - 1, False
  # A logging point logs the previous point's window, whose copy to the host it started then:
  # it never waits for the device to finish the steps just dispatched (a wait would drain the
  # device's queue at every point). The same records, one window later in wall time.
  pending = None
  for i, batch in enumerate(batches, start=done.steps):
    step_fn = _first_step(train_fn) if i == compile_step else train_fn
    state, batch_metrics, per_example = step_fn(state, batch, learning_rates[i], loss_hparams)
    window.append((batch_metrics, per_example))  # Summed at a logging point or the end.
    if periodic.due_step(i + 1, log_every):
      totals, stacked, window_outputs = _fold(totals, window, window_steps)
      outputs.append(window_outputs)
      with host_point():
        _log_train_window(writer, pending)
        pending = (_copy_to_host_async(stacked), first_step + i + 1, learning_rates[i],
                   (epoch, first_step, checkpointer))
      window = []
    progress(first_step + i + 1)  # Its first call starts the steps/s clock, after the compile.
    if checkpointer.reached_preemption(first_step + i + 1):
      stopped = True
      break
  with host_point():
    _log_train_window(writer, pending)
  if window:  # The steps after the last logging point.
    totals, _, window_outputs = _fold(totals, window, window_steps)
    outputs.append(window_outputs)
  return state, totals, outputs, i + 1, stopped


def _copy_to_host_async(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`tree`, its copy to the host started (read later without a wait on the transfer)."""
  for leaf in jax.tree.leaves(tree):
    leaf.copy_to_host_async()
  return tree


def _first_step(train_fn):
  """`train_fn` as the process's first step runs it (its program compiled ahead, or now where
  that failed): waited for once, to time it."""
  def step(*args):
    took = anatomy.Stopwatch()
    state, batch_metrics, per_example = train_fn(*args)
    jax.block_until_ready(batch_metrics)
    logging.info("The first step took %.1f s.", took.seconds)
    return state, batch_metrics, per_example
  return step


def step_guard(level: str) -> contextlib.AbstractContextManager:
  """JAX's transfer guard on device-to-host copies at `level`, around the step loop. It fires
  on accelerators only: a CPU device's buffers are host memory, read without a copy."""
  return jax.transfer_guard_device_to_host(level)


def host_point() -> contextlib.AbstractContextManager:
  """Where the step loop may copy device values to the host (logging, a checkpoint)."""
  return jax.transfer_guard_device_to_host("allow")


# How an epoch combines its steps' metrics: summed, but the first non-finite step and the
# smallest loss are minima and the largest gradient norm and loss maxima. Not clu.metrics
# (Average / Accuracy .merge): the same float32 additions, but the sums are checkpointed
# mid-epoch as plain arrays (run_state's "partial") and first_bad_step is a min, which
# clu.metrics has no metric for; a Collection would wrap three additions.
_COMBINE = {"first_bad_step": jnp.minimum, "loss_min": jnp.minimum,
            "grad_norm_max": jnp.maximum, "loss_max": jnp.maximum}


def window_steps(log_every: int, epoch_steps: tuple[int, ...]) -> int:
  """The steps a logging window's fold is padded to: `log_every`, or the run's longest epoch
  where that is shorter (a window never spans two epochs), so that a large `log_every` does
  not build a fold over steps no epoch has."""
  return max(1, min(log_every, max(epoch_steps, default=1)))


def compile_windows_ahead(train_step: Any, length: int) -> None:
  """Compiles `_fold_window` for the outputs of the compiled `train_step` (both its programs:
  an epoch's first window and the later ones), windows padded to `length` steps."""
  _, metrics, per_example = compile_ahead.out_abstract(train_step)
  window = [(metrics, per_example)] * length
  first = _fold_window.lower(None, window, np.int32(0)).compile()
  totals = compile_ahead.out_abstract(first)[0]
  _fold_window.lower(totals, window, np.int32(0)).compile()


def _fold(totals: dict[str, jax.Array] | None,
          window: list[tuple[dict[str, jax.Array], dict[str, jax.Array]]], length: int):
  """`_fold_window` of `window` padded to `length` steps (repeats of its last, not folded),
  so that every window of a run, an epoch's shorter last one included whatever the epoch's
  size, is one compiled program. Returns (totals, stacked metrics, (per-example outputs
  stacked, the real steps among them))."""
  real = len(window)
  padded = window + [window[-1]] * (length - real)
  totals, stacked, window_outputs = _fold_window(totals, padded, np.int32(real))
  return totals, stacked, (window_outputs, real)


@jax.jit
def _fold_window(totals: dict[str, jax.Array] | None,
                 window: list[tuple[dict[str, jax.Array], dict[str, jax.Array]]],
                 real: jax.Array):
  """A window of steps in one dispatch (none a step): `totals` (None: nothing yet) plus the
  epoch sums of each of its first `real` steps, in order (the rest is padding); the steps'
  metrics stacked for the log and their per-example outputs stacked for the epoch's end
  ([steps, ...] each, padding included). The steps are folded one after another in a scan
  (the same additions, in the same order, as a Python loop would make), so the program's
  size does not grow with the window's length."""
  stack = lambda *v: jnp.stack(v)  # noqa: E731
  metrics = jax.tree.map(stack, *[m for m, _ in window])
  mean_loss = metrics["loss_sum"] / metrics["count"]
  sums = {**{k: metrics[k] for k in EPOCH_SUMS}, "loss_min": mean_loss,
          "grad_norm_max": metrics["grad_norm"], "loss_max": mean_loss}
  first = 0
  if totals is None:  # The first step, always real.
    totals, first = {k: v[0] for k, v in sums.items()}, 1

  def add(carry, j):
    return {k: jnp.where(j < real, _COMBINE.get(k, jnp.add)(v, sums[k][j]), v)
            for k, v in carry.items()}, None

  totals, _ = jax.lax.scan(add, totals, jnp.arange(first, len(window)))
  return totals, metrics, jax.tree.map(stack, *[o for _, o in window])


def host_outputs(outputs: list[dict[str, jax.Array]],
                 earlier: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
  """The per-example outputs of an epoch's steps (`earlier`: those of the steps trained
  before a preemption), flattened in training order, on the host: one transfer a window."""
  if not outputs:
    return dict(earlier)
  real = [steps for _, steps in outputs]
  gathered = {k: [np.asarray(v)[:n].reshape(-1)
                  for v, n in zip(sharding.to_host([o[k] for o, _ in outputs]), real)]
              for k in outputs[0][0]}
  return {k: np.concatenate(([earlier[k]] if earlier else []) + v) for k, v in gathered.items()}


def _log_train_window(writer, pending: tuple | None) -> None:
  """Writes a logging window's train metrics, `pending` = (its stacked metrics, the global
  step it ends at, its learning rate, where), as flax and big_vision log them, and stops the
  run if one of its losses was not finite (`where`: the epoch, its first global step and the
  checkpointer, for `raise_if_bad`'s message). None: nothing to log yet."""
  if pending is None:
    return
  stacked, step, learning_rate, where = pending
  stacked = jax.device_get(stacked)  # [steps] per metric: one transfer each.
  raise_if_bad({"first_bad_step": np.min(stacked["first_bad_step"])}, *where)
  count = _sum(stacked["count"])
  scalars = {
      "train/loss": _sum(stacked["loss_sum"]) / count,
      "train/accuracy": _sum(stacked["correct"]) / count,
      "train/learning_rate": float(learning_rate),
      "train/grad_norm": float(np.mean(stacked["grad_norm"])),
      "train/param_norm": float(stacked["param_norm"][-1]),
  }
  # A step's own metrics (FL_gamma's meta_loss and gamma_sum), by their names' rule.
  for name in sorted(stacked.keys() - _STEP_METRICS):
    if name.endswith("_sum"):  # A sum over the batch's examples: their mean.
      scalars[f"train/{name.removesuffix('_sum')}_mean"] = _sum(stacked[name]) / count
    else:  # A number per step: the window's mean.
      scalars[f"train/{name}"] = float(np.mean(stacked[name]))
  writer.write_scalars(step, scalars)


# The batch metrics every train step returns (steps.train_step); a step may add its own,
# which `_log_train_window` logs by their names' rule.
_STEP_METRICS = frozenset({*EPOCH_SUMS, "grad_norm", "param_norm"})


def _sum(values: np.ndarray) -> float:
  """The sum of float32 values as Python floats, in order (as the window's log always was)."""
  return sum(float(v) for v in values)
