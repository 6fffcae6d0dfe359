"""Failures that stop a run end in one FATAL line naming the cause and the way out, and leave
nothing behind but the last good state: checkpoint write errors worded by their cause, the
liveness watch of multi-process runs, atomic writes on a full disk, a workdir turning
read-only mid-run, a missing --config file. docs/reliability.md lists each with its test.
"""

import contextlib
import errno
import os
import re
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from cpjax.data import decode_workers
from cpjax.runtime import (
  checkpointing,
  distributed,
  failures,
  files,
  metric_writers,
  run_logging,
  sharding,
)
from cpjax.training import train
from tests import test_reliability
from tests.helpers import (
  REPO,
  STEPS_PER_EPOCH,
  checkpoint_steps,
  main_command,
  read_metrics,
  restore_checkpoint,
  run_main,
  subprocess_env,
  tiny_config,
)

# A checkpoint-writing error of Gloo (JAX's CPU collectives) when the peer process is gone,
# as the survivor of a SIGKILLed peer logged it.
GLOO_RESET = ("INTERNAL: Gloo all-gather failed: [external/gloo/gloo/transport/tcp/pair.cc:534] "
              "Read error [127.0.0.1]:45831: Connection reset by peer")


def _raised_from(err: Exception, cause: Exception) -> Exception:
  try:
    raise err from cause
  except Exception as raised:  # pylint: disable=broad-except
    return raised


@pytest.fixture
def one_checkpoint(tmp_path):
  """A Checkpointer whose folder holds one committed checkpoint, at step 7."""
  checkpointer = checkpointing.Checkpointer(str(tmp_path), 2)
  state = sharding.replicate(sharding.create_mesh(), {"w": np.arange(6, dtype=np.float32)})
  assert checkpointer.save(7, state, {"epoch": 1, "step": 7})
  checkpointer.wait_until_finished()
  yield checkpointer
  checkpointer.close()


@pytest.mark.parametrize("error, processes, expected", [
    # A full disk, a quota, a read-only remount, a permission: the storage advice.
    (OSError(errno.ENOSPC, "No space left on device", "/ck/7/state/d/0a1"), 1,
     "writing a checkpoint in {d} failed (OSError: [Errno 28] No space left on device: "
     "'/ck/7/state/d/0a1'); make the folder {d} writable (or free space there), then rerun "
     "the same command: it resumes from the last good checkpoint, step 7 in {d}"),
    (OSError(errno.EACCES, "Permission denied", "/ck/x"), 2,
     "writing a checkpoint in {d} failed (PermissionError: [Errno 13] Permission denied: "
     "'/ck/x'); make the folder {d} writable (or free space there), then rerun the same "
     "command: it resumes from the last good checkpoint, step 7 in {d}"),
    (OSError(errno.EROFS, "Read-only file system"), 1,
     "writing a checkpoint in {d} failed (OSError: [Errno 30] Read-only file system); make "
     "the folder {d} writable (or free space there), then rerun the same command: it resumes "
     "from the last good checkpoint, step 7 in {d}"),
    # A storage error that another error was raised from (as orbax re-raises) is still one.
    (_raised_from(RuntimeError("commit failed"),
                  OSError(errno.EDQUOT, "Disk quota exceeded", "/ck/8")), 1,
     "writing a checkpoint in {d} failed (OSError: [Errno 122] Disk quota exceeded: '/ck/8'); "
     "make the folder {d} writable (or free space there), then rerun the same command: it "
     "resumes from the last good checkpoint, step 7 in {d}"),
    # tensorstore (under orbax) reports a full disk in its own exception type, by text.
    (ValueError('Error writing "ocdbt/d/1f": No space left on device'), 1,
     "writing a checkpoint in {d} failed (ValueError: Error writing \"ocdbt/d/1f\": No space "
     "left on device); make the folder {d} writable (or free space there), then rerun the "
     "same command: it resumes from the last good checkpoint, step 7 in {d}"),
    # A lost peer (Gloo's reset) in a 2-process run: a process was lost, and how to resume.
    (RuntimeError(GLOO_RESET), 2,
     "a process of this job (see the other processes' logs for which) was lost "
     f"(RuntimeError: {GLOO_RESET} while writing a checkpoint in {{d}}): killed, out of "
     "memory or its host down; this process stops too. Once every process has ended, rerun "
     "the same command: it resumes from the last good checkpoint, step 7 in {d} (on every "
     "process)"),
    # The same text with one process has no peer to lose: named by type and message.
    (RuntimeError(GLOO_RESET), 1,
     f"writing a checkpoint in {{d}} failed (RuntimeError: {GLOO_RESET}); rerun the same "
     "command: it resumes from the last good checkpoint, step 7 in {d}"),
    (ValueError("unexpected leaf type"), 2,
     "writing a checkpoint in {d} failed (ValueError: unexpected leaf type); rerun the same "
     "command: it resumes from the last good checkpoint, step 7 in {d}"),
])
def test_a_failed_checkpoint_write_is_worded_by_its_cause(one_checkpoint, monkeypatch, error,
                                                          processes, expected):
  """Storage errors (by errno, or tensorstore's text) get "make the folder writable (or
  free space there)"; a lost peer (Gloo's reset) gets the lost-process line, never the
  storage advice; anything else its type and message; each names the last good step."""
  directory = one_checkpoint.directory

  def failing():
    raise error
  monkeypatch.setattr(one_checkpoint._manager, "wait_until_finished", failing)
  with monkeypatch.context() as patch:
    patch.setattr(jax, "process_count", lambda: processes)
    with pytest.raises(checkpointing.CheckpointSaveError) as info:
      one_checkpoint.wait_until_finished()
  assert str(info.value) == expected.format(d=directory)


