"""Faults a cluster run meets: preemption (SIGTERM) in 1 and 2 processes, divergence, a second
run on the same workdir, a damaged metrics.jsonl, bad overrides (SIGKILL: test_train.py;
damaged checkpoints: test_checkpointing.py).

Each preemption test compares a run interrupted by SIGTERM mid-epoch and rerun
with the same command against the same run uninterrupted: every non-timing
field of metrics.jsonl must be equal (bit for bit on CPU).
"""

import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from cpjax.config import schema
from cpjax.runtime import checkpointing, preemption, run_logging, workdir_lock
from cpjax.selection import score_files
from cpjax.training import setup, train
from tests.helpers import (
  REPO,
  SELECTED_FLAGS,
  STEPS_PER_EPOCH,
  main_command,
  read_metrics,
  restore_checkpoint,
  subprocess_env,
  tiny_config,
  without_timing,
)

pytest_plugins = ("tests.trained_runs",)  # The shared trained runs.


def _read(path: str) -> str:
  if not os.path.exists(path):
    return ""
  with open(path) as f:
    return f.read()


def _wait_for(path: str, pattern: str, procs, timeout: float = 240) -> None:
  """Polls a log file until `pattern` appears (or a process dies, or `timeout`)."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if pattern in _read(path):
      return
    if any(p.poll() is not None for p in procs):
      raise AssertionError(f"a process ended before {pattern!r}: {_read(path)[-2000:]}")
    time.sleep(0.05)
  raise AssertionError(f"{pattern!r} not seen in {path} within {timeout} s")


def _saved_step(log: str) -> int:
  match = re.search(r"SIGTERM: saved a checkpoint at global step (\d+)", log)
  assert match, log[-3000:]
  return int(match.group(1))


def test_sigterm_mid_epoch_saves_exits_75_and_resumes_exactly(selected_run, tmp_path):
  """One process: SIGTERM in a selected epoch -> checkpoint at that step, exit 75; the rerun
  ends bit for bit as the uninterrupted run of the same config on the same 8 devices
  (tests/trained_runs.py's `selected_run`)."""
  workdir, log = str(tmp_path / "preempted"), str(tmp_path / "first.log")
  with open(log, "w") as stderr:
    proc = subprocess.Popen(main_command(workdir, *SELECTED_FLAGS), cwd=REPO,
                            env=subprocess_env(8),
                            stdout=subprocess.DEVNULL, stderr=stderr)
    # Epoch 1 (a selected one) of 3: epoch 2 leaves time for the signal to arrive.
    _wait_for(log, f"[{STEPS_PER_EPOCH + 5}] train/", [proc])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE
  first = _read(log)
  step = _saved_step(first)
  assert step % STEPS_PER_EPOCH != 0, "the stop should fall inside an epoch"
  assert first.count("saved a checkpoint") == 1
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))
  rerun = subprocess.run(main_command(workdir, *SELECTED_FLAGS), cwd=REPO,
                         env=subprocess_env(8),
                         capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"Resumed from {workdir}/checkpoints at global step {step}" in rerun.stderr
  assert without_timing(read_metrics(workdir)) == without_timing(
      read_metrics(selected_run.workdir))


def _port_free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


FAKE_SLURM = os.path.join(REPO, "tests", "fake_slurm")  # srun and scontrol stand-ins.
SBATCH = os.path.join(REPO, "scripts", "slurm", "train.sbatch")


def _coordinator_ports(count: int) -> list[int]:
  """`count` free ports where JAX's SLURM detection puts the coordinator (61440 + job id)."""
  start = 61440 + os.getpid() % 4000
  return [p for p in range(start, 65536) if _port_free(p)][:count]


def _slurm_env(tmp_path, tag: str, port: int) -> dict[str, str]:
  """The variables SLURM gives a 2-task job step, faked for 127.0.0.1 (jax.distributed reads
  them: JAX's SLURM detection takes the coordinator from the node list and the job id).
  Each task sees 4 CPU devices: 8 in all, as in the test process."""
  env = subprocess_env(4)
  return {**env, "PATH": f"{FAKE_SLURM}:{env['PATH']}",
          "SLURM_JOB_ID": str(port - 61440), "SLURM_STEP_NODELIST": "127.0.0.1",
          "SLURM_NTASKS": "2", "SLURM_SUBMIT_DIR": REPO,
          "FAKE_SLURM_LOG": str(tmp_path / f"{tag}_task"),
          "FAKE_SLURM_PIDS": str(tmp_path / f"{tag}_pids"),
          "FAKE_SLURM_CALLS": str(tmp_path / "scontrol_calls")}


def _sbatch(tmp_path, tag: str, workdir: str, port: int) -> subprocess.Popen:
  """Runs scripts/slurm/train.sbatch as SLURM would run the batch script of a 2-task job,
  on helpers.SELECTED_FLAGS (the config of the shared `selected_run`), with the host reader:
  each process gathers its half of every batch in host memory (`selected_run`, one process,
  reads on device)."""
  return subprocess.Popen(["bash", SBATCH, "configs/test.py", workdir, *SELECTED_FLAGS,
                           "--config.log_every_steps=1", "--config.dataset.reader=host"],
                          cwd=REPO, env=_slurm_env(tmp_path, tag, port),
                          start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _assert_like_one_process(one: str, two: str, train_ids: np.ndarray) -> None:
  """A 2-process run (2 x 4 devices) computes what the 1-process run (8 devices) computes, up
  to the order in which cross-process gradient sums add."""
  for epoch in range(3):
    a, b = (np.load(score_files.score_path(d, epoch))[train_ids] for d in (one, two))
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))  # The same ids were trained.
    np.testing.assert_allclose(a, b, atol=1e-4)
  # ~40 SGD steps grow the float32 rounding differences of the reordered sums to ~5e-4 in
  # weights of size ~0.1 (measured).
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-3, atol=2e-3),
               restore_checkpoint(one)["train"]["params"],
               restore_checkpoint(two)["train"]["params"])


