"""Resident memory of a folder dataset's epoch as the folder grows (2,000 to 50,000 files).

  python -m benchmarks.folder_memory --sizes 2000 50000

Writes generated 16 x 16 PNGs (random pixels, 10 class folders; generated, not real) and, for
each size, starts a fresh process that resolves the folder (listing, header check, channel
statistics), builds the host stage's reader and reads one training epoch of batches of 256
through it (decode, random-resized crop to 16 px, flip) on one CPU device, in the default
worker processes. Prints the process's resident memory before the dataset is touched, its
peak during the epoch and the growth, per size: the growth should be the per-file path table
and labels (tens of bytes a file), not the images; and the decoding workers' resident memory
at the epoch's end, all of them together (their imports, and each one's copy of the source's
path table; shared-memory pages they map are counted in each).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image

_CHILD = r"""
import json, os, resource, sys
import numpy as np
from configs import default
from cpjax.data import decode_workers, host_stage, preprocess, sources, splits
from cpjax.runtime import sharding

def rss_mb(pid="self"):
  with open(f"/proc/{pid}/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

dataset = default.get_config().dataset
dataset.update({"name": "folder", "folder": sys.argv[1], "image_size": 16, "val_size": 100,
                "test_size": 100, "flip": True})
mesh = sharding.create_mesh()
start = rss_mb()
spec = sources.resolve(dataset)
reader = host_stage.PreprocessReader(sources.open_splits(dataset)["train"],
                                     preprocess.from_config(dataset, spec.image_shape, 0), mesh)
order = splits.epoch_order(0, 0, np.arange(len(reader)), 256)
peak = rss_mb()
for batch in reader.batches(order, epoch=0):
  peak = max(peak, rss_mb())
workers = sum(rss_mb(pid) for pid in decode_workers.shared_pool(reader.num_workers).pids)
print("RESULT " + json.dumps({"files": spec.num_train, "start_mb": start, "peak_mb": peak,
                              "rows_read": reader.rows_read, "workers_mb": workers,
                              "num_workers": reader.num_workers}))
"""


def write_folder(root: str, count: int) -> None:
  rng = np.random.default_rng(0)
  for i in range(count):
    folder = os.path.join(root, "train", f"c{i % 10}")
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (16, 16, 3), np.uint8)).save(
        os.path.join(folder, f"{i:06d}.png"))


def measure(root: str) -> dict:
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": repo}
  out = subprocess.run([sys.executable, "-c", _CHILD, root], env=env, cwd=repo, check=True,
                       capture_output=True, text=True).stdout
  (line,) = [s for s in out.splitlines() if s.startswith("RESULT ")]
  return json.loads(line[len("RESULT "):])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 50000])
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    print("files   start MiB   peak MiB   growth MiB   rows read   workers   workers' MiB")
    for size in args.sizes:
      root = os.path.join(tmp, str(size))
      write_folder(root, size)
      result = measure(root)
      print(f"{result['files']:6d}   {result['start_mb']:8.1f}   {result['peak_mb']:8.1f}   "
            f"{result['peak_mb'] - result['start_mb']:9.1f}   {result['rows_read']:8d}   "
            f"{result['num_workers']:7d}   {result['workers_mb']:12.1f}")


if __name__ == "__main__":
  main()
