"""ImageNet-1k (ILSVRC 2012) with ResNet-50 at 224 px: the standard large-batch recipe.

Goyal et al. 2017 ("Accurate, Large Minibatch SGD") as flax's examples/imagenet and the
InfoBatch paper (Qin et al. 2024) train it: SGD with Nesterov momentum 0.9, learning rate
0.1 x batch / 256 = 0.4 for the global batch of 1024, a linear warm-up over 5 epochs, then a
cosine to 0 (per step), weight decay 1e-4, 90 epochs (Goyal et al.'s and torchvision's
reference length; flax's example trains 100, and 90 is where the cosine recipe's top-1
of ~76-77 % is usually reported). Data: tfds's `imagenet2012` (train: 1,281,167 images;
its 50,000-image validation split is the report's test set, as papers report it; 10,000
training images are carved out as the validation set that temperature scaling and the
post-hoc maps fit on). Training images: Inception-style random-resized crop (area 8-100 %,
aspect 3/4-4/3) to 224 and a flip; evaluation and scoring: shorter side to 256, centre 224
(cpjax.data.preprocess), decoded on the host by every core.

Prepare once (docs/data.md#imagenet), then:

  python main.py --config=configs/imagenet.py --workdir=workdir/in1k \\
      --config.dataset.data_dir=/data/tensorflow_datasets
  # or a folder of JPEGs: DIR/train/<wnid>/*.JPEG and the official validation images as
  # DIR/test/<wnid>/*.JPEG (a val/ folder would be the validation set instead)
  python main.py --config=configs/imagenet.py --workdir=workdir/in1k \\
      --config.dataset.name=folder --config.dataset.folder=/data/imagenet

Selection (docs/selection.md):

  # Tata et al. 2022's top-k entropy: half of the examples per epoch after 10 warm-up epochs
  python main.py --config=configs/imagenet.py --workdir=workdir/in1k_top50 \\
      --config.selection.method=top_k --config.selection.fraction=0.5 \\
      --config.selection.warmup_epochs=10
  # InfoBatch (Qin et al. 2024; prune r = 0.5 of the below-mean-loss examples, the last
  # 12.5 % of epochs on all data): epochs of drawn size need per-epoch schedule units
  python main.py --config=configs/imagenet.py --workdir=workdir/in1k_infobatch \\
      --config.selection.method=infobatch --config.optimizer.schedule_unit=epoch

The model `resnet50_imagenet` is the ImageNet ResNet-50 (7x7 stem, max-pool, 4 stages of
bottlenecks), computed in bfloat16 as flax's example does on accelerators.
"""

import ml_collections

from configs import default


def get_config() -> ml_collections.ConfigDict:
  """Returns the ImageNet ResNet-50 configuration."""
  config = default.get_config()
  config.dataset.name = "tfds:imagenet2012"  # Or "folder" with dataset.folder.
  config.dataset.val_size = 10000  # Carved from train: temperature scaling and post-hoc maps.
  config.dataset.image_size = 224
  config.dataset.channels = 3
  config.dataset.train_crop = "random_resized"
  config.dataset.crop_scale = (0.08, 1.0)  # Szegedy et al. 2015's Inception crop.
  config.dataset.crop_ratio = (3 / 4, 4 / 3)
  config.dataset.flip = True
  config.dataset.crop_padding = 0  # No pad-crop on the device: the host crops.
  config.dataset.eval_crop_fraction = 0.875  # 256 -> centre 224.
  config.dataset.mean = (0.485, 0.456, 0.406)  # The usual ImageNet statistics (flax, torchvision).
  config.dataset.std = (0.229, 0.224, 0.225)
  config.dataset.prefetch_depth = 2

  config.model.name = "resnet50_imagenet"
  config.model.dtype = "bfloat16"

  config.optimizer.learning_rate = 0.1 * 1024 / 256  # Linear scaling rule: 0.4.
  config.optimizer.momentum = 0.9
  config.optimizer.nesterov = True  # As flax's example.
  config.optimizer.weight_decay = 1e-4
  config.optimizer.schedule = "cosine"
  config.optimizer.schedule_unit = "step"  # Warm-up and cosine change at every step.
  config.optimizer.warmup_epochs = 5.0

  config.selection.warmup_epochs = 10  # Used only when a selection method is set.
  config.selection.score_batch_size = 1024

  config.evaluation.ood = ""  # gaussian_noise needs the test images in memory.

  config.num_epochs = 90
  config.batch_size = 1024
  config.eval_batch_size = 1024
  config.log_every_steps = 100  # 1,242 steps per epoch.
  return config