def test_slurm_job_preempted_on_one_task_requeues_and_resumes_exactly(selected_run, digits,
                                                                     tmp_path):
  """The SLURM batch script on 2 tasks over 127.0.0.1. Uninterrupted, the job computes what
  one process computes (`selected_run`). SIGTERM to task 0 only: both tasks agree on one
  step, save, exit 75; the script requeues; the requeued job ends with the metrics of the
  uninterrupted job, bit for bit."""
  # The uninterrupted and the preempted job run side by side (two jobs, two coordinators).
  straight_port, port = _coordinator_ports(2)
  straight = str(tmp_path / "straight")
  straight_job = _sbatch(tmp_path, "straight", straight, straight_port)
  try:
    _preempt_requeue_and_compare(tmp_path, port, straight_job, straight)
  finally:  # A failure above must not leave the other job's tasks running.
    if straight_job.poll() is None:
      os.killpg(straight_job.pid, signal.SIGKILL)
  _assert_like_one_process(selected_run.workdir, straight, digits["train"].ids)


def _preempt_requeue_and_compare(tmp_path, port: int, straight_job: subprocess.Popen,
                                 straight: str) -> None:
  workdir = str(tmp_path / "preempted")
  job = _sbatch(tmp_path, "first", workdir, port)
  # Early in epoch 0: the tasks agree on a stop step some steps after the signal (a round
  # trip through the coordination service), which must come before the run's last step.
  _wait_for(str(tmp_path / "first_task0.log"), "[5] train/", [job])
  task_pids = [int(p) for p in _read(str(tmp_path / "first_pids")).split()]
  os.kill(task_pids[0], signal.SIGTERM)
  assert job.wait(timeout=120) == preemption.EXIT_CODE
  steps = [_saved_step(_read(str(tmp_path / f"first_task{i}.log"))) for i in range(2)]
  assert steps[0] == steps[1]  # JAX's preemption sync point: one step for every process.
  assert "JAX process 1 / 2" in _read(str(tmp_path / "first_task1.log"))
  calls = _read(str(tmp_path / "scontrol_calls")).split("\n")
  assert calls[0].startswith("scontrol requeue ")
  assert _sbatch(tmp_path, "requeued", workdir, port).wait(timeout=300) == 0
  assert f"global step {steps[0]}" in _read(str(tmp_path / "requeued_task0.log"))
  assert straight_job.wait(timeout=300) == 0
  assert without_timing(read_metrics(workdir)) == without_timing(read_metrics(straight))


