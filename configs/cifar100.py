"""CIFAR-100 with the recipe of Tata et al. 2022, "Can Calibration Improve Sample
Prioritization?" (NeurIPS HITY workshop; docs/methods.md#calibration-guided-sample-prioritization).

As configs/cifar10.py with 100 classes and lr 0.1.
"""

import ml_collections

from configs import cifar10


def get_config() -> ml_collections.ConfigDict:
  """Returns Tata et al. 2022's CIFAR-100 configuration."""
  config = cifar10.get_config()
  config.dataset.name = "cifar100"  # tfds built-in; must be prepared beforehand.
  config.optimizer.learning_rate = 0.1  # Tata et al.'s CIFAR-100 rate.
  return config
