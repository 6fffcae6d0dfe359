"""The calibration report names a run's classes (folder, tfds:NAME) and their source.

The class list is written by hand here (as a run's classes.json); the numbers of a report
with it are compared with the same report written without one.
"""

import json
import os
import re

import numpy as np
import pytest

from cpjax.calibration import report, report_files
from tests.helpers import tiny_config


def _built() -> dict:
  rng = np.random.default_rng(1)
  logits, labels = rng.normal(size=(120, 25)), rng.integers(0, 25, 120)
  return report.build_report((logits, labels), (logits, labels), 25,
                             tiny_config().evaluation)


@pytest.mark.slow  # Builds a whole report (every metric, bootstrap and calibrator) twice.
def test_the_report_lists_the_classes_of_classes_json_and_keeps_its_numbers(tmp_path):
  built = _built()
  plain = report_files.write_report(str(tmp_path / "plain" / "report"), built)
  names = [f"wnid{i:02d}" for i in range(25)]
  workdir = tmp_path / "named"
  os.makedirs(workdir)
  with open(workdir / "classes.json", "w") as f:
    json.dump({"dataset": "folder", "classes": names}, f)
  named = report_files.write_report(str(workdir / "report"), built)
  with open(plain[1]) as f:
    plain_md = f.read()
  with open(named[1]) as f:
    named_md = f.read()
  # The section: source, count, the first 20 names with their label ids.
  line = next(line for line in named_md.splitlines() if line.startswith("25 classes"))
  assert line.startswith(f"25 classes of folder in label order (from {workdir}/classes.json;")
  assert "0 wnid00, 1 wnid01," in line and "19 wnid19, ... (25 in all)." in line
  assert "20 wnid20" not in line
  # The conformal sets' worst classes are named: "| 7 wnid07: 0.5000 (4) |".
  worst = re.findall(r"\| (\d+) (wnid\d\d): ", named_md)
  assert worst and all(name == names[int(label)] for label, name in worst)
  unnamed = re.sub(r"(\| \d+) wnid\d\d: ", r"\1: ", named_md)
  # Everything else, the numbers included, is the report without a class list.
  section = unnamed.index("## classes")
  end = unnamed.index("## test: bootstrap intervals")
  assert unnamed[:section] + unnamed[end:] == plain_md
  with open(plain[0]) as f:
    plain_json = json.load(f)
  with open(named[0]) as f:
    named_json = json.load(f)
  assert named_json.pop("classes") == {"dataset": "folder", "names": names,
                                       "source": str(workdir / "classes.json")}
  assert named_json == plain_json and "classes" not in plain_json
  assert "classes" not in built  # The built report is left as it was.


def _table(num_classes: int, **overrides) -> dict:
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(150, num_classes)) * 2
  labels = rng.integers(0, num_classes, 150)
  config = tiny_config(**{"evaluation.calibrator_resamples": 0,
                          "evaluation.calibrator_folds": 2,
                          **{f"evaluation.{k}": v for k, v in overrides.items()}}).evaluation
  section, _ = report.posthoc_table((logits, labels), (logits, labels), num_classes, config)
  return section


@pytest.mark.slow  # Cross-validated fits of every map, three times.
def test_maps_with_k_squared_parameters_are_skipped_above_the_cap_and_named(caplog):
  section = _table(6, calibrator_square_max_classes=5, calibrator="auto")
  reason = section["calibrators"]["dirichlet"]["skipped"]
  assert set(section["skipped"]) == {"matrix_scaling", "dirichlet"}
  assert section["calibrators"]["matrix_scaling"] == {"skipped": section["skipped"]
                                                      ["matrix_scaling"]}
  # 6^2 + 6 = 42 parameters, 9 strengths (0.01 to 1e6) x 2 folds + 1 refit = 19 fits.
  assert reason.startswith("K = 6 classes > evaluation.calibrator_square_max_classes = 5: its "
                           "42 parameters (K^2 + K) would be fitted 19 times")
  assert "vector_scaling" in section["calibrators"] and "test" in section["calibrators"][
      "vector_scaling"]
  assert section["chosen"] not in section["skipped"]
  assert sum("Post-hoc map dirichlet skipped" in r.getMessage() for r in caplog.records) == 1
  markdown = "\n".join(report_files._posthoc_markdown(section))  # pylint: disable=protected-access
  for method in ("matrix_scaling", "dirichlet"):
    assert f"- **{method} skipped**: K = 6 classes" in markdown
    assert f"| {method} |" not in markdown  # No table row of made-up numbers.
  assert json.loads(json.dumps(report_files.strict_json(section)))["skipped"] == section["skipped"]
  # At the cap, with no cap, or named as the calibrator: fitted.
  assert not _table(6, calibrator_square_max_classes=6)["skipped"]
  assert not _table(6, calibrator_square_max_classes=0)["skipped"]
  named = _table(6, calibrator_square_max_classes=5, calibrator="dirichlet")
  assert list(named["skipped"]) == ["matrix_scaling"] and named["chosen"] == "dirichlet"