def test_resume_advice_names_the_newest_committed_step_only(tmp_path):
  """Steps 3 and 9 committed, 12 written but never committed (no commit marker), a file
  and a non-step folder beside them: the advice names 9."""
  checkpointer = checkpointing.Checkpointer(str(tmp_path), 5)
  state = sharding.replicate(sharding.create_mesh(), {"w": np.zeros(3, np.float32)})
  for step in (3, 9):
    checkpointer.save(step, state, {"step": step})
    checkpointer.wait_until_finished()
  checkpointer.close()
  directory = checkpointer.directory
  os.makedirs(os.path.join(directory, "12", "state"))
  os.makedirs(os.path.join(directory, "corrupt"))
  open(os.path.join(directory, "15"), "w").close()
  assert failures.resume_advice(directory) == (
      f"rerun the same command: it resumes from the last good checkpoint, step 9 in "
      f"{directory}")
  empty = str(tmp_path / "none")
  assert failures.resume_advice(empty) == (
      f"rerun the same command: no checkpoint is committed in {empty} yet, so it starts from "
      "the beginning")


def test_an_unwritable_file_outside_checkpoints_names_the_file_and_its_folder(tmp_path):
  err = PermissionError(errno.EPERM, "Operation not permitted", "/w/metrics.jsonl.tmp12")
  directory = str(tmp_path / "checkpoints")
  assert failures.line(err, directory, 1) == (
      "writing /w/metrics.jsonl.tmp12 failed (PermissionError: [Errno 1] Operation not "
      "permitted: '/w/metrics.jsonl.tmp12'); make the folder /w writable (or free space "
      f"there), then rerun the same command: no checkpoint is committed in {directory} yet, "
      "so it starts from the beginning")
  assert failures.cause(ValueError("a bug"), 2) == failures.OTHER


def _shared_memory_full(monkeypatch) -> decode_workers.SharedMemoryFullError:
  """The host stage's error for a /dev/shm too small for its slots, as it raises it: from
  the ENOSPC of the pages' reservation (os.posix_fallocate) beneath."""
  def full(fd, offset, length):
    raise OSError(errno.ENOSPC, "No space left on device")
  with monkeypatch.context() as patch:
    patch.setattr(os, "posix_fallocate", full)
    with pytest.raises(decode_workers.SharedMemoryFullError) as raised:
      decode_workers.Slots(2, (64, 32, 32, 3))
  return raised.value


