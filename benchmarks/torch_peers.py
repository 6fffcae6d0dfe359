"""The PyTorch side of benchmarks.gpu_table: torchvision's ResNet-50, a CIFAR-stem ResNet-34
and torchvision's `DataLoader`, each set up as a PyTorch user would run it on a GPU.

- Train steps: AMP (`torch.autocast`, bfloat16), channels_last, SGD with momentum, cuDNN's
  autotuner on (`torch.backends.cudnn.benchmark`), eager or `torch.compile` (default mode)
  of the model. Images arrive as uint8 NHWC on the device, as cpjax's steps get them, and
  are normalised inside the step on both sides. Without a GPU (the tiny test) autocast is
  off: PyTorch's bfloat16 CPU path is not what the table measures, and is very slow.
- Scoring: eval-mode forward under `torch.no_grad` and autocast, then softmax, normalised
  entropy, top-class probability and correctness: what cpjax's `steps.scoring_pass_step`
  returns.
- Host stage: a `Dataset` over the same generated JPEGs doing PIL decode ->
  `RandomResizedCrop(size)` -> `RandomHorizontalFlip` -> uint8 tensor, in a `DataLoader`
  with persistent workers (started from a fork server: the parent process holds JAX's
  threads, which forking copies badly) and pinned memory, batches moved to the device.

  Its workers start without the main script. multiprocessing's fork server hands each new
  process the name of the parent's main module, which the process then imports again
  (`spawn.prepare`): under `python -m benchmarks.gpu_table` that is the whole table, JAX,
  flax, optax, torch, torchvision and cpjax's models, in each of the loader's 16 workers at
  once, before any of them decodes an image. On an H100 machine the DataLoader row took
  177.6 s, most of it before its first batch. So the workers are started (the loader's first
  `iter`) under a stand-in main module that names no file (cpjax.data.decode_workers
  .bare_main, as the host stage starts its own), and the fork server imports this module
  once (torch, torchvision, PIL), from which each worker forks. A stand-in of the table's
  main module (its imports less torch) on a loaded 2-core VM took 18.0-18.7 s to start 4
  fork-server processes that way, and 0.6-1.9 s with the stand-in and the preload.

Each `*_step` function returns (call, sync): `call()` runs one step, `sync(out)` waits for
the device, so that benchmarks.gpu_table times both frameworks with one function.
"""

import gc
import math
import multiprocessing
import time

from PIL import Image
import torch
from torch.nn import functional as F
import torchvision
from torchvision.transforms import v2 as transforms

from benchmarks import torch_reference
from cpjax.data import decode_workers

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
LOADER_TIMEOUT_SECONDS = 120  # A batch that takes longer raises instead of hanging the table.


def device() -> torch.device:
  return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def versions() -> dict[str, str]:
  return {"torch": torch.__version__, "torchvision": torchvision.__version__}


def _sync(_=None) -> None:
  if torch.cuda.is_available():
    torch.cuda.synchronize()


def _inputs(batch: int, size: int, classes: int, dev: torch.device):
  generator = torch.Generator(device="cpu").manual_seed(0)
  images = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, generator=generator)
  labels = torch.randint(0, classes, (batch,), generator=generator)
  return images.to(dev), labels.to(dev)


