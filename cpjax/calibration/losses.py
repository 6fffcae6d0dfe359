"""Per-example training losses with an optax-style signature, and their registry.

Every loss is `loss(logits [B, K], labels, **hyper) -> [B]`, a pure function;
`labels` are integer class ids [B], or probability targets [B, K] where the
loss allows them (mixup). Batch-level penalties (MMCE, DECE, s-ECE) are
computed over the whole global batch and added to every example's loss, so
the mean (or sum) over the batch is the sources' objective. Formulas, defaults
and check values: docs/methods.md#training-losses. `get_loss(config.loss)` binds
the config's hyper-parameters; epoch-dependent ones (a scheduled focal gamma)
come from `scheduled_hparams` and are passed per call by the train step.
"""

from collections.abc import Callable
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from cpjax import registry
from cpjax.calibration import surrogates

LossFn = Callable[..., jax.Array]
sg = jax.lax.stop_gradient


def _targets(labels: jax.Array, num_classes: int) -> jax.Array:
  """Integer class ids [B] -> one-hot [B, K]; probability targets pass through."""
  if labels.ndim == 1:
    return jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
  return labels


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """CE_i = -sum_k t_ik log softmax(z_i)_k (docs/methods.md#cross-entropy), from optax."""
  if labels.ndim == 1:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return optax.softmax_cross_entropy(logits, labels)


def label_smoothing(logits: jax.Array, labels: jax.Array, alpha: float,
                    convention: str = "uniform") -> jax.Array:
  """CE against smoothed targets (docs/methods.md#label-smoothing; Szegedy et al. 2016).

  uniform (PyTorch, seed, MbLS): t = (1 - alpha) onehot(y) + alpha / K.
  off_target (focal-loss paper): t_y = 1 - alpha, t_k = alpha / (K - 1), k != y.
  """
  num_classes = logits.shape[-1]
  onehot = _targets(labels, num_classes)
  if convention == "uniform":
    targets = (1.0 - alpha) * onehot + alpha / num_classes
  else:
    targets = (1.0 - alpha) * onehot + alpha / (num_classes - 1) * (1.0 - onehot)
  return optax.softmax_cross_entropy(logits, targets)


def _power(x: jax.Array, gamma: jax.Array) -> jax.Array:
  """x ** gamma for x in [0, 1], with finite gradients for every gamma >= 0.

  d/dx x^g is infinite at x = 0 for g < 1 (and 0 * inf = NaN for g = 0), so
  x = 0 takes the masked branch: 0 ** g = 0 for g > 0, 1 for g = 0.
  """
  safe = jnp.where(x > 0, x, 1.0)
  return jnp.where(x > 0, safe ** gamma, jnp.where(gamma == 0, 1.0, 0.0))


def focal_loss(logits: jax.Array, labels: jax.Array, gamma: float | jax.Array) -> jax.Array:
  """FL_i = -(1 - p_iy)^gamma log p_iy (docs/methods.md#focal-loss;
  Lin et al. 2017, Mukhoti et al. 2020).

  1 - p is computed as -expm1(log p), exact where p rounds to 1 in float32.
  The weight is not detached (as in the reference). gamma: scalar or [B].
  gamma = 0 gives cross-entropy exactly.
  """
  log_pt = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1)[:, 0]
  return -_power(-jnp.expm1(log_pt), jnp.asarray(gamma, log_pt.dtype)) * log_pt


def focal_gradient_bound(p: float, gamma: float) -> float:
  """g(p, gamma) = (1-p)^gamma - gamma p (1-p)^(gamma-1) log p (docs/methods.md#focal-loss).

  ||dFL/dw|| <= g(p, gamma) ||dCE/dw|| for last-layer weights (Mukhoti et al.
  2020, Prop. 1): focal loss shrinks the gradient where g < 1.
  """
  return (1 - p) ** gamma - gamma * p * (1 - p) ** (gamma - 1) * math.log(p)


