"""Subset policies: which training examples an epoch trains on (pure: scores, ids -> ids).

`select_top_k` is a global top-k over the scores of every training example,
computed by `jax.lax.top_k` on a score array sharded over the device mesh
(XLA gathers what it needs; every process gets the same ids). Ties go to the
lower example id: scores are laid out in increasing id order and
`jax.lax.top_k` returns the lower index first among equal values. NaN scores
rank last. The random baselines are NumPy draws that are pure functions of
(seed, epoch), so a resumed run redraws the same subsets and nothing about
them needs checkpointing.
"""

import jax
import numpy as np

from cpjax.runtime import sharding

METHODS = ("full", "top_k", "uniform_sorted", "random", "static_random")
SCORED_METHODS = ("top_k", "uniform_sorted")  # The methods that read scores.


def subset_size(fraction: float, count: int, num_train: int) -> int:
  """k: `count` if set (> 0), else round(fraction * num_train), at least 1."""
  k = count if count > 0 else int(round(fraction * num_train))
  return max(1, min(k, num_train))


def _ranked_positions(scores: np.ndarray, k: int, mesh: jax.sharding.Mesh | None) -> np.ndarray:
  """Positions of the k highest scores, best first (lower position on ties)."""
  scores = np.where(np.isnan(scores), -np.inf, np.asarray(scores, np.float32))
  if mesh is None:
    mesh = sharding.create_mesh()
  devices = mesh.devices.size
  padded = np.pad(scores, (0, -len(scores) % devices), constant_values=-np.inf)
  sharded = jax.make_array_from_callback(padded.shape, sharding.batch_sharded(mesh),
                                         lambda index: padded[index])
  _, positions = _top_k(sharded, k)
  return np.asarray(sharding.to_host(positions))


@jax.jit(static_argnums=1)
def _top_k(scores: jax.Array, k: int):
  return jax.lax.top_k(scores, k)


def select_top_k(scores: np.ndarray, ids: np.ndarray, k: int,
                 mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
  """Ids of the k highest-scoring examples, best first.

  Args:
    scores: [N] one score per training example, in the order of `ids`.
    ids: [N] the examples' ids, increasing (ties go to the lower id).
    k: how many to select (<= N).
    mesh: the device mesh to shard the scores over (default: all devices).

  Returns:
    int [k] selected ids.
  """
  _check(scores, ids, k)
  return np.asarray(ids)[_ranked_positions(scores, k, mesh)]


def select_uniform_sorted(scores: np.ndarray, ids: np.ndarray, k: int,
                          mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
  """The seed repository's "uniform" criterion: every floor(N/k)-th of the sorted list.

  Spreads the subset over the whole score range instead of its top.
  """
  _check(scores, ids, k)
  ranked = _ranked_positions(scores, len(scores), mesh)
  return np.asarray(ids)[ranked[::len(scores) // k][:k]]


def random_subset(ids: np.ndarray, k: int, seed: int, epoch: int | None) -> np.ndarray:
  """k ids drawn without replacement; a new draw per epoch, or one for all (epoch=None)."""
  key = [seed, 0x5E1EC7] if epoch is None else [seed, 0x5E1EC7, epoch]
  return np.sort(np.random.default_rng(key).choice(np.asarray(ids), size=k, replace=False))


def _check(scores: np.ndarray, ids: np.ndarray, k: int) -> None:
  if len(scores) != len(ids):
    raise ValueError(f"{len(scores)} scores for {len(ids)} ids")
  if not 1 <= k <= len(scores):
    raise ValueError(f"k={k} must be in [1, {len(scores)}]")
  if np.any(np.diff(ids) <= 0):
    raise ValueError("ids must be strictly increasing (the tie-break is by id)")


def choose_subset(method: str, scores: np.ndarray, ids: np.ndarray, k: int, seed: int,
                  epoch: int, mesh: jax.sharding.Mesh | None = None) -> np.ndarray:
  """The ids of `method`'s subset of size k for `epoch` (any method but "full").

  Args:
    method: one of METHODS other than "full".
    scores: [N] the score buffer, in the order of `ids` (unused by the random ones).
    ids: [N] the training examples' ids, increasing.
    k: subset size.
    seed: the run's root seed (the random baselines' draws).
    epoch: the 0-indexed epoch (per-epoch random draws).
    mesh: the device mesh of the global top-k.
  """
  if method == "top_k":
    return select_top_k(scores, ids, k, mesh)
  if method == "uniform_sorted":
    return select_uniform_sorted(scores, ids, k, mesh)
  if method in ("random", "static_random"):
    return random_subset(ids, k, seed, None if method == "static_random" else epoch)
  raise ValueError(f"selection method {method!r} has no subset; valid: "
                   f"{', '.join(m for m in METHODS if m != 'full')}")
