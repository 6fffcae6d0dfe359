"""The train state and the jitted steps: train, eval, score, and `predict` over a split.

Every step is a pure function of pytrees; the loop (cpjax.train) and the score
sources (cpjax.selection.sources) bind its keyword arguments with
`functools.partial` and jit it once over the 1-D `data` mesh. Steps bind a
small `StepSpec` (normalisation statistics, augmentation, loss reduction and
weighting), not the whole config, and never mutate their inputs. Evaluation and scoring share
one eval-mode forward (`eval_step`), so a score is always a function of exactly
the logits that evaluation sees.
"""

import dataclasses
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from cpjax.calibration import losses
from cpjax.data import augment, specs, splits
from cpjax.runtime import sharding
from cpjax.selection import policies, scores

NO_BAD_STEP = np.iinfo(np.int32).max  # `first_bad_step` when every loss was finite.


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training (all arrays: one orbax pytree)."""
  step: jax.Array  # Global step count (int32).
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array  # Key of the training stream; step keys are fold_in(rng, step).


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """What the steps need to know about the data and the loss: nothing else of the config."""
  mean: tuple[float, ...]  # Per-channel normalisation of pixels scaled to [0, 1].
  std: tuple[float, ...]
  num_classes: int
  crop_padding: int = 0  # Train-time random crop padding (0 = no crop).
  flip: bool = False  # Train-time random horizontal flips.
  mixup_alpha: float = 0.0  # Mixup Beta(alpha, alpha) per batch; 0 = off.
  reduction: str = "mean"  # Batch reduction of the per-example loss: mean or sum.
  # Batches carry a per-example loss weight `weight` (infobatch). A static flag, so that every
  # other run compiles exactly the program it compiled before weights existed.
  weighted: bool = False


def step_spec(config: ml_collections.ConfigDict) -> StepSpec:
  """The StepSpec of a run config (its dataset, augmentation and loss reduction)."""
  data = specs.DATASETS[config.dataset.name]
  return StepSpec(mean=data.mean, std=data.std, num_classes=data.num_classes,
                  crop_padding=config.dataset.crop_padding, flip=config.dataset.flip,
                  mixup_alpha=config.loss.mixup_alpha, reduction=config.loss.reduction,
                  weighted=config.selection.method in policies.WEIGHTED_METHODS)


def create_train_state(rng: jax.Array, model: nn.Module, tx: optax.GradientTransformation,
                       image_shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> TrainState:
  """Initialises a replicated TrainState on `mesh` (inside jit: multi-host safe)."""
  init_key, train_key = jax.random.split(rng)

  def init() -> TrainState:
    variables = model.init(init_key, jnp.zeros((1,) + tuple(image_shape)), train=False)
    return TrainState(step=jnp.zeros((), jnp.int32), params=variables["params"],
                      batch_stats=variables["batch_stats"],
                      opt_state=tx.init(variables["params"]), rng=train_key)
  return jax.jit(init, out_shardings=sharding.replicated(mesh))()


def abstract_train_state(model: nn.Module, tx: optax.GradientTransformation,
                         image_shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> TrainState:
  """The shapes, dtypes and (replicated) shardings of a TrainState, computing nothing."""
  shapes = jax.eval_shape(
      lambda: create_train_state(jax.random.PRNGKey(0), model, tx, image_shape, mesh))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding.replicated(mesh)), shapes)


def _with_learning_rate(opt_state: Any, learning_rate: jax.Array) -> Any:
  """A copy of an `optax.inject_hyperparams` state with a new learning rate."""
  return opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": learning_rate})


def train_step(state: TrainState, batch: dict[str, jax.Array], learning_rate: jax.Array,
               loss_hparams: dict[str, jax.Array], *, model: nn.Module,
               tx: optax.GradientTransformation, loss_fn: losses.LossFn,
               score_fn: scores.ScoreFn, spec: StepSpec
               ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
  """One SGD step on a global batch: augment, (mixup,) forward, loss, backward, update.

  Loss: sum_i w_i l_i m_i / sum_i m_i (reduction "sum": not divided); mask m, and weights w
  only if `spec.weighted` (otherwise no w at all, not w = 1).

  Args:
    state: the replicated train state (donated by the loop).
    batch: global batch of image (uint8), label, id, mask (1 = real example), and weight
      (float32 w) if `spec.weighted`.
    learning_rate: this epoch's learning rate.
    loss_hparams: this epoch's scheduled loss hyper-parameters (may be empty).

  Returns:
    The new state; summable metrics of this batch (loss and correct sums,
    example count, the step if its loss was not finite, else NO_BAD_STEP) and
    the global norms of the gradient and of the parameters before the update;
    per-example [B] priority score, confidence and correctness of this same
    pre-update forward pass (the reference's train-pass scores).
  """
  crop_key, mix_key = jax.random.split(jax.random.fold_in(state.rng, state.step))
  images = augment.random_crop_flip(crop_key, batch["image"], spec.crop_padding, spec.flip)
  images = augment.normalize(images, spec.mean, spec.std)
  targets, mask = batch["label"], batch["mask"]
  if spec.mixup_alpha > 0:
    targets = jax.nn.one_hot(targets, spec.num_classes)
    images, targets = augment.mixup(mix_key, images, targets, spec.mixup_alpha)

  def objective(params):
    (logits, _), updates = model.apply(
        {"params": params, "batch_stats": state.batch_stats}, images, train=True,
        mutable=["batch_stats"])
    per_example = loss_fn(logits, targets, **loss_hparams)
    weighted = per_example * batch["weight"] if spec.weighted else per_example
    total = jnp.sum(weighted * mask)
    loss = total if spec.reduction == "sum" else total / jnp.sum(mask)
    return loss, (logits, per_example, updates["batch_stats"])

  (loss, (logits, per_example, batch_stats)), grads = jax.value_and_grad(
      objective, has_aux=True)(state.params)
  opt_state = _with_learning_rate(state.opt_state, learning_rate)
  updates, opt_state = tx.update(grads, opt_state, state.params)
  new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            batch_stats=batch_stats, opt_state=opt_state)
  correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
  batch_metrics = {
      # Unweighted (w left out): train_loss stays the trained rows' mean loss, as for any method.
      "loss_sum": jnp.sum(per_example * mask),
      "correct": jnp.sum(correct * mask),
      "count": jnp.sum(mask),
      "first_bad_step": jnp.where(jnp.isfinite(loss), NO_BAD_STEP, state.step),
      "grad_norm": optax.tree.norm(grads),
      "param_norm": optax.tree.norm(state.params),
  }
  per_example_out = {"score": score_fn(logits, batch["label"]),
                     "confidence": jnp.max(jax.nn.softmax(logits.astype(jnp.float32)), -1),
                     "correct": correct}
  return new_state, batch_metrics, per_example_out


def eval_step(state: TrainState, batch: dict[str, jax.Array], *, model: nn.Module,
              spec: StepSpec) -> jax.Array:
  """Eval-mode logits [B, K] in float32: running BatchNorm statistics, no augmentation."""
  images = augment.normalize(batch["image"], spec.mean, spec.std)
  logits, _ = model.apply({"params": state.params, "batch_stats": state.batch_stats},
                          images, train=False)
  return logits.astype(jnp.float32)


def score_step(state: TrainState, batch: dict[str, jax.Array], *, model: nn.Module,
               spec: StepSpec, score_fn: scores.ScoreFn) -> jax.Array:
  """Priority scores [B] of `eval_step`'s logits (the fresh and target scoring passes)."""
  return score_fn(eval_step(state, batch, model=model, spec=spec), batch["label"])


def predict(fn, state: TrainState, split: splits.Split, mesh: jax.sharding.Mesh,
            batch_size: int) -> np.ndarray:
  """`fn(state, batch)` over every example of `split` once, in row order, on every host.

  The sharded batched forward pass of evaluation and scoring: padded batches
  (mask 0 on padding) go to the mesh, and the per-example outputs (logits
  [N, K], or scores [N]) are gathered; padding rows are dropped.
  """
  rows = sharding.process_rows(mesh, batch_size)
  outputs = []
  for batch in splits.eval_batches(split, batch_size):
    local = {k: v[rows] for k, v in batch.items()}
    outputs.append(fn(state, sharding.to_global(mesh, local, batch_size)))
  return np.concatenate(sharding.to_host(outputs))[:len(split)]
