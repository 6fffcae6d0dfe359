"""`python main.py` on a GPU in one command: three kinds of real runs of the trainer, tabled.

  python -m benchmarks.carry --check        # first, on a machine without a package registry
  python -m benchmarks.gpu_runs             # one GPU, 16 cores: under 9 minutes
  python -m benchmarks.gpu_runs --tiny      # tiny sizes on a CPU (the test; the default there)

Every run is a user's command, `python main.py --config=FILE --workdir=DIR [--config.X=V]`
in its own process (workdir, checkpoints, metrics.jsonl, the report), read back from its
metrics.jsonl and report/results.json:

  (a) the default job, configs/default.py as it is (--tiny: the tiny net, 2 epochs);
  (b) Fashion-MNIST (real: Debian's IDX files, --fashion-mnist-dir) on the selection study's
      20-epoch schedule (configs/fashion_mnist_long.py as studies/frontier_tiers.py's base run sets
      it): full data, the study's chosen design `topk_anneal-45` (top-k on the train pass's
      entropy, the last 2 epochs on all data: about 48 % of full data's example passes) and
      its neighbour `topk_anneal-55` (about 57 %), their overrides taken from
      studies.frontier's arms; seeds 0, 1, ... each seed's three runs one after another: two
      seeds always, more while the time budget lasts. Wall-clock seconds (training, scoring,
      selection, evaluation, report; the process in all), example passes
      (studies.long_schedule's count), test accuracy, and each design's paired differences
      from full data over the same seeds (90 % t intervals);
  (c) an ImageNet-shaped run over generated JPEGs (benchmarks.feeds.write_folder: 500 x 375
      smooth random colour fields with noise, quality 90; generated, not photographs) in
      1,000 classes, 20 a class in train/ and one in val/ and test/: configs/imagenet.py's
      ResNet-50 in bfloat16 at 224 px, batch 256 (learning rate 0.1 by its linear rule), 2
      epochs, top-k on half the images after a warm-up epoch, scored by a fresh pass, decoded
      by the host stage in worker processes on every core. Per epoch: images/s of training,
      the share of training spent waiting on input, scoring, selection and evaluation
      seconds; the final checkpoint's save, the report at K = 1,000, the GPU's peak memory
      (all from the trainer's records). Beside it, in its own process of the same command,
      benchmarks.gpu_table's bare flax train step on batches already on the device: the rate
      the trainer's last epoch is compared with.

Compilation cache: (a) runs as a user runs it (cpjax's default cache); (b) and (c) with none,
so every run compiles its own steps and no arm loads what another one compiled.

Each run's anatomy, its wall clock by part (start-up, opening the data, compiling and the
compilations counted, steady and warm-up steps, input wait, evaluation, scoring, selection,
checkpoints, report, the rest) from its last metrics.jsonl record, is tabled per run of (a)
and (c) and per arm of (b) (the mean over its seeds); "-" where a record has no such key.

Time: `--budget-seconds` (520 s by default, the whole command) decides only whether another
seed of (b) is run, after (c), from the slowest seed so far; each run has a time limit and is
killed past it with its worker processes (its status "timeout"). The table is printed and
written as JSON and markdown to --out (benchmarks/results/gpu_runs_<card>.json and .md;
_tiny added at tiny sizes). benchmarks.gpu_check runs these runs' kinds within 6 minutes.
Targets on one H100 or H200: the whole command <= 9 minutes; (b) the chosen design's
wall-clock <= 0.6 x full data's; (c) the trainer's training images/s >= 0.8 x the bare
step's, the report at K = 1,000 <= 60 s. Exit status 1 if a run failed.
"""

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks import carry, feeds
from configs import default, fashion_mnist_long, imagenet
from cpjax.calibration import report
from cpjax.config import implied, schema
from cpjax.data import input_pipeline
from studies import frontier_tiers, grid, long_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL, CHOSEN, NEIGHBOUR = "full", "topk_anneal-45", "topk_anneal-55"  # studies/frontier_tiers.py's.
ARMS = (FULL, CHOSEN, NEIGHBOUR)
WHOLE_COMMAND_TARGET, WALL_TARGET, RATE_TARGET, REPORT_TARGET = 540.0, 0.6, 0.8, 60.0


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What the command runs: one GPU's sizes, or `TINY` (a CPU, the test)."""
  budget_seconds: float = 520.0  # Whole command; another (b) seed only if it fits.
  default_job: tuple = ()  # (a): overrides of configs/default.py (none: the default job).
  fashion: tuple = ()  # (b): overrides of the study's base run (none: the study's own).
  min_seeds: int = 2
  max_seeds: int = 10
  classes: int = 1000  # (c)
  train_images: int = 20000
  source_size: tuple = (500, 375)
  imagenet: tuple = (("model.name", "resnet50_imagenet"), ("dataset.image_size", 224),
                     ("batch_size", 256), ("optimizer.learning_rate", 0.1))
  bare_model: str = "resnet50_imagenet"
  bare_size: int = 224
  bare_batch: int = 256
  run_timeout: float = 300.0  # Seconds a run of (a) or (b) may take before it is killed.
  imagenet_timeout: float = 420.0  # (c)'s run; the bare step gets run_timeout.
  # (b), (c): one compilation cache for all their runs (tiny: seconds saved a run), else none.
  shared_cache: bool = False
  tiny: bool = False


