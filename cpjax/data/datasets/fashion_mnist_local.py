"""Fashion-MNIST from local IDX files, verified by the sha256 of their contents.

Zalando's Fashion-MNIST (MIT licence): 60,000 train + 10,000 test real 28x28
grey images of 10 clothing classes. tfds's own `fashion_mnist` builder needs
the network, and rejects the files of Debian's `dataset-fashion-mnist`
package because Debian re-compressed them (same contents, other .gz bytes).
This builder reads the four IDX files (gzipped or not) from a local folder,
given as tfds's manual dir (the input pipeline passes Debian's folder by
default), and checks the sha256 of the *decompressed* contents.
"""

import gzip
import hashlib
import os

import etils.epath
import numpy as np
import tensorflow_datasets as tfds

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
# sha256 of the decompressed upstream files (identical in Debian's package).
_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
_SPLIT_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_verified_idx(folder: str, name: str) -> np.ndarray:
  """Reads IDX file `name` (or `name`.gz) from `folder`, checking its sha256.

  Args:
    folder: directory holding the file.
    name: IDX file name without `.gz`, one of the four Fashion-MNIST files.

  Returns:
    uint8 array: [N, 28, 28] for images, [N] for labels.

  Raises:
    FileNotFoundError: neither `name` nor `name.gz` is in `folder`.
    ValueError: the decompressed contents do not match the known sha256.
  """
  path = os.path.join(folder, name)
  if os.path.exists(path):
    with open(path, "rb") as f:
      raw = f.read()
  elif os.path.exists(path + ".gz"):
    with gzip.open(path + ".gz", "rb") as f:
      raw = f.read()
  else:
    raise FileNotFoundError(
        f"Fashion-MNIST file {name}[.gz] not found in {folder!r}. Install "
        "Debian's package (`apt-get install dataset-fashion-mnist`) or set "
        "config.dataset.manual_dir to a folder with the four IDX files.")
  digest = hashlib.sha256(raw).hexdigest()
  if digest != _SHA256[name]:
    raise ValueError(f"{path}: sha256 of the decompressed contents is {digest}, "
                     f"expected {_SHA256[name]}: not the Fashion-MNIST file.")
  ndim = raw[3]  # IDX header: 0, 0, dtype code, number of dimensions.
  dims = np.frombuffer(raw[4:4 + 4 * ndim], dtype=">u4").astype(int)
  return np.frombuffer(raw[4 + 4 * ndim:], dtype=np.uint8).reshape(dims)


class FashionMnistLocal(tfds.core.GeneratorBasedBuilder):
  """Fashion-MNIST (28x28x1, 10 classes) from local, verified IDX files."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release: 60,000 train / 10,000 test."}
  pkg_dir_path = etils.epath.Path(__file__).parent
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Pass the folder holding the four Fashion-MNIST IDX files (gzipped or "
      f"not) as the manual dir; Debian's dataset-fashion-mnist puts them in {DEFAULT_DIR}.")

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Tensor(shape=(28, 28, 1), dtype=np.uint8),
            "label": tfds.features.ClassLabel(names=[
                "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]),
            "id": tfds.features.Tensor(shape=(), dtype=np.int64),
        }),
        supervised_keys=("image", "label"),
        homepage="https://github.com/zalandoresearch/fashion-mnist",
    )

  def _split_generators(self, dl_manager: tfds.download.DownloadManager):
    folder = str(dl_manager.manual_dir)
    return {
        split: self._generate_examples(folder, *files)
        for split, files in _SPLIT_FILES.items()
    }

  def _generate_examples(self, folder: str, images_file: str, labels_file: str):
    images = read_verified_idx(folder, images_file)[..., None]
    labels = read_verified_idx(folder, labels_file)
    for i, (image, label) in enumerate(zip(images, labels)):
      yield i, {"image": image, "label": int(label), "id": i}
