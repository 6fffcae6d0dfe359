"""Start-up checks: everything a run will need, checked before the workdir is touched.

`check(config, workdir, mode)` runs after config validation and before the workdir lock,
the checkpoint folder or any compile; the datasets it prepares are the ones the run would
prepare at its start (or, for the OOD set, at its report). It checks first, and alone, that
`--workdir` can be the run's folder (a writable folder, or a path whose nearest existing
part is one: not a file), then

  * the dataset: opened through its tfds builder, or prepared now if it is to be prepared
    (download, manual_dir, a local builder: `input_pipeline.open_or_prepare`), or, for a
    streamed run, every array_record split's index, shard sizes and a sample of records
    against their CRC-32 (`array_records.check_files`);
  * the OOD set of the final report (`evaluation.ood` naming another dataset): on its own,
    through its own builder, opened or prepared now the same way; a run's manual_dir or
    download setting never lets it pass unchecked (it would otherwise fail at the report,
    after the whole training);
  * for training, a target run (`selection.target_workdir`): its config, split fields and
    recorded scores (`score_sources.check_target`);
  * for training, that the checkpoint folder (or its nearest existing parent) is writable
    and has room for checkpointing.ROOM_FACTOR times the run's checkpoint, whose size is read
    from the shapes of its tree (`run_state.abstract`), computing nothing.

Each failure is one line naming what is missing and how to fix it; all of them are
reported together in one `StartupCheckError`, and nothing has been written.
"""

import os
import tempfile

import ml_collections

from cpjax import run_state
from cpjax.data import array_records, input_pipeline, specs
from cpjax.runtime import checkpointing, files, sharding
from cpjax.selection import bookkeeping, score_sources


class StartupCheckError(RuntimeError):
  """Something the run will need is missing; one line per problem."""


def check(config: ml_collections.ConfigDict, workdir: str, mode: str = "train") -> None:
  """Runs every start-up check of `config` (validated) for `mode` ("train" or "evaluate").

  Raises:
    StartupCheckError: one line per failed check.
  """
  if problem := _workdir_problem(workdir):  # Nothing else is worth checking then.
    raise StartupCheckError(problem)
  checks = [_check_dataset, _check_ood]
  if mode == "train":  # Evaluating reads no target run and writes no checkpoint.
    checks += [_check_target, lambda c: _check_checkpoint_room(c, workdir)]
  problems = []
  for one in checks:
    try:
      one(config)
    except (OSError, ValueError, RuntimeError) as err:
      problems.append(" ".join(str(err).split()))  # One line, whatever the error's layout.
  if problems:
    raise StartupCheckError("start-up checks failed (nothing was written):\n  "
                            + "\n  ".join(problems))


def _workdir_problem(workdir: str) -> str | None:
  """Why `workdir` cannot be the run's folder, in one line, or None; creates nothing (the
  workdir lock creates the folder once every check has passed)."""
  where = files.existing_parent(workdir)
  if not os.path.isdir(where):
    return (f"--workdir {workdir!r} cannot be a folder: {where} is a file; pass another "
            "--workdir (nothing was written)")
  try:
    tempfile.NamedTemporaryFile(dir=where).close()  # Can the run create files here?
  except OSError as err:
    return (f"--workdir {workdir!r} is not writable ({err.strerror or err} in {where}); make "
            "it writable or pass another --workdir (nothing was written)")
  return None


def _check_dataset(config: ml_collections.ConfigDict) -> None:
  dataset = config.dataset
  if not input_pipeline.streams(dataset):
    input_pipeline.open_or_prepare(dataset.name, dataset)
    return
  names = ["train", "val", "test"] + (["meta_val"] if dataset.meta_val_size else [])
  for name in names:
    array_records.check_files(dataset.stream_dir, name, dataset)


def _check_ood(config: ml_collections.ConfigDict) -> None:
  ood = config.evaluation.ood
  if ood not in specs.DATASETS:  # "", or a corruption of the test set.
    return
  try:
    input_pipeline.open_or_prepare(ood, config.dataset)
  except input_pipeline.DataNotFoundError as err:
    raise input_pipeline.DataNotFoundError(
        f"the OOD set evaluation.ood={ood!r} of the final report is missing: {err} To skip "
        "the OOD evaluation instead, pass --config.evaluation.ood=\"\"") from err


def _check_target(config: ml_collections.ConfigDict) -> None:
  if config.selection.target_workdir:  # Validated: set only where a target is used.
    score_sources.check_target(config.selection, config.dataset)


def checkpoint_bytes(config: ml_collections.ConfigDict) -> int:
  """Bytes of the arrays of one checkpoint of `config` (train state, selection state and
  partial epoch), from their shapes and dtypes; nothing is computed."""
  return checkpointing.tree_bytes(run_state.abstract(
      config, sharding.create_mesh(),
      bookkeeping.initial_state_of(config.dataset, config.selection)))


def _check_checkpoint_room(config: ml_collections.ConfigDict, workdir: str) -> None:
  checkpointing.check_room(os.path.join(workdir, "checkpoints"),
                           checkpointing.ROOM_FACTOR * checkpoint_bytes(config))
