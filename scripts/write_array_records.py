"""Writes a dataset config's splits as array_record files for `dataset.reader=stream`.

  python -m scripts.write_array_records --config=configs/fashion_mnist.py --out=/data/fm_stream
  python main.py --config=configs/fashion_mnist.py --workdir=workdir/fm_stream \\
      --config.dataset.reader=stream --config.dataset.stream_dir=/data/fm_stream

The files hold the splits of this config's dataset fields (validation carve-out,
meta-validation, train_examples): a run with other split fields refuses them. This
command reads the splits through cpjax's loader, in memory; for a set larger than
memory, feed `cpjax.data.array_records.write_split` an iterator over its examples
(e.g. a tfds dataset) instead.
"""

from absl import app, flags
from ml_collections import config_flags

from cpjax.data import array_records, input_pipeline

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Path to a config file.", lock_config=True)
flags.DEFINE_string("out", None, "Directory for the array_record files.")
flags.DEFINE_integer("num_shards", 4, "Files per split.")
flags.mark_flags_as_required(["config", "out"])


def main(argv):
  del argv
  dataset = FLAGS.config.dataset
  split_by_name = input_pipeline.get_datasets(dataset)
  array_records.write_splits(split_by_name, FLAGS.out, dataset, FLAGS.num_shards)
  for name, split in split_by_name.items():
    print(f"{name}: {len(split)} examples -> {FLAGS.out}/{name}.array_record-*")


if __name__ == "__main__":
  app.run(main)
