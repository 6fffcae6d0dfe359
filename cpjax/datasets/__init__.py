"""tfds dataset builders that cpjax owns: real data that works with no network.

Importing this package registers the builders with tfds (`digits`,
`fashion_mnist_local`). It imports tensorflow_datasets, so only the input
pipeline (an I/O edge) imports it.
"""

from cpjax.datasets.digits import Digits
from cpjax.datasets.fashion_mnist_local import FashionMnistLocal

__all__ = ["Digits", "FashionMnistLocal"]
