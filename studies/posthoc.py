"""Train-time or post-hoc calibration? Every training loss x every post-hoc map, paired by seed.

The runs are the meta-calibration study's (studies/meta_calibration.py: small_cnn, SGD 0.9,
lr 0.05 cosine, batch 128; digits 30 epochs, Fashion-MNIST 6 epochs; losses cross_entropy,
focal, flsd53, ce_sece, ce_dece, flgamma_sece, flgamma_dece). Each run's report fits every map
of cpjax.calibration.posthoc on its validation split (strengths by 5-fold cross-validation
there) and measures it on the test split. A run is trained in `--out` unless its report
exists; with `--runs DIR`, a run found in DIR under the same layout (DATASET/LOSS/seedN with a
checkpoints/ folder) is copied into `--out` and its maps refitted from its last checkpoint
through the evaluate path (`train.evaluate_only`), without training; a report written before
the post-hoc maps existed is refitted the same way, and `--refit` refits every run's maps.

Each finished run leaves its table (test metrics of every map, and the map chosen on
validation) as a small JSON record in `--records` (default studies/results/posthoc_runs/,
committed with the summary); a run with a record is neither trained nor refitted (except with
`--refit`), so the study continues on a fresh clone, or on another machine, without the
workdirs that produced its finished runs.

The summary has, per dataset, the mean test ECE, NLL and accuracy of every (loss, map) over
seeds, and paired differences against cross-entropy + the map chosen on validation (`auto`,
lowest cross-validated NLL) and against cross-entropy + ensemble temperature scaling (the
report's default map), each loss with its own fit of that map and uncalibrated: the mean
difference over seeds with a 90 % Student-t interval of the per-seed differences (same seed,
same data split). A loss "beats" CE + post-hoc where its interval for ECE or NLL lies wholly
below zero and its accuracy interval not wholly below zero.

  python -m studies.posthoc                      # every dataset, loss and seed, from records
  python -m studies.posthoc --datasets digits    # one dataset

`fashion_mnist_long` takes its runs from the long-schedule study (studies/long_schedule.py:
20 epochs, crop+flip, all 54,000 training images) instead of training them: its full-data
arms `full` (cross_entropy), `flsd53_full` (flsd53) and `flgamma_full` (flgamma_sece), read
from `--long-runs` as they finish: a loss finished at fewer than 2 of the seeds whose
cross-entropy run has finished is left out and named, and the seeds are those at which every
loss kept has finished (each pair complete); a report without the post-hoc table is
refitted from a copy of the run, leaving the long study's own directory untouched.
"""

import argparse
import json
import logging
import os
import shutil
import time

import numpy as np
import scipy.stats

from cpjax.calibration import posthoc
from cpjax.training import train
from studies import grid, long_schedule, meta_calibration

METRICS = ("ece", "nll", "accuracy")
LEVEL = 0.9
LONG = "fashion_mnist_long"
LONG_ARMS = {"cross_entropy": "full", "flsd53": "flsd53_full", "flgamma_sece": "flgamma_full"}
DATASETS = ("digits", "fashion_mnist", LONG)
RECORDS = "studies/results/posthoc_runs"


def workdir_of(root: str, dataset: str, loss: str, seed: int) -> str:
  return os.path.join(root, dataset, loss, f"seed{seed}")


def run_config(dataset: str, loss: str, seed: int):
  if dataset == LONG:
    return long_schedule.run_config(LONG_ARMS[loss], seed)
  return grid.apply(meta_calibration.base_config(dataset),
                    {**meta_calibration.overrides(dataset, loss), "seed": seed})


def long_source(long_runs: str, loss: str, seed: int) -> str:
  return os.path.join(long_runs, LONG_ARMS[loss], f"seed{seed}")


def record_path(records: str, dataset: str, loss: str, seed: int) -> str:
  return os.path.join(records, dataset, loss, f"seed{seed}.json")