def test_a_full_dev_shm_is_named_by_the_host_stages_advice_not_as_a_full_folder(
    tmp_path, monkeypatch):
  """The ENOSPC beneath the host stage's error is its detail, not the cause to name: the
  line is the host stage's own (sizes, --shm-size, worker_kind=thread), raised alone or
  from inside another error, and names no folder to make writable."""
  full = _shared_memory_full(monkeypatch)
  assert isinstance(full.__cause__, OSError) and full.__cause__.errno == errno.ENOSPC
  checkpoints = str(tmp_path / "checkpoints")
  advice = (f"rerun the same command: no checkpoint is committed in {checkpoints} yet, so it "
            "starts from the beginning")
  for err in (full, _raised_from(RuntimeError("batch 3 of the pass failed"), full)):
    line = failures.line(err, checkpoints, 1)
    assert line == f"{full}; {advice}", line
    assert "--shm-size" in line and "worker_kind=thread" in line and "MiB" in line
    assert "writable" not in line and failures.cause(err, 1) != failures.STORAGE


# A full disk under the TensorBoard events file, as clu's writer reported it on a 64 KiB
# tmpfs (TensorFlow's flush error, re-raised by clu's asynchronous pool): no errno, no
# filename, the path in the text.
TF_EVENTS_FULL = ("{{{{function_node __wrapped__FlushSummaryWriter_device_/job:localhost/"
                  "replica:0/task:0/device:CPU:0}}}} {path}; No space left on device\n\tFailed "
                  "to flush 1 events to {path}\n\tCould not flush events file. "
                  "[Op:FlushSummaryWriter] name: ")


def test_a_full_disk_under_the_events_file_names_the_workdir_not_the_checkpoints(tmp_path):
  """Writing the events file in the workdir fails: the line names that file and its folder
  (the workdir), whether the path comes as the OSError's filename or only in the text of
  another error type; an ENOSPC that names no file names the workdir too, never the
  checkpoint folder it is not about."""
  workdir = str(tmp_path)
  checkpoints = os.path.join(workdir, "checkpoints")
  events = os.path.join(workdir, "events.out.tfevents.1795760815.vm.11122.0.v2")
  text = TF_EVENTS_FULL.format(path=events)
  advice = (f"make the folder {workdir} writable (or free space there), then rerun the same "
            f"command: no checkpoint is committed in {checkpoints} yet, so it starts from the "
            "beginning")
  from_text = _raised_from(RuntimeError(f"Error '{text}' occurred ASYNCHRONOUSLY."),
                           ValueError(text))
  first_line = text.split("\n")[0]
  assert failures.line(from_text, checkpoints, 1) == (
      f"writing the TensorBoard events file {events} failed (RuntimeError: Error "
      f"'{first_line}); {advice}")
  named = OSError(errno.ENOSPC, "No space left on device", events)
  assert failures.line(named, checkpoints, 1) == (
      f"writing the TensorBoard events file {events} failed (OSError: [Errno 28] No space "
      f"left on device: '{events}'); {advice}")
  bare = OSError(errno.ENOSPC, "No space left on device")  # A write() names no file.
  assert failures.line(bare, checkpoints, 1) == (
      "writing the run's files failed (OSError: [Errno 28] No space left on device); "
      f"{advice}")


