"""Selection budgets: the share of full data's example passes a run trains, and the kept
fraction that spends a given share (`config.selection.budget`).

A run of E epochs over N training rows trains all N rows in an epoch that does not select
(the warm-up epochs, the final full epochs) and k_e rows in a selected epoch e
(`api.Selection.k_at`: k_e = round(f_e N), at least 1, where f_e is the kept fraction of
epoch e, `policies.fraction_at`: the fraction f, or f moving linearly to `fraction_end`). Its
example passes are P(f) = sum_e rows_e and its share of full data's is P(f) / (E N). Every
f_e grows with f, so P is a nondecreasing step function of f, and the fraction that spends a
budget b is found by bisection: the one whose passes are nearest b E N (a tie goes to the
fewer passes), written with the fewest decimals that reach those passes. Each selected epoch
trains a whole number of rows, so P moves in steps of at most one row per selected epoch:
the nearest passes lie within S / 2 rows of b E N for S selected epochs, within one batch
wherever S <= 2 B.

The policies of size "fixed" and "constant" (`policies.Policy.size`) train exactly k_e rows,
so their passes are P(f); "expected" (importance sampling) trains k_e rows in expectation, so
P(f) is its expected passes; "free" (full, infobatch) decides its own sizes and takes no
budget.
"""

import math
from typing import NamedTuple

from cpjax.selection import policies

# The sizes whose passes a kept fraction sets: exactly, or in expectation ("expected").
BUDGET_SIZES = ("fixed", "constant", "expected")
_SMALLEST_FRACTION = 1e-15  # Stands for f -> 0+: every selected epoch at its least size.
_MOST_DECIMALS = 12  # The fraction's decimals: a fraction with more is not searched for.


class Schedule(NamedTuple):
  """What sets a selecting run's example passes besides its kept fraction."""
  num_rows: int  # N, the training examples.
  num_epochs: int  # E.
  warmup_epochs: int  # The first epochs, on all rows.
  final_full_epochs: int = 0  # The last epochs, on all rows.
  fraction_end: float = -1.0  # >= 0: the fraction moves linearly to this; < 0: constant.

  @property
  def selected(self) -> range:
    """The selected epochs (`api.Selection.selecting` of a policy other than full)."""
    return range(self.warmup_epochs, self.num_epochs - self.final_full_epochs)

  @property
  def full_passes(self) -> int:
    """Full data's example passes: E N."""
    return self.num_epochs * self.num_rows


def takes_budget(method: str) -> bool:
  """Whether `method`'s epoch sizes follow a kept fraction, so that a budget sets them."""
  return policies.POLICIES[method].size in BUDGET_SIZES


def budget_methods() -> list[str]:
  """The registered policies that take a budget."""
  return [p.name for p in policies.POLICIES.entries() if p.size in BUDGET_SIZES]


def rows_per_epoch(schedule: Schedule, fraction: float) -> list[int]:
  """The rows each epoch trains at kept `fraction` (`api.Selection`'s k_at, or all N)."""
  last_selected = schedule.selected.stop - 1
  return [policies.subset_size(policies.fraction_at(
              fraction, schedule.fraction_end, epoch, schedule.warmup_epochs, last_selected),
              0, schedule.num_rows)
          if epoch in schedule.selected else schedule.num_rows
          for epoch in range(schedule.num_epochs)]


def passes(schedule: Schedule, fraction: float) -> int:
  """P(f): the example passes of the whole run at kept `fraction`."""
  return sum(rows_per_epoch(schedule, fraction))


def pass_share(schedule: Schedule, fraction: float) -> float:
  """P(f) / (E N): the run's share of full data's example passes."""
  return passes(schedule, fraction) / schedule.full_passes


def reachable(schedule: Schedule) -> tuple[float, float]:
  """The least and the most share of full data's passes a kept fraction in (0, 1] gives."""
  return (pass_share(schedule, _SMALLEST_FRACTION), pass_share(schedule, 1.0))


