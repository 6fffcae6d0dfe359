"""The training loop's set-up (cpjax.training.train runs it): the checks before any work, the
run's parts built and its checkpoint restored, and the loop's parts (`Loop`) compiled ahead.

`check_before_work` validates the config (cpjax.config.validation) and the workdir and runs
the start-up checks (cpjax.config.preflight) before the workdir is touched. `setup_run`
builds the model and state, restores the latest checkpoint, refuses a folder dataset (or its
converted records) changed under its checkpoint (cpjax.data.fingerprint), unless the change
is the replacement of a file the run stopped on as damaged, and opens the data. `create_loop`
builds the selector, the jitted train step (the loss's step and batches from
cpjax.training.loss_steps), each epoch's steps and the evaluator; `compile_loop_ahead`
compiles their programs before the first epoch. The builders it uses (`create_selector`,
`jit_train_step`, `jit_eval_step`) are public: the benchmarks build the loop's own parts
with them.
"""

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax

from cpjax import models, optim, run_state, steps
from cpjax.calibration import losses
from cpjax.config import implied, preflight, validation
from cpjax.data import fingerprint, input_pipeline, sources, specs, splits
from cpjax.runtime import (
  anatomy,
  checkpointing,
  compilation_cache,
  compile_ahead,
  compiler_options,
  metric_writers,
  provenance,
  run_logging,
  sharding,
)
from cpjax.selection import bookkeeping, score_sources, scores, selector
from cpjax.training import evaluation, loss_steps, step_loop
from cpjax.training.run import EvalFn, Run, last_good

