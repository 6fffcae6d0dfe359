"""Train state, the jitted train and eval steps, and the training loop.

`train_and_evaluate(config, workdir)` is the one entry point: it validates the
config, resumes from the latest checkpoint in `workdir` if there is one, trains
epoch by epoch, evaluates, logs and checkpoints. The steps are pure functions
of pytrees, jitted once over a 1-D `data` mesh with the state donated.
"""

import functools
import logging
import os
import tempfile
import time
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from cpjax import augment, checkpointing, config_validation, input_pipeline
from cpjax import losses, metrics, models, optim, run_logging, sharding


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training (all arrays: one orbax pytree)."""
  step: jax.Array  # Global step count (int32).
  params: Any
  batch_stats: Any
  opt_state: Any
  rng: jax.Array  # Key of the training stream; step keys are fold_in(rng, step).


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


def train_step(state: TrainState, batch: dict[str, jax.Array], learning_rate: jax.Array,
               loss_hparams: dict[str, jax.Array], *, model: nn.Module,
               tx: optax.GradientTransformation, loss_fn: losses.LossFn,
               config: ml_collections.ConfigDict) -> tuple[TrainState, dict[str, jax.Array]]:
  """One SGD step on a global batch: augment, (mixup,) forward, loss, backward, update.

  Args:
    state: the replicated train state (donated).
    batch: global batch of image, label, id, mask.
    learning_rate: this epoch's learning rate.
    loss_hparams: this epoch's scheduled loss hyper-parameters (may be empty).

  Returns:
    The new state and summable metrics of this batch (loss and correct sums,
    example count, and the step if its loss was not finite).
  """
  spec = input_pipeline.DATASETS[config.dataset.name]
  crop_key, mix_key = jax.random.split(jax.random.fold_in(state.rng, state.step))
  images = augment.random_crop_flip(crop_key, batch["image"], config.dataset.crop_padding,
                                    config.dataset.flip)
  images = augment.normalize(images, spec.mean, spec.std)
  targets, mask = batch["label"], batch["mask"]
  if config.loss.mixup_alpha > 0:
    targets = jax.nn.one_hot(targets, spec.num_classes)
    images, targets = augment.mixup(mix_key, images, targets, config.loss.mixup_alpha)

  def objective(params):
    (logits, _), updates = model.apply(
        {"params": params, "batch_stats": state.batch_stats}, images, train=True,
        mutable=["batch_stats"])
    per_example = loss_fn(logits, targets, **loss_hparams)
    total = jnp.sum(per_example * mask)
    loss = total if config.loss.reduction == "sum" else total / jnp.sum(mask)
    return loss, (logits, per_example, updates["batch_stats"])

  (loss, (logits, per_example, batch_stats)), grads = jax.value_and_grad(
      objective, has_aux=True)(state.params)
  opt_state = state.opt_state
  opt_state.hyperparams["learning_rate"] = learning_rate
  updates, opt_state = tx.update(grads, opt_state, state.params)
  new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                            batch_stats=batch_stats, opt_state=opt_state)
  batch_metrics = {
      "loss_sum": jnp.sum(per_example * mask),
      "correct": jnp.sum((jnp.argmax(logits, -1) == batch["label"]) * mask),
      "count": jnp.sum(mask),
      "first_bad_step": jnp.where(jnp.isfinite(loss), jnp.iinfo(jnp.int32).max, state.step),
  }
  return new_state, batch_metrics


@jax.jit
def _accumulate(totals: dict[str, jax.Array], batch_metrics: dict[str, jax.Array]):
  """Sums batch metrics on device (min for the first non-finite step)."""
  return {k: jnp.minimum(v, batch_metrics[k]) if k == "first_bad_step" else v + batch_metrics[k]
          for k, v in totals.items()}


def eval_step(state: TrainState, batch: dict[str, jax.Array], *, model: nn.Module,
              config: ml_collections.ConfigDict) -> jax.Array:
  """Eval-mode logits (running BatchNorm statistics, no augmentation), float32."""
  spec = input_pipeline.DATASETS[config.dataset.name]
  images = augment.normalize(batch["image"], spec.mean, spec.std)
  logits, _ = model.apply({"params": state.params, "batch_stats": state.batch_stats},
                          images, train=False)
  return logits.astype(jnp.float32)


def predict(eval_fn, state: TrainState, split: input_pipeline.Split, mesh,
            batch_size: int) -> np.ndarray:
  """Logits [N, K] of every example of `split`, in row order, on every host."""
  rows = sharding.process_rows(mesh, batch_size)
  outputs = []
  for batch in input_pipeline.eval_batches(split, batch_size):
    local = {k: v[rows] for k, v in batch.items()}
    outputs.append(eval_fn(state, sharding.to_global(mesh, local, batch_size)))
  logits = np.concatenate(sharding.to_host(outputs))
  return logits[:len(split)]


def evaluate(eval_fn, state, splits, mesh, batch_size: int) -> dict[str, float]:
  """Accuracy and NLL of the validation and test splits."""
  results = {}
  for name in ("val", "test"):
    logits = predict(eval_fn, state, splits[name], mesh, batch_size)
    labels = splits[name].labels
    results[f"{name}_accuracy"] = metrics.accuracy(logits, labels)
    results[f"{name}_nll"] = metrics.nll(logits, labels)
  return results


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or infinite."""


def _raise_if_bad(totals, epoch: int, epoch_start_step: int, checkpoint_dir: str) -> None:
  bad = int(jax.device_get(totals["first_bad_step"]))
  if bad != np.iinfo(np.int32).max:
    raise NonFiniteLossError(
        f"non-finite training loss at epoch {epoch}, step {bad - epoch_start_step} of the "
        f"epoch (global step {bad}); the run stopped and the last good checkpoint in "
        f"{checkpoint_dir} is intact. Lower the learning rate or enable gradient clipping.")


