"""Seconds of the calibration report and of its figures, on fixed generated logits.

  python -m benchmarks.report_speed                        # K = 10, 1,000 val / 10,000 test
  python -m benchmarks.report_speed --baseline=../old      # and another checkout, alternating
  python -m benchmarks.report_speed --classes=3 --val=60 --test=100 --repeats=1  # a smoke run

Each measurement is a fresh process (so it pays what a run's report pays: imports, tracing,
compiling) that builds the report (`report.build_report`) with configs/fashion_mnist_long.py's
evaluation settings, `bootstrap_resamples` = 100 and `calibrator_resamples` = 0 (the
benchmark run's) unless told otherwise, writes the per-evaluation TensorBoard images three
times (`evaluation.write_calibration_images`: the reliability diagram and the confidence
histogram, as every evaluation does) and the report's files once (`report_files.write_report`:
results.json, results.md, four PNGs). `--cache=cold` runs with no persistent compilation
cache (a first run on a machine); `warm` with one that an untimed run of the same checkout
filled (every later run, as `python main.py` runs by default); `both` (the default) does both.

With `--baseline=DIR` (a checkout of another commit, e.g. a `git worktree`), the same
measurements run there too, alternating with this checkout's, and the table puts the faster
of `--repeats` runs of each side beside each other. The two sides' reports are compared
number by number (chosen map, cross-validated NLLs, parameters, test metrics, metrics,
intervals) and their per-evaluation images pixel by pixel. Timings on a shared machine are
noisy: compare sides of one run, never runs.

The logits are generated (not a model's): labels drawn from softmax(mu) with mu a one-hot
bump plus noise, and logits an over-confident, class-mixing linear map of mu, so that
temperature, vector, matrix and Dirichlet scaling each have something to fit.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in the measured checkout (its cpjax and configs), so only the standard library, NumPy
# and what that checkout imports are used.
CHILD = r'''
import json, os, sys, tempfile, time
started = time.perf_counter()
import numpy as np
from configs import fashion_mnist_long
try:
  from cpjax.training import evaluation
except ImportError:  # A checkout from before cpjax.training.
  from cpjax import evaluation
from cpjax.calibration import metrics, report
try:
  from cpjax.calibration import report_files
except ImportError:  # A checkout whose report module writes its files too.
  report_files = report
imported = time.perf_counter() - started
args = json.loads(sys.argv[1])


def generated(n, k, seed):
  shared = np.random.default_rng(0)
  mix = 2.0 * np.eye(k) + 0.15 * shared.normal(size=(k, k))
  bias = 0.5 * shared.normal(size=k)
  rng = np.random.default_rng(seed)
  mu = rng.normal(size=(n, k)) * 1.2
  mu[np.arange(n), rng.integers(0, k, n)] += 3.0
  p = np.exp(mu - mu.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  labels = (p.cumsum(1) > rng.random((n, 1))).argmax(1)
  return (mu @ mix + bias).astype(np.float32).astype(np.float64), labels


k = args["classes"]
val, test = generated(args["val"], k, 1), generated(args["test"], k, 2)
config = fashion_mnist_long.get_config().evaluation
config.bootstrap_resamples = args["bootstrap_resamples"]
config.calibrator_resamples = args["calibrator_resamples"]
started, cpu = time.perf_counter(), time.process_time()
results = report.build_report(val, test, k, config)
build, build_cpu = time.perf_counter() - started, time.process_time() - cpu


class Writer:
  def write_images(self, step, images):
    self.images = images


bins = metrics.reliability_bins(metrics.softmax(test[0]), test[1], config.num_bins)
bins = {"before_ts": {name: np.asarray(v).tolist() for name, v in bins._asdict().items()}}
images, writer = [], Writer()
for step in range(3):
  started = time.perf_counter()
  evaluation.write_calibration_images(writer, step, bins)
  images.append(time.perf_counter() - started)
np.savez(args["images"], **{name.replace("/", "_"): v for name, v in writer.images.items()})
with tempfile.TemporaryDirectory() as folder:
  started = time.perf_counter()
  report_files.write_report(os.path.join(folder, "report"), {**results, "title": "generated"})
  files = time.perf_counter() - started
maps = {name: {key: row.get(key) for key in ("cv_nll", "hyper", "parameters", "test")}
        for name, row in results["posthoc"]["calibrators"].items() if "skipped" not in row}
print("RESULT " + json.dumps({
    "seconds": {"import": imported, "report": build, "report_cpu": build_cpu, **{
        f"report_{name}": value for name, value in results["seconds"].items() if name != "total"},
        "first_images": images[0], "later_images": min(images[1:]), "report_files": files},
    "chosen": results["posthoc"]["chosen"], "maps": maps, "metrics": results["metrics"],
    "intervals": results["intervals"], "temperature": results["temperature"]["temperature"]}))
'''


def measure(checkout: str, args: dict, cache: str | None, images: str) -> dict:
  """One fresh process's report and figures in `checkout`; `cache`: a persistent compilation
  cache folder, or None for none."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE",
                                                                   "JAX_PERSISTENT_CACHE"))}
  env["PYTHONPATH"] = checkout
  env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  if cache is not None:
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1")
  run = subprocess.run([sys.executable, "-c", CHILD, json.dumps({**args, "images": images})],
                       cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
  lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
  if run.returncode or not lines:
    raise SystemExit(f"the measurement in {checkout} failed:\n{run.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT "):])


