"""Tiny configuration for tests and smoke runs: seconds on a CPU."""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  """Returns the tiny test configuration (digits, tiny net, 2 epochs)."""
  config = default.get_config()
  config.model.name = "tiny"  # Two conv layers: compiles and runs in seconds.
  config.num_epochs = 2  # Two epochs: enough to test resume and evaluation.
  config.batch_size = 64  # Divides every forced CPU device count used in tests.
  config.eval_batch_size = 128  # Several eval batches, the last one padded.
  config.log_every_steps = 5  # Exercise the periodic progress report.
  config.evaluation.bootstrap_resamples = 100  # Enough to test intervals, fast.
  return config
