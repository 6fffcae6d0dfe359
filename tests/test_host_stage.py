"""The host stage in worker processes: the same batches as threads, bit for bit, and the
ways it ends (a bad file, a dead worker, a killed main process).

Every image is generated (NumPy arrays saved with PIL). The reference for the batches is
the transform called on each row in this process, one at a time (`_direct`), not the
readers under test.
"""

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import jax
import ml_collections
import numpy as np
from PIL import Image
import pytest

from configs import default
from cpjax.config import validation
from cpjax.data import decode_workers, host_stage, preprocess, sources
from cpjax.runtime import sharding
from tests import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(name="folder", scope="module")
def _folder(tmp_path_factory) -> str:
  """3 classes x 8 train images (PNG and JPEG, 24-60 px a side) and 2 test images each."""
  rng = np.random.default_rng(41)
  root = tmp_path_factory.mktemp("host_stage") / "images"
  for split, count in (("train", 8), ("test", 2)):
    for name in ("ant", "bee", "cat"):
      os.makedirs(root / split / name)
      for i in range(count):
        h, w = (int(v) for v in rng.integers(24, 60, 2))
        fmt, ext = (("PNG", "png"), ("JPEG", "jpg"))[i % 2]
        Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(
            root / split / name / f"img{i}.{ext}", format=fmt)
  return str(root)


def _dataset(folder: str, **overrides) -> ml_collections.ConfigDict:
  dataset = default.get_config().dataset
  dataset.update({"name": "folder", "folder": folder, "image_size": 16, "val_size": 4,
                  "flip": True, "mean": (0.5,) * 3, "std": (0.25,) * 3, **overrides})
  return dataset


def _source_and_transform(dataset: ml_collections.ConfigDict, seed: int = 3):
  spec = sources.resolve(dataset)
  return sources.open_splits(dataset)["train"], preprocess.from_config(
      dataset, spec.image_shape, seed)


def _direct(source, transform, rows: np.ndarray, epoch: int | None) -> np.ndarray:
  """The reference: each row read and transformed here, in order, one at a time."""
  return np.stack([transform(source.read(np.asarray([row]))[0], int(source.ids[row]), epoch)
                   for row in rows])


@pytest.mark.slow  # Worker processes.
@pytest.mark.parametrize("read", ["folder", "records"])
def test_batches_are_bit_identical_whatever_the_worker_kind_count_and_read_ahead(
    folder, tmp_path, read):
  """Process workers (1 or 3), threads (2), read-ahead 1 or 3: the same batches, bit for
  bit, as the transform called row by row; training (with its epoch) and evaluation."""
  dataset = _dataset(folder)
  if read == "records":
    sources.write_records(dataset, str(tmp_path / "rec"), num_shards=2)
    dataset = _dataset("", stream_dir=str(tmp_path / "rec"))
  source, transform = _source_and_transform(dataset)
  assert type(source).__name__ == {"folder": "FolderSource", "records": "RecordSource"}[read]
  # 24 rows (some twice) in 3 batches of 8 (the 8 test devices' multiple).
  rows = np.random.default_rng(0).permutation(np.arange(24) % len(source))
  blocks = rows.reshape(3, 8)
  mesh = sharding.create_mesh()
  for epoch in (2, None):
    expected = _direct(source, transform, rows, epoch).reshape(blocks.shape + (16, 16, 3))
    for kind, workers, read_ahead in (("process", 1, 1), ("process", 3, 3),
                                      ("thread", 2, 2), ("process", 2, 2)):
      reader = host_stage.PreprocessReader(source, transform, mesh, workers,
                                           read_ahead=read_ahead, worker_kind=kind)
      batches = list(reader.batches(blocks, epoch=epoch))
      assert len(batches) == len(blocks)
      for s, batch in enumerate(batches):
        np.testing.assert_array_equal(jax.device_get(batch["image"]), expected[s],
                                      err_msg=f"{kind} x{workers} read_ahead {read_ahead}")
        np.testing.assert_array_equal(jax.device_get(batch["id"]), source.ids[blocks[s]])
      np.testing.assert_array_equal(reader.images(rows[:5], epoch), expected.reshape(
          (-1, 16, 16, 3))[:5])
  # The training crops are not the evaluation crops (the comparison above sees both).
  assert not np.array_equal(_direct(source, transform, rows[:4], 2),
                            _direct(source, transform, rows[:4], None))


