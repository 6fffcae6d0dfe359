"""The share of a training epoch the device waits on the host stage's input, same run.

  python -m benchmarks.input_wait --model=small_cnn --image-size=64 --steps=10 --threads=2

Writes `--steps` x `--batch-size` generated JPEGs (random smooth colour fields with noise,
`--source-size` pixels, quality 90: `benchmarks.host_stage.write_images`; generated, not real
photographs) as a folder of 10 classes, converts it to encoded array_record files, and times
one training epoch of `--model` at `--image-size` px (jitted `steps.train_step`, SGD, batch
`--batch-size`) fed three ways, in turn, `--repeats` times after an untimed compile:

  resident   the epoch's batches already on the devices (built once beforehand): no input
  folder     the host stage (`host_stage.PreprocessReader`: decode, random-resized crop,
             flip in `--threads` threads, 2 batches ahead, prefetch_depth 2) over the folder
  records    the same over the folder's encoded records (dataset.stream_dir)

The input-wait share of a reader is 1 - resident / reader (median epoch seconds): the part of
its epoch that would go if input cost nothing. It also prints the seconds the loop spent
blocked waiting for the reader's next batch, and each reader's epoch of input alone (its
batches made and put on the devices, no step). On a CPU backend the "device" is the same cores
the decode threads use, so the share there mixes waiting with competing for cores.
"""

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time

import jax
import numpy as np
from PIL import Image

from benchmarks import throughput
from configs import default
from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data import host_stage, preprocess, sources
from cpjax.runtime import compiler_options, sharding
from cpjax.selection import policies, scores

NUM_CLASSES = 10


def write_folder(root: str, count: int, width: int, height: int) -> None:
  """`count` generated JPEGs in NUM_CLASSES class folders of root/train (and one a class in
  root/val and root/test, so that every training image trains; never read here)."""
  rng = np.random.default_rng(0)
  for i in range(-2 * NUM_CLASSES, count):
    low = rng.integers(0, 256, (8, 8, 3), np.uint8)  # Smooth fields compress like photos.
    image = Image.fromarray(low).resize((width, height), Image.BICUBIC)
    noisy = np.asarray(image, np.int16) + rng.integers(-12, 13, (height, width, 3))
    split = "train" if i >= 0 else ("test" if i >= -NUM_CLASSES else "val")
    folder = os.path.join(root, split, f"class{i % NUM_CLASSES}")
    os.makedirs(folder, exist_ok=True)
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(
        os.path.join(folder, f"{i:05d}.JPEG"), quality=90)


def _dataset(folder: str, stream_dir: str, size: int):
  dataset = default.get_config().dataset
  dataset.update({"name": "folder", "folder": folder, "stream_dir": stream_dir,
                  "image_size": size, "flip": True, "crop_padding": 0,
                  "mean": (0.5,) * 3, "std": (0.25,) * 3})
  return dataset


def _train_fn(config, model, tx):
  spec = steps.step_spec(config.dataset, config.loss,
                         policies.weights_loss(config.selection.method))
  return jax.jit(functools.partial(
      steps.train_step, model=model, tx=tx, spec=spec, loss_fn=losses.get_loss(config.loss),
      score_fn=scores.normalized_entropy), donate_argnums=0,
      compiler_options=compiler_options.compiler_options("train"))


def _epoch(train_fn, state, batches) -> tuple[float, float, object]:
  """(epoch seconds, seconds blocked on the next batch, state) of one pass over `batches`."""
  lr, waited = np.float32(0.01), 0.0
  start = time.perf_counter()
  iterator = iter(batches)
  while True:
    before = time.perf_counter()
    batch = next(iterator, None)
    waited += time.perf_counter() - before
    if batch is None:
      break
    state, _, _ = train_fn(state, batch, lr, {})
  jax.block_until_ready(state.step)
  return time.perf_counter() - start, waited, state


def _input_alone(batches) -> float:
  """Seconds to make every batch of `batches` and put it on the devices, no step."""
  start = time.perf_counter()
  for batch in batches:
    jax.block_until_ready(batch)
  return time.perf_counter() - start


