"""The jitted steps: learning, their metrics, device-count invariance, sharded passes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data import augment, specs, splits
from cpjax.runtime import sharding
from cpjax.selection import policies, scores
from tests.helpers import tiny_config


def _setup(config, devices):
  """Mesh, model, fresh state and the jitted train step of `config` on `devices` (with loss
  weights where the config's selection method gives them, as the loop's selector decides)."""
  weighted = policies.returns_weights(config.selection.method)
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes)
  tx = optim.create_optimizer(config.optimizer)
  # The state is initialised on all devices (one compile of the init for every test, as
  # the runs' own) and copied, replicated, onto the mesh of `devices`.
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, data.image_shape,
                                   sharding.create_mesh())
  mesh = sharding.create_mesh(devices)
  state = jax.device_put(state, sharding.replicated(mesh))
  step = jax.jit(functools.partial(steps.train_step, model=model, tx=tx,
                                   loss_fn=losses.get_loss(config.loss),
                                   score_fn=scores.normalized_entropy,
                                   spec=steps.step_spec(config.dataset, config.loss, weighted)))
  return mesh, model, state, step


def _numpy_entropy(logits):
  """Tata et al. 2022's normalised entropy, -sum p log(p + 1e-6) / log K, in float64."""
  z = np.asarray(logits, np.float64)
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  return -(p * np.log(p + 1e-6)).sum(1) / np.log(z.shape[1])


def _numpy_global_norm(tree):
  """sqrt(sum of squares of every leaf), in float64 NumPy."""
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree.leaves(jax.device_get(tree)))))


def _numpy_scores(logits, labels):
  """Every registered priority score, written plainly in float64 NumPy
  (docs/methods.md#calibration-guided-sample-prioritization)."""
  z = np.asarray(logits, np.float64)
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  top2 = -np.sort(-p, axis=1)[:, :2]
  rows = np.arange(len(z))
  return {"entropy": _numpy_entropy(z),
          "least_confidence": 1 - p.max(1),
          "margin": top2[:, 1] - top2[:, 0],
          "loss": -np.log(p[rows, labels]),
          "el2n": np.linalg.norm(p - np.eye(z.shape[1])[labels], axis=1)}


def test_step_spec_holds_the_data_and_loss_facts_of_the_config():
  config = tiny_config(**{"loss.mixup_alpha": 0.2, "loss.reduction": "sum"})
  assert steps.step_spec(config.dataset, config.loss) == steps.StepSpec(
      mean=(0.3054,), std=(0.3762,), num_classes=10, crop_padding=1, flip=False,
      mixup_alpha=0.2, reduction="sum")
  # Eval-mode steps need no loss facts; the loss weights are the selector's to decide.
  assert steps.step_spec(config.dataset) == steps.StepSpec(
      mean=(0.3054,), std=(0.3762,), num_classes=10, crop_padding=1, flip=False)
  assert steps.step_spec(config.dataset, config.loss, weighted=True).weighted


@pytest.fixture(scope="module")
def no_crop_setup():
  """_setup of configs/test.py without augmentation, on all 8 devices: one init and one compiled
  train step for the tests below that start from it (the steps never mutate their inputs:
  test_train_step_never_mutates_its_inputs)."""
  return _setup(tiny_config(**{"dataset.crop_padding": 0}), jax.devices())


def test_train_step_lowers_the_loss_on_a_fixed_batch(digits, no_crop_setup):
  mesh, _, state, step = no_crop_setup
  batch = sharding.to_global(mesh, splits.batch_at(digits["train"], np.arange(64)), 64)
  losses_seen = []
  for _ in range(60):
    state, m, _ = step(state, batch, np.float32(0.2), {})
    m = jax.device_get(m)  # NumPy: an operation on jax arrays would compile a program.
    losses_seen.append(float(m["loss_sum"] / m["count"]))
  assert np.mean(losses_seen[-5:]) < 0.6 * losses_seen[0]
  assert int(state.step) == 60


