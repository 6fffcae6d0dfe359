"""A user's own module registers entries from outside the package (`config.import_modules`).

The module below is written into a temporary folder, never into cpjax: it registers a
selection policy with a setting of its own and a dataset source kind with its own prefix
that serves a small generated dataset. main.py imports it (--config.import_modules) before
it reads the config file and validates it, so its names are valid choices and its setting a
config field; the run trains on the generated data with the toy policy's subsets.
"""

import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest
from scipy import special

from cpjax import models
from cpjax.calibration import parametric, posthoc, report
from cpjax.config import schema, validation
from cpjax.data import preprocess, sources
from cpjax.selection import policies
from tests import helpers, toy_models

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
from cpjax.data import preprocess, sources, specs
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
                           local=True, test_split="test", encoded=True,
                           classes=tuple("abcd"))


def open_splits(dataset, spec):
  return {"train": GeneratedSource("train", np.arange(spec.num_train)),
          "test": GeneratedSource("test", np.arange(NUM_TEST))}


sources.KINDS.register(sources.SourceKind("toygen:", describe, open_splits,
                                          "generated 8x8 grey images (a test's)"))


def corner_box(rng, width, height, transform):
  """The top-left square of the image (no random draw)."""
  del rng, transform
  _log(event="crop", pid=os.getpid(), size=[width, height])
  side = min(width, height)
  return (0, 0, side, side)


preprocess.TRAIN_CROPS.register(preprocess.TrainCrop("toy_corner", corner_box,
                                                     "toy: the top-left square"))
_log(event="imported", pid=os.getpid())
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
             "--config.dataset.train_crop=toy_corner",
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
  # The training crop the module registered ran in the decoding worker processes, which
  # registered it from the reader's pickle (the module is imported there, not run).
  main_pid = next(c["pid"] for c in calls if c["event"] == "imported")
  crops = [c for c in calls if c["event"] == "crop"]
  assert crops and all(c["size"] == [8, 8] and c["pid"] != main_pid for c in crops)


@pytest.mark.slow  # main.py in a process of its own.
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


@pytest.mark.slow  # main.py in a process of its own.
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
    validation.validate(config)  # Raises if the name were unknown.
    assert "toy_first_k" in policies.POLICIES
    config.import_modules = "cpjax_user_policy_only, no_such_module_either"
    with pytest.raises(validation.ConfigError,
                       match="config.import_modules: cannot import module "
                             "'no_such_module_either'"):
      validation.validate(config)
  finally:
    if "toy_first_k" in policies.POLICIES:
      policies.POLICIES.unregister("toy_first_k")
    sys.modules.pop("cpjax_user_policy_only", None)


# ----------------------------------------------------------------- registered in a test


def test_a_model_registered_outside_cpjax_is_a_choice_built_by_its_constructor():
  spec = models.ModelSpec("toy_registered", toy_models.ToyNet, 8, 2, "toy: a test's model")
  with models.MODELS.registered(spec):
    config = helpers.tiny_config(**{"model.name": "toy_registered"})
    validation.validate(config)
    assert "| `toy_registered` | 8 px | x2 | toy: a test's model |" in models.markdown_table()
    x = jnp.ones((2, 8, 8, 1))
    built = models.create_model("toy_registered", 3)
    direct = toy_models.ToyNet(num_classes=3)  # What the constructor alone builds.
    key = jax.random.PRNGKey(0)
    ours, theirs = built.init(key, x, train=False), direct.init(key, x, train=False)
    np.testing.assert_array_equal(built.apply(ours, x, train=False)[0],
                                  direct.apply(theirs, x, train=False)[0])
    with pytest.raises(validation.ConfigError, match="did you mean toy_registered"):
      validation.validate(helpers.tiny_config(**{"model.name": "toy_registerd"}))
  assert "toy_registered" not in models.MODELS


