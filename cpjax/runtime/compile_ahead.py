"""A run's programs compiled before its first epoch, several at once.

Without it each jitted function compiles at its first call: the train step at the first step,
the eval step at the first evaluation (epoch 1 where evaluation is every other epoch), the
scoring step and the ranking at the first selected epoch. Each is a slow step in the middle of
the run, and one after another on one core. Here they are lowered for the arguments they will
get (`jit(f).lower(...)` of abstract values with the real shardings) and compiled in a few
threads at once, XLA's compiler working in each, before the loop starts; their first calls
then find them compiled (JAX's own cache of the function), so that epoch 0 runs at the steady
pace and no step compiles after it. A program that fails to compile ahead is not an error:
it is logged, and compiles at its first call as before.

The arguments' structure comes from the readers themselves: the first item of a batch
generator built exactly as the loop builds its own (no image of it is used), so that the
abstract batch cannot drift from the real one.
"""

from collections.abc import Callable, Iterable
import concurrent.futures
import contextlib
import logging
import time
from typing import Any

import jax
import numpy as np

# XLA's CPU and GPU compilers run a program's compilation in the calling thread: two
# threads compile two programs at once (the train and the eval step, the largest two).
THREADS = 2


def abstract(tree: Any) -> Any:
  """ShapeDtypeStructs of `tree`'s leaves: a jax.Array's with its sharding, a host value's
  (NumPy array or scalar) without one, as jit sees each."""
  def leaf(x):
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return jax.tree.map(leaf, tree)


def first_item(items: Iterable[Any]) -> Any:
  """The first item of a (batch) generator, which is then closed (ending its read-ahead);
  None when it has none."""
  with contextlib.closing(iter(items)) as iterator:
    return next(iterator, None)


class Compiler:
  """Lowers and compiles jitted functions for abstract arguments in `THREADS` threads."""

  def __init__(self):
    self._pool = concurrent.futures.ThreadPoolExecutor(THREADS,
                                                       thread_name_prefix="compile-ahead")
    self._futures: dict[str, concurrent.futures.Future] = {}

  def submit(self, name: str, jitted: Callable, *args: Any,
             then: Callable[[Any], None] | None = None) -> None:
    """Compiles `jitted` for `args` (abstract or real); `then(compiled)` runs after, in the
    same thread (to compile what takes its outputs)."""
    def work():
      compiled = jitted.lower(*args).compile()
      if then is not None:
        then(compiled)
      return compiled
    self._futures[name] = self._pool.submit(work)

  def wait(self) -> float:
    """Waits for every program; returns the seconds waited. A failure is logged (that
    program compiles at its first call instead)."""
    started = time.perf_counter()
    for name, future in list(self._futures.items()):
      try:
        future.result()
      except Exception as err:  # pylint: disable=broad-except  (the first call compiles it)
        logging.warning("Compiling %s ahead failed (%s: %s); it compiles at its first call "
                        "instead.", name, type(err).__name__, str(err)[:300])
    self._pool.shutdown()
    return time.perf_counter() - started


def out_abstract(compiled: Any) -> Any:
  """The abstract outputs (shapes, dtypes, shardings) of a compiled program."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      compiled.out_info)
