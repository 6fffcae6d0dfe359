"""A folder dataset as a new user's folder comes: images of varying size and no image_size,
an empty or lone class folder, names that are not UTF-8, a folder that changes between a kill
and its resume, a dataset folder that must stay untouched (read-only or shared).

Every image here is generated (random pixels saved with PIL) and labelled as such; expected
sizes, listings and differences are worked out from what the test wrote, not by the code under
test.
"""

import hashlib
import json
import logging
import os
import shutil
import subprocess

import numpy as np
from PIL import Image
import pytest

from configs import default
from cpjax.config import implied, validation
from cpjax.data import fingerprint, folder_source, host_stage, image_stats, preprocess, sources
from cpjax.runtime import sharding
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
    validation.validate(config)
  except validation.ConfigError as err:
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


# ---------------------------------------------------------------- defaults that fit a small folder


def test_a_small_folder_gets_carve_outs_that_fit_it_and_no_in_memory_ood_set(tmp_path):
  """configs/default.py with only the folder named, as the README's sentence runs it: its
  defaults were made for digits (val_size 180, test_size 0, ood 'gaussian_noise'). For a
  folder of 2 x 30 training images: validation 6 images (a tenth of 60; the default 180
  would take them all), a test set of 6 where test/ is absent, no OOD set; the config is
  then valid. What the user sets stays and is still refused when it cannot work; a folder
  with its own val/ keeps val_size (unused)."""
  shapes = [(8, 8)] * 30
  with_test = _generated_folder(str(tmp_path / "a"), {"ant": shapes, "bee": shapes},
                                test_per_class=2)
  only_train = _generated_folder(str(tmp_path / "b"), {"ant": shapes, "bee": shapes})

  def folder_config(folder, **overrides):
    config = default.get_config()
    config.dataset.name, config.dataset.folder = "folder", folder
    config.update_from_flattened_dict(overrides)
    return config

  named = {"dataset.name", "dataset.folder"}
  settings = implied.implied_settings(folder_config(with_test), named)
  # 6 validation images reach no conformal alpha below 1/7: no prediction sets.
  assert {k: v for k, (v, _) in settings.items()} == {"evaluation.ood": "",
                                                     "dataset.val_size": 6,
                                                     "evaluation.conformal_scores": ()}
  assert "60 training images: a tenth of them" in settings["dataset.val_size"][1]
  assert "too few for conformal_alpha=0.1" in settings["evaluation.conformal_scores"][1]
  settings = implied.implied_settings(folder_config(only_train), named)
  assert {k: v for k, (v, _) in settings.items()} == {"evaluation.ood": "",
                                                     "dataset.val_size": 6,
                                                     "dataset.test_size": 6,
                                                     "evaluation.conformal_scores": ()}
  config = implied.with_settings(folder_config(only_train),
                                           {k: v for k, (v, _) in settings.items()})
  validation.validate(config)  # Valid as implied.
  # An alpha the user asked for is kept, and refused with the smallest one 6 images reach.
  asked = folder_config(only_train, **{"evaluation.conformal_alpha": 0.1})
  settings = implied.implied_settings(asked, named | {"evaluation.conformal_alpha"})
  assert "evaluation.conformal_scores" not in settings
  with pytest.raises(validation.ConfigError, match=r"conformal_alpha=0.1 .* n = 6 .* "
                                                   r"smallest reachable alpha is 1/\(n \+ 1\)"):
    validation.validate(implied.with_settings(asked, {k: v for k, (v, _) in settings.items()}))
  # At least calibrator_folds validation images: 5 of 2 x 20 (a tenth would be 4).
  small = _generated_folder(str(tmp_path / "c"), {"ant": shapes[:20], "bee": shapes[:20]},
                            test_per_class=1)
  assert implied.implied_settings(folder_config(small), named)[
      "dataset.val_size"][0] == 5
  # Set by the user: kept, and refused with its reason.
  config = folder_config(with_test, **{"dataset.val_size": 180})
  settings = implied.implied_settings(config, named | {"dataset.val_size"})
  assert "dataset.val_size" not in settings
  with pytest.raises(validation.ConfigError,
                     match=r"val_size=180 must be below the train split size 60"):
    validation.validate(implied.with_settings(
        config, {k: v for k, (v, _) in settings.items()}))
  for name in ("ant", "bee"):
    _save_png(os.path.join(with_test, "val", name, "img0.png"), 8, 8)
  settings = implied.implied_settings(folder_config(with_test), named)
  assert {k: v for k, (v, _) in settings.items()} == {"evaluation.ood": ""}


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
    assert data == expected[os.fsencode(train.path(int(row))).split(b"/train/", 1)[1]]
  listing = sources.identity(dataset).listing["train"]
  assert sorted(os.fsencode(path) for path, *_ in listing) == sorted(expected)
  fingerprint.write_listings(str(tmp_path / "listing.json.gz"), [{"train": listing}])
  assert fingerprint.read_listings(str(tmp_path / "listing.json.gz")) == [{"train": listing}]


