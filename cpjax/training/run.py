"""What one run's loop shares: the `Run` of parts built at start-up (cpjax.training.setup), and
the epoch's record with the stops that guard it: a diverged run (`NonFiniteLossError`) or one
that learns nothing (`StalledTrainingError`), each naming where its last good checkpoint is.
Only cpjax.training.train and cpjax.training.setup read the Run: the parts below them get the
values and config sections they use."""

from collections.abc import Callable
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax

from cpjax import steps
from cpjax.data import readers, splits
from cpjax.runtime import checkpointing
from cpjax.training import loss_steps


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or infinite."""


class StalledTrainingError(RuntimeError):
  """A whole epoch trained with a gradient exactly zero or a loss exactly constant."""


# The jitted eval step: (state, batch) -> float32 logits [B, K].
EvalFn = Callable[[steps.TrainState, dict[str, jax.Array]], jax.Array]


@dataclasses.dataclass(frozen=True)
class Run:
  """A run's parts built once at start-up (`cpjax.training.setup.setup_run`), none of which
  changes while it trains: no config (each part was built from the sections it uses) and no
  train state (its buffers are donated by the first step: `setup_run` returns the restored
  state beside the Run). The loop's parts (selector, train step, evaluator, writers), which
  `evaluate_only` does not need, are cpjax.training.setup's `Loop`."""
  workdir: str
  mesh: jax.sharding.Mesh
  model: nn.Module
  tx: optax.GradientTransformation
  checkpointer: checkpointing.Checkpointer
  splits: dict[str, splits.Split]  # Host copies: labels, ids, images (none when streamed).
  readers: dict[str, readers.Reader]  # The same splits as batches on the mesh.
  eval_fn: EvalFn  # jitted.
  # The loss's steps (cpjax.training.loss_steps.for_loss, built once): its train step, its
  # extra train state and (FL_gamma) the report's test gammas.
  loss_kind: loss_steps.LossSteps
  # The epoch's batches from the train reader (the loss's: FL_gamma's joined by meta-validation
  # batches; `loss_kind.train_batches`).
  train_batches: loss_steps.TrainBatches
  # Metadata of every checkpoint: the config (as JSON) and a folder dataset's rows' digests
  # (its files or its records: cpjax.data.fingerprint), which a resume checks.
  checkpoint_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
  compilation_cache: str | None = None  # The persistent cache's directory; None: off.
  # Where this sitting's records come from: code, machine, start, config digest, seeds and the
  # label-noise draw (cpjax.runtime.provenance.gather).
  provenance: dict[str, Any] = dataclasses.field(default_factory=dict)


def last_good(checkpointer: checkpointing.Checkpointer) -> str:
  """Where the last good checkpoint is, for the message of a run that stops (the loop's and
  the evaluator's, which hold the checkpointer, not the Run)."""
  step = checkpointer.latest_step()
  if step is None:
    return f"No checkpoint was saved yet in {checkpointer.directory}."
  return f"The last good checkpoint is step {step} in {checkpointer.directory}."


def raise_if_bad(totals: dict[str, Any], epoch: int, epoch_start_step: int,
                 checkpointer: checkpointing.Checkpointer) -> None:
  """Stops the run if a step's loss was not finite (`totals["first_bad_step"]`)."""
  bad = int(jax.device_get(totals["first_bad_step"]))
  if bad != steps.NO_BAD_STEP:
    raise NonFiniteLossError(
        f"non-finite training loss at epoch {epoch}, step {bad - epoch_start_step} of the "
        f"epoch (global step {bad}); the run stopped without saving this state. "
        f"{last_good(checkpointer)} Lower the learning rate or enable gradient clipping.")


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
