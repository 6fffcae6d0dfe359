"""Corrupted copies of a test set, for OOD evaluation when no second dataset exists.

Gaussian noise as in CIFAR-10-C (Hendrycks & Dietterich 2019,
`make_cifar_c.py`): x in [0, 1], x + N(0, c^2) clipped to [0, 1], with
c = 0.04, 0.06, 0.08, 0.09, 0.10 for severities 1..5, stored as uint8.
"""

import numpy as np

GAUSSIAN_NOISE_SCALES = (0.04, 0.06, 0.08, 0.09, 0.10)


def gaussian_noise(images: np.ndarray, severity: int, seed: int = 0) -> np.ndarray:
  """uint8 images [N, H, W, C] with CIFAR-10-C Gaussian noise of `severity` (1..5)."""
  if severity not in range(1, len(GAUSSIAN_NOISE_SCALES) + 1):
    raise ValueError(f"severity={severity}; valid choices: 1, 2, 3, 4, 5")
  x = np.asarray(images, np.float64) / 255.0
  noise = np.random.default_rng(seed).normal(size=x.shape,
                                             scale=GAUSSIAN_NOISE_SCALES[severity - 1])
  return np.round(np.clip(x + noise, 0.0, 1.0) * 255.0).astype(np.uint8)
