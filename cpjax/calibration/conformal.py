"""Conformal prediction sets: split conformal with the LAC, APS and RAPS scores.

Split conformal (Vovk, Gammerman & Shafer 2005; Angelopoulos & Bates 2021, "A Gentle
Introduction to Conformal Prediction"; docs/methods.md#conformal-prediction-sets): a score
s(x, y), large where class y fits row x badly, computed for the label of each of n
calibration (validation) rows; the threshold q = the k-th smallest of those n scores,
k = ceil((n + 1)(1 - alpha)); the prediction set C(x) = {y : s(x, y) <= q}. A test row
exchangeable with the calibration rows has P(y in C(x)) >= 1 - alpha (k / (n + 1) when the
scores have no ties), so alpha < 1 / (n + 1) (k > n) is refused. k is computed exactly, alpha
read as the decimal it prints as (0.1 is 1/10).

With p a row's probabilities, its classes ranked by p (descending; ties: the smaller class
index first), r the rank of class y (1: the most probable), p_(j) the probability at rank j,
rho_j = p_(1) + ... + p_(j) summed in rank order (rho_0 = 0) and u a draw in [0, 1) per row
(randomised scores) or u = 1 (not randomised), evaluated left to right as written:

  lac   s = 1 - p_y  (Sadinle, Lei & Wasserman 2019, JASA: least ambiguous set-valued
        classifiers)
  aps   s = rho_{r-1} + u p_(r)  (Romano, Sesia & Candès 2020, NeurIPS: adaptive prediction
        sets; u = 1 gives rho_r, the mass of the classes ranked at or above y)
  raps  s = rho_{r-1} + u p_(r) + lambda max(r - k_reg, 0)  (Angelopoulos, Bates, Malik &
        Jordan 2021, ICLR: regularised adaptive prediction sets)

Each score is non-decreasing along a row's ranks, in floating point too (each term is, and
rounding is monotone), so a set is its row's top-L classes, L = #{ranks whose score <= q}
(the set size), and the label is covered iff its score <= q iff its rank <= L. A set may be
empty (the top class's own score above q): exact 1 - alpha coverage needs empty sets where
the model's top-1 accuracy exceeds 1 - alpha.

Every function is pure: arrays in, arrays out, NumPy by default and jit-able with
`xp=jax.numpy` (alpha and the settings static); `split_conformal` is the NumPy driver the
report uses, over blocks of rows. Every score is an entry of the registry SCORES, which
declares the `config.evaluation.*` settings it reads.
"""

from collections.abc import Callable, Sequence
import dataclasses
import fractions
import math
from typing import Any, NamedTuple

import numpy as np

from cpjax import registry

VALIDATION, TEST, OOD = 0, 1, 2  # The streams of `uniform_draws`: one per split.
BLOCK_ENTRIES = 1 << 20  # [rows, K] entries per block of `split_conformal` (8 MB in float64).
# Above this many classes the NumPy driver finds set sizes and label ranks by binary search
# along each sorted row (log2 K probes of one rank each) instead of counting all K entries:
# at K = 1,000 a block's label ranks took a ninth of the time, its set sizes a fifth (raps)
# to three quarters (lac); at K <= 100 counting was faster.
SEARCH_ABOVE = 256
# The report's driver sorts each row's leading ranks only (`leading_ranks`), at first this
# many: a set or a label ranked deeper has its row sorted whole, and where more than
# DEEP_SHARE of a block's rows did, the next block sorts twice as many ranks.
TOP_RANKS = 32
DEEP_SHARE = 0.125


def softmax(logits: np.ndarray) -> np.ndarray:
  """Row-wise softmax in float64, exp(z - max z) / sum exp(z - max z): the report's
  probabilities before a post-hoc map (one exponential an entry, a third faster than
  `metrics.softmax`'s exp of the log-softmax, to which it is equal to ~2 ulp)."""
  logits = np.asarray(logits, np.float64)
  probs = logits - logits.max(axis=-1, keepdims=True)
  np.exp(probs, out=probs)
  probs /= probs.sum(axis=-1, keepdims=True)
  return probs


