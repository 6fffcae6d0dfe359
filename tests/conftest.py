"""Test setup: 8 forced CPU devices before any JAX computation, and the shared fixtures.

Training runs are the slow part of the suite, so a run that several tests read is trained once
per pytest run: those fixtures are in tests/trained_runs.py, a plugin that the modules reading
them require (their tests must only read its workdir, or copy it).
"""

import gc
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# No garbage collection while JAX, TensorFlow and the test modules are imported: they create
# millions of long-lived objects and few cycles, and a full collection every time the heap
# grows by a quarter walked them all again (over a second of start-up in all).
# pytest_collection below turns it back on.
gc.disable()
# XLA:CPU compiles dominate the suite's time (the tiny net's init alone takes seconds), and
# many runs compile identical programs: a persistent compilation cache, fresh per pytest run
# (no state between runs), lets every run after the first load them. The variables reach the
# main.py runs of the tests and the pytest-xdist workers too (they start after this file is
# imported, so all share one cache). CPJAX_TEST_XLA_CACHE=<folder> (opt-in) keeps the cache
# there between pytest runs instead: a rerun loads what the last one compiled (an entry is
# keyed by the program, the compile options and the jax version, so an edit only misses; the
# folder grows with every edit and may be deleted at any time). A user's own
# JAX_COMPILATION_CACHE_DIR is used as it is, and never deleted.
_XLA_CACHE = None  # The fresh folder, deleted at the end of the pytest run.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  if os.environ.get("CPJAX_TEST_XLA_CACHE"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(os.environ["CPJAX_TEST_XLA_CACHE"])
  else:
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

from cpjax.data import input_pipeline  # pylint: disable=g-import-not-at-top
from tests import helpers  # pylint: disable=g-import-not-at-top


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
  """Garbage collection back on once the tests are collected (see gc.disable above), with every
  object alive then (JAX's, TensorFlow's, the test modules') frozen: out of the collector's
  sight. A full collection would walk them all again, about 0.4 s each time on a 2-core
  machine; Python runs one every so often, and pytest runs 5 at the end to find unraisable
  exceptions. Objects the tests create are collected as before."""
  del session
  try:
    return (yield)
  finally:
    gc.freeze()
    gc.enable()


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
