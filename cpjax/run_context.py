"""What one run's loop shares: the `Run` built at start-up (cpjax.train, cpjax.epoch_loop), the
error a diverged run stops with, where its last good checkpoint is, and the periodic-action
rule (also cpjax.evaluation's, whose evaluators get their own parts, not the Run)."""

import dataclasses
from typing import Any

import jax
import ml_collections

from cpjax import steps
from cpjax.data import readers, splits
from cpjax.runtime import checkpointing
from cpjax.selection import bookkeeping


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or infinite."""


@dataclasses.dataclass(frozen=True)
class Run:
  """What one run's loop shares, built once by `_setup` (frozen: nothing changes it after;
  cpjax.train adds `epoch_steps` by `dataclasses.replace` once)."""
  config: ml_collections.ConfigDict
  workdir: str
  mesh: jax.sharding.Mesh
  model: Any
  tx: Any
  checkpointer: checkpointing.Checkpointer
  splits: dict[str, splits.Split]  # Host copies: labels, ids, images (none when streamed).
  readers: dict[str, readers.HostReader]  # The same splits as batches on the mesh.
  eval_fn: Any  # jitted (state, batch) -> logits
  state: steps.TrainState  # As restored (or initialised).
  selection: bookkeeping.SelectionState  # Host copy, as restored.
  start_epoch: int
  partial: dict[str, Any] | None = None  # Steps of `start_epoch` already trained (preempted).
  # Steps of each epoch the run trains (cpjax.train._epoch_steps); () before it knows them.
  epoch_steps: tuple[int, ...] = ()
  compilation_cache: str | None = None  # The persistent cache's directory; None: off.
  # {split: digest} of a folder dataset's files, saved in every checkpoint's metadata
  # (cpjax.data.fingerprint); None for other datasets.
  data_digests: dict[str, str] | None = None

  @property
  def num_epochs(self) -> int:
    """Epochs the run trains: config.num_epochs, fewer where budget_steps runs out first."""
    return len(self.epoch_steps) if self.epoch_steps else self.config.num_epochs

  @property
  def total_steps(self) -> int:
    return sum(self.epoch_steps)


def last_good(checkpointer: checkpointing.Checkpointer) -> str:
  """Where the last good checkpoint is, for the message of a run that stops (the loop's and
  the evaluators', which hold the checkpointer, not the Run)."""
  step = checkpointer.latest_step()
  if step is None:
    return f"No checkpoint was saved yet in {checkpointer.directory}."
  return f"The last good checkpoint is step {step} in {checkpointer.directory}."


def due(epoch: int, every: int, num_epochs: int) -> bool:
  """Whether a periodic action (eval, checkpoint) runs after 0-indexed `epoch`: every
  `every` epochs and always after the last."""
  return (epoch + 1) % every == 0 or epoch + 1 == num_epochs