def focal_gamma_threshold(p0: float) -> float:
  """gamma*(p0): g(p, gamma) <= 1 for all p >= p0 once gamma >= gamma*(p0).

  Proposition 2 of Mukhoti et al. 2020 (docs/methods.md#sample-dependent-focal-loss-flsd),
  with a = 1 - p0, b = p0 log p0: gamma* = a/b + W_{-1}(-(a^(1 - a/b) / b) log a) / log a,
  W_{-1} the lower branch of Lambert W (SciPy; never on the training path). The
  1e-12 keeps the argument >= -1/e under round-off, as in the reference.
  gamma*(0.2) = 4.8506 and gamma*(0.25) = 3.0702: hence FLSD's 5 and 3.
  """
  from scipy.special import lambertw
  a, b = 1.0 - p0, p0 * math.log(p0)
  arg = -(a ** (1.0 - a / b) / b) * math.log(a) + 1e-12
  return a / b + float(lambertw(arg, k=-1).real) / math.log(a)


def flsd_gamma(logits: jax.Array, labels: jax.Array, high_p_gamma: float) -> jax.Array:
  """Sample-dependent focal gamma (docs/methods.md#sample-dependent-focal-loss-flsd;
  FLSD-53 / FLSD-532 of Mukhoti et al.).

  gamma_i = 5 if p_iy < 0.2, 3 if p_iy < 0.5, else `high_p_gamma` (3 for
  FLSD-53, 2 for FLSD-532); chosen from stop_gradient(p_iy), strict "<".
  """
  pt = sg(jnp.exp(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1)[:, 0]))
  return jnp.where(pt < 0.2, 5.0, jnp.where(pt < 0.5, 3.0, high_p_gamma))


def flsd_loss(logits: jax.Array, labels: jax.Array, high_p_gamma: float) -> jax.Array:
  """Focal loss with the FLSD sample-dependent gamma (`flsd_gamma`)."""
  return focal_loss(logits, labels, flsd_gamma(logits, labels, high_p_gamma))


