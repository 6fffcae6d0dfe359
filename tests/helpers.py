"""Shared test helpers: configs and running main.py as a user would."""

import json
import os
import subprocess
import sys

import ml_collections

from configs import test as test_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  """configs/test.py with dotted-name overrides, e.g. {"loss.name": "focal"}."""
  config = test_config.get_config()
  config.unlock()
  for name, value in overrides.items():
    *parents, leaf = name.split(".")
    node = config
    for parent in parents:
      node = node[parent]
    try:
      node[leaf] = value
    except TypeError:  # ConfigDict is type-safe; a wrong type must replace the field.
      del node[leaf]
      node[leaf] = value
  return config


def main_command(workdir: str, *flags: str, config: str = "configs/test.py") -> list[str]:
  return [sys.executable, os.path.join(REPO, "main.py"), f"--config={os.path.join(REPO, config)}",
          f"--workdir={workdir}", *flags]


def run_main(workdir: str, *flags: str, config: str = "configs/test.py",
             timeout: float = 300) -> subprocess.CompletedProcess:
  """Runs main.py in a fresh process (1 CPU device, as a user would)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run(main_command(workdir, *flags, config=config), cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]
