"""Study: which selection policy pays on the full Fashion-MNIST?

Every run is configs/fashion_mnist_selection.py (small_cnn, 54,000 training images,
6 epochs, the first on all data, test on the 10,000 test images) with one policy:

  full                  all data every epoch (the reference)
  same_budget-P         all data, cut to the optimizer steps of a P % run, cosine over them
  random-P              a fresh uniform P % each epoch
  rs2-P                 random without replacement across epochs (RS2)
  topk_entropy-P        max train-pass entropy (Tata et al. 2022's method, CE scorer)
  topk_entropy_target-P the same with the recorded entropies of a calibrated target run
                        (mixup alpha 0.15, full data, seed 0; trained once, its cost is
                        reported apart)
  class_balanced-P      top-k entropy within per-class quotas
  stratified-P          CCS: equal-width entropy strata, budget spread evenly
  mixed-P               half the budget at random, half top-k entropy
  sampled-P             Gumbel-top-k on entropy / 0.1
  infobatch             InfoBatch at its natural ratio (r = 0.5, last epoch on all data)

for P in 10 and 30 and seeds 0, 1, 2 (seeds outermost: after each seed the summary,
summary.json and the time-to-accuracy plot are rewritten, so a cut-short study still
reports the seeds it finished). A run whose report exists is not retrained, so the
study resumes where it stopped:

  python -m studies.selection --out=studies/out/selection
"""

import argparse
import json
import logging
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from configs import fashion_mnist_selection  # noqa: E402
from cpjax.calibration import report_files  # noqa: E402
from cpjax.data import splits  # noqa: E402
from cpjax.selection import policies  # noqa: E402
from studies import grid  # noqa: E402

FRACTIONS = (0.1, 0.3)
TEST_SIZE = 10_000  # Fashion-MNIST's test split.
TARGET = {"loss.mixup_alpha": 0.15, "selection.record_scores": True, "seed": 0}
POLICIES = {  # name: overrides of a selected run (method and policy parameters).
    "random": {"selection.method": "random"},
    "rs2": {"selection.method": "random_without_replacement"},
    "topk_entropy": {"selection.method": "top_k"},
    "topk_entropy_target": {"selection.method": "top_k", "selection.scoring": "target_recorded"},
    "class_balanced": {"selection.method": "class_balanced"},
    "stratified": {"selection.method": "stratified"},
    "mixed": {"selection.method": "mixed", "selection.random_share": 0.5},
    "sampled": {"selection.method": "sampled", "selection.temperature": 0.1},
}
INFOBATCH = {"selection.method": "infobatch", "selection.score": "loss",
             "selection.prune_ratio": 0.5,  # The authors' defaults: floor(0.875 * 6) = 5 pruned
             "selection.anneal_fraction": 0.125}  # epochs, the last on all data.