def test_a_folder_carve_out_pickles_its_own_paths_only(folder):
  """What a worker process receives: the validation carve-out of a folder, pickled, reads the
  same bytes under the same ids, labels and names (and a part taken of it too), and carries
  its own rows' paths, not the split's whole table."""
  dataset = _dataset(folder, val_size=6)
  sources.resolve(dataset)  # Registers the folder's facts, as config validation does.
  opened = sources.open_splits(dataset)
  val, train = opened["val"], opened["train"]
  copy = pickle.loads(pickle.dumps(val))
  rows = np.arange(len(val))
  np.testing.assert_array_equal(copy.ids, val.ids)
  np.testing.assert_array_equal(copy.labels, val.labels)
  assert [copy.where(r) for r in rows] == [val.where(r) for r in rows]
  assert copy.read(rows) == val.read(rows)
  part, copied_part = val.take(rows[2:5]), copy.take(rows[2:5])
  np.testing.assert_array_equal(copied_part.ids, part.ids)
  assert copied_part.read(np.arange(3)) == part.read(np.arange(3))
  assert len(copy._files.paths) == len(val) < len(train)  # pylint: disable=protected-access


def test_a_file_that_fails_to_decode_is_named_in_one_error(folder, tmp_path):
  """A JPEG cut short past its header opens at start-up and fails in a worker: the pass
  ends with the decoder's BadImageError naming the file, not a pool failure."""
  copy = tmp_path / "images"
  subprocess.run(["cp", "-r", folder, str(copy)], check=True)
  victim = sorted((copy / "train" / "bee").glob("*.jpg"))[0]
  data = victim.read_bytes()
  victim.write_bytes(data[:len(data) // 2])
  source, transform = _source_and_transform(_dataset(str(copy)))
  row = next(r for r in range(len(source)) if source.where(r) == str(victim))
  rows = np.arange(len(source))
  blocks = np.stack([np.delete(rows, row)[:8], np.concatenate([[row], np.delete(rows, row)[:7]])])
  reader = host_stage.PreprocessReader(source, transform, sharding.create_mesh(), 2)
  with pytest.raises(preprocess.BadImageError, match=f"{victim}: cannot be decoded"):
    for _ in reader.batches(blocks, epoch=0):
      pass
  # The workers are still there for the next pass.
  assert reader.images(np.delete(rows, row)[:2], epoch=0).shape == (2, 16, 16, 3)


@pytest.mark.slow  # A kill trial, or a process of its own.
def test_a_killed_worker_ends_the_pass_with_one_clear_error_within_seconds(folder):
  source, transform = _source_and_transform(_dataset(folder, image_size=64))
  reader = host_stage.PreprocessReader(source, transform, sharding.create_mesh(), 3,
                                       read_ahead=1)
  pool = decode_workers.shared_pool(3)
  rows = np.tile(np.arange(len(source)), 40)[:16 * 30].reshape(30, 16)  # 480 crops.
  batches = reader.batches(rows, epoch=0)
  next(batches)
  os.kill(pool.pids[0], signal.SIGKILL)
  start = time.monotonic()
  with pytest.raises(decode_workers.WorkerDiedError,
                     match=rf"pid {pool.pids[0]} was killed by SIGKILL"):
    for _ in batches:
      pass
  assert time.monotonic() - start < 20
  assert pool.broken and all(not _alive(pid) for pid in pool.pids)
  # The next reader gets a fresh pool.
  again = host_stage.PreprocessReader(source, transform, sharding.create_mesh(), 3)
  assert again.images(np.arange(3), epoch=0).shape == (3, 64, 64, 3)
  assert decode_workers.shared_pool(3) is not pool


def _alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


_KILLED_MAIN = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
import numpy as np
from configs import default
from cpjax.data import decode_workers, host_stage, preprocess, sources
from cpjax.runtime import sharding

dataset = default.get_config().dataset
dataset.update({{"name": "folder", "folder": {folder!r}, "image_size": 64, "val_size": 4,
                "mean": (0.5,) * 3, "std": (0.25,) * 3}})
spec = sources.resolve(dataset)
source = sources.open_splits(dataset)["train"]
reader = host_stage.PreprocessReader(source, preprocess.from_config(dataset, spec.image_shape, 0),
                                     sharding.create_mesh(), 2)
batches = reader.batches(np.tile(np.arange(len(source)), 400).reshape(-1, 16), epoch=0)
next(batches)  # Mid-pass: batches decoding in the workers, slots and the context in /dev/shm.
pids = decode_workers.shared_pool(2).pids
with open("/proc/self/maps") as f:
  shm = sorted({{line.split()[-1] for line in f if "/dev/shm/" in line}})
children = [pid for task in os.listdir("/proc/self/task")  # Any thread's children.
            for pid in open(f"/proc/self/task/{{task}}/children").read().split()]
print("READY " + json.dumps({{"workers": pids, "shm": shm, "children": children}}), flush=True)
for _ in batches:
  time.sleep(0.05)
time.sleep(60)
"""


@pytest.mark.slow  # A kill trial, or a process of its own.
def test_kill_9_of_the_main_process_leaves_no_workers_and_no_shared_memory(folder):
  process = subprocess.Popen(
      [sys.executable, "-c", _KILLED_MAIN.format(repo=REPO, folder=folder)],
      stdout=subprocess.PIPE, text=True, env=helpers.subprocess_env(devices=1))
  try:
    line = process.stdout.readline()
    assert line.startswith("READY "), line
    found = json.loads(line[len("READY "):])
  finally:
    process.kill()
    process.wait()
    process.stdout.close()
  children = [int(pid) for pid in found["children"]]
  assert set(found["workers"]) <= set(children) and found["shm"]  # What to look for.
  deadline = time.monotonic() + 20
  while time.monotonic() < deadline:
    left = [pid for pid in children if _alive(pid)]
    shm = [path for path in found["shm"] if os.path.exists(path)]
    if not left and not shm:
      break
    time.sleep(0.2)
  assert not left, f"processes left running: {left}"
  assert not shm, f"shared memory left: {shm}"


_EXIT_MID_PASS = """
import os, sys
sys.path.insert(0, {repo!r})
import numpy as np
from configs import default
from cpjax.data import decode_workers, host_stage, preprocess, sources
from cpjax.runtime import sharding

dataset = default.get_config().dataset
dataset.update({{"name": "folder", "folder": {folder!r}, "image_size": 32, "val_size": 4,
                "mean": (0.5,) * 3, "std": (0.25,) * 3}})
spec = sources.resolve(dataset)
source = sources.open_splits(dataset)["train"]
reader = host_stage.PreprocessReader(source, preprocess.from_config(dataset, spec.image_shape, 0),
                                     sharding.create_mesh(), 2)
batches = reader.batches(np.tile(np.arange(len(source)), 40).reshape(-1, 16), epoch=0)
next(batches)  # Mid-pass: the ring's slots and the reader's context in /dev/shm.
print("SEGMENTS " + " ".join(sorted(decode_workers._SEGMENTS)), flush=True)
if {kill_worker}:
  os.kill(decode_workers.shared_pool(2).pids[0], 9)
  try:
    for _ in batches:
      pass
  except decode_workers.WorkerDiedError:
    print("DIED", flush=True)
decode_workers.close_all()  # What main.py does before its FATAL line and os._exit.
print("FATAL the last word", file=sys.stderr, flush=True)
os._exit(1)
"""


@pytest.mark.slow  # A process of its own.
@pytest.mark.parametrize("kill_worker", [False, True])
def test_close_all_leaves_the_resource_tracker_nothing_to_report(folder, kill_worker):
  """A process that ends with os._exit (as main.py after a FATAL line) mid-pass (a disk
  full while a pass is in flight), or after a worker died: `close_all` first, and nothing
  follows its last line (no "leaked semaphore / shared_memory" notice), no segment is left
  in /dev/shm."""
  result = subprocess.run(
      [sys.executable, "-c", _EXIT_MID_PASS.format(repo=REPO, folder=folder,
                                                   kill_worker=kill_worker)],
      capture_output=True, text=True, env=helpers.subprocess_env(devices=1), timeout=120)
  assert result.returncode == 1, result.stderr[-3000:]
  (segments,) = [line.split()[1:] for line in result.stdout.splitlines()
                 if line.startswith("SEGMENTS")]
  assert len(segments) >= 2  # The context and the slots: what there was to release.
  assert ("DIED" in result.stdout) == kill_worker, result.stdout
  assert result.stderr.strip().splitlines()[-1] == "FATAL the last word", result.stderr[-3000:]
  assert "leaked" not in result.stderr, result.stderr[-3000:]
  assert not [name for name in segments if os.path.exists(f"/dev/shm/{name.lstrip('/')}")]


_WORKER_MODULES = """
import jax  # A main script that imports JAX, as main.py does (and much more).
import os, sys
sys.path.insert(0, {repo!r})
import numpy as np
from cpjax.data import decode_workers

pool = decode_workers.ProcessPool(1)
maps = open(f"/proc/{{pool.pids[0]}}/maps").read()
print("WORKER_HAS_JAXLIB", "jaxlib" in maps)
print("MAIN_HAS_JAXLIB", "jaxlib" in open("/proc/self/maps").read())
"""


@pytest.mark.slow  # A kill trial, or a process of its own.
def test_workers_do_not_run_the_main_script_again(tmp_path):
  """The workers start under a stand-in main module: a main script's imports (JAX here;
  for main.py, the trainer and TensorFlow) are not loaded again in each of them."""
  script = tmp_path / "main_like.py"
  script.write_text(_WORKER_MODULES.format(repo=REPO))
  out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       env=helpers.subprocess_env(devices=1), timeout=120, check=True).stdout
  assert "MAIN_HAS_JAXLIB True" in out and "WORKER_HAS_JAXLIB False" in out, out


def test_shared_memory_that_does_not_fit_is_refused_with_the_ways_out(monkeypatch):
  """A slot that /dev/shm cannot hold is refused when it is made (its pages reserved), not
  by a worker's SIGBUS at its first write."""
  made = []
  real = decode_workers.shared_memory.SharedMemory

  def recorded(*args, **kwargs):
    made.append(real(*args, **kwargs))
    return made[-1]

  def full(fd, offset, length):
    raise OSError(28, "No space left on device")
  monkeypatch.setattr(decode_workers.shared_memory, "SharedMemory", recorded)
  monkeypatch.setattr(os, "posix_fallocate", full)
  with pytest.raises(decode_workers.SharedMemoryFullError,
                     match=r"need 0\.8 MiB more shared memory for 2 batches of 256 images.*"
                           r"--shm-size.*worker_kind=thread"):
    decode_workers.Slots(2, (256, 32, 32, 3))
  assert len(made) == 1 and not os.path.exists(f"/dev/shm/{made[0].name}")  # Unlinked.
  # Small sizes in the units that show them: a slot of 1 x 4 x 4 x 3 bytes, 3 free 4 KiB
  # blocks.
  monkeypatch.setattr(decode_workers.os, "statvfs",
                      lambda path: os.statvfs_result((4096, 4096, 9, 3, 3, 9, 3, 3, 0, 255)))
  with pytest.raises(decode_workers.SharedMemoryFullError,
                     match=r"need 48 bytes more shared memory for 2 batches of 1 image, and "
                           r"/dev/shm has 12\.0 KiB free"):
    decode_workers.Slots(2, (1, 4, 4, 3))


def test_worker_kind_is_checked_with_its_choices():
  with pytest.raises(ValueError, match=r"worker_kind='fork'.*\('process', 'thread'\)"):
    host_stage.PreprocessReader(_Source(), preprocess.Transform(8, 3), sharding.create_mesh(),
                                worker_kind="fork")
  config = helpers.tiny_config(**{"dataset.worker_kind": "fork"})
  with pytest.raises(validation.ConfigError,
                     match=r"dataset.worker_kind.*'fork'.*process.*thread"):
    validation.validate(config)


class _Source:
  labels = ids = np.arange(4)


class _LockedSource(_Source):
  """A source holding a lock (unpicklable), as a naive one holding a shared handle would."""

  def __init__(self):
    self.lock = threading.Lock()


def test_a_source_that_cannot_be_pickled_is_refused_with_the_ways_out():
  reader = host_stage.PreprocessReader(_LockedSource(), preprocess.Transform(8, 3),
                                       sharding.create_mesh(), 1)
  with pytest.raises(TypeError, match=r"_LockedSource cannot be pickled.*__getstate__.*"
                                      r"worker_kind=thread"):
    reader.images(np.arange(2), epoch=0)


_MAIN_SOURCE = """
import sys
sys.path.insert(0, {repo!r})
import numpy as np
from cpjax.data import host_stage, preprocess
from cpjax.runtime import sharding

class ScriptSource:  # Defined in the main script, which the workers do not run.
  labels = ids = np.arange(4)
  def read(self, rows):
    return [b"x"] * len(rows)

reader = host_stage.PreprocessReader(ScriptSource(), preprocess.Transform(8, 3),
                                     sharding.create_mesh(), 1)
try:
  reader.images(np.arange(2), epoch=0)
except TypeError as err:
  print("ERROR", err)
"""


@pytest.mark.slow  # A kill trial, or a process of its own.
def test_a_source_class_of_the_main_script_is_named_with_the_ways_out(tmp_path):
  script = tmp_path / "script.py"
  script.write_text(_MAIN_SOURCE.format(repo=REPO))
  out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       env=helpers.subprocess_env(devices=1), timeout=120).stdout
  assert "ERROR a host-stage worker process cannot unpickle the reader's data source" in out
  assert "importable module" in out and "worker_kind=thread" in out, out


