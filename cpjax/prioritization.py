"""Calibration-guided sample prioritization: the epoch loop's side of it.

Each epoch from `warmup_epochs` on trains only on a subset of k training
examples (Can Calibration Improve Sample Prioritization?, spec §5). Where the
scores come from (`config.selection`):

  train_pass  the reference: the train step's own forward pass (train-mode
              BatchNorm, augmented, before the update, mixed inputs under
              mixup) scores each example it trains on; the score buffer keeps
              stale scores for examples not trained since.
  fresh       an eval-mode, unaugmented, sharded forward pass over every
              training example every `rescore_every` epochs (optionally bf16).
  target      another cpjax run's checkpoint scores instead of the current
              model (its architecture read from its checkpoint), once or every
              `rescore_every` epochs; or, with `target_per_epoch`, the target
              run's recorded train-pass scores of the same epoch.

The selection state (score buffer, last subset, time totals) is checkpointed
with the train state, and every random draw is a function of (seed, epoch), so
a resumed run selects exactly what the uninterrupted run selected.
"""

import dataclasses
import functools
import json
import logging
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from cpjax import augment, checkpointing, compiler_options, input_pipeline, metrics, models
from cpjax import optim, scoring, selection, sharding

SCORE_FILE = "scores/epoch_{epoch:04d}.npy"  # Recorded train-pass scores, by full-split id.
PHASES = ("scoring", "selection", "training")


def initial_state(num_train: int) -> dict[str, np.ndarray]:
  """The selection state before any epoch: zero scores (as the reference), no subset."""
  return {"scores": np.zeros(num_train, np.float32),
          "subset": np.zeros(num_train, np.int32),  # 1 = in the last selected subset.
          "scored_epoch": np.array(-1, np.int32),  # Last scoring pass (fresh/target).
          "seconds": np.zeros(len(PHASES), np.float32)}  # Cumulative time per phase.


def score_step(state, batch: dict[str, jax.Array], *, model, config: ml_collections.ConfigDict,
               score_fn: scoring.ScoreFn) -> jax.Array:
  """Eval-mode scores [B] of one unaugmented batch (the fresh/target scoring pass)."""
  spec = input_pipeline.DATASETS[config.dataset.name]
  images = augment.normalize(batch["image"], spec.mean, spec.std)
  logits, _ = model.apply({"params": state.params, "batch_stats": state.batch_stats},
                          images, train=False)
  return score_fn(logits, batch["label"])


@dataclasses.dataclass
class _Scorer:
  """A model that scores the training set in eval mode: the current one or a target."""
  score_fn: Any  # jitted (state, batch) -> scores [B]
  checkpointer: checkpointing.Checkpointer | None = None  # Target runs only.
  abstract_state: Any = None

  def target_state(self):
    restored = self.checkpointer.restore_latest(self.abstract_state)
    if restored is None:
      raise FileNotFoundError(f"target run has no checkpoint in {self.checkpointer.directory}")
    return restored[0]["train"]


def read_run_config(workdir: str) -> ml_collections.ConfigDict:
  """The config saved with the latest checkpoint of another run's `workdir`."""
  meta = checkpointing.Checkpointer(workdir, max_to_keep=1000).latest_meta()
  if meta is None:
    raise FileNotFoundError(f"no checkpoint in {os.path.join(workdir, 'checkpoints')}")
  return ml_collections.ConfigDict(json.loads(meta["config"]))


