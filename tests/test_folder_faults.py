"""A folder dataset as a new user's folder comes: images of varying size and no image_size,
an empty or lone class folder, names that are not UTF-8, a folder that changes between a kill
and its resume, a dataset folder that must stay untouched (read-only or shared).

Every image here is generated (random pixels saved with PIL) and labelled as such; expected
sizes, listings and differences are worked out from what the test wrote, not by the code under
test.
"""

import json
import logging
import os
import shutil
import subprocess

import numpy as np
from PIL import Image
import pytest

from configs import default
from cpjax import config_validation
from cpjax.data import fingerprint, folder_source, image_stats, sources
from tests import helpers


def _save_png(path, height: int, width: int, seed: int = 0) -> None:
  """A generated PNG (random pixels) of height x width at `path` (str or bytes)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
  Image.fromarray(pixels).save(path, format="PNG")


def _generated_folder(root: str, sizes: dict[str, list[tuple[int, int]]],
                      test_per_class: int = 0) -> str:
  """root/train/<class>/img<i>.png of the given (height, width) each, and test_per_class
  12 x 12 images per class in root/test/; generated."""
  for label, (name, shapes) in enumerate(sorted(sizes.items())):
    for i, (h, w) in enumerate(shapes):
      _save_png(os.path.join(root, "train", name, f"img{i}.png"), h, w, seed=100 * label + i)
    for i in range(test_per_class):
      _save_png(os.path.join(root, "test", name, f"img{i}.png"), 12, 12, seed=999 - i)
  return root


def _dataset(folder: str, **overrides):
  dataset = default.get_config().dataset
  dataset.update({"name": "folder", "folder": folder, "image_size": 0, "val_size": 2,
                  "test_size": 2, **overrides})
  return dataset


def _validate_folder(folder: str, **overrides) -> str:
  """config_validation's message for configs/test.py on `folder` ('' if valid)."""
  config = helpers.tiny_config(**{"dataset.name": "folder", "dataset.folder": folder,
                                  "dataset.val_size": 2, "evaluation.ood": "", **overrides})
  try:
    config_validation.validate(config)
  except config_validation.ConfigError as err:
    return str(err)
  return ""


def _snapshot(root: str) -> dict[str, tuple]:
  """Every file and folder under `root`: relative path -> (size or None, mtime_ns)."""
  out = {}
  for parent, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(parent, name)
      stat = os.stat(path)
      out[os.path.relpath(path, root)] = (None if name in dirs else stat.st_size,
                                          stat.st_mtime_ns)
  return out


# ---------------------------------------------------------------- default image size


def test_varying_sizes_get_the_median_shorter_side_rounded_down_to_8_logged_once(
    tmp_path, caplog):
  """Shorter sides 20, 41, 50 and 64, 70, 21 (sorted 20, 21, 41, 50, 64, 70: median 45.5,
  rounded down to 40); another folder of photo-sized images (shorter sides >= 300) gets the
  224 cap."""
  small = _generated_folder(str(tmp_path / "small"), {
      "ant": [(20, 33), (41, 45), (50, 90)], "bee": [(64, 64), (70, 75), (30, 21)]})
  with caplog.at_level(logging.INFO):
    for _ in range(2):  # Validation runs twice in main.py: chosen and logged once.
      spec = sources.resolve(_dataset(small))
  assert spec.image_shape == (40, 40, 3)
  lines = [r.getMessage() for r in caplog.records if "vary in size" in r.getMessage()]
  assert len(lines) == 1 and "using 40 (the median shorter side of 6 training images, " \
      "45.5 px" in lines[0]
  large = _generated_folder(str(tmp_path / "large"), {
      "ant": [(300, 400), (320, 330)], "bee": [(500, 310), (640, 480)]})
  assert sources.resolve(_dataset(large)).image_shape == (224, 224, 3)
  assert sources.resolve(_dataset(large, image_size=32)).image_shape == (32, 32, 3)


# ---------------------------------------------------------------- class folders


def test_an_empty_class_folder_is_refused_naming_it(tmp_path):
  folder = _generated_folder(str(tmp_path / "data"), {"ant": [(12, 12)] * 3,
                                                       "bee": [(12, 12)] * 3})
  os.makedirs(os.path.join(folder, "train", "cat"))
  os.makedirs(os.path.join(folder, "train", "dog"))
  with open(os.path.join(folder, "train", "dog", "notes.txt"), "w") as f:
    f.write("not an image")  # A class folder with no image file in it: empty too.
  message = _validate_folder(folder)
  assert "2 class folders hold no image files" in message, message
  assert os.path.join(folder, "train", "cat") in message
  assert os.path.join(folder, "train", "dog") in message


