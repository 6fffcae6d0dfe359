"""Losses against hand-worked values (docs/methods.md), NumPy references, finite differences."""

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.test_util import check_vjp
import numpy as np
import pytest
from scipy.special import lambertw
from scipy.special import log_softmax as np_log_softmax

from cpjax import models, optim, steps
from cpjax.calibration import losses, surrogates
from cpjax.config import validation
from cpjax.data import augment
from cpjax.runtime import sharding
from cpjax.selection import scores
from cpjax.training import train
from tests.helpers import read_metrics, tiny_config

Z = jnp.array([[2.0, 1.0, 0.0]])
Y = jnp.array([0])
MMCE_LOGITS = jnp.array([[3.0, 0, 0], [0, 2.0, 0], [1.0, 0, 0.5], [0, 0, 4.0]])
MMCE_LABELS = jnp.array([0, 0, 0, 2])


# The tests here compute their JAX values inside one jitted function each: op by op, every
# jax.numpy operation compiles an XLA program of its own on first use (tens of ms each on
# CPU, seconds for a test), where one program of them all compiles in a fraction of that.
# The losses are the same functions either way (the train steps only ever run them jitted).


def test_spec_check_values_cross_entropy_and_label_smoothing():
  @jax.jit
  def values(z, y):
    return (losses.cross_entropy(z, y)[0], losses.label_smoothing(z, y, 0.1, "uniform")[0],
            losses.label_smoothing(z, y, 0.1, "off_target")[0])
  ce, uniform, off_target = values(Z, Y)
  assert ce == pytest.approx(0.407606, abs=1e-5)
  assert uniform == pytest.approx(0.507606, abs=1e-5)
  assert off_target == pytest.approx(0.557606, abs=1e-5)


@pytest.mark.parametrize("gamma, expected", [(0, 0.407606), (1, 0.136450), (2, 0.045678),
                                             (3, 0.015291), (5, 0.001714)])
def test_spec_check_values_focal(gamma, expected):
  value = jax.jit(functools.partial(losses.focal_loss, gamma=gamma))(Z, Y)[0]
  assert value == pytest.approx(expected, abs=1e-5)


def test_spec_check_values_brier_mbls_mmce_dece():
  @jax.jit
  def values(z, y, z_mbls, logits, labels):
    return {"brier": losses.brier_score(z, y)[0],
            "mbls_penalty": losses.mbls_penalty(z_mbls, 10.0)[0],
            "mbls": losses.mbls_loss(z_mbls, y, 10.0, 0.1)[0],
            "mmce_code": surrogates.mmce_weighted(logits, labels, 0.4, "code"),
            "mmce_nominal": surrogates.mmce_weighted(logits, labels, 0.4, "nominal"),
            "mmce_unweighted": surrogates.mmce_unweighted(logits, labels, 0.4),
            "dece": surrogates.dece(logits, labels)}
  got = values(Z, Y, jnp.array([[12.0, 0.0, 1.0]]), MMCE_LOGITS, MMCE_LABELS)
  assert got["brier"] == pytest.approx(0.180061, abs=1e-5)
  assert got["mbls_penalty"] == pytest.approx(1.0, abs=1e-6)
  assert got["mbls"] == pytest.approx(0.1000228, abs=1e-6)
  assert got["mmce_code"] == pytest.approx(0.751428, abs=1e-5)
  assert got["mmce_nominal"] == pytest.approx(0.691121, abs=1e-5)
  assert got["mmce_unweighted"] == pytest.approx(0.024737, abs=1e-5)
  assert got["dece"] == pytest.approx(0.350997, abs=1e-5)


def g_bound(p, gamma):
  """docs/methods.md#focal-loss: g(p, gamma) = (1-p)^g - g p (1-p)^(g-1) log p."""
  return (1 - p) ** gamma - gamma * p * (1 - p) ** (gamma - 1) * np.log(p)


def gamma_star(p0):
  """docs/methods.md#sample-dependent-focal-loss-flsd / Proposition 2 of Mukhoti et al., through
  Lambert W_{-1} (SciPy)."""
  a, b = 1 - p0, p0 * np.log(p0)
  return a / b + lambertw(-(a ** (1 - a / b) / b) * np.log(a) + 1e-12, k=-1).real / np.log(a)


