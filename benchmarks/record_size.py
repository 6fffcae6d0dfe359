"""Size of a folder's encoded array_record conversion against the folder's image files.

  python -m benchmarks.record_size --images=1000 --classes=10

Writes `--images` generated JPEGs (random smooth colour fields with noise, ImageNet's
typical 500 x 375, quality 90: `benchmarks.host_stage.write_images`; generated, not real
photographs) into `--classes` class folders of a temporary DIR/train, converts the folder
with `cpjax.data.sources.write_records` (`--num-shards` files), and prints the bytes of the
image files, of the records directory (shards, index, dataset.json) and their ratio.
"""

import argparse
import os
import shutil
import tempfile
import time

from benchmarks import host_stage, throughput
from configs import default
from cpjax.data import sources


def directory_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(parent, f))
             for parent, _, files in os.walk(directory) for f in files)


def measure(images: int, classes: int, num_shards: int) -> dict:
  root = tempfile.mkdtemp(prefix="cpjax_record_size_")
  try:
    folder, out = os.path.join(root, "images"), os.path.join(root, "records")
    staging = os.path.join(root, "staging")
    os.makedirs(staging)
    paths = host_stage.write_images(staging, images)
    for i, path in enumerate(paths):  # Round-robin into the class folders.
      target = os.path.join(folder, "train", f"class{i % classes:03d}")
      os.makedirs(target, exist_ok=True)
      os.replace(path, os.path.join(target, os.path.basename(path)))
    dataset = default.get_config().dataset
    dataset.update({"name": "folder", "folder": folder, "image_size": 64,
                    "mean": (0.5,) * 3, "std": (0.25,) * 3})
    start = time.perf_counter()
    written = sources.write_records(dataset, out, num_shards)
    seconds = time.perf_counter() - start
    source, records = directory_bytes(folder), directory_bytes(out)
    return {"images": written["train"], "source_bytes": source, "records_bytes": records,
            "ratio": records / source, "convert_seconds": seconds}
  finally:
    shutil.rmtree(root)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--images", type=int, default=1000)
  parser.add_argument("--classes", type=int, default=10)
  parser.add_argument("--num-shards", type=int, default=4)
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  if args.images < args.num_shards or args.classes < 1:
    parser.error("--images >= --num-shards and --classes >= 1")
  results = measure(args.images, args.classes, args.num_shards)
  results["machine"], results["args"] = throughput.machine(), vars(args)
  print(f"{results['images']} generated JPEGs: files {results['source_bytes']:,} bytes, "
        f"records {results['records_bytes']:,} bytes, records / files = "
        f"{results['ratio']:.4f} (converted in {results['convert_seconds']:.1f} s)")
  throughput.write_json(args.json, results)


if __name__ == "__main__":
  main()
