"""The run's anatomy (cpjax.runtime.anatomy): the steady/warm-up split by hand, the compile
watch's counts and its warning after the first epoch, the union of nested compile spans, and
parts that add up to the wall clock."""

import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import pytest

from cpjax.runtime import anatomy
from tests import helpers, test_sources_slow


def test_training_splits_into_steady_and_warmup_by_hand():
  # Paces of the epochs after the first: 0.10, 0.12, 0.10 s/step -> median 0.10.
  # Warm-up: epoch 0 2.0 - 10 x 0.1 = 1.0; epoch 2 1.2 - 1.0 = 0.2; epochs 1, 3 none.
  parts = anatomy._split_training([(10, 2.0), (10, 1.0), (10, 1.2), (5, 0.5)])
  assert parts["warmup_step"] == pytest.approx(1.2)
  assert parts["steady_step"] == pytest.approx(4.7 - 1.2)


def test_a_single_epoch_is_its_own_pace():
  assert anatomy._split_training([(8, 4.0)]) == {"steady_step": 4.0, "warmup_step": 0.0}
  assert anatomy._split_training([]) == {"steady_step": 0.0, "warmup_step": 0.0}


def test_nested_compile_spans_count_once():
  watch = anatomy.CompileWatch()
  try:
    watch._spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.2, 5.4)]
    assert watch.main_seconds(0.0, 10.0) == pytest.approx(4.0)  # [0, 3] and [5, 6].
    assert watch.main_seconds(1.5, 5.5) == pytest.approx(1.5 + 0.5)
    assert watch.main_seconds(3.5, 4.5) == 0.0
  finally:
    watch.close()


def test_the_watch_counts_programs_and_names_a_late_one_with_its_shapes(caplog):
  @jax.jit
  def twice(x):
    return x * 2

  watch = anatomy.CompileWatch()
  try:
    twice(jnp.ones(2))  # A new program, before the first epoch ends.
    twice(jnp.ones(2))  # The same: no compile.
    assert watch.compilations >= 1
    three, four = jnp.ones(3, jnp.float32), jnp.ones(4)
    before = watch.compilations
    watch.first_epoch_done()
    with caplog.at_level(logging.WARNING):
      twice(three)  # A new shape after the first epoch.
    assert watch.after_first_epoch == 1
    assert watch.compilations == before + 1
    assert len(watch.late) == 1 and "twice" in watch.late[0] and "float32[3]" in watch.late[0]
    warned = [r.getMessage() for r in caplog.records if "after the first epoch" in r.getMessage()]
    assert len(warned) == 1 and "float32[3]" in warned[0]
    assert not any(r.getMessage().startswith("Finished ") for r in caplog.records)
    watch.stop_watching_late()
    twice(four)  # The report's programs are not the loop's.
    assert watch.after_first_epoch == 1
    assert not jax.config.jax_log_compiles  # Left as it was.
  finally:
    watch.close()


def test_the_parts_add_up_to_the_wall_clock():
  watch = anatomy.CompileWatch()
  try:
    clock = anatomy.RunClock(watch, start=time.time() - 1.0)
    clock.mark_startup_done()
    with clock.part("data_open"):
      time.sleep(0.02)
    with clock.training(4) as training:
      time.sleep(0.04)
      training.input_wait = 0.01
    with clock.part("scoring") as scoring:
      time.sleep(0.01)
    parts = clock.anatomy()
  finally:
    watch.close()
  total = sum(parts[anatomy.key(name)] for name in anatomy.PARTS)
  assert total == pytest.approx(parts["perf/wall_seconds"], abs=1e-6)
  assert parts["perf/startup_seconds"] >= 1.0
  assert parts["perf/data_open_seconds"] >= 0.02
  assert parts["perf/run_input_wait_seconds"] == pytest.approx(0.01)
  assert parts["perf/steady_step_seconds"] + parts["perf/warmup_step_seconds"] >= 0.029
  assert parts["perf/run_selection_seconds"] == 0.0
  assert parts["perf/run_scoring_seconds"] >= 0.01 and scoring.seconds >= 0.01
  assert all(type(v) in (float, int) for v in parts.values())  # JSON-ready.


