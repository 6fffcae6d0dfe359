"""Per-example training losses with an optax-style signature, and their registry.

Every loss is `loss(logits [B, K], labels [B] int or [B, K] probabilities,
**hyper) -> [B]`, a pure function. `get_loss(config.loss)` binds the config's
hyper-parameters; hyper-parameters that change during training (a scheduled
focal gamma) are passed per call by the train step.
"""

from collections.abc import Callable
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

LossFn = Callable[..., jax.Array]


def _as_targets(labels: jax.Array, num_classes: int) -> jax.Array:
  """Integer class ids [B] -> one-hot [B, K]; probability targets pass through."""
  if labels.ndim == 1:
    return jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
  return labels


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """CE_i = -sum_k t_ik log softmax(z_i)_k (spec §2.1); labels int or soft."""
  if labels.ndim == 1:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  return optax.softmax_cross_entropy(logits, labels)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
}


def loss_schema() -> dict[str, Any]:
  """Config checks of the loss hyper-parameter fields (`loss.*`)."""
  return {}


def cross_field_problems(config: ml_collections.ConfigDict) -> list[str]:
  """Problems that involve the loss and other config fields."""
  del config
  return []


def get_loss(config: ml_collections.ConfigDict) -> LossFn:
  """Binds `config.loss` hyper-parameters: returns fn(logits, labels, **scheduled)."""
  return functools.partial(LOSSES[config.name])
