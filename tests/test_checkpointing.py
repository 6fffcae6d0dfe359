"""Checkpointer: hashes, damaged steps moved aside and redone, mismatches, old checkpoints.

Small pytrees of replicated arrays on the 8 forced CPU devices, no training:
each test writes its own checkpoints in a few hundred milliseconds.
"""

import gc
import glob
import json
import logging
import os
import shutil
import signal
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from cpjax.runtime import checkpoint_integrity, checkpointing, orbax_layout, preemption, sharding
from tests.helpers import run_processes

# When orbax's restore of a damaged step fails, tensorstore reads still in flight finish
# after orbax closed its private asyncio loop; their callbacks then raise "Event loop is
# closed" into sys.unraisablehook, and their abandoned read coroutines raise when garbage
# collected (harmless noise, outside cpjax). Only those two are ignored, and the garbage is
# collected here, once after this module's tests (a full collection of the suite's heap takes
# about half a second), not in whichever test of the suite runs next.
pytestmark = [
    pytest.mark.filterwarnings("ignore:(?s)Exception ignored in.*Event loop is closed"
                               ":pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore:(?s)Exception ignored in.*_read_array_index_and_device_put"
                               ":pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(autouse=True, scope="module")
def _collect_abandoned_reads():
  yield
  gc.collect()

MESH = sharding.create_mesh()
# Large enough that orbax writes the arrays to a data file of their own (small ones are
# inlined into the OCDBT b-tree nodes, whose checksums already catch a flipped byte).
W_SHAPE = (300, 100)


def _state(seed: int):
  rng = np.random.default_rng(seed)
  return sharding.replicate(MESH, {
      "params": {"w": rng.standard_normal(W_SHAPE).astype(np.float32),
                 "b": rng.standard_normal(W_SHAPE[1]).astype(np.float32)},
      "step": np.int32(seed),
      "rng": np.array([seed, 7], np.uint32)})


def _meta(seed: int):
  return {"epoch": seed, "step": seed, "config": json.dumps({"seed": seed, "lr": 0.1})}


def _abstract(state, **shape_overrides):
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
  for name, shape in shape_overrides.items():
    old = abstract["params"][name]
    abstract["params"][name] = jax.ShapeDtypeStruct(shape, old.dtype, sharding=old.sharding)
  return abstract


def _assert_state_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.dtype == e.dtype and a.shape == e.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def _checkpoints(workdir):
  return os.path.join(workdir, "checkpoints")


def _save(workdir, *steps, max_to_keep=3):
  checkpointer = checkpointing.Checkpointer(workdir, max_to_keep)
  for step in steps:
    assert checkpointer.save(step, _state(step), _meta(step))
  checkpointer.close()


def _restore(workdir, abstract=None):
  checkpointer = checkpointing.Checkpointer(workdir, 3)
  try:
    return checkpointer.restore_latest(abstract or _abstract(_state(0)))
  finally:
    checkpointer.close()


def _moved_aside(workdir, step):
  return glob.glob(os.path.join(_checkpoints(workdir), "corrupt", f"{step}.*"))


def _data_files(workdir, step):
  """The files under checkpoints/<step>/state/ in OCDBT data folders (`d/`), largest first."""
  files = glob.glob(os.path.join(_checkpoints(workdir), str(step), "state", "**", "d", "*"),
                    recursive=True)
  return sorted(files, key=os.path.getsize, reverse=True)


def _read(path, mode="rb"):
  with open(path, mode) as f:
    return f.read()


def _write(path, data, mode="wb"):
  with open(path, mode) as f:
    f.write(data)


def _flip(path, fraction=0.5):
  data = bytearray(_read(path))
  data[int(len(data) * fraction)] ^= 0xFF
  _write(path, data)


@pytest.fixture(name="saved")
def fixture_saved(tmp_path):
  """A workdir with good checkpoints 10 and 20 (of _state(10) and _state(20))."""
  workdir = str(tmp_path / "saved")
  _save(workdir, 10, 20)
  return workdir


def _assert_fell_back_and_redoes(workdir, caplog, reason):
  """Restores step 10, step 20 moved aside (not deleted); a new save of 20 really happens."""
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    state, meta = _restore(workdir)
  _assert_state_equal(state, _state(10))
  assert meta == _meta(10)
  assert not os.path.exists(os.path.join(_checkpoints(workdir), "20"))
  (moved,) = _moved_aside(workdir, 20)
  assert os.path.isdir(os.path.join(moved, "state"))  # Moved with its files, not deleted.
  assert reason in _read(os.path.join(moved, "CPJAX_DAMAGE.txt"), "r")
  warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert any("Checkpoint 20" in w and moved in w and reason in w and "falling back to checkpoint 10"
             in w for w in warning), warning
  checkpointer = checkpointing.Checkpointer(workdir, 3)
  assert checkpointer.latest_step() == 10
  assert checkpointer.save(20, _state(21), _meta(21))  # The redone step 20, new content.
  checkpointer.wait_until_finished()
  for reader in (checkpointer, None):  # No stale cache of the old step 20 in this process.
    state, meta = reader.restore_latest(_abstract(_state(0))) if reader else _restore(workdir)
    _assert_state_equal(state, _state(21))
    assert meta == _meta(21)
  checkpointer.close()


def test_round_trip_restores_the_newest_with_its_meta_and_records_hashes(saved, caplog):
  with caplog.at_level(logging.WARNING):
    state, meta = _restore(saved)
  _assert_state_equal(state, _state(20))
  assert meta == _meta(20)  # As saved: the hash record stays inside the checkpoint.
  assert not [r for r in caplog.records if r.name != "absl"]
  with open(os.path.join(_checkpoints(saved), "20", "meta", "metadata")) as f:
    record = json.load(f)[checkpoint_integrity.INTEGRITY_KEY]
  assert record == checkpoint_integrity.integrity_record(_state(20), _meta(20))
  assert sorted(record["leaves"]) == ["params.b", "params.w", "rng", "step"]
  assert record["leaves"]["params.w"]["shape"] == list(W_SHAPE)


def test_hash_covers_every_byte_name_shape_and_dtype():
  state, meta = _state(1), _meta(1)
  base = checkpoint_integrity.integrity_record(state, meta)
  assert base == checkpoint_integrity.integrity_record(_state(1), _meta(1))  # Deterministic.
  w = np.asarray(state["params"]["w"]).copy()
  w.reshape(-1).view(np.uint8)[12345] ^= 1
  variants = [
      {**state, "params": {**state["params"], "w": w}},
      {**state, "params": {**state["params"], "w": w.reshape(100, 300)}},
      {**state, "params": {**state["params"], "w": np.asarray(state["params"]["w"]).view(
          np.int32)}},
      {**state, "params": {"v": state["params"]["w"], "b": state["params"]["b"]}},
  ]
  digests = {checkpoint_integrity.integrity_record(v, meta)["state_sha256"] for v in variants}
  assert len(digests) == len(variants) and base["state_sha256"] not in digests
  other_meta = checkpoint_integrity.integrity_record(state, _meta(2))
  assert other_meta["meta_sha256"] != base["meta_sha256"]


def test_flipped_byte_in_any_data_file_never_restores_other_content(saved, caplog):
  """Each data file of step 20 in turn: a flip in one that is read means fallback to 10,
  step 20 moved aside, and a redone save of 20; a flip in one orbax never reads (the
  per-process copies of merged b-tree nodes) restores step 20 intact."""
  files = [os.path.relpath(p, saved) for p in _data_files(saved, 20)]
  assert files and os.path.getsize(os.path.join(saved, files[0])) > np.prod(W_SHAPE)
  fell_back = []
  for i, relative in enumerate(files):
    workdir = os.path.join(os.path.dirname(saved), f"flip{i}")
    shutil.copytree(saved, workdir)
    _flip(os.path.join(workdir, relative))
    state, _ = _restore(workdir)
    if int(state["step"]) == 20:  # Unread file: the hashes confirm every array.
      _assert_state_equal(state, _state(20))
      assert not _moved_aside(workdir, 20)
      continue
    fell_back.append(relative)
    shutil.rmtree(workdir)
    shutil.copytree(saved, workdir)
    _flip(os.path.join(workdir, relative))
    _assert_fell_back_and_redoes(workdir, caplog, "")
  assert files[0] in fell_back  # The arrays' own data file.


@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.5, 0.7, 0.98])
def test_flipped_byte_in_the_array_data_falls_back_and_redoes_the_step(saved, caplog, fraction):
  _flip(_data_files(saved, 20)[0], fraction)
  _assert_fell_back_and_redoes(saved, caplog, "content hash mismatch")


