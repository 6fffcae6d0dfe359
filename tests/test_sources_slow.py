"""The host stage in whole runs and across processes (slow: each starts JAX processes).

A folder run killed with SIGKILL inside an epoch and rerun ends bit-identical to the run
left alone, and so does a run over the folder's converted records (to the folder's run);
two processes on 127.0.0.1 decode disjoint halves of each global batch, whose pixels are
those one process decodes, from the folder or from its records. Generated images throughout.
"""

import os
import signal
import subprocess
import time

import jax
import numpy as np
from PIL import Image
import pytest

from configs import default
from cpjax.data import host_stage, preprocess, sources
from cpjax.runtime import preemption, sharding
from tests import helpers

FOLDER_FLAGS = ("--config.dataset.name=folder", "--config.dataset.image_size=8",
                "--config.dataset.val_size=12", "--config.dataset.flip=True",
                "--config.dataset.crop_padding=0", "--config.evaluation.ood=",
                "--config.num_epochs=3", "--config.keep_checkpoints=10")


def make_folder(root: str, per_class: int = 40, seed: int = 0) -> str:
  """Generated images of varied size and format: 3 classes, each a dominant colour."""
  rng = np.random.default_rng(seed)
  for split, count in (("train", per_class), ("test", per_class // 4)):
    for label in range(3):
      folder = os.path.join(root, split, f"class{label}")
      os.makedirs(folder, exist_ok=True)
      for i in range(count):
        h, w = (int(v) for v in rng.integers(12, 40, 2))
        image = rng.integers(0, 80, (h, w, 3), np.uint8)
        image[..., label] += 150
        fmt, ext = (("PNG", ".png"), ("JPEG", ".jpg"))[i % 2]
        Image.fromarray(image).save(os.path.join(folder, f"{i:03d}{ext}"), format=fmt)
  return root


def _assert_same_run(straight: str, killed: str) -> None:
  assert (helpers.without_timing(helpers.read_metrics(killed))
          == helpers.without_timing(helpers.read_metrics(straight)))
  final = helpers.checkpoint_steps(straight)[-1]
  a, b = helpers.restore_checkpoint(straight, final), helpers.restore_checkpoint(killed, final)
  for state in (a, b):
    del state["selection"]["seconds"]  # Wall-clock totals differ between any two runs.
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.slow
# The host stage's runs (the folder and its records) are killed and resumed by
# tests/test_without_tensorflow.py, TensorFlow absent.
@pytest.mark.parametrize("read,decode", [("folder", "device_cpu")])
def test_a_folder_run_killed_mid_epoch_resumes_bit_for_bit(read, decode, tmp_path):
  """The folder run left alone against a run killed inside its second epoch and resumed,
  reading the folder itself or its converted records (the folder then moved away), decoded
  by the device stage (PIL on the host standing in for the GPU's decoder: the same
  batching, boxes, device op and sharding as dataset.decode=gpu)."""
  folder = make_folder(str(tmp_path / "images"))
  flags = (*FOLDER_FLAGS, f"--config.dataset.folder={folder}",
           f"--config.dataset.decode={decode}")
  straight = str(tmp_path / "straight")
  result = helpers.run_main(straight, *flags)
  assert result.returncode == 0, result.stderr[-3000:]
  if read == "records":
    dataset = default.get_config().dataset
    dataset.update({"name": "folder", "folder": folder, "image_size": 8})
    sources.write_records(dataset, str(tmp_path / "records"), num_shards=3)
    os.rename(folder, folder + "_moved")
    flags = (*FOLDER_FLAGS, f"--config.dataset.stream_dir={tmp_path / 'records'}")
  steps_per_epoch = -(-(120 - 12) // 64)
  killed = str(tmp_path / "killed")
  helpers.sigkill_once_saved(killed, flags, steps_per_epoch, helpers.subprocess_env())
  resumed = helpers.run_main(killed, *flags)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from" in resumed.stderr
  assert read != "records" or "its encoded records in" in resumed.stderr
  assert decode != "device_cpu" or "decoded and resized to (8, 8, 3) on the devices by " \
      "device_cpu" in resumed.stderr
  assert "mixes the two" not in resumed.stderr
  _assert_same_run(straight, killed)


_WORKER = r"""
import json, os, sys
sys.path.insert(0, os.environ["REPO"])
import jax
jax.config.update("jax_num_cpu_devices", 2)
pid, folder, stream_dir, kind = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
jax.distributed.initialize(os.environ["COORDINATOR"], 2, pid)
import numpy as np
from configs import default
from cpjax.data import host_stage, preprocess, record_source, sources
from cpjax.runtime import sharding

records_read = 0  # Rows this process read from the record files (threads read in-process).
_read_records = record_source.RecordSource.read


def _counted_read(self, rows):
  global records_read
  records_read += len(rows)
  return _read_records(self, rows)


record_source.RecordSource.read = _counted_read
dataset = default.get_config().dataset
dataset.update({"name": "folder", "folder": folder, "image_size": 8, "val_size": 12,
                "flip": True, "mean": (0.5,) * 3, "std": (0.25,) * 3,
                "stream_dir": stream_dir})
spec = sources.resolve(dataset)
reader = host_stage.PreprocessReader(sources.open_splits(dataset)["train"],
                                     preprocess.from_config(dataset, spec.image_shape, 0),
                                     sharding.create_mesh(), num_workers=2, worker_kind=kind)
assert type(reader.source).__name__ == ("RecordSource" if stream_dir else "FolderSource")
blocks = np.load(os.environ["BLOCKS"])
ids, images = [], []
for batch in reader.batches(blocks, epoch=1):
  shards = sorted(batch["id"].addressable_shards, key=lambda s: s.index[0].start or 0)
  ids += np.concatenate([np.asarray(s.data) for s in shards]).tolist()
  shards = sorted(batch["image"].addressable_shards, key=lambda s: s.index[0].start or 0)
  images += np.concatenate([np.asarray(s.data) for s in shards]).tolist()
# From the files where this process reads them (threads); else the rows it had decoded.
read = records_read if stream_dir and kind == "thread" else reader.rows_read
print("RESULT " + json.dumps({"ids": ids, "images": images, "rows_read": read}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("read,kind", [("folder", "process"), ("records", "thread"),
                                       ("records", "process")])
def test_two_processes_decode_disjoint_halves_of_each_batch(read, kind, tmp_path):
  folder = make_folder(str(tmp_path / "images"))
  blocks = np.random.default_rng(0).permutation(108)[:4 * 8].reshape(4, 8)
  np.save(str(tmp_path / "blocks.npy"), blocks)
  stream_dir = ""
  if read == "records":
    stream_dir = str(tmp_path / "records")
    dataset = default.get_config().dataset
    dataset.update({"name": "folder", "folder": folder, "image_size": 8})
    sources.write_records(dataset, stream_dir, num_shards=2)
  results = helpers.run_processes(_WORKER, [["0", folder, stream_dir, kind],
                                            ["1", folder, stream_dir, kind]],
                                  {"BLOCKS": str(tmp_path / "blocks.npy")})
  (first, _), (second, _) = results
  assert first["rows_read"] == second["rows_read"] == blocks.size // 2
  # Process 0 holds the first half of every batch, process 1 the second half, each with the
  # pixels one process decodes for those rows; nothing is read twice.
  dataset = default.get_config().dataset
  dataset.update({"name": "folder", "folder": folder, "image_size": 8, "val_size": 12,
                  "flip": True, "mean": (0.5,) * 3, "std": (0.25,) * 3})
  spec = sources.resolve(dataset)
  reader = host_stage.PreprocessReader(sources.open_splits(dataset)["train"],
                                       preprocess.from_config(dataset, spec.image_shape, 0),
                                       sharding.create_mesh())
  for result, half in ((first, slice(0, 4)), (second, slice(4, 8))):
    rows = blocks[:, half]
    np.testing.assert_array_equal(np.reshape(result["ids"], rows.shape), reader.ids[rows])
    expected = reader.images(rows.ravel(), epoch=1)
    np.testing.assert_array_equal(np.asarray(result["images"], np.uint8), expected)
  assert not set(first["ids"]) & set(second["ids"])


@pytest.mark.slow
def test_sigterm_to_the_process_group_saves_and_the_rerun_is_the_run_left_alone(tmp_path):
  """SIGTERM to the whole process group (as a scheduler or Ctrl-C sends it, so the decoding
  worker processes get it too) mid-run: the run saves a checkpoint and exits 75 (its workers
  keep decoding until then), and the rerun ends bit-identical to the run left alone."""
  folder = make_folder(str(tmp_path / "images"))
  flags = (*FOLDER_FLAGS, f"--config.dataset.folder={folder}", "--config.num_epochs=5",
           "--config.dataset.worker_kind=process", "--config.dataset.num_workers=2")
  straight = str(tmp_path / "straight")
  result = helpers.run_main(straight, *flags)
  assert result.returncode == 0, result.stderr[-3000:]
  stopped = str(tmp_path / "stopped")
  with open(tmp_path / "stopped.log", "w") as log:
    proc = subprocess.Popen(helpers.main_command(stopped, *flags), cwd=helpers.REPO,
                            env=helpers.subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=log, start_new_session=True)
    saved = os.path.join(stopped, "checkpoints", "2")  # Epoch 1's end (2 steps an epoch).
    deadline = time.monotonic() + 240
    while not os.path.isdir(saved) and time.monotonic() < deadline:
      assert proc.poll() is None, (tmp_path / "stopped.log").read_text()[-3000:]
      time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=240) == preemption.EXIT_CODE, (
        (tmp_path / "stopped.log").read_text()[-3000:])
  text = (tmp_path / "stopped.log").read_text()
  assert text.count("saved a checkpoint") == 1 and "worker process died" not in text
  resumed = helpers.run_main(stopped, *flags)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "Resumed from" in resumed.stderr
  _assert_same_run(straight, stopped)


def _decoding_workers(pid: int) -> list[int]:
  """The host-stage worker processes among `pid`'s children (not the resource tracker)."""
  children = []
  for task in os.listdir(f"/proc/{pid}/task"):
    try:  # A thread may end between the listing and the read.
      with open(f"/proc/{pid}/task/{task}/children") as f:
        children += [int(c) for c in f.read().split()]
    except FileNotFoundError:
      pass
  found = []
  for child in children:
    try:
      with open(f"/proc/{child}/cmdline", "rb") as f:
        if b"spawn_main" in f.read():
          found.append(child)
    except FileNotFoundError:
      pass
  return found


@pytest.mark.slow
def test_a_killed_decoding_worker_stops_the_run_with_one_fatal_line(tmp_path):
  """SIGKILL to one of a folder run's decoding workers (as the out-of-memory killer would):
  the run ends at once with exit status 1 and one FATAL line naming the worker, its signal
  and the checkpoint the rerun resumes from; no traceback, no hang; and the FATAL line is
  the last word: the pool's queues and shared memory are released before the exit, so
  multiprocessing's resource tracker finds nothing "leaked" to report after it."""
  folder = make_folder(str(tmp_path / "images"))
  flags = (*FOLDER_FLAGS, f"--config.dataset.folder={folder}", "--config.num_epochs=8",
           "--config.dataset.worker_kind=process", "--config.dataset.num_workers=2")
  workdir = str(tmp_path / "run")
  with open(tmp_path / "run.log", "w") as log:
    proc = subprocess.Popen(helpers.main_command(workdir, *flags), cwd=helpers.REPO,
                            env=helpers.subprocess_env(), stdout=subprocess.DEVNULL,
                            stderr=log)
    saved = os.path.join(workdir, "checkpoints", "2")
    deadline = time.monotonic() + 240
    while not os.path.isdir(saved) and time.monotonic() < deadline:
      assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
      time.sleep(0.02)
    (victim, *_) = _decoding_workers(proc.pid)
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=120) == 1, (tmp_path / "run.log").read_text()[-3000:]
  text = (tmp_path / "run.log").read_text()
  fatal = [line for line in text.splitlines() if line.startswith("FATAL")]
  assert len(fatal) == 1 and text.strip().splitlines()[-1] == fatal[0], text[-3000:]
  assert "leaked" not in text, text[-3000:]
  assert f"a host-stage worker process died (pid {victim} was killed by SIGKILL" in fatal[0]
  assert "rerun the same command: it resumes from the last good checkpoint, step" in fatal[0]
  assert "Traceback" not in text
