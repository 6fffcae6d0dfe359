"""cpjax's GPU table in one command: its steps and host stage against the peers, same run.

  python -m benchmarks.gpu_table --out=gpu_table.json     # one GPU, 16 cores: < 8 minutes
  python -m benchmarks.gpu_table --tiny --out=tiny.json   # tiny sizes on a CPU (the test)

Needs jax, flax, optax, ml-collections, grain, array-record, Pillow and OpenCV; torch and
torchvision are optional (the peer rows; skipped with a note without them), and so is
nvImageCodec (the device stage's GPU rows: `pip install 'cpjax[gpu-decode]'`). Imports no
TensorFlow, tensorflow_datasets or clu: only cpjax's lower-level modules (steps, models,
data.preprocess, data.host_stage, data.device_stage, data.folder_source), never cpjax.training.train
or cpjax.data.sources, which import tensorflow_datasets.

Rows (full sizes; --tiny swaps in the `tiny` net, 16 px images and batches of 4-8):
  ResNet-50 (`resnet50_imagenet`), bfloat16, batch 256, 224 px, train step: cpjax's
    `steps.train_step` | a bare flax step on the same model (cross-entropy, SGD momentum,
    nothing else) | torchvision's resnet50 in PyTorch eager (AMP, channels_last) |
    `torch.compile` of it (benchmarks.torch_peers)
  the scoring pass (eval forward + normalised entropy, `steps.scoring_pass_step`), batch
    1,024 | PyTorch eager
  CIFAR-stem ResNet-34 (`resnet34`), bfloat16, train, batch 32 and 512 | PyTorch eager
  the host stage (JPEG decode + random-resized crop to 224 + flip, into batches of 256 on
    the device) over a folder of generated 500 x 375 quality-90 JPEGs (smooth random colour
    fields plus noise: generated, not photographs): `host_stage.PreprocessReader` in
    threads and in processes, on all cores | torchvision's `DataLoader`, as many workers
    (started without re-importing this script in each: benchmarks.torch_peers; the seconds
    to its first batch are in the row)
  the device stage (dataset.decode=gpu: each device decodes its shard of the batch with
    nvImageCodec, and one jitted op crops, resizes and flips it there), the training and
    the evaluation transforms alone, images/s and CPU ms an image; skipped with a note where
    no GPU decoder can run (at --tiny sizes it runs with the PIL stand-in, device_cpu)
  a fresh scoring pass (the evaluation transform) fed by the device stage and by the host
    stage in processes, against the scoring pass's resident rate (batches on the devices)
  MFU of each ResNet-50 row from model FLOPs (benchmarks.model_flops: conv and dense MACs
    counted from the layer shapes, 3 forwards a train step), against the card's dense
    bfloat16 peak; omitted, with a note, for a card not in the peak table. Never from XLA's
    cost analysis, which on a GPU leaves out the cuDNN convolutions.

Timing: the first call (compile + one step) is timed apart; then warm-up steps, then
`windows` timed windows, each sized from a calibration step to last about `window_seconds`
(at most `max_steps` steps) and ended by block_until_ready (torch.cuda.synchronize); the
rate is the median window. Host-stage rows: one untimed epoch (workers start, page cache),
then timed epochs, median; CPU ms an image counts worker processes too. Every row runs
inside try/except (a failing row is reported in the JSON, the table goes on) and starts only
if the time budget left (`--budget-seconds`, 400 s from the start, the generated folder's
writing included) covers its estimate; the rows run with the targets and the cheap ones
first (`run_rows`), so a cut drops the CIFAR rows. A watchdog
ends a run still going 40 s past the budget (a row that hangs): it writes the rows done so
far, the running one as an error, and exits with status 3. `--rows=PREFIX,...` runs only
some rows (to redo one). Process rows need a cpjax whose PreprocessReader takes
`worker_kind`; without it they are skipped with a note. JAX takes GPU memory as it needs it
(XLA_PYTHON_CLIENT_PREALLOCATE=false unless set), leaving room for PyTorch's rows, and
PyTorch's cached memory is released after each of its rows.
"""

import argparse
import dataclasses
import fnmatch
import functools
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

import flax
from flax.training import train_state
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import feeds, model_flops, throughput
from configs import default
from cpjax import models, optim, steps
from cpjax.calibration import losses
from cpjax.data.device_stage import decoders
from cpjax.data.device_stage.reader import DeviceStageReader
from cpjax.runtime import sharding
from cpjax.selection import scores

