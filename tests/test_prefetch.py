"""Device prefetch (cpjax.data.readers.prefetched): the host and stream readers build the next
batches in a background thread, in order, at most `prefetch_depth` ahead; errors arrive in
their place; leaving early stops the thread and closes the source; and a run trains the same,
bit for bit, with and without it."""

import threading
import time

import jax
import numpy as np
import pytest

from cpjax.config import validation
from cpjax.data import array_records, input_pipeline, readers
from cpjax.runtime import sharding
from cpjax.training import train
from tests import helpers


def _counting(n: int, log: list, fail_at: int | None = None):
  """0..n-1, noting in `log` each item made (and "closed" when closed)."""
  try:
    for i in range(n):
      if i == fail_at:
        raise OSError(f"unreadable item {i}")
      log.append(i)
      yield i
  finally:
    log.append("closed")


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_items_come_in_order(depth):
  log = []
  assert list(readers.prefetched(_counting(10, log), depth)) == list(range(10))
  assert log == [*range(10), "closed"]


def test_the_thread_stays_at_most_depth_ahead():
  """Made - consumed never exceeds depth + 1 (depth waiting in the queue, one in hand)."""
  log, depth = [], 2
  items = readers.prefetched(_counting(20, log), depth)
  for consumed in range(1, 21):
    next(items)
    time.sleep(0.02)  # Time for the thread to run ahead as far as it can.
    made = len([x for x in log if x != "closed"])
    assert consumed <= made <= consumed + depth + 1, (consumed, made)
  assert list(items) == []


def test_an_error_arrives_in_its_place():
  log = []
  items = readers.prefetched(_counting(10, log, fail_at=4), 2)
  assert [next(items) for _ in range(4)] == [0, 1, 2, 3]
  with pytest.raises(OSError, match="unreadable item 4"):
    next(items)
  assert log[-1] == "closed"


def test_leaving_early_stops_the_thread_and_closes_the_source():
  log = []
  threads_before = threading.active_count()
  items = readers.prefetched(_counting(1000, log), 2)
  assert next(items) == 0
  items.close()
  assert log[-1] == "closed" and len(log) <= 5  # Stopped, not read to the end.
  assert threading.active_count() == threads_before


def test_bad_depths_are_refused(digits):
  mesh = sharding.create_mesh()
  for depth in (-1, 1.5, True):
    with pytest.raises(ValueError, match="prefetch_depth"):
      readers.Reader(digits["train"], mesh, prefetch_depth=depth)
  with pytest.raises(validation.ConfigError, match="dataset.prefetch_depth"):
    validation.validate(helpers.tiny_config(**{"dataset.prefetch_depth": -1}))


def test_host_batches_are_the_same_with_and_without_prefetch(digits):
  mesh = sharding.create_mesh()
  rng = np.random.default_rng(0)
  blocks = rng.permutation(len(digits["train"]))[:5 * 64].reshape(5, 64)
  weights = rng.random(len(digits["train"])).astype(np.float32)
  batches = {depth: jax.device_get(list(readers.Reader(digits["train"], mesh, depth)
                                        .batches(blocks, row_weights=weights)))
             for depth in (0, 2)}
  assert len(batches[2]) == 5
  jax.tree.map(np.testing.assert_array_equal, batches[2], batches[0])
  np.testing.assert_array_equal(batches[2][3]["image"], digits["train"].images[blocks[3]])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["host", "stream"])
def test_a_run_is_the_same_with_and_without_prefetch(kind, tmp_path):
  """InfoBatch (weighted batches) after a warm-up epoch, evaluated through the same reader:
  the checkpoints and metrics of depth 0 and the default (2) agree bit for bit."""
  overrides = {"dataset.reader": kind, "dataset.stream_dir": str(tmp_path / "records"),
               "num_epochs": 2, "selection.method": "infobatch", "selection.score": "loss",
               "selection.warmup_epochs": 1, "selection.anneal_fraction": 0.0,  # Epoch 1 pruned.
               "evaluation.ood": ""}
  if kind == "stream":
    dataset = helpers.tiny_config(**overrides).dataset
    array_records.write_splits(input_pipeline.get_datasets(dataset), dataset.stream_dir,
                               dataset)
  runs = {}
  for depth in (0, 2):
    runs[depth] = str(tmp_path / f"depth{depth}")
    train.train_and_evaluate(
        helpers.tiny_config(**overrides, **{"dataset.prefetch_depth": depth}), runs[depth])
  assert helpers.without_timing(helpers.read_metrics(runs[2])) == helpers.without_timing(
      helpers.read_metrics(runs[0]))
  trees = [helpers.restore_checkpoint(runs[d]) for d in (0, 2)]
  for tree in trees:
    del tree["selection"]["seconds"]
  jax.tree.map(np.testing.assert_array_equal, trees[1], trees[0])
