"""Config validation: bad values are named with the valid choices, before any work."""

import pytest

from configs import (
  cifar10,
  cifar10_target,
  cifar100,
  cifar100_target,
  default,
  fashion_mnist,
  fashion_mnist_selection,
  fashion_mnist_study,
)
from cpjax import config_validation, train
from cpjax.data import input_pipeline
from tests.helpers import tiny_config


@pytest.mark.parametrize("module", [default, cifar10, cifar100, cifar10_target, cifar100_target,
                                    fashion_mnist, fashion_mnist_selection, fashion_mnist_study])
def test_shipped_configs_are_valid(module):
  config_validation.validate(module.get_config())


@pytest.mark.parametrize("field, value, expected", [
    ("model.name", "resnet19", "valid choices: resnet110, resnet18"),
    ("dataset.name", "imagenet", "valid choices: cifar10, cifar100, digits"),
    ("loss.name", "focal_typo", "config.loss.name: got 'focal_typo'"),
    ("loss.reduction", "median", "valid choices: mean, sum"),
    ("optimizer.schedule", "linear", "valid choices: constant, cosine, multistep"),
    ("optimizer.schedule_unit", "batch", "valid choices: epoch, step"),
    ("budget_steps", -1, "config.budget_steps: must be in [0, None], got -1"),
    ("optimizer.learning_rate", 0.0, "config.optimizer.learning_rate: must be in (0.0"),
    ("optimizer.learning_rate", float("nan"), "must be finite"),
    ("optimizer.momentum", 1.5, "config.optimizer.momentum: must be in [0.0, 1.0], got 1.5"),
    ("num_epochs", 0, "config.num_epochs: must be in [1, None], got 0"),
    ("optimizer.milestones", (250, 150), "must be increasing ints"),
    ("dataset.val_size", 5000,
     "config.dataset.val_size=5000 must be below the train split size 1437"),
    ("batch_size", 60, "config.batch_size=60 must be divisible by the device count 8"),
    ("evaluation.temperature_method", "platt", "valid choices: grid_ece, grid_nll, lbfgs_nll"),
    ("evaluation.bootstrap_kind", "bca", "valid choices: basic, percentile"),
    ("evaluation.calibrator", "platt", "valid choices: auto, dirichlet, ensemble_temperature"),
    ("evaluation.calibrator_folds", 1, "config.evaluation.calibrator_folds: must be in [2, None]"),
    ("evaluation.calibrator_folds", 500,
     "calibrator_folds=500 exceeds config.dataset.val_size=180"),
    ("evaluation.bootstrap_level", 1.0, "bootstrap_level=1.0 must be below 1"),
    ("evaluation.ood", "svhn", "config.evaluation.ood='svhn' must be another dataset with the "
                               "image shape of 'digits'"),
    ("evaluation.ood", "noise", "valid choices: , cifar10"),
    ("evaluation.ood_severity", 6, "config.evaluation.ood_severity: must be in [1, 5], got 6"),
    ("xla_cpu_options", "fast", "valid choices: tuned, xla_default"),
])
def test_bad_value_names_field_and_choices(field, value, expected):
  with pytest.raises(config_validation.ConfigError) as info:
    config_validation.validate(tiny_config(**{field: value}))
  assert expected in str(info.value)


@pytest.mark.parametrize("field, value, expected", [
    ("batch_size", "64", "config.batch_size: must be an int, got '64'"),
    ("dataset.flip", 1, "config.dataset.flip: must be True or False"),
])
def test_wrong_type_names_field(field, value, expected):
  config = tiny_config()
  # ConfigDict is type-safe (tiny_config's overrides keep each field's type): a value of
  # the wrong type, as a hand-edited config could hold, must replace the field.
  *parents, leaf = field.split(".")
  node = config
  for parent in parents:
    node = node[parent]
  del node[leaf]
  node[leaf] = value
  with pytest.raises(config_validation.ConfigError) as info:
    config_validation.validate(config)
  assert expected in str(info.value)


def test_selected_epochs_need_epochs_after_the_warm_up():
  config = tiny_config(**{"selection.method": "top_k"})  # configs/test.py: 2 epochs, warm-up 2.
  with pytest.raises(config_validation.ConfigError, match=r"selection.warmup_epochs=2 leaves no "
                                                          r"epoch of the 2"):
    config_validation.validate(config)
  config_validation.validate(tiny_config(**{"selection.method": "top_k",
                                            "selection.warmup_epochs": 1}))
  config_validation.validate(tiny_config(**{"selection.method": "full"}))  # Never selects.