def range_text(schedule: Schedule) -> str:
  """'0.3336 to 1', the reachable shares as a message names them: the least rounded up and
  the most rounded down to 4 decimals, so that both ends printed are reachable."""
  low, high = reachable(schedule)
  return f"{math.ceil(low * 1e4) / 1e4:g} to {math.floor(high * 1e4) / 1e4:g}"


def fraction_for_budget(schedule: Schedule, budget: float) -> float:
  """The kept fraction whose passes are nearest `budget` E N (ties: the fewer passes), with
  the fewest decimals that reach them.

  Raises:
    ValueError: `budget` outside the shares the schedule reaches (`reachable`), or a schedule
      with no selected epoch; the message names the reachable range.
  """
  if not schedule.selected:
    raise ValueError(f"the schedule selects in none of its {schedule.num_epochs} epochs")
  low, high = reachable(schedule)
  if not low <= budget <= high:
    raise ValueError(f"the schedule reaches {range_text(schedule)} of full data's passes")
  target = budget * schedule.full_passes
  nearest = min((f for f in _around(schedule, target) if f is not None),
                key=lambda f: (abs(passes(schedule, f) - target), passes(schedule, f)))
  return _shortest_fraction(schedule, passes(schedule, nearest), nearest)


def _around(schedule: Schedule, target: float) -> tuple[float | None, float]:
  """(a fraction whose passes are the largest below `target`, or None where none is below;
  the least fraction, to float precision, whose passes reach it)."""
  low, high = _SMALLEST_FRACTION, 1.0
  if passes(schedule, low) >= target:
    return None, low
  for _ in range(200):  # Halves [low, high) until the two are adjacent floats.
    middle = (low + high) / 2
    if middle in (low, high):
      break
    low, high = (low, middle) if passes(schedule, middle) >= target else (middle, high)
  return low, high


def _shortest_fraction(schedule: Schedule, best: int, fallback: float) -> float:
  """The fraction with the fewest decimals whose passes are `best` (`fallback` reaches them:
  it is returned where no fraction of up to _MOST_DECIMALS decimals does)."""
  for decimals in range(1, _MOST_DECIMALS + 1):
    scale = 10 ** decimals
    low, high = 1, scale  # The least i with P(i / scale) >= best, by bisection on i.
    while low < high:
      middle = (low + high) // 2
      low, high = (low, middle) if passes(schedule, middle / scale) >= best else (middle + 1,
                                                                                  high)
    if passes(schedule, low / scale) == best:
      return low / scale
  return fallback


def plan_text(schedule: Schedule, method: str) -> str:
  """The schedule and the policy's size rule, for the start-up log, e.g. '1 warm-up epoch and
  2 final full epochs of 20 on all 54,000 rows, top_k's fixed size'."""
  full = [f"{n} {what} epoch{'s' * (n != 1)}" for n, what in (
      (schedule.warmup_epochs, "warm-up"), (schedule.final_full_epochs, "final full")) if n]
  epochs = (f"{' and '.join(full)} of {schedule.num_epochs} on all {schedule.num_rows:,} rows"
            if full else f"all {schedule.num_epochs} epochs selecting from "
            f"{schedule.num_rows:,} rows")
  moving = (f", the fraction moving to {schedule.fraction_end:g} by the last selected epoch"
            if schedule.fraction_end >= 0 else "")
  size = policies.POLICIES[method].size
  rule = (f"{method}'s size in expectation (k rows expected in each selected epoch)"
          if size == "expected" else f"{method}'s {size} size")
  return f"{epochs}{moving}, {rule}"


def passes_text(schedule: Schedule, fraction: float) -> str:
  """'618,871 of 1,080,000 example passes, 57.30 % of full data's': what `fraction` spends."""
  total = passes(schedule, fraction)
  return (f"{total:,} of {schedule.full_passes:,} example passes, "
          f"{100 * total / schedule.full_passes:.2f} % of full data's")
