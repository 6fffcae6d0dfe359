"""The registered models: one `ModelSpec` per `config.model.name`, in the registry `MODELS`.

`MODELS` (a cpjax.registry.Registry) is the single list the rest of cpjax reads: config
validation takes the valid names and the did-you-mean hint from it (`name_problem`), and
docs/models.md's table is `markdown_table()` (tests/test_models.py checks that they agree).
A user's module registers a model with `MODELS.register(ModelSpec(...))`
(docs/extending.md#add-a-model). A name of the form "package.module:ClassName" is not
registered: it is a user's own Flax module, built by import path (cpjax.models.custom).
"""

from collections.abc import Callable
import dataclasses
import functools

import flax.linen as nn
import jax.numpy as jnp

from cpjax import registry
from cpjax.models import custom, nets


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A registered model and the images it is made for."""
  name: str  # The value of config.model.name.
  constructor: Callable[..., nn.Module]  # Called with num_classes= and dtype= (compute dtype).
  image_size: int  # The image side (pixels) the architecture was designed for.
  downsampling: int  # Image side / side of the last feature map, before global pooling.
  doc: str  # One line, for docs/models.md's table.
  settings: tuple[registry.Setting, ...] = ()  # None: a model reads config.model's fields.


_kuangliu = functools.partial(nets.ResNet, stem="cifar")  # 3x3 stem, no max-pool: x8.
_imagenet = functools.partial(nets.ResNet, stem="imagenet")  # 7x7/2 conv + max-pool: x32.
_he_cifar = functools.partial(nets.ResNet, stage_widths=(16, 32, 64), stem_width=16,
                              shortcut="zero_pad")
_wide = functools.partial(nets.ResNet, stage_widths=(160, 320, 640), stem_width=16)
_BASIC_18, _BASIC_34 = (2, 2, 2, 2), (3, 4, 6, 3)

_SPECS = (
    ModelSpec("tiny", nets.TinyNet, 8, 2,
              "two conv+BN layers and a linear head: tests and smoke runs"),
    ModelSpec("small_cnn", nets.SmallCNN, 28, 4,
              "two conv+BN+max-pool stages and a 128-unit dense layer, 0.2M parameters"),
    ModelSpec("resnet18", functools.partial(_kuangliu, stage_sizes=_BASIC_18), 32, 8,
              "ResNet-18, CIFAR stem (3x3 conv, no max-pool), 11.2M parameters"),
    ModelSpec("resnet34", functools.partial(_kuangliu, stage_sizes=_BASIC_34), 32, 8,
              "ResNet-34, CIFAR stem, 21.3M parameters"),
    ModelSpec("resnet50", functools.partial(_kuangliu, stage_sizes=_BASIC_34,
                                            block=nets.Bottleneck), 32, 8,
              "ResNet-50 (bottleneck blocks), CIFAR stem, 23.5M parameters"),
    ModelSpec("resnet110", functools.partial(_kuangliu, stage_sizes=(3, 4, 26, 3),
                                             block=nets.Bottleneck), 32, 8,
              "ResNet-110 as the focal-loss code builds it (bottleneck [3, 4, 26, 3]), "
              "CIFAR stem, 45.9M parameters"),
    ModelSpec("resnet18_imagenet", functools.partial(_imagenet, stage_sizes=_BASIC_18),
              224, 32, "ResNet-18, ImageNet stem (7x7/2 conv, 3x3/2 max-pool), 11.7M "
              "parameters at 1,000 classes"),
    ModelSpec("resnet34_imagenet", functools.partial(_imagenet, stage_sizes=_BASIC_34),
              224, 32, "ResNet-34, ImageNet stem, 21.8M parameters at 1,000 classes"),
    ModelSpec("resnet50_imagenet", functools.partial(_imagenet, stage_sizes=_BASIC_34,
                                                     block=nets.Bottleneck),
              224, 32, "ResNet-50, ImageNet stem, 25.6M parameters at 1,000 classes"),
    ModelSpec("resnet20", functools.partial(_he_cifar, stage_sizes=(3, 3, 3)), 32, 4,
              "He et al.'s CIFAR ResNet-20 (16/32/64 channels, parameter-free shortcuts), "
              "0.27M parameters"),
    ModelSpec("resnet32", functools.partial(_he_cifar, stage_sizes=(5, 5, 5)), 32, 4,
              "He et al.'s CIFAR ResNet-32, 0.46M parameters"),
    ModelSpec("resnet56", functools.partial(_he_cifar, stage_sizes=(9, 9, 9)), 32, 4,
              "He et al.'s CIFAR ResNet-56, 0.85M parameters"),
    ModelSpec("wrn26_10", functools.partial(_wide, stage_sizes=(4, 4, 4)), 32, 4,
              "WideResNet-26-10 as the focal-loss code builds it, 36.5M parameters"),
)
_IMPORT_PATH_HINT = ("or a Flax module as 'package.module:ClassName' "
                     "(docs/extending.md#add-a-model)")
MODELS: registry.Registry[ModelSpec] = registry.Registry("model", "model",
                                                         hint=_IMPORT_PATH_HINT)
for _spec in _SPECS:
  MODELS.register(_spec)


def name_problem(name: object) -> str | None:
  """What is wrong with a `config.model.name` value, or None: a registered name, or the
  import path of a user's Flax module that imports (its output is checked later, with the
  dataset's shapes: `custom.contract_problems`)."""
  if not isinstance(name, str):
    return f"must be a string, got {name!r}"
  if name in MODELS:
    return None
  if custom.is_import_path(name):
    return custom.import_problem(name)
  return f"got {name!r}; {MODELS.choices(name)}"


def create_model(name: str, num_classes: int, dtype: str = "float32") -> nn.Module:
  """The model `name` with `num_classes` outputs, computing in `dtype` (params float32).

  Args:
    name: a registered name (`MODELS`), or "package.module:ClassName" for a user's Flax
      module (cpjax.models.custom).
    num_classes: the classifier's outputs.
    dtype: compute dtype, "float32" or "bfloat16".

  Returns:
    A module whose `apply(variables, x, train=...)` returns (float32 logits [B, K],
    penultimate features [B, d]); a user's module that returns logits alone gives None
    as features.

  Raises:
    ValueError: `name` is neither registered nor a usable import path (the message says
      which).
  """
  if name in MODELS:
    return MODELS[name].constructor(num_classes=num_classes, dtype=jnp.dtype(dtype))
  if isinstance(name, str) and custom.is_import_path(name):
    return custom.create(name, num_classes, jnp.dtype(dtype))
  raise ValueError(f"model.name: {name_problem(name)}")


def markdown_table() -> str:
  """docs/models.md's model table, one row per registered model, in registration order."""
  rows = ["| name | designed for | downsampling | model |", "|---|---|---|---|"]
  rows += [f"| `{s.name}` | {s.image_size} px | x{s.downsampling} | {s.doc} |"
           for s in MODELS.entries()]
  return "\n".join(rows)
