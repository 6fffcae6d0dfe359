"""Data: dataset facts, tfds reading, splits with stable ids, batches, augmentation."""
