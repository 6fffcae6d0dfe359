"""Static facts about each dataset cpjax knows, known before any data is read.

The registry `DATASETS` (a cpjax.registry.Registry of `DatasetSpec` entries) is what config
validation, the steps (normalisation statistics) and the readers consult; nothing here reads
files or imports tfds.

Built-in datasets are listed here. A dataset opened by a source kind (cpjax.data.sources
.KINDS: a folder of images, `folder`; any tfds image-classification dataset, `tfds:NAME`;
a user's own kind) has facts that only its files know (classes, sizes, statistics):
`cpjax.data.sources.resolve` reads them once at start-up and `register`s them under the
dataset's name, after which every layer reads them from `DATASETS` as it reads a built-in's.
"""

import dataclasses

from cpjax import registry


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """Static facts about a dataset, known before any data is read."""
  tfds_name: str
  image_shape: tuple[int, int, int]
  num_classes: int
  num_train: int  # Size of the full tfds `train` split.
  mean: tuple[float, ...]  # Per-channel mean of pixel values scaled to [0, 1].
  std: tuple[float, ...]  # Per-channel standard deviation, same scale.
  local: bool  # Built by a cpjax builder from local files: never downloads.
  test_split: str = "test"  # "": the dataset has none; test examples are carved from train.
  val_split: str = ""  # A split that holds validation; "": carved from train (val_size).
  # Its images are encoded files of any size (folder, tfds:NAME), never held in memory as
  # pixels: each batch's are decoded, cropped and flipped to `image_shape` as they are read,
  # on the host or on the devices (dataset.decode; cpjax.data.readers).
  encoded: bool = False
  classes: tuple[str, ...] = ()  # Class names in label order, where the dataset has them.
  # Its entry in DATASETS: the dataset's name (config.dataset.name; a source kind's `describe`
  # leaves it "": `register` sets it), a one-line doc and no settings of its own.
  name: str = ""
  doc: str = ""
  settings: tuple[registry.Setting, ...] = ()


DATASETS: registry.Registry[DatasetSpec] = registry.Registry(
    "dataset", "dataset", hint="or a source dataset (folder, tfds:NAME) once cpjax.data.sources"
    ".resolve(config.dataset) has registered it (config validation does that)")


def register(name: str, spec: DatasetSpec) -> DatasetSpec:
  """Records the facts of source dataset `name` (replacing any earlier ones: a process that
  opens another folder under the same name reads the new folder's facts) and returns them as
  registered; a built-in dataset's facts are fixed."""
  if name in BUILTIN:
    raise ValueError(f"{name!r} is a built-in dataset: its facts are fixed, not registered")
  if name in DATASETS:
    DATASETS.unregister(name)
  return DATASETS.register(dataclasses.replace(spec, name=name))


_BUILTIN_SPECS = {
    # Mean/std of the 1,437 training images (`python -m cpjax.data.input_pipeline digits`).
    "digits": DatasetSpec("digits", (8, 8, 1), 10, 1437, (0.3054,), (0.3762,), local=True),
    "fashion_mnist": DatasetSpec("fashion_mnist_local", (28, 28, 1), 10, 60000,
                                 (0.2860,), (0.3530,), local=True),
    # tfds's own builder: needs the network once (config.dataset.download=True).
    "fashion_mnist_tfds": DatasetSpec("fashion_mnist", (28, 28, 1), 10, 60000,
                                      (0.2860,), (0.3530,), local=False),
    # The CIFAR statistics of Tata et al. 2022's code
    # (docs/methods.md#data-splits-and-architectures).
    "cifar10": DatasetSpec("cifar10", (32, 32, 3), 10, 50000, (0.4914, 0.4822, 0.4465),
                           (0.2023, 0.1994, 0.2010), local=False),
    "cifar100": DatasetSpec("cifar100", (32, 32, 3), 100, 50000, (0.5071, 0.4865, 0.4409),
                            (0.2673, 0.2564, 0.2762), local=False),
    "svhn": DatasetSpec("svhn_cropped", (32, 32, 3), 10, 73257, (0.4377, 0.4438, 0.4728),
                        (0.1980, 0.2010, 0.1970), local=False),
}
for _name, _spec in _BUILTIN_SPECS.items():
  DATASETS.register(dataclasses.replace(_spec, name=_name))
BUILTIN = tuple(DATASETS)  # The built-in names (config choices besides source names).
