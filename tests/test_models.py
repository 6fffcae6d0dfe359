"""Model shapes and parameter counts, against counts derived by hand from layer shapes;
the registry against docs/models.md; the ImageNet stem against a NumPy forward."""

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpjax import models
from cpjax.config import validation
from cpjax.models import nets
from tests import helpers


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


def kuangliu_resnet(stages, block, expansion, classes=10, c_in=3, stem_kernel=3):
  n, channels = conv(stem_kernel, c_in, 64) + bn(64), 64  # The max-pool has no parameters.
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


def imagenet_resnet(stages, block, expansion, classes=1000):  # He et al.: 7x7 stem.
  return kuangliu_resnet(stages, block, expansion, classes, stem_kernel=7)


def count_params(name, shape, classes=10):
  model = models.create_model(name, classes)
  variables = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1,) + shape)))
  return sum(x.size for x in jax.tree.leaves(variables["params"]))


@pytest.mark.slow  # Traces 8 ResNets (test_published_counts keeps two of them fast).
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
  x = np.ones((3, 28, 28, 1), np.float32)
  # Jitted, and the checks in NumPy: op by op, every jax.numpy operation compiles on its own
  # (tens of ms each on CPU, seconds for a whole net).
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  logits, features = jax.device_get(jax.jit(model.apply)(variables, x))
  assert logits.shape == (3, 7) and features.shape == (3, 16)
  head = jax.device_get(variables["params"]["head"])
  assert np.allclose(logits, features @ head["kernel"] + head["bias"], atol=1e-5)


def test_batchnorm_train_mode_updates_stats_eval_mode_does_not():
  model = models.create_model("tiny", 10)
  x = np.asarray(jax.jit(lambda key: jax.random.normal(key, (16, 8, 8, 1)) * 3 + 2)(
      jax.random.PRNGKey(1)))
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), x)
  apply = jax.jit(model.apply, static_argnames=("train", "mutable"))
  _, updated = apply(variables, x, train=True, mutable=("batch_stats",))
  changed = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))),
                         variables["batch_stats"], updated["batch_stats"])
  assert all(jax.tree.leaves(changed))
  eval_a, _ = apply(variables, x[:4])
  eval_b, _ = apply(variables, x)  # Eval mode: no batch dependence.
  assert np.allclose(eval_a, np.asarray(eval_b)[:4], atol=1e-6)


def test_bfloat16_compute_keeps_float32_params_and_logits():
  model = models.create_model("tiny", 10, "bfloat16")  # Shares the ResNets' conv/norm layers.
  variables = jax.jit(model.init)(jax.random.PRNGKey(0), np.ones((2, 8, 8, 3), np.float32))
  assert {x.dtype for x in jax.tree.leaves(variables["params"])} == {jnp.dtype("float32")}
  logits, _ = jax.jit(model.apply)(variables, np.ones((2, 8, 8, 3), np.float32))
  assert logits.dtype == jnp.float32


# torchvision's resnet18/34/50 (1,000 classes), as its model documentation lists them.
PUBLISHED_IMAGENET = {"resnet18_imagenet": 11_689_512, "resnet34_imagenet": 21_797_672,
                      "resnet50_imagenet": 25_557_032}


@pytest.mark.parametrize("name, by_hand", [
    ("resnet18_imagenet", imagenet_resnet((2, 2, 2, 2), basic, 1)),
    ("resnet34_imagenet", imagenet_resnet((3, 4, 6, 3), basic, 1)),
    ("resnet50_imagenet", imagenet_resnet((3, 4, 6, 3), bottleneck, 4)),
])
def test_imagenet_resnet_counts_match_hand_derivation_and_torchvision(name, by_hand):
  assert by_hand == PUBLISHED_IMAGENET[name]  # The closed form agrees with the literature,
  assert count_params(name, (224, 224, 3), classes=1000) == by_hand  # and the model with both.


def block_outputs(name, side, dtype="float32", classes=1000):
  """eval_shape of the model on [2, side, side, 3]: (logits, features, every residual
  block's output in order), nothing computed."""
  model = models.create_model(name, classes, dtype)
  x = jax.ShapeDtypeStruct((2, side, side, 3), jnp.float32)
  variables = jax.eval_shape(lambda x: model.init(jax.random.PRNGKey(0), x), x)
  def is_block(module, method):
    return method == "__call__" and isinstance(module, (nets.BasicBlock, nets.Bottleneck))
  (logits, features), state = jax.eval_shape(
      lambda v, x: model.apply(v, x, capture_intermediates=is_block, mutable=["intermediates"]),
      variables, x)
  blocks = sorted(state["intermediates"].items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))
  return logits, features, [out["__call__"][0] for _, out in blocks], variables


@pytest.mark.slow  # ImageNet ResNets run at 224 and 64 px.
@pytest.mark.parametrize("name, width, n_blocks", [("resnet18_imagenet", 512, 8),
                                                   ("resnet34_imagenet", 512, 16),
                                                   ("resnet50_imagenet", 2048, 16)])
