"""Study: test accuracy and ECE of each calibration loss on the default job.

configs/default.py (digits, ResNet-18, 8 epochs) once per loss, seed 0:

  python -m studies.losses --out=studies/out/losses
"""

import argparse

from configs import default
from studies import grid

CELLS = [
    ("cross_entropy", {"loss.name": "cross_entropy"}),
    ("label_smoothing", {"loss.name": "label_smoothing"}),
    ("mixup", {"loss.name": "cross_entropy", "loss.mixup_alpha": 0.2}),
    ("focal", {"loss.name": "focal"}),
    ("flsd53", {"loss.name": "flsd53"}),
    ("mbls", {"loss.name": "mbls"}),
    ("brier", {"loss.name": "brier"}),
    ("mmce", {"loss.name": "mmce"}),
]


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="studies/out/losses")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  args = parser.parse_args()
  base = default.get_config()
  base.evaluation.ood = ""  # Accuracy and ECE only.
  grid.run_grid(base, CELLS, args.seeds, args.out,
                "Calibration losses on digits (configs/default.py: ResNet-18, 8 epochs)")


if __name__ == "__main__":
  main()
