"""The registries of policies, scores and losses: one registration adds a choice everywhere.

A toy policy, a toy score and a toy loss are registered here, in the test (not in the
package), and are then valid config choices with their declared settings, selectable,
scored and trained with; the docs' tables list exactly the registered names.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpjax import registry
from cpjax.calibration import losses
from cpjax.config import validation
from cpjax.selection import policies, scores
from cpjax.training import train
from scripts import registry_tables
from tests import helpers
from tests.helpers import tiny_config

STRIDE = registry.Setting("toy_stride", 3, registry.integer(1), "toy: every n-th id.")


def every_nth(request: policies.Request, toy_stride: int) -> np.ndarray:
  """The toy policy: ids at positions (epoch + j * stride) mod N, j = 0 .. k-1 (wrapping)."""
  positions = (request.epoch + toy_stride * np.arange(request.k)) % len(request.ids)
  return request.ids[positions]


TOY_POLICY = policies.Policy("every_nth", every_nth, "toy: every n-th id", settings=(STRIDE,),
                             needs_scores=False)


def _expected(ids: np.ndarray, k: int, epoch: int, stride: int) -> list[int]:
  """The toy rule, written out by hand: a Python loop over positions."""
  return sorted(int(ids[(epoch + stride * j) % len(ids)]) for j in range(k))


def test_a_policy_registered_in_a_test_selects_with_its_declared_setting():
  ids, labels = np.arange(10) * 2 + 1, np.zeros(10, int)
  with policies.POLICIES.registered(TOY_POLICY):
    request = policies.Request(np.zeros(10), labels, ids, k=3, seed=0, epoch=2)
    settings = policies.POLICIES.keywords("every_nth", {"toy_stride": 4})
    chosen, weights = policies.select("every_nth", request, settings)
    # Positions 2, 6 and 10 mod 10 = 0, sorted.
    assert chosen.tolist() == _expected(ids, 3, 2, 4) == [1, 5, 13] and weights is None
    # The config schema and configs/default.py know the policy and its setting now.
    config = tiny_config(**{"num_epochs": 2, "selection.method": "every_nth",
                            "selection.warmup_epochs": 1})
    assert config.selection.toy_stride == 3
    validation.validate(config)
    config.selection.toy_stride = 0
    with pytest.raises(validation.ConfigError,
                       match=r"config.selection.toy_stride: must be at least 1, got 0"):
      validation.validate(config)
  assert "every_nth" not in policies.POLICIES  # Gone again after the block.
  with pytest.raises(validation.ConfigError, match="config.selection.method: got "
                     "'every_nth'; valid choices: class_balanced, full"):
    validation.validate(tiny_config(**{"selection.method": "every_nth"}))


@pytest.mark.slow
def test_a_policy_registered_in_a_test_trains_a_run(tmp_path, digits):
  """configs/test.py with the toy policy: the subsets the run records are the toy rule's."""
  with policies.POLICIES.registered(TOY_POLICY):
    config = tiny_config(**{"num_epochs": 3, "selection.method": "every_nth",
                            "selection.warmup_epochs": 1, "selection.fraction": 0.25,
                            "evaluation.calibrator_resamples": 0})
    config.selection.toy_stride = 5
    train.train_and_evaluate(config, str(tmp_path))
  records = helpers.read_metrics(str(tmp_path))
  split = digits["train"]
  k = policies.subset_size(0.25, 0, len(split.ids))
  for epoch in (1, 2):
    chosen = np.searchsorted(split.ids, _expected(split.ids, k, epoch, 5))
    want = np.bincount(split.labels[chosen], minlength=10).tolist()
    got = next(r for r in records if r["epoch"] == epoch)
    assert got["subset_class_counts"] == want, epoch


def test_a_score_and_a_loss_registered_in_a_test_are_valid_choices_with_their_settings():
  power = registry.Setting("toy_power", 2.0, registry.number(0.0), "toy: exponent.")
  toy_score = scores.Score("toy_confidence", lambda z, y, toy_power: jnp.max(z, -1) ** toy_power,
                           "toy", settings=(power,), uses_labels=False)
  scale = registry.Setting("toy_scale", 0.5, registry.number(0.0), "toy: CE multiplier.",
                           arg="scale")
  toy_loss = losses.LossSpec("toy_scaled_ce", lambda z, y, scale: scale *
                             losses.cross_entropy(z, y), "toy", settings=(scale,))
  with scores.SCORES.registered(toy_score), losses.LOSSES.registered(toy_loss):
    config = tiny_config(**{"selection.score": "toy_confidence", "loss.name": "toy_scaled_ce"})
    validation.validate(config)
    config.selection.toy_power, config.loss.toy_scale = 3.0, 2.0
    logits, labels = jnp.array([[1.0, 2.0], [0.5, -1.0]]), jnp.array([1, 0])
    # Jitted, as the steps run them (op by op, every operation would compile on its own).
    np.testing.assert_allclose(jax.jit(scores.forward_score("toy_confidence", config.selection))(
        logits, labels), [8.0, 0.125])
    ce = [np.log1p(np.exp(-1.0)), np.log1p(np.exp(-1.5))]  # -log softmax of the label.
    np.testing.assert_allclose(jax.jit(losses.get_loss(config.loss))(logits, labels),
                               2 * np.array(ce), rtol=1e-6)


