"""The training loop: `train_and_evaluate` and `evaluate_only`.

`train_and_evaluate(config, workdir)` validates the config, restores the latest
checkpoint in `workdir` if there is one, and runs one loop over epochs, each of them one
function read top to bottom (`_train_epoch`): choose the epoch's rows (cpjax.selection), train
them with the jitted train step (cpjax.epoch_loop, cpjax.steps; the loss's step and batches
from cpjax.loss_steps), log train metrics every `log_every_steps`, evaluate and checkpoint
when `periodic.due`. After the loop, once the last checkpoint has committed and the last
epoch's record is in metrics.jsonl, `_write_report` writes the calibration report
(cpjax.evaluation) and adds its numbers to that record, in a fresh run and in a rerun alike: a
report that fails, or is killed, loses no training and no record, a signal stops it at once,
and a rerun (or --mode=evaluate) writes it. Start-up checks (cpjax.preflight) run before the
workdir is touched, and a folder dataset (or its converted records) changed under its
checkpoint is refused (cpjax.data.fingerprint), unless the change is the replacement of a
file the run stopped on as damaged; an epoch that learns nothing stops the run.
"""

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import json
import logging
import os
import tempfile
import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax

from cpjax import (
  compile_ahead,
  config_validation,
  epoch_loop,
  evaluation,
  loss_steps,
  models,
  optim,
  preflight,
  run_context,
  run_state,
  steps,
)
from cpjax.data import fingerprint, input_pipeline, sources, specs, splits

# Run and the two errors are part of this module's interface (users catch the errors).
from cpjax.epoch_loop import StalledTrainingError  # noqa: F401
from cpjax.run_context import NonFiniteLossError, Run  # noqa: F401
from cpjax.runtime import (
  anatomy,
  checkpointing,
  compilation_cache,
  compiler_options,
  metric_writers,
  periodic,
  run_logging,
  sharding,
  workdir_lock,
)
from cpjax.selection import bookkeeping, scores, selector
from cpjax.selection import sources as score_sources

# The jitted train step: (state, batch, learning rate, loss hyper-parameters) -> (state, batch
# metrics, per-example outputs); the state donated (cpjax.loss_steps builds it).
TrainFn = Callable[[steps.TrainState, dict[str, Any], np.float32, dict[str, np.float32]],
                   tuple[steps.TrainState, dict[str, jax.Array], dict[str, jax.Array]]]


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
  with contextlib.closing(anatomy.CompileWatch()) as watch:
    clock = anatomy.RunClock(watch)
    _check_before_work(config, workdir)
    clock.mark_startup_done()
    with (workdir_lock.WorkdirLock(workdir), fingerprint.noting_damage(workdir),
          contextlib.closing(compilation_cache.CacheStats()) as cache_stats):
      return _train_and_evaluate(config, workdir, cache_stats, clock)


