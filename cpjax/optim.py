"""The optimizer (optax SGD, PyTorch-style) and the learning-rate schedules.

PyTorch's SGD with coupled weight decay and clipping is, in order
(docs/methods.md#optimiser-and-schedules):
clip(raw grad) -> add wd * theta -> momentum buffer -> theta -= lr * buffer,
i.e. optax `chain(clip_by_global_norm, add_decayed_weights, sgd)`. The learning
rate is injected as a hyper-parameter and set by the train step from the
epoch's value, so schedules keep their epoch shape whatever the number of
steps per epoch (subset selection shrinks it). With `schedule_unit="step"` the
same schedule is stretched over the run's optimizer steps instead and changes
at every step: a run cut to a step budget (`budget_steps`, the "same budget"
baseline) still decays to its end.
"""

import math

import ml_collections
import numpy as np
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


def create_meta_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Adam on gamma-Net's parameters (`config.meta`; Meta-Calibration: torch Adam, lr 1e-3)."""
  return optax.adam(config.learning_rate)


def learning_rate_at(config: ml_collections.ConfigDict, epoch: float, num_epochs: int) -> float:
  """The learning rate at (0-indexed, possibly fractional) `epoch` of `num_epochs`.

  cosine: lr0 * (1 + cos(pi * e / E)) / 2 (PyTorch CosineAnnealingLR, eta_min 0);
  multistep: lr0 * decay_factor ** (number of milestones <= e); constant: lr0.
  """
  # Not optax.cosine_decay_schedule / piecewise_constant_schedule: they compute in float32,
  # and their rates differ from these float64 ones rounded to float32 (cosine over a
  # 637-step run: 374 steps differ, up to 2e-4 relative near the end; multistep over 350
  # epochs: the 100 epochs after the second drop), which would change every trained number.
  if config.schedule == "cosine":
    warmup = config.get("warmup_epochs", 0.0)  # The cosine starts after any warm-up.
    if warmup:
      epoch, num_epochs = max(epoch - warmup, 0.0), num_epochs - warmup
    return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * epoch / num_epochs))
  if config.schedule == "multistep":
    passed = sum(epoch >= m for m in config.milestones)
    return config.learning_rate * config.decay_factor ** passed
  return config.learning_rate


def learning_rate_of_step(config: ml_collections.ConfigDict, epoch: int, step: int,
                          total_steps: int, num_epochs: int) -> float:
  """The learning rate of global optimizer `step` (0-indexed) in 0-indexed `epoch`.

  schedule_unit "epoch": the epoch's rate, as in the sources (one per epoch).
  schedule_unit "step": the `num_epochs`-epoch schedule stretched over the run's
  `total_steps` steps, evaluated at e = step * num_epochs / total_steps; cosine
  becomes lr0 * (1 + cos(pi * step / total_steps)) / 2.

  With `warmup_epochs` W > 0 (Goyal et al. 2017's gradual warm-up, as flax's ImageNet
  example): lr0 * min(1, (e + u) / W) while e < W, u one epoch or one step (the unit), so
  the ramp ends at lr0; then the schedule, a cosine running over the E - W epochs after W.
  """
  if config.schedule_unit == "epoch":
    at, unit = float(epoch), 1.0
  else:
    at, unit = step * num_epochs / total_steps, num_epochs / total_steps
  warmup = config.get("warmup_epochs", 0.0)  # .get: configs saved before warm-up existed.
  if warmup and at < warmup:
    return config.learning_rate * min(1.0, (at + unit) / warmup)
  return learning_rate_at(config, at if config.schedule_unit == "step" else epoch, num_epochs)


def learning_rates(config: ml_collections.ConfigDict, epoch: int, epoch_start_step: int,
                   num_steps: int, total_steps: int, num_epochs: int) -> list[np.float32]:
  """The learning rate of each of the `num_steps` steps of `epoch`, from global step
  `epoch_start_step` on, as the train step takes them. Computed once for the epoch where the
  schedule is by epoch (the same number at every step: about 10 us of Python a step saved)."""
  def rate(step: int) -> np.float32:
    return np.float32(learning_rate_of_step(config, epoch, step, total_steps, num_epochs))
  if config.schedule_unit == "epoch":
    return [rate(epoch_start_step)] * num_steps
  return [rate(epoch_start_step + i) for i in range(num_steps)]
