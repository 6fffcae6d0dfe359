"""The GPU check's own logic without a GPU or a training run: which parts a resume keeps and
which it runs again, the records written as each part ends, the budget, a damaged results
file left as it is, a part past its limit killed and recorded as timed out, the code digest,
targets and markdown from records, a run's anatomy, and the carry's wheels repacked and
unpacked."""

import dataclasses
import gzip
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile

import numpy as np
import psutil
import pytest
from scipy import stats

from benchmarks import carry, gpu_check

REPO = gpu_check.REPO
IDENTITY = {"code_digest": "a" * 64, "commit": None, "card": "NVIDIA H200", "sizes": "full"}
MACHINE = {"backend": "gpu", "card": "NVIDIA H200", "devices": 1, "cores": 16, "cpu": "x86",
           "python": "3.12", "tensorflow": None, "jax": "0.11", "jaxlib": "0.11",
           "flax": "0.12", "optax": "0.2", "orbax-checkpoint": "0.11",
           "tensorflow-datasets": "4.9", "torch": "2.11"}
STUBS = tuple(gpu_check.Part(name, name, "unused:unused", 10.0) for name in ("a", "b", "c"))


class Recorder:
  """A stand-in for running a part: the parts asked for, and the results file as it stood
  when each was asked for (what was recorded before it)."""

  def __init__(self, path, status="done"):
    self.path, self.status, self.calls, self.seen = path, status, [], []

  def __call__(self, part, context, limit):
    del context
    self.calls.append((part.name, limit))
    self.seen.append(sorted(gpu_check.read_results(self.path)["parts"]))
    return {"status": self.status, "seconds": 2.0, "numbers": {"part": part.name}}


def _check(path, execute, identity=IDENTITY, budget=1000.0, part_limit=100.0):
  return gpu_check.Check(path=str(path), identity=identity, machine=MACHINE,
                         context={"tiny": False, "root": os.path.dirname(path)},
                         part_limit=part_limit, budget_seconds=budget,
                         start=time.perf_counter(), execute=execute)


def test_each_part_is_recorded_as_it_ends_with_the_code_and_card_it_ran_on(tmp_path):
  path = tmp_path / "gpu_check_h200.json"
  runner = Recorder(str(path))
  gpu_check.run_check(_check(path, runner), STUBS, {"format": gpu_check.FORMAT, "parts": {}},
                      resume=False)
  # When each part started, every part before it was already in the file.
  assert [name for name, _ in runner.calls] == ["a", "b", "c"]
  assert runner.seen == [[], ["a"], ["a", "b"]]
  results = gpu_check.read_results(str(path))
  for name in "abc":
    part = results["parts"][name]
    assert {k: part[k] for k in IDENTITY} == IDENTITY
    assert part["status"] == "done" and part["numbers"] == {"part": name}
    assert part["limit_seconds"] == pytest.approx(100.0) and part["machine"] == MACHINE
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp_")]  # Renamed in place.
  assert os.stat(path).st_mode & 0o777 == 0o644


def test_resume_keeps_done_parts_and_reruns_other_code_cards_and_failures(tmp_path, capsys):
  path = tmp_path / "gpu_check_h200.json"
  gpu_check.run_check(_check(path, Recorder(str(path))), STUBS,
                      {"format": gpu_check.FORMAT, "parts": {}}, resume=False)
  results = gpu_check.read_results(str(path))
  results["parts"]["a"]["code_digest"] = "b" * 64  # Another commit's code.
  results["parts"]["b"]["status"] = "timeout"
  gpu_check.write_json(str(path), results)
  runner = Recorder(str(path))
  capsys.readouterr()
  gpu_check.run_check(_check(path, runner), STUBS, gpu_check.read_results(str(path)),
                      resume=True)
  out = capsys.readouterr().out
  assert [name for name, _ in runner.calls] == ["a", "b"]  # c is kept.
  assert (f"a: recorded on code {'b' * 12}, card NVIDIA H200, full sizes; this is code "
          f"{'a' * 12}, card NVIDIA H200, full sizes: running it afresh") in out
  assert "b: recorded as timeout: running it again" in out and "c: kept, done on" in out
  after = gpu_check.read_results(str(path))["parts"]
  assert after["a"]["code_digest"] == "a" * 64 and after["b"]["status"] == "done"
  # Another card: every part is run again, each with its line.
  h100 = {**IDENTITY, "card": "NVIDIA H100 80GB HBM3"}
  runner = Recorder(str(path))
  gpu_check.run_check(_check(path, runner, identity=h100), STUBS,
                      gpu_check.read_results(str(path)), resume=True)
  assert [name for name, _ in runner.calls] == ["a", "b", "c"]
  assert "card NVIDIA H200, full sizes; this is code" in capsys.readouterr().out


