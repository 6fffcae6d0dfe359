"""Model FLOPs of a Flax image classifier, counted from its layers' shapes, and peak FLOP/s.

Model FLOPs utilisation (MFU: Chowdhery et al. 2022, "PaLM", appendix B) divides the FLOPs
the model needs by what the hardware could do in the same time. The FLOPs here are the
model's, not the compiler's: `forward_macs` runs the module once under `jax.eval_shape`
(nothing is computed or allocated) with every `nn.Conv` and `nn.Dense` call intercepted,
and sums their multiply-accumulates from the shapes:

  conv    H_out * W_out * C_out * k_h * k_w * C_in / groups
  dense   (leading dims) * d_in * d_out

BatchNorm, activations, pooling and the elementwise rest are left out, as in the usual
conventions (torchvision's published GFLOPS, fvcore): for ResNet-50 at 224 px they are
well under 1 % of the total. One forward of ResNet-50 at 224 px is about 4.1 GMAC
(torchvision documents 4.09 "GFLOPS", which are multiply-accumulates); a training step
costs 3 forwards (the backward pass computes gradients with respect to both inputs and
weights: 2 forwards' worth), and a MAC is 2 FLOPs, so training is 6 x MACs FLOPs an image.

XLA's `compiled.cost_analysis()` is not used on a GPU: there it leaves out the convolutions
that run as cuDNN custom calls, and counted 0.41 GFLOP an image for ResNet-50 training
instead of about 24.6. On XLA:CPU the convolutions are ordinary HLO and its count is close
to this one; `benchmarks/throughput.py` prints both there.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

# Dense bfloat16 tensor-core peak of one device, FLOP/s, from the vendors' data sheets (the
# SXM parts; "with sparsity" figures are twice these). Matched as a substring of
# `jax.Device.device_kind` / torch's device name, first match wins, so "H100 PCIe" comes
# before "H100".
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
)


def peak_bf16_flops(device_kind: str) -> float | None:
  """The dense bfloat16 peak of one `device_kind` device (FLOP/s), or None when unknown."""
  return next((peak for name, peak in PEAK_BF16_FLOPS if name in device_kind), None)


def _layer_macs(module: nn.Module, inputs: jax.Array, output: jax.Array) -> int:
  """Multiply-accumulates of one call of a conv or dense layer, from its shapes."""
  out = output.shape
  if isinstance(module, nn.Conv):
    kernel = math.prod(module.kernel_size)
    return math.prod(out) * kernel * inputs.shape[-1] // module.feature_group_count
  return math.prod(out) * inputs.shape[-1]  # nn.Dense: each output reads every input.


def forward_macs(model: nn.Module, image_shape: tuple[int, int, int]) -> int:
  """Multiply-accumulates of one eval-mode forward pass of `model` on one image.

  Args:
    model: a Flax module called as `model(images, train=False)`; its `nn.Conv` and
      `nn.Dense` layers are counted (layers of other kinds, e.g. a hand-written einsum,
      are not seen and count 0).
    image_shape: (height, width, channels) of one image.

  Returns:
    The summed MACs of its conv and dense layers for a batch of one image.
  """
  counted: list[int] = []

  def count(next_fun, args, kwargs, context):
    output = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and isinstance(context.module, (nn.Conv, nn.Dense)):
      counted.append(_layer_macs(context.module, args[0], output))
    return output

  def forward():
    images = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
    variables = model.init(jax.random.PRNGKey(0), images, train=False)
    counted.clear()  # `init` ran the layers once too: count the apply alone.
    return model.apply(variables, images, train=False)

  with nn.intercept_methods(count):
    jax.eval_shape(forward)
  return sum(counted)


def train_flops_per_image(model: nn.Module, image_shape: tuple[int, int, int]) -> float:
  """Model FLOPs of one training step per image: 3 forwards' MACs x 2 FLOPs a MAC."""
  return 6.0 * forward_macs(model, image_shape)


def forward_flops_per_image(model: nn.Module, image_shape: tuple[int, int, int]) -> float:
  """Model FLOPs of one forward pass per image: 2 FLOPs a MAC."""
  return 2.0 * forward_macs(model, image_shape)


def mfu(flops_per_image: float, images_per_s: float, peak_per_device: float | None,
        devices: int) -> float | None:
  """Model FLOPs utilisation: achieved model FLOP/s over the devices' summed peak; None
  when the peak is unknown."""
  if not peak_per_device:
    return None
  return flops_per_image * images_per_s / (peak_per_device * devices)
