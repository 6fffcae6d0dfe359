"""Each epoch's training rows: warm-up on all data, then a scored or random subset
(infobatch: a pruned subset of varying size, with a loss weight per row).

`Selector` joins the parts of the selection package for the training loop:
before an epoch, the score source refreshes the buffer if a pass is due and
the policy picks the subset by the buffer's scores (under score=reducible_loss:
the buffer's losses less the target's irreducible losses); after it, the
bookkeeping updates the selection state and returns the epoch's accounting.
Every random draw is a function of (seed, epoch) and the selection state is
checkpointed with the train state, so a resumed run selects exactly what the
uninterrupted run selected.
"""

import time

import jax
import ml_collections
import numpy as np

from cpjax import steps
from cpjax.data import readers, specs, splits
from cpjax.selection import bookkeeping, policies, score_files, scores, sources


class Selector:
  """Chooses each epoch's training rows and keeps the selection state's accounting."""

  def __init__(self, config: ml_collections.ConfigDict,
               train_split: splits.Split | readers.HostReader, mesh: jax.sharding.Mesh):
    self._config, self._selection, self._split, self._mesh = (
        config, config.selection, train_split, mesh)
    self._num_classes = specs.DATASETS[config.dataset.name].num_classes
    self._num_epochs = config.num_epochs
    # Weighted methods (infobatch) give every batch a per-example loss weight, in every
    # epoch (1 outside pruning), so that the run compiles one train step.
    self.weighted = policies.weights_loss(self._selection.method)
    self._reducible = self._selection.score == scores.REDUCIBLE_LOSS
    self._anneal_start = policies.anneal_start(config.num_epochs, self._selection.anneal_fraction)
    self._source = sources.create_source(config, train_split, mesh)
    self._params = policies.PolicyParams(
        direction=self._selection.direction, random_share=self._selection.random_share,
        temperature=self._selection.temperature, stratify_drop=self._selection.stratify_drop,
        num_strata=self._selection.num_strata, first_epoch=self._selection.warmup_epochs,
        prune_ratio=self._selection.prune_ratio)

  def selecting(self, epoch: int) -> bool:
    """Whether `epoch` trains on a selected subset: after the warm-up epochs and before the
    final full-data epochs (`selection.final_full_epochs`, an annealing phase as InfoBatch's
    for the fixed-size methods)."""
    last = self._num_epochs - self._selection.final_full_epochs
    return (self._selection.method != "full"
            and self._selection.warmup_epochs <= epoch < last)

  def k_at(self, epoch: int) -> int:
    """k of a fixed-size method in selected `epoch`: `selection.count`, or the kept fraction
    of the epoch (`selection.fraction`, moving linearly to `selection.fraction_end` over the
    selected epochs when that is set) times the training rows."""
    fraction = policies.fraction_at(
        self._selection.fraction, self._selection.fraction_end, epoch,
        self._selection.warmup_epochs,
        self._num_epochs - self._selection.final_full_epochs - 1)
    return policies.subset_size(fraction, self._selection.count, len(self._split))

  def steps_in_epoch(self, epoch: int) -> int:
    """Steps of `epoch` for the progress report's total. An infobatch epoch's size is known
    only once its rows are drawn: its full size counts (an upper bound; the loop trains
    ceil(rows / batch_size) steps of the rows it gets)."""
    fixed_subset = self.selecting(epoch) and not self.weighted
    rows = self.k_at(epoch) if fixed_subset else len(self._split)
    return -(-rows // self._config.batch_size)

  def rows_for_epoch(self, epoch: int, train_state: steps.TrainState,
                     state: bookkeeping.SelectionState):
    """Rows to train on in `epoch` (sorted), after any scoring pass due.

    Returns:
      (rows, float32 loss weights of the rows or None (unweighted methods),
      selection state, {"scoring_seconds", "selection_seconds"}).
    """
    if not self.selecting(epoch):
      rows = np.arange(len(self._split))
      return (rows, self._unit_weights(rows), state,
              {"scoring_seconds": 0.0, "selection_seconds": 0.0})
    start = time.perf_counter()
    if self._selection.method in policies.SCORED_METHODS:
      state = self._source.refresh(epoch, train_state, state)
    scored = time.perf_counter()
    chosen, weights = self._choose(epoch, self._priorities(state))
    rows = np.searchsorted(self._split.ids, chosen)
    return rows, weights, state, {"scoring_seconds": scored - start,
                                  "selection_seconds": time.perf_counter() - scored}

  def _priorities(self, state: bookkeeping.SelectionState) -> np.ndarray:
    """What the policy ranks: the score buffer, or under RHO-LOSS the buffer's training
    losses less the irreducible ones (the buffer keeps the raw losses, as every train pass
    and scoring pass writes them)."""
    if self._reducible:
      return scores.reducible_loss(state["scores"], state["irreducible"])
    return state["scores"]

  def _choose(self, epoch: int, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The policy's ids (increasing) and their weights (None for unweighted methods)."""
    if self.weighted:
      return policies.select_infobatch(scores, self._split.ids, self._config.seed, epoch,
                                       self._params.prune_ratio, self._anneal_start)
    return np.sort(policies.choose_subset(
        self._selection.method, scores, self._split.labels, self._split.ids, self.k_at(epoch),
        self._config.seed, epoch, self._params, self._mesh)), None

  def _unit_weights(self, rows: np.ndarray) -> np.ndarray | None:
    return np.ones(len(rows), np.float32) if self.weighted else None

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
      # score_mean_selected/_all: means of what the policy ranked (reducible losses under
      # RHO-LOSS), before this epoch's train pass rewrites the buffer.
      state, subset = bookkeeping.subset_record(state, rows, self._split.labels,
                                                self._num_classes, self._priorities(state))
      record.update(subset)
      if self._reducible:
        record.update(bookkeeping.irreducible_record(state["irreducible"], rows))
      if self.weighted:
        record.update(bookkeeping.pruning_record(len(rows), len(self._split)))
      if (calibration := self._source.scorer_calibration()) is not None:
        record.update(bookkeeping.scorer_record(calibration, rows,
                                                self._config.evaluation.num_bins))
    if self._source.learns_from_training:
      state = bookkeeping.with_scores(state, rows, first["score"])
    if self._selection.record_scores and jax.process_index() == 0:
      score_files.write_epoch_scores(
          workdir, epoch, specs.DATASETS[self._config.dataset.name].num_train,
          self._split.ids[rows], first["score"])
    state, seconds = bookkeeping.add_seconds(state, timings)
    record.update(seconds)
    return state, record