def test_target_workdir_needs_a_target_scoring(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  base = {"selection.method": "top_k", "selection.warmup_epochs": 1}
  # The old way (a target_workdir with the default train_pass scoring) names the new values.
  with pytest.raises(config_validation.ConfigError) as info:
    config_validation.validate(tiny_config(**base, **{"selection.target_workdir": str(tmp_path)}))
  assert "selection.scoring='target'" in str(info.value)
  assert "'target_recorded'" in str(info.value)
  with pytest.raises(config_validation.ConfigError, match="needs config.selection.target_workdir"):
    config_validation.validate(tiny_config(**base, **{"selection.scoring": "target"}))
  config_validation.validate(tiny_config(**base, **{"selection.scoring": "target",
                                                    "selection.target_workdir": str(tmp_path)}))


def test_reducible_loss_needs_a_target_run_and_the_current_models_losses(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  base = {"selection.method": "top_k", "selection.warmup_epochs": 1,
          "selection.score": "reducible_loss"}
  target = {"selection.target_workdir": str(tmp_path)}
  with pytest.raises(config_validation.ConfigError,
                     match="config.selection.score='reducible_loss' needs "
                           "config.selection.target_workdir"):
    config_validation.validate(tiny_config(**base))
  for scoring in ("target", "target_recorded"):
    with pytest.raises(config_validation.ConfigError) as info:
      config_validation.validate(tiny_config(**base, **target, **{"selection.scoring": scoring}))
    assert (f"config.selection.scoring={scoring!r} does not work with "
            "selection.score='reducible_loss'") in str(info.value)
    assert "valid: 'train_pass', 'fresh'" in str(info.value)
  with pytest.raises(config_validation.ConfigError, match="has no checkpoints/ folder"):
    config_validation.validate(tiny_config(**base, **{"selection.target_workdir":
                                                      str(tmp_path / "none")}))
  for scoring in ("train_pass", "fresh"):  # The target_workdir is RHO-LOSS's, not a scoring.
    config_validation.validate(tiny_config(**base, **target, **{"selection.scoring": scoring}))


def test_reducible_loss_is_not_for_infobatch(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(config_validation.ConfigError) as info:
    config_validation.validate(tiny_config(**{
        "num_epochs": 4, "selection.method": "infobatch", "selection.warmup_epochs": 1,
        "selection.score": "reducible_loss", "selection.target_workdir": str(tmp_path)}))
  assert ("config.selection.score='reducible_loss' does not work with "
          "selection.method='infobatch'") in str(info.value)
  assert "valid: 'loss'" in str(info.value)


@pytest.mark.parametrize("overrides", [{"budget_steps": 30},
                                       {"optimizer.schedule_unit": "step"}])
def test_infobatch_has_no_step_budget_or_step_schedule(overrides):
  with pytest.raises(config_validation.ConfigError) as info:
    config_validation.validate(tiny_config(**{
        "num_epochs": 4, "selection.method": "infobatch", "selection.warmup_epochs": 1,
        **overrides}))
  assert "need epochs of known size; selection.method='infobatch'" in str(info.value)


def test_renamed_field_points_at_its_replacement():
  config = tiny_config()
  config.unlock()
  config.selection.target_per_epoch = True  # Removed: now selection.scoring='target_recorded'.
  with pytest.raises(config_validation.ConfigError, match="target_recorded"):
    config_validation.validate(config)


def test_unknown_and_missing_fields_are_reported():
  config = tiny_config()
  config.unlock()
  config.optimizer.lr = 0.1  # A typo of learning_rate.
  del config.loss["reduction"]
  with pytest.raises(config_validation.ConfigError) as info:
    config_validation.validate(config)
  message = str(info.value)
  assert "config.optimizer.lr: unknown field" in message
  assert "optimizer.learning_rate" in message  # The known fields are listed.
  assert "config.loss.reduction: missing" in message


def test_every_problem_is_reported_at_once():
  config = tiny_config(**{"model.name": "nope", "num_epochs": -1})
  with pytest.raises(config_validation.ConfigError) as info:
    config_validation.validate(config)
  assert "config.model.name" in str(info.value) and "config.num_epochs" in str(info.value)


def test_validation_fails_before_data_load(tmp_path, monkeypatch):
  def no_data(*args, **kwargs):
    pytest.fail(f"get_datasets{args, kwargs} was called before the config was validated")
  monkeypatch.setattr(input_pipeline, "get_datasets", no_data)
  # A dataset that cannot load (not prepared, no download) AND a bad model name: the
  # config error must come first, before any data is read, and leave no files behind.
  config = tiny_config(**{"dataset.name": "cifar10", "dataset.data_dir": str(tmp_path / "none"),
                          "model.name": "nope"})
  with pytest.raises(config_validation.ConfigError, match="model.name"):
    train.train_and_evaluate(config, str(tmp_path / "workdir"))
  assert not (tmp_path / "workdir").exists()
  assert not (tmp_path / "none").exists()


def test_sizes_that_train_padded_steps_are_warned_about():
  # configs/test.py: 1,257 training digits. A batch of 2,000 is one step of repeated rows;
  # 1 % selected is k = round(12.57) = 13 rows, below a batch of 64.
  assert config_validation.size_warnings(tiny_config()) == []
  big_batch = config_validation.size_warnings(tiny_config(batch_size=2000))
  assert big_batch == ["config.batch_size=2000 exceeds the 1257 training examples: each epoch "
                       "is one step whose batch repeats examples"]
  small_subset = config_validation.size_warnings(tiny_config(
      **{"selection.method": "top_k", "selection.fraction": 0.01}))
  assert len(small_subset) == 1 and "k=13" in small_subset[0]
  assert "config.batch_size=64" in small_subset[0]
