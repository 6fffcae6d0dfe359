"""Evaluation of a run's state by one `Evaluator`, built once at start-up from the parts it
uses (cpjax.training.setup builds it from the config and the data; it holds neither the whole config
nor the `run.Run`, so it can be built and tested alone). It answers two questions:

  Evaluator.run           accuracy, NLL and the ECE family of the validation and test splits;
  Evaluator.write_report  the final calibration report (cpjax.calibration.report), written to
                          workdir/report.

The split metrics are due every `eval_every_epochs` and after the last epoch
(`periodic.due`, decided in cpjax.training.train's epoch); the report is written after the loop
(cpjax.training.train._write_report).

Each takes the train state when called and returns its numbers (as big_vision's evaluators,
`run(state) -> metrics`); TensorBoard images go to a writer passed in, drawn in a background
thread and written at the next evaluation or the run's end (`PendingImages`). A non-finite logit
means the model diverged: the run stops with `run.NonFiniteLossError`, naming the
last good checkpoint."""

from collections.abc import Callable, Mapping
from concurrent import futures
import dataclasses
import json
import logging
import os
from typing import Any
import weakref

import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from cpjax import steps
from cpjax.calibration import figures, metrics, posthoc, report, report_files
from cpjax.data import corruptions, input_pipeline, readers, splits
from cpjax.runtime import files, metric_writers, run_logging
from cpjax.training.run import NonFiniteLossError

SPLITS = ("val", "test")  # The splits evaluated, in this order.
REPORT_KEY = "calibrator"  # A key every `report_record` has: marks an epoch record complete.


class PendingImages:
  """An evaluation's TensorBoard images, drawn in one background thread while the run goes on
  and written by the thread that evaluates, at the next evaluation (`draw`) or `write`.

  Drawing them took ~0.4 s an evaluation on a 2-core CPU, and matplotlib's import ~1.3 s more
  at the first: time a short run spent in evaluation, not training. The event file is written
  from the caller's thread only (metric_writers.TensorBoardWriter raises its write errors
  there); images of one step follow that step's scalars in it, which TensorBoard orders by
  step. A failed drawing is raised at the next `draw` or `write`, never dropped."""

  def __init__(self):
    self._executor: futures.ThreadPoolExecutor | None = None
    self._pending: tuple[metric_writers.MetricWriter, int, futures.Future] | None = None

  def draw(self, writer: metric_writers.MetricWriter, step: int,
           reliability: dict[str, dict[str, list]]) -> None:
    """Writes the images drawn before, then starts drawing `reliability`'s for `step`."""
    self.write()
    if jax.process_index() != 0:  # Only process 0 writes images.
      return
    if self._executor is None:
      self._executor = futures.ThreadPoolExecutor(1, thread_name_prefix="cpjax-figures")
    self._pending = writer, step, self._executor.submit(calibration_images, step, reliability)

  def write(self, raise_errors: bool = True) -> None:
    """Waits for the images being drawn and writes them. Without `raise_errors` (a run
    already stopping on another error), a failed drawing is logged instead."""
    if self._pending is None:
      return
    (writer, step, images), self._pending = self._pending, None
    try:
      writer.write_images(step, {tag: image[None] for tag, image in images.result().items()})
    except Exception as error:  # pylint: disable=broad-except
      if raise_errors:
        raise
      logging.warning("The calibration images of step %d were not written (%s: %s).", step,
                      type(error).__name__, error)


