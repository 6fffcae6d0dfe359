"""Cost of fitting every post-hoc map, and of the report's post-hoc table.

  python -m benchmarks.posthoc_fits [--val=6000] [--test=10000] [--classes=10]
                                    [--maps=matrix_scaling,dirichlet] [--no-table]
  python -m benchmarks.posthoc_fits --logits=path.npz   # arrays val_z, val_y, test_z, test_y

Generated over-confident logits (labels drawn from softmax(z / 2)), or saved logits. Prints
each map's fit (5-fold cross-validation included; NumPy and SciPy, nothing compiles): its
seconds, its objective and Hessian-vector evaluations (a count a busy machine does not
change), the strength chosen, whether the fit converged and its test NLL; then the whole
table's time (fits, test metrics, 200-resample intervals of every column) beside the report's
existing before/after-TS bootstrap on the same machine in the same run, as a ratio.
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
  parser.add_argument("--maps", default=",".join(posthoc.MAPS))
  parser.add_argument("--logits", default="", help="an .npz of saved logits instead")
  parser.add_argument("--no-table", action="store_true")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  if args.logits:
    saved = np.load(args.logits)
    val, test = (saved["val_z"], saved["val_y"]), (saved["test_z"], saved["test_y"])
  else:
    val, test = _data(rng, args.val, args.classes), _data(rng, args.test, args.classes)
  for method in args.maps.split(","):
    start = time.perf_counter()
    calibrator = posthoc.fit(method, *val)
    seconds = time.perf_counter() - start
    test_nll = metrics.nll(posthoc.apply(calibrator, test[0]), test[1])  # log p: its own logits
    strength = {k: v for k, v in calibrator.hyper.items() if k in ("odir", "num_bins")}
    print(f"fit {method:<22}{seconds:>7.2f} s {calibrator.evaluations:>7} evaluations  "
          f"{strength}  converged {calibrator.converged}  edge {calibrator.at_edge}  "
          f"cv_nll {calibrator.cv_nll:.4f}  test NLL {test_nll:.4f}")
  if args.no_table:
    return
  config = default.get_config().evaluation
  start = time.perf_counter()
  report.posthoc_table(val, test, int(val[0].shape[1]), config)
  table = time.perf_counter() - start
  start = time.perf_counter()
  for t in (1.0, 2.0):  # The report's before/after-TS intervals: 3 metrics x B = 1000 each.
    report._intervals(test[0] / t, test[1], int(val[0].shape[1]), config)  # pylint: disable=protected-access
  intervals = time.perf_counter() - start
  print(f"post-hoc table {table:.1f} s; before/after-TS intervals {intervals:.1f} s; "
        f"ratio {table / intervals:.2f}")


if __name__ == "__main__":
  main()