try:  # The peer rows; without torch they are skipped with a note.
  from benchmarks import torch_peers
  TORCH_MISSING = ""
except ImportError as import_error:
  torch_peers, TORCH_MISSING = None, f"torch/torchvision not importable ({import_error})"

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
IMAGENET_TRAIN_IMAGES = 1_281_167  # A scoring pass over ImageNet's train split: its seconds.
HARD_MARGIN_SECONDS = 40.0  # After the budget, a watchdog writes what ran and exits.


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What the table runs: the full sizes (one GPU) or `TINY` (a CPU test)."""
  imagenet_model: str = "resnet50_imagenet"
  imagenet_size: int = 224
  train_batch: int = 256
  score_batch: int = 1024
  cifar_model: str = "resnet34"
  cifar_size: int = 32
  cifar_batches: tuple[int, ...] = (32, 512)
  warmup: int = 5  # Steps after the first call, before the calibration step.
  windows: int = 3
  window_seconds: float = 1.0
  max_steps: int = 200  # Per window.
  source_size: tuple[int, int] = (500, 375)  # Generated JPEGs, W x H.
  host_images: int = 4096  # Host-stage rows: images an epoch (whole batches).
  host_repeats: int = 2  # Timed epochs per host-stage row.
  budget_seconds: float = 400.0  # Whole script; a row starts only if its estimate fits.
  estimate_scale: float = 1.0  # Of the rows' estimated seconds (full sizes, one H100).
  torch_compile: bool = True  # The torch.compile row (minutes of compiling on a CPU).
  # Device-stage rows without a GPU decoder: the PIL stand-in (device_cpu), else skipped.
  stand_in_decode: bool = False


TINY = Sizes(imagenet_model="tiny", imagenet_size=16, train_batch=8, score_batch=8,
             cifar_model="tiny", cifar_size=16, cifar_batches=(4, 8), warmup=1, windows=2,
             window_seconds=0.01, max_steps=3, source_size=(64, 48), host_images=16,
             host_repeats=1, budget_seconds=600.0,
             estimate_scale=0.0, torch_compile=False, stand_in_decode=True)


def timed_rate(call, sync, images_per_call: int, sizes: Sizes) -> dict[str, Any]:
  """images/s of `call()` (median of timed windows), and the first call's seconds."""
  start = time.perf_counter()
  sync(call())
  first = time.perf_counter() - start
  out = None
  for _ in range(sizes.warmup):
    out = call()
  sync(out)
  start = time.perf_counter()
  sync(call())
  per_call = max(time.perf_counter() - start, 1e-6)
  count = int(min(max(math.ceil(sizes.window_seconds / per_call), 1), sizes.max_steps))
  rates = []
  for _ in range(sizes.windows):
    start = time.perf_counter()
    for _ in range(count):
      out = call()
    sync(out)
    rates.append(images_per_call * count / (time.perf_counter() - start))
  return {"images_per_s": statistics.median(rates), "window_images_per_s": rates,
          "steps_per_window": count, "first_call_seconds": first}


class BareState(train_state.TrainState):
  batch_stats: Any


