"""Reliability diagrams and confidence histograms: matplotlib figures of reliability bins.

The bins are those of `metrics.reliability_bins` as lists (`edges`, `accuracy`,
`confidence`, `count`), the form the report's results.json holds. Each function returns
a `matplotlib.figure.Figure` drawn on the Agg canvas (no pyplot, no global state), which
the report saves as PNG (cpjax.calibration.report) and the run writes to TensorBoard as
an RGB image (`rgb`).
"""

from typing import Any

import numpy as np


def _figure(width: float, height: float) -> Any:
  # Heavy; imported when a figure is drawn. Figure + the Agg canvas: no pyplot state.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(width, height), dpi=100)
  FigureCanvasAgg(fig)
  return fig


def reliability_figure(bins: dict[str, list], title: str) -> Any:
  """Accuracy per confidence bin (bars), the gap to the bin's mean confidence (red) and the
  diagonal of perfect calibration."""
  fig = _figure(4, 4)
  ax = fig.subplots()
  edges = np.asarray(bins["edges"])
  width = np.diff(edges)
  accuracy = np.nan_to_num(np.asarray(bins["accuracy"], float))
  ax.bar(edges[:-1], accuracy, width, align="edge", edgecolor="black", label="accuracy")
  ax.bar(edges[:-1], np.nan_to_num(np.asarray(bins["confidence"], float)) - accuracy, width,
         bottom=accuracy, align="edge", color="red", alpha=0.3, label="gap")
  ax.plot([0, 1], [0, 1], "k--", linewidth=1)
  ax.set(xlabel="confidence", ylabel="accuracy", title=title, xlim=(0, 1), ylim=(0, 1))
  ax.legend(loc="upper left")
  fig.tight_layout()
  return fig


def histogram_figure(reliability: dict[str, dict[str, list]]) -> Any:
  """The share of samples per confidence bin, one line per scaling (e.g. before_ts)."""
  fig = _figure(5, 3.5)
  ax = fig.subplots()
  for tag, bins in reliability.items():
    count = np.asarray(bins["count"], float)
    ax.stairs(count / max(count.sum(), 1), bins["edges"], label=tag.replace("_", " "))
  ax.set(xlabel="top-label confidence", ylabel="share of test samples", xlim=(0, 1))
  ax.legend()
  fig.tight_layout()
  return fig


def rgb(fig: Any) -> np.ndarray:
  """The figure rendered by Agg: uint8 [height, width, 3]."""
  fig.canvas.draw()
  return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
