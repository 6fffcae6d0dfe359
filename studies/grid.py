"""Runs a grid of cpjax configs in one process and summarises test accuracy and ECE.

A cell is (name, overrides); each (cell, seed) trains in its own workdir under
`out`, and a workdir whose report exists is not retrained, so a study can be
interrupted and rerun. The summary holds mean ± std over seeds of test
accuracy, ECE (15 bins, right-closed), ECE after temperature scaling, the
fitted temperature and the left-closed ECE of Tata et al. 2022, plus wall time and its
scoring / selection / training split.
"""

import collections
import json
import os
import time
from typing import Any

import ml_collections
import numpy as np

from cpjax.calibration import report_files
from cpjax.runtime import provenance
from cpjax.training import train

COLUMNS = (("accuracy", "before_ts", "accuracy"), ("ece", "before_ts", "ece"),
           ("ece_left_closed", "before_ts", "ece_left_closed"), ("ece_after_ts", "after_ts", "ece"))


def apply(config: ml_collections.ConfigDict, overrides: dict[str, Any]):
  """A copy of `config` with dotted-name overrides, type-checked by ml_collections."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.update_from_flattened_dict(overrides)
  return config


def run_cell(base, overrides: dict[str, Any], workdir: str) -> dict[str, Any]:
  """Trains one cell unless its report exists; returns its summary numbers, with the
  provenance of the run's sittings (`run_provenance`) and whether the row was rebuilt from a
  run folder trained before (by another process, perhaps on another machine)."""
  report_path = os.path.join(workdir, "report", "results.json")
  rebuilt = os.path.exists(report_path)
  if not rebuilt:
    start = time.time()
    train.train_and_evaluate(apply(base, overrides), workdir)
    with open(os.path.join(workdir, "wall_seconds.txt"), "w") as f:
      f.write(str(time.time() - start))
  results = report_files.read_results(report_path)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    last = [json.loads(line) for line in f][-1]
  with open(os.path.join(workdir, "wall_seconds.txt")) as f:
    wall = float(f.read())
  test = results["metrics"]["test"]
  row = {name: test[tag][key] for name, tag, key in COLUMNS}
  row.update(temperature=results["temperature"]["temperature"], wall_seconds=wall,
             **{f"{p}_seconds": last[f"total_{p}_seconds"]
                for p in ("scoring", "selection", "training")},
             provenance=run_provenance(workdir), rebuilt_from_run_folder=rebuilt)
  return row


def run_provenance(workdir: str) -> list[dict[str, Any]]:
  """The provenance of each sitting of the run in `workdir` (cpjax.runtime.provenance), in
  order, each once: the first metrics.jsonl record of every sitting holds its own and
  results.json the report's sitting's. [] for a run made before records held one."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    found = [r["provenance"] for r in map(json.loads, f) if "provenance" in r]
  with open(os.path.join(workdir, "report", "results.json")) as f:
    reported = json.load(f).get("provenance")
  found += [reported] if reported else []
  return [p for i, p in enumerate(found) if p not in found[:i]]


def code_versions_line(results: dict[str, dict[str, list]]) -> str:
  """The code versions of a study's records, with how many runs each made (a resumed run may
  name several), the runs whose records hold none, and how many of the records that say were
  rebuilt from run folders; `results`: per arm or cell, its runs' rows as lists by key
  (`provenance`, `rebuilt_from_run_folder`)."""
  versions, unrecorded, rebuilt, known = collections.Counter(), 0, 0, 0
  for entry in results.values():
    origins = entry.get("provenance", [])
    unrecorded += len(entry.get("accuracy", [])) - sum(1 for sittings in origins if sittings)
    rebuilt += sum(entry.get("rebuilt_from_run_folder", []))
    known += len(entry.get("rebuilt_from_run_folder", []))
    for sittings in origins:
      versions.update({provenance.code_text(p.get("code")) for p in sittings})
  named = [f"`{version}` ({n} run{'s' * (n != 1)})" for version, n in sorted(versions.items())]
  if unrecorded:
    named.append(f"not recorded (the records of {unrecorded} run{'s' * (unrecorded != 1)} hold "
                 "no provenance)")
  line = f"Code versions of the records: {'; '.join(named) or 'none'}."
  if known:
    line += f" Rebuilt from run folders trained before: {rebuilt} of {known} records."
  return line


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
           code_versions_line(results), "",
           "| cell | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
  for name, values in results.items():
    cells = []
    for key in keys:
      v = np.asarray(values[key], float)
      cells.append(f"{v.mean():.4f} ± {v.std(ddof=1) if len(v) > 1 else 0:.4f}"
                   if not key.endswith("seconds") else f"{v.mean():.1f}")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"
