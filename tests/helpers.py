"""Shared test helpers: configs, running main.py as a user would, the real-data guard."""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import ml_collections
import orbax.checkpoint as ocp
import pytest

from configs import test as test_config
from cpjax.data.datasets import fashion_mnist_local

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRE_REAL_DATA = "CPJAX_REQUIRE_REAL_DATA"  # "1" (CI): a missing real dataset fails.
FASHION_MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                       "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
FASHION_MNIST_MISSING = ("Debian's dataset-fashion-mnist is not installed "
                         "(apt-get install dataset-fashion-mnist to run this test)")
STEPS_PER_EPOCH = -(-1257 // 64)  # configs/test.py: 1,257 training digits in batches of 64.
# tests/trained_runs.py's main.py run: 4 full epochs of configs/test.py, recording scores.
MAIN_RUN_FLAGS = ("--config.num_epochs=4", "--config.selection.record_scores=True")
# The gamma-Net run of the `meta_run` fixture (configs/test.py overrides).
META_RUN = {"loss.name": "flgamma_dece", "dataset.meta_val_size": 128, "keep_checkpoints": 10}


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  """configs/test.py with dotted-name overrides, e.g. tiny_config(**{"loss.name": "focal"}).

  ml_collections applies the overrides with its own type checks (an int becomes
  a float where the field is a float); a typo in a name raises KeyError.
  """
  config = test_config.get_config()
  config.lock()  # Overrides may change fields, not add them.
  config.update_from_flattened_dict(overrides)
  config.unlock()
  return config


# configs/test.py, 3 epochs: 1 on all 1,257 rows, then 2 on the top half by train-pass entropy.
# The subset (628 rows, 10 steps) is smaller than the full epoch (20 steps).
SELECTED = {"num_epochs": 3, "selection.method": "top_k", "selection.fraction": 0.5,
            "selection.warmup_epochs": 1, "selection.record_scores": True,
            "keep_checkpoints": 10}
SELECTED_FLAGS = tuple(f"--config.{name}={value}" for name, value in SELECTED.items())


def selected_config(**overrides) -> ml_collections.ConfigDict:
  """SELECTED (above) as a config, with further overrides."""
  return tiny_config(**{**SELECTED, **overrides})


def subprocess_env(devices: int | None = None, **extra: str) -> dict[str, str]:
  """This process's environment for a child JAX process: `devices` forced CPU devices (None:
  JAX's default, 1), the suite's compile flags (conftest's TEST_XLA_FLAGS) kept, plus `extra`."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if devices is not None:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  # This interpreter's bin first: scripts that call `python3` (the SLURM stand-ins) find the
  # same environment even when its virtualenv is not activated.
  path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
  return {**os.environ, "XLA_FLAGS": " ".join(flags), "PATH": path, **extra}


def main_command(workdir: str, *flags: str, config: str = "configs/test.py") -> list[str]:
  return [sys.executable, os.path.join(REPO, "main.py"), f"--config={os.path.join(REPO, config)}",
          f"--workdir={workdir}", *flags]


def run_main(workdir: str, *flags: str, config: str = "configs/test.py",
             timeout: float = 300) -> subprocess.CompletedProcess:
  """Runs main.py in a fresh process (1 CPU device, as a user would; compiled at the suite's
  level, conftest's TEST_XLA_FLAGS)."""
  return subprocess.run(main_command(workdir, *flags, config=config), cwd=REPO,
                        env=subprocess_env(),
                        capture_output=True, text=True, timeout=timeout)


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def without_timing(records: list[dict]) -> list[dict]:
  """metrics.jsonl records without their wall-clock fields, the devices' peak memory and the
  provenance of a sitting's first record (its start time, and a resumed run's sittings
  start at other epochs): they differ between any two runs."""
  return [{k: v for k, v in r.items() if not k.endswith("_seconds") and not k.startswith("perf/")
           and k != "provenance"} for r in records]


def require_fashion_mnist() -> str:
  """The folder of Debian's Fashion-MNIST, for a test that reads the real dataset.

  When the files are absent the test is skipped, saying how to get them; with
  CPJAX_REQUIRE_REAL_DATA=1 (as CI sets) it fails instead, so a real-data test
  never silently stops running. Call it first in every test or fixture that
  reads /usr/share/datasets/fashion-mnist.
  """
  folder = fashion_mnist_local.DEFAULT_DIR  # Read at call time: a test may point it elsewhere.
  if all(any(os.path.exists(os.path.join(folder, name + ext)) for ext in (".gz", ""))
         for name in FASHION_MNIST_FILES):
    return folder
  if os.environ.get(REQUIRE_REAL_DATA) == "1":
    pytest.fail(FASHION_MNIST_MISSING, pytrace=False)
  pytest.skip(FASHION_MNIST_MISSING)


REQUIRE_TENSORFLOW = "CPJAX_REQUIRE_TENSORFLOW"  # "1" (CI): TensorFlow missing fails.
TENSORFLOW_MISSING = ("TensorFlow is not installed (optional: `pip install -r "
                      "requirements-tf.txt`, as the README's test command does)")


def require_tensorflow() -> None:
  """For a test that needs TensorFlow (a tfds dataset of encoded images to build, TensorFlow's
  own summaries or crop decode as the reference): skipped, saying how to install it, where it
  is absent; with CPJAX_REQUIRE_TENSORFLOW=1 (as CI sets) it fails instead."""
  if importlib.util.find_spec("tensorflow") is not None:
    return
  if os.environ.get(REQUIRE_TENSORFLOW) == "1":
    pytest.fail(TENSORFLOW_MISSING, pytrace=False)
  pytest.skip(TENSORFLOW_MISSING)


def free_port() -> int:
  """A TCP port free on 127.0.0.1 right now (for a jax.distributed coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def restore_checkpoint(workdir: str, step: int | None = None) -> dict:
  """A run's checkpoint state (latest, or `step`) as saved, onto one local device, whatever
  topology saved it; read with orbax directly, not through cpjax's Checkpointer."""
  manager = ocp.CheckpointManager(
      os.path.join(workdir, "checkpoints"),
      item_handlers={"state": ocp.StandardCheckpointHandler(),
                     "meta": ocp.JsonCheckpointHandler()})
  step = step or manager.latest_step()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                        manager.item_metadata(step)["state"])
  return manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target)))["state"]


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of a run's checkpoints, oldest first (read with orbax directly)."""
  return sorted(ocp.CheckpointManager(os.path.join(workdir, "checkpoints")).all_steps())