class Ranked(NamedTuple):
  """Probabilities [N, K] with each row sorted once: what every score reads."""
  probs: Any  # [N, K], class order.
  sorted: Any  # [N, K]: p_(1) >= p_(2) >= ... >= p_(K) per row.
  sums: Any  # [N, K + 1]: rho_0 = 0, rho_1, ..., rho_K, summed in rank order.


def ranked(probs, xp=np) -> Ranked:
  """`probs` [N, K] with each row sorted (descending) and its cumulative sums."""
  if xp is not np:
    descending = -xp.sort(-probs, axis=-1)  # Negation is exact: the values themselves.
    return Ranked(probs, descending, xp.concatenate(
        [xp.zeros_like(descending[..., :1]), xp.cumsum(descending, axis=-1)], axis=-1))
  descending = np.negative(probs)  # The same, in one array: negated, sorted, negated back.
  descending.sort(axis=-1)
  np.negative(descending, out=descending)
  sums = np.zeros(descending.shape[:-1] + (descending.shape[-1] + 1,), descending.dtype)
  np.cumsum(descending, axis=-1, out=sums[..., 1:])  # After a zero column, not copied there.
  return Ranked(probs, descending, sums)


def _at_ranks(view: Ranked, at, xp):
  """(rho_{j-1}, p_(j), j) at the 0-based rank positions `at` [N, m] (None: every rank)."""
  if at is None:
    num_classes = view.sorted.shape[-1]
    return view.sums[..., :-1], view.sorted, xp.arange(1, num_classes + 1)
  return (xp.take_along_axis(view.sums, at, axis=-1),
          xp.take_along_axis(view.sorted, at, axis=-1), at + 1)


def lac_scores(view: Ranked, u=None, xp=np, at=None):
  """LAC score at rank positions `at` (0-based, [N, m]; None: every rank, [N, K]):
  1 - p_(j) (Sadinle, Lei & Wasserman 2019, JASA). LAC is never randomised: `u` unused."""
  del u
  return 1 - _at_ranks(view, at, xp)[1]


def aps_scores(view: Ranked, u=None, xp=np, at=None):
  """APS score at rank positions `at` (as `lac_scores`): rho_{j-1} + u p_(j) (Romano, Sesia &
  Candès 2020, NeurIPS); u [N] in [0, 1), or None for u = 1 (then the score is rho_j)."""
  above, p, _ = _at_ranks(view, at, xp)
  return above + (p if u is None else xp.asarray(u)[:, None] * p)


def raps_scores(view: Ranked, u=None, xp=np, at=None, *, lam: float, k_reg: int):
  """RAPS score at rank positions `at` (as `lac_scores`): rho_{j-1} + u p_(j) + lambda
  max(j - k_reg, 0) (Angelopoulos, Bates, Malik & Jordan 2021, ICLR)."""
  rank = _at_ranks(view, at, xp)[2]
  return aps_scores(view, u, xp, at) + lam * xp.maximum(rank - k_reg, 0)


@dataclasses.dataclass(frozen=True)
class Score:
  """A conformal score with the `config.evaluation.*` settings it reads."""
  name: str
  doc: str  # One line: the score and its paper.
  # (Ranked view, u [N] or None, xp, at: rank positions [N, m] or None, the settings with a
  # keyword) -> the scores at those ranks, non-decreasing along each row's ranks.
  fn: Callable[..., Any]
  randomised: bool  # Reads u where config.evaluation.conformal_randomized is True.
  settings: tuple[registry.Setting, ...] = ()


# The settings the randomisable scores share (one object each).
RANDOMIZED = registry.Setting(
    "conformal_randomized", False, registry.boolean(),
    "aps/raps: randomised scores (u uniform in [0, 1) per row); False: u = 1.", arg=None)
SEED = registry.Setting("conformal_seed", 0, registry.integer(0, 2**31 - 1),
                        "aps/raps: seed of the randomised scores' u.", arg=None)
RAPS_LAMBDA = registry.Setting("conformal_raps_lambda", 0.01, registry.number(0.0),
                               "raps: lambda, the penalty per rank beyond k_reg.", arg="lam")
