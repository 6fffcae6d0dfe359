"""Where the scores of a selected epoch come from: one object per `selection.scoring`.

  train_pass       the reference: the train step's own forward pass (train-mode
                   BatchNorm, augmented, before the update, mixed inputs under
                   mixup) scores each example it trains on; examples not trained
                   since keep stale scores in the buffer.
  fresh            an eval-mode, unaugmented, sharded forward pass of the current
                   model over every training example every `rescore_every` epochs.
  target           the same pass with another cpjax run's latest checkpoint
                   (`target_workdir`, any architecture, read from its saved
                   config), once (`rescore_every=0`) or every R epochs.
  target_recorded  the target run's recorded train-pass scores of the same epoch.

Each is a `Scoring` entry of the registry `SOURCES` (cpjax.registry): its function builds the
source from the run's parts (`create_source`), and it says what it reads of a target run.
Each source has one job, `refresh(epoch, train_state, state) -> state`: update
the score buffer of the selection state if a pass is due. `learns_from_training`
says whether the loop writes the train pass's own scores into the buffer;
`scorer_calibration()` gives the last scoring pass's confidences and
correctness (fresh and target passes; None where there is none in memory).

Under score=reducible_loss (RHO-LOSS) the train_pass or fresh source fills the
buffer with the current model's losses, and `WithIrreducibleLoss` adds, once, the
target run's losses of the same rows (the selector subtracts them).
"""

from collections.abc import Callable
import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any, Protocol

import jax
import ml_collections
import numpy as np

from cpjax import models, registry, run_state, steps
from cpjax.data import readers, specs, splits
from cpjax.runtime import checkpointing, compile_ahead, compiler_options
from cpjax.selection import bookkeeping, score_files, scores


class ScoreSource(Protocol):
  learns_from_training: bool

  def refresh(self, epoch: int, train_state: steps.TrainState,
              state: bookkeeping.SelectionState) -> bookkeeping.SelectionState:
    """The selection state with the buffer rescored for `epoch` if a pass is due."""

  def scorer_calibration(self) -> tuple[np.ndarray, np.ndarray] | None:
    """([N] top-class probability, [N] 1.0 where it is the label) of the last scoring pass,
    or None: no pass of its own (train_pass: the train-pass ECE covers it; target_recorded
    records scores only), or none since the process started (a resumed run)."""


class TrainPass:
  """Scores come from training itself: nothing to do before an epoch."""
  learns_from_training = True

  def refresh(self, epoch, train_state, state):
    del epoch, train_state
    return state

  def scorer_calibration(self):
    return None


class ScoringPass:
  """A sharded eval-mode pass over the whole training split, every `rescore_every` epochs.

  With `target=None` it scores with the current train state (fresh); otherwise
  it restores the target run's latest checkpoint at each pass.
  """
  learns_from_training = False

  def __init__(self, score_fn, split: splits.Split | readers.Reader,
               mesh: jax.sharding.Mesh, batch_size: int, rescore_every: int,
               target: "Target | None" = None):
    self._score_fn, self._split, self._mesh = score_fn, split, mesh
    self._batch_size, self._rescore_every, self._target = batch_size, rescore_every, target
    self._calibration = None  # The last pass's (confidence, correct), this process only.

  def _due(self, epoch: int, state: bookkeeping.SelectionState) -> bool:
    last = int(state["scored_epoch"])
    return last < 0 or (self._rescore_every > 0 and epoch - last >= self._rescore_every)

  def refresh(self, epoch, train_state, state):
    if not self._due(epoch, state):
      return state
    start = time.perf_counter()
    logging.info("Scoring pass for epoch %d: %d training examples with %s...", epoch,
                 len(self._split), f"the target run {self._target.workdir}" if self._target
                 else "the current model")
    model_state = self._target.restore() if self._target else train_state
    columns = steps.predict(self._score_fn, model_state, self._split, self._mesh,
                            self._batch_size).astype(np.float32)  # [N, 3]
    self._calibration = columns[:, 1], columns[:, 2]
    logging.info("Scoring pass for epoch %d done in %.1f s.", epoch, time.perf_counter() - start)
    return {**state, "scores": columns[:, 0], "scored_epoch": np.array(epoch, np.int32)}

  def scorer_calibration(self):
    return self._calibration

  def compile_ahead(self, compiler: compile_ahead.Compiler, train_state: steps.TrainState
                    ) -> None:
    """Submits the scoring step, for the batches and state it will get, to `compiler`."""
    if self._target:  # Its state is restored at each pass: compiled at the first.
      return
    batch = steps.first_predict_batch(self._split, self._mesh, self._batch_size)
    compiler.submit("the scoring step", self._score_fn, compile_ahead.abstract(train_state),
                    compile_ahead.abstract(batch))


