"""Wall time of one training epoch, split into scoring / selection / training.

  python -m benchmarks.epoch_cost --data=cifar_sized --model=tiny
  python -m benchmarks.epoch_cost --data=fashion_mnist --model=resnet20

Runs the trainer's own epoch code (`Selector.rows_for_epoch`, `loop_overhead.trainer_steps`,
`Selector.after_epoch`) for full data and for 10 % / 30 % subsets in
`train_pass` and `fresh` scoring modes, after one untimed epoch that compiles
every step, with each data reader (cpjax.data.readers: `host` gathers batches in
host memory, `device` on the devices from int32 row ids). `cifar_sized` is 50,000
random 32x32x3 uint8 images (timing only, not a dataset); `fashion_mnist` is the
real 60,000-image training split from Debian's dataset-fashion-mnist package.
The ratio column is the epoch's total time over the same reader's full-data
epoch's; "fwd share" is the scoring pass's speed as a share of the model's pure
forward speed (the scoring step run over as many batches on one batch already on
the device: no gathering, no transfer).
"""

import argparse
import functools
import json
import time

import jax
import numpy as np

from benchmarks import loop_overhead, throughput
from configs import default
from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data import input_pipeline, readers, specs, splits
from cpjax.runtime import compiler_options, sharding
from cpjax.selection import bookkeeping, scores
from cpjax.training import loss_steps, setup, train


def _data(name: str, num_examples: int, data_dir: str = "") -> tuple[str, splits.Split]:
  if name == "cifar_sized":
    rng = np.random.default_rng(0)
    return "cifar10", splits.Split(
        rng.integers(0, 256, (num_examples, 32, 32, 3), np.uint8),
        rng.integers(0, 10, num_examples).astype(np.int32), np.arange(num_examples, dtype=np.int32))
  config = default.get_config().dataset
  config.name, config.val_size, config.data_dir = "fashion_mnist", 1, data_dir
  parts = input_pipeline.get_datasets(config)
  full = splits.Split(*(np.concatenate([getattr(parts["train"], f), getattr(parts["val"], f)])
                        for f in ("images", "labels", "ids")))
  order = np.argsort(full.ids)
  return "fashion_mnist", full.take(order[:num_examples])


def _config(dataset: str, model: str, batch_size: int, method: str, fraction: float,
            scoring_mode: str, score_batch_size: int, xla_cpu_options: str):
  config = default.get_config()
  config.xla_cpu_options = xla_cpu_options
  config.dataset.name = dataset
  config.model.name, config.batch_size = model, batch_size
  config.selection.method, config.selection.fraction = method, fraction
  config.selection.scoring, config.selection.warmup_epochs = scoring_mode, 1
  config.selection.score_batch_size = score_batch_size
  config.log_every_steps = 10**6
  return config


def measure_epoch(split, dataset, model_name, batch_size, method, fraction, scoring_mode,
                  score_batch_size, xla_cpu_options="tuned", reader="host") -> dict[str, float]:
  """Seconds per phase of epoch 1 (epoch 0 compiles and fills the score buffer)."""
  config = _config(dataset, model_name, batch_size, method, fraction, scoring_mode,
                   score_batch_size, xla_cpu_options)
  spec = specs.DATASETS[dataset]
  mesh = sharding.create_mesh()
  model = models.create_model(model_name, spec.num_classes, "float32")
  tx = optim.create_optimizer(config.optimizer)
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, spec.image_shape, mesh)
  train_fn = jax.jit(functools.partial(
      steps.train_step, model=model, tx=tx, spec=steps.step_spec(config.dataset, config.loss),
      loss_fn=losses.get_loss(config.loss), score_fn=scores.normalized_entropy),
      donate_argnums=0,
      compiler_options=compiler_options.compiler_options("train", xla_cpu_options))
  train_reader = (readers.DeviceReader if reader == "device" else readers.Reader)(split, mesh)
  sel = bookkeeping.initial_state(len(split))
  # The loop's Run, without checkpoints or evaluation (the selector needs neither).
  run = train.Run(workdir="", mesh=mesh, model=model, tx=tx, checkpointer=None,
                  splits={"train": split}, readers={"train": train_reader}, eval_fn=None,
                  loss_kind=loss_steps.for_loss(config.loss, config.meta, spec.num_classes),
                  train_batches=None)  # The selector reads neither the steps nor the batches.
  chooser = setup.create_selector(config, run)
  result = {}
  for epoch in (0, 1):  # Epoch 0: all data (warm-up), compiles; epoch 1 is timed.
    if epoch == 1 and scoring_mode == "fresh" and method != "full":
      chooser.rows_for_epoch(1, state, sel)  # Compile the scoring pass, untimed.
    rows, weights, sel, timings = chooser.rows_for_epoch(epoch, state, sel)
    start = time.perf_counter()
    state, order, per_example = loop_overhead.trainer_steps(config, train_fn, state,
                                                            train_reader, rows, epoch, weights)
    jax.block_until_ready(state.step)
    timings["training_seconds"] = time.perf_counter() - start
    sel, _ = chooser.after_epoch(epoch, sel, order, per_example, timings, "")
    result = {"k": len(rows), **timings}
  result["total_seconds"] = sum(result[f"{p}_seconds"] for p in bookkeeping.PHASES)
  return result


