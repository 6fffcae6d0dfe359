"""The device stage's compiled programs and pipelining, on any machine (dataset.decode=device_cpu:
PIL on the host standing in for the GPU's decoder, the same batching, device op and sharding).

  python -m benchmarks.device_stage                            # both parts, 2 cores: ~1 min
  python -m benchmarks.device_stage --part=programs --cpu-devices=4
  python -m benchmarks.device_stage --part=overlap --decode-seconds=0.2 --batches=12

programs: writes `--images` generated JPEGs (random smooth colour fields plus noise, quality 90;
generated, not photographs) whose sides are drawn uniformly in [--min-side, --max-side] into a
folder of 4 classes, then reads `--epochs` training epochs and one evaluation pass of it
through the device stage (`--image-size` px, batches of `--batch-size` over all devices), and
counts the programs of the device op (`device_resize.crop_resize_flip`) XLA compiles, by
jax.monitoring's backend-compile events named jit(crop_resize_flip): those the reader's
`compile_ahead` compiled before the passes, and those compiled during them. A cpjax whose
reader has no `compile_ahead` compiles them all during the passes (run this file from such a
checkout to compare).

overlap: the stand-in decoder taking `--decode-seconds` more a shard (a sleep: the time a GPU
decode takes) and a stand-in step of `--step-seconds` (a sleep, after the batch's images are
ready), `--batches` training batches of `--overlap-batch` images on one device: the seconds
with prefetch_depth 2 (pipelined) and with 0 (each batch decoded, then stepped), beside the
sums n (decode + step) and n max(decode, step) + decode.
"""

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import numpy as np
from PIL import Image

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
OP_NAME = "jit(crop_resize_flip)"


def write_images(root: str, count: int, min_side: int, max_side: int, seed: int = 0) -> None:
  """`count` generated JPEGs of random sides in [min_side, max_side] in root/train/c0..c3."""
  rng = np.random.default_rng(seed)
  for i in range(count):
    folder = os.path.join(root, "train", f"c{i % 4}")
    os.makedirs(folder, exist_ok=True)
    width, height = (int(v) for v in rng.integers(min_side, max_side + 1, 2))
    low = rng.integers(0, 256, (8, 8, 3), np.uint8)
    smooth = np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), np.int16)
    noisy = np.clip(smooth + rng.integers(-12, 13, smooth.shape), 0, 255).astype(np.uint8)
    Image.fromarray(noisy).save(os.path.join(folder, f"{i:05d}.jpg"), quality=90)


class CompileCounter:
  """Backend compiles by function name from construction until `close` (jax.monitoring)."""

  def __init__(self):
    self.counts: collections.Counter = collections.Counter()
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event: str, duration: float, **kwargs) -> None:
    del duration
    if event == COMPILE_EVENT:
      self.counts[kwargs.get("fun_name")] += 1

  def close(self) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on)


def _reader(root: str, size: int, mesh, decoder=None, prefetch_depth: int = 2):
  # cpjax imported once main() has put this checkout first on the path.
  # pylint: disable=import-outside-toplevel
  from cpjax.data import folder_source, preprocess
  from cpjax.data.device_stage import packed_regions
  from cpjax.data.device_stage.reader import DeviceStageReader
  source = folder_source.FolderSource(folder_source.listing(root, "train", 0, False))
  transform = preprocess.Transform(size=size, channels=3, flip=True, seed=0)
  return source, DeviceStageReader(
      source, transform, mesh, decoder or packed_regions.HostDecoder(), num_threads=2,
      prefetch_depth=prefetch_depth)


def programs(args) -> dict:
  """The device op's compiled programs over a short device_cpu epoch (module docstring)."""
  from cpjax.runtime import sharding  # pylint: disable=import-outside-toplevel
  root = tempfile.mkdtemp(prefix="cpjax-device-programs-")
  try:
    write_images(root, args.images, args.min_side, args.max_side)
    source, reader = _reader(root, args.image_size, sharding.create_mesh())
    steps = len(source) // args.batch_size
    blocks = np.random.default_rng(1).permutation(len(source))[:steps * args.batch_size]
    blocks = blocks.reshape(steps, args.batch_size)
    counter = CompileCounter()
    start = time.perf_counter()
    ahead = hasattr(reader, "compile_ahead")
    if ahead:
      reader.compile_ahead(args.batch_size, training=True)
      reader.compile_ahead(args.batch_size, training=False)
    compiled_ahead = counter.counts[OP_NAME]
    ahead_seconds = time.perf_counter() - start
    for epoch in [*range(args.epochs), None]:
      for batch in reader.batches(blocks, epoch=epoch):
        batch["image"].block_until_ready()
    counter.close()
    total = counter.counts[OP_NAME]
    return {"images": len(source), "sides": [args.min_side, args.max_side],
            "image_size": args.image_size, "batch_size": args.batch_size,
            "devices": len(jax.devices()), "passes": args.epochs + 1, "batches": 3 * steps,
            "compile_ahead": ahead, "compiled_ahead": compiled_ahead,
            "compiled_in_passes": total - compiled_ahead, "programs": total,
            "seconds_ahead": round(ahead_seconds, 2),
            "seconds": round(time.perf_counter() - start, 2)}
  finally:
    shutil.rmtree(root, ignore_errors=True)