@pytest.mark.parametrize("check, good, bad, expected", [
    (registry.integer(1), 1, 0, "must be at least 1, got 0"),
    (registry.integer(None, 5), 5, 6, "must be at most 5, got 6"),
    (registry.integer(1, 5), 5, 6, "must be in [1, 5], got 6"),
    (registry.number(0.0, low_open=True), 1e-9, 0.0, "must be above 0.0, got 0.0"),
    (registry.number(None, 1.0, high_open=True), 0.5, 1.0, "must be below 1.0, got 1.0"),
    (registry.number(0.0, 1.0, high_open=True), 0.0, 1.0, "must be in [0.0, 1.0), got 1.0"),
])
def test_a_range_with_one_end_is_said_in_words(check, good, bad, expected):
  """One bound: "at least 1", not "in [1, None]"; two: the interval."""
  assert check(good) is None
  assert check(bad) == expected


def test_unknown_names_get_the_closest_registered_one():
  for field, bad, close in [("selection.method", "top-k", "top_k"),
                            ("selection.score", "entropi", "entropy"),
                            ("loss.name", "focall", "focal")]:
    with pytest.raises(validation.ConfigError) as info:
      validation.validate(tiny_config(**{field: bad}))
    assert f"config.{field}: got {bad!r}; did you mean {close}" in str(info.value)
  with pytest.raises(ValueError, match="unknown selection policy 'samplde'; did you mean "
                                       "sampled"):
    policies.POLICIES["samplde"]  # pylint: disable=pointless-statement


def test_a_name_or_a_setting_is_declared_once():
  with pytest.raises(ValueError, match="'top_k' is already registered"):
    policies.POLICIES.register(policies.Policy("top_k", every_nth, "again"))
  other = registry.Setting("temperature", 2.0, registry.number(0.0), "another temperature")
  with pytest.raises(ValueError, match="declares setting 'temperature', which another entry "
                                       "declares differently"):
    policies.POLICIES.register(policies.Policy("hot", every_nth, "x", settings=(other,)))
  assert "hot" not in policies.POLICIES


def test_the_docs_tables_are_the_registries():
  """docs/selection.md and docs/losses.md hold what scripts/registry_tables.py writes."""
  generated = registry_tables.tables()
  for name, page in registry_tables.PAGES.items():
    with open(os.path.join(helpers.REPO, page)) as f:
      text = f.read()
    assert f"<!-- registry:{name} -->" in text, (page, name)
    assert registry_tables.render(text, generated) == text, (
        f"{page} is stale: run python -m scripts.registry_tables")
  # And each generated table names exactly the registered entries, in its first column.
  for name, registered in [("selection.method", policies.POLICIES),
                           ("selection.score", scores.SCORES), ("loss.name", losses.LOSSES)]:
    rows = generated[name].splitlines()[2:]
    assert [re.match(r"\| `([^`]+)`", row).group(1) for row in rows] == list(registered.names())


def _readme_table_names(header: str) -> set[str]:
  """The backticked names in the first column of README.md's table under `header`."""
  with open(os.path.join(helpers.REPO, "README.md")) as f:
    lines = f.read().split(header, 1)[1].splitlines()[2:]
  names = set()
  for line in lines:
    if not line.startswith("|"):
      break
    names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
  return names


def test_the_readme_tables_list_exactly_the_registered_policies_and_losses():
  assert _readme_table_names("| `selection.method` | subset |") == set(policies.POLICIES.names())
  assert _readme_table_names("| name | loss | paper |") == set(losses.LOSSES.names())


def test_existing_flat_setting_names_stay_config_fields_with_their_old_defaults():
  """The settings keep their flat names (selection.temperature, ...) and the values that
  configs/default.py wrote out before they were declared beside their entries."""
  config = tiny_config()
  before = {"selection": {"random_share": 0.5, "temperature": 1.0, "stratify_drop": 0.0,
                          "num_strata": 50, "prune_ratio": 0.5, "anneal_fraction": 0.125,
                          "infobatch_rescale": True, "mix": 0.5, "max_weight": 10.0,
                          "weighting": "normalized"},
            "loss": {"label_smoothing": 0.05, "ls_convention": "uniform", "focal_gamma": 3.0,
                     "gamma_boundaries": (100, 250), "mmce_lambda": 2.0, "mmce_form": "code",
                     "mmce_kernel_width": 0.4, "mbls_margin": 10.0, "mbls_lambda": 0.1,
                     "ecp_alpha": 0.1, "surrogate_lambda": 0.5, "dece_bins": 15,
                     "dece_t_a": 100.0, "dece_t_b": 0.01, "sece_bandwidth": 0.05}}
  for section, values in before.items():
    for name, value in values.items():
      assert config[section][name] == value and type(config[section][name]) is type(value)
  assert set(policies.POLICIES.defaults()) == set(before["selection"])
  assert set(losses.LOSSES.defaults()) == set(before["loss"])


def test_a_registry_lists_looks_up_and_names_a_bad_value_with_its_choices():
  """The one Registry every kind of entry uses (models, source kinds, crops, maps too)."""
  toys = registry.Registry("toy entry", "toy", hint="or anything else by hand")
  first = policies.Policy("beta", every_nth, "one")
  second = policies.Policy("alpha", every_nth, "two")
  toys.register(first)
  toys.register(second)
  assert list(toys) == ["beta", "alpha"] and len(toys) == 2  # Registration order.
  assert toys["alpha"] is second and toys.get("gamma") is None and "beta" in toys
  with pytest.raises(ValueError, match=r"unknown toy entry 'alpah'; did you mean alpha\? "
                                       "valid choices: alpha, beta, or anything else by hand"):
    toys["alpah"]  # pylint: disable=pointless-statement
  check = toys.check()
  assert check("beta") is None
  assert check(["beta"]) == ("got ['beta']; valid choices: alpha, beta, or anything else by "
                             "hand")  # An unhashable value is named, not a TypeError.