RAPS_K_REG = registry.Setting("conformal_raps_k_reg", 5, registry.integer(0),
                              "raps: k_reg, the ranks free of the penalty.", arg="k_reg")

SCORES: registry.Registry[Score] = registry.Registry("conformal score", "evaluation")
for _score in (
    Score("lac", "1 - p_y (Sadinle, Lei & Wasserman 2019, JASA)", lac_scores, False),
    Score("aps", "rho_{r-1} + u p_(r) (Romano, Sesia & Candès 2020, NeurIPS)", aps_scores,
          True, (RANDOMIZED, SEED)),
    Score("raps", "rho_{r-1} + u p_(r) + lambda (r - k_reg)^+ (Angelopoulos, Bates, Malik & "
          "Jordan 2021, ICLR)", raps_scores, True, (RANDOMIZED, SEED, RAPS_LAMBDA, RAPS_K_REG)),
):
  SCORES.register(_score)


def label_ranks(probs, labels, xp=np):
  """[N] rank of each row's label (1 = most probable): 1 + #{j : p_j > p_y} + #{j < y :
  p_j = p_y}, ties ranked by class index."""
  labels = xp.asarray(labels)
  p_y = xp.take_along_axis(probs, labels[:, None], axis=-1)
  before = (probs > p_y) | ((probs == p_y) & (xp.arange(probs.shape[-1]) < labels[:, None]))
  return 1 + xp.sum(before, axis=-1)


def _ranked_view(probs, xp, view: Ranked | None) -> Ranked:
  return ranked(probs, xp) if view is None else view


def rank_scores(name: str, probs, u=None, xp=np, view: Ranked | None = None, **settings):
  """[N, K] the scores of score `name` (SCORES) of the class at each rank, in rank order;
  `view`: `ranked(probs)` where already computed; `settings`: the score's keywords (raps:
  lam, k_reg)."""
  return SCORES[name].fn(_ranked_view(probs, xp, view), u, xp, None, **settings)


def class_scores(name: str, probs, u=None, xp=np, view: Ranked | None = None, **settings):
  """[N, K] s(x, k) of every class k, in class order: the score at the class's rank."""
  order = xp.argsort(-probs, axis=-1, stable=True)  # Ties: the smaller class index first.
  return xp.take_along_axis(rank_scores(name, probs, u, xp, view, **settings),
                            xp.argsort(order, axis=-1), axis=-1)


def label_scores(name: str, probs, labels, u=None, xp=np, view: Ranked | None = None,
                 **settings):
  """[N] the score of each row's label: the score at its rank (the same floating-point
  operations as the set's)."""
  at = label_ranks(probs, labels, xp)[:, None] - 1
  return SCORES[name].fn(_ranked_view(probs, xp, view), u, xp, at, **settings)[:, 0]


def quantile_rank(num_rows: int, alpha: float) -> int:
  """k = ceil((n + 1)(1 - alpha)), exact: alpha read as the decimal it prints as."""
  exact = fractions.Fraction(repr(float(alpha)))
  return math.ceil((num_rows + 1) * (1 - exact))


def smallest_alpha_text(num_rows: int) -> str:
  """"1/(n + 1) = 1/181 (0.005525, rounded up)": the smallest alpha that n rows reach, with a
  decimal at or above it (four significant digits)."""
  exact = fractions.Fraction(1, num_rows + 1)
  scale = fractions.Fraction(10) ** (3 - math.floor(math.log10(exact)))
  return f"1/(n + 1) = 1/{num_rows + 1} ({float(math.ceil(exact * scale) / scale):g}, rounded up)"


def _range_problem(alpha: Any) -> str | None:
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
    return f"must be a number in (0, 1), got {alpha!r}"
  return None


def alpha_problem(alpha: float, num_rows: int) -> str | None:
  """Why `alpha` cannot be used with `num_rows` calibration rows (outside (0, 1), or k > n),
  or None."""
  if (problem := _range_problem(alpha)) is not None:
    return f"alpha {problem}"
  k = quantile_rank(num_rows, alpha)
  if k > num_rows:
    return (f"alpha={alpha} needs the k-th smallest of the n = {num_rows} validation scores, "
            f"k = ceil((n + 1)(1 - alpha)) = {k} > n; the smallest reachable alpha is "
            f"{smallest_alpha_text(num_rows)}")
  return None


