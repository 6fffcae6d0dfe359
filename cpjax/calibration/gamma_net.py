"""gamma-Net, a per-example focal gamma from the backbone's features, and its meta-objectives.

Wang & Golebiowski, "Towards Unbiased Calibration using Meta-Regularization"
(TMLR 2024; docs/methods.md#gamma-net): for penultimate features x [B, d],

  a = x A  (A in R^{d x k}, k learned prototypes),  pi = softmax(a) row-wise,
  x~ = pi A^T  (attention reconstruction),  gamma = |x~ W| / tau  (W in R^{d x 1}),

so gamma >= 0. The backbone then trains on the focal loss with those gammas
(FL_gamma), and gamma-Net's parameters phi = {A, W} minimise a differentiable
calibration error on held-out data through a look-ahead of the classifier head
(cpjax.steps.meta_train_step). The features enter as stop_gradient: gamma-Net
reads the backbone, it never trains it.

Choices the paper leaves open (docs/methods.md#gamma-net), all configurable under `meta.*`:
k = the number of classes; A ~ N(0, 1/d); W ~ N(0, 1),
not N(0, 1/d), so that the initial gamma does not shrink with the feature
width d (x~ is a mixture of prototypes of norm ~1, so x~ W ~ N(0, |x~|^2) and
the initial mean gamma is ~0.8 |x~| / tau whatever d is); tau = 0.4; gamma
clamped to [0, 10] (0 = no clamp) so that a runaway phi cannot make the focal
weight (1 - p)^gamma vanish for every example.
"""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from cpjax.calibration import losses, surrogates

META_OBJECTIVES = ("sece", "dece")


class GammaNet(nn.Module):
  """features [B, d] -> gamma [B] >= 0 (docs/methods.md#gamma-net)."""
  num_prototypes: int = 10  # k.
  temperature: float = 0.4  # tau.
  max_gamma: float = 10.0  # Clamp gamma to [0, max_gamma]; 0 = no clamp.

  @nn.compact
  def __call__(self, features: jax.Array) -> jax.Array:
    x = jax.lax.stop_gradient(features).astype(jnp.float32)
    width = x.shape[-1]
    prototypes = self.param("prototypes", nn.initializers.normal(stddev=width ** -0.5),
                            (width, self.num_prototypes))
    projection = self.param("projection", nn.initializers.normal(stddev=1.0), (width, 1))
    attention = jax.nn.softmax(x @ prototypes, axis=-1)
    reconstruction = attention @ prototypes.T
    gamma = jnp.abs(reconstruction @ projection)[:, 0] / self.temperature
    return jnp.minimum(gamma, self.max_gamma) if self.max_gamma > 0 else gamma


def create_gamma_net(meta: ml_collections.ConfigDict, num_classes: int) -> GammaNet:
  """gamma-Net of `meta` (config.meta; num_prototypes 0 = one prototype per class)."""
  return GammaNet(num_prototypes=meta.num_prototypes or num_classes,
                  temperature=meta.temperature, max_gamma=meta.max_gamma)


MetaObjective = Callable[[jax.Array, jax.Array], jax.Array]


def create_meta_objective(loss: ml_collections.ConfigDict,
                          meta: ml_collections.ConfigDict) -> MetaObjective:
  """The meta-objective of `loss.name` (flgamma_sece / flgamma_dece), with the surrogates'
  hyper-parameters of `loss` (config.loss) and `meta.ce_weight` (config.meta)."""
  return meta_objective(losses.LOSSES[loss.name].meta_objective, meta.ce_weight,
                        loss.sece_bandwidth, loss.dece_bins, loss.dece_t_a, loss.dece_t_b)


def meta_objective(name: str, ce_weight: float = 0.0, bandwidth: float = 0.05,
                   num_bins: int = 15, t_a: float = 100.0, t_b: float = 0.01) -> MetaObjective:
  """The meta-loss of a meta-validation batch: (logits [B, K], labels [B]) -> scalar.

  sece: s-ECE (docs/methods.md#s-ece, FL_gamma-SECE); dece: DECE (docs/methods.md#dece,
  FL_gamma-DECE); plus `ce_weight` * mean cross-entropy (Meta-Calibration's CE + 0.5 DECE
  has ce_weight 1 on a DECE weight of 0.5; Wang & Golebiowski's Algorithm 1 uses the
  surrogate alone, ce_weight 0).
  """
  if name not in META_OBJECTIVES:
    raise ValueError(f"meta objective {name!r}; valid: {', '.join(META_OBJECTIVES)}")

  def objective(logits: jax.Array, labels: jax.Array) -> jax.Array:
    if name == "sece":
      value = surrogates.sece(logits, labels, bandwidth)
    else:
      value = surrogates.dece(logits, labels, num_bins, t_a, t_b)
    if ce_weight:
      value = value + ce_weight * jnp.mean(losses.cross_entropy(logits, labels))
    return value
  return objective


def head_logits(features: jax.Array, head: dict[str, jax.Array]) -> jax.Array:
  """The linear classifier head (flax nn.Dense params {"kernel", "bias"}) on `features`."""
  return features @ head["kernel"] + head["bias"]
