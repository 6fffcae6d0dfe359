"""What the trainer's Python loop costs: its steps per second against a bare loop.

  python -m benchmarks.loop_overhead                       # tiny net, batch 64, 8x8 images
  python -m benchmarks.loop_overhead --steps=400 --profile --json=out.json

With a tiny model a step takes a millisecond or less, and whatever Python does per step
becomes the bottleneck of a fast accelerator. This runs, in one process, the trainer's own
step loop as cpjax.training.train's epoch runs it (`trainer_steps` below:
`step_loop.train_steps` over the device reader's batches, gathered inside the train step,
with the learning rates, metric sums, a logging point every `--log-every` steps,
per-example outputs gathered at the epoch's end)
and a bare Python loop calling the same jitted train step on batches already on the
devices, over the same number of steps, in turn, `--repeats` times (after an untimed epoch
that compiles everything). The ratio of their steps per second (median, and best of the
repeats: the run least disturbed by other load) is the share of the bare loop's speed that
the trainer keeps (1.0 = no overhead). `--profile` runs one more
trainer epoch under cProfile and lists where its Python time goes, and how many Python
function calls it makes per step (a count, which a busy machine does not disturb). Data:
GENERATED 8x8x1 images (random bytes: timing only, not a dataset).
"""

import argparse
import cProfile
import io
import pstats
import statistics
import time

import jax
import numpy as np

from benchmarks import throughput
from configs import test as test_config
from cpjax import models, optim, run_state, steps
from cpjax.calibration import losses
from cpjax.data import readers, specs, splits
from cpjax.runtime import metric_writers, preemption, sharding
from cpjax.selection import policies
from cpjax.training import loss_steps, setup, step_loop


def _setup(model_name: str, batch_size: int, num_steps: int, log_every: int):
  config = test_config.get_config()
  config.model.name, config.batch_size, config.log_every_steps = model_name, batch_size, log_every
  spec = specs.DATASETS[config.dataset.name]
  rng = np.random.default_rng(0)
  num = batch_size * num_steps
  split = splits.Split(rng.integers(0, 256, (num, *spec.image_shape), np.uint8),
                       rng.integers(0, 10, num).astype(np.int32), np.arange(num, dtype=np.int32))
  mesh = sharding.create_mesh()
  model = models.create_model(model_name, spec.num_classes)
  tx = optim.create_optimizer(config.optimizer)
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, spec.image_shape, mesh)
  train_fn = setup.jit_train_step(
      config, model, tx, policies.returns_weights(config.selection.method),
      loss_steps.for_loss(config.loss, config.meta, spec.num_classes))
  reader = readers.DeviceReader(split, mesh)
  return config, reader, state, train_fn


def trainer_steps(config, train_fn, state, reader, rows, epoch=0, weights=None):
  """One epoch of `rows` through the step loop as cpjax.training.train's epoch runs it (no
  selection, evaluation or checkpoint): (state, order [steps, B], per-example outputs on the
  host)."""
  order = splits.epoch_order(config.seed, epoch, rows, config.batch_size)
  first_step = int(jax.device_get(state.step))
  row_weights = None
  if weights is not None:
    row_weights = np.ones(len(reader), np.float32)
    row_weights[rows] = weights
  batches = loss_steps.PlainSteps(config.loss).train_batches({"train": reader}, config.seed,
                                                             config.batch_size)(
      order, epoch=epoch, row_weights=row_weights, first_step=first_step)
  with step_loop.step_guard(config.step_transfer_guard):
    state, _, outputs, _, _ = step_loop.train_steps(
        train_fn, state, batches,
        optim.learning_rates(config.optimizer, epoch, first_step, len(order), len(order),
                                 config.num_epochs),
        losses.scheduled_hparams(config.loss, epoch), run_state.NOTHING_DONE,
        first_step=first_step, epoch=epoch, log_every=config.log_every_steps,
        window_steps=step_loop.window_steps(config.log_every_steps, (len(order),)),
        writer=metric_writers.MultiWriter([]), progress=lambda step: None,
        checkpointer=_NoCheckpoints())
  return state, order, step_loop.host_outputs(outputs, None)


class _NoCheckpoints:
  """The trainer's checkpointer as the step loop meets it, without a checkpoint folder: the
  same preemption check after every step (`Checkpointer.reached_preemption`), never set."""

  def __init__(self):
    self._preemption = preemption.PreemptionGuard()

  def reached_preemption(self, step: int) -> bool:
    return self._preemption.should_stop(step)


