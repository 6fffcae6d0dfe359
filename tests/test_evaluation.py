"""The evaluators (cpjax.training.evaluation) built alone, without a run: from an eval step, a
mesh and the val/test data. The whole path (a trained run's metrics and report) is tested
through the trainer in test_train.py, test_reliability.py and test_gamma_net.py."""

import collections
import dataclasses
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default
from cpjax.calibration import bootstrap, figures, metrics, posthoc, report, report_files
from cpjax.data import splits
from cpjax.runtime import sharding
from cpjax.training import evaluation
from cpjax.training.run import NonFiniteLossError
from tests import helpers

State = collections.namedtuple("State", "step")  # All that the evaluators read of a state.
NUM_CLASSES, LAST_GOOD = 10, "The last good checkpoint is step 3 in /nowhere."


def _split(n: int, offset: int) -> splits.Split:
  rng = np.random.default_rng(n)
  return splits.Split(rng.integers(0, 256, (n, 4, 4, 1), np.uint8),
                      rng.integers(0, NUM_CLASSES, n).astype(np.int32),
                      np.arange(offset, offset + n, dtype=np.int32))


def _logits(labels, ids):
  """Logits that a fake eval step computes from the batch: every third id is wrong (values
  exact in float32, so that jitted and eager computations agree bit for bit)."""
  shifted = (labels + (ids % 3 == 0)) % NUM_CLASSES
  return 3.0 * jax.nn.one_hot(shifted, NUM_CLASSES) + 0.25 * (ids % 7)[:, None]


def _evaluator(eval_fn) -> evaluation.Evaluator:
  data = {"val": _split(50, 0), "test": _split(70, 1000)}
  return evaluation.Evaluator(
      jax.jit(eval_fn), sharding.create_mesh(), data,
      {name: split.labels for name, split in data.items()}, NUM_CLASSES, batch_size=16,
      last_good=lambda: LAST_GOOD, evaluation=ml_collections.ConfigDict({"num_bins": 15}),
      workdir="", title="", test=data["test"], dataset=ml_collections.ConfigDict())


def _fake_eval_step(state, batch):
  del state
  return _logits(batch["label"], batch["id"]).astype(jnp.float32)


def test_split_metrics_are_the_calibration_metrics_of_each_splits_logits():
  evaluator = _evaluator(_fake_eval_step)
  got = evaluator.run(State(np.int32(7)))
  for name in ("val", "test"):
    split = evaluator.split_readers[name]
    want = report.calibration_metrics(np.asarray(_logits(split.labels, split.ids)),
                                      split.labels, NUM_CLASSES, 15)
    assert {k: got[f"{name}_{k}"] for k in want} == want
  assert set(got) == {f"{s}_{m}" for s in ("val", "test") for m in report.EPOCH_METRICS}


def test_a_non_finite_logit_stops_the_run_naming_the_last_good_checkpoint():
  def diverged(state, batch):
    logits = _fake_eval_step(state, batch)
    return jnp.where((batch["id"] == 1004)[:, None], jnp.nan, logits)
  evaluator = _evaluator(diverged)
  assert evaluator.finite_logits(State(np.int32(7)), "val").shape == (50, NUM_CLASSES)
  with pytest.raises(NonFiniteLossError) as info:
    evaluator.logits(State(np.int32(7)))
  assert str(info.value) == (
      "the model diverged: 1 of 70 test examples have non-finite logits at global step 7; "
      f"the run stopped without saving this state. {LAST_GOOD} Lower the learning rate or "
      "enable gradient clipping.")