@dataclasses.dataclass(frozen=True)
class Loop:
  """The loop's parts, beside the Run: built by `_train_and_evaluate` once the selector knows
  the epochs' sizes (`evaluate_only` needs none of them). None changes while the run trains."""
  selector: selector.Selector  # Each epoch's rows.
  train_fn: TrainFn  # jitted, the state donated.
  epoch_steps: tuple[int, ...]  # Steps of each epoch the run trains.
  evaluator: evaluation.Evaluator  # val/test metrics and the final report.
  writer: metric_writers.MetricWriter  # TensorBoard and the log.
  epoch_log: run_logging.EpochLog  # metrics.jsonl.
  progress: metric_writers.ProgressReport  # Steps/s and ETA.
  clock: anatomy.RunClock  # Where the process's wall clock goes (cpjax.runtime.anatomy).

  @property
  def num_epochs(self) -> int:
    """Epochs the run trains: config.num_epochs, fewer where budget_steps runs out first."""
    return len(self.epoch_steps)

  @property
  def total_steps(self) -> int:
    return sum(self.epoch_steps)


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        cache_stats: compilation_cache.CacheStats,
                        clock: anatomy.RunClock) -> dict[str, Any]:
  """Builds the run's parts, trains its epochs (`_train_epoch`) from the restored one, then
  writes the report of the last checkpoint (`_write_report`)."""
  run, state, selection_state, start_epoch, done = _setup(config, workdir, clock)
  writer = run_logging.create_writer(workdir)
  epoch_log = run_logging.EpochLog(workdir)
  epoch_log.keep_epochs_before(start_epoch)
  loop = _create_loop(config, run, writer, epoch_log, clock)
  if start_epoch < loop.num_epochs:
    clock.add("compile", _compile_ahead(config, run, loop, state))
  if start_epoch == 0 and done is None:
    writer.write_hparams(run_logging.flat_hparams(config.to_dict()))
    run_logging.log_parameter_overview(config.model.name, state.params)
  record, save_seconds = {}, None
  with run.checkpointer.handling_preemption():
    try:
      for epoch in range(start_epoch, loop.num_epochs):
        state, selection_state, record, save_seconds = _train_epoch(
            config, run, loop, epoch, state, selection_state,
            done if epoch == start_epoch else None, first=epoch == start_epoch)
        if epoch == start_epoch:  # Its steps, scoring (and evaluation, if due) compiled.
          logging.info("%s", cache_stats.summary(run.compilation_cache))
          clock.watch.first_epoch_done()
      clock.watch.stop_watching_late()  # The report's programs are its own.
      # Else a partly trained epoch past the run's end (num_epochs lowered): no report.
      if start_epoch < loop.num_epochs or done is None:
        record = _write_report(run, loop, state, max(start_epoch, loop.num_epochs), record,
                               save_seconds)
    finally:  # Also on errors: the last good checkpoint must finish writing.
      run.checkpointer.wait_until_finished()
      writer.close()  # The event file: its last events written, the file closed.
  return record


def _create_loop(config: ml_collections.ConfigDict, run: Run,
                 writer: metric_writers.MetricWriter, epoch_log: run_logging.EpochLog,
                 clock: anatomy.RunClock) -> Loop:
  """The loop's parts: the selector, the train step, each epoch's steps, the evaluator, and
  the run's `writer` (TensorBoard, the log) and `epoch_log` (metrics.jsonl) with the writers
  built on them."""
  chooser = _create_selector(config, run)
  epoch_steps = _epoch_steps([chooser.steps_in_epoch(e) for e in range(config.num_epochs)],
                             config.budget_steps)
  return Loop(
      selector=chooser, train_fn=_jit_train_step(config, run.model, run.tx, chooser.weighted,
                                                     run.loss_kind),
      epoch_steps=epoch_steps, evaluator=_create_evaluator(config, run), writer=writer,
      epoch_log=epoch_log,
      progress=run_logging.create_progress_reporter(
          sum(epoch_steps), writer, config.log_every_steps), clock=clock)


def _compile_ahead(config: ml_collections.ConfigDict, run: Run, loop: Loop,
                   state: steps.TrainState) -> float:
  """Compiles the loop's programs (the train step and its metric windows, the eval step, the
  selected epochs' scoring step and ranking) in threads before the first epoch
  (cpjax.compile_ahead), for batches built as the loop builds them. Returns the seconds
  waited for them."""
  _compile_readers_ahead(config, run)
  compiler = compile_ahead.Compiler()
  abstract_state = compile_ahead.abstract(state)
  train_rows = np.arange(min(config.batch_size, len(run.splits["train"])))[None]
  row_weights = (np.ones(len(run.splits["train"]), np.float32) if loop.selector.weighted
                 else None)
  item = compile_ahead.first_item(run.train_batches(train_rows, epoch=0, first_step=0,
                                                    row_weights=row_weights))
  hparams = epoch_loop.loss_hparams(config.loss, 0)
  compiler.submit("the train step", loop.train_fn, abstract_state, compile_ahead.abstract(item),
                  np.float32(0), hparams,
                  then=lambda c: epoch_loop.compile_windows_ahead(c, config.log_every_steps))
  batches = [compile_ahead.abstract(steps.first_predict_batch(
      run.readers[name], run.mesh, config.eval_batch_size)) for name in evaluation.SPLITS]
  for batch in {repr(b): b for b in batches}.values():  # One program for alike batches.
    compiler.submit("the eval step", run.eval_fn, abstract_state, batch)
  loop.selector.compile_ahead(compiler, state)
  return compiler.wait()


