"""Where cpjax's train step spends its time: a jax.profiler trace, grouped by kind of op.

  python -m benchmarks.profile_step --model=resnet18 --batch-size=128

Traces `--steps` calls of the compiled train step (the same one `throughput.py`
times) with `jax.profiler`, reads the Perfetto JSON the profiler writes, matches
each executed XLA op (one trace event per thunk on CPU, per kernel on GPU where
the names match the HLO) to its instruction in the compiled HLO, and sums the
time per category:

  conv forward           a convolution from the forward pass
  conv input-grad        the backward convolution w.r.t. the input (stride 1)
  conv input-grad, lhs-dilated
                         the same for a strided conv: XLA writes it as a
                         convolution over a zero-dilated input
  conv weight-grad       the backward convolution w.r.t. the kernel (its window
                         is the whole feature map)
  layout transpose/copy  fusions that transpose or copy an array into another
                         layout (with whatever elementwise work was fused in)
  dot                    matrix multiplies (the classifier head)
  reduction fusion       fusions that reduce (batch-norm statistics, loss sums)
  elementwise fusion     everything else that was fused

Prints ms per step per category, their share of the summed op time, the
top ops, and the wall time per step. Ops on different threads can overlap,
so the summed op time may differ from the wall time; the table says both.
"""

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time

import jax

from benchmarks import throughput
from cpjax import models
from cpjax.runtime import compiler_options

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? ([a-z][a-z0-9-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) ")
_WINDOW = re.compile(r"window=\{size=(\d+)x(\d+)")
_OUTPUT_SPATIAL = re.compile(r"= \w+\[\d+,(\d+),(\d+),\d+\]")


def _conv_category(line: str) -> str:
  """Classifies one HLO convolution line (NHWC `b01f` outputs, as Flax emits)."""
  window = _WINDOW.search(line)
  spatial = _OUTPUT_SPATIAL.search(line)
  # A weight gradient convolves the input with the output gradient: its window is the feature
  # map and its output is kernel-sized, so the window is larger than the output.
  if window and spatial and int(window.group(1)) > int(spatial.group(1)):
    return "conv weight-grad"
  if "lhs_dilate" in line:
    return "conv input-grad, lhs-dilated"
  if "transpose(" in line:  # op_name metadata of a backward-pass op
    return "conv input-grad"
  if "jvp(" in line:
    return "conv forward"
  return "conv (no metadata)"


def categorize(hlo_text: str) -> dict[str, str]:
  """Maps every instruction name of a compiled HLO module to one category."""
  computations: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)
  current = None
  for line in hlo_text.splitlines():
    if not line.startswith(" "):
      match = _COMPUTATION.match(line)
      current = match.group(1) if match else current
      continue
    match = _INSTRUCTION.match(line)
    if match and current:
      computations[current].append((match.group(1), match.group(2), line))

  def category_of(opcode: str, line: str, name: str) -> str:
    if opcode == "convolution":
      return _conv_category(line)
    if opcode == "fusion":
      called = re.search(r"calls=%(\S+?)[,\s]", line + " ")
      body = computations.get(called.group(1), []) if called else []
      opcodes = {op for _, op, _ in body}
      if "convolution" in opcodes:
        return next(_conv_category(text) for _, op, text in body if op == "convolution")
      if "dot" in opcodes:
        return "dot"
      if "transpose" in opcodes or name.startswith(("transpose", "copy")):
        return "layout transpose/copy"
      if opcodes & {"reduce", "reduce-window"}:
        return "reduction fusion"
      return "elementwise fusion"
    if opcode in ("transpose", "copy"):
      return "layout transpose/copy"
    if opcode == "dot":
      return "dot"
    return opcode

  return {name: category_of(opcode, line, name)
          for body in computations.values() for name, opcode, line in body}


def op_seconds(trace_dir: str) -> collections.Counter:
  """Total duration per event name in the profiler's Perfetto trace (seconds)."""
  files = sorted(glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True))
  if not files:
    raise FileNotFoundError(f"jax.profiler wrote no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(files[-1]) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  totals = collections.Counter()
  for event in events:
    if event.get("ph") == "X":
      totals[event["name"]] += event.get("dur", 0) / 1e6
  return totals


def profile(model_name: str, batch_size: int, image_size: int, steps: int,
            xla_cpu_options: str = "tuned") -> dict:
  """Wall time and categorised op time per train step."""
  _, _, state, step, batch, lr = throughput.train_setup(model_name, batch_size, image_size,
                                                        xla_cpu_options)
  compiled = step.lower(state, batch, lr, {}).compile()
  categories = categorize(compiled.as_text())
  state, metrics, _ = compiled(state, batch, lr, {})  # Warm-up.
  jax.block_until_ready(metrics)
  walls = []
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        start = time.perf_counter()
        state, metrics, _ = compiled(state, batch, lr, {})
        jax.block_until_ready(metrics)
        walls.append(time.perf_counter() - start)
    totals = op_seconds(trace_dir)
  ops = {name: seconds / steps for name, seconds in totals.items() if name in categories}
  by_category = collections.Counter()
  for name, seconds in ops.items():
    by_category[categories[name]] += seconds
  top = sorted(ops.items(), key=lambda item: -item[1])[:15]
  return {"wall_seconds_per_step": statistics.median(walls),
          "op_seconds_per_step": sum(ops.values()),
          "by_category": dict(by_category.most_common()),
          "top_ops": [{"name": n, "category": categories[n], "seconds": s} for n, s in top]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="resnet18", choices=sorted(models.MODELS))
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--xla-cpu-options", default="tuned", choices=compiler_options.PRESETS)
  parser.add_argument("--json", default="", help="Also write the results to this file.")
  args = parser.parse_args()
  results = {"machine": throughput.machine(), "args": vars(args),
             **profile(args.model, args.batch_size, args.image_size, args.steps,
                        args.xla_cpu_options)}
  op_total = results["op_seconds_per_step"]
  print(json.dumps(results["machine"]))
  print(f"wall per step {1e3 * results['wall_seconds_per_step']:.1f} ms; "
        f"summed op time {1e3 * op_total:.1f} ms")
  print(f"{'category':<32}{'ms/step':>10}{'share':>8}")
  for category, seconds in results["by_category"].items():
    print(f"{category:<32}{1e3 * seconds:>10.1f}{seconds / op_total:>8.1%}")
  print(f"\n{'top op':<40}{'category':<32}{'ms/step':>10}")
  for op in results["top_ops"]:
    print(f"{op['name']:<40}{op['category']:<32}{1e3 * op['seconds']:>10.1f}")
  throughput.write_json(args.json, results)


if __name__ == "__main__":
  main()
