"""gamma-Net and the bilevel meta step (docs/methods.md#gamma-net): formula, look-ahead,
meta-gradient, no leak.

References are independent of the code under test: the gamma-Net formula and the focal
loss's head gradient written out in NumPy, central finite differences of the meta-loss for
the second-order meta-gradient, and `steps.train_step` (plain focal loss with the same
gammas) for the backbone's update.
"""

import functools
import json
import os
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cpjax import models, optim, run_state, steps
from cpjax.calibration import gamma_net, losses, report
from cpjax.config import validation
from cpjax.data import augment, specs, splits
from cpjax.runtime import preemption, sharding
from cpjax.selection import scores
from cpjax.training import train
from tests import helpers
from tests.helpers import read_metrics, tiny_config

pytest_plugins = ("tests.trained_runs",)  # The shared trained runs.

STEPS = -(-(1257 - 128) // 64)  # configs/test.py less 128 meta-validation digits: 18 steps.


def _numpy_gamma(x, prototypes, projection, tau, max_gamma):
  a = x @ prototypes
  a = np.exp(a - a.max(1, keepdims=True))
  attention = a / a.sum(1, keepdims=True)
  gamma = np.abs(attention @ prototypes.T @ projection)[:, 0] / tau
  return np.minimum(gamma, max_gamma) if max_gamma else gamma


@pytest.mark.parametrize("max_gamma", [0.0, 1.5])
def test_gamma_net_is_the_formula_of_the_slides(max_gamma):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 5)).astype(np.float32)
  net = gamma_net.GammaNet(num_prototypes=3, temperature=0.7, max_gamma=max_gamma)
  # Jitted, as the steps run it: op by op, every operation would compile on its own.
  params = jax.jit(net.init)(jax.random.PRNGKey(0), jnp.asarray(x))["params"]
  got = np.asarray(jax.jit(net.apply)({"params": params}, jnp.asarray(x)))
  expected = _numpy_gamma(x.astype(np.float64), np.asarray(params["prototypes"], np.float64),
                          np.asarray(params["projection"], np.float64), 0.7, max_gamma)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  assert params["prototypes"].shape == (5, 3) and params["projection"].shape == (5, 1)


def test_gamma_is_non_negative_finite_and_blind_to_feature_gradients():
  net = gamma_net.GammaNet(num_prototypes=10)
  huge = np.full((4, 128), 1e30, np.float32)
  huge[1] = -1e30  # Saturated attention.

  @jax.jit  # One program (op by op, every operation would compile on its own).
  def gamma_and_feature_grad(features):
    params = net.init(jax.random.PRNGKey(1), features)["params"]
    feature_grad = jax.grad(lambda x: jnp.sum(net.apply({"params": params}, x)))(
        jnp.ones((4, 128)))
    return net.apply({"params": params}, features), feature_grad
  gamma, feature_grad = (np.asarray(x) for x in gamma_and_feature_grad(huge))
  assert np.all(np.isfinite(gamma)) and np.all(gamma >= 0) and np.all(gamma <= 10.0)
  assert np.all(feature_grad == 0)  # stop_gradient: gamma-Net never trains the backbone.


@pytest.mark.parametrize("width", [128, 512])
def test_initial_mean_gamma_is_of_order_one_whatever_the_feature_width(width):
  """The initial mean gamma is of order one (docs/methods.md#gamma-net); relu-like features."""
  x = jnp.abs(jax.random.normal(jax.random.PRNGKey(2), (256, width)))
  net = gamma_net.GammaNet(num_prototypes=10)
  mean_gamma = jax.jit(lambda key, x: jnp.mean(net.apply(net.init(key, x), x)))  # One compile.
  means = [float(mean_gamma(jax.random.PRNGKey(s), x)) for s in range(5)]
  assert 0.5 <= np.mean(means) <= 5.0, means


def _numpy_lookahead(kernel, bias, x, labels, mask, gamma, lr):
  """head - lr grad of mean_i m_i FL_i over sum m, with dFL/dz_k written out:
  dFL/dz_k = [gamma (1-p)^(gamma-1) p log p - (1-p)^gamma] (1[k=y] - p_k), p = p_y."""
  z = x @ kernel + bias
  prob = np.exp(z - z.max(1, keepdims=True))
  prob /= prob.sum(1, keepdims=True)
  p = prob[np.arange(len(labels)), labels]
  coefficient = gamma * (1 - p) ** (gamma - 1) * p * np.log(p) - (1 - p) ** gamma
  onehot = np.eye(z.shape[1])[labels]
  dz = coefficient[:, None] * (onehot - prob) * mask[:, None] / mask.sum()
  return kernel - lr * x.T @ dz, bias - lr * dz.sum(0)