def threshold(calibration_scores, alpha: float, xp=np):
  """q: the ceil((n + 1)(1 - alpha))-th smallest of the n calibration scores (Vovk et al.
  2005; Angelopoulos & Bates 2021). ValueError where alpha is outside (0, 1) or k > n."""
  n = calibration_scores.shape[0]
  problem = alpha_problem(alpha, n)
  if problem:
    raise ValueError(problem)
  k = quantile_rank(n, alpha)
  if xp is np:
    return np.partition(np.asarray(calibration_scores), k - 1)[k - 1]
  return xp.sort(calibration_scores)[k - 1]


def set_sizes(rank_matrix, q, xp=np):
  """[N] size of each row's set: the number of its scores <= q (any order)."""
  return xp.sum(rank_matrix <= q, axis=-1)


def prediction_sets(name: str, probs, q, u=None, xp=np, **settings):
  """[N, K] bool, class order: whether each class is in its row's set {y : s(x, y) <= q}."""
  return class_scores(name, probs, u, xp, **settings) <= q


def _prefix_lengths(holds: Callable[[np.ndarray], np.ndarray], num_rows: int,
                    num_positions: int) -> np.ndarray:
  """[N] per row, how many of its positions 0..num_positions-1 satisfy `holds`, a predicate
  of one position per row ([N, 1] -> [N, 1] bool) that holds on a prefix of each row: a
  binary search, ceil(log2(num_positions + 1)) probes."""
  low = np.zeros(num_rows, np.int64)
  high = np.full(num_rows, num_positions, np.int64)
  while (active := low < high).any():
    middle = (low + high) // 2
    ok = holds(np.minimum(middle, num_positions - 1)[:, None])[:, 0] & active
    low = np.where(ok, middle + 1, low)
    high = np.where(active & ~ok, middle, high)
  return low


def sorted_set_sizes(name: str, view: Ranked, q, u=None, **settings) -> np.ndarray:
  """[N] `set_sizes` of score `name`'s scores from a `Ranked` view (NumPy): above
  SEARCH_ABOVE classes by binary search along each row's ranks (the scores are
  non-decreasing there), each probe the score's own formula at one rank; else counted."""
  entry, num_classes = SCORES[name], view.sorted.shape[-1]
  if num_classes <= SEARCH_ABOVE:
    return set_sizes(entry.fn(view, u, np, None, **settings), q)
  return _prefix_lengths(lambda at: entry.fn(view, u, np, at, **settings) <= q,
                         len(view.sorted), num_classes)


def sorted_label_ranks(view: Ranked, labels: np.ndarray) -> np.ndarray:
  """[N] `label_ranks` from a `Ranked` view (NumPy): above SEARCH_ABOVE classes by binary
  searches of p_y along each sorted row, the class-index rule applied to the rows where p_y
  is tied only; else `label_ranks`."""
  num_classes = view.sorted.shape[-1]
  if num_classes <= SEARCH_ABOVE:
    return label_ranks(view.probs, labels)
  labels, rows = np.asarray(labels), len(view.sorted)
  p_y = view.probs[np.arange(rows), labels][:, None]

  def leading(compare):  # How many of the sorted row's entries lead p_y by `compare`.
    return _prefix_lengths(lambda at: compare(np.take_along_axis(view.sorted, at, -1), p_y),
                           rows, num_classes)
  above = leading(np.greater)
  tied = np.flatnonzero(leading(np.greater_equal) - above > 1)
  before = np.zeros(rows, np.int64)
  before[tied] = np.sum((view.probs[tied] == p_y[tied])
                        & (np.arange(num_classes) < labels[tied, None]), axis=-1)
  return 1 + above + before


def uniform_draws(seed: int, stream: int, num_rows: int) -> np.ndarray:
  """The u of the randomised scores for `num_rows` rows of one split: uniform in [0, 1) from
  np.random.default_rng([seed, stream]) (VALIDATION, TEST or OOD)."""
  return np.random.default_rng([seed, stream]).random(num_rows)


