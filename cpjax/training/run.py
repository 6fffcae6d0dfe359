"""What one run's loop shares: the `Run` of parts built at start-up (cpjax.training.setup),
the error a diverged run stops with, where its last good checkpoint is, and the
periodic-action rule (also cpjax.training.evaluation's). Only cpjax.training.train and
cpjax.training.setup read the Run: the parts below them get the values and config sections
they use."""

from collections.abc import Callable
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import optax

from cpjax import steps
from cpjax.data import readers, splits
from cpjax.runtime import checkpointing
from cpjax.training import loss_steps


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or infinite."""


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


def last_good(checkpointer: checkpointing.Checkpointer) -> str:
  """Where the last good checkpoint is, for the message of a run that stops (the loop's and
  the evaluator's, which hold the checkpointer, not the Run)."""
  step = checkpointer.latest_step()
  if step is None:
    return f"No checkpoint was saved yet in {checkpointer.directory}."
  return f"The last good checkpoint is step {step} in {checkpointer.directory}."