def brier_score(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Brier_i = sum_k (p_ik - t_ik)^2 (docs/methods.md#brier-score; Brier 1950)."""
  probs = jax.nn.softmax(logits)
  return jnp.sum((probs - _targets(labels, logits.shape[-1])) ** 2, axis=-1)


def mbls_penalty(logits: jax.Array, margin: float) -> jax.Array:
  """mean_k ReLU(max_j z_ij - z_ik - margin) per example
  (docs/methods.md#margin-based-label-smoothing-mbls; Liu et al. 2022)."""
  distances = jnp.max(logits, axis=-1, keepdims=True) - logits
  return jnp.mean(jax.nn.relu(distances - margin), axis=-1)


def mbls_loss(logits: jax.Array, labels: jax.Array, margin: float, lam: float) -> jax.Array:
  """Margin-based label smoothing: CE_i + lam * mean_k ReLU(d_ik - m)
  (docs/methods.md#margin-based-label-smoothing-mbls)."""
  return cross_entropy(logits, labels) + lam * mbls_penalty(logits, margin)


def ecp_loss(logits: jax.Array, labels: jax.Array, alpha: float) -> jax.Array:
  """Explicit confidence penalty: CE_i - alpha * mean_k(-p_ik log p_ik) (Pereyra et al. 2017).

  As the MbLS code's baseline: p clamped to [1e-10, 1 - 1e-10] inside the log.
  """
  probs = jax.nn.softmax(logits)
  clamped = jnp.clip(probs, 1e-10, 1.0 - 1e-10)
  return cross_entropy(logits, labels) - alpha * jnp.mean(-probs * jnp.log(clamped), axis=-1)


def _with_batch_penalty(logits: jax.Array, labels: jax.Array, penalty: jax.Array,
                        lam: float) -> jax.Array:
  """CE_i + lam * (one batch-level penalty), so mean_i = mean CE + lam * penalty."""
  return cross_entropy(logits, labels) + lam * penalty


def mmce_loss(logits: jax.Array, labels: jax.Array, lam: float, form: str,
              kernel_width: float) -> jax.Array:
  """CE + lam * weighted MMCE (docs/methods.md#mmce; Kumar et al. 2018)."""
  penalty = surrogates.mmce_weighted(logits, labels, kernel_width, form)
  return _with_batch_penalty(logits, labels, penalty, lam)


def ce_dece_loss(logits, labels, lam: float, num_bins: int, t_a: float, t_b: float):
  """CE + lam * DECE (docs/methods.md#ce-plus-a-calibration-surrogate: our reading of
  Wang & Golebiowski 2024's "CE-DECE")."""
  penalty = surrogates.dece(logits, labels, num_bins, t_a, t_b)
  return _with_batch_penalty(logits, labels, penalty, lam)


def ce_sece_loss(logits, labels, lam: float, bandwidth: float):
  """CE + lam * s-ECE (docs/methods.md#ce-plus-a-calibration-surrogate: "our SECE",
  our reading of Wang & Golebiowski 2024's "CE-SECE")."""
  return _with_batch_penalty(logits, labels, surrogates.sece(logits, labels, bandwidth), lam)


@dataclasses.dataclass(frozen=True)
class LossSpec:
  """A registered loss (`config.loss.name`) and the `config.loss.*` settings it reads."""
  name: str
  fn: LossFn  # fn(logits, labels, **settings, **scheduled) -> [B].
  doc: str  # One line for the docs' table: the loss and its paper.
  settings: tuple[registry.Setting, ...] = ()  # Bound by `get_loss` (those with a keyword).
  soft_targets: bool = False  # Accepts [B, K] probability targets (mixup).
  gamma_schedule: tuple[float, ...] | None = None  # FLSc: gamma per schedule phase.
  # FL_gamma-*: the focal loss with gamma-Net's per-example gamma, gamma-Net trained on this
  # meta-objective (cpjax.calibration.gamma_net, cpjax.steps.meta_train_step), which reads
  # `meta_settings` (not passed to `fn`).
  meta_objective: str | None = None
  meta_settings: tuple[registry.Setting, ...] = ()


LOSSES: registry.Registry[LossSpec] = registry.Registry("loss", "loss")

# Settings that several losses read are one object each (the registry refuses two
# different declarations of one field).
_LAMBDA = registry.Setting("surrogate_lambda", 0.5, registry.number(0.0),
                           "ce_dece/ce_sece: weight of the surrogate.", arg="lam")
_DECE = (registry.Setting("dece_bins", 15, registry.integer(1, 1000),
                          "ce_dece, flgamma_dece: soft bins M.", arg="num_bins"),
         registry.Setting("dece_t_a", 100.0, registry.number(0.0, low_open=True),
                          "ce_dece, flgamma_dece: soft-rank temperature.", arg="t_a"),
         registry.Setting("dece_t_b", 0.01, registry.number(0.0, low_open=True),
                          "ce_dece, flgamma_dece: soft-binning temperature.", arg="t_b"))
_BANDWIDTH = registry.Setting("sece_bandwidth", 0.05, registry.number(0.0, low_open=True),
                              "ce_sece, flgamma_sece: Gaussian kernel bandwidth h.",
                              arg="bandwidth")
_BOUNDARIES = registry.Setting("gamma_boundaries", (100, 250), registry.int_sequence(1),
                               "flsc531/flsc532: epochs where gamma steps down.", arg=None)

for _spec in (
    LossSpec("cross_entropy", cross_entropy, "CE", soft_targets=True),
    LossSpec("label_smoothing", label_smoothing,
             "CE against smoothed targets (Szegedy et al. 2016)", soft_targets=True, settings=(
                 registry.Setting("label_smoothing", 0.05, registry.number(0.0, 1.0),
                                  "label_smoothing: alpha.", arg="alpha"),
                 registry.Setting("ls_convention", "uniform",
                                  registry.choice(["uniform", "off_target"]),
                                  "label_smoothing: uniform (alpha/K) or off_target "
                                  "(alpha/(K-1), Mukhoti et al.).", arg="convention"))),
    LossSpec("focal", focal_loss, "-(1-p)^gamma log p (Lin et al. 2017; Mukhoti et al. 2020)",
             settings=(registry.Setting("focal_gamma", 3.0, registry.number(0.0, 20.0),
                                        "focal: fixed gamma (FL-3).", arg="gamma"),)),
    LossSpec("flsc531", focal_loss, "focal, gamma 5/3/1 by epoch (Mukhoti et al. 2020)",
             settings=(_BOUNDARIES,), gamma_schedule=(5.0, 3.0, 1.0)),
    LossSpec("flsc532", focal_loss, "focal, gamma 5/3/2 by epoch (Mukhoti et al. 2020)",
             settings=(_BOUNDARIES,), gamma_schedule=(5.0, 3.0, 2.0)),
    LossSpec("flsd53", functools.partial(flsd_loss, high_p_gamma=3.0),
             "focal, gamma per sample from p: 5 below 0.2, 3 below 0.5, else 3 "
             "(Mukhoti et al. 2020)"),
    LossSpec("flsd532", functools.partial(flsd_loss, high_p_gamma=2.0),
             "focal, gamma per sample from p: 5 below 0.2, 3 below 0.5, else 2 "
             "(Mukhoti et al. 2020)"),
    LossSpec("brier", brier_score, "sum_k (p_k - t_k)^2 (Brier 1950)", soft_targets=True),
    LossSpec("mmce", mmce_loss, "CE + lambda weighted MMCE (Kumar et al. 2018)", settings=(
        registry.Setting("mmce_lambda", 2.0, registry.number(0.0),
                         "mmce: weight of the MMCE penalty (focal-loss code).", arg="lam"),
        registry.Setting("mmce_form", "code", registry.choice(["code", "nominal"]),
                         "mmce: code (reference normalisation) or nominal (paper).",
                         arg="form"),
        registry.Setting("mmce_kernel_width", 0.4, registry.number(0.0, low_open=True),
                         "mmce: Laplacian kernel width.", arg="kernel_width"))),
    LossSpec("mbls", mbls_loss, "CE + lambda mean ReLU(d - m) (Liu et al. 2022)",
             soft_targets=True, settings=(
                 registry.Setting("mbls_margin", 10.0, registry.number(0.0),
                                  "mbls: logit-distance margin m (0 for \"m=0\").", arg="margin"),
                 registry.Setting("mbls_lambda", 0.1, registry.number(0.0),
                                  "mbls: penalty weight.", arg="lam"))),
    LossSpec("ecp", ecp_loss, "CE - alpha entropy (Pereyra et al. 2017)", soft_targets=True,
             settings=(registry.Setting("ecp_alpha", 0.1, registry.number(0.0),
                                        "ecp: entropy-penalty weight.", arg="alpha"),)),
    LossSpec("ce_dece", ce_dece_loss, "CE + lambda DECE (Bohdal et al. 2023; our reading of "
             "Wang & Golebiowski's \"CE-DECE\")", settings=(_LAMBDA, *_DECE)),
    LossSpec("ce_sece", ce_sece_loss, "CE + lambda s-ECE (\"our SECE\", Wang & Golebiowski "
             "2024)", settings=(_LAMBDA, _BANDWIDTH)),
    # Wang & Golebiowski's FL_gamma-SECE / FL_gamma-DECE (docs/methods.md#gamma-net): gamma
    # per example from gamma-Net.
    LossSpec("flgamma_sece", focal_loss, "focal with a per-example gamma from gamma-Net, "
             "meta-learned on s-ECE (Wang & Golebiowski 2024); needs dataset.meta_val_size, "
             "reads meta.*", meta_objective="sece", meta_settings=(_BANDWIDTH,)),
    LossSpec("flgamma_dece", focal_loss, "focal with a per-example gamma from gamma-Net, "
             "meta-learned on DECE (Wang & Golebiowski 2024, with Bohdal et al.'s meta step); "
             "needs dataset.meta_val_size, reads meta.*", meta_objective="dece",
             meta_settings=_DECE),
):
  LOSSES.register(_spec)


def scheduled_hparams(config: ml_collections.ConfigDict, epoch: int) -> dict[str, np.float32]:
  """Epoch-dependent loss hyper-parameters (docs/methods.md#scheduled-focal-loss-flsc), as
  host scalars the train step takes: the FLSc gamma, else {}.

  gamma = g1 for epoch < b1, g2 for b1 <= epoch < b2, g3 after
  (`config.gamma_boundaries`, (100, 250) for the 350-epoch CIFAR recipe).
  """
  schedule = LOSSES[config.name].gamma_schedule
  if schedule is None:
    return {}
  phase = sum(epoch >= b for b in config.gamma_boundaries)
  return {"gamma": np.float32(schedule[phase])}


def get_loss(config: ml_collections.ConfigDict) -> LossFn:
  """Binds `config.loss`'s fixed hyper-parameters: fn(logits, labels, **scheduled) -> [B]."""
  return functools.partial(LOSSES[config.name].fn, **LOSSES.keywords(config.name, config))
