r"""The GPU check: cpjax's trainer on one GPU, in parts that each fit 3 minutes, each part's
record written the moment it ends, so that two or three short GPU windows complete it.

  python -m benchmarks.gpu_check --resume   # one H100 or H200: the parts not yet recorded
  python -m benchmarks.gpu_check --tiny     # every part at tiny sizes on a CPU (the default
                                            # where JAX finds no GPU; the test suite's run)
  python -m benchmarks.gpu_check --render   # RESULTS.md's section from results/gpu_check_*.json

On a GPU machine without a package registry (the one measured: Python 3.12, jax with CUDA,
flax, optax, orbax, torch, scikit-learn, matplotlib, OpenCV; no TensorFlow, tfds, clu,
ml-collections or grain), bring the carry: here, where pip reaches a registry,
`python -m benchmarks.carry --for=gpu_check --out=gpu_carry` (it prints its size with the
checkout's files), then copy gpu_carry/ into the GPU machine's checkout and run there, from
the checkout's root, this one line (its results also go to $OUT, a folder that comes back;
benchmarks/README.md has it unbroken):

  python3 -m benchmarks.carry --unpack=gpu_carry && python3 -m pip install -q --no-index \
    --no-deps --find-links=gpu_carry/wheels -r gpu_carry/requirements.txt && python3 -m \
    benchmarks.gpu_check --resume --fashion-mnist-dir=gpu_carry/fashion-mnist --mirror="$OUT"

(pip installs into the image's own environment: nvImageCodec and nvJPEG join the `nvidia`
packages that jax's CUDA libraries are in, as they do in any CUDA environment.)

The parts, in this order, each in a process of its own (a run of the trainer is a user's
`python main.py --config=FILE --workdir=DIR [--config.X=V]` in a process of its own again,
read back from its metrics.jsonl and report):

  fashion        real Fashion-MNIST on the frontier study's 20-epoch base run: full data
                 against the study's chosen design `topk_anneal-45` (its overrides are
                 studies.frontier's), seeds 0 and 1, seed by seed, the arms alternating; no
                 compilation cache. Wall clock, seconds by phase, example passes, test
                 accuracy, the paired differences;
  imagenet_host  the ImageNet-shaped trainer (ResNet-50 in bfloat16, 224 px, batch 256, over
                 20,000 generated 500 x 375 JPEGs in 1,000 classes: generated, not
                 photographs) decoded by the host stage: 9 epochs, one warm-up epoch on all
                 images, then top-k on 90 % of them by one fresh scoring pass, 144,000 images
                 trained after epoch 0 (over 20 s at the bare step's 6,829 images/s on an
                 H200); evaluated once, at the end;
  imagenet_gpu   the same run with dataset.decode=gpu (nvImageCodec on the GPU). The two share
                 one compilation cache folder within a command: fair for their steady rates
                 (after epoch 0), not for their start-up;
  scoring        benchmarks.gpu_table's rows in a process of their own: the bare flax train
                 step (the rate the trainer's steady rate is held against), the scoring
                 pass's resident rate (batches already on the device) and a fresh scoring
                 pass fed by the device stage;
  default_job    configs/default.py as a user runs it (cpjax's compilation cache).

Each run's anatomy, where its wall clock went (start-up, opening the data, compiling,
steady and warm-up steps, input wait, evaluation, scoring, selection, checkpoints, report,
the rest), is its last metrics.jsonl record's `perf/*` keys (None where a trainer writes
none).

Records: results/gpu_check_<card>.json (h100, h200, ...; _tiny at tiny sizes; --results
names another file) holds one record a part, each written atomically (a temporary file
renamed over it) the moment the part ends: its status (done, failed or timeout), seconds,
limit, date, the machine, its numbers and the code it ran on: a digest of the files that
decide what runs (CODE_FILES: cpjax/, configs/, main.py, benchmarks/*.py, studies/*.py,
requirements*.txt; not benchmarks/results/), which a machine without .git computes too, and
the git commit where the checkout is a git checkout of its own. `--mirror=DIR` writes the
file and its markdown into DIR too after each part.

Resume: with --resume, a part recorded as done on this code digest, this card and these
sizes is kept; one recorded on another digest or card is announced (one line naming both)
and run afresh, and so is one recorded as failed or timed out. A results file that cannot be
read (not JSON, or not this command's records) is named and left as it is: the command stops
(exit status 2) before running anything. Without --resume the check starts afresh, and an
existing results file, readable or not, is first renamed to FILE.<UTC time>.bak (named in
the output, never overwritten).

Time: each part has a limit of 3 minutes (PART_LIMIT_SECONDS; --tiny: 20 minutes) and the whole
command a budget (--budget-seconds, 400 by default, counted from the start of `main`). A
part starts only if its estimate (its last recorded seconds on this card, else its
Part.estimate_seconds: its first on one H200) fits what is left of the budget, and runs
under the smaller of its limit and what is left; a part that does not fit is not started and
stays as it was recorded, for the next window.
A part past its own limit is killed with every process it started and recorded as
"timeout" (a later --resume runs it again); one stopped by the budget's end is not recorded.

Targets, met, missed or not measured (tiny sizes; a part not done; under 20 s of steady
training): Fashion-MNIST's full-data run <= 6 s outside steady steps; topk_anneal-45's wall
clock <= 0.7 x full data's; the ImageNet-shaped trainer's steady images/s >= 0.9 x the bare
step's with the host stage and with decode=gpu, its input-wait share <= 3 % with
decode=gpu; the fresh scoring pass >= 0.8 x the resident scoring rate.

Exit status: 0 when every part is recorded as done, 1 when a part is not (failed, timed out
or not started: run --resume again), 2 when the results file cannot be read.
"""

import argparse
import dataclasses
import datetime
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Callable

import numpy as np
import psutil

from benchmarks import carry, feeds
from configs import default, fashion_mnist_long, imagenet
from cpjax.calibration import report_files
from cpjax.config import implied, schema
from studies import frontier, grid, long_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results")
RESULTS_MD = os.path.join(REPO, "benchmarks", "RESULTS.md")
SECTION_HEADING = "## GPU check (`gpu_check.py`)"
FORMAT = "cpjax gpu_check records 1"
FULL, CHOSEN = "full", "topk_anneal-45"  # studies/frontier.py's arms.
ARMS = (FULL, CHOSEN)
PART_LIMIT_SECONDS = 180.0
DEFAULT_BUDGET_SECONDS = 400.0
STEADY_SECONDS = 20.0  # The ImageNet-shaped rates count as measured from this much on.
OUTSIDE_TARGET, WALL_TARGET = 6.0, 0.7
RATE_TARGET, WAIT_TARGET, SCORING_TARGET = 0.9, 0.03, 0.8
# The files whose contents decide what the check runs: its code identity.
CODE_FILES = (r"^cpjax/", r"^configs/", r"^main\.py$", r"^benchmarks/[^/]+\.py$",
              r"^studies/[^/]+\.py$", r"^requirements[^/]*\.txt$")


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What the parts run: one GPU's sizes, or `TINY` (a CPU, the test)."""
  part_limit: float = PART_LIMIT_SECONDS
  fashion: tuple = ()  # Overrides of the frontier study's base run (none: the study's own).
  default_job: tuple = ()  # Overrides of configs/default.py (none: the default job).
  classes: int = 1000  # The ImageNet-shaped folder.
  train_images: int = 20000
  source_size: tuple = (500, 375)
  imagenet: tuple = (("model.name", "resnet50_imagenet"), ("dataset.image_size", 224),
                     ("batch_size", 256), ("optimizer.learning_rate", 0.1))
  # After IMAGENET_RUN: 9 epochs, 90 % kept after the warm-up epoch, one scoring pass.
  steady: tuple = (("num_epochs", 9), ("selection.fraction", 0.9),
                   ("selection.rescore_every", 0), ("eval_every_epochs", 9),
                   ("checkpoint_every_epochs", 9), ("evaluation.bootstrap_resamples", 100),
                   ("evaluation.calibrator_resamples", 0))
  decoder: str = "gpu"  # imagenet_gpu's dataset.decode (the PIL stand-in at tiny sizes).
  seeds: tuple = (0, 1)  # The Fashion-MNIST pair's seeds, each arm run at each in turn.
  tiny: bool = False


