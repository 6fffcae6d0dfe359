"""The calibration report's numbers: metrics before/after temperature scaling, every post-hoc
map, conformal prediction sets, OOD.

`build_report` and `gamma_summary` are pure (arrays in, a JSON-ready dict out);
cpjax/calibration/report_files.py writes the report into its directory.
"""

import contextlib
import functools
import logging
import time
from typing import Any, NamedTuple

import ml_collections
import numpy as np

from cpjax.calibration import bootstrap, conformal, metrics, posthoc, ranking, temperature

EPOCH_METRICS = ("accuracy", "nll", "ece", "adaptive_ece", "classwise_ece", "mce")
SELECTIVE_METRICS = ("aurc", "e_aurc", "selective_risk_90", "selective_risk_95")
REPORT_METRICS = EPOCH_METRICS + ("ece_left_closed", "smooth_ece", "brier", "top5_accuracy",
                                  "s99_share", "s99_accuracy") + SELECTIVE_METRICS
# The post-hoc table's columns (test split).
TABLE_METRICS = ("accuracy", "ece", "ece_left_closed", "adaptive_ece", "classwise_ece", "nll",
                 "brier", "aurc", "e_aurc")
INTERVAL_METRICS = ("ece", "adaptive_ece", "classwise_ece")  # As in the focal-loss paper.
GAMMA_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


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
               names=INTERVAL_METRICS, counts_out: list | None = None
               ) -> dict[str, dict[str, float]]:
  """Bootstrap intervals of the named metrics; every metric resamples the same rows (same
  seed), logits and probabilities together, so the NLL's interval is of the same data.

  The resamples never copy the [N, K] probabilities (at ImageNet's K that copy was the
  report's cost): each is computed from how often it draws each row
  (`bootstrap.resampled_values`: matrix products and running sums along the sorted
  confidences, equal to the metric of the resample's rows up to float64 rounding).
  Non-finite probabilities take the generic `bootstrap.bootstrap_interval` (a resample
  without the bad rows is finite).
  `counts_out`: a list that receives the resamples' row counts (`bootstrap.resampled_values`;
  finite probabilities only), for the conformal section's intervals of the same rows.
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
      bootstrap.resampled_rows(len(labels), num_resamples, config.bootstrap_seed, block),
      counts_out)
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


class PosthocTable(NamedTuple):
  """`fitted_posthoc_table`'s result."""
  section: dict[str, Any]  # The report's "posthoc" section.
  calibrator: posthoc.Calibrator  # The chosen map, fitted on validation.
  test_log_probs: np.ndarray  # Its test log-probabilities [N, K].


def posthoc_table(val: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                  num_classes: int, config: ml_collections.ConfigDict,
                  started: dict[str, Any] | None = None) -> tuple[dict[str, Any], np.ndarray]:
  """(the report's "posthoc" section, the chosen map's test log-probabilities [N, K]):
  `fitted_posthoc_table` without the chosen map itself."""
  table = fitted_posthoc_table(val, test, num_classes, config, started)
  return table.section, table.test_log_probs


def fitted_posthoc_table(val: tuple[np.ndarray, np.ndarray],
                         test: tuple[np.ndarray, np.ndarray], num_classes: int,
                         config: ml_collections.ConfigDict,
                         started: dict[str, Any] | None = None) -> PosthocTable:
  """Every post-hoc map fitted on validation (strengths by k-fold CV there) and measured on
  test (but those `skip_reason` skips: row {"skipped": why}, also listed under "skipped"),
  with a bootstrap interval of every TABLE_METRICS column (`calibrator_resamples` resamples,
  0 = none: eight maps' intervals at the report's 1,000 would dominate its cost);
  the chosen one (`config.calibrator`, auto = lowest cross-validated validation NLL).
  `started`: {map: a future of (its Calibrator, fit seconds)} of maps whose fits were started
  already (`posthoc.fit_in_background`, with these folds and seed); the others are fitted here.

  Returns:
    The report's "posthoc" section, the chosen map and its test log-probabilities [N, K].
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
  return PosthocTable(
      {"requested": config.calibrator, "chosen": chosen, "folds": config.calibrator_folds,
       "calibrators": rows,
       "skipped": {method: row["skipped"] for method, row in rows.items() if "skipped" in row}},
      calibrators[chosen], test_log_probs[chosen])


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


CONFORMAL_TAGS = ("uncalibrated", "calibrated")  # softmax(z); the chosen post-hoc map's.
# The conformal numbers of metrics.jsonl's last record (each set's test value).
CONFORMAL_RECORDED = ("coverage", "mean_size", "singleton_share", "empty_share",
                      "worst_class_coverage")


def alpha_key(alpha: float) -> str:
  """An alpha as the report's keys spell it: the decimal it prints as ("0.1")."""
  return repr(float(alpha))


