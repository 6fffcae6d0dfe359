"""The bare flax train step's images/s (benchmarks.gpu_table's), as a command of its own.

  python -m benchmarks.bare_step --model=resnet50_imagenet --image-size=224 --batch-size=256 \\
      --classes=1000 --json=bare.json
  python -m benchmarks.bare_step --tiny --json=bare.json   # the tiny net, gpu_table's tiny timing

Normalise, forward, cross-entropy, backward, SGD with momentum, bfloat16 compute, on one
random batch already on the device: the rate a trainer's epoch is compared with
(benchmarks.gpu_runs runs it in its own process, so that its GPU memory is not the trainer's).
Imports no TensorFlow, tensorflow_datasets or clu.
"""

import argparse
import json

from benchmarks import gpu_table
from cpjax import models


def main(argv: list[str] | None = None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", default="resnet50_imagenet", choices=sorted(models.MODELS))
  parser.add_argument("--image-size", type=int, default=224)
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--classes", type=int, default=1000)
  parser.add_argument("--tiny", action="store_true",
                      help="gpu_table's tiny timing (a window of a few steps: a CPU test).")
  parser.add_argument("--json", default="", help="Also write the row here.")
  args = parser.parse_args(argv)
  timing = gpu_table.TINY if args.tiny else gpu_table.Sizes()
  row = gpu_table.bare_train(args.model, args.classes, args.image_size, args.batch_size, timing)
  row.update(model=args.model, image_size=args.image_size, batch=args.batch_size,
             classes=args.classes)
  print(f"bare flax train step, {args.model} {args.image_size} px, batch {args.batch_size}: "
        f"{row['images_per_s']:,.0f} images/s (first call {row['first_call_seconds']:.1f} s)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(row, f, indent=1)
  return row


if __name__ == "__main__":
  main()
