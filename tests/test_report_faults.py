"""A run killed or stopped during its final calibration report: the last checkpoint has
committed before the report begins, so nothing of the training may be lost, and the rerun must
write the report and complete the last epoch's metrics.jsonl record (each epoch once).

The kills land at chosen moments: main.py runs under `_AT_STAGE`, which wraps one function of
the report so that the process SIGKILLs itself (or hangs, for SIGTERM) when it is reached.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from cpjax.runtime import preemption
from tests.helpers import (
  REPO,
  STEPS_PER_EPOCH,
  checkpoint_steps,
  main_command,
  run_main,
  subprocess_env,
)

# configs/test.py, 2 epochs, with a report cheap enough to be built several times.
FLAGS = ("--config.num_epochs=2", "--config.evaluation.ood=",
         "--config.evaluation.bootstrap_resamples=20", "--config.evaluation.calibrator_resamples=0",
         "--config.evaluation.calibrator_folds=2")
LAST_STEP = 2 * STEPS_PER_EPOCH

# python -c _AT_STAGE STAGE main.py ARGS...: main.py, with the process killed (or hung) at STAGE:
#   report_start  the report's first computation (cpjax.calibration.report.build_report);
#   report_files  its second figure written (results.md and one PNG are on disk, not all);
#   record        the report fully written, the epoch's numbers not yet in metrics.jsonl;
#   hang          the report's first computation sleeps for 10 minutes instead.
_AT_STAGE = """
import os, runpy, signal, sys, time
from cpjax.training import evaluation
from cpjax.calibration import report, report_files
stage = sys.argv[1]
calls = []

def kill():
  os.kill(os.getpid(), signal.SIGKILL)

def at_call(module, name, action, nth=1):
  real = getattr(module, name)
  def wrapped(*args, **kwargs):
    calls.append(name)
    if calls.count(name) == nth:
      action()
    return real(*args, **kwargs)
  setattr(module, name, wrapped)

if stage == "report_start":
  at_call(report, "build_report", kill)
elif stage == "report_files":
  at_call(report_files, "_save_png", kill, nth=2)
elif stage == "record":
  at_call(evaluation, "report_record", kill)
elif stage == "hang":
  at_call(report, "build_report", lambda: time.sleep(600))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _command_at(stage: str, workdir: str) -> list[str]:
  return [sys.executable, "-c", _AT_STAGE, stage, *main_command(workdir, *FLAGS)[1:]]


