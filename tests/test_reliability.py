"""Failures a run must meet early, loudly and without losing work: a report that fails after
the last epoch, strict report JSON, a run that learns nothing, start-up checks of everything a
run will need (data, OOD set, target runs, stream files, checkpoint space), damaged stream
records, an unwritable checkpoint directory. docs/reliability.md lists each fault with its test.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import time
import types

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import cifar10 as cifar10_config
from configs import fashion_mnist as fashion_mnist_config
from cpjax import run_state
from cpjax.calibration import report, report_files
from cpjax.config import preflight
from cpjax.data import array_records, input_pipeline
from cpjax.data.datasets import fashion_mnist_local
from cpjax.runtime import checkpoint_room, checkpointing, sharding
from cpjax.selection import bookkeeping, score_files
from cpjax.training import run, train
from tests import helpers, test_faults
from tests.helpers import (
  REPO,
  SELECTED_FLAGS,
  STEPS_PER_EPOCH,
  checkpoint_steps,
  free_port,
  main_command,
  read_metrics,
  restore_checkpoint,
  run_main,
  sigkill_once_saved,
  subprocess_env,
  tiny_config,
  without_timing,
)

pytest_plugins = ("tests.trained_runs",)  # The shared trained runs.


def _strict_load(path: str):
  """json.load that refuses NaN, Infinity and -Infinity (as strict parsers do)."""
  with open(path) as f:
    return json.load(f, parse_constant=lambda name: pytest.fail(f"{name} in {path}"))


@pytest.mark.slow
def test_a_failing_report_keeps_the_last_epoch_and_evaluate_finishes_it(tmp_path, monkeypatch):
  """The report fails after the last epoch: its checkpoint is already committed, so
  --mode=evaluate writes the report from it, and a rerun of the training command writes it
  too, neither training again."""
  workdir, config = str(tmp_path), tiny_config()
  real = report_files.write_report

  def failing(*args, **kwargs):
    raise OSError("disk full while writing the report")
  monkeypatch.setattr(report_files, "write_report", failing)
  with pytest.raises(OSError, match="disk full"):
    train.train_and_evaluate(config, workdir)
  last = 2 * STEPS_PER_EPOCH
  assert checkpoint_steps(workdir) == [STEPS_PER_EPOCH, last]  # The last epoch is saved.
  monkeypatch.setattr(report_files, "write_report", real)
  results = train.evaluate_only(config, workdir)
  assert (results["checkpoint_step"], results["epoch"]) == (last, 2)
  on_disk = _strict_load(os.path.join(workdir, "report", "results.json"))
  assert (on_disk["checkpoint_step"], on_disk["epoch"], on_disk["epoch_step"]) == (last, 2, 0)
  with open(os.path.join(workdir, "report", "results.md")) as f:
    assert f"The model of global step {last}: after 2 epochs." in f.read()
  # The training command on the finished run: no training, the report rewritten if missing.
  os.remove(os.path.join(workdir, "report", "results.json"))
  epochs_before = [r["epoch"] for r in read_metrics(workdir)]
  train.train_and_evaluate(config, workdir)
  assert _strict_load(os.path.join(workdir, "report", "results.json"))["checkpoint_step"] == last
  assert [r["epoch"] for r in read_metrics(workdir)] == epochs_before
  assert checkpoint_steps(workdir) == [STEPS_PER_EPOCH, last]


@pytest.mark.slow  # Builds a whole report.
def test_report_json_is_strict_with_null_for_undefined_values(tmp_path):
  values = {"a": float("nan"), "b": [np.float32(1.5), np.inf, -np.inf], "c": np.int64(3),
            "d": {"e": np.array([0.25, np.nan])}, "f": True, "g": "text", "h": None}
  assert report_files.strict_json(values) == {"a": None, "b": [1.5, None, None], "c": 3,
                                        "d": {"e": [0.25, None]}, "f": True, "g": "text",
                                        "h": None}
  # A report of logits no test example is confident about: s99_accuracy and empty bins.
  rng = np.random.default_rng(0)
  logits, labels = rng.normal(size=(200, 10)) * 0.1, rng.integers(0, 10, 200)
  built = report.build_report((logits, labels), (logits, labels), 10,
                              tiny_config().evaluation)
  flat = json.dumps(built, default=float)
  assert "NaN" in flat  # The case: undefined values exist before the conversion.
  paths = report_files.write_report(str(tmp_path), built)
  strict = _strict_load(paths[0])
  assert strict["metrics"]["test"]["before_ts"]["accuracy"] == pytest.approx(
      float(np.mean(np.argmax(logits, -1) == labels)))
  assert None in strict["reliability"]["before_ts"]["accuracy"]  # Empty bins: null.
  # Read back for the studies: null is NaN again, everything else as written.
  back = report_files.read_results(paths[0])
  np.testing.assert_array_equal(back["reliability"]["before_ts"]["accuracy"],
                                built["reliability"]["before_ts"]["accuracy"])
  for split, by_tag in built["metrics"].items():
    for tag, values in by_tag.items():
      assert back["metrics"][split][tag] == pytest.approx(values, nan_ok=True), (split, tag)
  assert np.isnan(back["metrics"]["test"]["before_ts"]["s99_accuracy"])  # Nothing >= 0.99.


@pytest.mark.slow
def test_a_run_that_learns_nothing_stops_with_a_clear_message(tmp_path):
  """The outside report's run: FL_gamma with meta.max_gamma=0 and meta.temperature=1e-30
  trained with a loss of exactly 0.0 and exited 0 at chance accuracy. Now the first epoch
  stops it, naming the epoch, and nothing is saved."""
  config = tiny_config(**{"loss.name": "flgamma_sece", "dataset.meta_val_size": 128,
                          "meta.max_gamma": 0.0, "meta.temperature": 1e-30, "num_epochs": 1})
  with pytest.raises(train.StalledTrainingError,
                     match=r"learns nothing: at every one of the \d+ steps of epoch 0 the "
                           r"(gradient was exactly zero|training loss was exactly 0\.0)"):
    train.train_and_evaluate(config, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints" / "0")
  assert checkpoint_steps(str(tmp_path)) == []


@pytest.mark.parametrize("loss_min, loss_max, grad_max, steps, stalls", [
    (0.0, 0.0, 0.0, 5, True),  # Both.
    (0.5, 0.5, 0.1, 5, True),  # The same mean loss on 5 different batches.
    (0.5, 0.5, 0.1, 1, False),  # One step: one loss value says nothing.
    (0.4, 0.5, 0.0, 1, True),  # Zero gradient, even in one step.
    (0.4, 0.5, 0.1, 5, False),
    (-np.inf, np.inf, np.inf, 5, False),  # A resumed epoch's unknown extremes.
])
def test_stall_rule_by_hand(loss_min, loss_max, grad_max, steps, stalls, tmp_path):
  checkpointer = checkpointing.Checkpointer(str(tmp_path), 1)
  totals = {"loss_min": np.float32(loss_min), "loss_max": np.float32(loss_max),
            "grad_norm_max": np.float32(grad_max)}
  if stalls:
    with pytest.raises(run.StalledTrainingError):
      run.raise_if_stalled(totals, 3, steps, checkpointer, "cross_entropy")
  else:
    run.raise_if_stalled(totals, 3, steps, checkpointer, "cross_entropy")


# Start-up checks (cpjax.config.preflight): every failure is found before anything is written.


def _fails_at_start_up(config, workdir: str, *expected: str, checks_only: bool = False) -> str:
  """train_and_evaluate(config) stops in its start-up checks with one line per problem,
  each matching one of `expected` in order, and leaves `workdir` as it found it.
  `checks_only`: call those checks alone (cpjax.config.preflight.check, the first thing a run
  does), for a config whose training would take many minutes if the checks let it pass."""
  before = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else None
  with pytest.raises(preflight.StartupCheckError) as info:
    if checks_only:
      preflight.check(config, workdir)
    else:
      train.train_and_evaluate(config, workdir)
  lines = str(info.value).splitlines()[1:]
  assert len(lines) == len(expected), str(info.value)
  for line, pattern in zip(lines, expected):
    assert re.search(pattern, line), (pattern, line)
  after = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else None
  assert after == before  # No lock file, no checkpoints/ folder, nothing.
  return str(info.value)


@pytest.mark.slow  # A main.py process.
def test_cifar10_without_cifar_or_svhn_fails_at_start_up_in_seconds(tmp_path):
  """configs/cifar10.py on a machine without CIFAR-10 and SVHN, run as a user runs it: one
  line for each, the second naming --config.evaluation.ood="" to skip the OOD set; the
  workdir is never created. Without the OOD set, only the first line remains."""
  empty, workdir = str(tmp_path / "tfds"), str(tmp_path / "run")
  os.makedirs(empty)
  start = time.monotonic()
  result = run_main(workdir, f"--config.dataset.data_dir={empty}", config="configs/cifar10.py",
                    timeout=120)
  seconds = time.monotonic() - start
  fatal = [line for line in result.stderr.splitlines() if line.startswith("FATAL")]
  assert result.returncode == 2 and fatal, result.stderr[-3000:]
  problems = result.stderr[result.stderr.index("FATAL"):].splitlines()[1:]
  assert len(problems) == 2, result.stderr[-3000:]
  assert "tfds dataset 'cifar10' is not prepared" in problems[0]
  assert ("the OOD set evaluation.ood='svhn' of the final report is missing: tfds dataset "
          "'svhn_cropped' is not prepared") in problems[1]
  assert problems[1].endswith('pass --config.evaluation.ood=""')
  assert "Traceback" not in result.stderr
  assert not os.path.exists(workdir)
  # Start-up and the checks, on a machine shared with other jobs: well under a minute (the
  # issue's run trained 200 epochs before failing on SVHN).
  assert seconds < 60, seconds
  config = cifar10_config.get_config()
  config.dataset.data_dir, config.evaluation.ood = empty, ""
  _fails_at_start_up(config, workdir, "tfds dataset 'cifar10' is not prepared")


def test_an_ood_set_that_cannot_be_prepared_fails_at_start_up_despite_manual_dir(
    fashion_mnist_tfds, tmp_path):
  """configs/fashion_mnist.py with Debian's files as dataset.manual_dir and
  evaluation.ood=fashion_mnist_tfds (tfds's own builder, not prepared in data_dir). A check
  that passed the OOD set because manual_dir is set would let both epochs train, and tfds's
  checksum error would come at the report. tfds's builder prepares the OOD set
  at start-up from that folder, rejects Debian's re-compressed files by checksum (offline,
  no download), and the run stops before its first step with that one line."""
  prepared, _ = fashion_mnist_tfds
  data_dir = str(tmp_path / "tfds")  # The run's dataset prepared; nothing else there.
  os.makedirs(data_dir)
  os.symlink(os.path.join(prepared, "fashion_mnist_local"),
             os.path.join(data_dir, "fashion_mnist_local"))
  config = fashion_mnist_config.get_config()
  config.dataset.data_dir, config.evaluation.ood = data_dir, "fashion_mnist_tfds"
  config.dataset.manual_dir = fashion_mnist_local.DEFAULT_DIR
  _fails_at_start_up(
      config, str(tmp_path / "run"),
      r"^ *the OOD set evaluation\.ood='fashion_mnist_tfds' of the final report is missing: "
      r"could not prepare tfds dataset 'fashion_mnist' in '.*/tfds/fashion_mnist/[\d.]+' "
      rf"\(manual_dir='{fashion_mnist_local.DEFAULT_DIR}'\): NonMatchingChecksumError: .*"
      r'pass --config\.evaluation\.ood=""$', checks_only=True)


def test_a_manual_archive_for_the_run_does_not_let_a_missing_ood_set_through(tmp_path,
                                                                             monkeypatch):
  """configs/cifar10.py with a CIFAR-10 archive in manual_dir and its OOD set, SVHN, not
  prepared and not downloadable: found at start-up, not after the 200 epochs. There is no
  CIFAR-10 archive here: its builder is replaced by a stand-in that is prepared, as the
  archive would make it. SVHN goes through tfds's real builder; only its
  download_and_prepare is replaced, by the error an offline machine gets. The OOD set is
  prepared with its own builder, given the run's manual_dir (a folder may hold several
  archives), exactly once."""
  helpers.require_tensorflow()  # SVHN is prepared (here: tried) only where TF is installed.
  manual = str(tmp_path / "manual")
  os.makedirs(manual)
  real_builder, attempts = input_pipeline._builder, []  # pylint: disable=protected-access

  def builder(spec, dataset):
    if spec.tfds_name == "cifar10":  # Stand-in: prepared from the (absent) archive.
      splits = {"train": None, "test": None}
      return types.SimpleNamespace(info=types.SimpleNamespace(splits=splits), data_dir="/x")
    return real_builder(spec, dataset)

  def offline(self, download_config=None, **kwargs):
    del kwargs
    attempts.append((self.name, download_config.manual_dir))
    raise ConnectionError("no route to host (stand-in for an offline machine)")
  monkeypatch.setattr(input_pipeline, "_builder", builder)
  monkeypatch.setattr(tfds.builder_cls("svhn_cropped"), "download_and_prepare", offline)
  config = cifar10_config.get_config()
  config.dataset.data_dir, config.dataset.manual_dir = str(tmp_path / "tfds"), manual
  assert config.evaluation.ood == "svhn"
  _fails_at_start_up(
      config, str(tmp_path / "run"),
      r"^ *the OOD set evaluation\.ood='svhn' of the final report is missing: could not prepare "
      rf"tfds dataset 'svhn_cropped' in '.*' \(manual_dir='{manual}'\): ConnectionError: no "
      r'route to host \(stand-in for an offline machine\)\. .*pass --config\.evaluation\.ood=""$',
      checks_only=True)
  assert attempts == [("svhn_cropped", manual)]


def test_a_target_run_without_recorded_scores_fails_at_start_up(tmp_path):
  target = tmp_path / "target"
  os.makedirs(target / "checkpoints")  # A run that never recorded scores (nor a config).
  config = tiny_config(**{"selection.method": "top_k", "selection.warmup_epochs": 1,
                          "selection.scoring": "target_recorded",
                          "selection.target_workdir": str(target)})
  _fails_at_start_up(config, str(tmp_path), r"needs the target's recorded scores, e\.g\. "
                     r".*scores.*record_scores=True")


def test_no_room_for_a_checkpoint_fails_at_start_up(tmp_path, monkeypatch):
  """A file system with less free space than two checkpoints (the tiny model's, from its
  shapes: counted by hand below) is refused before the run starts."""
  config = tiny_config()
  nbytes = preflight.checkpoint_bytes(config)
  restored = run_state.abstract(config, sharding.create_mesh(), bookkeeping.initial_state_of(
      config.dataset, config.selection))
  by_hand = sum(int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                for leaf in jax.tree.leaves(restored))
  params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(restored["train"].params))
  assert nbytes == by_hand and nbytes >= 4 * params  # float32 parameters at least.
  usage = shutil.disk_usage(str(tmp_path))
  monkeypatch.setattr(checkpoint_room.shutil, "disk_usage",
                      lambda path: usage._replace(free=2 * nbytes - 1))
  _fails_at_start_up(config, str(tmp_path / "w"), r"checkpoint folder .*/w/checkpoints has "
                     r"[\d.]+ (KiB|MiB) free, a checkpoint needs [\d.]+ (KiB|MiB)")
  monkeypatch.setattr(checkpoint_room.shutil, "disk_usage",
                      lambda path: usage._replace(free=2 * nbytes))
  preflight.check(config, str(tmp_path / "w"))  # Just enough.


def _stream_config(directory: str, **overrides):
  return tiny_config(**{"dataset.reader": "stream", "dataset.stream_dir": directory,
                        "evaluation.ood": "", **overrides})


@pytest.fixture
def stream_dir(digits, tmp_path):
  """configs/test.py's splits as array_record files, 2 shards each."""
  directory = str(tmp_path / "stream")
  array_records.write_splits(digits, directory, tiny_config().dataset, num_shards=2)
  return directory


