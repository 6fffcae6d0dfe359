"""Static facts about each dataset cpjax knows, known before any data is read.

The registry `DATASETS` is what config validation, the steps (normalisation
statistics) and the readers consult; nothing here reads files or imports tfds.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """Static facts about a dataset, known before any data is read."""
  tfds_name: str
  image_shape: tuple[int, int, int]
  num_classes: int
  num_train: int  # Size of the full tfds `train` split.
  mean: tuple[float, ...]  # Per-channel mean of pixel values scaled to [0, 1].
  std: tuple[float, ...]  # Per-channel standard deviation, same scale.
  local: bool  # Built by a cpjax builder from local files: never downloads.
  test_split: str = "test"


DATASETS = {
    # Mean/std of the 1,437 training images (`python -m cpjax.data.input_pipeline digits`).
    "digits": DatasetSpec("digits", (8, 8, 1), 10, 1437, (0.3054,), (0.3762,), local=True),
    "fashion_mnist": DatasetSpec("fashion_mnist_local", (28, 28, 1), 10, 60000,
                                 (0.2860,), (0.3530,), local=True),
    # tfds's own builder: needs the network once (config.dataset.download=True).
    "fashion_mnist_tfds": DatasetSpec("fashion_mnist", (28, 28, 1), 10, 60000,
                                      (0.2860,), (0.3530,), local=False),
    # The CIFAR statistics of Tata et al. 2022's code
    # (docs/methods.md#data-splits-and-architectures).
    "cifar10": DatasetSpec("cifar10", (32, 32, 3), 10, 50000, (0.4914, 0.4822, 0.4465),
                           (0.2023, 0.1994, 0.2010), local=False),
    "cifar100": DatasetSpec("cifar100", (32, 32, 3), 100, 50000, (0.5071, 0.4865, 0.4409),
                            (0.2673, 0.2564, 0.2762), local=False),
    "svhn": DatasetSpec("svhn_cropped", (32, 32, 3), 10, 73257, (0.4377, 0.4438, 0.4728),
                        (0.1980, 0.2010, 0.1970), local=False),
}