def _killed_at(stage: str, workdir: str) -> None:
  done = subprocess.run(_command_at(stage, workdir), cwd=REPO, env=subprocess_env(),
                        capture_output=True, text=True, timeout=400)
  assert done.returncode == -signal.SIGKILL, (stage, done.returncode, done.stderr[-3000:])


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _epochs_in_file(workdir: str) -> list[int]:
  """The epoch of every line of metrics.jsonl, in file order (duplicates kept)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["epoch"] for line in f if line.strip()]


def _check_complete(workdir: str) -> None:
  """Every epoch once in metrics.jsonl, the last with its training numbers and the report's,
  and the report of the last checkpoint on disk, agreeing with that record."""
  assert _epochs_in_file(workdir) == [0, 1]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    last = [json.loads(line) for line in f][-1]
  assert {"train_loss", "train_accuracy", "test_ece", "calibrator"} <= set(last)
  with open(os.path.join(workdir, "report", "results.json")) as f:
    results = json.load(f)
  assert results["checkpoint_step"] == LAST_STEP
  chosen = results["posthoc"]["calibrators"][results["posthoc"]["chosen"]]["test"]
  assert last["calibrator"] == results["posthoc"]["chosen"]
  assert last["test_calibrated_ece"] == pytest.approx(chosen["ece"], rel=1e-12)
  assert last["test_ece"] == pytest.approx(results["metrics"]["test"]["before_ts"]["ece"],
                                           rel=1e-12)


@pytest.mark.slow
def test_kill_9_at_moments_of_the_report_loses_no_metrics_record(tmp_path):
  """The training run is killed while writing the report's files; its reruns (the report
  alone) are killed as the report starts and once it is written but not yet recorded; the
  last rerun ends with metrics.jsonl complete and the report of the last checkpoint."""
  workdir = str(tmp_path / "run")
  _killed_at("report_files", workdir)
  assert checkpoint_steps(workdir)[-1] == LAST_STEP
  assert _epochs_in_file(workdir) == [0, 1]  # The last epoch's training numbers, already.
  assert not os.path.exists(os.path.join(workdir, "report", "results.json"))
  assert os.path.exists(os.path.join(workdir, "report", "results.md"))  # A partial report.
  _killed_at("report_start", workdir)
  _killed_at("record", workdir)
  assert os.path.exists(os.path.join(workdir, "report", "results.json"))
  rerun = run_main(workdir, *FLAGS)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert "writing the report now" in rerun.stderr
  _check_complete(workdir)
  again = run_main(workdir, *FLAGS)  # Complete: nothing is redone, nothing duplicated.
  assert again.returncode == 0, again.stderr[-3000:]
  assert "writing the report now" not in again.stderr
  _check_complete(workdir)


@pytest.mark.slow
def test_sigterm_during_the_report_stops_at_once_and_the_rerun_writes_it(tmp_path):
  """SIGTERM while the report is being built (here: held there) ends the run with the
  preemption status within seconds, the last checkpoint intact; the rerun writes the report."""
  workdir, log = str(tmp_path / "run"), str(tmp_path / "first.log")
  with open(log, "w") as stderr:
    proc = subprocess.Popen(_command_at("hang", workdir), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=stderr)
    try:
      deadline = time.monotonic() + 400
      while "Building the calibration report" not in _read(log):
        assert proc.poll() is None and time.monotonic() < deadline, _read(log)[-3000:]
        time.sleep(0.1)
      proc.send_signal(signal.SIGTERM)
      # Held in a 10-minute sleep: only an immediate stop ends it within the minute.
      assert proc.wait(timeout=60) == preemption.EXIT_CODE
    finally:
      if proc.poll() is None:  # The test failed: leave no process behind.
        proc.kill()
        proc.wait()
  first = _read(log)
  assert f"SIGTERM: stopped during the final report; the last checkpoint (global step " \
         f"{LAST_STEP}) is saved" in first
  assert checkpoint_steps(workdir)[-1] == LAST_STEP
  rerun = run_main(workdir, *FLAGS)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert f"Resumed from {workdir}/checkpoints at global step {LAST_STEP}" in rerun.stderr
  _check_complete(workdir)


def test_several_processes_say_that_a_signal_will_not_stop_the_report(monkeypatch, caplog):
  """With several processes a signal cannot stop the report at once (JAX's preemption
  service holds SIGTERM, and one process alone cannot stop the others but at a step): each
  process says so as the report begins, so that a SIGTERM sent then, which the processes
  sit out, is not met with silence. One process says nothing (a signal stops it)."""
  for processes, said in ((2, 1), (1, 0)):
    monkeypatch.setattr(jax, "process_count", lambda n=processes: n)
    guard = preemption.PreemptionGuard()
    caplog.clear()
    with caplog.at_level(logging.INFO):
      with guard.stopping_at_once("stopped during the final report", 7):
        pass
    lines = [r.getMessage() for r in caplog.records if "SIGTERM" in r.getMessage()]
    assert len(lines) == said, lines
    if said:
      assert lines[0] == ("2 processes: a SIGTERM from here on does not stop the run (one "
                          "process cannot stop the others but at a training step): they finish "
                          "the final report and exit with status 0; the last checkpoint, global "
                          "step 7, is saved."), lines[0]


def test_a_signal_during_stopping_at_once_raises_preempted_there():
  """In the guard's at-once mode SIGTERM raises Preempted where the code is (here: in a
  sleep), with the given step; a signal received before the mode begins raises on entry;
  outside it a signal only requests a stop."""
  with preemption.PreemptionGuard() as guard:
    started = time.monotonic()
    with pytest.raises(preemption.Preempted, match="SIGTERM: report stopped") as raised:
      with guard.stopping_at_once("report stopped", 7):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    assert raised.value.step == 7 and time.monotonic() - started < 10
  with preemption.PreemptionGuard() as guard:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)  # Delivered: only the flag is set.
    assert guard.should_stop(0)
    with pytest.raises(preemption.Preempted):
      with guard.stopping_at_once("late", 3):
        pass
