"""Any tfds image-classification dataset as a data source (dataset.name="tfds:NAME").

Classes, split names and sizes come from the builder's metadata (`builder.info`): the label
feature's names, `info.splits`. Rows are read by index, as encoded bytes (the image feature's
decoding skipped), through `builder.as_data_source`, which needs the dataset prepared in the
array_record format. The split's labels (4 bytes per example) are read once, without the
images' decoding, and cached in the user's cache folder (never beside the prepared data,
which may be shared or read-only). Nothing is downloaded unless asked
(`dataset.download`), as for the built-in datasets.

Splits: "test" is the test split, else "validation" (ImageNet's convention: its labelled
validation set is what papers report as test); validation is "validation" when the dataset
has a separate test split, else carved from train (`val_size`); a dataset with neither is
carved (`test_size`).
"""

import functools
import hashlib
import logging
import os
import re

import numpy as np
import tensorflow_datasets as tfds

from cpjax.data import preprocess, tensorflow_optional
from cpjax.runtime import files


class TfdsSourceError(FileNotFoundError):
  """The tfds dataset is not prepared as cpjax reads it; the message says how to prepare it."""


def _prepare_hint(name: str) -> str:
  return (f"prepare it once on a machine with the data: `python -c \"import tensorflow_datasets "
          f"as tfds; tfds.builder('{name}', data_dir='DIR', file_format='array_record')"
          f".download_and_prepare()\"` (ImageNet: put ILSVRC2012_img_train.tar and "
          f"ILSVRC2012_img_val.tar in tfds's manual_dir, --config.dataset.manual_dir), then "
          f"pass --config.dataset.data_dir=DIR; or pass --config.dataset.download=True "
          f"where downloading is allowed")


@functools.lru_cache(maxsize=8)
def builder(name: str, data_dir: str, download: bool, manual_dir: str):
  """The prepared tfds builder of `name` (array_record); TfdsSourceError naming how to
  prepare it otherwise. Prepares it first only when `download` or `manual_dir` allows."""
  try:
    found = tfds.builder(name, data_dir=data_dir or None)
  except Exception as err:  # pylint: disable=broad-except  DatasetNotFoundError and kin.
    raise TfdsSourceError(not_found_message(name, err)) from err
  if not found.is_prepared() and (download or manual_dir):
    if not tensorflow_optional.installed():  # tfds encodes the images with it.
      raise TfdsSourceError(tensorflow_optional.missing_message(
          f"preparing tfds dataset {name!r} in {found.data_dir!r}"))
    found = tfds.builder(name, data_dir=data_dir or None, file_format="array_record")
    found.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=manual_dir or None))
  if not found.is_prepared():
    raise TfdsSourceError(f"tfds dataset {name!r} is not prepared in {found.data_dir!r} and "
                          f"cpjax does not download unless asked; {_prepare_hint(name)}"
                          f"{tensorflow_optional.preparing_note()}")
  if found.info.file_format.value != "array_record":
    raise TfdsSourceError(
        f"tfds dataset {name!r} in {found.data_dir!r} is stored as "
        f"{found.info.file_format.value}; cpjax reads examples by index and needs "
        f"array_record: {_prepare_hint(name)}")
  return found


def not_found_message(name: str, err: Exception) -> str:
  """The error of a name tfds does not know: its own first line, and its spelling suggestion
  ("Did you mean: mnsit -> mnist ?", far down its message, after the list of every
  dataset) as the name to pass."""
  text = str(err).strip()
  first = text.splitlines()[0][:300] if text else ""
  message = (f"dataset.name='tfds:{name}': tfds knows no such dataset "
             f"({type(err).__name__}: {first})")
  suggestion = re.search(r"Did you mean: \S+ -> (\S+) \?", text)
  if suggestion:
    message += f"; did you mean --config.dataset.name=tfds:{suggestion.group(1)}?"
  return message


def image_and_label_keys(info) -> tuple[str, str]:
  """The (image, label) feature names: supervised_keys, else 'image' and 'label'."""
  keys = info.supervised_keys or ("image", "label")
  image, label = keys[0], keys[1]
  features = info.features
  if image not in features or label not in features or not hasattr(features[label], "names"):
    raise TfdsSourceError(f"tfds dataset {info.name!r} is not an image-classification set "
                          f"cpjax can read: features {list(features)} (needs an image and a "
                          "ClassLabel label)")
  return image, label