_NO_TENSORFLOW = """
import sys
class Blocked:
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in ("tensorflow", "tensorflow_datasets", "clu"):
      raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Blocked())
sys.path.insert(0, {repo!r})
from cpjax.data import decode_workers, folder_source, host_stage, preprocess
print("IMPORTED")
"""


@pytest.mark.slow  # A kill trial, or a process of its own.
def test_the_host_stage_imports_without_tensorflow():
  """A GPU machine without TensorFlow runs the host stage (and the benchmarks on it)."""
  out = subprocess.run([sys.executable, "-c", _NO_TENSORFLOW.format(repo=REPO)],
                       capture_output=True, text=True, env=helpers.subprocess_env(devices=1),
                       timeout=120)
  assert out.returncode == 0 and "IMPORTED" in out.stdout, out.stderr[-2000:]


def _small_shm_command(command: list[str], kib: int) -> list[str]:
  """`command` run in a mount namespace of its own whose /dev/shm is a `kib` KiB tmpfs (the
  machine's /dev/shm untouched); skips the test where namespaces or mounts are not allowed."""
  probe = subprocess.run(["unshare", "-m", "sh", "-c",
                          f"mount -t tmpfs -o size={kib}k tmpfs /dev/shm"],
                         capture_output=True, text=True)
  if probe.returncode != 0:
    pytest.skip(f"cannot mount a small /dev/shm in a mount namespace here (needs root or "
                f"CAP_SYS_ADMIN): {probe.stderr.strip()}")
  return ["unshare", "-m", "sh", "-c",
          f'mount -t tmpfs -o size={kib}k tmpfs /dev/shm && exec "$@"', "sh", *command]