def _corner(rng, width, height, transform):
  del rng, transform
  return (0, 0, width // 2, height // 2)


def test_a_training_crop_registered_outside_cpjax_crops_training_images():
  pixels = np.arange(64, dtype=np.uint8).reshape(8, 8) * 3
  data = io.BytesIO()
  Image.fromarray(pixels, "L").save(data, format="PNG")
  with preprocess.TRAIN_CROPS.registered(preprocess.TrainCrop("toy_quarter", _corner, "toy")):
    transform = preprocess.Transform(size=4, channels=1, train_crop="toy_quarter")
    out = transform(data.getvalue(), example_id=5, epoch=0)
    # The top-left 4x4 at its own size: the crop box alone decides the pixels.
    np.testing.assert_array_equal(out[..., 0], pixels[:4, :4])
    assert schema.spine_schema()["dataset.train_crop"]("toy_quarter") is None
  problem = schema.spine_schema()["dataset.train_crop"]("toy_quarter")
  assert problem == "got 'toy_quarter'; valid choices: center, random_resized"


def _prior_fit(z, y, weights, setting, start):
  """s = z + b, b_k = log of class k's smoothed frequency among the weighted rows."""
  del setting, start
  counts = np.bincount(y, weights=weights, minlength=z.shape[1])
  return parametric.Fit({"b": np.log((counts + 1) / (counts.sum() + z.shape[1]))}, True,
                        float("nan"), 0, "closed form")


def _prior_apply(params, z, xp, hyper):
  del hyper
  shifted = z + xp.asarray(params["b"])
  return shifted - jax.nn.logsumexp(shifted, axis=-1, keepdims=True) if xp is jnp else (
      special.log_softmax(shifted, axis=-1))


def test_a_posthoc_map_registered_outside_cpjax_is_fitted_applied_and_reported():
  rng = np.random.default_rng(0)
  z, y = rng.normal(size=(120, 3)), rng.choice(3, 120, p=[0.6, 0.3, 0.1])
  entry = posthoc.Map("toy_prior", "toy: a class-prior shift", _prior_fit, _prior_apply)
  with posthoc.MAPS.registered(entry):
    calibrator = posthoc.fit("toy_prior", z, y, folds=3)
    # Refitted on every row: b by hand from the class counts.
    counts = np.array([np.sum(y == k) for k in range(3)])
    np.testing.assert_allclose(calibrator.params["b"], np.log((counts + 1) / (120 + 3)))
    log_p = posthoc.apply(calibrator, z)
    np.testing.assert_allclose(log_p, special.log_softmax(z + calibrator.params["b"], axis=1))
    np.testing.assert_allclose(posthoc.apply(calibrator, z, jnp), log_p, rtol=1e-5, atol=1e-6)
    # A config may choose it, and the report fits and tables it beside cpjax's maps.
    config = helpers.tiny_config(**{"evaluation.calibrator": "toy_prior"})
    assert schema.spine_schema()["evaluation.calibrator"]("toy_prior") is None
    config.evaluation.calibrator_resamples = 0
    section, chosen = report.posthoc_table((z[:60], y[:60]), (z[60:], y[60:]), 3,
                                           config.evaluation)
    assert list(section["calibrators"]) == list(posthoc.MAPS) and section["chosen"] == "toy_prior"
    shift = _prior_fit(z[:60], y[:60], np.ones(60), None, None).params["b"]
    np.testing.assert_allclose(chosen, special.log_softmax(z[60:] + shift, axis=1))
  assert "toy_prior" not in posthoc.MAPS


def _no_describe(dataset):
  raise AssertionError("not called: the test only names datasets")


def test_a_source_kind_registered_under_a_prefix_opens_its_names_only():
  kind = sources.SourceKind("toyprefix:", _no_describe, lambda d, s: {}, "toy datasets")
  assert not sources.is_source_name("toyprefix:abc")
  with sources.KINDS.registered(kind):
    assert sources.kind_of("toyprefix:abc") is kind and sources.is_source_name("toyprefix:a")
    # The bare prefix, another prefix and the prefix's word alone are no source names.
    assert not any(sources.is_source_name(n) for n in ("toyprefix:", "toyprefi:x", "toyprefix"))
    assert sources.name_problem("toyprefix:abc") is None
    problem = sources.name_problem("toyprefx")
    assert "did you mean toyprefix:?" in problem and "toyprefix:NAME (toy datasets)" in problem
    assert "folder (with dataset.folder=DIR)" in problem and "digits" in problem
  assert not sources.is_source_name("toyprefix:abc")  # Gone with its registration.
  for bad in ("a:b", ":", "toy::", "digits", ""):
    with pytest.raises(ValueError, match=f"source kind name {bad!r}"):
      sources.SourceKind(bad, _no_describe, lambda d, s: {})
  with pytest.raises(ValueError, match="'tfds:' is already registered"):
    sources.KINDS.register(sources.SourceKind("tfds:", _no_describe, lambda d, s: {}))
