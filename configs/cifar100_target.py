"""Tata et al. 2022's CIFAR-100 target model: ResNet-50 + mixup (alpha 0.25) on full data."""

import ml_collections

from configs import cifar10_target


def get_config() -> ml_collections.ConfigDict:
  """Returns the CIFAR-100 target configuration."""
  config = cifar10_target.get_config()
  config.dataset.name = "cifar100"  # tfds built-in; must be prepared beforehand.
  config.optimizer.learning_rate = 0.1  # Tata et al.'s CIFAR-100 rate.
  config.loss.mixup_alpha = 0.25  # Tata et al.'s target: mixup alpha 0.25 on CIFAR-100.
  config.evaluation.ood = "svhn"  # As for CIFAR-10.
  return config
