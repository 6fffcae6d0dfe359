"""Epoch cost with a deliberately slowed host reader, with and without device prefetch.

  python -m benchmarks.prefetch                         # small_cnn, 28x28, batch 128
  python -m benchmarks.prefetch --delay-ms=50 --depths 0 1 2 4 --json=out.json

Runs the trainer's own epoch loop (`loop_overhead.trainer_steps`, metrics logged every
`--log-every` steps as in a run) over GENERATED 28x28x1 images (random bytes: timing only,
not a dataset) read by a host reader whose every batch first sleeps `--delay-ms` (a slow
disk or network file system; `auto`: the train step's own time, so reading and computing
are equally long). Each `--depths` value is the reader's `prefetch_depth` (0 = no
prefetch); all run in this one process after an untimed epoch that compiles, in turn,
`--repeats` times, and the median epoch time per depth is compared with depth 0's.
Without prefetch, the loop reads a batch, then dispatches its step; at every logging point
it waits for the steps in flight and then for the next read. With prefetch a thread keeps
`depth` batches read and on the devices ahead of the loop.
"""

import argparse
import functools
import statistics
import time

import jax
import numpy as np

from benchmarks import loop_overhead, throughput
from configs import default
from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data import readers, splits
from cpjax.runtime import compiler_options, sharding
from cpjax.selection import policies, scores


class SlowReader(readers.Reader):
  """A host reader that sleeps `delay` seconds before building each batch."""

  def __init__(self, split, mesh, prefetch_depth: int, delay: float):
    super().__init__(split, mesh, prefetch_depth)
    self.delay = delay

  def batch(self, rows, mask=None, weights=None):
    time.sleep(self.delay)
    return super().batch(rows, mask, weights)


def _setup(model_name: str, batch_size: int, num_steps: int, log_every: int):
  config = default.get_config()
  config.dataset.name = "fashion_mnist"  # Image shape and statistics only; nothing is read.
  config.model.name, config.batch_size, config.log_every_steps = model_name, batch_size, log_every
  rng = np.random.default_rng(0)
  num = batch_size * num_steps
  split = splits.Split(rng.integers(0, 256, (num, 28, 28, 1), np.uint8),
                       rng.integers(0, 10, num).astype(np.int32), np.arange(num, dtype=np.int32))
  mesh = sharding.create_mesh()
  model = models.create_model(model_name, 10)
  tx = optim.create_optimizer(config.optimizer)
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, (28, 28, 1), mesh)
  train_fn = jax.jit(functools.partial(
      steps.train_step, model=model, tx=tx, spec=steps.step_spec(config.dataset, config.loss,
                                                        policies.returns_weights(config.selection.method)),
      loss_fn=losses.get_loss(config.loss), score_fn=scores.normalized_entropy),
      donate_argnums=0, compiler_options=compiler_options.compiler_options("train"))
  return config, split, mesh, model, tx, state, train_fn


def _epoch_seconds(config, split, mesh, model, tx, state, train_fn, reader):
  """(seconds of one epoch of the trainer's loop over `split` through `reader`, state)."""
  start = time.perf_counter()
  state = loop_overhead.trainer_steps(config, train_fn, state, reader, np.arange(len(split)))[0]
  jax.block_until_ready(state.step)
  return time.perf_counter() - start, state


def _step_seconds(split, mesh, state, train_fn, batch_size: int, num: int = 10) -> float:
  """The train step alone on one batch already on the devices (its compute time)."""
  batch = readers.Reader(split, mesh, 0).batch(np.arange(batch_size))
  args = (np.float32(0.01), {})
  state, *_ = train_fn(state, batch, *args)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(num):
    state, *_ = train_fn(state, batch, *args)
  jax.block_until_ready(state)
  return (time.perf_counter() - start) / num, state


def measure(model_name: str, batch_size: int, num_steps: int, log_every: int,
            delay_ms: float | None, depths: list[int], repeats: int) -> dict:
  config, split, mesh, model, tx, state, train_fn = _setup(model_name, batch_size, num_steps,
                                                           log_every)
  step, state = _step_seconds(split, mesh, state, train_fn, batch_size)
  delay = step if delay_ms is None else delay_ms / 1000
  _, state = _epoch_seconds(config, split, mesh, model, tx, state, train_fn,  # Compiles.
                            SlowReader(split, mesh, 0, 0.0))
  times = {depth: [] for depth in depths}
  for _ in range(repeats):
    for depth in depths:  # In turn, so that drifts in the machine's speed hit every depth.
      seconds, state = _epoch_seconds(config, split, mesh, model, tx, state, train_fn,
                                      SlowReader(split, mesh, depth, delay))
      times[depth].append(seconds)
  base = statistics.median(times[depths[0]])
  return {"step_seconds": step, "delay_seconds": delay, "steps": num_steps,
          "epochs": {str(d): {"seconds": t, "median_seconds": statistics.median(t),
                              "ratio_to_first": statistics.median(t) / base}
                     for d, t in times.items()}}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="small_cnn", choices=sorted(models.MODELS))
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--steps", type=int, default=40, help="Steps per epoch.")
  parser.add_argument("--log-every", type=int, default=10, help="The loop's log_every_steps.")
  parser.add_argument("--delay-ms", default="auto",
                      help="Sleep per batch read, ms; auto = the train step's time.")
  parser.add_argument("--depths", type=int, nargs="+", default=[0, 2],
                      help="prefetch_depth values; the first is the reference.")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  delay = None if args.delay_ms == "auto" else float(args.delay_ms)
  if min(args.depths) < 0 or args.repeats < 1 or args.steps < 1:
    parser.error("--depths >= 0, --repeats >= 1 and --steps >= 1")
  results = measure(args.model, args.batch_size, args.steps, args.log_every, delay,
                    args.depths, args.repeats)
  results["machine"], results["args"] = throughput.machine(), vars(args)
  print(f"train step {results['step_seconds'] * 1e3:.1f} ms; reader sleeps "
        f"{results['delay_seconds'] * 1e3:.1f} ms per batch; {args.steps} steps per epoch")
  print(f"{'prefetch_depth':<16}{'epoch s (median)':>18}{'x depth ' + str(args.depths[0]):>12}")
  for depth, row in results["epochs"].items():
    print(f"{depth:<16}{row['median_seconds']:>18.3f}{row['ratio_to_first']:>12.3f}")
  throughput.write_json(args.json, results)


if __name__ == "__main__":
  main()