def test_a_full_disk_met_first_by_the_events_file_is_named_by_that_file(tmp_path,
                                                                        monkeypatch, caplog):
  """The disk fills while the first checkpoint commits: the events file's next write is
  refused first (ENOSPC), in the second epoch, and then that checkpoint's commit, which the
  loop waits for on its way out. The run stops on the failure it met first: the line names
  the events file and the folder to free (the workdir), not the checkpoint folder; the
  commit's failure is logged as its detail."""
  workdir = str(tmp_path)
  full = threading.Event()
  real_save, real_write = checkpointing.Checkpointer.save, metric_writers.RecordWriter.write
  real_wait = checkpointing.Checkpointer.wait_until_finished

  def save(self, *args, **kwargs):
    saved = real_save(self, *args, **kwargs)
    full.set()  # From here on the disk is full.
    return saved

  def write(self, data):
    if full.is_set():
      raise OSError(errno.ENOSPC, "No space left on device")
    real_write(self, data)

  def refused_commit(self):
    real_wait(self)  # orbax's threads end (the step commits: the advice names it).
    with self._write_errors():  # pylint: disable=protected-access  As orbax's would.
      raise OSError(errno.ENOSPC, "No space left on device",
                    os.path.join(self.directory, "20.orbax-checkpoint-tmp", "state"))
  monkeypatch.setattr(checkpointing.Checkpointer, "save", save)
  monkeypatch.setattr(metric_writers.RecordWriter, "write", write)
  monkeypatch.setattr(checkpointing.Checkpointer, "wait_until_finished", refused_commit)
  with pytest.raises(OSError) as raised:
    train.train_and_evaluate(tiny_config(), workdir)
  events = raised.value.filename
  assert os.path.dirname(events) == workdir and failures.EVENTS_MARK in events
  checkpoints = os.path.join(workdir, "checkpoints")
  assert failures.line(raised.value, checkpoints, 1) == (
      f"writing the TensorBoard events file {events} failed (OSError: [Errno 28] writing "
      f"TensorBoard events: No space left on device: '{events}'); make the folder {workdir} "
      "writable (or free space there), then rerun the same command: it resumes from the "
      f"last good checkpoint, step {STEPS_PER_EPOCH} in {checkpoints}")
  detail = [r.getMessage() for r in caplog.records if "failed too" in r.getMessage()]
  assert len(detail) == 1 and f"writing a checkpoint in {checkpoints} failed" in detail[0]


def test_the_events_file_on_a_real_full_file_system_names_its_folder(tmp_path):
  """The run's TensorBoard writer in a 64 KiB tmpfs, written until the disk is full: the
  error it raises is named as the workdir's, not as the checkpoint folder's."""
  folder = str(tmp_path / "tiny")
  _mount_tiny_tmpfs(folder, 64)
  writer = None
  try:
    writer = run_logging.create_writer(folder)
    with pytest.raises(Exception) as raised:  # pylint: disable=broad-except  Any writer's.
      for step in range(10_000):
        writer.write_scalars(step, {f"metric_{i}": float(step) for i in range(50)})
        writer.flush()
    checkpoints = os.path.join(folder, "checkpoints")
    line = failures.line(raised.value, checkpoints, 1)
    assert failures.cause(raised.value, 1) == failures.STORAGE, line
    assert f"make the folder {folder} writable (or free space there)" in line, line
    assert f"{checkpoints} writable" not in line
  finally:
    if writer is not None:
      with contextlib.suppress(Exception):  # pylint: disable=broad-except  Its files closed.
        writer.close()
    subprocess.run(["umount", folder], check=True)


# The liveness watch of multi-process runs.


class _Store:
  """A stand-in for the coordination service's key-value store (full keys, as it lists)."""

  def __init__(self):
    self.values, self.down = {}, False

  def key_value_set(self, key, value, allow_overwrite=False):
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
    assert allow_overwrite or key not in self.values
    self.values[key] = value

  def key_value_dir_get(self, prefix):
    if self.down:
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
    return [(k, v) for k, v in sorted(self.values.items()) if k.startswith(prefix)]


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def _watch(store, clock, processes=3, timeout=5.0):
  return distributed.LivenessWatch(store, 0, processes, timeout, lambda *a: None,
                                   interval_s=1.0, clock=clock)


def test_the_watch_declares_a_silent_process_lost_after_the_timeout_by_hand():
  """Process 0 of 3 checks at t = 1, 2, ...; process 1 beats every second, process 2 stops
  after its beat at t = 3. Its counter was last seen to change at t = 3, so with a 5 s
  timeout it is lost at the first check later than t = 8: t = 9, and not before."""
  store, clock = _Store(), _Clock()
  watch = _watch(store, clock)
  for t in range(1, 12):
    clock.now = float(t)
    store.key_value_set("cpjax/alive/1", str(t), allow_overwrite=True)
    if t <= 3:
      store.key_value_set("cpjax/alive/2", str(t), allow_overwrite=True)
    verdict = watch.check()
    if t < 9:
      assert verdict is None, t
    else:
      assert verdict == ("process 2 of 3", "no heartbeat for 5 s"), t
      break
  assert store.values["cpjax/alive/0"] == "9"  # Its own counter: one beat per check.