def test_a_single_class_folder_needs_two_classes(tmp_path):
  folder = _generated_folder(str(tmp_path / "data"), {"ant": [(12, 12)] * 8})
  message = _validate_folder(folder)
  assert "has one class folder ('ant'): a classifier needs at least 2 classes" in message
  assert "val_size" not in message


# ---------------------------------------------------------------- names that are not UTF-8


def test_file_and_class_names_that_are_not_utf8_work_as_paths_and_show_escaped(tmp_path):
  """A Latin-1 class folder (b'caf\\xe9') and a file b'img\\xff.png': listed, read and
  fingerprinted by their bytes; the class name, stored as text, shows the byte escaped."""
  root = os.fsencode(str(tmp_path / "data"))
  for name in (b"ant", b"caf\xe9"):
    for i, file in enumerate((b"img\xff.png", b"img1.png", b"img2.png")):
      _save_png(os.path.join(root, b"train", name, file), 12, 12, seed=i)
  dataset = _dataset(os.fsdecode(root), image_size=12)
  spec = sources.resolve(dataset)
  assert spec.classes == ("ant", "caf\\xe9")
  json.dumps(spec.classes).encode("ascii")  # Stored as text: no surrogate left.
  train = sources.open_splits(dataset)["train"]
  expected = {}
  for name in (b"ant", b"caf\xe9"):
    for file in os.listdir(os.path.join(root, b"train", name)):
      with open(os.path.join(root, b"train", name, file), "rb") as f:
        expected[os.path.join(name, file)] = f.read()
  rows = np.arange(len(train))
  for row, data in zip(rows, train.read(rows)):
    assert data == expected[os.fsencode(train.where(int(row))).split(b"/train/", 1)[1]]
  listing = sources.file_listing(dataset)["train"]
  assert sorted(os.fsencode(path) for path, _, _ in listing) == sorted(expected)
  fingerprint.write_listing(str(tmp_path / "listing.json.gz"), {"train": listing})
  assert fingerprint.read_listing(str(tmp_path / "listing.json.gz")) == {"train": listing}


# ---------------------------------------------------------------- a folder changed under a run


def _listing(folder: str):
  return sources.file_listing(_dataset(folder, image_size=12))


def _changed_message(folder: str, before) -> str:
  folder_source.listing.cache_clear()  # A new process would list the folder afresh.
  with pytest.raises(fingerprint.DatasetChangedError) as raised:
    fingerprint.check_unchanged(fingerprint.digests(before), _listing(folder), before, folder,
                                step=40)
  return str(raised.value)


@pytest.fixture(name="data")
def _data(tmp_path):
  """3 classes x 4 generated 12 x 12 images in train/, 1 per class in test/."""
  return _generated_folder(str(tmp_path / "data"), {n: [(12, 12)] * 4 for n in ("a", "b", "c")},
                           test_per_class=1)


def test_the_listing_records_each_files_path_size_and_mtime(data):
  listing = _listing(data)
  assert sorted(listing) == ["test", "train"]
  for split, entries in listing.items():
    by_hand = sorted((os.path.relpath(os.path.join(parent, f), os.path.join(data, split)),
                      os.stat(os.path.join(parent, f)).st_size,
                      os.stat(os.path.join(parent, f)).st_mtime_ns)
                     for parent, _, files in os.walk(os.path.join(data, split)) for f in files)
    assert entries == by_hand
  folder_source.listing.cache_clear()
  fingerprint.check_unchanged(fingerprint.digests(listing), _listing(data), listing, data, 40)


