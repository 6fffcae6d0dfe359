"""A user's own module registers entries from outside the package (`config.import_modules`).

The module below is written into a temporary folder, never into cpjax: it registers a
selection policy with a setting of its own and a dataset source kind with its own prefix
that serves a small generated dataset. main.py imports it (--config.import_modules) before
it reads the config file and validates it, so its names are valid choices and its setting a
config field; the run trains on the generated data with the toy policy's subsets.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cpjax import config_validation
from cpjax.selection import policies
from tests import helpers

MODULE = "cpjax_user_ext"
NUM_EXAMPLES, NUM_CLASSES, NUM_TEST = 240, 4, 64  # The generated dataset: train and test.

# A user's module: it logs what cpjax asks of it (one JSON line per call) to $USER_EXT_LOG.
USER_MODULE = r'''
"""Generated data (label = id % 4, grey level by class, seeded noise) and a toy policy."""
import io
import json
import os

import numpy as np
from PIL import Image

from cpjax import registry
from cpjax.data import sources, specs
from cpjax.selection import policies

NUM_EXAMPLES, NUM_CLASSES, NUM_TEST = 240, 4, 64


def _log(**record):
  with open(os.environ["USER_EXT_LOG"], "a") as f:
    f.write(json.dumps(record) + "\n")


def every_nth(request, toy_stride):
  """Ids at positions (epoch + j * toy_stride) mod N, j = 0 .. k-1."""
  positions = (request.epoch + toy_stride * np.arange(request.k)) % len(request.ids)
  chosen = request.ids[positions]
  _log(event="select", epoch=request.epoch, ids=request.ids.tolist(), k=request.k,
       chosen=chosen.tolist())
  return chosen


policies.POLICIES.register(policies.Policy(
    "toy_every_nth", every_nth, "toy: every n-th id",
    settings=(registry.Setting("toy_stride", 3, registry.integer(1), "toy: the stride"),),
    needs_scores=False))


def _png(example_id, split):
  rng = np.random.default_rng([example_id, split == "test"])
  level = 40 + 60 * (example_id % NUM_CLASSES)
  pixels = np.clip(level + rng.integers(-20, 21, (8, 8)), 0, 255).astype(np.uint8)
  out = io.BytesIO()
  Image.fromarray(pixels, "L").save(out, format="PNG")
  return out.getvalue()


class GeneratedSource:
  encoded = True

  def __init__(self, split, ids):
    self.split, self.ids = split, np.asarray(ids, np.int32)
    self.labels = (self.ids % NUM_CLASSES).astype(np.int32)

  def __len__(self):
    return len(self.ids)

  def take(self, rows):
    return GeneratedSource(self.split, self.ids[rows])

  def read(self, rows):
    ids = self.ids[np.asarray(rows)]
    _log(event="read", split=self.split, ids=ids.tolist())
    return [_png(int(i), self.split) for i in ids]


def describe(dataset):
  _log(event="describe", name=dataset.name)
  return specs.DatasetSpec("", (8, 8, 1), NUM_CLASSES, NUM_EXAMPLES, (0.4,), (0.3,),
                           local=True, test_split="test", host_stage=True,
                           classes=tuple("abcd"))


def open_splits(dataset, spec):
  return {"train": GeneratedSource("train", np.arange(spec.num_train)),
          "test": GeneratedSource("test", np.arange(NUM_TEST))}


sources.KINDS.register(sources.SourceKind("toygen:", describe, open_splits,
                                          "generated 8x8 grey images (a test's)"))
'''


def _user_module(tmp_path) -> tuple[str, dict[str, str]]:
  """The module written into tmp_path/ext; the environment that finds it and its log."""
  folder = tmp_path / "ext"
  folder.mkdir()
  (folder / f"{MODULE}.py").write_text(USER_MODULE)
  log = str(tmp_path / "calls.jsonl")
  env = helpers.subprocess_env(PYTHONPATH=os.pathsep.join(
      [str(folder), helpers.REPO, os.environ.get("PYTHONPATH", "")]), USER_EXT_LOG=log)
  return log, env


def _calls(log: str) -> list[dict]:
  with open(log) as f:
    return [json.loads(line) for line in f]


RUN_FLAGS = ("--config.dataset.name=toygen:small", "--config.selection.method=toy_every_nth",
             "--config.selection.toy_stride=7", "--config.selection.warmup_epochs=1",
             "--config.selection.fraction=0.25", "--config.num_epochs=2",
             "--config.dataset.val_size=40", "--config.dataset.crop_padding=0",
             "--config.evaluation.ood=", "--config.evaluation.calibrator_resamples=0",
             "--config.dataset.worker_kind=process", "--config.dataset.num_workers=2")


@pytest.mark.slow
def test_a_users_module_registers_a_policy_and_a_source_that_a_run_trains_with(tmp_path):
  log, env = _user_module(tmp_path)
  workdir = str(tmp_path / "run")
  result = subprocess.run(
      helpers.main_command(workdir, f"--config.import_modules={MODULE}", *RUN_FLAGS),
      cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  calls = _calls(log)
  assert {"event": "describe", "name": "toygen:small"} in calls
  # The toy policy chose epoch 1's subset (after the one warm-up epoch), with the stride the
  # command line set: the rule applied by hand to the ids it was given.
  selects = [c for c in calls if c["event"] == "select"]
  assert [c["epoch"] for c in selects] == [1]
  select = selects[0]
  ids = select["ids"]
  # 240 - 40 validation rows; k = 0.25 of them; stride 7 is prime to 200: k distinct ids.
  assert len(ids) == NUM_EXAMPLES - 40 and select["k"] == (NUM_EXAMPLES - 40) // 4
  expected = [ids[(1 + 7 * j) % len(ids)] for j in range(select["k"])]
  assert select["chosen"] == expected and len(set(expected)) == select["k"]
  # The run trained on those rows: its recorded class counts are theirs (label = id % 4),
  # and every chosen row was read from the generated source.
  records = helpers.read_metrics(workdir)
  epoch1 = next(r for r in records if r.get("epoch") == 1 and "subset_class_counts" in r)
  assert epoch1["subset_class_counts"] == np.bincount(
      np.array(expected) % NUM_CLASSES, minlength=NUM_CLASSES).tolist()
  read_train = {i for c in calls if c["event"] == "read" and c["split"] == "train"
                for i in c["ids"]}
  assert set(expected) <= read_train
  read_test = {i for c in calls if c["event"] == "read" and c["split"] == "test"
               for i in c["ids"]}
  assert read_test == set(range(NUM_TEST))  # Evaluated on the generated test split.
  final = [r for r in records if "test_accuracy" in r]
  assert final and 0.0 <= final[-1]["test_accuracy"] <= 1.0


def test_a_module_that_cannot_be_imported_is_named_before_anything_runs(tmp_path):
  _, env = _user_module(tmp_path)
  workdir = str(tmp_path / "run")
  for modules, named in (("no_such_user_module", "cannot import module 'no_such_user_module'"),
                         (f"{MODULE},bad name", "'bad name' is not a module name")):
    result = subprocess.run(
        helpers.main_command(workdir, f"--config.import_modules={modules}"),
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in result.stderr
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


def test_without_the_module_its_names_are_not_choices(tmp_path):
  """The same names without --config.import_modules: refused, with the valid choices."""
  _, env = _user_module(tmp_path)
  result = subprocess.run(
      helpers.main_command(str(tmp_path / "run"), "--config.dataset.name=toygen:small",
                           "--config.selection.method=toy_every_nth"),
      cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 2
  assert "config.dataset.name: got 'toygen:small'" in result.stderr
  assert "config.selection.method: got 'toy_every_nth'" in result.stderr


def test_the_config_field_imports_modules_in_library_use(tmp_path, monkeypatch):
  """train_and_evaluate's validation imports config.import_modules itself (no main.py)."""
  folder = tmp_path / "ext"
  folder.mkdir()
  (folder / "cpjax_user_policy_only.py").write_text(
      "from cpjax.selection import policies\n"
      "policies.POLICIES.register(policies.Policy('toy_first_k', lambda r: r.ids[:r.k], "
      "'toy: the first k ids', needs_scores=False))\n")
  monkeypatch.syspath_prepend(str(folder))
  try:
    config = helpers.tiny_config(**{"selection.method": "toy_first_k",
                                    "selection.warmup_epochs": 1,
                                    "import_modules": "cpjax_user_policy_only"})
    config_validation.validate(config)  # Raises if the name were unknown.
    assert "toy_first_k" in policies.POLICIES
    config.import_modules = "cpjax_user_policy_only, no_such_module_either"
    with pytest.raises(config_validation.ConfigError,
                       match="config.import_modules: cannot import module "
                             "'no_such_module_either'"):
      config_validation.validate(config)
  finally:
    if "toy_first_k" in policies.POLICIES:
      policies.POLICIES.unregister("toy_first_k")
    sys.modules.pop("cpjax_user_policy_only", None)