def test_a_part_that_does_not_fit_the_budget_is_not_started_nor_recorded(tmp_path, capsys):
  path = tmp_path / "gpu_check_h200.json"
  old = {"format": gpu_check.FORMAT, "parts": {"b": {
      **IDENTITY, "code_digest": "b" * 64, "status": "done", "seconds": 12.0,
      "date": "2026-01-01 00:00 UTC"}}}
  gpu_check.write_json(str(path), old)
  # 15 s of budget: a (estimate 10 s) runs for 6 s; then b (12 s, its recorded seconds on
  # this card) and c (10 s) no longer fit.
  runner = Recorder(str(path))
  clock = _check(path, runner, budget=15.0)
  clock.execute = lambda part, context, limit: (time.sleep(6.0), runner(part, context, limit))[1]
  gpu_check.run_check(clock, STUBS, gpu_check.read_results(str(path)), resume=True)
  assert [name for name, _ in runner.calls] == ["a"]
  out = capsys.readouterr().out
  assert re.search(r"b: not started: [89] s of the budget left, it needs about 12 s", out)
  assert re.search(r"c: not started: [89] s of the budget left, it needs about 10 s", out)
  parts = gpu_check.read_results(str(path))["parts"]
  assert sorted(parts) == ["a", "b"] and parts["b"]["code_digest"] == "b" * 64  # As it was.
  # A part stopped by the budget's end (under its own limit) is not recorded either.
  cut = Recorder(str(path), status="timeout")
  gpu_check.run_check(_check(path, cut, budget=50.0), STUBS[2:],
                      gpu_check.read_results(str(path)), resume=True)
  assert cut.calls == [("c", pytest.approx(50.0, abs=1.0))]
  assert "c: stopped at the budget's end" in capsys.readouterr().out
  assert "c" not in gpu_check.read_results(str(path))["parts"]


# Parts run by the real worker (`run_in_worker`), in a process of their own.


def quick_part(context):
  return {"exit_status": 0, "seconds_given": context["seconds"]}


def failing_part(context):
  raise ValueError(f"a part that fails, root {context['root']}")


def sleeping_part(context):
  """Starts a process in a session of its own (as a trainer's run is), then sleeps."""
  child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                           start_new_session=True)
  with open(os.path.join(context["root"], "child.pid"), "w") as f:
    f.write(str(child.pid))
  time.sleep(120)


def _alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def test_a_part_past_its_limit_is_killed_with_its_processes_and_recorded_as_timeout(tmp_path):
  path = tmp_path / "gpu_check_h200.json"
  parts = tuple(gpu_check.Part(name, name, f"tests.test_gpu_check:{name}_part", 0.0)
                for name in ("quick", "failing", "sleeping"))
  check = _check(path, gpu_check.run_in_worker, part_limit=30.0)
  start = time.perf_counter()
  gpu_check.run_check(check, parts, {"format": gpu_check.FORMAT, "parts": {}}, resume=False)
  assert time.perf_counter() - start < 150
  records = gpu_check.read_results(str(path))["parts"]
  # The part's own runs get 5 s less than its limit, so a slow run is its own timeout.
  assert records["quick"]["status"] == "done"
  assert records["quick"]["numbers"]["seconds_given"] == pytest.approx(25.0, abs=0.5)
  assert records["failing"]["status"] == "failed" and records["failing"]["numbers"] is None
  assert "ValueError: a part that fails" in records["failing"]["log_tail"]
  sleeping = records["sleeping"]
  assert sleeping["status"] == "timeout" and 29 < sleeping["seconds"] < 60
  assert sleeping["limit_seconds"] == pytest.approx(30.0, abs=1.0)
  child = int((tmp_path / "child.pid").read_text())
  deadline = time.perf_counter() + 10
  while _alive(child) and time.perf_counter() < deadline:
    time.sleep(0.1)
  assert not _alive(child), "a process the part started outlived its limit"


