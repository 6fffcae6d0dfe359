"""CPU-sized prioritization study on real Fashion-MNIST (studies/prioritization.py).

ResNet-20 on a seeded 5,000-image subset of the training split, 6 epochs with
2 warm-up epochs on all data, evaluated once at the end. Small enough that the
45-run grid (3 losses x 5 data regimes x 3 seeds) fits in about an hour on 2
CPU cores; on a GPU, raise train_examples, num_epochs and warmup_epochs.
"""

import ml_collections

from configs import fashion_mnist


def get_config() -> ml_collections.ConfigDict:
  """Returns the study's base configuration (full data, cross-entropy)."""
  config = fashion_mnist.get_config()
  config.dataset.val_size = 1000  # Enough to fit the temperature; small to keep eval cheap.
  config.dataset.train_examples = 5000  # Seeded subset of the 59,000 remaining images.
  config.num_epochs = 6  # Short CPU schedule (Tata et al.: 200).
  config.batch_size = 128  # 40 steps per full epoch.
  config.selection.warmup_epochs = 2  # Full-data epochs before selection (Tata et al.: 10 of 200).
  config.eval_every_epochs = 6  # Evaluate only at the end.
  config.checkpoint_every_epochs = 6  # One checkpoint, at the end.
  config.log_every_steps = 20  # 40 steps per full epoch.
  config.evaluation.ood = ""  # No OOD pass: the study reports accuracy and ECE.
  config.evaluation.bootstrap_resamples = 200  # Intervals are not aggregated here.
  return config
