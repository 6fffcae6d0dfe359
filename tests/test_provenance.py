"""What a run's records say made them (cpjax/runtime/provenance.py): the code version from a
real git checkout, a changed tree, no checkout and no git; the seeds by name; and the records
of runs from different commits (the first metrics.jsonl record of each sitting, results.json,
a study's row and summary line, a row rebuilt from a run folder)."""

import hashlib
import os
import re
import subprocess
import time

import pytest

from cpjax.runtime import checkpointing, provenance
from cpjax.training import train
from studies import grid, long_schedule
from tests import helpers

GIT = ("git", "-c", "user.name=cpjax", "-c", "user.email=cpjax@example.com")


def _checkout(path) -> str:
  """A git repository at `path` holding one committed file; returns its commit."""
  os.makedirs(os.path.join(path, "cpjax"))
  with open(os.path.join(path, "cpjax", "__init__.py"), "w") as f:
    f.write("")
  for args in (("init", "-q"), ("add", "."), ("commit", "-q", "-m", "one")):
    subprocess.run([*GIT, "-C", str(path), *args], check=True)
  return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True,
                        capture_output=True, text=True).stdout.strip()


def test_the_code_version_of_a_checkout_and_of_its_changes(tmp_path):
  """A clean checkout: its commit, not dirty; an untracked file changes nothing; a changed
  tracked file makes it dirty; a new commit is a new version."""
  root = str(tmp_path / "repo")
  first = _checkout(root)
  assert provenance.code_version(root) == {"commit": first, "dirty": False}
  with open(os.path.join(root, "notes.txt"), "w") as f:
    f.write("untracked")
  assert provenance.code_version(root) == {"commit": first, "dirty": False}
  with open(os.path.join(root, "cpjax", "__init__.py"), "w") as f:
    f.write("x = 1\n")
  assert provenance.code_version(root) == {"commit": first, "dirty": True}
  subprocess.run([*GIT, "-C", root, "commit", "-q", "-am", "two"], check=True)
  second = provenance.code_version(root)
  assert second["commit"] != first and not second["dirty"]
  assert provenance.code_text(second) == second["commit"][:12]
  assert provenance.code_text({"commit": first, "dirty": True}) == f"{first[:12]} with changes"


def test_outside_a_checkout_or_without_git_the_package_version_or_why(tmp_path, monkeypatch):
  """A folder inside another repository is no checkout of cpjax; with git missing, or too slow,
  the run goes on and `code` says what is known."""
  root, real_run = str(tmp_path / "repo"), subprocess.run
  _checkout(root)
  inner = os.path.join(root, "cpjax")
  monkeypatch.setattr(provenance.importlib.metadata, "version",
                      lambda name: "9.9.9" if name == "cpjax" else None)
  assert provenance.code_version(inner) == {"package_version": "9.9.9"}
  assert provenance.code_text({"package_version": "9.9.9"}) == "cpjax 9.9.9"

  def not_installed(name):
    raise provenance.importlib.metadata.PackageNotFoundError(name)
  monkeypatch.setattr(provenance.importlib.metadata, "version", not_installed)
  assert "no git checkout of cpjax" in provenance.code_version(inner)["unknown"]

  def missing_git(*args, **kwargs):
    raise FileNotFoundError("git")
  monkeypatch.setattr(provenance.subprocess, "run", missing_git)
  assert "unknown" in provenance.code_version(root)

  def slow_status(command, **kwargs):
    if "status" in command:
      raise subprocess.TimeoutExpired(command, provenance.GIT_TIMEOUT_S)
    return real_run(command, **kwargs)
  monkeypatch.setattr(provenance.subprocess, "run", slow_status)
  assert provenance.code_version(root)["dirty"] == "unknown"


def test_every_seed_is_found_by_its_name():
  """The config's seeds, and one added later under a new name."""
  config = helpers.tiny_config()
  assert provenance.seeds(config) == {
      "seed": 0, "dataset.split_seed": 42, "dataset.label_noise_seed": 0,
      "evaluation.bootstrap_seed": 0, "evaluation.conformal_seed": 0}
  config.evaluation.new_draw_seed = 7
  assert provenance.seeds(config)["evaluation.new_draw_seed"] == 7