@pytest.mark.slow  # A main.py process.
def test_a_full_dev_shm_ends_the_run_with_the_host_stages_line_and_nothing_after(
    folder, tmp_path):
  """main.py on a folder with a 64 KiB /dev/shm (a container's default is 64 MB; here the
  first ring of 64 x 64 crops, 2 x 96 KiB, does not fit): exit 1, no traceback, one FATAL
  line, the host stage's own (what it needs, --shm-size, worker_kind=thread), not a full
  checkpoint folder; and it is the last line: no "leaked semaphore / shared_memory" notice
  of multiprocessing's resource tracker after it."""
  workdir = str(tmp_path / "run")
  command = helpers.main_command(
      workdir, "--config.dataset.name=folder", f"--config.dataset.folder={folder}",
      "--config.dataset.image_size=64", "--config.dataset.val_size=6",
      "--config.dataset.crop_padding=0", "--config.dataset.worker_kind=process",
      "--config.dataset.num_workers=2", "--config.batch_size=8", "--config.eval_batch_size=8",
      "--config.num_epochs=1", "--config.evaluation.ood=")
  result = subprocess.run(_small_shm_command(command, 64), cwd=REPO, capture_output=True,
                          text=True, env=helpers.subprocess_env(), timeout=300)
  assert result.returncode == 1, result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  fatal = [line for line in lines if line.startswith("FATAL")]
  assert len(fatal) == 1 and lines[-1] == fatal[0], result.stderr[-3000:]
  assert fatal[0].startswith("FATAL the host stage's worker processes need "), fatal[0]
  assert "--shm-size" in fatal[0] and "worker_kind=thread" in fatal[0], fatal[0]
  assert "writable" not in fatal[0], fatal[0]
  assert fatal[0].endswith("so it starts from the beginning"), fatal[0]
  assert "Traceback" not in result.stderr and "leaked" not in result.stderr
