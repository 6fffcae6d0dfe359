"""Cost of the calibration metrics and the bootstrap on 10,000 x 100 probabilities.

  python -m benchmarks.metrics_speed

Random logits (timing only). Each metric is timed as the median of 5 calls;
the bootstrap is one call of B = 1000 resamples.
"""

import statistics
import time

import numpy as np

from cpjax import bootstrap, metrics


def _median_seconds(fn, repeats: int = 5) -> float:
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(n: int = 10000, k: int = 100):
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
  total = 0.0
  for name, fn in timings.items():
    seconds = _median_seconds(fn)
    total += seconds
    print(f"{name:<16}{seconds * 1000:>9.1f} ms")
  print(f"{'all of the above':<16}{total * 1000:>9.1f} ms")
  for name, fn in (("ece", metrics.ece), ("adaptive_ece", metrics.adaptive_ece)):
    start = time.perf_counter()
    bootstrap.bootstrap_interval(fn, (probs, labels), num_resamples=1000)
    print(f"bootstrap 1000 x {name:<13}{time.perf_counter() - start:>7.2f} s")


if __name__ == "__main__":
  main()