@pytest.mark.slow
def test_divergence_stops_without_saving_and_keeps_the_last_good_checkpoint(tmp_path):
  """lr=100 after a good epoch: the run stops on a non-finite loss or logits, names the last
  checkpoint it saved, which holds finite parameters and survives rotation
  (keep_checkpoints=1); no number in metrics.jsonl is NaN; a sane rerun resumes from it."""
  workdir = str(tmp_path)
  train.train_and_evaluate(tiny_config(**{"num_epochs": 1, "keep_checkpoints": 1}), workdir)
  assert checkpointing.Checkpointer(workdir, 1).latest_step() == STEPS_PER_EPOCH
  # A diverging run: lr=100 (its loss passes 1e9 in the first epoch and turns non-finite in
  # the second; over 10 epochs the cosine schedule keeps the rate high for long enough).
  diverging = tiny_config(**{"num_epochs": 10, "keep_checkpoints": 1,
                             "optimizer.learning_rate": 100.0})
  with pytest.raises(train.NonFiniteLossError) as info:
    train.train_and_evaluate(diverging, workdir)
  named = int(re.search(r"last good checkpoint is step (\d+) in", str(info.value)).group(1))
  assert checkpointing.Checkpointer(workdir, 1).latest_step() == named
  state = setup.setup_run(diverging, workdir)[1]  # Restores the newest checkpoint.
  assert int(state.step) == named
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(state.params))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      numbers = [v for v in record.values() if isinstance(v, float)]
      assert all(np.isfinite(numbers)), record


def _fatal_alone(result: subprocess.CompletedProcess) -> str:
  """The run's FATAL line, which must be its last line and its only one, with no traceback."""
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  fatal = [line for line in lines if line.startswith("FATAL")]
  assert len(fatal) == 1 and lines[-1] == fatal[0], result.stderr[-3000:]
  assert "Traceback" not in result.stderr, result.stderr[-3000:]
  return fatal[0]


@pytest.mark.slow  # A main.py process.
def test_a_diverging_run_ends_in_one_fatal_line(tmp_path):
  """main.py at lr=100 (the evaluation's guard or the loss's fires): the guard's own sentence,
  naming the last good checkpoint and what to change, is the run's one FATAL line; exit 1."""
  result = subprocess.run(main_command(str(tmp_path), "--config.optimizer.learning_rate=100",
                                       "--config.num_epochs=4"),
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 1, result.stderr[-3000:]
  line = _fatal_alone(result)
  assert re.match(r"FATAL (the model diverged|non-finite training loss)", line), line
  assert line.endswith("Lower the learning rate or enable gradient clipping."), line


@pytest.mark.slow  # A main.py process.
def test_a_workdir_that_is_a_file_is_one_fatal_line_before_anything_is_written(tmp_path):
  blocker = tmp_path / "run"
  blocker.write_text("a file, not a folder")
  result = subprocess.run(main_command(str(blocker)), cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]  # Refused before it starts.
  assert _fatal_alone(result) == (f"FATAL --workdir '{blocker}' cannot be a folder: {blocker} "
                                  "is a file; pass another --workdir (nothing was written)")
  assert os.listdir(tmp_path) == ["run"] and blocker.read_text() == "a file, not a folder"


@pytest.mark.slow  # A main.py process each.
@pytest.mark.parametrize("delay", [0.005, 0.2])
def test_a_second_ctrl_c_changes_nothing_the_stop_is_the_last_line(tmp_path, delay):
  """Ctrl-C, then Ctrl-C again `delay` s later (5 ms: inside the stop's step and save; 0.2 s:
  about when the process exits): the run saves its checkpoint and exits with 75 all the same,
  and the stop's own line is stderr's last (no KeyboardInterrupt, nothing from JAX's exit)."""
  workdir, log = str(tmp_path / "run"), str(tmp_path / "run.log")
  with open(log, "w") as stderr:
    proc = subprocess.Popen(main_command(workdir, "--config.num_epochs=30"), cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=stderr)
    _wait_for(log, "Progress:", [proc])
    proc.send_signal(signal.SIGINT)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE, _read(log)[-3000:]
  lines = [line for line in _read(log).splitlines() if line.strip()]
  stop = re.search(r"SIGINT: saved a checkpoint at global step (\d+) \(epoch \d+, step \d+ of "
                   r"it\) in .*; rerun the same command to resume there\.$", lines[-1])
  assert stop, lines[-5:]
  assert "Traceback" not in _read(log) and "Exception ignored" not in _read(log)
  assert os.path.isdir(os.path.join(workdir, "checkpoints", stop.group(1)))


def test_a_second_signal_while_stopping_is_noted_once_and_nothing_follows_the_stop(
    tmp_path, caplog):
  """In one process: the second Ctrl-C is noted (one line naming `kill -9`), the stop goes on;
  a signal once the stop is raised, as the process unwinds, is not even noted."""
  checkpointer = checkpointing.Checkpointer(str(tmp_path), 2)
  try:
    with caplog.at_level(logging.WARNING), checkpointer.handling_preemption():
      for _ in range(2):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # Delivered, and no KeyboardInterrupt.
      assert checkpointer.reached_preemption(3)
      with pytest.raises(preemption.Preempted, match="SIGINT: saved a checkpoint at global "
                         "step 3"):
        checkpointer.stop_preempted(3, 0, 3)
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)
  finally:
    checkpointer.close()
  messages = [r.getMessage() for r in caplog.records]
  again = [m for m in messages if "again" in m]
  assert len(again) == 1 and f"kill -9 {os.getpid()} ends it now" in again[0], messages
  assert "again" in messages[-1], messages  # Nothing noted after the stop.