def _numbers(value) -> list[float]:
  """Every number in a nested structure, in a fixed order."""
  if isinstance(value, dict):
    return [x for key in sorted(value) for x in _numbers(value[key])]
  if isinstance(value, list):
    return [x for item in value for x in _numbers(item)]
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return [float(value)]
  return []


def _largest_difference(a, b) -> float:
  x, y = np.array(_numbers(a)), np.array(_numbers(b))
  if x.shape != y.shape:
    return float("inf")
  both_nan = np.isnan(x) & np.isnan(y)
  return float(np.max(np.where(both_nan, 0.0, np.abs(x - y)), initial=0.0))


def compare(ours: dict, theirs: dict, our_images: str, their_images: str) -> dict:
  """How far this checkout's report and images are from the baseline's."""
  same_images = True
  with np.load(our_images) as a, np.load(their_images) as b:
    same_images = sorted(a.files) == sorted(b.files) and all(
        np.array_equal(a[name], b[name]) for name in a.files)
  maps = ours["maps"]
  return {
      "same_chosen_map": ours["chosen"] == theirs["chosen"],
      "same_strengths": all(maps[m]["hyper"] == theirs["maps"][m]["hyper"] for m in maps),
      "cv_nll": max(abs(maps[m]["cv_nll"] - theirs["maps"][m]["cv_nll"]) for m in maps),
      "parameters": max(_largest_difference(maps[m]["parameters"],
                                            theirs["maps"][m]["parameters"]) for m in maps),
      "test_metrics": max(_largest_difference(maps[m]["test"], theirs["maps"][m]["test"])
                          for m in maps),
      "metrics": _largest_difference(ours["metrics"], theirs["metrics"]),
      "intervals": _largest_difference(ours["intervals"], theirs["intervals"]),
      "temperature": abs(ours["temperature"] - theirs["temperature"]),
      "same_images": same_images}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--val", type=int, default=1000, help="validation rows")
  parser.add_argument("--test", type=int, default=10000, help="test rows")
  parser.add_argument("--bootstrap-resamples", type=int, default=100)
  parser.add_argument("--calibrator-resamples", type=int, default=0)
  parser.add_argument("--repeats", type=int, default=3, help="runs of each side; the faster")
  parser.add_argument("--cache", choices=("cold", "warm", "both"), default="both")
  parser.add_argument("--baseline", default="", help="another checkout to measure beside")
  parser.add_argument("--json", default="", help="also write the numbers here")
  args = parser.parse_args()
  sides = {"this": REPO}
  if args.baseline:
    sides = {"baseline": os.path.abspath(args.baseline), **sides}
  child_args = {"classes": args.classes, "val": args.val, "test": args.test,
                "bootstrap_resamples": args.bootstrap_resamples,
                "calibrator_resamples": args.calibrator_resamples}
  modes = ("cold", "warm") if args.cache == "both" else (args.cache,)
  out = {"args": vars(args), "seconds": {}, "differences": {}}
  with tempfile.TemporaryDirectory() as scratch:
    caches = {side: os.path.join(scratch, f"cache_{side}") for side in sides}
    images = {side: os.path.join(scratch, f"images_{side}.npz") for side in sides}
    if "warm" in modes:  # Fill each side's cache once, untimed.
      for side, checkout in sides.items():
        measure(checkout, child_args, caches[side], images[side])
    runs = {(mode, side): [] for mode in modes for side in sides}
    for _ in range(args.repeats):  # Alternating, so a busy spell hits both sides alike.
      for mode in modes:
        for side, checkout in sides.items():
          runs[mode, side].append(measure(checkout, child_args,
                                          caches[side] if mode == "warm" else None,
                                          images[side]))
    for (mode, side), results in runs.items():
      out["seconds"][f"{mode} {side}"] = {name: min(r["seconds"][name] for r in results)
                                          for name in results[0]["seconds"]}
    if args.baseline:
      out["differences"] = compare(runs[modes[0], "this"][0], runs[modes[0], "baseline"][0],
                                   images["this"], images["baseline"])
  _print(out, modes, list(sides))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)


def _print(out: dict, modes, sides) -> None:
  columns = list(next(iter(out["seconds"].values())))
  print(f"{'seconds (min of runs)':<22}" + "".join(f"{c:>22}" for c in columns))
  for mode in modes:
    for side in sides:
      row = out["seconds"][f"{mode} {side}"]
      print(f"{mode + ' ' + side:<22}" + "".join(f"{row[c]:>22.2f}" for c in columns))
    if len(sides) == 2:
      ours, theirs = out["seconds"][f"{mode} this"], out["seconds"][f"{mode} baseline"]
      print(f"{mode + ' this / baseline':<22}" + "".join(
          f"{ours[c] / theirs[c] if theirs[c] else float('nan'):>22.2f}" for c in columns))
  for name, value in out["differences"].items():
    print(f"  {name}: {value}")


if __name__ == "__main__":
  main()
