"""The shared trained runs: a pytest plugin that the test modules reading them require
(`pytest_plugins`). Each run is trained once per pytest run (per pytest-xdist worker; the tests
that read one run form a group on one worker, see conftest.py) and its tests only read its
workdir, or copy it.

Kept out of conftest.py so that only the modules that train import cpjax.training.train, and with it
TensorFlow (cpjax.training.evaluation's clu.metric_writers imports TensorFlow's summary writer): the
pytest-xdist controller, which collects no tests, and a run of other test files start without.
"""

import dataclasses
import functools

import pytest

from cpjax import steps
from cpjax.training import setup, train
from tests import helpers


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
  real_step, real_jit = steps.train_step, setup.jit_train_step

  @functools.wraps(real_step)
  def counted_step(*args, **kwargs):
    traces.append(1)  # Runs once per trace, never per call of the compiled step.
    return real_step(*args, **kwargs)

  def captured_jit(*args):
    jitted.append(real_jit(*args))
    return jitted[-1]

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(steps, "train_step", counted_step)
    patch.setattr(setup, "jit_train_step", captured_jit)
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