@pytest.mark.slow  # A main.py process each.
@pytest.mark.parametrize("override", [("--config.foo=1",), ("--config.foo", "1")])
def test_an_unknown_override_fails_in_one_line_without_creating_the_workdir(tmp_path, override):
  result = subprocess.run(main_command(str(tmp_path / "w"), *override), cwd=REPO,
                          env=subprocess_env(1), capture_output=True, text=True, timeout=120)
  assert result.returncode == 2  # A usage error.
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert len(lines) == 1, result.stderr[-2000:]
  assert lines[0].startswith("FATAL Flags parsing error: config.foo: unknown field; known "
                             "fields: batch_size, budget_steps, checkpoint_every_epochs,"), lines[0]
  assert not os.path.exists(tmp_path / "w")


@pytest.mark.parametrize("name, expected", [
    ("selection.target_per_epoch",
     "config.selection.target_per_epoch: no longer exists; use selection.scoring="
     "'target_recorded'"),
    # The closest match comes first.
    ("los.name", "config.los.name: unknown field; did you mean loss.name"),
])
def test_renamed_and_misspelt_fields_name_the_right_one(name, expected):
  config = tiny_config()
  assert not schema.has_field(config, name)
  assert schema.unknown_field_message(config, name).startswith(expected)


def test_a_second_run_on_a_held_workdir_fails_fast_naming_the_holder(tmp_path):
  workdir = str(tmp_path / "w")
  with workdir_lock.WorkdirLock(workdir):
    with pytest.raises(workdir_lock.WorkdirLockedError,
                       match=f"is in use by PID {os.getpid()} on host {socket.gethostname()}"):
      train.train_and_evaluate(tiny_config(), workdir)  # flock: even within one process.
    assert os.listdir(workdir) == [workdir_lock.LOCK_FILE]  # Nothing else touched.
  with workdir_lock.WorkdirLock(workdir):  # Released on exit: free again.
    pass
  assert workdir_lock.read_holder(os.path.join(workdir, workdir_lock.LOCK_FILE)) is None