def check_target(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError if the target run did not train on the same data split."""
  if config.selection.target_per_epoch:
    first = os.path.join(config.selection.target_workdir,
                         SCORE_FILE.format(epoch=config.selection.warmup_epochs))
    if not os.path.exists(first):
      raise FileNotFoundError(
          f"config.selection.target_per_epoch needs the target's recorded scores, e.g. {first}; "
          "train the target with --config.selection.record_scores=True")
    return
  target = read_run_config(config.selection.target_workdir)
  for field in ("name", "val_size", "split_seed", "train_examples"):
    if target.dataset[field] != config.dataset[field]:
      raise ValueError(
          f"target run {config.selection.target_workdir} has dataset.{field}="
          f"{target.dataset[field]!r}, this run {config.dataset[field]!r}: the target must "
          "be trained on the same train/validation split")


class Prioritizer:
  """Chooses each epoch's training rows and keeps the selection state and accounting."""

  def __init__(self, config: ml_collections.ConfigDict, train_split: input_pipeline.Split,
               mesh: jax.sharding.Mesh, model, create_state):
    self.config, self.cfg, self.split, self.mesh = config, config.selection, train_split, mesh
    self.num_classes = input_pipeline.DATASETS[config.dataset.name].num_classes
    self.k = selection.subset_size(self.cfg.fraction, self.cfg.count, len(train_split))
    self._scorer = self._make_scorer(model, create_state)

  def _make_scorer(self, model, create_state) -> _Scorer | None:
    cfg = self.cfg
    if cfg.method not in ("top_k", "uniform_sorted") or cfg.target_per_epoch or (
        cfg.scoring == "train_pass" and not cfg.target_workdir):
      return None
    score_fn = scoring.SCORES[cfg.score]
    options = compiler_options.compiler_options("inference", self.config.xla_cpu_options)
    if not cfg.target_workdir:  # Fresh passes with the current model, maybe in bf16.
      scoring_model = models.create_model(self.config.model.name, self.num_classes,
                                          cfg.score_dtype)
      return _Scorer(jax.jit(functools.partial(score_step, model=scoring_model,
                                               config=self.config, score_fn=score_fn),
                             compiler_options=options))
    target_config = read_run_config(cfg.target_workdir)
    target_model = models.create_model(target_config.model.name, self.num_classes,
                                       cfg.score_dtype)
    spec = input_pipeline.DATASETS[target_config.dataset.name]
    abstract = jax.eval_shape(lambda: {
        "train": create_state(jax.random.PRNGKey(0), target_model,
                              optim.create_optimizer(target_config.optimizer),
                              spec.image_shape, self.mesh),
        "selection": sharding.replicate(self.mesh, initial_state(len(self.split)))})
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding.replicated(self.mesh)), abstract)
    logging.info("Scoring with target run %s (%s).", cfg.target_workdir,
                 target_config.model.name)
    return _Scorer(jax.jit(functools.partial(score_step, model=target_model,
                                             config=target_config, score_fn=score_fn),
                           compiler_options=options),
                   checkpointing.Checkpointer(cfg.target_workdir, max_to_keep=1000), abstract)

  def selecting(self, epoch: int) -> bool:
    return self.cfg.method != "full" and epoch >= self.cfg.warmup_epochs

  def steps_in_epoch(self, epoch: int) -> int:
    rows = self.k if self.selecting(epoch) else len(self.split)
    return -(-rows // self.config.batch_size)

  def epoch_rows(self, epoch: int, train_state, sel: dict[str, np.ndarray]):
    """Rows to train on in `epoch` (sorted), after any scoring pass due.

    Returns:
      (rows, updated selection state, {"scoring_seconds", "selection_seconds"}).
    """
    ids = self.split.ids
    if not self.selecting(epoch):
      return np.arange(len(ids)), sel, {"scoring_seconds": 0.0, "selection_seconds": 0.0}
    start = time.perf_counter()
    sel = dict(sel)
    if self.cfg.method in ("top_k", "uniform_sorted"):
      sel = self._refresh_scores(epoch, train_state, sel)
    scored = time.perf_counter()
    if self.cfg.method == "top_k":
      chosen = selection.select_top_k(sel["scores"], ids, self.k, self.mesh)
    elif self.cfg.method == "uniform_sorted":
      chosen = selection.select_uniform_sorted(sel["scores"], ids, self.k, self.mesh)
    else:
      chosen = selection.random_subset(ids, self.k, self.config.seed,
                                       None if self.cfg.method == "static_random" else epoch)
    rows = np.searchsorted(ids, np.sort(chosen))
    return rows, sel, {"scoring_seconds": scored - start,
                       "selection_seconds": time.perf_counter() - scored}

  def _refresh_scores(self, epoch, train_state, sel):
    cfg = self.cfg
    if cfg.target_per_epoch:
      path = os.path.join(cfg.target_workdir, SCORE_FILE.format(epoch=epoch))
      if not os.path.exists(path):
        raise FileNotFoundError(f"target scores for epoch {epoch} missing: {path}")
      sel["scores"] = np.load(path)[self.split.ids].astype(np.float32)
      return sel
    if self._scorer is None:  # train_pass: the buffer is already filled by training.
      return sel
    last = int(sel["scored_epoch"])
    if last >= 0 and (cfg.rescore_every == 0 or epoch - last < cfg.rescore_every):
      return sel
    state = self._scorer.target_state() if self._scorer.checkpointer else train_state
    sel["scores"] = sharding.predict(self._scorer.score_fn, state, self.split, self.mesh,
                                  cfg.score_batch_size).astype(np.float32)
    sel["scored_epoch"] = np.array(epoch, np.int32)
    return sel

  def after_epoch(self, epoch: int, sel: dict[str, np.ndarray], order: np.ndarray,
                  per_example: dict[str, np.ndarray], timings: dict[str, float],
                  workdir: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Stores train-pass scores, and returns the new state and the epoch's accounting.

    Args:
      order: [steps, B] rows in training order (the last batch cycles rows).
      per_example: train-pass "score", "confidence", "correct", each [steps * B].
      timings: scoring, selection and training seconds of the epoch.
    """
    rows, first = np.unique(order.ravel(), return_index=True)  # Each row's first pass.
    scores = per_example["score"][first]
    sel = dict(sel)
    record = {"selected_k": len(rows), "train_ece": metrics.ece_from_confidences(
        per_example["confidence"][first], per_example["correct"][first],
        self.config.evaluation.num_bins)}
    if self.selecting(epoch):
      previous = sel["subset"].astype(bool)
      current = np.zeros(len(self.split), bool)
      current[rows] = True
      record["subset_overlap"] = (float(np.sum(previous & current)) / len(rows)
                                  if previous.any() else None)
      counts = np.bincount(self.split.labels[rows], minlength=self.num_classes)
      record["subset_class_counts"] = counts.tolist()
      record["subset_min_class_share"] = float(counts.min() / len(rows))
      record["score_mean_selected"] = float(np.mean(sel["scores"][rows]))
      record["score_mean_all"] = float(np.mean(sel["scores"]))
      sel["subset"] = current.astype(np.int32)
    if self.cfg.scoring == "train_pass" and not self.cfg.target_workdir:
      sel["scores"] = sel["scores"].copy()
      sel["scores"][rows] = scores
    if self.cfg.record_scores and jax.process_index() == 0:
      self._record_scores(workdir, epoch, rows, scores)
    seconds = np.array([timings[f"{p}_seconds"] for p in PHASES], np.float32)
    sel["seconds"] = sel["seconds"] + seconds
    record.update(timings)
    record.update({f"total_{p}_seconds": float(s) for p, s in zip(PHASES, sel["seconds"])})
    return sel, record

  def _record_scores(self, workdir: str, epoch: int, rows: np.ndarray,
                     scores: np.ndarray) -> None:
    """Writes this epoch's train-pass scores by full-split id (NaN: not trained)."""
    num_ids = input_pipeline.DATASETS[self.config.dataset.name].num_train
    by_id = np.full(num_ids, np.nan, np.float32)
    by_id[self.split.ids[rows]] = scores
    path = os.path.join(workdir, SCORE_FILE.format(epoch=epoch))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
      np.save(f, by_id)
    os.replace(path + ".tmp", path)