def test_train_step_metrics_match_an_independent_computation(digits, no_crop_setup):
  """Masked rows count for nothing; grad_norm and param_norm are the global norms before
  the update; the per-example outputs are of the same (pre-update) forward pass."""
  mesh, model, state, step = no_crop_setup  # No augmentation: a known input.
  mask = np.where(np.arange(64) < 40, 1.0, 0.0).astype(np.float32)
  host = splits.batch_at(digits["train"], np.arange(64), mask)
  new_state, m, per_example = jax.device_get(
      step(state, sharding.to_global(mesh, host, 64), np.float32(0.1), {}))

  def objective(params):
    images = augment.normalize(jnp.asarray(host["image"]), (0.3054,), (0.3762,))
    (logits, _), _ = model.apply({"params": params, "batch_stats": state.batch_stats},
                                 images, train=True, mutable=["batch_stats"])
    per_row = losses.cross_entropy(logits, host["label"]) * mask
    return jnp.sum(per_row) / mask.sum(), (jnp.sum(per_row), logits)
  # The value and gradient jitted whole: one compile (the gradient of a jitted function taken
  # outside jit compiles its forward and backward passes apart, and its glue op by op).
  (_, (loss_sum, logits)), grads = jax.device_get(
      jax.jit(jax.value_and_grad(objective, has_aux=True))(state.params))
  assert m["count"] == 40
  assert m["loss_sum"] == pytest.approx(float(loss_sum), rel=1e-5)
  assert m["correct"] == np.sum((np.argmax(logits, -1) == host["label"]) * mask)
  assert m["first_bad_step"] == steps.NO_BAD_STEP
  assert m["grad_norm"] == pytest.approx(_numpy_global_norm(grads), rel=1e-4)
  assert m["param_norm"] == pytest.approx(_numpy_global_norm(state.params), rel=1e-6)
  np.testing.assert_allclose(per_example["score"], _numpy_entropy(logits), rtol=1e-4, atol=1e-6)
  assert int(new_state.step) == 1


_PLAIN_SGD = {"dataset.crop_padding": 0, "optimizer.momentum": 0.0,  # No augmentation, and
              "optimizer.weight_decay": 0.0}  # the update is -lr * gradient.


@pytest.mark.slow  # Two train steps compiled.
def test_weighted_step_with_unit_weights_is_the_unweighted_step(digits):
  rows = np.arange(64)
  results = []
  for method, weights in (("full", None), ("infobatch", np.ones(64, np.float32))):
    mesh, _, state, step = _setup(tiny_config(**_PLAIN_SGD, **{"selection.method": method}),
                                  jax.devices())
    host = splits.batch_at(digits["train"], rows, weights=weights)
    assert ("weight" in host) == (method == "infobatch")
    results.append(jax.device_get(step(state, sharding.to_global(mesh, host, 64),
                                       np.float32(0.1), {})))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), *results)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_weighted_step_descends_the_hand_written_weighted_loss(digits, reduction):
  """params' = params - lr * grad of sum_i w_i l_i m_i (/ sum_i m_i), written out by hand; the
  loss_sum metric stays the unweighted sum_i l_i m_i."""
  config = tiny_config(**_PLAIN_SGD, **{"selection.method": "infobatch",
                                        "loss.reduction": reduction})
  mesh, model, state, step = _setup(config, jax.devices())
  rng = np.random.default_rng(0)
  weights = rng.choice([0.0, 1.0, 2.0, 1 / 0.3], 64).astype(np.float32)
  mask = np.where(np.arange(64) < 50, 1.0, 0.0).astype(np.float32)
  host = splits.batch_at(digits["train"], np.arange(64), mask, weights)
  lr = np.float32(0.5 if reduction == "mean" else 0.01)  # Updates of similar sizes.
  new_state, m, _ = jax.device_get(step(state, sharding.to_global(mesh, host, 64), lr, {}))

  def weighted_loss(params):
    images = augment.normalize(jnp.asarray(host["image"]), (0.3054,), (0.3762,))
    (logits, _), _ = model.apply({"params": params, "batch_stats": state.batch_stats},
                                 images, train=True, mutable=["batch_stats"])
    per_row = losses.cross_entropy(logits, host["label"])
    total = sum(weights[i] * per_row[i] * mask[i] for i in range(64))
    return total / (mask.sum() if reduction == "mean" else 1.0), jnp.sum(per_row * mask)
  grads, loss_sum = jax.jit(jax.grad(weighted_loss, has_aux=True))(state.params)
  jax.tree.map(lambda new, old, g: np.testing.assert_allclose(new, old - lr * g, rtol=1e-5,
                                                              atol=1e-6),
               new_state.params, jax.device_get(state.params), jax.device_get(grads))
  assert m["loss_sum"] == pytest.approx(float(loss_sum), rel=1e-5)
  assert m["grad_norm"] == pytest.approx(_numpy_global_norm(grads), rel=1e-4)