def _normalized(images: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
  """uint8 NHWC -> normalised float NCHW in channels_last memory (NHWC strides: no copy)."""
  x = images.permute(0, 3, 1, 2).float().div_(255.0)
  return ((x - mean) / std).contiguous(memory_format=torch.channels_last)


def _stats(dev: torch.device, mean=IMAGENET_MEAN, std=IMAGENET_STD):
  return (torch.tensor(mean, device=dev).view(1, 3, 1, 1),
          torch.tensor(std, device=dev).view(1, 3, 1, 1))


def _autocast(dev: torch.device):
  return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


def _prepared(model: torch.nn.Module, dev: torch.device) -> torch.nn.Module:
  torch.backends.cudnn.benchmark = True
  return model.to(dev).to(memory_format=torch.channels_last)


def train_step(model: torch.nn.Module, batch: int, size: int, classes: int,
               compiled: bool = False):
  """(call, sync) of one AMP bfloat16 SGD-momentum train step of `model` on a fixed batch."""
  dev = device()
  torch.manual_seed(0)
  model = _prepared(model, dev).train()
  optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
  forward = torch.compile(model) if compiled else model
  images, labels = _inputs(batch, size, classes, dev)
  mean, std = _stats(dev)

  def call():
    with _autocast(dev):
      loss = F.cross_entropy(forward(_normalized(images, mean, std)), labels)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss
  return call, _sync


def score_step(model: torch.nn.Module, batch: int, size: int, classes: int):
  """(call, sync) of one eval-mode scoring pass step: [B, 3] of normalised entropy,
  top-class probability and correctness, as cpjax's scoring pass returns."""
  dev = device()
  model = _prepared(model, dev).eval()
  images, labels = _inputs(batch, size, classes, dev)
  mean, std = _stats(dev)

  def call():
    with torch.no_grad(), _autocast(dev):
      logits = model(_normalized(images, mean, std)).float()
    with torch.no_grad():
      p = F.softmax(logits, dim=-1)
      entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(-1) / math.log(classes)
      confidence, top = p.max(-1)
      return torch.stack([entropy, confidence, (top == labels).float()], -1)
  return call, _sync


def release_memory() -> None:
  """Returns the memory of collected tensors to the device (for the JAX rows after a peer)."""
  gc.collect()
  if torch.cuda.is_available():
    torch.cuda.empty_cache()


def resnet50(classes: int = 1000) -> torch.nn.Module:
  """torchvision's ResNet-50 (v1.5, random weights: nothing is downloaded)."""
  return torchvision.models.resnet50(weights=None, num_classes=classes)


def cifar_resnet34(classes: int = 10) -> torch.nn.Module:
  """The CIFAR-stem ResNet-34 of benchmarks.torch_reference (cpjax's `resnet34` shapes)."""
  return torch_reference.ResNet(torch_reference.BLOCKS["resnet34"], classes)


class JpegFiles(torch.utils.data.Dataset):
  """The generated JPEGs through torchvision's ImageNet training transform, as uint8."""

  def __init__(self, paths: list[str], size: int):
    self.paths = paths
    self.transform = transforms.Compose([  # On the PIL image, as torchvision's references.
        transforms.RandomResizedCrop(size, antialias=True), transforms.RandomHorizontalFlip(),
        transforms.PILToTensor()])

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, i: int):
    with Image.open(self.paths[i]) as image:
      return self.transform(image.convert("RGB")), i


def dataloader(paths: list[str], size: int, batch: int, workers: int):
  """torchvision's usual ImageNet training loader over `paths` (shuffled, full batches); its
  workers start at its first epoch (`loader_epoch`), forked from a server that has imported
  this module (the module docstring)."""
  context = None
  if workers > 0:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])  # Read when the server starts (once).
  return torch.utils.data.DataLoader(
      JpegFiles(paths, size), batch_size=batch, shuffle=True, num_workers=workers,
      pin_memory=torch.cuda.is_available(), drop_last=True, persistent_workers=workers > 0,
      multiprocessing_context=context, timeout=LOADER_TIMEOUT_SECONDS if workers > 0 else 0,
      generator=torch.Generator().manual_seed(0))


def loader_epoch(loader) -> tuple[float, int, float]:
  """(seconds, images, seconds to the first batch) of one epoch of `loader`, every batch on
  the device at the end. The first epoch starts the (persistent) workers, under a main
  module that names no file (the module docstring)."""
  dev, images, first = device(), 0, None
  start = time.perf_counter()
  with decode_workers.bare_main():
    batches = iter(loader)
  for batch, _ in batches:
    batch = batch.to(dev, non_blocking=True)
    images += len(batch)
    first = time.perf_counter() - start if first is None else first
  _sync()
  return time.perf_counter() - start, images, first
