"""A user's own Flax module by import path (`--config.model.name=package.module:Class`):
it trains through configs/test.py, keeps its own parameters, and every way of breaking the
contract (cpjax/models/custom.py) is refused at config validation, naming the bad value."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpjax import models
from cpjax.config import validation
from cpjax.models import custom
from cpjax.training import train
from tests import helpers, toy_models

TOY = "tests.toy_models:ToyNet"
MLP = "tests.toy_models:LogitsOnlyMLP"
NO_DTYPE = "tests.toy_models:NoDtype"


def _problems(name, **overrides):
  """config_validation's message for configs/test.py with model.name=`name` ('' if valid)."""
  try:
    validation.validate(helpers.tiny_config(**{"model.name": name, **overrides}))
  except validation.ConfigError as err:
    return str(err)
  return ""


@pytest.mark.parametrize("name, expected", [
    ("tests.no_such_module:Net",
     "cannot import module 'tests.no_such_module' (ModuleNotFoundError"),
    ("tests.toy_models:Missing", "has no attribute 'Missing'; its flax modules: HalfParams, "
                                 "LogitsOnlyMLP, NoDtype, NoNumClasses"),
    ("tests.toy_models:NotAModule", "NotAModule is <class 'tests.toy_models.NotAModule'>, "
                                    "not a flax.linen.Module subclass"),
    ("tests.toy_models:not_a_class", "not a flax.linen.Module subclass"),
    ("tests.toy_models:", "an import path is 'package.module:ClassName'"),
    ("tests.toy_models:ToyNet:x", "an import path is 'package.module:ClassName'"),
    ("tests.toy_models:NoNumClasses", "NoNumClasses(num_classes=10, dtype=float32), which "
                                      "failed"),
    ("tests.toy_models:WrongClasses", "apply(x, train=False) returned logits float32[2, 11]; "
                                      "expected a float array [2, 10]"),
    ("tests.toy_models:ThreeOutputs", "it must return logits [B, 10] or (logits [B, 10], "
                                      "features [B, d])"),
    ("tests.toy_models:WithDropout", "apply(x, train=True) on a float32 batch [2, 8, 8, 1] "
                                     "failed: InvalidRngError"),
    ("tests.toy_models:HalfParams", "parameters of dtype ['bfloat16']: keep them float32"),
])
def test_each_broken_contract_is_refused_naming_the_value(name, expected):
  message = _problems(name)
  assert f"config.model.name: got {name!r}" in message or f"{name!r}: " in message, message
  assert expected in message, message


def test_fl_gamma_needs_features_and_a_head():
  message = _problems(MLP, **{"loss.name": "flgamma_sece", "dataset.meta_val_size": 128})
  assert f"{MLP!r}: returns logits alone; the flgamma_* losses need (logits, features)" in message
  assert _problems(TOY, **{"loss.name": "flgamma_sece", "dataset.meta_val_size": 128}) == ""


@pytest.mark.parametrize("name", [TOY, MLP, NO_DTYPE])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_modules_that_meet_the_contract_validate(name, dtype):
  assert _problems(name, **{"model.dtype": dtype}) == ""


@pytest.mark.parametrize("cls, returns_features", [(toy_models.ToyNet, True),
                                                    (toy_models.LogitsOnlyMLP, False)])
def test_wrapper_keeps_the_modules_own_parameters_and_outputs(cls, returns_features):
  """cpjax's wrapper initialises exactly the parameters the module initialises alone (same
  tree, same values) and passes its logits through, as float32 (logits, features)."""
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 1))
  wrapped = models.create_model(f"tests.toy_models:{cls.__name__}", 10, "bfloat16")
  alone = cls(num_classes=10, dtype=jnp.bfloat16)
  ours = jax.jit(wrapped.init)(jax.random.PRNGKey(0), x)
  theirs = jax.jit(lambda k, x: alone.init(k, x, train=False))(jax.random.PRNGKey(0), x)
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  # Compared in NumPy: jnp comparisons outside jit would compile a program per leaf shape.
  assert all(jax.tree.leaves(jax.tree.map(
      lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), ours, theirs)))
  logits, features = jax.jit(wrapped.apply)(ours, x)
  expected = jax.jit(lambda v, x: alone.apply(v, x, train=False))(theirs, x)
  expected_logits = expected[0] if returns_features else expected
  assert logits.dtype == jnp.float32
  np.testing.assert_array_equal(logits, np.asarray(expected_logits).astype(np.float32))
  assert (features is not None) == returns_features


