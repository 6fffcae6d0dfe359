"""The persistent compilation cache: where it goes, who wins, and that a restart loads from it."""

import os
import re
import subprocess
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache
import pytest

from cpjax.runtime import compilation_cache
from tests import helpers

SUMMARY = re.compile(r"Persistent compilation cache (\S+): (\d+) of (\d+) compiled programs "
                     r"loaded from it \(([-\d.]+) s of compiling saved\), (\d+) compiled "
                     r"\((\d+) written to it\)")


@pytest.fixture
def restore_jax_cache():
  """Puts the suite's cache settings (conftest) back after a test changes them."""
  directory = jax.config.jax_compilation_cache_dir
  seconds = jax.config.jax_persistent_cache_min_compile_time_secs
  yield
  jax_cache.set_cache_dir(directory)
  jax_cache.reset_cache()
  jax.config.update("jax_persistent_cache_min_compile_time_secs", seconds)


def test_the_environment_variable_wins(tmp_path, monkeypatch, restore_jax_cache):
  monkeypatch.setenv(compilation_cache.ENV_DIR, str(tmp_path / "env"))
  monkeypatch.setenv(compilation_cache.ENV_MIN_SECONDS, "7")
  before = jax.config.jax_compilation_cache_dir
  assert compilation_cache.configure(str(tmp_path / "config"), 0.5) == before
  assert jax.config.jax_compilation_cache_dir == before
  assert not os.path.exists(tmp_path / "config")


def test_config_directory_and_off(tmp_path, monkeypatch, restore_jax_cache):
  monkeypatch.delenv(compilation_cache.ENV_DIR, raising=False)
  monkeypatch.delenv(compilation_cache.ENV_MIN_SECONDS, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path))
  expected = os.path.join(str(tmp_path), "cache", "xla")
  assert compilation_cache.configure("~/cache/xla", 0.25) == expected
  assert jax.config.jax_compilation_cache_dir == expected and os.path.isdir(expected)
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.25
  assert compilation_cache.configure("", 0.25) is None
  assert jax.config.jax_compilation_cache_dir is None


def test_an_uncreatable_directory_runs_uncached(tmp_path, monkeypatch, restore_jax_cache):
  monkeypatch.delenv(compilation_cache.ENV_DIR, raising=False)
  (tmp_path / "file").write_text("not a directory")
  assert compilation_cache.configure(str(tmp_path / "file" / "xla"), 1.0) is None
  assert jax.config.jax_compilation_cache_dir is None


def test_cache_stats_count_hits_and_compiles(tmp_path, monkeypatch, restore_jax_cache):
  """A function compiled, then compiled again after JAX forgot it in memory: one compile
  written to the cache, then one load from it."""
  monkeypatch.delenv(compilation_cache.ENV_DIR, raising=False)
  monkeypatch.delenv(compilation_cache.ENV_MIN_SECONDS, raising=False)
  directory = compilation_cache.configure(str(tmp_path / "xla"), 0.0)
  stats = compilation_cache.CacheStats()
  try:
    fn = lambda x: jax.numpy.sin(x) * 3.0 + 0.123456  # noqa: E731  A program no test compiles.
    jax.jit(fn)(1.0).block_until_ready()
    assert (stats.requests, stats.hits, stats.writes) == (1, 0, 1)
    jax.clear_caches()
    jax.jit(fn)(1.0).block_until_ready()
    assert (stats.requests, stats.hits, stats.writes) == (2, 1, 1)
  finally:
    stats.close()
  assert SUMMARY.match(stats.summary(directory)).groups()[1:3] == ("1", "2")
  assert "off" in stats.summary(None)


def _run_main(workdir: str, cache: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in helpers.subprocess_env().items()
         if k not in (compilation_cache.ENV_DIR, compilation_cache.ENV_MIN_SECONDS)}
  flags = ["--config.num_epochs=1", "--config.budget_steps=2", "--config.evaluation.ood=",
           f"--config.compilation_cache_dir={cache}", "--config.compilation_cache_min_seconds=0"]
  return subprocess.run(helpers.main_command(workdir, *flags), cwd=helpers.REPO, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_restart_loads_its_programs_from_the_cache(tmp_path):
  """main.py twice with the same config and a cache of its own: the first run compiles and
  writes every program, the second loads them all and logs so."""
  cache = str(tmp_path / "xla")
  summaries = []
  for name in ("first", "restart"):
    result = _run_main(str(tmp_path / name), cache)
    assert result.returncode == 0, result.stderr[-3000:]
    (match,) = SUMMARY.findall(result.stderr)
    summaries.append(match)
  (path, hits, requests, _, compiled, written), restart = summaries
  assert path == cache and os.listdir(cache)
  assert int(hits) == 0 and int(requests) > 0 and int(written) == int(compiled) == int(requests)
  assert restart[0] == cache and int(restart[1]) == int(restart[2]) == int(requests)
  assert int(restart[4]) == int(restart[5]) == 0


def test_an_unwritable_directory_runs_uncached(tmp_path, monkeypatch, restore_jax_cache):
  """A folder that exists but takes no file (here: a full one stands in as a folder whose
  temporary file fails): one warning naming it, and no cache."""
  monkeypatch.delenv(compilation_cache.ENV_DIR, raising=False)
  target = tmp_path / "xla"
  target.mkdir()

  def no_room(*args, **kwargs):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(compilation_cache.tempfile, "TemporaryFile", no_room)
  assert compilation_cache.configure(str(target), 1.0) is None
  assert jax.config.jax_compilation_cache_dir is None


def test_failed_writes_during_a_run_are_one_warning_and_the_cache_goes_off(
    tmp_path, monkeypatch, restore_jax_cache, caplog):
  """JAX warns once per program it cannot write (a cache folder that fills mid-run): the
  first becomes one warning naming the folder, the cache is turned off, the rest are
  silent; other warnings pass through untouched."""
  monkeypatch.delenv(compilation_cache.ENV_DIR, raising=False)
  monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # Restored after.
  folder = str(tmp_path / "xla")
  compilation_cache.configure(folder, 1.0)
  passed = []
  original = warnings.showwarning.cpjax_original
  monkeypatch.setattr(warnings.showwarning, "cpjax_original",
                      lambda message, *args, **kwargs: passed.append(str(message)))
  with caplog.at_level("WARNING"):
    for name in ("jit_a", "jit_b", "jit_c"):
      warnings.showwarning(UserWarning(
          f"Error writing persistent compilation cache entry for '{name}': OSError: [Errno 28] "
          "No space left on device"), UserWarning, "compiler.py", 1)
    warnings.showwarning(UserWarning("something else"), UserWarning, "x.py", 2)
  lines = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
  assert len(lines) == 1 and folder in lines[0] and "No space left" in lines[0]
  assert jax.config.jax_compilation_cache_dir is None
  assert passed == ["something else"]
  assert original is not None