# The jitted train step: (state, batch, learning rate, loss hyper-parameters) -> (state, batch
# metrics, per-example outputs); the state donated (cpjax.training.loss_steps builds it).
TrainFn = Callable[[steps.TrainState, dict[str, Any], np.float32, dict[str, np.float32]],
                   tuple[steps.TrainState, dict[str, jax.Array], dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class Loop:
  """The loop's parts, beside the Run: built by `create_loop` (for cpjax.training.train's
  `_train_and_evaluate`) once the selector knows the epochs' sizes (`evaluate_only` needs none
  of them). None changes while the run trains."""
  selector: selector.Selector  # Each epoch's rows.
  train_fn: TrainFn  # jitted, the state donated.
  epoch_steps: tuple[int, ...]  # Steps of each epoch the run trains.
  evaluator: evaluation.Evaluator  # val/test metrics and the final report.
  writer: metric_writers.MetricWriter  # TensorBoard and the log.
  epoch_log: run_logging.EpochLog  # metrics.jsonl.
  progress: metric_writers.ProgressReport  # Steps/s and ETA, on the clock.
  clock: anatomy.RunClock  # Where the process's wall clock goes (cpjax.runtime.anatomy).
  window_steps: int  # Steps a logging window's metrics fold over (step_loop.window_steps).

  @property
  def num_epochs(self) -> int:
    """Epochs the run trains: config.num_epochs, fewer where budget_steps runs out first."""
    return len(self.epoch_steps)

  @property
  def total_steps(self) -> int:
    return sum(self.epoch_steps)


def create_loop(config: ml_collections.ConfigDict, run: Run,
                writer: metric_writers.MetricWriter, epoch_log: run_logging.EpochLog,
                clock: anatomy.RunClock) -> Loop:
  """The loop's parts: the selector, the train step, each epoch's steps, the evaluator, and
  the run's `writer` (TensorBoard, the log) and `epoch_log` (metrics.jsonl) with the writers
  built on them."""
  chooser = create_selector(config, run, clock)
  epoch_steps = _epoch_steps([chooser.steps_in_epoch(e) for e in range(config.num_epochs)],
                             config.budget_steps)
  return Loop(
      selector=chooser, train_fn=jit_train_step(config, run.model, run.tx, chooser.weighted,
                                                     run.loss_kind),
      epoch_steps=epoch_steps, evaluator=create_evaluator(config, run), writer=writer,
      epoch_log=epoch_log, progress=metric_writers.ProgressReport(
          sum(epoch_steps), writer, config.log_every_steps, clock), clock=clock,
      window_steps=step_loop.window_steps(config.log_every_steps, epoch_steps))


def compile_loop_ahead(config: ml_collections.ConfigDict, run: Run, loop: Loop,
                       state: steps.TrainState) -> float:
  """Compiles the loop's programs (the train step and its metric windows, the eval step, the
  selected epochs' scoring step and ranking) in threads before the first epoch
  (cpjax.runtime.compile_ahead), for batches built as the loop builds them. Returns the seconds
  waited for them."""
  logging.info("Compiling the loop's programs ahead (the train, eval and scoring steps), %d "
               "at a time...", compile_ahead.THREADS)
  _compile_readers_ahead(config, run)
  compiler = compile_ahead.Compiler()
  if specs.DATASETS[config.dataset.name].encoded:
    # Its first batches would be decoded here, ahead of the loop (a damaged image then ends
    # the run before its first checkpoint): its steps compile at their first call, in the
    # first epoch; the ranking of its selected epochs reads no image, and compiles here.
    loop.selector.compile_ranking_ahead(compiler)
    return compiler.wait()
  abstract_state = compile_ahead.abstract(state)
  train_rows = np.arange(min(config.batch_size, len(run.splits["train"])))[None]
  row_weights = (np.ones(len(run.splits["train"]), np.float32) if loop.selector.weighted
                 else None)
  item = compile_ahead.first_item(run.train_batches(train_rows, epoch=0, first_step=0,
                                                    row_weights=row_weights))
  hparams = losses.scheduled_hparams(config.loss, 0)
  compiler.submit("the train step", loop.train_fn, abstract_state, compile_ahead.abstract(item),
                  np.float32(0), hparams,
                  then=lambda c: step_loop.compile_windows_ahead(c, loop.window_steps))
  batches = [compile_ahead.abstract(steps.first_predict_batch(
      run.readers[name], run.mesh, config.eval_batch_size)) for name in evaluation.SPLITS]
  for batch in {repr(b): b for b in batches}.values():  # One program for alike batches.
    compiler.submit("the eval step", run.eval_fn, abstract_state, batch)
  loop.selector.compile_ahead(compiler, state)
  waited = compiler.wait()
  logging.info("The loop's programs are compiled (%.1f s waited for them).", waited)
  return waited


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


def setup_run(config: ml_collections.ConfigDict, workdir: str,
              clock: anatomy.RunClock | None = None
              ) -> tuple[Run, steps.TrainState, Any, int, run_state.Done | None]:
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
  eval_fn = jit_eval_step(config, model)
  with clock.part("data_open") if clock else contextlib.nullcontext():
    data_splits, data_readers = input_pipeline.load(config.dataset, mesh, config.seed)
  _record_dataset(config.dataset, workdir)
  checkpoint_meta = {"config": config.to_json_best_effort(sort_keys=True),
                     **_decoder_meta(data_readers["train"], meta)}
  if data_digests is not None:  # A folder's rows: a resume checks they are unchanged.
    checkpoint_meta["data_digests"] = data_digests
  origin = provenance.gather(config, clock.start if clock else time.time(),
                             splits.noise_draw(config.dataset, data_splits["train"]))
  run = Run(workdir=workdir, mesh=mesh, model=model, tx=tx, checkpointer=checkpointer,
            splits=data_splits, readers=data_readers, eval_fn=eval_fn, loss_kind=kind,
            train_batches=kind.train_batches(data_readers, config.seed, config.batch_size),
            checkpoint_meta=checkpoint_meta, compilation_cache=cache_dir, provenance=origin)
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


def create_selector(config: ml_collections.ConfigDict, run: Run,
                    clock: anatomy.RunClock | None = None) -> selector.Selector:
  """The run's selector and its score source, each given the config sections it reads, the
  selector the run's `clock` (None: its own)."""
  data = specs.DATASETS[config.dataset.name]
  source = score_sources.create_source(
      config.selection, run.readers["train"], run.mesh, model_name=config.model.name,
      dataset=config.dataset, xla_cpu_options=config.xla_cpu_options)
  return selector.Selector(config.selection, run.readers["train"], run.mesh, source,
                           num_epochs=config.num_epochs, batch_size=config.batch_size,
                           seed=config.seed, num_classes=data.num_classes,
                           num_ids=data.num_train, num_bins=config.evaluation.num_bins,
                           clock=clock)


def create_evaluator(config: ml_collections.ConfigDict, run: Run) -> evaluation.Evaluator:
  """The run's evaluator, built from the parts it uses: the eval step, the val/test data, the
  sentence naming the last good checkpoint and (FL_gamma) the test gammas' step."""
  num_classes = specs.DATASETS[config.dataset.name].num_classes
  gamma_step = run.loss_kind.gamma_step(run.model, steps.step_spec(config.dataset))
  return evaluation.Evaluator(
      run.eval_fn, run.mesh, {name: run.readers[name] for name in evaluation.SPLITS},
      {name: run.splits[name].labels for name in evaluation.SPLITS}, num_classes,
      config.eval_batch_size, functools.partial(last_good, run.checkpointer),
      config.evaluation, run.workdir,
      f"{config.dataset.name}, {config.model.name}, {config.loss.name}", run.splits["test"],
      config.dataset, gamma_step and _jit_inference(config, gamma_step), run.provenance)


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


def check_before_work(config: ml_collections.ConfigDict, workdir: str,
                      mode: str = "train") -> None:
  """Validates the config and the workdir and runs the start-up checks (cpjax.config.preflight):
  before the workdir lock, any data load or compile."""
  validation.validate(config)
  for warning in validation.size_warnings(config):
    logging.warning("%s", warning)
  preflight.check(config, workdir, mode)


def _restore(checkpointer: checkpointing.Checkpointer, initial: dict[str, Any],
             config: ml_collections.ConfigDict) -> tuple[dict[str, Any], dict[str, Any]]:
  """The latest checkpoint and its metadata if any, else `initial` and {}."""
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), initial)
  restored = checkpointer.restore_latest(abstract)
  if restored is None:
    return initial, {}
  saved, meta = restored
  if changes := implied.resume_changes(meta["config"], config):
    logging.warning(changes)
  logging.info("Resumed from %s at global step %d (epoch %d, step %d of it).",
               checkpointer.directory, meta.get("step", -1), meta["epoch"],
               meta.get("epoch_step", 0))
  return saved, meta


