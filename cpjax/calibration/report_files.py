"""The calibration report's files: `write_report` is the side-effecting edge that writes
`results.json`, `results.md` and the PNG figures (for FL_gamma runs also the test set's gammas,
`gamma_test.npz`, and their histogram) of `report.build_report`'s dict into a report
directory, each file atomically; `read_results` and `add_results` read and extend
`results.json`. A dataset with class names (folder, tfds:NAME) has them in the run's
`classes.json` beside the report directory; the report names that list and its source
(labels are indices into it). A built-in dataset has none, and its report is unchanged.
"""

import json
import os
from typing import Any

import numpy as np

from cpjax.calibration import figures, report
from cpjax.runtime import files

CLASSES_FILE = "classes.json"  # In the workdir, beside report/ (written at the run's start).
CLASSES_SHOWN = 20  # Class names listed in results.md; the rest are in CLASSES_FILE.


def _epochs(results: dict[str, Any]) -> str:
  """'after 3 epochs', or 'after 3 epochs and 7 steps of epoch 3' for a mid-epoch checkpoint."""
  text = f"after {results['epoch']} epochs"
  if results.get("epoch_step"):
    text += f" and {results['epoch_step']} steps of epoch {results['epoch']}"
  return text


def _markdown(results: dict[str, Any]) -> str:
  fit = results["temperature"]
  lines = [f"# Calibration report: {results.get('title', '')}", ""]
  if "checkpoint_step" in results:
    lines += [f"The model of global step {results['checkpoint_step']}: {_epochs(results)}.", ""]
  lines += [f"Temperature ({fit['method']}, fitted on validation): T = {fit['temperature']:.3f}; "
            f"validation NLL {fit['nll_before']:.4f} -> {fit['nll_after']:.4f}"
            + (" (NLL ROSE: the fit does not help NLL)" if fit["nll_rose"] else ""), ""]
  for split, by_tag in results["metrics"].items():
    lines += [f"## {split}", "", "| metric | before TS | after TS |", "|---|---|---|"]
    lines += [f"| {name} | {by_tag['before_ts'][name]:.4f} | {by_tag['after_ts'][name]:.4f} |"
              for name in by_tag["before_ts"]]
    lines.append("")
  if "classes" in results:
    lines += _classes_markdown(results["classes"])
  lines += ["## test: bootstrap intervals", ""]
  for tag, by_name in results["intervals"].items():
    for name, iv in by_name.items():
      lines.append(f"- {tag} {name}: {iv['point']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}] "
                   f"({iv['level']:.0%} {iv['kind']}, B={iv['num_resamples']}, "
                   f"seed {iv['seed']})")
  if "posthoc" in results:
    lines += _posthoc_markdown(results["posthoc"])
  if results.get("conformal"):
    lines += _conformal_markdown(results["conformal"], results.get("classes", {}).get("names"))
  if results["ood"]:
    ood, fpr = results["ood"], results["ood"].get("fpr_at_95_tpr", {})
    lines += ["", f"## OOD (test vs {ood['set']}): AUROC, and FPR at 95 % TPR", "",
              "| score | AUROC before TS | AUROC after TS | FPR95 before TS | FPR95 after TS |",
              "|---|---|---|---|---|"]
    lines += [f"| {name} | {ood['before_ts'][name]:.4f} | {ood['after_ts'][name]:.4f} | "
              + " | ".join(f"{fpr[tag][name]:.4f}" if fpr else "—"
                           for tag in ("before_ts", "after_ts")) + " |"
              for name in ood["before_ts"]]
  if "gamma" in results:
    lines += ["", "## gamma-Net's gamma on the test set (eval-mode features)", "",
              "| predictions | count | mean | std | " + " | ".join(
                  f"q{int(round(100 * q)):02d}" for q in report.GAMMA_QUANTILES) + " |",
              "|---" * (4 + len(report.GAMMA_QUANTILES)) + "|"]
    for group, stats in results["gamma"].items():
      lines.append(f"| {group} | {stats['count']} | " + " | ".join(
          f"{v:.3f}" for k, v in stats.items() if k != "count") + " |")
  num_bins = len(results["reliability"]["before_ts"]["edges"]) - 1
  lines += ["", f"Fractions, not percent. ECE family: {num_bins} right-closed equal-width bins "
            "unless named otherwise; ece_left_closed is the ECE of Tata et al. 2022, 'Can "
            "Calibration Improve Sample Prioritization?' (NeurIPS HITY workshop), as their code "
            "computes it (float32 softmax, left-closed bins). Temperature scaling: Guo et al. "
            "2017, 'On Calibration of Modern Neural Networks' (ICML); AdaECE, classwise ECE, "
            "S99 and the basic bootstrap interval: Mukhoti et al. 2020, 'Calibrating Deep "
            "Neural Networks using Focal Loss' (NeurIPS); smooth ECE: Blasiok & Nakkiran 2024 "
            "(ICLR)." + (_CONFORMAL_PAPERS if results.get("conformal") else "")
            + " Definitions: docs/methods.md in the cpjax repository."]
  return "\n".join(lines) + "\n"


