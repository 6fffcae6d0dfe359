"""Reliability diagrams, confidence histograms and conformal set sizes: matplotlib figures.

The bins are those of `metrics.reliability_bins` as lists (`edges`, `accuracy`,
`confidence`, `count`), the form the report's results.json holds. Each picture is drawn on
the Agg canvas of a `matplotlib.figure.Figure` (no pyplot, no global state) and returned as
an RGB array (`reliability_image`, `histogram_image`: the run writes them to TensorBoard at
every evaluation) or PNG bytes (`reliability_png`, `histogram_png`: the report's files).

Building a figure (its axes, ticks, bars, legend and layout) cost most of a picture's time
(~0.3 s of ~0.4 s on a 2-core CPU), at every evaluation. So each kind of figure is built
once per process and kept: a later picture of the same kind moves its bars or steps to the
new data, sets its title and lays it out again, and gives the same pixels as a figure built
afresh for the same data (tests/test_evaluation.py compares them). The kept figures are
used under one lock: one picture at a time.

The set-size histogram of the report's conformal section (`set_size_png`, `set_size_image`)
is drawn once per report: the figure of the last section drawn is kept, so the report's PNG
and its TensorBoard image of one section build it once.
"""

import io
import threading
from typing import Any

import numpy as np

_KEPT: dict[tuple, Any] = {}  # (kind, ...) -> its figure and the artists a picture updates.
_LAST: dict[tuple, np.ndarray] = {}  # (kind, data) -> the RGB of a recent picture.
LAST_PICTURES = 8  # The report's pictures (five), with room.
_LOCK = threading.Lock()


def new_figure(width: float, height: float) -> Any:
  """A figure on its own Agg canvas."""
  # Imported here: matplotlib takes about a second to import, and only the pictures need it
  # (the training path imports this module through cpjax.training.evaluation).
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  fig = Figure(figsize=(width, height), dpi=100)
  FigureCanvasAgg(fig)
  return fig


def _reliability_values(bins: dict[str, list]):
  edges = np.asarray(bins["edges"], float)
  accuracy = np.nan_to_num(np.asarray(bins["accuracy"], float))
  gap = np.nan_to_num(np.asarray(bins["confidence"], float)) - accuracy
  return edges, accuracy, gap


def _build_reliability(bins: dict[str, list], title: str) -> dict[str, Any]:
  """Accuracy per confidence bin (bars), the gap to the bin's mean confidence (red) and the
  diagonal of perfect calibration."""
  fig = new_figure(4, 4)
  ax = fig.subplots()
  edges, accuracy, gap = _reliability_values(bins)
  width = np.diff(edges)
  bars = ax.bar(edges[:-1], accuracy, width, align="edge", edgecolor="black", label="accuracy")
  gaps = ax.bar(edges[:-1], gap, width, bottom=accuracy, align="edge", color="red", alpha=0.3,
                label="gap")
  ax.plot([0, 1], [0, 1], "k--", linewidth=1)
  ax.set(xlabel="confidence", ylabel="accuracy", title=title, xlim=(0, 1), ylim=(0, 1))
  ax.legend(loc="upper left")
  fig.tight_layout()
  return {"figure": fig, "axes": ax, "bars": bars, "gaps": gaps}


def _reliability(bins: dict[str, list], title: str) -> Any:
  """The kept reliability figure for these bins' edges, showing `bins` (call under _LOCK)."""
  key = ("reliability", tuple(np.asarray(bins["edges"], float).tolist()))
  kept = _KEPT.get(key)
  if kept is None:
    kept = _KEPT[key] = _build_reliability(bins, title)
    return kept["figure"]
  _, accuracy, gap = _reliability_values(bins)
  for bar, gap_bar, height, difference in zip(kept["bars"], kept["gaps"], accuracy, gap):
    bar.set_height(height)
    gap_bar.set_y(height)
    gap_bar.set_height(difference)
  kept["axes"].set_title(title)
  kept["figure"].tight_layout()
  return kept["figure"]


def _build_histogram(reliability: dict[str, dict[str, list]]) -> dict[str, Any]:
  """The share of samples per confidence bin, one line per scaling (e.g. before_ts)."""
  fig = new_figure(5, 3.5)
  ax = fig.subplots()
  steps = [ax.stairs(*_shares(bins), label=tag.replace("_", " "))
           for tag, bins in reliability.items()]
  ax.set(xlabel="top-label confidence", ylabel="share of test samples", xlim=(0, 1))
  ax.legend()
  fig.tight_layout()
  return {"figure": fig, "axes": ax, "steps": steps}


def _shares(bins: dict[str, list]) -> tuple[np.ndarray, list]:
  count = np.asarray(bins["count"], float)
  return count / max(count.sum(), 1), bins["edges"]


def _histogram(reliability: dict[str, dict[str, list]]) -> Any:
  """The kept histogram figure for these scalings, showing `reliability` (call under _LOCK)."""
  key = ("histogram", tuple(reliability))
  kept = _KEPT.get(key)
  if kept is None:
    kept = _KEPT[key] = _build_histogram(reliability)
    return kept["figure"]
  for step, bins in zip(kept["steps"], reliability.values()):
    shares, edges = _shares(bins)
    step.set_data(shares, edges)
  kept["axes"].relim()
  kept["axes"].autoscale_view()
  kept["figure"].tight_layout()
  return kept["figure"]


