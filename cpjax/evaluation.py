"""Evaluation of a run's state: val/test metrics each `eval_every_epochs`, and the final
calibration report (cpjax.calibration.report) after the last epoch. A non-finite logit
means the model diverged: the run stops with `run_context.NonFiniteLossError`."""

import dataclasses
import functools
import json
import logging
import os
from typing import Any

from clu import metric_writers
import jax
from jax.experimental import multihost_utils
import numpy as np

from cpjax import run_context, run_state, steps
from cpjax.calibration import figures, metrics, report
from cpjax.data import corruptions, input_pipeline, readers, specs, splits
from cpjax.runtime import compiler_options, files


def evaluate(run: run_context.Run, state: steps.TrainState,
             writer: metric_writers.MetricWriter | None = None, step: int = 0
             ) -> dict[str, float]:
  """Accuracy, NLL and the ECE family of the validation and test splits; with `writer`,
  also the test split's reliability diagram and confidence histogram as images at `step`."""
  num_classes = specs.DATASETS[run.config.dataset.name].num_classes
  num_bins = run.config.evaluation.num_bins
  results = {}
  for name in ("val", "test"):
    logits = finite_logits(run, state, run.readers[name], name)
    labels = run.splits[name].labels
    values = report.calibration_metrics(logits, labels, num_classes, num_bins)
    results.update({f"{name}_{metric}": value for metric, value in values.items()})
    if writer is not None and name == "test":
      bins = metrics.reliability_bins(metrics.softmax(logits), labels, num_bins)
      write_calibration_images(writer, step, {"before_ts": {
          k: np.asarray(v).tolist() for k, v in bins._asdict().items()}})
  return results


def write_calibration_images(writer: metric_writers.MetricWriter, step: int,
                             reliability: dict[str, dict[str, list]]) -> None:
  """The test split's reliability diagram of each scaling in `reliability` (before_ts, and
  after_ts in the final report) and its confidence histogram, as TensorBoard images
  (process 0 only: the others' writers only log)."""
  if jax.process_index() != 0:
    return
  images = {f"test/reliability_{tag}": figures.reliability_figure(
      bins, f"test, {tag.replace('_', ' ')}, step {step}") for tag, bins in reliability.items()}
  images["test/confidence_histogram"] = figures.histogram_figure(reliability)
  writer.write_images(step, {tag: figures.rgb(fig)[None] for tag, fig in images.items()})


def _write_report_summaries(writer: metric_writers.MetricWriter, step: int,
                            results: dict[str, Any]) -> None:
  """The final report in TensorBoard: after-TS metrics, the temperature (fitted on val) and
  the reliability images before and after temperature scaling."""
  scalars = {f"{split}/after_ts/{name}": value
             for split, by_tag in results["metrics"].items()
             for name, value in by_tag["after_ts"].items()}
  scalars["val/temperature"] = results["temperature"]["temperature"]
  writer.write_scalars(step, scalars)
  write_calibration_images(writer, step, results["reliability"])


def finite_logits(run: run_context.Run, state: steps.TrainState,
                  split: splits.Split | readers.HostReader, name: str) -> np.ndarray:
  """Eval-mode logits of `split`; a non-finite one means the model diverged: stop the run."""
  logits = steps.predict(run.eval_fn, state, split, run.mesh, run.config.eval_batch_size)
  if not np.all(np.isfinite(logits)):
    bad = int(np.sum(~np.all(np.isfinite(logits), axis=-1)))
    raise run_context.NonFiniteLossError(
        f"the model diverged: {bad} of {len(logits)} {name} examples have non-finite logits "
        f"at global step {int(jax.device_get(state.step))}; the run stopped without saving "
        f"this state. {run_context.last_good(run)} Lower the learning rate or enable "
        "gradient clipping.")
  return logits


def final_logits(run: run_context.Run, state: steps.TrainState) -> dict[str, np.ndarray]:
  """The validation and test logits of the final report; non-finite ones stop the run (the
  loop computes them before it saves the last epoch, so such a state is never saved)."""
  return {name: finite_logits(run, state, run.readers[name], name) for name in ("val", "test")}


def evaluate_when_due(run: run_context.Run, state: steps.TrainState, epoch: int,
                      writer: metric_writers.MetricWriter | None = None, step: int = 0,
                      logits: dict[str, np.ndarray] | None = None) -> dict[str, float]:
  """The epoch's val/test metrics: from the final report after the last epoch (from
  `logits`, `final_logits` of `state`, if given), from an evaluation every
  `eval_every_epochs`, else none. With `writer`, the evaluation's calibration figures (and
  the report's after-TS metrics and temperature) go to it at global `step`."""
  config = run.config
  if epoch + 1 == run.num_epochs:  # The report's before-TS numbers are the last eval.
    results = write_final_report(run, state, epoch + 1, logits=logits)
    if writer is not None:
      _write_report_summaries(writer, step, results)
    return report_record(results)
  if run_context.due(epoch, config.eval_every_epochs, run.num_epochs):
    return evaluate(run, state, writer, step)
  return {}


