"""scikit-learn's bundled handwritten digits as a tfds dataset (no network).

1,797 real 8x8 grey images of the digits 0-9 (the UCI optical recognition
set, test part), shipped inside scikit-learn. Pixel values 0..16 are rescaled
to uint8 0..255. A fixed seeded permutation puts 1,437 images in `train` and
360 in `test`; every example carries its `id`: its index in its split.
"""

import etils.epath
import numpy as np
import tensorflow_datasets as tfds

_NUM_TEST = 360
_SPLIT_SEED = 20240531  # Fixed forever: changing it changes the dataset.


def _digits_splits() -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Returns {split: (images uint8 [N, 8, 8, 1], labels int64 [N])}."""
  from sklearn.datasets import load_digits  # Heavy import, only when building.

  digits = load_digits()
  images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
  order = np.random.default_rng(_SPLIT_SEED).permutation(len(images))
  test, train = order[:_NUM_TEST], order[_NUM_TEST:]
  return {
      "train": (images[train], digits.target[train].astype(np.int64)),
      "test": (images[test], digits.target[test].astype(np.int64)),
  }


class Digits(tfds.core.GeneratorBasedBuilder):
  """scikit-learn's handwritten digits (8x8x1, 10 classes), built offline."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release: 1,437 train / 360 test."}
  # A builder outside tfds' own tree needs its package directory spelled out.
  pkg_dir_path = etils.epath.Path(__file__).parent

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Tensor(shape=(8, 8, 1), dtype=np.uint8),
            "label": tfds.features.ClassLabel(num_classes=10),
            "id": tfds.features.Tensor(shape=(), dtype=np.int64),
        }),
        supervised_keys=("image", "label"),
        homepage="https://scikit-learn.org/stable/datasets/toy_dataset.html",
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    del dl_manager  # Nothing to download: the data ships with scikit-learn.
    return {
        name: self._generate_examples(images, labels)
        for name, (images, labels) in _digits_splits().items()
    }

  def _generate_examples(self, images: np.ndarray, labels: np.ndarray):
    for i, (image, label) in enumerate(zip(images, labels)):
      yield i, {"image": image, "label": int(label), "id": i}