def test_focal_theory_values_and_lambert_w_thresholds():
  for (p, g), want in {(0.2, 5): 0.98691, (0.2, 3): 1.13002, (0.5, 3): 0.38493,
                       (0.5, 2): 0.59657}.items():
    assert losses.focal_gradient_bound(p, g) == pytest.approx(want, abs=1e-5)
    assert g_bound(p, g) == pytest.approx(want, abs=1e-5)
  assert losses.focal_gamma_threshold(0.2) == pytest.approx(4.8506, abs=1e-4)
  assert losses.focal_gamma_threshold(0.25) == pytest.approx(3.0702, abs=1e-4)
  assert gamma_star(0.1) == pytest.approx(losses.focal_gamma_threshold(0.1), rel=1e-6)


def test_flsd_gamma_thresholds_are_strict_and_detached():
  pts = np.array([0.1, 0.19, 0.21, 0.49, 0.51, 0.9])  # Two classes: p_t as given.
  logits = jnp.array(np.stack([np.log(pts), np.log(1 - pts)], -1), jnp.float32)
  labels = jnp.zeros(6, jnp.int32)

  @jax.jit
  def values(logits, labels):
    gammas = losses.flsd_gamma(logits, labels, 3.0)
    # FLSD equals fixed-gamma focal with the chosen per-example gamma, in value and
    # gradient: the gamma choice carries no gradient, the focal weight does.
    flsd = lambda z: jnp.sum(losses.flsd_loss(z, labels, 3.0))
    fixed = lambda z: jnp.sum(losses.focal_loss(z, labels, gammas))
    return (gammas, losses.flsd_gamma(logits, labels, 2.0), jax.grad(flsd)(logits),
            jax.grad(fixed)(logits))
  gammas_53, gammas_532, flsd_grad, fixed_grad = values(logits, labels)
  np.testing.assert_array_equal(gammas_53, [5, 5, 3, 3, 3, 3])
  np.testing.assert_array_equal(gammas_532, [5, 5, 3, 3, 2, 2])
  np.testing.assert_allclose(flsd_grad, fixed_grad, rtol=1e-6)


def np_reference_losses(z, y, k):
  """Plainly written NumPy versions (float64) of several losses."""
  logp = np_log_softmax(z, -1)
  p = np.exp(logp)
  onehot = np.eye(k)[y]
  ce = -logp[np.arange(len(y)), y]
  ecp = ce - 0.1 * np.mean(-p * np.log(np.clip(p, 1e-10, 1 - 1e-10)), -1)
  conf, correct = p.max(-1), (p.argmax(-1) == y).astype(float)
  kern = np.exp(-(conf[:, None] - conf[None]) ** 2 / (2 * 0.05**2))
  sece = np.mean(np.abs(kern @ correct / kern.sum(-1) - conf))
  return {"ce": ce, "brier": ((p - onehot) ** 2).sum(-1), "ecp": ecp, "sece": sece}