TINY = Sizes(
    budget_seconds=0.0, max_seeds=2, classes=10, train_images=40, source_size=(64, 48),
    default_job=(("model.name", "tiny"), ("num_epochs", 2), ("evaluation.bootstrap_resamples", 100),
                 ("evaluation.calibrator_resamples", 20)),
    # 512 of the 54,000 images in batches of 32 (16 steps an epoch), 200 validation images,
    # 8 epochs (the arms' kept fractions follow, by the study's own rule: 23 % and 37 %, 53 %
    # and 61 % of full data's passes), evaluated after the last.
    fashion=(("dataset.train_examples", 512), ("dataset.val_size", 200), ("batch_size", 32),
             ("num_epochs", 8), ("eval_every_epochs", 8),
             ("evaluation.bootstrap_resamples", 20)),
    imagenet=(("model.name", "tiny"), ("dataset.image_size", 16), ("batch_size", 8),
              ("eval_batch_size", 8), ("selection.score_batch_size", 8),
              ("evaluation.bootstrap_resamples", 20), ("evaluation.calibrator_resamples", 20)),
    bare_model="tiny", bare_size=16, bare_batch=8, run_timeout=300.0,
    imagenet_timeout=300.0, shared_cache=True, tiny=True)
# (c)'s settings at both sizes: top-k on half the images after one warm-up epoch, by a fresh
# scoring pass over the host stage; the folder's own val/ and test/; the learning-rate warm-up
# over the first epoch (the recipe's 5 would outlast the run).
IMAGENET_RUN = (("dataset.name", "folder"), ("num_epochs", 2), ("optimizer.warmup_epochs", 1.0),
                ("selection.method", "top_k"),
                ("selection.fraction", 0.5), ("selection.warmup_epochs", 1),
                ("selection.scoring", "fresh"))


# ---------------------------------------------------------------------------------------------
# One run of main.py.


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


def child_env(cache: bool) -> dict[str, str]:
  """This environment for a run; without `cache`, no persistent compilation cache from it
  (JAX_COMPILATION_CACHE_DIR would override the config's)."""
  env = dict(os.environ)
  if not cache:
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
  return env


def cache_dir(sizes: Sizes, root: str) -> str:
  """The compilation cache of (b)'s and (c)'s runs: none, or one they share (--tiny)."""
  return os.path.join(root, "xla_cache") if sizes.shared_cache else ""


def run_process(command: list[str], timeout: float, env: dict[str, str], log_path: str
                ) -> int | str:
  """`command` in a fresh process group (its worker processes too), its output in `log_path`:
  the exit status, or "timeout" when it ran past `timeout` seconds and its group was killed
  (a run past its time leaves no worker behind to slow the next one)."""
  with open(log_path, "w") as log:
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
      return process.wait(timeout=max(timeout, 0.0))
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
      return "timeout"


def log_tail(log_path: str) -> str:
  with open(log_path, errors="replace") as log:
    return log.read()[-3000:]


def run_main(config_file: str, workdir: str, flags: list[str], timeout: float,
             env: dict[str, str]) -> dict[str, Any]:
  """`python main.py --config=config_file --workdir=workdir *flags` in a fresh process, its
  output in workdir.log: the exit status ("timeout" if killed at `timeout` seconds), the
  process's seconds and, when it succeeded, its metrics.jsonl records and report."""
  command = ["main.py", f"--config={config_file}", f"--workdir={workdir}", *flags]
  start = time.perf_counter()
  status = run_process([sys.executable, *command], timeout, env, f"{workdir}.log")
  run = {"command": " ".join(["python", *command]), "exit_status": status,
         "seconds": time.perf_counter() - start, "log": f"{workdir}.log"}
  if status != 0:
    run["log_tail"] = log_tail(f"{workdir}.log")
    return run
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    run["records"] = [json.loads(line) for line in f]
  run["report"] = report.read_results(os.path.join(workdir, "report",
                                                               "results.json"))
  return run


