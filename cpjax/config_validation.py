"""Checks every config field once, at start-up, before any data load or compile.

An unknown field, a missing field, a wrong type or an out-of-range value raises
`ConfigError` naming the field and what would be valid. Choices come from the
registries of the modules that own them (datasets, models, losses).
"""

from collections.abc import Callable, Sequence
import math
import os
from typing import Any

import jax
import ml_collections

Check = Callable[[Any], str | None]  # Returns a problem description, or None.


class ConfigError(ValueError):
  """A config field has a bad value; the message names the field."""


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int | None = None, high: int | None = None) -> Check:
  """An int in [low, high]."""
  def check(value):
    if not _is_int(value):
      return f"must be an int, got {value!r} ({type(value).__name__})"
    if (low is not None and value < low) or (high is not None and value > high):
      return f"must be in [{low}, {high}], got {value}"
    return None
  return check


def number(low: float | None = None, high: float | None = None,
           low_open: bool = False) -> Check:
  """A finite float (ints accepted) in [low, high], or (low, high] if low_open."""
  def check(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return f"must be a number, got {value!r} ({type(value).__name__})"
    if not math.isfinite(value):
      return f"must be finite, got {value}"
    below = low is not None and (value <= low if low_open else value < low)
    if below or (high is not None and value > high):
      return f"must be in {'(' if low_open else '['}{low}, {high}], got {value}"
    return None
  return check


def boolean() -> Check:
  return lambda v: None if isinstance(v, bool) else f"must be True or False, got {v!r}"


def string() -> Check:
  return lambda v: None if isinstance(v, str) else f"must be a string, got {v!r}"


def choice(options: Sequence[str]) -> Check:
  """One of `options`."""
  def check(value):
    if value not in options:
      return f"got {value!r}; valid choices: {', '.join(sorted(options))}"
    return None
  return check


def int_sequence(low: int = 0) -> Check:
  """A tuple/list of ints >= low, in increasing order."""
  def check(value):
    if not isinstance(value, (tuple, list)) or not all(_is_int(v) for v in value):
      return f"must be a tuple of ints, got {value!r}"
    if any(v < low for v in value) or list(value) != sorted(value):
      return f"must be increasing ints >= {low}, got {value!r}"
    return None
  return check


def spine_schema() -> dict[str, Check]:
  """Checks of the trainer's own fields (loss hyper-parameters: cpjax.losses)."""
  # Registries own their names.
  from cpjax import bootstrap, compiler_options, input_pipeline, losses, models, scoring
  from cpjax import selection, temperature
  return {
      "seed": integer(0, 2**31 - 1),
      "dataset.name": choice(list(input_pipeline.DATASETS)),
      "dataset.data_dir": string(),
      "dataset.manual_dir": string(),
      "dataset.download": boolean(),
      "dataset.val_size": integer(1),
      "dataset.split_seed": integer(0, 2**31 - 1),
      "dataset.train_examples": integer(0),
      "dataset.crop_padding": integer(0, 16),
      "dataset.flip": boolean(),
      "model.name": choice(list(models.MODELS)),
      "model.dtype": choice(["float32", "bfloat16"]),
      "loss.name": choice(list(losses.LOSSES)),
      "loss.reduction": choice(["mean", "sum"]),
      "optimizer.learning_rate": number(0.0, 100.0, low_open=True),
      "optimizer.momentum": number(0.0, 1.0),
      "optimizer.nesterov": boolean(),
      "optimizer.weight_decay": number(0.0, 1.0),
      "optimizer.grad_clip_norm": number(0.0),
      "optimizer.schedule": choice(["cosine", "multistep", "constant"]),
      "optimizer.milestones": int_sequence(1),
      "optimizer.decay_factor": number(0.0, 1.0, low_open=True),
      "selection.method": choice(list(selection.METHODS)),
      "selection.score": choice(list(scoring.SCORES)),
      "selection.fraction": number(0.0, 1.0, low_open=True),
      "selection.count": integer(0),
      "selection.warmup_epochs": integer(0),
      "selection.scoring": choice(["train_pass", "fresh"]),
      "selection.rescore_every": integer(0),
      "selection.score_dtype": choice(["float32", "bfloat16"]),
      "selection.score_batch_size": integer(1),
      "selection.target_workdir": string(),
      "selection.target_per_epoch": boolean(),
      "selection.record_scores": boolean(),
      "evaluation.num_bins": integer(1, 1000),
      "evaluation.temperature_method": choice(list(temperature.METHODS)),
      "evaluation.bootstrap_resamples": integer(1),
      "evaluation.bootstrap_level": number(0.0, 1.0, low_open=True),
      "evaluation.bootstrap_kind": choice(list(bootstrap.KINDS)),
      "evaluation.bootstrap_seed": integer(0, 2**31 - 1),
      "evaluation.ood": choice(["", "gaussian_noise", *input_pipeline.DATASETS]),
      "evaluation.ood_severity": integer(1, 5),
      "num_epochs": integer(1),
      "batch_size": integer(1),
      "eval_batch_size": integer(1),
      "eval_every_epochs": integer(1),
      "checkpoint_every_epochs": integer(1),
      "keep_checkpoints": integer(1),
      "log_every_steps": integer(1),
      "xla_cpu_options": choice(compiler_options.PRESETS),
  }


def _leaves(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(_leaves(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def validate(config: ml_collections.ConfigDict) -> None:
  """Validates `config` as a whole; raises ConfigError listing every problem.

  Args:
    config: the full run configuration.

  Raises:
    ConfigError: one line per bad, unknown or missing field.
  """
  from cpjax import input_pipeline, losses

  schema = spine_schema()
  schema.update(losses.loss_schema())
  leaves = _leaves(config)
  problems = [f"config.{name}: unknown field; known fields: "
              f"{', '.join(sorted(schema))}" for name in leaves if name not in schema]
  problems += [f"config.{name}: missing (every config needs it; see configs/default.py)"
               for name in schema if name not in leaves]
  for name, check in schema.items():
    if name in leaves and (problem := check(leaves[name])):
      problems.append(f"config.{name}: {problem}")
  if not problems:
    problems = _cross_field_problems(config, input_pipeline, losses)
  if problems:
    raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def _cross_field_problems(config, input_pipeline, losses) -> list[str]:
  """Constraints that involve several fields or the runtime (device count)."""
  problems = losses.cross_field_problems(config)
  devices = jax.device_count()
  leaves = _leaves(config)
  for name in ("batch_size", "eval_batch_size", "selection.score_batch_size"):
    if (value := leaves[name]) % devices:
      problems.append(f"config.{name}={value} must be divisible by the "
                      f"device count {devices} (every device gets an equal share)")
  num_train = input_pipeline.DATASETS[config.dataset.name].num_train
  if config.dataset.val_size >= num_train:
    problems.append(f"config.dataset.val_size={config.dataset.val_size} must be "
                    f"below the train split size {num_train} of {config.dataset.name}")
  if config.evaluation.bootstrap_level >= 1.0:
    problems.append(f"config.evaluation.bootstrap_level={config.evaluation.bootstrap_level} "
                    "must be below 1 (e.g. 0.9 for a 90 % interval)")
  num_rows = num_train - config.dataset.val_size
  if config.dataset.train_examples > num_rows:
    problems.append(f"config.dataset.train_examples={config.dataset.train_examples} exceeds "
                    f"the {num_rows} training examples left after validation")
  num_rows = min(config.dataset.train_examples or num_rows, num_rows)
  if config.selection.count > num_rows:
    problems.append(f"config.selection.count={config.selection.count} exceeds the "
                    f"{num_rows} training examples")
  target = config.selection.target_workdir
  if config.selection.target_per_epoch and not target:
    problems.append("config.selection.target_per_epoch=True needs "
                    "config.selection.target_workdir")
  if target and config.selection.method not in ("top_k", "uniform_sorted"):
    problems.append(f"config.selection.target_workdir is set but selection.method="
                    f"{config.selection.method!r} uses no scores; use top_k or uniform_sorted")
  if target and not os.path.isdir(os.path.join(target, "checkpoints")):
    problems.append(f"config.selection.target_workdir={target!r} has no checkpoints/ folder "
                    "(it must be the --workdir of a finished cpjax run)")
  ood = config.evaluation.ood
  if ood in input_pipeline.DATASETS and (
      ood == config.dataset.name or input_pipeline.DATASETS[ood].image_shape
      != input_pipeline.DATASETS[config.dataset.name].image_shape):
    problems.append(f"config.evaluation.ood={ood!r} must be another dataset with the image "
                    f"shape of {config.dataset.name!r}, gaussian_noise, or '' (none)")
  return problems
