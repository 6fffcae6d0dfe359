"""On-device batch transforms: normalisation, random crop + flip, mixup.

All are pure jnp functions of (key, batch) so they run inside the jitted step,
sharded with the batch, and never bottleneck the accelerator on host work.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def normalize(images: jax.Array, mean: Sequence[float], std: Sequence[float],
              dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """uint8 [B, H, W, C] -> (x / 255 - mean) / std, per channel."""
  x = images.astype(jnp.float32) / 255.0
  return ((x - jnp.asarray(mean)) / jnp.asarray(std)).astype(dtype)


def random_crop_flip(key: jax.Array, images: jax.Array, padding: int,
                     flip: bool) -> jax.Array:
  """Per-example random crop with zero padding, then random horizontal flip.

  As torchvision's RandomCrop(size, padding) + RandomHorizontalFlip(0.5).

  Args:
    key: PRNG key for this batch.
    images: [B, H, W, C] raw pixels, before `normalize`: as in Tata et al. 2022's
      code (PIL crop, then ToTensor + Normalize) the padding is black, not the mean.
    padding: pixels of zero padding on each side (0 = no crop).
    flip: whether to flip half of the examples left-right.

  Returns:
    Augmented images, same shape.
  """
  batch, height, width, _ = images.shape
  crop_key, flip_key = jax.random.split(key)
  if padding:
    padded = jnp.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    offsets = jax.random.randint(crop_key, (batch, 2), 0, 2 * padding + 1)
    crop = lambda img, off: jax.lax.dynamic_slice(
        img, (off[0], off[1], 0), (height, width, img.shape[-1]))
    images = jax.vmap(crop)(padded, offsets)
  if flip:
    do_flip = jax.random.bernoulli(flip_key, 0.5, (batch, 1, 1, 1))
    images = jnp.where(do_flip, images[:, :, ::-1], images)
  return images


def mixup(key: jax.Array, images: jax.Array, targets: jax.Array,
          alpha: float) -> tuple[jax.Array, jax.Array]:
  """Mixup with one lambda and one permutation per batch (docs/methods.md#mixup; Zhang et al. 2018).

  lambda ~ Beta(alpha, alpha) (lambda = 1 if alpha <= 0), pi a random
  permutation: x~ = lambda x + (1 - lambda) x[pi], t~ = lambda t + (1 - lambda) t[pi].
  CE against t~ equals lambda CE(y) + (1 - lambda) CE(y[pi]) of the reference.

  Args:
    key: PRNG key for this batch.
    images: float [B, H, W, C], normalised (mixing follows augmentation).
    targets: probability targets [B, K] (one-hot for hard labels).
    alpha: Beta concentration.

  Returns:
    (mixed images, mixed targets).
  """
  lam_key, perm_key = jax.random.split(key)
  lam = jax.random.beta(lam_key, alpha, alpha) if alpha > 0 else jnp.float32(1.0)
  perm = jax.random.permutation(perm_key, images.shape[0])
  mix = lambda x: lam.astype(x.dtype) * x + (1 - lam).astype(x.dtype) * x[perm]
  return mix(images), mix(targets)
