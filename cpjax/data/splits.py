"""Splits in host memory with stable ids, the validation carve-out, and batches.

Every example keeps a stable integer `id`: its index in the dataset's full tfds
`train` split (or `test` split for test examples). Batch order is a pure
function of (seed, epoch, step), so a resumed run sees the same batches;
evaluation batches are padded and carry a `mask` so every example is seen
exactly once, whatever the batch or device count. Pure NumPy: no tfds here.
"""

import dataclasses

import ml_collections
import numpy as np

from cpjax.data import specs


@dataclasses.dataclass(frozen=True)
class Split:
  """One split in host memory, rows sorted by id."""
  images: np.ndarray  # uint8 [N, H, W, C]
  labels: np.ndarray  # int32 [N]
  ids: np.ndarray  # int32 [N], stable example ids

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, rows: np.ndarray) -> "Split":
    return Split(self.images[rows], self.labels[rows], self.ids[rows])


def carve_validation(num_train: int, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Seeded split of ids 0..num_train-1 into (train ids, val ids), each sorted.

  A NumPy permutation of the train split whose last `val_size` ids become
  validation. The shape of the seed code's split (a permutation, the tail is
  validation) but not its ids: the seed draws `torch.randperm` with
  `manual_seed(42)` through `random_split` (spec §1.1), which NumPy cannot
  reproduce without depending on torch. Runs compared with the seed repository
  therefore validate (and, for the train split, train) on different examples.
  """
  perm = np.random.default_rng(seed).permutation(num_train)
  return np.sort(perm[:-val_size]), np.sort(perm[-val_size:])


def num_train_examples(config: ml_collections.ConfigDict) -> int:
  """Training examples after the validation carve-out and any `train_examples` cap."""
  return config.train_examples or specs.DATASETS[config.name].num_train - config.val_size


def split_train_ids(config: ml_collections.ConfigDict) -> tuple[np.ndarray, np.ndarray]:
  """(train ids, validation ids) of `config.dataset`, each sorted."""
  spec = specs.DATASETS[config.name]
  train_ids, val_ids = carve_validation(spec.num_train, config.val_size, config.split_seed)
  if config.train_examples:  # A seeded subset of the training ids, for quick studies.
    train_ids = np.sort(np.random.default_rng([config.split_seed, 1]).choice(
        train_ids, config.train_examples, replace=False))
  return train_ids, val_ids


def epoch_order(seed: int, epoch: int, rows: np.ndarray, batch_size: int) -> np.ndarray:
  """Rows of one training epoch in batch order, as a pure function of (seed, epoch).

  The rows are shuffled and cycled to fill the last batch, so every row is
  trained at least once per epoch and every batch is full (BatchNorm sees no
  padding).

  Returns:
    int array [num_steps, batch_size], num_steps = ceil(len(rows) / batch_size).
  """
  shuffled = rows[np.random.default_rng([seed, epoch]).permutation(len(rows))]
  num_steps = -(-len(rows) // batch_size)
  return np.resize(shuffled, (num_steps, batch_size))


def batch_at(split: Split, rows: np.ndarray, mask: np.ndarray | None = None,
             weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
  """Gathers one host batch: image, label, id and mask (1 = real example), and with
  `weights` (float32, one per row) a per-example loss weight `weight`."""
  batch = {"image": split.images[rows], "label": split.labels[rows], "id": split.ids[rows],
           "mask": np.ones(len(rows), np.float32) if mask is None else mask}
  if weights is not None:
    batch["weight"] = np.asarray(weights, np.float32)
  return batch


def eval_batches(split: Split, batch_size: int):
  """Yields padded batches covering every row of `split` exactly once."""
  for start in range(0, len(split), batch_size):
    rows = np.arange(start, min(start + batch_size, len(split)))
    mask = np.zeros(batch_size, np.float32)
    mask[:len(rows)] = 1.0
    yield batch_at(split, np.pad(rows, (0, batch_size - len(rows))), mask)
