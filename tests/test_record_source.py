"""Folder and tfds:NAME datasets converted to array_record files of encoded images.

Every image here is generated (NumPy arrays saved with PIL) and labelled as such. The
references are independent of the code under test: the files' own bytes (read with open),
PIL's decode of those bytes, sizes counted by hand from the files, and the same dataset read
from its folder.
"""

import io
import os

import ml_collections
import numpy as np
from PIL import Image
import pytest

from configs import default
from cpjax.config import validation
from cpjax.data import (
  array_records,
  fingerprint,
  host_stage,
  preprocess,
  record_source,
  sources,
  specs,
  splits,
)
from cpjax.runtime import sharding
from cpjax.training import train
from tests.helpers import read_metrics, tiny_config


@pytest.fixture(name="folder")
def _folder(tmp_path):
  """A generated folder: 3 classes x 7 images (PNG and JPEG, sizes 16-47) in train/, 2 per
  class in test/."""
  rng = np.random.default_rng(11)
  root = tmp_path / "images"
  for split, count in (("train", 7), ("test", 2)):
    for name in ("cat", "ant", "bee"):
      for i in range(count):
        h, w = (int(v) for v in rng.integers(16, 48, 2))
        path = root / split / name / f"img{i}.{('png', 'jpg')[i % 2]}"
        os.makedirs(path.parent, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(
            path, format=("PNG", "JPEG")[i % 2])
  return str(root)


def _dataset(folder: str, **overrides) -> ml_collections.ConfigDict:
  dataset = default.get_config().dataset
  dataset.update({"name": "folder", "folder": folder, "image_size": 12, "val_size": 4,
                  "flip": True, **overrides})
  return dataset


def _converted(folder: str, out: str, num_shards: int = 2) -> ml_collections.ConfigDict:
  """Converts the folder; returns the dataset config that reads the records instead."""
  sources.write_records(_dataset(folder), out, num_shards)
  return _dataset("", stream_dir=out)  # The folder is not needed to read them.


def _files(folder: str, split: str) -> list[str]:
  """The split's files in row order: relative paths sorted (the folder source's ids)."""
  base = os.path.join(folder, split)
  return sorted(os.path.relpath(os.path.join(d, f), base)
                for d, _, files in os.walk(base) for f in files)


def _readers(dataset: ml_collections.ConfigDict) -> dict[str, host_stage.PreprocessReader]:
  spec = sources.resolve(dataset)
  transform = preprocess.from_config(dataset, spec.image_shape, seed=5)
  return {name: host_stage.PreprocessReader(source, transform, sharding.create_mesh(),
                                            num_workers=2)
          for name, source in sources.open_splits(dataset).items()}


def test_records_hold_each_files_bytes_id_and_label(folder, tmp_path):
  records = _converted(folder, str(tmp_path / "rec"))
  for split in ("train", "test"):
    source = record_source.RecordSource(records.stream_dir, split)
    paths = _files(folder, split)
    assert len(source) == len(paths)
    np.testing.assert_array_equal(source.ids, np.arange(len(paths)))
    for row, data in enumerate(source.read(np.arange(len(paths)))):
      with open(os.path.join(folder, split, paths[row]), "rb") as f:
        assert data == f.read()  # The file's bytes, unchanged.
      assert source.labels[row] == ("ant", "bee", "cat").index(paths[row].split(os.sep)[0])
      # PIL's own decode of those bytes is the file's pixels.
      np.testing.assert_array_equal(
          np.asarray(Image.open(io.BytesIO(data)).convert("RGB")),
          np.asarray(Image.open(os.path.join(folder, split, paths[row])).convert("RGB")))


def test_records_are_the_files_size_plus_a_small_per_record_overhead(folder, tmp_path):
  out = str(tmp_path / "rec")
  _converted(folder, out, num_shards=3)
  for split in ("train", "test"):
    source_bytes = sum(os.path.getsize(os.path.join(folder, split, p))
                       for p in _files(folder, split))
    shards = [os.path.join(out, f) for f in os.listdir(out)
              if f.startswith(f"{split}.array_record")]
    assert len(shards) == 3
    shard_bytes = sum(os.path.getsize(p) for p in shards)
    num = len(_files(folder, split))
    # Uncompressed records: every byte of every file, plus array_record's framing (a chunk
    # header and an index entry a record, ~50 bytes; a footer and padding to riegeli's
    # 64 KiB blocks a shard, at most two blocks).
    assert source_bytes <= shard_bytes <= source_bytes + 100 * num + 2 * 65536 * len(shards)


def test_a_run_over_the_records_sees_the_folders_facts_splits_and_pixels(folder, tmp_path):
  """Facts, carve-outs (validation, meta-validation, train_examples: chosen at run time) and
  every pass's pixels are those of the folder read directly, bit for bit."""
  fields = {"meta_val_size": 3, "train_examples": 9}
  direct = _dataset(folder, **fields)
  direct_spec = sources.resolve(direct)
  direct_readers = _readers(direct)
  records = _converted(folder, str(tmp_path / "rec"))
  records.update(fields)
  assert sources.resolve(records) == direct_spec
  assert specs.DATASETS["folder"].classes == ("ant", "bee", "cat")
  record_readers = _readers(records)
  assert set(record_readers) == set(direct_readers) == {"train", "val", "test", "meta_val"}
  for name, direct_reader in direct_readers.items():
    reader = record_readers[name]
    np.testing.assert_array_equal(reader.ids, direct_reader.ids)
    np.testing.assert_array_equal(reader.labels, direct_reader.labels)
    rows = np.random.default_rng(0).permutation(len(reader))
    for epoch in (0, 3, None):  # Two training epochs' crops, and the evaluation transform.
      np.testing.assert_array_equal(reader.images(rows, epoch),
                                    direct_reader.images(rows, epoch))
    blocks = np.resize(rows, 16).reshape(2, 8)  # Batches of 8: one row per device.
    for a, b in zip(reader.batches(blocks, epoch=1), direct_reader.batches(blocks, epoch=1)):
      for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))


