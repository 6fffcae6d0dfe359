"""Temperature scaling recovers a known temperature and flags useless fits."""

import numpy as np
import pytest

from cpjax.calibration import temperature


def _calibrated(seed, n=4000, k=10):
  """Logits z and labels drawn from softmax(z): a perfectly calibrated model."""
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(n, k)) * 2.5
  p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
  labels = (rng.uniform(size=(n, 1)) > np.cumsum(p, 1)).sum(1)
  return z, labels


@pytest.mark.parametrize("true_t", [0.5, 2.0, 3.5])
# L-BFGS on the NLL takes seconds a fit: slow; the grid methods stay in the fast set.
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m == "lbfgs_nll"
                                    else m for m in temperature.METHODS])
def test_recovers_known_temperature(true_t, method):
  z, labels = _calibrated(0)
  fit = temperature.fit_temperature(z * true_t, labels, method=method)
  assert fit.temperature == pytest.approx(true_t, rel=0.1)
  assert fit.nll_after <= fit.nll_before + 1e-9
  assert not fit.nll_rose


def test_grid_is_exact_tenths_and_ties_go_to_the_smallest():
  assert temperature.GRID[2] == 0.3 and temperature.GRID[-1] == 10.0
  assert len(temperature.GRID) == 100
  # One class: every T gives the same (zero) ECE: the first grid value wins.
  fit = temperature.fit_temperature(np.zeros((5, 1)), np.zeros(5, int), method="grid_ece")
  assert fit.temperature == 0.1


def test_nll_rise_is_flagged(caplog):
  # Six samples where the ECE grid picks T = 0.3, which sharpens the one
  # confident mistake (sample 3, label 0 against logits -3.3 / 0): NLL rises.
  z = np.array([[-1.3, -0.3], [3.3, 1.3], [-3.3, -0.0], [-1.2, 0.3], [-3.2, 0.5], [0.5, 3.2]])
  labels = np.array([1, 0, 0, 1, 1, 1])
  fit = temperature.fit_temperature(z, labels, method="grid_ece")

  def nll(t):
    logp = z / t - np.log(np.exp(z / t).sum(1, keepdims=True))
    return -logp[np.arange(6), labels].mean()
  assert fit.nll_after == pytest.approx(nll(fit.temperature))
  assert fit.nll_after > nll(1.0) and fit.nll_rose
  assert "RAISES validation NLL" in caplog.text


def test_unknown_method_is_named():
  with pytest.raises(ValueError, match="grid_ece, grid_nll, lbfgs_nll"):
    temperature.fit_temperature(np.zeros((2, 2)), np.zeros(2, int), method="platt")


@pytest.mark.parametrize("objective", ["ece", "nll"])
def test_grid_values_are_each_temperatures_metric_bit_for_bit(objective, monkeypatch):
  # The vectorised grid against the metric of each T computed alone, in blocks of any size.
  from cpjax.calibration import metrics  # pylint: disable=g-import-not-at-top
  z, labels = _calibrated(3, n=300, k=7)
  z[:5, 2] = 80.0  # Saturated rows: confidences of exactly 1.0 in float64.
  alone = [metrics.ece(metrics.softmax(z / t), labels, 15) if objective == "ece"
           else metrics.nll(z / t, labels) for t in temperature.GRID]
  for block in (None, 7 * z.size):  # All at once; 7 temperatures per block.
    if block:
      monkeypatch.setattr(temperature, "_GRID_VALUES", block)
    np.testing.assert_array_equal(temperature.grid_values(z, labels, objective, 15), alone)