def test_missing_or_truncated_stream_files_fail_at_start_up(stream_dir, tmp_path):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)  # An existing, empty workdir stays empty.
  _fails_at_start_up(_stream_config(str(tmp_path / "nowhere")), workdir,
                     r"no array_record split 'train' in .*nowhere.*write_array_records")
  shard = os.path.join(stream_dir, "val.array_record-00001-of-00002")
  with open(shard, "rb") as f:
    data = f.read()
  with open(shard, "wb") as f:
    f.write(data[:len(data) // 2])
  _fails_at_start_up(_stream_config(stream_dir), workdir,
                     rf"{shard} is {len(data) // 2} bytes, {len(data)} were written: the file "
                     r"is truncated or damaged; rewrite the split")


def _replace_image(directory: str, name: str, row: int, digits) -> str:
  """Rewrites shard files of split `name` with row `row`'s image inverted: a valid
  array_record file, same size, one record different from what the index recorded."""
  split = digits[name]
  images = split.images.copy()
  images[row] = 255 - images[row]
  other = directory + "_other"
  array_records.write_split(zip(split.ids, split.labels, images), len(split), other, name,
                            array_records.split_key(tiny_config().dataset), 2)
  shard = 0 if row < len(split) // 2 else 1
  path = f"{name}.array_record-{shard:05d}-of-00002"
  shutil.copyfile(os.path.join(other, path), os.path.join(directory, path))
  return os.path.join(directory, path)


def test_a_damaged_record_is_named_by_file_and_record_when_read(stream_dir, digits):
  """A record that differs from what was written (a valid file, so array_record cannot
  tell) and one with flipped bytes: reading either raises naming the file and the record;
  no garbled image comes back."""
  train_rows = len(digits["train"])
  row = train_rows - 3  # In shard 1, which starts at row train_rows // 2.
  path = _replace_image(stream_dir, "train", row, digits)
  reader = array_records.stream_reader(stream_dir, "train", sharding.create_mesh(),
                                       tiny_config().dataset)
  record = row - train_rows // 2
  with pytest.raises(array_records.DamagedRecordError,
                     match=rf"{path}: record {record} \(row {row} of the split\) is damaged "
                           r"\(its CRC-32 differs"):
    reader.images.read(np.arange(train_rows - 10, train_rows))
  reader.images.read(np.arange(10))  # The other rows still read.
  # Met by grain's read-ahead threads, as in training: the same error reaches the loop.
  blocks = np.arange(train_rows - train_rows % 8).reshape(-1, 8)
  with pytest.raises(array_records.DamagedRecordError, match=rf"{path}: record {record} "):
    for _ in reader.images.prefetched(blocks, num_threads=2, buffer_size=2):
      pass
  # Flipped bytes in a record of the test split: array_record's own chunk hash fails.
  path = os.path.join(stream_dir, "test.array_record-00000-of-00002")
  with open(path, "rb") as f:
    data = bytearray(f.read())
  image = digits["test"].images[7].tobytes()
  at = data.find(image)
  assert at > 0 and data.count(image) == 1
  data[at + 3] ^= 0xFF
  with open(path, "wb") as f:
    f.write(bytes(data))
  test_reader = array_records.stream_reader(stream_dir, "test", sharding.create_mesh())
  with pytest.raises(array_records.DamagedRecordError, match=rf"{path}: record \d+ \(row \d+ "
                     r"of the split\) is (unreadable|damaged)"):
    test_reader.images.read(np.arange(len(digits["test"])))


def test_a_damaged_sampled_record_fails_at_start_up(stream_dir, digits, tmp_path):
  path = _replace_image(stream_dir, "val", 0, digits)  # The first row is always sampled.
  _fails_at_start_up(_stream_config(stream_dir), str(tmp_path / "run"),
                     rf"{path}: record 0 \(row 0 of the split\) is damaged")


def _make_unwritable(path: str) -> str:
  """Makes folder `path` refuse new entries as a read-only mount or an exceeded quota would,
  even for root (the immutable attribute); returns the command that undoes it."""
  if os.geteuid() != 0:
    os.chmod(path, 0o555)
    return f"chmod 755 {path}"
  result = subprocess.run(["chattr", "+i", path], capture_output=True, text=True)
  if result.returncode != 0:
    pytest.skip(f"root cannot make {path} read-only here (chattr +i: {result.stderr.strip()})")
  return f"chattr -i {path}"


@pytest.mark.slow
def test_a_checkpoint_folder_turning_read_only_mid_run_stops_in_one_line(tmp_path):
  """checkpoints/ refuses new files after the first checkpoint (a read-only remount, a full
  disk, a quota): the next save stops the run at once with one line, exit 1, instead of
  orbax logging PermissionError and the process hanging; the first checkpoint is intact."""
  workdir = str(tmp_path / "run")
  flags = ("--config.num_epochs=3",)
  log = str(tmp_path / "stderr.log")
  with open(log, "w") as stderr_file:
    proc = subprocess.Popen(main_command(workdir, *flags), cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=stderr_file)
  checkpoints = os.path.join(workdir, "checkpoints")
  committed = os.path.join(checkpoints, str(STEPS_PER_EPOCH), "commit_success.txt")
  deadline = time.monotonic() + 240
  while not os.path.exists(committed) and time.monotonic() < deadline:
    assert proc.poll() is None, open(log).read()[-3000:]
    time.sleep(0.02)
  undo = _make_unwritable(checkpoints)
  try:
    start = time.monotonic()
    proc.wait(timeout=120)
    seconds = time.monotonic() - start
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    subprocess.run(undo.split(), check=True)
  with open(log) as f:
    stderr = f.read()
  assert proc.returncode == 1, stderr[-3000:]
  fatal = [line for line in stderr.splitlines() if line.startswith("FATAL")]
  # The probe before each save says it, or orbax's own write does if the folder turned
  # read-only while a save was under way: one line either way.
  assert len(fatal) == 1, stderr[-3000:]
  assert re.fullmatch(rf"FATAL (checkpoint folder {checkpoints} is not writable|writing a "
                      rf"checkpoint in {checkpoints} failed) \(PermissionError: .*Operation "
                      r"not permitted.*", fatal[0]), fatal[0]
  assert stderr.strip().splitlines()[-1] == fatal[0]  # The last word, not a traceback.
  assert seconds < 60, seconds  # An epoch of configs/test.py, then the refused save.
  assert checkpoint_steps(workdir) == [STEPS_PER_EPOCH]
  restored = restore_checkpoint(workdir)  # Intact: it restores.
  assert int(restored["train"]["step"]) == STEPS_PER_EPOCH


# Multi-process liveness and elastic resume.


def _start_processes(workdir: str, tmp_path, tag: str, flags, port: int, count: int = 2,
                     devices: int = 4) -> list[tuple[subprocess.Popen, str]]:
  """main.py as `count` processes of one job on 127.0.0.1 (`devices` CPU devices each);
  returns (process, log path) for each."""
  started = []
  for i in range(count):
    log = str(tmp_path / f"{tag}_{i}.log")
    with open(log, "w") as stderr:
      started.append((subprocess.Popen(
          main_command(workdir, *flags, f"--coordinator_address=127.0.0.1:{port}",
                       f"--num_processes={count}", f"--process_id={i}"),
          cwd=REPO, env=subprocess_env(devices, JAX_PLATFORMS="cpu"),
          stdout=subprocess.DEVNULL, stderr=stderr), log))
  return started


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


MULTI_FLAGS = (*SELECTED_FLAGS, "--config.log_every_steps=1", "--config.dataset.reader=host")


def test_a_killed_process_ends_its_peer_in_bounded_time_and_both_resume(selected_run, digits,
                                                                       tmp_path):
  """2 processes (2 x 4 devices); SIGKILL process 1 in epoch 1: process 0 exits with status
  1 once the heartbeat timeout (30 s here) has passed, never waiting forever, and its last
  line is one FATAL line naming process 1, the last good checkpoint and the rerun (not
  JAX's 64-line abort dump). The rerun of both resumes from that checkpoint
  and computes what one process computes (`selected_run`, as the SLURM test compares); so
  does the same checkpoint resumed as 1 process on 8 devices."""
  # 10 s once declared a healthy but CPU-starved process dead on a loaded 2-core machine.
  workdir, heartbeat = str(tmp_path / "run"), 30
  flags = (*MULTI_FLAGS, f"--heartbeat_timeout_s={heartbeat}")
  (first, log0), (second, _) = _start_processes(workdir, tmp_path, "first", flags, free_port())
  try:
    deadline = time.monotonic() + 300
    while f"[{STEPS_PER_EPOCH + 5}] train/" not in _read(log0):
      assert first.poll() is None and time.monotonic() < deadline, _read(log0)[-3000:]
      time.sleep(0.05)
    second.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    first.wait(timeout=heartbeat + 110)
    seconds = time.monotonic() - killed
  finally:
    for proc in (first, second):
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  log = _read(log0)
  assert first.returncode == 1, log[-3000:]
  # The watch sees a beat at most a second before the kill, and speaks a second after the
  # timeout at the latest (plus what the loaded machine adds).
  assert heartbeat - 2 <= seconds < heartbeat + 50, seconds
  fatal = [line for line in log.splitlines() if line.startswith("FATAL")]
  assert fatal == [log.strip().splitlines()[-1]], log[-3000:]  # One line, the last word.
  assert fatal[0] == (
      f"FATAL process 1 of 2 was lost (no heartbeat for {heartbeat} s): killed, out of memory "
      "or its host down; this process stops too. Once every process has ended, rerun the same "
      f"command: it resumes from the last good checkpoint, step {STEPS_PER_EPOCH} in "
      f"{workdir}/checkpoints (on every process)")
  assert "Check failure stack trace" not in log  # JAX's abort (its backstop) never came.
  assert checkpoint_steps(workdir) == [STEPS_PER_EPOCH]  # The last committed one.
  single = str(tmp_path / "single")
  shutil.copytree(workdir, single)
  rerun = _start_processes(workdir, tmp_path, "rerun", MULTI_FLAGS, free_port())
  for proc, log in rerun:
    assert proc.wait(timeout=400) == 0, _read(log)[-3000:]
    assert f"Resumed from {workdir}/checkpoints at global step {STEPS_PER_EPOCH}" in _read(log)
  assert [r["epoch"] for r in read_metrics(workdir)] == [0, 1, 2]
  test_faults._assert_like_one_process(selected_run.workdir, workdir, digits["train"].ids)
  # The same checkpoint of 2 processes resumed as 1 process on 8 devices: the same run.
  result = subprocess.run(main_command(single, *MULTI_FLAGS), cwd=REPO, env=subprocess_env(8),
                          capture_output=True, text=True, timeout=400)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"Resumed from {single}/checkpoints at global step {STEPS_PER_EPOCH}" in result.stderr
  _assert_same_run(selected_run.workdir, single)


def _assert_same_run(expected: str, actual: str) -> None:
  """Two workdirs of helpers.SELECTED hold the same run up to float rounding: the same rows
  selected in every epoch (the selection state's integers and the recorded scores' NaN
  pattern), every metric and score within float32 rounding of reordered sums."""
  a, b = (without_timing(read_metrics(d)) for d in (expected, actual))
  assert [r["epoch"] for r in a] == [r["epoch"] for r in b] == [0, 1, 2]
  for ra, rb in zip(a, b):
    assert ra.keys() == rb.keys()
    for key, value in ra.items():
      if isinstance(value, float):
        # FPR at 95 % TPR is a threshold statistic: a rounding-level change of one score can
        # move one of the 360 test images across it (1 / 360 = 0.0028). The calibrated
        # metrics come from a map fitted by an optimiser on cross-validation folds, which can
        # carry such a change on to a few images crossing an ECE bin edge.
        tolerance = {"fpr95": 1 / 360 + 1e-6, "calibrated": 2 / 360 + 1e-6}
        tolerance = next((v for k, v in tolerance.items() if k in key), 2e-3)
        assert rb[key] == pytest.approx(value, rel=1e-3, abs=tolerance, nan_ok=True), key
      else:
        assert rb[key] == value, key
  sa, sb = (restore_checkpoint(d)["selection"] for d in (expected, actual))
  assert sa.keys() == sb.keys()
  for key in sorted(set(sa) - {"seconds"}):  # Wall-clock totals differ between any two runs.
    x, y = np.asarray(sa[key]), np.asarray(sb[key])
    if np.issubdtype(x.dtype, np.floating):
      np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
      np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-3)
    else:
      np.testing.assert_array_equal(x, y)
  for epoch in range(3):
    x, y = (np.load(score_files.score_path(d, epoch)) for d in (expected, actual))
    np.testing.assert_array_equal(np.isnan(x), np.isnan(y))  # The same rows trained.
    np.testing.assert_allclose(x, y, atol=1e-4)


def test_a_checkpoint_of_8_devices_resumes_on_4_and_2_and_is_refused_on_3(selected_run,
                                                                        tmp_path):
  """A run of helpers.SELECTED on 8 CPU devices, SIGKILLed once its epoch-0 checkpoint is
  saved, resumed on 4 and on 2 devices: the same run as the uninterrupted one on 8
  (`selected_run`). On 3 devices the batch of 64 no longer divides: refused at start-up,
  naming the value and the device count, the checkpoint untouched."""
  eight = str(tmp_path / "eight")
  sigkill_once_saved(eight, SELECTED_FLAGS, STEPS_PER_EPOCH, subprocess_env(8))
  refused = subprocess.run(main_command(eight, *SELECTED_FLAGS), cwd=REPO,
                           env=subprocess_env(3), capture_output=True, text=True, timeout=300)
  assert refused.returncode != 0
  assert ("config.batch_size=64 must be divisible by the device count 3"
          in refused.stderr), refused.stderr[-3000:]
  assert checkpoint_steps(eight) == [STEPS_PER_EPOCH]
  for devices in (4, 2):
    workdir = str(tmp_path / f"on{devices}")
    shutil.copytree(eight, workdir)
    result = subprocess.run(main_command(workdir, *SELECTED_FLAGS), cwd=REPO,
                            env=subprocess_env(devices), capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Resumed from {workdir}/checkpoints at global step {STEPS_PER_EPOCH}" in (
        result.stderr)
    assert f"local devices: [{', '.join(f'CpuDevice(id={i})' for i in range(devices))}]" in (
        result.stderr)
    _assert_same_run(selected_run.workdir, workdir)


@pytest.mark.slow  # Builds a whole report.
def test_posthoc_table_intervals_follow_calibrator_resamples():
  rng = np.random.default_rng(1)
  logits, labels = rng.normal(size=(150, 4)) * 2, rng.integers(0, 4, 150)
  data = (logits, labels)
  config = tiny_config(**{"evaluation.calibrator_resamples": 0}).evaluation
  section, _ = report.posthoc_table(data, data, 4, config)
  assert all(row["intervals"] == {} for row in section["calibrators"].values())
  table = "\n".join(report_files._posthoc_markdown(section))  # pylint: disable=protected-access
  assert "| none | — |" in table and "[" not in table.split("| none |")[1]
  config = tiny_config(**{"evaluation.calibrator_resamples": 30}).evaluation
  section, _ = report.posthoc_table(data, data, 4, config)
  row = section["calibrators"]["none"]
  assert set(row["intervals"]) == set(report.TABLE_METRICS)
  assert all(iv["num_resamples"] == 30 for iv in row["intervals"].values())
  # Each cell shows its value and its interval, as results.md prints them.
  iv = row["intervals"]["nll"]
  table = "\n".join(report_files._posthoc_markdown(section))  # pylint: disable=protected-access
  assert f"{row['test']['nll']:.4f} [{iv['low']:.4f}, {iv['high']:.4f}]" in table
