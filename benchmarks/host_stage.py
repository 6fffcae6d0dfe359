"""The host stage in threads and in processes against tf.data and torchvision, same run.

  python -m benchmarks.host_stage --images=512 --workers=1,2            # a 2-core machine
  python -m benchmarks.host_stage --images=4096 --workers=1,2,4,8,16 --batch-size=256

Writes `--images` generated JPEGs (random smooth colour fields, ImageNet's typical 500 x 375,
quality 90; generated, not real photographs) as a folder, then decodes, crops (Inception-style
random-resized crop, area 8-100 %, aspect 3/4-4/3) to `--size` and flips every file into
batches of `--batch-size`, for each worker count of `--workers`, with:

  cpjax threads     `host_stage.PreprocessReader` with thread workers, batches put on the
                    devices, as the trainer runs it
  cpjax processes   the same reader with process workers (skipped, with a note, in a cpjax
                    whose reader has none)
  tf.data (flax)    flax's examples/imagenet `input_pipeline.preprocess_for_train` in tf.data
                    (`tf.image.sample_distorted_bounding_box` + `tf.io.decode_and_crop_jpeg`
                    + bicubic resize + random flip, batched), `num_parallel_calls` and the
                    private thread pool the worker count (TF's intra/inter-op pools: the
                    largest count, set once); only where TensorFlow is installed
  torch DataLoader  torchvision's PIL decode + `RandomResizedCrop` + `RandomHorizontalFlip`
                    in a `DataLoader` with that many workers (benchmarks.torch_peers); only
                    where torch is installed

A pipeline that needs a missing library is skipped with a note. Each pipeline gets an
untimed epoch first (workers start, TF traces, files enter the page cache), then `--repeats`
timed epochs interleaved with the other pipelines' (so that load changes hit all alike);
printed: images/s (median) and CPU ms per image (user + system of this process, its threads
and its worker processes, live or ended: benchmarks.feeds.cpu_seconds). On a machine that
other jobs load, a pipeline with more runnable threads takes a larger share of the cores,
which moves images/s but not CPU time per image. Then the ratios the targets read: processes
/ tf.data (images/s, and tf.data / processes in CPU time) at each worker count, and each
pipeline's scaling from the smallest worker count to each larger one (2 workers / 1 worker).
`--variants` adds cpjax threads with `resize="pil"` and with `tf_crop_decode` at the largest
worker count.
"""

import argparse
import dataclasses
import functools
import os
import statistics
import tempfile
import time

import jax
import numpy as np
from PIL import Image

from benchmarks import feeds, throughput
from cpjax.data import tensorflow_optional
from cpjax.runtime import sharding

try:  # The DataLoader rows; without torch they are skipped with a note.
  from benchmarks import torch_peers
  TORCH_MISSING = ""
except ImportError as import_error:
  torch_peers, TORCH_MISSING = None, f"torch/torchvision not importable ({import_error})"
TF_MISSING = ("" if tensorflow_optional.installed()
              else tensorflow_optional.missing_message("the tf.data row"))


def write_images(folder: str, count: int) -> list[str]:
  """`count` generated 500 x 375 JPEGs in `folder` (benchmarks.record_size's files)."""
  rng = np.random.default_rng(0)
  paths = []
  for i in range(count):
    low = rng.integers(0, 256, (8, 8, 3), np.uint8)  # Smooth fields compress like photos.
    image = Image.fromarray(low).resize((500, 375), Image.BICUBIC)
    noisy = np.asarray(image, np.int16) + rng.integers(-12, 13, (375, 500, 3))
    path = os.path.join(folder, f"{i:05d}.JPEG")
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(path, quality=90)
    paths.append(path)
  return paths


@dataclasses.dataclass
class Pipeline:
  """One way to make an epoch of batches: `epoch(index)` returns the images it made."""
  name: str
  epoch: object  # Callable[[int], int]
  close: object = None  # Callable[[], None]; stops its workers.