@dataclasses.dataclass(frozen=True)
class Evaluator:
  """Eval-mode logits of the validation and test splits: their calibration metrics after an
  epoch (`run`), and the final calibration report (`write_report`)."""
  eval_fn: Any  # jitted (state, batch) -> float32 logits (cpjax.training.setup.jit_eval_step).
  mesh: jax.sharding.Mesh
  split_readers: Mapping[str, readers.Reader]  # SPLITS as batches on the mesh.
  labels: Mapping[str, np.ndarray]  # SPLITS' labels, in row order.
  num_classes: int
  batch_size: int  # eval_batch_size.
  # The sentence naming the last good checkpoint (run.last_good), for the error of a
  # diverged model: a callable, as the checkpoint it names changes while the run trains.
  last_good: Callable[[], str]
  evaluation: ml_collections.ConfigDict  # config.evaluation: the report's settings.
  workdir: str
  title: str  # "dataset, model, loss": the report's title, before "after epoch N".
  test: splits.Split  # Host copy: ids for test_logits.npz; images for ood=gaussian_noise.
  # config.dataset: an OOD set that is another dataset is read as this run's test split is.
  dataset: ml_collections.ConfigDict
  # FL_gamma runs: jitted (state, batch) -> [B, 2] (gamma, correct), as the eval step's
  # compile options (cpjax.training.loss_steps.MetaSteps.gamma_step); None for every other loss.
  gamma_fn: Any = None
  # The sitting's provenance (cpjax.runtime.provenance.gather), written into results.json;
  # None: none (an evaluator built outside a run).
  provenance: Mapping[str, Any] | None = None
  # The last logits computed and weak references to the arrays of the state they are of: the
  # report of the state the last epoch evaluated reuses them (no second pass over val and
  # test). Weak, so that a state the train step donated is never kept alive by the cache.
  _last: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, compare=False,
                                          repr=False)
  # The last evaluation's TensorBoard images, drawn in the background (`PendingImages`).
  _images: PendingImages = dataclasses.field(default_factory=PendingImages, init=False,
                                             compare=False, repr=False)
  # The report's fits started early (`start_report`): {"step": its state's, "fits": ...}.
  _started: dict[str, Any] = dataclasses.field(default_factory=dict, init=False,
                                               compare=False, repr=False)

  def run(self, state: steps.TrainState, writer: metric_writers.MetricWriter | None = None,
          step: int = 0) -> dict[str, float]:
    """{val,test}_{metric} of `state`; with `writer`, also the test split's reliability
    diagram and confidence histogram as images at global `step`: drawn in the background and
    written at the next evaluation or `write_images` (`PendingImages`)."""
    results, all_logits = {}, self.logits(state)
    for name in SPLITS:
      logits, labels = all_logits[name], self.labels[name]
      values = report.calibration_metrics(logits, labels, self.num_classes,
                                          self.evaluation.num_bins)
      results.update({f"{name}_{metric}": value for metric, value in values.items()})
      if writer is not None and name == "test":
        bins = metrics.reliability_bins(metrics.softmax(logits), labels,
                                        self.evaluation.num_bins)
        self._images.draw(writer, step, {"before_ts": {
            k: np.asarray(v).tolist() for k, v in bins._asdict().items()}})
    return results

  def write_images(self, raise_errors: bool = True) -> None:
    """Writes the images of the last evaluation once drawn (`PendingImages.write`)."""
    self._images.write(raise_errors)

  def logits(self, state: steps.TrainState) -> dict[str, np.ndarray]:
    """The eval-mode logits of every split in SPLITS (the report's), each finite: those of
    the last call where `state` holds the very arrays it held then."""
    if _same_arrays(self._last.get("refs", ()), state):
      return dict(self._last["logits"])
    logits = {name: self.finite_logits(state, name) for name in SPLITS}
    self._last.clear()
    refs = _weak_refs(state)
    if refs is not None:
      for values in logits.values():
        values.flags.writeable = False  # Shared by the calls that reuse them.
      self._last.update(refs=refs, logits=logits)
    return dict(logits)

  def finite_logits(self, state: steps.TrainState, name: str) -> np.ndarray:
    """Eval-mode logits of split `name`; a non-finite one means the model diverged: stop."""
    logits = self.predict(state, self.split_readers[name])
    if not np.all(np.isfinite(logits)):
      bad = int(np.sum(~np.all(np.isfinite(logits), axis=-1)))
      raise NonFiniteLossError(
          f"the model diverged: {bad} of {len(logits)} {name} examples have non-finite logits "
          f"at global step {int(jax.device_get(state.step))}; the run stopped without saving "
          f"this state. {self.last_good()} Lower the learning rate or enable "
          "gradient clipping.")
    return logits

  def predict(self, state: steps.TrainState, data: splits.Split | readers.Reader,
              fn: Any = None) -> np.ndarray:
    """`fn(state, batch)` (default: the eval step) over `data`, sharded on the mesh in
    batches of `batch_size` (steps.predict): the one pass every evaluation makes."""
    return steps.predict(self.eval_fn if fn is None else fn, state, data, self.mesh,
                         self.batch_size)

  def import_report_libraries(self) -> None:
    """Starts importing the report's SciPy optimisers in a background thread (about half a
    second, `posthoc.import_scipy_in_background`), early in the run: the loop's compiling
    and jitted steps leave the interpreter free, and the report no longer waits for them."""
    posthoc.import_scipy_in_background()

  def start_report(self, state: steps.TrainState) -> None:
    """Starts the report's cross-validated fits of `state`'s validation logits in the
    background (`report.start_fits`), so that they run while the last checkpoint commits;
    `write_report` of the same state takes them."""
    logits = self.logits(state)
    self._started.update(step=int(jax.device_get(state.step)), fits=report.start_fits(
        (logits["val"], self.labels["val"]), self.num_classes, self.evaluation))

  def write_report(self, state: steps.TrainState, epoch: int,
                   epoch_step: int = 0) -> dict[str, Any]:
    """Builds the calibration report of `state` (the checkpoint of `epoch` complete epochs and
    `epoch_step` steps of the next) and writes it to workdir/report, naming that checkpoint."""
    logging.info("Building the calibration report after epoch %d: temperature fit, metrics, "
                 "%d bootstrap resamples per interval.", epoch,
                 self.evaluation.bootstrap_resamples)
    logits = self.logits(state)
    ood = self._ood_split()
    started = (self._started.get("fits")
               if self._started.get("step") == int(jax.device_get(state.step)) else None)
    self._started.clear()
    results = report.build_report(
        (logits["val"], self.labels["val"]), (logits["test"], self.labels["test"]),
        self.num_classes, self.evaluation, None if ood is None else self.predict(state, ood),
        started)
    results.update(title=f"{self.title}, after epoch {epoch}", epoch=epoch,
                   epoch_step=epoch_step, checkpoint_step=int(jax.device_get(state.step)))
    if self.provenance:
      results["provenance"] = dict(self.provenance)
    gamma = self._test_gammas(state)
    if gamma is not None:
      results["gamma"] = report.gamma_summary(*gamma)
    seconds = results["seconds"]
    logging.info("Report built: T = %.3f; metrics and temperature %.1f s, bootstrap %.1f s, "
                 "post-hoc maps %.1f s, conformal sets %.1f s; %.1f s in all.",
                 results["temperature"]["temperature"], seconds["metrics_and_temperature"],
                 seconds["bootstrap"], seconds["posthoc"], seconds["conformal"],
                 seconds["total"])
    if jax.process_index() == 0:
      self._write(results, gamma, logits)
    return results

  def add_to_results(self, extra: dict[str, Any]) -> None:
    """Adds `extra` to the report's results.json (process 0, which wrote it)."""
    if jax.process_index() == 0:
      report_files.add_results(os.path.join(self.workdir, "report", "results.json"), extra)

  def describes(self, step: int) -> bool:
    """Whether the report of the checkpoint at `step` is complete: workdir/report/results.json
    (written last of the report's files) describes that checkpoint, and metrics.jsonl holds
    the report's numbers in its epoch's record. As process 0 (the one that writes both) sees
    it: every process gets the same answer."""
    found = False
    if jax.process_index() == 0:
      try:
        with open(os.path.join(self.workdir, "report", "results.json"), encoding="utf-8") as f:
          saved = json.load(f)
        found = saved.get("checkpoint_step") == step and _records_report(
            os.path.join(self.workdir, "metrics.jsonl"), saved["epoch"] - 1)
      except (OSError, ValueError, KeyError, TypeError):
        pass  # No report, or a torn one: it describes nothing, and the rerun rewrites it.
    if jax.process_count() > 1:
      found = bool(multihost_utils.broadcast_one_to_all(np.int32(found)))
    return found

  def _write(self, results: dict[str, Any], gamma: tuple[np.ndarray, np.ndarray] | None,
             logits: dict[str, np.ndarray]) -> None:
    """The report's files, and the per-example logits of each split (SPLITS:
    val_logits.npz, test_logits.npz; ids in the split's order): paired comparisons of runs on
    the same test images (e.g. a paired bootstrap of accuracy differences), and every
    post-hoc map or conformal set of the report recomputed from the files (the maps and
    thresholds are fitted on the validation logits)."""
    report_dir = os.path.join(self.workdir, "report")
    logits_paths = []
    for name in SPLITS:
      logits_paths.append(os.path.join(report_dir, f"{name}_logits.npz"))
      ids = self.test.ids if name == "test" else self.split_readers[name].ids
      files.atomic_write(logits_paths[-1], lambda f, name=name, ids=ids: np.savez_compressed(
          f, logits=logits[name].astype(np.float32), labels=self.labels[name], ids=ids))
    # results.json last of all: `describes` takes it as the mark of a complete report.
    paths = [*report_files.write_report(report_dir, results, gamma), *logits_paths]
    logging.info("Wrote the calibration report: %s", ", ".join(paths))

  def _ood_split(self) -> splits.Split | None:
    """The OOD set of the report: a corrupted test set, another dataset, or none. Built when
    the report is (not at start-up): the training run never holds it."""
    if not self.evaluation.ood:
      return None
    if self.evaluation.ood == "gaussian_noise":
      return dataclasses.replace(self.test, images=corruptions.gaussian_noise(
          self.test.images, self.evaluation.ood_severity))
    return input_pipeline.get_test_split(self.dataset, self.evaluation.ood)

  def _test_gammas(self, state: steps.TrainState) -> tuple[np.ndarray, np.ndarray] | None:
    """An FL_gamma run's (gamma [N], correct [N]) on the test split, eval-mode features;
    None for other losses."""
    if self.gamma_fn is None:
      return None
    out = self.predict(state, self.split_readers["test"], self.gamma_fn)
    return out[:, 0], out[:, 1]