def bare_train_step(state: BareState, images: jax.Array, labels: jax.Array, *, model,
                    mean: tuple[float, ...], std: tuple[float, ...]):
  """The plainest flax train step: normalise, forward, cross-entropy, backward, SGD."""
  def loss_fn(params):
    x = (images.astype(jnp.float32) / 255.0 - jnp.asarray(mean)) / jnp.asarray(std)
    (logits, _), updates = model.apply({"params": params, "batch_stats": state.batch_stats},
                                       x, train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, updates["batch_stats"]
  (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


@dataclasses.dataclass
class JaxTrain:
  """A jitted, donated cpjax train step, its state (replaced as it trains) and a batch."""
  step: Any
  state: Any
  batch: dict[str, jax.Array]
  mesh: jax.sharding.Mesh

  def __call__(self, batch: dict[str, jax.Array] | None = None):
    self.state, metrics, _ = self.step(self.state, self.batch if batch is None else batch,
                                       np.float32(0.01), {})
    return metrics["loss_sum"]

  def train_fn(self, state, batch, lr, hparams):  # feeds.timed_epoch's signature.
    return self.step(state, batch, lr, hparams)


def _spec(classes: int, mean, std, crop_padding: int = 0, flip: bool = False) -> steps.StepSpec:
  return steps.StepSpec(mean=mean, std=std, num_classes=classes, crop_padding=crop_padding,
                        flip=flip)


def cpjax_train(model_name: str, classes: int, size: int, batch: int,
                spec: steps.StepSpec) -> JaxTrain:
  """cpjax's train step (bfloat16 model, float32 parameters, the default SGD) on random
  uint8 images: what the trainer jits."""
  config = default.get_config()
  mesh = sharding.create_mesh()
  model = models.create_model(model_name, classes, "bfloat16")
  tx = optim.create_optimizer(config.optimizer)
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, (size, size, 3), mesh)
  step = jax.jit(functools.partial(steps.train_step, model=model, tx=tx, spec=spec,
                                   loss_fn=losses.get_loss(config.loss),
                                   score_fn=scores.normalized_entropy), donate_argnums=0)
  return JaxTrain(step, state, throughput.random_batch(mesh, batch, size, classes), mesh)


def bare_train(model_name: str, classes: int, size: int, batch: int, sizes: Sizes) -> dict:
  model = models.create_model(model_name, classes, "bfloat16")
  mesh = sharding.create_mesh()
  variables = jax.jit(lambda: model.init(jax.random.PRNGKey(0),
                                         jnp.zeros((1, size, size, 3)), train=False))()
  state = jax.device_put(BareState.create(
      apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"],
      tx=optax.sgd(0.01, momentum=0.9)), sharding.replicated(mesh))
  data = throughput.random_batch(mesh, batch, size, classes)
  step = jax.jit(functools.partial(bare_train_step, model=model, mean=IMAGENET_MEAN,
                                   std=IMAGENET_STD), donate_argnums=0)
  holder = [state]

  def call():
    holder[0], loss = step(holder[0], data["image"], data["label"])
    return loss
  return timed_rate(call, jax.block_until_ready, batch, sizes)


@dataclasses.dataclass
class JaxScore:
  """A jitted scoring-pass step (eval forward + normalised entropy) and its state."""
  step: Any
  state: Any
  mesh: jax.sharding.Mesh


def score_setup(model_name: str, classes: int, size: int) -> JaxScore:
  mesh = sharding.create_mesh()
  model = models.create_model(model_name, classes, "bfloat16")
  tx = optim.create_optimizer(default.get_config().optimizer)
  state = steps.create_train_state(jax.random.PRNGKey(0), model, tx, (size, size, 3), mesh)
  step = jax.jit(functools.partial(steps.scoring_pass_step, model=model,
                                   spec=_spec(classes, IMAGENET_MEAN, IMAGENET_STD),
                                   score_fn=scores.normalized_entropy))
  return JaxScore(step, state, mesh)


def cpjax_score(score: JaxScore, classes: int, size: int, batch: int, sizes: Sizes) -> dict:
  """The scoring pass's rate on one batch already on the devices (the resident rate)."""
  data = throughput.random_batch(score.mesh, batch, size, classes)
  row = timed_rate(lambda: score.step(score.state, data), jax.block_until_ready, batch, sizes)
  row["imagenet_train_split_seconds"] = IMAGENET_TRAIN_IMAGES / row["images_per_s"]
  return row


def _all_cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _blocks(count: int, images: int, batch: int) -> np.ndarray:
  """Rows 0..n-1 (n: whole batches of `images`, at most `count`), shuffled, as [S, batch]."""
  n = min(count, images) // batch * batch
  if n == 0:
    raise ValueError(f"{images} images make no whole batch of {batch}")
  return np.random.default_rng(0).permutation(n).reshape(-1, batch)


def _consume(batches) -> None:
  for batch in batches:
    jax.block_until_ready(batch)


def _passes(reader, blocks: np.ndarray, sizes: Sizes, train: bool) -> dict:
  """images/s and CPU ms an image of `reader`'s batches of `blocks` on the devices: one
  untimed pass (workers start, page cache warms, programs compile), then `host_repeats` timed
  passes (training epochs 1, 2, ..., or the evaluation transform), medians."""
  epochs = list(range(1, sizes.host_repeats + 1)) if train else [None] * sizes.host_repeats
  _consume(reader.batches(blocks, epoch=0 if train else None))
  runs = []
  for epoch in epochs:
    cpu, start = feeds.cpu_seconds(), time.perf_counter()
    _consume(reader.batches(blocks, epoch=epoch))
    runs.append((blocks.size / (time.perf_counter() - start),
                 (feeds.cpu_seconds() - cpu) * 1e3 / blocks.size))
  return {"images_per_s": statistics.median(r for r, _ in runs),
          "cpu_ms_per_image": statistics.median(c for _, c in runs),
          "runs": runs, "images": int(blocks.size)}


def host_stage_reader(worker_kind: str):
  """A reader maker: the host stage with `worker_kind` workers on all cores, or (None, why)."""
  def make(source, transform, mesh, sizes):
    del sizes
    reader = feeds.preprocess_reader(source, transform, mesh, _all_cores(), worker_kind)
    return reader, f"this cpjax's PreprocessReader has no {worker_kind} workers"
  return make


def device_stage_reader(source, transform, mesh, sizes: Sizes):
  """The device stage's reader (cpjax.data.device_stage) with the gpu decoder where it can
  run, the PIL stand-in at tiny sizes (the CPU test runs the rows' code), else (None, why)."""
  problem = decoders.DECODERS["gpu"].problem()
  if problem and not sizes.stand_in_decode:
    return None, f"no GPU decoding here: {problem}"
  decoder = decoders.DECODERS["device_cpu" if problem else "gpu"].create(transform.channels)
  return DeviceStageReader(source, transform, mesh, decoder,
                                        num_threads=_all_cores()), ""


def reader_row(root: str, sizes: Sizes, make_reader, mesh, train: bool = True) -> dict:
  """images/s and CPU ms an image of a reader over the generated folder (all cores), batches
  on the devices: the training transform, or the evaluation transform (`train` False)."""
  source = feeds.folder_train_source(root)
  reader, note = make_reader(source, feeds.train_transform(sizes.imagenet_size), mesh, sizes)
  if reader is None:
    return {"skipped": note}
  blocks = _blocks(len(source), sizes.host_images, sizes.train_batch)
  try:
    row = _passes(reader, blocks, sizes, train)
  finally:
    feeds.close_reader(reader)
  row["workers"] = getattr(reader, "num_workers", getattr(reader, "num_threads", None))
  if hasattr(reader, "decoded_on_host"):  # The device stage: its decoder and fallbacks.
    row.update(decoder=reader.decoder_name, decoded_on_host=reader.decoded_on_host)
  return row


def host_stage_row(root: str, sizes: Sizes, worker_kind: str, mesh) -> dict:
  """`reader_row` of the host stage's reader with `worker_kind` workers on all cores."""
  return reader_row(root, sizes, host_stage_reader(worker_kind), mesh)


def fed_score_row(score: JaxScore, root: str, sizes: Sizes, make_reader) -> dict:
  """A fresh scoring pass (the evaluation transform, batches of `score_batch`) fed by a
  reader over the generated folder, against the resident rate (`cpjax_score`)."""
  source = feeds.folder_train_source(root)
  reader, note = make_reader(source, feeds.train_transform(sizes.imagenet_size), score.mesh,
                             sizes)
  if reader is None:
    return {"skipped": note}
  blocks = _blocks(len(source), sizes.host_images, sizes.score_batch)

  def scoring_pass() -> float:
    start, out = time.perf_counter(), None
    for batch in reader.batches(blocks):
      out = score.step(score.state, batch)
    jax.block_until_ready(out)
    return time.perf_counter() - start
  try:
    first = scoring_pass()  # Untimed: workers start, page cache warms, programs compile.
    seconds = statistics.median(scoring_pass() for _ in range(sizes.host_repeats))
  finally:
    feeds.close_reader(reader)
  rate = blocks.size / seconds
  return {"images_per_s": rate, "images": int(blocks.size), "first_pass_seconds": first,
          "imagenet_train_split_seconds": IMAGENET_TRAIN_IMAGES / rate,
          **({"decoder": reader.decoder_name} if hasattr(reader, "decoder_name") else {})}


def dataloader_row(root: str, sizes: Sizes) -> dict:
  """The same as `host_stage_row` for torchvision's DataLoader with as many workers."""
  source, workers = feeds.folder_train_source(root), _all_cores()
  count = min(len(source), sizes.host_images) // sizes.train_batch * sizes.train_batch
  loader = torch_peers.dataloader([source.where(r) for r in range(count)],
                                  sizes.imagenet_size, sizes.train_batch, workers)
  # Untimed: workers start (timed apart: the row once spent minutes here), page cache warms.
  start_seconds, _, first_batch_seconds = torch_peers.loader_epoch(loader)
  runs = []
  for _ in range(sizes.host_repeats):
    cpu = feeds.cpu_seconds()
    seconds, images, _ = torch_peers.loader_epoch(loader)
    runs.append((images / seconds, (feeds.cpu_seconds() - cpu) * 1e3 / images))
  del loader  # Its persistent workers end with it.
  return {"images_per_s": statistics.median(r for r, _ in runs),
          "cpu_ms_per_image": statistics.median(c for _, c in runs),
          "runs": runs, "workers": workers, "images": count,
          "first_epoch_seconds": start_seconds, "first_batch_seconds": first_batch_seconds}


class Table:
  """Runs rows under one time budget; each row's dict (or its skip note or error) by key."""

  def __init__(self, sizes: Sizes, selected: tuple[str, ...]):
    self.sizes, self.selected = sizes, selected
    self.start = time.perf_counter()
    self.rows: dict[str, dict] = {}
    self.running: tuple[str, str] | None = None  # (key, label) of the row running now.

  def run(self, key: str, label: str, estimate_seconds: float, fn, *args) -> dict:
    """`fn(*args)` as row `key`, unless it is not selected or its estimate (scaled) does not
    fit the time left; an exception becomes the row's "error"."""
    left = self.sizes.budget_seconds - (time.perf_counter() - self.start)
    need = estimate_seconds * self.sizes.estimate_scale
    start = time.perf_counter()
    if self.selected and not any(key.startswith(s) for s in self.selected):
      row = {"skipped": "not selected (--rows)"}
    elif need > left:
      row = {"skipped": f"time budget: {left:.0f} s left, the row needs about {need:.0f} s"}
    else:
      self.running = (key, label)
      try:
        row = fn(*args)
      except Exception as err:  # pylint: disable=broad-except  One failing row, not the table.
        traceback.print_exc()
        row = {"error": f"{type(err).__name__}: {str(err)[:1000]}"}
      self.running = None
    row.update(label=label, seconds=time.perf_counter() - start)
    self.rows[key] = row
    status = row.get("skipped") or row.get("error") or ""
    print(f"[{time.perf_counter() - self.start:6.0f} s] {key}: {status or 'done'} "
          f"({row['seconds']:.1f} s)", flush=True)
    return row


def _peer(fn):
  """`fn` when torch is importable, else a row that says why it is skipped."""
  if torch_peers is None:
    return lambda *args: {"skipped": TORCH_MISSING}
  return fn


def _torch_rate(make_step, batch: int, sizes: Sizes) -> dict:
  call, sync = make_step()
  try:
    return timed_rate(call, sync, batch, sizes)
  finally:
    del call
    torch_peers.release_memory()  # The cached blocks, for the JAX rows after it.


# The table's rows in the order they are shown; they run in `run_rows`' order instead.
ROW_ORDER = ("r50_train_cpjax", "r50_train_flax_bare", "r50_train_torch_eager",
             "r50_train_torch_compile", "r50_score_cpjax", "r50_score_fed_device_stage",
             "r50_score_fed_host_processes", "r50_score_torch_eager",
             "cifar_r34_train_b*",
             "host_stage_threads", "host_stage_processes", "host_stage_torch_dataloader",
             "device_stage_train", "device_stage_eval")


def run_rows(table: Table, sizes: Sizes, root: str) -> None:
  """Every row, the rows the targets read and the cheap rows first, so that a budget cut (or an
  estimate that was too small) drops the CIFAR rows."""
  s, name, b = sizes.imagenet_size, sizes.imagenet_model, sizes.train_batch
  tag = f"{name} {s}px"
  mesh, r50, score = sharding.create_mesh(), [], []
  make_r50 = functools.partial(cpjax_train, name, 1000, s, b,
                               _spec(1000, IMAGENET_MEAN, IMAGENET_STD))

  def r50_train() -> JaxTrain:  # The train row's step and state (already compiled), or new.
    if not r50:
      r50.append(make_r50())
    return r50[0]

  def r50_score() -> JaxScore:  # The scoring step (compiled by the first row that runs it).
    if not score:
      score.append(score_setup(name, 1000, s))
    return score[0]
  table.run("r50_train_cpjax", f"{tag} train bf16 b{b}: cpjax steps.train_step", 90,
            lambda: timed_rate(r50_train(), jax.block_until_ready, b, sizes))
  for kind, plural in (("process", "processes"), ("thread", "threads")):
    table.run(f"host_stage_{plural}", f"host stage {s}px, {plural}, all cores", 30,
              host_stage_row, root, sizes, kind, mesh)
  _device_stage_rows(table, sizes, root, r50_score)
  table.run("host_stage_torch_dataloader", f"torchvision DataLoader {s}px, all cores", 40,
            _peer(dataloader_row), root, sizes)
  table.run("r50_train_flax_bare", f"{tag} train bf16 b{b}: bare flax step", 60,
            bare_train, name, 1000, s, b, sizes)
  _resnet50_peer_rows(table, sizes)
  table.run("r50_score_torch_eager", f"torchvision resnet50 scoring b{sizes.score_batch}: "
            "eager", 20, _peer(_torch_rate),
            lambda: torch_peers.score_step(torch_peers.resnet50(), sizes.score_batch, s, 1000),
            sizes.score_batch, sizes)
  _cifar_rows(table, sizes)


def _device_stage_rows(table: Table, sizes: Sizes, root: str, r50_score) -> None:
  """The device stage (decode on the GPU) alone, and feeding a fresh scoring pass beside the
  resident scoring rate and the host stage feeding it (the trainer's epochs fed by it are
  benchmarks.gpu_check's)."""
  s, name, sb = sizes.imagenet_size, sizes.imagenet_model, sizes.score_batch
  mesh = sharding.create_mesh()
  for train, transform in ((True, "train"), (False, "eval")):
    table.run(f"device_stage_{transform}", f"device stage {s}px, {transform} transform, "
              "GPU decode", 25, reader_row, root, sizes, device_stage_reader, mesh, train)
  table.run("r50_score_cpjax", f"{name} {s}px scoring pass bf16 b{sb}: cpjax, resident", 30,
            lambda: cpjax_score(r50_score(), 1000, s, sb, sizes))
  table.run("r50_score_fed_device_stage", f"{name} {s}px scoring pass b{sb} fed by the device "
            "stage", 30, lambda: fed_score_row(r50_score(), root, sizes, device_stage_reader))
  table.run("r50_score_fed_host_processes", f"{name} {s}px scoring pass b{sb} fed by the host "
            "stage, processes", 40,
            lambda: fed_score_row(r50_score(), root, sizes, host_stage_reader("process")))


def _resnet50_peer_rows(table: Table, sizes: Sizes) -> None:
  s, b = sizes.imagenet_size, sizes.train_batch
  table.run("r50_train_torch_eager", f"torchvision resnet50 {s}px train b{b}: eager AMP", 30,
            _peer(_torch_rate),
            lambda: torch_peers.train_step(torch_peers.resnet50(), b, s, 1000), b, sizes)
  table.run("r50_train_torch_compile", f"torchvision resnet50 {s}px train b{b}: "
            "torch.compile", 150, _peer(_torch_rate) if sizes.torch_compile
            else lambda *_: {"skipped": "not at tiny sizes (minutes of compiling on a CPU)"},
            lambda: torch_peers.train_step(torch_peers.resnet50(), b, s, 1000, compiled=True),
            b, sizes)


def _cifar_rows(table: Table, sizes: Sizes) -> None:
  size, name = sizes.cifar_size, sizes.cifar_model
  spec = _spec(10, CIFAR_MEAN, CIFAR_STD, 4, True)  # cpjax's CIFAR crop + flip, on device.
  for batch in sizes.cifar_batches:
    table.run(f"cifar_r34_train_b{batch}_cpjax", f"{name} {size}px train bf16 b{batch}: cpjax",
              40, lambda batch=batch: timed_rate(cpjax_train(name, 10, size, batch, spec),
                                                 jax.block_until_ready, batch, sizes))
    table.run(f"cifar_r34_train_b{batch}_torch_eager",
              f"CIFAR ResNet-34 {size}px train b{batch}: eager AMP", 20, _peer(_torch_rate),
              lambda batch=batch: torch_peers.train_step(torch_peers.cifar_resnet34(), batch,
                                                         size, 10), batch, sizes)


def add_mfu(rows: dict[str, dict], sizes: Sizes, device_kind: str, devices: int) -> dict:
  """MFU of each ResNet-50 row from model FLOPs (benchmarks.model_flops), in place; returns
  the FLOP counts and the peak used (or the note saying why MFU is omitted)."""
  model = models.create_model(sizes.imagenet_model, 1000, "bfloat16")
  shape = (sizes.imagenet_size, sizes.imagenet_size, 3)
  flops = {"train": model_flops.train_flops_per_image(model, shape),
           "forward": model_flops.forward_flops_per_image(model, shape)}
  peak = model_flops.peak_bf16_flops(device_kind)
  info = {"model": sizes.imagenet_model, "image_size": sizes.imagenet_size,
          "forward_gmac_per_image": flops["forward"] / 2e9,
          "train_gflop_per_image": flops["train"] / 1e9,
          "forward_gflop_per_image": flops["forward"] / 1e9,
          "peak_bf16_flops_per_device": peak, "devices": devices,
          "source": "conv + dense MACs from the layer shapes (benchmarks.model_flops); "
                    "train = 3 forwards; not XLA's cost analysis"}
  if peak is None:
    info["note"] = f"MFU omitted: no bf16 peak known for device kind {device_kind!r}"
  for key, row in rows.items():
    kind = "train" if key.startswith("r50_train") else "forward" if key.startswith(
        "r50_score") else None
    if kind and "images_per_s" in row:
      row["model_flops_per_image"] = flops[kind]
      row["mfu"] = model_flops.mfu(flops[kind], row["images_per_s"], peak, devices)
  return info


def ratios(rows: dict[str, dict], sizes: Sizes) -> dict[str, float]:
  """Same-run ratios the performance targets read (a missing side leaves its ratio out)."""
  def rate(key):
    return rows.get(key, {}).get("images_per_s")
  pairs = {"r50_train cpjax / bare flax": ("r50_train_cpjax", "r50_train_flax_bare"),
           "r50_train cpjax / torch eager": ("r50_train_cpjax", "r50_train_torch_eager"),
           "r50_train cpjax / torch.compile": ("r50_train_cpjax", "r50_train_torch_compile"),
           "r50_score cpjax / torch eager": ("r50_score_cpjax", "r50_score_torch_eager"),
           **{f"cifar b{b} cpjax / torch eager": (f"cifar_r34_train_b{b}_cpjax",
                                                  f"cifar_r34_train_b{b}_torch_eager")
              for b in sizes.cifar_batches},
           "host stage processes / DataLoader": ("host_stage_processes",
                                                 "host_stage_torch_dataloader"),
           "host stage processes / threads": ("host_stage_processes", "host_stage_threads"),
           "host stage threads / DataLoader": ("host_stage_threads",
                                               "host_stage_torch_dataloader"),
           "host stage processes / r50 train step rate": ("host_stage_processes",
                                                          "r50_train_cpjax"),
           "device stage train / r50 train step rate": ("device_stage_train",
                                                        "r50_train_cpjax"),
           "device stage train / host stage processes": ("device_stage_train",
                                                         "host_stage_processes"),
           "scoring fed by the device stage / resident": ("r50_score_fed_device_stage",
                                                          "r50_score_cpjax"),
           "scoring fed by the host stage / resident": ("r50_score_fed_host_processes",
                                                        "r50_score_cpjax")}
  return {name: rate(a) / rate(b) for name, (a, b) in pairs.items() if rate(a) and rate(b)}


def print_table(results: dict) -> None:
  machine = results["machine"]
  print(f"\n{machine['card']} ({machine['devices']}), {machine['cores']} cores; "
        f"jax {machine['jax']}, flax {machine['flax']}, torch {machine.get('torch', '-')}; "
        f"{machine['date']}\n{machine['command']}")
  print(f"{'row':<66}{'img/s':>10}{'CPU ms/img':>12}{'MFU':>7}  note")
  for row in results["rows"].values():
    def cell(key, form, width):
      value = row.get(key)
      return f"{value:>{width}{form}}" if isinstance(value, (int, float)) else " " * width
    note = row.get("skipped") or row.get("error") or ""
    print(f"{row['label'][:65]:<66}{cell('images_per_s', '.0f', 10)}"
          f"{cell('cpu_ms_per_image', '.2f', 12)}{cell('mfu', '.3f', 7)}  {note[:100]}")
  flops = results["flops"]
  peak = flops["peak_bf16_flops_per_device"]
  print(f"model FLOPs: {flops['model']} at {flops['image_size']} px, "
        f"{flops['forward_gmac_per_image']:.3f} GMAC forward, "
        f"{flops['train_gflop_per_image']:.2f} GFLOP train an image; "
        + (flops["note"] if peak is None else f"bf16 peak {peak:.3g} FLOP/s a device"))
  for name, value in results["ratios"].items():
    print(f"  {name:<48}{value:8.2f}")


def machine_info(argv: list[str]) -> dict[str, Any]:
  info = throughput.machine()
  info.update(card=jax.devices()[0].device_kind, flax=flax.__version__,
              optax=optax.__version__, python=platform.python_version(),
              command=" ".join(["python -m benchmarks.gpu_table", *argv]),
              env={name: os.environ.get(name, "") for name in (
                  "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")})
  if torch_peers is not None:
    info.update(torch_peers.versions())
  return info


def ordered(rows: dict[str, dict]) -> dict[str, dict]:
  """`rows` in ROW_ORDER (the order they ran within one pattern)."""
  def rank(key: str) -> int:
    return next((i for i, pattern in enumerate(ROW_ORDER) if fnmatch.fnmatch(key, pattern)),
                len(ROW_ORDER))
  return dict(sorted(rows.items(), key=lambda item: rank(item[0])))


def finish(table: Table, sizes: Sizes, argv: list[str], out: str) -> dict:
  """The results of the rows run so far: printed, and written to `out` as JSON."""
  results = {"machine": machine_info(argv), "sizes": dataclasses.asdict(sizes),
             "rows": ordered(table.rows), "seconds": time.perf_counter() - table.start}
  results["flops"] = add_mfu(table.rows, sizes, results["machine"]["card"], jax.device_count())
  results["ratios"] = ratios(table.rows, sizes)
  print_table(results)
  throughput.write_json(out, results)
  return results


def _hard_stop(table: Table, sizes: Sizes, argv: list[str], out: str, root: str,
               margin: float) -> None:
  """The watchdog's end of a run past its budget (a row that hangs): the rows so far are
  written, the running one as an error, and the process exits with status 3. `root`: the
  folder to remove ("" to keep it)."""
  if table.running:
    table.rows[table.running[0]] = {"label": table.running[1], "error": "stopped: the run "
                                    f"passed its hard limit ({margin:.0f} s after the budget)"}
  print(f"hard time limit: stopping in row {table.running}", flush=True)
  try:
    finish(table, sizes, argv, out)
  finally:
    if root:
      shutil.rmtree(root, ignore_errors=True)
    os._exit(3)  # pylint: disable=protected-access  Worker threads may hold the interpreter.


def main(argv: list[str] | None = None) -> dict:
  # Before JAX starts its backend: take GPU memory as needed, leaving room for torch's rows.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tiny", action="store_true", help="Tiny sizes (a CPU test).")
  parser.add_argument("--out", default="", help="Also write the results as JSON here.")
  parser.add_argument("--rows", default="", help="Comma-separated row-key prefixes to run "
                      "(default all), e.g. r50_train,host_stage.")
  parser.add_argument("--budget-seconds", type=float, default=None,
                      help="Time budget of the rows (default 400; --tiny 600); a watchdog "
                      "ends the run --hard-margin-seconds after it.")
  parser.add_argument("--hard-margin-seconds", type=float, default=HARD_MARGIN_SECONDS,
                      help="Seconds after the budget at which the watchdog writes the rows "
                      f"done and exits (default {HARD_MARGIN_SECONDS:.0f}).")
  parser.add_argument("--estimate-scale", type=float, default=None,
                      help="Scale of the rows' estimated seconds, which decide whether a row "
                      "starts (default 1; --tiny 0); 0 starts every row while the budget lasts.")
  parser.add_argument("--folder", default="",
                      help="A folder written by benchmarks.feeds.write_folder (with enough "
                      "train/ images) to read instead of writing one; kept afterwards.")
  args = parser.parse_args(argv)
  argv = sys.argv[1:] if argv is None else argv
  sizes = TINY if args.tiny else Sizes()
  chosen = {"budget_seconds": args.budget_seconds, "estimate_scale": args.estimate_scale}
  sizes = dataclasses.replace(sizes, **{k: v for k, v in chosen.items() if v is not None})
  table = Table(sizes, tuple(r for r in args.rows.split(",") if r))
  root = args.folder or tempfile.mkdtemp(prefix="cpjax_gpu_table_")
  own = "" if args.folder else root  # The folder this run removes.
  watchdog = threading.Timer(sizes.budget_seconds + args.hard_margin_seconds, _hard_stop,
                             (table, sizes, argv, args.out, own, args.hard_margin_seconds))
  watchdog.daemon = True
  watchdog.start()
  try:
    if own:
      feeds.write_folder(root, sizes.host_images, *sizes.source_size)
    if torch_peers is None:
      print(f"note: {TORCH_MISSING}: the PyTorch rows are skipped")
    run_rows(table, sizes, root)
  finally:
    watchdog.cancel()
    if own:
      shutil.rmtree(own, ignore_errors=True)
  return finish(table, sizes, argv, args.out)


if __name__ == "__main__":
  main()
