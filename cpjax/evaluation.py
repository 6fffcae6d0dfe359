"""Evaluation of a run's state: val/test metrics each `eval_every_epochs`, and the final
calibration report (cpjax.calibration.report) after the last epoch. A non-finite logit
means the model diverged: the run stops with `run_context.NonFiniteLossError`."""

import dataclasses
import functools
import logging
import os
from typing import Any

import jax
import numpy as np

from cpjax import run_context, run_state, steps
from cpjax.calibration import report
from cpjax.data import corruptions, input_pipeline, readers, specs, splits
from cpjax.runtime import compiler_options


def evaluate(run: run_context.Run, state: steps.TrainState) -> dict[str, float]:
  """Accuracy, NLL and the ECE family of the validation and test splits."""
  num_classes = specs.DATASETS[run.config.dataset.name].num_classes
  results = {}
  for name in ("val", "test"):
    logits = finite_logits(run, state, run.readers[name], name)
    values = report.calibration_metrics(logits, run.splits[name].labels, num_classes,
                                        run.config.evaluation.num_bins)
    results.update({f"{name}_{metric}": value for metric, value in values.items()})
  return results


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


def evaluate_when_due(run: run_context.Run, state: steps.TrainState,
                      epoch: int) -> dict[str, float]:
  """The epoch's val/test metrics: from the final report after the last epoch, from an
  evaluation every `eval_every_epochs`, else none."""
  config = run.config
  if epoch + 1 == run.num_epochs:  # The report's before-TS numbers are the last eval.
    return report_record(write_final_report(run, state, epoch + 1))
  if run_context.due(epoch, config.eval_every_epochs, run.num_epochs):
    return evaluate(run, state)
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


def write_final_report(run: run_context.Run, state: steps.TrainState, epoch: int) -> dict[str, Any]:
  """Builds the calibration report of `state` and writes it to workdir/report."""
  config = run.config

  ood = _ood_split(run)
  results = report.build_report(
      (finite_logits(run, state, run.readers["val"], "val"), run.splits["val"].labels),
      (finite_logits(run, state, run.readers["test"], "test"), run.splits["test"].labels),
      specs.DATASETS[config.dataset.name].num_classes, config.evaluation,
      None if ood is None else steps.predict(run.eval_fn, state, ood, run.mesh,
                                             config.eval_batch_size))
  results.update(title=f"{config.dataset.name}, {config.model.name}, {config.loss.name}, "
                       f"after epoch {epoch}", epoch=epoch)
  gamma = test_gammas(run, state) if isinstance(state, steps.MetaTrainState) else None
  if gamma is not None:
    results["gamma"] = report.gamma_summary(*gamma)
  if jax.process_index() == 0:
    paths = report.write_report(os.path.join(run.workdir, "report"), results, gamma)
    logging.info("Wrote the calibration report: %s", ", ".join(paths))
  return results


def test_gammas(run: run_context.Run, state: steps.MetaTrainState
                ) -> tuple[np.ndarray, np.ndarray]:
  """An FL_gamma run's (gamma [N], correct [N]) on the test split, eval-mode features."""
  gamma_fn = jax.jit(functools.partial(steps.gamma_step, model=run.model,
                                       gamma_net=run_state.meta_parts(run.config)[0],
                                       spec=steps.step_spec(run.config)),
                     compiler_options=compiler_options.compiler_options(
                         "inference", run.config.xla_cpu_options))  # As run.eval_fn.
  out = steps.predict(gamma_fn, state, run.readers["test"], run.mesh,
                      run.config.eval_batch_size)
  return out[:, 0], out[:, 1]
