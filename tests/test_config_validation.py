"""Config validation: bad values are named with the valid choices, before any work."""

import os
import subprocess

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
from cpjax.config import implied, validation
from cpjax.data import input_pipeline
from cpjax.training import train
from tests.helpers import REPO, main_command, subprocess_env, tiny_config


@pytest.mark.parametrize("module", [default, cifar10, cifar100, cifar10_target, cifar100_target,
                                    fashion_mnist, fashion_mnist_selection, fashion_mnist_study])
def test_shipped_configs_are_valid(module):
  validation.validate(module.get_config())


@pytest.mark.parametrize("field, value, expected", [
    ("model.name", "resnet19", "valid choices: resnet110, resnet18"),
    ("dataset.name", "imagenet", "valid choices: cifar10, cifar100, digits"),
    ("loss.name", "focal_typo", "config.loss.name: got 'focal_typo'"),
    ("loss.reduction", "median", "valid choices: mean, sum"),
    ("optimizer.schedule", "linear", "valid choices: constant, cosine, multistep"),
    ("optimizer.schedule_unit", "batch", "valid choices: epoch, step"),
    ("budget_steps", -1, "config.budget_steps: must be at least 0, got -1"),
    ("optimizer.learning_rate", 0.0, "config.optimizer.learning_rate: must be in (0.0"),
    ("optimizer.learning_rate", float("nan"), "must be finite"),
    ("optimizer.momentum", 1.5, "config.optimizer.momentum: must be in [0.0, 1.0], got 1.5"),
    ("num_epochs", 0, "config.num_epochs: must be at least 1, got 0"),
    ("optimizer.milestones", (250, 150), "must be increasing ints"),
    ("dataset.val_size", 5000,
     "config.dataset.val_size=5000 must be below the train split size 1437"),
    ("batch_size", 60, "config.batch_size=60 must be divisible by the device count 8"),
    ("evaluation.temperature_method", "platt", "valid choices: grid_ece, grid_nll, lbfgs_nll"),
    ("evaluation.bootstrap_kind", "bca", "valid choices: basic, percentile"),
    ("evaluation.calibrator", "platt", "valid choices: auto, dirichlet, ensemble_temperature"),
    ("evaluation.calibrator_folds", 1, "config.evaluation.calibrator_folds: must be at least 2"),
    ("evaluation.calibrator_folds", 500,
     "calibrator_folds=500 exceeds config.dataset.val_size=180"),
    ("evaluation.bootstrap_level", 1.0, "bootstrap_level=1.0 must be below 1"),
    ("evaluation.ood", "svhn", "config.evaluation.ood='svhn' must be another dataset with the "
                               "image shape of 'digits'"),
    ("evaluation.ood", "noise", "valid choices: , cifar10"),
    ("evaluation.ood_severity", 6, "config.evaluation.ood_severity: must be in [1, 5], got 6"),
    ("xla_cpu_options", "fast", "valid choices: tuned, xla_default"),
    ("dataset.resize", "cv2", "config.dataset.resize: got 'cv2'"),
    ("dataset.resize", "bicubic", "valid choices: opencv, pil"),
    ("evaluation.conformal_alpha", 0.0,
     "config.evaluation.conformal_alpha: must be a number in (0, 1), got 0.0"),
    ("evaluation.conformal_alpha", (0.1, 1.0),
     "config.evaluation.conformal_alpha: must be a number in (0, 1), got 1.0"),
    # configs/test.py carves 180 validation rows: k = ceil(181 * 0.999) = 181 > 180.
    ("evaluation.conformal_alpha", 0.001,
     "config.evaluation.conformal_alpha=0.001 needs the k-th smallest of the n = 180 validation "
     "scores (dataset.val_size), k = ceil((n + 1)(1 - alpha)) = 181 > n: the smallest "
     "reachable alpha is 1/(n + 1) = 1/181 (0.005525, rounded up); raise alpha or "
     "dataset.val_size"),
    ("evaluation.conformal_alpha", (0.1, 0.0055),
     "config.evaluation.conformal_alpha=0.0055 needs the k-th smallest"),
    ("evaluation.conformal_scores", ("lac", "apss"),
     "config.evaluation.conformal_scores: got 'apss'; did you mean aps or raps? valid choices: "
     "aps, lac, raps"),
    ("evaluation.conformal_raps_k_reg", -1,
     "config.evaluation.conformal_raps_k_reg: must be at least 0, got -1"),
    ("evaluation.conformal_raps_lambda", -0.5,
     "config.evaluation.conformal_raps_lambda: must be at least 0.0, got -0.5"),
])
def test_bad_value_names_field_and_choices(field, value, expected):
  with pytest.raises(validation.ConfigError) as info:
    validation.validate(tiny_config(**{field: value}))
  assert expected in str(info.value)


