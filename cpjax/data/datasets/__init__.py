"""tfds dataset builders that cpjax owns: real data that works with no network.

Importing this package registers the builders with tfds (`digits`,
`fashion_mnist_local`). It imports tensorflow_datasets, so only the tfds edge of
the input pipeline (`cpjax.data.input_pipeline`) imports it.
"""

from cpjax.data.datasets.digits import Digits
from cpjax.data.datasets.fashion_mnist_local import FashionMnistLocal

__all__ = ["Digits", "FashionMnistLocal"]
