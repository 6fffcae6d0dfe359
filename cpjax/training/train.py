"""The training loop: `train_and_evaluate` and `evaluate_only` (docs/architecture.md).

`train_and_evaluate(config, workdir)` checks the config and everything the run needs
(cpjax.training.setup), restores the latest checkpoint in `workdir` if there is one, and runs
one loop over epochs, each of them one function read top to bottom (`_train_epoch`): choose
the epoch's rows, train them (cpjax.training.step_loop), evaluate and checkpoint when due.
After the loop, once the last checkpoint has committed and the last epoch's record is in
metrics.jsonl, `_write_report` writes the calibration report and adds its numbers to that
record, in a fresh run and in a rerun alike: a report that fails, or is killed, loses no
training and no record, a signal stops it at once, and a rerun (or --mode=evaluate) writes it.
"""

import contextlib
import logging
import os
import sys
from typing import Any

import jax
import ml_collections
import numpy as np
import optax

from cpjax import optim, run_state, steps
from cpjax.calibration import losses
from cpjax.data import fingerprint, splits
from cpjax.runtime import (
  anatomy,
  compilation_cache,
  failures,
  periodic,
  preemption,
  run_logging,
  workdir_lock,
)
from cpjax.selection import bookkeeping
from cpjax.training import evaluation, setup, step_loop

# The run's parts and stops; its two errors are also this module's interface (users catch them).
from cpjax.training.run import (  # noqa: F401
  NonFiniteLossError,
  Run,
  StalledTrainingError,
  epoch_record,
  last_good,
  raise_if_bad,
)

# What an epoch ends with: the state, the selection state, its record and its save's seconds.
EpochEnd = tuple[steps.TrainState, bookkeeping.SelectionState, dict[str, Any], float | None]


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
  try:
    with contextlib.closing(anatomy.CompileWatch()) as watch:
      clock = anatomy.RunClock(watch)
      setup.check_before_work(config, workdir)
      clock.mark_startup_done()
      with (workdir_lock.WorkdirLock(workdir), fingerprint.noting_damage(workdir),
            contextlib.closing(compilation_cache.CacheStats()) as cache_stats):
        return _train_and_evaluate(config, workdir, cache_stats, clock)
  except preemption.Preempted as stop:  # Its line last, after all the run's work and logs.
    logging.warning("%s", stop)
    raise


def _train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                        cache_stats: compilation_cache.CacheStats,
                        clock: anatomy.RunClock) -> dict[str, Any]:
  """Builds the run's parts, trains its epochs (`_train_epoch`) from the restored one, then
  writes the report of the last checkpoint (`_write_report`)."""
  run, state, selection_state, start_epoch, done = setup.setup_run(config, workdir, clock)
  writer = run_logging.create_writer(workdir)
  epoch_log = run_logging.EpochLog(workdir)
  epoch_log.keep_epochs_before(start_epoch)
  loop = setup.create_loop(config, run, writer, epoch_log, clock)
  loop.evaluator.import_report_libraries()
  if start_epoch < loop.num_epochs:
    clock.add("compile", setup.compile_loop_ahead(config, run, loop, state))
  if start_epoch == 0 and done is None:
    writer.write_hparams(run_logging.flat_hparams(config.to_dict()))
    run_logging.log_parameter_overview(config.model.name, state.params)
  record, save_seconds = {}, None
  with run.checkpointer.handling_preemption():
    try:
      for epoch in range(start_epoch, loop.num_epochs):
        state, selection_state, record, save_seconds = _train_epoch(
            config, run, loop, epoch, state, selection_state,
            done if epoch == start_epoch and done else run_state.NOTHING_DONE,
            first=epoch == start_epoch)
        if epoch == start_epoch:  # Its steps, scoring (and evaluation, if due) compiled.
          logging.info("%s", cache_stats.summary(run.compilation_cache))
          clock.watch.first_epoch_done()
      clock.watch.stop_watching_late()  # The report's programs are its own.
      # Else a partly trained epoch past the run's end (num_epochs lowered): no report.
      if start_epoch < loop.num_epochs or done is None:
        record = _write_report(run, loop, state, max(start_epoch, loop.num_epochs), record,
                               save_seconds)
      loop.evaluator.write_images()  # The last evaluation's, drawn while the report was built.
    finally:  # Also on errors: the last good checkpoint must finish writing. On an error's
      # way out what fails here is its detail: the run reports the failure it met first.
      with failures.detail_of(sys.exception()):
        run.checkpointer.wait_until_finished()
      loop.evaluator.write_images(raise_errors=False)
      with failures.detail_of(sys.exception()):
        writer.close()  # The event file: its last events written, the file closed.
  return record


