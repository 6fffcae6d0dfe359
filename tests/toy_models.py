"""Users' own Flax modules, as `--config.model.name=tests.toy_models:ClassName` names them.

`ToyNet`, `LogitsOnlyMLP` and `NoDtype` (no `dtype` field) meet cpjax's model contract
(cpjax/models/custom.py); each of the others breaks one part of it, for the tests of its error
messages.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


class ToyNet(nn.Module):
  """conv(8) -> BN -> ReLU -> mean pool -> Dense "head": (logits, features)."""
  num_classes: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> tuple[jax.Array, jax.Array]:
    x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x))
    features = jnp.mean(x, axis=(1, 2)).astype(jnp.float32)
    return nn.Dense(self.num_classes, name="head")(features), features


class LogitsOnlyMLP(nn.Module):
  """flatten -> Dense(32) -> ReLU -> Dense: logits alone, no BatchNorm (no batch_stats)."""
  num_classes: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    del train  # Nothing behaves differently in training.
    x = nn.relu(nn.Dense(32, dtype=self.dtype)(x.reshape((x.shape[0], -1))))
    return nn.Dense(self.num_classes, dtype=self.dtype)(x)


class NotAModule:
  """A plain class: not a flax.linen.Module."""


def not_a_class(num_classes, dtype):  # A function, not a Module subclass.
  return ToyNet(num_classes=num_classes, dtype=dtype)


class NoDtype(nn.Module):
  """Takes num_classes but no dtype field: a plain `Net(num_classes)`, computing in float32."""
  num_classes: int

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))


class NoNumClasses(nn.Module):
  """Its classes are a field of another name: cpjax cannot tell it the dataset's."""
  classes: int = 10
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    return nn.Dense(self.classes)(x.reshape((x.shape[0], -1)))


class WrongClasses(LogitsOnlyMLP):
  """One logit too many."""

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    return nn.Dense(self.num_classes + 1)(x.reshape((x.shape[0], -1)))


class ThreeOutputs(ToyNet):
  """(logits, features, features): not one of the two output forms."""

  def __call__(self, x: jax.Array, train: bool):
    logits, features = super().__call__(x, train)
    return logits, features, features


class WithDropout(LogitsOnlyMLP):
  """Dropout in train mode needs a random key, which cpjax does not pass."""

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    x = nn.Dropout(0.5, deterministic=not train)(x.reshape((x.shape[0], -1)))
    return nn.Dense(self.num_classes)(x)


class HalfParams(LogitsOnlyMLP):
  """bfloat16 parameters (cpjax keeps them float32)."""

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    return nn.Dense(self.num_classes, param_dtype=jnp.bfloat16)(x.reshape((x.shape[0], -1)))
