"""Data sources: what the readers read rows from, and the registry of source kinds.

A data source is a split's examples: `len`, `ids` (stable int32 example ids), `labels`
(int32), `take(rows)` (a source of some of its rows) and `read(rows)`, which gives decoded
pixels (uint8 [n, H, W, C]; `encoded` False) or the encoded bytes of each row (`encoded`
True, decoded by the host stage, cpjax.data.preprocess). Three kinds stand behind it:

  built-in     the in-memory splits of the datasets in cpjax.data.specs (splits.Split),
               read whole through tfds by cpjax.data.input_pipeline, as always
  folder       DIR/train/<class>/* (cpjax.data.folder_source)
  tfds:NAME    any tfds image-classification dataset (cpjax.data.tfds_source)
  records      a folder or tfds:NAME dataset converted to array_record files of its
               encoded images (`write_records`; cpjax.data.record_source), read in its
               place when `dataset.stream_dir` is set (`reads_records`)

A source kind is one `SourceKind` entry of the registry `KINDS` (cpjax.registry), named by
the dataset name it opens ("folder") or by the prefix of those it opens ("tfds:" opens
tfds:NAME; `is_source_name`, `kind_of`): `describe` reads a dataset config's facts
(classes, split sizes, output image shape, channel statistics) into a specs.DatasetSpec,
and `open` gives its splits as sources. The records kind is an entry too, named by no
dataset (`named` False): it opens a folder or tfds:NAME dataset's conversion in its place. A
user's module registers its own kind the same way (docs/extending.md#add-a-dataset-source).
`resolve` runs `describe` once at start-up (config validation) and registers the facts under
the dataset's name; `open_splits` applies the
run's carve-outs (validation, test, meta-validation, holdout, train_examples:
cpjax.data.splits) to the opened splits.

A kind's `describe` takes the output image size and the channel statistics from
cpjax.data.image_stats (the config's, else the images' own).
"""

from collections.abc import Callable
import dataclasses
import logging
import os
from typing import Protocol

import ml_collections
import numpy as np

from cpjax import registry
from cpjax.data import (
  fingerprint,
  folder_source,
  image_stats,
  record_source,
  specs,
  splits,
  tfds_source,
)


class DataSource(Protocol):
  """The rows of one split (see the module docstring)."""
  ids: np.ndarray
  labels: np.ndarray
  encoded: bool

  def __len__(self) -> int: ...

  def take(self, rows: np.ndarray) -> "DataSource": ...

  def read(self, rows: np.ndarray) -> np.ndarray | list[bytes]: ...


class Relabelled:
  """`source` with other labels (by example id, `labels_by_id` [N]): label noise."""

  def __init__(self, source: DataSource, labels_by_id: np.ndarray):
    self.source, self._by_id = source, labels_by_id
    self.ids, self.encoded = source.ids, source.encoded
    self.labels = labels_by_id[source.ids]

  def __len__(self) -> int:
    return len(self.source)

  def take(self, rows: np.ndarray) -> "Relabelled":
    return Relabelled(self.source.take(rows), self._by_id)

  def where(self, row: int) -> str:
    return getattr(self.source, "where", str)(row)

  @property
  def on_damage(self) -> str:
    return getattr(self.source, "on_damage", "")

  def entry(self, row: int) -> tuple[str, int] | None:
    return self.source.entry(row) if hasattr(self.source, "entry") else None

  def read(self, rows: np.ndarray) -> np.ndarray | list[bytes]:
    return self.source.read(rows)


@dataclasses.dataclass(frozen=True)
class SourceKind:
  """A kind of dataset source: its facts from a dataset config, and its splits."""
  # The dataset name it opens ("folder"), or a prefix ending in ":" ("tfds:"): it opens
  # every name PREFIX:REST with a non-empty REST.
  name: str
  describe: Callable[[ml_collections.ConfigDict], specs.DatasetSpec]
  # (dataset config, its spec) -> {"train", and "val" / "test" where the dataset has them}.
  open: Callable[[ml_collections.ConfigDict, specs.DatasetSpec], dict[str, DataSource]]
  doc: str = ""  # One line: what it opens (the dataset name's valid choices show it).
  settings: tuple[registry.Setting, ...] = ()  # None: kinds read config.dataset's fields.
  # Opened by a dataset name (or prefix). False: not a dataset name, read in a named kind's
  # place (records: a source dataset's conversion, when dataset.stream_dir is set).
  named: bool = True

  def __post_init__(self):
    head, _, tail = self.name.partition(":")
    if not head or tail or self.name in specs.BUILTIN:
      raise ValueError(f"source kind name {self.name!r}: a dataset name that is not a built-in "
                       f"one ({', '.join(specs.BUILTIN)}) and has no ':', or a prefix ending "
                       "in its only ':' ('tfds:')")

  @property
  def pattern(self) -> str:
    """How a dataset name selects it: "folder", "tfds:NAME"."""
    return self.name + "NAME" if self.name.endswith(":") else self.name


