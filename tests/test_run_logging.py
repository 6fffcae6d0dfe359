"""What a run writes for TensorBoard and metrics.jsonl: tag families, flattened hparams, the
calibration images and after-temperature-scaling scalars, the progress lines of the log."""

import contextlib
import errno
import io
import json
import logging
import math
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util

from cpjax import steps
from cpjax.runtime import anatomy, failures, metric_writers, run_logging, sharding
from cpjax.selection import bookkeeping, score_sources
from cpjax.training import step_loop
from tests import helpers, test_failures
from tests.helpers import STEPS_PER_EPOCH, read_metrics

pytest_plugins = ("tests.trained_runs",)  # The shared trained runs.


@pytest.mark.parametrize("key, tag", [
    ("train/loss", "train/loss"),  # The window's metrics keep their tags.
    ("train_loss", "train/epoch_loss"),  # The epoch's mean: not the window's train/loss.
    ("train_ece", "train/epoch_ece"),
    ("learning_rate", "train/epoch_learning_rate"),
    ("epoch", "train/epoch"),
    ("val_ece", "val/ece"),
    ("test_adaptive_ece", "test/adaptive_ece"),
    ("ood_auroc_energy", "ood/auroc_energy"),  # The report's OOD numbers: their own family.
    ("ood_conformal_calibrated_aps_alpha0.1_mean_size",
     "ood/conformal_calibrated_aps_alpha0.1_mean_size"),
    ("total_scoring_seconds", "perf/total_scoring_seconds"),
    ("epoch_seconds", "perf/epoch_seconds"),
    ("steps_per_sec", "perf/steps_per_sec"),
    ("subset_class_kl", "selection/subset_class_kl"),
    ("selected_k", "selection/selected_k"),
    ("train/meta_loss", "meta/loss"),
    ("train/gamma_mean", "meta/gamma_mean"),
])
def test_every_key_gets_its_tag_family(key, tag):
  assert run_logging.tensorboard_tag(key) == tag


def test_hparams_are_flat_scalars_with_dotted_names():
  flat = run_logging.flat_hparams({"seed": 0, "optimizer": {"learning_rate": 0.05,
                                                            "milestones": [150, 250],
                                                            "nesterov": False}})
  assert flat == {"seed": 0, "optimizer.learning_rate": 0.05,
                  "optimizer.milestones": "(150, 250)", "optimizer.nesterov": False}


class _Recorder(metric_writers.MetricWriter):
  """Keeps what it is given (a second, independent MetricWriter)."""

  def __init__(self):
    self.scalars = []

  def write_scalars(self, step, scalars):
    self.scalars.append((step, dict(scalars)))


def test_the_progress_report_gives_steps_per_second_since_its_last_report(caplog):
  """A run of 25 steps resumed at step 3, reporting every 5: the first call starts the clock;
  a call at a step that is not due (13) reports nothing; each report's rate is the steps
  since the previous report over the seconds since it, worked by hand on this clock."""
  written = _Scalars()
  report = metric_writers.ProgressReport(25, written, 5, anatomy.RunClock())
  calls = [(3, 0.0), (5, 1.0), (10, 2.0), (13, 3.0), (15, 4.5), (25, 14.5)]
  with caplog.at_level(logging.INFO):
    reported = [report(step, t=t) for step, t in calls]
  assert reported == [False, True, True, False, True, True]
  rates = [(step, s["steps_per_sec"]) for step, s in written.written]
  assert rates == [(5, 2.0), (10, 5.0), (15, 2.0), (25, 1.0)]  # 2/1, 5/1, 5/2.5, 10/10.
  assert all(s["uptime"] >= 0 for _, s in written.written)
  # ETA at step 5: 20 steps left at 2 steps/s.
  assert "Progress: 2.0 steps/s, 20.0% (5/25), ETA: 0m10s" in caplog.text


def test_tensorboard_events_are_written_without_tensorflow_and_read_back(tmp_path):
  """Scalars, an image and the hparams through the TensorFlow-free writer, read back by
  TensorBoard's own event reader: the values, the PNG's pixels and the HParams entry."""
  writer = metric_writers.TensorBoardWriter(str(tmp_path))
  image = np.random.default_rng(0).integers(0, 256, size=(1, 7, 5, 3), dtype=np.uint8)
  writer.write_scalars(3, {"val/ece": 0.125, "perf/steps": 7})
  writer.write_scalars(6, {"val/ece": 0.0625})
  writer.write_images(6, {"test/diagram": image})
  writer.write_hparams({"optimizer.learning_rate": 0.05, "model.name": "tiny"})
  writer.close()
  events = _events(str(tmp_path))
  assert set(events.Tags()["tensors"]) == {"val/ece", "perf/steps", "test/diagram",
                                           "_hparams_/session_start_info"}
  value = lambda e: float(tensor_util.make_ndarray(e.tensor_proto))
  assert [(e.step, value(e)) for e in events.Tensors("val/ece")] == [(3, 0.125), (6, 0.0625)]
  assert events.SummaryMetadata("val/ece").plugin_data.plugin_name == "scalars"
  (shown,) = events.Tensors("test/diagram")
  assert events.SummaryMetadata("test/diagram").plugin_data.plugin_name == "images"
  assert list(shown.tensor_proto.string_val[:2]) == [b"5", b"7"]  # Width, height.
  np.testing.assert_array_equal(_image(shown), image[0])
  content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
  hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
  assert hparams["optimizer.learning_rate"].number_value == pytest.approx(0.05)
  assert hparams["model.name"].string_value == "tiny"


