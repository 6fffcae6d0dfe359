"""The training loop: `train_and_evaluate` and `evaluate_only`.

`train_and_evaluate(config, workdir)` validates the config, restores the latest
checkpoint in `workdir` if there is one, and runs one loop over epochs: choose
the epoch's rows (cpjax.selection), train them with the jitted train step
(cpjax.steps), log train metrics every `log_every_steps`, evaluate and
checkpoint when `_due`, and write the calibration report after the last epoch.
"""

import dataclasses
import functools
import logging
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from cpjax import config_validation, models, optim, steps
from cpjax.calibration import losses, report
from cpjax.data import corruptions, input_pipeline, specs, splits
from cpjax.runtime import checkpointing, compiler_options, run_logging, sharding
from cpjax.selection import bookkeeping, scores, selector, sources

EPOCH_SUMS = ("loss_sum", "correct", "count", "first_bad_step")  # Summed over an epoch.


class NonFiniteLossError(FloatingPointError):
  """The training loss became NaN or infinite."""


@dataclasses.dataclass
class Run:
  """What one run's loop and evaluation share, built once by `_setup`."""
  config: ml_collections.ConfigDict
  workdir: str
  mesh: jax.sharding.Mesh
  model: Any
  tx: Any
  checkpointer: checkpointing.Checkpointer
  splits: dict[str, splits.Split]
  eval_fn: Any  # jitted (state, batch) -> logits
  state: steps.TrainState  # As restored (or initialised).
  selection: bookkeeping.SelectionState  # Host copy, as restored.
  start_epoch: int


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains and evaluates `config`, resuming from `workdir` if it has checkpoints.

  With `config.selection.method` other than "full", epochs after the warm-up
  train on a prioritized subset (cpjax.selection). After the last epoch, the
  calibration report (before/after temperature scaling, bootstrap intervals,
  OOD AUROC, reliability diagrams) goes to `workdir/report`.

  Args:
    config: run configuration (see configs/default.py); validated first.
    workdir: directory for checkpoints, TensorBoard events and metrics.jsonl.

  Returns:
    The last epoch's metrics record.
  """
  run = _setup(config, workdir)
  train_fn = _jit_train_step(config, run.model, run.tx)
  chooser = selector.Selector(config, run.splits["train"], run.mesh)
  writer = run_logging.create_writer(workdir)
  epoch_log = run_logging.EpochLog(workdir)
  epoch_log.keep_epochs_before(run.start_epoch)
  progress = run_logging.create_progress_reporter(
      sum(chooser.steps_in_epoch(e) for e in range(config.num_epochs)), writer,
      config.log_every_steps)
  if run.start_epoch == 0:
    writer.write_hparams({"config": config.to_json_best_effort()})
  state, selection_state, record = run.state, run.selection, {}
  try:
    for epoch in range(run.start_epoch, config.num_epochs):
      start = time.time()
      rows, selection_state, timings = chooser.rows_for_epoch(epoch, state, selection_state)
      train_start = time.perf_counter()
      with progress.timed("train", wait_jax_async_dispatch=False):
        state, record, order, per_example = train_epoch(run, train_fn, state, rows, epoch,
                                                        writer, progress)
      timings["training_seconds"] = time.perf_counter() - train_start
      selection_state, selection_record = chooser.after_epoch(
          epoch, selection_state, order, per_example, timings, workdir)
      record.update(selection_record)
      record.update(_evaluate_when_due(run, state, epoch))
      record.update(epoch=epoch, epoch_seconds=time.time() - start)
      writer.write_scalars(int(jax.device_get(state.step)), {
          k: v for k, v in record.items() if isinstance(v, (int, float)) and np.isfinite(v)})
      epoch_log.write(record)
      if _due(epoch, config.checkpoint_every_epochs, config.num_epochs):
        _save(run, epoch + 1, state, selection_state)
  finally:  # Also on errors: the last good checkpoint must finish writing.
    run.checkpointer.wait_until_finished()
    writer.flush()
  return record


def evaluate_only(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Restores the latest checkpoint in `workdir` and writes its report, no training.

  Returns:
    The report (also written to workdir/report).

  Raises:
    FileNotFoundError: `workdir` has no checkpoint.
  """
  run = _setup(config, workdir)
  if run.start_epoch == 0:
    raise FileNotFoundError(f"no checkpoint in {run.checkpointer.directory} to evaluate; "
                            "train first or point --workdir at a trained run")
  return write_final_report(run, run.state, run.start_epoch)


def _due(epoch: int, every: int, num_epochs: int) -> bool:
  """Whether a periodic action (eval, checkpoint) runs after 0-indexed `epoch`: every
  `every` epochs and always after the last."""
  return (epoch + 1) % every == 0 or epoch + 1 == num_epochs


