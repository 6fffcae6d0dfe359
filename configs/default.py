"""Default job: ResNet-18 with cross-entropy on the bundled handwritten digits.

Runs offline on a fresh machine (the data ships with scikit-learn) in a few
minutes on 2 CPU cores. Every other config starts from this one.
"""

import ml_collections
from ml_collections import config_dict

from cpjax.calibration import conformal, losses
from cpjax.selection import policies, scores


def get_config() -> ml_collections.ConfigDict:
  """Returns the default configuration."""
  config = ml_collections.ConfigDict()
  config.seed = 0  # Root seed: model init, data order, augmentation, mixup.
  # Modules to import at start-up, before the config is validated, comma-separated
  # ("mypkg.extras,my_sources"): a user's own registered policies, scores, losses, models,
  # source kinds, training crops or post-hoc maps (docs/extending.md). "" = none.
  config.import_modules = ""

  config.dataset = ml_collections.ConfigDict()
  # One of cpjax.data.specs.DATASETS, or a name a source kind opens (cpjax.data.sources
  # .KINDS): "folder" (dataset.folder) or "tfds:NAME" (any tfds image-classification
  # dataset), docs/data.md.
  config.dataset.name = "digits"
  config.dataset.data_dir = ""  # tfds data dir; "" = ~/tensorflow_datasets.
  config.dataset.manual_dir = ""  # Raw files for local builders; "" = builder default.
  config.dataset.download = False  # Let tfds download missing built-in data (needs network).
  config.dataset.val_size = 180  # Examples carved out of the train split for validation.
  config.dataset.split_seed = 42  # Seed of the train/validation carve-out (fixed per study).
  config.dataset.train_examples = 0  # Train on a seeded subset of this many examples; 0 = all.
  # Examples carved out of the training split (disjoint from val and test) for the held-out
  # meta-validation batches of the flgamma_* losses; 0 = none (every other loss). Left at 0
  # with an flgamma_* loss, main.py sets a tenth of the rows left after validation (>= a batch).
  config.dataset.meta_val_size = 0
  # Share of the training labels flipped uniformly to another class (generated symmetric
  # noise on the real images, seeded by label_noise_seed); validation and test stay clean.
  config.dataset.label_noise = 0.0
  config.dataset.label_noise_seed = 0  # Seed of which labels flip and to what.
  # A seeded share of the training rows held out (RHO-LOSS's irreducible-loss holdout):
  # train_part="holdout" trains on it (the target), "rest" on the other rows (the selecting
  # run), "all" ignores it (then holdout_fraction must be 0).
  config.dataset.holdout_fraction = 0.0
  config.dataset.train_part = "all"
  # How batches reach the devices (cpjax.data.readers): device (the splits live on every
  # device, batches gathered there from int32 row indices), host (gathered in host memory,
  # images sent per batch), stream (read by index from array_record files in stream_dir, each
  # process its own rows, read ahead by grain), or auto: stream when stream_dir is set and the
  # training split exceeds host_memory_mb, else device when the splits fit device_memory_mb
  # per device, else host. A folder or tfds:NAME dataset takes auto, host or stream: its
  # encoded records in stream_dir when set (auto, stream), else the source itself (auto, host).
  config.dataset.reader = "auto"
  config.dataset.device_memory_mb = 1024.0
  config.dataset.host_memory_mb = 16384.0
  # scripts/write_array_records.py's output for this dataset: raw pixels of a built-in
  # dataset's splits, or a folder's / tfds:NAME dataset's encoded images ("" = none).
  config.dataset.stream_dir = ""
  # host and stream readers: global batches put on the devices by a background thread ahead
  # of the step (0 = none, each batch made when the step asks for it).
  config.dataset.prefetch_depth = 2
  config.dataset.crop_padding = 1  # Random-crop zero padding in pixels (0 = no crop).
  config.dataset.flip = False  # Random horizontal flips (off: digits are not mirror-symmetric).
  # Source datasets (folder, tfds:NAME): read as encoded images, decoded and cropped on the
  # host (cpjax.data.preprocess, docs/data.md#your-own-data).
  config.dataset.folder = ""  # folder: DIR holding train/<class>/<images> (and val/, test/).
  config.dataset.test_size = 0  # Test examples carved from train when there is no test split.
  # Output S x S of the host stage; 0 = the dataset's fixed size, else (sizes vary) the
  # median shorter side of 512 training images, a multiple of 8, at most 224 (docs/data.md).
  config.dataset.image_size = 0
  config.dataset.channels = 0  # 1 (greyscale) or 3 (RGB); 0 = the dataset's own (3 if unknown).
  # Training crop: random_resized (Inception crop) or center (the evaluation crop).
  config.dataset.train_crop = "random_resized"
  config.dataset.crop_scale = (0.08, 1.0)  # random_resized: range of the crop's area share.
  config.dataset.crop_ratio = (3 / 4, 4 / 3)  # random_resized: range of its aspect ratio.
  # Evaluation and scoring: resize the shorter side to image_size / this, keep the centre.
  config.dataset.eval_crop_fraction = 0.875
  # Host-stage resize of the crop: opencv (area shrink, bilinear enlarge) or pil (antialiased).
  config.dataset.resize = "opencv"
  # Per-channel mean and std of pixels in [0, 1]; () = computed once on 512 training images
  # and cached in $XDG_CACHE_HOME/cpjax (~/.cache), never in the dataset's folder.
  config.dataset.mean = ()
  config.dataset.std = ()
  config.dataset.check_files = 50000  # folder: headers read at start-up per split (a sample above).
  config.dataset.skip_bad_files = False  # folder: leave out (and list) unreadable files.
  config.dataset.num_workers = 0  # Host-stage decode workers per process; 0 = its usable cores.
  # Host-stage workers: process (shared-memory worker processes) or thread (docs/data.md).
  config.dataset.worker_kind = "process"
  # Who decodes a folder's or tfds dataset's images: cpu (the host stage), gpu (each device
  # on its GPU with nvImageCodec, the gpu-decode extra), auto (gpu where it can run, else
  # cpu), device_cpu (the GPU path with PIL on the host standing in: tests) (docs/data.md).
  config.dataset.decode = "cpu"

  config.model = ml_collections.ConfigDict()
  config.model.name = "resnet18"  # Registered (docs/models.md) or a Flax module "pkg.module:Class".
  config.model.dtype = "float32"  # Compute dtype: float32 or bfloat16 (params stay float32).

  config.loss = ml_collections.ConfigDict()
  config.loss.name = "cross_entropy"  # One of cpjax.calibration.losses.LOSSES (docs/losses.md).
  config.loss.reduction = "mean"  # Batch reduction of the per-example loss: mean or sum.
  config.loss.mixup_alpha = 0.0  # Mixup Beta(alpha, alpha) per batch; 0 = off (Tata et al.: 0.15).
  # Each loss's own settings (label_smoothing, focal_gamma, mmce_lambda, ...), declared with
  # their defaults and one-line docs beside the loss in cpjax/calibration/losses.py (their
  # table: docs/losses.md).
  config.loss.update(losses.LOSSES.defaults())

  # gamma-Net meta-calibration, loss.name = flgamma_sece / flgamma_dece (docs/methods.md#gamma-net;
  # Wang & Golebiowski): focal loss with a per-example gamma from gamma-Net, whose parameters
  # minimise s-ECE / DECE on meta-validation batches (dataset.meta_val_size, needed).
  config.meta = ml_collections.ConfigDict()
  config.meta.learning_rate = 1e-3  # Adam on gamma-Net's parameters (Meta-Calibration's).
  config.meta.ce_weight = 0.0  # Meta-loss = surrogate + ce_weight * CE (0: as Algorithm 1).
  config.meta.num_prototypes = 0  # gamma-Net's k learned prototypes; 0 = number of classes.
  config.meta.temperature = 0.4  # gamma = |x~ W| / temperature.
  config.meta.max_gamma = 10.0  # Clamp gamma to [0, max_gamma]; 0 = no clamp.
  # Also add the meta-gradient to the backbone's, as the reference code does by not zeroing
  # its gradient buffer: the model then partly trains on the meta-validation batches.
  config.meta.leak_meta_gradient = False

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.learning_rate = 0.05  # Peak (initial) learning rate.
  config.optimizer.momentum = 0.9  # SGD momentum (PyTorch form, no dampening).
  config.optimizer.nesterov = False  # Nesterov momentum.
  config.optimizer.weight_decay = 5e-4  # Coupled (PyTorch-style) L2 added to the gradient.
  config.optimizer.grad_clip_norm = 0.0  # Clip the global gradient norm to this; 0 = off.
  config.optimizer.schedule = "cosine"  # LR schedule: cosine, multistep or constant.
  # Linear warm-up to learning_rate over this many epochs (cosine starts after it); 0 = none.
  config.optimizer.warmup_epochs = 0.0
  # "epoch": the LR changes once per epoch (the sources); "step": every step, the schedule
  # stretched over the run's optimizer steps (budget_steps when that cuts the run short).
  config.optimizer.schedule_unit = "epoch"
  config.optimizer.milestones = (150, 250)  # multistep: epochs at which the LR is decayed.
  config.optimizer.decay_factor = 0.1  # multistep: LR multiplier at each milestone.

  config.selection = ml_collections.ConfigDict()
  # full, or a policy of cpjax.selection.policies.POLICIES (docs/selection.md): top_k,
  # uniform_sorted, class_balanced, stratified, mixed, sampled, random (per epoch),
  # static_random, random_without_replacement, infobatch (needs score=loss,
  # scoring=train_pass, direction=hardest, which main.py sets unless given; fraction and
  # count unused), importance (k = fraction * N examples in expectation, loss-weighted).
  config.selection.method = "full"
  config.selection.direction = "hardest"  # Scored policies: hardest (highest) or easiest first.
  # Each policy's and score's own settings (temperature for sampled, stratify_drop for
  # stratified, prune_ratio for infobatch, mix for importance, ...), declared with their
  # defaults and one-line docs beside the policy in cpjax/selection/policies.py (their
  # table: docs/selection.md).
  config.selection.update(policies.POLICIES.defaults())
  config.selection.update(scores.SCORES.defaults())
  # Priority score (cpjax.selection.scores.SCORES); entropy = Tata et al. 2022's; reducible_loss
  # = RHO-LOSS: this run's loss less the target_workdir run's loss (scoring train_pass or fresh).
  config.selection.score = "entropy"
  config.selection.fraction = 0.1  # Share k/N of examples per selected epoch (unused by infobatch).
  config.selection.count = 0  # k as a count; > 0 overrides fraction (unused by infobatch).
  config.selection.warmup_epochs = 2  # All-data epochs before selection (Tata et al.: 10).
  # Fixed-size methods and importance: the last N epochs train on all data (InfoBatch's
  # annealing; infobatch itself uses anneal_fraction).
  config.selection.final_full_epochs = 0
  # Fixed-size methods and importance: < 0 keeps `fraction` every selected epoch; >= 0 moves
  # the kept fraction linearly from `fraction` (first selected epoch) to this (last selected
  # epoch).
  config.selection.fraction_end = -1.0
  config.selection.budget = 0.0  # Share of full passes (0 < b <= 1) that sets fraction; 0 = unset.
  # Where scores come from: train_pass (reference), fresh, target or target_recorded.
  config.selection.scoring = "train_pass"
  config.selection.rescore_every = 1  # fresh/target: epochs between scoring passes; 0 = once.
  config.selection.score_dtype = "float32"  # Compute dtype of scoring passes: float32 or bfloat16.
  config.selection.score_batch_size = 512  # Global batch of scoring passes (forward only: large).
  # target/target_recorded: the scoring run's --workdir; reducible_loss: the irreducible-loss run.
  config.selection.target_workdir = ""
  config.selection.record_scores = False  # Write train-pass scores per epoch to workdir/scores/.

  config.evaluation = ml_collections.ConfigDict()
  config.evaluation.num_bins = 15  # Bins of ECE, MCE, AdaECE, classwise ECE, reliability diagrams.
  # grid_ece, grid_nll or lbfgs_nll (cpjax.calibration.temperature).
  config.evaluation.temperature_method = "grid_ece"
  config.evaluation.bootstrap_resamples = 1000  # Bootstrap resamples B of the report's intervals.
  config.evaluation.bootstrap_level = 0.9  # Coverage of the bootstrap intervals.
  config.evaluation.bootstrap_kind = "basic"  # basic (pivotal; focal-loss code) or percentile.
  config.evaluation.bootstrap_seed = 0  # Seed of the bootstrap resampling.
  # Post-hoc map of the report's "calibrated" numbers: one of cpjax.calibration.posthoc.MAPS
  # or auto (lowest cross-validated validation NLL); every map is fitted and tabled anyway.
  # ensemble_temperature keeps every prediction; in studies/results/posthoc.md it beat auto by
  # 0.8 ECE points on a 180-image validation set and was within 0.1 of it on 6,000 images.
  config.evaluation.calibrator = "ensemble_temperature"
  config.evaluation.calibrator_folds = 5  # k of the k-fold CV on validation (map strengths).
  # Bootstrap resamples of every interval of the post-hoc table; 0 = no intervals there.
  config.evaluation.calibrator_resamples = 200
  # matrix_scaling and dirichlet (K^2 + K parameters) are fitted only for K <= this many
  # classes; above it the report skips them and names them (unless evaluation.calibrator names
  # one); 0 = no limit.
  config.evaluation.calibrator_square_max_classes = 128
  # OOD set: "", gaussian_noise (corrupted test) or a dataset name.
  config.evaluation.ood = "gaussian_noise"
  config.evaluation.ood_severity = 5  # gaussian_noise severity 1..5 (CIFAR-10-C scales).
  # Conformal prediction sets of the report (docs/evaluation.md): split conformal on the
  # validation logits, before and after the chosen post-hoc map, measured on test. Scores of
  # cpjax.calibration.conformal.SCORES (lac, aps, raps); () = none.
  config.evaluation.conformal_scores = ("lac", "aps", "raps")
  # Miscoverage alpha (coverage >= 1 - alpha): a number in (0, 1) or a tuple of them, each at
  # least 1 / (validation rows + 1).
  config.evaluation.conformal_alpha = config_dict.FieldReference(0.1, field_type=object)
  # Each score's own settings (conformal_randomized, conformal_seed, conformal_raps_lambda,
  # conformal_raps_k_reg), declared with their defaults and one-line docs beside the scores in
  # cpjax/calibration/conformal.py (their table: docs/evaluation.md).
  config.evaluation.update(conformal.SCORES.defaults())

  config.num_epochs = 8  # Training epochs.
  # Stop after this many optimizer steps in all, the epoch in which they run out cut short
  # and made the last (with its evaluation and report); 0 = train every epoch in full. With
  # optimizer.schedule_unit="step", the "same budget" baseline: full data in the number of
  # steps a subset run takes.
  config.budget_steps = 0
  config.batch_size = 64  # Global batch size (all devices and processes together).
  config.eval_batch_size = 256  # Global batch size of evaluation passes.
  config.eval_every_epochs = 1  # Evaluate validation and test every this many epochs.
  config.checkpoint_every_epochs = 1  # Save a checkpoint every this many epochs.
  config.keep_checkpoints = 2  # Checkpoints kept on disk (the newest ones).
  config.log_every_steps = 10  # Log train metrics and progress, check the loss, every N steps.
  config.xla_cpu_options = "tuned"  # tuned (cpjax.runtime.compiler_options) or xla_default.
  # JAX's persistent compilation cache, so a restart loads its compiled steps instead of
  # compiling them again; "" = off. The JAX_COMPILATION_CACHE_DIR environment variable wins.
  config.compilation_cache_dir = "~/.cache/cpjax/xla"
  config.compilation_cache_min_seconds = 0.1  # Cache programs that take this long to compile.
  # JAX's transfer guard on device-to-host copies inside the step loop, logging points and
  # checkpoints excepted: allow, log, disallow, log_explicit or disallow_explicit (the
  # *_explicit levels also catch jax.device_get). Checks on a GPU/TPU that no step waits on
  # the host; on CPU it never fires (device buffers are host memory).
  config.step_transfer_guard = "allow"
  return config
