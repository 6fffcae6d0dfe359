"""Faults a cluster run meets: preemption (SIGTERM) in 1 and 2 processes, divergence.

Each preemption test compares a run interrupted by SIGTERM mid-epoch and rerun
with the same command against the same run uninterrupted: every non-timing
field of metrics.jsonl must be equal (bit for bit on CPU).
"""

import json
import os
import re
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import pytest

from cpjax import train
from cpjax.runtime import checkpointing, preemption
from tests.helpers import REPO, main_command, read_metrics, tiny_config

TIMING = {"epoch_seconds", "training_seconds", "scoring_seconds", "selection_seconds",
          "total_training_seconds", "total_scoring_seconds", "total_selection_seconds"}
STEPS_PER_EPOCH = -(-1257 // 64)  # configs/test.py: 1,257 digits training images, batch 64.


def _without_timing(records):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _env(devices: int) -> dict[str, str]:
  return {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


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


SELECTING = ("--config.num_epochs=2", "--config.selection.method=top_k",
             "--config.selection.fraction=0.5", "--config.selection.warmup_epochs=1")


def test_sigterm_mid_epoch_saves_exits_75_and_resumes_exactly(tmp_path):
  """One process: SIGTERM in a selected epoch -> checkpoint at that step, exit 75, exact resume."""
  straight = subprocess.run(main_command(str(tmp_path / "straight"), *SELECTING), cwd=REPO,
                            env=_env(1), capture_output=True, text=True, timeout=300)
  assert straight.returncode == 0, straight.stderr[-3000:]
  workdir, log = str(tmp_path / "preempted"), str(tmp_path / "first.log")
  with open(log, "w") as stderr:
    proc = subprocess.Popen(main_command(workdir, *SELECTING), cwd=REPO, env=_env(1),
                            stdout=subprocess.DEVNULL, stderr=stderr)
    _wait_for(log, f"[{STEPS_PER_EPOCH + 5}] train/", [proc])  # Epoch 1, a selected one.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == preemption.EXIT_CODE
  first = _read(log)
  step = _saved_step(first)
  assert step % STEPS_PER_EPOCH != 0, "the stop should fall inside an epoch"
  assert first.count("saved a checkpoint") == 1
  assert os.path.isdir(os.path.join(workdir, "checkpoints", str(step)))
  rerun = subprocess.run(main_command(workdir, *SELECTING), cwd=REPO, env=_env(1),
                         capture_output=True, text=True, timeout=300)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"Resumed from {workdir}/checkpoints at global step {step}" in rerun.stderr
  assert _without_timing(read_metrics(workdir)) == _without_timing(
      read_metrics(str(tmp_path / "straight")))


def _port_free(port: int) -> bool:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError:
      return False
  return True


FAKE_SLURM = os.path.join(REPO, "tests", "fake_slurm")  # srun and scontrol stand-ins.
SBATCH = os.path.join(REPO, "scripts", "slurm", "train.sbatch")


def _slurm_env(tmp_path, tag: str) -> dict[str, str]:
  """The variables SLURM gives a 2-task job step, faked for 127.0.0.1 (jax.distributed reads
  them: JAX's SLURM detection takes the coordinator from the node list and the job id)."""
  port = next(p for p in range(61440 + os.getpid() % 4000, 65536) if _port_free(p))
  return {**_env(2), "PATH": f"{FAKE_SLURM}:{os.environ['PATH']}",
          "SLURM_JOB_ID": str(port - 61440), "SLURM_STEP_NODELIST": "127.0.0.1",
          "SLURM_NTASKS": "2", "SLURM_SUBMIT_DIR": REPO,
          "FAKE_SLURM_LOG": str(tmp_path / f"{tag}_task"),
          "FAKE_SLURM_PIDS": str(tmp_path / f"{tag}_pids"),
          "FAKE_SLURM_CALLS": str(tmp_path / "scontrol_calls")}


def _sbatch(tmp_path, tag: str, workdir: str, *flags: str) -> subprocess.Popen:
  """Runs scripts/slurm/train.sbatch as SLURM would run the batch script of a 2-task job."""
  return subprocess.Popen(["bash", SBATCH, "configs/test.py", workdir, "--config.num_epochs=1",
                           *flags, "--config.log_every_steps=1"],
                          cwd=REPO, env=_slurm_env(tmp_path, tag),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_slurm_job_preempted_on_one_task_requeues_and_resumes_exactly(tmp_path):
  """The SLURM batch script on 2 tasks over 127.0.0.1: SIGTERM to task 0 only; both tasks
  agree on one step, save, exit 75; the script requeues; the requeued job ends with the
  metrics of an uninterrupted job."""
  straight = str(tmp_path / "straight")
  assert _sbatch(tmp_path, "straight", straight).wait(timeout=300) == 0
  workdir = str(tmp_path / "preempted")
  job = _sbatch(tmp_path, "first", workdir)
  _wait_for(str(tmp_path / "first_task0.log"), "[5] train/", [job])
  task_pids = [int(p) for p in _read(str(tmp_path / "first_pids")).split()]
  os.kill(task_pids[0], signal.SIGTERM)
  assert job.wait(timeout=120) == preemption.EXIT_CODE
  steps = [_saved_step(_read(str(tmp_path / f"first_task{i}.log"))) for i in range(2)]
  assert steps[0] == steps[1]  # JAX's preemption sync point: one step for every process.
  assert "JAX process 1 / 2" in _read(str(tmp_path / "first_task1.log"))
  calls = _read(str(tmp_path / "scontrol_calls")).split("\n")
  assert calls[0].startswith("scontrol requeue ")
  assert _sbatch(tmp_path, "requeued", workdir).wait(timeout=300) == 0
  assert f"global step {steps[0]}" in _read(str(tmp_path / "requeued_task0.log"))
  assert _without_timing(read_metrics(workdir)) == _without_timing(read_metrics(straight))


def test_divergence_stops_without_saving_and_keeps_the_last_good_checkpoint(tmp_path):
  """lr=100 after a good epoch: the run stops on a non-finite loss or logits, names the last
  checkpoint it saved, which holds finite parameters and survives rotation
  (keep_checkpoints=1); no number in metrics.jsonl is NaN; a sane rerun resumes from it."""
  workdir = str(tmp_path)
  train.train_and_evaluate(tiny_config(**{"num_epochs": 1, "keep_checkpoints": 1}), workdir)
  assert checkpointing.Checkpointer(workdir, 1).latest_step() == STEPS_PER_EPOCH
  diverging = tiny_config(**{"num_epochs": 4, "keep_checkpoints": 1,
                             "optimizer.learning_rate": 100.0})
  with pytest.raises(train.NonFiniteLossError) as info:
    train.train_and_evaluate(diverging, workdir)
  named = int(re.search(r"last good checkpoint is step (\d+) in", str(info.value)).group(1))
  assert checkpointing.Checkpointer(workdir, 1).latest_step() == named
  run = train._setup(diverging, workdir)  # Restores the newest checkpoint.
  assert int(run.state.step) == named
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(run.state.params))
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      record = json.loads(line)
      numbers = [v for v in record.values() if isinstance(v, float)]
      assert all(np.isfinite(numbers)), record


def test_unknown_and_renamed_overrides_fail_in_one_line(tmp_path):
  for override, expected in (("--config.foo=1", "config.foo: unknown field"),
                             ("--config.selection.target_per_epoch=True",
                              "selection.scoring='target_recorded'"),
                             ("--config.los.name=focal", "did you mean loss.name")):
    result = subprocess.run(main_command(str(tmp_path / "w"), override), cwd=REPO,
                            env=_env(1), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert expected in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert not os.path.exists(tmp_path / "w")