def test_content_replaced_at_the_same_size_is_named(data):
  before = _listing(data)
  path = os.path.join(data, "train", "b", "img1.png")
  stat = os.stat(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # Rewritten later.
  message = _changed_message(data, before)
  assert f"changed since checkpoint 40 was saved (train/: 1 changed (size or modification " \
         f"time): {os.path.join('b', 'img1.png')})" in message
  assert "new --workdir" in message


def test_a_delete_plus_an_add_keeping_the_count_is_named(data):
  before = _listing(data)
  os.remove(os.path.join(data, "train", "a", "img0.png"))
  _save_png(os.path.join(data, "train", "c", "new.png"), 12, 12, seed=7)
  message = _changed_message(data, before)
  assert (f"1 removed: {os.path.join('a', 'img0.png')}; 1 added: "
          f"{os.path.join('c', 'new.png')}") in message


def test_a_file_moved_to_another_class_is_named(data):
  before = _listing(data)
  os.rename(os.path.join(data, "train", "a", "img3.png"),
            os.path.join(data, "train", "b", "img9.png"))
  message = _changed_message(data, before)
  assert (f"1 removed: {os.path.join('a', 'img3.png')}; 1 added: "
          f"{os.path.join('b', 'img9.png')}") in message


def test_a_changed_test_file_is_named(data):
  before = _listing(data)
  _save_png(os.path.join(data, "test", "c", "img0.png"), 12, 13, seed=5)  # Other size.
  message = _changed_message(data, before)
  assert "(test/: 1 changed (size or modification time): " in message
  assert "train/" not in message


def test_a_checkpoint_without_digests_is_not_checked_and_a_missing_listing_still_refuses(data):
  before = _listing(data)
  os.remove(os.path.join(data, "train", "a", "img0.png"))
  folder_source.listing.cache_clear()
  now = _listing(data)
  fingerprint.check_unchanged(None, now, before, data, 40)  # Saved before digests existed.
  with pytest.raises(fingerprint.DatasetChangedError, match=r"train/: its files differ"):
    fingerprint.check_unchanged(fingerprint.digests(before), now, None, data, 40)


# ---------------------------------------------------------------- the dataset folder untouched


def test_statistics_are_cached_outside_the_dataset_folder(data, tmp_path, monkeypatch):
  """Channel statistics go to $XDG_CACHE_HOME/cpjax/stats; the dataset folder's listing and
  every file's and folder's mtime are as before; the second start reads the cache."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  before = _snapshot(data)
  first = sources.resolve(_dataset(data, image_size=12))
  assert _snapshot(data) == before
  (cached,) = os.listdir(tmp_path / "cache" / "cpjax" / "stats")
  assert cached.startswith("cpjax_stats-") and cached.endswith(".json")

  def not_again(*args, **kwargs):
    raise AssertionError("the statistics were computed again instead of read from the cache")

  monkeypatch.setattr(image_stats, "channel_stats", not_again)
  again = sources.resolve(_dataset(data, image_size=12))
  assert (again.mean, again.std) == (first.mean, first.std)


# ---------------------------------------------------------------- from main.py


@pytest.mark.slow  # main.py processes.
def test_main_on_a_users_folder_defaults_its_size_leaves_it_untouched_and_refuses_a_change(
    tmp_path):
  """main.py on a generated folder of varying sizes with no image_size: it trains (size chosen
  and logged once), writes nothing into the folder (statistics in XDG_CACHE_HOME); a rerun
  after a delete plus an add (same count), or after an added file (which the checkpoint's
  shapes would also show), is refused in one line naming the files and the way out."""
  shapes = [(h, h + 10) for h in (16, 18, 20, 22, 26, 28, 30, 40)]
  folder = _generated_folder(str(tmp_path / "data"), {"ant": shapes, "bee": shapes[::-1]},
                             test_per_class=2)
  before = _snapshot(folder)
  workdir, env = str(tmp_path / "run"), helpers.subprocess_env(
      XDG_CACHE_HOME=str(tmp_path / "cache"))
  flags = ("--config.dataset.name=folder", f"--config.dataset.folder={folder}",
           "--config.dataset.val_size=4", "--config.dataset.crop_padding=0",
           "--config.num_epochs=1", "--config.batch_size=8", "--config.eval_batch_size=8",
           "--config.evaluation.ood=", "--config.evaluation.calibrator_folds=2",
           "--config.evaluation.calibrator_resamples=0",
           "--config.evaluation.bootstrap_resamples=20")

  def run():
    return subprocess.run(helpers.main_command(workdir, *flags), cwd=helpers.REPO,
                                  env=env, capture_output=True, text=True, timeout=400)

  first = run()
  assert first.returncode == 0, first.stderr[-3000:]
  # Shorter sides 16, 18, 20, 22, 26, 28, 30, 40 (twice): median (22 + 26) / 2 = 24.
  assert first.stderr.count("images vary in size: using 24 (the median shorter side") == 1
  assert _snapshot(folder) == before
  assert os.listdir(tmp_path / "cache" / "cpjax" / "stats")
  os.remove(os.path.join(folder, "train", "ant", "img0.png"))
  shutil.copy(os.path.join(folder, "train", "bee", "img1.png"),
              os.path.join(folder, "train", "bee", "copy.png"))
  refused = run()
  assert refused.returncode == 1, refused.stderr[-3000:]
  (line,) = [s for s in refused.stderr.splitlines() if s.startswith("FATAL")]
  assert (f"train/: 1 removed: {os.path.join('ant', 'img0.png')}; 1 added: "
          f"{os.path.join('bee', 'copy.png')}") in line
  assert "new --workdir" in line
  shutil.copy(os.path.join(folder, "train", "bee", "img2.png"),
              os.path.join(folder, "train", "bee", "copy2.png"))
  refused = run()
  assert refused.returncode == 1, refused.stderr[-3000:]
  assert f"2 added: {os.path.join('bee', 'copy.png')}, {os.path.join('bee', 'copy2.png')}" \
      in refused.stderr
  assert "does not fit this config" not in refused.stderr
