"""The tree a run checkpoints, defined once: train state, selection state, a partly trained epoch.

  {"train":     steps.TrainState (params, batch stats, optimizer state, step; for FL_gamma
                runs a MetaTrainState, which adds gamma-Net's phi and its Adam state),
   "selection": selection.bookkeeping.SelectionState (score buffer, last subset, times
                selected, last scoring epoch, seconds; irreducible losses under
                score=reducible_loss),
   "partial":   sums and per-example outputs of the steps of an epoch trained
                before a preemption (zeros at an epoch boundary)}

`checkpoint_tree` is the one spelling of it: the loop's save (cpjax.training.step_loop
.save_checkpoint), its restore target (cpjax.training.setup) and `abstract` (a `target` score source
restores another run's tree to score with its model, cpjax.selection.score_sources) all build it
here, so they cannot disagree about its shape. `partial_tree` and `partial_from_checkpoint`
turn an epoch's trained steps into the "partial" subtree and back. The "selection" subtree
is the selection package's (a layer above): it is passed in.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax

from cpjax import models, optim, steps
from cpjax.calibration import gamma_net, losses
from cpjax.data import specs, splits
from cpjax.runtime import sharding

PER_EXAMPLE = ("score", "confidence", "correct")  # The train step's per-example outputs.
PARTIAL_SUMS = ("loss_sum", "correct", "count")  # The epoch sums a mid-epoch checkpoint keeps.

# Also kept over an epoch (cpjax.training.step_loop): the largest gradient norm and the smallest and
# largest batch mean loss. A mid-epoch checkpoint does not save them: a resumed epoch starts
# them at these values, which mean "unknown" (they never show an epoch that learned nothing).
UNKNOWN_EXTREMES = {"grad_norm_max": np.inf, "loss_min": -np.inf, "loss_max": np.inf}


def checkpoint_tree(train: Any, selection: Any, partial: Any,
                    mesh: jax.sharding.Mesh | None = None) -> dict[str, Any]:
  """The tree a run checkpoints (the module docstring), from its three parts.

  Args:
    train: the train state (or its abstract shapes).
    selection: the selection state (or its abstract shapes).
    partial: the "partial" subtree (`empty_partial`, `partial_tree`, or abstract shapes).
    mesh: if given, `selection` and `partial` are host arrays, put replicated on it (the
      train state is on the mesh already).
  """
  if mesh is not None:
    selection, partial = sharding.replicate(mesh, (selection, partial))
  return {"train": train, "selection": selection, "partial": partial}


def partial_rows(dataset: ml_collections.ConfigDict, batch_size: int) -> int:
  """Size of the per-example buffers of a mid-epoch checkpoint: the longest epoch's rows
  (`dataset`: config.dataset; `batch_size`: config.batch_size)."""
  num_train = splits.num_train_examples(dataset)
  return -(-num_train // batch_size) * batch_size


def empty_partial(dataset: ml_collections.ConfigDict, batch_size: int) -> dict[str, np.ndarray]:
  """The "partial" subtree at an epoch boundary: nothing of an epoch trained."""
  rows = partial_rows(dataset, batch_size)
  return {"loss_sum": np.float32(0), "correct": np.float32(0), "count": np.float32(0),
          **{f"each_{k}": np.zeros(rows, np.float32) for k in PER_EXAMPLE}}


def partial_tree(dataset: ml_collections.ConfigDict, batch_size: int,
                 sums: dict[str, Any], outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The "partial" subtree of an epoch stopped mid-way: its `sums` (host values of
  PARTIAL_SUMS and more) and its per-example `outputs` (PER_EXAMPLE, in training order), the
  rest of the buffers zero."""
  partial = empty_partial(dataset, batch_size)
  partial.update({k: np.float32(sums[k]) for k in PARTIAL_SUMS})
  for k in PER_EXAMPLE:
    partial[f"each_{k}"][:len(outputs[k])] = outputs[k]
  return partial


@dataclasses.dataclass(frozen=True)
class Done:
  """The steps of an epoch trained before a preemption, as its checkpoint holds them: the
  `done` of cpjax.training.train._train_epoch."""
  steps: int  # Steps of the epoch trained.
  totals: dict[str, np.ndarray] | None  # Their epoch sums (None: no step yet).
  outputs: dict[str, np.ndarray] | None  # Their per-example outputs, in training order.


NOTHING_DONE = Done(steps=0, totals=None, outputs=None)


def partial_from_checkpoint(saved: dict[str, Any], epoch_step: int, batch_size: int
                            ) -> Done | None:
  """The trained part of an epoch from a checkpoint's "partial" subtree and its
  `epoch_step`; None at an epoch boundary."""
  if not epoch_step:
    return None
  saved = jax.tree.map(np.asarray, saved)
  rows = epoch_step * batch_size
  return Done(steps=epoch_step,
              # The extremes of the steps before the checkpoint are not saved: left unknown.
              totals={**{k: saved[k] for k in PARTIAL_SUMS},
                      "first_bad_step": np.int32(steps.NO_BAD_STEP),
                      **{k: np.float32(v) for k, v in UNKNOWN_EXTREMES.items()}},
              outputs={k: saved[f"each_{k}"][:rows] for k in PER_EXAMPLE})


def meta_parts(loss: ml_collections.ConfigDict, meta: ml_collections.ConfigDict,
               num_classes: int) -> tuple[nn.Module, optax.GradientTransformation] | None:
  """(gamma-Net, its optimizer) of an FL_gamma run; None for every other loss.

  Args:
    loss: config.loss (its name says whether the run is FL_gamma).
    meta: config.meta (gamma-Net's layers and its optimizer).
    num_classes: the dataset's classes (gamma-Net's input).
  """
  if losses.LOSSES[loss.name].meta_objective is None:
    return None
  return gamma_net.create_gamma_net(meta, num_classes), optim.create_meta_optimizer(meta)


def abstract(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
             selection: dict[str, np.ndarray]) -> dict[str, Any]:
  """Shapes, dtypes and (replicated) shardings of a run's checkpoint tree, computing nothing.

  Args:
    config: a run's whole config: its model, optimizer, dataset, batch_size, loss and meta
      sections all shape the tree (for a target run: the config saved with it).
    mesh: the mesh the restored arrays go to.
    selection: the run's initial "selection" subtree (cpjax.selection.bookkeeping
      .initial_state_of), for its shapes.
  """
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes, config.model.dtype)
  replicated = sharding.replicated(mesh)
  host_parts = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=replicated),
      (selection, empty_partial(config.dataset, config.batch_size)))
  return checkpoint_tree(steps.abstract_train_state(
      model, optim.create_optimizer(config.optimizer), data.image_shape, mesh,
      meta_parts(config.loss, config.meta, data.num_classes)), *host_parts)
