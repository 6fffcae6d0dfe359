"""Real-scale offline example: He et al.'s ResNet-20 on Fashion-MNIST.

Data: Debian's `dataset-fashion-mnist` package (verified IDX files), read by
cpjax's own tfds builder; no network needed. 54,000 train / 6,000 val /
10,000 test.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  """Returns the Fashion-MNIST ResNet-20 configuration."""
  config = default.get_config()
  config.dataset.name = "fashion_mnist"  # Local IDX files, sha256-verified.
  config.dataset.val_size = 6000  # 10 % of the 60,000 training images.
  config.dataset.crop_padding = 2  # 28x28 images: pad 2, crop back to 28.
  config.dataset.flip = True  # Clothes are left/right symmetric enough.
  config.model.name = "resnet20"  # 272k parameters: CPU-friendly.
  config.optimizer.learning_rate = 0.1  # He et al.'s CIFAR ResNet rate.
  config.num_epochs = 10  # About 10 min per epoch on 2 CPU cores; use a GPU for more.
  config.eval_batch_size = 1000  # Forward passes are cheap.
  config.log_every_steps = 50  # 422 steps per epoch.
  return config
