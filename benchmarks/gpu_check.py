"""A GPU check that fits a 15-minute GPU window: the trainer's runs and the device stage, in
at most 6 minutes on one H100 or H200, its table written after each part.

  python -m benchmarks.gpu_check --fashion-mnist-dir=gpu_carry/fashion-mnist   # one GPU
  python -m benchmarks.gpu_check --tiny     # tiny sizes on a CPU (the test; the default there)

On a GPU machine without a package registry, bring the carry first (benchmarks.carry): here,
`python -m benchmarks.carry --for=gpu_check --out=gpu_carry`; there, in the checkout,

  python -m benchmarks.carry --unpack=gpu_carry
  pip install --no-index --no-deps --find-links=gpu_carry/wheels -r gpu_carry/requirements.txt
  python -m benchmarks.gpu_check --fashion-mnist-dir=gpu_carry/fashion-mnist

The parts, in this order (the runs are benchmarks.gpu_runs', each `python main.py` in a
process of its own, read back from its metrics.jsonl and report):

  (a) the default job as a user runs it (cpjax's compilation cache);
  (b) real Fashion-MNIST on the frontier study's 20-epoch base run: full data against the
      study's chosen design `topk_anneal-45` (its overrides studies.frontier's), seeds 0 and
      1, seed by seed; no compilation cache, as gpu_runs runs them;
  (c) the ImageNet-shaped run (ResNet-50 bf16, 224 px, batch 256, 20,000 generated 500 x 375
      JPEGs in 1,000 classes) twice, decoded by the host stage and by the device stage
      (dataset.decode=gpu), 9 epochs: one warm-up epoch on all images, then top-k on 90 % of
      them by one fresh scoring pass, so that each run trains 144,000 images after epoch 0
      (21 s at the bare step's 6,829 images/s on an H200, benchmarks/RESULTS.md's GPU table;
      longer where input slows it); evaluated once, at the end. Both runs share ONE
      compilation cache folder, empty before the first: fair for comparing their input (the
      second loads the train step the first compiled), not their start-up. Beside them, the
      bare flax train step's rate (benchmarks.bare_step) in its own process, run first. The
      steady rate: the images trained after epoch 0 over their training seconds (input waits
      included), with the input-wait share of the same seconds;
  (d) benchmarks.gpu_table's device-stage rows in one process of their own, over (c)'s
      folder: the device stage alone (training and evaluation transforms), the input-wait
      share of a ResNet-50 epoch fed by it, and a fresh scoring pass fed by it against the
      resident scoring rate.

Time: `--budget-seconds` (360 by default) is the whole command's, counted from the start of
`main` (after Python's imports). Each part may use what is
left of it less the shares the parts after it keep (a: 7 %, b: 23 %, c: 47 %, d: 20 %), so a
part that ends early leaves its time to the next and a slow one never eats a later one's; the
runs of (c) split its time the same way (bare step 22 %, host stage 43 %, device stage 35 %).
A run past its limit is killed with its worker processes and marked "timeout"; a run with no
time left is not started ("timeout", not started); the command goes on to the next part.
After each part the table is printed and written to --out (benchmarks/results/
gpu_check_<card>.md and .json; _tiny at tiny sizes). Each run's anatomy (its wall clock by
part) comes from its last metrics.jsonl record ("-" where a trainer writes no such key).

The targets, printed as met, missed or not measured (not on a GPU; a number missing; (c)'s
rates from under 20 s of steady training): the whole check <= 360 s; (b) full data's seconds
outside steady steps <= 6 and topk_anneal-45's wall clock <= 0.7 x full data's; (c) steady
images/s >= 0.9 x the bare step's with either decoder, and an input-wait share <= 3 % with
decode=gpu; (d) the fresh scoring pass fed by the device stage >= 0.8 x the resident rate.
Exit status 1 if a run failed or timed out.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks import gpu_runs
from cpjax.data import input_pipeline

ARMS = (gpu_runs.FULL, gpu_runs.CHOSEN)
SEEDS = (0, 1)
PART_SHARES = {"default_job": 0.07, "fashion": 0.23, "imagenet": 0.47, "device_stage": 0.20}
RUN_SHARES = {"bare_step": 0.22, "host": 0.43, "decode_gpu": 0.35}  # Of (c) after its folder.
STEADY_SECONDS = 20.0  # (c)'s rates count as measured from this much steady training on.
# gpu_table's rows for (d): the device stage alone, the input-wait share, the fed scoring pass.
DEVICE_ROWS = ("device_stage_train", "device_stage_eval", "input_wait_device_stage",
               "r50_score_cpjax", "r50_score_fed_device_stage")
WHOLE_TARGET, OUTSIDE_TARGET, WALL_TARGET = 360.0, 6.0, 0.7
RATE_TARGET, WAIT_TARGET, SCORING_TARGET = 0.9, 0.03, 0.8


@dataclasses.dataclass(frozen=True)
class Check:
  """What the check runs: gpu_runs' sizes, (c)'s further settings and the time budget."""
  runs: gpu_runs.Sizes
  steady: tuple  # (c): overrides after gpu_runs' (epochs, kept share, one scoring pass).
  decoder: str  # (c)'s device-stage run: dataset.decode (gpu; device_cpu at tiny sizes).
  budget_seconds: float
  tiny: bool = False


FULL_SIZE = Check(
    runs=gpu_runs.Sizes(),
    steady=(("num_epochs", 9), ("selection.fraction", 0.9), ("selection.rescore_every", 0),
            ("eval_every_epochs", 9), ("checkpoint_every_epochs", 9),
            ("evaluation.bootstrap_resamples", 100), ("evaluation.calibrator_resamples", 0)),
    decoder="gpu", budget_seconds=360.0)
# gpu_runs' tiny sizes; (c): 40 images, 3 epochs (20 images in each after the first).
TINY = Check(runs=gpu_runs.TINY,
             steady=(("num_epochs", 3), ("selection.rescore_every", 0),
                     ("eval_every_epochs", 3), ("checkpoint_every_epochs", 3)),
             decoder="device_cpu", budget_seconds=3600.0, tiny=True)


class Clock:
  """Time limits of pieces run in order from one budget: a piece may use what is left of the
  budget less the shares (of the budget) that the pieces after it keep."""

  def __init__(self, seconds: float, shares: dict[str, float], start: float | None = None):
    self.seconds, self.shares = seconds, shares
    self.start = time.perf_counter() if start is None else start

  def left(self) -> float:
    return self.seconds - (time.perf_counter() - self.start)

  def limit(self, name: str) -> float:
    names = list(self.shares)
    later = names[names.index(name) + 1:]
    return self.left() - self.seconds * sum(self.shares[n] for n in later)


class Deadline:
  """The seconds left to one part (at least 0)."""

  def __init__(self, seconds: float):
    self.end = time.perf_counter() + seconds

  def left(self) -> float:
    return max(self.end - time.perf_counter(), 0.0)


def not_started(**row: Any) -> dict[str, Any]:
  return {**row, "exit_status": "timeout", "seconds": 0.0,
          "note": "not started: its part's time limit was reached"}


# ---------------------------------------------------------------------------------------------
# The parts.


def default_part(check: Check, root: str, deadline: Deadline, **_) -> dict[str, Any]:
  return gpu_runs.default_job(check.runs, root, timeout=deadline.left())


def fashion_part(check: Check, root: str, deadline: Deadline, fashion_mnist_dir: str,
                 **_) -> dict[str, Any]:
  """Fashion-MNIST prepared once, then ARMS at seed 0, then at seed 1."""
  configs = gpu_runs.fashion_configs(check.runs, root, fashion_mnist_dir, ARMS)
  prepare = time.perf_counter()
  input_pipeline.open_or_prepare("fashion_mnist", configs[gpu_runs.FULL].dataset)
  rows = []
  for seed in SEEDS:
    for name in ARMS:
      if deadline.left() < 1.0:
        rows.append(not_started(arm=name, seed=seed, wall_seconds=0.0))
        continue
      rows.append(gpu_runs.fashion_run(configs[name], name, seed, root, check.runs,
                                       timeout=deadline.left()))
      gpu_runs.progress(f"(b) {name} seed {seed}", rows[-1]["exit_status"],
                        rows[-1]["wall_seconds"])
  return {"prepare_seconds": time.perf_counter() - prepare, "runs": rows,
          "num_epochs": configs[gpu_runs.FULL].num_epochs,
          "means": gpu_runs.arm_means(rows, ARMS),
          "paired": {gpu_runs.CHOSEN: gpu_runs.paired(rows, gpu_runs.CHOSEN)},
          "arms": gpu_runs.arm_settings(configs)}


def imagenet_part(check: Check, root: str, deadline: Deadline, **_) -> dict[str, Any]:
  """(c)'s folder, the bare step, then the host-stage run and the device-stage run, their
  time split by RUN_SHARES, sharing one compilation cache folder."""
  part = gpu_runs.write_imagenet_folder(check.runs, root)
  clock = Clock(deadline.left(), RUN_SHARES)
  limit = clock.limit("bare_step")
  part["bare_step"] = (gpu_runs.bare_step_rate(check.runs, root, limit) if limit >= 1.0
                       else not_started())
  gpu_runs.progress("(c) bare train step", part["bare_step"]["exit_status"],
                    part["bare_step"]["seconds"])
  cache = os.path.join(root, "xla_cache_imagenet")
  part.update(cache=cache, runs={})
  for name, decode in (("host", "cpu"), ("decode_gpu", check.decoder)):
    limit = clock.limit(name)
    run = (gpu_runs.imagenet_run(check.runs, root, part["folder"], f"imagenet_{name}",
                                 {**dict(check.steady), "dataset.decode": decode}, cache, limit)
           if limit >= 1.0 else not_started())
    run["decode"] = decode
    if "epochs" in run:
      run["steady"] = steady(run, part["bare_step"].get("images_per_s"),
                             check.runs.train_images)
    part["runs"][name] = run
  return part


def steady(run: dict[str, Any], bare_rate: float | None, train_images: int) -> dict[str, Any]:
  """A (c) run's steady training: the epochs after the first (which compiles and warms up),
  their images over their training seconds, the input-wait share of those seconds, the ratio
  to the bare step; and the fresh scoring pass's rate: every training image over the epoch
  with the most scoring seconds (the one pass; the other epochs' are bookkeeping)."""
  later = run["epochs"][1:]
  seconds = sum(e["training_seconds"] for e in later)
  images = sum(e["images"] for e in later)
  scored = max(e["scoring_seconds"] for e in run["epochs"])
  rate = images / seconds if seconds > 0 else math.nan
  return {"epochs": len(later), "images": images, "training_seconds": seconds,
          "images_per_s": rate,
          "input_wait_share": (sum(e["input_wait_seconds"] for e in later) / seconds
                               if seconds > 0 else math.nan),
          "over_bare": rate / bare_rate if bare_rate else math.nan,
          "scoring_images_per_s": train_images / scored if scored > 0 else math.nan}


def device_part(check: Check, root: str, deadline: Deadline, results: dict[str, Any],
                **_) -> dict[str, Any]:
  """gpu_table's DEVICE_ROWS in a process of their own over (c)'s folder (gpu_table writes
  one when (c) wrote none): every row starts while its budget lasts; its watchdog writes the
  rows done 10 s before the part's limit, and the process is killed at the limit."""
  out, log = os.path.join(root, "gpu_table.json"), os.path.join(root, "gpu_table.log")
  folder = results.get("imagenet", {}).get("folder", "")
  limit = deadline.left()
  command = [sys.executable, "-m", "benchmarks.gpu_table", f"--rows={','.join(DEVICE_ROWS)}",
             f"--out={out}", f"--budget-seconds={max(limit - 20.0, 1.0):.0f}",
             "--hard-margin-seconds=10", "--estimate-scale=0",
             *([f"--folder={folder}"] if os.path.isdir(os.path.join(folder, "train")) else []),
             *(["--tiny"] if check.tiny else [])]
  start = time.perf_counter()
  status = gpu_runs.run_process(command, limit, gpu_runs.child_env(cache=False), log)
  part = {"command": " ".join(["python", *command[1:]]), "exit_status": status,
          "seconds": time.perf_counter() - start}
  if os.path.exists(out):  # Also after the watchdog's stop (status 3): the rows done.
    with open(out) as f:
      written = json.load(f)
    part.update(rows={k: v for k, v in written["rows"].items() if k in DEVICE_ROWS},
                ratios=written["ratios"])
  if status != 0:
    part["log_tail"] = gpu_runs.log_tail(log)
  gpu_runs.progress("(d) device-stage rows", status, part["seconds"])
  return part


PARTS = (("default_job", default_part), ("fashion", fashion_part),
         ("imagenet", imagenet_part), ("device_stage", device_part))


# ---------------------------------------------------------------------------------------------
# Targets and the table.


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


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
  """The GPU targets (module docstring) from what ran (tiny sizes: none is measured)."""
  tiny = "tiny sizes, not a GPU" if results["tiny"] else ""
  fashion, imagenet = results.get("fashion", {}), results.get("imagenet", {})
  full = fashion.get("means", {}).get(gpu_runs.FULL, {}).get("anatomy") or {}
  outside = (full["perf/wall_seconds"] - full["perf/steady_step_seconds"]
             if full.get("perf/wall_seconds") is not None
             and full.get("perf/steady_step_seconds") is not None else None)
  ratio = fashion.get("paired", {}).get(gpu_runs.CHOSEN, {}).get("wall_seconds_ratio")
  rows = [_target("whole check, seconds", results.get("seconds"), WHOLE_TARGET, "<=",
                  tiny or ("" if "device_stage" in results else "the check did not finish")),
          _target("(b) full data: seconds outside steady steps (perf/wall_seconds - "
                  "perf/steady_step_seconds, mean of the seeds)", outside, OUTSIDE_TARGET, "<=",
                  tiny),
          _target(f"(b) {gpu_runs.CHOSEN} wall clock / full data's (mean of the seeds' ratios)",
                  ratio[0] if ratio else None, WALL_TARGET, "<=", tiny)]
  for name, label in (("host", "host stage"), ("decode_gpu", "decode=gpu")):
    run = imagenet.get("runs", {}).get(name, {}).get("steady", {})
    short = (f"{run['training_seconds']:.1f} s of steady training, under {STEADY_SECONDS:.0f}"
             if run and run["training_seconds"] < STEADY_SECONDS else "")
    rows.append(_target(f"(c) {label}: steady images/s / the bare step's",
                        run.get("over_bare"), RATE_TARGET, ">=", tiny or short))
    if name == "decode_gpu":
      rows.append(_target("(c) decode=gpu: input-wait share of steady training",
                          run.get("input_wait_share"), WAIT_TARGET, "<=", tiny or short))
  scoring = results.get("device_stage", {}).get("ratios", {}).get(
      "scoring fed by the device stage / resident")
  rows.append(_target("(d) fresh scoring pass fed by the device stage / resident rate",
                      scoring, SCORING_TARGET, ">=", tiny))
  return rows


def _fmt(value: Any, digits: int = 2) -> str:
  return gpu_runs.fmt(value, digits)


def markdown(results: dict[str, Any]) -> str:
  tiny = results["tiny"]
  lines = gpu_runs.machine_lines(results["machine"],
                                 "GPU check" + (" - tiny sizes" if tiny else ""))
  lines += [f"Seconds so far: {results['seconds']:.0f} of the {results['budget_seconds']:.0f} "
            "s budget.", ""]
  parts = results["parts"]
  lines += gpu_runs.table(["part", "limit s", "seconds", "status"],
                          [[name, _fmt(parts[name]["limit_seconds"], 0),
                            _fmt(parts[name]["seconds"], 0), parts[name]["status"]]
                           if name in parts else [name, "-", "-", "not run yet"]
                           for name, _ in PARTS]) + [""]
  if "default_job" in results:
    lines += gpu_runs.default_lines(results["default_job"])
  if "fashion" in results:
    lines += gpu_runs.fashion_lines(results["fashion"], tiny)
  if "imagenet" in results:
    lines += _imagenet_lines(results["imagenet"])
  if "device_stage" in results:
    lines += _device_lines(results["device_stage"])
  lines += ["### Run anatomy", "", *gpu_runs.anatomy_lines(anatomy_rows(results)),
            "### Targets", ""]
  lines += gpu_runs.table(["target", "value", "bound", "status"],
                          [[t["target"], _fmt(t["value"], 3), t["bound"], t["status"]]
                           for t in results["targets"]])
  return "\n".join(lines) + "\n"


def anatomy_rows(results: dict[str, Any]) -> list[tuple[str, Any]]:
  """(label, anatomy) of every run so far, in the order they ran."""
  rows = []
  if "default_job" in results:
    rows.append(("(a) default job", results["default_job"].get("anatomy")))
  for run in results.get("fashion", {}).get("runs", []):
    rows.append((f"(b) `{run['arm']}` seed {run['seed']}", run.get("anatomy")))
  for name, run in results.get("imagenet", {}).get("runs", {}).items():
    rows.append((f"(c) {name} (dataset.decode={run['decode']})", run.get("anatomy")))
  return rows


def _imagenet_lines(part: dict[str, Any]) -> list[str]:
  lines = ["### (c) ImageNet-shaped at a steady state: generated JPEGs, not photographs", "",
           gpu_runs.folder_line(part), "", gpu_runs.bare_step_line(part["bare_step"]), "",
           "The two runs share ONE compilation cache folder, empty before the first: the "
           "host-stage run compiles, the decode=gpu run loads what the first compiled. Fair "
           "for comparing their input, not their start-up.", ""]
  for name, run in part["runs"].items():
    lines += [f"#### {name}: dataset.decode={run['decode']}", ""]
    if "steady" in run:
      s = run["steady"]
      lines += [f"Steady (epochs 1-{s['epochs']}): {s['images']:,} images in "
                f"{s['training_seconds']:.1f} s of training, {_fmt(s['images_per_s'], 0)} "
                f"images/s ({_fmt(s['over_bare'], 3)} x the bare step), input-wait share "
                f"{_fmt(s['input_wait_share'], 3)}; the fresh scoring pass "
                f"{_fmt(s['scoring_images_per_s'], 0)} images/s (its compile included).", ""]
    lines += gpu_runs.imagenet_run_lines(run) if "command" in run else [
        f"{run['exit_status']}: {run['note']}", ""]
  return lines


def _device_lines(part: dict[str, Any]) -> list[str]:
  lines = ["### (d) The device stage (benchmarks.gpu_table's rows)", "",
           f"Exit status {part['exit_status']}, {part['seconds']:.0f} s.", "",
           f"    {part['command']}", ""]
  rows = part.get("rows", {})
  lines += gpu_runs.table(
      ["row", "images/s", "CPU ms an image", "input-wait share", "decoder", "note"],
      [[row.get("label", key), _fmt(row.get("images_per_s"), 0),
        _fmt(row.get("cpu_ms_per_image"), 2), _fmt(row.get("input_wait_share"), 3),
        row.get("decoder", "-"), row.get("skipped") or row.get("error") or ""]
       for key, row in rows.items()])
  lines += [""] + [f"- {name}: {value:.3f}" for name, value in part.get("ratios", {}).items()]
  return lines + [""]


# ---------------------------------------------------------------------------------------------
# The command.


def write(results: dict[str, Any], stem: str) -> None:
  """The targets from what ran so far; the table printed and written as markdown and JSON."""
  results["targets"] = targets(results)
  gpu_runs.write_results(results, markdown(results), stem)


def failed(part: dict[str, Any]) -> bool:
  """Whether any run of a part's results failed or timed out."""
  runs = [part] if "exit_status" in part else []
  runs += part.get("runs", []) if isinstance(part.get("runs"), list) else list(
      part.get("runs", {}).values())
  runs += [part["bare_step"]] if "bare_step" in part else []
  errors = [row for row in part.get("rows", {}).values() if "error" in row]  # (d)'s rows.
  return bool(errors) or any(r["exit_status"] != 0 for r in runs)


def run_parts(check: Check, root: str, stem: str, results: dict[str, Any],
              fashion_mnist_dir: str, clock: Clock) -> None:
  """Each part under its limit, the table written after each."""
  for name, part_fn in PARTS:
    limit = clock.limit(name)
    start = time.perf_counter()
    results[name] = part_fn(check, root, Deadline(limit), results=results,
                            fashion_mnist_dir=fashion_mnist_dir)
    results["parts"][name] = {"limit_seconds": limit, "seconds": time.perf_counter() - start,
                              "status": "failed or timed out" if failed(results[name])
                              else "done"}
    results["seconds"] = time.perf_counter() - clock.start
    write(results, stem)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  gpu_runs.add_common_arguments(parser, "gpu_check")
  parser.add_argument("--budget-seconds", type=float, default=None,
                      help="The whole command's seconds (default 360; --tiny 3600).")
  args = parser.parse_args(argv)
  argv = sys.argv[1:] if argv is None else argv
  start = time.perf_counter()  # The budget counts from here (after Python's imports).
  info = gpu_runs.machine(argv, "benchmarks.gpu_check")
  tiny = args.tiny or info["backend"] == "cpu"
  if tiny and not args.tiny:
    print("No GPU found by JAX: running at tiny sizes (--tiny).", flush=True)
  check = TINY if tiny else FULL_SIZE
  if args.budget_seconds is not None:
    check = dataclasses.replace(check, budget_seconds=args.budget_seconds)
  clock = Clock(check.budget_seconds, PART_SHARES, start)
  root = args.workdir_root or tempfile.mkdtemp(prefix="cpjax_gpu_check_")
  os.makedirs(root, exist_ok=True)
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f"gpu_check_{gpu_runs.device_slug(info, tiny)}")
  results = {"machine": info, "tiny": tiny, "budget_seconds": check.budget_seconds,
             "check": dataclasses.asdict(check), "root": root, "parts": {}}
  run_parts(check, root, stem, results, os.path.abspath(args.fashion_mnist_dir), clock)
  print(f"Wrote {stem}.json and {stem}.md")
  return gpu_runs.clean_up(root, not any(failed(results[name]) for name, _ in PARTS),
                           bool(args.workdir_root))


if __name__ == "__main__":
  sys.exit(main())