TINY = Sizes(
    part_limit=1200.0,
    # 512 of the 54,000 images in batches of 32 (16 steps an epoch), 200 validation images,
    # 8 epochs (topk_anneal-45 keeps 23 % by the study's rule), evaluated after the last.
    fashion=(("dataset.train_examples", 512), ("dataset.val_size", 200), ("batch_size", 32),
             ("num_epochs", 8), ("eval_every_epochs", 8),
             ("evaluation.bootstrap_resamples", 20)),
    default_job=(("model.name", "tiny"), ("num_epochs", 2),
                 ("evaluation.bootstrap_resamples", 100),
                 ("evaluation.calibrator_resamples", 20)),
    classes=10, train_images=40, source_size=(64, 48),
    imagenet=(("model.name", "tiny"), ("dataset.image_size", 16), ("batch_size", 8),
              ("eval_batch_size", 8), ("selection.score_batch_size", 8),
              ("evaluation.bootstrap_resamples", 20), ("evaluation.calibrator_resamples", 20)),
    # 3 epochs: all 40 images in epoch 0, the top half (20) in each of the next two.
    steady=(("num_epochs", 3), ("selection.rescore_every", 0), ("eval_every_epochs", 3),
            ("checkpoint_every_epochs", 3)),
    # One seed: the runs' code is the same at every seed (tests/test_gpu_check.py pairs two
    # seeds' rows as a GPU's records hold them).
    decoder="device_cpu", seeds=(0,), tiny=True)
# The ImageNet-shaped runs at both sizes: top-k on half the images after one warm-up epoch
# (Sizes.steady changes the share), by a fresh scoring pass; the folder's own val/ and
# test/; the learning rate's warm-up over the first epoch (the recipe's 5 would outlast it).
IMAGENET_RUN = (("dataset.name", "folder"), ("num_epochs", 2), ("optimizer.warmup_epochs", 1.0),
                ("selection.method", "top_k"), ("selection.fraction", 0.5),
                ("selection.warmup_epochs", 1), ("selection.scoring", "fresh"))
# gpu_table's rows of the scoring part.
SCORING_ROWS = ("r50_train_flax_bare", "r50_score_cpjax", "r50_score_fed_device_stage")
FED_RATIO = "scoring fed by the device stage / resident"


class Deadline:
  """The seconds left until a time (at least 0)."""

  def __init__(self, seconds: float):
    self.end = time.perf_counter() + seconds

  def left(self) -> float:
    return max(self.end - time.perf_counter(), 0.0)


# ---------------------------------------------------------------------------------------------
# Processes: one run of main.py, a part's worker.


def kill_tree(pid: int) -> None:
  """SIGKILL to process `pid`, every process below it and their process groups: a trainer
  runs in a POSIX process session of its own (start_new_session), its decoding workers in
  its group."""
  try:
    top = psutil.Process(pid)
    processes = [top, *top.children(recursive=True)]
  except psutil.NoSuchProcess:
    return
  groups = set()
  for process in processes:
    try:
      groups.add(os.getpgid(process.pid))
    except ProcessLookupError:
      pass
  for group in groups - {os.getpgrp()}:
    try:
      os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
      pass
  for process in processes:
    try:
      process.kill()
    except psutil.NoSuchProcess:
      pass


def run_process(command: list[str], timeout: float, env: dict[str, str], log_path: str
                ) -> int | str:
  """`command` in a POSIX process session of its own, its output in `log_path`: the exit status, or
  "timeout" when it ran past `timeout` seconds and was killed with every process it started
  (none is left to slow what runs next)."""
  with open(log_path, "w") as log:
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
      return process.wait(timeout=max(timeout, 0.0))
    except subprocess.TimeoutExpired:
      kill_tree(process.pid)
      process.wait()
      return "timeout"


def log_tail(log_path: str) -> str:
  with open(log_path, errors="replace") as log:
    return log.read()[-3000:]


def child_env(cache: bool) -> dict[str, str]:
  """This environment for a run; without `cache`, no persistent compilation cache from it
  (JAX_COMPILATION_CACHE_DIR would override the config's)."""
  env = dict(os.environ)
  if not cache:
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def override_flags(config, reference) -> list[str]:
  """`--config.NAME=VALUE` for each field of `config` that differs from `reference` (the
  config file's own): the command line that turns the file's config into `config`."""
  leaves = schema.leaves(config)
  flags = []
  for name in sorted(implied.changed_fields(config, reference)):
    value = leaves[name]
    if isinstance(value, (tuple, list, dict)):
      raise ValueError(f"config.{name}={value!r}: only scalar fields are passed as flags")
    flags.append(f"--config.{name}={value}")  # str(float): the shortest exact repr.
  return flags


def run_main(config_file: str, workdir: str, flags: list[str], timeout: float,
             env: dict[str, str]) -> dict[str, Any]:
  """`python main.py --config=config_file --workdir=workdir *flags` in a process of its own,
  its output in workdir.log: the exit status ("timeout" if killed at `timeout` seconds), its
  seconds and, when it succeeded, its metrics.jsonl records and report."""
  command = ["main.py", f"--config={config_file}", f"--workdir={workdir}", *flags]
  start = time.perf_counter()
  status = run_process([sys.executable, *command], timeout, env, f"{workdir}.log")
  run = {"command": " ".join(["python", *command]), "exit_status": status,
         "seconds": time.perf_counter() - start}
  if status != 0:
    run["log_tail"] = log_tail(f"{workdir}.log")
    return run
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    run["records"] = [json.loads(line) for line in f]
  run["report"] = report_files.read_results(os.path.join(workdir, "report",
                                                               "results.json"))
  return run


def accuracy_of(run: dict[str, Any]) -> float:
  return float(run["report"]["metrics"]["test"]["before_ts"]["accuracy"])


