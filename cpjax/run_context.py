"""What one run's loop shares: the `Run` of parts built at start-up (cpjax.train), the error a
diverged run stops with, where its last good checkpoint is, and the periodic-action rule
(also cpjax.evaluation's). Only cpjax.train's epoch reads the Run: the parts below it get the
values and config sections they use."""

import dataclasses
from typing import Any

import jax

from cpjax import loss_steps
from cpjax.data import readers, splits
from cpjax.runtime import checkpointing


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or infinite."""


@dataclasses.dataclass(frozen=True)
class Run:
  """A run's parts built once at start-up, none of which changes while it trains: no config
  (each part was built from the sections it uses) and no train state (its buffers are donated
  by the first step: `cpjax.train._setup` returns the restored state beside the Run). Built in
  two steps: `_setup` the restored parts, then `cpjax.train` the loop's (selector, train step,
  evaluator, writers), which `evaluate_only` does not need."""
  workdir: str
  mesh: jax.sharding.Mesh
  model: Any
  tx: Any
  checkpointer: checkpointing.Checkpointer
  splits: dict[str, splits.Split]  # Host copies: labels, ids, images (none when streamed).
  readers: dict[str, readers.HostReader]  # The same splits as batches on the mesh.
  eval_fn: Any  # jitted (state, batch) -> logits
  # The epoch's batches from the train reader (the loss's: FL_gamma's joined by meta-validation
  # batches; cpjax.loss_steps).
  train_batches: loss_steps.TrainBatches
  # Metadata of every checkpoint: the config (as JSON) and a folder dataset's rows' digests
  # (its files or its records: cpjax.data.fingerprint), which a resume checks.
  checkpoint_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
  compilation_cache: str | None = None  # The persistent cache's directory; None: off.
  # The loop's parts (cpjax.train adds them once the selector knows the epochs' sizes).
  selector: Any = None  # selection.selector.Selector: each epoch's rows.
  train_fn: Any = None  # jitted (state, batch, learning_rate, loss_hparams), state donated.
  epoch_steps: tuple[int, ...] = ()  # Steps of each epoch the run trains.
  evaluator: Any = None  # evaluation.Evaluator: val/test metrics and the final report.
  writer: Any = None  # TensorBoard and the log.
  epoch_writer: Any = None  # The epoch records: TensorBoard and metrics.jsonl.
  epoch_log: Any = None  # run_logging.EpochLog: metrics.jsonl.
  progress: Any = None  # run_logging progress report (steps/s, ETA).

  @property
  def num_epochs(self) -> int:
    """Epochs the run trains: config.num_epochs, fewer where budget_steps runs out first."""
    return len(self.epoch_steps)

  @property
  def total_steps(self) -> int:
    return sum(self.epoch_steps)


def last_good(checkpointer: checkpointing.Checkpointer) -> str:
  """Where the last good checkpoint is, for the message of a run that stops (the loop's and
  the evaluator's, which hold the checkpointer, not the Run)."""
  step = checkpointer.latest_step()
  if step is None:
    return f"No checkpoint was saved yet in {checkpointer.directory}."
  return f"The last good checkpoint is step {step} in {checkpointer.directory}."


def due(epoch: int, every: int, num_epochs: int) -> bool:
  """Whether a periodic action (eval, checkpoint) runs after 0-indexed `epoch`: every
  `every` epochs and always after the last."""
  return (epoch + 1) % every == 0 or epoch + 1 == num_epochs
