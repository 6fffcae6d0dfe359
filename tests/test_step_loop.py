"""The step loop's metric windows: folded epoch sums against a NumPy reference, and the
window's padded length for a `log_every_steps` beyond any epoch."""

import numpy as np
import pytest

from cpjax.training import step_loop


def _step(rng: np.random.Generator, bad: int) -> tuple[dict, dict]:
  count = np.int32(rng.integers(5, 9))
  metrics = {"loss_sum": np.float32(rng.uniform(1, 5) * count), "correct": np.int32(3),
             "count": count, "first_bad_step": np.int32(bad),
             "grad_norm": np.float32(rng.uniform(0, 2)), "param_norm": np.float32(1.0)}
  return metrics, {"loss": rng.normal(size=4).astype(np.float32)}


@pytest.mark.parametrize("real,length", [(7, 10), (1, 1), (3, 3), (1, 6)])
def test_a_padded_window_folds_only_its_real_steps_in_order(real, length):
  rng = np.random.default_rng(real * 31 + length)
  window = [_step(rng, bad=100 - j) for j in range(real)]
  totals, stacked, (outputs, counted) = step_loop._fold(None, window, length)  # pylint: disable=protected-access
  mean_losses = [m["loss_sum"] / m["count"] for m, _ in window]
  loss_sum = window[0][0]["loss_sum"]
  for m, _ in window[1:]:  # float32, one addition after another, as the fold documents.
    loss_sum = np.float32(loss_sum + m["loss_sum"])
  assert counted == real
  assert float(totals["loss_sum"]) == float(loss_sum)
  assert int(totals["count"]) == sum(int(m["count"]) for m, _ in window)
  assert int(totals["correct"]) == 3 * real
  assert int(totals["first_bad_step"]) == 100 - (real - 1)
  np.testing.assert_allclose(float(totals["loss_min"]), min(mean_losses), rtol=1e-6)
  np.testing.assert_allclose(float(totals["loss_max"]), max(mean_losses), rtol=1e-6)
  assert float(totals["grad_norm_max"]) == max(float(m["grad_norm"]) for m, _ in window)
  assert stacked["loss_sum"].shape == (length,) and outputs["loss"].shape == (length, 4)
  np.testing.assert_array_equal(np.asarray(outputs["loss"])[:real],
                                np.stack([o["loss"] for _, o in window]))


def test_a_later_window_adds_to_the_epochs_totals():
  rng = np.random.default_rng(5)
  first, second = [_step(rng, 50) for _ in range(4)], [_step(rng, 50) for _ in range(2)]
  totals = step_loop._fold(None, first, 4)[0]  # pylint: disable=protected-access
  totals = step_loop._fold(totals, second, 4)[0]  # pylint: disable=protected-access
  assert int(totals["count"]) == sum(int(m["count"]) for m, _ in first + second)


@pytest.mark.parametrize("log_every,epochs,expected", [
    (10, (40, 40), 10),        # Shorter than an epoch: log_every itself.
    (10**6, (40, 12), 40),     # Longer: the longest epoch (a window never spans two).
    (50, (7,), 7),
    (3, (), 1)])
def test_the_window_is_never_longer_than_the_longest_epoch(log_every, epochs, expected):
  assert step_loop.window_steps(log_every, epochs) == expected
