"""Training without TensorFlow, as on a GPU or TPU image that leaves it out.

Each run here is a main.py process started with tests/no_tensorflow first on PYTHONPATH,
whose sitecustomize makes `import tensorflow` fail as a missing package does. The default
job's path (digits), a folder of images and its converted records, Fashion-MNIST from
Debian's files and an already-prepared tfds dataset train, resume after SIGKILL, evaluate
and write their report and TensorBoard events; a resumed run without TensorFlow ends as the
same run with TensorFlow importable. Generated images throughout, but for digits and
Fashion-MNIST (real).
"""

import os
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing import event_accumulator

from tests import helpers
from tests.test_sources_slow import FOLDER_FLAGS, _assert_same_run, make_folder

pytest_plugins = ("tests.trained_runs",)  # main_run: the default path with TensorFlow there.

BLOCKER = os.path.join(helpers.REPO, "tests", "no_tensorflow")


def without_tensorflow_env() -> dict[str, str]:
  """A child process's environment (helpers.subprocess_env) in which TensorFlow is absent."""
  path = os.pathsep.join(p for p in (BLOCKER, helpers.REPO, os.environ.get("PYTHONPATH"))
                         if p)
  return helpers.subprocess_env(PYTHONPATH=path)


def run_main_without_tensorflow(workdir: str, *flags: str, config: str = "configs/test.py"
                                ) -> subprocess.CompletedProcess:
  return subprocess.run(helpers.main_command(workdir, *flags, config=config), cwd=helpers.REPO,
                        env=without_tensorflow_env(), capture_output=True, text=True,
                        timeout=600)


def event_tags(workdir: str) -> set[str]:
  """Every tag of a workdir's TensorBoard events, as TensorBoard's reader lists them."""
  events = event_accumulator.EventAccumulator(workdir)
  events.Reload()
  return {tag for tags in events.Tags().values() if isinstance(tags, list) for tag in tags}