def test_run_process_returns_the_exit_status_or_timeout(tmp_path):
  assert gpu_check.run_process([sys.executable, "-c", "raise SystemExit(4)"], 30.0,
                               dict(os.environ), str(tmp_path / "log")) == 4
  start = time.perf_counter()
  assert gpu_check.run_process([sys.executable, "-c", "import time; time.sleep(60)"], 2.0,
                               dict(os.environ), str(tmp_path / "log")) == "timeout"
  assert time.perf_counter() - start < 30


def _main(monkeypatch, *args):
  monkeypatch.setattr(gpu_check, "machine", lambda: MACHINE)
  monkeypatch.setattr(gpu_check, "PARTS", ())  # Nothing runs: the file's handling alone.
  return gpu_check.main(list(args))


@pytest.mark.parametrize("damage", [b'{"format": "cpjax gpu_check records 1", "parts": {',
                                    b'{"parts": {}}', b'{"format": "cpjax gpu_check records 1",'
                                    b' "parts": {"fashion": {"status": "done"}}}'])
def test_a_damaged_results_file_is_named_and_left_as_it_is(tmp_path, monkeypatch, capsys,
                                                           damage):
  path = tmp_path / "gpu_check_h200.json"
  path.write_bytes(damage)
  assert _main(monkeypatch, "--resume", f"--results={path}",
               f"--workdir-root={tmp_path / 'w'}") == 2
  err = capsys.readouterr().err
  assert f"error: {path}" in err and "move it aside" in err
  assert path.read_bytes() == damage and os.listdir(tmp_path) == [path.name]
  # Without --resume: set aside under a new name, its bytes kept, and the check starts afresh.
  assert _main(monkeypatch, f"--results={path}", f"--workdir-root={tmp_path / 'w'}") == 0
  backups = [p for p in os.listdir(tmp_path) if p.endswith(".bak")]
  assert len(backups) == 1 and (tmp_path / backups[0]).read_bytes() == damage
  assert f"kept as {tmp_path / backups[0]}" in capsys.readouterr().out


def test_status_of_a_parts_numbers():
  assert gpu_check.status_of({"runs": [{"exit_status": 0}, {"exit_status": 0}]}) == "done"
  assert gpu_check.status_of({"runs": [{"exit_status": 0}, {"exit_status": 1}]}) == "failed"
  assert gpu_check.status_of({"run": {"exit_status": "timeout"}, "x": {"exit_status": 1}}) == (
      "timeout")
  assert gpu_check.status_of({"exit_status": 0, "rows": {"r": {"skipped": "no GPU"}}}) == (
      "failed")
  assert gpu_check.status_of({"exit_status": 0, "rows": {"r": {"error": "E"}}}) == "failed"


def test_code_digest_follows_the_code_not_the_results(tmp_path):
  for name, text in (("cpjax/a.py", "x = 1"), ("benchmarks/b.py", "y = 2"),
                     ("benchmarks/results/r.json", "{}"), ("docs/d.md", "doc"),
                     ("main.py", "main"), ("requirements.txt", "jax")):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  first = gpu_check.code_digest(str(tmp_path))
  (tmp_path / "benchmarks/results/r.json").write_text('{"parts": {}}')
  (tmp_path / "docs/d.md").write_text("other")
  (tmp_path / "cpjax/__pycache__").mkdir()
  (tmp_path / "cpjax/__pycache__/a.cpython-312.pyc").write_bytes(b"\0")
  assert gpu_check.code_digest(str(tmp_path)) == first
  (tmp_path / "cpjax/a.py").write_text("x = 2")
  assert gpu_check.code_digest(str(tmp_path)) != first
  assert gpu_check.git_commit(str(tmp_path)) is None  # No .git there, as on a GPU machine.


def test_git_commit_is_the_checkouts_own_never_an_enclosing_ones(tmp_path):
  """A copy of the code inside another checkout (its .git above it) has no commit of its
  own: the enclosing checkout's commit is not this code's."""
  outer = tmp_path / "outer"
  (outer / "inner" / "cpjax").mkdir(parents=True)
  (outer / "inner" / "cpjax" / "a.py").write_text("x = 1")
  def git(*args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=outer,
                   check=True, capture_output=True)
  git("init", "-q")
  git("add", ".")
  git("commit", "-q", "-m", "c")
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=outer, capture_output=True,
                        text=True, check=True).stdout.strip()
  assert gpu_check.git_commit(str(outer)) == head
  assert gpu_check.git_commit(str(outer / "inner")) is None
  (outer / "cpjax").mkdir()
  (outer / "cpjax" / "b.py").write_text("y = 2")  # A code file not committed.
  assert gpu_check.git_commit(str(outer)) == head + "+changes"


