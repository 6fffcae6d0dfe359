"""Readers (cpjax.data.readers): the device and stream readers' batches are the host reader's,
bit for bit, on 1 and 8 devices, and so is a whole run; `auto` picks by size; the stream
reader reads only this process's rows (2 processes on 127.0.0.1) and stays under a memory cap
on a generated set several times its size."""

import concurrent.futures
import os
import time
import types

import jax
import numpy as np
from PIL import Image
import pytest

from cpjax.config import validation
from cpjax.data import (
  array_records,
  host_stage,
  input_pipeline,
  readers,
  sources,
)
from cpjax.data.device_stage import decoders
from cpjax.data.device_stage.reader import DeviceStageReader
from cpjax.runtime import preemption, sharding
from cpjax.training import train
from tests import helpers
from tests.helpers import read_metrics, tiny_config


@pytest.mark.parametrize("num_devices", [1, 8])
def test_device_batches_are_the_host_split_rows(digits, num_devices):
  mesh = sharding.create_mesh(jax.devices()[:num_devices])
  split = digits["train"]
  rng = np.random.default_rng(num_devices)
  rows = rng.integers(0, len(split), 64)  # Repeats allowed, as in a cycled last batch.
  mask = (rng.random(64) < 0.8).astype(np.float32)
  weights = rng.random(64).astype(np.float32)
  host = readers.Reader(split, mesh).batch(rows, mask, weights)
  device = readers.DeviceReader(split, mesh).batch(rows, mask, weights)
  expected = {"image": split.images[rows], "label": split.labels[rows], "id": split.ids[rows],
              "mask": mask, "weight": weights}  # Straight NumPy indexing of the split.
  assert set(host) == set(device) == set(expected)
  for key, value in expected.items():
    for batch in (host, device):
      assert batch[key].sharding.is_equivalent_to(sharding.batch_sharded(mesh), 1)
      np.testing.assert_array_equal(np.asarray(batch[key]), value)
      assert np.asarray(batch[key]).dtype == value.dtype, key


@pytest.mark.parametrize("num_devices", [1, 8])
def test_device_reader_epoch_blocks_are_the_split_rows(digits, num_devices):
  """`batches` (the epoch's rows sent once, one gather per batch) gives NumPy's indexing of
  the split, with masks and per-row weights, each batch sharded on `data`; none for S = 0."""
  mesh = sharding.create_mesh(jax.devices()[:num_devices])
  split = digits["train"]
  rng = np.random.default_rng(num_devices)
  blocks = rng.integers(0, len(split), (3, 64))
  masks = (rng.random((3, 64)) < 0.8).astype(np.float32)
  row_weights = rng.random(len(split)).astype(np.float32)
  reader = readers.DeviceReader(split, mesh)
  batches = list(reader.batches(blocks, masks, row_weights))
  assert len(batches) == 3 and list(reader.batches(blocks[:0])) == []
  for s, batch in enumerate(batches):
    rows = blocks[s]
    expected = {"image": split.images[rows], "label": split.labels[rows],
                "id": split.ids[rows], "mask": masks[s], "weight": row_weights[rows]}
    assert set(batch) == set(expected)
    for key, value in expected.items():
      assert batch[key].sharding.is_equivalent_to(sharding.batch_sharded(mesh), 1)
      np.testing.assert_array_equal(np.asarray(batch[key]), value)
      assert np.asarray(batch[key]).dtype == value.dtype, key
  unmasked = list(reader.batches(blocks[:1]))[0]
  assert set(unmasked) == {"image", "label", "id", "mask"} and np.all(
      np.asarray(unmasked["mask"]) == 1)


def test_auto_picks_device_when_the_splits_fit_the_budget():
  assert input_pipeline.in_memory_kind("auto", 100 * 2**20, 100.0) == "device"  # Exactly fits.
  assert input_pipeline.in_memory_kind("auto", 100 * 2**20 + 1, 100.0) == "host"
  assert input_pipeline.in_memory_kind("auto", 25 * 2**20, 100.0, copies=4) == "device"  # 4 CPUs.
  assert input_pipeline.in_memory_kind("auto", 25 * 2**20 + 1, 100.0, copies=4) == "host"
  assert input_pipeline.in_memory_kind("host", 1, 100.0) == "host"  # An explicit choice is kept.
  assert input_pipeline.in_memory_kind("device", 10**12, 100.0) == "device"
  with pytest.raises(ValueError, match="dataset.reader='disk'; valid: auto, host, device, "
                                       "stream"):
    input_pipeline.in_memory_kind("disk", 1, 100.0)
  with pytest.raises(validation.ConfigError, match="dataset.reader"):
    validation.validate(tiny_config(**{"dataset.reader": "disk"}))


