"""The training loop: `train_and_evaluate` and `evaluate_only`.

`train_and_evaluate(config, workdir)` validates the config, restores the latest
checkpoint in `workdir` if there is one, and runs one loop over epochs: choose
the epoch's rows (cpjax.selection), train them with the jitted train step
(cpjax.epoch_loop, cpjax.steps), log train metrics every `log_every_steps`, evaluate and
checkpoint when `run_context.due`, and write the calibration report after the last epoch
(cpjax.evaluation), once that epoch's training numbers are in metrics.jsonl and its checkpoint
has committed: a report that fails, or is killed, loses no training and no record, a signal
stops it at once, and a rerun (or --mode=evaluate) writes it. Start-up checks
(cpjax.preflight) run before the workdir is touched, and a folder dataset changed under its
checkpoint is refused (cpjax.data.fingerprint); an epoch that learns nothing stops the run.
"""

import contextlib
import dataclasses
import functools
import json
import logging
import os
import tempfile
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from cpjax import (
  config_validation,
  epoch_loop,
  evaluation,
  models,
  optim,
  preflight,
  run_context,
  run_state,
  steps,
)
from cpjax.calibration import gamma_net, losses
from cpjax.data import fingerprint, input_pipeline, sources, specs

# Run and the two errors are part of this module's interface (users catch the errors).
from cpjax.epoch_loop import StalledTrainingError  # noqa: F401
from cpjax.run_context import NonFiniteLossError, Run  # noqa: F401
from cpjax.runtime import (
  checkpointing,
  compilation_cache,
  compiler_options,
  preemption,
  run_logging,
  sharding,
  workdir_lock,
)
from cpjax.selection import bookkeeping, scores, selector
from cpjax.selection import sources as score_sources


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains and evaluates `config`, resuming from `workdir` if it has checkpoints.

  With `config.selection.method` other than "full", epochs after the warm-up
  train on a prioritized subset (cpjax.selection). After the last epoch, the
  calibration report (before/after temperature scaling, bootstrap intervals,
  OOD AUROC, reliability diagrams) goes to `workdir/report`. On SIGTERM or
  Ctrl-C the run saves a checkpoint after the current step and raises
  `preemption.Preempted`; rerunning resumes at that step.

  Args:
    config: run configuration (see configs/default.py); validated first.
    workdir: directory for checkpoints, TensorBoard events and metrics.jsonl.

  Returns:
    The last epoch's metrics record.
  """
  _check_before_work(config, workdir)
  with workdir_lock.WorkdirLock(workdir), \
      contextlib.closing(compilation_cache.CacheStats()) as cache_stats:
    return _train_and_evaluate(config, workdir, cache_stats)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        cache_stats: compilation_cache.CacheStats) -> dict[str, Any]:
  run = _setup(config, workdir)
  chooser = _create_selector(config, run)
  train_fn = _jit_train_step(config, run.model, run.tx, chooser.weighted)
  # The one change to the Run after _setup (only the selector knows the epochs' sizes).
  run = dataclasses.replace(run, epoch_steps=_epoch_steps(
      [chooser.steps_in_epoch(e) for e in range(config.num_epochs)], config.budget_steps))
  report = _report_evaluator(config, run)
  evaluations = evaluation.Evaluations(report.split_evaluator, report,
                                       config.eval_every_epochs, run.num_epochs)
  writer = run_logging.create_writer(workdir)
  epoch_log = run_logging.EpochLog(workdir)
  epoch_log.keep_epochs_before(run.start_epoch)
  epoch_writer = run_logging.create_epoch_writer(writer, epoch_log)  # TensorBoard + jsonl.
  progress = run_logging.create_progress_reporter(run.total_steps, writer,
                                                  config.log_every_steps)
  if run.start_epoch == 0 and run.partial is None:
    writer.write_hparams(run_logging.flat_hparams(config.to_dict()))
  state, selection_state, record = run.state, run.selection, {}
  with preemption.PreemptionGuard() as guard:
    hooks = epoch_loop.LoopHooks(writer, progress, guard)
    try:
      _finish_report(run, evaluations, (writer, epoch_writer), epoch_log, guard)
      for epoch in range(run.start_epoch, run.num_epochs):
        start = time.time()
        rows, weights, selection_state, timings = chooser.rows_for_epoch(epoch, state,
                                                                         selection_state)
        plan = epoch_loop.EpochPlan(epoch, rows, selection_state,
                                    run.partial if epoch == run.start_epoch else None, weights)
        train_start = time.perf_counter()
        with progress.timed("train", wait_jax_async_dispatch=False):
          result = epoch_loop.train_epoch(run, train_fn, state, plan, hooks)
        state = result.state
        if result.partial is not None:  # Preempted mid-epoch: save its steps, then stop.
          step = epoch_loop.save_checkpoint(run, state, selection_state, epoch, result.partial,
                                            result.epoch_step)
          epoch_loop.stop_preempted(run, step, epoch, result.epoch_step, guard.signal_name)
        timings["training_seconds"] = time.perf_counter() - train_start
        selection_state, selection_record = chooser.after_epoch(
            epoch, selection_state, result.order, result.per_example, timings, workdir)
        record = {**result.record, **selection_record}
        last, logits = epoch + 1 == run.num_epochs, None
        global_step = int(jax.device_get(state.step))
        if last:  # Committed before the report: a report that fails loses no training.
          logits = report.split_evaluator.logits(state)  # Non-finite: stops, nothing saved.
          # The epoch's training numbers first: a kill during the report loses none of them
          # (before the commit below, the rerun redoes the epoch and drops this record).
          epoch_log.write({**record, "epoch": epoch, "epoch_seconds": time.time() - start})
          step = epoch_loop.save_checkpoint(run, state, selection_state, epochs_done=epoch + 1)
          run.checkpointer.wait_until_finished()
        stop_at_once = (guard.stopping_at_once(_REPORT_STOP.format(step=step), step) if last
                        else contextlib.nullcontext())
        with stop_at_once:  # The report: a signal stops it at once (the checkpoint is saved).
          record.update(evaluations.run(state, epoch, writer, global_step, logits))
        record.update(epoch=epoch, epoch_seconds=time.time() - start)
        epoch_writer.write_scalars(global_step, record)
        if epoch == run.start_epoch:  # Its steps, scoring (and evaluation, if due) compiled.
          logging.info("%s", cache_stats.summary(run.compilation_cache))
        if not last and (run_context.due(epoch, config.checkpoint_every_epochs,
                                         run.num_epochs) or result.stop_requested):
          step = epoch_loop.save_checkpoint(run, state, selection_state, epochs_done=epoch + 1)
        if result.stop_requested and epoch + 1 < run.num_epochs:
          epoch_loop.stop_preempted(run, step, epoch + 1, 0, guard.signal_name)
    finally:  # Also on errors: the last good checkpoint must finish writing.
      run.checkpointer.wait_until_finished()
      writer.flush()
  return record


# A signal during the final report stops the run at once: its checkpoint has committed.
_REPORT_STOP = ("stopped during the final report; the last checkpoint (global step {step}) "
                "is saved, and rerunning the same command writes the report.")


def _finish_report(run: Run, evaluations: evaluation.Evaluations, writers: tuple[Any, Any],
                   epoch_log: run_logging.EpochLog, guard: preemption.PreemptionGuard) -> None:
  """Writes the report of a run whose training is complete but whose report is missing,
  incomplete or of another checkpoint (a report that failed, or was killed, after the last
  checkpoint was saved), and its numbers into the last epoch's metrics.jsonl record.
  `writers`: (TensorBoard's, the epoch records' = TensorBoard's and metrics.jsonl)."""
  if run.start_epoch < run.num_epochs or run.partial is not None:
    return
  step = int(jax.device_get(run.state.step))
  if evaluations.report_evaluator.describes(step):
    return
  logging.warning("Training is complete (checkpoint %d) but report/ or metrics.jsonl does not "
                  "hold its report; writing the report now.", step)
  epoch = run.start_epoch - 1
  with guard.stopping_at_once(_REPORT_STOP.format(step=step), step):
    numbers = evaluations.run(run.state, epoch, writers[0], step)
  saved = epoch_log.record(epoch)
  if saved is None and jax.process_index() == 0:
    logging.warning("metrics.jsonl has no record of epoch %d (lost by an earlier version of "
                    "cpjax); writing the report's numbers alone for it.", epoch)
  writers[1].write_scalars(step, {**(saved or {}), **numbers, "epoch": epoch})


def evaluate_only(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Restores the latest checkpoint in `workdir` and writes its report, no training.

  Returns:
    The report (also written to workdir/report).

  Raises:
    FileNotFoundError: `workdir` has no checkpoint.
  """
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):  # Before _setup creates it.
    raise FileNotFoundError(f"no checkpoints/ in --workdir {workdir!r} to evaluate; train "
                            "first or point --workdir at a trained run")
  _check_before_work(config, workdir, "evaluate")
  with workdir_lock.WorkdirLock(workdir):
    run = _setup(config, workdir)
    if run.start_epoch == 0 and run.partial is None:
      raise FileNotFoundError(f"no checkpoint in {run.checkpointer.directory} to evaluate; "
                              "train first or point --workdir at a trained run")
    return _report_evaluator(config, run).run(run.state, run.start_epoch,
                                              run.partial["steps"] if run.partial else 0)


def _epoch_steps(natural: list[int], budget: int) -> tuple[int, ...]:
  """The steps of each epoch the run trains: `natural` (each epoch in full), or, with a
  step `budget` (> 0), as many as fit in it, the epoch in which it runs out cut short and
  made the last: [422, 422, 422] with budget 600 -> (422, 178)."""
  if not budget:
    return tuple(natural)
  cumulative = np.cumsum(natural)
  last = int(np.searchsorted(cumulative, budget))  # First epoch reaching the budget.
  if last == len(natural):
    return tuple(natural)
  return (*natural[:last], budget - (int(cumulative[last - 1]) if last else 0))


def _setup(config: ml_collections.ConfigDict, workdir: str) -> Run:
  """Builds the model and state, restores the latest checkpoint, reads the data."""
  # Before anything compiles (jit of the initial state is the first).
  cache_dir = compilation_cache.configure(config.compilation_cache_dir,
                                          config.compilation_cache_min_seconds)
  mesh = sharding.create_mesh()
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes, config.model.dtype)
  tx = optim.create_optimizer(config.optimizer)
  initial = run_state.checkpoint_tree(
      steps.create_train_state(jax.random.PRNGKey(config.seed), model, tx, data.image_shape,
                               mesh, _meta_parts(config)),
      bookkeeping.initial_state_of(config.dataset, config.selection),
      run_state.empty_partial(config.dataset, config.batch_size), mesh)
  checkpointer = checkpointing.Checkpointer(workdir, config.keep_checkpoints)
  # Before the restore: files added or deleted would show as a shape mismatch instead.
  data_digests = fingerprint.check_resume(sources.file_listing(config.dataset),
                                          checkpointer.latest_meta(), workdir,
                                          config.dataset.folder)
  saved, meta = _restore(checkpointer, initial, config)
  eval_fn = _jit_eval_step(config, model)
  data_splits, data_readers = input_pipeline.load(config.dataset, mesh, config.seed)
  _record_dataset(config.dataset, workdir)
  return Run(config, workdir, mesh, model, tx, checkpointer, data_splits, data_readers,
             eval_fn, saved["train"], jax.tree.map(np.asarray, saved["selection"]),
             meta.get("epoch", 0),
             run_state.partial_from_checkpoint(saved["partial"], meta.get("epoch_step", 0),
                                               config.batch_size),
             compilation_cache=cache_dir, data_digests=data_digests)


def _create_selector(config: ml_collections.ConfigDict, run: Run) -> selector.Selector:
  """The run's selector and its score source, each given the config sections it reads."""
  data = specs.DATASETS[config.dataset.name]
  source = score_sources.create_source(
      config.selection, run.readers["train"], run.mesh, model_name=config.model.name,
      dataset=config.dataset, xla_cpu_options=config.xla_cpu_options)
  return selector.Selector(config.selection, run.readers["train"], run.mesh, source,
                           num_epochs=config.num_epochs, batch_size=config.batch_size,
                           seed=config.seed, num_classes=data.num_classes,
                           num_ids=data.num_train, num_bins=config.evaluation.num_bins)


def _report_evaluator(config: ml_collections.ConfigDict,
                      run: Run) -> evaluation.ReportEvaluator:
  """The run's evaluators (its split evaluator inside the report's), built from the parts
  they use: the eval step, the val/test data and the sentence naming the last good
  checkpoint, not the Run."""
  split_evaluator = evaluation.SplitEvaluator(
      run.eval_fn, run.mesh, {name: run.readers[name] for name in evaluation.SPLITS},
      {name: run.splits[name].labels for name in evaluation.SPLITS},
      specs.DATASETS[config.dataset.name].num_classes, config.evaluation.num_bins,
      config.eval_batch_size, functools.partial(run_context.last_good, run.checkpointer))
  return evaluation.ReportEvaluator(
      split_evaluator, config.evaluation, run.workdir,
      f"{config.dataset.name}, {config.model.name}, {config.loss.name}", run.splits["test"],
      config.dataset, _jit_gamma_step(config, run.model))


def _record_dataset(dataset: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes the class names in label order (workdir/classes.json) of a dataset that has them,
  and the files a folder dataset left out (workdir/bad_files.txt); process 0 only."""
  names = specs.DATASETS[dataset.name].classes
  if jax.process_index() or not names:
    return
  with open(os.path.join(workdir, "classes.json"), "w") as f:
    json.dump({"dataset": dataset.name, "classes": list(names)}, f, indent=1)
  if bad := sources.bad_files(dataset):
    # Names that are not UTF-8 are written with backslash escapes, as the log shows them.
    with open(os.path.join(workdir, "bad_files.txt"), "w", errors="backslashreplace") as f:
      f.write("\n".join(bad) + "\n")
    logging.warning("%d unreadable files were left out of the dataset (listed in %s).",
                    len(bad), os.path.join(workdir, "bad_files.txt"))


def _check_before_work(config: ml_collections.ConfigDict, workdir: str,
                       mode: str = "train") -> None:
  """Validates the config and the workdir and runs the start-up checks (cpjax.preflight):
  before the workdir lock, any data load or compile."""
  config_validation.validate(config)
  for warning in config_validation.size_warnings(config):
    logging.warning("%s", warning)
  _check_workdir(workdir)
  preflight.check(config, workdir, mode)


def _check_workdir(workdir: str) -> None:
  """Fails early, before any data load or compile, if `workdir` is unusable; creates
  nothing (the workdir lock creates it once every check has passed)."""
  where = os.path.abspath(workdir)
  while not os.path.exists(where):
    where = os.path.dirname(where)
  try:
    if not os.path.isdir(where):
      raise NotADirectoryError(f"{where} is not a directory")
    tempfile.NamedTemporaryFile(dir=where).close()  # Can we create files here?
  except OSError as err:
    raise PermissionError(f"--workdir {workdir!r} is not a writable directory: {err}") from err


def _restore(checkpointer: checkpointing.Checkpointer, initial: dict[str, Any],
             config: ml_collections.ConfigDict) -> tuple[dict[str, Any], dict[str, Any]]:
  """The latest checkpoint and its metadata if any, else `initial` and {}."""
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), initial)
  restored = checkpointer.restore_latest(abstract)
  if restored is None:
    return initial, {}
  saved, meta = restored
  if meta["config"] != config.to_json_best_effort(sort_keys=True):
    logging.warning("Resuming with a config that differs from the checkpoint's.")
  logging.info("Resumed from %s at global step %d (epoch %d, step %d of it).",
               checkpointer.directory, meta.get("step", -1), meta["epoch"],
               meta.get("epoch_step", 0))
  return saved, meta


def _jit_train_step(config: ml_collections.ConfigDict, model, tx, weighted: bool):
  """The train step with the config's model, optimizer, loss and score bound; jitted once.
  `weighted`: batches carry loss weights (the selector's). FL_gamma losses train with the
  bilevel `steps.meta_train_step` instead."""
  score_fn = scores.forward_score(config.selection.score, config.selection)
  meta = _meta_parts(config)
  spec = steps.step_spec(config.dataset, config.loss, weighted)
  if meta is None:
    step = functools.partial(steps.train_step, model=model, tx=tx,
                             loss_fn=losses.get_loss(config.loss), score_fn=score_fn, spec=spec)
  else:
    step = functools.partial(steps.meta_train_step, model=model, gamma_net=meta[0], tx=tx,
                             meta_tx=meta[1],
                             objective=gamma_net.create_meta_objective(config.loss, config.meta),
                             score_fn=score_fn, spec=spec,
                             leak_meta_gradient=config.meta.leak_meta_gradient)
  return jax.jit(step, donate_argnums=0,
                 compiler_options=compiler_options.compiler_options("train",
                                                                    config.xla_cpu_options))


def _meta_parts(config: ml_collections.ConfigDict):
  """run_state.meta_parts of the config's sections: (gamma-Net, its optimizer) or None."""
  return run_state.meta_parts(config.loss, config.meta,
                              specs.DATASETS[config.dataset.name].num_classes)


def _jit_eval_step(config: ml_collections.ConfigDict, model):
  """The eval step (float32 logits) of the config's model; jitted once."""
  return jax.jit(functools.partial(steps.eval_step, model=model,
                                   spec=steps.step_spec(config.dataset)),
                 compiler_options=compiler_options.compiler_options("inference",
                                                                    config.xla_cpu_options))


def _jit_gamma_step(config: ml_collections.ConfigDict, model):
  """An FL_gamma run's test gammas step ((state, batch) -> [B, 2] gamma and correct, eval
  mode, the eval step's XLA options), jitted once; None for every other loss."""
  meta = _meta_parts(config)
  if meta is None:
    return None
  return jax.jit(functools.partial(steps.gamma_step, model=model, gamma_net=meta[0],
                                   spec=steps.step_spec(config.dataset)),
                 compiler_options=compiler_options.compiler_options("inference",
                                                                    config.xla_cpu_options))