# Targets and markdown from records whose numbers are known.


def _anatomy(wall, steady):
  return {**dict.fromkeys(gpu_check.ANATOMY_KEYS), "perf/wall_seconds": wall,
          "perf/steady_step_seconds": steady}


def _imagenet(decode, rate, seconds, wait):
  epochs = [{"epoch": 0, "images": 100, "training_seconds": 9.0, "images_per_s": 11.1,
             "input_wait_seconds": 1.0, "input_wait_share": 0.11, "scoring_seconds": 0.0,
             "selection_seconds": 0.0, "eval_seconds": 0.0},
            {"epoch": 1, "images": int(rate * seconds), "training_seconds": seconds,
             "images_per_s": rate, "input_wait_seconds": wait * seconds,
             "input_wait_share": wait, "scoring_seconds": 2.0, "selection_seconds": 0.01,
             "eval_seconds": 1.0}]
  return {"folder": {"folder": "f", "written": True, "seconds": 3.0, "classes": 10,
                     "train_images": 100, "source_size": [64, 48]},
          "run": {"command": "python main.py", "exit_status": 0, "seconds": 50.0,
                  "decode": decode, "cache_entries_before": 0, "epochs": epochs,
                  "steady": gpu_check.steady(epochs, 100), "checkpoint_seconds": 0.5,
                  "report_seconds": 2.0, "report_build_seconds": 1.5,
                  "peak_device_memory_bytes": 2**31, "test_accuracy": 0.1,
                  "anatomy": _anatomy(50.0, 30.0)}}


def _records(sizes="full", outside=(10.0, 4.5), ratio=0.65, host=(950.0, 30.0),
             gpu=(850.0, 25.0, 0.02), fed=0.9, bare=1000.0, drop=()):
  """Records of every part with the numbers the targets read."""
  numbers = {
      "fashion": {"num_epochs": 20, "prepare_seconds": 4.0, "runs": [
          {"arm": arm, "seed": s, "exit_status": 0, "anatomy": _anatomy(*outside)}
          for s in (0, 1) for arm in ("full", "topk_anneal-45")],
          "means": {arm: {"seeds": [0, 1], "wall_seconds": 20.0, "training_seconds": 8.0,
                          "scoring_seconds": 0.1, "selection_seconds": 0.1,
                          "eval_seconds": 1.0, "report_seconds": 2.0, "passes": 100.0,
                          "test_accuracy": 0.9, "anatomy": _anatomy(*outside)}
                    for arm in ("full", "topk_anneal-45")},
          "paired": {"seeds": [0, 1], "accuracy_points": (0.1, -0.2, 0.4),
                     "wall_seconds_ratio": (ratio, 0.6, 0.7),
                     "training_seconds_ratio": (0.5, 0.4, 0.6),
                     "passes_ratio": (0.48, 0.48, 0.48)}},
      "imagenet_host": _imagenet("cpu", host[0], host[1], 0.2),
      "imagenet_gpu": _imagenet("gpu", *gpu),
      "scoring": {"command": "python -m benchmarks.gpu_table", "exit_status": 0,
                  "seconds": 60.0, "rows": {"r50_train_flax_bare": {"images_per_s": bare}},
                  "ratios": {gpu_check.FED_RATIO: fed} if fed else {}},
      "default_job": {"command": "python main.py --config=configs/default.py --workdir=w",
                      "exit_status": 0, "seconds": 30.0, "test_accuracy": 0.95, "epochs": 20,
                      "anatomy": _anatomy(30.0, 10.0)}}
  return {"format": gpu_check.FORMAT, "parts": {
      name: {**IDENTITY, "sizes": sizes, "status": "done", "seconds": 60.0,
             "limit_seconds": 180.0, "date": f"2026-11-28 1{i}:00 UTC", "machine": MACHINE,
             "numbers": part} for i, (name, part) in enumerate(numbers.items())
      if name not in drop}}


