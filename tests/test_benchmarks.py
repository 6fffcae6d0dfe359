"""CI smoke runs of the benchmarks at tiny sizes, so they never rot (no timing asserted)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import xla_cpu_variants
from tests.helpers import REPO, subprocess_env

pytestmark = pytest.mark.slow  # Each smoke run is a process that compiles and runs steps.


def _run(module, *args, tmp_path):
  out = os.path.join(tmp_path, "result.json")
  result = subprocess.run([sys.executable, "-m", module, *args, f"--json={out}"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(out) as f:
    return json.load(f), result.stdout


def test_throughput_smoke(tmp_path):
  results, stdout = _run("benchmarks.throughput", "--model=tiny", "--batch-size=16",
                         "--score-batch-size=32", "--windows=1", "--steps=1", tmp_path=tmp_path)
  for key in ("compile_seconds", "train_images_per_s", "score_float32_images_per_s",
              "score_bfloat16_images_per_s"):
    assert results["jax"][key] > 0, key
  assert "jax.train_images_per_s" in stdout and results["machine"]["backend"] == "cpu"


def test_epoch_cost_smoke_on_real_fashion_mnist(fashion_mnist_tfds, tmp_path):
  results, stdout = _run("benchmarks.epoch_cost", "--data=fashion_mnist", "--num-examples=600",
                         f"--data-dir={fashion_mnist_tfds[0]}", "--fractions", "0.3",
                         "--batch-size=32", "--score-batch-size=64", "--readers", "device",
                         tmp_path=tmp_path)  # The host reader's epochs run the same code.
  epochs = results["epochs"]
  assert sorted(epochs) == ["device full", "device top_k 30% fresh",
                            "device top_k 30% train_pass"]
  assert epochs["device full"]["k"] == 600 and epochs["device full"]["ratio_to_full"] == 1.0
  assert epochs["device top_k 30% train_pass"]["k"] == epochs["device top_k 30% fresh"]["k"] == 180
  fresh = epochs["device top_k 30% fresh"]["scoring_share_of_forward"]
  assert fresh > 0 and epochs["device top_k 30% train_pass"]["scoring_share_of_forward"] is None
  for case in epochs.values():  # Every phase measured, and the total is their sum.
    phases = [case[f"{p}_seconds"] for p in ("scoring", "selection", "training")]
    assert min(phases) >= 0 and case["total_seconds"] == sum(phases)
  assert "x full" in stdout


def test_profile_step_smoke(tmp_path):
  """The trace is read back and the tiny net's ops land in named categories."""
  results, stdout = _run("benchmarks.profile_step", "--model=tiny", "--batch-size=16",
                         "--steps=1", "--xla-cpu-options=xla_default", tmp_path=tmp_path)
  assert results["wall_seconds_per_step"] > 0 and results["op_seconds_per_step"] > 0
  assert abs(sum(results["by_category"].values()) - results["op_seconds_per_step"]) < 1e-9
  assert any(c.startswith("conv ") for c in results["by_category"]), results["by_category"]
  assert "summed op time" in stdout


def test_xla_cpu_variants_smoke():
  """In this process (no start-up cost): two variants of the tiny net's train step."""
  for name in ("tuned (cpjax default)", "no YNNPACK"):
    result = xla_cpu_variants.measure("tiny", 16, 1, xla_cpu_variants.VARIANTS[name])
    assert result["compile_seconds"] > 0 and result["train_images_per_s"] > 0, name


def test_lowering_smoke(tmp_path):
  results, stdout = _run("benchmarks.lowering", "--models", "tiny:digits", "--batch-size=8",
                         tmp_path=tmp_path)
  steps = results["steps"]
  assert len(steps) == 10  # 5 step kinds x 2 dtypes.
  assert all(row["cuda_problems"] == row["tpu_problems"] == [] for row in steps)
  assert all(row["flops_per_example"] > 0 for row in steps) and "MFLOP/ex" in stdout


def test_restart_cache_smoke(tmp_path):
  results, stdout = _run("benchmarks.restart_cache", "--config=configs/test.py", "--repeats=1",
                         tmp_path=tmp_path)
  assert results["fresh_seconds"]["first_step"] > results["fresh_seconds"]["imports"] > 0
  assert results["cache_entries"] > 0 and len(results["restart_seconds"]) == 1
  assert "speed-up" in stdout


def test_prefetch_smoke(tmp_path):
  results, stdout = _run("benchmarks.prefetch", "--model=tiny", "--batch-size=16", "--steps=4",
                         "--repeats=1", "--delay-ms=1", "--depths", "0", "2",
                         tmp_path=tmp_path)
  assert sorted(results["epochs"]) == ["0", "2"] and results["epochs"]["0"]["ratio_to_first"] == 1
  assert results["delay_seconds"] == 0.001 and "prefetch_depth" in stdout


def test_loop_overhead_smoke(tmp_path):
  results, stdout = _run("benchmarks.loop_overhead", "--batch-size=16", "--steps=5",
                         "--log-every=2", "--repeats=1", "--profile", tmp_path=tmp_path)
  assert results["trainer_steps_per_s"] > 0 and results["best_ratio"] > 0
  assert "train_epoch" in results["profile_top_tottime"] and "trainer / bare" in stdout


def test_record_size_smoke(tmp_path):
  results, stdout = _run("benchmarks.record_size", "--images=8", "--classes=2", "--num-shards=2",
                         tmp_path=tmp_path)
  # Every byte of the 8 files is in the records: at least the files' size.
  assert results["images"] == 8 and results["records_bytes"] >= results["source_bytes"] > 0
  assert results["ratio"] == results["records_bytes"] / results["source_bytes"]
  assert "records / files" in stdout


def test_input_wait_smoke(tmp_path):
  results, stdout = _run("benchmarks.input_wait", "--model=tiny", "--image-size=16",
                         "--batch-size=8", "--steps=2", "--threads=1", "--source-size=40x30",
                         "--repeats=1", tmp_path=tmp_path)
  assert sorted(results["feeds"]) == ["folder", "records", "resident"]
  assert results["feeds"]["resident"]["input_wait_share"] == 0 and results["images"] == 16
  assert "input-wait share" in stdout
