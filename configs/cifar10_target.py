"""Tata et al. 2022's CIFAR-10 target model: ResNet-50 + mixup (alpha 0.3) on full data.

Records every training image's train-pass entropy each epoch in
workdir/scores/, which a run with --config.selection.target_workdir=THIS_WORKDIR
--config.selection.scoring=target_recorded uses to choose its subsets
(docs/methods.md#calibration-guided-sample-prioritization;
"Can Calibration Improve Sample Prioritization?", NeurIPS HITY workshop).
"""

import ml_collections

from configs import cifar10


def get_config() -> ml_collections.ConfigDict:
  """Returns the CIFAR-10 target configuration."""
  config = cifar10.get_config()
  config.model.name = "resnet50"  # Tata et al.'s target architecture.
  config.loss.mixup_alpha = 0.3  # Tata et al.'s target: mixup alpha 0.3 on CIFAR-10.
  config.selection.method = "full"  # The target trains on all data...
  config.selection.record_scores = True  # ...and records its scores every epoch.
  return config
