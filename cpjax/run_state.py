"""The tree a run checkpoints, defined once: train state, selection state, a partly trained epoch.

  {"train":     steps.TrainState (params, batch stats, optimizer state, step; for FL_gamma
                runs a MetaTrainState, which adds gamma-Net's phi and its Adam state),
   "selection": selection.bookkeeping.SelectionState (score buffer, last subset, times
                selected, last scoring epoch, seconds; irreducible losses under
                score=reducible_loss),
   "partial":   sums and per-example outputs of the steps of an epoch trained
                before a preemption (zeros at an epoch boundary)}

The loop saves and resumes this tree (cpjax.train); a `target` score source
restores another run's tree to score with its model (cpjax.selection.sources).
Both build the restore target here, so they cannot disagree about its shape. The
"selection" subtree is the selection package's (a layer above): it is passed in.
"""

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


def meta_parts(config: ml_collections.ConfigDict
               ) -> tuple[nn.Module, optax.GradientTransformation] | None:
  """(gamma-Net, its optimizer) of an FL_gamma run's config; None for every other loss."""
  if losses.LOSSES[config.loss.name].meta_objective is None:
    return None
  num_classes = specs.DATASETS[config.dataset.name].num_classes
  return (gamma_net.create_gamma_net(config.meta, num_classes),
          optim.create_meta_optimizer(config.meta))


def abstract(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
             selection: dict[str, np.ndarray]) -> dict[str, Any]:
  """Shapes, dtypes and (replicated) shardings of a run's checkpoint tree, computing nothing.

  Args:
    config: the run's own config (for a target run: the config saved with it).
    mesh: the mesh the restored arrays go to.
    selection: the run's initial "selection" subtree (cpjax.selection.bookkeeping
      .initial_state_of), for its shapes.
  """
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes, config.model.dtype)
  replicated = sharding.replicated(mesh)
  host_parts = {"selection": selection,
                "partial": empty_partial(config.dataset, config.batch_size)}
  return {"train": steps.abstract_train_state(model, optim.create_optimizer(config.optimizer),
                                              data.image_shape, mesh, meta_parts(config)),
          **jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                        sharding=replicated), host_parts)}
