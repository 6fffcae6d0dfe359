"""CI smoke runs of the benchmarks at tiny sizes, so they never rot (no timing asserted)."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import feeds, gpu_check, xla_cpu_variants
from tests import helpers, test_without_tensorflow
from tests.helpers import REPO, subprocess_env

pytestmark = pytest.mark.slow  # Each smoke run is a process that compiles and runs steps.


def _run(module, *args, tmp_path):
  out = os.path.join(tmp_path, "result.json")
  # 600 s: beside the suite's longest runs on 2 cores the Fashion-MNIST one took over 300.
  result = subprocess.run([sys.executable, "-m", module, *args, f"--json={out}"], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=600)
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


def test_device_stage_smoke(tmp_path):
  """The device op's programs: all compiled ahead on each of 2 devices, none during the
  passes; the overlap part's seconds (no timing asserted)."""
  results, stdout = _run("benchmarks.device_stage", "--cpu-devices=2", "--images=24",
                         "--max-side=120", "--batch-size=4", "--epochs=1", "--batches=3",
                         "--overlap-batch=2", "--decode-seconds=0.05", "--step-seconds=0.05",
                         tmp_path=tmp_path)
  programs = results["programs"]
  assert programs["devices"] == 2 and programs["compile_ahead"]
  assert programs["compiled_in_passes"] == 0 and programs["compiled_ahead"] >= 2
  assert programs["compiled_ahead"] % 2 == 0  # The same programs on each device.
  overlap = results["overlap"]
  assert overlap["unpipelined_seconds"] >= 3 * 0.1  # Each batch's decode and step in turn.
  assert overlap["pipelined_seconds"] > 0 and "device op programs:" in stdout


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
  assert "train_steps" in results["profile_top_tottime"] and "trainer / bare" in stdout


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
  # Process workers by default; threads (named in the results) where cpjax has none.
  assert results["worker_kind"] == ("process" if feeds.reader_options("process") is not None
                                    else "thread")
  folder = results["feeds"]["folder"]
  assert 0 <= folder["median_first_batch_seconds"] <= folder["median_blocked_seconds"]
  assert "input-wait share" in stdout


# Keys of every row of benchmarks.gpu_table at tiny sizes (its CIFAR batches are 4 and 8).
GPU_TABLE_ROWS = (
    "r50_train_cpjax", "r50_train_flax_bare", "r50_train_torch_eager",
    "r50_train_torch_compile", "r50_score_cpjax", "r50_score_torch_eager",
    "cifar_r34_train_b4_cpjax", "cifar_r34_train_b4_torch_eager",
    "cifar_r34_train_b8_cpjax", "cifar_r34_train_b8_torch_eager",
    "host_stage_threads", "host_stage_processes", "host_stage_torch_dataloader",
    "device_stage_train", "device_stage_eval", "r50_score_fed_device_stage",
    "r50_score_fed_host_processes")
_BLOCKER = '''
import sys


class _NoTensorFlow:
  """Makes TensorFlow, tensorflow_datasets and clu unimportable, as on a GPU machine."""

  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("tensorflow", "tensorflow_datasets", "clu"):
      raise ImportError(f"{name} is blocked: the GPU table must run without it")
    return None


sys.meta_path.insert(0, _NoTensorFlow())
'''


def _no_tensorflow_env(tmp_path) -> dict[str, str]:
  """A child environment where TensorFlow, tensorflow_datasets and clu cannot be imported
  (a sitecustomize on PYTHONPATH: worker processes get it too); checked before use."""
  blocker = tmp_path / "site"
  blocker.mkdir()
  (blocker / "sitecustomize.py").write_text(_BLOCKER)
  env = subprocess_env(PYTHONPATH=os.pathsep.join([str(blocker), REPO]))
  for module in ("tensorflow", "tensorflow_datasets", "clu"):
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "is blocked" in probe.stderr, module  # In force.
  return env


