"""The optimizer (optax SGD, PyTorch-style) and per-epoch learning-rate schedules.

PyTorch's SGD with coupled weight decay and clipping is, in order (spec §1.3):
clip(raw grad) -> add wd * theta -> momentum buffer -> theta -= lr * buffer,
i.e. optax `chain(clip_by_global_norm, add_decayed_weights, sgd)`. The learning
rate is injected as a hyper-parameter and set by the train step from the
epoch's value, so schedules keep their epoch shape whatever the number of
steps per epoch (subset selection shrinks it).
"""

import math

import ml_collections
import optax


def create_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """SGD with momentum, coupled weight decay and optional global-norm clipping.

  Args:
    config: `config.optimizer`.

  Returns:
    An optax transformation whose `learning_rate` hyper-parameter lives in
    its state (`optax.inject_hyperparams`).
  """
  def sgd_chain(learning_rate):
    parts = [optax.clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm else []
    parts += [optax.add_decayed_weights(config.weight_decay),
              optax.sgd(learning_rate, momentum=config.momentum or None,
                        nesterov=config.nesterov)]
    return optax.chain(*parts)
  return optax.inject_hyperparams(sgd_chain)(learning_rate=config.learning_rate)


def learning_rate_at(config: ml_collections.ConfigDict, epoch: int, num_epochs: int) -> float:
  """The learning rate of 0-indexed `epoch`, stepped once per epoch as in the sources.

  cosine: lr0 * (1 + cos(pi * e / E)) / 2 (PyTorch CosineAnnealingLR, eta_min 0);
  multistep: lr0 * decay_factor ** (number of milestones <= e); constant: lr0.
  """
  if config.schedule == "cosine":
    return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * epoch / num_epochs))
  if config.schedule == "multistep":
    passed = sum(epoch >= m for m in config.milestones)
    return config.learning_rate * config.decay_factor ** passed
  return config.learning_rate