def test_read_ahead_submits_ahead_finishes_in_order_and_cancels_what_is_left():
  """read_ahead=2: block s+2 is submitted before block s is finished, blocks finish in
  order, and closing the generator early cancels the futures of the blocks submitted and not
  finished (and only those)."""
  source = types.SimpleNamespace(labels=np.zeros(5, np.int32), ids=np.arange(5))
  reader = readers.SourceReader(source, None, sharding.create_mesh(), num_workers=1,
                                read_ahead=2)
  events, futures = [], {}

  def submit(s, block):
    events.append(f"submit {s}:{block}")
    futures[s] = [concurrent.futures.Future()]
    return futures[s]

  def finish(s, got):
    assert got is futures[s]
    events.append(f"finish {s}")
    return s

  assert list(reader.read_ahead("abcde", submit, finish)) == [0, 1, 2, 3, 4]
  assert events == ["submit 0:a", "submit 1:b", "submit 2:c", "finish 0", "submit 3:d",
                    "finish 1", "submit 4:e", "finish 2", "finish 3", "finish 4"]
  events.clear()
  blocks = reader.read_ahead("abcde", submit, finish)
  assert next(blocks) == 0
  blocks.close()
  assert events == ["submit 0:a", "submit 1:b", "submit 2:c", "finish 0"]
  assert [futures[s][0].cancelled() for s in range(3)] == [False, True, True]


def _never_read(dataset):
  raise AssertionError("the splits were read into memory for a kind that streams or decodes")


def _chosen(dataset, monkeypatch, read_splits=_never_read) -> set[type]:
  """The classes of the readers `choose` builds for `dataset` (every split has one); the
  splits read into memory by `read_splits`."""
  monkeypatch.setattr(input_pipeline, "get_datasets", read_splits)
  by_name = input_pipeline.choose(dataset, sharding.create_mesh(), 0)
  assert set(by_name) == {"train", "val", "test"}
  return {type(reader) for reader in by_name.values()}


@pytest.mark.parametrize("fields, kind", [
    ({"dataset.reader": "host"}, readers.Reader),
    ({"dataset.reader": "device"}, readers.DeviceReader),
    # 1,797 digits of 64 bytes and 8 bytes of label and id: 0.13 MiB, times 8 CPU devices.
    ({"dataset.reader": "auto", "dataset.device_memory_mb": 1.0}, readers.DeviceReader),
    ({"dataset.reader": "auto", "dataset.device_memory_mb": 0.5}, readers.Reader),
    # Records written, but the training split fits host memory: read into memory.
    ({"dataset.reader": "auto", "dataset.stream_dir": "records"}, readers.DeviceReader),
    ({"dataset.reader": "auto", "dataset.stream_dir": "records",
      "dataset.host_memory_mb": 0.01}, readers.StreamReader),
    ({"dataset.reader": "stream", "dataset.stream_dir": "records"}, readers.StreamReader),
])
def test_choose_builds_the_in_memory_and_stream_kinds(digits, tmp_path, monkeypatch, fields,
                                                      kind):
  fields = {k: str(tmp_path / v) if k.endswith("stream_dir") else v for k, v in fields.items()}
  dataset = tiny_config(**fields).dataset
  if dataset.stream_dir:
    array_records.write_splits(digits, dataset.stream_dir, dataset)
  streamed = kind is readers.StreamReader
  assert _chosen(dataset, monkeypatch, _never_read if streamed else lambda _: digits) == {kind}