def test_truncated_data_file_falls_back_and_redoes_the_step(saved, caplog):
  path = _data_files(saved, 20)[0]
  data = _read(path)
  _write(path, data[:len(data) // 2])
  _assert_fell_back_and_redoes(saved, caplog, "")


@pytest.mark.parametrize("damage, reason", [
    (lambda d: os.remove(os.path.join(d, "state", "_METADATA")), "state/_METADATA"),
    (lambda d: _flip(os.path.join(d, "state", "_METADATA")), "state/_METADATA"),
    (lambda d: os.remove(os.path.join(d, "_CHECKPOINT_METADATA")), "_CHECKPOINT_METADATA"),
    (lambda d: _flip(os.path.join(d, "_CHECKPOINT_METADATA"), 0.2), "_CHECKPOINT_METADATA"),
    (lambda d: os.remove(os.path.join(d, "meta", "metadata")), "meta/metadata"),
    (lambda d: _write(os.path.join(d, "meta", "metadata"), "{\"epoch\": 20", "w"),
     "meta/metadata"),
    (lambda d: os.remove(os.path.join(d, "commit_success.txt")), "commit marker"),
    (lambda d: os.remove(os.path.join(d, "state", "commit_success.txt")), "commit marker"),
], ids=["rm-state-METADATA", "flip-state-METADATA", "rm-CHECKPOINT_METADATA",
        "flip-CHECKPOINT_METADATA", "rm-meta", "truncated-meta", "rm-commit", "rm-state-commit"])
def test_damaged_or_missing_metadata_is_damage_not_a_mismatch(saved, caplog, damage, reason):
  damage(os.path.join(_checkpoints(saved), "20"))
  _assert_fell_back_and_redoes(saved, caplog, reason)


def test_the_installed_orbax_writes_the_step_layout_cpjax_recognises(saved):
  """orbax_layout names files orbax does not promise: if an orbax release lays a step out
  otherwise, this fails, saying what to update, before a run mistakes every good step for a
  damaged one (and moves it aside)."""
  step_dir = os.path.join(_checkpoints(saved), "20")
  assert orbax_layout.step_directory(_checkpoints(saved), 20) == step_dir
  written = sorted(os.path.relpath(os.path.join(folder, name), step_dir)
                   for folder, _, names in os.walk(step_dir) for name in names)
  missing = [f for f in orbax_layout.expected_files(checkpointing.ITEMS) if f not in written]
  assert not missing, (
      f"orbax-checkpoint {ocp.__version__} wrote a committed step without {missing} (it "
      f"wrote {written}): update COMMIT_MARKER / STEP_METADATA in "
      "cpjax/runtime/orbax_layout.py to its layout; until then every checkpoint looks damaged")
  assert orbax_layout.step_problem(step_dir, checkpointing.ITEMS) is None
  # A step still under orbax's temporary name (a save cut short) is not finalized.
  unfinished = os.path.join(_checkpoints(saved), "30.orbax-checkpoint-tmp-0")
  shutil.copytree(step_dir, unfinished)
  assert orbax_layout.step_problem(unfinished, checkpointing.ITEMS) == (
      "orbax does not consider the step finalized")


def test_edited_meta_fails_its_hash(saved, caplog):
  path = os.path.join(_checkpoints(saved), "20", "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  meta["epoch"] = 19  # Valid JSON, wrong content.
  with open(path, "w") as f:
    json.dump(meta, f)
  _assert_fell_back_and_redoes(saved, caplog, "meta/metadata differs from its recorded hash")


def test_shape_mismatch_is_a_clear_error_and_moves_nothing(saved):
  with pytest.raises(checkpointing.CheckpointMismatchError,
                     match=r"checkpoint 20 .* does not fit this config \(1 mismatches\).*\n  "
                           r"params.w: checkpoint \(300, 100\) vs config \(300, 99\)"):
    _restore(saved, _abstract(_state(0), w=(300, 99)))
  missing = _abstract(_state(0))
  missing["params"]["extra"] = missing["params"]["b"]
  del missing["params"]["b"]
  with pytest.raises(checkpointing.CheckpointMismatchError,
                     match=r"params.extra: not in the checkpoint(.|\n)*params.b: in the "
                           r"checkpoint, not in this config"):
    _restore(saved, missing)
  assert os.path.isdir(os.path.join(_checkpoints(saved), "20"))
  assert not os.path.exists(os.path.join(_checkpoints(saved), "corrupt"))


def test_old_checkpoint_without_hash_restores_with_one_warning(tmp_path, caplog):
  workdir = str(tmp_path)
  manager = ocp.CheckpointManager(  # As the previous version wrote them.
      _checkpoints(workdir), options=ocp.CheckpointManagerOptions(max_to_keep=3, create=True),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})
  manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(5)),
                                          meta=ocp.args.JsonSave(_meta(5))))
  manager.close()
  checkpointer = checkpointing.Checkpointer(workdir, 3)
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      state, meta = checkpointer.restore_latest(_abstract(_state(0)))
      _assert_state_equal(state, _state(5))
      assert meta == _meta(5)
  unverified = [r for r in caplog.records if "unverified" in r.getMessage()]
  assert len(unverified) == 1 and "Checkpoint 5" in unverified[0].getMessage()
  assert checkpointer.save(6, _state(6), _meta(6))  # New saves carry hashes.
  checkpointer.close()
  state, _ = _restore(workdir)
  _assert_state_equal(state, _state(6))