def test_a_finished_process_is_never_lost_and_a_dead_coordinator_is():
  store, clock = _Store(), _Clock()
  watch = _watch(store, clock, processes=2)
  clock.now = 1.0
  store.key_value_set("cpjax/alive/1", "1")
  store.key_value_set("cpjax/done/1", "1")  # It finished: its silence is no loss.
  for t in range(2, 30):
    clock.now = float(t)
    assert watch.check() is None
  # The store stops answering at t = 31 (process 0 hosts it: gone); the last answer was at
  # t = 30, so the verdict comes at the first check more than 5 s later, t = 36.
  clock.now = 30.0
  assert watch.check() is None
  store.down = True
  for t in range(31, 40):
    clock.now = float(t)
    verdict = watch.check()
    if t < 36:
      assert verdict is None, t
    else:
      assert verdict[0] == "process 0 of 2 (it hosts the coordination service)"
      assert verdict[1] == ("the coordination service has not answered for 6 s: RuntimeError: "
                            "UNAVAILABLE: failed to connect to all addresses")
      break


def test_the_watch_thread_calls_on_lost_once_and_finish_stops_it():
  store, lost = _Store(), []
  called = threading.Event()

  def on_lost(which, detail):
    lost.append((which, detail))
    called.set()
  watch = distributed.LivenessWatch(store, 0, 2, 0.3, on_lost, interval_s=0.05)
  start = time.monotonic()
  watch.start()
  assert called.wait(10)
  watch.join(5)
  assert not watch.is_alive() and lost == [("process 1 of 2", "no heartbeat for 0.3 s")]
  assert time.monotonic() - start >= 0.3
  # A process that finishes says so and stops beating, without a verdict.
  quiet = distributed.LivenessWatch(store, 1, 2, 60, on_lost, interval_s=0.05)
  quiet.start()
  quiet.finish()
  quiet.join(5)
  assert not quiet.is_alive() and store.values["cpjax/done/1"] == "1" and len(lost) == 1


def test_jax_heartbeat_is_a_backstop_later_than_the_watch():
  """JAX declares a process dead as early as half its timeout after the death (it beats
  every half timeout): that must still come after the watch's timeout, with room."""
  for timeout in (1, 10, 30, 100, 1000):
    assert distributed.jax_heartbeat_timeout(timeout) / 2 >= timeout + 10


# Atomic writes on a full disk.


def _full_disk_writer(written: bytes):
  """Content for atomic_write that writes `written`, then fails as a full disk does."""
  def write(f):
    f.write(written)
    raise OSError(errno.ENOSPC, "No space left on device")
  return write


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  files.atomic_write(path, "old\n")
  for written in (b"", b"partial"):  # 0 bytes (the reported case) or some.
    with pytest.raises(OSError, match="No space left"):
      files.atomic_write(path, _full_disk_writer(written))
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
    with open(path) as f:
      assert f.read() == "old\n"


def test_stale_temporaries_are_removed_by_their_exact_name_only(tmp_path):
  """What a kill mid-write leaves (metrics.jsonl.tmp<pid>) goes at start-up; nothing else
  does, not even near misses of the name."""
  kept = ["metrics.jsonl", "metrics.jsonl.tmp", "metrics.jsonl.tmp12a", "metrics.jsonl.tmp-3",
          "other.jsonl.tmp55", "xmetrics.jsonl.tmp66", "metrics.jsonl.tmp77.bak"]
  stale = ["metrics.jsonl.tmp123", "metrics.jsonl.tmp4567890"]
  for name in kept + stale:
    with open(tmp_path / name, "w") as f:
      f.write("" if "tmp" in name else '{"epoch": 0, "train_loss": 1.5}\n')
  os.makedirs(tmp_path / "metrics.jsonl.tmp999")  # A folder of that name is not ours.
  run_logging.EpochLog(str(tmp_path)).keep_epochs_before(1)
  assert sorted(os.listdir(tmp_path)) == sorted(kept + ["metrics.jsonl.tmp999"])
  assert read_metrics(str(tmp_path)) == [{"epoch": 0, "train_loss": 1.5}]


