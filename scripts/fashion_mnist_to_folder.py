"""Writes Debian's Fashion-MNIST as image files in class folders, for `dataset.name=folder`.

  python -m scripts.fashion_mnist_to_folder --out=/data/fm_folder
  python main.py --config=configs/fashion_mnist_folder.py --workdir=workdir/fm_folder \\
      --config.dataset.folder=/data/fm_folder

Real images (Zalando's Fashion-MNIST, read from the four sha256-verified IDX files that the
`fashion_mnist` dataset reads), re-encoded the way a folder of collected images varies:
each image is resized (bicubic) to a side drawn from 20..64 pixels (the width within 10 %
of the height), written as PNG or JPEG (quality 90) at random, and one in ten stored as RGB
(grey in three equal channels). All draws are seeded by the image's index, so the output is
the same on every machine. Folders: OUT/train/<label>_<name>/<index>.<ext> (index in the
IDX file; the label prefix keeps the sorted class order the original label order) and
OUT/test/... likewise.
"""

import argparse
import os

import numpy as np
from PIL import Image

from cpjax.data.datasets import fashion_mnist_local

CLASSES = ("t_shirt_top", "trouser", "pullover", "dress", "coat", "sandal", "shirt",
           "sneaker", "bag", "ankle_boot")
SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def class_folder(label: int) -> str:
  return f"{label}_{CLASSES[label]}"


def write_image(image: np.ndarray, index: int, seed: int, stem: str) -> str:
  """Writes one uint8 [28, 28] image re-encoded as the module docstring says; returns its path."""
  rng = np.random.default_rng([seed, index])
  height = int(rng.integers(20, 65))
  width = int(np.clip(round(height * rng.uniform(0.9, 1.1)), 20, 64))
  picture = Image.fromarray(image, "L").resize((width, height), Image.BICUBIC)
  if rng.random() < 0.1:
    picture = picture.convert("RGB")
  if rng.random() < 0.5:
    path = stem + ".png"
    picture.save(path, format="PNG")
  else:
    path = stem + ".jpg"
    picture.save(path, format="JPEG", quality=90)
  return path


def write_split(folder: str, split: str, out: str, seed: int, limit: int = 0) -> int:
  """Writes split `split` (the first `limit` images; 0 = all); returns the images written."""
  images_file, labels_file = SPLITS[split]
  images = fashion_mnist_local.read_verified_idx(folder, images_file)
  labels = fashion_mnist_local.read_verified_idx(folder, labels_file)
  count = len(images) if not limit else min(limit, len(images))
  for label in range(len(CLASSES)):
    os.makedirs(os.path.join(out, split, class_folder(label)), exist_ok=True)
  offset = 0 if split == "train" else 10**6  # Distinct draws for the test images.
  for i in range(count):
    stem = os.path.join(out, split, class_folder(int(labels[i])), f"{i:05d}")
    write_image(images[i], offset + i, seed, stem)
  return count


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="Output folder (train/ and test/).")
  parser.add_argument("--idx_dir", default=fashion_mnist_local.DEFAULT_DIR,
                      help="Folder of the four Fashion-MNIST IDX files.")
  parser.add_argument("--seed", type=int, default=0, help="Seed of sizes and formats.")
  parser.add_argument("--limit", type=int, default=0, help="Images per split; 0 = all.")
  args = parser.parse_args()
  for split in SPLITS:
    count = write_split(args.idx_dir, split, args.out, args.seed, args.limit)
    print(f"{split}: {count} images in {os.path.join(args.out, split)}")


if __name__ == "__main__":
  main()
