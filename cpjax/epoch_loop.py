"""One epoch of training: the step loop and its metric sums; the run's checkpoint saves.

`train_epoch` trains an `EpochPlan` (the epoch's rows, in the order cpjax.data.splits gives
them) with the jitted train step, sums the epoch's metrics on device, writes the train metrics
every `log_every_steps` steps, stops the run on a non-finite or stalled loss, and returns an
`EpochResult`. The step loop does no checkpoint I/O: on a preemption request mid-epoch it
returns the steps trained (`EpochResult.partial`, run_state's "partial" subtree), and its
caller saves them (`save_checkpoint`) and raises `preemption.Preempted` (`stop_preempted`);
`run_state.partial_from_checkpoint` turns that checkpoint back into the steps already
trained, so the rerun finishes the epoch bit for bit. cpjax.train owns the run around it:
set-up, restore, selection, checkpoints, evaluation and the report.
"""

from collections.abc import Iterator
import contextlib
import dataclasses
import itertools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cpjax import optim, run_context, run_state, steps
from cpjax.calibration import losses
from cpjax.data import splits
from cpjax.run_context import NonFiniteLossError, Run
from cpjax.runtime import preemption, sharding
from cpjax.selection import bookkeeping

EPOCH_SUMS = ("loss_sum", "correct", "count", "first_bad_step")  # Summed over an epoch.


class StalledTrainingError(RuntimeError):
  """A whole epoch trained with a gradient exactly zero or a loss exactly constant."""


@dataclasses.dataclass
class EpochPlan:
  """One epoch's input: its rows, and what a mid-epoch checkpoint must hold to resume it.

  The rows (and weights) are a pure function of the selection state, the seed and the
  epoch, so a resumed epoch recomputes them and trains the same ceil(rows / batch_size)
  steps: the number of rows may differ between epochs (infobatch), never between runs.
  """
  epoch: int
  rows: np.ndarray
  selection_state: bookkeeping.SelectionState  # After this epoch's scoring pass.
  done: dict[str, Any] | None = None  # Steps already trained: steps, totals, outputs.
  weights: np.ndarray | None = None  # Loss weight of each of `rows` (infobatch); None: none.


@dataclasses.dataclass(frozen=True)
class EpochResult:
  """What `train_epoch` gives back: the epoch trained, or stopped mid-way by a preemption.

  A complete epoch has its `record`, `order` and `per_example`; `stop_requested` says a stop
  came at its last step (the caller saves the epoch whole, then stops). An epoch stopped
  mid-way has `partial` instead (`run_state.partial_tree` of its `epoch_step` steps): the
  caller saves it with `state` and stops, and the rerun finishes the epoch from it.
  """
  state: steps.TrainState
  record: dict[str, Any] | None = None  # Epoch train metrics (train_loss, ...).
  order: np.ndarray | None = None  # [steps, B] rows in training order.
  per_example: dict[str, np.ndarray] | None = None  # Train-pass outputs, [steps * B] each.
  stop_requested: bool = False  # A preemption request came during the epoch.
  partial: dict[str, np.ndarray] | None = None  # Set when the epoch stopped mid-way.
  epoch_step: int = 0  # Steps of the epoch trained before a mid-way stop.


@dataclasses.dataclass
class LoopHooks:
  """The loop's side channels: metric writer, progress report, preemption guard."""
  writer: Any
  progress: Any
  guard: preemption.PreemptionGuard | None = None
  compiled: bool = False  # The train step has run once in this process (compiled).


def save_checkpoint(run: Run, state: steps.TrainState,
                    selection_state: bookkeeping.SelectionState, epochs_done: int,
                    partial: dict[str, np.ndarray] | None = None, epoch_step: int = 0) -> int:
  """Saves a checkpoint named by the global step; returns that step.

  `epochs_done` complete epochs; with `partial`, also `epoch_step` steps of the next.
  """
  step = int(jax.device_get(state.step))
  if not np.isfinite(float(jax.device_get(_global_norm(state.params)))):
    raise NonFiniteLossError(f"non-finite parameters at global step {step} (epoch "
                             f"{epochs_done}); the run stopped without saving them. "
                             f"{run_context.last_good(run.checkpointer)}")
  if partial is None:
    partial = run_state.empty_partial(run.config.dataset, run.config.batch_size)
  meta = {"epoch": epochs_done, "epoch_step": epoch_step, "step": step,
          "config": run.config.to_json_best_effort(sort_keys=True)}
  if run.data_digests is not None:  # A folder's files: a resume checks they are unchanged.
    meta["data_digests"] = run.data_digests
  run.checkpointer.save(step, run_state.checkpoint_tree(state, selection_state, partial,
                                                        run.mesh), meta)
  return step