def test_lookahead_is_one_hand_written_focal_step_of_the_head():
  rng = np.random.default_rng(3)
  x = rng.normal(size=(8, 6))
  labels = rng.integers(0, 4, 8)
  mask = np.array([1, 1, 1, 1, 1, 1, 0, 0], float)  # Padding rows take no part.
  gamma = rng.uniform(0.5, 4.0, 8)
  head = {"kernel": rng.normal(size=(6, 4)), "bias": rng.normal(size=4)}
  spec = steps.step_spec(tiny_config().dataset, tiny_config().loss)
  lookahead = jax.jit(steps.lookahead_head, static_argnums=6)  # Compiled, as the meta step.
  got = lookahead({k: jnp.asarray(v, jnp.float32) for k, v in head.items()},
                  jnp.asarray(x, jnp.float32), jnp.asarray(labels),
                  jnp.asarray(mask, jnp.float32), jnp.asarray(gamma, jnp.float32),
                  jnp.float32(0.3), spec)
  kernel, bias = _numpy_lookahead(head["kernel"], head["bias"], x, labels, mask, gamma, 0.3)
  np.testing.assert_allclose(got["kernel"], kernel, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got["bias"], bias, rtol=1e-4, atol=1e-5)


def _setup(objective="dece", leak=False, meta_tx=None, devices=None):
  """A TinyNet MetaTrainState on `devices` (default: 1), the jitted meta step, the pieces."""
  config = tiny_config(**{"loss.name": "focal", "dataset.crop_padding": 0})  # No crop.
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes)
  tx = optim.create_optimizer(config.optimizer)
  mesh = sharding.create_mesh(devices or jax.devices()[:1])
  net = gamma_net.GammaNet(num_prototypes=data.num_classes)
  meta_tx = meta_tx or optax.adam(1e-3)
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, data.image_shape, mesh,
                                   (net, meta_tx))
  spec = steps.step_spec(config.dataset, config.loss)
  step = jax.jit(functools.partial(
      steps.meta_train_step, model=model, gamma_net=net, tx=tx, meta_tx=meta_tx,
      objective=gamma_net.meta_objective(objective), score_fn=scores.normalized_entropy,
      spec=spec, leak_meta_gradient=leak))
  return model, net, tx, state, step, spec, mesh


def _batch(digits, mesh):
  """Train rows 0-63 and, as the meta-validation batch, rows 64-127 (full: no padding)."""
  train = splits.batch_at(digits["train"], np.arange(64))
  meta = splits.batch_at(digits["train"], np.arange(64, 128))
  return sharding.to_global(mesh, {**train, "meta_image": meta["image"],
                                   "meta_label": meta["label"]}, 64)


def _meta_loss(phi, state, model, net, spec, batch, lr, objective):
  """M(phi) composed from the documented pieces, evaluated without any gradient of phi."""
  images = augment.normalize(batch["image"], spec.mean, spec.std)  # _setup: no crop.
  variables = {"params": state.params, "batch_stats": state.batch_stats}
  (_, features), _ = model.apply(variables, images, train=True, mutable=["batch_stats"])
  gamma = net.apply({"params": phi}, features)
  head = steps.lookahead_head(state.params["head"], features, batch["label"], batch["mask"],
                              gamma, lr, spec)
  (_, meta_features), _ = model.apply(
      variables, augment.normalize(batch["meta_image"], spec.mean, spec.std), train=True,
      mutable=["batch_stats"])
  return objective(gamma_net.head_logits(meta_features, head), batch["meta_label"])


@pytest.mark.slow  # Each compiles FL_gamma's meta step (a look-ahead through the backbone).
@pytest.mark.parametrize("objective", ["dece", "sece"])
def test_meta_gradient_matches_finite_differences(objective, digits):
  """With meta_tx = SGD(1), the step moves phi by exactly -grad M(phi): compared with central
  differences of M along random directions."""
  model, net, _, state, step, spec, mesh = _setup(objective, meta_tx=optax.sgd(1.0))
  batch = _batch(digits, mesh)
  lr = np.float32(0.5)
  new_state, metrics, _ = step(state, batch, lr, {})
  grad = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                      state.meta_params, new_state.meta_params)
  loss = jax.jit(functools.partial(_meta_loss, state=state, model=model, net=net, spec=spec,
                                   batch=batch, lr=lr,
                                   objective=gamma_net.meta_objective(objective)))
  assert float(metrics["meta_loss"]) == pytest.approx(float(loss(state.meta_params)), rel=1e-5)
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grad)) > 1e-6  # Not vacuous.
  rng = np.random.default_rng(4)
  for _ in range(3):
    direction = jax.tree.map(lambda g: rng.normal(size=g.shape), grad)
    eps = 1e-2
    shifted = [jax.tree.map(lambda p, d, s=s: (p + s * eps * d).astype(np.float32),
                            state.meta_params, direction) for s in (1, -1)]
    numeric = (float(loss(shifted[0])) - float(loss(shifted[1]))) / (2 * eps)
    analytic = sum(float(np.sum(g * d)) for g, d in zip(jax.tree.leaves(grad),
                                                        jax.tree.leaves(direction)))
    assert analytic == pytest.approx(numeric, rel=0.05, abs=2e-5)


