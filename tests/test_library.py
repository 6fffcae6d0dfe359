"""The library API for one's own loop (cpjax.selection.api, examples/own_loop.py): the same ids
as the trainer's selection for the same seed and scores, a checkpointable state, clear errors."""

import os
import re

import numpy as np
import orbax.checkpoint as ocp
import pytest

from cpjax.config import validation
from cpjax.data import specs, splits
from cpjax.runtime import sharding
from cpjax.selection import api, bookkeeping, policies, score_sources, selector
from examples import own_loop
from tests import helpers
from tests.helpers import tiny_config

# Non-default settings, so that a setting the API dropped would show. A policy's setting not
# listed here is tested at its declared default (add a non-default value here for it).
SETTINGS = {"random_share": 0.3, "temperature": 0.2, "stratify_drop": 0.1, "num_strata": 7,
            "prune_ratio": 0.4, "anneal_fraction": 0.25, "infobatch_rescale": False, "mix": 0.3,
            "max_weight": 1.5}


def _trainer_ids(method, ids, labels, scores_by_epoch, seed, num_epochs, warmup, fraction,
                 **schedule):
  """The trainer's Selector (train-pass scoring) on the same ids, labels and score buffers:
  {epoch: (ids, weights)}. `schedule`: final_full_epochs, fraction_end. The Selector selects
  through an api.Selection it builds from config.selection, so this checks that translation
  (every field and setting reaching it) and the mapping of ids to the split's rows."""
  config = tiny_config(**{"seed": seed, "num_epochs": num_epochs, "selection.method": method,
                          "selection.warmup_epochs": warmup, "selection.fraction": fraction,
                          **{f"selection.{k}": v for k, v in {**SETTINGS, **schedule}.items()}})
  data = specs.DATASETS[config.dataset.name]
  chooser = selector.Selector(config.selection, splits.Split(None, labels, ids),
                              sharding.create_mesh(), score_sources.TrainPass(),
                              num_epochs=num_epochs, batch_size=config.batch_size, seed=seed,
                              num_classes=data.num_classes, num_ids=data.num_train,
                              num_bins=config.evaluation.num_bins)
  out = {}
  for epoch, buffer in scores_by_epoch.items():
    state = {**bookkeeping.initial_state(len(ids)), "scores": np.asarray(buffer, np.float32)}
    rows, weights, _, _ = chooser.rows_for_epoch(epoch, None, state)
    out[epoch] = ids[rows], weights
  return out


@pytest.mark.parametrize("method", policies.POLICIES.names())
def test_every_policy_selects_the_trainers_ids_for_the_same_seed_and_scores(method):
  rng = np.random.default_rng(3)
  ids, labels = np.sort(rng.choice(5000, 300, replace=False)), rng.integers(0, 4, 300)
  buffers = {epoch: rng.normal(size=300).astype(np.float32) for epoch in range(6)}
  settings = {s.name: SETTINGS.get(s.name, s.default) for s in policies.POLICIES[method].settings}
  selection = api.Selection(ids, labels, method=method, fraction=0.2, warmup_epochs=2,
                            num_epochs=6, seed=11, **settings)
  want = _trainer_ids(method, ids, labels, buffers, 11, 6, 2, 0.2)
  for epoch, buffer in buffers.items():
    got = selection.select({"scores": buffer}, epoch)
    np.testing.assert_array_equal(got.ids, want[epoch][0], err_msg=f"{method} epoch {epoch}")
    if selection.weighted:
      np.testing.assert_array_equal(got.weights, want[epoch][1])
    else:
      assert got.weights is None and want[epoch][1] is None
  if method == "top_k":  # And by hand: the 60 highest, ties to the lower id (none here).
    assert selection.k_at(3) == 60
    np.testing.assert_array_equal(selection.select({"scores": buffers[3]}, 3).ids,
                                  np.sort(ids[np.argsort(-buffers[3], kind="stable")[:60]]))


@pytest.mark.parametrize("method", ["top_k", "sampled", "random"])
def test_a_budget_schedule_selects_the_trainers_ids(method):
  """fraction_end 0.1 -> 0.5 over selected epochs 1..4, then 2 final full epochs."""
  rng = np.random.default_rng(5)
  ids, labels = np.arange(200), rng.integers(0, 3, 200)
  buffers = {epoch: rng.normal(size=200).astype(np.float32) for epoch in range(7)}
  selection = api.Selection(ids, labels, method=method, fraction=0.1, fraction_end=0.5,
                            final_full_epochs=2, warmup_epochs=1, num_epochs=7, seed=4,
                            **({"temperature": 0.2} if method == "sampled" else {}))
  want = _trainer_ids(method, ids, labels, buffers, 4, 7, 1, 0.1, final_full_epochs=2,
                      fraction_end=0.5)
  sizes = [len(selection.select({"scores": b}, e).ids) for e, b in buffers.items()]
  assert sizes == [200, 20, 47, 73, 100, 200, 200]  # round(200 (0.1 + 0.4 (e - 1) / 3)).
  for epoch, buffer in buffers.items():
    np.testing.assert_array_equal(selection.select({"scores": buffer}, epoch).ids,
                                  want[epoch][0], err_msg=f"{method} epoch {epoch}")


