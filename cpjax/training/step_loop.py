"""What one epoch of cpjax.training.train uses below it: the step loop, its metric sums and
train-window logs, the non-finite and stalled stops, the epoch's learning rates, and the
checkpoint save and the preemption stop.

`train_steps` runs an epoch's steps with the jitted train step: it sums the epoch's metrics on
device, writes the train metrics every `log_every_steps` steps, stops the run on a non-finite
loss, and ends after the current step when a preemption is requested. It does no checkpoint
I/O: cpjax.training.train's epoch saves what it returns (`save_checkpoint`: the one save) and stops
(`stop_preempted`: the one preemption stop). `run_state.partial_tree` turns the steps of an
epoch stopped mid-way into a checkpoint's "partial" subtree, and
`run_state.partial_from_checkpoint` back into the steps already trained (`Done`), so the rerun
finishes the epoch bit for bit. Every function takes values or the config section it uses.
"""

import contextlib
import logging
import time
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from cpjax import optim, run_state, steps
from cpjax.calibration import losses
from cpjax.runtime import checkpointing, compile_ahead, periodic, preemption, sharding
from cpjax.training.run import NonFiniteLossError, last_good

EPOCH_SUMS = ("loss_sum", "correct", "count", "first_bad_step")  # Summed over an epoch.
# An epoch's steps trained before a preemption (run_state.partial_from_checkpoint): none.
NOTHING_DONE = run_state.NOTHING_DONE


class StalledTrainingError(RuntimeError):
  """A whole epoch trained with a gradient exactly zero or a loss exactly constant."""


class InputWait:
  """Iterates `batches`, adding up in `seconds` the time each `next` blocked: how long the
  step loop waited on its input. With asynchronous dispatch the loop runs ahead of the
  device until the device's queue is full, so a loop fed faster than the device trains
  waits little here and a loop starved by its reader waits about as long as the device
  idles. The first batch's wait (a reader starting up) is counted too."""

  def __init__(self, batches):
    self._batches, self.seconds = batches, 0.0

  def __iter__(self):
    batches = iter(self._batches)
    while True:
      start = time.perf_counter()
      try:
        batch = next(batches)
      except StopIteration:
        return
      finally:
        self.seconds += time.perf_counter() - start
      yield batch


def train_steps(train_fn, state: steps.TrainState, batches, learning_rates: list,
                loss_hparams: dict[str, np.float32], done: dict[str, Any], *, first_step: int,
                epoch: int, log_every: int, window_steps: int, writer, progress,
                checkpointer: checkpointing.Checkpointer, last_step: int,
                compile_step: int = -1):
  """Trains the epoch's steps done.steps.. over `batches`, from global step `first_step`
  (the epoch's first) on; `learning_rates[i]`: step i's. The step at index `compile_step` is
  the process's first: its compile is timed and logged. `progress` is called there, at
  every multiple of `log_every` and at the run's `last_step` (where clu's report acts).
  After each step, `checkpointer.reached_preemption` says whether to stop. Each logging
  window's metrics are folded in one program over `window_steps` steps (`window_steps()`).

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
    if i == compile_step:
      state, batch_metrics, per_example = _first_step(train_fn, state, batch, learning_rates[i],
                                                      loss_hparams)
      progress(first_step + i + 1)  # Starts the steps/s clock after the compile.
    else:
      state, batch_metrics, per_example = train_fn(state, batch, learning_rates[i],
                                                   loss_hparams)
    window.append((batch_metrics, per_example))  # Summed at a logging point or the end.
    if (i + 1) % log_every == 0:
      totals, stacked, window_outputs = _fold(totals, window, window_steps)
      outputs.append(window_outputs)
      with host_point():
        _log_train_window(writer, pending)
        pending = (_copy_to_host_async(stacked), first_step + i + 1, learning_rates[i],
                   (epoch, first_step, checkpointer))
      window = []
    if (periodic.due_step(first_step + i + 1, log_every, last_step)
        and i != compile_step):
      progress(first_step + i + 1)  # Steps/s and ETA, at the steps where it reports only.
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


def _first_step(train_fn, state, batch, learning_rate, loss_hparams):
  """The process's first step (its program compiled ahead, or now where that failed); waits
  for it once, to time it."""
  compile_start = time.perf_counter()
  state, batch_metrics, per_example = train_fn(state, batch, learning_rate, loss_hparams)
  jax.block_until_ready(batch_metrics)
  logging.info("The first step took %.1f s.", time.perf_counter() - compile_start)
  return state, batch_metrics, per_example


def step_guard(level: str) -> contextlib.AbstractContextManager:
  """JAX's transfer guard on device-to-host copies at `level`, around the step loop. It fires
  on accelerators only: a CPU device's buffers are host memory, read without a copy."""
  return jax.transfer_guard_device_to_host(level)


def host_point() -> contextlib.AbstractContextManager:
  """Where the step loop may copy device values to the host (logging, a checkpoint)."""
  return jax.transfer_guard_device_to_host("allow")