@pytest.mark.parametrize("num_bytes, text", [
    (0, "0 bytes"), (1, "1 byte"), (1023, "1023 bytes"), (1024, "1.0 KiB"),
    (104857, "102.4 KiB"), (104858, "0.1 MiB"), (3 * 2**20, "3.0 MiB")])
def test_sizes_in_messages_are_in_the_unit_that_shows_them(num_bytes, text):
  """0.1 MiB = 104,857.6 bytes: below it KiB (a full disk's "0.0 MiB free" was untrue)."""
  assert files.size_text(num_bytes) == text


def _mount_tiny_tmpfs(folder: str, kib: int, files: int | None = None) -> None:
  """A tmpfs of `kib` KiB at `folder` (and room for `files` files and folders, itself
  included, where set)."""
  os.makedirs(folder)
  options = f"size={kib}k" + ("" if files is None else f",nr_inodes={files}")
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", folder],
                          capture_output=True, text=True)
  if result.returncode != 0:
    pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): "
                f"{result.stderr.strip()}")


def test_metrics_on_a_real_full_file_system_leave_no_temporary(tmp_path):
  """A 64 KiB tmpfs: one epoch's record written, then the disk filled; the next record's
  write fails with ENOSPC, leaving the first record and no temporary. Space freed, the
  rerun writes the record; the folder holds metrics.jsonl alone."""
  folder = str(tmp_path / "tiny")
  _mount_tiny_tmpfs(folder, 64)
  try:
    log = run_logging.EpochLog(folder)
    log.keep_epochs_before(0)
    first = {"epoch": 0, "train_loss": 2.25}
    log.write(first)
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
    try:  # Fill it to the last block.
      while True:
        os.write(fd, b"\0" * 4096)
    except OSError as err:
      assert err.errno == errno.ENOSPC
    finally:
      os.close(fd)
    second = {"epoch": 1, "train_loss": 1.75, "note": "x" * 5000}  # Needs new blocks.
    with pytest.raises(OSError) as info:
      log.write(second)
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(folder)) == ["filler", "metrics.jsonl"]
    assert read_metrics(folder) == [first]
    os.remove(os.path.join(folder, "filler"))
    rerun = run_logging.EpochLog(folder)
    rerun.keep_epochs_before(1)
    rerun.write(second)
    assert sorted(os.listdir(folder)) == ["metrics.jsonl"]
    assert read_metrics(folder) == [first, second]
  finally:
    subprocess.run(["umount", folder], check=True)


@pytest.mark.slow
def test_a_full_disk_mid_run_leaves_no_temporary_after_the_rerun(tmp_path, monkeypatch):
  """configs/test.py, 3 epochs: metrics.jsonl's write after epoch 1 fails with ENOSPC (the file
  system fills). No 0-byte metrics.jsonl.tmp* is left; the last good checkpoint (epoch 0)
  is intact. A temporary that a kill mid-write would leave is removed by the rerun, which
  finishes the run: the workdir then holds metrics.jsonl and no temporary."""
  workdir, config = str(tmp_path), tiny_config(num_epochs=3)
  real = files.atomic_write
  metrics_writes = []

  def filling(path, content):
    if path.endswith("metrics.jsonl"):
      metrics_writes.append(path)
      if len(metrics_writes) == 2:  # Epoch 1's record.
        return real(path, _full_disk_writer(b""))
    return real(path, content)
  monkeypatch.setattr(files, "atomic_write", filling)
  with pytest.raises(OSError, match="No space left on device"):
    train.train_and_evaluate(config, workdir)
  monkeypatch.setattr(files, "atomic_write", real)
  assert not [n for n in os.listdir(workdir) if ".tmp" in n]
  assert checkpoint_steps(workdir) == [STEPS_PER_EPOCH]
  assert int(restore_checkpoint(workdir)["train"]["step"]) == STEPS_PER_EPOCH
  open(os.path.join(workdir, "metrics.jsonl.tmp4242"), "w").close()  # As a kill leaves it.
  train.train_and_evaluate(config, workdir)
  assert not [n for n in os.listdir(workdir) if ".tmp" in n]
  assert [r["epoch"] for r in read_metrics(workdir)] == [0, 1, 2]


