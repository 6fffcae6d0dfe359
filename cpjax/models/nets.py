"""The architectures of cpjax's registered models (cpjax.models.registry); each returns
(logits, features).

- CIFAR-stem ResNet-18/34/50/110 (kuangliu/pytorch-cifar layout;
  docs/methods.md#data-splits-and-architectures): 3x3 stem with 64 channels, no
  max-pool, four stages 64/128/256/512 with first-block strides 1/2/2/2, projection
  shortcuts (1x1 conv + BN). The image is downsampled x8 (32 -> 4).
- ImageNet-stem ResNet-18/34/50 (He et al. 2016, "Deep Residual Learning for Image
  Recognition", Table 1; torchvision's layout): a 7x7 stride-2 conv, BN, ReLU and a 3x3
  stride-2 max-pool, then the same four stages: downsampled x32 (224 -> 7). The
  bottleneck's stride sits on its 3x3 conv ("ResNet v1.5", as torchvision and flax's
  ImageNet example).
- He et al. (2016) CIFAR ResNet-20/32/56: 16/32/64 channels, 3 stages of n
  basic blocks (depth 6n+2), parameter-free shortcuts ("option A": stride-2
  subsampling and zero channel padding).
- WideResNet-26-10 as in the focal-loss code: 16-channel stem, 3 stages of
  (26-2)/6 = 4 post-activation basic blocks of width 160/320/640.
- `small_cnn`: two conv+BN+max-pool stages (16, 32 channels), a 128-unit dense
  layer and the head: about 0.2M parameters and 1.2M multiply-adds per 28x28
  image, a CPU-sized model for full-size MNIST-like studies.
- `tiny`: two conv layers, for tests.

`features` are the penultimate (pooled) activations that a meta-network or a
feature-based score may read. BatchNorm uses PyTorch's defaults (momentum 0.1
= flax 0.9, eps 1e-5); its statistics are global-batch under jit on a mesh.
"""

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")  # He init.


class _Layers(nn.Module):
  """Shared constructors for conv and BatchNorm with the right defaults."""
  dtype: jnp.dtype = jnp.float32

  def conv(self, features: int, kernel: int = 3, stride: int = 1, name=None):
    return nn.Conv(features, (kernel, kernel), (stride, stride), padding=kernel // 2,
                   use_bias=False, kernel_init=_conv_init, dtype=self.dtype, name=name)

  def norm(self, train: bool, name=None):
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                        dtype=self.dtype, name=name)


class BasicBlock(_Layers):
  """Two 3x3 convs; projection shortcut when the shape changes
  (docs/methods.md#data-splits-and-architectures)."""
  features: int = 64
  stride: int = 1
  shortcut: str = "projection"  # or "zero_pad" (He et al. option A)
  expansion = 1

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    y = nn.relu(self.norm(train)(self.conv(self.features, 3, self.stride)(x)))
    y = self.norm(train)(self.conv(self.features)(y))
    return nn.relu(y + _shortcut(self, x, self.features, self.stride, train))


class Bottleneck(_Layers):
  """1x1 -> 3x3 (strided) -> 1x1 with 4x expansion, projection shortcut."""
  features: int = 64
  stride: int = 1
  shortcut: str = "projection"
  expansion = 4

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    y = nn.relu(self.norm(train)(self.conv(self.features, 1)(x)))
    y = nn.relu(self.norm(train)(self.conv(self.features, 3, self.stride)(y)))
    y = self.norm(train)(self.conv(self.features * 4, 1)(y))
    return nn.relu(y + _shortcut(self, x, self.features * 4, self.stride, train))


def _shortcut(block: _Layers, x: jax.Array, features: int, stride: int,
              train: bool) -> jax.Array:
  """Identity, or the block's shortcut when stride or width changes."""
  if stride == 1 and x.shape[-1] == features:
    return x
  if block.shortcut == "zero_pad":  # Parameter-free: subsample, pad channels.
    x = x[:, ::stride, ::stride, :]
    extra = features - x.shape[-1]
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (extra // 2, extra - extra // 2)))
  return block.norm(train, name="shortcut_bn")(
      block.conv(features, 1, stride, name="shortcut_conv")(x))


def _cifar_stem(net: "ResNet", x: jax.Array, train: bool) -> jax.Array:
  """3x3 conv, stride 1 -> BN -> ReLU: the image keeps its size."""
  return nn.relu(net.norm(train)(net.conv(net.stem_width)(x)))


def _imagenet_stem(net: "ResNet", x: jax.Array, train: bool) -> jax.Array:
  """7x7 conv, stride 2 -> BN -> ReLU -> 3x3 max-pool, stride 2 (He et al. 2016): x4.

  Padding 3 and 1 on each side, as torchvision (flax's example pads the pool "SAME", on
  the bottom/right only); max-pool pads with -inf, so a pad never wins.
  """
  x = nn.relu(net.norm(train)(net.conv(net.stem_width, 7, 2)(x)))
  return nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))


STEMS = {"cifar": _cifar_stem, "imagenet": _imagenet_stem}


class ResNet(_Layers):
  """Stem -> stages of blocks -> global average pool -> linear head."""
  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  stage_widths: Sequence[int] = (64, 128, 256, 512)
  block: Callable[..., nn.Module] = BasicBlock
  stem_width: int = 64
  stem: str = "cifar"  # A key of STEMS.
  shortcut: str = "projection"
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array]:
    x = STEMS[self.stem](self, x.astype(self.dtype), train)
    for stage, (blocks, width) in enumerate(zip(self.stage_sizes, self.stage_widths)):
      for i in range(blocks):
        stride = 2 if stage > 0 and i == 0 else 1
        x = self.block(features=width, stride=stride, shortcut=self.shortcut,
                       dtype=self.dtype)(x, train)
    features = jnp.mean(x, axis=(1, 2)).astype(jnp.float32)
    logits = nn.Dense(self.num_classes, dtype=jnp.float32, name="head")(features)
    return logits, features


class TinyNet(_Layers):
  """conv(8) -> BN -> ReLU -> conv(16, stride 2) -> BN -> ReLU -> pool -> dense."""
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array]:
    x = nn.relu(self.norm(train)(self.conv(8)(x.astype(self.dtype))))
    x = nn.relu(self.norm(train)(self.conv(16, 3, 2)(x)))
    features = jnp.mean(x, axis=(1, 2)).astype(jnp.float32)
    return nn.Dense(self.num_classes, name="head")(features), features


class SmallCNN(_Layers):
  """[conv(16) -> BN -> ReLU -> max-pool 2] -> [conv(32) -> ...] -> dense(128) -> ReLU -> dense.

  Flattening (not global pooling) keeps where a feature is, which small images need;
  `features` are the 128 dense activations.
  """
  num_classes: int = 10

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array]:
    x = x.astype(self.dtype)
    for width in (16, 32):
      x = nn.relu(self.norm(train)(self.conv(width)(x)))
      x = nn.max_pool(x, (2, 2), (2, 2))
    x = nn.Dense(128, dtype=self.dtype)(x.reshape((x.shape[0], -1)))
    features = nn.relu(x).astype(jnp.float32)
    return nn.Dense(self.num_classes, dtype=jnp.float32, name="head")(features), features