def test_the_events_match_tensorflows_own_summaries(tmp_path):
  """The same scalar and image written by tf.summary (TensorFlow installed: the optional
  part CI installs) and by cpjax's writer: the same tags, plugins, dtypes and values."""
  helpers.require_tensorflow()  # tf.summary is the reference.
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  (optional)
  image = np.random.default_rng(1).integers(0, 256, size=(1, 4, 6, 3), dtype=np.uint8)
  with tf.summary.create_file_writer(str(tmp_path / "tf")).as_default():
    tf.summary.scalar("val/ece", 0.25, step=2)
    tf.summary.image("test/diagram", image, step=2, max_outputs=1)
  ours = metric_writers.TensorBoardWriter(str(tmp_path / "ours"))
  ours.write_scalars(2, {"val/ece": 0.25})
  ours.write_images(2, {"test/diagram": image})
  ours.close()
  theirs, mine = _events(str(tmp_path / "tf")), _events(str(tmp_path / "ours"))
  assert set(theirs.Tags()["tensors"]) == set(mine.Tags()["tensors"])
  for tag in ("val/ece", "test/diagram"):
    assert (theirs.SummaryMetadata(tag).plugin_data.plugin_name
            == mine.SummaryMetadata(tag).plugin_data.plugin_name), tag
    (a,), (b,) = theirs.Tensors(tag), mine.Tensors(tag)
    assert a.step == b.step and a.tensor_proto.dtype == b.tensor_proto.dtype, tag
  assert (tensor_util.make_ndarray(theirs.Tensors("val/ece")[0].tensor_proto)
          == tensor_util.make_ndarray(mine.Tensors("val/ece")[0].tensor_proto))
  np.testing.assert_array_equal(_image(theirs.Tensors("test/diagram")[0]),
                                _image(mine.Tensors("test/diagram")[0]))


def test_an_epoch_record_reaches_jsonl_with_its_keys_and_tensorboard_tagged(tmp_path):
  recorder = _Recorder()
  epoch_log = run_logging.EpochLog(str(tmp_path))
  record = {"epoch": 0, "train_loss": 2.5, "test_ece": float("nan"), "selected_k": 10,
            "subset_class_counts": [4, 6]}
  run_logging.write_record(run_logging.TaggedWriter([recorder]), epoch_log, 20, record)
  with open(tmp_path / "metrics.jsonl") as f:
    assert [json.loads(line) for line in f] == [
        {"epoch": 0, "train_loss": 2.5, "test_ece": None, "selected_k": 10,
         "subset_class_counts": [4, 6]}]
  # TensorBoard: finite numbers only, each under its family.
  assert recorder.scalars == [(20, {"train/epoch": 0, "train/epoch_loss": 2.5,
                                    "selection/selected_k": 10})]


def _events(workdir):
  accumulator = event_accumulator.EventAccumulator(
      workdir, size_guidance={event_accumulator.TENSORS: 0})
  accumulator.Reload()
  return accumulator


def _image(event):
  """A TensorBoard image summary's first image as an RGB array (its PNG decoded)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top
  png = event.tensor_proto.string_val[2]
  with Image.open(io.BytesIO(png)) as image:
    return np.asarray(image.convert("RGB"))


def test_tensorboard_shows_the_calibration_story(main_run):
  """configs/test.py through main.py, 4 epochs: at every evaluation the test reliability
  diagram and confidence histogram; after the last, the after-TS diagram, metrics and the
  temperature, equal to the report's; every scalar under a family; flat hparams."""
  events = _events(main_run.workdir)
  tags = set(events.Tags()["tensors"])
  steps = [STEPS_PER_EPOCH * e for e in (1, 2, 3, 4)]
  for tag in ("test/reliability_before_ts", "test/confidence_histogram"):
    assert [e.step for e in events.Tensors(tag)] == steps, tag
  (after,) = events.Tensors("test/reliability_after_ts")
  assert after.step == steps[-1]
  pixels = _image(after)
  assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 10
  with open(os.path.join(main_run.workdir, "report", "results.json")) as f:
    report = json.load(f)
  scalar = lambda tag: float(tensor_util.make_ndarray(events.Tensors(tag)[-1].tensor_proto))
  assert scalar("val/temperature") == pytest.approx(report["temperature"]["temperature"],
                                                    rel=1e-6)
  for split in ("val", "test"):
    for name in ("ece", "nll", "adaptive_ece", "accuracy"):
      assert scalar(f"{split}/after_ts/{name}") == pytest.approx(
          report["metrics"][split]["after_ts"][name], rel=1e-6), (split, name)
  scalar_tags = tags - {"_hparams_/session_start_info"}
  assert all(t.startswith(run_logging.FAMILIES) for t in scalar_tags), sorted(scalar_tags)
  assert {"train/loss", "train/epoch_loss", "test/ece", "perf/steps_per_sec",
          "selection/selected_k"} <= scalar_tags
  # The HParams tab: one entry per config field, with its value.
  content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
  hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
  assert hparams["optimizer.learning_rate"].number_value == pytest.approx(0.05)
  assert hparams["model.name"].string_value == "tiny"
  assert hparams["num_epochs"].number_value == 4  # --config.num_epochs=4 of the run.
  assert "config" not in hparams  # Not one JSON string.
  # metrics.jsonl keeps its keys (studies read them).
  record = read_metrics(main_run.workdir)[-1]
  assert {"test_accuracy", "train_ece", "total_scoring_seconds", "selected_k"} <= set(record)
  assert not math.isnan(record["test_accuracy"])