def _cut_short(path) -> bytes:
  """Cuts the file at `path` (str or bytes) to half its bytes; returns its bytes before."""
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2])
  return data


def test_names_that_are_not_utf8_show_escaped_in_errors_as_in_classes_json(tmp_path):
  """A file that fails to decode, and a file whose header fails the start-up check, both
  named b'...\\xff...' under the class b'caf\\xe9': each error shows the bytes as `\\xff` and
  `\\xe9` (as classes.json and the docs), never as Python's surrogates (`\\udcff`)."""
  root = os.fsencode(str(tmp_path / "data"))
  for name in (b"ant", b"caf\xe9"):
    for i in range(3):
      _save_png(os.path.join(root, b"train", name, b"img%d.png" % i), 20, 20, seed=i)
  pixels = np.random.default_rng(3).integers(0, 256, (40, 40, 3), np.uint8)
  bad = os.path.join(root, b"train", b"caf\xe9", b"bad\xff.jpg")
  Image.fromarray(pixels).save(bad, format="JPEG")
  _cut_short(bad)  # Its header still opens: found when it is decoded.
  dataset = _dataset(os.fsdecode(root), image_size=12, mean=(0.5,) * 3, std=(0.25,) * 3)
  spec = sources.resolve(dataset)
  # The whole split: rows are the relative paths sorted (ant/img0-2, then caf\xe9/bad\xff).
  train = folder_source.FolderSource(folder_source.listing(os.fsdecode(root), "train", 100,
                                                           False))
  reader = host_stage.PreprocessReader(train, preprocess.from_config(dataset, spec.image_shape,
                                                                     0),
                                       sharding.create_mesh(), 1, worker_kind="thread")
  with pytest.raises(preprocess.BadImageError) as raised:
    reader.images(np.asarray([3]), epoch=0)
  message = str(raised.value)
  assert os.path.join(str(tmp_path / "data"), "train", "caf\\xe9", "bad\\xff.jpg") + (
      ": cannot be decoded") in message, message
  assert "\udce9" not in message and "\udcff" not in message, message
  with open(os.path.join(root, b"train", b"ant", b"hdr\xff.png"), "wb") as f:
    f.write(b"not an image at all")
  folder_source.listing.cache_clear()
  message = _validate_folder(os.fsdecode(root))
  assert os.path.join("train", "ant", "hdr\\xff.png (") in message, message
  assert "\udcff" not in message, message


# ---------------------------------------------------------------- a folder changed under a run


def _identity(folder: str) -> fingerprint.Identity:
  folder_source.listing.cache_clear()  # A new process would list the folder afresh.
  return sources.identity(_dataset(folder, image_size=12))


def _listing(folder: str):
  return _identity(folder).listing


def _changed_message(folder: str, before) -> str:
  with pytest.raises(fingerprint.DatasetChangedError) as raised:
    fingerprint.check_unchanged(fingerprint.digests(before), _identity(folder), before,
                                step=40)
  return str(raised.value)


def _sampled_by_hand(path: str) -> str:
  """The content digest as docs/data.md defines it, computed here: SHA-256 of the size in
  decimal and a newline, then the whole file up to 12 KiB, else its first, middle and last
  4 KiB; the first 16 hex digits."""
  with open(path, "rb") as f:
    data = f.read()
  size = len(data)
  if size <= 3 * 4096:
    sampled = data
  else:
    middle = (size - 4096) // 2
    sampled = data[:4096] + data[middle:middle + 4096] + data[-4096:]
  return hashlib.sha256(f"{size}\n".encode() + sampled).hexdigest()[:16]