def test_the_summary_line_names_the_parts_largest_first():
  parts = {anatomy.key(name): 0.0 for name in anatomy.PARTS}
  parts.update({"perf/wall_seconds": 12.0, "perf/compile_seconds": 7.0,
                "perf/run_report_seconds": 5.0, "perf/compilations": 9,
                "perf/compilations_after_first_epoch": 0})
  line = anatomy.summary_line(parts)
  assert line.startswith("Run anatomy: 12.0 s = compile 7.0 + report 5.0 s;")
  assert "9 programs compiled or loaded, 0 after the first epoch" in line


@pytest.mark.slow
def test_a_run_records_its_anatomy_and_compiles_nothing_after_its_first_epoch(tmp_path):
  """configs/test.py for 4 epochs: top-k on a fresh scoring pass with the kept fraction rising
  (a new k, and a new partial last batch, every selected epoch), evaluation first at epoch 1
  (eval_every_epochs=2): every program is compiled before or in the first epoch."""
  workdir = str(tmp_path / "run")
  result = helpers.run_main(
      workdir, "--config.num_epochs=4", "--config.eval_every_epochs=2",
      "--config.selection.method=top_k", "--config.selection.scoring=fresh",
      "--config.selection.fraction=0.3", "--config.selection.fraction_end=0.7",
      "--config.selection.warmup_epochs=1",
      f"--config.compilation_cache_dir={tmp_path / 'xla'}")
  assert result.returncode == 0, result.stderr[-3000:]
  records = helpers.read_metrics(workdir)
  sizes = [r["selected_k"] for r in records[1:]]  # The selected epochs' sizes.
  assert len(set(sizes)) == 3 and all(k % 64 for k in sizes)  # New k, partial last batches.
  last = records[-1]
  parts = [last[anatomy.key(name)] for name in anatomy.PARTS]
  assert all(p >= 0 for p in parts)
  assert sum(parts) == pytest.approx(last["perf/wall_seconds"], rel=1e-9)
  assert last["perf/compilations"] > 0
  assert last["perf/compilations_after_first_epoch"] == 0
  assert "Compiling after the first epoch" not in result.stderr
  assert "Run anatomy: " in result.stderr
  with open(os.path.join(workdir, "report", "results.json")) as f:
    saved = json.load(f)["anatomy"]
  assert saved == {k: last[k] for k in saved} and len(saved) == len(anatomy.PARTS) + 4


@pytest.mark.slow
def test_a_folder_run_compiles_its_ranking_before_the_first_epoch(tmp_path):
  """A folder of generated images (its steps compile at their first call, in the first
  epoch: no image is decoded ahead of the loop) with top-k after one warm-up epoch: the
  ranking of its selected epoch is compiled ahead, so nothing compiles after the first
  epoch and no warning says so."""
  folder = test_sources_slow.make_folder(str(tmp_path / "images"))
  workdir = str(tmp_path / "run")
  result = helpers.run_main(
      workdir, *test_sources_slow.FOLDER_FLAGS, f"--config.dataset.folder={folder}",
      "--config.num_epochs=2", "--config.selection.method=top_k",
      "--config.selection.fraction=0.5", "--config.selection.warmup_epochs=1",
      "--config.evaluation.calibrator_resamples=0", "--config.evaluation.bootstrap_resamples=10")
  assert result.returncode == 0, result.stderr[-3000:]
  records = helpers.read_metrics(workdir)
  assert records[1]["selected_k"] < records[0]["selected_k"]  # A selected epoch ran.
  assert records[-1]["perf/compilations_after_first_epoch"] == 0
  assert "Compiling after the first epoch" not in result.stderr