def save_record(path: str, rows: dict) -> None:
  """Writes one run's table atomically: a crash leaves the old record or none."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(f"{path}.tmp", "w") as f:
    json.dump(rows, f, indent=1)
  os.replace(f"{path}.tmp", path)


def load_record(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def long_plan(losses: list[str], seeds: list[int], long_runs: str,
              records: str | None = None) -> tuple[list, list, list]:
  """(losses, seeds, left-out losses) of the long-schedule runs ready for the study, every loss
  paired at every seed: the losses finished (a report in `long_runs` or a record in `records`)
  at 2 or more of the seeds whose cross-entropy run has finished (one seed gives no interval),
  and the seeds at which all of those finished."""
  def finished(loss, seed):
    return (os.path.exists(os.path.join(long_source(long_runs, loss, seed), "report",
                                        "results.json"))
            or bool(records) and os.path.exists(record_path(records, LONG, loss, seed)))
  ce_seeds = [s for s in seeds if finished("cross_entropy", s)]
  wanted = [loss for loss in losses if loss in LONG_ARMS]
  ready = [loss for loss in wanted if sum(finished(loss, s) for s in ce_seeds) >= 2]
  ready_seeds = [s for s in ce_seeds if ready and all(finished(loss, s) for loss in ready)]
  return ready, ready_seeds, [loss for loss in wanted if loss not in ready]


def long_report_of(loss: str, seed: int, out: str, long_runs: str, refit: bool = False) -> dict:
  """A finished long-schedule run's report with the post-hoc table: its own if it has one,
  else that of a copy refitted from the run's last checkpoint (the study's run untouched)."""
  source = long_source(long_runs, loss, seed)
  with open(os.path.join(source, "report", "results.json")) as f:
    report = json.load(f)
  if "posthoc" in report and not refit:
    return report
  workdir = workdir_of(out, LONG, loss, seed)
  copied_report = os.path.join(workdir, "report", "results.json")
  if os.path.exists(copied_report) and not refit:
    with open(copied_report) as f:
      report = json.load(f)
    if "posthoc" in report:
      return report
  shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("report", "*.lock"),
                  dirs_exist_ok=True)
  return json.loads(json.dumps(train.evaluate_only(run_config(LONG, loss, seed), workdir),
                               default=float))


def report_of(dataset: str, loss: str, seed: int, out: str, runs: str | None,
              refit: bool = False) -> dict:
  """The run's report with the post-hoc table: copied and refitted, or trained here; with
  `refit`, an existing report is rewritten from the run's last checkpoint (the maps refitted
  by the current code) through the evaluate path."""
  workdir = workdir_of(out, dataset, loss, seed)
  report_path = os.path.join(workdir, "report", "results.json")
  refit = refit and os.path.exists(report_path)  # A report written below is already current.
  source = workdir_of(runs, dataset, loss, seed) if runs else None
  if (not os.path.exists(report_path) and source
      and os.path.isdir(os.path.join(source, "checkpoints"))):
    shutil.copytree(source, workdir, ignore=shutil.ignore_patterns("report"), dirs_exist_ok=True)
    train.evaluate_only(run_config(dataset, loss, seed), workdir)
  if not os.path.exists(report_path):
    grid.run_cell(meta_calibration.base_config(dataset),
                  {**meta_calibration.overrides(dataset, loss), "seed": seed}, workdir)
  with open(report_path) as f:
    report = json.load(f)
  if refit or "posthoc" not in report:  # E.g. written before the maps existed.
    report = json.loads(json.dumps(train.evaluate_only(run_config(dataset, loss, seed), workdir),
                                   default=float))
  return report


def table(report: dict) -> dict[str, dict[str, float]]:
  """method -> test metrics, plus "auto" (the map chosen on validation) -> its metrics."""
  rows = {m: {k: row["test"][k] for k in METRICS}
          for m, row in report["posthoc"]["calibrators"].items()}
  cv_nll = {m: row["cv_nll"] for m, row in report["posthoc"]["calibrators"].items()}
  auto = min(cv_nll, key=cv_nll.get)
  rows["auto"] = {**rows[auto], "map": auto}
  return rows


def run_table(dataset: str, loss: str, seed: int, args: argparse.Namespace) -> dict:
  """One run's table: from its record, else from its report (trained, copied or refitted as
  needed), then recorded."""
  path = record_path(args.records, dataset, loss, seed)
  if os.path.exists(path) and not args.refit:
    return load_record(path)
  rows = table(long_report_of(loss, seed, args.out, args.long_runs, args.refit)
               if dataset == LONG else
               report_of(dataset, loss, seed, args.out, args.runs, args.refit))
  save_record(path, rows)
  return rows


def paired(ours: list[float], theirs: list[float]) -> dict[str, float]:
  """Mean per-seed difference ours - theirs with its Student-t interval (LEVEL)."""
  d = np.asarray(ours, float) - np.asarray(theirs, float)
  mean = float(d.mean())
  if len(d) < 2:
    return {"mean": mean, "low": float("nan"), "high": float("nan"), "seeds": len(d)}
  half = scipy.stats.t.ppf(0.5 + LEVEL / 2, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
  return {"mean": mean, "low": mean - half, "high": mean + half, "seeds": len(d)}


def compare(results: dict, dataset: str, map_name: str = "auto") -> dict:
  """Every loss, uncalibrated and with `map_name` (its own fit), against cross-entropy +
  `map_name`."""
  base = results[dataset]["cross_entropy"][map_name]
  out = {}
  for loss, by_map in results[dataset].items():
    for variant in ("none", map_name):
      if loss == "cross_entropy" and variant == map_name:
        continue
      out[f"{loss}+{variant}"] = {m: paired(by_map[variant][m], base[m]) for m in METRICS}
  return out


BASELINES = ("auto", "ensemble_temperature")  # CE + the map chosen on validation; the default.


def beats(diff: dict) -> bool:
  better = diff["ece"]["high"] < 0 or diff["nll"]["high"] < 0
  return better and not diff["accuracy"]["high"] < 0


RUNS = {
    "digits": "scikit-learn's digits, small_cnn, 30 epochs (the meta-calibration study's runs).",
    "fashion_mnist": "Fashion-MNIST, small_cnn, 6 epochs without augmentation (the "
                     "meta-calibration study's runs).",
    LONG: "Fashion-MNIST, small_cnn, 20 epochs with crop+flip on all 54,000 training images "
          "(the long-schedule study's full-data runs).",
}


def summary_lines(dataset: str, results: dict, seeds: list[int]) -> list[str]:
  by_loss = results[dataset]
  methods = list(posthoc.MAPS.names()) + ["auto"]
  lines = [f"## {dataset} (seeds {seeds})", "", RUNS[dataset], "",
           "Mean test ECE % / NLL over seeds, per training loss (rows) and post-hoc map "
           "(columns; auto = the map of lowest cross-validated validation NLL, per run).", "",
           "| loss | acc % | " + " | ".join(methods) + " |", "|---" * (len(methods) + 2) + "|"]
  best = min(((loss, m) for loss in by_loss for m in posthoc.MAPS.names()),
             key=lambda lm: np.mean(by_loss[lm[0]][lm[1]]["ece"]))
  best_nll = min(((loss, m) for loss in by_loss for m in posthoc.MAPS.names()),
                 key=lambda lm: np.mean(by_loss[lm[0]][lm[1]]["nll"]))
  for loss, by_map in by_loss.items():
    cells = [f"{100 * np.mean(by_map[m]['ece']):.2f} / {np.mean(by_map[m]['nll']):.3f}"
             for m in methods]
    lines.append(f"| {loss} | {100 * np.mean(by_map['none']['accuracy']):.2f} | "
                 + " | ".join(cells) + " |")
  lines += ["", f"Lowest mean test ECE: {best[0]} + {best[1]}; lowest mean test NLL: "
            f"{best_nll[0]} + {best_nll[1]} (chosen on test: descriptive only).", ""]
  for map_name in BASELINES:
    lines += _paired_table(results, dataset, map_name)
  return lines


def _paired_table(results: dict, dataset: str, map_name: str) -> list[str]:
  lines = [f"Paired differences against cross_entropy + {map_name} (per-seed difference, mean "
           f"and {LEVEL:.0%} t-interval; ECE and accuracy in points):", "",
           "| loss + map | ΔECE | ΔNLL | Δaccuracy | beats CE + post-hoc? |",
           "|---|---|---|---|---|"]
  diffs = compare(results, dataset, map_name)
  for name, diff in diffs.items():
    cells = [f"{s * diff[m]['mean']:+.2f} [{s * diff[m]['low']:+.2f}, {s * diff[m]['high']:+.2f}]"
             if m != "nll" else f"{diff[m]['mean']:+.4f} [{diff[m]['low']:+.4f}, "
             f"{diff[m]['high']:+.4f}]" for m, s in (("ece", 100), ("nll", 1), ("accuracy", 100))]
    lines.append(f"| {name} | " + " | ".join(cells) + f" | {'yes' if beats(diff) else 'no'} |")
  winners = [name for name, diff in diffs.items() if beats(diff)]
  one_seed = all(diff["ece"]["seeds"] < 2 for diff in diffs.values())
  lines += ["", f"**Does any training-time calibration loss beat cross-entropy + {map_name} on "
            f"{dataset}?** "
            + ("Not decided: one seed gives no interval." if one_seed else
               f"Yes: {', '.join(winners)}." if winners else
               f"No: no loss, uncalibrated or with {map_name}, has a test ECE or NLL interval "
               f"wholly below cross-entropy + {map_name} at no loss of accuracy."), ""]
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="studies/out/posthoc")
  parser.add_argument("--runs", default=None, help="existing meta-calibration study output")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--datasets", nargs="+", default=list(DATASETS),
                      choices=DATASETS)
  parser.add_argument("--long-runs", default="studies/out/long_schedule",
                      help=f"the long-schedule study's --out, read for {LONG}")
  parser.add_argument("--losses", nargs="+", default=list(meta_calibration.LOSSES),
                      choices=meta_calibration.LOSSES)
  parser.add_argument("--records", default=RECORDS,
                      help=f"one small record per finished run, read before anything is "
                           f"trained or refitted (default {RECORDS}, committed with the results)")
  parser.add_argument("--refit", action="store_true",
                      help="refit every run's maps from its last checkpoint (evaluate path), "
                           "records notwithstanding")
  args = parser.parse_args()
  if "cross_entropy" not in args.losses:
    parser.error("--losses must include cross_entropy (the baseline)")
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
  os.makedirs(args.out, exist_ok=True)
  command = "python -m studies.posthoc " + " ".join(
      f"--{k} {' '.join(map(str, v))}" if isinstance(v, list) else f"--{k}" if v is True
      else f"--{k}={v}" for k, v in ((k.replace("_", "-"), v) for k, v in vars(args).items())
      if v not in (None, False))
  results: dict = {}
  seeds_done: dict = {}
  for dataset in args.datasets:
    losses, seeds = args.losses, args.seeds
    if dataset == LONG:
      losses, seeds, left_out = long_plan(args.losses, args.seeds, args.long_runs,
                                           None if args.refit else args.records)
      print(f"{LONG}: seeds {seeds} of {args.long_runs}; losses {losses}"
            + (f"; left out (not finished at those seeds): {left_out}" if left_out else ""),
            flush=True)
      if "cross_entropy" not in losses:
        continue
    for seed in seeds:
      for loss in losses:
        print(f"[{time.strftime('%H:%M:%S')}] {dataset} seed {seed} {loss}", flush=True)
        for method, values in run_table(dataset, loss, seed, args).items():
          cell = results.setdefault(dataset, {}).setdefault(loss, {}).setdefault(method, {})
          for key, value in values.items():
            cell.setdefault(key, []).append(value)
      seeds_done.setdefault(dataset, []).append(seed)
      write_summary(results, seeds_done, args.out, command)  # After every seed: resumable.


def pooled_lines(dataset: str, results: dict) -> list[str]:
  """Every map against `auto` and against no map, paired over all (loss, seed) runs."""
  by_loss = results[dataset]
  def pooled(method, metric):
    return [v for loss in by_loss for v in by_loss[loss][method][metric]]
  lines = [f"Every map against auto and against none, paired over all {len(pooled('none', 'ece'))}"
           f" (loss, seed) runs of {dataset} (mean, {LEVEL:.0%} t-interval; runs of one seed "
           "share a data split, so the interval is optimistic):", "",
           "| map | ΔECE vs auto | ΔNLL vs auto | Δacc vs auto | ΔECE vs none | ΔNLL vs none |",
           "|---|---|---|---|---|---|"]
  for method in posthoc.MAPS.names():
    cells = []
    for base, metrics in (("auto", METRICS), ("none", ("ece", "nll"))):
      for metric in metrics:
        d = paired(pooled(method, metric), pooled(base, metric))
        scale = 1 if metric == "nll" else 100
        cells.append(f"{scale * d['mean']:+.3f} [{scale * d['low']:+.3f}, "
                     f"{scale * d['high']:+.3f}]")
    lines.append(f"| {method} | " + " | ".join(cells) + " |")
  return lines + [""]


def write_summary(results: dict, seeds: dict, out: str, command: str) -> None:
  lines = ["# Train-time or post-hoc calibration?", "", f"`{command}`", ""]
  for dataset in results:
    lines += summary_lines(dataset, results, seeds[dataset]) + pooled_lines(dataset, results)
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"seeds": seeds, "results": results,
               "paired": {d: {m: compare(results, d, m) for m in BASELINES} for d in results}},
              f, indent=1)
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  main()