def measure(model_name: str, size: int, batch_size: int, num_steps: int, threads: int,
            source_size: tuple[int, int], repeats: int) -> dict:
  root = tempfile.mkdtemp(prefix="cpjax_input_wait_")
  try:
    folder, records = os.path.join(root, "images"), os.path.join(root, "records")
    write_folder(folder, batch_size * num_steps, *source_size)
    sources.write_records(_dataset(folder, "", size), records, num_shards=4)
    config = default.get_config()
    config.model.name, config.batch_size = model_name, batch_size
    mesh = sharding.create_mesh()
    readers = {}
    for name, stream_dir in (("folder", ""), ("records", records)):
      config.dataset = _dataset(folder, stream_dir, size)
      spec = sources.resolve(config.dataset)
      transform = preprocess.from_config(config.dataset, spec.image_shape, seed=0)
      readers[name] = host_stage.PreprocessReader(
          sources.open_splits(config.dataset)["train"], transform, mesh, num_workers=threads)
    model = models.create_model(model_name, NUM_CLASSES)
    tx = optim.create_optimizer(config.optimizer)
    state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, (size, size, 3), mesh)
    train_fn = _train_fn(config, model, tx)
    blocks = np.random.default_rng(0).permutation(batch_size * num_steps).reshape(
        num_steps, batch_size)
    resident = list(readers["folder"].batches(blocks, epoch=1))  # On the devices already.
    _, _, state = _epoch(train_fn, state, resident[:2])  # Compiles.
    feeds = {"resident": lambda: resident,
             **{name: functools.partial(r.batches, blocks, epoch=1)
                for name, r in readers.items()}}
    for feed in feeds.values():  # Untimed: opens the records, warms the page cache.
      _input_alone(feed())
    times = {name: [] for name in feeds}
    waits = {name: [] for name in feeds}
    alone = {name: [] for name in feeds}
    for _ in range(repeats):
      for name, feed in feeds.items():  # In turn: drifts in the machine hit every feed.
        seconds, waited, state = _epoch(train_fn, state, feed())
        times[name].append(seconds)
        waits[name].append(waited)
        alone[name].append(_input_alone(feed()))
    base = statistics.median(times["resident"])
    return {"steps": num_steps, "images": batch_size * num_steps,
            "feeds": {name: {"seconds": times[name], "median_seconds": statistics.median(
                times[name]), "median_blocked_seconds": statistics.median(waits[name]),
                             "median_input_alone_seconds": statistics.median(alone[name]),
                             "input_wait_share": 1 - base / statistics.median(times[name])}
                      for name in feeds}}
  finally:
    shutil.rmtree(root)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="small_cnn", choices=sorted(models.MODELS))
  parser.add_argument("--image-size", type=int, default=64)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--steps", type=int, default=10, help="Steps per epoch.")
  parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                      help="Host-stage decode threads.")
  parser.add_argument("--source-size", default="500x375", help="WxH of the generated JPEGs.")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  width, height = (int(v) for v in args.source_size.split("x"))
  if min(args.steps, args.repeats, args.threads, args.batch_size) < 1:
    parser.error("--steps, --repeats, --threads and --batch-size must be >= 1")
  results = measure(args.model, args.image_size, args.batch_size, args.steps, args.threads,
                    (width, height), args.repeats)
  results["machine"], results["args"] = throughput.machine(), vars(args)
  print(f"{args.model} at {args.image_size} px, batch {args.batch_size}, {args.steps} steps, "
        f"{args.threads} decode threads, generated {args.source_size} JPEGs")
  print(f"{'feed':<10}{'epoch s (median)':>18}{'blocked s':>12}{'input alone s':>15}"
        f"{'input-wait share':>18}")
  for name, row in results["feeds"].items():
    print(f"{name:<10}{row['median_seconds']:>18.3f}{row['median_blocked_seconds']:>12.3f}"
          f"{row['median_input_alone_seconds']:>15.3f}{row['input_wait_share']:>18.3f}")
  throughput.write_json(args.json, results)


if __name__ == "__main__":
  main()