def _train_epoch(config: ml_collections.ConfigDict, run: Run, loop: setup.Loop, epoch: int,
                 state: steps.TrainState, selection_state: bookkeeping.SelectionState,
                 done: run_state.Done, first: bool = False) -> EpochEnd:
  """One epoch, top to bottom: choose its rows, train its steps (their metrics folded and
  logged every log_every_steps), fold the epoch's record, evaluate when due, write the
  record and save when due. A preemption request saves the steps trained (the epoch's, or a
  whole epoch) and stops, through one save and one stop. `done`: the epoch's steps trained
  before a preemption; `first`: the process's first epoch (its first step compiles).
  Returns the state, the selection state, the epoch's record and the seconds of its
  checkpoint's save (None: no save), whose commit only the report waits for."""
  epoch_time = anatomy.Stopwatch()
  rows, weights, selection_state, timings = loop.selector.rows_for_epoch(epoch, state,
                                                                         selection_state)
  order = splits.epoch_order(config.seed, epoch, rows, config.batch_size)[:loop.epoch_steps[epoch]]
  first_step = int(jax.device_get(state.step)) - done.steps  # The epoch's first step.
  learning_rates = optim.learning_rates(config.optimizer, epoch, first_step, len(order),
                                        loop.total_steps, config.num_epochs)
  hparams = losses.scheduled_hparams(config.loss, epoch)
  batches = run.train_batches(order[done.steps:], epoch=epoch, first_step=first_step + done.steps,
                              row_weights=_row_weights(rows, weights, len(run.splits["train"])))
  # closing: a stop (preemption, divergence) also ends a stream reader's read-ahead.
  with (loop.clock.training(len(order) - done.steps, timings) as training,
        contextlib.closing(batches), step_loop.step_guard(config.step_transfer_guard)):
    state, totals, outputs, trained, stopped = step_loop.train_steps(
        loop.train_fn, state, training.timed(batches), learning_rates, hparams, done,
        first_step=first_step, epoch=epoch, log_every=config.log_every_steps,
        window_steps=loop.window_steps, writer=loop.writer, progress=loop.progress,
        checkpointer=run.checkpointer, compile_step=done.steps if first else -1)
    jax.block_until_ready(state)  # The steps dispatched ahead: their compute is training's.
  outputs = step_loop.host_outputs(outputs, done.outputs)
  if trained < len(order):  # Stopped mid-epoch: its sums and outputs go into the checkpoint.
    raise_if_bad(totals, epoch, first_step, run.checkpointer)
    partial = run_state.partial_tree(config.dataset, config.batch_size, totals, outputs)
    return state, selection_state, {}, _save_when_due(
        config, run, loop, state, selection_state, epoch, stopped, trained, partial)
  record = epoch_record(totals, epoch, len(order), first_step, run.checkpointer,
                        config.loss.name, learning_rates[0], hparams)
  selection_state, selection_record = loop.selector.after_epoch(
      epoch, selection_state, order, outputs, timings, run.workdir)
  record.update(selection_record, epoch=epoch)
  if first and run.provenance:  # The sitting's first record says where and when it ran.
    record["provenance"] = run.provenance
  if periodic.due(epoch, config.eval_every_epochs, loop.num_epochs):
    with loop.clock.part("eval", record):  # A non-finite logit stops the run here.
      record.update(loop.evaluator.run(state, loop.writer, first_step + len(order)))
  record["epoch_seconds"] = epoch_time.seconds
  run_logging.write_record(loop.writer, loop.epoch_log, first_step + len(order), record)
  return state, selection_state, record, _save_when_due(
      config, run, loop, state, selection_state, epoch, stopped)


def _save_when_due(config: ml_collections.ConfigDict, run: Run, loop: setup.Loop,
                   state: steps.TrainState, selection_state: bookkeeping.SelectionState,
                   epoch: int, stopped: bool, trained: int = 0,
                   partial: dict[str, Any] | None = None) -> float | None:
  """After `epoch`, complete, or `trained` steps of it (their sums and outputs in `partial`):
  saves the checkpoint when due or `stopped` (a preemption request), and stops the run there
  for a preemption. Returns the save's own seconds (its commit is waited for after the loop),
  or None: no save."""
  # Where a resume starts: the next epoch, or this one's step after those trained.
  at_epoch, at_step = (epoch + 1, 0) if partial is None else (epoch, trained)
  if not (stopped or periodic.due(epoch, config.checkpoint_every_epochs, loop.num_epochs)):
    return None
  if partial is None:  # An epoch's boundary: nothing of the next one trained.
    partial = run_state.empty_partial(config.dataset, config.batch_size)
  with loop.clock.part("checkpoint") as saving:
    step = _save(run, state, selection_state, partial, at_epoch, at_step)
  if stopped and at_epoch < loop.num_epochs:  # The one preemption stop (after the run's
    # last step nothing is left to resume: the report after the loop answers it).
    run.checkpointer.stop_preempted(step, at_epoch, at_step)
  return saving.seconds


