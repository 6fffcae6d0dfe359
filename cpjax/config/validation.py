"""Checks every config field once, at start-up, before any data load or compile.

An unknown field, a missing field, a wrong type or an out-of-range value (the checks of
cpjax/config/schema.py) raises `ConfigError` naming the field and what would be valid; so
does a combination of fields that cannot work together (checked here). What a choice
implies where the user left a field unset is cpjax.config.implied's, applied before this.
"""

import os

import jax
import ml_collections

from cpjax import models
from cpjax.calibration import conformal, losses
from cpjax.config import schema
from cpjax.data import input_pipeline, sources, specs, splits
from cpjax.data.device_stage import decoders
from cpjax.selection import budgets, policies, score_sources, scores


class ConfigError(ValueError):
  """A config field has a bad value; the message names the field."""


def validate(config: ml_collections.ConfigDict) -> None:
  """Validates `config` as a whole; raises ConfigError listing every problem.

  Args:
    config: the full run configuration.

  Raises:
    ConfigError: one line per bad, unknown or missing field.
  """
  import_modules(config)  # First: the names the modules register are valid choices below.
  problems = field_problems(config)
  if not problems:
    problems = source_problems(config.dataset)
  if not problems:
    problems = _cross_field_problems(config)
  if problems:
    raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def field_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Each field on its own: unknown, missing, or a bad value (cpjax/config/schema.py)."""
  checks = schema.spine_schema()
  leaves = schema.leaves(config)
  problems = [schema.unknown_field(name, checks) for name in leaves if name not in checks]
  problems += [f"config.{name}: missing (every config needs it; see configs/default.py)"
               for name in checks if name not in leaves]
  for name, check in checks.items():
    if name in leaves and (problem := check(leaves[name])):
      problems.append(f"config.{name}: {problem}")
  return problems


def import_modules(config: ml_collections.ConfigDict) -> None:
  """Imports `config.import_modules` (a user's registrations), so that the names they
  register are valid choices; before `implied_settings` and `validate`.

  Raises:
    ConfigError: a module that cannot be imported, named with its error.
  """
  problem = schema.import_problem(config.get("import_modules", ""))
  if problem:
    raise ConfigError(f"invalid config:\n  config.import_modules: {problem}")



def source_problems(dataset: ml_collections.ConfigDict) -> list[str]:
  """A source dataset (folder, tfds:NAME): its facts read and registered (data_sources
  .resolve: a missing folder, an unprepared tfds dataset or unreadable files are named
  here), and the fields that only in-memory datasets use left alone."""
  if not sources.is_source_name(dataset.name):
    return [f"config.dataset.folder={dataset.folder!r} is read only with "
            "dataset.name='folder'"] if dataset.folder else []
  problems = []
  # Readers of a source dataset: auto and stream read its converted records when
  # dataset.stream_dir is set, else (auto, host) the source itself.
  if dataset.reader not in input_pipeline.SOURCE_READERS:
    problems.append(f"config.dataset.reader={dataset.reader!r}: a {dataset.name} dataset is "
                    "read by the host stage (decode and crop on the host); valid: "
                    f"{', '.join(input_pipeline.SOURCE_READERS)} (stream: its converted records in "
                    "dataset.stream_dir)")
  elif dataset.reader == "stream" and not dataset.stream_dir:
    problems.append(f"config.dataset.reader='stream' reads a {dataset.name} dataset's "
                    "converted records: set config.dataset.stream_dir=DIR (written by python "
                    "-m scripts.write_array_records), or reader='auto' to read the source")
  elif dataset.reader == "host" and dataset.stream_dir:
    problems.append(f"config.dataset.stream_dir={dataset.stream_dir!r} is not read with "
                    "dataset.reader='host' (the source itself); set reader='stream' or "
                    "'auto' to read the records, or stream_dir=''")
  if (dataset.mean == ()) != (dataset.std == ()) or len(dataset.mean) != len(dataset.std):
    problems.append(f"config.dataset.mean={dataset.mean} and std={dataset.std}: set both (one "
                    "number per channel) or neither (computed on a sample)")
  if problems:
    return problems
  try:
    sources.resolve(dataset)
  except (OSError, ValueError, RuntimeError) as err:
    text, field = " ".join(str(err).split()), f"dataset.name={dataset.name!r}"
    # An error that names the field itself (tfds's "no such dataset") is not prefixed twice.
    return [f"config.{text}" if text.startswith(field) else f"config.{field}: {text}"]
  channels = specs.DATASETS[dataset.name].image_shape[-1]
  if dataset.mean and len(dataset.mean) != channels:
    return [f"config.dataset.mean={dataset.mean} must hold {channels} numbers (channels)"]
  return []


def _loss_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Problems that involve the loss and other config fields."""
  spec = losses.LOSSES[config.loss.name]
  problems = []
  if config.loss.mixup_alpha > 0 and not spec.soft_targets:
    soft = sorted(name for name, s in losses.LOSSES.items() if s.soft_targets)
    problems.append(f"config.loss.mixup_alpha={config.loss.mixup_alpha} needs a loss that takes "
                    f"probability targets, not {config.loss.name!r}; valid: {', '.join(soft)}")
  if spec.gamma_schedule and len(config.loss.gamma_boundaries) != len(spec.gamma_schedule) - 1:
    problems.append(f"config.loss.gamma_boundaries={config.loss.gamma_boundaries} must hold "
                    f"{len(spec.gamma_schedule) - 1} epochs for {config.loss.name}")
  return problems + _meta_problems(config, spec)


def _meta_problems(config: ml_collections.ConfigDict, spec: losses.LossSpec) -> list[str]:
  """FL_gamma losses need meta-validation batches: full ones, no loss weights; no other loss
  takes examples away from training for them."""
  meta_size, batch_size = config.dataset.meta_val_size, config.batch_size
  metas = sorted(name for name, s in losses.LOSSES.items() if s.meta_objective)
  if spec.meta_objective is None:
    return [] if not meta_size else [
        f"config.dataset.meta_val_size={meta_size} takes examples out of training for "
        f"meta-validation, which only the losses {', '.join(metas)} use; set it to 0 for "
        f"loss.name={config.loss.name!r}"]
  problems = []
  if meta_size < batch_size:
    problems.append(f"config.dataset.meta_val_size={meta_size} must be at least "
                    f"config.batch_size={batch_size} for loss.name={config.loss.name!r}: each "
                    "step draws a full meta-validation batch of distinct examples")
  if policies.returns_weights(config.selection.method):
    problems.append(f"config.selection.method={config.selection.method!r} weights the loss per "
                    f"example, which loss.name={config.loss.name!r} does not support")
  return problems


def _selection_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Score sources, targets and subset sizes."""
  selection, problems = config.selection, []
  target, scoring = selection.target_workdir, selection.scoring
  reducible = selection.score == scores.REDUCIBLE_LOSS
  reads = score_sources.SOURCES[scoring].target  # What it reads of the target run.
  scores_with_target = bool(reads)
  if scores_with_target and not target:
    problems.append(f"config.selection.scoring={scoring!r} needs config.selection.target_workdir")
  if target and not (scores_with_target or reducible):
    problems.append(f"config.selection.target_workdir is set but selection.scoring={scoring!r}: "
                    "to score with the target run use selection.scoring='target' (its model "
                    "scores) or 'target_recorded' (its recorded scores of each epoch), or "
                    "selection.score='reducible_loss' (its losses as irreducible losses)")
  targeted = [p.name for p in policies.POLICIES.entries() if p.takes_target_scores]
  if target and selection.method not in targeted:
    problems.append(f"config.selection.target_workdir is set but selection.method="
                    f"{selection.method!r} uses no target scores; use {' or '.join(targeted)}")
  restores_target = reads == "model" or reducible  # Target_recorded reads score files.
  if target and restores_target and not os.path.isdir(os.path.join(target, "checkpoints")):
    problems.append(f"config.selection.target_workdir={target!r} has no checkpoints/ folder "
                    "(it must be the --workdir of a finished cpjax run)")
  return (problems + _reducible_loss_problems(config) + _policy_schedule_problems(config)
          + _proportional_problems(selection))


def _proportional_problems(selection: ml_collections.ConfigDict) -> list[str]:
  """A policy that draws with probabilities proportional to the score needs a score that is
  never negative (importance: a negative score would count as 0)."""
  policy = policies.POLICIES[selection.method]
  if not policy.proportional or scores.SCORES[selection.score].nonnegative:
    return []
  valid = [s.name for s in scores.SCORES.entries() if s.nonnegative]
  return [f"config.selection.score={selection.score!r} can be negative, and method="
          f"{selection.method!r} draws with probabilities proportional to the score; valid: "
          f"{', '.join(valid)}"]


def _policy_schedule_problems(config: ml_collections.ConfigDict) -> list[str]:
  """The selected epochs and the budget schedule (`policies.schedule_problems`, the checks
  the library API runs too) and the fields the policy needs (`Policy.needs`)."""
  selection = config.selection
  needs = policies.POLICIES[selection.method].needs
  problems = policies.needs_problems(selection.method, **{f: selection[f] for f in needs})
  problems += policies.schedule_problems(
      selection.method, num_epochs=config.num_epochs, warmup_epochs=selection.warmup_epochs,
      final_full_epochs=selection.final_full_epochs, fraction_end=selection.fraction_end,
      count=selection.count)
  return [f"config.selection.{problem}" for problem in problems]


def _reducible_loss_problems(config: ml_collections.ConfigDict) -> list[str]:
  """RHO-LOSS: this run's own losses (train pass or fresh pass) less the target run's."""
  selection, problems = config.selection, []
  if selection.score != scores.REDUCIBLE_LOSS:
    return problems
  if not selection.target_workdir:
    problems.append("config.selection.score='reducible_loss' needs "
                    "config.selection.target_workdir: the --workdir of a cpjax run (ideally "
                    "trained on held-out data) whose losses are the irreducible losses")
  own_losses = [s.name for s in score_sources.SOURCES.entries() if s.own_model]
  if selection.scoring not in own_losses:
    problems.append(f"config.selection.scoring={selection.scoring!r} does not work with "
                    "selection.score='reducible_loss' (the current model's losses come from "
                    "its own passes; the target run only gives the irreducible losses); "
                    f"valid: {', '.join(repr(s) for s in own_losses)}")
  return problems


def _size_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Split sizes, then the subset's against the training examples they leave."""
  num_rows, problems = training_rows(config)
  if problems:
    return problems
  selection = config.selection
  settings = {s.name: selection[s.name] for s in policies.POLICIES[selection.method].settings}
  return [f"config.selection.{problem}" for problem in policies.size_problems(
      selection.method, num_rows=num_rows, num_epochs=config.num_epochs,
      warmup_epochs=selection.warmup_epochs, fraction=selection.fraction,
      count=selection.count, **settings)] + _budget_problems(config, num_rows)


def training_rows(config: ml_collections.ConfigDict) -> tuple[int, list[str]]:
  """(the training examples a run selects from, []), or (0, the split-size problems that
  leave none); each size checked only when the sizes it depends on are valid."""
  num_train = specs.DATASETS[config.dataset.name].num_train
  val_size = splits.carved_val_size(config.dataset)
  if val_size >= num_train:  # Every size below would be negative: stop here.
    return 0, [f"config.dataset.val_size={config.dataset.val_size} must be below the train "
               f"split size {num_train} of {config.dataset.name}"]
  num_rows = num_train - val_size
  if not specs.DATASETS[config.dataset.name].test_split:
    test_size = config.dataset.test_size
    if not 0 < test_size < num_rows:
      return 0, [f"config.dataset.test_size={test_size}: {config.dataset.name} has no test "
                 f"split, so test examples are carved from train; set 0 < test_size < "
                 f"{num_rows}"]
    num_rows -= test_size
  if config.dataset.meta_val_size >= num_rows:
    return 0, [f"config.dataset.meta_val_size={config.dataset.meta_val_size} must be below "
               f"the {num_rows} training examples left after validation"]
  num_rows -= config.dataset.meta_val_size
  if problems := _holdout_problems(config.dataset, num_rows):
    return 0, problems
  num_rows = splits.num_train_examples(
      ml_collections.ConfigDict({**config.dataset.to_dict(), "train_examples": 0}))
  if config.dataset.train_examples > num_rows:
    return 0, [f"config.dataset.train_examples={config.dataset.train_examples} exceeds the "
               f"{num_rows} training examples left after validation, meta-validation and "
               "holdout"]
  return config.dataset.train_examples or num_rows, []


def budget_schedule(config: ml_collections.ConfigDict, num_rows: int) -> budgets.Schedule:
  """The schedule that sets a selecting run's passes besides its kept fraction."""
  selection = config.selection
  return budgets.Schedule(num_rows, config.num_epochs, selection.warmup_epochs,
                          selection.final_full_epochs, selection.fraction_end)


def _budget_problems(config: ml_collections.ConfigDict, num_rows: int) -> list[str]:
  """selection.budget: a policy whose sizes a kept fraction sets, no count beside it, a
  share the schedule reaches, and the fraction it derives (cpjax.config.implied sets it)."""
  selection, budget = config.selection, config.selection.budget
  if budget == 0:
    return []
  name = f"config.selection.budget={budget}"
  if not budgets.takes_budget(selection.method):
    return [f"{name} does not work with method={selection.method!r}, which decides its "
            "epochs' sizes itself (no kept fraction to derive); the methods that take a "
            f"budget: {', '.join(budgets.budget_methods())}"]
  if selection.count:
    return [f"{name} and config.selection.count={selection.count} were both set: the budget "
            "sets the subset size through selection.fraction; set one of them"]
  schedule = budget_schedule(config, num_rows)
  try:
    fraction = budgets.fraction_for_budget(schedule, budget)
  except ValueError as err:
    return [f"{name}: {err}; valid: a share of them in that range, or 0 (no budget)"]
  if selection.fraction != fraction:
    return [f"{name} and config.selection.fraction={selection.fraction} were both set: the "
            f"budget derives the fraction ({fraction} on this schedule); set one of them"]
  return []


def _holdout_problems(dataset: ml_collections.ConfigDict, pool_size: int) -> list[str]:
  """A holdout share is used by exactly the runs that train on one side of it."""
  fraction, part = dataset.holdout_fraction, dataset.train_part
  if part == "all":
    return [] if fraction == 0 else [
        f"config.dataset.holdout_fraction={fraction} is unused with dataset.train_part='all': "
        "set train_part='holdout' (train the irreducible-loss target on the held-out rows) or "
        "'rest' (train on the other rows), or holdout_fraction=0"]
  holdout = int(round(fraction * pool_size))
  if not 0 < holdout < pool_size:
    return [f"config.dataset.holdout_fraction={fraction} holds out {holdout} of the "
            f"{pool_size} training examples; dataset.train_part={part!r} needs at least one "
            "row on each side"]
  return []


def size_warnings(config: ml_collections.ConfigDict) -> list[str]:
  """Valid but probably unintended sizes, to log at start-up (each names its fields)."""
  num_rows = splits.num_train_examples(config.dataset)
  warnings = []
  if config.batch_size > num_rows:
    warnings.append(f"config.batch_size={config.batch_size} exceeds the {num_rows} training "
                    "examples: each epoch is one step whose batch repeats examples")
  if policies.reads_k(config.selection.method):
    k = policies.subset_size(config.selection.fraction, config.selection.count, num_rows)
    if k < config.batch_size:
      warnings.append(f"the selected subset (k={k} from selection.fraction/count) is smaller "
                      f"than config.batch_size={config.batch_size}: each selected epoch is one "
                      "step whose batch repeats examples")
  return warnings + _model_size_warnings(config)


def _model_size_warnings(config: ml_collections.ConfigDict) -> list[str]:
  """A registered model whose downsampling leaves less than one pixel of the image."""
  spec = models.MODELS.get(config.model.name)
  side = min(specs.DATASETS[config.dataset.name].image_shape[:2])
  if spec is None or side >= spec.downsampling:
    return []
  return [f"config.model.name={spec.name!r} downsamples x{spec.downsampling} (made for "
          f"{spec.image_size} px images); the {side} px images of {config.dataset.name!r} "
          "reach its last stages as 1x1 maps, mostly padding: a model made for small images "
          "(docs/models.md lists each one's input size) may do better"]


def _cross_field_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Constraints that involve several fields or the runtime (device count)."""
  problems = _loss_problems(config) + _selection_problems(config)
  devices = jax.device_count()
  leaves = schema.leaves(config)
  for name in ("batch_size", "eval_batch_size", "selection.score_batch_size"):
    if (value := leaves[name]) % devices:
      problems.append(f"config.{name}={value} must be divisible by the "
                      f"device count {devices} (every device gets an equal share)")
  if config.optimizer.warmup_epochs >= config.num_epochs:
    problems.append(f"config.optimizer.warmup_epochs={config.optimizer.warmup_epochs} must be "
                    f"below config.num_epochs={config.num_epochs}")
  if config.evaluation.bootstrap_level >= 1.0:
    problems.append(f"config.evaluation.bootstrap_level={config.evaluation.bootstrap_level} "
                    "must be below 1 (e.g. 0.9 for a 90 % interval)")
  if policies.returns_weights(config.selection.method) and (
      config.budget_steps or config.optimizer.schedule_unit == "step"):
    # An infobatch epoch's size is drawn when it starts: the run's steps are not known ahead.
    problems.append(f"config.budget_steps={config.budget_steps} and optimizer.schedule_unit="
                    f"{config.optimizer.schedule_unit!r} need epochs of known size; "
                    f"selection.method={config.selection.method!r} draws each epoch's size: "
                    "use budget_steps=0 and schedule_unit='epoch' with it")
  if config.evaluation.calibrator_folds > config.dataset.val_size:
    problems.append(f"config.evaluation.calibrator_folds={config.evaluation.calibrator_folds} "
                    f"exceeds config.dataset.val_size={config.dataset.val_size}: every fold "
                    "of the post-hoc maps' cross-validation needs a validation example")
  problems += _size_problems(config) + _conformal_problems(config)
  ood = config.evaluation.ood
  if ood in specs.DATASETS and (
      ood == config.dataset.name or specs.DATASETS[ood].image_shape
      != specs.DATASETS[config.dataset.name].image_shape):
    problems.append(f"config.evaluation.ood={ood!r} must be another dataset with the image "
                    f"shape of {config.dataset.name!r}, gaussian_noise, or '' (none)")
  return (problems + _reader_problems(config) + _decode_problems(config.dataset)
          + _model_problems(config))


def _conformal_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Each conformal alpha the validation rows reach: k = ceil((n + 1)(1 - alpha)) <= n. Where
  the dataset has a validation split of its own, its size is known only when it is read: the
  report skips (and names) an alpha it does not reach."""
  num_val = splits.carved_val_size(config.dataset)
  if not config.evaluation.conformal_scores or not num_val:
    return []
  problems = []
  for alpha in conformal.alphas(config.evaluation.conformal_alpha):
    k = conformal.quantile_rank(num_val, alpha)
    if k > num_val:
      problems.append(
          f"config.evaluation.conformal_alpha={alpha} needs the k-th smallest of the n = "
          f"{num_val} validation scores (dataset.val_size), k = ceil((n + 1)(1 - alpha)) = "
          f"{k} > n: the smallest reachable alpha is {conformal.smallest_alpha_text(num_val)};"
          " raise alpha or dataset.val_size, or set evaluation.conformal_scores=() for no "
          "prediction sets")
  return problems


def _decode_problems(dataset: ml_collections.ConfigDict) -> list[str]:
  """dataset.decode: a device-stage decoder takes a source dataset's encoded images, resizes
  as the 'opencv' engine does, and must be able to run here (the gpu decoder: an NVIDIA GPU
  and nvImageCodec), else one line naming what to install."""
  decode = dataset.decode
  if decode not in decoders.DECODERS:  # cpu, auto, or a bad name (the schema names it).
    return []
  if not sources.is_source_name(dataset.name):
    return [f"config.dataset.decode={decode!r} decodes the encoded images of a folder or tfds "
            f"dataset; {dataset.name!r} is held in memory as pixels: use 'cpu' or 'auto'"]
  problem = decoders.decoder_problem(decode, dataset.resize)
  return [f"config.dataset.decode={decode!r} {problem}; or decode on the host: "
          "--config.dataset.decode=cpu"] if problem else []


def _model_problems(config: ml_collections.ConfigDict) -> list[str]:
  """A user's module by import path: built and traced on one dummy batch of the dataset's
  image shape (jax.eval_shape: nothing computed or compiled), against cpjax's contract."""
  if not models.is_import_path(config.model.name):
    return []  # Registered models meet it by construction (tests/test_models.py).
  data = specs.DATASETS[config.dataset.name]
  return [f"config.model.name: {problem}" for problem in models.contract_problems(
      config.model.name, data.image_shape, data.num_classes, config.model.dtype,
      needs_head=losses.LOSSES[config.loss.name].meta_objective is not None)]


def _reader_problems(config: ml_collections.ConfigDict) -> list[str]:
  """A streamed run needs its array_record directory and keeps no test images in memory."""
  dataset = config.dataset
  if specs.DATASETS[dataset.name].encoded:
    return [] if config.evaluation.ood != "gaussian_noise" else [
        f"config.evaluation.ood='gaussian_noise' corrupts the test images in memory, which a "
        f"{dataset.name!r} run (images decoded on the host per batch) does not hold: use a "
        "built-in dataset or '' (none)"]
  if dataset.label_noise and dataset.stream_dir:
    return [f"config.dataset.label_noise={dataset.label_noise} flips labels in memory; a "
            "streamed run reads its labels from dataset.stream_dir: set stream_dir='' "
            "(in-memory readers) or label_noise=0"]
  if dataset.reader == "stream" and not dataset.stream_dir:
    return ["config.dataset.reader='stream' needs config.dataset.stream_dir (the output of "
            "python -m scripts.write_array_records for this dataset config)"]
  if input_pipeline.streams(dataset) and config.evaluation.ood == "gaussian_noise":
    return [f"config.evaluation.ood='gaussian_noise' corrupts the test images in memory, which "
            f"a streamed run (dataset.reader={dataset.reader!r}, stream_dir="
            f"{dataset.stream_dir!r}) does not hold: use another dataset or '' (none)"]
  return []