def test_the_log_reports_the_first_compile_and_the_report(main_run):
  log = main_run.log
  assert "Compiling the loop's programs ahead (the train, eval and scoring steps)" in log
  assert "The loop's programs are compiled (" in log
  assert "The first step took" in log
  assert "Building the calibration report after epoch 4" in log
  assert "100 bootstrap resamples" in log
  assert "Report built: T = " in log


def test_a_scoring_pass_logs_its_start_and_its_duration(digits, caplog):
  mesh = sharding.create_mesh()
  # A stand-in for the scoring step: [B, 3] columns (score, confidence, correct) = the label.
  score_fn = jax.jit(lambda state, batch: jnp.stack([batch["label"].astype(jnp.float32)] * 3,
                                                    axis=-1))
  source = score_sources.ScoringPass(score_fn, digits["train"], mesh, 64, rescore_every=1)
  with caplog.at_level(logging.INFO):
    state = source.refresh(3, None, bookkeeping.initial_state(len(digits["train"].ids)))
  np.testing.assert_array_equal(state["scores"], digits["train"].labels)  # One pass, in order.
  lines = [r.getMessage() for r in caplog.records]
  assert "Scoring pass for epoch 3: 1257 training examples with the current model..." in lines
  assert any(line.startswith("Scoring pass for epoch 3 done in ") for line in lines), lines


class _Scalars:
  """A writer that keeps what write_scalars gets."""

  def __init__(self):
    self.written = []

  def write_scalars(self, step, scalars):
    self.written.append((step, scalars))


def test_a_logging_window_logs_a_steps_own_metrics_by_their_names():
  """Two steps, worked by hand: the standard metrics, and the ones a step adds (as FL_gamma's
  step does): a `_sum` is a sum over examples, logged as their mean; any other, a number per
  step, as the window's mean."""
  no_bad = np.int32(steps.NO_BAD_STEP)
  stacked = {"loss_sum": np.float32([2, 4]), "correct": np.float32([1, 3]),
             "count": np.float32([4, 4]), "first_bad_step": np.int32([no_bad, no_bad]),
             "grad_norm": np.float32([1, 3]), "param_norm": np.float32([5, 6]),
             "gamma_sum": np.float32([2, 6]), "meta_loss": np.float32([0.5, 1.5])}
  writer = _Scalars()
  step_loop._log_train_window(writer, (stacked, 10, np.float32(0.25), (0, 8, None)))
  assert writer.written == [(10, {
      "train/loss": 0.75, "train/accuracy": 0.5, "train/learning_rate": 0.25,
      "train/grad_norm": 2.0, "train/param_norm": 6.0, "train/gamma_mean": 1.0,
      "train/meta_loss": 1.0})]
  step_loop._log_train_window(writer, None)  # Nothing pending: nothing written.
  assert len(writer.written) == 1


def test_a_full_disk_under_the_events_names_the_event_file_once(tmp_path, capfd):
  """A 64 KiB tmpfs as the workdir, filled by the events' own images: the write that fails
  raises one OSError (ENOSPC) naming the event file, in the writer's caller (no background
  thread's traceback on stderr), and the run's FATAL line names that folder to free, not
  the checkpoints'."""
  folder = str(tmp_path / "tiny")
  test_failures._mount_tiny_tmpfs(folder, 64)  # pylint: disable=protected-access
  try:
    writer = metric_writers.TensorBoardWriter(folder)
    noise = np.random.default_rng(0).integers(0, 256, size=(1, 64, 64, 3), dtype=np.uint8)
    with pytest.raises(OSError) as info:
      for step in range(100):  # 12 KiB of incompressible PNG each: full within a few.
        writer.write_images(step, {"test/noise": noise})
        writer.flush()
    assert info.value.errno == errno.ENOSPC and info.value.filename == writer.path
    assert "Traceback" not in capfd.readouterr().err
    line = failures.line(info.value, str(tmp_path / "checkpoints"), 1)
    assert f"make the folder {folder} writable (or free space there)" in line
    with contextlib.suppress(OSError):  # Whatever is still buffered has no room either.
      writer.close()
    writer.close()  # The file was closed all the same: a second close does nothing.
  finally:
    subprocess.run(["umount", folder], check=False)
