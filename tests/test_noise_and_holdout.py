"""Generated label noise and the RHO-LOSS holdout: which rows flip and to what, which rows
each part trains on, what validation refuses, and which targets may score which runs."""

import ml_collections
import numpy as np
import pytest

from cpjax.config import validation
from cpjax.data import input_pipeline, splits
from cpjax.selection import score_sources
from tests.helpers import tiny_config

POOL = 1257  # configs/test.py: 1,437 training digits less the 180 of validation.


def dataset_config(**overrides) -> ml_collections.ConfigDict:
  return tiny_config(**{f"dataset.{k}": v for k, v in overrides.items()}).dataset


def test_noise_flips_an_exact_share_of_the_pool_and_never_keeps_a_class():
  labels = np.arange(1000) % 7
  pool = np.arange(100, 900)  # Rows outside the pool (0..99, 900..999) stand for validation.
  noisy = splits.noisy_labels(labels, pool, 0.25, seed=3, num_classes=7)
  changed = np.flatnonzero(noisy != labels)
  assert len(changed) == 200  # round(0.25 * 800): every drawn row changes class.
  assert np.all((changed >= 100) & (changed < 900))
  assert noisy.dtype == np.int32 and noisy.min() >= 0 and noisy.max() < 7
  # The same seed flips the same rows to the same classes; another seed other rows.
  np.testing.assert_array_equal(noisy, splits.noisy_labels(labels, pool, 0.25, 3, 7))
  other = splits.noisy_labels(labels, pool, 0.25, 4, 7)
  assert not np.array_equal(np.flatnonzero(other != labels), changed)


def test_noise_is_uniform_over_the_other_classes():
  # Two classes: a flip has one place to go. Ten classes: each of the 9 others about equally
  # often (a chi-square test at 0.1 % on 20,000 flips).
  labels = np.zeros(40_000, np.int64)
  two = splits.noisy_labels(labels, np.arange(40_000), 0.5, 0, 2)
  assert np.sum(two == 1) == 20_000
  ten = splits.noisy_labels(labels, np.arange(40_000), 0.5, 0, 10)
  counts = np.bincount(ten[ten != 0], minlength=10)[1:]
  chi2 = np.sum((counts - 20_000 / 9) ** 2 / (20_000 / 9))
  assert chi2 < 27.88  # The 99.9 % quantile of chi-square with 8 degrees of freedom.


@pytest.mark.parametrize("seed", [0, 3, 7])
def test_flipped_rows_are_spread_over_every_epochs_order(seed):
  """With the noise seed equal to the training seed (as a study that draws its noise per seed
  runs it), a full-data epoch's first fifth holds about a fifth of the flipped rows, in every
  epoch: 1,000 of 5,000 rows flipped, the first 1,000 of an epoch's order a hypergeometric
  draw with mean 200 and sd sqrt(1000 x 0.2 x 0.8 x 4000 / 4999) = 11.3 flipped rows; the bound
  is 8 sd. A noise draw that shared an epoch's stream would put all 1,000 first in it."""
  pool = np.arange(5000)
  flipped = np.flatnonzero(splits.noisy_labels(np.zeros(5000, np.int64), pool, 0.2, seed, 10))
  assert len(flipped) == 1000
  for epoch in range(40):
    first = splits.epoch_order(seed, epoch, pool, 100).ravel()[:1000]
    assert abs(np.isin(first, flipped).sum() - 200) < 8 * 11.3, epoch


@pytest.mark.parametrize("fraction", [0.1, 0.37])
def test_holdout_and_rest_partition_the_training_pool(fraction):
  parts = {part: splits.split_ids(dataset_config(holdout_fraction=fraction, train_part=part))
           for part in ("holdout", "rest")}
  everything = splits.split_ids(dataset_config())
  holdout, rest = parts["holdout"]["train"], parts["rest"]["train"]
  assert len(holdout) == round(fraction * POOL) and len(np.intersect1d(holdout, rest)) == 0
  np.testing.assert_array_equal(np.union1d(holdout, rest), everything["train"])
  for part, ids in parts.items():
    np.testing.assert_array_equal(ids["val"], everything["val"])  # Validation is untouched.
    assert splits.num_train_examples(
        dataset_config(holdout_fraction=fraction, train_part=part)) == len(ids["train"])


