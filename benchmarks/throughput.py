"""Train and scoring throughput of cpjax's real jitted steps, optionally vs PyTorch.

  python -m benchmarks.throughput --model=resnet18 --batch-size=128 --compare-torch

Times `cpjax.steps.train_step` (augmentation, forward, loss, backward, SGD
update; state donated) and `cpjax.steps.score_step` (eval forward +
normalised entropy) in float32 and bfloat16, on random CIFAR-shaped inputs
(timing only: the values do not matter). Each rate is the median over
`--windows` timed windows of `--steps` steps after a warm-up window, each
window ending with `block_until_ready`. Compile time is the train step's
lower + compile. On a GPU, the train step's FLOPs (XLA cost analysis) give
model FLOPs utilisation against the device's peak. Prints a table and,
with --json, writes the numbers for scripts.
"""

import argparse
import functools
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

from configs import default
from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data import specs
from cpjax.runtime import compiler_options, sharding
from cpjax.selection import scores

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # Dense, per device.


def _config(model_name: str, batch_size: int):
  config = default.get_config()
  config.dataset.name = "cifar10"  # Image shape and normalisation only; no data is read.
  config.dataset.crop_padding, config.dataset.flip = 4, True
  config.model.name, config.batch_size = model_name, batch_size
  return config


def _rate(fn, images_per_call: int, windows: int, steps: int) -> float:
  """Median images/s over timed windows (after one warm-up window)."""
  rates = []
  for window in range(windows + 1):
    start = time.perf_counter()
    for _ in range(steps):
      out = fn()
    jax.block_until_ready(out)
    if window:
      rates.append(images_per_call * steps / (time.perf_counter() - start))
  return statistics.median(rates)


def random_batch(mesh, size: int, image_size: int, num_classes: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(0)
  host = {"image": rng.integers(0, 256, (size, image_size, image_size, 3), np.uint8),
          "label": rng.integers(0, num_classes, size).astype(np.int32),
          "id": np.arange(size, dtype=np.int32), "mask": np.ones(size, np.float32)}
  return sharding.to_global(mesh, {k: v[sharding.process_rows(mesh, size)]
                                   for k, v in host.items()}, size)


def train_setup(model_name: str, batch_size: int, image_size: int, xla_cpu_options: str,
                options: dict[str, str] | None = None):
  """(config, mesh, train state, jitted donated train step, batch, lr) on random inputs; the
  step compiles with the `xla_cpu_options` preset, or with `options` when given."""
  config = _config(model_name, batch_size)
  config.xla_cpu_options = xla_cpu_options
  spec = specs.DATASETS["cifar10"]
  mesh = sharding.create_mesh()
  model = models.create_model(model_name, spec.num_classes, "float32")
  tx = optim.create_optimizer(config.optimizer)
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx,
                                   (image_size, image_size, 3), mesh)
  step = jax.jit(functools.partial(steps.train_step, model=model, tx=tx,
                                   spec=steps.step_spec(config.dataset, config.loss),
                                   loss_fn=losses.get_loss(config.loss),
                                   score_fn=scores.normalized_entropy), donate_argnums=0,
                 compiler_options=(compiler_options.compiler_options("train", xla_cpu_options)
                                   if options is None else options))
  batch = random_batch(mesh, batch_size, image_size, spec.num_classes)
  return config, mesh, state, step, batch, np.float32(0.01)


def measure(model_name: str, batch_size: int, score_batch_size: int, image_size: int,
            windows: int, steps_per_window: int, xla_cpu_options: str = "tuned"
            ) -> dict[str, float]:
  """Compile time, train images/s, scoring images/s (float32, bfloat16), MFU on GPU."""
  config, mesh, state, step, batch, lr = train_setup(model_name, batch_size, image_size,
                                                     xla_cpu_options)
  spec = specs.DATASETS["cifar10"]
  start = time.perf_counter()
  compiled = step.lower(state, batch, lr, {}).compile()
  results = {"compile_seconds": time.perf_counter() - start}
  flops = (compiled.cost_analysis() or {}).get("flops", float("nan"))
  holder = [state]

  def train_once():
    holder[0], metrics, _ = compiled(holder[0], batch, lr, {})
    return metrics["loss_sum"]
  results["train_images_per_s"] = _rate(train_once, batch_size, windows, steps_per_window)
  results["train_step_gflops"] = flops / 1e9
  score_batch = random_batch(mesh, score_batch_size, image_size, spec.num_classes)
  for dtype in ("float32", "bfloat16"):
    scorer = jax.jit(functools.partial(
        steps.score_step, spec=steps.step_spec(config.dataset),
        score_fn=scores.normalized_entropy,
        model=models.create_model(model_name, spec.num_classes, dtype)),
        compiler_options=compiler_options.compiler_options("inference", xla_cpu_options))
    results[f"score_{dtype}_images_per_s"] = _rate(
        lambda s=scorer: s(holder[0], score_batch), score_batch_size, windows, steps_per_window)
  kind = jax.devices()[0].device_kind
  peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in kind), None)
  if peak and jax.default_backend() == "gpu":
    results["train_mfu_float32_step"] = (flops * results["train_images_per_s"] / batch_size
                                         / (peak * jax.device_count()))
  return results


def machine() -> dict[str, str]:
  cpu = platform.processor() or "unknown"
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    cpu = names[0] if names else cpu
  return {"backend": jax.default_backend(), "devices": f"{jax.device_count()} x "
          f"{jax.devices()[0].device_kind}", "cpu": cpu, "cores": str(os.cpu_count()),
          "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}


def write_json(path: str, results: dict) -> None:
  """Writes `results` to `path` for scripts; no-op when `path` is empty."""
  if path:
    with open(path, "w") as f:
      json.dump(results, f, indent=1)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="resnet18", choices=sorted(models.MODELS))
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--score-batch-size", type=int, default=512)
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--windows", type=int, default=5)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--compare-torch", action="store_true")
  parser.add_argument("--xla-cpu-options", default="tuned", choices=compiler_options.PRESETS,
                      help="cpjax.runtime.compiler_options preset of the JAX steps.")
  parser.add_argument("--json", default="", help="Also write the results to this file.")
  args = parser.parse_args()
  if args.compare_torch and args.model not in ("resnet18", "resnet34"):
    parser.error(f"--compare-torch has PyTorch twins of resnet18 and resnet34 only, "
                 f"not --model={args.model}")
  results = {"machine": machine(), "args": vars(args),
             "jax": measure(args.model, args.batch_size, args.score_batch_size, args.image_size,
                            args.windows, args.steps, args.xla_cpu_options)}
  if args.compare_torch:
    import torch

    from benchmarks import torch_reference
    results["machine"]["torch"] = torch.__version__
    results["torch"] = torch_reference.measure(
        args.model, args.batch_size, args.score_batch_size, args.image_size, 10, args.windows,
        args.steps, threads=os.cpu_count())
    results["ratio_jax_over_torch"] = {
        "train": results["jax"]["train_images_per_s"] / results["torch"]["train_images_per_s"],
        "score_float32": (results["jax"]["score_float32_images_per_s"]
                          / results["torch"]["score_images_per_s"])}
  print(json.dumps(results["machine"]))
  print(f"{'measure':<34}{'value':>14}")
  for side in ("jax", "torch", "ratio_jax_over_torch"):
    for key, value in results.get(side, {}).items():
      print(f"{side + '.' + key:<34}{value:>14.3f}")
  write_json(args.json, results)


if __name__ == "__main__":
  main()
