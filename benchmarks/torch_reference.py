"""The same CIFAR ResNets in PyTorch eager, as the code of Tata et al. 2022
("Can Calibration Improve Sample Prioritization?") runs them.

kuangliu/pytorch-cifar layout (3x3 stem, no max-pool, BasicBlocks [2,2,2,2] /
[3,4,6,3], 4x4 average pool, linear head): the layer shapes of cpjax's
`resnet18` / `resnet34`. `measure` times an SGD-momentum train step and an
eval-mode forward + entropy pass, as the JAX side does.
"""

import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F


class BasicBlock(nn.Module):
  def __init__(self, inputs: int, planes: int, stride: int):
    super().__init__()
    self.conv1 = nn.Conv2d(inputs, planes, 3, stride, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(planes)
    self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
    self.bn2 = nn.BatchNorm2d(planes)
    self.shortcut = nn.Sequential()
    if stride != 1 or inputs != planes:
      self.shortcut = nn.Sequential(nn.Conv2d(inputs, planes, 1, stride, bias=False),
                                    nn.BatchNorm2d(planes))

  def forward(self, x):
    out = F.relu(self.bn1(self.conv1(x)))
    return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
  def __init__(self, blocks: tuple[int, ...], num_classes: int, channels: int = 3):
    super().__init__()
    self.conv1 = nn.Conv2d(channels, 64, 3, 1, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(64)
    layers, inputs = [], 64
    for i, count in enumerate(blocks):
      planes = 64 * 2 ** i
      for j in range(count):
        layers.append(BasicBlock(inputs, planes, 2 if (i > 0 and j == 0) else 1))
        inputs = planes
    self.layers = nn.Sequential(*layers)
    self.linear = nn.Linear(512, num_classes)

  def forward(self, x):
    out = self.layers(F.relu(self.bn1(self.conv1(x))))
    return self.linear(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


BLOCKS = {"resnet18": (2, 2, 2, 2), "resnet34": (3, 4, 6, 3)}


def _median_rate(step, batch_size: int, windows: int, steps: int) -> float:
  rates = []
  for _ in range(windows):
    start = time.perf_counter()
    for _ in range(steps):
      step()
    rates.append(batch_size * steps / (time.perf_counter() - start))
  return statistics.median(rates)


def measure(model_name: str, batch_size: int, score_batch_size: int, image_size: int,
            num_classes: int, windows: int, steps: int, threads: int) -> dict[str, float]:
  """Train and scoring images/s (median of timed windows after one warm-up window)."""
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  model = ResNet(BLOCKS[model_name], num_classes)
  parameters = sum(p.numel() for p in model.parameters())
  optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
  images = torch.randn(batch_size, 3, image_size, image_size)
  labels = torch.randint(0, num_classes, (batch_size,))
  score_images = torch.randn(score_batch_size, 3, image_size, image_size)

  def train_step():
    model.train()
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()

  def score_step():
    model.eval()
    with torch.no_grad():
      p = F.softmax(model(score_images), dim=-1)
      (-(p * torch.log(p + 1e-6)).sum(-1)).sum().item()

  results = {"parameters": parameters}
  for name, step, size in (("train", train_step, batch_size),
                           ("score", score_step, score_batch_size)):
    _median_rate(step, size, 1, max(1, steps // 2))  # Warm-up.
    results[f"{name}_images_per_s"] = _median_rate(step, size, windows, steps)
  return results