@pytest.mark.parametrize("side", [224, 64])
def test_imagenet_resnets_downsample_32x(name, width, n_blocks, side):
  logits, features, blocks, _ = block_outputs(name, side)
  assert logits.shape == (2, 1000) and features.shape == (2, width)
  assert len(blocks) == n_blocks
  # The stem (7x7/2 conv, 3x3/2 max-pool) leaves side/4 for stage 1; the last stage side/32.
  assert blocks[0].shape[1:3] == (side // 4, side // 4)
  assert blocks[-1].shape == (2, side // 32, side // 32, width)


@pytest.mark.slow  # Runs every registered ResNet.
@pytest.mark.parametrize("name", sorted(n for n, s in models.MODELS.items()
                                        if getattr(s.constructor, "func", None) is nets.ResNet))
def test_declared_downsampling_of_every_resnet_is_measured(name):
  """Each registered ResNet's `downsampling` is its image side / its last block's side, at
  the image size it was made for."""
  spec = models.MODELS[name]
  _, _, blocks, _ = block_outputs(name, spec.image_size, classes=10)
  assert spec.image_size // blocks[-1].shape[1] == spec.downsampling


def test_imagenet_resnet50_bfloat16_computes_in_bfloat16_with_float32_params():
  logits, features, blocks, variables = block_outputs("resnet50_imagenet", 64, "bfloat16")
  assert {x.dtype for x in jax.tree.leaves(variables["params"])} == {jnp.dtype("float32")}
  assert {b.dtype for b in blocks} == {jnp.dtype("bfloat16")}
  assert logits.dtype == features.dtype == jnp.float32


class _Stem(nets.ResNet):
  """The ImageNet stem alone, in ResNet's own scope (its Conv_0 and BatchNorm_0)."""

  @nn.compact
  def __call__(self, x, train=False):
    return nets.STEMS["imagenet"](self, x, train)


def numpy_imagenet_stem(x, kernel):
  """torchvision's stem in NumPy float64: Conv2d(7, stride 2, padding 3), eval-mode BatchNorm
  at its initial statistics (mean 0, var 1, eps 1e-5, scale 1, bias 0), ReLU, then
  MaxPool2d(3, stride 2, padding 1)."""
  x = np.pad(np.asarray(x, np.float64), ((0, 0), (3, 3), (3, 3), (0, 0)))
  k = np.asarray(kernel, np.float64)
  out_side = (x.shape[1] - 7) // 2 + 1
  y = np.zeros((x.shape[0], out_side, out_side, k.shape[-1]))
  for i in range(out_side):
    for j in range(out_side):
      patch = x[:, 2 * i:2 * i + 7, 2 * j:2 * j + 7, :]
      y[:, i, j, :] = np.einsum("bhwc,hwco->bo", patch, k)
  y = np.maximum(y / np.sqrt(1 + 1e-5), 0)
  y = np.pad(y, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-np.inf)
  pooled_side = (y.shape[1] - 3) // 2 + 1
  return np.stack([np.stack([y[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3, :].max(axis=(1, 2))
                             for j in range(pooled_side)], 1) for i in range(pooled_side)], 1)


@pytest.mark.parametrize("side", [16, 15])  # Even and odd: the pads' placement shows.
def test_imagenet_stem_matches_a_numpy_forward(side):
  stem = _Stem()
  x = jax.random.normal(jax.random.PRNGKey(1), (2, side, side, 3))
  variables = jax.jit(stem.init)(jax.random.PRNGKey(0), x)
  out = jax.jit(stem.apply)(variables, x)
  expected = numpy_imagenet_stem(x, variables["params"]["Conv_0"]["kernel"])
  assert out.shape == expected.shape == (2, -(-side // 4), -(-side // 4), 64)
  np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


# Every name that configs, studies and checkpoints may hold: none may disappear or change.
EARLIER_NAMES = ("tiny", "small_cnn", "resnet18", "resnet34", "resnet50", "resnet110",
                 "resnet20", "resnet32", "resnet56", "wrn26_10")


def test_registry_keeps_every_earlier_name_and_each_entry_is_its_own_name():
  assert set(EARLIER_NAMES) <= set(models.MODELS)
  assert all(spec.name == name for name, spec in models.MODELS.items())
  with pytest.raises(AttributeError):  # Frozen: settings are declared once, beside the entry.
    models.MODELS["tiny"].image_size = 1


def test_docs_model_table_is_the_registry():
  with open(os.path.join(helpers.REPO, "docs", "models.md"), encoding="utf-8") as f:
    page = f.read()
  table = models.markdown_table()
  names = re.findall(r"^\| `([^`]+)` \|", table, re.MULTILINE)
  assert names == list(models.MODELS)
  assert table in page, f"docs/models.md's model table is out of date; it should read:\n{table}"


def test_unknown_model_name_gets_did_you_mean_and_the_choices():
  config = helpers.tiny_config(**{"model.name": "resnet50_imagnet"})
  with pytest.raises(validation.ConfigError) as err:
    validation.validate(config)
  message = str(err.value)
  assert "config.model.name: got 'resnet50_imagnet'; did you mean resnet50_imagenet" in message
  assert all(name in message for name in models.MODELS)
  with pytest.raises(ValueError, match="resnet50_imagnet"):
    models.create_model("resnet50_imagnet", 10)


def test_a_config_can_name_resnet50_imagenet_in_bfloat16():
  config = helpers.tiny_config(**{"model.name": "resnet50_imagenet", "model.dtype": "bfloat16",
                                  "dataset.name": "cifar10"})
  validation.validate(config)  # Raises on any problem.
  assert validation.size_warnings(config) == []  # 32 px: x32 still leaves 1 pixel.
  digits = helpers.tiny_config(**{"model.name": "resnet50_imagenet"})
  (warning,) = validation.size_warnings(digits)
  assert "resnet50_imagenet" in warning and "x32" in warning and "8 px" in warning