def test_targets_met_missed_and_not_measured():
  statuses = [t["status"] for t in gpu_check.targets(_records())]
  # 10 - 4.5 = 5.5 <= 6; 0.65 <= 0.7; 950 / 1000 >= 0.9; 850 / 1000 < 0.9; 0.02 <= 0.03;
  # 0.9 >= 0.8.
  assert statuses == ["met", "met", "met", "missed", "met", "met"]
  assert gpu_check.targets(_records())[0]["value"] == pytest.approx(5.5)
  over = _records(outside=(10.0, 3.0), ratio=0.93, gpu=(950.0, 25.0, 0.05), fed=0.5)
  assert [t["status"] for t in gpu_check.targets(over)] == [
      "missed", "missed", "met", "met", "missed", "missed"]
  short = gpu_check.targets(_records(host=(950.0, 12.0), fed=None))
  assert short[2]["status"] == "not measured (12.0 s of steady training, under 20)"
  assert short[5]["status"] == "not measured (no number)" and short[5]["value"] is None
  no_bare = gpu_check.targets(_records(drop=("scoring",)))
  assert no_bare[2]["status"] == "not measured (no bare step rate yet)"
  assert no_bare[5]["status"] == "not measured (scoring not done)"
  failed = _records()
  failed["parts"]["fashion"]["status"] = "timeout"
  assert gpu_check.targets(failed)[0]["status"] == "not measured (fashion not done)"
  tiny = gpu_check.targets(_records(sizes="tiny"))
  assert all(t["status"] == "not measured (tiny sizes, not a GPU)" for t in tiny)
  assert tiny[1]["value"] == 0.65  # Still shown.


def test_markdown_from_the_records():
  text = gpu_check.markdown(_records(drop=("default_job",)))
  assert text.startswith("### NVIDIA H200 (1 device(s)), 16 cores\n")
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
          for line in text.splitlines() if line.startswith("| ")}
  assert rows["fashion"][:4] == ["fashion", "done", "60", "180"]
  assert rows["default_job"][:2] == ["default_job", "not run yet"]
  assert rows["fashion `full` seed 1"][1] == "10.00"  # Anatomy: wall.
  assert rows["fashion `full` seed 1"][7] == "4.50"  # Steady steps.
  assert rows["imagenet_gpu"][1] == "50.00"
  prose = text.replace("\n", " ")  # Prose is wrapped at 100 characters.
  assert "850 images/s (0.850 x the bare step's 1,000)" in prose
  assert rows["decode=gpu: steady images/s / the bare step's"][1:] == ["0.850", ">= 0.9",
                                                                        "missed"]
  assert "test accuracy +0.10 [-0.20, +0.40] points, wall clock x0.650 [0.600, 0.700]" in prose
  assert all(len(line) <= 100 for line in text.splitlines() if not line.startswith(("|", "  ")))
  assert gpu_check.markdown({"format": gpu_check.FORMAT, "parts": {}}) == (
      "No part is recorded yet.\n")


def test_results_section_is_generated_from_the_records(tmp_path):
  empty = gpu_check.section(str(tmp_path))
  assert empty.startswith(gpu_check.SECTION_HEADING) and "No GPU has run it yet" in empty
  gpu_check.write_json(str(tmp_path / "gpu_check_h200.json"), _records())
  gpu_check.write_json(str(tmp_path / "gpu_check_cpu_tiny.json"), _records(sizes="tiny"))
  (tmp_path / "gpu_check_h200.json.20261128T000000Z.bak").write_text("set aside")
  text = gpu_check.section(str(tmp_path))
  assert text.count("`results/gpu_check_h200.json`") == 1 and "tiny sizes" not in text
  assert "cpu_tiny" not in text and ".bak" not in text
  assert gpu_check.markdown(_records()) in text
  results_md = tmp_path / "RESULTS.md"
  results_md.write_text(f"# R\n\n{gpu_check.SECTION_HEADING}\n\nold\n\n## Next\n\nkept\n")
  gpu_check.render(str(results_md), str(tmp_path))
  assert results_md.read_text() == f"# R\n\n{text}## Next\n\nkept\n"


def test_results_md_holds_the_section_the_committed_records_render():
  with open(gpu_check.RESULTS_MD) as f:
    text = f.read()
  start = text.index(gpu_check.SECTION_HEADING + "\n")
  end = text.find("\n## ", start) + 1 or len(text)
  assert text[start:end] == gpu_check.section(), (
      "RESULTS.md's GPU check section is stale: python -m benchmarks.gpu_check --render")