def _conformal_inputs(val, test, ood_logits, table: PosthocTable) -> dict[str, tuple]:
  """{tag: (validation, test, OOD rows or None, their row-wise map to probabilities)}: the
  logits and softmax (uncalibrated); the chosen map's log-probabilities and exp
  (calibrated). `conformal.split_conformal` maps each block of rows as it reaches it."""
  def calibrated(logits):
    return None if logits is None else posthoc.apply(table.calibrator, logits)
  return {"uncalibrated": (val[0], test[0], ood_logits, conformal.softmax),
          "calibrated": (calibrated(val[0]), table.test_log_probs, calibrated(ood_logits),
                         np.exp)}


def _conformal_draws(config: ml_collections.ConfigDict, num_val: int, num_test: int,
                     num_ood: int) -> dict[int, np.ndarray] | None:
  """The randomised scores' u of each split (`conformal.uniform_draws`), or None (u = 1)."""
  if not config.conformal_randomized:
    return None
  return {split: conformal.uniform_draws(config.conformal_seed, split, rows) for split, rows in (
      (conformal.VALIDATION, num_val), (conformal.TEST, num_test), (conformal.OOD, num_ood))}


def _usable_alphas(config: ml_collections.ConfigDict, num_val: int
                   ) -> tuple[list[float], dict[str, str]]:
  """(the alphas the validation rows reach, {alpha: why not} of the others, logged)."""
  usable, skipped = [], {}
  for alpha in conformal.alphas(config.conformal_alpha):
    problem = conformal.alpha_problem(alpha, num_val)
    if problem is None:
      usable.append(float(alpha))
    else:  # A dataset's own validation split: its size is first known here.
      logging.warning("Conformal prediction sets at alpha %s skipped: %s.", alpha, problem)
      skipped[alpha_key(alpha)] = problem
  return usable, skipped


def conformal_section(val: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                      num_classes: int, config: ml_collections.ConfigDict, table: PosthocTable,
                      ood_logits: np.ndarray | None = None, counts: list | None = None
                      ) -> dict[str, Any] | None:
  """Split conformal prediction sets (`conformal.split_conformal`) of every score of
  `config.conformal_scores` at every alpha of `config.conformal_alpha`, thresholds from the
  validation rows, before and after the chosen post-hoc map (CONFORMAL_TAGS): per set, the
  threshold, the test numbers (`conformal.summary`), their bootstrap intervals
  (`_conformal_intervals`) and, with OOD logits, the OOD rows' mean set size. An alpha the
  validation rows do not reach is skipped and named. None where no score is asked for.

  `counts`: the row counts of the report's other intervals' resamples, where recorded
  (`_intervals`'s `counts_out`); else the same resamples are drawn again.
  """
  names = tuple(config.conformal_scores)
  if not names:
    return None
  usable, skipped = _usable_alphas(config, len(val[1]))
  settings = {name: conformal.keywords(name, config) for name in names}
  draws = _conformal_draws(config, len(val[1]), len(test[1]),
                           0 if ood_logits is None else len(ood_logits))
  sets, measured = {tag: {name: {} for name in names} for tag in CONFORMAL_TAGS}, []
  for tag, (v, t, o, transform) in _conformal_inputs(val, test, ood_logits, table).items():
    found = conformal.split_conformal((v, val[1]), (t, test[1]), names, usable, settings,
                                      draws, o, transform)
    for (name, alpha), result in found.items():
      entry = {"rank": result.rank, "threshold": result.threshold,
               "test": conformal.summary(result.covered, result.sizes, test[1], num_classes)}
      if result.ood_sizes is not None:
        entry["ood"] = {"mean_size": float(np.mean(result.ood_sizes))}
      sets[tag][name][alpha_key(alpha)] = entry
      measured.append((entry, result))
  _conformal_intervals(measured, len(test[1]), config, counts)
  return {"scores": list(names), "alphas": usable, "skipped": skipped,
          "validation_rows": len(val[1]), "test_rows": len(test[1]),
          "calibrator": table.section["chosen"],
          "settings": {s.name: config[s.name] for s in conformal.SCORES.settings()},
          "sets": sets}


def _conformal_intervals(measured: list, num_rows: int, config: ml_collections.ConfigDict,
                         counts: list | None) -> None:
  """Adds to each set's entry the bootstrap interval of each conformal.ROW_STATISTICS
  statistic (coverage, mean size, singleton and empty shares): the test rows resampled as
  for the report's other intervals (`bootstrap_resamples`, `bootstrap_seed`), the threshold
  fixed (it is the validation rows'). All statistics of all sets in one matrix product a
  block of resamples (`bootstrap.resampled_means`: each resample's means bit for bit)."""
  if not measured:
    return
  statistics = conformal.ROW_STATISTICS
  values = np.stack([function(result.covered, result.sizes) for _, result in measured
                     for function in statistics.values()], axis=1)  # [N, sets x statistics]
  if not counts:
    counts = (bootstrap.row_counts(rows, num_rows) for rows in bootstrap.resampled_rows(
        num_rows, config.bootstrap_resamples, config.bootstrap_seed))
  resampled = bootstrap.resampled_means(values, counts)
  column = 0
  for entry, _ in measured:
    entry["intervals"] = {}
    for name in statistics:
      entry["intervals"][name] = bootstrap.interval_from_values(
          entry["test"][name], resampled[:, column], level=config.bootstrap_level,
          kind=config.bootstrap_kind, seed=config.bootstrap_seed)._asdict()
      column += 1