def test_the_same_states_arrays_are_evaluated_once_and_a_new_state_again():
  """The report of the state the last epoch evaluated reuses its logits; a state with other
  arrays (the next step's), or host values, is evaluated anew."""
  calls = []
  jitted = jax.jit(_fake_eval_step)

  def counted(state, batch):
    calls.append(1)
    return jitted(state, batch)
  evaluator = dataclasses.replace(_evaluator(_fake_eval_step), eval_fn=counted)
  batches = -(-50 // 16) + -(-70 // 16)  # One pass over val and test.
  state = State(jnp.int32(7))
  first = evaluator.run(state)
  logits = evaluator.logits(state)
  assert len(calls) == batches
  assert evaluator.run(state) == first and len(calls) == batches
  with pytest.raises(ValueError):
    logits["test"][0, 0] = 1.0  # Shared: read-only.
  evaluator.logits(State(jnp.int32(7)))  # Equal values, other arrays.
  assert len(calls) == 2 * batches
  evaluator.logits(State(np.int32(7)))  # Host values: never cached.
  evaluator.logits(State(np.int32(7)))
  assert len(calls) == 4 * batches


@pytest.mark.parametrize("finite", [True, False])
def test_report_intervals_equal_the_generic_bootstrap(finite):
  """The report's intervals (each resample's draws counted: running sums along the sorted
  confidences, tie groups, matrix products) against `bootstrap.bootstrap_interval` on the
  resampled [N, K] arrays, which recomputes each metric on each resample's rows: equal to
  float64 rounding; non-finite logits take the generic path (equal bit for bit)."""
  rng = np.random.default_rng(4)
  logits, labels = rng.normal(size=(300, 12)) * 3, rng.integers(0, 12, 300)
  logits[:30] = logits[30:60]  # Tied confidences: AURC's tie groups, AdaECE's tied edges.
  logits[60:64, 0] = 60.0  # Confidences of exactly 1.0 in float32: in no left-closed bin.
  if not finite:
    logits[7, 3] = np.nan
  config = default.get_config().evaluation
  ours = report._intervals(logits, labels, 12, config, 40, report.TABLE_METRICS)  # pylint: disable=protected-access
  functions = report._metric_functions(12, config.num_bins)  # pylint: disable=protected-access
  for name in report.TABLE_METRICS:
    reference = bootstrap.bootstrap_interval(
        functions[name], (metrics.softmax(logits), logits, labels), num_resamples=40,
        level=config.bootstrap_level, kind=config.bootstrap_kind,
        seed=config.bootstrap_seed)._asdict()
    assert ours[name].keys() == reference.keys()
    for field, value in reference.items():
      if isinstance(value, float) and finite:
        assert ours[name][field] == pytest.approx(value, rel=0, abs=1e-12), (name, field)
      else:
        assert ours[name][field] == value or (np.isnan(value) and np.isnan(ours[name][field])), (
            name, field)


@pytest.mark.parametrize("name", report.TABLE_METRICS)
def test_each_resamples_column_is_the_metric_of_its_rows(name):
  """`bootstrap.resampled_values` against the metric of each resample's rows, resample by
  resample (not only the interval's quantiles): generated logits with ties, saturated rows
  and resamples of very unequal draws."""
  rng = np.random.default_rng(9)
  logits, labels = rng.normal(size=(200, 5)) * 4, rng.integers(0, 5, 200)
  logits[:40] = logits[40:80]
  logits[80:85, 1] = 70.0
  probs = metrics.softmax(logits)
  rows = rng.integers(0, 200, (6, 200))
  rows[0] = rows[0] % 7  # A resample of 7 distinct rows.
  values = bootstrap.resampled_values(probs, logits, labels, 5, 15, (name,), [rows])[name]
  metric = report._metric_functions(5, 15)[name]  # pylint: disable=protected-access
  expected = [metric(probs[r], logits[r], labels[r]) for r in rows]
  np.testing.assert_allclose(values, expected, rtol=0, atol=1e-12)


class _ImageRecorder:
  """The writer calls an evaluation makes (images only), with the thread that made each."""

  def __init__(self):
    self.images = []

  def write_images(self, step, images):
    self.images.append((step, threading.current_thread(), dict(images)))


def test_an_evaluations_images_are_drawn_in_the_background_and_written_by_the_caller(
    monkeypatch):
  """`run` returns while its images are still being drawn (a drawing held back by an event
  here): their drawing does not add to the evaluation's time. The next evaluation, or
  `write_images`, waits for them and writes them in the caller's thread, in step order."""
  drawing, release, drawn_in = threading.Event(), threading.Event(), []

  def slow_images(step, reliability, histogram=True):
    drawing.set()
    drawn_in.append(threading.current_thread())
    assert release.wait(60)
    return {f"test/reliability_{tag}": np.zeros((4, 5, 3), np.uint8) + step
            for tag in reliability}
  monkeypatch.setattr(evaluation, "calibration_images", slow_images)
  evaluator, writer = _evaluator(_fake_eval_step), _ImageRecorder()
  evaluator.run(State(np.int32(7)), writer, step=7)
  assert drawing.wait(60) and writer.images == []  # Returned while the drawing waits.
  assert drawn_in[0] is not threading.current_thread()
  release.set()
  evaluator.run(State(np.int32(9)), writer, step=9)  # Writes step 7's first.
  ((step, thread, images),) = writer.images
  assert step == 7 and thread is threading.current_thread()
  assert images.keys() == {"test/reliability_before_ts"}
  assert np.array_equal(images["test/reliability_before_ts"], np.full((1, 4, 5, 3), 7, np.uint8))
  evaluator.write_images()
  evaluator.write_images()  # Nothing pending: nothing written twice.
  assert [step for step, _, _ in writer.images] == [7, 9]


def test_a_failed_drawing_is_raised_where_its_images_are_written(monkeypatch, caplog):
  """A drawing's error reaches the caller at the next `write_images` (or evaluation), not a
  thread's traceback; a run already stopping on another error logs it instead."""
  def broken(step, reliability, histogram=True):
    raise RuntimeError(f"no font for step {step}")
  monkeypatch.setattr(evaluation, "calibration_images", broken)
  evaluator, writer = _evaluator(_fake_eval_step), _ImageRecorder()
  evaluator.run(State(np.int32(7)), writer, step=7)
  with pytest.raises(RuntimeError, match="no font for step 7"):
    evaluator.write_images()
  evaluator.run(State(np.int32(8)), writer, step=8)
  evaluator.write_images(raise_errors=False)
  assert writer.images == []
  assert ("The calibration images of step 8 were not written (RuntimeError: no font for step "
          "8).") in caplog.text


def test_the_images_drawn_in_the_background_are_the_images_drawn_in_place():
  """The images an evaluation writes equal `write_calibration_images`' of the same bins."""
  evaluator = _evaluator(_fake_eval_step)
  background, in_place = _ImageRecorder(), _ImageRecorder()
  evaluator.run(State(np.int32(7)), background, step=7)
  evaluator.write_images()
  logits, labels = evaluator.logits(State(np.int32(7)))["test"], evaluator.labels["test"]
  bins = metrics.reliability_bins(metrics.softmax(logits), labels, 15)
  evaluation.write_calibration_images(in_place, 7, {"before_ts": {
      k: np.asarray(v).tolist() for k, v in bins._asdict().items()}})
  ((step, _, ours),), ((_, _, theirs),) = background.images, in_place.images
  assert step == 7 and ours.keys() == theirs.keys() == {
      "test/reliability_before_ts", "test/confidence_histogram"}
  for tag in ours:
    assert np.array_equal(ours[tag], theirs[tag]), tag


def _bins(scale, rows=400, seed=0):
  rng = np.random.default_rng(seed)
  bins = metrics.reliability_bins(metrics.softmax(rng.normal(size=(rows, 6)) * scale),
                                  rng.integers(0, 6, rows), 15)
  return {name: np.asarray(v).tolist() for name, v in bins._asdict().items()}


def test_a_kept_figure_draws_the_pixels_of_a_figure_built_afresh():
  """Each picture after a kind's first moves the kept figure's bars or steps and retitles it;
  the RGB images and PNG bytes equal those of a figure built afresh for the same data, for
  bins of every shape (empty bins, an almost empty set) and one to three scalings."""
  cases = [_bins(scale, seed=i) for i, scale in enumerate((0.5, 3.0, 20.0))] + [
      _bins(3.0, rows=3, seed=9)]

  def pictures(bins, histogram_bins):
    return (figures.reliability_image(bins, "test, step 7"), figures.reliability_png(
        bins, "test, after ts"), figures.histogram_image(histogram_bins),
            figures.histogram_png(histogram_bins))
  for i, bins in enumerate(cases):
    histogram_bins = {"before_ts": bins} if i % 2 else {
        "before_ts": bins, "after_ts": cases[i - 1], "calibrated": cases[i - 2]}
    kept = pictures(bins, histogram_bins)
    saved = dict(figures._KEPT)  # pylint: disable=protected-access
    figures._KEPT.clear()  # pylint: disable=protected-access
    try:
      fresh = pictures(bins, histogram_bins)
    finally:
      figures._KEPT.clear()  # pylint: disable=protected-access
      figures._KEPT.update(saved)  # pylint: disable=protected-access
    for ours, theirs in zip(kept, fresh):
      assert (np.array_equal(ours, theirs) if isinstance(ours, np.ndarray) else ours == theirs)
  assert kept[0].shape == (400, 400, 3) and kept[2].shape == (350, 500, 3)


def test_the_training_path_imports_neither_scipy_nor_matplotlib_nor_sklearn():
  """Only the report (and its pictures) needs them: importing the trainer, its evaluation and
  its config checks leaves them unimported (each takes up to a second)."""
  code = ("import sys\n"
          "import cpjax.config.schema, cpjax.training.evaluation, cpjax.training.train\n"
          "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'scipy', 'matplotlib', "
          "'sklearn', 'threadpoolctl'})\n"
          "assert not heavy, heavy\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO,
                          env=helpers.subprocess_env(), capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]


def test_the_report_saves_the_validation_logits_beside_the_test_logits(tmp_path, monkeypatch):
  """report/val_logits.npz and test_logits.npz: each split's eval-mode logits (float32), labels
  and ids in the split's order, so every post-hoc map and conformal set can be recomputed."""
  monkeypatch.setattr(report_files, "write_report", lambda report_dir, results, gamma: [])
  evaluator = dataclasses.replace(_evaluator(_fake_eval_step), workdir=str(tmp_path))
  evaluator._write({}, None, evaluator.logits(State(np.int32(7))))  # pylint: disable=protected-access
  for name, first_id in (("val", 0), ("test", 1000)):
    split = evaluator.split_readers[name]
    with np.load(tmp_path / "report" / f"{name}_logits.npz") as saved:
      assert sorted(saved.files) == ["ids", "labels", "logits"]
      assert saved["logits"].dtype == np.float32 and saved["ids"][0] == first_id
      np.testing.assert_array_equal(saved["ids"], split.ids)
      np.testing.assert_array_equal(saved["labels"], split.labels)
      np.testing.assert_array_equal(saved["logits"], _logits(split.labels, split.ids))


def test_the_reports_summaries_hold_the_set_size_image_and_its_record_the_numbers():
  """TensorBoard: the conformal sets' set-size histogram (the figure's own pixels) beside the
  reliability images; metrics.jsonl's record: each set's test numbers and OOD mean size."""
  rng = np.random.default_rng(2)
  labels = rng.integers(0, 5, 300)
  logits = 3.0 * (rng.normal(size=(300, 5)) + 2.0 * np.eye(5)[labels])
  calibrator = posthoc.fit("temperature", logits[:150], labels[:150])
  table = report.PosthocTable({"chosen": "temperature"}, calibrator,
                              posthoc.apply(calibrator, logits[150:]))
  section = report.conformal_section((logits[:150], labels[:150]), (logits[150:], labels[150:]),
                                     5, default.get_config().evaluation, table, logits[:40])
  results = {"metrics": {split: {"after_ts": {"nll": 1.0}} for split in ("val", "test")},
             "temperature": {"temperature": 1.5},
             "reliability": {"before_ts": _bins(1.0), "after_ts": _bins(2.0)},
             "conformal": section}
  writer = _ImageRecorder()
  evaluation.write_report_images(writer, 9, results)
  images = {tag: image for _, _, written in writer.images for tag, image in written.items()}
  assert set(images) == {"test/reliability_after_ts", "test/conformal_set_sizes"}
  np.testing.assert_array_equal(images["test/conformal_set_sizes"][0],
                                figures.set_size_image(section))
  assert evaluation.report_scalars(results) == {"val/after_ts/nll": 1.0, "test/after_ts/nll": 1.0,
                                                "val/temperature": 1.5}
  record = report.conformal_record(results)
  entry = section["sets"]["uncalibrated"]["aps"]["0.1"]
  assert record["test_conformal_uncalibrated_aps_alpha0.1_mean_size"] == entry["test"][
      "mean_size"]
  assert record["ood_conformal_uncalibrated_aps_alpha0.1_mean_size"] == entry["ood"]["mean_size"]
  assert set(record) == {f"test_conformal_{tag}_{name}_alpha0.1_{stat}"
                         for tag in report.CONFORMAL_TAGS for name in ("lac", "aps", "raps")
                         for stat in report.CONFORMAL_RECORDED} | {
      f"ood_conformal_{tag}_{name}_alpha0.1_mean_size" for tag in report.CONFORMAL_TAGS
      for name in ("lac", "aps", "raps")}
