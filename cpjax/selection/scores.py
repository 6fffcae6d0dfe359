"""Per-example priority scores from logits: pure jnp, higher = more worth training on.

Every score registered in SCORES is `score(logits [B, K], labels [B]) -> [B]` in float32
(labels are ignored by the label-free scores). The default, normalised
predictive entropy, is exactly that of Tata et al. 2022 ("Can Calibration
Improve Sample Prioritization?", NeurIPS HITY workshop; docs/methods.md#scores):
H = -sum_k p_k log(p_k + 1e-6) / log K, on probabilities that carry no gradient.

`reducible_loss` (RHO-LOSS) is a score of two models: the forward passes of the
current model compute its `loss`, and the selector subtracts another run's
losses of the same examples (`reducible_loss` below) before ranking.
"""

from collections.abc import Callable
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections

from cpjax import registry

ScoreFn = Callable[[jax.Array, jax.Array], jax.Array]


def _probs(logits: jax.Array) -> jax.Array:
  return jax.nn.softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)


def normalized_entropy(logits: jax.Array, labels: jax.Array | None = None) -> jax.Array:
  """H(p) / log K with Tata et al.'s +1e-6 inside the log (ranking unaffected)."""
  del labels
  p = _probs(logits)
  return -jnp.sum(p * jnp.log(p + 1e-6), axis=-1) / jnp.log(p.shape[-1])


def least_confidence(logits: jax.Array, labels: jax.Array | None = None) -> jax.Array:
  """1 - max_k p_k (Settles 2009, uncertainty sampling)."""
  del labels
  return 1.0 - jnp.max(_probs(logits), axis=-1)


def margin(logits: jax.Array, labels: jax.Array | None = None) -> jax.Array:
  """-(p_(1) - p_(2)): a small gap between the two top classes scores high."""
  del labels
  top2 = jax.lax.top_k(_probs(logits), 2)[0]
  return top2[:, 1] - top2[:, 0]


def loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Cross-entropy of the true label (Loshchilov & Hutter 2015, online batch selection)."""
  logp = jax.nn.log_softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def el2n(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """||softmax(z) - onehot(y)||_2 (Paul et al. 2021, "Deep learning on a data diet")."""
  p = _probs(logits)
  return jnp.linalg.norm(p - jax.nn.one_hot(labels, p.shape[-1]), axis=-1)


@dataclasses.dataclass(frozen=True)
class Score:
  """A registered priority score (`config.selection.score`)."""
  name: str
  fn: ScoreFn  # What the model's forward passes compute: fn(logits, labels, **settings) -> [B].
  doc: str  # One line for the docs' table.
  settings: tuple[registry.Setting, ...] = ()  # `config.selection.<name>` fields it reads.
  uses_labels: bool = True  # False: label-free (uncertainty) scores.
  # Never below 0 (up to rounding), so that a sampling probability may be proportional to it
  # (selection.method=importance refuses the others): declared, never assumed.
  nonnegative: bool = False


SCORES: registry.Registry[Score] = registry.Registry("selection score", "selection")
REDUCIBLE_LOSS = "reducible_loss"
for _score in (
    Score("entropy", normalized_entropy, "normalised predictive entropy H(p) / log K "
          "(Tata et al. 2022)", uses_labels=False, nonnegative=True),
    Score("least_confidence", least_confidence, "1 - max_k p_k (Settles 2009)",
          uses_labels=False, nonnegative=True),
    Score("margin", margin, "-(p_(1) - p_(2)), the gap of the two top classes",
          uses_labels=False),
    Score("loss", loss, "cross-entropy of the label (Loshchilov & Hutter 2015)",
          nonnegative=True),
    Score("el2n", el2n, "||softmax(z) - onehot(y)||_2 (Paul et al. 2021)", nonnegative=True),
    Score(REDUCIBLE_LOSS, loss, "RHO-LOSS (Mindermann et al., ICML 2022): this model's loss "
          "less `target_workdir`'s loss of the same example"),
):
  SCORES.register(_score)


def forward_score(name: str, selection: ml_collections.ConfigDict | None = None) -> ScoreFn:
  """The score function the train step and scoring passes compute for score `name`, with
  its settings bound from `selection` (config.selection; None: the declared defaults)."""
  score = SCORES[name]
  settings = {s.keyword: s.default if selection is None else selection[s.name]
              for s in score.settings if s.keyword is not None}
  return functools.partial(score.fn, **settings) if settings else score.fn


def reducible_loss(train_loss, irreducible_loss):
  """RHO-LOSS: L[y | x; current model] - L[y | x; irreducible-loss model], per example.

  The reducible holdout loss of Mindermann et al., "Prioritized Training on
  Points that are Learnable, Worth Learning, and Not Yet Learnt" (ICML 2022),
  Eq. 3, with L the cross-entropy of the label and the irreducible-loss model
  trained on held-out data: high for an example that the current model gets
  wrong (not yet learnt) and the other model gets right (learnable); low for a
  noisy or ambiguous one, which both get wrong, and for a learnt one. NumPy or
  jnp arrays of any (equal) shape.
  """
  return train_loss - irreducible_loss
