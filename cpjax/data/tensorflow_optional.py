"""TensorFlow is optional: only building a tfds catalog dataset and reading one stored as
tfrecord files need it (tfds encodes images and reads tfrecords with it), as do the tf.data
rows of the benchmarks. Training, evaluation, the report and TensorBoard events do not.

Where it is needed and absent, the error is one line saying what to install.
"""

import importlib.util

INSTALL = "pip install -r requirements-tf.txt (or: pip install 'cpjax[tf]')"


def installed() -> bool:
  """Whether `import tensorflow` would find a package (without importing it: ~2 s)."""
  return importlib.util.find_spec("tensorflow") is not None


def missing_message(what: str) -> str:
  """The line for `what` ("reading tfds dataset 'cifar10' (tfrecord files)") without TF."""
  return f"{what} needs TensorFlow, which is not installed here: {INSTALL}"


def preparing_note() -> str:
  """What an unprepared tfds dataset's message adds where TensorFlow is absent (tfds encodes
  the images with it while preparing: a download, a manual_dir): "" where it is installed."""
  if installed():
    return ""
  return f"; preparing it here needs TensorFlow, which is not installed: {INSTALL}"
