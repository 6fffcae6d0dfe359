"""A dataset's output image size and channel statistics, when its config leaves them unset.

Image size (`size_and_channels`): the config's `dataset.image_size`, else the dataset's own
fixed square shape, else `default_image_size`, the median shorter side of a seeded sample of
training images. Channel statistics (`channel_statistics`): `dataset.mean`/`dataset.std`
when set, else computed once on a seeded sample of training images under the evaluation
transform (`channel_stats`) and cached in the user's cache folder ($XDG_CACHE_HOME/cpjax/stats,
~/.cache by default), never beside the data: a dataset folder may be read-only or shared, and
a run leaves it untouched.
"""

import hashlib
import json
import logging
import os
from typing import Protocol

import ml_collections
import numpy as np

from cpjax.data import preprocess
from cpjax.runtime import files

STATS_SAMPLE = 512  # Training images whose pixels give the channel statistics.


class Rows(Protocol):
  """What these functions read of a split's source (cpjax.data.sources.DataSource): its
  length and the encoded bytes of some rows."""

  def __len__(self) -> int: ...

  def read(self, rows: np.ndarray) -> np.ndarray | list[bytes]: ...


def sample_rows(num_rows: int, sample: int = STATS_SAMPLE) -> np.ndarray:
  """The seeded sample of training rows (sorted) whose images give the default image size
  and the channel statistics."""
  return np.sort(np.random.default_rng(0).permutation(num_rows)[:sample])


DEFAULT_SIZE_MAX = 224  # torchvision's and timm's ImageNet input size: the default's cap.
_default_sizes: dict[str, int] = {}  # Each dataset's default size, chosen (and logged) once.


def default_image_size(train: Rows, key: str, sample: int = STATS_SAMPLE) -> int:
  """The output size of a dataset whose images vary in size: the median shorter side of a
  seeded sample of `sample` training images (read from their headers), rounded down to a
  multiple of 8, at least 8 and at most DEFAULT_SIZE_MAX (224, as torchvision's and timm's
  defaults): small images are not blown up, photos go to the usual 224. Logged once per
  dataset (`key`) and process."""
  if key in _default_sizes:
    return _default_sizes[key]
  rows = sample_rows(len(train), sample)
  where = getattr(train, "where", str)
  shorter = [min(preprocess.open_image(data, where(row)).size)
             for row, data in zip(rows, train.read(rows))]
  median = float(np.median(shorter))
  size = int(min(DEFAULT_SIZE_MAX, max(8, median // 8 * 8)))
  logging.info("dataset.image_size=0 and the images vary in size: using %d (the median shorter "
               "side of %d training images, %g px, rounded down to a multiple of 8, at most "
               "%d); set --config.dataset.image_size to choose another.", size, len(rows),
               median, DEFAULT_SIZE_MAX)
  _default_sizes[key] = size
  return size


def size_and_channels(dataset: ml_collections.ConfigDict, shape: tuple, train: Rows,
                       key: str) -> tuple[int, int]:
  """The host stage's output size and channels: the config's, else the dataset's own fixed
  image shape, else `default_image_size` of its training images (`key`: the dataset's)."""
  size = dataset.image_size or (shape[0] if shape and shape[0] and shape[0] == shape[1] else 0)
  if not size:
    size = default_image_size(train, key)
  channels = dataset.channels or (shape[-1] if shape and shape[-1] else 3)
  return size, channels


def channel_statistics(dataset: ml_collections.ConfigDict, train: Rows,
                image_shape: tuple[int, int, int], key: str
                ) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """(mean, std) per channel: the config's, else cached (files.user_cache_dir, keyed by the
  dataset's `key`, its size and the transform) or computed (`channel_stats`)."""
  if dataset.mean and dataset.std:
    return tuple(dataset.mean), tuple(dataset.std)
  transform = preprocess.Transform(size=image_shape[0], channels=image_shape[2],
                                   eval_fraction=dataset.eval_crop_fraction,
                                   resize=dataset.resize)
  key = (f"{key}|{len(train)}|{transform.size}|{transform.channels}|{transform.eval_fraction}"
         f"|{transform.resize}")
  path = os.path.join(files.user_cache_dir("stats"),
                      "cpjax_stats-" + hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")
  try:
    with open(path) as f:
      saved = json.load(f)
    if saved["key"] == key:
      return tuple(saved["mean"]), tuple(saved["std"])
  except (OSError, ValueError, KeyError, TypeError):
    pass  # Not cached yet (or a damaged entry): computed and cached again below.
  mean, std = channel_stats(train, transform)
  logging.info("Channel statistics of %s on %d training images: mean %s, std %s.",
               dataset.name, min(STATS_SAMPLE, len(train)), mean, std)
  try:
    files.atomic_write(path, json.dumps({"key": key, "mean": mean, "std": std}))
  except OSError as err:  # No cache: computed again next time, nothing else lost.
    logging.info("Channel statistics not cached (%s): %s", path, err)
  return mean, std


def channel_stats(train: Rows, transform: preprocess.Transform,
                  sample: int = STATS_SAMPLE) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-channel mean and standard deviation of pixels / 255 over a seeded sample of
  `train`'s images under the evaluation transform (rounded to 4 decimals)."""
  rows = sample_rows(len(train), sample)
  where = getattr(train, "where", str)
  images = np.stack([transform(data, 0, None, where=where(row))
                     for row, data in zip(rows, train.read(rows))]).astype(np.float64) / 255
  axes = tuple(range(images.ndim - 1))
  return (tuple(round(float(v), 4) for v in images.mean(axes)),
          tuple(round(max(float(v), 1e-3), 4) for v in images.std(axes)))
