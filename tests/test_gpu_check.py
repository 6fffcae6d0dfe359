"""The GPU check's and gpu_runs' own logic without a GPU or a training run: time limits from one
budget, targets met / missed / not measured, a run's anatomy from its last record, a run past
its time killed with its children, gpu_runs' table from runs whose records are known, and the
carry's wheel trimmed to one Python and its xz files unpacked."""

import gzip
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile

import psutil
import pytest

from benchmarks import carry, gpu_check, gpu_runs


def test_clock_gives_each_piece_what_is_left_less_the_later_shares():
  # Budget 100 s, shares a 10 %, b 30 %, c 50 %: at the start a may use 100 - 80 = 20 s.
  clock = gpu_check.Clock(100.0, {"a": 0.1, "b": 0.3, "c": 0.5})
  assert clock.limit("a") == pytest.approx(20.0, abs=0.5)
  # 10 s later (a ended early): b may use 90 - 50 = 40 s, its 30 plus a's unused 10.
  later = gpu_check.Clock(100.0, {"a": 0.1, "b": 0.3, "c": 0.5}, time.perf_counter() - 10.0)
  assert later.limit("b") == pytest.approx(40.0, abs=0.5)
  # 95 s later (b overran): c keeps only what is left, 5 s.
  late = gpu_check.Clock(100.0, {"a": 0.1, "b": 0.3, "c": 0.5}, time.perf_counter() - 95.0)
  assert late.limit("c") == pytest.approx(5.0, abs=0.5)
  assert sum(gpu_check.PART_SHARES.values()) <= 1.0
  assert sum(gpu_check.RUN_SHARES.values()) == pytest.approx(1.0)


def _results(*, tiny=False, outside=(10.0, 4.5), ratio=0.65, host=(0.95, 30.0),
             gpu=(0.85, 25.0, 0.02), scoring=0.9, seconds=350.0) -> dict:
  """A check's results with the numbers its targets read."""
  anatomy = {"perf/wall_seconds": outside[0], "perf/steady_step_seconds": outside[1]}
  return {
      "tiny": tiny, "seconds": seconds,
      "fashion": {"means": {"full": {"anatomy": anatomy}},
                  "paired": {"topk_anneal-45": {"wall_seconds_ratio": (ratio, 0.6, 0.7)}}},
      "imagenet": {"runs": {
          "host": {"steady": {"over_bare": host[0], "training_seconds": host[1],
                              "input_wait_share": 0.2}},
          "decode_gpu": {"steady": {"over_bare": gpu[0], "training_seconds": gpu[1],
                                    "input_wait_share": gpu[2]}}}},
      "device_stage": {"ratios": {"scoring fed by the device stage / resident": scoring}}}


def test_targets_met_missed_and_not_measured():
  rows = {t["target"].split(":")[0]: t for t in gpu_check.targets(_results())}
  statuses = [t["status"] for t in gpu_check.targets(_results())]
  # 350 <= 360; 10 - 4.5 = 5.5 <= 6; 0.65 <= 0.7; 0.95 >= 0.9; 0.85 < 0.9; 0.02 <= 0.03;
  # 0.9 >= 0.8.
  assert statuses == ["met", "met", "met", "met", "missed", "met", "met"]
  assert rows["(b) full data"]["value"] == pytest.approx(5.5)
  # Over the limits: each missed.
  over = _results(outside=(10.0, 3.0), ratio=0.93, seconds=361.0, gpu=(0.95, 25.0, 0.05),
                  scoring=0.5)
  assert [t["status"] for t in gpu_check.targets(over)] == [
      "missed", "missed", "missed", "met", "met", "missed", "missed"]
  # Under 20 s of steady training, (c)'s rates are not measured; a missing number neither.
  short = gpu_check.targets(_results(host=(0.95, 12.0), scoring=None))
  assert short[3]["status"] == "not measured (12.0 s of steady training, under 20)"
  assert short[6]["status"] == "not measured (no number)" and short[6]["value"] is None
  # No anatomy keys in the records (an older trainer): the fixed-cost target is not measured.
  older = _results()
  older["fashion"]["means"]["full"]["anatomy"] = dict.fromkeys(gpu_runs.ANATOMY_KEYS)
  assert gpu_check.targets(older)[1]["status"] == "not measured (no number)"
  # Tiny sizes on a CPU: nothing is measured, the values are still shown.
  tiny = gpu_check.targets(_results(tiny=True))
  assert all(t["status"] == "not measured (tiny sizes, not a GPU)" for t in tiny)
  assert tiny[2]["value"] == 0.65
  # A check stopped before its last part has no whole-check time.
  unfinished = _results()
  del unfinished["device_stage"]
  assert gpu_check.targets(unfinished)[0]["status"] == (
      "not measured (the check did not finish)")