def test_losses_match_numpy_references():
  rng = np.random.default_rng(0)
  z = rng.normal(0, 3, (32, 5))
  y = rng.integers(0, 5, 32)
  ref = np_reference_losses(z, y, 5)

  @jax.jit
  def values(z, y):
    return {"ce": losses.cross_entropy(z, y), "brier": losses.brier_score(z, y),
            "ecp": losses.ecp_loss(z, y, 0.1), "sece": surrogates.sece(z, y, 0.05)}
  got = values(jnp.array(z, jnp.float32), jnp.array(y))
  np.testing.assert_allclose(got["ce"], ref["ce"], rtol=1e-5)
  np.testing.assert_allclose(got["brier"], ref["brier"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["ecp"], ref["ecp"], rtol=1e-5)
  assert float(got["sece"]) == pytest.approx(ref["sece"], rel=1e-4)


LOSS_FNS = {
    "cross_entropy": losses.cross_entropy,
    "label_smoothing": functools.partial(losses.label_smoothing, alpha=0.1),
    "focal_0.5": functools.partial(losses.focal_loss, gamma=0.5),
    "focal_3": functools.partial(losses.focal_loss, gamma=3.0),
    "flsd53": functools.partial(losses.flsd_loss, high_p_gamma=3.0),
    "brier": losses.brier_score,
    "mmce": functools.partial(losses.mmce_loss, lam=2.0, form="code", kernel_width=0.4),
    "mmce_nominal": functools.partial(losses.mmce_loss, lam=2.0, form="nominal", kernel_width=0.4),
    "mbls": functools.partial(losses.mbls_loss, margin=1.0, lam=0.1),
    "ecp": functools.partial(losses.ecp_loss, alpha=0.1),
    "ce_dece": functools.partial(losses.ce_dece_loss, lam=0.5, num_bins=15, t_a=100.0, t_b=0.01),
    "ce_sece": functools.partial(losses.ce_sece_loss, lam=0.5, bandwidth=0.05),
    # A wider kernel for the finite-difference test: at h = 0.05 float32 steps are too coarse.
    "ce_sece_wide": functools.partial(losses.ce_sece_loss, lam=0.5, bandwidth=0.3),
}


def _dece_slow(names):
  """ce_dece (15 steep soft bins) compiles the slowest gradient of all: `slow`. Its values
  stay in the fast set (test_spec_check_values_brier_mbls_mmce_dece, the NumPy references)."""
  return [pytest.param(n, marks=pytest.mark.slow) if n == "ce_dece" else n for n in names]


# One jitted value and gradient of the summed loss per loss (compiled once per shape), for the
# finite differences and the extreme margins below.
_VALUE_AND_GRAD = {
    name: jax.jit(jax.value_and_grad(lambda x, y, fn=fn: jnp.sum(fn(x, y))))
    for name, fn in LOSS_FNS.items()}


@pytest.mark.parametrize("name", _dece_slow(sorted(set(LOSS_FNS) - {"ce_sece"})))
def test_gradients_match_finite_differences(name):
  z = jnp.array(np.random.default_rng(1).normal(0, 1, (6, 4)), jnp.float32)
  y = jnp.array([0, 1, 2, 3, 0, 1])
  # DECE's sigmoid(100 x) and soft bins are steep: a small step and loose tolerance.
  eps, tol = (1e-3, 5e-2) if name == "ce_dece" else (1e-2, 2e-2)
  # check_grads(fn, (z,), order=1, modes=["rev"]) is check_vjp(fn, partial(jax.vjp, fn), ...):
  # the VJP of a scalar loss is the cotangent times its gradient, here from one compiled
  # program (jax.vjp of a jitted fn compiles two more).
  value_and_grad = functools.partial(_VALUE_AND_GRAD[name], y=y)
  fn = lambda logits: value_and_grad(logits)[0]
  fn_vjp = lambda logits: (fn(logits), lambda ct: (ct * np.asarray(value_and_grad(logits)[1]),))
  check_vjp(fn, fn_vjp, (z,), eps=eps, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", _dece_slow(sorted(LOSS_FNS)))
@pytest.mark.parametrize("margin", [50.0, 100.0])
def test_extreme_margins_are_finite(name, margin):
  z = jnp.array([[margin, 0.0, 0.0], [0.0, margin, 0.0], [0.0, 0.0, -margin]])
  y = jnp.array([0, 0, 2])  # Confidently right, confidently wrong, uniform-ish.
  value, grad = _VALUE_AND_GRAD[name](z, y)
  assert np.isfinite(value) and np.all(np.isfinite(grad))


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 3.0, 5.0])
def test_focal_is_finite_at_probability_exactly_one(gamma):
  z = jnp.array([[200.0, 0.0, 0.0]], jnp.float32)

  @jax.jit
  def values(x):
    value, grad = jax.value_and_grad(lambda x: jnp.sum(losses.focal_loss(x, Y, gamma)))(x)
    return jax.nn.softmax(x)[0, 0], value, grad
  p_t, value, grad = values(z)
  assert float(p_t) == 1.0  # p_t is exactly 1 in float32.
  assert np.isfinite(value) and np.all(np.isfinite(grad))
  assert float(value) == pytest.approx(0.0, abs=1e-30)


