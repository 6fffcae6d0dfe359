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


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(workdir: str, logs: str, flags=()) -> list[subprocess.Popen]:
  """Starts main.py as processes 0 and 1 of a jax.distributed run on 127.0.0.1."""
  port, procs = _free_port(), []
  for i in range(2):
    with open(f"{logs}{i}.log", "w") as stderr:  # The child keeps its own copy of the fd.
      procs.append(subprocess.Popen(
          main_command(workdir, *flags, "--config.log_every_steps=1",
                       f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                       f"--process_id={i}"),
          cwd=REPO, env=_env(2), stdout=subprocess.DEVNULL, stderr=stderr))
  return procs


def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(tmp_path):
  """2 processes on 127.0.0.1: SIGTERM to process 0 only; both agree on the step, save, exit 75,
  and the rerun ends with the metrics of an uninterrupted 2-process run."""
  flags = ("--config.num_epochs=2",)
  straight = _two_processes(str(tmp_path / "straight"), str(tmp_path / "s"), flags)
  assert [p.wait(timeout=300) for p in straight] == [0, 0]
  workdir, logs = str(tmp_path / "preempted"), str(tmp_path / "p")
  procs = _two_processes(workdir, logs, flags)
  _wait_for(f"{logs}0.log", "[5] train/", procs)
  procs[0].send_signal(signal.SIGTERM)
  assert [p.wait(timeout=120) for p in procs] == [preemption.EXIT_CODE] * 2
  steps = [_saved_step(_read(f"{logs}{i}.log")) for i in range(2)]
  assert steps[0] == steps[1]  # JAX's preemption sync point: one step for every process.
  rerun = _two_processes(workdir, str(tmp_path / "r"), flags)
  assert [p.wait(timeout=300) for p in rerun] == [0, 0]
  assert _without_timing(read_metrics(workdir)) == _without_timing(
      read_metrics(str(tmp_path / "straight")))


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