@pytest.mark.slow  # Trains the example for 3 epochs.
def test_the_own_loop_example_selects_what_the_trainer_selects():
  """examples/own_loop.py, 3 epochs: its top-k entropy subsets are the trainer's for the
  scores its train step recorded, and by hand the 30 % highest of those scores."""
  history, report = own_loop.train(epochs=3, fraction=0.3, seed=0)
  ids = np.arange(len(history[0]["ids"]))
  labels = own_loop.load(0)["train"][1]
  want = _trainer_ids("top_k", ids, labels, {h["epoch"]: h["scores"] for h in history}, 0, 3,
                      1, 0.3)
  k = int(round(0.3 * len(ids)))
  for h in history:
    np.testing.assert_array_equal(h["ids"], want[h["epoch"]][0])
    if h["epoch"] >= 1:
      assert len(h["ids"]) == k and np.all(h["scores"] >= 0) and h["scores"].max() > 0
      np.testing.assert_array_equal(h["ids"], np.sort(np.argsort(-h["scores"],
                                                                 kind="stable")[:k]))
  assert 0.5 < report["accuracy"] <= 1 and 0 <= report["ece"] < 1
  assert report["nll_calibrated"] <= report["nll"] + 1e-3  # Fitted on validation, tested here.


def test_the_state_is_a_pytree_that_orbax_round_trips(tmp_path):
  selection = api.Selection(np.arange(50), method="sampled", fraction=0.2, temperature=0.5,
                            num_epochs=4, seed=2)
  state = selection.record(selection.init(), np.arange(50),
                           np.random.default_rng(0).normal(size=50))
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "selection", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "selection")
  np.testing.assert_array_equal(restored["scores"], state["scores"])
  np.testing.assert_array_equal(selection.select(restored, 3).ids,
                                selection.select(state, 3).ids)


def test_record_keeps_an_ids_first_score_and_refuses_unknown_ids():
  selection = api.Selection(np.array([3, 5, 9]), method="top_k", count=1)
  state = selection.record(selection.init(), [9, 3, 9], [1.0, 2.0, 7.0])
  np.testing.assert_array_equal(state["scores"], [2.0, 0.0, 1.0])
  assert selection.select(state, 0).ids.tolist() == [3]
  with pytest.raises(ValueError, match=r"ids not in the training set: \[4\]"):
    selection.record(state, [4, 5], [0.0, 0.0])


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "sampled", "temprature": 0.1}, "no setting 'temprature'; did you mean "
                                               "temperature"),
    ({"method": "sampled", "temperature": -1.0},
     "sampled setting temperature: must be at least 0.0"),
    ({"method": "top-k"}, "unknown selection policy 'top-k'; did you mean top_k"),
    ({"method": "infobatch", "direction": "easiest"}, "valid: 'hardest'"),
])
def test_bad_arguments_are_named_with_the_valid_ones(kwargs, message):
  with pytest.raises(ValueError, match=message):
    api.Selection(np.arange(10), **kwargs)


# Values that cannot work together, as api.Selection's keywords (num_epochs and the
# selection section's fields of a config), and the problem's text, worked by hand on
# configs/test.py's 1257 training examples.
COMBINATIONS = [
    ({"method": "stratified", "fraction": 0.5, "stratify_drop": 0.6},
     # k = round(0.5 * 1257) = 628 (to even); 1257 - int(0.6 * 1257) = 1257 - 754 = 503.
     "stratify_drop=0.6 leaves 503 of 1257 training examples, fewer than the subset size 628"),
    ({"method": "infobatch", "num_epochs": 4, "warmup_epochs": 2, "anneal_fraction": 0.5},
     "anneal_fraction=0.5 anneals from epoch 2 of 4, no later than warmup_epochs=2: "
     "infobatch would never prune"),  # floor((1 - 0.5) * 4) = 2.
    ({"method": "infobatch", "num_epochs": 4, "direction": "easiest"},
     "direction='easiest' does not work with method='infobatch'"),
    ({"method": "top_k", "count": 2000}, "count=2000 exceeds the 1257 training examples"),
    ({"method": "top_k", "num_epochs": 3, "warmup_epochs": 3},
     "warmup_epochs=3 leaves no epoch of the 3 (num_epochs) to select in"),
    ({"method": "top_k", "num_epochs": 2, "warmup_epochs": 1, "final_full_epochs": 1},
     "warmup_epochs=1 and final_full_epochs=1 leave no epoch of the 2 (num_epochs)"),
    ({"method": "infobatch", "num_epochs": 4, "final_full_epochs": 1},
     "final_full_epochs=1 works with the fixed-size methods only, not method='infobatch'"),
    ({"method": "top_k", "count": 10, "fraction_end": 0.5}, "fraction_end=0.5 needs count=0"),
    ({"method": "random_without_replacement", "fraction_end": 0.5},
     "fraction_end=0.5 does not work with method='random_without_replacement' (its subset "
     "needs one size)"),
]


@pytest.mark.parametrize("kwargs, problem", COMBINATIONS)
def test_a_bad_combination_is_the_same_error_in_the_api_and_the_config(kwargs, problem):
  config = tiny_config(**{("" if name == "num_epochs" else "selection.") + name: value
                          for name, value in kwargs.items()},
                       **({"selection.score": "loss"} if kwargs["method"] == "infobatch"
                          and "direction" not in kwargs else {}))
  with pytest.raises(validation.ConfigError) as from_config:
    validation.validate(config)
  assert f"config.selection.{problem}" in str(from_config.value)
  with pytest.raises(ValueError) as from_api:
    api.Selection(np.arange(splits.num_train_examples(config.dataset)), **kwargs)
  assert problem in str(from_api.value)


def _python_blocks(path: str) -> list[str]:
  with open(os.path.join(helpers.REPO, path)) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.parametrize("index", range(len(_python_blocks("docs/library.md"))))
def test_every_python_block_of_docs_library_runs(index):
  exec(compile(_python_blocks("docs/library.md")[index], f"docs/library.md block {index}",
               "exec"), {})  # pylint: disable=exec-used