_CONFORMAL_PAPERS = (
    " Split conformal: Vovk, Gammerman & Shafer 2005; Angelopoulos & Bates 2021, 'A Gentle "
    "Introduction to Conformal Prediction'; LAC: Sadinle, Lei & Wasserman 2019 (JASA); APS: "
    "Romano, Sesia & Candès 2020, 'Classification with Valid and Adaptive Coverage' "
    "(NeurIPS); RAPS: Angelopoulos, Bates, Malik & Jordan 2021, 'Uncertainty Sets for Image "
    "Classifiers using Conformal Prediction' (ICLR).")
SIZES_SHOWN = 6  # Set sizes listed per set in results.md's coverage by set size.


def _conformal_markdown(section: dict[str, Any], class_names: list[str] | None) -> list[str]:
  """A table per alpha of every score's sets before and after the chosen map, and each set's
  coverage by set size."""
  settings = section["settings"]
  randomised = (f"randomised (u seeded {settings['conformal_seed']})"
                if settings["conformal_randomized"] else "not randomised (u = 1)")
  lines = ["", "## Conformal prediction sets (thresholds from validation, measured on test)", "",
           f"Split conformal on n = {section['validation_rows']} validation rows: a set holds "
           "every class whose score is at most the threshold, the k-th smallest of the n "
           "validation scores, k = ceil((n + 1)(1 - alpha)); coverage >= 1 - alpha for test "
           "rows exchangeable with the validation rows. uncalibrated: softmax of the logits; "
           f"calibrated: **{section['calibrator']}**, fitted on the same validation rows. "
           "Each cell: the test value [bootstrap interval of the test rows, the threshold "
           f"fixed]. aps and raps {randomised}; raps: lambda = "
           f"{settings['conformal_raps_lambda']}, k_reg = {settings['conformal_raps_k_reg']}. "
           "Worst class: its label, coverage and test rows."]
  for alpha in section["alphas"]:
    key = report.alpha_key(alpha)
    lines += _conformal_table(section, key, class_names)
  lines += [f"- **alpha = {key} skipped**: {why}." for key, why in section["skipped"].items()]
  return lines


def _conformal_table(section: dict[str, Any], key: str, class_names: list[str] | None
                     ) -> list[str]:
  first = section["sets"][report.CONFORMAL_TAGS[0]][section["scores"][0]][key]
  lines = ["", f"### alpha = {key} (k = {first['rank']})", "",
           "| score | probabilities | threshold | coverage | mean size | median size | "
           "singletons | empty | worst class | OOD mean size |", "|---" * 10 + "|"]
  by_size = []
  for name in section["scores"]:
    for tag in report.CONFORMAL_TAGS:
      entry = section["sets"][tag][name][key]
      test, intervals = entry["test"], entry["intervals"]
      cells = [f"{test[stat]:.4f} [{intervals[stat]['low']:.4f}, {intervals[stat]['high']:.4f}]"
               for stat in ("coverage", "mean_size")]
      cells += [f"{test['median_size']:g}"]
      cells += [f"{test[stat]:.4f} [{intervals[stat]['low']:.4f}, {intervals[stat]['high']:.4f}]"
                for stat in ("singleton_share", "empty_share")]
      worst = test["worst_class"]
      label = f"{worst} {class_names[worst]}" if class_names and worst >= 0 else f"{worst}"
      cells.append(f"{label}: {test['worst_class_coverage']:.4f} ({test['worst_class_rows']})")
      cells.append(f"{entry['ood']['mean_size']:.3f}" if "ood" in entry else "—")
      lines.append(f"| {name} | {tag} | {entry['threshold']:.6g} | " + " | ".join(cells) + " |")
      sizes = test["by_size"]
      shown = [f"{size}: {coverage:.4f} ({rows})" for size, rows, coverage in zip(
          sizes["size"], sizes["rows"], sizes["coverage"])]
      more = ", ... (all in results.json)" if len(shown) > SIZES_SHOWN else ""
      by_size.append(f"- {name}, {tag}: {', '.join(shown[:SIZES_SHOWN])}{more}")
  return lines + ["", "Coverage by set size (size: coverage (test rows)):", "", *by_size]