def _flip(path: str, offset: int) -> None:
  """Inverts the byte at `offset` of the file at `path`: other content, the same size."""
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture(name="data")
def _data(tmp_path):
  """3 classes x 4 generated 12 x 12 images in train/, 1 per class in test/."""
  return _generated_folder(str(tmp_path / "data"), {n: [(12, 12)] * 4 for n in ("a", "b", "c")},
                           test_per_class=1)


def test_the_listing_records_each_files_path_size_sampled_content_and_mtime(data):
  listing = _listing(data)
  assert sorted(listing) == ["test", "train"]
  for split, entries in listing.items():
    by_hand = []
    for parent, _, names in os.walk(os.path.join(data, split)):
      for name in names:
        path = os.path.join(parent, name)
        by_hand.append((os.path.relpath(path, os.path.join(data, split)),
                        os.stat(path).st_size, _sampled_by_hand(path),
                        os.stat(path).st_mtime_ns))
    assert entries == sorted(by_hand)
  assert not fingerprint.check_unchanged(fingerprint.digests(listing), _identity(data), listing,
                                         40)


def test_a_large_file_is_compared_by_its_size_and_three_sampled_blocks(tmp_path):
  """A 100 x 100 PNG of random pixels (about 30 KB): its digest is the hand-computed one; a
  byte changed in its middle block is a change; one changed between the first and the
  middle block, at the same size, is not seen (the documented limit of the sampling)."""
  folder = _generated_folder(str(tmp_path / "data"), {"a": [(100, 100), (12, 12)],
                                                       "b": [(12, 12)] * 2})
  big = os.path.join(folder, "train", "a", "img0.png")
  size = os.path.getsize(big)
  assert size > 3 * 4096
  before = _listing(folder)
  assert before["train"][0][:3] == (os.path.join("a", "img0.png"), size, _sampled_by_hand(big))
  _flip(big, 4096 + 10)  # Between the first block and the middle one.
  assert not fingerprint.check_unchanged(fingerprint.digests(before), _identity(folder),
                                         before, 40)
  _flip(big, size // 2)  # Inside the middle block.
  assert (f"(train/: 1 changed (size or content): {os.path.join('a', 'img0.png')})"
          in _changed_message(folder, before))


def test_content_replaced_at_the_same_size_is_named(data):
  before = _listing(data)
  path = os.path.join(data, "train", "b", "img1.png")
  size = os.path.getsize(path)
  _flip(path, size // 2)
  assert os.path.getsize(path) == size
  message = _changed_message(data, before)
  assert (f"the files of dataset.folder={data!r} changed since checkpoint 40 was saved "
          f"(train/: 1 changed (size or content): {os.path.join('b', 'img1.png')})") in message
  assert "new --workdir" in message


def test_the_same_bytes_copied_back_or_a_touched_file_are_no_change(data, tmp_path):
  """`cp` of a file's own bytes (a new modification time, as a restore from a backup
  gives), or `touch`: the same file, the resume goes on."""
  before = _listing(data)
  path = os.path.join(data, "train", "b", "img1.png")
  shutil.copyfile(path, tmp_path / "backup.png")
  os.remove(path)
  shutil.copyfile(tmp_path / "backup.png", path)
  stat = os.stat(path)
  os.utime(os.path.join(data, "test", "a", "img0.png"), ns=(stat.st_atime_ns,
                                                            stat.st_mtime_ns + 10**9))
  now = _identity(data)
  assert [e[3] for e in now.listing["train"]] != [e[3] for e in before["train"]]
  assert not fingerprint.check_unchanged(fingerprint.digests(before), now, before, 40)


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
  assert "(test/: 1 changed (size or content): " in message
  assert "train/" not in message


def test_a_checkpoint_without_digests_is_not_checked_and_a_missing_listing_still_refuses(data):
  before = _listing(data)
  os.remove(os.path.join(data, "train", "a", "img0.png"))
  now = _identity(data)
  assert not fingerprint.check_unchanged(None, now, before, 40)  # Saved before digests existed.
  with pytest.raises(fingerprint.DatasetChangedError, match=r"train/: its files differ"):
    fingerprint.check_unchanged(fingerprint.digests(before), now, None, 40)


def _digest_before_content(entries) -> str:
  """The digest that checkpoints recorded before content was compared, as those versions
  wrote it: SHA-256 of each entry's path bytes, size and modification time."""
  sha = hashlib.sha256()
  for path, size, _, mtime in entries:
    sha.update(os.fsencode(path) + b"\0" + f"{size}\0{mtime}\n".encode())
  return sha.hexdigest()


def test_a_checkpoint_of_the_earlier_digests_resumes_and_still_sees_a_change(data):
  """A checkpoint saved by an earlier version (digests of paths, sizes and modification
  times; the listing file without contents) resumes on the same files, and is refused, by
  the rule it was saved under, when a file's modification time changed."""
  before = _listing(data)
  saved = {split: _digest_before_content(entries) for split, entries in before.items()}
  old_listing = {split: [(p, size, "", mtime) for p, size, _, mtime in entries]
                 for split, entries in before.items()}
  assert not fingerprint.check_unchanged(saved, _identity(data), old_listing, 40)
  path = os.path.join(data, "train", "c", "img2.png")
  stat = os.stat(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  with pytest.raises(fingerprint.DatasetChangedError,
                     match=r"train/: 1 changed \(size or modification time\): c/img2\.png"):
    fingerprint.check_unchanged(saved, _identity(data), old_listing, 40)


def _resumed(data: str, workdir: str, meta) -> dict:
  """check_resume at a (re)start in `workdir` with checkpoint metadata `meta` (None: no
  checkpoint), as cpjax.training.setup.setup_run calls it."""
  listings = fingerprint.saved_listings(workdir)
  folder_source.listing.cache_clear()
  identity = sources.identity(_dataset(data, image_size=12), listings[0] if listings else None)
  return fingerprint.check_resume(identity, listings, meta, workdir)


def test_a_file_the_run_found_damaged_may_be_replaced_and_nothing_else(data, tmp_path,
                                                                        caplog):
  """The run stops on b/img1.png (its example id: its row in the sorted listing), noted in
  the workdir. Replaced by other bytes, the resume goes on (a warning names it), again at a
  second resume from the same checkpoint; a change to another file is still refused,
  naming that one only. Once a checkpoint has trained on the replacement, a further change
  of that file is refused too: the note covers the damaged bytes only."""
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  saved = _resumed(data, workdir, None)
  meta = {"data_digests": saved, "step": 40}
  names = sorted(os.path.join(c, f"img{i}.png") for c in "abc" for i in range(4))
  damaged = os.path.join(data, "train", "b", "img1.png")
  _cut_short(damaged)
  with pytest.raises(preprocess.BadImageError):
    with fingerprint.noting_damage(workdir):
      error = preprocess.BadImageError(f"{damaged}: cannot be decoded")
      error.entry = ("train", names.index(os.path.join("b", "img1.png")))
      raise error
  _save_png(damaged, 12, 12, seed=77)  # Another image: not the bytes the listing holds.
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      now = _resumed(data, workdir, meta)
  assert now != saved
  assert sum(r.getMessage().startswith(f"train/{os.path.join('b', 'img1.png')} changed since "
                                       "checkpoint 40") and "found damaged" in r.getMessage()
             for r in caplog.records) == 2
  other = os.path.join(data, "train", "c", "img0.png")
  _flip(other, os.path.getsize(other) // 2)  # Past the header: it still lists.
  with pytest.raises(fingerprint.DatasetChangedError) as raised:
    _resumed(data, workdir, meta)
  assert f"(train/: 1 changed (size or content): {os.path.join('c', 'img0.png')})" \
      in str(raised.value)
  _flip(other, os.path.getsize(other) // 2)  # Put back.
  _save_png(damaged, 12, 12, seed=78)  # Changed again after checkpoint 50 trained on 77's.
  with pytest.raises(fingerprint.DatasetChangedError) as raised:
    _resumed(data, workdir, {"data_digests": now, "step": 50})
  assert f"(train/: 1 changed (size or content): {os.path.join('b', 'img1.png')})" \
      in str(raised.value)


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
  assert refused.returncode == 2, refused.stderr[-3000:]
  (line,) = [s for s in refused.stderr.splitlines() if s.startswith("FATAL")]
  assert (f"train/: 1 removed: {os.path.join('ant', 'img0.png')}; 1 added: "
          f"{os.path.join('bee', 'copy.png')}") in line
  assert "new --workdir" in line
  shutil.copy(os.path.join(folder, "train", "bee", "img2.png"),
              os.path.join(folder, "train", "bee", "copy2.png"))
  refused = run()
  assert refused.returncode == 2, refused.stderr[-3000:]
  assert f"2 added: {os.path.join('bee', 'copy.png')}, {os.path.join('bee', 'copy2.png')}" \
      in refused.stderr
  assert "does not fit this config" not in refused.stderr


@pytest.mark.slow  # main.py processes.
def test_a_damaged_image_ends_in_one_line_and_the_run_resumes_once_it_is_replaced(tmp_path):
  """A test image cut short past its header, damaged before the run starts (the start-up
  check reads headers only), is first read by the evaluation after epoch 1, once epoch 0's
  checkpoint is saved. The run ends with status 1 and one FATAL line, its last word: the
  file (as `\\xff` where its name is not UTF-8), how to repair it and the checkpoint the rerun
  resumes from; no traceback. With the file replaced by a good image, the rerun resumes
  from that checkpoint and finishes."""
  shapes = [(16, 20)] * 6
  folder = _generated_folder(str(tmp_path / "data"), {"ant": shapes, "bee": shapes},
                             test_per_class=2)
  victim = os.path.join(os.fsencode(folder), b"test", b"bee", b"img\xff.jpg")
  Image.fromarray(np.random.default_rng(5).integers(0, 256, (40, 40, 3), np.uint8)).save(
      victim, format="JPEG")
  good = _cut_short(victim)
  workdir, env = str(tmp_path / "run"), helpers.subprocess_env(
      XDG_CACHE_HOME=str(tmp_path / "cache"))
  flags = ("--config.dataset.name=folder", f"--config.dataset.folder={folder}",
           "--config.dataset.image_size=16", "--config.dataset.val_size=4",
           "--config.dataset.crop_padding=0", "--config.num_epochs=2",
           "--config.eval_every_epochs=2", "--config.batch_size=8",
           "--config.eval_batch_size=8", "--config.evaluation.ood=",
           "--config.evaluation.calibrator_folds=2", "--config.evaluation.calibrator_resamples=0",
           "--config.evaluation.bootstrap_resamples=20")

  def run():
    return subprocess.run(helpers.main_command(workdir, *flags), cwd=helpers.REPO, env=env,
                          capture_output=True, text=True, timeout=400)

  stopped = run()
  assert stopped.returncode == 1, stopped.stderr[-3000:]
  lines = stopped.stderr.strip().splitlines()
  fatal = [line for line in lines if line.startswith("FATAL")]
  assert len(fatal) == 1 and lines[-1] == fatal[0], stopped.stderr[-3000:]
  assert "Traceback" not in stopped.stderr
  (step,) = helpers.checkpoint_steps(workdir)  # Epoch 0's.
  shown = os.path.join(folder, "test", "bee", "img\\xff.jpg")
  assert fatal[0].startswith(f"FATAL {shown}: cannot be decoded ("), fatal[0]
  assert "replace the file with a readable copy of the image under the same name" in fatal[0]
  assert fatal[0].endswith(f"it resumes from the last good checkpoint, step {step} in "
                           f"{workdir}/checkpoints"), fatal[0]
  with open(victim, "wb") as f:
    f.write(good)
  resumed = run()
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"Resumed from {workdir}/checkpoints at global step {step}" in resumed.stderr
  assert "test/bee/img\\xff.jpg" in resumed.stderr and "found damaged" in resumed.stderr
  assert [r["epoch"] for r in helpers.read_metrics(workdir)] == [0, 1]
  assert "test_accuracy" in helpers.read_metrics(workdir)[-1]
