"""A thin orbax wrapper: save every N epochs, keep the last K, resume by default.

A checkpoint is taken at the end of an epoch (or at a preemption, mid-epoch)
and named by the global training step. It holds `state` (a pytree of arrays: train state, RNG key
and, with selection, the score buffer and subset) and `meta` (JSON: epoch and
the run's config as JSON). Restoring goes into an
abstract target carrying the current shardings; a shape mismatch is reported
by path before orbax is asked, and an unreadable latest checkpoint falls back
to the previous one with a warning.
"""

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointMismatchError(ValueError):
  """The checkpoint's arrays do not fit the current config's shapes."""


def _leaves_by_name(tree: Any) -> dict[str, Any]:
  """Leaves keyed by a dotted path of plain names (orbax stores dataclasses as dicts)."""
  def name(key):
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        return str(getattr(key, attr))
    return str(key)
  return {".".join(name(k) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class Checkpointer:
  """Saves and restores (state, meta) pairs under `workdir/checkpoints`."""

  def __init__(self, workdir: str, max_to_keep: int):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=True),
        # Named handlers let a fresh process read metadata before restoring.
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
    """Starts an asynchronous save of `state` and `meta` as checkpoint `step`."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict[str, Any]] | None:
    """Restores the newest readable checkpoint, or returns None if there is none.

    Args:
      abstract_state: pytree of jax.ShapeDtypeStruct (with shardings) that the
        restored arrays must fit.

    Raises:
      CheckpointMismatchError: the checkpoint's shapes differ from the target's.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    for i, step in enumerate(steps):
      try:
        self._check_shapes(step, abstract_state)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
      except CheckpointMismatchError:
        raise
      except Exception as err:  # pylint: disable=broad-except  (corrupt files: any error)
        if i + 1 == len(steps):
          raise RuntimeError(f"no readable checkpoint in {self.directory}: the oldest, "
                             f"{step}, failed with {err!r}") from err
        logging.warning("Checkpoint %d in %s is unreadable (%r); falling back to %d.",
                        step, self.directory, err, steps[i + 1])
        continue
      return restored["state"], restored["meta"]
    return None

  def latest_step(self) -> int | None:
    """The newest checkpoint's step (global training step), or None if there is none."""
    return self._manager.latest_step()

  def latest_meta(self) -> dict[str, Any] | None:
    """The JSON metadata of the newest checkpoint, or None if there is none."""
    step = self._manager.latest_step()
    if step is None:
      return None
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def _check_shapes(self, step: int, abstract_state: Any) -> None:
    saved = _leaves_by_name(self._manager.item_metadata(step)["state"])
    target = _leaves_by_name(abstract_state)
    problems = [f"{name}: checkpoint {tuple(saved[name].shape)} vs config {tuple(leaf.shape)}"
                for name, leaf in target.items()
                if name in saved and tuple(saved[name].shape) != tuple(leaf.shape)]
    problems += [f"{name}: not in the checkpoint" for name in target if name not in saved]
    if problems:
      raise CheckpointMismatchError(
          f"checkpoint {step} in {self.directory} does not fit this config "
          f"({len(problems)} mismatches), e.g.\n  " + "\n  ".join(problems[:5]) +
          "\nUse a fresh --workdir, or the config the checkpoint was trained with.")

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