def test_steady_rate_is_the_later_epochs_images_over_their_seconds():
  epochs = [{"images": 100, "training_seconds": 9.0, "input_wait_seconds": 1.0,
             "scoring_seconds": 0.0},
            {"images": 90, "training_seconds": 2.0, "input_wait_seconds": 0.5,
             "scoring_seconds": 4.0},
            {"images": 90, "training_seconds": 1.0, "input_wait_seconds": 0.1,
             "scoring_seconds": 1e-5}]  # No pass: its bookkeeping's seconds.
  s = gpu_check.steady({"epochs": epochs}, bare_rate=80.0, train_images=100)
  assert s["images"] == 180 and s["training_seconds"] == 3.0 and s["epochs"] == 2
  assert s["images_per_s"] == pytest.approx(60.0)  # 180 / 3.
  assert s["input_wait_share"] == pytest.approx(0.6 / 3.0)
  assert s["over_bare"] == pytest.approx(0.75)  # 60 / 80.
  assert s["scoring_images_per_s"] == pytest.approx(25.0)  # 100 images in 4 s.


def test_anatomy_from_the_last_record_and_its_table():
  records = [{"epoch": 0, "perf/wall_seconds": 99.0},
             {"epoch": 1, "perf/wall_seconds": 12.5, "perf/compilations": 7.0,
              "perf/compilations_after_first_epoch": 0.0, "perf/other_seconds": 0.25}]
  part = gpu_runs.anatomy({"records": records})
  assert part["perf/wall_seconds"] == 12.5 and part["perf/compilations"] == 7.0
  assert part["perf/startup_seconds"] is None and set(part) == set(gpu_runs.ANATOMY_KEYS)
  lines = gpu_runs.anatomy_lines([("run A", part), ("run B", None)])
  row_a = next(line for line in lines if line.startswith("| run A"))
  cells = [c.strip() for c in row_a.strip("|").split("|")]
  # wall, start-up, data open, compiling, compilations, after epoch 0, ..., other.
  assert cells[1:7] == ["12.50", "-", "-", "-", "7", "0"] and cells[-1] == "0.25"
  row_b = next(line for line in lines if line.startswith("| run B"))
  assert row_b.count("| - ") == len(gpu_runs.ANATOMY_KEYS)
  # The mean over runs: a key every run has is averaged, one any run lacks is None.
  mean = gpu_runs.mean_anatomy([part, {**part, "perf/wall_seconds": 13.5,
                                       "perf/other_seconds": None}])
  assert mean["perf/wall_seconds"] == 13.0 and mean["perf/other_seconds"] is None


