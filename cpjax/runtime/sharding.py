"""The device mesh, moving host batches onto it, and gathering results back to the host.

One 1-D mesh with axis `data` over every device of every process. The train
state is replicated; batches are sharded on their leading axis. Each process
builds only its own rows of every global batch, and
`jax.make_array_from_process_local_data` assembles the global array, so the
same code runs on one CPU, 8 GPUs or a multi-host cluster.
"""

import functools

import jax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np


def create_mesh(devices: list[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A 1-D mesh named `data` over `devices` (default: all), with Auto axes."""
  devices = jax.devices() if devices is None else devices
  return jax.make_mesh((len(devices),), ("data",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharded(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P("data"))


@functools.lru_cache(maxsize=64)  # Asked once per batch; the answer never changes.
def process_rows(mesh: jax.sharding.Mesh, global_batch_size: int) -> slice:
  """The contiguous rows of a global batch that this process's devices hold."""
  index_map = batch_sharded(mesh).addressable_devices_indices_map((global_batch_size,))
  starts = sorted(idx[0].start or 0 for idx in index_map.values())
  stops = sorted(idx[0].stop or global_batch_size for idx in index_map.values())
  if stops[-1] - starts[0] != global_batch_size // jax.process_count():
    raise ValueError("this process's devices do not hold a contiguous block of the batch")
  return slice(starts[0], stops[-1])


def to_global(mesh: jax.sharding.Mesh, local_batch: dict[str, np.ndarray],
              global_batch_size: int) -> dict[str, jax.Array]:
  """This process's rows of a batch -> global arrays sharded on `data`."""
  sharding = batch_sharded(mesh)
  return {key: jax.make_array_from_process_local_data(
              sharding, value, (global_batch_size,) + value.shape[1:])
          for key, value in local_batch.items()}


def to_global_blocks(mesh: jax.sharding.Mesh, local_blocks: dict[str, np.ndarray],
                     global_batch_size: int) -> dict[str, jax.Array]:
  """This process's columns of [S, B] blocks (S batches' rows) -> global arrays with the
  batch axis (1) sharded on `data`, as `to_global` lays out each batch."""
  blocks = NamedSharding(mesh, P(None, "data"))
  return {key: jax.make_array_from_process_local_data(
              blocks, value, (value.shape[0], global_batch_size) + value.shape[2:])
          for key, value in local_blocks.items()}


def to_host(tree):
  """Fully gathers (possibly multi-process) global arrays to NumPy on every host."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def replicate(mesh: jax.sharding.Mesh, tree):
  """Host arrays (identical on every process) -> global arrays replicated on `mesh`."""
  def put(value):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, replicated(mesh), lambda index: value[index])
  return jax.tree.map(put, tree)