@pytest.mark.slow  # Two meta steps and a train step compiled.
def test_backbone_update_is_plain_focal_with_the_new_gammas_unless_leaking(digits):
  """No leak: theta moves exactly as `train_step` moves it on FL with gamma-Net's gammas
  (from the updated phi) as per-example constants. With the reference's leak, it does not."""
  model, net, tx, state, step, spec, mesh = _setup()
  batch = _batch(digits, mesh)
  lr = np.float32(0.05)
  new_state, metrics, _ = step(state, batch, lr, {})
  images = augment.normalize(batch["image"], spec.mean, spec.std)
  (_, features), _ = model.apply({"params": state.params, "batch_stats": state.batch_stats},
                                 images, train=True, mutable=["batch_stats"])
  gamma = net.apply({"params": new_state.meta_params}, features)
  plain = jax.jit(functools.partial(
      steps.train_step, model=model, tx=tx, loss_fn=lambda z, y: losses.focal_loss(z, y, gamma),
      score_fn=scores.normalized_entropy, spec=spec))
  plain_state = steps.TrainState(step=state.step, params=state.params,
                                 batch_stats=state.batch_stats, opt_state=state.opt_state,
                                 rng=state.rng)
  expected, expected_metrics, _ = plain(plain_state, batch, lr, {})
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               new_state.params, expected.params)
  assert float(metrics["loss_sum"]) == pytest.approx(float(expected_metrics["loss_sum"]),
                                                     rel=1e-5)
  assert float(metrics["gamma_sum"]) == pytest.approx(float(jnp.sum(gamma)), rel=1e-5)

  leaking = _setup(leak=True)[4]
  leaked, _, _ = leaking(state, batch, lr, {})
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),  # phi: the same.
               leaked.meta_params, new_state.meta_params)
  differences = [float(np.abs(a - b).max()) for a, b in zip(
      jax.tree.leaves(leaked.params), jax.tree.leaves(expected.params))]
  assert max(differences) > 1e-6  # The meta-gradient reached theta.


@pytest.mark.slow  # The meta step compiled for 1 and for 8 devices.
def test_meta_step_is_the_same_on_one_and_eight_devices(digits):
  results = []
  for devices in (jax.devices()[:1], jax.devices()[:8]):
    _, _, _, state, step, _, mesh = _setup(devices=devices)
    batch = _batch(digits, mesh)
    for _ in range(2):
      state, _, _ = step(state, batch, np.float32(0.05), {})
    results.append(jax.device_get((state.params, state.meta_params)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), *results)


def test_cycled_rows_walk_reshuffled_passes():
  """Against a second construction: the passes' permutations concatenated, then sliced."""
  walk = np.concatenate([np.random.default_rng([7, 3, p]).permutation(5) for p in range(4)])
  for step in range(5):  # Batches of 3 over 5 rows: steps 1 and 3 straddle two passes.
    np.testing.assert_array_equal(splits.cycled_rows(7, step, 5, 3),
                                  walk[3 * step:3 * step + 3])


def test_meta_validation_ids_are_disjoint_and_leave_other_runs_split_alone():
  dataset = tiny_config().dataset
  before_train, before_val = splits.carve_validation(1437, dataset.val_size, dataset.split_seed)
  unchanged = splits.split_ids(dataset)
  np.testing.assert_array_equal(unchanged["train"], before_train)
  np.testing.assert_array_equal(unchanged["val"], before_val)
  assert len(unchanged["meta_val"]) == 0
  dataset.meta_val_size = 200
  ids = splits.split_ids(dataset)
  assert len(ids["meta_val"]) == 200 and len(ids["train"]) == len(before_train) - 200
  np.testing.assert_array_equal(np.sort(np.concatenate([ids["train"], ids["meta_val"]])),
                                before_train)  # Carved from training; val untouched.
  np.testing.assert_array_equal(ids["val"], before_val)
  assert splits.num_train_examples(dataset) == len(ids["train"])


