"""The content hashes recorded with each checkpoint: pure functions of arrays and JSON.

`integrity_record(state, meta)` is what cpjax.runtime.checkpointing stores under
the reserved `meta` key INTEGRITY_KEY at save and checks at restore: a SHA-256
of every leaf's C-order little-endian bytes (keyed by its dotted path, with its
shape and dtype), one digest over all of those in path order, and a digest of
the rest of `meta`. A record that is malformed or disagrees with itself raises
`Damaged`, as does any content that differs from it (the checkpointer's checks).
"""

import hashlib
import json
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

INTEGRITY_KEY = "_integrity"  # Reserved key of `meta`: the hash record of a checkpoint.
_HASH_VERSION = 1


class Damaged(Exception):
  """A checkpoint step is unreadable or its content differs from what was saved."""


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path: tuple[Any, ...]) -> str:
  return ".".join(_key_name(k) for k in path)


def leaves_by_name(tree: Any) -> dict[str, Any]:
  """Leaves keyed by a dotted path of plain names (orbax stores dataclasses as dicts)."""
  named = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = path_name(path)
    if name in named:
      raise ValueError(f"two leaves of a checkpoint pytree are both named {name!r}")
    named[name] = leaf
  return named


def _host_array(leaf: Any) -> np.ndarray:
  """A complete host copy of one leaf (on every process; see the module docstring)."""
  if isinstance(leaf, jax.Array):
    if leaf.is_fully_addressable:
      return np.asarray(leaf)
    if leaf.is_fully_replicated:
      return np.asarray(leaf.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
  return np.asarray(leaf)


def leaf_entry(leaf: Any) -> dict[str, Any]:
  """{shape, dtype, sha256} of one leaf; the hash is over its C-order little-endian bytes."""
  array = _host_array(leaf)
  if array.dtype.byteorder == ">":
    array = array.astype(array.dtype.newbyteorder("<"))
  data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
  return {"shape": [int(d) for d in array.shape], "dtype": str(array.dtype),
          "sha256": hashlib.sha256(data).hexdigest()}


def _state_digest(leaves: dict[str, dict[str, Any]]) -> str:
  """One SHA-256 over every leaf's path, dtype, shape and bytes' hash, in path order."""
  digest = hashlib.sha256()
  for name in sorted(leaves):
    entry = leaves[name]
    digest.update(json.dumps([name, entry["dtype"], entry["shape"], entry["sha256"]]).encode())
    digest.update(b"\n")
  return digest.hexdigest()


def canonical_meta(meta: dict[str, Any]) -> dict[str, Any]:
  """`meta` as it reads back from JSON, without the integrity record."""
  meta = {k: v for k, v in meta.items() if k != INTEGRITY_KEY}
  return json.loads(json.dumps(meta))


def meta_digest(meta: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(canonical_meta(meta), sort_keys=True).encode()).hexdigest()


def integrity_record(state: Any, meta: dict[str, Any]) -> dict[str, Any]:
  """The hash record `save` stores in `meta[INTEGRITY_KEY]` for `state` and `meta`."""
  leaves = {name: leaf_entry(leaf) for name, leaf in sorted(leaves_by_name(state).items())}
  return {"version": _HASH_VERSION, "algorithm": "sha256", "state_sha256": _state_digest(leaves),
          "meta_sha256": meta_digest(meta), "leaves": leaves}


def check_record(record: Any) -> dict[str, dict[str, Any]]:
  """The record's leaves if the record is well formed and self-consistent, else Damaged."""
  try:
    if record["version"] != _HASH_VERSION or record["algorithm"] != "sha256":
      raise Damaged(f"unknown integrity record version {record['version']!r} "
                     f"({record['algorithm']!r})")
    leaves = record["leaves"]
    consistent = _state_digest(leaves) == record["state_sha256"]
  except (KeyError, TypeError, AttributeError) as err:
    raise Damaged(f"malformed integrity record in meta ({err!r})") from err
  if not consistent:
    raise Damaged("the integrity record in meta is inconsistent with its own digest")
  return leaves