# The keys of a run's last record that split its wall clock, with their column names.
ANATOMY = (("perf/wall_seconds", "wall"), ("perf/startup_seconds", "start-up"),
           ("perf/data_open_seconds", "data open"), ("perf/compile_seconds", "compiling"),
           ("perf/compilations", "compilations"),
           ("perf/compilations_after_first_epoch", "after epoch 0"),
           ("perf/steady_step_seconds", "steady steps"),
           ("perf/warmup_step_seconds", "warm-up steps"),
           ("perf/run_input_wait_seconds", "input wait"), ("perf/run_eval_seconds", "evaluation"),
           ("perf/run_scoring_seconds", "scoring"), ("perf/run_selection_seconds", "selection"),
           ("perf/run_checkpoint_seconds", "checkpoints"), ("perf/run_report_seconds", "report"),
           ("perf/other_seconds", "other"))
ANATOMY_KEYS = tuple(key for key, _ in ANATOMY)


def anatomy(run: dict[str, Any]) -> dict[str, float | None]:
  """ANATOMY_KEYS from a finished run's last record (None where it lacks one)."""
  last = run["records"][-1]
  return {key: (float(last[key]) if key in last else None) for key in ANATOMY_KEYS}


def mean_anatomy(parts: list[dict[str, float | None]]) -> dict[str, float | None]:
  """Each key's mean over runs' anatomies (None unless every run has it)."""
  return {key: (float(np.mean([p[key] for p in parts]))
                if parts and all(p.get(key) is not None for p in parts) else None)
          for key in ANATOMY_KEYS}


# ---------------------------------------------------------------------------------------------
# The parts. Each is `function(context) -> its numbers`, run in a process of its own
# (`work`); context: tiny, root (the command's folder for workdirs, data and caches),
# fashion_mnist_dir, seconds (the part's limit).


def _sizes(context: dict[str, Any]) -> Sizes:
  return TINY if context["tiny"] else Sizes()


def fashion_part(context: dict[str, Any]) -> dict[str, Any]:
  """Fashion-MNIST prepared once (root/tfds), then full data and topk_anneal-45 at seed 0,
  then at seed 1 (at tiny sizes seed 0 alone)."""
  sizes, root, deadline = _sizes(context), context["root"], Deadline(context["seconds"])
  from cpjax.data import input_pipeline  # pylint: disable=import-outside-toplevel  (tfds)
  configs = fashion_configs(sizes, root, context["fashion_mnist_dir"])
  start = time.perf_counter()
  input_pipeline.open_or_prepare("fashion_mnist", configs[FULL].dataset)
  prepare = time.perf_counter() - start
  rows = [fashion_run(configs[name], name, seed, root, deadline.left())
          for seed in sizes.seeds for name in ARMS]
  return {"prepare_seconds": prepare, "runs": rows, "num_epochs": configs[FULL].num_epochs,
          "means": arm_means(rows), "paired": paired(rows), "arms": arm_settings(configs)}


def fashion_configs(sizes: Sizes, root: str, fashion_mnist_dir: str) -> dict[str, Any]:
  """ARMS' configs without their seed: studies/frontier.py's base run and arm overrides,
  the data prepared in root/tfds."""
  base = grid.apply(frontier.base_config(), {
      **dict(sizes.fashion), "dataset.data_dir": os.path.join(root, "tfds"),
      "dataset.manual_dir": os.path.abspath(fashion_mnist_dir),
      # None, as the study's runs (tiny sizes: one shared cache, for the test's minutes).
      "compilation_cache_dir": os.path.join(root, "xla_cache_fashion") if sizes.tiny else ""})
  arms = {arm.name: arm for arm in frontier.search_arms(base)}
  return {name: grid.apply(base, arms[name].overrides) for name in ARMS}


def fashion_run(config, name: str, seed: int, root: str, timeout: float) -> dict[str, Any]:
  """One arm at one seed: its seconds by phase, example passes, test accuracy, anatomy."""
  config = grid.apply(config, {"seed": seed})
  run = run_main("configs/fashion_mnist_long.py", os.path.join(root, f"{name}_seed{seed}"),
                 override_flags(config, fashion_mnist_long.get_config()), timeout,
                 child_env(cache=False))
  row = {"arm": name, "seed": seed, "exit_status": run["exit_status"],
         "wall_seconds": run["seconds"], "command": run["command"]}
  print(f"fashion: {name} seed {seed}: status {run['exit_status']}, {run['seconds']:.1f} s",
        flush=True)
  if run["exit_status"] != 0:
    return {**row, "log_tail": run["log_tail"]}
  records, last = run["records"], run["records"][-1]
  return {**row, **{f"{p}_seconds": last[f"total_{p}_seconds"]
                    for p in ("training", "scoring", "selection")},
          "eval_seconds": sum(r.get("eval_seconds", 0.0) for r in records),
          "report_seconds": last["report_seconds"],
          "passes": float(long_schedule.example_passes(config, records)[-1]),
          "test_accuracy": accuracy_of(run), "epochs": len(records), "anatomy": anatomy(run)}


FASHION_COLUMNS = ("wall_seconds", "training_seconds", "scoring_seconds", "selection_seconds",
                   "eval_seconds", "report_seconds", "passes", "test_accuracy")


