"""Cost of fitting every post-hoc map, and of the report's post-hoc section.

  python -m benchmarks.posthoc_fits [--classes=100] [--rows=5000] [--test=10000]
                                    [--maps=matrix_scaling,dirichlet] [--reference[=900]]
                                    [--table] [--no-fits]
  python -m benchmarks.posthoc_fits --classes=1000 --rows=10000 --table --no-fits
  python -m benchmarks.posthoc_fits --logits=path.npz   # arrays val_z, val_y, test_z, test_y

Generated over-confident logits (z ~ 3 N(0, 1), labels drawn from softmax(z / 2)), or saved
logits. Prints, for each map, its fit (the 5-fold cross-validation included): seconds, the
objective, gradient and Hessian-vector evaluations (a count a busy machine does not change),
its CPU seconds (every thread's: XLA's threads count too),
the strength chosen, whether it converged and its test NLL. The first JAX fit of a map
compiles its solver (one compilation per map and data shape): its seconds include that, as
the report's do.

--reference[=SECONDS] also fits vector, matrix and Dirichlet scaling with the solver the JAX
fits replaced (SciPy, float64: posthoc.SCIPY_ODIR_SOLVER), each in a child process stopped
after SECONDS (default 900), and prints its seconds, evaluations and test NLL beside the JAX
fit's, or that it did not finish.

--table times the report's post-hoc section (`report.posthoc_table` with configs/default.py's
evaluation settings: every map's fit, test metrics and 200-resample intervals; matrix and
Dirichlet scaling skipped above `calibrator_square_max_classes`) and prints each map's
fit_seconds and the skipped maps; with --ratio also the report's before/after-TS intervals in
the same run, as a ratio.
"""

import argparse
import multiprocessing
import time

import jax
import numpy as np

from configs import default
from cpjax.calibration import metrics, posthoc, report

REFERENCE_MAPS = ("vector_scaling", "matrix_scaling", "dirichlet")


def _data(rng, n, k):
  z = rng.normal(size=(n, k)) * 3
  p = metrics.softmax(z / 2)
  return z, np.minimum((rng.uniform(size=(n, 1)) > np.cumsum(p, 1)).sum(1), k - 1)


def _fit(method, val, test, solver=None):
  """(seconds, CPU seconds, calibrator, test NLL) of one cross-validated fit."""
  start, cpu = time.perf_counter(), time.process_time()
  calibrator = posthoc.fit(method, *val, solver=solver)
  seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
  test_nll = metrics.nll(posthoc.apply(calibrator, test[0]), test[1])  # log p: its own logits.
  return seconds, cpu, calibrator, test_nll


def _reference(method, val, test):
  seconds, _, calibrator, test_nll = _fit(method, val, test, posthoc.SCIPY_ODIR_SOLVER)
  return seconds, calibrator.evaluations, calibrator.hyper.get("odir"), test_nll


def _line(method, seconds, cpu, calibrator, test_nll):
  strength = {k: v for k, v in calibrator.hyper.items() if k in ("odir", "num_bins")}
  return (f"fit {method:<22}{seconds:>8.2f} s {cpu:>8.2f} CPU s "
          f"{calibrator.evaluations:>8} evaluations  "
          f"{strength}  converged {calibrator.converged}  edge {calibrator.at_edge}  "
          f"cv_nll {calibrator.cv_nll:.4f}  test NLL {test_nll:.4f}")


def _fits(methods, val, test, reference_limit):
  total = total_cpu = 0.0
  for method in methods:
    seconds, cpu, calibrator, test_nll = _fit(method, val, test)
    total, total_cpu = total + seconds, total_cpu + cpu
    print(_line(method, seconds, cpu, calibrator, test_nll), flush=True)
    if reference_limit and method in REFERENCE_MAPS:
      print("    reference (SciPy, float64): "
            + _run_reference(method, val, test, reference_limit, test_nll), flush=True)
  print(f"fits: {total:.1f} s, {total_cpu:.1f} CPU s (every thread of the process) in all "
        f"({len(methods)} maps)")


def _run_reference(method, val, test, limit, test_nll):
  """The old solver's fit in a child process, given `limit` seconds."""
  with multiprocessing.get_context("spawn").Pool(1) as pool:
    pending = pool.apply_async(_reference, (method, val, test))
    try:
      seconds, evaluations, odir, old_nll = pending.get(timeout=limit)
    except multiprocessing.TimeoutError:
      pool.terminate()
      return f"did not finish in {limit:g} s"
  return (f"{seconds:.2f} s, {evaluations} evaluations, odir {odir}, test NLL {old_nll:.4f}; "
          f"JAX's test NLL {100 * (test_nll / old_nll - 1):+.2f} % of it")


def _table(val, test, ratio):
  config = default.get_config().evaluation
  num_classes = int(val[0].shape[1])
  start = time.perf_counter()
  section, _ = report.posthoc_table(val, test, num_classes, config)
  table = time.perf_counter() - start
  for method, row in section["calibrators"].items():
    if "skipped" in row:
      print(f"table {method:<22} skipped: {row['skipped']}")
    else:
      print(f"table {method:<22}{row['fit_seconds']:>8.2f} s fit  converged {row['converged']}"
            f"  test NLL {row['test']['nll']:.4f}")
  fits = sum(row.get("fit_seconds", 0.0) for row in section["calibrators"].values())
  print(f"post-hoc section (K = {num_classes}, {len(val[1])} validation and {len(test[1])} "
        f"test rows): {table:.1f} s, of which the fits {fits:.1f} s and the test metrics and "
        f"their {config.calibrator_resamples}-resample intervals {table - fits:.1f} s")
  if ratio:
    start = time.perf_counter()
    for t in (1.0, 2.0):  # The report's before/after-TS intervals: 3 metrics x B = 1000 each.
      report._intervals(test[0] / t, test[1], num_classes, config)  # pylint: disable=protected-access
    intervals = time.perf_counter() - start
    print(f"before/after-TS intervals {intervals:.1f} s; ratio {table / intervals:.2f}")


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", type=int, default=5000, help="validation rows")
  parser.add_argument("--test", type=int, default=10000, help="test rows")
  parser.add_argument("--classes", type=int, default=100)
  parser.add_argument("--maps", default=",".join(posthoc.MAPS))
  parser.add_argument("--logits", default="", help="an .npz of saved logits instead")
  parser.add_argument("--reference", type=float, nargs="?", const=900.0, default=0.0,
                      help="also the SciPy fits, each stopped after this many seconds")
  parser.add_argument("--table", action="store_true", help="time the report's post-hoc section")
  parser.add_argument("--ratio", action="store_true", help="and the before/after-TS intervals")
  parser.add_argument("--no-fits", action="store_true", help="skip the per-map fits")
  args = parser.parse_args()
  unknown = sorted(set(args.maps.split(",")) - set(posthoc.MAPS))
  if unknown:
    parser.error(f"--maps: {', '.join(unknown)} not in {', '.join(posthoc.MAPS)}")
  rng = np.random.default_rng(0)
  if args.logits:
    saved = np.load(args.logits)
    val, test = (saved["val_z"], saved["val_y"]), (saved["test_z"], saved["test_y"])
  else:
    val, test = _data(rng, args.rows, args.classes), _data(rng, args.test, args.classes)
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); K = "
        f"{val[0].shape[1]}, {len(val[1])} validation and {len(test[1])} test rows", flush=True)
  if not args.no_fits:
    _fits(args.maps.split(","), val, test, args.reference)
  if args.table:
    _table(val, test, args.ratio)


if __name__ == "__main__":
  main()