def _folder_listing(dataset: ml_collections.ConfigDict, split: str) -> folder_source.Listing:
  return folder_source.listing(os.path.abspath(dataset.folder), split, dataset.check_files,
                               dataset.skip_bad_files)


def _folder_stats_key(root: str, train: folder_source.Listing) -> str:
  """The folder and its sampled files' paths, sizes and times: a folder replaced at the same
  path by as many other files does not reuse the old one's cached statistics."""
  sampled = fingerprint.stat_entries(os.path.join(root, "train"), [
      train.paths[int(row)] for row in image_stats.sample_rows(len(train.paths))])
  return f"{root}|{fingerprint.stat_digest(sampled)}"


def _describe_folder(dataset: ml_collections.ConfigDict) -> specs.DatasetSpec:
  if not dataset.folder:
    raise ValueError("dataset.name='folder' needs --config.dataset.folder=DIR "
                     "(DIR/train/<class>/<images>)")
  root = os.path.abspath(dataset.folder)
  classes = folder_source.class_names(root)
  present = folder_source.splits_present(root)
  train = _folder_listing(dataset, "train")
  for split in present[1:]:  # Named at start-up like train's bad files.
    _folder_listing(dataset, split)
  source = folder_source.FolderSource(train)
  size, channels = image_stats.size_and_channels(dataset, (), source, root)
  image_shape = (size, size, channels)
  mean, std = image_stats.channel_statistics(dataset, source, image_shape,
                                             key=_folder_stats_key(root, train))
  return specs.DatasetSpec("", image_shape, len(classes), len(train.paths), mean, std,
                           local=True, test_split="test" if "test" in present else "",
                           val_split="val" if "val" in present else "", encoded=True,
                           classes=tuple(folder_source.printable(name) for name in classes))


def _open_folder(dataset: ml_collections.ConfigDict, spec: specs.DatasetSpec
                 ) -> dict[str, DataSource]:
  names = ["train"] + [s for s in (spec.val_split, spec.test_split) if s]
  opened = {name: folder_source.FolderSource(_folder_listing(dataset, name)) for name in names}
  return {{"val": "val", "test": "test"}.get(name, name): source
          for name, source in opened.items()}


def _tfds_builder(dataset: ml_collections.ConfigDict):
  return tfds_source.builder(dataset.name[len("tfds:"):], dataset.data_dir, dataset.download,
                             dataset.manual_dir)


def _describe_tfds(dataset: ml_collections.ConfigDict) -> specs.DatasetSpec:
  found = _tfds_builder(dataset)
  info = found.info
  image_key, label_key = tfds_source.image_and_label_keys(info)
  roles = tfds_source.split_roles(info)
  train = tfds_source.TfdsSource(found, "train")
  size, channels = image_stats.size_and_channels(
      dataset, tuple(info.features[image_key].shape), train, f"{info.name}|{info.version}")
  mean, std = image_stats.channel_statistics(dataset, train, (size, size, channels),
                          key=f"{info.name}|{info.version}")
  return specs.DatasetSpec(info.name, (size, size, channels),
                           info.features[label_key].num_classes,
                           info.splits["train"].num_examples, mean, std, local=False,
                           test_split=roles["test"], val_split=roles["val"], encoded=True,
                           classes=tuple(info.features[label_key].names))


def _open_tfds(dataset: ml_collections.ConfigDict, spec: specs.DatasetSpec
               ) -> dict[str, DataSource]:
  found = _tfds_builder(dataset)
  out = {"train": tfds_source.TfdsSource(found, "train")}
  if spec.val_split:
    out["val"] = tfds_source.TfdsSource(found, spec.val_split)
  if spec.test_split:
    out["test"] = tfds_source.TfdsSource(found, spec.test_split)
  return out


def _stats_key(dataset: ml_collections.ConfigDict) -> str:
  """What the channel statistics' cache is keyed by: the folder, or the tfds name and
  version (the records keep their source's, so the two share a cache entry)."""
  if dataset.name == "folder":
    return _folder_stats_key(os.path.abspath(dataset.folder), _folder_listing(dataset, "train"))
  info = _tfds_builder(dataset).info
  return f"{info.name}|{info.version}"


