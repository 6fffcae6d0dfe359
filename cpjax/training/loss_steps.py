"""Which train step a loss trains with, and what else that step needs: the one place where
FL_gamma (meta-learned gamma, Wang & Golebiowski 2024) differs from every other loss.

`for_loss` gives the run's `PlainSteps` (every loss but FL_gamma: `steps.train_step`, the
training batches as the reader gives them) or `MetaSteps` (FL_gamma: gamma-Net and its
optimizer in the train state, the bilevel `steps.meta_train_step`, each training batch joined
by a meta-validation batch, and the report's test gammas). Both answer the same questions,
asked at start-up (cpjax.training.setup builds one, kept in the Run), so the epoch never meets
either:

  extra_state       what `steps.create_train_state` adds to the train state (None: nothing);
  build_train_step  the train step with the model, optimizer, score and StepSpec bound;
  train_batches     the epoch's batches function (`TrainBatches`) over the run's readers;
  gamma_step        the report's per-example gamma step (None: no gamma in the report).
"""

from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import ml_collections
import numpy as np
import optax

from cpjax import run_state, steps
from cpjax.calibration import losses
from cpjax.calibration.gamma_net import MetaObjective, create_meta_objective
from cpjax.data import readers, splits

# The epoch's batches: (row blocks [steps, B], *, epoch, row_weights [N] or None, first_step:
# the global step of the first block) -> the step loop's batches.
TrainBatches = Callable[..., Iterator[dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class PlainSteps:
  """Every loss but FL_gamma: one SGD step per batch on the loss of `loss` (config.loss)."""
  loss: ml_collections.ConfigDict
  extra_state: None = None

  def build_train_step(self, model: nn.Module, tx: optax.GradientTransformation,
                       score_fn: steps.ScoreFn, spec: steps.StepSpec):
    return functools.partial(steps.train_step, model=model, tx=tx,
                             loss_fn=losses.get_loss(self.loss), score_fn=score_fn, spec=spec)

  def train_batches(self, data_readers: dict[str, readers.Reader], seed: int,
                    batch_size: int) -> TrainBatches:
    """The training reader's batches themselves (nothing joins them)."""
    del seed, batch_size
    reader = data_readers["train"]

    def batches(row_blocks: np.ndarray, *, epoch: int, row_weights: np.ndarray | None,
                first_step: int) -> Iterator[dict[str, Any]]:
      del first_step
      return reader.train_batches(row_blocks, epoch=epoch, row_weights=row_weights)
    return batches

  def gamma_step(self, model: nn.Module, spec: steps.StepSpec) -> None:
    del model, spec


@dataclasses.dataclass(frozen=True)
class MetaSteps:
  """FL_gamma: the bilevel step of gamma-Net and the model (steps.meta_train_step)."""
  extra_state: tuple[nn.Module, optax.GradientTransformation]  # (gamma-Net, its optimizer).
  objective: MetaObjective  # The meta-loss of a meta-validation batch.
  leak_meta_gradient: bool  # config.meta.leak_meta_gradient (the reference code's quirk).

  def build_train_step(self, model: nn.Module, tx: optax.GradientTransformation,
                       score_fn: steps.ScoreFn, spec: steps.StepSpec):
    gamma_net, meta_tx = self.extra_state
    return functools.partial(steps.meta_train_step, model=model, gamma_net=gamma_net, tx=tx,
                             meta_tx=meta_tx, objective=self.objective, score_fn=score_fn,
                             spec=spec, leak_meta_gradient=self.leak_meta_gradient)

  def train_batches(self, data_readers: dict[str, readers.Reader], seed: int,
                    batch_size: int) -> TrainBatches:
    """Each training batch joined by the meta-validation batch of its global step
    (data_readers["meta_val"]; `seed`, `batch_size`: config's), `_joined`."""
    reader, meta_reader = data_readers["train"], data_readers["meta_val"]

    def batches(row_blocks: np.ndarray, *, epoch: int, row_weights: np.ndarray | None,
                first_step: int) -> Iterator[dict[str, Any]]:
      return _joined(reader.train_batches(row_blocks, epoch=epoch, row_weights=row_weights),
                     meta_reader, seed, batch_size, first_step, len(row_blocks))
    return batches

  def gamma_step(self, model: nn.Module, spec: steps.StepSpec):
    """(state, batch) -> [B, 2] (gamma, correct) of the test split (steps.gamma_step)."""
    return functools.partial(steps.gamma_step, model=model, gamma_net=self.extra_state[0],
                             spec=spec)


def _joined(train_batches: Iterator[dict[str, Any]], meta_reader: readers.Reader,
            seed: int, batch_size: int, first_step: int, num_steps: int
            ) -> Iterator[dict[str, Any]]:
  """Each training batch with the meta-validation batch of its global step (from
  `first_step` on, `num_steps` of them) as "meta_image" and "meta_label": a reshuffling walk
  over the meta-validation split, a function of the step, read ahead by a stream reader like
  the training batches. Closing it closes both readers' read-ahead."""
  if num_steps == 0:
    return
  rows = np.stack([splits.cycled_rows(seed, first_step + s, len(meta_reader), batch_size)
                   for s in range(num_steps)])
  with contextlib.closing(train_batches), contextlib.closing(meta_reader.batches(rows)) as meta:
    for batch, meta_batch in zip(train_batches, meta):
      yield {**batch, "meta_image": meta_batch["image"], "meta_label": meta_batch["label"]}


# The steps of a run's loss: what `for_loss` gives.
LossSteps = PlainSteps | MetaSteps


def for_loss(loss: ml_collections.ConfigDict, meta: ml_collections.ConfigDict,
             num_classes: int) -> LossSteps:
  """The steps of `loss` (config.loss): MetaSteps for FL_gamma (gamma-Net from `meta`,
  config.meta, on `num_classes`), else PlainSteps."""
  parts = run_state.meta_parts(loss, meta, num_classes)
  if parts is None:
    return PlainSteps(loss)
  return MetaSteps(parts, create_meta_objective(loss, meta),
                   meta.leak_meta_gradient)