class SlowDecoder:
  """The stand-in decoder taking `seconds` more a shard (a GPU decode's time), by sleeping."""

  def __init__(self, seconds: float):
    from cpjax.data.device_stage import packed_regions  # pylint: disable=import-outside-toplevel
    self._inner, self.seconds = packed_regions.HostDecoder(), seconds
    self.name = f"{self._inner.name}, {seconds} s more a shard"

  def prepare(self, item, channels):
    return self._inner.prepare(item, channels)

  def decode(self, *args, **kwargs):
    time.sleep(self.seconds)
    return self._inner.decode(*args, **kwargs)

  def layouts(self, length):
    return self._inner.layouts(length)


def fed_seconds(reader, blocks: np.ndarray, step_seconds: float) -> float:
  """Seconds to take `blocks`' training batches from `reader`, each followed by a stand-in
  step: wait for its images, then sleep `step_seconds`."""
  start = time.perf_counter()
  for batch in reader.batches(blocks, epoch=1):
    batch["image"].block_until_ready()
    time.sleep(step_seconds)
  return time.perf_counter() - start


def overlap(args) -> dict:
  """Pipelined against unpipelined seconds with a slow decoder and step (module docstring)."""
  from cpjax.runtime import sharding  # pylint: disable=import-outside-toplevel
  root = tempfile.mkdtemp(prefix="cpjax-device-overlap-")
  try:
    write_images(root, 4 * args.overlap_batch, 60, 200)
    mesh = sharding.create_mesh(jax.devices()[:1])
    decoder = SlowDecoder(args.decode_seconds)
    seconds = {}
    for depth in (2, 0):
      source, reader = _reader(root, 32, mesh, decoder, prefetch_depth=depth)
      rows = np.arange(args.batches * args.overlap_batch) % len(source)
      blocks = rows.reshape(args.batches, args.overlap_batch)
      fed_seconds(reader, blocks[:2], 0.0)  # The device op compiled, the headers scanned.
      seconds[depth] = fed_seconds(reader, blocks, args.step_seconds)
    n, d, s = args.batches, args.decode_seconds, args.step_seconds
    return {"batches": n, "decode_seconds": d, "step_seconds": s,
            "pipelined_seconds": round(seconds[2], 3),
            "unpipelined_seconds": round(seconds[0], 3),
            "serial_sum": round(n * (d + s), 3), "overlapped_sum": round(n * max(d, s) + d, 3),
            "pipelined_over_unpipelined": round(seconds[2] / seconds[0], 3)}
  finally:
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", choices=("all", "programs", "overlap"), default="all")
  parser.add_argument("--cpu-devices", type=int, default=1,
                      help="JAX CPU devices (on a CPU backend; the op compiles a device)")
  parser.add_argument("--images", type=int, default=96)
  parser.add_argument("--min-side", type=int, default=24)
  parser.add_argument("--max-side", type=int, default=400)
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--batches", type=int, default=12)
  parser.add_argument("--overlap-batch", type=int, default=8)
  parser.add_argument("--decode-seconds", type=float, default=0.2)
  parser.add_argument("--step-seconds", type=float, default=0.2)
  parser.add_argument("--json", default="", help="also write the results to this file")
  args = parser.parse_args()
  jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  sys.path.insert(0, os.getcwd())  # This checkout's cpjax (run from the repository root).
  out = {}
  if args.part in ("all", "programs"):
    out["programs"] = programs(args)
    print("device op programs:", json.dumps(out["programs"]))
  if args.part in ("all", "overlap"):
    out["overlap"] = overlap(args)
    print("overlap:", json.dumps(out["overlap"]))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"jax": jax.__version__, "backend": jax.default_backend(), **out}, f, indent=1)


if __name__ == "__main__":
  main()