@pytest.mark.parametrize("decode, kind", [
    ("cpu", host_stage.PreprocessReader),
    ("device_cpu", DeviceStageReader),
    ("auto", host_stage.PreprocessReader),  # No GPU decoder here.
])
def test_choose_builds_the_stages_by_dataset_decode(tmp_path, monkeypatch, decode, kind):
  """A folder dataset (encoded images) is never read into memory; dataset.decode picks its
  stage, which holds the source's labels."""
  if decode == "auto" and decoders.decoder_problem("gpu", "opencv") is None:
    pytest.skip("a GPU decoder runs here: auto picks it")
  for split, count in (("train", 12), ("test", 3)):
    for name in ("ant", "bee"):
      os.makedirs(tmp_path / split / name)
      for i in range(count):
        Image.new("RGB", (10 + i, 12), (40 * i, 0, 0)).save(tmp_path / split / name / f"{i}.png")
  dataset = tiny_config(**{"dataset.name": "folder", "dataset.folder": str(tmp_path),
                           "dataset.val_size": 4, "dataset.decode": decode,
                           "dataset.worker_kind": "thread"}).dataset
  sources.resolve(dataset)
  assert _chosen(dataset, monkeypatch) == {kind}
  train = input_pipeline.choose(dataset, sharding.create_mesh(), 0)["train"]
  opened = sources.open_splits(dataset)["train"]
  np.testing.assert_array_equal(train.labels, opened.labels)
  np.testing.assert_array_equal(train.ids, opened.ids)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    # Subsets with per-example loss weights.
    {"selection.method": "infobatch", "selection.score": "loss",
     "selection.anneal_fraction": 0.0},  # 2 epochs: the second pruned, none annealed.
    # gamma-Net's meta-validation batches, and a fresh scoring pass over the training split.
    {"loss.name": "flgamma_dece", "dataset.meta_val_size": 128, "selection.method": "top_k",
     "selection.scoring": "fresh"}], ids=["infobatch", "flgamma_fresh"])
