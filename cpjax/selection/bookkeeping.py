"""The selection state and the per-epoch accounting: pure NumPy, no I/O.

The selection state is a dict of arrays checkpointed with the train state:
the score buffer (one score per training row), the last subset as a 0/1 mask,
how many subsets each row has been in, the epoch of the last scoring pass, and
the cumulative seconds per phase; under score=reducible_loss also each row's
irreducible loss and the target step it came from.
Every function returns new arrays and leaves its inputs untouched.
"""

import ml_collections
import numpy as np

from cpjax.calibration import metrics
from cpjax.data import splits
from cpjax.selection import scores

PHASES = ("scoring", "selection", "training")
SelectionState = dict[str, np.ndarray]


def initial_state(num_train: int, reducible: bool = False) -> SelectionState:
  """The selection state before any epoch: zero scores (as the reference), no subset.

  With `reducible` (score=reducible_loss) it also holds the irreducible losses, not yet
  computed: checkpointed with the rest, so a resumed run ranks by the very losses the
  uninterrupted run ranked by, without restoring the target again. Only such runs hold
  them, so every other run's checkpoint keeps its shape.
  """
  state = {"scores": np.zeros(num_train, np.float32),
           "subset": np.zeros(num_train, np.int32),  # 1 = in the last selected subset.
           "times_selected": np.zeros(num_train, np.int32),  # Selected subsets holding a row.
           "scored_epoch": np.array(-1, np.int32),  # Last scoring pass (fresh/target).
           "seconds": np.zeros(len(PHASES), np.float32)}  # Cumulative time per phase.
  if reducible:
    state["irreducible"] = np.zeros(num_train, np.float32)  # The target's loss per row.
    state["irreducible_step"] = np.array(-1, np.int32)  # Its checkpoint's step; -1 = none yet.
  return state


def initial_state_of(dataset: ml_collections.ConfigDict,
                     selection: ml_collections.ConfigDict) -> SelectionState:
  """`initial_state` of a run's config sections (config.dataset, config.selection): the
  checkpoint's "selection" subtree before any epoch."""
  return initial_state(splits.num_train_examples(dataset),
                       reducible=selection.score == scores.REDUCIBLE_LOSS)


def first_pass(order: np.ndarray, per_example: dict[str, np.ndarray]
               ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """The rows trained in an epoch and each row's outputs from its first pass.

  Args:
    order: [steps, B] rows in training order (the last batch cycles rows).
    per_example: arrays [steps * B] in that order.

  Returns:
    (sorted unique rows, per_example restricted to each row's first occurrence).
  """
  rows, first = np.unique(order.ravel(), return_index=True)
  return rows, {k: v[first] for k, v in per_example.items()}


def with_scores(state: SelectionState, rows: np.ndarray, scores: np.ndarray) -> SelectionState:
  """The state with the score buffer's `rows` set to `scores` (train-pass scoring)."""
  buffer = state["scores"].copy()
  buffer[rows] = scores
  return {**state, "scores": buffer}


def subset_record(state: SelectionState, rows: np.ndarray, labels: np.ndarray,
                  num_classes: int, priorities: np.ndarray | None = None
                  ) -> tuple[SelectionState, dict]:
  """Accounting of a selected epoch's subset, and the state with it as the last subset.

  Args:
    state: the selection state before this epoch's subset is recorded.
    rows: the rows trained this epoch.
    labels: [N] labels of every training row.
    num_classes: K.
    priorities: [N] what the policy ranked, if not the score buffer itself.

  Returns:
    (new state, record): overlap with the previous subset (None for the
    first), class counts, the smallest class share and the KL divergence of
    the subset's class histogram from the full set's, the share of rows never
    selected so far, mean priority of the subset and of all rows.
  """
  priorities = state["scores"] if priorities is None else priorities
  previous = state["subset"].astype(bool)
  current = np.zeros(len(previous), bool)
  current[rows] = True
  times_selected = state["times_selected"] + current
  counts = np.bincount(labels[rows], minlength=num_classes)
  record = {
      "subset_overlap": (float(np.sum(previous & current)) / len(rows)
                         if previous.any() else None),
      "subset_class_counts": counts.tolist(),
      "subset_min_class_share": float(counts.min() / len(rows)),
      "subset_class_kl": class_kl(counts, np.bincount(labels, minlength=num_classes)),
      "never_selected_share": float(np.mean(times_selected == 0)),
      "score_mean_selected": float(np.mean(priorities[rows])),
      "score_mean_all": float(np.mean(priorities)),
  }
  return {**state, "subset": current.astype(np.int32),
          "times_selected": times_selected.astype(np.int32)}, record


def class_kl(subset_counts: np.ndarray, full_counts: np.ndarray) -> float:
  """KL(p || q) = sum_c p_c log(p_c / q_c) in nats, p and q the class shares of the subset
  and of the full set (0 log 0 = 0): 0 for a stratified subset; large when selection
  starves classes (max-entropy top-k on Fashion-MNIST does: studies/results/selection.md)."""
  p = subset_counts / subset_counts.sum()
  q = full_counts / full_counts.sum()
  held = p > 0
  return float(np.sum(p[held] * np.log(p[held] / q[held])))


def irreducible_record(irreducible: np.ndarray, rows: np.ndarray) -> dict:
  """Mean irreducible loss of a subset and of all rows (score=reducible_loss): a subset
  that avoids noisy examples has the lower one. With the mean reducible losses
  (score_mean_*) they add up to the mean training losses the ranking started from."""
  return {"irreducible_loss_mean_selected": float(np.mean(irreducible[rows])),
          "irreducible_loss_mean_all": float(np.mean(irreducible))}


def pruning_record(num_kept: int, num_train: int) -> dict:
  """Size of a pruned epoch (infobatch): rows kept, and the share 1 - kept / N pruned."""
  return {"kept_count": num_kept, "pruned_share": 1.0 - num_kept / num_train}


def train_pass_record(confidence: np.ndarray, correct: np.ndarray, num_bins: int) -> dict:
  """Size and ECE of what an epoch trained on, from its own train-pass outputs."""
  return {"selected_k": len(confidence),
          "train_ece": metrics.ece_from_confidences(confidence, correct, num_bins)}


def scorer_record(calibration: tuple[np.ndarray, np.ndarray], rows: np.ndarray,
                  num_bins: int) -> dict:
  """ECE of the scorer's own predictions (the last scoring pass's [N] confidences and
  correctness) on the rows the epoch trained: how far to trust the ranking that chose them
  (the premise of Tata et al. 2022, 'Can Calibration Improve Sample Prioritization?', is that
  a calibrated scorer ranks better)."""
  confidence, correct = calibration
  return {"scorer_ece": metrics.ece_from_confidences(confidence[rows], correct[rows], num_bins)}


def add_seconds(state: SelectionState, timings: dict[str, float]
                ) -> tuple[SelectionState, dict[str, float]]:
  """Adds an epoch's `{phase}_seconds` to the totals; returns the state and both as a record."""
  seconds = state["seconds"] + np.array([timings[f"{p}_seconds"] for p in PHASES], np.float32)
  record = {**timings, **{f"total_{p}_seconds": float(s) for p, s in zip(PHASES, seconds)}}
  return {**state, "seconds": seconds}, record