def keywords(name: str, section: Any) -> dict[str, Any]:
  """Score `name`'s keyword settings from `section` (config.evaluation or a dict)."""
  return SCORES.keywords(name, section)


def names_problem(value: Any) -> str | None:
  """`config.evaluation.conformal_scores`' check: a tuple of distinct registered scores."""
  if not isinstance(value, (tuple, list)):
    return f"must be a tuple of conformal score names, got {value!r}"
  for name in value:
    if name not in SCORES:
      return f"got {name!r}; {SCORES.choices(name)}"
  if len(set(value)) != len(value):
    return f"names a score twice: {tuple(value)!r}"
  return None


def alphas(value: Any) -> tuple[float, ...]:
  """`config.evaluation.conformal_alpha` as a tuple (a number, or a tuple or list of them)."""
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def alphas_problem(value: Any) -> str | None:
  """`config.evaluation.conformal_alpha`'s check: a number in (0, 1), or a non-empty tuple
  of distinct ones."""
  values = alphas(value)
  if not values:
    return "must be a number in (0, 1) or a non-empty tuple of them, got ()"
  for alpha in values:
    if (problem := _range_problem(alpha)) is not None:
      return problem
  if len(set(values)) != len(values):
    return f"names an alpha twice: {value!r}"
  return None


class Sets(NamedTuple):
  """One score at one alpha: the threshold and, per test (and OOD) row, coverage and size."""
  rank: int  # k = ceil((n + 1)(1 - alpha)).
  threshold: float  # q.
  covered: np.ndarray  # [N] bool: the label's score <= q.
  sizes: np.ndarray  # [N] int: the set's size.
  ood_sizes: np.ndarray | None  # [M] int, or None without OOD rows.