def test_input_wait_runs_without_tensorflow(tmp_path):
  """On a GPU machine without TensorFlow: the folder feed runs, the records feed (which
  needs cpjax.data.sources) is skipped with a note."""
  out = tmp_path / "wait.json"
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.input_wait", "--model=tiny", "--image-size=16",
       "--batch-size=8", "--steps=2", "--workers=1", "--source-size=40x30", "--repeats=1",
       f"--json={out}"], env=_no_tensorflow_env(tmp_path), cwd=REPO, capture_output=True,
      text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads(out.read_text())
  assert sorted(results["feeds"]) == ["folder", "resident"]
  assert "tensorflow" in results["records_skipped"] and "no records feed" in result.stdout
  assert results["feeds"]["folder"]["median_seconds"] > 0


def _resnet50_macs_by_hand(size: int = 224, classes: int = 1000) -> int:
  """He et al. 2016, Table 1 (v1.5: the stride on the bottleneck's 3x3), conv by conv."""
  side = size // 2
  macs = side * side * 64 * 7 * 7 * 3  # Stem: 7x7/2, 3 -> 64 channels.
  side, inputs = side // 2, 64  # 3x3/2 max-pool.
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
    for i in range(blocks):
      out = side // (2 if stage > 0 and i == 0 else 1)
      macs += side * side * inputs * width  # 1x1 reduce, at the input's size.
      macs += out * out * width * width * 9  # 3x3, strided.
      macs += out * out * width * 4 * width  # 1x1 expand.
      if i == 0:
        macs += out * out * inputs * 4 * width  # 1x1 projection shortcut.
      side, inputs = out, 4 * width
  return macs + inputs * classes  # The linear head.


def test_model_flops_of_resnet50_match_a_hand_count_and_torchvision():
  from benchmarks import model_flops  # pylint: disable=import-outside-toplevel
  from cpjax import models  # pylint: disable=import-outside-toplevel
  counted = model_flops.forward_macs(models.create_model("resnet50_imagenet", 1000), (224, 224, 3))
  assert counted == pytest.approx(_resnet50_macs_by_hand(), rel=1e-6)
  assert counted == pytest.approx(4.09e9, rel=0.01)  # torchvision's documented 4.09 G(MAC)s.
  train = model_flops.train_flops_per_image(models.create_model("resnet50_imagenet", 1000),
                                            (224, 224, 3))
  assert train == pytest.approx(6 * counted)  # 3 forwards, 2 FLOPs a MAC: ~24.5 GFLOP.
  assert model_flops.mfu(24.6e9, 6725.0, 989e12, 1) == pytest.approx(0.1673, abs=1e-4)
  assert model_flops.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert model_flops.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
  assert model_flops.peak_bf16_flops("cpu") is None
  assert model_flops.mfu(1.0, 1.0, None, 1) is None