def run_processes(code: str, args: list[list[str]], env: dict[str, str] | None = None,
                  timeout: float = 240) -> list[tuple[dict, str]]:
  """Runs `python -c code` once per argument list, side by side, as the processes of one JAX
  job on CPU with a coordinator on 127.0.0.1 (env REPO, COORDINATOR, JAX_PLATFORMS=cpu, plus
  `env`); each must exit 0 and print one line "RESULT <json>". Returns (result, stderr) each."""
  env = subprocess_env(REPO=REPO, COORDINATOR=f"127.0.0.1:{free_port()}", JAX_PLATFORMS="cpu",
                       **(env or {}))
  procs = [subprocess.Popen([sys.executable, "-c", code, *a], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for a in args]
  results = []
  for proc in procs:
    try:
      stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
    assert proc.returncode == 0, stderr[-3000:]
    (line,) = [s for s in stdout.splitlines() if s.startswith("RESULT ")]
    results.append((json.loads(line[len("RESULT "):]), stderr))
  return results


def sigkill_once_saved(workdir: str, flags, step: int, env: dict[str, str]) -> None:
  """Starts main.py on `workdir`, SIGKILLs it as soon as its checkpoint at global `step` is on
  disk (no chance to clean up), and checks that it was killed, not finished."""
  proc = subprocess.Popen(main_command(workdir, *flags), cwd=REPO, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  saved = os.path.join(workdir, "checkpoints", str(step))
  deadline = time.monotonic() + 240
  while not os.path.isdir(saved) and time.monotonic() < deadline:
    assert proc.poll() is None, f"the run ended before its checkpoint at step {step}"
    time.sleep(0.02)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL and os.path.isdir(saved)
