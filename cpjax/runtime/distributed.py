"""Starting jax.distributed for multi-process runs (called by main.py only).

Auto-detected clusters (Cloud TPU pods, SLURM, Open MPI) need no arguments:
`jax.distributed.initialize()` reads their environment. Anything else passes
the coordinator address, process count and process id explicitly, as flags
or through JAX's own variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID). A plain single-machine run starts nothing.

Liveness. A process that dies (SIGKILL, the OOM killer, a lost node) stops sending
heartbeats to JAX's coordination service; after `heartbeat_timeout_s` seconds the service
declares it dead and every other process ends with an error naming the lost task, instead
of waiting in a collective forever and holding the allocation. The job's scheduler then
sees a failed step and the requeued job resumes from the last committed checkpoint. The
timeout (main.py's --heartbeat_timeout_s) must exceed the longest pause of a healthy
process's heartbeat thread:
JAX's default is 100 s.
"""

import os

import jax

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                "JAX_COORDINATOR_ADDRESS")


HEARTBEAT_TIMEOUT_S = 100  # JAX's default: a process silent this long is declared dead.


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> None:
  """Calls jax.distributed.initialize when running as one of several processes; a process
  silent for `heartbeat_timeout_s` seconds ends the others (see the module docstring)."""
  if heartbeat_timeout_s < 1:
    raise ValueError(f"--heartbeat_timeout_s={heartbeat_timeout_s} must be at least 1 second")
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit):
    if any(v is None for v in explicit):
      raise ValueError("--coordinator_address, --num_processes and --process_id go "
                       f"together; got {explicit}")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)
  elif _is_multiprocess_cluster():
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)


def _is_multiprocess_cluster() -> bool:
  if "SLURM_JOB_ID" in os.environ:
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1
  return any(name in os.environ for name in _CLUSTER_ENV[1:])