def _compile_readers_ahead(config: ml_collections.ConfigDict, run: Run) -> None:
  """A reader with programs of its own (the device stage's crop and resize, a program per
  batch size and pass kind) compiles them first, in its threads, for every pass the loop
  makes: training, evaluation and the fresh scoring pass."""
  passes = [("train", config.batch_size, True),
            *((name, config.eval_batch_size, False) for name in evaluation.SPLITS)]
  if config.selection.scoring == "fresh":
    passes.append(("train", config.selection.score_batch_size, False))
  for name, batch_size, training in passes:
    ahead = getattr(run.readers[name], "compile_ahead", None)
    if ahead is not None:
      ahead(batch_size, training)


def _train_epoch(config: ml_collections.ConfigDict, run: Run, loop: Loop, epoch: int,
                 state: steps.TrainState, selection_state: bookkeeping.SelectionState,
                 done: run_state.Done | None, first: bool = False
                 ) -> tuple[steps.TrainState, bookkeeping.SelectionState, dict[str, Any],
                            float | None]:
  """One epoch, top to bottom: choose its rows, train its steps (their metrics folded and
  logged every log_every_steps), fold the epoch's record, evaluate when due, write the
  record and save when due. A preemption request saves the steps trained (the epoch's, or a
  whole epoch) and stops, through one save and one stop. `done`: the epoch's steps trained
  before a preemption (None: none); `first`: the process's first epoch (its first step
  compiles). Returns the state, the selection state, the epoch's record and the seconds of
  its checkpoint's save (None: no save), whose commit only the report waits for."""
  start = time.time()
  with loop.clock.part("selection"):
    rows, weights, selection_state, timings = loop.selector.rows_for_epoch(epoch, state,
                                                                           selection_state)
  loop.clock.move("selection", "scoring", timings["scoring_seconds"])
  order = splits.epoch_order(config.seed, epoch, rows, config.batch_size)
  order, done = order[:loop.epoch_steps[epoch]], done or epoch_loop.NOTHING_DONE
  first_step = int(jax.device_get(state.step)) - done.steps  # The epoch's first step.
  learning_rates = epoch_loop.learning_rates(config.optimizer, epoch, first_step, len(order),
                                             loop.total_steps, config.num_epochs)
  hparams, train_start = epoch_loop.loss_hparams(config.loss, epoch), time.perf_counter()
  batches = run.train_batches(  # The train reader's (FL_gamma's joined by their own).
      order[done.steps:], epoch=epoch, first_step=first_step + done.steps,
      row_weights=_row_weights(rows, weights, len(run.splits["train"])))
  waiting = epoch_loop.InputWait(batches)  # The seconds the loop blocks on its next batch.
  # closing: a stop inside the epoch (preemption, divergence) also ends a stream reader's
  # read-ahead. The transfer guard covers the step loop but its logging points.
  with (loop.progress.timed("train"), loop.clock.training(len(order) - done.steps) as wait,
        contextlib.closing(batches), epoch_loop.step_guard(config.step_transfer_guard)):
    state, totals, outputs, trained, stopped = epoch_loop.train_steps(
        loop.train_fn, state, waiting, learning_rates, hparams, done, first_step=first_step,
        epoch=epoch, log_every=config.log_every_steps, writer=loop.writer,
        progress=loop.progress, checkpointer=run.checkpointer,
        last_step=loop.total_steps, compile_step=done.steps if first else -1)
    wait["input_wait"] = waiting.seconds
    jax.block_until_ready(state)  # The steps dispatched ahead: their compute is training's.
  outputs, complete = epoch_loop.host_outputs(outputs, done.outputs), trained == len(order)
  record = {}
  if complete:
    record = epoch_loop.epoch_record(totals, epoch, len(order), first_step, run.checkpointer,
                                     config.loss.name, learning_rates[0], hparams)
    timings["training_seconds"] = time.perf_counter() - train_start
    with loop.clock.part("selection"):
      selection_state, selection_record = loop.selector.after_epoch(
          epoch, selection_state, order, outputs, timings, run.workdir)
    record = {**record, **selection_record, "epoch": epoch,
              "input_wait_seconds": waiting.seconds}
    if periodic.due(epoch, config.eval_every_epochs, loop.num_epochs):
      # A non-finite logit stops the run here, before the state is saved.
      with loop.clock.part("eval"):
        numbers, record["eval_seconds"] = _timed(loop.evaluator.run, state, loop.writer,
                                                 first_step + len(order))
      record.update(numbers)
    record["epoch_seconds"] = time.time() - start
    run_logging.write_record(loop.writer, loop.epoch_log, first_step + len(order), record)
    partial = run_state.empty_partial(config.dataset, config.batch_size)
  else:  # Stopped mid-epoch: its sums and outputs go into the checkpoint.
    epoch_loop.raise_if_bad(totals, epoch, first_step, run.checkpointer)
    partial = run_state.partial_tree(config.dataset, config.batch_size,
                                     jax.device_get(totals), outputs)
  save_seconds = _save_when_due(config, run, loop, state, selection_state, partial, epoch,
                                complete, trained, stopped)
  return state, selection_state, record, save_seconds


