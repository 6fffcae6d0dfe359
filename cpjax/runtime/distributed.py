"""Starting jax.distributed for multi-process runs (called by main.py only).

Auto-detected clusters (Cloud TPU pods, SLURM, Open MPI) need no arguments:
`jax.distributed.initialize()` reads their environment. Anything else passes
the coordinator address, process count and process id explicitly, as flags
or through JAX's own variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID). A plain single-machine run starts nothing.
"""

import os

import jax

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                "JAX_COORDINATOR_ADDRESS")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
  """Calls jax.distributed.initialize when running as one of several processes."""
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise ValueError("--coordinator_address, --num_processes and --process_id go "
                       f"together; got {explicit}")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif _is_multiprocess_cluster():
    jax.distributed.initialize()


def _is_multiprocess_cluster() -> bool:
  if "SLURM_JOB_ID" in os.environ:
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1
  return any(name in os.environ for name in _CLUSTER_ENV[1:])