def test_every_checkpoint_damaged_moves_all_aside_and_raises(saved, caplog):
  for step in (10, 20):
    _flip(_data_files(saved, step)[0])
  with pytest.raises(RuntimeError, match=r"every one is damaged \(20 \(content hash.*10 \("
                                         r"content hash.*moved to .*corrupt; a rerun starts"):
    _restore(saved)
  assert _moved_aside(saved, 10) and _moved_aside(saved, 20)
  with caplog.at_level(logging.WARNING):
    assert _restore(saved) is None  # A rerun starts from scratch, and says why.
  assert "damaged ones were moved to" in caplog.text


def test_restore_casts_a_verified_checkpoint_to_the_target_dtype(saved):
  abstract = _abstract(_state(0))
  b = abstract["params"]["b"]
  abstract["params"]["b"] = jax.ShapeDtypeStruct(b.shape, np.float16, sharding=b.sharding)
  state, _ = _restore(saved, abstract)
  assert state["params"]["b"].dtype == np.float16
  assert state["params"]["b"].sharding == b.sharding
  np.testing.assert_array_equal(state["params"]["b"],
                                np.asarray(_state(20)["params"]["b"]).astype(np.float16))


def test_save_of_an_existing_or_older_step(saved):
  checkpointer = checkpointing.Checkpointer(saved, 3)
  assert not checkpointer.save(20, _state(21), _meta(21))  # Exists: kept as it is.
  with pytest.raises(checkpointing.CheckpointSaveError, match="only steps after that"):
    checkpointer.save(15, _state(15), _meta(15))
  with pytest.raises(ValueError, match="reserved"):
    checkpointer.save(30, _state(30), {**_meta(30), checkpoint_integrity.INTEGRITY_KEY: {}})
  checkpointer.close()
  state, _ = _restore(saved)
  _assert_state_equal(state, _state(20))