# A workdir turning read-only mid-run, and a missing --config file (main.py, as users run it).


@pytest.mark.slow
def test_a_workdir_turning_read_only_mid_run_ends_in_one_fatal_line(tmp_path):
  """The workdir refuses new files once the first checkpoint is committed (as root: the
  immutable attribute, since chmod does not stop root). The next write there (metrics.jsonl's
  after the next epoch; on a loaded machine the run may be further on, up to the report's
  folder) fails with PermissionError; the run ends without a traceback, in one FATAL line
  naming the file, the folder to make writable and the last good checkpoint (the newest
  committed one on disk), exit status 1, and that checkpoint intact."""
  workdir = str(tmp_path / "run")
  log = str(tmp_path / "stderr.log")
  with open(log, "w") as stderr_file:
    proc = subprocess.Popen(main_command(workdir, "--config.num_epochs=6"), cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=stderr_file)
  committed = os.path.join(workdir, "checkpoints", str(STEPS_PER_EPOCH), "commit_success.txt")
  deadline = time.monotonic() + 240
  while not os.path.exists(committed) and time.monotonic() < deadline:
    assert proc.poll() is None, open(log).read()[-3000:]
    time.sleep(0.02)
  try:
    undo = test_reliability._make_unwritable(workdir)  # pylint: disable=protected-access
  except BaseException:
    proc.kill()
    proc.wait()
    raise
  try:
    proc.wait(timeout=180)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    subprocess.run(undo.split(), check=True)
  with open(log) as f:
    stderr = f.read()
  assert proc.returncode == 1, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  fatal = [line for line in stderr.splitlines() if line.startswith("FATAL")]
  assert len(fatal) == 1 and stderr.strip().splitlines()[-1] == fatal[0], stderr[-3000:]
  steps = checkpoint_steps(workdir)
  last, checkpoints = steps[-1], os.path.join(workdir, "checkpoints")
  assert re.fullmatch(
      rf"FATAL writing {workdir}/(metrics\.jsonl\.tmp\d+|report) failed \((PermissionError|"
      rf"OSError): .*\); make the folder {workdir} writable \(or free space there\), then "
      rf"rerun the same command: it resumes from the last good checkpoint, step {last} in "
      rf"{checkpoints}", fatal[0]), fatal[0]
  assert int(restore_checkpoint(workdir)["train"]["step"]) == last  # Intact: it restores.
  epochs = [r["epoch"] for r in read_metrics(workdir)]
  assert epochs == list(range(len(epochs))) and 1 <= len(epochs) <= last // STEPS_PER_EPOCH
  assert not [n for n in os.listdir(workdir) if ".tmp" in n]


