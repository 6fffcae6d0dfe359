"""CIFAR-10 with the recipe of Tata et al. 2022, "Can Calibration Improve Sample
Prioritization?" (NeurIPS HITY workshop; docs/methods.md#calibration-guided-sample-prioritization).

ResNet-34 (CIFAR stem), SGD momentum 0.9, lr 0.01, cosine over 200 epochs
stepped per epoch, coupled weight decay 5e-4, batch 32, mean-reduced loss,
45,000 / 5,000 train / validation split; from epoch 10 on, each epoch trains on
the 10 % of training images with the highest train-pass entropy (20 % / 30 %:
--config.selection.fraction=0.2). Needs the tfds `cifar10` data in
config.dataset.data_dir (see docs/data.md: "Using CIFAR-10 / CIFAR-100 / SVHN").
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  """Returns Tata et al. 2022's CIFAR-10 configuration."""
  config = default.get_config()
  config.dataset.name = "cifar10"  # tfds built-in; must be prepared beforehand.
  config.dataset.val_size = 5000  # 45,000 / 5,000 as in Tata et al.'s code.
  config.dataset.crop_padding = 4  # RandomCrop(32, padding=4).
  config.dataset.flip = True  # RandomHorizontalFlip(0.5).
  config.model.name = "resnet34"  # Tata et al.'s "current" model.
  config.optimizer.learning_rate = 0.01  # Tata et al.'s CIFAR-10 rate.
  config.num_epochs = 200  # Tata et al.'s schedule length.
  config.batch_size = 32  # Tata et al.'s README command.
  config.eval_batch_size = 1000  # Large forward-only batches.
  config.log_every_steps = 200  # 1,407 steps per full epoch.
  config.selection.method = "top_k"  # Max-entropy subsets (their --importance_criterion entropy).
  config.selection.fraction = 0.1  # k = 4,500 of 45,000 (Tata et al. Table 1: 10 / 20 / 30 %).
  config.selection.warmup_epochs = 10  # Tata et al.'s warm-up on all data.
  # The focal-loss paper's OOD set (needs tfds svhn_cropped; "" to skip).
  config.evaluation.ood = "svhn"
  return config
