"""configs/imagenet.py's recipe and data pipeline: the warm-up by hand, and the config run end
to end on a generated ImageNet-shaped folder (10 classes x 8 images of varied sizes, JPEG)
with a tiny model in place of ResNet-50."""

import json
import math
import os

import numpy as np
from PIL import Image
import pytest

from configs import imagenet
from cpjax import models, optim
from cpjax.data import specs
from cpjax.training import train


def test_warmup_then_cosine_by_hand():
  config = imagenet.get_config().optimizer
  config.learning_rate, config.warmup_epochs = 0.4, 2.0
  cosine = lambda e: 0.4 * 0.5 * (1 + math.cos(math.pi * (e - 2) / 8))
  config.schedule_unit = "epoch"  # One rate per epoch: (e + 1) / W of lr0 while warming up.
  got = [optim.learning_rate_of_step(config, e, 0, 100, 10) for e in (0, 1, 2, 6, 9)]
  np.testing.assert_allclose(got, [0.2, 0.4, 0.4, cosine(6), cosine(9)])
  config.schedule_unit = "step"  # 10 steps per epoch: (step + 1) / 20 of lr0 for 20 steps.
  got = [optim.learning_rate_of_step(config, 0, s, 100, 10) for s in (0, 9, 19, 20, 60, 99)]
  np.testing.assert_allclose(got, [0.02, 0.2, 0.4, 0.4, cosine(6), cosine(9.9)])
  config.warmup_epochs = 0.0  # No warm-up: the plain cosine of every existing config.
  assert optim.learning_rate_of_step(config, 0, 30, 100, 10) == pytest.approx(
      0.4 * 0.5 * (1 + math.cos(math.pi * 0.3)))


def test_the_recipe_numbers():
  config = imagenet.get_config()
  assert config.optimizer.learning_rate == pytest.approx(0.1 * config.batch_size / 256)
  assert (config.batch_size, config.optimizer.momentum, config.optimizer.weight_decay,
          config.num_epochs) == (1024, 0.9, 1e-4, 90)
  assert (config.dataset.image_size, tuple(config.dataset.crop_scale)) == (224, (0.08, 1.0))
  assert models.name_problem(config.model.name) is None  # resnet50_imagenet is registered.


def _imagenet_shaped(root: str) -> str:
  """Generated JPEGs of varied size (60-300 px a side), 10 classes x 8 in train/, x 2 in
  test/ (the official validation images' place), named like ImageNet's."""
  rng = np.random.default_rng(0)
  for split, count in (("train", 8), ("test", 2)):
    for c in range(10):
      folder = os.path.join(root, split, f"n{c:08d}")
      os.makedirs(folder, exist_ok=True)
      for i in range(count):
        h, w = (int(v) for v in rng.integers(60, 300, 2))
        image = rng.integers(0, 256, (h, w, 3), np.uint8)
        mode = "L" if i == 3 else "RGB"  # ImageNet has a few greyscale JPEGs.
        Image.fromarray(image).convert(mode).save(
            os.path.join(folder, f"n{c:08d}_{i}.JPEG"), format="JPEG", quality=90)
  return root


@pytest.mark.slow  # A whole training run.
def test_the_imagenet_pipeline_end_to_end_with_a_tiny_model(tmp_path):
  folder = _imagenet_shaped(str(tmp_path / "imagenet"))
  config = imagenet.get_config()
  config.dataset.name, config.dataset.folder = "folder", folder
  config.dataset.val_size = 10
  config.model.name = "tiny"  # ResNet-50 at 224 px is for accelerators.
  config.batch_size = config.eval_batch_size = config.selection.score_batch_size = 16
  config.num_epochs, config.optimizer.warmup_epochs = 2, 1.0
  config.evaluation.bootstrap_resamples = config.evaluation.calibrator_resamples = 20
  # Selection over host-decoded data: epoch 1 trains the top half by a fresh scoring pass.
  config.selection.method, config.selection.fraction = "top_k", 0.5
  config.selection.warmup_epochs, config.selection.scoring = 1, "fresh"
  workdir = str(tmp_path / "run")
  record = train.train_and_evaluate(config, workdir)
  assert specs.DATASETS["folder"].image_shape == (224, 224, 3)
  assert 0.0 <= record["test_accuracy"] <= 1.0 and np.isfinite(record["test_nll"])
  with open(os.path.join(workdir, "classes.json")) as f:
    assert json.load(f)["classes"] == [f"n{c:08d}" for c in range(10)]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert records[1]["selected_k"] == 35 and records[1]["scoring_seconds"] > 0
  # Warm-up over the first of 2 epochs, per step: the run's first step at lr0 times one
  # step's share of an epoch, 2 epochs / (5 full-data steps + 3 of the top half).
  total_steps = -(-(80 - 10) // 16) + -(-35 // 16)
  assert records[0]["learning_rate"] == pytest.approx(
      config.optimizer.learning_rate * 2 / total_steps)
