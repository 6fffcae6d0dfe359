"""The loop's jitted steps lower for GPU and TPU on this CPU machine (jax.export, no compile).

Every step kind (train, InfoBatch-weighted train, gamma-Net meta train, eval, scoring pass),
for a ResNet and small_cnn, in float32 and bfloat16, exported for ("cuda",) and ("tpu",) with
the batch sharded over conftest's 8 forced CPU devices; and the train, scoring and eval steps
of the ImageNet-stem ResNet-50 on 224 px images in bfloat16. The exported StableHLO must hold no
host callback and no float64, and keep the batch sharded on `data`. The checker itself is
tested on modules that do hold a callback and float64, so a pass is not vacuous.
"""

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


@pytest.mark.parametrize("kind", lowering.KINDS)
@pytest.mark.parametrize("dtype", lowering.DTYPES)
@pytest.mark.parametrize("model_name", ["resnet18", "small_cnn"])
def test_step_lowers_for_gpu_and_tpu(mesh, model_name, dtype, kind):
  _check_lowers(lowering.build_step(kind, model_name, dtype, "digits", BATCH, mesh), kind, dtype)


@pytest.mark.parametrize("kind", ["train", "score", "eval"])
def test_imagenet_resnet50_at_224_lowers_for_gpu_and_tpu(mesh, kind):
  """ResNet-50 with the ImageNet stem on 224 px images, bfloat16 compute, as an ImageNet
  config runs it (3-channel normalisation and the classes from cifar10's spec)."""
  step = lowering.build_step(kind, "resnet50_imagenet", "bfloat16", "cifar10", BATCH, mesh,
                             image_size=224)
  for text in _check_lowers(step, kind, "bfloat16"):
    assert lowering.parameters(text)["batch['image']"][0] == f"{BATCH}x224x224x3xui8"
    assert "bf16" in text  # Every step, eval too, runs the bfloat16 network.


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