class TargetRecorded:
  """The target run's recorded train-pass scores of each epoch (score_files)."""
  learns_from_training = False

  def __init__(self, target_workdir: str, ids: np.ndarray):
    self._workdir, self._ids = target_workdir, ids

  def refresh(self, epoch, train_state, state):
    del train_state
    return {**state, "scores": score_files.read_epoch_scores(self._workdir, epoch, self._ids)}

  def scorer_calibration(self):
    return None


class WithIrreducibleLoss:
  """A source of the current model's losses, plus once the target's: RHO-LOSS's two parts.

  At the first selected epoch, an eval-mode sharded pass of the target run's
  latest checkpoint computes the cross-entropy of every training row (the
  irreducible losses); they go into the selection state with the target's step
  and are never recomputed (a resumed run restores them with the state).
  """

  def __init__(self, source: ScoreSource, loss_fn, split: splits.Split | readers.Reader,
               mesh: jax.sharding.Mesh, batch_size: int, target: "Target"):
    self._source, self._loss_fn, self._split = source, loss_fn, split
    self._mesh, self._batch_size, self._target = mesh, batch_size, target
    self.learns_from_training = source.learns_from_training

  def refresh(self, epoch, train_state, state):
    state = self._source.refresh(epoch, train_state, state)
    if int(state["irreducible_step"]) >= 0:
      return state
    target_state = self._target.restore()
    losses = steps.predict(self._loss_fn, target_state, self._split, self._mesh,
                           self._batch_size).astype(np.float32)
    step = int(jax.device_get(target_state.step))
    if not np.all(np.isfinite(losses)):  # A diverged target: its ranking would mean nothing.
      raise FloatingPointError(f"the target run {self._target.workdir} (step {step}) has "
                               f"non-finite losses on {np.sum(~np.isfinite(losses))} training "
                               "examples; it cannot give irreducible losses")
    logging.info("Irreducible losses from target step %d: mean %.4f.", step, np.mean(losses))
    return {**state, "irreducible": losses, "irreducible_step": np.array(step, np.int32)}

  def scorer_calibration(self):
    return self._source.scorer_calibration()