def trainer_epoch(run, train_fn, state):
  """(seconds, state) of one epoch of the trainer's loop over the whole split."""
  config, reader = run
  start = time.perf_counter()
  state = trainer_steps(config, train_fn, state, reader, np.arange(len(reader)))[0]
  jax.block_until_ready(state)
  return time.perf_counter() - start, state


def bare_epoch(train_fn, state, batches):
  """(seconds, state) of the same step called over `batches`, already on the devices."""
  learning_rate = np.float32(0.05)  # A host scalar, as the loop passes it.
  start = time.perf_counter()
  for batch in batches:
    state, _, _ = train_fn(state, batch, learning_rate, {})
  jax.block_until_ready(state)
  return time.perf_counter() - start, state


def measure(model_name: str, batch_size: int, num_steps: int, log_every: int, repeats: int,
            profile: bool) -> dict:
  config, reader, state, train_fn = _setup(model_name, batch_size, num_steps, log_every)
  run = (config, reader)
  order = splits.epoch_order(config.seed, 0, np.arange(len(reader)), batch_size)
  batches = list(reader.batches(order))  # The same batches, placed up front.
  jax.block_until_ready(batches)
  _, state = trainer_epoch(run, train_fn, state)  # Compiles every program of the loop.
  _, state = bare_epoch(train_fn, state, batches)
  times = {"trainer": [], "bare": []}
  for _ in range(repeats):  # In turn, so that drifts in the machine's speed hit both.
    seconds, state = trainer_epoch(run, train_fn, state)
    times["trainer"].append(seconds)
    seconds, state = bare_epoch(train_fn, state, batches)
    times["bare"].append(seconds)
  rate = {k: num_steps / statistics.median(v) for k, v in times.items()}
  best = {k: num_steps / min(v) for k, v in times.items()}  # Least disturbed by other load.
  results = {"steps": num_steps, "seconds": times, "trainer_steps_per_s": rate["trainer"],
             "bare_steps_per_s": rate["bare"], "ratio": rate["trainer"] / rate["bare"],
             "best_trainer_steps_per_s": best["trainer"], "best_bare_steps_per_s": best["bare"],
             "best_ratio": best["trainer"] / best["bare"]}
  if profile:
    profiler = cProfile.Profile()
    profiler.enable()
    trainer_epoch(run, train_fn, state)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(15)
    results["profile_top_tottime"] = text.getvalue()
    # Python function calls per step (a count, not a time: it holds on a busy machine), the
    # epoch's own work (logging points, outputs gathered at its end) spread over its steps.
    results["profile_calls_per_step"] = stats.total_calls / num_steps
  return results


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="tiny", choices=sorted(models.MODELS))
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--steps", type=int, default=200, help="Steps per epoch.")
  parser.add_argument("--log-every", type=int, default=10, help="The loop's log_every_steps.")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--profile", action="store_true", help="cProfile one trainer epoch.")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  if args.repeats < 1 or args.steps < 1 or args.log_every < 1:
    parser.error("--repeats, --steps and --log-every must be >= 1")
  results = measure(args.model, args.batch_size, args.steps, args.log_every, args.repeats,
                    args.profile)
  results["machine"], results["args"] = throughput.machine(), vars(args)
  print(f"{args.model}, batch {args.batch_size}, {args.steps} steps, log every "
        f"{args.log_every}; {jax.device_count()} device(s)")
  print(f"{'steps/s':<14}{'median':>10}{'best':>10}")
  print(f"{'trainer loop':<14}{results['trainer_steps_per_s']:>10.1f}"
        f"{results['best_trainer_steps_per_s']:>10.1f}")
  print(f"{'bare loop':<14}{results['bare_steps_per_s']:>10.1f}"
        f"{results['best_bare_steps_per_s']:>10.1f}")
  print(f"{'trainer / bare':<14}{results['ratio']:>10.3f}{results['best_ratio']:>10.3f}")
  if args.profile:
    print(results["profile_top_tottime"])
    print(f"Python function calls per trainer step: {results['profile_calls_per_step']:.1f}")
  throughput.write_json(args.json, results)


if __name__ == "__main__":
  main()
