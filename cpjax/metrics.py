"""Evaluation metrics on host arrays: pure NumPy functions, float64 inside.

Inputs are logits [N, K] and integer labels [N]; results are fractions.
"""

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
  """Row-wise log-softmax in float64."""
  z = np.asarray(logits, np.float64)
  z = z - z.max(axis=-1, keepdims=True)
  return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
  """Top-1 accuracy: mean of 1[argmax_k z_ik = y_i]."""
  return float(np.mean(np.argmax(logits, axis=-1) == labels))


def nll(logits: np.ndarray, labels: np.ndarray) -> float:
  """Mean negative log-likelihood: mean_i -log softmax(z_i)[y_i] (spec §3.5)."""
  return float(-np.mean(log_softmax(logits)[np.arange(len(labels)), labels]))
