"""The train state and the jitted steps: train, eval, score, and `predict` over a split.

Every step is a pure function of pytrees; the loop (cpjax.training.train) and the score
sources (cpjax.selection.score_sources) bind its keyword arguments with
`functools.partial` and jit it once over the 1-D `data` mesh. Steps bind a
small `StepSpec` (normalisation statistics, augmentation, loss reduction and
weighting), not the whole config, and never mutate their inputs. The score a
step computes per example is a function passed in (`score_fn`, from
cpjax.selection.scores): the steps know nothing of selection. Evaluation and scoring share
one eval-mode forward (`eval_step`), so a score is always a function of exactly
the logits that evaluation sees.
"""

from collections.abc import Callable
import contextlib
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
from cpjax.calibration.gamma_net import MetaObjective, head_logits
from cpjax.data import augment, readers, specs, splits
from cpjax.runtime import sharding

# A per-example score of logits [B, K] and labels [B] -> [B] (cpjax.selection.scores).
ScoreFn = Callable[[jax.Array, jax.Array], jax.Array]
NO_BAD_STEP = np.iinfo(np.int32).max  # `first_bad_step` when every loss was finite.


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training (all arrays: one orbax pytree)."""
  step: jax.Array  # Global step count (int32).
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array  # Key of the training stream; step keys are fold_in(rng, step).


@flax.struct.dataclass
class MetaTrainState(TrainState):
  """A TrainState plus gamma-Net's parameters phi and their optimizer (Adam) state: the train
  state of FL_gamma runs, checkpointed and restored whole, so exact resume covers phi."""
  meta_params: Any
  meta_opt_state: Any


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


def step_spec(dataset: ml_collections.ConfigDict, loss: ml_collections.ConfigDict | None = None,
              weighted: bool = False) -> StepSpec:
  """The StepSpec of a run's config sections.

  Args:
    dataset: config.dataset (normalisation, classes, augmentation).
    loss: config.loss (mixup, reduction), for the train steps; None for the eval-mode
      steps (evaluation, scoring), which use neither.
    weighted: batches carry loss weights (the selection policy's choice: Selector.weighted).
  """
  data = specs.DATASETS[dataset.name]
  train_parts = {} if loss is None else {"mixup_alpha": loss.mixup_alpha,
                                         "reduction": loss.reduction}
  # A source dataset's images are flipped with their crops, where they are decoded
  # (cpjax.data.preprocess's boxes and flips, on the host or on the devices).
  return StepSpec(mean=data.mean, std=data.std, num_classes=data.num_classes,
                  crop_padding=dataset.crop_padding, flip=dataset.flip and not data.encoded,
                  weighted=weighted,
                  **train_parts)


def create_train_state(rng: jax.Array, model: nn.Module, tx: optax.GradientTransformation,
                       image_shape: tuple[int, ...], mesh: jax.sharding.Mesh,
                       meta: tuple[nn.Module, optax.GradientTransformation] | None = None
                       ) -> TrainState:
  """Initialises a replicated TrainState on `mesh` (inside jit: multi-host safe).

  With `meta` = (gamma-Net, its optimizer), a MetaTrainState whose phi is initialised on
  the model's features of a blank image, from a key of its own (fold_in(rng, 1)).
  """
  init_key, train_key = jax.random.split(rng)

  def init() -> TrainState:
    blank = jnp.zeros((1,) + tuple(image_shape))
    variables = model.init(init_key, blank, train=False)
    fields = dict(step=jnp.zeros((), jnp.int32), params=variables["params"],
                  # A user's module without BatchNorm has none (cpjax.models.custom).
                  batch_stats=variables.get("batch_stats", {}),
                  opt_state=tx.init(variables["params"]), rng=train_key)
    if meta is None:
      return TrainState(**fields)
    gamma_net, meta_tx = meta
    _, features = model.apply(variables, blank, train=False)
    phi = gamma_net.init(jax.random.fold_in(rng, 1), features)["params"]
    return MetaTrainState(**fields, meta_params=phi, meta_opt_state=meta_tx.init(phi))
  return jax.jit(init, out_shardings=sharding.replicated(mesh))()


def abstract_train_state(model: nn.Module, tx: optax.GradientTransformation,
                         image_shape: tuple[int, ...], mesh: jax.sharding.Mesh,
                         meta: tuple[nn.Module, optax.GradientTransformation] | None = None
                         ) -> TrainState:
  """The shapes, dtypes and (replicated) shardings of a (Meta)TrainState, computing nothing."""
  shapes = jax.eval_shape(
      lambda: create_train_state(jax.random.PRNGKey(0), model, tx, image_shape, mesh, meta))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=sharding.replicated(mesh)), shapes)


def _with_learning_rate(opt_state: Any, learning_rate: jax.Array) -> Any:
  """A copy of an `optax.inject_hyperparams` state with a new learning rate."""
  return opt_state._replace(hyperparams={**opt_state.hyperparams, "learning_rate": learning_rate})


def train_step(state: TrainState, batch: dict[str, jax.Array], learning_rate: jax.Array,
               loss_hparams: dict[str, jax.Array], *, model: nn.Module,
               tx: optax.GradientTransformation, loss_fn: losses.LossFn,
               score_fn: ScoreFn, spec: StepSpec
               ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
  """One SGD step on a global batch: augment, (mixup,) forward, loss, backward, update.

  Loss: sum_i w_i l_i m_i / sum_i m_i (reduction "sum": not divided); mask m, and weights w
  only if `spec.weighted` (otherwise no w at all, not w = 1).

  Args:
    state: the replicated train state (donated by the loop).
    batch: global batch of image (uint8), label, id, mask (1 = real example), and weight
      (float32 w) if `spec.weighted`; or what the step gathers it from on the devices
      (readers.DeviceReader.train_batches: `readers.gathered`).
    learning_rate: this epoch's learning rate.
    loss_hparams: this epoch's scheduled loss hyper-parameters (may be empty).

  Returns:
    The new state; summable metrics of this batch (loss and correct sums,
    example count, the step if its loss was not finite, else NO_BAD_STEP) and
    the global norms of the gradient and of the parameters before the update;
    per-example [B] priority score, confidence and correctness of this same
    pre-update forward pass (the reference's train-pass scores).
  """
  batch = readers.gathered(batch)  # In this program: one dispatch a step, not two.
  crop_key, mix_key = jax.random.split(jax.random.fold_in(state.rng, state.step))
  images = _augmented(crop_key, batch["image"], spec)
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
    return _reduce(weighted, mask, spec), (logits, per_example, updates.get("batch_stats", {}))

  (loss, (logits, per_example, batch_stats)), grads = jax.value_and_grad(
      objective, has_aux=True)(state.params)
  new_state = _sgd_update(state, grads, batch_stats, learning_rate, tx)
  return new_state, *_step_outputs(state, batch, logits, per_example, loss, grads, score_fn)


def _augmented(key: jax.Array, images: jax.Array, spec: StepSpec) -> jax.Array:
  """Train-time crop and flip, then normalisation."""
  images = augment.random_crop_flip(key, images, spec.crop_padding, spec.flip)
  return augment.normalize(images, spec.mean, spec.std)


def _reduce(per_example: jax.Array, mask: jax.Array, spec: StepSpec) -> jax.Array:
  """sum_i l_i m_i, divided by sum_i m_i under reduction "mean"."""
  total = jnp.sum(per_example * mask)
  return total if spec.reduction == "sum" else total / jnp.sum(mask)


def _sgd_update(state: TrainState, grads: Any, batch_stats: Any, learning_rate: jax.Array,
                tx: optax.GradientTransformation) -> TrainState:
  """The state after one optimizer step with `grads` at `learning_rate`."""
  opt_state = _with_learning_rate(state.opt_state, learning_rate)
  updates, opt_state = tx.update(grads, opt_state, state.params)
  return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                       batch_stats=batch_stats, opt_state=opt_state)


def _step_outputs(state: TrainState, batch: dict[str, jax.Array], logits: jax.Array,
                  per_example: jax.Array, loss: jax.Array, grads: Any,
                  score_fn: ScoreFn) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """A train step's summable batch metrics and per-example outputs (see `train_step`)."""
  mask = batch["mask"]
  confidence, correct = _confidence_and_correct(logits, batch["label"])
  batch_metrics = {
      # Unweighted (w left out): train_loss stays the trained rows' mean loss, as for any method.
      "loss_sum": jnp.sum(per_example * mask),
      "correct": jnp.sum(correct * mask),
      "count": jnp.sum(mask),
      "first_bad_step": jnp.where(jnp.isfinite(loss), NO_BAD_STEP, state.step),
      "grad_norm": optax.tree.norm(grads),
      "param_norm": optax.tree.norm(state.params),
  }
  per_example_out = {"score": score_fn(logits, batch["label"]), "confidence": confidence,
                     "correct": correct}
  return batch_metrics, per_example_out


def _confidence_and_correct(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per example: the top-class probability (float32 softmax) and 1.0 where it is the label."""
  confidence = jnp.max(jax.nn.softmax(logits.astype(jnp.float32)), axis=-1)
  return confidence, (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)


def lookahead_head(head: dict[str, jax.Array], features: jax.Array, labels: jax.Array,
                   mask: jax.Array, gamma: jax.Array, learning_rate: jax.Array,
                   spec: StepSpec) -> dict[str, jax.Array]:
  """One SGD step of the classifier head alone on the focal loss with per-example `gamma`,
  the features fixed: head - lr grad_head L, L = the reduced FL(features head, y; gamma)
  (docs/methods.md#meta-calibration-step, step 2; differentiable in gamma, so phi gets a
  meta-gradient through it)."""
  def loss(h):
    per_example = losses.focal_loss(head_logits(features, h), labels, gamma)
    return _reduce(per_example, mask, spec)
  return jax.tree.map(lambda w, g: w - learning_rate * g, head, jax.grad(loss)(head))


def meta_train_step(state: MetaTrainState, batch: dict[str, jax.Array],
                    learning_rate: jax.Array, loss_hparams: dict[str, jax.Array], *,
                    model: nn.Module, gamma_net: nn.Module, tx: optax.GradientTransformation,
                    meta_tx: optax.GradientTransformation, objective: MetaObjective,
                    score_fn: ScoreFn, spec: StepSpec, leak_meta_gradient: bool = False
                    ) -> tuple[MetaTrainState, dict[str, jax.Array], dict[str, jax.Array]]:
  """One bilevel step of FL_gamma with a meta-learned gamma (docs/methods.md#meta-calibration-step:
  the Meta-Calibration scheme of Bohdal et al. 2023 as Wang & Golebiowski 2024 extend it):

  1. train-mode forward of the train batch: logits z, features x (BatchNorm statistics
     updated as in `train_step`);
  2. gamma = gammaNet_phi(x); look-ahead of the classifier head only, with the backbone
     fixed: head' = head - lr grad_head L(head, phi), L the reduced focal loss
     FL(x head, y; gamma) over the batch;
  3. meta-validation batch forward (train-mode BatchNorm on its own statistics, not kept),
     meta-loss M = objective(x_v head', y_v) (s-ECE or DECE, optionally + CE);
  4. phi <- meta_tx step on grad_phi M (a second-order gradient through the look-ahead);
  5. theta <- tx step on grad_theta FL(z, y; gamma), gamma from the updated phi held
     constant (stop-gradient): the backbone never sees the meta-validation batch.

  `leak_meta_gradient` reproduces the reference code's quirk instead: theta's gradient also
  holds grad_theta M (its gradient buffer is not zeroed between the meta and the main
  backward pass), so the model partly trains on the meta-validation batch. Off by default.

  Args:
    state: the train state with phi and its optimizer state (donated by the loop).
    batch: as in `train_step` (no mixup, no loss weights), plus "meta_image" and "meta_label":
      a full global batch (no padding) of the meta-validation split.
    learning_rate: as in `train_step`; also the look-ahead's step size.
    loss_hparams: unused (FL_gamma has no scheduled hyper-parameter); the loop's signature.

  Returns:
    (state, batch metrics of `train_step` plus "meta_loss" and "gamma_sum" (sum of the masked
    gammas), per-example outputs of `train_step`).
  """
  del loss_hparams
  batch = readers.gathered(batch)
  crop_key, _ = jax.random.split(jax.random.fold_in(state.rng, state.step))
  images = _augmented(crop_key, batch["image"], spec)
  labels, mask = batch["label"], batch["mask"]
  variables = {"params": state.params, "batch_stats": state.batch_stats}

  def forward(params):
    (logits, features), updates = model.apply({**variables, "params": params}, images,
                                              train=True, mutable=["batch_stats"])
    return (logits, features), updates.get("batch_stats", {})

  (logits, features), backward, batch_stats = jax.vjp(forward, state.params, has_aux=True)
  meta_images = augment.normalize(batch["meta_image"], spec.mean, spec.std)

  def meta_loss(phi, params, train_features):
    """M as a function of phi (and, for the leak only, of theta through both forwards)."""
    gamma = gamma_net.apply({"params": phi}, train_features)
    head = lookahead_head(params["head"], train_features, labels, mask, gamma,
                          learning_rate, spec)
    (_, meta_features), _ = model.apply({**variables, "params": params}, meta_images,
                                        train=True, mutable=["batch_stats"])
    return objective(head_logits(meta_features, head), batch["meta_label"])

  meta_value, meta_grads = jax.value_and_grad(meta_loss)(state.meta_params, state.params,
                                                         features)
  meta_updates, meta_opt_state = meta_tx.update(meta_grads, state.meta_opt_state,
                                                state.meta_params)
  new_phi = optax.apply_updates(state.meta_params, meta_updates)
  gamma = jax.lax.stop_gradient(gamma_net.apply({"params": new_phi}, features))

  def train_loss(z):
    per_example = losses.focal_loss(z, labels, gamma)
    return _reduce(per_example, mask, spec), per_example

  (loss, per_example), logits_grad = jax.value_and_grad(train_loss, has_aux=True)(logits)
  (grads,) = backward((logits_grad, jnp.zeros_like(features)))
  if leak_meta_gradient:
    leaked = jax.grad(lambda p: meta_loss(state.meta_params, p, forward(p)[0][1]))(state.params)
    grads = jax.tree.map(jnp.add, grads, leaked)
  new_state = _sgd_update(state, grads, batch_stats, learning_rate, tx).replace(
      meta_params=new_phi, meta_opt_state=meta_opt_state)
  batch_metrics, per_example_out = _step_outputs(state, batch, logits, per_example, loss, grads,
                                                 score_fn)
  batch_metrics.update(meta_loss=meta_value, gamma_sum=jnp.sum(gamma * mask))
  return new_state, batch_metrics, per_example_out


def _eval_forward(state: TrainState, batch: dict[str, jax.Array], model: nn.Module,
                  spec: StepSpec) -> tuple[jax.Array, jax.Array]:
  """Eval-mode (float32 logits [B, K], penultimate features [B, d]): running BatchNorm
  statistics, no augmentation."""
  images = augment.normalize(batch["image"], spec.mean, spec.std)
  logits, features = model.apply({"params": state.params, "batch_stats": state.batch_stats},
                                 images, train=False)
  return logits.astype(jnp.float32), features


def eval_step(state: TrainState, batch: dict[str, jax.Array], *, model: nn.Module,
              spec: StepSpec) -> jax.Array:
  """Eval-mode logits [B, K] in float32: running BatchNorm statistics, no augmentation."""
  return _eval_forward(state, batch, model, spec)[0]


def gamma_step(state: MetaTrainState, batch: dict[str, jax.Array], *, model: nn.Module,
               gamma_net: nn.Module, spec: StepSpec) -> jax.Array:
  """[B, 2] per example of an FL_gamma run: gamma-Net's gamma on the eval-mode features, and
  1.0 where the top class is the label (the report's gamma by correctness)."""
  logits, features = _eval_forward(state, batch, model, spec)
  gamma = gamma_net.apply({"params": state.meta_params}, features)
  return jnp.stack([gamma, _confidence_and_correct(logits, batch["label"])[1]], axis=-1)


def score_step(state: TrainState, batch: dict[str, jax.Array], *, model: nn.Module,
               spec: StepSpec, score_fn: ScoreFn) -> jax.Array:
  """Priority scores [B] of `eval_step`'s logits (the fresh and target scoring passes)."""
  return score_fn(eval_step(state, batch, model=model, spec=spec), batch["label"])


def scoring_pass_step(state: TrainState, batch: dict[str, jax.Array], *, model: nn.Module,
                      spec: StepSpec, score_fn: ScoreFn) -> jax.Array:
  """[B, 3] per example: `score_step`'s score, the top-class probability and 1.0 where the
  top class is the label. One forward pass gives a scoring pass both the ranking and the
  scorer's own calibration on the rows it picks (the `scorer_ece` diagnostic)."""
  logits = eval_step(state, batch, model=model, spec=spec)
  confidence, correct = _confidence_and_correct(logits, batch["label"])
  return jnp.stack([score_fn(logits, batch["label"]), confidence, correct], axis=-1)


def predict(fn, state: TrainState, data: splits.Split | readers.Reader,
            mesh: jax.sharding.Mesh, batch_size: int) -> np.ndarray:
  """`fn(state, batch)` over every example of `data` once, in row order, on every host.

  The sharded batched forward pass of evaluation and scoring: padded batches
  (mask 0 on padding) go to the mesh, and the per-example outputs (logits
  [N, K], or scores [N]) are gathered; padding rows are dropped. `data` is a
  reader (cpjax.data.readers: the run's device or host reader) or a host split.
  """
  with contextlib.closing(_predict_batches(data, mesh, batch_size)) as batches:
    outputs = [fn(state, batch) for batch in batches]
  return np.concatenate(sharding.to_host(outputs))[:len(data)]


def _predict_batches(data: splits.Split | readers.Reader, mesh: jax.sharding.Mesh,
                     batch_size: int):
  """`predict`'s padded batches of `data`, in row order."""
  reader = data if isinstance(data, readers.Reader) else readers.Reader(data, mesh)
  rows, masks = (np.stack(parts) for parts in zip(*splits.eval_rows(len(reader), batch_size)))
  return reader.batches(rows, masks)


def first_predict_batch(data: splits.Split | readers.Reader, mesh: jax.sharding.Mesh,
                        batch_size: int) -> dict[str, jax.Array]:
  """The first batch `predict` gives its `fn` (its structure, shapes and shardings: a program
  compiled ahead for it is the one `predict` calls)."""
  with contextlib.closing(_predict_batches(data, mesh, batch_size)) as batches:
    return next(iter(batches))