def _save_when_due(config: ml_collections.ConfigDict, run: Run, loop: Loop,
                   state: steps.TrainState, selection_state: bookkeeping.SelectionState,
                   partial: dict[str, Any], epoch: int, complete: bool, trained: int,
                   stopped: bool) -> float | None:
  """After `epoch` (`complete`, or `trained` steps of it): saves the checkpoint when due or
  `stopped` (a preemption request), and stops the run there for a preemption. Returns the
  save's own seconds (its commit is waited for after the loop), or None: no save."""
  save_seconds = None
  # Where a resume starts: the next epoch, or this one's step after those trained.
  at_epoch, at_step = epoch + complete, 0 if complete else trained
  if stopped or periodic.due(epoch, config.checkpoint_every_epochs, loop.num_epochs):
    with loop.clock.part("checkpoint"):
      step, save_seconds = _timed(epoch_loop.save_checkpoint, run.checkpointer, run.mesh,
                                  run.checkpoint_meta, state, selection_state, partial,
                                  at_epoch, at_step)
  if stopped and at_epoch < loop.num_epochs:  # The one preemption stop (after the run's
    # last step nothing is left to resume: the report after the loop answers it).
    epoch_loop.stop_preempted(run.checkpointer, step, at_epoch, at_step)
  return save_seconds


def peak_device_memory() -> dict[str, int]:
  """{"perf/peak_device_memory_bytes": the most bytes any local device has held at once in
  this process (its allocator's peak)} where the backend counts them (GPU, TPU); {} where
  it does not (CPU: `memory_stats()` is None)."""
  peaks = [(device.memory_stats() or {}).get("peak_bytes_in_use")
           for device in jax.local_devices()]
  peaks = [int(p) for p in peaks if p is not None]
  return {"perf/peak_device_memory_bytes": max(peaks)} if peaks else {}


def _anatomy(loop: Loop) -> dict[str, Any]:
  """The process's run anatomy (cpjax.runtime.anatomy), logged in one line and added to
  report/results.json."""
  parts = loop.clock.anatomy()
  logging.info("%s", anatomy.summary_line(parts))
  loop.evaluator.add_to_results({"anatomy": parts})
  return parts


def _timed(fn, *args) -> tuple[Any, float]:
  """`fn(*args)` and the seconds it took."""
  start = time.perf_counter()
  return fn(*args), time.perf_counter() - start


def _row_weights(rows: np.ndarray, weights: np.ndarray | None, num_rows: int
                 ) -> np.ndarray | None:
  """The epoch's loss weights indexed by training row (None when its policy has none)."""
  if weights is None:
    return None
  row_weights = np.ones(num_rows, np.float32)
  row_weights[rows] = weights
  return row_weights


# A signal during the final report stops the run at once: its checkpoint has committed.
_REPORT_STOP = ("stopped during the final report; the last checkpoint (global step {step}) "
                "is saved, and rerunning the same command writes the report.")


