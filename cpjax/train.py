"""The training loop: `train_and_evaluate` and `evaluate_only`.

`train_and_evaluate(config, workdir)` validates the config, restores the latest
checkpoint in `workdir` if there is one, and runs one loop over epochs: choose
the epoch's rows (cpjax.selection), train them with the jitted train step
(cpjax.steps), log train metrics every `log_every_steps`, evaluate and
checkpoint when `run_context.due`, and write the calibration report after the last epoch
(cpjax.evaluation), once that epoch's checkpoint has committed: a report that fails loses no
training, and a rerun (or --mode=evaluate) writes it. Start-up checks (cpjax.preflight) run
before the workdir is touched; an epoch that learns nothing stops the run.
"""

from collections.abc import Iterator
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from cpjax import (
  config_validation,
  evaluation,
  models,
  optim,
  preflight,
  run_context,
  run_state,
  steps,
)
from cpjax.calibration import gamma_net, losses
from cpjax.data import input_pipeline, specs, splits

# Run and NonFiniteLossError are part of this module's interface (users catch the error).
from cpjax.run_context import NonFiniteLossError, Run
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

EPOCH_SUMS = ("loss_sum", "correct", "count", "first_bad_step")  # Summed over an epoch.
# Also kept over an epoch: the largest gradient norm and the smallest and largest batch mean
# loss; a whole epoch with a zero gradient or one exact loss value learned nothing.
_EXTREMES = {"grad_norm_max": np.inf, "loss_min": -np.inf, "loss_max": np.inf}  # Unknown.


class StalledTrainingError(RuntimeError):
  """A whole epoch trained with a gradient exactly zero or a loss exactly constant."""


@dataclasses.dataclass
class EpochPlan:
  """One epoch's input: its rows, and what a mid-epoch checkpoint must hold to resume it.

  The rows (and weights) are a pure function of the selection state, the seed and the
  epoch, so a resumed epoch recomputes them and trains the same ceil(rows / batch_size)
  steps: the number of rows may differ between epochs (infobatch), never between runs.
  """
  epoch: int
  rows: np.ndarray
  selection_state: bookkeeping.SelectionState  # After this epoch's scoring pass.
  done: dict[str, Any] | None = None  # Steps already trained: steps, totals, outputs.
  weights: np.ndarray | None = None  # Loss weight of each of `rows` (infobatch); None: none.


