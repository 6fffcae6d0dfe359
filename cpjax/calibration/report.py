"""The calibration report: metrics before/after temperature scaling, every post-hoc map, OOD.

`build_report` and `gamma_summary` are pure (arrays in, a JSON-ready dict out);
`write_report` is the side-effecting edge that writes `results.json`,
`results.md` and the PNG figures (for FL_gamma runs also the test set's gammas,
`gamma_test.npz`, and their histogram) into a report directory, each file
atomically. A dataset with class names (folder, tfds:NAME) has them in the run's
`classes.json` beside the report directory; the report names that list and its source
(labels are indices into it). A built-in dataset has none, and its report is unchanged.
"""

import functools
import json
import logging
import os
import time
from typing import Any

import ml_collections
import numpy as np

from cpjax.calibration import bootstrap, figures, metrics, posthoc, ranking, temperature
from cpjax.runtime import files

EPOCH_METRICS = ("accuracy", "nll", "ece", "adaptive_ece", "classwise_ece", "mce")
SELECTIVE_METRICS = ("aurc", "e_aurc", "selective_risk_90", "selective_risk_95")
REPORT_METRICS = EPOCH_METRICS + ("ece_left_closed", "smooth_ece", "brier", "top5_accuracy",
                                  "s99_share", "s99_accuracy") + SELECTIVE_METRICS
# The post-hoc table's columns (test split).
TABLE_METRICS = ("accuracy", "ece", "ece_left_closed", "adaptive_ece", "classwise_ece", "nll",
                 "brier", "aurc", "e_aurc")
INTERVAL_METRICS = ("ece", "adaptive_ece", "classwise_ece")  # As in the focal-loss paper.
GAMMA_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)
CLASSES_FILE = "classes.json"  # In the workdir, beside report/ (written at the run's start).
CLASSES_SHOWN = 20  # Class names listed in results.md; the rest are in CLASSES_FILE.


class _Rows:
  """A split's logits [N, K] and labels [N], and what several metrics read computed once:
  the float64 log-softmax and softmax, the top label's confidence and correctness (and of
  the float32 softmax, `seed_ece`'s). Each metric gets the same numbers as from the arrays."""

  def __init__(self, logits: np.ndarray, labels: np.ndarray, probs: np.ndarray | None = None):
    self.logits, self.labels = np.asarray(logits), np.asarray(labels)
    if probs is not None:
      self.probs = probs

  @functools.cached_property
  def log_probs(self) -> np.ndarray:
    return metrics.log_softmax(self.logits)

  @functools.cached_property
  def probs(self) -> np.ndarray:
    return np.exp(self.log_probs)  # metrics.softmax.

  @functools.cached_property
  def top(self) -> tuple[np.ndarray, np.ndarray]:
    return metrics.top_label(self.probs, self.labels)

  @functools.cached_property
  def top32(self) -> tuple[np.ndarray, np.ndarray]:
    return metrics.top_label(metrics.softmax_float32(self.logits), self.labels)


def _rows_metrics(num_classes: int, num_bins: int):
  """name -> f(_Rows) for every reported metric."""
  return {
      "accuracy": lambda r: metrics.accuracy(r.probs, r.labels),
      "nll": lambda r: float(-np.mean(r.log_probs[np.arange(len(r.labels)), r.labels])),
      "ece": lambda r: metrics.ece_from_confidences(*r.top, num_bins),
      "ece_left_closed": lambda r: metrics.seed_ece_from_confidences(*r.top32, num_bins),
      "adaptive_ece": lambda r: metrics.adaptive_ece_from_confidences(*r.top, num_bins),
      "classwise_ece": lambda r: metrics.classwise_ece(r.probs, r.labels, num_classes, num_bins),
      "mce": lambda r: metrics.mce_from_confidences(*r.top, num_bins),
      "smooth_ece": lambda r: metrics.smooth_ece(r.probs, r.labels),
      "brier": lambda r: metrics.brier(r.probs, r.labels),
      "top5_accuracy": lambda r: metrics.top_k_accuracy(r.logits, r.labels,
                                                        min(5, num_classes)),
      "s99_share": lambda r: metrics.s99_from_confidences(*r.top)[0],
      "s99_accuracy": lambda r: metrics.s99_from_confidences(*r.top)[1],
      "aurc": lambda r: ranking.aurc_from_confidences(*r.top),
      "e_aurc": lambda r: ranking.e_aurc_from_confidences(*r.top),
      "selective_risk_90": lambda r: ranking.selective_risk_from_confidences(*r.top, 0.9),
      "selective_risk_95": lambda r: ranking.selective_risk_from_confidences(*r.top, 0.95),
  }


