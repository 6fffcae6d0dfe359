"""What a config's choices imply, and what changed: the settings a choice needs that the user
left unset, and the fields that differ from a reference.

`implied_settings` lists what a choice needs and the user left unset (main.py applies it,
with `with_settings`, before validating): a policy's declared needs
(`selection.method='infobatch'` implies its score, scoring and direction); an `flgamma_*` loss
implies a meta-validation split; a source dataset (a folder, tfds:NAME) implies no in-memory
OOD set and, for a split it lacks, a validation or test carve-out that fits its size (a tenth
of its training images at most), and no conformal prediction sets where that carve-out is too
small for the default alpha. An explicit setting that contradicts the choice is still
refused by cpjax.config.validation. `budget_settings` derives the kept fraction from
`selection.budget` (cpjax.selection.budgets), after those. `changed_fields` says what a
config file set (against configs/default.py), `user_set` which fields the user set (a
command-line budget outranks a config file's fraction), `resume_changes` what a resumed run
changes from its checkpoint's config.
"""

from collections.abc import Collection
import copy
import json
from typing import Any

import ml_collections

from cpjax.calibration import conformal, losses
from cpjax.config import schema, validation
from cpjax.data import sources, specs
from cpjax.selection import budgets, policies


def default_meta_val_size(dataset: ml_collections.ConfigDict, batch_size: int) -> int:
  """The meta-validation split an flgamma_* loss gets when `dataset.meta_val_size` is unset:
  10 % of the training examples left after validation, at least one batch (each step draws
  a full batch of distinct meta-validation examples)."""
  num_rows = specs.DATASETS[dataset.name].num_train - dataset.val_size
  return max(batch_size, num_rows // 10)


def changed_fields(config: ml_collections.ConfigDict,
                   reference: ml_collections.ConfigDict) -> set[str]:
  """Dotted names of the fields of `config` whose value differs from (or is absent in)
  `reference`: what a config file set, compared with configs/default.py."""
  reference_leaves = schema.leaves(reference)
  return {name for name, value in schema.leaves(config).items()
          if name not in reference_leaves or reference_leaves[name] != value}


# Fields that set the run's length: the learning-rate schedule is a function of it.
_LENGTH_FIELDS = ("num_epochs", "budget_steps")


def resume_changes(saved_json: str, config: ml_collections.ConfigDict) -> str:
  """What a resumed run changes from its checkpoint's config, as one warning ("" if
  nothing): each changed field with both values, and, where the run's length or the
  optimizer changed, that the learning-rate schedule is recomputed from them.

  Args:
    saved_json: the checkpoint's config (`to_json_best_effort(sort_keys=True)`).
    config: this run's config.
  """
  def flat(text: str) -> dict[str, Any]:
    return schema.leaves(ml_collections.ConfigDict(json.loads(text)))
  saved, now = flat(saved_json), flat(config.to_json_best_effort(sort_keys=True))
  names = sorted(n for n in set(saved) | set(now) if saved.get(n, _ABSENT) != now.get(n, _ABSENT))
  if not names:
    return ""
  shown = "; ".join(f"{n} {saved.get(n, _ABSENT)!r} -> {now.get(n, _ABSENT)!r}" for n in names)
  line = f"Resuming with a config that differs from the checkpoint's: {shown}."
  length = [f"{n}={now[n]!r}" for n in _LENGTH_FIELDS if n in names and n in now]
  if length or any(n.startswith("optimizer.") for n in names):
    what = f"length ({', '.join(length)})" if length else "optimizer settings"
    line += (f" The learning-rate schedule is recomputed for the new {what}: the epochs from "
             "here take their rates from it, not from the checkpoint's schedule.")
  return line


class _Absent:
  def __repr__(self) -> str:
    return "(absent)"


_ABSENT = _Absent()


def implied_settings(config: ml_collections.ConfigDict,
                     explicit: Collection[str]) -> dict[str, tuple[Any, str]]:
  """The fields that the config's choices need and the user did not set.

  Args:
    config: the run configuration, before validation.
    explicit: dotted names of the fields the user set (command-line overrides, and the
      fields a config file changed); these are never implied, so a contradicting one is
      refused by `validate` with its reason.

  Returns:
    {dotted field: (value to set, the choice that implies it)}; empty when nothing is implied.
  """
  implied = {}
  method = config.selection.method
  policy = policies.POLICIES[method] if method in policies.POLICIES else None
  for field, needed in policy.needs.items() if policy else ():
    name = f"selection.{field}"
    if name not in explicit and config.selection[field] != needed:
      implied[name] = (needed, f"selection.method={method!r} {policy.needs_reason}")
  name = "dataset.meta_val_size"
  if (config.loss.name in losses.LOSSES and losses.LOSSES[config.loss.name].meta_objective
      and name not in explicit and not config.dataset.meta_val_size
      and config.dataset.name in specs.DATASETS  # Bad values: left to `validate` to name.
      and schema.is_int(config.dataset.val_size)
      and schema.is_int(config.batch_size)):
    implied[name] = (default_meta_val_size(config.dataset, config.batch_size),
                     f"loss.name={config.loss.name!r} trains gamma-Net on held-out "
                     "meta-validation batches (10 % of the training examples)")
  return {**_source_settings(config, explicit), **implied}


def _source_settings(config: ml_collections.ConfigDict,
                     explicit: Collection[str]) -> dict[str, tuple[Any, str]]:
  """What a source dataset (a folder, tfds:NAME) needs of the defaults made for the built-in
  ones: no in-memory OOD set (its test images are read per batch), and, for a split it lacks,
  a carve-out that fits its training images (a tenth of them, at most the default; validation
  at least calibrator_folds images). Nothing for a dataset that cannot be read yet (`validate`
  names why)."""
  dataset = config.dataset
  if (not sources.is_source_name(dataset.name) or validation.field_problems(config)
      or validation.source_problems(dataset)):
    return {}
  spec, implied = specs.DATASETS[dataset.name], {}
  what = f"dataset.name={dataset.name!r}"
  if config.evaluation.ood == "gaussian_noise" and "evaluation.ood" not in explicit:
    implied["evaluation.ood"] = ("", f"{what} reads its test images per batch; the "
                                 "gaussian_noise OOD set corrupts test images held in memory")
  folds, tenth = config.evaluation.calibrator_folds, spec.num_train // 10
  if (not spec.val_split and "dataset.val_size" not in explicit
      and dataset.val_size > max(folds, tenth)):
    implied["dataset.val_size"] = (max(folds, tenth), (
        f"{what} has no validation split and {spec.num_train} training images: a tenth of "
        f"them (at least evaluation.calibrator_folds={folds}) is carved out for validation"))
  if not spec.test_split and "dataset.test_size" not in explicit and not dataset.test_size:
    implied["dataset.test_size"] = (max(1, tenth), (
        f"{what} has no test split and {spec.num_train} training images: a tenth of them is "
        "carved out as the test set"))
  num_val = implied.get("dataset.val_size", (dataset.val_size,))[0]
  unreached = [alpha for alpha in conformal.alphas(config.evaluation.conformal_alpha)
               if not spec.val_split and conformal.alpha_problem(alpha, num_val)]
  if (unreached and config.evaluation.conformal_scores
      and not any(name in explicit for name in ("evaluation.conformal_scores",
                                                "evaluation.conformal_alpha"))):
    implied["evaluation.conformal_scores"] = ((), (
        f"{what} carves out {num_val} validation images, too few for conformal_alpha="
        f"{unreached[0]} (the smallest alpha they reach is "
        f"{conformal.smallest_alpha_text(num_val)}): no prediction sets"))
  return implied


# Fields a command-line override derives: a config file's values of them give way to it (a
# budget on the command line replaces the kept fraction and count a config file set).
_DERIVES = {"selection.budget": ("selection.fraction", "selection.count")}


def user_set(overrides: Collection[str], file_changed: Collection[str]) -> set[str]:
  """The fields the user set: the command-line `overrides`, and the fields the config file
  changed from configs/default.py (`file_changed`) unless an override derives them."""
  derived = {name for override in overrides for name in _DERIVES.get(override, ())}
  return set(overrides) | (set(file_changed) - derived)


def budget_settings(config: ml_collections.ConfigDict,
                    explicit: Collection[str]) -> tuple[dict[str, Any], str]:
  """The kept fraction that `selection.budget` derives (and count 0 in place of a config
  file's count), with the line that logs it; ({}, "") without a budget, or where
  `validate` will name what is wrong with it (a policy without a kept fraction, a share the
  schedule does not reach, a bad field).

  Raises:
    validation.ConfigError: the budget and a kept fraction or count both set by the user
      (`explicit`), named together.
  """
  selection = config.selection
  if not isinstance(selection.get("budget"), (int, float)) or not selection.budget:
    return {}, ""
  both = [name for name, value in (("selection.fraction", True),
                                    ("selection.count", selection.count))
          if name in explicit and value]  # A count of 0 sets no size.
  if both:
    leaf = both[0].split(".")[1]
    raise validation.ConfigError(
        f"invalid config:\n  config.selection.budget={selection.budget} and "
        f"config.{both[0]}={selection[leaf]} were both set: the budget derives the kept "
        "fraction; set one of them")
  if (validation.field_problems(config) or validation.source_problems(config.dataset)
      or not budgets.takes_budget(selection.method)):
    return {}, ""
  num_rows, problems = validation.training_rows(config)
  if problems:
    return {}, ""
  schedule = validation.budget_schedule(config, num_rows)
  try:
    fraction = budgets.fraction_for_budget(schedule, selection.budget)
  except ValueError:  # A share the schedule does not reach: `validate` names its range.
    return {}, ""
  settings = {"selection.fraction": fraction, **({"selection.count": 0} if selection.count
                                                 else {})}
  count = " and selection.count=0" if selection.count else ""
  return settings, (f"selection.budget={selection.budget}: selection.fraction={fraction}{count} "
                    f"({budgets.plan_text(schedule, selection.method)}): "
                    f"{budgets.passes_text(schedule, fraction)}.")


def with_settings(config: ml_collections.ConfigDict,
                  settings: dict[str, Any]) -> ml_collections.ConfigDict:
  """A copy of `config` with each dotted field of `settings` set to its value."""
  config = copy.deepcopy(config)
  for name, value in settings.items():
    *parents, leaf = name.split(".")
    section = config
    for parent in parents:
      section = section[parent]
    section[leaf] = value
  return config