def test_a_module_without_dtype_computes_in_its_own_with_one_notice(caplog, monkeypatch):
  """NoDtype is built as NoDtype(num_classes=10): under model.dtype=bfloat16 its logits are
  its own float32 ones, bit for bit (a bfloat16 computation would round them), and one
  notice says model.dtype was not passed; float32 asks for nothing it lacks: no second one."""
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 8, 1))
  alone = toy_models.NoDtype(num_classes=10)
  variables = jax.jit(lambda k, x: alone.init(k, x, train=False))(jax.random.PRNGKey(0), x)
  expected = np.asarray(jax.jit(lambda v, x: alone.apply(v, x, train=False))(variables, x))
  assert expected.dtype == np.float32
  monkeypatch.setattr(custom, "_NOTIFIED", set())  # As in a fresh process.
  with caplog.at_level("WARNING"):
    for _ in range(2):  # Built twice (validation and the run build it): noticed once.
      wrapped = models.create_model(NO_DTYPE, 10, "bfloat16")
    models.create_model(NO_DTYPE, 10, "float32")
  notices = [r.getMessage() for r in caplog.records if "has no `dtype` field" in r.getMessage()]
  assert notices == [f"model.dtype=bfloat16 is not passed to {NO_DTYPE}: it has no `dtype` "
                     "field, so it computes in its own dtype (declare `dtype: Any = "
                     "jnp.float32` to take model.dtype)."]
  logits, _ = jax.jit(wrapped.apply)(variables, x)
  np.testing.assert_array_equal(np.asarray(logits), expected)


@pytest.mark.slow  # A main.py process.
def test_main_trains_a_module_without_dtype_with_no_extra_flag(tmp_path):
  """From main.py, model.dtype=bfloat16 and a module with num_classes alone: it trains, its
  checkpoint holds the module's float32 parameters, and the notice is logged once."""
  workdir = str(tmp_path / "run")
  result = helpers.run_main(workdir, f"--config.model.name={NO_DTYPE}",
                            "--config.model.dtype=bfloat16", "--config.num_epochs=1",
                            "--config.evaluation.ood=", "--config.evaluation.calibrator_folds=2",
                            "--config.evaluation.calibrator_resamples=0",
                            "--config.evaluation.bootstrap_resamples=20")
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stderr.count("has no `dtype` field, so it computes in its own dtype") == 1
  params = helpers.restore_checkpoint(workdir)["train"]["params"]
  assert {np.asarray(p).dtype.name for p in jax.tree.leaves(params)} == {"float32"}
  assert jax.tree.map(np.shape, params) == {"Dense_0": {"bias": (10,), "kernel": (64, 10)}}


@pytest.mark.slow
def test_training_runs_with_a_users_module(tmp_path):
  """configs/test.py with a logits-only, BatchNorm-free MLP: trains, evaluates and checkpoints
  the module's own parameter tree (an empty batch_stats)."""
  workdir = str(tmp_path)
  config = helpers.tiny_config(**{"model.name": MLP, "evaluation.ood": ""})
  validation.validate(config)
  train.train_and_evaluate(config, workdir)
  epochs = helpers.read_metrics(workdir)
  assert [r["epoch"] for r in epochs] == [0, 1]
  assert epochs[1]["train_loss"] < epochs[0]["train_loss"]
  assert epochs[1]["test_accuracy"] > 0.3  # Chance is 0.1 on the ten digit classes.
  restored = helpers.restore_checkpoint(workdir)
  alone = jax.eval_shape(lambda: toy_models.LogitsOnlyMLP(num_classes=10).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8, 8, 1)), train=False))
  shapes = jax.tree.map(np.shape, restored["train"]["params"])
  assert shapes == jax.tree.map(lambda a: a.shape, alone["params"])


@pytest.mark.slow  # A main.py process.
def test_main_refuses_a_bad_module_before_touching_the_workdir(tmp_path):
  workdir = str(tmp_path / "run")
  result = helpers.run_main(workdir, "--config.model.name=tests.toy_models:WrongClasses")
  assert result.returncode == 2, result.stderr[-2000:]
  assert ("config.model.name: 'tests.toy_models:WrongClasses': apply(x, train=False) returned "
          "logits float32[2, 11]") in result.stderr
  assert not os.path.exists(workdir)  # Nothing read, compiled or written.
