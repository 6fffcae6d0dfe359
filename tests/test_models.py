"""Model shapes and parameter counts, against counts derived by hand from layer shapes."""

import jax
import jax.numpy as jnp
import pytest

from cpjax import models


def conv(k, c_in, c_out):  # No bias (followed by BatchNorm).
  return k * k * c_in * c_out


def bn(c):  # Scale and bias.
  return 2 * c


def basic(c_in, c_out, projection):
  n = conv(3, c_in, c_out) + bn(c_out) + conv(3, c_out, c_out) + bn(c_out)
  return n + (conv(1, c_in, c_out) + bn(c_out) if projection else 0)


def bottleneck(c_in, width, projection):
  out = 4 * width
  n = conv(1, c_in, width) + bn(width) + conv(3, width, width) + bn(width)
  n += conv(1, width, out) + bn(out)
  return n + (conv(1, c_in, out) + bn(out) if projection else 0)


def kuangliu_resnet(stages, block, expansion, classes=10, c_in=3):
  n, channels = conv(3, c_in, 64) + bn(64), 64
  for stage, (blocks, width) in enumerate(zip(stages, (64, 128, 256, 512))):
    for i in range(blocks):
      out = width * expansion
      n += block(channels, width, projection=(channels != out or (stage > 0 and i == 0)))
      channels = out
  return n + channels * classes + classes


def he_cifar_resnet(n_blocks, classes=10, c_in=3):  # Option A shortcuts: no parameters.
  n, channels = conv(3, c_in, 16) + bn(16), 16
  for width in (16, 32, 64):
    for _ in range(n_blocks):
      n += basic(channels, width, projection=False)
      channels = width
  return n + 64 * classes + classes


def wrn(n_blocks, k, classes=10):
  n, channels = conv(3, 3, 16) + bn(16), 16
  for width in (16 * k, 32 * k, 64 * k):
    for i in range(n_blocks):
      n += basic(channels, width, projection=(i == 0))
      channels = width
  return n + channels * classes + classes


def count_params(name, shape, classes=10):
  model = models.create_model(name, classes)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1,) + shape)))
  return sum(x.size for x in jax.tree.leaves(variables["params"]))


@pytest.mark.parametrize("name, expected", [
    ("resnet18", kuangliu_resnet((2, 2, 2, 2), basic, 1)),
    ("resnet34", kuangliu_resnet((3, 4, 6, 3), basic, 1)),
    ("resnet50", kuangliu_resnet((3, 4, 6, 3), bottleneck, 4)),
    ("resnet110", kuangliu_resnet((3, 4, 26, 3), bottleneck, 4)),
    ("resnet20", he_cifar_resnet(3)),
    ("resnet32", he_cifar_resnet(5)),
    ("resnet56", he_cifar_resnet(9)),
    ("wrn26_10", wrn(4, 10)),
])
def test_parameter_counts_match_hand_derivation(name, expected):
  assert count_params(name, (32, 32, 3)) == expected


def test_small_cnn_count_by_hand():
  # conv 3*3*1*16 + BN 2*16; conv 3*3*16*32 + BN 2*32; 28 -> 14 -> 7: dense 7*7*32*128 + 128;
  # head 128*10 + 10.
  expected = 144 + 32 + 4608 + 64 + 1568 * 128 + 128 + 1290
  assert count_params("small_cnn", (28, 28, 1)) == expected


def test_published_counts():
  # Figures quoted in the literature: kuangliu ResNet-18 11.17M, He et al. ResNet-20 0.27M.
  assert count_params("resnet18", (32, 32, 3)) == 11_173_962
  assert round(count_params("resnet20", (32, 32, 3)) / 1e6, 2) == 0.27


def test_outputs_logits_and_penultimate_features():
  model = models.create_model("tiny", 7)  # Every model ends in the same pool -> dense head.
  x = jnp.ones((3, 28, 28, 1))
  # Jitted: eager op-by-op execution compiles every primitive (seconds each on CPU).
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  logits, features = jax.jit(model.apply)(variables, x)
  assert logits.shape == (3, 7) and features.shape == (3, 16)
  head = variables["params"]["head"]
  assert jnp.allclose(logits, features @ head["kernel"] + head["bias"], atol=1e-5)


def test_batchnorm_train_mode_updates_stats_eval_mode_does_not():
  model = models.create_model("tiny", 10)
  x = jax.random.normal(jax.random.PRNGKey(1), (16, 8, 8, 1)) * 3 + 2
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  apply = jax.jit(model.apply, static_argnames=("train", "mutable"))
  _, updated = apply(variables, x, train=True, mutable=("batch_stats",))
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), variables["batch_stats"],
                         updated["batch_stats"])
  assert all(jax.tree.leaves(changed))
  eval_a, _ = apply(variables, x[:4])
  eval_b, _ = apply(variables, x)  # Eval mode: no batch dependence.
  assert jnp.allclose(eval_a, eval_b[:4], atol=1e-6)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  model = models.create_model("tiny", 10, "bfloat16")  # Shares the ResNets' conv/norm layers.
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.ones((2, 8, 8, 3)))
  assert {x.dtype for x in jax.tree.leaves(variables["params"])} == {jnp.dtype("float32")}
  logits, _ = jax.jit(model.apply)(variables, jnp.ones((2, 8, 8, 3)))
  assert logits.dtype == jnp.float32
