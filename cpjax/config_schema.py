"""Every config field and its check: the schema that `config_validation.validate` applies.

Each check returns a problem description or None; choices come from the registries of the
modules that own them (datasets, models, losses, policies), so a new registry entry is a
valid choice without an edit here. Unknown fields get the closest known names, and renamed
ones a pointer to their replacement.
"""

from collections.abc import Callable, Sequence
import difflib
import math
from typing import Any

import ml_collections

from cpjax import models
from cpjax.calibration import bootstrap, losses, posthoc, temperature
from cpjax.data import preprocess, readers, specs, splits
from cpjax.data import sources as data_sources
from cpjax.runtime import compiler_options
from cpjax.selection import policies, scores, sources

Check = Callable[[Any], str | None]  # Returns a problem description, or None.


def is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int | None = None, high: int | None = None) -> Check:
  """An int in [low, high]."""
  def check(value):
    if not is_int(value):
      return f"must be an int, got {value!r} ({type(value).__name__})"
    if (low is not None and value < low) or (high is not None and value > high):
      return f"must be in [{low}, {high}], got {value}"
    return None
  return check


def number(low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> Check:
  """A finite float (ints accepted) in [low, high]; low_open/high_open exclude the ends."""
  def check(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return f"must be a number, got {value!r} ({type(value).__name__})"
    if not math.isfinite(value):
      return f"must be finite, got {value}"
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
      return (f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}, "
              f"got {value}")
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
    if not isinstance(value, (tuple, list)) or not all(is_int(v) for v in value):
      return f"must be a tuple of ints, got {value!r}"
    if any(v < low for v in value) or list(value) != sorted(value):
      return f"must be increasing ints >= {low}, got {value!r}"
    return None
  return check


# Fields that were replaced: an old config or override gets a pointer to the new one.
RENAMED_FIELDS = {
    "selection.target_per_epoch": "selection.scoring='target_recorded' (with "
                                  "selection.target_workdir)",
}


def spine_schema() -> dict[str, Check]:
  """Checks of every field; the registries of the modules that own them give the choices."""
  return {
      "seed": integer(0, 2**31 - 1),
      "dataset.name": data_sources.name_problem,
      "dataset.data_dir": string(),
      "dataset.manual_dir": string(),
      "dataset.download": boolean(),
      "dataset.val_size": integer(1),
      "dataset.split_seed": integer(0, 2**31 - 1),
      "dataset.train_examples": integer(0),
      "dataset.meta_val_size": integer(0),
      "dataset.label_noise": number(0.0, 1.0, high_open=True),
      "dataset.label_noise_seed": integer(0, 2**31 - 1),
      "dataset.holdout_fraction": number(0.0, 1.0, high_open=True),
      "dataset.train_part": choice(list(splits.TRAIN_PARTS)),
      "dataset.reader": choice(list(readers.READERS)),
      "dataset.device_memory_mb": number(0.0),
      "dataset.host_memory_mb": number(0.0),
      "dataset.stream_dir": string(),
      "dataset.prefetch_depth": integer(0, 64),
      "dataset.crop_padding": integer(0, 16),
      "dataset.flip": boolean(),
      "dataset.folder": string(),
      "dataset.test_size": integer(0),
      "dataset.image_size": integer(0, 4096),
      "dataset.channels": lambda v: None if is_int(v) and v in (0, 1, 3) else (
          f"must be 0 (the dataset's own), 1 or 3, got {v!r}"),
      "dataset.train_crop": choice(list(preprocess.TRAIN_CROPS)),
      "dataset.crop_scale": lambda v: data_sources.floats_problem(v, 2, 1e-6, 1.0, True),
      "dataset.crop_ratio": lambda v: data_sources.floats_problem(v, 2, 1e-3, 1e3, True),
      "dataset.eval_crop_fraction": number(0.0, 1.0, low_open=True),
      "dataset.mean": lambda v: data_sources.floats_problem(v, None, 0.0, 1.0),
      "dataset.std": lambda v: data_sources.floats_problem(v, None, 1e-6, 1.0),
      "dataset.check_files": integer(0),
      "dataset.skip_bad_files": boolean(),
      "dataset.num_workers": integer(0, 256),
      "model.name": models.name_problem,
      "model.dtype": choice(["float32", "bfloat16"]),
      "loss.name": choice(list(losses.LOSSES)),
      "loss.reduction": choice(["mean", "sum"]),
      "optimizer.learning_rate": number(0.0, 100.0, low_open=True),
      "optimizer.momentum": number(0.0, 1.0),
      "optimizer.nesterov": boolean(),
      "optimizer.weight_decay": number(0.0, 1.0),
      "optimizer.grad_clip_norm": number(0.0),
      "optimizer.schedule": choice(["cosine", "multistep", "constant"]),
      "optimizer.schedule_unit": choice(["epoch", "step"]),
      "optimizer.warmup_epochs": number(0.0),
      "optimizer.milestones": int_sequence(1),
      "optimizer.decay_factor": number(0.0, 1.0, low_open=True),
      "selection.method": choice(list(policies.METHODS)),
      "selection.direction": choice(list(policies.DIRECTIONS)),
      "selection.random_share": number(0.0, 1.0),
      "selection.temperature": number(0.0),
      "selection.stratify_drop": number(0.0, 1.0, high_open=True),
      "selection.num_strata": integer(1),
      "selection.prune_ratio": number(0.0, 1.0, high_open=True),
      "selection.anneal_fraction": number(0.0, 1.0, high_open=True),
      "selection.score": choice(list(scores.NAMES)),
      "selection.fraction": number(0.0, 1.0, low_open=True),
      "selection.count": integer(0),
      "selection.warmup_epochs": integer(0),
      "selection.final_full_epochs": integer(0),
      "selection.fraction_end": number(-1.0, 1.0),
      "selection.scoring": choice(list(sources.SOURCES)),
      "selection.rescore_every": integer(0),
      "selection.score_dtype": choice(["float32", "bfloat16"]),
      "selection.score_batch_size": integer(1),
      "selection.target_workdir": string(),
      "selection.record_scores": boolean(),
      "evaluation.num_bins": integer(1, 1000),
      "evaluation.temperature_method": choice(list(temperature.METHODS)),
      "evaluation.bootstrap_resamples": integer(1),
      "evaluation.bootstrap_level": number(0.0, 1.0, low_open=True),
      "evaluation.bootstrap_kind": choice(list(bootstrap.KINDS)),
      "evaluation.bootstrap_seed": integer(0, 2**31 - 1),
      "evaluation.calibrator": choice(["auto", *posthoc.MAPS]),  # The registry of maps.
      "evaluation.calibrator_folds": integer(2),
      "evaluation.calibrator_resamples": integer(0),
      "evaluation.ood": choice(["", "gaussian_noise", *specs.DATASETS]),
      "evaluation.ood_severity": integer(1, 5),
      "num_epochs": integer(1),
      "budget_steps": integer(0),
      "meta.learning_rate": number(0.0, 10.0, low_open=True),
      "meta.ce_weight": number(0.0),
      "meta.num_prototypes": integer(0),
      "meta.temperature": number(0.0, low_open=True),
      "meta.max_gamma": number(0.0),
      "meta.leak_meta_gradient": boolean(),
      "batch_size": integer(1),
      "eval_batch_size": integer(1),
      "eval_every_epochs": integer(1),
      "checkpoint_every_epochs": integer(1),
      "keep_checkpoints": integer(1),
      "log_every_steps": integer(1),
      "xla_cpu_options": choice(compiler_options.PRESETS),
      "compilation_cache_dir": string(),
      "compilation_cache_min_seconds": number(0.0),
      "step_transfer_guard": choice(["allow", "log", "disallow", "log_explicit",
                                     "disallow_explicit"]),
      **_loss_schema(),
  }


def _loss_schema() -> dict[str, Check]:
  """Checks of the loss hyper-parameter fields (`loss.*`)."""
  return {
      "loss.label_smoothing": number(0.0, 1.0),
      "loss.ls_convention": choice(["uniform", "off_target"]),
      "loss.focal_gamma": number(0.0, 20.0),
      "loss.gamma_boundaries": int_sequence(1),
      "loss.mmce_lambda": number(0.0),
      "loss.mmce_form": choice(["code", "nominal"]),
      "loss.mmce_kernel_width": number(0.0, low_open=True),
      "loss.mbls_margin": number(0.0),
      "loss.mbls_lambda": number(0.0),
      "loss.ecp_alpha": number(0.0),
      "loss.surrogate_lambda": number(0.0),
      "loss.dece_bins": integer(1, 1000),
      "loss.dece_t_a": number(0.0, low_open=True),
      "loss.dece_t_b": number(0.0, low_open=True),
      "loss.sece_bandwidth": number(0.0, low_open=True),
      "loss.mixup_alpha": number(0.0),
  }


def leaves(config: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in config.items():
    if isinstance(value, ml_collections.ConfigDict):
      out.update(leaves(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def unknown_field(name: str, schema: dict[str, Check]) -> str:
  if name in RENAMED_FIELDS:
    return f"config.{name}: no longer exists; use {RENAMED_FIELDS[name]}"
  close = difflib.get_close_matches(name, list(schema), n=3)
  hint = f"did you mean {' or '.join(close)}? " if close else ""
  return f"config.{name}: unknown field; {hint}known fields: {', '.join(sorted(schema))}"


def has_field(config: ml_collections.ConfigDict, name: str) -> bool:
  """Whether dotted `name` (e.g. "loss.name") is a field of `config`."""
  return name in leaves(config) or any(k.startswith(name + ".") for k in leaves(config))


def unknown_field_message(config: ml_collections.ConfigDict, name: str) -> str:
  """The error for an override of a field `config` does not have (valid fields listed)."""
  del config  # Every valid config has exactly the schema's fields.
  return unknown_field(name, spine_schema())
