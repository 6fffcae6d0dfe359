"""Splits in host memory with stable ids, the validation carve-out, and batches.

Every example keeps a stable integer `id`: its index in the dataset's full tfds
`train` split (or `test` split for test examples). Batch order is a pure
function of (seed, epoch, step), so a resumed run sees the same batches;
evaluation batches are padded and carry a `mask` so every example is seen
exactly once, whatever the batch or device count. Pure NumPy: no tfds here.
"""

import dataclasses
import hashlib
from typing import Any

import ml_collections
import numpy as np

from cpjax.data import specs


@dataclasses.dataclass(frozen=True)
class Split:
  """One split in host memory, rows sorted by id: the in-memory data source
  (cpjax.data.sources.DataSource) of the built-in datasets."""
  images: np.ndarray | None  # uint8 [N, H, W, C]; None when streamed (cpjax.data.readers)
  labels: np.ndarray  # int32 [N]
  ids: np.ndarray  # int32 [N], stable example ids
  encoded = False  # read() gives decoded pixels.

  def __len__(self) -> int:
    return len(self.labels)

  def take(self, rows: np.ndarray) -> "Split":
    return Split(None if self.images is None else self.images[rows], self.labels[rows],
                 self.ids[rows])

  def read(self, rows: np.ndarray) -> np.ndarray:
    """uint8 images [len(rows), H, W, C] of `rows`."""
    return self.images[rows]