def test_gpu_table_tiny_runs_without_tensorflow(tmp_path):
  """`--tiny` end to end in a process where TensorFlow, tensorflow_datasets and clu cannot
  be imported (the GPU machine has none): every row has numbers or names why it has none."""
  env = _no_tensorflow_env(tmp_path)
  out = tmp_path / "table.json"
  result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_table", "--tiny",
                           f"--out={out}"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  results = json.loads(out.read_text())
  rows = results["rows"]
  assert sorted(rows) == sorted(GPU_TABLE_ROWS)
  torch_missing = importlib.util.find_spec("torch") is None
  for key, row in rows.items():
    assert "error" not in row, (key, row["error"])
    if "skipped" in row:  # Only where a reason holds: no torch, no process workers, tiny.
      note = row["skipped"]
      assert (("torch" in note and torch_missing and "torch" in key)
              or ("process workers" in note and "process" in key)
              or (key == "r50_train_torch_compile" and "tiny" in note)), (key, note)
      continue
    assert math.isfinite(row["images_per_s"]) and row["images_per_s"] > 0, key
    if key.startswith("host_stage"):
      assert row["cpu_ms_per_image"] > 0 and row["images"] == 16, key
    if "device_stage" in key:  # No GPU here: the rows' code runs with the PIL stand-in.
      assert row["decoder"].startswith("device_cpu"), key
    if key.startswith("r50_score_fed"):
      assert row["images"] == 16 and row["imagenet_train_split_seconds"] > 0, key
  for key in ("r50_train_cpjax", "r50_train_flax_bare", "r50_score_cpjax", "host_stage_threads"):
    assert "images_per_s" in rows[key], key  # These need nothing but cpjax and its deps.
  # The tiny net at 16 px with the ImageNet rows' 1,000 classes, layer by layer:
  # conv 3x3 3->8 at 16x16, conv 3x3/2 8->16 to 8x8, dense 16->1000.
  assert results["flops"]["forward_gmac_per_image"] * 1e9 == pytest.approx(
      16 * 16 * 8 * 9 * 3 + 8 * 8 * 16 * 9 * 8 + 16 * 1000)
  assert results["flops"]["peak_bf16_flops_per_device"] is None and "MFU omitted" in (
      results["flops"]["note"])
  assert rows["r50_train_cpjax"]["mfu"] is None
  machine = results["machine"]
  assert machine["card"] and machine["jax"] and machine["flax"] and machine["date"]
  assert machine["command"].startswith("python -m benchmarks.gpu_table --tiny")
  assert "r50_train cpjax / bare flax" in results["ratios"] and "model FLOPs" in result.stdout


def test_host_stage_smoke(tmp_path):
  """The worker sweep: each pipeline at 1 and 2 workers, or the reason it is skipped."""
  results, stdout = _run("benchmarks.host_stage", "--images=16", "--batch-size=8",
                         "--workers=1,2", "--repeats=1", "--size=32", tmp_path=tmp_path)
  assert sorted(results["results"]) == ["1", "2"]
  processes = feeds.reader_options("process") is not None
  for rows in results["results"].values():
    assert list(rows) == ["cpjax threads", "cpjax processes", "tf.data (flax)",
                          "torch DataLoader"]
    for name, row in rows.items():
      library = {"cpjax processes": processes, "tf.data (flax)": importlib.util.find_spec(
          "tensorflow") is not None, "torch DataLoader": importlib.util.find_spec(
              "torch") is not None}.get(name, True)
      if not library:
        assert row["skipped"], name
        continue
      assert row["images_per_s"] > 0 and row["cpu_ms_per_image"] > 0, name
      assert len(row["runs"]) == 1, name
  ratios = results["ratios"]
  threads = results["results"]
  assert ratios["cpjax threads: 2 workers / 1"] == pytest.approx(
      threads["2"]["cpjax threads"]["images_per_s"] / threads["1"]["cpjax threads"]["images_per_s"])
  if processes and "images_per_s" in threads["2"]["tf.data (flax)"]:
    assert "2 workers: processes / tf.data, images/s" in ratios
  assert "ratio cpjax threads: 2 workers / 1" in stdout


def test_reader_options_follow_the_readers_signature(monkeypatch):
  """`worker_kind` is passed only to a reader that takes it; threads need nothing, and a
  reader without the keyword has no process workers."""
  from cpjax.data import host_stage  # pylint: disable=import-outside-toplevel

  class ThreadsOnly:
    def __init__(self, source, transform, mesh, num_workers=0, prefetch_depth=2, read_ahead=2):
      pass

  class BothKinds:
    def __init__(self, source, transform, mesh, num_workers=0, prefetch_depth=2, read_ahead=2,
                 worker_kind="process"):
      pass

  monkeypatch.setattr(host_stage, "PreprocessReader", ThreadsOnly)
  assert feeds.reader_options("thread") == {} and feeds.reader_options("process") is None
  monkeypatch.setattr(host_stage, "PreprocessReader", BothKinds)
  assert feeds.reader_options("process") == {"worker_kind": "process"}
  assert feeds.reader_options("thread") == {"worker_kind": "thread"}
  with pytest.raises(ValueError, match="'fiber'.*thread.*process"):
    feeds.reader_options("fiber")