@pytest.mark.parametrize("overrides, expected", [
    ({"loss.name": "flgamma_sece"}, "meta_val_size=0 must be at least config.batch_size=64"),
    ({"dataset.meta_val_size": 100}, "set it to 0 for loss.name='cross_entropy'"),
    ({"loss.name": "flgamma_dece", "dataset.meta_val_size": 100, "num_epochs": 4,
      "selection.method": "infobatch", "selection.score": "loss", "selection.warmup_epochs": 1},
     "does not support"),
    ({"loss.name": "flgamma_dece", "dataset.meta_val_size": 1300},
     "meta_val_size=1300 must be below the 1257 training examples"),
    ({"loss.name": "flgamma_dece", "dataset.meta_val_size": 100, "loss.mixup_alpha": 0.2},
     "needs a loss that takes probability targets"),
])
def test_bad_meta_configs_fail_with_the_field_named(overrides, expected):
  with pytest.raises(validation.ConfigError, match=re.escape(expected)):
    validation.validate(tiny_config(**overrides))


META = helpers.META_RUN


def test_flgamma_run_trains_phi_and_checkpoints_it(meta_run):
  records = read_metrics(meta_run.workdir)
  assert [r["epoch"] for r in records] == [0, 1]
  assert all(np.isfinite(r["train_loss"]) for r in records)
  assert 0.0 <= records[-1]["test_ece"] <= 1.0
  saved = helpers.restore_checkpoint(meta_run.workdir)["train"]
  config = tiny_config(**META)
  mesh = sharding.create_mesh(jax.devices()[:1])
  data = specs.DATASETS[config.dataset.name]
  initial = steps.create_train_state(
      jax.random.PRNGKey(config.seed), models.create_model(config.model.name, data.num_classes),
      optim.create_optimizer(config.optimizer), data.image_shape, mesh,
      run_state.meta_parts(config.loss, config.meta, data.num_classes))
  moved = [float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
      jax.tree.leaves(saved["meta_params"]), jax.tree.leaves(initial.meta_params))]
  assert min(moved) > 0  # Adam moved every part of phi.
  counts = [v for path, v in jax.tree_util.tree_flatten_with_path(saved["meta_opt_state"])[0]
            if "count" in jax.tree_util.keystr(path)]
  assert [int(c) for c in counts] == [helpers.checkpoint_steps(meta_run.workdir)[-1]]


def test_flgamma_run_resumes_mid_epoch_exactly(meta_run, tmp_path, monkeypatch):
  """A stop 5 steps into epoch 1, then a rerun: metrics and final state (phi and its Adam
  state included) are the uninterrupted run's, bit for bit."""
  workdir = str(tmp_path / "resumed")
  stop = STEPS + 5
  monkeypatch.setattr(preemption.PreemptionGuard, "should_stop", lambda self, step: step == stop)
  with pytest.raises(preemption.Preempted):
    train.train_and_evaluate(tiny_config(**META), workdir)
  monkeypatch.undo()
  train.train_and_evaluate(tiny_config(**META), workdir)
  _assert_same_run(workdir, meta_run.workdir)


def _assert_same_run(workdir: str, reference: str) -> None:
  """Metrics but timings, and the final checkpoint (phi and its Adam state included), equal
  bit for bit."""
  assert (helpers.without_timing(read_metrics(workdir))
          == helpers.without_timing(read_metrics(reference)))
  straight, resumed = (helpers.restore_checkpoint(w) for w in (reference, workdir))
  for tree in (straight, resumed):
    del tree["selection"]["seconds"]
  jax.tree.map(np.testing.assert_array_equal, resumed, straight)