def _write_report(run: Run, loop: Loop, state: steps.TrainState, epochs: int,
                  record: dict[str, Any], save_seconds: float | None) -> dict[str, Any]:
  """Writes the calibration report of the last checkpoint (`state`, after `epochs` complete
  epochs) to workdir/report and TensorBoard, once that checkpoint has committed, and its
  numbers into the last epoch's metrics.jsonl record, unless both already hold it: after the
  loop, of a fresh run and of a rerun alike (whose report failed, or was killed, after that
  checkpoint was saved). A signal stops it at once. `record`: the last epoch's record if this
  process trained it ({}: read from metrics.jsonl); `save_seconds`: its checkpoint's save, if
  this process saved it. Returns the record with the report's numbers and times."""
  commit_start = time.perf_counter()
  with loop.clock.part("checkpoint"):
    run.checkpointer.wait_until_finished()  # The last checkpoint commits first.
  step = int(jax.device_get(state.step))
  if loop.evaluator.describes(step):
    return record
  epoch = epochs - 1
  if not record:
    logging.warning("Training is complete (checkpoint %d) but report/ or metrics.jsonl does "
                    "not hold its report; writing the report now.", step)
    record = loop.epoch_log.record(epoch)
    if record is None and jax.process_index() == 0:
      logging.warning("metrics.jsonl has no record of epoch %d (lost by an earlier version "
                      "of cpjax); writing the report's numbers alone for it.", epoch)
  # The save and the wait for its commit (where this process saved it).
  times = {} if save_seconds is None else {
      "checkpoint_seconds": save_seconds + time.perf_counter() - commit_start}
  report_start = time.perf_counter()
  with (run.checkpointer.stopping_at_once(_REPORT_STOP.format(step=step), step),
        loop.clock.part("report")):
    results = loop.evaluator.write_report(state, epochs)
    evaluation.write_report_summaries(loop.writer, step, results)
    numbers = evaluation.report_record(results)
  times["report_seconds"] = time.perf_counter() - report_start
  numbers.update(times)
  numbers.update(peak_device_memory())
  numbers.update(_anatomy(loop))
  record = record or {}
  # The last epoch's seconds take in its checkpoint's and its report's. TensorBoard holds
  # the epoch's record at this step (its epoch wrote it): the rest only. Last:
  # metrics.jsonl's record marks the report complete.
  new_keys = [k for k in numbers if k not in record]
  record = {**record, **numbers, "epoch": epoch,
            "epoch_seconds": record.get("epoch_seconds", 0.0) + sum(times.values())}
  run_logging.write_record(loop.writer, loop.epoch_log, step, record, new_keys)
  return record


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
  with (workdir_lock.WorkdirLock(workdir), fingerprint.noting_damage(workdir),
        contextlib.closing(anatomy.CompileWatch()) as watch):
    run, state, _, start_epoch, done = _setup(config, workdir, anatomy.RunClock(watch))
    if start_epoch == 0 and done is None:
      raise FileNotFoundError(f"no checkpoint in {run.checkpointer.directory} to evaluate; "
                              "train first or point --workdir at a trained run")
    return _create_evaluator(config, run).write_report(state, start_epoch,
                                                       done.steps if done else 0)


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


def _setup(config: ml_collections.ConfigDict, workdir: str, clock: anatomy.RunClock
           ) -> tuple[Run, steps.TrainState, Any, int, dict[str, Any] | None]:
  """Builds the model and state, restores the latest checkpoint, reads the data.

  Returns:
    (the Run's restored parts, the train state, the selection state (host copy), the epoch
    to start at, the steps of it trained before a preemption (None: none)). The state is
    returned beside the Run, not in it: the first step donates its buffers.
  """
  # Before anything compiles (jit of the initial state is the first).
  cache_dir = compilation_cache.configure(config.compilation_cache_dir,
                                          config.compilation_cache_min_seconds)
  mesh = sharding.create_mesh()
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes, config.model.dtype)
  tx = optim.create_optimizer(config.optimizer)
  kind = loss_steps.for_loss(config.loss, config.meta, data.num_classes)
  initial = run_state.checkpoint_tree(
      steps.create_train_state(jax.random.PRNGKey(config.seed), model, tx, data.image_shape,
                               mesh, kind.extra_state),
      bookkeeping.initial_state_of(config.dataset, config.selection),
      run_state.empty_partial(config.dataset, config.batch_size), mesh)
  checkpointer = checkpointing.Checkpointer(workdir, config.keep_checkpoints)
  # Before the restore: files added or deleted would show as a shape mismatch instead.
  listings = fingerprint.saved_listings(workdir)
  data_digests = fingerprint.check_resume(
      sources.identity(config.dataset, listings[0] if listings else None), listings,
      checkpointer.latest_meta(), workdir)
  saved, meta = _restore(checkpointer, initial, config)
  eval_fn = _jit_eval_step(config, model)
  with clock.part("data_open"):
    data_splits, data_readers = input_pipeline.load(config.dataset, mesh, config.seed)
  _record_dataset(config.dataset, workdir)
  checkpoint_meta = {"config": config.to_json_best_effort(sort_keys=True),
                     **_decoder_meta(data_readers["train"], meta)}
  if data_digests is not None:  # A folder's rows: a resume checks they are unchanged.
    checkpoint_meta["data_digests"] = data_digests
  run = Run(workdir=workdir, mesh=mesh, model=model, tx=tx, checkpointer=checkpointer,
            splits=data_splits, readers=data_readers, eval_fn=eval_fn, loss_kind=kind,
            train_batches=kind.train_batches(data_readers, config.seed, config.batch_size),
            checkpoint_meta=checkpoint_meta, compilation_cache=cache_dir)
  return (run, saved["train"], jax.tree.map(np.asarray, saved["selection"]),
          meta.get("epoch", 0), run_state.partial_from_checkpoint(
              saved["partial"], meta.get("epoch_step", 0), config.batch_size))


