"""Every script, benchmark and study runs as `python -m ...` from the checkout, at tiny sizes
(the benchmarks that train: tests/test_benchmarks.py). Each smoke run checks its output against
what the inputs imply, not only that it exits 0."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from cpjax.data import array_records, input_pipeline
from tests.helpers import REPO, subprocess_env, tiny_config


def _module(module: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  """`python -m module args` from the checkout, as the docs tell a user to run it."""
  result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


@pytest.mark.slow  # Each smoke run is a `python -m` process.
def test_metrics_speed_smoke(tmp_path):
  out = tmp_path / "metrics_speed.json"
  stdout = _module("benchmarks.metrics_speed", "--n=300", "--k=5", "--resamples=10",
                   f"--json={out}").stdout
  result = json.loads(out.read_text())
  seconds = result["seconds"]
  metric_names = ("ece", "adaptive_ece", "classwise_ece", "mce", "smooth_ece", "nll", "brier",
                  "top5")
  assert all(seconds[name] > 0 for name in metric_names)
  assert math.isclose(seconds["all_metrics"], sum(seconds[name] for name in metric_names))
  assert seconds["bootstrap_ece"] > 0 and seconds["bootstrap_adaptive_ece"] > 0
  assert result["resamples"] == 10 and "bootstrap 10 x ece" in stdout


def _write_jsonl(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.slow
def test_compare_metrics_finds_exactly_the_changed_field(tmp_path):
  """Timing fields are ignored, null and NaN both mean "no number", one changed value counts."""
  base = [{"epoch": 0, "train_loss": 0.5, "val_ece": None, "train_seconds": 1.0},
          {"epoch": 1, "train_loss": 0.25, "val_ece": 0.125, "train_seconds": 2.0}]
  _write_jsonl(tmp_path / "a.jsonl", base)
  _write_jsonl(tmp_path / "same.jsonl", [{**r, "train_seconds": 9.0} for r in base])
  _write_jsonl(tmp_path / "other.jsonl", [base[0], {**base[1], "val_ece": 0.25}])
  same = _module("scripts.compare_metrics", str(tmp_path / "a.jsonl"), str(tmp_path / "same.jsonl"))
  assert "2 epochs, 3 non-timing fields: all equal" in same.stdout
  result = subprocess.run([sys.executable, "-m", "scripts.compare_metrics",
                           str(tmp_path / "a.jsonl"), str(tmp_path / "other.jsonl")], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert "epoch 1 val_ece: 0.125 vs 0.25" in result.stdout and "1 differences" in result.stdout


@pytest.mark.slow
def test_grad_norm_regrouping_smoke():
  stdout = _module("scripts.grad_norm_regrouping", "--config=configs/test.py", "--steps=2").stdout
  differences = re.findall(r"^step (\d+): max relative parameter difference (\S+)$", stdout,
                           re.MULTILINE)
  assert [step for step, _ in differences] == ["1", "2"], stdout
  assert all(0.0 <= float(value) < 1e-3 for _, value in differences), stdout


@pytest.mark.slow
def test_write_array_records_reads_back_the_config_splits(tmp_path):
  out = tmp_path / "stream"
  stdout = _module("scripts.write_array_records", "--config=configs/test.py", f"--out={out}",
                   "--num_shards=2").stdout
  dataset = tiny_config().dataset
  expected = input_pipeline.get_datasets(dataset)
  for name, split in expected.items():
    assert f"{name}: {len(split)} examples" in stdout
    index, shape, paths = array_records.read_index(str(out), name, dataset)
    np.testing.assert_array_equal(index.ids, split.ids)
    np.testing.assert_array_equal(index.labels, split.labels)
    rows = np.array([0, len(split) // 2, len(split) - 1])
    images = array_records.RecordImages(paths, shape, len(split)).read(rows)
    np.testing.assert_array_equal(images, split.images[rows])


@pytest.mark.slow
@pytest.mark.parametrize("module, flag", [
    ("studies.losses", "--out"), ("studies.prioritization", "--out"),
    ("studies.selection", "--out"), ("studies.meta_calibration", "--out"),
    ("studies.long_schedule", "--summarise-only"), ("studies.posthoc", "--out"),
    ("studies.frontier", "--summarise-only"),
    # Writes a folder dataset from the real Fashion-MNIST files (Debian's package).
    ("scripts.fashion_mnist_to_folder", "--idx_dir"),
    # Folder-dataset benchmarks (thousands of generated files): here their command lines.
    ("benchmarks.folder_memory", "--sizes"), ("benchmarks.host_stage", "--images"),
    # Timed in-process at a tiny size in tests/test_benchmarks.py; here its command line.
    ("benchmarks.xla_cpu_variants", "--batch-size"),
    # Its parts at tiny sizes in tests/test_benchmarks.py, its records in
    # tests/test_gpu_check.py: here its command line.
    ("benchmarks.gpu_check", "--resume")])
def test_long_entry_points_start(module, flag):
  """A study trains for minutes to hours; here its command line parses and lists `flag`."""
  assert flag in _module(module, "--help").stdout


@pytest.mark.slow
def test_registry_tables_find_the_docs_up_to_date():
  assert "up to date" in _module("scripts.registry_tables", "--check").stdout


@pytest.mark.slow
def test_the_own_loop_example_starts():
  """Run for a few epochs in tests/test_library.py; here its command line."""
  assert "--epochs" in _module("examples.own_loop", "--help").stdout


def test_every_entry_point_has_a_smoke_test():
  """A new script, benchmark or example with a __main__ must get a smoke run here or in
  tests/test_benchmarks.py."""
  tested = ""
  for name in ("test_entry_points.py", "test_benchmarks.py"):
    with open(os.path.join(REPO, "tests", name)) as f:
      tested += f.read()
  for directory in ("scripts", "benchmarks", "studies", "examples"):
    for file in sorted(os.listdir(os.path.join(REPO, directory))):
      if not file.endswith(".py"):
        continue
      with open(os.path.join(REPO, directory, file)) as f:
        if '__name__ == "__main__"' not in f.read():
          continue
      module = f"{directory}.{file[:-3]}"
      assert f'"{module}"' in tested, f"{module} has no smoke test"


@pytest.mark.slow
def test_posthoc_fits_times_every_map_and_the_table():
  result = _module("benchmarks.posthoc_fits", "--rows=300", "--test=300", "--classes=4", "--table",
                   "--ratio")
  assert result.returncode == 0, result.stderr[-2000:]
  fitted = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("fit ")]
  assert fitted == ["none", "temperature", "vector_scaling", "matrix_scaling", "dirichlet",
                    "ensemble_temperature", "histogram_binning", "isotonic"]
  tabled = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("table ")]
  assert tabled == fitted  # K = 4 is under the cap: the report's table fits every map too.
  assert "post-hoc section (K = 4, 300 validation and 300 test rows)" in result.stdout
  assert "ratio" in result.stdout


@pytest.mark.slow
def test_soak_logs_memory_per_epoch(tmp_path):
  out = tmp_path / "soak.json"
  result = _module("benchmarks.soak", "--epochs=3", "--skip=0", f"--out={out}")
  assert result.returncode == 0, result.stderr[-2000:]
  with open(out) as f:
    soak = json.load(f)
  rss = [sample["rss_mib"] for sample in soak["samples"]]
  assert len(rss) == 3 and all(v > 0 for v in rss), soak
  assert soak["rss_mib_first"] == rss[0] and soak["rss_mib_last"] == rss[-1]


@pytest.mark.slow
def test_decode_difference_compares_the_device_stage_with_the_host_stage(tmp_path):
  """`benchmarks.decode_difference` at tiny sizes: a row per pass for the CPU stand-in, and
  with the host stage's reduced-scale decode off both stages apply one resize rule to the same
  decoded pixels, so they agree within 1 level (docs/data.md)."""
  out = tmp_path / "diff.json"
  _module("benchmarks.decode_difference", "--images=4", "--size=32", f"--out={out}")
  rows = json.loads(out.read_text())["rows"]
  assert set(rows["device_cpu"]) >= {"train", "eval"}
  for transform in ("train", "eval"):
    same_rule = rows["device_cpu, no draft"][transform]
    assert same_rule["max_abs"] <= 1 and same_rule["share_within_1"] == 1.0, transform


@pytest.mark.slow
def test_fixed_costs_tables_two_sides_and_the_anatomy(tmp_path):
  """benchmarks.fixed_costs at tiny size (this checkout on both sides): its table and JSON,
  the parts of the records, and this side's anatomy with no compilation after epoch 0."""
  _module("benchmarks.fixed_costs", "--tiny", f"--out={tmp_path}", timeout=600)
  with open(tmp_path / "fixed_costs.json") as f:
    summary = json.load(f)
  for kind in ("cold", "warm"):
    current = summary["best"]["current"][kind]
    assert current["anatomy"]["perf/compilations_after_first_epoch"] == 0
    assert current["anatomy"]["perf/wall_seconds"] < current["wall"]  # Inside the process's.
    assert summary["ratios"][kind] == pytest.approx(
        current["wall"] / summary["best"]["baseline"][kind]["wall"])
  assert summary["met"]["no_compilation_after_first_epoch"] is True
  assert (tmp_path / "fixed_costs.md").read_text().startswith("# Fixed costs")