class StartedFits(NamedTuple):
  """`start_fits`' result: the report's BLAS limit, held until the report is built, and the
  futures of its background fits."""
  blas: contextlib.ExitStack
  futures: dict[str, Any]


def start_fits(val: tuple[np.ndarray, np.ndarray], num_classes: int,
               config: ml_collections.ConfigDict) -> StartedFits:
  """One BLAS thread for the report (`posthoc.one_blas_thread`, held until `build_report`
  ends) and its cross-validated iterative fits on the validation rows started in a
  background thread (`posthoc.fit_in_background`): a caller that knows the report's
  validation logits early (the run, while its last checkpoint commits) starts them here."""
  blas = contextlib.ExitStack()
  blas.enter_context(posthoc.one_blas_thread())
  return StartedFits(blas, posthoc.fit_in_background(
      [m for m in posthoc.MAPS if skip_reason(m, num_classes, config) is None], *val,
      folds=config.calibrator_folds, seed=config.bootstrap_seed))


def build_report(val: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                 num_classes: int, config: ml_collections.ConfigDict,
                 ood_logits: np.ndarray | None = None,
                 started: StartedFits | None = None) -> dict[str, Any]:
  """Everything of the final report, before and after temperature scaling.

  Args:
    val: (logits, labels) of the validation split; the temperature is fitted here.
    test: (logits, labels) of the test split.
    num_classes: K.
    config: the `evaluation` config section.
    ood_logits: logits of an out-of-distribution set, or None.
    started: `start_fits` of the same validation rows and config, where called already.

  Returns:
    A JSON-ready dict: temperature fit, metrics per split and scaling,
    bootstrap intervals on test, every post-hoc map on test and the chosen one
    (`posthoc_table`), OOD AUROCs and FPRs at 95 % TPR, reliability bins
    ("before_ts", "after_ts", "calibrated": the chosen map), conformal prediction sets
    before and after the chosen map (`conformal_section`; none where
    `config.conformal_scores` is empty), timings.
  """
  # The cross-validated iterative fits run in a background thread while the metrics, the
  # intervals and the other maps are computed here.
  started = start_fits(val, num_classes, config) if started is None else started
  with started.blas:  # One BLAS thread until the background fits are done.
    return _build_report(val, test, num_classes, config, ood_logits, started.futures)


def _build_report(val, test, num_classes, config, ood_logits, background) -> dict[str, Any]:
  started = report_started = time.perf_counter()
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
  started, counts = time.perf_counter(), []  # The resamples' row counts: for conformal's.
  for tag, t in scalings.items():
    report["intervals"][tag] = _intervals(test[0] / t, test[1], num_classes, config,
                                          counts_out=counts if tag == "before_ts" else None)
  bootstrap_seconds = time.perf_counter() - started
  started = time.perf_counter()
  table = fitted_posthoc_table(val, test, num_classes, config, background)
  report["posthoc"] = table.section
  bins = metrics.reliability_bins(np.exp(table.test_log_probs), test[1], config.num_bins)
  report["reliability"]["calibrated"] = {k: np.asarray(v).tolist()
                                         for k, v in bins._asdict().items()}
  posthoc_seconds = time.perf_counter() - started
  if ood_logits is not None:
    ood = {tag: _ood(test[0], ood_logits, t) for tag, t in scalings.items()}
    report["ood"] = {"set": config.ood, **{tag: pair[0] for tag, pair in ood.items()},
                     "fpr_at_95_tpr": {tag: pair[1] for tag, pair in ood.items()}}
  started = time.perf_counter()
  section = conformal_section(val, test, num_classes, config, table, ood_logits, counts)
  if section is not None:
    report["conformal"] = section
  report["seconds"] = {"metrics_and_temperature": metrics_seconds,
                       "bootstrap": bootstrap_seconds, "posthoc": posthoc_seconds,
                       "conformal": time.perf_counter() - started,
                       "total": time.perf_counter() - report_started}
  return report


def conformal_record(results: dict[str, Any]) -> dict[str, float]:
  """The conformal numbers of metrics.jsonl's last record: each set's CONFORMAL_RECORDED test
  numbers (`test_conformal_<tag>_<score>_alpha<alpha>_<number>`) and its OOD mean set size
  (`ood_conformal_<tag>_<score>_alpha<alpha>_mean_size`); {} without a conformal section."""
  record = {}
  for tag, by_name in results.get("conformal", {}).get("sets", {}).items():
    for name, by_alpha in by_name.items():
      for key, entry in by_alpha.items():
        stem = f"conformal_{tag}_{name}_alpha{key}"
        record.update({f"test_{stem}_{stat}": entry["test"][stat]
                       for stat in CONFORMAL_RECORDED})
        if "ood" in entry:
          record[f"ood_{stem}_mean_size"] = entry["ood"]["mean_size"]
  return record


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