def test_identities():
  rng = np.random.default_rng(2)
  z = jnp.array(rng.normal(0, 2, (16, 10)), jnp.float32)
  y = jnp.array(rng.integers(0, 10, 16))
  images = jnp.array(rng.normal(0, 1, (16, 4, 4, 1)), jnp.float32)

  @jax.jit
  def values(z, y, images):
    onehot = jax.nn.one_hot(y, 10)
    mixed, mixed_t = augment.mixup(jax.random.PRNGKey(0), images, onehot, 0.0)  # lambda = 1.
    return {"ce": losses.cross_entropy(z, y), "ls": losses.label_smoothing(z, y, 0.0),
            "focal": losses.focal_loss(z, y, 0.0), "mbls": losses.mbls_loss(z, y, 1e6, 0.1),
            "ce_onehot": losses.cross_entropy(z, onehot),
            "brier_onehot": losses.brier_score(z, onehot), "brier": losses.brier_score(z, y),
            "targets": onehot, "mixed": mixed, "mixed_t": mixed_t}
  got = values(z, y, images)
  ce = got["ce"]
  np.testing.assert_allclose(got["ls"], ce, rtol=1e-6)
  np.testing.assert_allclose(got["focal"], ce, rtol=1e-6)
  np.testing.assert_allclose(got["mbls"], ce, rtol=1e-6)
  np.testing.assert_allclose(got["ce_onehot"], ce, rtol=1e-6)
  np.testing.assert_allclose(got["brier_onehot"], got["brier"], rtol=1e-6)
  np.testing.assert_array_equal(got["mixed"], images)
  np.testing.assert_array_equal(got["mixed_t"], got["targets"])


def test_mixup_mixes_pairs_with_one_lambda():
  @jax.jit
  def mixed_batch():
    images = jax.random.normal(jax.random.PRNGKey(5), (8, 2, 2, 1))
    targets = jnp.eye(8)  # Example i has its own class i: the targets reveal the pairing.
    return (images, *augment.mixup(jax.random.PRNGKey(3), images, targets, 0.4),
            jax.random.normal(jax.random.PRNGKey(4), (8, 8)))
  images, mixed, mixed_t, z = (np.asarray(x) for x in mixed_batch())
  lam = float(np.min(np.diag(mixed_t)))  # lam on the diagonal (1 where pi(i) = i).
  assert 0 < lam < 1
  partner = np.array([np.argmax(np.where(np.arange(8) == i, -1, row)) if row[i] < 1 else i
                      for i, row in enumerate(mixed_t)])
  np.testing.assert_array_equal(np.sort(partner), np.arange(8))  # One permutation.
  np.testing.assert_allclose(mixed, lam * images + (1 - lam) * images[partner], atol=1e-6)
  np.testing.assert_allclose(mixed_t.sum(-1), 1.0, rtol=1e-6)
  # CE against the mixed targets = lam CE(y) + (1 - lam) CE(y_pi): the reference form.
  y = np.arange(8)
  mixed_ce, ce, partner_ce = (np.asarray(x) for x in jax.jit(lambda z, t, y, y_pi: (
      losses.cross_entropy(z, t), losses.cross_entropy(z, y), losses.cross_entropy(z, y_pi)))(
          z, mixed_t, y, y[partner]))
  np.testing.assert_allclose(mixed_ce, lam * ce + (1 - lam) * partner_ce, rtol=1e-5)


JITTED_LOSS_FNS = {name: jax.jit(fn) for name, fn in LOSS_FNS.items()}


# Shapes from a few values: every new shape compiles every loss again (minutes in all).
@pytest.mark.slow  # Every loss compiled at 4 shapes.
@settings(max_examples=40, deadline=None)
@given(st.sampled_from([1, 12]), st.sampled_from([2, 7]), st.integers(0, 2**31 - 1),
       st.floats(0.1, 30.0))
def test_property_non_negative_and_shape(batch, classes, seed, scale):
  rng = np.random.default_rng(seed)
  z = jnp.array(rng.normal(0, scale, (batch, classes)), jnp.float32)
  y = jnp.array(rng.integers(0, classes, batch))
  for name, fn in JITTED_LOSS_FNS.items():
    out = fn(z, y)
    assert out.shape == (batch,), name
    # ECP subtracts an entropy bonus: CE - 0.1 mean_k(-p log p) >= -0.1 log K / K.
    floor = -0.1 * np.log(classes) / classes - 1e-6 if name == "ecp" else -1e-6
    assert np.all(np.asarray(out) >= floor), name


