"""Every config field and its check: the schema that `config_validation.validate` applies.

Each check returns a problem description or None; choices come from the registries of the
modules that own them (datasets, models, losses, policies, scores), and the settings of
losses, policies, selection scores and conformal scores (`loss.*`, `selection.*`,
`evaluation.conformal_*`) are declared beside their entries
(cpjax/registry.py), so a new registry entry and its settings need no edit here. Unknown
fields get the closest known names, and renamed ones a pointer to their replacement.
"""

import difflib
import importlib
import re
from typing import Any

import ml_collections

from cpjax import models, registry
from cpjax.calibration import bootstrap, conformal, losses, posthoc, temperature
from cpjax.data import decode_workers, input_pipeline, preprocess, sources, specs, splits
from cpjax.data.device_stage import decoders
from cpjax.runtime import compiler_options
from cpjax.selection import policies, score_sources, scores

# The checks' builders live with the registries (an entry's settings use them too).
Check = registry.Check
is_int, integer, number = registry.is_int, registry.integer, registry.number
boolean, string, choice, int_sequence = (registry.boolean, registry.string, registry.choice,
                                         registry.int_sequence)


# Fields that were replaced: an old config or override gets a pointer to the new one.
RENAMED_FIELDS = {
    "selection.target_per_epoch": "selection.scoring='target_recorded' (with "
                                  "selection.target_workdir)",
}


_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def module_names(value: str) -> list[str]:
  """The module names of `config.import_modules` (comma-separated; blanks ignored)."""
  return [name.strip() for name in value.split(",") if name.strip()]


def import_problem(value: Any) -> str | None:
  """`config.import_modules`'s check, which imports each module (once: Python keeps it): a
  user's module registers its entries when it is imported. The first module that is no
  module name or cannot be imported is named, with its error."""
  if not isinstance(value, str):
    return f"must be a string of comma-separated module names, got {value!r}"
  for name in module_names(value):
    if not _MODULE_NAME.match(name):
      return f"{name!r} is not a module name (package.module; names separated by commas)"
    try:
      importlib.import_module(name)
    except Exception as err:  # pylint: disable=broad-except  Any error of the user's code.
      return (f"cannot import module {name!r} ({type(err).__name__}: {err}); is it installed "
              "or on PYTHONPATH?")
  return None


def spine_schema() -> dict[str, Check]:
  """Checks of every field; the registries of the modules that own them give the choices."""
  return {
      "seed": integer(0, 2**31 - 1),
      "import_modules": import_problem,
      "dataset.name": sources.name_problem,
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
      "dataset.reader": choice(input_pipeline.READER_CHOICES),
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
      "dataset.train_crop": preprocess.TRAIN_CROPS.check(),
      "dataset.crop_scale": registry.floats(2, 1e-6, 1.0, True),
      "dataset.crop_ratio": registry.floats(2, 1e-3, 1e3, True),
      "dataset.eval_crop_fraction": number(0.0, 1.0, low_open=True),
      "dataset.resize": choice(list(preprocess.RESIZE_ENGINES)),
      "dataset.mean": registry.floats(None, 0.0, 1.0),
      "dataset.std": registry.floats(None, 1e-6, 1.0),
      "dataset.check_files": integer(0),
      "dataset.skip_bad_files": boolean(),
      "dataset.num_workers": integer(0, 256),
      "dataset.worker_kind": choice(list(decode_workers.WORKER_KINDS)),
      "dataset.decode": choice(decoders.decode_choices),
      "model.name": models.name_problem,
      "model.dtype": choice(["float32", "bfloat16"]),
      "loss.name": losses.LOSSES.check(),
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
      "selection.method": policies.POLICIES.check(),
      "selection.direction": choice(list(policies.DIRECTIONS)),
      "selection.score": scores.SCORES.check(),
      "selection.fraction": number(0.0, 1.0, low_open=True),
      "selection.count": integer(0),
      "selection.warmup_epochs": integer(0),
      "selection.final_full_epochs": integer(0),
      "selection.fraction_end": number(-1.0, 1.0),
      "selection.budget": number(),  # Its range is the schedule's (config.validation).
      "selection.scoring": score_sources.SOURCES.check(),
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
      "evaluation.calibrator": choice(lambda: ["auto", *posthoc.MAPS]),  # When it runs.
      "evaluation.calibrator_folds": integer(2),
      "evaluation.calibrator_resamples": integer(0),
      "evaluation.calibrator_square_max_classes": integer(0),
      "evaluation.ood": choice(["", "gaussian_noise", *specs.DATASETS]),
      "evaluation.ood_severity": integer(1, 5),
      "evaluation.conformal_scores": conformal.names_problem,
      "evaluation.conformal_alpha": conformal.alphas_problem,
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
      "loss.mixup_alpha": number(0.0),
      **losses.LOSSES.checks(),
      **policies.POLICIES.checks(),
      **scores.SCORES.checks(),
      **conformal.SCORES.checks(),
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
