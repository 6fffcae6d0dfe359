"""The loop's jitted steps lower for GPU and TPU on this CPU machine (jax.export, no compile).

Every step kind (train, InfoBatch-weighted train, gamma-Net meta train, eval, scoring pass),
for a ResNet and small_cnn, in float32 and bfloat16, exported for ("cuda",) and ("tpu",) with
the batch sharded over conftest's 8 forced CPU devices; and the train, scoring and eval steps
of the ImageNet-stem ResNet-50 on 224 px images in bfloat16. The exported StableHLO must hold no
host callback and no float64, and keep the batch sharded on `data`. The checker itself is
tested on modules that do hold a callback and float64, so a pass is not vacuous.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import lowering
from cpjax.runtime import sharding

BATCH = 16  # Two examples per device: the smallest batch that shards over 8.


@pytest.fixture(scope="module")
def mesh():
  assert jax.device_count() == 8, "conftest forces 8 CPU devices"
  return sharding.create_mesh()


@pytest.mark.slow  # Lowers whole train/score/eval steps of ResNet-18 and small_cnn (20 cases).
@pytest.mark.parametrize("kind", lowering.KINDS)
@pytest.mark.parametrize("dtype", lowering.DTYPES)
@pytest.mark.parametrize("model_name", ["resnet18", "small_cnn"])
def test_step_lowers_for_gpu_and_tpu(mesh, model_name, dtype, kind):
  _check_lowers(lowering.build_step(kind, model_name, dtype, "digits", BATCH, mesh), kind, dtype)


@pytest.mark.slow  # ResNet-50 steps at 224 px.
@pytest.mark.parametrize("kind", ["train", "score", "eval"])
def test_imagenet_resnet50_at_224_lowers_for_gpu_and_tpu(mesh, kind):
  """ResNet-50 with the ImageNet stem on 224 px images, bfloat16 compute, as an ImageNet
  config runs it (3-channel normalisation and the classes from cifar10's spec)."""
  step = lowering.build_step(kind, "resnet50_imagenet", "bfloat16", "cifar10", BATCH, mesh,
                             image_size=224)
  for text in _check_lowers(step, kind, "bfloat16"):
    assert lowering.parameters(text)["batch['image']"][0] == f"{BATCH}x224x224x3xui8"
    assert "bf16" in text  # Every step, eval too, runs the bfloat16 network.


def _conv_multiply_adds(side, kernel, stride, c_in, c_out, padding_counts=False):
  """(multiply-adds, output side) of a square conv with padding kernel // 2; unless
  `padding_counts`, only those that touch the image: per axis, the (output position, kernel
  tap) pairs that land inside the input."""
  pad, out = kernel // 2, (side + 2 * (kernel // 2) - kernel) // stride + 1
  pairs = sum(padding_counts or 0 <= o * stride - pad + t < side
              for o in range(out) for t in range(kernel))
  return pairs * pairs * c_in * c_out, out


def _resnet50_imagenet_multiply_adds(side, classes, padding_counts=False):
  """He et al.'s ResNet-50 written out layer by layer: the 7x7/2 stem conv, the 3x3/2 max-pool
  (no multiply-adds), [3, 4, 6, 3] bottlenecks of widths 64..512 (stride on the 3x3, a
  projection where the shape changes), the head."""
  conv = functools.partial(_conv_multiply_adds, padding_counts=padding_counts)
  total, side = conv(side, 7, 2, 3, 64)
  side, channels = -(-side // 2), 64
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
    for i in range(blocks):
      stride = 2 if stage > 0 and i == 0 else 1
      total += conv(side, 1, 1, channels, width)[0]
      mults, out = conv(side, 3, stride, width, width)
      total += mults + conv(out, 1, 1, width, 4 * width)[0]
      if stride == 2 or channels != 4 * width:
        total += conv(side, 1, stride, channels, 4 * width)[0]
      side, channels = out, 4 * width
  return total + channels * classes


@pytest.mark.slow
def test_imagenet_resnet50_eval_flops_match_a_layer_by_layer_count(mesh):
  """XLA's cost analysis of the eval step at 224 px is 2 FLOPs per multiply-add of the
  convolutions and the head, counted here layer by layer (padding excluded, as XLA counts
  it), plus the elementwise work (normalisation, BatchNorm, ReLU, residual adds, pooling):
  under 1 % more. Counting the padding too, the count is the 4.09 G multiply-adds quoted for
  torchvision's ResNet-50 at 1,000 classes."""
  assert round(_resnet50_imagenet_multiply_adds(224, 1000, padding_counts=True) / 1e9, 2) == 4.09
  step = lowering.build_step("eval", "resnet50_imagenet", "float32", "cifar10", BATCH, mesh,
                             image_size=224)
  counted = 2 * _resnet50_imagenet_multiply_adds(224, classes=10)
  assert counted <= lowering.flops_per_example(step, BATCH) <= 1.01 * counted


def _check_lowers(step, kind, dtype):
  """`step` exported for each platform: no callback or float64, batch sharded on `data`,
  state replicated, the compute dtype in the module. Returns the exported modules' text."""
  texts = []
  for platforms in lowering.PLATFORMS:
    exported = lowering.export(step, platforms)
    text = exported.mlir_module()
    assert exported.platforms == platforms and exported.nr_devices == 8
    assert lowering.problems(text) == [], (platforms, lowering.problems(text))
    assert 'sdy.mesh @mesh = <["data"=8]>' in text
    params = lowering.parameters(text)
    batch = {name: p for name, p in params.items() if name.startswith("batch[")}
    # Arguments a step does not read (the ids; the eval step's labels) are pruned.
    names = {name[len("batch['"):-2] for name in batch}
    needed = {"image"} | {"infobatch_train": {"weight"},
                          "meta_train": {"meta_image", "meta_label"}}.get(kind, set())
    assert needed <= names <= set(step.args[1]), names
    for name, (tensor, attrs) in batch.items():  # Leading (batch) axis on `data`.
      assert tensor.split("x")[0] == str(BATCH), (name, tensor)
      assert '#sdy.sharding<@mesh, [{"data"}' in attrs, (name, attrs)
    state = [attrs for name, (_, attrs) in params.items() if name.startswith("state")]
    assert state and not any('"data"' in attrs for attrs in state)  # Replicated.
    if dtype == "bfloat16" and kind != "eval":
      assert "bf16" in text  # The compute dtype reached the module.
    texts.append(text)
  return texts


def test_problems_finds_host_callbacks_and_float64():
  """The checker on modules that hold what it looks for (lowered for CPU, where callbacks
  lower; export itself refuses them), and on one that holds neither."""
  def with_callback(x):
    doubled = jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct((3,), x.dtype),
                                x)
    jax.debug.print("x = {}", x)
    return doubled + 1
  spec = jax.ShapeDtypeStruct((3,), jnp.float32)
  found = lowering.problems(jax.jit(with_callback).lower(spec).as_text())
  assert len(found) == 1 and "callback" in found[0], found
  with jax.enable_x64(True):
    text = jax.export.export(jax.jit(lambda x: (x.astype(jnp.float64) * 2).astype(jnp.float32)),
                             platforms=("cuda",))(spec).mlir_module()
  found = lowering.problems(text)
  assert len(found) == 1 and "float64" in found[0], found
  clean = jax.export.export(jax.jit(lambda x: jnp.sin(x) * 2), platforms=("cuda",))(spec)
  assert lowering.problems(clean.mlir_module()) == []


def test_flops_per_example_of_a_dense_layer(mesh):
  """XLA's cost analysis, as the report reads it, on a matmul with a known count: x [B, 64]
  @ w [64, 32] is 2 * 64 * 32 FLOPs per example."""
  fn = jax.jit(lambda x, w: x @ w)
  args = (jax.ShapeDtypeStruct((BATCH, 64), jnp.float32, sharding=sharding.batch_sharded(mesh)),
          jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=sharding.replicated(mesh)))
  assert lowering.flops_per_example(lowering.Step(fn, args), BATCH) == 2 * 64 * 32
