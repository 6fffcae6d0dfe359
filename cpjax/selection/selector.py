"""Each epoch's training rows: warm-up on all data, then a scored or random subset
(infobatch, importance: a subset of varying size, with a loss weight per row).

`Selector` is the training loop's side of the library API's `api.Selection`, which
makes every selection decision (which epochs select, k, the policy's ids and
weights), so that the trainer and one's own loop (examples/own_loop.py) select
alike by construction. What only the trainer has is here: before an epoch, the
score source refreshes the buffer if a pass is due (a scoring pass through the
mesh readers) and the selection ranks the buffer's scores (under
score=reducible_loss: the buffer's losses less the target's irreducible losses),
mapped to the split's rows; after it, the bookkeeping updates the selection
state, returns the epoch's accounting and writes the scores to the workdir.
Every random draw is a function of (seed, epoch) and the selection state is
checkpointed with the train state, so a resumed run selects exactly what the
uninterrupted run selected.
"""

import jax
import ml_collections
import numpy as np

from cpjax import steps
from cpjax.data import readers, splits
from cpjax.runtime import anatomy, compile_ahead
from cpjax.selection import api, bookkeeping, policies, score_files, score_sources, scores, subsets


class Selector:
  """Chooses each epoch's training rows and keeps the selection state's accounting."""

  def __init__(self, selection: ml_collections.ConfigDict,
               train_split: splits.Split | readers.Reader, mesh: jax.sharding.Mesh,
               source: score_sources.ScoreSource, *, num_epochs: int, batch_size: int, seed: int,
               num_classes: int, num_ids: int, num_bins: int,
               clock: anatomy.RunClock | None = None):
    """Binds the selection to the run's training split.

    Args:
      selection: config.selection.
      train_split: the training split (host copy or reader): ids, labels, its size.
      mesh: the mesh of the policies' global ranking.
      source: where the scores come from (`score_sources.create_source` of `selection`).
      num_epochs, batch_size, seed: the run's (config.*): the schedule of selected epochs,
        the steps of an epoch and the root of every random draw.
      num_classes: the dataset's classes (the subset's class accounting).
      num_ids: the dataset's training examples, the id range of the recorded score files.
      num_bins: evaluation.num_bins, of the train-pass and scorer ECE.
      clock: the run's clock, whose parts "scoring" and "selection" it times (None: its own).
    """
    self._clock = clock or anatomy.RunClock()
    self._split, self._source, self._batch_size = train_split, source, batch_size
    self._num_classes, self._num_ids, self._num_bins = num_classes, num_ids, num_bins
    self._record_scores, self._method = selection.record_scores, selection.method
    self._reducible = selection.score == scores.REDUCIBLE_LOSS
    policy_settings = {s.name: selection[s.name]
                       for s in policies.POLICIES[selection.method].settings}
    self.selection = api.Selection(
        train_split.ids, train_split.labels, method=selection.method,
        fraction=selection.fraction, count=selection.count,
        warmup_epochs=selection.warmup_epochs, num_epochs=num_epochs, seed=seed,
        direction=selection.direction, final_full_epochs=selection.final_full_epochs,
        fraction_end=selection.fraction_end, mesh=mesh, **policy_settings)
    # Weighted methods (infobatch, importance) give every batch a per-example loss weight, in every
    # epoch (1 outside pruning), so that the run compiles one train step.
    self.weighted = self.selection.weighted

  def compile_ranking_ahead(self, compiler: compile_ahead.Compiler) -> None:
    """Submits the global ranking of the selected epochs (it needs only the number of
    scores) to `compiler`."""
    if self._method != "full":
      subsets.compile_ranking_ahead(compiler, len(self._split), self.selection.mesh)

  def compile_ahead(self, compiler: compile_ahead.Compiler, train_state: steps.TrainState
                    ) -> None:
    """Submits the programs of the run's selected epochs (the scoring pass's step, the
    global ranking) to `compiler`, so that no selected epoch compiles them."""
    if self._method == "full":
      return
    if hasattr(self._source, "compile_ahead"):
      self._source.compile_ahead(compiler, train_state)
    self.compile_ranking_ahead(compiler)

  def steps_in_epoch(self, epoch: int) -> int:
    """Steps of `epoch` for the progress report's total. An infobatch or importance epoch's
    size is known only once its rows are drawn: its full size counts (an upper bound; the
    loop trains ceil(rows / batch_size) steps of the rows it gets)."""
    fixed_subset = self.selection.selecting(epoch) and not self.weighted
    rows = self.selection.k_at(epoch) if fixed_subset else len(self._split)
    return -(-rows // self._batch_size)

  def rows_for_epoch(self, epoch: int, train_state: steps.TrainState,
                     state: bookkeeping.SelectionState):
    """Rows to train on in `epoch` (sorted), after any scoring pass due.

    Returns:
      (rows, float32 loss weights of the rows or None (unweighted methods),
      selection state, {"scoring_seconds", "selection_seconds"}).
    """
    if not self.selection.selecting(epoch):  # All rows (unit weights): no pass, no ranking.
      subset = self.selection.select(state, epoch)
      return (np.arange(len(self._split)), subset.weights, state,
              {"scoring_seconds": 0.0, "selection_seconds": 0.0})
    with self._clock.part("scoring") as scoring:
      if self.selection.policy.needs_scores:
        state = self._source.refresh(epoch, train_state, state)
    with self._clock.part("selection") as selecting:
      subset = self.selection.select({"scores": self._priorities(state)}, epoch)
      rows = np.searchsorted(self._split.ids, subset.ids)
    return rows, subset.weights, state, {"scoring_seconds": scoring.seconds,
                                         "selection_seconds": selecting.seconds}

  def _priorities(self, state: bookkeeping.SelectionState) -> np.ndarray:
    """What the policy ranks: the score buffer, or under RHO-LOSS the buffer's training
    losses less the irreducible ones (the buffer keeps the raw losses, as every train pass
    and scoring pass writes them)."""
    if self._reducible:
      return scores.reducible_loss(state["scores"], state["irreducible"])
    return state["scores"]

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
    with self._clock.part("selection"):
      rows, first = bookkeeping.first_pass(order, per_example)
      record = bookkeeping.train_pass_record(first["confidence"], first["correct"], self._num_bins)
      if self.selection.selecting(epoch):
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
          record.update(bookkeeping.scorer_record(calibration, rows, self._num_bins))
      if self._source.learns_from_training:
        state = bookkeeping.with_scores(state, rows, first["score"])
      if self._record_scores and jax.process_index() == 0:
        score_files.write_epoch_scores(workdir, epoch, self._num_ids, self._split.ids[rows],
                                       first["score"])
      state, seconds = bookkeeping.add_seconds(state, timings)
      record.update(seconds)
      return state, record