def train_epoch(train_fn, state, split, epoch, config, mesh, report, checkpoint_dir):
  """Trains one epoch over `split` in the epoch's deterministic order."""
  order = input_pipeline.epoch_order(config.seed, epoch, np.arange(len(split)), config.batch_size)
  rows = sharding.process_rows(mesh, config.batch_size)
  learning_rate = np.float32(optim.learning_rate_at(config.optimizer, epoch, config.num_epochs))
  loss_hparams = {k: np.float32(v) for k, v in losses.scheduled_hparams(config.loss, epoch).items()}
  epoch_start_step = int(jax.device_get(state.step))
  totals = None
  for i, batch_rows in enumerate(order):
    batch = sharding.to_global(mesh, input_pipeline.batch_at(split, batch_rows[rows]),
                               config.batch_size)
    state, batch_metrics = train_fn(state, batch, learning_rate, loss_hparams)
    totals = batch_metrics if totals is None else _accumulate(totals, batch_metrics)
    report(epoch_start_step + i + 1)
    if (i + 1) % config.log_every_steps == 0:
      _raise_if_bad(totals, epoch, epoch_start_step, checkpoint_dir)
  _raise_if_bad(totals, epoch, epoch_start_step, checkpoint_dir)
  totals = jax.device_get(totals)
  return state, {"train_loss": float(totals["loss_sum"] / totals["count"]),
                 "train_accuracy": float(totals["correct"] / totals["count"]),
                 "learning_rate": float(learning_rate),
                 **{k: float(v) for k, v in loss_hparams.items()}}


def _check_workdir(workdir: str) -> None:
  """Fails early, before any data load or compile, if `workdir` is unusable."""
  try:
    os.makedirs(workdir, exist_ok=True)
    tempfile.NamedTemporaryFile(dir=workdir).close()  # Can we create files here?
  except OSError as err:
    raise PermissionError(f"--workdir {workdir!r} is not a writable directory: {err}") from err


def _resume(checkpointer, state, config) -> tuple[TrainState, int]:
  """Restores the latest checkpoint if any: returns (state, first epoch to run)."""
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  restored = checkpointer.restore_latest(abstract)
  if restored is None:
    return state, 0
  state, meta = restored
  if meta["config"] != config.to_json_best_effort(sort_keys=True):
    logging.warning("Resuming with a config that differs from the checkpoint's.")
  logging.info("Resumed from %s after epoch %d.", checkpointer.directory, meta["epoch"])
  return state, meta["epoch"]


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains and evaluates `config`, resuming from `workdir` if it has checkpoints.

  Args:
    config: run configuration (see configs/default.py); validated first.
    workdir: directory for checkpoints, TensorBoard events and metrics.jsonl.

  Returns:
    The last epoch's metrics record.
  """
  config_validation.validate(config)
  _check_workdir(workdir)
  mesh = sharding.create_mesh()
  spec = input_pipeline.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, spec.num_classes, config.model.dtype)
  tx = optim.create_optimizer(config.optimizer)
  state = create_train_state(jax.random.PRNGKey(config.seed), model, tx, spec.image_shape, mesh)
  checkpointer = checkpointing.Checkpointer(workdir, config.keep_checkpoints)
  state, start_epoch = _resume(checkpointer, state, config)
  splits = input_pipeline.get_datasets(config.dataset)

  train_fn = jax.jit(functools.partial(train_step, model=model, tx=tx, config=config,
                                       loss_fn=losses.get_loss(config.loss)),
                     donate_argnums=0)
  eval_fn = jax.jit(functools.partial(eval_step, model=model, config=config))
  writer = run_logging.create_writer(workdir)
  epoch_log = run_logging.EpochLog(workdir)
  epoch_log.keep_epochs_before(start_epoch)
  steps_per_epoch = -(-len(splits["train"]) // config.batch_size)
  report = run_logging.create_progress_reporter(config.num_epochs * steps_per_epoch, writer)
  if start_epoch == 0:
    writer.write_hparams({"config": config.to_json_best_effort()})

  try:
    return _run_epochs(state, start_epoch, config, splits, mesh, train_fn, eval_fn, writer,
                       epoch_log, report, checkpointer)
  finally:  # Also on errors: the last good checkpoint must finish writing.
    checkpointer.wait_until_finished()
    writer.flush()


def _run_epochs(state, start_epoch, config, splits, mesh, train_fn, eval_fn, writer,
                epoch_log, report, checkpointer) -> dict[str, Any]:
  """The epoch loop: train, evaluate when due, log, checkpoint when due."""
  record = {}
  for epoch in range(start_epoch, config.num_epochs):
    start = time.time()
    with report.timed("train", wait_jax_async_dispatch=False):
      state, record = train_epoch(train_fn, state, splits["train"], epoch, config, mesh,
                                  report, checkpointer.directory)
    last = epoch + 1 == config.num_epochs
    if (epoch + 1) % config.eval_every_epochs == 0 or last:
      record.update(evaluate(eval_fn, state, splits, mesh, config.eval_batch_size))
    record.update(epoch=epoch, epoch_seconds=time.time() - start)
    writer.write_scalars(int(jax.device_get(state.step)), record)
    epoch_log.write(record)
    if (epoch + 1) % config.checkpoint_every_epochs == 0 or last:
      checkpointer.save(epoch + 1, state, {
          "epoch": epoch + 1, "config": config.to_json_best_effort(sort_keys=True)})
  return record