def _classes_markdown(section: dict[str, Any]) -> list[str]:
  """The class list: its source and the first CLASSES_SHOWN names with their label ids."""
  names = section["names"]
  shown = ", ".join(f"{i} {name}" for i, name in enumerate(names[:CLASSES_SHOWN]))
  more = f", ... ({len(names)} in all)" if len(names) > CLASSES_SHOWN else ""
  return ["## classes", "", f"{len(names)} classes of {section['dataset']} in label order "
          f"(from {section['source']}; a label is an index into it): {shown}{more}.", ""]


def read_classes(workdir: str) -> dict[str, Any] | None:
  """The class list a run recorded (workdir/classes.json: dataset, names, source), or None
  when its dataset has no class names."""
  path = os.path.join(workdir, CLASSES_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    recorded = json.load(f)
  return {"dataset": recorded["dataset"], "names": list(recorded["classes"]), "source": path}


def _posthoc_markdown(section: dict[str, Any]) -> list[str]:
  """The table of every post-hoc map on the test split, the chosen one in bold."""
  lines = ["", "## Post-hoc maps (fitted on validation, measured on test)", "",
           f"Chosen: **{section['chosen']}** (evaluation.calibrator={section['requested']!r}; "
           f"auto = lowest {section['folds']}-fold cross-validated validation NLL). Each cell: "
           "the test value [bootstrap interval, where evaluation.calibrator_resamples > 0]. "
           "Fit: whether the map's fit converged (else it is its starting map, the identity), "
           "and whether its strength is its grid's edge.", "",
           "| map | strength | fit | CV val NLL | " + " | ".join(report.TABLE_METRICS) + " |",
           "|---" * (len(report.TABLE_METRICS) + 4) + "|"]
  for method, row in section["calibrators"].items():
    if "skipped" in row:
      continue
    name = f"**{method}**" if method == section["chosen"] else method
    strength = ", ".join(f"{k}={v}" for k, v in row["hyper"].items()) or "—"
    lines.append(f"| {name} | {strength} | {_fit_flag(row)} | {row['cv_nll']:.4f} | "
                 + " | ".join(_with_interval(row, m) for m in report.TABLE_METRICS) + " |")
  skipped = section.get("skipped", {})
  if skipped:
    lines += ["", "Not fitted:", ""]
    lines += [f"- **{method} skipped**: {reason}." for method, reason in skipped.items()]
  return lines


def _fit_flag(row: dict[str, Any]) -> str:
  """'ok', or what is wrong: no converged fit, a strength at the edge of its grid."""
  flags = [] if row.get("converged", True) else ["NOT CONVERGED"]
  flags += ["grid edge"] if row.get("at_edge") else []
  return ", ".join(flags) or "ok"


def _with_interval(row: dict[str, Any], name: str) -> str:
  """'value [low, high]', or the value alone where no interval was asked for."""
  interval = row["intervals"].get(name)
  value = f"{row['test'][name]:.4f}"
  return value if interval is None else f"{value} [{interval['low']:.4f}, {interval['high']:.4f}]"


def reliability_title(tag: str, chosen: str = "") -> str:
  """The title of a reliability diagram of `tag` (before_ts, after_ts, or calibrated: named by
  the `chosen` map), in the report's PNG files and TensorBoard's images alike (TensorBoard
  shows each image's step beside it): the same picture is drawn once for both."""
  return f"test, {chosen}" if tag == "calibrated" else f"test, {tag.replace('_', ' ')}"


def _save_png(path: str, png: bytes) -> None:
  files.atomic_write(path, png)


def _gamma_figure(path: str, gamma: np.ndarray, correct: np.ndarray) -> None:
  fig = figures.new_figure(5, 3.5)  # Drawn once per report: not kept.
  ax = fig.subplots()
  edges = np.linspace(0.0, max(float(np.max(gamma)), 1e-6), 41)
  for label, rows in (("correct", correct > 0.5), ("incorrect", correct <= 0.5)):
    if rows.any():  # Shares within each group: the incorrect ones are few.
      ax.stairs(np.histogram(gamma[rows], edges)[0] / rows.sum(), edges,
                label=f"{label} ({rows.sum()})")
  ax.set(xlabel="gamma", ylabel="share of the group's test samples")
  ax.legend()
  fig.tight_layout()
  _save_png(path, figures.png(fig))


def strict_json(value: Any) -> Any:
  """`value` (dicts, lists, numbers, NumPy scalars and arrays) with every float that is NaN or
  infinite replaced by None: JSON has no NaN, and strict parsers refuse Python's `NaN` token."""
  if isinstance(value, dict):
    return {k: strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple, np.ndarray)):
    return [strict_json(v) for v in value]
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    return float(value) if np.isfinite(value) else None
  return value