def report_record(results: dict[str, Any]) -> dict[str, Any]:
  """The final report's numbers for metrics.jsonl: per split the epoch metrics and the
  selective-prediction ones before scaling; the chosen post-hoc map's test metrics
  (test_calibrated_*, its name in `calibrator`); each OOD score's AUROC and FPR at 95 % TPR."""
  record = {f"{split}_{name}": results["metrics"][split]["before_ts"][name]
            for split in ("val", "test")
            for name in report.EPOCH_METRICS + report.SELECTIVE_METRICS}
  section = results["posthoc"]
  record["calibrator"] = section["chosen"]
  record.update({f"test_calibrated_{name}": value
                 for name, value in section["calibrators"][section["chosen"]]["test"].items()})
  if results["ood"]:
    for score, value in results["ood"]["before_ts"].items():
      record[f"ood_auroc_{score}"] = value
      record[f"ood_fpr95_{score}"] = results["ood"]["fpr_at_95_tpr"]["before_ts"][score]
  return record


def _ood_split(run: run_context.Run) -> splits.Split | None:
  """The OOD set of the report: a corrupted test set, another dataset, or none."""
  evaluation, test = run.config.evaluation, run.splits["test"]
  if not evaluation.ood:
    return None
  if evaluation.ood == "gaussian_noise":
    return dataclasses.replace(test, images=corruptions.gaussian_noise(
        test.images, evaluation.ood_severity))
  return input_pipeline.get_test_split(run.config.dataset, evaluation.ood)


def write_final_report(run: run_context.Run, state: steps.TrainState, epoch: int,
                       epoch_step: int = 0,
                       logits: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
  """Builds the calibration report of `state` (the checkpoint of `epoch` complete epochs and
  `epoch_step` steps of the next; `logits`: its `final_logits` if already computed) and
  writes it to workdir/report, naming that checkpoint."""
  config = run.config
  logging.info("Building the calibration report after epoch %d: temperature fit, metrics, "
               "%d bootstrap resamples per interval.", epoch,
               config.evaluation.bootstrap_resamples)
  logits = logits or final_logits(run, state)
  ood = _ood_split(run)
  results = report.build_report(
      (logits["val"], run.splits["val"].labels), (logits["test"], run.splits["test"].labels),
      specs.DATASETS[config.dataset.name].num_classes, config.evaluation,
      None if ood is None else steps.predict(run.eval_fn, state, ood, run.mesh,
                                             config.eval_batch_size))
  results.update(title=f"{config.dataset.name}, {config.model.name}, {config.loss.name}, "
                       f"after epoch {epoch}", epoch=epoch, epoch_step=epoch_step,
                 checkpoint_step=int(jax.device_get(state.step)))
  gamma = test_gammas(run, state) if isinstance(state, steps.MetaTrainState) else None
  if gamma is not None:
    results["gamma"] = report.gamma_summary(*gamma)
  seconds = results["seconds"]
  logging.info("Report built: T = %.3f; metrics and temperature %.1f s, bootstrap %.1f s.",
               results["temperature"]["temperature"], seconds["metrics_and_temperature"],
               seconds["bootstrap"])
  if jax.process_index() == 0:
    paths = report.write_report(os.path.join(run.workdir, "report"), results, gamma)
    # Per-example test logits (ids in the test split's order): paired comparisons of runs
    # on the same test images (e.g. a paired bootstrap of accuracy differences).
    paths.append(os.path.join(run.workdir, "report", "test_logits.npz"))
    files.atomic_write(paths[-1], lambda f: np.savez_compressed(
        f, logits=logits["test"].astype(np.float32), labels=run.splits["test"].labels,
        ids=run.splits["test"].ids))
    logging.info("Wrote the calibration report: %s", ", ".join(paths))
  return results


def report_describes(run: run_context.Run, step: int) -> bool:
  """Whether workdir/report/results.json exists and describes the checkpoint at `step`, as
  process 0 (the one that writes it) sees it: every process gets the same answer."""
  found = False
  if jax.process_index() == 0:
    try:
      with open(os.path.join(run.workdir, "report", "results.json"), encoding="utf-8") as f:
        found = json.load(f).get("checkpoint_step") == step
    except (OSError, ValueError):
      pass  # No report, or a torn one: it describes nothing, and the rerun rewrites it.
  if jax.process_count() > 1:
    found = bool(multihost_utils.broadcast_one_to_all(np.int32(found)))
  return found


def test_gammas(run: run_context.Run, state: steps.MetaTrainState
                ) -> tuple[np.ndarray, np.ndarray]:
  """An FL_gamma run's (gamma [N], correct [N]) on the test split, eval-mode features."""
  gamma_fn = jax.jit(functools.partial(steps.gamma_step, model=run.model,
                                       gamma_net=run_state.meta_parts(run.config)[0],
                                       spec=steps.step_spec(run.config.dataset)),
                     compiler_options=compiler_options.compiler_options(
                         "inference", run.config.xla_cpu_options))  # As run.eval_fn.
  out = steps.predict(gamma_fn, state, run.readers["test"], run.mesh,
                      run.config.eval_batch_size)
  return out[:, 0], out[:, 1]