def _weak_refs(state: Any) -> tuple[weakref.ref, ...] | None:
  """Weak references to the leaves of `state`; None where one is not a jax.Array (a host
  value can change in place: nothing is cached for it)."""
  leaves = jax.tree.leaves(state)
  if not leaves or not all(isinstance(leaf, jax.Array) for leaf in leaves):
    return None
  return tuple(weakref.ref(leaf) for leaf in leaves)


def _same_arrays(refs: tuple[weakref.ref, ...], state: Any) -> bool:
  """Whether `state`'s leaves are the very arrays `refs` refer to (jax.Arrays are immutable:
  the same objects hold the same values)."""
  leaves = jax.tree.leaves(state)
  return bool(refs) and len(refs) == len(leaves) and all(
      ref() is leaf for ref, leaf in zip(refs, leaves))


def _records_report(metrics_path: str, epoch: int) -> bool:
  """Whether metrics.jsonl's record of 0-indexed `epoch` holds the report's numbers
  (`report_record`: its "calibrator" key), not only the epoch's training numbers written
  before the report began."""
  if not os.path.exists(metrics_path):
    return False
  return any(r["epoch"] == epoch and REPORT_KEY in r for r in run_logging.read_records(
      metrics_path))


def calibration_images(step: int, reliability: dict[str, dict[str, list]],
                       histogram: bool = True) -> dict[str, np.ndarray]:
  """The test split's reliability diagram of each scaling in `reliability` (before_ts;
  after_ts and calibrated in the final report) and, with `histogram`, its confidence
  histogram: {TensorBoard tag: RGB uint8 [H, W, 3]}."""
  del step  # TensorBoard shows each image's step beside it.
  images = {f"test/reliability_{tag}": figures.reliability_image(
      bins, report_files.reliability_title(tag)) for tag, bins in reliability.items()}
  if histogram:
    images["test/confidence_histogram"] = figures.histogram_image(reliability)
  return images


