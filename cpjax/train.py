"""Train state, the jitted train and eval steps, and the training loop.

`train_and_evaluate(config, workdir)` is the one entry point: it validates the
config, resumes from the latest checkpoint in `workdir` if there is one, trains
epoch by epoch, evaluates, logs and checkpoints. The steps are pure functions
of pytrees, jitted once over a 1-D `data` mesh with the state donated.
"""

import dataclasses
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

from cpjax import augment, checkpointing, compiler_options, config_validation, corruptions
from cpjax import input_pipeline
from cpjax import losses, models, optim, prioritization, report, run_logging, scoring
from cpjax import sharding


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
               score_fn: scoring.ScoreFn, config: ml_collections.ConfigDict
               ) -> tuple[TrainState, dict[str, jax.Array], dict[str, jax.Array]]:
  """One SGD step on a global batch: augment, (mixup,) forward, loss, backward, update.

  Args:
    state: the replicated train state (donated).
    batch: global batch of image, label, id, mask.
    learning_rate: this epoch's learning rate.
    loss_hparams: this epoch's scheduled loss hyper-parameters (may be empty).

  Returns:
    The new state, summable metrics of this batch (loss and correct sums,
    example count, and the step if its loss was not finite), and per-example
    [B] priority score, confidence and correctness of the pre-update pass.
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
  correct = (jnp.argmax(logits, -1) == batch["label"]).astype(jnp.float32)
  batch_metrics = {
      "loss_sum": jnp.sum(per_example * mask),
      "correct": jnp.sum(correct * mask),
      "count": jnp.sum(mask),
      "first_bad_step": jnp.where(jnp.isfinite(loss), jnp.iinfo(jnp.int32).max, state.step),
  }
  # Per example, from this same pre-update forward pass (the reference's train-pass scores).
  per_example_out = {"score": score_fn(logits, batch["label"]),
                     "confidence": jnp.max(jax.nn.softmax(logits.astype(jnp.float32)), -1),
                     "correct": correct}
  return new_state, batch_metrics, per_example_out


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


def evaluate(eval_fn, state, splits, mesh, config) -> dict[str, float]:
  """Accuracy, NLL and the ECE family of the validation and test splits."""
  num_classes = input_pipeline.DATASETS[config.dataset.name].num_classes
  results = {}
  for name in ("val", "test"):
    logits = sharding.predict(eval_fn, state, splits[name], mesh, config.eval_batch_size)
    values = report.calibration_metrics(logits, splits[name].labels, num_classes,
                                        config.evaluation.num_bins)
    results.update({f"{name}_{metric}": value for metric, value in values.items()})
  return results


def _ood_split(config, splits) -> input_pipeline.Split | None:
  """The OOD set of the report: a corrupted test set, another dataset, or none."""
  if not config.evaluation.ood:
    return None
  test = splits["test"]
  if config.evaluation.ood == "gaussian_noise":
    return dataclasses.replace(test, images=corruptions.gaussian_noise(
        test.images, config.evaluation.ood_severity))
  return input_pipeline.get_test_split(config.dataset, config.evaluation.ood)


def write_final_report(eval_fn, state, splits, mesh, config, workdir: str,
                       epoch: int) -> dict[str, Any]:
  """Builds the calibration report of `state` and writes it to workdir/report."""
  def logits_of(split):
    return sharding.predict(eval_fn, state, split, mesh, config.eval_batch_size)
  ood = _ood_split(config, splits)
  results = report.build_report(
      (logits_of(splits["val"]), splits["val"].labels),
      (logits_of(splits["test"]), splits["test"].labels),
      input_pipeline.DATASETS[config.dataset.name].num_classes, config.evaluation,
      None if ood is None else logits_of(ood))
  results.update(title=f"{config.dataset.name}, {config.model.name}, {config.loss.name}, "
                       f"after epoch {epoch}", epoch=epoch)
  if jax.process_index() == 0:
    paths = report.write_report(os.path.join(workdir, "report"), results)
    logging.info("Wrote the calibration report: %s", ", ".join(paths))
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


def train_epoch(train_fn, state, split, rows, epoch, config, mesh, report_progress,
                checkpoint_dir):
  """Trains one epoch over `rows` of `split` in the epoch's deterministic order.

  Returns:
    (state, epoch record, order [steps, B] of the rows trained, per-example
    train-pass outputs flattened in that order).
  """
  order = input_pipeline.epoch_order(config.seed, epoch, rows, config.batch_size)
  local_rows = sharding.process_rows(mesh, config.batch_size)
  learning_rate = np.float32(optim.learning_rate_at(config.optimizer, epoch, config.num_epochs))
  loss_hparams = {k: np.float32(v) for k, v in losses.scheduled_hparams(config.loss, epoch).items()}
  epoch_start_step = int(jax.device_get(state.step))
  totals, outputs = None, []
  for i, batch_rows in enumerate(order):
    batch = sharding.to_global(mesh, input_pipeline.batch_at(split, batch_rows[local_rows]),
                               config.batch_size)
    state, batch_metrics, per_example = train_fn(state, batch, learning_rate, loss_hparams)
    totals = batch_metrics if totals is None else _accumulate(totals, batch_metrics)
    outputs.append(per_example)
    report_progress(epoch_start_step + i + 1)
    if (i + 1) % config.log_every_steps == 0:
      _raise_if_bad(totals, epoch, epoch_start_step, checkpoint_dir)
  _raise_if_bad(totals, epoch, epoch_start_step, checkpoint_dir)
  totals = jax.device_get(totals)
  per_example = {k: np.concatenate([np.asarray(v) for v in sharding.to_host([o[k] for o in outputs])])
                 for k in outputs[0]}
  record = {"train_loss": float(totals["loss_sum"] / totals["count"]),
            "train_accuracy": float(totals["correct"] / totals["count"]),
            "learning_rate": float(learning_rate),
            **{k: float(v) for k, v in loss_hparams.items()}}
  return state, record, order, per_example


def _check_workdir(workdir: str) -> None:
  """Fails early, before any data load or compile, if `workdir` is unusable."""
  try:
    os.makedirs(workdir, exist_ok=True)
    tempfile.NamedTemporaryFile(dir=workdir).close()  # Can we create files here?
  except OSError as err:
    raise PermissionError(f"--workdir {workdir!r} is not a writable directory: {err}") from err


def _resume(checkpointer, saved, config) -> tuple[dict[str, Any], int]:
  """Restores the latest checkpoint if any: returns (saved tree, first epoch to run)."""
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), saved)
  restored = checkpointer.restore_latest(abstract)
  if restored is None:
    return saved, 0
  saved, meta = restored
  if meta["config"] != config.to_json_best_effort(sort_keys=True):
    logging.warning("Resuming with a config that differs from the checkpoint's.")
  logging.info("Resumed from %s after epoch %d.", checkpointer.directory, meta["epoch"])
  return saved, meta["epoch"]


@dataclasses.dataclass
class _Run:
  """What training and evaluate-only share: mesh, model, jitted eval, state."""
  mesh: jax.sharding.Mesh
  model: nn.Module
  tx: optax.GradientTransformation
  state: TrainState
  selection: dict[str, np.ndarray]  # Host copy of the prioritization state.
  start_epoch: int
  checkpointer: checkpointing.Checkpointer
  splits: dict[str, input_pipeline.Split]
  eval_fn: Any


def _start(config: ml_collections.ConfigDict, workdir: str) -> _Run:
  """Validates, builds the model and state, resumes, and reads the data."""
  config_validation.validate(config)
  if config.selection.target_workdir:
    prioritization.check_target(config)
  _check_workdir(workdir)
  mesh = sharding.create_mesh()
  spec = input_pipeline.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, spec.num_classes, config.model.dtype)
  tx = optim.create_optimizer(config.optimizer)
  saved = {"train": create_train_state(jax.random.PRNGKey(config.seed), model, tx,
                                       spec.image_shape, mesh),
           "selection": sharding.replicate(mesh, prioritization.initial_state(
               input_pipeline.num_train_examples(config.dataset)))}
  checkpointer = checkpointing.Checkpointer(workdir, config.keep_checkpoints)
  saved, start_epoch = _resume(checkpointer, saved, config)
  eval_fn = jax.jit(functools.partial(eval_step, model=model, config=config),
                    compiler_options=compiler_options.compiler_options(
                        "inference", config.xla_cpu_options))
  return _Run(mesh, model, tx, saved["train"], jax.tree.map(np.asarray, saved["selection"]),
              start_epoch, checkpointer, input_pipeline.get_datasets(config.dataset), eval_fn)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains and evaluates `config`, resuming from `workdir` if it has checkpoints.

  With `config.selection.method` other than "full", epochs after the warm-up
  train on a prioritized subset (cpjax.prioritization). At the end, the
  calibration report (before/after temperature scaling, bootstrap intervals,
  OOD AUROC, reliability diagrams) goes to `workdir/report`.

  Args:
    config: run configuration (see configs/default.py); validated first.
    workdir: directory for checkpoints, TensorBoard events and metrics.jsonl.

  Returns:
    The last epoch's metrics record.
  """
  run = _start(config, workdir)
  train_fn = jax.jit(functools.partial(train_step, model=run.model, tx=run.tx, config=config,
                                       loss_fn=losses.get_loss(config.loss),
                                       score_fn=scoring.SCORES[config.selection.score]),
                     donate_argnums=0, compiler_options=compiler_options.compiler_options(
                         "train", config.xla_cpu_options))
  prioritizer = prioritization.Prioritizer(config, run.splits["train"], run.mesh, run.model,
                                           create_train_state)
  writer = run_logging.create_writer(workdir)
  epoch_log = run_logging.EpochLog(workdir)
  epoch_log.keep_epochs_before(run.start_epoch)
  total_steps = sum(prioritizer.steps_in_epoch(e) for e in range(config.num_epochs))
  report_progress = run_logging.create_progress_reporter(total_steps, writer)
  if run.start_epoch == 0:
    writer.write_hparams({"config": config.to_json_best_effort()})
  try:
    return _run_epochs(run, config, train_fn, prioritizer, writer, epoch_log, report_progress,
                       workdir)
  finally:  # Also on errors: the last good checkpoint must finish writing.
    run.checkpointer.wait_until_finished()
    writer.flush()