def rgb(fig: Any) -> np.ndarray:
  """The figure rendered by Agg: uint8 [height, width, 3]."""
  fig.canvas.draw()
  return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def png(fig: Any) -> bytes:
  """The figure as PNG bytes: its Agg pixels (`rgb`, at the figure's 100 dpi) encoded by
  Pillow at compression level 1 (matplotlib's savefig drew the figure again: twice the time
  for the same pixels)."""
  return _encoded(rgb(fig))


def _picture(kind: str, data: Any, draw) -> np.ndarray:
  """The RGB picture of `kind` for `data` (hashable), drawn by `draw()` (a figure) unless one
  of the last LAST_PICTURES pictures was of the same kind and data: the report's PNG file and
  its TensorBoard image of one figure are drawn once (call under _LOCK)."""
  key = (kind, data)
  if key not in _LAST:
    if len(_LAST) >= LAST_PICTURES:
      del _LAST[next(iter(_LAST))]  # The oldest.
    _LAST[key] = rgb(draw())
  return _LAST[key]


def _encoded(image: np.ndarray) -> bytes:
  """RGB pixels as PNG bytes (Pillow, compression level 1)."""
  from PIL import Image  # pylint: disable=g-import-not-at-top  (as in `png`)
  out = io.BytesIO()
  Image.fromarray(image).save(out, format="png", compress_level=1)
  return out.getvalue()


def _bins_key(bins: dict[str, list]) -> tuple:
  # Bytes, not floats: an empty bin's NaN equals no other NaN, but its bytes do.
  return tuple((k, np.asarray(v, float).tobytes()) for k, v in sorted(bins.items()))


def reliability_image(bins: dict[str, list], title: str) -> np.ndarray:
  """The reliability diagram of `bins` as RGB, uint8 [400, 400, 3]."""
  with _LOCK:
    return _picture("reliability", (title, _bins_key(bins)),
                    lambda: _reliability(bins, title)).copy()


def reliability_png(bins: dict[str, list], title: str) -> bytes:
  """The reliability diagram of `bins` as PNG bytes."""
  return _encoded(reliability_image(bins, title))


def histogram_image(reliability: dict[str, dict[str, list]]) -> np.ndarray:
  """The confidence histogram of each scaling's bins as RGB, uint8 [350, 500, 3]."""
  with _LOCK:
    return _picture("histogram", tuple((t, _bins_key(b)) for t, b in reliability.items()),
                    lambda: _histogram(reliability)).copy()


def histogram_png(reliability: dict[str, dict[str, list]]) -> bytes:
  """The confidence histogram of each scaling's bins as PNG bytes."""
  return _encoded(histogram_image(reliability))


def _set_size_shares(section: dict[str, Any]) -> tuple[str, list[tuple[str, np.ndarray]]]:
  """(the first alpha's key, [(label, share of test rows at each set size 0..max)]) of a
  report's conformal section: each score before and after the chosen map."""
  key = repr(float(section["alphas"][0]))
  lines = []
  for name in section["scores"]:
    for tag, by_name in section["sets"].items():
      by_size = by_name[name][key]["test"]["by_size"]
      rows = np.zeros(max(by_size["size"]) + 1)
      rows[by_size["size"]] = by_size["rows"]
      lines.append((f"{name}, {tag}", rows / rows.sum()))
  return key, lines


def _set_sizes(section: dict[str, Any]) -> Any:
  """The set-size figure of `section`: the one kept where it is of the same data (call under
  _LOCK)."""
  key, lines = _set_size_shares(section)
  data = (key, tuple((label, tuple(shares)) for label, shares in lines))
  kept = _KEPT.get(("set_sizes",))
  if kept is not None and kept["data"] == data:
    return kept["figure"]
  fig = new_figure(5, 3.5)
  ax = fig.subplots()
  for index, (label, shares) in enumerate(lines):
    ax.stairs(shares, np.arange(len(shares) + 1) - 0.5, label=label, color=f"C{index // 2}",
              linestyle="-" if index % 2 else "--")
  ax.set(xlabel="set size", ylabel="share of test rows", title=f"test sets, alpha = {key}",
         xlim=(-0.5, max(len(shares) for _, shares in lines) - 0.5))
  ax.legend(fontsize="small")
  fig.tight_layout()
  _KEPT[("set_sizes",)] = {"figure": fig, "data": data}
  return fig


def set_size_image(section: dict[str, Any]) -> np.ndarray:
  """The conformal section's set-size histogram (its first alpha) as RGB, uint8
  [350, 500, 3]."""
  key, lines = _set_size_shares(section)
  with _LOCK:
    return _picture("set_sizes", (key, tuple((label, tuple(shares)) for label, shares in lines)),
                    lambda: _set_sizes(section)).copy()


def set_size_png(section: dict[str, Any]) -> bytes:
  """The conformal section's set-size histogram (its first alpha) as PNG bytes."""
  return _encoded(set_size_image(section))