def _save(run: Run, state: steps.TrainState, selection_state: bookkeeping.SelectionState,
          partial: dict[str, np.ndarray], epochs_done: int, epoch_step: int) -> int:
  """The one save: a checkpoint named by the global step, which it returns, of `epochs_done`
  complete epochs and `epoch_step` steps of the next (their sums and outputs in `partial`),
  with the run's own metadata (its config, a folder dataset's digests). Parameters that are
  not finite are never saved (the checkpointer's rotation contract)."""
  step = int(jax.device_get(state.step))
  if not np.isfinite(float(jax.device_get(_global_norm(state.params)))):
    raise NonFiniteLossError(f"non-finite parameters at global step {step} (epoch "
                             f"{epochs_done}); the run stopped without saving them. "
                             f"{last_good(run.checkpointer)}")
  run.checkpointer.save(step, run_state.checkpoint_tree(state, selection_state, partial,
                                                        run.mesh),
                        {"epoch": epochs_done, "epoch_step": epoch_step, "step": step,
                         **run.checkpoint_meta})
  return step


_global_norm = jax.jit(optax.tree.norm)


def peak_device_memory() -> dict[str, int]:
  """{"perf/peak_device_memory_bytes": the most bytes any local device has held at once in
  this process (its allocator's peak)} where the backend counts them (GPU, TPU); {} where
  it does not (CPU: `memory_stats()` is None)."""
  peaks = [(device.memory_stats() or {}).get("peak_bytes_in_use")
           for device in jax.local_devices()]
  peaks = [int(p) for p in peaks if p is not None]
  return {"perf/peak_device_memory_bytes": max(peaks)} if peaks else {}


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


def _write_report(run: Run, loop: setup.Loop, state: steps.TrainState, epochs: int,
                  record: dict[str, Any], save_seconds: float | None) -> dict[str, Any]:
  """Writes the calibration report of the last checkpoint (`state`, after `epochs` complete
  epochs) to workdir/report and TensorBoard, once that checkpoint has committed, and its
  numbers into the last epoch's metrics.jsonl record, unless both already hold it: after the
  loop, of a fresh run and of a rerun alike (whose report failed, or was killed, after that
  checkpoint was saved). A signal stops it at once. `record`: the last epoch's record if this
  process trained it ({}: read from metrics.jsonl); `save_seconds`: its checkpoint's save, if
  this process saved it. Returns the record with the report's numbers and times."""
  step = int(jax.device_get(state.step))
  described = loop.evaluator.describes(step)
  if not described:  # The report's fits start while the checkpoint commits.
    loop.evaluator.start_report(state)
  with loop.clock.part("checkpoint") as committing:
    run.checkpointer.wait_until_finished()  # The last checkpoint commits first.
  if described:
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
      "checkpoint_seconds": save_seconds + committing.seconds}
  with (run.checkpointer.stopping_at_once(_REPORT_STOP.format(step=step), step),
        loop.clock.part("report") as reporting):
    results = loop.evaluator.write_report(state, epochs)
    evaluation.write_report_images(loop.writer, step, results)
    numbers = evaluation.report_record(results)
  times["report_seconds"] = reporting.seconds
  parts = loop.clock.anatomy()  # The process's run anatomy: logged, and in results.json.
  logging.info("%s", anatomy.summary_line(parts))
  loop.evaluator.add_to_results({"anatomy": parts})
  numbers.update(**times, **peak_device_memory(), **parts)
  record = record or {}
  # The last epoch's seconds take in its checkpoint's and its report's. TensorBoard holds
  # the epoch's record at this step (its epoch wrote it): the rest only, with the report's
  # own scalars. Last: metrics.jsonl's record marks the report complete.
  tensorboard = {k: v for k, v in numbers.items() if k not in record}
  record = {**record, **numbers, "epoch": epoch,
            "epoch_seconds": record.get("epoch_seconds", 0.0) + sum(times.values())}
  run_logging.write_record(loop.writer, loop.epoch_log, step, record,
                           {**tensorboard, **evaluation.report_scalars(results)})
  return record


def evaluate_only(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Restores the latest checkpoint in `workdir` and writes its report, no training.

  Returns:
    The report (also written to workdir/report).

  Raises:
    FileNotFoundError: `workdir` has no checkpoint.
  """
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):  # Before setup_run creates it.
    raise FileNotFoundError(f"no checkpoints/ in --workdir {workdir!r} to evaluate; train "
                            "first or point --workdir at a trained run")
  setup.check_before_work(config, workdir, "evaluate")
  with (workdir_lock.WorkdirLock(workdir), fingerprint.noting_damage(workdir),
        contextlib.closing(anatomy.CompileWatch()) as watch):
    run, state, _, start_epoch, done = setup.setup_run(config, workdir, anatomy.RunClock(watch))
    if start_epoch == 0 and done is None:
      raise FileNotFoundError(f"no checkpoint in {run.checkpointer.directory} to evaluate; "
                              "train first or point --workdir at a trained run")
    return setup.create_evaluator(config, run).write_report(state, start_epoch,
                                                       done.steps if done else 0)