def carve_validation(num_train: int, val_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Seeded split of ids 0..num_train-1 into (train ids, val ids), each sorted.

  A NumPy permutation of the train split whose last `val_size` ids become
  validation. The shape of Tata et al. 2022's split (a permutation, the tail
  is validation) but not its ids: their code draws `torch.randperm` with
  `manual_seed(42)` through `random_split`, which NumPy cannot reproduce
  without depending on torch (docs/methods.md#data-splits-and-architectures). Runs compared
  with that code therefore validate (and train) on different examples.
  """
  perm = np.random.default_rng(seed).permutation(num_train)
  return np.sort(perm[:-val_size]), np.sort(perm[-val_size:])


TRAIN_PARTS = ("all", "rest", "holdout")


def carved_val_size(config: ml_collections.ConfigDict) -> int:
  """Validation examples carved out of the train split: `val_size`, or none when the dataset
  has a validation split of its own (a folder's val/, a tfds dataset's validation split)."""
  return 0 if specs.DATASETS[config.name].val_split else config.val_size


def carved_test_size(config: ml_collections.ConfigDict) -> int:
  """Test examples carved out of the train split: none when the dataset has a test split,
  else `test_size`."""
  return 0 if specs.DATASETS[config.name].test_split else config.get("test_size", 0)


def _holdout_size(pool_size: int, holdout_fraction: float) -> int:
  return int(round(holdout_fraction * pool_size))


def num_train_examples(config: ml_collections.ConfigDict) -> int:
  """Training examples after the validation, meta-validation and holdout carve-outs and any
  `train_examples` cap."""
  if config.train_examples:
    return config.train_examples
  # .get: the configs saved by older runs have no meta_val_size or holdout fields.
  pool = (specs.DATASETS[config.name].num_train - carved_val_size(config)
          - carved_test_size(config) - config.get("meta_val_size", 0))
  holdout = _holdout_size(pool, config.get("holdout_fraction", 0.0))
  return {"all": pool, "rest": pool - holdout, "holdout": holdout}[
      config.get("train_part", "all")]


def split_ids(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """{"train", "val", "meta_val", "pool"} ids of `config.dataset`, each sorted, and "test"
  where the dataset has no test split.

  Validation is carved first (`carve_validation`; none where the dataset has a validation
  split of its own), then the test ids of a dataset without a test split (`test_size`, a
  seeded draw); the meta-validation ids (FL_gamma's
  held-out batches, `meta_val_size`, none by default) are a seeded draw from the rest, so
  they never overlap validation or test. What is left is the training pool ("pool", where
  `label_noise` applies). A `holdout_fraction` of the pool is a further seeded draw: a run
  with `train_part="holdout"` trains on it (RHO-LOSS's irreducible-loss model, Mindermann et
  al., ICML 2022), one with `train_part="rest"` on the other rows, and "all" on the whole
  pool. `train_examples` then caps the training ids.
  """
  spec = specs.DATASETS[config.name]
  if spec.val_split:  # Validation is a split of its own: every train id trains.
    train_ids, val_ids = np.arange(spec.num_train), np.zeros(0, np.int64)
  else:
    train_ids, val_ids = carve_validation(spec.num_train, config.val_size, config.split_seed)
  carved = {}
  if test_size := carved_test_size(config):  # No test split: a seeded draw after validation.
    drawn = np.random.default_rng([config.split_seed, 6]).permutation(train_ids)
    carved["test"], train_ids = np.sort(drawn[:test_size]), np.sort(drawn[test_size:])
  meta_size = config.get("meta_val_size", 0)
  drawn = np.random.default_rng([config.split_seed, 2]).permutation(train_ids)
  meta_ids = np.sort(drawn[:meta_size])
  if meta_size:  # Without a carve-out the training ids stay exactly as they were.
    train_ids = np.sort(drawn[meta_size:])
  pool_ids = train_ids
  part = config.get("train_part", "all")
  if part != "all":
    holdout = _holdout_size(len(pool_ids), config.get("holdout_fraction", 0.0))
    drawn = np.random.default_rng([config.split_seed, 4]).permutation(pool_ids)
    train_ids = np.sort(drawn[:holdout] if part == "holdout" else drawn[holdout:])
  if config.train_examples:  # A seeded subset of the training ids, for quick studies.
    train_ids = np.sort(np.random.default_rng([config.split_seed, 1]).choice(
        train_ids, config.train_examples, replace=False))
  return {"train": train_ids, "val": val_ids, "meta_val": meta_ids, "pool": pool_ids, **carved}


# The label-noise draw's stream tag, in (seed, tag) seeds: far above any epoch number, so that
# no epoch's order (`epoch_order`, seeded by (seed, epoch)) draws from the same stream.
LABEL_NOISE_STREAM = 0x1AB3150


def noisy_labels(labels: np.ndarray, pool_rows: np.ndarray, fraction: float, seed: int,
                 num_classes: int) -> np.ndarray:
  """Labels with round(fraction * P) of the P `pool_rows` flipped uniformly to another class.

  Symmetric ("uniform to another class") label noise, the usual synthetic benchmark
  (e.g. RHO-LOSS's and the noisy-label literature's): the flipped rows are a seeded draw
  from the pool, and each gets label (y + o) mod K with o uniform on 1..K-1, so it never
  keeps its class. Rows outside the pool (validation, test) keep their labels. A pure
  function of (seed, pool): a run trained on part of the pool sees the same noisy labels
  as one trained on the rest. Its random stream, (seed, LABEL_NOISE_STREAM), is none of
  `epoch_order`'s (seed, epoch): with `label_noise_seed` equal to the training seed, a stream
  that an epoch's order shares would shuffle that epoch with the permutation that picked the
  flipped rows, so that a full-data epoch trained them all first, back to back.

  Args:
    labels: int [N] labels of the whole split.
    pool_rows: int [P] rows of `labels` that are training data, in increasing id order.
    fraction: share of the pool to flip, in [0, 1).
    seed: the noise seed (`dataset.label_noise_seed`).
    num_classes: K >= 2.

  Returns:
    int32 [N] labels.
  """
  rng = np.random.default_rng([seed, LABEL_NOISE_STREAM])
  flipped = rng.permutation(len(pool_rows))[:int(round(fraction * len(pool_rows)))]
  offsets = rng.integers(1, num_classes, size=len(flipped))
  out = np.array(labels, np.int32)
  rows = np.asarray(pool_rows)[flipped]
  out[rows] = (out[rows] + offsets) % num_classes
  return out


def noise_draw(dataset: ml_collections.ConfigDict, train) -> dict[str, Any]:
  """The label-noise draw a run trains on, for its provenance (cpjax.runtime.provenance):
  the share and seed of `noisy_labels`, its stream tag, and sha256 of the `train` split's ids
  and labels as they are trained (int64 ids, then int64 labels), which names the draw
  whatever code made it (0 share: the clean labels' digest)."""
  digest = hashlib.sha256(np.asarray(train.ids, np.int64).tobytes()
                          + np.asarray(train.labels, np.int64).tobytes()).hexdigest()
  return {"share": dataset.label_noise, "seed": dataset.label_noise_seed,
          "stream": LABEL_NOISE_STREAM, "train_labels_sha256": digest}


def cycled_rows(seed: int, step: int, num_rows: int, batch_size: int) -> np.ndarray:
  """Rows [batch_size] of batch `step` of an endless walk over `num_rows` rows that reshuffles
  at every pass (pass p: permutation of (seed, p)): the meta-validation batch of global step
  `step`, a pure function of the step so that a resumed run draws the same batches."""
  positions = np.arange(step * batch_size, (step + 1) * batch_size)
  passes = positions // num_rows
  rows = np.empty(batch_size, np.int64)
  for p in np.unique(passes):
    at = passes == p
    permutation = np.random.default_rng([seed, 3, int(p)]).permutation(num_rows)
    rows[at] = permutation[positions[at] % num_rows]
  return rows


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


def eval_rows(num_rows: int, batch_size: int):
  """Yields (rows [batch_size], mask [batch_size]) covering rows 0..num_rows-1 exactly once in
  order; the last batch is padded with row 0 under mask 0."""
  for start in range(0, num_rows, batch_size):
    rows = np.arange(start, min(start + batch_size, num_rows))
    mask = np.zeros(batch_size, np.float32)
    mask[:len(rows)] = 1.0
    yield np.pad(rows, (0, batch_size - len(rows))), mask