def _setup(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Validates, builds the model and state, restores the latest checkpoint, reads the data."""
  config_validation.validate(config)
  if config.selection.scoring in ("target", "target_recorded"):
    sources.check_target(config)
  _check_workdir(workdir)
  mesh = sharding.create_mesh()
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes, config.model.dtype)
  tx = optim.create_optimizer(config.optimizer)
  initial = {"train": steps.create_train_state(jax.random.PRNGKey(config.seed), model, tx,
                                               data.image_shape, mesh),
             "selection": sharding.replicate(mesh, bookkeeping.initial_state(
                 splits.num_train_examples(config.dataset)))}
  checkpointer = checkpointing.Checkpointer(workdir, config.keep_checkpoints)
  saved, start_epoch = _restore(checkpointer, initial, config)
  eval_fn = jax.jit(functools.partial(steps.eval_step, model=model,
                                      spec=steps.step_spec(config)),
                    compiler_options=compiler_options.compiler_options(
                        "inference", config.xla_cpu_options))
  return Run(config, workdir, mesh, model, tx, checkpointer,
             input_pipeline.get_datasets(config.dataset), eval_fn, saved["train"],
             jax.tree.map(np.asarray, saved["selection"]), start_epoch)


def _check_workdir(workdir: str) -> None:
  """Fails early, before any data load or compile, if `workdir` is unusable."""
  try:
    os.makedirs(workdir, exist_ok=True)
    tempfile.NamedTemporaryFile(dir=workdir).close()  # Can we create files here?
  except OSError as err:
    raise PermissionError(f"--workdir {workdir!r} is not a writable directory: {err}") from err


def _restore(checkpointer: checkpointing.Checkpointer, initial: dict[str, Any],
             config: ml_collections.ConfigDict) -> tuple[dict[str, Any], int]:
  """The latest checkpoint if any, else `initial`; and the first epoch to run."""
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), initial)
  restored = checkpointer.restore_latest(abstract)
  if restored is None:
    return initial, 0
  saved, meta = restored
  if meta["config"] != config.to_json_best_effort(sort_keys=True):
    logging.warning("Resuming with a config that differs from the checkpoint's.")
  logging.info("Resumed from %s after epoch %d.", checkpointer.directory, meta["epoch"])
  return saved, meta["epoch"]


def _save(run: Run, epochs_done: int, state: steps.TrainState,
          selection_state: bookkeeping.SelectionState) -> None:
  run.checkpointer.save(epochs_done,
                        {"train": state, "selection": sharding.replicate(run.mesh, selection_state)},
                        {"epoch": epochs_done,
                         "config": run.config.to_json_best_effort(sort_keys=True)})


def _jit_train_step(config: ml_collections.ConfigDict, model, tx):
  """The train step with the config's model, optimizer, loss and score bound; jitted once."""
  return jax.jit(functools.partial(steps.train_step, model=model, tx=tx,
                                   loss_fn=losses.get_loss(config.loss),
                                   score_fn=scores.SCORES[config.selection.score],
                                   spec=steps.step_spec(config)),
                 donate_argnums=0,
                 compiler_options=compiler_options.compiler_options("train",
                                                                    config.xla_cpu_options))


@jax.jit
def _accumulate(totals: dict[str, jax.Array], batch_metrics: dict[str, jax.Array]):
  """Sums batch metrics on device (min for the first non-finite step)."""
  return {k: jnp.minimum(v, batch_metrics[k]) if k == "first_bad_step" else v + batch_metrics[k]
          for k, v in totals.items()}


def train_epoch(run: Run, train_fn, state: steps.TrainState, rows: np.ndarray, epoch: int,
                writer, progress):
  """Trains one epoch over `rows` of the training split in the epoch's deterministic order.

  Every `log_every_steps` steps, the window's train metrics go to `writer` and a
  non-finite loss stops the run.

  Returns:
    (state, epoch record, order [steps, B] of the rows trained, per-example
    train-pass outputs flattened in that order).
  """
  config = run.config
  order = splits.epoch_order(config.seed, epoch, rows, config.batch_size)
  local_rows = sharding.process_rows(run.mesh, config.batch_size)
  learning_rate = np.float32(optim.learning_rate_at(config.optimizer, epoch, config.num_epochs))
  loss_hparams = {k: np.float32(v) for k, v in losses.scheduled_hparams(config.loss, epoch).items()}
  epoch_start_step = int(jax.device_get(state.step))
  totals, window, outputs = None, [], []
  for i, batch_rows in enumerate(order):
    batch = sharding.to_global(run.mesh, splits.batch_at(run.splits["train"],
                                                         batch_rows[local_rows]),
                               config.batch_size)
    state, batch_metrics, per_example = train_fn(state, batch, learning_rate, loss_hparams)
    epoch_sums = {k: batch_metrics[k] for k in EPOCH_SUMS}
    totals = epoch_sums if totals is None else _accumulate(totals, epoch_sums)
    window.append(batch_metrics)
    outputs.append(per_example)
    progress(epoch_start_step + i + 1)
    if (i + 1) % config.log_every_steps == 0:
      _log_train_window(run, writer, window, epoch_start_step + i + 1, epoch, epoch_start_step,
                        learning_rate)
      window = []
  _raise_if_bad(run, totals, epoch, epoch_start_step)
  totals = jax.device_get(totals)
  per_example = {k: np.concatenate([np.asarray(v) for v in sharding.to_host([o[k] for o in outputs])])
                 for k in outputs[0]}
  record = {"train_loss": float(totals["loss_sum"] / totals["count"]),
            "train_accuracy": float(totals["correct"] / totals["count"]),
            "learning_rate": float(learning_rate),
            **{k: float(v) for k, v in loss_hparams.items()}}
  return state, record, order, per_example


def _log_train_window(run: Run, writer, window: list[dict[str, jax.Array]], step: int,
                      epoch: int, epoch_start_step: int, learning_rate: np.float32) -> None:
  """Writes the train metrics of the steps up to global `step` (as flax and big_vision
  log them) and stops the run if one of their losses was not finite."""
  window = jax.device_get(window)
  _raise_if_bad(run, {"first_bad_step": min(m["first_bad_step"] for m in window)}, epoch,
                epoch_start_step)
  count = sum(float(m["count"]) for m in window)
  writer.write_scalars(step, {
      "train/loss": sum(float(m["loss_sum"]) for m in window) / count,
      "train/accuracy": sum(float(m["correct"]) for m in window) / count,
      "train/learning_rate": float(learning_rate),
      "train/grad_norm": float(np.mean([m["grad_norm"] for m in window])),
      "train/param_norm": float(window[-1]["param_norm"]),
  })


def _raise_if_bad(run: Run, totals: dict[str, Any], epoch: int, epoch_start_step: int) -> None:
  bad = int(jax.device_get(totals["first_bad_step"]))
  if bad != steps.NO_BAD_STEP:
    raise NonFiniteLossError(
        f"non-finite training loss at epoch {epoch}, step {bad - epoch_start_step} of the "
        f"epoch (global step {bad}); the run stopped and the last good checkpoint in "
        f"{run.checkpointer.directory} is intact. Lower the learning rate or enable "
        "gradient clipping.")


def evaluate(run: Run, state: steps.TrainState) -> dict[str, float]:
  """Accuracy, NLL and the ECE family of the validation and test splits."""
  num_classes = specs.DATASETS[run.config.dataset.name].num_classes
  results = {}
  for name in ("val", "test"):
    logits = steps.predict(run.eval_fn, state, run.splits[name], run.mesh,
                           run.config.eval_batch_size)
    values = report.calibration_metrics(logits, run.splits[name].labels, num_classes,
                                        run.config.evaluation.num_bins)
    results.update({f"{name}_{metric}": value for metric, value in values.items()})
  return results


def _evaluate_when_due(run: Run, state: steps.TrainState, epoch: int) -> dict[str, float]:
  """The epoch's val/test metrics: from the final report after the last epoch, from an
  evaluation every `eval_every_epochs`, else none."""
  config = run.config
  if epoch + 1 == config.num_epochs:  # The report's before-TS numbers are the last eval.
    results = write_final_report(run, state, epoch + 1)
    return {f"{split}_{name}": results["metrics"][split]["before_ts"][name]
            for split in ("val", "test") for name in report.EPOCH_METRICS}
  if _due(epoch, config.eval_every_epochs, config.num_epochs):
    return evaluate(run, state)
  return {}


def _ood_split(run: Run) -> splits.Split | None:
  """The OOD set of the report: a corrupted test set, another dataset, or none."""
  evaluation, test = run.config.evaluation, run.splits["test"]
  if not evaluation.ood:
    return None
  if evaluation.ood == "gaussian_noise":
    return dataclasses.replace(test, images=corruptions.gaussian_noise(
        test.images, evaluation.ood_severity))
  return input_pipeline.get_test_split(run.config.dataset, evaluation.ood)


def write_final_report(run: Run, state: steps.TrainState, epoch: int) -> dict[str, Any]:
  """Builds the calibration report of `state` and writes it to workdir/report."""
  config = run.config

  def logits_of(split):
    return steps.predict(run.eval_fn, state, split, run.mesh, config.eval_batch_size)
  ood = _ood_split(run)
  results = report.build_report(
      (logits_of(run.splits["val"]), run.splits["val"].labels),
      (logits_of(run.splits["test"]), run.splits["test"].labels),
      specs.DATASETS[config.dataset.name].num_classes, config.evaluation,
      None if ood is None else logits_of(ood))
  results.update(title=f"{config.dataset.name}, {config.model.name}, {config.loss.name}, "
                       f"after epoch {epoch}", epoch=epoch)
  if jax.process_index() == 0:
    paths = report.write_report(os.path.join(run.workdir, "report"), results)
    logging.info("Wrote the calibration report: %s", ", ".join(paths))
  return results
