"""Differentiable batch-level calibration penalties: MMCE, DECE, s-ECE.

Pure jnp functions of (logits [B, K], integer labels [B]) returning a scalar
for the whole batch. They are defined over the mini-batch, so under jit on a
mesh they see the global batch (sharding does not change them).
"""

import jax
import jax.numpy as jnp

sg = jax.lax.stop_gradient


def _confidence_and_correct(logits: jax.Array, labels: jax.Array):
  """r_i = max_k p_ik (differentiable), a_i = 1[argmax = y_i] (not differentiable)."""
  probs = jax.nn.softmax(logits)
  correct = sg((jnp.argmax(probs, -1) == labels).astype(probs.dtype))
  return jnp.max(probs, -1), correct


def _laplacian_kernel(r: jax.Array, width: float) -> jax.Array:
  """k(r_i, r_j) = exp(-|r_i - r_j| / width), [B, B]."""
  return jnp.exp(-jnp.abs(r[:, None] - r[None, :]) / width)


def mmce_unweighted(logits: jax.Array, labels: jax.Array, width: float = 0.4) -> jax.Array:
  """MMCE_m = (1/N^2) sum_ij (a_i - r_i)(a_j - r_j) k(r_i, r_j), no square root
  (docs/methods.md#mmce; Kumar et al. 2018, as returned by the focal-loss code)."""
  r, a = _confidence_and_correct(logits, labels)
  e = a - r
  return jnp.sum(e[:, None] * e[None, :] * _laplacian_kernel(r, width)) / r.shape[0] ** 2


def mmce_weighted(logits: jax.Array, labels: jax.Array, width: float = 0.4,
                  form: str = "code") -> jax.Array:
  """Weighted MMCE over the batch (docs/methods.md#mmce; Kumar et al. 2018).

  With C the correct and I the incorrect examples (m = |C|, n = |I|) and
  S_CC = sum_{i,j in C} (1-r_i)(1-r_j) k, S_II = sum_{i,j in I} r_i r_j k,
  S_CI = sum_{i in C, j in I} (1-r_i) r_j k:
    nominal: sqrt(S_CC/m^2 + S_II/n^2 - 2 S_CI/(mn));
    code (the focal-loss repo, for lambda = 2 parity): each pair sum is first
      averaged (/m^2, /n^2, /mn) then divided again by (m^2 + 1e-5),
      (n^2 + 1e-5), (mn + 1e-5); result sqrt(. + 1e-10).
  Both are 0 when C or I is empty, and clipped at 0 from below.
  """
  r, a = _confidence_and_correct(logits, labels)
  k = _laplacian_kernel(r, width)
  c, w = a * (1.0 - r), (1.0 - a) * r  # Masked weights of the correct / incorrect sets.
  s_cc, s_ii, s_ci = c @ k @ c, w @ k @ w, c @ k @ w
  m, n = jnp.sum(a), jnp.sum(1.0 - a)
  both = (m > 0) & (n > 0)
  m_, n_ = jnp.maximum(m, 1.0), jnp.maximum(n, 1.0)
  if form == "code":
    err = (s_cc / m_**2 / (m**2 + 1e-5) + s_ii / n_**2 / (n**2 + 1e-5)
           - 2.0 * s_ci / (m_ * n_) / (m * n + 1e-5))
    value = jnp.sqrt(jnp.maximum(err, 0.0) + 1e-10)
  else:
    err = s_cc / m_**2 + s_ii / n_**2 - 2.0 * s_ci / (m_ * n_)
    value = jnp.sqrt(jnp.where(both, jnp.maximum(err, 1e-20), 1.0))
  return jnp.where(both, value, 0.0)


def dece(logits: jax.Array, labels: jax.Array, num_bins: int = 15, t_a: float = 100.0,
         t_b: float = 0.01) -> jax.Array:
  """Differentiable ECE (docs/methods.md#dece; Bohdal et al. 2023, Meta-Calibration).

  Soft bins: h_ij = (j c_i - j(j-1)/(2M)) / t_b, B = softmax_j(h), then
  B <- (B + 1e-6) / (1 + (M+1) 1e-6) (the reference's renormaliser). Soft
  accuracy: rank_i = 0.5 + sum_k sigmoid(t_a (p_ik - p_iy)), acc_i =
  ReLU(2 - rank_i). DECE = sum_j (sum_i B_ij / N) |acc_j - conf_j|.
  """
  probs = jax.nn.softmax(logits)
  conf = jnp.max(probs, -1)
  j = jnp.arange(1, num_bins + 1, dtype=probs.dtype)
  h = (j[None, :] * conf[:, None] - j * (j - 1) / (2 * num_bins)) / t_b
  bins = (jax.nn.softmax(h, -1) + 1e-6) / (1.0 + (num_bins + 1) * 1e-6)
  p_true = jnp.take_along_axis(probs, labels[:, None], -1)
  rank = 0.5 + jnp.sum(jax.nn.sigmoid(t_a * (probs - p_true)), -1)
  acc = jax.nn.relu(2.0 - rank)
  mass = jnp.sum(bins, 0)
  bin_conf = (bins.T @ conf) / mass
  bin_acc = (bins.T @ acc) / mass
  return jnp.sum(mass / conf.shape[0] * jnp.abs(bin_acc - bin_conf))


def sece(logits: jax.Array, labels: jax.Array, bandwidth: float = 0.05) -> jax.Array:
  """Smooth ECE, "our SECE" (docs/methods.md#s-ece; after Wang & Golebiowski 2024).

  sACC_i = sum_j a_j k(c_i, c_j) / sum_j k(c_i, c_j) with the Gaussian kernel
  k = exp(-(c - c')^2 / (2 h^2)), hard accuracy a_j, self term included;
  s-ECE = mean_i |sACC_i - c_i|. Gradients flow through c in both places.
  """
  conf, correct = _confidence_and_correct(logits, labels)
  kernel = jnp.exp(-((conf[:, None] - conf[None, :]) ** 2) / (2.0 * bandwidth**2))
  smooth_acc = kernel @ correct / jnp.sum(kernel, -1)
  return jnp.mean(jnp.abs(smooth_acc - conf))