def arm_means(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Per arm: the finished seeds, each column's mean over them and their mean anatomy."""
  out = {}
  for name in ARMS:
    done = [r for r in rows if r["arm"] == name and r["exit_status"] == 0]
    out[name] = {"seeds": [r["seed"] for r in done],
                 **{c: float(np.mean([r[c] for r in done])) if done else math.nan
                    for c in FASHION_COLUMNS},
                 "anatomy": mean_anatomy([r["anatomy"] for r in done])}
  return out


def paired(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """CHOSEN against full data over the seeds both finished: the test accuracy difference in
  points and the wall-clock, training-time and example-pass ratios, each a mean with its 90 %
  t interval over the seeds (long_schedule.seed_interval; NaN bounds below 2 seeds)."""
  by = {(r["arm"], r["seed"]): r for r in rows if r["exit_status"] == 0}
  seeds = sorted(s for a, s in by if a == CHOSEN and (FULL, s) in by)
  per_seed = {
      "accuracy_points": [100 * (by[CHOSEN, s]["test_accuracy"] - by[FULL, s]["test_accuracy"])
                          for s in seeds],
      **{f"{c}_ratio": [by[CHOSEN, s][c] / by[FULL, s][c] for s in seeds]
         for c in ("wall_seconds", "training_seconds", "passes")}}
  out = {"seeds": seeds, "per_seed": per_seed}
  for key, values in per_seed.items():
    out[key] = long_schedule.seed_interval(values) if values else (math.nan,) * 3
  return out


def arm_settings(configs: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Per arm: its selection settings, epochs and batch size (what its name stands for)."""
  return {name: {k: v for k, v in sorted(schema.leaves(c).items())
                 if k.startswith(("selection.", "num_epochs", "batch_size"))}
          for name, c in configs.items()}


def imagenet_host_part(context: dict[str, Any]) -> dict[str, Any]:
  return imagenet_part(context, "host", "cpu")


def imagenet_gpu_part(context: dict[str, Any]) -> dict[str, Any]:
  return imagenet_part(context, "decode_gpu", _sizes(context).decoder)


def imagenet_part(context: dict[str, Any], name: str, decode: str) -> dict[str, Any]:
  """The generated folder (written unless an earlier part of this command wrote it), then
  the trainer over it with dataset.decode=`decode`, the compilation cache folder shared by
  the command's ImageNet-shaped runs."""
  sizes, root, deadline = _sizes(context), context["root"], Deadline(context["seconds"])
  folder = imagenet_folder(sizes, root)
  cache = os.path.join(root, "xla_cache_imagenet")
  cached = len(os.listdir(cache)) if os.path.isdir(cache) else 0
  config = grid.apply(imagenet.get_config(), {
      **dict(IMAGENET_RUN), **dict(sizes.imagenet), **dict(sizes.steady),
      "dataset.folder": folder["folder"], "dataset.decode": decode,
      "compilation_cache_dir": cache})
  run = run_main("configs/imagenet.py", os.path.join(root, f"imagenet_{name}"),
                 override_flags(config, imagenet.get_config()), deadline.left(),
                 child_env(cache=False))
  print(f"{name}: status {run['exit_status']}, {run['seconds']:.1f} s", flush=True)
  row = {key: run[key] for key in ("command", "exit_status", "seconds")}
  row.update(decode=decode, cache_entries_before=cached)
  if run["exit_status"] == 0:
    row.update(imagenet_numbers(run), anatomy=anatomy(run))
    row["steady"] = steady(row["epochs"], sizes.train_images)
  else:
    row["log_tail"] = run["log_tail"]
  return {"folder": folder, "run": row}


def imagenet_folder(sizes: Sizes, root: str) -> dict[str, Any]:
  """root/imagenet_shaped: generated JPEGs (benchmarks.feeds.write_folder), written into a
  temporary folder renamed once complete, so that a part killed while writing leaves none
  that a later part would read."""
  folder, start = os.path.join(root, "imagenet_shaped"), time.perf_counter()
  written = not os.path.isdir(folder)
  if written:
    partial = folder + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    feeds.write_folder(partial, sizes.train_images, *sizes.source_size, classes=sizes.classes)
    os.replace(partial, folder)
  return {"folder": folder, "written": written, "seconds": time.perf_counter() - start,
          "classes": sizes.classes, "train_images": sizes.train_images,
          "source_size": list(sizes.source_size)}


def imagenet_numbers(run: dict[str, Any]) -> dict[str, Any]:
  """Per epoch, and the run's end, from its records and report."""
  epochs = [{"epoch": r["epoch"], "images": r["selected_k"],
             "training_seconds": r["training_seconds"],
             "images_per_s": r["selected_k"] / r["training_seconds"],
             "input_wait_seconds": r["input_wait_seconds"],
             "input_wait_share": r["input_wait_seconds"] / r["training_seconds"],
             "scoring_seconds": r["scoring_seconds"], "selection_seconds": r["selection_seconds"],
             "eval_seconds": r.get("eval_seconds", math.nan)} for r in run["records"]]
  last, results = run["records"][-1], run["report"]
  return {"epochs": epochs, "checkpoint_seconds": last["checkpoint_seconds"],
          "report_seconds": last["report_seconds"],
          "report_build_seconds": results["seconds"]["total"],
          "peak_device_memory_bytes": last.get("perf/peak_device_memory_bytes"),
          "test_accuracy": accuracy_of(run)}


def steady(epochs: list[dict[str, Any]], train_images: int) -> dict[str, Any]:
  """The steady training of an ImageNet-shaped run: the epochs after the first (which
  compiles and warms up), their images over their training seconds and the input-wait share
  of those seconds; and the fresh scoring pass's rate: every training image over the epoch
  with the most scoring seconds (the one pass, its compile included)."""
  later = epochs[1:]
  seconds = sum(e["training_seconds"] for e in later)
  images = sum(e["images"] for e in later)
  scored = max(e["scoring_seconds"] for e in epochs)
  return {"epochs": len(later), "images": images, "training_seconds": seconds,
          "images_per_s": images / seconds if seconds > 0 else math.nan,
          "input_wait_share": (sum(e["input_wait_seconds"] for e in later) / seconds
                               if seconds > 0 else math.nan),
          "scoring_images_per_s": train_images / scored if scored > 0 else math.nan}


def scoring_part(context: dict[str, Any]) -> dict[str, Any]:
  """benchmarks.gpu_table's SCORING_ROWS in a process of their own, over the ImageNet-shaped
  folder where this command wrote it (else gpu_table writes its own); its watchdog writes the
  rows done 10 s before the part's limit."""
  root, seconds = context["root"], context["seconds"]
  out, log = os.path.join(root, "gpu_table.json"), os.path.join(root, "gpu_table.log")
  folder = os.path.join(root, "imagenet_shaped")
  command = [sys.executable, "-m", "benchmarks.gpu_table", f"--rows={','.join(SCORING_ROWS)}",
             f"--out={out}", f"--budget-seconds={max(seconds - 25.0, 1.0):.0f}",
             "--hard-margin-seconds=10", "--estimate-scale=0",
             *([f"--folder={folder}"] if os.path.isdir(folder) else []),
             *(["--tiny"] if context["tiny"] else [])]
  start = time.perf_counter()
  status = run_process(command, max(seconds - 5.0, 1.0), child_env(cache=False), log)
  part = {"command": " ".join(["python", *command[1:]]), "exit_status": status,
          "seconds": time.perf_counter() - start}
  if os.path.exists(out):  # Also after the watchdog's stop (status 3): the rows done.
    with open(out) as f:
      written = json.load(f)
    part.update(rows={k: v for k, v in written["rows"].items() if k in SCORING_ROWS},
                ratios=written["ratios"])
  if status != 0:
    part["log_tail"] = log_tail(log)
  print(f"scoring: status {status}, {part['seconds']:.1f} s", flush=True)
  return part


def default_job_part(context: dict[str, Any]) -> dict[str, Any]:
  """The default job as a user runs it (cpjax's own compilation cache)."""
  sizes = _sizes(context)
  config = grid.apply(default.get_config(), dict(sizes.default_job))
  run = run_main("configs/default.py", os.path.join(context["root"], "default"),
                 override_flags(config, default.get_config()), context["seconds"],
                 child_env(cache=True))
  row = {k: run[k] for k in ("command", "exit_status", "seconds")}
  if run["exit_status"] == 0:
    row.update(test_accuracy=accuracy_of(run), epochs=len(run["records"]),
               anatomy=anatomy(run))
  else:
    row["log_tail"] = run["log_tail"]
  return row


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  title: str
  function: str  # "module:function", called with the context in the part's own process.
  # Its seconds on one H200 (the first recorded run; the folder written by imagenet_host),
  # until a record of it on this card says otherwise.
  estimate_seconds: float


PARTS = (
    Part("fashion", "Fashion-MNIST: full data against topk_anneal-45",
         "benchmarks.gpu_check:fashion_part", 145.0),
    Part("imagenet_host", "ImageNet-shaped trainer, host stage",
         "benchmarks.gpu_check:imagenet_host_part", 160.0),
    Part("imagenet_gpu", "ImageNet-shaped trainer, decode=gpu",
         "benchmarks.gpu_check:imagenet_gpu_part", 145.0),
    Part("scoring", "Fresh scoring pass and the bare step", "benchmarks.gpu_check:scoring_part",
         95.0),
    Part("default_job", "The default job", "benchmarks.gpu_check:default_job_part", 45.0))


def work(function: str, context: str, result_path: str) -> None:
  """A part's process: `function` (module:name) called with the context (JSON), its numbers
  written to `result_path`."""
  module, name = function.split(":")
  result = getattr(importlib.import_module(module), name)(json.loads(context))
  write_json(result_path, result)


WORKER = "import sys; from benchmarks import gpu_check; gpu_check.work(*sys.argv[1:])"


def status_of(numbers: Any) -> str:
  """A part's status from its numbers: "timeout" if a run in them timed out, "failed" if one
  exited with another status or a gpu_table row has an error or was skipped (no GPU decoder,
  say), else "done"."""
  statuses, errors = [], []

  def walk(value):
    if isinstance(value, dict):
      if "exit_status" in value:
        statuses.append(value["exit_status"])
      errors.extend(value[k] for k in ("error", "skipped") if k in value)
      for item in value.values():
        walk(item)
    elif isinstance(value, list):
      for item in value:
        walk(item)
  walk(numbers)
  if "timeout" in statuses:
    return "timeout"
  return "failed" if errors or any(s != 0 for s in statuses) else "done"


def run_in_worker(part: Part, context: dict[str, Any], limit: float) -> dict[str, Any]:
  """`part` in a process of its own, killed with every process it started at `limit`
  seconds: its status, seconds and numbers (with the log's end unless it is done). The part
  itself gives its runs 5 s less, so that a slow run is its own "timeout"."""
  root = context["root"]
  result_path = os.path.join(root, f"{part.name}.result.json")
  log = os.path.join(root, f"{part.name}.log")
  if os.path.exists(result_path):
    os.remove(result_path)
  inner = {**context, "seconds": max(limit - 5.0, 1.0)}
  start = time.perf_counter()
  exit_status = run_process([sys.executable, "-c", WORKER, part.function, json.dumps(inner),
                             result_path], limit, dict(os.environ), log)
  outcome: dict[str, Any] = {"seconds": time.perf_counter() - start}
  if exit_status == 0 and os.path.exists(result_path):
    with open(result_path) as f:
      outcome["numbers"] = json.load(f)
    outcome["status"] = status_of(outcome["numbers"])
  else:
    outcome["status"] = "timeout" if exit_status == "timeout" else "failed"
  if outcome["status"] != "done":
    outcome["log_tail"] = log_tail(log)
  return outcome


# ---------------------------------------------------------------------------------------------
# Records: the results file, the code's identity, what a resume runs.


class ResultsError(Exception):
  """A results file that cannot be read: named, and left as it is."""


def code_digest(root: str = REPO) -> str:
  """sha256 over CODE_FILES' paths and contents under `root`, from the file system (a GPU
  machine's copy of the checkout has no .git); caches and compiled files left out."""
  patterns = [re.compile(p) for p in CODE_FILES]
  digest = hashlib.sha256()
  paths = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
    for name in files:
      path = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
      if any(p.search(path) for p in patterns) and not name.endswith(".pyc"):
        paths.append(path)
  for path in sorted(paths):
    with open(os.path.join(root, path), "rb") as f:
      digest.update(path.encode() + b"\0" + f.read() + b"\0")
  return digest.hexdigest()


def git_commit(root: str = REPO) -> str | None:
  """The checkout's commit, "+changes" added when CODE_FILES differ from it; None where `root`
  is not a git checkout's top (a GPU machine's copy without .git, or a copy inside another
  checkout, whose commit is not this code's)."""
  def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()
  try:
    if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(root):
      return None
    head = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--", "cpjax", "configs", "main.py",
                  "benchmarks/*.py", "studies/*.py", "requirements*.txt")
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("+changes" if changed else "")


def read_results(path: str) -> dict[str, Any]:
  """The records in `path` ({"format", "parts"}; empty where the file is missing); a file
  that is not this command's readable records raises ResultsError naming it."""
  if not os.path.exists(path):
    return {"format": FORMAT, "parts": {}}
  try:
    with open(path) as f:
      results = json.load(f)
  except (OSError, ValueError) as err:
    raise ResultsError(f"{path} cannot be read as JSON ({err})") from err
  if not isinstance(results, dict) or results.get("format") != FORMAT:
    raise ResultsError(f"{path} is not a gpu_check results file (no \"format\": {FORMAT!r})")
  parts = results.get("parts")
  bad = (["parts"] if not isinstance(parts, dict) else
         [name for name, r in parts.items() if not isinstance(r, dict)
          or not {"status", "code_digest", "card", "sizes"} <= set(r)])
  if bad:
    raise ResultsError(f"{path}: its records of {', '.join(bad)} lack their status, code "
                       "digest, card or sizes")
  return results


def write_json(path: str, value: Any) -> None:
  """`value` as JSON in `path`, atomically: a temporary file beside it, renamed over it."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  handle, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix=".json")
  try:
    with os.fdopen(handle, "w") as f:
      json.dump(value, f, indent=1, default=str)
      f.write("\n")
    os.chmod(temporary, 0o644)  # mkstemp's file is its owner's alone; a results file is not.
    os.replace(temporary, path)
  except BaseException:
    os.remove(temporary)
    raise


def set_aside(path: str) -> str | None:
  """Renames an existing `path` to path.<UTC time>.bak (a new name, never one in use)."""
  if not os.path.exists(path):
    return None
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
  target, n = f"{path}.{stamp}.bak", 1
  while os.path.exists(target):
    target, n = f"{path}.{stamp}-{n}.bak", n + 1
  os.replace(path, target)
  return target


def rerun_reason(record: dict[str, Any] | None, identity: dict[str, Any]) -> str | None:
  """Why a resume runs a part recorded as `record` (None: it keeps it)."""
  if record is None:
    return "not recorded yet"
  theirs = {k: record.get(k) for k in ("code_digest", "card", "sizes")}
  ours = {k: identity[k] for k in theirs}
  if theirs != ours:
    return (f"recorded on code {theirs['code_digest'][:12]}, card {theirs['card']}, "
            f"{theirs['sizes']} sizes; this is code {ours['code_digest'][:12]}, card "
            f"{ours['card']}, {ours['sizes']} sizes: running it afresh")
  if record["status"] != "done":
    return f"recorded as {record['status']}: running it again"
  return None


@dataclasses.dataclass
class Check:
  """One command's run of the parts: where the records go, the code and machine they ran
  on, the budget, and how a part is run (`run_in_worker`; the tests pass stand-ins)."""
  path: str
  identity: dict[str, Any]
  machine: dict[str, Any]
  context: dict[str, Any]
  part_limit: float
  budget_seconds: float
  start: float
  mirror: str = ""
  execute: Callable[[Part, dict[str, Any], float], dict[str, Any]] = run_in_worker

  def left(self) -> float:
    return self.budget_seconds - (time.perf_counter() - self.start)


def run_check(check: Check, parts: tuple[Part, ...], results: dict[str, Any],
              resume: bool) -> dict[str, Any]:
  """Runs each part a resume does not keep, while it fits the budget, recording each as it
  ends (`record`); returns the results."""
  for part in parts:
    old = results["parts"].get(part.name)
    reason = rerun_reason(old, check.identity) if resume else "starting afresh"
    if reason is None:
      print(f"{part.name}: kept, done on {old['date']} in {old['seconds']:.0f} s", flush=True)
      continue
    estimate = (old["seconds"] if old and old.get("card") == check.identity["card"]
                and old.get("sizes") == check.identity["sizes"] and old["status"] == "done"
                else 0.0 if check.identity["sizes"] == "tiny" else part.estimate_seconds)
    if estimate > check.left() or check.left() < 1.0:
      print(f"{part.name}: not started: {max(check.left(), 0):.0f} s of the budget left, it "
            f"needs about {estimate:.0f} s (--resume runs it later)", flush=True)
      continue
    print(f"{part.name}: {reason}", flush=True)
    limit = min(check.part_limit, check.left())
    outcome = check.execute(part, check.context, limit)
    if outcome["status"] == "timeout" and limit < check.part_limit:
      print(f"{part.name}: stopped at the budget's end after {outcome['seconds']:.0f} s; not "
            "recorded (--resume runs it again)", flush=True)
      continue
    record(check, results, part, outcome, limit)
  return results


def record(check: Check, results: dict[str, Any], part: Part, outcome: dict[str, Any],
           limit: float) -> None:
  """The part's record in the results, written at once (and mirrored)."""
  results["parts"][part.name] = {
      **check.identity, "status": outcome["status"], "seconds": outcome["seconds"],
      "limit_seconds": limit, "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()) + " UTC",
      "machine": check.machine, "numbers": outcome.get("numbers"),
      **({"log_tail": outcome["log_tail"]} if "log_tail" in outcome else {})}
  write_json(check.path, results)
  print(f"{part.name}: {outcome['status']} in {outcome['seconds']:.0f} s, recorded in "
        f"{check.path}", flush=True)
  if check.mirror:
    write_json(os.path.join(check.mirror, os.path.basename(check.path)), results)
    stem = os.path.splitext(os.path.basename(check.path))[0]
    with open(os.path.join(check.mirror, f"{stem}.md"), "w") as f:
      f.write(markdown(results))


# ---------------------------------------------------------------------------------------------
# Targets and the markdown.


def _done(results: dict[str, Any], name: str) -> dict[str, Any] | None:
  """The numbers of part `name` where it is recorded as done, else None."""
  found = results["parts"].get(name)
  return found["numbers"] if found and found["status"] == "done" else None


def _target(name: str, value: float | None, bound: float, sense: str, why: str = ""
            ) -> dict[str, Any]:
  """A target's row: met, missed, or not measured (`why`, or its number is missing)."""
  missing = value is None or not math.isfinite(value)
  if why or missing:
    status = f"not measured ({why or 'no number'})"
  else:
    status = "met" if (value <= bound if sense == "<=" else value >= bound) else "missed"
  return {"target": name, "value": None if missing else value, "bound": f"{sense} {bound:g}",
          "status": status}


def bare_rate(results: dict[str, Any]) -> float | None:
  scoring = _done(results, "scoring") or {}
  return scoring.get("rows", {}).get("r50_train_flax_bare", {}).get("images_per_s")


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
  """The targets (module docstring) from the parts recorded as done."""
  tiny = any(r["sizes"] == "tiny" for r in results["parts"].values())

  def why(part: str, extra: str = "") -> str:
    return ("tiny sizes, not a GPU" if tiny else extra if _done(results, part) is not None
            else f"{part} not done")
  fashion = _done(results, "fashion") or {}
  full = fashion.get("means", {}).get(FULL, {}).get("anatomy") or {}
  outside = (full["perf/wall_seconds"] - full["perf/steady_step_seconds"]
             if full.get("perf/wall_seconds") is not None
             and full.get("perf/steady_step_seconds") is not None else None)
  ratio = fashion.get("paired", {}).get("wall_seconds_ratio")
  rows = [_target("full data: seconds outside steady steps (mean of the seeds)", outside,
                  OUTSIDE_TARGET, "<=", why("fashion")),
          _target(f"{CHOSEN} wall clock / full data's (mean of the seeds' ratios)",
                  ratio[0] if ratio else None, WALL_TARGET, "<=", why("fashion"))]
  bare = bare_rate(results)
  for name, label in (("imagenet_host", "host stage"), ("imagenet_gpu", "decode=gpu")):
    run = (_done(results, name) or {}).get("run", {}).get("steady", {})
    short = (f"{run['training_seconds']:.1f} s of steady training, under {STEADY_SECONDS:.0f}"
             if run and run["training_seconds"] < STEADY_SECONDS else "")
    over = run["images_per_s"] / bare if run and bare else None
    rows.append(_target(f"{label}: steady images/s / the bare step's", over, RATE_TARGET, ">=",
                        why(name, short) or ("" if bare else "no bare step rate yet")))
    if name == "imagenet_gpu":
      rows.append(_target("decode=gpu: input-wait share of steady training",
                          run.get("input_wait_share"), WAIT_TARGET, "<=", why(name, short)))
  fed = (_done(results, "scoring") or {}).get("ratios", {}).get(FED_RATIO)
  rows.append(_target("fresh scoring pass fed by the device stage / the resident rate", fed,
                      SCORING_TARGET, ">=", why("scoring")))
  return rows


def fmt(value: Any, digits: int = 1) -> str:
  if value is None or (isinstance(value, float) and not math.isfinite(value)):
    return "-"
  if isinstance(value, float):
    return f"{value:,.{digits}f}"
  return str(value)


def _interval(triple, digits: int = 2, sign: str = "+") -> str:
  """'mean [low, high]' (`sign` "+": signed, a difference; "": a ratio)."""
  mean, low, high = triple
  if not math.isfinite(low):
    return fmt(mean, digits)
  form = f"{sign}.{digits}f"
  return f"{mean:{form}} [{low:{form}}, {high:{form}}]"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
          *["| " + " | ".join(r) + " |" for r in rows], ""]


def markdown(results: dict[str, Any]) -> str:
  """The results file's tables: its parts, each part's numbers, the runs' anatomy and the
  targets."""
  records = results["parts"]
  if not records:
    return "No part is recorded yet.\n"
  latest = max(records.values(), key=lambda r: r["date"])
  m = latest["machine"]
  lines = [f"### {m['card']} ({m['devices']} device(s)), {m['cores']} cores"
           + (", tiny sizes" if latest["sizes"] == "tiny" else ""), "",
           f"Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, flax {m['flax']}, "
           f"optax {m['optax']}, orbax-checkpoint {m['orbax-checkpoint']}, "
           f"tensorflow-datasets {m['tensorflow-datasets']}, torch {m['torch'] or '-'}, "
           f"tensorflow {m['tensorflow'] or 'not installed'}; CPU {m['cpu']}.", ""]
  lines += table(["part", "status", "seconds", "limit s", "date", "code digest", "commit"],
                 [[p.name, r["status"], fmt(r["seconds"], 0), fmt(r["limit_seconds"], 0),
                   r["date"], r["code_digest"][:12], (r["commit"] or "-")[:12]]
                  if (r := records.get(p.name)) else [p.name, "not run yet", *["-"] * 5]
                  for p in PARTS])
  for name, lines_of in (("fashion", fashion_lines), ("imagenet_host", imagenet_lines),
                         ("imagenet_gpu", imagenet_lines), ("scoring", scoring_lines),
                         ("default_job", default_lines)):
    if records.get(name, {}).get("numbers"):
      lines += lines_of(name, records[name]["numbers"], results)
  lines += ["#### Run anatomy", "", *anatomy_lines(anatomy_rows(results)), "#### Targets", ""]
  lines += table(["target", "value", "bound", "status"],
                 [[t["target"], fmt(t["value"], 3), t["bound"], t["status"]]
                  for t in targets(results)])
  return wrapped(lines)


def wrapped(lines: list[str]) -> str:
  """The lines as markdown text, prose wrapped at 100 characters (tables, headings, lists
  and indented commands as they are)."""
  return "".join(line + "\n" if line.startswith(("|", "#", "- ", "    ")) or len(line) <= 100
                 else textwrap.fill(line, 100, break_on_hyphens=False) + "\n"
                 for line in lines)


def fashion_lines(_, part: dict[str, Any], results: dict[str, Any]) -> list[str]:
  tiny = results["parts"]["fashion"]["sizes"] == "tiny"
  size = ("tiny: 512 training images in batches of 32, 200 validation images" if tiny
          else "54,000 training images, 6,000 validation, small_cnn, batch 128")
  lines = [f"#### fashion: {part['num_epochs']} epochs, full data against `{CHOSEN}`", "",
           f"Real Fashion-MNIST, {size}; data prepared in {part['prepare_seconds']:.1f} s; "
           "seconds are means over the seeds (evaluation: every pass, the final one "
           "included).", ""]
  means = part["means"]
  lines += table(["arm", "seeds", "wall s", "training s", "scoring s", "selection s",
                  "evaluation s", "report s", "example passes (x full)", "test accuracy"],
                 [[f"`{name}`", ",".join(map(str, m["seeds"])), fmt(m["wall_seconds"]),
                   fmt(m["training_seconds"]), fmt(m["scoring_seconds"], 2),
                   fmt(m["selection_seconds"], 2), fmt(m["eval_seconds"]),
                   fmt(m["report_seconds"]),
                   f"{m['passes']:,.0f} ({m['passes'] / means[FULL]['passes']:.3f})"
                   if math.isfinite(m["passes"]) else "-", fmt(m["test_accuracy"], 4)]
                  for name, m in means.items()])
  p = part["paired"]
  lines += [f"Paired with full data, seeds {','.join(map(str, p['seeds'])) or '-'} (mean [90 % "
            "t interval]): test accuracy " + _interval(p["accuracy_points"]) + " points, wall "
            "clock x" + _interval(p["wall_seconds_ratio"], 3, "") + ", training seconds x"
            + _interval(p["training_seconds_ratio"], 3, "") + ", example passes x"
            + _interval(p["passes_ratio"], 3, "") + ".", ""]
  return lines


def imagenet_lines(name: str, part: dict[str, Any], results: dict[str, Any]) -> list[str]:
  run, folder = part["run"], part["folder"]
  lines = [f"#### {name}: dataset.decode={run['decode']}", "",
           f"{folder['train_images']:,} generated {folder['source_size'][0]} x "
           f"{folder['source_size'][1]} JPEGs in {folder['classes']:,} classes (not "
           "photographs; " + (f"written in {folder['seconds']:.0f} s" if folder["written"]
                              else "written by an earlier part") + "); compilation cache "
           f"entries before the run: {run['cache_entries_before']}. Exit status "
           f"{run['exit_status']}, {run['seconds']:.0f} s.", "", f"    {run['command']}", ""]
  if "steady" not in run:
    return lines
  s, bare = run["steady"], bare_rate(results)
  lines += [f"Steady (epochs 1-{s['epochs']}): {s['images']:,} images in "
            f"{s['training_seconds']:.1f} s of training, {fmt(s['images_per_s'], 0)} images/s"
            + (f" ({s['images_per_s'] / bare:.3f} x the bare step's {bare:,.0f})" if bare
               else "") + f", input-wait share {fmt(s['input_wait_share'], 3)}; the fresh "
            f"scoring pass {fmt(s['scoring_images_per_s'], 0)} images/s (its compile "
            "included).", ""]
  lines += table(["epoch", "images", "training s", "images/s", "input-wait share",
                  "scoring s", "selection s", "evaluation s"],
                 [[str(e["epoch"]), f"{e['images']:,}", fmt(e["training_seconds"], 2),
                   fmt(e["images_per_s"], 0), fmt(e["input_wait_share"], 3),
                   fmt(e["scoring_seconds"], 2), fmt(e["selection_seconds"], 3),
                   fmt(e["eval_seconds"], 2)] for e in run["epochs"]])
  peak = run["peak_device_memory_bytes"]
  return lines + [f"Final checkpoint {run['checkpoint_seconds']:.2f} s; report "
                  f"{run['report_seconds']:.1f} s ({run['report_build_seconds']:.1f} s building "
                  "it); peak device memory "
                  + (f"{peak / 2**30:.2f} GiB." if peak else "not counted by this backend."), ""]


def scoring_lines(_, part: dict[str, Any], __) -> list[str]:
  lines = ["#### scoring: benchmarks.gpu_table's rows", "",
           f"Exit status {part['exit_status']}, {part['seconds']:.0f} s.", "",
           f"    {part['command']}", ""]
  lines += table(["row", "images/s", "decoder", "note"],
                 [[row.get("label", key), fmt(row.get("images_per_s"), 0),
                   row.get("decoder", "-"), row.get("skipped") or row.get("error") or ""]
                  for key, row in part.get("rows", {}).items()])
  return lines + [f"- {name}: {value:.3f}" for name, value in part.get("ratios", {}).items()
                  if name in (FED_RATIO, "scoring fed by the host stage / resident")] + [""]


def default_lines(_, row: dict[str, Any], __) -> list[str]:
  command = " ".join(w for w in row["command"].split() if not w.startswith("--workdir="))
  return ["#### default_job", "",
          f"`{command}`: exit status {row['exit_status']}, {row['seconds']:.1f} s, "
          f"{row.get('epochs', '-')} epochs, test accuracy {fmt(row.get('test_accuracy'), 4)}.",
          ""]


def anatomy_rows(results: dict[str, Any]) -> list[tuple[str, Any]]:
  """(label, anatomy) of every run recorded, in the order the parts run."""
  rows, records = [], results["parts"]
  for run in ((records.get("fashion") or {}).get("numbers") or {}).get("runs", []):
    rows.append((f"fashion `{run['arm']}` seed {run['seed']}", run.get("anatomy")))
  for name in ("imagenet_host", "imagenet_gpu"):
    if (records.get(name) or {}).get("numbers"):
      rows.append((name, records[name]["numbers"]["run"].get("anatomy")))
  if (records.get("default_job") or {}).get("numbers"):
    rows.append(("default_job", records["default_job"]["numbers"].get("anatomy")))
  return rows


def anatomy_lines(rows: list[tuple[str, dict[str, float | None] | None]]) -> list[str]:
  """A table of runs' anatomies: seconds, or counts for the compilations; "-" where a record
  lacks the key, or the run has none."""
  def cell(key, value):
    if value is None:
      return "-"
    return f"{value:.0f}" if "compilations" in key else f"{value:.2f}"
  return ["Each run's wall clock by part, from its last metrics.jsonl record (seconds; "
          "compilations counted; \"-\": no such key).", "",
          *table(["run", *(name for _, name in ANATOMY)],
                 [[label, *(cell(key, (part or {}).get(key)) for key in ANATOMY_KEYS)]
                  for label, part in rows])]


def section(folder: str = RESULTS_DIR) -> str:
  """RESULTS.md's section: the one-line GPU command and each card's records in `folder`
  (results/gpu_check_<card>.json, tiny sizes and set-aside files left out)."""
  paths = sorted(p for p in os.listdir(folder) if re.fullmatch(r"gpu_check_[a-z0-9_]+\.json", p)
                 and not p.endswith("_tiny.json"))
  lines = [SECTION_HEADING, "",
           "Generated from `results/gpu_check_<card>.json` by `python -m benchmarks.gpu_check "
           "--render`; the command and its rules: "
           "[README.md](README.md#the-gpu-check-gpu_checkpy).", ""]
  if not paths:
    return wrapped(lines + [
        "No GPU has run it yet: none of its targets is measured (Fashion-MNIST's full-data "
        f"run <= {OUTSIDE_TARGET:g} s outside steady steps; `{CHOSEN}`'s wall clock <= "
        f"{WALL_TARGET:g} x full data's; the ImageNet-shaped trainer's steady images/s >= "
        f"{RATE_TARGET:g} x the bare step's with the host stage and with decode=gpu, its "
        f"input-wait share <= {WAIT_TARGET * 100:g} % with decode=gpu; the fresh scoring pass >= "
        f"{SCORING_TARGET:g} x the resident scoring rate).", ""])
  for path in paths:
    lines += [f"`results/{path}`:", "", *markdown(read_results(os.path.join(folder, path))
                                                  ).splitlines()]
  return wrapped(lines).rstrip("\n") + "\n\n"


def render(results_md: str = RESULTS_MD, folder: str = RESULTS_DIR) -> None:
  """Replaces RESULTS.md's section (its heading to the next "## " heading) with `section`."""
  with open(results_md) as f:
    text = f.read()
  start = text.index(SECTION_HEADING + "\n")
  end = text.find("\n## ", start + 1)
  end = len(text) if end < 0 else end + 1
  with open(results_md, "w") as f:
    f.write(text[:start] + section(folder) + text[end:])


# ---------------------------------------------------------------------------------------------
# The command.


MACHINE_PROBE = """
import importlib.metadata, json, os, platform
import jax
def version(*names):
  for name in names:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return None
cpu = platform.processor()
if os.path.exists("/proc/cpuinfo"):
  with open("/proc/cpuinfo") as f:
    cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
print(json.dumps({"backend": jax.default_backend(), "card": jax.devices()[0].device_kind,
                  "devices": jax.device_count(), "cpu": cpu, "cores": os.cpu_count(),
                  "python": platform.python_version(),
                  "tensorflow": version("tensorflow", "tensorflow-cpu"),
                  **{n: version(n) for n in ("jax", "jaxlib", "flax", "optax",
                     "orbax-checkpoint", "tensorflow-datasets", "torch")}}))
"""


def machine() -> dict[str, Any]:
  """The card and library versions, from a fresh process (this one starts no JAX backend:
  the JPEG folder is written by forked processes)."""
  result = subprocess.run([sys.executable, "-c", MACHINE_PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=True)
  return json.loads(result.stdout.strip().splitlines()[-1])


def device_slug(card: str, backend: str, tiny: bool) -> str:
  """h100, h200, ... from the card's name (else its name's letters and digits); _tiny."""
  found = re.search(r"\b([A-Z]\d{2,4})\b", card)
  slug = (found.group(1) if found and backend != "cpu"
          else re.sub(r"[^a-z0-9]+", "_", card.lower()).strip("_"))
  return slug.lower() + ("_tiny" if tiny else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--resume", action="store_true",
                      help="Keep the parts recorded as done on this code and card; run the rest.")
  parser.add_argument("--tiny", action="store_true",
                      help="Tiny sizes (a CPU test); the default where JAX finds no GPU.")
  parser.add_argument("--budget-seconds", type=float, default=None,
                      help=f"The whole command's seconds (default {DEFAULT_BUDGET_SECONDS:.0f}; "
                      "--tiny 3600); a part starts only if its estimate fits what is left.")
  parser.add_argument("--results", default="",
                      help="The results file (default benchmarks/results/gpu_check_<card>.json).")
  parser.add_argument("--mirror", default="",
                      help="Also write the results file and its markdown here after each part.")
  parser.add_argument("--fashion-mnist-dir", default=carry.FASHION_MNIST_DIR,
                      help="The four Fashion-MNIST IDX files (gzipped or not).")
  parser.add_argument("--workdir-root", default="",
                      help="Where the runs' workdirs, data and JPEG folder go (default: a "
                      "temporary folder, removed at the end unless a part is not done).")
  parser.add_argument("--render", action="store_true",
                      help="Only rewrite RESULTS.md's section from results/gpu_check_*.json.")
  return parser.parse_args(argv)


def open_results(path: str, resume: bool) -> dict[str, Any]:
  """The records a run continues: the file's with --resume, else none (an existing file set
  aside first)."""
  if resume:
    return read_results(path)
  moved = set_aside(path)
  if moved:
    print(f"Starting afresh: the earlier {path} is kept as {moved}", flush=True)
  return {"format": FORMAT, "parts": {}}


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.render:
    render()
    print(f"Wrote {SECTION_HEADING[3:]} in {RESULTS_MD}")
    return 0
  start = time.perf_counter()  # The budget counts from here (after Python's imports).
  info = machine()
  tiny = args.tiny or info["backend"] == "cpu"
  if tiny and not args.tiny:
    print("No GPU found by JAX: running at tiny sizes (--tiny).", flush=True)
  sizes = TINY if tiny else Sizes()
  path = args.results or os.path.join(
      RESULTS_DIR, f"gpu_check_{device_slug(info['card'], info['backend'], tiny)}.json")
  try:
    results = open_results(path, args.resume)
  except ResultsError as err:
    print(f"error: {err}. It is left as it is: move it aside (or run without --resume, which "
          "keeps it as a .bak file and starts afresh).", file=sys.stderr)
    return 2
  root = args.workdir_root or tempfile.mkdtemp(prefix="cpjax_gpu_check_")
  os.makedirs(root, exist_ok=True)
  identity = {"code_digest": code_digest(), "commit": git_commit(), "card": info["card"],
              "sizes": "tiny" if tiny else "full"}
  budget = args.budget_seconds or (3600.0 if tiny else DEFAULT_BUDGET_SECONDS)
  check = Check(path=path, identity=identity, machine=info, mirror=args.mirror,
                context={"tiny": tiny, "root": root,
                         "fashion_mnist_dir": os.path.abspath(args.fashion_mnist_dir)},
                part_limit=sizes.part_limit, budget_seconds=budget, start=start)
  results = run_check(check, PARTS, results, args.resume)
  print("\n" + markdown(results), flush=True)
  done = all((results["parts"].get(p.name) or {}).get("status") == "done" for p in PARTS)
  if done and not args.workdir_root:
    shutil.rmtree(root, ignore_errors=True)
  elif not done:
    print(f"Not every part is done (--resume runs the rest); the runs' logs are under {root}",
          file=sys.stderr)
  return 0 if done else 1


if __name__ == "__main__":
  sys.exit(main())
