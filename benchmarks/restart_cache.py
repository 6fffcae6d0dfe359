"""Time from process start to the first finished step: a fresh start vs a restart that finds
its compiled programs in the persistent compilation cache.

  python -m benchmarks.restart_cache                          # ResNet-18 on digits (default)
  python -m benchmarks.restart_cache --config=configs/test.py --json=out.json

Runs `main.py` on one config in fresh processes, one after the other: first with an empty
cache directory (it compiles every program and writes it to the cache), then `--repeats`
restarts with that cache (each loads the programs instead of compiling them). Each run logs
its train metrics after step 1 (`log_every_steps=1`): that line comes after a host read of
the step's metrics, so the step has finished; the time from starting the process to that line
is the measure, and the process is then stopped. Both sides do the same work (interpreter,
imports, data, initialisation, the first step) and differ only in compiling, so their ratio
from one run of this script is the restart speed-up. Each run trains in a workdir of its own,
so a restart does not also restore a checkpoint.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks import throughput

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_ONE = re.compile(r"\[1\] .*train/loss")
STARTED = re.compile(r"JAX process \d+ / \d+")  # main.py's first line, after its imports.


def _time_to_first_step(config: str, workdir: str, cache: str, flags: list[str],
                        timeout: float) -> dict[str, float]:
  """Seconds from starting main.py to its first log line (imports done) and to its log line
  of step 1's metrics; then stops it."""
  env = {k: v for k, v in os.environ.items()  # The config's cache directory, not a user's.
         if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
  command = [sys.executable, os.path.join(REPO, "main.py"), f"--config={config}",
             f"--workdir={workdir}", "--config.log_every_steps=1", "--config.num_epochs=1",
             f"--config.compilation_cache_dir={cache}", *flags]
  start = time.perf_counter()
  proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  lines, started = [], None
  try:
    for line in proc.stderr:
      lines.append(line)
      if started is None and STARTED.search(line):
        started = time.perf_counter() - start
      if STEP_ONE.search(line):
        return {"first_step": time.perf_counter() - start, "imports": started}
      if time.perf_counter() - start > timeout:
        break
  finally:
    proc.kill()
    proc.wait()
  raise RuntimeError("main.py ended or timed out before step 1:\n" + "".join(lines[-30:]))


def measure(config: str, repeats: int, flags: list[str], timeout: float) -> dict:
  with tempfile.TemporaryDirectory(prefix="cpjax-restart-") as root:
    cache = os.path.join(root, "xla")
    fresh = _time_to_first_step(config, os.path.join(root, "fresh"), cache, flags, timeout)
    entries = len(os.listdir(cache))
    restarts = [_time_to_first_step(config, os.path.join(root, f"restart{i}"), cache, flags,
                                    timeout) for i in range(repeats)]
  best = min(restarts, key=lambda r: r["first_step"])
  return {"fresh_seconds": fresh, "restart_seconds": restarts, "cache_entries": entries,
          "speedup": fresh["first_step"] / best["first_step"],
          "speedup_after_imports": ((fresh["first_step"] - fresh["imports"])
                                    / (best["first_step"] - best["imports"]))}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default=os.path.join(REPO, "configs", "default.py"))
  parser.add_argument("--repeats", type=int, default=2, help="Restarts timed (best is used).")
  parser.add_argument("--timeout", type=float, default=1200.0, help="Per run, seconds.")
  parser.add_argument("--flag", action="append", default=[],
                      help="Extra main.py flag, e.g. --flag=--config.model.name=resnet20.")
  parser.add_argument("--json", default="", help="Also write the results to this file.")
  args = parser.parse_args()
  if args.repeats < 1:
    parser.error(f"--repeats={args.repeats}: at least 1")
  load_before = os.getloadavg()
  results = measure(args.config, args.repeats, args.flag, args.timeout)
  results.update(machine=throughput.machine(), args=vars(args),
                 load_average_before=load_before, load_average_after=os.getloadavg())
  fresh = results["fresh_seconds"]
  print(f"fresh start to step 1:  {fresh['first_step']:6.1f} s (imports {fresh['imports']:.1f} s;"
        f" {results['cache_entries']} programs written to the cache)")
  for restart in results["restart_seconds"]:
    print(f"restart to step 1:      {restart['first_step']:6.1f} s (imports "
          f"{restart['imports']:.1f} s)")
  print(f"speed-up (fresh / best restart): {results['speedup']:.2f}x; after the imports: "
        f"{results['speedup_after_imports']:.2f}x")
  throughput.write_json(args.json, results)


if __name__ == "__main__":
  main()
