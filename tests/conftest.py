"""Test setup: 8 forced CPU devices before any JAX computation, and the shared fixtures.

Training runs are the slow part of the suite, so a run that several tests read
is trained once per session here (its tests must only read its workdir, or copy it).
"""

import dataclasses
import functools
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# XLA:CPU compiles dominate the suite's time (the tiny net's init alone takes seconds), and
# many runs compile identical programs: a persistent compilation cache, fresh per session
# (no state between sessions), lets every run after the first load them. The variables
# reach the main.py runs of the tests and the pytest-xdist workers too (they start after
# this file is imported, so all share one cache); a user's own cache directory is left alone.
_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _XLA_CACHE = tempfile.mkdtemp(prefix="cpjax-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# The suite's programs are small and compiling them is most of its time: LLVM's backend
# optimisations (XLA's default level is 3) only change how fast the generated code runs, and
# skipping them made test_losses + test_steps run in 61 s instead of 87 s (2-core VM). Same
# HLO, same math; results may differ from level 3 in the last float bits, which
# test_compiler_options.py bounds for a train step. Subprocesses (and the pytest-xdist
# workers, which inherit the variable) keep the flag (helpers.subprocess_env), so every
# bit-for-bit comparison is between runs of one level.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
import jax  # pylint: disable=g-import-not-at-top

jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # pylint: disable=g-import-not-at-top  (after the device count is set)

from cpjax import steps, train  # pylint: disable=g-import-not-at-top
from cpjax.data import input_pipeline  # pylint: disable=g-import-not-at-top
from tests import helpers  # pylint: disable=g-import-not-at-top


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  if _XLA_CACHE is not None:
    shutil.rmtree(_XLA_CACHE, ignore_errors=True)


# The README runs the suite on two pytest-xdist workers (`-n 2`, `--dist loadgroup` in
# pyproject.toml). A session fixture is built once per worker, so the tests that read one
# trained run (or the prepared Fashion-MNIST) form a group and run on one worker: each run
# still trains once, and the groups spread over the workers.
_SHARED_FIXTURES = ("selected_run", "main_run", "other_model_run", "meta_run",
                    "fashion_mnist_tfds")
# Fixtures that train a whole run (or build a tfds set): their tests are marked `slow`.
_TRAINED_RUN_FIXTURES = (*_SHARED_FIXTURES, "infobatch_run")


@pytest.hookimpl(tryfirst=True)  # Before pytest-xdist reads the groups off the markers.
def pytest_collection_modifyitems(items):
  for item in items:
    shared = [name for name in _SHARED_FIXTURES if name in getattr(item, "fixturenames", ())]
    if shared:  # No test reads two of them; if one did, both runs would build on its worker.
      item.add_marker(pytest.mark.xdist_group(shared[0]))
    if any(name in getattr(item, "fixturenames", ()) for name in _TRAINED_RUN_FIXTURES):
      item.add_marker(pytest.mark.slow)  # Needs a whole training run (or the built tfds set).


@pytest.fixture(scope="session")
def digits():
  """configs/test.py's splits: 1,257 train, 180 validation, 360 test digits."""
  return input_pipeline.get_datasets(helpers.tiny_config().dataset)


@pytest.fixture
def fashion_mnist_files():
  """Debian's Fashion-MNIST folder, or skip (fail under CPJAX_REQUIRE_REAL_DATA=1)."""
  return helpers.require_fashion_mnist()


fashion_mnist_dir = fashion_mnist_files  # The same fixture under its first name.


@pytest.fixture(scope="session")
def fashion_mnist_tfds(tmp_path_factory):
  """A tfds data_dir with Fashion-MNIST prepared from Debian's files (once per session: the
  preparation writes 70,000 images); skips or fails as `fashion_mnist_files` does."""
  helpers.require_fashion_mnist()
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  config = helpers.tiny_config(**{"dataset.name": "fashion_mnist", "dataset.data_dir": data_dir,
                                  "dataset.val_size": 6000}).dataset
  return data_dir, input_pipeline.get_datasets(config)


@dataclasses.dataclass(frozen=True)
class TrainedRun:
  workdir: str
  config: object
  record: dict  # The last epoch's metrics record.
  train_step_traces: int = 0  # How often steps.train_step was traced during the run.
  train_step_executables: int = 0  # Compiled executables of the run's jitted train step.
  log: str = ""  # The run's stderr (absl log lines), for runs made in a subprocess.


@pytest.fixture(scope="session")
def selected_run(tmp_path_factory) -> TrainedRun:
  """helpers.selected_config() trained once on 8 devices, counting train-step traces.

  The counting wrapper only observes: the run computes exactly what an
  unwrapped run computes (test_selection resumes against it bit for bit).
  """
  workdir = str(tmp_path_factory.mktemp("selected"))
  config = helpers.selected_config()
  traces, jitted = [], []
  real_step, real_jit = steps.train_step, train._jit_train_step  # pylint: disable=protected-access

  @functools.wraps(real_step)
  def counted_step(*args, **kwargs):
    traces.append(1)  # Runs once per trace, never per call of the compiled step.
    return real_step(*args, **kwargs)

  def captured_jit(*args):
    jitted.append(real_jit(*args))
    return jitted[-1]

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(steps, "train_step", counted_step)
    patch.setattr(train, "_jit_train_step", captured_jit)
    record = train.train_and_evaluate(config, workdir)
  assert len(jitted) == 1
  return TrainedRun(workdir, config, record, len(traces),
                    jitted[0]._cache_size())  # pylint: disable=protected-access


@pytest.fixture(scope="session")
def other_model_run(tmp_path_factory) -> TrainedRun:
  """configs/test.py with small_cnn, one epoch: a run of another architecture than `tiny`
  (small_cnn rather than a ResNet: it compiles in a fraction of the time).

  Its tests read its checkpoint and config (the same split as every digits run), not its
  report: no OOD pass."""
  workdir = str(tmp_path_factory.mktemp("other_model"))
  config = helpers.tiny_config(**{"num_epochs": 1, "model.name": "small_cnn",
                                  "evaluation.ood": ""})
  return TrainedRun(workdir, config, train.train_and_evaluate(config, workdir))


@pytest.fixture(scope="session")
def meta_run(tmp_path_factory) -> TrainedRun:
  """configs/test.py with FL_gamma-DECE (helpers.META_RUN: gamma-Net, 128 meta-validation
  digits), in this process (8 devices): the gamma-Net tests read it, and test_selection uses
  it as a gamma-Net target."""
  workdir = str(tmp_path_factory.mktemp("flgamma"))
  config = helpers.tiny_config(**helpers.META_RUN)
  return TrainedRun(workdir, config, train.train_and_evaluate(config, workdir))


@pytest.fixture(scope="session")
def main_run(tmp_path_factory) -> TrainedRun:
  """`main.py` with helpers.MAIN_RUN_FLAGS in a fresh process (1 CPU device), as a user runs it.

  Shared by the end-to-end, evaluate-only and SIGKILL tests (test_train) and as
  the recorded-scores target of test_selection: read it, or copy it.
  """
  workdir = str(tmp_path_factory.mktemp("main"))
  result = helpers.run_main(workdir, *helpers.MAIN_RUN_FLAGS)
  assert result.returncode == 0, result.stderr[-3000:]
  return TrainedRun(workdir, None, helpers.read_metrics(workdir)[-1], log=result.stderr)
