"""Runs a grid of cpjax configs in one process and summarises test accuracy and ECE.

A cell is (name, overrides); each (cell, seed) trains in its own workdir under
`out`, and a workdir whose report exists is not retrained, so a study can be
interrupted and rerun. The summary holds mean ± std over seeds of test
accuracy, ECE (15 bins, right-closed), ECE after temperature scaling, the
fitted temperature and the left-closed ECE of Tata et al. 2022, plus wall time and its
scoring / selection / training split.
"""

import json
import os
import time
from typing import Any

import ml_collections
import numpy as np

from cpjax.calibration import report
from cpjax.training import train

COLUMNS = (("accuracy", "before_ts", "accuracy"), ("ece", "before_ts", "ece"),
           ("ece_left_closed", "before_ts", "ece_left_closed"), ("ece_after_ts", "after_ts", "ece"))


def apply(config: ml_collections.ConfigDict, overrides: dict[str, Any]):
  """A copy of `config` with dotted-name overrides, type-checked by ml_collections."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.update_from_flattened_dict(overrides)
  return config


def run_cell(base, overrides: dict[str, Any], workdir: str) -> dict[str, Any]:
  """Trains one cell unless its report exists; returns its summary numbers."""
  report_path = os.path.join(workdir, "report", "results.json")
  if not os.path.exists(report_path):
    start = time.time()
    train.train_and_evaluate(apply(base, overrides), workdir)
    with open(os.path.join(workdir, "wall_seconds.txt"), "w") as f:
      f.write(str(time.time() - start))
  results = report.read_results(report_path)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    last = [json.loads(line) for line in f][-1]
  with open(os.path.join(workdir, "wall_seconds.txt")) as f:
    wall = float(f.read())
  test = results["metrics"]["test"]
  row = {name: test[tag][key] for name, tag, key in COLUMNS}
  row.update(temperature=results["temperature"]["temperature"], wall_seconds=wall,
             **{f"{p}_seconds": last[f"total_{p}_seconds"]
                for p in ("scoring", "selection", "training")})
  return row


def run_grid(base: ml_collections.ConfigDict, cells: list[tuple[str, dict[str, Any]]],
             seeds: list[int], out: str, title: str) -> None:
  """Runs every (cell, seed), then writes summary.json and summary.md to `out`."""
  os.makedirs(out, exist_ok=True)
  results = {}
  for name, overrides in cells:
    rows = []
    for seed in seeds:
      workdir = os.path.join(out, name, f"seed{seed}")
      print(f"[{time.strftime('%H:%M:%S')}] {name} seed {seed}", flush=True)
      rows.append(run_cell(base, {**overrides, "seed": seed}, workdir))
    results[name] = {key: [r[key] for r in rows] for key in rows[0]}
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump({"seeds": seeds, "cells": dict(cells), "results": results}, f, indent=1)
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(_markdown(results, seeds, title))
  print(_markdown(results, seeds, title))


def _markdown(results, seeds, title) -> str:
  keys = ("accuracy", "ece", "ece_after_ts", "temperature", "ece_left_closed", "wall_seconds",
          "scoring_seconds", "selection_seconds", "training_seconds")
  lines = [f"# {title}", "", f"Mean ± std over seeds {seeds}; test set; fractions; ECE with 15 "
           "right-closed bins (ece_left_closed: Tata et al. 2022's convention).", "",
           "| cell | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
  for name, values in results.items():
    cells = []
    for key in keys:
      v = np.asarray(values[key], float)
      cells.append(f"{v.mean():.4f} ± {v.std(ddof=1) if len(v) > 1 else 0:.4f}"
                   if not key.endswith("seconds") else f"{v.mean():.1f}")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"