def budget_steps(config, fraction: float) -> int:
  """Optimizer steps of a run keeping `fraction` per selected epoch: the warm-up epochs
  in full, then ceil(k / batch) steps per epoch."""
  num_rows = splits.num_train_examples(config.dataset)
  k = policies.subset_size(fraction, 0, num_rows)
  per_epoch = -(-num_rows // config.batch_size), -(-k // config.batch_size)
  warmup = config.selection.warmup_epochs
  return warmup * per_epoch[0] + (config.num_epochs - warmup) * per_epoch[1]


def cells(config, target_workdir: str) -> list[tuple[str, dict]]:
  out = [("full", {})]
  for fraction in FRACTIONS:
    pct = int(round(fraction * 100))
    out.append((f"same_budget-{pct}", {"budget_steps": budget_steps(config, fraction),
                                       "optimizer.schedule_unit": "step"}))
    for name, overrides in POLICIES.items():
      overrides = {**overrides, "selection.fraction": fraction}
      if overrides.get("selection.scoring") == "target_recorded":
        overrides["selection.target_workdir"] = target_workdir
      out.append((f"{name}-{pct}", overrides))
  out.append(("infobatch", dict(INFOBATCH)))
  return out


def _records(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def run_summary(workdir: str, base, overrides: dict) -> dict:
  """One run's numbers: the study grid's, the per-epoch curve and the subset diagnostics."""
  row = grid.run_cell(base, overrides, workdir)
  records = _records(workdir)
  intervals = report_files.read_results(
      os.path.join(workdir, "report", "results.json"))["intervals"]["before_ts"]
  compute = np.cumsum([sum(r[f"{p}_seconds"] for p in ("scoring", "selection", "training"))
                       for r in records])
  selected = [r for r in records if "subset_class_kl" in r]
  row.update(
      compute_seconds=float(compute[-1]),
      curve_seconds=compute.tolist(),
      curve_accuracy=[r.get("test_accuracy") for r in records],
      # The report bootstraps the ECE family only; accuracy's is the binomial closed form.
      accuracy_halfwidth=1.645 * np.sqrt(row["accuracy"] * (1 - row["accuracy"]) / TEST_SIZE),
      ece_halfwidth=(intervals["ece"]["high"] - intervals["ece"]["low"]) / 2,
      class_kl=float(np.mean([r["subset_class_kl"] for r in selected])) if selected else 0.0,
      min_class_share=(float(min(r["subset_min_class_share"] for r in selected))
                       if selected else 0.1),
      never_selected=selected[-1]["never_selected_share"] if selected else 0.0,
      train_ece=float(np.mean([r["train_ece"] for r in selected])) if selected else None)
  return row


def _mean_std(values) -> str:
  v = np.asarray(values, float)
  return f"{100 * v.mean():.2f} ± {100 * (v.std(ddof=1) if len(v) > 1 else 0):.2f}"


def write_summary(results: dict, seeds: list[int], out: str, target_seconds: float,
                  header: str) -> None:
  """summary.json, summary.md and time_to_accuracy.png from the finished runs."""
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"seeds": seeds, "target_seconds": target_seconds, "results": results}, f,
              indent=1)
  full_compute = np.mean(results["full"]["compute_seconds"]) if "full" in results else None
  full_wall = np.mean(results["full"]["wall_seconds"]) if "full" in results else None
  lines = [header, "", grid.code_versions_line(results), "",
           "| run | seeds | test acc % | test ECE % | ECE after TS % | ±acc / ±ECE (90 %) | "
           "scoring / selection / training s | saving vs full: compute / "
           "process | class KL | min class share | never selected | train-pass ECE % |",
           "|---" * 12 + "|"]
  for name, r in results.items():
    n = len(r["accuracy"])
    compute = np.mean(r["compute_seconds"])
    saving = ("—" if full_compute is None or name == "full" else
              f"{100 * (1 - compute / full_compute):.0f} % / "
              f"{100 * (1 - np.mean(r['wall_seconds']) / full_wall):.0f} %")
    train_ece = [v for v in r["train_ece"] if v is not None]
    lines.append(
        f"| {name} | {n} | {_mean_std(r['accuracy'])} | {_mean_std(r['ece'])} | "
        f"{_mean_std(r['ece_after_ts'])} | {100 * np.mean(r['accuracy_halfwidth']):.2f} / "
        f"{100 * np.mean(r['ece_halfwidth']):.2f} | "
        f"{np.mean(r['scoring_seconds']):.0f} / {np.mean(r['selection_seconds']):.1f} / "
        f"{np.mean(r['training_seconds']):.0f} | {saving} | {np.mean(r['class_kl']):.3f} | "
        f"{100 * np.mean(r['min_class_share']):.1f} % | "
        f"{100 * np.mean(r['never_selected']):.0f} % | "
        f"{'—' if not train_ece else f'{100 * np.mean(train_ece):.1f}'} |")
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("\n".join(lines) + "\n")
  _plot(results, os.path.join(out, "time_to_accuracy.png"))


