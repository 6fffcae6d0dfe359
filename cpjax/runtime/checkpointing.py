"""A thin orbax wrapper: save every N epochs, keep the last K, resume by default.

A checkpoint is taken at the end of an epoch (or at a preemption, mid-epoch) and named by
the global training step. It holds `state` (a pytree of arrays: cpjax.run_state's tree of
train state, selection state and partial epoch) and `meta` (JSON: epoch, epoch step, global
step and the run's config as JSON). Restoring goes into an abstract target carrying the
current shardings.

Integrity. `save` records, under the reserved `meta` key `_integrity`, the hash record of
cpjax.runtime.checkpoint_integrity (a SHA-256 of every leaf's bytes with its path, shape and
dtype, one digest over all of them, and a digest of the rest of `meta`), computed on the host
from the very arrays handed to orbax, before `save` returns. `restore_latest` checks, newest
step first:

  * the step's own files (cpjax.runtime.orbax_layout, the one module that knows orbax's
    file names): finalized, its commit markers (step and items) and a readable step
    metadata file; the `meta` JSON and its integrity record;
  * the `state` item metadata (`state/_METADATA`): unreadable or missing is
    damage; readable but disagreeing with the recorded shapes is damage;
  * the fit to the target: readable metadata whose shapes or array names differ
    from the target's is a real config mismatch, `CheckpointMismatchError`
    naming the arrays (never moved aside, never a fallback);
  * the restore itself (any error is damage) and the restored bytes against the
    recorded hashes (any difference is damage).

A damaged step is moved aside, never deleted: renamed to `checkpoints/corrupt/<step>.<UTC
time>` (a name orbax does not list as a step), with the reason written inside it, in
`CPJAX_DAMAGE.txt`, and a warning naming it. The manager re-reads its step list, the next
older step is tried, and a later `save` of the moved step really writes it again. If every
step is damaged, all are moved aside and RuntimeError is raised (a rerun then starts from
scratch). Checkpoints written before hashes were recorded restore as before, with one
warning that they are unverified.

Rotation contract. orbax keeps the newest `max_to_keep` committed steps and deletes older
ones only after a newer save has committed. The loop must therefore never `save` a state it
has not checked (finite parameters): then a checkpoint is only ever rotated away once a newer
good one exists. A step damaged on disk later is detected and moved aside at restore, so it
never counts against the older good ones after that.

Multi-process. Every process calls `save` and `restore_latest` at the same point. Only fully
replicated arrays are saved in cpjax, so each process hashes (and verifies) a complete copy;
an array that is not fully replicated nor fully addressable is gathered with
`process_allgather` (a collective). At restore the processes agree on each step's verdict
(allgather: any damage anywhere is damage, any mismatch anywhere is a mismatch); only process
0 renames a damaged step, then all processes synchronize and reload their step lists. A
restore error that orbax raises on one process inside one of its own collectives can still
leave the others waiting; that is beyond what this wrapper can detect.

Read-only use (another run's checkpoints, `read_only=True`): damaged steps are
skipped with a warning but left in place, and `save` is refused.

Preemption. As orbax's CheckpointManager (`reached_preemption`), the checkpointer also says
when a preemption request means "save and stop" (cpjax.runtime.preemption: SIGTERM or Ctrl-C
in one process, JAX's preemption service across several), so the loop asks one object when
to save and whether to stop: `handling_preemption` turns the signals into requests for the
run's duration, `reached_preemption(step)` reads them after a step, `stop_preempted` is the
one stop once the step is saved, and `stopping_at_once` covers work done after the last save
(the report), which a signal ends where it is.
"""

import contextlib
import logging
import os
import time
from typing import Any, NoReturn

import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp

from cpjax.runtime import checkpoint_integrity, failures, orbax_layout, preemption

# The save error and the room check live in checkpoint_room; callers reach them here too.
from cpjax.runtime.checkpoint_room import ROOM_FACTOR, CheckpointSaveError, check_room, tree_bytes

CORRUPT_DIR = "corrupt"  # Under checkpoints/: damaged steps, moved aside.
_DAMAGE_NOTE = "CPJAX_DAMAGE.txt"
ITEMS = ("state", "meta")  # The items of every checkpoint.
_OK, _DAMAGED, _MISMATCH = 0, 1, 2