def test_steady_rate_is_the_later_epochs_images_over_their_seconds():
  epochs = [{"images": 100, "training_seconds": 9.0, "input_wait_seconds": 1.0,
             "scoring_seconds": 0.0},
            {"images": 90, "training_seconds": 2.0, "input_wait_seconds": 0.5,
             "scoring_seconds": 4.0},
            {"images": 90, "training_seconds": 1.0, "input_wait_seconds": 0.1,
             "scoring_seconds": 1e-5}]  # No pass: its bookkeeping's seconds.
  s = gpu_check.steady(epochs, train_images=100)
  assert s["images"] == 180 and s["training_seconds"] == 3.0 and s["epochs"] == 2
  assert s["images_per_s"] == pytest.approx(60.0)  # 180 / 3.
  assert s["input_wait_share"] == pytest.approx(0.6 / 3.0)
  assert s["scoring_images_per_s"] == pytest.approx(25.0)  # 100 images in 4 s.


def test_anatomy_from_the_last_record_and_its_table():
  records = [{"epoch": 0, "perf/wall_seconds": 99.0},
             {"epoch": 1, "perf/wall_seconds": 12.5, "perf/compilations": 7.0,
              "perf/compilations_after_first_epoch": 0.0, "perf/other_seconds": 0.25}]
  part = gpu_check.anatomy({"records": records})
  assert part["perf/wall_seconds"] == 12.5 and part["perf/compilations"] == 7.0
  assert part["perf/startup_seconds"] is None and set(part) == set(gpu_check.ANATOMY_KEYS)
  lines = gpu_check.anatomy_lines([("run A", part), ("run B", None)])
  row_a = next(line for line in lines if line.startswith("| run A"))
  cells = [c.strip() for c in row_a.strip("|").split("|")]
  # wall, start-up, data open, compiling, compilations, after epoch 0, ..., other.
  assert cells[1:7] == ["12.50", "-", "-", "-", "7", "0"] and cells[-1] == "0.25"
  row_b = next(line for line in lines if line.startswith("| run B"))
  assert row_b.count("| - ") == len(gpu_check.ANATOMY_KEYS)
  mean = gpu_check.mean_anatomy([part, {**part, "perf/wall_seconds": 13.5,
                                        "perf/other_seconds": None}])
  assert mean["perf/wall_seconds"] == 13.0 and mean["perf/other_seconds"] is None


def test_fashion_part_pairs_the_arms_seed_by_seed_from_their_records(tmp_path, monkeypatch):
  """main.py's runs replaced by runs whose records are known: each run's last record carries
  perf/wall_seconds = 10 + seed, its process 20 + seed seconds (topk_anneal-45: 12 + seed)."""
  kept = {"full": 512, "topk_anneal-45": 118}
  order = []

  def run_main(config_file, workdir, flags, timeout, env):
    del config_file, flags, timeout, env
    arm, seed = os.path.basename(workdir).rsplit("_seed", 1)
    order.append((arm, int(seed)))
    records = [{"epoch": e, "selected_k": k, "eval_seconds": 0.5}
               for e, k in enumerate([512, *[kept[arm]] * 5, 512, 512])]
    records[-1].update({"total_training_seconds": 8.0, "total_scoring_seconds": 0.0,
                        "total_selection_seconds": 0.1, "report_seconds": 2.0,
                        "perf/wall_seconds": 10.0 + int(seed)})
    return {"command": "python main.py", "exit_status": 0,
            "seconds": (12.0 if arm == "topk_anneal-45" else 20.0) + int(seed),
            "records": records, "report": {"metrics": {"test": {"before_ts": {
                "accuracy": 0.5 + 0.01 * (arm == "full")}}}}}
  from cpjax.data import input_pipeline  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(gpu_check, "run_main", run_main)
  monkeypatch.setattr(input_pipeline, "open_or_prepare", lambda *a, **k: None)
  # The tiny sizes with the GPU sizes' two seeds (the tiny check runs seed 0 alone).
  monkeypatch.setattr(gpu_check, "TINY", dataclasses.replace(gpu_check.TINY, seeds=(0, 1)))
  part = gpu_check.fashion_part({"tiny": True, "root": str(tmp_path), "seconds": 100.0,
                                 "fashion_mnist_dir": str(tmp_path)})
  assert order == [("full", 0), ("topk_anneal-45", 0), ("full", 1), ("topk_anneal-45", 1)]
  assert part["means"]["full"]["anatomy"]["perf/wall_seconds"] == 10.5
  assert part["means"]["full"]["anatomy"]["perf/steady_step_seconds"] is None
  assert part["paired"]["wall_seconds_ratio"][0] == pytest.approx((12 / 20 + 13 / 21) / 2)
  assert part["paired"]["accuracy_points"][0] == pytest.approx(-1.0)
  assert part["arms"]["topk_anneal-45"]["selection.fraction"] == 0.23  # The study's rule.
  assert gpu_check.status_of(part) == "done"


