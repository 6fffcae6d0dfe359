"""The host stage's training transform against flax's ImageNet tf.data pipeline, same run.

  python -m benchmarks.host_stage --images=400 --threads=2

Writes `--images` generated JPEGs (random smooth colour fields, ImageNet's typical 500 x 375,
quality 90; generated, not real photographs) to a temporary folder, then decodes, crops
(Inception-style random-resized crop, area 8-100 %, aspect 3/4-4/3) to 224 x 224 and flips
every file with (a) cpjax's host stage (`cpjax.data.preprocess.Transform` in a thread pool of
`--threads`, as `host_stage.PreprocessReader` runs it) and (b) flax's examples/imagenet
`input_pipeline.preprocess_for_train` in tf.data (`tf.image.sample_distorted_bounding_box` +
`tf.io.decode_and_crop_jpeg` + bicubic resize + random flip, `num_parallel_calls` =
`--threads`, TF's intra-op threads `--threads`), both reading the files from disk, and
(c) cpjax's host stage with `tf_crop_decode` on (TF decodes the crop window only), and (d)
cpjax's host stage with the previous resize engine, `resize="pil"` (PIL's antialiased
bilinear; (a) and (c) use the default, "opencv"). Prints
images/s of each (median of `--repeats`, interleaved) and the ratios to tf.data, and the
process's CPU time per image (user + system, all threads, TF's included): on a machine
that other jobs load, a pipeline with more runnable threads takes a larger share of the
cores, which moves images/s but not CPU time per image.
"""

import argparse
import concurrent.futures
import os
import resource
import statistics
import tempfile
import time

import numpy as np
from PIL import Image

from cpjax.data import preprocess


def write_images(folder: str, count: int) -> list[str]:
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


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def timed(rate, *args, **kwargs) -> tuple[float, float]:
  """(images/s, CPU ms per image) of `rate(paths, ...)`."""
  cpu = _cpu_seconds()
  images_per_s = rate(*args, **kwargs)
  return images_per_s, (_cpu_seconds() - cpu) * 1e3 / len(args[0])


def cpjax_rate(paths: list[str], threads: int, tf_crop_decode: bool = False,
               resize: str = "opencv") -> float:
  transform = preprocess.Transform(size=224, channels=3, flip=True, seed=0,
                                   tf_crop_decode=tf_crop_decode, resize=resize)

  def one(i: int) -> np.ndarray:
    with open(paths[i], "rb") as f:
      return transform(f.read(), i, 0)
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for _ in pool.map(one, range(len(paths)), chunksize=8):
      pass
  return len(paths) / (time.perf_counter() - start)


def tf_rate(paths: list[str], threads: int) -> float:
  import tensorflow as tf  # pylint: disable=import-outside-toplevel  (the reference's only user)
  tf.config.threading.set_intra_op_parallelism_threads(threads)
  tf.config.threading.set_inter_op_parallelism_threads(threads)

  def decode_and_random_crop(image_bytes):  # flax examples/imagenet/input_pipeline.py
    shape = tf.io.extract_jpeg_shape(image_bytes)
    bbox = tf.constant([0.0, 0.0, 1.0, 1.0], dtype=tf.float32, shape=[1, 1, 4])
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        shape, bounding_boxes=bbox, min_object_covered=0.1,
        aspect_ratio_range=(3. / 4., 4. / 3.), area_range=(0.08, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    offset_y, offset_x, _ = tf.unstack(begin)
    height, width, _ = tf.unstack(size)
    image = tf.io.decode_and_crop_jpeg(image_bytes, tf.stack([offset_y, offset_x, height, width]),
                                       channels=3)
    image = tf.image.resize([image], [224, 224], method=tf.image.ResizeMethod.BICUBIC)[0]
    return tf.image.random_flip_left_right(tf.reshape(image, [224, 224, 3]))

  dataset = tf.data.Dataset.from_tensor_slices(paths).map(
      tf.io.read_file, num_parallel_calls=threads).map(
          decode_and_random_crop, num_parallel_calls=threads).prefetch(threads)
  options = tf.data.Options()
  options.threading.private_threadpool_size = threads
  dataset = dataset.with_options(options)
  start = time.perf_counter()
  for _ in dataset:
    pass
  return len(paths) / (time.perf_counter() - start)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--images", type=int, default=400)
  parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as folder:
    paths = write_images(folder, args.images)
    tf_rate(paths[:16], args.threads)  # Warm: TF's start-up and graph tracing.
    pipelines = {  # Name -> (rate function, its arguments after the paths).
        "cpjax (opencv resize)": (cpjax_rate, {}),
        "cpjax (pil resize)": (cpjax_rate, {"resize": "pil"}),
        "cpjax, TF crops": (cpjax_rate, {"tf_crop_decode": True}),
        "tf.data (flax)": (tf_rate, {}),
    }
    runs = {name: [] for name in pipelines}
    for _ in range(args.repeats):  # Interleaved, so load changes hit all alike.
      for name, (rate, kwargs) in pipelines.items():
        runs[name].append(timed(rate, paths, args.threads, **kwargs))
  rate = {name: statistics.median(r for r, _ in runs[name]) for name in runs}
  cpu = {name: statistics.median(c for _, c in runs[name]) for name in runs}
  print(f"generated {args.images} JPEGs 500x375 -> 224x224 RRC + flip, {args.threads} threads")
  for name in runs:
    print(f"{name:22s}: {rate[name]:8.1f} img/s  (runs: "
          f"{', '.join(f'{r:.1f}' for r, _ in runs[name])});  CPU {cpu[name]:.3f} ms/img "
          f"(runs: {', '.join(f'{c:.3f}' for _, c in runs[name])})")
  ref = "tf.data (flax)"
  ours = [name for name in runs if name != ref]
  print("ratio cpjax / tf.data (img/s): "
        + ";  ".join(f"{name} {rate[name] / rate[ref]:.2f}" for name in ours))
  print("CPU-time ratio tf.data / cpjax: "
        + ";  ".join(f"{name} {cpu[ref] / cpu[name]:.2f}" for name in ours))

if __name__ == "__main__":
  main()