@dataclasses.dataclass
class LoopHooks:
  """The loop's side channels: metric writer, progress report, preemption guard."""
  writer: Any
  progress: Any
  guard: preemption.PreemptionGuard | None = None
  stop_after_epoch: bool = False  # A stop was requested at an epoch's last step.
  compiled: bool = False  # The train step has run once in this process (compiled).


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
  chooser = selector.Selector(config, run.readers["train"], run.mesh)
  train_fn = _jit_train_step(config, run.model, run.tx, chooser.weighted)
  run.epoch_steps = _epoch_steps([chooser.steps_in_epoch(e) for e in range(config.num_epochs)],
                                 config.budget_steps)
  writer = run_logging.create_writer(workdir)
  epoch_log = run_logging.EpochLog(workdir)
  epoch_log.keep_epochs_before(run.start_epoch)
  epoch_writer = run_logging.create_epoch_writer(writer, epoch_log)  # TensorBoard + jsonl.
  progress = run_logging.create_progress_reporter(run.total_steps, writer,
                                                  config.log_every_steps)
  if run.start_epoch == 0 and run.partial is None:
    writer.write_hparams(run_logging.flat_hparams(config.to_dict()))
  state, selection_state, record = run.state, run.selection, {}
  _finish_report(run)
  with preemption.PreemptionGuard() as guard:
    hooks = LoopHooks(writer, progress, guard)
    try:
      for epoch in range(run.start_epoch, run.num_epochs):
        start = time.time()
        rows, weights, selection_state, timings = chooser.rows_for_epoch(epoch, state,
                                                                         selection_state)
        plan = EpochPlan(epoch, rows, selection_state,
                         run.partial if epoch == run.start_epoch else None, weights)
        train_start = time.perf_counter()
        with progress.timed("train", wait_jax_async_dispatch=False):
          state, record, order, per_example = train_epoch(run, train_fn, state, plan, hooks)
        timings["training_seconds"] = time.perf_counter() - train_start
        selection_state, selection_record = chooser.after_epoch(
            epoch, selection_state, order, per_example, timings, workdir)
        record.update(selection_record)
        last, logits = epoch + 1 == run.num_epochs, None
        if last:  # Committed before the report: a report that fails loses no training.
          logits = evaluation.final_logits(run, state)  # Non-finite: stops, nothing saved.
          step = _save(run, state, selection_state, epochs_done=epoch + 1)
          run.checkpointer.wait_until_finished()
        global_step = int(jax.device_get(state.step))
        record.update(evaluation.evaluate_when_due(run, state, epoch, writer, global_step,
                                                   logits))
        record.update(epoch=epoch, epoch_seconds=time.time() - start)
        epoch_writer.write_scalars(global_step, record)
        if epoch == run.start_epoch:  # Its steps, scoring (and evaluation, if due) compiled.
          logging.info("%s", cache_stats.summary(run.compilation_cache))
        if not last and (run_context.due(epoch, config.checkpoint_every_epochs,
                                         run.num_epochs) or hooks.stop_after_epoch):
          step = _save(run, state, selection_state, epochs_done=epoch + 1)
        if hooks.stop_after_epoch and epoch + 1 < run.num_epochs:
          _stop_preempted(run, step, epoch + 1, 0, guard.signal_name)
    finally:  # Also on errors: the last good checkpoint must finish writing.
      run.checkpointer.wait_until_finished()
      writer.flush()
  return record