# The carry.


def _wheel(path, members: dict[str, bytes]) -> None:
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for name, data in members.items():
      z.writestr(name, data)


def test_repack_keeps_one_pythons_modules_cuts_what_cpjax_never_loads_and_stores(tmp_path):
  info = "nvidia_nvimgcodec_cu13-1.0.dist-info"
  so = {f"nvidia/nvimgcodec/impl.cpython-{v}-x86_64-linux-gnu.so": v.encode()
        for v in ("311", "312", "313t")}
  ext = {f"nvidia/nvimgcodec/extensions/lib{n}_ext.so.0": n.encode()
         for n in ("nvjpeg", "jpeg_turbo", "nvtiff", "opencv")}
  kept = ["nvidia/nvimgcodec/impl.cpython-312-x86_64-linux-gnu.so",
          "nvidia/nvimgcodec/extensions/libnvjpeg_ext.so.0",
          "nvidia/nvimgcodec/extensions/libjpeg_turbo_ext.so.0", "nvidia/nvimgcodec/__init__.py"]
  names = [*so, *ext, "nvidia/nvimgcodec/__init__.py", "nvidia/nvimgcodec/include/h.h"]
  record = "".join(f"{n},sha256=x,1\n" for n in [*names, f"{info}/RECORD"])
  wheel = tmp_path / "nvidia_nvimgcodec_cu13-1.0-py3-none-manylinux_2_28_x86_64.whl"
  _wheel(wheel, {**so, **ext, "nvidia/nvimgcodec/__init__.py": b"",
                 "nvidia/nvimgcodec/include/h.h": b"", f"{info}/RECORD": record.encode(),
                 f"{info}/WHEEL": b"Wheel-Version: 1.0\nTag: py3-none-manylinux_2_28_x86_64\n"})
  out = carry.repack(str(wheel), "3.12")
  assert out == str(tmp_path / "nvidia_nvimgcodec_cu13-1.0-cp312-none-manylinux_2_28_x86_64.whl")
  assert not wheel.exists()
  with zipfile.ZipFile(out) as z:
    assert sorted(z.namelist()) == sorted([*kept, f"{info}/RECORD", f"{info}/WHEEL"])
    assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    assert z.read(kept[0]) == b"312"
    assert z.read(f"{info}/RECORD").decode().splitlines() == [
        f"{n},sha256=x,1" for n in [kept[0], *kept[1:3], kept[3], f"{info}/RECORD"]]
    assert b"Tag: cp312-none-manylinux_2_28_x86_64" in z.read(f"{info}/WHEEL")
  # tensorflow-datasets keeps what its import loads and its checksums; its name stays.
  tfds = tmp_path / "tensorflow_datasets-4.9-py3-none-any.whl"
  files = ["tensorflow_datasets/__init__.py", "tensorflow_datasets/core/a.py",
           "tensorflow_datasets/core/a_test.py", "tensorflow_datasets/image/mnist.py",
           "tensorflow_datasets/url_checksums/mnist.txt", "tensorflow_datasets/rlds/r.py"]
  _wheel(tfds, dict.fromkeys(files, b"x"))
  assert carry.repack(str(tfds), "3.12") == str(tfds)
  with zipfile.ZipFile(tfds) as z:
    assert sorted(z.namelist()) == sorted(
        ["tensorflow_datasets/__init__.py", "tensorflow_datasets/core/a.py",
         "tensorflow_datasets/url_checksums/mnist.txt", "tensorflow_datasets/rlds/r.py"])