def _alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie, killed but not yet reaped, does not)."""
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def test_run_process_past_its_time_is_killed_with_its_children(tmp_path):
  """A process that starts a child and sleeps: at its time limit both are gone."""
  pid_file = tmp_path / "child.pid"
  code = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
          "time.sleep(60)\n")
  start = time.perf_counter()
  status = gpu_runs.run_process([sys.executable, "-c", code], 3.0, dict(os.environ),
                                str(tmp_path / "log"))
  assert status == "timeout" and time.perf_counter() - start < 30
  child = int(pid_file.read_text())
  deadline = time.perf_counter() + 10
  while _alive(child) and time.perf_counter() < deadline:
    time.sleep(0.1)
  assert not _alive(child), "the child outlived its parent's time limit"
  assert gpu_runs.run_process([sys.executable, "-c", "raise SystemExit(4)"], 30.0,
                              dict(os.environ), str(tmp_path / "log2")) == 4


def _fake_runs(monkeypatch):
  """gpu_runs' processes replaced by runs whose records are known: each run's last record
  carries perf/wall_seconds = 10 + seed and perf/steady_step_seconds = 4 (seed 1 of
  topk_anneal-55 lacks the steady key), its process 20 + seed seconds (topk_anneal-45: 12 +
  seed)."""
  kept = {"full": 512, "topk_anneal-45": 118, "topk_anneal-55": 189}

  def run_main(config_file, workdir, flags, timeout, env):
    del config_file, timeout, env
    name = os.path.basename(workdir)  # default, <arm>_seed<seed> or imagenet.
    arm, seed = name.rsplit("_seed", 1) if "_seed" in name else ("", "0")
    seed = int(seed)
    # Fashion-MNIST: 8 epochs, the arm's kept images in epochs 1-5; else 2 epochs of 40.
    selected = ([512, *[kept[arm]] * 5, 512, 512] if arm else [40, 40])
    records = [{"epoch": e, "selected_k": k, "training_seconds": 1.0, "input_wait_seconds": 0.1,
                "scoring_seconds": 0.0, "selection_seconds": 0.0, "eval_seconds": 0.5}
               for e, k in enumerate(selected)]
    last = {"total_training_seconds": 8.0, "total_scoring_seconds": 0.0,
            "total_selection_seconds": 0.1, "report_seconds": 2.0, "checkpoint_seconds": 0.3,
            "perf/wall_seconds": 10.0 + seed}
    if not (arm == "topk_anneal-55" and seed == 1):
      last["perf/steady_step_seconds"] = 4.0
    records[-1].update(last)
    return {"command": " ".join(["python main.py", *flags]), "exit_status": 0,
            "seconds": (12.0 if arm == "topk_anneal-45" else 20.0) + seed, "records": records,
            "report": {"metrics": {"test": {"before_ts": {"accuracy": 0.5}}},
                       "seconds": {"total": 1.0}}}
  monkeypatch.setattr(gpu_runs, "run_main", run_main)
  monkeypatch.setattr(gpu_runs, "bare_step_rate", lambda *a, **k: {
      "exit_status": 0, "seconds": 1.0, "images_per_s": 80.0, "model": "tiny", "batch": 8})
  monkeypatch.setattr(gpu_runs.feeds, "write_folder", lambda *a, **k: None)
  monkeypatch.setattr(gpu_runs.input_pipeline, "open_or_prepare", lambda *a, **k: None)
  monkeypatch.setattr(gpu_runs, "machine", lambda argv, module="": {
      "backend": "cpu", "card": "cpu", "devices": 1, "cores": 2, "cpu": "test",
      "python": "3", "date": "today", "tensorflow": None, "jax": "j", "jaxlib": "j",
      "flax": "f", "optax": "o", "orbax-checkpoint": "c", "tensorflow-datasets": "t",
      "torch": None, "command": "python -m benchmarks.gpu_runs --tiny"})


def test_gpu_runs_tables_each_arms_anatomy_from_its_runs(tmp_path, monkeypatch):
  _fake_runs(monkeypatch)
  assert gpu_runs.main(["--tiny", f"--out={tmp_path}", f"--workdir-root={tmp_path / 'w'}"]) == 0
  results = json.loads((tmp_path / "gpu_runs_cpu_tiny.json").read_text())
  text = (tmp_path / "gpu_runs_cpu_tiny.md").read_text()
  means = results["fashion"]["means"]
  assert means["full"]["anatomy"]["perf/wall_seconds"] == 10.5  # Seeds 0 and 1: 10, 11.
  assert means["topk_anneal-55"]["anatomy"]["perf/steady_step_seconds"] is None
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
          for line in text.splitlines() if line.startswith("| (")}
  full = rows["(b) `full`, mean of seeds 0,1"]
  assert full[1] == "10.50" and full[7] == "4.00"  # wall; steady steps.
  assert rows["(b) `topk_anneal-55`, mean of seeds 0,1"][7] == "-"
  assert rows["(a) default job"][1] == "10.00" and rows["(c) ImageNet-shaped"][1] == "10.00"
  # The chosen design's wall clock over full data's: (12/20 + 13/21) / 2.
  assert results["targets"][1]["value"] == pytest.approx((12 / 20 + 13 / 21) / 2)


def _wheel(path, members: dict[str, bytes]) -> None:
  with zipfile.ZipFile(path, "w") as z:
    for name, data in members.items():
      z.writestr(name, data)


def test_keep_one_python_leaves_only_that_pythons_modules(tmp_path):
  info = "pkg-1.0.dist-info"
  so = {f"pkg/impl.cpython-{v}-x86_64-linux-gnu.so": v.encode() for v in ("311", "312", "313t")}
  record = "".join(f"{n},sha256=x,1\n" for n in [*so, "pkg/__init__.py", f"{info}/RECORD"])
  wheel = tmp_path / "pkg-1.0-py3-none-manylinux_2_28_x86_64.whl"
  _wheel(wheel, {**so, "pkg/__init__.py": b"", f"{info}/RECORD": record.encode(),
                 f"{info}/WHEEL": b"Wheel-Version: 1.0\nTag: py3-none-manylinux_2_28_x86_64\n"})
  out = carry.keep_one_python(str(wheel), "3.12")
  assert out == str(tmp_path / "pkg-1.0-cp312-none-manylinux_2_28_x86_64.whl")
  assert not wheel.exists()
  with zipfile.ZipFile(out) as z:
    assert sorted(z.namelist()) == sorted(["pkg/impl.cpython-312-x86_64-linux-gnu.so",
                                           "pkg/__init__.py", f"{info}/RECORD", f"{info}/WHEEL"])
    assert z.read("pkg/impl.cpython-312-x86_64-linux-gnu.so") == b"312"
    assert z.read(f"{info}/RECORD").decode().splitlines() == [
        "pkg/impl.cpython-312-x86_64-linux-gnu.so,sha256=x,1", "pkg/__init__.py,sha256=x,1",
        f"{info}/RECORD,sha256=x,1"]
    assert b"Tag: cp312-none-manylinux_2_28_x86_64" in z.read(f"{info}/WHEEL")
  # A wheel for one Python already, or a pure one, is left as it is.
  plain = tmp_path / "other-1.0-cp312-cp312-manylinux_2_28_x86_64.whl"
  _wheel(plain, {"other/impl.cpython-312-x86_64-linux-gnu.so": b""})
  assert carry.keep_one_python(str(plain), "3.12") == str(plain) and plain.exists()


def test_fashion_mnist_carried_as_xz_unpacks_to_the_same_bytes(tmp_path):
  source, target = tmp_path / "source", tmp_path / "carry" / "fashion-mnist"
  source.mkdir()
  contents = {}
  for i, name in enumerate(carry.FASHION_MNIST_FILES):
    contents[name[:-3]] = bytes(range(256)) * (i + 1)
    with gzip.open(source / name, "wb") as f:
      f.write(contents[name[:-3]])
  carry.copy_fashion_mnist(str(source), str(target), "xz")
  assert sorted(os.listdir(target)) == sorted(n[:-3] + ".xz" for n in carry.FASHION_MNIST_FILES)
  written = carry.unpack(str(tmp_path / "carry"))
  assert sorted(os.path.basename(p) for p in written) == sorted(contents)
  for name, raw in contents.items():
    assert hashlib.sha256((target / name).read_bytes()).digest() == hashlib.sha256(raw).digest()


def test_carry_for_gpu_check_names_its_groups_and_requirements():
  preset = carry.PRESETS["gpu_check"]
  assert preset["groups"] == ("training", "gpu-decode") and preset["fashion_format"] == "xz"
  with open(carry.GPU_DECODE_REQUIREMENTS) as f:  # Not installed here: the file's lines.
    lines = [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]
  assert carry.pinned(("gpu-decode",)) == lines and lines[0].startswith("nvidia-nvimgcodec")
  result = subprocess.run([sys.executable, "-m", "benchmarks.carry", "--for=nothing"],
                          cwd=gpu_runs.REPO, capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and "invalid choice: 'nothing'" in result.stderr