def test_flsc_gamma_schedule_by_epoch():
  config = tiny_config(**{"loss.name": "flsc531"}).loss
  assert [losses.scheduled_hparams(config, e)["gamma"] for e in (0, 99, 100, 249, 250, 349)] == \
      [5.0, 5.0, 3.0, 3.0, 1.0, 1.0]
  config.name = "flsc532"
  assert losses.scheduled_hparams(config, 300)["gamma"] == 2.0
  config.name = "focal"
  assert losses.scheduled_hparams(config, 0) == {}


def test_loss_config_errors_name_the_field():
  with pytest.raises(validation.ConfigError, match="mixup_alpha=0.2 needs a loss that takes "
                     "probability targets, not 'focal'; valid: brier, cross_entropy"):
    validation.validate(tiny_config(**{"loss.name": "focal", "loss.mixup_alpha": 0.2}))
  with pytest.raises(validation.ConfigError, match="config.loss.mmce_form: got 'paper'"):
    validation.validate(tiny_config(**{"loss.mmce_form": "paper"}))
  with pytest.raises(validation.ConfigError, match="must hold 2 epochs for flsc531"):
    validation.validate(
        tiny_config(**{"loss.name": "flsc531", "loss.gamma_boundaries": (5,)}))


@pytest.fixture(scope="module")
def fixed_batch():
  """A fixed batch of 32 random 8x8 images with labels, on a 1-device mesh: the loss, not the
  sharding, is under test here (test_steps checks 1 against 8 devices), and one device
  compiles each loss's step in a fraction of the time."""
  rng = np.random.default_rng(0)
  host = {"image": rng.integers(0, 256, (32, 8, 8, 1)).astype(np.uint8),
          "label": rng.integers(0, 10, 32).astype(np.int32),
          "id": np.arange(32, dtype=np.int32), "mask": np.ones(32, np.float32)}
  mesh = sharding.create_mesh(jax.devices()[:1])
  return mesh, sharding.to_global(mesh, host, 32)


@pytest.mark.slow  # A train step compiled per registered loss.
@pytest.mark.parametrize("name", sorted(n for n, s in losses.LOSSES.items()
                                         if s.meta_objective is None))
def test_every_registered_loss_lowers_its_loss_in_jitted_train_steps(name, fixed_batch):
  """One jitted steps.train_step per registered loss (its config's hyper-parameters, and
  epoch 0's scheduled ones): finite, and 5 steps on the same batch lower the summed loss.
  The FL_gamma losses train with steps.meta_train_step instead (test_gamma_net.py)."""
  mesh, batch = fixed_batch
  config = tiny_config(**{"loss.name": name, "dataset.crop_padding": 0})
  model = models.create_model("tiny", 10)
  tx = optim.create_optimizer(config.optimizer)
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, (8, 8, 1), mesh)
  step = jax.jit(functools.partial(steps.train_step, model=model, tx=tx,
                                   loss_fn=losses.get_loss(config.loss),
                                   score_fn=scores.normalized_entropy,
                                   spec=steps.step_spec(config.dataset, config.loss)))
  hparams = losses.scheduled_hparams(config.loss, 0)
  loss_sums = []
  for _ in range(6):  # The 6th step's loss is that of the parameters after 5 updates.
    state, metrics, _ = step(state, batch, np.float32(0.1), hparams)
    loss_sums.append(float(metrics["loss_sum"]))
    assert int(metrics["first_bad_step"]) == steps.NO_BAD_STEP
  assert np.all(np.isfinite(loss_sums)), loss_sums
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(state.params)))
  assert loss_sums[-1] < loss_sums[0], loss_sums


@pytest.mark.slow
def test_mixup_trains_through_the_loop_with_a_loss_chosen_by_name(tmp_path):
  """The one end-to-end run of the loss features: mixup, with a loss chosen by its name."""
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(tiny_config(**{"loss.name": "brier", "loss.mixup_alpha": 0.15,
                                          "num_epochs": 1}), workdir)
  record = read_metrics(workdir)[-1]
  assert np.isfinite(record["train_loss"]) and np.isfinite(record["val_nll"])