def _finish_report(run: Run) -> None:
  """Writes the report of a run whose training is complete but whose report is missing or
  describes another checkpoint (the report failed after the last checkpoint was saved)."""
  if run.start_epoch < run.num_epochs or run.partial is not None:
    return
  step = int(jax.device_get(run.state.step))
  if not evaluation.report_describes(run, step):
    logging.warning("Training is complete (checkpoint %d) but report/ does not describe it; "
                    "writing the report now.", step)
    evaluation.write_final_report(run, run.state, run.start_epoch)


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
    return evaluation.write_final_report(run, run.state, run.start_epoch,
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
  initial = {"train": steps.create_train_state(jax.random.PRNGKey(config.seed), model, tx,
                                               data.image_shape, mesh,
                                               run_state.meta_parts(config)),
             "selection": sharding.replicate(mesh, bookkeeping.initial_state_of(
                 config.dataset, config.selection)),
             "partial": sharding.replicate(mesh, run_state.empty_partial(config.dataset,
                                                                         config.batch_size))}
  checkpointer = checkpointing.Checkpointer(workdir, config.keep_checkpoints)
  saved, meta = _restore(checkpointer, initial, config)
  eval_fn = _jit_eval_step(config, model)
  data_splits, data_readers = input_pipeline.load(config.dataset, mesh)
  return Run(config, workdir, mesh, model, tx, checkpointer, data_splits, data_readers,
             eval_fn, saved["train"], jax.tree.map(np.asarray, saved["selection"]),
             meta.get("epoch", 0), _partial_from_checkpoint(saved["partial"], meta, config),
             compilation_cache=cache_dir)


def _partial_from_checkpoint(saved: dict[str, Any], meta: dict[str, Any],
                             config: ml_collections.ConfigDict) -> dict[str, Any] | None:
  """The trained part of an epoch from a mid-epoch checkpoint's subtree, else None."""
  done_steps = meta.get("epoch_step", 0)
  if not done_steps:
    return None
  saved = jax.tree.map(np.asarray, saved)
  rows = done_steps * config.batch_size
  return {"steps": done_steps,
          # The extremes of the steps before the checkpoint are not saved: left unknown.
          "totals": {"loss_sum": saved["loss_sum"], "correct": saved["correct"],
                     "count": saved["count"], "first_bad_step": np.int32(steps.NO_BAD_STEP),
                     **{k: np.float32(v) for k, v in _EXTREMES.items()}},
          "outputs": {k: saved[f"each_{k}"][:rows] for k in run_state.PER_EXAMPLE}}


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


def _save(run: Run, state: steps.TrainState, selection_state: bookkeeping.SelectionState,
          epochs_done: int, partial: dict[str, np.ndarray] | None = None,
          epoch_step: int = 0) -> int:
  """Saves a checkpoint named by the global step; returns that step.

  `epochs_done` complete epochs; with `partial`, also `epoch_step` steps of the next.
  """
  step = int(jax.device_get(state.step))
  if not np.isfinite(float(jax.device_get(_global_norm(state.params)))):
    raise NonFiniteLossError(f"non-finite parameters at global step {step} (epoch "
                             f"{epochs_done}); the run stopped without saving them. "
                             f"{run_context.last_good(run)}")
  run.checkpointer.save(step, {
      "train": state, "selection": sharding.replicate(run.mesh, selection_state),
      "partial": sharding.replicate(run.mesh, partial or run_state.empty_partial(
          run.config.dataset, run.config.batch_size))},
      {"epoch": epochs_done, "epoch_step": epoch_step, "step": step,
       "config": run.config.to_json_best_effort(sort_keys=True)})
  return step


def _jit_train_step(config: ml_collections.ConfigDict, model, tx, weighted: bool):
  """The train step with the config's model, optimizer, loss and score bound; jitted once.
  `weighted`: batches carry loss weights (the selector's). FL_gamma losses train with the
  bilevel `steps.meta_train_step` instead."""
  score_fn = scores.forward_score(config.selection.score)
  meta = run_state.meta_parts(config)
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


def _jit_eval_step(config: ml_collections.ConfigDict, model):
  """The eval step (float32 logits) of the config's model; jitted once."""
  return jax.jit(functools.partial(steps.eval_step, model=model,
                                   spec=steps.step_spec(config.dataset)),
                 compiler_options=compiler_options.compiler_options("inference",
                                                                    config.xla_cpu_options))


_global_norm = jax.jit(optax.tree.norm)


@jax.jit
def _accumulate(totals: dict[str, jax.Array], batch_metrics: dict[str, jax.Array]):
  """Sums batch metrics on device (min for the first non-finite step and the smallest loss,
  max for the largest gradient norm and loss)."""
  # Not clu.metrics (Average / Accuracy .merge): the same float32 additions, but the sums are
  # checkpointed mid-epoch as plain arrays (run_state's "partial") and first_bad_step is a
  # min, which clu.metrics has no metric for; a Collection would wrap three additions.
  combine = {"first_bad_step": jnp.minimum, "loss_min": jnp.minimum,
             "grad_norm_max": jnp.maximum, "loss_max": jnp.maximum}
  return {k: combine.get(k, jnp.add)(v, batch_metrics[k]) for k, v in totals.items()}


def _epoch_sums(batch_metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """What `_accumulate` keeps of one step's metrics."""
  mean_loss = batch_metrics["loss_sum"] / batch_metrics["count"]
  return {**{k: batch_metrics[k] for k in EPOCH_SUMS}, "grad_norm_max": batch_metrics["grad_norm"],
          "loss_min": mean_loss, "loss_max": mean_loss}


def _fold_steps(totals: dict[str, jax.Array] | None, window: list[dict[str, jax.Array]]
                ) -> dict[str, jax.Array] | None:
  """`totals` (None: nothing yet) plus the epoch sums of each step's metrics, in order."""
  for batch_metrics in window:
    sums = _epoch_sums(batch_metrics)
    totals = sums if totals is None else _accumulate(totals, sums)
  return totals


@jax.jit
def _fold_window(totals: dict[str, jax.Array] | None, window: list[dict[str, jax.Array]]
                 ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """A logging window in one dispatch: `_fold_steps` (the same sums, in the same order) and
  its metrics stacked for the log ([steps] per metric). Summing per window rather than per
  step keeps the loop at one dispatch per step (the step's)."""
  return _fold_steps(totals, window), jax.tree.map(lambda *v: jnp.stack(v), *window)


def train_epoch(run: Run, train_fn, state: steps.TrainState, plan: EpochPlan, hooks: LoopHooks):
  """Trains one epoch over `plan.rows` in the epoch's deterministic order.

  Every `log_every_steps` steps, the window's train metrics go to the writer and
  a non-finite loss stops the run. A preemption request saves a checkpoint after
  the current step and raises `preemption.Preempted`. With `plan.done`, the
  first steps were trained before a preemption and are skipped.

  Returns:
    (state, epoch record, order [steps, B] of the rows trained, per-example
    train-pass outputs flattened in that order).
  """
  config, epoch = run.config, plan.epoch
  order = splits.epoch_order(config.seed, epoch, plan.rows, config.batch_size)
  if run.epoch_steps:  # A step budget cuts the last epoch short (else this keeps all).
    order = order[:run.epoch_steps[epoch]]
  loss_hparams = {k: np.float32(v) for k, v in losses.scheduled_hparams(config.loss, epoch).items()}
  done = plan.done or {"steps": 0, "totals": None, "outputs": None}
  epoch_start_step = int(jax.device_get(state.step)) - done["steps"]
  totals = None if done["totals"] is None else jax.device_put(done["totals"])
  outputs, window = [], []
  row_weights = _row_weights(plan, len(run.splits["train"]))
  epoch_learning_rate = _learning_rate(run, epoch, epoch_start_step)
  # closing: a stop inside the epoch (preemption, divergence) also ends a stream reader's
  # read-ahead, of the training and of the meta-validation batches. The transfer guard
  # (config.step_transfer_guard) covers the loop, its logging points and saves excepted
  # (`_host_point`): a step that waits on a device value stalls an accelerator
  # (tests/test_transfer_guard.py counts such reads on CPU, where the guard cannot fire).
  with contextlib.closing(run.readers["train"].batches(
      order[done["steps"]:], row_weights=row_weights)) as train_batches, \
      contextlib.closing(_meta_batches(run, epoch_start_step + done["steps"],
                                       len(order) - done["steps"])) as meta_batches, \
      _step_guard(config.step_transfer_guard):
    for i, (train_batch, meta_batch) in enumerate(zip(train_batches, meta_batches),
                                                  start=done["steps"]):
      learning_rate = _learning_rate(run, epoch, epoch_start_step + i)
      batch = {**train_batch, **meta_batch}
      if not hooks.compiled:
        compile_start = time.perf_counter()
        logging.info("Compiling the train step (the first step waits for it)...")
      state, batch_metrics, per_example = train_fn(state, batch, learning_rate, loss_hparams)
      if not hooks.compiled:  # Waits for the first step once, to time the compile.
        jax.block_until_ready(batch_metrics)
        logging.info("Train step compiled; the first step took %.1f s.",
                     time.perf_counter() - compile_start)
        hooks.compiled = True
      window.append(batch_metrics)  # Summed into `totals` at a logging point or a stop.
      outputs.append(per_example)
      hooks.progress(epoch_start_step + i + 1)
      if (i + 1) % config.log_every_steps == 0:
        totals, stacked = _fold_window(totals, window)
        with _host_point():
          _log_train_window(run, hooks.writer, stacked, epoch_start_step + i + 1, epoch,
                            epoch_start_step, learning_rate)
        window = []
      if hooks.guard is not None and hooks.guard.should_stop(epoch_start_step + i + 1):
        if i + 1 == len(order):  # The epoch is complete: the loop saves it whole, then stops.
          hooks.stop_after_epoch = True
        else:
          totals, window = _fold_steps(totals, window), []
          with _host_point():
            _save_preempted(run, state, plan, totals, _host_outputs(outputs, done["outputs"]),
                            i + 1, epoch_start_step, hooks.guard.signal_name)
  totals = _fold_steps(totals, window)  # The steps after the last logging point.
  _raise_if_bad(run, totals, epoch, epoch_start_step)
  totals = jax.device_get(totals)
  _raise_if_stalled(run, totals, epoch, len(order))
  per_example = _host_outputs(outputs, done["outputs"])
  record = {"train_loss": float(totals["loss_sum"] / totals["count"]),
            "train_accuracy": float(totals["correct"] / totals["count"]),
            "learning_rate": float(epoch_learning_rate),  # At the epoch's first step.
            **{k: float(v) for k, v in loss_hparams.items()}}
  return state, record, order, per_example


def _step_guard(level: str) -> contextlib.AbstractContextManager:
  """JAX's transfer guard on device-to-host copies at `level`, around the step loop. It fires
  on accelerators only: a CPU device's buffers are host memory, read without a copy."""
  return jax.transfer_guard_device_to_host(level)


def _host_point() -> contextlib.AbstractContextManager:
  """Where the step loop may copy device values to the host (logging, a checkpoint)."""
  return jax.transfer_guard_device_to_host("allow")


def _learning_rate(run: Run, epoch: int, step: int) -> np.float32:
  """The learning rate of global step `step` (0-indexed) in `epoch` (optim)."""
  return np.float32(optim.learning_rate_of_step(run.config.optimizer, epoch, step,
                                                run.total_steps, run.config.num_epochs))


def _meta_batches(run: Run, first_step: int, num_steps: int
                  ) -> Iterator[dict[str, jax.Array]]:
  """The meta-validation batches of global steps first_step, first_step + 1, ... (FL_gamma
  runs; else empty dicts): a reshuffling walk over the meta-validation split, a function of
  the step, read ahead by a stream reader like the training batches."""
  meta_reader = run.readers.get("meta_val")
  if meta_reader is None:
    yield from itertools.repeat({}, num_steps)
    return
  if num_steps == 0:
    return
  rows = np.stack([splits.cycled_rows(run.config.seed, first_step + s, len(meta_reader),
                                      run.config.batch_size) for s in range(num_steps)])
  with contextlib.closing(meta_reader.batches(rows)) as batches:
    for meta in batches:
      yield {"meta_image": meta["image"], "meta_label": meta["label"]}


def _row_weights(plan: EpochPlan, num_rows: int) -> np.ndarray | None:
  """The plan's weights indexed by training row (None when the plan has none)."""
  if plan.weights is None:
    return None
  weights = np.ones(num_rows, np.float32)
  weights[plan.rows] = plan.weights
  return weights


def _host_outputs(outputs: list[dict[str, jax.Array]],
                  earlier: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
  """The per-example outputs of an epoch's steps, flattened in training order, on the host."""
  if not outputs:
    return dict(earlier)
  gathered = {k: [np.asarray(v) for v in sharding.to_host([o[k] for o in outputs])]
              for k in outputs[0]}
  return {k: np.concatenate(([earlier[k]] if earlier else []) + v) for k, v in gathered.items()}


def _save_preempted(run: Run, state: steps.TrainState, plan: EpochPlan, totals, outputs,
                    epoch_step: int, epoch_start_step: int, signal_name: str) -> None:
  """Saves the state after `epoch_step` steps of `plan.epoch`, waits for it, raises Preempted."""
  _raise_if_bad(run, totals, plan.epoch, epoch_start_step)  # Never save a diverged state.
  totals = jax.device_get(totals)
  partial = run_state.empty_partial(run.config.dataset, run.config.batch_size)
  partial.update({k: np.float32(totals[k]) for k in ("loss_sum", "correct", "count")})
  for k in run_state.PER_EXAMPLE:
    partial[f"each_{k}"][:len(outputs[k])] = outputs[k]
  step = _save(run, state, plan.selection_state, plan.epoch, partial, epoch_step)
  _stop_preempted(run, step, plan.epoch, epoch_step, signal_name)


def _stop_preempted(run: Run, step: int, epoch: int, epoch_step: int, signal_name: str) -> None:
  """Waits for the checkpoint at global `step` to commit, logs one line, raises Preempted."""
  run.checkpointer.wait_until_finished()
  message = (f"{signal_name}: saved a checkpoint at global step {step} (epoch {epoch}, step "
             f"{epoch_step} of it) in {run.checkpointer.directory}; rerun the same command to "
             "resume there.")
  logging.warning(message)
  raise preemption.Preempted(message, step)


def _log_train_window(run: Run, writer, stacked: dict[str, jax.Array], step: int,
                      epoch: int, epoch_start_step: int, learning_rate: np.float32) -> None:
  """Writes the train metrics of the steps up to global `step` (as flax and big_vision
  log them) and stops the run if one of their losses was not finite."""
  stacked = jax.device_get(stacked)  # [steps] per metric: one transfer each.
  window = [{k: v[i] for k, v in stacked.items()} for i in range(len(stacked["count"]))]
  _raise_if_bad(run, {"first_bad_step": min(m["first_bad_step"] for m in window)}, epoch,
                epoch_start_step)
  count = sum(float(m["count"]) for m in window)
  scalars = {
      "train/loss": sum(float(m["loss_sum"]) for m in window) / count,
      "train/accuracy": sum(float(m["correct"]) for m in window) / count,
      "train/learning_rate": float(learning_rate),
      "train/grad_norm": float(np.mean([m["grad_norm"] for m in window])),
      "train/param_norm": float(window[-1]["param_norm"]),
  }
  if "meta_loss" in window[-1]:  # FL_gamma: the meta-objective and gamma-Net's mean gamma.
    scalars["train/meta_loss"] = float(np.mean([m["meta_loss"] for m in window]))
    scalars["train/gamma_mean"] = sum(float(m["gamma_sum"]) for m in window) / count
  writer.write_scalars(step, scalars)


def _raise_if_bad(run: Run, totals: dict[str, Any], epoch: int, epoch_start_step: int) -> None:
  bad = int(jax.device_get(totals["first_bad_step"]))
  if bad != steps.NO_BAD_STEP:
    raise NonFiniteLossError(
        f"non-finite training loss at epoch {epoch}, step {bad - epoch_start_step} of the "
        f"epoch (global step {bad}); the run stopped without saving this state. "
        f"{run_context.last_good(run)} Lower the learning rate or enable gradient clipping.")




def _raise_if_stalled(run: Run, totals: dict[str, np.ndarray], epoch: int, num_steps: int
                      ) -> None:
  """Stops a run whose epoch learned nothing: a gradient exactly zero at every step, or the
  same batch mean loss, bit for bit, at every one of several steps (different batches)."""
  zero_gradient = float(totals["grad_norm_max"]) == 0.0
  constant_loss = num_steps > 1 and float(totals["loss_min"]) == float(totals["loss_max"])
  if not (zero_gradient or constant_loss):
    return
  what = ("the gradient was exactly zero" if zero_gradient else
          f"the training loss was exactly {float(totals['loss_min'])!r}")
  raise StalledTrainingError(
      f"the run learns nothing: at every one of the {num_steps} steps of epoch {epoch} {what}; "
      f"the run stopped without saving this state. {run_context.last_good(run)} Check the "
      f"loss and its hyperparameters (loss.name={run.config.loss.name!r}; an FL_gamma loss "
      "needs meta.max_gamma > 0 and a meta.temperature that keeps gamma-Net's softmax "
      "finite) and the learning rate.")