@pytest.mark.slow  # Compiled for 1 and for 8 devices.
def test_one_and_eight_devices_give_the_same_loss_and_gradients(digits):
  config = tiny_config()
  rows = np.arange(64)
  results = []
  for devices in (jax.devices()[:1], jax.devices()[:8]):
    mesh, model, state, _ = _setup(config, devices)
    batch = sharding.to_global(mesh, splits.batch_at(digits["train"], rows), 64)
    assert batch["image"].sharding.spec == jax.sharding.PartitionSpec("data")
    assert len(batch["image"].sharding.device_set) == len(devices)

    def loss_of(params, state=state, batch=batch, model=model):
      images = batch["image"].astype(jnp.float32) / 255.0
      (logits, _), _ = model.apply({"params": params, "batch_stats": state.batch_stats},
                                   images, train=True, mutable=["batch_stats"])
      return jnp.mean(losses.cross_entropy(logits, batch["label"]))
    results.append(jax.device_get(jax.jit(jax.value_and_grad(loss_of))(state.params)))
  (loss1, grads1), (loss8, grads8) = results
  np.testing.assert_allclose(loss1, loss8, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               grads1, grads8)


@pytest.mark.slow  # Compiled for 1, 2 and 8 devices.
def test_full_train_step_matches_across_device_counts(digits):
  """The whole step (augmentation, BatchNorm, optimizer) is device-count invariant."""
  config = tiny_config()
  params = []
  for devices in (jax.devices()[:1], jax.devices()[:8]):
    mesh, _, state, step = _setup(config, devices)
    for i in range(3):
      rows = np.arange(64 * i, 64 * (i + 1))
      batch = sharding.to_global(mesh, splits.batch_at(digits["train"], rows), 64)
      state, _, _ = step(state, batch, np.float32(0.05), {})
    params.append(jax.device_get(state.params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), *params)


def test_predict_sees_every_id_once_and_scores_are_the_entropy_of_eval_logits(digits):
  """The sharded pass of evaluation and fresh/target scoring, on 8 devices."""
  config = tiny_config()
  mesh, model, state, _ = _setup(config, jax.devices())
  split = digits["train"]  # 1,257 examples: batches of 104 do not divide it.

  def id_step(state, batch):
    del state
    return batch["id"].astype(jnp.float32)
  seen = steps.predict(jax.jit(id_step), state, split, mesh, 104)
  np.testing.assert_array_equal(seen, split.ids)  # Every id once, in row order.

  spec = steps.step_spec(config.dataset, config.loss)
  score_fn = jax.jit(functools.partial(steps.score_step, model=model, spec=spec,
                                       score_fn=scores.normalized_entropy))
  eval_fn = jax.jit(functools.partial(steps.eval_step, model=model, spec=spec))
  got = steps.predict(score_fn, state, split, mesh, 104)
  logits = steps.predict(eval_fn, state, split, mesh, 128)
  assert logits.shape == (1257, 10) and logits.dtype == np.float32
  np.testing.assert_allclose(got, _numpy_entropy(logits), rtol=1e-4)