@pytest.mark.slow  # A main.py process.
def test_main_on_a_held_workdir_is_one_fatal_line_naming_the_holder(tmp_path):
  """The second run of a busy workdir, as users start it: the holder named in one line,
  exit 2 (refused before it starts), no traceback; the holder's lock untouched."""
  workdir = str(tmp_path / "w")
  with workdir_lock.WorkdirLock(workdir) as lock:
    result = subprocess.run(main_command(workdir), cwd=REPO, env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert workdir_lock.read_holder(lock.path)["pid"] == os.getpid()
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert lines[-1].startswith(f"FATAL --workdir {workdir!r} is in use by PID {os.getpid()} on "
                              f"host {socket.gethostname()}"), result.stderr[-3000:]
  assert lines[-1].endswith("wait for it, stop it, or use another --workdir.")
  assert "Traceback" not in result.stderr and len([s for s in lines if "FATAL" in s]) == 1


@pytest.mark.slow
def test_a_killed_holder_never_blocks_the_rerun(tmp_path):
  """SIGKILL gives no chance to clean up: the kernel drops the flock with the process."""
  workdir = str(tmp_path)
  holder = subprocess.Popen(
      [sys.executable, "-c", "import time; from cpjax.runtime import workdir_lock; "
       f"lock = workdir_lock.WorkdirLock({workdir!r}); lock.__enter__(); "
       "print('held', flush=True); time.sleep(600)"], cwd=REPO, stdout=subprocess.PIPE, text=True)
  assert holder.stdout.readline().strip() == "held"
  with pytest.raises(workdir_lock.WorkdirLockedError, match=f"PID {holder.pid} "):
    workdir_lock.WorkdirLock(workdir).__enter__()
  holder.kill()
  holder.wait()
  holder.stdout.close()
  with workdir_lock.WorkdirLock(workdir) as lock:
    assert workdir_lock.read_holder(lock.path)["pid"] == os.getpid()


def test_without_flock_a_dead_holder_on_this_host_is_stale(tmp_path, monkeypatch, caplog):
  def no_flock(*args):
    raise OSError(errno.ENOLCK, "No locks available")
  monkeypatch.setattr(workdir_lock.fcntl, "flock", no_flock)
  path = os.path.join(tmp_path, workdir_lock.LOCK_FILE)
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  for host, pid, outcome in ((socket.gethostname(), dead.pid, "taken over"),
                             (socket.gethostname(), os.getppid(), "in use"),
                             ("other-host", dead.pid, "in use")):
    with open(path, "w") as f:
      json.dump({"host": host, "pid": pid, "started": "then", "command": "x"}, f)
    if outcome == "taken over":
      with workdir_lock.WorkdirLock(str(tmp_path)):
        assert "no longer running" in caplog.text
    else:
      with pytest.raises(workdir_lock.WorkdirLockedError, match=f"PID {pid} on host {host}.*"
                         "if that run is gone"):
        workdir_lock.WorkdirLock(str(tmp_path)).__enter__()


def test_metrics_log_keeps_the_last_record_per_epoch_and_writes_nan_as_null(tmp_path, caplog):
  path = os.path.join(tmp_path, "metrics.jsonl")
  with open(path, "w") as f:
    f.write('{"epoch": 1, "a": 1}\n\n{"epoch": 0, "a": 2}\n{"epoch": 1, "a": 3}\n[]\n{"ep')
  assert run_logging.read_records(path) == [{"epoch": 0, "a": 2}, {"epoch": 1, "a": 3}]
  assert "line 5 is not a complete epoch record" in caplog.text  # `[]` has no epoch.
  assert "line 6 is not a complete epoch record" in caplog.text
  log = run_logging.EpochLog(str(tmp_path))
  log.write({"epoch": 2, "val_nll": float("nan"), "val_ece": np.float64("inf"), "ok": 0.5})
  log.keep_epochs_before(2)  # Epoch 2 is to be redone; the damaged lines go too.
  log.write({"epoch": 2, "val_nll": float("nan"), "val_ece": 0.25})
  with open(path) as f:
    lines = f.read().splitlines()
  strict = [json.loads(line, parse_constant=lambda name: pytest.fail(name)) for line in lines]
  assert strict == [{"epoch": 0, "a": 2}, {"epoch": 1, "a": 3},
                    {"epoch": 2, "val_nll": None, "val_ece": 0.25}]

