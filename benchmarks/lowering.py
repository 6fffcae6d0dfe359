"""Do cpjax's jitted steps lower for GPU and TPU? And their FLOPs per example.

  python -m benchmarks.lowering                       # ResNet-18 (CIFAR shape), small_cnn
  python -m benchmarks.lowering --models resnet20:cifar10 --batch-size=256 --json=out.json
  python -m benchmarks.lowering --models resnet50_imagenet:cifar10:224 --batch-size=16

Exports (`jax.export`, which lowers without compiling and needs no accelerator) the steps the
loop jits, exactly as it jits them: the train step, the InfoBatch-weighted train step, the
FL_gamma meta (gamma-Net) train step, the eval step and the scoring-pass step, each in
float32 and bfloat16, for `("cuda",)` and `("tpu",)`, with the batch sharded over a `data`
mesh of every local device. Each exported module is checked for what would only fail on the
first accelerator job: host callbacks (a `jax.pure_callback`, `jax.debug.print` or
`io_callback` left in a step) and float64 values. Each step's FLOPs per example come from
XLA's cost analysis of the lowered, unpartitioned module (the whole global batch, before
SPMD partitioning) divided by the batch size: the numerator of model FLOP utilisation on
an accelerator.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=8 for an 8-device mesh on a CPU.
tests/test_lowering.py runs the same checks at a tiny size.
"""

import argparse
import dataclasses
import re
import time

import jax
import jax.numpy as jnp

from benchmarks import throughput
from configs import default
from cpjax import models, optim, run_state, steps
from cpjax.data import specs
from cpjax.runtime import sharding
from cpjax.selection import policies, score_sources, scores
from cpjax.training import loss_steps, setup

KINDS = ("train", "infobatch_train", "meta_train", "eval", "score")
PLATFORMS = (("cuda",), ("tpu",))
DTYPES = ("float32", "bfloat16")

# A host callback lowers to a custom call whose target names it (jaxlib 0.10:
# xla_ffi_python_cpu_callback, xla_ffi_python_gpu_callback, xla_python_cpu_callback, ...).
_CUSTOM_CALL = re.compile(r"custom_call @([\w.$-]+)")
_CALLBACK = re.compile(r"callback|host|python", re.IGNORECASE)
_F64 = re.compile(r"\bf64\b|complex<f64>")
# A parameter of the exported `main`: its type, its sharding (Shardy) and its name.
_PARAM = re.compile(r'%arg\d+: tensor<([^>]*)>(?: \{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\})? '
                    r'loc\("([^"]*)"\)')


def step_config(kind: str, model_name: str, dtype: str, dataset: str, batch_size: int):
  """configs/default.py set up for one step kind: the loss and selection it needs."""
  config = default.get_config()
  config.dataset.name, config.batch_size = dataset, batch_size
  config.model.name, config.model.dtype = model_name, dtype
  config.selection.score_dtype = dtype
  if kind == "infobatch_train":  # Batches carry a per-example loss weight.
    config.selection.method, config.selection.score = "infobatch", "loss"
  if kind == "meta_train":
    config.loss.name, config.dataset.meta_val_size = "flgamma_sece", 128
  return config


@dataclasses.dataclass
class Step:
  """A jitted step as the loop builds it, and abstract arguments to lower it with."""
  fn: object
  args: tuple


def build_step(kind: str, model_name: str, dtype: str, dataset: str, batch_size: int,
               mesh: jax.sharding.Mesh, image_size: int | None = None) -> Step:
  """The loop's own jitted `kind` step (cpjax.training.train, cpjax.selection.score_sources) and
  abstract (shape, dtype, sharding) arguments: replicated state, batch sharded on `data`.

  `image_size` replaces the dataset's image side (e.g. 224 for an ImageNet-stem ResNet on
  3-channel images); the dataset still gives the channels, classes and normalisation.
  """
  if kind not in KINDS:
    raise ValueError(f"step kind {kind!r}; valid: {', '.join(KINDS)}")
  config = step_config(kind, model_name, dtype, dataset, batch_size)
  data = specs.DATASETS[dataset]
  image_shape = data.image_shape if image_size is None else (image_size, image_size,
                                                             data.image_shape[-1])
  model = models.create_model(model_name, data.num_classes, dtype)
  tx = optim.create_optimizer(config.optimizer)
  state = steps.abstract_train_state(model, tx, image_shape, mesh,
                                     run_state.meta_parts(config.loss, config.meta,
                                                          data.num_classes))
  batch = _abstract_batch(kind, image_shape, batch_size, mesh)
  if kind == "eval":
    return Step(setup.jit_eval_step(config, model), (state, batch))
  if kind == "score":
    score_fn = scores.forward_score(config.selection.score, config.selection)
    fn = score_sources._jit_score_step(  # pylint: disable=protected-access
        config.model.name, config.dataset, dtype, score_fn, config.xla_cpu_options)
    return Step(fn, (state, batch))
  learning_rate = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding.replicated(mesh))
  fn = setup.jit_train_step(
      config, model, tx, policies.returns_weights(config.selection.method),
      loss_steps.for_loss(config.loss, config.meta, data.num_classes))
  return Step(fn, (state, batch, learning_rate, {}))


