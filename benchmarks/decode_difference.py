"""How far the device stage's pixels are from the host stage's, on the same boxes.

  python -m benchmarks.decode_difference --images=64 --out=diff.json
  python -m benchmarks.decode_difference --images=32 --width=1000 --height=750

Over a folder of generated 500 x 375 (`--width`, `--height`) quality-90 JPEGs
(benchmarks.feeds.write_folder: smooth random colour fields plus noise, not photographs), the
host stage (dataset.decode=cpu:
PIL's decode, at a reduced DCT scale where the box is 2x the output or more, then OpenCV's
resize) against the device stage with each decoder that can run here, on the same rows and
the same (seed, epoch, id) boxes and flips, at `--size` (224): the mean and the largest
absolute difference over all pixels and channels, for the training transform (epoch 1) and
the evaluation transform. Rows:

  device_cpu          PIL on the host standing in for the GPU's decoder (full-scale decode)
  device_cpu, no draft  the same against the host stage with its reduced-scale decode off:
                      the same decoded pixels on both sides, so what is left is the resize
                      (float32 against OpenCV's fixed point) and its rounding
  gpu                 nvImageCodec on the GPU (only where an NVIDIA GPU and the library are)
  nvimgcodec cpu      nvImageCodec's own calls on its CPU backend (where it is installed)
"""

import argparse
import os
import shutil
import tempfile

import numpy as np

from benchmarks import feeds, throughput
from cpjax.data import (
  host_stage,
  preprocess,
)
from cpjax.data.device_stage import decoders, nvimgcodec, packed_regions
from cpjax.data.device_stage.reader import DeviceStageReader
from cpjax.runtime import sharding


def _decoders() -> dict[str, object]:
  """The device-stage decoders that can run here, by row name."""
  out = {"device_cpu": packed_regions.HostDecoder()}
  if decoders.DECODERS["gpu"].problem() is None:
    out["gpu"] = nvimgcodec.Decoder(3)
  else:
    try:
      out["nvimgcodec cpu"] = nvimgcodec.Decoder(3, on_gpu=False)
    except ImportError:
      pass
  return out


def _difference(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
  diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
  return {"mean_abs": float(diff.mean()), "max_abs": int(diff.max()),
          "share_equal": float((diff == 0).mean()), "share_within_1": float((diff <= 1).mean())}


def measure(root: str, size: int, images: int) -> dict[str, dict]:
  source = feeds.folder_train_source(root)
  rows = np.arange(min(images, len(source)))
  mesh = sharding.create_mesh()
  out = {}
  for draft in (True, False):
    transform = preprocess.Transform(size=size, channels=3, flip=True, seed=0, jpeg_draft=draft)
    host = host_stage.PreprocessReader(source, transform, mesh, worker_kind="thread")
    reference = {epoch: host.images(rows, epoch) for epoch in (1, None)}
    for name, decoder in _decoders().items():
      if not draft and name != "device_cpu":
        continue
      reader = DeviceStageReader(source, transform, mesh, decoder)
      key = name if draft else f"{name}, no draft"
      out[key] = {("train" if epoch else "eval"): _difference(reference[epoch],
                                                              reader.images(rows, epoch))
                  for epoch in (1, None)}
      out[key]["decoder"] = decoder.name
  return out


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--images", type=int, default=64)
  parser.add_argument("--size", type=int, default=224)
  parser.add_argument("--width", type=int, default=500)
  parser.add_argument("--height", type=int, default=375)
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  root = tempfile.mkdtemp(prefix="cpjax_decode_difference_")
  try:
    feeds.write_folder(root, args.images, args.width, args.height)
    results = {"machine": throughput.machine(), "images": args.images, "size": args.size,
               "source_size": [args.width, args.height],
               "rows": measure(root, args.size, args.images)}
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(f"{'decoder vs the host stage':<28}{'pass':>6}{'mean |d|':>10}{'max |d|':>9}"
        f"{'equal':>8}{'<= 1':>8}")
  for name, row in results["rows"].items():
    for transform in ("train", "eval"):
      d = row[transform]
      print(f"{name:<28}{transform:>6}{d['mean_abs']:>10.3f}{d['max_abs']:>9d}"
            f"{d['share_equal']:>8.3f}{d['share_within_1']:>8.3f}")
  throughput.write_json(args.out, results)
  return results


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  main()