def test_rotation_keeps_the_last_good_checkpoint_after_a_damaged_newer_one(tmp_path, caplog):
  workdir = str(tmp_path)
  _save(workdir, 10, 20, max_to_keep=2)
  _flip(_data_files(workdir, 20)[0])
  checkpointer = checkpointing.Checkpointer(workdir, 2)
  state, _ = checkpointer.restore_latest(_abstract(_state(0)))
  _assert_state_equal(state, _state(10))
  assert checkpointer.save(20, _state(20), _meta(20))  # The damaged 20 no longer counts...
  checkpointer.wait_until_finished()
  assert checkpointer.save(30, _state(30), _meta(30))  # ...and only a good 10 rotates away.
  checkpointer.close()
  assert sorted(int(name) for name in os.listdir(_checkpoints(workdir))
                if name.isdigit()) == [20, 30]
  assert len(_moved_aside(workdir, 20)) == 1


def test_read_only_skips_damage_without_moving_or_writing(saved, tmp_path, caplog):
  _flip(_data_files(saved, 20)[0])
  reader = checkpointing.Checkpointer(saved, 1000, read_only=True)
  with caplog.at_level(logging.WARNING):
    state, _ = reader.restore_latest(_abstract(_state(0)))
  _assert_state_equal(state, _state(10))
  assert "Checkpoint 20" in caplog.text and "falling back to checkpoint 10" in caplog.text
  assert os.path.isdir(os.path.join(_checkpoints(saved), "20"))
  assert not os.path.exists(os.path.join(_checkpoints(saved), "corrupt"))
  assert reader.latest_meta() == _meta(20)  # Its metadata is intact.
  with pytest.raises(checkpointing.CheckpointSaveError, match="read-only"):
    reader.save(30, _state(30), _meta(30))
  reader.close()
  empty = str(tmp_path / "empty")
  reader = checkpointing.Checkpointer(empty, 1000, read_only=True)
  assert reader.latest_meta() is None and reader.restore_latest(_abstract(_state(0))) is None
  reader.close()
  assert not os.path.exists(empty)