def test_flgamma_main_py_killed_with_sigkill_resumes_exactly(meta_run, tmp_path):
  """main.py on 8 devices (as `meta_run`), SIGKILLed once the checkpoint after epoch 0 is on
  disk (no chance to clean up), then rerun: the same run as the uninterrupted one."""
  workdir = str(tmp_path / "killed")
  flags = [f"--config.{k}={v}" for k, v in META.items()]
  env = helpers.subprocess_env(8)
  helpers.sigkill_once_saved(workdir, flags, STEPS, env)  # After epoch 0.
  assert not os.path.isdir(os.path.join(workdir, "checkpoints", str(2 * STEPS)))
  resumed = subprocess.run(helpers.main_command(workdir, *flags), cwd=helpers.REPO, env=env,
                           capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from" in resumed.stderr
  _assert_same_run(workdir, meta_run.workdir)


def test_report_of_an_flgamma_run_holds_its_test_gammas(meta_run, digits):
  """The report's gammas: one per test image, within gamma-Net's clamp, `correct` agreeing with
  the report's test accuracy, and the summary's statistics those of the saved gammas."""
  report_dir = os.path.join(meta_run.workdir, "report")
  saved = np.load(os.path.join(report_dir, "gamma_test.npz"))
  gamma, correct = saved["gamma"], saved["correct"]
  config = meta_run.config
  assert gamma.shape == correct.shape == (len(digits["test"]),)
  assert np.all(np.isfinite(gamma)) and np.all((gamma >= 0) & (gamma <= config.meta.max_gamma))
  # Independently: the formula in NumPy on the final checkpoint's eval-mode features.
  state = helpers.restore_checkpoint(meta_run.workdir)["train"]
  data = specs.DATASETS[config.dataset.name]
  model = models.create_model(config.model.name, data.num_classes)
  _, features = model.apply({"params": state["params"], "batch_stats": state["batch_stats"]},
                            augment.normalize(digits["test"].images, data.mean, data.std),
                            train=False)
  phi = jax.tree.map(lambda a: np.asarray(a, np.float64), state["meta_params"])
  np.testing.assert_allclose(gamma, _numpy_gamma(
      np.asarray(features, np.float64), phi["prototypes"], phi["projection"],
      config.meta.temperature, config.meta.max_gamma), rtol=1e-4, atol=1e-6)
  with open(os.path.join(report_dir, "results.json")) as f:
    results = json.load(f)
  assert correct.mean() == pytest.approx(results["metrics"]["test"]["before_ts"]["accuracy"])
  assert results["gamma"]["all"]["mean"] == pytest.approx(float(np.mean(gamma)), rel=1e-6)
  assert results["gamma"]["incorrect"]["count"] == int(np.sum(correct == 0))
  assert os.path.getsize(os.path.join(report_dir, "gamma_histogram.png")) > 1000


def test_gamma_step_is_gamma_net_on_the_eval_mode_features(digits):
  model, net, _, state, _, spec, mesh = _setup()
  batch = splits.batch_at(digits["test"], np.arange(64))
  gamma_step = jax.jit(functools.partial(steps.gamma_step, model=model, gamma_net=net, spec=spec))
  got = np.asarray(gamma_step(state, sharding.to_global(mesh, batch, 64)))
  logits, features = jax.jit(lambda state, images: model.apply(
      {"params": state.params, "batch_stats": state.batch_stats},
      augment.normalize(images, spec.mean, spec.std), train=False))(state, batch["image"])
  phi = jax.tree.map(lambda a: np.asarray(a, np.float64), state.meta_params)
  expected = _numpy_gamma(np.asarray(features, np.float64), phi["prototypes"],
                          phi["projection"], net.temperature, net.max_gamma)
  np.testing.assert_allclose(got[:, 0], expected, rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(got[:, 1], np.argmax(logits, -1) == batch["label"])


def test_gamma_summary_by_correctness_is_the_hand_worked_one():
  summary = report.gamma_summary(np.array([0.0, 1.0, 2.0, 3.0, 4.0]),
                                 np.array([1.0, 1.0, 0.0, 1.0, 0.0]))
  # all: 0..4; quantile q at position 4q, linear between neighbours.
  assert summary["all"] == pytest.approx({"count": 5, "mean": 2.0, "std": np.sqrt(2.0),
                                          "q05": 0.2, "q25": 1.0, "q50": 2.0, "q75": 3.0,
                                          "q95": 3.8})
  # correct: 0, 1, 3 (positions 2q): q25 at 0.5 -> 0.5, q75 at 1.5 -> 2, q95 at 1.9 -> 2.8.
  assert summary["correct"] == pytest.approx({
      "count": 3, "mean": 4 / 3, "std": np.sqrt(14 / 9), "q05": 0.1, "q25": 0.5, "q50": 1.0,
      "q75": 2.0, "q95": 2.8})
  assert summary["incorrect"]["count"] == 2 and summary["incorrect"]["mean"] == 3.0
  assert summary["incorrect"]["std"] == 1.0
  nobody_wrong = report.gamma_summary(np.array([1.0, 2.0]), np.array([1.0, 1.0]))
  assert nobody_wrong["incorrect"]["count"] == 0 and np.isnan(nobody_wrong["incorrect"]["mean"])