class CheckpointMismatchError(ValueError):
  """The checkpoint's arrays do not fit the current config's shapes."""


def _agree(code: int) -> int:
  """The worst verdict over all processes (identity with one process)."""
  if jax.process_count() == 1:
    return code
  codes = multihost_utils.process_allgather(np.asarray([code], np.int32))
  return int(np.max(codes))


class Checkpointer:
  """Saves and restores (state, meta) pairs under `workdir/checkpoints`.

  Args:
    workdir: the run's directory; checkpoints go to `workdir/checkpoints`.
    max_to_keep: how many of the newest checkpoints orbax keeps.
    read_only: for another run's checkpoints: never write, create, rotate or move
      anything; damaged steps are only skipped.
  """

  def __init__(self, workdir: str, max_to_keep: int | None, *, read_only: bool = False):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.read_only = read_only
    self._warned_unverified = False
    self._preemption = preemption.PreemptionGuard()
    if read_only:
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0,
                                             enable_async_checkpointing=False)
    else:
      options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        # Named handlers let a fresh process read metadata before restoring.
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  @property
  def corrupt_directory(self) -> str:
    """Where damaged steps are moved aside (`checkpoints/corrupt`)."""
    return os.path.join(self.directory, CORRUPT_DIR)

  def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
    """Starts an asynchronous save of `state` and `meta` (plus hashes) as checkpoint `step`.

    The caller must have checked `state` (finite parameters) first: see the module
    docstring's rotation contract. The hashes are computed before this returns, so `state`
    may be donated afterwards.

    Returns:
      True if the save was started; False if checkpoint `step` already exists
      (it is kept as it is: it holds the same global step).

    Raises:
      CheckpointSaveError: orbax declined to save (e.g. `step` is older than
        the latest checkpoint), this Checkpointer is read-only, or the folder is not
        writable or lacks room for ROOM_FACTOR times the checkpoint (`check_room`).
      ValueError: `meta` uses the reserved key checkpoint_integrity.INTEGRITY_KEY.
    """
    if self.read_only:
      raise CheckpointSaveError(f"{self.directory} was opened read-only; not saving step {step}")
    if checkpoint_integrity.INTEGRITY_KEY in meta:
      raise ValueError(f"meta key {checkpoint_integrity.INTEGRITY_KEY!r} is reserved for the "
                       "checkpoint's hashes")
    if step in self._manager.all_steps():
      logging.info("Checkpoint %d already exists in %s; not saving it again.", step,
                   self.directory)
      return False
    # A folder turned read-only or full mid-run stops the run here, in one line: inside
    # orbax's asynchronous commit the same error would be logged and the process would hang.
    try:
      check_room(self.directory, ROOM_FACTOR * tree_bytes(state))
    except CheckpointSaveError as err:  # Mid-run: say where the rerun resumes.
      raise CheckpointSaveError(f"{err}; then {failures.resume_advice(self.directory)}") from err
    meta = {**meta, checkpoint_integrity.INTEGRITY_KEY:
            checkpoint_integrity.integrity_record(state, meta)}
    with self._write_errors():  # orbax raises here the error of the previous async save.
      saved = self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    if not saved:
      raise CheckpointSaveError(
          f"orbax did not save checkpoint {step} in {self.directory} (its newest is "
          f"{self._manager.latest_step()}; it saves only steps after that)")
    return True

  def restore_latest(self, abstract_state: Any) -> tuple[Any, dict[str, Any]] | None:
    """Restores the newest good checkpoint, or returns None if there is none.

    Damaged steps on the way are moved aside (see the module docstring) with a
    warning; `meta` comes back as saved, without the integrity record.

    Args:
      abstract_state: pytree of jax.ShapeDtypeStruct (with shardings) that the
        restored arrays must fit.

    Raises:
      CheckpointMismatchError: the checkpoint's shapes differ from the target's.
      RuntimeError: there were checkpoints, and every one of them is damaged.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      self._note_moved_aside()
      return None
    damaged = []
    for i, step in enumerate(steps):
      code, outcome = self._try_step(step, abstract_state)
      agreed = _agree(code)
      if agreed == _MISMATCH:
        if code == _MISMATCH:
          raise outcome
        raise CheckpointMismatchError(f"checkpoint {step} in {self.directory} does not fit this "
                                      "config on another process")
      if agreed == _DAMAGED:
        reason = outcome if code == _DAMAGED else "damaged as read by another process"
        where = self._set_aside(step, reason)
        fallback = (f"falling back to checkpoint {steps[i + 1]}" if i + 1 < len(steps)
                    else "no older checkpoint is left")
        if where:
          logging.warning("Checkpoint %d in %s is damaged (%s); moved it aside to %s, %s.",
                          step, self.directory, reason, where, fallback)
        else:
          logging.warning("Checkpoint %d in %s is damaged (%s); %s.", step, self.directory,
                          reason, fallback)
        damaged.append(f"{step} ({reason})")
        continue
      state, meta, verified = outcome
      if not verified and not self._warned_unverified:
        self._warned_unverified = True
        logging.warning("Checkpoint %d in %s has no content hash (saved before cpjax recorded "
                        "one); restored it unverified.", step, self.directory)
      return state, meta
    moved = ("left in place (read-only)" if self.read_only else
             f"moved to {self.corrupt_directory}; a rerun starts from scratch")
    raise RuntimeError(f"no readable checkpoint in {self.directory}: every one is damaged ("
                       + "; ".join(damaged) + f") and was {moved}")

  def latest_step(self) -> int | None:
    """The newest checkpoint's step (global training step), or None if there is none."""
    return self._manager.latest_step()

  def latest_meta(self) -> dict[str, Any] | None:
    """The JSON metadata of the newest checkpoint whose metadata reads back intact, or None.

    Only reads: a damaged step is skipped with a warning, not moved aside.
    """
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        return self._read_meta(step)[0]
      except checkpoint_integrity.Damaged as err:
        logging.warning("Checkpoint %d in %s has damaged metadata (%s); reading an older one.",
                        step, self.directory, err)
    return None

  def wait_until_finished(self) -> None:
    """Waits for the pending save to commit; its failure raises CheckpointSaveError."""
    with self._write_errors():
      self._manager.wait_until_finished()

  @contextlib.contextmanager
  def _write_errors(self):
    """An error of orbax's (asynchronous) writing as one CheckpointSaveError line.

    After such an error orbax's background threads may never end, and the interpreter waits
    for them at exit: main.py ends the process at once on CheckpointSaveError.
    """
    try:
      yield
    except CheckpointSaveError:
      raise
    except Exception as err:  # pylint: disable=broad-except  (any write error: one line)
      # Worded by cause: a full or read-only folder, a lost peer process (a collective of
      # orbax's failed), or anything else by its type and message.
      raise CheckpointSaveError(failures.line(
          err, self.directory, jax.process_count(),
          what=f"writing a checkpoint in {self.directory}", folder=self.directory)) from err

  def close(self) -> None:
    self._manager.close()

  # Preemption: when a request means "save and stop" (cpjax.runtime.preemption).

  def handling_preemption(self) -> preemption.PreemptionGuard:
    """A context in which SIGTERM and Ctrl-C only request a stop (`reached_preemption`)."""
    return self._preemption

  def reached_preemption(self, step: int) -> bool:
    """Whether the run must save and stop after global `step` (all processes agree)."""
    return self._preemption.should_stop(step)

  def stopping_at_once(self, message: str, step: int) -> contextlib.AbstractContextManager:
    """A context in which a preemption signal raises `preemption.Preempted(message)` at once:
    for work after the checkpoint at global `step` has committed, which a rerun redoes."""
    return self._preemption.stopping_at_once(message, step)

  def stop_preempted(self, step: int, epoch: int, epoch_step: int) -> NoReturn:
    """The one preemption stop: waits for the checkpoint at global `step` (`epoch` complete
    epochs and `epoch_step` steps of the next) to commit, raises Preempted."""
    self.wait_until_finished()
    self._preemption.stop(f"saved a checkpoint at global step {step} (epoch {epoch}, step "
                          f"{epoch_step} of it) in {self.directory}; rerun the same command "
                          "to resume there.", step)

  # Restoring one step.

  def _step_directory(self, step: int) -> str:
    return orbax_layout.step_directory(self.directory, step)

  def _try_step(self, step: int, abstract_state: Any) -> tuple[int, Any]:
    """(_OK, (state, meta, verified)), (_DAMAGED, reason) or (_MISMATCH, error)."""
    try:
      return _OK, self._restore_step(step, abstract_state)
    except checkpoint_integrity.Damaged as err:
      return _DAMAGED, str(err)[:1000]
    except CheckpointMismatchError as err:
      return _MISMATCH, err

  def _restore_step(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any], bool]:
    self._check_step_files(step)
    meta, leaves = self._read_meta(step)
    saved = self._saved_leaves(step)
    if leaves is not None:
      disagree = sorted(set(saved) ^ set(leaves)) + [
          name for name in sorted(set(saved) & set(leaves))
          if list(saved[name][0]) != leaves[name]["shape"]
          or str(saved[name][1]) != leaves[name]["dtype"]]
      if disagree:
        raise checkpoint_integrity.Damaged(
            f"state/_METADATA disagrees with the recorded hashes for {len(disagree)} arrays, "
            f"e.g. {', '.join(disagree[:3])}")
    self._check_fit(step, saved, abstract_state)
    # Restore in the saved dtypes (the hashes are of those), cast to the target's afterwards.
    recast = any(saved[name][1] != np.dtype(leaf.dtype)
                 for name, leaf in checkpoint_integrity.leaves_by_name(abstract_state).items())
    target = abstract_state if not recast else _map_named(lambda name, leaf: jax.ShapeDtypeStruct(
        leaf.shape, saved[name][1], sharding=getattr(leaf, "sharding", None)), abstract_state)
    try:
      state = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target)))["state"]
    except Exception as err:  # pylint: disable=broad-except  (damaged files: any error)
      raise checkpoint_integrity.Damaged(
          f"orbax could not restore it: {failures.describe(err)}") from err
    if leaves is not None:
      actual = {name: checkpoint_integrity.leaf_entry(leaf)
                for name, leaf in checkpoint_integrity.leaves_by_name(state).items()}
      bad = [name for name in sorted(leaves) if actual.get(name) != leaves[name]]
      if bad:
        raise checkpoint_integrity.Damaged(f"content hash mismatch in {len(bad)} arrays, e.g. "
                                f"{', '.join(bad[:3])}")
    if recast:
      state = jax.tree.map(_cast_like, state, abstract_state)
    return state, meta, leaves is not None

  def _check_step_files(self, step: int) -> None:
    """The commit markers and step metadata that orbax writes with every committed step."""
    problem = orbax_layout.step_problem(self._step_directory(step), ITEMS)
    if problem is not None:
      raise checkpoint_integrity.Damaged(problem)

  def _read_meta(self, step: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]] | None]:
    """(meta without the record, the record's leaves or None for an old checkpoint)."""
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
    except Exception as err:  # pylint: disable=broad-except  (damaged files: any error)
      raise checkpoint_integrity.Damaged(
          f"meta/metadata is unreadable ({failures.describe(err)})") from err
    if not isinstance(meta, dict):
      raise checkpoint_integrity.Damaged("meta/metadata is not a JSON object")
    if checkpoint_integrity.INTEGRITY_KEY not in meta:
      return meta, None
    record = meta[checkpoint_integrity.INTEGRITY_KEY]
    leaves = checkpoint_integrity.check_record(record)
    if checkpoint_integrity.meta_digest(meta) != record.get("meta_sha256"):
      raise checkpoint_integrity.Damaged("meta/metadata differs from its recorded hash")
    return checkpoint_integrity.canonical_meta(meta), leaves

  def _saved_leaves(self, step: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{name: (shape, dtype)} from the `state` item metadata; unreadable is damage."""
    try:
      tree = self._manager.item_metadata(step)["state"]
      if tree is None:
        raise ValueError("no metadata")
      named = checkpoint_integrity.leaves_by_name(tree)
      saved = {name: (tuple(int(d) for d in leaf.shape), np.dtype(leaf.dtype))
               for name, leaf in named.items()}
    except Exception as err:  # pylint: disable=broad-except  (damaged files: any error)
      raise checkpoint_integrity.Damaged(
          "the state metadata (state/_METADATA, or the arrays' own in OCDBT) is missing or "
          f"unreadable ({failures.describe(err)})") from err
    if not saved:
      raise checkpoint_integrity.Damaged("state/_METADATA lists no arrays")
    return saved

  def _check_fit(self, step: int, saved: dict[str, tuple[tuple[int, ...], np.dtype]],
                 abstract_state: Any) -> None:
    target = checkpoint_integrity.leaves_by_name(abstract_state)
    problems = [f"{name}: checkpoint {saved[name][0]} vs config {tuple(leaf.shape)}"
                for name, leaf in target.items()
                if name in saved and saved[name][0] != tuple(leaf.shape)]
    problems += [f"{name}: not in the checkpoint" for name in target if name not in saved]
    problems += [f"{name}: in the checkpoint, not in this config"
                 for name in saved if name not in target]
    if problems:
      raise CheckpointMismatchError(
          f"checkpoint {step} in {self.directory} does not fit this config "
          f"({len(problems)} mismatches), e.g.\n  " + "\n  ".join(problems[:5]) +
          "\nUse a fresh --workdir, or the config the checkpoint was trained with.")

  # Moving damaged steps aside.

  def _set_aside(self, step: int, reason: str) -> str | None:
    """Moves step `step` to checkpoints/corrupt/ (process 0) and reloads; returns where."""
    if self.read_only:
      return None
    where, error = None, None
    if jax.process_index() == 0:
      try:
        os.makedirs(self.corrupt_directory, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        where = os.path.join(self.corrupt_directory, f"{step}.{stamp}")
        n = 0
        while os.path.exists(where):
          n += 1
          where = os.path.join(self.corrupt_directory, f"{step}.{stamp}.{n}")
        os.rename(self._step_directory(step), where)
      except OSError as err:
        error = err
      else:
        try:  # Best effort: the note only helps a person looking at it later.
          with open(os.path.join(where, _DAMAGE_NOTE), "w", encoding="utf-8") as f:
            f.write(f"cpjax moved checkpoint {step} aside at {stamp}: {reason}\n")
        except OSError as note_error:  # The move itself worked: say so, and go on.
          logging.warning("Could not write %s into %s (%s); the reason was: %s",
                          _DAMAGE_NOTE, where, note_error, reason)
    # Every process waits for the rename (and learns whether it worked) before re-listing.
    if _agree(_DAMAGED if error else _OK) != _OK:
      raise RuntimeError(f"could not move damaged checkpoint {step} in {self.directory} aside "
                         f"({error!r} on process 0); move or delete "
                         f"{self._step_directory(step)} by hand") from error
    self._manager.reload()
    if step in self._manager.all_steps():
      raise RuntimeError(f"damaged checkpoint {step} is still listed in {self.directory} after "
                         "moving it aside")
    return where or os.path.join(self.corrupt_directory, f"{step}.*")

  def _note_moved_aside(self) -> None:
    if os.path.isdir(self.corrupt_directory) and os.listdir(self.corrupt_directory):
      logging.warning("No checkpoint in %s to resume from (damaged ones were moved to %s).",
                      self.directory, self.corrupt_directory)


def _map_named(fn, tree: Any) -> Any:
  """`tree` with each leaf replaced by fn(dotted name, leaf)."""
  paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return jax.tree_util.tree_unflatten(
      treedef, [fn(checkpoint_integrity.path_name(p), leaf) for p, leaf in paths])


def _cast_like(leaf: Any, target: Any) -> Any:
  """`leaf` in the target's dtype (and sharding), if it was saved in another dtype."""
  if np.dtype(leaf.dtype) == np.dtype(target.dtype):
    return leaf
  cast = leaf.astype(target.dtype)
  sharding = getattr(target, "sharding", None)
  return jax.device_put(cast, sharding) if sharding is not None else cast