def test_latest_meta_skips_a_step_with_damaged_metadata(saved):
  _write(os.path.join(_checkpoints(saved), "20", "meta", "metadata"), "{", "w")
  checkpointer = checkpointing.Checkpointer(saved, 3)
  assert checkpointer.latest_meta() == _meta(10)
  assert os.path.isdir(os.path.join(_checkpoints(saved), "20"))  # Only read, nothing moved.
  checkpointer.close()


_WORKER = r"""
import json, os, sys
sys.path.insert(0, os.environ["REPO"])
import jax
jax.config.update("jax_num_cpu_devices", 2)
pid, phase, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(os.environ["COORDINATOR"], 2, pid)
import numpy as np
from cpjax.runtime import checkpointing, sharding
mesh = sharding.create_mesh()
assert len(mesh.devices.ravel()) == 4 and jax.process_count() == 2

def state(seed):
  rng = np.random.default_rng(seed)
  return sharding.replicate(mesh, {"w": rng.standard_normal((300, 100)).astype(np.float32),
                                   "step": np.int32(seed)})

def local(tree):
  return {k: np.asarray(v.addressable_data(0)) for k, v in tree.items()}

abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state(0))
checkpointer = checkpointing.Checkpointer(workdir, 3)
out = {}
if phase == "save":
  for step in (10, 20):
    out[step] = checkpointer.save(step, state(step), {"step": step})
else:
  restored, meta = checkpointer.restore_latest(abstract)
  out["restored"] = int(local(restored)["step"])
  out["equal"] = bool(np.array_equal(local(restored)["w"], local(state(10))["w"]))
  out["saved"] = checkpointer.save(20, state(21), {"step": 21})
  checkpointer.wait_until_finished()
  again, meta = checkpointing.Checkpointer(workdir, 3).restore_latest(abstract)
  out["again"] = [int(local(again)["step"]), meta["step"],
                  bool(np.array_equal(local(again)["w"], local(state(21))["w"]))]
checkpointer.close()
print("RESULT " + json.dumps(out), flush=True)
"""


def _two_processes(phase: str, workdir: str) -> list[tuple[dict, str]]:
  return run_processes(_WORKER, [[str(pid), phase, workdir] for pid in range(2)])


@pytest.mark.slow
def test_two_processes_agree_process_0_moves_aside_and_the_step_is_redone(tmp_path):
  workdir = str(tmp_path / "wd")
  assert [r for r, _ in _two_processes("save", workdir)] == [{"10": True, "20": True}] * 2
  _flip(_data_files(workdir, 20)[0])
  results = _two_processes("restore", workdir)
  for result, _ in results:
    assert result == {"restored": 10, "equal": True, "saved": True, "again": [21, 21, True]}
  assert "moved it aside to" in results[0][1] and "Checkpoint 20" in results[1][1]
  assert len(_moved_aside(workdir, 20)) == 1


def test_the_checkpointer_says_when_a_preemption_stops_the_run(tmp_path):
  """Inside `handling_preemption` SIGTERM only requests a stop, which `reached_preemption`
  reports after the step it arrives in; `stop_preempted` raises Preempted naming the signal and
  the checkpoint, `stopping_at_once` with the given step at once; the signal handler is
  restored on exit."""
  checkpointer = checkpointing.Checkpointer(str(tmp_path), 2)
  before = signal.getsignal(signal.SIGTERM)
  try:
    with checkpointer.handling_preemption():
      assert not checkpointer.reached_preemption(3)
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.1)  # Delivered: the process is still here, only a stop is requested.
      assert checkpointer.reached_preemption(4)
      with pytest.raises(preemption.Preempted, match="SIGTERM: saved a checkpoint at global "
                         r"step 4 \(epoch 0, step 4 of it\)"):
        checkpointer.stop_preempted(4, 0, 4)
      with pytest.raises(preemption.Preempted, match="SIGTERM: the report stopped") as raised:
        with checkpointer.stopping_at_once("the report stopped", 9):
          pass
      assert raised.value.step == 9
    assert signal.getsignal(signal.SIGTERM) is before
  finally:
    checkpointer.close()