_global_norm = jax.jit(optax.tree.norm)


@jax.jit
def _accumulate(totals: dict[str, jax.Array], batch_metrics: dict[str, jax.Array]):
  """Sums batch metrics on device (min for the first non-finite step and the smallest loss,
  max for the largest gradient norm and loss)."""
  # Not clu.metrics (Average / Accuracy .merge): the same float32 additions, but the sums are
  # checkpointed mid-epoch as plain arrays (run_state's "partial") and first_bad_step is a
  # min, which clu.metrics has no metric for; a Collection would wrap three additions.
  combine = {"first_bad_step": jnp.minimum, "loss_min": jnp.minimum,
             "grad_norm_max": jnp.maximum, "loss_max": jnp.maximum}
  return {k: combine.get(k, jnp.add)(v, batch_metrics[k]) for k, v in totals.items()}


def _epoch_sums(batch_metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """What `_accumulate` keeps of one step's metrics."""
  mean_loss = batch_metrics["loss_sum"] / batch_metrics["count"]
  return {**{k: batch_metrics[k] for k in EPOCH_SUMS}, "grad_norm_max": batch_metrics["grad_norm"],
          "loss_min": mean_loss, "loss_max": mean_loss}


def _fold_steps(totals: dict[str, jax.Array] | None, window: list[dict[str, jax.Array]]
                ) -> dict[str, jax.Array] | None:
  """`totals` (None: nothing yet) plus the epoch sums of each step's metrics, in order."""
  for batch_metrics in window:
    sums = _epoch_sums(batch_metrics)
    totals = sums if totals is None else _accumulate(totals, sums)
  return totals


@jax.jit
def _fold_window(totals: dict[str, jax.Array] | None, window: list[dict[str, jax.Array]]
                 ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """A logging window in one dispatch: `_fold_steps` (the same sums, in the same order) and
  its metrics stacked for the log ([steps] per metric). Summing per window rather than per
  step keeps the loop at one dispatch per step (the step's)."""
  return _fold_steps(totals, window), jax.tree.map(lambda *v: jnp.stack(v), *window)


def train_epoch(run: Run, train_fn, state: steps.TrainState, plan: EpochPlan,
                hooks: LoopHooks) -> EpochResult:
  """Trains one epoch over `plan.rows` in the epoch's deterministic order.

  Every `log_every_steps` steps, the window's train metrics go to the writer and
  a non-finite loss stops the run. A preemption request ends the epoch after the
  current step: the result holds what a checkpoint must save (the loop does no
  checkpoint I/O; cpjax.train saves and stops). With `plan.done`, the first steps
  were trained before a preemption and are skipped.
  """
  config, epoch = run.config, plan.epoch
  order = splits.epoch_order(config.seed, epoch, plan.rows, config.batch_size)
  if run.epoch_steps:  # A step budget cuts the last epoch short (else this keeps all).
    order = order[:run.epoch_steps[epoch]]
  loss_hparams = {k: np.float32(v) for k, v in losses.scheduled_hparams(config.loss, epoch).items()}
  done = plan.done or {"steps": 0, "totals": None, "outputs": None}
  epoch_start_step = int(jax.device_get(state.step)) - done["steps"]
  totals = None if done["totals"] is None else jax.device_put(done["totals"])
  outputs, window, stop_requested = [], [], False
  row_weights = _row_weights(plan, len(run.splits["train"]))
  epoch_learning_rate = _learning_rate(run, epoch, epoch_start_step)
  # Each step's learning rate, computed before the loop rather than in it.
  learning_rates = _learning_rates(run, epoch, epoch_start_step, done["steps"], len(order))
  # closing: a stop inside the epoch (preemption, divergence) also ends a stream reader's
  # read-ahead, of the training and of the meta-validation batches. The transfer guard
  # (config.step_transfer_guard) covers the loop, its logging points and a stop's host
  # reads excepted (`_host_point`): a step that waits on a device value stalls an
  # accelerator (tests/test_transfer_guard.py counts such reads on CPU, where the guard
  # cannot fire).
  with contextlib.closing(run.readers["train"].train_batches(
      order[done["steps"]:], row_weights=row_weights, epoch=epoch)) as train_batches, \
      contextlib.closing(_meta_batches(run, epoch_start_step + done["steps"],
                                       len(order) - done["steps"])) as meta_batches, \
      _step_guard(config.step_transfer_guard):
    for i, (train_batch, meta_batch) in enumerate(zip(train_batches, meta_batches),
                                                  start=done["steps"]):
      learning_rate = learning_rates[i]
      batch = {**train_batch, **meta_batch} if meta_batch else train_batch
      if not hooks.compiled:
        compile_start = time.perf_counter()
        logging.info("Compiling the train step (the first step waits for it)...")
      state, batch_metrics, per_example = train_fn(state, batch, learning_rate, loss_hparams)
      if not hooks.compiled:  # Waits for the first step once, to time the compile.
        jax.block_until_ready(batch_metrics)
        logging.info("Train step compiled; the first step took %.1f s.",
                     time.perf_counter() - compile_start)
        hooks.compiled = True
      window.append(batch_metrics)  # Summed into `totals` at a logging point or a stop.
      outputs.append(per_example)
      hooks.progress(epoch_start_step + i + 1)
      if (i + 1) % config.log_every_steps == 0:
        totals, stacked = _fold_window(totals, window)
        with _host_point():
          _log_train_window(run, hooks.writer, stacked, epoch_start_step + i + 1, epoch,
                            epoch_start_step, learning_rate)
        window = []
      if hooks.guard is not None and hooks.guard.should_stop(epoch_start_step + i + 1):
        stop_requested = True
        if i + 1 < len(order):  # Mid-epoch: the caller saves these steps and stops.
          totals = _fold_steps(totals, window)
          with _host_point():
            return _stopped(run, state, epoch, totals, _host_outputs(outputs, done["outputs"]),
                            i + 1, epoch_start_step)
  totals = _fold_steps(totals, window)  # The steps after the last logging point.
  _raise_if_bad(run, totals, epoch, epoch_start_step)
  totals = jax.device_get(totals)
  _raise_if_stalled(run, totals, epoch, len(order))
  record = {"train_loss": float(totals["loss_sum"] / totals["count"]),
            "train_accuracy": float(totals["correct"] / totals["count"]),
            "learning_rate": float(epoch_learning_rate),  # At the epoch's first step.
            **{k: float(v) for k, v in loss_hparams.items()}}
  return EpochResult(state, record, order, _host_outputs(outputs, done["outputs"]),
                     stop_requested)


def _step_guard(level: str) -> contextlib.AbstractContextManager:
  """JAX's transfer guard on device-to-host copies at `level`, around the step loop. It fires
  on accelerators only: a CPU device's buffers are host memory, read without a copy."""
  return jax.transfer_guard_device_to_host(level)


def _host_point() -> contextlib.AbstractContextManager:
  """Where the step loop may copy device values to the host (logging, a checkpoint)."""
  return jax.transfer_guard_device_to_host("allow")


def _learning_rate(run: Run, epoch: int, step: int) -> np.float32:
  """The learning rate of global step `step` (0-indexed) in `epoch` (optim)."""
  return np.float32(optim.learning_rate_of_step(run.config.optimizer, epoch, step,
                                                run.total_steps, run.config.num_epochs))


def _learning_rates(run: Run, epoch: int, epoch_start_step: int, first: int, num_steps: int
                    ) -> list[np.float32 | None]:
  """`_learning_rate` of steps first..num_steps - 1 of `epoch`, at their index (None before
  `first`: steps trained before a preemption). Computed once for the epoch where the schedule
  is by epoch (the same number at every step: about 10 us of Python a step saved)."""
  if run.config.optimizer.schedule_unit == "epoch":
    return [None] * first + [_learning_rate(run, epoch, epoch_start_step)] * (num_steps - first)
  return [None] * first + [_learning_rate(run, epoch, epoch_start_step + i)
                           for i in range(first, num_steps)]


def _meta_batches(run: Run, first_step: int, num_steps: int
                  ) -> Iterator[dict[str, jax.Array]]:
  """The meta-validation batches of global steps first_step, first_step + 1, ... (FL_gamma
  runs; else empty dicts): a reshuffling walk over the meta-validation split, a function of
  the step, read ahead by a stream reader like the training batches."""
  meta_reader = run.readers.get("meta_val")
  if meta_reader is None:
    yield from itertools.repeat({}, num_steps)
    return
  if num_steps == 0:
    return
  rows = np.stack([splits.cycled_rows(run.config.seed, first_step + s, len(meta_reader),
                                      run.config.batch_size) for s in range(num_steps)])
  with contextlib.closing(meta_reader.batches(rows)) as batches:
    for meta in batches:
      yield {"meta_image": meta["image"], "meta_label": meta["label"]}


def _row_weights(plan: EpochPlan, num_rows: int) -> np.ndarray | None:
  """The plan's weights indexed by training row (None when the plan has none)."""
  if plan.weights is None:
    return None
  weights = np.ones(num_rows, np.float32)
  weights[plan.rows] = plan.weights
  return weights


def _host_outputs(outputs: list[dict[str, jax.Array]],
                  earlier: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
  """The per-example outputs of an epoch's steps, flattened in training order, on the host."""
  if not outputs:
    return dict(earlier)
  gathered = {k: [np.asarray(v) for v in sharding.to_host([o[k] for o in outputs])]
              for k in outputs[0]}
  return {k: np.concatenate(([earlier[k]] if earlier else []) + v) for k, v in gathered.items()}


def _stopped(run: Run, state: steps.TrainState, epoch: int, totals: dict[str, jax.Array],
             outputs: dict[str, np.ndarray], epoch_step: int, epoch_start_step: int
             ) -> EpochResult:
  """The result of an epoch stopped after `epoch_step` steps: the "partial" subtree that a
  checkpoint of `state` must hold to finish the epoch on resume."""
  _raise_if_bad(run, totals, epoch, epoch_start_step)  # Never hand on a diverged state.
  partial = run_state.partial_tree(run.config.dataset, run.config.batch_size,
                                   jax.device_get(totals), outputs)
  return EpochResult(state, stop_requested=True, partial=partial, epoch_step=epoch_step)


def stop_preempted(run: Run, step: int, epoch: int, epoch_step: int, signal_name: str) -> None:
  """Waits for the checkpoint at global `step` to commit, logs one line, raises Preempted."""
  run.checkpointer.wait_until_finished()
  message = (f"{signal_name}: saved a checkpoint at global step {step} (epoch {epoch}, step "
             f"{epoch_step} of it) in {run.checkpointer.directory}; rerun the same command to "
             "resume there.")
  logging.warning(message)
  raise preemption.Preempted(message, step)


def _log_train_window(run: Run, writer, stacked: dict[str, jax.Array], step: int,
                      epoch: int, epoch_start_step: int, learning_rate: np.float32) -> None:
  """Writes the train metrics of the steps up to global `step` (as flax and big_vision
  log them) and stops the run if one of their losses was not finite."""
  stacked = jax.device_get(stacked)  # [steps] per metric: one transfer each.
  window = [{k: v[i] for k, v in stacked.items()} for i in range(len(stacked["count"]))]
  _raise_if_bad(run, {"first_bad_step": min(m["first_bad_step"] for m in window)}, epoch,
                epoch_start_step)
  count = sum(float(m["count"]) for m in window)
  scalars = {
      "train/loss": sum(float(m["loss_sum"]) for m in window) / count,
      "train/accuracy": sum(float(m["correct"]) for m in window) / count,
      "train/learning_rate": float(learning_rate),
      "train/grad_norm": float(np.mean([m["grad_norm"] for m in window])),
      "train/param_norm": float(window[-1]["param_norm"]),
  }
  if "meta_loss" in window[-1]:  # FL_gamma: the meta-objective and gamma-Net's mean gamma.
    scalars["train/meta_loss"] = float(np.mean([m["meta_loss"] for m in window]))
    scalars["train/gamma_mean"] = sum(float(m["gamma_sum"]) for m in window) / count
  writer.write_scalars(step, scalars)


def _raise_if_bad(run: Run, totals: dict[str, Any], epoch: int, epoch_start_step: int) -> None:
  bad = int(jax.device_get(totals["first_bad_step"]))
  if bad != steps.NO_BAD_STEP:
    raise NonFiniteLossError(
        f"non-finite training loss at epoch {epoch}, step {bad - epoch_start_step} of the "
        f"epoch (global step {bad}); the run stopped without saving this state. "
        f"{run_context.last_good(run.checkpointer)} Lower the learning rate or enable "
        "gradient clipping.")


def _raise_if_stalled(run: Run, totals: dict[str, np.ndarray], epoch: int, num_steps: int
                      ) -> None:
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
      f"the run stopped without saving this state. {run_context.last_good(run.checkpointer)} "
      f"Check the loss and its hyperparameters (loss.name={run.config.loss.name!r}; an "
      "FL_gamma loss needs meta.max_gamma > 0 and a meta.temperature that keeps gamma-Net's "
      "softmax finite) and the learning rate.")
