"""How much logging the gradient norm changes training: the train step with and without it.

  python -m scripts.grad_norm_regrouping [--config=configs/default.py] [--steps=20]
      [--xla-cpu-options=tuned|xla_default]

The train step returns the global gradient norm for the per-step train metrics.
Computing it gives the gradient a second consumer, and XLA:CPU then fuses the
backward pass differently and rounds differently. This trains the same batches
with the real step and with a copy whose gradient-norm output is a constant,
and prints the largest relative parameter difference after each step: the
size of the regrouping, before a chaotic network amplifies it.
"""

import argparse
import functools
import importlib.util

import jax
import numpy as np
import optax

from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data import input_pipeline, specs, splits
from cpjax.runtime import compiler_options, sharding
from cpjax.selection import scores


def _config(path: str):
  spec = importlib.util.spec_from_file_location("config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _without_grad_norm(*args, **kwargs):
  """steps.train_step with optax.tree.norm of the gradient replaced by a constant."""
  real_norm, calls = optax.tree.norm, []

  def norm(tree, *a, **k):
    calls.append(1)
    return jax.numpy.float32(0) if len(calls) == 1 else real_norm(tree, *a, **k)
  optax.tree.norm = norm  # The step computes the gradient's norm first (at trace time).
  try:
    return steps.train_step(*args, **kwargs)
  finally:
    optax.tree.norm = real_norm


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default="configs/default.py")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--xla-cpu-options", default="", help="default: the config's")
  args = parser.parse_args()
  config = _config(args.config)
  config.xla_cpu_options = args.xla_cpu_options or config.xla_cpu_options
  data = specs.DATASETS[config.dataset.name]
  mesh = sharding.create_mesh()
  model = models.create_model(config.model.name, data.num_classes, config.model.dtype)
  tx = optim.create_optimizer(config.optimizer)
  bound = dict(model=model, tx=tx, loss_fn=losses.get_loss(config.loss),
               score_fn=scores.forward_score(config.selection.score, config.selection),
               spec=steps.step_spec(config.dataset, config.loss))
  # As the loop jits it (cpjax.training.setup.jit_train_step): donated state, the config's options.
  options = compiler_options.compiler_options("train", config.xla_cpu_options)
  with_norm, without_norm = (jax.jit(functools.partial(fn, **bound), donate_argnums=0,
                                     compiler_options=options)
                             for fn in (steps.train_step, _without_grad_norm))
  states = [steps.create_train_state(jax.random.PRNGKey(config.seed), model, tx,
                                     data.image_shape, mesh) for _ in range(2)]
  train = input_pipeline.get_datasets(config.dataset)["train"]
  order = splits.epoch_order(config.seed, 0, np.arange(len(train)), config.batch_size)
  lr = np.float32(optim.learning_rate_at(config.optimizer, 0, config.num_epochs))
  hparams = losses.scheduled_hparams(config.loss, 0)
  for step in range(min(args.steps, len(order))):
    batch = sharding.to_global(mesh, splits.batch_at(train, order[step]), config.batch_size)
    states = [fn(s, batch, lr, hparams)[0] for fn, s in zip((with_norm, without_norm), states)]
    diffs = jax.tree.leaves(jax.tree.map(
        lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))
                           / (np.max(np.abs(np.asarray(b))) + 1e-30)),
        states[0].params, states[1].params))
    print(f"step {step + 1}: max relative parameter difference {max(diffs):.2e}", flush=True)


if __name__ == "__main__":
  main()
