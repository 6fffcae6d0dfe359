"""Where a run's records came from: the code, the machine, the time, the config and its seeds.

`gather` is called once at a run's start-up (cpjax.training.setup.setup_run); the first
metrics.jsonl record each sitting of a run writes, report/results.json and every study
record carry what it returns (docs/evaluation.md). Its keys:

  code             {"commit": the git commit of the checkout cpjax is imported from, "dirty":
                   whether its tracked files had changes (or "unknown")}; outside a checkout
                   {"package_version": the installed cpjax's}; {"unknown": why} else
  started_utc      the process's start, ISO 8601 in UTC
  host             the host name
  platform         JAX's backend (cpu, gpu, tpu); device_kind, device_count: its devices
  cpu, cpu_count   the processor's model name and the cores
  jax, flax        their versions
  config_sha256    sha256 of the config as every checkpoint saves it
                   (`config.to_json_best_effort(sort_keys=True)`)
  seeds            every config field named `seed` or `*_seed`, by dotted name (a field added
                   later is found by its name)
  label_noise      the label-noise draw (given by the caller: cpjax.data.splits.noise_draw)

Asking git never fails a run: a missing git, a folder that is no checkout of cpjax or a
slow `git status` (GIT_TIMEOUT_S) only changes what `code` says.
"""

import datetime
import hashlib
import importlib.metadata
import os
import platform as platform_module
import socket
import subprocess
from typing import Any

import flax
import jax
import ml_collections

PACKAGE = "cpjax"
GIT_TIMEOUT_S = 10.0
# The checkout's root: the folder that holds the cpjax package.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gather(config: ml_collections.ConfigDict, started: float,
           label_noise: dict[str, Any] | None = None) -> dict[str, Any]:
  """The provenance of a run of `config` whose process started at `started` (time.time()),
  with the label-noise draw it trains on."""
  devices = jax.devices()
  out = {"code": code_version(), "started_utc": utc_text(started),
         "host": socket.gethostname(), "platform": jax.default_backend(),
         "device_kind": devices[0].device_kind, "device_count": len(devices),
         "cpu": cpu_model(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
         "flax": flax.__version__, "config_sha256": config_digest(config),
         "seeds": seeds(config)}
  if label_noise is not None:
    out["label_noise"] = label_noise
  return out


def utc_text(seconds: float) -> str:
  """'2026-11-28T19:02:03Z': a time.time() value in UTC, to the second."""
  moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
  return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def config_digest(config: ml_collections.ConfigDict) -> str:
  """sha256 of the config as a checkpoint's metadata holds it (its "config"), so that the
  digest of a record can be checked against the run's checkpoints."""
  text = config.to_json_best_effort(sort_keys=True)
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seeds(config: ml_collections.ConfigDict) -> dict[str, int]:
  """Every field named `seed` or ending in `_seed`, by dotted name."""
  return {name: value for name, value in _leaves(config.to_dict()).items()
          if name.rsplit(".", 1)[-1] == "seed" or name.endswith("_seed")}


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_leaves(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def code_version(root: str = _ROOT) -> dict[str, Any]:
  """The code cpjax runs from: a git checkout's commit and whether its tracked files had
  changes, else the installed package's version, else why neither is known."""
  commit = _git(root, "rev-parse", "HEAD") if _is_checkout(root) else None
  if commit:
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": "unknown" if status is None else bool(status)}
  try:
    return {"package_version": importlib.metadata.version(PACKAGE)}
  except importlib.metadata.PackageNotFoundError:
    return {"unknown": f"{root} is no git checkout of {PACKAGE}, and {PACKAGE} is not installed"}


def code_text(code: dict[str, Any] | None) -> str:
  """A code version in a line: 'abc1234def0', 'abc1234def0 with changes', 'cpjax 0.3.0' or
  'not recorded'."""
  if not code:
    return "not recorded"
  if "commit" in code:
    dirty = {True: " with changes", "unknown": " (changes unknown)"}.get(code["dirty"], "")
    return f"{code['commit'][:12]}{dirty}"
  if "package_version" in code:
    return f"{PACKAGE} {code['package_version']}"
  return "unknown"


def _is_checkout(root: str) -> bool:
  """Whether `root` is the top of a git work tree (not a folder inside another repository)."""
  top = _git(root, "rev-parse", "--show-toplevel")
  return top is not None and os.path.realpath(top) == os.path.realpath(root)


def _git(root: str, *args: str) -> str | None:
  """git's stripped output in `root`, or None where git is missing, fails or is too slow."""
  try:
    done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                          timeout=GIT_TIMEOUT_S, check=False)
  except (OSError, subprocess.SubprocessError):
    return None
  return done.stdout.strip() if done.returncode == 0 else None


def cpu_model() -> str:
  """The processor's model name (/proc/cpuinfo), else what `platform` says."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      return next(line.split(":", 1)[1].strip() for line in f
                  if line.startswith("model name"))
  except (OSError, StopIteration):
    return platform_module.processor() or platform_module.machine()
