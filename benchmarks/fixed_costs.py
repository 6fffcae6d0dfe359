"""A short Fashion-MNIST run's wall clock against an earlier commit's, cold and warm, with its
anatomy: does cpjax spend its time training?

  python -m benchmarks.fixed_costs                           # against 1637301, 3 repeats
  python -m benchmarks.fixed_costs --baseline=COMMIT --repeats=5 --out=benchmarks/results

The run (Debian's Fashion-MNIST, prepared beforehand: both sides read the same prepared
tfds dataset; this side's decoded-array file beside it is made by an untimed first run):

  python main.py --config=configs/fashion_mnist_long.py --config.num_epochs=3
      --config.dataset.train_examples=4096 --config.dataset.val_size=1000
      --config.eval_every_epochs=1 --config.evaluation.bootstrap_resamples=100
      --config.evaluation.calibrator_resamples=0 --config.selection.method=top_k
      --config.selection.fraction=0.37 --config.selection.warmup_epochs=1

each time in a fresh workdir. Cold: an empty `compilation_cache_dir`; warm: the same folder
again, after a cold run filled it. The baseline runs from a detached git worktree of
`--baseline` (made under --worktree-root if missing). The two sides alternate, cold then warm,
`--repeats` times; the faster of each side's runs is compared (this machine's timings vary by
up to a quarter between identical runs). Per run: the process's wall clock; this side's
anatomy from its last metrics record (cpjax.runtime.anatomy); the baseline's parts that its
records hold (training, evaluation, scoring, selection, checkpoint, report), the rest being
its start-up, data, compiling and logging. Targets: this side's wall clock at most 0.5 of
the baseline's warm and 0.6 cold; no compilation after the first epoch. Writes
fixed_costs.json and fixed_costs.md to --out.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from studies import long_schedule

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("--config=configs/fashion_mnist_long.py", "--config.num_epochs=3",
         "--config.dataset.train_examples=4096", "--config.dataset.val_size=1000",
         "--config.eval_every_epochs=1", "--config.evaluation.bootstrap_resamples=100",
         "--config.evaluation.calibrator_resamples=0", "--config.selection.method=top_k",
         "--config.selection.fraction=0.37", "--config.selection.warmup_epochs=1")
# --tiny (the suite's smoke run): configs/test.py for 2 epochs, this checkout on both sides.
TINY_FLAGS = ("--config=configs/test.py", "--config.num_epochs=2",
              "--config.selection.method=top_k", "--config.selection.fraction=0.5",
              "--config.selection.warmup_epochs=1")
TARGETS = {"warm": 0.5, "cold": 0.6}
EVAL_IMAGES = 1000 + 10000  # Validation and test images of each evaluation of FLAGS' run.
# The parts every epoch's record (or the last one's) held before the anatomy.
RECORD_PARTS = {"training": "training_seconds", "eval": "eval_seconds",
                "scoring": "scoring_seconds", "selection": "selection_seconds",
                "checkpoint": "checkpoint_seconds", "report": "report_seconds"}


def run_once(repo: str, workdir: str, cache: str, timeout: float,
             flags: tuple[str, ...] = FLAGS) -> dict:
  """One run of the command in `repo` (its own cpjax); its wall clock and last records."""
  env = {k: v for k, v in os.environ.items()  # The config's cache folder, not a user's.
         if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  command = [sys.executable, "main.py", *flags, f"--workdir={workdir}",
             f"--config.compilation_cache_dir={cache}"]
  started = time.perf_counter()
  result = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)
  wall = time.perf_counter() - started
  if result.returncode:
    raise RuntimeError(f"{' '.join(command)} in {repo} failed:\n{result.stderr[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  parts = {name: sum(r.get(key, 0.0) for r in records) for name, key in RECORD_PARTS.items()}
  # Images a second of training and of evaluation (its forward passes, metrics and figures;
  # EVAL_IMAGES a pass) over the epochs after the first (the first compiled, before).
  later = [r for r in records[1:] if r.get("eval_seconds")]
  rates = {"train_images_per_second": sum(r["selected_k"] for r in later)
           / max(sum(r["training_seconds"] for r in later), 1e-9),
           "eval_images_per_second": EVAL_IMAGES * len(later)
           / max(sum(r["eval_seconds"] for r in later), 1e-9)} if later else {}
  anatomy = {k: v for k, v in records[-1].items()
             if k.startswith("perf/") and ("seconds" in k or "compilations" in k)}
  return {"wall": wall, "parts": parts, "anatomy": anatomy, "rates": rates,
          "test_accuracy": records[-1].get("test_accuracy")}


def baseline_tree(commit: str, root: str) -> str:
  """A detached worktree of `commit` (made once under `root`)."""
  path = os.path.join(root, f"cpjax-{commit[:12]}")
  if not os.path.isdir(path):
    subprocess.run(["git", "worktree", "add", "--detach", path, commit], cwd=REPO, check=True,
                   capture_output=True)
  return path


def measure(sides: dict[str, str], repeats: int, timeout: float,
            flags: tuple[str, ...] = FLAGS, prime: bool = True) -> dict:
  """{side: {"cold": [runs], "warm": [runs]}}, the sides alternating."""
  out = {side: {"cold": [], "warm": []} for side in sides}
  scratch = tempfile.mkdtemp(prefix="fixed_costs_")
  try:
    for side, repo in sides.items() if prime else ():  # Untimed: data files made, imports warm.
      run_once(repo, os.path.join(scratch, f"prime-{side}"), os.path.join(scratch, "prime"),
               timeout, flags)
    for i in range(repeats):
      for side, repo in sides.items():
        cache = os.path.join(scratch, f"cache-{side}-{i}")
        for kind in ("cold", "warm"):
          run = run_once(repo, os.path.join(scratch, f"{side}-{i}-{kind}"), cache, timeout,
                         flags)
          out[side][kind].append(run)
          print(f"{side:8s} {kind} #{i + 1}: {run['wall']:.1f} s", flush=True)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  return out


def summarise(runs: dict, baseline: str) -> dict:
  """The fastest run of each side and kind, their ratio, the targets."""
  best = {side: {kind: min(v, key=lambda r: r["wall"]) for kind, v in kinds.items()}
          for side, kinds in runs.items()}
  ratios = {kind: best["current"][kind]["wall"] / best["baseline"][kind]["wall"]
            for kind in ("cold", "warm")}
  late = max(r["anatomy"].get("perf/compilations_after_first_epoch", 0)
             for kind in runs["current"].values() for r in kind)
  return {"baseline": baseline, "best": best, "ratios": ratios,
          "met": {**{kind: ratios[kind] <= TARGETS[kind] for kind in TARGETS},
                  "no_compilation_after_first_epoch": late == 0},
          "all_walls": {side: {kind: [r["wall"] for r in v] for kind, v in kinds.items()}
                        for side, kinds in runs.items()}}


def markdown(summary: dict, machine: str) -> str:
  best, lines = summary["best"], []
  lines += [f"# Fixed costs: a short Fashion-MNIST run against {summary['baseline']}", "",
            f"Machine: {machine}. Fastest of each side's runs (all: "
            f"{json.dumps(summary['all_walls'])}).", "",
            "| | baseline cold | this cold | baseline warm | this warm |", "|---|---|---|---|---|",
            f"| wall clock (s) | {best['baseline']['cold']['wall']:.1f} | "
            f"{best['current']['cold']['wall']:.1f} | {best['baseline']['warm']['wall']:.1f} | "
            f"{best['current']['warm']['wall']:.1f} |"]
  for name in RECORD_PARTS:
    lines.append(f"| {name} (records) | " + " | ".join(
        f"{best[s][k]['parts'][name]:.2f}" for k in ("cold", "warm")
        for s in ("baseline", "current")) + " |")
  rates = best["current"]["warm"]["rates"]
  if rates and summary["baseline"] != "itself":  # --tiny evaluates other images.
    lines += ["", f"This side, warm, epochs after the first: training "
              f"{rates['train_images_per_second']:,.0f} images/s, evaluation "
              f"{rates['eval_images_per_second']:,.0f} images/s (forward passes, metrics and "
              "figures)."]
  lines += ["", f"Ratio this / baseline: cold {summary['ratios']['cold']:.2f} (target <= "
            f"{TARGETS['cold']}), warm {summary['ratios']['warm']:.2f} (target <= "
            f"{TARGETS['warm']}). Met: {summary['met']}.", "",
            "This side's anatomy (perf/ keys of its last record), cold and warm:", ""]
  for kind in ("cold", "warm"):
    anatomy = best["current"][kind]["anatomy"]
    lines.append(f"- {kind}: " + ", ".join(f"{k[5:]} {v:.2f}" if isinstance(v, float)
                                           else f"{k[5:]} {v}" for k, v in anatomy.items()))
  return "\n".join(lines) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--baseline", default="1637301")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--timeout", type=float, default=600)
  parser.add_argument("--worktree-root", default=tempfile.gettempdir())
  parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
  parser.add_argument("--tiny", action="store_true",
                      help="configs/test.py, this checkout on both sides, 1 repeat, unprimed")
  args = parser.parse_args()
  if args.tiny:
    sides = {"baseline": REPO, "current": REPO}
    summary = summarise(measure(sides, 1, args.timeout, TINY_FLAGS, prime=False), "itself")
  else:
    sides = {"baseline": baseline_tree(args.baseline, args.worktree_root), "current": REPO}
    summary = summarise(measure(sides, args.repeats, args.timeout), args.baseline)
  machine = long_schedule.machine()  # The machine's name as the study records give it.
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "fixed_costs.json"), "w") as f:
    json.dump({**summary, "machine": machine}, f, indent=1)
  text = markdown(summary, machine)
  with open(os.path.join(args.out, "fixed_costs.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