def evaluate_only(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Restores the latest checkpoint in `workdir` and writes its report, no training.

  Returns:
    The report (also written to workdir/report).

  Raises:
    FileNotFoundError: `workdir` has no checkpoint.
  """
  run = _start(config, workdir)
  if run.start_epoch == 0:
    raise FileNotFoundError(f"no checkpoint in {run.checkpointer.directory} to evaluate; "
                            "train first or point --workdir at a trained run")
  return write_final_report(run.eval_fn, run.state, run.splits, run.mesh, config, workdir,
                            run.start_epoch)


def _run_epochs(run: _Run, config, train_fn, prioritizer, writer, epoch_log, report_progress,
                workdir):
  """The epoch loop: select, train, evaluate when due, log, checkpoint when due.

  The last epoch writes the calibration report; returns its metrics record.
  """
  state, sel, record = run.state, run.selection, {}
  for epoch in range(run.start_epoch, config.num_epochs):
    start = time.time()
    rows, sel, timings = prioritizer.epoch_rows(epoch, state, sel)
    train_start = time.perf_counter()
    with report_progress.timed("train", wait_jax_async_dispatch=False):
      state, record, order, per_example = train_epoch(
          train_fn, state, run.splits["train"], rows, epoch, config, run.mesh,
          report_progress, run.checkpointer.directory)
    timings["training_seconds"] = time.perf_counter() - train_start
    sel, selection_record = prioritizer.after_epoch(epoch, sel, order, per_example, timings,
                                                    workdir)
    record.update(selection_record)
    if epoch + 1 == config.num_epochs:  # The report's before-TS numbers are the last eval.
      results = write_final_report(run.eval_fn, state, run.splits, run.mesh, config, workdir,
                                   epoch + 1)
      record.update({f"{split}_{name}": results["metrics"][split]["before_ts"][name]
                     for split in ("val", "test") for name in report.EPOCH_METRICS})
    elif (epoch + 1) % config.eval_every_epochs == 0:
      record.update(evaluate(run.eval_fn, state, run.splits, run.mesh, config))
    record.update(epoch=epoch, epoch_seconds=time.time() - start)
    writer.write_scalars(int(jax.device_get(state.step)), {
        k: v for k, v in record.items() if isinstance(v, (int, float)) and np.isfinite(v)})
    epoch_log.write(record)
    if (epoch + 1) % config.checkpoint_every_epochs == 0 or epoch + 1 == config.num_epochs:
      run.checkpointer.save(epoch + 1, {"train": state,
                                        "selection": sharding.replicate(run.mesh, sel)},
                            {"epoch": epoch + 1,
                             "config": config.to_json_best_effort(sort_keys=True)})
  return record
