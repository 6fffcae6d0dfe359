"""Seconds of the report's conformal section at K = 10 and K = 1,000 on 50,000 test rows.

  python -m benchmarks.conformal_speed                       # K = 10 and 1,000, the targets
  python -m benchmarks.conformal_speed --classes=10 --test=2000 --val=500 --repeats=1  # smoke
  python -m benchmarks.conformal_speed --json=conformal_speed.json

What is timed is what the conformal prediction sets add to a report
(`report.conformal_section`, docs/evaluation.md#conformal-prediction-sets), with the default
config's settings (lac, aps and raps at alpha = 0.1, not randomised, `bootstrap_resamples` =
1000): the probabilities before and after the chosen map (a temperature map here), every
threshold from the validation rows, each test row's coverage and set size, the summaries and
the bootstrap intervals, whose resamples' row counts the report's other intervals recorded
already (drawn here untimed, as the report's before-TS intervals draw them), with one BLAS
thread, as the report holds (`posthoc.one_blas_thread`). Each number is
the median of `--repeats` calls: the section's wall-clock and CPU seconds (the process's
own: on a shared machine nearer to what an idle one takes than the wall clock), the part that
`conformal.split_conformal` takes (both probabilities) and the section's time when it draws
its resamples itself.

The logits are generated (timing only): 10,000 validation rows (ImageNet's carve-out in
configs/imagenet.py) and 50,000 test rows (its test set), a one-hot bump plus noise. The
targets: 0.05 s at K = 10, 1 s at K = 1,000. Timings on a shared machine are noisy: the load
average is printed beside them.
"""

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from configs import default
from cpjax.calibration import conformal, metrics, posthoc, report

TARGETS = {10: 0.05, 1000: 1.0}  # Seconds the section may add to a report at K classes.


def _generated(rows: int, num_classes: int, rng: np.random.Generator):
  labels = rng.integers(0, num_classes, rows)
  logits = rng.normal(size=(rows, num_classes)) * 1.5
  logits[np.arange(rows), labels] += 4.0
  return logits.astype(np.float32), labels


def _median_seconds(fn, repeats: int) -> tuple[float, float]:
  """(wall, CPU) seconds of `fn`, each the median of `repeats` calls."""
  wall, cpu = [], []
  for _ in range(repeats):
    started, cpu_started = time.perf_counter(), time.process_time()
    fn()
    wall.append(time.perf_counter() - started)
    cpu.append(time.process_time() - cpu_started)
  return statistics.median(wall), statistics.median(cpu)


def measure(num_classes: int, num_val: int, num_test: int, repeats: int,
            resamples: int) -> dict[str, float]:
  """Seconds (medians of `repeats`) of the section with the report's recorded resamples, of
  its split_conformal part, and of the section drawing its own resamples."""
  rng = np.random.default_rng(num_classes)
  val, test = _generated(num_val, num_classes, rng), _generated(num_test, num_classes, rng)
  config = default.get_config().evaluation
  config.bootstrap_resamples = resamples
  calibrator = posthoc.Calibrator("temperature", {"log_t": np.float64(np.log(1.5))},
                                  {"floor": posthoc.DEFAULT_FLOOR}, 0.0)
  table = report.PosthocTable({"chosen": "temperature"}, calibrator,
                              posthoc.apply(calibrator, test[0]))
  counts = []
  report._intervals(test[0], test[1], num_classes, config, counts_out=counts)  # pylint: disable=protected-access
  names, alphas = tuple(config.conformal_scores), conformal.alphas(config.conformal_alpha)

  def both_split_conformals():  # As the section calls it: logits, then log-probabilities.
    inputs = ((val[0], test[0], metrics.softmax),
              (posthoc.apply(calibrator, val[0]), table.test_log_probs, np.exp))
    for val_rows, test_rows, transform in inputs:
      conformal.split_conformal((val_rows, val[1]), (test_rows, test[1]), names, alphas,
                                {"raps": conformal.keywords("raps", config)},
                                transform=transform)
  with posthoc.one_blas_thread():  # As the report runs it (report.build_report).
    section = _median_seconds(lambda: report.conformal_section(
        val, test, num_classes, config, table, None, counts), repeats)
    return {
        "section": section[0], "section_cpu": section[1],
        "split_conformal": _median_seconds(both_split_conformals, repeats)[0],
        "section_drawing_resamples": _median_seconds(lambda: report.conformal_section(
            val, test, num_classes, config, table), repeats)[0],
    }


def _machine() -> dict[str, str]:
  cpu = platform.processor() or "unknown"
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else cpu
  return {"cpu": cpu, "cores": str(os.cpu_count()), "numpy": np.__version__,
          "load_average": " ".join(f"{v:.2f}" for v in os.getloadavg()),
          "date": time.strftime("%Y-%m-%d")}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--classes", type=int, nargs="+", default=sorted(TARGETS),
                      help="K, one measurement each")
  parser.add_argument("--val", type=int, default=10000, help="validation rows")
  parser.add_argument("--test", type=int, default=50000, help="test rows")
  parser.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples B")
  parser.add_argument("--repeats", type=int, default=3, help="calls per number (the median)")
  parser.add_argument("--json", default="", help="also write the numbers here")
  args = parser.parse_args()
  machine = _machine()
  print(f"{machine['cpu']}, {machine['cores']} cores, load average {machine['load_average']}; "
        f"{args.val} validation and {args.test} test rows, B = {args.resamples}")
  print(f"{'K':>6} {'section s':>10} {'its CPU s':>10} {'target s':>9} {'met':>4} "
        f"{'split_conformal s':>18} {'drawing resamples s':>20}")
  rows = {}
  for num_classes in args.classes:
    seconds = measure(num_classes, args.val, args.test, args.repeats, args.resamples)
    target = TARGETS.get(num_classes)
    met = "" if target is None else ("yes" if seconds["section"] <= target else "no")
    rows[str(num_classes)] = {**seconds, "target": target}
    print(f"{num_classes:>6} {seconds['section']:>10.3f} {seconds['section_cpu']:>10.3f} "
          f"{'' if target is None else f'{target:.2f}':>9} {met:>4} "
          f"{seconds['split_conformal']:>18.3f} {seconds['section_drawing_resamples']:>20.3f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"machine": machine, "args": vars(args), "seconds": rows}, f, indent=1)


if __name__ == "__main__":
  main()
