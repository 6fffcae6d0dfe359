"""One run per workdir: an exclusive lock on `workdir/cpjax.lock`, named by its holder.

Two runs writing one workdir interleave checkpoints and metrics.jsonl records
and corrupt both, so a run holds this lock from before it restores anything
until it exits. The lock is `fcntl.flock` on the file: the kernel releases it
when the holder exits for any reason (SIGKILL included), so a crashed run
never leaves a lock that blocks the rerun. The file also names the holder
(host, PID, start time, command line) for the second run's error message.

Stale locks. Where the filesystem does not support flock (some network
filesystems), the file's content is the lock instead: a holder on this host
whose PID is no longer alive is stale and taken over with a warning; a holder
on another host cannot be checked from here, so the error says to delete the
file if that run is known to be gone.

Multi-process runs share one workdir: process 0 takes the lock and all
processes learn the outcome (an allgather), so every process of a second
launch fails at once instead of waiting in a collective.
"""

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time

import jax
from jax.experimental import multihost_utils
import numpy as np

LOCK_FILE = "cpjax.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class WorkdirLockedError(RuntimeError):
  """Another run holds the workdir."""


class WorkdirLock:
  """Context manager holding `workdir`'s lock; raises WorkdirLockedError if it is taken."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._file = None

  def __enter__(self) -> "WorkdirLock":
    problem = self._acquire() if jax.process_index() == 0 else ""
    problems = multihost_utils.process_allgather(np.int32(bool(problem)))
    if np.any(problems):
      self.release()
      raise WorkdirLockedError(problem or f"process 0 could not lock {self.path}; see its log")
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()

  def release(self) -> None:
    """Gives the lock up (idempotent); the file stays, naming no one."""
    if self._file is not None:
      self._file.truncate(0)  # A later reader must not take a finished run for a live one.
      self._file.close()  # Closing the descriptor releases the flock.
      self._file = None

  def _acquire(self) -> str:
    """Takes the lock; returns "" on success, else the message naming the holder."""
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    f = open(self.path, "a+")  # Never truncates a holder's record before we hold the lock.
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
      if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
        f.close()
        return self._held_message(read_holder(self.path), checked=True)
      if err.errno not in _NO_FLOCK:
        f.close()
        raise
      holder = read_holder(self.path)
      if holder and not _is_stale(holder):
        f.close()
        return self._held_message(holder, checked=False)
      if holder:
        logging.warning("Taking over %s: its holder (PID %s on %s) is no longer running.",
                        self.path, holder.get("pid"), holder.get("host"))
    f.seek(0)
    f.truncate(0)
    f.write(json.dumps(_this_process()) + "\n")
    f.flush()
    self._file = f
    return ""

  def _held_message(self, holder: dict | None, checked: bool) -> str:
    who = (f"PID {holder.get('pid')} on host {holder.get('host')}, started "
           f"{holder.get('started')} ({holder.get('command')})" if holder else "another process")
    hint = ("wait for it, stop it, or use another --workdir" if checked else
            "if that run is gone (this filesystem has no flock, so cpjax cannot tell), delete "
            f"{self.path}; otherwise wait for it or use another --workdir")
    return f"--workdir {os.path.dirname(self.path)!r} is in use by {who}: {hint}."


def read_holder(path: str) -> dict | None:
  """The holder record of a lock file, or None if it names no one (or is unreadable)."""
  try:
    with open(path) as f:
      return json.loads(f.read() or "null")
  except (OSError, ValueError):
    return None


def _this_process() -> dict:
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}


def _is_stale(holder: dict) -> bool:
  """True only if the holder is on this host and its PID is not alive."""
  if holder.get("host") != socket.gethostname():
    return False
  try:
    os.kill(int(holder["pid"]), 0)
  except ProcessLookupError:
    return True
  except (PermissionError, KeyError, TypeError, ValueError):
    return False
  return False