def measure_pure_forward(split, dataset, model_name, score_batch_size,
                         xla_cpu_options="tuned") -> float:
  """Seconds of the scoring step alone over ceil(N / B) batches of B: one batch kept on the
  device and scored again and again, so no data moves (the model's pure forward speed)."""
  spec = specs.DATASETS[dataset]
  mesh = sharding.create_mesh()
  model = models.create_model(model_name, spec.num_classes, "float32")
  config = _config(dataset, model_name, 128, "full", 1.0, "train_pass", score_batch_size,
                   xla_cpu_options)
  state = steps.create_train_state(jax.random.PRNGKey(0), model,
                                   optim.create_optimizer(config.optimizer), spec.image_shape,
                                   mesh)
  score_fn = jax.jit(functools.partial(
      steps.scoring_pass_step, model=model, spec=steps.step_spec(config.dataset, config.loss),
      score_fn=scores.normalized_entropy),
      compiler_options=compiler_options.compiler_options("inference", xla_cpu_options))
  sample = split.take(np.arange(min(score_batch_size, len(split))))
  batch = readers.DeviceReader(sample, mesh).batch(np.arange(score_batch_size) % len(sample))
  jax.block_until_ready(score_fn(state, batch))  # Compile.
  start = time.perf_counter()
  for _ in range(-(-len(split) // score_batch_size)):
    out = score_fn(state, batch)
  jax.block_until_ready(out)
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default="cifar_sized", choices=["cifar_sized", "fashion_mnist"])
  parser.add_argument("--num-examples", type=int, default=0, help="0 = 50,000 / 60,000.")
  parser.add_argument("--data-dir", default="", help="tfds data_dir ('' = tfds's default).")
  parser.add_argument("--model", default="tiny", choices=sorted(models.MODELS))
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--score-batch-size", type=int, default=1024)
  parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.3])
  parser.add_argument("--xla-cpu-options", default="tuned", choices=compiler_options.PRESETS)
  parser.add_argument("--readers", nargs="+", default=["host", "device"],
                      choices=["host", "device"], help="each reader's epochs, in one run")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  num = args.num_examples or (50000 if args.data == "cifar_sized" else 60000)
  dataset, split = _data(args.data, num, args.data_dir)
  cases = [("full", "full", 1.0, "train_pass")]
  cases += [(f"top_k {f:.0%} {mode}", "top_k", f, mode)
            for mode in ("train_pass", "fresh") for f in args.fractions]
  rows = {}
  for reader in args.readers:
    for name, method, fraction, mode in cases:
      row = measure_epoch(split, dataset, args.model, args.batch_size, method, fraction, mode,
                          args.score_batch_size, args.xla_cpu_options, reader)
      full = rows.get(f"{reader} full", row)  # The same reader's full epoch.
      rows[f"{reader} {name}"] = {**row, "ratio_to_full": row["total_seconds"]
                                  / full["total_seconds"]}
  forward = measure_pure_forward(split, dataset, args.model, args.score_batch_size,
                                 args.xla_cpu_options)
  for name, r in rows.items():  # The fresh scoring pass's speed as a share of the forward's.
    r["scoring_share_of_forward"] = forward / r["scoring_seconds"] if "fresh" in name else None
  machine = throughput.machine()
  print(json.dumps(machine), f"data={args.data} n={len(split)} model={args.model} "
        f"batch={args.batch_size}")
  print(f"pure forward (scoring step on one resident batch, {len(split)} images): "
        f"{forward:.3f} s")
  print(f"{'case':<30}{'k':>8}{'scoring s':>11}{'select s':>10}{'train s':>10}{'total s':>10}"
        f"{'x full':>8}{'fwd share':>10}")
  for name, r in rows.items():
    share = r["scoring_share_of_forward"]
    print(f"{name:<30}{r['k']:>8}{r['scoring_seconds']:>11.3f}{r['selection_seconds']:>10.3f}"
          f"{r['training_seconds']:>10.3f}{r['total_seconds']:>10.3f}{r['ratio_to_full']:>8.3f}"
          f"{'' if share is None else f'{share:.2f}':>10}")
  throughput.write_json(args.json, {"machine": machine, "args": vars(args), "epochs": rows})


if __name__ == "__main__":
  main()