def jit_train_step(config: ml_collections.ConfigDict, model: nn.Module,
                   tx: optax.GradientTransformation, weighted: bool,
                   loss_kind: loss_steps.LossSteps) -> TrainFn:
  """The train step of the run's loss (`loss_kind`, cpjax.training.loss_steps: FL_gamma's is the
  bilevel `steps.meta_train_step`) with its model, optimizer and score bound; jitted once, the
  state donated. `weighted`: batches carry loss weights (the selector's)."""
  step = loss_kind.build_train_step(
      model, tx, scores.forward_score(config.selection.score, config.selection),
      steps.step_spec(config.dataset, config.loss, weighted))
  return jax.jit(step, donate_argnums=0,
                 compiler_options=compiler_options.compiler_options("train",
                                                                    config.xla_cpu_options))


def jit_eval_step(config: ml_collections.ConfigDict, model: nn.Module) -> EvalFn:
  """The eval step (float32 logits) of the config's model; jitted once."""
  return _jit_inference(config, functools.partial(steps.eval_step, model=model,
                                                  spec=steps.step_spec(config.dataset)))


def _jit_inference(config: ml_collections.ConfigDict, step):
  """An eval-mode `step` jitted once with the inference XLA options (the eval step's, and
  an FL_gamma run's test gammas step)."""
  return jax.jit(step, compiler_options=compiler_options.compiler_options(
      "inference", config.xla_cpu_options))
