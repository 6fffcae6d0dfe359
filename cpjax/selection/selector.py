"""Each epoch's training rows: warm-up on all data, then a scored or random subset.

`Selector` joins the parts of the selection package for the training loop:
before an epoch, the score source refreshes the buffer if a pass is due and
the policy picks the subset; after it, the bookkeeping updates the selection
state and returns the epoch's accounting. Every random draw is a function of
(seed, epoch) and the selection state is checkpointed with the train state,
so a resumed run selects exactly what the uninterrupted run selected.
"""

import time

import jax
import ml_collections
import numpy as np

from cpjax import steps
from cpjax.data import specs, splits
from cpjax.selection import bookkeeping, policies, score_files, sources


class Selector:
  """Chooses each epoch's training rows and keeps the selection state's accounting."""

  def __init__(self, config: ml_collections.ConfigDict, train_split: splits.Split,
               mesh: jax.sharding.Mesh):
    self._config, self._selection, self._split, self._mesh = (
        config, config.selection, train_split, mesh)
    self._num_classes = specs.DATASETS[config.dataset.name].num_classes
    self.k = policies.subset_size(self._selection.fraction, self._selection.count,
                                  len(train_split))
    self._source = sources.create_source(config, train_split, mesh)
    self._params = policies.PolicyParams(
        direction=self._selection.direction, random_share=self._selection.random_share,
        temperature=self._selection.temperature, stratify_drop=self._selection.stratify_drop,
        num_strata=self._selection.num_strata, first_epoch=self._selection.warmup_epochs)

  def selecting(self, epoch: int) -> bool:
    return self._selection.method != "full" and epoch >= self._selection.warmup_epochs

  def steps_in_epoch(self, epoch: int) -> int:
    rows = self.k if self.selecting(epoch) else len(self._split)
    return -(-rows // self._config.batch_size)

  def rows_for_epoch(self, epoch: int, train_state: steps.TrainState,
                     state: bookkeeping.SelectionState):
    """Rows to train on in `epoch` (sorted), after any scoring pass due.

    Returns:
      (rows, selection state, {"scoring_seconds", "selection_seconds"}).
    """
    if not self.selecting(epoch):
      return (np.arange(len(self._split)), state,
              {"scoring_seconds": 0.0, "selection_seconds": 0.0})
    start = time.perf_counter()
    if self._selection.method in policies.SCORED_METHODS:
      state = self._source.refresh(epoch, train_state, state)
    scored = time.perf_counter()
    chosen = policies.choose_subset(self._selection.method, state["scores"], self._split.labels,
                                    self._split.ids, self.k, self._config.seed, epoch,
                                    self._params, self._mesh)
    rows = np.searchsorted(self._split.ids, np.sort(chosen))
    return rows, state, {"scoring_seconds": scored - start,
                         "selection_seconds": time.perf_counter() - scored}

  def after_epoch(self, epoch: int, state: bookkeeping.SelectionState, order: np.ndarray,
                  per_example: dict[str, np.ndarray], timings: dict[str, float],
                  workdir: str) -> tuple[bookkeeping.SelectionState, dict]:
    """Takes in the epoch's train-pass outputs; returns the new state and its accounting.

    Args:
      order: [steps, B] rows in training order (the last batch cycles rows).
      per_example: train-pass "score", "confidence", "correct", each [steps * B].
      timings: scoring, selection and training seconds of the epoch.
      workdir: where `record_scores` writes the epoch's scores.
    """
    rows, first = bookkeeping.first_pass(order, per_example)
    record = bookkeeping.train_pass_record(first["confidence"], first["correct"],
                                           self._config.evaluation.num_bins)
    if self.selecting(epoch):
      state, subset = bookkeeping.subset_record(state, rows, self._split.labels,
                                                self._num_classes)
      record.update(subset)
    if self._source.learns_from_training:
      state = bookkeeping.with_scores(state, rows, first["score"])
    if self._selection.record_scores and jax.process_index() == 0:
      score_files.write_epoch_scores(
          workdir, epoch, specs.DATASETS[self._config.dataset.name].num_train,
          self._split.ids[rows], first["score"])
    state, seconds = bookkeeping.add_seconds(state, timings)
    record.update(seconds)
    return state, record