def _reader_pipeline(name: str, source, transform, mesh, workers: int, kind: str,
                     blocks: np.ndarray) -> Pipeline | str:
  reader = feeds.preprocess_reader(source, transform, mesh, workers, kind)
  if reader is None:
    return f"this cpjax's PreprocessReader has no {kind} workers"

  def epoch(index: int) -> int:
    for batch in reader.batches(blocks, epoch=index):
      jax.block_until_ready(batch)
    return int(blocks.size)
  return Pipeline(name, epoch, functools.partial(feeds.close_reader, reader))


def _loader_pipeline(paths: list[str], size: int, batch: int, workers: int) -> Pipeline | str:
  if torch_peers is None:
    return TORCH_MISSING
  loader = torch_peers.dataloader(paths, size, batch, workers)
  return Pipeline("torch DataLoader", lambda _: torch_peers.loader_epoch(loader)[1])


def _tf_pipeline(paths: list[str], size: int, batch: int, workers: int) -> Pipeline | str:
  if TF_MISSING:
    return TF_MISSING
  return Pipeline("tf.data (flax)", lambda _: tf_epoch(paths, size, batch, workers))


def tf_epoch(paths: list[str], size: int, batch: int, threads: int) -> int:
  """Images of one epoch of flax's ImageNet training pipeline over `paths` (whole batches)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  (optional: the reference)

  def decode_and_random_crop(image_bytes):  # flax examples/imagenet/input_pipeline.py
    shape = tf.io.extract_jpeg_shape(image_bytes)
    bbox = tf.constant([0.0, 0.0, 1.0, 1.0], dtype=tf.float32, shape=[1, 1, 4])
    begin, crop, _ = tf.image.sample_distorted_bounding_box(
        shape, bounding_boxes=bbox, min_object_covered=0.1,
        aspect_ratio_range=(3. / 4., 4. / 3.), area_range=(0.08, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    offset_y, offset_x, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(crop)
    image = tf.io.decode_and_crop_jpeg(image_bytes, tf.stack([offset_y, offset_x, height, width]),
                                       channels=3)
    image = tf.image.resize([image], [size, size], method=tf.image.ResizeMethod.BICUBIC)[0]
    return tf.image.random_flip_left_right(tf.reshape(image, [size, size, 3]))

  dataset = tf.data.Dataset.from_tensor_slices(paths).map(
      tf.io.read_file, num_parallel_calls=threads).map(
          decode_and_random_crop, num_parallel_calls=threads).batch(
              batch, drop_remainder=True).prefetch(2)
  options = tf.data.Options()
  options.threading.private_threadpool_size = threads
  images = 0
  for images_batch in dataset.with_options(options):
    images += int(images_batch.shape[0])
  return images


def set_tf_threads(threads: int) -> None:
  """TF's intra- and inter-op pools, once, before TF runs anything (it refuses later): the
  sweep's largest worker count; each epoch's tf.data work runs in its private pool."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  (optional: the reference)
  tf.config.threading.set_intra_op_parallelism_threads(threads)
  tf.config.threading.set_inter_op_parallelism_threads(threads)


def pipelines(root: str, args, workers: int, mesh) -> dict[str, Pipeline | str]:
  """The pipelines at `workers` workers by name, or the note saying why one is skipped."""
  source = feeds.folder_train_source(root)
  count = min(len(source), args.images) // args.batch_size * args.batch_size
  blocks = np.random.default_rng(0).permutation(count).reshape(-1, args.batch_size)
  paths = [source.where(r) for r in range(count)]
  transform = feeds.train_transform(args.size)
  made = {
      "cpjax threads": _reader_pipeline("cpjax threads", source, transform, mesh, workers,
                                        "thread", blocks),
      "cpjax processes": _reader_pipeline("cpjax processes", source, transform, mesh,
                                          workers, "process", blocks),
      "tf.data (flax)": _tf_pipeline(paths, args.size, args.batch_size, workers),
      "torch DataLoader": _loader_pipeline(paths, args.size, args.batch_size, workers)}
  if args.variants and workers == max(args.workers):
    for name, change in (("cpjax threads, pil resize", {"resize": "pil"}),
                         ("cpjax threads, TF crops", {"tf_crop_decode": True})):
      made[name] = _reader_pipeline(name, source, dataclasses.replace(transform, **change),
                                    mesh, workers, "thread", blocks)
  return made