def test_the_carry_packed_and_unpacked_gives_back_its_wheels_and_idx_files(tmp_path):
  source, folder = tmp_path / "source", tmp_path / "carry"
  source.mkdir()
  contents = {}
  for i, name in enumerate(carry.FASHION_MNIST_FILES):
    contents[name[:-3]] = bytes(range(256)) * (i + 1)
    with gzip.open(source / name, "wb") as f:
      f.write(contents[name[:-3]])
  carry.copy_fashion_mnist(str(source), str(folder / "fashion-mnist"), "xz")
  (folder / "wheels").mkdir()
  wheel = folder / "wheels" / "pkg-1.0-py3-none-any.whl"
  _wheel(wheel, {"pkg/__init__.py": b"x = 1"})
  original = wheel.read_bytes()
  archive = carry.pack(str(folder))
  assert sorted(os.listdir(folder)) == ["fashion-mnist", "wheels.tar.xz"]
  with tarfile.open(archive) as tar:
    assert tar.getnames() == ["wheels", "wheels/pkg-1.0-py3-none-any.whl"]
  written = carry.unpack(str(folder))
  assert str(folder / "wheels") in written and wheel.read_bytes() == original
  target = folder / "fashion-mnist"
  for name, raw in contents.items():
    assert hashlib.sha256((target / name).read_bytes()).digest() == hashlib.sha256(raw).digest()
  with zipfile.ZipFile(io.BytesIO(original)) as z:
    assert z.read("pkg/__init__.py") == b"x = 1"


def test_carry_for_gpu_check_names_its_groups_and_leaves_out_what_the_image_has():
  preset = carry.PRESETS["gpu_check"]
  assert preset["groups"] == ("training", "gpu-decode") and preset["fashion_format"] == "xz"
  training = [d for d, _ in carry.GROUPS["training"]]
  assert set(preset["leave_out"]) < set(training) and "tensorflow-datasets" not in (
      preset["leave_out"])
  with open(carry.GPU_DECODE_REQUIREMENTS) as f:  # Not installed here: the file's lines.
    lines = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
  assert carry.pinned(("gpu-decode",)) == lines and lines[0].startswith("nvidia-nvimgcodec")
  result = subprocess.run([sys.executable, "-m", "benchmarks.carry", "--for=nothing"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and "invalid choice: 'nothing'" in result.stderr


def test_the_fashion_pair_is_paired_seed_by_seed_with_t_intervals():
  """`paired` and `arm_means` over hand-made rows of two seeds (the GPU sizes' pair; the tiny
  check runs one): per-seed differences and ratios, each a mean with SciPy's 90 % t interval;
  a seed whose selection run failed is left out of both arms' pairing."""
  def row(arm, seed, wall, training, passes, accuracy, status=0):
    return {"arm": arm, "seed": seed, "exit_status": status, "wall_seconds": wall,
            "training_seconds": training, "scoring_seconds": 0.0, "selection_seconds": 0.0,
            "eval_seconds": 1.0, "report_seconds": 1.0, "passes": passes,
            "test_accuracy": accuracy, "anatomy": _anatomy(wall, training)}
  rows = [row("full", 0, 20.0, 8.0, 100.0, 0.90), row("topk_anneal-45", 0, 14.0, 4.0, 48.0, 0.91),
          row("full", 1, 22.0, 8.8, 100.0, 0.92), row("topk_anneal-45", 1, 13.2, 4.4, 48.0, 0.90),
          row("full", 2, 21.0, 8.0, 100.0, 0.93), row("topk_anneal-45", 2, 0.0, 0.0, 0.0, 0.0, 1)]
  p = gpu_check.paired(rows)
  assert p["seeds"] == [0, 1]
  assert p["per_seed"]["accuracy_points"] == pytest.approx([1.0, -2.0])
  assert p["per_seed"]["wall_seconds_ratio"] == pytest.approx([0.7, 0.6])

  def t90(values):
    half = stats.t.ppf(0.95, 1) * np.std(values, ddof=1) / np.sqrt(2)
    return (np.mean(values), np.mean(values) - half, np.mean(values) + half)
  assert p["accuracy_points"] == pytest.approx(t90([1.0, -2.0]))
  assert p["wall_seconds_ratio"] == pytest.approx(t90([0.7, 0.6]))
  assert p["training_seconds_ratio"] == pytest.approx(t90([0.5, 0.5]))
  assert p["passes_ratio"] == pytest.approx((0.48, 0.48, 0.48))
  means = gpu_check.arm_means(rows)
  assert means["full"]["seeds"] == [0, 1, 2] and means["topk_anneal-45"]["seeds"] == [0, 1]
  assert means["full"]["wall_seconds"] == pytest.approx(21.0)
  assert means["topk_anneal-45"]["test_accuracy"] == pytest.approx(0.905)
  one = gpu_check.paired(rows[:2])  # One seed (the tiny check's): no interval.
  assert one["seeds"] == [0] and one["wall_seconds_ratio"][0] == pytest.approx(0.7)
  assert all(np.isnan(one["wall_seconds_ratio"][1:]))