def _plot(results: dict, path: str) -> None:
  """Test accuracy after each epoch vs cumulative scoring + selection + training seconds, mean
  over seeds: one panel per kept fraction, one colour per policy; full data and InfoBatch
  (no fixed fraction) in both."""
  policies_in_order = ["full", "same_budget", *POLICIES, "infobatch"]
  colours = dict(zip(policies_in_order, plt.get_cmap("tab20").colors[::2] +
                     plt.get_cmap("tab20").colors[1::2]))
  fig, axes = plt.subplots(1, len(FRACTIONS), figsize=(14, 6), sharey=True)
  for ax, fraction in zip(axes, FRACTIONS):
    suffix = f"-{int(round(fraction * 100))}"
    for name, r in results.items():
      policy = name.removesuffix(suffix)
      if name.endswith("0") and not name.endswith(suffix):
        continue  # The other fraction's panel.
      seconds = np.mean([np.asarray(c) for c in r["curve_seconds"]], axis=0)
      accuracy = np.mean([np.asarray(c, float) for c in r["curve_accuracy"]], axis=0)
      ax.plot(seconds, 100 * accuracy, marker=".", label=policy, color=colours[policy],
              linewidth=2.5 if policy in ("full", "same_budget") else 1.3,
              linestyle="--" if policy == "same_budget" else "-")
    ax.set_title(f"{suffix[1:]} % kept per selected epoch")
    ax.set_xlabel("cumulative scoring + selection + training seconds (2-core CPU)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  axes[0].set_ylabel("test accuracy % (mean over seeds)")
  axes[0].set_ylim(86, 92.5)
  fig.suptitle("Fashion-MNIST, small_cnn, 6 epochs (epoch 0 on all data): time to accuracy")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="studies/out/selection")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--only", nargs="*", default=None,
                      help="run only these cells (e.g. full random-10); default: all")
  args = parser.parse_args()
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # Run progress.
  base = fashion_mnist_selection.get_config()
  base.evaluation.bootstrap_resamples = 200  # ECE intervals only; 1,000 would add ~minutes.
  os.makedirs(args.out, exist_ok=True)
  target = os.path.join(args.out, "target_mixup")
  print(f"[{time.strftime('%H:%M:%S')}] target run (mixup 0.15, records its scores)", flush=True)
  grid.run_cell(base, TARGET, target)
  with open(os.path.join(target, "wall_seconds.txt")) as f:
    target_seconds = float(f.read())
  grid_cells = [c for c in cells(base, target) if args.only is None or c[0] in args.only]
  header = (f"# Selection on the full Fashion-MNIST\n\n`python -m studies.selection "
            f"--out={args.out}`; configs/fashion_mnist_selection.py: small_cnn, 54,000 train / "
            "6,000 val / 10,000 test images, 6 epochs (epoch 0 on all data), batch 128. "
            "Accuracy and ECE (15 bins) on the test set, mean ± std over seeds; ± columns: mean "
            "half-widths of each run's 90 % intervals over the 10,000 test images (ECE: the "
            "report's bootstrap, 200 resamples; accuracy: 1.645 sqrt(p (1 - p) / n)). "
            "Seconds: totals of the loop's scoring / selection / training phases (evaluation, "
            "compile and report excluded); saving = 1 - this run's / full's, compute (those "
            "phases) and process (whole run wall). Diagnostics over the selected epochs: mean "
            "class KL of the subset from the full set, smallest class share, share never "
            "selected by the end, train-pass ECE of the trained rows. The target run of "
            f"topk_entropy_target took {target_seconds:.0f} s once (not in its row).")
  results: dict = {}
  for done, seed in enumerate(args.seeds):
    for name, overrides in grid_cells:
      print(f"[{time.strftime('%H:%M:%S')}] seed {seed} {name}", flush=True)
      row = run_summary(os.path.join(args.out, name, f"seed{seed}"), base,
                        {**overrides, "seed": seed})
      for key, value in row.items():
        results.setdefault(name, {}).setdefault(key, []).append(value)
    write_summary(results, args.seeds[:done + 1], args.out, target_seconds, header)
    print(f"[{time.strftime('%H:%M:%S')}] seed {seed} done: {args.out}/summary.md", flush=True)


if __name__ == "__main__":
  main()