def test_the_blocker_makes_tensorflow_absent_and_the_trainer_imports_without_it():
  code = ("import importlib.util, sys\n"
          "assert importlib.util.find_spec('tensorflow') is None\n"
          "try:\n  import tensorflow\nexcept ModuleNotFoundError:\n  pass\n"
          "else:\n  raise SystemExit('tensorflow imported')\n"
          "import main, cpjax.training.train, cpjax.training.evaluation\n"
          "import cpjax.data.input_pipeline\n"
          "import cpjax.data.sources, cpjax.data.tfds_source, cpjax.runtime.run_logging\n"
          "assert 'tensorflow' not in sys.modules, 'something imported tensorflow'\n"
          "print('OK')\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO,
                          env=without_tensorflow_env(), capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0 and result.stdout.strip() == "OK", result.stderr[-3000:]


@pytest.mark.slow
def test_the_default_path_without_tensorflow_resumes_into_the_run_with_it(main_run, tmp_path):
  """configs/test.py (digits) killed after its first epoch's checkpoint and rerun, TensorFlow
  absent both times: the metrics (timings aside) and the report are main_run's, which ran
  with TensorFlow importable; its TensorBoard events hold the same tags."""
  workdir = str(tmp_path / "killed")
  helpers.sigkill_once_saved(workdir, helpers.MAIN_RUN_FLAGS, helpers.STEPS_PER_EPOCH,
                             without_tensorflow_env())
  resumed = run_main_without_tensorflow(workdir, *helpers.MAIN_RUN_FLAGS)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from" in resumed.stderr
  assert (helpers.without_timing(helpers.read_metrics(workdir))
          == helpers.without_timing(helpers.read_metrics(main_run.workdir)))
  assert os.path.exists(os.path.join(workdir, "report", "results.json"))
  tags = event_tags(workdir)
  assert tags == event_tags(main_run.workdir)
  assert {"test/reliability_before_ts", "train/loss", "val/ece",
          "_hparams_/session_start_info"} <= tags


@pytest.mark.slow
@pytest.mark.parametrize("read", ["folder", "records"])
def test_a_folder_run_without_tensorflow_resumes_bit_for_bit(read, tmp_path):
  """A folder of generated images, TensorFlow absent throughout (the conversion too): the run
  left alone against a run killed inside its second epoch and resumed, reading the folder
  itself or its converted records (the folder then moved away: the records alone give the
  folder's run). The host stage decodes; tests/test_sources_slow.py kills the device stage's
  run."""
  folder = make_folder(str(tmp_path / "images"))
  flags = (*FOLDER_FLAGS, f"--config.dataset.folder={folder}")
  straight = str(tmp_path / "straight")
  result = run_main_without_tensorflow(straight, *flags)
  assert result.returncode == 0, result.stderr[-3000:]
  if read == "records":
    convert = subprocess.run(
        [sys.executable, "-m", "scripts.write_array_records",
         f"--config={os.path.join(helpers.REPO, 'configs/test.py')}",
         "--config.dataset.name=folder", f"--config.dataset.folder={folder}",
         "--config.dataset.image_size=8", f"--out={tmp_path / 'records'}", "--num_shards=3"],
        cwd=helpers.REPO, env=without_tensorflow_env(), capture_output=True, text=True,
        timeout=300)
    assert convert.returncode == 0, convert.stderr[-3000:]
    os.rename(folder, folder + "_moved")
    flags = (*FOLDER_FLAGS, f"--config.dataset.stream_dir={tmp_path / 'records'}")
  killed = str(tmp_path / "killed")
  helpers.sigkill_once_saved(killed, flags, -(-(120 - 12) // 64), without_tensorflow_env())
  resumed = run_main_without_tensorflow(killed, *flags)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from" in resumed.stderr and "mixes the two" not in resumed.stderr
  assert read != "records" or "its encoded records in" in resumed.stderr
  _assert_same_run(straight, killed)
  assert os.path.exists(os.path.join(killed, "report", "results.json"))
  assert "test/reliability_before_ts" in event_tags(killed)


@pytest.mark.slow
def test_fashion_mnist_trains_without_tensorflow(tmp_path):
  """Fashion-MNIST from Debian's files, prepared into a fresh tfds data_dir and trained on (a
  512-image subset, one epoch) without TensorFlow: it evaluates and writes its report."""
  helpers.require_fashion_mnist()
  workdir = str(tmp_path / "run")
  result = run_main_without_tensorflow(
      workdir, "--config.dataset.name=fashion_mnist", f"--config.dataset.data_dir={tmp_path}",
      "--config.dataset.train_examples=512", "--config.num_epochs=1")
  assert result.returncode == 0, result.stderr[-3000:]
  (record,) = helpers.read_metrics(workdir)
  assert record["epoch"] == 0 and 0.0 <= record["test_accuracy"] <= 1.0
  assert os.path.exists(os.path.join(workdir, "report", "results.json"))


@pytest.mark.slow
def test_a_prepared_tfds_dataset_trains_without_tensorflow(tmp_path):
  """A generated tfds dataset prepared (array_record) where TensorFlow is installed, as tfds
  needs it to encode images, then read by name (tfds:NAME) in a run without TensorFlow."""
  helpers.require_tensorflow()  # tfds encodes the images with it.
  prepare = subprocess.run(
      [sys.executable, "-c",
       "import sys, tensorflow_datasets as tfds\n"
       "from tests.test_sources import CpjaxGeneratedImages  # registers the builder\n"
       "tfds.builder('cpjax_generated_images', data_dir=sys.argv[1],"
       " file_format='array_record').download_and_prepare()\n", str(tmp_path / "tfds")],
      cwd=helpers.REPO, env=helpers.subprocess_env(), capture_output=True, text=True,
      timeout=300)
  assert prepare.returncode == 0, prepare.stderr[-3000:]
  workdir = str(tmp_path / "run")
  result = run_main_without_tensorflow(
      workdir, "--config.dataset.name=tfds:cpjax_generated_images",
      f"--config.dataset.data_dir={tmp_path / 'tfds'}", "--config.dataset.image_size=8",
      "--config.dataset.val_size=6", "--config.evaluation.ood=", "--config.num_epochs=1")
  assert result.returncode == 0, result.stderr[-3000:]
  (record,) = helpers.read_metrics(workdir)
  assert record["epoch"] == 0 and 0.0 <= record["test_accuracy"] <= 1.0
  assert os.path.exists(os.path.join(workdir, "report", "results.json"))


@pytest.mark.slow  # Two main.py processes.
@pytest.mark.parametrize("name", ["cifar10", "tfds:mnist"])
def test_an_unprepared_tfds_dataset_without_tensorflow_says_preparing_needs_it(name, tmp_path):
  """Nothing prepared in data_dir and no TensorFlow, a catalog dataset (checked at start-up)
  or one named tfds:NAME (checked with the config): both refused before the run starts (exit
  2, no traceback, the workdir not created), the dataset's line saying that preparing it
  here needs TensorFlow and what to install, without asking for a download first."""
  empty, workdir = str(tmp_path / "tfds"), str(tmp_path / "run")
  os.makedirs(empty)
  result = run_main_without_tensorflow(workdir, f"--config.dataset.name={name}",
                                       f"--config.dataset.data_dir={empty}",
                                       "--config.evaluation.ood=")
  assert result.returncode == 2, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  fatal = lines.index(next(line for line in lines if line.startswith("FATAL")))
  (problem,) = lines[fatal + 1:]  # One line per problem under the FATAL heading.
  assert "is not prepared in" in problem, problem
  assert "preparing it here needs TensorFlow, which is not installed: pip install -r " \
      "requirements-tf.txt" in problem, problem
  assert "Traceback" not in result.stderr and not os.path.exists(workdir)