@pytest.mark.slow  # Two main.py processes.
def test_a_missing_config_file_is_one_line_and_exit_status_2(tmp_path):
  """As an unknown field is: one line naming the file and the configs there are, exit 2
  (a usage error), no traceback, no workdir."""
  workdir = str(tmp_path / "run")
  missing = str(tmp_path / "configs" / "nosuch.py")
  result = subprocess.run(main_command(workdir)[:2] + [f"--config={missing}:arg",
                                                        f"--workdir={workdir}"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr[-3000:]
  configs = sorted(n for n in os.listdir(os.path.join(REPO, "configs"))
                   if n.endswith(".py") and n != "__init__.py")
  assert lines[0] == (f"FATAL --config file {missing!r} does not exist (or is not a file); the "
                      f"configs in {REPO}/configs: {', '.join(configs)}")
  assert "test.py" in configs and not os.path.exists(workdir)
  # An existing file is not affected: the same command with configs/test.py and a bad field
  # still fails on the field (exit 2), not on the file.
  result = run_main(workdir, "--config.no_such_field=1", timeout=120)
  assert result.returncode == 2 and "no_such_field" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow  # A main.py process.
def test_main_without_flags_is_one_line_naming_the_required_flags(tmp_path):
  """`python main.py` alone, as a new user first types it: one line naming --config and
  --workdir with a command that sets them, exit 2 (a usage error), no traceback, and no
  absl usage text."""
  result = subprocess.run(main_command(str(tmp_path))[:2], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip().splitlines() == [
      "FATAL --config and --workdir are required: python main.py --config=configs/default.py "
      "--workdir=DIR (any file of configs/, any folder for the run's checkpoints, logs and "
      "report)"], result.stderr[-3000:]
  assert not result.stdout


def test_only_completions_into_a_closed_event_loop_are_kept_off_stderr():
  """main.py's unraisable-exception hook: "Event loop is closed" (tensorstore's completions of
  a refused save's writes, as a full disk gives them under load) goes to the debug log; any
  other unraisable exception is printed as Python prints it."""
  script = (
      "import sys\n"
      "import main\n"
      "sys.unraisablehook = main._quiet_closed_loop_callbacks  # pylint: disable=protected-access\n"
      "class Completion:\n"
      "  def __init__(self, message):\n"
      "    self.message = message\n"
      "  def __del__(self):\n"
      "    raise RuntimeError(self.message)\n"
      "Completion('Event loop is closed')\n"
      "Completion('another error')\n"
      "print('done')\n")
  result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0 and result.stdout == "done\n", result.stderr[-3000:]
  assert "RuntimeError: another error" in result.stderr, result.stderr[-3000:]
  assert "Event loop is closed" not in result.stderr, result.stderr[-3000:]


@pytest.mark.slow  # A main.py process on a mounted tmpfs.
def test_a_full_disk_before_the_first_checkpoint_ends_in_the_fatal_line_alone(tmp_path):
  """The workdir on a tmpfs with room for 20 files (4 MiB of bytes): the lock, the events
  file, metrics.jsonl and the checkpoints folder, then some of orbax's files of the first
  checkpoint; its next file is refused (ENOSPC), in orbax's writing threads, while
  tensorstore still completes the save's other writes. Files, not
  bytes, run out: the events file's flushes, whose timing races the checkpoint's writes,
  need bytes only, so the checkpoint is always the write refused. orbax's threads each log
  the refused write with a traceback, and tensorstore's completions into orbax's closed
  event loop raise where no caller catches them; the run ends with its FATAL line alone
  (exit 1): no traceback, no error line of orbax's before it, nothing after it, and no
  checkpoint committed."""
  workdir = str(tmp_path / "tiny")
  _mount_tiny_tmpfs(workdir, 4096, files=20)
  try:
    result = run_main(workdir, "--config.num_epochs=1", timeout=300)
    checkpoints = os.path.join(workdir, "checkpoints")
    left = sorted(os.listdir(checkpoints)) if os.path.isdir(checkpoints) else []
  finally:
    subprocess.run(["umount", workdir], check=True)
  assert result.returncode == 1, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  fatal = [line for line in lines if line.startswith("FATAL")]
  assert len(fatal) == 1 and lines[-1] == fatal[0], result.stderr[-3000:]
  # The error it names is orbax's first: the refused file ("No space left on device") or,
  # as a loaded machine orders the writing threads, a write into a folder that refusal left
  # uncreated.
  assert fatal[0].startswith(f"FATAL writing a checkpoint in {checkpoints} failed ("), fatal
  assert "no checkpoint is committed" in fatal[0], fatal
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  assert not [line for line in lines if line.startswith("E")], result.stderr[-3000:]
  # orbax began the first checkpoint and the full disk stopped it (its temporary folder
  # stays, uncommitted): the case whose tracebacks are kept out.
  assert left and all(name.endswith(".orbax-checkpoint-tmp") for name in left), left