def test_conformal_alphas_the_validation_rows_reach_are_valid():
  """1/(n + 1) = 1/181 is the smallest alpha of 180 validation rows (k = 180 = n); a tuple or
  list of alphas is checked one by one; with no conformal score, alpha is not used."""
  for alpha in (0.00553, (0.05, 0.1), [0.2, 0.00553]):
    validation.validate(tiny_config(**{"evaluation.conformal_alpha": alpha}))
  validation.validate(tiny_config(**{"evaluation.conformal_alpha": 0.001,
                                            "evaluation.conformal_scores": ()}))


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
  with pytest.raises(validation.ConfigError) as info:
    validation.validate(config)
  assert expected in str(info.value)


def test_selected_epochs_need_epochs_after_the_warm_up():
  config = tiny_config(**{"selection.method": "top_k"})  # configs/test.py: 2 epochs, warm-up 2.
  with pytest.raises(validation.ConfigError, match=r"selection.warmup_epochs=2 leaves no "
                                                          r"epoch of the 2"):
    validation.validate(config)
  validation.validate(tiny_config(**{"selection.method": "top_k",
                                            "selection.warmup_epochs": 1}))
  validation.validate(tiny_config(**{"selection.method": "full"}))  # Never selects.


def test_target_workdir_needs_a_target_scoring(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  base = {"selection.method": "top_k", "selection.warmup_epochs": 1}
  # The old way (a target_workdir with the default train_pass scoring) names the new values.
  with pytest.raises(validation.ConfigError) as info:
    validation.validate(tiny_config(**base, **{"selection.target_workdir": str(tmp_path)}))
  assert "selection.scoring='target'" in str(info.value)
  assert "'target_recorded'" in str(info.value)
  with pytest.raises(validation.ConfigError, match="needs config.selection.target_workdir"):
    validation.validate(tiny_config(**base, **{"selection.scoring": "target"}))
  validation.validate(tiny_config(**base, **{"selection.scoring": "target",
                                                    "selection.target_workdir": str(tmp_path)}))


def test_reducible_loss_needs_a_target_run_and_the_current_models_losses(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  base = {"selection.method": "top_k", "selection.warmup_epochs": 1,
          "selection.score": "reducible_loss"}
  target = {"selection.target_workdir": str(tmp_path)}
  with pytest.raises(validation.ConfigError,
                     match="config.selection.score='reducible_loss' needs "
                           "config.selection.target_workdir"):
    validation.validate(tiny_config(**base))
  for scoring in ("target", "target_recorded"):
    with pytest.raises(validation.ConfigError) as info:
      validation.validate(tiny_config(**base, **target, **{"selection.scoring": scoring}))
    assert (f"config.selection.scoring={scoring!r} does not work with "
            "selection.score='reducible_loss'") in str(info.value)
    assert "valid: 'train_pass', 'fresh'" in str(info.value)
  with pytest.raises(validation.ConfigError, match="has no checkpoints/ folder"):
    validation.validate(tiny_config(**base, **{"selection.target_workdir":
                                                      str(tmp_path / "none")}))
  for scoring in ("train_pass", "fresh"):  # The target_workdir is RHO-LOSS's, not a scoring.
    validation.validate(tiny_config(**base, **target, **{"selection.scoring": scoring}))


def test_reducible_loss_is_not_for_infobatch(tmp_path):
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(validation.ConfigError) as info:
    validation.validate(tiny_config(**{
        "num_epochs": 4, "selection.method": "infobatch", "selection.warmup_epochs": 1,
        "selection.score": "reducible_loss", "selection.target_workdir": str(tmp_path)}))
  assert ("config.selection.score='reducible_loss' does not work with "
          "method='infobatch'") in str(info.value)
  assert "valid: 'loss'" in str(info.value)


@pytest.mark.parametrize("overrides", [{"budget_steps": 30},
                                       {"optimizer.schedule_unit": "step"}])
def test_infobatch_has_no_step_budget_or_step_schedule(overrides):
  with pytest.raises(validation.ConfigError) as info:
    validation.validate(tiny_config(**{
        "num_epochs": 4, "selection.method": "infobatch", "selection.warmup_epochs": 1,
        **overrides}))
  assert "need epochs of known size; selection.method='infobatch'" in str(info.value)


def test_renamed_field_points_at_its_replacement():
  config = tiny_config()
  config.unlock()
  config.selection.target_per_epoch = True  # Removed: now selection.scoring='target_recorded'.
  with pytest.raises(validation.ConfigError, match="target_recorded"):
    validation.validate(config)


def test_unknown_and_missing_fields_are_reported():
  config = tiny_config()
  config.unlock()
  config.optimizer.lr = 0.1  # A typo of learning_rate.
  del config.loss["reduction"]
  with pytest.raises(validation.ConfigError) as info:
    validation.validate(config)
  message = str(info.value)
  assert "config.optimizer.lr: unknown field" in message
  assert "optimizer.learning_rate" in message  # The known fields are listed.
  assert "config.loss.reduction: missing" in message


def test_every_problem_is_reported_at_once():
  config = tiny_config(**{"model.name": "nope", "num_epochs": -1})
  with pytest.raises(validation.ConfigError) as info:
    validation.validate(config)
  assert "config.model.name" in str(info.value) and "config.num_epochs" in str(info.value)


def test_validation_fails_before_data_load(tmp_path, monkeypatch):
  def no_data(*args, **kwargs):
    pytest.fail(f"get_datasets{args, kwargs} was called before the config was validated")
  monkeypatch.setattr(input_pipeline, "get_datasets", no_data)
  # A dataset that cannot load (not prepared, no download) AND a bad model name: the
  # config error must come first, before any data is read, and leave no files behind.
  config = tiny_config(**{"dataset.name": "cifar10", "dataset.data_dir": str(tmp_path / "none"),
                          "model.name": "nope"})
  with pytest.raises(validation.ConfigError, match="model.name"):
    train.train_and_evaluate(config, str(tmp_path / "workdir"))
  assert not (tmp_path / "workdir").exists()
  assert not (tmp_path / "none").exists()


def test_sizes_that_train_padded_steps_are_warned_about():
  # configs/test.py: 1,257 training digits. A batch of 2,000 is one step of repeated rows;
  # 1 % selected is k = round(12.57) = 13 rows, below a batch of 64.
  assert validation.size_warnings(tiny_config()) == []
  big_batch = validation.size_warnings(tiny_config(batch_size=2000))
  assert big_batch == ["config.batch_size=2000 exceeds the 1257 training examples: each epoch "
                       "is one step whose batch repeats examples"]
  small_subset = validation.size_warnings(tiny_config(
      **{"selection.method": "top_k", "selection.fraction": 0.01}))
  assert len(small_subset) == 1 and "k=13" in small_subset[0]
  assert "config.batch_size=64" in small_subset[0]


# The choices of main.py's command line: what a choice implies, and how a bad config exits.
INFOBATCH = {"num_epochs": 4, "selection.method": "infobatch", "selection.warmup_epochs": 1}


def test_infobatch_alone_implies_its_score_unless_the_user_chose_one():
  config = tiny_config(**INFOBATCH)
  with pytest.raises(validation.ConfigError, match="selection.score='entropy'"):
    validation.validate(config)  # The library itself implies nothing.
  settings = implied.implied_settings(config, explicit=set(INFOBATCH))
  assert {k: v for k, (v, _) in settings.items()} == {"selection.score": "loss"}
  assert "infobatch" in settings["selection.score"][1]  # The reason names the choice.
  completed = implied.with_settings(config, {"selection.score": "loss"})
  validation.validate(completed)
  assert config.selection.score == "entropy"  # with_settings copies.
  # An explicit contradicting score is never overwritten: validate refuses it, naming why.
  explicit = implied.implied_settings(config, {*INFOBATCH, "selection.score"})
  assert explicit == {}
  with pytest.raises(validation.ConfigError,
                     match="config.selection.score='entropy' does not work with "
                           "method='infobatch'.*valid: 'loss'"):
    validation.validate(config)


def test_an_flgamma_loss_implies_a_tenth_of_the_training_rows_for_meta_validation():
  config = tiny_config(**{"loss.name": "flgamma_sece"})
  settings = implied.implied_settings(config, explicit={"loss.name"})
  # digits: 1,437 train-split rows less 180 for validation = 1,257; a tenth is 125 >= 64.
  assert {k: v for k, (v, _) in settings.items()} == {"dataset.meta_val_size": 125}
  validation.validate(implied.with_settings(config, {"dataset.meta_val_size":
                                                                      125}))
  # At least one batch: with a batch of 256, a tenth (125) would be too few.
  big_batch = tiny_config(**{"loss.name": "flgamma_dece", "batch_size": 256})
  assert implied.implied_settings(big_batch, {"loss.name", "batch_size"})[
      "dataset.meta_val_size"][0] == 256
  # The user's explicit 0 is refused with the reason, not replaced.
  assert implied.implied_settings(config, {"loss.name",
                                                     "dataset.meta_val_size"}) == {}
  with pytest.raises(validation.ConfigError, match="meta_val_size=0 must be at least"):
    validation.validate(config)
  assert implied.implied_settings(tiny_config(), explicit=set()) == {}


def test_changed_fields_are_those_a_config_file_sets():
  changed = implied.changed_fields(fashion_mnist.get_config(), default.get_config())
  assert "dataset.name" in changed and "seed" not in changed
  assert implied.changed_fields(default.get_config(), default.get_config()) == set()


def test_a_resume_names_each_changed_field_and_a_recomputed_schedule():
  """The checkpoint's config as train saves it (JSON) against the resumed run's: each changed
  field with both values, sorted by name; a changed length or optimizer setting adds that the
  learning-rate schedule is recomputed; nothing changed, nothing to say."""
  saved = tiny_config().to_json_best_effort(sort_keys=True)  # num_epochs 2, lr 0.05.
  assert implied.resume_changes(saved, tiny_config()) == ""
  longer = tiny_config(**{"num_epochs": 10, "dataset.flip": True})
  assert implied.resume_changes(saved, longer) == (
      "Resuming with a config that differs from the checkpoint's: dataset.flip False -> True; "
      "num_epochs 2 -> 10. The learning-rate schedule is recomputed for the new length "
      "(num_epochs=10): the epochs from here take their rates from it, not from the "
      "checkpoint's schedule.")
  faster = tiny_config(**{"optimizer.learning_rate": 0.1})
  assert implied.resume_changes(saved, faster).endswith(
      "optimizer.learning_rate 0.05 -> 0.1. The learning-rate schedule is recomputed for the "
      "new optimizer settings: the epochs from here take their rates from it, not from the "
      "checkpoint's schedule.")
  seeded = tiny_config(seed=7)
  assert implied.resume_changes(saved, seeded) == (
      "Resuming with a config that differs from the checkpoint's: seed 0 -> 7.")


def _run_main_fast(tmp_path, *flags):
  """main.py on configs/test.py with `flags`, for command lines that stop before training."""
  return subprocess.run(main_command(str(tmp_path / "w"), *flags), cwd=REPO,
                        env=subprocess_env(1), capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # A main.py process.
def test_a_bad_config_prints_its_problem_alone_and_exits_with_a_usage_status(tmp_path):
  # "--config.num_epochs 0" (space, not "="): absl's flag form reaches the config too.
  result = _run_main_fast(tmp_path, "--config.num_epochs", "0")
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert lines == ["FATAL invalid config:", "  config.num_epochs: must be at least 1, got 0"]
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.slow  # A main.py process.
def test_an_unreachable_conformal_alpha_is_one_fatal_line_naming_the_smallest(tmp_path):
  result = _run_main_fast(tmp_path, "--config.evaluation.conformal_alpha=(0.1, 0.002)")
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert lines == [
      "FATAL invalid config:",
      "  config.evaluation.conformal_alpha=0.002 needs the k-th smallest of the n = 180 "
      "validation scores (dataset.val_size), k = ceil((n + 1)(1 - alpha)) = 181 > n: the "
      "smallest reachable alpha is 1/(n + 1) = 1/181 (0.005525, rounded up); raise alpha or "
      "dataset.val_size, or set evaluation.conformal_scores=() for no prediction sets"]


@pytest.mark.slow  # Two main.py processes.
def test_main_logs_the_implied_fields_and_refuses_an_explicit_contradiction(tmp_path):
  # infobatch alone: score=loss is implied (logged); warmup 5 of 2 epochs stops it before work.
  result = _run_main_fast(tmp_path, "--config.selection.method", "infobatch",
                          "--config.selection.warmup_epochs=5")
  assert result.returncode == 2, result.stderr[-2000:]
  assert "Implied config.selection.score='loss': selection.method='infobatch'" in result.stderr
  assert "selection.score" not in result.stderr.split("FATAL", 1)[1]
  assert "config.selection.warmup_epochs=5 leaves no epoch" in result.stderr
  assert "Traceback" not in result.stderr
  result = _run_main_fast(tmp_path, "--config.selection.method=infobatch",
                          "--config.selection.score=entropy", "--config.num_epochs=4",
                          "--config.selection.warmup_epochs=1")
  assert result.returncode == 2, result.stderr[-2000:]
  assert "Implied" not in result.stderr
  assert ("config.selection.score='entropy' does not work with method='infobatch'"
          in result.stderr)


@pytest.mark.parametrize("overrides, expected", [
    ({"selection.method": "infobatch", "selection.score": "loss",
      "selection.final_full_epochs": 1}, "use anneal_fraction"),
    ({"selection.method": "top_k", "selection.warmup_epochs": 1,
      "selection.final_full_epochs": 1}, "leave no epoch of the 2"),
    ({"selection.method": "random_without_replacement", "selection.warmup_epochs": 1,
      "selection.fraction_end": 0.5}, "its subset needs one size"),
    ({"selection.method": "top_k", "selection.warmup_epochs": 1, "selection.count": 10,
      "selection.fraction_end": 0.5}, "needs count=0"),
    ({"selection.method": "top_k", "selection.warmup_epochs": 1,
      "selection.fraction_end": 0.0}, "keeps no example"),
])
def test_budget_schedule_rules_name_the_fields(overrides, expected):
  with pytest.raises(validation.ConfigError, match=expected):
    validation.validate(tiny_config(**overrides))
