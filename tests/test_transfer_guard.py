"""No step of the loop reads a device value on the host between logging points.

A `float()`, `np.asarray`, `jax.device_get` or Python branch on a device value inside the step
loop costs a CPU run nearly nothing and an accelerator most of its throughput. JAX's transfer
guard (config.step_transfer_guard) catches those on a GPU or TPU, but never fires on CPU, whose
device buffers are host memory read without a copy. So these tests count the reads instead:
every host read of a jax.Array goes through `ArrayImpl._value` (float, int, bool, item,
np.asarray, printing) or `copy_to_host_async` (jax.device_get), and both are counted while the
loop's guard is entered and none of its host points (logging, checkpoint saves) is. The runs
cover the device reader with selection (top-k, and InfoBatch's weighted steps) and gamma-Net's
bilevel step with its meta-validation batches; a planted per-step read shows that the count
would catch one.
"""

import contextlib

import jax
from jax._src import array as jax_array  # ArrayImpl: where every host read of an array goes.
import numpy as np
import pytest

from cpjax.training import setup, step_loop, train
from tests import helpers

DEVICE_READER = {"dataset.reader": "device", "evaluation.ood": "",
                 "evaluation.bootstrap_resamples": 10}


@pytest.fixture
def host_reads(monkeypatch):
  """The list of host reads made inside the step loop, outside its host points."""
  reads, inside = [], []  # inside: a stack of True (guarded loop) / False (host point).

  def scoped(original, guarded):
    @contextlib.contextmanager
    def context(*args):
      inside.append(guarded)
      try:
        with original(*args):
          yield
      finally:
        inside.pop()
    return context

  monkeypatch.setattr(step_loop, "step_guard", scoped(step_loop.step_guard, True))
  monkeypatch.setattr(step_loop, "host_point", scoped(step_loop.host_point, False))
  value, copy = jax_array.ArrayImpl._value, jax_array.ArrayImpl.copy_to_host_async  # pylint: disable=protected-access

  def note(kind, arr):
    if inside and inside[-1]:
      reads.append((kind, arr.shape, arr.dtype))

  def counted_value(arr):
    note("value", arr)
    return value.fget(arr)

  def counted_copy(arr):
    note("copy_to_host_async", arr)
    return copy(arr)

  monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted_value))
  monkeypatch.setattr(jax_array.ArrayImpl, "copy_to_host_async", counted_copy)
  return reads


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    {**helpers.SELECTED, "selection.record_scores": False},
    {"num_epochs": 3, "selection.method": "infobatch", "selection.score": "loss",
     "selection.anneal_fraction": 0.0},  # Epoch 2 pruned (none annealed).
    {**helpers.META_RUN, "num_epochs": 1},
], ids=["top_k", "infobatch", "gamma_net"])
def test_epochs_run_without_per_step_host_reads(tmp_path, host_reads, overrides):
  config = helpers.tiny_config(**{**DEVICE_READER, **overrides})
  record = train.train_and_evaluate(config, str(tmp_path))
  assert record["epoch"] == config.num_epochs - 1 and np.isfinite(record["train_loss"])
  assert len(helpers.read_metrics(str(tmp_path))) == config.num_epochs
  assert host_reads == []


@pytest.mark.slow
def test_a_per_step_host_read_is_counted(tmp_path, host_reads, monkeypatch):
  """A loss read back after every step (as a `float(loss)` in the loop would) is counted once
  per step; the logging points' own reads (every 5 steps) are not."""
  jit_train_step = setup.jit_train_step

  def syncing_step(*args, **kwargs):
    step = jit_train_step(*args, **kwargs)

    def run_and_read(*step_args):
      state, batch_metrics, per_example = step(*step_args)
      float(batch_metrics["loss_sum"])  # The per-step sync the count must catch.
      return state, batch_metrics, per_example
    return run_and_read

  monkeypatch.setattr(setup, "jit_train_step", syncing_step)
  config = helpers.tiny_config(**{**DEVICE_READER, "num_epochs": 1})
  train.train_and_evaluate(config, str(tmp_path))
  assert [kind for kind, _, _ in host_reads] == ["value"] * helpers.STEPS_PER_EPOCH


def test_guard_levels_are_validated(tmp_path):
  config = helpers.tiny_config(step_transfer_guard="forbid")
  with pytest.raises(ValueError, match="step_transfer_guard.*disallow_explicit"):
    train.train_and_evaluate(config, str(tmp_path))
  assert jax.config.jax_transfer_guard_device_to_host is None  # No guard left on.
