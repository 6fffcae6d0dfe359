"""Study: does entropy selection beat random subsets on Fashion-MNIST?

CE, FLSD-53 and mixup (alpha 0.15), each on full data and on 30 % / 10 %
subsets chosen by max normalised entropy (train-pass scores, the reference) or
uniformly at random per epoch, over 3 seeds: 45 runs of
configs/fashion_mnist_study.py.

  python -m studies.prioritization --out=studies/out/prioritization
"""

import argparse

from configs import fashion_mnist_study
from studies import grid

LOSSES = {"ce": {"loss.name": "cross_entropy"}, "flsd53": {"loss.name": "flsd53"},
          "mixup": {"loss.name": "cross_entropy", "loss.mixup_alpha": 0.15}}


def cells():
  out = []
  for loss, loss_overrides in LOSSES.items():
    out.append((f"{loss}-full", dict(loss_overrides)))
    for fraction in (0.3, 0.1):
      for method, name in (("top_k", "entropy"), ("random", "random")):
        out.append((f"{loss}-{int(fraction * 100)}pct-{name}",
                    {**loss_overrides, "selection.method": method,
                     "selection.fraction": fraction}))
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default="studies/out/prioritization")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  args = parser.parse_args()
  grid.run_grid(fashion_mnist_study.get_config(), cells(), args.seeds, args.out,
                "Prioritization on Fashion-MNIST (ResNet-20, 5,000 train images, 6 epochs, "
                "2 warm-up)")


if __name__ == "__main__":
  main()