def split_roles(info) -> dict[str, str]:
  """{"train", "val", "test"} -> the tfds split holding it ("" = carved from train)."""
  names = set(info.splits)
  if "train" not in names:
    raise TfdsSourceError(f"tfds dataset {info.name!r} has no train split: {sorted(names)}")
  test = "test" if "test" in names else ("validation" if "validation" in names else "")
  val = "validation" if test == "test" and "validation" in names else ""
  return {"train": "train", "val": val, "test": test}


def _labels_cache(found, split: str) -> str:
  """The user's cache file of `split`'s labels (files.user_cache_dir), keyed by the prepared
  data's folder, name and version: never written beside the data."""
  key = f"{found.data_dir}|{found.info.name}|{found.info.version}|{split}"
  return os.path.join(files.user_cache_dir("labels"),
                      f"cpjax_labels-{hashlib.sha1(key.encode()).hexdigest()[:16]}.npy")


def split_labels(found, split: str) -> np.ndarray:
  """int32 labels of `split` in row order: read once (images not decoded) and cached in the
  user's cache folder (or, where that cannot be written, recomputed each start)."""
  path = _labels_cache(found, split)
  if os.path.exists(path):
    cached = np.load(path)
    if len(cached) == found.info.splits[split].num_examples:
      return cached
  image_key, label_key = image_and_label_keys(found.info)
  source = found.as_data_source(split, decoders={image_key: tfds.decode.SkipDecoding()})
  labels = np.zeros(len(source), np.int32)
  for start in range(0, len(source), 4096):
    rows = list(range(start, min(start + 4096, len(source))))
    labels[start:start + len(rows)] = [int(r[label_key]) for r in source.__getitems__(rows)]
  try:
    files.atomic_write(path, lambda f: np.save(f, labels))
  except OSError as err:
    logging.warning("Could not cache the labels of %s (%s): they are read at each start.",
                    split, err)
  return labels


class TfdsSource:
  """Rows of a tfds split, read by index as encoded image bytes."""
  encoded = True
  # The way out of an example that cannot be read or decoded (added to the host stage's error).
  on_damage = ("the prepared tfds dataset is damaged: prepare it again (tfds.builder(...)"
               ".download_and_prepare(), file_format='array_record')")

  def __init__(self, found, split: str, rows: np.ndarray | None = None):
    self._builder, self._split = found, split
    self._image_key, _ = image_and_label_keys(found.info)
    all_labels = split_labels(found, split)
    self._rows = np.arange(len(all_labels)) if rows is None else np.asarray(rows)
    self.labels, self.ids = all_labels[self._rows], self._rows.astype(np.int32)
    self._source = None  # Opened on first read (it holds file handles).

  def __len__(self) -> int:
    return len(self._rows)

  def __getstate__(self) -> dict:
    """Pickled (for the host stage's worker processes) without the opened data source:
    each process opens the files itself."""
    return {**self.__dict__, "_source": None}

  def take(self, rows: np.ndarray) -> "TfdsSource":
    return TfdsSource(self._builder, self._split, self._rows[rows])

  def where(self, row: int) -> str:
    return (f"tfds {self._builder.name} split {self._split!r} example "
            f"{int(self._rows[row])}")

  def read(self, rows: np.ndarray) -> list[bytes]:
    if self._source is None:
      self._source = self._builder.as_data_source(
          self._split, decoders={self._image_key: tfds.decode.SkipDecoding()})
    try:
      # One row (the host stage's reads): indexing, ~20 us; __getitems__ starts a thread
      # pool per call (~1 ms), which pays only for many rows at once.
      records = ([self._source[int(self._rows[rows[0]])]] if len(rows) == 1 else
                 self._source.__getitems__([int(self._rows[r]) for r in rows]))
    except Exception as err:  # pylint: disable=broad-except  array_record: bare errors.
      raise preprocess.BadImageError(f"{self.where(int(rows[0]))} ...: unreadable "
                                     f"({type(err).__name__}: {str(err)[:200]})") from err
    return [bytes(r[self._image_key]) for r in records]
