"""Writes a dataset config's splits as array_record files for `dataset.reader=stream`.

  python -m scripts.write_array_records --config=configs/fashion_mnist.py --out=/data/fm_stream
  python main.py --config=configs/fashion_mnist.py --workdir=workdir/fm_stream \\
      --config.dataset.reader=stream --config.dataset.stream_dir=/data/fm_stream

A built-in dataset's files hold raw pixels of the splits of this config's dataset fields
(validation carve-out, meta-validation, train_examples): a run with other split fields
refuses them. This command reads such splits through cpjax's loader, in memory; for a set
larger than memory, feed `cpjax.data.array_records.write_split` an iterator over its
examples instead.

A folder or tfds:NAME dataset is converted whole, streaming, into records of each image's
encoded file bytes (about the size of the source files), its ids and labels; any split
fields can then be used with them (the carve-outs are taken at run time):

  python -m scripts.write_array_records --config=configs/imagenet.py \\
      --config.dataset.name=folder --config.dataset.folder=DIR --out=/data/in1k_records
  python main.py --config=configs/imagenet.py --workdir=workdir/in1k \\
      --config.dataset.name=folder --config.dataset.stream_dir=/data/in1k_records
"""

import os

from absl import app, flags
from ml_collections import config_flags

from cpjax.data import array_records, input_pipeline, sources

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_string("out", None, "Directory for the array_record files.")
flags.DEFINE_integer("num_shards", 4, "Files per split.")
flags.mark_flags_as_required(["config", "out"])


def directory_bytes(directory: str) -> int:
  """Bytes of the files under `directory`."""
  return sum(os.path.getsize(os.path.join(parent, f))
             for parent, _, files in os.walk(directory) for f in files)


def main(argv):
  del argv
  dataset = FLAGS.config.dataset
  if sources.is_source_name(dataset.name):
    written = sources.write_records(dataset, FLAGS.out, FLAGS.num_shards)
    for name, count in written.items():
      print(f"{name}: {count} encoded examples -> {FLAGS.out}/{name}.array_record-*")
    print(f"records: {directory_bytes(FLAGS.out)} bytes")
    return
  split_by_name = input_pipeline.get_datasets(dataset)
  array_records.write_splits(split_by_name, FLAGS.out, dataset, FLAGS.num_shards)
  for name, split in split_by_name.items():
    print(f"{name}: {len(split)} examples -> {FLAGS.out}/{name}.array_record-*")


if __name__ == "__main__":
  app.run(main)