def add_results(path: str, extra: dict[str, Any]) -> None:
  """Adds `extra`'s keys to the results.json at `path`, atomically (the run's anatomy, known
  only once the report is written)."""
  with open(path, encoding="utf-8") as f:
    saved = json.load(f)
  files.atomic_write(path, json.dumps(strict_json({**saved, **extra}), indent=1,
                                      allow_nan=False))


def read_results(path: str) -> dict[str, Any]:
  """A results.json as written, with each `null` (an undefined value) read back as NaN, so
  arithmetic on it propagates as it did before the file was written."""
  with open(path, encoding="utf-8") as f:
    return _null_to_nan(json.load(f))


def _null_to_nan(value: Any) -> Any:
  if isinstance(value, dict):
    return {k: _null_to_nan(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_null_to_nan(v) for v in value]
  return float("nan") if value is None else value


def write_report(report_dir: str, results: dict[str, Any],
                 gamma: tuple[np.ndarray, np.ndarray] | None = None) -> list[str]:
  """Writes results.json, results.md and three PNGs (four with the chosen map's reliability
  diagram, five with conformal prediction sets: set_size_histogram.png); with `gamma` = (an
  FL_gamma run's test gammas [N], correct [N]) also gamma_test.npz and gamma_histogram.png.
  Returns the paths.
  The run's class list (`read_classes` of the report directory's parent), where it has one,
  goes into both (results["classes"])."""
  os.makedirs(report_dir, exist_ok=True)
  classes = read_classes(os.path.dirname(os.path.abspath(report_dir)))
  if classes is not None:
    results = {**results, "classes": classes}
  paths = [os.path.join(report_dir, name) for name in (
      "results.json", "results.md", "reliability_before_ts.png", "reliability_after_ts.png",
      "confidence_histogram.png")]
  if "calibrated" in results["reliability"]:
    paths.append(os.path.join(report_dir, "reliability_calibrated.png"))
    _save_png(paths[-1], figures.reliability_png(
        results["reliability"]["calibrated"],
        reliability_title("calibrated", results["posthoc"]["chosen"])))
  files.atomic_write(paths[1], _markdown(results))
  for path, tag in zip(paths[2:4], ("before_ts", "after_ts")):
    _save_png(path, figures.reliability_png(results["reliability"][tag],
                                            reliability_title(tag)))
  _save_png(paths[4], figures.histogram_png(results["reliability"]))
  if results.get("conformal", {}).get("alphas"):
    paths.append(os.path.join(report_dir, "set_size_histogram.png"))
    _save_png(paths[-1], figures.set_size_png(results["conformal"]))
  if gamma is not None:
    paths += [os.path.join(report_dir, name) for name in ("gamma_test.npz", "gamma_histogram.png")]
    files.atomic_write(paths[-2], lambda f: np.savez(f, gamma=gamma[0], correct=gamma[1]))
    _gamma_figure(paths[-1], *gamma)
  # Last: a report killed while being written has no results.json describing it (a rerun
  # that finds one takes the report as complete, cpjax.training.evaluation).
  files.atomic_write(paths[0], json.dumps(strict_json(results), indent=1, allow_nan=False))
  return paths
