"""Cost of the calibration metrics and the bootstrap on 10,000 x 100 probabilities.

  python -m benchmarks.metrics_speed [--n=10000] [--k=100] [--resamples=1000] [--json=PATH]

Random logits (timing only). Each metric is timed as the median of 5 calls;
the bootstrap is one call of B = 1000 resamples.
"""

import argparse
import json
import statistics
import time

import numpy as np

from cpjax.calibration import bootstrap, metrics


def _median_seconds(fn, repeats: int = 5) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(n: int = 10000, k: int = 100, resamples: int = 1000) -> dict[str, float]:
  """Seconds per metric call (median of 5) and per bootstrap of `resamples` resamples."""
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(n, k)) * 3
  labels = rng.integers(0, k, n)
  probs = metrics.softmax(logits)
  timings = {
      "ece": lambda: metrics.ece(probs, labels),
      "adaptive_ece": lambda: metrics.adaptive_ece(probs, labels),
      "classwise_ece": lambda: metrics.classwise_ece(probs, labels, k),
      "mce": lambda: metrics.mce(probs, labels),
      "smooth_ece": lambda: metrics.smooth_ece(probs, labels),
      "nll": lambda: metrics.nll(logits, labels),
      "brier": lambda: metrics.brier(probs, labels),
      "top5": lambda: metrics.top_k_accuracy(probs, labels, 5),
  }
  seconds = {name: _median_seconds(fn) for name, fn in timings.items()}
  seconds["all_metrics"] = sum(seconds.values())
  for name, fn in (("ece", metrics.ece), ("adaptive_ece", metrics.adaptive_ece)):
    start = time.perf_counter()
    bootstrap.bootstrap_interval(fn, (probs, labels), num_resamples=resamples)
    seconds[f"bootstrap_{name}"] = time.perf_counter() - start
  return seconds


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=10000, help="examples")
  parser.add_argument("--k", type=int, default=100, help="classes")
  parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples B")
  parser.add_argument("--json", default="", help="also write the seconds here")
  args = parser.parse_args()
  seconds = measure(args.n, args.k, args.resamples)
  for name, value in seconds.items():
    if name.startswith("bootstrap_"):
      print(f"bootstrap {args.resamples} x {name[10:]:<13}{value:>7.2f} s")
    else:
      print(f"{name:<16}{value * 1000:>9.1f} ms")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"n": args.n, "k": args.k, "resamples": args.resamples, "seconds": seconds}, f,
                indent=1)


if __name__ == "__main__":
  main()