def _source_shape(dataset: ml_collections.ConfigDict) -> tuple:
  """The source's own image shape, where it has one (a tfds feature's); () otherwise."""
  if dataset.name == "folder":
    return ()
  info = _tfds_builder(dataset).info
  return tuple(info.features[tfds_source.image_and_label_keys(info)[0]].shape)


def _describe_records(dataset: ml_collections.ConfigDict) -> specs.DatasetSpec:
  directory = os.path.abspath(dataset.stream_dir)
  facts = record_source.read_manifest(directory, dataset.name)
  record_source.check(directory, facts)
  if dataset.name == "folder" and dataset.folder and (
      os.path.abspath(dataset.folder) != facts["source"]):
    logging.warning("dataset.folder=%s is not read: the run reads %s, converted from %s.",
                    dataset.folder, directory, facts["source"])
  train = record_source.RecordSource(directory, "train")
  size, channels = image_stats.size_and_channels(dataset, tuple(facts["shape"]), train,
                                                 facts["stats_key"])
  mean, std = image_stats.channel_statistics(dataset, train, (size, size, channels),
                                             key=facts["stats_key"])
  roles = facts["splits"]
  return specs.DatasetSpec(facts["tfds_name"], (size, size, channels), len(facts["classes"]),
                           len(train), mean, std, local=dataset.name == "folder",
                           test_split="test" if "test" in roles else "",
                           val_split="val" if "val" in roles else "", encoded=True,
                           classes=tuple(facts["classes"]))


def _open_records(dataset: ml_collections.ConfigDict, spec: specs.DatasetSpec
                  ) -> dict[str, DataSource]:
  directory = os.path.abspath(dataset.stream_dir)
  names = ["train"] + [s for s in (spec.val_split, spec.test_split) if s]
  return {name: record_source.RecordSource(directory, name) for name in names}


# Source kinds by name ("folder") or name prefix ("tfds:"). A new kind is one registration
# and a module with its source class (docs/extending.md#add-a-dataset-source).
KINDS: registry.Registry[SourceKind] = registry.Registry("dataset source kind", "dataset")
KINDS.register(SourceKind("folder", _describe_folder, _open_folder,
                          "with dataset.folder=DIR"))
KINDS.register(SourceKind("tfds:", _describe_tfds, _open_tfds,
                          "any tfds image-classification dataset"))
# A folder or tfds:NAME dataset's converted records, read in the source's place
# (`reads_records`).
KINDS.register(SourceKind("records", _describe_records, _open_records,
                          "a source dataset's converted records (dataset.stream_dir)",
                          named=False))


def kind_of(name: str) -> SourceKind | None:
  """The source kind that opens dataset `name`: the kind registered under `name`, else the
  one registered under its prefix "PREFIX:" (with a non-empty rest); None for another name
  (a built-in dataset's, or that of a kind named by no dataset: records)."""
  if not isinstance(name, str):
    return None
  prefix, colon, rest = name.partition(":")
  if colon:
    kind = KINDS.get(prefix + colon) if rest else None
  else:
    kind = KINDS.get(name)
  return kind if kind is not None and kind.named else None


def is_source_name(name: str) -> bool:
  """Whether dataset `name` is opened by a registered source kind (`kind_of`)."""
  return kind_of(name) is not None


def reads_records(dataset: ml_collections.ConfigDict) -> bool:
  """Whether a source dataset's run reads its converted records (dataset.stream_dir set,
  dataset.reader auto or stream) rather than the source itself."""
  return (is_source_name(dataset.name) and bool(dataset.stream_dir)
          and dataset.reader in ("auto", "stream"))


def read_from(dataset: ml_collections.ConfigDict) -> str:
  """Where a source dataset's run reads its rows, in words (the readers' log line)."""
  return (f"its encoded records in {dataset.stream_dir}" if reads_records(dataset)
          else "the source")


def _kind(dataset: ml_collections.ConfigDict) -> SourceKind | None:
  return KINDS["records"] if reads_records(dataset) else kind_of(dataset.name)


