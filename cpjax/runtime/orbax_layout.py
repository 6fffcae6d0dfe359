"""The one place that knows how orbax-checkpoint lays out a committed step on disk.

cpjax checks a step's own files before it restores it (cpjax.runtime.checkpointing).
orbax's public API gives the step's directory (`ocp.step.build_step_path` with the
manager's default `standard_name_format`) and whether that directory is finalized
(`ocp.step.is_checkpoint_finalized`: no temporary name, and on file systems that
commit by marker file, the marker). It offers no check that each item was committed,
nor that the step metadata file is readable, so those two names are orbax's own, kept
here and nowhere else:

  <step>/commit_success.txt            written last when the step commits
  <step>/<item>/commit_success.txt     one per item (here: state, meta)
  <step>/_CHECKPOINT_METADATA          the step metadata (JSON object)

tests/test_checkpointing.py saves a checkpoint with the installed orbax and asserts
this layout: an orbax release that writes another one fails that test, naming what to
update here, instead of making every step look damaged (and moving it aside) at resume.
"""

from collections.abc import Sequence
import json
import os

import orbax.checkpoint as ocp

COMMIT_MARKER = "commit_success.txt"
STEP_METADATA = "_CHECKPOINT_METADATA"


def step_directory(directory: str, step: int) -> str:
  """The directory of checkpoint `step` under a CheckpointManager's `directory` (default
  step names, as cpjax's manager writes them)."""
  return os.fspath(ocp.step.build_step_path(directory, ocp.step.standard_name_format(), step))


def expected_files(items: Sequence[str]) -> list[str]:
  """The files (relative to a step's directory) every committed step with `items` holds."""
  return [COMMIT_MARKER, *(os.path.join(item, COMMIT_MARKER) for item in items), STEP_METADATA]


def step_problem(step_dir: str, items: Sequence[str]) -> str | None:
  """Why the step in `step_dir` is not a complete committed step, or None if it is.

  Args:
    step_dir: a step's directory (`step_directory`).
    items: the names of the items saved in every step.
  """
  if not ocp.step.is_checkpoint_finalized(step_dir):
    return "orbax does not consider the step finalized"
  for marker in expected_files(items)[:-1]:
    if not os.path.isfile(os.path.join(step_dir, marker)):
      return f"commit marker {marker} is missing"
  try:
    with open(os.path.join(step_dir, STEP_METADATA), encoding="utf-8") as f:
      if not isinstance(json.load(f), dict):
        raise ValueError("not a JSON object")
  except (OSError, ValueError) as err:
    return f"{STEP_METADATA} is unreadable ({type(err).__name__}: {str(err)[:200]})"
  return None


def committed_steps(directory: str, items: Sequence[str] = ("state", "meta")) -> list[int]:
  """The steps under a CheckpointManager's `directory` that are complete committed steps
  (`step_problem` finds nothing), oldest first; [] if the folder is missing or unreadable.
  Reads only the folder listing and the markers: safe while a save is under way or failed.
  """
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(int(name) for name in names if name.isdigit()
                and step_problem(step_directory(directory, int(name)), items) is None)
