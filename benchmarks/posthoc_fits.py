"""Cost of fitting every post-hoc map, and of the report's post-hoc table.

  python -m benchmarks.posthoc_fits [--val=6000] [--test=10000] [--classes=10]

Synthetic over-confident logits (labels drawn from softmax(z / 2)). Prints each map's fit
time (5-fold cross-validation included; the fits are NumPy and SciPy, nothing compiles) and
the whole table's time (fits, test metrics, 200-resample intervals of every column) beside
the report's existing before/after-TS bootstrap on the same machine in the same run, as a
ratio.
"""

import argparse
import time

import numpy as np

from configs import default
from cpjax.calibration import metrics, posthoc, report


def _data(rng, n, k):
  z = rng.normal(size=(n, k)) * 3
  p = metrics.softmax(z / 2)
  return z, (rng.uniform(size=(n, 1)) > np.cumsum(p, 1)).sum(1)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--val", type=int, default=6000)
  parser.add_argument("--test", type=int, default=10000)
  parser.add_argument("--classes", type=int, default=10)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  val, test = _data(rng, args.val, args.classes), _data(rng, args.test, args.classes)
  for method in posthoc.METHODS:
    start = time.perf_counter()
    calibrator = posthoc.fit(method, *val)
    print(f"fit {method:<22}{time.perf_counter() - start:>7.2f} s  cv_nll "
          f"{calibrator.cv_nll:.4f}")
  config = default.get_config().evaluation
  start = time.perf_counter()
  report.posthoc_table(val, test, args.classes, config)
  table = time.perf_counter() - start
  start = time.perf_counter()
  for t in (1.0, 2.0):  # The report's before/after-TS intervals: 3 metrics x B = 1000 each.
    report._intervals(test[0] / t, test[1], args.classes, config)  # pylint: disable=protected-access
  intervals = time.perf_counter() - start
  print(f"post-hoc table {table:.1f} s; before/after-TS intervals {intervals:.1f} s; "
        f"ratio {table / intervals:.2f}")


if __name__ == "__main__":
  main()