def test_a_study_names_the_machine_a_run_folders_provenance_gives():
  """long_schedule.machine_of(the provenance gathered here) is this machine's machine()."""
  gathered = provenance.gather(helpers.tiny_config(), time.time())
  assert long_schedule.machine_of(gathered) == long_schedule.machine()
  assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", gathered["started_utc"])


def _commit(letter: str, dirty: bool = False) -> dict:
  return {"commit": letter * 40, "dirty": dirty}


def _well_formed(origin: dict, config) -> None:
  assert set(origin) == {"code", "started_utc", "host", "platform", "device_kind",
                         "device_count", "cpu", "cpu_count", "jax", "flax", "config_sha256",
                         "seeds", "label_noise"}
  assert origin["device_count"] == 8 and origin["platform"] == "cpu"  # conftest's devices.
  assert origin["config_sha256"] == hashlib.sha256(
      config.to_json_best_effort(sort_keys=True).encode()).hexdigest()
  assert origin["seeds"] == provenance.seeds(config)
  assert set(origin["label_noise"]) == {"share", "seed", "stream", "train_labels_sha256"}


@pytest.mark.slow  # Three short training runs.
def test_runs_from_different_commits_leave_records_that_say_so(tmp_path, monkeypatch):
  """Two runs, one from commit a and one from commit b with changes: each first metrics.jsonl
  record and results.json name its commit, and the study line lists both; the first run
  resumed from commit c adds c to its record (its second sitting); a study row rebuilt from
  its folder says so and keeps the folder's provenance. The config digest is the checkpoint's
  config's."""
  noisy = {"num_epochs": 1, "selection.method": "full", "dataset.label_noise": 0.2,
           "dataset.label_noise_seed": 5, "evaluation.bootstrap_resamples": 10}
  rows, base = {}, helpers.tiny_config()
  for name, code in (("a", _commit("a")), ("b", _commit("b", dirty=True))):
    monkeypatch.setattr(provenance, "code_version", lambda code=code: code)
    workdir = str(tmp_path / name)
    rows[name] = grid.run_cell(base, {**noisy, "seed": ord(name)}, workdir)
    first = helpers.read_metrics(workdir)[0]["provenance"]
    config = grid.apply(base, {**noisy, "seed": ord(name)})
    _well_formed(first, config)
    assert first["code"] == code and first["seeds"]["seed"] == ord(name)
    assert first["label_noise"]["share"] == 0.2 and first["label_noise"]["seed"] == 5
    assert rows[name]["provenance"] == [first] and not rows[name]["rebuilt_from_run_folder"]
    meta = checkpointing.Checkpointer(workdir, None, read_only=True).latest_meta()
    assert first["config_sha256"] == hashlib.sha256(meta["config"].encode()).hexdigest()
  results = {name: {key: [value] for key, value in row.items()} for name, row in rows.items()}
  assert grid.code_versions_line(results) == (
      f"Code versions of the records: `{'a' * 12}` (1 run); `{'b' * 12} with changes` (1 run). "
      "Rebuilt from run folders trained before: 0 of 2 records.")
  assert (rows["a"]["provenance"][0]["label_noise"]["train_labels_sha256"]
          == rows["b"]["provenance"][0]["label_noise"]["train_labels_sha256"])

  monkeypatch.setattr(provenance, "code_version", lambda: _commit("c"))
  workdir = str(tmp_path / "a")
  train.train_and_evaluate(grid.apply(base, {**noisy, "seed": ord("a"), "num_epochs": 2}),
                           workdir)
  sittings = grid.run_provenance(workdir)
  assert [p["code"]["commit"][0] for p in sittings] == ["a", "c"]
  assert [("provenance" in r) for r in helpers.read_metrics(workdir)] == [True, True]
  rebuilt = grid.run_cell(base, {**noisy, "seed": ord("a"), "num_epochs": 2}, workdir)
  assert rebuilt["rebuilt_from_run_folder"] and rebuilt["provenance"] == sittings
  line = grid.code_versions_line({"a": {k: [v] for k, v in rebuilt.items()}})
  assert line == (f"Code versions of the records: `{'a' * 12}` (1 run); `{'c' * 12}` (1 run). "
                  "Rebuilt from run folders trained before: 1 of 1 records.")
  old = {"full": {"accuracy": [0.9, 0.91]}}
  assert grid.code_versions_line(old) == (
      "Code versions of the records: not recorded (the records of 2 runs hold no provenance).")