def _abstract_batch(kind: str, image_shape: tuple[int, ...], batch_size: int,
                    mesh: jax.sharding.Mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch a reader gives `kind`'s step, every array sharded on `data`."""
  def arg(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.batch_sharded(mesh))
  batch = {"image": arg((batch_size, *image_shape), jnp.uint8),
           "label": arg((batch_size,), jnp.int32), "id": arg((batch_size,), jnp.int32),
           "mask": arg((batch_size,), jnp.float32)}
  if kind == "infobatch_train":
    batch["weight"] = arg((batch_size,), jnp.float32)
  if kind == "meta_train":
    batch.update(meta_image=arg((batch_size, *image_shape), jnp.uint8),
                 meta_label=arg((batch_size,), jnp.int32))
  return batch


def export(step: Step, platforms: tuple[str, ...]) -> jax.export.Exported:
  """`step` lowered for `platforms` (nothing is compiled)."""
  return jax.export.export(step.fn, platforms=platforms)(*step.args)


def problems(module_text: str) -> list[str]:
  """What in a StableHLO module would fail or be slow on an accelerator: host callbacks
  (custom calls to a Python callback) and float64 values. Empty when there is none."""
  found = [f"host callback: custom_call @{target}"
           for target in sorted(set(_CUSTOM_CALL.findall(module_text)))
           if _CALLBACK.search(target)]
  f64_lines = [line.strip() for line in module_text.splitlines() if _F64.search(line)]
  if f64_lines:
    found.append(f"{len(f64_lines)} lines with float64, first: {f64_lines[0][:200]}")
  return found


def parameters(module_text: str) -> dict[str, tuple[str, str]]:
  """The exported `main`'s parameters: name (e.g. "batch['image']") -> (tensor type, Shardy
  sharding attribute, "" when none)."""
  (signature,) = [line for line in module_text.splitlines() if "func.func public @main" in line]
  return {name: (tensor, attrs or "") for tensor, attrs, name in _PARAM.findall(signature)}


def flops_per_example(step: Step, batch_size: int) -> float:
  """XLA's cost-analysis FLOPs of the lowered (unpartitioned, global-batch) step / batch."""
  return step.fn.trace(*step.args).lower().cost_analysis()["flops"] / batch_size


def check(models_and_data: list[tuple[str, str, int | None]], batch_size: int) -> list[dict]:
  """Every (model, dataset, image side or None) x dtype x step kind: lowered for each
  platform and checked."""
  mesh = sharding.create_mesh()
  rows = []
  for model_name, dataset, image_size in models_and_data:
    for dtype in DTYPES:
      for kind in KINDS:
        step = build_step(kind, model_name, dtype, dataset, batch_size, mesh, image_size)
        row = {"model": model_name, "dataset": dataset, "image_size": image_size,
               "dtype": dtype, "step": kind}
        for platforms in PLATFORMS:
          start = time.perf_counter()
          exported = export(step, platforms)
          row[f"{platforms[0]}_export_seconds"] = time.perf_counter() - start
          row[f"{platforms[0]}_problems"] = problems(exported.mlir_module())
        row["flops_per_example"] = flops_per_example(step, batch_size)
        rows.append(row)
        print(_line(row), flush=True)
  return rows


def _line(row: dict) -> str:
  verdict = {p[0]: "ok" if not row[f"{p[0]}_problems"] else "; ".join(row[f"{p[0]}_problems"])
             for p in PLATFORMS}
  return (f"{row['model']:<18}{row['dtype']:<10}{row['step']:<17}"
          f"{row['flops_per_example'] / 1e6:>12.1f}  {verdict['cuda']:<6}{verdict['tpu']}")


def _model_dataset_size(parser: argparse.ArgumentParser,
                        value: str) -> tuple[str, str, int | None]:
  """"model:dataset[:side]" -> (model, dataset, side or None); a bad part is a usage error."""
  model_name, dataset, *size = value.split(":") + [""] * (":" not in value)
  if (model_name not in models.MODELS or dataset not in specs.DATASETS or len(size) > 1
      or (size and not size[0].isdigit())):
    parser.error(f"--models {value}: model:dataset[:image side], model one of "
                 f"{sorted(models.MODELS)}, dataset one of {sorted(specs.DATASETS)}")
  return model_name, dataset, int(size[0]) if size else None


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--models", nargs="+",
                      default=["resnet18:cifar10", "small_cnn:fashion_mnist"],
                      help="model:dataset[:image side] (the dataset gives the image shape, "
                           "classes and normalisation; the side replaces its height and width).")
  parser.add_argument("--batch-size", type=int, default=128, help="Global batch.")
  parser.add_argument("--json", default="", help="Also write the results to this file.")
  args = parser.parse_args()
  pairs = [_model_dataset_size(parser, m) for m in args.models]
  if args.batch_size % jax.device_count():
    parser.error(f"--batch-size={args.batch_size} must divide over {jax.device_count()} devices")
  print(f"{jax.device_count()} devices; batch {args.batch_size}")
  print(f"{'model':<18}{'dtype':<10}{'step':<17}{'MFLOP/ex':>12}  cuda  tpu")
  rows = check(pairs, args.batch_size)
  throughput.write_json(args.json, {"machine": throughput.machine(), "args": vars(args),
                                    "steps": rows})
  if any(row[f"{p[0]}_problems"] for row in rows for p in PLATFORMS):
    raise SystemExit("some steps have host callbacks or float64 (above)")


if __name__ == "__main__":
  main()
