"""Train and scoring throughput of cpjax's real jitted steps, optionally vs PyTorch.

  python -m benchmarks.throughput --model=resnet18 --batch-size=128 --compare-torch

Times `cpjax.steps.train_step` (augmentation, forward, loss, backward, SGD
update; state donated) and `cpjax.steps.score_step` (eval forward +
normalised entropy) in float32 and bfloat16, on random CIFAR-shaped inputs
(timing only: the values do not matter). Each rate is the median over
`--windows` timed windows of `--steps` steps after a warm-up window, each
window ending with `block_until_ready`. Compile time is the train step's
lower + compile. Prints a table and, with --json, writes the numbers for scripts.

FLOPs and MFU: the model FLOPs of a train step per image come from the model's conv and
dense layer shapes (`benchmarks.model_flops`: MACs x 2 x 3 forwards), on every backend;
MFU is that times the train images/s over the device's dense bfloat16 peak, printed where
the device kind has a known peak (GPUs, TPUs: `model_flops.PEAK_BF16_FLOPS`; the train
step computes in `--dtype`). XLA's own count (`cost_analysis()` of the compiled step) is
printed on a CPU only, beside the model FLOPs: on XLA:CPU convolutions are ordinary HLO and
it counts them; on a GPU it leaves out the cuDNN convolution calls (about 60x too few
FLOPs for ResNet-50), so it is never used there.
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

from benchmarks import model_flops
from configs import default
from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data import specs
from cpjax.runtime import compiler_options, sharding
from cpjax.selection import scores


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
                options: dict[str, str] | None = None, dtype: str = "float32"):
  """(config, mesh, train state, jitted donated train step, batch, lr) on random inputs; the
  step compiles with the `xla_cpu_options` preset, or with `options` when given, and
  computes in `dtype` (parameters float32)."""
  config = _config(model_name, batch_size)
  config.xla_cpu_options = xla_cpu_options
  spec = specs.DATASETS["cifar10"]
  mesh = sharding.create_mesh()
  model = models.create_model(model_name, spec.num_classes, dtype)
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
            windows: int, steps_per_window: int, xla_cpu_options: str = "tuned",
            dtype: str = "float32") -> dict[str, float]:
  """Compile time, train images/s, scoring images/s (float32, bfloat16), model FLOPs and
  MFU (where the device's peak is known; `dtype`: the train step's compute dtype)."""
  config, mesh, state, step, batch, lr = train_setup(model_name, batch_size, image_size,
                                                     xla_cpu_options, dtype=dtype)
  spec = specs.DATASETS["cifar10"]
  start = time.perf_counter()
  compiled = step.lower(state, batch, lr, {}).compile()
  results = {"compile_seconds": time.perf_counter() - start}
  holder = [state]

  def train_once():
    holder[0], metrics, _ = compiled(holder[0], batch, lr, {})
    return metrics["loss_sum"]
  results["train_images_per_s"] = _rate(train_once, batch_size, windows, steps_per_window)
  score_batch = random_batch(mesh, score_batch_size, image_size, spec.num_classes)
  for score_dtype in ("float32", "bfloat16"):
    scorer = jax.jit(functools.partial(
        steps.score_step, spec=steps.step_spec(config.dataset),
        score_fn=scores.normalized_entropy,
        model=models.create_model(model_name, spec.num_classes, score_dtype)),
        compiler_options=compiler_options.compiler_options("inference", xla_cpu_options))
    results[f"score_{score_dtype}_images_per_s"] = _rate(
        lambda s=scorer: s(holder[0], score_batch), score_batch_size, windows, steps_per_window)
  results.update(_flops(compiled, model_name, spec.num_classes, image_size, batch_size,
                        results["train_images_per_s"]))
  return results


def _flops(compiled, model_name: str, num_classes: int, image_size: int, batch_size: int,
           train_images_per_s: float) -> dict[str, float]:
  """Model GFLOPs a train image and MFU against the bf16 peak (where known); on a CPU also
  XLA's count of the compiled step (module docstring: why not on a GPU)."""
  model = models.create_model(model_name, num_classes)
  flops = model_flops.train_flops_per_image(model, (image_size, image_size, 3))
  out = {"train_model_gflops_per_image": flops / 1e9}
  if jax.default_backend() == "cpu":
    xla = (compiled.cost_analysis() or {}).get("flops", float("nan"))
    out["train_xla_cost_analysis_gflops_per_image"] = xla / batch_size / 1e9
  mfu = model_flops.mfu(flops, train_images_per_s,
                        model_flops.peak_bf16_flops(jax.devices()[0].device_kind),
                        jax.device_count())
  if mfu is not None:
    out["train_mfu_vs_bf16_peak"] = mfu
  return out


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
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="Compute dtype of the timed train step (MFU is against the bf16 "
                      "peak).")
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
                            args.windows, args.steps, args.xla_cpu_options, args.dtype)}
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
  print(f"{'measure':<48}{'value':>14}")
  for side in ("jax", "torch", "ratio_jax_over_torch"):
    for key, value in results.get(side, {}).items():
      print(f"{side + '.' + key:<48}{value:>14.4g}")
  write_json(args.json, results)


if __name__ == "__main__":
  main()