def test_a_run_is_the_same_with_every_reader(overrides, tmp_path, monkeypatch):
  """On 8 devices: the host, device and stream readers train the same run, bit for bit; the
  streamed run is stopped 1 step into epoch 1 and resumed (it reads on from that step)."""
  overrides = {**overrides, "selection.warmup_epochs": 1, "num_epochs": 2,
               "evaluation.ood": "", "dataset.stream_dir": str(tmp_path / "records")}
  dataset = tiny_config(**overrides).dataset
  array_records.write_splits(input_pipeline.get_datasets(dataset), dataset.stream_dir, dataset)
  runs = {}
  for kind in ("host", "device", "stream"):
    runs[kind] = str(tmp_path / kind)
    config = tiny_config(**overrides, **{"dataset.reader": kind})
    if kind == "stream":
      # One step into epoch 1 (the top_k run's epoch 1 has 2 steps).
      stop = -(-int(helpers.read_metrics(runs["host"])[0]["selected_k"]) // 64) + 1
      monkeypatch.setattr(preemption.PreemptionGuard, "should_stop",
                          lambda self, step: step == stop)
      with pytest.raises(preemption.Preempted):
        train.train_and_evaluate(config, runs[kind])
      monkeypatch.undo()
      # Every batch the resumed run reads (training, meta-validation, scoring, evaluation)
      # comes through the read-ahead, none from a one-off synchronous read.
      monkeypatch.setattr(readers.StreamReader, "batch", _no_synchronous_read)
    train.train_and_evaluate(config, runs[kind])
    monkeypatch.undo()
  trees = {kind: helpers.restore_checkpoint(workdir) for kind, workdir in runs.items()}
  for tree in trees.values():
    del tree["selection"]["seconds"]
  for kind in ("device", "stream"):
    # A run resumed inside a freshly scored epoch has no scorer_ece for it (the scoring pass's
    # predictions are not checkpointed; docs/selection.md): compare the rest.
    records = [helpers.without_timing(read_metrics(runs[k])) for k in (kind, "host")]
    if kind == "stream":
      records = [[{k: v for k, v in r.items() if k != "scorer_ece"} for r in run]
                 for run in records]
    assert records[0] == records[1], kind
    jax.tree.map(np.testing.assert_array_equal, trees[kind], trees["host"])


def _no_synchronous_read(self, rows, mask=None, weights=None):
  raise AssertionError(f"a synchronous read of {len(rows)} rows in a streamed run")


def _generated_image(example_id: int, shape) -> np.ndarray:
  """GENERATED data (not a dataset): the image of an id, random bytes seeded by it."""
  return np.random.default_rng(example_id).integers(0, 256, shape, np.uint8)


def _write_generated(directory: str, num: int, shape) -> None:
  examples = ((i, i % 10, _generated_image(i, shape)) for i in range(num))
  array_records.write_split(examples, num, directory, "train", {"name": "generated"}, 4)


@pytest.mark.parametrize("num_devices", [1, 8])
def test_streamed_batches_are_the_host_split_rows_read_ahead_or_not(digits, num_devices,
                                                                   tmp_path):
  mesh = sharding.create_mesh(jax.devices()[:num_devices])
  dataset = tiny_config().dataset
  array_records.write_splits({"train": digits["train"]}, str(tmp_path), dataset, num_shards=3)
  stream = array_records.stream_reader(str(tmp_path), "train", mesh, dataset)
  host = readers.Reader(digits["train"], mesh)
  rng = np.random.default_rng(num_devices)
  blocks = rng.integers(0, len(host), (5, 64))
  masks = (rng.random((5, 64)) < 0.9).astype(np.float32)
  weights = rng.random(len(host)).astype(np.float32)
  expected = list(host.batches(blocks, masks, weights))
  reading = stream.batches(blocks, masks, weights)
  ahead = [next(reading)]
  deadline = time.monotonic() + 10
  while stream.images.rows_read <= 64 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert stream.images.rows_read > 64  # grain's threads read the next batches ahead.
  ahead += list(reading)
  one_by_one = [stream.batch(rows, masks[s], weights[rows]) for s, rows in enumerate(blocks)]
  assert stream.images.rows_read == 2 * blocks.size  # Only the rows asked for, each time.
  for want, *gots in zip(expected, ahead, one_by_one):
    for got in gots:
      assert set(got) == set(want)
      for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
  assert stream.split.images is None  # The images stay in the files.


def test_uneven_shards_bad_images_and_empty_splits(tmp_path):
  """9 rows in 4 shards: every shard written (2, 2, 2, 3 rows) and read back in row order."""
  mesh = sharding.create_mesh(jax.devices()[:1])
  _write_generated(str(tmp_path), 9, (4, 4, 1))
  reader = array_records.stream_reader(str(tmp_path), "train", mesh)
  assert len(os.listdir(tmp_path)) == 5  # 4 shards + the index.
  images = reader.images.read(np.arange(9)[::-1])
  for row, image in zip(range(8, -1, -1), images):
    np.testing.assert_array_equal(image, _generated_image(row, (4, 4, 1)))
  with pytest.raises(ValueError, match="image dtype float32, must be uint8"):
    array_records.write_split([(0, 0, np.zeros((2, 2, 1), np.float32))], 1, str(tmp_path), "x",
                              {})
  with pytest.raises(ValueError, match="0 examples in 1 shards"):
    array_records.write_split([], 0, str(tmp_path), "empty", {})
  with pytest.raises(ValueError, match="3 examples written, 4 announced"):
    array_records.write_split([(i, 0, np.zeros((2, 2, 1), np.uint8)) for i in range(3)], 4,
                              str(tmp_path), "short", {})
  assert not os.path.exists(tmp_path / "short.index.npz")  # No index for a partial write.


def test_stream_files_of_another_split_config_are_refused(digits, tmp_path):
  dataset = tiny_config().dataset
  array_records.write_splits({"train": digits["train"]}, str(tmp_path), dataset, num_shards=2)
  other = tiny_config(**{"dataset.val_size": 100}).dataset
  with pytest.raises(ValueError, match="dataset.val_size=180, this run has 100"):
    array_records.read_index(str(tmp_path), "train", other)
  with pytest.raises(FileNotFoundError, match="no array_record split 'test'"):
    array_records.read_index(str(tmp_path), "test", dataset)
  with pytest.raises(validation.ConfigError, match="needs config.dataset.stream_dir"):
    validation.validate(tiny_config(**{"dataset.reader": "stream"}))
  with pytest.raises(validation.ConfigError, match="corrupts the test images in memory"):
    validation.validate(tiny_config(**{"dataset.reader": "stream",
                                              "dataset.stream_dir": str(tmp_path),
                                              "evaluation.ood": "gaussian_noise"}))


_STREAM_WORKER = r"""
import json, os, sys
sys.path.insert(0, os.environ["REPO"])
import jax
jax.config.update("jax_num_cpu_devices", int(os.environ["DEVICES"]))
pid, num_processes, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if num_processes > 1:
  jax.distributed.initialize(os.environ["COORDINATOR"], num_processes, pid)
import numpy as np
from cpjax.data import array_records
from cpjax.runtime import sharding

def rss_mb():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

mesh = sharding.create_mesh()
reader = array_records.stream_reader(directory, "train", mesh)
shape = reader.images.image_shape
blocks, masks, weights = (np.load(os.environ["BLOCKS"] + suffix)
                          for suffix in (".blocks.npy", ".masks.npy", ".weights.npy"))
warmup = reader.batches(blocks[:1])
next(warmup)  # Threads and buffers up before the baseline.
warmup.close()
warmup_rows = reader.images.rows_read
start, peak, mismatches = rss_mb(), 0.0, 0
local = {"id": [], "mask": [], "weight": []}
by_start = lambda shards: sorted(shards, key=lambda shard: shard.index[0].start or 0)
for batch in reader.batches(blocks, masks, weights):
  shards = {key: by_start(batch[key].addressable_shards) for key in ("id", "image", *local)}
  for key in local:
    local[key] += np.concatenate([np.asarray(s.data) for s in shards[key]]).tolist()
  for id_shard, image_shard in zip(shards["id"], shards["image"]):
    ids, images = np.asarray(id_shard.data), np.asarray(image_shard.data)
    mismatches += sum(int(not np.array_equal(image, np.random.default_rng(int(i)).integers(
        0, 256, shape, np.uint8))) for i, image in zip(ids, images))
  peak = max(peak, rss_mb())
print("RESULT " + json.dumps({**local, "mismatches": mismatches,
                              "rows_read": reader.images.rows_read - warmup_rows,
                              "growth_mb": peak - start}), flush=True)
"""


def _stream_processes(directory, blocks, num_processes, devices):
  """Runs _STREAM_WORKER in `num_processes` processes over `blocks` [S, B] of rows, with
  random masks [S, B] and per-row weights; returns (their results, masks, weights)."""
  rng = np.random.default_rng(blocks.size)
  masks = (rng.random(blocks.shape) < 0.8).astype(np.float32)
  weights = rng.random(int(blocks.max()) + 1).astype(np.float32)
  blocks_path = os.path.join(directory, "rows")
  for suffix, value in ((".blocks.npy", blocks), (".masks.npy", masks),
                        (".weights.npy", weights)):
    np.save(blocks_path + suffix, value)
  results = helpers.run_processes(
      _STREAM_WORKER, [[str(pid), str(num_processes), directory]
                       for pid in range(num_processes)],
      {"DEVICES": str(devices), "BLOCKS": blocks_path})
  results = [result for result, _ in results]
  return results, masks, weights


@pytest.mark.slow
def test_two_processes_read_disjoint_halves_whose_union_is_the_global_batch(tmp_path):
  """2 processes x 2 CPU devices on 127.0.0.1 (jax.distributed), generated records."""
  _write_generated(str(tmp_path), 300, (8, 8, 1))
  blocks = np.random.default_rng(0).permutation(300)[:6 * 16].reshape(6, 16)
  (first, second), masks, weights = _stream_processes(str(tmp_path), blocks, 2, devices=2)
  for result in (first, second):
    assert result["mismatches"] == 0 and result["rows_read"] == blocks.size // 2
  assert not set(first["id"]) & set(second["id"])
  assert sorted(first["id"] + second["id"]) == sorted(blocks.ravel().tolist())
  # Each process holds the first or second half of every global batch (rows sharded on data),
  # with those rows' masks and weights.
  for result, half in ((first, slice(0, 8)), (second, slice(8, 16))):
    np.testing.assert_array_equal(np.reshape(result["id"], (6, 8)), blocks[:, half])
    np.testing.assert_array_equal(np.reshape(result["mask"], (6, 8)), masks[:, half])
    np.testing.assert_array_equal(np.reshape(result["weight"], (6, 8)),
                                  weights[blocks[:, half]])


@pytest.mark.slow
def test_streaming_a_set_four_times_the_memory_cap_stays_under_the_cap(tmp_path):
  """60,000 GENERATED 32x32x3 images (176 MB of uncompressed records) streamed in one epoch of
  batches of 256 by a fresh process: its resident memory grows by less than 40 MB."""
  num, cap_mb = 60_000, 40.0
  _write_generated(str(tmp_path), num, (32, 32, 3))
  on_disk = sum(os.path.getsize(os.path.join(tmp_path, f)) for f in os.listdir(tmp_path)
                if ".array_record-" in f)
  assert on_disk > 4 * cap_mb * 2**20
  blocks = np.random.default_rng(1).permutation(num)[:num // 256 * 256].reshape(-1, 256)
  (result,), _, _ = _stream_processes(str(tmp_path), blocks, 1, devices=1)
  assert result["mismatches"] == 0 and len(result["id"]) == blocks.size
  assert result["rows_read"] == blocks.size  # Each row once, nothing beyond the epoch.
  assert result["growth_mb"] < cap_mb, result["growth_mb"]