def test_noisy_digits_keep_clean_validation_and_test_labels_and_agree_across_parts():
  clean = input_pipeline.get_datasets(dataset_config())
  noisy = input_pipeline.get_datasets(dataset_config(label_noise=0.2, label_noise_seed=1))
  for name in ("val", "test"):
    np.testing.assert_array_equal(noisy[name].labels, clean[name].labels)
    np.testing.assert_array_equal(noisy[name].images, clean[name].images)
  assert np.sum(noisy["train"].labels != clean["train"].labels) == round(0.2 * POOL)
  # A run on the rest of a holdout sees, row for row, the labels of the run on everything.
  rest = input_pipeline.get_datasets(dataset_config(
      label_noise=0.2, label_noise_seed=1, holdout_fraction=0.1, train_part="rest"))["train"]
  position = np.searchsorted(noisy["train"].ids, rest.ids)
  np.testing.assert_array_equal(rest.labels, noisy["train"].labels[position])


@pytest.mark.parametrize("overrides, message", [
    ({"dataset.holdout_fraction": 0.1},
     "config.dataset.holdout_fraction=0.1 is unused with dataset.train_part='all'"),
    ({"dataset.train_part": "rest"},
     "config.dataset.holdout_fraction=0.0 holds out 0 of the 1257 training examples"),
    ({"dataset.train_part": "middle"}, "config.dataset.train_part"),
    ({"dataset.label_noise": 1.0}, "config.dataset.label_noise: must be in [0.0, 1.0)"),
    ({"dataset.label_noise": 0.2, "dataset.stream_dir": "/data/fm"},
     "config.dataset.label_noise=0.2 flips labels in memory"),
])
def test_bad_noise_and_holdout_settings_are_named(overrides, message):
  with pytest.raises(ValueError) as info:
    validation.validate(tiny_config(**overrides))
  assert message in str(info.value)


def _target_config(**dataset) -> ml_collections.ConfigDict:
  config = tiny_config(**{f"dataset.{k}": v for k, v in dataset.items()})
  return ml_collections.ConfigDict(config.to_dict())


def _check_target(config: ml_collections.ConfigDict) -> None:
  """score_sources.check_target of this run's sections, as preflight calls it."""
  score_sources.check_target(config.selection, config.dataset)


RHO_RUN = {"selection.method": "top_k", "selection.score": "reducible_loss",
           "selection.target_workdir": "/target", "selection.warmup_epochs": 1,
           "num_epochs": 3}


def test_a_holdout_target_may_score_the_rest_but_not_the_reverse(monkeypatch):
  holdout = _target_config(holdout_fraction=0.1, train_part="holdout")
  monkeypatch.setattr(score_sources, "read_run_config", lambda workdir: holdout)
  _check_target(tiny_config(**RHO_RUN, **{"dataset.holdout_fraction": 0.1,
                                          "dataset.train_part": "rest"}))
  rest = _target_config(holdout_fraction=0.1, train_part="rest")
  monkeypatch.setattr(score_sources, "read_run_config", lambda workdir: rest)
  with pytest.raises(ValueError, match="train the selecting run with train_part='rest'"):
    _check_target(tiny_config(**RHO_RUN, **{"dataset.holdout_fraction": 0.1,
                                            "dataset.train_part": "holdout"}))


@pytest.mark.parametrize("field, theirs", [("label_noise", 0.2), ("label_noise_seed", 5),
                                           ("holdout_fraction", 0.2)])
def test_a_target_with_other_labels_or_holdout_is_refused(monkeypatch, field, theirs):
  ours = {"label_noise": 0.1, "label_noise_seed": 1, "holdout_fraction": 0.1,
          "train_part": "rest"}
  target = _target_config(**{**ours, "train_part": "holdout", field: theirs})
  monkeypatch.setattr(score_sources, "read_run_config", lambda workdir: target)
  with pytest.raises(ValueError, match=f"dataset.{field}="):
    _check_target(tiny_config(**RHO_RUN, **{f"dataset.{k}": v for k, v in ours.items()}))
