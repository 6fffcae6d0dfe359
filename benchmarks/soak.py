"""Soak run: memory over a long run of the real trainer (a benchmark, not a test).

  python -m benchmarks.soak --epochs=50
  python -m benchmarks.soak --epochs=10 --out=benchmarks/results/soak_test_10.json

Trains `configs/test.py` with selection on (top_k, half of the rows by train-pass entropy
after 1 warm-up epoch, scores recorded) for `--epochs` epochs through
`train.train_and_evaluate`, in this process, and samples after each epoch (when its record
reaches metrics.jsonl) the process's resident memory (host RSS, /proc via psutil) and each
local device's `memory_stats()` bytes in use (None on backends without them, e.g. CPU).
Reports the RSS growth per epoch over the epochs after `--skip` (the first epochs compile
and fill caches) as the least-squares slope and as the median single-epoch step (robust to
the allocator handing memory back now and then), and the largest single-epoch step.
A leak of one batch per epoch would show as a slope of at least the batch's bytes.
"""

import argparse
import json
import os
import tempfile
import threading
import time

import jax
import numpy as np
import psutil

from configs import test as test_config
from cpjax.training import train


def _config(epochs: int):
  config = test_config.get_config()
  config.num_epochs = epochs
  config.selection.method, config.selection.fraction = "top_k", 0.5
  config.selection.warmup_epochs, config.selection.record_scores = 1, True
  config.evaluation.bootstrap_resamples = 10  # The final report is not what is measured.
  return config


def _device_bytes() -> list[int | None]:
  stats = [d.memory_stats() for d in jax.local_devices()]
  return [None if s is None else int(s.get("bytes_in_use", 0)) for s in stats]


class _Sampler(threading.Thread):
  """Samples memory each time metrics.jsonl gains an epoch record."""

  def __init__(self, workdir: str):
    super().__init__(daemon=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.samples, self.done = [], threading.Event()
    self.process = psutil.Process()

  def _epochs(self) -> int:
    try:
      with open(self.path) as f:
        return sum(1 for line in f if line.strip())
    except OSError:
      return 0

  def run(self):
    while not self.done.is_set():
      if self._epochs() > len(self.samples):
        self.samples.append({"epoch": len(self.samples), "time": time.time(),
                             "rss_mib": self.process.memory_info().rss / 2**20,
                             "device_bytes_in_use": _device_bytes()})
      time.sleep(0.05)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--epochs", type=int, default=50)
  parser.add_argument("--skip", type=int, default=5, help="epochs left out of the slope")
  parser.add_argument("--out", default="", help="JSON results file (default: print only)")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as workdir:
    sampler = _Sampler(workdir)
    sampler.start()
    start = time.time()
    train.train_and_evaluate(_config(args.epochs), workdir)
    seconds = time.time() - start
    time.sleep(0.3)  # The last record's sample.
    sampler.done.set()
    sampler.join()
  samples = sampler.samples
  rss = np.array([s["rss_mib"] for s in samples])
  tail = np.arange(len(rss))[args.skip:]
  slope = float(np.polyfit(tail, rss[args.skip:], 1)[0]) if len(tail) >= 2 else float("nan")
  result = {"epochs": args.epochs, "seconds": seconds, "skip": args.skip,
            "rss_mib_first": float(rss[0]), "rss_mib_last": float(rss[-1]),
            "rss_mib_growth_per_epoch": slope,
            # Robust to the allocator handing memory back now and then (a one-epoch drop).
            "rss_mib_median_epoch_step": float(np.median(np.diff(rss[args.skip:])))
            if len(tail) >= 2 else float("nan"),
            "rss_mib_largest_epoch_step": float(np.max(np.diff(rss[args.skip:])))
            if len(tail) >= 2 else float("nan"),
            "device": str(jax.devices()[0]), "samples": samples}
  print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