def _metric_functions(num_classes: int, num_bins: int):
  """name -> f(probs, logits, labels) for every reported metric (the generic bootstrap's)."""
  return {name: (lambda p, z, y, f=f: f(_Rows(z, y, p)))
          for name, f in _rows_metrics(num_classes, num_bins).items()}


def calibration_metrics(logits: np.ndarray, labels: np.ndarray, num_classes: int,
                        num_bins: int = 15, names=EPOCH_METRICS) -> dict[str, float]:
  """The named metrics of eval-mode logits [N, K].

  Every metric is computed from the float64 softmax of the logits (ECE family:
  right-closed bins), except: `nll` from the logits; `top5_accuracy` ranks the
  logits (no ties where the probabilities underflow to 0); `ece_left_closed`
  is `metrics.seed_ece`, the ECE of Tata et al. 2022's code, which takes a
  float32 softmax of the logits and left-closed bins, so a confidence that is
  exactly 1.0 in float32 (top-logit margin above ~17) is in no bin, as there.
  The softmax and the top label are computed once for all of them.
  """
  functions, rows = _rows_metrics(num_classes, num_bins), _Rows(logits, labels)
  return {name: functions[name](rows) for name in names}


def _intervals(logits, labels, num_classes, config, num_resamples: int | None = None,
               names=INTERVAL_METRICS) -> dict[str, dict[str, float]]:
  """Bootstrap intervals of the named metrics; every metric resamples the same rows (same
  seed), logits and probabilities together, so the NLL's interval is of the same data.

  The resamples never copy the [N, K] probabilities (at ImageNet's K that copy was the
  report's cost): each is computed from how often it draws each row
  (`bootstrap.resampled_values`: matrix products and running sums along the sorted
  confidences, equal to the metric of the resample's rows up to float64 rounding).
  Non-finite probabilities take the generic `bootstrap.bootstrap_interval` (a resample
  without the bad rows is finite).
  """
  functions = _metric_functions(num_classes, config.num_bins)
  probs, logits = metrics.softmax(logits), np.asarray(logits)
  settings = {"level": config.bootstrap_level, "kind": config.bootstrap_kind,
              "seed": config.bootstrap_seed}
  num_resamples = num_resamples or config.bootstrap_resamples
  if not np.all(np.isfinite(probs)):
    return {name: bootstrap.bootstrap_interval(
        functions[name], (probs, logits, labels), num_resamples=num_resamples,
        **settings)._asdict() for name in names}
  # Blocks of resamples of at most ~2^22 draws: the running sums are [block, N] each.
  block = max(1, min(100, (1 << 22) // max(len(labels), 1)))
  values = bootstrap.resampled_values(
      probs, logits, labels, num_classes, config.num_bins, names,
      bootstrap.resampled_rows(len(labels), num_resamples, config.bootstrap_seed, block))
  return {name: bootstrap.interval_from_values(functions[name](probs, logits, labels),
                                               values[name], **settings)._asdict()
          for name in names}


def _ood(test_logits, ood_logits, temperature_value) -> tuple[dict, dict]:
  """AUROC and FPR at 95 % TPR of each OOD score, test set = negatives, OOD set = positives."""
  inside = ranking.ood_scores(test_logits / temperature_value)
  outside = ranking.ood_scores(ood_logits / temperature_value)
  return ({name: ranking.auroc(inside[name], outside[name]) for name in inside},
          {name: ranking.fpr_at_tpr(inside[name], outside[name], 0.95) for name in inside})


def _parameters_for_json(calibrator: posthoc.Calibrator) -> dict[str, Any]:
  """The parametric maps' parameters; the one-vs-rest maps' table shapes (they are large)."""
  if posthoc.MAPS[calibrator.method].parametric:
    return {k: np.asarray(v).tolist() for k, v in calibrator.params.items()}
  return {k: list(np.shape(v)) for k, v in calibrator.params.items()}


def posthoc_table(val: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                  num_classes: int, config: ml_collections.ConfigDict,
                  started: dict[str, Any] | None = None) -> tuple[dict[str, Any], np.ndarray]:
  """Every post-hoc map fitted on validation (strengths by k-fold CV there) and measured on
  test (but those `skip_reason` skips: row {"skipped": why}, also listed under "skipped"),
  with a bootstrap interval of every TABLE_METRICS column (`calibrator_resamples` resamples,
  0 = none: eight maps' intervals at the report's 1,000 would dominate its cost);
  the chosen one (`config.calibrator`, auto = lowest cross-validated validation NLL).
  `started`: {map: a future of (its Calibrator, fit seconds)} of maps whose fits were started
  already (`posthoc.fit_in_background`, with these folds and seed); the others are fitted here.

  Returns:
    (the report's "posthoc" section, the chosen map's test log-probabilities [N, K]).
  """
  rows, calibrators, test_log_probs = {}, {}, {}
  for method in posthoc.MAPS:
    skipped = skip_reason(method, num_classes, config)
    if skipped is not None:
      logging.warning("Post-hoc map %s skipped: %s.", method, skipped)
      rows[method] = {"skipped": skipped}
      continue
    if method in (started or {}):  # Fitted in the background (`posthoc.fit_in_background`).
      calibrators[method], fit_seconds = started[method].result()
    else:
      fit_started = time.perf_counter()
      calibrators[method] = posthoc.fit(method, *val, folds=config.calibrator_folds,
                                        seed=config.bootstrap_seed)
      fit_seconds = time.perf_counter() - fit_started
    test_log_probs[method] = posthoc.apply(calibrators[method], test[0])
    rows[method] = {
        "hyper": {k: v for k, v in calibrators[method].hyper.items() if k in ("odir", "num_bins")},
        "cv_nll": calibrators[method].cv_nll, "fit_seconds": fit_seconds,
        "converged": calibrators[method].converged,
        "grad_norm": calibrators[method].grad_norm, "at_edge": calibrators[method].at_edge,
        "parameters": _parameters_for_json(calibrators[method]),
        "test": calibration_metrics(test_log_probs[method], test[1], num_classes,
                                    config.num_bins, TABLE_METRICS),
        "intervals": (_intervals(test_log_probs[method], test[1], num_classes, config,
                                 config.calibrator_resamples, TABLE_METRICS)
                      if config.calibrator_resamples else {})}
  chosen = posthoc.choose(calibrators, config.calibrator)
  return ({"requested": config.calibrator, "chosen": chosen, "folds": config.calibrator_folds,
           "calibrators": rows,
           "skipped": {method: row["skipped"] for method, row in rows.items() if "skipped" in row}},
          test_log_probs[chosen])


def skip_reason(method: str, num_classes: int, config: ml_collections.ConfigDict) -> str | None:
  """Why the report does not fit `method` (a map with K^2 + K parameters above
  `calibrator_square_max_classes` classes, unless it is the requested calibrator), or None."""
  cap = config.calibrator_square_max_classes
  if (not posthoc.MAPS[method].square or not cap or num_classes <= cap
      or method == config.calibrator):
    return None
  return (f"K = {num_classes} classes > evaluation.calibrator_square_max_classes = {cap}: its "
          f"{num_classes ** 2 + num_classes:,} parameters (K^2 + K) would be fitted "
          f"{len(posthoc.MAPS[method].grid) * config.calibrator_folds + 1} times (each strength "
          "on each fold, then on all rows); raise the limit, set it to 0, or name the map in "
          "evaluation.calibrator to fit it")


def build_report(val: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                 num_classes: int, config: ml_collections.ConfigDict,
                 ood_logits: np.ndarray | None = None) -> dict[str, Any]:
  """Everything of the final report, before and after temperature scaling.

  Args:
    val: (logits, labels) of the validation split; the temperature is fitted here.
    test: (logits, labels) of the test split.
    num_classes: K.
    config: the `evaluation` config section.
    ood_logits: logits of an out-of-distribution set, or None.

  Returns:
    A JSON-ready dict: temperature fit, metrics per split and scaling,
    bootstrap intervals on test, every post-hoc map on test and the chosen one
    (`posthoc_table`), OOD AUROCs and FPRs at 95 % TPR, reliability bins
    ("before_ts", "after_ts", "calibrated": the chosen map), timings.
  """
  with posthoc.one_blas_thread():  # Held until the background fits are done.
    return _build_report(val, test, num_classes, config, ood_logits)


def _build_report(val, test, num_classes, config, ood_logits) -> dict[str, Any]:
  started = report_started = time.perf_counter()
  # The cross-validated iterative fits run in a background thread while the metrics, the
  # intervals and the other maps are computed here.
  background = posthoc.fit_in_background(
      [m for m in posthoc.MAPS if skip_reason(m, num_classes, config) is None], *val,
      folds=config.calibrator_folds, seed=config.bootstrap_seed)
  fit = temperature.fit_temperature(*val, method=config.temperature_method,
                                    num_bins=config.num_bins)
  scalings = {"before_ts": 1.0, "after_ts": fit.temperature}
  report = {"temperature": {**fit._asdict(), "nll_rose": fit.nll_rose},
            "metrics": {}, "reliability": {}, "intervals": {}, "ood": {}}
  for split, (logits, labels) in (("val", val), ("test", test)):
    report["metrics"][split] = {
        tag: calibration_metrics(logits / t, labels, num_classes, config.num_bins,
                                 REPORT_METRICS) for tag, t in scalings.items()}
  for tag, t in scalings.items():
    bins = metrics.reliability_bins(metrics.softmax(test[0] / t), test[1], config.num_bins)
    report["reliability"][tag] = {k: np.asarray(v).tolist() for k, v in bins._asdict().items()}
  metrics_seconds = time.perf_counter() - started
  started = time.perf_counter()
  for tag, t in scalings.items():
    report["intervals"][tag] = _intervals(test[0] / t, test[1], num_classes, config)
  bootstrap_seconds = time.perf_counter() - started
  started = time.perf_counter()
  report["posthoc"], chosen_log_probs = posthoc_table(val, test, num_classes, config,
                                                      background)
  bins = metrics.reliability_bins(np.exp(chosen_log_probs), test[1], config.num_bins)
  report["reliability"]["calibrated"] = {k: np.asarray(v).tolist()
                                         for k, v in bins._asdict().items()}
  posthoc_seconds = time.perf_counter() - started
  if ood_logits is not None:
    ood = {tag: _ood(test[0], ood_logits, t) for tag, t in scalings.items()}
    report["ood"] = {"set": config.ood, **{tag: pair[0] for tag, pair in ood.items()},
                     "fpr_at_95_tpr": {tag: pair[1] for tag, pair in ood.items()}}
  report["seconds"] = {"metrics_and_temperature": metrics_seconds,
                       "bootstrap": bootstrap_seconds, "posthoc": posthoc_seconds,
                       "total": time.perf_counter() - report_started}
  return report


def gamma_summary(gamma: np.ndarray, correct: np.ndarray) -> dict[str, dict[str, float]]:
  """Count, mean, std and quantiles (GAMMA_QUANTILES) of an FL_gamma run's per-example gammas
  [N], over all examples and split by whether the prediction is correct (`correct` [N], 0/1);
  a group without examples has count 0 and NaN statistics."""
  gamma, correct = np.asarray(gamma, np.float64), np.asarray(correct) > 0.5
  out = {}
  for group, rows in (("all", np.ones_like(correct)), ("correct", correct),
                      ("incorrect", ~correct)):
    values = gamma[rows]
    stats = ({"mean": values.mean(), "std": values.std()} if len(values) else
             {"mean": np.nan, "std": np.nan})
    stats.update({f"q{int(round(100 * q)):02d}": (np.quantile(values, q) if len(values) else
                                                  np.nan) for q in GAMMA_QUANTILES})
    out[group] = {"count": int(len(values)), **{k: float(v) for k, v in stats.items()}}
  return out


def _epochs(report: dict[str, Any]) -> str:
  """'after 3 epochs', or 'after 3 epochs and 7 steps of epoch 3' for a mid-epoch checkpoint."""
  text = f"after {report['epoch']} epochs"
  if report.get("epoch_step"):
    text += f" and {report['epoch_step']} steps of epoch {report['epoch']}"
  return text


def _markdown(report: dict[str, Any]) -> str:
  fit = report["temperature"]
  lines = [f"# Calibration report: {report.get('title', '')}", ""]
  if "checkpoint_step" in report:
    lines += [f"The model of global step {report['checkpoint_step']}: {_epochs(report)}.", ""]
  lines += [f"Temperature ({fit['method']}, fitted on validation): T = {fit['temperature']:.3f}; "
            f"validation NLL {fit['nll_before']:.4f} -> {fit['nll_after']:.4f}"
            + (" (NLL ROSE: the fit does not help NLL)" if fit["nll_rose"] else ""), ""]
  for split, by_tag in report["metrics"].items():
    lines += [f"## {split}", "", "| metric | before TS | after TS |", "|---|---|---|"]
    lines += [f"| {name} | {by_tag['before_ts'][name]:.4f} | {by_tag['after_ts'][name]:.4f} |"
              for name in by_tag["before_ts"]]
    lines.append("")
  if "classes" in report:
    lines += _classes_markdown(report["classes"])
  lines += ["## test: bootstrap intervals", ""]
  for tag, by_name in report["intervals"].items():
    for name, iv in by_name.items():
      lines.append(f"- {tag} {name}: {iv['point']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}] "
                   f"({iv['level']:.0%} {iv['kind']}, B={iv['num_resamples']}, "
                   f"seed {iv['seed']})")
  if "posthoc" in report:
    lines += _posthoc_markdown(report["posthoc"])
  if report["ood"]:
    ood, fpr = report["ood"], report["ood"].get("fpr_at_95_tpr", {})
    lines += ["", f"## OOD (test vs {ood['set']}): AUROC, and FPR at 95 % TPR", "",
              "| score | AUROC before TS | AUROC after TS | FPR95 before TS | FPR95 after TS |",
              "|---|---|---|---|---|"]
    lines += [f"| {name} | {ood['before_ts'][name]:.4f} | {ood['after_ts'][name]:.4f} | "
              + " | ".join(f"{fpr[tag][name]:.4f}" if fpr else "—"
                           for tag in ("before_ts", "after_ts")) + " |"
              for name in ood["before_ts"]]
  if "gamma" in report:
    lines += ["", "## gamma-Net's gamma on the test set (eval-mode features)", "",
              "| predictions | count | mean | std | " + " | ".join(
                  f"q{int(round(100 * q)):02d}" for q in GAMMA_QUANTILES) + " |",
              "|---" * (4 + len(GAMMA_QUANTILES)) + "|"]
    for group, stats in report["gamma"].items():
      lines.append(f"| {group} | {stats['count']} | " + " | ".join(
          f"{v:.3f}" for k, v in stats.items() if k != "count") + " |")
  num_bins = len(report["reliability"]["before_ts"]["edges"]) - 1
  lines += ["", f"Fractions, not percent. ECE family: {num_bins} right-closed equal-width bins "
            "unless named otherwise; ece_left_closed is the ECE of Tata et al. 2022, 'Can "
            "Calibration Improve Sample Prioritization?' (NeurIPS HITY workshop), as their code "
            "computes it (float32 softmax, left-closed bins). Temperature scaling: Guo et al. "
            "2017, 'On Calibration of Modern Neural Networks' (ICML); AdaECE, classwise ECE, "
            "S99 and the basic bootstrap interval: Mukhoti et al. 2020, 'Calibrating Deep "
            "Neural Networks using Focal Loss' (NeurIPS); smooth ECE: Blasiok & Nakkiran 2024 "
            "(ICLR). Definitions: docs/methods.md in the cpjax repository."]
  return "\n".join(lines) + "\n"


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
           "| map | strength | fit | CV val NLL | " + " | ".join(TABLE_METRICS) + " |",
           "|---" * (len(TABLE_METRICS) + 4) + "|"]
  for method, row in section["calibrators"].items():
    if "skipped" in row:
      continue
    name = f"**{method}**" if method == section["chosen"] else method
    strength = ", ".join(f"{k}={v}" for k, v in row["hyper"].items()) or "—"
    lines.append(f"| {name} | {strength} | {_fit_flag(row)} | {row['cv_nll']:.4f} | "
                 + " | ".join(_with_interval(row, m) for m in TABLE_METRICS) + " |")
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


def write_report(report_dir: str, report: dict[str, Any],
                 gamma: tuple[np.ndarray, np.ndarray] | None = None) -> list[str]:
  """Writes results.json, results.md and three PNGs; with `gamma` = (an FL_gamma run's test
  gammas [N], correct [N]) also gamma_test.npz and gamma_histogram.png. Returns the paths.
  The run's class list (`read_classes` of the report directory's parent), where it has one,
  goes into both (report["classes"])."""
  os.makedirs(report_dir, exist_ok=True)
  classes = read_classes(os.path.dirname(os.path.abspath(report_dir)))
  if classes is not None:
    report = {**report, "classes": classes}
  paths = [os.path.join(report_dir, name) for name in (
      "results.json", "results.md", "reliability_before_ts.png", "reliability_after_ts.png",
      "confidence_histogram.png")]
  if "calibrated" in report["reliability"]:
    paths.append(os.path.join(report_dir, "reliability_calibrated.png"))
    _save_png(paths[-1], figures.reliability_png(report["reliability"]["calibrated"],
                                                 f"test, {report['posthoc']['chosen']}"))
  files.atomic_write(paths[1], _markdown(report))
  for path, tag in zip(paths[2:4], ("before_ts", "after_ts")):
    _save_png(path, figures.reliability_png(report["reliability"][tag],
                                            f"test, {tag.replace('_', ' ')}"))
  _save_png(paths[4], figures.histogram_png(report["reliability"]))
  if gamma is not None:
    paths += [os.path.join(report_dir, name) for name in ("gamma_test.npz", "gamma_histogram.png")]
    files.atomic_write(paths[-2], lambda f: np.savez(f, gamma=gamma[0], correct=gamma[1]))
    _gamma_figure(paths[-1], *gamma)
  # Last: a report killed while being written has no results.json describing it (a rerun
  # that finds one takes the report as complete, cpjax.training.evaluation).
  files.atomic_write(paths[0], json.dumps(strict_json(report), indent=1, allow_nan=False))
  return paths