class Target:
  """Another cpjax run's latest checkpoint, restored on demand."""

  def __init__(self, workdir: str, abstract_state: Any):
    self.workdir = workdir
    self._checkpointer = checkpointing.Checkpointer(workdir, None, read_only=True)
    self._abstract = abstract_state

  def restore(self) -> steps.TrainState:
    restored = self._checkpointer.restore_latest(self._abstract)
    if restored is None:
      raise FileNotFoundError(f"target run has no checkpoint in {self._checkpointer.directory}")
    return restored[0]["train"]


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The whole config saved with the latest checkpoint of another run's `workdir`: a target's
  model, dataset split and checkpoint tree are described by all of its sections."""
  meta = checkpointing.Checkpointer(workdir, None, read_only=True).latest_meta()
  if meta is None:
    raise FileNotFoundError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}")
  return ml_collections.ConfigDict(json.loads(meta["config"]))


def check_target(selection: ml_collections.ConfigDict,
                 dataset: ml_collections.ConfigDict) -> None:
  """Raises if the target run (`selection.target_workdir`) cannot serve this run, whose
  config.selection and config.dataset are given (before any data load or compile).

  Raises:
    FileNotFoundError: no recorded scores (target_recorded) or no checkpoint (target).
    ValueError: the target run did not train on the same train/validation split (a model
      target may differ in meta_val_size: a gamma-Net run can score a cross-entropy run).
  """
  recorded = SOURCES[selection.scoring].target == "scores"
  if recorded:
    first = score_files.score_path(selection.target_workdir, selection.warmup_epochs)
    if not os.path.exists(first):
      raise FileNotFoundError(
          f"selection.scoring='target_recorded' needs the target's recorded scores, e.g. "
          f"{first}; train the target with --config.selection.record_scores=True")
  target = read_run_config(selection.target_workdir)
  defaults = {"train_part": "all"}
  for field in ("name", "val_size", "split_seed", "train_examples", "meta_val_size",
                "label_noise", "label_noise_seed", "holdout_fraction", "train_part"):
    # .get: runs from before these fields existed had none (0, clean labels, no holdout).
    theirs, ours = target.dataset.get(field, defaults.get(field, 0)), dataset[field]
    if theirs == ours:
      continue
    if field == "train_part" and not recorded:
      _check_target_part(theirs, ours, selection.target_workdir)
      continue
    if field == "meta_val_size" and not recorded:
      # A gamma-Net target held its meta-validation rows out of training; it never saw this
      # run's validation or test rows either, so its model may score this run's rows. Recorded
      # scores exist only for the rows the target trained on: there the split must be ours.
      if theirs > ours:  # Else the target trained on every row this run trains on.
        logging.warning(
            "Target run %s held %d meta-validation rows out of its training: it scores them "
            "out of sample (higher entropy and loss than the rows it trained on), which "
            "favours them under hardest-first policies.", selection.target_workdir, theirs)
      continue
    raise ValueError(
        f"target run {selection.target_workdir} has dataset.{field}={theirs!r}, this run "
        f"{ours!r}: the target must be trained on the same train/validation split"
        + ("" if recorded else " (only meta_val_size may differ when it scores with its model)"))


def _check_target_part(theirs: str, ours: str, target_workdir: str) -> None:
  """A model target may train on another part of the holdout split than this run: the
  RHO-LOSS setup is a target on the held-out rows scoring a run on the rest."""
  if theirs == "holdout" and ours == "rest":
    return  # Disjoint rows: the target scores this run's rows out of sample.
  if ours == "holdout":
    raise ValueError(f"this run trains on the held-out rows (dataset.train_part='holdout'), "
                     f"the target run {target_workdir} on {theirs!r}: train the selecting run "
                     "with train_part='rest' and the target with train_part='holdout'")
  logging.warning("Target run %s trained on dataset.train_part=%r and this run on %r: it has "
                  "seen the rows it scores (in-sample scores).", target_workdir, theirs, ours)


def _jit_score_step(model_name: str, dataset: ml_collections.ConfigDict, dtype: str, score_fn,
                    preset: str, step_fn=steps.scoring_pass_step):
  """A jitted eval-mode `step_fn` (a scoring pass's [B, 3] columns, or `steps.score_step`'s
  scores) of model `model_name` for `dataset` (a run's config.dataset: its classes and
  normalisation), in compute `dtype`, with the XLA options of `preset`."""
  model = models.create_model(model_name, specs.DATASETS[dataset.name].num_classes, dtype)
  return jax.jit(
      functools.partial(step_fn, model=model, spec=steps.step_spec(dataset), score_fn=score_fn),
      compiler_options=compiler_options.compiler_options("inference", preset))


def create_source(selection: ml_collections.ConfigDict,
                  split: splits.Split | readers.Reader, mesh: jax.sharding.Mesh, *,
                  model_name: str, dataset: ml_collections.ConfigDict,
                  xla_cpu_options: str) -> ScoreSource:
  """The score source of `selection.scoring` for the training `split` (under
  score=reducible_loss, with the target's irreducible losses added).

  Args:
    selection: config.selection.
    split: the training split (host copy or reader).
    mesh: the mesh of the scoring passes.
    model_name, dataset: this run's config.model.name and config.dataset: the model of a
      fresh pass (a target's model and dataset come from the target run's saved config).
    xla_cpu_options: config.xla_cpu_options, the scoring passes' XLA options.
  """
  source = SOURCES[selection.scoring].create(selection, split, mesh, model_name, dataset,
                                             xla_cpu_options)
  if selection.score != scores.REDUCIBLE_LOSS:
    return source
  # Built now, run at the first selected epoch: start-up only reads the target's config.
  loss_fn, target = _target_scorer(selection, "loss", mesh, xla_cpu_options, steps.score_step)
  return WithIrreducibleLoss(source, loss_fn, split, mesh, selection.score_batch_size, target)


# A score source's builder: (selection, training split, mesh, model_name, dataset,
# xla_cpu_options) -> the source (`create_source`'s arguments).
Create = Callable[[ml_collections.ConfigDict, splits.Split | readers.Reader,
                   jax.sharding.Mesh, str, ml_collections.ConfigDict, str], ScoreSource]


def _train_pass(selection, split, mesh, model_name, dataset, xla_cpu_options) -> TrainPass:
  del selection, split, mesh, model_name, dataset, xla_cpu_options
  return TrainPass()


def _fresh(selection, split, mesh, model_name, dataset, xla_cpu_options) -> ScoringPass:
  """Scoring passes of the current model, `model_name` for `dataset`."""
  score_fn = _jit_score_step(model_name, dataset, selection.score_dtype,
                             scores.forward_score(selection.score, selection), xla_cpu_options)
  return ScoringPass(score_fn, split, mesh, selection.score_batch_size, selection.rescore_every)


def _target(selection, split, mesh, model_name, dataset, xla_cpu_options) -> ScoringPass:
  """Scoring passes of the target run's model (its model and dataset are its own)."""
  del model_name, dataset
  score_fn, target = _target_scorer(selection, selection.score, mesh, xla_cpu_options)
  return ScoringPass(score_fn, split, mesh, selection.score_batch_size, selection.rescore_every,
                     target=target)


def _target_recorded(selection, split, mesh, model_name, dataset, xla_cpu_options
                     ) -> TargetRecorded:
  del mesh, model_name, dataset, xla_cpu_options
  return TargetRecorded(selection.target_workdir, split.ids)


@dataclasses.dataclass(frozen=True)
class Scoring:
  """A `selection.scoring` choice: where a selected epoch's scores come from."""
  name: str
  create: Create
  doc: str
  # What it reads of the target run (selection.target_workdir): "" nothing, "model" its
  # latest checkpoint, "scores" its recorded train-pass scores.
  target: str = ""
  own_model: bool = False  # It scores with this run's current model.
  settings: tuple[registry.Setting, ...] = ()  # Its fields are config.selection's own.


SOURCES: registry.Registry[Scoring] = registry.Registry("score source", "selection")
SOURCES.register(Scoring("train_pass", _train_pass, "the train step's own forward pass",
                         own_model=True))
SOURCES.register(Scoring("fresh", _fresh, "an eval-mode pass of the current model every "
                         "rescore_every epochs", own_model=True))
SOURCES.register(Scoring("target", _target, "an eval-mode pass of the target run's latest "
                         "checkpoint", target="model"))
SOURCES.register(Scoring("target_recorded", _target_recorded, "the target run's recorded "
                         "train-pass scores of the same epoch", target="scores"))


def _target_scorer(selection: ml_collections.ConfigDict, score_name: str,
                   mesh: jax.sharding.Mesh, xla_cpu_options: str,
                   step_fn=steps.scoring_pass_step) -> tuple[Any, Target]:
  """The jitted eval-mode `step_fn` of the target run's own model (`score_name` scores),
  and the target. The target's model, dataset and checkpoint tree come from its whole saved
  config (`read_run_config`): they are the target run's, not this run's."""
  target_config = read_run_config(selection.target_workdir)
  score_fn = _jit_score_step(target_config.model.name, target_config.dataset,
                             selection.score_dtype, scores.forward_score(score_name, selection),
                             xla_cpu_options, step_fn)
  logging.info("Scoring with target run %s (%s).", selection.target_workdir,
               target_config.model.name)
  return score_fn, Target(selection.target_workdir, run_state.abstract(
      target_config, mesh, bookkeeping.initial_state_of(target_config.dataset,
                                                        target_config.selection)))