def write_calibration_images(writer: metric_writers.MetricWriter, step: int,
                             reliability: dict[str, dict[str, list]],
                             histogram: bool = True) -> None:
  """The test split's reliability diagram of each scaling in `reliability` (before_ts; after_ts
  and calibrated in the final report) and, with `histogram`, its confidence histogram, as
  TensorBoard images (process 0 only: the others' writers only log)."""
  if jax.process_index() != 0:
    return
  images = calibration_images(step, reliability, histogram)
  writer.write_images(step, {tag: image[None] for tag, image in images.items()})


def report_scalars(results: dict[str, Any]) -> dict[str, float]:
  """The final report's scalars that TensorBoard alone shows (metrics.jsonl holds
  `report_record`'s): the after-TS metrics and the temperature (fitted on val)."""
  scalars = {f"{split}/after_ts/{name}": value
             for split, by_tag in results["metrics"].items()
             for name, value in by_tag["after_ts"].items()}
  scalars["val/temperature"] = results["temperature"]["temperature"]
  return scalars


def write_report_images(writer: metric_writers.MetricWriter, step: int,
                        results: dict[str, Any]) -> None:
  """The final report's images in TensorBoard, at the last epoch's global `step`: the
  reliability diagrams after temperature scaling and after the chosen post-hoc map, and the
  conformal sets' set-size histogram (its first alpha). The before-TS image and the
  confidence histogram are the last epoch's evaluation's (`Evaluator.run`, at the same step):
  not written twice."""
  if jax.process_index() != 0:
    return
  # The report's own pictures (their titles too): drawn once for its files and for here.
  chosen = results.get("posthoc", {}).get("chosen", "")
  images = {f"test/reliability_{tag}": figures.reliability_image(
      bins, report_files.reliability_title(tag, chosen))
      for tag, bins in results["reliability"].items() if tag != "before_ts"}
  if results.get("conformal", {}).get("alphas"):
    images["test/conformal_set_sizes"] = figures.set_size_image(results["conformal"])
  writer.write_images(step, {tag: image[None] for tag, image in images.items()})


def report_record(results: dict[str, Any]) -> dict[str, Any]:
  """The final report's numbers for metrics.jsonl: per split the epoch metrics and the
  selective-prediction ones before scaling; the chosen post-hoc map's test metrics
  (test_calibrated_*, its name in `calibrator`); each OOD score's AUROC and FPR at 95 % TPR;
  the conformal sets' test numbers and OOD mean set sizes (`report.conformal_record`)."""
  record = {f"{split}_{name}": results["metrics"][split]["before_ts"][name]
            for split in SPLITS
            for name in report.EPOCH_METRICS + report.SELECTIVE_METRICS}
  section = results["posthoc"]
  record[REPORT_KEY] = section["chosen"]
  record.update({f"test_calibrated_{name}": value
                 for name, value in section["calibrators"][section["chosen"]]["test"].items()})
  if results["ood"]:
    for score, value in results["ood"]["before_ts"].items():
      record[f"ood_auroc_{score}"] = value
      record[f"ood_fpr95_{score}"] = results["ood"]["fpr_at_95_tpr"]["before_ts"][score]
  record.update(report.conformal_record(results))
  return record