def save_checkpoint(checkpointer: checkpointing.Checkpointer, mesh: jax.sharding.Mesh,
                    meta: dict[str, Any], state: steps.TrainState, selection_state: Any,
                    partial: dict[str, np.ndarray], epochs_done: int, epoch_step: int = 0) -> int:
  """Saves a checkpoint named by the global step; returns that step. `epochs_done` complete
  epochs and `epoch_step` steps of the next (their sums and outputs in `partial`); `meta`:
  the run's own metadata (its config, a folder dataset's digests)."""
  step = int(jax.device_get(state.step))
  if not np.isfinite(float(jax.device_get(_global_norm(state.params)))):
    raise NonFiniteLossError(f"non-finite parameters at global step {step} (epoch "
                             f"{epochs_done}); the run stopped without saving them. "
                             f"{last_good(checkpointer)}")
  checkpointer.save(step, run_state.checkpoint_tree(state, selection_state, partial, mesh),
                    {"epoch": epochs_done, "epoch_step": epoch_step, "step": step, **meta})
  return step


def stop_preempted(checkpointer: checkpointing.Checkpointer, step: int, epoch: int,
                   epoch_step: int) -> NoReturn:
  """Waits for the checkpoint at global `step` to commit, logs one line, raises Preempted."""
  checkpointer.wait_until_finished()
  message = (f"{checkpointer.preemption_signal}: saved a checkpoint at global step {step} "
             f"(epoch {epoch}, step {epoch_step} of it) in {checkpointer.directory}; rerun the "
             "same command to resume there.")
  logging.warning(message)
  raise preemption.Preempted(message, step)


_global_norm = jax.jit(optax.tree.norm)


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


def loss_hparams(loss: ml_collections.ConfigDict, epoch: int) -> dict[str, np.float32]:
  """The loss's scheduled hyper-parameters at `epoch` (config.loss), as host scalars."""
  return {k: np.float32(v) for k, v in losses.scheduled_hparams(loss, epoch).items()}


def learning_rates(optimizer: ml_collections.ConfigDict, epoch: int, epoch_start_step: int,
                   num_steps: int, total_steps: int, num_epochs: int) -> list[np.float32]:
  """The learning rate of each of the `num_steps` steps of `epoch` (optim; `optimizer`:
  config.optimizer), from global step `epoch_start_step` on. Computed once for the epoch
  where the schedule is by epoch (the same number at every step: about 10 us of Python a step
  saved)."""
  def rate(step: int) -> np.float32:
    return np.float32(optim.learning_rate_of_step(optimizer, epoch, step, total_steps,
                                                  num_epochs))
  if optimizer.schedule_unit == "epoch":
    return [rate(epoch_start_step)] * num_steps
  return [rate(epoch_start_step + i) for i in range(num_steps)]


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


def raise_if_bad(totals: dict[str, Any], epoch: int, epoch_start_step: int,
                 checkpointer: checkpointing.Checkpointer) -> None:
  """Stops the run if a step's loss was not finite (`totals["first_bad_step"]`)."""
  bad = int(jax.device_get(totals["first_bad_step"]))
  if bad != steps.NO_BAD_STEP:
    raise NonFiniteLossError(
        f"non-finite training loss at epoch {epoch}, step {bad - epoch_start_step} of the "
        f"epoch (global step {bad}); the run stopped without saving this state. "
        f"{last_good(checkpointer)} Lower the learning rate or enable "
        "gradient clipping.")


def raise_if_stalled(totals: dict[str, np.ndarray], epoch: int, num_steps: int,
                     checkpointer: checkpointing.Checkpointer, loss_name: str) -> None:
  """Stops a run whose epoch learned nothing: a gradient exactly zero at every step, or the
  same batch mean loss, bit for bit, at every one of several steps (different batches)."""
  zero_gradient = float(totals["grad_norm_max"]) == 0.0
  constant_loss = num_steps > 1 and float(totals["loss_min"]) == float(totals["loss_max"])
  if not (zero_gradient or constant_loss):
    return
  what = ("the gradient was exactly zero" if zero_gradient else
          f"the training loss was exactly {float(totals['loss_min'])!r}")
  raise StalledTrainingError(
      f"the run learns nothing: at every one of the {num_steps} steps of epoch {epoch} {what}; "
      f"the run stopped without saving this state. {last_good(checkpointer)} "
      f"Check the loss and its hyperparameters (loss.name={loss_name!r}; an "
      "FL_gamma loss needs meta.max_gamma > 0 and a meta.temperature that keeps gamma-Net's "
      "softmax finite) and the learning rate.")


def epoch_record(totals: dict[str, Any], epoch: int, num_steps: int, epoch_start_step: int,
                 checkpointer: checkpointing.Checkpointer, loss_name: str,
                 learning_rate: np.float32, hparams: dict[str, np.float32]) -> dict[str, float]:
  """The epoch's train numbers for its record (`learning_rate`: at its first step), after the
  non-finite and stalled checks of its sums (`totals`, on device)."""
  raise_if_bad(totals, epoch, epoch_start_step, checkpointer)
  totals = jax.device_get(totals)
  raise_if_stalled(totals, epoch, num_steps, checkpointer, loss_name)
  return {"train_loss": float(totals["loss_sum"] / totals["count"]),
          "train_accuracy": float(totals["correct"] / totals["count"]),
          "learning_rate": float(learning_rate), **{k: float(v) for k, v in hparams.items()}}