def test_accuracy(run: dict[str, Any]) -> float:
  return float(run["report"]["metrics"]["test"]["before_ts"]["accuracy"])


def _done(run: dict[str, Any]) -> bool:
  return run["exit_status"] == 0


# ---------------------------------------------------------------------------------------------
# A run's anatomy: where its wall clock went, from its last metrics.jsonl record.


# The keys of a run's last record that split its wall clock (records of older trainers lack
# them: "-" in the table), with their column names.
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


def anatomy_lines(rows: list[tuple[str, dict[str, float | None] | None]]) -> list[str]:
  """A markdown table of runs' anatomies, a (label, anatomy) each: seconds, or counts for the
  compilations; "-" where a record lacks the key, or the run has no record."""
  def cell(key, value):
    if value is None:
      return "-"
    return f"{value:.0f}" if "compilations" in key else f"{value:.2f}"
  return ["Each run's wall clock by part, from its last metrics.jsonl record (seconds; "
          "compilations counted; \"-\": the record has no such key).", "",
          *table(["run", *(name for _, name in ANATOMY)],
                 [[label, *(cell(key, (part or {}).get(key)) for key in ANATOMY_KEYS)]
                  for label, part in rows]), ""]


# ---------------------------------------------------------------------------------------------
# (a) the default job.


def default_job(sizes: Sizes, root: str, timeout: float | None = None) -> dict[str, Any]:
  """The default job as a user runs it (cpjax's own compilation cache); killed past `timeout`
  seconds (default sizes.run_timeout)."""
  config = grid.apply(default.get_config(), dict(sizes.default_job))
  run = run_main("configs/default.py", os.path.join(root, "default"),
                 override_flags(config, default.get_config()),
                 sizes.run_timeout if timeout is None else timeout, child_env(cache=True))
  row = {k: run[k] for k in ("command", "exit_status", "seconds")}
  if _done(run):
    row.update(test_accuracy=test_accuracy(run), epochs=len(run["records"]),
               anatomy=anatomy(run))
  else:
    row["log_tail"] = run["log_tail"]
  return row


# ---------------------------------------------------------------------------------------------
# (b) Fashion-MNIST: the frontier study's arms.


def fashion_configs(sizes: Sizes, root: str, fashion_mnist_dir: str,
                    names: tuple[str, ...] = ARMS) -> dict[str, Any]:
  """The configs of the arms `names` without their seed: studies/frontier_tiers.py's base run and
  arm overrides, the data prepared once in root/tfds, no compilation cache."""
  base = grid.apply(frontier_tiers.base_config(), {
      **dict(sizes.fashion), "dataset.data_dir": os.path.join(root, "tfds"),
      "dataset.manual_dir": fashion_mnist_dir, "compilation_cache_dir": cache_dir(sizes, root)})
  arms = {arm.name: arm for arm in frontier_tiers.search_arms(base)}
  return {name: grid.apply(base, arms[name].overrides) for name in names}


def fashion_run(config, name: str, seed: int, root: str, sizes: Sizes,
                timeout: float | None = None) -> dict[str, Any]:
  """One arm at one seed: its seconds by part, example passes, test accuracy and anatomy;
  killed past `timeout` seconds (default sizes.run_timeout)."""
  config = grid.apply(config, {"seed": seed})
  run = run_main("configs/fashion_mnist_long.py", os.path.join(root, f"{name}_seed{seed}"),
                 override_flags(config, fashion_mnist_long.get_config()),
                 sizes.run_timeout if timeout is None else timeout, child_env(cache=False))
  row = {"arm": name, "seed": seed, "exit_status": run["exit_status"],
         "wall_seconds": run["seconds"], "command": run["command"]}
  if not _done(run):
    return {**row, "log_tail": run["log_tail"]}
  records, last = run["records"], run["records"][-1]
  return {**row, **{f"{p}_seconds": last[f"total_{p}_seconds"]
                    for p in ("training", "scoring", "selection")},
          "eval_seconds": sum(r.get("eval_seconds", 0.0) for r in records),
          "report_seconds": last["report_seconds"],
          "passes": float(long_schedule.example_passes(config, records)[-1]),
          "test_accuracy": test_accuracy(run), "epochs": len(records), "anatomy": anatomy(run)}


FASHION_COLUMNS = ("wall_seconds", "training_seconds", "scoring_seconds", "selection_seconds",
                   "eval_seconds", "report_seconds", "passes", "test_accuracy")


