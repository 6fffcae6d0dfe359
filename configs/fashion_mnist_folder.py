"""Real Fashion-MNIST through the folder path: image files of varied size, cropped on the host.

The folder is Debian's Fashion-MNIST re-encoded by scripts/fashion_mnist_to_folder.py as
PNG and JPEG files of 20-64 pixels (some RGB), in class folders. Each training image is an
Inception-style random-resized crop (area share 0.5-1, a milder range than ImageNet's
0.08-1: the 28-pixel garments fill their frame) decoded to 28 x 28 grey pixels on the
host; evaluation resizes the whole image to 28 x 28 (eval_crop_fraction 1, as the
in-memory set is evaluated uncropped). Otherwise the schedule of
configs/fashion_mnist_selection.py (small_cnn, SGD 0.05, cosine, batch 128), 4 epochs:

  python -m scripts.fashion_mnist_to_folder --out=/data/fm_folder
  python main.py --config=configs/fashion_mnist_folder.py --workdir=workdir/fm_folder \\
      --config.dataset.folder=/data/fm_folder
"""

import ml_collections

from configs import fashion_mnist_selection


def get_config() -> ml_collections.ConfigDict:
  """Returns the folder-path Fashion-MNIST configuration."""
  config = fashion_mnist_selection.get_config()
  config.dataset.name = "folder"
  config.dataset.folder = ""  # Set on the command line: scripts/fashion_mnist_to_folder.py's --out.
  config.dataset.image_size = 28  # The in-memory set's size.
  config.dataset.channels = 1  # Grey, as the in-memory set (RGB files are converted).
  config.dataset.crop_scale = (0.5, 1.0)  # See the docstring.
  config.dataset.eval_crop_fraction = 1.0  # Evaluate on the whole image, resized.
  config.num_epochs = 4  # Within ~10 minutes on 2 shared CPU cores.
  return config