def test_a_damaged_record_is_named_when_read_and_a_truncated_shard_at_start_up(folder,
                                                                               tmp_path):
  out = str(tmp_path / "rec")
  records = _converted(folder, out, num_shards=2)
  sources.resolve(records)
  opened = sources.open_splits(records)
  path = os.path.join(folder, "train", _files(folder, "train")[15])  # Row 15: shard 1.
  with open(path, "rb") as f:
    payload = f.read()
  shard = os.path.join(out, "train.array_record-00001-of-00002")
  with open(shard, "rb") as f:
    content = bytearray(f.read())
  at = content.find(payload)  # Uncompressed: the file's bytes lie in the shard as they are.
  assert at >= 0
  content[at + len(payload) // 2] ^= 0xFF
  with open(shard, "wb") as f:
    f.write(content)
  name = "train" if 15 in opened["train"].ids else "val"
  row = int(np.flatnonzero(opened[name].ids == 15)[0])
  transform = preprocess.from_config(records, specs.DATASETS["folder"].image_shape, seed=0)
  reader = host_stage.PreprocessReader(opened[name], transform, sharding.create_mesh())
  # Shard 1 holds rows [10, 21): row 15 is its record 5 (riegeli's chunk hash, or the
  # record's CRC-32, finds the flipped byte).
  with pytest.raises(array_records.DamagedRecordError,
                     match=r"train.array_record-00001-of-00002: record 5 \(row 15 of the "
                           r"split\) is (unreadable|damaged)"):
    reader.images(np.asarray([row]), epoch=0)
  with open(shard, "r+b") as f:
    f.truncate(len(content) - 10)
  config = tiny_config(**{"dataset.name": "folder", "dataset.stream_dir": out,
                          "dataset.image_size": 12, "dataset.val_size": 6,
                          "evaluation.ood": ""})
  with pytest.raises(validation.ConfigError,
                     match=r"train.array_record-00001-of-00002 is \d+ bytes, \d+ were written"):
    validation.validate(config)


def test_config_fields_of_the_records_are_checked_at_start_up(folder, tmp_path):
  out = str(tmp_path / "rec")
  _converted(folder, out)
  base = {"dataset.name": "folder", "dataset.image_size": 12, "dataset.val_size": 6,
          "evaluation.ood": "", "evaluation.conformal_scores": ()}  # Too few for alpha 0.1.
  bad = {
      "dataset.reader='device'.*valid: auto, host, stream": {"dataset.reader": "device",
                                                             "dataset.stream_dir": out},
      "reader='stream' reads a folder dataset's converted records": {
          "dataset.reader": "stream", "dataset.folder": folder},
      "stream_dir=.* is not read with dataset.reader='host'": {
          "dataset.reader": "host", "dataset.stream_dir": out, "dataset.folder": folder},
      "holds dataset 'folder'.*dataset.name='tfds:cpjax_generated_images'": {
          "dataset.name": "tfds:cpjax_generated_images", "dataset.stream_dir": out},
      "holds no converted folder dataset.*write_array_records": {
          "dataset.stream_dir": str(tmp_path)},
  }
  for message, fields in bad.items():
    with pytest.raises(validation.ConfigError, match=message):
      validation.validate(tiny_config(**{**base, **fields}))
  for reader in ("auto", "stream"):
    validation.validate(tiny_config(**{**base, "dataset.reader": reader,
                                              "dataset.stream_dir": out}))
  # Raw records (a built-in dataset's) are refused as encoded ones, and the reverse.
  with pytest.raises(ValueError, match="holds encoded images.*reads raw ones"):
    array_records.read_index(out, "train")


def test_label_noise_on_a_folder_flips_a_seeded_share_of_the_pool(folder, tmp_path):
  """Symmetric noise on the training pool only: round(fraction * pool) rows get another
  class, validation and test keep theirs; the records give the same noisy labels."""
  clean = sources.open_splits(_dataset(folder))
  noisy_config = _dataset(folder, label_noise=0.4, label_noise_seed=3)
  sources.resolve(noisy_config)
  noisy = sources.open_splits(noisy_config)
  for name in ("val", "test"):
    np.testing.assert_array_equal(noisy[name].labels, clean[name].labels)
  flipped = noisy["train"].labels != clean["train"].labels
  pool = len(clean["train"])  # No holdout, no train_examples: the pool is the train split.
  assert flipped.sum() == round(0.4 * pool)
  # The in-memory datasets' draw (splits.noisy_labels) on the same labels and pool.
  full = np.concatenate([clean["train"].labels, clean["val"].labels])
  order = np.argsort(np.concatenate([clean["train"].ids, clean["val"].ids]))
  expected = splits.noisy_labels(full[order], np.sort(clean["train"].ids), 0.4, 3, 3)
  np.testing.assert_array_equal(noisy["train"].labels, expected[noisy["train"].ids])
  records = _converted(folder, str(tmp_path / "rec"))
  records.update({"label_noise": 0.4, "label_noise_seed": 3})
  sources.resolve(records)
  np.testing.assert_array_equal(sources.open_splits(records)["train"].labels,
                                noisy["train"].labels)
  validation.validate(tiny_config(**{
      "dataset.name": "folder", "dataset.folder": folder, "dataset.image_size": 12,
      "dataset.val_size": 6, "dataset.label_noise": 0.4, "evaluation.ood": "",
      "evaluation.conformal_scores": ()}))  # 6 validation images: too few for alpha 0.1.


def test_a_conversion_stopped_midway_is_refused_not_half_read(folder, tmp_path, monkeypatch):
  out = str(tmp_path / "rec")
  records = _converted(folder, out)
  sources.resolve(records)  # A whole conversion reads.
  real = record_source.write_split

  def stopped(source, directory, split, *args, **kwargs):
    if split == "test":  # Killed after train was rewritten.
      raise KeyboardInterrupt
    return real(source, directory, split, *args, **kwargs)

  monkeypatch.setattr(record_source, "write_split", stopped)
  with pytest.raises(KeyboardInterrupt):
    sources.write_records(_dataset(folder), out)
  with pytest.raises(FileNotFoundError, match="dataset.json is missing: not written, or its "
                                              "writing stopped"):
    sources.resolve(records)


def test_records_without_their_identity_file_are_refused_where_the_checkpoint_knew_it(
    folder, tmp_path, caplog):
  """The conversion writes one identity file a split. With the training split's deleted,
  the records name it as missing; a checkpoint that recorded the rows' digests refuses the
  resume naming that file (the rows cannot be checked, so they may be other rows); a run
  without such a checkpoint goes on unchecked, with a warning naming the file."""
  out = str(tmp_path / "rec")
  _converted(folder, out)
  whole = record_source.identity(out)
  assert not whole.missing and sorted(whole.listing) == ["test", "train"]
  missing = os.path.join(out, "train.identity.npz")
  os.remove(missing)
  found = record_source.identity(out)
  assert found.missing == missing and found.listing == {}
  meta = {"step": 7, "data_digests": fingerprint.digests(whole.listing)}
  with pytest.raises(fingerprint.DatasetChangedError) as raised:
    fingerprint.check_resume(found, [whole.listing], meta, str(tmp_path))
  assert str(raised.value).startswith(
      f"the records in dataset.stream_dir={out!r} lack {missing}, though checkpoint 7 recorded "
      "their rows' identity")
  assert "Convert the files as they were into them again" in str(raised.value)
  assert "new --workdir" in str(raised.value)
  for meta in (None, {"step": 7}):  # No checkpoint, or one saved without digests.
    caplog.clear()
    assert fingerprint.check_resume(found, [], meta, str(tmp_path)) is None
    assert f"lack {missing}" in caplog.text and "cannot check" in caplog.text


def _records_run_config(stream_dir: str = "", folder: str = "") -> ml_collections.ConfigDict:
  """configs/test.py on the generated folder's records (or the folder itself): 1 epoch of the
  tiny model in batches of 8, a small report."""
  return tiny_config(**{
      "dataset.name": "folder", "dataset.stream_dir": stream_dir, "dataset.folder": folder,
      "dataset.image_size": 12, "dataset.val_size": 6, "evaluation.ood": "",
      "num_epochs": 1, "batch_size": 8, "eval_batch_size": 8,
      "evaluation.calibrator_folds": 2, "evaluation.calibrator_resamples": 0,
      "evaluation.bootstrap_resamples": 20,
      # 6 validation images reach alpha >= 1/7 (the finite-sample correction's bound).
      "evaluation.conformal_alpha": 0.2})


@pytest.mark.slow  # Trains.
def test_a_resume_onto_records_of_a_changed_folder_is_refused_naming_the_file(folder,
                                                                               tmp_path):
  """A run over the records (1 epoch), then the folder converted again into the same
  directory. Unchanged, the rerun goes on from its checkpoint. With one training image
  replaced (another generated image) the rerun is refused before anything is restored,
  naming the records, the file that changed and the way back, and so is a run reading the
  changed folder itself: the records keep the identity of the files they were converted
  from, and so are the changed records with their identity files deleted. The run's metrics
  are left as they were."""
  out, workdir = str(tmp_path / "rec"), str(tmp_path / "run")
  sources.write_records(_dataset(folder), out, num_shards=2)
  train.train_and_evaluate(_records_run_config(stream_dir=out), workdir)
  metrics = read_metrics(workdir)
  sources.write_records(_dataset(folder), out, num_shards=2)  # The same files again.
  train.train_and_evaluate(_records_run_config(stream_dir=out), workdir)
  assert read_metrics(workdir) == metrics
  replaced = os.path.join(folder, "train", "bee", "img3.jpg")
  Image.fromarray(np.random.default_rng(99).integers(0, 256, (20, 30, 3), np.uint8)).save(
      replaced, format="JPEG")
  sources.write_records(_dataset(folder), out, num_shards=2)
  with pytest.raises(fingerprint.DatasetChangedError) as raised:
    train.train_and_evaluate(_records_run_config(stream_dir=out), workdir)
  message = str(raised.value)
  assert f"the records in dataset.stream_dir={out!r} changed since checkpoint " in message
  assert f"(train/: 1 changed (size or content): {os.path.join('bee', 'img3.jpg')})" in message
  assert "new --workdir" in message
  with pytest.raises(fingerprint.DatasetChangedError,
                     match=r"train/: 1 changed \(size or content\): bee/img3\.jpg"):
    train.train_and_evaluate(_records_run_config(folder=folder), workdir)
  # The changed records with their identity files deleted: still refused, naming the file
  # (not trained on as unchecked rows).
  for split in ("train", "test"):
    os.remove(os.path.join(out, f"{split}.identity.npz"))
  with pytest.raises(fingerprint.DatasetChangedError,
                     match=rf"lack {out}/train\.identity\.npz, though checkpoint \d+ recorded"):
    train.train_and_evaluate(_records_run_config(stream_dir=out), workdir)
  assert read_metrics(workdir) == metrics