def run(root: str, args, workers: int, mesh) -> dict[str, dict]:
  """Each pipeline's runs [(images/s, CPU ms an image)] and medians at `workers` workers
  (or the note saying why it was skipped)."""
  named = pipelines(root, args, workers, mesh)
  made = [p for p in named.values() if isinstance(p, Pipeline)]
  runs = {p.name: [] for p in made}
  try:
    for p in made:
      p.epoch(0)  # Untimed.
    for repeat in range(1, args.repeats + 1):
      for p in made:
        cpu, start = feeds.cpu_seconds(), time.perf_counter()
        images = p.epoch(repeat)
        seconds = time.perf_counter() - start
        runs[p.name].append((images / seconds, (feeds.cpu_seconds() - cpu) * 1e3 / images))
  finally:
    for p in made:
      if p.close:
        p.close()
  return {name: {"skipped": p} if isinstance(p, str) else {
      "images_per_s": statistics.median(x for x, _ in runs[name]),
      "cpu_ms_per_image": statistics.median(c for _, c in runs[name]), "runs": runs[name]}
          for name, p in named.items()}


def ratios(results: dict[int, dict[str, dict]]) -> dict[str, float]:
  """processes / tf.data (images/s; CPU time the other way) per worker count, and each
  pipeline's images/s at each worker count over its smallest one's."""
  out = {}
  for workers, rows in results.items():
    ours, ref = rows.get("cpjax processes", {}), rows.get("tf.data (flax)", {})
    if "images_per_s" in ours and "images_per_s" in ref:
      out[f"{workers} workers: processes / tf.data, images/s"] = (
          ours["images_per_s"] / ref["images_per_s"])
      out[f"{workers} workers: tf.data / processes, CPU ms an image"] = (
          ref["cpu_ms_per_image"] / ours["cpu_ms_per_image"])
  counts = sorted(results)
  for name in sorted({n for rows in results.values() for n in rows}):
    base = results[counts[0]].get(name, {}).get("images_per_s")
    for workers in counts[1:]:
      rate = results[workers].get(name, {}).get("images_per_s")
      if base and rate:
        out[f"{name}: {workers} workers / {counts[0]}"] = rate / base
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--images", type=int, default=512)
  parser.add_argument("--workers", "--threads", dest="workers", default=f"1,{os.cpu_count()}",
                      help="Comma-separated worker counts to sweep, e.g. 1,2.")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--size", type=int, default=224, help="Output side, pixels.")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--variants", action="store_true",
                      help="Also cpjax threads with resize=pil and with tf_crop_decode.")
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  try:
    args.workers = sorted({int(w) for w in str(args.workers).split(",") if w})
  except ValueError:
    parser.error(f"--workers must be comma-separated counts like 1,2, got {args.workers!r}")
  if not args.workers or min(args.workers) < 1 or args.images < args.batch_size:
    parser.error(f"--workers must be >= 1 (got {args.workers}) and --images >= --batch-size")
  with tempfile.TemporaryDirectory() as root:
    feeds.write_folder(root, args.images, classes=10)
    mesh = sharding.create_mesh()
    if not TF_MISSING:
      set_tf_threads(max(args.workers))
    results = {w: run(root, args, w, mesh) for w in args.workers}
  report = {"machine": throughput.machine(), "args": vars(args),
            "results": {str(w): rows for w, rows in results.items()},
            "ratios": ratios(results)}
  print(f"generated {args.images} JPEGs 500x375 -> {args.size}x{args.size} random-resized "
        f"crop + flip, batches of {args.batch_size}")
  print(f"{'workers':>7}  {'pipeline':<28}{'img/s':>9}{'CPU ms/img':>12}  runs (img/s)")
  for workers, rows in results.items():
    for name, row in rows.items():
      if "skipped" in row:
        print(f"{workers:>7}  {name:<28}  skipped: {row['skipped']}")
        continue
      print(f"{workers:>7}  {name:<28}{row['images_per_s']:>9.1f}{row['cpu_ms_per_image']:>12.3f}"
            f"  {', '.join(f'{r:.1f}' for r, _ in row['runs'])}")
  for name, value in report["ratios"].items():
    print(f"ratio {name}: {value:.2f}")
  throughput.write_json(args.json, report)


if __name__ == "__main__":
  main()