def _decoder_meta(reader, restored: dict[str, Any]) -> dict[str, str]:
  """{"decoder": what decodes a source dataset's images} for the checkpoints (nothing for an
  in-memory dataset), warning when a resume decodes them otherwise than the checkpoint's run
  did: the GPU's and the host's decoders give different pixels (docs/data.md), so the run
  then mixes the two, which is said, not done silently."""
  name = getattr(reader, "decoder_name", None)
  if name is None:
    return {}
  before = restored.get("decoder")
  if before is not None and before != name:
    logging.warning("The checkpoint's run decoded its images with %s; this resume decodes them "
                    "with %s, whose pixels differ: from here the run mixes the two. To keep "
                    "one decoder, resume with the checkpoint's dataset.decode where it runs.",
                    before, name)
  return {"decoder": name}


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


def _create_evaluator(config: ml_collections.ConfigDict, run: Run) -> evaluation.Evaluator:
  """The run's evaluator, built from the parts it uses: the eval step, the val/test data, the
  sentence naming the last good checkpoint and (FL_gamma) the test gammas' step."""
  num_classes = specs.DATASETS[config.dataset.name].num_classes
  gamma_step = run.loss_kind.gamma_step(run.model, steps.step_spec(config.dataset))
  return evaluation.Evaluator(
      run.eval_fn, run.mesh, {name: run.readers[name] for name in evaluation.SPLITS},
      {name: run.splits[name].labels for name in evaluation.SPLITS}, num_classes,
      config.eval_batch_size, functools.partial(run_context.last_good, run.checkpointer),
      config.evaluation, run.workdir,
      f"{config.dataset.name}, {config.model.name}, {config.loss.name}", run.splits["test"],
      config.dataset, gamma_step and _jit_inference(config, gamma_step))


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
  if changes := config_validation.resume_changes(meta["config"], config):
    logging.warning(changes)
  logging.info("Resumed from %s at global step %d (epoch %d, step %d of it).",
               checkpointer.directory, meta.get("step", -1), meta["epoch"],
               meta.get("epoch_step", 0))
  return saved, meta


def _jit_train_step(config: ml_collections.ConfigDict, model: nn.Module,
                    tx: optax.GradientTransformation, weighted: bool,
                    loss_kind: loss_steps.LossSteps) -> TrainFn:
  """The train step of the run's loss (`loss_kind`, cpjax.loss_steps: FL_gamma's is the
  bilevel `steps.meta_train_step`) with its model, optimizer and score bound; jitted once, the
  state donated. `weighted`: batches carry loss weights (the selector's)."""
  step = loss_kind.build_train_step(
      model, tx, scores.forward_score(config.selection.score, config.selection),
      steps.step_spec(config.dataset, config.loss, weighted))
  return jax.jit(step, donate_argnums=0,
                 compiler_options=compiler_options.compiler_options("train",
                                                                    config.xla_cpu_options))


def _jit_eval_step(config: ml_collections.ConfigDict, model: nn.Module) -> run_context.EvalFn:
  """The eval step (float32 logits) of the config's model; jitted once."""
  return _jit_inference(config, functools.partial(steps.eval_step, model=model,
                                                  spec=steps.step_spec(config.dataset)))


def _jit_inference(config: ml_collections.ConfigDict, step):
  """An eval-mode `step` jitted once with the inference XLA options (the eval step's, and
  an FL_gamma run's test gammas step)."""
  return jax.jit(step, compiler_options=compiler_options.compiler_options(
      "inference", config.xla_cpu_options))
