"""Image classifiers chosen by `config.model.name`; each returns (logits, features).

  cpjax.models.nets      the architectures (CIFAR- and ImageNet-stem ResNets, small nets)
  cpjax.models.registry  one ModelSpec per registered name; create_model
  cpjax.models.custom    a user's own Flax module by import path ("package.module:Class")
"""

from cpjax.models.custom import ModelContractError, contract_problems, is_import_path
from cpjax.models.registry import MODELS, ModelSpec, create_model, markdown_table, name_problem

__all__ = ["MODELS", "ModelContractError", "ModelSpec", "contract_problems", "create_model",
           "is_import_path", "markdown_table", "name_problem"]
