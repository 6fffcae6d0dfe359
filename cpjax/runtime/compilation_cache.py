"""JAX's persistent compilation cache: on by default, so a restarted job skips compiling.

A preempted job that restarts would otherwise compile every step again (minutes on a TPU pod
or for a large model on GPUs). `configure` points JAX's persistent cache
(`jax.experimental.compilation_cache`) at `config.compilation_cache_dir` (default
~/.cache/cpjax/xla; "" turns it off), before anything compiles; every run of the same
programs on the same machine kind then loads them from there. On GPUs JAX also keeps its
per-fusion autotuning results there. A `JAX_COMPILATION_CACHE_DIR` environment variable
wins over the config (as it does for any JAX program): a cluster's shared cache, or a test
suite's private one, stays in charge. `CacheStats` counts, through `jax.monitoring`'s events,
how many compiled programs came from the cache, for the start-up log line.

The cache is trusted code: anyone who can write to its directory can make the job run
arbitrary code. Keep it private to the user (the default is under the home directory).
"""

import logging
import os
import tempfile
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"
ENV_MIN_SECONDS = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"
_WRITES = "/jax/compilation_cache/cache_misses"  # Recorded when an entry is written.
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def configure(directory: str, min_compile_seconds: float) -> str | None:
  """Turns JAX's persistent compilation cache on at `directory` (`~` expanded; "" = off) for
  programs that take at least `min_compile_seconds` to compile. Call before compiling.

  The environment variables JAX_COMPILATION_CACHE_DIR and
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, where set, win over the arguments.

  Returns:
    The cache directory in use, or None when the cache is off.
  """
  if os.environ.get(ENV_DIR):
    logging.info("Persistent compilation cache: %s (from %s).",
                 jax.config.jax_compilation_cache_dir, ENV_DIR)
    _warn_once_on_failed_writes(jax.config.jax_compilation_cache_dir)
    return jax.config.jax_compilation_cache_dir
  path = os.path.abspath(os.path.expanduser(directory)) if directory else None
  if path is not None:
    try:
      os.makedirs(path, exist_ok=True)
      tempfile.TemporaryFile(dir=path).close()  # Can entries be written there?
    except OSError as err:  # A read-only home or a full disk, say: run uncached, not fail.
      logging.warning("compilation_cache_dir=%r cannot be written (%s); compiling without "
                      "the persistent cache.", directory, err)
      path = None
  _warn_once_on_failed_writes(path)
  if path != jax.config.jax_compilation_cache_dir:
    jax_cache.set_cache_dir(path)
    jax_cache.reset_cache()  # The next compile opens the cache at the new directory.
  if ENV_MIN_SECONDS not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  logging.info("Persistent compilation cache: %s.", path or "off")
  return path


_WRITE_FAILED = "Error writing persistent compilation cache entry"


def _warn_once_on_failed_writes(path: str | None) -> None:
  """A cache folder that fills (or is removed) during a run: JAX warns once per program it
  cannot write, with a stack. The first failure becomes one warning naming the folder, the
  cache is turned off (the run goes on compiling what it lacks), and later ones are silent."""
  shown = warnings.showwarning
  if getattr(shown, "cpjax_cache_path", False) is not False:  # Ours already: rebind it.
    shown = shown.cpjax_original

  def showwarning(message, category, filename, lineno, file=None, line=None):
    if not str(message).startswith(_WRITE_FAILED):
      return showwarning.cpjax_original(message, category, filename, lineno, file, line)
    if jax.config.jax_compilation_cache_dir is not None:
      logging.warning("The persistent compilation cache %s cannot be written (%s); the run "
                      "goes on without it.", showwarning.cpjax_cache_path,
                      str(message).split(": ", 1)[-1])
      jax_cache.set_cache_dir(None)
      jax_cache.reset_cache()
    return None
  showwarning.cpjax_cache_path, showwarning.cpjax_original = path, shown
  warnings.showwarning = showwarning


class CacheStats:
  """Counts compilations that could use the persistent cache, and how many it served, from
  construction until `close` (jax.monitoring listeners)."""

  def __init__(self):
    self.requests = self.hits = self.writes = 0
    self.saved_seconds = 0.0
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    self._listening = True

  def _on_event(self, event: str, **kwargs) -> None:
    del kwargs
    if event == _REQUESTS:
      self.requests += 1
    elif event == _HITS:
      self.hits += 1
    elif event == _WRITES:
      self.writes += 1

  def _on_duration(self, event: str, duration: float, **kwargs) -> None:
    del kwargs
    if event == _SAVED:
      self.saved_seconds += duration

  def close(self) -> None:
    """Stops counting (a second call does nothing)."""
    if self._listening:
      jax.monitoring.unregister_event_listener(self._on_event)
      jax.monitoring.unregister_event_duration_listener(self._on_duration)
      self._listening = False

  def summary(self, directory: str | None) -> str:
    """One log line: where the cache is and what it served."""
    if directory is None:
      return "Persistent compilation cache off (config.compilation_cache_dir='')."
    return (f"Persistent compilation cache {directory}: {self.hits} of {self.requests} "
            f"compiled programs loaded from it ({self.saved_seconds:.1f} s of compiling "
            f"saved), {self.requests - self.hits} compiled ({self.writes} written to it).")