def _blocks(num_rows: int, num_classes: int) -> list[slice]:
  rows = max(1, BLOCK_ENTRIES // max(num_classes, 1))
  return [slice(start, start + rows) for start in range(0, num_rows, rows)]


def leading_ranks(probs: np.ndarray, depth: int) -> Ranked:
  """The first `depth` ranks of `ranked(probs)`: the same numbers (the `depth` largest
  probabilities of each row, which `np.partition` finds, sorted, and their sums in rank
  order), without sorting the rest of each row."""
  top = np.partition(np.negative(probs), depth - 1, axis=-1)[:, :depth]
  top.sort(axis=-1)
  np.negative(top, out=top)
  sums = np.zeros((len(top), depth + 1), top.dtype)
  np.cumsum(top, axis=-1, out=sums[:, 1:])
  return Ranked(probs, top, sums)


class _Block:
  """A block of rows' probabilities for the driver: its leading ranks sorted
  (`leading_ranks`, TOP_RANKS deep), each label's rank, and the rows whose label or set
  reaches past the leading ranks sorted whole where asked (a good model's are few)."""

  def __init__(self, probs: np.ndarray, labels: np.ndarray | None,
               u: dict[str, np.ndarray | None], depth: int):
    self.probs, self.u = probs, u
    self.depth = min(probs.shape[-1], depth)
    self.leading = leading_ranks(probs, self.depth)
    self.deep = 0  # The most rows of one label or set call that reached past the depth.
    self.ranks = None if labels is None else self._label_ranks(np.asarray(labels))

  def _label_ranks(self, labels: np.ndarray) -> np.ndarray:
    """`label_ranks`: 1 + the leading probabilities above p_y where p_y is among them alone;
    counted over the whole row where it ties another or lies deeper."""
    p_y = self.probs[np.arange(len(labels)), labels][:, None]
    top = self.leading.sorted
    ranks = 1 + np.sum(top > p_y, axis=-1)
    # p_y tied, or at the leading ranks' last value or below (where a tie may lie deeper).
    at_edge = p_y[:, 0] <= top[:, -1] if self.depth < self.probs.shape[-1] else False
    counted = np.flatnonzero((np.sum(top == p_y, axis=-1) != 1) | at_edge)
    ranks[counted] = label_ranks(self.probs[counted], labels[counted])
    return ranks

  def whole(self, rows: np.ndarray) -> Ranked:
    return ranked(self.probs[rows])

  def label_scores(self, name: str, keywords: dict) -> np.ndarray:
    """[rows] each label's score (the same operations as `label_scores`)."""
    fn, u = SCORES[name].fn, self.u[name]
    at = np.minimum(self.ranks, self.depth)[:, None] - 1
    scores = fn(self.leading, u, np, at, **keywords)[:, 0]
    deep = np.flatnonzero(self.ranks > self.depth)
    self.deep = max(self.deep, len(deep))
    if len(deep):
      scores[deep] = fn(self.whole(deep), None if u is None else u[deep], np,
                        self.ranks[deep, None] - 1, **keywords)[:, 0]
    return scores

  def sizes(self, name: str, keywords: dict, q) -> np.ndarray:
    """[rows] each set's size: its leading scores <= q, counted; a row whose leading scores
    all are (its set may reach deeper) by `sorted_set_sizes` on the row sorted whole."""
    fn, u = SCORES[name].fn, self.u[name]
    inside = fn(self.leading, u, np, None, **keywords) <= q
    sizes = np.sum(inside, axis=-1)
    if self.depth < self.probs.shape[-1]:
      deep = np.flatnonzero(inside[:, -1])
      self.deep = max(self.deep, len(deep))
      if len(deep):
        sizes[deep] = sorted_set_sizes(name, self.whole(deep), q,
                                       None if u is None else u[deep], **keywords)
    return sizes


def _blocks_of(rows_of, labels, u: dict[str, np.ndarray | None], transform):
  """A `_Block` per block of rows of transform(rows_of) (labels None: sizes only), each
  sorting twice the ranks of the one before where more than DEEP_SHARE of its rows went
  deeper (after the block's use: the generator resumes once the caller is done with it)."""
  depth = TOP_RANKS
  for rows in _blocks(len(rows_of), rows_of.shape[-1]):
    block = np.asarray(rows_of[rows], np.float64)
    probs = block if transform is None else np.asarray(transform(block), np.float64)
    current = _Block(probs, None if labels is None else labels[rows],
                     {name: None if drawn is None else drawn[rows] for name, drawn in u.items()},
                     depth)
    yield current
    if current.deep > DEEP_SHARE * len(probs):
      depth = min(2 * depth, rows_of.shape[-1])


def _calibration_scores(rows_of, labels, settings, u, transform) -> dict[str, np.ndarray]:
  """{name: [n] the label scores of the calibration rows}."""
  out = {name: [] for name in settings}
  for block in _blocks_of(rows_of, labels, u, transform):
    for name, keywords_ in settings.items():
      out[name].append(block.label_scores(name, keywords_))
  return {name: np.concatenate(parts) for name, parts in out.items()}


def _measured(rows_of, labels, settings, u, thresholds, transform) -> dict[tuple, tuple]:
  """{(name, alpha): (covered [N] or None, sizes [N])} of the rows (labels None: sizes
  only), block by block."""
  parts = {key: ([], []) for key in thresholds}
  for block in _blocks_of(rows_of, labels, u, transform):
    for name, keywords_ in settings.items():
      score = None if labels is None else block.label_scores(name, keywords_)
      for alpha in (alpha for key_name, alpha in thresholds if key_name == name):
        q = thresholds[name, alpha]
        parts[name, alpha][1].append(block.sizes(name, keywords_, q))
        if score is not None:
          parts[name, alpha][0].append(score <= q)
  return {key: (np.concatenate(covered) if covered else None,
                np.concatenate(sizes) if sizes else np.zeros(0, np.int64))
          for key, (covered, sizes) in parts.items()}


def split_conformal(val: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                    names: Sequence[str], alpha_values: Sequence[float],
                    settings: dict[str, dict[str, Any]] | None = None,
                    draws: dict[int, np.ndarray] | None = None,
                    ood_probs: np.ndarray | None = None,
                    transform: Callable[[np.ndarray], np.ndarray] | None = None
                    ) -> dict[tuple[str, float], Sets]:
  """Split conformal of every score of `names` at every alpha: thresholds from the
  calibration rows, each test row's coverage and set size, each OOD row's set size.

  Args:
    val: (probabilities [n, K], labels [n]) of the calibration (validation) rows.
    test: (probabilities [N, K], labels [N]) of the test rows.
    names: scores of SCORES.
    alpha_values: miscoverage levels, each in (0, 1) with k <= n (else ValueError).
    settings: {name: its keywords} (`keywords`); missing: none.
    draws: {VALIDATION, TEST, OOD: u [rows]} for the randomised scores; None: u = 1.
    ood_probs: probabilities [M, K] of out-of-distribution rows, or None.
    transform: a row-wise map to probabilities, applied block by block where the arrays
      hold something else: `metrics.softmax` for logits, `np.exp` for log-probabilities (no
      [N, K] probabilities are made whole: each block's stay in cache from the map to the
      sets). None: the arrays are probabilities.

  Returns:
    {(name, alpha): Sets}, in the order of `names`, then of `alpha_values`.
  """
  settings = {name: (settings or {}).get(name, {}) for name in names}

  def u_of(split: int) -> dict[str, np.ndarray | None]:
    drawn = None if draws is None else draws[split]
    return {name: drawn if SCORES[name].randomised else None for name in names}
  calibration = _calibration_scores(*val, settings, u_of(VALIDATION), transform)
  ranks = {alpha: quantile_rank(len(val[1]), alpha) for alpha in alpha_values}
  thresholds = {(name, alpha): threshold(calibration[name], alpha)
                for name in names for alpha in alpha_values}
  measured = _measured(*test, settings, u_of(TEST), thresholds, transform)
  ood = (None if ood_probs is None else
         _measured(ood_probs, None, settings, u_of(OOD), thresholds, transform))
  return {(name, alpha): Sets(ranks[alpha], float(thresholds[name, alpha]),
                              *measured[name, alpha], None if ood is None else ood[name, alpha][1])
          for name, alpha in thresholds}


def summary(covered: np.ndarray, sizes: np.ndarray, labels: np.ndarray,
            num_classes: int) -> dict[str, Any]:
  """The test numbers of one score at one alpha: coverage overall and per class (NaN for a
  class without rows; the worst class: the lowest coverage, ties to the smaller index), mean
  and median set size, the shares of singleton and empty sets, and coverage by set size."""
  covered, sizes = np.asarray(covered, np.float64), np.asarray(sizes, np.int64)
  class_count = np.bincount(labels, minlength=num_classes)
  with np.errstate(invalid="ignore", divide="ignore"):
    class_coverage = np.bincount(labels, covered, num_classes) / class_count
  worst = int(np.nanargmin(class_coverage)) if class_count.any() else -1
  size_count = np.bincount(sizes)
  present = np.flatnonzero(size_count)
  return {"coverage": float(covered.mean()), "mean_size": float(sizes.mean()),
          "median_size": float(np.median(sizes)),
          "singleton_share": float(np.mean(sizes == 1)),
          "empty_share": float(np.mean(sizes == 0)),
          "worst_class": worst,
          "worst_class_coverage": float(class_coverage[worst]) if worst >= 0 else float("nan"),
          "worst_class_rows": int(class_count[worst]) if worst >= 0 else 0,
          "class_coverage": class_coverage.tolist(), "class_rows": class_count.tolist(),
          "by_size": {"size": present.tolist(), "rows": size_count[present].tolist(),
                      "coverage": (np.bincount(sizes, covered)[present]
                                   / size_count[present]).tolist()}}


# The per-row statistics whose bootstrap intervals the report gives: name -> f(covered,
# sizes) -> [N] non-negative integers (each statistic is the mean of its rows).
ROW_STATISTICS = {
    "coverage": lambda covered, sizes: np.asarray(covered, np.int64),
    "mean_size": lambda covered, sizes: np.asarray(sizes, np.int64),
    "singleton_share": lambda covered, sizes: (np.asarray(sizes) == 1).astype(np.int64),
    "empty_share": lambda covered, sizes: (np.asarray(sizes) == 0).astype(np.int64),
}