def test_write_folder_forks_only_before_jax_starts(tmp_path):
  """Generated JPEGs are written by forked processes only while JAX runs no backend; the
  files are the same either way (image i is a function of i)."""
  code = ("import sys, jax\nfrom benchmarks import feeds\n"
          "before = feeds.started_backend()\n"
          "feeds.write_folder(sys.argv[1] + '/a', 6, 40, 30, classes=2, workers=2)\n"
          "jax.devices()\n"
          "feeds.write_folder(sys.argv[1] + '/b', 6, 40, 30, classes=2, workers=2)\n"
          "print(before, feeds.started_backend())\n")
  result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["False", "True"]
  files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.JPEG"))
  assert len(files) == 6 + 2 * 2  # Train, plus one a class in val and in test.
  for name in files:
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def _test_accuracy(workdir) -> float:
  with open(os.path.join(workdir, "report", "results.json")) as f:
    return json.load(f)["metrics"]["test"]["before_ts"]["accuracy"]


def _last_record(workdir) -> dict:
  return helpers.read_metrics(str(workdir))[-1]


def test_gpu_check_tiny_runs_every_part_through_main_py_and_records_what_the_runs_wrote(
    tmp_path):
  """`benchmarks.gpu_check --tiny` end to end on a CPU, TensorFlow absent throughout: every
  part recorded as done with this code's digest, every run main.py's (workdir, checkpoints,
  metrics.jsonl, report) and its numbers and anatomy the workdirs'; then --resume keeps them
  all. Fashion-MNIST's 8-epoch tiny schedule is 16 steps of 32 an epoch on 512 images;
  topk_anneal-45 keeps round(0.23 x 512) = 118 images (4 steps) in epochs 1-5 and all in the
  last 2; a step is 3 passes of 32. The ImageNet-shaped runs: 40 generated JPEGs, all in
  epoch 0, then the top half (20) by one fresh scoring pass, in each of 2 more epochs."""
  helpers.require_fashion_mnist()
  path, runs, mirror = tmp_path / "gpu_check_cpu_tiny.json", tmp_path / "runs", tmp_path / "out"
  command = [sys.executable, "-m", "benchmarks.gpu_check", "--tiny", f"--results={path}",
             f"--workdir-root={runs}", f"--mirror={mirror}"]
  result = subprocess.run(command, cwd=REPO, env=test_without_tensorflow.without_tensorflow_env(),
                          capture_output=True, text=True, timeout=3600)
  assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
  results = json.loads(path.read_text())
  records = results["parts"]
  assert list(records) == [p.name for p in gpu_check.PARTS]
  for record in records.values():
    assert record["status"] == "done" and record["sizes"] == "tiny" and record["card"] == "cpu"
    assert record["code_digest"] == gpu_check.code_digest()
  assert json.loads((mirror / path.name).read_text()) == results
  assert (mirror / "gpu_check_cpu_tiny.md").read_text() == gpu_check.markdown(results)
  parts = {name: record["numbers"] for name, record in records.items()}

  def assert_anatomy(anatomy, workdir):  # Each run's anatomy: its last record's keys.
    last = _last_record(workdir)
    assert anatomy == {k: last.get(k) for k in gpu_check.ANATOMY_KEYS}, workdir
  _assert_fashion(parts["fashion"], runs, assert_anatomy)
  for name, decode in (("imagenet_host", "cpu"), ("imagenet_gpu", "device_cpu")):
    _assert_imagenet(parts[name], decode, runs, assert_anatomy)
  assert parts["imagenet_host"]["folder"]["written"]  # Written once, read by the second.
  assert not parts["imagenet_gpu"]["folder"]["written"]
  # The scoring part: gpu_table's rows over the same folder, the PIL stand-in decoding.
  scoring = parts["scoring"]
  assert f"--folder={runs / 'imagenet_shaped'}" in scoring["command"].split()
  assert sorted(scoring["rows"]) == sorted(gpu_check.SCORING_ROWS)
  rows = scoring["rows"]
  assert all(row["images_per_s"] > 0 for row in rows.values())
  assert rows["r50_score_fed_device_stage"]["decoder"].startswith("device_cpu")
  assert scoring["ratios"][gpu_check.FED_RATIO] == pytest.approx(
      rows["r50_score_fed_device_stage"]["images_per_s"] / rows["r50_score_cpjax"]["images_per_s"])
  job = parts["default_job"]
  assert job["epochs"] == 2 and job["test_accuracy"] == _test_accuracy(runs / "default")
  assert_anatomy(job["anatomy"], runs / "default")
  targets = gpu_check.targets(results)
  assert all(t["status"] == "not measured (tiny sizes, not a GPU)" for t in targets)
  assert targets[1]["value"] == pytest.approx(parts["fashion"]["paired"]["wall_seconds_ratio"][0])
  # Again with --resume: every part is kept, nothing runs, the records are unchanged.
  again = subprocess.run([*command, "--resume"], cwd=REPO,
                         env=test_without_tensorflow.without_tensorflow_env(),
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert [line.split(":")[0] for line in again.stdout.splitlines() if ": kept, done on" in line
          ] == [p.name for p in gpu_check.PARTS]
  assert json.loads(path.read_text()) == results


def _assert_fashion(fashion, runs, assert_anatomy) -> None:
  """Full data and topk_anneal-45 at seed 0 (tiny sizes), each a main.py run with its own
  report."""
  assert [(r["arm"], r["seed"]) for r in fashion["runs"]] == [("full", 0), ("topk_anneal-45", 0)]
  steps = {"full": 8 * 16, "topk_anneal-45": 3 * 16 + 5 * 4}
  kept = {"full": 512, "topk_anneal-45": 118}
  for row in fashion["runs"]:
    workdir = runs / f"{row['arm']}_seed{row['seed']}"
    assert row["test_accuracy"] == _test_accuracy(workdir) and 0 <= row["test_accuracy"] <= 1
    assert row["passes"] == steps[row["arm"]] * 32 * 3, row
    records = helpers.read_metrics(str(workdir))
    assert [r["selected_k"] for r in records] == [512] + [kept[row["arm"]]] * 5 + [512] * 2
    assert helpers.checkpoint_steps(str(workdir))[-1] == steps[row["arm"]]
    phases = sum(row[f"{p}_seconds"] for p in ("training", "scoring", "selection", "eval",
                                                "report"))
    assert 0 < phases < row["wall_seconds"], row  # Parts of the process's time.
    assert_anatomy(row["anatomy"], workdir)
  assert fashion["arms"]["topk_anneal-45"]["selection.fraction"] == 0.23  # The study's rule.
  p = fashion["paired"]
  difference = 100 * (_test_accuracy(runs / "topk_anneal-45_seed0")
                      - _test_accuracy(runs / "full_seed0"))
  assert p["seeds"] == [0] and p["per_seed"]["accuracy_points"] == pytest.approx([difference])
  assert p["passes_ratio"][0] == pytest.approx(steps["topk_anneal-45"] / steps["full"])
  walls = {r["arm"]: r["wall_seconds"] for r in fashion["runs"]}
  assert p["wall_seconds_ratio"][0] == pytest.approx(walls["topk_anneal-45"] / walls["full"])


def _assert_imagenet(part, decode, runs, assert_anatomy) -> None:
  """One ImageNet-shaped run over the folder of 40 JPEGs in 10 classes, its compilation
  cache folder the command's."""
  run = part["run"]
  workdir = runs / f"imagenet_{'host' if decode == 'cpu' else 'decode_gpu'}"
  assert run["decode"] == decode
  assert f"--config.compilation_cache_dir={runs / 'xla_cache_imagenet'}" in run["command"].split()
  assert (f"--config.dataset.decode={decode}" in run["command"].split()) == (decode != "cpu")
  records = helpers.read_metrics(str(workdir))
  assert [r["selected_k"] for r in records] == [40, 20, 20]
  with open(f"{workdir}.log") as f:  # One fresh scoring pass, before epoch 1.
    assert [line.split("Scoring pass for ")[1][:7] for line in f
            if "Scoring pass for epoch" in line and "done in" in line] == ["epoch 1"]
  assert [e["images"] for e in run["epochs"]] == [40, 20, 20]
  later = records[1:]
  seconds = sum(r["training_seconds"] for r in later)
  steady = run["steady"]
  assert steady["images"] == 40 and steady["training_seconds"] == pytest.approx(seconds)
  assert steady["images_per_s"] == pytest.approx(40 / seconds)
  assert steady["input_wait_share"] == pytest.approx(
      sum(r["input_wait_seconds"] for r in later) / seconds)
  assert steady["scoring_images_per_s"] == pytest.approx(40 / records[1]["scoring_seconds"])
  assert run["checkpoint_seconds"] > 0 and run["peak_device_memory_bytes"] is None
  assert_anatomy(run["anatomy"], workdir)
  with open(workdir / "classes.json") as f:
    assert len(json.load(f)["classes"]) == 10


def test_carry_pins_requirements_versions_and_names_groups():
  """The carried wheels are requirements.txt's pinned versions wherever it pins them (the
  gpu-decode group's, not installed here, as requirements-gpu-decode.txt states them)."""
  from benchmarks import carry  # pylint: disable=import-outside-toplevel
  with open(os.path.join(REPO, "requirements.txt")) as f:
    pins = dict(line.split("#")[0].strip().split("==") for line in f
                if "==" in line.split("#")[0])
  pinned = dict(r.split("==") for r in carry.pinned(tuple(carry.GROUPS)) if "==" in r)
  shared = set(pins) & set(pinned)
  assert {"ml-collections", "clu", "tensorflow-datasets", "grain", "array-record",
          "scikit-learn", "matplotlib", "opencv-python-headless"} <= shared
  assert all(pinned[name] == pins[name] for name in shared), shared
  with pytest.raises(SystemExit, match="unknown group 'tfds'.*training, digits, report"):
    carry.parse_groups("training,tfds")


def test_carry_check_names_what_a_machine_lacks(tmp_path):
  """--check in a process where grain and clu cannot be imported: it names them, their group
  and the command that brings them, and exits 1."""
  site = tmp_path / "site"
  site.mkdir()
  (site / "sitecustomize.py").write_text(_BLOCKER.replace(
      '("tensorflow", "tensorflow_datasets", "clu")', '("grain", "clu")'))
  env = subprocess_env(PYTHONPATH=os.pathsep.join([str(site), REPO]))
  result = subprocess.run([sys.executable, "-m", "benchmarks.carry", "--check"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 1, result.stdout + result.stderr
  training = next(line for line in result.stdout.splitlines() if line.startswith("training"))
  assert training.split("missing: ")[1] == "clu, grain"
  assert "report    all importable" in result.stdout
  assert "--groups=training" in result.stdout and "is blocked" in result.stdout


def test_report_speed_smoke(tmp_path):
  """Both cache modes of this checkout at a tiny size (no baseline: nothing to compare)."""
  results, stdout = _run("benchmarks.report_speed", "--classes=3", "--val=60", "--test=100",
                         "--bootstrap-resamples=5", "--repeats=1", tmp_path=tmp_path)
  for mode in ("cold this", "warm this"):
    seconds = results["seconds"][mode]
    assert seconds["report"] > 0 and seconds["later_images"] > 0 and seconds["report_files"] > 0
  assert results["differences"] == {} and "cold this" in stdout


def test_conformal_speed_smoke(tmp_path):
  results, stdout = _run("benchmarks.conformal_speed", "--classes", "3", "40", "--val=200",
                         "--test=300", "--resamples=20", "--repeats=1", tmp_path=tmp_path)
  for k in ("3", "40"):
    seconds = results["seconds"][k]
    assert seconds["section"] > 0 and seconds["split_conformal"] > 0, k
    assert seconds["target"] is None
  assert "section s" in stdout and results["machine"]["load_average"]
