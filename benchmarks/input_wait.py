"""The share of a training epoch the device waits on the host stage's input, same run.

  python -m benchmarks.input_wait --model=small_cnn --image-size=64 --steps=10 --workers=2
  python -m benchmarks.input_wait --model=resnet50_imagenet --image-size=224 --batch-size=256 \
      --steps=24                                          # a GPU: ResNet-50 at 224 px

Writes `--steps` x `--batch-size` generated JPEGs (random smooth colour fields with noise,
`--source-size` pixels, quality 90: `benchmarks.feeds.write_folder`; generated, not real
photographs) as a folder of 10 classes, converts it to encoded array_record files, and times
one training epoch of `--model` at `--image-size` px (jitted `steps.train_step`, SGD, batch
`--batch-size`, computing in `--dtype`) fed three ways, in turn, `--repeats` times after an
untimed compile (`benchmarks.feeds.wait_shares`):

  resident   the epoch's batches already on the devices (built once beforehand): no input
  folder     the host stage (`host_stage.PreprocessReader`: decode, random-resized crop,
             flip in `--workers` workers of `--worker-kind`, processes by default, 2 batches
             ahead, prefetch_depth 2) over the folder
  records    the same over the folder's encoded records (dataset.stream_dir); needs
             cpjax.data.sources, which imports tensorflow_datasets: skipped, with a note,
             where that is missing (a GPU machine without TensorFlow)

The input-wait share of a reader is 1 - resident / reader (median epoch seconds): the part of
its epoch that would go if input cost nothing. It also prints the seconds the loop spent
blocked waiting for the reader's next batch (and of those, the first batch's: the reader's
start), and each reader's epoch of input alone (its batches made and put on the devices, no
step). On a CPU backend the "device" is the same cores the decode workers use, so the share
there mixes waiting with competing for cores. A cpjax whose reader has no process workers
runs threads, and says so.
"""

import argparse
import functools
import os
import shutil
import tempfile

import jax
import numpy as np

from benchmarks import feeds, throughput
from configs import default
from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data import preprocess
from cpjax.runtime import compiler_options, sharding
from cpjax.selection import scores

try:  # The records feed (cpjax.data.sources imports tensorflow_datasets, which a GPU machine
  # may lack); without it the folder feed still runs.
  from cpjax.data import sources
  SOURCES_MISSING = ""
except ImportError as import_error:
  sources, SOURCES_MISSING = None, f"cpjax.data.sources not importable ({import_error})"

NUM_CLASSES = 10
MEAN, STD = (0.5,) * 3, (0.25,) * 3  # Of the generated images, roughly; timing only.


def _dataset(folder: str, stream_dir: str, size: int):
  dataset = default.get_config().dataset
  dataset.update({"name": "folder", "folder": folder, "stream_dir": stream_dir,
                  "image_size": size, "flip": True, "crop_padding": 0,
                  "mean": MEAN, "std": STD})
  return dataset


def _train_fn(config, model, tx):
  # The folder's StepSpec as steps.step_spec gives it (flips are the host stage's).
  spec = steps.StepSpec(mean=MEAN, std=STD, num_classes=NUM_CLASSES,
                        mixup_alpha=config.loss.mixup_alpha, reduction=config.loss.reduction)
  return jax.jit(functools.partial(
      steps.train_step, model=model, tx=tx, spec=spec, loss_fn=losses.get_loss(config.loss),
      score_fn=scores.normalized_entropy), donate_argnums=0,
      compiler_options=compiler_options.compiler_options("train"))


def _records_reader(folder: str, records: str, size: int, mesh, workers: int,
                    worker_kind: str):
  """The host stage over the folder's encoded array_record conversion (dataset.stream_dir)."""
  sources.write_records(_dataset(folder, "", size), records, num_shards=4)
  dataset = _dataset(folder, records, size)
  spec = sources.resolve(dataset)
  transform = preprocess.from_config(dataset, spec.image_shape, seed=0)
  return feeds.preprocess_reader(sources.open_splits(dataset)["train"], transform, mesh,
                                 workers, worker_kind)