def write_records(dataset: ml_collections.ConfigDict, directory: str, num_shards: int = 4
                  ) -> dict[str, int]:
  """Converts source dataset `dataset` (folder, tfds:NAME; read as configured) into encoded
  records in `directory` (cpjax.data.record_source); returns {split: rows written}."""
  kind = kind_of(dataset.name)
  if kind is None:
    raise ValueError(f"dataset.name={dataset.name!r} is a built-in dataset: its records hold "
                     "raw pixels (array_records.write_splits); encoded records are written "
                     "for folder and tfds:NAME datasets")
  spec = kind.describe(dataset)
  opened = kind.open(dataset, spec)
  record_source.clear_manifest(directory)
  written = {}
  for split, source in opened.items():
    record_source.write_split(source, directory, split, dataset.name, num_shards)
    written[split] = len(source)
  source = (os.path.abspath(dataset.folder) if dataset.name == "folder"
            else f"tfds {spec.tfds_name} in {_tfds_builder(dataset).data_dir}")
  record_source.write_manifest(directory, {
      "name": dataset.name, "source": source, "tfds_name": spec.tfds_name,
      "classes": list(spec.classes), "splits": list(opened), "shape": list(
          _source_shape(dataset)), "stats_key": _stats_key(dataset),
      "bad_files": bad_files(dataset)})
  return written


def resolve(dataset: ml_collections.ConfigDict) -> specs.DatasetSpec:
  """The facts of `dataset` (config.dataset): a built-in's from specs, a source dataset's
  read from its files and registered under its name (specs.register).

  Raises:
    ValueError, FileNotFoundError: the source cannot be read as configured (named).
  """
  kind = _kind(dataset)
  if kind is None:
    return specs.DATASETS[dataset.name]
  return specs.register(dataset.name, kind.describe(dataset))


def open_splits(dataset: ml_collections.ConfigDict) -> dict[str, DataSource]:
  """{"train", "val", "test"} sources of a resolved source dataset, and "meta_val" with a
  meta_val_size: the run's carve-outs (cpjax.data.splits.split_ids) of its splits."""
  spec = specs.DATASETS[dataset.name]
  opened = _kind(dataset).open(dataset, spec)
  ids = splits.split_ids(dataset)
  train = opened["train"]  # Its rows are its ids 0..N-1.
  if dataset.label_noise:  # Generated noise on real images, drawn as for in-memory splits.
    train = Relabelled(train, splits.noisy_labels(
        train.labels, ids["pool"], dataset.label_noise, dataset.label_noise_seed,
        spec.num_classes))
  out = {"train": train.take(ids["train"]),
         "val": opened["val"] if spec.val_split else train.take(ids["val"]),
         "test": opened["test"] if spec.test_split else train.take(ids["test"])}
  if len(ids["meta_val"]):
    out["meta_val"] = train.take(ids["meta_val"])
  return out


def bad_files(dataset: ml_collections.ConfigDict) -> list[str]:
  """The files a folder dataset left out (skip_bad_files), each with its problem (those its
  converted records' source left out, when it reads records)."""
  if reads_records(dataset):
    return record_source.read_manifest(os.path.abspath(dataset.stream_dir),
                                       dataset.name)["bad_files"]
  if dataset.name != "folder":
    return []
  root = os.path.abspath(dataset.folder)
  return [f"{os.path.join(root, split, path)}\t{problem}"
          for split in folder_source.splits_present(root)
          for path, problem in _folder_listing(dataset, split).bad]


def identity(dataset: ml_collections.ConfigDict,
             known: dict[str, list[fingerprint.Entry]] | None = None
             ) -> fingerprint.Identity | None:
  """The identity of a folder dataset's rows (cpjax.data.fingerprint), read from its folder
  (each file's digest taken from `known`, the workdir's listing, where its size and time are
  unchanged) or from its converted records; None for every other dataset (a built-in's or a
  tfds dataset's version does not change under a run)."""
  if reads_records(dataset):
    return record_source.identity(os.path.abspath(dataset.stream_dir))
  if dataset.name != "folder":
    return None
  root = os.path.abspath(dataset.folder)
  listing = {}
  for split in folder_source.splits_present(root):
    paths = _folder_listing(dataset, split).paths
    listing[split] = fingerprint.file_entries(os.path.join(root, split),
                                              [paths[row] for row in range(len(paths))],
                                              (known or {}).get(split, ()))
  return fingerprint.Identity(
      listing, f"the files of dataset.folder={folder_source.printable(root)!r}",
      "put the files back as they were (a file this run found damaged: a readable copy of "
      "it)")


def name_problem(name) -> str | None:
  """config.dataset.name's check: a built-in dataset, or a name a registered source kind
  opens ("folder", "tfds:NAME")."""
  if name in specs.BUILTIN or is_source_name(name):
    return None
  named = [kind for kind in KINDS.entries() if kind.named]
  kinds = " or ".join(f"{kind.pattern} ({kind.doc})" if kind.doc else kind.pattern
                      for kind in named)
  names = [*specs.BUILTIN, *(kind.name for kind in named)]
  return (f"got {name!r}; {registry.did_you_mean(name, names)}valid choices: "
          f"{', '.join(sorted(specs.BUILTIN))}, {kinds}")
