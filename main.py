"""Trains and evaluates a cpjax config: the command-line entry point.

  python main.py --config=configs/default.py --workdir=/tmp/cpjax
  python main.py --config=configs/default.py --workdir=/tmp/cpjax \
      --config.loss.name=cross_entropy --config.num_epochs=5
  python main.py --config=configs/default.py --workdir=/tmp/cpjax --mode=evaluate

Rerunning the same command resumes from the latest checkpoint in --workdir.
On a cluster, jax.distributed is started first (see cpjax/distributed.py).
"""

import logging as std_logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF (used by clu writers) is chatty.

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from cpjax.runtime import distributed
from cpjax import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and metrics.")
flags.DEFINE_enum("mode", "train", ["train", "evaluate"],
                  "train (resumes if --workdir has checkpoints), or evaluate: write "
                  "--workdir/report for the latest checkpoint without training.")
flags.DEFINE_string("coordinator_address", None,
                    "host:port of process 0, for clusters jax cannot auto-detect.")
flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # orbax logs every save step at INFO; keep its warnings, drop the rest.
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname)
  distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  logging.info("JAX process %d / %d; local devices: %s", jax.process_index(),
               jax.process_count(), jax.local_devices())
  if FLAGS.mode == "train":
    train.train_and_evaluate(FLAGS.config, FLAGS.workdir)
  else:
    train.evaluate_only(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
  jax.config.config_with_absl()
  app.run(main)