def arm_means(rows: list[dict[str, Any]], names: tuple[str, ...] = ARMS
              ) -> dict[str, dict[str, Any]]:
  """Per arm of `names`: the finished seeds, each column's mean over them and their mean
  anatomy."""
  out = {}
  for name in names:
    done = [r for r in rows if r["arm"] == name and r["exit_status"] == 0]
    out[name] = {"seeds": [r["seed"] for r in done],
                 **{c: float(np.mean([r[c] for r in done])) if done else math.nan
                    for c in FASHION_COLUMNS},
                 "anatomy": mean_anatomy([r["anatomy"] for r in done])}
  return out


def paired(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
  """Arm `name` against full data over the seeds both finished: test accuracy difference in
  points and the wall-clock, training-time and example-pass ratios, each a mean with its
  90 % t interval over the seeds (long_schedule.seed_interval; NaN bounds below 2 seeds)."""
  by = {(r["arm"], r["seed"]): r for r in rows if r["exit_status"] == 0}
  seeds = sorted(s for a, s in by if a == name and (FULL, s) in by)
  per_seed = {
      "accuracy_points": [100 * (by[name, s]["test_accuracy"] - by[FULL, s]["test_accuracy"])
                          for s in seeds],
      **{f"{c}_ratio": [by[name, s][c] / by[FULL, s][c] for s in seeds]
         for c in ("wall_seconds", "training_seconds", "passes")}}
  out = {"seeds": seeds, "per_seed": per_seed}
  for key, values in per_seed.items():
    out[key] = long_schedule.seed_interval(values) if values else (math.nan,) * 3
  return out


def arm_settings(configs: dict[str, Any]) -> dict[str, dict[str, Any]]:
  """Per arm: its selection settings, epochs and batch size (the fields its name stands for)."""
  return {name: {k: v for k, v in sorted(schema.leaves(c).items())
                 if k.startswith(("selection.", "num_epochs", "batch_size"))}
          for name, c in configs.items()}


def fashion_round(configs: dict, seed: int, root: str, sizes: Sizes,
                  rows: list[dict[str, Any]]) -> float:
  """ARMS at `seed`, appended to `rows`; returns the round's seconds."""
  start = time.perf_counter()
  for name in ARMS:
    rows.append(fashion_run(configs[name], name, seed, root, sizes))
    progress(f"(b) {name} seed {seed}", rows[-1]["exit_status"], rows[-1]["wall_seconds"])
  return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# (c) the ImageNet-shaped run and the bare step.


def write_imagenet_folder(sizes: Sizes, root: str) -> dict[str, Any]:
  """(c)'s generated JPEGs in root/imagenet_shaped: the folder, its seconds and what is in it."""
  folder, start = os.path.join(root, "imagenet_shaped"), time.perf_counter()
  feeds.write_folder(folder, sizes.train_images, *sizes.source_size, classes=sizes.classes)
  return {"folder": folder, "folder_seconds": time.perf_counter() - start,
          "classes": sizes.classes, "train_images": sizes.train_images,
          "source_size": list(sizes.source_size),
          "images": "generated (smooth random colour fields with noise), not photographs"}


def imagenet_run(sizes: Sizes, root: str, folder: str, name: str, overrides: dict[str, Any],
                 cache: str, timeout: float) -> dict[str, Any]:
  """configs/imagenet.py over `folder` as (c) sets it (IMAGENET_RUN, sizes.imagenet, then
  `overrides`), workdir root/name, compilation cache folder `cache` ("" none): its command,
  status and seconds, and when it finished its numbers (`imagenet_numbers`) and anatomy."""
  config = grid.apply(imagenet.get_config(), {
      **dict(IMAGENET_RUN), **dict(sizes.imagenet), "dataset.folder": folder,
      "compilation_cache_dir": cache, **overrides})
  run = run_main("configs/imagenet.py", os.path.join(root, name),
                 override_flags(config, imagenet.get_config()), timeout, child_env(cache=False))
  progress(f"(c) ImageNet-shaped run {name}", run["exit_status"], run["seconds"])
  row = {**{key: run[key] for key in ("command", "exit_status", "seconds")},
         "classes": sizes.classes}
  if _done(run):
    row.update(imagenet_numbers(run), anatomy=anatomy(run))
  else:
    row["log_tail"] = run["log_tail"]
  return row


def imagenet_part(sizes: Sizes, root: str) -> dict[str, Any]:
  """The generated folder, the run over it, and the bare step's rate in its own process."""
  part = write_imagenet_folder(sizes, root)
  run = imagenet_run(sizes, root, part["folder"], "imagenet", {}, cache_dir(sizes, root),
                     sizes.imagenet_timeout)
  part.update(run)
  part["bare_step"] = bare_step_rate(sizes, root)
  progress("(c) bare train step", part["bare_step"].get("exit_status"),
           part["bare_step"]["seconds"])
  bare = part["bare_step"].get("images_per_s")
  if bare and _done(run):
    part["trainer_over_bare"] = part["epochs"][-1]["images_per_s"] / bare
  return part


def imagenet_numbers(run: dict[str, Any]) -> dict[str, Any]:
  """Per epoch, and the run's end, from its records and report."""
  epochs = [{"epoch": r["epoch"], "images": r["selected_k"],
             "training_seconds": r["training_seconds"],
             "images_per_s": r["selected_k"] / r["training_seconds"],
             "input_wait_seconds": r["input_wait_seconds"],
             "input_wait_share": r["input_wait_seconds"] / r["training_seconds"],
             "scoring_seconds": r["scoring_seconds"], "selection_seconds": r["selection_seconds"],
             "eval_seconds": r.get("eval_seconds", math.nan)} for r in run["records"]]
  last, report = run["records"][-1], run["report"]
  return {"epochs": epochs, "checkpoint_seconds": last["checkpoint_seconds"],
          "report_seconds": last["report_seconds"],
          "report_build_seconds": report["seconds"]["total"],
          "peak_device_memory_bytes": last.get("perf/peak_device_memory_bytes"),
          "test_accuracy": test_accuracy(run)}


def bare_step_rate(sizes: Sizes, root: str, timeout: float | None = None) -> dict[str, Any]:
  """benchmarks.bare_step (gpu_table's bare flax train step) at (c)'s model, size, batch and
  classes, in a fresh process of this command: images/s on batches already on the device;
  killed past `timeout` seconds (default sizes.run_timeout)."""
  out = os.path.join(root, "bare_step.json")
  command = [sys.executable, "-m", "benchmarks.bare_step", f"--model={sizes.bare_model}",
             f"--image-size={sizes.bare_size}", f"--batch-size={sizes.bare_batch}",
             f"--classes={sizes.classes}", f"--json={out}", *(["--tiny"] if sizes.tiny else [])]
  start = time.perf_counter()
  status = run_process(command, sizes.run_timeout if timeout is None else timeout,
                       child_env(cache=False), os.path.join(root, "bare_step.log"))
  row = {"exit_status": status, "seconds": time.perf_counter() - start}
  if status == 0:
    with open(out) as f:
      row.update(json.load(f))
  else:
    row["log_tail"] = log_tail(os.path.join(root, "bare_step.log"))
  return row


# ---------------------------------------------------------------------------------------------
# The machine, the targets, the table.


MACHINE_PROBE = """
import importlib.metadata, json, os, platform, time
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
                  "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                  "tensorflow": version("tensorflow", "tensorflow-cpu"),
                  **{n: version(n) for n in ("jax", "jaxlib", "flax", "optax",
                     "orbax-checkpoint", "tensorflow-datasets", "torch")}}))
"""


def machine(argv: list[str], module: str = "benchmarks.gpu_runs") -> dict[str, Any]:
  """The card and library versions, from a fresh process (this one starts no JAX backend:
  the JPEG folder is written by forked processes), and the command `python -m module *argv`."""
  result = subprocess.run([sys.executable, "-c", MACHINE_PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=True)
  info = json.loads(result.stdout.strip().splitlines()[-1])
  info["command"] = " ".join(["python -m", module, *argv])
  return info


def device_slug(info: dict[str, Any], tiny: bool) -> str:
  """h100, h200, ... from the card's name (else its name's letters and digits); _tiny."""
  found = re.search(r"\b([A-Z]\d{2,4})\b", info["card"])
  slug = (found.group(1) if found and info["backend"] != "cpu"
          else re.sub(r"[^a-z0-9]+", "_", info["card"].lower()).strip("_"))
  return slug.lower() + ("_tiny" if tiny else "")


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
  """Each target's value and whether it is met (None where its numbers are missing)."""
  chosen = results["fashion"]["paired"][CHOSEN]["wall_seconds_ratio"][0]
  part = results["imagenet"]
  rows = [("whole command seconds", results["seconds"], WHOLE_COMMAND_TARGET, "<="),
          (f"(b) {CHOSEN} wall-clock / full data's (mean of the seeds' ratios)", chosen,
           WALL_TARGET, "<="),
          ("(c) trainer's training images/s (last epoch) / the bare step's",
           part.get("trainer_over_bare", math.nan), RATE_TARGET, ">="),
          ("(c) report seconds", part.get("report_seconds", math.nan), REPORT_TARGET, "<=")]
  out = []
  for name, value, bound, sense in rows:
    met = None if not np.isfinite(value) else bool(value <= bound if sense == "<=" else
                                                    value >= bound)
    out.append({"target": name, "value": value, "bound": f"{sense} {bound:g}", "met": met})
  return out


def fmt(value: Any, digits: int = 1) -> str:
  if value is None or (isinstance(value, float) and not np.isfinite(value)):
    return "-"
  if isinstance(value, float):
    return f"{value:,.{digits}f}"
  return str(value)


def _interval(triple, digits: int = 2, sign: str = "+") -> str:
  """'mean [low, high]' (`sign` "+": signed, a difference; "": a ratio)."""
  mean, low, high = triple
  if not np.isfinite(low):
    return fmt(mean, digits)
  form = f"{sign}.{digits}f"
  return f"{mean:{form}} [{low:{form}}, {high:{form}}]"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
          *["| " + " | ".join(r) + " |" for r in rows]]


def machine_lines(m: dict[str, Any], title: str) -> list[str]:
  """The heading `title` on the card, then its date, versions, CPU and the command."""
  return [f"## {title} on {m['card']} ({m['devices']} device(s)), {m['cores']} cores", "",
          f"{m['date']}; Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, flax "
          f"{m['flax']}, optax {m['optax']}, orbax-checkpoint {m['orbax-checkpoint']}, "
          f"tensorflow-datasets {m['tensorflow-datasets']}, torch "
          f"{m['torch'] or 'not installed'}, tensorflow {m['tensorflow'] or 'not installed'}; "
          f"CPU {m['cpu']}.", "", f"    {m['command']}", ""]


def markdown(results: dict[str, Any]) -> str:
  m, tiny = results["machine"], results["sizes"]["tiny"]
  lines = machine_lines(m, "python main.py" + (" - tiny sizes" if tiny else ""))
  lines += [f"Whole command: {results['seconds']:.0f} s.", ""]
  lines += default_lines(results["default_job"])
  lines += fashion_lines(results["fashion"], tiny)
  lines += _imagenet_lines(results["imagenet"])
  fashion = results["fashion"]["means"]
  lines += ["### Run anatomy", ""] + anatomy_lines(
      [("(a) default job", results["default_job"].get("anatomy")),
       *((f"(b) `{name}`, mean of seeds {','.join(map(str, m['seeds'])) or '-'}",
          m["anatomy"]) for name, m in fashion.items()),
       ("(c) ImageNet-shaped", results["imagenet"].get("anatomy"))])
  lines += ["### Targets" + (" (for one H100 or H200: not for tiny sizes on a CPU)"
                             if tiny else ""), ""]
  lines += table(["target", "value", "bound", "met"],
                 [[t["target"], fmt(t["value"], 2), t["bound"],
                   "-" if t["met"] is None else ("yes" if t["met"] else "no")]
                  for t in results["targets"]])
  return "\n".join(lines) + "\n"


def default_lines(row: dict[str, Any]) -> list[str]:
  return ["### (a) The default job", "",
          *table(["command", "exit status", "seconds", "test accuracy"],
                 [[f"`{_without_workdir(row['command'])}`", str(row["exit_status"]),
                   fmt(row["seconds"]), fmt(row.get("test_accuracy"), 4)]]), ""]


def _without_workdir(command: str) -> str:
  return " ".join(w for w in command.split() if not w.startswith("--workdir="))


def fashion_lines(part: dict[str, Any], tiny: bool) -> list[str]:
  size = ("tiny: 512 training images in batches of 32, 200 validation images" if tiny
          else "54,000 training images, 6,000 validation, small_cnn, batch 128")
  lines = [f"### (b) Fashion-MNIST, the selection study's schedule: {part['num_epochs']} epochs",
           "",
           f"Real Fashion-MNIST (Debian's IDX files), {size}; studies/frontier_tiers.py's arms; "
           "seconds are means over the seeds, the process's wall clock and its parts from "
           "metrics.jsonl (evaluation: every evaluation pass, the final one included).", ""]
  means = part["means"]
  lines += table(["arm", "seeds", "wall s", "training s", "scoring s", "selection s",
                  "evaluation s", "report s", "example passes (x full)", "test accuracy"],
                 [[f"`{name}`", ",".join(map(str, m["seeds"])), fmt(m["wall_seconds"]),
                   fmt(m["training_seconds"]), fmt(m["scoring_seconds"], 2),
                   fmt(m["selection_seconds"], 2), fmt(m["eval_seconds"]),
                   fmt(m["report_seconds"]),
                   f"{m['passes']:,.0f} ({m['passes'] / means[FULL]['passes']:.3f})"
                   if np.isfinite(m["passes"]) else "-", fmt(m["test_accuracy"], 4)]
                  for name, m in means.items()])
  lines += ["", "Paired with full data, same seeds (mean [90 % t interval]):", ""]
  lines += table(["arm", "seeds", "test accuracy, points", "wall-clock ratio",
                  "training-seconds ratio", "example-pass ratio"],
                 [[f"`{name}`", ",".join(map(str, p["seeds"])),
                   _interval(p["accuracy_points"]), _interval(p["wall_seconds_ratio"], 3, ""),
                   _interval(p["training_seconds_ratio"], 3, ""),
                   _interval(p["passes_ratio"], 3, "")]
                 for name, p in part["paired"].items()])
  failed = [r for r in part["runs"] if r["exit_status"] != 0]
  lines += [""] + [f"- failed: {r['arm']} seed {r['seed']}, status {r['exit_status']}"
                   for r in failed] + ([""] if failed else [])
  return lines


def _imagenet_lines(part: dict[str, Any]) -> list[str]:
  return ["### (c) ImageNet-shaped: generated JPEGs, not photographs", "",
          folder_line(part), "", *imagenet_run_lines(part),
          bare_step_line(part["bare_step"]) + (
              f" The trainer's last epoch / bare: {fmt(part.get('trainer_over_bare'), 3)}."
              if "images_per_s" in part["bare_step"] else ""), ""]


def folder_line(part: dict[str, Any]) -> str:
  return (f"{part['train_images']:,} generated {part['source_size'][0]} x "
          f"{part['source_size'][1]} JPEGs in {part['classes']:,} classes (written in "
          f"{part['folder_seconds']:.0f} s).")


def imagenet_run_lines(run: dict[str, Any]) -> list[str]:
  """One run of (c) (`imagenet_run`): its status, seconds and command; once finished, its
  epochs, final checkpoint, report and peak device memory."""
  lines = [f"Exit status {run['exit_status']}, {run['seconds']:.0f} s.", "",
           f"    {run['command']}", ""]
  if "epochs" not in run:
    return lines
  lines += table(["epoch", "images", "training s", "images/s", "input-wait share",
                  "scoring s", "selection s", "evaluation s"],
                 [[str(e["epoch"]), f"{e['images']:,}", fmt(e["training_seconds"], 2),
                   fmt(e["images_per_s"], 0), fmt(e["input_wait_share"], 3),
                   fmt(e["scoring_seconds"], 2), fmt(e["selection_seconds"], 3),
                   fmt(e["eval_seconds"], 2)] for e in run["epochs"]])
  peak = run["peak_device_memory_bytes"]
  return lines + [
      "", f"Epoch 0's training includes the train step's compile. Final checkpoint: "
      f"{run['checkpoint_seconds']:.2f} s (save and commit). Report at K = "
      f"{run['classes']:,}: "
      f"{run['report_seconds']:.1f} s ({run['report_build_seconds']:.1f} s building it, the "
      "rest its files and logs). Peak device memory: "
      + (f"{peak / 2**30:.2f} GiB." if peak else "not counted by this backend."), ""]


def bare_step_line(bare: dict[str, Any]) -> str:
  return (f"Bare flax train step ({bare.get('model', '-')}, batch {bare.get('batch', '-')}, "
          "batches on the device; its own process): "
          + (f"{bare['images_per_s']:,.0f} images/s." if "images_per_s" in bare
             else f"failed (status {bare['exit_status']})."))


# ---------------------------------------------------------------------------------------------
# The command.


def progress(what: str, status: Any, seconds: float) -> None:
  print(f"{what}: status {status}, {seconds:.1f} s", flush=True)


def run_all(sizes: Sizes, root: str, fashion_mnist_dir: str, start: float) -> dict[str, Any]:
  """(a), (b)'s first seeds, (c), then (b)'s further seeds while the budget lasts."""
  results = {"default_job": default_job(sizes, root)}
  progress("(a) default job", results["default_job"]["exit_status"],
           results["default_job"]["seconds"])
  configs = fashion_configs(sizes, root, fashion_mnist_dir)
  prepare = time.perf_counter()
  input_pipeline.open_or_prepare("fashion_mnist", configs[FULL].dataset)
  rows, rounds = [], []
  fashion = {"prepare_seconds": time.perf_counter() - prepare, "runs": rows,
             "num_epochs": configs[FULL].num_epochs}
  for seed in range(sizes.min_seeds):
    rounds.append(fashion_round(configs, seed, root, sizes, rows))
  results["imagenet"] = imagenet_part(sizes, root)
  seed = sizes.min_seeds
  while (seed < sizes.max_seeds
         and time.perf_counter() - start + max(rounds) <= sizes.budget_seconds):
    rounds.append(fashion_round(configs, seed, root, sizes, rows))
    seed += 1
  fashion.update(means=arm_means(rows),
                 paired={name: paired(rows, name) for name in (CHOSEN, NEIGHBOUR)},
                 arms=arm_settings(configs))
  results["fashion"] = fashion
  return results


def all_succeeded(results: dict[str, Any]) -> bool:
  runs = [results["default_job"], *results["fashion"]["runs"], results["imagenet"],
          results["imagenet"]["bare_step"]]
  return all(r["exit_status"] == 0 for r in runs)


def add_common_arguments(parser: argparse.ArgumentParser, name: str) -> None:
  """--tiny, --out (the folder for `name`_<card>.json and .md), --fashion-mnist-dir and
  --workdir-root."""
  parser.add_argument("--tiny", action="store_true",
                      help="Tiny sizes (a CPU test); the default where JAX finds no GPU.")
  parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"),
                      help=f"Folder for {name}_<card>.json and .md.")
  parser.add_argument("--fashion-mnist-dir", default=carry.FASHION_MNIST_DIR,
                      help="The four Fashion-MNIST IDX files (gzipped or not).")
  parser.add_argument("--workdir-root", default="",
                      help="Where the runs' workdirs and the JPEG folder go (default: a "
                      "temporary folder, removed at the end unless a run failed).")