def _worker_kind(worker_kind: str) -> str:
  """`worker_kind`, or "thread" (with a printed note) where this cpjax has no such workers."""
  if feeds.reader_options(worker_kind) is None:
    print(f"note: this cpjax's PreprocessReader has no {worker_kind} workers: threads instead")
    return "thread"
  return worker_kind


def measure(model_name: str, size: int, batch_size: int, num_steps: int, workers: int,
            source_size: tuple[int, int], repeats: int, worker_kind: str = "process",
            dtype: str = "float32") -> dict:
  root = tempfile.mkdtemp(prefix="cpjax_input_wait_")
  readers = {}
  try:
    folder = os.path.join(root, "images")
    feeds.write_folder(folder, batch_size * num_steps, *source_size, classes=NUM_CLASSES)
    config = default.get_config()
    config.model.name, config.batch_size = model_name, batch_size
    mesh = sharding.create_mesh()
    worker_kind = _worker_kind(worker_kind)
    readers["folder"] = feeds.preprocess_reader(
        feeds.folder_train_source(folder), feeds.train_transform(size), mesh, workers,
        worker_kind)
    if sources is not None:
      readers["records"] = _records_reader(folder, os.path.join(root, "records"), size, mesh,
                                           workers, worker_kind)
    else:
      print(f"note: {SOURCES_MISSING}: no records feed")
    model = models.create_model(model_name, NUM_CLASSES, dtype)
    tx = optim.create_optimizer(config.optimizer)
    state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, (size, size, 3), mesh)
    blocks = np.random.default_rng(0).permutation(batch_size * num_steps).reshape(
        num_steps, batch_size)
    resident = list(readers["folder"].batches(blocks, epoch=1))  # On the devices already.
    epoch_feeds = {"resident": lambda: resident,
                   **{name: functools.partial(r.batches, blocks, epoch=1)
                      for name, r in readers.items()}}
    results, _ = feeds.wait_shares(_train_fn(config, model, tx), state, epoch_feeds, repeats)
    return {"steps": num_steps, "images": batch_size * num_steps, "worker_kind": worker_kind,
            "feeds": results, **({"records_skipped": SOURCES_MISSING} if sources is None else {})}
  finally:
    for reader in readers.values():
      feeds.close_reader(reader)
    shutil.rmtree(root)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="small_cnn", choices=sorted(models.MODELS))
  parser.add_argument("--image-size", type=int, default=64)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--steps", type=int, default=10, help="Steps per epoch.")
  parser.add_argument("--workers", "--threads", dest="workers", type=int,
                      default=os.cpu_count() or 1, help="Host-stage decode workers.")
  parser.add_argument("--worker-kind", default="process", choices=feeds.WORKER_KINDS,
                      help="Host-stage workers: processes (the default) or threads.")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                      help="Compute dtype of the train step (bfloat16 on a GPU).")
  parser.add_argument("--source-size", default="500x375", help="WxH of the generated JPEGs.")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--json", default="")
  args = parser.parse_args()
  width, height = (int(v) for v in args.source_size.split("x"))
  if min(args.steps, args.repeats, args.workers, args.batch_size) < 1:
    parser.error("--steps, --repeats, --workers and --batch-size must be >= 1")
  results = measure(args.model, args.image_size, args.batch_size, args.steps, args.workers,
                    (width, height), args.repeats, args.worker_kind, args.dtype)
  results["machine"], results["args"] = throughput.machine(), vars(args)
  print(f"{args.model} at {args.image_size} px, batch {args.batch_size}, {args.steps} steps, "
        f"{args.workers} decode {results['worker_kind']}s, generated {args.source_size} JPEGs")
  print(f"{'feed':<10}{'epoch s (median)':>18}{'blocked s':>12}{'first batch s':>15}"
        f"{'input alone s':>15}{'input-wait share':>18}")
  for name, row in results["feeds"].items():
    print(f"{name:<10}{row['median_seconds']:>18.3f}{row['median_blocked_seconds']:>12.3f}"
          f"{row['median_first_batch_seconds']:>15.3f}{row['median_input_alone_seconds']:>15.3f}"
          f"{row['input_wait_share']:>18.3f}")
  throughput.write_json(args.json, results)


if __name__ == "__main__":
  main()
