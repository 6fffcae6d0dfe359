"""Makes TensorFlow absent for a process started with this folder first on PYTHONPATH.

Python imports `sitecustomize` at start-up; this one takes every `tensorflow` module out of
the path finder's reach, so `import tensorflow` raises ModuleNotFoundError and
`importlib.util.find_spec("tensorflow")` is None, as on a GPU or TPU image without it
(tests/test_without_tensorflow.py). Nothing else changes.
"""

import importlib.machinery
import sys


class _WithoutTensorFlow(importlib.machinery.PathFinder):
  """The path finder, blind to `tensorflow` and its submodules."""

  @classmethod
  def find_spec(cls, fullname, path=None, target=None):
    if fullname.split(".")[0] == "tensorflow":
      return None
    return super().find_spec(fullname, path, target)


sys.meta_path[:] = [_WithoutTensorFlow if finder is importlib.machinery.PathFinder else finder
                    for finder in sys.meta_path]