def write_results(results: dict[str, Any], text: str, stem: str) -> None:
  """The table `text` printed, and written with `results` to stem.md and stem.json."""
  print("\n" + text, flush=True)
  with open(f"{stem}.json", "w") as f:
    json.dump(results, f, indent=1, default=str)
  with open(f"{stem}.md", "w") as f:
    f.write(text)


def clean_up(root: str, ok: bool, keep: bool) -> int:
  """The command's exit status (0: every run succeeded); removes the runs' folder `root`
  unless a run failed (its logs are there) or `keep`."""
  if ok and not keep:
    shutil.rmtree(root, ignore_errors=True)
  elif not ok:
    print(f"A run failed or timed out: its log is kept under {root}", file=sys.stderr)
  return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_common_arguments(parser, "gpu_runs")
  parser.add_argument("--budget-seconds", type=float, default=None,
                      help="The whole command's time budget: another seed of (b) only while "
                      "it fits (default 520 s; --tiny: none beyond the two seeds).")
  parser.add_argument("--max-seeds", type=int, default=None,
                      help="(b)'s seeds at most (default 10; --tiny 2); two always run.")
  parser.add_argument("--imagenet-images", type=int, default=None,
                      help="(c)'s generated training images, whole classes (default 20,000 "
                      "in 1,000 classes; --tiny 40 in 10).")
  args = parser.parse_args(argv)
  argv = sys.argv[1:] if argv is None else argv
  start = time.perf_counter()
  info = machine(argv)
  tiny = args.tiny or info["backend"] == "cpu"
  if tiny and not args.tiny:
    print("No GPU found by JAX: running at tiny sizes (--tiny).", flush=True)
  sizes = TINY if tiny else Sizes()
  chosen = {"budget_seconds": args.budget_seconds, "max_seeds": args.max_seeds,
            "train_images": args.imagenet_images}
  sizes = dataclasses.replace(sizes, **{k: v for k, v in chosen.items() if v is not None})
  if sizes.train_images % sizes.classes or sizes.train_images <= 0:
    parser.error(f"--imagenet-images={sizes.train_images}: must be a positive multiple of "
                 f"the {sizes.classes} classes")
  if sizes.max_seeds < sizes.min_seeds:
    parser.error(f"--max-seeds={sizes.max_seeds}: must be at least {sizes.min_seeds}")
  root = args.workdir_root or tempfile.mkdtemp(prefix="cpjax_gpu_runs_")
  os.makedirs(root, exist_ok=True)
  results = {"machine": info, "sizes": dataclasses.asdict(sizes), "root": root,
             **run_all(sizes, root, os.path.abspath(args.fashion_mnist_dir), start)}
  results["seconds"] = time.perf_counter() - start
  results["targets"] = targets(results)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f"gpu_runs_{device_slug(info, tiny)}")
  write_results(results, markdown(results), stem)
  print(f"Wrote {stem}.json and {stem}.md")
  return clean_up(root, all_succeeded(results), bool(args.workdir_root))


if __name__ == "__main__":
  sys.exit(main())