@pytest.mark.slow
def test_train_step_never_mutates_its_inputs(digits):
  """The step leaves the state, batch and hyper-parameters it was given as they were: in
  particular the learning rate it injects goes into a new opt_state, not the input's."""
  config = tiny_config()  # With crop augmentation: the step draws from the state's key.
  mesh, model, state, _ = _setup(config, jax.devices()[:1])
  tx = optim.create_optimizer(config.optimizer)
  batch = sharding.to_global(mesh, splits.batch_at(digits["train"], np.arange(16)), 16)
  hparams = {"gamma": jnp.float32(2.0)}
  before = jax.tree.map(np.array, (state, batch, hparams))
  initial_lr = float(state.opt_state.hyperparams["learning_rate"])
  assert initial_lr != 0.5  # The step's learning rate differs from the state's.

  loss_fn = lambda logits, labels, gamma: losses.focal_loss(logits, labels, gamma)
  # The step reads the caller's own objects (closed over, not passed as jit arguments, which
  # jit would flatten into copies), so any mutation of them would show below; jitting it
  # whole compiles once instead of op by op (tens of seconds on CPU).
  new_state, metrics, _ = jax.jit(lambda: steps.train_step(
      state, batch, jnp.float32(0.5), hparams, model=model, tx=tx, loss_fn=loss_fn,
      score_fn=scores.normalized_entropy, spec=steps.step_spec(config.dataset, config.loss)))()

  after = jax.tree.map(np.array, (state, batch, hparams))
  assert jax.tree.structure(after) == jax.tree.structure(before)
  jax.tree.map(np.testing.assert_array_equal, after, before)
  assert float(state.opt_state.hyperparams["learning_rate"]) == initial_lr
  assert int(state.step) == 0 and set(hparams) == {"gamma"}
  # The step did act: a new state with the new learning rate and moved parameters.
  assert float(new_state.opt_state.hyperparams["learning_rate"]) == 0.5
  assert int(new_state.step) == 1 and np.isfinite(float(metrics["loss_sum"]))
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(),
                                       new_state.params, before[0].params))
  assert max(moved) > 0


@pytest.fixture(scope="module")
def one_step_trained(digits):
  """configs/test.py's state after one train step on rows 0-63 (trained BatchNorm statistics),
  that batch, and eval_step's logits of it: computed once for every score below."""
  config = tiny_config()
  mesh, model, state, step = _setup(config, jax.devices())
  spec = steps.step_spec(config.dataset, config.loss)
  host = splits.batch_at(digits["train"], np.arange(64))
  batch = sharding.to_global(mesh, host, 64)
  state, _, _ = step(state, batch, np.float32(0.1), {})
  logits = np.asarray(jax.jit(functools.partial(steps.eval_step, model=model, spec=spec))(
      state, batch))
  return model, spec, state, host, batch, logits


# reducible_loss's forward pass is `loss` (the selector subtracts the target's losses later).
@pytest.mark.parametrize("name", sorted(n for n in scores.SCORES.names()
                                         if n != scores.REDUCIBLE_LOSS))
def test_score_step_is_the_registered_score_of_eval_step_logits(name, one_step_trained):
  model, spec, state, host, batch, logits = one_step_trained
  score_fn = scores.forward_score(name)
  got = np.asarray(jax.jit(functools.partial(steps.score_step, model=model, spec=spec,
                                             score_fn=score_fn))(state, batch))
  assert got.shape == (64,) and got.dtype == np.float32
  # The score of the logits, compiled on its own (op by op, each op would compile by itself).
  np.testing.assert_allclose(got, jax.jit(score_fn)(logits, host["label"]),
                             rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(got, _numpy_scores(logits, host["label"])[name],
                             rtol=1e-4, atol=1e-6)
