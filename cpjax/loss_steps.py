"""Which train step a loss trains with, and what else that step needs: the one place where
FL_gamma (meta-learned gamma, Wang & Golebiowski 2024) differs from every other loss.

`for_loss` gives the run's `PlainSteps` (every loss but FL_gamma: `steps.train_step`, the
training batches as the reader gives them) or `MetaSteps` (FL_gamma: gamma-Net and its
optimizer in the train state, the bilevel `steps.meta_train_step`, each training batch joined
by a meta-validation batch, and the report's test gammas). Both answer the same four
questions, so the loop (cpjax.train) asks them without knowing which loss it trains:

  extra_state       what `steps.create_train_state` adds to the train state (None: nothing);
  build_train_step  the train step with the model, optimizer, score and StepSpec bound;
  with_data         itself, reading any batches of its own from the run's readers;
  batches           the step loop's batches from the training reader's;
  gamma_step        the report's per-example gamma step (None: no gamma in the report).
"""

from collections.abc import Iterator
import contextlib
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import ml_collections
import numpy as np
import optax

from cpjax import run_state, steps
from cpjax.calibration import gamma_net as gamma_net_lib
from cpjax.calibration import losses
from cpjax.data import readers, splits


@dataclasses.dataclass(frozen=True)
class PlainSteps:
  """Every loss but FL_gamma: one SGD step per batch on the loss of `loss` (config.loss)."""
  loss: ml_collections.ConfigDict
  extra_state: None = None

  def build_train_step(self, model: nn.Module, tx: optax.GradientTransformation,
                       score_fn: steps.ScoreFn, spec: steps.StepSpec):
    return functools.partial(steps.train_step, model=model, tx=tx,
                             loss_fn=losses.get_loss(self.loss), score_fn=score_fn, spec=spec)

  def with_data(self, data_readers: dict[str, readers.HostReader], seed: int,
                batch_size: int) -> "PlainSteps":
    """Itself: its batches are the training reader's alone."""
    del data_readers, seed, batch_size
    return self

  def batches(self, train_batches: Iterator[dict[str, Any]], first_step: int, num_steps: int
              ) -> Iterator[dict[str, Any]]:
    """The reader's training batches themselves (nothing joins them)."""
    del first_step, num_steps
    return train_batches

  def gamma_step(self, model: nn.Module, spec: steps.StepSpec) -> None:
    del model, spec


@dataclasses.dataclass(frozen=True)
class MetaSteps:
  """FL_gamma: the bilevel step of gamma-Net and the model (steps.meta_train_step)."""
  extra_state: tuple[nn.Module, optax.GradientTransformation]  # (gamma-Net, its optimizer).
  objective: gamma_net_lib.MetaObjective  # The meta-loss of a meta-validation batch.
  leak_meta_gradient: bool  # config.meta.leak_meta_gradient (the reference code's quirk).
  # Where the meta-validation batches come from (`with_data`, once the data is read).
  meta_reader: readers.HostReader | None = None
  seed: int = 0  # config.seed: the meta-validation walk's.
  batch_size: int = 0  # config.batch_size.

  def with_data(self, data_readers: dict[str, readers.HostReader], seed: int,
                batch_size: int) -> "MetaSteps":
    """A copy that reads its meta-validation batches from data_readers["meta_val"]."""
    return dataclasses.replace(self, meta_reader=data_readers["meta_val"], seed=seed,
                               batch_size=batch_size)

  def build_train_step(self, model: nn.Module, tx: optax.GradientTransformation,
                       score_fn: steps.ScoreFn, spec: steps.StepSpec):
    gamma_net, meta_tx = self.extra_state
    return functools.partial(steps.meta_train_step, model=model, gamma_net=gamma_net, tx=tx,
                             meta_tx=meta_tx, objective=self.objective, score_fn=score_fn,
                             spec=spec, leak_meta_gradient=self.leak_meta_gradient)

  def batches(self, train_batches: Iterator[dict[str, Any]], first_step: int, num_steps: int
              ) -> Iterator[dict[str, Any]]:
    """Each training batch with the meta-validation batch of its global step (from
    `first_step` on, `num_steps` of them) as "meta_image" and "meta_label": a reshuffling walk
    over the meta-validation split, a function of the step, read ahead by a stream
    reader like the training batches. Closing it closes both readers' read-ahead."""
    if num_steps == 0:
      return
    rows = np.stack([splits.cycled_rows(self.seed, first_step + s, len(self.meta_reader),
                                        self.batch_size) for s in range(num_steps)])
    with contextlib.closing(train_batches), \
        contextlib.closing(self.meta_reader.batches(rows)) as meta:
      for batch, meta_batch in zip(train_batches, meta):
        yield {**batch, "meta_image": meta_batch["image"], "meta_label": meta_batch["label"]}

  def gamma_step(self, model: nn.Module, spec: steps.StepSpec):
    """(state, batch) -> [B, 2] (gamma, correct) of the test split (steps.gamma_step)."""
    return functools.partial(steps.gamma_step, model=model, gamma_net=self.extra_state[0],
                             spec=spec)


def for_loss(loss: ml_collections.ConfigDict, meta: ml_collections.ConfigDict,
             num_classes: int) -> PlainSteps | MetaSteps:
  """The steps of `loss` (config.loss): MetaSteps for FL_gamma (gamma-Net from `meta`,
  config.meta, on `num_classes`), else PlainSteps."""
  parts = run_state.meta_parts(loss, meta, num_classes)
  if parts is None:
    return PlainSteps(loss)
  return MetaSteps(parts, gamma_net_lib.create_meta_objective(loss, meta),
                   meta.leak_meta_gradient)

